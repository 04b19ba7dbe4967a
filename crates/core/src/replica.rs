//! One replica: the composition root of the consume path. It connects to Redis and RabbitMQ,
//! declares the topology, consumes the work queue and, beside it, the return queue (messages
//! back from a delay) with bounded concurrency, reconnects when the broker goes away, and drains
//! on shutdown. It starts in stages ([`Starting`] → [`Connecting`] → [`Replica`]) so that the
//! operator side can serve its endpoints from the first moment and build its views once Redis
//! answers, without the consume path knowing it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use clap::Args;
use futures::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::broker::ladder::Ladder;
use crate::broker::{self, BrokerArgs, Publisher, Settler, Topology};
use crate::config::{LimiterArgs, RedisArgs, duration_arg};
use crate::downstream::{Downstream, DownstreamArgs};
use crate::fleet;
use crate::links::{self, Links};
use crate::permit::{self, PermitStore, RedisClient};
use crate::routes::{Routes, RoutesArgs};
use crate::telemetry::{self, Readiness};
use crate::worker::{Stats, Worker, WorkerSettings};

/// Everything `turnstile consume` is configured with (flags and `TURNSTILE_*` variables).
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Consumer")]
pub struct ConsumeArgs {
    /// Concurrent downstream calls per replica.
    #[arg(long, env = "TURNSTILE_WORKERS", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub workers: u32,
    /// AMQP prefetch [default: 8 x workers, at least 64]: bounds the messages in the replica,
    /// held ones included.
    #[arg(long, env = "TURNSTILE_PREFETCH", value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: Option<u16>,
    /// Messages each delay ladder level's consumer holds at most (12 levels): a replica holds at
    /// most 12 times as many delayed messages, bodies included.
    #[arg(long = "delay-prefetch", env = "TURNSTILE_DELAY_PREFETCH", default_value_t = crate::broker::ladder::DEFAULT_PREFETCH, value_parser = clap::value_parser!(u16).range(1..))]
    pub delay_prefetch: u16,
    /// Failed attempts (5xx, timeouts, connection errors) before a message is dead-lettered.
    #[arg(long = "max-attempts", env = "TURNSTILE_MAX_ATTEMPTS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// Cap on a pause taken from a 429's Retry-After (a longer one is capped and logged).
    #[arg(long = "max-pause", env = "TURNSTILE_MAX_PAUSE", default_value = "1h", value_parser = duration_arg)]
    pub max_pause: Duration,
    /// A message throttled (429) this long is dead-lettered as `throttled`.
    #[arg(long = "throttle-deadline", env = "TURNSTILE_THROTTLE_DEADLINE", default_value = "24h", value_parser = duration_arg)]
    pub throttle_deadline: Duration,
    /// Longest wait for a permit held inside the replica; longer waits go through the broker.
    #[arg(long, env = "TURNSTILE_HOLD", default_value = "2s", value_parser = duration_arg)]
    pub hold: Duration,
    /// First retry delay after a failed attempt; doubles with jitter up to --retry-max.
    #[arg(long = "retry-min", env = "TURNSTILE_RETRY_MIN", default_value = "1s", value_parser = duration_arg)]
    pub retry_min: Duration,
    /// Longest retry delay after failed attempts.
    #[arg(long = "retry-max", env = "TURNSTILE_RETRY_MAX", default_value = "5m", value_parser = duration_arg)]
    pub retry_max: Duration,
    #[command(flatten)]
    pub done: DoneTtlArgs,
    /// On SIGTERM, how long in-flight calls may take to finish; after it the replica closes its
    /// connection anyway and the broker redelivers what was still unsettled.
    #[arg(long = "shutdown-grace", env = "TURNSTILE_SHUTDOWN_GRACE", default_value = "8s", value_parser = duration_arg)]
    pub shutdown_grace: Duration,
    /// Start even when Redis may evict keys (`maxmemory` with a `maxmemory-policy` other than
    /// `noeviction`). A seller whose state is evicted is then paused for one window.
    #[arg(long = "allow-eviction", env = "TURNSTILE_ALLOW_EVICTION", default_value = "off", value_name = "ON|OFF", num_args = 0..=1, default_missing_value = "on", action = clap::ArgAction::Set, value_parser = crate::config::Switch)]
    pub allow_eviction: bool,
    /// Join a fleet whose terms are more than ten times looser than this replica's own over
    /// some window (a limit lowered that far on purpose). Without it such a replica stays not
    /// ready, its terms not counted, so that a mistyped limit cannot stall every seller.
    #[arg(long = "allow-stricter-terms", env = "TURNSTILE_ALLOW_STRICTER_TERMS", default_value = "off", value_name = "ON|OFF", num_args = 0..=1, default_missing_value = "on", action = clap::ArgAction::Set, value_parser = crate::config::Switch)]
    pub allow_stricter_terms: bool,
    #[command(flatten)]
    pub downstream: DownstreamArgs,
    #[command(flatten)]
    pub routes: RoutesArgs,
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub limiter: LimiterArgs,
    #[command(flatten)]
    pub links: crate::links::LinkArgs,
}

/// How long completion records are kept (`TURNSTILE_DONE_TTL`), declared once: `turnstile
/// consume` and `turnstile dead-letters replay` flatten it.
#[derive(Args, Clone, Copy, Debug)]
pub struct DoneTtlArgs {
    /// How long completion records are kept: a registered message redelivered within it is not
    /// called again, and a dead letter whose replay fails is recorded as dead again for that
    /// long.
    #[arg(id = "done_ttl", long = "done-ttl", env = "TURNSTILE_DONE_TTL", default_value = "7d", value_name = "DONE_TTL", value_parser = duration_arg)]
    pub ttl: Duration,
}

impl ConsumeArgs {
    /// The prefetch of each consumer channel (work and return queue).
    pub fn prefetch(&self) -> u16 {
        self.prefetch
            .unwrap_or_else(|| (self.workers.saturating_mul(8)).clamp(64, u16::MAX as u32) as u16)
    }
    /// The queues this replica consumes and publishes to.
    pub fn topology(&self) -> Topology {
        self.broker.topology()
    }
}

/// A running replica's handles.
pub struct Replica {
    pub stats: Arc<Stats>,
    pub ready: Readiness,
    done: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Replica {
    /// Checks the configuration, then connects to Redis and the broker, retrying with backoff
    /// for as long as either is unreachable, and returns once the replica is consuming. A
    /// configuration error fails at once. If `shutdown` comes first, the returned replica has
    /// already stopped.
    pub async fn start(args: ConsumeArgs, shutdown: CancellationToken) -> anyhow::Result<Self> {
        let starting = Starting::new(args)?;
        let (stats, ready) = (starting.stats.clone(), starting.ready.clone());
        let consuming = match starting.connect_redis(&shutdown).await? {
            Some(connecting) => connecting.consume(shutdown).await?,
            None => None,
        };
        Ok(consuming.unwrap_or_else(|| Replica::stopped(stats, ready)))
    }

    /// The handles of a replica that stopped before it consumed anything.
    fn stopped(stats: Arc<Stats>, ready: Readiness) -> Self {
        Self {
            stats,
            ready,
            done: tokio::spawn(async { Ok(()) }),
        }
    }

    /// Waits until the replica has drained and stopped (after `shutdown` is cancelled).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.done.await.context("the replica task panicked")?
    }
}

/// A replica whose configuration was checked and that has not connected yet: its readiness
/// (false) and counters can be watched already.
pub struct Starting {
    pub stats: Arc<Stats>,
    pub ready: Readiness,
    args: ConsumeArgs,
    redis: RedisClient,
    downstream: Downstream,
    /// The routes of the routes file (none without one).
    routes: Arc<Routes>,
    /// The broker's nodes, and which to try first (see [`broker::Nodes`]).
    nodes: Arc<broker::Nodes>,
    /// The replica's links to the broker and Redis (see [`crate::links`]).
    links: Links,
}

impl Starting {
    /// Checks the configuration; fails at once on an error. No I/O.
    pub fn new(mut args: ConsumeArgs) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !args.broker.queue.name.is_empty() && args.broker.queue.name.len() <= 200,
            "TURNSTILE_QUEUE must be 1 to 200 characters"
        );
        let heartbeat = args.links.heartbeat(args.downstream.timeout);
        if let Some(warning) = args
            .links
            .heartbeat_warning(heartbeat, args.downstream.timeout)
        {
            warn!("{warning}");
        }
        let nodes =
            Arc::new(broker::Nodes::parse(&args.broker.amqp.url)?.with_heartbeat(heartbeat));
        args.limiter.check().map_err(anyhow::Error::msg)?;
        let routes = Arc::new(Routes::load(&args.routes)?);
        let exact_log = args.limiter.algorithm == crate::config::Algorithm::SlidingWindow;
        anyhow::ensure!(
            exact_log || routes.is_empty(),
            "TURNSTILE_ROUTES_FILE needs TURNSTILE_ALGORITHM=sliding-window (a route's units are kept per call in a log)"
        );
        anyhow::ensure!(
            exact_log || args.downstream.cost_header.is_none(),
            "TURNSTILE_COST_HEADER needs TURNSTILE_ALGORITHM=sliding-window (a call's units are corrected in the log)"
        );
        // A bulk call gathers its rows from what the replica holds: a derived prefetch leaves
        // room for two full calls.
        let bulk_rows = routes.most_bulk_rows();
        if args.prefetch.is_none() && bulk_rows > 0 {
            let rows = u16::try_from(bulk_rows.saturating_mul(2)).unwrap_or(u16::MAX);
            args.prefetch = Some(args.prefetch().max(rows));
        }
        let stats = Arc::new(Stats::default());
        Ok(Self {
            nodes,
            links: Links::new(args.links.link_timeout),
            redis: RedisClient::new(&args.redis)?,
            downstream: Downstream::new(&args.downstream)?
                .recording(stats.downstream.clone())
                .with_routes(routes.clone()),
            routes,
            stats,
            ready: Readiness::default(),
            args,
        })
    }

    /// The names of the routes of the routes file (none without one).
    pub fn route_names(&self) -> Vec<String> {
        self.routes
            .iter()
            .map(|route| route.name.as_str().to_owned())
            .collect()
    }

    /// Connects to Redis, retrying with backoff; `None` if `shutdown` comes first.
    pub async fn connect_redis(
        self,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Option<Connecting>> {
        let Some(conn) =
            until_connected("Redis", shutdown, always_retry, Outage::Unreported, || {
                self.redis.connect()
            })
            .await?
            .map(|(conn, _)| conn)
        else {
            return Ok(None);
        };
        metrics::gauge!("turnstile_redis_connected").set(1.0);
        check_memory_policy(&conn, self.args.allow_eviction).await?;
        if let Err(error) = permit::scripts::load_every(&conn).await {
            warn!(%error, "could not load the limiter's scripts into Redis; each is loaded at its first use");
        }
        let permits =
            PermitStore::new(conn, &self.args.redis.key_prefix, self.args.limiter.clone())
                .with_call_timeout(self.args.downstream.timeout)
                .with_routes(self.routes.clone())
                .with_learned_charges(self.args.downstream.cost_header.is_some());
        permits.probe_set_nx_get().await;
        let fleet = Arc::new(
            fleet::Member::new(
                &permits,
                &self.args.redis.key_prefix,
                self.args.limiter.clone(),
                self.stats.clone(),
                self.ready.clone(),
                &self.args.broker.queue.name,
            )
            .allowing_stricter_terms(self.args.allow_stricter_terms),
        );
        Ok(Some(Connecting {
            permits,
            fleet,
            starting: self,
        }))
    }
}

/// Refuses a Redis that may evict keys unless `allowed`: a limiter state evicted would be taken
/// for a new seller's (see `permit::server`). A server that does not say (INFO refused) is let
/// through with a warning.
async fn check_memory_policy(conn: &permit::RedisConn, allowed: bool) -> anyhow::Result<()> {
    let policies = match permit::server::memory_policies(conn).await {
        Ok(policies) => policies,
        Err(error) => {
            warn!(%error, "could not read Redis's maxmemory-policy (INFO memory); make sure it is noeviction");
            return Ok(());
        }
    };
    match permit::server::evicting(&policies) {
        Some(policy) if !allowed => anyhow::bail!(
            "Redis may evict turnstile's keys ({policy}), and an evicted limiter state would let a second window of calls through: set maxmemory-policy noeviction, or TURNSTILE_ALLOW_EVICTION=true to start anyway (a seller whose state is evicted is then paused for one window)"
        ),
        Some(policy) => {
            warn!(%policy, "Redis may evict turnstile's keys (TURNSTILE_ALLOW_EVICTION): a seller whose state is evicted is paused for one window");
            Ok(())
        }
        None => Ok(()),
    }
}

/// A replica connected to Redis, not yet to the broker.
pub struct Connecting {
    /// The replica's permit store (the operator side reads its views through it).
    pub permits: PermitStore,
    /// The replica as a member of the fleet (the operator side reads the fleet through it).
    pub fleet: Arc<fleet::Member>,
    starting: Starting,
}

impl Connecting {
    /// The settings the replica runs with.
    pub fn args(&self) -> &ConsumeArgs {
        &self.starting.args
    }

    /// Connects to the broker (retrying with backoff while it is unreachable) and consumes;
    /// returns once the replica is consuming; `None` if `shutdown` came first. A refusal that
    /// retrying cannot fix (credentials, vhost, a queue declared with other arguments) fails
    /// with the broker's reason.
    pub async fn consume(self, shutdown: CancellationToken) -> anyhow::Result<Option<Replica>> {
        let Starting {
            stats,
            ready,
            args,
            downstream,
            routes,
            nodes,
            links,
            ..
        } = self.starting;
        let (permits, fleet) = (self.permits, self.fleet);
        // Consumes only once every live replica grants under the fleet's terms, this one's
        // included (see `fleet`).
        if !fleet.join(&shutdown).await {
            fleet.leave().await;
            return Ok(None);
        }
        // The heartbeats go on until the replica has drained (it grants until then).
        let watcher_stop = CancellationToken::new();
        let heartbeats = tokio::spawn(fleet.clone().run(watcher_stop.clone()));
        let worker = Arc::new(new_worker(
            &args,
            &permits,
            downstream,
            routes,
            stats.clone(),
            &links,
        ));
        let redis_watch = tokio::spawn(watch_redis(
            permits.conn().clone(),
            links.clone(),
            ready.clone(),
            watcher_stop.clone(),
        ));
        let opened = until_connected(
            "RabbitMQ",
            &shutdown,
            broker::is_configuration_error,
            Outage::Unreported,
            || Session::open(&args, &worker, &nodes),
        )
        .await
        .context("TURNSTILE_AMQP_URL / TURNSTILE_QUEUE_TYPE: the broker refused the replica")?;
        let Some((session, _)) = opened else {
            watcher_stop.cancel();
            let _ = tokio::join!(heartbeats, redis_watch);
            return Ok(None);
        };
        // Series that their tasks set again soon, exported from the first scrape on.
        let longest_hold = args.broker.topology().holds().longest();
        metrics::gauge!("turnstile_delay_longest_hold_seconds").set(longest_hold.as_secs_f64());
        metrics::gauge!("turnstile_redis_cold_start_pause_seconds").set(0.0);
        ready.set(true);
        metrics::gauge!("turnstile_broker_connected").set(1.0);
        let terms = permits.limiter();
        info!(queue = %args.broker.queue.name, workers = args.workers, prefetch = args.prefetch(), algorithm = %terms.algorithm, limit = %terms.limit, broker = %session.node, consumer_timeout = %args.broker.consumer_timeout, longest_hold_s = args.broker.topology().holds().longest().as_secs(), "consuming");
        // The reschedule watcher outlives `shutdown` until the replica has drained.
        let watcher = tokio::spawn(permit::watch_reschedules(
            permits.clone(),
            worker.reschedules.clone(),
            watcher_stop.clone(),
        ));
        let memory_watch = tokio::spawn(permit::server::watch_memory_policy(
            permits.conn().clone(),
            watcher_stop.clone(),
        ));
        let cold_start_watch = tokio::spawn(permit::server::watch_cold_start(
            permits.conn().clone(),
            longest_span(&terms),
            terms.redis_durable,
            stats.redis_cold_start_until_ms.clone(),
            watcher_stop.clone(),
        ));
        let repeats = tokio::spawn(crate::telemetry::repeats::report(watcher_stop.clone()));
        let ready_for_run = ready.clone();
        let done = tokio::spawn(async move {
            let ran = run(args, worker, nodes, session, ready_for_run, shutdown).await;
            // What calls made with permit-block units answered, written before the end.
            let _ =
                tokio::time::timeout(Duration::from_secs(1), permits.write_pool_answers()).await;
            watcher_stop.cancel();
            let _ = tokio::join!(
                watcher,
                memory_watch,
                cold_start_watch,
                repeats,
                heartbeats,
                redis_watch
            );
            ran
        });
        Ok(Some(Replica { stats, ready, done }))
    }
}

/// The longest window + guard of `terms`' limits (the default stack and the global limit): how
/// long a Redis that just started makes sellers wait, at most.
fn longest_span(terms: &crate::config::LimiterArgs) -> Duration {
    terms
        .limit
        .iter()
        .chain(
            terms
                .global_limit
                .0
                .iter()
                .flat_map(crate::config::Limits::iter),
        )
        .map(|l| l.window() + terms.guard_for(l.window()))
        .max()
        .unwrap_or_default()
}

/// The replica's one worker (shared by every delivery task).
fn new_worker(
    args: &ConsumeArgs,
    permits: &PermitStore,
    downstream: Downstream,
    routes: Arc<Routes>,
    stats: Arc<Stats>,
    links: &Links,
) -> Worker {
    let prefetch = args.prefetch();
    let (reschedules, _) = tokio::sync::broadcast::channel(1024);
    Worker {
        limiter: Arc::new(permits.clone()),
        progress: Arc::new(permits.clone()),
        downstream: Arc::new(downstream),
        routes,
        topology: args.topology(),
        settings: WorkerSettings {
            max_attempts: args.max_attempts,
            hold: args.hold,
            max_pause: args.max_pause,
            throttle_deadline: args.throttle_deadline,
            hold_capacity: (prefetch as usize * 3 / 4).max(1),
            done_ttl: args.done.ttl,
            retry_min: args.retry_min,
            retry_max: args.retry_max,
        },
        workers: Arc::new(Semaphore::new(args.workers as usize)),
        due_lane: Arc::new(Semaphore::new((args.workers as usize / 4).max(1))),
        ask_ahead: crate::worker::AskAhead::new(args.workers as usize),
        stats,
        reschedules,
        terms: permits.applied().watch_terms(),
        records_in_writing: Default::default(),
        seller_waits: Default::default(),
        seen_batches: Default::default(),
        links: links.clone(),
        records_later: Default::default(),
        gathers: Default::default(),
    }
}

/// One broker connection with its channels and consumers.
struct Session {
    connection: Arc<lapin::Connection>,
    /// The node it is connected to, its URL's password hidden.
    node: String,
    /// The connection's own events: its error, the broker blocking its publishes (in a mutex
    /// only to be `Sync`: read through `get_mut`).
    events: std::sync::Mutex<futures::stream::BoxStream<'static, lapin::Event>>,
    publisher: Publisher,
    /// The results' own channel (see `broker::results`).
    results: Arc<dyn broker::results::ResultSink>,
    /// New messages, from producers (and from older replicas' returns).
    work: Intake,
    /// Messages coming back after a delay (`<q>.ready`).
    returns: Intake,
    /// The settler of the delay ladder's channel, once the ladder consumes: the workers settle
    /// the due messages the ladder hands them there.
    ladder: Option<Settler>,
}

impl Session {
    async fn open(
        args: &ConsumeArgs,
        worker: &Worker,
        nodes: &broker::Nodes,
    ) -> anyhow::Result<Self> {
        let name = format!(
            "turnstile {} pid {}",
            args.broker.queue.name,
            std::process::id()
        );
        let connection = Arc::new(nodes.connect(&name).await?);
        let node = nodes.connected_node();
        // What the broker agreed to (the lower of its own and the one asked), not only what
        // was asked.
        let negotiated = connection.configuration().heartbeat();
        if let Some(warning) = args
            .links
            .heartbeat_warning(negotiated, args.downstream.timeout)
        {
            warn!(broker = %node, "{warning}");
        }
        let events = std::sync::Mutex::new(connection.events_listener().boxed());
        let publisher = Publisher::open(&connection)
            .await?
            .rescuing_to(worker.topology.ready())
            .counting(worker.stats.broker.clone());
        worker.topology.declare(&connection).await?;
        let results: Arc<dyn broker::results::ResultSink> =
            Arc::new(broker::Results::open(connection.clone(), &worker.topology.results()).await?);
        let tag = format!(
            "turnstile-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let prefetch = args.prefetch();
        let cost = &worker.stats.broker;
        let work = Intake::open(
            &connection,
            worker.topology.work(),
            prefetch,
            tag.clone(),
            cost,
        )
        .await?;
        let returns = Intake::open(
            &connection,
            worker.topology.ready(),
            prefetch,
            format!("{tag}-ready"),
            cost,
        )
        .await?;
        Ok(Self {
            connection,
            node,
            events,
            publisher,
            results,
            work,
            returns,
            ladder: None,
        })
    }

    /// Stops both consumers (no new deliveries; unsettled ones stay with the replica).
    async fn cancel(&self) {
        tokio::join!(self.work.cancel(), self.returns.cancel());
    }

    /// Sends the acks every settler collected so far.
    async fn flush(&self) -> Result<(), lapin::Error> {
        let ladder = async {
            match &self.ladder {
                Some(settler) => settler.flush().await,
                None => Ok(()),
            }
        };
        let (work, returns, ladder) = tokio::join!(
            self.work.settler.flush(),
            self.returns.settler.flush(),
            ladder
        );
        work.and(returns).and(ladder)
    }
}

/// A queue the workers take deliveries from, on a channel of its own: the channel's prefetch
/// bounds what the replica holds from this queue alone, and its settler batches the acks of
/// this queue's delivery tags alone, so neither queue's deliveries can hold up the other's.
struct Intake {
    queue: String,
    channel: lapin::Channel,
    settler: Settler,
    consumer: lapin::Consumer,
    tag: String,
}

impl Intake {
    async fn open(
        connection: &lapin::Connection,
        queue: &str,
        prefetch: u16,
        tag: String,
        cost: &Arc<broker::BrokerCost>,
    ) -> anyhow::Result<Self> {
        let channel = connection
            .create_channel()
            .await
            .with_context(|| format!("opening the consumer channel of {queue:?}"))?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .with_context(|| format!("setting the prefetch of {queue:?}"))?;
        let consumer = channel
            .basic_consume(
                queue.into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("consuming from {queue:?}"))?;
        Ok(Self {
            queue: queue.to_owned(),
            settler: Settler::new(channel.clone()).counting(cost.clone()),
            channel,
            consumer,
            tag,
        })
    }

    /// The next delivery, recorded as received; or why the consumer ended (the connection was
    /// lost, or the broker cancelled the consumer).
    fn received(
        &self,
        next: Option<Result<lapin::message::Delivery, lapin::Error>>,
    ) -> Result<lapin::message::Delivery, String> {
        match next {
            Some(Ok(delivery)) => {
                self.settler.received(delivery.delivery_tag);
                Ok(delivery)
            }
            Some(Err(error)) => Err(error.to_string()),
            None => Err(format!(
                "the broker cancelled the consumer of {:?}",
                self.queue
            )),
        }
    }

    /// Stops the consumer: no new deliveries (those already received are still settled).
    async fn cancel(&self) {
        let _ = self
            .channel
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
            .await;
    }
}

/// Whether the outage `until_connected` waits out was logged already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outage {
    /// Not yet (a first connection): its first failure is logged as a warning.
    Unreported,
    /// The caller logged the lost connection: every failure is logged at debug level.
    Reported,
}

/// How long `until_connected` waited: its failed attempts, and for how long.
#[derive(Clone, Copy, Debug)]
struct Waited {
    failures: u32,
    for_ms: u64,
}

/// Calls `connect` until it succeeds, with exponential backoff and jitter (200 ms to 10 s);
/// `Ok(None)` if `shutdown` comes first, `Err` at once for an error that `hopeless` says
/// retrying cannot fix. It logs the outage once, not each attempt: its first failure as a
/// warning (unless [`Outage::Reported`]), each failure at debug level, and the connection
/// made after failures of an unreported outage.
async fn until_connected<T, F, Fut>(
    what: &str,
    shutdown: &CancellationToken,
    hopeless: fn(&anyhow::Error) -> bool,
    outage: Outage,
    connect: F,
) -> anyhow::Result<Option<(T, Waited)>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let started = tokio::time::Instant::now();
    let failures = std::sync::atomic::AtomicU32::new(0);
    let attempts = connect
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_secs(10))
                .with_jitter()
                .without_max_times(),
        )
        .when(|error| !hopeless(error))
        .notify(|error: &anyhow::Error, after| {
            let failed = failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            let error = telemetry::error_chain(error);
            if failed == 1 && outage == Outage::Unreported {
                warn!(%error, "{what} is unavailable; retrying until it answers");
            } else {
                debug!(%error, failures = failed, retry_in_ms = after.as_millis() as u64, "{what} is still unavailable");
            }
        });
    let connected = tokio::select! {
        connected = attempts => connected?,
        _ = shutdown.cancelled() => return Ok(None),
    };
    let waited = Waited {
        failures: failures.into_inner(),
        for_ms: started.elapsed().as_millis() as u64,
    };
    if waited.failures > 0 && outage == Outage::Unreported {
        info!(
            failures = waited.failures,
            waited_ms = waited.for_ms,
            "{what} answers; connected"
        );
    }
    Ok(Some((connected, waited)))
}

/// Never hopeless: keep trying.
fn always_retry(_: &anyhow::Error) -> bool {
    false
}

/// Turns each reschedule notice into a release of the delay ladder's held messages it
/// concerns, until shutdown.
async fn release_ladder_messages(
    mut notices: tokio::sync::broadcast::Receiver<permit::Rescheduled>,
    releases: tokio::sync::broadcast::Sender<broker::ladder::Release>,
    shutdown: CancellationToken,
) {
    loop {
        let notice = tokio::select! {
            notice = notices.recv() => notice,
            _ = shutdown.cancelled() => return,
        };
        match notice {
            Ok(notice) => {
                let _ = releases.send(Arc::new(move |delivery| {
                    crate::worker::released_by(&notice, delivery)
                }));
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// Consumes until shutdown, reconnecting with backoff whenever the broker connection is lost.
async fn run(
    args: ConsumeArgs,
    worker: Arc<Worker>,
    nodes: Arc<broker::Nodes>,
    first: Session,
    ready: Readiness,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let tracker = TaskTracker::new();
    let (releases, _) = tokio::sync::broadcast::channel(1024);
    tracker.spawn(release_ladder_messages(
        worker.reschedules.subscribe(),
        releases.clone(),
        shutdown.clone(),
    ));
    let consuming = Consuming {
        args: &args,
        worker: &worker,
        nodes: &nodes,
        tracker: &tracker,
        releases: &releases,
        shutdown: &shutdown,
        ready: &ready,
    };
    let links = &worker.links;
    let mut session = Some(first);
    loop {
        let mut current = match session.take() {
            Some(s) => s,
            None => {
                // A replica cut off from Redis consumes again only once Redis answers.
                if links.redis_cut() {
                    tokio::select! {
                        () = links.redis_back() => {}
                        () = shutdown.cancelled() => break,
                    }
                }
                match consuming.reconnect().await {
                    Some(s) => {
                        ready.set(true);
                        metrics::gauge!("turnstile_broker_connected").set(1.0);
                        s
                    }
                    None => break,
                }
            }
        };
        // Readiness and `turnstile_broker_connected` were said as the session ended.
        match consuming.consume(&mut current).await {
            Ended::Shutdown => {
                ready.not_ready("shutting down: draining");
                consuming.close(current).await;
                records_written(&worker, args.shutdown_grace).await;
                return Ok(());
            }
            Ended::Lost(why) => {
                metrics::counter!("turnstile_broker_errors_total").increment(1);
                warn!(error = %why, broker = %current.node, "broker connection lost; reconnecting");
            }
            Ended::HandedBack => warn!(
                why = %silent_for("Redis", links.timeout()),
                broker = %current.node,
                "handed the held and delayed messages back to the other replicas; consuming again once Redis answers"
            ),
        }
        // A hung link never answers the close: the broker drops the connection itself once
        // its heartbeats stop (see `crate::links`).
        let closing = current.connection.close(320, "reconnecting".into());
        let _ = tokio::time::timeout(Duration::from_secs(1), closing).await;
    }
    drain(&tracker, tokio::time::Instant::now() + args.shutdown_grace).await;
    records_written(&worker, args.shutdown_grace).await;
    Ok(())
}

/// Waits, within `grace`, for the completion records kept while Redis was cut off to be
/// written (see `Worker::record_later`); those left are lost with the replica (logged).
async fn records_written(worker: &Worker, grace: Duration) {
    let later = &worker.records_later;
    if !all_done(later, tokio::time::Instant::now() + grace).await {
        warn!(
            unwritten = later.len(),
            "stopping with completion records kept while Redis was cut off still unwritten: a copy of those messages published again would be called again"
        );
    }
}

/// How a broker session ended.
#[derive(Debug)]
enum Ended {
    /// Shutdown: the replica drains and stops.
    Shutdown,
    /// The session failed (why): the replica reconnects.
    Lost(String),
    /// Redis was cut off: the session handed its messages back; the replica consumes again
    /// once Redis answers.
    HandedBack,
}

/// What a link silent for the link timeout is told apart by.
fn silent_for(what: &str, timeout: Duration) -> String {
    format!(
        "{what} did not answer within {} (TURNSTILE_LINK_TIMEOUT)",
        humantime::format_duration(timeout)
    )
}

/// Probes the broker every [`links::PROBE_EVERY`] with a round trip on a channel of its own
/// (a passive declare of the work queue); returns why the session must end once one is not
/// answered within `timeout` (a hung link) or fails.
async fn probe_broker(
    connection: Arc<lapin::Connection>,
    queue: String,
    timeout: Duration,
) -> String {
    let channel = match tokio::time::timeout(timeout, connection.create_channel()).await {
        Ok(Ok(channel)) => channel,
        Ok(Err(error)) => return format!("could not open the broker probe's channel: {error}"),
        Err(_) => return silent_for("the broker", timeout),
    };
    loop {
        let asked = broker::depth(&channel, &queue);
        match tokio::time::timeout(timeout, asked).await {
            Ok(Ok(_)) => tokio::time::sleep(links::PROBE_EVERY).await,
            Ok(Err(error)) => {
                return format!(
                    "the broker refused a probe: {}",
                    telemetry::error_chain(&error)
                );
            }
            Err(_) => return silent_for("the broker", timeout),
        }
    }
}

/// Pings Redis every [`links::PROBE_EVERY`] (each within the link timeout), noting each answer
/// in `links`, and says when Redis becomes cut off or answers again (its readiness, a log line,
/// `turnstile_redis_connected`), until `stop`.
async fn watch_redis(
    conn: permit::RedisConn,
    links: Links,
    ready: Readiness,
    stop: CancellationToken,
) {
    let timeout = links.timeout();
    loop {
        let ping = permit::server::ping(&conn);
        let pinged = tokio::select! {
            pinged = tokio::time::timeout(timeout, ping) => pinged,
            () = stop.cancelled() => return,
        };
        if let Ok(Ok(())) = pinged {
            links.redis_answered();
        }
        match links.check_redis() {
            Some(true) => {
                let why = format!(
                    "{}: handing the held and delayed messages back",
                    silent_for("Redis", timeout)
                );
                warn!(
                    silent_ms = links.redis_silent_for().as_millis() as u64,
                    "{why}"
                );
                metrics::gauge!("turnstile_redis_connected").set(0.0);
                ready.not_ready(why);
            }
            Some(false) => info!("Redis answers again; consuming again"),
            None => {}
        }
        tokio::select! {
            () = tokio::time::sleep(links::PROBE_EVERY) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// What one broker session after another consumes with.
struct Consuming<'a> {
    args: &'a ConsumeArgs,
    worker: &'a Arc<Worker>,
    nodes: &'a broker::Nodes,
    tracker: &'a TaskTracker,
    releases: &'a tokio::sync::broadcast::Sender<broker::ladder::Release>,
    shutdown: &'a CancellationToken,
    /// Said not ready as soon as a session ends, before its calls in flight settle.
    ready: &'a Readiness,
}

impl Consuming<'_> {
    /// Opens a new session after a lost one (logged), retrying whatever the broker says (a
    /// permission or policy may be fixed while the replica waits, not ready); `None` if
    /// shutdown comes first.
    async fn reconnect(&self) -> Option<Session> {
        let (reopened, waited) = until_connected(
            "RabbitMQ",
            self.shutdown,
            always_retry,
            Outage::Reported,
            || Session::open(self.args, self.worker, self.nodes),
        )
        .await
        .expect("always_retry never gives up")?;
        info!(
            broker = %reopened.node,
            failures = waited.failures,
            waited_ms = waited.for_ms,
            "reconnected to the broker; consuming again"
        );
        metrics::counter!("turnstile_reconnects_total").increment(1);
        self.worker
            .stats
            .reconnects
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(reopened)
    }

    /// Consumes the session's work queue, return queue and delay ladder until shutdown, or
    /// until the session fails: its connection is lost, or a consumer or the publish channel
    /// failed.
    async fn consume(&self, current: &mut Session) -> Ended {
        let connection_lost = CancellationToken::new();
        // The session's deliveries end as at shutdown when it hands its work back (see
        // `hand_back`): each waiting message goes back through the return queue keeping its
        // reserved slot, for another replica to take.
        let handing_back = self.shutdown.child_token();
        let deliveries = TaskTracker::new();
        // Every queue feeds the same workers (and the same worker semaphore).
        let dispatch = {
            let (worker, publisher) = (self.worker.clone(), current.publisher.clone());
            let (results, tracker) = (current.results.clone(), self.tracker.clone());
            let (shutdown, lost) = (handing_back.clone(), connection_lost.clone());
            let deliveries = deliveries.clone();
            move |delivery: lapin::message::Delivery, settler: Settler| {
                let (worker, publisher) = (worker.clone(), publisher.clone());
                let results = results.clone();
                let (shutdown, lost) = (shutdown.clone(), lost.clone());
                tracker.spawn(deliveries.track_future(async move {
                    worker
                        .process(delivery, &publisher, &results, &settler, &shutdown, &lost)
                        .await
                }));
            }
        };
        let ladder = Arc::new(Ladder {
            topology: self.worker.topology.clone(),
            publisher: current.publisher.clone(),
            stats: self.worker.stats.ladder.clone(),
            cost: self.worker.stats.broker.clone(),
            prefetch: self.args.delay_prefetch,
            releases: self.releases.clone(),
            terms: self.worker.terms.clone(),
            handoff: Some(Arc::new(dispatch.clone())),
        });
        let ladder_failed = match ladder
            .start(
                &current.connection,
                self.tracker,
                self.shutdown,
                &connection_lost,
            )
            .await
        {
            Ok(settler) => {
                current.ladder = Some(settler);
                None
            }
            Err(error) => Some(format!(
                "could not consume the delay ladder: {}",
                telemetry::error_chain(&error)
            )),
        };
        let mut probe = tokio::spawn(probe_broker(
            current.connection.clone(),
            self.worker.topology.work().to_owned(),
            self.worker.links.timeout(),
        ));
        let events = current.events.get_mut().unwrap_or_else(|e| e.into_inner());
        let ended = match ladder_failed {
            Some(why) => Ended::Lost(why),
            None => loop {
                tokio::select! {
                    _ = self.shutdown.cancelled() => break Ended::Shutdown,
                    probed = &mut probe => {
                        break Ended::Lost(probed.unwrap_or_else(|e| format!("the broker probe failed: {e}")));
                    }
                    () = self.worker.links.redis_cut_off() => break Ended::HandedBack,
                    _ = connection_lost.cancelled() => {
                        break Ended::Lost("a delay ladder consumer or the publish channel failed".into());
                    }
                    Some(event) = events.next() => match event {
                        // A channel's error is the operation's (logged there, if unexpected);
                        // the connection's own ends the session.
                        lapin::Event::Error(error) if current.connection.status().errored() => {
                            break Ended::Lost(error.to_string());
                        }
                        lapin::Event::ConnectionBlocked(reason) => warn!(
                            %reason,
                            "the broker blocks this replica's publishes (a resource alarm): delays, retries, dead letters and results wait until it lifts the block"
                        ),
                        lapin::Event::ConnectionUnblocked => {
                            info!("the broker lifted its block on this replica's publishes");
                        }
                        _ => {}
                    },
                    next = current.work.consumer.next() => match current.work.received(next) {
                        Ok(delivery) => dispatch(delivery, current.work.settler.clone()),
                        Err(why) => break Ended::Lost(why),
                    },
                    next = current.returns.consumer.next() => match current.returns.received(next) {
                        Ok(delivery) => {
                            self.worker.stats.ladder.returned(&delivery);
                            dispatch(delivery, current.returns.settler.clone());
                        }
                        Err(why) => break Ended::Lost(why),
                    },
                }
            },
        };
        probe.abort();
        match ended {
            Ended::HandedBack => {
                // Not ready already: `watch_redis` said so as it cut Redis off.
                self.hand_back(current, &handing_back, &deliveries).await;
                connection_lost.cancel();
                Ended::HandedBack
            }
            Ended::Lost(why) => {
                self.ready.not_ready(format!(
                    "the broker connection was lost ({why}): reconnecting"
                ));
                metrics::gauge!("turnstile_broker_connected").set(0.0);
                connection_lost.cancel();
                // A connection that still works (a probe unanswered in time, a channel of its
                // own failed) is closed only once the calls in flight ended and are recorded:
                // the broker hands their messages to others as soon as it is closed.
                let status = current.connection.status();
                if status.connected() && !status.errored() {
                    self.settle_in_flight(&deliveries).await;
                }
                Ended::Lost(why)
            }
            Ended::Shutdown => Ended::Shutdown,
        }
    }

    /// Waits, within the downstream timeout (and 2 s), for the session's deliveries to settle,
    /// once nothing new starts: the calls in flight end and are recorded.
    async fn settle_in_flight(&self, deliveries: &TaskTracker) {
        let bound = self.args.downstream.timeout + Duration::from_secs(2);
        if !all_done(deliveries, tokio::time::Instant::now() + bound).await {
            warn!(
                unsettled = deliveries.len(),
                "deliveries still unsettled as the session ends: the broker takes them back with the connection"
            );
        }
    }

    /// Hands the session's work back while Redis is cut off: no new deliveries; every message
    /// waiting here for a permit goes back through the return queue keeping its reserved slot
    /// (as at shutdown: `handing_back`), and the calls in flight end and their registrations
    /// settle (results published and acked, their records written once Redis answers: see
    /// `Worker::record_later`), within the downstream timeout; the acks are sent. The caller
    /// then closes the connection, and the delay ladder's messages go back to their levels for
    /// the other replicas.
    async fn hand_back(
        &self,
        current: &Session,
        handing_back: &CancellationToken,
        deliveries: &TaskTracker,
    ) {
        handing_back.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(1), current.cancel()).await;
        self.settle_in_flight(deliveries).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), current.flush()).await;
    }

    /// Shuts the session down: no new deliveries, in-flight work finished (held messages
    /// returned) within the grace, the last acks sent, the connection closed.
    async fn close(&self, current: Session) {
        info!(
            "shutting down: no new deliveries; finishing in-flight work, returning held messages"
        );
        // One deadline for every step, so that a hung broker or downstream cannot hold the
        // exit past the grace (plus a moment to send the last acks and close).
        let grace_over = tokio::time::Instant::now() + self.args.shutdown_grace;
        let closing_over = grace_over + Duration::from_secs(1);
        let _ = tokio::time::timeout_at(grace_over, current.cancel()).await;
        drain(self.tracker, grace_over).await;
        match tokio::time::timeout_at(closing_over, current.flush()).await {
            Ok(Ok(())) => {}
            _ => warn!(
                "last acks not sent; the broker redelivers those messages (their completion records keep them from being called again)"
            ),
        }
        let _ = tokio::time::timeout_at(
            closing_over,
            current.connection.close(200, "shutdown".into()),
        )
        .await;
        info!("stopped");
    }
}

/// Lets in-flight work finish until `deadline`; after it, what is still unsettled is left to
/// the broker (it redelivers once the connection closes).
async fn drain(tracker: &TaskTracker, deadline: tokio::time::Instant) {
    if !all_done(tracker, deadline).await {
        warn!(
            unsettled = tracker.len(),
            "shutdown grace over: closing with calls in flight; the broker redelivers their messages"
        );
    }
}

/// Closes `tracker` (no new task) and waits for its tasks until `deadline`; whether they all
/// ended.
async fn all_done(tracker: &TaskTracker, deadline: tokio::time::Instant) -> bool {
    tracker.close();
    tokio::time::timeout_at(deadline, tracker.wait())
        .await
        .is_ok()
}
