//! The terms a replica's limiter grants under now ([`Applied`]): its own settings until the
//! fleet is heard from, then the strictest terms of every live replica (see `crate::fleet`),
//! replaced whole while calls run. Every operation reads them once ([`Applied::current`]), so
//! no call mixes two stacks.
//!
//! Two things stop grants without a word from Redis's limiter:
//! - **stale terms**: a replica that has not heard from the fleet's registry for most of an
//!   entry's lifetime may no longer know the strictest terms (a replica with stricter ones may
//!   have started meanwhile): it grants nothing until it hears again ([`PermitError::Fleet`],
//!   which the worker waits out like a Redis outage);
//! - **an algorithm change**: each algorithm keeps its own state, blind to the others' grants,
//!   so grants under a new algorithm wait until every grant under the old one has left its
//!   longest window ([`Applied::fence_until`]).
//!
//! The fleet's terms have a **tag** ([`Applied::terms_tag`], 0 before the fleet is heard from):
//! a message delayed under them carries it (`x-turnstile-terms`), so that a message that waits
//! for a slot or a ticket given under terms no longer in force is woken and asks anew (see
//! `broker::ladder` and the worker): a raise, or a stricter replica's departure, never leaves a
//! backlog waiting out slots planned under terms the fleet left.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::config::LimiterArgs;
use crate::permit::error::PermitError;

/// The terms a replica grants under now, and when they stop being trusted.
#[derive(Debug)]
pub struct Applied {
    current: RwLock<Arc<LimiterArgs>>,
    /// What `trusted_until_ns` counts from.
    base: Instant,
    /// Past this instant (ns after `base`) the terms may be stale: grants stop. `i64::MAX`:
    /// they never go stale (a store that does not follow a fleet, as tools and tests use).
    trusted_until_ns: AtomicI64,
    /// No grant before this Redis time (µs; 0: none): see [`Applied::fence_until`].
    fence_us: AtomicI64,
    /// The fleet's terms in force, in brief, watched by the delay ladder and the workers.
    in_force: tokio::sync::watch::Sender<InForce>,
}

/// What the workers and the delay ladder need of the fleet's terms in force.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InForce {
    /// Their tag (see [`terms_tag`]; 0 before the fleet is heard from).
    pub tag: u64,
    /// The routes some live replica knows (a message on one this replica does not know waits
    /// for a replica that does, see `crate::fleet`).
    pub routes: Arc<std::collections::BTreeSet<crate::domain::RouteName>>,
}

/// The tag a message carries when the terms it was delayed under are unknown (they changed
/// while it asked): it is woken and asks anew at the next change, or as soon as it is seen.
pub const UNKNOWN_TERMS: u64 = u64::MAX;

/// The tag of terms written as `digest` (FNV-1a, 64 bits: equal for equal terms on every
/// replica; never 0 or [`UNKNOWN_TERMS`]).
pub fn terms_tag(digest: &str) -> u64 {
    let hash = digest
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
    hash.clamp(1, UNKNOWN_TERMS - 1)
}

/// Whether a message that waits under terms tagged `carried` (its header; `None` without one)
/// must ask anew under the terms tagged `now` (0: no fleet's terms yet, nothing is stale).
pub fn stale_terms(carried: Option<u64>, now: u64) -> bool {
    now != 0 && carried.is_some_and(|tag| tag != now)
}

impl Applied {
    /// Terms that apply as given, until replaced.
    pub fn new(limiter: LimiterArgs) -> Self {
        Self {
            current: RwLock::new(Arc::new(limiter)),
            base: Instant::now(),
            trusted_until_ns: AtomicI64::new(i64::MAX),
            fence_us: AtomicI64::new(0),
            in_force: tokio::sync::watch::Sender::new(InForce::default()),
        }
    }

    /// The tag of the fleet's terms in force (0 before the fleet is heard from).
    pub fn terms_tag(&self) -> u64 {
        self.in_force.borrow().tag
    }

    /// Follows the fleet's terms in force.
    pub fn watch_terms(&self) -> tokio::sync::watch::Receiver<InForce> {
        self.in_force.subscribe()
    }

    /// Replaces the terms with the fleet's (`in_force` in brief); returns the ones replaced,
    /// as [`Applied::replace`] does.
    pub fn replace_in_force(&self, limiter: LimiterArgs, in_force: InForce) -> Arc<LimiterArgs> {
        let old = self.replace(limiter);
        self.in_force.send_replace(in_force);
        old
    }

    /// The terms that apply now. Hold the answer for one operation only: while it is held,
    /// the replica does not report the terms that replaced it as applied (see
    /// [`Applied::replace`]).
    pub fn current(&self) -> Arc<LimiterArgs> {
        self.current
            .read()
            .expect("the applied terms' lock is never poisoned")
            .clone()
    }

    /// Replaces the terms; returns the ones replaced. Operations already running finish under
    /// the old terms: they are done once the returned `Arc` is the last one
    /// (`Arc::strong_count` is 1).
    pub fn replace(&self, limiter: LimiterArgs) -> Arc<LimiterArgs> {
        let mut current = self
            .current
            .write()
            .expect("the applied terms' lock is never poisoned");
        std::mem::replace(&mut *current, Arc::new(limiter))
    }

    /// The terms are trusted until `until` (the fleet's registry was heard from).
    pub fn trust_until(&self, until: Instant) {
        self.trusted_until_ns
            .store(self.since_base(until), Ordering::Relaxed);
    }

    /// `at` in ns after `base` (0 before it).
    fn since_base(&self, at: Instant) -> i64 {
        at.saturating_duration_since(self.base)
            .as_nanos()
            .min(i64::MAX as u128 - 1) as i64
    }

    /// Grants under the current algorithm wait until Redis time `until_us` (0: no fence).
    pub fn fence_until(&self, until_us: i64) {
        self.fence_us.store(until_us.max(0), Ordering::Relaxed);
    }

    /// The fence's end, Redis µs (0: none).
    pub(crate) fn fence_us(&self) -> i64 {
        self.fence_us.load(Ordering::Relaxed)
    }

    /// Whether a grant may be asked for now (`now_us`: Redis time as the replica estimates
    /// it): an error while the terms are stale, `Some(wait)` while the algorithm's fence
    /// stands, `None` when it may.
    pub fn check(&self, now_us: Option<i64>) -> Result<Option<Duration>, PermitError> {
        if self.since_base(Instant::now()) >= self.trusted_until_ns.load(Ordering::Relaxed) {
            return Err(PermitError::Fleet(
                "this replica has not heard from the fleet's registry lately: a replica with stricter terms may have started, so it grants nothing until it hears again",
            ));
        }
        let fence = self.fence_us();
        if fence == 0 {
            return Ok(None);
        }
        // Without an estimate of Redis's time yet, the whole fence is waited for.
        let now = now_us.unwrap_or(i64::MIN);
        Ok((fence > now).then(|| {
            Duration::from_micros(fence.saturating_sub(now.max(0)).max(1_000) as u64)
                .min(Duration::from_secs(5))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Algorithm, Limit};

    fn terms(count: u32) -> LimiterArgs {
        LimiterArgs::new(
            Limit::new(count, Duration::from_secs(1)).unwrap(),
            Algorithm::SlidingWindow,
        )
    }

    #[test]
    fn replaced_terms_apply_to_the_next_operation_and_the_old_ones_are_released_when_done() {
        let applied = Applied::new(terms(20));
        let running = applied.current();
        let old = applied.replace(terms(10));
        assert_eq!(applied.current().limit.min_count(), 10);
        assert_eq!(
            Arc::strong_count(&old),
            2,
            "the running operation still holds them"
        );
        drop(running);
        assert_eq!(Arc::strong_count(&old), 1);
    }

    #[test]
    fn a_message_waits_on_only_while_the_terms_it_was_delayed_under_are_in_force() {
        let (a, b) = (
            terms_tag("sliding-window 20/1s"),
            terms_tag("sliding-window 1/1d"),
        );
        assert_ne!(a, b);
        assert_eq!(
            a,
            terms_tag("sliding-window 20/1s"),
            "the same on every replica"
        );
        assert!(!stale_terms(Some(a), a));
        assert!(stale_terms(Some(b), a));
        assert!(stale_terms(Some(UNKNOWN_TERMS), a));
        assert!(
            !stale_terms(None, a),
            "a message delayed without a tag waits on"
        );
        assert!(
            !stale_terms(Some(b), 0),
            "no fleet's terms yet: nothing is stale"
        );
        let applied = Applied::new(terms(10));
        let watch = applied.watch_terms();
        assert_eq!(applied.terms_tag(), 0);
        applied.replace_in_force(
            terms(20),
            InForce {
                tag: a,
                ..InForce::default()
            },
        );
        assert_eq!(watch.borrow().tag, a);
    }

    #[test]
    fn terms_not_heard_of_in_time_stop_every_grant() {
        let applied = Applied::new(terms(10));
        assert!(
            applied.check(Some(1)).unwrap().is_none(),
            "never stale untrusted"
        );
        applied.trust_until(Instant::now() + Duration::from_secs(60));
        assert!(applied.check(Some(1)).unwrap().is_none());
        applied.trust_until(Instant::now());
        let refused = applied.check(Some(1)).unwrap_err();
        assert!(refused.is_transient(), "waited out like an outage");
    }

    #[test]
    fn an_algorithm_fence_says_when_to_come_back_and_lifts_at_its_end() {
        let applied = Applied::new(terms(10));
        applied.fence_until(3_000_000);
        assert_eq!(
            applied.check(Some(2_000_000)).unwrap(),
            Some(Duration::from_secs(1))
        );
        assert_eq!(applied.check(Some(3_000_000)).unwrap(), None);
        assert!(applied.check(None).unwrap().is_some(), "no clock yet: wait");
    }
}
