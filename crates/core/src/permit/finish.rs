//! Finishing: what the limiter records after a call — its end in the seller's calls, a
//! registration's completion record (`lua/complete.lua`), what adaptive limits learn from the
//! answer (`lua/learn.lua`), a reported cost (`lua/recost.lua`) — and a slot given back unused
//! (`lua/unreserve.lua`).

use std::time::Duration;

use crate::config::Algorithm;
use crate::domain::{BatchId, BatchSize, Cost, MessageId, SellerId};
use crate::permit::batch::{Operation, When};
use crate::permit::calls;
use crate::permit::calls::{CallEnded, Unreserve};
use crate::permit::calls::{Complete, CompleteAnswer, CompleteBatch};
use crate::permit::calls::{Learn, LearnAnswer};
use crate::permit::calls::{Recost, Recosted};
use crate::permit::decision::{CHARGE_MEMORY, Reservation};
use crate::permit::error::PermitError;
use crate::permit::outcome::{
    BatchEvent, CallAnswer, Completion, InBatch, LearnedChange, Lesson, Recorded, Why,
};
use crate::permit::records::Orphan;
use crate::permit::store::{MOST_THROTTLED, PermitStore};
use crate::permit::terms::Terms;
use crate::routes::Route;

/// How far a learned stack stands below its configured one: the smallest learned / configured
/// count over its limits (1 when nothing is learned below it), from the counts as the scripts
/// write them.
pub(super) fn learned_ratio(learned: &str, configured: &str) -> f64 {
    learned
        .split(',')
        .zip(configured.split(','))
        .filter_map(|(l, c)| Some(l.parse::<f64>().ok()? / c.parse::<f64>().ok()?.max(1.0)))
        .fold(1.0, f64::min)
}

impl PermitStore {
    /// Records that the call `call` of `cost` units was answered at `answered_us` (Redis time,
    /// an upper bound; `None`: now), for every answer but a registration, which [`Self::complete_call`] records
    /// with its completion. The record rides along with other calls (see [`record_delay`]).
    pub(crate) async fn call_ended(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        answered_us: Option<i64>,
    ) -> Result<(), PermitError> {
        if let Some(blocks) = &self.blocks {
            blocks.recorded(call);
        }
        let ended = CallEnded {
            calls: self.keys.calls(seller),
            call,
            answered_us: answered_us.unwrap_or(-1).max(-1),
            cost: cost.units(),
        };
        let _: i64 = self
            .run(ended.operation(), When::Within(self.record_delay))
            .await?;
        Ok(())
    }

    /// As [`Self::unreserve`], for a message on `route`: its units leave the route's log too.
    pub(crate) async fn unreserve_on(
        &self,
        seller: &SellerId,
        reservation: &Reservation,
        cost: Cost,
        route: Option<&Route>,
    ) -> Result<bool, PermitError> {
        let limiter = self.limiter();
        let unreserve = Unreserve {
            state: self.state_key(&limiter, seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            algorithm: limiter.algorithm,
            token: &reservation.token,
            cost: reservation.cost.unwrap_or(cost).units(),
            slot_us: reservation.slot_us,
            held_counts: reservation.limits.counts_arg(),
            held_windows: reservation.limits.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            capacity: limiter.bucket_capacity,
            route: self.on_route(&limiter, seller, route),
        };
        let given_back: u8 = unreserve
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        if given_back == 1 {
            metrics::counter!("turnstile_reservations_released_total").increment(1);
        }
        Ok(given_back == 1)
    }

    /// The downstream reported that the call `call` (whose message asked `requested` units,
    /// granted `cost` units at `slot_us`, on `route` if any) cost `actual`: its units in the
    /// seller's windows (and the route's) become `actual`, for every replica, and the charge of
    /// its endpoint is learned for the next calls to ask for it (`Self::cost_to_ask`); when
    /// that charge rises, the seller's reservations on the endpoint made for fewer units are
    /// given back, so that their messages ask again at it (see `lua/recost.lua`). Other slots
    /// already reserved keep their place. sliding-window only (the others keep no units per
    /// call): elsewhere nothing changes. A call granted and charged its message's cost changes
    /// nothing and costs no Redis call.
    /// Returns the units added (> 0) or given back (< 0).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn recost(
        &self,
        seller: &SellerId,
        call: &str,
        requested: Cost,
        cost: Cost,
        actual: u32,
        slot_us: i64,
        route: Option<&Route>,
    ) -> Result<i64, PermitError> {
        let limiter = self.limiter();
        if limiter.algorithm != Algorithm::SlidingWindow
            || (actual == cost.units() && cost == requested)
        {
            return Ok(0);
        }
        let recost = Recost {
            log: self.state_key(&limiter, seller),
            calls: self.keys.calls(seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            charge: self.keys.charge(seller, route.map(|route| &route.name)),
            route_log: route.map(|route| self.keys.route_log(seller, &route.name)),
            call,
            cost: cost.units(),
            actual: actual.min(Cost::MAX),
            slot_us: slot_us.max(0),
            requested: requested.min(cost).units(),
            memory_ms: CHARGE_MEMORY.as_millis() as u64,
        };
        let (changed, charge, given_back): Recosted = recost
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        if changed != 0 {
            let direction = if changed > 0 { "charged" } else { "refunded" };
            metrics::counter!("turnstile_cost_corrections_total", "direction" => direction)
                .increment(changed.unsigned_abs());
        }
        if given_back > 0 {
            tracing::debug!(
                charge,
                given_back,
                "a higher charge learned: reservations made for fewer units given back"
            );
            metrics::counter!("turnstile_reservations_released_total")
                .increment(u64::from(given_back));
        }
        Ok(changed)
    }

    /// Moves a message to the state it is in now (see `lua/complete.lua`) and counts it there
    /// once: in its batch's progress and, when it becomes or stops being dead, in the dead
    /// letters by reason ([`Records::dead_now`]).
    pub async fn complete(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        completion: Completion<'_>,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        self.record(seller, message, batch, completion, None, ttl)
            .await
    }

    /// As [`Self::complete`] with [`Completion::Registered`], for the message registered by the
    /// call `answer` names: its answer is recorded in the same step (see [`Decision::Granted`])
    /// and, with adaptive limits, its acceptance by the downstream (see `note_accepted` in
    /// `lua/include/learned.lua`). The record rides along with other calls for up to [`record_delay`]:
    /// it must be written before the message is acked, and a replica that dies before writing
    /// it leaves the message to be called again (docs/performance.md, "Redis calls per message").
    pub(crate) async fn complete_call(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        answer: CallAnswer<'_>,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        self.record(
            seller,
            message,
            batch,
            Completion::Registered,
            Some(answer),
            ttl,
        )
        .await
    }

    pub(super) async fn record(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        completion: Completion<'_>,
        answer: Option<CallAnswer<'_>>,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        let call = answer.map_or("", |a| a.call);
        // A call made with a pool unit (or one that took a block).
        let pooled = self
            .blocks
            .as_ref()
            .filter(|_| !call.is_empty())
            .and_then(|blocks| Some((blocks, blocks.recorded(call)?)));
        let answered = match (pooled, answer) {
            (Some((blocks, bounds)), Some(answer))
                if batch.is_none()
                    && answer.cost.units() == 1
                    && matches!(completion, Completion::Registered) =>
            {
                self.record_pooled(seller, message, answer, ttl, blocks, bounds)
                    .await?
            }
            _ => {
                self.record_by_script(seller, message, batch, completion, answer, ttl)
                    .await?
            }
        };
        // The tally is a shared key (another Cluster slot): a second step, only when a message
        // becomes or stops being dead. Its failure costs the count, not the transition.
        let tallied = match (answered.changed, completion) {
            (true, Completion::Dead(reason)) => self.records().tally_dead(reason, 1).await,
            (true, _) if !answered.was_dead_for.is_empty() => {
                self.records().tally_dead(&answered.was_dead_for, -1).await
            }
            _ => Ok(()),
        };
        if let Err(error) = tallied {
            metrics::counter!("turnstile_redis_errors_total").increment(1);
            tracing::warn!(%error, "the dead letters by reason were not updated");
        }
        Ok(Recorded {
            changed: answered.changed,
            raise_due: answered.raise_due,
            event: BatchEvent::parse(&answered.event),
        })
    }

    /// A message's state moved by `lua/complete.lua`, with the answer of the call that
    /// registered it, if any (sent with others within [`record_delay`] then, else at once).
    pub(super) async fn record_by_script(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: Option<InBatch<'_>>,
        completion: Completion<'_>,
        answer: Option<CallAnswer<'_>>,
        ttl: Duration,
    ) -> Result<CompleteAnswer, PermitError> {
        let limiter = self.limiter();
        let (call, cost, answered_us) =
            answer.map_or(("", 0, None), |a| (a.call, a.cost.units(), a.answered_us));
        let result = answer.and_then(|a| a.result).unwrap_or("");
        let adaptive = (limiter.adaptive && !call.is_empty()).then(|| {
            (
                self.adaptive_keys(seller),
                calls::AdaptiveArgs {
                    counts: limiter.limit.counts_arg(),
                    windows: limiter.limit.windows_arg(),
                    guard_us: Terms::guard_arg_of(limiter.seller_guard()),
                },
            )
        });
        let complete = Complete {
            done: self.keys.done(seller, message),
            calls: self.keys.calls(seller),
            adaptive,
            batch: batch.map(|batch| CompleteBatch {
                progress: self.keys.batch(seller, batch.id),
                seller: seller.as_str(),
                batch: batch.id.as_str(),
                size: batch.size.map_or(0, BatchSize::get),
            }),
            ttl_ms: ttl.as_millis().max(1) as u64,
            outcome: completion.outcome(),
            reason: match completion {
                Completion::Dead(reason) => reason,
                _ => "",
            },
            call,
            answered_us: answered_us.unwrap_or(-1).max(-1),
            cost,
            result,
        };
        let when = if call.is_empty() {
            When::Now
        } else {
            When::Within(self.record_delay)
        };
        self.run(complete.operation(), when).await
    }

    /// Says that a registered message's result was published: its record keeps `registered`
    /// alone, with its TTL (a record gone meanwhile is not recreated). Rides along with the next
    /// call to Redis (within [`record_delay`]), as the records do, and nobody waits for it (a
    /// detached operation: no task, no reply): a plain SET, no round trip of its own while the
    /// replica is busy. A trim that fails only leaves the result kept, and a redelivery of the
    /// message would publish it again.
    pub fn result_published(&self, seller: &SellerId, message: &MessageId) {
        let key = self.keys.done(seller, message);
        let mut set = redis::cmd("SET");
        set.arg(&key).arg("registered").arg("XX").arg("KEEPTTL");
        self.send_detached(Operation::commands(vec![set], key), self.record_delay);
    }

    /// The seller's keys of adaptive limits (see [`calls::AdaptiveKeys`]).
    pub(super) fn adaptive_keys(&self, seller: &SellerId) -> calls::AdaptiveKeys {
        calls::AdaptiveKeys {
            learned: self.keys.learned(seller),
            accepted: self.keys.accepted(seller),
            limit: self.keys.limit(seller),
        }
    }

    /// Learns from what the downstream answered for the seller (see `lua/learn.lua`): a 429, a
    /// learned limit used in full for long enough, or rate-limit headers. When the counts that
    /// apply change, every slot reserved under the old ones is given back and announced, as
    /// for an operator's change, so the seller's whole backlog follows at once. Does nothing
    /// (and answers `None`) with adaptive limits off.
    pub(crate) async fn learn(
        &self,
        seller: &SellerId,
        lesson: Lesson,
    ) -> Result<Option<LearnedChange>, PermitError> {
        self.learn_at(seller, lesson, None).await
    }

    /// As [`Self::learn`], for a lesson of an answer that came back at `answered_us` (Redis
    /// time, an upper bound; see [`CallAnswer`]): a raise is judged and a quota's reset counted
    /// from then. What a 2xx's headers teach rides along with other calls (see
    /// [`record_delay`]); a 429's lesson and a raise are sent at once.
    pub(crate) async fn learn_at(
        &self,
        seller: &SellerId,
        lesson: Lesson,
        answered_us: Option<i64>,
    ) -> Result<Option<LearnedChange>, PermitError> {
        let limiter = self.limiter();
        if !limiter.adaptive {
            return Ok(None);
        }
        if matches!(lesson, Lesson::Throttled { .. }) && self.blocks.is_some() {
            let mut lately = self
                .throttled
                .lock()
                .expect("the throttled sellers' lock is never poisoned");
            if lately.len() >= MOST_THROTTLED {
                lately.clear();
            }
            lately.insert(seller.clone(), std::time::Instant::now());
        }
        let learn = self.learn_call(seller, lesson, answered_us);
        // A 429's lesson decides what the message does next, and a raise comes after its
        // record already rode along: both go at once. A 2xx's headers may ride along.
        let when = match lesson {
            Lesson::Throttled { .. } | Lesson::Recovery => When::Now,
            Lesson::Told(_) => When::Within(self.record_delay),
        };
        let LearnAnswer {
            changed,
            released,
            now_us: now,
            counts,
            why,
            configured,
            wake,
            lowered,
        } = self.run(learn.operation(), when).await?;
        if !changed {
            return Ok(None);
        }
        let why = Why::parse(&why).unwrap_or(Why::Header);
        metrics::counter!("turnstile_adaptive_changes_total", "why" => why.label()).increment(1);
        metrics::histogram!("turnstile_adaptive_learned_ratio")
            .record(learned_ratio(&counts, &configured));
        if wake {
            self.admin().announce(seller, released, now).await?;
        } else {
            metrics::counter!("turnstile_reservations_released_total").increment(released);
        }
        Ok(Some(LearnedChange {
            counts,
            why,
            lowered,
        }))
    }

    /// `lua/learn.lua`'s call for what `lesson` (its answer at `answered_us`) teaches about
    /// the seller's limit (see [`Learn`]).
    pub(super) fn learn_call(
        &self,
        seller: &SellerId,
        lesson: Lesson,
        answered_us: Option<i64>,
    ) -> Learn {
        let limiter = self.limiter();
        let (event, granted_us, told) = match lesson {
            Lesson::Throttled { granted_us, told } => ("throttled", granted_us, told),
            Lesson::Recovery => ("recovery", answered_us.unwrap_or(0), None),
            Lesson::Told(told) => ("header", answered_us.unwrap_or(0), Some(told)),
        };
        let told = told.unwrap_or_default();
        let micros =
            |d: Option<Duration>| d.map_or(-1, |d| d.as_micros().min(i64::MAX as u128) as i64);
        let count = |n: Option<u64>| n.map_or(-1, |n| n.min(i64::MAX as u64) as i64);
        Learn {
            learned: self.keys.learned(seller),
            accepted: self.keys.accepted(seller),
            limit: self.keys.limit(seller),
            state: self.state_key(&limiter, seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            calls: self.keys.calls(seller),
            pool: self.keys.pool(seller),
            terms: Terms::from(&*limiter),
            min: limiter.adaptive_min.get(),
            event,
            granted_us: granted_us.max(0),
            told_limit: count(told.limit.filter(|&n| n >= 1)),
            told_window_us: micros(told.window.filter(|w| !w.is_zero())),
            told_remaining: count(told.remaining),
            told_reset_us: micros(told.reset),
            route_logs: self.route_logs(seller),
        }
    }

    /// Counts a message as dead-lettered for `reason`: its completion record (and its batch's
    /// progress) when it has a seller and an id (once, however many copies), else one more dead
    /// letter by reason.
    pub async fn count_dead(
        &self,
        identity: &crate::domain::Identity,
        batch_size: Option<BatchSize>,
        reason: &str,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        let batch = identity.batch_id.as_ref().map(|id| InBatch {
            id,
            size: batch_size,
        });
        match (&identity.seller_id, &identity.message_id) {
            (Some(seller), Some(message)) => {
                self.complete(seller, message, batch, Completion::Dead(reason), ttl)
                    .await
            }
            _ => self
                .records()
                .tally_dead(reason, 1)
                .await
                .map(|()| Recorded::default()),
        }
    }

    /// Counts `orphan`, a dead-lettered message of `batch` whose body named no seller, in the
    /// batch of the seller whose messages first named that id, as dead for its reason (once,
    /// like any message). While no seller's message has named the batch, it is kept under the
    /// batch's id ([`Records::keep_orphan`](super::Records::keep_orphan)) and tallied in the
    /// dead letters by reason; the first replica to see one of the batch's messages counts it
    /// then ([`Self::adopt_orphans`]). Kept first and looked for the seller again after, so
    /// that one of the two always finds the other. Returns the seller it was counted for and
    /// what counting found (its batch's completion event, if that completed the batch), or
    /// `None` while it is kept.
    pub async fn count_orphan(
        &self,
        batch: &BatchId,
        orphan: &Orphan,
        ttl: Duration,
    ) -> Result<Option<(SellerId, Recorded)>, PermitError> {
        let records = self.records();
        if let Some(seller) = records.first_seller_of(batch).await? {
            let recorded = self
                .adopt_orphan(&seller, batch, orphan, false, ttl)
                .await?;
            return Ok(Some((seller, recorded)));
        }
        records.keep_orphan(batch, orphan, ttl).await?;
        records.tally_dead(&orphan.reason, 1).await?;
        let Some(seller) = records.first_seller_of(batch).await? else {
            return Ok(None);
        };
        let recorded = self.adopt_orphan(&seller, batch, orphan, true, ttl).await?;
        Ok(Some((seller, recorded)))
    }

    /// Counts the `orphans` kept for `batch` (see [`Self::count_orphan`]) in `seller`'s batch,
    /// and forgets them. Returns the batch's completion event, if counting them completed it.
    pub async fn adopt_orphans(
        &self,
        seller: &SellerId,
        batch: &BatchId,
        orphans: &[Orphan],
        ttl: Duration,
    ) -> Result<Option<BatchEvent>, PermitError> {
        let mut event = None;
        for orphan in orphans {
            let recorded = self.adopt_orphan(seller, batch, orphan, true, ttl).await?;
            event = recorded.event.or(event);
        }
        Ok(event)
    }

    /// Counts one orphan in `seller`'s batch. One that was `kept` was tallied in the dead
    /// letters by reason then: the count that moves it to dead (which tallies it) takes that
    /// back, so that it is tallied once.
    async fn adopt_orphan(
        &self,
        seller: &SellerId,
        batch: &BatchId,
        orphan: &Orphan,
        kept: bool,
        ttl: Duration,
    ) -> Result<Recorded, PermitError> {
        let in_batch = InBatch {
            id: batch,
            size: None,
        };
        let dead = Completion::Dead(&orphan.reason);
        let recorded = self
            .complete(seller, &orphan.message, Some(in_batch), dead, ttl)
            .await?;
        let records = self.records();
        if kept {
            if recorded.changed {
                records.tally_dead(&orphan.reason, -1).await?;
            }
            records.drop_orphan(batch, orphan).await?;
        }
        Ok(recorded)
    }
}
