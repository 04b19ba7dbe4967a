//! Sellers this replica was lately told to wait for: a new message of such a seller is almost
//! surely told to wait too (a reserved slot, a far ticket), so it asks for its permit without
//! taking a worker even when every worker is busy. Workers bound the downstream calls; a
//! decision that only schedules a message need not hold one for its Redis round trips, which on
//! a slow link would keep every other seller's messages from their calls. A guess that turns
//! out wrong costs a grant its wait for a worker (bounded, see `Worker::ask`), never a limit.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::domain::SellerId;

/// Most sellers remembered; beyond them a seller is simply not guessed.
pub const MOST_SELLERS: usize = 10_000;

/// Until when each seller is expected to be told to wait.
#[derive(Default)]
pub struct SellerWaits {
    until: Mutex<HashMap<SellerId, Instant>>,
    /// Woken whenever a seller is told to wait: a message queued for a worker looks again
    /// whether it may ask without one.
    told: Notify,
}

impl SellerWaits {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SellerId, Instant>> {
        self.until
            .lock()
            .expect("the waits' lock is never poisoned")
    }

    /// Notes that `seller` was told, at `now`, to come back after `wait`.
    pub fn told_to_wait(&self, seller: &SellerId, wait: Duration, now: Instant) {
        let mut until = self.lock();
        if until.len() >= MOST_SELLERS && !until.contains_key(seller) {
            until.retain(|_, at| *at > now);
            if until.len() >= MOST_SELLERS {
                return;
            }
        }
        until.insert(seller.clone(), now + wait);
        drop(until);
        self.told.notify_waiters();
    }

    /// Completes when a seller is next told to wait (see [`Notify::notified`] for how not to
    /// miss one between a look and the wait).
    pub fn told(&self) -> tokio::sync::futures::Notified<'_> {
        self.told.notified()
    }

    /// Notes that `seller` was granted: its next message may be too.
    pub fn granted(&self, seller: &SellerId) {
        self.lock().remove(seller);
    }

    /// Whether a new message of `seller` is expected to be told to wait at `now`.
    pub fn expects_wait(&self, seller: &SellerId, now: Instant) -> bool {
        self.lock().get(seller).is_some_and(|at| *at > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seller(s: &str) -> SellerId {
        SellerId::parse(s).unwrap()
    }

    #[test]
    fn a_seller_told_to_wait_is_expected_to_wait_until_then_or_until_granted() {
        let waits = SellerWaits::default();
        let now = Instant::now();
        let s = seller("S-1");
        assert!(!waits.expects_wait(&s, now));
        waits.told_to_wait(&s, Duration::from_secs(2), now);
        assert!(waits.expects_wait(&s, now + Duration::from_secs(1)));
        assert!(!waits.expects_wait(&s, now + Duration::from_secs(2)));
        assert!(!waits.expects_wait(&seller("S-2"), now));
        waits.granted(&s);
        assert!(!waits.expects_wait(&s, now));
    }

    #[test]
    fn the_memory_is_bounded_and_makes_room_from_expired_sellers() {
        let waits = SellerWaits::default();
        let now = Instant::now();
        for i in 0..MOST_SELLERS {
            waits.told_to_wait(&seller(&format!("S-{i}")), Duration::from_millis(10), now);
        }
        let late = seller("S-late");
        waits.told_to_wait(&late, Duration::from_secs(1), now);
        assert!(!waits.expects_wait(&late, now), "full: not remembered");
        let later = now + Duration::from_millis(20);
        waits.told_to_wait(&late, Duration::from_secs(1), later);
        assert!(
            waits.expects_wait(&late, later),
            "room made from expired ones"
        );
        assert_eq!(waits.lock().len(), 1);
    }
}
