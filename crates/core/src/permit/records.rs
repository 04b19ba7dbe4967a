//! What turnstile keeps in Redis beside the limiter, read and written only through these
//! functions: the uploads' progress (published here, counted by `lua/complete.lua`) and the
//! shared state of the dashboard (sellers seen, throughput). Key names: [`super::keys`].

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use redis::AsyncCommands;

use super::{PermitError, PermitStore};
use crate::domain::{BatchId, SellerId};

/// How far one upload (batch) is, as its progress hash holds it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct UploadProgress {
    pub seller: String,
    pub batch: String,
    pub total: u64,
    /// Units of every limit the upload's messages take together (their costs; `total` when
    /// the upload did not weigh them).
    pub units: u64,
    pub registered: u64,
    pub dead: u64,
    pub published_ms: Option<u64>,
    pub last_ms: Option<u64>,
}

impl UploadProgress {
    /// Messages neither registered nor dead (never dead-lettered, or replayed since): the
    /// upload is done when none is left.
    pub fn waiting(&self) -> u64 {
        self.total.saturating_sub(self.registered + self.dead)
    }

    /// The units of the waiting messages, at the upload's mean cost per message.
    pub fn waiting_units(&self) -> u64 {
        let waiting = self.waiting();
        if self.total == 0 || self.units <= self.total {
            return waiting;
        }
        (u128::from(waiting) * u128::from(self.units)).div_ceil(u128::from(self.total)) as u64
    }

    /// An upload's progress from its hash (`None` when it holds no upload).
    fn parse(fields: &HashMap<String, String>) -> Option<Self> {
        let num = |f: &str| fields.get(f).and_then(|v| v.parse::<u64>().ok());
        Some(Self {
            seller: fields.get("seller")?.clone(),
            batch: fields.get("batch").cloned().unwrap_or_default(),
            total: num("total").unwrap_or(0),
            units: num("units").or(num("total")).unwrap_or(0),
            registered: num("registered").unwrap_or(0),
            dead: num("dead").unwrap_or(0),
            published_ms: num("published_ms"),
            last_ms: num("last_ms"),
        })
    }
}

/// Most uploads kept in the upload index (the oldest go first).
const INDEXED_UPLOADS: usize = 1000;
/// How long a minute of throughput is kept.
const THROUGHPUT_KEPT: Duration = Duration::from_secs(11 * 60);

impl PermitStore {
    /// Records that `total` messages of a batch, of `units` units together, were published,
    /// kept `ttl` (re-publishing the same batch keeps its counts: its messages are not
    /// registered twice), and indexes the upload by publish time (the 1,000 newest younger than
    /// `ttl`).
    pub async fn record_published(
        &self,
        seller: &SellerId,
        batch: &BatchId,
        total: u64,
        units: u64,
        ttl: Duration,
    ) -> Result<(), PermitError> {
        let key = self.keys.batch(seller, batch);
        let now_ms = (self.redis_time_us().await? / 1000) as u64;
        let mut conn = self.conn.clone();
        let _: () = redis::pipe()
            .atomic()
            .hset(&key, "seller", seller.as_str())
            .hset(&key, "batch", batch.as_str())
            .hset(&key, "total", total)
            .hset(&key, "units", units)
            .hset(&key, "published_ms", now_ms)
            .pexpire(&key, ttl.as_millis() as i64)
            .query_async(&mut conn)
            .await?;
        let index = self.keys.uploads();
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

    /// The `n` most recently published uploads that are still recorded, newest first (an
    /// expired one is dropped from the index).
    pub async fn recent_uploads(&self, n: usize) -> Result<Vec<UploadProgress>, PermitError> {
        let index = self.keys.uploads();
        let mut conn = self.conn.clone();
        let keys: Vec<String> = conn.zrevrange(&index, 0, n.max(1) as isize - 1).await?;
        let read = keys.iter().map(|key| {
            let mut conn = self.conn.clone();
            async move {
                let fields: HashMap<String, String> = conn.hgetall(key).await?;
                Ok::<_, PermitError>(fields)
            }
        });
        let mut out = Vec::new();
        for (key, fields) in keys.iter().zip(futures::future::try_join_all(read).await?) {
            match UploadProgress::parse(&fields) {
                Some(p) => out.push(p),
                // Expired: drop it from the index.
                None => conn.zrem::<_, _, ()>(&index, key).await?,
            }
        }
        Ok(out)
    }

    /// The progress of every upload recorded under the key prefix, or a seller's, or one batch
    /// (in no particular order). Scans the keyspace: for operator commands, not the hot path.
    pub async fn uploads(
        &self,
        seller: Option<&SellerId>,
        batch: Option<&BatchId>,
    ) -> Result<Vec<UploadProgress>, PermitError> {
        let keys = match (seller, batch) {
            (Some(seller), Some(batch)) => vec![self.keys.batch(seller, batch)],
            (Some(seller), None) => {
                super::keys_matching(&self.conn, &self.keys.batches_of(seller)).await?
            }
            (None, _) => super::keys_matching(&self.conn, &self.keys.batches()).await?,
        };
        let mut out = Vec::new();
        let mut conn = self.conn.clone();
        for key in keys {
            let fields: HashMap<String, String> = conn.hgetall(&key).await?;
            let Some(p) = UploadProgress::parse(&fields) else {
                continue;
            };
            if batch.is_none_or(|b| b.as_str() == p.batch) {
                out.push(p);
            }
        }
        Ok(out)
    }

    /// The `most_recent` sellers any replica asked permits for last (newest first), and how
    /// many were asked about at or after `since_ms` (unix ms).
    pub async fn sellers_seen(
        &self,
        most_recent: usize,
        since_ms: u64,
    ) -> Result<(Vec<String>, u64), PermitError> {
        let key = self.keys.sellers_seen();
        Ok(redis::pipe()
            .zrevrange(&key, 0, most_recent as isize - 1)
            .zcount(&key, since_ms, "+inf")
            .query_async(&mut self.conn.clone())
            .await?)
    }

    /// Registrations per second by every replica from unix second `first_s` to `last_s`
    /// (both included), oldest first.
    pub async fn throughput(&self, first_s: u64, last_s: u64) -> Result<Vec<u64>, PermitError> {
        let minutes: Vec<u64> = (first_s / 60..=last_s / 60).collect();
        let mut pipe = redis::pipe();
        for m in &minutes {
            pipe.hgetall(self.keys.throughput(*m));
        }
        let counts: Vec<HashMap<u64, u64>> = pipe.query_async(&mut self.conn.clone()).await?;
        let mut per_second = vec![0; (last_s + 1).saturating_sub(first_s) as usize];
        for (second, n) in counts.iter().flatten() {
            if (first_s..=last_s).contains(second) {
                per_second[(second - first_s) as usize] += n;
            }
        }
        Ok(per_second)
    }

    /// Records what a replica did since its last sample, at `now_ms` (unix ms): `registered`
    /// in the throughput of the current second (kept 11 minutes), and `sellers` in the sellers
    /// seen, which keeps those seen within `seen_for`, at most `at_most` of them. One round
    /// trip; nothing when idle.
    pub async fn record_activity(
        &self,
        now_ms: u64,
        registered: u64,
        sellers: &HashSet<String>,
        seen_for: Duration,
        at_most: usize,
    ) -> Result<(), PermitError> {
        if registered == 0 && sellers.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        if registered > 0 {
            let second = now_ms / 1000;
            let key = self.keys.throughput(second / 60);
            pipe.hincr(&key, second, registered)
                .ignore()
                .pexpire(&key, THROUGHPUT_KEPT.as_millis() as i64)
                .ignore();
        }
        if !sellers.is_empty() {
            let key = self.keys.sellers_seen();
            let members: Vec<(u64, &str)> = sellers.iter().map(|s| (now_ms, s.as_str())).collect();
            pipe.zadd_multiple(&key, &members)
                .ignore()
                .zrembyscore(
                    &key,
                    "-inf",
                    now_ms.saturating_sub(seen_for.as_millis() as u64) as f64,
                )
                .ignore()
                .cmd("ZREMRANGEBYRANK")
                .arg(&key)
                .arg(0)
                .arg(-(at_most as i64) - 1)
                .ignore()
                .pexpire(&key, seen_for.as_millis() as i64)
                .ignore();
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }
}
