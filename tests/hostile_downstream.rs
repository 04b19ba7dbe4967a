//! What the downstream answers is untrusted too: redirects, endless or absurd Retry-After, and
//! seller ids that would change the URL's structure.
mod support;

use std::time::Duration;

use serde_json::json;
use support::eventually;
use turnstile_core::broker::{header_str, headers};
use turnstile_core::domain::SellerId;

fn reason_and_detail(d: &lapin::message::Delivery) -> (String, String) {
    (
        header_str(d, headers::REASON).unwrap_or_default(),
        header_str(d, headers::DETAIL).unwrap_or_default(),
    )
}

#[tokio::test]
async fn a_redirect_is_never_followed_but_dead_lettered_with_its_location() -> anyhow::Result<()> {
    let mut rig = support::rig("redirect", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    rig.publish_product(
        "S-sso",
        "m-redirected",
        json!({"mock": {"statuses": [302]}}),
    )
    .await?;
    let dead = rig.dead_letters(1).await?;
    let (reason, detail) = reason_and_detail(&dead[0]);
    let stats = rig.mock.stats();
    rig.stop_replicas().await?;
    assert_eq!(reason, "rejected");
    assert!(
        detail.contains("HTTP 302") && detail.contains("/login"),
        "{detail}"
    );
    assert_eq!(
        stats.requests, 1,
        "the login page was never asked: {stats:?}"
    );
    assert_eq!(rig.total(|s| &s.registered), 0);
    rig.cleanup().await
}

#[tokio::test]
async fn a_retry_after_of_years_pauses_the_seller_only_for_the_max_pause() -> anyhow::Result<()> {
    let mut rig = support::rig("retry-after", "100/1s").prepare().await?;
    let mut settings = rig.settings(2);
    settings.max_pause = Duration::from_secs(2);
    rig.start_replica(settings).await?;
    rig.publish_product(
        "S-years",
        "m-years",
        json!({"mock": {"statuses": [429, 200], "retry_after": "99999999"}}),
    )
    .await?;
    let store = rig.store();
    let seller = SellerId::parse("S-years").unwrap();
    eventually("the 429 paused the seller", || {
        rig.total(|s| &s.throttled) >= 1
    })
    .await;
    let paused = store.admin().paused_for(&seller).await.unwrap();
    assert!(paused <= Duration::from_secs(2), "paused for {paused:?}");
    let stats = rig.wait_registered(1).await?;
    rig.stop_replicas().await?;
    assert_eq!(stats.sellers["S-years"].registered, 1);
    rig.cleanup().await
}

#[tokio::test]
async fn a_downstream_that_throttles_forever_is_given_up_after_the_throttle_deadline()
-> anyhow::Result<()> {
    let mut rig = support::rig("throttle-deadline", "100/1s")
        .prepare()
        .await?;
    let mut settings = rig.settings(2);
    settings.max_pause = Duration::from_millis(300);
    settings.throttle_deadline = Duration::from_secs(2);
    rig.start_replica(settings).await?;
    rig.publish_product(
        "S-forever",
        "m-forever",
        json!({"mock": {"statuses": [429], "retry_after": "1"}}),
    )
    .await?;
    let dead = rig.dead_letters(1).await?;
    let (reason, detail) = reason_and_detail(&dead[0]);
    rig.stop_replicas().await?;
    assert_eq!(reason, "throttled", "{detail}");
    assert!(detail.contains("429"), "{detail}");
    rig.cleanup().await
}

#[tokio::test]
async fn seller_ids_never_change_the_url_structure() -> anyhow::Result<()> {
    let mut rig = support::rig("segments", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    for (i, seller) in ["..", "."].iter().enumerate() {
        rig.publish_product(seller, &format!("m-dots-{i}"), json!({}))
            .await?;
    }
    for seller in ["a/b", "a?b", "a#b", "%2e%2e", "..."] {
        rig.publish_product(seller, &format!("m-{seller}"), json!({}))
            .await?;
    }
    let dead = rig.dead_letters(2).await?;
    let stats = rig.wait_registered(5).await?;
    rig.stop_replicas().await?;
    for d in &dead {
        let (reason, detail) = reason_and_detail(d);
        assert_eq!(reason, "invalid-message", "{detail}");
        assert!(detail.contains("path segment"), "{detail}");
    }
    for seller in ["a/b", "a?b", "a#b", "%2e%2e", "..."] {
        let key = SellerId::parse(seller).unwrap().header_value();
        assert_eq!(
            stats.sellers.get(&key).map(|s| s.registered),
            Some(1),
            "{seller} reached its own path: {stats:?}"
        );
    }
    rig.cleanup().await
}
