//! Permit blocks: the units a replica took from Redis at once for its next calls of a seller
//! (see `take_block` in `lua/prelude.lua` and README, "Permit blocks"), handed out here one by
//! one without a script, and settled in one step when the block is over (`lua/block_end.lua`).
//!
//! A block is only granted while the seller is far from its limits, so a replica busy with many
//! sellers far from theirs asks Redis for one acquire per block instead of one per call. Each
//! unit is counted in flight in the seller's calls from the grant until grant + hold + the
//! call's bound, so the calls gate sees it wherever in that time it is used: a unit is handed
//! out only within the hold, measured on this replica's monotonic clock from *before* the
//! grant was asked (so never later, in Redis time, than grant + hold).
//!
//! What a block's calls answered (the call that took it, its unit 1, included) is kept here (its
//! [`Ledger`]) and written when the block is
//! over and every call it handed out has answered (or could no longer answer): the ends of its
//! calls, its accepted calls for adaptive limits, and its units not handed out, given back. Until
//! then, and if the replica dies first, each unit keeps its place until its bound: later than
//! needed, never too early.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::domain::SellerId;

/// Most sellers with a block held at once by one replica: beyond it, no new block is asked for
/// until one is over (memory stays bounded however many sellers a replica sees).
pub const MOST_BLOCKS: usize = 4096;

/// Most units a block takes besides the call that asks for it (`MAX_BLOCK` in the prelude).
pub const MOST_UNITS: u32 = 64;

/// Units a replica asks for the first time it sees a seller (or after it forgot it), before it
/// has seen how many its blocks get used (see [`Blocks::wanted`]).
pub const FIRST_SIZE: u32 = 16;

/// How often the blocks are looked through for ones that are over.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// `mutex` locked (none of this module's locks is held across anything that can panic).
fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .expect("a permit block's lock is never poisoned")
}

/// One seller's block while its units are handed out.
#[derive(Debug)]
struct Block {
    token: String,
    /// Unit numbers not handed out yet (2 to units + 1), the next one last.
    free: Vec<u32>,
    /// How many units it took.
    units: usize,
    /// Redis time of the grant (µs).
    granted_us: i64,
    /// This replica's clock before the grant was asked.
    asked: Instant,
    used_permille: u32,
}

/// What a block's calls answered, until it is written (see the module's doc).
#[derive(Debug)]
struct Ledger {
    seller: SellerId,
    asked: Instant,
    /// Units handed out whose answer is not known yet.
    pending: usize,
    /// No more units are handed out.
    closed: bool,
    done: Settled,
}

/// A block over, to write to Redis in one step (`lua/block_end.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    pub seller: SellerId,
    pub token: String,
    /// Units never handed out: given back.
    pub unused: Vec<u32>,
    /// (unit, when its answer came: Redis µs, an upper bound; -1 = when written, accepted).
    pub answers: Vec<(u32, i64, bool)>,
}

/// A unit handed out: the call it names and an upper bound of Redis time now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    pub call: String,
    pub granted_us: i64,
    pub used_permille: u32,
}

/// The blocks one replica holds, by seller, and the ledgers of those not written yet.
#[derive(Debug)]
pub struct Blocks {
    held: Mutex<HashMap<SellerId, Block>>,
    /// By the token of the call that took the block.
    ledgers: Mutex<HashMap<String, Ledger>>,
    /// How many units to ask for next, by seller (see [`Blocks::wanted`]); at most
    /// [`MOST_BLOCKS`] sellers (forgotten all at once beyond).
    sizes: Mutex<HashMap<SellerId, u32>>,
    /// Units a block of this replica's got used, on average (exponentially weighted over the
    /// last blocks of every seller): a new seller's first block is sized by it.
    typical: Mutex<f64>,
    /// Most units asked for with a grant.
    want: u32,
    /// How long after it was asked a block's units are handed out.
    hold: Duration,
    /// How long after it was asked a block's calls may still answer: the hold plus a call's
    /// bound. A ledger is written by then whatever it still waits for.
    settle_by: Duration,
    /// When the blocks were last looked through.
    swept: Mutex<Instant>,
    /// Messages that asked for a grant since the last sweep, and this replica's rate of them
    /// (per second, exponentially weighted; 0 until measured).
    asking: std::sync::atomic::AtomicU64,
    rate: Mutex<f64>,
}

impl Blocks {
    /// Blocks of up to `want` units (at most [`MOST_UNITS`]), handed out within `hold`, whose
    /// calls answer within `bound` of being handed out.
    pub fn new(want: u32, hold: Duration, bound: Duration) -> Self {
        Self {
            held: Mutex::default(),
            ledgers: Mutex::default(),
            sizes: Mutex::default(),
            typical: Mutex::new(f64::from(FIRST_SIZE) / 1.5),
            want: want.min(MOST_UNITS),
            hold,
            settle_by: hold + bound,
            swept: Mutex::new(Instant::now()),
            asking: std::sync::atomic::AtomicU64::new(0),
            rate: Mutex::new(0.0),
        }
    }

    /// A message asks for a grant (for the replica's rate, see [`Self::wanted`]).
    pub fn asking(&self) {
        self.asking
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The hold in µs, as the script takes it.
    pub fn hold_us(&self) -> u64 {
        self.hold.as_micros() as u64
    }

    /// How many units to ask for with a grant of `seller`: as many as this replica handed out
    /// of the seller's last block within its hold, twice as many when it handed out all of
    /// them, for a seller not seen lately half again what this replica's blocks get used on
    /// average, at most the configured most. After a
    /// block of which nothing was handed out, one grant asks for none, the next for one unit
    /// (a seller with a message now and then costs no block each time). None while this
    /// replica holds as many blocks (or ledgers) as it may.
    pub fn wanted(&self, seller: &SellerId) -> u32 {
        if self.want == 0 {
            return 0;
        }
        {
            let held = locked(&self.held);
            if held.len() >= MOST_BLOCKS && !held.contains_key(seller) {
                return 0;
            }
        }
        if locked(&self.ledgers).len() >= 2 * MOST_BLOCKS {
            return 0;
        }
        let mut sizes = locked(&self.sizes);
        match sizes.get_mut(seller) {
            Some(size) if *size == 0 => {
                *size = 1;
                0
            }
            Some(size) => (*size).min(self.want),
            None => self.first_size(),
        }
    }

    /// A new seller's first block: half again what this replica's blocks get used on average
    /// (see [`FIRST_SIZE`] for the start), and, once this replica's rate of messages is known,
    /// no more than 1.5 × the messages it can expect of one seller within a hold: its rate ×
    /// the hold, shared by the sellers it holds blocks of. At least 2.
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

    /// Notes how a block of `units` ended: `used` of them handed out.
    fn note_size(&self, seller: &SellerId, units: usize, used: usize) {
        {
            let mut typical = locked(&self.typical);
            *typical = 0.9 * *typical + 0.1 * used as f64;
        }
        let next = if used >= units {
            (2 * units).min(self.want as usize)
        } else {
            used
        };
        let mut sizes = locked(&self.sizes);
        if sizes.len() >= MOST_BLOCKS && !sizes.contains_key(seller) {
            sizes.clear();
        }
        sizes.insert(seller.clone(), next as u32);
    }

    /// Whether the seller's block is within its hold with a unit left.
    pub fn holds(&self, seller: &SellerId) -> bool {
        let held = locked(&self.held);
        held.get(seller)
            .is_some_and(|b| !b.free.is_empty() && b.asked.elapsed() < self.hold)
    }

    /// Hands out a unit of the seller's block, if it holds one still within its hold.
    pub fn take(&self, seller: &SellerId) -> Option<Unit> {
        let mut held = locked(&self.held);
        let block = held.get_mut(seller)?;
        let since = block.asked.elapsed();
        if since >= self.hold {
            return None;
        }
        let unit = block.free.pop()?;
        let taken = Unit {
            call: format!("{}-{unit}", block.token),
            granted_us: block
                .granted_us
                .saturating_add(since.as_micros().min(i64::MAX as u128) as i64),
            used_permille: block.used_permille,
        };
        if let Some(ledger) = locked(&self.ledgers).get_mut(&block.token) {
            ledger.pending += 1;
        }
        if block.free.is_empty() {
            let block = held.remove(seller).expect("the block is held");
            drop(held);
            // Used up: nothing to give back, its ledger waits for the answers.
            let closed = self.close(seller, block);
            debug_assert!(closed.is_none());
        }
        Some(taken)
    }

    /// Keeps a block of `units` granted with the call `token` at Redis time `granted_us`, asked
    /// at `asked`; returns what the seller's previous block left to write, if it is over.
    pub fn keep(
        &self,
        seller: &SellerId,
        token: &str,
        units: u32,
        granted_us: i64,
        asked: Instant,
        used_permille: u32,
    ) -> Option<Settled> {
        if units == 0 {
            return None;
        }
        let units = units.min(MOST_UNITS);
        let block = Block {
            token: token.to_owned(),
            free: (2..=units + 1).rev().collect(),
            units: units as usize,
            granted_us,
            asked,
            used_permille,
        };
        locked(&self.ledgers).insert(
            token.to_owned(),
            Ledger {
                seller: seller.clone(),
                asked,
                // The call that took the block is its unit 1, handed out with the grant.
                pending: 1,
                closed: false,
                done: Settled {
                    seller: seller.clone(),
                    token: token.to_owned(),
                    unused: Vec::new(),
                    answers: Vec::new(),
                },
            },
        );
        let old = locked(&self.held).insert(seller.clone(), block);
        old.and_then(|old| self.close(seller, old))
    }

    /// Ends the handing out of a block: its size noted (see [`Self::wanted`]), its free units
    /// to give back; its ledger, if nothing it handed out still waits for an answer.
    fn close(&self, seller: &SellerId, block: Block) -> Option<Settled> {
        self.note_size(seller, block.units, block.units - block.free.len());
        let mut ledgers = locked(&self.ledgers);
        let ledger = ledgers.get_mut(&block.token)?;
        ledger.closed = true;
        ledger.done.unused.extend(block.free);
        if ledger.pending == 0 {
            return ledgers.remove(&block.token).map(|l| l.done);
        }
        None
    }

    /// Notes the answer of `call`, if it is a unit of one of this replica's blocks (else
    /// `None`: not a block's): when it came (Redis µs, an upper bound; `None`: unknown, taken
    /// as when the ledger is written) and whether the downstream accepted it. Answers
    /// `Some(Some(..))` when that was the last answer its block waited for.
    pub fn answered(
        &self,
        call: &str,
        answered_us: Option<i64>,
        accepted: bool,
    ) -> Option<Option<Settled>> {
        // Unit 1 is the call that took the block, named by the token itself.
        let (token, unit) = match call.rsplit_once('-') {
            Some((token, unit)) => (token, unit.parse().ok()?),
            None => (call, 1),
        };
        self.unit_done(token, unit, |done| {
            done.answers
                .push((unit, answered_us.unwrap_or(-1).max(-1), accepted))
        })
    }

    /// Unit `unit` the ledger of `token` waited for is done, `note`d in what it will write
    /// (`None`: no ledger of this replica's); answers what it leaves to write if that was the
    /// last. A unit noted already (a record retried) changes nothing.
    fn unit_done(
        &self,
        token: &str,
        unit: u32,
        note: impl FnOnce(&mut Settled),
    ) -> Option<Option<Settled>> {
        let mut ledgers = locked(&self.ledgers);
        let ledger = ledgers.get_mut(token)?;
        if ledger.done.answers.iter().any(|(u, _, _)| *u == unit)
            || ledger.done.unused.contains(&unit)
        {
            return Some(None);
        }
        ledger.pending = ledger.pending.saturating_sub(1);
        note(&mut ledger.done);
        if ledger.closed && ledger.pending == 0 {
            return Some(ledgers.remove(token).map(|l| l.done));
        }
        Some(None)
    }

    /// A unit handed out whose call will not be made (its message registered already, the
    /// seller is paused, or its claim failed: reclaimed): given back with its block. Answers
    /// what the block leaves to write if that was the last unit it waited for.
    pub fn release(&self, call: &str) -> Option<Settled> {
        let (token, unit) = call.rsplit_once('-')?;
        let unit: u32 = unit.parse().ok()?;
        self.unit_done(token, unit, |done| done.unused.push(unit))
            .flatten()
    }

    /// Blocks whose hold is over, closed, and ledgers written: those closed with every answer
    /// in, and those whose calls can no longer answer (a unit handed out but never called, a
    /// replica that lost track) with what they have. Also measures this replica's rate of
    /// messages since the last sweep (see [`Self::first_size`]). At most once per
    /// [`SWEEP_EVERY`] (an empty list otherwise).
    pub fn sweep(&self) -> Vec<Settled> {
        {
            let mut swept = locked(&self.swept);
            let since = swept.elapsed();
            if since < SWEEP_EVERY {
                return Vec::new();
            }
            *swept = Instant::now();
            let asked = self.asking.swap(0, std::sync::atomic::Ordering::Relaxed) as f64;
            let now = asked / since.as_secs_f64();
            let mut rate = locked(&self.rate);
            *rate = if *rate == 0.0 {
                now
            } else {
                0.7 * *rate + 0.3 * now
            };
        }
        let over: Vec<(SellerId, Block)> = {
            let mut held = locked(&self.held);
            let sellers: Vec<SellerId> = held
                .iter()
                .filter(|(_, b)| b.asked.elapsed() >= self.hold)
                .map(|(seller, _)| seller.clone())
                .collect();
            sellers
                .into_iter()
                .filter_map(|seller| held.remove(&seller).map(|b| (seller, b)))
                .collect()
        };
        let mut settled: Vec<Settled> = over
            .into_iter()
            .filter_map(|(seller, old)| self.close(&seller, old))
            .collect();
        settled.extend(self.overdue(self.settle_by));
        settled
    }

    /// Takes the seller's block away (its limit changed or it was paused: no more units are
    /// handed out); what it leaves to write, if nothing it handed out waits for an answer.
    pub fn drop_seller(&self, seller: &SellerId) -> Option<Settled> {
        self.drop_if(seller, |_| true)
    }

    /// Takes the seller's block away if it is the one that handed out `call` (not a newer one).
    pub fn drop_block_of(&self, seller: &SellerId, call: &str) -> Option<Settled> {
        let token = call.rsplit_once('-').map_or(call, |(token, _)| token);
        self.drop_if(seller, |block| block.token == token)
    }

    fn drop_if(&self, seller: &SellerId, which: impl Fn(&Block) -> bool) -> Option<Settled> {
        let old = {
            let mut held = locked(&self.held);
            if !held.get(seller).is_some_and(which) {
                return None;
            }
            held.remove(seller)
        };
        old.and_then(|old| self.close(seller, old))
    }

    /// Ledgers asked for at least `age` ago, removed (with their blocks, if still held).
    fn overdue(&self, age: Duration) -> Vec<Settled> {
        // Locked in the order `take` locks them: held, then ledgers.
        let mut held = locked(&self.held);
        let mut ledgers = locked(&self.ledgers);
        let tokens: Vec<String> = ledgers
            .iter()
            .filter(|(_, l)| l.asked.elapsed() >= age)
            .map(|(token, _)| token.clone())
            .collect();
        let mut ended = Vec::new();
        let settled = tokens
            .into_iter()
            .filter_map(|token| {
                let mut ledger = ledgers.remove(&token)?;
                if held.get(&ledger.seller).is_some_and(|b| b.token == token)
                    && let Some(block) = held.remove(&ledger.seller)
                {
                    ended.push((
                        ledger.seller.clone(),
                        block.units,
                        block.units - block.free.len(),
                    ));
                    ledger.done.unused.extend(block.free);
                }
                Some(ledger.done)
            })
            .collect();
        drop((held, ledgers));
        for (seller, units, used) in ended {
            self.note_size(&seller, units, used);
        }
        settled
    }

    /// Every block and ledger taken away (shutdown), to write with what they have.
    pub fn drain(&self) -> Vec<Settled> {
        self.overdue(Duration::ZERO)
    }

    /// Sellers with a block held now.
    pub fn len(&self) -> usize {
        locked(&self.held).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seller(id: &str) -> SellerId {
        SellerId::parse(id).unwrap()
    }

    fn blocks(want: u32) -> Blocks {
        Blocks::new(want, Duration::from_secs(60), Duration::from_secs(60))
    }

    #[test]
    fn a_block_hands_out_each_unit_once_in_order_then_is_gone() {
        let blocks = blocks(3);
        blocks.keep(&seller("S-1"), "ab12", 3, 1_000, Instant::now(), 10);
        let calls: Vec<String> =
            std::iter::from_fn(|| blocks.take(&seller("S-1")).map(|u| u.call)).collect();
        assert_eq!(calls, ["ab12-2", "ab12-3", "ab12-4"]);
        assert!(blocks.is_empty());
    }

    #[test]
    fn a_used_up_block_is_written_once_its_last_call_answered_with_every_answer() {
        let blocks = blocks(2);
        let s1 = seller("S-1");
        blocks.keep(&s1, "ab12", 2, 0, Instant::now(), 0);
        let first = blocks.take(&s1).unwrap();
        let second = blocks.take(&s1).unwrap();
        assert_eq!(blocks.answered(&first.call, Some(100), true), Some(None));
        assert_eq!(blocks.answered(&second.call, Some(200), false), Some(None));
        let settled = blocks.answered("ab12", Some(50), true).unwrap().unwrap();
        assert_eq!(settled.token, "ab12");
        assert_eq!(settled.unused, Vec::<u32>::new());
        assert_eq!(
            settled.answers,
            vec![(2, 100, true), (3, 200, false), (1, 50, true)]
        );
        assert_eq!(blocks.answered(&second.call, Some(300), true), None);
    }

    #[test]
    fn a_unit_released_is_given_back_with_the_units_never_handed_out() {
        let blocks = blocks(3);
        let s1 = seller("S-1");
        blocks.keep(&s1, "ab12", 3, 0, Instant::now(), 0);
        let unit = blocks.take(&s1).unwrap();
        assert_eq!(blocks.release(&unit.call), None);
        assert_eq!(
            blocks.drop_seller(&s1),
            None,
            "the call that took it is pending"
        );
        let settled = blocks.answered("ab12", Some(5), true).unwrap().unwrap();
        let mut unused = settled.unused.clone();
        unused.sort();
        assert_eq!(unused, [2, 3, 4]);
        assert_eq!(settled.answers, vec![(1, 5, true)]);
    }

    #[test]
    fn an_answer_noted_twice_counts_once() {
        let blocks = blocks(2);
        let s1 = seller("S-1");
        blocks.keep(&s1, "ab12", 2, 0, Instant::now(), 0);
        let first = blocks.take(&s1).unwrap();
        blocks.take(&s1).unwrap();
        assert_eq!(blocks.answered(&first.call, Some(1), true), Some(None));
        assert_eq!(blocks.answered(&first.call, Some(1), true), Some(None));
        assert_eq!(
            blocks.answered("ab12", Some(2), true),
            Some(None),
            "unit 3 is still pending"
        );
    }

    #[test]
    fn a_failed_claim_drops_only_the_block_it_came_from() {
        let blocks = blocks(4);
        let s1 = seller("S-1");
        blocks.keep(&s1, "old", 2, 0, Instant::now(), 0);
        let unit = blocks.take(&s1).unwrap();
        blocks.keep(&s1, "new", 2, 0, Instant::now(), 0);
        assert_eq!(blocks.drop_block_of(&s1, &unit.call), None);
        assert!(blocks.holds(&s1), "the newer block stays");
    }

    #[test]
    fn a_call_that_is_no_unit_of_a_block_is_not_a_blocks() {
        let blocks = blocks(2);
        assert_eq!(blocks.answered("cd34", Some(1), true), None);
        assert_eq!(blocks.answered("ab12-x", Some(1), true), None);
        assert_eq!(blocks.answered("ab12-2", Some(1), true), None);
    }

    #[test]
    fn a_unit_is_not_handed_out_once_the_hold_is_over_and_the_rest_is_given_back() {
        let blocks = Blocks::new(4, Duration::from_millis(1), Duration::from_secs(60));
        let s1 = seller("S-1");
        blocks.keep(&s1, "ab12", 4, 1_000, Instant::now(), 10);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(blocks.take(&s1), None);
        *blocks.swept.lock().unwrap() -= SWEEP_EVERY;
        assert_eq!(
            blocks.sweep(),
            vec![],
            "the call that took it has not answered"
        );
        assert!(blocks.is_empty());
        let settled = blocks.answered("ab12", Some(9), true).unwrap().unwrap();
        let mut units = settled.unused.clone();
        units.sort();
        assert_eq!(units, [2, 3, 4, 5]);
        assert_eq!(settled.answers, vec![(1, 9, true)]);
    }

    #[test]
    fn a_ledger_whose_calls_can_no_longer_answer_is_written_with_what_it_has() {
        let blocks = Blocks::new(4, Duration::from_millis(1), Duration::from_millis(1));
        let s1 = seller("S-1");
        blocks.keep(&s1, "ab12", 4, 1_000, Instant::now(), 10);
        let unit = blocks.take(&s1).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        *blocks.swept.lock().unwrap() -= SWEEP_EVERY;
        let settled = blocks.sweep();
        assert_eq!(settled.len(), 1);
        assert_eq!(settled[0].unused.len(), 3);
        assert!(settled[0].answers.is_empty());
        assert_eq!(blocks.answered(&unit.call, Some(1), true), None);
    }

    #[test]
    fn a_unit_says_redis_time_no_earlier_than_the_grant_plus_the_time_since_it_was_asked() {
        let blocks = blocks(2);
        let asked = Instant::now() - Duration::from_millis(20);
        blocks.keep(&seller("S-1"), "ab12", 2, 5_000_000, asked, 0);
        let unit = blocks.take(&seller("S-1")).unwrap();
        assert!(unit.granted_us >= 5_020_000, "{unit:?}");
    }

    #[test]
    fn a_new_block_closes_the_old_one_and_a_drain_takes_the_rest() {
        let blocks = blocks(8);
        let s1 = seller("S-1");
        blocks.keep(&s1, "old", 2, 0, Instant::now(), 0);
        let unit = blocks.take(&s1).unwrap();
        assert_eq!(blocks.keep(&s1, "new", 2, 0, Instant::now(), 0), None);
        assert_eq!(blocks.answered("old", Some(7), true), Some(None));
        let old = blocks.answered(&unit.call, None, true).unwrap().unwrap();
        assert_eq!((old.token.as_str(), old.unused.clone()), ("old", vec![3]));
        assert_eq!(old.answers, vec![(1, 7, true), (2, -1, true)]);
        let rest = blocks.drain();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].token, "new");
        assert_eq!(rest[0].unused.len(), 2);
    }

    #[test]
    fn a_block_used_up_asks_for_twice_as_many_and_one_left_unused_for_what_was_used() {
        let blocks = blocks(16);
        let s1 = seller("S-1");
        assert_eq!(blocks.wanted(&s1), FIRST_SIZE);
        blocks.keep(&s1, "a", 2, 0, Instant::now(), 0);
        while blocks.take(&s1).is_some() {}
        assert_eq!(blocks.wanted(&s1), 4);
        blocks.keep(&s1, "b", 4, 0, Instant::now(), 0);
        blocks.take(&s1);
        blocks.drain();
        assert_eq!(blocks.wanted(&s1), 1);
    }

    #[test]
    fn a_new_sellers_first_block_follows_how_many_units_blocks_get_used() {
        let blocks = blocks(64);
        assert_eq!(blocks.wanted(&seller("S-first")), FIRST_SIZE);
        for i in 0..40 {
            let s = seller(&format!("S-{i}"));
            blocks.keep(&s, &format!("t{i}"), 8, 0, Instant::now(), 0);
            for _ in 0..4 {
                blocks.take(&s);
            }
            blocks.drop_seller(&s);
        }
        let first = blocks.wanted(&seller("S-new"));
        assert!((5..=8).contains(&first), "4 of 8 used each time: {first}");
    }

    #[test]
    fn a_new_sellers_first_block_is_what_one_seller_of_this_replicas_rate_can_use() {
        let blocks = Blocks::new(64, Duration::from_secs(2), Duration::from_secs(60));
        for i in 0..100 {
            let s = seller(&format!("S-{i}"));
            blocks.keep(&s, &format!("t{i}"), 8, 0, Instant::now(), 0);
        }
        // 100 messages a second over the 100 sellers it holds blocks of: 2 per hold each.
        *blocks.rate.lock().unwrap() = 100.0;
        assert_eq!(blocks.wanted(&seller("S-new")), 3);
        *blocks.rate.lock().unwrap() = 10_000.0;
        assert_eq!(blocks.wanted(&seller("S-new")), FIRST_SIZE);
    }

    #[test]
    fn after_a_block_left_whole_one_grant_asks_for_none_and_the_next_for_one() {
        let blocks = blocks(16);
        let s1 = seller("S-1");
        blocks.keep(&s1, "a", 2, 0, Instant::now(), 0);
        blocks.drain();
        assert_eq!(blocks.wanted(&s1), 0);
        assert_eq!(blocks.wanted(&s1), 1);
        assert_eq!(blocks.wanted(&s1), 1);
    }

    #[test]
    fn no_block_is_asked_for_a_new_seller_once_as_many_are_held_as_allowed() {
        let blocks = blocks(16);
        for i in 0..MOST_BLOCKS {
            blocks.keep(
                &seller(&format!("S-{i}")),
                &format!("t{i}"),
                2,
                0,
                Instant::now(),
                0,
            );
        }
        assert_eq!(blocks.wanted(&seller("S-new")), 0);
        assert_eq!(blocks.wanted(&seller("S-0")), FIRST_SIZE);
        assert_eq!(blocks.drain().len(), MOST_BLOCKS);
        assert_eq!(
            blocks.wanted(&seller("S-new")),
            2,
            "room again, and blocks that went unused make a new seller's first block small"
        );
    }
}
