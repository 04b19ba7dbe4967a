//! `lua/unreserve.lua`.

use crate::config::Algorithm;
use crate::permit::calls::call::{Call, OnRoute, invoke};
use crate::permit::scripts;

/// `lua/unreserve.lua`: gives back a reservation whose message will not come back for it.
/// Answers 1 if it was given back, 0 if there was none. See the script's header.
pub(in crate::permit) struct Unreserve<'a> {
    /// KEYS[1]: the seller's limiter state for ALGORITHM.
    pub state: String,
    /// KEYS[2]: the seller's reserved slots.
    pub reserved: String,
    /// ARGV[1].
    pub algorithm: Algorithm,
    /// ARGV[2]: TOKEN the slot was reserved with.
    pub token: &'a str,
    /// ARGV[3]: COST the slot was reserved for.
    pub cost: u32,
    /// ARGV[4] to ARGV[6]: the slot, and the stack it was reserved under.
    pub slot_us: i64,
    pub held_counts: String,
    pub held_windows: String,
    /// ARGV[7]: GUARD in µs.
    pub guard_us: i64,
    /// ARGV[8]: token-bucket's CAPACITY (ignored by the others).
    pub capacity: u32,
    /// The route the message takes, if any (KEYS[3] and KEYS[4], its stack from ARGV[9]).
    pub route: Option<OnRoute>,
}

impl Unreserve<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::unreserve(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.state.clone()).key(self.reserved.clone());
        OnRoute::keys(self.route.as_ref(), to);
        to.arg(self.algorithm.name())
            .arg(self.token)
            .arg(self.cost)
            .arg(self.slot_us)
            .arg(&self.held_counts)
            .arg(&self.held_windows)
            .arg(self.guard_us)
            .arg(self.capacity);
        OnRoute::args(self.route.as_ref(), to);
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    #[test]
    fn keys_and_args_follow_the_header() {
        const SOURCE: &str = include_str!("../../../lua/unreserve.lua");
        let mut written = Written::default();
        Unreserve {
            state: "state".into(),
            reserved: "reserved".into(),
            algorithm: Algorithm::FixedWindow,
            token: "t1",
            cost: 2,
            slot_us: 77,
            held_counts: "10".into(),
            held_windows: "1000000".into(),
            guard_us: -1,
            capacity: 4,
            route: None,
        }
        .write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[
                ("state", "limiter state for ALGORITHM"),
                ("reserved", "reserved slots"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("fixed-window", "ALGORITHM"),
                ("t1", "TOKEN"),
                ("2", "COST"),
                ("77", "SLOT"),
                ("10", "COUNTS"),
                ("1000000", "WINDOWS_US"),
                ("-1", "GUARD"),
                ("4", "CAPACITY"),
            ],
        );
    }
}
