//! Bulk calls: the rows of one seller and one route gathered into one call (see
//! [`crate::routes::Bulk`]).
//!
//! The first row of a bulk route to hold a permit leads: it opens a [`Gather`] for its seller
//! and route, waits up to the route's `linger` (never past the moment its grant must be
//! called by) or until `max_rows` rows have joined, closes it and makes the call for all of
//! them. A row that joins waits for its own entry of the answer without a worker, then
//! finishes as if it had made the call itself (its completion record, its result, its
//! retry). A gather is one seller's: another seller's rows never wait for it.
//!
//! Where a row joins depends on how the route counts a call:
//! - `cost = "row"`: every row takes its own permit for its own units; a granted row joins
//!   the open gather (or leads a new one).
//! - `cost = "call"`: only the leader takes a permit (the route's cost, once). A row with no
//!   reserved slot that finds a gather open rides in it without asking ([`Gathers::ride`]):
//!   its grant ([`crate::permit::Grant::riding`]) holds no units.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use crate::domain::{Registration, RouteName, SellerId};
use crate::downstream::Answered;
use crate::permit::Grant;

/// A gather's seller and route (none: the default endpoint).
pub type GatherKey = (SellerId, Option<RouteName>);

/// What a row that joined a gather gets back: its entry of the answer, and whether the answer
/// could not be mapped to the rows (the row is then retried alone).
pub type RowAnswer = (Answered, bool);

/// How long before its call must start a gather still takes a row: time for the row to reach
/// it and for the call to leave.
const JOIN_MARGIN: Duration = Duration::from_millis(50);

/// The gathers open on a replica, at most one per seller and route.
#[derive(Default)]
pub struct Gathers {
    open: Mutex<HashMap<GatherKey, Arc<Gather>>>,
}

/// Rows of one seller and one route waiting for one call.
pub struct Gather {
    rows: Mutex<Rows>,
    /// Told when the gather fills up.
    full: Notify,
    /// When the call must start (its leader's grant's bound, or its linger's end).
    start_by: Instant,
    max_rows: usize,
    /// On a route whose calls count once: the grant riders ride with (see [`Gathers::ride`]).
    lead: Option<Grant>,
}

#[derive(Default)]
struct Rows {
    /// The rows that joined (the leader's own is not among them), each with where its answer
    /// goes.
    joined: Vec<(Registration, oneshot::Sender<RowAnswer>)>,
    closed: bool,
}

impl Gather {
    /// Whether it still takes a row whose call must start by `due` (a grant's bound).
    fn takes(&self, rows: &Rows, due: Instant) -> bool {
        !rows.closed
            && rows.joined.len() + 1 < self.max_rows
            && Instant::now() + JOIN_MARGIN < self.start_by
            && self.start_by <= due
    }

    /// Waits until it is full or its call must start.
    pub async fn gathered(&self) {
        let full = self.full.notified();
        tokio::pin!(full);
        full.as_mut().enable();
        if self.lock().joined.len() + 1 >= self.max_rows {
            return;
        }
        tokio::select! {
            _ = full => {}
            _ = tokio::time::sleep_until(self.start_by) => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Rows> {
        self.rows.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Gathers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<GatherKey, Arc<Gather>>> {
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Opens the gather of `key` for a leader whose call must start by `start_by`, taking up to
    /// `max_rows` rows with the leader's; `lead`: the grant riders ride with, on a route whose
    /// calls count once. It replaces one no longer taking rows.
    pub fn open(
        &self,
        key: GatherKey,
        max_rows: usize,
        start_by: Instant,
        lead: Option<Grant>,
    ) -> Arc<Gather> {
        let gather = Arc::new(Gather {
            rows: Mutex::default(),
            full: Notify::new(),
            start_by,
            max_rows,
            lead,
        });
        self.lock().insert(key, gather.clone());
        gather
    }

    /// A grant to ride with in the open gather of `key`, for `registration` (of a route whose
    /// calls count once), if one takes rows now. The row must still [`Gathers::join`] it
    /// before its call: the gather may close meanwhile.
    pub fn ride(&self, key: &GatherKey, registration: &Registration) -> Option<Grant> {
        let gather = self.lock().get(key)?.clone();
        let lead = gather.lead.as_ref()?;
        let rows = gather.lock();
        gather
            .takes(&rows, gather.start_by)
            .then(|| Grant::riding(lead, &registration.message_id, registration.cost))
    }

    /// Joins `registration` (whose grant must be called by `due`) to the open gather of `key`,
    /// if it takes it: its answer comes on the receiver.
    pub fn join(
        &self,
        key: &GatherKey,
        registration: &Registration,
        due: Instant,
    ) -> Option<oneshot::Receiver<RowAnswer>> {
        let gather = self.lock().get(key)?.clone();
        let mut rows = gather.lock();
        if !gather.takes(&rows, due) {
            return None;
        }
        let (answer, answered) = oneshot::channel();
        rows.joined.push((registration.clone(), answer));
        if rows.joined.len() + 1 >= gather.max_rows {
            gather.full.notify_one();
        }
        Some(answered)
    }

    /// Closes `gather` (of `key`): no row joins it from now; the rows that joined, in order.
    pub fn close(
        &self,
        key: &GatherKey,
        gather: &Arc<Gather>,
    ) -> Vec<(Registration, oneshot::Sender<RowAnswer>)> {
        {
            let mut open = self.lock();
            if open.get(key).is_some_and(|g| Arc::ptr_eq(g, gather)) {
                open.remove(key);
            }
        }
        let mut rows = gather.lock();
        rows.closed = true;
        std::mem::take(&mut rows.joined)
    }

    /// How many gathers are open (each holds its rows in memory until its call).
    pub fn open_count(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration(seller: &str, id: &str) -> Registration {
        let body = format!(r#"{{"message_id":"{id}","seller_id":"{seller}","product":{{}}}}"#);
        Registration::parse(body.as_bytes(), None).unwrap()
    }

    fn key(seller: &str) -> GatherKey {
        (SellerId::parse(seller).unwrap(), None)
    }

    #[tokio::test(start_paused = true)]
    async fn rows_join_the_open_gather_of_their_seller_until_it_is_full_and_never_another_sellers() {
        let gathers = Gathers::default();
        let start_by = Instant::now() + Duration::from_millis(200);
        let far = Instant::now() + Duration::from_secs(1);
        let gather = gathers.open(key("S-1"), 3, start_by, None);
        assert!(gathers.join(&key("S-2"), &registration("S-2", "x"), far).is_none());
        assert!(gathers.join(&key("S-1"), &registration("S-1", "a"), far).is_some());
        // Its grant must be called before the gather's call would start: not taken.
        let soon = Instant::now() + Duration::from_millis(100);
        assert!(gathers.join(&key("S-1"), &registration("S-1", "b"), soon).is_none());
        assert!(gathers.join(&key("S-1"), &registration("S-1", "b"), far).is_some());
        // Full with the leader's own row: the leader stops waiting at once.
        assert!(gathers.join(&key("S-1"), &registration("S-1", "c"), far).is_none());
        let waited = Instant::now();
        gather.gathered().await;
        assert_eq!(waited.elapsed(), Duration::ZERO);
        let joined = gathers.close(&key("S-1"), &gather);
        let ids: Vec<&str> = joined.iter().map(|(r, _)| r.message_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(gathers.open_count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gather_waits_for_rows_until_its_call_must_start_and_takes_none_after_it_closed() {
        let gathers = Gathers::default();
        let start_by = Instant::now() + Duration::from_millis(200);
        let far = Instant::now() + Duration::from_secs(1);
        let gather = gathers.open(key("S-1"), 50, start_by, None);
        let waited = Instant::now();
        gather.gathered().await;
        assert_eq!(waited.elapsed(), Duration::from_millis(200));
        assert!(gathers.join(&key("S-1"), &registration("S-1", "late"), far).is_none());
        assert!(gathers.close(&key("S-1"), &gather).is_empty());
        let again = gathers.open(key("S-1"), 50, Instant::now() + Duration::from_millis(200), None);
        gathers.close(&key("S-1"), &gather);
        assert_eq!(gathers.open_count(), 1, "closing an old gather leaves the new one open");
        assert!(gathers.join(&key("S-1"), &registration("S-1", "new"), far).is_some());
        assert_eq!(gathers.close(&key("S-1"), &again).len(), 1);
    }
}
