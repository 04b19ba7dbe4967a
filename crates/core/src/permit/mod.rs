//! Permits: the shared, atomic per-seller limiter in Redis (Lua), used by every replica.
//!
//! A caller asks for a permit for a seller. It is granted now, or the caller is told when to
//! come back; when reserving is on (the consumer's case) the caller then also *holds* that future
//! slot, so a deep backlog is scheduled one slot after another instead of every waiting caller
//! coming back at the same instant and being denied again. A caller that waits the returned time
//! and comes back with its [`Reservation`] is granted, unless the seller was paused or its limit
//! changed meanwhile, or it came back too late (then it simply reserves again).
//!
//! A seller's grant is then checked against what lies beyond the seller
//! (`PermitStore::beyond_seller`): a lease of its calls in flight
//! (`TURNSTILE_SELLER_CONCURRENCY`, `lua/lease.lua`) and the global limit shared fairly by all
//! sellers (`TURNSTILE_GLOBAL_LIMIT`, `lua/global.lua`, in a Redis slot of its own); if either
//! refuses, the grant is given back (`lua/release.lua`) and the call deferred.
//!
//! The hot operations (acquire, redeem, the completion record, a call's end, a lesson) go to
//! Redis in batches, several in one call when they can (`batch`, `lua/batch.lua`). A grant of a
//! seller far from its limits brings more units into the seller's pool for its next calls by
//! any replica ([`block`]: permit blocks), claimed without a script.
//!
//! [`server`] reads whether the Redis servers may evict keys (a replica refuses such a Redis
//! unless told it may); the scripts themselves detect state lost to an eviction or a flush.
//!
//! Each script's KEYS and ARGV are laid out in one place, by name, in the order its header
//! lists them, and its answer is read there too: one type per script in `calls`.
//!
//! This module owns the Redis keyspace: [`keys`] builds every key, and nothing outside it talks
//! to Redis about turnstile's keys but through [`PermitStore`] (the limiter's hot path, here),
//! [`Admin`] (sellers' terms as operators set and read them, `admin`) and [`Records`] (the
//! uploads' progress, the dead letters by reason and the dashboard's shared state, `records`).

mod admin;
pub mod applied;
mod batch;
pub mod block;
mod calls;
mod conn;
pub mod keys;
mod limiter;
mod records;
mod registry;
pub mod scripts;
pub mod server;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use admin::{
    Admin, Change, GlobalShare, GlobalUsage, LONGEST_PAUSE, Learned, LimitUsage, MAX_SHADOW_COUNT,
    MAX_WEIGHT, PauseSpanError, Quota, Rescheduled, Shadow, Terms, Usage, binding_of, pause_span,
};
pub use applied::Applied;
use batch::{Batcher, Operation, When};
use block::Blocks;
use calls::{
    Acquire, AcquireAnswer, AcquireTail, CallEnded, Complete, CompleteAnswer, CompleteBatch,
    Global, GlobalAnswer, GlobalEnd, Learn, LearnAnswer, Lease, LeaseAnswer, OnRoute, Recost,
    Recosted, Redeem, RedeemAnswer, Release, Unreserve,
};
pub use conn::{RedisClient, RedisConn, round_trips};
pub use keys::Keyspace;
pub use limiter::{Ask, Asked, Ended, Finished, Grant, Limiter, Progress};
pub use records::{BatchSeen, Records, RetryDue, UploadProgress};
use redis::AsyncCommands;
pub use registry::{Registered, Registry, Roll};

use crate::config::{Algorithm, LimiterArgs, Limits, RedisArgs};
use crate::domain::{BatchId, BatchSize, Cost, MessageId, Priority, RateLimitHeaders, SellerId};
use crate::routes::Route;

/// A failed permit decision: the caller cannot know whether it may call, so it must not.
#[derive(Debug, thiserror::Error)]
pub enum PermitError {
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected answer from the {0} script")]
    Answer(&'static str),
    /// A script refused an operation of a batch (see `lua/batch.lua`): its inputs, or a
    /// command inside it failed.
    #[error("Redis refused: {0}")]
    Refused(String),
    /// The fleet's terms could not be confirmed (see [`applied`]): waited out.
    #[error("{0}")]
    Fleet(&'static str),
}

impl PermitError {
    /// Whether asking again later can succeed. Only a script's own refusal (an error it raises
    /// with `ERR turnstile: …`, for inputs it rejects) and an answer of the wrong shape are
    /// final: every other error (Redis unreachable or timing out, and every server error such
    /// as OOM, MISCONF, READONLY, BUSY, LOADING, NOREPLICAS, CLUSTERDOWN, TRYAGAIN, even inside a
    /// batch) says nothing about the request, so the caller waits and asks again.
    pub fn is_transient(&self) -> bool {
        match self {
            PermitError::Redis(error) => !is_final(error),
            PermitError::Refused(why) => !is_own_refusal(why),
            PermitError::Answer(_) => false,
            PermitError::Fleet(_) => true,
        }
    }
}

/// The prefix of every error a script raises itself (see `lua/include/args.lua`).
const OWN_REFUSAL: &str = "ERR turnstile:";

/// Whether an error a batch operation raised is a script's own refusal (not a server error).
fn is_own_refusal(why: &str) -> bool {
    why.starts_with(OWN_REFUSAL)
}

/// Whether a Redis error is final: a script's own refusal, or an answer that does not convert.
fn is_final(error: &redis::RedisError) -> bool {
    let own = error.code() == Some("ERR")
        && error
            .detail()
            .is_some_and(|d| d.starts_with(&OWN_REFUSAL["ERR ".len()..]));
    own || error.kind() == redis::ErrorKind::UnexpectedReturnType
}

/// A message's place among its seller's waiting messages: its priority (0 to 9, higher first),
/// its deadline and when turnstile first saw it. It travels in the token a reservation is made
/// with (`<random>-r<P>-<DEADLINE_MS or 0>-<ARRIVAL_MS>`), so that `lua/include/ranks.lua` can
/// order a seller's reservations without another key. A message with a priority or a deadline
/// takes the first slot reserved for a message of the same cost ranked behind it, and the
/// reservations from there move back one place each: the same slots, held in another order, so
/// no window holds more than before. A message that has waited nine [`AGING`]s is ranked ahead of
/// every message that arrived after it; among the others, ranked behind means a lower effective
/// priority (a message rises one level for every [`AGING`] it has waited since it arrived), then
/// a later deadline (none is latest), then a later arrival.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rank {
    pub priority: Priority,
    pub deadline_ms: Option<u64>,
    pub arrival_ms: u64,
}

/// How long a waiting message waits for each level it rises (see [`Rank`] and `AGING_US` in
/// `lua/include/ranks.lua`): after nine of these, no message that came later passes it.
pub const AGING: Duration = Duration::from_secs(60);

/// Most reservations a message giving way reads, those right before its slot, and most units
/// it moves back (`GIVE_WAY_REACH` in `lua/include/ranks.lua`): a priority message passes at
/// most this many reservations when it reserves, so one acquire's work stays about half a
/// millisecond however deep its seller's backlog.
pub const GIVE_WAY_REACH: u32 = 256;

/// A seller's give-way budget (`GIVE_WAY_STEPS_PER_S` in `lua/include/ranks.lua`): steps a
/// second, a reservation read or a unit moved being one, at most [`GIVE_WAY_STEPS_SAVED`]
/// saved. A message giving way reaches at most half of what is left (each reservation it moves
/// it read first); with nothing left it keeps its slot at the end of the schedule. So one
/// seller's priority flood costs Redis about a millisecond a second, whatever its depth.
pub const GIVE_WAY_STEPS_PER_SECOND: u32 = 1024;

/// Most steps of a seller's give-way budget saved (`GIVE_WAY_STEPS_SAVED` in
/// `lua/include/ranks.lua`): what its priority messages may spend at once, in one batch script.
pub const GIVE_WAY_STEPS_SAVED: u32 = 2048;

impl Rank {
    /// A fresh reservation token, carrying `rank` if given; a call on a route carries none and
    /// ends with `-q` (see `routed` in `lua/include/routes.lua`: it keeps its slot).
    fn token(rank: Option<&Rank>, routed: bool) -> String {
        let random = rand::random::<u64>();
        if routed {
            return format!("{random:x}-q");
        }
        match rank {
            Some(rank) => format!(
                "{random:x}-r{}-{}-{}",
                rank.priority.get(),
                rank.deadline_ms.unwrap_or(0),
                rank.arrival_ms
            ),
            None => format!("{random:x}"),
        }
    }
}

/// A slot held for a seller: call at `slot_us` (Redis time). It is bound to its `token` (and
/// the cost it was reserved for) in the seller's reserved set and is redeemed at most once (see
/// `lua/redeem.lua`); it stays valid only under the stack of limits it was reserved with, and only until the seller's terms change (a
/// limit set or cleared, a pause lifted: see [`Admin::reschedule`]), which gives it back.
/// `reserved_at_us` (Redis time) tells a holder whether a [`Rescheduled`] notice concerns it.
///
/// A reservation travels in a message header, which anyone can write: [`Reservation::decode`]
/// accepts only the exact form, and the script grants only a live entry, so a forged, copied or
/// stale header never lets a call through — the message just acquires anew.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub slot_us: i64,
    pub limits: Limits,
    pub reserved_at_us: i64,
    pub token: String,
    /// The units it was reserved for when they are not its message's cost (a charge learned
    /// from the downstream's answers raised them, see [`PermitStore::cost_to_ask`]); `None`:
    /// its message's cost. It is redeemed and given back at these units.
    pub cost: Option<Cost>,
}

impl Reservation {
    /// `SLOT_US/COUNTS/WINDOWS_US/RESERVED_AT_US/TOKEN`, then `/COST` when it was reserved for
    /// other units than its message's cost (COUNTS and WINDOWS_US comma-separated, one per limit
    /// of the stack): how a reservation travels in a message header.
    pub fn encode(&self) -> String {
        let mut encoded = format!(
            "{}/{}/{}/{}/{}",
            self.slot_us,
            self.limits.counts_arg(),
            self.limits.windows_arg(),
            self.reserved_at_us,
            self.token
        );
        if let Some(cost) = self.cost {
            encoded.push_str(&format!("/{}", cost.units()));
        }
        encoded
    }

    /// The reservation in a header, or `None` for anything but the exact form (non-negative
    /// integers, a well-formed stack, token of 1 to 64 letters, digits or dashes, and a cost, if
    /// any, from 1 to [`Cost::MAX`] written as an integer is).
    pub fn decode(s: &str) -> Option<Self> {
        let mut parts = s.split('/');
        let slot_us = parts.next()?.parse().ok().filter(|s| *s >= 0)?;
        let (counts, windows) = (parts.next()?, parts.next()?);
        let mut r = Self {
            slot_us,
            limits: Limits::from_args(counts, windows)
                .filter(|l| l.counts_arg() == counts && l.windows_arg() == windows)?,
            reserved_at_us: parts.next()?.parse().ok().filter(|t| *t >= 0)?,
            token: parts.next()?.to_owned(),
            cost: None,
        };
        if let Some(cost) = parts.next() {
            let units: u32 = cost.parse().ok()?;
            r.cost = Some(Cost::new(units).filter(|_| units.to_string() == cost)?);
        }
        let token_ok = (1..=64).contains(&r.token.len())
            && r.token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-');
        (parts.next().is_none() && token_ok).then_some(r)
    }
}

/// The units a message asks for: its own cost (`requested`) and what it asks (`cost`: the
/// same, or a charge learned from its endpoint's answers, see [`PermitStore::cost_to_ask`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asking {
    pub requested: Cost,
    pub cost: Cost,
}

/// What the limiter decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Call now. `slot_us` is the Redis time the call is counted at (a redeemed reservation's
    /// slot), `granted_us` the Redis time of the grant; `used_permille` is how much of the
    /// seller's limit is taken with this grant, in thousandths (a redeemed reservation counts as
    /// 1000: its slot was reserved because the limit had no room).
    /// `call` names the call in the seller's calls until its answer is recorded
    /// ([`PermitStore::complete_call`], [`PermitStore::call_ended`]).
    Granted {
        slot_us: i64,
        granted_us: i64,
        used_permille: u32,
        call: String,
        /// When the request that made the grant left this replica (the grant is younger):
        /// the worker sends the call within [`CALL_ALLOWANCE`] of it, or drops the grant.
        sent: std::time::Instant,
    },
    /// Not yet: come back after `retry_after`. With a reservation, come back with it and the
    /// slot is yours; without (reserving off, beyond the horizon), acquire again then.
    Wait {
        retry_after: Duration,
        reservation: Option<Reservation>,
    },
    /// The seller's limit granted, but a lease of its calls in flight or the global limit did
    /// not: the seller's grant was given back; come back after `retry_after` (a ticket of the
    /// seller's, see `lua/lease.lua` and `lua/global.lua`).
    Deferred { retry_after: Duration, by: Deferral },
    /// The message already registered (its completion record exists): do not call again.
    AlreadyDone,
    /// The call's cost exceeds what the seller's `limits` can ever grant at once (`most`
    /// units: the smallest COUNT, or with gcra the burst, or with token-bucket the capacity).
    /// Nothing was taken; asking again cannot help.
    TooCostly {
        cost: Cost,
        most: u32,
        limits: Limits,
        /// What sets `most` with this algorithm, and what to change (for the dead letter).
        bound_by: &'static str,
    },
}

impl Decision {
    /// A decision of an acquire made for `asked`: a slot it reserved says the units it was
    /// reserved for when they are not the message's cost ([`Reservation::cost`]).
    fn reserved_for(mut self, asked: Asking) -> Self {
        if let Decision::Wait {
            reservation: Some(reservation),
            ..
        } = &mut self
        {
            reservation.cost = (asked.cost != asked.requested).then_some(asked.cost);
        }
        self
    }
}

/// What deferred a call the seller's own limit granted (see [`Decision::Deferred`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deferral {
    /// `TURNSTILE_SELLER_CONCURRENCY` calls of the seller are in flight.
    Concurrency,
    /// The seller has taken more than its fair share of the global limit while others wait.
    GlobalShare,
    /// The global limit has no room now.
    GlobalFull,
}

/// How soon the callers refused a lease come back, one after another (see `lua/lease.lua`).
const LEASE_POLL: Duration = Duration::from_millis(10);

/// What the global limit decided for a seller's call (see `lua/global.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalDecision {
    /// Call now: the global units are taken, counted at `at_us` (Redis time).
    Granted { at_us: i64 },
    /// Not now: come back after `retry_after`. `ahead`: the seller has taken more than its
    /// fair share while others wait; else the global limit has no room now.
    Wait { retry_after: Duration, ahead: bool },
    /// The cost exceeds the smallest COUNT of the global stack: never granted.
    TooCostly { most: u32 },
}

/// The `outcome` label values of `turnstile_seller_leases_total`.
pub const LEASE_OUTCOMES: [&str; 2] = ["leased", "refused"];

/// The `outcome` label values of `turnstile_global_permits_total`: granted; refused because
/// the seller is over its fair share while others wait (`ahead`) or because the global limit
/// has no room (`full`); a cost it never grants.
pub const GLOBAL_OUTCOMES: [&str; 4] = ["granted", "ahead", "full", "too-costly"];

/// The `verdict` label values of `turnstile_shadow_verdicts_total`.
pub const SHADOW_VERDICTS: [&str; 3] = ["agree", "stricter", "looser"];

/// How long a seller stays active for the global limit's fair shares after its last grant (or
/// after the time its last denial told it to come back): a tenth of the global stack's
/// shortest window, within [20 ms, 1 s].
fn global_idle(global: &Limits) -> Duration {
    (global.shortest_window() / 10).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// Why a reservation was given up when redeemed (the caller reserves anew).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forfeit {
    Paused,
    LimitChanged,
    Late,
    /// No such reservation: never made (a forged header), already redeemed (a duplicate copy
    /// of the message), given back when the seller's terms changed, or lost with Redis.
    NotReserved,
}

impl Forfeit {
    pub const ALL: [Forfeit; 4] = [
        Forfeit::Paused,
        Forfeit::LimitChanged,
        Forfeit::Late,
        Forfeit::NotReserved,
    ];

    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Forfeit::Paused => "paused",
            Forfeit::LimitChanged => "limit_changed",
            Forfeit::Late => "late",
            Forfeit::NotReserved => "not_reserved",
        }
    }
}

/// What happened to a message, as its completion record keeps it (see `lua/complete.lua`):
/// each message is in one state, and counted in its upload's progress in that one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion<'a> {
    /// The downstream accepted it (2xx).
    Registered,
    /// Dead-lettered (confirmed by the broker) with this reason: counted once, however many
    /// copies are dead-lettered, and not at all if it already registered.
    Dead(&'a str),
    /// Taken out of the dead letters to be republished to the work queue: waiting again.
    Replayed,
}

impl Completion<'_> {
    /// The script's OUTCOME argument.
    fn outcome(self) -> &'static str {
        match self {
            Completion::Registered => "registered",
            Completion::Dead(_) => "dead",
            Completion::Replayed => "replayed",
        }
    }
}

/// A call's answer, as [`PermitStore::complete_call`] records it: the call's name (see
/// [`Decision::Granted`]), its cost, and when the answer came back (Redis µs, an upper bound: the
/// grant's time plus the time from asking for the permit to the answer; `None`: when recorded).
#[derive(Clone, Copy, Debug)]
pub struct CallAnswer<'a> {
    pub call: &'a str,
    pub cost: Cost,
    pub answered_us: Option<i64>,
    /// The message's result (JSON), kept in its record until published (see
    /// [`Records::result_published`]); `None`: nothing to keep.
    pub result: Option<&'a str>,
}

/// What recording a message's state did ([`PermitStore::complete`],
/// [`PermitStore::complete_call`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Whether the message's state changed (and was counted).
    pub changed: bool,
    /// Whether a learned limit of its seller is due to change: a raise, or a correction of the
    /// last decrease ([`Lesson::Recovery`]).
    pub raise_due: bool,
    /// The completion event of its batch, pending publication (see [`BatchEvent`]).
    pub event: Option<BatchEvent>,
}

/// A batch's completion event waiting to be published: the batch completed at `completed_ms`
/// (Unix ms, Redis time). Whoever publishes it says so with [`Records::batch_event_sent`];
/// until then the message that completed the batch, its redeliveries (recorded again, or acked
/// as registered before) and a replica first seeing the batch find it pending; a message
/// counted after the batch completed (one more than its total) does not, so that it is not
/// published twice at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchEvent {
    pub completed_ms: u64,
}

impl BatchEvent {
    /// The event a script's EVENT answer names ('' when none is pending).
    fn parse(event: &str) -> Option<Self> {
        event.parse().ok().map(|completed_ms| Self { completed_ms })
    }
}

/// A message's batch as its completion is counted: the batch's id and the `batch_size` the
/// message gave.
#[derive(Clone, Copy, Debug)]
pub struct InBatch<'a> {
    pub id: &'a BatchId,
    pub size: Option<BatchSize>,
}

impl<'a> InBatch<'a> {
    /// The batch of a registration, if it names one.
    pub fn of(registration: &'a crate::domain::Registration) -> Option<Self> {
        Some(Self {
            id: registration.batch_id.as_ref()?,
            size: registration.batch_size,
        })
    }
}

/// What the downstream's answers taught about a seller's real limit (see `lua/learn.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lesson {
    /// A 429 for the call granted at `granted_us` (Redis µs), with what its rate-limit headers
    /// said, if anything.
    Throttled {
        granted_us: i64,
        told: Option<RateLimitHeaders>,
    },
    /// [`PermitStore::complete_call`] said a learned limit is due to change: a raise, or a
    /// correction of the last decrease.
    Recovery,
    /// A 2xx answer's rate-limit headers.
    Told(RateLimitHeaders),
}

/// Why a learned limit last changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// A 429 lowered it.
    Throttled,
    /// Sustained success raised it.
    Recovery,
    /// Rate-limit headers set it.
    Header,
}

impl Why {
    pub const ALL: [Why; 3] = [Why::Throttled, Why::Recovery, Why::Header];

    fn parse(s: &str) -> Option<Self> {
        match s {
            "429" => Some(Why::Throttled),
            "recovery" => Some(Why::Recovery),
            "header" => Some(Why::Header),
            _ => None,
        }
    }

    /// The metric label and the name shown: `429`, `recovery` or `header`.
    pub const fn label(self) -> &'static str {
        match self {
            Why::Throttled => "429",
            Why::Recovery => "recovery",
            Why::Header => "header",
        }
    }
}

/// A change of a seller's learned limit (see [`PermitStore::learn`]): its counts now, and
/// whether a count went down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LearnedChange {
    pub counts: String,
    pub why: Why,
    pub lowered: bool,
}

/// A grant that leaves at least this much of the limit taken (thousandths) is near the limit
/// (as envoy's ratelimit counts `near_limit`: 80%).
pub const NEAR_LIMIT_PERMILLE: u32 = 800;

/// Counts a decision in the permit metrics (label: the algorithm; never the seller). A grant
/// that leaves the limit at least [`NEAR_LIMIT_PERMILLE`] taken is `near_limit`; a wait told by
/// an acquire is `over_limit` (the limit had no room), a wait told by a redeem is only `denied`
/// (the caller came back before its reserved slot).
fn observe(algorithm: Algorithm, decision: &Decision, acquired: bool) {
    let algorithm = algorithm.name();
    match decision {
        Decision::Granted { used_permille, .. } => {
            metrics::counter!("turnstile_permits_granted_total", "algorithm" => algorithm)
                .increment(1);
            if *used_permille >= NEAR_LIMIT_PERMILLE {
                metrics::counter!("turnstile_permits_near_limit_total", "algorithm" => algorithm)
                    .increment(1);
            }
        }
        Decision::Wait { .. } => {
            metrics::counter!("turnstile_permits_denied_total", "algorithm" => algorithm)
                .increment(1);
            if acquired {
                metrics::counter!("turnstile_permits_over_limit_total", "algorithm" => algorithm)
                    .increment(1);
            }
        }
        Decision::Deferred { .. } | Decision::AlreadyDone | Decision::TooCostly { .. } => {}
    }
}

/// How far a learned stack stands below its configured one: the smallest learned / configured
/// count over its limits (1 when nothing is learned below it), from the counts as the scripts
/// write them.
fn learned_ratio(learned: &str, configured: &str) -> f64 {
    learned
        .split(',')
        .zip(configured.split(','))
        .filter_map(|(l, c)| Some(l.parse::<f64>().ok()? / c.parse::<f64>().ok()?.max(1.0)))
        .fold(1.0, f64::min)
}

/// Counts a shadow limit's verdict on a decision (see `judge_shadow` in `lua/include/shadow.lua`):
/// `agree`, `stricter` or `looser`; nothing without a shadow limit.
fn count_verdict(verdict: &str) {
    let Some(&verdict) = SHADOW_VERDICTS.iter().find(|&&v| v == verdict) else {
        return;
    };
    metrics::counter!("turnstile_shadow_verdicts_total", "verdict" => verdict).increment(1);
}

/// The per-seller limiter over Redis, shared by all replicas through Redis.
#[derive(Clone)]
pub struct PermitStore {
    conn: RedisConn,
    keys: Keyspace,
    /// The terms it grants under now (see [`applied`]): read once per operation.
    applied: Arc<Applied>,
    call_bound: Duration,
    /// Sends the hot operations in batches (see [`batch`]); started at first use.
    batcher: Arc<OnceLock<Batcher>>,
    /// How long a completion record may wait to ride along with another call (see
    /// [`record_delay`]).
    record_delay: Duration,
    clock: Arc<RedisClock>,
    /// Permit blocks, with `TURNSTILE_PERMIT_BLOCK` > 0 (see [`block`]); they apply under
    /// terms that allow them (see [`PermitStore::pooled`]).
    /// The routes of the routes file (see [`crate::routes`]): a change of a seller's terms
    /// gives back their reservations in their logs too.
    routes: Arc<crate::routes::Routes>,
    blocks: Option<Arc<Blocks>>,
    /// Whether the task that writes what calls made with pool units answered was started (see
    /// `start_writing_answers`).
    writing_answers: Arc<OnceLock<()>>,
    /// The sellers this store reserved slots for lately (see [`PermitStore::reserving`]).
    reserving: Arc<std::sync::Mutex<HashMap<SellerId, std::time::Instant>>>,
    /// The sellers this store learned a 429 of lately: what their calls made with pool units
    /// answered may correct the decrease once written (see `write_answers`).
    throttled: Arc<std::sync::Mutex<HashMap<SellerId, std::time::Instant>>>,
    /// Whether calls ask for the charge learned from their endpoint's answers
    /// (`TURNSTILE_COST_HEADER`, see [`PermitStore::cost_to_ask`]).
    learns_charges: bool,
}

/// How long a charge learned from the downstream's answers (see [`PermitStore::cost_to_ask`])
/// is kept after the last answer that set or confirmed it: a charge no call confirms for that
/// long is forgotten, and the next calls ask their own cost again.
pub const CHARGE_MEMORY: Duration = Duration::from_secs(600);

/// The units a call asks for: its message's `requested` cost, or the charge `learned` from its
/// endpoint's answers when higher, capped at `most` (the smallest COUNT of the stacks it takes,
/// so that a charge never makes it too costly to be granted) but never below `requested`.
pub fn charged_cost(requested: Cost, learned: Option<u32>, most: u32) -> Cost {
    learned
        .map(|charge| charge.min(most).min(Cost::MAX))
        .and_then(Cost::new)
        .map_or(requested, |charge| charge.max(requested))
}

/// The charge a learned-charge key holds (see [`Keyspace::charge`]): an integer from 1 to
/// [`Cost::MAX`] written as one, else `None` (the key is read as untrusted).
fn parse_charge(value: Option<&[u8]>) -> Option<u32> {
    let text = std::str::from_utf8(value?).ok()?;
    let units: u32 = text.parse().ok()?;
    (units.to_string() == text && Cost::new(units).is_some()).then_some(units)
}

/// Most sellers [`PermitStore::reserving`] keeps (beyond it, the ones not seen for
/// [`RESERVING_FOR`] are forgotten, then new ones are not noted).
const MOST_RESERVING: usize = 10_000;

/// How long a seller stays in [`PermitStore::reserving`] after its last reservation: longer than
/// any slot is reserved ahead but for the deepest backlogs.
const RESERVING_FOR: Duration = Duration::from_secs(3600);

/// Most sellers [`PermitStore::throttled`] keeps (beyond it, it starts over).
const MOST_THROTTLED: usize = 4096;

/// How long after a 429 of a seller learned here what its calls made with pool units answered
/// is looked at for a correction of the decrease (see `write_answers`): longer than the pool's
/// answers wait to be written, shorter than the accepted log is kept at the shortest window.
const THROTTLED_FOR: Duration = Duration::from_secs(2);

/// How long after its grant a block's units may be claimed.
pub const BLOCK_HOLD: Duration = Duration::from_secs(2);

/// How much room a plain claim of a pool unit leaves between its call's bound and the unit's
/// end (see `PermitStore::grant_from_pool`): for the replica's clock, which measures the bound,
/// to run a little slower than Redis's.
const CLAIM_MARGIN_US: i64 = 20_000;

/// How often what calls made with pool units answered is written (see
/// [`block::Blocks::answered`]).
const WRITE_ANSWERS_EVERY: Duration = Duration::from_millis(500);

/// How long a completion record (or a call's end, or a lesson from a 2xx) may wait to ride
/// along with another call to the same place before it is sent by itself:
/// `TURNSTILE_RECORD_DELAY`, or a quarter of the default limit's shortest window if that is less
/// (a record should land well before the next window's calls are decided; it carries when the
/// answer came, so a late one is still exact).
pub fn record_delay(limiter: &LimiterArgs) -> Duration {
    (limiter.limit.shortest_window() / 4).min(limiter.record_delay)
}

/// This replica's estimate of Redis's clock, from the Redis time in the limiter's answers. A
/// sample `redis_now - local_now` (the local side on a monotonic clock, taken when the answer
/// arrived) is at most the true offset, since Redis read its clock before the answer arrived;
/// the largest sample of the last [`RedisClock::FRESH`] is used, so an estimate is not ahead of
/// the clock of the Redis that answered it (on Redis Cluster, of the node with the fastest
/// clock). It only decides how long a message waits before it asks: Redis decides the rest.
struct RedisClock {
    base: std::time::Instant,
    /// (offset µs, local µs when observed), once observed.
    sample: std::sync::Mutex<Option<(i64, i64)>>,
}

impl Default for RedisClock {
    fn default() -> Self {
        Self {
            base: std::time::Instant::now(),
            sample: std::sync::Mutex::new(None),
        }
    }
}

impl RedisClock {
    const FRESH: i64 = 10_000_000;

    fn local_us(&self) -> i64 {
        self.base.elapsed().as_micros().min(i64::MAX as u128) as i64
    }

    fn observe(&self, redis_now_us: i64) {
        let local = self.local_us();
        let offset = redis_now_us - local;
        let mut sample = self
            .sample
            .lock()
            .expect("the clock's lock is never poisoned");
        let newer = match *sample {
            None => true,
            Some((kept, at)) => offset > kept || local - at > Self::FRESH,
        };
        if newer {
            *sample = Some((offset, local));
        }
    }

    fn now_us(&self) -> Option<i64> {
        let sample = *self
            .sample
            .lock()
            .expect("the clock's lock is never poisoned");
        sample.map(|(offset, _)| self.local_us() + offset)
    }
}

/// How long after its grant a call may still start: a worker that could not send it sooner
/// drops the grant (the call's place is kept until its bound, never less).
pub const CALL_ALLOWANCE: Duration = Duration::from_secs(1);

fn wait_for(at_us: i64, now_us: i64) -> Duration {
    Duration::from_micros(at_us.saturating_sub(now_us).max(0) as u64)
}

impl PermitStore {
    pub async fn connect(redis: &RedisArgs, limiter: &LimiterArgs) -> anyhow::Result<Self> {
        Ok(Self::new(
            RedisConn::connect(redis).await?,
            &redis.key_prefix,
            limiter.clone(),
        ))
    }

    pub fn new(conn: RedisConn, prefix: &str, limiter: LimiterArgs) -> Self {
        let blocks = (limiter.permit_block > 0)
            .then(|| Arc::new(Blocks::new(limiter.permit_block, BLOCK_HOLD)));
        Self {
            conn,
            keys: Keyspace::new(prefix),
            record_delay: record_delay(&limiter),
            blocks,
            writing_answers: Arc::default(),
            throttled: Arc::default(),
            reserving: Arc::default(),
            applied: Arc::new(Applied::new(limiter)),
            routes: Arc::default(),
            call_bound: Duration::ZERO,
            batcher: Arc::default(),
            clock: Arc::default(),
            learns_charges: false,
        }
    }

    /// With `on` (`TURNSTILE_COST_HEADER` set), calls ask for the charge learned from their
    /// endpoint's answers (see [`Self::cost_to_ask`]); off, they ask their message's cost and
    /// nothing is read.
    pub fn with_learned_charges(mut self, on: bool) -> Self {
        self.learns_charges = on;
        self
    }

    /// Runs a hot operation through the batcher (see [`batch`]) and reads its answer as `T`.
    async fn run<T: redis::FromRedisValue>(
        &self,
        operation: Operation,
        when: When,
    ) -> Result<T, PermitError> {
        Ok(self.run_sent(operation, when).await?.0)
    }

    /// As [`Self::run`], with when the call that carried the operation left this replica.
    async fn run_sent<T: redis::FromRedisValue>(
        &self,
        operation: Operation,
        when: When,
    ) -> Result<(T, std::time::Instant), PermitError> {
        let batcher = self
            .batcher
            .get_or_init(|| Batcher::start(self.conn.clone()));
        let (answer, sent) = batcher.run_sent(operation, when).await;
        if let (Err(PermitError::Redis(_)), Some(blocks)) = (&answer, &self.blocks) {
            blocks.forget_pools();
        }
        let value = redis::from_redis_value(answer?).map_err(|e| PermitError::Redis(e.into()))?;
        Ok((value, sent.into_std()))
    }

    /// Calls to Redis this store (and its clones) sent for the limiter's hot operations so
    /// far, each carrying one or more operations (see [`batch`]).
    pub fn batched_calls(&self) -> u64 {
        self.batcher.get().map_or(0, Batcher::calls)
    }

    /// Redis's time now as this replica estimates it from the limiter's answers (never ahead
    /// of Redis's, see `RedisClock`); `None` before the first answer.
    pub fn redis_now_us(&self) -> Option<i64> {
        self.clock.now_us()
    }

    /// Calls granted by this store are sent within [`CALL_ALLOWANCE`] of their grant and
    /// answered (or timed out) within `timeout` of being sent: each holds its place in the
    /// seller's window until its answer is recorded, and at most until grant + allowance +
    /// timeout (see `calls_gate` in `lua/include/calls.lua`). Without it (zero), a call counts at its
    /// grant only, as a point.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_bound = CALL_ALLOWANCE + timeout;
        self
    }

    fn call_bound_us(&self) -> u64 {
        self.call_bound.as_micros() as u64
    }

    /// Records that the call `call` of `cost` units was answered at `answered_us` (Redis time,
    /// an upper bound; `None`: now), for every answer but a registration, which [`Self::complete_call`] records
    /// with its completion. The record rides along with other calls (see [`record_delay`]).
    pub async fn call_ended(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        answered_us: Option<i64>,
    ) -> Result<(), PermitError> {
        if let Some(blocks) = &self.blocks {
            blocks.recorded(call);
        }
        let ended = CallEnded {
            calls: self.keys.calls(seller),
            call,
            answered_us: answered_us.unwrap_or(-1).max(-1),
            cost: cost.units(),
        };
        let _: i64 = self
            .run(ended.operation(), When::Within(self.record_delay))
            .await?;
        Ok(())
    }

    /// The algorithm it grants under now.
    pub fn algorithm(&self) -> Algorithm {
        self.limiter().algorithm
    }

    /// The default stack it grants under now (the fleet's, see [`applied`]).
    pub fn default_limit(&self) -> Limits {
        self.limiter().limit.clone()
    }

    /// The terms it grants under now, for one operation (see [`Applied::current`]).
    pub fn limiter(&self) -> Arc<LimiterArgs> {
        self.applied.current()
    }

    /// The terms it grants under, as the fleet replaces them (see [`applied`]).
    pub fn applied(&self) -> &Arc<Applied> {
        &self.applied
    }

    /// The permit blocks, when the terms `limiter` allow them: sliding-window, neither a
    /// global limit nor a seller concurrency.
    fn pooled(&self, limiter: &LimiterArgs) -> Option<&Arc<Blocks>> {
        self.blocks.as_ref().filter(|_| {
            limiter.algorithm == Algorithm::SlidingWindow
                && limiter.global_limit.0.is_none()
                && limiter.seller_concurrency.0.is_none()
        })
    }

    /// The connection to Redis this store uses.
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The keys this store uses (see [`keys`]).
    pub fn keys(&self) -> &Keyspace {
        &self.keys
    }

    /// Sellers' terms under this store's connection and prefix, read under the terms it grants
    /// under, as the fleet replaces them (see [`Admin`]).
    pub fn admin(&self) -> Admin {
        Admin::following(self.conn.clone(), self.keys.prefix(), self.applied.clone())
            .with_routes(&self.routes)
    }

    /// The routes it was given (see [`Self::with_routes`]).
    pub fn routes(&self) -> &Arc<crate::routes::Routes> {
        &self.routes
    }

    /// Knows the routes of the routes file: a change of a seller's terms (a lesson of adaptive
    /// limits, a pause, a limit set) gives back reservations on them in their logs too.
    pub fn with_routes(mut self, routes: Arc<crate::routes::Routes>) -> Self {
        self.routes = routes;
        self
    }

    /// The seller's logs of every route (see [`Self::with_routes`]).
    fn route_logs(&self, seller: &SellerId) -> Vec<String> {
        self.routes
            .iter()
            .map(|route| self.keys.route_log(seller, &route.name))
            .collect()
    }

    /// The uploads' progress, the dead letters by reason and the dashboard's shared state under
    /// this store's connection and prefix (see [`Records`]).
    pub fn records(&self) -> Records {
        Records::new(self.conn.clone(), self.keys.prefix())
    }

    /// Pauses the seller on every replica for `duration` (as a 429 asks): see [`Admin::pause`].
    pub async fn pause(
        &self,
        seller: &SellerId,
        duration: Duration,
    ) -> Result<Duration, PermitError> {
        self.admin().pause(seller, duration).await
    }

    /// A call's route as the scripts take it (see [`OnRoute`]), under `limiter`'s stack for it
    /// (the fleet's, see [`LimiterArgs::route_limits`]) or else its own.
    fn on_route(
        &self,
        limiter: &LimiterArgs,
        seller: &SellerId,
        route: Option<&Route>,
    ) -> Option<OnRoute> {
        route.map(|route| {
            let limits = limiter
                .route_limits
                .get(&route.name)
                .unwrap_or(&route.limits);
            OnRoute {
                log: self.keys.route_log(seller, &route.name),
                limit: self.keys.route_limit(seller, &route.name),
                counts: limits.counts_arg(),
                windows: limits.windows_arg(),
            }
        })
    }

    /// The key holding the seller's limiter state for the configured algorithm.
    fn state_key(&self, limiter: &LimiterArgs, seller: &SellerId) -> String {
        self.keys.state(seller, limiter.algorithm)
    }

    /// The seller's learned state, passed to the scripts that apply it only with adaptive
    /// limits on.
    fn learned_key(&self, limiter: &LimiterArgs, seller: &SellerId) -> Option<String> {
        limiter.adaptive.then(|| self.keys.learned(seller))
    }

    /// Asks for a permit of one unit now. With `reserve`, a caller who must wait holds a slot.
    pub async fn acquire(&self, seller: &SellerId, reserve: bool) -> Result<Decision, PermitError> {
        self.acquire_for(seller, None, Cost::ONE, reserve).await
    }

    /// As [`Self::acquire`], for a call of `cost` units of every limit.
    pub async fn acquire_units(
        &self,
        seller: &SellerId,
        cost: Cost,
        reserve: bool,
    ) -> Result<Decision, PermitError> {
        self.acquire_for(seller, None, cost, reserve).await
    }

    /// As [`Self::acquire_units`], for a message: if it already registered, answers
    /// `AlreadyDone` in the same round trip and takes nothing.
    pub async fn acquire_for(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        reserve: bool,
    ) -> Result<Decision, PermitError> {
        self.acquire_with(seller, message, cost, reserve, 0, None, None)
            .await
    }

    /// As [`Self::acquire_for`]. With permit blocks on (sliding-window), a call of one unit is
    /// first granted a unit of the seller's pool if it holds one, and a grant takes up to
    /// `block` more units into the pool (see [`block`], `take_block` and `claim_idle` in
    /// `lua/include/blocks.lua`).
    #[allow(clippy::too_many_arguments)]
    async fn acquire_with(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        reserve: bool,
        block: u32,
        rank: Option<&Rank>,
        route: Option<&Route>,
    ) -> Result<Decision, PermitError> {
        let asked = std::time::Instant::now();
        let limiter = self.limiter();
        let algorithm = limiter.algorithm;
        let token = Rank::token(rank, route.is_some());
        // A call on a route never takes part in permit blocks.
        let pooled = self.pooled(&limiter).filter(|_| route.is_none());
        let block_hold = pooled.map(|blocks| (block.min(block::MOST_UNITS), blocks.hold_us()));
        let mut acquire =
            self.acquire_call(&limiter, seller, message, cost, reserve, block_hold, &token);
        acquire.route = self.on_route(&limiter, seller, route);
        let (values, sent) = self.run_sent(acquire.operation(), When::Now).await?;
        let answer = AcquireAnswer { values, algorithm };
        let mut decision = answer.decision(token, cost, sent)?;
        if let Decision::Granted {
            granted_us: now, ..
        }
        | Decision::Wait {
            reservation:
                Some(Reservation {
                    reserved_at_us: now,
                    ..
                }),
            ..
        } = &decision
        {
            self.clock.observe(*now);
        }
        if let Some(blocks) = pooled
            && cost == Cost::ONE
        {
            self.took_from_pool(
                &limiter,
                blocks,
                seller,
                &answer,
                block,
                asked,
                &mut decision,
            );
        }
        if let Decision::Wait {
            reservation: Some(_),
            ..
        } = &decision
        {
            self.noted_reserving(seller);
        }
        observe(algorithm, &decision, true);
        Ok(decision)
    }

    /// Notes that the seller holds a slot this store reserved (bounded, see
    /// [`MOST_RESERVING`]).
    fn noted_reserving(&self, seller: &SellerId) {
        let mut reserving = self
            .reserving
            .lock()
            .expect("the reserving sellers' lock is never poisoned");
        let now = std::time::Instant::now();
        if reserving.len() >= MOST_RESERVING && !reserving.contains_key(seller) {
            reserving.retain(|_, at| now.duration_since(*at) < RESERVING_FOR);
            if reserving.len() >= MOST_RESERVING {
                return;
            }
        }
        reserving.insert(seller.clone(), now);
    }

    /// The sellers this store reserved slots for in the last hour (at most
    /// [`MOST_RESERVING`]): those whose backlog a change of the default terms re-plans (see
    /// [`PermitStore::release_reserved`]).
    pub fn reserving(&self) -> Vec<SellerId> {
        let now = std::time::Instant::now();
        self.reserving
            .lock()
            .expect("the reserving sellers' lock is never poisoned")
            .iter()
            .filter(|(_, at)| now.duration_since(**at) < RESERVING_FOR)
            .map(|(seller, _)| seller.clone())
            .collect()
    }

    /// Gives back every slot reserved for each of `sellers`, made under the terms `before`
    /// (as `turnstile limits set` does for one seller, and announced the same way), so that
    /// the terms now in force apply at once to their whole backlogs: their messages reserve
    /// anew. Returns how many sellers were re-planned; stops at the first Redis error.
    pub async fn release_reserved(
        &self,
        before: &LimiterArgs,
        sellers: &[SellerId],
    ) -> Result<usize, PermitError> {
        let admin = Admin::new(self.conn.clone(), self.keys.prefix(), Terms::from(before))
            .with_routes(&self.routes);
        for seller in sellers {
            admin.reschedule(seller, admin::Change::Release).await?;
        }
        Ok(sellers.len())
    }

    /// `lua/<algorithm>.lua`'s call for the seller (see [`Acquire`]); `block`: with permit
    /// blocks on (sliding-window), the units a grant may take into the pool and their hold.
    #[allow(clippy::too_many_arguments)]
    fn acquire_call<'a>(
        &self,
        limiter: &LimiterArgs,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        reserve: bool,
        block: Option<(u32, u64)>,
        token: &'a str,
    ) -> Acquire<'a> {
        let limit = &limiter.limit;
        Acquire {
            state: self.state_key(limiter, seller),
            limit: self.keys.limit(seller),
            pause: self.keys.pause(seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            server: self.keys.server(seller),
            calls: self.keys.calls(seller),
            far: self.keys.far(seller),
            learned: self.keys.learned(seller),
            shadow: self.keys.shadow(seller),
            shadow_log: self.keys.shadow_log(seller),
            losses: self.keys.losses(seller),
            give_way: self.keys.give_way(seller),
            done: message.map(|message| self.keys.done(seller, message)),
            counts: limit.counts_arg(),
            windows: limit.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            reserve,
            durable: limiter.redis_durable,
            adaptive: limiter.adaptive,
            horizon_us: limiter.horizon.as_micros() as u64,
            token,
            bound_us: self.call_bound_us(),
            cost: cost.units(),
            tail: match limiter.algorithm {
                Algorithm::SlidingWindow => AcquireTail::SlidingWindow {
                    pool: self.keys.pool(seller),
                    block,
                },
                Algorithm::Gcra => AcquireTail::Gcra {
                    burst: limiter.gcra_burst.max(1),
                },
                Algorithm::TokenBucket => AcquireTail::TokenBucket {
                    capacity: limiter.bucket_capacity,
                },
                Algorithm::FixedWindow => AcquireTail::FixedWindow,
            },
            route: None,
        }
    }

    /// What a sliding-window grant of one unit (asked at `asked`) did with the seller's pool
    /// of permit blocks (see `calls::PoolAnswer`): units taken into it or claimed from it (then the
    /// call is that unit), stale units given back.
    #[allow(clippy::too_many_arguments)]
    fn took_from_pool(
        &self,
        limiter: &LimiterArgs,
        blocks: &Arc<Blocks>,
        seller: &SellerId,
        answer: &AcquireAnswer,
        block: u32,
        asked: std::time::Instant,
        decision: &mut Decision,
    ) {
        let pool = answer.pool(block);
        blocks.acquired(seller, pool.taken, pool.stale);
        if !blocks.tries_pool(seller) {
            blocks.unseen_pool(pool.unit.is_some());
        }
        if let Decision::Granted { call, .. } = decision
            && (pool.unit.is_some() || pool.taken > 0)
        {
            if let Some(unit) = pool.unit {
                metrics::counter!("turnstile_permit_block_units_total").increment(1);
                *call = unit;
            } else {
                metrics::counter!("turnstile_permit_blocks_total").increment(1);
            }
            let stack = answer.stack().unwrap_or_else(|_| limiter.limit.clone());
            blocks.saw_pool(seller, asked);
            blocks.claimed(call, Self::log_bounds(limiter, &stack));
        }
    }

    /// The accepted log's bounds under `stack` (see [`block::LogBounds`]).
    fn log_bounds(limiter: &LimiterArgs, stack: &Limits) -> block::LogBounds {
        block::LogBounds {
            span_us: stack
                .iter()
                .map(|l| (l.window() + limiter.guard_for(l.window())).as_micros() as u64)
                .max()
                .unwrap_or(0),
            most: stack
                .iter()
                .map(|l| u64::from(l.count()))
                .max()
                .unwrap_or(0),
        }
    }

    /// A grant from the seller's pool (see [`block`]) in one plain round trip, if this replica
    /// saw units in it lately (or guesses it has some, see [`Blocks::guesses_pool`]): the
    /// seller's pause, limit override and the message's completion record read (a plain claim
    /// does not read them the way an acquire does), Redis's `TIME` and the claim of a unit
    /// (`ZPOPMIN`). `TIME` runs after the message asked, so a call bounded from then answers by
    /// `TIME` + its bound at the latest: the unit is used only if that (and
    /// [`CLAIM_MARGIN_US`]) is within its end in the seller's calls. A unit that is not used
    /// (late, its message registered, its seller paused) is given back; an empty pool sends the
    /// message to an acquire.
    async fn grant_from_pool(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
    ) -> Result<Option<Decision>, PermitError> {
        let limiter = self.limiter();
        let Some(blocks) = self.pooled(&limiter) else {
            return Ok(None);
        };
        blocks.asking();
        if cost != Cost::ONE {
            return Ok(None);
        }
        let seen = blocks.tries_pool(seller);
        if !seen && !blocks.guesses_pool() {
            return Ok(None);
        }
        let asked = std::time::Instant::now();
        let mut read = redis::cmd("MGET");
        read.arg(self.keys.pause(seller))
            .arg(self.keys.limit(seller));
        if let Some(message) = message {
            read.arg(self.keys.done(seller, message));
        }
        let mut claim = redis::cmd("ZPOPMIN");
        claim.arg(self.keys.pool(seller));
        let ((read, (seconds, micros), popped), sent): (PoolClaim, _) = self
            .run_sent(
                Operation::commands(
                    vec![read, redis::cmd("TIME"), claim],
                    self.keys.pause(seller),
                ),
                When::Now,
            )
            .await?;
        let now_us = seconds.saturating_mul(1_000_000).saturating_add(micros);
        let (Some(unit), Some(ends)) = (
            popped.first(),
            popped.get(1).and_then(|s| s.parse::<f64>().ok()),
        ) else {
            if seen {
                blocks.pool_gone(seller);
            } else {
                blocks.unseen_pool(false);
            }
            return Ok(None);
        };
        if !seen {
            blocks.unseen_pool(true);
        }
        if read
            .get(2)
            .is_some_and(|state| state.as_deref().is_some_and(records::is_registered))
        {
            self.give_back_unit(seller, unit);
            return Ok(Some(Decision::AlreadyDone));
        }
        let paused_until = read
            .first()
            .and_then(|until| until.as_deref()?.parse::<i64>().ok())
            .unwrap_or(0);
        let in_hold = now_us + self.call_bound_us() as i64 + CLAIM_MARGIN_US <= ends as i64;
        if paused_until > now_us || !in_hold {
            // The message acquires, which says when to come back.
            self.give_back_unit(seller, unit);
            blocks.pool_gone(seller);
            return Ok(None);
        }
        self.clock.observe(now_us);
        let granted_us = now_us;
        // A pool is only made under no learned limit: the override's stack, or the default.
        let stack = read
            .get(1)
            .and_then(|raw| parse_override(raw.as_deref()?))
            .unwrap_or_else(|| limiter.limit.clone());
        blocks.saw_pool(seller, asked);
        blocks.claimed(unit, Self::log_bounds(&limiter, &stack));
        let decision = Decision::Granted {
            slot_us: granted_us,
            granted_us,
            // A block is only granted with at most half of every limit used.
            used_permille: 0,
            call: unit.clone(),
            sent,
        };
        metrics::counter!("turnstile_permit_block_units_total").increment(1);
        observe(limiter.algorithm, &decision, true);
        Ok(Some(decision))
    }

    /// Gives back a pool unit this replica claimed but will not call (in the background): it
    /// leaves the seller's log and calls. Until then, or if that fails, it holds its place until
    /// its end.
    fn give_back_unit(&self, seller: &SellerId, unit: &str) {
        let mut from_log = redis::cmd("ZREM");
        from_log
            .arg(self.keys.state(seller, Algorithm::SlidingWindow))
            .arg(unit);
        let mut from_calls = redis::cmd("ZREM");
        from_calls.arg(self.keys.calls(seller)).arg(unit);
        let operation = Operation::commands(vec![from_log, from_calls], self.keys.calls(seller));
        let store = self.clone();
        tokio::spawn(async move {
            if let Err(error) = store
                .run::<redis::Value>(operation, When::Within(store.record_delay))
                .await
            {
                tracing::debug!(%error, "a permit-block unit was not given back: it holds its place until its end");
            }
        });
    }

    /// Acquires for a message, asking for a block with the grant when blocks apply.
    async fn acquire_blocking(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        rank: Option<&Rank>,
    ) -> Result<Decision, PermitError> {
        let want = match &self.blocks {
            Some(blocks) if cost == Cost::ONE => blocks.wanted(seller),
            _ => 0,
        };
        self.acquire_with(seller, message, cost, true, want, rank, None)
            .await
    }

    /// The seller's terms changed (or it was paused): this replica stops claiming from its pool
    /// without an acquire.
    fn drop_block(&self, seller: &SellerId) {
        if let Some(blocks) = &self.blocks {
            blocks.pool_gone(seller);
        }
    }

    /// Comes back for a reserved slot: `Ok(Ok(decision))` is granted or still early (wait again
    /// with the same reservation); `Ok(Err(forfeit))` means the slot is gone.
    pub async fn redeem(
        &self,
        seller: &SellerId,
        held: Reservation,
    ) -> Result<Result<Decision, Forfeit>, PermitError> {
        self.redeem_for(seller, None, Cost::ONE, held, None).await
    }

    /// As [`Self::redeem`], for a message of `cost` units (answers `AlreadyDone` if it already
    /// registered). A reservation is only good for the cost it was made for.
    pub async fn redeem_for(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        held: Reservation,
        route: Option<&Route>,
    ) -> Result<Result<Decision, Forfeit>, PermitError> {
        let limiter = self.limiter();
        let mut redeem = self.redeem_call(&limiter, seller, message, cost, &held);
        redeem.route = self.on_route(&limiter, seller, route);
        let (
            RedeemAnswer {
                status,
                at_us: at,
                now_us: now,
                verdict,
            },
            sent,
        ) = self.run_sent(redeem.operation(), When::Now).await?;
        self.clock.observe(now);
        count_verdict(&verdict);
        let redeemed = match status {
            1 => Ok(Decision::Granted {
                slot_us: at,
                granted_us: now,
                used_permille: 1000,
                call: held.token.clone(),
                sent,
            }),
            2 => Ok(Decision::Wait {
                retry_after: wait_for(at, now),
                reservation: Some(held),
            }),
            // Moved later by a message ranked ahead of it (see `lua/include/ranks.lua`): the
            // same reservation, at its new slot.
            9 => Ok(Decision::Wait {
                retry_after: wait_for(at, now),
                reservation: Some(Reservation {
                    slot_us: at,
                    ..held
                }),
            }),
            3 => Err(Forfeit::Paused),
            4 => Err(Forfeit::LimitChanged),
            5 => Err(Forfeit::Late),
            6 => Ok(Decision::AlreadyDone),
            8 => Err(Forfeit::NotReserved),
            _ => return Err(PermitError::Answer("redeem")),
        };
        match &redeemed {
            Ok(decision) => observe(limiter.algorithm, decision, false),
            Err(forfeit) => metrics::counter!(
                "turnstile_reservations_forfeited_total",
                "reason" => forfeit.label()
            )
            .increment(1),
        }
        Ok(redeemed)
    }

    /// `lua/redeem.lua`'s call for the seller's reservation `held` (see [`Redeem`]).
    fn redeem_call<'a>(
        &self,
        limiter: &LimiterArgs,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        held: &'a Reservation,
    ) -> Redeem<'a> {
        let limit = &limiter.limit;
        Redeem {
            limit: self.keys.limit(seller),
            pause: self.keys.pause(seller),
            state: self.state_key(limiter, seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            server: self.keys.server(seller),
            calls: self.keys.calls(seller),
            learned: self.keys.learned(seller),
            shadow: self.keys.shadow(seller),
            shadow_log: self.keys.shadow_log(seller),
            losses: self.keys.losses(seller),
            done: message.map(|message| self.keys.done(seller, message)),
            counts: limit.counts_arg(),
            windows: limit.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            slot_us: held.slot_us,
            held_counts: held.limits.counts_arg(),
            held_windows: held.limits.windows_arg(),
            durable: limiter.redis_durable,
            adaptive: limiter.adaptive,
            algorithm: limiter.algorithm,
            token: &held.token,
            capacity: limiter.bucket_capacity,
            bound_us: self.call_bound_us(),
            cost: cost.units(),
            route: None,
        }
    }

    /// Redeems `held` if there is one, and reserves anew if it was forfeited; a grant is then
    /// asked of the global limit too, if there is one (see [`Self::within_global`]): the one
    /// permit a consumer asks for before each downstream call.
    pub async fn acquire_or_redeem(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        held: Option<&Reservation>,
    ) -> Result<(Decision, Option<Forfeit>), PermitError> {
        self.acquire_or_redeem_ranked(seller, message, cost, held, None)
            .await
    }

    /// As [`Self::acquire_or_redeem`], for a message of `rank` among its seller's waiting
    /// messages: a slot it reserves is taken from the first reservations ranked behind it, which
    /// move back (see [`Rank`]).
    pub async fn acquire_or_redeem_ranked(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        held: Option<&Reservation>,
        rank: Option<&Rank>,
    ) -> Result<(Decision, Option<Forfeit>), PermitError> {
        self.acquire_or_redeem_on(seller, message, cost, held, rank, None)
            .await
    }

    /// As [`Self::acquire_or_redeem_ranked`], for a call on `route` (see [`crate::routes`]):
    /// it takes units of the route's stack and of the seller's budget in the same step, never
    /// from permit blocks, and its slot keeps its place (no message ranked ahead moves it).
    pub async fn acquire_or_redeem_on(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        held: Option<&Reservation>,
        rank: Option<&Rank>,
        route: Option<&Route>,
    ) -> Result<(Decision, Option<Forfeit>), PermitError> {
        let asked = Asking {
            requested: cost,
            cost,
        };
        let (decision, forfeit, _) = self
            .acquire_or_redeem_costed(seller, message, asked, held, rank, route)
            .await?;
        Ok((decision, forfeit))
    }

    /// As [`Self::acquire_or_redeem_on`], for a message of `asked.requested` units asking for
    /// `asked.cost` (see [`Self::cost_to_ask`]): a slot it holds is redeemed at the units it was
    /// reserved for ([`Reservation::cost`]), a new one is reserved at `asked.cost` (and says so
    /// when that is not the message's cost). Returns the units the decision is for too.
    pub async fn acquire_or_redeem_costed(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        asked: Asking,
        held: Option<&Reservation>,
        rank: Option<&Rank>,
        route: Option<&Route>,
    ) -> Result<(Decision, Option<Forfeit>, Cost), PermitError> {
        let cost = asked.cost;
        let (mut decision, forfeit, units) = match held {
            Some(held) => {
                let reserved = held.cost.unwrap_or(asked.requested);
                match self
                    .redeem_for(seller, message, reserved, held.clone(), route)
                    .await?
                {
                    Ok(decision) => (decision, None, reserved),
                    Err(forfeit) => (
                        self.acquire_with(seller, message, cost, true, 0, rank, route)
                            .await?
                            .reserved_for(asked),
                        Some(forfeit),
                        cost,
                    ),
                }
            }
            None if route.is_some() => (
                self.acquire_with(seller, message, cost, true, 0, rank, route)
                    .await?
                    .reserved_for(asked),
                None,
                cost,
            ),
            None => match self.grant_from_pool(seller, message, cost).await? {
                // Blocks are only taken without a global limit or seller concurrency.
                Some(decision) => return Ok((decision, None, cost)),
                None => (
                    self.acquire_blocking(seller, message, cost, rank)
                        .await?
                        .reserved_for(asked),
                    None,
                    cost,
                ),
            },
        };
        decision = self.beyond_seller(seller, units, decision, route).await?;
        Ok((decision, forfeit, units))
    }

    /// A seller's grant is called only with a lease of its calls in flight
    /// (`TURNSTILE_SELLER_CONCURRENCY`) and the global limit's units (`TURNSTILE_GLOBAL_LIMIT`)
    /// too, asked in that order. If either refuses, what was taken is given back (the lease;
    /// the seller's grant, [`Self::release`]) and the grant becomes [`Decision::Deferred`] or,
    /// for a cost the global limit can never grant, [`Decision::TooCostly`]. Any other
    /// decision, and every decision when neither is set, is returned as it is.
    async fn beyond_seller(
        &self,
        seller: &SellerId,
        cost: Cost,
        decision: Decision,
        route: Option<&Route>,
    ) -> Result<Decision, PermitError> {
        let limiter = self.limiter();
        let Decision::Granted { slot_us, call, .. } = &decision else {
            return Ok(decision);
        };
        let leased = limiter.seller_concurrency.0.is_some();
        let refused = match self.take_lease(seller, call).await {
            Ok(None) => self.global_refusal(seller, cost, call).await,
            Ok(Some(retry_after)) => {
                return self
                    .give_back(seller, call, cost, *slot_us, false, route)
                    .await
                    .map(|()| Decision::Deferred {
                        retry_after,
                        by: Deferral::Concurrency,
                    });
            }
            Err(error) => Err(error),
        };
        match refused {
            Ok(None) => Ok(decision),
            Ok(Some(refused)) => {
                self.give_back(seller, call, cost, *slot_us, leased, route)
                    .await?;
                Ok(refused)
            }
            Err(error) => {
                // Not called either way: give back what was taken if Redis lets us.
                let _ = self
                    .give_back(seller, call, cost, *slot_us, leased, route)
                    .await;
                Err(error)
            }
        }
    }

    /// Gives back a grant that will not be called, and its lease if `leased`.
    async fn give_back(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        slot_us: i64,
        leased: bool,
        route: Option<&Route>,
    ) -> Result<(), PermitError> {
        let released = self.release(seller, call, cost, slot_us, route).await;
        if leased {
            self.end_lease(seller, call).await?;
        }
        released
    }

    /// What the global limit refuses of a call (`None`: it grants, or there is none).
    async fn global_refusal(
        &self,
        seller: &SellerId,
        cost: Cost,
        call: &str,
    ) -> Result<Option<Decision>, PermitError> {
        let limiter = self.limiter();
        let Some(global) = &limiter.global_limit.0 else {
            return Ok(None);
        };
        Ok(match self.admit_globally(seller, cost, call).await? {
            GlobalDecision::Granted { .. } => None,
            GlobalDecision::Wait { retry_after, ahead } => Some(Decision::Deferred {
                retry_after,
                by: if ahead {
                    Deferral::GlobalShare
                } else {
                    Deferral::GlobalFull
                },
            }),
            GlobalDecision::TooCostly { most } => Some(Decision::TooCostly {
                cost,
                most,
                limits: global.clone(),
                bound_by: "the smallest COUNT of TURNSTILE_GLOBAL_LIMIT",
            }),
        })
    }

    /// Takes a lease of the seller's calls in flight for `call` (see `lua/lease.lua`): `None`
    /// when leased (or without `TURNSTILE_SELLER_CONCURRENCY`), else when to ask again.
    async fn take_lease(
        &self,
        seller: &SellerId,
        call: &str,
    ) -> Result<Option<Duration>, PermitError> {
        let limiter = self.limiter();
        let Some(limit) = limiter.seller_concurrency.0 else {
            return Ok(None);
        };
        let lease = Lease {
            leases: self.keys.leases(seller),
            ticket: self.keys.lease_ticket(seller),
            limit: limit.get(),
            call,
            bound_us: self.call_bound_us().max(1),
            poll_us: LEASE_POLL.as_micros() as u64,
        };
        let LeaseAnswer {
            leased,
            at_us,
            now_us,
        } = lease
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        let outcome = LEASE_OUTCOMES[usize::from(!leased)];
        metrics::counter!("turnstile_seller_leases_total", "outcome" => outcome).increment(1);
        Ok((!leased).then(|| wait_for(at_us, now_us)))
    }

    /// Ends the lease of `call` (its answer came back, or it will not be sent); without
    /// `TURNSTILE_SELLER_CONCURRENCY`, nothing.
    pub async fn end_lease(&self, seller: &SellerId, call: &str) -> Result<(), PermitError> {
        let limiter = self.limiter();
        if limiter.seller_concurrency.0.is_none() {
            return Ok(());
        }
        let _: i64 = self
            .conn
            .clone()
            .zrem(self.keys.leases(seller), call)
            .await?;
        Ok(())
    }

    /// Asks the global limit for `cost` units for the call `call` of `seller` (see
    /// `lua/global.lua`); without a global limit, grants.
    pub async fn admit_globally(
        &self,
        seller: &SellerId,
        cost: Cost,
        call: &str,
    ) -> Result<GlobalDecision, PermitError> {
        let limiter = self.limiter();
        let Some(global) = &limiter.global_limit.0 else {
            return Ok(GlobalDecision::Granted { at_us: 0 });
        };
        let admit = Global {
            keys: self.keys.global_keys(),
            counts: global.counts_arg(),
            windows: global.windows_arg(),
            guard_us: Terms::guard_arg_of(Some(limiter.global_guard())),
            call,
            cost: cost.units(),
            seller: &seller.key_tag(),
            idle_us: global_idle(global).as_micros() as u64,
            durable: limiter.redis_durable,
            bound_us: self.call_bound_us(),
        };
        let GlobalAnswer {
            status,
            at_us: at,
            now_us: now,
            why,
        } = admit
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        let decision = match (status, why) {
            (1, _) => GlobalDecision::Granted { at_us: at },
            (0, 1 | 2) => GlobalDecision::Wait {
                retry_after: wait_for(at, now),
                ahead: why == 1,
            },
            (4, _) => GlobalDecision::TooCostly {
                most: u32::try_from(at).map_err(|_| PermitError::Answer("global"))?,
            },
            _ => return Err(PermitError::Answer("global")),
        };
        let outcome = GLOBAL_OUTCOMES[match decision {
            GlobalDecision::Granted { .. } => 0,
            GlobalDecision::Wait { ahead: true, .. } => 1,
            GlobalDecision::Wait { ahead: false, .. } => 2,
            GlobalDecision::TooCostly { .. } => 3,
        }];
        metrics::counter!("turnstile_global_permits_total", "outcome" => outcome).increment(1);
        Ok(decision)
    }

    /// Ends the call `call` of `cost` units that the global limit granted: answered at
    /// `answered_us` (Redis time, an upper bound), its units hold their place in the global log
    /// only until then; never sent (`None`), they leave it (see `lua/global_end.lua`). Without a
    /// global limit, nothing.
    pub(crate) async fn end_globally(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        answered_us: Option<i64>,
    ) -> Result<(), PermitError> {
        if self.limiter().global_limit.0.is_none() {
            return Ok(());
        }
        let end = GlobalEnd {
            log: self.keys.global_log(),
            call,
            cost: cost.units(),
            seller: &seller.key_tag(),
            answered_us: answered_us.unwrap_or(GlobalEnd::UNSENT),
        };
        let _: i64 = end
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Gives back the seller's grant `call` of `cost` units counted at `slot_us`, which will not
    /// be called (see `lua/release.lua`).
    async fn release(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        slot_us: i64,
        route: Option<&Route>,
    ) -> Result<(), PermitError> {
        let limiter = self.limiter();
        let release = Release {
            state: self.state_key(&limiter, seller),
            limit: self.keys.limit(seller),
            calls: self.keys.calls(seller),
            learned: self.learned_key(&limiter, seller),
            counts: limiter.limit.counts_arg(),
            windows: limiter.limit.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            algorithm: limiter.algorithm,
            call,
            cost: cost.units(),
            slot_us: slot_us.max(0),
            capacity: limiter.bucket_capacity,
            route: self.on_route(&limiter, seller, route),
        };
        let _: i64 = release
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Gives back `reservation` (of `cost` units, its message's cost, unless it says it was
    /// reserved for other units: [`Reservation::cost`]), whose message will not come back for
    /// it: its delayed copy was not published, or it went back to the broker without it.
    /// Whether it was still live (a redeemed, forfeited or given-back reservation is left as it
    /// is).
    pub async fn unreserve(
        &self,
        seller: &SellerId,
        reservation: &Reservation,
        cost: Cost,
    ) -> Result<bool, PermitError> {
        self.unreserve_on(seller, reservation, cost, None).await
    }

    /// As [`Self::unreserve`], for a message on `route`: its units leave the route's log too.
    pub async fn unreserve_on(
        &self,
        seller: &SellerId,
        reservation: &Reservation,
        cost: Cost,
        route: Option<&Route>,
    ) -> Result<bool, PermitError> {
        let limiter = self.limiter();
        let unreserve = Unreserve {
            state: self.state_key(&limiter, seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            algorithm: limiter.algorithm,
            token: &reservation.token,
            cost: reservation.cost.unwrap_or(cost).units(),
            slot_us: reservation.slot_us,
            held_counts: reservation.limits.counts_arg(),
            held_windows: reservation.limits.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            capacity: limiter.bucket_capacity,
            route: self.on_route(&limiter, seller, route),
        };
        let given_back: u8 = unreserve
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        if given_back == 1 {
            metrics::counter!("turnstile_reservations_released_total").increment(1);
        }
        Ok(given_back == 1)
    }

    /// The downstream reported that the call `call` (whose message asked `requested` units,
    /// granted `cost` units at `slot_us`, on `route` if any) cost `actual`: its units in the
    /// seller's windows (and the route's) become `actual`, for every replica, and the charge of
    /// its endpoint is learned for the next calls to ask for it ([`Self::cost_to_ask`]); when
    /// that charge rises, the seller's reservations on the endpoint made for fewer units are
    /// given back, so that their messages ask again at it (see `lua/recost.lua`). Other slots
    /// already reserved keep their place. sliding-window only (the others keep no units per
    /// call): elsewhere nothing changes. A call granted and charged its message's cost changes
    /// nothing and costs no Redis call.
    /// Returns the units added (> 0) or given back (< 0).
    #[allow(clippy::too_many_arguments)]
    pub async fn recost(
        &self,
        seller: &SellerId,
        call: &str,
        requested: Cost,
        cost: Cost,
        actual: u32,
        slot_us: i64,
        route: Option<&Route>,
    ) -> Result<i64, PermitError> {
        let limiter = self.limiter();
        if limiter.algorithm != Algorithm::SlidingWindow
            || (actual == cost.units() && cost == requested)
        {
            return Ok(0);
        }
        let recost = Recost {
            log: self.state_key(&limiter, seller),
            calls: self.keys.calls(seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            charge: self.keys.charge(seller, route.map(|route| &route.name)),
            route_log: route.map(|route| self.keys.route_log(seller, &route.name)),
            call,
            cost: cost.units(),
            actual: actual.min(Cost::MAX),
            slot_us: slot_us.max(0),
            requested: requested.min(cost).units(),
            memory_ms: CHARGE_MEMORY.as_millis() as u64,
        };
        let (changed, charge, given_back): Recosted = recost
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        if changed != 0 {
            let direction = if changed > 0 { "charged" } else { "refunded" };
            metrics::counter!("turnstile_cost_corrections_total", "direction" => direction)
                .increment(changed.unsigned_abs());
        }
        if given_back > 0 {
            tracing::debug!(
                charge,
                given_back,
                "a higher charge learned: reservations made for fewer units given back"
            );
            metrics::counter!("turnstile_reservations_released_total")
                .increment(u64::from(given_back));
        }
        Ok(changed)
    }

    /// The units a call of `requested` units on `route` (the default endpoint: `None`) asks for:
    /// with learned charges on ([`Self::with_learned_charges`]), the charge learned from its
    /// endpoint's answers when higher (see [`charged_cost`]: capped at the smallest COUNT of the
    /// configured stacks it takes: TURNSTILE_LIMIT, its route's, the global limit; a seller's
    /// override below it answers too costly, and the limiter asks again at the override's
    /// smallest COUNT); else, and under any algorithm but sliding-window, `requested`
    /// without reading anything. One read of the seller's key, through the batcher; the charge
    /// may rise between this read and the grant (an answer coming back meanwhile): that call
    /// is then granted at the lower cost, as one granted before the answer came.
    pub async fn cost_to_ask(
        &self,
        seller: &SellerId,
        requested: Cost,
        route: Option<&Route>,
    ) -> Result<Cost, PermitError> {
        let limiter = self.limiter();
        if !self.learns_charges || limiter.algorithm != Algorithm::SlidingWindow {
            return Ok(requested);
        }
        let key = self.keys.charge(seller, route.map(|route| &route.name));
        let mut get = redis::cmd("GET");
        get.arg(&key);
        let (value,): (Option<Vec<u8>>,) = self
            .run(Operation::commands(vec![get], key), When::Now)
            .await?;
        let most = [
            Some(&limiter.limit),
            route.map(|route| &route.limits),
            limiter.global_limit.0.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(Limits::min_count)
        .min()
        .unwrap_or(Cost::MAX);
        Ok(charged_cost(
            requested,
            parse_charge(value.as_deref()),
            most,
        ))
    }

    /// Moves a message to the state it is in now (see `lua/complete.lua`) and counts it there
    /// once: in its batch's progress and, when it becomes or stops being dead, in the dead
    /// letters by reason ([`Records::dead_now`]).
    pub async fn complete(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        completion: Completion<'_>,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        self.record(seller, message, batch, completion, None, ttl)
            .await
    }

    /// As [`Self::complete`] with [`Completion::Registered`], for the message registered by the
    /// call `answer` names: its answer is recorded in the same step (see [`Decision::Granted`])
    /// and, with adaptive limits, its acceptance by the downstream (see `note_accepted` in
    /// `lua/include/learned.lua`). The record rides along with other calls for up to [`record_delay`]:
    /// it must be written before the message is acked, and a replica that dies before writing
    /// it leaves the message to be called again (docs/performance.md, "Redis calls per message").
    pub async fn complete_call(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        answer: CallAnswer<'_>,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        self.record(
            seller,
            message,
            batch,
            Completion::Registered,
            Some(answer),
            ttl,
        )
        .await
    }

    async fn record(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        completion: Completion<'_>,
        answer: Option<CallAnswer<'_>>,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        let call = answer.map_or("", |a| a.call);
        // A call made with a pool unit (or one that took a block).
        let pooled = self
            .blocks
            .as_ref()
            .filter(|_| !call.is_empty())
            .and_then(|blocks| Some((blocks, blocks.recorded(call)?)));
        let answered = match (pooled, answer) {
            (Some((blocks, bounds)), Some(answer))
                if batch.is_none()
                    && answer.cost.units() == 1
                    && matches!(completion, Completion::Registered) =>
            {
                self.record_pooled(seller, message, answer, ttl, blocks, bounds)
                    .await?
            }
            _ => {
                self.record_by_script(seller, message, batch, completion, answer, ttl)
                    .await?
            }
        };
        // The tally is a shared key (another Cluster slot): a second step, only when a message
        // becomes or stops being dead. Its failure costs the count, not the transition.
        let tallied = match (answered.changed, completion) {
            (true, Completion::Dead(reason)) => self.records().tally_dead(reason, 1).await,
            (true, _) if !answered.was_dead_for.is_empty() => {
                self.records().tally_dead(&answered.was_dead_for, -1).await
            }
            _ => Ok(()),
        };
        if let Err(error) = tallied {
            metrics::counter!("turnstile_redis_errors_total").increment(1);
            tracing::warn!(%error, "the dead letters by reason were not updated");
        }
        Ok(Recorded {
            changed: answered.changed,
            raise_due: answered.raise_due,
            event: BatchEvent::parse(&answered.event),
        })
    }

    /// A message registered by a call of one unit made with a pool unit, in no upload: no
    /// upload to count, and no learned limit applied when its pool was made (so no raise to
    /// look for), so the state moves to `registered` by a plain SET ... GET (complete.lua's
    /// transitions read from what it was); the call's answer is written with others of the
    /// seller's (see `Blocks::answered`).
    async fn record_pooled(
        &self,
        seller: &SellerId,
        message: &MessageId,
        answer: CallAnswer<'_>,
        ttl: Duration,
        blocks: &Arc<Blocks>,
        bounds: block::LogBounds,
    ) -> Result<CompleteAnswer, PermitError> {
        let mut set = redis::cmd("SET");
        let state = match answer.result {
            Some(result) => format!("registered {result}"),
            None => "registered".to_owned(),
        };
        set.arg(self.keys.done(seller, message))
            .arg(state)
            .arg("PX")
            .arg(ttl.as_millis().max(1) as u64)
            .arg("GET");
        let (was,): (Option<String>,) = self
            .run(
                Operation::commands(vec![set], self.keys.done(seller, message)),
                When::Within(self.record_delay),
            )
            .await?;
        if let Some(at) = answer.answered_us {
            let full = blocks.answered(seller, answer.call, at, bounds);
            self.start_writing_answers(blocks);
            if let Some(full) = full {
                let store = self.clone();
                tokio::spawn(async move { store.write_answers(vec![full]).await });
            }
        }
        Ok(CompleteAnswer::registered_from(was.as_deref()))
    }

    /// A message's state moved by `lua/complete.lua`, with the answer of the call that
    /// registered it, if any (sent with others within [`record_delay`] then, else at once).
    async fn record_by_script(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        completion: Completion<'_>,
        answer: Option<CallAnswer<'_>>,
        ttl: Duration,
    ) -> Result<CompleteAnswer, PermitError> {
        let limiter = self.limiter();
        let (call, cost, answered_us) =
            answer.map_or(("", 0, None), |a| (a.call, a.cost.units(), a.answered_us));
        let result = answer.and_then(|a| a.result).unwrap_or("");
        let adaptive = (limiter.adaptive && !call.is_empty()).then(|| {
            (
                self.adaptive_keys(seller),
                calls::AdaptiveArgs {
                    counts: limiter.limit.counts_arg(),
                    windows: limiter.limit.windows_arg(),
                    guard_us: Terms::guard_arg_of(limiter.seller_guard()),
                },
            )
        });
        let complete = Complete {
            done: self.keys.done(seller, message),
            calls: self.keys.calls(seller),
            adaptive,
            batch: batch.map(|batch| CompleteBatch {
                progress: self.keys.batch(seller, batch.id),
                seller: seller.as_str(),
                batch: batch.id.as_str(),
                size: batch.size.map_or(0, BatchSize::get),
            }),
            ttl_ms: ttl.as_millis().max(1) as u64,
            outcome: completion.outcome(),
            reason: match completion {
                Completion::Dead(reason) => reason,
                _ => "",
            },
            call,
            answered_us: answered_us.unwrap_or(-1).max(-1),
            cost,
            result,
        };
        let when = if call.is_empty() {
            When::Now
        } else {
            When::Within(self.record_delay)
        };
        self.run(complete.operation(), when).await
    }

    /// Says that a registered message's result was published: its record keeps `registered`
    /// alone, with its TTL (a record gone meanwhile is not recreated). Rides along with the next
    /// call to Redis (within [`record_delay`]), as the records do: a plain SET, no round trip
    /// of its own while the replica is busy.
    pub async fn result_published(
        &self,
        seller: &SellerId,
        message: &MessageId,
    ) -> Result<(), PermitError> {
        let key = self.keys.done(seller, message);
        let mut set = redis::cmd("SET");
        set.arg(&key).arg("registered").arg("XX").arg("KEEPTTL");
        let _: (Option<String>,) = self
            .run(
                Operation::commands(vec![set], key),
                When::Within(self.record_delay),
            )
            .await?;
        Ok(())
    }

    /// The seller's keys of adaptive limits (see [`calls::AdaptiveKeys`]).
    fn adaptive_keys(&self, seller: &SellerId) -> calls::AdaptiveKeys {
        calls::AdaptiveKeys {
            learned: self.keys.learned(seller),
            accepted: self.keys.accepted(seller),
            limit: self.keys.limit(seller),
        }
    }

    /// Writes what calls made with pool units answered every [`WRITE_ANSWERS_EVERY`] (see
    /// [`Blocks::answered`]); started with the first such answer, it writes what is left and
    /// ends once only it holds the blocks (every clone of this store dropped).
    fn start_writing_answers(&self, blocks: &Arc<Blocks>) {
        if self.writing_answers.set(()).is_err() {
            return;
        }
        let store = self.clone();
        let blocks = blocks.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(WRITE_ANSWERS_EVERY);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                // This task's two handles (`store`'s and `blocks`) are the last ones left.
                let last = Arc::strong_count(&blocks) <= 2;
                store.write_answers(blocks.take_answers()).await;
                if last {
                    return;
                }
            }
        });
    }

    /// Writes what calls made with pool units answered, one plain step per seller: each call's
    /// end in the seller's calls comes forward to its answer (`ZADD XX LT`), and with adaptive
    /// limits the calls go into the accepted log, kept to as many entries and as long a life as
    /// `note_accepted` keeps it (entries older than its span are dropped by the next note
    /// through a script; `learn.lua` counts the log by time, so they are never counted). Until
    /// then, or if that fails, a call holds its place until its end.
    async fn write_answers(&self, answers: Vec<(SellerId, block::Answers)>) {
        let limiter = self.limiter();
        let throttled: Vec<SellerId> = if limiter.adaptive {
            let lately = self
                .throttled
                .lock()
                .expect("the throttled sellers' lock is never poisoned");
            answers
                .iter()
                .filter(|(seller, _)| {
                    lately
                        .get(seller)
                        .is_some_and(|at| at.elapsed() < THROTTLED_FOR)
                })
                .map(|(seller, _)| seller.clone())
                .collect()
        } else {
            Vec::new()
        };
        let writes = answers.into_iter().map(|(seller, answers)| {
            let mut end = redis::cmd("ZADD");
            end.arg(self.keys.calls(&seller)).arg("XX").arg("LT");
            for (at, call) in &answers.calls {
                end.arg(*at).arg(call);
            }
            let mut commands = vec![end];
            if limiter.adaptive {
                let accepted = self.keys.accepted(&seller);
                let mut note = redis::cmd("ZADD");
                note.arg(&accepted);
                for (at, call) in &answers.calls {
                    note.arg(*at).arg(call);
                }
                let mut by_number = redis::cmd("ZREMRANGEBYRANK");
                by_number
                    .arg(&accepted)
                    .arg(0)
                    .arg(-(2 * answers.bounds.most as i64 + answers.calls.len() as i64 + 1));
                let mut expire = redis::cmd("PEXPIRE");
                expire.arg(&accepted).arg(answers.bounds.span_us / 1000 + 1);
                commands.extend([note, by_number, expire]);
            }
            let operation = Operation::commands(commands, self.keys.calls(&seller));
            self.run::<redis::Value>(operation, When::Within(self.record_delay))
        });
        for result in futures::future::join_all(writes).await {
            if let Err(error) = result {
                tracing::debug!(%error, "answers of calls made with pool units were not written: each holds its place until its end");
            }
        }
        // A 429 learned before these answers were written may have lowered the seller's limit
        // below what the downstream accepted: they may correct it now.
        for seller in throttled {
            match self.learn(&seller, Lesson::Recovery).await {
                Ok(Some(change)) => {
                    tracing::info!(counts = %change.counts, why = change.why.label(), "the seller's learned limit changed");
                }
                Ok(None) => {}
                Err(error) => tracing::debug!(%error, "could not learn from the pool's answers"),
            }
        }
    }

    /// Writes at once what calls made with pool units answered (at shutdown).
    pub async fn write_pool_answers(&self) {
        if let Some(blocks) = &self.blocks {
            self.write_answers(blocks.take_answers()).await;
        }
    }

    /// Learns from what the downstream answered for the seller (see `lua/learn.lua`): a 429, a
    /// learned limit used in full for long enough, or rate-limit headers. When the counts that
    /// apply change, every slot reserved under the old ones is given back and announced, as
    /// for an operator's change, so the seller's whole backlog follows at once. Does nothing
    /// (and answers `None`) with adaptive limits off.
    pub async fn learn(
        &self,
        seller: &SellerId,
        lesson: Lesson,
    ) -> Result<Option<LearnedChange>, PermitError> {
        self.learn_at(seller, lesson, None).await
    }

    /// As [`Self::learn`], for a lesson of an answer that came back at `answered_us` (Redis
    /// time, an upper bound; see [`CallAnswer`]): a raise is judged and a quota's reset counted
    /// from then. What a 2xx's headers teach rides along with other calls (see
    /// [`record_delay`]); a 429's lesson and a raise are sent at once.
    pub async fn learn_at(
        &self,
        seller: &SellerId,
        lesson: Lesson,
        answered_us: Option<i64>,
    ) -> Result<Option<LearnedChange>, PermitError> {
        let limiter = self.limiter();
        if !limiter.adaptive {
            return Ok(None);
        }
        if matches!(lesson, Lesson::Throttled { .. }) && self.blocks.is_some() {
            let mut lately = self
                .throttled
                .lock()
                .expect("the throttled sellers' lock is never poisoned");
            if lately.len() >= MOST_THROTTLED {
                lately.clear();
            }
            lately.insert(seller.clone(), std::time::Instant::now());
        }
        let learn = self.learn_call(seller, lesson, answered_us);
        // A 429's lesson decides what the message does next, and a raise comes after its
        // record already rode along: both go at once. A 2xx's headers may ride along.
        let when = match lesson {
            Lesson::Throttled { .. } | Lesson::Recovery => When::Now,
            Lesson::Told(_) => When::Within(self.record_delay),
        };
        let LearnAnswer {
            changed,
            released,
            now_us: now,
            counts,
            why,
            configured,
            wake,
            lowered,
        } = self.run(learn.operation(), when).await?;
        if !changed {
            return Ok(None);
        }
        let why = Why::parse(&why).unwrap_or(Why::Header);
        metrics::counter!("turnstile_adaptive_changes_total", "why" => why.label()).increment(1);
        metrics::histogram!("turnstile_adaptive_learned_ratio")
            .record(learned_ratio(&counts, &configured));
        if wake {
            self.admin().announce(seller, released, now).await?;
        } else {
            metrics::counter!("turnstile_reservations_released_total").increment(released);
        }
        Ok(Some(LearnedChange {
            counts,
            why,
            lowered,
        }))
    }

    /// `lua/learn.lua`'s call for what `lesson` (its answer at `answered_us`) teaches about
    /// the seller's limit (see [`Learn`]).
    fn learn_call(&self, seller: &SellerId, lesson: Lesson, answered_us: Option<i64>) -> Learn {
        let limiter = self.limiter();
        let (event, granted_us, told) = match lesson {
            Lesson::Throttled { granted_us, told } => ("throttled", granted_us, told),
            Lesson::Recovery => ("recovery", answered_us.unwrap_or(0), None),
            Lesson::Told(told) => ("header", answered_us.unwrap_or(0), Some(told)),
        };
        let told = told.unwrap_or_default();
        let micros =
            |d: Option<Duration>| d.map_or(-1, |d| d.as_micros().min(i64::MAX as u128) as i64);
        let count = |n: Option<u64>| n.map_or(-1, |n| n.min(i64::MAX as u64) as i64);
        Learn {
            learned: self.keys.learned(seller),
            accepted: self.keys.accepted(seller),
            limit: self.keys.limit(seller),
            state: self.state_key(&limiter, seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            calls: self.keys.calls(seller),
            pool: self.keys.pool(seller),
            terms: Terms::from(&*limiter),
            min: limiter.adaptive_min.get(),
            event,
            granted_us: granted_us.max(0),
            told_limit: count(told.limit.filter(|&n| n >= 1)),
            told_window_us: micros(told.window.filter(|w| !w.is_zero())),
            told_remaining: count(told.remaining),
            told_reset_us: micros(told.reset),
            route_logs: self.route_logs(seller),
        }
    }

    /// Counts a message as dead-lettered for `reason`: its completion record (and its batch's
    /// progress) when it has a seller and an id (once, however many copies), else one more dead
    /// letter by reason.
    pub async fn count_dead(
        &self,
        identity: &crate::domain::Identity,
        batch_size: Option<BatchSize>,
        reason: &str,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        let batch = identity.batch_id.as_ref().map(|id| InBatch {
            id,
            size: batch_size,
        });
        match (&identity.seller_id, &identity.message_id) {
            (Some(seller), Some(message)) => {
                self.complete(seller, message, batch, Completion::Dead(reason), ttl)
                    .await
            }
            _ => self
                .records()
                .tally_dead(reason, 1)
                .await
                .map(|()| Recorded::default()),
        }
    }
}

/// How often a replica reads the reschedule log.
pub const RESCHEDULE_POLL: Duration = Duration::from_millis(250);

/// Reads the shared reschedule log every [`RESCHEDULE_POLL`] until `shutdown`, and sends each
/// new entry to `notices` (the messages this replica holds listen there). Starts from the Redis
/// time at its first read. Each read looks two seconds behind the newest entry seen,
/// so that an entry written late (its time is taken in the script, its log entry is written
/// just after) is not skipped; entries already sent are not sent again. A Redis error is logged
/// at debug level and the next poll tries again.
pub async fn watch_reschedules(
    store: PermitStore,
    notices: tokio::sync::broadcast::Sender<Rescheduled>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let admin = store.admin();
    let lookback = RESCHEDULE_LOOKBACK.as_micros() as i64;
    let mut cursor: Option<i64> = None;
    let mut sent: std::collections::HashSet<(String, i64)> = Default::default();
    let mut ticker = tokio::time::interval(RESCHEDULE_POLL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        let Some(since) = cursor else {
            match admin.redis_time_us().await {
                Ok(now) => cursor = Some(now),
                Err(error) => tracing::debug!(%error, "reading the reschedule log: no Redis time"),
            }
            continue;
        };
        match admin.rescheduled_since(since - lookback).await {
            Ok(entries) => {
                for entry in entries {
                    cursor = cursor.max(Some(entry.at_us));
                    if sent.insert((entry.seller.clone(), entry.at_us)) {
                        // The seller's terms changed: its block (granted under the old ones)
                        // is not used further.
                        if let Ok(seller) = SellerId::parse(&entry.seller) {
                            store.drop_block(&seller);
                        }
                        let _ = notices.send(entry);
                    }
                }
                let oldest = cursor.unwrap_or(since) - lookback;
                sent.retain(|(_, at)| *at > oldest);
            }
            Err(error) => tracing::debug!(%error, "reading the reschedule log failed"),
        }
    }
}

/// How far behind the newest entry seen the reschedule log is read again.
const RESCHEDULE_LOOKBACK: Duration = Duration::from_secs(2);

/// Every key matching a glob pattern: KEYS on each primary of a cluster, SCAN elsewhere. Meant
/// for operator commands and cleanup over a prefix, not for the hot path.
pub async fn keys_matching(conn: &RedisConn, pattern: &str) -> Result<Vec<String>, PermitError> {
    let mut conn = conn.clone();
    if let RedisConn::Cluster(_) = conn {
        return Ok(redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut conn)
            .await?);
    }
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// Bytes Redis uses for `key` (`MEMORY USAGE key SAMPLES 0`: exact), or `None` if it does not
/// exist. For benchmarks and tests that weigh the limiter's state.
pub async fn memory_usage(conn: &RedisConn, key: &str) -> Result<Option<u64>, PermitError> {
    Ok(redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut conn.clone())
        .await?)
}

/// Bytes Redis uses for every key that starts with `prefix:`.
pub async fn memory_of_prefix(conn: &RedisConn, prefix: &str) -> Result<u64, PermitError> {
    let mut total = 0;
    for key in keys_matching(conn, &Keyspace::new(prefix).everything()).await? {
        total += memory_usage(conn, &key).await?.unwrap_or(0);
    }
    Ok(total)
}

/// Deletes every key that starts with `prefix:` (for demos, benchmarks and tests that clean up
/// after themselves).
pub async fn delete_prefix(conn: &RedisConn, prefix: &str) -> anyhow::Result<()> {
    let mut unlink = conn.clone();
    for key in keys_matching(conn, &Keyspace::new(prefix).everything()).await? {
        let _: i64 = unlink.unlink(&key).await?;
    }
    Ok(())
}

/// A script's answer (a list), read by position; anything missing or of another type is the
/// script's bad answer.
struct Answer<'a> {
    values: &'a [redis::Value],
    script: &'static str,
}

impl Answer<'_> {
    fn bad(&self) -> PermitError {
        PermitError::Answer(self.script)
    }
    fn get<T: redis::FromRedisValue>(&self, i: usize) -> Result<T, PermitError> {
        self.values
            .get(i)
            .and_then(|v| redis::from_redis_value_ref(v).ok())
            .ok_or_else(|| self.bad())
    }
    fn int(&self, i: usize) -> Result<i64, PermitError> {
        self.get(i)
    }
    fn text(&self, i: usize) -> Result<String, PermitError> {
        self.get(i)
    }
    /// A count at `i` (a negative one reads as 0).
    fn count(&self, i: usize) -> Result<u64, PermitError> {
        Ok(self.int(i)?.max(0) as u64)
    }
    /// The stack at `i` (counts) and `i + 1` (windows).
    fn limits(&self, i: usize) -> Result<Limits, PermitError> {
        Limits::from_args(&self.text(i)?, &self.text(i + 1)?).ok_or_else(|| self.bad())
    }
}

/// A seller's limit override as the scripts write it (`"COUNTS WINDOWS_US"`); `None` if it is
/// not well-formed (the scripts ignore it then).
fn parse_override(raw: &str) -> Option<Limits> {
    let (counts, windows) = raw.split_once(' ')?;
    Limits::from_args(counts, windows)
}

/// What a pool claim reads: the seller's pause, override and the message's completion record,
/// Redis's TIME, and the unit popped from the pool with its end.
type PoolClaim = (Vec<Option<String>>, (i64, i64), Vec<String>);

#[cfg(test)]
mod tests {
    use super::{PermitError, Reservation, charged_cost, learned_ratio, parse_charge};
    use crate::domain::Cost;

    fn cost(units: u32) -> Cost {
        Cost::new(units).unwrap()
    }

    #[test]
    fn a_call_asks_the_charge_learned_when_higher_within_the_smallest_count() {
        assert_eq!(charged_cost(cost(1), None, 10), cost(1));
        assert_eq!(charged_cost(cost(1), Some(4), 10), cost(4));
        assert_eq!(charged_cost(cost(5), Some(4), 10), cost(5));
        // Capped at the smallest COUNT, never below the message's own cost.
        assert_eq!(charged_cost(cost(1), Some(40), 10), cost(10));
        assert_eq!(charged_cost(cost(12), Some(40), 10), cost(12));
        assert_eq!(charged_cost(cost(1), Some(0), 10), cost(1));
        assert_eq!(
            charged_cost(cost(1), Some(u32::MAX), u32::MAX),
            cost(10_000)
        );
    }

    #[test]
    fn a_learned_charge_is_read_as_untrusted() {
        assert_eq!(parse_charge(Some(b"4")), Some(4));
        assert_eq!(parse_charge(Some(b"10000")), Some(10_000));
        for bad in [
            &b""[..],
            b"0",
            b"10001",
            b"04",
            b"+4",
            b" 4",
            b"4.0",
            b"-1",
            b"\xff",
        ] {
            assert_eq!(parse_charge(Some(bad)), None, "{bad:?}");
        }
        assert_eq!(parse_charge(None), None);
    }

    #[test]
    fn a_reservation_names_its_units_only_when_they_are_not_its_messages_cost() {
        let plain = Reservation::decode("5/10/1000000/4/tok-1").unwrap();
        assert_eq!(plain.cost, None);
        assert_eq!(plain.encode(), "5/10/1000000/4/tok-1");
        let charged = Reservation {
            cost: Some(cost(4)),
            ..plain
        };
        assert_eq!(charged.encode(), "5/10/1000000/4/tok-1/4");
        assert_eq!(Reservation::decode(&charged.encode()), Some(charged));
        for bad in ["0", "10001", "04", "x", "", "4/4"] {
            let header = format!("5/10/1000000/4/tok-1/{bad}");
            assert_eq!(Reservation::decode(&header), None, "{header}");
        }
    }

    #[test]
    fn the_give_way_bounds_are_the_scripts() {
        let ranks = include_str!("../../lua/include/ranks.lua");
        for line in [
            format!("local GIVE_WAY_REACH = {}\n", super::GIVE_WAY_REACH),
            format!(
                "local GIVE_WAY_STEPS_PER_S = {}\n",
                super::GIVE_WAY_STEPS_PER_SECOND
            ),
            format!(
                "local GIVE_WAY_STEPS_SAVED = {}\n",
                super::GIVE_WAY_STEPS_SAVED
            ),
            format!("local AGING_US = {}\n", super::AGING.as_micros()),
        ] {
            assert!(ranks.contains(&line), "ranks.lua says {line}");
        }
    }

    /// The error Redis answers with `line` (a RESP error line, without `-` and CRLF).
    fn server_error(line: &str) -> PermitError {
        let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
        PermitError::Redis(value.extract_error().unwrap_err())
    }

    #[test]
    fn only_a_scripts_own_refusal_is_final_every_server_error_is_waited_out() {
        let refusal = "ERR turnstile: COST must be at most 10000 script: 1f2e, on @user_script:9.";
        assert!(!server_error(refusal).is_transient());
        assert!(
            !PermitError::Refused("ERR turnstile: TOKEN must be 1 to 64".into()).is_transient()
        );
        assert!(!PermitError::Answer("redeem").is_transient());
        for line in [
            "OOM command not allowed when used memory > 'maxmemory'.",
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "READONLY You can't write against a read only replica.",
            "BUSY Redis is busy running a script.",
            "LOADING Redis is loading the dataset in memory",
            "NOREPLICAS Not enough good replicas to write.",
            "CLUSTERDOWN The cluster is down",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "MASTERDOWN Link with MASTER is down",
            "ERR Error running script (call to f_1): @user_script:1: Unknown Redis command",
        ] {
            assert!(server_error(line).is_transient(), "{line}");
            // The same error caught inside a batch (see lua/batch.lua).
            assert!(PermitError::Refused(line.into()).is_transient(), "{line}");
        }
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(PermitError::Redis(io.into()).is_transient());
    }

    #[test]
    fn the_learned_ratio_is_the_lowest_of_the_stack() {
        assert_eq!(learned_ratio("5", "20"), 0.25);
        assert_eq!(learned_ratio("6,20", "6,40"), 0.5);
        assert_eq!(learned_ratio("20", "20"), 1.0);
        assert_eq!(learned_ratio("", "20"), 1.0);
    }
}
