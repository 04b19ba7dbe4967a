//! Inspecting dead letters and replaying chosen ones onto the work queue.
//!
//! Most dead letters were published by a replica with the reason in [`headers::REASON`]. The
//! broker dead-letters too: a quorum work queue moves a message returned more than its
//! delivery limit to `<q>.dead` with only its `x-death` history, whose reason `delivery_limit`
//! (RabbitMQ 3.10 and later) is listed as `delivery-limit`; any other broker reason `R` (an
//! operator's TTL or length limit: `expired`, `maxlen`; a reject by another client:
//! `rejected`) as `broker-R`.

use std::time::Duration;

use anyhow::Context;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};

use crate::domain::Registration;
use crate::permit::{Completion, PermitError, PermitStore};

use super::{Publisher, Topology, depth, header_str, headers, is_death_history};

/// The reason listed for a message the broker dead-lettered after too many returns.
pub const DELIVERY_LIMIT_REASON: &str = "delivery-limit";

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
    let present = depth(channel, topology.dead()).await?;
    let mut keep = Vec::new();
    for _ in 0..present {
        let Some(message) = channel
            .basic_get(topology.dead().into(), BasicGetOptions::default())
            .await?
        else {
            break;
        };
        let (take, delivery) = visit(message.delivery).await?;
        if take {
            delivery.acker.ack(BasicAckOptions::default()).await?;
        } else {
            keep.push(delivery.acker);
        }
    }
    for acker in keep {
        acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await?;
    }
    Ok(())
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
                if let Err(error) = publisher
                    .publish("", &work, &delivery.data, properties)
                    .await
                {
                    revived.undo(permits, ttl).await;
                    return Err(error.into());
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
    Message(Registration, String),
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
    match super::registration_of(delivery) {
        Ok(r) => {
            let revived = permits
                .complete(
                    &r.seller_id,
                    &r.message_id,
                    r.batch_id.as_ref(),
                    Completion::Replayed,
                    ttl,
                )
                .await?;
            Ok(if revived {
                Revived::Message(r, was_dead_for)
            } else {
                Revived::Nothing
            })
        }
        Err(_) if was_dead_for == INVALID => {
            permits.tally_dead(INVALID, -1).await?;
            Ok(Revived::Unidentified(INVALID))
        }
        Err(_) => Ok(Revived::Nothing),
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
            Revived::Message(r, reason) => permits.count_dead(Some(r), reason, ttl).await,
            Revived::Unidentified(reason) => permits.count_dead(None, reason, ttl).await,
        };
        if let Err(error) = undone {
            tracing::warn!(%error, "not republished, and still counted as waiting");
        }
    }
}
