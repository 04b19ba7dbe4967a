//! Uploads past their ETA: the gauge `turnstile_batches_overdue`, one number for the whole
//! deployment (no label per batch or seller), for the alert `TurnstileBatchesOverdue`; and
//! those that cannot complete as things stand, `turnstile_batches_stalled` (see
//! [`progress::stalled`]).
//!
//! Every [`EVERY`], a replica serving `/metrics` reads the [`UPLOADS_READ`] newest uploads and,
//! for each seller with a batch still waiting, that seller's report as `/api/sellers/{id}`
//! gives it (`turnstile_upload::progress::read_seller`: each batch's ETA from the seller's
//! limits, pause and the work ahead). It remembers the ETA it first gave each waiting batch
//! (its promise: when it was given and when it falls due) and counts the batches still
//! waiting more than the margin after it: [`OVERDUE_AFTER`] or a quarter of the time they were
//! given, whichever is longer. A batch done, or no longer among the newest, is forgotten, so
//! the memory is bounded by [`UPLOADS_READ`]. Promises live in the replica: after a restart a
//! batch is promised anew (the alert takes `max` over the replicas).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::debug;
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{Admin, PermitError, Records};
use turnstile_upload::progress::{self, BatchReport};

/// How often the batches are read.
pub const EVERY: Duration = Duration::from_secs(30);

/// How many of the newest uploads are looked at.
pub const UPLOADS_READ: usize = 200;

/// The least a batch is overdue by before it counts.
pub const OVERDUE_AFTER: Duration = Duration::from_secs(10 * 60);

/// When a batch was first given an ETA, and when that ETA falls due (Unix ms, this replica's
/// clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Promise {
    given_ms: u64,
    due_ms: u64,
}

impl Promise {
    /// When the batch counts as overdue: the margin (at least `least`, or a quarter of the
    /// time it was given) after it fell due.
    fn overdue_from_ms(&self, least: Duration) -> u64 {
        let given = self.due_ms.saturating_sub(self.given_ms);
        self.due_ms + (least.as_millis() as u64).max(given / 4)
    }
}

/// The ETA this replica first gave each waiting batch of the newest uploads.
#[derive(Debug, Default)]
pub struct Promises {
    by_batch: HashMap<(String, String), Promise>,
    least: Duration,
}

impl Promises {
    /// No promise yet; a batch counts as overdue at least `least` after its ETA
    /// ([`OVERDUE_AFTER`] in a replica).
    pub fn new(least: Duration) -> Self {
        Self {
            by_batch: HashMap::new(),
            least,
        }
    }

    /// Notes `batches` as read at `now_ms`: a waiting batch seen for the first time is promised
    /// its ETA; a batch done, without an ETA (total unknown) or not read any more is forgotten.
    /// Returns how many batches are overdue.
    pub fn note(&mut self, now_ms: u64, batches: &[BatchReport]) -> usize {
        let mut kept = HashMap::new();
        for batch in batches.iter().filter(|b| !b.done) {
            let Some(eta_s) = batch.eta_s else { continue };
            let key = (batch.seller_id.clone(), batch.batch_id.clone());
            let promise = self.by_batch.get(&key).copied().unwrap_or(Promise {
                given_ms: now_ms,
                due_ms: now_ms + (eta_s.max(0.0) * 1000.0) as u64,
            });
            kept.insert(key, promise);
        }
        self.by_batch = kept;
        self.by_batch
            .values()
            .filter(|p| now_ms > p.overdue_from_ms(self.least))
            .count()
    }

    /// Reads the newest uploads' waiting batches (see the module's documentation) and notes
    /// them as read at `now_ms`; how many are overdue, and how many stalled (see
    /// [`progress::stalled`]).
    pub async fn check(
        &mut self,
        admin: &Admin,
        records: &Records,
        now_ms: u64,
    ) -> Result<(usize, usize), PermitError> {
        let batches = waiting_batches(admin, records, now_ms).await?;
        let stalled = batches.iter().filter(|b| b.stalled.is_some()).count();
        Ok((self.note(now_ms, &batches), stalled))
    }
}

/// The reports of the batches of the [`UPLOADS_READ`] newest uploads whose seller has one of
/// them waiting.
async fn waiting_batches(
    admin: &Admin,
    records: &Records,
    now_ms: u64,
) -> Result<Vec<BatchReport>, PermitError> {
    let recent = progress::recent(records, UPLOADS_READ).await?;
    let newest: BTreeSet<(&str, &str)> = recent
        .iter()
        .map(|p| (p.seller.as_str(), p.batch.as_str()))
        .collect();
    let sellers: BTreeSet<&str> = recent
        .iter()
        .filter(|p| p.waiting().is_some_and(|n| n > 0))
        .map(|p| p.seller.as_str())
        .collect();
    let sellers: Vec<SellerId> = sellers
        .into_iter()
        .filter_map(|s| SellerId::parse(s).ok())
        .collect();
    let reports = futures::future::try_join_all(
        sellers
            .iter()
            .map(|seller| progress::read_seller_at(admin, records, seller, now_ms)),
    )
    .await?;
    Ok(reports
        .into_iter()
        .flat_map(|report| report.batches)
        .filter(|b| newest.contains(&(b.seller_id.as_str(), b.batch_id.as_str())))
        .collect())
}

/// Sets `turnstile_batches_overdue` and `turnstile_batches_stalled` every [`EVERY`] until `stop` (a failed read counts in
/// `turnstile_redis_errors_total` and leaves the gauge as it was).
pub async fn watch(admin: Admin, records: Records, stop: CancellationToken) {
    let mut promises = Promises::new(OVERDUE_AFTER);
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let now_ms = turnstile_core::domain::unix_ms();
        match promises.check(&admin, &records, now_ms).await {
            Ok((overdue, stalled)) => {
                metrics::gauge!("turnstile_batches_overdue").set(overdue as f64);
                metrics::gauge!("turnstile_batches_stalled").set(stalled as f64);
            }
            Err(error) => {
                metrics::counter!("turnstile_redis_errors_total").increment(1);
                debug!(%error, "could not read the uploads' ETAs; trying again later");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(name: &str, eta_s: Option<f64>, done: bool) -> BatchReport {
        BatchReport {
            batch_id: name.into(),
            seller_id: "S-1".into(),
            total: Some(10),
            registered: 0,
            dead: Default::default(),
            waiting: Some(if done { 0 } else { 10 }),
            done,
            eta_s,
            eta_limits_s: eta_s,
            eta_basis: turnstile_upload::progress::Basis::Limits,
            observed_per_s: None,
            now_ms: 0,
            retrying: 0,
            extra: 0,
            other_size: None,
            also_sellers: Vec::new(),
            first_seen_ms: None,
            last_ms: None,
            completed_ms: None,
            stalled: None,
        }
    }

    const MIN: u64 = 60_000;

    #[test]
    fn a_batch_counts_once_it_waits_past_its_first_eta_by_the_margin() {
        let mut promises = Promises::new(OVERDUE_AFTER);
        // Promised at 0 for 1 minute: overdue after 1 + 10 minutes.
        assert_eq!(promises.note(0, &[batch("a", Some(60.0), false)]), 0);
        // A later ETA does not move the promise.
        assert_eq!(
            promises.note(10 * MIN, &[batch("a", Some(3600.0), false)]),
            0
        );
        assert_eq!(promises.note(11 * MIN, &[batch("a", Some(60.0), false)]), 0);
        assert_eq!(
            promises.note(11 * MIN + 1, &[batch("a", Some(60.0), false)]),
            1
        );
        // Done: forgotten, and not counted.
        assert_eq!(promises.note(12 * MIN, &[batch("a", Some(0.0), true)]), 0);
        assert!(promises.by_batch.is_empty());
    }

    #[test]
    fn a_long_batch_has_a_quarter_of_its_time_as_margin() {
        let mut promises = Promises::new(OVERDUE_AFTER);
        // Given 8 hours: overdue 2 hours after them.
        let eight_hours = 8.0 * 3600.0;
        assert_eq!(
            promises.note(0, &[batch("big", Some(eight_hours), false)]),
            0
        );
        assert_eq!(
            promises.note(10 * 60 * MIN, &[batch("big", Some(1.0), false)]),
            0
        );
        assert_eq!(
            promises.note(10 * 60 * MIN + 1, &[batch("big", Some(1.0), false)]),
            1
        );
    }

    #[test]
    fn a_batch_no_longer_read_or_without_an_eta_is_forgotten() {
        let mut promises = Promises::new(Duration::ZERO);
        assert_eq!(
            promises.note(0, &[batch("a", Some(1.0), false), batch("b", None, false)]),
            0
        );
        assert_eq!(promises.by_batch.len(), 1, "no ETA, no promise");
        assert_eq!(promises.note(2000, &[batch("a", Some(1.0), false)]), 1);
        assert_eq!(promises.note(3000, &[batch("b", Some(1.0), false)]), 0);
        assert_eq!(promises.by_batch.len(), 1);
        // Seen again later: promised anew.
        assert_eq!(promises.note(3500, &[batch("a", Some(1.0), false)]), 0);
    }
}
