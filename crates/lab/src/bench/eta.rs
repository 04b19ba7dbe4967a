//! `turnstile bench eta`: how honest a batch's ETA is. One seller uploads `--rows` messages of
//! one batch (`batch_id`, `batch_size`) at `--limit` to `--replicas` replicas against the strict
//! mock; `GET /api/batches/{id}` is read at 2, 5 and 10 s after the first message is published,
//! then every 30 s and at every 10% of the batch registered, until the batch is done or the
//! mock has registered every row. Each reading's predicted finish (its time + `eta_s`) is set
//! beside the real one (the mock's last registration of the seller): the error in seconds, as a
//! share of the real duration and of the time that was really left; the headline is the first
//! reading at 2 s or later, and the worst error from 10% registered on. Three ways the pace
//! falls below the limit: `--latency-ms` (a downstream slower than the limit), `--api-limit`
//! (an API whose real limit is lower than the replicas are told) and `--cut-off-after-s` (the
//! last replica cut off from Redis).

use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::mock_api::MockArgs;
use crate::rig::{Message, Rig, RigArgs};
use crate::slow_link::{self, SlowLink};
use turnstile_core::config::{Algorithm, LimiterArgs, Limits};
use turnstile_ops::http::Listen;
use turnstile_ops::serve::HttpArgs;

use super::workload::print_outcome;

/// Flags of `turnstile bench eta`.
#[derive(Args, Debug, Clone)]
pub struct EtaArgs {
    /// Messages of the batch.
    #[arg(long, default_value_t = 500)]
    pub rows: usize,
    /// The seller's limit (or a comma-separated stack), both turnstile's and the mock's.
    #[arg(long, default_value = "100/1m", value_parser = turnstile_core::config::limits_arg)]
    pub limit: Limits,
    /// Consumer replicas.
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Workers of each replica.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// The consumers' limiter algorithm.
    #[arg(long, value_enum, default_value_t = Algorithm::SlidingWindow)]
    pub algorithm: Algorithm,
    /// The mock's answers take this long (ms): a downstream slower than the limit.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// The limit the mock really enforces, when lower than `--limit` (which the replicas are
    /// told): an API whose real limit is below the configured one.
    #[arg(long, value_parser = turnstile_core::config::limits_arg)]
    pub api_limit: Option<Limits>,
    /// Cut the last replica (not the first, which serves the API read) off from Redis this many
    /// seconds after the first publish (its Redis link through a proxy that then hangs), for
    /// the rest of the run; needs two replicas or more.
    #[arg(long)]
    pub cut_off_after_s: Option<f64>,
    #[command(flatten)]
    pub rig: RigArgs,
}

/// The fixed moments of the first readings, in seconds after the first publish; then one
/// every [`EVERY_S`].
const FIRST_S: [f64; 3] = [2.0, 5.0, 10.0];
const EVERY_S: f64 = 30.0;
const SELLER: &str = "uploader";
const BATCH: &str = "upload-1";

/// One reading of the batch's report.
struct Reading {
    /// Seconds after the first publish (the mock's clock, as the request was sent).
    at_s: f64,
    registered: u64,
    eta_s: Option<f64>,
    /// The soonest the limits allow (the ETA from the limits alone).
    eta_limits_s: Option<f64>,
    /// What the ETA rests on, and the seller's observed pace (units per second).
    basis: String,
    pace: Option<f64>,
    done: bool,
}

/// Runs the upload and prints the readings; `Ok(false)` when anything was lost, duplicated or
/// over the limit.
pub async fn run(args: EtaArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.rows > 0, "--rows must be at least 1");
    anyhow::ensure!(
        args.cut_off_after_s.is_none() || args.replicas >= 2,
        "--cut-off-after-s needs --replicas 2 or more (the first serves the API read)"
    );
    let (rows, limit) = (args.rows, args.limit.clone());
    let settings = args.rig.replica_settings(
        "eta",
        LimiterArgs::new(limit.clone(), args.algorithm),
        args.workers,
        Duration::from_secs(2),
    );
    eprintln!(
        "eta: one seller's batch of {rows} at {limit}, {} replicas x {} workers, {}",
        args.replicas, args.workers, args.algorithm
    );
    let mut mock = MockArgs::local(limit.clone());
    mock.latency_ms = args.latency_ms;
    let mut builder = Rig::build(settings).with_mock(mock);
    if let Some(api) = &args.api_limit {
        builder = builder.with_api_limit(api.clone());
    }
    let mut rig = builder.prepare().await?;
    // The first replica serves the API; with a cut planned, the last one's Redis link goes
    // through a proxy of its own.
    let mut proxy = None;
    for n in 0..args.replicas {
        let mut settings = rig.settings(args.workers);
        if n + 1 == args.replicas && n > 0 && args.cut_off_after_s.is_some() {
            let redis = slow_link::address_of(rig.redis_url()).await?;
            let link = SlowLink::start(redis, Duration::ZERO).await?;
            settings.redis.url = link.redis_url();
            proxy = Some(link);
        }
        if n == 0 {
            let http = HttpArgs {
                http_addr: Listen::At("127.0.0.1:0".parse()?),
                http_token: None,
            };
            rig.start_replica(turnstile_ops::serve::ServeArgs {
                consume: settings,
                http,
            })
            .await?;
        } else {
            rig.start_replica(settings).await?;
        }
    }
    let url = format!(
        "http://{}/api/batches/{BATCH}",
        rig.dashboard().context("the rig serves no HTTP")?
    );
    let body = |i: usize| {
        let id = format!("{SELLER}-{i}");
        serde_json::json!({"message_id": id, "seller_id": SELLER, "batch_id": BATCH,
            "batch_size": rows, "product": {"sku": i}})
        .to_string()
        .into_bytes()
    };
    let messages = (0..rows)
        .map(|i| Message {
            seller: SELLER.into(),
            body: body(i),
        })
        .collect();
    let optimum = limit.optimum_drain(rows as u64);
    let start_ms = rig.mock.stats().now_ms;
    let since = |ms: u64| ms.saturating_sub(start_ms) as f64 / 1000.0;
    rig.publish_all(messages).await?;

    let client = reqwest::Client::new();
    let deadline = optimum.as_secs_f64() * 3.0 + 60.0;
    let (mut moments, mut next_tenth) = (FIRST_S.iter().copied(), 1);
    let mut next_at = moments.next().unwrap_or(EVERY_S);
    let mut readings = Vec::new();
    let mut cut = args.cut_off_after_s;
    loop {
        let stats = rig.mock.stats();
        let registered = stats.sellers.get(SELLER).map_or(0, |s| s.registered);
        let at_s = since(stats.now_ms);
        if let (Some(after), Some(link)) = (cut, &proxy)
            && at_s >= after
        {
            link.hang();
            eprintln!("eta: the last replica cut off from Redis at {at_s:.1} s");
            cut = None;
        }
        if registered >= rows as u64 || at_s > deadline {
            break;
        }
        let tenth = next_tenth < 10 && registered * 10 >= next_tenth * rows as u64;
        if at_s >= next_at || tenth {
            let reading = read(&client, &url, at_s).await?;
            if reading.done {
                break;
            }
            readings.push(reading);
            while at_s >= next_at {
                next_at = moments.next().unwrap_or(next_at + EVERY_S);
            }
            while next_tenth < 10 && registered * 10 >= next_tenth * rows as u64 {
                next_tenth += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last_ms = rig.mock.stats().sellers.get(SELLER).and_then(|s| s.last_ms);
    if let Some(link) = &proxy {
        link.restore();
    }
    let report = rig.finish().await?;
    let finish = last_ms.map_or(f64::NAN, since);

    print_outcome(&report);
    println!(
        "{:<44} {:>9.2}s",
        format!("optimum ({rows} at {limit}, greedy schedule)"),
        optimum.as_secs_f64()
    );
    println!("{:<44} {:>9.2}s", "real finish (last registration)", finish);
    let headline = readings
        .iter()
        .find(|r| r.eta_s.is_some() && r.at_s >= FIRST_S[0])
        .or_else(|| readings.iter().rev().find(|r| r.eta_s.is_some()));
    if let Some(first) = headline {
        let eta = first.eta_s.unwrap_or(f64::NAN);
        println!(
            "ETA given at {:.1} s: {eta:.1} s (finish at {:.1} s); real: {finish:.1} s; error {:+.1} s, {:+.1}%",
            first.at_s,
            first.at_s + eta,
            first.at_s + eta - finish,
            100.0 * (first.at_s + eta - finish) / finish
        );
    }
    println!();
    println!(
        "{:>8} {:>10} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>14} {:>9} {:>11}",
        "at_s",
        "registered",
        "eta_s",
        "predicted",
        "real",
        "error_s",
        "%_of_run",
        "%_of_left",
        "basis",
        "pace_/s",
        "limits_err%"
    );
    let (mut worst_from_tenth, mut worst_by_limits): (f64, f64) = (0.0, 0.0);
    for r in &readings {
        let Some(eta) = r.eta_s else {
            println!("{:>8.1} {:>10} {:>8}", r.at_s, r.registered, "-");
            continue;
        };
        let error = r.at_s + eta - finish;
        let by_limits = r
            .eta_limits_s
            .map(|l| 100.0 * (r.at_s + l - finish) / finish);
        if r.registered * 10 >= rows as u64 {
            worst_from_tenth = worst_from_tenth.max((100.0 * error / finish).abs());
            worst_by_limits = worst_by_limits.max(by_limits.unwrap_or(0.0).abs());
        }
        println!(
            "{:>8.1} {:>10} {:>8.1} {:>10.1} {:>10.1} {:>+9.1} {:>+8.1}% {:>+8.1}% {:>14} {:>9} {:>11}",
            r.at_s,
            r.registered,
            eta,
            r.at_s + eta,
            finish,
            error,
            100.0 * error / finish,
            100.0 * error / (finish - r.at_s),
            r.basis,
            r.pace.map_or("-".to_owned(), |p| format!("{p:.1}")),
            by_limits.map_or("-".to_owned(), |e| format!("{e:+.1}%"))
        );
    }
    println!(
        "worst error from 10% registered on: {worst_from_tenth:.1}% of the run (from the limits alone: {worst_by_limits:.1}%)"
    );
    // Calls over the mock's limit are what a lower real limit answers with 429s, not ours.
    let violations_ok = args.api_limit.is_some() || report.violations == 0;
    Ok(report.lost == 0 && violations_ok && report.duplicates == 0)
}

/// Reads the batch's report as the upload service does.
async fn read(client: &reqwest::Client, url: &str, at_s: f64) -> anyhow::Result<Reading> {
    let response = client.get(url).send().await?;
    if !response.status().is_success() {
        return Ok(Reading {
            at_s,
            registered: 0,
            eta_s: None,
            eta_limits_s: None,
            basis: "-".into(),
            pace: None,
            done: false,
        });
    }
    let report: serde_json::Value = response.json().await?;
    Ok(Reading {
        at_s,
        registered: report["registered"].as_u64().unwrap_or(0),
        eta_s: report["eta_s"].as_f64(),
        eta_limits_s: report["eta_limits_s"].as_f64(),
        basis: report["eta_basis"].as_str().unwrap_or("-").to_owned(),
        pace: report["observed_per_s"].as_f64(),
        done: report["done"].as_bool().unwrap_or(false),
    })
}
