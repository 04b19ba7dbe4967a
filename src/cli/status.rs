//! `turnstile status`: how far each upload is (registered, waiting, dead-lettered), its
//! seller's limits (which one binds now) and when it will be done; and the global limit's use
//! and each seller's share of it, when there is one.

use std::process::ExitCode;
use std::time::Duration;

use turnstile_core::config::{LimiterArgs, RedisArgs};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{GlobalUsage, PermitStore, Usage};
use turnstile_upload::progress::{self, Progress};

use super::{batch_arg, seller_arg};

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

/// Runs `turnstile status`.
pub async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let store = PermitStore::connect(&args.redis, &args.limiter).await?;
    let seller = args.seller.as_deref().map(seller_arg).transpose()?;
    let batch = args.batch.as_deref().map(batch_arg).transpose()?;
    anyhow::ensure!(
        batch.is_none() || seller.is_some(),
        "--batch needs --seller"
    );
    let uploads = progress::list(&store, seller.as_ref(), batch.as_ref()).await?;
    let backlog = progress::backlog_by_seller(&uploads);
    let mut rows = Vec::new();
    for p in &uploads {
        let seller = SellerId::parse(&p.seller).map_err(|e| anyhow::anyhow!("{e}"))?;
        let usage = store.usage(&seller).await?;
        let eta = usage.limit.optimum_drain(backlog[p.seller.as_str()]) + usage.paused_for;
        rows.push((p, usage, eta));
    }
    if args.json {
        let value: Vec<_> = rows
            .iter()
            .map(|(p, usage, eta)| {
                let limits: Vec<_> = usage
                    .per_limit
                    .iter()
                    .map(|l| serde_json::json!({"limit": l.limit.to_string(), "used": l.used, "capacity": l.capacity, "ahead": l.ahead}))
                    .collect();
                serde_json::json!({"seller": p.seller, "batch": p.batch, "total": p.total, "registered": p.registered,
                    "waiting": p.waiting(), "waiting_units": p.waiting_units(), "dead_lettered": p.dead, "done": p.waiting() == 0,
                    "limit": usage.limit.to_string(), "limits": limits, "binding": binding(usage), "eta_s": eta.as_secs_f64()})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    let global = store.global_usage().await?;
    if rows.is_empty() {
        println!(
            "no uploads recorded under key prefix {:?}",
            store.key_prefix()
        );
    } else {
        print_table(&rows);
    }
    if let Some(global) = &global {
        print_global(global);
    }
    Ok(ExitCode::SUCCESS)
}

/// The global limit: each limit's units taken now, the sellers competing, and each seller's
/// share of its shortest window.
fn print_global(global: &GlobalUsage) {
    let taken: Vec<String> = global
        .per_limit
        .iter()
        .map(|l| format!("{}: {} of {} units taken now", l.limit, l.used, l.capacity))
        .collect();
    println!(
        "\nglobal limit {}: {}; {} sellers competing (weights {})",
        global.limit,
        taken.join(", "),
        global.present,
        global.weights
    );
    let total: u64 = global.shares.iter().map(|s| s.units).sum();
    for share in global.shares.iter().take(20) {
        println!(
            "  {:<24} {:>6} units {:>5.1}%  weight {}",
            share.seller,
            share.units,
            100.0 * share.units as f64 / total.max(1) as f64,
            share.weight
        );
    }
}

/// The limit of the seller's stack that binds now (see `permit::binding_of`).
fn binding(usage: &Usage) -> String {
    usage.per_limit[usage.binding].limit.to_string()
}

/// Prints one line per upload: its counts, its seller's limits, the one that binds now and when
/// it will be done.
fn print_table(rows: &[(&Progress, Usage, Duration)]) {
    println!(
        "{:<16} {:<28} {:>6} {:>10} {:>8} {:>6} {:>14} {:>8} {:>10}",
        "seller", "batch", "total", "registered", "waiting", "dead", "limit", "binds", "done in"
    );
    for (p, usage, eta) in rows {
        let done = if p.waiting() == 0 {
            "done".to_owned()
        } else {
            format!("~{:.0}s", eta.as_secs_f64().max(1.0))
        };
        println!(
            "{:<16} {:<28} {:>6} {:>10} {:>8} {:>6} {:>14} {:>8} {:>10}",
            p.seller,
            p.batch,
            p.total,
            p.registered,
            p.waiting(),
            p.dead,
            usage.limit.to_string(),
            binding(usage),
            done
        );
    }
}
