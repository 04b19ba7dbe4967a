//! The operator commands end to end through the released binary's contract: publish, status,
//! dead-letters, consume with SIGTERM, and demo.
mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::pipeline::Pipeline;
use support::{redis_url, run};

fn turnstile() -> Command {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
}

/// The environment a replica or command of this pipeline runs with.
fn env_of(p: &Pipeline, cmd: &mut Command) {
    cmd.env("TURNSTILE_QUEUE", p.broker.queue())
        .env("TURNSTILE_KEY_PREFIX", &p.keys.prefix)
        .env("TURNSTILE_REDIS_URL", redis_url())
        .env("TURNSTILE_DOWNSTREAM_URL", p.mock.url())
        .env("TURNSTILE_LIMIT", &p.limit)
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("RUST_LOG", "warn");
}

fn examples(file: &str) -> String {
    format!("{}/examples/{file}", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test]
async fn publish_sends_one_message_per_product_and_status_follows_the_upload() {
    let mut p = Pipeline::new("publish", "100/1s").await;
    let mut cmd = turnstile();
    env_of(&p, &mut cmd);
    let (code, out, err) = run(cmd.args([
        "publish",
        &examples("products.csv"),
        "--seller",
        "S-77",
        "--batch",
        "b1",
    ]));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("published 40 of 40 products of S-77 (batch b1)"),
        "{out}"
    );
    assert_eq!(p.broker.depth(p.broker.queue()).await, 40);

    let status = |p: &Pipeline| {
        let mut cmd = turnstile();
        env_of(p, &mut cmd);
        let (code, out, err) = run(cmd.args(["status", "--seller", "S-77", "--json"]));
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let before = status(&p);
    assert_eq!(before[0]["total"], 40);
    assert_eq!(before[0]["waiting"], 40);

    p.start_replicas(1, 4).await;
    p.wait_registered(40).await;
    p.wait_settled_registered(40).await;
    let after = status(&p);
    assert_eq!(
        (
            after[0]["registered"].as_u64(),
            after[0]["waiting"].as_u64()
        ),
        (Some(40), Some(0))
    );

    // Publishing the same file again registers nothing twice.
    let mut cmd = turnstile();
    env_of(&p, &mut cmd);
    let (code, _, err) = run(cmd.args([
        "publish",
        &examples("products.csv"),
        "--seller",
        "S-77",
        "--batch",
        "b1",
    ]));
    assert_eq!(code, 0, "{err}");
    while p.total(|s| &s.already_done) < 40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = p.mock.stats();
    assert_eq!(
        (stats.registered, stats.duplicates, stats.requests),
        (40, 0, 40)
    );
    p.cleanup().await;
}

#[tokio::test]
async fn publish_refuses_a_missing_file_with_a_clear_error() {
    let (code, _, err) =
        run(turnstile().args(["publish", "/nonexistent/products.xlsx", "--seller", "S"]));
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent/products.xlsx"), "{err}");
}

#[tokio::test]
async fn dead_letters_are_listed_and_replayed_after_the_cause_is_fixed() {
    let mut p = Pipeline::new("replay", "100/1s").await;
    p.start_replicas(1, 2).await;
    // Rejected once (400), then accepted: the cause is "fixed" downstream.
    p.publish_product(
        "S-1",
        "m-fixed",
        serde_json::json!({"mock": {"statuses": [400, 200]}}),
    )
    .await;
    p.broker.publish(b"garbage").await;
    while p.broker.depth(p.broker.topology.dead()).await < 2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut cmd = turnstile();
    env_of(&p, &mut cmd);
    let (code, out, err) = run(cmd.args(["dead-letters", "list", "--json"]));
    assert_eq!(code, 0, "{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut reasons: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["reason"].as_str().unwrap())
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["invalid-message", "rejected"]);
    assert_eq!(
        p.broker.depth(p.broker.topology.dead()).await,
        2,
        "listing leaves them in place"
    );

    let mut cmd = turnstile();
    env_of(&p, &mut cmd);
    let (code, out, err) = run(cmd.args(["dead-letters", "replay", "--reason", "rejected"]));
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("replayed 1 to"), "{out}");
    p.wait_registered(1).await;
    assert_eq!(
        p.broker.depth(p.broker.topology.dead()).await,
        1,
        "the garbage stays dead"
    );
    p.cleanup().await;
}

fn spawn_consumer(p: &Pipeline, workers: u32) -> Child {
    let mut cmd = turnstile();
    env_of(p, &mut cmd);
    cmd.args(["consume"])
        .env("TURNSTILE_WORKERS", workers.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("turnstile consume starts")
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn sigterm_during_a_run_exits_zero_and_loses_nothing() {
    let mut p = Pipeline::new("sigterm", "20/1s").await;
    p.publish("busy", 100).await;
    p.publish("other", 10).await;
    let mut child = spawn_consumer(&p, 4);
    // Let it register some and hold or delay the rest, then stop it.
    let started = std::time::Instant::now();
    while p.mock.stats().registered < 30 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the replica exited early"
        );
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the replica registered nothing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal(&child, "-TERM");
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0), "exit code after SIGTERM");
    // A fresh replica finishes the work: every message registered exactly once.
    p.start_replicas(1, 4).await;
    let stats = p.wait_registered(110).await;
    p.stop_replicas().await;
    assert_eq!(
        (stats.registered, stats.duplicates, stats.violations),
        (110, 0, 0),
        "{stats:?}"
    );
    assert_eq!(p.broker.depth(p.broker.queue()).await, 0);
    p.cleanup().await;
}

#[test]
fn the_demo_registers_everything_within_the_limits_and_reports_json() {
    let (code, out, err) = run(turnstile()
        .args([
            "demo",
            "--json",
            "--limit",
            "20/1s",
            "--replicas",
            "2",
            "--queue-type",
            "classic",
        ])
        .env("TURNSTILE_KEY_PREFIX", support::unique("demo"))
        .env("RUST_LOG", "warn"));
    assert_eq!(code, 0, "{out}\n{err}");
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["registered"], 95);
    assert_eq!(last["lost"], 0);
    assert_eq!(last["duplicates"], 0);
    assert_eq!(last["violations"], 0);
}

#[test]
fn no_secret_is_shown_by_help_or_a_startup_error() {
    let secrets = [
        (
            "TURNSTILE_REDIS_URL",
            "redis://:redis-password@127.0.0.1:1/",
        ),
        (
            "TURNSTILE_AMQP_URL",
            "amqp://guest:amqp-password@127.0.0.1:1/%2f",
        ),
        (
            "TURNSTILE_DOWNSTREAM_URL",
            "http://127.0.0.1:1/register/{seller_id}?api_key=api-key-secret",
        ),
        ("TURNSTILE_DOWNSTREAM_TOKEN", "bearer-token-secret"),
    ];
    let words = [
        "redis-password",
        "amqp-password",
        "api-key-secret",
        "bearer-token-secret",
    ];
    for args in [
        &["consume", "--help"][..],
        &["publish", "--help"],
        &["limits", "get", "--help"],
        &["status", "--help"],
        // A configuration error at start names the setting, not its secret.
        &["consume", "--workers", "0"],
        &["consume", "--http-addr", "not-an-address"],
        &["limits", "get", "--seller", "S-1"],
    ] {
        let mut cmd = turnstile();
        cmd.envs(secrets).env("RUST_LOG", "debug").args(args);
        let (_, out, err) = run(cmd.stdin(Stdio::null()));
        for word in words {
            assert!(
                !out.contains(word) && !err.contains(word),
                "`turnstile {}` shows {word}:\n{out}\n{err}",
                args.join(" ")
            );
        }
    }
}
