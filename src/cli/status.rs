//! `turnstile status`: how far each upload is (registered, waiting, dead-lettered) and when it
//! will be done.

use std::process::ExitCode;
use std::time::Duration;

use turnstile_core::config::{LimiterArgs, Limits, RedisArgs};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::PermitStore;
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
    } else {
        print_table(&rows);
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints one line per upload: its counts, its seller's limit and when it will be done.
fn print_table(rows: &[(&Progress, Limits, Duration)]) {
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
}
