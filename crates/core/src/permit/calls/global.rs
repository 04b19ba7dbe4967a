//! `lua/global.lua`.

use crate::permit::calls::call::{Call, invoke};
use crate::permit::scripts;

/// `lua/global.lua`: admits a seller's call under the global limit, shared fairly by the
/// competing sellers. See the script's header.
pub(in crate::permit) struct Global<'a> {
    /// KEYS[1] to KEYS[9]: the global limit's keys, in the script's order (see
    /// `Keyspace::global_keys`).
    pub keys: [String; 9],
    /// ARGV[1] to ARGV[3]: the global stack and the guard.
    pub counts: String,
    pub windows: String,
    pub guard_us: i64,
    /// ARGV[4]: TOKEN of the call.
    pub call: &'a str,
    /// ARGV[5]: COST.
    pub cost: u32,
    /// ARGV[6]: SELLER, the seller's key tag.
    pub seller: &'a str,
    /// ARGV[7]: IDLE in µs.
    pub idle_us: u64,
    /// ARGV[8] FLAGS: +2 durable Redis.
    pub durable: bool,
    /// ARGV[9]: BOUND in µs, the latest the call's answer comes.
    pub bound_us: u64,
}

impl Global<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::global(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        for key in &self.keys {
            to.key(key.clone());
        }
        to.arg(&self.counts)
            .arg(&self.windows)
            .arg(self.guard_us)
            .arg(self.call)
            .arg(self.cost)
            .arg(self.seller)
            .arg(self.idle_us)
            .arg(2 * u8::from(self.durable))
            .arg(self.bound_us);
    }
}

/// `lua/global_end.lua`: a call the global limit granted was answered at `answered_us` (-1:
/// now), or never sent ([`GlobalEnd::UNSENT`]). Answers how many units changed.
pub(in crate::permit) struct GlobalEnd<'a> {
    /// KEYS[1]: the global log.
    pub log: String,
    /// ARGV[1]: TOKEN of the call.
    pub call: &'a str,
    /// ARGV[2]: COST.
    pub cost: u32,
    /// ARGV[3]: SELLER, the seller's key tag.
    pub seller: &'a str,
    /// ARGV[4]: ANSWERED_US (-1 = now, [`GlobalEnd::UNSENT`] = never sent).
    pub answered_us: i64,
}

impl GlobalEnd<'_> {
    /// ANSWERED_US of a call that was never sent: its units leave the log.
    pub const UNSENT: i64 = -2;

    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::global_end(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.log.clone())
            .arg(self.call)
            .arg(self.cost)
            .arg(self.seller)
            .arg(self.answered_us);
    }
}

/// `global.lua`'s answer `{STATUS, AT_US, NOW_US, WHY}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::permit) struct GlobalAnswer {
    /// 1 granted, 0 wait (WHY 1: the seller is ahead of its share, 2: the limit is full),
    /// 4 COST exceeds the smallest COUNT (AT_US is that COUNT).
    pub status: u8,
    pub at_us: i64,
    pub now_us: i64,
    pub why: u8,
}

impl redis::FromRedisValue for GlobalAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (status, at_us, now_us, why) = redis::from_redis_value(v)?;
        Ok(Self {
            status,
            at_us,
            now_us,
            why,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;
    use crate::permit::Keyspace;

    #[test]
    fn keys_and_args_follow_the_header() {
        const SOURCE: &str = include_str!("../../../lua/global.lua");
        let keys = Keyspace::new("t").global_keys();
        let mut written = Written::default();
        Global {
            keys: keys.clone(),
            counts: "10".into(),
            windows: "1000000".into(),
            guard_us: -1,
            call: "c1",
            cost: 2,
            seller: "{s1}",
            idle_us: 9,
            durable: true,
            bound_us: 7,
        }
        .write(&mut written);
        let phrases = [
            "global log",
            "fair state",
            "finish tags",
            "competing sellers",
            "weights",
            "tickets and weights",
            "server stamp",
            "global pause",
            "loss marker",
        ];
        let expected: Vec<(&str, &str)> = keys.iter().map(String::as_str).zip(phrases).collect();
        check(SOURCE, "KEYS", &written.keys, &expected);
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("10", "COUNTS"),
                ("1000000", "WINDOWS"),
                ("-1", "GUARD"),
                ("c1", "TOKEN"),
                ("2", "COST"),
                ("{s1}", "SELLER"),
                ("9", "IDLE"),
                ("2", "FLAGS"),
                ("7", "BOUND"),
            ],
        );
    }

    #[test]
    fn the_end_of_a_call_follows_its_header() {
        const SOURCE: &str = include_str!("../../../lua/global_end.lua");
        let mut written = Written::default();
        GlobalEnd {
            log: "log".into(),
            call: "c1",
            cost: 2,
            seller: "{s1}",
            answered_us: GlobalEnd::UNSENT,
        }
        .write(&mut written);
        check(SOURCE, "KEYS", &written.keys, &[("log", "global log")]);
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("c1", "TOKEN"),
                ("2", "COST"),
                ("{s1}", "SELLER"),
                ("-2", "ANSWERED_US"),
            ],
        );
    }
}
