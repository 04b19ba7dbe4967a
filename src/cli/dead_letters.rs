//! `turnstile dead-letters`: list dead letters with their reasons, or move chosen ones back to
//! the work queue.

use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use turnstile_core::broker::{BrokerArgs, dead_letters};
use turnstile_core::config::{LimiterArgs, RedisArgs};
use turnstile_core::permit::PermitStore;

/// `turnstile dead-letters`: its action and the broker; `replay` also reads Redis (it counts
/// the messages it moves back as waiting again). No limiter setting is read.
#[derive(clap::Args, Debug)]
#[command(subcommand_precedence_over_arg = true)]
pub struct DeadLettersArgs {
    #[command(subcommand)]
    pub action: DeadLettersAction,
    #[command(flatten)]
    pub broker: BrokerArgs,
}

#[derive(Subcommand, Debug)]
pub enum DeadLettersAction {
    /// List dead letters with their reasons (they stay where they are).
    List {
        /// Only those with this reason (invalid-message, rejected, attempts-exhausted, throttled,
        /// delivery-limit).
        #[arg(long)]
        reason: Option<String>,
        /// Print JSON instead of a table.
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
        #[arg(long = "done-ttl", env = "TURNSTILE_DONE_TTL", default_value = "7d", value_parser = turnstile_core::config::duration_arg)]
        done_ttl: Duration,
        #[command(flatten)]
        redis: RedisArgs,
    },
}

/// Runs `turnstile dead-letters`.
pub async fn run(DeadLettersArgs { action, broker }: DeadLettersArgs) -> anyhow::Result<ExitCode> {
    let opening = async {
        let (connection, publisher, topology) = broker.open("turnstile dead-letters").await?;
        let channel = connection.create_channel().await?;
        anyhow::Ok((connection, publisher, topology, channel))
    };
    let (connection, publisher, topology, channel) =
        tokio::time::timeout(dead_letters::STEP_TIMEOUT, opening)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "the broker did not open a session within {:?}",
                    dead_letters::STEP_TIMEOUT
                )
            })??;
    match action {
        DeadLettersAction::List { reason, json } => {
            let selection = selection_of(reason.as_deref())?;
            let letters = dead_letters::list(&channel, &topology, &selection).await?;
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
        DeadLettersAction::Replay {
            reason,
            done_ttl,
            redis,
        } => {
            let selection = selection_of(reason.as_deref())?;
            let store = PermitStore::connect(&redis, &LimiterArgs::default()).await?;
            let done = dead_letters::replay(
                &channel, &publisher, &topology, &selection, &store, done_ttl, false,
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
    let closing = connection.close(200, "done".into());
    let _ = tokio::time::timeout(dead_letters::STEP_TIMEOUT, closing).await;
    Ok(ExitCode::SUCCESS)
}

/// The dead letters `--reason` selects.
fn selection_of(reason: Option<&str>) -> anyhow::Result<dead_letters::Selection> {
    let mut selection = dead_letters::Selection::all();
    if let Some(reason) = reason {
        selection = selection.with_reason(reason.parse()?);
    }
    Ok(selection)
}
