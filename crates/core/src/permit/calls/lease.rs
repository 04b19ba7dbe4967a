//! `lua/lease.lua`.

use crate::permit::calls::call::{Call, invoke};
use crate::permit::scripts;

/// `lua/lease.lua`: a lease of one of the seller's calls in flight, under its LIMIT of calls
/// at once. See the script's header.
pub(in crate::permit) struct Lease<'a> {
    /// KEYS[1]: the seller's leases.
    pub leases: String,
    /// KEYS[2]: the seller's next lease ticket.
    pub ticket: String,
    /// ARGV[1]: LIMIT, most calls in flight at once.
    pub limit: u32,
    /// ARGV[2]: TOKEN of the call.
    pub call: &'a str,
    /// ARGV[3]: BOUND in µs (at least 1).
    pub bound_us: u64,
    /// ARGV[4]: POLL in µs.
    pub poll_us: u64,
}

impl Lease<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::lease(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.leases.clone())
            .key(self.ticket.clone())
            .arg(self.limit)
            .arg(self.call)
            .arg(self.bound_us)
            .arg(self.poll_us);
    }
}

/// `lease.lua`'s answer `{STATUS, AT_US, NOW_US}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::permit) struct LeaseAnswer {
    /// Leased (call now); else LIMIT calls are in flight: come back at AT_US.
    pub leased: bool,
    pub at_us: i64,
    pub now_us: i64,
}

impl redis::FromRedisValue for LeaseAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (status, at_us, now_us): (u8, i64, i64) = redis::from_redis_value(v)?;
        Ok(Self {
            leased: status == 1,
            at_us,
            now_us,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    #[test]
    fn keys_and_args_follow_the_header() {
        const SOURCE: &str = include_str!("../../../lua/lease.lua");
        let mut written = Written::default();
        Lease {
            leases: "leases".into(),
            ticket: "ticket".into(),
            limit: 3,
            call: "c1",
            bound_us: 5,
            poll_us: 6,
        }
        .write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[("leases", "leases"), ("ticket", "next lease ticket")],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("3", "LIMIT"),
                ("c1", "TOKEN"),
                ("5", "BOUND"),
                ("6", "POLL"),
            ],
        );
    }
}
