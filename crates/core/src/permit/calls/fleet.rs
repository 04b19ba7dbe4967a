//! The fleet's registry script (see `permit/registry.rs`): `lua/fleet.lua`.

use crate::permit::calls::call::{Call, invoke};
use crate::permit::scripts;

/// What `lua/fleet.lua` does (ARGV[1] and what goes with it).
pub(in crate::permit) enum FleetAction<'a> {
    /// Renews the replica's entry (EXPIRY, RETAIN in ms) and notes its ALGORITHM ('' none).
    Beat {
        id: &'a str,
        entry: &'a str,
        expiry_ms: u64,
        algorithm: &'a str,
        retain_ms: u64,
    },
    /// Takes the replica's entry out, noting its ALGORITHM's last use.
    Leave { id: &'a str, algorithm: &'a str },
    /// Reads the registry (moving the expired entries to the lost ones, as every action does).
    Read,
}

/// `lua/fleet.lua`: the replicas' registry. Answers `{NOW_MS, MEMBERS, ALGORITHMS, LOST, LEFT}`.
pub(in crate::permit) struct FleetCall<'a> {
    /// KEYS[1]: the fleet.
    pub fleet: String,
    /// KEYS[2]: the fleet's algorithms.
    pub algorithms: String,
    /// KEYS[3]: the fleet's lost replicas.
    pub lost: String,
    /// KEYS[4]: the replicas that left lately.
    pub left: String,
    pub action: FleetAction<'a>,
    /// ARGV[7] (LOST_RETAIN): how long a lost replica stays listed, ms.
    pub lost_retain_ms: u64,
}

impl FleetCall<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::fleet(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.fleet.clone())
            .key(self.algorithms.clone())
            .key(self.lost.clone())
            .key(self.left.clone());
        match self.action {
            FleetAction::Beat {
                id,
                entry,
                expiry_ms,
                algorithm,
                retain_ms,
            } => {
                to.arg("beat")
                    .arg(id)
                    .arg(entry)
                    .arg(expiry_ms)
                    .arg(algorithm)
                    .arg(retain_ms);
            }
            FleetAction::Leave { id, algorithm } => {
                to.arg("leave").arg(id).arg("").arg(0).arg(algorithm).arg(0);
            }
            FleetAction::Read => {
                to.arg("read").arg("").arg("").arg(0).arg("").arg(0);
            }
        }
        to.arg(self.lost_retain_ms);
    }
}

/// One live entry of the registry, as `lua/fleet.lua` answers it: (ID, SINCE_MS, LAST_MS,
/// ENTRY).
pub(in crate::permit) type FleetMember = (String, i64, i64, String);

/// One lost replica, as `lua/fleet.lua` answers it: (ID, LOST_MS, LAST_MS, SINCE_MS, ENTRY).
pub(in crate::permit) type FleetLost = (String, i64, i64, i64, String);

/// `lua/fleet.lua`'s answer: (NOW_MS, MEMBERS, ALGORITHMS as a flat list of name, last ms,
/// LOST, LEFT).
pub(in crate::permit) type FleetAnswer = (
    i64,
    Vec<FleetMember>,
    Vec<String>,
    Vec<FleetLost>,
    Vec<String>,
);

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    const SOURCE: &str = include_str!("../../../lua/fleet.lua");

    fn written(action: FleetAction<'_>) -> Written {
        let mut written = Written::default();
        FleetCall {
            fleet: "fleet".into(),
            algorithms: "algorithms".into(),
            lost: "lost".into(),
            left: "left".into(),
            action,
            lost_retain_ms: 900_000,
        }
        .write(&mut written);
        written
    }

    #[test]
    fn a_beat_follows_its_header() {
        let beat = written(FleetAction::Beat {
            id: "r1",
            entry: "{}",
            expiry_ms: 5000,
            algorithm: "gcra",
            retain_ms: 9000,
        });
        check(
            SOURCE,
            "KEYS",
            &beat.keys,
            &[
                ("fleet", "the fleet "),
                ("algorithms", "fleet's algorithms"),
                ("lost", "lost replicas"),
                ("left", "left lately"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &beat.args,
            &[
                ("beat", "ACTION"),
                ("r1", "ID"),
                ("{}", "ENTRY"),
                ("5000", "EXPIRY"),
                ("gcra", "ALGORITHM"),
                ("9000", "RETAIN"),
                ("900000", "LOST_RETAIN"),
            ],
        );
    }

    #[test]
    fn a_leave_and_a_read_follow_their_header() {
        let leave = written(FleetAction::Leave {
            id: "r1",
            algorithm: "gcra",
        });
        assert_eq!(leave.args, ["leave", "r1", "", "0", "gcra", "0", "900000"]);
        check(
            SOURCE,
            "ARGV",
            &leave.args,
            &[
                ("leave", "ACTION"),
                ("r1", "ID"),
                ("", "ENTRY"),
                ("0", "EXPIRY"),
                ("gcra", "ALGORITHM"),
                ("0", "RETAIN"),
                ("900000", "LOST_RETAIN"),
            ],
        );
        let read = written(FleetAction::Read);
        check(
            SOURCE,
            "ARGV",
            &read.args,
            &[
                ("read", "ACTION"),
                ("", "ID"),
                ("", "ENTRY"),
                ("0", "EXPIRY"),
                ("", "ALGORITHM"),
                ("0", "RETAIN"),
                ("900000", "LOST_RETAIN"),
            ],
        );
    }
}
