//! What turnstile keeps in Redis beside the limiter, read and written only through
//! [`Records`]: the batches' progress (described when a replica first sees one,
//! `lua/batch_seen.lua`; counted by `lua/complete.lua`), the messages of batches waiting out a
//! retry's backoff (`lua/retry.lua`, for the ETA), the dead letters by reason, and the shared
//! state of the dashboard (sellers seen, throughput). Key names: [`super::keys`].

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use redis::AsyncCommands;

use crate::domain::{BatchId, BatchSize, Cost, MessageId, SellerId, key_part};
use crate::permit::calls::{BatchEventSent, BatchSeenCall, RetriesCall, RetryCall, Tally};
use crate::permit::completion::{is_registered, pending_result};
use crate::permit::conn::{RedisConn, keys_matching};
use crate::permit::error::PermitError;
use crate::permit::keys::Keyspace;
use crate::permit::outcome::BatchEvent;

/// How far one batch (an upload) is, as its progress hash holds it (see `lua/complete.lua`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct UploadProgress {
    pub seller: String,
    pub batch: String,
    /// How many messages the batch has in all (the first `batch_size` its messages gave), if
    /// any did.
    pub total: Option<u64>,
    pub registered: u64,
    /// Messages dead-lettered and not replayed since, in all and by reason.
    pub dead: u64,
    pub dead_by_reason: std::collections::BTreeMap<String, u64>,
    /// Units (costs) of the registered and dead messages together.
    pub done_units: u64,
    /// When the batch was first seen, its last message counted, and it completed (Unix ms,
    /// Redis time).
    pub first_ms: Option<u64>,
    pub last_ms: Option<u64>,
    pub completed_ms: Option<u64>,
    /// Another `batch_size` than the total that a message of the batch gave, if one did.
    pub other_size: Option<u64>,
    /// How many of its rows one permit carries (a bulk route whose calls count once), 1
    /// otherwise.
    pub rows_per_call: u64,
}

impl UploadProgress {
    /// Messages neither registered nor dead (never dead-lettered, or replayed since), when
    /// the total is known: the batch is done when none is left.
    pub fn waiting(&self) -> Option<u64> {
        Some(self.total?.saturating_sub(self.registered + self.dead))
    }

    /// Whether every message of a batch with a known total is registered or dead.
    pub fn done(&self) -> bool {
        self.waiting() == Some(0)
    }

    /// Messages counted beyond the total (a batch whose messages outnumber its `batch_size`).
    pub fn extra(&self) -> u64 {
        self.total.map_or(0, |total| {
            (self.registered + self.dead).saturating_sub(total)
        })
    }

    /// The units of the waiting messages, at the mean cost of those done so far (one unit
    /// each before any is done), for rows that go `rows_per_call` to a permit as many permits
    /// as they need; 0 when the total is unknown.
    pub fn waiting_units(&self) -> u64 {
        let waiting = self
            .waiting()
            .unwrap_or(0)
            .div_ceil(self.rows_per_call.max(1));
        let done = self.registered + self.dead;
        if done == 0 || self.done_units <= done {
            return waiting;
        }
        (u128::from(waiting) * u128::from(self.done_units)).div_ceil(u128::from(done)) as u64
    }

    /// A batch's progress from its hash (`None` when it holds no batch).
    fn parse(fields: &HashMap<String, String>) -> Option<Self> {
        let num = |f: &str| fields.get(f).and_then(|v| v.parse::<u64>().ok());
        let dead_by_reason = fields
            .iter()
            .filter_map(|(field, n)| {
                Some((field.strip_prefix("dead:")?.to_owned(), n.parse().ok()?))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        Some(Self {
            seller: fields.get("seller")?.clone(),
            batch: fields.get("batch").cloned().unwrap_or_default(),
            total: num("total"),
            registered: num("registered").unwrap_or(0),
            dead: num("dead").unwrap_or(0),
            dead_by_reason,
            done_units: num("done_units").unwrap_or(0),
            first_ms: num("first_ms"),
            last_ms: num("last_ms"),
            completed_ms: num("completed_ms"),
            other_size: num("other_size"),
            rows_per_call: num("rows_per_call").unwrap_or(1).clamp(1, 1000),
        })
    }
}

/// What noting a batch as seen found ([`Records::batch_seen`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchSeen {
    /// Its pending completion event, if any.
    pub event: Option<BatchEvent>,
    /// How many sellers' messages named its id (more than one: a batch that mixes sellers).
    pub sellers: u64,
    /// Its dead-lettered messages whose body named no seller, kept until now (see
    /// [`Records::keep_orphan`]): to be counted in this seller's batch.
    pub orphans: Vec<Orphan>,
}

/// A dead-lettered message whose body named a batch and a message id but no seller that
/// parses, kept under the batch's id until a seller's message names the batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Orphan {
    pub message: MessageId,
    /// Why it was dead-lettered (a dead-letter reason).
    pub reason: String,
}

impl Orphan {
    /// The set member that keeps it: `<reason> <message id>`.
    fn member(&self) -> String {
        format!("{} {}", self.reason, self.message.as_str())
    }

    fn parse(member: &str) -> Option<Self> {
        let (reason, message) = member.split_once(' ')?;
        Some(Self {
            message: MessageId::parse(message).ok()?,
            reason: reason.to_owned(),
        })
    }
}

/// A message of a batch waiting out a retry's backoff, as its seller's retries hold it (see
/// [`Records::retry_due`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryDue {
    /// The id of the message's batch.
    pub batch: String,
    /// The message's id.
    pub message: String,
    /// The message's units (its cost).
    pub units: u64,
    /// How long until the retry is due (Redis time).
    pub due_in: Duration,
}

impl RetryDue {
    /// Most entries a seller's retries keep: the latest due (see `lua/retry.lua`).
    pub const KEPT: usize = 256;

    /// The entry of the seller's retries for a message: `COST:BATCH:MESSAGE`, the ids
    /// percent-encoded as in keys (never a `:`).
    fn member(batch: &BatchId, message: &MessageId, cost: Cost) -> String {
        format!(
            "{}:{}:{}",
            cost.units(),
            key_part(batch.as_str()),
            key_part(message.as_str())
        )
    }

    /// An entry of the seller's retries due in `due_in_ms` (`None` if it does not parse).
    fn parse(member: &str, due_in_ms: u64) -> Option<Self> {
        let mut parts = member.splitn(3, ':');
        let units = parts.next()?.parse().ok()?;
        let decode = |part: &str| {
            percent_encoding::percent_decode_str(part)
                .decode_utf8()
                .ok()
                .map(|s| s.into_owned())
        };
        let batch = decode(parts.next()?)?;
        let message = decode(parts.next()?)?;
        Some(Self {
            batch,
            message,
            units,
            due_in: Duration::from_millis(due_in_ms),
        })
    }
}

/// Most batches kept in the batch index (the oldest go first).
const INDEXED_UPLOADS: usize = 1000;
/// How long a minute of throughput is kept.
const THROUGHPUT_KEPT: Duration = Duration::from_secs(11 * 60);

/// How long an hour of [`History`] is kept after its last write.
const HISTORY_KEPT: Duration = Duration::from_secs(25 * 3600);
/// Most hours of history read at once.
pub const HISTORY_HOURS: u64 = 24;

/// What every replica did in one minute, as the dashboard's history keeps it (24 hours).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct History {
    /// The unix minute.
    pub minute: u64,
    /// Messages registered (2xx).
    pub registered: u64,
    /// Messages dead-lettered.
    pub dead: u64,
    /// Messages delayed because their seller's limit was full.
    pub delayed: u64,
    /// Messages put back for a retry after a failed call.
    pub retried: u64,
}

impl History {
    /// Its rates, each with its name as the hash's fields end (`<minute>:<name>`): the one list
    /// of them.
    fn rates_mut(&mut self) -> [(&'static str, &mut u64); 4] {
        [
            ("registered", &mut self.registered),
            ("dead", &mut self.dead),
            ("delayed", &mut self.delayed),
            ("retried", &mut self.retried),
        ]
    }

    /// Its rates by name (see [`History::rates_mut`]).
    pub fn rates(mut self) -> [(&'static str, u64); 4] {
        self.rates_mut().map(|(name, n)| (name, *n))
    }

    /// What was counted since `earlier` was (each rate less `earlier`'s, never below zero).
    pub fn since(mut self, earlier: History) -> History {
        for ((_, n), (_, before)) in self.rates_mut().into_iter().zip(earlier.rates()) {
            *n = n.saturating_sub(before);
        }
        self
    }

    fn rate_mut(&mut self, name: &str) -> Option<&mut u64> {
        self.rates_mut()
            .into_iter()
            .find(|(rate, _)| *rate == name)
            .map(|(_, n)| n)
    }
}

/// The uploads' progress, the dead letters by reason and the dashboard's shared state, under
/// one key prefix: written by the replicas (a replica takes its own from
/// [`PermitStore::records`](super::PermitStore::records)), read by the operator commands, the
/// dashboard and the HTTP API.
#[derive(Clone)]
pub struct Records {
    conn: RedisConn,
    keys: Keyspace,
}

impl Records {
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        Self {
            conn,
            keys: Keyspace::new(prefix),
        }
    }

    /// Notes a batch as this replica first sees one of its messages (see `lua/batch_seen.lua`):
    /// its progress describes it from now on, kept `ttl` after its last change, and it is
    /// indexed by when it was first seen (the 1,000 newest younger than `ttl`) and by its id
    /// ([`Self::batches_named`]).
    pub async fn batch_seen(
        &self,
        seller: &SellerId,
        batch: &BatchId,
        size: Option<BatchSize>,
        ttl: Duration,
    ) -> Result<BatchSeen, PermitError> {
        self.batch_seen_carried(seller, batch, size, ttl, 1).await
    }

    /// [`Self::batch_seen`], for a batch whose rows go `rows_per_call` to a permit (a bulk
    /// route whose calls count once): its progress says so, and its waiting rows are counted
    /// by it ([`UploadProgress::waiting_units`]).
    pub async fn batch_seen_carried(
        &self,
        seller: &SellerId,
        batch: &BatchId,
        size: Option<BatchSize>,
        ttl: Duration,
        rows_per_call: u32,
    ) -> Result<BatchSeen, PermitError> {
        let key = self.keys.batch(seller, batch);
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let seen = BatchSeenCall {
            progress: key.clone(),
            seller_batches: self.keys.seller_batches(seller),
            ttl_ms,
            seller: seller.as_str(),
            batch: batch.as_str(),
            size: size.map_or(0, BatchSize::get),
            rows_per_call: rows_per_call.clamp(1, 1000),
        };
        let (first_ms, event): (u64, String) = seen
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        let index = self.keys.uploads();
        let named = self.keys.batch_sellers(batch);
        let mut conn = self.conn.clone();
        // Two other slots than the seller's (two steps on Redis Cluster).
        let _: () = redis::pipe()
            .zadd(&index, &key, first_ms)
            .zrembyscore(&index, "-inf", first_ms.saturating_sub(ttl_ms) as f64)
            .cmd("ZREMRANGEBYRANK")
            .arg(&index)
            .arg(0)
            .arg(-(INDEXED_UPLOADS as i64) - 1)
            .pexpire(&index, ttl_ms as i64)
            .query_async(&mut conn)
            .await?;
        let (sellers, orphans): (u64, Vec<String>) = redis::pipe()
            .sadd(&named, seller.as_str())
            .ignore()
            .pexpire(&named, ttl_ms as i64)
            .ignore()
            .scard(&named)
            .smembers(self.keys.batch_orphans(batch))
            .query_async(&mut conn)
            .await?;
        Ok(BatchSeen {
            event: BatchEvent::parse(&event),
            sellers,
            orphans: orphans.iter().filter_map(|m| Orphan::parse(m)).collect(),
        })
    }

    /// The seller whose messages first named `batch` (the one `/api/batches/{id}` reports), if
    /// any did.
    pub async fn first_seller_of(&self, batch: &BatchId) -> Result<Option<SellerId>, PermitError> {
        let named = self.batches_named(batch).await?;
        Ok(named.first().and_then(|p| SellerId::parse(&p.seller).ok()))
    }

    /// Keeps `orphan`, a dead-lettered message of `batch` whose body named no seller, under
    /// the batch's id for `ttl`: the first replica to see a seller's message of the batch
    /// counts it there ([`BatchSeen::orphans`]).
    pub async fn keep_orphan(
        &self,
        batch: &BatchId,
        orphan: &Orphan,
        ttl: Duration,
    ) -> Result<(), PermitError> {
        let key = self.keys.batch_orphans(batch);
        let _: () = redis::pipe()
            .sadd(&key, orphan.member())
            .ignore()
            .pexpire(&key, ttl.as_millis().max(1) as i64)
            .ignore()
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Forgets `orphan` of `batch`, once counted in a seller's batch.
    pub async fn drop_orphan(&self, batch: &BatchId, orphan: &Orphan) -> Result<(), PermitError> {
        let _: i64 = self
            .conn
            .clone()
            .srem(self.keys.batch_orphans(batch), orphan.member())
            .await?;
        Ok(())
    }

    /// Notes that `message` of `batch`, of `cost` units, waits out a retry's backoff, due
    /// `delay` from now (Redis time): bookkeeping for the ETA only, which no grant reads (see
    /// `lua/retry.lua`). The seller's retries keep the [`RetryDue::KEPT`] latest due, a message
    /// once, and expire when the latest is due.
    pub async fn retry_due(
        &self,
        seller: &SellerId,
        message: &MessageId,
        batch: &BatchId,
        cost: Cost,
        delay: Duration,
    ) -> Result<(), PermitError> {
        let member = RetryDue::member(batch, message, cost);
        let call = RetryCall {
            retries: self.keys.retries(seller),
            delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            member: &member,
            keep: RetryDue::KEPT,
        };
        let _: u64 = call
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// The seller's messages waiting out a retry's backoff whose retry is not due yet, soonest
    /// first (see [`Self::retry_due`]).
    pub async fn retries_due(&self, seller: &SellerId) -> Result<Vec<RetryDue>, PermitError> {
        let call = RetriesCall {
            retries: self.keys.retries(seller),
        };
        let found: Vec<(String, u64)> = call
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(found
            .iter()
            .filter_map(|(member, due_in_ms)| RetryDue::parse(member, *due_in_ms))
            .collect())
    }

    /// The progress of every batch named `batch` (one per seller whose messages named it; a
    /// batch that mixes sellers has several), as the batch index by id knows them.
    pub async fn batches_named(&self, batch: &BatchId) -> Result<Vec<UploadProgress>, PermitError> {
        let sellers: Vec<String> = self
            .conn
            .clone()
            .smembers(self.keys.batch_sellers(batch))
            .await?;
        let mut out = Vec::new();
        for seller in sellers {
            let Ok(seller) = SellerId::parse(&seller) else {
                continue;
            };
            if let Some(p) = self.batch_progress(&seller, batch).await? {
                out.push(p);
            }
        }
        out.sort_by_key(|p| p.first_ms);
        Ok(out)
    }

    /// The progress of the seller's batches still recorded, oldest first (by when each was
    /// first seen; at most the 1,000 newest).
    pub async fn seller_batches(
        &self,
        seller: &SellerId,
    ) -> Result<Vec<UploadProgress>, PermitError> {
        let ids: Vec<String> = self
            .conn
            .clone()
            .zrange(self.keys.seller_batches(seller), 0, -1)
            .await?;
        let mut pipe = redis::pipe();
        let ids: Vec<BatchId> = ids
            .iter()
            .filter_map(|id| BatchId::parse(id).ok())
            .collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        for id in &ids {
            pipe.hgetall(self.keys.batch(seller, id));
        }
        let all: Vec<HashMap<String, String>> = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(all.iter().filter_map(UploadProgress::parse).collect())
    }

    /// One batch's progress, if it is still recorded.
    pub async fn batch_progress(
        &self,
        seller: &SellerId,
        batch: &BatchId,
    ) -> Result<Option<UploadProgress>, PermitError> {
        let fields: HashMap<String, String> = self
            .conn
            .clone()
            .hgetall(self.keys.batch(seller, batch))
            .await?;
        Ok(UploadProgress::parse(&fields))
    }

    /// The pending completion event of a batch, if any (for a redelivery acked as registered
    /// before: the replica that recorded it may have died before publishing the event).
    pub async fn pending_event(
        &self,
        seller: &SellerId,
        batch: &BatchId,
    ) -> Result<Option<BatchEvent>, PermitError> {
        let event: Option<String> = self
            .conn
            .clone()
            .hget(self.keys.batch(seller, batch), "event")
            .await?;
        Ok(event.as_deref().and_then(BatchEvent::parse))
    }

    /// Says that a batch's completion `event` was published (confirmed): it is no longer
    /// pending (see `lua/batch_event_sent.lua`).
    pub(crate) async fn batch_event_sent(
        &self,
        seller: &SellerId,
        batch: &BatchId,
        event: BatchEvent,
    ) -> Result<(), PermitError> {
        let sent = BatchEventSent {
            progress: self.keys.batch(seller, batch),
            completed_ms: event.completed_ms,
        };
        let _: i64 = sent
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// The `n` most recently first seen batches that are still recorded, newest first (an
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
                keys_matching(&self.conn, &self.keys.batches_of(seller)).await?
            }
            (None, _) => keys_matching(&self.conn, &self.keys.batches()).await?,
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

    /// Replaces what the replica `replica` says it holds in its delay ladder with `held`
    /// (seller and summary), kept `ttl` unless said again. One round trip, atomic.
    pub async fn record_held(
        &self,
        replica: &str,
        held: &[(String, crate::broker::ladder::HeldSummary)],
        ttl: Duration,
    ) -> Result<(), PermitError> {
        let key = self.keys.held_by(replica);
        let mut pipe = redis::pipe();
        pipe.atomic().del(&key).ignore();
        if !held.is_empty() {
            let fields: Vec<(&str, String)> = held
                .iter()
                .map(|(seller, summary)| {
                    (
                        seller.as_str(),
                        serde_json::to_string(summary).unwrap_or_default(),
                    )
                })
                .collect();
            pipe.hset_multiple(&key, &fields)
                .ignore()
                .pexpire(&key, ttl.as_millis() as i64)
                .ignore();
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// What each of `replicas` says it holds of `seller` (those that hold some), in their
    /// order. One round trip.
    pub async fn held_of(
        &self,
        replicas: &[String],
        seller: &str,
    ) -> Result<Vec<(String, crate::broker::ladder::HeldSummary)>, PermitError> {
        if replicas.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for replica in replicas {
            pipe.hget(self.keys.held_by(replica), seller);
        }
        let said: Vec<Option<String>> = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(replicas
            .iter()
            .zip(said)
            .filter_map(|(replica, json)| {
                Some((replica.clone(), serde_json::from_str(&json?).ok()?))
            })
            .collect())
    }

    /// Every minute from unix minute `first` to `last` (both included, at most
    /// [`HISTORY_HOURS`] hours: the latest of them), oldest first, a minute without anything
    /// recorded all zero. One round trip.
    pub async fn history(&self, first: u64, last: u64) -> Result<Vec<History>, PermitError> {
        let first = first.max((last + 1).saturating_sub(HISTORY_HOURS * 60));
        let hours: Vec<u64> = (first / 60..=last / 60).collect();
        let mut pipe = redis::pipe();
        for h in &hours {
            pipe.hgetall(self.keys.history(*h));
        }
        let counts: Vec<HashMap<String, u64>> = pipe.query_async(&mut self.conn.clone()).await?;
        let mut minutes: Vec<History> = (first..=last)
            .map(|minute| History {
                minute,
                ..History::default()
            })
            .collect();
        for (field, n) in counts.iter().flatten() {
            let Some((minute, rate)) = field.split_once(':') else {
                continue;
            };
            let Ok(minute) = minute.parse::<u64>() else {
                continue;
            };
            if let Some(count) = (first..=last)
                .contains(&minute)
                .then(|| minutes[(minute - first) as usize].rate_mut(rate))
                .flatten()
            {
                *count += n;
            }
        }
        Ok(minutes)
    }

    /// Records what a replica did since its last sample, at `now_ms` (unix ms): `done`'s
    /// registrations in the throughput of the current second (kept 11 minutes), each of its
    /// rates in the current minute's [`History`] (kept 24 hours; its `minute` is ignored), and
    /// `sellers` in the sellers seen, which keeps those seen within `seen_for`, at most
    /// `at_most` of them. One round trip; nothing when idle.
    pub async fn record_activity(
        &self,
        now_ms: u64,
        done: History,
        sellers: &HashSet<String>,
        seen_for: Duration,
        at_most: usize,
    ) -> Result<(), PermitError> {
        let registered = done.registered;
        let rates = done.rates();
        let counted = rates.iter().any(|(_, n)| *n > 0);
        if !counted && sellers.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        if counted {
            let minute = now_ms / 60_000;
            let key = self.keys.history(minute / 60);
            for (name, n) in rates.into_iter().filter(|(_, n)| *n > 0) {
                pipe.hincr(&key, format!("{minute}:{name}"), n).ignore();
            }
            pipe.pexpire(&key, HISTORY_KEPT.as_millis() as i64).ignore();
        }
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

    /// Adds `by` to the dead letters now with `reason` (never below zero).
    /// [`PermitStore::complete`](super::PermitStore::complete) keeps it for messages with an
    /// identity; this is for those without (a body that does not parse), counted per dead
    /// letter.
    pub async fn tally_dead(&self, reason: &str, by: i64) -> Result<(), PermitError> {
        let tally = Tally {
            counts: self.keys.dead_now(),
            field: reason,
            by,
        };
        let _: i64 = tally
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// The result a registered message's record keeps until it is published (see
    /// `pending_result`); `None` once published, or when the message is not registered.
    pub async fn pending_result(
        &self,
        seller: &SellerId,
        message: &MessageId,
    ) -> Result<Option<String>, PermitError> {
        let state: Option<String> = self
            .conn
            .clone()
            .get(self.keys.done(seller, message))
            .await?;
        Ok(state.as_deref().and_then(pending_result).map(str::to_owned))
    }

    /// Whether a message's completion record says registered (its result published or not):
    /// reads only the record's first bytes, never the result it may keep.
    pub async fn is_registered(
        &self,
        seller: &SellerId,
        message: &MessageId,
    ) -> Result<bool, PermitError> {
        let start: String = self
            .conn
            .clone()
            .getrange(
                self.keys.done(seller, message),
                0,
                "registered ".len() as isize - 1,
            )
            .await?;
        Ok(is_registered(&start))
    }

    /// What a message's completion record says of it (see `lua/complete.lua`): `registered`
    /// (its result published or not), `dead:<REASON>`, or `None`: waiting (never finished, or
    /// replayed since), never seen, or its record expired (`TURNSTILE_DONE_TTL`). With how long
    /// the record is kept yet.
    pub async fn message_state(
        &self,
        seller: &SellerId,
        message: &MessageId,
    ) -> Result<Option<(String, Option<Duration>)>, PermitError> {
        let key = self.keys.done(seller, message);
        let (state, ttl_ms): (Option<String>, i64) = redis::pipe()
            .get(&key)
            .pttl(&key)
            .query_async(&mut self.conn.clone())
            .await?;
        let ttl = u64::try_from(ttl_ms).ok().map(Duration::from_millis);
        let state = state.map(|state| match is_registered(&state) {
            true => "registered".to_owned(),
            false => state,
        });
        Ok(state.map(|state| (state, ttl)))
    }

    /// Notes an operator's action (a JSON entry) in the shared list every replica's dashboard
    /// shows: newest first, at most `keep` entries, the list kept `kept_for` after the last.
    pub async fn note_action(
        &self,
        entry: &str,
        keep: usize,
        kept_for: Duration,
    ) -> Result<(), PermitError> {
        let key = self.keys.actions();
        redis::pipe()
            .lpush(&key, entry)
            .ignore()
            .ltrim(&key, 0, keep.max(1) as isize - 1)
            .ignore()
            .pexpire(&key, kept_for.as_millis().max(1) as i64)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// The `n` most recent operators' actions (JSON entries), newest first.
    pub async fn recent_actions(&self, n: usize) -> Result<Vec<String>, PermitError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        Ok(self
            .conn
            .clone()
            .lrange(self.keys.actions(), 0, n as isize - 1)
            .await?)
    }

    /// The messages dead-lettered and not replayed (nor registered by a copy) since, by reason:
    /// each message with an identity counted once, each dead letter without one once.
    pub async fn dead_now(&self) -> Result<std::collections::BTreeMap<String, u64>, PermitError> {
        let counts: std::collections::BTreeMap<String, i64> =
            self.conn.clone().hgetall(self.keys.dead_now()).await?;
        Ok(counts
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(reason, n)| (reason, n as u64))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_entry_keeps_its_batch_and_units_whatever_the_ids_hold() {
        let batch = BatchId::parse("spring: größe {1}").unwrap();
        let message = MessageId::parse("m:1:2").unwrap();
        let cost = Cost::new(3).unwrap();
        let member = RetryDue::member(&batch, &message, cost);
        assert_eq!(member.matches(':').count(), 2, "{member}");
        assert_eq!(
            RetryDue::parse(&member, 1500),
            Some(RetryDue {
                batch: batch.as_str().to_owned(),
                message: message.as_str().to_owned(),
                units: 3,
                due_in: Duration::from_millis(1500),
            })
        );
        assert_eq!(RetryDue::parse("x:b:m", 1), None);
        assert_eq!(RetryDue::parse("1:b", 1), None);
    }

    #[test]
    fn a_batch_whose_rows_go_many_to_a_permit_waits_for_as_many_permits_as_they_need() {
        let fields = |extra: &[(&str, &str)]| {
            let fields: HashMap<String, String> = [
                ("seller", "S"),
                ("batch", "b"),
                ("total", "500"),
                ("registered", "20"),
                ("done_units", "20"),
            ]
            .iter()
            .chain(extra)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
            fields
        };
        let single = UploadProgress::parse(&fields(&[])).unwrap();
        assert_eq!((single.rows_per_call, single.waiting_units()), (1, 480));
        let bulk = UploadProgress::parse(&fields(&[("rows_per_call", "50")])).unwrap();
        assert_eq!(bulk.waiting(), Some(480), "it still waits for its rows");
        assert_eq!(
            bulk.waiting_units(),
            10,
            "480 rows at 50 to a permit: 10 permits"
        );
        let odd = UploadProgress::parse(&fields(&[("rows_per_call", "0")])).unwrap();
        assert_eq!(
            odd.waiting_units(),
            480,
            "a value out of range counts one row per permit"
        );
    }
}
