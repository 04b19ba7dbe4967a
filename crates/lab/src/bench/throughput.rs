//! `turnstile bench throughput`: how fast turnstile drains a backlog with limits out of the way,
//! beside two loops on the same broker in the same run: a bare consume-and-ack loop (the broker's
//! own limit) and a bare loop that parses each message, POSTs it to the same downstream and acks
//! (the same work without permits). Also counts Redis commands per registered message (INFO
//! commandstats deltas) and the permit latency under that load, for 1, 2, 4... replicas.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures::StreamExt;
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::local_redis::LocalRedis;
use crate::mock_api::{MockArgs, MockServer};
use crate::rig::{RigArgs, registration_body};
use turnstile_core::broker::{self, Settler, Topology};
use turnstile_core::config::{Algorithm, Limit, LimiterArgs};
use turnstile_core::domain::Registration;
use turnstile_core::downstream::{Downstream, DownstreamArgs, Reply};
use turnstile_core::permit::{RedisConn, delete_prefix, round_trips};
use turnstile_core::replica::ConsumeArgs;
use turnstile_core::worker::{LatencySummary, Stats};
use turnstile_ops::serve::Served;

#[derive(Args, Debug, Clone)]
pub struct ThroughputArgs {
    /// Messages per run.
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Sellers the messages spread over (round robin).
    #[arg(long, default_value_t = 2_000)]
    pub sellers: usize,
    /// The per-seller limit; the default keeps limits out of the way.
    #[arg(long, default_value = "1000000/1s", value_parser = turnstile_core::config::limit_arg)]
    pub limit: Limit,
    /// The consumers' limiter algorithm.
    #[arg(long, value_enum, default_value_t = Algorithm::SlidingWindow)]
    pub algorithm: Algorithm,
    /// Replica counts to run turnstile with, one run each (e.g. `1,2,4`).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub replicas: Vec<usize>,
    /// Workers per replica (the bare loop runs as many calls at once as one replica).
    #[arg(long, default_value_t = 64)]
    pub workers: u32,
    /// Rounds of every measurement; the table shows each row's median round.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Redis to use; by default a private `redis-server` on a free port, so that the command
    /// counts are turnstile's alone. A comma-separated list of URLs means Redis Cluster.
    #[arg(id = "bench_redis_url", long = "bench-redis-url", value_name = "URL")]
    pub redis_url: Option<String>,
    #[command(flatten)]
    pub rig: RigArgs,
    /// Print the results as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
    /// The replicas' TURNSTILE_PERMIT_BLOCK (default: its default; 0 = no permit blocks).
    #[arg(long)]
    pub permit_block: Option<u32>,
}

/// CPU time used so far by the broker, the Redis servers and this process, from /proc (Linux).
#[derive(Clone, Copy, Debug, Default)]
struct Cpu {
    broker: f64,
    redis: f64,
    this: f64,
}

/// Processes whose command line names them: RabbitMQ's `beam.smp`, `redis-server` on `ports`.
fn cpu_now(redis_ports: &[u16]) -> Cpu {
    let ticks = 100.0; // USER_HZ on Linux
    let seconds = |pid: &str| -> f64 {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
                let user: f64 = fields.get(11)?.parse().ok()?;
                let system: f64 = fields.get(12)?.parse().ok()?;
                Some((user + system) / ticks)
            })
            .unwrap_or(0.0)
    };
    let mut cpu = Cpu {
        this: seconds("self"),
        ..Cpu::default()
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return cpu;
    };
    for entry in entries.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("beam.smp") && cmdline.contains("rabbit") {
            cpu.broker += seconds(&pid);
        } else if cmdline.starts_with("redis-server")
            && redis_ports.iter().any(|p| {
                cmdline.contains(&format!(":{p}")) || cmdline.contains(&format!("--port {p}"))
            })
        {
            cpu.redis += seconds(&pid);
        }
    }
    cpu
}

impl std::ops::Sub for Cpu {
    type Output = Cpu;
    fn sub(self, before: Cpu) -> Cpu {
        Cpu {
            broker: self.broker - before.broker,
            redis: self.redis - before.redis,
            this: self.this - before.this,
        }
    }
}

/// The port of a `redis://host:port/db` URL (6379 when none is given).
fn url_port(url: &str) -> Option<u16> {
    let rest = url.trim().split_once("://").map_or(url.trim(), |(_, r)| r);
    let authority = rest.split('/').next()?;
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    match host.rsplit_once(':') {
        Some((_, port)) => port.parse().ok(),
        None => Some(6379),
    }
}

/// One measured run.
#[derive(Debug, Serialize)]
pub struct Run {
    pub name: String,
    pub messages: u64,
    pub seconds: f64,
    pub per_second: f64,
    /// Versus the bare parse-POST-ack loop of the same round.
    pub vs_bare_loop: f64,
    /// Versus the same loop with acks batched as turnstile batches them.
    pub vs_bare_batched: f64,
    /// Turnstile with N replicas versus N bare parse-POST-ack loops side by side in the same
    /// round (each its own connection and as many calls at once as a replica): the same shape
    /// of work without permits. For one replica it is `vs_bare_loop`.
    pub vs_bare_side_by_side: Option<f64>,
    /// Requests replicas sent to Redis (a script call or a pipeline counts once).
    pub redis_round_trips_per_message: Option<f64>,
    /// Scripts Redis ran (EVALSHA/EVAL).
    pub redis_scripts_per_message: Option<f64>,
    /// Every command Redis executed, those inside scripts included.
    pub redis_commands_per_message: Option<f64>,
    pub permit_p50_us: Option<f64>,
    pub permit_p99_us: Option<f64>,
    pub violations: Option<u64>,
    pub duplicates: Option<u64>,
    pub lost: Option<u64>,
    /// CPU time per message (µs): the broker, Redis, and this process (consumers and the
    /// in-process downstream together). On 2 cores their sum bounds the rate.
    pub cpu_broker_us: f64,
    pub cpu_redis_us: f64,
    pub cpu_process_us: f64,
    /// Where Redis's time went (turnstile runs): per command, most time first.
    pub redis_time: Vec<super::commandstats::CommandTime>,
}

pub async fn run(args: ThroughputArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.messages > 0 && args.sellers > 0,
        "--messages and --sellers must be positive"
    );
    let private_redis;
    let redis_url = match &args.redis_url {
        Some(url) => url.clone(),
        None => {
            private_redis = LocalRedis::start()?;
            private_redis.url()
        }
    };
    let mut redis_args = args.rig.redis.clone();
    redis_args.url = redis_url.clone();
    let redis = RedisConn::connect(&redis_args).await?;
    let stop_mock = CancellationToken::new();
    let mock = MockServer::start(MockArgs::local(args.limit), stop_mock.clone()).await?;
    let downstream_args = DownstreamArgs {
        url: mock.url(),
        token: None,
        timeout: Duration::from_secs(10),
        cost_header: None,
    };
    let defaults = LimiterArgs::new(args.limit, args.algorithm);
    let limiter = LimiterArgs {
        // A private Redis has just started: no cold-start wait, as with a durable Redis.
        redis_durable: true,
        permit_block: args.permit_block.unwrap_or(defaults.permit_block),
        ..defaults
    };
    let tag = format!("{:08x}", rand::random::<u32>());
    let mut settings =
        args.rig
            .replica_settings("throughput", limiter, args.workers, Duration::from_secs(2));
    settings.redis = redis_args.clone();
    settings.redis.key_prefix = format!("{}-throughput-{tag}", args.rig.redis.key_prefix);
    settings.downstream = downstream_args.clone();
    let prefetch = settings.prefetch();
    println!(
        "{} messages over {} sellers per run, limit {} ({}), {} workers and prefetch {} per replica, {:?} queues, Redis {}",
        args.messages,
        args.sellers,
        args.limit,
        args.algorithm,
        args.workers,
        prefetch,
        args.rig.queue_type,
        turnstile_core::config::redact_url(&redis_url),
    );

    let mut bench = Bench {
        args: &args,
        settings,
        tag,
        mock: &mock,
        redis: &redis,
        redis_ports: redis_url.split(',').filter_map(url_port).collect(),
        round: 0,
    };

    // The bare loops call a downstream without limits (they have no limiter); with the default
    // limit it is the same as turnstile's.
    let unlimited: Limit = "1000000/1s".parse().expect("a valid limit");
    let bare_mock;
    let bare_downstream = if args.limit == unlimited {
        Downstream::new(&downstream_args)?
    } else {
        bare_mock = MockServer::start(MockArgs::local(unlimited), stop_mock.clone()).await?;
        Downstream::new(&DownstreamArgs {
            url: bare_mock.url(),
            ..downstream_args.clone()
        })?
    };
    // Every round measures every row once, in the same order. The table shows each row's
    // median round; its ratio is the median of the ratios taken within each round.
    let mut rounds: Vec<Vec<Run>> = Vec::new();
    for round in 1..=args.repeat {
        println!("round {round} of {}", args.repeat);
        let mut row = vec![
            bench
                .bare("ack-only loop (broker limit)", Loop::AckOnly)
                .await?,
            bench
                .bare("ack-only, acks batched by 100", Loop::AckBatched)
                .await?,
        ];
        let bare = bench
            .bare(
                "bare loop: parse, POST, ack",
                Loop::Register(&bare_downstream),
            )
            .await?;
        let batched = bench
            .bare(
                "bare loop, acks batched",
                Loop::RegisterBatched(&bare_downstream),
            )
            .await?;
        let (bare_rate, batched_rate) = (bare.per_second, batched.per_second);
        row.push(bare);
        row.push(batched);
        for &replicas in &args.replicas {
            let side_by_side_rate = if replicas > 1 {
                let copies = bench
                    .bare_copies(
                        &format!("bare loop x{replicas}, side by side"),
                        &bare_downstream,
                        replicas,
                    )
                    .await?;
                let rate = copies.per_second;
                row.push(copies);
                rate
            } else {
                bare_rate
            };
            let mut run = bench.turnstile(replicas).await?;
            run.vs_bare_side_by_side = Some(run.per_second / side_by_side_rate);
            row.push(run);
        }
        for run in &mut row {
            run.vs_bare_loop = run.per_second / bare_rate;
            run.vs_bare_batched = run.per_second / batched_rate;
        }
        rounds.push(row);
    }
    let clean = rounds
        .iter()
        .flatten()
        .all(|r| r.lost.unwrap_or(0) == 0 && r.violations.unwrap_or(0) == 0);
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let mut runs = Vec::new();
    for _ in 0..rounds[0].len() {
        let mut of_row: Vec<Run> = rounds.iter_mut().map(|r| r.remove(0)).collect();
        let ratio = median(of_row.iter().map(|r| r.vs_bare_loop).collect());
        let ratio_batched = median(of_row.iter().map(|r| r.vs_bare_batched).collect());
        let side_by_side: Vec<f64> = of_row
            .iter()
            .filter_map(|r| r.vs_bare_side_by_side)
            .collect();
        let ratio_side_by_side = (!side_by_side.is_empty()).then(|| median(side_by_side));
        of_row.sort_by(|a, b| a.per_second.total_cmp(&b.per_second));
        let mut typical = of_row.swap_remove(of_row.len() / 2);
        typical.vs_bare_loop = ratio;
        typical.vs_bare_batched = ratio_batched;
        typical.vs_bare_side_by_side = ratio_side_by_side;
        runs.push(typical);
    }
    stop_mock.cancel();
    delete_prefix(&redis, &bench.settings.redis.key_prefix).await?;

    println!();
    println!(
        "{:<34} {:>7} {:>6} {:>8} {:>8} {:>10} {:>8} {:>9} {:>11} {:>12} {:>10} {:>9} {:>5} {:>5}   CPU µs/msg: broker + Redis + this process",
        "run",
        "msgs",
        "secs",
        "msg/s",
        "vs bare",
        "vs batched",
        "vs bare xN",
        "trips/msg",
        "scripts/msg",
        "commands/msg",
        "permit p50",
        "p99",
        "viol",
        "lost",
    );
    let opt = |v: Option<f64>, digits: usize| v.map_or("-".to_owned(), |v| format!("{v:.digits$}"));
    let opt_n = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
    for r in &runs {
        println!(
            "{:<34} {:>7} {:>6.2} {:>8.0} {:>7.2}x {:>9.2}x {:>10} {:>9} {:>11} {:>12} {:>8}µs {:>7}µs {:>5} {:>5}   {:>5.0} + {:>5.0} + {:>5.0}",
            r.name,
            r.messages,
            r.seconds,
            r.per_second,
            r.vs_bare_loop,
            r.vs_bare_batched,
            r.vs_bare_side_by_side
                .map_or("-".to_owned(), |v| format!("{v:.2}x")),
            opt(r.redis_round_trips_per_message, 2),
            opt(r.redis_scripts_per_message, 2),
            opt(r.redis_commands_per_message, 1),
            opt(r.permit_p50_us, 0),
            opt(r.permit_p99_us, 0),
            opt_n(r.violations),
            opt_n(r.lost),
            r.cpu_broker_us,
            r.cpu_redis_us,
            r.cpu_process_us,
        );
    }
    for r in runs.iter().filter(|r| !r.redis_time.is_empty()) {
        super::commandstats::print_time(&r.name, "message", &r.redis_time);
    }
    if args.json {
        println!("{}", serde_json::to_string(&runs)?);
    }
    Ok(clean)
}

impl Run {
    fn bare(name: &str, messages: usize, took: Duration) -> Self {
        Self {
            name: name.to_owned(),
            messages: messages as u64,
            seconds: took.as_secs_f64(),
            per_second: messages as f64 / took.as_secs_f64(),
            vs_bare_loop: 0.0,
            vs_bare_batched: 0.0,
            vs_bare_side_by_side: None,
            redis_round_trips_per_message: None,
            redis_scripts_per_message: None,
            redis_commands_per_message: None,
            redis_time: Vec::new(),
            permit_p50_us: None,
            permit_p99_us: None,
            violations: None,
            duplicates: None,
            lost: None,
            cpu_broker_us: 0.0,
            cpu_redis_us: 0.0,
            cpu_process_us: 0.0,
        }
    }

    fn with_cpu(mut self, used: Cpu) -> Self {
        let per = |s: f64| s * 1e6 / self.messages.max(1) as f64;
        self.cpu_broker_us = per(used.broker);
        self.cpu_redis_us = per(used.redis);
        self.cpu_process_us = per(used.this);
        self
    }
}

struct Bench<'a> {
    args: &'a ThroughputArgs,
    settings: ConsumeArgs,
    tag: String,
    mock: &'a MockServer,
    redis: &'a RedisConn,
    redis_ports: Vec<u16>,
    round: usize,
}

impl Bench<'_> {
    /// A bare loop (see [`bare_loop`]) drains a fresh backlog.
    async fn bare(&mut self, name: &str, kind: Loop<'_>) -> anyhow::Result<Run> {
        let topology = self.backlog().await?;
        let cpu = cpu_now(&self.redis_ports);
        let took = bare_loop(&self.settings, &topology, self.args.messages, kind).await?;
        let used = cpu_now(&self.redis_ports) - cpu;
        self.done_with(&topology).await?;
        Ok(Run::bare(name, self.args.messages, took).with_cpu(used))
    }

    /// `copies` bare parse-POST-ack loops, each with its own connection, drain one fresh
    /// backlog together (the bare counterpart of `copies` replicas).
    async fn bare_copies(
        &mut self,
        name: &str,
        downstream: &Downstream,
        copies: usize,
    ) -> anyhow::Result<Run> {
        let topology = self.backlog().await?;
        let cpu = cpu_now(&self.redis_ports);
        let started = Instant::now();
        let drained = CancellationToken::new();
        let done = Arc::new(AtomicU64::new(0));
        futures::future::try_join_all((0..copies).map(|_| {
            bare_copy(
                &self.settings,
                &topology,
                self.args.messages as u64,
                downstream,
                &done,
                &drained,
            )
        }))
        .await?;
        let took = started.elapsed();
        let used = cpu_now(&self.redis_ports) - cpu;
        self.done_with(&topology).await?;
        Ok(Run::bare(name, self.args.messages, took).with_cpu(used))
    }

    /// A fresh queue with the whole workload published to it (ids unique to this round).
    async fn backlog(&mut self) -> anyhow::Result<Topology> {
        self.round += 1;
        let mut broker_args = self.settings.broker.clone();
        broker_args.queue.name = format!("turnstile-throughput-{}-{}", self.tag, self.round);
        let (connection, publisher, topology) = broker_args.open("turnstile bench").await?;
        let queue = topology.work().to_owned();
        let round = self.round;
        let sellers = self.args.sellers;
        let results: Vec<_> = futures::stream::iter(0..self.args.messages)
            .map(|i| {
                let (publisher, queue) = (&publisher, &queue);
                async move {
                    let body = registration_body(
                        &format!("r{round}-m{i}"),
                        &format!("S-{}", i % sellers),
                        None,
                        serde_json::json!({"sku": i, "name": "bench product"}),
                    );
                    let properties =
                        BasicProperties::default().with_content_type("application/json".into());
                    publisher.publish("", queue, &body, properties).await
                }
            })
            .buffer_unordered(512)
            .collect()
            .await;
        for r in results {
            r.context("publishing the backlog")?;
        }
        let _ = connection.close(200, "published".into()).await;
        Ok(topology)
    }

    async fn done_with(&self, topology: &Topology) -> anyhow::Result<()> {
        let connection = broker::connect(&self.settings.broker.amqp.url, "turnstile bench").await?;
        let channel = connection.create_channel().await?;
        topology.delete(&channel).await?;
        let _ = connection.close(200, "done".into()).await;
        Ok(())
    }

    /// `replicas` replicas drain a fresh backlog; Redis commands are counted around the run.
    async fn turnstile(&mut self, replicas: usize) -> anyhow::Result<Run> {
        let topology = self.backlog().await?;
        let before_mock = self.mock.stats();
        let commands_before = super::commandstats::command_calls(self.redis).await?;
        let trips_before = round_trips();
        let cpu = cpu_now(&self.redis_ports);
        let mut settings = self.settings.clone();
        settings.broker.queue.name = topology.work().to_owned();
        let stop = CancellationToken::new();
        let started = Instant::now();
        let mut running = Vec::new();
        for _ in 0..replicas {
            running.push(Served::start(settings.clone().into(), stop.clone()).await?);
        }
        let target = self.args.messages as u64;
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let settled: u64 = running
                .iter()
                .map(|r| {
                    r.stats.registered.load(Ordering::Relaxed)
                        + r.stats.dead_lettered.load(Ordering::Relaxed)
                })
                .sum();
            if settled >= target || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = started.elapsed();
        let latency = LatencySummary::default();
        let stats: Vec<Arc<Stats>> = running.iter().map(|r| r.stats.clone()).collect();
        stop.cancel();
        for replica in running {
            replica.wait().await?;
        }
        for s in &stats {
            latency.absorb(&s.permit_latency);
        }
        let trips = round_trips() - trips_before;
        let used = cpu_now(&self.redis_ports) - cpu;
        let commands_after = super::commandstats::command_calls(self.redis).await?;
        let after_mock = self.mock.stats();
        self.done_with(&topology).await?;
        let registered = after_mock.registered - before_mock.registered;
        let (scripts, commands) = commands_after.per_message_since(&commands_before, registered);
        let per_message = |n: u64| Some(n as f64 / registered.max(1) as f64);
        Ok(Run {
            name: format!(
                "turnstile, {replicas} replica{}",
                if replicas == 1 { "" } else { "s" }
            ),
            messages: registered,
            seconds: took.as_secs_f64(),
            per_second: registered as f64 / took.as_secs_f64(),
            vs_bare_loop: 0.0,
            vs_bare_batched: 0.0,
            vs_bare_side_by_side: None,
            redis_round_trips_per_message: per_message(trips),
            redis_scripts_per_message: Some(scripts),
            redis_commands_per_message: Some(commands),
            redis_time: commands_after.time_per_message_since(&commands_before, registered),
            permit_p50_us: Some(latency.quantile(0.5).as_secs_f64() * 1e6),
            permit_p99_us: Some(latency.quantile(0.99).as_secs_f64() * 1e6),
            violations: Some(after_mock.violations - before_mock.violations),
            duplicates: Some(after_mock.duplicates - before_mock.duplicates),
            lost: Some(target.saturating_sub(registered)),
            cpu_broker_us: 0.0,
            cpu_redis_us: 0.0,
            cpu_process_us: 0.0,
        }
        .with_cpu(used))
    }
}

/// What a bare loop does with each delivery.
#[derive(Clone, Copy)]
enum Loop<'a> {
    /// Acks it as it comes.
    AckOnly,
    /// Acks every hundredth with `multiple` (the broker's ceiling with batched acks).
    AckBatched,
    /// Parses it, POSTs it (as many at once as a replica's workers) and acks it.
    Register(&'a Downstream),
    /// The same, with acks batched as turnstile batches them ([`Settler`]).
    RegisterBatched(&'a Downstream),
}

/// What a bare loop does with a delivery's body: parse it and POST it; whether it registered.
async fn register_bare(downstream: &Downstream, body: &[u8]) -> bool {
    let registration =
        Registration::parse(body, None).expect("the bench publishes valid registrations");
    matches!(
        downstream.register(&registration).await,
        Reply::Registered(_)
    )
}

/// A bare loop's own connection, with a channel consuming the work queue at a replica's
/// prefetch.
async fn bare_consumer(
    settings: &ConsumeArgs,
    topology: &Topology,
) -> anyhow::Result<(lapin::Connection, lapin::Channel, lapin::Consumer)> {
    let connection =
        broker::connect(&settings.broker.amqp.url, "turnstile bench bare loop").await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(settings.prefetch(), BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            topology.work().into(),
            "bare".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((connection, channel, consumer))
}

/// One of several bare parse-POST-ack loops on one backlog of `messages`: it consumes until
/// they have registered `messages` together (`done`), then cancels `drained` for the others.
async fn bare_copy(
    settings: &ConsumeArgs,
    topology: &Topology,
    messages: u64,
    downstream: &Downstream,
    done: &Arc<AtomicU64>,
    drained: &CancellationToken,
) -> anyhow::Result<()> {
    let (connection, _channel, mut consumer) = bare_consumer(settings, topology).await?;
    let workers = Arc::new(Semaphore::new(settings.workers as usize));
    let tasks = tokio_util::task::TaskTracker::new();
    loop {
        let delivery = tokio::select! {
            _ = drained.cancelled() => break,
            delivery = consumer.next() => delivery.context("a bare loop's consumer ended")??,
        };
        let worker = workers.clone().acquire_owned().await?;
        let (downstream, done, drained) = (downstream.clone(), done.clone(), drained.clone());
        tasks.spawn(async move {
            let registered = register_bare(&downstream, &delivery.data).await;
            drop(worker);
            if registered {
                let _ = delivery.acker.ack(BasicAckOptions::default()).await;
                if done.fetch_add(1, Ordering::Relaxed) + 1 >= messages {
                    drained.cancel();
                }
            }
        });
    }
    tasks.close();
    tasks.wait().await;
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}

/// A bare consumer of a backlog of `messages`; returns the time to drain it.
async fn bare_loop(
    settings: &ConsumeArgs,
    topology: &Topology,
    messages: usize,
    kind: Loop<'_>,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let (connection, channel, mut consumer) = bare_consumer(settings, topology).await?;
    let done = Arc::new(AtomicU64::new(0));
    let workers = Arc::new(Semaphore::new(settings.workers as usize));
    let settler = matches!(kind, Loop::RegisterBatched(_)).then(|| Settler::new(channel.clone()));
    let tasks = tokio_util::task::TaskTracker::new();
    let mut received = 0;
    while received < messages {
        let delivery = consumer
            .next()
            .await
            .context("the bare loop's consumer ended")??;
        received += 1;
        match kind {
            Loop::AckOnly => {
                delivery.acker.ack(BasicAckOptions::default()).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Loop::AckBatched => {
                if received % 100 == 0 || received == messages {
                    delivery
                        .acker
                        .ack(BasicAckOptions { multiple: true })
                        .await?;
                    done.store(received as u64, Ordering::Relaxed);
                }
            }
            Loop::Register(downstream) | Loop::RegisterBatched(downstream) => {
                let worker = workers.clone().acquire_owned().await?;
                let (downstream, done) = (downstream.clone(), done.clone());
                let settler = settler.clone();
                if let Some(settler) = &settler {
                    settler.received(delivery.delivery_tag);
                }
                tasks.spawn(async move {
                    let registered = register_bare(&downstream, &delivery.data).await;
                    drop(worker);
                    if registered {
                        match settler {
                            Some(settler) => settler.ack(delivery.delivery_tag),
                            None => {
                                let _ = delivery.acker.ack(BasicAckOptions::default()).await;
                            }
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        }
    }
    tasks.close();
    tasks.wait().await;
    if let Some(settler) = &settler {
        settler.flush().await?;
    }
    let took = started.elapsed();
    let _ = connection.close(200, "done".into()).await;
    anyhow::ensure!(
        done.load(Ordering::Relaxed) == messages as u64,
        "the bare loop registered {} of {messages}",
        done.load(Ordering::Relaxed)
    );
    Ok(took)
}
