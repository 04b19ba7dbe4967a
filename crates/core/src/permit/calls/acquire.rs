//! The acquire scripts: `lua/sliding_window.lua`, `lua/gcra.lua`, `lua/token_bucket.lua` and
//! `lua/fixed_window.lua`, which share their keys and arguments but for a tail of their own.

use super::Call;
use crate::config::Algorithm;
use crate::permit::batch::Operation;

/// An acquire script (one per algorithm, see [`AcquireTail`]): grants the seller's permit
/// now, reserves a future slot (FLAGS +1) or answers when to come back. See the scripts'
/// headers.
pub(in crate::permit) struct Acquire<'a> {
    /// KEYS[1]: the seller's state for the algorithm (log, TATs, buckets or counters).
    pub state: String,
    /// KEYS[2] to KEYS[11], the seller's.
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
        let mut operation = Operation::new(self.tail.algorithm().name());
        self.write(&mut operation);
        operation
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
            .key(self.losses.clone());
        if let AcquireTail::SlidingWindow { pool, .. } = &self.tail {
            to.key(pool.clone());
        }
        if let Some(done) = &self.done {
            to.key(done.clone());
        }
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
            AcquireTail::SlidingWindow { block: None, .. } | AcquireTail::FixedWindow => {}
        }
    }
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
        };
        let mut written = Written::default();
        acquire.write(&mut written);
        written
    }

    const KEYS: [(&str, &str); 11] = [
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
        check(SOURCE, "KEYS", &plain.keys, &keys[..12]);
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
}
