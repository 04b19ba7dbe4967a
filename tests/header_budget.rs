//! A message's headers get a budget: the broker's frame_max bounds a content header frame, and
//! every copy turnstile republishes (a ladder hop, a delayed copy, a dead letter) adds headers
//! of its own. A message whose copy could not be sent within the frame is dead-lettered at its
//! first delivery, before any permit, without its foreign headers; it never costs a connection,
//! a reservation or a copy in the delay ladder, and `dead-letters list` reads it back.
mod support;

use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;
use support::broker::TestBroker;
use turnstile_core::broker::{self, QueueType, dead_letters, header_str, headers, long_string};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{Ask, Limiter};
use turnstile_core::trace::{TRACEPARENT, TraceContext};

/// A foreign header this long fits the broker's frame_max (131,072 bytes) as published, and
/// leaves fewer bytes than any copy of it adds.
const BLOB: usize = 130_900;

const BLOB_HEADER: &str = "x-producer-blob";

fn body(seller: &str, id: &str) -> Vec<u8> {
    json!({"message_id": id, "seller_id": seller, "product": {"id": id}})
        .to_string()
        .into_bytes()
}

/// The headers of the oversized message: the blob and a trace context.
fn big_headers(trace: &TraceContext) -> Vec<(&'static str, AMQPValue)> {
    vec![
        (BLOB_HEADER, long_string(&"b".repeat(BLOB))),
        (TRACEPARENT, long_string(&trace.traceparent())),
    ]
}

/// Takes `seller`'s next permits out of the downstream's sight (the limit's worth, then
/// reservations up to about `ahead` windows): the messages published next wait seconds for
/// their slots, through the delay ladder.
async fn throttle(rig: &turnstile_lab::rig::Rig, seller: &str, ahead: usize) -> anyhow::Result<()> {
    let store = rig.store();
    let seller = SellerId::parse(seller).map_err(|e| anyhow::anyhow!("{e}"))?;
    for _ in 0..ahead {
        store.ask(Ask::new(&seller)).await?;
    }
    Ok(())
}

fn header_names(delivery: &Delivery) -> Vec<String> {
    delivery
        .properties
        .headers()
        .as_ref()
        .map(|t| t.inner().keys().map(|k| k.to_string()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_copy_would_exceed_the_frame_is_dead_lettered_once_and_costs_no_connection()
-> anyhow::Result<()> {
    let mut rig = support::rig("big-headers", "5/2s").prepare().await?;
    let seller = "S-big";
    throttle(&rig, seller, 20).await?;
    for i in 0..5 {
        rig.publish_product(seller, &format!("before-{i}"), json!({"sku": i}))
            .await?;
    }
    let trace = TraceContext::start();
    rig.publish_with_headers(&body(seller, "big"), &big_headers(&trace))
        .await?;
    for i in 0..5 {
        rig.publish_product(seller, &format!("after-{i}"), json!({"sku": i}))
            .await?;
    }
    let started = std::time::Instant::now();
    rig.start_replicas(1, 4).await?;
    rig.wait(std::time::Duration::from_secs(300), |_| {})
        .await?;
    let took = started.elapsed();
    let stats = rig.mock.stats();
    let reconnects = rig.total(|s| &s.reconnects);
    let dead_lettered = rig.total(|s| &s.dead_lettered);
    rig.stop_replicas().await?;
    let mut left = Vec::new();
    for queue in rig.topology.queues() {
        let depth = rig.depth(&queue).await?;
        if depth > 0 {
            left.push((queue, depth));
        }
    }
    println!(
        "big headers, after {took:?}: {} registered, {} violations, {} duplicates, \
         {dead_lettered} dead-lettered by the replica, {reconnects} reconnects, left {left:?}",
        stats.registered, stats.violations, stats.duplicates,
    );
    assert_eq!(reconnects, 0, "the replica's connection was never lost");
    assert_eq!(stats.sellers[seller].registered, 10, "{stats:?}");
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(dead_lettered, 1, "dead-lettered once");
    assert_eq!(
        left,
        [(rig.topology.dead().to_owned(), 1)],
        "one dead letter, nothing else left behind"
    );
    let dead = rig.dead_letters(1).await?;
    let letter = &dead[0];
    let reason = header_str(letter, headers::REASON);
    let detail = header_str(letter, headers::DETAIL).unwrap_or_default();
    assert_eq!(reason.as_deref(), Some("invalid-message"));
    assert!(detail.starts_with("headers too large"), "{detail}");
    assert_eq!(letter.data, body(seller, "big"), "the body is kept");
    let names = header_names(letter);
    assert!(!names.iter().any(|n| n == BLOB_HEADER), "{names:?}");
    assert_eq!(
        header_str(letter, TRACEPARENT),
        Some(trace.traceparent()),
        "the trace headers are kept"
    );
    rig.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_list_returns_a_message_dead_lettered_for_its_headers() -> anyhow::Result<()> {
    let mut rig = support::rig("big-list", "5/2s").prepare().await?;
    throttle(&rig, "S-list", 20).await?;
    rig.publish("S-list", 3).await?;
    let trace = TraceContext::start();
    rig.publish_with_headers(&body("S-list", "big"), &big_headers(&trace))
        .await?;
    rig.start_replicas(1, 4).await?;
    rig.wait(std::time::Duration::from_secs(300), |_| {})
        .await?;
    rig.stop_replicas().await?;
    let channel = rig.connection().create_channel().await?;
    let listed = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        dead_letters::list(&channel, &rig.topology, &dead_letters::Selection::all()),
    )
    .await
    .map_err(|_| anyhow::anyhow!("dead-letters list hung"))??;
    println!("listed: {listed:?}");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].reason, "invalid-message");
    assert_eq!(listed[0].message_id.as_deref(), Some("big"));
    assert!(
        listed[0].detail.starts_with("headers too large"),
        "{listed:?}"
    );
    // Listing hands each letter back (a nack with requeue), which the broker may count a
    // moment later.
    let mut left = rig.dead_lettered().await?;
    for _ in 0..100 {
        if left == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        left = rig.dead_lettered().await?;
    }
    assert_eq!(left, 1, "listing leaves it there");
    rig.cleanup().await
}

/// A dead letter the broker made itself from a message published at the limit (an operator's
/// TTL, here 0, moved it with `x-death` added), larger than the frame: no AMQP client can receive
/// it. The listing fails at once, saying why, instead of hanging, and the dead letter stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_larger_than_the_frame_fails_the_listing_with_the_reason()
-> anyhow::Result<()> {
    let broker = TestBroker::new("big-expired", QueueType::Quorum).await;
    let expiring = format!("{}.expiring", broker.queue());
    let channel = broker.connection.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(0));
    args.insert("x-dead-letter-exchange".into(), long_string(""));
    args.insert(
        "x-dead-letter-routing-key".into(),
        long_string(broker.topology.dead()),
    );
    channel
        .queue_declare(
            expiring.as_str().into(),
            QueueDeclareOptions::default(),
            args,
        )
        .await?;
    let mut headers = FieldTable::default();
    headers.insert(BLOB_HEADER.into(), long_string(&"b".repeat(BLOB)));
    let properties = BasicProperties::default().with_headers(headers);
    broker
        .publisher
        .publish("", &expiring, &body("S-expired", "big"), properties)
        .await?;
    support::eventually_async("the broker dead-letters it", async || {
        broker.depth(broker.topology.dead()).await == 1
    })
    .await;
    let reader = broker::connect(&support::broker::amqp_url(), "turnstile test list").await?;
    let reading = reader.create_channel().await?;
    let listed = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        dead_letters::list(&reading, &broker.topology, &dead_letters::Selection::all()),
    )
    .await
    .map_err(|_| anyhow::anyhow!("dead-letters list hung"))?;
    let error = format!("{:#}", listed.expect_err("no client can receive it"));
    println!("listing a dead letter larger than the frame: {error}");
    assert!(error.contains("frame_max"), "{error}");
    assert_eq!(broker.depth(broker.topology.dead()).await, 1, "it stays");
    channel
        .queue_delete(expiring.as_str().into(), QueueDeleteOptions::default())
        .await?;
    broker.cleanup().await;
    Ok(())
}
