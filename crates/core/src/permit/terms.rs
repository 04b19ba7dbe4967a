//! The terms a seller's state is read and changed under (the algorithm, the default stack,
//! the guard, ...), as the scripts that read it take them.

use std::time::Duration;

use crate::config::{Algorithm, LimiterArgs, Limits};
use crate::permit::calls::Call;

/// The terms a seller's state is read and changed under, beside its own keys: what an
/// [`Admin`] needs of the limiter's settings (see [`LimiterArgs`], whose fields these are).
#[derive(Clone, Debug, PartialEq)]
pub struct Terms {
    pub algorithm: Algorithm,
    /// The default stack (`TURNSTILE_LIMIT`): a seller without an override is held to it.
    pub limit: Limits,
    /// `TURNSTILE_LIMIT_GUARD`, if set (see [`Terms::guard_for`]).
    pub guard: Option<Duration>,
    pub gcra_burst: u32,
    pub bucket_capacity: u32,
    /// Whether adaptive limits apply (`TURNSTILE_ADAPTIVE`).
    pub adaptive: bool,
    /// The global limit (`TURNSTILE_GLOBAL_LIMIT`), if there is one.
    pub global_limit: Option<Limits>,
}

impl From<&LimiterArgs> for Terms {
    fn from(limiter: &LimiterArgs) -> Self {
        Self {
            algorithm: limiter.algorithm,
            limit: limiter.limit.clone(),
            guard: limiter.guard,
            gcra_burst: limiter.gcra_burst,
            bucket_capacity: limiter.bucket_capacity,
            adaptive: limiter.adaptive,
            global_limit: limiter.global_limit.0.clone(),
        }
    }
}

impl Terms {
    /// The guard in effect for a window of the seller's own stack, as
    /// [`LimiterArgs::guard_for`] gives it.
    pub fn guard_for(&self, window: Duration) -> Duration {
        crate::config::guard_for(self.seller_guard(), window)
    }

    /// The guard of the seller's own windows (see [`crate::config::seller_guard`]).
    pub fn seller_guard(&self) -> Option<Duration> {
        crate::config::seller_guard(self.algorithm, self.guard)
    }

    /// The scripts' GUARD argument for the seller's own windows (-1: each window's default).
    pub(super) fn guard_arg(&self) -> i64 {
        Self::guard_arg_of(self.seller_guard())
    }

    /// The scripts' GUARD argument for a configured guard (-1: each window's default).
    pub(super) fn guard_arg_of(guard: Option<Duration>) -> i64 {
        guard.map_or(-1, |g| g.as_micros() as i64)
    }

    /// The arguments that open `lua/usage.lua`, `lua/reschedule.lua` and `lua/learn.lua`: the
    /// algorithm, the default stack, the guard, gcra's burst and token-bucket's capacity.
    pub(super) fn args(&self, invocation: &mut impl Call) {
        invocation
            .arg(self.algorithm.name())
            .arg(self.limit.counts_arg())
            .arg(self.limit.windows_arg())
            .arg(self.guard_arg())
            .arg(self.gcra_burst.max(1))
            .arg(self.bucket_capacity);
    }
}

#[cfg(test)]
impl Terms {
    /// The terms the scripts' types are tested under: 10 per second, no guard, gcra's burst 3,
    /// a bucket of 4, no global limit (what `Terms::args` writes for them is in those tests).
    pub(in crate::permit) fn example(algorithm: Algorithm, adaptive: bool) -> Self {
        Self {
            algorithm,
            limit: Limits::from_args("10", "1000000").unwrap(),
            guard: None,
            gcra_burst: 3,
            bucket_capacity: 4,
            adaptive,
            global_limit: None,
        }
    }
}
