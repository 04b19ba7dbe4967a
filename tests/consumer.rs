//! The consumer pipeline end to end: real RabbitMQ and Redis, a strict mock downstream.
mod support;

use std::time::Duration;

use serde_json::json;
use turnstile_core::broker::{header_str, header_u64, headers};

#[tokio::test]
async fn several_replicas_register_every_message_exactly_once_within_the_limit()
-> anyhow::Result<()> {
    let mut rig = support::rig("replicas", "10/1s").prepare().await?;
    rig.publish("big", 45).await?;
    for s in 0..8 {
        rig.publish(&format!("small-{s}"), 4).await?;
    }
    rig.start_replicas(3, 4).await?;
    let stats = rig.wait_registered(45 + 32).await?;
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(stats.registered, 77);
    assert_eq!(stats.sellers["big"].registered, 45);
    for s in 0..8 {
        assert_eq!(stats.sellers[&format!("small-{s}")].registered, 4);
    }
    rig.stop_replicas().await?;
    assert_eq!(
        rig.depth(rig.topology.work()).await?,
        0,
        "nothing left in the work queue"
    );
    assert_eq!(
        rig.depth(rig.topology.dead()).await?,
        0,
        "nothing dead-lettered"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn a_2xx_is_acked_and_a_redelivered_registered_message_is_not_called_again()
-> anyhow::Result<()> {
    let mut rig = support::rig("ok", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    rig.publish_product("S-1", "m-1", json!({"sku": "A"}))
        .await?;
    rig.wait_settled_registered(1).await?;
    // The same message again (a redelivery after a lost ack looks like this): acked, not called.
    rig.publish_product("S-1", "m-1", json!({"sku": "A"}))
        .await?;
    rig.publish_product("S-1", "m-2", json!({"sku": "B"}))
        .await?;
    rig.wait_settled_registered(2).await?;
    while rig.total(|s| &s.already_done) < 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rig.stop_replicas().await?;
    let stats = rig.mock.stats();
    assert_eq!(stats.requests, 2, "m-1 was called once: {stats:?}");
    assert_eq!(stats.duplicates, 0);
    assert_eq!(rig.depth(rig.topology.work()).await?, 0);
    rig.cleanup().await
}

#[tokio::test]
async fn a_429_pauses_the_seller_and_delays_the_message_without_counting_an_attempt()
-> anyhow::Result<()> {
    let mut rig = support::rig("throttled", "100/1s").prepare().await?;
    let mut settings = rig.settings(2);
    settings.max_attempts = 1; // a counted attempt would dead-letter at once
    rig.start_replica(settings).await?;
    rig.publish_product(
        "S-429",
        "m-429",
        json!({"mock": {"statuses": [429, 200], "retry_after": "1"}}),
    )
    .await?;
    let stats = rig.wait_registered(1).await?;
    assert_eq!(stats.scripted, 1, "one 429 answered: {stats:?}");
    assert_eq!(stats.violations, 0);
    rig.stop_replicas().await?;
    assert_eq!(rig.depth(rig.topology.dead()).await?, 0);
    rig.cleanup().await
}

#[tokio::test]
async fn a_503_is_retried_with_backoff_and_then_registered() -> anyhow::Result<()> {
    let mut rig = support::rig("retry", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    rig.publish_product(
        "S-503",
        "m-503",
        json!({"mock": {"statuses": [503, 503, 200]}}),
    )
    .await?;
    let stats = rig.wait_registered(1).await?;
    assert_eq!(stats.scripted, 2, "{stats:?}");
    rig.stop_replicas().await?;
    rig.cleanup().await
}

#[tokio::test]
async fn failures_past_the_attempt_limit_are_dead_lettered_with_the_reason() -> anyhow::Result<()> {
    let mut rig = support::rig("exhausted", "100/1s").prepare().await?;
    let mut settings = rig.settings(2);
    settings.max_attempts = 3;
    settings.downstream.timeout = Duration::from_millis(300);
    rig.start_replica(settings).await?;
    rig.publish_product("S-down", "m-503", json!({"mock": {"statuses": [503]}}))
        .await?;
    rig.publish_product(
        "S-down",
        "m-slow",
        json!({"mock": {"statuses": [200], "delay_ms": 2000}}),
    )
    .await?;
    let mut dead = rig.dead_letters(2).await?;
    dead.sort_by_key(|d| header_str(d, headers::DETAIL));
    for d in &dead {
        assert_eq!(
            header_str(d, headers::REASON).as_deref(),
            Some("attempts-exhausted")
        );
        assert_eq!(
            header_u64(d, headers::ATTEMPT),
            Some(2),
            "attempts before the last"
        );
    }
    assert!(
        header_str(&dead[0], headers::DETAIL)
            .unwrap()
            .contains("HTTP 503")
    );
    assert!(
        header_str(&dead[1], headers::DETAIL)
            .unwrap()
            .contains("timeout")
    );
    let body: serde_json::Value = serde_json::from_slice(&dead[0].data).unwrap();
    assert_eq!(
        body["message_id"], "m-503",
        "the dead letter keeps its body"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn a_400_is_dead_lettered_at_once_with_status_and_body() -> anyhow::Result<()> {
    let mut rig = support::rig("rejected", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    rig.publish_product("S-bad", "m-400", json!({"mock": {"statuses": [400]}}))
        .await?;
    let dead = rig.dead_letters(1).await?;
    assert_eq!(
        header_str(&dead[0], headers::REASON).as_deref(),
        Some("rejected")
    );
    let detail = header_str(&dead[0], headers::DETAIL).unwrap();
    assert!(
        detail.starts_with("HTTP 400: ") && detail.contains("scripted"),
        "{detail}"
    );
    assert_eq!(rig.mock.stats().requests, 1, "called once, not retried");
    rig.cleanup().await
}

#[tokio::test]
async fn invalid_messages_are_dead_lettered_with_the_reason_and_the_replica_goes_on()
-> anyhow::Result<()> {
    let mut rig = support::rig("invalid", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    let bad: Vec<&[u8]> = vec![
        b"",
        b"not json",
        b"[1]",
        br#"{"product":{}}"#,
        br#"{"seller_id":"S"}"#,
        b"\xff\xfe",
    ];
    for body in &bad {
        rig.publish_body(body).await?;
    }
    rig.publish("S-good", 1).await?;
    let dead = rig.dead_letters(bad.len()).await?;
    for d in &dead {
        assert_eq!(
            header_str(d, headers::REASON).as_deref(),
            Some("invalid-message")
        );
        assert!(!header_str(d, headers::DETAIL).unwrap().is_empty());
    }
    rig.wait_registered(1).await?;
    rig.cleanup().await
}

#[tokio::test]
async fn weighed_messages_under_a_stack_register_within_every_limit_and_a_cost_that_never_fits_is_dead_lettered()
-> anyhow::Result<()> {
    let mut rig = support::rig("weighed", "4/1s,10/3s").prepare().await?;
    for i in 0..12u32 {
        rig.publish_weighed(
            "S-heavy",
            &format!("heavy-{i}"),
            i % 3 + 1,
            json!({ "sku": i }),
        )
        .await?;
    }
    rig.publish_weighed("S-heavy", "too-heavy", 5, json!({"sku": "big"}))
        .await?;
    for i in 0..3 {
        rig.publish_weighed("S-light", &format!("light-{i}"), 1, json!({ "sku": i }))
            .await?;
    }
    rig.start_replicas(2, 3).await?;
    let stats = rig.wait_registered(15).await?;
    let dead = rig.dead_letters(1).await?;
    assert_eq!(
        header_str(&dead[0], headers::REASON).as_deref(),
        Some("invalid-message")
    );
    let detail = header_str(&dead[0], headers::DETAIL).unwrap();
    assert_eq!(
        detail,
        "cost 5 exceeds what the seller's limit 4/1s,10/3s can ever grant to one call: at most 4, \
         the smallest COUNT"
    );
    assert_eq!(
        stats.violations, 0,
        "no window of either limit overfull: {stats:?}"
    );
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(stats.sellers["S-heavy"].units, 4 * (1 + 2 + 3));
    assert!(stats.sellers["S-heavy"].max_in_window <= 4, "{stats:?}");
    assert_eq!(stats.sellers["S-light"].units, 3);
    rig.cleanup().await
}

#[tokio::test]
async fn a_rig_dropped_without_cleanup_leaves_no_queue_and_no_key_behind() -> anyhow::Result<()> {
    let mut rig = support::rig("dropped", "5/1s").prepare().await?;
    rig.publish("S-dropped", 20).await?;
    rig.start_replicas(1, 2).await?;
    rig.wait_registered(3).await?;
    let (work, prefix) = (rig.topology.work().to_owned(), rig.key_prefix.clone());
    let redis = support::Backend::Standalone.connect().await;
    let everything = turnstile_core::permit::Keyspace::new(&prefix).everything();
    assert!(
        !turnstile_core::permit::keys_matching(&redis, &everything)
            .await?
            .is_empty()
    );

    rig.stop_replicas().await?;
    drop(rig); // as a test that fails half-way does

    let connection = turnstile_core::broker::connect(&support::broker::amqp_url(), "check").await?;
    let channel = connection.create_channel().await?;
    let depth = turnstile_core::broker::depth(&channel, &work).await;
    assert!(
        depth.is_err(),
        "the work queue {work} is still there: {depth:?}"
    );
    let left = turnstile_core::permit::keys_matching(&redis, &everything).await?;
    assert!(left.is_empty(), "keys left behind: {left:?}");
    Ok(())
}
