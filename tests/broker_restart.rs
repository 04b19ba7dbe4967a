//! A broker restart (`rabbitmqctl stop_app` / `start_app`) under load: replicas report not-ready,
//! reconnect with backoff, re-declare, resume; nothing is lost. Its own test binary, so that no
//! other test runs while the broker is down.
mod support;

use std::process::Command;
use std::time::Duration;

use support::eventually;
use support::pipeline::Pipeline;

fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl")
        .args(args)
        .status()
        .expect("rabbitmqctl runs");
    assert!(status.success(), "rabbitmqctl {args:?}");
}

#[tokio::test]
async fn a_broker_restart_loses_nothing_and_replicas_resume() {
    let mut p = Pipeline::new("broker-restart", "20/1s").await;
    p.start_replicas(2, 4).await;
    p.publish("S-restart", 80).await;
    p.publish("S-small", 5).await;
    eventually("some registered", || p.mock.stats().registered >= 25).await;
    rabbitmqctl(&["stop_app"]);
    eventually("replicas not ready", || {
        p.replicas().all(|r| !r.ready.get())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    rabbitmqctl(&["start_app"]);
    eventually("replicas ready again", || {
        p.replicas().all(|r| r.ready.get())
    })
    .await;
    p.broker.reconnect().await;
    p.publish("S-after", 5).await;
    let stats = p.wait_registered(90).await;
    p.stop_replicas().await;
    println!(
        "after a broker restart: {} registered, {} duplicate calls",
        stats.registered, stats.duplicates
    );
    assert_eq!((stats.registered, stats.violations), (90, 0), "{stats:?}");
    p.cleanup().await;
}
