//! A message coming back from the delay ladder for its slot is not queued behind the work
//! queue's backlog. Its own test binary: it keeps the (shared, 2-core) machine busy with
//! a backlog of thousands of messages.
mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use turnstile_lab::mock_api::MockArgs;
use turnstile_lab::rig::{Message, registration_body};

/// Messages of the seller whose backlog waits through the delay ladder (2/2s: all but the
/// first two wait longer than the hold, 2 s).
const RETURNING: usize = 12;
/// Other sellers, with two messages each (within their limit: none of them waits).
const OTHER_SELLERS: usize = 3_000;

/// One seller's messages go through the delay ladder while 6,000 other messages wait in the
/// work queue behind them, drained slowly (a downstream answering in 50 ms, one replica with 4
/// workers: at most 80 calls/s, so the backlog takes over a minute). The returning seller's
/// slots are all due within about 11 s. If a message coming back from the ladder were
/// published to the tail of the work queue, it would reach a worker only after the backlog in
/// front of it, late for its slot: the seller would finish when the work queue is (nearly)
/// empty. Coming back through the return queue, the seller finishes while most of the
/// backlog still waits: an ordering fact, whatever the machine's speed (a slower machine
/// drains the backlog more slowly still).
#[tokio::test]
async fn delayed_messages_come_back_in_time_while_the_work_queue_is_deep() -> anyhow::Result<()> {
    let mut rig = support::rig("deep", "2/2s")
        .with_mock(MockArgs {
            latency_ms: 50,
            ..MockArgs::local("2/2s".parse::<turnstile_core::config::Limits>()?)
        })
        .prepare()
        .await?;
    let message = |seller: &str, id: String| Message {
        seller: seller.to_owned(),
        body: registration_body(&id, seller, None, serde_json::json!({"sku": 1})),
    };
    // The returning seller's messages first: the replica takes them at once and sends all but
    // two through the ladder; the backlog is then in the work queue behind them.
    let mut messages: Vec<Message> = (0..RETURNING)
        .map(|i| message("S-returning", format!("S-returning-{i}")))
        .collect();
    for s in 0..OTHER_SELLERS {
        for i in 0..2 {
            messages.push(message(&format!("S-{s}"), format!("S-{s}-{i}")));
        }
    }
    let backlog = (OTHER_SELLERS * 2) as u32;
    rig.publish_all(messages).await?;
    // The default prefetch (64, sixteen deliveries per worker): a returning message neither
    // waits behind the work queue's backlog (its own queue) nor for a worker behind the
    // deliveries already in the replica (the due lane).
    let settings = rig.settings(4);
    rig.start_replica(settings).await?;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let finished = loop {
        let stats = rig.mock.stats();
        let returning = stats.sellers.get("S-returning").map_or(0, |s| s.registered);
        if returning >= RETURNING as u64 {
            break stats;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {returning} of {RETURNING} registered: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let waiting = rig.depth(rig.topology.work()).await?;
    let others = finished.registered - RETURNING as u64;
    let parked: u64 = rig
        .replicas()
        .map(|r| r.stats.ladder.deliveries.load(Ordering::Relaxed))
        .sum();
    let forfeited = rig.total(|s| &s.forfeited);
    println!(
        "the returning seller's {RETURNING} messages registered {:.1} s after its first, with \
         {waiting} of {backlog} other messages still in the work queue ({others} registered); \
         {} violations, {parked} ladder deliveries, {forfeited} reserved slots forfeited",
        finished.sellers["S-returning"]
            .last_ms
            .zip(finished.sellers["S-returning"].first_ms)
            .map_or(f64::NAN, |(last, first)| (last - first) as f64 / 1000.0),
        finished.violations
    );
    assert_eq!(finished.violations, 0, "{finished:?}");
    assert!(
        parked > 0,
        "the returning seller's messages went through the ladder"
    );
    assert!(
        waiting > backlog / 2,
        "the returning seller finished only after the backlog in front of its returns: \
         {waiting} of {backlog} left"
    );
    rig.cleanup().await
}
