//! `turnstile bench supersede`: superseded rows against the real broker, Redis and a strict mock.
//!
//! 1. The corrected upload: one seller's `--rows` rows at `--limit`, and the same rows corrected
//!    (version 2) published once `--corrected-after` are registered; run without `product_key`
//!    and then with it. Prints the downstream calls, when the last registration came (the
//!    corrected upload's completion), the rows final (registered or dead-lettered: each has its
//!    result) and how many products the API holds at version 2.
//! 2. The update burst: `--updates` updates (versions 1 to N) of each of `--products` products
//!    of one seller at `--burst-limit`, published at once with `product_key` and `version`.
//!    Prints the calls per product and whether the API holds each product's last version.

use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use crate::rig::{Message, Rig, RigArgs};
use turnstile_core::config::{Algorithm, LimiterArgs, Limits};

#[derive(Args, Debug)]
pub struct SupersedeArgs {
    #[command(flatten)]
    pub rig: RigArgs,
    /// The seller's limit, and the strict mock's.
    #[arg(long, default_value = "20/1s", value_parser = turnstile_core::config::limits_arg)]
    pub limit: Limits,
    /// Rows of the upload (and of its correction).
    #[arg(long, default_value_t = 500)]
    pub rows: usize,
    /// Registrations after which the corrected upload is published.
    #[arg(long, default_value_t = 100)]
    pub corrected_after: u64,
    /// Replicas sharing the queue.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Workers per replica.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// The limit of the update burst.
    #[arg(long, default_value = "5/1s", value_parser = turnstile_core::config::limits_arg)]
    pub burst_limit: Limits,
    /// Products of the update burst.
    #[arg(long, default_value_t = 10)]
    pub products: usize,
    /// Updates of each product in the burst.
    #[arg(long, default_value_t = 50)]
    pub updates: usize,
}

const SELLER: &str = "S-up";

/// Row `i` of upload `upload` (`old`, version 1; `new`, version 2), naming its product when
/// `keyed`.
fn row(upload: &str, i: usize, version: i64, keyed: bool) -> Message {
    let sku = format!("P-{i}");
    let mut body = json!({
        "message_id": format!("{upload}-{i}"),
        "seller_id": SELLER,
        "batch_id": upload,
        "product": {"sku": sku, "version": version},
    });
    if keyed {
        body["product_key"] = sku.into();
        body["version"] = version.into();
    }
    Message {
        seller: SELLER.to_owned(),
        body: serde_json::to_vec(&body).expect("a body"),
    }
}

/// One run's figures.
struct Run {
    calls: u64,
    registered: u64,
    dead: u64,
    violations: u64,
    duplicates: u64,
    last_s: f64,
    latest_held: usize,
    products: usize,
    lost: u64,
}

async fn rig(args: &SupersedeArgs, what: &str, limit: &Limits) -> anyhow::Result<Rig> {
    let limiter = LimiterArgs::new(limit.clone(), Algorithm::SlidingWindow);
    let settings = args
        .rig
        .replica_settings(what, limiter, args.workers, Duration::from_secs(2));
    Rig::build(settings)
        .with_api_limit(limit.clone())
        .start(args.replicas)
        .await
}

/// The seller's figures once every row is final.
async fn settled(
    rig: Rig,
    limit: &Limits,
    rows: u64,
    latest: impl Fn(&str, i64) -> bool,
) -> anyhow::Result<Run> {
    rig.wait(
        limit.optimum_drain(rows) * 3 + Duration::from_secs(60),
        |_| {},
    )
    .await?;
    let stats = rig.mock.stats();
    let seller = stats.sellers.get(SELLER).cloned().unwrap_or_default();
    let latest_held = seller
        .versions
        .iter()
        .filter(|(sku, v)| latest(sku, **v))
        .count();
    let report = rig.finish().await?;
    Ok(Run {
        calls: stats.requests,
        registered: report.registered,
        dead: report.dead_lettered,
        violations: report.violations,
        duplicates: report.duplicates,
        last_s: report
            .sellers
            .get(SELLER)
            .and_then(|s| s.last_s)
            .unwrap_or(0.0),
        latest_held,
        products: seller.versions.len(),
        lost: report.lost,
    })
}

async fn corrected(args: &SupersedeArgs, keyed: bool) -> anyhow::Result<Run> {
    let mut rig = rig(args, "supersede", &args.limit).await?;
    rig.publish_all((0..args.rows).map(|i| row("old", i, 1, keyed)).collect())
        .await?;
    let patience = Instant::now() + args.limit.optimum_drain(args.rows as u64 * 2) * 3;
    while rig.mock.stats().registered < args.corrected_after && Instant::now() < patience {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rig.publish_all((0..args.rows).map(|i| row("new", i, 2, keyed)).collect())
        .await?;
    settled(rig, &args.limit, 2 * args.rows as u64, |_, v| v == 2).await
}

async fn burst(args: &SupersedeArgs) -> anyhow::Result<Run> {
    let mut rig = rig(args, "supersede-burst", &args.burst_limit).await?;
    let mut messages = Vec::new();
    for update in 1..=args.updates {
        for product in 0..args.products {
            let sku = format!("P-{product}");
            let body = json!({
                "message_id": format!("{sku}-v{update}"),
                "seller_id": SELLER,
                "product_key": sku,
                "version": update,
                "product": {"sku": sku, "version": update},
            });
            messages.push(Message {
                seller: SELLER.to_owned(),
                body: serde_json::to_vec(&body)?,
            });
        }
    }
    rig.publish_all(messages).await?;
    let last = args.updates as i64;
    settled(
        rig,
        &args.burst_limit,
        (args.updates * args.products) as u64,
        |_, v| v == last,
    )
    .await
}

/// Runs both parts; `Ok(false)` when a row was lost, registered twice or over the limit.
pub async fn run(args: SupersedeArgs) -> anyhow::Result<bool> {
    let rows = 2 * args.rows as u64;
    eprintln!(
        "supersede: {} rows of one seller at {}, corrected when {} are registered; {} replicas x {} workers",
        args.rows, args.limit, args.corrected_after, args.replicas, args.workers
    );
    let plain = corrected(&args, false).await?;
    let keyed = corrected(&args, true).await?;
    println!(
        "\nthe corrected upload: {} rows at {}, corrected after {} registrations",
        args.rows, args.limit, args.corrected_after
    );
    println!(
        "  {:<20} {:>6} {:>11} {:>11} {:>11} {:>9} {:>10} {:>9}",
        "", "calls", "registered", "superseded", "last call", "final", "latest v2", "over/dup"
    );
    for (name, run) in [
        ("without product_key", &plain),
        ("with product_key", &keyed),
    ] {
        println!(
            "  {name:<20} {:>6} {:>11} {:>11} {:>10.1}s {:>9} {:>6}/{:<3} {:>4}/{}",
            run.calls,
            run.registered,
            run.dead,
            run.last_s,
            run.registered + run.dead,
            run.latest_held,
            run.products,
            run.violations,
            run.duplicates
        );
    }
    println!(
        "  with product_key: {:.2}x the calls, the corrected upload done {:.0}% sooner ({:.1}s against {:.1}s)",
        keyed.calls as f64 / plain.calls.max(1) as f64,
        100.0 * (1.0 - keyed.last_s / plain.last_s.max(f64::MIN_POSITIVE)),
        keyed.last_s,
        plain.last_s
    );
    let bursted = burst(&args).await?;
    let updates = (args.updates * args.products) as u64;
    println!(
        "\nthe update burst: {} updates of each of {} products at {}",
        args.updates, args.products, args.burst_limit
    );
    println!(
        "  {} calls for {updates} updates ({:.1} per product), {} superseded; the API holds the last version of {} of {} products; {} over the limit, {} duplicates",
        bursted.calls,
        bursted.calls as f64 / args.products.max(1) as f64,
        bursted.dead,
        bursted.latest_held,
        args.products,
        bursted.violations,
        bursted.duplicates
    );
    let sound = |run: &Run, total: u64| {
        run.lost == 0
            && run.violations == 0
            && run.duplicates == 0
            && run.registered + run.dead == total
    };
    let ok = sound(&plain, rows)
        && sound(&keyed, rows)
        && sound(&bursted, updates)
        && keyed.latest_held == args.rows
        && bursted.latest_held == args.products;
    if !ok {
        println!(
            "\nFAILED: a row lost, registered twice, over the limit, or a product's last version not held"
        );
    }
    Ok(ok)
}
