//! The broker refusing turnstile's own publishes for a while (a `reject-publish` policy on the
//! delay ladder: a full queue, a memory alarm's nacks): a message whose delayed copy is refused
//! goes back to the broker and gives back the slot it had reserved, so the seller's schedule
//! does not run ahead of its backlog, and the backlog drains when the broker accepts again.
mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::run;
use turnstile_core::broker::QueueType;
use turnstile_core::domain::SellerId;
use turnstile_lab::rig::Rig;

/// Sets (or with `None`, clears) a policy on the ladder's queues of `work`.
fn ladder_policy(work: &str, definition: Option<&str>) {
    let name = format!("turnstile-test-{work}-refuse");
    let mut cmd = Command::new("rabbitmqctl");
    match definition {
        Some(definition) => cmd.args([
            "set_policy",
            "-p",
            "/",
            "--priority",
            "10",
            "--apply-to",
            "queues",
            &name,
            &format!("^{}\\.wait\\.", work.replace('.', "\\.")),
            definition,
        ]),
        None => cmd.args(["clear_policy", "-p", "/", &name]),
    };
    let (code, out, err) = run(&mut cmd);
    assert_eq!(code, 0, "rabbitmqctl: {out}{err}");
}

/// Whether the broker refuses (nacks) a publish to `queue` now.
async fn refused(rig: &Rig, queue: &str) -> bool {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let channel = rig.connection().create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for _ in 0..100 {
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                b"probe",
                lapin::BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        if confirm.is_nack() {
            let _ = channel.close(200, "".into()).await;
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// How many slots are reserved under `key`, and how far ahead the last one is.
async fn reserved(rig: &Rig, key: &str) -> (u64, Duration) {
    let mut conn = rig.store().conn().clone();
    let entries: Vec<(String, i64)> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .unwrap();
    let now = rig.admin().redis_time_us().await.unwrap();
    let ahead = entries.iter().map(|(_, s)| s - now).max().unwrap_or(0);
    (
        entries.len() as u64,
        Duration::from_micros(ahead.max(0) as u64),
    )
}

#[tokio::test]
async fn a_refused_delay_publish_gives_back_its_reserved_slot() {
    // Classic levels: a quorum queue lets a publish in while it is empty whatever its max-length.
    let mut rig = support::rig("refused-delay", "10/1s")
        .with_delay_type(QueueType::Classic)
        .prepare()
        .await
        .unwrap();
    let work = rig.topology.work().to_owned();
    let settings = rig.settings(4);
    let prefetch = u64::from(settings.prefetch());
    rig.start_replica(settings).await.unwrap();
    let seller = SellerId::parse("S-refused").unwrap();
    let reserved_key = rig
        .store()
        .keys()
        .reserved(&seller, rig.store().algorithm());
    ladder_policy(
        &work,
        Some(r#"{"max-length":0,"overflow":"reject-publish"}"#),
    );
    assert!(
        refused(&rig, &format!("{work}.wait.3")).await,
        "the policy makes the broker refuse publishes to the ladder"
    );
    let started = Instant::now();
    rig.publish("S-refused", 150).await.unwrap();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (held, ahead) = reserved(&rig, &reserved_key).await;
    let registered_meanwhile = rig.mock.stats().registered;
    ladder_policy(&work, None);
    let stats = rig.wait_registered(150).await.unwrap();
    let drained = started.elapsed();
    rig.wait_settled_registered(150).await.unwrap();
    let (left, _) = reserved(&rig, &reserved_key).await;
    println!(
        "ladder refused for 8 s: {held} slots reserved at its end, the last {ahead:?} ahead \
         ({registered_meanwhile} registered by then); 150 drained in {drained:?} (optimum ~15 s); \
         {left} reserved after; violations {}, dead letters {}",
        stats.violations,
        rig.dead_lettered().await.unwrap()
    );
    assert!(
        held <= prefetch,
        "reserved slots beyond the messages a replica can hold ({prefetch}): {held}"
    );
    assert_eq!(left, 0, "reserved slots left behind");
    assert_eq!(
        (stats.registered, stats.violations, stats.duplicates),
        (150, 0, 0)
    );
    assert_eq!(rig.dead_lettered().await.unwrap(), 0);
    rig.stop_replicas().await.unwrap();
    rig.cleanup().await.unwrap();
}
