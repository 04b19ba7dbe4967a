//! `turnstile limits`: show or change per-seller limit overrides and pauses (stored in Redis,
//! effective on every replica at once).

use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use turnstile_core::config::{LimiterArgs, Limits, RedisArgs};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{MAX_WEIGHT, PermitStore};

use super::seller_arg;

/// `turnstile limits`: its action and where the limits live.
#[derive(clap::Args, Debug)]
pub struct LimitsArgs {
    #[command(subcommand)]
    pub action: LimitsAction,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub limiter: LimiterArgs,
}

#[derive(Subcommand, Debug)]
pub enum LimitsAction {
    /// Set a seller's limit, e.g. `--limit 500/1m`, or a stack that must all hold, e.g.
    /// `--limit 10/1s,500/1h`; and/or its weight under the global limit, e.g. `--weight 5`.
    #[command(group(clap::ArgGroup::new("what").required(true).multiple(true).args(["new_limit", "weight"])))]
    Set {
        #[arg(long)]
        seller: String,
        #[arg(long = "limit", value_parser = turnstile_core::config::limits_arg)]
        new_limit: Option<Limits>,
        /// The seller's share of TURNSTILE_GLOBAL_LIMIT when it binds, relative to the others'
        /// (default 1; 1 to 1000).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_WEIGHT)))]
        weight: Option<u32>,
    },
    /// Show each limit that applies to a seller (an override or the default), how much of it is
    /// taken, which one binds now, and any pause.
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

/// Runs `turnstile limits`.
pub async fn run(
    LimitsArgs {
        action,
        redis,
        limiter,
    }: LimitsArgs,
) -> anyhow::Result<ExitCode> {
    let store = PermitStore::connect(&redis, &limiter).await?;
    let line = match action {
        LimitsAction::Set {
            seller,
            new_limit,
            weight,
        } => {
            let seller = seller_arg(&seller)?;
            let mut said = Vec::new();
            if let Some(new_limit) = new_limit {
                LimiterArgs {
                    limit: new_limit.clone(),
                    ..limiter.clone()
                }
                .check()
                .map_err(anyhow::Error::msg)
                .context("refusing the new limit")?;
                said.push(format!("{new_limit} (override)"));
                store
                    .set_limit(&seller, new_limit)
                    .await
                    .context("setting the limit")?;
            }
            if let Some(weight) = weight {
                store
                    .set_weight(&seller, weight)
                    .await
                    .context("setting the weight")?;
                said.push(format!("weight {weight}"));
            }
            format!("{seller}: {}", said.join(", "))
        }
        LimitsAction::Get { seller } => get(&store, &seller_arg(&seller)?).await?,
        LimitsAction::Resume { seller } => {
            let seller = seller_arg(&seller)?;
            let was = store.resume(&seller).await.context("lifting the pause")?;
            let what = if was {
                "pause lifted"
            } else {
                "was not paused"
            };
            format!("{seller}: {what}")
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
            format!(
                "{seller}: {what}; {} (default) applies",
                store.default_limit()
            )
        }
    };
    println!("{line}");
    Ok(ExitCode::SUCCESS)
}

/// The stack that applies to a seller, whether it is an override, and its pause; then a line
/// per limit: how much of it is taken now and promised ahead, and which one binds now.
async fn get(store: &PermitStore, seller: &SellerId) -> anyhow::Result<String> {
    let usage = store.usage(seller).await.context("reading the limit")?;
    let whose = if usage.overridden {
        "override"
    } else {
        "default"
    };
    let mut line = format!("{seller}: {} ({whose})", usage.limit);
    let weight = store.weight(seller).await.context("reading the weight")?;
    if weight != 1 {
        line += &format!(", weight {weight}");
    }
    if !usage.paused_for.is_zero() {
        line += &format!(", paused for {:.1}s", usage.paused_for.as_secs_f64());
    }
    for (i, u) in usage.per_limit.iter().enumerate() {
        line += &format!(
            "\n  {:<10} {} of {} units taken now, {} ahead{}",
            u.limit.to_string(),
            u.used,
            u.capacity,
            u.ahead,
            if i == usage.binding && usage.per_limit.len() > 1 {
                "  <- binds now"
            } else {
                ""
            }
        );
    }
    Ok(line)
}
