//! What a replica tells the operator besides its counters: its log lines as they reach a file
//! or a log pipeline (no colours in a pipe, flat JSON, one line per change of the broker
//! connection's state, no password), and the count of uploads past their ETA. The broker is
//! shared with other tests, so it is never stopped: a replica reaches it through a proxy that
//! the test cuts and restores (`turnstile_lab::slow_link`). Every line of this test binary, on
//! every thread (lapin logs from threads of its own), goes to one global subscriber; the tests
//! that read it run one at a time.
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use turnstile_core::telemetry::{self, Format};
use turnstile_lab::slow_link::SlowLink;
use turnstile_ops::overdue::Promises;

/// The lines of this process: as a replica writes them in JSON (its default filter), and
/// everything at `info` (what lapin says on its own).
struct Captured {
    replica: support::Lines,
    everything: support::Lines,
}

fn captured() -> &'static Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED.get_or_init(|| {
        let captured = Captured {
            replica: support::Lines::default(),
            everything: support::Lines::default(),
        };
        tracing_subscriber::registry()
            .with(
                telemetry::layer(Format::Json, captured.replica.clone())
                    .with_filter(telemetry::filter_from(None)),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(captured.everything.clone())
                    .with_ansi(false)
                    .with_filter(tracing_subscriber::EnvFilter::new("info")),
            )
            .init();
        captured
    })
}

/// One test at a time reads the captured lines.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_broker_connection_is_one_line_when_lost_and_one_when_back() -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let captured = captured();
    let url = support::broker::amqp_url();
    let host = url
        .split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap();
    let broker = tokio::net::lookup_host(host).await?.next().unwrap();
    let link = SlowLink::start(broker, Duration::ZERO).await?;
    let mut rig = support::rig("signals-outage", "100/1s").prepare().await?;
    let mut settings = rig.settings(2);
    let password = "guest";
    settings.broker.amqp.url = format!("amqp://guest:{password}@{}/%2f", link.addr());
    rig.start_replica(settings).await?;
    let ready = rig.replicas().next().unwrap().ready.clone();
    assert!(ready.get());
    captured.replica.take();
    captured.everything.take();

    // Lost: every connection closed, and every attempt to reconnect, until restored.
    let accepted = link.accepted();
    link.cut();
    support::eventually_async("the replica sees the connection lost", async || {
        !ready.get()
    })
    .await;
    support::eventually_async("three attempts to reconnect failed", async || {
        link.accepted() >= accepted + 3
    })
    .await;
    link.restore();
    support::eventually_async("the replica consumes again", async || ready.get()).await;
    let ours = captured.replica.take();
    let everything = captured.everything.take();
    rig.publish("S-after-outage", 2).await?;
    rig.wait_registered(2).await?;
    rig.stop_replicas().await?;
    rig.cleanup().await?;

    let lines: Vec<Value> = ours
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is one JSON object"))
        .collect();
    let said = |message: &str| -> Vec<&Value> {
        lines.iter().filter(|l| l["message"] == message).collect()
    };
    let lost = said("broker connection lost; reconnecting");
    assert_eq!(lost.len(), 1, "one line when lost:\n{ours}");
    let back = said("reconnected to the broker; consuming again");
    assert_eq!(back.len(), 1, "one line when back:\n{ours}");
    assert!(back[0]["failures"].as_u64().unwrap() >= 3, "{}", back[0]);
    let node = format!("amqp://***@{}/%2f", link.addr());
    assert_eq!(lost[0]["broker"], node.as_str(), "{}", lost[0]);
    assert_eq!(back[0]["broker"], node.as_str(), "{}", back[0]);
    let loud: Vec<&Value> = lines
        .iter()
        .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
        .collect();
    assert_eq!(loud, lost, "the one warning of the outage:\n{ours}");
    assert!(
        !lines
            .iter()
            .any(|l| l["target"].as_str().is_some_and(|t| t.starts_with("lapin"))),
        "lapin's own lines are off:\n{ours}"
    );
    assert!(!ours.contains(password), "a password in the logs:\n{ours}");
    assert!(
        !ours.contains("Error {") && !ours.contains("Kind("),
        "Debug format in the logs:\n{ours}"
    );
    for line in &lines {
        let text = line.to_string();
        assert!(text.matches("os error").count() <= 1, "{text}");
    }
    // What the default filter kept out: lapin's own ERROR lines for the same outage.
    let lapin = everything
        .lines()
        .filter(|l| l.contains(" ERROR ") && l.contains("lapin::"))
        .count();
    assert!(
        lapin >= 1,
        "lapin logged nothing of the outage:\n{everything}"
    );
    println!(
        "the outage: {} line(s) from the replica, lapin would have added {lapin} ERROR line(s)",
        lines.len()
    );
    Ok(())
}

/// Runs `turnstile consume` with `env`, its stderr piped, until it logs that Redis (at a port
/// where nothing listens) is unavailable; what it wrote to stderr by then.
fn piped_replica_lines(env: &[(&str, &str)]) -> String {
    let redis = format!("redis://:s3cret@127.0.0.1:{}/", support::free_port());
    let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
    command
        .arg("consume")
        .env("TURNSTILE_REDIS_URL", &redis)
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("TURNSTILE_DOWNSTREAM_URL", "http://127.0.0.1:9/{seller_id}")
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .env_remove("TURNSTILE_LOG_FORMAT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("the binary runs");
    let stderr = child.stderr.take().unwrap();
    let (lines, read) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let mut text = String::new();
    loop {
        let line = read
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no line about Redis:\n{text}"));
        text.push_str(&line);
        text.push('\n');
        if line.contains("Redis is unavailable") {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    text
}

#[test]
fn a_replica_writing_to_a_pipe_writes_no_colours_and_json_lines_are_flat() {
    let text = piped_replica_lines(&[]);
    assert!(
        !text.contains('\u{1b}'),
        "ANSI escapes in a pipe:\n{text:?}"
    );
    assert!(text.contains(" WARN "), "{text}");
    let text = piped_replica_lines(&[("TURNSTILE_LOG_FORMAT", "json")]);
    assert!(!text.contains('\u{1b}'), "{text:?}");
    for line in text.lines() {
        let line: Value = serde_json::from_str(line).expect("one JSON object per line");
        assert!(
            line.get("fields").is_none() && line.get("span").is_none(),
            "{line}"
        );
        if line["message"] == "Redis is unavailable; retrying until it answers" {
            assert_eq!(line["level"], "WARN");
            assert_eq!(line["target"], "turnstile_core::replica");
            assert!(
                line["error"].as_str().is_some_and(|e| !e.is_empty()),
                "{line}"
            );
        }
    }
    assert!(!text.contains("s3cret"), "a password in the logs:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_still_waiting_past_its_eta_counts_as_overdue_and_one_whose_rows_never_come_as_stalled()
-> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    captured();
    let mut rig = support::rig("signals-overdue", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    // A batch of 3 of which only one message ever comes: two wait for good. And a batch of
    // one, done.
    for (message, batch, size) in [("m-late-1", "b-late", 3), ("m-done-1", "b-done", 1)] {
        let body = json!({
            "message_id": message,
            "seller_id": "S-overdue",
            "batch_id": batch,
            "batch_size": size,
            "product": {"sku": message},
        });
        rig.publish_body(body.to_string().as_bytes()).await?;
    }
    rig.wait_registered(2).await?;
    let (admin, records) = (rig.admin(), rig.records());
    let mut promises = Promises::new(turnstile_ops::overdue::OVERDUE_AFTER);
    let now = turnstile_core::domain::unix_ms();
    assert_eq!(
        promises.check(&admin, &records, now).await?,
        (0, 0),
        "promised now"
    );
    let margin = turnstile_ops::overdue::OVERDUE_AFTER.as_millis() as u64;
    let stalled_after = turnstile_upload::progress::STALLED_AFTER.as_millis() as u64;
    assert_eq!(
        promises.check(&admin, &records, now + margin / 2).await?,
        (0, 0),
        "its ETA (a moment) is past, by less than the margin; still for less than the bound"
    );
    assert_eq!(
        promises
            .check(&admin, &records, now + 2 * margin.max(stalled_after))
            .await?,
        (1, 1),
        "b-late only: b-done is done; b-late's two missing rows never come"
    );
    let report = turnstile_upload::progress::read_seller_at(
        &admin,
        &records,
        &turnstile_core::domain::SellerId::parse("S-overdue").unwrap(),
        now + 2 * stalled_after,
    )
    .await?;
    let late = report
        .batches
        .iter()
        .find(|b| b.batch_id == "b-late")
        .unwrap();
    let why = &late.stalled.as_ref().expect("b-late is stalled").why;
    assert!(why.starts_with("2 of 3 rows not counted"), "{why}");
    rig.stop_replicas().await?;
    rig.cleanup().await
}
