//! One delivery, start to finish: parse, permit, call, and one [`Outcome`], applied in one place.
//!
//! A throttled message waits for the slot the limiter reserved for it. Short waits (up to
//! `hold`) are held here, unacked and within prefetch; longer ones go through the broker's delay
//! ladder and come back `lead` before their slot, then are held for the rest. Other sellers'
//! messages never queue behind either: a held message takes no worker, and the ladder's queues
//! each hold one fixed delay.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder, Retryable};
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use metrics_util::storage::Summary;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use crate::broker::{
    PublishError, Publisher, Settler, Topology, header_str, header_u64, headers, long_string,
};
use crate::domain::Registration;
use crate::downstream::{Downstream, Reply};
use crate::permit::{CALL_ALLOWANCE, Decision, PermitError, PermitStore, Rescheduled, Reservation};

/// What to do with a delivery; decided by [`Worker::handle`], applied by [`Worker::settle`].
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Registered now: ack.
    Registered,
    /// Registered before (completion record): ack without calling.
    AlreadyDone,
    /// Come back later through the delay ladder, with what the message carries (its
    /// reservation, if any).
    Delay { after: Duration, carried: Carried },
    /// Give up: publish to `<queue>.dead` with the reason, then ack.
    DeadLetter {
        reason: &'static str,
        detail: String,
    },
    /// Give the message back to the broker as it is (nack + requeue).
    Requeue,
}

impl Outcome {
    /// The outcome's label in `turnstile_outcomes_total`, for a delivery that carried
    /// `delivered_attempt` failed attempts: a delay after one more failed attempt is `retried`.
    fn label(&self, delivered_attempt: u32) -> &'static str {
        match self {
            Outcome::Registered => "registered",
            Outcome::AlreadyDone => "already_done",
            Outcome::Delay { carried, .. } if carried.attempt > delivered_attempt => "retried",
            Outcome::Delay { .. } => "delayed",
            Outcome::DeadLetter { .. } => "dead_lettered",
            Outcome::Requeue => "requeued",
        }
    }
}

/// What a message carries from one delivery to the next, in `x-turnstile-*` headers. Read once
/// at the edge, and untrusted: anything that does not parse is ignored (a reservation must
/// also be live in Redis to count, see `permit::Reservation`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Carried {
    /// Failed downstream attempts so far (429s are not counted).
    pub attempt: u32,
    /// The permit slot reserved for the message.
    pub reservation: Option<Reservation>,
    /// Since when (Unix ms) the downstream has answered 429 to this message.
    pub throttled_since_ms: Option<u64>,
}

impl Carried {
    /// Reads the headers of a delivery received at `now_ms` (a throttling start in the future
    /// counts from now).
    pub fn from_delivery(delivery: &Delivery, now_ms: u64) -> Self {
        Self {
            attempt: Self::attempt_of(delivery),
            reservation: Self::reservation_of(delivery),
            throttled_since_ms: header_u64(delivery, headers::THROTTLED_SINCE)
                .map(|t| t.min(now_ms)),
        }
    }

    /// The reservation a delivery carries, if its header has the exact form.
    fn reservation_of(delivery: &Delivery) -> Option<Reservation> {
        header_str(delivery, headers::RESERVATION).and_then(|r| Reservation::decode(&r))
    }

    /// Failed attempts a delivery says it had (saturating; 0 when the header does not parse).
    fn attempt_of(delivery: &Delivery) -> u32 {
        header_u64(delivery, headers::ATTEMPT).map_or(0, |a| u32::try_from(a).unwrap_or(u32::MAX))
    }

    /// The headers that carry it on.
    fn headers(&self) -> Vec<(&'static str, AMQPValue)> {
        let mut headers = vec![
            (
                headers::ATTEMPT,
                AMQPValue::LongLongInt(i64::from(self.attempt)),
            ),
            (
                headers::RESERVATION,
                long_string(
                    &self
                        .reservation
                        .as_ref()
                        .map(Reservation::encode)
                        .unwrap_or_default(),
                ),
            ),
        ];
        if let Some(since) = self.throttled_since_ms {
            headers.push((
                headers::THROTTLED_SINCE,
                AMQPValue::LongLongInt(since as i64),
            ));
        }
        headers
    }
}

/// What one replica reports to whoever watches it: its counters (also exported as Prometheus
/// metrics) and the sellers it has seen. This is the consume path's whole interface to the
/// operator side: the dashboard and `/metrics` read it; the worker writes it and knows nothing
/// of them. (Dead letters are counted in Redis, through [`PermitStore::count_dead`].)
#[derive(Debug, Default)]
pub struct Stats {
    pub deliveries: AtomicU64,
    pub registered: AtomicU64,
    pub already_done: AtomicU64,
    pub delayed: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub requeued: AtomicU64,
    pub throttled: AtomicU64,
    pub forfeited: AtomicU64,
    pub held: AtomicUsize,
    pub in_flight: AtomicUsize,
    /// What the delay ladder's consumers did in this replica.
    pub ladder: Arc<crate::broker::ladder::LadderStats>,
    /// How long each permit decision took (one Redis round trip, or more after errors).
    pub permit_latency: LatencySummary,
    /// Sellers asked about since the dashboard sampler last took them (at most
    /// [`Stats::MAX_SELLERS`]; the sampler records them in Redis every second).
    pub sellers: Mutex<HashSet<String>>,
}

impl Stats {
    /// Most sellers remembered between two samples.
    pub const MAX_SELLERS: usize = 10_000;

    /// Notes that the replica asked for a permit for `seller`.
    pub fn touch(&self, seller: &crate::domain::SellerId) {
        let mut sellers = self.sellers.lock().expect("never poisoned");
        if sellers.len() < Self::MAX_SELLERS && !sellers.contains(seller.as_str()) {
            sellers.insert(seller.as_str().to_owned());
        }
    }

    /// The sellers noted since the last call.
    pub fn take_sellers(&self) -> HashSet<String> {
        std::mem::take(&mut *self.sellers.lock().expect("never poisoned"))
    }
}

/// Latencies for quantiles, in metrics-util's [`Summary`] (a DDSketch: quantiles within 1% of
/// the true value, from 1 µs up), behind a lock held only to add or read samples.
pub struct LatencySummary {
    summary: Mutex<Summary>,
}

impl LatencySummary {
    /// Relative error of a quantile.
    const ALPHA: f64 = 0.01;
    /// Most buckets: each is about 2% wide, so 2048 of them span 1 µs to well beyond a day.
    const MAX_BUCKETS: u32 = 2_048;
    /// Shorter latencies (seconds) count as zero.
    const MIN_SECONDS: f64 = 1e-6;

    /// Adds one sample.
    pub fn record(&self, took: Duration) {
        self.lock().add(took.as_secs_f64());
    }

    /// Samples recorded so far.
    pub fn count(&self) -> u64 {
        self.lock().count() as u64
    }

    /// The `q`-quantile (0..=1) of the samples so far, or zero.
    pub fn quantile(&self, q: f64) -> Duration {
        let seconds = self.lock().quantile(q.clamp(0.0, 1.0));
        seconds.map_or(Duration::ZERO, |s| Duration::from_secs_f64(s.max(0.0)))
    }

    /// Adds another summary's samples to this one (to sum over replicas).
    pub fn absorb(&self, other: &LatencySummary) {
        let theirs = other.lock().clone();
        self.lock()
            .merge(&theirs)
            .expect("every latency summary has the same parameters");
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Summary> {
        self.summary.lock().expect("never poisoned")
    }
}

impl Default for LatencySummary {
    fn default() -> Self {
        Self {
            summary: Mutex::new(Summary::new(
                Self::ALPHA,
                Self::MAX_BUCKETS,
                Self::MIN_SECONDS,
            )),
        }
    }
}

impl std::fmt::Debug for LatencySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencySummary")
            .field("count", &self.count())
            .field("p50", &self.quantile(0.5))
            .field("p99", &self.quantile(0.99))
            .finish()
    }
}

/// How the worker behaves (from `ConsumeArgs`).
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// Failed attempts (5xx, timeouts, connection errors) before a message is dead-lettered.
    pub max_attempts: u32,
    /// Longest wait held in the replica; longer ones go through the broker.
    pub hold: Duration,
    /// Longest pause a 429's Retry-After may ask for (a longer one is capped and logged).
    pub max_pause: Duration,
    /// How long a message may be throttled (429s) before it is dead-lettered as `throttled`.
    pub throttle_deadline: Duration,
    /// Most messages held at once (the rest of the prefetch stays free for other sellers).
    pub hold_capacity: usize,
    /// How long completion records are kept (redeliveries within it are not called twice).
    pub done_ttl: Duration,
    /// First retry delay after a failed attempt (doubling, with jitter, up to `retry_max`).
    pub retry_min: Duration,
    pub retry_max: Duration,
}

/// The next step for a message, decided from plain values by [`WorkerSettings`]' `plan_*`
/// methods (no I/O) and carried out by [`Worker::handle`].
#[derive(Debug, PartialEq)]
enum Plan {
    /// Settle the delivery with this outcome.
    Settle(Outcome),
    /// Call the downstream now, under the grant that names the call `call`.
    Call { call: String },
    /// Hold the message here, unacked, for this long (or until its reserved slot is given
    /// back), then ask for its permit again.
    Hold(Duration),
    /// Ask for a permit again at once.
    AskAgain,
    /// No permit decision (Redis unavailable): wait this long, holding no worker, then ask
    /// again.
    AskAfter(Duration),
    /// A 429: pause the seller on every replica for `pause` (what the downstream `asked`
    /// for, capped at `max_pause`), then ask again.
    PauseSeller { pause: Duration, asked: Duration },
    /// A failed attempt: come back through the delay ladder `after` the backoff.
    Retry { after: Duration, why: String },
}

impl WorkerSettings {
    /// What a permit decision leads to, given how long it took to come (`waited`) and how many
    /// messages are held in the replica (`holding`). A grant is called only if it came within
    /// [`CALL_ALLOWANCE`]: its place in the window was only promised for a call starting
    /// within it; a later one is asked for again, without the reservation.
    fn plan_decision(
        &self,
        decision: Decision,
        waited: Duration,
        holding: usize,
        carried: &mut Carried,
    ) -> Plan {
        match decision {
            Decision::AlreadyDone => Plan::Settle(Outcome::AlreadyDone),
            Decision::Granted { call, .. } if waited <= CALL_ALLOWANCE => Plan::Call { call },
            Decision::Granted { .. } => {
                carried.reservation = None;
                Plan::AskAgain
            }
            Decision::Wait {
                retry_after,
                reservation,
            } => {
                carried.reservation = reservation;
                self.plan_wait(retry_after, holding, carried)
            }
        }
    }

    /// Where a message told to wait `retry_after` waits. Held here if it has a reservation,
    /// the wait is within `hold` and fewer than `hold_capacity` messages are held (`holding`);
    /// otherwise it goes through the delay ladder, coming back [`WorkerSettings::lead`] before
    /// its reserved slot (or at the time, without a reservation) — unless that leaves no more
    /// than one ladder step, which is held here too.
    fn plan_wait(&self, retry_after: Duration, holding: usize, carried: &Carried) -> Plan {
        let reserved = carried.reservation.is_some();
        if !reserved || retry_after > self.hold || holding >= self.hold_capacity {
            let lead = if reserved {
                self.lead()
            } else {
                Duration::ZERO
            };
            if retry_after > lead + crate::broker::UNIT {
                return Plan::Settle(Outcome::Delay {
                    after: retry_after - lead,
                    carried: carried.clone(),
                });
            }
        }
        Plan::Hold(retry_after)
    }

    /// What the downstream's reply to a call leads to. The call spent the message's
    /// reservation. `now_ms` is the time (Unix ms); `window` is the default limit's window,
    /// the pause after a 429 without Retry-After.
    fn plan_reply(
        &self,
        reply: Reply,
        carried: &mut Carried,
        now_ms: u64,
        window: Duration,
    ) -> Plan {
        carried.reservation = None;
        match reply {
            Reply::Registered => Plan::Settle(Outcome::Registered),
            Reply::Throttled { retry_after } => {
                self.plan_throttled(retry_after.unwrap_or(window), carried, now_ms)
            }
            Reply::Transient(why) => self.plan_failure(why, carried),
            Reply::Rejected { status, body } => Plan::Settle(Outcome::DeadLetter {
                reason: "rejected",
                detail: format!("HTTP {status}: {body}"),
            }),
        }
    }

    /// A 429 that `asked` for a pause: the seller is paused for it, capped at `max_pause` (at
    /// least 1 ms). A message throttled for `throttle_deadline` since its first 429 (noted in
    /// `carried` now if this is the first) is dead-lettered as `throttled` instead.
    fn plan_throttled(&self, asked: Duration, carried: &mut Carried, now_ms: u64) -> Plan {
        let since = *carried.throttled_since_ms.get_or_insert(now_ms);
        let throttled_for = Duration::from_millis(now_ms.saturating_sub(since));
        if throttled_for >= self.throttle_deadline {
            return Plan::Settle(Outcome::DeadLetter {
                reason: "throttled",
                detail: format!(
                    "the downstream answered 429 for {} s (TURNSTILE_THROTTLE_DEADLINE {} s)",
                    throttled_for.as_secs(),
                    self.throttle_deadline.as_secs()
                ),
            });
        }
        Plan::PauseSeller {
            pause: asked.min(self.max_pause).max(Duration::from_millis(1)),
            asked,
        }
    }

    /// A failed attempt (5xx, timeout, connection error), counted in `carried`: the
    /// `max_attempts`-th is dead-lettered as `attempts-exhausted`, earlier ones are retried
    /// after [`WorkerSettings::backoff`].
    fn plan_failure(&self, why: String, carried: &mut Carried) -> Plan {
        carried.attempt = carried.attempt.saturating_add(1);
        let attempt = carried.attempt;
        if attempt >= self.max_attempts {
            return Plan::Settle(Outcome::DeadLetter {
                reason: "attempts-exhausted",
                detail: format!("{attempt} attempts failed; last: {why}"),
            });
        }
        Plan::Retry {
            after: self.backoff(attempt),
            why,
        }
    }

    /// How early a message delayed through the broker comes back before its slot: half the
    /// hold, at least two ladder steps.
    fn lead(&self) -> Duration {
        (self.hold / 2).max(crate::broker::UNIT * 2)
    }

    /// The n-th retry delay: exponential from `retry_min` (doubling), capped at `retry_max`,
    /// plus a random jitter of up to as much again.
    fn backoff(&self, attempt: u32) -> Duration {
        ExponentialBuilder::default()
            .with_min_delay(self.retry_min)
            .with_max_delay(self.retry_max)
            .with_jitter()
            .without_max_times()
            .build()
            .nth(attempt.saturating_sub(1) as usize)
            .unwrap_or(self.retry_max)
    }
}

/// Everything a delivery needs; shared by all of a replica's tasks.
pub struct Worker {
    pub permits: PermitStore,
    pub downstream: Downstream,
    pub topology: Topology,
    pub settings: WorkerSettings,
    pub workers: Arc<Semaphore>,
    /// Extra workers only for messages coming back for a reserved slot (a quarter of
    /// `workers`, at least one): a due slot never waits for a worker behind new messages, and a
    /// slot lost to that wait would cost the message another round through the ladder.
    pub due_lane: Arc<Semaphore>,
    pub stats: Arc<Stats>,
    /// Notices of sellers whose terms changed (see `permit::watch_reschedules`): a message held
    /// for a slot given back by the change comes back at once.
    pub reschedules: tokio::sync::broadcast::Sender<Rescheduled>,
}

/// Permit decisions the limiter may refuse (not for want of Redis) before the message is
/// dead-lettered: retrying cannot help, and the worker must not spin.
const PERMIT_REFUSALS: u32 = 3;

/// Backoff while Redis is unavailable: 50 ms doubling to 5 s, with jitter, for as long as it
/// takes (fail closed: no call without a decision).
fn redis_backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}

/// What a failed permit decision leads to.
#[derive(Debug, PartialEq)]
enum PermitFailure {
    /// Redis is unreachable or busy: wait this long (holding no worker), then ask again.
    Unavailable(Duration),
    /// The limiter refused the request (a script error, an unexpected answer): ask again
    /// without the message's reservation.
    Refused,
    /// Refused [`PERMIT_REFUSALS`] times: dead-letter the message with the reason.
    GiveUp,
}

/// Decides what a failed permit decision leads to: transport errors are retried with backoff
/// without limit, anything else a few times and then given up.
fn permit_failure(
    error: &PermitError,
    refused: &mut u32,
    unavailable: &mut impl Iterator<Item = Duration>,
) -> PermitFailure {
    if error.is_transient() {
        return PermitFailure::Unavailable(unavailable.next().unwrap_or(Duration::from_secs(5)));
    }
    *refused += 1;
    if *refused >= PERMIT_REFUSALS {
        PermitFailure::GiveUp
    } else {
        PermitFailure::Refused
    }
}

/// The permit errors met while handling one message: the limiter's refusals so far, and the
/// backoff while Redis is unavailable.
struct PermitErrors {
    refused: u32,
    unavailable: ExponentialBackoff,
}

impl Default for PermitErrors {
    fn default() -> Self {
        Self {
            refused: 0,
            unavailable: redis_backoff(),
        }
    }
}

impl PermitErrors {
    /// What a failed permit decision leads to (see [`permit_failure`]); counted and logged.
    fn plan(&mut self, error: PermitError, carried: &mut Carried) -> Plan {
        metrics::counter!("turnstile_redis_errors_total").increment(1);
        match permit_failure(&error, &mut self.refused, &mut self.unavailable) {
            PermitFailure::Unavailable(wait) => {
                warn!(%error, retry_in_ms = wait.as_millis() as u64, "no permit decision (Redis); not calling");
                Plan::AskAfter(wait)
            }
            PermitFailure::Refused => {
                // Whatever the message carried (a reservation) is dropped.
                warn!(%error, refused = self.refused, "the limiter refused the request; acquiring anew without a reservation");
                carried.reservation = None;
                Plan::AskAgain
            }
            PermitFailure::GiveUp => Plan::Settle(Outcome::DeadLetter {
                reason: "invalid-message",
                detail: format!("the limiter refused it {} times: {error}", self.refused),
            }),
        }
    }
}

/// What a message interrupted while waiting becomes: at shutdown it goes back through the return
/// queue keeping what it carries (its reservation); with its connection lost, the broker has
/// requeued it already.
fn returned(carried: Carried, why: Interrupted) -> Outcome {
    match why {
        Interrupted::Shutdown => Outcome::Delay {
            after: Duration::ZERO,
            carried,
        },
        Interrupted::ConnectionLost => Outcome::Requeue,
    }
}

/// Completes when a notice says that `registration`'s reserved slot was given back (its
/// seller's terms changed after it was reserved), or when notices were missed (coming back
/// early costs one redeem, which answers "early" if the slot is still held); never without a
/// reservation.
async fn given_back(
    mut notices: tokio::sync::broadcast::Receiver<Rescheduled>,
    registration: &Registration,
    reservation: Option<&Reservation>,
) {
    use tokio::sync::broadcast::error::RecvError;
    let Some(reservation) = reservation else {
        return std::future::pending().await;
    };
    loop {
        match notices.recv().await {
            Ok(notice) if notice.concerns(registration.seller_id.as_str(), reservation) => return,
            Ok(_) => {}
            Err(RecvError::Lagged(_)) => return,
            Err(RecvError::Closed) => return std::future::pending().await,
        }
    }
}

/// Whether a delivery waiting in the delay ladder holds a slot that `notice` says was given
/// back: it then goes to the return queue at once instead of waiting for that slot.
pub fn released_by(notice: &Rescheduled, delivery: &Delivery) -> bool {
    let Some(reservation) = Carried::reservation_of(delivery) else {
        return false;
    };
    crate::broker::registration_of(delivery)
        .is_ok_and(|r| notice.concerns(r.seller_id.as_str(), &reservation))
}

/// Counts a dead letter (confirmed by the broker) in the metrics, and its message as dead in
/// its upload's progress and in the dead letters by reason, once per message
/// ([`PermitStore::count_dead`]; a body without an identity is counted per dead letter). The
/// Redis part runs in the background: it never delays the ack, and a failure only costs the
/// count.
fn count_dead_letter(
    permits: &PermitStore,
    delivery: &Delivery,
    reason: &'static str,
    ttl: Duration,
) {
    metrics::counter!("turnstile_dead_letters_total", "reason" => reason).increment(1);
    let registration = crate::broker::registration_of(delivery).ok();
    let permits = permits.clone();
    let record = async move {
        let counted = permits.count_dead(registration.as_ref(), reason, ttl).await;
        if let Err(error) = counted {
            metrics::counter!("turnstile_redis_errors_total").increment(1);
            warn!(%error, "dead-lettered, but not counted in the dashboard and upload progress");
        }
    };
    tokio::spawn(record.in_current_span());
}

/// How a handler's wait ended early.
enum Interrupted {
    /// Shutting down: return the message to the broker, keeping its reservation.
    Shutdown,
    /// The connection that delivered it is gone: the broker has requeued it already.
    ConnectionLost,
}

impl Worker {
    /// Handles a delivery and settles it; never fails (errors are logged with context).
    pub async fn process(
        &self,
        delivery: Delivery,
        publisher: &Publisher,
        settler: &Settler,
        shutdown: &CancellationToken,
        connection_lost: &CancellationToken,
    ) {
        self.stats.deliveries.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("turnstile_deliveries_total").increment(1);
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string());
        let registration = Registration::parse(&delivery.data, message_id.as_deref());
        let carried = Carried::from_delivery(&delivery, crate::broker::unix_ms());
        let attempt = carried.attempt;
        let span = match &registration {
            Ok(r) => {
                info_span!("registration", seller = %r.seller_id, message = %r.message_id, attempt)
            }
            Err(_) => info_span!("registration", seller = "?", message = ?message_id, attempt),
        };
        let outcome = async {
            let outcome = match registration {
                Ok(registration) => {
                    self.handle(&registration, carried, shutdown, connection_lost)
                        .await
                }
                Err(invalid) => Outcome::DeadLetter {
                    reason: "invalid-message",
                    detail: invalid.to_string(),
                },
            };
            debug!(?outcome, "handled");
            outcome
        }
        .instrument(span.clone())
        .await;
        self.settle(delivery, outcome, publisher, settler, connection_lost)
            .instrument(span)
            .await;
    }

    /// Decides what happens to one registration. Holds a worker permit only while asking for a
    /// permit and calling the downstream, so held messages never starve the workers.
    pub async fn handle(
        &self,
        registration: &Registration,
        mut carried: Carried,
        shutdown: &CancellationToken,
        connection_lost: &CancellationToken,
    ) -> Outcome {
        if let Err(why) = self.downstream.check_seller(&registration.seller_id) {
            return Outcome::DeadLetter {
                reason: "invalid-message",
                detail: why,
            };
        }
        let mut permit_errors = PermitErrors::default();
        loop {
            let plan = self
                .ask(
                    registration,
                    &mut carried,
                    &mut permit_errors,
                    shutdown,
                    connection_lost,
                )
                .await;
            let carried_out = self
                .carry_out(plan, registration, &carried, shutdown, connection_lost)
                .await;
            if let Some(outcome) = carried_out {
                return outcome;
            }
        }
    }

    /// One round: takes a worker, asks for (or redeems) a permit and plans what its answer
    /// leads to; a grant is called at once, under the worker, and the plan is then the
    /// reply's. Never returns [`Plan::Call`].
    async fn ask(
        &self,
        registration: &Registration,
        carried: &mut Carried,
        permit_errors: &mut PermitErrors,
        shutdown: &CancellationToken,
        connection_lost: &CancellationToken,
    ) -> Plan {
        let interrupted = |why| Plan::Settle(returned(carried.clone(), why));
        let worker = tokio::select! {
            permit = self.workers.clone().acquire_owned() => permit.expect("the worker semaphore is never closed"),
            permit = self.due_lane.clone().acquire_owned(), if carried.reservation.is_some() => permit.expect("the due lane is never closed"),
            _ = shutdown.cancelled() => return interrupted(Interrupted::Shutdown),
            _ = connection_lost.cancelled() => return interrupted(Interrupted::ConnectionLost),
        };
        let asked = std::time::Instant::now();
        let decided = tokio::select! {
            d = self.decide(registration, carried.reservation.as_ref()) => d,
            _ = shutdown.cancelled() => return interrupted(Interrupted::Shutdown),
            _ = connection_lost.cancelled() => return interrupted(Interrupted::ConnectionLost),
        };
        let decision = match decided {
            Ok(decision) => decision,
            Err(error) => {
                // No worker is held while the message waits for Redis.
                drop(worker);
                return permit_errors.plan(error, carried);
            }
        };
        let waited = asked.elapsed();
        let holding = self.stats.held.load(Ordering::Relaxed);
        match self
            .settings
            .plan_decision(decision, waited, holding, carried)
        {
            Plan::Call { call } => self.call(registration, &call, worker, carried).await,
            plan => {
                drop(worker);
                if plan == Plan::AskAgain {
                    warn!(
                        waited_ms = waited.as_millis() as u64,
                        "a permit came back too late to send the call with it; asking again"
                    );
                }
                plan
            }
        }
    }

    /// Calls the downstream under a grant (the call named `call`), lets go of the worker once
    /// the call's answer is recorded, and plans what the reply leads to.
    async fn call(
        &self,
        registration: &Registration,
        call: &str,
        worker: OwnedSemaphorePermit,
        carried: &mut Carried,
    ) -> Plan {
        self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        let reply = self.downstream.register(registration).await;
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        // Only the exact algorithms hold calls until their answer; a registration's answer is
        // recorded with its completion.
        if self.permits.algorithm().is_exact() && !matches!(reply, Reply::Registered) {
            self.record_call_end(registration, call).await;
        }
        drop(worker);
        match reply {
            Reply::Registered => self.record_completion(registration, call).await,
            Reply::Throttled { .. } => {
                self.stats.throttled.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("turnstile_downstream_throttled_total").increment(1);
            }
            Reply::Transient(_) | Reply::Rejected { .. } => {}
        }
        let now_ms = crate::broker::unix_ms();
        let window = self.permits.default_limit().window();
        self.settings.plan_reply(reply, carried, now_ms, window)
    }

    /// Carries out a plan other than a call: `Some` outcome to settle the message with, or
    /// `None` to ask for a permit again.
    async fn carry_out(
        &self,
        plan: Plan,
        registration: &Registration,
        carried: &Carried,
        shutdown: &CancellationToken,
        connection_lost: &CancellationToken,
    ) -> Option<Outcome> {
        let delay = |after| {
            Some(Outcome::Delay {
                after,
                carried: carried.clone(),
            })
        };
        let interrupted = match plan {
            Plan::Settle(outcome) => return Some(outcome),
            Plan::AskAgain => return None,
            Plan::Call { .. } => unreachable!("a grant is called as soon as it is planned"),
            Plan::AskAfter(wait) => {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => None,
                    _ = shutdown.cancelled() => Some(Interrupted::Shutdown),
                    _ = connection_lost.cancelled() => Some(Interrupted::ConnectionLost),
                }
            }
            Plan::Hold(wait) => {
                self.hold(wait, registration, carried, shutdown, connection_lost)
                    .await
            }
            Plan::PauseSeller { pause, asked } => {
                if self.pause_seller(registration, pause, asked).await {
                    return None;
                }
                return delay(pause);
            }
            Plan::Retry { after, why } => {
                warn!(attempt = carried.attempt, %why, "downstream failed; retrying later");
                self.stats.retried.fetch_add(1, Ordering::Relaxed);
                return delay(after);
            }
        };
        interrupted.map(|why| returned(carried.clone(), why))
    }

    /// Holds a message here (counted in `held`) for `wait`, or until its reserved slot is
    /// given back; `Some` if the wait was interrupted.
    async fn hold(
        &self,
        wait: Duration,
        registration: &Registration,
        carried: &Carried,
        shutdown: &CancellationToken,
        connection_lost: &CancellationToken,
    ) -> Option<Interrupted> {
        self.stats.held.fetch_add(1, Ordering::Relaxed);
        let notices = self.reschedules.subscribe();
        let waited = tokio::select! {
            _ = tokio::time::sleep(wait) => None,
            _ = given_back(notices, registration, carried.reservation.as_ref()) => None,
            _ = shutdown.cancelled() => Some(Interrupted::Shutdown),
            _ = connection_lost.cancelled() => Some(Interrupted::ConnectionLost),
        };
        self.stats.held.fetch_sub(1, Ordering::Relaxed);
        waited
    }

    /// A 429: pauses the seller on every replica for `pause` (the downstream `asked` for
    /// Retry-After, or one window); `false` if the pause could not be recorded (the message is
    /// then delayed instead).
    async fn pause_seller(
        &self,
        registration: &Registration,
        pause: Duration,
        asked: Duration,
    ) -> bool {
        if asked > self.settings.max_pause {
            warn!(
                retry_after_s = asked.as_secs(),
                max_pause_s = self.settings.max_pause.as_secs(),
                "Retry-After longer than TURNSTILE_MAX_PAUSE: pausing for TURNSTILE_MAX_PAUSE"
            );
        }
        warn!(
            pause_ms = pause.as_millis() as u64,
            "downstream answered 429: pausing the seller on every replica"
        );
        if let Err(error) = self.permits.pause(&registration.seller_id, pause).await {
            warn!(%error, "could not record the pause; delaying the message instead");
            return false;
        }
        true
    }

    /// Asks for (or redeems) a permit: one attempt (see [`permit_failure`] for what an error
    /// leads to).
    async fn decide(
        &self,
        registration: &Registration,
        held: Option<&Reservation>,
    ) -> Result<Decision, PermitError> {
        let started = std::time::Instant::now();
        let (decision, forfeit) = self
            .permits
            .acquire_or_redeem(
                &registration.seller_id,
                Some(&registration.message_id),
                held,
            )
            .await?;
        self.stats.permit_latency.record(started.elapsed());
        if let Some(forfeit) = forfeit {
            self.stats.forfeited.fetch_add(1, Ordering::Relaxed);
            debug!(?forfeit, "reserved slot given up; reserved anew");
        }
        self.stats.touch(&registration.seller_id);
        Ok(decision)
    }

    /// Records the registration (and the answer of its call, `call`) in one step.
    async fn record_completion(&self, registration: &Registration, call: &str) {
        let record = || async {
            self.permits
                .complete_call(
                    &registration.seller_id,
                    &registration.message_id,
                    registration.batch_id.as_ref(),
                    call,
                    self.settings.done_ttl,
                )
                .await
        };
        let retry = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_times(6);
        if let Err(error) = record.retry(retry).await {
            warn!(%error, "registered, but the completion record was not written: a redelivery could call again");
        }
    }

    /// Records that the call `call` was answered (not a registration): it stops holding its
    /// place in the seller's window beyond now. On failure it holds it until its bound.
    async fn record_call_end(&self, registration: &Registration, call: &str) {
        if let Err(error) = self.permits.call_ended(&registration.seller_id, call).await {
            debug!(%error, "the call's answer was not recorded; its place is kept until its bound");
        }
    }

    /// Applies an outcome: the one place that acks, nacks, delays or dead-letters.
    pub async fn settle(
        &self,
        delivery: Delivery,
        outcome: Outcome,
        publisher: &Publisher,
        settler: &Settler,
        connection_lost: &CancellationToken,
    ) {
        let tag = delivery.delivery_tag;
        let result = match self.republish(&delivery, &outcome, publisher).await {
            Ok(()) => {
                self.count(&delivery, &outcome);
                match outcome {
                    Outcome::Registered | Outcome::AlreadyDone => {
                        settler.ack(tag);
                        Ok(())
                    }
                    Outcome::Requeue => settler.requeue(tag).await,
                    // Republished: an ack lost with the connection would leave two copies.
                    Outcome::Delay { .. } | Outcome::DeadLetter { .. } => {
                        settler.ack_now(tag).await
                    }
                }
            }
            Err(error) => {
                self.return_unpublished(error, tag, publisher, settler, connection_lost)
                    .await
            }
        };
        if let Err(error) = result {
            debug!(%error, "could not settle the delivery (its channel is gone; the broker redelivers it)");
        }
    }

    /// Publishes what an outcome sends on: the delayed copy, or the dead letter.
    async fn republish(
        &self,
        delivery: &Delivery,
        outcome: &Outcome,
        publisher: &Publisher,
    ) -> Result<(), PublishError> {
        match outcome {
            Outcome::Registered | Outcome::AlreadyDone | Outcome::Requeue => Ok(()),
            Outcome::Delay { after, carried } => {
                publisher
                    .delay(&self.topology, delivery, *after, &carried.headers())
                    .await
            }
            Outcome::DeadLetter { reason, detail } => {
                warn!(reason, detail, "dead-lettering");
                publisher
                    .dead_letter(&self.topology, delivery, reason, detail)
                    .await
            }
        }
    }

    /// Counts a settled outcome in the stats and the metrics (a dead letter also in the
    /// dashboard and its upload's progress, see [`count_dead_letter`]).
    fn count(&self, delivery: &Delivery, outcome: &Outcome) {
        let counter = match outcome {
            Outcome::Registered => &self.stats.registered,
            Outcome::AlreadyDone => &self.stats.already_done,
            Outcome::Delay { .. } => &self.stats.delayed,
            Outcome::DeadLetter { .. } => &self.stats.dead_lettered,
            Outcome::Requeue => &self.stats.requeued,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let label = outcome.label(Carried::attempt_of(delivery));
        metrics::counter!("turnstile_outcomes_total", "outcome" => label).increment(1);
        if let Outcome::DeadLetter { reason, .. } = outcome {
            count_dead_letter(&self.permits, delivery, reason, self.settings.done_ttl);
        }
    }

    /// Returns a message whose outcome could not be published to the broker, after a pause;
    /// with the publish channel closed, asks for a new connection instead (the broker then
    /// requeues it).
    async fn return_unpublished(
        &self,
        error: PublishError,
        tag: u64,
        publisher: &Publisher,
        settler: &Settler,
        connection_lost: &CancellationToken,
    ) -> Result<(), lapin::Error> {
        metrics::counter!("turnstile_broker_errors_total").increment(1);
        self.stats.requeued.fetch_add(1, Ordering::Relaxed);
        if !publisher.channel().status().connected() {
            // A closed publish channel fails every republish: reconnect (the replica reports
            // not ready meanwhile) instead of returning messages in a loop.
            warn!(%error, "the publish channel is closed; reconnecting to the broker");
            connection_lost.cancel();
            return Ok(());
        }
        // Back off before returning it, so that a broker refusing publishes (nacks) is not
        // hammered by the same message again at once.
        let pause = Duration::from_millis(rand::random_range(500..1_500));
        warn!(%error, retry_in_ms = pause.as_millis() as u64, "republishing failed; returning the message to the broker");
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = connection_lost.cancelled() => return Ok(()),
        }
        settler.requeue(tag).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const SECOND: Duration = Duration::from_secs(1);

    /// Settings as a replica might have them: 5 attempts, a 2 s hold for 10 messages, pauses
    /// of at most 60 s, a 600 s throttle deadline, retries from 1 s to 30 s.
    fn settings() -> WorkerSettings {
        WorkerSettings {
            max_attempts: 5,
            hold: 2 * SECOND,
            max_pause: 60 * SECOND,
            throttle_deadline: 600 * SECOND,
            hold_capacity: 10,
            done_ttl: 3_600 * SECOND,
            retry_min: SECOND,
            retry_max: 30 * SECOND,
        }
    }

    fn reservation() -> Reservation {
        Reservation {
            slot_us: 1_000_000,
            count: 1,
            window_us: 1_000_000,
            reserved_at_us: 0,
            token: "t".into(),
        }
    }

    fn reserved() -> Carried {
        Carried {
            reservation: Some(reservation()),
            ..Carried::default()
        }
    }

    fn wait(retry_after: Duration, reservation: Option<Reservation>) -> Decision {
        Decision::Wait {
            retry_after,
            reservation,
        }
    }

    fn delay(after: Duration, carried: Carried) -> Plan {
        Plan::Settle(Outcome::Delay { after, carried })
    }

    fn dead_letter(reason: &'static str, detail: &str) -> Plan {
        Plan::Settle(Outcome::DeadLetter {
            reason,
            detail: detail.into(),
        })
    }

    #[test]
    fn a_reserved_wait_within_the_hold_is_held_here() {
        let mut carried = Carried::default();
        let decision = wait(1_500 * MS, Some(reservation()));
        let plan = settings().plan_decision(decision, Duration::ZERO, 0, &mut carried);
        assert_eq!(plan, Plan::Hold(1_500 * MS));
        assert_eq!(
            carried,
            reserved(),
            "the reservation is kept for the redeem"
        );
    }

    #[test]
    fn a_denial_longer_than_the_hold_goes_through_the_ladder() {
        let mut carried = Carried::default();
        let decision = wait(10 * SECOND, Some(reservation()));
        let plan = settings().plan_decision(decision, Duration::ZERO, 0, &mut carried);
        // Back one lead (half the 2 s hold) before the slot, with the reservation.
        assert_eq!(plan, delay(9 * SECOND, reserved()));
    }

    #[test]
    fn a_short_wait_goes_through_the_ladder_when_the_hold_is_full() {
        let plan = settings().plan_wait(1_500 * MS, 10, &reserved());
        assert_eq!(plan, delay(500 * MS, reserved()));
    }

    #[test]
    fn a_wait_within_one_ladder_step_of_the_lead_is_held_even_when_the_hold_is_full() {
        let plan = settings().plan_wait(1_250 * MS, 10, &reserved());
        assert_eq!(plan, Plan::Hold(1_250 * MS));
    }

    #[test]
    fn a_wait_without_a_reservation_goes_through_the_ladder_for_all_of_it() {
        let plan = settings().plan_wait(SECOND, 0, &Carried::default());
        assert_eq!(plan, delay(SECOND, Carried::default()));
    }

    #[test]
    fn a_wait_without_a_reservation_within_one_ladder_step_is_held_here() {
        let plan = settings().plan_wait(250 * MS, 0, &Carried::default());
        assert_eq!(plan, Plan::Hold(250 * MS));
    }

    #[test]
    fn the_lead_is_half_the_hold_and_at_least_two_ladder_steps() {
        assert_eq!(settings().lead(), SECOND);
        let short_hold = WorkerSettings {
            hold: 600 * MS,
            ..settings()
        };
        assert_eq!(short_hold.lead(), 2 * crate::broker::UNIT);
    }

    #[test]
    fn a_grant_that_came_in_time_is_called() {
        let mut carried = reserved();
        let granted = Decision::Granted {
            slot_us: 0,
            used_permille: 1_000,
            call: "call-1".into(),
        };
        let plan = settings().plan_decision(granted, CALL_ALLOWANCE, 0, &mut carried);
        assert_eq!(
            plan,
            Plan::Call {
                call: "call-1".into()
            }
        );
    }

    #[test]
    fn a_grant_that_came_too_late_is_asked_for_again_without_the_reservation() {
        let mut carried = reserved();
        let granted = Decision::Granted {
            slot_us: 0,
            used_permille: 1_000,
            call: "call-1".into(),
        };
        let late = CALL_ALLOWANCE + MS;
        let plan = settings().plan_decision(granted, late, 0, &mut carried);
        assert_eq!(plan, Plan::AskAgain);
        assert_eq!(carried.reservation, None);
    }

    #[test]
    fn a_message_registered_before_is_acked_without_a_call() {
        let plan =
            settings().plan_decision(Decision::AlreadyDone, Duration::ZERO, 0, &mut reserved());
        assert_eq!(plan, Plan::Settle(Outcome::AlreadyDone));
    }

    #[test]
    fn a_registration_spends_the_reservation() {
        let mut carried = reserved();
        let plan = settings().plan_reply(Reply::Registered, &mut carried, 0, SECOND);
        assert_eq!(plan, Plan::Settle(Outcome::Registered));
        assert_eq!(carried.reservation, None);
    }

    #[test]
    fn a_fifth_failure_with_max_attempts_five_is_dead_lettered() {
        let mut carried = Carried {
            attempt: 4,
            ..reserved()
        };
        let reply = Reply::Transient("HTTP 503".into());
        let plan = settings().plan_reply(reply, &mut carried, 0, SECOND);
        assert_eq!(
            plan,
            dead_letter("attempts-exhausted", "5 attempts failed; last: HTTP 503")
        );
        assert_eq!(carried.attempt, 5);
    }

    #[test]
    fn a_fourth_failure_is_retried_after_the_fourth_backoff_without_the_reservation() {
        let mut carried = Carried {
            attempt: 3,
            ..reserved()
        };
        let reply = Reply::Transient("timeout".into());
        let plan = settings().plan_reply(reply, &mut carried, 0, SECOND);
        let Plan::Retry { after, why } = plan else {
            panic!("{plan:?}");
        };
        assert!((8 * SECOND..=16 * SECOND).contains(&after), "{after:?}");
        assert_eq!(why, "timeout");
        assert_eq!(carried.attempt, 4);
        assert_eq!(carried.reservation, None);
    }

    #[test]
    fn backoff_doubles_up_to_retry_max() {
        let settings = settings();
        for attempt in 1..=10u32 {
            let base = (SECOND * 2u32.pow(attempt - 1)).min(settings.retry_max);
            for _ in 0..20 {
                let after = settings.backoff(attempt);
                // The jitter adds up to as much again.
                assert!(base <= after && after <= base * 2, "{attempt}: {after:?}");
            }
        }
        assert!(
            settings.backoff(0) <= 2 * SECOND,
            "attempt 0 counts as the first"
        );
    }

    #[test]
    fn a_rejection_is_dead_lettered_with_its_status_and_body() {
        let reply = Reply::Rejected {
            status: 422,
            body: "unknown seller".into(),
        };
        let plan = settings().plan_reply(reply, &mut Carried::default(), 0, SECOND);
        assert_eq!(plan, dead_letter("rejected", "HTTP 422: unknown seller"));
    }

    #[test]
    fn a_first_429_pauses_the_seller_for_its_retry_after_and_notes_since_when() {
        let mut carried = reserved();
        let reply = Reply::Throttled {
            retry_after: Some(5 * SECOND),
        };
        let plan = settings().plan_reply(reply, &mut carried, 1_000_000, SECOND);
        let (pause, asked) = (5 * SECOND, 5 * SECOND);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
        assert_eq!(carried.throttled_since_ms, Some(1_000_000));
        assert_eq!(carried.reservation, None);
    }

    #[test]
    fn a_429_without_retry_after_pauses_the_seller_for_one_window() {
        let reply = Reply::Throttled { retry_after: None };
        let plan = settings().plan_reply(reply, &mut Carried::default(), 0, 3 * SECOND);
        let (pause, asked) = (3 * SECOND, 3 * SECOND);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
    }

    #[test]
    fn a_retry_after_beyond_max_pause_pauses_for_max_pause() {
        let plan = settings().plan_throttled(3_600 * SECOND, &mut Carried::default(), 0);
        let (pause, asked) = (60 * SECOND, 3_600 * SECOND);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
    }

    #[test]
    fn a_retry_after_of_zero_pauses_for_a_millisecond() {
        let plan = settings().plan_throttled(Duration::ZERO, &mut Carried::default(), 0);
        let (pause, asked) = (MS, Duration::ZERO);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
    }

    #[test]
    fn a_429_just_before_the_throttle_deadline_pauses_the_seller() {
        let mut carried = Carried {
            throttled_since_ms: Some(1_000_000),
            ..Carried::default()
        };
        let now_ms = 1_000_000 + 599_999;
        let plan = settings().plan_throttled(SECOND, &mut carried, now_ms);
        let (pause, asked) = (SECOND, SECOND);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
        assert_eq!(
            carried.throttled_since_ms,
            Some(1_000_000),
            "still the first"
        );
    }

    #[test]
    fn a_429_past_the_throttle_deadline_is_dead_lettered_as_throttled() {
        let mut carried = Carried {
            throttled_since_ms: Some(1_000_000),
            ..Carried::default()
        };
        let now_ms = 1_000_000 + 600_000;
        let plan = settings().plan_throttled(SECOND, &mut carried, now_ms);
        let detail = "the downstream answered 429 for 600 s (TURNSTILE_THROTTLE_DEADLINE 600 s)";
        assert_eq!(plan, dead_letter("throttled", detail));
    }

    #[test]
    fn a_limiter_refusal_drops_the_reservation_and_the_third_dead_letters_the_message() {
        let mut errors = PermitErrors::default();
        let mut carried = reserved();
        let refusal = || PermitError::Answer("redeem");
        assert_eq!(errors.plan(refusal(), &mut carried), Plan::AskAgain);
        assert_eq!(carried.reservation, None);
        assert_eq!(errors.plan(refusal(), &mut carried), Plan::AskAgain);
        let detail = "the limiter refused it 3 times: unexpected answer from the redeem script";
        let plan = errors.plan(refusal(), &mut carried);
        assert_eq!(plan, dead_letter("invalid-message", detail));
    }

    #[test]
    fn redis_out_of_reach_is_asked_again_later_keeping_the_reservation() {
        let mut errors = PermitErrors::default();
        let mut carried = reserved();
        let io = PermitError::Redis(redis::RedisError::from(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        let plan = errors.plan(io, &mut carried);
        assert!(
            matches!(plan, Plan::AskAfter(wait) if wait <= 100 * MS),
            "{plan:?}"
        );
        assert_eq!(carried, reserved());
    }

    #[test]
    fn a_wait_interrupted_by_shutdown_goes_back_with_its_reservation() {
        let outcome = returned(reserved(), Interrupted::Shutdown);
        let after = Duration::ZERO;
        let carried = reserved();
        assert_eq!(outcome, Outcome::Delay { after, carried });
    }

    #[test]
    fn a_wait_interrupted_by_a_lost_connection_is_left_to_the_broker() {
        let outcome = returned(reserved(), Interrupted::ConnectionLost);
        assert_eq!(outcome, Outcome::Requeue);
    }

    #[test]
    fn a_delay_after_one_more_failed_attempt_counts_as_retried() {
        let delayed = Outcome::Delay {
            after: SECOND,
            carried: Carried {
                attempt: 2,
                ..Carried::default()
            },
        };
        assert_eq!(delayed.label(1), "retried");
        assert_eq!(delayed.label(2), "delayed");
        assert_eq!(Outcome::Requeue.label(0), "requeued");
    }

    #[test]
    fn redis_outages_are_waited_out_and_refusals_given_up_after_three() {
        let io = PermitError::Redis(redis::RedisError::from(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        let (mut refused, mut backoff) = (0, redis_backoff());
        for _ in 0..100 {
            assert!(matches!(
                permit_failure(&io, &mut refused, &mut backoff),
                PermitFailure::Unavailable(wait) if wait <= Duration::from_secs(10)
            ));
        }
        let script = PermitError::Answer("redeem");
        assert_eq!(
            permit_failure(&script, &mut refused, &mut backoff),
            PermitFailure::Refused
        );
        assert_eq!(
            permit_failure(&script, &mut refused, &mut backoff),
            PermitFailure::Refused
        );
        assert_eq!(
            permit_failure(&script, &mut refused, &mut backoff),
            PermitFailure::GiveUp
        );
    }

    #[test]
    fn latency_quantiles_follow_the_samples_within_a_percent() {
        let latencies = LatencySummary::default();
        assert_eq!(latencies.quantile(0.5), Duration::ZERO, "no samples yet");
        for micros in 1..=100u64 {
            latencies.record(Duration::from_micros(micros * 10));
        }
        assert_eq!(latencies.count(), 100);
        let p50 = latencies.quantile(0.5).as_secs_f64() * 1e6;
        let p99 = latencies.quantile(0.99).as_secs_f64() * 1e6;
        assert!((495.0..=505.0).contains(&p50), "{p50}");
        assert!((980.0..=1_000.0).contains(&p99), "{p99}");
    }

    #[test]
    fn absorbed_latencies_count_in_the_quantiles() {
        let (fast, slow) = (LatencySummary::default(), LatencySummary::default());
        for _ in 0..50 {
            fast.record(Duration::from_micros(100));
            slow.record(Duration::from_millis(10));
        }
        fast.absorb(&slow);
        assert_eq!(fast.count(), 100);
        let p99 = fast.quantile(0.99).as_secs_f64() * 1e3;
        assert!((9.9..=10.1).contains(&p99), "{p99}");
        assert_eq!(slow.count(), 50, "the absorbed summary keeps its samples");
    }
}
