//! `turnstile bench ...`: measurements that print figures, each beside a baseline measured in the
//! same run on the same machine (no thresholds: the figures are for people to read).

mod adaptive;
mod depth;
pub mod eta;
pub mod faults;
mod permits;
pub mod scenario;
pub mod sellers;
mod shares;
pub mod throughput;

use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;

use anyhow::Context;
use turnstile_core::config::RedisArgs;
use turnstile_core::permit::RedisConn;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Permits/s and latency of each algorithm from one process, beside a plain INCR round trip.
    Permits {
        #[command(flatten)]
        redis: RedisArgs,
        /// Concurrent callers.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// How long each measurement runs.
        #[arg(long, default_value = "3s", value_parser = turnstile_core::config::duration_arg)]
        duration: Duration,
        /// Distinct sellers the callers spread over.
        #[arg(long, default_value_t = 1000)]
        sellers: usize,
        /// The global limit measured last, over sellers whose own limits are out of the way.
        #[arg(long = "global-limit", default_value = "10000/1s", value_parser = turnstile_core::config::limits_arg)]
        global_limit: turnstile_core::config::Limits,
    },
    /// A busy seller's backlog ahead of many small sellers, against a strict downstream.
    Scenario(Box<scenario::ScenarioArgs>),
    /// Drain rate with limits out of the way, beside a bare ack loop and a bare parse-POST-ack
    /// loop on the same broker; Redis round trips per message; permit latency; 1..N replicas.
    Throughput(Box<throughput::ThroughputArgs>),
    /// A workload while a replica is SIGKILLed, Redis restarts and broker connections are cut.
    Faults(Box<faults::FaultArgs>),
    /// Ten thousand active sellers: Redis memory per seller for each algorithm, keys gone after
    /// idleness, and a replica's memory as it serves them.
    Sellers(Box<sellers::SellersArgs>),
    /// One seller's batch against a strict downstream: the ETA `GET /api/batches/{id}` gives at
    /// moments of its upload, beside when its last message really registered.
    Eta(Box<eta::EtaArgs>),
    /// One seller's Redis memory against the depth of its backlog (each queued message asks
    /// for a permit, reserving), beside the smallest depth.
    Depth {
        #[command(flatten)]
        redis: RedisArgs,
        /// The seller's limit.
        #[arg(long, default_value = "100/1m", value_parser = turnstile_core::config::limit_arg)]
        limit: turnstile_core::config::Limit,
        /// Backlog depths to weigh (comma-separated).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "1000,10000,100000,1000000"
        )]
        depths: Vec<u64>,
        /// Concurrent callers.
        #[arg(long, default_value_t = 32)]
        concurrency: u64,
        /// Also print JSON lines.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(which: BenchCommand) -> anyhow::Result<ExitCode> {
    match which {
        BenchCommand::Permits {
            redis,
            concurrency,
            duration,
            sellers,
            global_limit,
        } => {
            permits::run(&redis, concurrency, duration, sellers, global_limit).await?;
        }
        BenchCommand::Depth {
            redis,
            limit,
            depths,
            concurrency,
            json,
        } => {
            depth::run(&redis, limit, &depths, concurrency, json).await?;
        }
        BenchCommand::Faults(args) => {
            if !faults::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Throughput(args) => {
            if !throughput::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Scenario(args) => {
            if !scenario::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Sellers(args) => {
            if !sellers::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Eta(args) => {
            if !eta::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Latency percentiles of a sample, in microseconds.
pub fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// What Redis has executed so far, summed over every node: scripts called (EVALSHA, EVAL) and
/// all commands (the commands scripts run inside Redis included).
pub struct CommandCalls {
    pub scripts: u64,
    pub total: u64,
    /// Nodes asked (each INFO call itself counts one command on its node).
    pub nodes: u64,
    /// Per command: (calls, µs spent), summed over the nodes.
    pub by_command: std::collections::BTreeMap<String, (u64, u64)>,
}

/// Where Redis's time went, per message, for one command (INFO commandstats). A script's time
/// includes the commands it ran, which are also counted under their own names.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CommandTime {
    pub command: String,
    pub calls_per_message: f64,
    pub us_per_message: f64,
}

pub async fn command_calls(redis: &RedisConn) -> anyhow::Result<CommandCalls> {
    let mut conn = redis.clone();
    let infos: Vec<String> = match redis {
        RedisConn::Single(_) => vec![
            redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await?,
        ],
        RedisConn::Cluster(_) => {
            let by_node: std::collections::HashMap<String, String> = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await
                .context("INFO commandstats on every node")?;
            by_node.into_values().collect()
        }
    };
    let mut calls = CommandCalls {
        scripts: 0,
        total: 0,
        nodes: infos.len() as u64,
        by_command: Default::default(),
    };
    for info in &infos {
        for line in info.lines() {
            let Some((name, rest)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            let field = |name: &str| -> u64 {
                rest.split(',')
                    .find_map(|f| f.strip_prefix(name))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            let (n, usec) = (field("calls="), field("usec="));
            let entry = calls.by_command.entry(name.to_owned()).or_default();
            *entry = (entry.0 + n, entry.1 + usec);
            calls.total += n;
            if name.starts_with("eval") {
                calls.scripts += n;
            }
        }
    }
    Ok(calls)
}

impl CommandCalls {
    /// Per message of `messages`, since `before`: each command's calls and µs, most time first
    /// (the `info` asked for these counts left out).
    pub fn time_per_message_since(&self, before: &CommandCalls, messages: u64) -> Vec<CommandTime> {
        let n = messages.max(1) as f64;
        let mut times: Vec<CommandTime> = self
            .by_command
            .iter()
            .filter(|(name, _)| name.as_str() != "info")
            .filter_map(|(name, &(calls, usec))| {
                let (calls_before, usec_before) =
                    before.by_command.get(name).copied().unwrap_or_default();
                let calls = calls.saturating_sub(calls_before);
                (calls > 0).then(|| CommandTime {
                    command: name.clone(),
                    calls_per_message: calls as f64 / n,
                    us_per_message: usec.saturating_sub(usec_before) as f64 / n,
                })
            })
            .collect();
        times.sort_by(|a, b| b.us_per_message.total_cmp(&a.us_per_message));
        times
    }

    /// Per message of `messages`, since `before`: (scripts called, commands executed, the
    /// commands inside scripts included; each INFO asked for these counts left out).
    pub fn per_message_since(&self, before: &CommandCalls, messages: u64) -> (f64, f64) {
        let n = messages.max(1) as f64;
        let scripts = self.scripts.saturating_sub(before.scripts);
        let commands = self.total.saturating_sub(before.total + before.nodes);
        (scripts as f64 / n, commands as f64 / n)
    }
}
