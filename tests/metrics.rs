//! `/metrics` from the first scrape: every counter and histogram series a replica can export is
//! there at 0 before any message, and no series appears later that the first scrape lacked.
//! (Its own test binary: the Prometheus recorder is one per process, so no other test's events
//! can show in these counts.)
mod support;

use std::collections::BTreeSet;

use serde_json::json;
use turnstile_core::series::{Kind, METRICS};
use turnstile_ops::http::Listen;
use turnstile_ops::serve::{HttpArgs, ServeArgs};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_replica_exports_every_series_at_zero_and_no_series_appears_later()
-> anyhow::Result<()> {
    let mut rig = support::rig("metrics-zero", "3/1s").prepare().await?;
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
    for metric in METRICS.iter().filter(|m| m.kind != Kind::Gauge) {
        for value in metric.label_values(algorithm) {
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
        assert!(
            first_page.contains(&format!("# HELP {} ", metric.name)),
            "{} has no help text",
            metric.name
        );
    }
    assert!(
        first.iter().any(|(s, v)| s == "turnstile_ready" && *v <= 1.0),
        "readiness is exported:\n{first_page}"
    );

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
        later.iter().any(|(s, v)| {
            s == r#"turnstile_dead_letters_total{reason="rejected"}"# && *v >= 1.0
        }) && later.iter().any(|(s, v)| {
            s == r#"turnstile_permits_denied_total{algorithm="sliding-window"}"# && *v >= 1.0
        })
    })
    .await;
    let new: Vec<&String> = later
        .iter()
        .map(|(s, _)| s)
        .filter(|s| !s.starts_with("turnstile_queue_messages{"))
        .filter(|s| !first_ids.contains(&identity(s)))
        .collect();
    assert!(new.is_empty(), "series missing from the first scrape: {new:?}");
    let exported: BTreeSet<&str> = METRICS.iter().map(|m| m.name).collect();
    for (s, _) in &later {
        let name = identity(s);
        let name = name.split('{').next().unwrap();
        assert!(exported.contains(name), "{name} is not in series::METRICS");
    }
    rig.cleanup().await
}
