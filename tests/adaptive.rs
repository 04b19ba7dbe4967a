//! Adaptive limits (`TURNSTILE_ADAPTIVE`): a 429 lowers a seller's learned limit to what the
//! downstream accepted, sustained success raises it again up to the configured limit,
//! rate-limit headers set it and a quota shared by every replica; and shadow limits, judged
//! beside the enforced one and never enforced. Against the real Redis and the local Redis
//! Cluster, and replicas against the strict mock whose real limit differs from turnstile's.

mod support;

use std::time::Duration;

use serde_json::json;

use turnstile_core::config::{Algorithm, LimiterArgs, Limits};
use turnstile_core::domain::{Cost, MessageId, RateLimitHeaders, SellerId};
use turnstile_core::permit::{CallAnswer, Decision, Lesson, PermitStore, Why};
use turnstile_lab::mock_api::{MockArgs, RateLimitForm};

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

/// The answer to the call `call` of one unit granted at `granted_us`, answered at once.
fn answer(call: &str, granted_us: i64) -> CallAnswer<'_> {
    CallAnswer {
        call,
        cost: Cost::ONE,
        answered_us: Some(granted_us),
        result: None,
    }
}

/// Takes a permit now and has the downstream accept the call: returns when it was granted.
async fn accepted_call(store: &PermitStore, s: &SellerId, n: usize) -> i64 {
    let Decision::Granted {
        slot_us,
        call,
        granted_us,
        ..
    } = store.acquire(s, false).await.unwrap()
    else {
        panic!("call {n} of {s} was not granted at once");
    };
    let message = MessageId::parse(&format!("m-{n}")).unwrap();
    store
        .complete_call(
            s,
            &message,
            None,
            answer(&call, granted_us),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    slot_us
}

/// The stack that applies to `s` now, as an acquire answers it (asked without reserving).
async fn counts_now(store: &PermitStore, s: &SellerId) -> String {
    store.admin().usage(s).await.unwrap().limit.counts_arg()
}

async fn a_429_lowers_the_learned_limit_to_what_the_downstream_accepted(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-lower").await;
    let store = keys.store(limiter("20/2s"));
    let s = seller("S-lower");
    let mut granted = 0;
    for n in 0..5 {
        granted = accepted_call(&store, &s, n).await;
    }
    let lesson = Lesson::Throttled {
        granted_us: granted,
        told: None,
    };
    let change = store.learn(&s, lesson).await.unwrap().expect("a change");
    assert_eq!((change.counts.as_str(), change.why), ("5", Why::Throttled));
    assert_eq!(counts_now(&store, &s).await, "5");
    let learned = store.admin().learned(&s).await.unwrap().expect("learned");
    assert_eq!(learned.configured, limits("20/2s"));
    assert_eq!(learned.limit, limits("5/2s"));
    assert_eq!(learned.from, Some(limits("20/2s")));
    // The learned limit is what every acquire applies: five calls were made in the window.
    assert!(matches!(
        store.acquire(&s, false).await.unwrap(),
        Decision::Wait { .. }
    ));
    // A 429 for a call granted before that change says nothing new.
    let stale = Lesson::Throttled {
        granted_us: granted - 1,
        told: None,
    };
    assert_eq!(store.learn(&s, stale).await.unwrap(), None);
    assert_eq!(counts_now(&store, &s).await, "5");
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
        let Decision::Granted {
            call, granted_us, ..
        } = store.acquire(&s, false).await.unwrap()
        else {
            panic!("call {n} of the burst was not granted at once");
        };
        burst.push((call, granted_us));
    }
    let record = |n: usize| {
        let (call, granted_us) = &burst[n];
        let message = MessageId::parse(&format!("c-{n}")).unwrap();
        let store = &store;
        let s = &s;
        async move {
            store
                .complete_call(
                    s,
                    &message,
                    None,
                    answer(call, *granted_us),
                    Duration::from_secs(60),
                )
                .await
                .unwrap()
                .raise_due
        }
    };
    // Two of the accepted calls are recorded before the first 429 is learned from.
    for n in 0..2 {
        record(n).await;
    }
    let first_429 = Lesson::Throttled {
        granted_us: burst[7].1,
        told: None,
    };
    let change = store
        .learn(&s, first_429)
        .await
        .unwrap()
        .expect("a decrease");
    assert_eq!((change.counts.as_str(), change.why), ("2", Why::Throttled));
    // The backlog reserves under the lowered limit.
    for n in 0..4 {
        let decision = store.acquire(&s, true).await.unwrap();
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
    // corrected up to what the downstream accepted in that window, never to the 429'd calls.
    let mut due = false;
    for n in 2..5 {
        due |= record(n).await;
    }
    assert!(due, "a correction is due");
    let change = store
        .learn(&s, Lesson::Recovery)
        .await
        .unwrap()
        .expect("a correction");
    assert_eq!((change.counts.as_str(), change.why), ("5", Why::Throttled));
    // A raise re-slots the backlog: the slots reserved under the lower limit are given back.
    assert_eq!(store.admin().usage(&s).await.unwrap().ahead, 0);
    let learned = store.admin().learned(&s).await.unwrap().expect("learned");
    assert_eq!(learned.from, Some(limits("20/2s")), "{learned:?}");
    // A 429 of the same burst learned later, and a recovery with nothing new, change nothing.
    let late_429 = Lesson::Throttled {
        granted_us: burst[6].1,
        told: None,
    };
    assert_eq!(store.learn(&s, late_429).await.unwrap(), None);
    assert_eq!(store.learn(&s, Lesson::Recovery).await.unwrap(), None);
    assert_eq!(counts_now(&store, &s).await, "5");
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
        let now = store.admin().redis_time_us().await.unwrap();
        let lesson = Lesson::Throttled {
            granted_us: now,
            told: None,
        };
        store.learn(&s, lesson).await.unwrap();
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
    let now = store.admin().redis_time_us().await.unwrap();
    let lesson = Lesson::Throttled {
        granted_us: now,
        told: None,
    };
    store.learn(&s, lesson).await.unwrap();
    assert_eq!(counts_now(&store, &s).await, "2");
    // Use the learned limit in full, window after window: each raise is due only then.
    let mut seen = vec![2];
    for n in 0..200 {
        let decision = store.acquire(&s, false).await.unwrap();
        let Decision::Granted {
            call, granted_us, ..
        } = decision
        else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let message = MessageId::parse(&format!("r-{n}")).unwrap();
        let due = store
            .complete_call(
                &s,
                &message,
                None,
                answer(&call, granted_us),
                Duration::from_secs(60),
            )
            .await
            .unwrap()
            .raise_due;
        if due {
            let change = store
                .learn_at(&s, Lesson::Recovery, Some(granted_us))
                .await
                .unwrap();
            if let Some(change) = change {
                // A raise made while the 429's window is still open is a correction from the
                // calls it accepted, which keeps the decrease's reason.
                assert!(
                    matches!(change.why, Why::Recovery | Why::Throttled),
                    "{:?}",
                    change.why
                );
                seen.push(change.counts.parse::<u32>().unwrap());
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
    assert_eq!(store.learn(&s, Lesson::Recovery).await.unwrap(), None);
    keys.cleanup().await;
}

async fn rate_limit_headers_set_the_limit_and_a_quota_every_replica_follows(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-headers").await;
    let one = keys.store(limiter("20/1s"));
    let other = keys.store(limiter("20/1s"));
    let s = seller("S-headers");
    let told = RateLimitHeaders {
        limit: Some(10),
        window: Some(Duration::from_secs(1)),
        remaining: Some(0),
        reset: Some(Duration::from_secs(3)),
    };
    let change = one.learn(&s, Lesson::Told(told)).await.unwrap();
    assert_eq!(
        change.map(|c| (c.counts, c.why)),
        Some(("10".into(), Why::Header))
    );
    // The other replica waits for the quota's reset, though no call was made.
    match other.acquire(&s, false).await.unwrap() {
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
    one.learn(&s, Lesson::Told(told_later)).await.unwrap();
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
    one.learn(&s, Lesson::Told(per_minute)).await.unwrap();
    assert_eq!(counts_now(&one, &s).await, "6");
    keys.cleanup().await;
}

async fn a_changed_limit_or_adaptive_off_drops_what_was_learned(backend: Backend) {
    let keys = Keys::new(backend, "adaptive-terms").await;
    let store = keys.store(limiter("20/1s"));
    let s = seller("S-terms");
    let told = RateLimitHeaders {
        limit: Some(7),
        ..RateLimitHeaders::default()
    };
    store.learn(&s, Lesson::Told(told)).await.unwrap();
    assert_eq!(counts_now(&store, &s).await, "7");
    let off = keys.store(LimiterArgs {
        adaptive: false,
        ..limiter("20/1s")
    });
    assert_eq!(counts_now(&off, &s).await, "20");
    assert_eq!(off.learn(&s, Lesson::Told(told)).await.unwrap(), None);
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
        store.acquire(&s, false).await.unwrap(),
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
