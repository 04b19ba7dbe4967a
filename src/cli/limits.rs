//! `turnstile limits`: show or change per-seller limit overrides, shadow limits and pauses
//! (stored in Redis, effective on every replica at once), and show what adaptive limits learned.

use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use turnstile_core::config::{LimiterArgs, Limits, RedisArgs, TermsArgs};
use turnstile_core::domain::SellerId;
use turnstile_core::fleet;
use turnstile_core::permit::{Admin, MAX_SHADOW_COUNT, MAX_WEIGHT, RedisConn, Terms};

use super::seller_arg;

/// `turnstile limits`: its action, where the limits live and the replicas' terms they are read
/// and changed under. The terms go before the action (`turnstile limits --algorithm gcra get
/// --seller S`): after it, `limits set`'s `--limit` is the seller's new limit.
#[derive(clap::Args, Debug)]
#[command(
    subcommand_precedence_over_arg = true,
    after_help = "Sellers are read and changed under the fleet's terms (the strictest of the live replicas'). With no replica alive, under the terms given here (--limit, --algorithm, ...: the TURNSTILE_* variables, or flags before the action: `turnstile limits --limit 100/1m get --seller S`)."
)]
pub struct LimitsArgs {
    #[command(subcommand)]
    pub action: LimitsAction,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub terms: TermsArgs,
}

#[derive(Subcommand, Debug)]
pub enum LimitsAction {
    /// Set a seller's limit, e.g. `--limit 500/1m`, or a stack that must all hold, e.g.
    /// `--limit 10/1s,500/1h`; and/or its weight under the global limit, e.g. `--weight 5`.
    /// With `--shadow`, the limit is only judged beside the enforced one, never enforced:
    /// `limits get`, the dashboard and `turnstile_shadow_verdicts_total` show what it would
    /// have done.
    #[command(group(clap::ArgGroup::new("what").required(true).multiple(true).args(["new_limit", "weight"])))]
    Set {
        /// The seller.
        #[arg(long)]
        seller: String,
        /// The seller's new limit (an override of the default), COUNT/DURATION, or a
        /// comma-separated stack that must all hold.
        #[arg(long = "limit", value_parser = turnstile_core::config::limits_arg)]
        new_limit: Option<Limits>,
        /// Set `--limit` as the seller's shadow limit (its verdicts start from zero).
        #[arg(long, requires = "new_limit")]
        shadow: bool,
        /// The seller's share of TURNSTILE_GLOBAL_LIMIT when it binds, relative to the others'
        /// (default 1; 1 to 1000).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_WEIGHT)))]
        weight: Option<u32>,
    },
    /// Show each limit that applies to a seller (an override or the default, and what adaptive
    /// limits learned of it), how much of it is taken, which one binds now, any pause, and the
    /// shadow limit's verdicts.
    Get {
        /// The seller.
        #[arg(long)]
        seller: String,
    },
    /// Remove a seller's override (the default applies again), or with `--shadow` its shadow
    /// limit.
    Clear {
        /// The seller.
        #[arg(long)]
        seller: String,
        /// Remove the seller's shadow limit instead.
        #[arg(long)]
        shadow: bool,
    },
    /// Lift a seller's pause (taken from a 429's Retry-After) on every replica at once.
    Resume {
        /// The seller.
        #[arg(long)]
        seller: String,
    },
    /// Forget a seller's limiter state (its grants, reserved slots, learned limit) safely: the
    /// seller is paused for one window first, so that no call of the forgotten state shares a
    /// window with a new one. Its override, weight and completion records are kept. (Deleting
    /// its keys by hand instead lets a second window of calls through.)
    Reset {
        /// The seller.
        #[arg(long)]
        seller: String,
    },
}

/// Runs `turnstile limits`.
pub async fn run(
    LimitsArgs {
        action,
        redis,
        terms,
    }: LimitsArgs,
) -> anyhow::Result<ExitCode> {
    let conn = RedisConn::connect(&redis).await?;
    let terms = fleet::tool_terms(&conn, &redis.key_prefix, LimiterArgs::with_terms(terms)).await?;
    if let Some(note) = terms.note(&redis.key_prefix) {
        eprintln!("{note}");
    }
    let limiter = terms.limiter;
    let store = Admin::new(conn, &redis.key_prefix, Terms::from(&limiter));
    let line = match action {
        LimitsAction::Set {
            seller,
            new_limit,
            weight,
            shadow,
        } => {
            let seller = seller_arg(&seller)?;
            let mut said = Vec::new();
            if let Some(new_limit) = new_limit.clone().filter(|_| shadow) {
                anyhow::ensure!(
                    new_limit.iter().all(|l| l.count() <= MAX_SHADOW_COUNT),
                    "refusing the shadow limit {new_limit}: a shadow COUNT may be at most {MAX_SHADOW_COUNT} (its log keeps that many units per seller)"
                );
                store
                    .set_shadow(&seller, new_limit.clone())
                    .await
                    .context("setting the shadow limit")?;
                said.push(format!("{new_limit} (shadow: judged, not enforced)"));
            } else if let Some(new_limit) = new_limit {
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
        LimitsAction::Reset { seller } => {
            let seller = seller_arg(&seller)?;
            let paused = store
                .reset(&seller)
                .await
                .context("resetting the seller's limiter state")?;
            format!(
                "{seller}: limiter state forgotten; paused for {:.1}s so that no call of the forgotten state shares a window with a new one",
                paused.as_secs_f64()
            )
        }
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
        LimitsAction::Clear {
            seller,
            shadow: true,
        } => {
            let seller = seller_arg(&seller)?;
            let had = store
                .clear_shadow(&seller)
                .await
                .context("clearing the shadow limit")?;
            let what = if had {
                "shadow limit cleared"
            } else {
                "had no shadow limit"
            };
            format!("{seller}: {what}")
        }
        LimitsAction::Clear {
            seller,
            shadow: false,
        } => {
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
async fn get(store: &Admin, seller: &SellerId) -> anyhow::Result<String> {
    let usage = store.usage(seller).await.context("reading the limit")?;
    let whose = if usage.overridden {
        "override"
    } else {
        "default"
    };
    let learned = store
        .learned(seller)
        .await
        .context("reading the learned limit")?;
    let configured = learned
        .as_ref()
        .map_or(&usage.limit, |learned| &learned.configured);
    let mut line = format!("{seller}: {configured} ({whose})");
    if let Some(learned) = &learned {
        line += &learned_line(learned);
    }
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
    if let Some(shadow) = store.shadow(seller).await.context("reading the shadow")? {
        line += &format!(
            "\n  shadow {}: agreed {}, would have held back {} (by {:.1}s in all), would have let {} go at once",
            shadow.limit,
            shadow.agree,
            shadow.stricter,
            shadow.delay.as_secs_f64(),
            shadow.looser
        );
    }
    Ok(line)
}

/// What adaptive limits learned of a seller: the limit that applies, why and when it last
/// changed, and the downstream's quota.
fn learned_line(learned: &turnstile_core::permit::Learned) -> String {
    let mut line = String::new();
    if learned.limit != learned.configured {
        line += &format!(", learned {}", learned.limit);
    } else {
        line += ", learned: as configured";
    }
    if let (Some(why), Some(ago)) = (learned.why, learned.changed_ago) {
        line += &format!(" ({} {:.1}s ago", why.label(), ago.as_secs_f64());
        if let Some(from) = &learned.from {
            line += &format!(", from {from}");
        }
        line += ")";
    }
    if learned.limit != learned.configured {
        line += &format!("; raised after {} window(s) of full use", learned.patience);
    }
    if let Some(quota) = learned.quota {
        line += &format!(
            "; downstream quota {} left, resets in {:.1}s",
            quota.left,
            quota.resets_in.as_secs_f64()
        );
    }
    line
}
