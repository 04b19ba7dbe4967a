//! Asking: one attempt of a message for a permit, as [`super::Limiter::ask`] makes it. A
//! slot it holds is redeemed (`lua/redeem.lua`), else a grant comes from the seller's permit
//! pool ([`super::pool`]) or its algorithm's script (`lua/<algorithm>.lua`), reserving a slot
//! when it must wait; a grant is then checked beyond the seller ([`super::beyond`]).

use crate::config::{Algorithm, LimiterArgs, Limits};
use crate::domain::{Cost, MessageId, SellerId};
use crate::permit::batch::{Operation, When};
use crate::permit::block;
use crate::permit::calls::{Acquire, AcquireAnswer, AcquireTail};
use crate::permit::calls::{Redeem, RedeemAnswer};
use crate::permit::decision::{
    Asking, Decision, Forfeit, Rank, Reservation, charged_cost, parse_charge, wait_since,
};
use crate::permit::error::PermitError;
use crate::permit::limiter::Ask;
use crate::permit::observed::{count_verdict, observe};
use crate::permit::store::PermitStore;
use crate::permit::terms::Terms;
use crate::routes::Route;

impl PermitStore {
    /// As [`Self::acquire_for`]. With permit blocks on (sliding-window), a call of one unit is
    /// first granted a unit of the seller's pool if it holds one, and a grant takes up to
    /// `block` more units into the pool (see [`block`], `take_block` and `claim_idle` in
    /// `lua/include/blocks.lua`).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn acquire_with(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        reserve: bool,
        block: u32,
        rank: Option<&Rank>,
        route: Option<&Route>,
    ) -> Result<Decision, PermitError> {
        let asked = std::time::Instant::now();
        let limiter = self.limiter();
        let algorithm = limiter.algorithm;
        let token = Rank::token(rank, route.is_some());
        // A call on a route never takes part in permit blocks.
        let pooled = self.pooled(&limiter).filter(|_| route.is_none());
        let block_hold = pooled.map(|blocks| (block.min(block::MOST_UNITS), blocks.hold_us()));
        let mut acquire =
            self.acquire_call(&limiter, seller, message, cost, reserve, block_hold, &token);
        acquire.route = self.on_route(&limiter, seller, route);
        let (values, sent) = self.run_sent(acquire.operation(), When::Now).await?;
        let answer = AcquireAnswer { values, algorithm };
        let mut decision = answer.decision(token, cost, sent)?;
        if let Decision::Granted {
            granted_us: now, ..
        }
        | Decision::Wait {
            reservation:
                Some(Reservation {
                    reserved_at_us: now,
                    ..
                }),
            ..
        } = &decision
        {
            self.clock.observe(*now);
        }
        if let Some(blocks) = pooled
            && cost == Cost::ONE
        {
            self.took_from_pool(
                &limiter,
                blocks,
                seller,
                &answer,
                block,
                asked,
                &mut decision,
            );
        }
        if let Decision::Wait {
            reservation: Some(_),
            ..
        } = &decision
        {
            self.noted_reserving(seller);
        }
        observe(algorithm, &decision, true);
        Ok(decision)
    }

    /// `lua/<algorithm>.lua`'s call for the seller (see [`Acquire`]); `block`: with permit
    /// blocks on (sliding-window), the units a grant may take into the pool and their hold.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn acquire_call<'a>(
        &self,
        limiter: &LimiterArgs,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        reserve: bool,
        block: Option<(u32, u64)>,
        token: &'a str,
    ) -> Acquire<'a> {
        let limit = &limiter.limit;
        Acquire {
            state: self.state_key(limiter, seller),
            limit: self.keys.limit(seller),
            pause: self.keys.pause(seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            server: self.keys.server(seller),
            calls: self.keys.calls(seller),
            far: self.keys.far(seller),
            learned: self.keys.learned(seller),
            shadow: self.keys.shadow(seller),
            shadow_log: self.keys.shadow_log(seller),
            losses: self.keys.losses(seller),
            give_way: self.keys.give_way(seller),
            done: message.map(|message| self.keys.done(seller, message)),
            counts: limit.counts_arg(),
            windows: limit.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            reserve,
            durable: limiter.redis_durable,
            adaptive: limiter.adaptive,
            horizon_us: limiter.horizon.as_micros() as u64,
            token,
            bound_us: self.call_bound_us(),
            cost: cost.units(),
            tail: match limiter.algorithm {
                Algorithm::SlidingWindow => AcquireTail::SlidingWindow {
                    pool: self.keys.pool(seller),
                    block,
                },
                Algorithm::Gcra => AcquireTail::Gcra {
                    burst: limiter.gcra_burst.max(1),
                },
                Algorithm::TokenBucket => AcquireTail::TokenBucket {
                    capacity: limiter.bucket_capacity,
                },
                Algorithm::FixedWindow => AcquireTail::FixedWindow,
            },
            route: None,
        }
    }

    /// As [`Self::redeem`], for a message of `cost` units (answers `AlreadyDone` if it already
    /// registered). A reservation is only good for the cost it was made for.
    pub(super) async fn redeem(
        &self,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        held: Reservation,
        route: Option<&Route>,
    ) -> Result<Result<Decision, Forfeit>, PermitError> {
        let limiter = self.limiter();
        let mut redeem = self.redeem_call(&limiter, seller, message, cost, &held);
        redeem.route = self.on_route(&limiter, seller, route);
        let (
            RedeemAnswer {
                status,
                at_us: at,
                now_us: now,
                verdict,
            },
            sent,
        ) = self.run_sent(redeem.operation(), When::Now).await?;
        self.clock.observe(now);
        count_verdict(&verdict);
        let redeemed = match status {
            1 => Ok(Decision::Granted {
                slot_us: at,
                granted_us: now,
                used_permille: 1000,
                call: held.token.clone(),
                sent,
            }),
            2 => Ok(Decision::Wait {
                retry_after: wait_since(at, now, sent),
                reservation: Some(held),
            }),
            // Moved later by a message ranked ahead of it (see `lua/include/ranks.lua`): the
            // same reservation, at its new slot.
            9 => Ok(Decision::Wait {
                retry_after: wait_since(at, now, sent),
                reservation: Some(Reservation {
                    slot_us: at,
                    ..held
                }),
            }),
            3 => Err(Forfeit::Paused),
            4 => Err(Forfeit::LimitChanged),
            5 => Err(Forfeit::Late),
            6 => Ok(Decision::AlreadyDone),
            8 => Err(Forfeit::NotReserved),
            _ => return Err(PermitError::Answer("redeem")),
        };
        match &redeemed {
            Ok(decision) => observe(limiter.algorithm, decision, false),
            Err(forfeit) => metrics::counter!(
                "turnstile_reservations_forfeited_total",
                "reason" => forfeit.label()
            )
            .increment(1),
        }
        Ok(redeemed)
    }

    /// `lua/redeem.lua`'s call for the seller's reservation `held` (see [`Redeem`]).
    pub(super) fn redeem_call<'a>(
        &self,
        limiter: &LimiterArgs,
        seller: &SellerId,
        message: Option<&MessageId>,
        cost: Cost,
        held: &'a Reservation,
    ) -> Redeem<'a> {
        let limit = &limiter.limit;
        Redeem {
            limit: self.keys.limit(seller),
            pause: self.keys.pause(seller),
            state: self.state_key(limiter, seller),
            reserved: self.keys.reserved(seller, limiter.algorithm),
            server: self.keys.server(seller),
            calls: self.keys.calls(seller),
            learned: self.keys.learned(seller),
            shadow: self.keys.shadow(seller),
            shadow_log: self.keys.shadow_log(seller),
            losses: self.keys.losses(seller),
            done: message.map(|message| self.keys.done(seller, message)),
            counts: limit.counts_arg(),
            windows: limit.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            slot_us: held.slot_us,
            held_counts: held.limits.counts_arg(),
            held_windows: held.limits.windows_arg(),
            durable: limiter.redis_durable,
            adaptive: limiter.adaptive,
            algorithm: limiter.algorithm,
            token: &held.token,
            capacity: limiter.bucket_capacity,
            bound_us: self.call_bound_us(),
            cost: cost.units(),
            route: None,
        }
    }

    /// One attempt of `ask`, for `asked` units (see `Self::cost_to_ask`): a slot it holds is
    /// redeemed at the units it was reserved for ([`Reservation::cost`]) and, if forfeited, one
    /// is reserved anew at `asked.cost` (saying so when that is not the message's cost); a
    /// message without one is granted a unit of its seller's permit pool if there is one (see
    /// [`super::pool`]), else asks its algorithm's script, reserving a slot if it must wait
    /// (unless it asks not to). A grant is then checked beyond the seller (see
    /// [`Self::beyond_seller`]). Returns the decision, the forfeit of the slot held, and the
    /// units the decision is for.
    pub(super) async fn decide(
        &self,
        ask: &Ask<'_>,
        asked: Asking,
    ) -> Result<(Decision, Option<Forfeit>, Cost), PermitError> {
        let (seller, message, rank) = (ask.seller, ask.message, ask.rank.as_ref());
        let route = ask.route.map(|route| &**route);
        let cost = asked.cost;
        let acquire =
            |block| self.acquire_with(seller, message, cost, ask.reserve, block, rank, route);
        let (mut decision, forfeit, units) = match ask.held {
            Some(held) => {
                let reserved = held.cost.unwrap_or(asked.requested);
                match self
                    .redeem(seller, message, reserved, held.clone(), route)
                    .await?
                {
                    Ok(decision) => (decision, None, reserved),
                    Err(forfeit) => (acquire(0).await?.reserved_for(asked), Some(forfeit), cost),
                }
            }
            // A call on a route never takes part in permit pools.
            None if route.is_some() || !ask.reserve => {
                (acquire(0).await?.reserved_for(asked), None, cost)
            }
            None => match self.grant_from_pool(seller, message, cost).await? {
                // Pools are only made without a global limit or seller concurrency.
                Some(decision) => return Ok((decision, None, cost)),
                None => (
                    acquire(self.block_wanted(seller, cost))
                        .await?
                        .reserved_for(asked),
                    None,
                    cost,
                ),
            },
        };
        decision = self.beyond_seller(seller, units, decision, route).await?;
        Ok((decision, forfeit, units))
    }

    /// The units a call of `requested` units on `route` (the default endpoint: `None`) asks for:
    /// with learned charges on ([`Self::with_learned_charges`]), the charge learned from its
    /// endpoint's answers when higher (see [`charged_cost`]: capped at the smallest COUNT of the
    /// configured stacks it takes: TURNSTILE_LIMIT, its route's, the global limit; a seller's
    /// override below it answers too costly, and the limiter asks again at the override's
    /// smallest COUNT); else, and under any algorithm but sliding-window, `requested`
    /// without reading anything. One read of the seller's key, through the batcher; the charge
    /// may rise between this read and the grant (an answer coming back meanwhile): that call
    /// is then granted at the lower cost, as one granted before the answer came.
    pub(crate) async fn cost_to_ask(
        &self,
        seller: &SellerId,
        requested: Cost,
        route: Option<&Route>,
    ) -> Result<Cost, PermitError> {
        let limiter = self.limiter();
        if !self.learns_charges || limiter.algorithm != Algorithm::SlidingWindow {
            return Ok(requested);
        }
        let key = self.keys.charge(seller, route.map(|route| &route.name));
        let mut get = redis::cmd("GET");
        get.arg(&key);
        let (value,): (Option<Vec<u8>>,) = self
            .run(Operation::commands(vec![get], key), When::Now)
            .await?;
        let most = [
            Some(&limiter.limit),
            route.map(|route| &route.limits),
            limiter.global_limit.0.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(Limits::min_count)
        .min()
        .unwrap_or(Cost::MAX);
        Ok(charged_cost(
            requested,
            parse_charge(value.as_deref()),
            most,
        ))
    }
}
