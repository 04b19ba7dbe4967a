//! The operator commands end to end through the released binary's contract: publish, status,
//! dead-letters, consume with SIGTERM, and demo.
mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;
use support::{redis_url, run};
use turnstile_lab::rig::Rig;

fn turnstile() -> Command {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
}

/// The environment a replica or command of this pipeline runs with.
fn env_of(rig: &Rig, cmd: &mut Command) {
    cmd.env("TURNSTILE_QUEUE", rig.topology.work())
        .env("TURNSTILE_KEY_PREFIX", &rig.key_prefix)
        .env("TURNSTILE_REDIS_URL", redis_url())
        .env("TURNSTILE_DOWNSTREAM_URL", rig.mock.url())
        .env("TURNSTILE_LIMIT", rig.limit.to_string())
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("RUST_LOG", "warn");
}

fn examples(file: &str) -> String {
    format!("{}/examples/{file}", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test]
async fn publish_sends_one_message_per_product_and_status_follows_the_upload() -> anyhow::Result<()>
{
    let mut rig = support::rig("publish", "100/1s").prepare().await?;
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
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
    assert_eq!(rig.depth(rig.topology.work()).await?, 40);

    let status = |rig: &Rig| {
        let mut cmd = turnstile();
        env_of(rig, &mut cmd);
        let (code, out, err) = run(cmd.args(["status", "--seller", "S-77", "--json"]));
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    // `publish` writes nothing to Redis: the replicas know the upload once they see it.
    assert_eq!(status(&rig), json!([]));

    rig.start_replicas(1, 4).await?;
    rig.wait_registered(40).await?;
    rig.wait_settled_registered(40).await?;
    let after = status(&rig);
    assert_eq!(
        (
            after[0]["total"].as_u64(),
            after[0]["registered"].as_u64(),
            after[0]["waiting"].as_u64(),
            after[0]["done"].as_bool(),
        ),
        (Some(40), Some(40), Some(0), Some(true))
    );

    // Publishing the same file again registers nothing twice.
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (code, _, err) = run(cmd.args([
        "publish",
        &examples("products.csv"),
        "--seller",
        "S-77",
        "--batch",
        "b1",
    ]));
    assert_eq!(code, 0, "{err}");
    while rig.total(|s| &s.already_done) < 40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = rig.mock.stats();
    assert_eq!(
        (stats.registered, stats.duplicates, stats.requests),
        (40, 0, 40)
    );
    rig.cleanup().await
}

#[tokio::test]
async fn a_weighed_upload_is_published_with_its_costs_and_registers_within_the_stack()
-> anyhow::Result<()> {
    let mut rig = support::rig("weighed-publish", "6/1s,20/5s")
        .prepare()
        .await?;
    // The mock counts a product's `cost` as its units, so the cost column is named so here.
    let file = std::env::temp_dir().join(format!("{}.jsonl", rig.topology.work()));
    std::fs::write(
        &file,
        [1, 2, 3, 4]
            .map(|c| format!("{{\"sku\":{c},\"cost\":{c}}}\n"))
            .concat()
            + "{\"sku\":5,\"cost\":\"seven\"}\n",
    )?;
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (code, out, err) = run(cmd.args([
        "publish",
        file.to_str().unwrap(),
        "--seller",
        "S-weighed",
        "--batch",
        "w1",
        "--cost-column",
        "cost",
    ]));
    std::fs::remove_file(&file)?;
    assert_eq!(code, 0, "{err}");
    // 1 + 2 + 3 fill the first second; 4 goes one second later.
    assert!(
        out.contains("published 4 of 4 products of 10 units (cost) of S-weighed (batch w1)")
            && out.contains("1 bad rows skipped; at 6/1s,20/5s they take at least 1s"),
        "{out}"
    );
    assert!(err.contains("row 5"), "the bad row is reported: {err}");
    rig.start_replicas(1, 4).await?;
    let stats = rig.wait_registered(4).await?;
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.sellers["S-weighed"].units, 10, "{stats:?}");
    rig.wait_settled_registered(4).await?;
    let after = status_of(&rig, "S-weighed");
    assert_eq!(
        (&after[0]["total"], &after[0]["waiting"], &after[0]["limit"]),
        (&json!(4), &json!(0), &json!("6/1s,20/5s"))
    );
    assert_eq!(after[0]["limits"].as_array().map(Vec::len), Some(2));
    rig.cleanup().await
}

#[tokio::test]
async fn publish_refuses_a_missing_file_with_a_clear_error() {
    let (code, _, err) =
        run(turnstile().args(["publish", "/nonexistent/products.xlsx", "--seller", "S"]));
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent/products.xlsx"), "{err}");
}

#[tokio::test]
async fn dead_letters_are_listed_and_replayed_after_the_cause_is_fixed() -> anyhow::Result<()> {
    let mut rig = support::rig("replay", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    // Rejected once (400), then accepted: the cause is "fixed" downstream.
    rig.publish_product(
        "S-1",
        "m-fixed",
        serde_json::json!({"mock": {"statuses": [400, 200]}}),
    )
    .await?;
    rig.publish_body(b"garbage").await?;
    while rig.depth(rig.topology.dead()).await? < 2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
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
    // Listing leaves them in place: returned (requeued) as the command ends, which the broker
    // may count a moment later.
    let returned = tokio::time::Instant::now() + Duration::from_secs(5);
    while rig.depth(rig.topology.dead()).await? < 2 && tokio::time::Instant::now() < returned {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        rig.depth(rig.topology.dead()).await?,
        2,
        "listing leaves them in place"
    );

    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (code, out, err) = run(cmd.args(["dead-letters", "replay", "--reason", "rejected"]));
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("replayed 1 to"), "{out}");
    rig.wait_registered(1).await?;
    assert_eq!(
        rig.depth(rig.topology.dead()).await?,
        1,
        "the garbage stays dead"
    );
    rig.cleanup().await
}

fn spawn_consumer(rig: &Rig, workers: u32) -> Child {
    let mut cmd = turnstile();
    env_of(rig, &mut cmd);
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
async fn sigterm_during_a_run_exits_zero_and_loses_nothing() -> anyhow::Result<()> {
    let mut rig = support::rig("sigterm", "20/1s").prepare().await?;
    rig.publish("busy", 100).await?;
    rig.publish("other", 10).await?;
    let mut child = spawn_consumer(&rig, 4);
    // Let it register some and hold or delay the rest, then stop it.
    let started = std::time::Instant::now();
    while rig.mock.stats().registered < 30 {
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
    rig.start_replicas(1, 4).await?;
    let stats = rig.wait_registered(110).await?;
    rig.stop_replicas().await?;
    assert_eq!(
        (stats.registered, stats.duplicates, stats.violations),
        (110, 0, 0),
        "{stats:?}"
    );
    assert_eq!(rig.depth(rig.topology.work()).await?, 0);
    rig.cleanup().await
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

#[test]
fn a_blank_dashboard_token_stops_startup_with_a_clear_error() {
    for blank in ["", "   "] {
        let mut cmd = turnstile();
        cmd.env("TURNSTILE_HTTP_TOKEN", blank)
            .env("TURNSTILE_DOWNSTREAM_URL", "http://127.0.0.1:1/r")
            .env("TURNSTILE_HTTP_ADDR", "127.0.0.1:0")
            .arg("consume");
        let (code, _, err) = run(cmd.stdin(Stdio::null()));
        assert_eq!(code, 2, "a blank token {blank:?} is refused: {err}");
        assert!(
            err.contains("TURNSTILE_HTTP_TOKEN") || err.contains("--http-token"),
            "{err}"
        );
        assert!(err.contains("the token is empty"), "{err}");
    }
}

/// `turnstile status --json` for a seller.
fn status_of(rig: &Rig, seller: &str) -> serde_json::Value {
    let mut cmd = turnstile();
    env_of(rig, &mut cmd);
    let (code, out, err) = run(cmd.args(["status", "--seller", seller, "--json"]));
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

/// (registered, dead, waiting) of a seller's one upload, as `turnstile status` shows them.
fn counts_of(rig: &Rig, seller: &str) -> (u64, u64, u64) {
    let s = status_of(rig, seller);
    let n = |f: &str| s[0][f].as_u64().unwrap_or_else(|| panic!("{f} in {s}"));
    (n("registered"), n("dead_lettered"), n("waiting"))
}

/// Reads with `read` until it gives `want`; panics after a minute with what it gave last.
async fn wait_for<T: PartialEq + std::fmt::Debug>(
    what: &str,
    want: T,
    mut read: impl AsyncFnMut() -> T,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got = read().await;
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} = {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `turnstile status` until a seller's upload shows `want` (dead letters are counted just
/// after the broker confirmed them); panics with what it showed last.
async fn wait_counts(rig: &Rig, seller: &str, want: (u64, u64, u64)) {
    let what = format!("status of {seller}: (registered, dead, waiting)");
    wait_for(&what, want, async || counts_of(rig, seller)).await;
}

/// Waits until the dashboard counts `want` messages dead now as `rejected` (`None`: no such
/// row). The dashboard's tally follows the completion record in a second step (the two live in
/// different Cluster slots), so it may trail the upload's counts for a moment.
async fn wait_rejected_now(rig: &Rig, seller: &str, want: Option<u64>) {
    wait_for("dead letters now as rejected", want, async || {
        let (dead, _) = dashboard_of(rig, seller).await;
        dead.get("rejected").and_then(serde_json::Value::as_u64)
    })
    .await;
}

/// The dashboard's dead letters by reason and a seller's upload row, as a replica serves them.
async fn dashboard_of(rig: &Rig, seller: &str) -> (serde_json::Value, serde_json::Value) {
    let dashboard = turnstile_ops::dashboard::Dashboard::new(
        rig.admin(),
        rig.records(),
        Default::default(),
        Default::default(),
        turnstile_ops::dashboard::ReplicaInfo {
            queue: rig.topology.work().to_owned(),
            algorithm: "sliding-window",
            limit: rig.limit.to_string(),
            workers: 1,
            prefetch: 1,
            pid: 0,
        },
    );
    let snapshot = serde_json::to_value(dashboard.snapshot().await.unwrap()).unwrap();
    let upload = snapshot["uploads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["seller"] == seller)
        .cloned()
        .unwrap_or_default();
    (snapshot["dead_letters"].clone(), upload)
}

#[tokio::test]
async fn status_counts_each_message_once_through_dead_letters_and_their_replay()
-> anyhow::Result<()> {
    const N: u64 = 60;
    const REJECTED: u64 = 20;
    let mut rig = support::rig("once", "100/1s").prepare().await?;
    // Every third product is rejected (400) the first time and accepted after the replay.
    let file = std::env::temp_dir().join(format!("{}.jsonl", support::unique("once")));
    let lines: String = (0..N)
        .map(|i| {
            let product = if i % 3 == 0 {
                serde_json::json!({"sku": i, "mock": {"statuses": [400, 200]}})
            } else {
                serde_json::json!({"sku": i})
            };
            format!("{product}\n")
        })
        .collect();
    std::fs::write(&file, lines).unwrap();
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (code, out, err) = run(cmd.args([
        "publish",
        file.to_str().unwrap(),
        "--seller",
        "S-once",
        "--batch",
        "b1",
    ]));
    std::fs::remove_file(&file).unwrap();
    assert_eq!(code, 0, "{out}\n{err}");

    rig.start_replicas(1, 4).await?;
    rig.wait_registered(N - REJECTED).await?;
    while u64::from(rig.depth(rig.topology.dead()).await?) < REJECTED {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_counts(&rig, "S-once", (N - REJECTED, REJECTED, 0)).await;
    wait_rejected_now(&rig, "S-once", Some(REJECTED)).await;
    let (_, upload) = dashboard_of(&rig, "S-once").await;
    assert_eq!(upload["dead"], REJECTED, "{upload}");

    // Replayed while no replica runs: every replayed message waits, none is dead any more.
    rig.stop_replicas().await?;
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (code, out, err) = run(cmd.args(["dead-letters", "replay"]));
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("replayed {REJECTED} to")), "{out}");
    let after_replay = counts_of(&rig, "S-once");
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (_, table, _) = run(cmd.args(["status", "--seller", "S-once"]));
    let (dead, upload) = dashboard_of(&rig, "S-once").await;
    assert_eq!(
        after_replay,
        (N - REJECTED, 0, REJECTED),
        "(registered, dead, waiting) right after the replay"
    );
    assert!(
        !table
            .lines()
            .any(|l| l.contains("b1") && l.ends_with("done")),
        "status says done while {REJECTED} wait in the work queue:\n{table}"
    );
    assert_eq!(dead.get("rejected"), None, "{dead}");
    assert_eq!(
        (&upload["dead"], &upload["waiting"]),
        (&0.into(), &REJECTED.into()),
        "{upload}"
    );

    // While they register, the counts never overlap: done only once all N registered.
    rig.start_replicas(1, 4).await?;
    loop {
        let (registered, dead, waiting) = counts_of(&rig, "S-once");
        assert_eq!(dead, 0);
        assert_eq!(
            registered + waiting,
            N,
            "registered {registered} + waiting {waiting}"
        );
        if registered == N {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = rig.mock.stats();
    assert_eq!((stats.registered, stats.duplicates), (N, 0), "{stats:?}");
    let (dead, upload) = dashboard_of(&rig, "S-once").await;
    assert_eq!(
        (&upload["registered"], &upload["dead"]),
        (&N.into(), &0.into()),
        "{upload}"
    );
    assert_eq!(dead.get("rejected"), None, "{dead}");
    rig.cleanup().await
}

#[tokio::test]
async fn a_message_dead_lettered_twice_counts_once() -> anyhow::Result<()> {
    let mut rig = support::rig("twice", "100/1s").prepare().await?;
    // m-copied is in the queue twice (a duplicate copy); m-again is rejected again after its
    // first replay. Both are accepted the third time they are asked.
    let product = serde_json::json!({"mock": {"statuses": [400, 400, 200]}});
    for id in ["m-copied", "m-copied", "m-again"] {
        let body = serde_json::json!({"message_id": id, "seller_id": "S-twice", "batch_id": "b2",
            "batch_size": 2, "product": product});
        rig.publish_body(body.to_string().as_bytes()).await?;
    }
    // One worker: the replayed copies are called one after the other, so the second finds the
    // first registered (two copies called at once would both reach the API: at-least-once).
    rig.start_replicas(1, 1).await?;
    while rig.depth(rig.topology.dead()).await? < 3 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Three dead letters of two messages: two dead.
    wait_counts(&rig, "S-twice", (0, 2, 0)).await;
    wait_rejected_now(&rig, "S-twice", Some(2)).await;

    let replay = |rig: &Rig| {
        let mut cmd = turnstile();
        env_of(rig, &mut cmd);
        let (code, out, err) = run(cmd.args(["dead-letters", "replay"]));
        assert_eq!(code, 0, "{err}");
        out
    };
    // Replayed: m-copied registers (its second copy is already done), m-again is dead again.
    assert!(replay(&rig).starts_with("replayed 3 to"));
    rig.wait_registered(1).await?;
    while rig.depth(rig.topology.dead()).await? < 1 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_counts(&rig, "S-twice", (1, 1, 0)).await;
    wait_rejected_now(&rig, "S-twice", Some(1)).await;

    assert!(replay(&rig).starts_with("replayed 1 to"));
    rig.wait_registered(2).await?;
    wait_counts(&rig, "S-twice", (2, 0, 0)).await;
    wait_rejected_now(&rig, "S-twice", None).await;
    let stats = rig.mock.stats();
    assert_eq!((stats.registered, stats.duplicates), (2, 0), "{stats:?}");
    rig.cleanup().await
}

#[test]
fn the_connection_flags_go_before_or_after_the_command() {
    let prefix = support::unique("global");
    let cli = |args: &[&str]| {
        let mut cmd = turnstile();
        cmd.env_remove("TURNSTILE_KEY_PREFIX")
            .env("TURNSTILE_REDIS_URL", "redis://127.0.0.1:1/")
            .env("TURNSTILE_LIMIT", "100/1m")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null());
        run(cmd.args(args))
    };
    let redis = redis_url();
    // Set with the flags before the command, read with them after it, and between `limits` and
    // its action: the same seller under the same prefix.
    let (code, out, err) = cli(&[
        "--key-prefix",
        &prefix,
        "--redis-url",
        &redis,
        "limits",
        "set",
        "--seller",
        "S-g",
        "--limit",
        "7/1s",
    ]);
    assert_eq!((code, out.trim()), (0, "S-g: 7/1s (override)"), "{err}");
    for args in [
        &[
            "limits",
            "get",
            "--seller",
            "S-g",
            "--key-prefix",
            &prefix,
            "--redis-url",
            &redis,
        ][..],
        &[
            "limits",
            "--key-prefix",
            &prefix,
            "get",
            "--seller",
            "S-g",
            "--redis-url",
            &redis,
        ],
        &[
            "--redis-url",
            &redis,
            "limits",
            "get",
            "--seller",
            "S-g",
            "--key-prefix",
            &prefix,
        ],
    ] {
        let (code, out, err) = cli(args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(out.starts_with("S-g: 7/1s (override)"), "{args:?}: {out}");
    }
    // Another prefix is another set of sellers.
    let (code, out, err) = cli(&[
        "limits",
        "get",
        "--seller",
        "S-g",
        "--redis-url",
        &redis,
        "--key-prefix",
        "t-other",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("S-g: 100/1m (default)"), "{out}");
    // A flag a command does not use is refused, before it as after it.
    for args in [
        &["--queue", "q", "limits", "get", "--seller", "S-g"][..],
        &["limits", "get", "--seller", "S-g", "--queue", "q"],
        &["--amqp-url", "amqp://h/", "status"],
    ] {
        let (code, _, err) = cli(args);
        assert_eq!(code, 2, "{args:?} is refused: {err}");
        assert!(
            err.contains("--queue") || err.contains("--amqp-url"),
            "{err}"
        );
    }
    let (code, _, _) = cli(&[
        "limits",
        "clear",
        "--seller",
        "S-g",
        "--redis-url",
        &redis,
        "--key-prefix",
        &prefix,
    ]);
    assert_eq!(code, 0);
}

#[test]
fn each_command_shows_only_its_own_options() {
    let help = |args: &[&str]| {
        let (code, out, err) = run(turnstile().args(args).arg("--help"));
        assert_eq!(code, 0, "{err}");
        out
    };
    let consume = help(&["consume"]);
    for flag in [
        "--amqp-url",
        "--queue",
        "--key-prefix",
        "--limit-guard",
        "--reserve-horizon",
        "--permit-block",
        "--adaptive",
    ] {
        assert!(consume.contains(flag), "consume --help: {flag}");
    }
    let publish = help(&["publish"]);
    assert!(publish.contains("--limit <LIMIT>") && publish.contains("--queue"));
    for tuning in [
        "--algorithm",
        "--permit-block",
        "--record-delay",
        "--gcra-burst",
        "--workers",
    ] {
        assert!(!publish.contains(tuning), "publish --help shows {tuning}");
    }
    let status = help(&["status"]);
    for term in [
        "--limit",
        "--algorithm",
        "--limit-guard",
        "--adaptive",
        "--global-limit",
    ] {
        assert!(status.contains(term), "status --help: {term}");
    }
    for other in [
        "--permit-block",
        "--record-delay",
        "--reserve-horizon",
        "--amqp-url",
        "--queue ",
    ] {
        assert!(!status.contains(other), "status --help shows {other}");
    }
    let dead_letters = help(&["dead-letters", "replay"]);
    for other in ["--limit", "--algorithm", "--adaptive"] {
        assert!(
            !dead_letters.contains(other),
            "dead-letters --help shows {other}"
        );
    }
    let mock = help(&["mock-api"]);
    assert!(
        !mock.contains("--amqp-url") && !mock.contains("--key-prefix"),
        "{mock}"
    );
}

#[test]
fn completions_are_printed_for_each_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let (code, out, err) = run(turnstile().args(["completions", shell]));
        assert_eq!(code, 0, "{shell}: {err}");
        assert!(
            out.contains("limits") && out.contains("dead-letters"),
            "{shell}"
        );
    }
    let (code, out, _) = run(turnstile().args(["completions", "bash"]));
    assert_eq!(code, 0);
    assert!(
        out.contains("complete") && out.contains("--key-prefix"),
        "{out}"
    );
}
