//! What operators see: the live dashboard (rendered by headless Chromium), `/metrics`,
//! `/api/dashboard` before Redis is there, and JSON log lines.
mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use turnstile_core::broker::long_string;
use turnstile_core::config::Limits;
use turnstile_core::domain::{BatchId, SellerId};
use turnstile_core::trace::{TRACEPARENT, TraceContext};
use turnstile_lab::rig::Rig;
use turnstile_ops::http::Listen;
use turnstile_ops::serve::{HttpArgs, ServeArgs, Served};

/// Endpoints served at `addr`, without a token.
fn serving_at(addr: &str) -> HttpArgs {
    HttpArgs {
        http_addr: Listen::At(addr.parse().unwrap()),
        http_token: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_each_seller_and_its_upload_progress_while_a_workload_runs()
-> anyhow::Result<()> {
    let chromium = Chromium::find();
    let mut rig = support::rig("dash", "3/1s").prepare().await?;
    let store = rig.store();
    for _ in 0..2 {
        let consume = rig.settings(4);
        let http = serving_at("127.0.0.1:0");
        rig.start_replica(ServeArgs { consume, http }).await?;
    }
    let http = rig.replicas().next().unwrap().http_addr.unwrap();
    let (page, api) = (
        format!("http://{http}/"),
        format!("http://{http}/api/dashboard"),
    );

    // Four uploads: a big one, a small one of a seller with a stack of limits, one with a
    // product the API rejects, and one of a seller paused for ten minutes (nothing of it is
    // published, so it only waits).
    store
        .admin()
        .set_limit(&seller("S-small"), "3/1s,8/1m".parse::<Limits>().unwrap())
        .await?;
    upload(&mut rig, "S-big", "spring", 30, 0).await?;
    upload(&mut rig, "S-small", "summer", 6, 0).await?;
    upload(&mut rig, "S-bad", "autumn", 1, 1).await?;
    // As a replica notes a batch when it first sees one of its messages.
    store
        .records()
        .batch_seen(
            &seller("S-paused"),
            &batch("winter"),
            turnstile_core::domain::BatchSize::new(3),
            Duration::from_secs(600),
        )
        .await
        .unwrap();
    store
        .pause(&seller("S-paused"), Duration::from_secs(600))
        .await
        .unwrap();

    // While it runs: the page lists every seller and upload.
    wait_for_api(&api, "the big upload under way", |d| {
        upload_of(d, "S-big")["registered"].as_u64() > Some(0)
    })
    .await;
    let artifacts = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    chromium
        .screenshot(&page, &artifacts.join("dashboard.png"))
        .await;
    let dom = chromium.dump_dom(&page).await;
    std::fs::write(artifacts.join("dashboard-running.html"), &dom).unwrap();
    assert!(
        dom.contains("data-updated="),
        "the page never rendered data from /api/dashboard:\n{dom}"
    );
    for (seller, total) in [("S-big", 30), ("S-small", 6), ("S-bad", 2), ("S-paused", 3)] {
        let row = row(&dom, "upload", seller);
        let registered = cell(&row, "registered");
        let (done, of) = registered.split_once(" / ").expect("registered / total");
        assert_eq!(of, total.to_string(), "{seller}'s upload total: {row}");
        assert!(done.parse::<u64>().unwrap() <= total, "{row}");
        row_of(&dom, "seller", seller).expect("a window row for each seller of the workload");
    }
    assert!(
        item(&dom, "paused", "S-paused").is_some(),
        "the paused seller is listed as paused"
    );

    // After it ran: the numbers are what registered.
    let stats = rig.wait_registered(30 + 6 + 1).await?;
    assert_eq!(stats.violations, 0, "{stats:?}");
    wait_for_api(&api, "every registration counted", |d| {
        d["throughput"]["total"] == 37
            && upload_of(d, "S-bad")["dead"] == 1
            && upload_of(d, "S-big")["registered"] == 30
            && upload_of(d, "S-small")["registered"] == 6
    })
    .await;
    // Once its last second has passed, the stacked seller's minute limit binds: 6 of 8 units.
    wait_for_api(&api, "the stacked seller's minute limit binding", |d| {
        seller_of(d, "S-small").is_some_and(|s| {
            s["limit"] == "3/1s,8/1m"
                && s["binding"] == "8/1m"
                && s["limits"][1] == json!({"limit": "8/1m", "used": 6, "capacity": 8, "ahead": 0})
        })
    })
    .await;
    let dom = chromium.dump_dom(&page).await;
    std::fs::write(artifacts.join("dashboard-done.html"), &dom).unwrap();
    let stacked = row(&dom, "seller", "S-small");
    assert!(
        stacked.contains("3/1s,8/1m") && stacked.contains("binds: 8/1m"),
        "the stack and the limit that binds: {stacked}"
    );
    let registered = |seller: &str| stats.sellers[seller].registered;
    let big = row(&dom, "upload", "S-big");
    assert_eq!(registered("S-big"), 30);
    assert_eq!(cell(&big, "registered"), "30 / 30", "{big}");
    assert_eq!(cell(&big, "eta"), "done", "{big}");
    let small = row(&dom, "upload", "S-small");
    assert_eq!(registered("S-small"), 6);
    assert_eq!(cell(&small, "registered"), "6 / 6", "{small}");
    let bad = row(&dom, "upload", "S-bad");
    assert_eq!(registered("S-bad"), 1);
    assert_eq!(cell(&bad, "registered"), "1 / 2", "{bad}");
    assert_eq!(cell(&bad, "dead"), "1", "{bad}");
    assert_eq!(cell(&bad, "eta"), "done", "{bad}");
    let paused = row(&dom, "upload", "S-paused");
    assert_eq!(cell(&paused, "registered"), "0 / 3", "{paused}");
    assert!(
        cell(&paused, "eta").starts_with('~') && cell(&paused, "eta").contains('m'),
        "a paused upload finishes after its pause (minutes): {paused}"
    );
    let rejected = item(&dom, "dead-letters", "rejected").expect("dead letters by reason");
    assert!(rejected.contains(">1<"), "one rejected: {rejected}");
    assert_eq!(text_of(&dom, "throughput-total"), "37");
    rig.cleanup().await
}

#[tokio::test]
async fn metrics_count_permits_outcomes_and_downstream_answers_without_a_label_per_seller()
-> anyhow::Result<()> {
    let mut rig = support::rig("metrics", "2/1s").prepare().await?;
    let consume = rig.settings(2);
    let http = serving_at("127.0.0.1:0");
    rig.start_replica(ServeArgs { consume, http }).await?;
    let http = rig.replicas().next().unwrap().http_addr.unwrap();
    rig.publish("S-metrics-seller", 5).await?;
    rig.publish_product(
        "S-metrics-rejected",
        "m-rejected",
        json!({"mock": {"statuses": [400]}}),
    )
    .await?;
    rig.wait_registered(5).await?;
    rig.dead_letters(1).await?;

    let url = format!("http://{http}/metrics");
    let mut body = String::new();
    let wanted = [
        r#"turnstile_permits_granted_total{algorithm="sliding-window"}"#,
        r#"turnstile_permits_near_limit_total{algorithm="sliding-window"}"#,
        r#"turnstile_permits_over_limit_total{algorithm="sliding-window"}"#,
        r#"turnstile_permits_denied_total{algorithm="sliding-window"}"#,
        r#"turnstile_outcomes_total{outcome="registered"}"#,
        r#"turnstile_outcomes_total{outcome="dead_lettered"}"#,
        r#"turnstile_dead_letters_total{reason="rejected"}"#,
        r#"turnstile_downstream_requests_total{class="2xx"}"#,
        r#"turnstile_downstream_requests_total{class="4xx"}"#,
        r#"turnstile_downstream_request_duration_seconds_count{class="2xx"}"#,
        r#"turnstile_queue_messages{queue="dead"}"#,
        "turnstile_deliveries_total",
        "turnstile_in_flight",
        "turnstile_held_messages",
        "turnstile_delay_held_messages",
        "turnstile_ready",
        r#"turnstile_queue_messages{queue="ready"}"#,
    ];
    // At least: five grants, registrations and 2xx answers; one 4xx answer and dead letter.
    let least = [
        (wanted[0], 5.0),
        (wanted[4], 5.0),
        (wanted[7], 5.0),
        (wanted[8], 1.0),
        (wanted[6], 1.0),
    ];
    let counted = |body: &str| {
        least
            .iter()
            .all(|&(m, n)| value(body, m).is_some_and(|v| v >= n))
    };
    support::eventually_async("every event counted", async || {
        body = reqwest::get(&url).await.unwrap().text().await.unwrap();
        wanted.iter().all(|m| value(&body, m).is_some()) && counted(&body)
    })
    .await;
    for metric in wanted {
        assert!(value(&body, metric).is_some(), "{metric} missing:\n{body}");
    }
    assert!(counted(&body), "{least:?}:\n{body}");
    assert!(
        !body.contains("S-metrics"),
        "no label carries a seller id:\n{body}"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn before_redis_answers_the_dashboard_data_is_503_and_the_replica_is_not_ready()
-> anyhow::Result<()> {
    let rig = support::rig("unready", "10/1s").prepare().await?;
    let mut settings = rig.settings(1);
    settings.redis.url = "redis://127.0.0.1:1/".into(); // nothing listens there
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let settings = ServeArgs {
        consume: settings,
        http: serving_at(&format!("127.0.0.1:{port}")),
    };
    let shutdown = CancellationToken::new();
    let starting = tokio::spawn(Served::start(settings, shutdown.clone()));
    let base = format!("http://127.0.0.1:{port}");
    let mut answered = None;
    support::eventually_async("the HTTP endpoints serve", async || {
        answered = reqwest::get(format!("{base}/api/dashboard")).await.ok();
        answered.is_some()
    })
    .await;
    let answer = answered.unwrap();
    assert_eq!(answer.status(), 503);
    let error: Value = answer.json().await.unwrap();
    assert_eq!(error["error"], "not connected to Redis yet");
    let page = reqwest::get(format!("{base}/")).await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("/api/dashboard"));
    assert_eq!(
        reqwest::get(format!("{base}/readyz"))
            .await
            .unwrap()
            .status(),
        503
    );
    assert_eq!(
        reqwest::get(format!("{base}/healthz"))
            .await
            .unwrap()
            .status(),
        200
    );
    shutdown.cancel();
    starting.await.unwrap().unwrap().wait().await.unwrap();
    rig.cleanup().await
}

#[tokio::test]
async fn a_json_log_line_of_a_message_carries_its_seller_message_id_attempt_and_trace()
-> anyhow::Result<()> {
    // This runtime runs every task on this thread, so a thread-local subscriber sees them all.
    let lines = Lines::default();
    let _logging = tracing::subscriber::set_default(turnstile_core::telemetry::subscriber(
        tracing_subscriber::EnvFilter::new("turnstile=debug"),
        turnstile_core::telemetry::Format::Json,
        lines.clone(),
    ));
    let mut rig = support::rig("logs", "100/1s").prepare().await?;
    rig.start_replicas(1, 1).await?;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let body = json!({
        "message_id": "m-log",
        "seller_id": "S-log",
        "batch_id": "b-log",
        "product": {"mock": {"statuses": [503, 200]}},
    });
    let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
    rig.publish_with_headers(
        body.to_string().as_bytes(),
        &[(TRACEPARENT, long_string(&traceparent))],
    )
    .await?;
    rig.wait_settled_registered(1).await?;
    rig.stop_replicas().await?;
    // The span of each call, as the downstream received it.
    let called: BTreeSet<String> = rig
        .mock
        .recent_requests()
        .iter()
        .filter(|r| r.header("idempotency-key") == Some("m-log"))
        .map(|r| {
            let call = TraceContext::parse(r.header(TRACEPARENT).unwrap().as_bytes(), None);
            let call = call.expect("a valid traceparent");
            assert_eq!(call.trace_id().to_string(), trace, "the message's trace");
            call.span_id().to_string()
        })
        .collect();
    assert_eq!(called.len(), 2, "a 503, then a 2xx");
    let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    let of_message: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("every line is JSON"))
        .filter(|l| l["message_id"] == "m-log")
        .collect();
    let retried = of_message
        .iter()
        .find(|l| l["message"] == "downstream failed; retrying later")
        .unwrap_or_else(|| panic!("the retry is logged in the message's span:\n{text}"));
    // Flat, as log pipelines index them: the span's fields beside the event's own.
    assert_eq!(retried["seller_id"], "S-log");
    assert_eq!(retried["batch_id"], "b-log");
    assert_eq!(retried["attempt"], 0, "the first delivery");
    assert_eq!(retried["failed_attempts"], 1, "{retried}");
    assert!(retried.get("span").is_none(), "{retried}");
    assert!(
        of_message.iter().any(|l| l["attempt"] == 1),
        "the redelivery's lines carry attempt 1:\n{text}"
    );
    // Every line carries the message's trace, and the lines name each call's span.
    for line in &of_message {
        assert_eq!(line["trace_id"], trace, "{line}");
        assert_eq!(line["seller_id"], "S-log", "{line}");
    }
    let logged: BTreeSet<String> = of_message
        .iter()
        .filter_map(|l| l["span_id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(logged, called, "the logs name each call's span:\n{text}");
    rig.cleanup().await
}

// ---------------------------------------------------------------------------------------------

fn seller(s: &str) -> SellerId {
    SellerId::parse(s).unwrap()
}

fn batch(b: &str) -> BatchId {
    BatchId::parse(b).unwrap()
}

/// Publishes an upload of `ok` products and `rejected` ones (answered 400), each message
/// carrying the batch's size as `turnstile publish` does.
async fn upload(
    rig: &mut Rig,
    seller_id: &str,
    batch_id: &str,
    ok: usize,
    rejected: usize,
) -> anyhow::Result<()> {
    for i in 0..ok + rejected {
        let product = if i < ok {
            json!({"sku": i})
        } else {
            json!({"sku": i, "mock": {"statuses": [400]}})
        };
        let body = json!({"message_id": format!("{seller_id}-{batch_id}-{i}"), "seller_id": seller_id,
            "batch_id": batch_id, "batch_size": ok + rejected, "product": product});
        rig.publish_body(body.to_string().as_bytes()).await?;
    }
    Ok(())
}

fn upload_of<'a>(dashboard: &'a Value, seller: &str) -> &'a Value {
    dashboard["uploads"]
        .as_array()
        .and_then(|u| u.iter().find(|u| u["seller"] == seller))
        .unwrap_or(&Value::Null)
}

fn seller_of<'a>(dashboard: &'a Value, seller: &str) -> Option<&'a Value> {
    dashboard["sellers"]
        .as_array()
        .and_then(|rows| rows.iter().find(|row| row["seller"] == seller))
}

/// Polls `/api/dashboard` until `done` holds for its answer.
async fn wait_for_api(api: &str, what: &str, done: impl Fn(&Value) -> bool) {
    support::eventually_async(what, async || match reqwest::get(api).await {
        Ok(r) if r.status().is_success() => done(&r.json().await.unwrap()),
        _ => false,
    })
    .await;
}

/// A metric's value in a Prometheus text page (`name{labels}` exactly as rendered).
fn value(page: &str, metric: &str) -> Option<f64> {
    page.lines().find_map(|l| {
        l.strip_prefix(metric)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The DOM of a `<tr class="<class>" data-seller="<seller>" …>…</tr>` row, if rendered.
fn row_of(dom: &str, class: &str, seller: &str) -> Option<String> {
    let start = dom.find(&format!(r#"<tr class="{class}" data-seller="{seller}""#))?;
    let end = dom[start..].find("</tr>")? + start;
    Some(dom[start..end].to_owned())
}

fn row(dom: &str, class: &str, seller: &str) -> String {
    row_of(dom, class, seller).unwrap_or_else(|| panic!("no {class} row for {seller}:\n{dom}"))
}

/// The text of the cell `<td class="… <class>">text</td>` of a row.
fn cell(row: &str, class: &str) -> String {
    let marker = format!(r#" {class}">"#);
    let start = row
        .find(&marker)
        .unwrap_or_else(|| panic!("no {class} cell in {row}"))
        + marker.len();
    row[start..][..row[start..].find("</td>").unwrap()].to_owned()
}

/// The `<li data-…="<key>">…</li>` of the list with id `list`.
fn item(dom: &str, list: &str, key: &str) -> Option<String> {
    let list = &dom[dom.find(&format!(r#"id="{list}""#))?..];
    let list = &list[..list.find("</ul>")?];
    let start = list.find(&format!(r#"="{key}">"#))?;
    Some(list[start..][..list[start..].find("</li>")?].to_owned())
}

/// The text of the element with id `id` (no markup inside).
fn text_of(dom: &str, id: &str) -> String {
    let marker = format!(r#"id="{id}">"#);
    let start = dom.find(&marker).unwrap_or_else(|| panic!("no #{id}")) + marker.len();
    dom[start..][..dom[start..].find('<').unwrap()].to_owned()
}

/// Headless Chromium (Debian's `chromium`, or `$CHROMIUM`).
struct Chromium {
    binary: PathBuf,
}

impl Chromium {
    /// Finds it, or fails the test saying how to install it.
    fn find() -> Self {
        let binary = std::env::var_os("CHROMIUM")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::split_paths(&std::env::var_os("PATH")?)
                    .map(|dir| dir.join("chromium"))
                    .find(|path| path.is_file())
            })
            .unwrap_or_else(|| {
                panic!(
                    "this test needs headless Chromium: `apt-get install -y chromium` \
                     (or set CHROMIUM=/path/to/chromium); .ci/run installs it"
                )
            });
        Self { binary }
    }

    /// Runs Chromium on `url` with a fresh profile until the page's timers have run for 5 s of
    /// virtual time (so its first refreshes happened); returns stdout.
    async fn run(&self, url: &str, action: &[String]) -> String {
        let profile = std::env::temp_dir().join(support::unique("chromium"));
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-extensions",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--window-size=1280,1000",
                "--virtual-time-budget=5000",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(action)
            .arg(url)
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(120), command.output())
            .await
            .expect("chromium finishes (guard time)")
            .expect("chromium runs");
        let _ = std::fs::remove_dir_all(&profile);
        assert!(
            out.status.success(),
            "chromium failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The DOM after the page's scripts ran.
    async fn dump_dom(&self, url: &str) -> String {
        self.run(url, &["--dump-dom".into()]).await
    }

    /// A PNG of the page as rendered.
    async fn screenshot(&self, url: &str, path: &Path) {
        let _ = std::fs::remove_file(path);
        self.run(url, &[format!("--screenshot={}", path.display())])
            .await;
        assert!(path.is_file(), "chromium wrote no screenshot at {path:?}");
    }
}

/// A log writer into a shared buffer.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Lines {
    type Writer = Lines;
    fn make_writer(&'w self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test]
async fn with_an_http_token_the_dashboard_needs_it_and_probes_stay_open() -> anyhow::Result<()> {
    let mut rig = support::rig("http-token", "10/1s").prepare().await?;
    let consume = rig.settings(1);
    let http = HttpArgs {
        http_token: Some("dash-secret".into()),
        ..serving_at("127.0.0.1:0")
    };
    rig.start_replica(ServeArgs { consume, http }).await?;
    let base = format!(
        "http://{}",
        rig.replicas().next().unwrap().http_addr.unwrap()
    );
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let status = |path: &str, auth: Option<(&str, &str)>| {
        let mut request = client.get(format!("{base}{path}"));
        if let Some((name, value)) = auth {
            request = request.header(name, value);
        }
        async move { request.send().await.unwrap() }
    };
    for path in ["/", "/api/dashboard"] {
        assert_eq!(
            status(path, None).await.status(),
            401,
            "{path} without a token"
        );
        let wrong = status(path, Some(("Authorization", "Bearer nope"))).await;
        assert_eq!(wrong.status(), 401, "{path} with a wrong token");
        let bearer = status(path, Some(("Authorization", "Bearer dash-secret"))).await;
        assert_eq!(bearer.status(), 200, "{path} with the bearer token");
    }
    let opened = status("/?token=dash-secret", None).await;
    assert_eq!(opened.status(), 200);
    let cookie = opened.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    let pair = cookie.split(';').next().unwrap().to_owned();
    let with_cookie = status("/api/dashboard", Some(("Cookie", &pair))).await;
    assert_eq!(with_cookie.status(), 200);
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(status(path, None).await.status(), 200, "{path} stays open");
    }
    let metrics = status("/metrics", None).await.text().await.unwrap();
    assert!(!metrics.contains("dash-secret"));
    rig.cleanup().await
}
