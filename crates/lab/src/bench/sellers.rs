//! `turnstile bench sellers`: ten thousand active sellers.
//!
//! - **Redis memory per seller**, for each algorithm: the growth of INFO `used_memory` divided by
//!   the number of sellers (after one permit each, and after `--permits`), and `MEMORY USAGE` of
//!   a seller's state key, beside a plain `SET key 1 PX` per seller measured the same way.
//! - **Completion records**: what one costs (done key plus its share of the upload's hash), and
//!   what 10,000 sellers × 500 messages cost for the done TTL.
//! - **Keys gone after idleness**: with a short limit, every limiter key has expired two windows
//!   plus guards and 2 s after the last permit (a reserved slot's lateness); completion records
//!   stay (their TTL is the done TTL).
//! - **No per-seller growth in a replica**: the resident memory of an in-process replica after a
//!   warm-up, and again after it has served every seller.
//!
//! Memory is measured on a private `redis-server` (flushed between measurements) unless
//! `--redis-url` names another Redis or a cluster, where other clients' writes show up in the
//! figures. Nothing here has a threshold: the figures are for people to read.

use std::future::Future;
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures::{StreamExt, TryStreamExt};
use lapin::BasicProperties;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};
use tokio_util::sync::CancellationToken;

use crate::local_redis::LocalRedis;
use crate::rig::{RigArgs, registration_body};
use turnstile_core::broker::{AmqpArgs, QueueType};
use turnstile_core::config::redact_url;
use turnstile_core::config::{
    Algorithm, Limit, LimiterArgs, RedisArgs, duration_arg, format_duration,
};
use turnstile_core::domain::{BatchId, MessageId, SellerId};
use turnstile_core::permit::{
    Ask, Completion, InBatch, Keyspace, Limiter, PermitStore, RedisConn, SLOW_LINK_LATENESS,
    delete_prefix, keys_matching,
};
use turnstile_ops::serve::Served;

/// Flags of `turnstile bench sellers`.
#[derive(Args, Debug, Clone)]
pub struct SellersArgs {
    /// Active sellers.
    #[arg(long, default_value_t = 10_000)]
    pub sellers: usize,
    /// Permits each seller takes (memory is also measured after a single one).
    #[arg(long, default_value_t = 5)]
    pub permits: u32,
    /// Limit of the memory measurement.
    #[arg(long, default_value = "100/60s", value_parser = turnstile_core::config::limit_arg)]
    pub limit: Limit,
    /// Short limit of the idleness check: every limiter key must be gone two windows plus guards
    /// and 2 s after the last permit. Its window should outlast filling one algorithm's keys, so that
    /// "keys before" counts every seller.
    #[arg(long = "idle-limit", default_value = "5/10s", value_parser = turnstile_core::config::limit_arg)]
    pub idle_limit: Limit,
    /// Completion records written per seller (one upload each).
    #[arg(long = "messages-per-seller", default_value_t = 10)]
    pub messages_per_seller: usize,
    /// TTL of the completion records (TURNSTILE_DONE_TTL's default).
    #[arg(long = "done-ttl", default_value = "7d", value_parser = duration_arg)]
    pub done_ttl: Duration,
    /// Sellers the in-process replica serves (2 messages each, through RabbitMQ) in the replica
    /// memory step [default: --sellers]; 0 skips the step.
    #[arg(long = "replica-sellers")]
    pub replica_sellers: Option<usize>,
    /// Sellers the replica serves before its first memory reading (at most half of them).
    #[arg(long = "warmup-sellers", default_value_t = 1000)]
    pub warmup_sellers: usize,
    /// Redis to measure instead of a private redis-server (TURNSTILE_REDIS_URL is not read);
    /// a comma-separated list of node URLs means Redis Cluster. Other clients' writes then show
    /// up in the memory figures.
    #[arg(id = "bench_redis_url", long = "bench-redis-url", value_name = "URL")]
    pub redis_url: Option<String>,
    #[command(flatten)]
    pub amqp: AmqpArgs,
    /// Queue type of the replica step's queues.
    #[arg(long = "queue-type", value_enum, default_value_t = QueueType::Quorum)]
    pub queue_type: QueueType,
    /// Redis calls in flight at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Print the summary as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
}

/// Everything measured, as printed with `--json`.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub sellers: usize,
    pub permits: u32,
    pub limit: String,
    pub idle_limit: String,
    /// `private redis-server X.Y.Z` or the URL(s) measured.
    pub redis: String,
    /// `SET <seller key> 1 PX 60000` per seller: INFO used_memory growth / sellers.
    pub baseline_set_bytes: f64,
    pub algorithms: Vec<AlgorithmFigures>,
    pub completion: CompletionFigures,
    pub idle: IdleFigures,
    /// Absent when skipped (`--replica-sellers 0`).
    pub replica: Option<ReplicaFigures>,
}

/// Redis memory of one algorithm's per-seller state, and its expiry.
#[derive(Debug, Serialize)]
pub struct AlgorithmFigures {
    pub algorithm: &'static str,
    /// INFO used_memory growth / sellers, after one permit each.
    pub bytes_per_seller_one_permit: f64,
    /// INFO used_memory growth / sellers, after `permits` each.
    pub bytes_per_seller: f64,
    /// Mean `MEMORY USAGE` of a seller's state key after `permits` (sampled).
    pub state_key_memory_usage: f64,
    /// `bytes_per_seller` / `baseline_set_bytes`.
    pub ratio_to_baseline: f64,
    /// Limiter keys right after the sellers took their permits at the idle limit.
    pub keys_before_idle: usize,
    /// Limiter keys two windows plus guards and 2 s after the last permit (expected: 0).
    pub keys_after_idle: usize,
}

/// What completion records cost (kept for the done TTL, one per registered message).
#[derive(Debug, Serialize)]
pub struct CompletionFigures {
    pub records: usize,
    /// INFO used_memory growth / records (done key, plus the upload's hash shared by the
    /// seller's records).
    pub bytes_per_record: f64,
    pub done_key_memory_usage: f64,
    pub batch_key_memory_usage: f64,
    /// `bytes_per_record` / `baseline_set_bytes`.
    pub ratio_to_baseline: f64,
    /// Done keys still there after the idle wait (expected: all of them).
    pub records_after_idle: usize,
    /// TTL left on a sampled done key after the idle wait, in seconds.
    pub ttl_left_s: f64,
    /// `bytes_per_record` × 10,000 sellers × 500 messages.
    pub projected_bytes_10k_sellers_x_500: f64,
}

/// The idle wait.
#[derive(Debug, Serialize)]
pub struct IdleFigures {
    /// Waited after the last permit: window + guard + 500 ms.
    pub waited_s: f64,
    /// Private Redis only: expired limiter keys that active expiry had not reclaimed yet at
    /// the end of the wait (DBSIZE above what it was before the idle step). Redis samples keys
    /// with a TTL and tolerates ~10% of them stale, and the completion records (days of TTL)
    /// make up most of them.
    pub stale_keys_after_wait: Option<u64>,
    /// Private Redis only: the same after the SCAN that counted the keys (which reclaims the
    /// expired keys it meets).
    pub stale_keys_after_scan: Option<u64>,
    /// Private Redis only: INFO used_memory growth over the idle step after that SCAN, per
    /// seller and algorithm.
    pub bytes_left_per_seller: Option<f64>,
}

/// Resident memory of an in-process replica as it serves more sellers.
#[derive(Debug, Serialize)]
pub struct ReplicaFigures {
    pub sellers: usize,
    pub warmup_sellers: usize,
    pub messages: u64,
    pub registered: u64,
    pub duplicates: u64,
    pub violations: u64,
    /// (sellers served, VmRSS in KiB) after the warm-up and after each further chunk.
    pub rss_kib: Vec<(usize, u64)>,
    /// (last VmRSS − VmRSS after warm-up) / sellers served since.
    pub rss_delta_per_seller_bytes: f64,
}

/// Runs every measurement and prints the table; false when a limiter key outlived idleness or
/// the replica did not register every message exactly once within the limits.
pub async fn run(args: SellersArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.sellers > 0, "--sellers must be at least 1");
    anyhow::ensure!(args.permits > 0, "--permits must be at least 1");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let target = Target::open(args.redis_url.as_deref()).await?;
    // On a private Redis, the production prefix: key length is part of what a seller costs.
    let base = match &target.private {
        Some(_) => "turnstile".to_owned(),
        None => format!("turnstile-sellers-{:08x}", rand::random::<u32>()),
    };
    eprintln!(
        "sellers: {} sellers, {} permits each at {}, on {}",
        args.sellers, args.permits, args.limit, target.shown
    );
    let result = measure(&args, &target, &base).await;
    target.cleanup(&base).await?;
    let summary = result?;
    print(&args, &summary);
    let replica_ok = summary
        .replica
        .as_ref()
        .is_none_or(|r| r.registered == r.messages && r.duplicates == 0 && r.violations == 0);
    Ok(summary.algorithms.iter().all(|a| a.keys_after_idle == 0) && replica_ok)
}

async fn measure(args: &SellersArgs, target: &Target, base: &str) -> anyhow::Result<Summary> {
    let n = args.sellers;
    let conn = &target.conn;
    warm_scripts(target, base).await?;

    eprintln!("  baseline: SET per seller");
    let baseline_set_bytes = bytes_per(target, base, n, args.concurrency, |i| {
        let mut conn = conn.clone();
        let key = Keyspace::new(base).lab_baseline(&seller(i));
        async move {
            let () = redis::cmd("SET")
                .arg(key)
                .arg(1)
                .arg("PX")
                .arg(60_000)
                .query_async(&mut conn)
                .await?;
            Ok(())
        }
    })
    .await?;

    let mut algorithms = Vec::new();
    for algorithm in Algorithm::ALL {
        eprintln!("  {algorithm}: memory");
        let store = limiter_store(conn, base, args.limit, algorithm);
        fresh_window(&store, algorithm).await?;
        let one = bytes_per(target, base, n, args.concurrency, |i| {
            let store = store.clone();
            async move { take(&store, &seller(i), 1).await }
        })
        .await?;
        fresh_window(&store, algorithm).await?;
        let many = bytes_per(target, base, n, args.concurrency, |i| {
            let store = store.clone();
            async move { take(&store, &seller(i), args.permits).await }
        })
        .await?;
        let usage = mean_usage(
            conn,
            sample(n).map(|i| store.keys().state(&seller(i), algorithm)),
        )
        .await?;
        algorithms.push(AlgorithmFigures {
            algorithm: algorithm.name(),
            bytes_per_seller_one_permit: one,
            bytes_per_seller: many,
            state_key_memory_usage: usage,
            ratio_to_baseline: many / baseline_set_bytes,
            keys_before_idle: 0,
            keys_after_idle: 0,
        });
    }

    let mut completion = completion_records(args, target, base, baseline_set_bytes).await?;
    let idle = idle(args, target, base, &mut algorithms).await?;
    completion.records_after_idle = keys_matching(conn, &Keyspace::new(base).completion_records())
        .await?
        .len();
    let ttl_ms: i64 = redis::cmd("PTTL")
        .arg(
            limiter_store(conn, base, args.limit, Algorithm::SlidingWindow)
                .keys()
                .done(&seller(0), &message(0, 0)),
        )
        .query_async(&mut conn.clone())
        .await?;
    completion.ttl_left_s = ttl_ms as f64 / 1000.0;

    let replica_sellers = args.replica_sellers.unwrap_or(n);
    let replica = if replica_sellers == 0 {
        None
    } else {
        Some(replica_memory(args, target, replica_sellers).await?)
    };

    Ok(Summary {
        sellers: n,
        permits: args.permits,
        limit: args.limit.to_string(),
        idle_limit: args.idle_limit.to_string(),
        redis: target.shown.clone(),
        baseline_set_bytes,
        algorithms,
        completion,
        idle,
        replica,
    })
}

/// Completion records (`PermitStore::complete`: done key and the upload's hash), one upload of
/// `--messages-per-seller` messages per seller, kept for `--done-ttl`.
async fn completion_records(
    args: &SellersArgs,
    target: &Target,
    base: &str,
    baseline_set_bytes: f64,
) -> anyhow::Result<CompletionFigures> {
    eprintln!("  completion records");
    let per_seller = args.messages_per_seller.max(1);
    let records = args.sellers * per_seller;
    let store = limiter_store(&target.conn, base, args.limit, Algorithm::SlidingWindow);
    let batch = BatchId::parse("products-0123abcd").expect("a valid batch id");
    let bytes_per_record = bytes_per(target, base, records, args.concurrency, |r| {
        let store = store.clone();
        let batch = batch.clone();
        let (s, m) = (r / per_seller, r % per_seller);
        async move {
            store
                .complete(
                    &seller(s),
                    &message(s, m),
                    Some(InBatch {
                        id: &batch,
                        size: None,
                    }),
                    Completion::Registered,
                    args.done_ttl,
                )
                .await
                .context("writing a completion record")?;
            Ok(())
        }
    })
    .await?;
    let sampled = || sample(args.sellers);
    let done_key_memory_usage = mean_usage(
        &target.conn,
        sampled().map(|s| store.keys().done(&seller(s), &message(s, 0))),
    )
    .await?;
    let batch_key_memory_usage = mean_usage(
        &target.conn,
        sampled().map(|s| store.keys().batch(&seller(s), &batch)),
    )
    .await?;
    Ok(CompletionFigures {
        records,
        bytes_per_record,
        done_key_memory_usage,
        batch_key_memory_usage,
        ratio_to_baseline: bytes_per_record / baseline_set_bytes,
        records_after_idle: 0,
        ttl_left_s: 0.0,
        projected_bytes_10k_sellers_x_500: bytes_per_record * 10_000.0 * 500.0,
    })
}

/// Every algorithm at the short idle limit: limiter keys counted right after the sellers took
/// their permits, and again two windows plus guards and [`SLOW_LINK_LATENESS`] after the last
/// one (a reserved slot lies at most a window + guard ahead, and stays redeemable a window +
/// guard + [`SLOW_LINK_LATENESS`] late with the exact algorithms).
async fn idle(
    args: &SellersArgs,
    target: &Target,
    base: &str,
    algorithms: &mut [AlgorithmFigures],
) -> anyhow::Result<IdleFigures> {
    let limit = args.idle_limit;
    let permits = args.permits.min(limit.count());
    let memory_before = target.used_memory().await?;
    let dbsize_before = target.dbsize().await?;
    let mut last_permit = Instant::now();
    let mut longest_guard = Duration::ZERO;
    for (algorithm, figures) in Algorithm::ALL.into_iter().zip(algorithms.iter_mut()) {
        eprintln!("  {algorithm}: keys at {limit}, {permits} permits per seller");
        let prefix = format!("{base}-idle-{}", algorithm.name());
        let store = limiter_store(&target.conn, &prefix, limit, algorithm);
        fresh_window(&store, algorithm).await?;
        for_each(args.sellers, args.concurrency, |i| {
            let store = store.clone();
            async move { take(&store, &seller(i), permits).await }
        })
        .await?;
        last_permit = Instant::now();
        longest_guard =
            longest_guard.max(LimiterArgs::new(limit, algorithm).guard_for(limit.window()));
        figures.keys_before_idle = keys_matching(&target.conn, &store.keys().everything())
            .await?
            .len();
    }
    let waited =
        (limit.window() + longest_guard) * 2 + SLOW_LINK_LATENESS + Duration::from_millis(500);
    eprintln!(
        "  idle: waiting {} after the last permit",
        format_duration(waited)
    );
    tokio::time::sleep_until((last_permit + waited).into()).await;

    // DBSIZE still counts expired keys that active expiry has not sampled yet; SCAN reclaims
    // the expired keys it meets, so DBSIZE is read first.
    let private = target.private.is_some();
    let stale_keys_after_wait = match private {
        true => Some(target.dbsize().await?.saturating_sub(dbsize_before)),
        false => None,
    };
    for (algorithm, figures) in Algorithm::ALL.into_iter().zip(algorithms.iter_mut()) {
        let prefix = format!("{base}-idle-{}", algorithm.name());
        figures.keys_after_idle = keys_matching(&target.conn, &Keyspace::new(&prefix).everything())
            .await?
            .len();
    }
    let (mut stale_keys_after_scan, mut bytes_left_per_seller) = (None, None);
    if private {
        stale_keys_after_scan = Some(target.dbsize().await?.saturating_sub(dbsize_before));
        let left = target.used_memory().await? as f64 - memory_before as f64;
        bytes_left_per_seller = Some(left / (args.sellers * algorithms.len()) as f64);
    }
    Ok(IdleFigures {
        waited_s: waited.as_secs_f64(),
        stale_keys_after_wait,
        stale_keys_after_scan,
        bytes_left_per_seller,
    })
}

/// An in-process replica serves `sellers` sellers × 2 messages; its VmRSS is read after the
/// warm-up and after each further quarter. The mock downstream runs as a child process
/// (`turnstile mock-api`), so its own per-seller ledger is not counted as the replica's.
async fn replica_memory(
    args: &SellersArgs,
    target: &Target,
    sellers: usize,
) -> anyhow::Result<ReplicaFigures> {
    let warmup = args.warmup_sellers.min(sellers / 2);
    let limit = Limit::new(1_000_000, Duration::from_secs(1)).expect("a valid limit");
    eprintln!(
        "  replica: {sellers} sellers x 2 messages through RabbitMQ ({:?} queues), limit {limit}, RSS after {warmup} sellers and after all",
        args.queue_type
    );
    let mut mock = MockChild::start(limit).await?;
    let rig = RigArgs {
        queue_type: args.queue_type,
        amqp: args.amqp.clone(),
        redis: RedisArgs {
            url: target.url.clone(),
            cluster: false,
            key_prefix: "turnstile".into(),
        },
    };
    let name = format!("sellers-{:08x}-replica", rand::random::<u32>());
    let limiter = LimiterArgs {
        redis_durable: true,
        ..LimiterArgs::new(limit, Algorithm::SlidingWindow)
    };
    let mut settings = rig.replica_settings(&name, limiter, 16, Duration::from_secs(2));
    settings.downstream.url = mock.url.clone();
    let (connection, publisher, topology) = settings
        .broker
        .open("turnstile bench sellers")
        .await
        .context("opening the broker")?;
    let stop = CancellationToken::new();
    let replica = Served::start(settings.clone().into(), stop.clone()).await?;

    let served = async {
        let mut rss = Vec::new();
        let mut published = 0u64;
        let mut from = 0;
        let quarter = (sellers - warmup).div_ceil(4).max(1);
        let mut upto = warmup.max(1);
        loop {
            published += publish(&publisher, topology.work(), from..upto).await?;
            let deadline = Instant::now() + Duration::from_secs(120);
            while replica.stats.registered.load(Ordering::Relaxed) < published {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "the replica registered {} of {published} messages in 120 s",
                    replica.stats.registered.load(Ordering::Relaxed)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            rss.push((upto, rss_kib()?));
            eprintln!("    {upto} sellers served: VmRSS {} KiB", rss_kib()?);
            if upto >= sellers {
                return Ok((rss, published));
            }
            from = upto;
            upto = (upto + quarter).min(sellers);
        }
    }
    .await;

    stop.cancel();
    let stopped = replica.wait().await;
    let deleted = async {
        let channel = connection.create_channel().await?;
        topology.delete(&channel).await?;
        let _ = channel.close(200, "done".into()).await;
        let _ = connection.close(200, "done".into()).await;
        delete_prefix(&target.conn, &settings.redis.key_prefix).await
    }
    .await;
    let stats = crate::mock_api::fetch_stats(&mock.url).await;
    mock.stop().await;
    let (rss, published) = served?;
    stopped?;
    deleted.context("deleting the replica's queues and keys")?;
    let stats = stats.context("reading the mock's counters")?;
    let (first, last) = (rss[0], rss[rss.len() - 1]);
    Ok(ReplicaFigures {
        sellers,
        warmup_sellers: first.0,
        messages: published,
        registered: stats.registered,
        duplicates: stats.duplicates,
        violations: stats.violations,
        rss_delta_per_seller_bytes: (last.1 as f64 - first.1 as f64) * 1024.0
            / (last.0 - first.0).max(1) as f64,
        rss_kib: rss,
    })
}

/// Publishes 2 registrations for each seller in `sellers` (confirmed); returns how many.
async fn publish(
    publisher: &turnstile_core::broker::Publisher,
    queue: &str,
    sellers: std::ops::Range<usize>,
) -> anyhow::Result<u64> {
    let messages = sellers.flat_map(|s| [(s, 0), (s, 1)]);
    let count = messages.clone().count() as u64;
    futures::stream::iter(messages)
        .map(|(s, m)| async move {
            let body = registration_body(
                message(s, m).as_str(),
                seller(s).as_str(),
                Some("products-0123abcd"),
                serde_json::json!({"sku": m}),
            );
            let properties =
                BasicProperties::default().with_content_type("application/json".into());
            publisher
                .publish("", queue, &body, properties)
                .await
                .context("publishing a registration")
        })
        .buffer_unordered(256)
        .try_for_each(|()| async { Ok(()) })
        .await?;
    Ok(count)
}

fn print(args: &SellersArgs, s: &Summary) {
    println!(
        "{} sellers on {}; INFO used_memory growth / sellers; MEMORY USAGE: mean of {} state keys",
        s.sellers,
        s.redis,
        sample(s.sellers).count()
    );
    let many = format!("B/seller {}@{}", s.permits, s.limit);
    println!(
        "{:<16} {:>14} {:>16} {:>14} {:>14} {:>7} {:>22}",
        "algorithm",
        "B/seller 1",
        many,
        "MEMORY USAGE",
        "baseline SET B",
        "ratio",
        format!("keys {}: before→after", s.idle_limit)
    );
    for a in &s.algorithms {
        println!(
            "{:<16} {:>14.1} {:>16.1} {:>14.1} {:>14.1} {:>6.2}x {:>22}",
            a.algorithm,
            a.bytes_per_seller_one_permit,
            a.bytes_per_seller,
            a.state_key_memory_usage,
            s.baseline_set_bytes,
            a.ratio_to_baseline,
            format!("{}→{}", a.keys_before_idle, a.keys_after_idle)
        );
    }
    let c = &s.completion;
    println!(
        "{:<16} {:>14} {:>16.1} {:>14.1} {:>14.1} {:>6.2}x {:>22}",
        "completion rec.",
        "-",
        c.bytes_per_record,
        c.done_key_memory_usage,
        s.baseline_set_bytes,
        c.ratio_to_baseline,
        format!("{} stay (TTL)", c.records_after_idle)
    );
    println!(
        "completion records: {} ({} per seller, one upload each), {:.1} B each (done key MEMORY USAGE {:.0} B, upload hash {:.0} B per seller); {:.0} s of TTL left after idle; 10k sellers x 500 messages = {:.0} MiB for {}",
        c.records,
        args.messages_per_seller.max(1),
        c.bytes_per_record,
        c.done_key_memory_usage,
        c.batch_key_memory_usage,
        c.ttl_left_s,
        c.projected_bytes_10k_sellers_x_500 / 1048576.0,
        format_duration(args.done_ttl)
    );
    let reclaimed = match (
        s.idle.stale_keys_after_wait,
        s.idle.stale_keys_after_scan,
        s.idle.bytes_left_per_seller,
    ) {
        (Some(wait), Some(scan), Some(left)) => format!(
            "; expired but not yet reclaimed by active expiry (DBSIZE): {wait}, after SCAN: {scan}; used_memory left: {left:.1} B per seller"
        ),
        _ => String::new(),
    };
    println!(
        "idle: limiter keys counted {:.1} s after the last permit at {}{reclaimed}",
        s.idle.waited_s, s.idle_limit
    );
    if let Some(r) = &s.replica {
        println!(
            "replica (in-process, 16 workers; mock downstream in a child process): {} sellers x 2 messages, {} registered, {} duplicates, {} violations",
            r.sellers, r.registered, r.duplicates, r.violations
        );
        println!(
            "{:>16} {:>12} {:>16}",
            "sellers served", "VmRSS KiB", "Δ since warm-up"
        );
        let first = r.rss_kib[0];
        for &(served, kib) in &r.rss_kib {
            println!(
                "{:>16} {:>12} {:>+15}K",
                served,
                kib,
                kib as i64 - first.1 as i64
            );
        }
        println!(
            "replica VmRSS growth per seller after the warm-up: {:+.1} B",
            r.rss_delta_per_seller_bytes
        );
    }
    if args.json {
        match serde_json::to_string(s) {
            Ok(json) => println!("{json}"),
            Err(error) => eprintln!("turnstile: cannot print the summary as JSON: {error}"),
        }
    }
}

/// The Redis being measured: a private `redis-server`, or the one(s) named by `--redis-url`.
struct Target {
    conn: RedisConn,
    /// One connection per node named, for INFO and DBSIZE (a cluster's figures are summed).
    nodes: Vec<RedisConn>,
    url: String,
    shown: String,
    /// Flushed between measurements when it is ours.
    private: Option<LocalRedis>,
}

fn redis_args(url: &str) -> RedisArgs {
    RedisArgs {
        url: url.to_owned(),
        cluster: false,
        key_prefix: "turnstile".into(),
    }
}

impl Target {
    async fn open(url: Option<&str>) -> anyhow::Result<Self> {
        let (private, url) = match url {
            Some(url) => (None, url.to_owned()),
            None => {
                let redis = LocalRedis::start()?;
                let url = redis.url();
                (Some(redis), url)
            }
        };
        let conn = RedisConn::connect(&redis_args(&url)).await?;
        let mut nodes = Vec::new();
        for node in url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            nodes.push(RedisConn::connect(&redis_args(node)).await?);
        }
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut nodes[0].clone())
            .await
            .context("INFO server")?;
        let version = info_field(&info, "redis_version").unwrap_or("?");
        let shown = match &private {
            Some(_) => format!("a private redis-server {version} ({url})"),
            None if nodes.len() > 1 => format!(
                "Redis Cluster {version} ({}; shared: other clients' writes count too)",
                redact_url(&url)
            ),
            None => format!(
                "Redis {version} ({}; shared: other clients' writes count too)",
                redact_url(&url)
            ),
        };
        Ok(Self {
            conn,
            nodes,
            url,
            shown,
            private,
        })
    }

    /// INFO used_memory, summed over the nodes, once in-flight buffers have settled.
    async fn used_memory(&self) -> anyhow::Result<u64> {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut total = 0;
        for node in &self.nodes {
            let info: String = redis::cmd("INFO")
                .arg("memory")
                .query_async(&mut node.clone())
                .await
                .context("INFO memory")?;
            total += info_field(&info, "used_memory")
                .and_then(|v| v.parse::<u64>().ok())
                .context("no used_memory in INFO memory")?;
        }
        Ok(total)
    }

    /// DBSIZE summed over the nodes (expired keys not yet reclaimed included).
    async fn dbsize(&self) -> anyhow::Result<u64> {
        let mut total = 0;
        for node in &self.nodes {
            let n: u64 = redis::cmd("DBSIZE")
                .query_async(&mut node.clone())
                .await
                .context("DBSIZE")?;
            total += n;
        }
        Ok(total)
    }

    /// Empties a private Redis (its dictionaries shrink too); elsewhere deletes `prefix:*`.
    async fn clear(&self, prefix: &str) -> anyhow::Result<()> {
        if self.private.is_some() {
            let () = redis::cmd("FLUSHALL")
                .arg("SYNC")
                .query_async(&mut self.conn.clone())
                .await
                .context("FLUSHALL")?;
            Ok(())
        } else {
            delete_prefix(&self.conn, prefix).await
        }
    }

    /// Deletes every key this run wrote on a shared Redis (a private one just stops).
    async fn cleanup(&self, base: &str) -> anyhow::Result<()> {
        if self.private.is_some() {
            return Ok(());
        }
        for prefix in std::iter::once(base.to_owned()).chain(
            Algorithm::ALL
                .iter()
                .map(|a| format!("{base}-idle-{}", a.name())),
        ) {
            delete_prefix(&self.conn, &prefix)
                .await
                .with_context(|| format!("deleting {prefix}:*"))?;
        }
        Ok(())
    }
}

fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// Loads every script once, so that no measurement counts the script cache.
async fn warm_scripts(target: &Target, base: &str) -> anyhow::Result<()> {
    for algorithm in Algorithm::ALL {
        let limit = Limit::new(1, Duration::from_secs(1)).expect("a valid limit");
        take(
            &limiter_store(&target.conn, base, limit, algorithm),
            &seller(0),
            1,
        )
        .await?;
    }
    limiter_store(
        &target.conn,
        base,
        Limit::new(1, Duration::from_secs(1)).expect("valid"),
        Algorithm::SlidingWindow,
    )
    .complete(
        &seller(0),
        &message(0, 0),
        None,
        Completion::Registered,
        Duration::from_secs(1),
    )
    .await
    .context("writing a completion record")?;
    target.clear(base).await
}

/// Clears `prefix`, runs `op(0..n)` and returns the growth of INFO used_memory divided by `n`.
async fn bytes_per<F, Fut>(
    target: &Target,
    prefix: &str,
    n: usize,
    concurrency: usize,
    op: F,
) -> anyhow::Result<f64>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    target.clear(prefix).await?;
    let before = target.used_memory().await?;
    for_each(n, concurrency, op).await?;
    let after = target.used_memory().await?;
    Ok((after as f64 - before as f64) / n as f64)
}

/// Runs `op(0..n)`, `concurrency` at a time.
async fn for_each<F, Fut>(n: usize, concurrency: usize, op: F) -> anyhow::Result<()>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    futures::stream::iter(0..n)
        .map(op)
        .buffer_unordered(concurrency)
        .try_for_each(|()| async { Ok(()) })
        .await
}

/// fixed-window: its keys expire at the end of the calendar window, so a measurement that
/// crossed a window edge would see them go. Waits for the next window when less than half of
/// this one (at most 15 s) is left.
async fn fresh_window(store: &PermitStore, algorithm: Algorithm) -> anyhow::Result<()> {
    if algorithm != Algorithm::FixedWindow {
        return Ok(());
    }
    let window = store.default_limit().shortest_window().as_micros() as i64;
    let now = store.admin().redis_time_us().await.context("Redis TIME")?;
    let left = window - now.rem_euclid(window);
    if left < (window / 2).min(15_000_000) {
        eprintln!(
            "  fixed-window: waiting {:.1} s for the next window",
            left as f64 / 1e6
        );
        tokio::time::sleep(Duration::from_micros(left as u64 + 100_000)).await;
    }
    Ok(())
}

/// Takes `permits` permits for the seller, one after the other (waiting callers reserve).
async fn take(store: &PermitStore, seller: &SellerId, permits: u32) -> anyhow::Result<()> {
    for _ in 0..permits {
        store
            .ask(Ask::new(seller))
            .await
            .with_context(|| format!("acquiring a permit for {seller}"))?;
    }
    Ok(())
}

/// A permit store at `limit`. `redis_durable`: a private Redis is younger than a window, and
/// the cold-start rule would then write a pause key for every new seller, which a Redis that
/// has been up longer than a window never does.
fn limiter_store(
    conn: &RedisConn,
    prefix: &str,
    limit: Limit,
    algorithm: Algorithm,
) -> PermitStore {
    PermitStore::new(
        conn.clone(),
        prefix,
        LimiterArgs {
            redis_durable: true,
            ..LimiterArgs::new(limit, algorithm)
        },
    )
}

/// Mean `MEMORY USAGE … SAMPLES 0` (exact) of the keys that exist.
async fn mean_usage(conn: &RedisConn, keys: impl Iterator<Item = String>) -> anyhow::Result<f64> {
    let (mut total, mut count) = (0u64, 0u64);
    for key in keys {
        let usage = turnstile_core::permit::memory_usage(conn, &key)
            .await
            .with_context(|| format!("MEMORY USAGE {key}"))?;
        if let Some(usage) = usage {
            total += usage;
            count += 1;
        }
    }
    anyhow::ensure!(count > 0, "none of the sampled keys exists");
    Ok(total as f64 / count as f64)
}

/// Up to 100 seller indexes spread over `0..n`.
fn sample(n: usize) -> impl Iterator<Item = usize> {
    (0..n).step_by((n / 100).max(1)).take(100)
}

fn seller(i: usize) -> SellerId {
    SellerId::parse(&format!("S-{i:05}")).expect("a valid seller id")
}

/// A message id shaped like `turnstile publish`'s: `u-` and 32 hex digits.
fn message(seller: usize, m: usize) -> MessageId {
    MessageId::parse(&format!("u-{seller:016x}{m:016x}")).expect("a valid message id")
}

/// This process's resident memory (VmRSS), in KiB.
fn rss_kib() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("reading /proc/self/status (the replica step needs Linux)")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in /proc/self/status")
}

/// `turnstile mock-api` as a child process of this executable, on a free port.
struct MockChild {
    child: Child,
    url: String,
    /// Kept open so that the child never writes into a closed pipe.
    _stdout: Lines<BufReader<ChildStdout>>,
}

impl MockChild {
    async fn start(limit: Limit) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("finding this executable")?;
        let mut child = tokio::process::Command::new(exe)
            .args(["mock-api", "--addr", "127.0.0.1:0", "--limit"])
            .arg(limit.to_string())
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting `turnstile mock-api` as a child process")?;
        let mut lines = BufReader::new(child.stdout.take().context("the mock's stdout")?).lines();
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .context("the mock API did not start within 10 s")??
            .context("the mock API exited at start")?;
        let url = line
            .strip_prefix("mock registration API on ")
            .with_context(|| format!("unexpected first line from mock-api: {line:?}"))?
            .trim()
            .to_owned();
        Ok(Self {
            child,
            url,
            _stdout: lines,
        })
    }

    async fn stop(&mut self) {
        let _ = self.child.kill().await;
    }
}
