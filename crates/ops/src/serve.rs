//! `turnstile consume` as the operator runs it: one replica of the consume path with its HTTP
//! endpoints and dashboard beside it. The endpoints answer from the first moment (not ready
//! until the replica consumes); the dashboard's views are built once Redis answers, and its
//! samplers run until the replica has drained, so that the last registrations are counted too.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use clap::Args;
use secrecy::SecretString;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;
use turnstile_core::replica::{Connecting, ConsumeArgs, Starting};
use turnstile_core::telemetry::Readiness;
use turnstile_core::worker::Stats;

use crate::broker_link::BrokerLink;
use crate::broker_link::Controls;
use crate::dashboard::{self, Dashboard, ReplicaInfo};
use crate::http::{self, Endpoints, Listen};
use crate::overdue;

/// Everything `turnstile consume` is configured with: the consume path's settings and the
/// operator endpoints'.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub consume: ConsumeArgs,
    #[command(flatten)]
    pub http: HttpArgs,
}

/// Where and how the operator endpoints are served.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "HTTP endpoints")]
pub struct HttpArgs {
    /// The dashboard (/), /api/dashboard, /metrics, /healthz, /readyz; `127.0.0.1:0` picks a
    /// free port; `off` disables.
    #[arg(long = "http-addr", env = "TURNSTILE_HTTP_ADDR", default_value = "0.0.0.0:9464", value_parser = http::parse_addr)]
    pub http_addr: Listen,
    /// When set, the dashboard (/) and its API need this token (bearer, or the cookie set by
    /// opening /?token=…), and the dashboard's actions (pause, resume, limits, replays) are on;
    /// /metrics, /healthz and /readyz stay open. Unset, the actions are off.
    #[arg(
        long = "http-token",
        env = "TURNSTILE_HTTP_TOKEN",
        hide_env_values = true,
        value_parser = http::parse_token
    )]
    pub http_token: Option<SecretString>,
}

impl HttpArgs {
    /// No endpoints (the lab's extra replicas).
    pub fn off() -> Self {
        Self {
            http_addr: Listen::Off,
            http_token: None,
        }
    }
}

impl From<ConsumeArgs> for ServeArgs {
    /// A replica serving no endpoints.
    fn from(consume: ConsumeArgs) -> Self {
        Self {
            consume,
            http: HttpArgs::off(),
        }
    }
}

/// A replica with its endpoints.
pub struct Served {
    pub stats: Arc<Stats>,
    pub ready: Readiness,
    /// Where the endpoints listen, if they do.
    pub http_addr: Option<SocketAddr>,
    /// The replica until it has drained, then the dashboard's samplers until they stopped
    /// (whether or not anyone waits for it).
    done: JoinHandle<anyhow::Result<()>>,
}

impl Served {
    /// Serves the endpoints (not ready yet), then starts the replica (see
    /// [`turnstile_core::replica::Replica::start`]) and, once it consumes, the dashboard's
    /// samplers, which run until the replica has drained.
    pub async fn start(args: ServeArgs, shutdown: CancellationToken) -> anyhow::Result<Self> {
        let algorithm = args.consume.limiter.algorithm;
        let starting = Starting::new(args.consume)?;
        let views = Arc::new(OnceLock::new());
        let actions = args.http.http_token.is_some();
        let endpoints = Endpoints {
            token: args.http.http_token,
            ready: starting.ready.clone(),
            stats: starting.stats.clone(),
            dashboard: views.clone(),
        };
        let http_addr = match args.http.http_addr {
            Listen::At(addr) => {
                // Every series from the first scrape: counters at 0, not ready yet, not
                // connected yet, the build and the process.
                http::prometheus();
                turnstile_core::series::export_at_zero(algorithm, &starting.route_names());
                crate::process::collect();
                starting.ready.set(false);
                Some(http::serve(addr, endpoints, shutdown.clone()).await?)
            }
            Listen::Off => None,
        };
        let (stats, ready) = (starting.stats.clone(), starting.ready.clone());
        // Shut down before it consumed: the endpoints keep answering (not ready) until
        // `shutdown`, and there is nothing to drain.
        let stopped = || Self {
            stats: stats.clone(),
            ready: ready.clone(),
            http_addr,
            done: tokio::spawn(async { Ok(()) }),
        };
        let Some(connecting) = starting.connect_redis(&shutdown).await? else {
            return Ok(stopped());
        };
        // The operator side's own broker connection (never the replica's): queue depths, the
        // broker's health, dead letters. Only a replica serving HTTP has one.
        let link = match http_addr {
            Some(_) => Some(Arc::new(BrokerLink::new(
                &connecting.args().broker.amqp.url,
                connecting.args().topology(),
            )?)),
            None => None,
        };
        let mut dashboard = dashboard_of(&connecting, &stats, &ready).with_actions(actions);
        if let Some(link) = &link {
            dashboard = dashboard.with_broker(link.clone());
        }
        let dashboard = Arc::new(dashboard);
        let (admin, records) = (connecting.permits.admin(), connecting.permits.records());
        let _ = views.set(dashboard.clone());
        // The link reads the broker from the start: while the replica waits for it, the page
        // says why.
        let stop = CancellationToken::new();
        let watching = link.map(|link| tokio::spawn(link.watch(stop.clone())));
        let Some(replica) = connecting.consume(shutdown).await? else {
            stop.cancel();
            if let Some(watching) = watching {
                let _ = watching.await;
            }
            return Ok(stopped());
        };
        if let Some(addr) = http_addr {
            info!(%addr, "serving the dashboard, /metrics, /healthz and /readyz");
        }
        let mut samplers = vec![tokio::spawn(dashboard::sample(dashboard, stop.clone()))];
        samplers.extend(watching);
        if http_addr.is_some() {
            samplers.push(tokio::spawn(overdue::watch(admin, records, stop.clone())));
        }
        let done = tokio::spawn(async move {
            let ran = replica.wait().await;
            stop.cancel();
            for sampler in samplers {
                let _ = sampler.await;
            }
            ran
        });
        Ok(Self {
            stats,
            ready,
            http_addr,
            done,
        })
    }

    /// Waits until the replica has drained and stopped, and the samplers with it.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.done.await.context("the replica task panicked")?
    }
}

/// The dashboard of a replica that has just connected to Redis.
fn dashboard_of(connecting: &Connecting, stats: &Arc<Stats>, ready: &Readiness) -> Dashboard {
    let args = connecting.args();
    Dashboard::new(
        connecting.permits.admin(),
        connecting.permits.records(),
        stats.clone(),
        ready.clone(),
        ReplicaInfo {
            queue: args.broker.queue.name.clone(),
            algorithm: args.limiter.algorithm.name(),
            limit: args.limiter.limit.to_string(),
            workers: args.workers,
            prefetch: args.prefetch(),
            pid: std::process::id(),
        },
    )
    .with_fleet(connecting.fleet.clone())
    .with_controls(Controls {
        permits: connecting.permits.clone(),
        done_ttl: args.done.ttl,
    })
}
