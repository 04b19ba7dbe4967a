//! The batches this replica has noted as seen (see `PermitStore::batch_seen`): a batch is
//! noted once per replica, by the first of its messages the replica gets, not once per message.
//! Bounded: past [`SeenBatches::MAX`] the oldest are forgotten (one is then noted again if more
//! of its messages come, which is harmless: noting is idempotent).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use crate::domain::{BatchId, SellerId};

/// A batch of a seller.
type Key = (SellerId, BatchId);

/// The batches noted (or being noted) by this replica.
#[derive(Default)]
pub struct SeenBatches {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    seen: HashSet<Key>,
    order: VecDeque<Key>,
}

impl SeenBatches {
    /// Most batches remembered.
    pub const MAX: usize = 10_000;

    /// Whether the batch is new here: `true` once (the caller notes it), until it is forgotten
    /// ([`Self::forget`], or as the oldest past [`Self::MAX`]).
    pub fn first_sight(&self, seller: &SellerId, batch: &BatchId) -> bool {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = (seller.clone(), batch.clone());
        if !inner.seen.insert(key.clone()) {
            return false;
        }
        inner.order.push_back(key);
        while inner.order.len() > Self::MAX {
            if let Some(oldest) = inner.order.pop_front() {
                inner.seen.remove(&oldest);
            }
        }
        true
    }

    /// Forgets a batch whose noting failed: its next message notes it again.
    pub fn forget(&self, seller: &SellerId, batch: &BatchId) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = (seller.clone(), batch.clone());
        if inner.seen.remove(&key) {
            inner.order.retain(|k| k != &key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_new_once_until_forgotten_and_the_oldest_go_past_the_bound() {
        let seen = SeenBatches::default();
        let (s, b) = (
            SellerId::parse("S-1").unwrap(),
            BatchId::parse("b-1").unwrap(),
        );
        assert!(seen.first_sight(&s, &b));
        assert!(!seen.first_sight(&s, &b));
        seen.forget(&s, &b);
        assert!(seen.first_sight(&s, &b));
        for i in 0..SeenBatches::MAX {
            seen.first_sight(&s, &BatchId::parse(&format!("other-{i}")).unwrap());
        }
        assert!(seen.first_sight(&s, &b), "the oldest was forgotten");
        assert!(seen.inner.lock().unwrap().seen.len() <= SeenBatches::MAX);
    }
}
