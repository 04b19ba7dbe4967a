//! The `turnstile` command line: subcommands, and the startup code that wires the modules.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use std::path::PathBuf;
use std::time::Duration;

use crate::bench;
use crate::broker::{BrokerArgs, dead_letters};
use crate::config::{Limit, LimiterArgs, RedisArgs};
use crate::domain::{BatchId, SellerId};
use crate::mock_api::{MockArgs, MockServer};
use crate::permit::PermitStore;
use crate::progress;
use crate::replica::{ConsumeArgs, Replica};
use crate::upload::read_upload;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(
    name = "turnstile",
    version,
    about = "Per-seller rate-limited registration consumer"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one consumer replica (many may share the queue).
    Consume(Box<ConsumeArgs>),
    /// A strict stand-in for the registration API (for demos, tests and benchmarks).
    MockApi(MockArgs),
    /// Publish a seller's upload (.xlsx, .csv or .jsonl): one registration message per product.
    Publish(Box<PublishArgs>),
    /// How far each upload is: registered, waiting, dead-lettered, and when it will be done.
    Status(Box<StatusArgs>),
    /// Everything on the local RabbitMQ and Redis: mock API, replicas, uploads, live progress.
    Demo(Box<crate::demo::DemoArgs>),
    /// Inspect dead letters, or move chosen ones back to the work queue.
    DeadLetters {
        #[command(subcommand)]
        action: DeadLettersAction,
        #[command(flatten)]
        broker: BrokerArgs,
        #[command(flatten)]
        redis: RedisArgs,
        #[command(flatten)]
        limiter: LimiterArgs,
    },
    /// Show or change per-seller limit overrides (stored in Redis, effective on every replica).
    Limits {
        #[command(subcommand)]
        action: LimitsAction,
        #[command(flatten)]
        redis: RedisArgs,
        #[command(flatten)]
        limiter: LimiterArgs,
    },
    /// Measurements that print figures next to a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

#[derive(Subcommand, Debug)]
pub enum LimitsAction {
    /// Set a seller's limit, e.g. `--limit 500/1m`.
    Set {
        #[arg(long)]
        seller: String,
        #[arg(long = "limit", value_parser = crate::config::limit_arg)]
        new_limit: Limit,
    },
    /// Show the limit that applies to a seller, and whether it is an override or paused.
    Get {
        #[arg(long)]
        seller: String,
    },
    /// Remove a seller's override (the default applies again).
    Clear {
        #[arg(long)]
        seller: String,
    },
    /// Lift a seller's pause (taken from a 429's Retry-After) on every replica at once.
    Resume {
        #[arg(long)]
        seller: String,
    },
}

#[derive(clap::Args, Debug)]
pub struct PublishArgs {
    /// The upload: .xlsx (first sheet), .csv or .jsonl; the first row (or each object's keys)
    /// names the product fields.
    pub file: PathBuf,
    #[arg(long)]
    pub seller: String,
    /// The upload's batch id [default: file name + digest of its content].
    #[arg(long)]
    pub batch: Option<String>,
    /// Refuse the whole file if any row is bad (default: report bad rows and skip them).
    #[arg(long)]
    pub strict: bool,
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub limiter: LimiterArgs,
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[arg(long)]
    pub seller: Option<String>,
    #[arg(long)]
    pub batch: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub limiter: LimiterArgs,
}

#[derive(Subcommand, Debug)]
pub enum DeadLettersAction {
    /// List dead letters with their reasons (they stay where they are).
    List {
        /// Only those with this reason (invalid-message, rejected, attempts-exhausted, throttled,
        /// delivery-limit).
        #[arg(long)]
        reason: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Move dead letters (all, or those with --reason) back to the work queue, attempts reset;
    /// their messages count as waiting again in their uploads' progress.
    Replay {
        /// Only those with this reason (as listed).
        #[arg(long)]
        reason: Option<String>,
        /// How long completion records are kept (the replicas' TURNSTILE_DONE_TTL): a message
        /// whose republish fails is recorded as dead again for that long.
        #[arg(long = "done-ttl", env = "TURNSTILE_DONE_TTL", default_value = "7d", value_parser = crate::config::duration_arg)]
        done_ttl: Duration,
    },
}

fn seller_arg(s: &str) -> anyhow::Result<SellerId> {
    SellerId::parse(s).map_err(|e| anyhow::anyhow!("--seller {s:?}: {e}"))
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Consume(args) => {
            let shutdown = shutdown_on_signal();
            let replica = Replica::start(*args, shutdown).await?;
            replica.wait().await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Limits {
            action,
            redis,
            limiter,
        } => {
            let store = PermitStore::connect(&redis, &limiter).await?;
            match action {
                LimitsAction::Set { seller, new_limit } => {
                    let seller = seller_arg(&seller)?;
                    store
                        .set_limit(&seller, new_limit)
                        .await
                        .context("setting the limit")?;
                    println!("{seller}: {new_limit} (override)");
                }
                LimitsAction::Get { seller } => {
                    let seller = seller_arg(&seller)?;
                    let limit = store
                        .limit_override(&seller)
                        .await
                        .context("reading the limit")?;
                    let paused = store
                        .paused_for(&seller)
                        .await
                        .context("reading the pause")?;
                    match limit {
                        Some(limit) => print!("{seller}: {limit} (override)"),
                        None => print!("{seller}: {} (default)", store.default_limit()),
                    }
                    if !paused.is_zero() {
                        print!(", paused for {:.1}s", paused.as_secs_f64());
                    }
                    println!();
                }
                LimitsAction::Resume { seller } => {
                    let seller = seller_arg(&seller)?;
                    let was = store.resume(&seller).await.context("lifting the pause")?;
                    println!(
                        "{seller}: {}",
                        if was {
                            "pause lifted"
                        } else {
                            "was not paused"
                        }
                    );
                }
                LimitsAction::Clear { seller } => {
                    let seller = seller_arg(&seller)?;
                    let had = store
                        .clear_limit(&seller)
                        .await
                        .context("clearing the limit")?;
                    let what = if had {
                        "override cleared"
                    } else {
                        "had no override"
                    };
                    println!(
                        "{seller}: {what}; {} (default) applies",
                        store.default_limit()
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { which } => bench::run(which).await,
        Command::MockApi(args) => {
            let shutdown = shutdown_on_signal();
            let server = MockServer::start(args, shutdown).await?;
            println!("mock registration API on {}", server.url());
            server.wait().await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Publish(args) => publish(*args).await,
        Command::Status(args) => status(*args).await,
        Command::Demo(args) => crate::demo::run(*args).await,
        Command::DeadLetters {
            action,
            broker,
            redis,
            limiter,
        } => {
            let (connection, publisher, topology) = broker.open("turnstile dead-letters").await?;
            let channel = connection.create_channel().await?;
            match action {
                DeadLettersAction::List { reason, json } => {
                    let letters =
                        dead_letters::list(&channel, &topology, reason.as_deref()).await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&letters)?);
                    } else {
                        println!("{} dead letters in {}", letters.len(), topology.dead());
                        for d in &letters {
                            println!(
                                "{:<24} {:<16} {:<20} {}",
                                d.message_id.as_deref().unwrap_or("-"),
                                d.seller_id.as_deref().unwrap_or("-"),
                                d.reason,
                                d.detail
                            );
                        }
                    }
                }
                DeadLettersAction::Replay { reason, done_ttl } => {
                    let store = PermitStore::connect(&redis, &limiter).await?;
                    let done = dead_letters::replay(
                        &channel,
                        &publisher,
                        &topology,
                        reason.as_deref(),
                        &store,
                        done_ttl,
                    )
                    .await?;
                    println!(
                        "replayed {} to {}; {} left in {}",
                        done.replayed,
                        topology.work(),
                        done.kept,
                        topology.dead()
                    );
                }
            }
            let _ = connection.close(200, "done".into()).await;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A token cancelled on SIGTERM or SIGINT (Ctrl-C); the only place signals are read.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    // Registered here, before anything else runs: a SIGTERM in the first instant is then a
    // shutdown too, not the default action (exit at once).
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        // Cancel before logging: a log line cannot fail the shutdown (stderr may be closed).
        cancel.cancel();
        tracing::info!("shutdown signal received");
    });
    token
}

/// How long upload progress is kept in Redis.
const PROGRESS_TTL: Duration = Duration::from_secs(7 * 86400);

async fn publish(args: PublishArgs) -> anyhow::Result<ExitCode> {
    let seller = seller_arg(&args.seller)?;
    let batch = match &args.batch {
        Some(b) => Some(BatchId::parse(b).map_err(|e| anyhow::anyhow!("--batch {b:?}: {e}"))?),
        None => None,
    };
    let upload = read_upload(&args.file, &seller, batch.as_ref(), args.strict)?;
    for bad in &upload.bad_rows {
        eprintln!("skipped {bad}");
    }
    let store = PermitStore::connect(&args.redis, &args.limiter).await?;
    let (connection, publisher, topology) = args.broker.open("turnstile publish").await?;
    let bar = indicatif::ProgressBar::new(upload.rows.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(format!(
        "publishing {} of {seller}",
        upload.batch_id.as_str()
    ));
    let queue = topology.work().to_owned();
    let published = futures::stream::iter(&upload.rows)
        .map(|row| {
            let (publisher, queue, bar) = (&publisher, &queue, &bar);
            async move {
                let properties = lapin::BasicProperties::default()
                    .with_content_type("application/json".into())
                    .with_message_id(row.message_id.as_str().into());
                publisher
                    .publish("", queue, &row.body, properties)
                    .await
                    .with_context(|| format!("publishing row {}", row.row))?;
                bar.inc(1);
                anyhow::Ok(())
            }
        })
        .buffered(128)
        .collect::<Vec<_>>()
        .await;
    bar.finish_and_clear();
    let failed: Vec<_> = published.into_iter().filter_map(Result::err).collect();
    let sent = upload.rows.len() - failed.len();
    progress::record_published(
        &store,
        &seller,
        &upload.batch_id,
        upload.rows.len() as u64,
        PROGRESS_TTL,
    )
    .await
    .context("recording the upload's progress")?;
    let _ = connection.close(200, "done".into()).await;
    let limit = store.effective_limit(&seller).await?;
    println!(
        "{}: published {sent} of {} products of {seller} (batch {}) to {queue}; {} bad rows skipped; at {limit} they take at least {:.0}s",
        args.file.display(),
        upload.rows.len(),
        upload.batch_id.as_str(),
        upload.bad_rows.len(),
        limit.optimum_drain(sent as u64).as_secs_f64()
    );
    if let Some(error) = failed.first() {
        anyhow::bail!(
            "{} products were not published (confirmed): {error:#}",
            failed.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let store = PermitStore::connect(&args.redis, &args.limiter).await?;
    let seller = args.seller.as_deref().map(seller_arg).transpose()?;
    let batch = match &args.batch {
        Some(b) => Some(BatchId::parse(b).map_err(|e| anyhow::anyhow!("--batch {b:?}: {e}"))?),
        None => None,
    };
    anyhow::ensure!(
        batch.is_none() || seller.is_some(),
        "--batch needs --seller"
    );
    let uploads = progress::list(&store, seller.as_ref(), batch.as_ref()).await?;
    let backlog = progress::backlog_by_seller(&uploads);
    let mut rows = Vec::new();
    for p in &uploads {
        let seller = SellerId::parse(&p.seller).map_err(|e| anyhow::anyhow!("{e}"))?;
        let limit = store.effective_limit(&seller).await?;
        let paused = store.paused_for(&seller).await?;
        rows.push((
            p,
            limit,
            limit.optimum_drain(backlog[p.seller.as_str()]) + paused,
        ));
    }
    if args.json {
        let value: Vec<_> = rows
            .iter()
            .map(|(p, limit, eta)| {
                serde_json::json!({"seller": p.seller, "batch": p.batch, "total": p.total, "registered": p.registered,
                    "waiting": p.waiting(), "dead_lettered": p.dead, "done": p.waiting() == 0, "limit": limit.to_string(), "eta_s": eta.as_secs_f64()})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        println!(
            "no uploads recorded under key prefix {:?}",
            store.key_prefix()
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<16} {:<28} {:>6} {:>10} {:>8} {:>6} {:>10} {:>10}",
        "seller", "batch", "total", "registered", "waiting", "dead", "limit", "done in"
    );
    for (p, limit, eta) in rows {
        let done = if p.waiting() == 0 {
            "done".to_owned()
        } else {
            format!("~{:.0}s", eta.as_secs_f64().max(1.0))
        };
        println!(
            "{:<16} {:<28} {:>6} {:>10} {:>8} {:>6} {:>10} {:>10}",
            p.seller,
            p.batch,
            p.total,
            p.registered,
            p.waiting(),
            p.dead,
            limit.to_string(),
            done
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn every_subcommand_parses_with_its_defaults() {
        use clap::Parser;
        for args in [
            &[
                "turnstile",
                "consume",
                "--downstream-url",
                "http://127.0.0.1:1/{seller_id}",
            ][..],
            &[
                "turnstile",
                "consume",
                "--downstream-url",
                "http://h/{seller_id}",
                "--http-addr",
                "off",
            ],
            &["turnstile", "mock-api"],
            &["turnstile", "publish", "f.csv", "--seller", "S"],
            &["turnstile", "status"],
            &["turnstile", "demo"],
            &["turnstile", "dead-letters", "list"],
            &["turnstile", "dead-letters", "replay"],
            &["turnstile", "limits", "get", "--seller", "S"],
            &["turnstile", "bench", "scenario"],
            &["turnstile", "bench", "permits"],
        ] {
            if let Err(error) = super::Cli::try_parse_from(args) {
                panic!("{args:?}: {error}");
            }
        }
    }
}
