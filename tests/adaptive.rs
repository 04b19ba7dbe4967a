//! Adaptive limits (`TURNSTILE_ADAPTIVE`): a 429 lowers a seller's learned limit to what the
//! downstream accepted, sustained success raises it again up to the configured limit,
//! rate-limit headers set it and a quota shared by every replica; and shadow limits, judged
//! beside the enforced one and never enforced. Against the real Redis and the local Redis
//! Cluster, and replicas against the strict mock whose real limit differs from turnstile's.

mod support;

use std::time::Duration;

use serde_json::json;

use turnstile_core::config::{Algorithm, LimiterArgs, Limits};
use turnstile_core::domain::{MessageId, RateLimitHeaders, SellerId};
use turnstile_core::permit::{Ask, Decision, PermitStore, Why};
use turnstile_lab::mock_api::{MockArgs, RateLimitForm};

use support::asks::{self, Call, call_now, decide, throttled};
use support::{Backend, Keys};

fn seller(s: &str) -> SellerId {
    SellerId::parse(s).unwrap()
}

fn limits(s: &str) -> Limits {
    s.parse().unwrap()
}

fn limiter(limit: &str) -> LimiterArgs {
    support::limiter(limit, Algorithm::SlidingWindow)
}

/// A call of `s` granted now, asked without reserving (nor taking a permit block) for the
/// message `m-<n>`.
async fn call_for(store: &PermitStore, s: &SellerId, n: usize) -> Call {
    let message = MessageId::parse(&format!("m-{n}")).unwrap();
    call_now(store, Ask::new(s).message(&message).without_reserving()).await
}

/// As [`call_for`], once the seller's limit lets it through (it asks again when told).
async fn call_in_time_for(store: &PermitStore, s: &SellerId, n: usize) -> Call {
    let message = MessageId::parse(&format!("m-{n}")).unwrap();
    let ask = Ask::new(s).message(&message).without_reserving();
    loop {
        let asked = asks::call(store, ask).await;
        if let Some(call) = asked {
            return call;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Takes a permit now and has the downstream accept the call: whether its record says a
/// learned count is due to change (the limiter then learns it, see `Ended::Registered`).
async fn accepted_call(store: &PermitStore, s: &SellerId, n: usize) -> bool {
    let call = call_for(store, s, n).await;
    accepted(store, &call).await
}

/// The downstream accepted `call` at once: whether its record says a learned count is due
/// to change.
async fn accepted(store: &PermitStore, call: &Call) -> bool {
    let finished = asks::answered(store, call).await;
    finished
        .recorded
        .expect("a registration's record")
        .raise_due
}

/// The downstream answered a call of `s` granted now with a 2xx whose rate-limit headers said
/// `told`.
async fn told(store: &PermitStore, s: &SellerId, n: usize, told: RateLimitHeaders) {
    let call = call_for(store, s, n).await;
    told_by(store, &call, told).await;
}

/// The downstream answered `call` with a 2xx whose rate-limit headers said `told`.
async fn told_by(store: &PermitStore, call: &Call, told: RateLimitHeaders) {
    asks::finish(store, call, call.granted_us, asks::registered(Some(told))).await;
}

/// The stack that applies to `s` now, as an acquire answers it (asked without reserving).
async fn counts_now(store: &PermitStore, s: &SellerId) -> String {
    store.admin().usage(s).await.unwrap().limit.counts_arg()
}

/// The counts that apply to `s` now and why they last changed.
async fn learned_now(store: &PermitStore, s: &SellerId) -> (String, Option<Why>) {
    let why = store.admin().learned(s).await.unwrap().and_then(|l| l.why);
    (counts_now(store, s).await, why)
}

async fn a_429_lowers_the_learned_limit_to_what_the_downstream_accepted(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-lower").await;
    let store = keys.store(limiter("20/2s"));
    let s = seller("S-lower");
    for n in 0..5 {
        accepted_call(&store, &s, n).await;
    }
    // Two more calls of the burst, which the downstream refuses.
    let earlier = call_for(&store, &s, 5).await;
    let refused = call_for(&store, &s, 6).await;
    assert!(throttled(&store, &refused, None).await, "a decrease");
    assert_eq!(
        learned_now(&store, &s).await,
        ("5".into(), Some(Why::Throttled))
    );
    let learned = store.admin().learned(&s).await.unwrap().expect("learned");
    assert_eq!(learned.configured, limits("20/2s"));
    assert_eq!(learned.limit, limits("5/2s"));
    assert_eq!(learned.from, Some(limits("20/2s")));
    // The learned limit is what every acquire applies: seven calls were made in the window.
    assert!(matches!(
        decide(&store, Ask::new(&s).without_reserving()).await,
        Decision::Wait { .. }
    ));
    // A 429 for a call granted before that change says nothing new.
    assert!(!throttled(&store, &earlier, None).await);
    assert_eq!(
        learned_now(&store, &s).await,
        ("5".into(), Some(Why::Throttled))
    );
    keys.cleanup().await;
}

async fn later_answers_correct_a_decrease_and_a_raise_gives_back_the_reserved_slots(
    backend: Backend,
) {
    let keys = Keys::new(backend, "adaptive-correct").await;
    let store = keys.store(limiter("20/2s"));
    let s = seller("S-correct");
    // A burst of eight calls: the downstream accepts the first five and refuses the others.
    let mut burst = Vec::new();
    for n in 0..8 {
        burst.push(call_for(&store, &s, n).await);
    }
    // Two of the accepted calls are recorded before the first 429 is learned from.
    for call in &burst[..2] {
        accepted(&store, call).await;
    }
    assert!(throttled(&store, &burst[7], None).await, "a decrease");
    assert_eq!(
        learned_now(&store, &s).await,
        ("2".into(), Some(Why::Throttled))
    );
    // The backlog reserves under the lowered limit.
    for n in 0..4 {
        let decision = decide(&store, Ask::new(&s)).await;
        assert!(
            matches!(
                decision,
                Decision::Wait {
                    reservation: Some(_),
                    ..
                }
            ),
            "backlog message {n}: {decision:?}"
        );
    }
    assert_eq!(store.admin().usage(&s).await.unwrap().ahead, 4);
    // The other three accepted calls of the burst are recorded after it: the decrease is
    // corrected (as their records say it is due) up to what the downstream accepted in that
    // window, never to the 429'd calls.
    let mut due = false;
    for call in &burst[2..5] {
        due |= accepted(&store, call).await;
    }
    assert!(due, "a correction is due");
    assert_eq!(
        learned_now(&store, &s).await,
        ("5".into(), Some(Why::Throttled))
    );
    // A raise re-slots the backlog: the slots reserved under the lower limit are given back.
    assert_eq!(store.admin().usage(&s).await.unwrap().ahead, 0);
    let learned = store.admin().learned(&s).await.unwrap().expect("learned");
    assert_eq!(learned.from, Some(limits("20/2s")), "{learned:?}");
    // A 429 of the same burst learned later changes nothing.
    assert!(!throttled(&store, &burst[6], None).await);
    assert_eq!(
        learned_now(&store, &s).await,
        ("5".into(), Some(Why::Throttled))
    );
    keys.cleanup().await;
}

async fn a_learned_limit_never_goes_below_the_minimum(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-min").await;
    let store = keys.store(LimiterArgs {
        adaptive_min: 3.try_into().unwrap(),
        ..limiter("8/2s")
    });
    let s = seller("S-min");
    for round in 0..4 {
        // Each 429 answers a call granted after the last change.
        let call = call_in_time_for(&store, &s, round).await;
        throttled(&store, &call, None).await;
        assert!(
            counts_now(&store, &s).await.parse::<u32>().unwrap() >= 3,
            "round {round}"
        );
    }
    // Nothing accepted: each 429 halves (8, 4, then the minimum 3).
    assert_eq!(counts_now(&store, &s).await, "3");
    keys.cleanup().await;
}

async fn sustained_success_raises_the_learned_limit_up_to_the_configured_one(backend: Backend) {
    for algorithm in Algorithm::ALL {
        raises_up_to_the_configured_limit(backend, algorithm).await;
    }
}

async fn raises_up_to_the_configured_limit(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "adaptive-raise").await;
    let store = keys.store(support::limiter("4/300ms", algorithm));
    let s = seller("S-raise");
    let first = call_for(&store, &s, 0).await;
    throttled(&store, &first, None).await;
    assert_eq!(counts_now(&store, &s).await, "2");
    // Use the learned limit in full, window after window: each raise is due only then, and
    // learned as the record that says so is written.
    let mut seen = vec![2];
    for n in 0..200 {
        let message = MessageId::parse(&format!("r-{n}")).unwrap();
        let ask = Ask::new(&s).message(&message).without_reserving();
        let Some(call) = asks::call(&store, ask).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        if accepted(&store, &call).await {
            let (counts, why) = learned_now(&store, &s).await;
            let count = counts.parse::<u32>().unwrap();
            if seen.last() != Some(&count) {
                // A raise made while the 429's window is still open is a correction from the
                // calls it accepted, which keeps the decrease's reason.
                assert!(
                    matches!(why, Some(Why::Recovery | Why::Throttled)),
                    "{why:?}"
                );
                seen.push(count);
            }
        }
        if seen.last() == Some(&4) {
            break;
        }
    }
    assert_eq!(
        seen,
        vec![2, 3, 4],
        "{algorithm}: one step at a time, up to the configured count"
    );
    // At the configured count, nothing is due any more.
    let call = call_in_time_for(&store, &s, 200).await;
    assert!(!accepted(&store, &call).await, "{algorithm}");
    assert_eq!(counts_now(&store, &s).await, "4");
    keys.cleanup().await;
}

async fn rate_limit_headers_set_the_limit_and_a_quota_every_replica_follows(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-headers").await;
    let one = keys.store(limiter("20/1s"));
    let other = keys.store(limiter("20/1s"));
    let s = seller("S-headers");
    // Three calls of one replica, answered one after another.
    let mut calls = Vec::new();
    for n in 0..3 {
        calls.push(call_for(&one, &s, n).await);
    }
    let told = RateLimitHeaders {
        limit: Some(10),
        window: Some(Duration::from_secs(1)),
        remaining: Some(0),
        reset: Some(Duration::from_secs(3)),
    };
    told_by(&one, &calls[0], told).await;
    assert_eq!(
        learned_now(&one, &s).await,
        ("10".into(), Some(Why::Header))
    );
    // The other replica waits for the quota's reset, though it made no call.
    match decide(&other, Ask::new(&s).without_reserving()).await {
        Decision::Wait { retry_after, .. } => {
            assert!(retry_after > Duration::from_secs(2), "{retry_after:?}")
        }
        decision => panic!("the quota was ignored: {decision:?}"),
    }
    let quota = one
        .admin()
        .learned(&s)
        .await
        .unwrap()
        .unwrap()
        .quota
        .unwrap();
    assert_eq!(quota.left, 0);
    // A later answer of the same window cannot give back what is used up.
    let told_later = RateLimitHeaders {
        remaining: Some(5),
        ..told
    };
    told_by(&one, &calls[1], told_later).await;
    assert_eq!(
        one.admin()
            .learned(&s)
            .await
            .unwrap()
            .unwrap()
            .quota
            .unwrap()
            .left,
        0
    );
    // A window of 1 min maps onto a configured 1 s limit as itself.
    let per_minute = RateLimitHeaders {
        limit: Some(6),
        window: Some(Duration::from_secs(60)),
        ..RateLimitHeaders::default()
    };
    told_by(&one, &calls[2], per_minute).await;
    assert_eq!(counts_now(&one, &s).await, "6");
    keys.cleanup().await;
}

async fn a_changed_limit_or_adaptive_off_drops_what_was_learned(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-terms").await;
    let store = keys.store(limiter("20/1s"));
    let s = seller("S-terms");
    let limit = |n| RateLimitHeaders {
        limit: Some(n),
        ..RateLimitHeaders::default()
    };
    told(&store, &s, 0, limit(7)).await;
    assert_eq!(counts_now(&store, &s).await, "7");
    let off = keys.store(LimiterArgs {
        adaptive: false,
        ..limiter("20/1s")
    });
    assert_eq!(counts_now(&off, &s).await, "20");
    // Adaptive off, the headers teach nothing.
    told(&off, &s, 1, limit(5)).await;
    assert_eq!(counts_now(&store, &s).await, "7");
    store.admin().set_limit(&s, limits("30/1s")).await.unwrap();
    assert_eq!(counts_now(&store, &s).await, "30");
    assert_eq!(store.admin().learned(&s).await.unwrap(), None);
    keys.cleanup().await;
}

async fn a_shadow_limit_records_what_it_would_have_done_without_enforcing_it(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-shadow").await;
    let store = keys.store(limiter("5/10s"));
    let s = seller("S-shadow");
    store.admin().set_shadow(&s, limits("2/10s")).await.unwrap();
    for n in 0..5 {
        accepted_call(&store, &s, n).await;
    }
    let shadow = store.admin().shadow(&s).await.unwrap().expect("a shadow");
    assert_eq!(shadow.limit, limits("2/10s"));
    assert_eq!((shadow.agree, shadow.stricter, shadow.looser), (2, 3, 0));
    assert!(shadow.delay > Duration::from_secs(20), "{shadow:?}");
    // A shadow looser than the enforced limit: the caller told to wait would have gone.
    store
        .admin()
        .set_shadow(&s, limits("50/10s"))
        .await
        .unwrap();
    assert!(matches!(
        decide(&store, Ask::new(&s).without_reserving()).await,
        Decision::Wait { .. }
    ));
    let shadow = store.admin().shadow(&s).await.unwrap().unwrap();
    assert_eq!((shadow.agree, shadow.stricter, shadow.looser), (0, 0, 1));
    assert!(store.admin().clear_shadow(&s).await.unwrap());
    assert_eq!(store.admin().shadow(&s).await.unwrap(), None);
    keys.cleanup().await;
}

macro_rules! adaptive_tests {
    ($backend:expr) => {
        #[tokio::test]
        async fn a_429_lowers_the_learned_limit_to_what_the_downstream_accepted() {
            super::a_429_lowers_the_learned_limit_to_what_the_downstream_accepted($backend).await;
        }
        #[tokio::test]
        async fn later_answers_correct_a_decrease_and_a_raise_gives_back_the_reserved_slots() {
            super::later_answers_correct_a_decrease_and_a_raise_gives_back_the_reserved_slots(
                $backend,
            )
            .await;
        }
        #[tokio::test]
        async fn a_learned_limit_never_goes_below_the_minimum() {
            super::a_learned_limit_never_goes_below_the_minimum($backend).await;
        }
        #[tokio::test]
        async fn sustained_success_raises_the_learned_limit_up_to_the_configured_one() {
            super::sustained_success_raises_the_learned_limit_up_to_the_configured_one($backend)
                .await;
        }
        #[tokio::test]
        async fn rate_limit_headers_set_the_limit_and_a_quota_every_replica_follows() {
            super::rate_limit_headers_set_the_limit_and_a_quota_every_replica_follows($backend)
                .await;
        }
        #[tokio::test]
        async fn a_changed_limit_or_adaptive_off_drops_what_was_learned() {
            super::a_changed_limit_or_adaptive_off_drops_what_was_learned($backend).await;
        }
        #[tokio::test]
        async fn a_shadow_limit_records_what_it_would_have_done_without_enforcing_it() {
            super::a_shadow_limit_records_what_it_would_have_done_without_enforcing_it($backend)
                .await;
        }
    };
}

mod standalone {
    adaptive_tests!(super::Backend::Standalone);
}

mod cluster {
    adaptive_tests!(super::Backend::Cluster);
}

/// The pure decisions of `lua/include/learned.lua`, run by the real Redis: what a 429 lowers a
/// learned count to, and what a later answer of the same window corrects it to.
#[test]
fn a_decrease_follows_what_the_downstream_accepted_and_a_correction_only_raises() {
    let mut conn = redis::Client::open(support::redis_url())
        .unwrap()
        .get_connection()
        .unwrap();
    let learn = turnstile_core::permit::scripts::sources()
        .into_iter()
        .find(|source| source.name == "learn")
        .expect("learn.lua");
    let mut eval = |expression: &str| -> i64 {
        redis::cmd("EVAL")
            .arg(format!("{}\nreturn ({expression}) or -1", learn.setup))
            .arg(0)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
    };
    // lowered_count(COUNT, ACCEPTED, FLOOR)
    let lowered = [
        ((20, 5, 1), 5),
        ((20, 1, 1), 1),
        ((20, 0, 1), 10),
        ((6, 6, 1), 3),
        ((6, 9, 1), 3),
        ((8, 0, 3), 4),
        ((4, 0, 3), 3),
        ((20, 2, 3), 3),
    ];
    for ((count, accepted, floor), want) in lowered {
        let expression = format!("lowered_count({count}, {accepted}, {floor})");
        assert_eq!(eval(&expression), want, "{expression}");
    }
    // corrected_count(COUNT, FROM, ACCEPTED); -1 = stays
    let corrected = [
        ((1, 20, 5), 5),
        ((2, 20, 3), 3),
        ((5, 20, 5), -1),
        ((2, 6, 9), 5),
        ((3, 6, 6), 5),
        ((5, 6, 6), -1),
        ((10, 20, 5), -1),
        ((4, 5, 5), -1),
    ];
    for ((count, from, accepted), want) in corrected {
        let expression = format!("corrected_count({count}, {from}, {accepted})");
        assert_eq!(eval(&expression), want, "{expression}");
    }
}

/// Replicas told 20/1s against an API that allows 5/1s and says so in `X-RateLimit-*`: the
/// headers set the learned limit to the API's, and everything registers.
#[tokio::test]
async fn replicas_learn_the_apis_limit_from_its_headers() -> anyhow::Result<()> {
    let mock = MockArgs {
        rate_limit_headers: RateLimitForm::X,
        ..MockArgs::local(limits("5/1s"))
    };
    let mut rig = support::rig("adaptive-rig-headers", "20/1s")
        .with_mock(mock)
        .with_api_limit(limits("5/1s"))
        .serving(turnstile_ops::serve::HttpArgs {
            http_addr: turnstile_ops::http::Listen::At("127.0.0.1:0".parse()?),
            http_token: None,
        })
        .prepare()
        .await?;
    for i in 0..20 {
        rig.publish_product("S-api", &format!("api-{i}"), json!({ "sku": i }))
            .await?;
    }
    rig.start_replicas(2, 4).await?;
    let stats = rig.wait_registered(20).await?;
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    let learned = rig
        .admin()
        .learned(&seller("S-api"))
        .await?
        .expect("learned");
    assert_eq!(learned.limit, limits("5/1s"), "{learned:?}");
    assert_eq!(learned.why, Some(Why::Header));
    // The dashboard shows configured vs learned, and the metrics count the change.
    let http = rig.dashboard().unwrap();
    let d: serde_json::Value = reqwest::get(format!("http://{http}/api/dashboard"))
        .await?
        .json()
        .await?;
    let row = d["sellers"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["seller"] == "S-api"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (&row["limit"], &row["configured"], &row["learned"]),
        (&json!("5/1s"), &json!("20/1s"), &json!("header")),
        "{d}"
    );
    let metrics = reqwest::get(format!("http://{http}/metrics"))
        .await?
        .text()
        .await?;
    let changes = metrics.lines().find_map(|l| {
        l.strip_prefix(r#"turnstile_adaptive_changes_total{why="header"} "#)?
            .parse::<f64>()
            .ok()
    });
    assert!(changes.is_some_and(|n| n >= 1.0), "{metrics}");
    rig.cleanup().await
}

/// Replicas told 20/1s against an API that allows 5/1s and sends no rate-limit headers nor
/// Retry-After: its 429s lower the learned limit (never above what the API accepted in a
/// window), and everything registers.
#[tokio::test]
async fn replicas_learn_the_apis_limit_from_its_429s() -> anyhow::Result<()> {
    let mock = MockArgs {
        no_retry_after: true,
        ..MockArgs::local(limits("5/1s"))
    };
    let mut rig = support::rig("adaptive-rig-429", "20/1s")
        .with_mock(mock)
        .with_api_limit(limits("5/1s"))
        .prepare()
        .await?;
    for i in 0..30 {
        rig.publish_product("S-429", &format!("t-{i}"), json!({ "sku": i }))
            .await?;
    }
    rig.start_replicas(2, 4).await?;
    let stats = rig.wait_registered(30).await?;
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert!(stats.violations > 0, "the API refused calls: {stats:?}");
    let learned = rig
        .admin()
        .learned(&seller("S-429"))
        .await?
        .expect("learned");
    let count = learned.limit.iter().next().unwrap().count();
    assert!(
        (1..20).contains(&count),
        "429s lowered the limit: {learned:?}"
    );
    rig.cleanup().await
}
