//! The Python upload-service example (`examples/python/upload_service.py`) against one real
//! `turnstile consume` and the strict mock API: every row's result comes back to its `reply_to`
//! queue carrying the API's answer, and the batch's `batch.completed` event and
//! `GET /api/batches/{id}` count the same outcomes.
//!
//! Needs Python 3 with pika (`scripts/test.sh` installs Debian's python3-pika); without them
//! the test fails, it does not skip.
mod support;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};

use serde_json::{Value, json};
use support::run;
use turnstile_lab::rig::Rig;

const SELLER: &str = "S-py";
const ROWS: usize = 12;
const TOKEN: &str = "python-example-token";

/// What the mock is scripted to answer a row with, and so the row's result.
#[derive(Clone, Copy)]
enum Expect {
    /// 200 at once.
    Registered,
    /// 503, then 200: registered on the second attempt.
    RegisteredOnRetry,
    /// This 4xx: dead-lettered at once.
    Rejected(u16),
    /// 503 every time: dead-lettered after TURNSTILE_MAX_ATTEMPTS (2).
    Exhausted,
}

fn expected(row: usize) -> Expect {
    match row {
        3 => Expect::Rejected(422),
        5 => Expect::RegisteredOnRetry,
        8 => Expect::Rejected(409),
        10 => Expect::Exhausted,
        _ => Expect::Registered,
    }
}

/// The products file (JSONL) the example publishes: row `i` is line `i`.
fn products_file() -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}.jsonl", support::unique("python-products")));
    let lines: Vec<String> = (1..=ROWS)
        .map(|row| {
            let mut product =
                json!({ "sku": format!("PY-{row:03}"), "title": format!("Product {row}") });
            let statuses = match expected(row) {
                Expect::Registered => None,
                Expect::RegisteredOnRetry => Some(json!([503, 200])),
                Expect::Rejected(status) => Some(json!([status])),
                Expect::Exhausted => Some(json!([503])),
            };
            if let Some(statuses) = statuses {
                product["mock"] = json!({ "statuses": statuses });
            }
            product.to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").expect("the products file is written");
    path
}

/// A Python 3 that imports pika: `$PYTHON`, else `python3` on the PATH, else Debian's
/// `/usr/bin/python3` (where python3-pika installs, whatever python3 comes first on the PATH).
fn python_with_pika() -> String {
    let candidates: Vec<String> = match std::env::var("PYTHON") {
        Ok(python) => vec![python],
        Err(_) => vec!["python3".into(), "/usr/bin/python3".into()],
    };
    for python in &candidates {
        let imports = Command::new(python)
            .args(["-c", "import pika"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if imports {
            return python.clone();
        }
    }
    panic!(
        "the Python example needs Python 3 with pika, and none of {candidates:?} imports it: \
         scripts/test.sh installs it (Debian's python3-pika), or set PYTHON to a python3 that has pika"
    );
}

/// `turnstile consume`, killed when dropped (a failed test must not leave it running).
struct Replica(Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts one replica for `rig` serving HTTP (behind [`TOKEN`]) on `port`, failing fast on 503s
/// (up to 2 attempts, 100 ms apart), and waits until it is ready.
async fn start_replica(rig: &Rig, port: u16) -> Replica {
    let mut replica = Replica(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .arg("consume")
            .env("TURNSTILE_AMQP_URL", support::broker::amqp_url())
            .env("TURNSTILE_QUEUE", rig.topology.work())
            .env("TURNSTILE_KEY_PREFIX", &rig.key_prefix)
            .env("TURNSTILE_REDIS_URL", support::redis_url())
            .env("TURNSTILE_DOWNSTREAM_URL", rig.mock.url())
            .env("TURNSTILE_LIMIT", rig.limit.to_string())
            .env("TURNSTILE_WORKERS", "4")
            .env("TURNSTILE_MAX_ATTEMPTS", "2")
            .env("TURNSTILE_RETRY_MIN", "100ms")
            .env("TURNSTILE_RETRY_MAX", "200ms")
            .env("TURNSTILE_HTTP_ADDR", format!("127.0.0.1:{port}"))
            .env("TURNSTILE_HTTP_TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("turnstile consume starts"),
    );
    let ready = format!("http://127.0.0.1:{port}/readyz");
    let mut exited = None;
    support::eventually_async("the replica is ready", async || {
        exited = replica.0.try_wait().unwrap();
        if exited.is_some() {
            return true;
        }
        reqwest::get(&ready)
            .await
            .is_ok_and(|answer| answer.status() == 200)
    })
    .await;
    assert_eq!(exited, None, "turnstile consume exited before it was ready");
    replica
}

#[tokio::test]
async fn the_python_upload_service_gets_every_rows_result_and_the_batch_completion()
-> anyhow::Result<()> {
    let python = python_with_pika();
    let rig = support::rig("python", "5/1s").prepare().await?;
    let port = support::free_port();
    let replica = start_replica(&rig, port).await;
    let products = products_file();
    let batch = support::unique("batch");

    let script = format!(
        "{}/examples/python/upload_service.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut cmd = Command::new(&python);
    cmd.arg(&script)
        .args(["--amqp-url", &support::broker::amqp_url()])
        .args(["--queue", rig.topology.work()])
        .args(["--seller", SELLER, "--batch", &batch])
        .arg("--file")
        .arg(&products)
        .args(["--api", &format!("http://127.0.0.1:{port}")])
        .args(["--api-token", TOKEN])
        .args(["--timeout", "120"]); // a guard against hanging, not a speed check
    let (code, out, err) = tokio::task::spawn_blocking(move || run(&mut cmd)).await?;
    let _ = std::fs::remove_file(&products);
    assert_eq!(code, 0, "the example failed:\n{out}\n{err}");
    let summary = out
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find_map(|line| line.get("summary").cloned())
        .unwrap_or_else(|| panic!("no summary line:\n{out}\n{err}"));
    let context = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(summary["complete"], true, "{context}");

    // One result per row (the example keeps one per message_id), in row order.
    let results = summary["results"].as_array().unwrap();
    let rows: Vec<u64> = results.iter().map(|r| r["row"].as_u64().unwrap()).collect();
    assert_eq!(rows, (1..=ROWS as u64).collect::<Vec<_>>(), "{context}");

    let mut registered = 0;
    let mut dead = BTreeMap::<String, u64>::new();
    for (result, row) in results.iter().zip(1..) {
        let message_id = format!("{SELLER}:{batch}:{row}");
        let why = format!("row {row}: {result}");
        assert_eq!(result["message_id"], message_id, "{why}");
        assert_eq!(result["seller_id"], SELLER, "{why}");
        assert_eq!(result["batch_id"], batch.as_str(), "{why}");
        assert_eq!(result["response_truncated"], false, "{why}");
        assert!(result["first_seen"].is_string(), "{why}");
        assert!(result["finished"].is_string(), "{why}");
        let outcome = result["outcome"].as_str().unwrap();
        let (outcome_wanted, status, response, attempts) = match expected(row) {
            // The mock's own answer: the registration's id is its Idempotency-Key.
            Expect::Registered => (
                "registered",
                200,
                json!({"registered": true, "id": message_id}),
                1,
            ),
            Expect::RegisteredOnRetry => (
                "registered",
                200,
                json!({"registered": true, "id": message_id}),
                2,
            ),
            Expect::Rejected(status) => (
                "rejected",
                status,
                json!({"error": format!("scripted {status}")}),
                1,
            ),
            Expect::Exhausted => (
                "attempts-exhausted",
                503,
                json!({"error": "scripted 503"}),
                2,
            ),
        };
        assert_eq!(outcome, outcome_wanted, "{why}");
        assert_eq!(result["status"], status, "{why}");
        assert_eq!(result["response"], response, "{why}");
        assert_eq!(result["attempts"], attempts, "{why}");
        if outcome == "registered" {
            registered += 1;
            assert_eq!(result["detail"], Value::Null, "{why}");
        } else {
            *dead.entry(outcome.to_owned()).or_default() += 1;
        }
    }
    assert_eq!(registered, 9);
    assert_eq!(
        dead,
        BTreeMap::from([("attempts-exhausted".into(), 1), ("rejected".into(), 2)])
    );

    // The completion event, and the replica's API once it came, count the same outcomes.
    let completed = &summary["completed"];
    assert_eq!(completed["batch_id"], batch.as_str(), "{completed}");
    assert_eq!(completed["seller_id"], SELLER, "{completed}");
    assert_eq!(completed["total"], ROWS, "{completed}");
    assert_eq!(completed["registered"], registered, "{completed}");
    assert_eq!(
        support::dead_counts(&completed["dead"]),
        dead,
        "{completed}"
    );
    assert!(completed["started"].is_string(), "{completed}");
    assert!(completed["finished"].is_string(), "{completed}");
    let api = &summary["api"];
    assert_eq!(api["batch_id"], batch.as_str(), "{api}");
    assert_eq!(api["seller_id"], SELLER, "{api}");
    assert_eq!(api["total"], ROWS, "{api}");
    assert_eq!(api["registered"], registered, "{api}");
    assert_eq!(support::dead_counts(&api["dead"]), dead, "{api}");
    assert_eq!(api["waiting"], 0, "{api}");
    assert_eq!(api["done"], true, "{api}");

    // What the mock saw agrees: each registered row registered once.
    let stats = rig.mock.stats();
    assert_eq!(
        (stats.registered, stats.duplicates),
        (registered, 0),
        "{stats:?}"
    );
    drop(replica);
    rig.cleanup().await
}
