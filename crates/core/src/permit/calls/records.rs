//! The records' scripts (see `permit/records.rs`): `lua/batch_seen.lua`,
//! `lua/batch_event_sent.lua`, `lua/tally.lua`, `lua/retry.lua` and `lua/retries.lua`.

use crate::permit::calls::call::{Call, invoke};
use crate::permit::scripts;

/// `lua/batch_seen.lua`: a batch seen by a replica (its progress created if new, its size
/// taken if first given). Answers `{FIRST_MS, EVENT}`. See the script's header.
pub(in crate::permit) struct BatchSeenCall<'a> {
    /// KEYS[1]: the batch's progress.
    pub progress: String,
    /// KEYS[2]: the seller's batches.
    pub seller_batches: String,
    /// ARGV[1]: TTL in ms (at least 1).
    pub ttl_ms: u64,
    /// ARGV[2] SELLER, ARGV[3] BATCH, ARGV[4] BATCH_SIZE (0 = none).
    pub seller: &'a str,
    pub batch: &'a str,
    pub size: u32,
    /// ARGV[5]: ROWS_PER_CALL (1 to 1000).
    pub rows_per_call: u32,
}

impl BatchSeenCall<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::batch_seen(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.progress.clone())
            .key(self.seller_batches.clone())
            .arg(self.ttl_ms)
            .arg(self.seller)
            .arg(self.batch)
            .arg(self.size)
            .arg(self.rows_per_call);
    }
}

/// `lua/batch_event_sent.lua`: the batch's completion event EVENT was published. Answers 1
/// when it was pending and is no longer, else 0.
pub(in crate::permit) struct BatchEventSent {
    /// KEYS[1]: the batch's progress.
    pub progress: String,
    /// ARGV[1]: EVENT, the event's `completed_ms`.
    pub completed_ms: u64,
}

impl BatchEventSent {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::batch_event_sent(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.progress.clone()).arg(self.completed_ms);
    }
}

/// `lua/tally.lua`: adds BY to FIELD of a hash of counts. Answers the count now.
pub(in crate::permit) struct Tally<'a> {
    /// KEYS[1]: the hash of counts.
    pub counts: String,
    /// ARGV[1]: FIELD.
    pub field: &'a str,
    /// ARGV[2]: BY (may be negative).
    pub by: i64,
}

impl Tally<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::tally(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.counts.clone()).arg(self.field).arg(self.by);
    }
}

/// `lua/retry.lua`: a message of a batch waits out a retry's backoff, due DELAY_MS from now.
/// Answers the seller's retries not due yet.
pub(in crate::permit) struct RetryCall<'a> {
    /// KEYS[1]: the seller's retries.
    pub retries: String,
    /// ARGV[1]: DELAY_MS.
    pub delay_ms: u64,
    /// ARGV[2]: MEMBER, `COST:BATCH:MESSAGE`.
    pub member: &'a str,
    /// ARGV[3]: KEEP, most entries kept.
    pub keep: usize,
}

impl RetryCall<'_> {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::retry(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.retries.clone())
            .arg(self.delay_ms)
            .arg(self.member)
            .arg(self.keep);
    }
}

/// `lua/retries.lua`: a seller's retries not due yet. Answers `{MEMBER, DUE_IN_MS, ...}`.
pub(in crate::permit) struct RetriesCall {
    /// KEYS[1]: the seller's retries.
    pub retries: String,
}

impl RetriesCall {
    /// The script's invocation.
    pub fn invocation(&self) -> redis::ScriptInvocation<'static> {
        invoke(scripts::retries(), |to| self.write(to))
    }

    /// KEYS and ARGV in the script's order.
    pub fn write<C: Call>(&self, to: &mut C) {
        to.key(self.retries.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::super::header::{Written, check};
    use super::*;

    #[test]
    fn batch_seen_follows_its_header() {
        const SOURCE: &str = include_str!("../../../lua/batch_seen.lua");
        let mut written = Written::default();
        BatchSeenCall {
            progress: "progress".into(),
            seller_batches: "batches".into(),
            ttl_ms: 9,
            seller: "s1",
            batch: "b1",
            size: 7,
            rows_per_call: 50,
        }
        .write(&mut written);
        check(
            SOURCE,
            "KEYS",
            &written.keys,
            &[
                ("progress", "batch's progress"),
                ("batches", "seller's batches"),
            ],
        );
        check(
            SOURCE,
            "ARGV",
            &written.args,
            &[
                ("9", "TTL"),
                ("s1", "SELLER"),
                ("b1", "BATCH"),
                ("7", "BATCH_SIZE"),
                ("50", "ROWS_PER_CALL"),
            ],
        );
    }

    #[test]
    fn batch_event_sent_and_tally_follow_their_headers() {
        const SENT: &str = include_str!("../../../lua/batch_event_sent.lua");
        let mut written = Written::default();
        BatchEventSent {
            progress: "progress".into(),
            completed_ms: 5,
        }
        .write(&mut written);
        check(
            SENT,
            "KEYS",
            &written.keys,
            &[("progress", "batch's progress")],
        );
        check(SENT, "ARGV", &written.args, &[("5", "EVENT")]);

        const TALLY: &str = include_str!("../../../lua/tally.lua");
        let mut written = Written::default();
        Tally {
            counts: "counts".into(),
            field: "rejected",
            by: -1,
        }
        .write(&mut written);
        check(
            TALLY,
            "KEYS",
            &written.keys,
            &[("counts", "hash of counts")],
        );
        check(
            TALLY,
            "ARGV",
            &written.args,
            &[("rejected", "FIELD"), ("-1", "BY")],
        );
    }

    #[test]
    fn retry_and_retries_follow_their_headers() {
        const RETRY: &str = include_str!("../../../lua/retry.lua");
        let mut written = Written::default();
        RetryCall {
            retries: "retries".into(),
            delay_ms: 1500,
            member: "2:b1:m1",
            keep: 256,
        }
        .write(&mut written);
        check(
            RETRY,
            "KEYS",
            &written.keys,
            &[("retries", "seller's retries")],
        );
        check(
            RETRY,
            "ARGV",
            &written.args,
            &[("1500", "DELAY_MS"), ("2:b1:m1", "MEMBER"), ("256", "KEEP")],
        );

        const RETRIES: &str = include_str!("../../../lua/retries.lua");
        let mut written = Written::default();
        RetriesCall {
            retries: "retries".into(),
        }
        .write(&mut written);
        check(
            RETRIES,
            "KEYS",
            &written.keys,
            &[("retries", "seller's retries")],
        );
        assert!(written.args.is_empty());
    }
}
