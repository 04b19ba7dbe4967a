//! The fleet's registry script (see `permit/registry.rs`): `lua/fleet.lua`.

use super::Call;
use super::invoke;
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
    /// Reads the live entries only.
    Read,
}

/// `lua/fleet.lua`: the replicas' registry. Answers `{NOW_MS, MEMBERS, ALGORITHMS}`.
pub(in crate::permit) struct FleetCall<'a> {
    /// KEYS[1]: the fleet.
    pub fleet: String,
    /// KEYS[2]: the fleet's algorithms.
    pub algorithms: String,
    pub action: FleetAction<'a>,
}

impl FleetCall<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::fleet(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.fleet.clone()).key(self.algorithms.clone());
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
                to.arg("leave").arg(id).arg("").arg(0).arg(algorithm);
            }
            FleetAction::Read => {
                to.arg("read");
            }
        }
    }
}

/// One live entry of the registry, as `lua/fleet.lua` answers it: (ID, SINCE_MS, LAST_MS,
/// ENTRY).
pub(in crate::permit) type FleetMember = (String, i64, i64, String);

/// `lua/fleet.lua`'s answer: (NOW_MS, MEMBERS, ALGORITHMS as a flat list of name, last ms).
pub(in crate::permit) type FleetAnswer = (i64, Vec<FleetMember>, Vec<String>);

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
            action,
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
            ],
        );
    }

    #[test]
    fn a_leave_and_a_read_follow_their_header() {
        let leave = written(FleetAction::Leave {
            id: "r1",
            algorithm: "gcra",
        });
        assert_eq!(leave.args, ["leave", "r1", "", "0", "gcra"]);
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
            ],
        );
        assert_eq!(written(FleetAction::Read).args, ["read"]);
    }
}
