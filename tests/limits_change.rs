//! A seller's terms changed at runtime (`limits set`, `limits clear`, `limits resume`) apply at
//! once to its whole backlog, including the messages waiting in the delay ladder and those held
//! in the replicas for slots reserved under the old terms.
mod support;

use std::time::Duration;

use support::eventually;
use turnstile_core::config::Algorithm;
use turnstile_core::domain::SellerId;
use turnstile_core::permit::PermitStore;

/// The latest slot reserved for the seller (Redis time, µs), or none.
async fn last_reserved_slot(store: &PermitStore, seller: &SellerId) -> Option<i64> {
    let mut conn = redis::Client::open(support::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let last: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(store.keys().reserved(seller, store.algorithm()))
        .arg(-1)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .unwrap();
    last.first().map(|(_, slot)| *slot as i64)
}

/// 150 messages of one seller at 5/1s (an override; the API itself allows 50/1s). Once 10 are
/// registered the override is raised to 50/1s: the rest, most of them in the delay ladder with
/// slots up to ~28 s ahead, must all be registered before the last slot the old limit had
/// reserved — they come back at once and reserve anew under the new limit.
async fn raised_mid_backlog(algorithm: Algorithm) -> anyhow::Result<()> {
    let mut rig = support::rig(&format!("raise-{algorithm}"), "50/1s")
        .with_algorithm(algorithm)
        .prepare()
        .await?;
    let settings = rig.settings(4);
    let store = rig.store();
    let seller = SellerId::parse("S-raised").unwrap();
    store
        .admin()
        .set_limit(
            &seller,
            "5/1s".parse::<turnstile_core::config::Limits>().unwrap(),
        )
        .await
        .unwrap();
    rig.start_replica(settings.clone()).await?;
    rig.start_replica(settings).await?;
    rig.publish("S-raised", 150).await?;
    eventually("10 registered under 5/1s", || {
        rig.mock.stats().registered >= 10
    })
    .await;
    eventually("the backlog is reserved", || {
        rig.total(|s| &s.delayed) >= 100
    })
    .await;
    let old_end = last_reserved_slot(&store, &seller)
        .await
        .expect("slots reserved under 5/1s");
    let raised_at = store.admin().redis_time_us().await.unwrap();
    store
        .admin()
        .set_limit(
            &seller,
            "50/1s".parse::<turnstile_core::config::Limits>().unwrap(),
        )
        .await
        .unwrap();
    let stats = rig.wait_registered(150).await?;
    let done_at = store.admin().redis_time_us().await.unwrap();
    let released: u64 = rig
        .replicas()
        .map(|r| {
            r.stats
                .ladder
                .released
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    let deliveries = rig.total(|s| &s.deliveries);
    rig.stop_replicas().await?;
    println!(
        "{algorithm}: raised 5/1s -> 50/1s with the old schedule ending {:.1} s later: all 150 \
         registered {:.1} s after the raise; {released} ladder messages released early, \
         {:.2} deliveries per message, {stats:?}",
        (old_end - raised_at) as f64 / 1e6,
        (done_at - raised_at) as f64 / 1e6,
        deliveries as f64 / 150.0,
    );
    assert!(
        done_at < old_end,
        "{algorithm}: the backlog waited for its old slots ({} s after the raise, old end {} s)",
        (done_at - raised_at) / 1_000_000,
        (old_end - raised_at) / 1_000_000
    );
    assert!(released > 0, "{algorithm}: no ladder message was released");
    assert_eq!(stats.duplicates, 0, "{algorithm}: {stats:?}");
    if algorithm.is_exact() {
        assert_eq!(stats.violations, 0, "{algorithm}: {stats:?}");
    }
    rig.cleanup().await
}

#[tokio::test]
async fn a_limit_raised_mid_backlog_reaches_every_delayed_message_at_once() -> anyhow::Result<()> {
    for algorithm in Algorithm::ALL {
        raised_mid_backlog(algorithm).await?;
    }
    Ok(())
}

/// A paused seller's delayed messages come back as soon as the pause is lifted, not at the
/// slots they had reserved after the end of the (one-hour) pause.
#[tokio::test]
async fn a_lifted_pause_brings_the_delayed_messages_back_at_once() -> anyhow::Result<()> {
    let mut rig = support::rig("resumed", "100/1s").prepare().await?;
    let store = rig.store();
    let seller = SellerId::parse("S-resumed").unwrap();
    store
        .pause(&seller, Duration::from_secs(3600))
        .await
        .unwrap();
    rig.start_replicas(2, 2).await?;
    rig.publish("S-resumed", 5).await?;
    eventually("the messages wait", || rig.total(|s| &s.delayed) >= 5).await;
    assert!(
        store.admin().resume(&seller).await.unwrap(),
        "it was paused"
    );
    assert_eq!(
        store.admin().paused_for(&seller).await.unwrap(),
        Duration::ZERO
    );
    let stats = rig.wait_registered(5).await?;
    rig.stop_replicas().await?;
    assert_eq!((stats.violations, stats.duplicates), (0, 0), "{stats:?}");
    rig.cleanup().await
}
