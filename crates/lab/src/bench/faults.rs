//! `turnstile bench faults`: a workload against a strict downstream while a replica is killed
//! with SIGKILL, Redis is stopped and restarted empty, and the replicas' broker connections are
//! cut (and, with `--restart-broker`, the local broker restarted); prints what the downstream
//! counted: lost, duplicates, violations.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;

use crate::local_redis::LocalRedis;
use crate::mock_api::{MockArgs, MockServer};
use crate::rig::registration_body;
use turnstile_core::broker::{AmqpArgs, BrokerArgs, QueueArgs, QueueType};
use turnstile_core::config::Limit;

#[derive(Args, Debug, Clone)]
pub struct FaultArgs {
    /// The per-seller limit, both turnstile's and the mock's.
    #[arg(long, default_value = "20/1s", value_parser = turnstile_core::config::limit_arg)]
    pub limit: Limit,
    /// Consumer replicas (each its own process).
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Workers of each replica.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Messages of the busy seller; 10 small sellers send 10 each.
    #[arg(long, default_value_t = 300)]
    pub big: usize,
    /// Also restart the local broker (`rabbitmqctl stop_app` / `start_app`): disrupts every
    /// other user of it.
    #[arg(long)]
    pub restart_broker: bool,
    #[command(flatten)]
    pub amqp: AmqpArgs,
}

fn spawn_replica(
    args: &FaultArgs,
    queue: &str,
    redis_url: &str,
    downstream: &str,
) -> anyhow::Result<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .arg("consume")
        .env("TURNSTILE_AMQP_URL", &args.amqp.url)
        .env("TURNSTILE_QUEUE", queue)
        .env("TURNSTILE_REDIS_URL", redis_url)
        .env("TURNSTILE_KEY_PREFIX", "faults")
        .env("TURNSTILE_DOWNSTREAM_URL", downstream)
        .env("TURNSTILE_LIMIT", args.limit.to_string())
        .env("TURNSTILE_WORKERS", args.workers.to_string())
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?)
}

fn rabbitmqctl(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("rabbitmqctl").args(args).output()?;
    anyhow::ensure!(out.status.success(), "rabbitmqctl {args:?} failed");
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Closes every broker connection whose client properties mention `queue`.
fn cut_connections(queue: &str) -> anyhow::Result<usize> {
    let listing = rabbitmqctl(&["list_connections", "pid", "client_properties", "-q"])?;
    let mut cut = 0;
    for pid in listing
        .lines()
        .filter(|l| l.contains(queue))
        .filter_map(|l| l.split_whitespace().next())
    {
        rabbitmqctl(&["close_connection", pid, "turnstile bench faults"])?;
        cut += 1;
    }
    Ok(cut)
}

/// Messages held anywhere in the topology, in any state (`rabbitmqctl list_queues messages`).
fn still_queued(queues: &[String]) -> anyhow::Result<u64> {
    let listing = rabbitmqctl(&["list_queues", "name", "messages", "-q"])?;
    let mut total = 0;
    for line in listing.lines() {
        let mut f = line.split_whitespace();
        let (Some(name), Some(n)) = (f.next(), f.next().and_then(|n| n.parse::<u64>().ok())) else {
            continue;
        };
        if n > 0 && queues.iter().any(|q| q == name) {
            eprintln!("  {n} messages still in {name}");
            total += n;
        }
    }
    Ok(total)
}

pub async fn run(args: FaultArgs) -> anyhow::Result<bool> {
    let queue = format!("turnstile-faults-{:08x}", rand::random::<u32>());
    let broker = BrokerArgs {
        amqp: args.amqp.clone(),
        queue: QueueArgs {
            name: queue.clone(),
        },
        queue_type: QueueType::Quorum,
        delay_queue_type: QueueType::Quorum,
        consumer_timeout: Default::default(),
    };
    let (connection, publisher, topology) = broker.open("turnstile bench faults").await?;
    let mut redis = LocalRedis::start()?;
    let stop_mock = CancellationToken::new();
    let mock = MockServer::start(MockArgs::local(args.limit), stop_mock.clone()).await?;
    let mut replicas = Vec::new();
    for _ in 0..args.replicas {
        replicas.push(spawn_replica(&args, &queue, &redis.url(), &mock.url())?);
    }
    let mut published = 0u64;
    let mut bodies = Vec::new();
    for i in 0..args.big {
        bodies.push(registration_body(
            &format!("big-{i}"),
            "big",
            None,
            serde_json::json!({"i": i}),
        ));
    }
    for s in 0..10 {
        for i in 0..10 {
            bodies.push(registration_body(
                &format!("small-{s}-{i}"),
                &format!("small-{s}"),
                None,
                serde_json::json!({"i": i}),
            ));
        }
    }
    for body in &bodies {
        publisher
            .publish(
                "",
                &queue,
                body,
                BasicProperties::default().with_content_type("application/json".into()),
            )
            .await?;
        published += 1;
    }
    let _ = connection.close(200, "published".into()).await;
    let started = Instant::now();
    let at = |secs: u64| started + Duration::from_secs(secs);
    eprintln!(
        "faults: {published} messages, limit {}, {} replicas (child processes), private Redis at {}",
        args.limit,
        args.replicas,
        redis.url()
    );

    tokio::time::sleep_until(at(3).into()).await;
    replicas[0].kill()?; // SIGKILL
    replicas[0].wait()?;
    eprintln!("  t=3s  replica 0 killed with SIGKILL (and started again)");
    replicas[0] = spawn_replica(&args, &queue, &redis.url(), &mock.url())?;

    tokio::time::sleep_until(at(6).into()).await;
    redis.stop();
    eprintln!("  t=6s  Redis stopped");
    tokio::time::sleep_until(at(8).into()).await;
    redis.restart()?;
    eprintln!("  t=8s  Redis started again, empty");

    tokio::time::sleep_until(at(11).into()).await;
    let cut = cut_connections(&queue)?;
    eprintln!("  t=11s {cut} broker connections closed by the broker");
    if args.restart_broker {
        tokio::time::sleep_until(at(14).into()).await;
        rabbitmqctl(&["stop_app"])?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        rabbitmqctl(&["start_app"])?;
        eprintln!("  t=14s broker restarted");
    }

    let optimum = args.limit.optimum_drain(args.big as u64);
    let deadline = Instant::now() + optimum * 2 + Duration::from_secs(60);
    while mock.stats().registered < published && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for replica in &mut replicas {
        let _ = Command::new("kill")
            .args(["-TERM", &replica.id().to_string()])
            .status();
    }
    for replica in &mut replicas {
        let _ = replica.wait();
    }
    let stats = mock.stats();
    let queued = still_queued(&topology.queues())?;
    // A message is lost if it neither registered nor is still queued somewhere.
    let lost = published.saturating_sub(stats.registered + queued);
    println!("{:<44} {:>8}", "published", published);
    println!(
        "{:<44} {:>8}",
        "registered (unique Idempotency-Keys)", stats.registered
    );
    println!(
        "{:<44} {:>8}",
        "still queued (copies of registered ones are acked on arrival)", queued
    );
    println!("{:<44} {:>8}", "lost", lost);
    println!(
        "{:<44} {:>8}",
        "duplicate calls (same Idempotency-Key)", stats.duplicates
    );
    println!(
        "{:<44} {:>8}",
        "violations (over the limit, strict window)", stats.violations
    );
    println!(
        "{:<44} {:>7.1}s",
        "elapsed",
        started.elapsed().as_secs_f64()
    );
    let (connection, _, topology) = broker.open("turnstile bench faults cleanup").await?;
    topology.delete(&connection.create_channel().await?).await?;
    stop_mock.cancel();
    Ok(lost == 0 && stats.violations == 0)
}
