//! One seller's flood of priority messages on top of its own backlog, beside the same backlog
//! without the flood: what the other sellers' permits and a bare PING wait meanwhile, and what
//! the acquire scripts cost Redis (`INFO commandstats`). Every message acts as a replica's does:
//! it acquires (reserving, with its rank), waits for its slot, comes back for it (told a later
//! one when it was moved), and ends its call at once. The commands of 10 ms or more are counted
//! from the slow log (set `slowlog-log-slower-than` to 10000 or less, and `slowlog-max-len`
//! large enough, on a Redis of the bench's own).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;

use turnstile_core::config::{Algorithm, Limit, LimiterArgs, RedisArgs};
use turnstile_core::domain::{Priority, SellerId};
use turnstile_core::permit::{
    Ask, Decision, Ended, Grant, Limiter, PermitStore, Rank, RedisConn, Reservation, delete_prefix,
};

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
    /// Messages published at once on top, with a deadline an hour away.
    #[arg(long, default_value_t = 1500)]
    flood: u64,
    /// The flood's priority (0 to 9; 0 and no deadline: a plain flood, to compare with).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u8).range(0..=9))]
    flood_priority: u8,
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

/// Latencies measured by tasks that may still wait for an answer when the measure ends: each
/// finished one is a sample, and so is the wait so far of each unanswered one (a lower bound).
#[derive(Clone, Default)]
struct Samples {
    done: Arc<Mutex<Vec<Duration>>>,
    waiting: Arc<Mutex<Vec<Option<Instant>>>>,
}

impl Samples {
    /// Runs `ask` again and again from a task of its own (`worker`), timing each.
    fn run<F, Fut>(&self, worker: usize, ask: F) -> tokio::task::JoinHandle<anyhow::Result<()>>
    where
        F: Fn(usize) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
    {
        self.waiting.lock().expect("not poisoned").push(None);
        let samples = self.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let t = Instant::now();
                samples.waiting.lock().expect("not poisoned")[worker] = Some(t);
                ask(i).await?;
                samples.waiting.lock().expect("not poisoned")[worker] = None;
                samples.done.lock().expect("not poisoned").push(t.elapsed());
            }
            Ok(())
        })
    }

    /// The samples so far, the unanswered ones' waits included.
    fn take(&self) -> Latencies {
        let mut all = self.done.lock().expect("not poisoned").clone();
        all.extend(
            self.waiting
                .lock()
                .expect("not poisoned")
                .iter()
                .flatten()
                .map(|t| t.elapsed()),
        );
        all.sort_unstable();
        Latencies(all)
    }
}

/// Ends `tasks`, and says the first error one of them met.
async fn end(tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>) -> anyhow::Result<()> {
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        match task.await {
            Ok(done) => done?,
            Err(e) if e.is_cancelled() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The other sellers' acquires (each granted call ended at once) and PINGs, for `duration`.
async fn watch(
    store: Arc<PermitStore>,
    conn: RedisConn,
    others: usize,
    duration: Duration,
) -> anyhow::Result<(Latencies, Latencies)> {
    let (acquires, pings) = (Samples::default(), Samples::default());
    let mut tasks = Vec::new();
    for worker in 0..others {
        let store = store.clone();
        tasks.push(acquires.run(worker, move |i| {
            let store = store.clone();
            let seller = SellerId::parse(&format!("S-other-{}", (worker + i * others) % 500));
            async move {
                let seller = seller.expect("valid");
                let ask = Ask::new(&seller).without_reserving();
                let asked = store.ask(ask).await?;
                if let Some(grant) = Grant::of(ask, &asked.decision, asked.cost) {
                    answer(&store, &grant).await?;
                }
                Ok(())
            }
        }));
    }
    tasks.push(pings.run(0, move |_| {
        let mut conn = conn.clone();
        async move {
            let _: String = redis::cmd("PING").query_async(&mut conn).await?;
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(())
        }
    }));
    tokio::time::sleep(duration).await;
    let measured = (acquires.take(), pings.take());
    end(tasks).await?;
    Ok(measured)
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
        let ask = Ask::new(&seller).held(held.as_ref()).rank(rank);
        let asked = store.ask(ask).await?;
        match asked.decision {
            Decision::Granted { .. } => {
                let place = grants.fetch_add(1, Ordering::Relaxed);
                if rank.priority.get() > 0 || rank.deadline_ms.is_some() {
                    places.lock().expect("not poisoned").push(place);
                }
                if let Some(grant) = Grant::of(ask, &asked.decision, asked.cost) {
                    answer(&store, &grant).await?;
                }
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

/// The id of the latest entry of Redis's slow log (-1 if none).
async fn slowlog_mark(conn: &RedisConn) -> anyhow::Result<i64> {
    let mut conn = conn.clone();
    let latest: Vec<Vec<redis::Value>> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(1)
        .query_async(&mut conn)
        .await?;
    Ok(latest
        .first()
        .and_then(|e| e.first())
        .and_then(|id| redis::from_redis_value_ref::<i64>(id).ok())
        .unwrap_or(-1))
}

/// The slow log's entries after `mark` that took at least 10 ms (but the bench's own SLOWLOG): how many, and the longest (ms).
async fn slow_since(conn: &RedisConn, mark: i64) -> anyhow::Result<(usize, f64)> {
    let mut conn = conn.clone();
    let entries: Vec<Vec<redis::Value>> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(100_000)
        .query_async(&mut conn)
        .await?;
    let (mut n, mut longest) = (0, 0.0_f64);
    for entry in entries {
        let int = |i: usize| {
            entry
                .get(i)
                .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok())
        };
        let command = entry
            .get(3)
            .and_then(|args| redis::from_redis_value_ref::<Vec<String>>(args).ok())
            .and_then(|args| args.into_iter().next())
            .unwrap_or_default();
        if let (Some(id), Some(us)) = (int(0), int(2))
            && id > mark
            && us >= 10_000
            && !command.eq_ignore_ascii_case("slowlog")
        {
            n += 1;
            longest = longest.max(us as f64 / 1000.0);
        }
    }
    Ok((n, longest))
}

/// Script calls and their µs in Redis (EVALSHA and EVAL), so far.
async fn script_time(conn: &RedisConn) -> anyhow::Result<(u64, u64)> {
    let calls = command_calls(conn).await?;
    Ok(["evalsha", "eval"]
        .iter()
        .filter_map(|c| calls.by_command.get(*c))
        .fold((0, 0), |(n, us), (c, u)| (n + c, us + u)))
}

/// What one phase measured.
struct Phase {
    acquires: Latencies,
    pings: Latencies,
    /// Script calls and their µs in Redis.
    scripts: u64,
    script_us: u64,
    /// Commands of at least 10 ms in the slow log: how many, and the longest (ms).
    slow: (usize, f64),
}

/// One phase on a seller of its own: its backlog, then `flood` priority messages on top, while
/// the other sellers' acquires and PING are measured for the phase's duration.
async fn phase(
    args: &GiveWayArgs,
    conn: &RedisConn,
    store: &Arc<PermitStore>,
    seller: &str,
    flood: u64,
) -> anyhow::Result<Phase> {
    let seller = SellerId::parse(seller).expect("valid");
    let grants = Arc::new(AtomicU64::new(0));
    let places = Arc::new(Mutex::new(Vec::new()));
    let spawn = |priority: u8| {
        // A plain message has no deadline either.
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
    let (calls0, us0) = script_time(conn).await?;
    let mark = slowlog_mark(conn).await?;
    let watcher = tokio::spawn(watch(
        store.clone(),
        conn.clone(),
        args.others,
        args.duration,
    ));
    let first = grants.load(Ordering::Relaxed);
    for _ in 0..flood {
        tasks.push(spawn(args.flood_priority));
    }
    let (acquires, pings) = watcher.await??;
    let (calls1, us1) = script_time(conn).await?;
    let slow = slow_since(conn, mark).await?;
    end(tasks).await?;
    if flood > 0 && args.flood_priority > 0 {
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
    Ok(Phase {
        acquires,
        pings,
        scripts: calls1 - calls0,
        script_us: us1 - us0,
        slow,
    })
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
        "{}: {} plain messages of one seller waiting at {}, then {} of priority {}; {} others' \
         callers; {:?} each phase",
        algorithm.name(),
        args.backlog,
        args.limit,
        args.flood,
        args.flood_priority,
        args.others,
        args.duration
    );
    let mut config = conn.clone();
    let slower_than: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("slowlog-log-slower-than")
        .query_async(&mut config)
        .await?;
    if slower_than.get(1).and_then(|v| v.parse::<i64>().ok()) > Some(10_000) {
        println!("  (the slow log keeps only commands over {slower_than:?} µs)");
    }
    println!(
        "  {:<34} {:>8} {:>9} {:>9} {:>9}",
        "", "n", "p50 ms", "p99 ms", "max ms"
    );
    let report = |name: &str, phase: Phase| {
        phase.acquires.row(&format!("others' acquire, {name}"));
        phase.pings.row(&format!("PING, {name}"));
        println!(
            "  scripts, {name}: {} calls, {:.1} µs each on average; {} commands of 10 ms or more \
             in the slow log (longest {:.1} ms)",
            phase.scripts,
            phase.script_us as f64 / phase.scripts.max(1) as f64,
            phase.slow.0,
            phase.slow.1
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

/// Ends a granted call as answered now (a 2xx of no message): its place in the seller's calls
/// ends, as a consumer's would.
async fn answer(store: &PermitStore, grant: &Grant) -> anyhow::Result<()> {
    let answer = Ended::Registered {
        told: None,
        batch: None,
        ttl: Duration::ZERO,
        result: None,
    };
    store.finish(grant, grant.answered_us(), answer).await?;
    Ok(())
}
