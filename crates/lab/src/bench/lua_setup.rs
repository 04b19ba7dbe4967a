//! `turnstile bench lua-setup`: what the pieces of `lua/include/` a script includes cost Redis
//! on every call. Redis runs a script's whole text on each EVALSHA, so before the script's own
//! work it defines every helper of its pieces. For each script, its pieces followed by
//! `return 1` are called N times, beside a bare `return 1` called as often in the same run; the
//! difference of Redis's own time per call (INFO commandstats, `cmdstat_evalsha`) is the
//! set-up. "all pieces" is every piece together: what each script ran before they were split
//! (`lua/prelude.lua`).
//!
//! Redis's counters are read before and after each measurement (no CONFIG RESETSTAT, which would
//! also reset the eviction and flush counters the scripts' loss detection reads), so run it on a
//! Redis no one else sends scripts to meanwhile.

use anyhow::{Context, bail};
use clap::Args;
use turnstile_core::config::RedisArgs;
use turnstile_core::permit::scripts;

#[derive(Args, Debug)]
pub struct LuaSetupArgs {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// EVALSHA calls of each script in each round.
    #[arg(long, default_value_t = 20_000)]
    pub calls: u64,
    /// Rounds, each over every script in turn: a figure is the median of its rounds.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Calls sent in one pipeline.
    #[arg(long, default_value_t = 500)]
    pub pipeline: u64,
}

/// One script measured: its name, how many pieces and Lua lines run before `return 1`.
struct Candidate {
    name: String,
    pieces: usize,
    lines: usize,
    sha: String,
    us_per_call: Vec<f64>,
}

/// `cmdstat_evalsha`'s calls and µs so far.
async fn evalsha_stats(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<(u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let Some(line) = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
    else {
        return Ok((0, 0));
    };
    let field = |name: &str| -> u64 {
        line.split(',')
            .find_map(|f| f.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("calls="), field("usec=")))
}

/// Redis's µs per call of `calls` EVALSHA of `sha` (no keys, no arguments).
async fn measure(
    conn: &mut redis::aio::MultiplexedConnection,
    sha: &str,
    calls: u64,
    pipeline: u64,
) -> anyhow::Result<f64> {
    let (calls_before, usec_before) = evalsha_stats(conn).await?;
    let mut left = calls;
    while left > 0 {
        let n = left.min(pipeline.max(1));
        let mut pipe = redis::pipe();
        for _ in 0..n {
            pipe.cmd("EVALSHA").arg(sha).arg(0).ignore();
        }
        pipe.query_async::<()>(conn).await?;
        left -= n;
    }
    let (calls_after, usec_after) = evalsha_stats(conn).await?;
    let counted = calls_after.saturating_sub(calls_before);
    if counted < calls {
        bail!("Redis counted {counted} EVALSHA calls of {calls}");
    }
    Ok(usec_after.saturating_sub(usec_before) as f64 / counted as f64)
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

pub async fn run(args: LuaSetupArgs) -> anyhow::Result<()> {
    if args.redis.cluster || args.redis.url.contains(',') {
        bail!("bench lua-setup measures one Redis server: give one --redis-url, not a cluster");
    }
    let client = redis::Client::open(args.redis.url.as_str()).context("the Redis URL")?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .context("connecting to Redis")?;
    let server: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await?;
    let version = server
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_owned();

    let mut texts: Vec<(String, usize, String)> = vec![("bare".to_owned(), 0, String::new())];
    for source in scripts::sources() {
        let mut name = source.name.to_owned();
        if name == "batch" {
            name.push_str(" (+ its operations)");
        }
        texts.push((name, source.pieces.len(), source.setup));
    }
    let all = scripts::all_pieces();
    texts.push(("all pieces".to_owned(), usize::MAX, all));
    let piece_count = scripts::sources()
        .iter()
        .flat_map(|s| s.pieces.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .len();

    let mut candidates = Vec::new();
    for (name, pieces, setup) in texts {
        let text = if setup.is_empty() {
            "return 1".to_owned()
        } else {
            format!("{setup}\nreturn 1")
        };
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&text)
            .query_async(&mut conn)
            .await
            .with_context(|| format!("SCRIPT LOAD of {name}'s pieces"))?;
        candidates.push(Candidate {
            name,
            pieces: if pieces == usize::MAX {
                piece_count
            } else {
                pieces
            },
            lines: if setup.is_empty() {
                0
            } else {
                setup.lines().count()
            },
            sha,
            us_per_call: Vec::new(),
        });
    }

    println!(
        "Lua set-up per call on Redis {version}: each script's pieces + `return 1`, {} EVALSHA per round ({} per pipeline), median of {} rounds, against a bare `return 1` in the same run",
        args.calls, args.pipeline, args.rounds
    );
    for round in 0..args.rounds.max(1) {
        eprintln!("round {} of {}", round + 1, args.rounds.max(1));
        for c in &mut candidates {
            let us = measure(&mut conn, &c.sha, args.calls, args.pipeline).await?;
            c.us_per_call.push(us);
        }
    }

    let bare = median(&candidates[0].us_per_call);
    let whole = median(&candidates[candidates.len() - 1].us_per_call) - bare;
    println!(
        "{:<28} {:>6} {:>10} {:>10} {:>12} {:>14}",
        "script", "pieces", "Lua lines", "µs/call", "set-up µs", "of all pieces"
    );
    for c in &candidates {
        let us = median(&c.us_per_call);
        let setup = us - bare;
        let share = if c.name == "bare" || whole <= 0.0 {
            String::new()
        } else {
            format!("{:.0}%", 100.0 * setup / whole)
        };
        println!(
            "{:<28} {:>6} {:>10} {:>10.2} {:>12.2} {:>14}",
            c.name, c.pieces, c.lines, us, setup, share
        );
    }
    println!(
        "(set-up µs = µs/call - bare; \"all pieces\" is every piece together, what every script ran before the split)"
    );
    Ok(())
}
