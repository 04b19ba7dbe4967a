//! Upload progress in Redis: the producer records what it published, consumers record what
//! registered or was dead-lettered and the replay what it took back (`lua/complete.lua`);
//! `turnstile status` reads both. Each message is counted once, in the state its completion
//! record says it is in now, so `registered` and `dead` never overlap. Each
//! recorded upload is also indexed by publish time (`uploads`, a shared key), so the dashboard
//! finds the recent ones without scanning the keyspace. The keys are read and written by
//! [`PermitStore`] (`turnstile_core::permit::keys` names them).

use std::time::Duration;

use turnstile_core::domain::{BatchId, SellerId};
use turnstile_core::permit::{PermitError, PermitStore};

/// How far one upload (batch) is.
pub use turnstile_core::permit::UploadProgress as Progress;

/// Units waiting per seller over `uploads` (each upload's waiting messages at its mean cost). A
/// seller's uploads share its limits and their messages interleave in the queue, so each upload
/// is done, at the latest, when its seller's whole backlog is: `limits.optimum_drain(backlog)`
/// (with a backlog, registrations run at the binding limit, so that is also about when it
/// finishes).
pub fn backlog_by_seller(uploads: &[Progress]) -> std::collections::HashMap<&str, u64> {
    let mut backlog = std::collections::HashMap::new();
    for p in uploads {
        *backlog.entry(p.seller.as_str()).or_default() += p.waiting_units();
    }
    backlog
}

/// Records that `total` messages of a batch, of `units` units together, were published
/// (re-publishing the same batch keeps its counts: its messages are not registered twice).
pub async fn record_published(
    store: &PermitStore,
    seller: &SellerId,
    batch: &BatchId,
    total: u64,
    units: u64,
    ttl: Duration,
) -> Result<(), PermitError> {
    store
        .record_published(seller, batch, total, units, ttl)
        .await
}

/// The `n` most recently published uploads that are still recorded, newest first.
pub async fn recent(store: &PermitStore, n: usize) -> Result<Vec<Progress>, PermitError> {
    store.recent_uploads(n).await
}

/// Progress of every upload recorded under the key prefix, or a seller's, or one batch.
pub async fn list(
    store: &PermitStore,
    seller: Option<&SellerId>,
    batch: Option<&BatchId>,
) -> anyhow::Result<Vec<Progress>> {
    let mut out = store.uploads(seller, batch).await?;
    out.sort_by(|a, b| {
        (a.seller.as_str(), a.batch.as_str()).cmp(&(b.seller.as_str(), b.batch.as_str()))
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upload(seller: &str, total: u64, registered: u64) -> Progress {
        Progress {
            seller: seller.into(),
            batch: format!("b{total}"),
            total,
            units: total,
            registered,
            dead: 0,
            published_ms: None,
            last_ms: None,
        }
    }

    #[test]
    fn a_sellers_uploads_share_one_backlog() {
        let uploads = [
            upload("S-1", 40, 30),
            upload("S-1", 40, 4),
            upload("S-2", 5, 5),
        ];
        let backlog = backlog_by_seller(&uploads);
        assert_eq!(backlog["S-1"], 46);
        assert_eq!(backlog["S-2"], 0);
        let limit: turnstile_core::config::Limit = "5/1s".parse().unwrap();
        assert_eq!(limit.optimum_drain(backlog["S-1"]), Duration::from_secs(9));
    }
}
