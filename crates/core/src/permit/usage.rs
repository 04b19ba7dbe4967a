//! What the usage scripts answer (`lua/usage.lua`, `lua/global_usage.lua`): how much of each
//! limit of a seller's stack, and of the global limit, is taken now, and which limit binds.

use std::time::Duration;

use crate::config::{Limit, Limits};
use crate::permit::outcome::Why;

/// How much of the global limit is taken now, and by whom (see [`Admin::global_usage`](super::Admin::global_usage)).
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalUsage {
    /// The global stack.
    pub limit: Limits,
    /// Each limit of the stack: units granted in its window now (`used`), of `capacity`.
    pub per_limit: Vec<LimitUsage>,
    /// Sellers competing for global units now (refused recently; see `lua/global.lua`), and
    /// their weights together.
    pub present: u64,
    pub weights: f64,
    /// Each seller with units in the shortest window, most first: its units and weight.
    pub shares: Vec<GlobalShare>,
}

/// One seller's part of the global limit's shortest window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GlobalShare {
    /// The seller's key tag (its id percent-encoded; see `SellerId::key_tag`).
    pub seller: String,
    pub units: u64,
    pub weight: u32,
}

/// A seller's shadow limit and its verdicts so far (see `judge_shadow` in `lua/include/shadow.lua`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shadow {
    pub limit: Limits,
    /// Decisions it agreed with.
    pub agree: u64,
    /// Calls granted that it would have held back, and by how long in all (to the ms).
    pub stricter: u64,
    pub delay: Duration,
    /// Callers told to wait that it would have let go at once.
    pub looser: u64,
}

/// How much of one limit of a seller's stack is taken now, in units: `used` of `capacity`
/// counts against the limit now, `ahead` is promised beyond it (reserved units, debt).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitUsage {
    pub limit: Limit,
    pub used: u64,
    pub capacity: u64,
    pub ahead: u64,
    /// How long ago the oldest unit `used` counts was taken: the window frees from then on
    /// (sliding-window and fixed-window; zero for the others).
    pub oldest_age: Duration,
    /// The guard added to the window (TURNSTILE_LIMIT_GUARD): a window's units free up
    /// `window + guard` after they were taken.
    pub guard: Duration,
    /// Reservations whose slot is in the window now (counted in `used`) and that are not
    /// redeemed yet: granted, and still waiting for their call.
    pub due_reserved: u64,
}

impl LimitUsage {
    /// `used / capacity` as thousandths.
    pub fn permille(&self) -> u64 {
        self.used * 1000 / self.capacity.max(1)
    }
}

/// How much of a seller's limits is taken now (see `lua/usage.lua`): `used`, `capacity` and
/// `ahead` are those of the limit that binds now (`per_limit[binding]`, see [`binding_of`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub used: u64,
    pub capacity: u64,
    pub ahead: u64,
    /// The stack that applies (the seller's override or the default).
    pub limit: Limits,
    /// Each limit of the stack, in its order.
    pub per_limit: Vec<LimitUsage>,
    /// Which of `per_limit` binds now.
    pub binding: usize,
    /// Whether `limit` is the seller's own override.
    pub overridden: bool,
    /// How long the seller stays paused (zero when not paused).
    pub paused_for: Duration,
    /// Units of the seller's calls granted and not answered yet (counted in `used`, and still
    /// waiting to be registered).
    pub in_flight: u64,
    /// The stack configured for the seller; `limit` is it with the learned counts (adaptive
    /// limits), lowered for `learned_why` (`None` when nothing is learned below it).
    pub configured: Limits,
    pub learned_why: Option<Why>,
    /// The seller's shadow limit and its verdicts (`delay` not read), if one is set.
    pub shadow: Option<Shadow>,
    /// What the downstream accepted of the seller's calls in its longest window, with adaptive
    /// limits on (which keep the accepted log); `None` with them off.
    pub accepted: Option<Accepted>,
}

/// Units the downstream accepted (2xx) in a seller's longest window up to now, and how long
/// ago the oldest of them was.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accepted {
    pub units: u64,
    pub oldest_age: Duration,
}

/// The limit of a stack that binds now: the most taken (`used / capacity`); among equally taken
/// ones (all idle, say), the one with the lowest long-run rate, which binds a long backlog.
pub fn binding_of(per_limit: &[LimitUsage]) -> usize {
    let rate_below = |a: &Limit, b: &Limit| {
        u128::from(a.count()) * b.window().as_nanos()
            < u128::from(b.count()) * a.window().as_nanos()
    };
    let mut best = 0;
    for (i, u) in per_limit.iter().enumerate().skip(1) {
        let b = &per_limit[best];
        if u.permille() > b.permille()
            || (u.permille() == b.permille() && rate_below(&u.limit, &b.limit))
        {
            best = i;
        }
    }
    best
}
