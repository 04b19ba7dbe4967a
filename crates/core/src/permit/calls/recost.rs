//! `lua/recost.lua`.

use crate::permit::calls::call::{Call, invoke};
use crate::permit::scripts;

/// `lua/recost.lua`: a granted call's units become what the downstream reported it cost, and
/// the charge of its endpoint is learned. Answers `{CHANGED, CHARGE, GIVEN_BACK}` (see
/// [`Recosted`]). See the script's header.
pub(in crate::permit) struct Recost<'a> {
    /// KEYS[1]: the seller's log.
    pub log: String,
    /// KEYS[2]: the seller's calls.
    pub calls: String,
    /// KEYS[3]: the seller's reserved slots.
    pub reserved: String,
    /// KEYS[4]: the charge learned for the call's endpoint.
    pub charge: String,
    /// KEYS[5], for a call on a route: the route's log for the seller.
    pub route_log: Option<String>,
    /// ARGV[1]: TOKEN, the grant's call.
    pub call: &'a str,
    /// ARGV[2]: COST it was granted for.
    pub cost: u32,
    /// ARGV[3]: ACTUAL, what the downstream reported.
    pub actual: u32,
    /// ARGV[4]: SLOT in µs, the grant's slot.
    pub slot_us: i64,
    /// ARGV[5]: REQUESTED, the units its message asked for.
    pub requested: u32,
    /// ARGV[6]: MEMORY in ms, how long a charge learned is kept after the last answer that set
    /// or confirmed it.
    pub memory_ms: u64,
}

/// What `lua/recost.lua` answered: the units added (> 0) or removed (< 0), the charge learned
/// now (0 = none) and how many reservations made for fewer units were given back.
pub(in crate::permit) type Recosted = (i64, u32, u32);

impl Recost<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::recost(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.log.clone())
            .key(self.calls.clone())
            .key(self.reserved.clone())
            .key(self.charge.clone());
        if let Some(route_log) = &self.route_log {
            to.key(route_log.clone());
        }
        to.arg(self.call)
            .arg(self.cost)
            .arg(self.actual)
            .arg(self.slot_us)
            .arg(self.requested)
            .arg(self.memory_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    #[test]
    fn keys_and_args_follow_the_header() {
        const SOURCE: &str = include_str!("../../../lua/recost.lua");
        let mut written = Written::default();
        Recost {
            log: "log".into(),
            calls: "calls".into(),
            reserved: "reserved".into(),
            charge: "charge".into(),
            route_log: Some("route".into()),
            call: "c1",
            cost: 2,
            actual: 5,
            slot_us: 77,
            requested: 1,
            memory_ms: 600_000,
        }
        .write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[
                ("log", "seller's log"),
                ("calls", "seller's calls"),
                ("reserved", "reserved slots"),
                ("charge", "charge learned"),
                ("route", "route's log"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("c1", "TOKEN"),
                ("2", "COST"),
                ("5", "ACTUAL"),
                ("77", "SLOT"),
                ("1", "REQUESTED"),
                ("600000", "MEMORY"),
            ],
        );
    }
}
