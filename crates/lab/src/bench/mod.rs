//! `turnstile bench ...`: measurements that print figures, each beside a baseline measured in the
//! same run on the same machine (no thresholds: the figures are for people to read).

mod adaptive;
pub mod bulk;
mod commandstats;
mod depth;
pub mod eta;
pub mod faults;
mod give_way;
mod lua_setup;
pub mod partition;
pub mod passes;
mod permits;
pub mod rolling;
pub mod routes;
pub mod scenario;
pub mod sellers;
mod shares;
pub mod supersede;
pub mod throughput;
mod workload;

use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;

use turnstile_core::config::RedisArgs;

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
    /// What the Lua pieces each script includes cost Redis per call, beside a bare script.
    LuaSetup(Box<lua_setup::LuaSetupArgs>),
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
    /// What a backlog hours deep costs the broker per message under each consumer timeout
    /// (TURNSTILE_CONSUMER_TIMEOUT), counted by the delay ladder's own planner.
    Passes(Box<passes::PassesArgs>),
    /// One seller's flood of priority messages on top of its backlog: the other sellers'
    /// permit latency and PING beside the same backlog without the flood.
    GiveWay(Box<give_way::GiveWayArgs>),
    /// A rolling deploy that changes the limit: replica A at the old limit drains a backlog,
    /// B starts at the new one, A is stopped; the windows over either limit from B's readiness,
    /// counted on the downstream's clock.
    Rolling(Box<rolling::RollingArgs>),
    /// A mixed backlog on several routes under one budget per seller, against a strict mock
    /// enforcing every limit: each seller's drain beside the longest any one limit allows.
    Routes(Box<routes::RoutesBenchArgs>),
    /// Superseded rows: a corrected upload with and without `product_key` (calls, when the
    /// corrected upload was done, every row's outcome), and a burst of updates per product.
    Supersede(Box<supersede::SupersedeArgs>),
    /// Bulk calls: one seller's upload one row per call and in bulk calls counted per call,
    /// then counted per row (calls, when the upload was done, rows registered, over the limit).
    Bulk(Box<bulk::BulkArgs>),
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
        BenchCommand::LuaSetup(args) => lua_setup::run(*args).await?,
        BenchCommand::Passes(args) => passes::run(*args),
        BenchCommand::GiveWay(args) => give_way::run(*args).await?,
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
        BenchCommand::Rolling(args) => {
            if !rolling::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Routes(args) => {
            if !routes::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Eta(args) => {
            if !eta::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Supersede(args) => {
            if !supersede::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        BenchCommand::Bulk(args) => {
            if !bulk::run(*args).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
