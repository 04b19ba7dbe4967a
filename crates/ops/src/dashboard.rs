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
//! - `sellers`: sellers asked about in the last 10 minutes (sorted set: seller -> last ms),
//!   at most 10,000, also written by the sampler from [`Stats::take_sellers`];
//! - `dead-now`: messages dead-lettered and not replayed since, by reason (hash, kept by
//!   [`turnstile_core::permit::PermitStore::complete`]): a message counts once however often
//!   it was dead-lettered, and no longer once replayed or registered by a copy;
//! - `uploads`: the batches by when a replica first saw them (written by
//!   [`Records::batch_seen`]).
//!
//! The cost is bounded whatever the number of sellers: a snapshot reads the 200 sellers asked
//! about most recently and the 50 most recent uploads (one read-only script per seller), shows
//! the 50 busiest, and is computed at most once a second however many pages poll it. Queue
//! depths come from the broker every 5 s (passive declares on a connection of the dashboard's
//! own) and are also exported as gauges.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use turnstile_core::broker::{self, Topology, unix_ms};
use turnstile_core::domain::SellerId;
use turnstile_core::fleet;
use turnstile_core::permit::{Admin, Records, RetryDue, Usage};
use turnstile_core::telemetry::Readiness;
use turnstile_core::worker::Stats;
use turnstile_upload::progress;

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
/// Longest time a snapshot may take (then `/api/dashboard` answers 503).
const GATHER_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the replica reads its queue depths from the broker.
const QUEUES_EVERY: Duration = Duration::from_secs(5);

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

/// Messages in the replica's queues, as last read from the broker.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct QueueDepths {
    /// Ready in the work queue.
    pub work: u64,
    /// Back from a delay and ready in the return queue `<queue>.ready` (taken beside the work
    /// queue, not behind it).
    pub returning: u64,
    /// In the delay ladder (throttled or retried, coming back later).
    pub delayed: u64,
    /// In `<queue>.dead`.
    pub dead: u64,
    /// When they were read (unix ms).
    pub read_ms: u64,
}

/// Everything the page shows, at one moment.
#[derive(Debug, Serialize)]
pub struct Snapshot {
    /// Unix ms when it was taken.
    pub now_ms: u64,
    pub replica: ReplicaView,
    /// `None` until the broker was read once.
    pub queues: Option<QueueDepths>,
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
    /// The fleet as this replica's last heartbeat saw it (`None` before it).
    pub fleet: Option<FleetView>,
}

/// The fleet (see `turnstile_core::fleet`) with the serving replica's id.
#[derive(Debug, Serialize)]
pub struct FleetView {
    #[serde(flatten)]
    pub view: fleet::View,
    /// The serving replica's id.
    pub me: String,
}

/// The global limit (`TURNSTILE_GLOBAL_LIMIT`) now: each limit's units taken of its COUNT,
/// the sellers competing for it (refused recently), and the sellers' shares of its shortest window.
#[derive(Debug, Serialize)]
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
#[derive(Debug, Serialize)]
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
    pub ready: bool,
    pub in_flight: usize,
    pub held: usize,
    pub deliveries: u64,
    pub registered: u64,
    pub ladder: LadderView,
}

/// What this replica's delay ladder consumers did: messages held now, hops moved on, hops
/// that ended more than a second late, and the longest any message came back after its due
/// time.
#[derive(Debug, Serialize)]
pub struct LadderView {
    pub held: usize,
    pub hops: u64,
    pub overdue: u64,
    pub max_late_ms: u64,
}

/// One seller's window.
#[derive(Debug, Serialize)]
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
#[derive(Debug, Serialize)]
pub struct ShadowRow {
    pub limit: String,
    pub agree: u64,
    pub stricter: u64,
    pub looser: u64,
}

/// One limit of a seller's stack: `used` of `capacity` units taken now, `ahead` promised.
#[derive(Debug, Serialize)]
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
#[derive(Debug, Serialize)]
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
    pub first_seen_ms: Option<u64>,
    pub last_ms: Option<u64>,
}

/// Registrations per second by every replica, oldest first, ending at `end_s` (unix seconds).
#[derive(Debug, Serialize)]
pub struct Throughput {
    pub end_s: u64,
    pub per_second: Vec<u64>,
    /// Their sum.
    pub total: u64,
}

/// A replica's dashboard: what it needs to take a [`Snapshot`].
pub struct Dashboard {
    admin: Admin,
    records: Records,
    stats: Arc<Stats>,
    ready: Readiness,
    info: ReplicaInfo,
    /// The serving replica as a member of the fleet, if it is one.
    fleet: Option<Arc<fleet::Member>>,
    depths: Arc<Mutex<Option<QueueDepths>>>,
    cache: tokio::sync::Mutex<Option<(Instant, Arc<String>)>>,
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
            depths: Arc::default(),
            cache: tokio::sync::Mutex::default(),
        }
    }

    /// The dashboard of a replica that is a member of a fleet: the page lists the fleet.
    pub fn with_fleet(mut self, member: Arc<fleet::Member>) -> Self {
        self.fleet = Some(member);
        self
    }

    /// The fleet as the serving replica's last heartbeat saw it, with its id.
    pub fn fleet(&self) -> Option<FleetView> {
        let member = self.fleet.as_ref()?;
        Some(FleetView {
            view: member.view(),
            me: member.id().to_owned(),
        })
    }

    /// The snapshot as JSON, computed at most once a second.
    pub async fn json(&self) -> anyhow::Result<Arc<String>> {
        let mut cache = self.cache.lock().await;
        if let Some((at, json)) = &*cache
            && at.elapsed() < CACHE_FOR
        {
            return Ok(json.clone());
        }
        let snapshot = tokio::time::timeout(GATHER_TIMEOUT, self.snapshot())
            .await
            .context("the snapshot took too long")??;
        let json = Arc::new(serde_json::to_string(&snapshot)?);
        *cache = Some((Instant::now(), json.clone()));
        Ok(json)
    }

    /// Reads the shared state from Redis (and the last queue depths) into a snapshot.
    pub async fn snapshot(&self) -> anyhow::Result<Snapshot> {
        let now_ms = unix_ms();
        let (uploads, (recent_sellers, sellers_active), dead_letters, throughput) = tokio::try_join!(
            async {
                progress::recent(&self.records, UPLOADS_SHOWN)
                    .await
                    .context("reading uploads")
            },
            self.active_sellers(now_ms),
            self.dead_letters(),
            self.throughput(now_ms),
        )?;

        let mut seen = HashSet::new();
        let candidates: Vec<SellerId> = uploads
            .iter()
            .map(|u| u.seller.as_str())
            .chain(recent_sellers.iter().map(String::as_str))
            .filter(|s| seen.insert(*s))
            .filter_map(|s| SellerId::parse(s).ok())
            .collect();
        let usages =
            futures::future::try_join_all(candidates.iter().map(|seller| self.admin.usage(seller)))
                .await
                .context("reading sellers' windows")?;
        let usage: HashMap<&str, &Usage> = candidates
            .iter()
            .map(SellerId::as_str)
            .zip(usages.iter())
            .collect();
        let uploading: Vec<&SellerId> = candidates
            .iter()
            .filter(|s| uploads.iter().any(|u| u.seller == s.as_str()))
            .collect();
        let retries = futures::future::try_join_all(
            uploading
                .iter()
                .map(|seller| self.records.retries_due(seller)),
        )
        .await
        .context("reading sellers' retries")?;
        let retries: HashMap<&str, Vec<RetryDue>> =
            uploading.iter().map(|s| s.as_str()).zip(retries).collect();

        let uploads = upload_rows(&uploads, &usage, &retries);
        let (rows, paused) = seller_rows(&usage);
        let global = self
            .admin
            .global_usage()
            .await
            .context("reading the global limit")?
            .map(global_view);

        Ok(Snapshot {
            now_ms,
            replica: self.replica_view(),
            queues: *self.depths.lock().expect("never poisoned"),
            sellers: rows,
            sellers_active,
            paused,
            uploads,
            dead_letters,
            throughput,
            global,
            fleet: self.fleet(),
        })
    }

    /// This replica's own figures.
    fn replica_view(&self) -> ReplicaView {
        let stats = &self.stats;
        // The terms it grants under now (the fleet's), not the ones it was started with.
        let terms = self.admin.terms();
        ReplicaView {
            info: ReplicaInfo {
                algorithm: terms.algorithm.name(),
                limit: terms.limit.to_string(),
                ..self.info.clone()
            },
            ready: self.ready.get(),
            in_flight: stats.in_flight.load(Ordering::Relaxed),
            held: stats.held.load(Ordering::Relaxed),
            deliveries: stats.deliveries.load(Ordering::Relaxed),
            registered: stats.registered.load(Ordering::Relaxed),
            ladder: LadderView {
                held: stats.ladder.held.load(Ordering::Relaxed),
                hops: stats.ladder.hops.load(Ordering::Relaxed),
                overdue: stats.ladder.overdue.load(Ordering::Relaxed),
                max_late_ms: stats.ladder.max_late_ms.load(Ordering::Relaxed),
            },
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

    /// Records what this replica did since the last call: `registered` in the current second's
    /// throughput and the sellers it asked about. One round trip; nothing when idle.
    async fn record(
        &self,
        registered: u64,
        sellers: &HashSet<String>,
    ) -> Result<(), turnstile_core::permit::PermitError> {
        self.records
            .record_activity(
                unix_ms(),
                registered,
                sellers,
                ACTIVE_FOR,
                Stats::MAX_SELLERS,
            )
            .await
    }
}

/// One row per upload, newest first, with its ETA as `/api/batches/{id}` computes it from its
/// seller's uploads shown here and its `retries` waiting (none for a seller whose usage was not
/// read).
fn upload_rows(
    uploads: &[progress::Progress],
    usage: &HashMap<&str, &Usage>,
    retries: &HashMap<&str, Vec<RetryDue>>,
) -> Vec<UploadRow> {
    let mut eta: HashMap<(String, String), Option<f64>> = HashMap::new();
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
        for b in progress::seller_report(&id, batches, (*usage).clone(), None, retries).batches {
            eta.insert((b.seller_id, b.batch_id), b.eta_s);
        }
    }
    uploads
        .iter()
        .map(|p| UploadRow {
            seller: p.seller.clone(),
            batch: p.batch.clone(),
            total: p.total,
            registered: p.registered,
            dead: p.dead,
            dead_by_reason: p.dead_by_reason.clone(),
            waiting: p.waiting(),
            eta_s: eta
                .get(&(p.seller.clone(), p.batch.clone()))
                .copied()
                .flatten(),
            first_seen_ms: p.first_ms,
            last_ms: p.last_ms,
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
    let mut recorded = dashboard.stats.registered.load(Ordering::Relaxed);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.cancelled() => true,
        };
        let registered = dashboard.stats.registered.load(Ordering::Relaxed);
        let sellers = dashboard.stats.take_sellers();
        match dashboard.record(registered - recorded, &sellers).await {
            Ok(()) => recorded = registered,
            Err(error) => {
                metrics::counter!("turnstile_redis_errors_total").increment(1);
                debug!(%error, "could not record dashboard samples; retrying next second");
            }
        }
        if stopping {
            return;
        }
    }
}

/// The depth of each of the topology's queues, the delay ladder's summed.
async fn read_depths(channel: &lapin::Channel, topology: &Topology) -> anyhow::Result<QueueDepths> {
    let mut depths = QueueDepths {
        read_ms: unix_ms(),
        ..Default::default()
    };
    for queue in topology.queues() {
        let n = u64::from(broker::depth(channel, &queue).await?);
        if queue == topology.work() {
            depths.work = n;
        } else if queue == topology.ready() {
            depths.returning = n;
        } else if queue == topology.dead() {
            depths.dead = n;
        } else {
            depths.delayed += n;
        }
    }
    Ok(depths)
}

impl QueueDepths {
    /// Sets the `turnstile_queue_messages` gauges.
    fn export(&self) {
        for (queue, n) in [
            ("work", self.work),
            ("ready", self.returning),
            ("delay", self.delayed),
            ("dead", self.dead),
        ] {
            metrics::gauge!("turnstile_queue_messages", "queue" => queue).set(n as f64);
        }
    }
}

/// Reads the queue depths from the broker every 5 s until `stop` (on a connection of its own,
/// reopened after errors), for the page and the `turnstile_queue_messages` gauges.
pub async fn watch_queues(
    dashboard: Arc<Dashboard>,
    amqp_url: String,
    topology: Topology,
    stop: CancellationToken,
) {
    let name = format!(
        "turnstile {} dashboard pid {}",
        topology.work(),
        std::process::id()
    );
    let mut open: Option<(lapin::Connection, lapin::Channel)> = None;
    let mut tick = tokio::time::interval(QUEUES_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        let read = async {
            if open.is_none() {
                let connection = broker::connect(&amqp_url, &name).await?;
                let channel = connection.create_channel().await?;
                open = Some((connection, channel));
            }
            let (_, channel) = open.as_ref().expect("opened above");
            read_depths(channel, &topology).await
        };
        let read = tokio::select! {
            read = tokio::time::timeout(QUEUES_EVERY, read) => read,
            _ = stop.cancelled() => break,
        };
        match read {
            Ok(Ok(depths)) => {
                depths.export();
                *dashboard.depths.lock().expect("never poisoned") = Some(depths);
            }
            Ok(Err(error)) => {
                metrics::counter!("turnstile_broker_errors_total").increment(1);
                debug!(error = format!("{error:#}"), "could not read queue depths");
                open = None;
            }
            Err(_) => open = None,
        }
    }
    if let Some((connection, _)) = open {
        let _ = connection.close(200, "stopping".into()).await;
    }
}
