//! The delay ladder: where a throttled message waits at the broker, held by the replicas.
//!
//! Level k is a plain durable queue `<q>.wait.<k>` for messages with 2^k to 2^(k+1) x [`UNIT`]
//! left to wait. A delayed message carries its due time ([`headers::DUE`]) and the end of its
//! wait in its level ([`headers::HOP`]): its due time, or at most the level's hold
//! ([`Holds::level`]) later. Every replica consumes every level with a generous prefetch and holds
//! each message, unacked, until its own hold ends: then a message that is due is handed straight
//! to the replica's workers, the level's delivery being the one they settle (no republish, no
//! other queue), and one that is not (a wait longer than the top level holds) is republished,
//! confirmed, to the level of what is left, and only then acked. So a delayed message costs one
//! delivery from its level, however long its wait, up to the longest hold ([`Holds`]); each
//! further longest hold one more.
//!
//! The longest hold follows the broker's consumer timeout as the operator set it
//! (`TURNSTILE_CONSUMER_TIMEOUT`, RabbitMQ's `consumer_timeout`, 30 minutes by default): a
//! quarter of it (at most 10 minutes) is left for the worker's call after the hold, so 22.5
//! minutes by default, and an operator who raises the timeout gets fewer hops. A broker that
//! closes a ladder channel for an ack timeout names the value it used; the replica then holds
//! under that value for the rest of its life ([`AckTimeout::learned`]), and says so.
//!
//! The levels only bound disorder: a level's consumer holds at most its prefetch, so when a
//! level holds more messages than its consumers take, the others wait in the queue, in the
//! order they came. Those of one level have due times within a factor of two of each other:
//! one seller's messages come in the order of their slots, and no short wait sits behind a long
//! one of another level.
//!
//! Why not the broker's own TTL + dead-lettering: a quorum queue's at-least-once dead-letter worker
//! that starts before its target exchange, queue or bindings are recovered after a broker restart
//! parks the expired messages and only retries every `dead_letter_worker_publisher_confirm_timeout`
//! (180 s by default, RabbitMQ 3.10 to 4.x), or never when its supervisor gave up
//! (rabbitmq/rabbitmq-server#12625 and #16652); classic queues dead-letter at most once and drop
//! them. Here nothing moves a message but a replica: a broker restart or a lost connection
//! returns the unacked messages to their level (those handed to the workers too), and the next
//! consumer holds them for the rest of their wait, or hands them on at once. A message that
//! came back to its level that way [`HANDED_RETURNS`] times (or once, on a classic level) is
//! not handed to the workers but republished to the return queue `<q>.ready`, whose delivery
//! limit dead-letters a message that keeps crashing replicas, as the work queue's does.
//!
//! Every header is untrusted: a hop end that does not parse, or lies further ahead than the
//! level's own hold, is bounded by that hold counted from receipt; a due time further than
//! [`MAX_DELAY`] is cut to it; a message without a due time is due at once. The slot a handed
//! message comes back for is checked on Redis by the worker, as every other.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, warn};

use super::{PublishError, Publisher, Settler, Topology, header_u64, headers};
use crate::config::ConsumerTimeout;
use crate::domain::unix_ms;

/// The smallest delay step of the ladder.
pub const UNIT: Duration = Duration::from_millis(250);
/// Levels of the ladder: level k takes waits of 2^k to 2^(k+1) x UNIT; the top level takes
/// every longer one and holds a message as long as the broker's consumer timeout allows
/// ([`Holds::longest`]).
pub const LEVELS: u32 = 12;
/// Messages each level's consumer holds at most, by default (TURNSTILE_DELAY_PREFETCH): a
/// replica holds at most LEVELS times as many delayed messages, bodies included.
pub const DEFAULT_PREFETCH: u16 = 256;
/// The longest delay a message may carry (longer ones are cut to it).
pub const MAX_DELAY: Duration = Duration::from_secs(36 * 3600);
/// A hop that ends this much later than it should counts as overdue.
pub const OVERDUE: Duration = Duration::from_secs(1);

/// Where a delayed message goes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    /// Wait in level `level` until `until_ms` (Unix ms).
    Level { level: u32, until_ms: u64 },
    /// Due (less than one UNIT left): back to the consume path, handed to the workers by the
    /// level's consumer, or published to the return queue `<q>.ready`.
    Ready,
}

/// How much later than its due time a hop may end: the few ms a replica takes to move a
/// message on, so that a delay of whole UNITs is not cut short by them.
pub const SLACK: Duration = Duration::from_millis(25);

/// How long the ladder may hold one delivery under a broker's consumer timeout: each level at
/// most the upper end of its waits, and none longer than [`Holds::longest`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holds {
    longest: Duration,
}

impl Holds {
    /// The most of a consumer timeout left for what follows a hold: the wait for a free
    /// worker, the call and the ack.
    pub const MOST_LEFT: Duration = Duration::from_secs(10 * 60);

    /// The holds under `timeout`: the longest is the timeout less a quarter of it, and at most
    /// [`Holds::MOST_LEFT`] less (22.5 minutes under RabbitMQ's default 30, 110 under 2 hours);
    /// [`MAX_DELAY`] without a timeout.
    pub fn under(timeout: ConsumerTimeout) -> Self {
        Self::at_most(match timeout.get() {
            Some(timeout) => timeout - (timeout / 4).min(Self::MOST_LEFT),
            None => MAX_DELAY,
        })
    }

    /// Holds whose longest is `longest` (at least one UNIT, at most [`MAX_DELAY`]), whatever
    /// the timeout: e.g. the fixed 1,024 s top hold of the ladder before the consumer timeout
    /// was a setting, as a baseline.
    pub fn at_most(longest: Duration) -> Self {
        Self {
            longest: longest.clamp(UNIT, MAX_DELAY),
        }
    }

    /// The longest any level holds a message: the top level's hold.
    pub fn longest(&self) -> Duration {
        self.longest
    }

    /// The longest a message waits in level `level` from its receipt: 2^(level+1) x UNIT, the
    /// upper end of the level's waits, and at most [`Holds::longest`]; the top level holds
    /// [`Holds::longest`].
    pub fn level(&self, level: u32) -> Duration {
        if level >= LEVELS - 1 {
            return self.longest;
        }
        (UNIT * (2u32 << level)).min(self.longest)
    }

    /// The next hop of a message due at `due_ms`, at `now_ms`: the level of the time left (the
    /// highest level k with 2^k UNITs left, counting [`SLACK`]), held until the due time or for
    /// at most that level's hold; with less than one UNIT left, the consume path.
    pub fn next_hop(&self, now_ms: u64, due_ms: u64) -> Hop {
        let unit = UNIT.as_millis() as u64;
        let units = (due_ms + SLACK.as_millis() as u64).saturating_sub(now_ms) / unit;
        if units == 0 {
            return Hop::Ready;
        }
        let level = (63 - units.leading_zeros()).min(LEVELS - 1);
        Hop::Level {
            level,
            until_ms: due_ms.min(now_ms + self.level(level).as_millis() as u64),
        }
    }
}

impl Default for Holds {
    fn default() -> Self {
        Self::under(ConsumerTimeout::default())
    }
}

/// The consumer timeout a replica holds under: the one set, lowered for the rest of the
/// process to the one the broker named when it closed a ladder channel for an ack timeout.
#[derive(Debug, Default)]
pub struct AckTimeout {
    set: ConsumerTimeout,
    /// The broker's own, in ms, once it named one lower than `set` (0: none).
    learned_ms: AtomicU64,
}

impl AckTimeout {
    /// Holding under `set` until the broker says otherwise.
    pub fn new(set: ConsumerTimeout) -> Self {
        Self {
            set,
            learned_ms: AtomicU64::new(0),
        }
    }

    /// The timeout the operator set.
    pub fn set(&self) -> ConsumerTimeout {
        self.set
    }

    /// The timeout held under now: the one set, or the broker's if it named a lower one.
    pub fn in_force(&self) -> ConsumerTimeout {
        match self.learned_ms.load(Ordering::Relaxed) {
            0 => self.set,
            ms => ConsumerTimeout::new(Some(Duration::from_millis(ms))),
        }
    }

    /// The holds under the timeout in force.
    pub fn holds(&self) -> Holds {
        Holds::under(self.in_force())
    }

    /// The broker closed a channel for an ack timeout of `broker`: from now on hold under it if
    /// it is lower than the timeout in force. Returns the new holds the first time it lowers
    /// them (so that one closing is reported once, not by every level's consumer).
    pub fn learned(&self, broker: Duration) -> Option<Holds> {
        let broker_ms = (broker.as_millis() as u64).max(1);
        let mut current = self.learned_ms.load(Ordering::Relaxed);
        loop {
            let in_force = match current {
                0 => self.set.get().map_or(u64::MAX, |t| t.as_millis() as u64),
                ms => ms,
            };
            if broker_ms >= in_force {
                return None;
            }
            match self.learned_ms.compare_exchange(
                current,
                broker_ms,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.holds()),
                Err(now) => current = now,
            }
        }
    }
}

/// The ack timeout a broker names when it closes a channel for one, read from the error's text
/// (RabbitMQ: "delivery acknowledgement on channel 1 timed out. Timeout value used: 1800000
/// ms. …", or "Consumer … has timed out waiting for delivery acknowledgement. Timeout used: …
/// ms. …"); `None` for any other error.
pub fn ack_timeout_named(error: &str) -> Option<Duration> {
    if !error.contains("timed out") {
        return None;
    }
    let (_, after) = error.split_once("used: ")?;
    let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 || digits > 15 || !after[digits..].trim_start().starts_with("ms") {
        return None;
    }
    after[..digits].parse().ok().map(Duration::from_millis)
}

/// How long a message received at `now_ms` from a level that holds at most `wait` still has
/// to wait: until its hop's end, but never longer than the level's hold counted from now (a
/// forged or skewed hop end cannot hold the level), and not at all without a hop end.
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
    /// Messages republished (to another level, or due to the return queue) and acked.
    pub hops: AtomicU64,
    /// Hops that ended more than [`OVERDUE`] after their time (the message sat in the broker,
    /// e.g. during a broker restart or with no replica running).
    pub overdue: AtomicU64,
    /// When the last of those ended (Unix ms; 0: none yet).
    pub last_overdue_ms: AtomicU64,
    /// The latest any message came back after its due time, in ms.
    pub max_late_ms: AtomicU64,
    /// Messages moved on before their due time because their reserved slot was given back (a
    /// release notice).
    pub released: AtomicU64,
    /// Deliveries taken from the return queue `<q>.ready` by this replica's workers (also
    /// counted in the worker's deliveries).
    pub returns: AtomicU64,
    /// Of those with a due time, the latest one was taken after it, in ms: the ladder's own
    /// lateness plus the wait in the return queue.
    pub max_return_late_ms: AtomicU64,
    /// The sum of how late (after their due time) those were taken, in ms (for a mean).
    pub return_late_ms: AtomicU64,
    /// The messages held now, by seller (see [`HeldIndex`]).
    pub by_seller: HeldIndex,
}

/// The messages a replica's ladder holds now, by seller: each one's message id and when its
/// hold ends (Unix ms). Bounded by what the ladder holds (its levels' prefetch), so by the
/// prefetch, not by the queue: a message in the ladder's queues and not held is not in it.
#[derive(Debug, Default)]
pub struct HeldIndex {
    sellers: std::sync::Mutex<HashMap<String, HeldOfSeller>>,
    next: AtomicU64,
}

/// A seller's held messages: (end of hold in Unix ms, a sequence number, message id).
type HeldOfSeller = BTreeSet<(u64, u64, String)>;

/// A held message's place in the [`HeldIndex`], to take it out again.
#[derive(Debug)]
struct Indexed {
    seller: String,
    key: (u64, u64, String),
}

/// What one replica holds of one seller, as its summary says it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeldSummary {
    /// Messages held.
    pub held: u64,
    /// When the first and the last of their holds end (Unix ms).
    pub next_ms: u64,
    pub last_ms: u64,
    /// The soonest of them: message id and when its hold ends.
    pub soonest: Vec<(String, u64)>,
}

impl HeldIndex {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, HeldOfSeller>> {
        self.sellers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes a delivery held until `end_ms`, if its body names a seller.
    fn hold(&self, delivery: &Delivery, end_ms: u64) -> Option<Indexed> {
        let identity = super::identity_of(delivery);
        let seller = identity.seller_id?.as_str().to_owned();
        let message = identity
            .message_id
            .map(|m| m.as_str().to_owned())
            .unwrap_or_default();
        let key = (end_ms, self.next.fetch_add(1, Ordering::Relaxed), message);
        self.lock()
            .entry(seller.clone())
            .or_default()
            .insert(key.clone());
        Some(Indexed { seller, key })
    }

    /// Takes a held message out (moved on, released, or returned to the broker).
    fn release(&self, indexed: Option<Indexed>) {
        let Some(Indexed { seller, key }) = indexed else {
            return;
        };
        let mut sellers = self.lock();
        if let Some(held) = sellers.get_mut(&seller) {
            held.remove(&key);
            if held.is_empty() {
                sellers.remove(&seller);
            }
        }
    }

    /// The `most` sellers it holds most of (most first), each with its `shown` soonest
    /// messages.
    pub fn largest(&self, most: usize, shown: usize) -> Vec<(String, HeldSummary)> {
        let sellers = self.lock();
        let mut largest: Vec<(&String, &HeldOfSeller)> = sellers.iter().collect();
        largest.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.0.cmp(b.0)));
        largest
            .into_iter()
            .take(most)
            .map(|(seller, held)| (seller.clone(), summary(held, shown)))
            .collect()
    }
}

fn summary(held: &HeldOfSeller, shown: usize) -> HeldSummary {
    HeldSummary {
        held: held.len() as u64,
        next_ms: held.first().map_or(0, |(end, ..)| *end),
        last_ms: held.last().map_or(0, |(end, ..)| *end),
        soonest: held
            .iter()
            .take(shown)
            .map(|(end, _, message)| (message.clone(), *end))
            .collect(),
    }
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

/// Hands a due ladder delivery to the workers, with the settler of its channel (the workers
/// settle it as any other delivery).
pub type Handoff = Arc<dyn Fn(Delivery, Settler) + Send + Sync>;

/// Holds the ladder's messages: one consumer per level, all on a channel of their own. Each
/// level's loop runs on `tracker` until `shutdown`; if the broker ends a consumer (a lost
/// connection, a channel error), `failed` is cancelled so that the replica reconnects.
pub struct Ladder {
    pub topology: Topology,
    pub publisher: Publisher,
    pub stats: Arc<LadderStats>,
    /// Where its acks and requeues are counted.
    pub cost: Arc<super::BrokerCost>,
    /// Messages each level's consumer holds at most.
    pub prefetch: u16,
    /// Release notices: each names, by a test over a delivery, messages that must not wait for
    /// the end of their delay any more (their reserved slot was given back) and go back to the
    /// consume path at once.
    pub releases: tokio::sync::broadcast::Sender<Release>,
    /// The tag of the fleet's terms in force (see `permit::applied`): a message delayed under
    /// other terms goes back to the consume path at once, whether it is held when they change
    /// or received after, to ask anew under the terms in force.
    pub terms: tokio::sync::watch::Receiver<crate::permit::applied::InForce>,
    /// Where due messages go: the replica's workers; without one, the return queue.
    pub handoff: Option<Handoff>,
}

/// A test over a held delivery: whether it is released (see [`Ladder::releases`]).
pub type Release = Arc<dyn Fn(&Delivery) -> bool + Send + Sync>;

impl Ladder {
    /// Starts consuming every level on `connection`; returns the settler of the ladder's
    /// channel (whose batched acks must be flushed before the connection is closed).
    pub async fn start(
        self: &Arc<Self>,
        connection: &Connection,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        failed: &CancellationToken,
    ) -> anyhow::Result<Settler> {
        let channel = connection
            .create_channel()
            .await
            .context("opening the delay ladder's channel")?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .context("setting the delay ladder's prefetch")?;
        let holds = self.topology.holds();
        metrics::gauge!("turnstile_delay_longest_hold_seconds").set(holds.longest().as_secs_f64());
        // Each level's consumer records its own deliveries: not in the channel's tag order.
        let settler = Settler::new(channel.clone())
            .singly()
            .counting(self.cost.clone());
        for k in 0..LEVELS {
            let queue = self.topology.level(k);
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
            let settler = settler.clone();
            tracker.spawn(async move {
                let level = Level {
                    hold: holds.level(k),
                    settler,
                };
                ladder
                    .run_level(consumer, level, &inner, &shutdown, &failed)
                    .await
            });
        }
        Ok(settler)
    }

    /// Holds the level's messages (at most the prefetch), each until its hold ends, and then
    /// moves it on; a release notice moves the messages it names on at once.
    async fn run_level(
        self: Arc<Self>,
        mut consumer: lapin::Consumer,
        level: Level,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        failed: &CancellationToken,
    ) {
        let mut releases = self.releases.subscribe();
        let mut terms = self.terms.clone();
        let stale = |delivery: &Delivery, now: u64| {
            crate::permit::applied::stale_terms(header_u64(delivery, headers::TERMS), now)
        };
        // By the end of their hold (Unix ms), then in order of receipt; each with its place in
        // the index by seller.
        let mut held: BTreeMap<(u64, u64), (Delivery, Option<Indexed>)> = BTreeMap::new();
        let mut received = 0u64;
        loop {
            let head_wait = held
                .first_key_value()
                .map(|((end, _), _)| Duration::from_millis(end.saturating_sub(unix_ms())));
            tokio::select! {
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        level.settler.received(delivery.delivery_tag);
                        self.stats.held.fetch_add(1, Ordering::Relaxed);
                        self.stats.deliveries.fetch_add(1, Ordering::Relaxed);
                        if stale(&delivery, terms.borrow().tag) {
                            self.spawn_move_on(tracker, delivery, &level.settler, true);
                            continue;
                        }
                        let now = unix_ms();
                        let hop_until = header_u64(&delivery, headers::HOP);
                        let end = now + remaining_wait(now, hop_until, level.hold).as_millis() as u64;
                        let indexed = self.stats.by_seller.hold(&delivery, end);
                        held.insert((end, received), (delivery, indexed));
                        received += 1;
                    }
                    Some(Err(error)) => {
                        self.learn_ack_timeout(&error.to_string());
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
                    let (_, (delivery, indexed)) = held.pop_first().expect("a head to wait for");
                    self.stats.by_seller.release(indexed);
                    self.spawn_move_on(tracker, delivery, &level.settler, false);
                }
                Ok(()) = terms.changed() => {
                    let now = terms.borrow_and_update().tag;
                    self.release_held(&mut held, |d| stale(d, now), tracker, &level.settler);
                }
                release = releases.recv() => {
                    let Ok(release) = release else { continue };
                    self.release_held(&mut held, |d| release(d), tracker, &level.settler);
                }
                _ = shutdown.cancelled() => break,
                _ = failed.cancelled() => break,
            }
        }
        // Unacked: the broker returns them to their level when the connection closes.
        self.stats.held.fetch_sub(held.len(), Ordering::Relaxed);
        for (_, (_, indexed)) in held {
            self.stats.by_seller.release(indexed);
        }
    }

    /// A ladder consumer ended with `error`: if the broker closed the channel for an ack
    /// timeout lower than the one held under, hold under the broker's from now on (the
    /// deliveries it returned are received again and held for the rest of their wait).
    fn learn_ack_timeout(&self, error: &str) {
        let Some(broker) = ack_timeout_named(error) else {
            return;
        };
        metrics::counter!("turnstile_delay_ack_timeouts_total").increment(1);
        let set = self.topology.ack_timeout().set();
        match self.topology.ack_timeout().learned(broker) {
            Some(holds) => error!(
                broker_consumer_timeout_ms = broker.as_millis() as u64,
                consumer_timeout = %set,
                longest_hold_s = holds.longest().as_secs(),
                "the broker closed the delay ladder's channel for an ack timeout shorter than TURNSTILE_CONSUMER_TIMEOUT says: holding under the broker's from now on; set TURNSTILE_CONSUMER_TIMEOUT to the broker's consumer_timeout"
            ),
            None => warn!(
                broker_consumer_timeout_ms = broker.as_millis() as u64,
                consumer_timeout = %set,
                "the broker closed the delay ladder's channel for an ack timeout (a worker or the host was stalled longer than the margin left after a hold)"
            ),
        }
    }

    /// Moves on at once every held delivery `released` names.
    fn release_held(
        self: &Arc<Self>,
        held: &mut BTreeMap<(u64, u64), (Delivery, Option<Indexed>)>,
        released: impl Fn(&Delivery) -> bool,
        tracker: &TaskTracker,
        settler: &Settler,
    ) {
        let keys: Vec<(u64, u64)> = held
            .iter()
            .filter(|(_, (delivery, _))| released(delivery))
            .map(|(key, _)| *key)
            .collect();
        for key in keys {
            let (delivery, indexed) = held.remove(&key).expect("a held delivery");
            self.stats.by_seller.release(indexed);
            self.spawn_move_on(tracker, delivery, settler, true);
        }
    }

    fn spawn_move_on(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        delivery: Delivery,
        settler: &Settler,
        released: bool,
    ) {
        let (ladder, settler) = (self.clone(), settler.clone());
        tracker.spawn(async move {
            ladder.move_on(delivery, settler, released).await;
            ladder.stats.held.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Moves a message on when its hold is over, or when `released`: a due one to the workers
    /// (or, returned to its level too often or without workers, to the return queue), any other to the level of
    /// the time it has left; a publish is confirmed before the ack, and a failed one returns
    /// the message to its level.
    async fn move_on(&self, delivery: Delivery, settler: Settler, released: bool) {
        let now = unix_ms();
        let hop_until = header_u64(&delivery, headers::HOP);
        if released {
            self.stats.released.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("turnstile_delay_released_total").increment(1);
        } else if let Some(until) = hop_until
            && now.saturating_sub(until) > OVERDUE.as_millis() as u64
        {
            self.stats.overdue.fetch_add(1, Ordering::Relaxed);
            self.stats.last_overdue_ms.store(now, Ordering::Relaxed);
            metrics::counter!("turnstile_delay_overdue_total").increment(1);
        }
        let due = header_u64(&delivery, headers::DUE)
            .map(|due| due.min(due_after(now, MAX_DELAY)))
            .unwrap_or(now);
        let hop = if released {
            Hop::Ready
        } else {
            self.topology.holds().next_hop(now, due)
        };
        if hop == Hop::Ready && !released {
            let late = now.saturating_sub(due);
            self.stats.max_late_ms.fetch_max(late, Ordering::Relaxed);
            metrics::histogram!("turnstile_delay_late_seconds").record(late as f64 / 1000.0);
        }
        if let (Hop::Ready, Some(handoff)) = (hop, &self.handoff)
            && handed_on(&delivery)
        {
            self.stats.handed.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("turnstile_delay_handed_total").increment(1);
            handoff(delivery, settler);
            return;
        }
        let tag = delivery.delivery_tag;
        let published = self
            .publisher
            .hop(&self.topology, &delivery, hop, &[])
            .await;
        match published {
            Ok(()) => {
                self.stats.hops.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("turnstile_delay_hops_total").increment(1);
                if let Err(error) = settler.ack_now(tag).await {
                    debug!(%error, "could not ack a moved ladder message (the broker redelivers it; the copy ahead is deduplicated by its completion record)");
                }
            }
            Err(error) => {
                warn!(%error, "could not move a delayed message on; returning it to its level");
                metrics::counter!("turnstile_broker_errors_total").increment(1);
                let _ = settler.requeue(tag).await;
            }
        }
    }
}

/// A level's settings for its consumer.
struct Level {
    /// The longest a message is held from its receipt ([`Holds::level`]).
    hold: Duration,
    /// The settler of the ladder's channel.
    settler: Settler,
}

/// How often a ladder message may have come back to its level (lost connections, crashes,
/// shutdowns: see [`hand_on`]) and still be handed straight to the workers.
pub const HANDED_RETURNS: u64 = 3;

/// Whether a due ladder delivery goes to the workers straight from its level (see [`hand_on`]).
pub fn handed_on(delivery: &Delivery) -> bool {
    hand_on(
        delivery.redelivered,
        header_u64(delivery, "x-delivery-count"),
    )
}

/// Whether a due ladder delivery goes to the workers straight from its level, from its
/// `redelivered` flag and the count of its returns a quorum queue gives it (`x-delivery-count`):
/// while it came back fewer than [`HANDED_RETURNS`] times; a classic queue counts nothing, and
/// a redelivered message there is not handed on. Otherwise it goes through the return queue,
/// whose delivery limit ends a message that keeps crashing replicas in the dead letters.
pub fn hand_on(redelivered: bool, returns: Option<u64>) -> bool {
    match returns {
        Some(returns) => returns < HANDED_RETURNS,
        None => !redelivered,
    }
}

/// Publishing into the ladder.
impl Publisher {
    /// Publishes a copy of `delivery` into the delay ladder: it reappears on the return queue
    /// after `delay` (less than one UNIT early, capped at [`MAX_DELAY`]), with `extra`
    /// headers. A delay under one UNIT goes to the return queue at once.
    pub async fn delay(
        &self,
        topology: &Topology,
        delivery: &Delivery,
        delay: Duration,
        extra: &[(&str, AMQPValue)],
    ) -> Result<(), PublishError> {
        let now = unix_ms();
        let due = due_after(now, delay);
        let delays = header_u64(delivery, headers::DELAYS).unwrap_or(0) + 1;
        let mut all: Vec<(&str, AMQPValue)> = extra.to_vec();
        all.push((headers::DELAYS, AMQPValue::LongLongInt(delays as i64)));
        all.push((headers::DUE, AMQPValue::LongLongInt(due as i64)));
        self.hop(
            topology,
            delivery,
            topology.holds().next_hop(now, due),
            &all,
        )
        .await
    }

    /// Publishes a copy of `delivery` into `hop` (a ladder level or the return queue), with
    /// `extra` headers.
    pub async fn hop(
        &self,
        topology: &Topology,
        delivery: &Delivery,
        hop: Hop,
        extra: &[(&str, AMQPValue)],
    ) -> Result<(), PublishError> {
        let mut all = extra.to_vec();
        all.extend(hop_headers(hop));
        let properties = self.copy(delivery, &all);
        self.publish("", &topology.hop_queue(hop), &delivery.data, properties)
            .await
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

    /// The hops of a message due at `due`, delayed at `now`, with the level of each.
    fn hops(mut now: u64, due: u64) -> (Vec<u32>, u64) {
        let mut levels = Vec::new();
        while let Hop::Level { level, until_ms } = Holds::default().next_hop(now, due) {
            assert!(until_ms > now, "a hop waits");
            assert!(
                until_ms <= due + SLACK.as_millis() as u64,
                "a hop never ends after the due time"
            );
            assert!(until_ms - now <= Holds::default().level(level).as_millis() as u64);
            levels.push(level);
            now = until_ms;
        }
        (levels, now)
    }

    #[test]
    fn a_delay_waits_in_one_level_until_its_due_time() {
        // 1,300 ms = 5 units (+50 ms): level 2 (4 to 8 units), held until the due time.
        let (levels, back) = hops(10_000, 11_300);
        assert_eq!(levels, [2]);
        assert_eq!(back, 11_300);
        for delay in [250, 499, 500, 1_000, 7_999, 60_000, 600_000, 1_024_000] {
            let (levels, back) = hops(0, delay);
            assert_eq!(levels.len(), 1, "a delay of {delay} ms takes one hop");
            assert_eq!(back, delay);
        }
    }

    #[test]
    fn each_level_takes_waits_from_its_wait_to_twice_it() {
        for k in 0..LEVELS - 1 {
            let from = (U << k) - SLACK.as_millis() as u64;
            assert!(
                matches!(Holds::default().next_hop(0, from), Hop::Level { level, .. } if level == k)
            );
            let to = (U << (k + 1)) - SLACK.as_millis() as u64 - 1;
            assert!(
                matches!(Holds::default().next_hop(0, to), Hop::Level { level, .. } if level == k)
            );
        }
    }

    #[test]
    fn long_delays_go_round_the_top_level_held_as_long_as_the_consumer_timeout_allows() {
        let top = LEVELS - 1;
        let due = 3 * 3_600_000; // three hours
        let (levels, back) = hops(0, due);
        assert!(levels[..3].iter().all(|&level| level == top), "{levels:?}");
        assert_eq!(back, due);
        let per_pass = Holds::default().longest().as_millis() as u64;
        assert_eq!(
            per_pass,
            22 * 60_000 + 30_000,
            "22.5 minutes under the default 30"
        );
        assert_eq!(levels.len() as u64, due.div_ceil(per_pass), "{levels:?}");
    }

    #[test]
    fn a_raised_consumer_timeout_holds_longer_and_a_lowered_one_shorter_at_every_level() {
        let minutes = |m: u64| ConsumerTimeout::new(Some(Duration::from_secs(m * 60)));
        assert_eq!(
            Holds::under(minutes(120)).longest(),
            Duration::from_secs(110 * 60),
            "at most ten minutes left for the call"
        );
        assert_eq!(
            Holds::under(minutes(4)).longest(),
            Duration::from_secs(180),
            "a quarter left"
        );
        assert_eq!(
            Holds::under(ConsumerTimeout::new(None)).longest(),
            MAX_DELAY
        );
        let short = Holds::under(minutes(4));
        for k in 0..LEVELS {
            assert!(short.level(k) <= short.longest());
            assert!(short.level(k) <= Holds::default().level(k).max(short.longest()));
        }
        assert_eq!(short.level(2), UNIT * 8, "a low level keeps its own hold");
        // A wait of 100 minutes: one hold under 2 hours, five under the default 30 minutes.
        let wait = 100 * 60_000;
        let passes = |holds: Holds| {
            let mut at = 0;
            let mut n = 0;
            while let Hop::Level { until_ms, .. } = holds.next_hop(at, wait) {
                assert!(until_ms - at <= holds.longest().as_millis() as u64);
                at = until_ms;
                n += 1;
            }
            n
        };
        assert_eq!(passes(Holds::under(minutes(120))), 1);
        assert_eq!(passes(Holds::default()), 5);
    }

    #[test]
    fn a_consumer_timeout_is_a_duration_of_at_least_five_seconds_or_off() {
        let parse = |s: &str| s.parse::<ConsumerTimeout>();
        assert_eq!(parse("30m"), Ok(ConsumerTimeout::default()));
        assert_eq!(parse("1800000ms"), Ok(ConsumerTimeout::default()));
        assert_eq!(parse(" OFF "), Ok(ConsumerTimeout::new(None)));
        for bad in ["", "soon", "4s", "0", "-5m"] {
            let error = parse(bad).expect_err(bad);
            assert!(error.contains("TURNSTILE_CONSUMER_TIMEOUT"), "{error}");
        }
        assert_eq!(ConsumerTimeout::default().to_string(), "30m");
        assert_eq!(ConsumerTimeout::new(None).to_string(), "off");
    }

    #[test]
    fn the_timeout_a_broker_names_when_it_closes_a_channel_is_read_from_its_words() {
        let rabbit_3_10 = "protocol error: AMQP soft error: PRECONDITION-FAILED: delivery acknowledgement on channel 3 timed out. Timeout value used: 60000 ms. This timeout value can be configured, see consumers doc guide to learn more";
        assert_eq!(
            ack_timeout_named(rabbit_3_10),
            Some(Duration::from_secs(60))
        );
        let per_consumer = "Consumer amq.ctag-1 on channel 2 has timed out waiting for delivery acknowledgement. Timeout used: 900000 ms. This timeout value can be configured";
        assert_eq!(
            ack_timeout_named(per_consumer),
            Some(Duration::from_secs(900))
        );
        for other in [
            "connection reset by peer",
            "PRECONDITION-FAILED: unknown delivery tag 7",
            "timed out. Timeout value used: ms",
            "timed out. Timeout value used: 99999999999999999999 ms",
            "timed out. Timeout value used: 60000 s",
        ] {
            assert_eq!(ack_timeout_named(other), None, "{other}");
        }
    }

    #[test]
    fn a_broker_that_names_a_lower_timeout_is_held_under_from_then_on_and_reported_once() {
        let timeout = AckTimeout::new(ConsumerTimeout::default());
        assert_eq!(timeout.holds(), Holds::default());
        assert_eq!(
            timeout.learned(Duration::from_secs(3600)),
            None,
            "not lower"
        );
        let lowered = timeout.learned(Duration::from_secs(600)).expect("lower");
        assert_eq!(lowered.longest(), Duration::from_secs(450));
        assert_eq!(timeout.holds(), lowered);
        assert_eq!(timeout.learned(Duration::from_secs(600)), None, "once");
        assert_eq!(timeout.learned(Duration::from_secs(900)), None);
        assert_eq!(timeout.set(), ConsumerTimeout::default());
        let unset = AckTimeout::new(ConsumerTimeout::new(None));
        assert!(unset.learned(Duration::from_secs(1800)).is_some());
        assert_eq!(unset.holds(), Holds::default());
    }

    #[test]
    fn a_message_due_now_or_in_the_past_goes_to_the_return_queue() {
        assert_eq!(Holds::default().next_hop(1_000, 1_000), Hop::Ready);
        assert_eq!(Holds::default().next_hop(1_000, 1_224), Hop::Ready);
        assert!(matches!(
            Holds::default().next_hop(1_000, 1_225),
            Hop::Level { level: 0, .. }
        ));
        assert_eq!(Holds::default().next_hop(5_000, 1_000), Hop::Ready);
        assert_eq!(
            Holds::default().next_hop(1_000, 1_250),
            Hop::Level {
                level: 0,
                until_ms: 1_250
            }
        );
    }

    #[test]
    fn a_forged_hop_end_cannot_hold_a_level_longer_than_its_wait() {
        let wait = Holds::default().level(3);
        assert_eq!(remaining_wait(0, Some(u64::MAX), wait), wait);
        assert_eq!(
            remaining_wait(0, Some(500), wait),
            Duration::from_millis(500)
        );
        assert_eq!(remaining_wait(9_000, Some(500), wait), Duration::ZERO);
        assert_eq!(remaining_wait(0, None, wait), Duration::ZERO);
    }

    #[test]
    fn a_message_that_keeps_coming_back_to_its_level_goes_through_the_return_queue() {
        assert!(hand_on(false, None));
        assert!(!hand_on(true, None), "a classic level counts nothing");
        assert!(hand_on(true, Some(1)), "returned once by a lost connection");
        assert!(hand_on(true, Some(HANDED_RETURNS - 1)));
        assert!(!hand_on(true, Some(HANDED_RETURNS)));
        assert!(
            !hand_on(false, Some(u64::MAX)),
            "a forged count only costs a hop"
        );
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
