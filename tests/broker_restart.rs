//! Broker restarts (`rabbitmqctl stop_app` / `start_app`) under load: replicas report not-ready,
//! reconnect with backoff, re-declare, resume; nothing is lost and nothing stays in the delay
//! ladder. Its own test binary, so that no other test runs while the broker is down.
mod support;

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::Rng;
use support::eventually;
use turnstile_core::broker::QueueType;
use turnstile_lab::rig::Rig;

fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(out.status.success(), "rabbitmqctl {args:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every message the broker holds in the pipeline's queues, whatever its state: ready,
/// unacked, or parked by the broker (a quorum queue's dead-letter backlog counts in
/// `messages` but is neither ready nor unacked).
fn held_by_broker(rig: &Rig) -> u64 {
    let queues = rig.topology.queues();
    rabbitmqctl(&["-q", "list_queues", "name", "messages"])
        .lines()
        .filter_map(|line| {
            let (name, n) = line.split_once('\t')?;
            queues
                .iter()
                .any(|q| q == name)
                .then(|| n.trim().parse::<u64>().ok())?
        })
        .sum()
}

async fn restart_broker(rig: &mut Rig, down: Duration) -> anyhow::Result<()> {
    rabbitmqctl(&["stop_app"]);
    eventually("replicas not ready", || {
        rig.replicas().all(|r| !r.ready.get())
    })
    .await;
    tokio::time::sleep(down).await;
    rabbitmqctl(&["start_app"]);
    eventually("replicas ready again", || {
        rig.replicas().all(|r| r.ready.get())
    })
    .await;
    rig.reconnect().await?;
    Ok(())
}

/// A backlog deep enough to keep messages on several ladder levels, restarted `restarts`
/// times at random moments, with new sellers publishing between restarts.
async fn repeated_restarts_strand_nothing(
    delay_type: QueueType,
    restarts: usize,
) -> anyhow::Result<()> {
    let mut rig = support::rig("restarts", "10/1s")
        .with_delay_type(delay_type)
        .prepare()
        .await?;
    rig.start_replicas(2, 4).await?;
    rig.publish("S-big", 300).await?;
    let mut total = 300;
    let mut rng = rand::rng();
    for round in 0..restarts {
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..3_000))).await;
        let down = Duration::from_millis(rng.random_range(200..2_500));
        restart_broker(&mut rig, down).await?;
        let seller = format!("S-round-{round}");
        rig.publish(&seller, 25).await?;
        total += 25;
    }
    let stats = rig.wait_registered(total).await?;
    eventually("every copy left the broker's queues", || {
        held_by_broker(&rig) == 0
    })
    .await;
    let late_ms = rig
        .replicas()
        .map(|r| r.stats.ladder.max_late_ms.load(Ordering::Relaxed))
        .max()
        .unwrap_or(0);
    let parked: u64 = rig
        .replicas()
        .map(|r| r.stats.ladder.deliveries.load(Ordering::Relaxed))
        .sum();
    let hops: u64 = rig
        .replicas()
        .map(|r| r.stats.ladder.hops.load(Ordering::Relaxed))
        .sum();
    let overdue: u64 = rig
        .replicas()
        .map(|r| r.stats.ladder.overdue.load(Ordering::Relaxed))
        .sum();
    rig.stop_replicas().await?;
    println!(
        "{delay_type:?} ladder, {restarts} broker restarts: {} of {total} registered, {} violations, \
         {} duplicate calls, {parked} ladder deliveries, {hops} republished ({overdue} ended >1 s \
         late), longest past its due time: {late_ms} ms",
        stats.registered, stats.violations, stats.duplicates
    );
    assert_eq!(stats.registered, total, "{stats:?}");
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert!(parked > 0, "the backlog went through the ladder");
    rig.cleanup().await
}

/// One test, so that the two ladders are never restarted at the same time.
#[tokio::test]
async fn ten_broker_restarts_strand_nothing_in_quorum_or_classic_ladders() -> anyhow::Result<()> {
    repeated_restarts_strand_nothing(QueueType::Quorum, 10).await?;
    repeated_restarts_strand_nothing(QueueType::Classic, 10).await
}
