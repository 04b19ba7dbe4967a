//! The fleet: replicas announce themselves in Redis, every grant follows the strictest terms of
//! any live replica, and operator tools read the fleet's terms, against the real RabbitMQ and
//! Redis (replicas in this process, and one as a process of its own to be SIGKILLed).

mod support;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use turnstile_core::config::{Algorithm, Limits};
use turnstile_core::fleet::{self, EXPIRY, HEARTBEAT};
use turnstile_core::permit::RedisConn;
use turnstile_core::telemetry::Readiness;
use turnstile_core::worker::Stats;
use turnstile_lab::rig::{Message, Rig};
use turnstile_lab::slow_link::SlowLink;
use turnstile_ops::serve::{ServeArgs, Served};

/// A replica of `rig` with its own stop, granting under `limit`, adaptive limits off (so that
/// only the fleet's terms move the limit), 8 workers.
async fn replica(rig: &Rig, limit: &str, stop: &CancellationToken) -> Served {
    Served::start(replica_args(rig, limit), stop.clone())
        .await
        .expect("a replica starts")
}

/// What [`replica`] starts with.
fn replica_args(rig: &Rig, limit: &str) -> ServeArgs {
    replica_args_under(rig, limit, Algorithm::SlidingWindow)
}

/// What a replica with `limit` under `algorithm` starts with.
fn replica_args_under(rig: &Rig, limit: &str, algorithm: Algorithm) -> ServeArgs {
    let mut settings = rig.settings(8);
    settings.limiter.limit = limit.parse::<Limits>().unwrap();
    settings.limiter.algorithm = algorithm;
    settings.limiter.adaptive = false;
    ServeArgs::from(settings)
}

/// The mock forgets what it saw (and restarts its windows): it counts from now.
async fn reset_mock(rig: &Rig) {
    let base = format!("http://{}", rig.mock.addr());
    let answer = reqwest::Client::new()
        .post(format!("{base}/reset"))
        .send()
        .await
        .expect("the mock answers");
    assert!(answer.status().is_success());
}

async fn fleet_view(rig: &Rig) -> fleet::View {
    let prefix = rig.settings(1).redis.key_prefix;
    fleet::read(rig.store().conn(), &prefix).await.unwrap()
}

/// The fleet once every live replica reports that it grants under the terms in force (a new
/// replica applies them before it consumes, and reports so at its next heartbeat).
async fn applied_fleet(rig: &Rig) -> fleet::View {
    let mut seen = None;
    support::eventually_async("every replica reports the terms in force", async || {
        let fleet = fleet_view(rig).await;
        let applied = fleet.applied;
        seen = Some(fleet);
        applied
    })
    .await;
    seen.unwrap()
}

/// Messages the replicas settled as registered.
fn registered(replicas: &[&Arc<Stats>]) -> u64 {
    replicas
        .iter()
        .map(|stats| stats.registered.load(Ordering::Relaxed))
        .sum()
}

/// Every message published is settled as registered (or as done already: a copy that came
/// back after its registration, its ack lost at a replica's stop), none dead-lettered, none
/// left in a queue. Fails after two minutes saying what it saw: each replica's outcomes, each
/// queue's depth, the API's counts (since its last reset).
async fn nothing_lost(rig: &Rig, replicas: &[&Arc<Stats>], n: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let api = rig.mock.stats();
        let settled: u64 = replicas
            .iter()
            .map(|s| s.registered.load(Ordering::Relaxed) + s.already_done.load(Ordering::Relaxed))
            .sum();
        let depth = rig.depth_everywhere().await.unwrap();
        if settled >= n && depth == 0 {
            break;
        }
        if std::time::Instant::now() >= deadline {
            let mut depths = Vec::new();
            for queue in rig.topology.queues() {
                depths.push(format!("{queue}: {}", rig.depth(&queue).await.unwrap()));
            }
            panic!(
                "not every message settled as registered: replicas {:?}; queues {depths:?}; the API registered {} of {n} ({} requests, {} duplicates, {} violations)",
                replicas.iter().map(|s| outcomes(s)).collect::<Vec<_>>(),
                api.registered,
                api.requests,
                api.duplicates,
                api.violations,
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rig.dead_lettered().await.unwrap(), 0);
}

/// What a replica settled, and what it holds, for a failure's message.
fn outcomes(stats: &Stats) -> String {
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    format!(
        "registered {} done-already {} delayed {} retried {} requeued {} dead {} held {} in flight {}",
        load(&stats.registered),
        load(&stats.already_done),
        load(&stats.delayed),
        load(&stats.retried),
        load(&stats.requeued),
        load(&stats.dead_lettered),
        stats.held.load(Ordering::Relaxed),
        stats.in_flight.load(Ordering::Relaxed),
    )
}

/// A rolling deploy lowering 20/1s to 10/1s, mid-backlog: from the moment the new replica is
/// ready, the downstream (enforcing 10/1s) never sees more than 10 calls in a second, though
/// the old replica keeps running for 3 s; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_deploy_that_lowers_the_limit_holds_the_new_one_from_the_first_new_replica_ready()
{
    let mut rig = support::rig("fleet-lower", "20/1s")
        .with_api_limit("10/1s".parse().unwrap())
        .prepare()
        .await
        .unwrap();
    let n = 100;
    rig.publish("S-1", n).await.unwrap();
    let (stop_old, stop_new) = (CancellationToken::new(), CancellationToken::new());
    let old = replica(&rig, "20/1s", &stop_old).await;
    let old_stats = old.stats.clone();
    support::eventually("the old replica drains", || registered(&[&old_stats]) >= 20).await;

    let new = replica(&rig, "10/1s", &stop_new).await;
    // Ready: the new replica consumes, and every live replica grants under 10/1s.
    reset_mock(&rig).await;
    let fleet = applied_fleet(&rig).await;
    assert_eq!(fleet.replicas.len(), 2);
    assert!(!fleet.agree);
    assert_eq!(fleet.effective.unwrap().limit.to_string(), "10/1s");

    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_old.cancel();
    old.wait().await.unwrap();
    nothing_lost(&rig, &[&old_stats, &new.stats], n as u64).await;
    let seen = rig.mock.stats();
    assert_eq!(
        seen.violations, 0,
        "calls over 10/1s after the new replica was ready: {seen:?}"
    );
    stop_new.cancel();
    new.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// A rolling deploy raising 10/1s to 20/1s: while the old replica lives, every grant follows
/// 10/1s (the downstream enforcing it sees no call over it); once it is gone, 20/1s applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_deploy_that_raises_the_limit_takes_effect_when_the_last_old_replica_is_gone() {
    let mut rig = support::rig("fleet-raise", "10/1s")
        .with_api_limit("10/1s".parse().unwrap())
        .prepare()
        .await
        .unwrap();
    rig.publish("S-1", 40).await.unwrap();
    let (stop_old, stop_new) = (CancellationToken::new(), CancellationToken::new());
    let old = replica(&rig, "10/1s", &stop_old).await;
    let old_stats = old.stats.clone();
    support::eventually("the old replica drains", || registered(&[&old_stats]) >= 20).await;

    let new = replica(&rig, "20/1s", &stop_new).await;
    reset_mock(&rig).await;
    // Work for both replicas (the old one holds what it fetched already).
    rig.publish_all((40..100).map(|i| Message::numbered("S-1", i)).collect())
        .await
        .unwrap();
    let n = 100;
    let fleet = applied_fleet(&rig).await;
    assert_eq!(
        fleet.effective.as_ref().unwrap().limit.to_string(),
        "10/1s",
        "the old replica's stricter terms stay in force"
    );
    assert!(
        fleet.replicas.iter().all(|r| r
            .entry
            .applies
            .as_deref()
            .is_some_and(|t| t.contains(" 10/1s "))),
        "every replica grants under 10/1s: {fleet:?}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let while_old_lived = rig.mock.stats();
    stop_old.cancel();
    old.wait().await.unwrap();
    assert_eq!(
        while_old_lived.violations, 0,
        "calls over 10/1s while the old replica lived: {while_old_lived:?}"
    );
    support::eventually_async("20/1s applies once the old replica is gone", async || {
        let fleet = fleet_view(&rig).await;
        fleet.replicas.len() == 1
            && fleet.applied
            && fleet
                .effective
                .is_some_and(|t| t.limit.to_string() == "20/1s")
    })
    .await;
    nothing_lost(&rig, &[&old_stats, &new.stats], n as u64).await;
    stop_new.cancel();
    new.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// A replica killed with SIGKILL leaves the registry once its entry expires: a read right after
/// that finds it gone, and lost.
#[tokio::test]
async fn a_replica_killed_with_sigkill_leaves_the_registry() {
    let rig = support::rig("fleet-kill", "10/1s").prepare().await.unwrap();
    let settings = rig.settings(2);
    let prefix = settings.redis.key_prefix.clone();
    let conn: RedisConn = rig.store().conn().clone();
    let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("consume")
        .env("TURNSTILE_AMQP_URL", &settings.broker.amqp.url)
        .env("TURNSTILE_REDIS_URL", &settings.redis.url)
        .env("TURNSTILE_KEY_PREFIX", &prefix)
        .env("TURNSTILE_QUEUE", &settings.broker.queue.name)
        .env("TURNSTILE_DOWNSTREAM_URL", rig.mock.url())
        .env("TURNSTILE_LIMIT", "10/1s")
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    support::eventually_async("the replica registers", async || {
        let fleet = fleet::read(&conn, &prefix).await.unwrap();
        fleet
            .replicas
            .iter()
            .any(|r| r.entry.pid == pid && r.entry.ready)
    })
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    tokio::time::sleep(EXPIRY + HEARTBEAT).await;
    let fleet = fleet::read(&conn, &prefix).await.unwrap();
    assert!(
        fleet.replicas.is_empty(),
        "a killed replica is still listed: {fleet:?}"
    );
    assert!(fleet.effective.is_none());
    // No replica was left to see it go: the read finds it lost, and `turnstile status` says so.
    assert!(
        fleet.lost.len() == 1 && fleet.lost[0].pid == pid && fleet.lost[0].ready,
        "the killed replica is listed as lost, consuming when last heard of: {fleet:?}"
    );
    let (code, out, err) = support::run(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .arg("status")
            .env("TURNSTILE_REDIS_URL", &settings.redis.url)
            .env("TURNSTILE_KEY_PREFIX", &prefix),
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("no turnstile replica is alive"), "{err}");
    assert!(
        out.contains("fleet: 0 live replicas (none alive); terms in force: none; 1 lost"),
        "{out}"
    );
    assert!(
        out.contains(&format!("LOST: {} ", fleet.lost[0].id))
            && out.contains("last known: consuming"),
        "{out}"
    );
    rig.cleanup().await.unwrap();
}

/// `turnstile limits get` and `turnstile status` run in a shell whose TURNSTILE_LIMIT is not the
/// replicas' show the fleet's limit; with no replica alive they say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_show_the_fleets_terms_not_their_shells() {
    let rig = support::rig("fleet-tools", "5/1s").prepare().await.unwrap();
    let prefix = rig.settings(1).redis.key_prefix;
    let redis_url = rig.settings(1).redis.url;
    let stop = CancellationToken::new();
    let running = replica(&rig, "5/1s", &stop).await;
    let limits_get = || {
        support::run(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(["limits", "get", "--seller", "S-1"])
                .env("TURNSTILE_REDIS_URL", &redis_url)
                .env("TURNSTILE_KEY_PREFIX", &prefix)
                .env("TURNSTILE_LIMIT", "100/1m"),
        )
    };
    let (code, out, err) = limits_get();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("S-1: 5/1s (default)"), "{out}");
    assert!(!err.contains("no turnstile replica"), "{err}");
    let (code, out, err) = support::run(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .arg("status")
            .env("TURNSTILE_REDIS_URL", &redis_url)
            .env("TURNSTILE_KEY_PREFIX", &prefix)
            .env("TURNSTILE_LIMIT", "100/1m"),
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("fleet: 1 live replica (they agree); terms in force: sliding-window 5/1s"),
        "{out}"
    );

    stop.cancel();
    running.wait().await.unwrap();
    let (code, out, err) = limits_get();
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("no turnstile replica is alive"), "{err}");
    assert!(out.contains("S-1: 100/1m (default)"), "{out}");
    rig.cleanup().await.unwrap();
}

/// A deploy that changes the algorithm: while the old replica lives, the new one grants under
/// the old algorithm (the longest-running replica's); once it is gone, grants under the new one
/// wait until every grant under the old one has left the window, so the limit holds across the
/// switch; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_algorithm_waits_until_the_old_ones_grants_left_the_window() {
    let mut rig = support::rig("fleet-algorithm", "10/1s")
        .prepare()
        .await
        .unwrap();
    rig.publish("S-1", 50).await.unwrap();
    let (stop_old, stop_new) = (CancellationToken::new(), CancellationToken::new());
    let mut old_settings = rig.settings(4);
    old_settings.limiter.algorithm = Algorithm::Gcra;
    old_settings.limiter.adaptive = false;
    let old = Served::start(ServeArgs::from(old_settings), stop_old.clone())
        .await
        .unwrap();
    let old_stats = old.stats.clone();
    support::eventually("the old replica drains", || registered(&[&old_stats]) >= 10).await;
    let new = replica(&rig, "10/1s", &stop_new).await;
    let fleet = fleet_view(&rig).await;
    assert_eq!(
        fleet.effective.unwrap().algorithm,
        Algorithm::Gcra,
        "the longest-running replica's algorithm"
    );

    stop_old.cancel();
    old.wait().await.unwrap();
    let mut switched = None;
    support::eventually_async("the fleet moves to sliding-window", async || {
        let fleet = fleet_view(&rig).await;
        let moved = fleet.applied
            && fleet
                .effective
                .as_ref()
                .is_some_and(|t| t.algorithm == Algorithm::SlidingWindow);
        if moved {
            switched = Some(fleet);
        }
        moved
    })
    .await;
    let switched = switched.unwrap();
    assert!(
        switched.algorithm_fence_until.is_some(),
        "grants under sliding-window wait for gcra's to leave the window: {switched:?}"
    );
    // Nothing is granted while the fence stands (read on Redis's clock, to its end).
    let before = rig.mock.stats().registered;
    let redis_now_ms = || async {
        let (s, us): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut rig.store().conn().clone())
            .await
            .unwrap();
        s * 1000 + us / 1000
    };
    let fence_ms = switched.fence_until_ms;
    let left = fence_ms - redis_now_ms().await - 300;
    if left > 0 {
        tokio::time::sleep(Duration::from_millis(left as u64)).await;
        assert!(redis_now_ms().await < fence_ms);
        assert_eq!(
            rig.mock.stats().registered,
            before,
            "a call was granted under the new algorithm before the old one's left the window"
        );
    }
    nothing_lost(&rig, &[&old_stats, &new.stats], 50).await;
    let seen = rig.mock.stats();
    assert_eq!(seen.violations, 0, "{seen:?}");
    stop_new.cancel();
    new.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// `GET /api/fleet` lists the live replicas with their terms, says whether they agree and which
/// terms are in force; `/metrics` counts them and flags the disagreement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_api_lists_the_replicas_and_the_terms_in_force() {
    let rig = support::rig("fleet-api", "8/1s").prepare().await.unwrap();
    let stop = CancellationToken::new();
    let quiet = replica(&rig, "8/1s", &stop).await;
    let mut settings = rig.settings(2);
    settings.limiter.limit = "5/1s".parse().unwrap();
    let (serving, endpoints) = serving_http(settings, &stop).await;
    let mut fleet = serde_json::Value::Null;
    support::eventually_async("the serving replica's heartbeat sees both", async || {
        fleet = endpoints.fleet().await;
        fleet["replicas"].as_array().is_some_and(|r| r.len() == 2) && fleet["applied"] == true
    })
    .await;
    assert_eq!(fleet["agree"], false, "{fleet}");
    assert_eq!(fleet["effective"]["limit"], "5/1s", "{fleet}");
    assert_eq!(fleet["effective"]["algorithm"], "sliding-window", "{fleet}");
    let replicas = fleet["replicas"].as_array().unwrap();
    let limits: Vec<&str> = replicas
        .iter()
        .map(|r| r["terms"]["limit"].as_str().unwrap())
        .collect();
    assert_eq!(limits, ["8/1s", "5/1s"], "longest-running first: {fleet}");
    for r in replicas {
        for field in ["id", "host", "version", "started", "last_seen"] {
            assert!(r[field].is_string(), "{field} in {r}");
        }
    }
    assert!(
        replicas.iter().any(|r| r["id"] == fleet["me"]),
        "the serving replica names itself: {fleet}"
    );
    // The gauges follow the serving replica's heartbeat, which may come after the read above.
    support::eventually_async("/metrics counts both and their disagreement", async || {
        let metrics = endpoints.metrics().await;
        metrics.contains("turnstile_fleet_replicas 2")
            && metrics.contains("turnstile_fleet_disagreement 1")
    })
    .await;
    stop.cancel();
    quiet.wait().await.unwrap();
    serving.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// An RFC 3339 stamp of the fleet's view, as a time.
/// A replica with `settings` serving its endpoints on a free port, and a reader of them.
async fn serving_http(
    settings: turnstile_core::replica::ConsumeArgs,
    stop: &CancellationToken,
) -> (Served, Endpoints) {
    let serving = Served::start(
        ServeArgs {
            consume: settings,
            http: turnstile_ops::serve::HttpArgs {
                http_addr: turnstile_ops::http::Listen::At("127.0.0.1:0".parse().unwrap()),
                http_token: None,
            },
        },
        stop.clone(),
    )
    .await
    .unwrap();
    let base = format!("http://{}", serving.http_addr.unwrap());
    let endpoints = Endpoints {
        base,
        client: reqwest::Client::new(),
    };
    (serving, endpoints)
}

/// A serving replica's endpoints, read as a client would.
struct Endpoints {
    base: String,
    client: reqwest::Client,
}

impl Endpoints {
    /// `GET /api/fleet`.
    async fn fleet(&self) -> serde_json::Value {
        let answer = self.get("/api/fleet").await;
        answer.json().await.unwrap()
    }

    /// `GET /metrics`.
    async fn metrics(&self) -> String {
        self.get("/metrics").await.text().await.unwrap()
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        let url = format!("{}{path}", self.base);
        self.client.get(url).send().await.unwrap()
    }
}

fn stamp(rfc3339: &str) -> std::time::SystemTime {
    humantime::parse_rfc3339(rfc3339).unwrap_or_else(|e| panic!("{rfc3339}: {e}"))
}

/// A replica that stops renewing its entry (stuck, or cut off from Redis) is listed as lost by
/// the others and by the operator's read: since when, its last heartbeat, and what it last said
/// (not ready, and why); its stricter terms no longer count. Once it beats again it is live and
/// no longer lost; one that leaves is never listed as lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_heartbeating_is_listed_as_lost_until_it_beats_again() {
    let keys = support::Keys::new(support::Backend::Standalone, "fleet-lost").await;
    let member = |limit: &str, ready: &Readiness| {
        let own = support::limiter(limit, Algorithm::SlidingWindow);
        fleet::Member::new(
            &keys.store(own.clone()),
            &keys.prefix,
            own,
            Arc::new(Stats::default()),
            ready.clone(),
            "q",
        )
    };
    let (steady_ready, silent_ready) = (Readiness::default(), Readiness::default());
    steady_ready.set(true);
    let steady = member("20/1s", &steady_ready);
    let silent = member("5/1s", &silent_ready);
    silent_ready.not_ready("the broker did not answer within 5s");
    silent.beat().await.unwrap();
    let both = steady.beat().await.unwrap();
    assert_eq!(both.replicas.len(), 2, "{both:?}");
    assert!(both.lost.is_empty(), "{both:?}");
    assert_eq!(both.effective.unwrap().limit.to_string(), "5/1s");
    let said = both.replicas.iter().find(|r| r.id == silent.id()).unwrap();
    assert!(!said.entry.ready);
    assert_eq!(
        said.entry.not_ready.as_ref().map(|n| n.why.as_str()),
        Some("the broker did not answer within 5s"),
        "a live replica says why it is not ready"
    );

    // `silent` beats no more; `steady` beats on.
    let mut seen = None;
    support::eventually_async("the silent replica is listed as lost", async || {
        let view = steady.beat().await.unwrap();
        let lost = !view.lost.is_empty();
        seen = Some(view);
        lost
    })
    .await;
    let view = seen.unwrap();
    let ids: Vec<&str> = view.replicas.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, [steady.id()], "{view:?}");
    assert_eq!(
        view.effective.as_ref().unwrap().limit.to_string(),
        "20/1s",
        "a lost replica's terms no longer count: {view:?}"
    );
    assert!(view.agree, "{view:?}");
    assert_eq!(view.lost.len(), 1, "{view:?}");
    let lost = &view.lost[0];
    assert_eq!(lost.id, silent.id());
    assert_eq!(lost.pid, std::process::id());
    assert_eq!(
        stamp(&lost.lost_since),
        stamp(&lost.last_seen) + EXPIRY,
        "lost when its entry expired: {lost:?}"
    );
    assert!(stamp(&lost.started) <= stamp(&lost.last_seen), "{lost:?}");
    assert!(!lost.ready, "its last state: {lost:?}");
    assert_eq!(
        lost.not_ready.as_ref().map(|n| n.why.as_str()),
        Some("the broker did not answer within 5s"),
        "and why: {lost:?}"
    );
    let json = serde_json::to_value(&view).unwrap();
    for field in [
        "id",
        "host",
        "version",
        "started",
        "last_seen",
        "lost_since",
    ] {
        assert!(json["lost"][0][field].is_string(), "{field} in {json}");
    }
    let read = fleet::read(&keys.conn, &keys.prefix).await.unwrap();
    assert_eq!(
        read.lost.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        [silent.id()],
        "the operator's read lists it too: {read:?}"
    );

    // It beats again: live, no longer lost, its terms count again.
    silent_ready.set(true);
    let back = silent.beat().await.unwrap();
    assert!(back.lost.is_empty(), "{back:?}");
    let view = steady.beat().await.unwrap();
    assert_eq!(view.replicas.len(), 2, "{view:?}");
    assert!(view.lost.is_empty(), "{view:?}");
    assert_eq!(view.effective.unwrap().limit.to_string(), "5/1s");

    // It leaves: gone, and never listed as lost, however long the others beat on.
    silent.leave().await;
    let until = tokio::time::Instant::now() + EXPIRY + HEARTBEAT;
    while tokio::time::Instant::now() < until {
        let view = steady.beat().await.unwrap();
        assert_eq!(view.replicas.len(), 1, "{view:?}");
        assert!(
            view.lost.is_empty(),
            "a replica that left is not lost: {view:?}"
        );
        tokio::time::sleep(HEARTBEAT).await;
    }
    keys.cleanup().await;
}

/// A replica cut off from Redis (its link reset) is listed as lost by `GET /api/fleet` on
/// another replica, with its last state, and counted by `turnstile_fleet_replicas_lost`; once
/// the link is back it beats again and is live.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fleet_api_lists_a_replica_cut_off_from_redis_as_lost() {
    let rig = support::rig("fleet-cut", "8/1s").prepare().await.unwrap();
    let stop = CancellationToken::new();
    // The first replica reaches Redis through a link of its own, which the test cuts.
    let redis_url = rig.settings(1).redis.url;
    let authority = redis_url
        .split_once("://")
        .map_or(redis_url.as_str(), |(_, rest)| rest)
        .split(['/', '?'])
        .next()
        .unwrap();
    let redis = tokio::net::lookup_host(authority.rsplit('@').next().unwrap())
        .await
        .unwrap()
        .next()
        .unwrap();
    let link = SlowLink::start(redis, Duration::ZERO).await.unwrap();
    let mut settings = rig.settings(2);
    settings.limiter.limit = "5/1s".parse().unwrap();
    settings.redis.url = link.redis_url();
    let cut_off = Served::start(ServeArgs::from(settings), stop.clone())
        .await
        .unwrap();
    let (serving, endpoints) = serving_http(rig.settings(2), &stop).await;
    let mut fleet = serde_json::Value::Null;
    support::eventually_async("both replicas live and ready", async || {
        fleet = endpoints.fleet().await;
        fleet["replicas"]
            .as_array()
            .is_some_and(|r| r.len() == 2 && r.iter().all(|r| r["ready"] == true))
    })
    .await;
    assert_eq!(fleet["effective"]["limit"], "5/1s", "{fleet}");
    assert_eq!(fleet["lost"], serde_json::json!([]), "{fleet}");
    let lost_id = fleet["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] != fleet["me"])
        .unwrap()["id"]
        .clone();

    link.cut();
    support::eventually_async("the cut-off replica is listed as lost", async || {
        fleet = endpoints.fleet().await;
        fleet["lost"].as_array().is_some_and(|l| l.len() == 1)
    })
    .await;
    let lost = &fleet["lost"][0];
    assert_eq!(lost["id"], lost_id, "{fleet}");
    assert_eq!(
        lost["ready"], true,
        "consuming at its last heartbeat: {fleet}"
    );
    for field in ["host", "version", "started", "last_seen", "lost_since"] {
        assert!(lost[field].is_string(), "{field} in {lost}");
    }
    assert_eq!(fleet["replicas"].as_array().unwrap().len(), 1, "{fleet}");
    assert_eq!(
        fleet["effective"]["limit"], "8/1s",
        "its terms no longer count: {fleet}"
    );
    // The gauge follows the serving replica's heartbeat, which may come after the read above.
    support::eventually_async("/metrics counts the lost replica", async || {
        endpoints
            .metrics()
            .await
            .contains("turnstile_fleet_replicas_lost 1")
    })
    .await;

    link.restore();
    support::eventually_async("the replica beats again: live, not lost", async || {
        fleet = endpoints.fleet().await;
        fleet["lost"].as_array().is_some_and(Vec::is_empty)
            && fleet["replicas"].as_array().is_some_and(|r| r.len() == 2)
    })
    .await;
    stop.cancel();
    cut_off.wait().await.unwrap();
    serving.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// A replica with terms far stricter than the fleet's (a shell pointed at production with
/// `TURNSTILE_LIMIT=1/1d`) visits for 4 s with the operator's consent, and leaves: what the
/// fleet applied under its terms is undone, and the backlog drains at the fleet's own pace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_visiting_replica_with_a_stricter_limit_leaves_nothing_stalled_behind() {
    a_stricter_visitor_leaves_nothing_stalled(Algorithm::SlidingWindow, "fleet-visitor").await;
}

/// The same under gcra, whose state is one arrival time per limit: the visitor's day-ahead
/// schedule is brought to the fleet's terms once they apply again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_visiting_replica_with_a_stricter_limit_leaves_nothing_stalled_behind_under_gcra() {
    a_stricter_visitor_leaves_nothing_stalled(Algorithm::Gcra, "fleet-visitor-gcra").await;
}

async fn a_stricter_visitor_leaves_nothing_stalled(algorithm: Algorithm, name: &str) {
    let mut rig = support::rig(name, "20/1s")
        .with_api_limit("20/1s".parse().unwrap())
        .prepare()
        .await
        .unwrap();
    let (stop_fleet, stop_visitor) = (CancellationToken::new(), CancellationToken::new());
    let fleet = Served::start(
        replica_args_under(&rig, "20/1s", algorithm),
        stop_fleet.clone(),
    )
    .await
    .expect("a replica starts");
    rig.publish("S-1", 200).await.unwrap();
    support::eventually("the fleet registers", || registered(&[&fleet.stats]) >= 20).await;

    let mut visiting = replica_args_under(&rig, "1/1d", algorithm);
    visiting.consume.allow_stricter_terms = true;
    let visitor = Served::start(visiting, stop_visitor.clone()).await.unwrap();
    let visitor_stats = visitor.stats.clone();
    support::eventually_async("the fleet applies the visitor's terms", async || {
        let view = fleet_view(&rig).await;
        view.applied
            && view
                .effective
                .is_some_and(|t| t.limit.to_string() == "1/1d")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    rig.publish_all((200..205).map(|i| Message::numbered("S-2", i)).collect())
        .await
        .unwrap();
    stop_visitor.cancel();
    visitor.wait().await.unwrap();
    let (left_at, waiting) = (
        std::time::Instant::now(),
        205 - registered(&[&fleet.stats, &visitor_stats]),
    );

    nothing_lost(&rig, &[&fleet.stats, &visitor_stats], 205).await;
    println!(
        "after the visitor left: {waiting} messages waiting, all registered {:.1} s later (20/1s needs {:.1} s)",
        left_at.elapsed().as_secs_f64(),
        waiting as f64 / 20.0
    );
    let seen = rig.mock.stats();
    assert_eq!(seen.violations, 0, "{seen:?}");
    stop_fleet.cancel();
    fleet.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// A replica whose limit is far stricter than the fleet's (1/1d against 20/1s), started without
/// the operator saying it is intended, is refused: listed, not ready, why given, its terms
/// never counted, so the fleet's sellers drain at the fleet's pace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_far_stricter_than_the_fleet_is_refused_and_its_terms_never_count() {
    let mut rig = support::rig("fleet-refused", "20/1s")
        .with_api_limit("20/1s".parse().unwrap())
        .prepare()
        .await
        .unwrap();
    let (stop_fleet, stop_visitor) = (CancellationToken::new(), CancellationToken::new());
    let fleet = replica(&rig, "20/1s", &stop_fleet).await;
    rig.publish("S-1", 100).await.unwrap();
    support::eventually("the fleet registers", || registered(&[&fleet.stats]) >= 10).await;

    // A refused replica never consumes: its start only returns at its stop.
    let visiting = tokio::spawn(Served::start(
        replica_args(&rig, "1/1d"),
        stop_visitor.clone(),
    ));
    let mut view = None;
    support::eventually_async("the visitor is listed as refused", async || {
        let fleet = fleet_view(&rig).await;
        let refused = fleet.replicas.iter().any(|r| {
            r.entry.refused.is_some() && !r.entry.ready && r.entry.terms.limit.to_string() == "1/1d"
        });
        view = Some(fleet);
        refused
    })
    .await;
    let view = view.unwrap();
    let why = view
        .replicas
        .iter()
        .find_map(|r| r.entry.refused.clone())
        .unwrap();
    assert!(why.contains("TURNSTILE_ALLOW_STRICTER_TERMS"), "{why}");
    for _ in 0..3 {
        let view = fleet_view(&rig).await;
        assert_eq!(
            view.effective.unwrap().limit.to_string(),
            "20/1s",
            "a refused replica's terms never count"
        );
        tokio::time::sleep(HEARTBEAT).await;
    }
    nothing_lost(&rig, &[&fleet.stats], 100).await;
    let seen = rig.mock.stats();
    assert_eq!(seen.violations, 0, "{seen:?}");
    stop_visitor.cancel();
    let _ = visiting.await.unwrap();
    stop_fleet.cancel();
    fleet.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// The registry's key deleted again and again during a rolling deploy that lowers 20/1s to
/// 10/1s: the old replica never grants under 20/1s again (it keeps counting the new replica's
/// terms until they would have expired), so the downstream enforcing 10/1s sees no call over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_registry_never_lets_a_replica_grant_under_looser_terms() {
    let mut rig = support::rig("fleet-deleted", "20/1s")
        .with_api_limit("10/1s".parse().unwrap())
        .prepare()
        .await
        .unwrap();
    let n = 40;
    rig.publish("S-1", n).await.unwrap();
    let (stop_old, stop_new) = (CancellationToken::new(), CancellationToken::new());
    let old = replica(&rig, "20/1s", &stop_old).await;
    let old_stats = old.stats.clone();
    support::eventually("the old replica drains", || registered(&[&old_stats]) >= 20).await;
    let new = replica(&rig, "10/1s", &stop_new).await;
    reset_mock(&rig).await;
    applied_fleet(&rig).await;

    let prefix = rig.settings(1).redis.key_prefix;
    let registry = format!("{prefix}:{{{prefix}~shared}}:fleet");
    let mut conn = rig.store().conn().clone();
    // Fresh work keeps both replicas asking while the registry is deleted under them.
    let mut published = n;
    // For 10 s: longer than an entry lives, so a replica cannot rely on seeing the others
    // between two deletions.
    for _ in 0..34 {
        let _: () = redis::cmd("DEL")
            .arg(&registry)
            .query_async(&mut conn)
            .await
            .unwrap();
        rig.publish_all(
            (published..published + 5)
                .map(|i| Message::numbered("S-1", i))
                .collect(),
        )
        .await
        .unwrap();
        published += 5;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop_old.cancel();
    old.wait().await.unwrap();
    nothing_lost(&rig, &[&old_stats, &new.stats], published as u64).await;
    let seen = rig.mock.stats();
    assert_eq!(
        seen.violations, 0,
        "calls over 10/1s with the registry deleted: {seen:?}"
    );
    stop_new.cancel();
    new.wait().await.unwrap();
    rig.cleanup().await.unwrap();
}
