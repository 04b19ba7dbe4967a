//! The acquire scripts: `lua/sliding_window.lua`, `lua/gcra.lua`, `lua/token_bucket.lua` and
//! `lua/fixed_window.lua`, which share their keys and arguments but for a tail of their own.

use crate::config::{Algorithm, Limits};
use crate::domain::Cost;
use crate::permit::batch::Operation;
use crate::permit::calls::call::{Answer, Call, OnRoute, operate};
use crate::permit::decision::{Decision, Reservation, wait_since};
use crate::permit::error::PermitError;
use crate::permit::observed::count_verdict;

/// An acquire script (one per algorithm, see [`AcquireTail`]): grants the seller's permit
/// now, reserves a future slot (FLAGS +1) or answers when to come back. See the scripts'
/// headers.
pub(in crate::permit) struct Acquire<'a> {
    /// KEYS[1]: the seller's state for the algorithm (log, TATs, buckets or counters).
    pub state: String,
    /// KEYS[2] to KEYS[12], the seller's.
    pub limit: String,
    pub pause: String,
    pub reserved: String,
    pub server: String,
    pub calls: String,
    pub far: String,
    pub learned: String,
    pub shadow: String,
    pub shadow_log: String,
    pub losses: String,
    pub give_way: String,
    /// The last key, optional: the message's completion record.
    pub done: Option<String>,
    /// ARGV[1] to ARGV[3]: the default stack and the guard.
    pub counts: String,
    pub windows: String,
    pub guard_us: i64,
    /// ARGV[4] FLAGS: +1 reserve, +2 durable Redis, +4 adaptive limits.
    pub reserve: bool,
    pub durable: bool,
    pub adaptive: bool,
    /// ARGV[5]: HORIZON in µs.
    pub horizon_us: u64,
    /// ARGV[6]: TOKEN.
    pub token: &'a str,
    /// ARGV[7]: BOUND in µs.
    pub bound_us: u64,
    /// ARGV[8]: COST.
    pub cost: u32,
    /// The algorithm, its own key and its arguments from ARGV[9].
    pub tail: AcquireTail,
    /// sliding-window: the route the call takes, if any (its keys last, its stack from
    /// ARGV[11]; BLOCK and HOLD are then written as 0 when permit blocks are off).
    pub route: Option<OnRoute>,
}

/// What an acquire script takes of its own.
pub(in crate::permit) enum AcquireTail {
    /// `sliding_window.lua`: KEYS[12], the seller's pool of permit-block units, and with permit
    /// blocks on, ARGV[9] BLOCK and ARGV[10] HOLD in µs.
    SlidingWindow {
        pool: String,
        block: Option<(u32, u64)>,
    },
    /// `gcra.lua`: ARGV[9] BURST.
    Gcra { burst: u32 },
    /// `token_bucket.lua`: ARGV[9] CAPACITY.
    TokenBucket { capacity: u32 },
    /// `fixed_window.lua`: nothing more.
    FixedWindow,
}

impl AcquireTail {
    pub fn algorithm(&self) -> Algorithm {
        match self {
            AcquireTail::SlidingWindow { .. } => Algorithm::SlidingWindow,
            AcquireTail::Gcra { .. } => Algorithm::Gcra,
            AcquireTail::TokenBucket { .. } => Algorithm::TokenBucket,
            AcquireTail::FixedWindow => Algorithm::FixedWindow,
        }
    }
}

impl Acquire<'_> {
    /// The batch's operation (named after the algorithm).
    pub fn operation(&self) -> Operation {
        operate(self.tail.algorithm().name(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.state.clone())
            .key(self.limit.clone())
            .key(self.pause.clone())
            .key(self.reserved.clone())
            .key(self.server.clone())
            .key(self.calls.clone())
            .key(self.far.clone())
            .key(self.learned.clone())
            .key(self.shadow.clone())
            .key(self.shadow_log.clone())
            .key(self.losses.clone())
            .key(self.give_way.clone());
        if let AcquireTail::SlidingWindow { pool, .. } = &self.tail {
            to.key(pool.clone());
        }
        if let Some(done) = &self.done {
            to.key(done.clone());
        }
        let route = match self.tail {
            AcquireTail::SlidingWindow { .. } => self.route.as_ref(),
            _ => None,
        };
        OnRoute::keys(route, to);
        let flags =
            u8::from(self.reserve) | (2 * u8::from(self.durable)) | (4 * u8::from(self.adaptive));
        to.arg(&self.counts)
            .arg(&self.windows)
            .arg(self.guard_us)
            .arg(flags)
            .arg(self.horizon_us)
            .arg(self.token)
            .arg(self.bound_us)
            .arg(self.cost);
        match &self.tail {
            AcquireTail::Gcra { burst } => {
                to.arg(*burst);
            }
            AcquireTail::TokenBucket { capacity } => {
                to.arg(*capacity);
            }
            AcquireTail::SlidingWindow {
                block: Some((units, hold_us)),
                ..
            } => {
                to.arg(*units).arg(*hold_us);
            }
            AcquireTail::SlidingWindow { block: None, .. } if route.is_some() => {
                to.arg(0).arg(0);
            }
            AcquireTail::SlidingWindow { block: None, .. } | AcquireTail::FixedWindow => {}
        }
        OnRoute::args(route, to);
    }
}

/// An acquire script's answer `{STATUS, SLOT_US, NOW_US, COUNTS, WINDOWS_US, USED_PERMILLE,
/// VERDICT}` (sliding-window's goes on with `BLOCKED, CALL, ENDS_US, STALE`), read by position
/// (see the scripts' headers).
pub(in crate::permit) struct AcquireAnswer {
    pub values: Vec<redis::Value>,
    pub algorithm: Algorithm,
}

impl AcquireAnswer {
    fn answer(&self) -> Answer<'_> {
        Answer {
            values: &self.values,
            script: self.algorithm.name(),
        }
    }

    /// The decision: `token` names the call (granted) or the reservation (told to wait with a
    /// slot held); `sent`, when the call that carried it left this replica. Counts the shadow
    /// limit's VERDICT.
    pub fn decision(
        &self,
        token: String,
        cost: Cost,
        sent: std::time::Instant,
    ) -> Result<Decision, PermitError> {
        let answer = self.answer();
        let (status, slot, now) = (answer.int(0)?, answer.int(1)?, answer.int(2)?);
        if let Ok(verdict) = answer.text(6) {
            count_verdict(&verdict);
        }
        match status {
            1 => Ok(Decision::Granted {
                slot_us: slot,
                granted_us: now,
                used_permille: answer
                    .int(5)
                    .map_or(0, |p| p.clamp(0, i64::from(u32::MAX)) as u32),
                call: token,
                sent,
            }),
            2 => Ok(Decision::Wait {
                retry_after: wait_since(slot, now, sent),
                reservation: Some(Reservation {
                    slot_us: slot,
                    limits: answer.limits(3)?,
                    reserved_at_us: now,
                    token,
                    cost: None,
                }),
            }),
            0 => Ok(Decision::Wait {
                retry_after: wait_since(slot, now, sent),
                reservation: None,
            }),
            3 => Ok(Decision::AlreadyDone),
            4 => Ok(Decision::TooCostly {
                cost,
                most: u32::try_from(slot).map_err(|_| answer.bad())?,
                limits: answer.limits(3)?,
                bound_by: match self.algorithm {
                    Algorithm::SlidingWindow | Algorithm::FixedWindow => "the smallest COUNT",
                    Algorithm::Gcra => {
                        "the smallest of COUNT and TURNSTILE_GCRA_BURST (raise the burst to the \
                         largest cost)"
                    }
                    Algorithm::TokenBucket => "the smallest bucket capacity",
                },
            }),
            _ => Err(answer.bad()),
        }
    }

    /// The stack that applied (COUNTS and WINDOWS_US).
    pub fn stack(&self) -> Result<Limits, PermitError> {
        self.answer().limits(3)
    }

    /// What sliding-window's answer says of the seller's pool, for a caller that takes up to
    /// `block` units into it.
    pub fn pool(&self, block: u32) -> PoolAnswer {
        let int = |i: usize| {
            self.values
                .get(i)
                .and_then(|v| redis::from_redis_value_ref::<u32>(v).ok())
                .unwrap_or(0)
        };
        let unit = self
            .values
            .get(8)
            .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
            .filter(|unit| !unit.is_empty());
        PoolAnswer {
            taken: int(7).min(block),
            unit,
            stale: int(10),
        }
    }
}

/// What a sliding-window acquire answered about the seller's pool (see `sliding_window.lua`):
/// units it took into it (BLOCKED), the unit it claimed from it for this call (CALL), stale
/// units given back (STALE).
pub(in crate::permit) struct PoolAnswer {
    pub taken: u32,
    pub unit: Option<String>,
    pub stale: u32,
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    fn sample(tail: AcquireTail, done: bool) -> Written {
        let acquire = Acquire {
            state: "state".into(),
            limit: "limit".into(),
            pause: "pause".into(),
            reserved: "reserved".into(),
            server: "server".into(),
            calls: "calls".into(),
            far: "far".into(),
            learned: "learned".into(),
            shadow: "shadow".into(),
            shadow_log: "shadow_log".into(),
            losses: "losses".into(),
            give_way: "give_way".into(),
            done: done.then(|| "done".into()),
            counts: "10".into(),
            windows: "1000000".into(),
            guard_us: -1,
            reserve: true,
            durable: false,
            adaptive: true,
            horizon_us: 60,
            token: "t1",
            bound_us: 5,
            cost: 2,
            tail,
            route: None,
        };
        let mut written = Written::default();
        acquire.write(&mut written);
        written
    }

    const KEYS: [(&str, &str); 12] = [
        ("state", "the seller's"),
        ("limit", "limit override"),
        ("pause", "pause"),
        ("reserved", "reserved slots"),
        ("server", "server stamp"),
        ("calls", "seller's calls"),
        ("far", "far queue"),
        ("learned", "learned state"),
        ("shadow", "shadow limit"),
        ("shadow_log", "shadow log"),
        ("losses", "loss marker"),
        ("give_way", "give-way budget"),
    ];

    const ARGV: [(&str, &str); 8] = [
        ("10", "COUNTS"),
        ("1000000", "WINDOWS"),
        ("-1", "GUARD"),
        ("5", "FLAGS"),
        ("60", "HORIZON"),
        ("t1", "TOKEN"),
        ("5", "BOUND"),
        ("2", "COST"),
    ];

    fn with<const N: usize>(
        common: [(&'static str, &'static str); N],
        more: &[(&'static str, &'static str)],
    ) -> Vec<(&'static str, &'static str)> {
        common.iter().chain(more).copied().collect()
    }

    #[test]
    fn sliding_window_follows_its_header() {
        const SOURCE: &str = include_str!("../../../lua/sliding_window.lua");
        let tail = || AcquireTail::SlidingWindow {
            pool: "pool".into(),
            block: Some((8, 900)),
        };
        let full = sample(tail(), true);
        let keys = with(KEYS, &[("pool", "pool"), ("done", "completion record")]);
        check(SOURCE, "KEYS", &full.keys, &keys);
        let argv = with(ARGV, &[("8", "BLOCK"), ("900", "HOLD")]);
        check(SOURCE, "ARGV", &full.args, &argv);
        let plain = sample(
            AcquireTail::SlidingWindow {
                pool: "pool".into(),
                block: None,
            },
            false,
        );
        check(SOURCE, "KEYS", &plain.keys, &keys[..13]);
        check(SOURCE, "ARGV", &plain.args, &argv[..8]);
    }

    #[test]
    fn gcra_token_bucket_and_fixed_window_follow_their_headers() {
        let keys = with(KEYS, &[("done", "completion record")]);
        for (source, tail, more) in [
            (
                include_str!("../../../lua/gcra.lua"),
                AcquireTail::Gcra { burst: 3 },
                &[("3", "BURST")][..],
            ),
            (
                include_str!("../../../lua/token_bucket.lua"),
                AcquireTail::TokenBucket { capacity: 4 },
                &[("4", "CAPACITY")][..],
            ),
            (
                include_str!("../../../lua/fixed_window.lua"),
                AcquireTail::FixedWindow,
                &[][..],
            ),
        ] {
            let written = sample(tail, true);
            check(source, "KEYS", &written.keys, &keys);
            check(source, "ARGV", &written.args, &with(ARGV, more));
            let lines = super::super::header::lines(source, "ARGV");
            assert_eq!(written.args.len(), lines.len());
        }
    }

    #[test]
    fn an_answer_reads_by_the_header() {
        use redis::Value::{BulkString, Int};
        let text = |s: &str| BulkString(s.as_bytes().to_vec());
        let answer = |status| AcquireAnswer {
            values: vec![
                Int(status),     // STATUS
                Int(2_000_000),  // SLOT_US
                Int(1_000_000),  // NOW_US
                text("10"),      // COUNTS
                text("1000000"), // WINDOWS_US
                Int(300),        // USED_PERMILLE
                text(""),        // VERDICT
                Int(9),          // BLOCKED
                text("unit-1"),  // CALL
                Int(0),          // ENDS_US
                Int(2),          // STALE
            ],
            algorithm: Algorithm::SlidingWindow,
        };
        let sent = std::time::Instant::now();
        let granted = answer(1).decision("t1".into(), Cost::ONE, sent).unwrap();
        assert!(matches!(
            granted,
            Decision::Granted {
                slot_us: 2_000_000,
                granted_us: 1_000_000,
                used_permille: 300,
                ..
            }
        ));
        let Decision::Wait {
            retry_after,
            reservation: Some(held),
        } = answer(2).decision("t1".into(), Cost::ONE, sent).unwrap()
        else {
            panic!("a reservation")
        };
        // Counted from when the request left (a moment ago): the slot's second, give or take
        // the moment and a tenth of it.
        let second = std::time::Duration::from_secs(1);
        assert!(
            retry_after <= second && retry_after >= second - std::time::Duration::from_millis(50),
            "{retry_after:?}"
        );
        assert_eq!((held.slot_us, held.reserved_at_us), (2_000_000, 1_000_000));
        assert_eq!(held.limits, answer(2).stack().unwrap());
        assert!(answer(7).decision("t1".into(), Cost::ONE, sent).is_err());
        let pool = answer(1).pool(4);
        assert_eq!(
            (pool.taken, pool.unit.as_deref(), pool.stale),
            (4, Some("unit-1"), 2)
        );
    }
}
