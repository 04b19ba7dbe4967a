//! A slow link to Redis (a fixed latency each way, through `turnstile_lab::slow_link`): a
//! backlog still drains, at the limit's pace plus the latency, and small sellers are not held
//! up beyond it. The figures are printed beside the optimum; what is asserted is that everything
//! registers, within the limit, once.
mod support;

use std::time::{Duration, Instant};

use turnstile_lab::local_redis::LocalRedis;
use turnstile_lab::slow_link::SlowLink;

/// A seller's backlog of 100 at 20/1s (optimum about 5 s) and ten small sellers of 3 messages,
/// through a link to Redis with `round_trip` of latency.
async fn drains_through_a_slow_link(round_trip: Duration) {
    let redis = LocalRedis::start().unwrap();
    let target = format!("127.0.0.1:{}", redis.port()).parse().unwrap();
    let link = SlowLink::start(target, round_trip / 2).await.unwrap();
    let mut rig = support::rig("slow-redis", "20/1s")
        .on_redis(&link.redis_url())
        .prepare()
        .await
        .unwrap();
    rig.start_replica(rig.settings(16)).await.unwrap();
    let started = Instant::now();
    let published_ms = rig.mock.stats().now_ms;
    rig.publish("S-big", 100).await.unwrap();
    for i in 0..10 {
        rig.publish(&format!("S-small-{i}"), 3).await.unwrap();
    }
    let stats = rig.wait_registered(130).await.unwrap();
    let drained = started.elapsed();
    rig.wait_settled_registered(130).await.unwrap();
    let small_last_ms = (0..10)
        .filter_map(|i| stats.sellers[&format!("S-small-{i}")].last_ms)
        .max()
        .unwrap_or(0)
        .saturating_sub(published_ms);
    let big = &stats.sellers["S-big"];
    let big_ms = big.last_ms.unwrap_or(0) - big.first_ms.unwrap_or(0);
    println!(
        "round trip {round_trip:?}: S-big's 100 at 20/1s took {:.1} s from its first call \
         (optimum 4.95 s: {:.2}x; {:.2}x with one round trip per window added), all drained in \
         {drained:.1?}; the small sellers' last call {:.1} s after publishing; violations {}, duplicates {}, \
         deliveries {}",
        big_ms as f64 / 1000.0,
        big_ms as f64 / 4950.0,
        big_ms as f64 / (4950.0 + 5.0 * round_trip.as_millis() as f64),
        small_last_ms as f64 / 1000.0,
        stats.violations,
        stats.duplicates,
        rig.total(|s| &s.deliveries),
    );
    assert_eq!(
        (stats.registered, stats.violations, stats.duplicates),
        (130, 0, 0),
        "{stats:?}"
    );
    link.set_one_way(Duration::ZERO);
    rig.stop_replicas().await.unwrap();
    rig.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_backlog_drains_through_a_200_ms_round_trip_to_redis() {
    drains_through_a_slow_link(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn a_backlog_drains_through_a_500_ms_round_trip_to_redis() {
    drains_through_a_slow_link(Duration::from_millis(500)).await;
}
