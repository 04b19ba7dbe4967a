//! The mock registration API, in-process on a free port: limits, duplicates, scripts, failures.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use turnstile_lab::mock_api::{MockArgs, MockServer, Stats, fetch_stats};

struct Mock {
    server: MockServer,
    shutdown: CancellationToken,
    client: reqwest::Client,
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn mock(limit: &str) -> Mock {
    mock_with(limit, 0.0).await
}

async fn mock_with(limit: &str, fail_rate: f64) -> Mock {
    let args = MockArgs {
        limit: limit.parse().unwrap(),
        addr: "127.0.0.1:0".parse().unwrap(),
        fail_rate,
        ..MockArgs::local(limit.parse::<turnstile_core::config::Limits>().unwrap())
    };
    let shutdown = CancellationToken::new();
    let server = MockServer::start(args, shutdown.clone()).await.unwrap();
    Mock {
        server,
        shutdown,
        client: reqwest::Client::new(),
    }
}

impl Mock {
    fn register_url(&self, seller: &str) -> String {
        self.server.url().replace("{seller_id}", seller)
    }

    async fn register(&self, seller: &str, key: &str, product: Value) -> reqwest::Response {
        self.client
            .post(self.register_url(seller))
            .header("Idempotency-Key", key)
            .header("X-Seller-Id", seller)
            .json(&product)
            .send()
            .await
            .unwrap()
    }

    async fn status_of(&self, seller: &str, key: &str) -> StatusCode {
        self.register(seller, key, json!({"sku": key}))
            .await
            .status()
    }

    fn stats(&self) -> Stats {
        self.server.stats()
    }
}

fn retry_after(response: &reqwest::Response) -> Option<u64> {
    response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

#[tokio::test]
async fn it_accepts_count_registrations_then_refuses_with_retry_after_and_counts_a_violation() {
    let mock = mock("3/10s").await;
    for key in ["k1", "k2", "k3"] {
        let response = mock.register("S-1", key, json!({"sku": key})).await;
        assert_eq!(response.status(), StatusCode::OK);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body, json!({"registered": true, "id": key}));
    }
    let refused = mock.register("S-1", "k4", json!({"sku": "k4"})).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let wait = retry_after(&refused).expect("a 429 carries Retry-After");
    assert!((1..=10).contains(&wait), "Retry-After {wait}");

    assert_eq!(mock.status_of("S-2", "other").await, StatusCode::OK);

    let stats = mock.stats();
    assert_eq!(
        (stats.requests, stats.registered, stats.violations),
        (5, 4, 1)
    );
    let s1 = &stats.sellers["S-1"];
    assert_eq!((s1.registered, s1.violations, s1.max_in_window), (3, 1, 3));
    assert!(s1.first_ms.unwrap() <= s1.last_ms.unwrap());
    let refused: Vec<&str> = s1.first_violations.iter().map(|v| v.key.as_str()).collect();
    assert_eq!(refused, ["k4"], "the refused request is named");
    assert!(s1.first_violations[0].at_ms >= s1.last_ms.unwrap());
    assert_eq!(stats.sellers["S-2"].violations, 0);
}

#[tokio::test]
async fn a_request_after_the_window_has_passed_is_accepted_again() {
    let mock = mock("3/300ms").await;
    for key in ["a", "b", "c"] {
        assert_eq!(mock.status_of("S", key).await, StatusCode::OK);
    }
    let refused = mock.register("S", "d", json!({})).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&refused), Some(1));

    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(mock.status_of("S", "d").await, StatusCode::OK);
    let stats = mock.stats();
    assert_eq!((stats.registered, stats.violations), (4, 1));
    assert_eq!(stats.sellers["S"].max_in_window, 3);
}

#[tokio::test]
async fn a_replayed_idempotency_key_is_answered_200_counted_as_duplicate_and_not_as_a_registration()
{
    let mock = mock("1/10s").await;
    assert_eq!(mock.status_of("S", "same").await, StatusCode::OK);
    let replay = mock.register("S", "same", json!({"sku": "same"})).await;
    assert_eq!(replay.status(), StatusCode::OK);
    let body: Value = replay.json().await.unwrap();
    assert_eq!(body, json!({"registered": true, "id": "same"}));
    assert_eq!(
        mock.status_of("S", "new").await,
        StatusCode::TOO_MANY_REQUESTS,
        "the replay did not take the window's only slot, the first registration did"
    );

    let stats = mock.stats();
    assert_eq!(
        (stats.registered, stats.duplicates, stats.violations),
        (1, 1, 1)
    );
    assert_eq!(stats.sellers["S"].duplicates, 1);
}

#[tokio::test]
async fn scripted_statuses_are_answered_in_order_and_the_last_one_repeats() {
    let mock = mock("10/10s").await;
    let product = json!({"sku": "x", "mock": {"statuses": [503, 429, 200], "retry_after": "2"}});

    let first = mock.register("S", "scripted", product.clone()).await;
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(retry_after(&first), None);
    let body: Value = first.json().await.unwrap();
    assert_eq!(body, json!({"error": "scripted 503"}));

    let second = mock.register("S", "scripted", product.clone()).await;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&second), Some(2));

    let third = mock.register("S", "scripted", product.clone()).await;
    assert_eq!(third.status(), StatusCode::OK);
    let fourth = mock.register("S", "scripted", product).await;
    assert_eq!(fourth.status(), StatusCode::OK);

    let stats = mock.stats();
    assert_eq!(
        (
            stats.scripted,
            stats.registered,
            stats.duplicates,
            stats.violations
        ),
        (2, 1, 1, 0)
    );
}

#[tokio::test]
async fn a_scripted_success_still_counts_toward_the_window() {
    let mock = mock("1/10s").await;
    let product = json!({"mock": {"statuses": [201]}});
    let accepted = mock.register("S", "s1", product.clone()).await;
    assert_eq!(accepted.status(), StatusCode::CREATED);
    let refused = mock.register("S", "s2", product).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let stats = mock.stats();
    assert_eq!(
        (stats.registered, stats.violations, stats.scripted),
        (1, 1, 0)
    );
}

#[tokio::test]
async fn a_scripted_delay_provokes_a_client_timeout() {
    let mock = mock("10/10s").await;
    let outcome = mock
        .client
        .post(mock.register_url("S"))
        .timeout(Duration::from_millis(100))
        .header("Idempotency-Key", "slow")
        .json(&json!({"mock": {"statuses": [200], "delay_ms": 5000}}))
        .send()
        .await;
    assert!(outcome.unwrap_err().is_timeout());
}

#[tokio::test]
async fn with_fail_rate_one_every_request_is_answered_503() {
    let mock = mock_with("100/1s", 1.0).await;
    for i in 0..5 {
        assert_eq!(
            mock.status_of("S", &format!("k{i}")).await,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    let stats = mock.stats();
    assert_eq!(
        (stats.injected_failures, stats.registered, stats.violations),
        (5, 0, 0)
    );
}

#[tokio::test]
async fn a_request_without_idempotency_key_or_json_object_is_refused_with_400() {
    let mock = mock("10/1s").await;
    let without_key = mock
        .client
        .post(mock.register_url("S"))
        .json(&json!({"sku": "a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(without_key.status(), StatusCode::BAD_REQUEST);
    let body: Value = without_key.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("Idempotency-Key"),
        "{body}"
    );

    let without_content_type = mock
        .client
        .post(mock.register_url("S"))
        .header("Idempotency-Key", "k")
        .body(r#"{"sku": "a"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(without_content_type.status(), StatusCode::BAD_REQUEST);

    let array = mock.register("S", "k", json!([1, 2])).await;
    assert_eq!(array.status(), StatusCode::BAD_REQUEST);

    let stats = mock.stats();
    assert_eq!((stats.requests, stats.registered), (3, 0));
    assert!(stats.sellers.is_empty());
}

#[tokio::test]
async fn the_seller_is_the_x_seller_id_header_verbatim_or_else_the_path_segment() {
    let mock = mock("1/10s").await;
    let by_header = mock
        .client
        .post(mock.register_url("ignored"))
        .header("Idempotency-Key", "h")
        .header("X-Seller-Id", "gr%C3%B6%C3%9Fe")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(by_header.status(), StatusCode::OK);
    let by_path = mock
        .client
        .post(mock.register_url("gr%C3%B6%C3%9Fe"))
        .header("Idempotency-Key", "p")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        by_path.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the same seller by path"
    );
    let sellers: Vec<String> = mock.stats().sellers.into_keys().collect();
    assert_eq!(sellers, ["gr%C3%B6%C3%9Fe"]);
}

#[tokio::test]
async fn stats_round_trip_through_fetch_stats_and_reset_clears_them() {
    let mock = mock("2/10s").await;
    for key in ["a", "b", "c"] {
        mock.status_of("S-1", key).await;
    }
    mock.status_of("S-1", "a").await;
    let local = mock.stats();
    assert_eq!(
        (local.registered, local.violations, local.duplicates),
        (2, 1, 1)
    );

    let base = format!("http://{}", mock.server.addr());
    let same_moment = |s: Stats| Stats {
        now_ms: local.now_ms,
        ..s
    };
    assert_eq!(same_moment(fetch_stats(&base).await.unwrap()), local);
    assert_eq!(
        same_moment(fetch_stats(&mock.server.url()).await.unwrap()),
        local
    );

    let reset = mock
        .client
        .post(format!("{base}/reset"))
        .send()
        .await
        .unwrap();
    assert!(reset.status().is_success());
    // Everything is cleared; `now_ms` is the mock's clock since the reset (0 or a few ms).
    let cleared = fetch_stats(&base).await.unwrap();
    assert_eq!(
        Stats {
            now_ms: 0,
            ..cleared
        },
        Stats::default()
    );
    assert_eq!(mock.status_of("S-1", "a").await, StatusCode::OK);
}

#[tokio::test]
async fn the_server_stops_when_shutdown_is_cancelled() {
    let shutdown = CancellationToken::new();
    let args = MockArgs {
        limit: "1/1s".parse().unwrap(),
        addr: "127.0.0.1:0".parse().unwrap(),
        ..MockArgs::local("1/1s".parse::<turnstile_core::config::Limits>().unwrap())
    };
    let server = MockServer::start(args, shutdown.clone()).await.unwrap();
    let base = format!("http://{}", server.addr());
    fetch_stats(&base).await.unwrap();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), server.wait())
        .await
        .expect("the server stops")
        .unwrap();
    assert!(fetch_stats(&base).await.is_err());
}
