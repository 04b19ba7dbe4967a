//! The `turnstile` command line: one file per command whose body lives here; `demo` and
//! `bench` run the lab's ([`turnstile_lab`]). The only place that knows every part.
//! - [`consume`]: one replica with its endpoints (`turnstile_ops::serve`)
//! - [`mock_api`]: the lab's strict stand-in for the registration API
//! - [`publish`], [`status`]: the producer side (`turnstile_upload`)
//! - [`limits`], [`dead_letters`]: operator commands on Redis and the broker

mod consume;
mod dead_letters;
mod limits;
mod mock_api;
mod publish;
mod status;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use turnstile_core::domain::{BatchId, SellerId};
use turnstile_lab::{bench, demo};
use turnstile_ops::serve::ServeArgs;

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
    #[command(
        after_help = "Also read from the environment: TURNSTILE_LOG_FORMAT (`json` for one JSON object per line; default text) and RUST_LOG (the log filter; default `info,lapin::channel=off`, and `lapin::channel=off` is added to a RUST_LOG that names no lapin target)."
    )]
    Consume(Box<ServeArgs>),
    /// A strict stand-in for the registration API (for demos, tests and benchmarks).
    MockApi(turnstile_lab::mock_api::MockArgs),
    /// Publish a seller's upload (.xlsx, .csv or .jsonl): one registration message per product.
    Publish(Box<publish::PublishArgs>),
    /// How far each upload is: registered, waiting, dead-lettered, and when it will be done.
    Status(Box<status::StatusArgs>),
    /// Everything on the local RabbitMQ and Redis: mock API, replicas, uploads, live progress.
    Demo(Box<demo::DemoArgs>),
    /// Inspect dead letters, or move chosen ones back to the work queue.
    DeadLetters(Box<dead_letters::DeadLettersArgs>),
    /// Show or change per-seller limit overrides (stored in Redis, effective on every replica).
    Limits(Box<limits::LimitsArgs>),
    /// Measurements that print figures next to a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Consume(args) => consume::run(*args).await,
        Command::MockApi(args) => mock_api::run(args).await,
        Command::Publish(args) => publish::run(*args).await,
        Command::Status(args) => status::run(*args).await,
        Command::Demo(args) => demo::run(*args).await,
        Command::DeadLetters(args) => dead_letters::run(*args).await,
        Command::Limits(args) => limits::run(*args).await,
        Command::Bench { which } => bench::run(which).await,
    }
}

/// `--seller`, parsed.
fn seller_arg(s: &str) -> anyhow::Result<SellerId> {
    SellerId::parse(s).map_err(|e| anyhow::anyhow!("--seller {s:?}: {e}"))
}

/// `--batch`, parsed.
fn batch_arg(s: &str) -> anyhow::Result<BatchId> {
    BatchId::parse(s).map_err(|e| anyhow::anyhow!("--batch {s:?}: {e}"))
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
            &["turnstile", "bench", "eta"],
        ] {
            if let Err(error) = super::Cli::try_parse_from(args) {
                panic!("{args:?}: {error}");
            }
        }
    }
}
