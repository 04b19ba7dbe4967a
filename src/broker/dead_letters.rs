//! Inspecting dead letters and replaying chosen ones onto the work queue.

use std::time::Duration;

use anyhow::Context;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel};

use crate::domain::Registration;
use crate::permit::{Completion, PermitError, PermitStore};

use super::{Publisher, Topology, depth, header_str, headers};

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

fn describe(delivery: &lapin::message::Delivery) -> DeadLetter {
    let body: Option<serde_json::Value> = serde_json::from_slice(&delivery.data).ok();
    let field = |name: &str| {
        body.as_ref()
            .and_then(|b| b.get(name))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    DeadLetter {
        message_id: field("message_id").or_else(|| {
            delivery
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string())
        }),
        seller_id: field("seller_id"),
        reason: header_str(delivery, headers::REASON).unwrap_or_else(|| "unknown".into()),
        detail: header_str(delivery, headers::DETAIL).unwrap_or_default(),
        dead_at_ms: super::header_u64(delivery, headers::DEAD_AT),
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
/// while visiting and the ones left are returned at the end, so none is seen twice or lost.
async fn visit<F, Fut>(channel: &Channel, topology: &Topology, mut visit: F) -> anyhow::Result<()>
where
    F: FnMut(lapin::message::Delivery) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(bool, lapin::message::Delivery)>>,
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
            keep.push(delivery);
        }
    }
    for delivery in keep {
        delivery
            .acker
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
/// it was, turnstile's own headers removed (a fresh start: attempts at zero), confirmed before
/// the dead letter is removed. Each message is counted as waiting again before it is
/// republished ([`revive`]), so no replica can register or dead-letter it while it still
/// counts as dead; if the republish fails, it is counted dead again (with `ttl`, the completion
/// records' TTL).
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
        let take =
            reason.is_none_or(|r| header_str(&delivery, headers::REASON).as_deref() == Some(r));
        let work = topology.work().to_owned();
        let publisher = publisher.clone();
        if take {
            done.replayed += 1
        } else {
            done.kept += 1
        }
        async move {
            if take {
                let mut table = delivery.properties.headers().clone().unwrap_or_default();
                let own: Vec<ShortString> = table
                    .inner()
                    .keys()
                    .filter(|k| k.as_str().starts_with("x-turnstile-"))
                    .cloned()
                    .collect();
                let mut kept = FieldTable::default();
                for (k, v) in table.inner() {
                    if !own.contains(k) {
                        kept.insert(k.clone(), v.clone());
                    }
                }
                table = kept;
                let properties: BasicProperties = delivery.properties.clone().with_headers(table);
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
            Revived::Message(r, reason) => permits
                .complete(
                    &r.seller_id,
                    &r.message_id,
                    r.batch_id.as_ref(),
                    Completion::Dead(reason),
                    ttl,
                )
                .await
                .map(drop),
            Revived::Unidentified(reason) => permits.tally_dead(reason, 1).await,
        };
        if let Err(error) = undone {
            tracing::warn!(%error, "not republished, and still counted as waiting");
        }
    }
}
