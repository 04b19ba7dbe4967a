//! What operators see: the live dashboard (rendered by headless Chromium), `/metrics`,
//! `/api/dashboard` before Redis is there, and JSON log lines.
mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use turnstile_core::config::Limits;
use turnstile_core::domain::{BatchId, SellerId};
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

    // Without a token, dead letters are not read (a listing counts toward their delivery
    // limit and shows their bodies).
    let dead = reqwest::get(format!("http://{http}/api/dead-letters")).await?;
    assert_eq!(dead.status(), reqwest::StatusCode::FORBIDDEN);
    assert!(dead.text().await?.contains("TURNSTILE_HTTP_TOKEN"));

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
    chromium
        .screenshot_sized(&page, &screens().join("dashboard-running.png"), "1400,2000")
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
    /// virtual time (so its first refreshes happened), in a window of `window` (`W,H`); returns
    /// stdout.
    async fn run(&self, url: &str, window: &str, action: &[String]) -> String {
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
                "--virtual-time-budget=5000",
            ])
            .arg(format!("--window-size={window}"))
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
        self.run(url, "1280,1000", &["--dump-dom".into()]).await
    }

    /// A PNG of the page as rendered.
    async fn screenshot(&self, url: &str, path: &Path) {
        self.screenshot_sized(url, path, "1280,1000").await;
    }

    /// A PNG of the page as rendered in a window of `window` (`W,H`, e.g. `1400,2000` for the
    /// whole page).
    async fn screenshot_sized(&self, url: &str, path: &Path, window: &str) {
        let _ = std::fs::remove_file(path);
        self.run(url, window, &[format!("--screenshot={}", path.display())])
            .await;
        assert!(path.is_file(), "chromium wrote no screenshot at {path:?}");
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
    // Without the token, a browser gets a form, and the API a JSON error.
    let page = status("/", None).await.text().await.unwrap();
    assert!(page.contains(r#"<form method="get" action="/">"#), "{page}");
    let api = status("/api/dashboard", None).await;
    let error: serde_json::Value = api.json().await.unwrap();
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .contains("TURNSTILE_HTTP_TOKEN"),
        "{error}"
    );
    // Opened with the token: the cookie, and on to the page without the token in its address.
    let opened = status("/?token=dash-secret&x=1", None).await;
    assert_eq!(opened.status(), 303);
    assert_eq!(opened.headers()["location"], "/?x=1");
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

// --- the operator's console: actions, dead letters, outages -------------------------------------

/// Where the screenshots go: the folder `TURNSTILE_SCREENSHOTS` names (for a person to look
/// at), else the test artifacts.
fn screens() -> PathBuf {
    let dir = std::env::var_os("TURNSTILE_SCREENSHOTS")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/artifacts"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Endpoints served at a free port with `token`.
fn serving_with_token(token: &str) -> HttpArgs {
    HttpArgs {
        http_token: Some(turnstile_ops::http::parse_token(token).unwrap()),
        ..serving_at("127.0.0.1:0")
    }
}

/// A client of one replica's API, as the page or a script uses it: the token as a bearer
/// token, actions as JSON with the action header.
struct Console {
    base: String,
    token: Option<String>,
    client: reqwest::Client,
}

impl Console {
    fn of(addr: std::net::SocketAddr, token: Option<&str>) -> Self {
        Self {
            base: format!("http://{addr}"),
            token: token.map(str::to_owned),
            client: reqwest::Client::builder()
                .user_agent("turnstile-dashboard-test")
                .build()
                .unwrap(),
        }
    }

    /// A POST of `action` with nothing but `body` (the test adds what it tries).
    fn post(&self, action: &str) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}/api/actions/{action}", self.base))
    }

    /// An action as the page sends it; its status and answer.
    async fn act(&self, action: &str, body: Value) -> (u16, Value) {
        let mut request = self
            .post(action)
            .header(turnstile_ops::actions::ACTION_HEADER, "1")
            .json(&body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        answer(request.send().await.unwrap()).await
    }

    /// A GET of the API; its status and answer.
    async fn get(&self, path: &str) -> (u16, Value) {
        let mut request = self.client.get(format!("{}{path}", self.base));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        answer(request.send().await.unwrap()).await
    }

    /// Polls `/api/dashboard` until `done` holds for its answer.
    async fn wait_for(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let mut last = Value::Null;
        support::eventually_async(what, async || {
            let (status, data) = self.get("/api/dashboard").await;
            let ok = status == 200 && done(&data);
            last = data;
            ok
        })
        .await;
        last
    }

    /// The page's URL, opened with the token (the page then carries it in its cookie).
    fn page(&self, fragment: &str) -> String {
        match &self.token {
            Some(token) => format!("{}/?token={token}{fragment}", self.base),
            None => format!("{}/{fragment}", self.base),
        }
    }
}

async fn answer(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The text of `"error"` in an answer.
fn error_of(answer: &Value) -> String {
    answer["error"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_are_off_without_a_token_and_refused_cross_site_without_it_or_with_bad_input()
-> anyhow::Result<()> {
    let chromium = Chromium::find();
    let mut rig = support::rig("act-guard", "10/1s").prepare().await?;
    let consume = rig.settings(1);
    rig.start_replica(ServeArgs {
        consume,
        http: serving_at("127.0.0.1:0"),
    })
    .await?;
    let consume = rig.settings(1);
    rig.start_replica(ServeArgs {
        consume,
        http: serving_with_token("guard-secret"),
    })
    .await?;
    let addrs: Vec<_> = rig.replicas().map(|r| r.http_addr.unwrap()).collect();
    let (open, guarded) = (
        Console::of(addrs[0], None),
        Console::of(addrs[1], Some("guard-secret")),
    );
    let seller = seller("S-guarded");
    let pause = json!({"seller": seller.as_str(), "for": "10m"});

    // Without TURNSTILE_HTTP_TOKEN: actions are off, and the page says why.
    let (status, said) = open.act("pause", pause.clone()).await;
    assert_eq!(status, 403, "{said}");
    assert!(error_of(&said).contains("TURNSTILE_HTTP_TOKEN"), "{said}");
    let data = open.wait_for("the open replica's data", |_| true).await;
    assert_eq!(data["actions"]["enabled"], false);
    assert!(
        data["actions"]["why_not"]
            .as_str()
            .unwrap()
            .contains("TURNSTILE_HTTP_TOKEN")
    );
    let dom = chromium.dump_dom(&open.page("")).await;
    let note = element(&dom, "actions-note");
    assert!(
        !note.contains(" hidden") && note.contains("TURNSTILE_HTTP_TOKEN"),
        "the page says why it cannot act: {note}"
    );
    let button = tag(&dom, "act-pause");
    assert!(
        button.contains("disabled"),
        "the page's actions are disabled: {button}"
    );

    // With the token: refused without it, from another site, as a form, or without the header.
    let cookie = "turnstile_token=guard-secret";
    let json_body = pause.to_string();
    let tries: Vec<(&str, reqwest::RequestBuilder, u16)> = vec![
        (
            "no token",
            guarded
                .post("pause")
                .header("x-turnstile-action", "1")
                .json(&pause),
            401,
        ),
        (
            "the token in the query only",
            guarded
                .client
                .post(format!(
                    "{}/api/actions/pause?token=guard-secret",
                    guarded.base
                ))
                .header("x-turnstile-action", "1")
                .json(&pause),
            401,
        ),
        (
            "a cross-site request carrying the cookie",
            guarded
                .post("pause")
                .header("cookie", cookie)
                .header("origin", "http://evil.example")
                .header("sec-fetch-site", "cross-site")
                .header("x-turnstile-action", "1")
                .json(&pause),
            403,
        ),
        (
            "a cross-site request with the bearer token",
            guarded
                .post("pause")
                .bearer_auth("guard-secret")
                .header("sec-fetch-site", "cross-site")
                .header("x-turnstile-action", "1")
                .json(&pause),
            403,
        ),
        (
            "another origin",
            guarded
                .post("pause")
                .header("cookie", cookie)
                .header("origin", "http://evil.example")
                .header("x-turnstile-action", "1")
                .json(&pause),
            403,
        ),
        (
            "a form, as a cross-site form posts it",
            guarded
                .post("pause")
                .header("cookie", cookie)
                .header("x-turnstile-action", "1")
                .header("content-type", "application/x-www-form-urlencoded")
                .body("seller=S-guarded&for=10m"),
            415,
        ),
        (
            "text/plain, as a cross-site form posts it",
            guarded
                .post("pause")
                .header("cookie", cookie)
                .header("x-turnstile-action", "1")
                .header("content-type", "text/plain")
                .body(json_body.clone()),
            415,
        ),
        (
            "without the action header",
            guarded
                .post("pause")
                .header("cookie", cookie)
                .header("content-type", "application/json")
                .body(json_body.clone()),
            403,
        ),
    ];
    for (what, request, want) in tries {
        let (status, said) = answer(request.send().await.unwrap()).await;
        assert_eq!(status, want, "{what}: {said}");
    }
    let get = guarded
        .client
        .get(format!("{}/api/actions/pause", guarded.base))
        .bearer_auth("guard-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 405, "an action is a POST");

    // Inputs are checked: a clear 400 each, and nothing done.
    let operator = "ana";
    for (action, body, says) in [
        ("pause", json!({"seller": "", "for": "10m"}), "seller"),
        (
            "pause",
            json!({"seller": "x".repeat(129), "for": "10m"}),
            "too long",
        ),
        (
            "pause",
            json!({"seller": "S-guarded", "for": "2d"}),
            "at most 24h",
        ),
        (
            "pause",
            json!({"seller": "S-guarded", "for": "0s"}),
            "is not a duration",
        ),
        (
            "pause",
            json!({"seller": "S-guarded", "for": "soon"}),
            "for",
        ),
        (
            "set-limit",
            json!({"seller": "S-guarded", "limit": "ten a second"}),
            "limit",
        ),
        (
            "set-limit",
            json!({"seller": "S-guarded", "limit": "0/1s"}),
            "limit",
        ),
        (
            "resume",
            json!({"seller": "S-guarded", "sneaky": 1}),
            "unknown field",
        ),
        ("replay", json!({"seller": "S-guarded"}), "dry_run"),
        ("replay", json!({"dry_run": true}), "choose what to replay"),
        (
            "replay",
            json!({"reason": "rejected", "dry_run": true}),
            "choose what to replay",
        ),
        (
            "replay",
            json!({"seller": "S-guarded", "reason": "bogus", "dry_run": true}),
            "reason",
        ),
        (
            "pause",
            json!({"seller": "S-guarded", "for": "1m", "operator": "a\u{7}b"}),
            "operator",
        ),
    ] {
        let mut body = body;
        if body.get("operator").is_none() {
            body["operator"] = json!(operator);
        }
        let (status, said) = guarded.act(action, body.clone()).await;
        assert_eq!(status, 400, "{action} {body}: {said}");
        assert!(error_of(&said).contains(says), "{action} {body}: {said}");
    }
    let admin = rig.admin();
    assert_eq!(
        admin.paused_for(&seller).await?,
        Duration::ZERO,
        "nothing paused"
    );
    assert_eq!(admin.limit_override(&seller).await?, None, "no limit set");

    // The refusals for bad input are in the recent actions (every replica shows them); those
    // refused before their input was read are logged only.
    let data = guarded
        .wait_for("the refused actions listed", |d| {
            d["recent_actions"]
                .as_array()
                .is_some_and(|a| a.len() >= 11)
        })
        .await;
    let actions = data["recent_actions"].as_array().unwrap();
    assert!(
        actions.iter().all(|a| a["outcome"] == "refused"),
        "{actions:?}"
    );
    assert!(
        actions
            .iter()
            .filter(|a| a["result"].as_str().unwrap().contains("at most 24h"))
            .all(|a| a["operator"] == operator
                && a["remote"].as_str().unwrap().starts_with("127.0.0.1")),
        "{actions:?}"
    );
    assert_eq!(
        open.wait_for("the other replica lists them too", |d| {
            d["recent_actions"]
                .as_array()
                .is_some_and(|a| a.len() == actions.len())
        })
        .await["actions"]["enabled"],
        false
    );
    rig.cleanup().await
}

#[tokio::test]
async fn pause_resume_and_a_seller_limit_through_the_api_are_done_on_every_replica_and_audited()
-> anyhow::Result<()> {
    // This runtime runs every task on this thread, so a thread-local subscriber sees them all.
    let lines = support::Lines::default();
    let _logging = tracing::subscriber::set_default(turnstile_core::telemetry::subscriber(
        tracing_subscriber::EnvFilter::new("turnstile::audit=info"),
        turnstile_core::telemetry::Format::Json,
        lines.clone(),
    ));
    let mut rig = support::rig("act", "10/1s").prepare().await?;
    let consume = rig.settings(1);
    rig.start_replica(ServeArgs {
        consume,
        http: serving_with_token("act-secret"),
    })
    .await?;
    let api = Console::of(rig.dashboard().unwrap(), Some("act-secret"));
    let seller = seller("S-act {1}");
    let admin = rig.admin();
    let who = |body: Value| {
        let mut body = body;
        body["operator"] = json!("night shift");
        body
    };

    let (status, paused) = api
        .act(
            "pause",
            who(json!({"seller": seller.as_str(), "for": "10m"})),
        )
        .await;
    assert_eq!(status, 200, "{paused}");
    assert!(
        paused["result"]
            .as_str()
            .unwrap()
            .contains("paused for 10m"),
        "{paused}"
    );
    let left = admin.paused_for(&seller).await?;
    assert!(
        left > Duration::from_secs(9 * 60) && left <= Duration::from_secs(600),
        "{left:?}"
    );
    api.wait_for("the paused seller listed", |d| {
        d["paused"]
            .as_array()
            .is_some_and(|p| p.iter().any(|s| s["seller"] == seller.as_str()))
    })
    .await;

    let (status, resumed) = api
        .act("resume", who(json!({"seller": seller.as_str()})))
        .await;
    assert_eq!(status, 200, "{resumed}");
    assert_eq!(resumed["was_paused"], true);
    assert_eq!(admin.paused_for(&seller).await?, Duration::ZERO);

    let (status, set) = api
        .act(
            "set-limit",
            who(json!({"seller": seller.as_str(), "limit": " 5/1s,100/1m "})),
        )
        .await;
    assert_eq!(status, 200, "{set}");
    assert_eq!(set["limit"], "5/1s,100/1m");
    assert_eq!(
        admin.limit_override(&seller).await?,
        Some("5/1s,100/1m".parse::<Limits>().unwrap())
    );
    let usage = admin.usage(&seller).await?;
    assert!(
        usage.overridden && usage.limit.to_string() == "5/1s,100/1m",
        "{usage:?}"
    );

    let (status, cleared) = api
        .act("clear-limit", who(json!({"seller": seller.as_str()})))
        .await;
    assert_eq!(status, 200, "{cleared}");
    assert_eq!(cleared["had_override"], true);
    assert_eq!(admin.limit_override(&seller).await?, None);

    // Every replica's page lists them, newest first, with who asked.
    let data = api
        .wait_for("the four actions listed", |d| {
            d["recent_actions"].as_array().is_some_and(|a| a.len() == 4)
        })
        .await;
    let listed: Vec<&str> = data["recent_actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            assert_eq!(a["outcome"], "done", "{a}");
            assert_eq!(a["seller"], seller.as_str(), "{a}");
            assert_eq!(a["operator"], "night shift", "{a}");
            assert_eq!(a["user_agent"], "turnstile-dashboard-test", "{a}");
            assert!(
                a["remote"].as_str().unwrap().starts_with("127.0.0.1:"),
                "{a}"
            );
            a["action"].as_str().unwrap()
        })
        .collect();
    assert_eq!(listed, ["clear-limit", "set-limit", "resume", "pause"]);

    // And the audit log has each: who, what, the outcome, when.
    let text = lines.text();
    let audited: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("every line is JSON"))
        .filter(|l| l["target"] == "turnstile::audit")
        .collect();
    assert_eq!(audited.len(), 4, "{text}");
    for (line, action) in audited
        .iter()
        .zip(["pause", "resume", "set-limit", "clear-limit"])
    {
        // The fields, flattened into the line or under `fields`.
        let fields = if line["fields"].is_object() {
            &line["fields"]
        } else {
            line
        };
        assert_eq!(fields["action"], action, "{line}");
        assert_eq!(fields["seller"], seller.as_str(), "{line}");
        assert_eq!(fields["outcome"], "done", "{line}");
        assert_eq!(fields["operator"], "night shift", "{line}");
        assert_eq!(fields["dry_run"], false, "{line}");
        assert!(
            fields["remote"].as_str().unwrap().starts_with("127.0.0.1:"),
            "{line}"
        );
        assert!(fields["at"].as_str().unwrap().ends_with('Z'), "{line}");
    }
    assert!(text.contains(r#""argument":"5/1s,100/1m""#), "{text}");
    rig.cleanup().await
}

/// Publishes `n` messages of `seller`'s batch `batch` that the API rejects once (400) and
/// registers when called again: `<batch>-<i>`.
async fn publish_rejected_once(
    rig: &mut Rig,
    seller: &str,
    batch: &str,
    n: usize,
) -> anyhow::Result<()> {
    for i in 0..n {
        let body = json!({"message_id": format!("{batch}-{i}"), "seller_id": seller,
            "batch_id": batch, "batch_size": n,
            "product": {"sku": format!("sku-{batch}-{i}"), "mock": {"statuses": [400, 200]}}});
        rig.publish_body(body.to_string().as_bytes()).await?;
    }
    Ok(())
}

/// The message ids of a listing's letters.
fn ids(letters: &Value) -> BTreeSet<String> {
    letters
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["message_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_browsable_found_and_replayed_exactly_as_selected_after_a_dry_run()
-> anyhow::Result<()> {
    let chromium = Chromium::find();
    let mut rig = support::rig("replay", "50/1s").prepare().await?;
    let consume = rig.settings(2);
    rig.start_replica(ServeArgs {
        consume,
        http: serving_with_token("replay-secret"),
    })
    .await?;
    let api = Console::of(rig.dashboard().unwrap(), Some("replay-secret"));
    publish_rejected_once(&mut rig, "S-dl-a", "a-batch", 3).await?;
    publish_rejected_once(&mut rig, "S-dl-b", "b-batch", 2).await?;
    rig.publish("S-dl-ok", 1).await?;
    rig.wait_registered(1).await?;
    support::eventually_async("five dead letters", async || {
        rig.dead_lettered().await.unwrap() == 5
    })
    .await;

    // Browsable: reason, detail, seller, batch, when, the body's start.
    let (status, all) = api.get("/api/dead-letters").await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(all["matched"], 5, "{all}");
    for letter in all["letters"].as_array().unwrap() {
        assert_eq!(letter["reason"], "rejected", "{letter}");
        assert!(
            letter["detail"].as_str().unwrap().contains("400"),
            "{letter}"
        );
        assert!(letter["dead_at_ms"].as_u64().is_some(), "{letter}");
        let batch = letter["batch_id"].as_str().unwrap();
        assert!(
            letter["body_excerpt"]
                .as_str()
                .unwrap()
                .contains(&format!("sku-{batch}")),
            "{letter}"
        );
    }
    for (query, want) in [
        ("?seller=S-dl-a", 3),
        ("?batch=b-batch", 2),
        ("?message_id=b-batch-1", 1),
        ("?seller=S-dl-a&batch=b-batch", 0),
        ("?reason=throttled", 0),
        ("?reason=rejected&limit=2", 5),
    ] {
        let (status, listed) = api.get(&format!("/api/dead-letters{query}")).await;
        assert_eq!(status, 200, "{query}: {listed}");
        assert_eq!(listed["matched"], want, "{query}: {listed}");
    }
    let (_, two) = api.get("/api/dead-letters?limit=2").await;
    assert_eq!(two["letters"].as_array().unwrap().len(), 2);
    for bad in ["?reason=bogus", "?limit=0", "?colour=red", "?seller=%07"] {
        let (status, said) = api.get(&format!("/api/dead-letters{bad}")).await;
        assert_eq!(status, 400, "{bad}: {said}");
    }

    // Found by seller, batch or message id; what is not found is said.
    let (_, found) = api.get("/api/search?q=S-dl-a").await;
    assert_eq!(found["seller"]["seller_id"], "S-dl-a", "{found}");
    assert_eq!(
        found["seller"]["batches"][0]["batch_id"], "a-batch",
        "{found}"
    );
    let (_, found) = api.get("/api/search?q=b-batch").await;
    assert_eq!(found["batch"]["seller_id"], "S-dl-b", "{found}");
    assert_eq!(found["batch"]["dead"]["rejected"], 2, "{found}");
    let (_, found) = api.get("/api/search?q=b-batch-1").await;
    let message = &found["message"];
    assert_eq!(
        ids(&message["dead_letters"]),
        BTreeSet::from(["b-batch-1".to_owned()])
    );
    assert_eq!(message["records"][0]["seller"], "S-dl-b", "{found}");
    assert_eq!(message["records"][0]["state"], "dead:rejected", "{found}");
    let (_, found) = api.get("/api/search?q=S-dl-ok-0&seller=S-dl-ok").await;
    assert_eq!(
        found["message"]["records"][0]["state"], "registered",
        "{found}"
    );
    let (_, nothing) = api.get("/api/search?q=no-such-thing").await;
    assert!(
        nothing["seller"].is_null() && nothing["batch"].is_null() && nothing["message"].is_null()
    );
    let said = nothing["said"].to_string();
    for says in [
        "no seller",
        "no batch",
        "not among the dead letters",
        "give the seller too",
    ] {
        assert!(said.contains(says), "{says}: {said}");
    }
    for bad in ["?q=%07&kind=seller", "?q=%07", "?q=", "?q=x&kind=planet"] {
        let (status, said) = api.get(&format!("/api/search{bad}")).await;
        assert_eq!(status, 400, "{bad}: {said}");
    }

    // The page, with its dead letters and a message found.
    let page = api.page("#find=b-batch-1");
    let shot = screens().join("dead-letters.png");
    chromium.screenshot_sized(&page, &shot, "1400,2000").await;
    let dom = chromium.dump_dom(&page).await;
    std::fs::write(screens().join("dead-letters.html"), &dom).unwrap();
    let listed = element(&dom, "dead-list");
    assert_eq!(
        listed.matches(r#"<tr class="letter""#).count(),
        5,
        "{listed}"
    );
    assert!(
        listed.contains("sku-a-batch-0") && listed.contains(">rejected<"),
        "{listed}"
    );
    assert!(element(&dom, "dl-status").contains("5 match"));
    let found = element(&dom, "search-results");
    assert!(
        found.contains(r#"class="found message-found" data-message="b-batch-1""#),
        "{found}"
    );
    assert!(found.contains("dead:rejected"), "{found}");

    // A dry run of a seller's moves nothing and says what would move.
    let replay_a = json!({"seller": "S-dl-a", "dry_run": true, "operator": "ana"});
    let (status, would) = api.act("replay", replay_a.clone()).await;
    assert_eq!(status, 200, "{would}");
    assert_eq!(would["moved"], 3, "{would}");
    assert_eq!(
        ids(&would["letters"]),
        BTreeSet::from(["a-batch-0", "a-batch-1", "a-batch-2"].map(String::from))
    );
    assert!(would["result"].as_str().unwrap().contains("nothing moved"));
    assert_eq!(rig.dead_lettered().await?, 5, "a dry run moves nothing");
    assert_eq!(rig.mock.stats().registered, 1);

    // The real one moves exactly those: they register, the others stay dead.
    let (status, moved) = api
        .act(
            "replay",
            json!({"seller": "S-dl-a", "dry_run": false, "operator": "ana"}),
        )
        .await;
    assert_eq!(status, 200, "{moved}");
    assert_eq!(moved["moved"], 3, "{moved}");
    rig.wait_registered(1 + 3).await?;
    let (_, left) = api.get("/api/dead-letters").await;
    assert_eq!(
        ids(&left["letters"]),
        BTreeSet::from(["b-batch-0", "b-batch-1"].map(String::from))
    );

    // One message, a dry run first.
    let one = json!({"message_id": "b-batch-1", "dry_run": true});
    let (_, would) = api.act("replay", one).await;
    assert_eq!(would["moved"], 1, "{would}");
    assert_eq!(rig.dead_lettered().await?, 2);
    // Not without a name for the audit trail.
    let (status, nameless) = api
        .act(
            "replay",
            json!({"message_id": "b-batch-1", "dry_run": false}),
        )
        .await;
    assert_eq!(status, 400, "{nameless}");
    assert!(
        nameless["error"]
            .as_str()
            .unwrap_or_default()
            .contains("needs your name"),
        "{nameless}"
    );
    assert_eq!(rig.dead_lettered().await?, 2, "nothing moved");
    let (_, moved) = api
        .act(
            "replay",
            json!({"message_id": "b-batch-1", "dry_run": false, "operator": "ana"}),
        )
        .await;
    assert_eq!(moved["moved"], 1, "{moved}");
    rig.wait_registered(1 + 3 + 1).await?;
    let (_, left) = api.get("/api/dead-letters").await;
    assert_eq!(
        ids(&left["letters"]),
        BTreeSet::from(["b-batch-0".to_owned()])
    );
    let stats = rig.mock.stats();
    assert_eq!((stats.registered, stats.duplicates), (5, 0), "{stats:?}");

    // The batches count the replayed messages as registered, and the replays are audited.
    let data = api
        .wait_for("the replays counted and listed", |d| {
            upload_of(d, "S-dl-a")["registered"] == 3
                && upload_of(d, "S-dl-b")["registered"] == 1
                && upload_of(d, "S-dl-b")["dead"] == 1
                && d["recent_actions"].as_array().is_some_and(|a| a.len() == 5)
        })
        .await;
    let replays: Vec<(bool, String)> = data["recent_actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["dry_run"].as_bool().unwrap(),
                a["result"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        replays.iter().map(|(dry, _)| *dry).collect::<Vec<_>>(),
        [false, false, true, false, true],
        "{replays:?}"
    );
    assert!(
        replays[1].1.contains("needs your name"),
        "the nameless replay refused: {replays:?}"
    );
    // The page after the replays: one dead letter left, the actions listed.
    let page = api.page("");
    chromium
        .screenshot_sized(&page, &screens().join("after-replays.png"), "1400,2000")
        .await;
    let dom = chromium.dump_dom(&page).await;
    let listed = element(&dom, "dead-list");
    assert_eq!(
        listed.matches(r#"<tr class="letter""#).count(),
        1,
        "{listed}"
    );
    let actions = element(&dom, "recent-actions");
    assert_eq!(
        actions.matches(r#"data-action="replay""#).count(),
        5,
        "{actions}"
    );
    assert!(actions.contains("replay (dry run) done"), "{actions}");
    assert!(actions.contains("ana from 127.0.0.1:"), "{actions}");
    rig.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_grouped_by_reason_and_detail_paged_and_discarded_after_a_dry_run()
-> anyhow::Result<()> {
    let chromium = Chromium::find();
    let mut rig = support::rig("discard", "50/1s").prepare().await?;
    rig.start_replica(ServeArgs {
        consume: rig.settings(2),
        http: serving_with_token("discard-secret"),
    })
    .await?;
    let api = Console::of(rig.dashboard().unwrap(), Some("discard-secret"));
    // Six alike (400 from one seller), two of another answer (422, another seller), one
    // body that is no JSON.
    publish_rejected_once(&mut rig, "S-g-many", "g-many", 6).await?;
    for i in 0..2 {
        let body = json!({"message_id": format!("g-few-{i}"), "seller_id": "S-g-few",
            "batch_id": "g-few", "batch_size": 2,
            "product": {"sku": format!("sku-few-{i}"), "mock": {"statuses": [422]}}});
        rig.publish_body(body.to_string().as_bytes()).await?;
    }
    rig.publish_body(b"not json at all").await?;
    support::eventually_async("nine dead letters", async || {
        rig.dead_lettered().await.unwrap() == 9
    })
    .await;
    // The history counts them in their minute, beside the registrations (none).
    support::eventually_async("the history counts the dead letters", async || {
        let (_, history) = api.get("/api/history?hours=1").await;
        let sum = |rate: &str| -> u64 {
            history["minutes"]
                .as_array()
                .map_or(0, |m| m.iter().map(|x| x[rate].as_u64().unwrap()).sum())
        };
        sum("dead") == 9 && sum("registered") == 0
    })
    .await;
    let (_, history) = api.get("/api/history?hours=2").await;
    assert_eq!(
        history["minutes"].as_array().unwrap().len(),
        120,
        "{history}"
    );
    for bad in ["?hours=0", "?hours=25", "?hours=x"] {
        let (status, said) = api.get(&format!("/api/history{bad}")).await;
        assert_eq!(status, 400, "{bad}: {said}");
    }

    // Grouped by reason and detail, largest first, every letter counted.
    let (status, all) = api.get("/api/dead-letters").await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(all["matched"], 9, "{all}");
    let groups = all["groups"].as_array().unwrap();
    let counts: Vec<(u64, &str, u64)> = groups
        .iter()
        .map(|g| {
            (
                g["count"].as_u64().unwrap(),
                g["reason"].as_str().unwrap(),
                g["sellers"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        counts,
        [
            (6, "rejected", 1),
            (2, "rejected", 1),
            (1, "invalid-message", 0)
        ],
        "{all}"
    );
    assert!(
        groups[0]["detail"].as_str().unwrap().contains("400"),
        "{all}"
    );
    assert_eq!(groups[0]["some_sellers"], json!(["S-g-many"]), "{all}");
    let few_detail = groups[1]["detail"].as_str().unwrap().to_owned();
    assert!(few_detail.contains("422"), "{all}");

    // Paged: three pages of four, each letter on exactly one of them; the groups count all.
    let mut seen = Vec::new();
    for offset in [0, 4, 8] {
        let (status, page) = api
            .get(&format!("/api/dead-letters?offset={offset}&limit=4"))
            .await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(
            (page["matched"].as_u64(), page["offset"].as_u64()),
            (Some(9), Some(offset))
        );
        assert_eq!(page["groups"].as_array().unwrap().len(), 3, "{page}");
        seen.extend(ids(&page["letters"]));
    }
    assert_eq!(seen.len(), 9, "{seen:?}");
    assert_eq!(seen.iter().collect::<BTreeSet<_>>().len(), 9, "{seen:?}");
    // A group selected by its exact detail.
    let query = format!(
        "/api/dead-letters?reason=rejected&detail={}",
        urlencode(&few_detail)
    );
    let (_, few) = api.get(&query).await;
    assert_eq!(
        ids(&few["letters"]),
        BTreeSet::from(["g-few-0", "g-few-1"].map(String::from)),
        "{few}"
    );
    for bad in [
        "?offset=-1",
        "?offset=x",
        &format!("?detail={}", "x".repeat(1100)),
    ] {
        let (status, said) = api.get(&format!("/api/dead-letters{bad}")).await;
        assert_eq!(status, 400, "{bad}: {said}");
    }

    // A discard: the dry run removes nothing; without a name it is refused; then exactly the
    // group chosen goes, and its messages stay counted dead in their upload.
    let group = json!({"batch": "g-few", "reason": "rejected", "detail": few_detail});
    let mut dry = group.clone();
    dry["dry_run"] = true.into();
    let (status, would) = api.act("discard", dry).await;
    assert_eq!(status, 200, "{would}");
    assert_eq!(
        (would["matched"].as_u64(), would["discarded"].as_u64()),
        (Some(2), Some(0))
    );
    assert!(
        would["result"]
            .as_str()
            .unwrap()
            .contains("nothing removed"),
        "{would}"
    );
    assert_eq!(rig.dead_lettered().await?, 9, "a dry run removes nothing");
    let mut nameless = group.clone();
    nameless["dry_run"] = false.into();
    let (status, refused) = api.act("discard", nameless.clone()).await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains("needs your name"),
        "{refused}"
    );
    let (status, everything) = api
        .act(
            "discard",
            json!({"reason": "rejected", "dry_run": false, "operator": "ana"}),
        )
        .await;
    assert_eq!(
        status, 400,
        "a reason alone names no message, seller or batch: {everything}"
    );
    let mut named = nameless;
    named["operator"] = "ana".into();
    let (status, done) = api.act("discard", named).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["discarded"], 2, "{done}");
    support::eventually_async("seven dead letters left", async || {
        rig.dead_lettered().await.unwrap() == 7
    })
    .await;
    let (_, left) = api.get("/api/dead-letters").await;
    assert_eq!(left["matched"], 7, "{left}");
    assert!(!ids(&left["letters"]).contains("g-few-0"), "{left}");
    let data = api
        .wait_for("the discards audited", |d| {
            d["recent_actions"]
                .as_array()
                .is_some_and(|a| a.iter().filter(|a| a["action"] == "discard").count() == 4)
        })
        .await;
    assert_eq!(
        upload_of(&data, "S-g-few")["dead"],
        2,
        "a discarded message stays counted dead: {data}"
    );
    let stats = rig.mock.stats();
    assert_eq!(
        stats.registered, 0,
        "nothing discarded was called: {stats:?}"
    );

    // The page: the groups, the page of letters, the discard beside the replay.
    let page = api.page("");
    chromium
        .screenshot_sized(
            &page,
            &screens().join("dead-letter-groups.png"),
            "1400,2200",
        )
        .await;
    let dom = chromium.dump_dom(&page).await;
    std::fs::write(screens().join("dead-letter-groups.html"), &dom).unwrap();
    let grouped = element(&dom, "dead-groups");
    assert_eq!(
        grouped.matches(r#"<tr class="group""#).count(),
        2,
        "{grouped}"
    );
    assert!(
        grouped.contains(">6<") && grouped.contains(">invalid-message<"),
        "{grouped}"
    );
    assert_eq!(text_of(&dom, "dl-page"), "1–7 of 7");
    assert!(
        text_of(&dom, "history-totals").contains("9 dead-lettered"),
        "{}",
        text_of(&dom, "history-totals")
    );
    assert!(dom.contains(r#"id="dl-discard""#));
    rig.cleanup().await
}

/// `text` percent-encoded for a query string.
fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sellers_messages_held_for_their_slot_are_listed_by_the_replica_holding_them()
-> anyhow::Result<()> {
    let chromium = Chromium::find();
    // Two a minute: of ten messages two are called, eight wait in the delay ladder.
    let mut rig = support::rig("held", "2/1m").prepare().await?;
    rig.start_replica(ServeArgs {
        consume: rig.settings(2),
        http: serving_with_token("held-secret"),
    })
    .await?;
    let api = Console::of(rig.dashboard().unwrap(), Some("held-secret"));
    rig.publish("S-held", 10).await?;
    rig.wait_registered(2).await?;
    let mut found = Value::Null;
    support::eventually_async("the eight held messages are said", async || {
        let (_, answer) = api.get("/api/search?q=S-held&kind=seller").await;
        found = answer;
        found["seller"]["held"]
            .as_array()
            .is_some_and(|h| h.iter().map(|r| r["held"].as_u64().unwrap()).sum::<u64>() == 8)
    })
    .await;
    // The history counts the delays (each message delayed once or more for its slot).
    support::eventually_async("the history counts the delays", async || {
        let (_, history) = api.get("/api/history?hours=1").await;
        history["minutes"].as_array().is_some_and(|m| {
            m.iter()
                .map(|x| x["delayed"].as_u64().unwrap())
                .sum::<u64>()
                >= 8
        })
    })
    .await;
    let held = &found["seller"]["held"][0];
    let replica = held["replica"].as_str().unwrap();
    assert!(!replica.is_empty(), "{found}");
    let soonest = held["soonest"].as_array().unwrap();
    assert_eq!(soonest.len(), 8, "{found}");
    let mut ids: Vec<&str> = soonest.iter().map(|m| m[0].as_str().unwrap()).collect();
    let dues: Vec<u64> = soonest.iter().map(|m| m[1].as_u64().unwrap()).collect();
    assert!(
        dues.windows(2).all(|w| w[0] <= w[1]),
        "soonest first: {found}"
    );
    assert_eq!(held["next_ms"].as_u64(), dues.first().copied(), "{found}");
    assert_eq!(held["last_ms"].as_u64(), dues.last().copied(), "{found}");
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 8, "eight distinct messages: {found}");
    assert!(ids.iter().all(|id| id.starts_with("S-held-")), "{found}");
    // Another seller holds nothing.
    rig.publish("S-free", 1).await?;
    rig.wait_registered(3).await?;
    let (_, free) = api.get("/api/search?q=S-free&kind=seller").await;
    assert_eq!(free["seller"]["held"], json!([]), "{free}");

    let page = api.page("#find=S-held");
    chromium
        .screenshot_sized(&page, &screens().join("held-messages.png"), "1400,2000")
        .await;
    let dom = chromium.dump_dom(&page).await;
    let shown = element(&dom, "search-results");
    assert!(shown.contains("held for their slot"), "{shown}");
    assert!(shown.contains(&format!("{replica}: 8 (next ")), "{shown}");
    rig.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_broker_outage_the_page_says_the_broker_is_down_since_when_and_marks_stale_figures()
-> anyhow::Result<()> {
    let chromium = Chromium::find();
    let mut rig = support::rig("outage", "10/1s").prepare().await?;
    rig.publish("S-outage", 3).await?;
    // The replica reaches the broker through a link of its own, which the test cuts: the
    // shared broker keeps running.
    let broker: std::net::SocketAddr = "127.0.0.1:5672".parse().unwrap();
    let link = turnstile_lab::slow_link::SlowLink::start(broker, Duration::ZERO).await?;
    let mut consume = rig.settings(1);
    consume.broker.amqp.url = format!("amqp://guest:guest@{}/%2f", link.addr());
    rig.start_replica(ServeArgs {
        consume,
        http: serving_with_token("outage-secret"),
    })
    .await?;
    rig.wait_registered(3).await?;
    let api = Console::of(rig.dashboard().unwrap(), Some("outage-secret"));
    let before = api
        .wait_for("the broker up and the queues read", |d| {
            d["health"]["broker"]["state"] == "up"
                && d["queues"]["stale"] == false
                && d["replica"]["ready"] == true
        })
        .await;
    let read_before = before["queues"]["read_ms"].as_u64().unwrap();

    link.cut();
    let during = api
        .wait_for(
            "the broker down, the queues stale, the replica not consuming",
            |d| {
                d["health"]["broker"]["state"] == "down"
                    && d["queues"]["stale"] == true
                    && d["replica"]["ready"] == false
            },
        )
        .await;
    let broker_health = &during["health"]["broker"];
    assert!(
        broker_health["since_ms"].as_u64().unwrap() > read_before,
        "{broker_health}"
    );
    assert!(!error_of(&json!({"error": broker_health["last_error"]})).is_empty());
    assert_eq!(
        during["queues"]["read_ms"], read_before,
        "the last depths read, not new ones"
    );
    assert_eq!(during["health"]["redis"]["state"], "up");
    assert!(
        during["replica"]["not_ready_why"]
            .as_str()
            .unwrap()
            .contains("broker"),
        "{}",
        during["replica"]
    );

    let page = api.page("");
    let shot = screens().join("broker-outage.png");
    chromium.screenshot_sized(&page, &shot, "1400,2000").await;
    let dom = chromium.dump_dom(&page).await;
    std::fs::write(screens().join("broker-outage.html"), &dom).unwrap();
    assert_eq!(text_of(&dom, "broker-state"), "down");
    assert!(
        text_of(&dom, "broker-since").starts_with("down since "),
        "{}",
        text_of(&dom, "broker-since")
    );
    let error = text_of(&dom, "broker-error");
    assert!(
        error.starts_with("last error (") && error.len() > "last error ()".len() + 10,
        "{error}"
    );
    assert!(
        tag(&dom, "queues").contains("stale"),
        "the queue depths are marked stale: {}",
        tag(&dom, "queues")
    );
    assert!(
        text_of(&dom, "queue-read").starts_with("STALE: last read "),
        "{}",
        text_of(&dom, "queue-read")
    );
    let alerts = element(&dom, "alert-list");
    assert!(alerts.contains("Broker down since"), "{alerts}");
    assert!(
        text_of(&dom, "ready").starts_with("not consuming: the broker"),
        "{}",
        text_of(&dom, "ready")
    );
    assert_eq!(text_of(&dom, "redis-state"), "up");
    rig.cleanup().await
}

/// The opening tag of the element with id `id`.
fn tag(dom: &str, id: &str) -> String {
    let marker = format!(r#"id="{id}""#);
    let at = dom.find(&marker).unwrap_or_else(|| panic!("no #{id}"));
    let start = dom[..at].rfind('<').unwrap();
    let end = at + dom[at..].find('>').unwrap();
    dom[start..=end].to_owned()
}

/// The element with id `id`, up to the next closing tag of its kind (no nested element of the
/// same kind inside).
fn element(dom: &str, id: &str) -> String {
    let open = tag(dom, id);
    let name: String = open[1..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let start = dom.find(&open).unwrap();
    let close = format!("</{name}>");
    let end = start + dom[start..].find(&close).unwrap();
    dom[start..end].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_redis_outage_the_page_keeps_the_last_figures_read_marked_stale()
-> anyhow::Result<()> {
    let chromium = Chromium::find();
    let mut rig = support::rig("redis-outage", "10/1s").prepare().await?;
    // The replica reaches Redis through a link of its own, which the test cuts.
    let redis: std::net::SocketAddr = "127.0.0.1:6379".parse().unwrap();
    let link = turnstile_lab::slow_link::SlowLink::start(redis, Duration::ZERO).await?;
    let mut consume = rig.settings(1);
    consume.redis.url = link.redis_url();
    rig.start_replica(ServeArgs {
        consume,
        http: serving_at("127.0.0.1:0"),
    })
    .await?;
    upload(&mut rig, "S-before", "before-outage", 4, 0).await?;
    rig.wait_registered(4).await?;
    let api = Console::of(rig.dashboard().unwrap(), None);
    api.wait_for("the upload counted", |d| {
        upload_of(d, "S-before")["registered"] == 4 && d["health"]["redis"]["state"] == "up"
    })
    .await;

    link.cut();
    let during = api
        .wait_for("Redis down, its figures stale", |d| {
            d["health"]["redis"]["state"] == "down" && d["shared_stale"] == true
        })
        .await;
    let redis_health = &during["health"]["redis"];
    assert!(
        redis_health["last_error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{redis_health}"
    );
    assert!(
        during["shared_read_ms"].as_u64().unwrap()
            < redis_health["since_ms"].as_u64().unwrap() + 5_000,
        "the figures are those read before the outage"
    );
    assert_eq!(
        upload_of(&during, "S-before")["registered"],
        4,
        "the last figures are kept"
    );
    assert_eq!(during["health"]["broker"]["state"], "up");

    let page = api.page("");
    chromium
        .screenshot_sized(&page, &screens().join("redis-outage.png"), "1400,2000")
        .await;
    let dom = chromium.dump_dom(&page).await;
    std::fs::write(screens().join("redis-outage.html"), &dom).unwrap();
    assert_eq!(text_of(&dom, "redis-state"), "down");
    assert!(text_of(&dom, "redis-since").starts_with("down since "));
    assert!(
        tag(&dom, "uploads-section").contains("stale"),
        "the uploads are marked stale"
    );
    assert!(
        element(&dom, "uploads-section").contains("stale · read "),
        "with the time they were read"
    );
    assert!(element(&dom, "alert-list").contains("Redis down since"));
    assert_eq!(
        cell(&row(&dom, "upload", "S-before"), "registered"),
        "4 / 4"
    );
    rig.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_whose_client_goes_away_is_still_carried_out_and_audited() -> anyhow::Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut rig = support::rig("gone", "50/1s").prepare().await?;
    let consume = rig.settings(1);
    rig.start_replica(ServeArgs {
        consume,
        http: serving_with_token("gone-secret"),
    })
    .await?;
    let addr = rig.dashboard().unwrap();
    // Dead letters of one seller, straight in the dead-letter queue: replaying them takes a
    // round trip to Redis and to the broker each, far longer than the client stays.
    const LETTERS: usize = 1000;
    let channel = rig.connection().create_channel().await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await?;
    for i in 0..LETTERS {
        let body = json!({"message_id": format!("gone-{i}"), "seller_id": "S-gone",
            "product": {"sku": format!("gone-{i}")}});
        channel
            .basic_publish(
                "".into(),
                rig.topology.dead().into(),
                lapin::options::BasicPublishOptions::default(),
                body.to_string().as_bytes(),
                lapin::BasicProperties::default(),
            )
            .await?
            .await?;
    }

    // The whole request, then, once the replay is under way, the connection closed before
    // its answer (a browser tab closed, a proxy that gave up).
    let body = json!({"seller": "S-gone", "dry_run": false, "operator": "gone"}).to_string();
    let request = format!(
        "POST /api/actions/replay HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer gone-secret\r\n\
         X-Turnstile-Action: 1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let dead = rig.topology.dead().to_owned();
    support::eventually_async("the replay under way", async || {
        turnstile_core::broker::depth(&channel, &dead)
            .await
            .unwrap()
            < LETTERS as u32
    })
    .await;
    drop(stream);

    // The replay runs to its end all the same, and its audit entry says what it did.
    let records = rig.records();
    let mut entry = None;
    support::eventually_async("the replay done and audited", async || {
        entry = turnstile_ops::audit::recent(&records, 10)
            .await
            .unwrap()
            .into_iter()
            .find(|e| e.action == "replay" && e.outcome != "refused");
        entry.is_some()
    })
    .await;
    let entry = entry.unwrap();
    assert_eq!(entry.outcome, "done", "{entry:?}");
    assert!(
        entry
            .result
            .starts_with(&format!("{LETTERS} dead letter(s)")),
        "{entry:?}"
    );
    rig.cleanup().await
}
