//! `lua/learn.lua`.

use crate::config::Algorithm;
use crate::permit::batch::Operation;
use crate::permit::calls::call::{Call, operate};
use crate::permit::terms::Terms;

/// `lua/learn.lua`: what the downstream's answer (a 429, a recovery, its rate-limit headers)
/// teaches about the seller's real limit, applied to its learned state. See the script's
/// header.
pub(in crate::permit) struct Learn {
    /// KEYS[1] to KEYS[6], the seller's.
    pub learned: String,
    pub accepted: String,
    pub limit: String,
    /// KEYS[4]: the seller's limiter state for the terms' algorithm.
    pub state: String,
    pub reserved: String,
    pub calls: String,
    /// KEYS[7]: the seller's pool of permit-block units, passed with sliding-window only.
    pub pool: String,
    /// ARGV[1] to ARGV[6]: ALGORITHM, the default stack, GUARD, BURST and CAPACITY.
    pub terms: Terms,
    /// ARGV[7]: MIN, the lowest a learned count goes.
    pub min: u32,
    /// ARGV[8]: EVENT: `throttled`, `recovery` or `header`.
    pub event: &'static str,
    /// ARGV[9]: GRANTED in µs.
    pub granted_us: i64,
    /// ARGV[10] to ARGV[13], from headers: LIMIT, WINDOW in µs, REMAINING, RESET in µs (-1 =
    /// none).
    pub told_limit: i64,
    pub told_window_us: i64,
    pub told_remaining: i64,
    pub told_reset_us: i64,
    /// sliding-window: the seller's logs of the routes, the last keys; ARGV[14] says how many.
    pub route_logs: Vec<String>,
}

impl Learn {
    /// The batch's operation (`learn`).
    pub fn operation(&self) -> Operation {
        operate("learn", |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.learned.clone())
            .key(self.accepted.clone())
            .key(self.limit.clone())
            .key(self.state.clone())
            .key(self.reserved.clone())
            .key(self.calls.clone());
        let route_logs: &[String] = match self.terms.algorithm {
            Algorithm::SlidingWindow => &self.route_logs,
            _ => &[],
        };
        if self.terms.algorithm == Algorithm::SlidingWindow {
            to.key(self.pool.clone());
        }
        for log in route_logs {
            to.key(log.clone());
        }
        self.terms.args(to);
        to.arg(self.min)
            .arg(self.event)
            .arg(self.granted_us)
            .arg(self.told_limit)
            .arg(self.told_window_us)
            .arg(self.told_remaining)
            .arg(self.told_reset_us);
        if !route_logs.is_empty() {
            to.arg(route_logs.len());
        }
    }
}

/// `learn.lua`'s answer `{CHANGED, RELEASED, NOW_US, COUNTS, WHY, CONFIGURED, WAKE, LOWERED}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::permit) struct LearnAnswer {
    /// The learned counts changed.
    pub changed: bool,
    /// Reservations given back.
    pub released: u64,
    pub now_us: i64,
    /// The learned counts, comma-separated.
    pub counts: String,
    pub why: String,
    /// The configured counts they are learned from.
    pub configured: String,
    /// Holders of the released reservations are to be told (a reschedule notice).
    pub wake: bool,
    /// The counts went down.
    pub lowered: bool,
}

impl redis::FromRedisValue for LearnAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (changed, released, now_us, counts, why, configured, wake, lowered): (
            u8,
            u64,
            i64,
            String,
            String,
            String,
            u8,
            u8,
        ) = redis::from_redis_value(v)?;
        Ok(Self {
            changed: changed == 1,
            released,
            now_us,
            counts,
            why,
            configured,
            wake: wake == 1,
            lowered: lowered == 1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    const SOURCE: &str = include_str!("../../../lua/learn.lua");

    fn written(algorithm: Algorithm) -> Written {
        let terms = Terms::example(algorithm, true);
        let learn = Learn {
            learned: "learned".into(),
            accepted: "accepted".into(),
            limit: "limit".into(),
            state: "state".into(),
            reserved: "reserved".into(),
            calls: "calls".into(),
            pool: "pool".into(),
            terms,
            min: 2,
            event: "header",
            granted_us: 99,
            told_limit: 50,
            told_window_us: 60,
            told_remaining: 7,
            told_reset_us: -1,
            route_logs: Vec::new(),
        };
        let mut written = Written::default();
        learn.write(&mut written);
        written
    }

    #[test]
    fn keys_and_args_follow_the_header() {
        let sliding = written(Algorithm::SlidingWindow);
        let keys = [
            ("learned", "learned state"),
            ("accepted", "accepted log"),
            ("limit", "limit override"),
            ("state", "limiter state for ALGORITHM"),
            ("reserved", "reserved slots"),
            ("calls", "seller's calls"),
            ("pool", "pool of unclaimed permit-block units"),
        ];
        check(SOURCE, "KEYS", &sliding.keys, &keys);
        // No guard by default with sliding-window, each window's own (-1) with the others.
        let args = |algorithm, guard| {
            [
                (algorithm, "ALGORITHM"),
                ("10", "default COUNTS"),
                ("1000000", "default WINDOWS"),
                (guard, "GUARD"),
                ("3", "BURST"),
                ("4", "CAPACITY"),
                ("2", "MIN"),
                ("header", "EVENT"),
                ("99", "GRANTED"),
                ("50", "LIMIT from headers"),
                ("60", "WINDOW in µs from headers"),
                ("7", "REMAINING"),
                ("-1", "RESET"),
            ]
        };
        check(SOURCE, "ARGV", &sliding.args, &args("sliding-window", "0"));
        let gcra = written(Algorithm::Gcra);
        check(SOURCE, "KEYS", &gcra.keys, &keys[..6]);
        check(SOURCE, "ARGV", &gcra.args, &args("gcra", "-1"));
    }
}
