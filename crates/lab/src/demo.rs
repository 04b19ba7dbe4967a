//! `turnstile demo`: the whole journey on the local RabbitMQ and Redis. A strict mock
//! registration API, several consumer replicas, and the example uploads of a few sellers, one
//! of them far bigger than its limit allows at once; live progress per seller, then a summary.
//! Everything runs in this process on queues and keys of its own, deleted at the end.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use turnstile_core::config::{Algorithm, Limit, LimiterArgs};
use turnstile_core::domain::{BatchId, SellerId};
use turnstile_ops::http::{Listen, parse_addr};
use turnstile_ops::serve::HttpArgs;

use crate::rig::{Message, Rig, RigArgs};
use turnstile_upload::upload::read_upload;

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Consumer replicas to run.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Workers per replica.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// The (time-compressed) per-seller limit of the mock API and the consumers.
    #[arg(long, default_value = "5/1s", value_parser = turnstile_core::config::limit_arg)]
    pub limit: Limit,
    /// The consumers' limiter algorithm.
    #[arg(long, value_enum, default_value_t = Algorithm::SlidingWindow)]
    pub algorithm: Algorithm,
    /// Where the example uploads are [default: ./examples, else the source tree's].
    #[arg(long)]
    pub examples: Option<PathBuf>,
    /// Print the summary as one JSON object on the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// Where the first replica serves the live dashboard (port 0 picks a free one), or `off`.
    #[arg(long, default_value = "127.0.0.1:0", value_parser = parse_addr)]
    pub dashboard: Listen,
    #[command(flatten)]
    pub rig: RigArgs,
}

fn examples_dir(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = given {
        return Ok(dir.to_owned());
    }
    let local = PathBuf::from("examples");
    if local.join("products.xlsx").exists() {
        return Ok(local);
    }
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    anyhow::ensure!(
        source.exists(),
        "no examples/ directory here; pass --examples DIR"
    );
    Ok(source)
}

/// The demo's uploads: (seller, file, batch).
const UPLOADS: &[(&str, &str, &str)] = &[
    ("S-1001", "products.xlsx", "spring-catalog"),
    ("S-1001", "products.csv", "summer-catalog"),
    ("S-2002", "products.jsonl", "new-arrivals"),
    ("S-3003", "products.jsonl", "restock"),
    ("S-4004", "products.jsonl", "first-upload"),
];

pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let dir = examples_dir(args.examples.as_deref())?;
    let mut messages = Vec::new();
    let mut per_seller: BTreeMap<String, u64> = BTreeMap::new();
    let mut uploads = Vec::new();
    for (seller, file, batch) in UPLOADS {
        let seller_id = SellerId::parse(seller).expect("demo sellers are valid");
        let batch_id = BatchId::parse(batch).expect("demo batches are valid");
        let upload = read_upload(&dir.join(file), &seller_id, Some(&batch_id), true)
            .with_context(|| format!("reading the example upload {file}"))?;
        *per_seller.entry(seller.to_string()).or_default() += upload.rows.len() as u64;
        uploads.push((seller_id, batch_id, upload.rows.len() as u64));
        messages.extend(upload.rows.into_iter().map(|row| Message {
            seller: seller.to_string(),
            body: row.body,
        }));
    }
    let limiter = LimiterArgs::new(args.limit, args.algorithm);
    let settings = args
        .rig
        .replica_settings("demo", limiter, args.workers, Duration::from_secs(2));
    eprintln!(
        "turnstile demo: strict mock API at {} per seller, {} replicas x {} workers, {} uploads from {}",
        args.limit,
        args.replicas,
        args.workers,
        UPLOADS.len(),
        dir.display()
    );
    let http = HttpArgs {
        http_addr: args.dashboard,
        http_token: None,
    };
    let mut rig = Rig::build(settings)
        .serving(http)
        .start(args.replicas)
        .await?;
    if let Some(addr) = rig.dashboard() {
        eprintln!("live dashboard while the demo runs: http://{addr}/");
    }
    let total = messages.len() as u64;
    rig.publish_all(messages).await?;
    eprintln!("published {total} registrations (confirmed); registering within the limit:");

    let bars = MultiProgress::new();
    let style =
        ProgressStyle::with_template("{prefix:>8} [{bar:40.green/white}] {pos:>3}/{len:3} {msg}")
            .expect("static template")
            .progress_chars("=> ");
    let seller_bars: BTreeMap<String, ProgressBar> = per_seller
        .iter()
        .map(|(seller, &n)| {
            let bar = bars.add(
                ProgressBar::new(n)
                    .with_style(style.clone())
                    .with_prefix(seller.clone()),
            );
            (seller.clone(), bar)
        })
        .collect();
    let biggest = per_seller.values().copied().max().unwrap_or(0);
    let optimum = args.limit.optimum_drain(biggest);
    rig.wait(optimum * 3 + Duration::from_secs(60), |stats| {
        for (seller, bar) in &seller_bars {
            let key = SellerId::parse(seller).expect("valid").header_value();
            let done = stats.sellers.get(&key).map_or(0, |s| s.registered);
            bar.set_position(done);
            if done >= bar.length().unwrap_or(0) {
                bar.finish_with_message("registered");
            } else {
                bar.set_message(format!(
                    "~{:.0}s left",
                    args.limit
                        .optimum_drain(bar.length().unwrap_or(0) - done)
                        .as_secs_f64()
                ));
            }
        }
    })
    .await?;
    for bar in seller_bars.values() {
        bar.finish();
    }
    let report = rig.finish().await?;

    let (big_seller, big) = report
        .sellers
        .iter()
        .max_by_key(|(_, s)| s.published)
        .map(|(k, v)| (k.clone(), v.clone()))
        .context("no sellers")?;
    let drain = big.drain_s.unwrap_or(f64::NAN);
    println!();
    println!("summary");
    println!(
        "  registered            {:>8} of {}",
        report.registered, report.published
    );
    println!("  lost                  {:>8}", report.lost);
    println!(
        "  duplicates            {:>8}   (downstream saw an Idempotency-Key twice)",
        report.duplicates
    );
    println!(
        "  violations            {:>8}   (requests over a seller's limit at the strict downstream)",
        report.violations
    );
    println!("  dead-lettered         {:>8}", report.dead_lettered);
    println!(
        "  deliveries/message    {:>8.2}",
        report.deliveries_per_message
    );
    println!(
        "  {big_seller} drained {} in {drain:.1}s; the limit allows no faster than {:.1}s ({:.2}x)",
        big.published,
        optimum.as_secs_f64(),
        drain / optimum.as_secs_f64().max(f64::EPSILON)
    );
    for (seller, s) in &report.sellers {
        if *seller != big_seller {
            println!(
                "  {seller} registered {} within {:.1}s of publishing",
                s.registered,
                s.last_s.unwrap_or(f64::NAN)
            );
        }
    }
    let ok = report.lost == 0 && report.violations == 0;
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        value["drain_s"] = drain.into();
        value["optimum_s"] = optimum.as_secs_f64().into();
        value["ok"] = ok.into();
        value
            .as_object_mut()
            .expect("a report is an object")
            .remove("sellers");
        println!("{value}");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
