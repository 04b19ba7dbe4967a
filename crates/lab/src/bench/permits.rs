//! Permit throughput and latency per algorithm, beside a plain Redis round trip (INCR).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use redis::AsyncCommands;

use turnstile_core::config::{Algorithm, GlobalLimit, Limit, LimiterArgs, Limits, RedisArgs};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{Ask, Decision, Keyspace, Limiter, PermitStore, RedisConn};

struct Figures {
    ops_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
}

/// Runs `op` from `concurrency` tasks for `duration`; returns rate and latency.
async fn measure<F, Fut>(concurrency: usize, duration: Duration, op: F) -> anyhow::Result<Figures>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut i = worker;
            while Instant::now() < deadline {
                let t = Instant::now();
                op(i).await?;
                samples.push(t.elapsed());
                i += concurrency;
            }
            anyhow::Ok(samples)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    let elapsed = start.elapsed().as_secs_f64();
    all.sort_unstable();
    Ok(Figures {
        ops_per_sec: all.len() as f64 / elapsed,
        p50_us: percentile(&all, 0.5),
        p99_us: percentile(&all, 0.99),
    })
}

pub async fn run(
    redis: &RedisArgs,
    concurrency: usize,
    duration: Duration,
    sellers: usize,
    global: Limits,
) -> anyhow::Result<()> {
    let conn = RedisConn::connect(redis).await?;
    let prefix = format!("{}-bench-{:x}", redis.key_prefix, rand::random::<u32>());
    let sellers: Arc<Vec<SellerId>> = Arc::new(
        (0..sellers)
            .map(|i| SellerId::parse(&format!("bench-{i}")).unwrap())
            .collect(),
    );

    println!(
        "permits from one process: {concurrency} concurrent callers over {} sellers, {:?} each, limits out of the way",
        sellers.len(),
        duration
    );
    println!(
        "{:<26} {:>12} {:>10} {:>10} {:>12}",
        "operation", "ops/s", "p50 µs", "p99 µs", "vs INCR"
    );
    let baseline = {
        let conn = conn.clone();
        let keys = Keyspace::new(&prefix);
        let sellers = sellers.clone();
        measure(concurrency, duration, move |i| {
            let mut conn = conn.clone();
            let key = keys.lab_incr(&sellers[i % sellers.len()]);
            async move {
                let _: i64 = conn.incr(&key, 1).await?;
                Ok(())
            }
        })
        .await?
    };
    let row = |name: &str, f: &Figures| {
        println!(
            "{:<26} {:>12.0} {:>10.0} {:>10.0} {:>11.2}x",
            name,
            f.ops_per_sec,
            f.p50_us,
            f.p99_us,
            f.ops_per_sec / baseline.ops_per_sec
        )
    };
    row("INCR (baseline)", &baseline);
    // Without and with TURNSTILE_REDIS_DURABLE: the server stamp (INFO server, a GET and a
    // PEXPIRE in each script) is checked only without.
    for (algorithm, durable) in Algorithm::ALL
        .into_iter()
        .flat_map(|a| [(a, false), (a, true)])
    {
        let limiter = LimiterArgs {
            gcra_burst: 1_000_000,
            redis_durable: durable,
            ..LimiterArgs::new(
                Limit::new(1_000_000_000, Duration::from_secs(1)).unwrap(),
                algorithm,
            )
        };
        let store = PermitStore::new(conn.clone(), &prefix, limiter);
        let sellers = sellers.clone();
        let figures = measure(concurrency, duration, move |i| {
            let store = store.clone();
            let seller = sellers[i % sellers.len()].clone();
            async move {
                store.ask(Ask::new(&seller)).await.context("acquire")?;
                Ok(())
            }
        })
        .await?;
        let name = if durable {
            format!("{algorithm}, durable")
        } else {
            algorithm.name().to_owned()
        };
        row(&name, &figures);
    }
    // A consumer's whole permit (`Limiter::ask`), without and with the global limit: each
    // call of the latter also asks the global limit (one slot of its own on a Redis Cluster),
    // and a refusal gives the seller's grant back.
    for with_global in [false, true] {
        let limiter = LimiterArgs {
            global_limit: GlobalLimit(with_global.then(|| global.clone())),
            ..LimiterArgs::new(
                Limit::new(1_000_000_000, Duration::from_secs(1)).unwrap(),
                Algorithm::SlidingWindow,
            )
        };
        let store = PermitStore::new(conn.clone(), &prefix, limiter);
        let sellers = sellers.clone();
        let granted = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = granted.clone();
        let figures = measure(concurrency, duration, move |i| {
            let (store, counted) = (store.clone(), counted.clone());
            let seller = sellers[i % sellers.len()].clone();
            async move {
                let asked = store.ask(Ask::new(&seller)).await.context("ask")?;
                if matches!(asked.decision, Decision::Granted { .. }) {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(())
            }
        })
        .await?;
        let name = if with_global {
            format!("+ global {global}")
        } else {
            "sliding-window, whole".to_owned()
        };
        row(&name, &figures);
        let granted = granted.load(std::sync::atomic::Ordering::Relaxed) as f64;
        println!(
            "{:<26} {:>12.0} granted/s",
            "",
            granted / duration.as_secs_f64()
        );
    }
    cleanup(&conn, &prefix).await?;
    Ok(())
}

/// Deletes every key under `prefix` (SCAN + UNLINK on each node).
pub async fn cleanup(conn: &RedisConn, prefix: &str) -> anyhow::Result<()> {
    turnstile_core::permit::delete_prefix(conn, prefix).await
}

/// Latency percentiles of a sample, in microseconds.
fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}
