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
    let (code, out, err) = run(cmd.env("TURNSTILE_OPERATOR", "ana").args([
        "dead-letters",
        "replay",
        "--reason",
        "rejected",
    ]));
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("replayed 1 to"), "{out}");
    rig.wait_registered(1).await?;
    assert_eq!(
        rig.depth(rig.topology.dead()).await?,
        1,
        "the garbage stays dead"
    );
    // The replay is in the audit trail every replica's console lists, with who and where.
    let actions = turnstile_ops::audit::recent(&rig.records(), 10).await?;
    assert_eq!(actions.len(), 1, "{actions:?}");
    let replay = &actions[0];
    assert_eq!(
        (
            replay.action.as_str(),
            replay.argument.as_deref(),
            replay.dry_run
        ),
        ("replay", Some("rejected"), false),
        "{replay:?}"
    );
    assert_eq!(replay.who.operator.as_deref(), Some("ana"), "{replay:?}");
    assert!(
        replay.who.remote.starts_with("command line on "),
        "{replay:?}"
    );
    assert!(replay.result.starts_with("replayed 1"), "{replay:?}");
    rig.cleanup().await
}

/// A pause from the command line is in the audit trail with who asked, for how long and why,
/// as a pause from the console is; a read (`limits get`) is not.
#[tokio::test]
async fn a_pause_from_the_command_line_is_audited_with_who_and_why() -> anyhow::Result<()> {
    let rig = support::rig("cli-audit", "100/1s").prepare().await?;
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (code, out, err) = run(cmd.env("TURNSTILE_OPERATOR", "night shift").args([
        "limits",
        "pause",
        "--seller",
        "S-noisy",
        "--for",
        "10m",
        "--why",
        "flooding the API",
    ]));
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("S-noisy: paused"), "{out}");
    let mut cmd = turnstile();
    env_of(&rig, &mut cmd);
    let (code, _, err) = run(cmd.args(["limits", "get", "--seller", "S-noisy"]));
    assert_eq!(code, 0, "{err}");
    let actions = turnstile_ops::audit::recent(&rig.records(), 10).await?;
    assert_eq!(actions.len(), 1, "only the pause: {actions:?}");
    let pause = &actions[0];
    assert_eq!(
        (
            pause.action.as_str(),
            pause.seller.as_deref(),
            pause.argument.as_deref()
        ),
        ("pause", Some("S-noisy"), Some("10m: flooding the API")),
        "{pause:?}"
    );
    assert_eq!(pause.who.operator.as_deref(), Some("night shift"));
    assert_eq!(pause.outcome, "done");
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
    let shown = readme_demo_output();
    for label in [
        "summary",
        "registered",
        "lost",
        "duplicates",
        "violations",
        "dead-lettered",
    ] {
        let line = shown
            .lines()
            .find(|l| l.split_whitespace().next() == Some(label))
            .unwrap_or_else(|| panic!("the README's demo output has no {label} line:\n{shown}"));
        assert!(
            out.lines().any(|l| l == line),
            "the demo printed no {line:?}:\n{out}"
        );
    }
}

/// The demo's output as the README's quick start shows it: its first `text` block.
fn readme_demo_output() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
    let readme = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let quick_start = readme
        .split("## Quick start")
        .nth(1)
        .expect("the README has a quick start");
    quick_start
        .split("```text\n")
        .nth(1)
        .and_then(|block| block.split("```").next())
        .unwrap_or_else(|| panic!("the quick start shows no output:\n{quick_start}"))
        .to_owned()
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

#[test]
fn a_placeholder_other_than_seller_id_in_the_downstream_url_stops_startup_naming_both() {
    let mut cmd = turnstile();
    // A broker that refuses the login ends a replica that would start with the template.
    cmd.env("TURNSTILE_AMQP_URL", wrong_password_url())
        .env("TURNSTILE_REDIS_URL", redis_url())
        .env("TURNSTILE_KEY_PREFIX", support::unique("placeholder"))
        .env("TURNSTILE_QUEUE", support::unique("placeholder"))
        .env(
            "TURNSTILE_DOWNSTREAM_URL",
            "http://127.0.0.1:1/register/{seller}",
        )
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("RUST_LOG", "off")
        .arg("consume");
    let (code, _, err) = run(cmd.stdin(Stdio::null()));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("TURNSTILE_DOWNSTREAM_URL")
            && err.contains("unknown placeholder {seller}: the only placeholder is {seller_id}"),
        "{err}"
    );
}

#[test]
fn a_bad_value_read_from_a_variable_is_named_by_the_variable_not_only_the_flag() {
    let cases = [
        ("consume", "TURNSTILE_WORKERS", "--workers", "x"),
        ("consume", "TURNSTILE_ADAPTIVE", "--adaptive", "maybe"),
        ("consume", "TURNSTILE_HTTP_ADDR", "--http-addr", "nope"),
        ("status", "TURNSTILE_LIMIT", "--limit", "lots"),
    ];
    for (command, variable, flag, value) in cases {
        let (code, out, err) = run(turnstile()
            .env(variable, value)
            .arg(command)
            .stdin(Stdio::null()));
        assert_eq!(code, 2, "{variable}={value}: {err}");
        assert!(out.is_empty(), "{out}");
        assert!(
            err.contains(&format!(
                "invalid value '{value}' for '{variable} ({flag})'"
            )),
            "{variable}={value}: {err}"
        );
        let (code, _, err) = run(turnstile()
            .args([command, flag, value])
            .stdin(Stdio::null()));
        assert_eq!(code, 2, "{flag} {value}: {err}");
        assert!(
            err.contains(&format!("invalid value '{value}' for '{flag}")),
            "{flag} {value}: {err}"
        );
    }
}

/// Runs `cmd` with its stdout a pipe whose reader has already gone (as `| head -1` leaves it
/// once head has its line); (exit code, stderr).
fn with_stdout_closed(cmd: &mut Command) -> (i32, String) {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = cmd
        .stdout(writer)
        .stdin(Stdio::null())
        .output()
        .expect("command runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn printing_to_a_closed_stdout_ends_quietly_with_exit_zero() {
    let prefix = support::unique("closed-stdout");
    let mut completions = turnstile();
    completions.args(["completions", "bash"]);
    let mut status = turnstile();
    status
        .env("TURNSTILE_REDIS_URL", redis_url())
        .env("TURNSTILE_KEY_PREFIX", &prefix)
        .env("RUST_LOG", "off")
        .args(["status", "--json"]);
    for mut cmd in [completions, status] {
        let (code, err) = with_stdout_closed(&mut cmd);
        // `status` notes on stderr that no replica is alive; nothing else may be said there.
        let err: Vec<&str> = err
            .lines()
            .filter(|l| !l.starts_with("no turnstile replica is alive"))
            .collect();
        assert_eq!((code, err), (0, Vec::<&str>::new()), "{cmd:?}");
    }
}

/// The test broker's URL with a password it refuses.
fn wrong_password_url() -> String {
    let uri: lapin::uri::AMQPUri = support::broker::amqp_url().parse().expect("an AMQP URL");
    let vhost = uri.vhost.replace('%', "%25").replace('/', "%2f");
    format!(
        "amqp://{}:not-the-password@{}:{}/{vhost}",
        uri.authority.userinfo.username, uri.authority.host, uri.authority.port
    )
}

#[test]
fn a_refused_login_says_so_once_with_the_user_and_the_setting_to_check() {
    let (code, out, err) = run(turnstile()
        .env("TURNSTILE_AMQP_URL", wrong_password_url())
        .env("TURNSTILE_QUEUE", support::unique("login"))
        .env("RUST_LOG", "off")
        .args(["dead-letters", "list"])
        .stdin(Stdio::null()));
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty(), "{out}");
    let user = support::broker::amqp_url()
        .parse::<lapin::uri::AMQPUri>()
        .map(|u| u.authority.userinfo.username)
        .expect("an AMQP URL");
    assert!(
        err.contains(&format!(
            "the broker refused the login for user {user}: check TURNSTILE_AMQP_URL"
        )),
        "{err}"
    );
    assert_eq!(err.matches("Login was refused").count(), 1, "{err}");
    assert!(!err.contains("not-the-password"), "{err}");
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
    // What the commands wrote beside the limit (their audit entries, the terms' reschedules).
    tokio::runtime::Runtime::new()
        .expect("a runtime")
        .block_on(support::delete_keys(&redis, &prefix));
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

/// Runs `turnstile` with the rig's environment; (exit code, stdout, stderr).
fn cli(rig: &Rig, args: &[&str]) -> (i32, String, String) {
    let mut cmd = turnstile();
    env_of(rig, &mut cmd);
    run(cmd.args(args).stdin(Stdio::null()))
}

/// Runs a `--json` command that must succeed and returns its one JSON document.
fn cli_json(rig: &Rig, args: &[&str]) -> serde_json::Value {
    let (code, out, err) = cli(rig, args);
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

/// The message ids of listed dead letters, sorted.
fn ids_of(letters: &serde_json::Value) -> Vec<String> {
    let mut ids: Vec<String> = letters
        .as_array()
        .unwrap_or_else(|| panic!("a list of dead letters: {letters}"))
        .iter()
        .map(|d| d["message_id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

/// Waits until `<queue>.dead` holds `n` ready messages (a listing or a dry run returns what it
/// read, which the broker counts a moment later).
async fn wait_dead(rig: &Rig, n: u32) {
    let what = format!("{}'s depth", rig.topology.dead());
    wait_for(&what, n, async || {
        rig.depth(rig.topology.dead()).await.unwrap()
    })
    .await;
}

/// `dead-letters list --json` with the selecting flags `select`: the ids listed, once every
/// one of the `present` dead letters is back in the queue.
async fn listed(rig: &Rig, present: u32, select: &[&str]) -> Vec<String> {
    wait_dead(rig, present).await;
    let args: Vec<&str> = ["dead-letters", "list", "--json"]
        .into_iter()
        .chain(select.iter().copied())
        .collect();
    ids_of(&cli_json(rig, &args))
}

#[tokio::test]
async fn dead_letters_are_listed_and_replayed_by_id_seller_batch_and_reason() -> anyhow::Result<()>
{
    let mut rig = support::rig("select", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    // Rejected once (400), accepted when replayed.
    let fixed = json!({"mock": {"statuses": [400, 200]}});
    for (id, seller, batch) in [
        ("m-a1", "S-a", "b1"),
        ("m-a2", "S-a", "b1"),
        ("m-b1", "S-b", "b2"),
    ] {
        let body = turnstile_lab::rig::registration_body(id, seller, Some(batch), fixed.clone());
        rig.publish_body(&body).await?;
    }
    // Invalid: a cost of 0 (its seller and batch are still read), and a body that is no JSON.
    let invalid = json!({"message_id": "m-a3", "seller_id": "S-a", "batch_id": "b1", "cost": 0,
        "product": {}});
    rig.publish_body(invalid.to_string().as_bytes()).await?;
    rig.publish_body(b"\x1b[31mgarbage\xff").await?;
    wait_dead(&rig, 5).await;

    // Every dead letter, with what an operator needs.
    let all = cli_json(&rig, &["dead-letters", "list", "--json"]);
    let letters = all.as_array().unwrap();
    assert_eq!(letters.len(), 5, "{all}");
    let a1 = letters.iter().find(|d| d["message_id"] == "m-a1").unwrap();
    assert_eq!(
        (
            &a1["seller_id"],
            &a1["batch_id"],
            &a1["reason"],
            &a1["attempts"]
        ),
        (&json!("S-a"), &json!("b1"), &json!("rejected"), &json!(1)),
        "{a1}"
    );
    assert!(a1["detail"].as_str().unwrap().contains("400"), "{a1}");
    assert!(a1["dead_at"].as_str().unwrap().ends_with('Z'), "{a1}");
    assert!(a1["dead_at_ms"].as_u64().is_some(), "{a1}");
    assert!(
        a1["body_excerpt"].as_str().unwrap().contains("\"m-a1\""),
        "{a1}"
    );
    assert_eq!(a1["body_truncated"], false, "{a1}");
    let garbage = letters.iter().find(|d| d["seller_id"].is_null()).unwrap();
    assert_eq!(garbage["reason"], "invalid-message", "{garbage}");
    let garbage_id = garbage["message_id"].as_str().unwrap().to_owned();
    assert!(garbage_id.starts_with("sha256:"), "{garbage}");
    // The table shows the garbage without handing its escape sequence to the terminal.
    let (code, table, err) = cli(&rig, &["dead-letters", "list"]);
    assert_eq!(code, 0, "{err}");
    assert!(table.starts_with("5 dead letters in"), "{table}");
    assert!(
        !table.contains('\u{1b}') && table.contains("\\u{1b}[31mgarbage"),
        "{table}"
    );

    // Selected by seller, batch, reason, id, and by several at once (all must hold).
    assert_eq!(
        listed(&rig, 5, &["--seller", "S-a"]).await,
        ["m-a1", "m-a2", "m-a3"]
    );
    assert_eq!(listed(&rig, 5, &["--batch", "b2"]).await, ["m-b1"]);
    let mut invalid = vec!["m-a3".to_owned(), garbage_id.clone()];
    invalid.sort();
    assert_eq!(
        listed(&rig, 5, &["--reason", "invalid-message"]).await,
        invalid
    );
    assert_eq!(listed(&rig, 5, &["--id", "m-b1"]).await, ["m-b1"]);
    assert_eq!(
        listed(
            &rig,
            5,
            &["--seller", "S-a", "--batch", "b1", "--reason", "rejected"]
        )
        .await,
        ["m-a1", "m-a2"]
    );
    assert!(
        listed(&rig, 5, &["--seller", "S-b", "--reason", "invalid-message"])
            .await
            .is_empty()
    );

    // A dry run shows exactly what would move, and moves nothing.
    wait_dead(&rig, 5).await;
    let dry = cli_json(
        &rig,
        &[
            "dead-letters",
            "replay",
            "--dry-run",
            "--seller",
            "S-a",
            "--reason",
            "rejected",
            "--json",
        ],
    );
    assert_eq!(
        (
            &dry["dry_run"],
            &dry["matched"],
            &dry["replayed"],
            &dry["kept"]
        ),
        (&json!(true), &json!(2), &json!(0), &json!(3)),
        "{dry}"
    );
    assert_eq!(ids_of(&dry["letters"]), ["m-a1", "m-a2"]);
    assert_eq!(dry["work_queue"], rig.topology.work());
    wait_dead(&rig, 5).await;
    let (code, out, err) = cli(
        &rig,
        &["dead-letters", "replay", "--dry-run", "--batch", "b2"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("would replay 1 to"), "{out}");
    wait_dead(&rig, 5).await;
    assert_eq!(rig.mock.stats().registered, 0, "a dry run moves nothing");

    // Replayed one message by its id: it alone registers.
    let one = cli_json(&rig, &["dead-letters", "replay", "--id", "m-a1", "--json"]);
    assert_eq!(
        (
            &one["dry_run"],
            &one["matched"],
            &one["replayed"],
            &one["kept"]
        ),
        (&json!(false), &json!(1), &json!(1), &json!(4)),
        "{one}"
    );
    assert_eq!(ids_of(&one["letters"]), ["m-a1"]);
    let stats = rig.wait_registered(1).await?;
    assert_eq!(stats.sellers["S-a"].registered, 1, "{stats:?}");
    // By seller, then by batch and reason.
    wait_dead(&rig, 4).await;
    let (code, out, err) = cli(&rig, &["dead-letters", "replay", "--seller", "S-b"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("replayed 1 to"), "{out}");
    rig.wait_registered(2).await?;
    wait_dead(&rig, 3).await;
    let (code, out, err) = cli(
        &rig,
        &[
            "dead-letters",
            "replay",
            "--batch",
            "b1",
            "--reason",
            "rejected",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("replayed 1 to"), "{out}");
    let stats = rig.wait_registered(3).await?;
    assert_eq!(
        (stats.registered, stats.duplicates, stats.violations),
        (3, 0, 0),
        "{stats:?}"
    );
    // What is left: the two invalid ones. Nothing matched is no failure.
    assert_eq!(listed(&rig, 2, &[]).await, invalid);
    wait_dead(&rig, 2).await;
    let none = cli_json(
        &rig,
        &["dead-letters", "replay", "--id", "m-none", "--json"],
    );
    assert_eq!((&none["matched"], &none["kept"]), (&json!(0), &json!(2)));
    wait_dead(&rig, 2).await;
    let (code, _, err) = cli(&rig, &["dead-letters", "replay", "--id", "m-none"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("no dead letter matches"), "{err}");
    rig.cleanup().await
}

#[test]
fn an_unknown_reason_is_a_usage_error_that_lists_the_reasons() {
    for args in [
        &["dead-letters", "list", "--reason", "bogus"][..],
        &["dead-letters", "replay", "--reason", "rejectd"],
        &[
            "dead-letters",
            "replay",
            "--dry-run",
            "--reason",
            "Rejected",
        ],
    ] {
        // Refused before anything connects: nowhere to connect to is needed.
        let (code, out, err) = run(turnstile()
            .args(args)
            .env("TURNSTILE_AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
            .env("TURNSTILE_REDIS_URL", "redis://127.0.0.1:1/"));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{out}");
        for reason in [
            "invalid-message",
            "rejected",
            "attempts-exhausted",
            "throttled",
            "delivery-limit",
            "broker-expired",
            "unknown",
        ] {
            assert!(
                err.contains(reason),
                "{args:?} does not list {reason}: {err}"
            );
        }
    }
}

#[test]
fn usage_errors_exit_2_and_failures_to_connect_exit_1() {
    let nowhere = |cmd: &mut Command| {
        cmd.env("TURNSTILE_AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
            .env("TURNSTILE_REDIS_URL", "redis://127.0.0.1:1/")
            .env("RUST_LOG", "off")
            .stdin(Stdio::null());
    };
    for args in [
        &["limits", "pause", "--seller", "S", "--for", "0s"][..],
        &["limits", "pause", "--seller", "S", "--for", "0"],
        &["limits", "pause", "--seller", "S", "--for", "25h"],
        &["limits", "pause", "--seller", "S", "--for", "soon"],
        &["limits", "pause", "--for", "10m"],
        &["limits", "get", "--seller", ""],
        &["dead-letters", "list", "--seller", "a\u{1}b"],
        &["dead-letters", "replay", "--id", ""],
        &["limits", "frobnicate"],
        &["status", "--rows", "5"],
        &["status", "--deadline", "2026-11-26T10:00:00+09:00"],
        &["status", "--seller", "S", "--rows", "0"],
        &["status", "--seller", "S", "--rows", "1000001"],
        &["status", "--seller", "S", "--deadline", "tomorrow"],
    ] {
        let mut cmd = turnstile();
        nowhere(&mut cmd);
        let (code, out, err) = run(cmd.args(args));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
    }
    for args in [
        &["limits", "get", "--seller", "S", "--json"][..],
        &["limits", "pause", "--seller", "S", "--for", "10m", "--json"],
        &["dead-letters", "list", "--json"],
        &["status", "--json"],
    ] {
        let mut cmd = turnstile();
        nowhere(&mut cmd);
        let (code, out, err) = run(cmd.args(args));
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: nothing on stdout, got {out}");
        assert!(err.contains("127.0.0.1:1"), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn a_paused_seller_waits_uncalled_until_resumed_and_then_keeps_its_limit()
-> anyhow::Result<()> {
    let mut rig = support::rig("pause", "4/1s").prepare().await?;
    rig.start_replicas(1, 4).await?;
    let paused = cli_json(
        &rig,
        &[
            "limits", "pause", "--seller", "S-p", "--for", "10m", "--json",
        ],
    );
    assert_eq!(
        (
            &paused["seller"],
            &paused["until_resumed"],
            &paused["requested_s"]
        ),
        (&json!("S-p"), &json!(false), &json!(600.0)),
        "{paused}"
    );
    let left = paused["paused_for_s"].as_f64().unwrap();
    assert!(left > 0.0 && left <= 600.0, "{paused}");
    let got = cli_json(&rig, &["limits", "get", "--seller", "S-p", "--json"]);
    assert!(got["paused_for_s"].as_f64().unwrap() > 0.0, "{got}");

    rig.publish("S-p", 12).await?;
    rig.publish("S-other", 4).await?;
    // The other seller is not held up; the paused one's messages are all delayed, none called.
    let stats = rig.wait_registered(4).await?;
    assert_eq!(stats.sellers["S-other"].registered, 4, "{stats:?}");
    support::eventually("the paused seller's messages are delayed", || {
        rig.total(|s| &s.delayed) >= 12
    })
    .await;
    let stats = rig.mock.stats();
    assert!(
        !stats.sellers.contains_key("S-p"),
        "called while paused: {stats:?}"
    );

    // Resumed: they come back at once (not after the 10 minutes), within the seller's limit.
    let resumed = cli_json(&rig, &["limits", "resume", "--seller", "S-p", "--json"]);
    assert_eq!(resumed, json!({"seller": "S-p", "resumed": true}));
    let stats = rig.wait_registered(16).await?;
    assert_eq!(
        (stats.registered, stats.violations, stats.duplicates),
        (16, 0, 0),
        "{stats:?}"
    );
    assert!(stats.sellers["S-p"].max_in_window <= 4, "{stats:?}");

    // Without --for: until resumed, at most a day.
    let held = cli_json(&rig, &["limits", "pause", "--seller", "S-q", "--json"]);
    assert_eq!(held["until_resumed"], true, "{held}");
    assert!(held["paused_for_s"].as_f64().unwrap() <= 86_400.0, "{held}");
    let (code, out, err) = cli(&rig, &["limits", "resume", "--seller", "S-q"]);
    assert_eq!((code, out.trim()), (0, "S-q: pause lifted"), "{err}");
    let got = cli_json(&rig, &["limits", "get", "--seller", "S-q", "--json"]);
    assert_eq!(got["paused_for_s"], 0.0, "{got}");
    let again = cli_json(&rig, &["limits", "resume", "--seller", "S-q", "--json"]);
    assert_eq!(again["resumed"], false, "{again}");
    rig.cleanup().await
}

#[tokio::test]
async fn every_scripted_command_prints_one_json_document() -> anyhow::Result<()> {
    let rig = support::rig("json", "100/1s").prepare().await?;
    let set = cli_json(
        &rig,
        &[
            "limits", "set", "--seller", "S-j", "--limit", "7/1s", "--weight", "3", "--json",
        ],
    );
    assert_eq!(
        set,
        json!({"seller": "S-j", "limit": "7/1s", "shadow": false, "weight": 3})
    );
    let got = cli_json(&rig, &["limits", "get", "--seller", "S-j", "--json"]);
    assert_eq!(
        (
            &got["limit"],
            &got["override"],
            &got["weight"],
            &got["paused_for_s"]
        ),
        (&json!("7/1s"), &json!(true), &json!(3), &json!(0.0)),
        "{got}"
    );
    assert_eq!(got["limits"][0]["limit"], "7/1s", "{got}");
    assert_eq!(got["limits"][0]["binds"], true, "{got}");
    let cleared = cli_json(&rig, &["limits", "clear", "--seller", "S-j", "--json"]);
    assert_eq!(
        (&cleared["cleared"], &cleared["default_limit"]),
        (&json!(true), &json!("100/1s")),
        "{cleared}"
    );
    let reset = cli_json(&rig, &["limits", "reset", "--seller", "S-j", "--json"]);
    assert!(reset["paused_for_s"].as_f64().unwrap() > 0.0, "{reset}");
    let resumed = cli_json(&rig, &["limits", "resume", "--seller", "S-j", "--json"]);
    assert_eq!(resumed["resumed"], true, "{resumed}");

    let published = cli_json(
        &rig,
        &[
            "publish",
            &examples("products.csv"),
            "--seller",
            "S-j",
            "--batch",
            "bj",
            "--json",
        ],
    );
    assert_eq!(
        (
            &published["published"],
            &published["products"],
            &published["failed"],
            &published["batch_id"],
            &published["queue"]
        ),
        (
            &json!(40),
            &json!(40),
            &json!(0),
            &json!("bj"),
            &json!(rig.topology.work())
        ),
        "{published}"
    );
    assert_eq!(rig.depth(rig.topology.work()).await?, 40);
    assert_eq!(cli_json(&rig, &["status", "--json"]), json!([]));
    // Asking before publishing: an idle seller's 250 rows at 100/1s, granted at 0, 1 and 2 s.
    let asked = cli_json(
        &rig,
        &[
            "status",
            "--seller",
            "S-ask",
            "--rows",
            "250",
            "--deadline",
            "2030-01-01T09:00:00+09:00",
            "--json",
        ],
    );
    let admission = &asked["admission"];
    assert_eq!(
        (
            &asked["seller_id"],
            &asked["backlog"],
            &admission["rows"],
            &admission["finish_in_s"],
            &admission["deadline"],
            &admission["meets_deadline"]
        ),
        (
            &json!("S-ask"),
            &json!(0),
            &json!(250),
            &json!(2.0),
            &json!("2030-01-01T00:00:00Z"),
            &json!(true)
        ),
        "{asked}"
    );
    let (code, out, err) = cli(
        &rig,
        &[
            "status",
            "--seller",
            "S-ask",
            "--deadline",
            "2020-01-01T00:00:00Z",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("1 more row of S-ask published now")
            && out.contains("deadline 2020-01-01T00:00:00Z: NOT met"),
        "{out}"
    );
    assert_eq!(
        cli_json(&rig, &["dead-letters", "list", "--json"]),
        json!([])
    );
    let replayed = cli_json(&rig, &["dead-letters", "replay", "--dry-run", "--json"]);
    assert_eq!(replayed["matched"], 0, "{replayed}");
    rig.cleanup().await
}

#[tokio::test]
async fn dead_letters_are_listed_by_group_and_discarded_for_good_after_a_dry_run()
-> anyhow::Result<()> {
    let mut rig = support::rig("discard-cli", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    let rejected = json!({"mock": {"statuses": [400]}});
    for (id, seller) in [("m-d1", "S-d"), ("m-d2", "S-d"), ("m-e1", "S-e")] {
        let body = turnstile_lab::rig::registration_body(id, seller, Some("bd"), rejected.clone());
        rig.publish_body(&body).await?;
    }
    rig.publish_body(b"garbage").await?;
    wait_dead(&rig, 4).await;

    // The table starts with the groups: three alike, one invalid.
    let (code, table, err) = cli(&rig, &["dead-letters", "list"]);
    assert_eq!(code, 0, "{err}");
    assert!(table.contains("by reason and detail"), "{table}");
    let rejected_line = table
        .lines()
        .find(|l| l.contains(" rejected "))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(rejected_line.trim_start().starts_with("3 "), "{table}");

    // A dry run removes nothing.
    let dry = cli_json(
        &rig,
        &[
            "dead-letters",
            "discard",
            "--seller",
            "S-d",
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(
        (&dry["matched"], &dry["discarded"]),
        (&json!(2), &json!(0)),
        "{dry}"
    );
    wait_dead(&rig, 4).await;

    // The real one removes exactly those, for good; the others stay.
    let done = cli_json(
        &rig,
        &[
            "dead-letters",
            "discard",
            "--seller",
            "S-d",
            "--operator",
            "ana",
            "--json",
        ],
    );
    assert_eq!(
        (&done["matched"], &done["discarded"]),
        (&json!(2), &json!(2)),
        "{done}"
    );
    assert_eq!(ids_of(&done["letters"]), ["m-d1", "m-d2"]);
    wait_dead(&rig, 2).await;
    assert_eq!(listed(&rig, 2, &[]).await.len(), 2);
    assert!(listed(&rig, 2, &["--seller", "S-d"]).await.is_empty());
    // Nothing was republished: no call for them.
    assert_eq!(rig.mock.stats().registered, 0);
    // Audited, with who did it.
    let actions = turnstile_ops::audit::recent(&rig.records(), 10).await?;
    let discards: Vec<_> = actions.iter().filter(|a| a.action == "discard").collect();
    assert_eq!(discards.len(), 2, "{actions:?}");
    assert!(discards.iter().any(|a| a.dry_run), "{actions:?}");
    assert!(
        discards
            .iter()
            .any(|a| a.who.operator.as_deref() == Some("ana")),
        "{actions:?}"
    );
    rig.cleanup().await
}
