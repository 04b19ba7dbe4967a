//! `lua/complete.lua`.

use crate::permit::batch::Operation;
use crate::permit::calls::call::{AdaptiveKeys, Call, operate};
use crate::permit::completion::{RecordState, moved_to};

/// `lua/complete.lua`: moves a message's completion record to the state it is in now
/// (OUTCOME), counts it there once in its batch's progress, and records the answer of the CALL
/// that registered it (its end in the seller's calls and, with adaptive limits, its acceptance
/// in the accepted log). See the script's header.
pub(in crate::permit) struct Complete<'a> {
    /// KEYS[1]: the message's completion record.
    pub done: String,
    /// KEYS[2]: the seller's calls.
    pub calls: String,
    /// ADAPTIVE (ARGV[7]): the seller's keys (KEYS[3] to KEYS[5]) and the defaults
    /// (ARGV[8] to ARGV[10]); `None`: adaptive limits off (or no call to note).
    pub adaptive: Option<(AdaptiveKeys, AdaptiveArgs)>,
    /// The batch whose progress counts the message (KEYS[6], or KEYS[3] without ADAPTIVE;
    /// ARGV[11] to ARGV[13]).
    pub batch: Option<CompleteBatch<'a>>,
    /// ARGV[1]: TTL of the record and the progress, in ms (at least 1).
    pub ttl_ms: u64,
    /// ARGV[2]: `registered`, `dead` or `replayed`.
    pub outcome: &'static str,
    /// ARGV[3]: with `dead`, the REASON ('' otherwise).
    pub reason: &'a str,
    /// ARGV[4]: the token of the call that registered it ('' when none).
    pub call: &'a str,
    /// ARGV[5]: when the call's answer came (Redis µs; -1 = now).
    pub answered_us: i64,
    /// ARGV[6]: the message's cost (0 = not known).
    pub cost: u32,
    /// ARGV[14]: with `registered`, the message's result kept in the record until it is
    /// published ('' = none; ARGV[11] to ARGV[13] are then written even without a batch).
    pub result: &'a str,
}

/// ARGV[8] to ARGV[10] of `complete.lua` with ADAPTIVE: the default stack and the guard.
pub(in crate::permit) struct AdaptiveArgs {
    pub counts: String,
    pub windows: String,
    pub guard_us: i64,
}

/// A message's batch as `complete.lua` counts it: its progress key and the SELLER, BATCH and
/// BATCH_SIZE arguments.
pub(in crate::permit) struct CompleteBatch<'a> {
    pub progress: String,
    pub seller: &'a str,
    pub batch: &'a str,
    /// 0 = none given.
    pub size: u32,
}

impl Complete<'_> {
    /// The batch's operation (`complete`).
    pub fn operation(&self) -> Operation {
        operate("complete", |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.done.clone()).key(self.calls.clone());
        if let Some((keys, _)) = &self.adaptive {
            to.key(keys.learned.clone())
                .key(keys.accepted.clone())
                .key(keys.limit.clone());
        }
        if let Some(batch) = &self.batch {
            to.key(batch.progress.clone());
        }
        to.arg(self.ttl_ms)
            .arg(self.outcome)
            .arg(self.reason)
            .arg(self.call)
            .arg(self.answered_us)
            .arg(self.cost);
        match &self.adaptive {
            Some((_, args)) => to
                .arg(1)
                .arg(&args.counts)
                .arg(&args.windows)
                .arg(args.guard_us),
            None => to.arg(0).arg("").arg("").arg(-1),
        };
        match &self.batch {
            Some(batch) => to.arg(batch.seller).arg(batch.batch).arg(batch.size),
            None if !self.result.is_empty() => to.arg("").arg("").arg(0),
            None => return,
        };
        if !self.result.is_empty() {
            to.arg(self.result);
        }
    }
}

/// `complete.lua`'s answer `{CHANGED, WAS_DEAD_FOR, RAISE, EVENT}`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(in crate::permit) struct CompleteAnswer {
    /// The state changed (and was counted).
    pub changed: bool,
    /// The REASON the message was dead for when it left `dead`, else ''.
    pub was_dead_for: String,
    /// A learned count is due to change (a raise, or a correction of the last decrease).
    pub raise_due: bool,
    /// The batch's completion event to publish, or ''.
    pub event: String,
}

impl CompleteAnswer {
    /// What `complete.lua` answers for a message moved to `registered` from the state `was`
    /// (its completion record before), as [`TRANSITIONS`] say: changed when it moved, and the
    /// reason it was dead for when it left `dead`; nothing is learned (no raise), no event.
    pub fn registered_from(was: Option<&str>) -> Self {
        let (from, reason) = RecordState::of(was);
        if moved_to("registered", from).is_none() {
            return Self::default();
        }
        Self {
            changed: true,
            was_dead_for: reason.to_owned(),
            ..Self::default()
        }
    }
}

impl redis::FromRedisValue for CompleteAnswer {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let (changed, was_dead_for, raise, event): (u8, String, u8, String) =
            redis::from_redis_value(v)?;
        Ok(Self {
            changed: changed == 1,
            was_dead_for,
            raise_due: raise == 1,
            event,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    const SOURCE: &str = include_str!("../../../lua/complete.lua");

    fn sample(adaptive: bool, batch: bool) -> Written {
        let mut written = Written::default();
        sample_complete(adaptive, batch).write(&mut written);
        written
    }

    fn sample_complete(adaptive: bool, batch: bool) -> Complete<'static> {
        Complete {
            done: "done".into(),
            calls: "calls".into(),
            adaptive: adaptive.then(|| {
                (
                    AdaptiveKeys {
                        learned: "learned".into(),
                        accepted: "accepted".into(),
                        limit: "limit".into(),
                    },
                    AdaptiveArgs {
                        counts: "10,100".into(),
                        windows: "1000,60000".into(),
                        guard_us: -1,
                    },
                )
            }),
            batch: batch.then_some(CompleteBatch {
                progress: "progress".into(),
                seller: "s1",
                batch: "b1",
                size: 7,
            }),
            ttl_ms: 1000,
            outcome: "registered",
            reason: "",
            call: "c1",
            answered_us: 42,
            cost: 3,
            result: if batch {
                r#"{"outcome":"registered"}"#
            } else {
                ""
            },
        }
    }

    #[test]
    fn keys_and_args_follow_the_header() {
        let full = sample(true, true);
        check(
            SOURCE,
            "KEYS",
            &full.keys,
            &[
                ("done", "completion record"),
                ("calls", "seller's calls"),
                ("learned", "learned state"),
                ("accepted", "accepted log"),
                ("limit", "limit override"),
                ("progress", "(KEYS[3] without ADAPTIVE)"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &full.args,
            &[
                ("1000", "TTL"),
                ("registered", "OUTCOME"),
                ("", "REASON"),
                ("c1", "CALL"),
                ("42", "ANSWERED_US"),
                ("3", "COST"),
                ("1", "ADAPTIVE"),
                ("10,100", "COUNTS"),
                ("1000,60000", "WINDOWS"),
                ("-1", "GUARD"),
                ("s1", "SELLER"),
                ("b1", "BATCH"),
                ("7", "BATCH_SIZE"),
                (r#"{"outcome":"registered"}"#, "RESULT"),
            ],
        );
    }

    #[test]
    fn without_adaptive_the_batch_is_the_third_key_and_the_adaptive_args_are_blank() {
        let plain = sample(false, true);
        assert_eq!(plain.keys, ["done", "calls", "progress"]);
        assert_eq!(&plain.args[6..10], ["0", "", "", "-1"]);
        assert_eq!(&plain.args[10..13], ["s1", "b1", "7"]);
        let alone = sample(false, false);
        assert_eq!(alone.keys, ["done", "calls"]);
        assert_eq!(alone.args.len(), 10);
    }

    #[test]
    fn a_result_without_a_batch_comes_after_blank_batch_args() {
        let alone = {
            let mut written = Written::default();
            let mut c = sample_complete(false, false);
            c.result = "{}";
            c.write(&mut written);
            written
        };
        assert_eq!(&alone.args[10..], ["", "", "0", "{}"]);
    }

    /// Runs `complete.lua` on a record holding `was` (none: no record), with no call and no
    /// batch: its answer and the record after.
    fn complete_on(was: Option<&str>, outcome: &str) -> (CompleteAnswer, Option<String>) {
        let url = std::env::var("TURNSTILE_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let mut conn = redis::Client::open(url)
            .and_then(|client| client.get_connection())
            .expect("the tests' Redis");
        let prefix = format!("turnstile-test:complete-moves:{}", std::process::id());
        let (done, calls) = (format!("{prefix}:done"), format!("{prefix}:calls"));
        let mut reset = redis::cmd("DEL");
        reset.arg(&done).arg(&calls);
        let () = reset.query(&mut conn).unwrap();
        if let Some(was) = was {
            let () = redis::cmd("SET")
                .arg(&done)
                .arg(was)
                .query(&mut conn)
                .unwrap();
        }
        let mut written = Written::default();
        Complete {
            batch: None,
            adaptive: None,
            outcome: match outcome {
                "registered" => "registered",
                "dead" => "dead",
                _ => "replayed",
            },
            reason: "gone",
            call: "",
            result: "",
            ..sample_complete(false, false)
        }
        .write(&mut written);
        let mut eval = redis::cmd("EVAL");
        eval.arg(crate::permit::scripts::source("complete").text())
            .arg(2)
            .arg(&done)
            .arg(&calls)
            .arg(&written.args);
        let answer: CompleteAnswer = eval.query(&mut conn).unwrap();
        let after: Option<String> = redis::cmd("GET").arg(&done).query(&mut conn).unwrap();
        let () = reset.query(&mut conn).unwrap();
        (answer, after)
    }

    #[test]
    fn complete_lua_moves_a_record_as_the_transitions_say() {
        let states = [
            None,
            Some("registered"),
            Some(r#"registered {"a":1}"#),
            Some("dead:rejected"),
        ];
        for was in states {
            let (from, reason) = RecordState::of(was);
            for outcome in ["registered", "dead", "replayed"] {
                let (answer, after) = complete_on(was, outcome);
                let to = moved_to(outcome, from);
                assert_eq!(answer.changed, to.is_some(), "{outcome} from {was:?}");
                let after_state = RecordState::of(after.as_deref()).0;
                assert_eq!(after_state, to.unwrap_or(from), "{outcome} from {was:?}");
                if to.is_none() {
                    assert_eq!(after.as_deref(), was, "{outcome} from {was:?}");
                }
                let left_dead = to.is_some() && from == RecordState::Dead;
                assert_eq!(
                    answer.was_dead_for,
                    if left_dead { reason } else { "" },
                    "{outcome} from {was:?}"
                );
                if outcome == "registered" {
                    assert_eq!(answer, CompleteAnswer::registered_from(was), "{was:?}");
                }
            }
        }
    }

    #[test]
    fn a_plain_registration_moves_the_state_as_complete_lua_does() {
        assert!(CompleteAnswer::registered_from(None).changed);
        assert!(!CompleteAnswer::registered_from(Some("registered")).changed);
        let unpublished = CompleteAnswer::registered_from(Some(r#"registered {"a":1}"#));
        assert!(!unpublished.changed);
        let from_dead = CompleteAnswer::registered_from(Some("dead:rejected"));
        assert!(from_dead.changed);
        assert_eq!(from_dead.was_dead_for, "rejected");
    }
}
