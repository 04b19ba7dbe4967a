//! The operators' scripts (see `permit/admin.rs`): `lua/usage.lua`, `lua/reschedule.lua`,
//! `lua/global_usage.lua`, `lua/pause.lua` and `lua/reset.lua`.

use std::time::Duration;

use crate::config::{Algorithm, Limits};
use crate::permit::calls::call::{Answer, Call, invoke};
use crate::permit::decision::wait_for;
use crate::permit::error::PermitError;
use crate::permit::outcome::Why;
use crate::permit::scripts;
use crate::permit::terms::Terms;
use crate::permit::usage::{
    Accepted, GlobalShare, GlobalUsage, LimitUsage, Shadow, Usage, binding_of,
};

/// `lua/usage.lua`: how much of each of the seller's limits is taken now, the stack that
/// applies and any pause (read-only). See the script's header.
pub(in crate::permit) struct UsageCall<'a> {
    /// KEYS[1] to KEYS[7], the seller's: its state for the terms' algorithm, limit override,
    /// pause, learned state, shadow limit, calls and reserved set.
    pub state: String,
    pub limit: String,
    pub pause: String,
    pub learned: String,
    pub shadow: String,
    pub calls: String,
    pub reserved: String,
    /// KEYS[8], with adaptive limits on: the seller's accepted log.
    pub accepted: String,
    /// ARGV[1] to ARGV[6] (ALGORITHM, the default stack, GUARD, BURST, CAPACITY) and
    /// ARGV[7] ADAPTIVE.
    pub terms: &'a Terms,
}

impl UsageCall<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::usage(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.state.clone())
            .key(self.limit.clone())
            .key(self.pause.clone())
            .key(self.learned.clone())
            .key(self.shadow.clone())
            .key(self.calls.clone())
            .key(self.reserved.clone());
        if self.terms.adaptive {
            to.key(self.accepted.clone());
        }
        self.terms.args(to);
        to.arg(u8::from(self.terms.adaptive));
    }
}

impl UsageCall<'_> {
    /// The seller's usage from the script's answer `{PAUSED_UNTIL_US, NOW_US, OVERRIDE, COUNTS,
    /// WINDOWS_US, then per limit USED, CAPACITY, AHEAD; then CONFIGURED_COUNTS, WHY, the
    /// shadow limit's COUNTS, WINDOWS_US, AGREE, STRICTER and LOOSER; then per limit
    /// OLDEST_AGE_US; IN_FLIGHT; then per limit DUE; ACCEPTED, ACCEPTED_OLDEST_AGE_US}` (see
    /// the script's header).
    pub fn read(&self, values: &[redis::Value]) -> Result<Usage, PermitError> {
        let answer = Answer {
            values,
            script: "usage",
        };
        let (paused_until, now, overridden) = (answer.int(0)?, answer.int(1)?, answer.int(2)?);
        let limit = answer.limits(3)?;
        let tail = 5 + 3 * limit.len();
        let accepted_at = tail + 8 + 2 * limit.len();
        if answer.values.len() != accepted_at + 2 {
            return Err(answer.bad());
        }
        let configured = Limits::from_args(&answer.text(tail)?, &limit.windows_arg())
            .ok_or_else(|| answer.bad())?;
        let shadow = shadow_at(&answer, tail + 2)?;
        let per_limit = limit
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(LimitUsage {
                    limit: *l,
                    used: answer.count(5 + 3 * i)?,
                    capacity: answer.count(6 + 3 * i)?,
                    ahead: answer.count(7 + 3 * i)?,
                    oldest_age: Duration::from_micros(answer.count(tail + 7 + i)?),
                    guard: self.terms.guard_for(l.window()),
                    due_reserved: answer.count(tail + 8 + limit.len() + i)?,
                })
            })
            .collect::<Result<Vec<_>, PermitError>>()?;
        let binding = binding_of(&per_limit);
        let bound = &per_limit[binding];
        let learned_why = Why::parse(&answer.text(tail + 1)?).filter(|_| configured != limit);
        let in_flight = answer.count(tail + 7 + limit.len())?;
        let accepted = self.terms.adaptive.then_some(()).map(|()| {
            Ok::<_, PermitError>(Accepted {
                units: answer.count(accepted_at)?,
                oldest_age: Duration::from_micros(answer.count(accepted_at + 1)?),
            })
        });
        Ok(Usage {
            accepted: accepted.transpose()?,
            used: bound.used,
            capacity: bound.capacity,
            ahead: bound.ahead,
            limit,
            per_limit,
            binding,
            overridden: overridden == 1,
            paused_for: wait_for(paused_until, now),
            in_flight,
            learned_why,
            configured,
            shadow,
        })
    }
}

/// The shadow limit in `usage.lua`'s answer from `i`: its COUNTS and WINDOWS_US ('' when none),
/// AGREE, STRICTER and LOOSER.
fn shadow_at(answer: &Answer<'_>, i: usize) -> Result<Option<Shadow>, PermitError> {
    let verdicts = |i| answer.text(i).ok().and_then(|n| n.parse::<u64>().ok());
    Ok(
        Limits::from_args(&answer.text(i)?, &answer.text(i + 1)?).map(|limit| Shadow {
            limit,
            agree: verdicts(i + 2).unwrap_or(0),
            stricter: verdicts(i + 3).unwrap_or(0),
            looser: verdicts(i + 4).unwrap_or(0),
            delay: Duration::ZERO,
        }),
    )
}

/// `lua/reschedule.lua`: changes the seller's terms (CHANGE) and gives back every slot
/// reserved under the old ones. See the script's header.
pub(in crate::permit) struct Reschedule<'a> {
    /// KEYS[1] to KEYS[4], the seller's: its state for the terms' algorithm, limit override,
    /// pause and reserved slots.
    pub state: String,
    pub limit: String,
    pub pause: String,
    pub reserved: String,
    /// KEYS[5] and KEYS[6], sliding-window only: the seller's pool and calls.
    pub pool: String,
    pub calls: String,
    /// KEYS[7] (KEYS[5] but with sliding-window), with adaptive limits on: the seller's
    /// learned state.
    pub learned: String,
    /// ARGV[1] to ARGV[6]: ALGORITHM, the default stack, GUARD, BURST and CAPACITY; the
    /// algorithm and adaptive limits decide the keys above.
    pub terms: &'a Terms,
    /// ARGV[7] CHANGE: `set`, `clear`, `resume` or `release`.
    pub change: &'static str,
    /// ARGV[8], with `set`: the new override "COUNTS WINDOWS_US".
    pub set: Option<String>,
    /// The seller's logs of the routes, the last keys; ARGV[9] says how many (see
    /// `lua/include/routes.lua`).
    pub route_logs: Vec<String>,
}

impl Reschedule<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::reschedule(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.state.clone())
            .key(self.limit.clone())
            .key(self.pause.clone())
            .key(self.reserved.clone());
        if self.terms.algorithm == Algorithm::SlidingWindow {
            to.key(self.pool.clone()).key(self.calls.clone());
        }
        if self.terms.adaptive {
            to.key(self.learned.clone());
        }
        for log in &self.route_logs {
            to.key(log.clone());
        }
        self.terms.args(to);
        to.arg(self.change);
        if let Some(set) = &self.set {
            to.arg(set);
        } else if !self.route_logs.is_empty() {
            to.arg("");
        }
        if !self.route_logs.is_empty() {
            to.arg(self.route_logs.len());
        }
    }
}

/// `reschedule.lua`'s answer `{CHANGED, RELEASED, NOW_US}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::permit) struct RescheduleAnswer {
    /// There was something to change (an override to clear, a pause to lift).
    pub changed: bool,
    /// Reserved slots given back.
    pub released: u64,
    pub now_us: i64,
}

impl redis::FromRedisValue for RescheduleAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (changed, released, now_us): (u8, u64, i64) = redis::from_redis_value(v)?;
        Ok(Self {
            changed: changed == 1,
            released,
            now_us,
        })
    }
}

/// `lua/global_usage.lua`: how much of the global limit is taken now and by whom
/// (read-only). See the script's header.
pub(in crate::permit) struct GlobalUsageCall {
    /// The global limit's keys, as `lua/global.lua` takes them (`Keyspace::global_keys`).
    pub keys: [String; 9],
    /// ARGV[1] to ARGV[3]: the global stack and the guard.
    pub counts: String,
    pub windows: String,
    pub guard_us: i64,
}

impl GlobalUsageCall {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::global_usage(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        for key in &self.keys {
            to.key(key.clone());
        }
        to.arg(&self.counts).arg(&self.windows).arg(self.guard_us);
    }
}

impl GlobalUsageCall {
    /// The global limit's use from the script's answer `{NOW_US, COMPETING, WEIGHTS, then per
    /// limit of the stack USED, COUNT, then per seller with units in the shortest window SELLER,
    /// UNITS, WEIGHT}` (see the script's header), the largest share first.
    pub fn read(
        &self,
        values: &[redis::Value],
        global: &Limits,
        terms: &Terms,
    ) -> Result<GlobalUsage, PermitError> {
        let answer = Answer {
            values,
            script: "global usage",
        };
        let per_limit = global
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(LimitUsage {
                    limit: *l,
                    used: answer.count(3 + 2 * i)?,
                    capacity: answer.count(4 + 2 * i)?,
                    ahead: 0,
                    oldest_age: Duration::ZERO,
                    guard: crate::config::global_guard(terms.guard),
                    due_reserved: 0,
                })
            })
            .collect::<Result<Vec<_>, PermitError>>()?;
        let first_share = 3 + 2 * global.len();
        let mut shares = Vec::new();
        for i in (first_share..answer.values.len()).step_by(3) {
            shares.push(GlobalShare {
                seller: answer.text(i)?,
                units: answer.count(i + 1)?,
                weight: u32::try_from(answer.int(i + 2)?).unwrap_or(1).max(1),
            });
        }
        shares.sort_by(|a, b| b.units.cmp(&a.units).then(a.seller.cmp(&b.seller)));
        Ok(GlobalUsage {
            limit: global.clone(),
            per_limit,
            present: answer.count(1)?,
            weights: answer.text(2)?.parse().unwrap_or(0.0),
            shares,
        })
    }
}

/// `lua/pause.lua`: pauses the seller for FOR µs (a longer pause is kept). Answers the
/// pause's end in µs.
pub(in crate::permit) struct Pause {
    /// KEYS[1]: the seller's pause.
    pub pause: String,
    /// ARGV[1]: FOR in µs (at least 1).
    pub for_us: i64,
}

impl Pause {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::pause(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.pause.clone()).arg(self.for_us);
    }
}

/// `lua/reset.lua`: forgets the seller's limiter state behind a pause of one window and its
/// guard. See the script's header.
pub(in crate::permit) struct Reset {
    /// KEYS[1]: the seller's pause.
    pub pause: String,
    /// KEYS[2]: the seller's limit override (read for the pause's span).
    pub limit: String,
    /// KEYS[3…]: the seller's keys to forget.
    pub forget: Vec<String>,
    /// ARGV[1] to ARGV[3]: the default stack and the guard.
    pub counts: String,
    pub windows: String,
    pub guard_us: i64,
}

impl Reset {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::reset(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.pause.clone()).key(self.limit.clone());
        for key in &self.forget {
            to.key(key.clone());
        }
        to.arg(&self.counts).arg(&self.windows).arg(self.guard_us);
    }
}

/// `reset.lua`'s answer `{PAUSED_UNTIL_US, NOW_US, FORGOTTEN}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::permit) struct ResetAnswer {
    pub paused_until_us: i64,
    pub now_us: i64,
    /// How many of the keys to forget existed.
    pub forgotten: u64,
}

impl redis::FromRedisValue for ResetAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (paused_until_us, now_us, forgotten) = redis::from_redis_value(v)?;
        Ok(Self {
            paused_until_us,
            now_us,
            forgotten,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check, lines};
    use super::*;
    use crate::permit::Keyspace;

    fn terms(algorithm: Algorithm, adaptive: bool) -> Terms {
        Terms::example(algorithm, adaptive)
    }

    /// ARGV[1] to ARGV[6] as `Terms::args` writes them for [`terms`].
    fn terms_args<'a>(algorithm: &'a str, guard: &'a str) -> Vec<(&'a str, &'a str)> {
        vec![
            (algorithm, "ALGORITHM"),
            ("10", "default COUNTS"),
            ("1000000", "default WINDOWS"),
            (guard, "GUARD"),
            ("3", "BURST"),
            ("4", "CAPACITY"),
        ]
    }

    #[test]
    fn usage_follows_its_header() {
        const SOURCE: &str = include_str!("../../../lua/usage.lua");
        let terms = terms(Algorithm::Gcra, true);
        let mut written = Written::default();
        UsageCall {
            state: "state".into(),
            limit: "limit".into(),
            pause: "pause".into(),
            learned: "learned".into(),
            shadow: "shadow".into(),
            calls: "calls".into(),
            reserved: "reserved".into(),
            accepted: "accepted".into(),
            terms: &terms,
        }
        .write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[
                ("state", "limiter state for ALGORITHM"),
                ("limit", "limit override"),
                ("pause", "pause"),
                ("learned", "learned state"),
                ("shadow", "shadow limit"),
                ("calls", "seller's calls"),
                ("reserved", "reserved set"),
                ("accepted", "accepted log"),
            ],
        );
        let mut args = terms_args("gcra", &written.args[3]);
        args.push(("1", "ADAPTIVE"));
        check(SOURCE, "ARGV", &written.args, &args);
    }

    #[test]
    fn usage_reads_its_answer_by_the_header() {
        use redis::Value::{BulkString, Int};
        let text = |s: &str| BulkString(s.as_bytes().to_vec());
        let terms = terms(Algorithm::SlidingWindow, false);
        let call = UsageCall {
            state: String::new(),
            limit: String::new(),
            pause: String::new(),
            learned: String::new(),
            shadow: String::new(),
            calls: String::new(),
            reserved: String::new(),
            accepted: String::new(),
            terms: &terms,
        };
        let answer = [
            Int(2_000_000), // PAUSED_UNTIL_US
            Int(1_000_000), // NOW_US
            Int(1),         // OVERRIDE
            text("10"),     // COUNTS
            text("1000000"),
            Int(3), // USED
            Int(10),
            Int(1),     // AHEAD
            text("10"), // CONFIGURED_COUNTS
            text(""),   // WHY
            text("5"),  // the shadow's COUNTS
            text("1000000"),
            text("4"), // AGREE
            text("2"),
            text("1"),
            Int(500), // OLDEST_AGE_US
            Int(2),   // IN_FLIGHT
            Int(1),   // DUE
            Int(7),   // ACCEPTED
            Int(900), // ACCEPTED_OLDEST_AGE_US
        ];
        let usage = call.read(&answer).unwrap();
        assert_eq!(usage.accepted, None, "adaptive limits off: not read");
        assert_eq!((usage.used, usage.capacity, usage.ahead), (3, 10, 1));
        assert!(usage.overridden);
        assert_eq!(usage.paused_for, Duration::from_secs(1));
        assert_eq!(usage.in_flight, 2);
        assert_eq!(usage.per_limit[0].oldest_age, Duration::from_micros(500));
        assert_eq!(usage.per_limit[0].due_reserved, 1);
        let shadow = usage.shadow.unwrap();
        assert_eq!((shadow.agree, shadow.stricter, shadow.looser), (4, 2, 1));
        assert!(call.read(&answer[..17]).is_err(), "one value short");
    }

    fn reschedule(terms: &Terms, set: bool) -> Written {
        let mut written = Written::default();
        Reschedule {
            state: "state".into(),
            limit: "limit".into(),
            pause: "pause".into(),
            reserved: "reserved".into(),
            pool: "pool".into(),
            calls: "calls".into(),
            learned: "learned".into(),
            terms,
            change: if set { "set" } else { "clear" },
            set: set.then(|| "5 1000000".into()),
            route_logs: Vec::new(),
        }
        .write(&mut written);
        written
    }

    #[test]
    fn reschedule_follows_its_header() {
        const SOURCE: &str = include_str!("../../../lua/reschedule.lua");
        let sliding = terms(Algorithm::SlidingWindow, true);
        let full = reschedule(&sliding, true);
        check(
            SOURCE,
            "KEYS",
            &full.keys,
            &[
                ("state", "limiter state for ALGORITHM"),
                ("limit", "limit override"),
                ("pause", "pause"),
                ("reserved", "reserved slots"),
                ("pool", "pool of unclaimed permit-block units"),
                ("calls", "seller's calls"),
                ("learned", "learned"),
            ],
        );
        let mut args = terms_args("sliding-window", &full.args[3]);
        args.extend([("set", "CHANGE"), ("5 1000000", "new override")]);
        check(SOURCE, "ARGV", &full.args, &args);
        // Without sliding-window, the learned state is KEYS[5]; without adaptive limits, none.
        let gcra = reschedule(&terms(Algorithm::Gcra, true), false);
        assert_eq!(
            gcra.keys,
            ["state", "limit", "pause", "reserved", "learned"]
        );
        assert_eq!(gcra.args.len(), 7);
        let plain = reschedule(&terms(Algorithm::Gcra, false), false);
        assert_eq!(plain.keys, ["state", "limit", "pause", "reserved"]);
    }

    #[test]
    fn global_usage_follows_its_header() {
        let mut written = Written::default();
        let keys = Keyspace::new("t").global_keys();
        GlobalUsageCall {
            keys: keys.clone(),
            counts: "10".into(),
            windows: "1000000".into(),
            guard_us: -1,
        }
        .write(&mut written);
        // KEYS[1..8] in its header: the keys global.lua takes, all of them.
        assert_eq!(written.keys, keys);
        assert_eq!(
            lines(include_str!("../../../lua/global.lua"), "KEYS").len(),
            written.keys.len()
        );
        check(
            include_str!("../../../lua/global_usage.lua"),
            "ARGV",
            &written.args,
            &[("10", "COUNTS"), ("1000000", "WINDOWS"), ("-1", "GUARD")],
        );
    }

    #[test]
    fn pause_follows_its_header() {
        const PAUSE: &str = include_str!("../../../lua/pause.lua");
        let mut written = Written::default();
        Pause {
            pause: "pause".into(),
            for_us: 9,
        }
        .write(&mut written);
        check(PAUSE, "KEYS", &written.keys, &[("pause", "pause")]);
        check(PAUSE, "ARGV", &written.args, &[("9", "FOR")]);
    }

    #[test]
    fn reset_follows_its_header() {
        const RESET: &str = include_str!("../../../lua/reset.lua");
        let mut written = Written::default();
        Reset {
            pause: "pause".into(),
            limit: "limit".into(),
            forget: vec!["a".into(), "b".into()],
            counts: "10".into(),
            windows: "1000000".into(),
            guard_us: -1,
        }
        .write(&mut written);
        check(
            RESET,
            "KEYS",
            &written.keys[..2],
            &[("pause", "pause"), ("limit", "limit override")],
        );
        assert_eq!(
            written.keys[2..],
            ["a", "b"],
            "KEYS[3…]: the keys to forget"
        );
        check(
            RESET,
            "ARGV",
            &written.args,
            &[("10", "COUNTS"), ("1000000", "WINDOWS"), ("-1", "GUARD")],
        );
    }
}
