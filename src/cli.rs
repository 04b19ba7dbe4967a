//! The `turnstile` command line: subcommands, and the startup code that wires the modules.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::bench;
use crate::config::{Limit, LimiterArgs, RedisArgs};
use crate::domain::SellerId;
use crate::permit::PermitStore;
use crate::replica::{ConsumeArgs, Replica};
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
        #[arg(long = "limit", value_parser = |s: &str| s.parse::<Limit>().map_err(|e| e.to_string()))]
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
    }
}

/// A token cancelled on SIGTERM or SIGINT (Ctrl-C); the only place signals are read.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("installing the SIGTERM handler");
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutdown signal received");
        cancel.cancel();
    });
    token
}
