//! `lua/ended.lua`.

use crate::permit::batch::Operation;
use crate::permit::calls::call::{Call, operate};

/// `lua/ended.lua`: a call's answer came (or it will not be sent): its END in the seller's
/// calls. Answers 1. See the script's header.
pub(in crate::permit) struct CallEnded<'a> {
    /// KEYS[1]: the seller's calls.
    pub calls: String,
    /// ARGV[1]: TOKEN of the call.
    pub call: &'a str,
    /// ARGV[2]: ANSWERED_US (-1 = now).
    pub answered_us: i64,
    /// ARGV[3]: COST of the call (0 = not known).
    pub cost: u32,
}

impl CallEnded<'_> {
    /// The batch's operation (`ended`).
    pub fn operation(&self) -> Operation {
        operate("ended", |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.calls.clone())
            .arg(self.call)
            .arg(self.answered_us)
            .arg(self.cost);
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    #[test]
    fn keys_and_args_follow_the_header() {
        const SOURCE: &str = include_str!("../../../lua/ended.lua");
        let mut written = Written::default();
        CallEnded {
            calls: "calls".into(),
            call: "c1",
            answered_us: -1,
            cost: 2,
        }
        .write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[("calls", "seller's calls")],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[("c1", "TOKEN"), ("-1", "ANSWERED_US"), ("2", "COST")],
        );
    }
}
