//! `turnstile bench bulk`: bulk calls against the real broker, Redis and a strict mock that
//! answers each bulk call per row.
//!
//! 1. The seed's upload at test speed: one seller's `--rows` rows at `--limit` calls, sent one
//!    row per call and then `--max-rows` per call (`cost = "call"`). Prints the calls, the
//!    time from the first registration to the last and from the end of the publish to the
//!    last (the publish overlaps the calls), the rows registered (each with its result), the
//!    calls over the limit and the duplicates.
//! 2. Rows counted one by one (`cost = "row"`) at `--row-limit` units: the same figures, and
//!    the rows per second against the limit.

use std::time::Duration;

use clap::Args;
use serde_json::json;

use crate::mock_api::{BulkCount, MockArgs};
use crate::rig::{Message, Rig, RigArgs};
use turnstile_core::config::{Algorithm, LimiterArgs, Limits};

#[derive(Args, Debug)]
pub struct BulkArgs {
    #[command(flatten)]
    pub rig: RigArgs,
    /// The seller's limit in calls (part 1), and the strict mock's.
    #[arg(long, default_value = "20/1s", value_parser = turnstile_core::config::limits_arg)]
    pub limit: Limits,
    /// The seller's limit in rows (part 2, `cost = "row"`), and the strict mock's.
    #[arg(long, default_value = "100/1s", value_parser = turnstile_core::config::limits_arg)]
    pub row_limit: Limits,
    /// Rows of the upload.
    #[arg(long, default_value_t = 500)]
    pub rows: usize,
    /// Most rows per bulk call.
    #[arg(long, default_value_t = 50)]
    pub max_rows: usize,
    /// How long a bulk call waits for more rows once its first row holds a permit.
    #[arg(long, default_value = "200ms", value_parser = turnstile_core::config::duration_arg)]
    pub linger: Duration,
    /// Replicas sharing the queue.
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Workers per replica.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
}

const SELLER: &str = "S-bulk";

/// One run's figures.
struct Run {
    calls: u64,
    rows_in_calls: u64,
    registered: u64,
    violations: u64,
    duplicates: u64,
    max_in_window: u64,
    /// From the end of the publish to the last registration.
    last_s: f64,
    /// From the first registration to the last.
    drain_s: f64,
    lost: u64,
}

/// One run: `rows` rows of one seller at `limit`, in bulk calls counted as `count` (none: one
/// row per call).
async fn upload(args: &BulkArgs, limit: &Limits, count: Option<BulkCount>) -> anyhow::Result<Run> {
    let limiter = LimiterArgs::new(limit.clone(), Algorithm::SlidingWindow);
    let settings = args
        .rig
        .replica_settings("bulk", limiter, args.workers, Duration::from_secs(2));
    let mock = MockArgs {
        bulk: Some(count.unwrap_or(BulkCount::Call)),
        bulk_items: Some("items".into()),
        ..MockArgs::local(limit.clone())
    };
    let mut rig = Rig::build(settings).with_mock(mock).prepare().await?;
    let path = std::env::temp_dir().join(format!(
        "turnstile-bench-bulk-{:08x}.toml",
        rand::random::<u32>()
    ));
    let mut consume = rig.settings(args.workers);
    if let Some(count) = count {
        let cost = match count {
            BulkCount::Call => "call",
            BulkCount::Row => "row",
        };
        std::fs::write(
            &path,
            format!(
                "[default]\nbulk = {{ max_rows = {}, linger = \"{}ms\", cost = \"{cost}\", items = \"items\", id_field = \"message_id\" }}\n",
                args.max_rows,
                args.linger.as_millis()
            ),
        )?;
        consume.routes.file = Some(path.clone());
    }
    let started = async {
        for _ in 0..args.replicas {
            rig.start_replica(consume.clone()).await?;
        }
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_file(&path);
    started?;
    let rows = (0..args.rows)
        .map(|i| Message {
            seller: SELLER.to_owned(),
            body: serde_json::to_vec(&json!({
                "message_id": format!("row-{i}"), "seller_id": SELLER,
                "batch_id": "upload", "batch_size": args.rows,
                "product": {"sku": format!("P-{i}")},
            }))
            .expect("a body"),
        })
        .collect();
    rig.publish_all(rows).await?;
    rig.wait(
        limit.optimum_drain(args.rows as u64) * 3 + Duration::from_secs(60),
        |_| {},
    )
    .await?;
    let stats = rig.mock.stats();
    let seller = stats.sellers.get(SELLER).cloned().unwrap_or_default();
    let report = rig.finish().await?;
    Ok(Run {
        calls: stats.requests,
        rows_in_calls: if count.is_some() {
            stats.bulk_rows
        } else {
            stats.requests
        },
        registered: report.registered,
        violations: report.violations,
        duplicates: report.duplicates,
        max_in_window: seller.max_in_window,
        last_s: report
            .sellers
            .get(SELLER)
            .and_then(|s| s.last_s)
            .unwrap_or(0.0),
        drain_s: report
            .sellers
            .get(SELLER)
            .and_then(|s| s.drain_s)
            .unwrap_or(0.0),
        lost: report.lost,
    })
}

fn print_row(name: &str, run: &Run) {
    println!(
        "  {name:<24} {:>6} {:>8} {:>11} {:>10.2}s {:>10.2}s {:>11} {:>10} {:>4}/{}",
        run.calls,
        run.rows_in_calls,
        run.registered,
        run.drain_s,
        run.last_s,
        run.max_in_window,
        run.lost,
        run.violations,
        run.duplicates
    );
}

/// Runs both parts; `Ok(false)` when a row was lost, registered twice or over the limit.
pub async fn run(args: BulkArgs) -> anyhow::Result<bool> {
    eprintln!(
        "bulk: {} rows of one seller, {} replicas x {} workers, up to {} rows per call, linger {} ms",
        args.rows,
        args.replicas,
        args.workers,
        args.max_rows,
        args.linger.as_millis()
    );
    let single = upload(&args, &args.limit, None).await?;
    let calls = upload(&args, &args.limit, Some(BulkCount::Call)).await?;
    let rows = upload(&args, &args.row_limit, Some(BulkCount::Row)).await?;
    let header = || {
        println!(
            "  {:<24} {:>6} {:>8} {:>11} {:>11} {:>11} {:>11} {:>10} {:>9}",
            "",
            "calls",
            "rows",
            "registered",
            "first-last",
            "after pub",
            "most/window",
            "lost",
            "over/dup"
        )
    };
    println!(
        "\n{} rows at {} calls, cost = \"call\"",
        args.rows, args.limit
    );
    header();
    print_row("one row per call", &single);
    print_row(&format!("up to {} per call", args.max_rows), &calls);
    println!(
        "  bulk: {:.1}x fewer calls; the first to the last registration {:.2}s against {:.2}s",
        single.calls as f64 / calls.calls.max(1) as f64,
        calls.drain_s,
        single.drain_s
    );
    println!(
        "\n{} rows at {} units, cost = \"row\"",
        args.rows, args.row_limit
    );
    header();
    print_row(&format!("up to {} per call", args.max_rows), &rows);
    let per_s = args
        .row_limit
        .iter()
        .next()
        .map_or(0.0, |l| f64::from(l.count()) / l.window().as_secs_f64());
    println!(
        "  {:.1} rows per call; {:.0} rows/s after the first window's burst against a limit of {:.0}/s",
        rows.rows_in_calls as f64 / rows.calls.max(1) as f64,
        (args.rows as f64 - per_s) / rows.drain_s.max(f64::MIN_POSITIVE),
        per_s
    );
    let total = args.rows as u64;
    let sound = |run: &Run| {
        run.lost == 0 && run.violations == 0 && run.duplicates == 0 && run.registered == total
    };
    let ok = sound(&single) && sound(&calls) && sound(&rows);
    if !ok {
        println!("\nFAILED: a row lost, registered twice, or a call over the limit");
    }
    Ok(ok)
}
