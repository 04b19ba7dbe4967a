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
    let registered: Vec<&Value> = all
        .iter()
        .filter(|r| r["outcome"] == "registered")
        .collect();
    assert_eq!(registered.len(), rows, "{:?}", results.brief());
    for result in registered {
        let (status, named) = entry_of(result);
        assert_eq!(status, 200, "{result}");
        assert_eq!(named, result["message_id"].as_str().unwrap(), "{result}");
    }
}

/// A batch's progress as the replicas recorded it.
async fn batch_progress(
    rig: &Rig,
    seller: &str,
    batch: &str,
) -> turnstile_core::permit::UploadProgress {
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
        rig.publish_body(&row("S-big", "upload-1", i, 500, None))
            .await?;
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
    assert_eq!(
        batch.rows_per_call, 50,
        "its ETA counts 50 rows to a permit"
    );
    assert!(batch.completed_ms.is_some(), "{batch:?}");
    rig.stop_replicas().await?;
    assert_eq!(rig.dead_lettered().await?, 0);
    rig.cleanup().await
}

/// Rows counted one by one (`cost = "row"`) at 100 units per second: each row takes its own
/// permit, rows granted together share a call, and the API never sees a window over the limit,
/// in far fewer requests than rows.
#[tokio::test]
async fn rows_counted_one_by_one_share_calls_without_a_window_over_the_limit() -> anyhow::Result<()>
{
    let bulk = r#"max_rows = 50, linger = "100ms", cost = "row", items = "items", id_field = "message_id""#;
    let (mut rig, results) = bulk_rig("bulk-rows", "100/1s", BulkCount::Row, bulk, 2, 4).await?;
    for i in 0..300 {
        rig.publish_body(&row("S-rows", "rows-1", i, 300, None))
            .await?;
    }
    let stats = rig.wait_registered(300).await?;
    results.until(300).await;
    let seller = &stats.sellers["S-rows"];
    println!(
        "300 rows at 100 units/1s, each its own unit, up to 50 per call: {}; most units in a \
         window {}; the first to the last registration {} ms (the limit allows 2,000 ms)",
        calls_and_rows(&stats),
        seller.max_in_window,
        seller.last_ms.unwrap_or(0) - seller.first_ms.unwrap_or(0)
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(seller.registered, 300);
    assert_eq!(
        seller.units, 300,
        "every row's unit counted once: {stats:?}"
    );
    assert!(seller.max_in_window <= 100, "{stats:?}");
    assert!(stats.requests < 100, "rows shared calls: {stats:?}");
    assert_each_row_has_its_own_entry(&results, 300);
    rig.stop_replicas().await?;
    assert_eq!(rig.dead_lettered().await?, 0);
    rig.cleanup().await
}

/// 50 rows in bulk calls whose answers say 3 rows are rejected and 2 failed for now: each row
/// follows its own entry. The rejected are dead-lettered with their entry, the failed retried
/// on their own and registered, the rest registered once; nothing lost, nothing registered
/// twice. Twice over, with new rows.
#[tokio::test]
async fn each_row_of_a_bulk_call_follows_its_own_entry_of_the_answer() -> anyhow::Result<()> {
    let bulk = r#"max_rows = 50, linger = "200ms", cost = "call", items = "items", id_field = "message_id""#;
    let (mut rig, results) = bulk_rig("bulk-mixed", "20/1s", BulkCount::Call, bulk, 1, 4).await?;
    for round in 0..2 {
        let batch = format!("mixed-{round}");
        for i in 0..50 {
            let mock = match i {
                5 | 17 | 33 => Some(json!({"statuses": [422]})),
                8 | 40 => Some(json!({"statuses": [503, 200]})),
                _ => None,
            };
            rig.publish_body(&row("S-mixed", &batch, i, 50, mock))
                .await?;
        }
        let done = 50 * (round + 1);
        support::eventually("every row final", || results.all().len() >= done).await;
    }
    let stats = rig.mock.stats();
    println!(
        "2 x 50 rows, 3 rejected and 2 retryable in each: {}",
        calls_and_rows(&stats)
    );
    let rejected = results.with_outcome("rejected");
    let mut expected: Vec<String> = (0..2)
        .flat_map(|r| [5, 17, 33].map(|i| format!("mixed-{r}-{i}")))
        .collect();
    let mut got = rejected.clone();
    got.sort();
    expected.sort();
    assert_eq!(got, expected, "{:?}", results.brief());
    assert_each_row_has_its_own_entry(&results, 94);
    for result in results.all().iter().filter(|r| r["outcome"] == "rejected") {
        assert_eq!(entry_of(result).0, 422, "{result}");
        assert_eq!(entry_of(result).1, result["message_id"].as_str().unwrap());
    }
    for id in ["mixed-0-8", "mixed-0-40", "mixed-1-8", "mixed-1-40"] {
        let result = results
            .all()
            .into_iter()
            .find(|r| r["message_id"] == id)
            .unwrap();
        assert_eq!(result["outcome"], "registered", "{result}");
        assert_eq!(result["attempts"], 2, "retried once: {result}");
    }
    assert_eq!(stats.registered, 94, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(
        results.all().len(),
        100,
        "one result per row: {:?}",
        results.brief()
    );
    for round in 0..2 {
        let batch = batch_progress(&rig, "S-mixed", &format!("mixed-{round}")).await;
        assert!(
            batch.done() && batch.registered == 47 && batch.dead == 3,
            "{batch:?}"
        );
    }
    rig.stop_replicas().await?;
    assert_eq!(rig.dead_lettered().await?, 6);
    rig.cleanup().await
}

/// A bulk answer that cannot be mapped to its rows (an entry missing) registers no row by a
/// guess: every row of that call is retried in a call of its own, and each is registered once.
/// Twice over.
#[tokio::test]
async fn rows_of_a_bulk_answer_that_cannot_be_mapped_are_retried_one_at_a_time()
-> anyhow::Result<()> {
    let bulk = r#"max_rows = 10, linger = "200ms", cost = "call", items = "items", id_field = "message_id""#;
    let (mut rig, results) = bulk_rig("bulk-garbled", "20/1s", BulkCount::Call, bulk, 1, 4).await?;
    for round in 0..2 {
        let batch = format!("garbled-{round}");
        for i in 0..10 {
            let mock = (i == 3).then(|| json!({"statuses": [200], "garble": 1}));
            rig.publish_body(&row("S-garbled", &batch, i, 10, mock))
                .await?;
        }
        let done = 10 * (round + 1);
        support::eventually("every row final", || results.all().len() >= done).await;
    }
    let stats = rig.mock.stats();
    println!(
        "2 x 10 rows, one garbled answer in each: {}",
        calls_and_rows(&stats)
    );
    assert!(stats.garbled >= 2, "{stats:?}");
    assert_eq!(stats.registered, 20, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_each_row_has_its_own_entry(&results, 20);
    // The garbled calls' rows came back alone: one request each, after the garbled ones.
    assert!(stats.requests >= stats.garbled + 10, "{stats:?}");
    let retried = results.all().iter().filter(|r| r["attempts"] == 2).count();
    assert!(
        retried >= 10,
        "the rows of a garbled answer were retried: {:?}",
        results.all()
    );
    rig.stop_replicas().await?;
    assert_eq!(rig.dead_lettered().await?, 0);
    rig.cleanup().await
}

/// One seller fills bulk calls while another sends a single row: the single row goes in a
/// call of its own (a gather is one seller's), never waiting in the other's.
#[tokio::test]
async fn a_small_sellers_row_never_joins_another_sellers_bulk_call() -> anyhow::Result<()> {
    let bulk = r#"max_rows = 50, linger = "300ms", cost = "call", items = "items", id_field = "message_id""#;
    let (mut rig, results) = bulk_rig("bulk-small", "20/1s", BulkCount::Call, bulk, 1, 4).await?;
    for i in 0..120 {
        rig.publish_body(&row("S-filling", "filling", i, 120, None))
            .await?;
        if i == 60 {
            rig.publish_body(&row("S-small", "small", 0, 1, None))
                .await?;
        }
    }
    let stats = rig.wait_registered(121).await?;
    results.until(121).await;
    let small = &stats.sellers["S-small"];
    println!(
        "120 rows of one seller in bulk calls and one of another: {}; the small seller's row \
         registered at {} ms, the filling seller's from {} to {} ms",
        calls_and_rows(&stats),
        small.first_ms.unwrap_or(0),
        stats.sellers["S-filling"].first_ms.unwrap_or(0),
        stats.sellers["S-filling"].last_ms.unwrap_or(0),
    );
    assert_eq!(small.registered, 1);
    assert_eq!(small.units, 1, "its own call: {stats:?}");
    assert_eq!(stats.sellers["S-filling"].registered, 120);
    assert_eq!(stats.violations + stats.duplicates, 0, "{stats:?}");
    assert_each_row_has_its_own_entry(&results, 121);
    rig.stop_replicas().await?;
    rig.cleanup().await
}

/// A backlog deeper than the limit's calls: 300 rows at 2 calls per second, 50 per call. The
/// rows wait with the row that holds their call's slot (in memory or through the delay ladder)
/// instead of each reserving a slot of its own: about 6 calls, never a window over the limit.
#[tokio::test]
async fn rows_beyond_the_limits_calls_wait_with_their_calls_leader_instead_of_reserving_slots()
-> anyhow::Result<()> {
    let bulk = r#"max_rows = 50, linger = "200ms", cost = "call", items = "items", id_field = "message_id""#;
    let (mut rig, results) = bulk_rig("bulk-deep", "2/1s", BulkCount::Call, bulk, 2, 4).await?;
    for i in 0..300 {
        rig.publish_body(&row("S-deep", "deep-1", i, 300, None))
            .await?;
    }
    // Once the first two calls are registered, the batch's ETA counts 50 rows to a permit.
    let batch = turnstile_core::domain::BatchId::parse("deep-1").unwrap();
    let report = loop {
        let report = turnstile_upload::progress::read_batch(&rig.admin(), &rig.records(), &batch)
            .await?
            .expect("the batch is recorded");
        if report.registered >= 100 {
            break report;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let waiting = report.waiting.unwrap_or(0);
    let eta = report.eta_s.unwrap_or(f64::MAX);
    println!(
        "with {} registered and {waiting} waiting, the batch's eta_s is {eta:.2}",
        report.registered
    );
    assert!(waiting >= 50, "read while rows wait: {report:?}");
    assert!(
        eta <= (waiting.div_ceil(50) as f64) * 1.2 + 1.0,
        "{waiting} rows at 50 to a call and 2 calls/1s: {report:?}"
    );
    let stats = rig.wait_registered(300).await?;
    results.until(300).await;
    let seller = &stats.sellers["S-deep"];
    println!(
        "300 rows at 2 calls/1s, 50 per call: {}; the first to the last registration {} ms \
         (6 calls need 2,000 ms; one row per call 149,500 ms)",
        calls_and_rows(&stats),
        seller.last_ms.unwrap_or(0) - seller.first_ms.unwrap_or(0)
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(seller.registered, 300);
    assert!(
        stats.requests <= 30,
        "rows shared calls under the limit: {stats:?}"
    );
    assert_each_row_has_its_own_entry(&results, 300);
    rig.stop_replicas().await?;
    assert_eq!(rig.dead_lettered().await?, 0);
    rig.cleanup().await
}

/// Whole-call answers apply to every row: an API that allows fewer calls than the replicas
/// are told (429s with Retry-After) pauses the seller and every row of the call waits, and a
/// whole-call 503 retries every row of the call. Every row is registered once, none lost.
#[tokio::test]
async fn a_whole_call_429_or_503_applies_to_every_row_and_every_row_is_registered_once()
-> anyhow::Result<()> {
    let mock = MockArgs {
        bulk: Some(BulkCount::Call),
        bulk_items: Some("items".into()),
        ..MockArgs::local(limits("2/1s"))
    };
    let mut rig = support::rig("bulk-whole", "20/1s")
        .with_mock(mock)
        .with_api_limit(limits("2/1s"))
        .prepare()
        .await?;
    let results = Results::listen(&rig).await;
    let file = RoutesFile::bulk(
        "bulk-whole",
        r#"max_rows = 10, linger = "50ms", cost = "call", items = "items", id_field = "message_id""#,
    );
    let mut settings = rig.settings(4);
    settings.routes.file = Some(file.0.clone());
    rig.start_replica(settings).await?;
    for i in 0..40 {
        // Row 5's first call is answered 503 whole, row 25's first two.
        let mock = match i {
            5 => Some(json!({"statuses": [200], "garble": 1, "whole": 503})),
            25 => Some(json!({"statuses": [200], "garble": 2, "whole": 503})),
            _ => None,
        };
        rig.publish_body(&row("S-whole", "whole", i, 40, mock))
            .await?;
    }
    let stats = rig.wait_registered(40).await?;
    results.until(40).await;
    println!(
        "40 rows, 10 per call, told 20/1s, the API allows 2/1s and fails three calls: {}; \
         {} answered 503 whole",
        calls_and_rows(&stats),
        stats.scripted
    );
    assert_eq!(stats.sellers["S-whole"].registered, 40);
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(stats.scripted, 3, "{stats:?}");
    assert!(
        stats.violations > 0,
        "the API's own limit answered 429s: {stats:?}"
    );
    assert_each_row_has_its_own_entry(&results, 40);
    assert_eq!(results.all().len(), 40, "one result per row");
    rig.stop_replicas().await?;
    assert_eq!(rig.dead_lettered().await?, 0);
    rig.cleanup().await
}
