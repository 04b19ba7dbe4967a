//! Permit blocks: units a grant takes at once into the seller's pool in Redis (see `take_block`
//! and `claim_idle` in `lua/include/blocks.lua` and docs/performance.md, "Permit blocks"), for
//! the seller's next calls by every replica. What a replica keeps of them here is small:
//!
//! - the sellers whose pool it saw units in lately ([`Blocks::tries_pool`]): their next message
//!   claims a unit with one plain `ZPOPMIN` beside its completion-record read, no script; an
//!   empty pool sends it to an acquire, which claims from the pool first too;
//! - the units it claimed whose call is not recorded yet ([`Blocks::recorded`]): their
//!   registration is recorded with a plain `SET … GET` (the calls are counted in Redis already);
//! - what those calls answered, by seller ([`Blocks::answered`]), written every 500 ms and at
//!   shutdown: each call's end brought forward to its answer, and with adaptive limits its entry
//!   in the accepted log; until then, or if that is lost, a call holds its place until its end;
//! - how many units to ask for, by seller ([`Blocks::wanted`]).
//!
//! A block is only granted while the seller is far from its limits. Each unit is counted in
//! flight in the seller's calls until its END (the end of its hold plus the taker's bound), and
//! used only by a call that answers by then: an acquire checks on Redis's clock, a plain claim on
//! Redis's `TIME` read in the same pipeline, after the call was asked for (its own bound plus a
//! margin), so the calls gate sees the call wherever in that time it is made. A unit no one
//! claims leaves the pool, the log and the calls at the next acquire of the seller after its
//! hold (or when one is short of room), or expires with them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::domain::SellerId;

/// Most sellers one replica keeps a pool hint or a size for: beyond it, no new block is asked
/// for and the sizes start over (memory stays bounded however many sellers a replica sees).
pub(crate) const MOST_BLOCKS: usize = 4096;

/// Most units a block takes besides the call that asks for it (`MAX_BLOCK` in
/// `lua/include/blocks.lua`).
pub(crate) const MOST_UNITS: u32 = 64;

/// Units a replica asks for the first time it sees a seller (or after it forgot it), before it
/// has seen how many its blocks get used (see [`Blocks::wanted`]).
pub(crate) const FIRST_SIZE: u32 = 16;

/// Most claimed units whose record is awaited: beyond it they are forgotten (their records
/// then go through `complete.lua`, which is right for any call).
const MOST_CLAIMED: usize = 65_536;

/// How often this replica's rate of messages is measured.
const MEASURE_EVERY: Duration = Duration::from_millis(100);

/// `mutex` locked (none of this module's locks is held across anything that can panic).
fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .expect("a permit block's lock is never poisoned")
}

/// The seller's accepted log's bounds under the stack that applies to it (its longest window +
/// guard, its largest COUNT): a registration made with a pool unit is noted in it with plain
/// commands, kept as `note_accepted` (`lua/include/learned.lua`) keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogBounds {
    pub span_us: u64,
    pub most: u64,
}

/// What calls of a seller made with pool units answered, to write together (see
/// [`Blocks::answered`]): (when the answer came, Redis µs, an upper bound; the call), and the
/// seller's accepted log's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answers {
    pub calls: Vec<(i64, String)>,
    pub bounds: LogBounds,
}

/// Most answers kept for one seller before they are written at once.
const MOST_ANSWERS: usize = 64;

/// What this replica asked for and saw of a seller's blocks.
#[derive(Debug, Clone, Copy, Default)]
struct Size {
    /// Units to ask for next (0 once: a block went unused, see [`Blocks::wanted`]).
    next: u32,
    /// Units of the last block this replica took, not yet judged (see [`Blocks::acquired`]).
    last: u32,
}

/// One replica's hints about the seller pools (see the module's doc).
#[derive(Debug)]
pub(crate) struct Blocks {
    /// Until when a message of the seller tries a plain claim first.
    pools: Mutex<HashMap<SellerId, Instant>>,
    /// How often a seller this replica saw no pool of lately had one anyway (another replica's),
    /// exponentially weighted: above one half, such a seller's message tries a plain claim
    /// first too (see [`Self::guesses_pool`]).
    found_unseen: Mutex<f64>,
    /// Units claimed whose registration is not recorded yet.
    claimed: Mutex<HashMap<String, LogBounds>>,
    /// Answers of calls made with pool units, by seller, not written yet.
    answers: Mutex<HashMap<SellerId, Answers>>,
    sizes: Mutex<HashMap<SellerId, Size>>,
    /// Units a block got used, on average (exponentially weighted over the last blocks this
    /// replica judged): a new seller's first block is sized by it.
    typical: Mutex<f64>,
    /// Most units asked for with a grant.
    want: u32,
    /// How long after its grant a block's units may be claimed.
    hold: Duration,
    /// When the rate was last measured, messages that asked since, and the rate (per second,
    /// exponentially weighted; 0 until measured).
    measured: Mutex<Instant>,
    asking: AtomicU64,
    rate: Mutex<f64>,
}

impl Blocks {
    /// Blocks of up to `want` units (at most [`MOST_UNITS`]) whose units may be claimed within
    /// `hold` of their grant.
    pub fn new(want: u32, hold: Duration) -> Self {
        Self {
            pools: Mutex::default(),
            found_unseen: Mutex::new(0.0),
            claimed: Mutex::default(),
            answers: Mutex::default(),
            sizes: Mutex::default(),
            typical: Mutex::new(f64::from(FIRST_SIZE) / 1.5),
            want: want.min(MOST_UNITS),
            hold,
            measured: Mutex::new(Instant::now()),
            asking: AtomicU64::new(0),
            rate: Mutex::new(0.0),
        }
    }

    /// The hold in µs, as the script takes it.
    pub(crate) fn hold_us(&self) -> u64 {
        self.hold.as_micros() as u64
    }

    /// A message asks for a grant (for the replica's rate, see [`Self::wanted`]).
    pub fn asking(&self) {
        self.asking.fetch_add(1, Ordering::Relaxed);
        let mut measured = locked(&self.measured);
        let since = measured.elapsed();
        if since < MEASURE_EVERY {
            return;
        }
        *measured = Instant::now();
        let now = self.asking.swap(0, Ordering::Relaxed) as f64 / since.as_secs_f64();
        let mut rate = locked(&self.rate);
        *rate = if *rate == 0.0 {
            now
        } else {
            0.7 * *rate + 0.3 * now
        };
    }

    /// Whether this replica saw units in the seller's pool within the last hold: its next
    /// message tries a plain claim first.
    pub(crate) fn tries_pool(&self, seller: &SellerId) -> bool {
        let mut pools = locked(&self.pools);
        match pools.get(seller) {
            Some(until) if Instant::now() < *until => true,
            Some(_) => {
                pools.remove(seller);
                false
            }
            None => false,
        }
    }

    /// Whether a message of a seller whose pool this replica has not seen lately should try a
    /// plain claim first all the same: most such sellers had one lately (other replicas took
    /// blocks for them), so a claim that finds none costs less than the acquires that would find
    /// one.
    pub(crate) fn guesses_pool(&self) -> bool {
        *locked(&self.found_unseen) > 0.5
    }

    /// A seller whose pool this replica had not seen lately had units in it (`found`) or not.
    pub(crate) fn unseen_pool(&self, found: bool) {
        let mut rate = locked(&self.found_unseen);
        *rate = 0.95 * *rate + if found { 0.05 } else { 0.0 };
    }

    /// The seller's pool had units when this replica asked at `asked` (it took a block into it,
    /// or claimed from it).
    pub(crate) fn saw_pool(&self, seller: &SellerId, asked: Instant) {
        let mut pools = locked(&self.pools);
        if pools.len() >= MOST_BLOCKS && !pools.contains_key(seller) {
            pools.retain(|_, until| Instant::now() < *until);
            if pools.len() >= MOST_BLOCKS {
                return;
            }
        }
        pools.insert(seller.clone(), asked + self.hold);
    }

    /// Redis failed an answer (it may have restarted, perhaps with writes lost, or failed
    /// over): no pool is claimed from without an acquire until one is seen again, and sellers
    /// not seen are not guessed to have one. (The first acquire of a seller on a server that did
    /// not write its state drops its pool: see `sliding_window.lua`.)
    pub(crate) fn forget_pools(&self) {
        locked(&self.pools).clear();
        *locked(&self.found_unseen) = 0.0;
    }

    /// The seller's pool was found empty (or is no longer to be used: its terms changed).
    pub(crate) fn pool_gone(&self, seller: &SellerId) {
        locked(&self.pools).remove(seller);
    }

    /// Notes the unit `call` claimed by this replica (or the call that took a block), under a
    /// stack of `bounds`.
    pub fn claimed(&self, call: &str, bounds: LogBounds) {
        let mut claimed = locked(&self.claimed);
        if claimed.len() >= MOST_CLAIMED {
            claimed.clear();
        }
        claimed.insert(call.to_owned(), bounds);
    }

    /// Forgets the claimed unit `call` (its call was answered); the bounds it was noted with,
    /// if it was one this replica claimed.
    pub fn recorded(&self, call: &str) -> Option<LogBounds> {
        locked(&self.claimed).remove(call)
    }

    /// The call `call` of the seller, made with a pool unit (or one that took a block),
    /// registered; its answer came at `at` (Redis µs, an upper bound). Its end in the seller's
    /// calls and its place in the accepted log are written later with others of the seller's
    /// ([`Self::take_answers`]): the seller's answers, if they are now as many as are kept (or
    /// this replica keeps as many sellers as it may: this one alone), to write at once.
    pub fn answered(
        &self,
        seller: &SellerId,
        call: &str,
        at: i64,
        bounds: LogBounds,
    ) -> Option<(SellerId, Answers)> {
        let mut answers = locked(&self.answers);
        if answers.len() >= MOST_BLOCKS && !answers.contains_key(seller) {
            let calls = vec![(at, call.to_owned())];
            return Some((seller.clone(), Answers { calls, bounds }));
        }
        let kept = answers.entry(seller.clone()).or_insert_with(|| Answers {
            calls: Vec::new(),
            bounds,
        });
        kept.calls.push((at, call.to_owned()));
        kept.bounds = bounds;
        if kept.calls.len() >= MOST_ANSWERS {
            return answers.remove_entry(seller);
        }
        None
    }

    /// Every answer kept, by seller, to write now.
    pub(crate) fn take_answers(&self) -> Vec<(SellerId, Answers)> {
        locked(&self.answers).drain().collect()
    }

    /// How many units to ask for with a grant of `seller`: as many as the seller's last block
    /// taken here got used, twice as many when it was used up, for a seller not seen lately half
    /// again what blocks get used on average, at most the configured most. After a block of
    /// which nothing was used, one grant asks for none, the next for one unit (a seller with a
    /// message now and then costs no block each time). None while this replica keeps as many
    /// sellers as it may.
    pub fn wanted(&self, seller: &SellerId) -> u32 {
        if self.want == 0 {
            return 0;
        }
        let mut sizes = locked(&self.sizes);
        let full = sizes.len() >= MOST_BLOCKS;
        match sizes.get_mut(seller) {
            Some(size) if size.next == 0 => {
                size.next = 1;
                0
            }
            Some(size) => size.next.min(self.want),
            None if full => 0,
            None => {
                drop(sizes);
                self.first_size()
            }
        }
    }

    /// A new seller's first block: half again what blocks get used on average (see
    /// [`FIRST_SIZE`] for the start), and, once this replica's rate of messages is known, no
    /// more than 1.5 × the messages it can expect of one seller within a hold: its rate × the
    /// hold, shared by the sellers it sees pools of. At least 2.
    fn first_size(&self) -> u32 {
        let typical = *locked(&self.typical);
        let mut size = typical * 1.5;
        let rate = *locked(&self.rate);
        if rate > 0.0 {
            let sellers = self.len().max(1) as f64;
            size = size.min(rate * self.hold.as_secs_f64() / sellers * 1.5);
        }
        (size.ceil() as u32)
            .clamp(2, self.want.max(2))
            .min(self.want)
    }

    /// An acquire of the seller answered: it took `taken` units into the pool, and found
    /// `stale` units left there unused after their hold (given back). The last block this
    /// replica took is judged by what the pool says: a pool that ran dry (nothing stale) used it
    /// up, so the next asks for twice as many; units left stale were not needed.
    pub fn acquired(&self, seller: &SellerId, taken: u32, stale: u32) {
        let mut sizes = locked(&self.sizes);
        if sizes.len() >= MOST_BLOCKS && !sizes.contains_key(seller) {
            sizes.clear();
        }
        let size = sizes.entry(seller.clone()).or_insert(Size {
            next: FIRST_SIZE.min(self.want),
            last: 0,
        });
        if size.last > 0 && (taken > 0 || stale > 0) {
            let used = size.last.saturating_sub(stale);
            size.next = if used >= size.last {
                (2 * size.last).min(self.want)
            } else {
                used
            };
            let mut typical = locked(&self.typical);
            *typical = 0.9 * *typical + 0.1 * f64::from(used);
        }
        if taken > 0 {
            size.last = taken;
            if size.next == 0 {
                size.next = 1;
            }
        } else if stale > 0 {
            size.last = 0;
        }
    }

    /// Sellers whose pool this replica tries now.
    pub fn len(&self) -> usize {
        locked(&self.pools).len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How long after its grant a block's units may be claimed.
pub const BLOCK_HOLD: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    fn seller(id: &str) -> SellerId {
        SellerId::parse(id).unwrap()
    }

    fn blocks(want: u32) -> Blocks {
        Blocks::new(want, Duration::from_secs(60))
    }

    const BOUNDS: LogBounds = LogBounds {
        span_us: 63_000_000,
        most: 100,
    };

    #[test]
    fn a_seller_is_tried_from_its_pool_only_within_the_hold_after_its_units_were_seen() {
        let blocks = Blocks::new(16, Duration::from_millis(50));
        let s1 = seller("S-1");
        assert!(!blocks.tries_pool(&s1));
        blocks.saw_pool(&s1, Instant::now());
        assert!(blocks.tries_pool(&s1));
        blocks.saw_pool(&s1, Instant::now() - Duration::from_millis(60));
        assert!(!blocks.tries_pool(&s1), "asked more than a hold ago");
        assert!(blocks.is_empty());
    }

    #[test]
    fn after_redis_failed_no_pool_is_tried_or_guessed() {
        let blocks = blocks(16);
        let s1 = seller("S-1");
        blocks.saw_pool(&s1, Instant::now());
        for _ in 0..40 {
            blocks.unseen_pool(true);
        }
        blocks.forget_pools();
        assert!(!blocks.tries_pool(&s1));
        assert!(!blocks.guesses_pool());
    }

    #[test]
    fn an_empty_pool_is_not_tried_again() {
        let blocks = blocks(16);
        let s1 = seller("S-1");
        blocks.saw_pool(&s1, Instant::now());
        blocks.pool_gone(&s1);
        assert!(!blocks.tries_pool(&s1));
    }

    #[test]
    fn sellers_not_seen_are_tried_from_their_pool_once_most_such_had_one() {
        let blocks = blocks(16);
        assert!(!blocks.guesses_pool());
        for _ in 0..40 {
            blocks.unseen_pool(true);
        }
        assert!(blocks.guesses_pool());
        for _ in 0..40 {
            blocks.unseen_pool(false);
        }
        assert!(!blocks.guesses_pool());
    }

    #[test]
    fn answers_are_kept_by_seller_until_taken_or_as_many_as_are_kept() {
        let blocks = blocks(16);
        let (s1, s2) = (seller("S-1"), seller("S-2"));
        assert_eq!(blocks.answered(&s1, "a-2", 10, BOUNDS), None);
        assert_eq!(blocks.answered(&s2, "b-2", 11, BOUNDS), None);
        assert_eq!(blocks.answered(&s1, "a-3", 12, BOUNDS), None);
        let mut taken = blocks.take_answers();
        taken.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        assert_eq!(taken.len(), 2);
        assert_eq!(
            taken[0].1.calls,
            vec![(10, "a-2".to_owned()), (12, "a-3".to_owned())]
        );
        assert!(blocks.take_answers().is_empty());
        for i in 1..MOST_ANSWERS {
            assert_eq!(blocks.answered(&s1, &format!("c-{i}"), 1, BOUNDS), None);
        }
        let full = blocks.answered(&s1, "c-last", 1, BOUNDS).unwrap();
        assert_eq!(full.1.calls.len(), MOST_ANSWERS);
        assert!(blocks.take_answers().is_empty());
    }

    #[test]
    fn a_claimed_unit_is_recorded_once_with_its_span() {
        let blocks = blocks(16);
        blocks.claimed("ab12-3", BOUNDS);
        assert_eq!(blocks.recorded("ab12-3"), Some(BOUNDS));
        assert_eq!(
            blocks.recorded("ab12-3"),
            None,
            "a record retried is no unit"
        );
        assert_eq!(
            blocks.recorded("cd34"),
            None,
            "a call this replica did not claim"
        );
    }

    #[test]
    fn a_block_used_up_asks_for_twice_as_many_and_one_left_stale_for_what_was_used() {
        let blocks = blocks(16);
        let s1 = seller("S-1");
        assert_eq!(blocks.wanted(&s1), FIRST_SIZE);
        blocks.acquired(&s1, 2, 0);
        // The pool ran dry: the next acquire finds nothing stale.
        blocks.acquired(&s1, 4, 0);
        assert_eq!(blocks.wanted(&s1), 4, "the block of 2 was used up");
        blocks.acquired(&s1, 0, 3);
        assert_eq!(blocks.wanted(&s1), 1, "1 of 4 used");
    }

    #[test]
    fn after_a_block_left_whole_one_grant_asks_for_none_and_the_next_for_one() {
        let blocks = blocks(16);
        let s1 = seller("S-1");
        blocks.acquired(&s1, 2, 0);
        blocks.acquired(&s1, 0, 2);
        assert_eq!(blocks.wanted(&s1), 0);
        assert_eq!(blocks.wanted(&s1), 1);
        assert_eq!(blocks.wanted(&s1), 1);
    }

    #[test]
    fn a_new_sellers_first_block_follows_how_many_units_blocks_get_used() {
        let blocks = blocks(64);
        assert_eq!(blocks.wanted(&seller("S-first")), FIRST_SIZE);
        for i in 0..40 {
            let s = seller(&format!("S-{i}"));
            blocks.acquired(&s, 8, 0);
            blocks.acquired(&s, 0, 4);
        }
        let first = blocks.wanted(&seller("S-new"));
        assert!((5..=8).contains(&first), "4 of 8 used each time: {first}");
    }

    #[test]
    fn a_new_sellers_first_block_is_what_one_seller_of_this_replicas_rate_can_use() {
        let blocks = Blocks::new(64, Duration::from_secs(2));
        for i in 0..100 {
            blocks.saw_pool(&seller(&format!("S-{i}")), Instant::now());
        }
        // 100 messages a second over the 100 sellers it sees pools of: 2 per hold each.
        *blocks.rate.lock().unwrap() = 100.0;
        assert_eq!(blocks.wanted(&seller("S-new")), 3);
        *blocks.rate.lock().unwrap() = 10_000.0;
        assert_eq!(blocks.wanted(&seller("S-new")), FIRST_SIZE);
    }

    #[test]
    fn no_block_is_asked_for_a_new_seller_once_as_many_are_kept_as_allowed() {
        let blocks = blocks(16);
        for i in 0..MOST_BLOCKS {
            blocks.acquired(&seller(&format!("S-{i}")), 2, 0);
        }
        assert_eq!(blocks.wanted(&seller("S-new")), 0);
        assert_eq!(blocks.wanted(&seller("S-0")), FIRST_SIZE.min(16));
        blocks.acquired(&seller("S-new"), 2, 0);
        assert_eq!(
            blocks.wanted(&seller("S-1")),
            FIRST_SIZE,
            "the sizes started over: S-1 is new again"
        );
    }

    #[test]
    fn the_rate_of_messages_is_measured_as_they_ask() {
        let blocks = blocks(16);
        *blocks.measured.lock().unwrap() -= Duration::from_secs(1);
        for _ in 0..50 {
            blocks.asking();
        }
        let rate = *blocks.rate.lock().unwrap();
        assert!(
            rate > 0.0 && rate <= 1.0 + 1e-9,
            "1 message over 1 s: {rate}"
        );
    }
}
