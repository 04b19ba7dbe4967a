//! Bulk calls: many rows of one seller in one downstream call, under the same limits, with a
//! result for every row, against the real broker and Redis and a strict mock that answers each
//! bulk call per row.
mod support;

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{Value, json};
use support::results::Results;
use turnstile_core::config::Limits;
use turnstile_lab::mock_api::{BulkCount, MockArgs, Stats};
use turnstile_lab::rig::Rig;

fn limits(s: &str) -> Limits {
    s.parse().unwrap()
}

/// A routes file making the default endpoint bulk (`[default] bulk = { … }`), removed on drop.
struct RoutesFile(PathBuf);

impl RoutesFile {
    fn bulk(test: &str, bulk: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "turnstile-bulk-{test}-{:08x}.toml",
            rand::random::<u32>()
        ));
        std::fs::write(&path, format!("[default]\nbulk = {{ {bulk} }}\n")).unwrap();
        Self(path)
    }
}

impl Drop for RoutesFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A rig whose mock holds each seller to `limit` and answers bulk calls counted as `count`,
/// with `replicas` replicas of `workers` workers calling the default endpoint in bulk as
/// `bulk` says; and a listener of its results.
async fn bulk_rig(
    what: &str,
    limit: &str,
    count: BulkCount,
    bulk: &str,
    replicas: usize,
    workers: u32,
) -> anyhow::Result<(Rig, Results)> {
    let mock = MockArgs {
        bulk: Some(count),
        bulk_items: Some("items".into()),
        ..MockArgs::local(limits(limit))
    };
    let mut rig = support::rig(what, limit).with_mock(mock).prepare().await?;
    let results = Results::listen(&rig).await;
    let file = RoutesFile::bulk(what, bulk);
    let mut settings = rig.settings(workers);
    settings.routes.file = Some(file.0.clone());
    for _ in 0..replicas {
        rig.start_replica(settings.clone()).await?;
    }
    Ok((rig, results))
}

/// Row `i` of `seller`'s batch `batch` of `size` rows, its product scripted by `mock` if given.
fn row(seller: &str, batch: &str, i: usize, size: usize, mock: Option<Value>) -> Vec<u8> {
    let mut product = json!({ "sku": format!("{batch}-{i}") });
    if let Some(mock) = mock {
        product["mock"] = mock;
    }
    json!({
        "message_id": format!("{batch}-{i}"), "seller_id": seller,
        "batch_id": batch, "batch_size": size, "product": product,
    })
    .to_string()
    .into_bytes()
}

/// Each result's own entry of the bulk answer: its status, and the message id the entry names.
fn entry_of(result: &Value) -> (u64, String) {
    let response = &result["response"];
    (
        result["status"].as_u64().unwrap_or(0),
        response["message_id"].as_str().unwrap_or("").to_owned(),
    )
}

/// Every result registered, each with its own entry of the answer (its own message id).
fn assert_each_row_has_its_own_entry(results: &Results, rows: usize) {
    let all = results.all();
    let registered: Vec<&Value> = all.iter().filter(|r| r["outcome"] == "registered").collect();
    assert_eq!(registered.len(), rows, "{:?}", results.brief());
    for result in registered {
        let (status, named) = entry_of(result);
        assert_eq!(status, 200, "{result}");
        assert_eq!(named, result["message_id"].as_str().unwrap(), "{result}");
    }
}

/// A batch's progress as the replicas recorded it.
async fn batch_progress(rig: &Rig, seller: &str, batch: &str) -> turnstile_core::permit::UploadProgress {
    let seller = turnstile_core::domain::SellerId::parse(seller).unwrap();
    let batch = turnstile_core::domain::BatchId::parse(batch).unwrap();
    rig.records()
        .batch_progress(&seller, &batch)
        .await
        .unwrap()
        .expect("the batch is recorded")
}

fn calls_and_rows(stats: &Stats) -> String {
    format!(
        "{} calls ({} bulk, {} rows in them), {} registered, {} violations, {} duplicates",
        stats.requests,
        stats.bulk_calls,
        stats.bulk_rows,
        stats.registered,
        stats.violations,
        stats.duplicates
    )
}

/// The seed's upload at test speed: 500 rows of one seller at 20 calls per second, 50 rows per
/// call counted as one call. Every row is registered once through bulk calls that never take
/// a window over the limit, each row gets its own result with its own entry of the answer, and
/// the batch completes.
#[tokio::test]
async fn an_upload_of_500_rows_is_registered_in_bulk_calls_under_the_calls_limit_with_a_result_per_row()
-> anyhow::Result<()> {
    let bulk = r#"max_rows = 50, linger = "200ms", cost = "call", items = "items", id_field = "message_id""#;
    let (mut rig, results) = bulk_rig("bulk-seed", "20/1s", BulkCount::Call, bulk, 2, 4).await?;
    let started = Instant::now();
    for i in 0..500 {
        rig.publish_body(&row("S-big", "upload-1", i, 500, None)).await?;
    }
    let stats = rig.wait_registered(500).await?;
    let took = started.elapsed();
    results.until(500).await;
    let seller = &stats.sellers["S-big"];
    println!(
        "500 rows at 20 calls/1s, 50 per call: {}; published and registered in {:.2}s, the first \
         to the last registration {} ms (one row per call needs 24.05 s)",
        calls_and_rows(&stats),
        took.as_secs_f64(),
        seller.last_ms.unwrap_or(0) - seller.first_ms.unwrap_or(0)
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(stats.sellers["S-big"].registered, 500);
    assert_eq!(stats.bulk_rows, 500, "no row was sent twice: {stats:?}");
    assert!(
        stats.requests <= 40,
        "rows went in bulk calls, not one by one: {stats:?}"
    );
    assert!(stats.sellers["S-big"].max_in_window <= 20, "{stats:?}");
    assert_each_row_has_its_own_entry(&results, 500);
    let batch = batch_progress(&rig, "S-big", "upload-1").await;
    assert!(batch.done() && batch.registered == 500, "{batch:?}");
    assert!(batch.completed_ms.is_some(), "{batch:?}");
    rig.stop_replicas().await?;
    assert_eq!(rig.dead_lettered().await?, 0);
    rig.cleanup().await
}
