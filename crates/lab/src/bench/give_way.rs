//! One seller's flood of priority messages on top of its own backlog, beside the same backlog
//! without the flood: what the other sellers' permits and a bare PING wait meanwhile, and what
//! the acquire scripts cost Redis (`INFO commandstats`). Every message acts as a replica's does:
//! it acquires (reserving, with its rank), waits for its slot, comes back for it (told a later
//! one when it was moved), and ends its call at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;

use turnstile_core::config::{Algorithm, Limit, LimiterArgs, RedisArgs};
use turnstile_core::domain::{Cost, Priority, SellerId};
use turnstile_core::permit::{Decision, PermitStore, Rank, RedisConn, Reservation, delete_prefix};

use super::commandstats::command_calls;

#[derive(Args, Debug)]
pub struct GiveWayArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// The flooding seller's limit (every seller's).
    #[arg(long, default_value = "200/1s", value_parser = turnstile_core::config::limit_arg)]
    limit: Limit,
    /// Plain messages of the flooding seller waiting before the flood.
    #[arg(long, default_value_t = 3000)]
    backlog: u64,
    /// Messages of priority 9 with a deadline an hour away, published at once on top.
    #[arg(long, default_value_t = 1500)]
    flood: u64,
    /// How long the other sellers' permits and PING are measured without the flood, and then
    /// with it.
    #[arg(long, default_value = "10s", value_parser = turnstile_core::config::duration_arg)]
    duration: Duration,
    /// Concurrent callers of the other sellers (each asks, then asks again at once).
    #[arg(long, default_value_t = 8)]
    others: usize,
    /// The algorithms to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "sliding-window,gcra")]
    algorithms: Vec<Algorithm>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Latencies (sorted) of one measured phase.
#[derive(Default)]
struct Latencies(Vec<Duration>);

impl Latencies {
    fn at(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i].as_secs_f64() * 1000.0
    }

    fn row(&self, name: &str) {
        println!(
            "  {name:<34} {:>8} {:>9.2} {:>9.2} {:>9.2}",
            self.0.len(),
            self.at(0.5),
            self.at(0.99),
            self.at(1.0)
        );
    }
}

/// The other sellers' acquires and PINGs, measured until `stop`.
async fn watch(
    store: Arc<PermitStore>,
    conn: RedisConn,
    others: usize,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(Latencies, Latencies)> {
    let mut tasks = Vec::new();
    for worker in 0..others {
        let (store, stop) = (store.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut i = worker;
            while !stop.load(Ordering::Relaxed) {
                let seller = SellerId::parse(&format!("S-other-{}", i % 500)).expect("valid");
                let t = Instant::now();
                let decision = store.acquire(&seller, false).await?;
                samples.push(t.elapsed());
                if let Decision::Granted { call, .. } = decision {
                    store.call_ended(&seller, &call, Cost::ONE, None).await?;
                }
                i += others;
            }
            anyhow::Ok(samples)
        }));
    }
    let pings = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut conn = conn;
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let _: String = redis::cmd("PING").query_async(&mut conn).await?;
                samples.push(t.elapsed());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            anyhow::Ok(samples)
        })
    };
    let mut acquires = Vec::new();
    for task in tasks {
        acquires.extend(task.await??);
    }
    let mut pings = pings.await??;
    acquires.sort_unstable();
    pings.sort_unstable();
    Ok((Latencies(acquires), Latencies(pings)))
}

/// One message of the flooding seller, as a replica serves it: acquires with `rank`, waits for
/// its slot, comes back for it until granted; a priority message's place among the seller's
/// grants goes into `places`.
async fn serve(
    store: Arc<PermitStore>,
    seller: SellerId,
    rank: Rank,
    grants: Arc<AtomicU64>,
    places: Arc<Mutex<Vec<u64>>>,
) -> anyhow::Result<()> {
    let mut held: Option<Reservation> = None;
    loop {
        let (decision, _) = store
            .acquire_or_redeem_ranked(&seller, None, Cost::ONE, held.as_ref(), Some(&rank))
            .await?;
        match decision {
            Decision::Granted { call, .. } => {
                let place = grants.fetch_add(1, Ordering::Relaxed);
                if rank.priority.get() > 0 {
                    places.lock().expect("not poisoned").push(place);
                }
                store.call_ended(&seller, &call, Cost::ONE, None).await?;
                return Ok(());
            }
            Decision::Wait {
                retry_after,
                reservation,
            } => {
                held = reservation;
                tokio::time::sleep(retry_after).await;
            }
            other => anyhow::bail!("unexpected decision {other:?}"),
        }
    }
}

/// Script calls and their µs in Redis (EVALSHA and EVAL), so far.
async fn script_time(conn: &RedisConn) -> anyhow::Result<(u64, u64)> {
    let calls = command_calls(conn).await?;
    Ok(["evalsha", "eval"]
        .iter()
        .filter_map(|c| calls.by_command.get(*c))
        .fold((0, 0), |(n, us), (c, u)| (n + c, us + u)))
}

/// One phase on a seller of its own: its backlog, then `flood` priority messages on top, while
/// the other sellers' acquires and PING are measured for the phase's duration.
async fn phase(
    args: &GiveWayArgs,
    conn: &RedisConn,
    store: &Arc<PermitStore>,
    seller: &str,
    flood: u64,
) -> anyhow::Result<(Latencies, Latencies, u64, u64)> {
    let seller = SellerId::parse(seller).expect("valid");
    let grants = Arc::new(AtomicU64::new(0));
    let places = Arc::new(Mutex::new(Vec::new()));
    let spawn = |priority: u8| {
        let deadline_ms = (priority > 0).then(|| now_ms() + 3_600_000);
        tokio::spawn(serve(
            store.clone(),
            seller.clone(),
            Rank {
                priority: Priority::from_amqp(Some(priority)),
                deadline_ms,
                arrival_ms: now_ms(),
            },
            grants.clone(),
            places.clone(),
        ))
    };
    let mut tasks = Vec::new();
    for i in 0..args.backlog {
        tasks.push(spawn(0));
        if i % 64 == 63 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (calls0, us0) = script_time(conn).await?;
    let watcher = tokio::spawn(watch(
        store.clone(),
        conn.clone(),
        args.others,
        stop.clone(),
    ));
    let first = grants.load(Ordering::Relaxed);
    for _ in 0..flood {
        tasks.push(spawn(9));
    }
    tokio::time::sleep(args.duration).await;
    stop.store(true, Ordering::Relaxed);
    let (acquires, pings) = watcher.await??;
    let (calls1, us1) = script_time(conn).await?;
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        match task.await {
            Ok(served) => served?,
            Err(e) if e.is_cancelled() => {}
            Err(e) => return Err(e.into()),
        }
    }
    if flood > 0 {
        let mut places: Vec<u64> = places
            .lock()
            .expect("not poisoned")
            .iter()
            .map(|p| p - first)
            .collect();
        places.sort_unstable();
        println!(
            "  flood: {} of {} granted within the phase, {} of the seller's grants in all; their \
             places among the seller's grants since the flood: first {:?}, median {:?}, last {:?}",
            places.len(),
            flood,
            grants.load(Ordering::Relaxed) - first,
            places.first(),
            places.get(places.len() / 2),
            places.last()
        );
    }
    Ok((acquires, pings, calls1 - calls0, us1 - us0))
}

/// Measures one algorithm: a backlog alone, then a backlog with the flood.
async fn measure(args: &GiveWayArgs, conn: &RedisConn, algorithm: Algorithm) -> anyhow::Result<()> {
    let prefix = format!(
        "{}-giveway-{:08x}",
        args.redis.key_prefix,
        rand::random::<u32>()
    );
    let limiter = LimiterArgs {
        permit_block: 0,
        redis_durable: true,
        adaptive: false,
        ..LimiterArgs::new(args.limit, algorithm)
    };
    let store = Arc::new(PermitStore::new(conn.clone(), &prefix, limiter));
    println!(
        "{}: {} plain messages of one seller waiting at {}; {} others' callers; {:?} each phase",
        algorithm.name(),
        args.backlog,
        args.limit,
        args.others,
        args.duration
    );
    println!(
        "  {:<34} {:>8} {:>9} {:>9} {:>9}",
        "", "n", "p50 ms", "p99 ms", "max ms"
    );
    let report = |name: &str, (acquires, pings, calls, us): (Latencies, Latencies, u64, u64)| {
        acquires.row(&format!("others' acquire, {name}"));
        pings.row(&format!("PING, {name}"));
        println!(
            "  scripts, {name}: {calls} calls, {:.1} µs each on average",
            us as f64 / calls.max(1) as f64
        );
    };
    report(
        "backlog alone",
        phase(args, conn, &store, "S-backlog", 0).await?,
    );
    report(
        "with the flood",
        phase(args, conn, &store, "S-flood", args.flood).await?,
    );
    delete_prefix(conn, &prefix).await?;
    Ok(())
}

pub async fn run(args: GiveWayArgs) -> anyhow::Result<()> {
    let conn = RedisConn::connect(&args.redis)
        .await
        .context("connecting to Redis")?;
    for &algorithm in &args.algorithms {
        measure(&args, &conn, algorithm).await?;
    }
    Ok(())
}
