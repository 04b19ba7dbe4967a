//! The decision stage's vocabulary: what a message asks with ([`Rank`], [`Asking`], a held
//! [`Reservation`]) and what the limiter answers ([`Decision`], [`Forfeit`]), with the pure
//! rules that need no Redis (the token a reservation is made with, the units a call asks).

use std::time::Duration;

use crate::config::Limits;
use crate::domain::{Cost, Priority};

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
    pub(super) fn token(rank: Option<&Rank>, routed: bool) -> String {
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
    /// from the downstream's answers raised them, see `PermitStore::cost_to_ask`); `None`:
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
/// same, or a charge learned from its endpoint's answers, see `PermitStore::cost_to_ask`).
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
    /// (`PermitStore::complete_call`, `PermitStore::call_ended`).
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
    pub(super) fn reserved_for(mut self, asked: Asking) -> Self {
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

/// How long a charge learned from the downstream's answers (see `PermitStore::cost_to_ask`)
/// is kept after the last answer that set or confirmed it: a charge no call confirms for that
/// long is forgotten, and the next calls ask their own cost again.
pub const CHARGE_MEMORY: Duration = Duration::from_secs(600);

/// The units a call asks for: its message's `requested` cost, or the charge `learned` from its
/// endpoint's answers when higher, capped at `most` (the smallest COUNT of the stacks it takes,
/// so that a charge never makes it too costly to be granted) but never below `requested`.
pub(crate) fn charged_cost(requested: Cost, learned: Option<u32>, most: u32) -> Cost {
    learned
        .map(|charge| charge.min(most).min(Cost::MAX))
        .and_then(Cost::new)
        .map_or(requested, |charge| charge.max(requested))
}

/// The charge a learned-charge key holds (see [`Keyspace::charge`]): an integer from 1 to
/// [`Cost::MAX`] written as one, else `None` (the key is read as untrusted).
pub(super) fn parse_charge(value: Option<&[u8]>) -> Option<u32> {
    let text = std::str::from_utf8(value?).ok()?;
    let units: u32 = text.parse().ok()?;
    (units.to_string() == text && Cost::new(units).is_some()).then_some(units)
}

/// How long after its grant a call may still start: a worker that could not send it sooner
/// drops the grant (the call's place is kept until its bound, never less).
pub const CALL_ALLOWANCE: Duration = Duration::from_secs(1);

/// How much later than one window + guard sliding-window and gcra still serve a reserved slot
/// (`SLOW_LINK_LATE` in `lua/include/reservations.lua`): room for the round trips a redeem
/// answered "early" by the calls gate costs its message through a slow link to Redis. The
/// seller's reserved slots (and the keys that keep them) outlive their last slot by as much.
pub const SLOW_LINK_LATENESS: Duration = Duration::from_secs(2);

pub(super) fn wait_for(at_us: i64, now_us: i64) -> Duration {
    Duration::from_micros(at_us.saturating_sub(now_us).max(0) as u64)
}

/// Most a [`wait_since`] comes back after its time, to allow for the link's jitter.
const COME_BACK_MARGIN: Duration = Duration::from_millis(20);

/// How long to wait from now to come back at Redis time `at_us`, as told by an answer that
/// found Redis at `now_us` to a request that left at `sent`: counted from when that request
/// left, not from its answer, so that the next request reaches Redis about at `at_us` however
/// far Redis is (the link's latency each way cancels out; counted from the answer, every
/// come-back reached Redis a whole round trip late, and a slow Redis cost a window two round
/// trips instead of one). A tenth of the round trip (at most [`COME_BACK_MARGIN`]) is added:
/// a request a little late costs that much, one a little early is told to come back again, a
/// whole round trip more.
pub(super) fn wait_since(at_us: i64, now_us: i64, sent: std::time::Instant) -> Duration {
    let round_trip = sent.elapsed();
    let margin = (round_trip / 10).min(COME_BACK_MARGIN);
    (wait_for(at_us, now_us) + margin).saturating_sub(round_trip)
}

/// A seller's limit override as the scripts write it (`"COUNTS WINDOWS_US"`); `None` if it is
/// not well-formed (the scripts ignore it then).
pub(in crate::permit) fn parse_override(raw: &str) -> Option<Limits> {
    let (counts, windows) = raw.split_once(' ')?;
    Limits::from_args(counts, windows)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_come_back_counts_from_when_the_request_left_plus_a_tenth_of_the_round_trip() {
        // Told at Redis time 0 to come back at 1 s, by a request that left 200 ms ago: come
        // back 800 ms from now, and 20 ms more for jitter.
        let sent = Instant::now() - Duration::from_millis(200);
        let wait = wait_since(1_000_000, 0, sent);
        assert!(
            (Duration::from_millis(800)..=Duration::from_millis(820)).contains(&wait),
            "{wait:?}"
        );
        // A far Redis: the margin stays at most 20 ms.
        let sent = Instant::now() - Duration::from_secs(2);
        let wait = wait_since(10_000_000, 0, sent);
        assert!(
            (Duration::from_millis(8_000)..=Duration::from_millis(8_020)).contains(&wait),
            "{wait:?}"
        );
        // A time already past, or nearer than the round trip: at once.
        assert_eq!(wait_since(100_000, 0, sent), Duration::ZERO);
        assert_eq!(wait_since(0, 5, Instant::now()), Duration::ZERO);
    }
}
