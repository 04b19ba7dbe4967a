//! The delay ladder, moved on by the replicas themselves.
//!
//! Level k is a plain durable queue `<q>.wait.<k>` in which every message waits exactly
//! 2^k x [`UNIT`]. A delayed message carries its due time ([`headers::DUE`]) and the end of its
//! current hop ([`headers::HOP`]). Every replica consumes every level; a level's consumer takes
//! its messages in order, waits until the head's hop has ended, republishes it (confirmed) to the
//! next level — the highest whose wait still fits before the due time — or, with less than one
//! UNIT left, to the return queue `<q>.ready`, and only then acks it. The replicas consume the
//! return queue beside the work queue, so a message whose slot is due never waits behind the
//! work queue's backlog. Since all messages of a level wait the same time, a level's queue is
//! ordered by hop end: no short delay waits behind a long one.
//!
//! Why not the broker's own TTL + dead-lettering: a quorum queue's at-least-once dead-letter worker
//! that starts before its target exchange, queue or bindings are recovered after a broker restart
//! parks the expired messages and only retries every `dead_letter_worker_publisher_confirm_timeout`
//! (180 s by default, RabbitMQ 3.10 to 4.x), or never when its supervisor gave up
//! (rabbitmq/rabbitmq-server#12625 and #16652); classic queues dead-letter at most once and drop
//! them. Here nothing moves a message but a replica's confirmed publish followed by its ack: a
//! broker restart or a lost connection returns the unacked messages to their level, and the next
//! consumer moves them on at once if their hop is over. The cost: one consumer delivery per hop
//! (the popcount of the delay in UNITs, LEVELS at most per pass of 17 minutes).
//!
//! Every header is untrusted: a hop end that does not parse, or lies further ahead than the
//! level's own wait, is bounded by that wait counted from receipt; a due time further than
//! [`MAX_DELAY`] is cut to it; a message without a due time goes to the return queue at once.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use super::{Publisher, Topology, header_u64, headers, unix_ms};

/// The smallest delay step of the ladder.
pub const UNIT: Duration = Duration::from_millis(250);
/// Levels of the ladder: one pass waits up to (2^LEVELS - 1) x UNIT (about 17 minutes); a
/// longer delay goes round the top level again. The top level holds a message for 2^11 x UNIT
/// = 512 s, well inside RabbitMQ's default consumer timeout (30 minutes).
pub const LEVELS: u32 = 12;
/// The longest delay a message may carry (longer ones are cut to it).
pub const MAX_DELAY: Duration = Duration::from_secs(36 * 3600);
/// A hop that ends this much later than it should counts as overdue.
pub const OVERDUE: Duration = Duration::from_secs(1);

/// Where a delayed message goes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    /// Wait in level `level` until `until_ms` (Unix ms).
    Level { level: u32, until_ms: u64 },
    /// Due (less than one UNIT left): back to the consume path through the return queue
    /// `<q>.ready`.
    Ready,
}

/// How much later than its due time a hop may end: the few ms a replica takes to move a
/// message on, so that a delay of whole UNITs is not cut short by them.
pub const SLACK: Duration = Duration::from_millis(25);

/// The next hop of a message due at `due_ms`, at `now_ms`: the highest level whose wait ends
/// no later than the due time plus [`SLACK`] (greedy binary decomposition), or the return queue.
pub fn next_hop(now_ms: u64, due_ms: u64) -> Hop {
    let unit = UNIT.as_millis() as u64;
    let units = (due_ms + SLACK.as_millis() as u64).saturating_sub(now_ms) / unit;
    if units == 0 {
        return Hop::Ready;
    }
    let level = (63 - units.leading_zeros()).min(LEVELS - 1);
    Hop::Level {
        level,
        until_ms: now_ms + (unit << level),
    }
}

/// The wait of level `level`.
pub fn level_wait(level: u32) -> Duration {
    UNIT * (1u32 << level)
}

/// How long a message received at `now_ms` from a level that waits `wait` still has to wait:
/// until its hop's end, but never longer than the level's wait counted from now (a forged or
/// skewed hop end cannot hold the level), and not at all without a hop end.
pub fn remaining_wait(now_ms: u64, hop_until_ms: Option<u64>, wait: Duration) -> Duration {
    match hop_until_ms {
        Some(until) => Duration::from_millis(until.saturating_sub(now_ms)).min(wait),
        None => Duration::ZERO,
    }
}

/// The due time of a message delayed by `delay` at `now_ms` (capped at [`MAX_DELAY`]).
pub fn due_after(now_ms: u64, delay: Duration) -> u64 {
    now_ms + delay.min(MAX_DELAY).as_millis() as u64
}

/// What the ladder did in this replica (exported as metrics; read by tests and the dashboard).
#[derive(Debug, Default)]
pub struct LadderStats {
    /// Ladder messages this replica holds now (received, not yet moved on).
    pub held: AtomicUsize,
    /// Deliveries this replica's ladder consumers received.
    pub deliveries: AtomicU64,
    /// Of those, the deliveries handed straight to the workers when due (also counted in the
    /// worker's deliveries).
    pub handed: AtomicU64,
    /// Hops moved on (to the next level or the return queue).
    pub hops: AtomicU64,
    /// Hops that ended more than [`OVERDUE`] after their time (the message sat in the broker,
    /// e.g. during a broker restart or with no replica running).
    pub overdue: AtomicU64,
    /// The latest any message came back after its due time, in ms.
    pub max_late_ms: AtomicU64,
    /// Messages sent to the return queue before their due time because their reserved slot was
    /// given back (a release notice).
    pub released: AtomicU64,
    /// Deliveries taken from the return queue `<q>.ready` by this replica's workers (also
    /// counted in the worker's deliveries).
    pub returns: AtomicU64,
    /// Of those with a due time, the latest one was taken after it, in ms: the ladder's own
    /// lateness plus the wait in the return queue.
    pub max_return_late_ms: AtomicU64,
    /// The sum of how late (after their due time) those were taken, in ms (for a mean).
    pub return_late_ms: AtomicU64,
}

impl LadderStats {
    /// Counts a delivery taken from the return queue and how long after its due time it came.
    pub fn returned(&self, delivery: &Delivery) {
        self.returns.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("turnstile_delay_returns_total").increment(1);
        if let Some(due) = header_u64(delivery, headers::DUE) {
            let late = unix_ms().saturating_sub(due);
            self.max_return_late_ms.fetch_max(late, Ordering::Relaxed);
            self.return_late_ms.fetch_add(late, Ordering::Relaxed);
            metrics::histogram!("turnstile_delay_return_late_seconds").record(late as f64 / 1000.0);
        }
    }
}

/// Moves the ladder on: one consumer per level, on a channel of its own. Each level's loop runs
/// on `tracker` until `shutdown`; if the broker ends a consumer (a lost connection, a channel error), `failed`
/// is cancelled so that the replica reconnects.
pub struct Ladder {
    pub topology: Topology,
    pub publisher: Publisher,
    pub stats: Arc<LadderStats>,
    /// Where its acks and requeues are counted.
    pub cost: Arc<super::BrokerCost>,
    /// Messages each level's consumer holds at most.
    pub prefetch: u16,
    /// Release notices: each names, by a test over a delivery, messages that must not wait for
    /// the end of their delay any more (their reserved slot was given back) and go to the return
    /// queue at once.
    pub releases: tokio::sync::broadcast::Sender<Release>,
}

/// A test over a held delivery: whether it is released (see [`Ladder::releases`]).
pub type Release = Arc<dyn Fn(&Delivery) -> bool + Send + Sync>;

impl Ladder {
    /// Starts consuming every level on `connection`.
    pub async fn start(
        self: &Arc<Self>,
        connection: &Connection,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        failed: &CancellationToken,
    ) -> anyhow::Result<()> {
        let channel = connection
            .create_channel()
            .await
            .context("opening the delay ladder's channel")?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .context("setting the delay ladder's prefetch")?;
        for k in 0..LEVELS {
            let (queue, wait) = (self.topology.level(k), level_wait(k));
            let consumer = channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .with_context(|| format!("consuming the delay level {queue:?}"))?;
            let ladder = self.clone();
            let (inner, shutdown, failed) = (tracker.clone(), shutdown.clone(), failed.clone());
            tracker.spawn(async move {
                ladder
                    .run_level(consumer, wait, &inner, &shutdown, &failed)
                    .await
            });
        }
        Ok(())
    }

    /// Holds the level's messages in order of their hop's end (at most the prefetch) and moves
    /// each on when its hop is over; a release notice moves the messages it names on to the
    /// return queue at once.
    async fn run_level(
        self: Arc<Self>,
        mut consumer: lapin::Consumer,
        wait: Duration,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        failed: &CancellationToken,
    ) {
        let mut releases = self.releases.subscribe();
        let mut held: VecDeque<(Delivery, Option<u64>)> = VecDeque::new();
        loop {
            let head_wait = held
                .front()
                .map(|(_, hop_until)| remaining_wait(unix_ms(), *hop_until, wait));
            tokio::select! {
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        self.stats.held.fetch_add(1, Ordering::Relaxed);
                        self.stats.deliveries.fetch_add(1, Ordering::Relaxed);
                        let hop_until = header_u64(&delivery, headers::HOP);
                        held.push_back((delivery, hop_until));
                    }
                    Some(Err(error)) => {
                        debug!(%error, "delay ladder consumer ended");
                        failed.cancel();
                        break;
                    }
                    None => {
                        warn!("the broker cancelled a delay ladder consumer");
                        failed.cancel();
                        break;
                    }
                },
                _ = tokio::time::sleep(head_wait.unwrap_or_default()), if head_wait.is_some() => {
                    let (delivery, hop_until) = held.pop_front().expect("a head to wait for");
                    self.spawn_move_on(tracker, delivery, hop_until, false);
                }
                release = releases.recv() => {
                    let Ok(release) = release else { continue };
                    let (released, kept): (Vec<_>, Vec<_>) =
                        held.drain(..).partition(|(delivery, _)| release(delivery));
                    held = kept.into();
                    for (delivery, hop_until) in released {
                        self.spawn_move_on(tracker, delivery, hop_until, true);
                    }
                }
                _ = shutdown.cancelled() => break,
                _ = failed.cancelled() => break,
            }
        }
        // Unacked: the broker returns them to their level when the connection closes.
        self.stats.held.fetch_sub(held.len(), Ordering::Relaxed);
    }

    fn spawn_move_on(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        delivery: Delivery,
        hop_until: Option<u64>,
        released: bool,
    ) {
        let ladder = self.clone();
        tracker.spawn(async move {
            ladder.move_on(delivery, hop_until, released).await;
            ladder.stats.held.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Publishes the message to its next hop (confirmed) — the return queue when `released` —,
    /// then acks it; a failed publish returns it to its level.
    async fn move_on(&self, delivery: Delivery, hop_until: Option<u64>, released: bool) {
        let now = unix_ms();
        if released {
            self.stats.released.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("turnstile_delay_released_total").increment(1);
        } else if let Some(until) = hop_until
            && now.saturating_sub(until) > OVERDUE.as_millis() as u64
        {
            self.stats.overdue.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("turnstile_delay_overdue_total").increment(1);
        }
        let due = header_u64(&delivery, headers::DUE)
            .map(|due| due.min(due_after(now, MAX_DELAY)))
            .unwrap_or(now);
        let hop = if released {
            Hop::Ready
        } else {
            next_hop(now, due)
        };
        let published = self
            .publisher
            .hop(&self.topology, &delivery, hop, &[])
            .await;
        match published {
            Ok(()) => {
                self.stats.hops.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("turnstile_delay_hops_total").increment(1);
                if hop == Hop::Ready && !released {
                    let late = now.saturating_sub(due);
                    self.stats.max_late_ms.fetch_max(late, Ordering::Relaxed);
                    metrics::histogram!("turnstile_delay_late_seconds")
                        .record(late as f64 / 1000.0);
                }
                let acked = delivery.acker.ack(BasicAckOptions::default()).await;
                if acked.is_ok() {
                    super::BrokerCost::count(&self.cost.acks);
                }
                if let Err(error) = acked {
                    debug!(%error, "could not ack a moved ladder message (the broker redelivers it; the copy ahead is deduplicated by its completion record)");
                }
            }
            Err(error) => {
                warn!(%error, "could not move a delayed message on; returning it to its level");
                metrics::counter!("turnstile_broker_errors_total").increment(1);
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                };
                if delivery.acker.nack(requeue).await.is_ok() {
                    super::BrokerCost::count(&self.cost.requeues);
                }
            }
        }
    }
}

/// The headers of a message entering `hop` (its due time is kept from the delivery).
pub(super) fn hop_headers(hop: Hop) -> Vec<(&'static str, AMQPValue)> {
    match hop {
        Hop::Level { until_ms, .. } => {
            vec![(headers::HOP, AMQPValue::LongLongInt(until_ms as i64))]
        }
        Hop::Ready => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: u64 = 250;

    #[test]
    fn a_delay_takes_one_hop_per_set_bit_highest_first() {
        // 1,300 ms = 5 units (+50 ms): level 2 (1,000 ms), then level 0 (250 ms), then the return queue.
        let mut now = 10_000;
        let due = now + 1_300;
        let mut levels = Vec::new();
        while let Hop::Level { level, until_ms } = next_hop(now, due) {
            assert_eq!(until_ms, now + (U << level));
            assert!(
                until_ms <= due + SLACK.as_millis() as u64,
                "a hop never ends after the due time"
            );
            levels.push(level);
            now = until_ms;
        }
        assert_eq!(levels, [2, 0]);
        assert!(due + 25 - now < U, "back less than one unit early");
    }

    #[test]
    fn long_delays_go_round_the_top_level() {
        let top = LEVELS - 1;
        let due = 3_600_000; // one hour
        let mut now = 0;
        let mut hops = 0;
        while let Hop::Level { level, until_ms } = next_hop(now, due) {
            if due - now >= U << LEVELS {
                assert_eq!(level, top);
            }
            now = until_ms;
            hops += 1;
        }
        assert!(due + 25 - now < U);
        assert!(hops <= 3600 / 512 + LEVELS as usize, "{hops} hops");
    }

    #[test]
    fn a_message_due_now_or_in_the_past_goes_to_the_return_queue() {
        assert_eq!(next_hop(1_000, 1_000), Hop::Ready);
        assert_eq!(next_hop(1_000, 1_224), Hop::Ready);
        assert!(matches!(
            next_hop(1_000, 1_225),
            Hop::Level { level: 0, .. }
        ));
        assert_eq!(next_hop(5_000, 1_000), Hop::Ready);
        assert_eq!(
            next_hop(1_000, 1_250),
            Hop::Level {
                level: 0,
                until_ms: 1_250
            }
        );
    }

    #[test]
    fn a_forged_hop_end_cannot_hold_a_level_longer_than_its_wait() {
        let wait = level_wait(3);
        assert_eq!(remaining_wait(0, Some(u64::MAX), wait), wait);
        assert_eq!(
            remaining_wait(0, Some(500), wait),
            Duration::from_millis(500)
        );
        assert_eq!(remaining_wait(9_000, Some(500), wait), Duration::ZERO);
        assert_eq!(remaining_wait(0, None, wait), Duration::ZERO);
    }

    #[test]
    fn due_times_are_capped() {
        assert_eq!(due_after(0, Duration::from_secs(1)), 1_000);
        assert_eq!(
            due_after(0, Duration::from_secs(u64::MAX / 4)),
            MAX_DELAY.as_millis() as u64
        );
    }
}
