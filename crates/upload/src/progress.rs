//! Batch progress and when a batch will be done, as `turnstile status`, the dashboard and the
//! HTTP API (`/api/batches/{id}`, `/api/sellers/{id}`) all give it.
//!
//! The consume side counts each batch in Redis (`lua/batch_seen.lua` when a replica first sees
//! one of its messages, `lua/complete.lua` as each is registered or dead-lettered, once per
//! message through retries, replays and redeliveries) and notes its messages waiting out a
//! retry's backoff (`lua/retry.lua`); this module reads those, and the seller's limits, and
//! computes the ETA ([`eta`]). Keys: `turnstile_core::permit::keys`.
//!
//! Admission ([`Admission`]): before publishing, an upload service asks when N more rows of a
//! seller published now would all be registered, behind the seller's backlog, and whether that
//! is before a deadline: the same ETA, over the backlog and those rows.

use std::cmp::Reverse;
use std::time::Duration;

use serde::Serialize;
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, UtcOffset};
use turnstile_core::domain::{BatchId, SellerId};
use turnstile_core::permit::{Admin, GlobalUsage, PermitError, Records, RetryDue, Usage, Why};

/// How far one batch is.
pub use turnstile_core::permit::UploadProgress as Progress;

/// How long until `units` more units of a seller are registered (its waiting units, granted
/// ones among them): for each limit of its effective stack (override or configured, with
/// learned counts), the greedy schedule of the units its window holds for calls already
/// answered (`used`, less the calls in flight and the reserved slots due and not redeemed
/// yet), then `units`: `(ceil((answered + units) / COUNT) - 1)` periods of window + guard
/// (the limiter frees a unit that long after it was taken), counted from when the oldest unit
/// in its window was taken; not before its pause ends and the stack drains `units` from there;
/// and not faster than its weighted share of the global limit (`global_rate`, units per
/// second), when there is one. A unit granted and not answered yet is in the window and still
/// waiting: it is counted once. Messages among `units` that wait out a retry's backoff
/// (`retries`, not due yet) are called no earlier than their retry: not before each retry is
/// due and the units of the retries due then or later have drained from there, as from a
/// pause's end (at most `units` of them).
pub fn eta(usage: &Usage, global_rate: Option<f64>, units: u64, retries: &[RetryDue]) -> Duration {
    if units == 0 {
        return Duration::ZERO;
    }
    let idle = |n: u64| {
        usage
            .per_limit
            .iter()
            .map(|limit| drain(limit, n))
            .max()
            .unwrap_or_default()
    };
    let shared = |n: u64| match global_rate.filter(|r| *r > 0.0) {
        Some(rate) => Duration::from_secs_f64(n.saturating_sub(1) as f64 / rate),
        None => Duration::ZERO,
    };
    let mut eta = Duration::ZERO;
    for limit in &usage.per_limit {
        let done = limit
            .used
            .saturating_sub(usage.in_flight + limit.due_reserved);
        let through = drain(limit, done + units).saturating_sub(limit.oldest_age);
        eta = eta.max(through);
    }
    if !usage.paused_for.is_zero() {
        eta = eta.max(usage.paused_for + idle(units));
    }
    eta = eta.max(shared(units));
    let mut latest_first: Vec<&RetryDue> = retries.iter().collect();
    latest_first.sort_by_key(|r| Reverse(r.due_in));
    let mut from_then = 0;
    for retry in latest_first {
        from_then = (from_then + retry.units.max(1)).min(units);
        eta = eta.max(retry.due_in + idle(from_then).max(shared(from_then)));
    }
    eta
}

/// The greedy schedule of `n` units through one limit from an idle start: `(ceil(n / COUNT) -
/// 1)` periods of window + guard.
fn drain(limit: &turnstile_core::permit::LimitUsage, n: u64) -> Duration {
    let periods = n.div_ceil(u64::from(limit.limit.count())).saturating_sub(1);
    (limit.limit.window() + limit.guard) * u32::try_from(periods).unwrap_or(u32::MAX)
}

/// What an ETA rests on: the seller's limits, or the pace its work is actually getting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Basis {
    /// The seller's limits (with its pause, learned limit, global share and retries): as fast
    /// as they allow, the pace observed being no slower, or not known yet.
    Limits,
    /// The pace the seller's open batches were registered at so far ([`observed_pace`]),
    /// slower than its limits allow: a slow downstream, too few free workers, an API whose
    /// real limit is lower, a replica cut off.
    ObservedPace,
}

/// The least a seller's open batches must have had counted before their pace is observed:
/// this many units, and [`OBSERVED_FROM`] of their rows.
pub const OBSERVED_AFTER_UNITS: u64 = 10;

/// The least share of their rows a seller's open batches must have had counted before their
/// pace is observed.
pub const OBSERVED_FROM: f64 = 0.05;

/// The pace (units per second) the seller's open batches are getting, read at `now_ms`: the
/// faster of their pace so far ([`pace_so_far`]) and the seller's calls in its longest window
/// now ([`recent_pace`]), so that a slow start (pauses while a lower real limit was learned)
/// does not weigh on the pace once it picked up. `None` until the pace so far is known.
///
/// While the seller's limit is learned below its configured one, its pace so far is not the
/// pace: it includes the time the API refused calls until the lower limit was learned, and the
/// learned limit already is what the API allows.
pub fn observed_pace(batches: &[Progress], usage: &Usage, now_ms: u64) -> Option<f64> {
    let so_far = pace_so_far(batches, now_ms)?;
    let recent = recent_pace(usage);
    if usage.learned_why.is_some() {
        return recent;
    }
    Some(recent.map_or(so_far, |recent| recent.max(so_far)))
}

/// The least calls in a seller's window for [`recent_pace`] to say anything.
const RECENT_AFTER_CALLS: u64 = 5;

/// The seller's units registered per second over its longest window now, one unit fewer than
/// counted over the time since the oldest of them (the gaps between them); `None` with fewer
/// than [`RECENT_AFTER_CALLS`], when they span less than half the window (a burst after a pause
/// says little of the pace), or for an algorithm that keeps no such log (GCRA, token bucket).
/// With adaptive limits on, the units the downstream accepted (its accepted log): a call it
/// refused with a 429 is no registration, and while a lower limit is being learned the calls
/// run ahead of what registers. Without, the answered calls the window holds (not those in
/// flight or reserved).
pub fn recent_pace(usage: &Usage) -> Option<f64> {
    let longest = usage.per_limit.iter().max_by_key(|l| l.limit.window())?;
    let (counted, age) = match usage.accepted {
        Some(accepted) => (accepted.units, accepted.oldest_age),
        None => (
            longest
                .used
                .saturating_sub(usage.in_flight + longest.due_reserved),
            longest.oldest_age,
        ),
    };
    let span = age.as_secs_f64();
    let covers = span >= longest.limit.window().as_secs_f64() / 2.0;
    (counted >= RECENT_AFTER_CALLS && covers).then(|| (counted - 1) as f64 / span)
}

/// The pace (units per second) at which the seller's open batches (`batches` with rows
/// waiting) had their units counted so far, read at `now_ms`: their counted units over the
/// time since the first of them was first seen; `None` until they have [`OBSERVED_AFTER_UNITS`]
/// units and [`OBSERVED_FROM`] of their rows counted, over at least a second. A batch waiting
/// behind the seller's earlier work counts its units too (none, until its turn), so the pace
/// is the seller's, not one batch's.
pub fn pace_so_far(batches: &[Progress], now_ms: u64) -> Option<f64> {
    let open: Vec<&Progress> = batches
        .iter()
        .filter(|b| b.waiting().is_some_and(|w| w > 0))
        .collect();
    let since = open.iter().filter_map(|b| b.first_ms).min()?;
    let units: u64 = open
        .iter()
        .map(|b| b.done_units.max(b.registered + b.dead))
        .sum();
    let rows: u64 = open.iter().filter_map(|b| b.total).sum();
    let done: u64 = open.iter().map(|b| b.registered + b.dead).sum();
    let elapsed = now_ms.saturating_sub(since) as f64 / 1000.0;
    let enough = units >= OBSERVED_AFTER_UNITS && done as f64 >= OBSERVED_FROM * rows as f64;
    (enough && elapsed >= 1.0).then(|| units as f64 / elapsed)
}

/// How much later than the limits' ETA the observed pace's must be to be taken (and at least
/// one window + guard later): a seller that keeps up with its limits reads a little slower
/// between two windows' grants, and the limits' schedule is then the better estimate.
pub const OBSERVED_MARGIN: f64 = 1.1;

/// An ETA from the limits (`by_limits`) and, once observed, the seller's pace (`pace`, units
/// per second) for `units`: the observed pace's when it is later than the limits' by more than
/// [`OBSERVED_MARGIN`] and by more than `window` (the seller's longest window + guard), else
/// the limits'; and which it is.
pub fn honest_eta(
    by_limits: Duration,
    pace: Option<f64>,
    units: u64,
    window: Duration,
) -> (Duration, Basis) {
    let observed = at_pace(pace, units);
    let later_than = by_limits.mul_f64(OBSERVED_MARGIN).max(by_limits + window);
    match observed {
        Some(observed) if observed > later_than => (observed, Basis::ObservedPace),
        _ => (by_limits, Basis::Limits),
    }
}

/// The ETA of `units` of a seller's work: (the estimate, the soonest its limits allow, what
/// the estimate rests on). Normally [`honest_eta`] over the limits' schedule ([`eta`]). While
/// a limit is learned below the configured one from the API's answers (its 429s, then its
/// acceptance; not one its rate-limit headers stated), that limit is a guess they keep revising
/// (lowered on a 429, raised once it accepts more), so the pace it accepts now says the finish
/// either way, never sooner than the configured limits allow.
fn estimate(
    usage: &Usage,
    global_rate: Option<f64>,
    units: u64,
    retries: &[RetryDue],
    pace: Option<f64>,
) -> (Duration, Duration, Basis) {
    let by_limits = eta(usage, global_rate, units, retries);
    let guessed = matches!(usage.learned_why, Some(Why::Throttled | Why::Recovery));
    if guessed && let Some(observed) = at_pace(pace, units) {
        let configured = eta(&with_configured_limits(usage), global_rate, units, retries);
        return (observed.max(configured), by_limits, Basis::ObservedPace);
    }
    let (honest, basis) = honest_eta(by_limits, pace, units, longest_window(usage));
    (honest, by_limits, basis)
}

/// How long `units` take at `pace` units per second, when there is a pace.
fn at_pace(pace: Option<f64>, units: u64) -> Option<Duration> {
    pace.filter(|p| *p > 0.0)
        .and_then(|p| Duration::try_from_secs_f64(units as f64 / p).ok())
}

/// `usage` under the seller's configured limits instead of the learned ones (the same windows,
/// the configured counts).
fn with_configured_limits(usage: &Usage) -> Usage {
    let mut configured = usage.clone();
    for (limit, count) in configured.per_limit.iter_mut().zip(usage.configured.iter()) {
        limit.limit = *count;
        limit.capacity = u64::from(count.count());
    }
    configured
}

/// The longest window + guard of the seller's stack now.
fn longest_window(usage: &Usage) -> Duration {
    usage
        .per_limit
        .iter()
        .map(|l| l.limit.window() + l.guard)
        .max()
        .unwrap_or_default()
}

/// A seller's share of the global limit, in units per second: the global stack's slowest
/// long-run rate, shared by weight among the sellers competing now (all of it when none
/// competes).
pub fn global_rate(global: &GlobalUsage, seller: &SellerId) -> f64 {
    let rate = global
        .limit
        .iter()
        .map(|l| f64::from(l.count()) / l.window().as_secs_f64())
        .fold(f64::INFINITY, f64::min);
    if global.present <= 1 || global.weights <= 0.0 {
        return rate;
    }
    let tag = seller.key_tag();
    let weight = global
        .shares
        .iter()
        .find(|s| s.seller == tag)
        .map_or(1.0, |s| f64::from(s.weight.max(1)));
    rate * (weight / global.weights.max(weight)).min(1.0)
}

/// A batch as the API and the tools report it.
#[derive(Clone, Debug, Serialize)]
pub struct BatchReport {
    pub batch_id: String,
    pub seller_id: String,
    /// How many messages it has in all (null until a message gave `batch_size`).
    pub total: Option<u64>,
    pub registered: u64,
    /// Dead-lettered and not replayed, by reason.
    pub dead: std::collections::BTreeMap<String, u64>,
    /// Neither registered nor dead (null while the total is unknown).
    pub waiting: Option<u64>,
    pub done: bool,
    /// Seconds until its last message is expected to be registered (0 when done; null while
    /// its total is unknown): the later of what its seller's limits allow and what the pace
    /// observed so far gives (see `eta_basis`).
    pub eta_s: Option<f64>,
    /// The soonest its seller's limits allow (null while its total is unknown): with `eta_s`,
    /// the range the finish is expected in.
    pub eta_limits_s: Option<f64>,
    /// What `eta_s` rests on: `limits` or `observed-pace` (see [`Basis`]).
    pub eta_basis: Basis,
    /// The pace its seller's open batches are registered at, units per second, once observed
    /// (see [`observed_pace`]).
    pub observed_per_s: Option<f64>,
    /// When it was read (Unix ms): `eta_s` counts from then.
    pub now_ms: u64,
    /// Its waiting messages whose retry is not due yet (as its seller's retries keep them:
    /// the 256 due last).
    pub retrying: u64,
    /// Messages beyond its total (its messages outnumber its `batch_size`).
    pub extra: u64,
    /// Another `batch_size` a message of it gave than its total, if any did.
    pub other_size: Option<u64>,
    /// Every seller whose messages named this batch id, when more than this one did.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub also_sellers: Vec<String>,
    pub first_seen_ms: Option<u64>,
    pub last_ms: Option<u64>,
    pub completed_ms: Option<u64>,
    /// Set when it has rows waiting that nothing explains (see [`stalled`]): it will not
    /// complete without them.
    pub stalled: Option<Stalled>,
}

/// A batch that cannot complete as things stand: rows waiting, none counted for long, and
/// nothing in the seller's state (a pause, retries waiting, work ahead) that explains it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Stalled {
    /// Since when neither it nor an earlier batch of its seller had a row counted (Unix ms).
    pub since_ms: u64,
    /// What it waits for and what may have happened to it, in words.
    pub why: String,
}

/// The least time a batch with rows waiting sees none counted (of it or of its seller's
/// earlier batches) before it is reported stalled; two of the seller's longest windows when
/// that is longer (a seller limited to a few calls an hour counts rarely).
pub const STALLED_AFTER: Duration = Duration::from_secs(10 * 60);

/// Whether batch `b` is stalled at `now_ms`: rows waiting, its seller neither paused nor with
/// any of the batch's rows waiting out a retry (`retrying`), and no row of it or of the
/// seller's batches first seen before it counted since `moving_ms` (the latest such count, or
/// its first sight) for [`STALLED_AFTER`] or two of the longest windows (`longest`) of the
/// seller's limits, whichever is longer. A batch waiting behind its seller's earlier work is
/// not stalled while that work moves.
pub fn stalled(
    b: &Progress,
    moving_ms: u64,
    now_ms: u64,
    paused: bool,
    retrying: u64,
    longest: Duration,
) -> Option<Stalled> {
    let waiting = b.waiting().filter(|w| *w > 0)?;
    if paused || retrying > 0 {
        return None;
    }
    let still = Duration::from_millis(now_ms.saturating_sub(moving_ms));
    if still < STALLED_AFTER.max(longest * 2) {
        return None;
    }
    let total = b.total.unwrap_or(0);
    let sizes = match b.other_size {
        Some(other) => {
            format!("; its messages gave different batch_size values ({total} and {other})")
        }
        None => String::new(),
    };
    Some(Stalled {
        since_ms: moving_ms,
        why: format!(
            "{waiting} of {total} rows not counted, none for {} min, with the seller neither \
             paused nor retrying: fewer rows were published than batch_size, or rows were \
             lost before turnstile counted them (a message TTL, a purged queue), or no replica \
             is consuming{sizes}",
            still.as_secs() / 60
        ),
    })
}
/// A seller's backlog and limits as the API and the tools report them.
#[derive(Clone, Debug, Serialize)]
pub struct SellerReport {
    pub seller_id: String,
    /// Waiting messages, and their units, over its batches with a known total.
    pub backlog: u64,
    pub backlog_units: u64,
    /// The limits: the stack in force, the configured one (the override or the default), the
    /// learned one when adaptive limits hold it lower, and the override if set.
    pub effective: String,
    pub configured: String,
    pub learned: Option<String>,
    pub overridden: bool,
    /// Seconds the seller stays paused (0 when not paused).
    pub paused_for_s: f64,
    /// Its share of the global limit, units per second, when there is one.
    pub global_share_per_s: Option<f64>,
    /// Seconds until its whole backlog is expected to be registered: the later of what its
    /// limits allow (`eta_limits_s`) and what its observed pace gives (see `eta_basis`).
    pub eta_s: f64,
    pub eta_limits_s: f64,
    pub eta_basis: Basis,
    /// The pace its open batches are registered at, units per second, once observed.
    pub observed_per_s: Option<f64>,
    /// When it was read (Unix ms).
    pub now_ms: u64,
    /// Messages of its backlog whose retry is not due yet (at most the 256 due last).
    pub retrying: u64,
    pub batches: Vec<BatchReport>,
    /// How much of each of its limits is taken now, as read for the ETA.
    #[serde(skip)]
    pub usage: Usage,
    /// Its backlog's messages waiting out a retry's backoff, as read for the ETA.
    #[serde(skip)]
    pub backlog_retries: Vec<RetryDue>,
}

impl SellerReport {
    /// How long until `units` more units published now are registered, behind its whole
    /// backlog: [`eta`] over its backlog's units and those, with its limits, pause, share of
    /// the global limit and retries waiting as read for `eta_s` (which is `eta_with(0)`).
    pub fn eta_with(&self, units: u64) -> Duration {
        self.eta_and_basis(units).0
    }

    /// [`Self::eta_with`], with what it rests on: the later of what the limits allow and what
    /// the pace observed so far gives ([`honest_eta`]).
    pub fn eta_and_basis(&self, units: u64) -> (Duration, Basis) {
        let units = self.backlog_units.saturating_add(units);
        let (eta, _, basis) = estimate(
            &self.usage,
            self.global_share_per_s,
            units,
            &self.backlog_retries,
            self.observed_per_s,
        );
        (eta, basis)
    }

    /// The answer to `question` about this seller at `now`: when `question.rows` more rows (of
    /// one unit each, the default cost) published now are expected to be registered, and
    /// whether that is by its deadline.
    pub fn admission(&self, question: &Question, now: OffsetDateTime) -> Admission {
        let (finish_in, basis) = self.eta_and_basis(question.rows);
        let finish_at = later(now, finish_in);
        Admission {
            rows: question.rows,
            finish_at: rfc3339_millis(finish_at),
            finish_in_s: finish_in.as_secs_f64(),
            basis,
            observed_per_s: self.observed_per_s,
            deadline: question.deadline.map(rfc3339),
            meets_deadline: question.deadline.map(|deadline| finish_at <= deadline),
        }
    }
}

/// The most rows one admission question may ask about.
pub const MAX_ROWS: u64 = 1_000_000;

/// What an upload service asks before publishing: can `rows` more rows of a seller, published
/// now, all be registered by `deadline`?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Question {
    /// How many rows (1 to [`MAX_ROWS`]; 1 when not given).
    pub rows: u64,
    pub deadline: Option<OffsetDateTime>,
}

impl Question {
    /// The question a request's `rows` and `deadline` parameters ask, `None` when it gives
    /// neither; a bad one is refused naming the parameter and what it expects.
    pub fn from_params(rows: Option<&str>, deadline: Option<&str>) -> Result<Option<Self>, String> {
        if rows.is_none() && deadline.is_none() {
            return Ok(None);
        }
        let rows = match rows {
            Some(rows) => parse_rows(rows).map_err(|why| format!("rows: {why}"))?,
            None => 1,
        };
        let deadline = match deadline {
            Some(deadline) => {
                Some(parse_deadline(deadline).map_err(|why| format!("deadline: {why}"))?)
            }
            None => None,
        };
        Ok(Some(Self { rows, deadline }))
    }
}

/// Parses a number of rows: a whole number from 1 to [`MAX_ROWS`].
pub fn parse_rows(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(rows) if (1..=MAX_ROWS).contains(&rows) => Ok(rows),
        _ => Err(format!(
            "expected a whole number of rows from 1 to {MAX_ROWS}"
        )),
    }
}

/// Parses a deadline: an RFC 3339 date-time with any offset.
pub fn parse_deadline(text: &str) -> Result<OffsetDateTime, String> {
    OffsetDateTime::parse(text.trim(), &Rfc3339)
        .map_err(|_| "expected an RFC 3339 date-time such as 2026-11-26T10:00:00+09:00".to_owned())
}

/// `at` as RFC 3339 in UTC (`…Z`), its fraction of a second kept.
pub fn rfc3339(at: OffsetDateTime) -> String {
    at.to_offset(UtcOffset::UTC)
        .format(&Rfc3339)
        .unwrap_or_else(|_| at.unix_timestamp().to_string())
}

/// `at` as RFC 3339 in UTC, to the millisecond.
fn rfc3339_millis(at: OffsetDateTime) -> String {
    rfc3339(at.replace_millisecond(at.millisecond()).unwrap_or(at))
}

/// The answer to a [`Question`] about a seller: an estimate from the state read now (its
/// backlog, limits, pause, learned limit and retries), not a promise; what binds is each
/// message's own `deadline`, past which it is dead-lettered as `expired`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Admission {
    pub rows: u64,
    /// When the last of the rows, published now behind the seller's backlog, is expected to
    /// be registered (RFC 3339, UTC).
    pub finish_at: String,
    /// The same, in seconds from now.
    pub finish_in_s: f64,
    /// What it rests on: the seller's limits, or its observed pace when that is slower (the
    /// seller's work is registered slower than its limits allow).
    pub basis: Basis,
    /// The seller's observed pace, units per second, once known.
    pub observed_per_s: Option<f64>,
    /// The deadline asked about, in UTC (absent when none was).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    /// Whether `finish_at` is at or before the deadline (absent without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub meets_deadline: Option<bool>,
}

impl BatchReport {
    /// Whether the batch is expected to be done by `deadline`, asked at `now`: a done batch
    /// if it completed by then (its last message counted, when its completion is not known);
    /// a waiting one if its ETA ends by then; unknown (`None`) while its total is.
    pub fn meets(&self, deadline: OffsetDateTime, now: OffsetDateTime) -> Option<bool> {
        if self.done {
            let finished = self.completed_ms.or(self.last_ms).map_or(now, |ms| {
                OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap_or(now)
            });
            return Some(finished <= deadline);
        }
        let eta = Duration::try_from_secs_f64(self.eta_s?).unwrap_or(Duration::MAX);
        Some(later(now, eta) <= deadline)
    }
}

/// `wait` after `now`; the last moment RFC 3339 can write (9999-12-31) when that is later.
fn later(now: OffsetDateTime, wait: Duration) -> OffsetDateTime {
    time::Duration::try_from(wait)
        .ok()
        .and_then(|wait| now.checked_add(wait))
        .filter(|at| at.year() <= 9999)
        .unwrap_or_else(|| OffsetDateTime::new_utc(time::Date::MAX, time::Time::MAX))
}

/// Reports a seller's batches (`batches`, as the store holds them) with an ETA each: a batch is
/// done, at the latest, when the seller's waiting work first seen before it and its own are
/// (a seller's messages are served in arrival order, its batches' interleaved), and not before
/// its own messages waiting out a retry's backoff (`retries`, the seller's) are due and drained:
/// a message coming back from a retry asks behind the seller's work already reserved, so
/// another batch's retries do not hold it up. The seller's ETA counts the retries of all its
/// batches still waiting.
///
/// A batch is marked [`stalled`] at `now_ms` (Unix ms) when neither it nor an earlier batch of
/// the seller had a row counted for long, with nothing to explain it.
pub fn seller_report(
    seller: &SellerId,
    mut batches: Vec<Progress>,
    usage: Usage,
    global_rate: Option<f64>,
    retries: &[RetryDue],
    now_ms: u64,
) -> SellerReport {
    batches.sort_by_key(|b| (b.first_ms, b.batch.clone()));
    let longest = longest_window(&usage);
    let paused = !usage.paused_for.is_zero();
    let pace = observed_pace(&batches, &usage, now_ms);
    let mut ahead = 0;
    let mut moving_ms = 0;
    let mut reports = Vec::new();
    let mut backlog_retries = Vec::new();
    let mut retrying = 0;
    for b in &batches {
        let counted_ms = b.last_ms.or(b.first_ms).unwrap_or(now_ms);
        moving_ms = moving_ms.max(counted_ms);
        ahead += b.waiting_units();
        let waiting = b.waiting();
        let own: Vec<RetryDue> = match waiting {
            Some(1..) => retries
                .iter()
                .filter(|r| r.batch == b.batch)
                .cloned()
                .collect(),
            _ => Vec::new(),
        };
        let (eta_s, eta_limits_s, basis) = match waiting {
            None => (None, None, Basis::Limits),
            Some(0) => (Some(0.0), Some(0.0), Basis::Limits),
            Some(_) => {
                let (honest, by_limits, basis) = estimate(&usage, global_rate, ahead, &own, pace);
                (
                    Some(honest.as_secs_f64()),
                    Some(by_limits.as_secs_f64()),
                    basis,
                )
            }
        };
        let own_retrying = (own.len() as u64).min(waiting.unwrap_or(0));
        retrying += own_retrying;
        let mut report = batch_report(b, eta_s, own_retrying);
        report.eta_limits_s = eta_limits_s;
        report.eta_basis = basis;
        report.observed_per_s = pace;
        report.now_ms = now_ms;
        report.stalled = stalled(b, moving_ms, now_ms, paused, own_retrying, longest);
        reports.push(report);
        backlog_retries.extend(own);
    }
    let backlog = batches.iter().filter_map(Progress::waiting).sum();
    let (seller_honest, seller_by_limits, seller_basis) =
        estimate(&usage, global_rate, ahead, &backlog_retries, pace);
    SellerReport {
        seller_id: seller.as_str().to_owned(),
        backlog,
        backlog_units: ahead,
        effective: usage.limit.to_string(),
        configured: usage.configured.to_string(),
        learned: usage.learned_why.map(|_| usage.limit.to_string()),
        overridden: usage.overridden,
        paused_for_s: usage.paused_for.as_secs_f64(),
        global_share_per_s: global_rate,
        eta_s: seller_honest.as_secs_f64(),
        eta_limits_s: seller_by_limits.as_secs_f64(),
        eta_basis: seller_basis,
        observed_per_s: pace,
        now_ms,
        retrying,
        batches: reports,
        usage,
        backlog_retries,
    }
}

fn batch_report(b: &Progress, eta_s: Option<f64>, retrying: u64) -> BatchReport {
    BatchReport {
        batch_id: b.batch.clone(),
        seller_id: b.seller.clone(),
        total: b.total,
        registered: b.registered,
        dead: b.dead_by_reason.clone(),
        waiting: b.waiting(),
        done: b.done(),
        eta_s,
        eta_limits_s: eta_s,
        eta_basis: Basis::Limits,
        observed_per_s: None,
        now_ms: 0,
        retrying,
        extra: b.extra(),
        other_size: b.other_size,
        also_sellers: Vec::new(),
        first_seen_ms: b.first_ms,
        last_ms: b.last_ms,
        completed_ms: b.completed_ms,
        stalled: None,
    }
}

/// A seller's report, read now: its batches and retries waiting (from `records`), usage and
/// share of the global limit (from `admin`).
pub async fn read_seller(
    admin: &Admin,
    records: &Records,
    seller: &SellerId,
) -> Result<SellerReport, PermitError> {
    read_seller_at(admin, records, seller, turnstile_core::domain::unix_ms()).await
}

/// [`read_seller`], its batches judged [`stalled`] or not as at `now_ms` (Unix ms).
pub async fn read_seller_at(
    admin: &Admin,
    records: &Records,
    seller: &SellerId,
    now_ms: u64,
) -> Result<SellerReport, PermitError> {
    // The window first: a message registered between the two reads is then missing from both
    // (at most an early ETA by a part of a window), never counted in both (a whole window late).
    let usage = admin.usage(seller).await?;
    let batches = records.seller_batches(seller).await?;
    let retries = records.retries_due(seller).await?;
    let global = admin.global_usage().await?;
    let rate = global.as_ref().map(|g| global_rate(g, seller));
    Ok(seller_report(
        seller, batches, usage, rate, &retries, now_ms,
    ))
}

/// A batch's report, read now (`None` if no seller's messages named it, or it expired). A batch
/// id used by several sellers is reported as the first seen of them, naming the others in
/// `also_sellers`.
pub async fn read_batch(
    admin: &Admin,
    records: &Records,
    batch: &BatchId,
) -> Result<Option<BatchReport>, PermitError> {
    let named = records.batches_named(batch).await?;
    let Some(first) = named.first() else {
        return Ok(None);
    };
    let Ok(seller) = SellerId::parse(&first.seller) else {
        return Ok(None);
    };
    let report = read_seller(admin, records, &seller).await?;
    let mut found = report
        .batches
        .into_iter()
        .find(|b| b.batch_id == batch.as_str())
        .unwrap_or_else(|| batch_report(first, None, 0));
    found.also_sellers = named.iter().skip(1).map(|p| p.seller.clone()).collect();
    Ok(Some(found))
}

/// The `n` most recently first seen batches that are still recorded, newest first.
pub async fn recent(records: &Records, n: usize) -> Result<Vec<Progress>, PermitError> {
    records.recent_uploads(n).await
}

/// Progress of every batch recorded under the key prefix, or a seller's, or one batch.
pub async fn list(
    records: &Records,
    seller: Option<&SellerId>,
    batch: Option<&BatchId>,
) -> anyhow::Result<Vec<Progress>> {
    let mut out = match (seller, batch) {
        (Some(seller), None) => records.seller_batches(seller).await?,
        (None, Some(batch)) => records.batches_named(batch).await?,
        _ => records.uploads(seller, batch).await?,
    };
    out.sort_by(|a, b| {
        (a.seller.as_str(), a.batch.as_str()).cmp(&(b.seller.as_str(), b.batch.as_str()))
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_core::config::Limits;
    use turnstile_core::permit::LimitUsage;

    /// A seller's usage, without guard (the tests' windows are exact), nothing in flight.
    fn usage(limit: &str, used: u64, oldest_age: Duration) -> Usage {
        let limits: Limits = limit.parse().unwrap();
        let per_limit: Vec<LimitUsage> = limits
            .iter()
            .map(|l| LimitUsage {
                limit: *l,
                used,
                capacity: u64::from(l.count()),
                ahead: 0,
                oldest_age,
                guard: Duration::ZERO,
                due_reserved: 0,
            })
            .collect();
        Usage {
            used,
            capacity: per_limit[0].capacity,
            ahead: 0,
            limit: limits.clone(),
            per_limit,
            binding: 0,
            overridden: false,
            paused_for: Duration::ZERO,
            in_flight: 0,
            configured: limits,
            learned_why: None,
            shadow: None,
            accepted: None,
        }
    }

    /// A moment just after the test batches were first seen (Unix ms 0 to 2).
    const SOON_MS: u64 = 10;

    fn batch(name: &str, first_ms: u64, total: u64, registered: u64) -> Progress {
        Progress {
            seller: "S-1".into(),
            batch: name.into(),
            total: Some(total),
            registered,
            first_ms: Some(first_ms),
            ..Progress::default()
        }
    }

    #[test]
    fn an_upload_of_500_at_100_a_minute_is_due_four_windows_after_its_first_grants() {
        let idle = usage("100/1m", 0, Duration::ZERO);
        assert_eq!(eta(&idle, None, 500, &[]), Duration::from_secs(240));
        // Two seconds in: 100 granted, 400 waiting.
        let started = usage("100/1m", 100, Duration::from_secs(2));
        assert_eq!(eta(&started, None, 400, &[]), Duration::from_secs(238));
        // 150 s in: grants at 0, 60 and 120 s; 200 waiting.
        let later = usage("100/1m", 100, Duration::from_secs(30));
        assert_eq!(eta(&later, None, 200, &[]), Duration::from_secs(90));
        assert_eq!(eta(&later, None, 0, &[]), Duration::ZERO);
    }

    #[test]
    fn each_window_ahead_takes_its_guard_too() {
        let mut guarded = usage("100/1m", 100, Duration::from_secs(2));
        guarded.per_limit[0].guard = Duration::from_secs(2);
        // Grants at 0, 62, 124, 186 and 248 s.
        assert_eq!(eta(&guarded, None, 400, &[]), Duration::from_secs(246));
    }

    #[test]
    fn a_unit_granted_and_not_answered_is_counted_once() {
        // A window's 100 units just granted, 70 answered, 10 in flight and 20 reserved slots
        // due: the 330 waiting include those 30, so 300 more grants, three windows.
        let mut burst = usage("100/1m", 100, Duration::ZERO);
        burst.in_flight = 10;
        burst.per_limit[0].due_reserved = 20;
        assert_eq!(eta(&burst, None, 330, &[]), Duration::from_secs(180));
        let mut answered = usage("100/1m", 100, Duration::ZERO);
        answered.in_flight = 0;
        assert_eq!(eta(&answered, None, 300, &[]), Duration::from_secs(180));
    }

    #[test]
    fn a_pause_and_a_global_share_push_the_eta_out() {
        let mut paused = usage("100/1m", 0, Duration::ZERO);
        paused.paused_for = Duration::from_secs(30);
        assert_eq!(eta(&paused, None, 150, &[]), Duration::from_secs(90));
        let idle = usage("100/1m", 0, Duration::ZERO);
        assert_eq!(eta(&idle, Some(1.0), 101, &[]), Duration::from_secs(100));
    }

    #[test]
    fn a_batch_waits_for_the_sellers_work_seen_before_it() {
        let idle = usage("10/1s", 0, Duration::ZERO);
        let seller = SellerId::parse("S-1").unwrap();
        let batches = vec![
            batch("later", 2, 20, 0),
            batch("first", 1, 30, 0),
            batch("done", 0, 5, 5),
        ];
        let report = seller_report(&seller, batches, idle, None, &[], SOON_MS);
        let names: Vec<_> = report.batches.iter().map(|b| b.batch_id.as_str()).collect();
        assert_eq!(names, ["done", "first", "later"]);
        assert_eq!(report.batches[0].eta_s, Some(0.0));
        assert_eq!(report.batches[1].eta_s, Some(2.0));
        assert_eq!(report.batches[2].eta_s, Some(4.0));
        assert_eq!((report.backlog, report.eta_s), (50, 4.0));
    }

    const MINUTE_MS: u64 = 60_000;

    /// `name`, first seen at 0 and last counted at `last_min` minutes, 3 of 10 rows waiting.
    fn waiting_since(name: &str, first_ms: u64, last_min: u64) -> Progress {
        Progress {
            registered: 7,
            last_ms: Some(last_min * MINUTE_MS),
            ..batch(name, first_ms, 10, 0)
        }
    }

    #[test]
    fn a_batch_none_of_whose_rows_is_counted_for_ten_minutes_with_nothing_to_explain_it_is_stalled()
    {
        let seller = SellerId::parse("S-1").unwrap();
        let report = |batches, usage, retries: &[RetryDue], now_min: u64| {
            seller_report(&seller, batches, usage, None, retries, now_min * MINUTE_MS)
        };
        let idle = || usage("100/1m", 0, Duration::ZERO);
        let b = || vec![waiting_since("b", 0, 5)];
        assert_eq!(report(b(), idle(), &[], 14).batches[0].stalled, None);
        let stalled = report(b(), idle(), &[], 15).batches[0].stalled.clone();
        let stalled = stalled.expect("still for ten minutes");
        assert_eq!(stalled.since_ms, 5 * MINUTE_MS);
        assert!(
            stalled
                .why
                .starts_with("3 of 10 rows not counted, none for 10 min"),
            "{}",
            stalled.why
        );
        // A pause or a row waiting out its retry explains it.
        let mut paused = idle();
        paused.paused_for = Duration::from_secs(60);
        assert_eq!(report(b(), paused, &[], 60).batches[0].stalled, None);
        let retrying = [retry("b", 1, 30)];
        assert_eq!(report(b(), idle(), &retrying, 60).batches[0].stalled, None);
        // A seller allowed a few calls an hour counts rarely: two of its windows, not ten
        // minutes.
        let hourly = || usage("2/1h", 0, Duration::ZERO);
        assert_eq!(report(b(), hourly(), &[], 60).batches[0].stalled, None);
        assert!(report(b(), hourly(), &[], 126).batches[0].stalled.is_some());
        // Done, or its total unknown: never.
        let done = Progress {
            registered: 10,
            ..waiting_since("b", 0, 5)
        };
        assert_eq!(report(vec![done], idle(), &[], 60).batches[0].stalled, None);
        let unknown = Progress {
            total: None,
            ..waiting_since("b", 0, 5)
        };
        assert_eq!(
            report(vec![unknown], idle(), &[], 60).batches[0].stalled,
            None
        );
    }

    #[test]
    fn a_batch_waiting_behind_its_sellers_earlier_work_is_not_stalled_while_that_moves() {
        let seller = SellerId::parse("S-1").unwrap();
        // `behind` was first seen at 1 min and nothing of it is counted yet; `earlier` last
        // counted a row at 29 min. At 30 min, `behind` waits for `earlier`; once `earlier` is
        // still too, both are stalled.
        let behind = Progress {
            registered: 0,
            last_ms: None,
            ..waiting_since("behind", MINUTE_MS, 0)
        };
        let batches = || vec![waiting_since("earlier", 0, 29), behind.clone()];
        let idle = || usage("100/1m", 0, Duration::ZERO);
        let at_30 = seller_report(&seller, batches(), idle(), None, &[], 30 * MINUTE_MS);
        assert!(
            at_30.batches.iter().all(|b| b.stalled.is_none()),
            "{:?}",
            at_30.batches
        );
        let at_40 = seller_report(&seller, batches(), idle(), None, &[], 40 * MINUTE_MS);
        assert!(
            at_40.batches.iter().all(|b| b.stalled.is_some()),
            "{:?}",
            at_40.batches
        );
        // A later batch moving does not explain an earlier one's rows.
        let later = waiting_since("later", 2 * MINUTE_MS, 39);
        let mixed = vec![waiting_since("earlier", 0, 29), later];
        let at_40 = seller_report(&seller, mixed, idle(), None, &[], 40 * MINUTE_MS);
        let got: Vec<_> = at_40
            .batches
            .iter()
            .map(|b| (b.batch_id.as_str(), b.stalled.is_some()))
            .collect();
        assert_eq!(got, [("earlier", true), ("later", false)]);
    }

    #[test]
    fn a_seller_registered_slower_than_its_limits_allow_is_given_the_eta_of_its_observed_pace() {
        let seller = SellerId::parse("S-1").unwrap();
        // 340 rows at 20/1s, a downstream that takes 10 a second: 100 registered in 10 s.
        let slow = || Progress {
            registered: 100,
            done_units: 100,
            ..batch("b", 0, 340, 100)
        };
        let limits = || usage("20/1s", 10, Duration::from_millis(900));
        let report = seller_report(&seller, vec![slow()], limits(), None, &[], 10_000);
        let b = &report.batches[0];
        assert_eq!(b.observed_per_s, Some(10.0));
        assert_eq!((b.eta_s, b.eta_basis), (Some(24.0), Basis::ObservedPace));
        assert!(b.eta_limits_s.unwrap() < 12.5, "{b:?}");
        assert_eq!(
            (report.eta_s, report.eta_basis),
            (24.0, Basis::ObservedPace)
        );
        // An admission question is answered at that pace too, and says so.
        let question = Question {
            rows: 60,
            deadline: None,
        };
        let answer = report.admission(&question, at("2026-11-26T01:00:00Z"));
        assert_eq!(
            (answer.finish_in_s, answer.basis),
            (30.0, Basis::ObservedPace)
        );
        assert_eq!(answer.observed_per_s, Some(10.0));
    }

    #[test]
    fn a_first_windows_burst_faster_than_the_long_run_limit_leaves_the_eta_to_the_limits() {
        let seller = SellerId::parse("S-1").unwrap();
        // 500 at 100/1m: the first 100 granted at once, registered within 1.5 s.
        let burst = Progress {
            done_units: 100,
            ..batch("b", 0, 500, 100)
        };
        let report = seller_report(
            &seller,
            vec![burst],
            usage("100/1m", 100, Duration::from_millis(1500)),
            None,
            &[],
            1_500,
        );
        let b = &report.batches[0];
        assert!(b.observed_per_s.unwrap() > 60.0, "{b:?}");
        assert_eq!(b.eta_basis, Basis::Limits);
        assert_eq!(b.eta_s, b.eta_limits_s);
    }

    #[test]
    fn no_pace_is_observed_before_ten_units_and_five_percent_of_the_rows_over_a_second() {
        let open = |registered, total| Progress {
            done_units: registered,
            ..batch("b", 0, total, registered)
        };
        assert_eq!(pace_so_far(&[open(9, 100)], 10_000), None);
        assert_eq!(pace_so_far(&[open(10, 1000)], 10_000), None);
        assert_eq!(pace_so_far(&[open(50, 1000)], 900), None);
        assert_eq!(pace_so_far(&[open(50, 1000)], 10_000), Some(5.0));
        // A done batch is not the seller's pace now.
        assert_eq!(pace_so_far(&[open(100, 100)], 10_000), None);
    }

    #[test]
    fn a_pace_that_picked_up_after_a_slow_start_is_read_from_the_sellers_window_now() {
        // 60 registered in 10 s (6 a second), but the window of the last 0.9 s holds 10 calls.
        let batches = [Progress {
            done_units: 60,
            ..batch("b", 0, 300, 60)
        }];
        let mut now = usage("20/1s", 10, Duration::from_millis(900));
        assert_eq!(recent_pace(&now), Some(10.0));
        assert_eq!(observed_pace(&batches, &now, 10_000), Some(10.0));
        // Calls in flight are not answered yet; fewer than five answered say nothing.
        now.in_flight = 6;
        assert_eq!(recent_pace(&now), None);
        assert_eq!(observed_pace(&batches, &now, 10_000), Some(6.0));
    }

    #[test]
    fn with_adaptive_limits_the_recent_pace_is_what_the_downstream_accepted_not_the_calls() {
        // 20 calls in the last 0.95 s, but the API refused half of them (429s) while the lower
        // limit was being learned: 10 accepted, the oldest 0.9 s ago.
        let batches = [Progress {
            done_units: 30,
            ..batch("b", 0, 300, 30)
        }];
        let mut now = usage("20/1s", 20, Duration::from_millis(950));
        assert_eq!(recent_pace(&now), Some(19.0 / 0.95));
        now.accepted = Some(turnstile_core::permit::Accepted {
            units: 10,
            oldest_age: Duration::from_millis(900),
        });
        assert_eq!(recent_pace(&now), Some(10.0));
        assert_eq!(observed_pace(&batches, &now, 10_000), Some(10.0));
        // Nothing accepted lately says nothing of the pace (the pace so far stands).
        now.accepted = Some(turnstile_core::permit::Accepted::default());
        assert_eq!(recent_pace(&now), None);
        assert_eq!(observed_pace(&batches, &now, 10_000), Some(3.0));
    }

    #[test]
    fn a_batch_without_a_total_has_no_eta_and_is_never_done() {
        let unknown = Progress {
            total: None,
            registered: 3,
            ..batch("b", 0, 0, 3)
        };
        assert_eq!(unknown.waiting(), None);
        assert!(!unknown.done());
        let report = seller_report(
            &SellerId::parse("S-1").unwrap(),
            vec![unknown],
            usage("10/1s", 0, Duration::ZERO),
            None,
            &[],
            SOON_MS,
        );
        assert_eq!(report.batches[0].eta_s, None);
    }

    /// `units` of batch `batch` whose retry is due in `due_in_s` seconds.
    fn retry(batch: &str, units: u64, due_in_s: u64) -> RetryDue {
        RetryDue {
            batch: batch.into(),
            message: format!("{batch}-retried"),
            units,
            due_in: Duration::from_secs(due_in_s),
        }
    }

    #[test]
    fn a_message_waiting_for_its_retry_is_not_done_before_the_retry_is_due() {
        let idle = usage("100/1m", 0, Duration::ZERO);
        // The operator's case: one message left, retried in 30 s (was 0: "~1s").
        assert_eq!(eta(&idle, None, 1, &[]), Duration::ZERO);
        assert_eq!(
            eta(&idle, None, 1, &[retry("b", 1, 30)]),
            Duration::from_secs(30)
        );
        // 150 retried messages due in 70 s, the window long free by then: 100 at 70 s, the
        // other 50 a window later.
        assert_eq!(
            eta(&idle, None, 150, &[retry("b", 150, 70)]),
            Duration::from_secs(130)
        );
        // 100 of 250 due in 30 s: the limit binds (grants at 0, 60 and 120 s) whatever they do.
        assert_eq!(
            eta(&idle, None, 250, &[retry("b", 100, 30)]),
            Duration::from_secs(120)
        );
    }

    #[test]
    fn the_retries_due_at_or_after_each_one_drain_from_its_due_time() {
        let idle = usage("100/1m", 0, Duration::ZERO);
        // 50 due in 10 s and 60 in 20 s: 50 granted at 10 s, 50 at 20 s, the last 10 once the
        // first expire, at 70 s.
        let retries = [retry("b", 60, 20), retry("b", 50, 10)];
        assert_eq!(eta(&idle, None, 110, &retries), Duration::from_secs(70));
        // Never more of them than the units waiting (an entry of a message registered since).
        assert_eq!(
            eta(&idle, None, 1, &[retry("b", 5, 5), retry("b", 300, 5)]),
            Duration::from_secs(5)
        );
        // A global share of 1 unit/s drains them no faster from their due time.
        assert_eq!(
            eta(&idle, Some(1.0), 11, &[retry("b", 11, 10)]),
            Duration::from_secs(20)
        );
        // Nothing waiting: no retry holds it.
        assert_eq!(eta(&idle, None, 0, &[retry("b", 1, 30)]), Duration::ZERO);
    }

    #[test]
    fn a_batch_waits_for_its_own_retries_not_another_batchs() {
        let idle = usage("10/1s", 0, Duration::ZERO);
        let seller = SellerId::parse("S-1").unwrap();
        let batches = vec![
            batch("first", 1, 30, 0),
            batch("later", 2, 20, 0),
            batch("done", 0, 5, 5),
        ];
        let retries = [
            retry("first", 1, 50),
            retry("done", 1, 90),
            retry("elsewhere", 1, 99),
        ];
        let report = seller_report(&seller, batches, idle, None, &retries, SOON_MS);
        let got: Vec<_> = report
            .batches
            .iter()
            .map(|b| (b.batch_id.as_str(), b.eta_s, b.retrying))
            .collect();
        // `later` is not held up by `first`'s retry: the retried message asks behind it. A
        // done batch's entry and an unknown batch's count for nothing.
        assert_eq!(
            got,
            [
                ("done", Some(0.0), 0),
                ("first", Some(50.0), 1),
                ("later", Some(4.0), 0)
            ]
        );
        assert_eq!(
            (report.backlog, report.eta_s, report.retrying),
            (50, 50.0, 1)
        );
    }

    /// The instant an RFC 3339 text names.
    fn at(text: &str) -> OffsetDateTime {
        parse_deadline(text).unwrap()
    }

    /// A seller at 10/10s whose window holds the 10 units just registered, with 20 waiting.
    fn busy_seller() -> SellerReport {
        seller_report(
            &SellerId::parse("S-1").unwrap(),
            vec![batch("b", 1, 30, 10)],
            usage("10/10s", 10, Duration::ZERO),
            None,
            &[],
            SOON_MS,
        )
    }

    /// A seller configured at 20/1s whose limit was learned down to 5/1s (a 429), with 100
    /// rows waiting 10 s after its batch was first seen, the downstream accepting `accepted`
    /// units in its last 0.9 s.
    fn learning_seller(accepted: u64) -> SellerReport {
        let mut now = usage("5/1s", 5, Duration::from_millis(900));
        now.configured = "20/1s".parse().unwrap();
        now.learned_why = Some(turnstile_core::permit::Why::Throttled);
        now.accepted = Some(turnstile_core::permit::Accepted {
            units: accepted,
            oldest_age: Duration::from_millis(900),
        });
        seller_report(
            &SellerId::parse("S-1").unwrap(),
            vec![batch("b", 1, 120, 20)],
            now,
            None,
            &[],
            10_000,
        )
    }

    #[test]
    fn while_a_limit_is_learned_the_accepted_pace_says_the_finish_either_way() {
        // The learned 5/1s says about 20 s; the API accepts 10 a second: 10 s, observed.
        let at_ten = learning_seller(10);
        assert_eq!(at_ten.observed_per_s, Some(10.0));
        assert_eq!(at_ten.eta_basis, Basis::ObservedPace);
        assert!((at_ten.eta_s - 10.0).abs() < 0.01, "{}", at_ten.eta_s);
        assert!(at_ten.eta_limits_s > 18.0, "{}", at_ten.eta_limits_s);
        // Never sooner than the configured 20/1s allows (100 in 5 windows: 4 s), however fast
        // it seems.
        let fast = learning_seller(91);
        assert_eq!(fast.observed_per_s, Some(100.0));
        assert!((fast.eta_s - 4.0).abs() < 0.2, "{}", fast.eta_s);
    }

    #[test]
    fn rows_are_a_whole_number_from_1_to_a_million() {
        assert_eq!(parse_rows("1"), Ok(1));
        assert_eq!(parse_rows("1000000"), Ok(MAX_ROWS));
        for bad in ["0", "1000001", "-1", "2.5", "", "five"] {
            let said = parse_rows(bad).expect_err(bad);
            assert!(said.contains("from 1 to 1000000"), "{bad:?}: {said}");
        }
    }

    #[test]
    fn a_deadline_is_an_rfc_3339_date_time_echoed_in_utc() {
        let deadline = at("2026-11-26T10:00:00+09:00");
        assert_eq!(rfc3339(deadline), "2026-11-26T01:00:00Z");
        assert_eq!(
            rfc3339(at("2026-11-26T01:00:00.250Z")),
            "2026-11-26T01:00:00.25Z"
        );
        for bad in [
            "2026-11-26",
            "2026-11-26T10:00:00",
            "tomorrow",
            "",
            "1764118800",
        ] {
            let said = parse_deadline(bad).expect_err(bad);
            assert!(said.contains("RFC 3339"), "{bad:?}: {said}");
        }
    }

    #[test]
    fn a_question_is_asked_only_with_rows_or_a_deadline_and_a_bad_one_names_its_parameter() {
        assert_eq!(Question::from_params(None, None), Ok(None));
        assert_eq!(
            Question::from_params(None, Some("2026-11-26T01:00:00Z")),
            Ok(Some(Question {
                rows: 1,
                deadline: Some(at("2026-11-26T01:00:00Z"))
            }))
        );
        assert_eq!(
            Question::from_params(Some("5"), None),
            Ok(Some(Question {
                rows: 5,
                deadline: None
            }))
        );
        let rows = Question::from_params(Some("0"), None).unwrap_err();
        assert!(rows.starts_with("rows: expected"), "{rows}");
        let deadline = Question::from_params(Some("5"), Some("soon")).unwrap_err();
        assert_eq!(
            deadline,
            "deadline: expected an RFC 3339 date-time such as 2026-11-26T10:00:00+09:00"
        );
    }

    #[test]
    fn five_more_rows_behind_twenty_waiting_at_10_per_10s_finish_a_window_after_the_backlog() {
        let seller = busy_seller();
        assert_eq!((seller.backlog_units, seller.eta_s), (20, 20.0));
        assert_eq!(seller.eta_with(0), Duration::from_secs(20));
        let now = at("2026-11-26T01:00:00Z");
        let soon = Question {
            rows: 5,
            deadline: Some(at("2026-11-26T10:00:05+09:00")),
        };
        assert_eq!(
            seller.admission(&soon, now),
            Admission {
                rows: 5,
                finish_at: "2026-11-26T01:00:30Z".into(),
                finish_in_s: 30.0,
                basis: Basis::Limits,
                observed_per_s: None,
                deadline: Some("2026-11-26T01:00:05Z".into()),
                meets_deadline: Some(false),
            }
        );
        let later_on = Question {
            deadline: Some(at("2026-11-26T01:01:00Z")),
            ..soon
        };
        assert_eq!(seller.admission(&later_on, now).meets_deadline, Some(true));
        // Exactly at the deadline meets it; no deadline, no verdict.
        let exactly = Question {
            deadline: Some(at("2026-11-26T01:00:30Z")),
            ..soon
        };
        assert_eq!(seller.admission(&exactly, now).meets_deadline, Some(true));
        let open = seller.admission(
            &Question {
                rows: 5,
                deadline: None,
            },
            now,
        );
        assert_eq!((open.deadline, open.meets_deadline), (None, None));
        let json = serde_json::to_value(seller.admission(
            &Question {
                rows: 5,
                deadline: None,
            },
            now,
        ))
        .unwrap();
        assert_eq!(
            json,
            serde_json::json!({"rows": 5, "finish_at": "2026-11-26T01:00:30Z", "finish_in_s": 30.0,
                "basis": "limits", "observed_per_s": null})
        );
    }

    #[test]
    fn an_admission_counts_a_pause_and_is_written_to_the_millisecond() {
        let mut seller = busy_seller();
        seller.usage.paused_for = Duration::from_millis(45_250);
        // Paused 45.25 s: then the 25 units drain in two more windows.
        let now = at("2026-11-26T01:00:00.000400Z");
        let answer = seller.admission(
            &Question {
                rows: 5,
                deadline: None,
            },
            now,
        );
        assert_eq!(answer.finish_in_s, 65.25);
        assert_eq!(answer.finish_at, "2026-11-26T01:01:05.25Z");
    }

    #[test]
    fn a_finish_beyond_year_9999_is_written_as_its_last_moment() {
        let mut slow = busy_seller();
        slow.usage = usage("1/1d", 0, Duration::ZERO);
        slow.backlog_units = u64::MAX / 2;
        let answer = slow.admission(
            &Question {
                rows: MAX_ROWS,
                deadline: Some(at("9999-12-31T23:59:59Z")),
            },
            at("2026-11-26T01:00:00Z"),
        );
        assert_eq!(answer.finish_at, "9999-12-31T23:59:59.999Z");
        assert_eq!(answer.meets_deadline, Some(false));
    }

    #[test]
    fn a_batch_meets_a_deadline_if_its_eta_ends_by_it_or_it_completed_by_it() {
        let seller = busy_seller();
        let waiting = &seller.batches[0];
        assert_eq!(waiting.eta_s, Some(20.0));
        let now = at("2026-11-26T01:00:00Z");
        assert_eq!(waiting.meets(at("2026-11-26T01:00:05Z"), now), Some(false));
        assert_eq!(waiting.meets(at("2026-11-26T01:00:20Z"), now), Some(true));
        let completed_ms = u64::try_from(now.unix_timestamp()).unwrap() * 1000 - 60_000;
        let done = BatchReport {
            done: true,
            eta_s: Some(0.0),
            completed_ms: Some(completed_ms),
            ..waiting.clone()
        };
        assert_eq!(done.meets(at("2026-11-26T00:59:30Z"), now), Some(true));
        assert_eq!(done.meets(at("2026-11-26T00:58:30Z"), now), Some(false));
        let unknown = BatchReport {
            eta_s: None,
            ..waiting.clone()
        };
        assert_eq!(unknown.meets(at("2026-11-26T01:00:20Z"), now), None);
    }
}
