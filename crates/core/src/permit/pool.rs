//! The permit pool in front of the seller's script (`TURNSTILE_PERMIT_BLOCK`, sliding-window
//! only): a grant far from the limits takes a block of units into the seller's pool, claimed
//! by any replica's next calls without a script (see [`super::block`] for the bookkeeping),
//! and what those calls answered is written back in the background.

use crate::permit::batch::{Operation, When};
use crate::permit::block::Blocks;
use crate::permit::calls::{AcquireAnswer, CompleteAnswer};
use crate::permit::decision::{Decision, parse_override};
use crate::permit::error::PermitError;
use crate::permit::observed::observe;
use crate::permit::outcome::{CallAnswer, Lesson};
use crate::permit::store::{PermitStore, THROTTLED_FOR};
use crate::permit::{block, completion};
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Algorithm, LimiterArgs, Limits};
use crate::domain::{Cost, MessageId, SellerId};

/// How much room a plain claim of a pool unit leaves between its call's bound and the unit's
/// end (see `PermitStore::grant_from_pool`): for the replica's clock, which measures the bound,
/// to run a little slower than Redis's.
pub(super) const CLAIM_MARGIN_US: i64 = 20_000;

/// How often what calls made with pool units answered is written (see
/// [`block::Blocks::answered`]).
pub(super) const WRITE_ANSWERS_EVERY: Duration = Duration::from_millis(500);

/// What a pool claim reads: the seller's pause, override and the message's completion record,
/// Redis's TIME, and the unit popped from the pool with its end.
pub(super) type PoolClaim = (Vec<Option<String>>, (i64, i64), Vec<String>);

impl PermitStore {
    /// The permit blocks, when the terms `limiter` allow them: sliding-window, neither a
    /// global limit nor a seller concurrency.
    pub(super) fn pooled(&self, limiter: &LimiterArgs) -> Option<&Arc<Blocks>> {
        self.blocks.as_ref().filter(|_| {
            limiter.algorithm == Algorithm::SlidingWindow
                && limiter.global_limit.0.is_none()
                && limiter.seller_concurrency.0.is_none()
        })
    }

    /// What a sliding-window grant of one unit (asked at `asked`) did with the seller's pool
    /// of permit blocks (see `calls::PoolAnswer`): units taken into it or claimed from it (then the
    /// call is that unit), stale units given back.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn took_from_pool(
        &self,
        limiter: &LimiterArgs,
        blocks: &Arc<Blocks>,
        seller: &SellerId,
        answer: &AcquireAnswer,
        block: u32,
        asked: std::time::Instant,
        decision: &mut Decision,
    ) {
        let pool = answer.pool(block);
        blocks.acquired(seller, pool.taken, pool.stale);
        if !blocks.tries_pool(seller) {
            blocks.unseen_pool(pool.unit.is_some());
        }
        if let Decision::Granted { call, .. } = decision
            && (pool.unit.is_some() || pool.taken > 0)
        {
            if let Some(unit) = pool.unit {
                metrics::counter!("turnstile_permit_block_units_total").increment(1);
                *call = unit;
            } else {
                metrics::counter!("turnstile_permit_blocks_total").increment(1);
            }
            let stack = answer.stack().unwrap_or_else(|_| limiter.limit.clone());
            blocks.saw_pool(seller, asked);
            blocks.claimed(call, Self::log_bounds(limiter, &stack));
        }
    }

    /// The accepted log's bounds under `stack` (see [`block::LogBounds`]).
    pub(super) fn log_bounds(limiter: &LimiterArgs, stack: &Limits) -> block::LogBounds {
        block::LogBounds {
            span_us: stack
                .iter()
                .map(|l| (l.window() + limiter.guard_for(l.window())).as_micros() as u64)
                .max()
                .unwrap_or(0),
            most: stack
                .iter()
                .map(|l| u64::from(l.count()))
                .max()
                .unwrap_or(0),
        }
    }

    /// A grant from the seller's pool (see [`block`]) in one plain round trip, if this replica
    /// saw units in it lately (or guesses it has some, see [`Blocks::guesses_pool`]): the
    /// seller's pause, limit override and the message's completion record read (a plain claim
    /// does not read them the way an acquire does), Redis's `TIME` and the claim of a unit
    /// (`ZPOPMIN`). `TIME` runs after the message asked, so a call bounded from then answers by
    /// `TIME` + its bound at the latest: the unit is used only if that (and
    /// [`CLAIM_MARGIN_US`]) is within its end in the seller's calls. A unit that is not used
    /// (late, its message registered, its seller paused) is given back; an empty pool sends the
    /// message to an acquire.
    pub(super) async fn grant_from_pool(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
    ) -> Result<Option<Decision>, PermitError> {
        let limiter = self.limiter();
        let Some(blocks) = self.pooled(&limiter) else {
            return Ok(None);
        };
        blocks.asking();
        if cost != Cost::ONE {
            return Ok(None);
        }
        let seen = blocks.tries_pool(seller);
        if !seen && !blocks.guesses_pool() {
            return Ok(None);
        }
        let asked = std::time::Instant::now();
        let mut read = redis::cmd("MGET");
        read.arg(self.keys.pause(seller))
            .arg(self.keys.limit(seller));
        if let Some(message) = message {
            read.arg(self.keys.done(seller, message));
        }
        let mut claim = redis::cmd("ZPOPMIN");
        claim.arg(self.keys.pool(seller));
        let ((read, (seconds, micros), popped), sent): (PoolClaim, _) = self
            .run_sent(
                Operation::commands(
                    vec![read, redis::cmd("TIME"), claim],
                    self.keys.pause(seller),
                ),
                When::Now,
            )
            .await?;
        let now_us = seconds.saturating_mul(1_000_000).saturating_add(micros);
        let (Some(unit), Some(ends)) = (
            popped.first(),
            popped.get(1).and_then(|s| s.parse::<f64>().ok()),
        ) else {
            if seen {
                blocks.pool_gone(seller);
            } else {
                blocks.unseen_pool(false);
            }
            return Ok(None);
        };
        if !seen {
            blocks.unseen_pool(true);
        }
        if read
            .get(2)
            .is_some_and(|state| state.as_deref().is_some_and(completion::is_registered))
        {
            self.give_back_unit(seller, unit);
            return Ok(Some(Decision::AlreadyDone));
        }
        let paused_until = read
            .first()
            .and_then(|until| until.as_deref()?.parse::<i64>().ok())
            .unwrap_or(0);
        let in_hold = now_us + self.call_bound_us() as i64 + CLAIM_MARGIN_US <= ends as i64;
        if paused_until > now_us || !in_hold {
            // The message acquires, which says when to come back.
            self.give_back_unit(seller, unit);
            blocks.pool_gone(seller);
            return Ok(None);
        }
        self.clock.observe(now_us);
        let granted_us = now_us;
        // A pool is only made under no learned limit: the override's stack, or the default.
        let stack = read
            .get(1)
            .and_then(|raw| parse_override(raw.as_deref()?))
            .unwrap_or_else(|| limiter.limit.clone());
        blocks.saw_pool(seller, asked);
        blocks.claimed(unit, Self::log_bounds(&limiter, &stack));
        let decision = Decision::Granted {
            slot_us: granted_us,
            granted_us,
            // A block is only granted with at most half of every limit used.
            used_permille: 0,
            call: unit.clone(),
            sent,
        };
        metrics::counter!("turnstile_permit_block_units_total").increment(1);
        observe(limiter.algorithm, &decision, true);
        Ok(Some(decision))
    }

    /// Gives back a pool unit this replica claimed but will not call (in the background): it
    /// leaves the seller's log and calls. Until then, or if that fails, it holds its place until
    /// its end.
    pub(super) fn give_back_unit(&self, seller: &SellerId, unit: &str) {
        let mut from_log = redis::cmd("ZREM");
        from_log
            .arg(self.keys.state(seller, Algorithm::SlidingWindow))
            .arg(unit);
        let mut from_calls = redis::cmd("ZREM");
        from_calls.arg(self.keys.calls(seller)).arg(unit);
        let operation = Operation::commands(vec![from_log, from_calls], self.keys.calls(seller));
        let store = self.clone();
        tokio::spawn(async move {
            if let Err(error) = store
                .run::<redis::Value>(operation, When::Within(store.record_delay))
                .await
            {
                tracing::debug!(%error, "a permit-block unit was not given back: it holds its place until its end");
            }
        });
    }

    /// The units a grant of `cost` for the seller may take into its pool with it (see
    /// [`Blocks::wanted`]): none without permit blocks or for a call of more than one unit.
    pub(super) fn block_wanted(&self, seller: &SellerId, cost: Cost) -> u32 {
        match &self.blocks {
            Some(blocks) if cost == Cost::ONE => blocks.wanted(seller),
            _ => 0,
        }
    }

    /// The seller's terms changed (or it was paused): this replica stops claiming from its pool
    /// without an acquire.
    pub(super) fn drop_block(&self, seller: &SellerId) {
        if let Some(blocks) = &self.blocks {
            blocks.pool_gone(seller);
        }
    }

    /// A message registered by a call of one unit made with a pool unit, in no upload: no
    /// upload to count, and no learned limit applied when its pool was made (so no raise to
    /// look for), so the state moves to `registered` by a plain SET ... GET (complete.lua's
    /// transitions read from what it was); the call's answer is written with others of the
    /// seller's (see `Blocks::answered`).
    pub(super) async fn record_pooled(
        &self,
        seller: &SellerId,
        message: &MessageId,
        answer: CallAnswer<'_>,
        ttl: Duration,
        blocks: &Arc<Blocks>,
        bounds: block::LogBounds,
    ) -> Result<CompleteAnswer, PermitError> {
        let mut set = redis::cmd("SET");
        let state = match answer.result {
            Some(result) => format!("registered {result}"),
            None => "registered".to_owned(),
        };
        set.arg(self.keys.done(seller, message))
            .arg(state)
            .arg("PX")
            .arg(ttl.as_millis().max(1) as u64)
            .arg("GET");
        let (was,): (Option<String>,) = self
            .run(
                Operation::commands(vec![set], self.keys.done(seller, message)),
                When::Within(self.record_delay),
            )
            .await?;
        if let Some(at) = answer.answered_us {
            let full = blocks.answered(seller, answer.call, at, bounds);
            self.start_writing_answers(blocks);
            if let Some(full) = full {
                let store = self.clone();
                tokio::spawn(async move { store.write_answers(vec![full]).await });
            }
        }
        Ok(CompleteAnswer::registered_from(was.as_deref()))
    }

    /// Writes what calls made with pool units answered every [`WRITE_ANSWERS_EVERY`] (see
    /// [`Blocks::answered`]); started with the first such answer, it writes what is left and
    /// ends once only it holds the blocks (every clone of this store dropped).
    pub(super) fn start_writing_answers(&self, blocks: &Arc<Blocks>) {
        if self.writing_answers.set(()).is_err() {
            return;
        }
        let store = self.clone();
        let blocks = blocks.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(WRITE_ANSWERS_EVERY);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                // This task's two handles (`store`'s and `blocks`) are the last ones left.
                let last = Arc::strong_count(&blocks) <= 2;
                store.write_answers(blocks.take_answers()).await;
                if last {
                    return;
                }
            }
        });
    }

    /// Writes what calls made with pool units answered, one plain step per seller: each call's
    /// end in the seller's calls comes forward to its answer (`ZADD XX LT`), and with adaptive
    /// limits the calls go into the accepted log, kept to as many entries and as long a life as
    /// `note_accepted` keeps it (entries older than its span are dropped by the next note
    /// through a script; `learn.lua` counts the log by time, so they are never counted). Until
    /// then, or if that fails, a call holds its place until its end.
    pub(super) async fn write_answers(&self, answers: Vec<(SellerId, block::Answers)>) {
        let limiter = self.limiter();
        let throttled: Vec<SellerId> = if limiter.adaptive {
            let lately = self
                .throttled
                .lock()
                .expect("the throttled sellers' lock is never poisoned");
            answers
                .iter()
                .filter(|(seller, _)| {
                    lately
                        .get(seller)
                        .is_some_and(|at| at.elapsed() < THROTTLED_FOR)
                })
                .map(|(seller, _)| seller.clone())
                .collect()
        } else {
            Vec::new()
        };
        let writes = answers.into_iter().map(|(seller, answers)| {
            let mut end = redis::cmd("ZADD");
            end.arg(self.keys.calls(&seller)).arg("XX").arg("LT");
            for (at, call) in &answers.calls {
                end.arg(*at).arg(call);
            }
            let mut commands = vec![end];
            if limiter.adaptive {
                let accepted = self.keys.accepted(&seller);
                let mut note = redis::cmd("ZADD");
                note.arg(&accepted);
                for (at, call) in &answers.calls {
                    note.arg(*at).arg(call);
                }
                let mut by_number = redis::cmd("ZREMRANGEBYRANK");
                by_number
                    .arg(&accepted)
                    .arg(0)
                    .arg(-(2 * answers.bounds.most as i64 + answers.calls.len() as i64 + 1));
                let mut expire = redis::cmd("PEXPIRE");
                expire.arg(&accepted).arg(answers.bounds.span_us / 1000 + 1);
                commands.extend([note, by_number, expire]);
            }
            let operation = Operation::commands(commands, self.keys.calls(&seller));
            self.run::<redis::Value>(operation, When::Within(self.record_delay))
        });
        for result in futures::future::join_all(writes).await {
            if let Err(error) = result {
                tracing::debug!(%error, "answers of calls made with pool units were not written: each holds its place until its end");
            }
        }
        // A 429 learned before these answers were written may have lowered the seller's limit
        // below what the downstream accepted: they may correct it now.
        for seller in throttled {
            match self.learn(&seller, Lesson::Recovery).await {
                Ok(Some(change)) => {
                    tracing::info!(counts = %change.counts, why = change.why.label(), "the seller's learned limit changed");
                }
                Ok(None) => {}
                Err(error) => tracing::debug!(%error, "could not learn from the pool's answers"),
            }
        }
    }

    /// Writes at once what calls made with pool units answered (at shutdown).
    pub async fn write_pool_answers(&self) {
        if let Some(blocks) = &self.blocks {
            self.write_answers(blocks.take_answers()).await;
        }
    }
}
