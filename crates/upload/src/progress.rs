//! Upload progress in Redis: the producer records what it published, consumers record what
//! registered or was dead-lettered and the replay what it took back (`lua/complete.lua`);
//! `turnstile status` reads both. Each message is counted once, in the state its completion
//! record says it is in now, so `registered` and `dead` never overlap. Each
//! recorded upload is also indexed by publish time (`uploads`, a shared key), so the dashboard
//! finds the recent ones without scanning the keyspace.

use std::collections::HashMap;
use std::time::Duration;

use redis::AsyncCommands;

use turnstile_core::domain::{BatchId, SellerId};
use turnstile_core::permit::{PermitError, PermitStore, keys_matching};

/// How far one upload (batch) is.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Progress {
    pub seller: String,
    pub batch: String,
    pub total: u64,
    pub registered: u64,
    pub dead: u64,
    pub published_ms: Option<u64>,
    pub last_ms: Option<u64>,
}

impl Progress {
    /// Messages neither registered nor dead (never dead-lettered, or replayed since): the
    /// upload is done when none is left.
    pub fn waiting(&self) -> u64 {
        self.total.saturating_sub(self.registered + self.dead)
    }
}

/// Messages waiting per seller over `uploads`. A seller's uploads share its limit and their
/// messages interleave in the queue, so each upload is done, at the latest, when its seller's
/// whole backlog is: `limit.optimum_drain(backlog)` (with a backlog, registrations run at the
/// limit, so that is also about when it finishes).
pub fn backlog_by_seller(uploads: &[Progress]) -> std::collections::HashMap<&str, u64> {
    let mut backlog = std::collections::HashMap::new();
    for p in uploads {
        *backlog.entry(p.seller.as_str()).or_default() += p.waiting();
    }
    backlog
}

/// Records that `total` messages of a batch were published (re-publishing the same batch keeps
/// its counts: its messages are not registered twice).
pub async fn record_published(
    store: &PermitStore,
    seller: &SellerId,
    batch: &BatchId,
    total: u64,
    ttl: Duration,
) -> Result<(), PermitError> {
    let key = store.batch_key(seller, batch);
    let now_ms = (store.redis_time_us().await? / 1000) as u64;
    let mut conn = store.connection();
    let _: () = redis::pipe()
        .atomic()
        .hset(&key, "seller", seller.as_str())
        .hset(&key, "batch", batch.as_str())
        .hset(&key, "total", total)
        .hset(&key, "published_ms", now_ms)
        .pexpire(&key, ttl.as_millis() as i64)
        .query_async(&mut conn)
        .await?;
    let index = store.shared_key(UPLOADS);
    let _: () = redis::pipe()
        .zadd(&index, &key, now_ms)
        .zrembyscore(
            &index,
            "-inf",
            now_ms.saturating_sub(ttl.as_millis() as u64) as f64,
        )
        .cmd("ZREMRANGEBYRANK")
        .arg(&index)
        .arg(0)
        .arg(-(INDEXED_UPLOADS as i64) - 1)
        .pexpire(&index, ttl.as_millis() as i64)
        .query_async(&mut conn)
        .await?;
    Ok(())
}

/// The shared key indexing uploads by publish time (sorted set: batch key -> published ms).
const UPLOADS: &str = "uploads";
/// Most uploads kept in the index (the oldest go first).
const INDEXED_UPLOADS: usize = 1000;

/// The `n` most recently published uploads that are still recorded, newest first.
pub async fn recent(store: &PermitStore, n: usize) -> Result<Vec<Progress>, PermitError> {
    let index = store.shared_key(UPLOADS);
    let mut conn = store.connection();
    let keys: Vec<String> = conn.zrevrange(&index, 0, n.max(1) as isize - 1).await?;
    let read = keys.iter().map(|key| {
        let mut conn = store.connection();
        async move {
            let fields: HashMap<String, String> = conn.hgetall(key).await?;
            Ok::<_, PermitError>(fields)
        }
    });
    let mut out = Vec::new();
    for (key, fields) in keys.iter().zip(futures::future::try_join_all(read).await?) {
        match parse(&fields) {
            Some(p) => out.push(p),
            // Expired: drop it from the index.
            None => conn.zrem::<_, _, ()>(&index, key).await?,
        }
    }
    Ok(out)
}

/// An upload's progress from its hash (`None` when it holds no upload).
fn parse(fields: &HashMap<String, String>) -> Option<Progress> {
    let num = |f: &str| fields.get(f).and_then(|v| v.parse::<u64>().ok());
    Some(Progress {
        seller: fields.get("seller")?.clone(),
        batch: fields.get("batch").cloned().unwrap_or_default(),
        total: num("total").unwrap_or(0),
        registered: num("registered").unwrap_or(0),
        dead: num("dead").unwrap_or(0),
        published_ms: num("published_ms"),
        last_ms: num("last_ms"),
    })
}

/// Progress of every upload recorded under the key prefix, or a seller's, or one batch.
pub async fn list(
    store: &PermitStore,
    seller: Option<&SellerId>,
    batch: Option<&BatchId>,
) -> anyhow::Result<Vec<Progress>> {
    let keys = match (seller, batch) {
        (Some(seller), Some(batch)) => vec![store.batch_key(seller, batch)],
        (Some(seller), None) => {
            keys_matching(&store.connection(), &store.seller_key(seller, "batch:*")).await?
        }
        (None, _) => {
            keys_matching(
                &store.connection(),
                &format!("{}:*:batch:*", store.key_prefix()),
            )
            .await?
        }
    };
    let mut out = Vec::new();
    let mut conn = store.connection();
    for key in keys {
        let fields: HashMap<String, String> = conn.hgetall(&key).await?;
        let Some(p) = parse(&fields) else {
            continue;
        };
        if batch.is_none_or(|b| b.as_str() == p.batch) {
            out.push(p);
        }
    }
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
