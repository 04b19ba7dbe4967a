//! The calendar: where a message waits that has longer to wait than the delay ladder's top
//! level holds (about 17 minutes).
//!
//! A replica may hold a delivery unacked only so long (RabbitMQ's consumer timeout, 30 minutes
//! by default, counts from the delivery), so the ladder's top level holds a message at most
//! 1,024 s; a longer wait used to be republished once per 1,024 s. Instead, such a message is
//! published once to the calendar queue of its due time, `<q>.at.<slot>` (slots of
//! [`CALENDAR_SLOT`], 512 s, in Unix time), declared by the publisher on first use. No replica
//! consumes that queue before [`calendar_opens_ms`]: the top level's hold before the slot ends,
//! so no message of it is held longer than the top level holds one, and a message goes to the
//! calendar only with more than that hold left, so its queue is not consumed yet when it is
//! published. From then on every replica consumes it as it consumes a level: each message is
//! held until its due time and handed straight to the replica's workers. So a message costs two
//! deliveries (the work queue's and its slot's) however long it waits, up to
//! [`super::ladder::MAX_DELAY`].
//!
//! A replica stops consuming a slot's queue a minute after the slot ends, once it holds nothing
//! from it, and deletes the queue if it is unused and empty (the last replica to stop deletes
//! it). Slots whose queues may still hold messages — a replica that crashed holding some, the
//! whole fleet down through a slot — are found by probing (a passive declare): when a replica
//! starts, the slots of the last two hours; every minute, the open slots and those this replica
//! stopped consuming in the last two hours without deleting their queue; and once, from half a
//! minute after it starts, every slot of the last [`super::ladder::MAX_DELAY`] and an hour. A
//! past slot with messages ready is consumed again, and its messages, all due, are handed on at
//! once. A probe of a queue that does not exist is a channel error the broker logs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use super::ladder::{
    CALENDAR_SLOT, LEVELS, Ladder, Level, MAX_DELAY, calendar_ends_ms, calendar_opens_ms,
    level_hold, open_calendar_slot,
};
use super::{Settler, unix_ms};

/// How long after its slot ends a replica keeps consuming a calendar queue: a copy published
/// by a replica whose clock is behind, or returned by a lost connection, still finds a consumer.
const GRACE: Duration = Duration::from_secs(60);
/// How often the open slots and the recent undeleted ones are probed.
const SWEEP: Duration = Duration::from_secs(60);
/// The recent past probed at start and kept in the sweep: two hours of slots.
const RECENT: Duration = Duration::from_secs(2 * 3600);
/// How long after its start a replica probes every slot of the last [`MAX_DELAY`] and an hour
/// (a replica that lives less does not; the sweeps of the others do), and the pause between
/// two of those probes.
const DEEP_SWEEP_AFTER: Duration = Duration::from_secs(30);
const DEEP_SWEEP_PACE: Duration = Duration::from_millis(20);

/// A replica's consumers of the calendar's queues, on the ladder's channel.
pub(super) struct Calendar {
    pub(super) ladder: Arc<Ladder>,
    pub(super) channel: Channel,
    pub(super) settler: Settler,
}

/// The slot of `ms` (Unix ms).
fn slot_of(ms: u64) -> u64 {
    ms / CALENDAR_SLOT.as_millis() as u64
}

/// Whether `slot` is over at `now_ms`: ended more than [`GRACE`] ago.
fn over(slot: u64, now_ms: u64) -> bool {
    now_ms > calendar_ends_ms(slot) + GRACE.as_millis() as u64
}

/// Whether a replica consumes the queue of `slot`, found with `ready` messages at `now_ms`: an
/// open slot always; one that is over only while messages are left in it.
fn worth_consuming(slot: u64, ready: u32, now_ms: u64) -> bool {
    now_ms >= calendar_opens_ms(slot) && (!over(slot, now_ms) || ready > 0)
}

impl Calendar {
    /// Consumes each calendar queue from its slot's opening until it is over, until `shutdown`
    /// or `failed` (a lost connection: the next connection's calendar starts afresh).
    pub(super) async fn run(
        self,
        connection: Arc<Connection>,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        failed: &CancellationToken,
    ) {
        let started = unix_ms();
        // The slots consumed here, each with what retires its consumer (cancelled once over).
        let mut consuming: BTreeMap<u64, CancellationToken> = BTreeMap::new();
        // Slots this replica stopped consuming whose queue it could not delete (still used by
        // others, or not empty): swept every minute for two hours, for what may be left.
        let mut undeleted: BTreeSet<u64> = BTreeSet::new();
        let finished: Arc<Mutex<Vec<u64>>> = Arc::default();
        let woken = Arc::new(Notify::new());
        let mut probe: Option<Channel> = None;
        let recent = slot_of(RECENT.as_millis() as u64);
        let mut open = open_calendar_slot(started);
        let mut due: Vec<u64> = (open.saturating_sub(recent)..=open).collect();
        let mut deep: Vec<u64> = {
            let back = slot_of((MAX_DELAY + Duration::from_secs(3600)).as_millis() as u64);
            (open.saturating_sub(back)..open.saturating_sub(recent)).collect()
        };
        let mut next_sweep = started + SWEEP.as_millis() as u64;
        loop {
            let now = unix_ms();
            // A paced deep probe, once the replica has run a while.
            if now >= started + DEEP_SWEEP_AFTER.as_millis() as u64
                && let Some(slot) = deep.pop()
            {
                due.push(slot);
            }
            for slot in std::mem::take(&mut due) {
                if consuming.contains_key(&slot) {
                    continue;
                }
                let Some(ready) = self.probe(&connection, &mut probe, slot).await else {
                    undeleted.remove(&slot);
                    continue;
                };
                if worth_consuming(slot, ready, now) {
                    match self
                        .consume(slot, tracker, shutdown, failed, &finished, &woken)
                        .await
                    {
                        Some(retire) => {
                            consuming.insert(slot, retire);
                        }
                        None => return,
                    }
                }
            }
            for (slot, retire) in &consuming {
                if over(*slot, now) {
                    retire.cancel();
                }
            }
            let done: Vec<u64> = std::mem::take(&mut *finished.lock().expect("never poisoned"));
            for slot in done {
                consuming.remove(&slot);
                if !self.delete_if_unused(&connection, &mut probe, slot).await {
                    undeleted.insert(slot);
                }
            }
            let next_open = calendar_opens_ms(open + 1);
            let mut wake_at = next_open.min(next_sweep);
            // The next slot to retire (one retired already waits for its consumer to end).
            if let Some(over_at) = consuming
                .iter()
                .filter(|(_, retire)| !retire.is_cancelled())
                .map(|(slot, _)| calendar_ends_ms(*slot) + GRACE.as_millis() as u64 + 1)
                .min()
            {
                wake_at = wake_at.min(over_at);
            }
            if !deep.is_empty() {
                wake_at = wake_at.min(
                    (started + DEEP_SWEEP_AFTER.as_millis() as u64)
                        .max(now + DEEP_SWEEP_PACE.as_millis() as u64),
                );
            }
            let wait = Duration::from_millis(wake_at.saturating_sub(now));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = woken.notified() => {}
                _ = shutdown.cancelled() => break,
                _ = failed.cancelled() => break,
            }
            let now = unix_ms();
            let newly = open_calendar_slot(now);
            if newly > open {
                due.extend(open + 1..=newly);
                open = newly;
            }
            if now >= next_sweep {
                undeleted.retain(|slot| *slot + recent >= open);
                due.extend(undeleted.iter().copied());
                due.extend(open.saturating_sub(1)..=open);
                next_sweep = now + SWEEP.as_millis() as u64;
            }
        }
        if let Some(probe) = probe {
            let _ = probe.close(200, "calendar done".into()).await;
        }
    }

    /// The messages ready in the queue of `slot`, or `None` if it does not exist (or the broker
    /// could not be asked: the next sweep asks again). A passive declare of a missing queue
    /// closes its channel: the probe has a channel of its own, opened again as needed.
    async fn probe(
        &self,
        connection: &Connection,
        probe: &mut Option<Channel>,
        slot: u64,
    ) -> Option<u32> {
        let channel = match probe {
            Some(channel) if channel.status().connected() => channel.clone(),
            _ => {
                let channel = connection.create_channel().await.ok()?;
                *probe = Some(channel.clone());
                channel
            }
        };
        let queue = self.ladder.topology.calendar(slot);
        match channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
        {
            Ok(found) => Some(found.message_count()),
            Err(_) => {
                *probe = None;
                None
            }
        }
    }

    /// Starts consuming the queue of `slot` on the ladder's channel, held as a level's (the top
    /// level's hold); returns what retires the consumer, or `None` if the channel failed (the
    /// replica reconnects).
    async fn consume(
        &self,
        slot: u64,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        failed: &CancellationToken,
        finished: &Arc<Mutex<Vec<u64>>>,
        woken: &Arc<Notify>,
    ) -> Option<CancellationToken> {
        let queue = self.ladder.topology.calendar(slot);
        let consumer = match self
            .channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
        {
            Ok(consumer) => consumer,
            Err(error) => {
                debug!(%error, queue, "could not consume a calendar queue; reconnecting");
                failed.cancel();
                return None;
            }
        };
        debug!(queue, "consuming a calendar queue");
        let retire = CancellationToken::new();
        let level = Level {
            hold: level_hold(LEVELS - 1),
            settler: self.settler.clone(),
        };
        let (ladder, channel) = (self.ladder.clone(), self.channel.clone());
        let (inner, stop, lost) = (tracker.clone(), shutdown.clone(), failed.clone());
        let (finished, woken, retiring) = (finished.clone(), woken.clone(), retire.clone());
        tracker.spawn(async move {
            ladder
                .run_level(
                    consumer,
                    level,
                    &inner,
                    &stop,
                    &lost,
                    Some((retiring, channel)),
                )
                .await;
            finished.lock().expect("never poisoned").push(slot);
            woken.notify_one();
        });
        Some(retire)
    }

    /// Deletes the queue of `slot` if no replica consumes it and nothing is ready in it; whether
    /// it is gone. The broker refuses otherwise, closing the probe's channel: another replica
    /// deletes it, or a sweep finds what is left.
    async fn delete_if_unused(
        &self,
        connection: &Connection,
        probe: &mut Option<Channel>,
        slot: u64,
    ) -> bool {
        let Some(channel) = (match probe {
            Some(channel) if channel.status().connected() => Some(channel.clone()),
            _ => connection.create_channel().await.ok(),
        }) else {
            return false;
        };
        *probe = Some(channel.clone());
        let queue = self.ladder.topology.calendar(slot);
        let deleted = channel
            .queue_delete(
                queue.as_str().into(),
                QueueDeleteOptions {
                    if_unused: true,
                    if_empty: true,
                    ..Default::default()
                },
            )
            .await;
        if deleted.is_err() {
            *probe = None;
        }
        deleted.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::ladder::{Hop, calendar_slot, next_hop};

    const MINUTE: u64 = 60_000;

    #[test]
    fn a_wait_longer_than_the_top_level_holds_goes_once_to_the_calendar_queue_of_its_due_time() {
        let now = 1_800_000_000_000;
        for wait in [1_025_000, 30 * MINUTE, 3 * 60 * MINUTE, 36 * 60 * MINUTE] {
            let due = now + wait;
            let Hop::Calendar { slot, until_ms } = next_hop(now, due) else {
                panic!("a wait of {wait} ms goes to the calendar");
            };
            assert_eq!((slot, until_ms), (calendar_slot(due), due));
            assert!(
                calendar_opens_ms(slot) > now,
                "its queue is not consumed yet when it is published"
            );
            assert!(
                calendar_ends_ms(slot) - calendar_opens_ms(slot)
                    <= level_hold(LEVELS - 1).as_millis() as u64,
                "no message of it is held longer than the top level holds one"
            );
            assert!(calendar_opens_ms(slot) <= due && due < calendar_ends_ms(slot));
        }
        assert!(matches!(
            next_hop(now, now + 1_000_000),
            Hop::Level { level: 11, .. }
        ));
    }

    #[test]
    fn the_open_slots_are_those_whose_opening_has_come() {
        let now = 1_800_000_123_456;
        let open = open_calendar_slot(now);
        assert!(calendar_opens_ms(open) <= now);
        assert!(calendar_opens_ms(open + 1) > now);
        // The open slots: the one running now and the next one.
        assert_eq!(open, slot_of(now) + 1);
    }

    #[test]
    fn a_slot_is_consumed_while_open_and_after_it_is_over_only_with_messages_left() {
        let slot = 3_515_625;
        let opens = calendar_opens_ms(slot);
        let ends = calendar_ends_ms(slot);
        assert!(!worth_consuming(slot, 5, opens - 1), "not before it opens");
        assert!(worth_consuming(slot, 0, opens));
        assert!(worth_consuming(slot, 0, ends + GRACE.as_millis() as u64));
        let later = ends + GRACE.as_millis() as u64 + 1;
        assert!(
            !worth_consuming(slot, 0, later),
            "an empty past slot is left"
        );
        assert!(
            worth_consuming(slot, 1, later),
            "what is left in a past one is handed on"
        );
    }
}
