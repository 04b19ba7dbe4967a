//! Beyond a seller's own limit: the global limit (`TURNSTILE_GLOBAL_LIMIT`), exact over every
//! seller together and shared fairly by weight, and the cap on a seller's calls in flight
//! (`TURNSTILE_SELLER_CONCURRENCY`); a grant either refuses is given back to its seller.
//! Against the real Redis and the local Redis Cluster (where the global state lives in one slot
//! of its own).

mod support;

use std::sync::Arc;

use serde_json::json;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;
use tokio::sync::Mutex;

use turnstile_core::config::{Algorithm, GlobalLimit, LimiterArgs, SellerConcurrency};
use turnstile_core::domain::{Cost, SellerId};
use turnstile_core::permit::{Ask, Decision, Deferral, Limiter, PermitStore};
use turnstile_lab::slow_link::SlowLink;

use support::asks::{call_now, decide};
use support::{Backend, Keys};

fn seller(s: &str) -> SellerId {
    SellerId::parse(s).unwrap()
}

/// Sellers of `limit` each under the global `global`.
fn limiter(limit: &str, global: &str) -> LimiterArgs {
    LimiterArgs {
        global_limit: GlobalLimit(Some(global.parse().unwrap())),
        ..support::limiter(limit, Algorithm::SlidingWindow)
    }
}

/// When the global limit counted the call `call` of `seller` (Redis µs): its first unit's
/// place in the global log (a call not yet answered holds it at its grant, without a bound).
async fn counted_globally(store: &PermitStore, seller: &SellerId, call: &str) -> i64 {
    let member = format!("{call}|{}", seller.key_tag());
    let at: Option<i64> = redis::cmd("ZSCORE")
        .arg(store.keys().global_log())
        .arg(&member)
        .query_async(&mut store.conn().clone())
        .await
        .unwrap();
    at.unwrap_or_else(|| panic!("{member} is in the global log"))
}

/// Eight callers over sixteen sellers, costs of 1 to 3 units, ask the global stack
/// `6/1s,15/3s` until 45 units are granted, each coming back when told: no window of either
/// limit ever holds more than its COUNT in units, whoever asked.
async fn the_global_stack_is_exact_over_every_seller(backend: Backend) {
    let keys = Keys::new(backend, "global-exact").await;
    let store = keys.store(limiter("1000/1s", "6/1s,15/3s"));
    let grants = Arc::new(Mutex::new(Vec::<(i64, u32)>::new()));
    let mut callers = Vec::new();
    for caller in 0..8u32 {
        let (store, grants) = (store.clone(), grants.clone());
        callers.push(tokio::spawn(async move {
            for call in 0u32.. {
                if grants.lock().await.iter().map(|g| g.1).sum::<u32>() >= 45 {
                    return;
                }
                let s = seller(&format!("S-{}", (caller + call) % 16));
                let cost = Cost::new(call % 3 + 1).unwrap();
                match decide(&store, Ask::new(&s).cost(cost)).await {
                    Decision::Granted { call, .. } => {
                        let at_us = counted_globally(&store, &s, &call).await;
                        grants.lock().await.push((at_us, cost.units()));
                    }
                    Decision::Deferred { retry_after, .. } => {
                        tokio::time::sleep(retry_after).await;
                    }
                    other => unreachable!("3 units fit 6/1s, and the sellers' 1000/1s: {other:?}"),
                }
            }
        }));
    }
    for caller in callers {
        caller.await.unwrap();
    }
    let grants = grants.lock().await.clone();
    assert!(
        support::max_units_in_any_window(&grants, 1_000_000) <= 6,
        "{grants:?}"
    );
    assert!(
        support::max_units_in_any_window(&grants, 3_000_000) <= 15,
        "{grants:?}"
    );
    keys.cleanup().await;
}

/// Sellers asking for single units through `asks` workers each, every worker asking again at
/// once after a grant and at the time it was told after a refusal (as a replica's workers do),
/// until the global limit has granted `total` units; the workers still waiting are stopped
/// then, so the sellers are still competing when this returns. Returns each seller's grants
/// from the first refusal on (before it, the limit had room for everyone and nobody competed).
async fn compete(
    store: &turnstile_core::permit::PermitStore,
    askers: &[(&SellerId, u32)],
    total: u64,
) -> Vec<u64> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let granted = Arc::new(AtomicU64::new(0));
    let contended = Arc::new(AtomicBool::new(false));
    let counted: Arc<Vec<AtomicU64>> = Arc::new(askers.iter().map(|_| AtomicU64::new(0)).collect());
    let reached = Arc::new(tokio::sync::Notify::new());
    let mut workers = Vec::new();
    for (n, (s, asks)) in askers.iter().enumerate() {
        for _ in 0..*asks {
            let (store, s) = (store.clone(), (*s).clone());
            let (granted, contended, counted) =
                (granted.clone(), contended.clone(), counted.clone());
            let reached = reached.clone();
            workers.push(tokio::spawn(async move {
                loop {
                    match decide(&store, Ask::new(&s)).await {
                        Decision::Granted { .. } => {
                            if granted.load(Ordering::SeqCst) >= total {
                                return;
                            }
                            if contended.load(Ordering::SeqCst) {
                                counted[n].fetch_add(1, Ordering::SeqCst);
                            }
                            if granted.fetch_add(1, Ordering::SeqCst) + 1 == total {
                                reached.notify_one();
                            }
                        }
                        Decision::Deferred { retry_after, .. } => {
                            contended.store(true, Ordering::SeqCst);
                            tokio::time::sleep(retry_after).await;
                        }
                        other => {
                            unreachable!("one unit fits, and the sellers' 1000/1s: {other:?}")
                        }
                    }
                }
            }));
        }
    }
    // Bounded only so that workers that all failed cannot hang the test.
    tokio::time::timeout(Duration::from_secs(300), reached.notified())
        .await
        .expect("the global limit granted every unit asked for");
    for worker in &workers {
        worker.abort();
    }
    for worker in workers {
        if let Err(stopped) = worker.await
            && stopped.is_panic()
        {
            std::panic::resume_unwind(stopped.into_panic());
        }
    }
    counted.iter().map(|c| c.load(Ordering::SeqCst)).collect()
}

/// While the global limit has room, every seller is granted what it asks. Once it binds, a
/// seller with a backlog asking through three workers gets no more than one asking through
/// one: the two compete from their first refusal, level, and the busy one may run at most
/// QUANTUM (20/1s: 1 unit) and one call ahead.
async fn a_busy_seller_cannot_run_ahead_of_a_small_one(backend: Backend) {
    let keys = Keys::new(backend, "global-fair").await;
    let store = keys.store(limiter("1000/1s", "20/1s"));
    let (busy, small) = (seller("S-busy"), seller("S-small"));
    let counted = compete(&store, &[(&busy, 3), (&small, 1)], 80).await;
    let (busy, small) = (counted[0], counted[1]);
    assert!(small >= 20, "busy {busy}, small {small}");
    assert!(busy <= small + 2, "busy {busy}, small {small}");
    keys.cleanup().await;
}

/// A seller whose calls are all granted competes with nobody: another may take the rest of the
/// budget, and is refused only when it is used up, never for being ahead of it.
async fn a_seller_that_is_always_granted_holds_nobody_back(backend: Backend) {
    let keys = Keys::new(backend, "global-slow").await;
    let store = keys.store(limiter("1000/1s", "50/1s"));
    let (slow, busy) = (seller("S-slow"), seller("S-busy"));
    let granted = |d| matches!(d, Decision::Granted { .. });
    let (mut busy_granted, mut slow_granted) = (0, 0);
    for i in 0.. {
        if i % 10 == 0 {
            let slow_ask = decide(&store, Ask::new(&slow)).await;
            assert!(
                granted(slow_ask),
                "the slow seller is refused only when all is used"
            );
            slow_granted += 1;
        }
        match decide(&store, Ask::new(&busy)).await {
            Decision::Granted { .. } => busy_granted += 1,
            Decision::Deferred { by, .. } => {
                assert_eq!(
                    by,
                    Deferral::GlobalFull,
                    "refused as ahead after {busy_granted}"
                );
                break;
            }
            other => unreachable!("{other:?}"),
        }
    }
    assert_eq!(busy_granted + slow_granted, 50, "the whole window was used");
    keys.cleanup().await;
}

/// Two sellers asking alike, of weights 4 and 1, share the global limit 4:1 once it binds:
/// over 80 units, the light one's units and the heavy one's quarter differ by at most QUANTUM
/// (1) and one call, from their first refusal on.
async fn weights_divide_the_global_limit(backend: Backend) {
    let keys = Keys::new(backend, "global-weights").await;
    let store = keys.store(limiter("1000/1s", "20/1s"));
    let (heavy, light) = (seller("S-heavy"), seller("S-light"));
    store.admin().set_weight(&heavy, 4).await.unwrap();
    assert_eq!(store.admin().weight(&heavy).await.unwrap(), 4);
    assert_eq!(store.admin().weight(&light).await.unwrap(), 1);
    let counted = compete(&store, &[(&heavy, 4), (&light, 4)], 100).await;
    let (h, l) = (counted[0], counted[1]);
    assert!(
        (h as f64 / 4.0 - l as f64).abs() <= 2.0,
        "heavy {h}, light {l}"
    );
    // What the dashboard and `turnstile status` show of it: the window holds 20 units, both
    // sellers are competing, with their weights.
    let usage = store.admin().global_usage().await.unwrap().unwrap();
    assert_eq!(usage.limit.to_string(), "20/1s");
    assert_eq!(usage.per_limit[0].capacity, 20);
    assert!(usage.per_limit[0].used <= 20, "{usage:?}");
    assert_eq!((usage.present, usage.weights), (2, 5.0), "{usage:?}");
    let weights: Vec<(&str, u32)> = usage
        .shares
        .iter()
        .map(|s| (s.seller.as_str(), s.weight))
        .collect();
    assert!(weights.contains(&("S-heavy", 4)), "{usage:?}");
    keys.cleanup().await;
}

/// A seller's grant the global limit refuses is given back to the seller: its own limit shows
/// only what was called, and the call can be asked for again at once.
async fn a_refused_grant_is_given_back_to_the_seller(backend: Backend) {
    let keys = Keys::new(backend, "global-release").await;
    let store = keys.store(limiter("3/1s", "1/1s"));
    let s = seller("S-given-back");
    let granted = |d: &Decision| matches!(d, Decision::Granted { .. });
    let first = decide(&store, Ask::new(&s)).await;
    assert!(granted(&first), "{first:?}");
    for _ in 0..4 {
        let refused = decide(&store, Ask::new(&s)).await;
        assert!(
            matches!(
                refused,
                Decision::Deferred {
                    by: Deferral::GlobalFull,
                    ..
                }
            ),
            "{refused:?}"
        );
    }
    let usage = store.admin().usage(&s).await.unwrap();
    assert_eq!(usage.used, 1, "only the call made counts: {usage:?}");
    // A cost the global stack never grants is refused as such, and given back too.
    let costly = decide(&store, Ask::new(&s).cost(Cost::new(2).unwrap())).await;
    match costly {
        Decision::TooCostly { most, bound_by, .. } => {
            assert_eq!(most, 1);
            assert!(bound_by.contains("TURNSTILE_GLOBAL_LIMIT"), "{bound_by}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(store.admin().usage(&s).await.unwrap().used, 1);
    keys.cleanup().await;
}

/// A global state stamped by another Redis server (a failover to a replica, state restored
/// from elsewhere) may have lost grants: the global limit grants nothing for one window from
/// now, whoever asks; then it grants again.
async fn a_global_state_from_another_server_pauses_the_global_limit(backend: Backend) {
    let keys = Keys::new(backend, "global-stamp").await;
    let store = keys.store(LimiterArgs {
        redis_durable: false,
        ..limiter("1000/1s", "5/1s")
    });
    let s = seller("S-stamp");
    assert!(matches!(
        decide(&store, Ask::new(&s)).await,
        Decision::Granted { .. }
    ));
    let stamp = store.keys().global_keys()[6].clone();
    let _: () = redis::cmd("SET")
        .arg(&stamp)
        .arg("0123456789abcdef")
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    match decide(&store, Ask::new(&s)).await {
        Decision::Deferred {
            retry_after,
            by: Deferral::GlobalFull,
        } => {
            // One window (1 s; the global limit keeps no guard) from the moment the stamp was
            // found foreign, counted from when the request left (so a moment less).
            assert!(
                retry_after <= Duration::from_secs(1) && retry_after >= Duration::from_millis(900),
                "{retry_after:?}"
            );
            tokio::time::sleep(retry_after).await;
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        decide(&store, Ask::new(&s)).await,
        Decision::Granted { .. }
    ));
    keys.cleanup().await;
}

/// Every key of the global limit but the weights expires once nobody asks.
async fn the_global_state_expires_when_idle(backend: Backend) {
    let keys = Keys::new(backend, "global-idle").await;
    let store = keys.store(limiter("1000/1s", "5/1s"));
    for i in 0..8 {
        decide(&store, Ask::new(&seller(&format!("S-{i}")))).await;
    }
    let space = store.keys().clone();
    for key in [
        space.global_log(),
        space.global_fair(),
        space.global_finish(),
        space.global_active(),
        space.global_sellers(),
    ] {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut keys.conn.clone())
            .await
            .unwrap();
        // At most: the last refused seller's ticket (a window + guard away here), IDLE after
        // it, and a window.
        assert!(ttl > 0 && ttl <= 2_400, "{key}: {ttl} ms");
    }
    keys.cleanup().await;
}

/// Sellers of `limit` with at most `n` calls in flight each.
fn leased(limit: &str, n: u32) -> LimiterArgs {
    LimiterArgs {
        seller_concurrency: SellerConcurrency(NonZeroU32::new(n)),
        ..support::limiter(limit, Algorithm::SlidingWindow)
    }
}

/// At most two calls of a seller in flight: a third grant is deferred and given back (its
/// seller's limit shows only the two), another seller is not held back, an answered call frees
/// its lease at once, and one never answered (its replica died) frees it at its bound.
async fn a_sellers_calls_in_flight_are_capped_by_leases(backend: Backend) {
    let keys = Keys::new(backend, "leases").await;
    // A call's bound: 1 s to send it + a 100 ms timeout.
    let store = keys
        .store(leased("100/1m", 2))
        .with_call_timeout(Duration::from_millis(100));
    let (s, other) = (seller("S-leased"), seller("S-other"));
    let ask = |s: &SellerId| {
        let (store, s) = (store.clone(), s.clone());
        async move { decide(&store, Ask::new(&s)).await }
    };
    let call = |d: Decision| match d {
        Decision::Granted { call, .. } => call,
        other => panic!("{other:?}"),
    };
    let first = call_now(&store, Ask::new(&s)).await;
    let _second = call(ask(&s).await);
    let third = ask(&s).await;
    assert!(
        matches!(
            third,
            Decision::Deferred {
                by: Deferral::Concurrency,
                ..
            }
        ),
        "{third:?}"
    );
    assert_eq!(
        store.admin().usage(&s).await.unwrap().used,
        2,
        "the third grant was given back"
    );
    call(ask(&other).await);
    store.answered(&first.grant).await;
    let _third = call(ask(&s).await);
    assert!(matches!(ask(&s).await, Decision::Deferred { .. }));
    // Never answered: the leases end at their bound (1.1 s after their grant).
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    call(ask(&s).await);
    keys.cleanup().await;
}

macro_rules! global_tests {
    ($backend:expr) => {
        #[tokio::test]
        async fn the_global_stack_is_exact_over_every_seller() {
            super::the_global_stack_is_exact_over_every_seller($backend).await;
        }
        #[tokio::test]
        async fn a_busy_seller_cannot_run_ahead_of_a_small_one() {
            super::a_busy_seller_cannot_run_ahead_of_a_small_one($backend).await;
        }
        #[tokio::test]
        async fn a_seller_that_is_always_granted_holds_nobody_back() {
            super::a_seller_that_is_always_granted_holds_nobody_back($backend).await;
        }
        #[tokio::test]
        async fn weights_divide_the_global_limit() {
            super::weights_divide_the_global_limit($backend).await;
        }
        #[tokio::test]
        async fn a_refused_grant_is_given_back_to_the_seller() {
            super::a_refused_grant_is_given_back_to_the_seller($backend).await;
        }
        #[tokio::test]
        async fn a_sellers_calls_in_flight_are_capped_by_leases() {
            super::a_sellers_calls_in_flight_are_capped_by_leases($backend).await;
        }
        #[tokio::test]
        async fn a_global_state_from_another_server_pauses_the_global_limit() {
            super::a_global_state_from_another_server_pauses_the_global_limit($backend).await;
        }
        #[tokio::test]
        async fn the_global_state_expires_when_idle() {
            super::the_global_state_expires_when_idle($backend).await;
        }
    };
}

mod standalone {
    global_tests!(super::Backend::Standalone);
}

mod cluster {
    global_tests!(super::Backend::Cluster);
}

/// Replicas under a global limit: three sellers' registrations never exceed it at the strict
/// downstream, which enforces it too, and all of them register.
#[tokio::test]
async fn replicas_keep_the_global_limit_at_the_downstream() -> anyhow::Result<()> {
    let settings = LimiterArgs {
        global_limit: GlobalLimit(Some("4/1s".parse().unwrap())),
        ..support::limiter("100/1s", Algorithm::SlidingWindow)
    };
    let mut rig = support::rig_with("global-rig", settings)
        .serving(turnstile_ops::serve::HttpArgs {
            http_addr: turnstile_ops::http::Listen::At("127.0.0.1:0".parse()?),
            http_token: None,
        })
        .prepare()
        .await?;
    for s in ["S-a", "S-b", "S-c"] {
        for i in 0..4 {
            rig.publish_product(s, &format!("{s}-{i}"), json!({ "sku": i }))
                .await?;
        }
    }
    rig.start_replicas(2, 4).await?;
    let stats = rig.wait_registered(12).await?;
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.global_violations, 0, "{stats:?}");
    assert!(stats.max_global_in_window <= 4, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    // The dashboard shows the global budget.
    let api = format!("http://{}/api/dashboard", rig.dashboard().unwrap());
    support::eventually_async("the dashboard's global limit", async || {
        let Ok(answer) = reqwest::get(&api).await else {
            return false;
        };
        let d: serde_json::Value = answer.json().await.unwrap_or_default();
        d["global"]["limit"] == "4/1s" && d["global"]["limits"][0]["capacity"] == 4
    })
    .await;
    rig.cleanup().await
}

/// Calls that reach the downstream late never put a window over the global limit: the first
/// calls cross a link that holds every request and answer 400 ms, the later ones cross it at
/// once. Each call holds its place in the global log until its answer, so the fast calls wait
/// for the slow ones' answers instead of landing in the same window of the downstream.
#[tokio::test]
async fn calls_that_reach_the_downstream_late_never_put_a_window_over_the_global_limit()
-> anyhow::Result<()> {
    let settings = LimiterArgs {
        global_limit: GlobalLimit(Some("4/1s".parse().unwrap())),
        ..support::limiter("100/1s", Algorithm::SlidingWindow)
    };
    let mut rig = support::rig_with("global-late", settings).prepare().await?;
    for s in ["S-a", "S-b", "S-c"] {
        for i in 0..4 {
            rig.publish_product(s, &format!("{s}-{i}"), json!({ "sku": i }))
                .await?;
        }
    }
    let mut replica = rig.settings(8);
    let api = reqwest::Url::parse(&replica.downstream.url)?;
    let api = SocketAddr::new(
        api.host_str().unwrap_or("127.0.0.1").parse()?,
        api.port().unwrap_or(80),
    );
    let link = SlowLink::start(api, Duration::from_millis(400)).await?;
    replica.downstream.url = format!("http://{}/register/{{seller_id}}", link.addr());
    rig.start_replica(replica).await?;
    rig.wait_registered(4).await?;
    link.set_one_way(Duration::ZERO);
    let stats = rig.wait_registered(12).await?;
    assert_eq!(stats.global_violations, 0, "{stats:?}");
    assert!(stats.max_global_in_window <= 4, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    rig.cleanup().await
}

/// Replicas with at most one call of a seller in flight, against a downstream that takes 50 ms
/// to answer: it never sees two calls of one seller at once, and everything registers.
#[tokio::test]
async fn replicas_keep_one_call_of_a_seller_in_flight() -> anyhow::Result<()> {
    let mock = turnstile_lab::mock_api::MockArgs {
        latency_ms: 50,
        ..turnstile_lab::mock_api::MockArgs::local(
            "100/1s".parse::<turnstile_core::config::Limits>()?,
        )
    };
    let mut rig = support::rig_with("leases-rig", leased("100/1s", 1))
        .with_mock(mock)
        .prepare()
        .await?;
    for s in ["S-one", "S-two"] {
        for i in 0..8 {
            rig.publish_product(s, &format!("{s}-{i}"), json!({ "sku": i }))
                .await?;
        }
    }
    rig.start_replicas(2, 4).await?;
    let stats = rig.wait_registered(16).await?;
    for s in ["S-one", "S-two"] {
        assert_eq!(stats.sellers[s].max_in_flight, 1, "{s}: {stats:?}");
    }
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    rig.cleanup().await
}
