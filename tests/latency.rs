//! Exact whatever the latency: a call holds its place in the seller's window from its grant
//! until its answer, so a request that reaches the API late (a new connection, a handshake, a
//! pause) never makes the API count more than the limit in any window.
mod support;

use turnstile_core::config::Algorithm;
use turnstile_lab::mock_api::MockArgs;

/// One request in ten reaches the strict mock 400 ms late (it counts the request only then),
/// at 20/1s with 2 replicas of 4 workers: the mock never sees more than 20 in a second.
async fn late_arrivals(algorithm: Algorithm) -> anyhow::Result<()> {
    let mock = MockArgs {
        slow_rate: 0.1,
        slow_ms: 400,
        ..MockArgs::local("20/1s".parse::<turnstile_core::config::Limits>().unwrap())
    };
    let mut rig = support::rig(&format!("late-{algorithm}"), "20/1s")
        .with_mock(mock)
        .with_algorithm(algorithm)
        .prepare()
        .await?;
    let settings = rig.settings(4);
    rig.start_replica(settings.clone()).await?;
    rig.start_replica(settings).await?;
    rig.publish("S-late", 200).await?;
    let stats = rig.wait_registered(200).await?;
    rig.stop_replicas().await?;
    let seller = &stats.sellers["S-late"];
    println!(
        "{algorithm}: 200 at 20/1s, 1 in 10 requests 400 ms late: {} violations, at most {} \
         in a window, drained in {} ms",
        stats.violations,
        seller.max_in_window,
        seller.last_ms.unwrap_or(0) - seller.first_ms.unwrap_or(0)
    );
    assert_eq!(stats.violations, 0, "{algorithm}: {stats:?}");
    assert_eq!(stats.duplicates, 0, "{algorithm}: {stats:?}");
    rig.cleanup().await
}

#[tokio::test]
async fn requests_that_reach_the_api_late_never_push_a_window_over_the_limit() -> anyhow::Result<()>
{
    for algorithm in [Algorithm::SlidingWindow, Algorithm::Gcra] {
        late_arrivals(algorithm).await?;
    }
    Ok(())
}
