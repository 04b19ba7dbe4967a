//! `lua/redeem.lua`.

use crate::config::Algorithm;
use crate::permit::batch::Operation;
use crate::permit::calls::call::{Call, OnRoute, operate};

/// `lua/redeem.lua`: grants a slot the seller reserved for TOKEN, if it is still held, the
/// limits it was reserved under still apply and its time has come. See the script's header.
pub(in crate::permit) struct Redeem<'a> {
    /// KEYS[1] to KEYS[10], the seller's.
    pub limit: String,
    pub pause: String,
    /// KEYS[3]: the seller's limiter state for ALGORITHM.
    pub state: String,
    pub reserved: String,
    pub server: String,
    pub calls: String,
    pub learned: String,
    pub shadow: String,
    pub shadow_log: String,
    pub losses: String,
    /// KEYS[11], optional: the message's completion record.
    pub done: Option<String>,
    /// ARGV[1] to ARGV[3]: the default stack and the guard.
    pub counts: String,
    pub windows: String,
    pub guard_us: i64,
    /// ARGV[4] to ARGV[6]: the slot, and the stack it was reserved under.
    pub slot_us: i64,
    pub held_counts: String,
    pub held_windows: String,
    /// ARGV[7] FLAGS: +2 durable Redis, +4 adaptive limits.
    pub durable: bool,
    pub adaptive: bool,
    /// ARGV[8].
    pub algorithm: Algorithm,
    /// ARGV[9]: the TOKEN the slot was reserved with.
    pub token: &'a str,
    /// ARGV[10]: token-bucket's CAPACITY (ignored by the others).
    pub capacity: u32,
    /// ARGV[11]: BOUND in µs.
    pub bound_us: u64,
    /// ARGV[12]: COST the slot was reserved for.
    pub cost: u32,
    /// The route the call takes, if any (its keys last, its stack from ARGV[13]).
    pub route: Option<OnRoute>,
}

impl Redeem<'_> {
    /// The batch's operation (`redeem`).
    pub fn operation(&self) -> Operation {
        operate("redeem", |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.limit.clone())
            .key(self.pause.clone())
            .key(self.state.clone())
            .key(self.reserved.clone())
            .key(self.server.clone())
            .key(self.calls.clone())
            .key(self.learned.clone())
            .key(self.shadow.clone())
            .key(self.shadow_log.clone())
            .key(self.losses.clone());
        if let Some(done) = &self.done {
            to.key(done.clone());
        }
        OnRoute::keys(self.route.as_ref(), to);
        let flags = (2 * u8::from(self.durable)) | (4 * u8::from(self.adaptive));
        to.arg(&self.counts)
            .arg(&self.windows)
            .arg(self.guard_us)
            .arg(self.slot_us)
            .arg(&self.held_counts)
            .arg(&self.held_windows)
            .arg(flags)
            .arg(self.algorithm.name())
            .arg(self.token)
            .arg(self.capacity)
            .arg(self.bound_us)
            .arg(self.cost);
        OnRoute::args(self.route.as_ref(), to);
    }
}

/// `redeem.lua`'s answer `{STATUS, AT_US, NOW_US, VERDICT}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::permit) struct RedeemAnswer {
    /// 1 granted, 2 early, 3 paused, 4 limits changed, 5 too late, 6 already registered,
    /// 8 no such reservation.
    pub status: u8,
    pub at_us: i64,
    pub now_us: i64,
    /// The shadow limit's verdict (with 1), else ''.
    pub verdict: String,
}

impl redis::FromRedisValue for RedeemAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (status, at_us, now_us, verdict) = redis::from_redis_value(v)?;
        Ok(Self {
            status,
            at_us,
            now_us,
            verdict,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    const SOURCE: &str = include_str!("../../../lua/redeem.lua");

    #[test]
    fn keys_and_args_follow_the_header() {
        let redeem = Redeem {
            limit: "limit".into(),
            pause: "pause".into(),
            state: "state".into(),
            reserved: "reserved".into(),
            server: "server".into(),
            calls: "calls".into(),
            learned: "learned".into(),
            shadow: "shadow".into(),
            shadow_log: "shadow_log".into(),
            losses: "losses".into(),
            done: Some("done".into()),
            counts: "10".into(),
            windows: "1000000".into(),
            guard_us: -1,
            slot_us: 77,
            held_counts: "9".into(),
            held_windows: "2000000".into(),
            durable: true,
            adaptive: true,
            algorithm: Algorithm::TokenBucket,
            token: "t1",
            capacity: 4,
            bound_us: 5,
            cost: 2,
            route: None,
        };
        let mut written = Written::default();
        redeem.write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[
                ("limit", "limit override"),
                ("pause", "pause"),
                ("state", "limiter state for ALGORITHM"),
                ("reserved", "reserved slots"),
                ("server", "server stamp"),
                ("calls", "seller's calls"),
                ("learned", "learned state"),
                ("shadow", "shadow limit"),
                ("shadow_log", "shadow log"),
                ("losses", "loss marker"),
                ("done", "completion record"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("10", "default COUNTS"),
                ("1000000", "default WINDOWS"),
                ("-1", "GUARD"),
                ("77", "SLOT"),
                ("9", "COUNTS the slot was reserved under"),
                ("2000000", "WINDOWS_US the slot was reserved under"),
                ("6", "FLAGS"),
                ("token-bucket", "ALGORITHM"),
                ("t1", "TOKEN"),
                ("4", "CAPACITY"),
                ("5", "BOUND"),
                ("2", "COST"),
            ],
        );
    }
}
