//! The consume path's seam to Redis: what a worker asks of the limiter ([`Limiter`]) and of the
//! uploads' records ([`Progress`]), as two traits that [`PermitStore`] implements and a test
//! can fake.
//!
//! A message asks once before its call ([`Limiter::ask`]) and, when granted, hands the answer
//! back once after it ([`Limiter::finish`], after [`Limiter::answered`] ends the call's lease the
//! moment the answer came). Everything after the call is the limiter's: the call's end in the
//! seller's calls or its completion record, what adaptive limits learn from the answer, the
//! permit pools' bookkeeping and the batching of these writes with other Redis calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use tracing::{debug, info, warn};

use crate::domain::{BatchId, BatchSize, Cost, Identity, MessageId, RateLimitHeaders, SellerId};
use crate::permit::batch::{Operation, When};
use crate::permit::decision::{Asking, Decision, Forfeit, Rank, Reservation};
use crate::permit::error::PermitError;
use crate::permit::outcome::{BatchEvent, CallAnswer, Completion, InBatch, Lesson, Recorded};
use crate::permit::records::{BatchSeen, Orphan, UploadProgress};
use crate::permit::store::PermitStore;
use crate::permit::supersession::{ProductMessage, SupersedeStep, Supersession};
use crate::routes::Route;

/// A request for a permit: the one way into the limiter (see [`Limiter::ask`]). Built with
/// [`Ask::new`] for a seller and one unit, reserving; the rest is said where it applies.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub seller: &'a SellerId,
    /// The message asking, if any: one already registered (its completion record says so) is
    /// answered [`Decision::AlreadyDone`] and takes nothing.
    pub message: Option<&'a MessageId>,
    /// Units of every limit the call takes: its message's cost (a charge learned from the
    /// downstream's answers may raise what it asks, see [`Asked::cost`]).
    pub cost: Cost,
    /// The slot the message reserved when it last asked, if it holds one.
    pub held: Option<&'a Reservation>,
    /// Its place among its seller's waiting messages (see [`Rank`]); `None`: unranked, the
    /// last of its priority.
    pub rank: Option<Rank>,
    /// The route its call takes, if any: its units are taken of the route's stack too.
    pub route: Option<&'a Arc<Route>>,
    /// Whether a caller that must wait holds the slot it is told to come back at (the
    /// consumer's case, see [`Reservation`]); without, it asks anew then.
    pub reserve: bool,
}

impl<'a> Ask<'a> {
    /// One unit for `seller`, reserving a slot if it must wait.
    pub fn new(seller: &'a SellerId) -> Self {
        Self {
            seller,
            message: None,
            cost: Cost::ONE,
            held: None,
            rank: None,
            route: None,
            reserve: true,
        }
    }

    /// For `message` (see [`Ask::message`]).
    pub fn message(self, message: &'a MessageId) -> Self {
        Self {
            message: Some(message),
            ..self
        }
    }

    /// For a call of `cost` units.
    pub fn cost(self, cost: Cost) -> Self {
        Self { cost, ..self }
    }

    /// Coming back with the slot `held`, if any.
    pub fn held(self, held: Option<&'a Reservation>) -> Self {
        Self { held, ..self }
    }

    /// Ranked `rank` among its seller's waiting messages.
    pub fn rank(self, rank: Rank) -> Self {
        Self {
            rank: Some(rank),
            ..self
        }
    }

    /// On `route`, if any.
    pub fn route(self, route: Option<&'a Arc<Route>>) -> Self {
        Self { route, ..self }
    }

    /// Without holding a slot if it must wait: it asks anew when told to come back.
    pub fn without_reserving(self) -> Self {
        Self {
            reserve: false,
            ..self
        }
    }
}

/// The limiter's answer to an [`Ask`]: the decision, and whether a reserved slot the message
/// came back with was forfeited (and a new one reserved in the same step).
#[derive(Debug)]
pub struct Asked {
    pub decision: Decision,
    pub forfeit: Option<Forfeit>,
    /// The units the decision is for: the message's cost, or the charge learned from its
    /// endpoint's answers when higher (see `PermitStore::cost_to_ask`), or the units its held
    /// slot was reserved for.
    pub cost: Cost,
}

/// A granted call, from its grant until the limiter is told how it ended ([`Limiter::finish`]
/// or [`Limiter::unsent`]).
#[derive(Debug)]
pub struct Grant {
    seller: SellerId,
    /// The message it is for, if any (without, a registration keeps no completion record).
    message: Option<MessageId>,
    /// The units its message asked for.
    requested: Cost,
    /// The units it was granted for (`requested`, or a charge learned since).
    cost: Cost,
    call: String,
    granted_us: i64,
    slot_us: i64,
    sent: Instant,
    /// The route the call takes, if any.
    route: Option<Arc<Route>>,
    /// Whether what the answer's headers told was learned already (a completion record that
    /// failed is written again, its lesson not taught twice).
    taught: AtomicBool,
    /// Whether it rides in another grant's bulk call ([`Grant::riding`]): it holds no units.
    rides: bool,
}

impl Grant {
    /// The grant `decision` gives the message that asked with `ask`, if it is one, of `cost`
    /// units (see [`Asked::cost`]).
    pub fn of(ask: Ask<'_>, decision: &Decision, cost: Cost) -> Option<Self> {
        let Decision::Granted {
            slot_us,
            granted_us,
            call,
            sent,
            ..
        } = decision
        else {
            return None;
        };
        Some(Self {
            seller: ask.seller.clone(),
            message: ask.message.cloned(),
            requested: ask.cost.min(cost),
            cost,
            call: call.clone(),
            granted_us: *granted_us,
            slot_us: *slot_us,
            sent: *sent,
            route: ask.route.cloned(),
            taught: AtomicBool::new(false),
            rides: false,
        })
    }

    /// The grant of `message` (of `cost` units) riding in `lead`'s bulk call, on a route whose
    /// calls count once however many rows they carry (see [`crate::routes::BulkCost::Call`]):
    /// it takes no units and has no call of its own (`lead`'s answer ends that), and its
    /// registration's record is written without a call's end. Its call must start when
    /// `lead`'s does.
    /// Without `message`, a template that rows ride with by naming themselves (see
    /// [`Grant::riding`] of it).
    pub fn riding(lead: &Grant, message: Option<&MessageId>, cost: Cost) -> Self {
        Self {
            seller: lead.seller.clone(),
            message: message.cloned(),
            requested: cost,
            cost,
            call: lead.call.clone(),
            granted_us: lead.granted_us,
            slot_us: lead.slot_us,
            sent: lead.sent,
            route: lead.route.clone(),
            taught: AtomicBool::new(true),
            rides: true,
        }
    }

    /// Whether it rides in another grant's bulk call ([`Grant::riding`]).
    pub fn rides(&self) -> bool {
        self.rides
    }

    /// The units the call was granted for.
    pub fn cost(&self) -> Cost {
        self.cost
    }

    /// The route the call takes, if any.
    pub fn route(&self) -> Option<&Arc<Route>> {
        self.route.as_ref()
    }

    /// The call's name in the seller's calls.
    pub fn call(&self) -> &str {
        &self.call
    }

    /// When the request that made the grant left this replica: the call is sent within
    /// [`super::CALL_ALLOWANCE`] of it, or dropped ([`Limiter::unsent`]).
    pub fn sent(&self) -> Instant {
        self.sent
    }

    /// An upper bound, in Redis time, for now (when the call's answer came): Redis granted at
    /// `granted_us`, after the request was sent, so no more than the time since then has passed
    /// on Redis's clock since the grant.
    pub fn answered_us(&self) -> i64 {
        let since = self.sent.elapsed().as_micros().min(i64::MAX as u128) as i64;
        self.granted_us.saturating_add(since)
    }
}

/// How long a call's claim outlasts the call's own bound (see [`Limiter::note_call`]): time
/// for its record to be written.
pub const CLAIM_MARGIN: Duration = Duration::from_secs(5);

/// How long a claim taken with a permit question holds before its call starts (see
/// [`Limiter::claim_call`]): a granted call starts within [`super::CALL_ALLOWANCE`] of its request
/// leaving, or is given back; a question that leads to no call leaves a claim that soon ends.
pub const CLAIM_ASKING: Duration = Duration::from_secs(4);

/// Whether a message may be called by this delivery ([`Limiter::claim_call`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallClaim {
    /// This question took the claim (it holds [`CLAIM_ASKING`] from then).
    Taken,
    /// The claim is this delivery's, taken by an earlier question of it: asking again does not
    /// renew it ([`Limiter::renew_claim`] does).
    Held,
    /// Another copy of the message holds the claim: it asked at the same moment (a producer's
    /// duplicate), or it is being called (its replica lost the delivery with the call in
    /// flight, and the broker handed this copy over). Asked again within a second, a copy finds
    /// that call recorded (the message registered) or the claim ended.
    Elsewhere,
}

/// How a granted call ended, as the limiter needs to know it.
#[derive(Clone, Copy, Debug)]
pub enum Ended<'a> {
    /// A 2xx: the message is registered (counted in `batch`, if it is in one; its record kept
    /// `ttl`), and the answer's rate-limit headers said `told`. Its `result` (JSON), when
    /// given, is kept in the record until [`Progress::result_published`]: whichever replica
    /// gets the message next (a redelivery) publishes it if it is still there.
    Registered {
        told: Option<RateLimitHeaders>,
        batch: Option<InBatch<'a>>,
        ttl: Duration,
        result: Option<&'a str>,
    },
    /// A 429, with what its rate-limit headers said.
    Throttled { told: Option<RateLimitHeaders> },
    /// Any other answer, a timeout or a connection error.
    Failed,
}

/// What the limiter did with a call's answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Finished {
    /// The registration's record, for [`Ended::Registered`].
    pub recorded: Option<Recorded>,
    /// Whether a 429 lowered the seller's learned limit.
    pub lowered: bool,
}

/// The per-seller limiter as a worker uses it: once before a call, once after it.
pub trait Limiter: Send + Sync {
    /// Asks for a permit (or redeems the slot the message holds), and beyond the seller for a
    /// lease of its calls in flight and the global limit's units: one attempt.
    fn ask<'a>(&'a self, ask: Ask<'a>) -> BoxFuture<'a, Result<Asked, PermitError>>;

    /// The call's answer came (or it timed out): its lease of the seller's calls in flight ends
    /// now, and its units in the global limit hold their place only until now. A failure leaves
    /// either to the call's bound.
    fn answered<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, ()>;

    /// Hands the call's answer (which came at `answered_us`, see [`Grant::answered_us`]) back:
    /// a registration's completion record with the call's end (an error only if that record is
    /// not written: call again until it is), any other answer's end (a failure only keeps the
    /// call's place until its bound), and what adaptive limits learn from it.
    fn finish<'a>(
        &'a self,
        grant: &'a Grant,
        answered_us: i64,
        answer: Ended<'a>,
    ) -> BoxFuture<'a, Result<Finished, PermitError>>;

    /// Claims `message`'s call for one delivery of it (`token`, unique to the delivery), on
    /// every replica: sent beside the delivery's permit question, in the same round trip, so
    /// that of two copies asking at once only one may call. The claim holds
    /// [`CLAIM_ASKING`] (a question leads to its call within [`super::CALL_ALLOWANCE`]), for the
    /// whole call once it starts ([`Self::note_call`]); a delivery that asks again finds its
    /// own claim [`CallClaim::Held`].
    fn claim_call<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        token: &'a str,
    ) -> BoxFuture<'a, Result<CallClaim, PermitError>>;

    /// One step of a message that names its product, holding the reservation `held` (see
    /// [`super::Supersession`]): whether it is still its product's latest message, decided for
    /// every replica at once.
    fn supersede<'a>(
        &'a self,
        message: &'a ProductMessage<'a>,
        step: SupersedeStep<'a>,
        held: Option<&'a Reservation>,
    ) -> BoxFuture<'a, Result<Supersession, PermitError>>;

    /// `grant`'s call starts: its message's claim ([`Self::claim_call`]) holds until the call's
    /// bound plus [`CLAIM_MARGIN`] and the record's delay, riding along with the next calls to
    /// Redis (nobody waits for it).
    fn note_call(&self, grant: &Grant);

    /// Renews a delivery's claim of `message`'s call ([`CallClaim::Held`]) for another
    /// [`CLAIM_ASKING`], riding along with the next calls to Redis. Only for a claim known to
    /// hold long enough for the renewal to reach Redis first: it renews whichever claim is there.
    fn renew_claim(&self, seller: &SellerId, message: &MessageId);

    /// Ends a delivery's claim of `message`'s call that led to no call (the delivery waits
    /// elsewhere, is settled, or goes back to the broker), riding along with the next calls to
    /// Redis, so that another copy may be called at once; a failure leaves it to its expiry.
    fn unclaim_call(&self, seller: &SellerId, message: &MessageId);

    /// Drops a grant unsent: its lease ends and its units are given back, so that the seller's
    /// next call may take them; a failure leaves them counted until they leave the window.
    fn unsent(&self, grant: Grant) -> BoxFuture<'_, ()>;

    /// Pauses the seller on every replica for `pause` (a 429).
    fn pause<'a>(
        &'a self,
        seller: &'a SellerId,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>>;

    /// Gives back a slot reserved for a message of `cost` units (on `route`, if any) that will
    /// not come back for it; whether it was still reserved.
    fn unreserve<'a>(
        &'a self,
        seller: &'a SellerId,
        reservation: &'a Reservation,
        cost: Cost,
        route: Option<&'a Arc<Route>>,
    ) -> BoxFuture<'a, Result<bool, PermitError>>;

    /// The downstream reported that `grant`'s call cost `actual` units (`TURNSTILE_COST_HEADER`):
    /// the seller's windows (and its route's) count `actual` instead of what it was granted
    /// for, for every replica, and the charge is learned for the next calls (see
    /// `PermitStore::recost`). A failure leaves the granted cost counted.
    fn recost<'a>(&'a self, grant: &'a Grant, actual: u32) -> BoxFuture<'a, ()>;

    /// Redis's time now as estimated from the limiter's answers; `None` before the first.
    fn now_us(&self) -> Option<i64>;

    /// The default limit's shortest window.
    fn shortest_window(&self) -> Duration;

    /// Whether a reserved slot also waits for the calls that fill its windows to be answered
    /// (sliding-window and gcra: a call holds its place until its answer), so that a message
    /// coming back for it one typical call late finds the window open; with the others a slot
    /// must be redeemed on time.
    fn slots_wait_for_answers(&self) -> bool {
        false
    }

    /// Whether a grant may wait a moment for a worker before its call is sent: only where
    /// every limit holds a call's place until its answer (sliding-window and gcra; the global
    /// limit always does).
    fn grants_may_wait(&self) -> bool {
        false
    }
}

/// The records of the uploads a worker keeps: batches seen, messages dead-lettered, and
/// batches' completion events.
pub trait Progress: Send + Sync {
    /// Notes a batch as seen by this replica (see `lua/batch_seen.lua`), whose rows go
    /// `rows_per_call` to a permit.
    fn batch_seen<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
        size: Option<BatchSize>,
        ttl: Duration,
        rows_per_call: u32,
    ) -> BoxFuture<'a, Result<BatchSeen, PermitError>>;

    /// Records a message of a batch as dead-lettered for `reason`, counted in its batch once.
    fn dead_in_batch<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        batch: InBatch<'a>,
        reason: &'static str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Recorded, PermitError>>;

    /// Counts a dead-lettered message that names no batch, once per message (per dead letter
    /// for a body without an identity); one whose body named a batch and a message id but no
    /// seller is counted in that batch (see [`PermitStore::count_orphan`]). Returns the seller
    /// and completion event of the batch that counting it completed, if it did.
    fn dead<'a>(
        &'a self,
        identity: &'a Identity,
        reason: &'static str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<(SellerId, BatchEvent)>, PermitError>>;

    /// Counts in `seller`'s batch the messages of it dead-lettered without a seller and kept
    /// until now ([`BatchSeen::orphans`]); returns the batch's completion event if that
    /// completed it.
    fn adopt_orphans<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
        orphans: &'a [Orphan],
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<BatchEvent>, PermitError>>;

    /// The completion event of a batch, if one is pending publication.
    fn pending_event<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
    ) -> BoxFuture<'a, Result<Option<BatchEvent>, PermitError>>;

    /// The result of a registered message, if its record still keeps it unpublished (see
    /// [`Ended::Registered`]).
    fn pending_result<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
    ) -> BoxFuture<'a, Result<Option<String>, PermitError>>;

    /// Whether a message's completion record says registered.
    fn is_registered<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
    ) -> BoxFuture<'a, Result<bool, PermitError>>;

    /// Says that a registered message's result was published: its record no longer keeps it.
    /// Nobody waits for it: a trim that fails only leaves the result kept, and a redelivery
    /// of the message would publish it again.
    fn result_published(&self, seller: &SellerId, message: &MessageId);

    /// A batch's progress now (`None`: expired).
    fn batch_progress<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
    ) -> BoxFuture<'a, Result<Option<UploadProgress>, PermitError>>;

    /// Says that a batch's completion `event` was published.
    fn event_sent<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
        event: BatchEvent,
    ) -> BoxFuture<'a, Result<(), PermitError>>;

    /// Notes that a message of a batch waits out a retry's backoff, due `delay` from now: for
    /// the batch's ETA only, never read by a grant (see [`super::Records::retry_due`]).
    fn retry_due<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        batch: &'a BatchId,
        cost: Cost,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>>;
}

impl PermitStore {
    /// Learns `lesson` (see [`PermitStore::learn_at`]); whether a 429 lowered the learned
    /// limit. A failure only costs the lesson.
    async fn teach(&self, seller: &SellerId, lesson: Lesson, answered_us: i64) -> bool {
        match self.learn_at(seller, lesson, Some(answered_us)).await {
            Ok(Some(change)) => {
                info!(counts = %change.counts, why = change.why.label(), "the seller's learned limit changed");
                matches!(lesson, Lesson::Throttled { .. }) && change.lowered
            }
            Ok(None) => false,
            Err(error) => {
                debug!(%error, "could not learn from the downstream's answer");
                false
            }
        }
    }

    /// Records that `grant`'s call, not a registration, was answered at `answered_us`, for the
    /// exact algorithms (the others do not hold calls until their answer).
    async fn end_call(&self, grant: &Grant, answered_us: i64) {
        if !self.algorithm().is_exact() {
            return;
        }
        let ended = self
            .call_ended(&grant.seller, &grant.call, grant.cost, Some(answered_us))
            .await;
        if let Err(error) = ended {
            debug!(%error, "the call's answer was not recorded; its place is kept until its bound");
        }
    }

    /// How long a call's claim holds once the call starts: the call's bound plus
    /// [`CLAIM_MARGIN`] and the record's delay (long enough for the call to be answered and its
    /// record written; a copy asks again after it at the latest).
    fn call_claim_hold(&self) -> Duration {
        self.call_bound + self.record_delay + CLAIM_MARGIN
    }

    /// The holder of `key`'s claim before `claim` (its `SET … NX`), with `GET` in the same
    /// command where Redis takes it (see [`Self::probe_set_nx_get`]): `None` if this `SET`
    /// took it. `None` (not `Some`) when Redis does not take it: it stops being tried (a
    /// failover to a Redis before 7.0).
    async fn claim_in_one(
        &self,
        key: &str,
        claim: &redis::Cmd,
    ) -> Option<Result<Option<String>, PermitError>> {
        if !self.set_nx_get.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let mut claim = claim.clone();
        claim.arg("GET");
        let answered: Result<(Option<String>,), PermitError> = self
            .run(Operation::commands(vec![claim], key.to_owned()), When::Now)
            .await;
        match answered {
            Ok((holder,)) => Some(Ok(holder)),
            Err(PermitError::Redis(error))
                if error.kind()
                    == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) =>
            {
                self.set_nx_get
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                None
            }
            Err(error) => Some(Err(error)),
        }
    }

    /// The holder of `key`'s claim before `claim` (its `SET … NX`, for `token`), by the `SET`
    /// and a `GET` after it: `None` if this `SET` took it. (A `GET` that finds none: deleted
    /// between the two commands, a call ended just then; another's, asked again.)
    async fn claim_in_two(
        &self,
        key: String,
        claim: redis::Cmd,
        token: &str,
    ) -> Result<Option<String>, PermitError> {
        let mut holder = redis::cmd("GET");
        holder.arg(&key);
        let (set, holder): (Option<String>, Option<String>) = self
            .run(Operation::commands(vec![claim, holder], key), When::Now)
            .await?;
        Ok(match set {
            Some(_) if holder.as_deref() == Some(token) => None,
            _ => Some(holder.unwrap_or_default()),
        })
    }

    /// Makes `message`'s claim ([`Limiter::claim_call`]), whichever delivery's it is, hold for
    /// `hold` from when this reaches Redis, riding along with the next calls to Redis.
    fn hold_claim(&self, seller: &SellerId, message: &MessageId, hold: Duration) {
        let key = self.keys.calling(seller, message);
        let mut expire = redis::cmd("PEXPIRE");
        expire.arg(&key).arg(hold.as_millis().max(1) as u64);
        self.send_detached(Operation::commands(vec![expire], key), Duration::ZERO);
    }

    /// Deletes `message`'s claim ([`Limiter::claim_call`]), riding along with the next calls to
    /// Redis; a failure leaves it to its expiry.
    fn delete_claim(&self, seller: &SellerId, message: &MessageId) {
        let key = self.keys.calling(seller, message);
        let mut release = redis::cmd("DEL");
        release.arg(&key);
        self.send_detached(Operation::commands(vec![release], key), self.record_delay);
    }

    /// Ends `grant`'s claim on its message's call ([`Limiter::claim_call`]) once it was
    /// answered without registering it, so that its retry may be called at once on any
    /// replica; riding along with the next calls to Redis, nobody waits for it. A failure
    /// leaves the claim to its expiry. A registration keeps its claim until it expires: its
    /// completion record answers for it from then on.
    fn release_claim(&self, grant: &Grant) {
        if let Some(message) = &grant.message {
            self.delete_claim(&grant.seller, message);
        }
    }

    /// Ends `grant`'s lease; a failure leaves it to its expiry.
    async fn end_grant_lease(&self, grant: &Grant) {
        if let Err(error) = self.end_lease(&grant.seller, &grant.call).await {
            warn!(%error, "could not end the call's lease: it ends at its expiry");
        }
    }

    /// Ends `grant`'s units in the global limit: answered at `answered_us`, or never sent
    /// (`None`). A failure leaves them in their place until the call's bound: budget unused for
    /// a while, never a window over the limit.
    async fn end_grant_globally(&self, grant: &Grant, answered_us: Option<i64>) {
        let ended = self
            .end_globally(&grant.seller, &grant.call, grant.cost, answered_us)
            .await;
        if let Err(error) = ended {
            warn!(%error, "could not end the call in the global limit: its units hold their place until its bound");
        }
    }

    async fn finish_call(
        &self,
        grant: &Grant,
        answered_us: i64,
        answer: Ended<'_>,
    ) -> Result<Finished, PermitError> {
        let seller = &grant.seller;
        match answer {
            Ended::Registered {
                told,
                batch,
                ttl,
                result,
            } => {
                let call = CallAnswer {
                    // A row riding in another's call records no call's end: that call's does.
                    call: if grant.rides { "" } else { &grant.call },
                    cost: grant.cost,
                    answered_us: Some(answered_us),
                    result,
                };
                let lesson = told.filter(|_| !grant.taught.swap(true, Ordering::Relaxed));
                let Some(message) = &grant.message else {
                    // A call for no message keeps no completion record: it ends as any other.
                    self.end_call(grant, answered_us).await;
                    if let Some(told) = lesson {
                        self.teach(seller, Lesson::Told(told), answered_us).await;
                    }
                    return Ok(Finished::default());
                };
                // Both go in the same batch when they can (see `batch`).
                let (recorded, _) = tokio::join!(
                    self.complete_call(seller, message, batch, call, ttl),
                    async {
                        if let Some(told) = lesson {
                            self.teach(seller, Lesson::Told(told), answered_us).await;
                        }
                    }
                );
                let recorded = recorded?;
                if recorded.raise_due && told.is_none() && !grant.rides {
                    self.teach(seller, Lesson::Recovery, answered_us).await;
                }
                Ok(Finished {
                    recorded: Some(recorded),
                    lowered: false,
                })
            }
            Ended::Throttled { .. } | Ended::Failed if grant.rides => {
                self.release_claim(grant);
                Ok(Finished::default())
            }
            Ended::Throttled { told } => {
                let lesson = Lesson::Throttled {
                    granted_us: grant.granted_us,
                    told,
                };
                self.release_claim(grant);
                // The call's end rides in the lesson's call, which goes at once.
                let (_, lowered) = tokio::join!(
                    self.end_call(grant, answered_us),
                    self.teach(seller, lesson, answered_us)
                );
                Ok(Finished {
                    recorded: None,
                    lowered,
                })
            }
            Ended::Failed => {
                self.release_claim(grant);
                self.end_call(grant, answered_us).await;
                Ok(Finished::default())
            }
        }
    }
}

impl Limiter for PermitStore {
    fn ask<'a>(&'a self, ask: Ask<'a>) -> BoxFuture<'a, Result<Asked, PermitError>> {
        async move {
            // The fleet's terms unconfirmed, or a new algorithm's fence (see `applied`).
            if let Some(retry_after) = self.applied().check(self.redis_now_us())? {
                return Ok(Asked {
                    decision: Decision::Wait {
                        retry_after,
                        reservation: ask.held.cloned(),
                    },
                    forfeit: None,
                    cost: ask.held.and_then(|held| held.cost).unwrap_or(ask.cost),
                });
            }
            let route = ask.route.map(|route| &**route);
            let asking = Asking {
                requested: ask.cost,
                cost: self.cost_to_ask(ask.seller, ask.cost, route).await?,
            };
            let (mut decision, forfeit, mut cost) = self.decide(&ask, asking).await?;
            // The seller's own stack (an override) may hold less than the charge: asked again
            // at its smallest COUNT, never below the message's cost.
            if let Decision::TooCostly { most, .. } = decision
                && asking.cost != asking.requested
                && let Some(most) = Cost::new(most).filter(|most| *most >= asking.requested)
            {
                // Only an acquire answers so: a slot held was redeemed or forfeited before.
                let asking = Asking {
                    cost: most,
                    ..asking
                };
                let again = Ask { held: None, ..ask };
                (decision, _, cost) = self.decide(&again, asking).await?;
            }
            // Too costly is the message's own cost's doing, and said so.
            if let Decision::TooCostly { cost: too, .. } = &mut decision {
                *too = asking.requested;
            }
            Ok(Asked {
                decision,
                forfeit,
                cost,
            })
        }
        .boxed()
    }

    fn answered<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, ()> {
        async move {
            if grant.rides {
                return;
            }
            let answered_us = grant.answered_us();
            tokio::join!(
                self.end_grant_lease(grant),
                self.end_grant_globally(grant, Some(answered_us))
            );
        }
        .boxed()
    }

    fn finish<'a>(
        &'a self,
        grant: &'a Grant,
        answered_us: i64,
        answer: Ended<'a>,
    ) -> BoxFuture<'a, Result<Finished, PermitError>> {
        self.finish_call(grant, answered_us, answer).boxed()
    }

    fn claim_call<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        token: &'a str,
    ) -> BoxFuture<'a, Result<CallClaim, PermitError>> {
        async move {
            let key = self.keys.calling(seller, message);
            let mut claim = redis::cmd("SET");
            claim
                .arg(&key)
                .arg(token)
                .arg("NX")
                .arg("PX")
                .arg(CLAIM_ASKING.as_millis() as u64);
            let holder = match self.claim_in_one(&key, &claim).await {
                Some(holder) => holder?,
                None => self.claim_in_two(key, claim, token).await?,
            };
            Ok(match holder {
                None => CallClaim::Taken,
                Some(holder) if holder == token => CallClaim::Held,
                Some(_) => CallClaim::Elsewhere,
            })
        }
        .boxed()
    }

    fn supersede<'a>(
        &'a self,
        message: &'a ProductMessage<'a>,
        step: SupersedeStep<'a>,
        held: Option<&'a Reservation>,
    ) -> BoxFuture<'a, Result<Supersession, PermitError>> {
        PermitStore::supersede(self, message, step, held).boxed()
    }

    fn note_call(&self, grant: &Grant) {
        if let Some(message) = &grant.message {
            self.hold_claim(&grant.seller, message, self.call_claim_hold());
        }
    }

    fn renew_claim(&self, seller: &SellerId, message: &MessageId) {
        self.hold_claim(seller, message, CLAIM_ASKING);
    }

    fn unclaim_call(&self, seller: &SellerId, message: &MessageId) {
        self.delete_claim(seller, message);
    }

    fn unsent(&self, grant: Grant) -> BoxFuture<'_, ()> {
        async move {
            if grant.rides {
                return;
            }
            tokio::join!(
                self.end_grant_lease(&grant),
                self.end_grant_globally(&grant, None)
            );
            let released = self
                .release(
                    &grant.seller,
                    &grant.call,
                    grant.cost,
                    grant.slot_us,
                    grant.route.as_deref(),
                )
                .await;
            if let Err(error) = released {
                debug!(%error, "a grant dropped unsent was not given back; its units count until they leave the window");
            }
        }
        .boxed()
    }

    fn pause<'a>(
        &'a self,
        seller: &'a SellerId,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        async move { PermitStore::pause(self, seller, pause).await.map(|_| ()) }.boxed()
    }

    fn unreserve<'a>(
        &'a self,
        seller: &'a SellerId,
        reservation: &'a Reservation,
        cost: Cost,
        route: Option<&'a Arc<Route>>,
    ) -> BoxFuture<'a, Result<bool, PermitError>> {
        PermitStore::unreserve_on(self, seller, reservation, cost, route.map(|r| &**r)).boxed()
    }

    fn recost<'a>(&'a self, grant: &'a Grant, actual: u32) -> BoxFuture<'a, ()> {
        async move {
            if grant.rides {
                return;
            }
            let recosted = PermitStore::recost(
                self,
                &grant.seller,
                &grant.call,
                grant.requested,
                grant.cost,
                actual,
                grant.slot_us,
                grant.route.as_deref(),
            )
            .await;
            if let Err(error) = recosted {
                warn!(%error, "the call's reported cost was not recorded: its granted cost stays counted");
            }
        }
        .boxed()
    }

    fn now_us(&self) -> Option<i64> {
        self.redis_now_us()
    }

    fn shortest_window(&self) -> Duration {
        self.default_limit().shortest_window()
    }

    fn slots_wait_for_answers(&self) -> bool {
        self.limiter().algorithm.is_exact()
    }

    fn grants_may_wait(&self) -> bool {
        // Without a call bound (a store of the operator's tools), a call holds no place.
        self.limiter().algorithm.is_exact() && self.call_bound_us() > 0
    }
}

impl Progress for PermitStore {
    fn batch_seen<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
        size: Option<BatchSize>,
        ttl: Duration,
        rows_per_call: u32,
    ) -> BoxFuture<'a, Result<BatchSeen, PermitError>> {
        async move {
            self.records()
                .batch_seen_carried(seller, batch, size, ttl, rows_per_call)
                .await
        }
        .boxed()
    }

    fn dead_in_batch<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        batch: InBatch<'a>,
        reason: &'static str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Recorded, PermitError>> {
        self.complete(seller, message, Some(batch), Completion::Dead(reason), ttl)
            .boxed()
    }

    fn dead<'a>(
        &'a self,
        identity: &'a Identity,
        reason: &'static str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<(SellerId, BatchEvent)>, PermitError>> {
        async move {
            if let (None, Some(batch), Some(message)) = (
                &identity.seller_id,
                &identity.batch_id,
                &identity.message_id,
            ) {
                let orphan = Orphan {
                    message: message.clone(),
                    reason: reason.to_owned(),
                };
                let counted = self.count_orphan(batch, &orphan, ttl).await?;
                return Ok(counted.and_then(|(seller, r)| Some((seller, r.event?))));
            }
            self.count_dead(identity, None, reason, ttl).await?;
            Ok(None)
        }
        .boxed()
    }

    fn adopt_orphans<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
        orphans: &'a [Orphan],
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<BatchEvent>, PermitError>> {
        self.adopt_orphans(seller, batch, orphans, ttl).boxed()
    }

    fn pending_event<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
    ) -> BoxFuture<'a, Result<Option<BatchEvent>, PermitError>> {
        async move { self.records().pending_event(seller, batch).await }.boxed()
    }

    fn pending_result<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
    ) -> BoxFuture<'a, Result<Option<String>, PermitError>> {
        async move { self.records().pending_result(seller, message).await }.boxed()
    }

    fn is_registered<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
    ) -> BoxFuture<'a, Result<bool, PermitError>> {
        async move { self.records().is_registered(seller, message).await }.boxed()
    }

    fn result_published(&self, seller: &SellerId, message: &MessageId) {
        PermitStore::result_published(self, seller, message);
    }

    fn batch_progress<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
    ) -> BoxFuture<'a, Result<Option<UploadProgress>, PermitError>> {
        async move { self.records().batch_progress(seller, batch).await }.boxed()
    }

    fn event_sent<'a>(
        &'a self,
        seller: &'a SellerId,
        batch: &'a BatchId,
        event: BatchEvent,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        async move { self.records().batch_event_sent(seller, batch, event).await }.boxed()
    }

    fn retry_due<'a>(
        &'a self,
        seller: &'a SellerId,
        message: &'a MessageId,
        batch: &'a BatchId,
        cost: Cost,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        async move {
            self.records()
                .retry_due(seller, message, batch, cost, delay)
                .await
        }
        .boxed()
    }
}
