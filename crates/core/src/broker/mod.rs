//! RabbitMQ: the topology turnstile declares, the consumer channel and the confirmed publisher.
//!
//! Topology for `TURNSTILE_QUEUE=<q>` (every name but `<q>` starts with `<q>.`):
//! - `<q>`: the work queue (durable; quorum by default). A quorum work queue dead-letters a
//!   message returned more than [`WORK_DELIVERY_LIMIT`] times to `<q>.dead`, at least once.
//! - `<q>.ready`: the return queue. Every message that re-enters the consume path after a delay
//!   (the end of its ladder hops, a return at shutdown) is published here, never to `<q>`, and
//!   each replica consumes it beside `<q>` with a prefetch of its own: a message whose slot is
//!   due does not wait behind the work queue's backlog. Protected as the work queue is.
//! - `<q>.dead`: dead letters, with the reason in headers (turnstile's own), or in `x-death`
//!   (the broker's: the delivery limit). A quorum `<q>.dead` declares a delivery limit that
//!   listing it never reaches ([`UNREACHED_DELIVERY_LIMIT`]).
//! - the delay ladder ([`ladder`]): queues `<q>.wait.<k>` for k = 0..LEVELS, in which a
//!   message waits 2^k x UNIT; the replicas consume them and move each message on, confirmed,
//!   when its wait is over. No broker TTL or dead-lettering is involved.
//! - `<q>.results`: a topic exchange for what flows back to the upload service, each message's
//!   result and each batch's completion event ([`results`]).
//!
//! Every message's headers fit a budget of the connection's frame_max ([`budget`]).

pub mod budget;
pub mod dead_letters;
mod settle;
pub use settle::Settler;
pub mod ladder;
pub mod results;
mod topology;

pub use budget::TooLarge;
pub use ladder::{Hop, LEVELS, UNIT};
pub use results::Results;
pub use topology::{
    Declared, Protection, QueueType, ReplyRefusal, Topology, UNREACHED_DELIVERY_LIMIT,
    WORK_DELIVERY_LIMIT,
};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use lapin::Confirmation;
use lapin::message::Delivery;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::domain::unix_ms;

/// Headers turnstile reads and writes on the messages it republishes.
pub mod headers {
    /// The reserved permit slot (`SLOT_US/COUNT/WINDOW_US`, Redis time), see `permit::Reservation`.
    pub const RESERVATION: &str = "x-turnstile-reservation";
    /// Failed downstream attempts so far (429s are not counted).
    pub const ATTEMPT: &str = "x-turnstile-attempt";
    /// Times the message went through the delay ladder.
    pub const DELAYS: &str = "x-turnstile-delays";
    /// When a delayed message is due back in the consume path (Unix ms).
    pub const DUE: &str = "x-turnstile-due-ms";
    /// When a delayed message's wait in its current ladder level ends (Unix ms).
    pub const HOP: &str = "x-turnstile-hop-ms";
    /// Since when (Unix ms) the downstream has answered 429 to the message.
    pub const THROTTLED_SINCE: &str = "x-turnstile-throttled-since-ms";
    /// Why turnstile dead-lettered a message: `invalid-message`, `rejected`,
    /// `attempts-exhausted` or `throttled` (a message the broker dead-lettered has none, see
    /// [`super::dead_letters::Reason`]).
    pub const REASON: &str = "x-turnstile-reason";
    /// The detail of the reason: the parse error, or the status and a body excerpt.
    pub const DETAIL: &str = "x-turnstile-detail";
    /// Unix time in ms when the message was dead-lettered.
    pub const DEAD_AT: &str = "x-turnstile-dead-at-ms";
    /// On a dead letter: the calls that counted as attempts, the last one included (as its
    /// result's `attempts`).
    pub const ATTEMPTS: &str = "x-turnstile-attempts";
    /// On a superseded dead letter: the message id of the newer message of its product that
    /// took its place (as its result's `superseded_by`).
    pub const SUPERSEDED_BY: &str = "x-turnstile-superseded-by";
    /// The queue the dead letter was consumed from.
    pub const QUEUE: &str = "x-turnstile-queue";
    /// When turnstile first saw the message (Unix ms), for its result.
    pub const FIRST_SEEN: &str = "x-turnstile-first-seen-ms";
    /// The tag of the fleet's terms the message was delayed under (decimal), see
    /// `permit::applied::terms_tag`: under other terms it is woken and asks anew.
    pub const TERMS: &str = "x-turnstile-terms";
    /// `1` on a message of a bulk route whose bulk answer could not be mapped to its rows: it
    /// is retried in a call of its own (anything else, or none, lets it share a call).
    pub const ALONE: &str = "x-turnstile-alone";
}

/// `TURNSTILE_AMQP_URL`'s default: the local broker.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Where the broker is (`TURNSTILE_AMQP_URL`), declared once: every command that connects to
/// the broker flattens it (with [`BrokerArgs`], or alone where it declares its own queues).
/// Its `Debug` hides the URL's password. Its flag is global (see
/// [`crate::config::RedisArgs`]): taken before the subcommand too.
#[derive(clap::Args, Clone)]
pub struct AmqpArgs {
    /// Broker URL, or a comma-separated list of the URLs of a cluster's nodes: a replica
    /// connects to one that answers and, when its connection is lost, tries the next first.
    #[arg(
        id = "amqp_url",
        long = "amqp-url",
        env = "TURNSTILE_AMQP_URL",
        default_value = DEFAULT_AMQP_URL,
        hide_env_values = true,
        value_name = "URL",
        global = true
    )]
    pub url: String,
}

impl std::fmt::Debug for AmqpArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpArgs")
            .field("url", &redact_amqp_url(&self.url))
            .finish()
    }
}

/// The work queue (`TURNSTILE_QUEUE`), declared once: every command that uses turnstile's
/// queues flattens it (with [`BrokerArgs`]). Its flag is global, as [`AmqpArgs`]'s.
#[derive(clap::Args, Clone, Debug)]
pub struct QueueArgs {
    /// Work queue; every other queue/exchange name derives from it.
    #[arg(
        id = "queue",
        long = "queue",
        env = "TURNSTILE_QUEUE",
        default_value = "registrations",
        value_name = "NAME",
        global = true
    )]
    pub name: String,
}

/// Where the broker is and which queues turnstile uses there. Its flags are global (see
/// [`crate::config::RedisArgs`]): `--amqp-url` and `--queue` are taken before the subcommand
/// too, and all of them after a command's action (`turnstile dead-letters list --queue q`).
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Connection")]
pub struct BrokerArgs {
    #[command(flatten)]
    pub amqp: AmqpArgs,
    #[command(flatten)]
    pub queue: QueueArgs,
    /// Queue type of the work queue and the others turnstile declares.
    #[arg(long = "queue-type", env = "TURNSTILE_QUEUE_TYPE", value_enum, default_value_t = QueueType::Quorum, global = true)]
    pub queue_type: QueueType,
    /// Queue type of the delay ladder's levels (quorum: at-least-once dead-lettering).
    #[arg(long = "delay-queue-type", env = "TURNSTILE_DELAY_QUEUE_TYPE", value_enum, default_value_t = QueueType::Quorum, global = true)]
    pub delay_queue_type: QueueType,
    /// The broker's consumer timeout (RabbitMQ's `consumer_timeout`, 30 minutes by default), or
    /// `off`: the delay ladder holds a delivery at most this less a quarter (at most 10
    /// minutes less), so a raised timeout means fewer hops for long waits. A broker that closes
    /// a channel for a shorter one is held under from then on, with an error in the log.
    #[arg(
        long = "consumer-timeout",
        env = "TURNSTILE_CONSUMER_TIMEOUT",
        default_value = "30m",
        global = true
    )]
    pub consumer_timeout: crate::config::ConsumerTimeout,
}

impl BrokerArgs {
    pub fn topology(&self) -> Topology {
        Topology::new(&self.queue.name, self.queue_type)
            .with_delay_type(self.delay_queue_type)
            .with_consumer_timeout(self.consumer_timeout)
    }

    /// Connects, opens a confirming publisher and declares the topology (idempotent).
    pub async fn open(&self, name: &str) -> anyhow::Result<(Connection, Publisher, Topology)> {
        let connection = connect(&self.amqp.url, name).await?;
        let publisher = Publisher::open(&connection).await?;
        let topology = self.topology();
        topology.declare(&connection).await?;
        Ok((connection, publisher, topology))
    }
}

/// The URL with its password hidden, for logs and errors.
pub fn redact_amqp_url(url: &str) -> String {
    crate::config::redact_url(url)
}

/// How long one node may take to accept a connection before the next is tried.
const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The broker's nodes (`TURNSTILE_AMQP_URL`: one URL, or a comma-separated list of a cluster's
/// nodes), and which one to try first: the one after the node of the last connection, so that
/// a replica whose connection was lost moves on to the next node at once.
#[derive(Debug)]
pub struct Nodes {
    urls: Vec<String>,
    next: AtomicUsize,
    /// The AMQP heartbeat to ask for (seconds) where a URL does not say (`?heartbeat=`).
    heartbeat: Option<u16>,
}

impl Nodes {
    /// Every URL of the list, each checked (a malformed URL is not worth retrying).
    pub fn parse(list: &str) -> anyhow::Result<Self> {
        let urls: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        anyhow::ensure!(!urls.is_empty(), "TURNSTILE_AMQP_URL is empty");
        for (i, url) in urls.iter().enumerate() {
            url.parse::<lapin::uri::AMQPUri>().map_err(|why| {
                anyhow::anyhow!(
                    "TURNSTILE_AMQP_URL {:?} (node {} of {}) is not a valid AMQP URL: {why}",
                    redact_amqp_url(url),
                    i + 1,
                    urls.len()
                )
            })?;
        }
        Ok(Self {
            urls,
            next: AtomicUsize::new(0),
            heartbeat: None,
        })
    }

    /// Asks the broker for this heartbeat (seconds) on every connection whose URL does not
    /// set one: the broker takes the lower of its own and this one, and drops a connection
    /// silent for two to three of them (see `crate::links`).
    pub fn with_heartbeat(mut self, heartbeat: u16) -> Self {
        self.heartbeat = Some(heartbeat);
        self
    }

    /// Connects to the first node that answers, trying each once in turn from the one after
    /// the last connection's (each within [`NODE_CONNECT_TIMEOUT`]); the error of the last
    /// node tried when none answers.
    pub async fn connect(&self, name: &str) -> anyhow::Result<Connection> {
        let first = self.next.load(Ordering::Relaxed);
        let mut last_error = None;
        for i in try_order(first, self.urls.len()) {
            let url = &self.urls[i];
            let properties = ConnectionProperties::default().with_connection_name(name.into());
            let mut uri: lapin::uri::AMQPUri = url
                .parse()
                .map_err(|why| anyhow::anyhow!("{}: {why}", redact_amqp_url(url)))?;
            if uri.query.heartbeat.is_none() {
                uri.query.heartbeat = self.heartbeat;
            }
            let user = uri.authority.userinfo.username.clone();
            let attempt = tokio::time::timeout(
                NODE_CONNECT_TIMEOUT,
                Connection::connect_uri(uri, properties),
            );
            let error = match attempt.await {
                Ok(Ok(connection)) => {
                    self.next
                        .store((i + 1) % self.urls.len(), Ordering::Relaxed);
                    return Ok(connection);
                }
                Ok(Err(error)) if is_login_refused(&error) => {
                    anyhow::Error::new(error).context(format!(
                        "the broker refused the login for user {user}: check TURNSTILE_AMQP_URL"
                    ))
                }
                Ok(Err(error)) => anyhow::Error::new(error),
                Err(_) => anyhow::anyhow!("no answer within {NODE_CONNECT_TIMEOUT:?}"),
            };
            if self.urls.len() > 1 {
                tracing::debug!(node = %redact_amqp_url(url), error = %crate::telemetry::error_chain(&error), "a broker node did not answer; trying the next");
            }
            last_error = Some(error.context(format!(
                "cannot connect to RabbitMQ at {}",
                redact_amqp_url(url)
            )));
        }
        let last_error = last_error.expect("a list of nodes is never empty");
        Err(match self.urls.len() {
            1 => last_error,
            n => last_error.context(format!("no broker node of {n} answered")),
        })
    }

    /// The node of the last connection made, its URL's password hidden.
    pub fn connected_node(&self) -> String {
        let n = self.urls.len();
        let last = (self.next.load(Ordering::Relaxed) + n - 1) % n;
        redact_amqp_url(&self.urls[last])
    }
}

/// The nodes' indexes in the order they are tried: from `first`, wrapping around.
fn try_order(first: usize, n: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |k| (first + k) % n)
}

/// Messages ready in a queue (a passive declare: fails if the queue does not exist).
pub async fn depth(channel: &Channel, queue: &str) -> anyhow::Result<u32> {
    let q = channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("reading the depth of {queue:?}"))?;
    Ok(q.message_count())
}

/// Whether a connection attempt failed because the broker refused its user name or password
/// (ACCESS_REFUSED while connecting).
fn is_login_refused(error: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if amqp.kind() == &AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED))
}

/// Whether the broker refused us for a reason that retrying cannot fix: wrong credentials or
/// permissions (ACCESS_REFUSED), an unknown vhost (NOT_ALLOWED), or a queue that exists with
/// other arguments, e.g. another queue type (PRECONDITION_FAILED).
pub fn is_configuration_error(error: &anyhow::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    error
        .chain()
        .filter_map(|e| e.downcast_ref::<lapin::Error>())
        .any(|e| match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => matches!(
                amqp.kind(),
                AMQPErrorKind::Soft(
                    AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED
                ) | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
            ),
            _ => false,
        })
}

/// Opens a connection named `name` to the first node of `urls` (one URL or a comma-separated
/// list, see [`Nodes`]) that answers.
pub async fn connect(urls: &str, name: &str) -> anyhow::Result<Connection> {
    Nodes::parse(urls)?.connect(name).await
}

/// What a replica asked of the broker for the messages it handled, counted message by message:
/// with the deliveries (the worker's and the delay ladder's) the broker's cost per message.
#[derive(Debug, Default)]
pub struct BrokerCost {
    /// Copies of messages published and confirmed: delays, ladder hops, dead letters, rescues.
    pub publishes: AtomicU64,
    /// Results and batch completion events published and confirmed.
    pub results: AtomicU64,
    /// Deliveries acked (each one, whether its ack went alone or in a `multiple` run).
    pub acks: AtomicU64,
    /// Deliveries returned to their queue (nack with requeue).
    pub requeues: AtomicU64,
}

impl BrokerCost {
    /// Adds one to `counter`.
    pub fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A channel in confirm mode: every publish waits for the broker's confirm. Cheap to clone
/// (one per delivery): the channel is shared. Never sends a frame larger than its connection's
/// frame_max, and its copies of a message keep the budget of [`budget`].
#[derive(Clone)]
pub struct Publisher {
    channel: Arc<Channel>,
    frame_max: u32,
    /// Where a message returned to another publish of the channel goes (see
    /// [`Publisher::rescuing_to`]).
    rescue: Option<Arc<str>>,
    /// Where its confirmed publishes are counted, if anywhere.
    cost: Option<Arc<BrokerCost>>,
}

/// Whether a published message must reach a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// A message no queue takes is returned: [`PublishError::Unroutable`].
    Mandatory,
    /// A message no queue takes is dropped by the broker (a fan-out no one listens to).
    Optional,
}

/// A publish the broker did not take (nack, unroutable, or the channel failed).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("broker: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("the broker refused the message (nack)")]
    Nacked,
    #[error("the message could not be routed to {0}")]
    Unroutable(String),
    #[error("not sent: {0}")]
    TooLarge(#[from] TooLarge),
}

impl Publisher {
    /// Opens a confirming channel on `connection` (connected: its frame_max is negotiated).
    pub async fn open(connection: &Connection) -> anyhow::Result<Self> {
        Self::confirming(connection)
            .await
            .context("opening a publish channel with publisher confirms")
    }

    /// As [`Self::open`], failing with the client's error (for a caller that retries a
    /// publish on a channel it opens again).
    pub async fn confirming(connection: &Connection) -> Result<Self, lapin::Error> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            channel: Arc::new(channel),
            frame_max: connection.configuration().frame_max(),
            rescue: None,
            cost: None,
        })
    }

    /// Counts every publish the broker confirms in `cost`'s publishes.
    pub fn counting(mut self, cost: Arc<BrokerCost>) -> Self {
        self.cost = Some(cost);
        self
    }

    /// Publishes the messages the broker returns to other publishes of this channel to
    /// `queue`. lapin hands a returned (unroutable) message to whichever publish of the channel
    /// is confirmed next: the publish that went nowhere may then be confirmed as delivered, and
    /// its original acked. The publish that receives another's return publishes it to `queue`
    /// (the return queue: a copy that comes back early costs a delivery, one lost costs the
    /// message), and its own publish counts as delivered.
    pub fn rescuing_to(mut self, queue: &str) -> Self {
        self.rescue = Some(queue.into());
        self
    }

    /// Whether both publish on the same channel (not only one with the same id).
    pub fn is_on_channel_of(&self, other: &Publisher) -> bool {
        Arc::ptr_eq(&self.channel, &other.channel)
    }

    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Whether `delivery` can be handled: every copy of it fits the frame (see
    /// [`budget::admit`]).
    pub fn admit(&self, delivery: &Delivery) -> Result<(), TooLarge> {
        budget::admit(
            budget::header_frame_size(&delivery.properties),
            self.frame_max,
        )
    }

    /// Publishes persistently and mandatorily and waits for the broker's confirm; refuses
    /// (without sending) properties whose frame would exceed the frame_max, which would make the
    /// broker close the connection.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        self.publish_to(exchange, routing_key, body, properties, Routing::Mandatory)
            .await
    }

    /// As [`Self::publish`], `routing` saying whether a message no queue takes is an error.
    pub async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
        routing: Routing,
    ) -> Result<(), PublishError> {
        let properties = properties.with_delivery_mode(2);
        let frame = budget::header_frame_size(&properties);
        if !budget::fits_frame(frame, self.frame_max) {
            return Err(TooLarge {
                bytes: frame,
                frame_max: self.frame_max,
            }
            .into());
        }
        let confirm = self
            .channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: routing == Routing::Mandatory,
                    ..Default::default()
                },
                body,
                properties,
            )
            .await?
            .await?;
        let (returned, answer) = match confirm {
            Confirmation::Ack(None) | Confirmation::NotRequested => (None, Ok(())),
            Confirmation::Ack(Some(returned)) => {
                let unroutable =
                    PublishError::Unroutable(format!("exchange {exchange:?}, key {routing_key:?}"));
                (Some(returned), Err(unroutable))
            }
            Confirmation::Nack(returned) => (returned, Err(PublishError::Nacked)),
        };
        if let (Ok(()), Some(cost)) = (&answer, &self.cost) {
            BrokerCost::count(&cost.publishes);
        }
        let Some(returned) = returned else {
            return answer;
        };
        let ours = returned.delivery.routing_key.as_str() == routing_key
            && returned.delivery.exchange.as_str() == exchange
            && returned.delivery.data == body;
        if ours {
            return answer;
        }
        self.rescue_returned(returned).await;
        match answer {
            Err(PublishError::Unroutable(_)) => Ok(()),
            other => other,
        }
    }

    /// Publishes a message the broker returned to another publish of this channel to the
    /// rescue queue (see [`Self::rescuing_to`]); logged when there is none or it fails.
    async fn rescue_returned(&self, returned: lapin::message::BasicReturnMessage) {
        let delivery = returned.delivery;
        let Some(queue) = &self.rescue else {
            tracing::error!(exchange = %delivery.exchange, routing_key = %delivery.routing_key, "a message the broker returned as unroutable was confirmed as delivered: it may be lost");
            return;
        };
        metrics::counter!("turnstile_returns_rescued_total").increment(1);
        tracing::warn!(exchange = %delivery.exchange, routing_key = %delivery.routing_key, rescued_to = %queue, "the broker returned a copy as unroutable (its queue is gone?): republished to the return queue");
        let once = Self {
            rescue: None,
            ..self.clone()
        };
        let rescued = Box::pin(once.publish_to(
            "",
            queue,
            &delivery.data,
            delivery.properties,
            Routing::Mandatory,
        ))
        .await;
        if let Err(error) = rescued {
            tracing::error!(%error, "a copy the broker returned could not be republished to the return queue: it may be lost");
        }
    }

    /// Publishes a copy of `delivery` to the dead-letter queue with the reason in headers (and
    /// `extra` headers set).
    pub async fn dead_letter(
        &self,
        topology: &Topology,
        delivery: &Delivery,
        reason: &str,
        detail: &str,
        extra: &[(&str, AMQPValue)],
    ) -> Result<(), PublishError> {
        let now_ms = unix_ms() as i64;
        let mut set = vec![
            (headers::REASON, long_string(reason)),
            (headers::DETAIL, long_string(budget::clip_detail(detail))),
            (headers::DEAD_AT, AMQPValue::LongLongInt(now_ms)),
            (headers::QUEUE, long_string(topology.work())),
        ];
        set.extend(extra.iter().cloned());
        let properties = self.copy(delivery, &set);
        self.publish("", topology.dead(), &delivery.data, properties)
            .await
    }

    /// The properties of a copy of `delivery` with `extra` headers (see [`copy_properties`]),
    /// keeping as many of its foreign headers as fit the budget ([`budget::fitting_copy`]).
    fn copy(&self, delivery: &Delivery, extra: &[(&str, AMQPValue)]) -> BasicProperties {
        let (properties, kept) = budget::fitting_copy(self.frame_max, |keep| {
            copy_properties(delivery, extra, keep)
        });
        if kept != budget::Keep::All {
            tracing::warn!(
                ?kept,
                frame_max = self.frame_max,
                "the message's headers do not fit a copy: its foreign headers are dropped"
            );
        }
        properties
    }
}

/// An AMQP long-string header value.
pub fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// The delivery's properties with `extra` headers set (replacing those of the same name in any
/// case: a `TraceParent` beside the `traceparent` set would make both invalid), the others
/// kept as `keep` says, and the broker's dead-letter history removed. The history must go: a message that goes through the ladder a second time with
/// `x-death` naming a ladder queue is taken for a dead-letter cycle, which a quorum queue then
/// holds forever and a classic queue drops.
fn copy_properties(
    delivery: &Delivery,
    extra: &[(&str, AMQPValue)],
    keep: budget::Keep,
) -> BasicProperties {
    let mut table = FieldTable::default();
    if let Some(headers) = delivery.properties.headers() {
        for (name, value) in headers.inner() {
            let text = name.as_str();
            let replaced = extra.iter().any(|(set, _)| set.eq_ignore_ascii_case(text));
            if !is_death_history(text) && !replaced && keep.keeps(text) {
                table.insert(name.clone(), value.clone());
            }
        }
    }
    for (name, value) in extra {
        table.insert(ShortString::from(*name), value.clone());
    }
    delivery.properties.clone().with_headers(table)
}

/// Whether a header is the broker's dead-letter history (`x-death`, `x-first-death-*`,
/// `x-last-death-*`).
pub(crate) fn is_death_history(name: &str) -> bool {
    name == "x-death" || name.starts_with("x-first-death-") || name.starts_with("x-last-death-")
}

fn header<'a>(delivery: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
    delivery.properties.headers().as_ref()?.inner().get(name)
}

/// A header as an unsigned integer (any AMQP integer type, or a decimal string).
pub fn header_u64(delivery: &Delivery, name: &str) -> Option<u64> {
    match header(delivery, name)? {
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        _ => None,
    }
}

/// The registration a delivery carries, parsed as the worker parses it (the AMQP message-id
/// property is the fallback id), or why it is invalid.
pub fn registration_of(
    delivery: &Delivery,
) -> Result<crate::domain::Registration, crate::domain::InvalidMessage> {
    let message_id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str());
    crate::domain::Registration::parse(&delivery.data, message_id)
}

/// The message a delivery carries, as replays, completion records and the delay ladder's index
/// know it, whether or not its body parses (the AMQP message-id property is the fallback id).
pub fn identity_of(delivery: &Delivery) -> crate::domain::Identity {
    let message_id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str());
    crate::domain::Identity::of(&delivery.data, message_id)
}

/// A header as text.
pub fn header_str(delivery: &Delivery, name: &str) -> Option<String> {
    match header(delivery, name)? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// Arguments table from pairs.
pub(crate) fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in pairs {
        table.insert(ShortString::from(*k), v.clone());
    }
    table
}

#[cfg(test)]
mod nodes_tests {
    use super::*;

    #[test]
    fn nodes_are_tried_from_the_one_after_the_last_connection_wrapping_around() {
        assert_eq!(try_order(0, 3).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(try_order(2, 3).collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(try_order(0, 1).collect::<Vec<_>>(), [0]);
    }

    #[test]
    fn a_list_of_broker_urls_is_checked_node_by_node() {
        let nodes = Nodes::parse("amqp://a:5672/%2f, amqp://b:5673/%2f").unwrap();
        assert_eq!(nodes.urls, ["amqp://a:5672/%2f", "amqp://b:5673/%2f"]);
        let bad = Nodes::parse("amqp://a:5672/%2f,http://user:secret@b/").unwrap_err();
        let said = format!("{bad:#}");
        assert!(
            said.contains("node 2 of 2") && !said.contains("secret"),
            "{said}"
        );
        assert!(Nodes::parse(" , ").is_err());
    }
}
