//! Inspecting dead letters and replaying chosen ones onto the work queue.
//!
//! Most dead letters were published by a replica with the reason in [`headers::REASON`]. The
//! broker dead-letters too: a quorum work queue moves a message returned more than its
//! delivery limit to `<q>.dead` with only its `x-death` history, whose reason `delivery_limit`
//! (RabbitMQ 3.10 and later) is listed as `delivery-limit`; any other broker reason `R` (an
//! operator's TTL or length limit: `expired`, `maxlen`; a reject by another client:
//! `rejected`) as `broker-R`.
//!
//! Every broker step is bounded ([`STEP_TIMEOUT`]) and fails at once when its channel fails,
//! which lapin never reports to the step itself: a dead letter whose headers exceed the
//! connection's frame_max makes the client close the connection in the middle of a read.

use std::time::Duration;

use anyhow::Context;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};

use crate::domain::{BatchSize, Identity};
use crate::permit::{Completion, InBatch, PermitError, PermitStore};

use super::{Publisher, Topology, depth, header_str, headers, is_death_history};

/// The reason listed for a message the broker dead-lettered after too many returns.
pub const DELIVERY_LIMIT_REASON: &str = "delivery-limit";

/// Longest one broker step of a listing or a replay may take (a read, an ack, a confirm): a
/// broker that stops answering fails the command instead of hanging it.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a step looks whether its channel failed.
const CHANNEL_CHECK: Duration = Duration::from_millis(50);

/// What a read that lost its connection most likely met.
const UNREADABLE: &str = "most likely the dead letter's headers are larger than the broker's \
    frame_max, which no AMQP client can receive (turnstile's own dead letters always fit; the \
    broker's x-death can push a message published at the limit over it): raise frame_max in \
    rabbitmq.conf to read it, or take it off with the management UI";

/// Runs one broker `step` on `channel` (`what` names it in the error): within
/// [`STEP_TIMEOUT`], and failing as soon as the channel fails.
async fn step<T, E>(
    channel: &Channel,
    what: &str,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> anyhow::Result<T>
where
    E: Into<anyhow::Error>,
{
    tokio::select! {
        done = tokio::time::timeout(STEP_TIMEOUT, step) => match done {
            Ok(done) => done.map_err(Into::into).with_context(|| what.to_owned()),
            Err(_) => anyhow::bail!("{what}: no answer from the broker within {STEP_TIMEOUT:?}"),
        },
        () = failed(channel) => anyhow::bail!("{what}: the broker connection failed"),
    }
}

/// Completes when `channel` is no longer open.
async fn failed(channel: &Channel) {
    while channel.status().connected() {
        tokio::time::sleep(CHANNEL_CHECK).await;
    }
}

/// One dead letter as listed.
#[derive(Debug, serde::Serialize)]
pub struct DeadLetter {
    pub message_id: Option<String>,
    pub seller_id: Option<String>,
    pub reason: String,
    pub detail: String,
    pub dead_at_ms: Option<u64>,
    pub bytes: usize,
}

/// The broker's latest dead-lettering of a message: the first entry of its `x-death` header.
struct Death {
    reason: String,
    queue: String,
    count: u64,
    at_ms: Option<u64>,
}

fn latest_death(delivery: &Delivery) -> Option<Death> {
    let headers = delivery.properties.headers().as_ref()?;
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(entry) = deaths.as_slice().first()? else {
        return None;
    };
    let text = |name: &str| match entry.inner().get(name) {
        Some(AMQPValue::LongString(s)) => Some(s.to_string()),
        Some(AMQPValue::ShortString(s)) => Some(s.to_string()),
        _ => None,
    };
    Some(Death {
        reason: text("reason")?,
        queue: text("queue").unwrap_or_default(),
        count: match entry.inner().get("count") {
            Some(AMQPValue::LongLongInt(n)) => u64::try_from(*n).unwrap_or(0),
            Some(AMQPValue::LongInt(n)) => u64::try_from(*n).unwrap_or(0),
            _ => 0,
        },
        at_ms: match entry.inner().get("time") {
            Some(AMQPValue::Timestamp(seconds)) => seconds.checked_mul(1000),
            _ => None,
        },
    })
}

/// Why a dead letter is dead, the detail, and when it died (Unix ms): turnstile's headers, or
/// else the broker's `x-death`.
fn reason_of(delivery: &Delivery) -> (String, String, Option<u64>) {
    if let Some(reason) = header_str(delivery, headers::REASON) {
        return (
            reason,
            header_str(delivery, headers::DETAIL).unwrap_or_default(),
            super::header_u64(delivery, headers::DEAD_AT),
        );
    }
    match latest_death(delivery) {
        Some(death) => {
            let reason = match death.reason.as_str() {
                "delivery_limit" => DELIVERY_LIMIT_REASON.to_owned(),
                other => format!("broker-{other}"),
            };
            let detail = format!(
                "dead-lettered by the broker from {:?} ({}, {} time(s))",
                death.queue, death.reason, death.count
            );
            (reason, detail, death.at_ms)
        }
        None => ("unknown".into(), String::new(), None),
    }
}

fn describe(delivery: &Delivery) -> DeadLetter {
    let body: Option<serde_json::Value> = serde_json::from_slice(&delivery.data).ok();
    let field = |name: &str| {
        body.as_ref()
            .and_then(|b| b.get(name))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    let (reason, detail, dead_at_ms) = reason_of(delivery);
    DeadLetter {
        message_id: field("message_id").or_else(|| {
            delivery
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string())
        }),
        seller_id: field("seller_id"),
        reason,
        detail,
        dead_at_ms,
        bytes: delivery.data.len(),
    }
}

/// What `replay` did.
#[derive(Debug, Default, serde::Serialize)]
pub struct Replayed {
    pub replayed: u64,
    pub kept: u64,
}

/// Visits each dead letter present now exactly once: `visit` returns true to take it off the
/// dead-letter queue (after it was handled), false to leave it there. Messages are held unacked
/// while visiting and the ones left are returned at the end, so none is seen twice or lost;
/// of a message left, only its acker is kept meanwhile (not its body), so visiting a large
/// dead-letter queue holds a few dozen bytes per message, not the messages.
async fn visit<F, Fut>(channel: &Channel, topology: &Topology, mut visit: F) -> anyhow::Result<()>
where
    F: FnMut(Delivery) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(bool, Delivery)>>,
{
    let present = step(
        channel,
        "reading the dead-letter queue's depth",
        depth(channel, topology.dead()),
    )
    .await?;
    let mut keep = Vec::new();
    for _ in 0..present {
        let Some(message) = next(channel, topology).await? else {
            break;
        };
        let (take, delivery) = visit(message.delivery).await?;
        if take {
            let ack = delivery.acker.ack(BasicAckOptions::default());
            step(channel, "removing a replayed dead letter", ack).await?;
        } else {
            keep.push(delivery.acker);
        }
    }
    let requeue = BasicNackOptions {
        requeue: true,
        ..Default::default()
    };
    for acker in keep {
        step(channel, "leaving a dead letter", acker.nack(requeue)).await?;
    }
    Ok(())
}

/// The next dead letter, held unacked; a connection lost while reading it is explained.
async fn next(
    channel: &Channel,
    topology: &Topology,
) -> anyhow::Result<Option<lapin::message::BasicGetMessage>> {
    let what = format!("reading a dead letter from {:?}", topology.dead());
    let get = channel.basic_get(topology.dead().into(), BasicGetOptions::default());
    step(channel, &what, get).await.map_err(|error| {
        if channel.status().connected() {
            error
        } else {
            anyhow::anyhow!("{error:#}; {UNREADABLE}")
        }
    })
}

/// Lists the dead letters (optionally only those whose reason is `reason`); leaves them all.
pub async fn list(
    channel: &Channel,
    topology: &Topology,
    reason: Option<&str>,
) -> anyhow::Result<Vec<DeadLetter>> {
    let mut out = Vec::new();
    visit(channel, topology, |delivery| {
        let d = describe(&delivery);
        if reason.is_none_or(|r| r == d.reason) {
            out.push(d);
        }
        async move { Ok((false, delivery)) }
    })
    .await?;
    Ok(out)
}

/// Moves the dead letters with `reason` (all when `None`) back to the work queue: the body as
/// it was, turnstile's own headers and the broker's dead-letter history removed (a fresh start:
/// attempts at zero), confirmed before the dead letter is removed. Each message is counted as
/// waiting again before it is republished (`revive`), so no replica can register or
/// dead-letter it while it still counts as dead; if the republish fails, it is counted dead
/// again (with `ttl`, the completion records' TTL).
pub async fn replay(
    channel: &Channel,
    publisher: &Publisher,
    topology: &Topology,
    reason: Option<&str>,
    permits: &PermitStore,
    ttl: Duration,
) -> anyhow::Result<Replayed> {
    let mut done = Replayed::default();
    visit(channel, topology, |delivery| {
        let take = reason.is_none_or(|r| reason_of(&delivery).0 == r);
        let work = topology.work().to_owned();
        let publisher = publisher.clone();
        if take {
            done.replayed += 1
        } else {
            done.kept += 1
        }
        async move {
            if take {
                let mut kept = FieldTable::default();
                if let Some(table) = delivery.properties.headers() {
                    for (k, v) in table.inner() {
                        if !k.as_str().starts_with("x-turnstile-") && !is_death_history(k.as_str())
                        {
                            kept.insert(k.clone(), v.clone());
                        }
                    }
                }
                let properties: BasicProperties = delivery.properties.clone().with_headers(kept);
                let revived = revive(permits, &delivery, ttl)
                    .await
                    .context("counting a replayed message as waiting again")?;
                let publish = publisher.publish("", &work, &delivery.data, properties);
                let republished = step(publisher.channel(), "republishing a dead letter", publish);
                if let Err(error) = republished.await {
                    revived.undo(permits, ttl).await;
                    return Err(error);
                }
            }
            Ok((take, delivery))
        }
    })
    .await?;
    Ok(done)
}

/// What [`revive`] changed, to be undone if the republish fails.
enum Revived {
    /// Nothing was counted dead for it (already registered, counted as waiting, or a duplicate
    /// copy whose message was revived already).
    Nothing,
    /// Its completion record went from dead (for this reason) back to waiting.
    Message(Identity, Option<BatchSize>, String),
    /// A body without an identity left the dead letters by reason.
    Unidentified(&'static str),
}

/// Counts a dead letter's message as waiting again, before it is republished: its completion
/// record goes from dead back to waiting (`lua/complete.lua`, which also lowers its upload's
/// `dead` and the dead letters by reason), once however many copies are replayed. A body
/// without an identity (counted per dead letter, always as `invalid-message`) leaves the dead
/// letters by reason.
async fn revive(
    permits: &PermitStore,
    delivery: &Delivery,
    ttl: Duration,
) -> Result<Revived, PermitError> {
    let was_dead_for = header_str(delivery, headers::REASON).unwrap_or_default();
    let amqp_id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str());
    let identity = Identity::of(&delivery.data, amqp_id);
    let batch_size = super::registration_of(delivery)
        .ok()
        .and_then(|r| r.batch_size);
    match (&identity.seller_id, &identity.message_id) {
        (Some(seller), Some(message)) => {
            let batch = identity.batch_id.as_ref().map(|id| InBatch {
                id,
                size: batch_size,
            });
            let revived = permits
                .complete(seller, message, batch, Completion::Replayed, ttl)
                .await?;
            Ok(if revived.changed {
                Revived::Message(identity, batch_size, was_dead_for)
            } else {
                Revived::Nothing
            })
        }
        _ if was_dead_for == INVALID => {
            permits.records().tally_dead(INVALID, -1).await?;
            Ok(Revived::Unidentified(INVALID))
        }
        _ => Ok(Revived::Nothing),
    }
}

/// The reason of a dead letter whose body does not parse.
const INVALID: &str = "invalid-message";

impl Revived {
    /// Counts the message as dead again (its republish failed: it stays a dead letter). A
    /// failure here leaves it counted as waiting, never as done.
    async fn undo(self, permits: &PermitStore, ttl: Duration) {
        let undone = match &self {
            Revived::Nothing => Ok(()),
            Revived::Message(identity, size, reason) => permits
                .count_dead(identity, *size, reason, ttl)
                .await
                .map(drop),
            Revived::Unidentified(reason) => permits.records().tally_dead(reason, 1).await,
        };
        if let Err(error) = undone {
            tracing::warn!(%error, "not republished, and still counted as waiting");
        }
    }
}
