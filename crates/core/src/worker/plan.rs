//! What happens to a message, decided from plain values with no I/O: the [`Outcome`] of a
//! delivery, the next step ([`Plan`]) after a permit decision, a downstream answer or a permit
//! error, and the backoff and lead they use. [`super::Worker`] carries the plans out.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

use crate::domain::MessageId;
use crate::downstream::{ApiResponse, Reply};
use tracing::warn;

use super::carried::Carried;
use crate::domain::Deadline;
use crate::permit::{CALL_ALLOWANCE, Decision, PermitError, Reservation};

/// What to do with a delivery; decided by [`Worker::handle`], applied by [`Worker::settle`].
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Registered now: ack (after its result).
    Registered(Report),
    /// Registered before (completion record): ack without calling.
    AlreadyDone,
    /// Come back later through the delay ladder, with what the message carries (its
    /// reservation, if any).
    Delay { after: Duration, carried: Carried },
    /// Give up: publish to `<queue>.dead` with the reason, then its result, then ack.
    DeadLetter {
        reason: &'static str,
        detail: String,
        report: Report,
    },
    /// Give the message back to the broker as it is (nack + requeue). The copy the broker
    /// gives back carries what the delivery carried; a reservation taken since (`holding`) is
    /// given back.
    Requeue { holding: Option<Reservation> },
}

/// What a message's result says beside its outcome: the downstream's answer to its last call
/// (none when no call was answered) and its attempts: the calls that counted as attempts, the
/// last one included (a 429 is not an attempt).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub response: Option<ApiResponse>,
    pub attempts: u32,
    /// A superseded message's successor: the newer message of its product that took its place.
    pub superseded_by: Option<MessageId>,
}

impl Report {
    /// A message that ends after `attempts` attempts, with no answer to carry.
    pub fn after(attempts: u32) -> Self {
        Self {
            response: None,
            attempts,
            superseded_by: None,
        }
    }
}

impl Outcome {
    /// Dead-lettered for `reason` with `detail`, after `attempts` attempts, with no answer to
    /// carry.
    pub fn dead(reason: &'static str, detail: impl Into<String>, attempts: u32) -> Self {
        Outcome::DeadLetter {
            reason,
            detail: detail.into(),
            report: Report::after(attempts),
        }
    }
}

/// The dead-letter reason (and result outcome) of a superseded message: a newer message of its
/// product took its place (see `superseding`).
pub(super) const SUPERSEDED: &str = "superseded";

/// The `outcome` label values of `turnstile_outcomes_total` (see [`Outcome::label`]).
pub const OUTCOME_LABELS: [&str; 6] = [
    "registered",
    "already_done",
    "delayed",
    "retried",
    "dead_lettered",
    "requeued",
];

/// Every reason a replica dead-letters with (`x-turnstile-reason`, the `reason` label of
/// `turnstile_dead_letters_total`).
pub const DEAD_LETTER_REASONS: [&str; 6] = [
    "invalid-message",
    "rejected",
    "attempts-exhausted",
    "throttled",
    "expired",
    SUPERSEDED,
];

impl Outcome {
    /// The outcome's label in `turnstile_outcomes_total`, for a delivery that carried
    /// `delivered_attempt` failed attempts: a delay after one more failed attempt is `retried`.
    pub(super) fn label(&self, delivered_attempt: u32) -> &'static str {
        match self {
            Outcome::Registered(_) => "registered",
            Outcome::AlreadyDone => "already_done",
            Outcome::Delay { carried, .. } if carried.attempt > delivered_attempt => "retried",
            Outcome::Delay { .. } => "delayed",
            Outcome::DeadLetter { .. } => "dead_lettered",
            Outcome::Requeue { .. } => "requeued",
        }
    }

    /// The backoff of a delay after one more failed attempt than the delivery carried
    /// (`delivered_attempt`): a retry (`retried` in [`Outcome::label`]); `None` for any other
    /// outcome.
    pub(super) fn retry_backoff(&self, delivered_attempt: u32) -> Option<Duration> {
        match self {
            Outcome::Delay { after, carried } if carried.attempt > delivered_attempt => {
                Some(*after)
            }
            _ => None,
        }
    }
}

/// Whether a message with `deadline` that can next be called `next_call` from `now_ms` (Unix ms;
/// `None`: now) has expired: its call could only be made after its deadline. The dead letter's
/// detail names the deadline and the earliest time the message could have been called.
pub fn expired(
    deadline: Option<Deadline>,
    now_ms: u64,
    next_call: Option<Duration>,
) -> Option<String> {
    let deadline = deadline?.unix_ms();
    let earliest = now_ms.saturating_add(next_call.map_or(0, |d| d.as_millis() as u64));
    (earliest > deadline).then(|| {
        format!(
            "deadline {} is before the earliest time it could be called, {}",
            crate::domain::rfc3339(deadline),
            crate::domain::rfc3339(earliest)
        )
    })
}

/// How long a message on a route this replica does not know waits before it is delivered
/// again, to whichever replica takes it (see [`plan_unknown_route`]).
pub const ROUTE_ELSEWHERE_WAIT: Duration = Duration::from_secs(1);

/// How long after turnstile first saw it a message on a route this replica does not know may
/// wait for a replica that does (a rolling deploy of a routes file takes minutes, not more).
pub const ROUTE_ELSEWHERE_PATIENCE: Duration = Duration::from_secs(600);

/// The outcome of a message naming a route this replica's routes file lacks (`invalid`: why
/// it is invalid here). While a live replica knows the route (`known_elsewhere`: a rolling
/// deploy adds it) and the message first came less than [`ROUTE_ELSEWHERE_PATIENCE`] ago, it
/// waits [`ROUTE_ELSEWHERE_WAIT`] to be delivered again (another replica may take it); else it
/// is dead-lettered as `invalid-message`, saying why.
pub fn plan_unknown_route(
    known_elsewhere: bool,
    carried: &Carried,
    now_ms: u64,
    invalid: &str,
) -> Outcome {
    let waited = Duration::from_millis(now_ms.saturating_sub(carried.first_seen_ms));
    if !known_elsewhere {
        return Outcome::dead("invalid-message", invalid.to_owned(), carried.attempt);
    }
    if waited >= ROUTE_ELSEWHERE_PATIENCE {
        return Outcome::dead(
            "invalid-message",
            format!(
                "{invalid}, and no replica that knows the route took it within {}",
                humantime::format_duration(ROUTE_ELSEWHERE_PATIENCE)
            ),
            carried.attempt,
        );
    }
    Outcome::Delay {
        after: ROUTE_ELSEWHERE_WAIT,
        carried: Carried {
            reservation: None,
            terms_tag: None,
            ..carried.clone()
        },
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
pub(super) enum Plan {
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
    /// What a permit decision leads to, given how old a grant may be (`waited`: the time since
    /// the request that made it left) and how many messages are held in the replica
    /// (`holding`). A grant is called only within [`CALL_ALLOWANCE`] of it: its place in the
    /// window was only promised for a call starting within it; a later one is asked for again,
    /// without the reservation.
    pub(super) fn plan_decision(
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
            Decision::Deferred { retry_after, .. } => {
                carried.reservation = None;
                self.plan_deferred(retry_after, holding, carried)
            }
            Decision::TooCostly {
                cost,
                most,
                limits,
                bound_by,
            } => Plan::Settle(Outcome::dead(
                "invalid-message",
                format!(
                    "cost {cost} exceeds what the seller's limit {limits} can ever grant to one \
                     call: at most {most}, {bound_by}"
                ),
                carried.attempt,
            )),
        }
    }

    /// Where a message told to wait `retry_after` waits. Held here if it has a reservation,
    /// the wait is within `hold` and fewer than `hold_capacity` messages are held (`holding`);
    /// otherwise it goes through the delay ladder, coming back [`WorkerSettings::lead`] before
    /// its reserved slot (or at the time, without a reservation) — unless that leaves no more
    /// than one ladder step, which is held here too.
    pub(super) fn plan_wait(
        &self,
        retry_after: Duration,
        holding: usize,
        carried: &Carried,
    ) -> Plan {
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

    /// A message that comes back holding a reservation whose slot is still `until_slot` ahead
    /// (by this replica's estimate of Redis's clock, which is never ahead of it) waits for its
    /// slot without asking Redis, which would only answer "early": as after that answer, it is
    /// held here or sent back through the ladder (see [`Self::plan_wait`]). `None` (ask now)
    /// for a slot less than a millisecond ahead, or further ahead than `hold`: a header
    /// claiming a far slot is checked with Redis at once, so a forged one can delay a message
    /// by no more than `hold`.
    pub(super) fn plan_early_return(
        &self,
        until_slot: Duration,
        holding: usize,
        carried: &Carried,
    ) -> Option<Plan> {
        if carried.reservation.is_none()
            || until_slot < Duration::from_millis(1)
            || until_slot > self.hold
        {
            return None;
        }
        Some(self.plan_wait(until_slot, holding, carried))
    }

    /// Where a message a lease or the global limit turned away waits `retry_after` (its
    /// ticket: see `lua/lease.lua`, `lua/global.lua`): held here if the wait is within `hold`
    /// and fewer than `hold_capacity` messages are held (a ticket is precise, and a held
    /// message costs no delivery), else delayed through the broker for all of it.
    pub(super) fn plan_deferred(
        &self,
        retry_after: Duration,
        holding: usize,
        carried: &Carried,
    ) -> Plan {
        if (retry_after > self.hold || holding >= self.hold_capacity)
            && retry_after > crate::broker::UNIT
        {
            return Plan::Settle(Outcome::Delay {
                after: retry_after,
                carried: carried.clone(),
            });
        }
        Plan::Hold(retry_after)
    }

    /// What the downstream's reply to a call leads to. The call spent the message's
    /// reservation. `now_ms` is the time (Unix ms); `window` is the default limit's window,
    /// the pause after a 429 without Retry-After.
    pub(super) fn plan_reply(
        &self,
        reply: Reply,
        carried: &mut Carried,
        now_ms: u64,
        window: Duration,
        lowered: bool,
    ) -> Plan {
        carried.reservation = None;
        match reply {
            Reply::Registered(response) => Plan::Settle(Outcome::Registered(Report {
                response: Some(response),
                attempts: carried.attempt.saturating_add(1),
                superseded_by: None,
            })),
            // The learned limit went down: it spaces the seller's next calls, no pause needed.
            Reply::Throttled { retry_after: None } if lowered => self
                .throttled_too_long(carried, now_ms)
                .unwrap_or(Plan::AskAgain),
            Reply::Throttled { retry_after } => {
                self.plan_throttled(retry_after.unwrap_or(window), carried, now_ms)
            }
            Reply::Transient { why, response } => self.plan_failure(why, response, carried),
            Reply::Rejected {
                status,
                body,
                response,
            } => Plan::Settle(Outcome::DeadLetter {
                reason: "rejected",
                detail: format!("HTTP {status}: {body}"),
                report: Report {
                    response,
                    attempts: carried.attempt.saturating_add(1),
                    superseded_by: None,
                },
            }),
        }
    }

    /// A 429 that `asked` for a pause: the seller is paused for it, capped at `max_pause` (at
    /// least 1 ms). A message throttled for `throttle_deadline` since its first 429 (noted in
    /// `carried` now if this is the first) is dead-lettered as `throttled` instead.
    pub(super) fn plan_throttled(
        &self,
        asked: Duration,
        carried: &mut Carried,
        now_ms: u64,
    ) -> Plan {
        if let Some(dead) = self.throttled_too_long(carried, now_ms) {
            return dead;
        }
        Plan::PauseSeller {
            pause: asked.min(self.max_pause).max(Duration::from_millis(1)),
            asked,
        }
    }

    /// The dead letter of a message throttled for `throttle_deadline` since its first 429
    /// (noted in `carried` now if this is the first), else `None`.
    fn throttled_too_long(&self, carried: &mut Carried, now_ms: u64) -> Option<Plan> {
        let since = *carried.throttled_since_ms.get_or_insert(now_ms);
        let throttled_for = Duration::from_millis(now_ms.saturating_sub(since));
        (throttled_for >= self.throttle_deadline).then(|| {
            Plan::Settle(Outcome::dead(
                "throttled",
                format!(
                    "the downstream answered 429 for {} s (TURNSTILE_THROTTLE_DEADLINE {} s)",
                    throttled_for.as_secs(),
                    self.throttle_deadline.as_secs()
                ),
                carried.attempt,
            ))
        })
    }

    /// A failed attempt (5xx, timeout, connection error), counted in `carried`: the
    /// `max_attempts`-th is dead-lettered as `attempts-exhausted`, earlier ones are retried
    /// after [`WorkerSettings::backoff`].
    pub(super) fn plan_failure(
        &self,
        why: String,
        response: Option<ApiResponse>,
        carried: &mut Carried,
    ) -> Plan {
        carried.attempt = carried.attempt.saturating_add(1);
        let attempt = carried.attempt;
        if attempt >= self.max_attempts {
            return Plan::Settle(Outcome::DeadLetter {
                reason: "attempts-exhausted",
                detail: format!("{attempt} attempts failed; last: {why}"),
                report: Report {
                    response,
                    attempts: attempt,
                    superseded_by: None,
                },
            });
        }
        Plan::Retry {
            after: self.backoff(attempt),
            why,
        }
    }

    /// How early a message delayed through the broker comes back before its slot: half the
    /// hold, at least two ladder steps.
    pub(super) fn lead(&self) -> Duration {
        (self.hold / 2).max(crate::broker::UNIT * 2)
    }

    /// How long from now until a message that planned `plan` can next be called, if the plan
    /// makes it wait: its reserved slot (`until_slot`, when it holds one and the plan waits for
    /// it), or else the end of the wait (a delay, a hold, a pause, a retry's backoff, a wait for
    /// Redis). `None` for a plan that settles the message or asks again at once.
    pub(super) fn next_call_after(
        &self,
        plan: &Plan,
        until_slot: Option<Duration>,
    ) -> Option<Duration> {
        let wait = match plan {
            Plan::Hold(wait) | Plan::AskAfter(wait) => *wait,
            Plan::PauseSeller { pause, .. } => *pause,
            Plan::Retry { after, .. } => *after,
            Plan::Settle(Outcome::Delay { after, carried }) if carried.reservation.is_some() => {
                *after + self.lead()
            }
            Plan::Settle(Outcome::Delay { after, .. }) => *after,
            Plan::Settle(_) | Plan::AskAgain | Plan::Call { .. } => return None,
        };
        // A message waiting for its reserved slot is called at the slot, not at the end of a
        // wait that also covers the answers it waits for.
        Some(match (plan, until_slot) {
            (Plan::Hold(_) | Plan::Settle(Outcome::Delay { .. }), Some(slot)) => slot.min(wait),
            _ => wait,
        })
    }

    /// The n-th retry delay: exponential from `retry_min` (doubling), capped at `retry_max`,
    /// plus a random jitter of up to as much again.
    pub(super) fn backoff(&self, attempt: u32) -> Duration {
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

/// Permit decisions the limiter may refuse (not for want of Redis) before the message is
/// dead-lettered: retrying cannot help, and the worker must not spin.
pub(super) const PERMIT_REFUSALS: u32 = 3;

/// Backoff while Redis is unavailable: 50 ms doubling to 5 s, with jitter, for as long as it
/// takes (fail closed: no call without a decision).
pub(super) fn redis_backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}

/// What a failed permit decision leads to.
#[derive(Debug, PartialEq)]
pub(super) enum PermitFailure {
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
pub(super) fn permit_failure(
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
pub(super) struct PermitErrors {
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
    pub(super) fn plan(&mut self, error: PermitError, carried: &mut Carried) -> Plan {
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
            PermitFailure::GiveUp => Plan::Settle(Outcome::dead(
                "invalid-message",
                format!("the limiter refused it {} times: {error}", self.refused),
                carried.attempt,
            )),
        }
    }
}

/// What a message interrupted while waiting becomes: at shutdown it goes back through the return
/// queue keeping what it carries (its reservation); with its connection lost, the broker has
/// requeued it already, and the reservation it holds is given back.
pub(super) fn returned(carried: Carried, why: Interrupted) -> Outcome {
    match why {
        Interrupted::Shutdown => Outcome::Delay {
            after: Duration::ZERO,
            carried,
        },
        Interrupted::ConnectionLost => Outcome::Requeue {
            holding: carried.reservation,
        },
    }
}

/// The reservation a settled message leaves behind, to give back: one the message holds but the
/// broker's copy does not carry (taken since it was `delivered` with its own, read only when
/// needed), when the message goes back as it came: requeued, or its delayed copy not
/// `republished`.
pub(super) fn stranded(
    delivered: impl FnOnce() -> Option<Reservation>,
    outcome: &Outcome,
    republished: bool,
) -> Option<Reservation> {
    let holding = match outcome {
        Outcome::Requeue { holding } => holding.as_ref(),
        Outcome::Delay { carried, .. } if !republished => carried.reservation.as_ref(),
        _ => None,
    }?;
    (Some(holding) != delivered().as_ref()).then(|| holding.clone())
}

/// How a handler's wait ended early.
pub(super) enum Interrupted {
    /// Shutting down: return the message to the broker, keeping its reservation.
    Shutdown,
    /// The connection that delivered it is gone: the broker has requeued it already.
    ConnectionLost,
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

    #[test]
    fn a_message_expires_when_its_next_call_could_only_come_after_its_deadline() {
        let deadline = Some(Deadline::from_unix_ms(10_000));
        assert_eq!(
            expired(None, 99_000, Some(SECOND)),
            None,
            "no deadline, never"
        );
        assert_eq!(expired(deadline, 9_000, Some(SECOND)), None, "called at it");
        assert_eq!(expired(deadline, 10_000, None), None, "asking at it");
        let late = expired(deadline, 9_000, Some(SECOND + MS)).unwrap();
        assert!(late.contains("1970-01-01T00:00:10.000Z"), "{late}");
        assert!(late.contains("1970-01-01T00:00:10.001Z"), "{late}");
        assert!(expired(deadline, 10_001, None).is_some(), "past it");
    }

    #[test]
    fn a_waiting_message_is_next_called_at_its_slot_or_at_the_end_of_its_wait() {
        let s = settings();
        let mut carried = Carried::default();
        assert_eq!(s.next_call_after(&Plan::AskAgain, None), None);
        assert_eq!(
            s.next_call_after(&Plan::Settle(Outcome::AlreadyDone), None),
            None
        );
        assert_eq!(
            s.next_call_after(
                &Plan::PauseSeller {
                    pause: 7 * SECOND,
                    asked: 7 * SECOND
                },
                None
            ),
            Some(7 * SECOND)
        );
        let retry = Plan::Retry {
            after: 3 * SECOND,
            why: "HTTP 503".into(),
        };
        assert_eq!(s.next_call_after(&retry, None), Some(3 * SECOND));
        let unreserved = Plan::Settle(Outcome::Delay {
            after: 9 * SECOND,
            carried: carried.clone(),
        });
        assert_eq!(s.next_call_after(&unreserved, None), Some(9 * SECOND));
        // With a reservation: back `lead` before the slot, called at the slot.
        carried.reservation = Some(reservation());
        let reserved = Plan::Settle(Outcome::Delay {
            after: 9 * SECOND,
            carried,
        });
        assert_eq!(
            s.next_call_after(&reserved, None),
            Some(9 * SECOND + s.lead())
        );
        assert_eq!(
            s.next_call_after(&reserved, Some(8 * SECOND)),
            Some(8 * SECOND)
        );
        assert_eq!(
            s.next_call_after(&Plan::Hold(1_500 * MS), Some(1_200 * MS)),
            Some(1_200 * MS),
            "a hold that also waits for answers: the slot decides"
        );
    }

    fn reservation() -> Reservation {
        Reservation {
            slot_us: 1_000_000,
            limits: "1/1s".parse().unwrap(),
            reserved_at_us: 0,
            token: "t".into(),
            cost: None,
        }
    }

    #[test]
    fn a_route_another_replica_knows_waits_for_it_within_the_patience_then_is_dead_lettered() {
        let carried = Carried {
            first_seen_ms: 1_000_000,
            ..Carried::default()
        };
        let why = "invalid route: names no route of the routes file";
        assert!(matches!(
            plan_unknown_route(true, &carried, 1_000_500, why),
            Outcome::Delay { after, .. } if after == ROUTE_ELSEWHERE_WAIT
        ));
        let late = 1_000_000 + ROUTE_ELSEWHERE_PATIENCE.as_millis() as u64;
        match plan_unknown_route(true, &carried, late, why) {
            Outcome::DeadLetter { reason, detail, .. } => {
                assert_eq!(reason, "invalid-message");
                assert!(
                    detail.contains("no replica that knows the route took it within 10m"),
                    "{detail}"
                );
            }
            other => panic!("{other:?}"),
        }
        match plan_unknown_route(false, &carried, 1_000_500, why) {
            Outcome::DeadLetter { detail, .. } => {
                assert_eq!(detail, why, "no live replica knows it")
            }
            other => panic!("{other:?}"),
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
        Plan::Settle(Outcome::dead(reason, detail, 0))
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
    fn a_cost_the_limits_can_never_grant_is_dead_lettered_as_invalid_with_what_bounds_it() {
        let decision = Decision::TooCostly {
            cost: crate::domain::Cost::new(3).unwrap(),
            most: 1,
            limits: "6/1s,20/5s".parse().unwrap(),
            bound_by: "the smallest of COUNT and TURNSTILE_GCRA_BURST",
        };
        let plan = settings().plan_decision(decision, Duration::ZERO, 0, &mut Carried::default());
        assert_eq!(
            plan,
            dead_letter(
                "invalid-message",
                "cost 3 exceeds what the seller's limit 6/1s,20/5s can ever grant to one call: \
                 at most 1, the smallest of COUNT and TURNSTILE_GCRA_BURST"
            )
        );
    }

    #[test]
    fn a_global_wait_within_the_hold_is_held_here_and_a_longer_one_goes_through_the_ladder() {
        let global = |retry_after| Decision::Deferred {
            retry_after,
            by: crate::permit::Deferral::GlobalShare,
        };
        let mut carried = reserved();
        let plan = settings().plan_decision(global(1_500 * MS), Duration::ZERO, 0, &mut carried);
        assert_eq!(plan, Plan::Hold(1_500 * MS));
        assert_eq!(
            carried,
            Carried::default(),
            "the seller's grant was given back"
        );
        let plan = settings().plan_decision(global(5 * SECOND), Duration::ZERO, 0, &mut carried);
        assert_eq!(plan, delay(5 * SECOND, Carried::default()));
        let plan = settings().plan_decision(global(SECOND), Duration::ZERO, 10, &mut carried);
        assert_eq!(plan, delay(SECOND, Carried::default()), "the hold is full");
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
    fn a_reservation_back_before_its_slot_waits_for_it_without_asking() {
        let s = settings();
        let soon = Duration::from_millis(700);
        assert_eq!(
            s.plan_early_return(soon, 0, &reserved()),
            Some(Plan::Hold(soon))
        );
        assert_eq!(
            s.plan_early_return(soon, 0, &Carried::default()),
            None,
            "nothing reserved: ask"
        );
        assert_eq!(
            s.plan_early_return(Duration::ZERO, 0, &reserved()),
            None,
            "due: redeem"
        );
        assert_eq!(
            s.plan_early_return(s.hold + Duration::from_millis(1), 0, &reserved()),
            None,
            "a slot further than the hold is checked with Redis at once"
        );
    }

    #[test]
    fn a_grant_that_came_in_time_is_called() {
        let mut carried = reserved();
        let granted = Decision::Granted {
            slot_us: 0,
            granted_us: 0,
            used_permille: 1_000,
            call: "call-1".into(),
            sent: std::time::Instant::now(),
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
            granted_us: 0,
            used_permille: 1_000,
            call: "call-1".into(),
            sent: std::time::Instant::now(),
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
        let answer = ApiResponse::new(201, br#"{"product_id":7}"#, false);
        let reply = Reply::Registered(answer.clone());
        let plan = settings().plan_reply(reply, &mut carried, 0, SECOND, false);
        let report = Report {
            response: Some(answer),
            attempts: 1,
            superseded_by: None,
        };
        assert_eq!(plan, Plan::Settle(Outcome::Registered(report)));
        assert_eq!(carried.reservation, None);
    }

    #[test]
    fn a_fifth_failure_with_max_attempts_five_is_dead_lettered() {
        let mut carried = Carried {
            attempt: 4,
            ..reserved()
        };
        let last = ApiResponse::new(503, b"down for maintenance", false);
        let reply = Reply::Transient {
            why: "HTTP 503".into(),
            response: Some(last.clone()),
        };
        let plan = settings().plan_reply(reply, &mut carried, 0, SECOND, false);
        assert_eq!(
            plan,
            Plan::Settle(Outcome::DeadLetter {
                reason: "attempts-exhausted",
                detail: "5 attempts failed; last: HTTP 503".into(),
                report: Report {
                    response: Some(last),
                    attempts: 5,
                    superseded_by: None,
                },
            })
        );
        assert_eq!(carried.attempt, 5);
    }

    #[test]
    fn a_fourth_failure_is_retried_after_the_fourth_backoff_without_the_reservation() {
        let mut carried = Carried {
            attempt: 3,
            ..reserved()
        };
        let reply = Reply::unanswered("timeout".into());
        let plan = settings().plan_reply(reply, &mut carried, 0, SECOND, false);
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
        let answer = ApiResponse::new(422, b"unknown seller", false);
        let reply = Reply::Rejected {
            status: 422,
            body: "unknown seller".into(),
            response: Some(answer.clone()),
        };
        let mut carried = Carried {
            attempt: 2,
            ..Carried::default()
        };
        let plan = settings().plan_reply(reply, &mut carried, 0, SECOND, false);
        let report = Report {
            response: Some(answer),
            attempts: 3,
            superseded_by: None,
        };
        assert_eq!(
            plan,
            Plan::Settle(Outcome::DeadLetter {
                reason: "rejected",
                detail: "HTTP 422: unknown seller".into(),
                report
            })
        );
    }

    #[test]
    fn a_first_429_pauses_the_seller_for_its_retry_after_and_notes_since_when() {
        let mut carried = reserved();
        let reply = Reply::Throttled {
            retry_after: Some(5 * SECOND),
        };
        let plan = settings().plan_reply(reply, &mut carried, 1_000_000, SECOND, false);
        let (pause, asked) = (5 * SECOND, 5 * SECOND);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
        assert_eq!(carried.throttled_since_ms, Some(1_000_000));
        assert_eq!(carried.reservation, None);
    }

    #[test]
    fn a_429_without_retry_after_pauses_the_seller_for_one_window() {
        let reply = Reply::Throttled { retry_after: None };
        let plan = settings().plan_reply(reply, &mut Carried::default(), 0, 3 * SECOND, false);
        let (pause, asked) = (3 * SECOND, 3 * SECOND);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
    }

    #[test]
    fn a_429_that_lowered_the_learned_limit_asks_again_without_a_pause() {
        let reply = Reply::Throttled { retry_after: None };
        let mut carried = Carried::default();
        let plan = settings().plan_reply(reply, &mut carried, 5_000, 3 * SECOND, true);
        assert_eq!(plan, Plan::AskAgain);
        assert_eq!(carried.throttled_since_ms, Some(5_000));
    }

    #[test]
    fn a_429_that_lowered_the_learned_limit_still_honours_retry_after() {
        let reply = Reply::Throttled {
            retry_after: Some(2 * SECOND),
        };
        let plan = settings().plan_reply(reply, &mut Carried::default(), 0, 3 * SECOND, true);
        let (pause, asked) = (2 * SECOND, 2 * SECOND);
        assert_eq!(plan, Plan::PauseSeller { pause, asked });
    }

    #[test]
    fn a_429_that_lowered_the_learned_limit_past_the_deadline_is_dead_lettered() {
        let reply = Reply::Throttled { retry_after: None };
        let mut carried = Carried {
            throttled_since_ms: Some(0),
            ..Carried::default()
        };
        let far = settings().throttle_deadline.as_millis() as u64;
        let plan = settings().plan_reply(reply, &mut carried, far, SECOND, true);
        assert!(matches!(
            plan,
            Plan::Settle(Outcome::DeadLetter {
                reason: "throttled",
                ..
            })
        ));
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
    fn a_wait_interrupted_by_a_lost_connection_is_left_to_the_broker_its_reservation_given_back() {
        let outcome = returned(reserved(), Interrupted::ConnectionLost);
        let holding = reserved().reservation;
        assert!(holding.is_some());
        assert_eq!(outcome, Outcome::Requeue { holding });
    }

    #[test]
    fn a_reservation_the_brokers_copy_does_not_carry_is_given_back() {
        let taken = reserved().reservation;
        let delivered = Reservation {
            token: "delivered".into(),
            ..taken.clone().unwrap()
        };
        let delay = Outcome::Delay {
            after: SECOND,
            carried: reserved(),
        };
        // A delayed copy published carries it on; one not published leaves it behind.
        assert_eq!(stranded(|| Some(delivered.clone()), &delay, true), None);
        assert_eq!(stranded(|| Some(delivered.clone()), &delay, false), taken);
        assert_eq!(stranded(|| None, &delay, false), taken);
        // The broker's copy still carries the reservation it was delivered with.
        assert_eq!(stranded(|| taken.clone(), &delay, false), None);
        let requeue = Outcome::Requeue {
            holding: taken.clone(),
        };
        assert_eq!(stranded(|| Some(delivered.clone()), &requeue, true), taken);
        assert_eq!(stranded(|| taken.clone(), &requeue, true), None);
        assert_eq!(
            stranded(|| None, &Outcome::Requeue { holding: None }, true),
            None
        );
        let registered = Outcome::Registered(Report::after(1));
        assert_eq!(stranded(|| None, &registered, false), None);
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
        assert_eq!(Outcome::Requeue { holding: None }.label(0), "requeued");
        // Only a retry's backoff is noted for the ETA.
        assert_eq!(delayed.retry_backoff(1), Some(SECOND));
        assert_eq!(delayed.retry_backoff(2), None);
        assert_eq!(Outcome::AlreadyDone.retry_backoff(0), None);
    }

    #[test]
    fn every_outcome_label_and_dead_letter_reason_is_in_the_fixed_sets_exported_at_zero() {
        let outcomes = [
            Outcome::Registered(Report::default()),
            Outcome::AlreadyDone,
            Outcome::Delay {
                after: SECOND,
                carried: Carried::default(),
            },
            Outcome::Delay {
                after: SECOND,
                carried: Carried {
                    attempt: 1,
                    ..Carried::default()
                },
            },
            Outcome::dead("rejected", "", 0),
            Outcome::Requeue { holding: None },
        ];
        let labels: std::collections::BTreeSet<_> = outcomes.iter().map(|o| o.label(0)).collect();
        let fixed: std::collections::BTreeSet<_> = OUTCOME_LABELS.into_iter().collect();
        assert_eq!(labels, fixed);

        // Every dead-letter reason written in the worker's source is one of the fixed set.
        for source in [include_str!("plan.rs"), include_str!("mod.rs")] {
            let literals = source
                .split("reason: \"")
                .skip(1)
                .chain(source.split("Outcome::dead(\"").skip(1))
                .chain(source.split("dead(\n").skip(1).filter_map(|s| {
                    let s = s.trim_start();
                    s.strip_prefix('"')
                }));
            for literal in literals {
                let reason = &literal[..literal.find('"').expect("a closed literal")];
                assert!(
                    DEAD_LETTER_REASONS.contains(&reason),
                    "dead-letter reason {reason:?} is missing from DEAD_LETTER_REASONS"
                );
            }
        }
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
}
