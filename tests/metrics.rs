//! `/metrics` from the first scrape: every counter and histogram series a replica can export is
//! there at 0 before any message (before the replica reached Redis, even), with the gauges the
//! alert rules need, the build's and the process's; no series appears later that the first
//! scrape lacked. (Its own test binary: the Prometheus recorder is one per process, so no other
//! test's events can show in these counts.)
mod support;

use std::collections::BTreeSet;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_core::config::Algorithm;
use turnstile_core::series::{self, Kind, METRICS};
use turnstile_ops::http::Listen;
use turnstile_ops::serve::{HttpArgs, ServeArgs, Served};

/// The series of a scrape: `name{labels}` (without a histogram bucket's `le`) → value.
fn series(page: &str) -> Vec<(String, f64)> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (id, value) = l.rsplit_once(' ')?;
            Some((id.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// A series' identity without its histogram part: `name{labels}` where a histogram's
/// `_bucket`, `_sum` and `_count` are its own name and a bucket's `le` is dropped.
fn identity(id: &str) -> String {
    let (name, labels) = id.split_once('{').unwrap_or((id, ""));
    let histogram = ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = name.strip_suffix(suffix)?;
        METRICS
            .iter()
            .any(|m| m.name == base && m.kind == Kind::Histogram)
            .then_some(base)
    });
    let name = histogram.unwrap_or(name);
    let labels: Vec<&str> = labels
        .trim_end_matches('}')
        .split(',')
        .filter(|l| !l.is_empty() && !l.starts_with("le="))
        .collect();
    if labels.is_empty() {
        name.to_owned()
    } else {
        format!("{name}{{{}}}", labels.join(","))
    }
}

/// The value of the series `id` (`name{labels}`) in a scrape, if it is there.
fn value(scrape: &[(String, f64)], id: &str) -> Option<f64> {
    scrape.iter().find(|(s, _)| s == id).map(|(_, v)| *v)
}

/// The metrics an alert rule names that a replica exports only once it has read them from
/// Redis or the broker (moments after it reached them): an unknown value is absent rather than
/// a false 0.
const READ_FIRST: [&str; 2] = ["turnstile_redis_may_evict", "turnstile_queue_messages"];

/// The first scrape of a replica that has not reached Redis yet (so nothing else either).
async fn scrape_before_redis(rig: &turnstile_lab::rig::Rig) -> anyhow::Result<String> {
    let mut consume = rig.settings(2);
    consume.redis.url = format!("redis://127.0.0.1:{}/", support::free_port());
    let port = support::free_port();
    let http = HttpArgs {
        http_addr: Listen::At(format!("127.0.0.1:{port}").parse()?),
        http_token: None,
    };
    let stop = CancellationToken::new();
    let starting = tokio::spawn(Served::start(ServeArgs { consume, http }, stop.clone()));
    let url = format!("http://127.0.0.1:{port}/metrics");
    let mut page = String::new();
    support::eventually_async(
        "the endpoints of a replica without Redis answer",
        async || match reqwest::get(&url).await {
            Ok(answer) => {
                page = answer.text().await.unwrap();
                true
            }
            Err(_) => false,
        },
    )
    .await;
    stop.cancel();
    starting.await??.wait().await?;
    Ok(page)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_replica_exports_every_series_at_zero_and_no_series_appears_later()
-> anyhow::Result<()> {
    let mut rig = support::rig("metrics-zero", "3/1s").prepare().await?;

    // Before it reached Redis or the broker: not ready, not connected, nothing overdue; the
    // build and the process; every series an alert rule needs but those read from Redis or
    // the broker.
    let before = scrape_before_redis(&rig).await?;
    let scrape = series(&before);
    for gauge in [
        "turnstile_ready",
        "turnstile_broker_connected",
        "turnstile_redis_connected",
        "turnstile_batches_overdue",
        "turnstile_batches_stalled",
    ] {
        assert_eq!(value(&scrape, gauge), Some(0.0), "{gauge}:\n{before}");
    }
    let build = format!(
        "turnstile_build_info{{version=\"{}\",git_sha=\"{}\"}}",
        series::VERSION,
        series::GIT_SHA
    );
    let build_info = scrape.iter().find(|(s, _)| {
        s.starts_with("turnstile_build_info{")
            && s.contains(&format!("version=\"{}\"", series::VERSION))
            && s.contains(&format!("git_sha=\"{}\"", series::GIT_SHA))
    });
    assert_eq!(build_info.map(|(_, v)| *v), Some(1.0), "{build}:\n{before}");
    for metric in METRICS.iter().filter(|m| m.is_process()) {
        let found = value(&scrape, metric.name);
        assert!(found.is_some(), "{} is missing:\n{before}", metric.name);
        assert!(
            before.contains(&format!("# HELP {} ", metric.name)),
            "{} has no help text",
            metric.name
        );
    }
    for positive in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
        "process_threads",
    ] {
        assert!(
            value(&scrape, positive).unwrap() > 0.0,
            "{positive}:\n{before}"
        );
    }
    let named: BTreeSet<String> = rule_metrics(include_str!("../deploy/prometheus/alerts.yml"));
    assert!(named.len() >= 12, "{named:?}");
    for name in &named {
        let present = scrape
            .iter()
            .any(|(s, _)| identity(s).split('{').next() == Some(name.as_str()));
        assert!(
            present || READ_FIRST.contains(&name.as_str()),
            "{name}, named by an alert rule, is missing from the first scrape:\n{before}"
        );
    }

    let consume = rig.settings(2);
    let algorithm = consume.limiter.algorithm;
    let http = HttpArgs {
        http_addr: Listen::At("127.0.0.1:0".parse()?),
        http_token: None,
    };
    rig.start_replica(ServeArgs { consume, http }).await?;
    let url = format!(
        "http://{}/metrics",
        rig.replicas().next().unwrap().http_addr.unwrap()
    );

    // Before any message: each counter and histogram with each label value, at 0.
    let first_page = reqwest::get(&url).await?.text().await?;
    let first = series(&first_page);
    for metric in METRICS
        .iter()
        .filter(|m| m.kind != Kind::Gauge && !m.is_process())
    {
        for value in metric.label_values(algorithm, &[]) {
            let labels = match metric.label {
                Some(label) => format!("{{{}=\"{value}\"}}", label.key),
                None => String::new(),
            };
            let id = match metric.kind {
                Kind::Histogram => format!("{}_count{labels}", metric.name),
                _ => format!("{}{labels}", metric.name),
            };
            let found = first.iter().find(|(s, _)| *s == id);
            assert_eq!(
                found.map(|(_, v)| *v),
                Some(0.0),
                "{id} is not at 0 in the first scrape:\n{first_page}"
            );
        }
        // A metric by route has no series without a routes file, and so no help text yet.
        let by_route = metric.label_values(algorithm, &[]).is_empty();
        assert!(
            by_route || first_page.contains(&format!("# HELP {} ", metric.name)),
            "{} has no help text",
            metric.name
        );
    }
    let ready = first.iter().find(|(s, _)| s == "turnstile_ready");
    assert!(
        ready.is_some_and(|(_, v)| *v == 0.0 || *v == 1.0),
        "readiness is exported:\n{first_page}"
    );
    // Consuming: connected to both; Redis's memory policy read.
    for gauge in [
        "turnstile_broker_connected",
        "turnstile_redis_connected",
        "turnstile_ready",
    ] {
        assert_eq!(value(&first, gauge), Some(1.0), "{gauge}:\n{first_page}");
    }
    assert_eq!(
        value(&first, "turnstile_redis_may_evict"),
        Some(0.0),
        "{first_page}"
    );
    // The queue depths come with their first reading, moments later.
    support::eventually_async("the queue depths are read", async || {
        let page = reqwest::get(&url).await.unwrap().text().await.unwrap();
        ["work", "ready", "delay", "dead"]
            .iter()
            .all(|queue| page.contains(&format!("turnstile_queue_messages{{queue=\"{queue}\"}} ")))
            && page.contains("turnstile_queue_messages_age_seconds ")
    })
    .await;

    // Then a workload with grants, waits, a registration refused, and 2xx/4xx answers.
    rig.publish("S-zero-busy", 8).await?;
    rig.publish_product(
        "S-zero-rejected",
        "m-zero-rejected",
        json!({"mock": {"statuses": [400]}}),
    )
    .await?;
    rig.wait_registered(8).await?;
    rig.dead_letters(1).await?;

    let first_ids: BTreeSet<String> = first.iter().map(|(s, _)| identity(s)).collect();
    let mut later = Vec::new();
    support::eventually_async("the workload is counted", async || {
        later = series(&reqwest::get(&url).await.unwrap().text().await.unwrap());
        later
            .iter()
            .any(|(s, v)| s == r#"turnstile_dead_letters_total{reason="rejected"}"# && *v >= 1.0)
            && later.iter().any(|(s, v)| {
                s == r#"turnstile_permits_denied_total{algorithm="sliding-window"}"# && *v >= 1.0
            })
    })
    .await;
    let new: Vec<&String> = later
        .iter()
        .map(|(s, _)| s)
        .filter(|s| !s.starts_with("turnstile_queue_messages"))
        .filter(|s| !first_ids.contains(&identity(s)))
        .collect();
    let before_ids: BTreeSet<String> = scrape.iter().map(|(s, _)| identity(s)).collect();
    // The queue depths come with the console's first reading of the broker, whenever that is.
    let after_redis: BTreeSet<String> = first_ids
        .difference(&before_ids)
        .filter(|s| !s.starts_with("turnstile_queue_messages"))
        .cloned()
        .collect();
    assert_eq!(
        after_redis,
        BTreeSet::from([
            "turnstile_fleet_disagreement".to_owned(),
            "turnstile_fleet_replicas".to_owned(),
            "turnstile_redis_may_evict".to_owned(),
            // Set when the replica first reads Redis's start.
            "turnstile_redis_cold_start_pause_seconds".to_owned(),
            // Set when the delay ladder's channel opens, from the consumer timeout.
            "turnstile_delay_longest_hold_seconds".to_owned(),
        ]),
        "the series that come with a replica's first reading of Redis and its ladder's start"
    );
    assert!(
        new.is_empty(),
        "series missing from the first scrape: {new:?}"
    );
    let exported: BTreeSet<&str> = METRICS.iter().map(|m| m.name).collect();
    for (s, _) in &later {
        let name = identity(s);
        let name = name.split('{').next().unwrap();
        assert!(exported.contains(name), "{name} is not in series::METRICS");
    }
    rig.cleanup().await
}

/// The names a PromQL query uses that a replica does not export (a histogram exports
/// `<name>_bucket`, `_sum` and `_count`), and whether it names any of ours at all.
fn unexported(query: &str) -> (Vec<String>, bool) {
    let exported = |name: &str| {
        METRICS.iter().any(|m| {
            m.name == name
                || (m.kind == Kind::Histogram
                    && ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|suffix| name.strip_suffix(suffix) == Some(m.name)))
        })
    };
    let mut missing = Vec::new();
    let mut named = false;
    for (at, _) in query.match_indices("turnstile_") {
        if at > 0 && query.as_bytes()[at - 1].is_ascii_alphanumeric() {
            continue;
        }
        let end = query[at..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(query.len(), |n| at + n);
        let name = &query[at..end];
        named = true;
        if !exported(name) {
            missing.push(name.to_owned());
        }
    }
    (missing, named)
}

/// The metric names a rules file (or a query) uses: `turnstile_*` and `process_*`, a
/// histogram's `_bucket` as the histogram.
fn rule_metrics(rules: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for prefix in ["turnstile_", "process_"] {
        for (at, _) in rules.match_indices(prefix) {
            if at > 0 && rules.as_bytes()[at - 1].is_ascii_alphanumeric() {
                continue;
            }
            let end = rules[at..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(rules.len(), |n| at + n);
            names.insert(identity(&rules[at..end]));
        }
    }
    names
}

/// Every `expr` of every panel (rows' nested panels too) and every variable's query.
fn queries(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(panels: &serde_json::Value, out: &mut Vec<(String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?").to_owned();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"]
                    .as_str()
                    .expect("a Prometheus target has an expr");
                out.push((title.clone(), expr.to_owned()));
            }
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] == "query" {
            let query = &variable["query"];
            let query = query["query"]
                .as_str()
                .or(query.as_str())
                .unwrap_or_default();
            out.push((format!("${}", variable["name"]), query.to_owned()));
        }
    }
    out
}

#[test]
fn every_query_of_the_grafana_dashboard_names_metrics_a_replica_exports() {
    let text = include_str!("../deploy/grafana/turnstile.json");
    let dashboard: serde_json::Value = serde_json::from_str(text).expect("the dashboard is JSON");
    let queries = queries(&dashboard);
    assert!(queries.len() >= 20, "{} queries", queries.len());
    for (panel, query) in &queries {
        let (missing, named) = unexported(query);
        assert!(named, "{panel}: {query} names no turnstile metric");
        assert!(
            missing.is_empty(),
            "{panel}: {query} names {missing:?}, which no replica exports"
        );
        let unknown = unknown_label_values(query);
        assert!(
            unknown.is_empty(),
            "{panel}: {query}: no series has {unknown:?}"
        );
    }
    // What an operator must see: throughput, permits, downstream answers and latency, queue
    // depths, dead letters by reason, readiness.
    let all: String = queries
        .iter()
        .map(|(_, q)| q.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    for wanted in [
        "turnstile_outcomes_total",
        "turnstile_deliveries_total",
        "turnstile_permits_granted_total",
        "turnstile_permits_denied_total",
        "turnstile_permits_near_limit_total",
        "turnstile_downstream_requests_total",
        "turnstile_downstream_request_duration_seconds_bucket",
        "turnstile_queue_messages",
        "sum by (reason) (rate(turnstile_dead_letters_total",
        "turnstile_ready",
    ] {
        assert!(all.contains(wanted), "the dashboard shows no {wanted}");
    }
    // Panels have distinct ids and query the dashboard's Prometheus data source variable.
    let mut ids = BTreeSet::new();
    let mut stack = vec![&dashboard["panels"]];
    while let Some(panels) = stack.pop() {
        for panel in panels.as_array().into_iter().flatten() {
            assert!(
                ids.insert(panel["id"].as_u64().expect("a panel id")),
                "id twice"
            );
            if panel["type"] != "row" {
                assert_eq!(
                    panel["datasource"]["uid"], "${datasource}",
                    "{}",
                    panel["title"]
                );
            }
            stack.push(&panel["panels"]);
        }
    }
    assert_eq!(dashboard["uid"], "turnstile");
}

/// The label matchers of a query (`key="v"`, `key=~"a|b"`) whose value no exported metric
/// takes under that label (`instance` and `le` are Prometheus' own).
fn unknown_label_values(query: &str) -> Vec<String> {
    let mut unknown = Vec::new();
    for (at, _) in query.match_indices('"') {
        // A matcher's value starts after `key="` or `key=~"`.
        let before = &query[..at];
        let Some(before) = before
            .strip_suffix("=~")
            .or_else(|| before.strip_suffix('='))
        else {
            continue;
        };
        let key_start = before
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let key = &before[key_start..];
        if key.is_empty() || key == "instance" || key == "job" || key == "le" {
            continue;
        }
        let value = &query[at + 1..];
        let value = &value[..value.find('"').unwrap_or(value.len())];
        let known: BTreeSet<String> = METRICS
            .iter()
            .filter(|m| m.label.is_some_and(|l| l.key == key))
            .flat_map(|m| {
                Algorithm::ALL
                    .iter()
                    .flat_map(move |&a| m.label_values(a, &[]))
            })
            .collect();
        for alternative in value.split('|') {
            if !known.contains(alternative) {
                unknown.push(format!("{key}={alternative:?}"));
            }
        }
    }
    unknown
}

#[test]
fn the_dashboard_check_catches_a_metric_no_replica_exports() {
    let (missing, named) = unexported("sum(rate(turnstile_permits_grantd_total[5m]))");
    assert!(named);
    assert_eq!(missing, ["turnstile_permits_grantd_total"]);
    assert_eq!(
        unknown_label_values(
            r#"rate(turnstile_outcomes_total{instance=~"$i",outcome="registerd"}[1m])"#
        ),
        [r#"outcome="registerd""#]
    );
    assert_eq!(
        unknown_label_values(r#"turnstile_downstream_requests_total{class=~"5xx|timeout|eror"}"#),
        [r#"class="eror""#]
    );
    assert!(unknown_label_values(r#"turnstile_queue_messages{queue="work"}"#).is_empty());
    let (missing, _) = unexported("rate(turnstile_downstream_request_duration_seconds_bucket[1m])");
    assert!(missing.is_empty());
    let (_, named) = unexported("up");
    assert!(!named);
}

#[test]
fn the_operations_doc_documents_every_metric_and_no_other() {
    let doc = include_str!("../docs/operations.md");
    let table: BTreeSet<&str> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
        .filter(|name| name.starts_with("turnstile_") || name.starts_with("process_"))
        .collect();
    let exported: BTreeSet<&str> = METRICS.iter().map(|m| m.name).collect();
    assert_eq!(
        table, exported,
        "docs/operations.md's metrics table vs series::METRICS"
    );
}

#[test]
fn every_alert_rule_names_metrics_a_replica_exports() {
    let rules = include_str!("../deploy/prometheus/alerts.yml");
    let (missing, named) = unexported(rules);
    assert!(named);
    assert!(missing.is_empty(), "alerts.yml names {missing:?}");
    let unknown = unknown_label_values(rules);
    assert!(
        unknown.is_empty(),
        "alerts.yml matches {unknown:?}, which no series has"
    );
    assert!(
        rules.matches("- alert: ").count() >= 5,
        "the rules file holds the alerts"
    );
}

/// Every `.rs` file under `dir`.
fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_metric_the_sources_emit_is_in_the_catalogue() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in [
        "src",
        "crates/core/src",
        "crates/ops/src",
        "crates/upload/src",
        "crates/lab/src",
    ] {
        sources(&root.join(dir), &mut files);
    }
    let mut seen = BTreeSet::new();
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        for macro_call in ["counter!(", "gauge!(", "histogram!("] {
            for after in source.split(macro_call).skip(1) {
                let Some(quoted) = after.trim_start().strip_prefix('"') else {
                    continue; // a name from a variable, as in series::export_at_zero
                };
                let name = &quoted[..quoted.find('"').expect("a closed literal")];
                assert!(
                    METRICS.iter().any(|m| m.name == name),
                    "{name} ({}) is emitted but missing from series::METRICS",
                    file.display()
                );
                seen.insert(name.to_owned());
            }
        }
    }
    // The scan finds them: the core's, and the operator side's queue depths and gauges.
    for name in [
        "turnstile_deliveries_total",
        "turnstile_queue_messages",
        "turnstile_in_flight",
    ] {
        assert!(seen.contains(name), "{name} not found in the sources");
    }
}
