//! The operator's side of sellers' terms, as every replica applies them: limit overrides,
//! pauses, shadow limits and weights under the global limit, set and read; how much of each
//! seller's limits (and of the global limit) is taken now, and what adaptive limits learned.
//!
//! An [`Admin`] needs only a connection, the key prefix and the [`Terms`] the scripts read a
//! seller's state under (the algorithm, the default stack, the guard, ...), not the hot path's
//! tuning: an operator command builds one from those, a replica takes its own from
//! [`PermitStore::admin`](super::PermitStore::admin). A change of a seller's terms is
//! announced in the shared reschedule log, from which every replica's
//! [`watch_reschedules`](super::watch_reschedules) wakes the messages it holds for the seller.

use std::sync::Arc;
use std::time::Duration;

use redis::AsyncCommands;

use crate::config::{Algorithm, Limits};
use crate::domain::SellerId;
use crate::permit::applied::Applied;
use crate::permit::calls::{
    GlobalUsageCall, Pause, Reschedule, RescheduleAnswer, Reset, ResetAnswer, UsageCall,
};
use crate::permit::conn::RedisConn;
use crate::permit::decision::{Reservation, parse_override, wait_for};
use crate::permit::error::PermitError;
use crate::permit::keys::Keyspace;
use crate::permit::outcome::Why;
use crate::permit::terms::Terms;
use crate::permit::usage::{GlobalUsage, Shadow, Usage};

/// Largest COUNT of a shadow limit: its log keeps at most this many units per seller (see
/// `judge_shadow` in `lua/include/shadow.lua`).
pub const MAX_SHADOW_COUNT: u32 = 10_000;

/// Most a seller's weight under the global limit may be.
pub const MAX_WEIGHT: u32 = 1000;

/// The longest pause an operator may set (`limits pause`), and what a pause given no duration
/// lasts: until `limits resume`, at most this long. A paused seller's waiting messages reserve
/// their slot at the pause's end, which a resume gives back at once so that they come back
/// then; replicas reserve at most TURNSTILE_RESERVE_HORIZON ahead (24 hours by default), and a
/// message told to wait longer than that waits without a reservation, for the pause's original
/// end, whatever a resume does. So a pause stays within the default horizon.
pub const LONGEST_PAUSE: Duration = Duration::from_secs(24 * 3600);

/// A pause an operator may not set (see [`pause_span`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PauseSpanError {
    /// A pause that lasts no time.
    #[error("a pause must last more than 0s (at most 24h); to lift a pause: `limits resume`")]
    Zero,
    /// A pause beyond [`LONGEST_PAUSE`].
    #[error(
        "a pause lasts at most 24h: the replicas reserve waiting messages' slots at most 24h ahead \
         (TURNSTILE_RESERVE_HORIZON's default), and a longer wait is not reached by `limits \
         resume`; pause again to extend one"
    )]
    TooLong(Duration),
}

/// How long an operator's pause lasts: `requested`, or without one [`LONGEST_PAUSE`] (until
/// resumed); refused when it is zero or longer than [`LONGEST_PAUSE`].
pub fn pause_span(requested: Option<Duration>) -> Result<Duration, PauseSpanError> {
    match requested {
        None => Ok(LONGEST_PAUSE),
        Some(d) if d.is_zero() => Err(PauseSpanError::Zero),
        Some(d) if d > LONGEST_PAUSE => Err(PauseSpanError::TooLong(d)),
        Some(d) => Ok(d),
    }
}

/// What adaptive limits learned of a seller (see [`Admin::learned`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Learned {
    /// The stack configured for the seller (its override or the default).
    pub configured: Limits,
    /// The stack that applies: `configured` with the learned counts.
    pub limit: Limits,
    /// The stack before the last change, if there was one.
    pub from: Option<Limits>,
    pub why: Option<Why>,
    pub changed_ago: Option<Duration>,
    /// Windows of full use the next raise waits for.
    pub patience: u32,
    /// The downstream's quota from rate-limit headers, while it lasts.
    pub quota: Option<Quota>,
}

/// What rate-limit headers said is left of a seller's quota at the downstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    pub left: u64,
    pub resets_in: Duration,
}

/// A change of a seller's terms (see [`Admin::reschedule`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// The seller's limit becomes this override (one limit or a stack).
    Set(Limits),
    /// The seller's override is removed (the default applies).
    Clear,
    /// The seller's pause is lifted.
    Resume,
    /// Nothing changes but every reserved slot is given back.
    Release,
}

/// How long a reschedule stays in the shared log (a replica that polls less often than this
/// misses it: its held messages then come back at their old slots, as before the change).
const RESCHEDULE_LOG_SPAN: Duration = Duration::from_secs(3600);

/// A seller whose terms changed at `at_us` (Redis time): every reservation of the seller made
/// before then was given back, and whoever holds one should come back now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rescheduled {
    pub seller: String,
    pub at_us: i64,
}

impl Rescheduled {
    /// Whether this notice concerns a message of `seller` holding `reservation`.
    pub fn concerns(&self, seller: &str, reservation: &Reservation) -> bool {
        self.seller == seller && reservation.reserved_at_us <= self.at_us
    }
}

/// Reads and changes sellers' terms in Redis, under one key prefix: what the operator commands,
/// the dashboard and the HTTP API use, and what a replica pauses a seller with.
#[derive(Clone)]
pub struct Admin {
    conn: RedisConn,
    keys: Keyspace,
    /// The terms it reads under, unless it follows a replica's (`follows`).
    fixed: Terms,
    /// The terms a replica grants under, as the fleet replaces them (see [`Applied`]).
    follows: Option<Arc<Applied>>,
    /// The routes of the routes file (see [`crate::routes`]): a change gives back their
    /// reservations in their logs too.
    routes: Vec<crate::domain::RouteName>,
}

impl Admin {
    pub fn new(conn: RedisConn, prefix: &str, terms: Terms) -> Self {
        Self {
            conn,
            keys: Keyspace::new(prefix),
            fixed: terms,
            follows: None,
            routes: Vec::new(),
        }
    }

    /// Gives back reservations on `routes` in their logs too when the seller's terms change.
    pub fn with_routes(mut self, routes: &crate::routes::Routes) -> Self {
        self.routes = routes.iter().map(|route| route.name.clone()).collect();
        self
    }

    /// An `Admin` that reads under the terms a replica grants under, whatever they become.
    pub(crate) fn following(conn: RedisConn, prefix: &str, applied: Arc<Applied>) -> Self {
        Self {
            follows: Some(applied.clone()),
            ..Self::new(conn, prefix, Terms::from(&*applied.current()))
        }
    }

    /// The terms it reads and changes sellers' state under now.
    pub fn terms(&self) -> Terms {
        match &self.follows {
            Some(applied) => Terms::from(&*applied.current()),
            None => self.fixed.clone(),
        }
    }

    /// The default stack (a seller without an override is held to it).
    pub fn default_limit(&self) -> Limits {
        self.terms().limit
    }

    /// How much of the global limit is taken now and by whom, in one read-only round trip;
    /// `None` without a global limit.
    pub async fn global_usage(&self) -> Result<Option<GlobalUsage>, PermitError> {
        let terms = self.terms();
        let Some(global) = &terms.global_limit else {
            return Ok(None);
        };
        let call = GlobalUsageCall {
            keys: self.keys.global_keys(),
            counts: global.counts_arg(),
            windows: global.windows_arg(),
            guard_us: Terms::guard_arg_of(Some(crate::config::global_guard(terms.guard))),
        };
        let answer: Vec<redis::Value> = call
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        call.read(&answer, global, &terms).map(Some)
    }

    /// Sets a seller's weight under the global limit (1 = the default share; 1 to
    /// [`MAX_WEIGHT`]), effective at its next activation on every replica.
    pub async fn set_weight(&self, seller: &SellerId, weight: u32) -> Result<(), PermitError> {
        let mut conn = self.conn.clone();
        let key = self.keys.global_weights();
        if weight <= 1 {
            let _: i64 = conn.hdel(key, seller.key_tag()).await?;
        } else {
            let _: i64 = conn
                .hset(key, seller.key_tag(), weight.min(MAX_WEIGHT))
                .await?;
        }
        Ok(())
    }

    /// A seller's weight under the global limit (1 unless set).
    pub async fn weight(&self, seller: &SellerId) -> Result<u32, PermitError> {
        let weight: Option<u32> = self
            .conn
            .clone()
            .hget(self.keys.global_weights(), seller.key_tag())
            .await?;
        Ok(weight.unwrap_or(1).max(1))
    }

    /// What adaptive limits learned of the seller under its configured stack now, if anything
    /// (see `lua/learn.lua`): read by operator commands and the dashboard; `None` with adaptive
    /// limits off (nothing learned applies then).
    pub async fn learned(&self, seller: &SellerId) -> Result<Option<Learned>, PermitError> {
        let terms = self.terms();
        if !terms.adaptive {
            return Ok(None);
        }
        let fields: std::collections::HashMap<String, String> =
            self.conn.clone().hgetall(self.keys.learned(seller)).await?;
        let configured = self.effective_limit(seller).await?;
        let terms = format!("{} {}", configured.counts_arg(), configured.windows_arg());
        if fields.get("terms") != Some(&terms) {
            return Ok(None);
        }
        let windows = configured.windows_arg();
        let stack = |field: &str| {
            fields
                .get(field)
                .and_then(|counts| Limits::from_args(counts, &windows))
        };
        let number = |field: &str| fields.get(field).and_then(|v| v.parse::<i64>().ok());
        let now = self.redis_time_us().await?;
        let quota = match (number("left"), number("until")) {
            (Some(left), Some(until)) if until > now => Some(Quota {
                left: left.max(0) as u64,
                resets_in: wait_for(until, now),
            }),
            _ => None,
        };
        Ok(Some(Learned {
            limit: stack("counts").unwrap_or_else(|| configured.clone()),
            from: stack("from"),
            why: fields.get("why").and_then(|w| Why::parse(w)),
            changed_ago: number("at")
                .filter(|&at| at > 0)
                .map(|at| wait_for(now, at)),
            patience: number("patience").unwrap_or(1).clamp(1, 64) as u32,
            quota,
            configured,
        }))
    }

    /// Sets the seller's shadow limit (one limit or a stack), judged beside the enforced one
    /// from now on and never enforced (see `judge_shadow` in `lua/include/shadow.lua`); its verdicts
    /// start from zero.
    pub async fn set_shadow(&self, seller: &SellerId, limit: Limits) -> Result<(), PermitError> {
        let key = self.keys.shadow(seller);
        redis::pipe()
            .atomic()
            .del(&key)
            .ignore()
            .del(self.keys.shadow_log(seller))
            .ignore()
            .hset_multiple(
                &key,
                &[
                    ("counts", limit.counts_arg()),
                    ("windows", limit.windows_arg()),
                ],
            )
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Removes the seller's shadow limit; whether there was one.
    pub async fn clear_shadow(&self, seller: &SellerId) -> Result<bool, PermitError> {
        let (removed, _): (u8, u8) = redis::pipe()
            .atomic()
            .del(self.keys.shadow(seller))
            .del(self.keys.shadow_log(seller))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(removed == 1)
    }

    /// The seller's shadow limit and what it would have done so far, if one is set.
    pub async fn shadow(&self, seller: &SellerId) -> Result<Option<Shadow>, PermitError> {
        let fields: std::collections::HashMap<String, String> =
            self.conn.clone().hgetall(self.keys.shadow(seller)).await?;
        let (Some(counts), Some(windows)) = (fields.get("counts"), fields.get("windows")) else {
            return Ok(None);
        };
        let Some(limit) = Limits::from_args(counts, windows) else {
            return Ok(None);
        };
        let number = |field: &str| {
            fields
                .get(field)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Ok(Some(Shadow {
            limit,
            agree: number("agree"),
            stricter: number("stricter"),
            looser: number("looser"),
            delay: Duration::from_millis(number("delay_ms")),
        }))
    }

    /// Pauses the seller on every replica for `duration`; returns how long the pause now lasts
    /// (an existing longer pause is kept).
    pub async fn pause(
        &self,
        seller: &SellerId,
        duration: Duration,
    ) -> Result<Duration, PermitError> {
        let duration_us = duration.as_micros().clamp(1, i64::MAX as u128) as i64;
        let pause = Pause {
            pause: self.keys.pause(seller),
            for_us: duration_us,
        };
        let until: i64 = pause
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        let now = self.redis_time_us().await?;
        Ok(wait_for(until, now))
    }

    /// An operator's pause: pauses the seller on every replica for `duration` (as
    /// [`Admin::pause`]: a longer pause in force is kept), then gives back every slot reserved
    /// for its waiting messages and the unclaimed units of its permit block (see
    /// `lua/reschedule.lua`), announced to every replica: the messages held for a slot come
    /// back at once, find the seller paused and reserve anew after the pause, and no call
    /// starts after the pause but the ones granted before it. Returns how long the pause lasts
    /// (see [`pause_span`] for what an operator may ask).
    pub async fn pause_now(
        &self,
        seller: &SellerId,
        duration: Duration,
    ) -> Result<Duration, PermitError> {
        let paused = self.pause(seller, duration).await?;
        self.reschedule(seller, Change::Release).await?;
        Ok(paused)
    }

    /// How long the seller stays paused (zero when not paused).
    pub async fn paused_for(&self, seller: &SellerId) -> Result<Duration, PermitError> {
        let until: Option<i64> = self.conn.clone().get(self.keys.pause(seller)).await?;
        let now = self.redis_time_us().await?;
        Ok(wait_for(until.unwrap_or(0), now))
    }

    /// How much of each of the seller's limits is taken now, the stack that applies and any
    /// pause, in one read-only round trip (for the dashboard; the limiter never needs it).
    pub async fn usage(&self, seller: &SellerId) -> Result<Usage, PermitError> {
        let terms = self.terms();
        let call = UsageCall {
            state: self.keys.state(seller, terms.algorithm),
            limit: self.keys.limit(seller),
            pause: self.keys.pause(seller),
            learned: self.keys.learned(seller),
            shadow: self.keys.shadow(seller),
            calls: self.keys.calls(seller),
            reserved: self.keys.reserved(seller, terms.algorithm),
            accepted: self.keys.accepted(seller),
            terms: &terms,
        };
        let answer: Vec<redis::Value> = call
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        call.read(&answer)
    }

    /// Redis server time in µs.
    pub async fn redis_time_us(&self) -> Result<i64, PermitError> {
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(secs * 1_000_000 + micros)
    }

    /// The seller's override, if one is set (and well-formed: the scripts ignore any other).
    pub async fn limit_override(&self, seller: &SellerId) -> Result<Option<Limits>, PermitError> {
        let raw: Option<String> = self.conn.clone().get(self.keys.limit(seller)).await?;
        Ok(raw.as_deref().and_then(parse_override))
    }

    /// The stack that applies to the seller: its override or the default.
    pub async fn effective_limit(&self, seller: &SellerId) -> Result<Limits, PermitError> {
        let terms = self.terms();
        Ok(self
            .limit_override(seller)
            .await?
            .unwrap_or_else(|| terms.limit.clone()))
    }

    /// Lifts the seller's pause on every replica at once; whether it was paused.
    pub async fn resume(&self, seller: &SellerId) -> Result<bool, PermitError> {
        self.reschedule(seller, Change::Resume).await
    }

    /// Forgets the seller's limiter state (see `lua/reset.lua`) behind a pause of one window
    /// and its guard, so that no call granted under the forgotten state shares a window with a
    /// new one, and wakes the messages held for its reserved slots on every replica. Returns
    /// how long the seller is paused.
    pub async fn reset(&self, seller: &SellerId) -> Result<Duration, PermitError> {
        let terms = self.terms();
        let mut forget: Vec<String> = Algorithm::ALL
            .into_iter()
            .map(|algorithm| self.keys.state(seller, algorithm))
            .collect();
        forget.extend([
            self.keys.reserved(seller, terms.algorithm),
            self.keys.far(seller),
            self.keys.give_way(seller),
            self.keys.pool(seller),
            self.keys.learned(seller),
            self.keys.accepted(seller),
            self.keys.server(seller),
        ]);
        let reset = Reset {
            pause: self.keys.pause(seller),
            limit: self.keys.limit(seller),
            forget,
            counts: terms.limit.counts_arg(),
            windows: terms.limit.windows_arg(),
            guard_us: terms.guard_arg(),
        };
        let ResetAnswer {
            paused_until_us: until,
            now_us: now,
            ..
        } = reset
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        self.announce(seller, 0, now).await?;
        Ok(wait_for(until, now))
    }

    /// Sets a per-seller override (one limit or a stack), effective at once on every replica.
    pub async fn set_limit(
        &self,
        seller: &SellerId,
        limit: impl Into<Limits>,
    ) -> Result<(), PermitError> {
        let limit = limit.into();
        self.reschedule(seller, Change::Set(limit)).await?;
        Ok(())
    }

    /// Sets the seller's override of a route's stack (`limits set --seller S --route R`), then
    /// gives back the seller's reservations (in every route's log this `Admin` knows, see
    /// [`Admin::with_routes`]) so that its backlog is slotted again under it. A call granted
    /// between the two steps (a few milliseconds) was slotted under the route's old stack.
    pub async fn set_route_limit(
        &self,
        seller: &SellerId,
        route: &crate::domain::RouteName,
        limit: &Limits,
    ) -> Result<(), PermitError> {
        if limit.has_calendar() && self.terms().algorithm != crate::config::Algorithm::SlidingWindow
        {
            return Err(PermitError::Refused(
                "ERR turnstile: a calendar limit (COUNT/1d@...) needs sliding-window".into(),
            ));
        }
        let value = format!("{} {}", limit.counts_arg(), limit.windows_arg());
        let _: () = self
            .conn
            .clone()
            .set(self.keys.route_limit(seller, route), value)
            .await?;
        self.release_on(seller, route).await
    }

    /// Gives back the seller's reservations, in `route`'s log too whether or not this `Admin`
    /// knows the routes file.
    async fn release_on(
        &self,
        seller: &SellerId,
        route: &crate::domain::RouteName,
    ) -> Result<(), PermitError> {
        let mut admin = self.clone();
        if !admin.routes.contains(route) {
            admin.routes.push(route.clone());
        }
        admin.reschedule(seller, Change::Release).await?;
        Ok(())
    }

    /// Removes the seller's override of a route's stack (the routes file's applies again) and
    /// slots its backlog again; returns whether there was one.
    pub async fn clear_route_limit(
        &self,
        seller: &SellerId,
        route: &crate::domain::RouteName,
    ) -> Result<bool, PermitError> {
        let removed: u64 = self
            .conn
            .clone()
            .del(self.keys.route_limit(seller, route))
            .await?;
        self.release_on(seller, route).await?;
        Ok(removed > 0)
    }

    /// The seller's override of a route's stack, if one is set.
    pub async fn route_limit(
        &self,
        seller: &SellerId,
        route: &crate::domain::RouteName,
    ) -> Result<Option<Limits>, PermitError> {
        let raw: Option<String> = self
            .conn
            .clone()
            .get(self.keys.route_limit(seller, route))
            .await?;
        Ok(raw.as_deref().and_then(parse_override))
    }

    /// Removes a per-seller override; returns whether there was one.
    pub async fn clear_limit(&self, seller: &SellerId) -> Result<bool, PermitError> {
        self.reschedule(seller, Change::Clear).await
    }

    /// Applies `change` to the seller's terms and gives back every slot reserved under the old
    /// ones in the same atomic step (see `lua/reschedule.lua`), then announces it in the
    /// shared reschedule log, from which every replica's
    /// [`watch_reschedules`](super::watch_reschedules) wakes the messages it holds for the
    /// seller: the new terms apply at once to the whole backlog.
    /// Returns whether there was something to change (an override to clear, a pause to lift).
    pub async fn reschedule(&self, seller: &SellerId, change: Change) -> Result<bool, PermitError> {
        let terms = self.terms();
        let (change, set) = match change {
            Change::Set(limit) => (
                "set",
                Some(format!("{} {}", limit.counts_arg(), limit.windows_arg())),
            ),
            Change::Clear => ("clear", None),
            Change::Resume => ("resume", None),
            Change::Release => ("release", None),
        };
        let reschedule = Reschedule {
            state: self.keys.state(seller, terms.algorithm),
            limit: self.keys.limit(seller),
            pause: self.keys.pause(seller),
            reserved: self.keys.reserved(seller, terms.algorithm),
            pool: self.keys.pool(seller),
            calls: self.keys.calls(seller),
            learned: self.keys.learned(seller),
            terms: &terms,
            change,
            set,
            route_logs: self
                .routes
                .iter()
                .map(|route| self.keys.route_log(seller, route))
                .collect(),
        };
        let RescheduleAnswer {
            changed,
            released,
            now_us,
        } = reschedule
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        self.announce(seller, released, now_us).await?;
        Ok(changed)
    }

    /// Announces that the seller's terms changed at `now` (Redis µs) and `released` reserved
    /// slots were given back, in the shared reschedule log, from which every replica's
    /// [`watch_reschedules`](super::watch_reschedules) wakes the messages it holds for the seller.
    pub(super) async fn announce(
        &self,
        seller: &SellerId,
        released: u64,
        now: i64,
    ) -> Result<(), PermitError> {
        metrics::counter!("turnstile_reservations_released_total").increment(released);
        let log = self.keys.reschedules();
        redis::pipe()
            .zadd(&log, seller.as_str(), now)
            .ignore()
            .zrembyscore(&log, "-inf", now - RESCHEDULE_LOG_SPAN.as_micros() as i64)
            .ignore()
            .pexpire(&log, RESCHEDULE_LOG_SPAN.as_millis() as i64)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Sellers whose terms changed after `since_us` (Redis time), oldest first, with when: read
    /// from the shared reschedule log (at most 1,000 at a time).
    pub(crate) async fn rescheduled_since(
        &self,
        since_us: i64,
    ) -> Result<Vec<Rescheduled>, PermitError> {
        let entries: Vec<(String, f64)> = redis::cmd("ZRANGEBYSCORE")
            .arg(self.keys.reschedules())
            .arg(format!("({since_us}"))
            .arg("+inf")
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(1000)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(entries
            .into_iter()
            .map(|(seller, at)| Rescheduled {
                seller,
                at_us: at as i64,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operators_pause_lasts_what_was_asked_or_until_resumed_within_the_longest() {
        assert_eq!(pause_span(None), Ok(LONGEST_PAUSE));
        for asked in [
            Duration::from_micros(1),
            Duration::from_secs(600),
            LONGEST_PAUSE,
        ] {
            assert_eq!(pause_span(Some(asked)), Ok(asked));
        }
        assert_eq!(pause_span(Some(Duration::ZERO)), Err(PauseSpanError::Zero));
        let long = LONGEST_PAUSE + Duration::from_millis(1);
        assert_eq!(pause_span(Some(long)), Err(PauseSpanError::TooLong(long)));
        // The longest pause is what replicas reserve ahead by default: a resume reaches every
        // waiting message.
        assert_eq!(LONGEST_PAUSE, crate::config::LimiterArgs::default().horizon);
        for error in [PauseSpanError::Zero, PauseSpanError::TooLong(long)] {
            assert!(error.to_string().contains("24h"), "{error}");
        }
    }
}
