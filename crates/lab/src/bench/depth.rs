//! Redis memory of one seller against the depth of its backlog: every queued message asks for a
//! permit (reserving, as a replica does), and the seller's keys are weighed afterwards, beside
//! the smallest depth measured in the same run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::Context;

use turnstile_core::config::{Algorithm, Limit, LimiterArgs, RedisArgs};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{
    Ask, Decision, Limiter, PermitStore, RedisConn, delete_prefix, memory_of_prefix,
};

/// What one depth left in Redis.
struct Weighed {
    depth: u64,
    reserved: u64,
    told_to_come_back: u64,
    bytes: u64,
    secs: f64,
}

/// `depth` callers of one seller ask for a permit, `concurrency` at a time.
async fn weigh(
    conn: &RedisConn,
    prefix: &str,
    limiter: LimiterArgs,
    depth: u64,
    concurrency: u64,
) -> anyhow::Result<Weighed> {
    let store = Arc::new(PermitStore::new(conn.clone(), prefix, limiter));
    let seller = SellerId::parse("S-deep").expect("a valid seller id");
    let (reserved, far, next) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (store, seller) = (store.clone(), seller.clone());
        let (reserved, far, next) = (reserved.clone(), far.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < depth {
                match store.ask(Ask::new(&seller)).await?.decision {
                    Decision::Wait {
                        reservation: Some(_),
                        ..
                    } => reserved.fetch_add(1, Ordering::Relaxed),
                    Decision::Wait {
                        reservation: None, ..
                    } => far.fetch_add(1, Ordering::Relaxed),
                    _ => 0,
                };
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    let bytes = memory_of_prefix(conn, prefix).await?;
    delete_prefix(conn, prefix).await?;
    Ok(Weighed {
        depth,
        reserved: reserved.load(Ordering::Relaxed),
        told_to_come_back: far.load(Ordering::Relaxed),
        bytes,
        secs,
    })
}

/// Weighs one seller's Redis state at each depth for each algorithm and prints a table (and
/// JSON lines with `json`).
pub async fn run(
    redis: &RedisArgs,
    limit: Limit,
    depths: &[u64],
    concurrency: u64,
    json: bool,
) -> anyhow::Result<()> {
    let conn = RedisConn::connect(redis)
        .await
        .context("connecting to Redis")?;
    println!(
        "one seller at {limit}: Redis bytes of all its keys after N queued messages each asked for a permit (reserving)"
    );
    println!(
        "{:<15} {:>10} {:>9} {:>14} {:>12} {:>10} {:>8}",
        "algorithm", "depth", "reserved", "come back later", "bytes", "vs first", "secs"
    );
    for algorithm in Algorithm::ALL {
        let mut first = None;
        for &depth in depths {
            let prefix = format!("{}-depth-{:08x}", redis.key_prefix, rand::random::<u32>());
            let mut limiter = LimiterArgs::new(limit, algorithm);
            limiter.redis_durable = true;
            let w = weigh(&conn, &prefix, limiter, depth, concurrency).await?;
            let base = *first.get_or_insert(w.bytes.max(1));
            println!(
                "{:<15} {:>10} {:>9} {:>14} {:>12} {:>9.2}x {:>8.1}",
                algorithm.name(),
                w.depth,
                w.reserved,
                w.told_to_come_back,
                w.bytes,
                w.bytes as f64 / base as f64,
                w.secs
            );
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "algorithm": algorithm.name(), "limit": limit.to_string(),
                        "depth": w.depth, "reserved": w.reserved,
                        "told_to_come_back": w.told_to_come_back, "bytes": w.bytes,
                    })
                );
            }
        }
    }
    Ok(())
}
