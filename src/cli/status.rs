//! `turnstile status`: how far each upload is (registered, waiting, dead-lettered), its
//! seller's limits (which one binds now) and when it will be done; and the global limit's use
//! and each seller's share of it, when there is one. With `--seller S --rows N --deadline T`,
//! the admission answer too: when N more rows of S published now would all be registered, and
//! whether by T (as `GET /api/sellers/{id}?rows=N&deadline=T` gives it).

use std::process::ExitCode;

use time::OffsetDateTime;
use turnstile_core::config::{GlobalLimitArgs, LimiterArgs, RedisArgs, TermsArgs};
use turnstile_core::domain::SellerId;
use turnstile_core::fleet;
use turnstile_core::permit::{Admin, GlobalUsage, Records, RedisConn, Terms, Usage};
use turnstile_upload::progress::{self, Admission, BatchReport, Question, SellerReport};

use turnstile_core::domain::BatchId;

use super::{batch_value, seller_value};

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Only this seller's uploads.
    #[arg(long, value_parser = seller_value)]
    pub seller: Option<SellerId>,
    /// Only the uploads with this batch id.
    #[arg(long, value_parser = batch_value)]
    pub batch: Option<BatchId>,
    /// With --seller: when this many more rows of it (1 to 1000000, one unit each), published
    /// now behind its backlog, are expected to be registered (an estimate from the current
    /// state).
    #[arg(long, requires = "seller", value_name = "N", value_parser = rows_value)]
    pub rows: Option<u64>,
    /// With --seller: whether those rows (1 without --rows) are expected to be registered by
    /// this RFC 3339 date-time, e.g. 2026-11-26T10:00:00+09:00. An estimate: what binds is each
    /// message's own deadline (dead-lettered as `expired` past it).
    #[arg(long, requires = "seller", value_name = "TIME", value_parser = deadline_value)]
    pub deadline: Option<OffsetDateTime>,
    /// Print JSON instead of a table (with --rows or --deadline: the seller's report with its
    /// `admission`, as `GET /api/sellers/{id}` gives it).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Each seller's limits are read under the fleet's terms (their usage, what adaptive limits
    /// learned, the ETA); these apply only when no replica is alive.
    #[command(flatten)]
    pub terms: TermsArgs,
    /// The global limit's use and each seller's share of it.
    #[command(flatten)]
    pub global: GlobalLimitArgs,
}

/// Runs `turnstile status`.
pub async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let limiter =
        LimiterArgs::with_terms(args.terms.clone()).with_global_limit(args.global.clone());
    let conn = RedisConn::connect(&args.redis).await?;
    let prefix = &args.redis.key_prefix;
    let terms = fleet::tool_terms(&conn, prefix, limiter).await?;
    if let Some(note) = terms.note(prefix) {
        eprintln!("{note}");
    }
    let admin = Admin::new(conn.clone(), prefix, Terms::from(&terms.limiter));
    let records = Records::new(conn, prefix);
    let question = (args.rows.is_some() || args.deadline.is_some()).then(|| Question {
        rows: args.rows.unwrap_or(1),
        deadline: args.deadline,
    });
    let (seller, batch) = (args.seller.clone(), args.batch.clone());
    let uploads = progress::list(&records, seller.as_ref(), batch.as_ref()).await?;
    // One report per seller, as `GET /api/sellers/{id}` gives it; its batches' ETAs count the
    // work seen before each.
    let mut sellers: Vec<SellerId> = Vec::new();
    for p in &uploads {
        let id = SellerId::parse(&p.seller).map_err(|e| anyhow::anyhow!("{e}"))?;
        if !sellers.contains(&id) {
            sellers.push(id);
        }
    }
    let mut rows = Vec::new();
    for id in &sellers {
        let report = progress::read_seller(&admin, &records, id).await?;
        for b in report.batches {
            if batch
                .as_ref()
                .is_none_or(|wanted| wanted.as_str() == b.batch_id)
            {
                rows.push((b, report.usage.clone()));
            }
        }
    }
    // Read for its own sake: a seller with no batch recorded has no row above.
    let admission = match (&question, &seller) {
        (Some(question), Some(seller)) => {
            let report = progress::read_seller(&admin, &records, seller).await?;
            let admission = report.admission(question, OffsetDateTime::now_utc());
            Some((report, admission))
        }
        _ => None,
    };
    if args.json {
        if let Some((report, admission)) = &admission {
            let mut value = serde_json::json!(report);
            value["admission"] = serde_json::json!(admission);
            println!("{}", serde_json::to_string_pretty(&value)?);
            return Ok(ExitCode::SUCCESS);
        }
        let value: Vec<_> = rows
            .iter()
            .map(|(b, usage)| {
                let limits: Vec<_> = usage
                    .per_limit
                    .iter()
                    .map(|l| serde_json::json!({"limit": l.limit.to_string(), "used": l.used, "capacity": l.capacity, "ahead": l.ahead}))
                    .collect();
                let mut value = serde_json::json!(b);
                value["dead_lettered"] = b.dead.values().sum::<u64>().into();
                value["limit"] = usage.limit.to_string().into();
                value["limits"] = limits.into();
                value["binding"] = binding(usage).into();
                value
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    let global = admin.global_usage().await?;
    if let Some(fleet) = &terms.fleet {
        for line in fleet_lines(fleet) {
            println!("{line}");
        }
    }
    if rows.is_empty() {
        println!(
            "no batches recorded under key prefix {:?}",
            args.redis.key_prefix
        );
    } else {
        print_table(&rows);
    }
    if let Some(global) = &global {
        print_global(global);
    }
    if let Some((report, admission)) = &admission {
        println!("\n{}", admission_text(report, admission));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--rows`, parsed by clap (a bad one is a usage error).
fn rows_value(s: &str) -> Result<u64, String> {
    progress::parse_rows(s)
}

/// `--deadline`, parsed by clap (a bad one is a usage error).
fn deadline_value(s: &str) -> Result<OffsetDateTime, String> {
    progress::parse_deadline(s)
}

/// The admission answer in words: when the rows would be registered, behind what, and the
/// deadline's verdict.
fn admission_text(report: &SellerReport, admission: &Admission) -> String {
    let rows = match admission.rows {
        1 => "1 more row".to_owned(),
        n => format!("{n} more rows"),
    };
    let mut text = format!(
        "{rows} of {} published now: all registered by about {} (in ~{:.0}s), behind {} units \
         waiting at {}",
        report.seller_id,
        admission.finish_at,
        admission.finish_in_s.ceil(),
        report.backlog_units,
        report.effective
    );
    if let (Some(deadline), Some(meets)) = (&admission.deadline, admission.meets_deadline) {
        let verdict = if meets { "met" } else { "NOT met" };
        text.push_str(&format!(
            "\ndeadline {deadline}: {verdict} (an estimate from the current state; what binds \
             is each message's own deadline: a message that cannot be called by it is \
             dead-lettered as `expired`)"
        ));
    }
    text
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

/// Prints one line per batch: its counts, its seller's limits, the one that binds now and when
/// it will be done.
fn print_table(rows: &[(BatchReport, Usage)]) {
    println!(
        "{:<16} {:<28} {:>6} {:>10} {:>8} {:>6} {:>14} {:>8} {:>10}",
        "seller", "batch", "total", "registered", "waiting", "dead", "limit", "binds", "done in"
    );
    let or_unknown = |n: Option<u64>| n.map_or("?".to_owned(), |n| n.to_string());
    for (b, usage) in rows {
        let done = match b.eta_s {
            _ if b.done => "done".to_owned(),
            _ if b.stalled.is_some() => "stalled".to_owned(),
            Some(eta) => format!("~{:.0}s", eta.max(1.0)),
            None => "?".to_owned(),
        };
        println!(
            "{:<16} {:<28} {:>6} {:>10} {:>8} {:>6} {:>14} {:>8} {:>10}",
            b.seller_id,
            b.batch_id,
            or_unknown(b.total),
            b.registered,
            or_unknown(b.waiting),
            b.dead.values().sum::<u64>(),
            usage.limit.to_string(),
            binding(usage),
            done
        );
        if let Some(stalled) = &b.stalled {
            println!("  stalled: {}", stalled.why);
        }
    }
}

/// The fleet: one line (its live replicas, the terms in force, whether they agree), then one
/// per live replica that does not consume and one per replica lost lately.
fn fleet_lines(fleet: &fleet::View) -> Vec<String> {
    let mut lines = vec![fleet_line(fleet)];
    let why = |n: &Option<turnstile_core::telemetry::NotReady>| {
        n.as_ref().map_or_else(
            || "no reason given".to_owned(),
            |n| {
                format!(
                    "{}, since {}",
                    n.why,
                    turnstile_core::domain::rfc3339(n.since_ms)
                )
            },
        )
    };
    for r in fleet.replicas.iter().filter(|r| !r.entry.ready) {
        lines.push(format!(
            "  not ready: {} on {} (pid {}): {}",
            r.id,
            r.entry.host,
            r.entry.pid,
            why(&r.entry.not_ready)
        ));
    }
    for r in &fleet.lost {
        let last_known = if r.ready {
            "consuming".to_owned()
        } else {
            format!("not consuming: {}", why(&r.not_ready))
        };
        lines.push(format!(
            "  LOST: {} on {} (pid {}) since {}, last heartbeat {}; last known: {last_known}, {} in flight; its terms no longer count",
            r.id, r.host, r.pid, r.lost_since, r.last_seen, r.in_flight
        ));
    }
    lines
}

/// The fleet in one line: its replicas, the terms in force, whether they agree, and how many
/// do not consume or were lost lately.
fn fleet_line(fleet: &fleet::View) -> String {
    let effective = fleet
        .effective
        .as_ref()
        .map_or_else(|| "none".to_owned(), fleet::FleetTerms::digest);
    let agree = if fleet.replicas.is_empty() {
        "none alive"
    } else if fleet.agree {
        "they agree"
    } else {
        "they run with different terms: every grant follows the strictest"
    };
    let not_ready = fleet.replicas.iter().filter(|r| !r.entry.ready).count();
    let mut trouble = String::new();
    if not_ready > 0 {
        trouble += &format!("; {not_ready} not ready");
    }
    if !fleet.lost.is_empty() {
        trouble += &format!(
            "; {} lost in the last {} min",
            fleet.lost.len(),
            fleet::LOST_RETENTION.as_secs() / 60
        );
    }
    format!(
        "fleet: {} live replica{} ({agree}); terms in force: {effective}{trouble}",
        fleet.replicas.len(),
        if fleet.replicas.len() == 1 { "" } else { "s" }
    )
}
