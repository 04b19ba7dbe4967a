//! The operators' dashboard: a page at `/` of every replica (`dashboard.html`, plain HTML and a
//! little JS) that polls `/api/dashboard` every 2 s for a [`Snapshot`] of the state all replicas
//! share: per-seller window use and pauses, upload progress and ETA, dead letters by reason,
//! queue depths and throughput.
//!
//! Every replica feeds the shared state (all shared keys, one Redis Cluster slot: see
//! [`turnstile_core::permit::keys`]; read and written by [`Records`]), so any replica's page
//! shows the whole deployment:
//! - `throughput:<minute>`: registrations per second (hash: unix second -> count), added by each
//!   replica's sampler once a second, kept 11 minutes;
//! - `history:<hour>`: registrations, dead letters, delays and retries per minute (hash:
//!   `<minute>:<rate>` -> count), added by the same sampler, kept 24 hours (`/api/history`);
//! - `sellers`: sellers asked about in the last 10 minutes (sorted set: seller -> last ms),
//!   at most 10,000, also written by the sampler from [`Stats::take_sellers`];
//! - `dead-now`: messages dead-lettered and not replayed since, by reason (hash, kept by
//!   [`turnstile_core::permit::PermitStore::complete`]): a message counts once however often
//!   it was dead-lettered, and no longer once replayed or registered by a copy;
//! - `uploads`: the batches by when a replica first saw them (written by
//!   [`Records::batch_seen`]).
//!
//! The cost is bounded whatever the number of sellers: a snapshot reads the 200 sellers asked
//! about most recently, those of the 50 most recent uploads and of the 30 most recent
//! operators' actions (one read-only script per seller, and one for its retries waiting), shows the 50 busiest, and is computed at most once a second
//! however many pages poll it. Queue depths come from the broker every 5 s (passive declares on
//! the operator side's own connection, [`BrokerLink`]) and are also exported as gauges.
//!
//! **Nothing stale is shown as current.** The broker's and Redis's health (up or down, since
//! when, the last error) come with every snapshot. While Redis does not answer, the snapshot
//! keeps the last figures read from it, marked stale with the time they were read
//! (`shared_stale`, `shared_read_ms`); queue depths carry the time they were read and are
//! marked stale once older than two reads or while the broker is down; the fleet is as the
//! replica's last heartbeat saw it, marked stale once that is older than an entry's lifetime.
//! The downstream's answers (classes, error ratio, latency quantiles) are this replica's own,
//! over the last 5 minutes (`turnstile_core::downstream::recent`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use turnstile_core::domain::SellerId;
use turnstile_core::domain::unix_ms;
use turnstile_core::downstream::recent::Recently;
use turnstile_core::fleet;
use turnstile_core::permit::{Admin, HISTORY_HOURS, History, Records, RetryDue, Usage};
use turnstile_core::telemetry::Readiness;
use turnstile_core::worker::Stats;
use turnstile_upload::progress;

use crate::audit;
pub use crate::broker_link::QueueDepths;
use crate::broker_link::{BrokerLink, Controls, DEPTHS_STALE_AFTER};
use crate::health::{self, Health};

/// The page served at `/`.
pub const PAGE: &str = include_str!("dashboard.html");

/// Sellers shown (the busiest first) and uploads shown (the newest first).
const SELLERS_SHOWN: usize = 50;
const UPLOADS_SHOWN: usize = 50;
/// Sellers asked about most recently that a snapshot looks at.
const SELLER_CANDIDATES: usize = 200;
/// How long a seller counts as active after a replica last asked for its permit.
const ACTIVE_FOR: Duration = Duration::from_secs(600);
/// Seconds of throughput in a snapshot.
const THROUGHPUT_SECONDS: u64 = 300;
/// How long a computed snapshot is served to every page that asks.
const CACHE_FOR: Duration = Duration::from_secs(1);
/// Longest time reading the shared state from Redis may take (then the last one read is
/// served, marked stale).
const GATHER_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest time a sampler's write (or probe) may take before Redis counts as down.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(2);
/// The fleet as the last heartbeat saw it is stale once that heartbeat is older than this (an
/// entry's lifetime in the registry).
const FLEET_STALE_AFTER: Duration = fleet::EXPIRY;
/// Sellers listed with retries waiting, and messages shown of each.
const RETRY_SELLERS_SHOWN: usize = 50;
const RETRY_MESSAGES_SHOWN: usize = 5;
/// Recent operators' actions in a snapshot.
const ACTIONS_SHOWN: usize = 30;

/// What the page shows about the replica that serves it.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaInfo {
    pub queue: String,
    pub algorithm: &'static str,
    /// The default limit (sellers may have overrides).
    pub limit: String,
    pub workers: u32,
    pub prefetch: u16,
    pub pid: u32,
}

/// Everything the page shows, at one moment.
#[derive(Debug, Serialize)]
pub struct Snapshot {
    /// Unix ms when it was taken.
    pub now_ms: u64,
    pub replica: ReplicaView,
    /// The broker's and Redis's health as this replica's operator side last found them.
    pub health: HealthView,
    /// `None` until the broker was read once.
    pub queues: Option<QueuesView>,
    /// What the downstream answered this replica over the last 5 minutes.
    pub downstream: Recently,
    /// What is read from Redis (every replica's shared state), as last read.
    #[serde(flatten)]
    pub shared: Shared,
    /// Whether `shared` is older than this snapshot: Redis did not answer, and these are the
    /// figures read at `shared_read_ms` (0: never read).
    pub shared_stale: bool,
    /// The fleet as this replica's last heartbeat saw it (`None` before it).
    pub fleet: Option<FleetView>,
    /// Whether the page may act (pause, resume, limits, replays), and why not.
    pub actions: ActionsView,
}

/// The figures read from Redis for a snapshot (see [`Snapshot::shared`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Shared {
    /// When they were read (Unix ms; 0: never).
    pub shared_read_ms: u64,
    /// The busiest sellers (by share of their limit taken, then promised ahead).
    pub sellers: Vec<SellerRow>,
    /// Sellers any replica asked about in the last 10 minutes (the table shows at most 50).
    pub sellers_active: u64,
    /// Paused sellers among those looked at, longest pause first.
    pub paused: Vec<SellerRow>,
    /// The most recent uploads, newest first.
    pub uploads: Vec<UploadRow>,
    /// Messages dead-lettered and not replayed since, by reason (each counted once).
    pub dead_letters: BTreeMap<String, u64>,
    pub throughput: Throughput,
    /// The global limit's budget, its use and each seller's share (`None` without one).
    pub global: Option<GlobalView>,
    /// Messages of batches waiting out a retry's backoff, among the sellers looked at.
    pub retries: RetriesView,
    /// The operators' recent actions from any replica's page, newest first.
    pub recent_actions: Vec<audit::Entry>,
}

/// The broker's and Redis's health (see [`crate::health`]).
#[derive(Debug, Serialize)]
pub struct HealthView {
    pub broker: BrokerHealth,
    pub redis: health::Status,
}

/// The broker's health as the operator side's connection found it, and what the consume path
/// says of its own connection.
#[derive(Debug, Serialize)]
pub struct BrokerHealth {
    #[serde(flatten)]
    pub status: health::Status,
    /// Whether this replica checks the broker at all (only a replica serving HTTP does).
    pub checked: bool,
    /// Broker sessions the replica opened again after losing one.
    pub reconnects: u64,
}

/// Queue depths with how old they are.
#[derive(Debug, Serialize)]
pub struct QueuesView {
    #[serde(flatten)]
    pub depths: QueueDepths,
    /// How long ago they were read, ms.
    pub age_ms: u64,
    /// Whether they are no longer current: the broker is down, or they are older than two
    /// reads.
    pub stale: bool,
}

/// Whether the page may act, and why not.
#[derive(Clone, Debug, Serialize)]
pub struct ActionsView {
    pub enabled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
}

/// Messages of batches waiting out a retry's backoff (see `Records::retries_due`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RetriesView {
    /// Messages waiting for a retry, over the sellers looked at.
    pub messages: u64,
    /// Sellers with retries waiting, the soonest due first (at most 50).
    pub sellers: Vec<RetryRow>,
}

/// One seller's messages waiting for a retry.
#[derive(Clone, Debug, Serialize)]
pub struct RetryRow {
    pub seller: String,
    pub messages: u64,
    pub units: u64,
    /// How long until the first and the last of them is due, ms.
    pub next_due_ms: u64,
    pub last_due_ms: u64,
    /// The soonest due (at most 5): message id, batch, due in ms.
    pub soonest: Vec<RetryMessage>,
}

/// One message waiting for a retry.
#[derive(Clone, Debug, Serialize)]
pub struct RetryMessage {
    pub message: String,
    pub batch: String,
    pub due_in_ms: u64,
}

/// The fleet (see `turnstile_core::fleet`) with the serving replica's id.
#[derive(Debug, Serialize)]
pub struct FleetView {
    #[serde(flatten)]
    pub view: fleet::View,
    /// The serving replica's id.
    pub me: String,
    /// When the heartbeat that read it was answered (Unix ms, Redis's clock; 0: none yet).
    pub read_ms: i64,
    /// Whether that heartbeat is older than an entry's lifetime in the registry (Redis down,
    /// or heartbeats failing): the list may no longer be the fleet.
    pub stale: bool,
}

/// The global limit (`TURNSTILE_GLOBAL_LIMIT`) now: each limit's units taken of its COUNT,
/// the sellers competing for it (refused recently), and the sellers' shares of its shortest window.
#[derive(Clone, Debug, Serialize)]
pub struct GlobalView {
    pub limit: String,
    pub limits: Vec<LimitRow>,
    /// Sellers competing now (refused recently), and their weights together.
    pub present: u64,
    pub weights: f64,
    /// The sellers with units in the shortest window, most first (at most [`SELLERS_SHOWN`]).
    pub shares: Vec<ShareRow>,
}

/// One seller's share of the global limit's shortest window.
#[derive(Clone, Debug, Serialize)]
pub struct ShareRow {
    pub seller: String,
    pub units: u64,
    pub weight: u32,
    /// `units` over every seller's units in the window, in thousandths.
    pub permille: u64,
}

/// The serving replica itself.
#[derive(Debug, Serialize)]
pub struct ReplicaView {
    #[serde(flatten)]
    pub info: ReplicaInfo,
    /// Its id in the fleet's registry, if it is a member.
    pub id: Option<String>,
    pub ready: bool,
    /// Why it does not consume, as far as this replica can tell (absent while ready).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_ready_why: Option<String>,
    pub in_flight: usize,
    pub held: usize,
    pub deliveries: u64,
    pub registered: u64,
    pub ladder: LadderView,
    /// Until when (Unix ms) every seller waits because Redis started less than a window ago
    /// (absent when it does not; see `TURNSTILE_REDIS_DURABLE`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_cold_start_until_ms: Option<u64>,
}

/// What this replica's delay ladder consumers did: messages held now, hops moved on, hops
/// that ended more than a second late (and when the last did), and the longest any message
/// came back after its due time.
#[derive(Debug, Serialize)]
pub struct LadderView {
    pub held: usize,
    pub hops: u64,
    /// Since the replica started, and when the last of them ended (Unix ms, absent: none).
    pub overdue: u64,
    pub last_overdue_ms: Option<u64>,
    /// Since the replica started.
    pub max_late_ms: u64,
    /// Hops and overdue hops of the last 5 minutes (since the start while younger).
    pub recent: LadderRecent,
}

/// The delay ladder's counts over the last 5 minutes.
#[derive(Debug, Serialize)]
pub struct LadderRecent {
    pub hops: u64,
    pub overdue: u64,
}

/// One seller's window.
#[derive(Clone, Debug, Serialize)]
pub struct SellerRow {
    pub seller: String,
    /// The limit that applies, e.g. `100/1m`, or the stack, e.g. `6/1s,20/5s`.
    pub limit: String,
    /// Whether the limit is the seller's own override.
    pub overridden: bool,
    /// The stack configured for the seller; `limit` is it with what adaptive limits learned.
    pub configured: String,
    /// Why the learned limit is below `configured` (`429`, `recovery`, `header`); absent when
    /// it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub learned: Option<&'static str>,
    /// The seller's shadow limit and its verdicts, if one is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowRow>,
    /// The limit of the stack that binds now (the most taken; see `permit::binding_of`):
    /// `used`, `capacity` and `ahead` are its own.
    pub binding: String,
    /// Each limit of the stack, in its order.
    pub limits: Vec<LimitRow>,
    /// `used` of `capacity` counts against the limit now (see `lua/usage.lua`), in units.
    pub used: u64,
    pub capacity: u64,
    /// Promised beyond the window: reserved slots of waiting messages.
    pub ahead: u64,
    /// Remaining pause in ms (0 when not paused).
    pub paused_ms: u64,
}

/// A seller's shadow limit: how many decisions it agreed with, would have held back
/// (`stricter`) or let go at once (`looser`).
#[derive(Clone, Debug, Serialize)]
pub struct ShadowRow {
    pub limit: String,
    pub agree: u64,
    pub stricter: u64,
    pub looser: u64,
}

/// One limit of a seller's stack: `used` of `capacity` units taken now, `ahead` promised.
#[derive(Clone, Debug, Serialize)]
pub struct LimitRow {
    pub limit: String,
    pub used: u64,
    pub capacity: u64,
    pub ahead: u64,
}

impl From<&turnstile_core::permit::LimitUsage> for LimitRow {
    fn from(l: &turnstile_core::permit::LimitUsage) -> Self {
        LimitRow {
            limit: l.limit.to_string(),
            used: l.used,
            capacity: l.capacity,
            ahead: l.ahead,
        }
    }
}

/// One upload's (batch's) progress.
#[derive(Clone, Debug, Serialize)]
pub struct UploadRow {
    pub seller: String,
    pub batch: String,
    /// Null until a message gave its `batch_size`.
    pub total: Option<u64>,
    pub registered: u64,
    pub dead: u64,
    pub dead_by_reason: BTreeMap<String, u64>,
    /// Null while the total is unknown.
    pub waiting: Option<u64>,
    /// Seconds until its last message is expected to be registered, as `/api/batches/{id}`
    /// gives it (see [`progress::eta`]); 0 when done, null while the total is unknown.
    pub eta_s: Option<f64>,
    /// Why it cannot complete as things stand, when it is stalled (see
    /// [`progress::stalled`]).
    pub stalled: Option<String>,
    pub first_seen_ms: Option<u64>,
    pub last_ms: Option<u64>,
}

/// Registrations per second by every replica, oldest first, ending at `end_s` (unix seconds).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Throughput {
    pub end_s: u64,
    pub per_second: Vec<u64>,
    /// Their sum.
    pub total: u64,
}

/// A replica's dashboard: what it needs to take a [`Snapshot`], and what the operator's
/// endpoints act with.
pub struct Dashboard {
    admin: Admin,
    records: Records,
    stats: Arc<Stats>,
    ready: Readiness,
    info: ReplicaInfo,
    /// The serving replica as a member of the fleet, if it is one.
    fleet: Option<Arc<fleet::Member>>,
    /// The operator side's link to the broker, if this replica serves HTTP.
    broker: Option<Arc<BrokerLink>>,
    /// What the operator's actions need beyond the views (see [`Dashboard::with_controls`]).
    controls: Option<Controls>,
    /// Whether the page may act (`TURNSTILE_HTTP_TOKEN` is set).
    actions_enabled: bool,
    redis: Health,
    /// The last figures read from Redis, served (marked stale) while Redis does not answer.
    last_shared: Mutex<Option<Shared>>,
    cache: tokio::sync::Mutex<Option<(Instant, Arc<String>)>>,
    /// The delay ladder's counts as the sampler saw them lately, for the last 5 minutes'.
    ladder_window: Mutex<LadderWindow>,
}

/// How often a replica says what its delay ladder holds, and how long that is kept.
const HELD_EVERY: Duration = Duration::from_secs(5);
const HELD_KEPT: Duration = Duration::from_secs(15);
/// Sellers a replica says it holds messages of (those it holds most of), and messages said of
/// each (the soonest).
const HELD_SELLERS: usize = 1000;
const HELD_SHOWN: usize = 20;

/// When this replica last said what it holds, and whether it held nothing then.
#[derive(Default)]
struct HeldSaid {
    at: Option<Instant>,
    empty: bool,
}

/// How far back the ladder's windowed counts reach.
const LADDER_WINDOW_MS: u64 = 5 * 60 * 1000;
/// How often the ladder's counts are kept for the window.
const LADDER_SAMPLE_EVERY_MS: u64 = 10_000;

/// The delay ladder's cumulative counts (hops, overdue hops) kept every
/// [`LADDER_SAMPLE_EVERY_MS`] for [`LADDER_WINDOW_MS`] and a little more (about 32 samples),
/// so that the counts of the last 5 minutes are the counts now less those of the newest sample
/// at least 5 minutes old (since the start while the replica is younger).
#[derive(Debug, Default)]
struct LadderWindow {
    samples: std::collections::VecDeque<(u64, u64, u64)>,
}

impl LadderWindow {
    /// Keeps `(hops, overdue)` as of `now_ms` if the last kept is older than a sample's
    /// spacing; forgets those no window needs any more.
    fn note(&mut self, now_ms: u64, hops: u64, overdue: u64) {
        if self
            .samples
            .back()
            .is_none_or(|(at, ..)| now_ms >= at + LADDER_SAMPLE_EVERY_MS)
        {
            self.samples.push_back((now_ms, hops, overdue));
        }
        while self.samples.len() > 1 && self.samples[1].0 + LADDER_WINDOW_MS <= now_ms {
            self.samples.pop_front();
        }
    }

    /// The hops and overdue hops of the last 5 minutes, given the counts now.
    fn recent(&self, now_ms: u64, hops: u64, overdue: u64) -> (u64, u64) {
        let base = self
            .samples
            .iter()
            .rev()
            .find(|(at, ..)| at + LADDER_WINDOW_MS <= now_ms)
            .map_or((0, 0), |(_, h, o)| (*h, *o));
        (hops.saturating_sub(base.0), overdue.saturating_sub(base.1))
    }
}

impl Dashboard {
    /// The sellers' terms the dashboard reads (the HTTP API's batches and sellers read them too).
    pub fn admin(&self) -> &Admin {
        &self.admin
    }

    /// The records the dashboard reads and its sampler writes (the HTTP API reads them too).
    pub fn records(&self) -> &Records {
        &self.records
    }

    /// The operator side's link to the broker, if this replica has one.
    pub fn broker(&self) -> Option<&Arc<BrokerLink>> {
        self.broker.as_ref()
    }

    /// What the operator's actions need, if this replica can act.
    pub fn controls(&self) -> Option<&Controls> {
        self.controls.as_ref()
    }

    /// Redis's health as the dashboard last found it.
    pub fn redis_health(&self) -> &Health {
        &self.redis
    }

    /// The serving replica's id in the fleet, or its pid.
    pub fn replica_name(&self) -> String {
        self.fleet
            .as_ref()
            .map_or_else(|| format!("pid {}", self.info.pid), |m| m.id().to_owned())
    }

    pub fn new(
        admin: Admin,
        records: Records,
        stats: Arc<Stats>,
        ready: Readiness,
        info: ReplicaInfo,
    ) -> Self {
        Self {
            admin,
            records,
            stats,
            ready,
            info,
            fleet: None,
            broker: None,
            controls: None,
            actions_enabled: false,
            redis: Health::new("Redis"),
            last_shared: Mutex::default(),
            cache: tokio::sync::Mutex::default(),
            ladder_window: Mutex::default(),
        }
    }

    /// The dashboard of a replica that is a member of a fleet: the page lists the fleet.
    pub fn with_fleet(mut self, member: Arc<fleet::Member>) -> Self {
        self.fleet = Some(member);
        self
    }

    /// The dashboard reads queue depths and dead letters through `link`.
    pub fn with_broker(mut self, link: Arc<BrokerLink>) -> Self {
        self.broker = Some(link);
        self
    }

    /// The operator's actions run with `controls`.
    pub fn with_controls(mut self, controls: Controls) -> Self {
        self.controls = Some(controls);
        self
    }

    /// The page may act (the endpoints check the token: see `crate::actions`).
    pub fn with_actions(mut self, enabled: bool) -> Self {
        self.actions_enabled = enabled;
        self
    }

    /// The fleet as the serving replica's last heartbeat saw it, with its id.
    pub fn fleet(&self) -> Option<FleetView> {
        let member = self.fleet.as_ref()?;
        let view = member.view();
        let read_ms = view.now_ms;
        let age = (unix_ms() as i64).saturating_sub(read_ms);
        Some(FleetView {
            stale: read_ms == 0
                || age > FLEET_STALE_AFTER.as_millis() as i64
                || self.redis.is_down(),
            read_ms,
            view,
            me: member.id().to_owned(),
        })
    }

    /// Forgets the snapshot computed last: the next page sees an action's effect at once.
    pub async fn invalidate(&self) {
        *self.cache.lock().await = None;
    }

    /// The snapshot as JSON, computed at most once a second.
    pub async fn json(&self) -> anyhow::Result<Arc<String>> {
        let mut cache = self.cache.lock().await;
        if let Some((at, json)) = &*cache
            && at.elapsed() < CACHE_FOR
        {
            return Ok(json.clone());
        }
        let snapshot = self.snapshot().await?;
        let json = Arc::new(serde_json::to_string(&snapshot)?);
        *cache = Some((Instant::now(), json.clone()));
        Ok(json)
    }

    /// A snapshot: this replica's own figures, the broker's and Redis's health, and the shared
    /// state read from Redis, or, while Redis does not answer, the last read (marked stale;
    /// empty if it was never read), so that the page always shows what is down and since when.
    pub async fn snapshot(&self) -> anyhow::Result<Snapshot> {
        let now_ms = unix_ms();
        let last = self.last_shared.lock().expect("never poisoned").clone();
        // While the sampler finds Redis down, do not make every page wait for a timeout.
        let read = if self.redis.is_down() && last.is_some() {
            None
        } else {
            Some(
                tokio::time::timeout(GATHER_TIMEOUT, self.shared(now_ms))
                    .await
                    .unwrap_or_else(|_| {
                        Err(anyhow::anyhow!(
                            "Redis did not answer within {GATHER_TIMEOUT:?}"
                        ))
                    }),
            )
        };
        let (shared, shared_stale) = match read {
            Some(Ok(shared)) => {
                self.redis.ok();
                *self.last_shared.lock().expect("never poisoned") = Some(shared.clone());
                (shared, false)
            }
            Some(Err(error)) => {
                metrics::counter!("turnstile_redis_errors_total").increment(1);
                self.redis.failed(&crate::health::one_line(&error));
                (last.unwrap_or_default(), true)
            }
            None => (last.unwrap_or_default(), true),
        };
        Ok(Snapshot {
            now_ms,
            replica: self.replica_view(),
            health: self.health_view(),
            queues: self.queues_view(now_ms),
            downstream: self.stats.downstream.summary(),
            shared,
            shared_stale,
            fleet: self.fleet(),
            actions: ActionsView {
                enabled: self.actions_enabled,
                why_not: (!self.actions_enabled).then(|| ACTIONS_OFF.to_owned()),
            },
        })
    }

    /// Reads the shared state from Redis.
    async fn shared(&self, now_ms: u64) -> anyhow::Result<Shared> {
        let (uploads, (recent_sellers, sellers_active), dead_letters, throughput, recent_actions) =
            tokio::try_join!(
                async {
                    progress::recent(&self.records, UPLOADS_SHOWN)
                        .await
                        .context("reading uploads")
                },
                self.active_sellers(now_ms),
                self.dead_letters(),
                self.throughput(now_ms),
                async {
                    audit::recent(&self.records, ACTIONS_SHOWN)
                        .await
                        .context("reading the recent actions")
                },
            )?;

        // The sellers of the recent uploads, those asked about recently, and those an operator
        // acted on lately (a seller paused from the page is listed as paused even when idle).
        let mut seen = HashSet::new();
        let candidates: Vec<SellerId> = uploads
            .iter()
            .map(|u| u.seller.as_str())
            .chain(recent_sellers.iter().map(String::as_str))
            .chain(recent_actions.iter().filter_map(|a| a.seller.as_deref()))
            .filter(|s| seen.insert(*s))
            .filter_map(|s| SellerId::parse(s).ok())
            .collect();
        let (usages, retries) = tokio::try_join!(
            async {
                futures::future::try_join_all(
                    candidates.iter().map(|seller| self.admin.usage(seller)),
                )
                .await
                .context("reading sellers' windows")
            },
            async {
                futures::future::try_join_all(
                    candidates
                        .iter()
                        .map(|seller| self.records.retries_due(seller)),
                )
                .await
                .context("reading sellers' retries")
            },
        )?;
        let usage: HashMap<&str, &Usage> = candidates
            .iter()
            .map(SellerId::as_str)
            .zip(usages.iter())
            .collect();
        let retries: HashMap<&str, Vec<RetryDue>> = candidates
            .iter()
            .map(SellerId::as_str)
            .zip(retries)
            .collect();

        let uploads = upload_rows(&uploads, &usage, &retries);
        let (rows, paused) = seller_rows(&usage);
        let global = self
            .admin
            .global_usage()
            .await
            .context("reading the global limit")?
            .map(global_view);

        Ok(Shared {
            shared_read_ms: now_ms,
            sellers: rows,
            sellers_active,
            paused,
            uploads,
            dead_letters,
            throughput,
            global,
            retries: retries_view(&retries),
            recent_actions,
        })
    }

    /// The broker's and Redis's health.
    fn health_view(&self) -> HealthView {
        HealthView {
            broker: BrokerHealth {
                status: self
                    .broker
                    .as_ref()
                    .map(|b| b.health().status())
                    .unwrap_or_default(),
                checked: self.broker.is_some(),
                reconnects: self.stats.reconnects.load(Ordering::Relaxed),
            },
            redis: self.redis.status(),
        }
    }

    /// The queue depths last read, with their age.
    fn queues_view(&self, now_ms: u64) -> Option<QueuesView> {
        let broker = self.broker.as_ref()?;
        let depths = broker.depths()?;
        let age_ms = now_ms.saturating_sub(depths.read_ms);
        Some(QueuesView {
            depths,
            age_ms,
            stale: broker.health().is_down() || age_ms > DEPTHS_STALE_AFTER.as_millis() as u64,
        })
    }

    /// This replica's own figures.
    fn replica_view(&self) -> ReplicaView {
        let stats = &self.stats;
        // The terms it grants under now (the fleet's), not the ones it was started with.
        let terms = self.admin.terms();
        let ready = self.ready.get();
        // The reason the replica gave, else what this side can tell.
        let not_ready_why = (!ready).then(|| match self.ready.why() {
            Some(said) => said.why,
            None if self.broker.as_ref().is_some_and(|b| b.health().is_down()) => {
                "the broker does not answer: reconnecting".to_owned()
            }
            None if self.redis.is_down() => "Redis does not answer".to_owned(),
            None => "starting, waiting for the fleet to apply its terms, reconnecting, or draining"
                .to_owned(),
        });
        ReplicaView {
            info: ReplicaInfo {
                algorithm: terms.algorithm.name(),
                limit: terms.limit.to_string(),
                ..self.info.clone()
            },
            id: self.fleet.as_ref().map(|m| m.id().to_owned()),
            ready,
            not_ready_why,
            in_flight: stats.in_flight.load(Ordering::Relaxed),
            held: stats.held.load(Ordering::Relaxed),
            deliveries: stats.deliveries.load(Ordering::Relaxed),
            registered: stats.registered.load(Ordering::Relaxed),
            ladder: LadderView {
                held: stats.ladder.held.load(Ordering::Relaxed),
                hops: stats.ladder.hops.load(Ordering::Relaxed),
                overdue: stats.ladder.overdue.load(Ordering::Relaxed),
                recent: {
                    let (hops, overdue) =
                        self.ladder_window.lock().expect("never poisoned").recent(
                            unix_ms(),
                            stats.ladder.hops.load(Ordering::Relaxed),
                            stats.ladder.overdue.load(Ordering::Relaxed),
                        );
                    LadderRecent { hops, overdue }
                },
                last_overdue_ms: Some(stats.ladder.last_overdue_ms.load(Ordering::Relaxed))
                    .filter(|ms| *ms > 0),
                max_late_ms: stats.ladder.max_late_ms.load(Ordering::Relaxed),
            },
            redis_cold_start_until_ms: Some(
                stats.redis_cold_start_until_ms.load(Ordering::Relaxed),
            )
            .filter(|until| *until > turnstile_core::domain::unix_ms()),
        }
    }

    /// The sellers asked about most recently, and how many were in the last 10 minutes.
    async fn active_sellers(&self, now_ms: u64) -> anyhow::Result<(Vec<String>, u64)> {
        self.records
            .sellers_seen(
                SELLER_CANDIDATES,
                now_ms.saturating_sub(ACTIVE_FOR.as_millis() as u64),
            )
            .await
            .context("reading active sellers")
    }

    async fn dead_letters(&self) -> anyhow::Result<BTreeMap<String, u64>> {
        self.records
            .dead_now()
            .await
            .context("reading dead letters by reason")
    }

    /// Says in Redis what this replica's delay ladder holds, by seller (the
    /// [`HELD_SELLERS`] it holds most of, each with its [`HELD_SHOWN`] soonest messages),
    /// every [`HELD_EVERY`] while it holds any, once more when it holds none; kept
    /// [`HELD_KEPT`], so a replica gone is forgotten. Only a member of a fleet says it (its id
    /// names the key).
    async fn say_held(
        &self,
        said: &mut HeldSaid,
    ) -> Result<(), turnstile_core::permit::PermitError> {
        let Some(member) = &self.fleet else {
            return Ok(());
        };
        let now = Instant::now();
        if said.at.is_some_and(|at| now < at + HELD_EVERY) {
            return Ok(());
        }
        let held = self
            .stats
            .ladder
            .by_seller
            .largest(HELD_SELLERS, HELD_SHOWN);
        if held.is_empty() && said.empty {
            return Ok(());
        }
        self.records
            .record_held(member.id(), &held, HELD_KEPT)
            .await?;
        *said = HeldSaid {
            at: Some(now),
            empty: held.is_empty(),
        };
        Ok(())
    }

    /// What the live replicas of the fleet hold of `seller` in their delay ladders, as they
    /// last said it (within [`HELD_KEPT`]).
    pub async fn held_of(
        &self,
        seller: &str,
    ) -> anyhow::Result<Vec<(String, turnstile_core::broker::ladder::HeldSummary)>> {
        let replicas: Vec<String> = match self.fleet() {
            Some(fleet) => fleet.view.replicas.iter().map(|r| r.id.clone()).collect(),
            None => Vec::new(),
        };
        self.records
            .held_of(&replicas, seller)
            .await
            .context("reading what the replicas hold")
    }

    /// What every replica did in each of the last `hours` hours' minutes (at most
    /// [`HISTORY_HOURS`]), the current one included, oldest first.
    pub async fn history(&self, hours: u64) -> anyhow::Result<Vec<History>> {
        let last = unix_ms() / 60_000;
        let first = (last + 1).saturating_sub(hours.clamp(1, HISTORY_HOURS) * 60);
        self.records
            .history(first, last)
            .await
            .context("reading the history")
    }

    /// Registrations per second over the last [`THROUGHPUT_SECONDS`], the current one included
    /// (replicas record once a second, so the newest second fills in as they do).
    async fn throughput(&self, now_ms: u64) -> anyhow::Result<Throughput> {
        let end_s = now_ms / 1000;
        let start_s = end_s + 1 - THROUGHPUT_SECONDS;
        let per_second = self
            .records
            .throughput(start_s, end_s)
            .await
            .context("reading throughput")?;
        Ok(Throughput {
            end_s,
            total: per_second.iter().sum(),
            per_second,
        })
    }

    /// Records what this replica did since the last call: its registrations in the current
    /// second's throughput, each rate of `done` in the current minute's history, and the
    /// sellers it asked about. One round trip; when idle, a probe (Redis's
    /// clock) instead, so that Redis's health is known every second.
    async fn record(
        &self,
        done: History,
        sellers: &HashSet<String>,
    ) -> Result<(), turnstile_core::permit::PermitError> {
        if done == History::default() && sellers.is_empty() {
            return self.admin.redis_time_us().await.map(drop);
        }
        self.records
            .record_activity(unix_ms(), done, sellers, ACTIVE_FOR, Stats::MAX_SELLERS)
            .await
    }
}

/// The sellers with retries waiting, soonest due first (see [`RetriesView`]).
fn retries_view(retries: &HashMap<&str, Vec<RetryDue>>) -> RetriesView {
    let mut sellers: Vec<RetryRow> = retries
        .iter()
        .filter(|(_, due)| !due.is_empty())
        .map(|(seller, due)| {
            let ms = |r: &RetryDue| r.due_in.as_millis() as u64;
            RetryRow {
                seller: (*seller).to_owned(),
                messages: due.len() as u64,
                units: due.iter().map(|r| r.units).sum(),
                next_due_ms: due.iter().map(ms).min().unwrap_or(0),
                last_due_ms: due.iter().map(ms).max().unwrap_or(0),
                soonest: due
                    .iter()
                    .take(RETRY_MESSAGES_SHOWN)
                    .map(|r| RetryMessage {
                        message: r.message.clone(),
                        batch: r.batch.clone(),
                        due_in_ms: ms(r),
                    })
                    .collect(),
            }
        })
        .collect();
    let messages = sellers.iter().map(|s| s.messages).sum();
    sellers.sort_by(|a, b| {
        a.next_due_ms
            .cmp(&b.next_due_ms)
            .then(a.seller.cmp(&b.seller))
    });
    sellers.truncate(RETRY_SELLERS_SHOWN);
    RetriesView { messages, sellers }
}

/// One row per upload, newest first, with its ETA as `/api/batches/{id}` computes it from its
/// seller's uploads shown here and its `retries` waiting (none for a seller whose usage was not
/// read).
fn upload_rows(
    uploads: &[progress::Progress],
    usage: &HashMap<&str, &Usage>,
    retries: &HashMap<&str, Vec<RetryDue>>,
) -> Vec<UploadRow> {
    let mut eta: HashMap<(String, String), (Option<f64>, Option<String>)> = HashMap::new();
    let now_ms = turnstile_core::domain::unix_ms();
    let mut by_seller: BTreeMap<&str, Vec<progress::Progress>> = BTreeMap::new();
    for p in uploads {
        by_seller
            .entry(p.seller.as_str())
            .or_default()
            .push(p.clone());
    }
    for (seller, batches) in by_seller {
        let (Some(usage), Ok(id)) = (usage.get(seller), SellerId::parse(seller)) else {
            continue;
        };
        let retries = retries.get(seller).map_or(&[][..], Vec::as_slice);
        let report = progress::seller_report(&id, batches, (*usage).clone(), None, retries, now_ms);
        for b in report.batches {
            let stalled = b.stalled.map(|s| s.why);
            eta.insert((b.seller_id, b.batch_id), (b.eta_s, stalled));
        }
    }
    uploads
        .iter()
        .map(|p| {
            let (eta_s, stalled) = eta
                .get(&(p.seller.clone(), p.batch.clone()))
                .cloned()
                .unwrap_or_default();
            UploadRow {
                seller: p.seller.clone(),
                batch: p.batch.clone(),
                total: p.total,
                registered: p.registered,
                dead: p.dead,
                dead_by_reason: p.dead_by_reason.clone(),
                waiting: p.waiting(),
                eta_s,
                stalled,
                first_seen_ms: p.first_ms,
                last_ms: p.last_ms,
            }
        })
        .collect()
}

/// The global limit as the dashboard shows it.
fn global_view(usage: turnstile_core::permit::GlobalUsage) -> GlobalView {
    let total: u64 = usage.shares.iter().map(|s| s.units).sum();
    GlobalView {
        limit: usage.limit.to_string(),
        limits: usage.per_limit.iter().map(LimitRow::from).collect(),
        present: usage.present,
        weights: usage.weights,
        shares: usage
            .shares
            .into_iter()
            .take(SELLERS_SHOWN)
            .map(|s| ShareRow {
                permille: s.units * 1000 / total.max(1),
                seller: s.seller,
                units: s.units,
                weight: s.weight,
            })
            .collect(),
    }
}

/// The busiest sellers (share of the limit taken, then promised ahead) and the longest paused,
/// at most [`SELLERS_SHOWN`] of each.
fn seller_rows(usage: &HashMap<&str, &Usage>) -> (Vec<SellerRow>, Vec<SellerRow>) {
    let row = |seller: &str, u: &Usage| SellerRow {
        seller: seller.to_owned(),
        limit: u.limit.to_string(),
        overridden: u.overridden,
        configured: u.configured.to_string(),
        learned: u.learned_why.map(|why| why.label()),
        shadow: u.shadow.as_ref().map(|s| ShadowRow {
            limit: s.limit.to_string(),
            agree: s.agree,
            stricter: s.stricter,
            looser: s.looser,
        }),
        binding: u.per_limit[u.binding].limit.to_string(),
        limits: u.per_limit.iter().map(LimitRow::from).collect(),
        used: u.used,
        capacity: u.capacity,
        ahead: u.ahead,
        paused_ms: u.paused_for.as_millis() as u64,
    };
    let mut rows: Vec<SellerRow> = usage.iter().map(|(s, u)| row(s, u)).collect();
    let mut paused: Vec<SellerRow> = usage
        .iter()
        .filter(|(_, u)| !u.paused_for.is_zero())
        .map(|(s, u)| row(s, u))
        .collect();
    paused.sort_by(|a, b| b.paused_ms.cmp(&a.paused_ms).then(a.seller.cmp(&b.seller)));
    paused.truncate(SELLERS_SHOWN);
    // Busiest first: share of the limit taken (in thousandths), then promised ahead.
    let share = |r: &SellerRow| (r.used * 1000).checked_div(r.capacity).unwrap_or(0);
    rows.sort_by(|a, b| {
        (share(b), b.ahead, b.paused_ms)
            .cmp(&(share(a), a.ahead, a.paused_ms))
            .then(a.seller.cmp(&b.seller))
    });
    rows.truncate(SELLERS_SHOWN);
    (rows, paused)
}

/// Feeds the shared state once a second (throughput, active sellers) until `stop`, then once
/// more. Runs on every replica, with or without HTTP: every page counts every replica.
pub async fn sample(dashboard: Arc<Dashboard>, stop: CancellationToken) {
    let counted = |stats: &Stats| History {
        minute: 0,
        registered: stats.registered.load(Ordering::Relaxed),
        dead: stats.dead_lettered.load(Ordering::Relaxed),
        delayed: stats.delayed.load(Ordering::Relaxed),
        retried: stats.retried.load(Ordering::Relaxed),
    };
    let mut recorded = counted(&dashboard.stats);
    let mut held_said = HeldSaid::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.cancelled() => true,
        };
        let now = counted(&dashboard.stats);
        let since = now.since(recorded);
        let sellers = dashboard.stats.take_sellers();
        dashboard
            .ladder_window
            .lock()
            .expect("never poisoned")
            .note(
                unix_ms(),
                dashboard.stats.ladder.hops.load(Ordering::Relaxed),
                dashboard.stats.ladder.overdue.load(Ordering::Relaxed),
            );
        let recording = async {
            dashboard.record(since, &sellers).await?;
            dashboard.say_held(&mut held_said).await
        };
        match tokio::time::timeout(SAMPLE_TIMEOUT, recording).await {
            Ok(Ok(())) => {
                recorded = now;
                dashboard.redis.ok();
            }
            Ok(Err(error)) => {
                metrics::counter!("turnstile_redis_errors_total").increment(1);
                dashboard.redis.failed(&error.to_string());
                debug!(%error, "could not record dashboard samples; retrying next second");
            }
            Err(_) => {
                metrics::counter!("turnstile_redis_errors_total").increment(1);
                dashboard
                    .redis
                    .failed(&format!("no answer within {SAMPLE_TIMEOUT:?}"));
            }
        }
        if stopping {
            return;
        }
    }
}

/// Why actions are off on a replica without a token.
pub const ACTIONS_OFF: &str = "actions are off: they need TURNSTILE_HTTP_TOKEN set on the replica (then open the page with ?token=…)";

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60_000;

    #[test]
    fn the_ladder_window_counts_the_last_five_minutes_and_everything_while_younger() {
        let mut window = LadderWindow::default();
        // Younger than 5 minutes: everything since the start.
        window.note(0, 0, 0);
        window.note(MIN, 40, 3);
        assert_eq!(window.recent(MIN, 40, 3), (40, 3));
        // Samples every 10 s; ten minutes on, only what came after the sample 5 minutes ago.
        for s in 1..=60 {
            window.note(MIN + s * 10_000, 40 + s, 3);
        }
        let now = MIN + 600_000;
        let (hops, overdue) = window.recent(now, 100, 3);
        assert_eq!(
            (hops, overdue),
            (100 - (40 + 30), 0),
            "late hops 10 minutes ago are gone"
        );
        // An overdue hop now counts; the kept samples stay bounded.
        assert_eq!(window.recent(now, 101, 4).1, 1);
        assert!(window.samples.len() <= 32, "{}", window.samples.len());
    }

    #[test]
    fn the_ladder_window_keeps_one_sample_per_spacing() {
        let mut window = LadderWindow::default();
        for ms in (0..20_000).step_by(100) {
            window.note(ms, ms, 0);
        }
        assert_eq!(window.samples.len(), 2);
    }
}
