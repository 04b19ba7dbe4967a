//! What flows back to the upload service: each message's result, and each batch's completion
//! event, published with confirms on a channel of their own.
//!
//! - a result goes to the topic exchange `<q>.results` with routing key `result.<outcome>`
//!   (dropped by the broker when no queue is bound: a fan-out for whoever listens), and, when
//!   the message has a `reply_to`, to that queue through the default exchange with the
//!   message's `correlation_id` (RabbitMQ's RPC convention). A reply no queue takes (the queue
//!   is gone) is counted and logged, never retried: the exchange's copy still goes out. A
//!   `reply_to` naming one of turnstile's own queues (`<q>`, `<q>.…`) or one named like
//!   another deployment's is refused (see [`Topology::refuses_reply_to`]): counted, logged at
//!   most once a minute, and the exchange's copy still goes out.
//! - a batch's completion event goes to `<q>.results` with routing key `batch.completed`.
//!
//! The channel is this module's own: a results exchange deleted at runtime makes the broker
//! close the channel that published to it (404), which must not be the channel that moves
//! messages through the ladder. A failed publish reopens the channel and declares the exchange
//! again before it reports the error; the caller retries.
//!
//! Replies go out on channels of their own ([`REPLY_CHANNELS`]), one reply in flight on each:
//! lapin hands a returned (unroutable) message to whichever confirm of its channel completes
//! next, so a reply sharing a channel with other publishes in flight could have its return
//! taken by another publish (which would then fail and be sent again) and pass as delivered
//! itself, uncounted. The results channel carries no mandatory publish, so no return.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use lapin::options::ExchangeDeclareOptions;
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ExchangeKind};

use super::{PublishError, Publisher, ReplyRefusal, Routing, Topology};

/// The routing key of a batch's completion event.
pub const BATCH_COMPLETED: &str = "batch.completed";

/// Where a message asked its result to go besides the results exchange: its `reply_to`, unless
/// that names a queue a reply must not reach (see [`Topology::refuses_reply_to`]), and its
/// `correlation_id`. Built only from a delivery and the topology ([`ReplyTo::of`]), so a reply
/// can only go where the topology allows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplyTo {
    queue: Option<ReplyQueue>,
    pub correlation_id: Option<ShortString>,
}

/// A message's `reply_to`, allowed or refused.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ReplyQueue {
    /// The reply goes there.
    To(ShortString),
    /// The reply is refused: the result goes only to the results exchange.
    Refused(ShortString, ReplyRefusal),
}

impl ReplyTo {
    /// A delivery's `reply_to` (an empty one is none), checked against `topology`, and its
    /// `correlation_id`.
    pub fn of(properties: &BasicProperties, topology: &Topology) -> Self {
        let queue = properties
            .reply_to()
            .clone()
            .filter(|q| !q.as_str().is_empty())
            .map(|q| match topology.refuses_reply_to(q.as_str()) {
                Some(refusal) => ReplyQueue::Refused(q, refusal),
                None => ReplyQueue::To(q),
            });
        Self {
            queue,
            correlation_id: properties.correlation_id().clone(),
        }
    }

    /// The queue the reply goes to, if any.
    pub fn queue(&self) -> Option<&str> {
        match &self.queue {
            Some(ReplyQueue::To(queue)) => Some(queue.as_str()),
            _ => None,
        }
    }

    /// The `reply_to` refused, and why, if it was.
    pub fn refused(&self) -> Option<(&str, ReplyRefusal)> {
        match &self.queue {
            Some(ReplyQueue::Refused(queue, refusal)) => Some((queue.as_str(), *refusal)),
            _ => None,
        }
    }
}

/// How often a refused `reply_to` is logged, at most, for each reason (each is counted).
const REFUSALS_LOGGED_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Counts a refused reply in `turnstile_replies_refused_total{reason}` and logs it: the first
/// of each reason at once, then at most one line per reason every [`REFUSALS_LOGGED_EVERY`]
/// (with how many were refused since the last line), so a producer setting it on every message
/// floods nothing.
fn refused(queue: &str, refusal: ReplyRefusal) {
    use std::collections::HashMap;
    use std::time::Instant;
    static LOGGED: std::sync::Mutex<Option<HashMap<ReplyRefusal, (Instant, u64)>>> =
        std::sync::Mutex::new(None);
    metrics::counter!("turnstile_replies_refused_total", "reason" => refusal.label()).increment(1);
    let now = Instant::now();
    let mut logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner());
    let last = logged.get_or_insert_default().entry(refusal);
    let unlogged = match last {
        std::collections::hash_map::Entry::Vacant(first) => {
            first.insert((now, 0));
            Some(0)
        }
        std::collections::hash_map::Entry::Occupied(mut seen) => {
            let (at, since) = seen.get_mut();
            *since += 1;
            if now.duration_since(*at) >= REFUSALS_LOGGED_EVERY {
                let unlogged = *since - 1;
                *seen.get_mut() = (now, 0);
                Some(unlogged)
            } else {
                None
            }
        }
    };
    drop(logged);
    if let Some(unlogged) = unlogged {
        let why = match refusal {
            ReplyRefusal::OwnQueue => "it names one of this replica's own queues",
            ReplyRefusal::TurnstileQueue => {
                "it is named as another turnstile deployment names its queues (….ready, ….dead, ….wait.<k>)"
            }
        };
        tracing::warn!(
            reply_to = queue,
            reason = refusal.label(),
            refused_unlogged = unlogged,
            "a message's reply_to was refused: {why}; its result went only to the results exchange"
        );
    }
}

/// Where a worker's results go (a test can fake it): [`Results`] publishes them to the broker.
pub trait ResultSink: Send + Sync {
    /// Publishes a message's result (see [`Results::publish_result`]).
    fn publish_result<'a>(
        &'a self,
        outcome: &'a str,
        message_id: Option<&'a str>,
        body: &'a [u8],
        reply: &'a ReplyTo,
    ) -> futures::future::BoxFuture<'a, Result<bool, PublishError>>;

    /// Publishes a batch's completion event (see [`Results::publish_event`]).
    fn publish_event<'a>(
        &'a self,
        batch_id: &'a str,
        body: &'a [u8],
    ) -> futures::future::BoxFuture<'a, Result<(), PublishError>>;
}

impl ResultSink for Results {
    fn publish_result<'a>(
        &'a self,
        outcome: &'a str,
        message_id: Option<&'a str>,
        body: &'a [u8],
        reply: &'a ReplyTo,
    ) -> futures::future::BoxFuture<'a, Result<bool, PublishError>> {
        futures::FutureExt::boxed(Results::publish_result(
            self, outcome, message_id, body, reply,
        ))
    }

    fn publish_event<'a>(
        &'a self,
        batch_id: &'a str,
        body: &'a [u8],
    ) -> futures::future::BoxFuture<'a, Result<(), PublishError>> {
        futures::FutureExt::boxed(Results::publish_event(self, batch_id, body))
    }
}

/// How many replies one broker connection's results publish at once, each alone on a channel
/// of its own (opened at its first reply).
pub const REPLY_CHANNELS: usize = 8;

/// The results exchange and the confirming channel results go out on, and the channels replies
/// go out on; one per broker connection. Cheap to clone (shared).
#[derive(Clone)]
pub struct Results {
    connection: Arc<Connection>,
    exchange: Arc<str>,
    channel: Arc<tokio::sync::Mutex<Publisher>>,
    /// The reply channels, each held for the whole of one reply (publish and confirm).
    replies: Arc<[tokio::sync::Mutex<Option<Publisher>>]>,
    next_reply: Arc<AtomicUsize>,
}

impl Results {
    /// Opens the results' channel on `connection` and declares `exchange` (a durable topic
    /// exchange).
    pub async fn open(connection: Arc<Connection>, exchange: &str) -> anyhow::Result<Self> {
        let channel = open_channel(&connection, exchange).await?;
        Ok(Self {
            connection,
            exchange: exchange.into(),
            channel: Arc::new(tokio::sync::Mutex::new(channel)),
            replies: (0..REPLY_CHANNELS)
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            next_reply: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Publishes a message's result (JSON `body`) to the results exchange with routing key
    /// `result.<outcome>`, and to `reply`'s queue when there is one, both confirmed. `Ok(false)`
    /// when the reply found no queue (counted and logged; the exchange's copy went out).
    pub async fn publish_result(
        &self,
        outcome: &str,
        message_id: Option<&str>,
        body: &[u8],
        reply: &ReplyTo,
    ) -> Result<bool, PublishError> {
        let mut properties = properties(message_id, "turnstile.result");
        if let Some(correlation) = &reply.correlation_id {
            properties = properties.with_correlation_id(correlation.clone());
        }
        let channel = self.channel.lock().await.clone();
        let key = format!("result.{outcome}");
        let to_exchange = channel.publish_to(
            &self.exchange,
            &key,
            body,
            properties.clone(),
            Routing::Optional,
        );
        let to_reply = async {
            match reply.queue() {
                Some(queue) => self.reply(queue, body, properties.clone()).await,
                None => Ok(()),
            }
        };
        let (exchange, replied) = tokio::join!(to_exchange, to_reply);
        if let Err(error) = exchange {
            return Err(self.failed(channel, error).await);
        }
        if let Some((queue, refusal)) = reply.refused() {
            refused(queue, refusal);
        }
        match replied {
            Ok(()) => Ok(true),
            Err(PublishError::Unroutable(_)) => {
                metrics::counter!("turnstile_results_unrouted_total").increment(1);
                tracing::warn!(
                    reply_to = reply.queue().unwrap_or_default(),
                    "the message's reply_to queue does not exist: its result went only to the results exchange"
                );
                Ok(false)
            }
            // A closed reply channel is opened again at its next reply.
            Err(error) => Err(error),
        }
    }

    /// Publishes a reply to `queue` through the default exchange, mandatory and confirmed,
    /// alone on the next reply channel (opened, or opened again if closed, first): its return,
    /// if the queue does not exist, is its own.
    async fn reply(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let slot = self.next_reply.fetch_add(1, Ordering::Relaxed) % self.replies.len();
        let mut held = self.replies[slot].lock().await;
        let publisher = match held.as_ref() {
            Some(open) if open.channel().status().connected() => open.clone(),
            _ => {
                let opened = Publisher::confirming(&self.connection).await?;
                *held = Some(opened.clone());
                opened
            }
        };
        publisher
            .publish_to("", queue, body, properties, Routing::Mandatory)
            .await
    }

    /// Publishes a batch's completion event (JSON `body`), confirmed.
    pub async fn publish_event(&self, batch_id: &str, body: &[u8]) -> Result<(), PublishError> {
        let channel = self.channel.lock().await.clone();
        let properties = properties(Some(batch_id), "turnstile.batch.completed");
        let sent = channel
            .publish_to(
                &self.exchange,
                BATCH_COMPLETED,
                body,
                properties,
                Routing::Optional,
            )
            .await;
        match sent {
            Ok(()) => Ok(()),
            Err(error) => Err(self.failed(channel, error).await),
        }
    }

    /// After a failed publish on `used`: a closed channel (the exchange deleted, say) is
    /// replaced by a new one, with the exchange declared again, so that a retry can succeed.
    async fn failed(&self, used: Publisher, error: PublishError) -> PublishError {
        if used.channel().status().connected() || !self.connection.status().connected() {
            return error;
        }
        let mut current = self.channel.lock().await;
        if !current.is_on_channel_of(&used) || current.channel().status().connected() {
            return error;
        }
        match open_channel(&self.connection, &self.exchange).await {
            Ok(reopened) => {
                tracing::warn!(%error, exchange = %self.exchange, "the results channel was closed; reopened it and declared the results exchange again");
                *current = reopened;
            }
            Err(reopen) => {
                tracing::warn!(%error, reopen = format!("{reopen:#}"), "the results channel was closed and could not be reopened");
            }
        }
        error
    }
}

/// A result's or an event's properties: JSON, persistent, named by `message_id`, typed.
fn properties(message_id: Option<&str>, kind: &str) -> BasicProperties {
    let mut properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_type(kind.into())
        .with_timestamp(crate::domain::unix_ms() / 1000);
    if let Some(id) = message_id.filter(|id| id.len() <= 255) {
        properties = properties.with_message_id(id.into());
    }
    properties
}

/// A confirming channel with `exchange` declared on it.
async fn open_channel(connection: &Connection, exchange: &str) -> anyhow::Result<Publisher> {
    let publisher = Publisher::confirming(connection)
        .await
        .context("opening the results channel")?;
    declare_exchange(publisher.channel(), exchange).await?;
    Ok(publisher)
}

/// Declares the results exchange (durable topic; idempotent).
pub async fn declare_exchange(channel: &lapin::Channel, exchange: &str) -> anyhow::Result<()> {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("declaring the results exchange {exchange:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::QueueType;

    fn reply_to(queue: &str) -> ReplyTo {
        let properties = BasicProperties::default()
            .with_reply_to(queue.into())
            .with_correlation_id("c-1".into());
        ReplyTo::of(
            &properties,
            &Topology::new("registrations", QueueType::Quorum),
        )
    }

    #[test]
    fn a_reply_goes_only_where_the_topology_allows() {
        let allowed = reply_to("upload-replies");
        assert_eq!(allowed.queue(), Some("upload-replies"));
        assert_eq!(allowed.refused(), None);
        let refused = reply_to("registrations.wait.0");
        assert_eq!(refused.queue(), None, "no reply to a queue of ours");
        assert_eq!(
            refused.refused(),
            Some(("registrations.wait.0", ReplyRefusal::OwnQueue))
        );
        assert_eq!(
            refused.correlation_id.as_ref().map(|c| c.as_str()),
            Some("c-1"),
            "kept for the exchange"
        );
        let none = reply_to("");
        assert_eq!((none.queue(), none.refused()), (None, None));
    }
}
