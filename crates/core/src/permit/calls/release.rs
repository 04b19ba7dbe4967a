//! `lua/release.lua`.

use crate::config::Algorithm;
use crate::permit::calls::call::{Call, OnRoute, invoke};
use crate::permit::scripts;

/// `lua/release.lua`: gives back a grant whose call will not be made (refused beyond the
/// seller: its lease or the global limit). Answers 1. See the script's header.
pub(in crate::permit) struct Release<'a> {
    /// KEYS[1]: the seller's limiter state for ALGORITHM.
    pub state: String,
    /// KEYS[2]: the seller's limit override.
    pub limit: String,
    /// KEYS[3]: the seller's calls.
    pub calls: String,
    /// KEYS[4], with adaptive limits on: the seller's learned state.
    pub learned: Option<String>,
    /// ARGV[1] to ARGV[3]: the default stack and the guard.
    pub counts: String,
    pub windows: String,
    pub guard_us: i64,
    /// ARGV[4].
    pub algorithm: Algorithm,
    /// ARGV[5]: TOKEN, the grant's call.
    pub call: &'a str,
    /// ARGV[6]: COST, the units it took.
    pub cost: u32,
    /// ARGV[7]: SLOT in µs, when it was counted.
    pub slot_us: i64,
    /// ARGV[8]: token-bucket's CAPACITY (ignored by the others).
    pub capacity: u32,
    /// The route the call took, if any (its keys last, its stack from ARGV[9]).
    pub route: Option<OnRoute>,
}

impl Release<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::release(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.state.clone())
            .key(self.limit.clone())
            .key(self.calls.clone());
        if let Some(learned) = &self.learned {
            to.key(learned.clone());
        }
        OnRoute::keys(self.route.as_ref(), to);
        to.arg(&self.counts)
            .arg(&self.windows)
            .arg(self.guard_us)
            .arg(self.algorithm.name())
            .arg(self.call)
            .arg(self.cost)
            .arg(self.slot_us)
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
        const SOURCE: &str = include_str!("../../../lua/release.lua");
        let mut written = Written::default();
        Release {
            state: "state".into(),
            limit: "limit".into(),
            calls: "calls".into(),
            learned: Some("learned".into()),
            counts: "10".into(),
            windows: "1000000".into(),
            guard_us: -1,
            algorithm: Algorithm::Gcra,
            call: "c1",
            cost: 2,
            slot_us: 77,
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
                ("limit", "limit override"),
                ("calls", "seller's calls"),
                ("learned", "learned state"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("10", "COUNTS"),
                ("1000000", "WINDOWS"),
                ("-1", "GUARD"),
                ("gcra", "ALGORITHM"),
                ("c1", "TOKEN"),
                ("2", "COST"),
                ("77", "SLOT"),
                ("4", "CAPACITY"),
            ],
        );
    }
}
