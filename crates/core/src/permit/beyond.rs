//! Beyond the seller: a grant of the seller's limit is called only with a lease of the
//! seller's calls in flight (`TURNSTILE_SELLER_CONCURRENCY`, `lua/lease.lua`) and the global
//! limit's units (`TURNSTILE_GLOBAL_LIMIT`, `lua/global.lua`); a refusal gives the grant back
//! (`lua/release.lua`).

use std::time::Duration;

use redis::AsyncCommands;

use crate::config::Limits;
use crate::domain::{Cost, SellerId};
use crate::permit::calls::Release;
use crate::permit::calls::{Global, GlobalAnswer, GlobalEnd};
use crate::permit::calls::{Lease, LeaseAnswer};
use crate::permit::decision::{Decision, Deferral, wait_since};
use crate::permit::error::PermitError;
use crate::permit::store::PermitStore;
use crate::permit::terms::Terms;
use crate::routes::Route;

/// How soon the callers refused a lease come back, one after another (see `lua/lease.lua`).
pub(super) const LEASE_POLL: Duration = Duration::from_millis(10);

/// What the global limit decided for a seller's call (see `lua/global.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalDecision {
    /// Call now: the global units are taken, counted at `at_us` (Redis time).
    Granted { at_us: i64 },
    /// Not now: come back after `retry_after`. `ahead`: the seller has taken more than its
    /// fair share while others wait; else the global limit has no room now.
    Wait { retry_after: Duration, ahead: bool },
    /// The cost exceeds the smallest COUNT of the global stack: never granted.
    TooCostly { most: u32 },
}

/// The `outcome` label values of `turnstile_seller_leases_total`.
pub const LEASE_OUTCOMES: [&str; 2] = ["leased", "refused"];

/// The `outcome` label values of `turnstile_global_permits_total`: granted; refused because
/// the seller is over its fair share while others wait (`ahead`) or because the global limit
/// has no room (`full`); a cost it never grants.
pub const GLOBAL_OUTCOMES: [&str; 4] = ["granted", "ahead", "full", "too-costly"];

/// How long a seller stays active for the global limit's fair shares after its last grant (or
/// after the time its last denial told it to come back): a tenth of the global stack's
/// shortest window, within [20 ms, 1 s].
pub(super) fn global_idle(global: &Limits) -> Duration {
    (global.shortest_window() / 10).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

impl PermitStore {
    /// A seller's grant is called only with a lease of its calls in flight
    /// (`TURNSTILE_SELLER_CONCURRENCY`) and the global limit's units (`TURNSTILE_GLOBAL_LIMIT`)
    /// too, asked in that order. If either refuses, what was taken is given back (the lease;
    /// the seller's grant, [`Self::release`]) and the grant becomes [`Decision::Deferred`] or,
    /// for a cost the global limit can never grant, [`Decision::TooCostly`]. Any other
    /// decision, and every decision when neither is set, is returned as it is.
    pub(super) async fn beyond_seller(
        &self,
        seller: &SellerId,
        cost: Cost,
        decision: Decision,
        route: Option<&Route>,
    ) -> Result<Decision, PermitError> {
        let limiter = self.limiter();
        let Decision::Granted { slot_us, call, .. } = &decision else {
            return Ok(decision);
        };
        let leased = limiter.seller_concurrency.0.is_some();
        let refused = match self.take_lease(seller, call).await {
            Ok(None) => self.global_refusal(seller, cost, call).await,
            Ok(Some(retry_after)) => {
                return self
                    .give_back(seller, call, cost, *slot_us, false, route)
                    .await
                    .map(|()| Decision::Deferred {
                        retry_after,
                        by: Deferral::Concurrency,
                    });
            }
            Err(error) => Err(error),
        };
        match refused {
            Ok(None) => Ok(decision),
            Ok(Some(refused)) => {
                self.give_back(seller, call, cost, *slot_us, leased, route)
                    .await?;
                Ok(refused)
            }
            Err(error) => {
                // Not called either way: give back what was taken if Redis lets us.
                let _ = self
                    .give_back(seller, call, cost, *slot_us, leased, route)
                    .await;
                Err(error)
            }
        }
    }

    /// Gives back a grant that will not be called, and its lease if `leased`.
    pub(super) async fn give_back(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        slot_us: i64,
        leased: bool,
        route: Option<&Route>,
    ) -> Result<(), PermitError> {
        let released = self.release(seller, call, cost, slot_us, route).await;
        if leased {
            self.end_lease(seller, call).await?;
        }
        released
    }

    /// What the global limit refuses of a call (`None`: it grants, or there is none).
    pub(super) async fn global_refusal(
        &self,
        seller: &SellerId,
        cost: Cost,
        call: &str,
    ) -> Result<Option<Decision>, PermitError> {
        let limiter = self.limiter();
        let Some(global) = &limiter.global_limit.0 else {
            return Ok(None);
        };
        Ok(match self.admit_globally(seller, cost, call).await? {
            GlobalDecision::Granted { .. } => None,
            GlobalDecision::Wait { retry_after, ahead } => Some(Decision::Deferred {
                retry_after,
                by: if ahead {
                    Deferral::GlobalShare
                } else {
                    Deferral::GlobalFull
                },
            }),
            GlobalDecision::TooCostly { most } => Some(Decision::TooCostly {
                cost,
                most,
                limits: global.clone(),
                bound_by: "the smallest COUNT of TURNSTILE_GLOBAL_LIMIT",
            }),
        })
    }

    /// Takes a lease of the seller's calls in flight for `call` (see `lua/lease.lua`): `None`
    /// when leased (or without `TURNSTILE_SELLER_CONCURRENCY`), else when to ask again.
    pub(super) async fn take_lease(
        &self,
        seller: &SellerId,
        call: &str,
    ) -> Result<Option<Duration>, PermitError> {
        let limiter = self.limiter();
        let Some(limit) = limiter.seller_concurrency.0 else {
            return Ok(None);
        };
        let lease = Lease {
            leases: self.keys.leases(seller),
            ticket: self.keys.lease_ticket(seller),
            limit: limit.get(),
            call,
            bound_us: self.call_bound_us().max(1),
            poll_us: LEASE_POLL.as_micros() as u64,
        };
        let sent = std::time::Instant::now();
        let LeaseAnswer {
            leased,
            at_us,
            now_us,
        } = lease
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        let outcome = LEASE_OUTCOMES[usize::from(!leased)];
        metrics::counter!("turnstile_seller_leases_total", "outcome" => outcome).increment(1);
        Ok((!leased).then(|| wait_since(at_us, now_us, sent)))
    }

    /// Ends the lease of `call` (its answer came back, or it will not be sent); without
    /// `TURNSTILE_SELLER_CONCURRENCY`, nothing.
    pub(crate) async fn end_lease(&self, seller: &SellerId, call: &str) -> Result<(), PermitError> {
        let limiter = self.limiter();
        if limiter.seller_concurrency.0.is_none() {
            return Ok(());
        }
        let _: i64 = self
            .conn
            .clone()
            .zrem(self.keys.leases(seller), call)
            .await?;
        Ok(())
    }

    /// Asks the global limit for `cost` units for the call `call` of `seller` (see
    /// `lua/global.lua`); without a global limit, grants.
    pub(crate) async fn admit_globally(
        &self,
        seller: &SellerId,
        cost: Cost,
        call: &str,
    ) -> Result<GlobalDecision, PermitError> {
        let limiter = self.limiter();
        let Some(global) = &limiter.global_limit.0 else {
            return Ok(GlobalDecision::Granted { at_us: 0 });
        };
        let admit = Global {
            keys: self.keys.global_keys(),
            counts: global.counts_arg(),
            windows: global.windows_arg(),
            guard_us: Terms::guard_arg_of(Some(limiter.global_guard())),
            call,
            cost: cost.units(),
            seller: &seller.key_tag(),
            idle_us: global_idle(global).as_micros() as u64,
            durable: limiter.redis_durable,
            bound_us: self.call_bound_us(),
        };
        let sent = std::time::Instant::now();
        let GlobalAnswer {
            status,
            at_us: at,
            now_us: now,
            why,
        } = admit
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        let decision = match (status, why) {
            (1, _) => GlobalDecision::Granted { at_us: at },
            (0, 1 | 2) => GlobalDecision::Wait {
                retry_after: wait_since(at, now, sent),
                ahead: why == 1,
            },
            (4, _) => GlobalDecision::TooCostly {
                most: u32::try_from(at).map_err(|_| PermitError::Answer("global"))?,
            },
            _ => return Err(PermitError::Answer("global")),
        };
        let outcome = GLOBAL_OUTCOMES[match decision {
            GlobalDecision::Granted { .. } => 0,
            GlobalDecision::Wait { ahead: true, .. } => 1,
            GlobalDecision::Wait { ahead: false, .. } => 2,
            GlobalDecision::TooCostly { .. } => 3,
        }];
        metrics::counter!("turnstile_global_permits_total", "outcome" => outcome).increment(1);
        Ok(decision)
    }

    /// Ends the call `call` of `cost` units that the global limit granted: answered at
    /// `answered_us` (Redis time, an upper bound), its units hold their place in the global log
    /// only until then; never sent (`None`), they leave it (see `lua/global_end.lua`). Without a
    /// global limit, nothing.
    pub(crate) async fn end_globally(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        answered_us: Option<i64>,
    ) -> Result<(), PermitError> {
        if self.limiter().global_limit.0.is_none() {
            return Ok(());
        }
        let end = GlobalEnd {
            log: self.keys.global_log(),
            call,
            cost: cost.units(),
            seller: &seller.key_tag(),
            answered_us: answered_us.unwrap_or(GlobalEnd::UNSENT),
        };
        let _: i64 = end
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Gives back the seller's grant `call` of `cost` units counted at `slot_us`, which will not
    /// be called (see `lua/release.lua`).
    pub(super) async fn release(
        &self,
        seller: &SellerId,
        call: &str,
        cost: Cost,
        slot_us: i64,
        route: Option<&Route>,
    ) -> Result<(), PermitError> {
        let limiter = self.limiter();
        let release = Release {
            state: self.state_key(&limiter, seller),
            limit: self.keys.limit(seller),
            calls: self.keys.calls(seller),
            learned: self.learned_key(&limiter, seller),
            counts: limiter.limit.counts_arg(),
            windows: limiter.limit.windows_arg(),
            guard_us: Terms::guard_arg_of(limiter.seller_guard()),
            algorithm: limiter.algorithm,
            call,
            cost: cost.units(),
            slot_us: slot_us.max(0),
            capacity: limiter.bucket_capacity,
            route: self.on_route(&limiter, seller, route),
        };
        let _: i64 = release
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}
