//! The limiter as the tests ask it: through its one way in ([`Limiter::ask`]), and for a call
//! granted, back through [`Limiter::finish`] with how it ended.

use std::time::Duration;

use turnstile_core::domain::{Cost, RateLimitHeaders};
use turnstile_core::permit::{
    Ask, Decision, Ended, Finished, Forfeit, Grant, Limiter, PermitStore, Reservation,
};

/// What the limiter decides for `ask` (one attempt).
pub async fn decide(store: &PermitStore, ask: Ask<'_>) -> Decision {
    store.ask(ask).await.expect("the limiter answers").decision
}

/// A call granted: the grant to hand back, and when it was granted (Redis µs): `slot_us`, the
/// time it is counted at, and `granted_us`, the grant's.
#[derive(Debug)]
pub struct Call {
    pub grant: Grant,
    pub slot_us: i64,
    pub granted_us: i64,
}

impl Call {
    /// The call `ask` is granted by `decision` of `cost` units, if it is one.
    pub fn of(ask: Ask<'_>, decision: &Decision, cost: Cost) -> Option<Self> {
        let Decision::Granted {
            slot_us,
            granted_us,
            ..
        } = decision
        else {
            return None;
        };
        Some(Self {
            grant: Grant::of(ask, decision, cost)?,
            slot_us: *slot_us,
            granted_us: *granted_us,
        })
    }

    /// The call's name in the seller's calls.
    pub fn name(&self) -> &str {
        self.grant.call()
    }
}

/// The call `ask` is granted now, if it is.
pub async fn call(store: &PermitStore, ask: Ask<'_>) -> Option<Call> {
    let asked = store.ask(ask).await.expect("the limiter answers");
    Call::of(ask, &asked.decision, asked.cost)
}

/// The call `ask` is granted now; panics if it is not.
pub async fn call_now(store: &PermitStore, ask: Ask<'_>) -> Call {
    let asked = store.ask(ask).await.expect("the limiter answers");
    Call::of(ask, &asked.decision, asked.cost)
        .unwrap_or_else(|| panic!("not granted now: {:?}", asked.decision))
}

/// The call `ask` is granted once it comes back when told (with the slot it holds, if it
/// reserved one), as a consumer does.
pub async fn call_in_time(store: &PermitStore, ask: Ask<'_>) -> Call {
    let mut held: Option<Reservation> = None;
    loop {
        let again = ask.held(held.as_ref());
        let asked = store.ask(again).await.expect("the limiter answers");
        assert_eq!(
            asked.forfeit, None,
            "a caller coming back at its slot keeps it"
        );
        match &asked.decision {
            Decision::Granted { .. } => {
                return Call::of(again, &asked.decision, asked.cost).expect("granted");
            }
            Decision::Wait {
                retry_after,
                reservation,
            } => {
                tokio::time::sleep(*retry_after).await;
                held = reservation.clone();
            }
            Decision::Deferred { retry_after, .. } => {
                tokio::time::sleep(*retry_after).await;
                held = None;
            }
            other => panic!("never granted: {other:?}"),
        }
    }
}

/// Comes back with the slot `ask` holds: `Ok` its decision (granted, or still early), `Err`
/// why the slot is gone. It reserves nothing anew: a message that finds its slot gone asks
/// again without reserving in the same step (which, with room, is granted).
pub async fn redeem(store: &PermitStore, ask: Ask<'_>) -> Result<Decision, Forfeit> {
    assert!(ask.held.is_some(), "a slot is redeemed only by its holder");
    let asked = store
        .ask(ask.without_reserving())
        .await
        .expect("the limiter answers");
    match asked.forfeit {
        Some(forfeit) => Err(forfeit),
        None => Ok(asked.decision),
    }
}

/// A 2xx whose rate-limit headers said `told`: the message the call was asked for, if any, is
/// registered (its record kept a minute); a call for no message only ends.
pub fn registered(told: Option<RateLimitHeaders>) -> Ended<'static> {
    Ended::Registered {
        told,
        batch: None,
        ttl: Duration::from_secs(60),
        result: None,
    }
}

/// Hands `call`'s answer back, as it came at `answered_us` (Redis µs).
pub async fn finish(
    store: &PermitStore,
    call: &Call,
    answered_us: i64,
    answer: Ended<'_>,
) -> Finished {
    store
        .finish(&call.grant, answered_us, answer)
        .await
        .expect("the answer is recorded")
}

/// The downstream answered `call` at once with a 2xx (see [`registered`]).
pub async fn answered(store: &PermitStore, call: &Call) -> Finished {
    finish(store, call, call.granted_us, registered(None)).await
}

/// The downstream answered `call` at once with a 429 whose headers said `told`: whether the
/// seller's learned limit went down.
pub async fn throttled(store: &PermitStore, call: &Call, told: Option<RateLimitHeaders>) -> bool {
    finish(store, call, call.granted_us, Ended::Throttled { told })
        .await
        .lowered
}
