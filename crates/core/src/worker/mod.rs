//! One delivery, start to finish: parse, permit, call, and one [`Outcome`], applied in one place.
//!
//! A throttled message waits for the slot the limiter reserved for it. Short waits (up to
//! `hold`) are held here, unacked and within prefetch; longer ones go through the broker's delay
//! ladder and come back `lead` before their slot, then are held for the rest. Other sellers'
//! messages never queue behind either: a held message takes no worker, and the ladder's queues
//! each hold one fixed delay.
//!
//! - this module: [`Worker`], the I/O of one delivery (permit, call, hold, settle)
//! - [`plan`]: what happens to a message, decided from plain values ([`Outcome`], `Plan`,
//!   [`WorkerSettings`]' `plan_*` methods, backoff and lead), with unit tests that need no
//!   services
//! - [`stats`]: [`Stats`], what a replica reports to whoever watches it
//! - [`waits`]: [`SellerWaits`], the sellers lately told to wait, whose new messages ask for
//!   their permit without taking a worker
//! - [`report`]: a message's result and a batch's completion event, as the upload service
//!   reads them
//! - [`batches`]: [`SeenBatches`], the batches this replica has noted as seen
//! - [`bulk`]: [`Gathers`], the rows of one seller and route gathered into one bulk call

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::types::AMQPValue;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::broker::results::{ReplyTo, ResultSink};
use crate::broker::{PublishError, Publisher, Settler, Topology};
use crate::domain::unix_ms;
use crate::domain::{
    BatchId, Identity, MessageId, Priority, RateLimitHeaders, Registration, SellerId,
};
use crate::downstream::{Api, Reply};
use crate::routes::{BulkCost, Route, Routes};
use crate::trace::TraceContext;
mod ahead;
mod batches;
mod bulk;
mod carried;
#[cfg(test)]
mod fakes;
#[cfg(test)]
mod handle_tests;
mod plan;
pub mod report;
mod stats;
mod superseding;
mod waits;

pub use ahead::AskAhead;
pub use batches::SeenBatches;
pub use bulk::Gathers;
pub use carried::Carried;
pub use plan::{DEAD_LETTER_REASONS, OUTCOME_LABELS, Outcome, Report, WorkerSettings};
use plan::{Interrupted, PermitErrors, Plan, returned, stranded};
pub use stats::{LatencySummary, Stats};
pub use waits::SellerWaits;

use crate::permit::{
    Ask, Asked, BatchEvent, CALL_ALLOWANCE, CLAIM_ASKING, CallClaim, Decision, Ended, Grant,
    InBatch, Limiter, PermitError, Progress, Rank, Recorded, Rescheduled, Reservation,
};

/// What may end a wait early: the replica shutting down, or the delivery's connection lost.
#[derive(Clone, Copy)]
struct Interruptions<'a> {
    shutdown: &'a CancellationToken,
    connection_lost: &'a CancellationToken,
}

/// A token never cancelled: what [`Interruptions::NONE`] waits on.
static NEVER: std::sync::LazyLock<CancellationToken> =
    std::sync::LazyLock::new(CancellationToken::new);

impl Interruptions<'static> {
    /// Nothing ends the wait (work that outlives its delivery's session).
    fn none() -> Self {
        Self {
            shutdown: &NEVER,
            connection_lost: &NEVER,
        }
    }
}

/// Where a delivery's result goes, and what it says of the message besides its outcome.
struct Reporting {
    results: Arc<dyn ResultSink>,
    reply: ReplyTo,
    /// Who the message is, as far as its body says (all of it for a valid registration).
    identity: Identity,
    /// The batch size the message gave, if it is a valid registration that gave one.
    batch_size: Option<crate::domain::BatchSize>,
    /// The message's units (one for a message that is not a valid registration).
    cost: crate::domain::Cost,
    first_seen_ms: u64,
}

impl Reporting {
    /// The message's batch, if its body names one (and a seller and an id to count it by).
    fn batch(&self) -> Option<(&SellerId, &MessageId, InBatch<'_>)> {
        let identity = &self.identity;
        Some((
            identity.seller_id.as_ref()?,
            identity.message_id.as_ref()?,
            InBatch {
                id: identity.batch_id.as_ref()?,
                size: self.batch_size,
            },
        ))
    }
}

/// `result`, a Redis failure counted in `turnstile_redis_errors_total`.
fn counting_redis_errors<T>(result: Result<T, PermitError>) -> Result<T, PermitError> {
    if result.is_err() {
        metrics::counter!("turnstile_redis_errors_total").increment(1);
    }
    result
}

/// Runs `attempt` until it succeeds, waiting out failures with the Redis backoff (each logged
/// as `what`); `None` when shutdown or a lost connection interrupts the wait.
async fn until_done<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    what: &'static str,
    interruptions: Interruptions<'_>,
    mut attempt: impl FnMut() -> F,
) -> Option<T> {
    let mut backoff = plan::redis_backoff();
    loop {
        let error = match attempt().await {
            Ok(done) => return Some(done),
            Err(error) => error,
        };
        let wait = backoff.next().unwrap_or(Duration::from_secs(5));
        warn!(%error, retry_in_ms = wait.as_millis() as u64, "{what}; retrying, the message unacked");
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = interruptions.shutdown.cancelled() => return None,
            _ = interruptions.connection_lost.cancelled() => return None,
        }
    }
}

/// Everything a delivery needs; shared by all of a replica's tasks.
pub struct Worker {
    /// The per-seller limiter (in production a [`crate::permit::PermitStore`]).
    pub limiter: Arc<dyn Limiter>,
    /// The uploads' records (in production the same store).
    pub progress: Arc<dyn Progress>,
    /// The registration API (in production a [`crate::downstream::Downstream`]).
    pub downstream: Arc<dyn Api>,
    /// The routes a message may name (none without a routes file).
    pub routes: Arc<Routes>,
    pub topology: Topology,
    pub settings: WorkerSettings,
    pub workers: Arc<Semaphore>,
    /// Extra workers only for messages coming back for a reserved slot (a quarter of
    /// `workers`, at least one): a due slot never waits for a worker behind new messages, and a
    /// slot lost to that wait would cost the message another round through the ladder.
    pub due_lane: Arc<Semaphore>,
    /// Places for new messages to ask for their permit while every worker is busy (see
    /// [`ahead`]).
    pub ask_ahead: ahead::AskAhead,
    pub stats: Arc<Stats>,
    /// Notices of sellers whose terms changed (see `permit::watch_reschedules`): a message held
    /// for a slot given back by the change comes back at once.
    pub reschedules: tokio::sync::broadcast::Sender<Rescheduled>,
    /// The tag of the fleet's terms in force (see `permit::applied`): a message that waited
    /// under others asks anew, and the delay ladder wakes such messages when it changes.
    pub terms: tokio::sync::watch::Receiver<crate::permit::applied::InForce>,
    /// Registrations whose completion record is being written here.
    pub records_in_writing: RecordsInWriting,
    /// Sellers lately told to wait: their new messages ask without taking a worker.
    pub seller_waits: SellerWaits,
    /// Batches this replica noted as seen (once per batch, not per message).
    pub seen_batches: Arc<SeenBatches>,
    /// The replica's links: while Redis is cut off, a registration's record waits in the
    /// background (see [`Self::record_later`]).
    pub links: crate::links::Links,
    /// The records written in the background once Redis answers (see [`Self::record_later`]):
    /// the replica's drain waits for them.
    pub records_later: tokio_util::task::TaskTracker,
    /// The rows of bulk routes gathered into one call (see [`bulk`]).
    pub gathers: Arc<Gathers>,
}

/// Added to a typical call's duration in [`Worker::answers_allowance`]: a call's end is recorded
/// from when its permit was asked for, a little before the call was sent.
const ANSWER_MARGIN: Duration = Duration::from_millis(2);
/// The most [`Worker::answers_allowance`] adds to a wait.
const MOST_ANSWERS_ALLOWANCE: Duration = Duration::from_secs(1);

/// How long a message whose call another copy claimed ([`Limiter::claim_call`]) waits before
/// it asks again (the call that holds the claim is usually answered and recorded long before
/// its claim expires, and the copy is then acked as registered), and how long one whose claim
/// Redis did not answer waits (also past the end of a claim no longer fresh).
const CLAIM_RECHECK: Duration = Duration::from_secs(1);
const CLAIM_UNANSWERED_RECHECK: Duration = Duration::from_millis(100);

/// One delivery's claim of its message's call ([`Limiter::claim_call`]): the token that names
/// the delivery in Redis, and when the claim it holds was taken or last renewed (no later than
/// when the question that did it left), if it holds one that led to no call yet. A claim is
/// relied on, and renewed when the delivery asks again ([`Limiter::renew_claim`]), only while
/// it is fresh, within [`CLAIM_FRESH`] of that: an older one may end before the renewal, or the
/// call's own hold ([`Limiter::note_call`]), reaches Redis.
struct DeliveryClaim {
    token: String,
    taken: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// How long after it was taken a delivery's claim is relied on to call, or ended by the
/// delivery itself: [`CLAIM_ASKING`] less 1.5 s, left for the call's hold (or the `DEL`) to
/// reach Redis before the claim ends on its own. Through a link of 500 ms a question that
/// takes two round trips (a redeem, then an acquire) still calls under its claim.
const CLAIM_FRESH: Duration = Duration::from_millis(2_500);

impl DeliveryClaim {
    fn new() -> Self {
        Self {
            token: format!("{:016x}", rand::random::<u64>()),
            taken: std::sync::Mutex::new(None),
        }
    }

    fn taken(&self) -> std::sync::MutexGuard<'_, Option<tokio::time::Instant>> {
        self.taken.lock().expect("never poisoned")
    }

    /// Whether a claim taken (or renewed) at `taken` is still fresh.
    fn fresh_since(taken: tokio::time::Instant) -> bool {
        taken.elapsed() < CLAIM_FRESH
    }

    /// A question that left at `asked` got `claimed`; whether the claim is this delivery's and
    /// fresh, to be renewed from `asked` ([`Limiter::renew_claim`]).
    fn answered(
        &self,
        claimed: &Result<CallClaim, PermitError>,
        asked: tokio::time::Instant,
    ) -> bool {
        let mut taken = self.taken();
        match claimed {
            Ok(CallClaim::Taken) => *taken = Some(asked),
            // Fresh, it holds long enough for its renewal to reach Redis first.
            Ok(CallClaim::Held) if taken.is_some_and(Self::fresh_since) => {
                *taken = Some(asked);
                return true;
            }
            Ok(CallClaim::Held) => {}
            Ok(CallClaim::Elsewhere) => *taken = None,
            // Not known: kept as it was (it ends on its own).
            Err(_) => {}
        }
        false
    }

    /// How long until the claim this delivery holds ends on its own (or is ended), if it is no
    /// longer fresh (see [`CLAIM_FRESH`]); `None` while it is fresh. One of an earlier call of
    /// this delivery (answered without registering: its `DEL` may still be on its way) is not.
    fn stale_for(&self) -> Option<Duration> {
        let Some(taken) = *self.taken() else {
            return Some(Duration::ZERO);
        };
        (!Self::fresh_since(taken)).then(|| CLAIM_ASKING.saturating_sub(taken.elapsed()))
    }

    /// Whether the delivery holds a fresh claim that led to no call: it may end it.
    fn fresh(&self) -> bool {
        self.taken().is_some_and(Self::fresh_since)
    }

    /// Its call started: the claim is the call's now.
    fn called(&self) {
        *self.taken() = None;
    }
}

/// What a message asks for its permit with: the worker it calls under, if it took one first,
/// and its place to ask ahead, if it took one (see [`ahead`]); neither when it asks while
/// workers are free or its seller is expected to wait.
#[derive(Default)]
struct Asking {
    worker: Option<OwnedSemaphorePermit>,
    ahead: Option<OwnedSemaphorePermit>,
}

impl Asking {
    fn with_worker(worker: OwnedSemaphorePermit) -> Self {
        Self {
            worker: Some(worker),
            ahead: None,
        }
    }
}

/// Registrations this replica is calling, then writing the completion record of: a record may
/// ride along with other calls to Redis for a while (see `permit::batch`), and another copy of
/// the same message delivered to this replica meanwhile waits for it, then finds the message
/// registered, as it would if the record had been written at once; a copy granted while one is
/// called asks again after it. Holds at most one entry per call in flight or record in
/// writing.
#[derive(Default)]
pub struct RecordsInWriting {
    by_message: std::sync::Mutex<HashMap<(SellerId, MessageId), Arc<Notify>>>,
    /// Registrations recorded here lately, and when: a grant asked for before that moment (by
    /// a copy, while the record did not exist) is not called (see [`RecordsInWriting::claim`]).
    /// Kept [`CALL_ALLOWANCE`] and a little more: an older grant is never called anyway.
    recorded: std::sync::Mutex<Recent<(SellerId, MessageId)>>,
}

/// Keys noted lately and when, forgotten [`Recent::KEPT`] after they were noted: each note
/// forgets the notes older than that, in the order they were made, so a note costs the same
/// whatever the rate (a sweep of the whole set on every note cost a replica at 3,000
/// registrations a second about a tenth of its CPU).
struct Recent<K> {
    at: HashMap<K, std::time::Instant>,
    /// The notes in the order they were made; a key noted again has an older entry here that
    /// no longer matches its time in `at`, and forgets nothing when it goes.
    order: std::collections::VecDeque<(std::time::Instant, K)>,
}

impl<K> Default for Recent<K> {
    fn default() -> Self {
        Self {
            at: HashMap::new(),
            order: std::collections::VecDeque::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone> Recent<K> {
    /// How long a note is kept: a grant older than [`CALL_ALLOWANCE`] is never called anyway.
    const KEPT: Duration = Duration::from_secs(2 * CALL_ALLOWANCE.as_secs());

    /// Notes `key` at `now`, and forgets the notes older than [`Recent::KEPT`] before `now`.
    fn note(&mut self, key: K, now: std::time::Instant) {
        while let Some((at, _)) = self.order.front()
            && now.saturating_duration_since(*at) > Self::KEPT
        {
            let (at, old) = self.order.pop_front().expect("a front was just seen");
            if self.at.get(&old) == Some(&at) {
                self.at.remove(&old);
            }
        }
        self.at.insert(key.clone(), now);
        self.order.push_back((now, key));
    }

    /// When `key` was last noted, if it is still kept.
    fn noted(&self, key: &K) -> Option<std::time::Instant> {
        self.at.get(key).copied()
    }
}

/// Ends a record's writing when dropped (written, failed, or the task gone): its waiters go on.
struct Writing<'a> {
    records: &'a RecordsInWriting,
    key: (SellerId, MessageId),
}

impl Writing<'_> {
    /// The registration is recorded: a grant a copy asked for before now is not called.
    fn recorded(self) {
        let now = std::time::Instant::now();
        self.records
            .recorded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note(self.key.clone(), now);
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if let Some(notify) = self.records.lock().remove(&self.key) {
            notify.notify_waiters();
        }
    }
}

impl RecordsInWriting {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(SellerId, MessageId), Arc<Notify>>> {
        self.by_message
            .lock()
            .expect("the records' lock is never poisoned")
    }

    /// The key of `registration`'s record.
    fn key(registration: &Registration) -> (SellerId, MessageId) {
        (
            registration.seller_id.clone(),
            registration.message_id.clone(),
        )
    }

    /// Notes that `registration` is being called here, and then its record written, until the
    /// guard is dropped; `None` if another copy of it is (it goes first), or if a copy was
    /// recorded here since the grant's request was `sent` (the grant did not see the record).
    fn claim(&self, registration: &Registration, sent: std::time::Instant) -> Option<Writing<'_>> {
        let key = Self::key(registration);
        let recorded = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
        if recorded.noted(&key).is_some_and(|at| at >= sent) {
            return None;
        }
        drop(recorded);
        let mut calling = self.lock();
        if calling.contains_key(&key) {
            return None;
        }
        calling.insert(key.clone(), Arc::default());
        Some(Writing { records: self, key })
    }

    /// Whether `registration`'s record is being written here.
    fn is_writing(&self, registration: &Registration) -> bool {
        self.lock().contains_key(&Self::key(registration))
    }

    /// Waits while `registration`'s record is being written here.
    async fn wait_for(&self, registration: &Registration) {
        let key = Self::key(registration);
        let Some(notify) = self.lock().get(&key).cloned() else {
            return;
        };
        let notified = notify.notified();
        tokio::pin!(notified);
        // Registered before looking again: a wake-up between the two is not missed.
        notified.as_mut().enable();
        if self.lock().contains_key(&key) {
            notified.await;
        }
    }
}

/// The tag a delayed message carries: the fleet's terms' it asked under (`before`), or
/// [`UNKNOWN_TERMS`](crate::permit::applied::UNKNOWN_TERMS) when they changed while it asked
/// (`after`); none before the fleet is heard from.
fn waited_under(before: u64, after: u64) -> Option<u64> {
    match (before, after) {
        (0, _) => None,
        (before, after) if before == after => Some(before),
        _ => Some(crate::permit::applied::UNKNOWN_TERMS),
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

/// Counts a dead-lettered message that names no batch as dead in the dead letters by reason,
/// once per message ([`PermitStore::count_dead`]; a body without an identity is counted per
/// dead letter), in the background: it never delays the ack, and a failure only costs the
/// count. A message whose body named a batch but no seller is counted in that batch (see
/// [`PermitStore::count_orphan`]), and the batch's completion event published if that
/// completed it.
fn count_dead_letter(
    progress: &Arc<dyn Progress>,
    results: &Arc<dyn ResultSink>,
    identity: &Identity,
    reason: &'static str,
    ttl: Duration,
) {
    let identity = identity.clone();
    let (progress, results) = (progress.clone(), results.clone());
    let record = async move {
        match progress.dead(&identity, reason, ttl).await {
            Ok(Some((seller, event))) => {
                if let Some(batch) = &identity.batch_id {
                    let sent = publish_event(
                        &*progress,
                        &*results,
                        &seller,
                        batch,
                        event,
                        Interruptions::none(),
                    );
                    let _ = tokio::time::timeout(EVENT_PUBLISH_BOUND, sent).await;
                }
            }
            Ok(None) => {}
            Err(error) => {
                metrics::counter!("turnstile_redis_errors_total").increment(1);
                warn!(%error, "dead-lettered, but not counted in the dashboard and upload progress");
            }
        }
    };
    tokio::spawn(record.in_current_span());
}

/// How long a completion event found in the background (a batch's first sight, a message
/// without a seller counted in its batch) is retried before it is left pending for the
/// batch's next message or redelivery.
const EVENT_PUBLISH_BOUND: Duration = Duration::from_secs(30);

/// Publishes a batch's completion `event` (its counts read now) and says so in Redis, retrying
/// until both are done; `false` when interrupted first (the event stays pending: the next
/// message of the batch recorded, or a redelivery, publishes it).
async fn publish_event(
    progress: &dyn Progress,
    results: &dyn ResultSink,
    seller: &SellerId,
    batch: &BatchId,
    event: BatchEvent,
    interruptions: Interruptions<'_>,
) -> bool {
    let what = "the batch's completion event was not published";
    let published = until_done(what, interruptions, || async move {
        let Some(counts) = progress.batch_progress(seller, batch).await? else {
            // Expired meanwhile: nothing left to say.
            return anyhow::Ok(());
        };
        let body = report::completed_body(&counts, event.completed_ms);
        results.publish_event(batch.as_str(), &body).await?;
        progress.event_sent(seller, batch, event).await?;
        metrics::counter!("turnstile_batches_completed_total").increment(1);
        info!(
            batch = batch.as_str(),
            registered = counts.registered,
            dead = counts.dead,
            "batch completed"
        );
        anyhow::Ok(())
    })
    .await;
    published.is_some()
}

impl Worker {
    /// Handles a delivery and settles it (a final outcome's result published to `results`
    /// first); never fails (errors are logged with context).
    pub async fn process(
        &self,
        delivery: Delivery,
        publisher: &Publisher,
        results: &Arc<dyn ResultSink>,
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
        let mut known_elsewhere = false;
        let registration = Registration::parse(&delivery.data, message_id.as_deref()).and_then(
            |mut registration| {
                registration.priority = Priority::from_amqp(*delivery.properties.priority());
                if let Some(route) = &registration.route {
                    known_elsewhere = self.routes.get(route).is_none()
                        && self.terms.borrow().routes.contains(route);
                }
                self.routes.resolve(&mut registration)?;
                Ok(registration)
            },
        );
        let mut carried = Carried::from_delivery(&delivery, crate::domain::unix_ms());
        let reporting = Reporting {
            results: results.clone(),
            reply: ReplyTo::of(&delivery.properties, &self.topology),
            identity: match &registration {
                Ok(r) => Identity::from(r),
                Err(_) => Identity::of(&delivery.data, message_id.as_deref()),
            },
            batch_size: registration.as_ref().ok().and_then(|r| r.batch_size),
            cost: registration
                .as_ref()
                .map_or(crate::domain::Cost::ONE, |r| r.cost),
            first_seen_ms: carried.first_seen_ms,
        };
        let attempt = carried.attempt;
        // A missing or invalid traceparent starts a new trace (never a reason to refuse), which
        // the message's delayed copies and dead letter then carry.
        let trace = TraceContext::from_headers(delivery.properties.headers().as_ref())
            .unwrap_or_else(|| {
                let started = TraceContext::start();
                carried.started_trace = Some(started.clone());
                started
            });
        let trace_id = trace.trace_id();
        let started_trace = carried.started_trace.clone();
        // `span_id`: the current downstream call's span, recorded when it is made. An invalid
        // message carries what could be read of its ids.
        let ids = &reporting.identity;
        let span = info_span!(
            "registration",
            seller_id = ids.seller_id.as_ref().map(|s| s.as_str()),
            message_id = ids.message_id.as_ref().map(|m| m.as_str()),
            batch_id = ids.batch_id.as_ref().map(|b| b.as_str()),
            attempt,
            trace_id = %trace_id,
            span_id = tracing::field::Empty
        );
        // Before any permit: a message no copy of which fits the broker's frame goes no further.
        let admitted = publisher.admit(&delivery);
        let interruptions = Interruptions {
            shutdown,
            connection_lost,
        };
        let outcome = async {
            if let Ok(registration) = &registration {
                self.note_batch(registration, &reporting);
            }
            let outcome = match registration {
                _ if let Err(too_large) = admitted => {
                    Outcome::dead("invalid-message", too_large.to_string(), attempt)
                }
                Ok(registration) => {
                    self.handle(&registration, &trace, carried, &reporting, interruptions)
                        .await
                }
                Err(invalid) if known_elsewhere => {
                    debug!(%invalid, "a route another replica knows: waiting for one to take it");
                    plan::plan_unknown_route(
                        true,
                        &carried,
                        crate::domain::unix_ms(),
                        &invalid.to_string(),
                    )
                }
                Err(invalid) => Outcome::dead("invalid-message", invalid.to_string(), attempt),
            };
            debug!(?outcome, "handled");
            outcome
        }
        .instrument(span.clone())
        .await;
        let outcome = self
            .unless_registered(outcome, &reporting, interruptions)
            .instrument(span.clone())
            .await;
        self.settle(
            delivery,
            outcome,
            started_trace.as_ref(),
            publisher,
            &reporting,
            settler,
            interruptions,
        )
        .instrument(span)
        .await;
    }

    /// `outcome`, unless it dead-letters a message whose completion record says registered: the
    /// delivery is then a copy of a registered message, or something else naming it (its result
    /// come back into a queue of ours by another route, an edited copy, a copy past its
    /// deadline), acked as registered as any copy of it is (see [`Self::report_already_done`]):
    /// a registered message never gets a later result that says otherwise. Requeued when
    /// interrupted before Redis answered.
    async fn unless_registered(
        &self,
        outcome: Outcome,
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> Outcome {
        let Outcome::DeadLetter { reason, detail, .. } = &outcome else {
            return outcome;
        };
        let ids = &reporting.identity;
        let (Some(seller), Some(message)) = (&ids.seller_id, &ids.message_id) else {
            return outcome;
        };
        let what = "could not read whether the message is registered before dead-lettering it";
        let registered = until_done(what, interruptions, || async move {
            counting_redis_errors(self.progress.is_registered(seller, message).await)
        })
        .await;
        match registered {
            Some(false) => outcome,
            Some(true) => {
                warn!(
                    reason,
                    detail,
                    "not dead-lettered: the message it names is registered; acked as registered"
                );
                Outcome::AlreadyDone
            }
            None => Outcome::Requeue { holding: None },
        }
    }

    /// Notes the registration's batch as seen, the first time this replica sees one of its
    /// messages, in the background (see [`Progress::batch_seen`]); a failure is retried by
    /// its next message. A completion event found pending is published.
    fn note_batch(&self, registration: &Registration, reporting: &Reporting) {
        let Some(batch) = &registration.batch_id else {
            return;
        };
        let seller = &registration.seller_id;
        if !self.seen_batches.first_sight(seller, batch) {
            return;
        }
        let (progress, ttl) = (self.progress.clone(), self.settings.done_ttl);
        let (seller, batch, size) = (seller.clone(), batch.clone(), registration.batch_size);
        // A bulk route whose calls count once carries up to max_rows rows on one permit.
        let rows_per_call = match self.routes.bulk(registration.route.as_ref()) {
            Some(bulk) if bulk.cost == BulkCost::Call => bulk.max_rows as u32,
            _ => 1,
        };
        let results = reporting.results.clone();
        let seen_batches = self.seen_batches.clone();
        let note = async move {
            match progress
                .batch_seen(&seller, &batch, size, ttl, rows_per_call)
                .await
            {
                Ok(seen) => {
                    if seen.sellers > 1 {
                        metrics::counter!("turnstile_batch_anomalies_total", "kind" => "mixed_sellers")
                            .increment(1);
                        warn!(
                            batch = batch.as_str(),
                            sellers = seen.sellers,
                            "a batch id is used by several sellers: each seller's messages are counted as a batch of their own"
                        );
                    }
                    // Its messages dead-lettered without a seller, counted in it now.
                    let mut event = seen.event;
                    if !seen.orphans.is_empty() {
                        match progress
                            .adopt_orphans(&seller, &batch, &seen.orphans, ttl)
                            .await
                        {
                            Ok(adopted) => event = adopted.or(event),
                            Err(error) => {
                                seen_batches.forget(&seller, &batch);
                                debug!(%error, "could not count the batch's messages without a seller; its next message tries again");
                            }
                        }
                    }
                    // A batch found complete with its event unpublished (its last message's
                    // replica died before publishing it, and this message is one more), or
                    // completed by its messages without a seller.
                    if let Some(event) = event {
                        let sent = publish_event(
                            &*progress,
                            &*results,
                            &seller,
                            &batch,
                            event,
                            Interruptions::none(),
                        );
                        let _ = tokio::time::timeout(EVENT_PUBLISH_BOUND, sent).await;
                    }
                }
                Err(error) => {
                    seen_batches.forget(&seller, &batch);
                    debug!(%error, "could not note the batch as seen; its next message tries again");
                }
            }
        };
        tokio::spawn(note.in_current_span());
    }

    /// Decides what happens to one registration (of the trace `trace`: each call is a span of
    /// it). Holds a worker permit only while asking for a permit and calling the downstream, so
    /// held messages never starve the workers.
    async fn handle(
        &self,
        registration: &Registration,
        trace: &TraceContext,
        mut carried: Carried,
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> Outcome {
        let Interruptions {
            shutdown,
            connection_lost,
        } = interruptions;
        if let Err(why) = self.downstream.check_seller(&registration.seller_id) {
            return Outcome::dead("invalid-message", why, carried.attempt);
        }
        let product = self.product_of(registration);
        // The token of the reservation last noted for the product (see `note_reserved`).
        let mut noted = None;
        if let Some(product) = &product
            && let Some(superseded) = self
                .arrive(
                    registration,
                    product,
                    &mut carried,
                    &mut noted,
                    interruptions,
                )
                .await
        {
            return superseded;
        }
        let mut permit_errors = PermitErrors::default();
        let claim = DeliveryClaim::new();
        let outcome = loop {
            if let Some(detail) = plan::expired(registration.deadline, unix_ms(), None) {
                break self.expire(registration, &mut carried, detail);
            }
            let plan = self
                .ask(
                    registration,
                    trace,
                    &mut carried,
                    (&mut permit_errors, &claim),
                    reporting,
                    interruptions,
                )
                .await;
            let plan = self.within_deadline(plan, registration, &mut carried);
            if let Some(product) = &product
                && matches!(plan, Plan::Hold(_) | Plan::Settle(Outcome::Delay { .. }))
                && let Some(superseded) = self
                    .note_reserved(registration, product, &mut carried, &mut noted)
                    .await
            {
                break superseded;
            }
            let carried_out = self
                .carry_out(plan, registration, &carried, shutdown, connection_lost)
                .await;
            if let Some(outcome) = carried_out {
                break outcome;
            }
        };
        // A leader leaving without its call releases the rows that waited for it.
        if let Some(bulk) = self.routes.bulk(registration.route.as_ref())
            && bulk.cost == BulkCost::Call
        {
            let key = bulk::key_of(registration);
            let delay = match &outcome {
                Outcome::Delay { after, .. } => Some(*after),
                _ => None,
            };
            self.gathers.release(&key, &registration.message_id, delay);
        }
        // The delivery leaves with a claim that led to no call: another copy may call now. (One
        // no longer fresh is left to end on its own: it may be another copy's by now.)
        if claim.fresh() {
            self.limiter
                .unclaim_call(&registration.seller_id, &registration.message_id);
        }
        outcome
    }

    /// One round: takes a worker, asks for (or redeems) a permit, claiming the message's call
    /// in the same round trip, and plans what the answer leads to; a grant is called at once,
    /// under the worker, and the plan is then the reply's. Never returns [`Plan::Call`].
    async fn ask(
        &self,
        registration: &Registration,
        trace: &TraceContext,
        carried: &mut Carried,
        (permit_errors, claim): (&mut PermitErrors, &DeliveryClaim),
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> Plan {
        let Interruptions {
            shutdown,
            connection_lost,
        } = interruptions;
        let terms = self.terms.borrow().tag;
        if crate::permit::applied::stale_terms(carried.terms_tag, terms) {
            self.forget_stale_terms(registration, carried).await;
        }
        let interrupted = |why| Plan::Settle(returned(carried.clone(), why));
        if let Some(plan) = self.early_return(carried) {
            return plan;
        }
        // A copy of a message registered here a moment ago asks once its record is written.
        tokio::select! {
            _ = self.records_in_writing.wait_for(registration) => {}
            _ = shutdown.cancelled() => return interrupted(Interrupted::Shutdown),
            _ = connection_lost.cancelled() => return interrupted(Interrupted::ConnectionLost),
        }
        let seller = &registration.seller_id;
        if let Some(key) = self.riding_key(registration, carried) {
            // A row of a route whose calls count once rides in its seller's gather, if one
            // takes it: it asks only for its message's claim (see `bulk`).
            let told = match self.gathers.attach(&key, &registration.message_id) {
                Some(told) => tokio::select! {
                    told = told => told.ok(),
                    _ = shutdown.cancelled() => return interrupted(Interrupted::Shutdown),
                    _ = connection_lost.cancelled() => return interrupted(Interrupted::ConnectionLost),
                },
                None => None,
            };
            match told {
                Some(bulk::Attached::Ride(template, gather)) => {
                    let rider =
                        Grant::riding(&template, Some(&registration.message_id), registration.cost);
                    let plan = self
                        .ride(
                            registration,
                            trace,
                            (rider, &gather),
                            claim,
                            carried,
                            reporting,
                            interruptions,
                        )
                        .await;
                    // Its place is given up if it did not ride (nothing, once it did).
                    self.gathers
                        .leave_unless_joined(&gather, &registration.message_id);
                    return plan;
                }
                Some(bulk::Attached::Released(Some(after))) => {
                    return Plan::Settle(Outcome::Delay {
                        after,
                        carried: carried.clone(),
                    });
                }
                // Its leader left without a call: the first row released leads the next.
                Some(bulk::Attached::Released(None)) => return Plan::AskAgain,
                None => {
                    let max_rows = self.routes.bulk(key.1.as_ref()).map_or(1, |b| b.max_rows);
                    self.gathers.lead(key, &registration.message_id, max_rows);
                }
            }
        }
        let Asking { worker, ahead } =
            match self.worker_to_ask(seller, carried, interruptions).await {
                Ok(asking) => asking,
                Err(why) => return interrupted(why),
            };
        if self.records_in_writing.is_writing(registration) {
            // Registered by another worker while this one waited for a worker.
            return Plan::AskAgain;
        }
        let asked = std::time::Instant::now();
        let question = Ask::new(seller)
            .message(&registration.message_id)
            .cost(registration.cost)
            .held(carried.reservation.as_ref())
            .rank(Rank {
                priority: registration.priority,
                deadline_ms: registration.deadline.map(|d| d.unix_ms()),
                arrival_ms: carried.first_seen_ms,
            })
            .route(self.route_of(registration));
        // Beside the question, in the same round trip: of two copies of the message asking at
        // once (a producer's duplicate, a copy the broker handed over while this one's call is
        // in flight elsewhere), only the claim's holder may call.
        let claim_asked = tokio::time::Instant::now();
        let claiming = self
            .limiter
            .claim_call(seller, &registration.message_id, &claim.token);
        let (decided, claimed) = tokio::select! {
            d = futures::future::join(self.decide(question), claiming) => d,
            _ = shutdown.cancelled() => return interrupted(Interrupted::Shutdown),
            _ = connection_lost.cancelled() => return interrupted(Interrupted::ConnectionLost),
        };
        let claimed = self.claim_answered(registration, claim, claimed, claim_asked);
        let (mut decision, cost) = match decided {
            Ok(decided) => decided,
            Err(error) => {
                // No worker is held while the message waits for Redis.
                drop(worker);
                return permit_errors.plan(error, carried);
            }
        };
        if let Decision::Wait {
            retry_after,
            reservation: Some(_),
        } = &mut decision
        {
            *retry_after += self.answers_allowance();
        }
        carried.terms_tag = None;
        match &decision {
            Decision::Wait { retry_after, .. } | Decision::Deferred { retry_after, .. } => {
                let now = std::time::Instant::now();
                self.seller_waits.told_to_wait(seller, *retry_after, now);
                carried.terms_tag = waited_under(terms, self.terms.borrow().tag);
            }
            Decision::Granted { .. } => self.seller_waits.granted(seller),
            _ => {}
        }
        let holding = self.stats.held.load(Ordering::Relaxed);
        // A grant's age is bounded by the time since its request left, not since the ask: a
        // request may wait for the batcher, and a redeem or a pool claim may go first.
        let grant = Grant::of(question, &decision, cost);
        let sent = grant.as_ref().map_or(asked, Grant::sent);
        let waited = sent.elapsed();
        debug!(
            ?decision,
            since_sent_ms = waited.as_millis() as u64,
            asked_ms = asked.elapsed().as_millis() as u64,
            "permit answered"
        );
        let plan = self
            .settings
            .plan_decision(decision, waited, holding, carried);
        match (plan, grant) {
            (Plan::Call { .. }, Some(grant)) => {
                self.call_granted(
                    registration,
                    trace,
                    (grant, claimed, claim, None),
                    Asking { worker, ahead },
                    carried,
                    reporting,
                    interruptions,
                )
                .await
            }
            (plan, grant) => {
                drop((worker, ahead));
                if plan == Plan::AskAgain
                    && let Some(grant) = grant
                {
                    self.limiter.unsent(grant).await;
                    warn!(
                        since_sent_ms = waited.as_millis() as u64,
                        asked_ms = asked.elapsed().as_millis() as u64,
                        "a permit came back too late to send the call with it (Redis is slow); given back, asking again"
                    );
                }
                plan
            }
        }
    }

    /// The worker a message asks with, if it takes one before asking. Workers bound the
    /// downstream calls, not the questions to Redis (see `waits` and `ahead`): a message coming
    /// back for its reserved slot takes one (or one of the due lane); a new message asks without
    /// one while workers are free, or when its seller was lately told to wait, and takes one once
    /// granted. With every worker busy calling, it takes a place to ask ahead (while calls are
    /// fast), or else queues for a worker; it leaves either queue if its seller is told to wait
    /// meanwhile.
    async fn worker_to_ask(
        &self,
        seller: &SellerId,
        carried: &Carried,
        interruptions: Interruptions<'_>,
    ) -> Result<Asking, Interrupted> {
        let Interruptions {
            shutdown,
            connection_lost,
        } = interruptions;
        if carried.reservation.is_some() {
            let worker = tokio::select! {
                permit = self.workers.clone().acquire_owned() => permit.expect("the worker semaphore is never closed"),
                permit = self.due_lane.clone().acquire_owned() => permit.expect("the due lane is never closed"),
                _ = shutdown.cancelled() => return Err(Interrupted::Shutdown),
                _ = connection_lost.cancelled() => return Err(Interrupted::ConnectionLost),
            };
            return Ok(Asking::with_worker(worker));
        }
        let ahead = self.limiter.grants_may_wait() && self.ask_ahead.allowed();
        let queue = if ahead {
            self.ask_ahead.places.clone()
        } else {
            self.workers.clone()
        };
        let queued = queue.acquire_owned();
        tokio::pin!(queued);
        loop {
            let told = self.seller_waits.told();
            tokio::pin!(told);
            told.as_mut().enable();
            if self.workers.available_permits() > 0
                || self
                    .seller_waits
                    .expects_wait(seller, std::time::Instant::now())
            {
                return Ok(Asking::default());
            }
            tokio::select! {
                permit = &mut queued => {
                    let permit = permit.expect("the worker and ask-ahead semaphores are never closed");
                    return Ok(if ahead {
                        Asking { worker: None, ahead: Some(permit) }
                    } else {
                        Asking::with_worker(permit)
                    });
                }
                _ = told => {}
                _ = shutdown.cancelled() => return Err(Interrupted::Shutdown),
                _ = connection_lost.cancelled() => return Err(Interrupted::ConnectionLost),
            }
        }
    }

    /// Calls a grant under `worker`, or under one taken now for a message that asked without
    /// one (see [`Self::worker_for_grant`]): if another copy of the message holds the claim of
    /// its call (`claimed`), no worker is free in time, or a copy registered here meanwhile,
    /// the grant goes back and the message asks again.
    #[allow(clippy::too_many_arguments)]
    async fn call_granted(
        &self,
        registration: &Registration,
        trace: &TraceContext,
        (grant, claimed, claim, riding): (
            Grant,
            Result<CallClaim, PermitError>,
            &DeliveryClaim,
            Option<&Arc<bulk::Gather>>,
        ),
        Asking { worker, ahead }: Asking,
        carried: &mut Carried,
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> Plan {
        let recheck = match claimed {
            // One no longer fresh (not renewed) is let end, then taken anew.
            Ok(CallClaim::Taken | CallClaim::Held) => claim
                .stale_for()
                .map(|left| left + CLAIM_UNANSWERED_RECHECK),
            Ok(CallClaim::Elsewhere) => {
                metrics::counter!("turnstile_calls_claimed_elsewhere_total").increment(1);
                // A warning (folded when it repeats): another copy asked at the same moment, or
                // another replica lost this delivery with its call in flight.
                warn!(
                    recheck_ms = CLAIM_RECHECK.as_millis() as u64,
                    "another copy of this message holds the claim of its call: asking again in a moment"
                );
                Some(CLAIM_RECHECK)
            }
            Err(error) => {
                debug!(%error, "the call could not be claimed (Redis); not calling");
                Some(CLAIM_UNANSWERED_RECHECK)
            }
        };
        if let Some(recheck) = recheck {
            drop((worker, ahead));
            self.limiter.unsent(grant).await;
            carried.reservation = None;
            return Plan::AskAfter(recheck);
        }
        let worker = match worker {
            Some(worker) => Some(worker),
            // A row riding in another's bulk call waits for it without a worker.
            None if grant.rides() => None,
            None => match self.worker_for_grant(grant.sent(), interruptions).await {
                Some(worker) if !self.records_in_writing.is_writing(registration) => Some(worker),
                _ => {
                    self.limiter.unsent(grant).await;
                    carried.reservation = None;
                    return Plan::AskAgain;
                }
            },
        };
        drop(ahead);
        // A replica that lost its broker connection, or hands its work back, or stops, starts
        // no call: the message goes back to the broker for another replica, which must be the
        // only one to call it.
        if interruptions.connection_lost.is_cancelled() || interruptions.shutdown.is_cancelled() {
            self.limiter.unsent(grant).await;
            return Plan::Settle(Outcome::Requeue { holding: None });
        }
        if let Some(detail) = plan::expired(registration.deadline, unix_ms(), None) {
            self.limiter.unsent(grant).await;
            return Plan::Settle(self.expire(registration, carried, detail));
        }
        // Two copies of one message here (a redelivery beside a delayed copy, a producer's
        // duplicate) never call at once: the second asks again once the first is recorded.
        let Some(calling) = self.records_in_writing.claim(registration, grant.sent()) else {
            self.limiter.unsent(grant).await;
            carried.reservation = None;
            return Plan::AskAgain;
        };
        // A row riding in another's bulk call makes sure of its place before it may be
        // superseded no more: its gather may have closed meanwhile (it then has no call).
        if let Some(gather) = riding
            && !self.gathers.is_open(gather)
        {
            return Plan::AskAgain;
        }
        // A product's message that a newer one superseded takes no call; from the step that
        // says it may, it is never superseded.
        if let Some(product) = self.product_of(registration)
            && let Some(instead) = self
                .start_product_call(registration, &product, &grant, carried)
                .await
        {
            drop(calling);
            self.limiter.unsent(grant).await;
            return instead;
        }
        // A row of a bulk route joins its gather now, when it takes it: from here on nothing
        // stops its call. A rider whose gather closed in the meantime has no call.
        let joined = match riding {
            Some(gather) => self.gathers.ride_in(gather, registration),
            None => self.join_gather(registration, &grant, carried),
        };
        if joined.is_none() && grant.rides() {
            if let Some(product) = self.product_of(registration) {
                self.unstart_product_call(&product).await;
            }
            return Plan::AskAgain;
        }
        // Its claim holds for the whole call from now (the registration leaves it to expire:
        // its record answers for it; a call answered without registering ends it).
        self.limiter.note_call(&grant);
        claim.called();
        self.call(
            registration,
            trace,
            grant,
            (worker, calling, joined),
            carried,
            reporting,
            interruptions,
        )
        .await
    }

    /// Joins `registration` (granted `grant`, a permit of its own) to its seller's open gather
    /// on a bulk route whose rows are counted one by one, if the gather takes it (see
    /// [`bulk`]): its answer comes on the receiver. On a route whose calls count once, a row
    /// with a permit of its own always leads its own call.
    fn join_gather(
        &self,
        registration: &Registration,
        grant: &Grant,
        carried: &Carried,
    ) -> Option<tokio::sync::oneshot::Receiver<bulk::RowAnswer>> {
        let bulk = self.routes.bulk(registration.route.as_ref())?;
        if carried.alone || bulk.max_rows < 2 || bulk.cost != BulkCost::Row {
            return None;
        }
        let key = bulk::key_of(registration);
        self.gathers
            .join(&key, registration, bulk::due(grant.sent()))
    }

    /// A worker for a grant that came to a message asking without one, if one is free before
    /// the grant is [`CALL_ALLOWANCE`] old (counted from `sent`) and nothing interrupts.
    async fn worker_for_grant(
        &self,
        sent: std::time::Instant,
        interruptions: Interruptions<'_>,
    ) -> Option<OwnedSemaphorePermit> {
        let left = CALL_ALLOWANCE.saturating_sub(sent.elapsed());
        tokio::select! {
            permit = tokio::time::timeout(left, self.workers.clone().acquire_owned()) => {
                permit.ok().map(|p| p.expect("the worker semaphore is never closed"))
            }
            _ = interruptions.shutdown.cancelled() => None,
            _ = interruptions.connection_lost.cancelled() => None,
        }
    }

    /// How late after its reserved slot a message asks for it: with the algorithms whose slots
    /// also wait for the answers of the calls that fill the window (see
    /// [`Limiter::slots_wait_for_answers`]), one typical call (and [`ANSWER_MARGIN`]), at most
    /// [`MOST_ANSWERS_ALLOWANCE`] and a quarter of the shortest window (a slot is served up to
    /// a window late): the window opens only once the call it waits for has been
    /// answered, so asking at the slot itself would only be told to come back then, one more
    /// round trip to Redis per message. Never with the others, whose slots must be redeemed
    /// on time.
    fn answers_allowance(&self) -> Duration {
        if !self.limiter.slots_wait_for_answers() {
            return Duration::ZERO;
        }
        (self.ask_ahead.typical_call() + ANSWER_MARGIN)
            .min(MOST_ANSWERS_ALLOWANCE)
            .min(self.limiter.shortest_window() / 4)
    }

    /// How long until the reserved slot the message holds (plus `allowance`), on Redis's clock
    /// as the limiter last saw it; `None` without a reservation, before the limiter's first
    /// answer, or once the slot has come.
    fn until_slot(&self, carried: &Carried, allowance: Duration) -> Option<Duration> {
        let slot_us = carried.reservation.as_ref()?.slot_us;
        let until = slot_us
            .saturating_add(allowance.as_micros() as i64)
            .checked_sub(self.limiter.now_us()?)?;
        Some(Duration::from_micros(u64::try_from(until).ok()?))
    }

    /// `plan`, or the message's expiry if the plan makes it wait past its deadline (its
    /// reserved slot, or the end of its wait, is after it): see [`plan::expired`].
    fn within_deadline(
        &self,
        plan: Plan,
        registration: &Registration,
        carried: &mut Carried,
    ) -> Plan {
        if registration.deadline.is_none() {
            return plan;
        }
        let until_slot = self.until_slot(carried, Duration::ZERO);
        let Some(next_call) = self.settings.next_call_after(&plan, until_slot) else {
            return plan;
        };
        match plan::expired(registration.deadline, unix_ms(), Some(next_call)) {
            Some(detail) => Plan::Settle(self.expire(registration, carried, detail)),
            None => plan,
        }
    }

    /// Dead-letters a message as `expired` (`detail` says why), giving back the slot it
    /// reserved, so that the seller's next message may take it.
    fn expire(
        &self,
        registration: &Registration,
        carried: &mut Carried,
        detail: String,
    ) -> Outcome {
        if let Some(reservation) = carried.reservation.take() {
            self.unreserve_later(
                registration.seller_id.clone(),
                reservation,
                registration.cost,
                self.route_of(registration).cloned(),
            );
        }
        debug!(%detail, "expired");
        Outcome::dead("expired", detail, carried.attempt)
    }

    /// Forgets what a message waited for under fleet's terms no longer in force (a raise, a
    /// stricter replica gone): the slot it reserved under them is given back first, so that
    /// the slot it asks for now is planned under the terms in force, not after the old one.
    /// A failure to give it back leaves the old slot until it is pruned as stale.
    async fn forget_stale_terms(&self, registration: &Registration, carried: &mut Carried) {
        carried.terms_tag = None;
        let Some(reservation) = carried.reservation.take() else {
            return;
        };
        metrics::counter!("turnstile_reservations_replanned_total").increment(1);
        let given_back = self
            .limiter
            .unreserve(
                &registration.seller_id,
                &reservation,
                registration.cost,
                self.route_of(registration),
            )
            .await;
        if let Err(error) = given_back {
            debug!(%error, "a slot reserved under terms no longer in force was not given back; it is when pruned as stale");
        }
    }

    /// The plan for a message back before its reserved slot (see
    /// [`WorkerSettings::plan_early_return`]), if it is.
    fn early_return(&self, carried: &Carried) -> Option<Plan> {
        let until_slot = self.until_slot(carried, self.answers_allowance())?;
        let holding = self.stats.held.load(Ordering::Relaxed);
        self.settings
            .plan_early_return(until_slot, holding, carried)
    }

    /// Calls the downstream under a grant, as a new span of the message's trace, lets go of the
    /// worker once the answer came, hands the answer back to the limiter (for a 2xx, once its
    /// result is published: see [`Self::record_completion`]), and plans what the reply leads to.
    #[allow(clippy::too_many_arguments)]
    async fn call(
        &self,
        registration: &Registration,
        trace: &TraceContext,
        grant: Grant,
        (mut worker, calling, joined): (
            Option<OwnedSemaphorePermit>,
            Writing<'_>,
            Option<tokio::sync::oneshot::Receiver<bulk::RowAnswer>>,
        ),
        carried: &mut Carried,
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> Plan {
        let span = trace.child();
        tracing::Span::current().record("span_id", tracing::field::display(span.span_id()));
        self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        let answered = match self.routes.bulk(registration.route.as_ref()) {
            None => {
                let started = std::time::Instant::now();
                let answered = self.downstream.call(registration, &span).await;
                self.ask_ahead.called(started.elapsed());
                answered
            }
            Some(bulk) => {
                self.bulk_call(
                    bulk,
                    registration,
                    &grant,
                    (&mut worker, joined),
                    carried,
                    &span,
                )
                .await
            }
        };
        let answered_us = grant.answered_us();
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        // Kept, for a registration, until its record is written (see `ask`).
        let writing = matches!(answered.reply, Reply::Registered(_)).then_some(calling);
        self.limiter.answered(&grant).await;
        if let Some(actual) = answered.cost {
            self.limiter.recost(&grant, actual).await;
        }
        // The records below may wait to ride along with other calls to Redis: the worker is
        // free for the next call meanwhile (the message stays unacked until they are written).
        drop(worker);
        let reply = answered.reply;
        // A quota's reset is capped as a Retry-After is: a downstream cannot stall a seller
        // longer than TURNSTILE_MAX_PAUSE by saying so in its headers.
        let told = answered.rate_limit.map(|told| RateLimitHeaders {
            reset: told.reset.map(|reset| reset.min(self.settings.max_pause)),
            ..told
        });
        let lowered = match &reply {
            Reply::Registered(response) => 'registered: {
                // The record, with the result it keeps, goes in before anything waits on the
                // broker: from then on a copy redelivered to any replica is acked as registered
                // (never called again) and publishes the result if it is still kept.
                let report = Report {
                    response: Some(response.clone()),
                    attempts: carried.attempt.saturating_add(1),
                    superseded_by: None,
                };
                let result = self.result_body(reporting, "registered", None, &report);
                let kept = String::from_utf8_lossy(&result);
                let answer = Ended::Registered {
                    told,
                    batch: InBatch::of(registration),
                    ttl: self.settings.done_ttl,
                    result: Some(&kept),
                };
                let recorded = self.record_completion(&grant, answered_us, answer).await;
                if let Some(writing) = writing {
                    writing.recorded();
                }
                let Some(recorded) = recorded else {
                    // Redis cut off: the result goes out now and the message is acked; its
                    // record is written once Redis answers. Only a lost connection stops the
                    // publish (not a shutdown or a hand-back): the record then keeps the
                    // result, for the copy the broker hands to another replica.
                    let only_lost = Interruptions {
                        shutdown: &NEVER,
                        ..interruptions
                    };
                    let published = self
                        .publish_body(reporting, "registered", &result, only_lost)
                        .await;
                    let kept = (!published).then(|| kept.into_owned());
                    self.record_later(grant, answered_us, registration, told, reporting, kept);
                    if !published {
                        return Plan::Settle(Outcome::Requeue { holding: None });
                    }
                    break 'registered false;
                };
                if !self
                    .publish_body(reporting, "registered", &result, interruptions)
                    .await
                {
                    // Recorded with its result: a redelivery is acked as registered and
                    // publishes it.
                    return Plan::Settle(Outcome::Requeue { holding: None });
                }
                self.result_sent(&registration.seller_id, &registration.message_id);
                if !self
                    .publish_pending(reporting, recorded.event, interruptions)
                    .await
                {
                    // Recorded: a redelivery is acked as registered and publishes the event.
                    return Plan::Settle(Outcome::Requeue { holding: None });
                }
                false
            }
            Reply::Throttled { .. } => {
                self.stats.throttled.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("turnstile_downstream_throttled_total").increment(1);
                let answer = Ended::Throttled { told };
                let finished = self.limiter.finish(&grant, answered_us, answer).await;
                finished.is_ok_and(|f| f.lowered)
            }
            Reply::Transient { .. } | Reply::Rejected { .. } => {
                // Only a registration's record can fail: a call's end that is not written
                // keeps its place until its bound.
                let _ = self
                    .limiter
                    .finish(&grant, answered_us, Ended::Failed)
                    .await;
                false
            }
        };
        let now_ms = crate::domain::unix_ms();
        let window = self.limiter.shortest_window();
        self.settings
            .plan_reply(reply, carried, now_ms, window, lowered)
    }

    /// What a delivery's claim of its message's call (asked at `asked`) came to: a Redis
    /// failure counted, and a fresh claim of its own renewed (see [`DeliveryClaim::answered`]).
    fn claim_answered(
        &self,
        registration: &Registration,
        claim: &DeliveryClaim,
        claimed: Result<CallClaim, PermitError>,
        asked: tokio::time::Instant,
    ) -> Result<CallClaim, PermitError> {
        let claimed = counting_redis_errors(claimed);
        if claim.answered(&claimed, asked) {
            self.limiter
                .renew_claim(&registration.seller_id, &registration.message_id);
        }
        claimed
    }

    /// The gather `registration` would ride in, on a route whose calls count once (see
    /// [`bulk`]): only for a message with no reserved slot of its own, not to be called alone.
    fn riding_key(
        &self,
        registration: &Registration,
        carried: &Carried,
    ) -> Option<bulk::GatherKey> {
        if carried.reservation.is_some() || carried.alone {
            return None;
        }
        let bulk = self.routes.bulk(registration.route.as_ref())?;
        (bulk.cost == BulkCost::Call && bulk.max_rows > 1).then(|| bulk::key_of(registration))
    }

    /// Calls `registration` riding with `rider` in another row's bulk call, once its claim
    /// of the call is taken (in its own round trip: it asks for no permit).
    #[allow(clippy::too_many_arguments)]
    async fn ride(
        &self,
        registration: &Registration,
        trace: &TraceContext,
        (rider, gather): (Grant, &Arc<bulk::Gather>),
        claim: &DeliveryClaim,
        carried: &mut Carried,
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> Plan {
        let seller = &registration.seller_id;
        let claim_asked = tokio::time::Instant::now();
        let claiming = self
            .limiter
            .claim_call(seller, &registration.message_id, &claim.token);
        let claimed = tokio::select! {
            c = claiming => self.claim_answered(registration, claim, c, claim_asked),
            _ = interruptions.shutdown.cancelled() => return Plan::Settle(returned(carried.clone(), Interrupted::Shutdown)),
            _ = interruptions.connection_lost.cancelled() => return Plan::Settle(returned(carried.clone(), Interrupted::ConnectionLost)),
        };
        self.call_granted(
            registration,
            trace,
            (rider, claimed, claim, Some(gather)),
            Asking::default(),
            carried,
            reporting,
            interruptions,
        )
        .await
    }

    /// `registration`'s answer from a bulk call (see [`bulk`]): as a row that `joined` its
    /// seller's open gather (its worker given up while it waits), or as the leader of a new
    /// one, which waits for rows up to the route's linger (never past its grant's allowance)
    /// and makes the call. A row whose bulk answer could not be mapped is marked to be called
    /// alone.
    async fn bulk_call(
        &self,
        bulk: &crate::routes::Bulk,
        registration: &Registration,
        grant: &Grant,
        (worker, joined): (
            &mut Option<OwnedSemaphorePermit>,
            Option<tokio::sync::oneshot::Receiver<bulk::RowAnswer>>,
        ),
        carried: &mut Carried,
        span: &TraceContext,
    ) -> crate::downstream::Answered {
        if let Some(answer) = joined {
            drop(worker.take());
            let (answered, unmapped) = answer.await.unwrap_or_else(|_| {
                let reply = Reply::unanswered("the bulk call it joined was not made".into());
                (crate::downstream::Answered::only(reply), false)
            });
            carried.alone |= unmapped;
            return answered;
        }
        let key = bulk::key_of(registration);
        let started = std::time::Instant::now();
        let mut joined = Vec::new();
        if !carried.alone && bulk.max_rows > 1 {
            let start_by = (tokio::time::Instant::now() + bulk.linger).min(bulk::due(grant.sent()));
            let lead = (bulk.cost == BulkCost::Call)
                .then(|| Grant::riding(grant, None, registration.cost));
            let leader = &registration.message_id;
            let gather = self
                .gathers
                .open(key.clone(), leader, bulk.max_rows, start_by, lead);
            let quiet = (bulk.cost == BulkCost::Row).then_some(bulk::QUIET);
            gather.gathered(quiet).await;
            joined = self.gathers.close(&key, &gather);
        }
        let (others, answers): (Vec<_>, Vec<_>) = joined.into_iter().unzip();
        let mut rows = Vec::with_capacity(others.len() + 1);
        rows.push(registration.clone());
        rows.extend(others);
        debug!(rows = rows.len(), "bulk call");
        let called = self.downstream.call_bulk(bulk, &rows, span).await;
        self.ask_ahead.called(started.elapsed());
        let unmapped = called.unmapped;
        let mut answered = called.answers.into_iter();
        let mut own = answered.next().unwrap_or_else(|| {
            let reply = Reply::unanswered("the bulk answer had no entry for it".into());
            crate::downstream::Answered::only(reply)
        });
        for (answer, row) in answers.into_iter().zip(answered) {
            let _ = answer.send((row, unmapped));
        }
        // The provider's cost header is the whole call's: it says nothing of one row's units.
        if bulk.cost == BulkCost::Row {
            own.cost = None;
        }
        carried.alone |= unmapped;
        own
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
                warn!(failed_attempts = carried.attempt, %why, "downstream failed; retrying later");
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
        if let Err(error) = self.limiter.pause(&registration.seller_id, pause).await {
            warn!(%error, "could not record the pause; delaying the message instead");
            return false;
        }
        true
    }

    /// Asks for (or redeems) a permit: one attempt (see [`permit_failure`] for what an error
    /// leads to). Answers the decision and the units it is for (see [`Asked::cost`]).
    async fn decide(
        &self,
        question: Ask<'_>,
    ) -> Result<(Decision, crate::domain::Cost), PermitError> {
        let started = std::time::Instant::now();
        let Asked {
            decision,
            forfeit,
            cost,
        } = self.limiter.ask(question).await?;
        self.stats.permit_latency.record(started.elapsed());
        if let Some(forfeit) = forfeit {
            self.stats.forfeited.fetch_add(1, Ordering::Relaxed);
            debug!(?forfeit, "reserved slot given up; reserved anew");
        }
        self.stats.touch(question.seller);
        Ok((decision, cost))
    }

    /// Hands a registration's `answer` back to the limiter: its completion record, in one step
    /// with its call's end. A Redis that fails or refuses the write (down, OOM, MISCONF,
    /// READONLY, …) is waited out with the Redis backoff, the message unacked, whatever
    /// happens to the broker or a shutdown (the drain's grace bounds it); `None` only once
    /// Redis is cut off (see [`crate::links`]), the record unwritten.
    async fn record_completion(
        &self,
        grant: &Grant,
        answered_us: i64,
        answer: Ended<'_>,
    ) -> Option<Recorded> {
        let what = "registered, but the completion record is not written yet";
        let finished = until_done(what, Interruptions::none(), || async move {
            let finished = self.limiter.finish(grant, answered_us, answer).await;
            counting_redis_errors(finished)
        });
        let finished = tokio::select! {
            finished = finished => finished,
            _ = self.links.redis_cut_off() => None,
        };
        if finished.is_none() {
            warn!(
                "registered, but Redis is cut off: the result goes out now, the message is acked, and its completion record is written once Redis answers"
            );
        }
        finished.map(|f| f.recorded.unwrap_or_default())
    }

    /// Writes, in the background, the completion record of a registration answered while
    /// Redis was cut off, once Redis answers (retrying); then publishes its batch's completion
    /// event if that completed it. `unpublished`: its result, when it could not be published
    /// (the message went back to the broker): the record keeps it for the copy's replica to
    /// publish; else the record is trimmed to `registered` (a write abandoned at the cut may
    /// have kept the result). Tracked in [`Self::records_later`]: the replica's drain waits for
    /// it within its grace; a replica stopped before leaves it unwritten, and a copy of the
    /// message published again by its producer would be called again (the same
    /// Idempotency-Key).
    fn record_later(
        &self,
        grant: Grant,
        answered_us: i64,
        registration: &Registration,
        told: Option<RateLimitHeaders>,
        reporting: &Reporting,
        unpublished: Option<String>,
    ) {
        let (limiter, progress) = (self.limiter.clone(), self.progress.clone());
        let results = reporting.results.clone();
        let links = self.links.clone();
        let seller = registration.seller_id.clone();
        let message = registration.message_id.clone();
        let batch = registration.batch_id.clone();
        let size = registration.batch_size;
        let ttl = self.settings.done_ttl;
        let later = async move {
            let in_batch = batch.as_ref().map(|id| InBatch { id, size });
            let answer = Ended::Registered {
                told,
                batch: in_batch,
                ttl,
                result: unpublished.as_deref(),
            };
            // Logged once: Redis is known to be cut off, its return is logged by the replica.
            let mut backoff = plan::redis_backoff();
            let recorded = loop {
                links.redis_back().await;
                match counting_redis_errors(limiter.finish(&grant, answered_us, answer).await) {
                    Ok(finished) => break finished.recorded,
                    Err(error) => {
                        debug!(%error, "a completion record kept while Redis was cut off is not written yet")
                    }
                }
                tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(5))).await;
            };
            if unpublished.is_none() {
                progress.result_published(&seller, &message);
            }
            if let (Some(event), Some(batch)) = (recorded.and_then(|r| r.event), &batch) {
                let none = Interruptions::none();
                let sent = publish_event(&*progress, &*results, &seller, batch, event, none);
                let _ = tokio::time::timeout(Duration::from_secs(30), sent).await;
            }
            info!("the completion record kept while Redis was cut off is written");
        };
        self.records_later.spawn(later.in_current_span());
    }

    /// Says that a registration's result was published: its record no longer keeps it (see
    /// [`Progress::result_published`], which nobody waits for).
    fn result_sent(&self, seller: &SellerId, message: &MessageId) {
        self.progress.result_published(seller, message);
    }

    /// A message's result (see [`report::Final`]), as published.
    fn result_body(
        &self,
        reporting: &Reporting,
        outcome: &str,
        detail: Option<&str>,
        report: &Report,
    ) -> Vec<u8> {
        report::Final {
            identity: &reporting.identity,
            outcome,
            detail,
            report,
            first_seen_ms: reporting.first_seen_ms,
            finished_ms: crate::domain::unix_ms(),
        }
        .body()
    }

    /// Publishes a message's result (see [`report::Final`]) to the results exchange and its
    /// `reply_to`, retrying until the broker confirms; `false` when interrupted first.
    async fn publish_result(
        &self,
        reporting: &Reporting,
        outcome: &str,
        detail: Option<&str>,
        report: &Report,
        interruptions: Interruptions<'_>,
    ) -> bool {
        let body = self.result_body(reporting, outcome, detail, report);
        self.publish_body(reporting, outcome, &body, interruptions)
            .await
    }

    /// Publishes a result's `body` (see [`Self::publish_result`]); `false` when interrupted
    /// first.
    async fn publish_body(
        &self,
        reporting: &Reporting,
        outcome: &str,
        body: &[u8],
        interruptions: Interruptions<'_>,
    ) -> bool {
        let message_id = reporting.identity.message_id.as_ref().map(|m| m.as_str());
        let what = "the message's result was not published";
        let sent = until_done(what, interruptions, || async move {
            let sent = reporting
                .results
                .publish_result(outcome, message_id, body, &reporting.reply)
                .await;
            if sent.is_err() {
                metrics::counter!("turnstile_broker_errors_total").increment(1);
            }
            sent
        })
        .await;
        if sent.is_some() {
            metrics::counter!("turnstile_results_published_total").increment(1);
            crate::broker::BrokerCost::count(&self.stats.broker.results);
        }
        sent.is_some()
    }

    /// Publishes the completion `event` of the message's batch, if there is one; `false` when
    /// interrupted first.
    async fn publish_pending(
        &self,
        reporting: &Reporting,
        event: Option<BatchEvent>,
        interruptions: Interruptions<'_>,
    ) -> bool {
        let (Some(event), Some((seller, _, batch))) = (event, reporting.batch()) else {
            return true;
        };
        publish_event(
            &*self.progress,
            &*reporting.results,
            seller,
            batch.id,
            event,
            interruptions,
        )
        .await
    }

    /// Before a dead letter is acked: its result, then (for a message of a batch) its record,
    /// which counts it in its batch, and the batch's completion event if that completed it;
    /// `false` when interrupted first (the message is returned: its dead letter may then be
    /// published twice, never lost). A message without a batch is counted in the background
    /// (see [`count_dead_letter`]).
    async fn report_dead(
        &self,
        reason: &'static str,
        detail: &str,
        report: &Report,
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> bool {
        if !self
            .publish_result(reporting, reason, Some(detail), report, interruptions)
            .await
        {
            return false;
        }
        let Some((seller, message, batch)) = reporting.batch() else {
            count_dead_letter(
                &self.progress,
                &reporting.results,
                &reporting.identity,
                reason,
                self.settings.done_ttl,
            );
            return true;
        };
        let what = "dead-lettered, but not counted in its batch yet";
        let recorded = until_done(what, interruptions, || async move {
            let recorded = self
                .progress
                .dead_in_batch(seller, message, batch, reason, self.settings.done_ttl)
                .await;
            counting_redis_errors(recorded)
        })
        .await;
        match recorded {
            Some(recorded) => {
                self.publish_pending(reporting, recorded.event, interruptions)
                    .await
            }
            None => false,
        }
    }

    /// Before a message registered before is acked: its result, if its record still keeps it
    /// (the replica that registered it lost the broker, or died, before publishing it), then
    /// the completion event of its batch, if one is pending; `false` when interrupted first.
    async fn report_already_done(
        &self,
        reporting: &Reporting,
        interruptions: Interruptions<'_>,
    ) -> bool {
        let ids = &reporting.identity;
        if let (Some(seller), Some(message)) = (&ids.seller_id, &ids.message_id) {
            let what = "could not read whether the message's result is still to publish";
            let pending = until_done(what, interruptions, || {
                self.progress.pending_result(seller, message)
            })
            .await;
            let Some(pending) = pending else {
                return false;
            };
            if let Some(result) = pending {
                if !self
                    .publish_body(reporting, "registered", result.as_bytes(), interruptions)
                    .await
                {
                    return false;
                }
                info!("a copy of a registered message published the result its record kept");
                self.result_sent(seller, message);
            }
        }
        let Some((seller, _, batch)) = reporting.batch() else {
            return true;
        };
        let what = "could not read whether the batch's completion event is pending";
        let pending = until_done(what, interruptions, || {
            self.progress.pending_event(seller, batch.id)
        })
        .await;
        match pending {
            Some(event) => self.publish_pending(reporting, event, interruptions).await,
            None => false,
        }
    }

    /// Applies an outcome: the one place that acks, nacks, delays or dead-letters (a dead
    /// letter carries `started_trace`, see [`Carried::started_trace`]). A dead letter's result
    /// is published before the ack (a registration's was, before its record).
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        delivery: Delivery,
        outcome: Outcome,
        started_trace: Option<&TraceContext>,
        publisher: &Publisher,
        reporting: &Reporting,
        settler: &Settler,
        interruptions: Interruptions<'_>,
    ) {
        let connection_lost = interruptions.connection_lost;
        let tag = delivery.delivery_tag;
        let delayed_at = std::time::Instant::now();
        let published = self
            .republish(&delivery, &outcome, started_trace, reporting, publisher)
            .await;
        let delivered = || Carried::reservation_of(&delivery);
        if let Some(left) = stranded(delivered, &outcome, published.is_ok()) {
            self.give_back(&delivery, left);
        }
        let reported = match (&published, &outcome) {
            (
                Ok(()),
                Outcome::DeadLetter {
                    reason,
                    detail,
                    report,
                },
            ) => {
                self.report_dead(reason, detail, report, reporting, interruptions)
                    .await
            }
            (Ok(()), Outcome::AlreadyDone) => {
                self.report_already_done(reporting, interruptions).await
            }
            _ => true,
        };
        if !reported {
            self.stats.requeued.fetch_add(1, Ordering::Relaxed);
            if let Err(error) = settler.requeue(tag).await {
                debug!(%error, "could not return the delivery (its channel is gone; the broker redelivers it)");
            }
            return;
        }
        let result = match published {
            Ok(()) => {
                self.count(&delivery, &outcome);
                if let Some(backoff) = outcome.retry_backoff(Carried::attempt_of(&delivery)) {
                    self.note_retry(reporting, backoff, delayed_at);
                }
                match outcome {
                    Outcome::Registered(_) | Outcome::AlreadyDone => {
                        settler.ack(tag);
                        Ok(())
                    }
                    Outcome::Requeue { .. } => settler.requeue(tag).await,
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

    /// Notes a message of a batch delayed for a retry as waiting out its `backoff`, counted from
    /// `delayed_at` (when its delayed copy was published), for its batch's ETA (see
    /// [`Progress::retry_due`]), in the background: it never delays the ack, and a failure only
    /// costs the ETA this retry. A message without a batch is not noted: no ETA counts it.
    fn note_retry(&self, reporting: &Reporting, backoff: Duration, delayed_at: std::time::Instant) {
        let Some((seller, message, batch)) = reporting.batch() else {
            return;
        };
        let progress = self.progress.clone();
        let (seller, message, batch) = (seller.clone(), message.clone(), batch.id.clone());
        let cost = reporting.cost;
        let note = async move {
            let left = backoff.saturating_sub(delayed_at.elapsed());
            let noted = progress
                .retry_due(&seller, &message, &batch, cost, left)
                .await;
            if let Err(error) = noted {
                metrics::counter!("turnstile_redis_errors_total").increment(1);
                debug!(%error, "the retry was not noted for its batch's ETA");
            }
        };
        tokio::spawn(note.in_current_span());
    }

    /// Gives back `reservation`, which the message's copy at the broker does not carry (see
    /// [`stranded`]), in the background: a failure only leaves it until it is pruned as stale,
    /// which gives it back too.
    fn give_back(&self, delivery: &Delivery, reservation: Reservation) {
        let Ok(mut registration) = crate::broker::registration_of(delivery) else {
            return;
        };
        if self.routes.resolve(&mut registration).is_err() {
            return;
        }
        let route = self.route_of(&registration).cloned();
        self.unreserve_later(
            registration.seller_id,
            reservation,
            registration.cost,
            route,
        );
    }

    /// The route `registration`'s call takes (resolved when it was parsed, see
    /// [`Routes::resolve`]).
    fn route_of(&self, registration: &Registration) -> Option<&Arc<Route>> {
        registration
            .route
            .as_ref()
            .and_then(|name| self.routes.get(name))
    }

    /// Gives back a slot reserved for a message of `cost` units in the background: a failure
    /// only leaves it until it is pruned as stale, which gives it back too.
    fn unreserve_later(
        &self,
        seller: SellerId,
        reservation: Reservation,
        cost: crate::domain::Cost,
        route: Option<Arc<Route>>,
    ) {
        let limiter = self.limiter.clone();
        let give_back = async move {
            match limiter
                .unreserve(&seller, &reservation, cost, route.as_ref())
                .await
            {
                Ok(given_back) => debug!(given_back, "a reserved slot the message left behind"),
                Err(error) => {
                    debug!(%error, "a reserved slot the message left behind was not given back; it is when pruned as stale")
                }
            }
        };
        tokio::spawn(give_back.in_current_span());
    }

    /// Publishes what an outcome sends on: the delayed copy, or the dead letter.
    async fn republish(
        &self,
        delivery: &Delivery,
        outcome: &Outcome,
        started_trace: Option<&TraceContext>,
        reporting: &Reporting,
        publisher: &Publisher,
    ) -> Result<(), PublishError> {
        match outcome {
            Outcome::Registered(_) | Outcome::AlreadyDone | Outcome::Requeue { .. } => Ok(()),
            Outcome::Delay { after, carried } => {
                publisher
                    .delay(&self.topology, delivery, *after, &carried.headers())
                    .await
            }
            Outcome::DeadLetter {
                reason,
                detail,
                report,
            } => {
                // A superseded row is the seller's own correction at work, not a fault.
                if *reason == plan::SUPERSEDED {
                    info!(reason, detail, "dead-lettering");
                } else {
                    warn!(reason, detail, "dead-lettering");
                }
                let mut extra = carried::started_trace_headers(started_trace);
                extra.push(carried::first_seen_header(reporting.first_seen_ms));
                extra.push((
                    crate::broker::headers::ATTEMPTS,
                    AMQPValue::LongLongInt(i64::from(report.attempts)),
                ));
                if let Some(by) = &report.superseded_by {
                    extra.push((
                        crate::broker::headers::SUPERSEDED_BY,
                        AMQPValue::LongString(by.as_str().into()),
                    ));
                }
                publisher
                    .dead_letter(&self.topology, delivery, reason, detail, &extra)
                    .await
            }
        }
    }

    /// Counts a settled outcome in the stats and the metrics.
    fn count(&self, delivery: &Delivery, outcome: &Outcome) {
        let counter = match outcome {
            Outcome::Registered(_) => &self.stats.registered,
            Outcome::AlreadyDone => &self.stats.already_done,
            Outcome::Delay { .. } => &self.stats.delayed,
            Outcome::DeadLetter { .. } => &self.stats.dead_lettered,
            Outcome::Requeue { .. } => &self.stats.requeued,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let label = outcome.label(Carried::attempt_of(delivery));
        metrics::counter!("turnstile_outcomes_total", "outcome" => label).increment(1);
        if let Outcome::DeadLetter { reason, .. } = outcome {
            metrics::counter!("turnstile_dead_letters_total", "reason" => *reason).increment(1);
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
    use std::sync::atomic::AtomicBool;

    use super::*;

    fn registration(id: &str) -> Registration {
        let body = format!(r#"{{"message_id":"{id}","seller_id":"S-1","product":{{}}}}"#);
        Registration::parse(body.as_bytes(), None).expect("a registration")
    }

    #[tokio::test]
    async fn a_copy_waits_while_its_message_record_is_written_here_and_no_longer() {
        let records = Arc::new(RecordsInWriting::default());
        let first = registration("m-1");
        let writing = records
            .claim(&first, std::time::Instant::now())
            .expect("nothing claimed it yet");
        // Another message does not wait.
        records.wait_for(&registration("m-2")).await;
        let done = Arc::new(AtomicBool::new(false));
        let copy = tokio::spawn({
            let (records, done) = (records.clone(), done.clone());
            async move {
                records.wait_for(&registration("m-1")).await;
                done.store(true, Ordering::SeqCst);
            }
        });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(
            !done.load(Ordering::SeqCst),
            "the copy waits for the record"
        );
        let asked = std::time::Instant::now();
        assert!(
            records.claim(&registration("m-1"), asked).is_none(),
            "a copy cannot be called while the first is"
        );
        writing.recorded();
        copy.await.unwrap();
        assert!(done.load(Ordering::SeqCst));
        assert!(records.lock().is_empty(), "nothing is kept once written");
        assert!(
            records.claim(&registration("m-1"), asked).is_none(),
            "a grant asked for before the record is not called"
        );
        assert!(
            records
                .claim(&registration("m-1"), std::time::Instant::now())
                .is_some(),
            "one asked for after it is (the limiter saw the record)"
        );
    }

    #[test]
    fn a_recent_note_is_kept_for_its_span_and_forgotten_after_whatever_the_rate() {
        let start = std::time::Instant::now();
        let kept = Recent::<u32>::KEPT;
        let mut recent = Recent::default();
        recent.note(1, start);
        recent.note(2, start + kept / 2);
        assert_eq!(recent.noted(&1), Some(start));
        recent.note(3, start + kept + Duration::from_millis(1));
        assert_eq!(recent.noted(&1), None, "older than its span: forgotten");
        assert_eq!(recent.noted(&2), Some(start + kept / 2), "within it: kept");
        // Noted again: the first note's turn to go must not take the second with it.
        let again = start + kept + Duration::from_millis(2);
        recent.note(2, again);
        recent.note(4, start + kept / 2 + kept + Duration::from_millis(1));
        assert_eq!(recent.noted(&2), Some(again));
        for i in 0..10_000u32 {
            recent.note(
                100 + i,
                again + kept * 3 + Duration::from_micros(u64::from(i)),
            );
        }
        assert_eq!(recent.noted(&2), None);
        assert_eq!(recent.at.len(), 10_000, "only the notes within the span");
        assert_eq!(recent.order.len(), 10_000);
    }
}
