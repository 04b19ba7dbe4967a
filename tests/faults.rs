//! Faults: Redis outages and restarts, a replica killed with SIGKILL, broker connections cut,
//! downstream storms, bad input, secrets. Nothing lost, no limit broken.
mod support;

use std::process::Command;
use std::time::Duration;

use serde_json::json;
use support::asks::decide;
use support::eventually;
use support::{limiter, run};
use turnstile_core::broker::{header_str, headers};
use turnstile_core::config::Algorithm;
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{Ask, Decision, Limiter, PermitStore, RedisConn};
use turnstile_lab::local_redis::LocalRedis;
use turnstile_lab::mock_api::MockArgs;

fn turnstile() -> Command {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
}

#[tokio::test]
async fn a_redis_that_just_started_makes_sellers_wait_out_one_window() {
    let redis = LocalRedis::start().unwrap();
    let conn = RedisConn::connect(&support::redis_args(&redis.url(), "x"))
        .await
        .unwrap();
    let seller = SellerId::parse("S-1").unwrap();
    let mut settings = limiter("5/20s", Algorithm::SlidingWindow);
    settings.redis_durable = false;
    let store = PermitStore::new(conn.clone(), "cold", settings.clone());
    match decide(&store, Ask::new(&seller).without_reserving()).await {
        Decision::Wait { retry_after, .. } => {
            assert!(retry_after > Duration::from_secs(15), "{retry_after:?}")
        }
        other => panic!("granted on a Redis that may have lost a full window: {other:?}"),
    }
    settings.redis_durable = true;
    let durable = PermitStore::new(conn, "durable", settings);
    assert!(matches!(
        decide(&durable, Ask::new(&seller).without_reserving()).await,
        Decision::Granted { .. }
    ));
}

/// A cold-start pause taken under a long window (a far stricter replica's 1/1d in force) ends
/// with the window of the terms in force once they are shorter (the stricter replica gone): the
/// seller does not wait a day for terms no replica holds any more.
#[tokio::test]
async fn a_cold_start_pause_taken_under_a_longer_window_ends_with_the_terms_in_force() {
    let redis = LocalRedis::start().unwrap();
    let conn = RedisConn::connect(&support::redis_args(&redis.url(), "x"))
        .await
        .unwrap();
    let seller = SellerId::parse("S-1").unwrap();
    let mut strict = limiter("1/1d", Algorithm::SlidingWindow);
    strict.redis_durable = false;
    let store = PermitStore::new(conn.clone(), "cold", strict);
    match decide(&store, Ask::new(&seller).without_reserving()).await {
        Decision::Wait { retry_after, .. } => {
            assert!(retry_after > Duration::from_secs(3600), "{retry_after:?}")
        }
        other => panic!("granted on a Redis that may have lost a day's grants: {other:?}"),
    }
    let mut plain = limiter("20/1s", Algorithm::SlidingWindow);
    plain.redis_durable = false;
    let store = PermitStore::new(conn, "cold", plain);
    let mut waits = Vec::new();
    let granted = loop {
        match decide(&store, Ask::new(&seller).without_reserving()).await {
            Decision::Granted { .. } => break true,
            Decision::Wait { retry_after, .. } if waits.len() < 10 => {
                waits.push(retry_after);
                tokio::time::sleep(retry_after.min(Duration::from_secs(5))).await;
            }
            _ => break false,
        }
    };
    assert!(granted, "still paused under 20/1s: told to wait {waits:?}");
    assert!(
        waits.iter().all(|w| *w < Duration::from_secs(60)),
        "the day's pause was kept: {waits:?}"
    );
}

/// Grants at once (without reserving) until the limit says wait; returns the grants' slots.
async fn grant_all(store: &PermitStore, seller: &SellerId, most: usize) -> Vec<i64> {
    let mut slots = Vec::new();
    while slots.len() < most {
        let asked = store.ask(Ask::new(seller).without_reserving()).await;
        match asked.map(|asked| asked.decision) {
            Ok(Decision::Granted { slot_us, .. }) => slots.push(slot_us),
            Ok(_) => break,
            // A Redis still loading its snapshot: ask again.
            Err(error) if error.is_transient() => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(error) => panic!("{error}"),
        }
    }
    slots
}

/// Waits until the private Redis has been up longer than `span` (so that a seller without
/// state is not paused as after a restart).
async fn wait_uptime(conn: &RedisConn, span: Duration) {
    loop {
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        let up: u64 = info
            .lines()
            .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        if Duration::from_secs(up) > span {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A Redis restarted from an RDB snapshot taken after the first of 50 grants (limit 50 per
/// 3 s) has forgotten the other 49, which the downstream still counts. The seller's state was
/// written by the server before the restart (its stamp names the old run id), so it is paused
/// until one window after the restart (sliding-window adds no guard): no grant falls within a
/// window of the old ones.
#[tokio::test]
async fn a_redis_restored_from_an_older_snapshot_lets_no_burst_through() {
    let dir = std::env::temp_dir().join(support::unique("snapshot"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut redis = LocalRedis::start_with_snapshots(&dir).unwrap();
    let conn = RedisConn::connect(&support::redis_args(&redis.url(), "x"))
        .await
        .unwrap();
    let mut settings = limiter("50/3s", Algorithm::SlidingWindow);
    settings.redis_durable = false;
    let span_us: i64 = 3_000_000; // the window (sliding-window adds no guard)
    let store = PermitStore::new(conn.clone(), "snapshot", settings);
    let seller = SellerId::parse("S-restored").unwrap();
    wait_uptime(&conn, Duration::from_micros(span_us as u64)).await;

    let mut before = grant_all(&store, &seller, 1).await;
    let _: () = redis::cmd("SAVE")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    before.extend(grant_all(&store, &seller, 49).await);
    assert_eq!(before.len(), 50, "the window holds 50 grants");
    redis.stop(); // a crash: the 49 grants after the snapshot are lost
    redis.restart().unwrap();
    let after = grant_all(&store, &seller, 50).await;
    let last_before = *before.iter().max().unwrap();
    let within = after.iter().filter(|t| **t < last_before + span_us).count();
    println!(
        "restored from a snapshot holding 1 of 50 grants: {} granted at once after the restart, \
         {within} of them within a window of the 50 before",
        after.len()
    );
    let mut all = before;
    all.extend(&after);
    assert!(
        support::max_in_any_window(&all, span_us) <= 50,
        "a burst went through: {within} grants within the window of the 50 before"
    );
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A replica promoted while it lagged has missed the primary's last grants. The seller's stamp
/// (replicated from the primary) names the primary's run id, so on the promoted replica the
/// seller is paused for one window (sliding-window adds no guard): the missed grants cannot let
/// a burst through.
#[tokio::test]
async fn a_promoted_replica_that_missed_grants_lets_no_burst_through() {
    let primary = LocalRedis::start().unwrap();
    let replica = LocalRedis::start().unwrap();
    let on_primary = RedisConn::connect(&support::redis_args(&primary.url(), "x"))
        .await
        .unwrap();
    let on_replica = RedisConn::connect(&support::redis_args(&replica.url(), "x"))
        .await
        .unwrap();
    let mut settings = limiter("50/3s", Algorithm::SlidingWindow);
    settings.redis_durable = false;
    let span_us: i64 = 3_000_000;
    let seller = SellerId::parse("S-failover").unwrap();
    let store = PermitStore::new(on_primary.clone(), "failover", settings.clone());
    let promoted = PermitStore::new(on_replica.clone(), "failover", settings);
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(primary.port())
        .query_async(&mut on_replica.clone())
        .await
        .unwrap();
    wait_uptime(&on_primary, Duration::from_micros(span_us as u64)).await;
    wait_uptime(&on_replica, Duration::from_micros(span_us as u64)).await;
    // The replica's first sync is done before WAIT counts on it (WAIT would otherwise block
    // for the whole sync, longer than a command may take on this connection).
    support::eventually_async("the replica synced with the primary", async || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut on_replica.clone())
            .await
            .unwrap_or_default();
        info.contains("master_link_status:up")
    })
    .await;

    let mut before = grant_all(&store, &seller, 1).await;
    // The replica has the first grant (and the stamp) ...
    let _: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query_async(&mut on_primary.clone())
        .await
        .unwrap();
    // ... and is promoted; the primary's next 49 grants never reach it (the lag).
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut on_replica.clone())
        .await
        .unwrap();
    before.extend(grant_all(&store, &seller, 49).await);
    assert_eq!(before.len(), 50);
    let after = grant_all(&promoted, &seller, 50).await;
    let mut all = before.clone();
    all.extend(&after);
    let last_before = *before.iter().max().unwrap();
    let within = after.iter().filter(|t| **t < last_before + span_us).count();
    println!(
        "promoted replica that missed 49 of 50 grants: {within} granted within the window of \
         the 50 before"
    );
    assert!(
        support::max_in_any_window(&all, span_us) <= 50,
        "a burst went through on the promoted replica: {within}"
    );
}

#[tokio::test]
async fn a_redis_outage_stops_all_calls_and_its_restart_lets_no_burst_through() -> anyhow::Result<()>
{
    let mut redis = LocalRedis::start().unwrap();
    let mut rig = support::rig("redis-outage", "10/1s")
        .on_redis(&redis.url())
        .prepare()
        .await?;
    let mut settings = rig.settings(4);
    settings.limiter.redis_durable = false;
    rig.start_replica(settings).await?;
    rig.publish("S-outage", 60).await?;
    eventually("some registered", || rig.mock.stats().registered >= 15).await;
    redis.stop();
    tokio::time::sleep(Duration::from_millis(300)).await; // calls granted before the stop finish
    let during = rig.mock.stats().registered;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        rig.mock.stats().registered,
        during,
        "a call was made without a permit (Redis down)"
    );
    redis.restart().unwrap();
    let stats = rig.wait_registered(60).await?;
    assert_eq!(
        (stats.registered, stats.violations, stats.duplicates),
        (60, 0, 0),
        "{stats:?}"
    );
    rig.stop_replicas().await?;
    assert_eq!(rig.depth(rig.topology.work()).await?, 0);
    rig.cleanup().await
}

#[tokio::test]
async fn a_replica_killed_with_sigkill_loses_nothing() -> anyhow::Result<()> {
    let mut rig = support::rig("sigkill", "20/1s").prepare().await?;
    rig.publish("S-busy", 100).await?;
    rig.publish("S-small", 10).await?;
    let mut doomed = support::spawn_consumer(&rig, 4);
    let mut survivor = support::spawn_consumer(&rig, 4);
    eventually("some registered", || rig.mock.stats().registered >= 30).await;
    doomed.kill().unwrap(); // SIGKILL
    doomed.wait().unwrap();
    let registered = rig.wait_registered(110).await;
    survivor.kill().unwrap();
    survivor.wait().unwrap();
    let stats = registered?;
    println!(
        "after SIGKILL: {} registered, {} duplicate calls, {} violations",
        stats.registered, stats.duplicates, stats.violations
    );
    assert_eq!(stats.registered, 110, "every message registered");
    assert_eq!(stats.violations, 0);
    // A duplicate call is possible only for a message whose 2xx arrived at the killed replica
    // before it could write the completion record: at most its 4 in-flight calls.
    assert!(stats.duplicates <= 4, "{stats:?}");
    rig.cleanup().await
}

fn close_connections_named(name_part: &str) -> usize {
    let out = Command::new("rabbitmqctl")
        .args(["list_connections", "pid", "client_properties", "-q"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut closed = 0;
    for line in text.lines().filter(|l| l.contains(name_part)) {
        let pid = line.split_whitespace().next().unwrap();
        let status = Command::new("rabbitmqctl")
            .args(["close_connection", pid, "fault test"])
            .status()
            .unwrap();
        assert!(status.success());
        closed += 1;
    }
    closed
}

#[tokio::test]
async fn a_closed_broker_connection_is_rebuilt_and_nothing_is_lost() -> anyhow::Result<()> {
    let mut rig = support::rig("close-conn", "20/1s").prepare().await?;
    rig.start_replicas(1, 4).await?;
    rig.publish("S-conn", 80).await?;
    eventually("some registered", || rig.mock.stats().registered >= 20).await;
    assert!(
        close_connections_named(rig.topology.work()) >= 1,
        "the replica's connection was found"
    );
    eventually("not ready after the cut", || {
        !rig.replicas().next().unwrap().ready.get()
    })
    .await;
    eventually("ready again", || rig.replicas().next().unwrap().ready.get()).await;
    let stats = rig.wait_registered(80).await?;
    assert_eq!((stats.registered, stats.violations), (80, 0), "{stats:?}");
    rig.stop_replicas().await?;
    assert_eq!(rig.depth(rig.topology.work()).await?, 0);
    rig.cleanup().await
}

#[tokio::test]
async fn a_downstream_storm_is_retried_with_backoff_then_dead_lettered_never_in_a_hot_loop()
-> anyhow::Result<()> {
    let mut rig = support::rig("storm", "100/1s").prepare().await?;
    let mut settings = rig.settings(4);
    settings.max_attempts = 3;
    settings.downstream.timeout = Duration::from_millis(300);
    rig.start_replica(settings.clone()).await?;
    for i in 0..5 {
        rig.publish_product(
            "S-storm",
            &format!("503-{i}"),
            json!({"mock": {"statuses": [503]}}),
        )
        .await?;
        rig.publish_product(
            "S-storm",
            &format!("slow-{i}"),
            json!({"mock": {"statuses": [200], "delay_ms": 1000}}),
        )
        .await?;
        rig.publish_product(
            "S-storm",
            &format!("flaky-{i}"),
            json!({"mock": {"statuses": [503, 502, 200]}}),
        )
        .await?;
    }
    let dead = rig.dead_letters(10).await?;
    let stats = rig.wait_registered(5).await?;
    for d in &dead {
        assert_eq!(
            header_str(d, headers::REASON).as_deref(),
            Some("attempts-exhausted")
        );
    }
    // Exactly one request per attempt: 5 x 3 (503) + 5 x 3 (timeouts) + 5 x 3 (flaky, 3rd ok).
    assert_eq!(stats.requests, 45, "{stats:?}");
    rig.stop_replicas().await?;

    // Connection refused: retried, then dead-lettered with the cause.
    settings.downstream.url = "http://127.0.0.1:9/register/{seller_id}".into();
    rig.start_replica(settings).await?;
    rig.publish_product("S-refused", "refused-1", json!({}))
        .await?;
    let dead = rig.dead_letters(1).await?;
    assert!(
        header_str(&dead[0], headers::DETAIL)
            .unwrap()
            .contains("connection error")
    );
    rig.cleanup().await
}

#[tokio::test]
async fn bad_input_is_dead_lettered_and_unusual_seller_ids_are_registered() -> anyhow::Result<()> {
    let mut rig = support::rig("input", "100/1s").prepare().await?;
    rig.start_replicas(1, 4).await?;
    let nested = format!(
        r#"{{"seller_id":"S","product":{}{}}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let huge = format!(
        r#"{{"seller_id":"S","product":{{"x":"{}"}}}}"#,
        "a".repeat(2 << 20)
    );
    let long_seller = format!(r#"{{"seller_id":"{}","product":{{}}}}"#, "x".repeat(129));
    let bad: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"not json".to_vec(),
        b"\"a string\"".to_vec(),
        br#"{"seller_id":"S","product":"not an object"}"#.to_vec(),
        br#"{"seller_id":["S"],"product":{}}"#.to_vec(),
        br#"{"seller_id":"","product":{}}"#.to_vec(),
        br#"{"seller_id":"a\nb","product":{}}"#.to_vec(),
        long_seller.into_bytes(),
        nested.into_bytes(),
        huge.into_bytes(),
        b"{\"seller_id\":\"S\",\"product\":{\"x\":\"\xff\"}}".to_vec(),
    ];
    for body in &bad {
        rig.publish_body(body).await?;
    }
    let long = "y".repeat(128);
    let unusual = [
        "{brace}",
        "a:b:c",
        "with space",
        "größe",
        "店舗",
        long.as_str(),
    ];
    for (i, seller) in unusual.iter().enumerate() {
        rig.publish_product(seller, &format!("u-{i}"), json!({"i": i}))
            .await?;
    }
    let dead = rig.dead_letters(bad.len()).await?;
    assert!(
        dead.iter()
            .all(|d| header_str(d, headers::REASON).as_deref() == Some("invalid-message"))
    );
    let stats = rig.wait_registered(unusual.len() as u64).await?;
    for seller in unusual {
        let sent_as = SellerId::parse(seller).unwrap().header_value();
        assert!(sent_as.is_ascii());
        assert_eq!(
            stats.sellers[&sent_as].registered, 1,
            "{seller} arrived as {sent_as}"
        );
    }
    assert_eq!(stats.sellers["gr%C3%B6%C3%9Fe"].registered, 1);
    rig.cleanup().await
}

#[test]
fn secrets_never_appear_in_errors_and_config_errors_name_the_setting() {
    // Unreachable services are retried (and logged) until SIGTERM; run each case for 2 s.
    let retrying_for_2s = |amqp_url: &str, redis_url: &str| {
        let mut cmd = Command::new("timeout");
        cmd.args([
            "-s",
            "TERM",
            "2s",
            env!("CARGO_BIN_EXE_turnstile"),
            "consume",
        ])
        .env("TURNSTILE_AMQP_URL", amqp_url)
        .env("TURNSTILE_REDIS_URL", redis_url)
        .env("TURNSTILE_DOWNSTREAM_URL", "http://127.0.0.1:9/{seller_id}")
        .env("TURNSTILE_DOWNSTREAM_TOKEN", "tok-secret")
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("RUST_LOG", "debug");
        let (_, out, err) = run(&mut cmd);
        format!("{out}{err}")
    };
    let redis_refused = retrying_for_2s(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        "redis://:redispass@127.0.0.1:6379/",
    );
    assert!(
        redis_refused.contains("Redis is unavailable; retrying"),
        "{redis_refused}"
    );
    let broker_away = retrying_for_2s("amqp://user:hunter2@127.0.0.1:9/%2f", &support::redis_url());
    assert!(
        broker_away.contains("RabbitMQ is unavailable; retrying"),
        "{broker_away}"
    );
    for secret in ["hunter2", "redispass", "tok-secret"] {
        assert!(
            !redis_refused.contains(secret),
            "{secret} leaked: {redis_refused}"
        );
        assert!(
            !broker_away.contains(secret),
            "{secret} leaked: {broker_away}"
        );
    }
    // A refusal that retrying cannot fix (wrong password) fails the start at once (the guard
    // of 30 s only keeps a regression from hanging the suite).
    let (code, _, err) = run(Command::new("timeout")
        .args([
            "-s",
            "TERM",
            "30s",
            env!("CARGO_BIN_EXE_turnstile"),
            "consume",
        ])
        .env(
            "TURNSTILE_AMQP_URL",
            "amqp://guest:hunter3@127.0.0.1:5672/%2f",
        )
        .env("TURNSTILE_REDIS_URL", support::redis_url())
        .env("TURNSTILE_DOWNSTREAM_URL", "http://127.0.0.1:9/{seller_id}")
        .env("TURNSTILE_HTTP_ADDR", "off"));
    assert_eq!(code, 1, "a refused login fails the start: {err}");
    assert!(
        err.contains("ACCESS_REFUSED") && err.contains("TURNSTILE_AMQP_URL"),
        "{err}"
    );
    assert!(!err.contains("hunter3"), "{err}");
    let (code, _, err) = run(turnstile()
        .arg("consume")
        .env("TURNSTILE_DOWNSTREAM_URL", "x")
        .env("TURNSTILE_AMQP_URL", "amqp://user:hunter2@[nonsense/"));
    assert_eq!(code, 1, "a malformed URL fails at once");
    assert!(
        err.contains("TURNSTILE_AMQP_URL") && !err.contains("hunter2"),
        "{err}"
    );
    let (code, _, err) = run(turnstile()
        .arg("consume")
        .env("TURNSTILE_DOWNSTREAM_URL", "x")
        .env("TURNSTILE_LIMIT", "0/1s"));
    assert_eq!(code, 2);
    assert!(err.contains("TURNSTILE_LIMIT"), "{err}");
    let (code, _, err) = run(turnstile()
        .arg("consume")
        .env_remove("TURNSTILE_DOWNSTREAM_URL"));
    assert_eq!(code, 2);
    assert!(
        err.contains("downstream-url") || err.contains("TURNSTILE_DOWNSTREAM_URL"),
        "{err}"
    );
}

/// From now on, forwards connections on `port` to the test broker (a broker "coming up" there).
async fn broker_comes_up_on(port: u16) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let broker = support::broker::amqp_url();
    let target = broker
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("127.0.0.1:5672")
        .to_owned();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    })
}

async fn http_status(url: &str) -> Option<u16> {
    reqwest::get(url).await.ok().map(|r| r.status().as_u16())
}

#[tokio::test]
async fn a_replica_started_before_redis_and_the_broker_waits_not_ready_then_consumes()
-> anyhow::Result<()> {
    let mut redis = LocalRedis::start().unwrap();
    let mut rig = support::rig("late-services", "50/1s")
        .on_redis(&redis.url())
        .prepare()
        .await?;
    redis.stop();
    let (broker_port, http_port) = (support::free_port(), support::free_port());
    let mut settings = rig.settings(4);
    settings.broker.amqp.url = format!("amqp://guest:guest@127.0.0.1:{broker_port}/%2f");
    let settings = turnstile_ops::serve::ServeArgs {
        consume: settings,
        http: turnstile_ops::serve::HttpArgs {
            http_addr: turnstile_ops::http::Listen::At(([127, 0, 0, 1], http_port).into()),
            http_token: None,
        },
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let starting = tokio::spawn(turnstile_ops::serve::Served::start(
        settings,
        shutdown.clone(),
    ));
    let base = format!("http://127.0.0.1:{http_port}");

    let mut alive = None;
    for _ in 0..500 {
        alive = http_status(&format!("{base}/healthz")).await;
        if alive.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(alive, Some(200), "/healthz answers while Redis is away");
    assert_eq!(http_status(&format!("{base}/readyz")).await, Some(503));

    redis.restart().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!starting.is_finished(), "started without a broker");
    assert_eq!(
        http_status(&format!("{base}/readyz")).await,
        Some(503),
        "ready without a broker"
    );

    let forwarder = broker_comes_up_on(broker_port).await;
    let replica = starting
        .await
        .unwrap()
        .expect("the replica starts once both are up");
    assert_eq!(http_status(&format!("{base}/readyz")).await, Some(200));
    rig.publish("S-late", 30).await?;
    let stats = rig.wait_registered(30).await?;
    assert_eq!((stats.registered, stats.violations), (30, 0), "{stats:?}");
    shutdown.cancel();
    replica.wait().await.unwrap();
    forwarder.abort();
    rig.cleanup().await
}

#[tokio::test]
async fn sigterm_under_load_finishes_in_flight_calls_returns_the_rest_and_exits_zero()
-> anyhow::Result<()> {
    // A slow downstream keeps all 16 workers busy, and limits hold or delay most messages.
    let mut rig = support::rig("sigterm-load", "20/1s")
        .with_mock(MockArgs {
            latency_ms: 300,
            ..MockArgs::local("20/1s".parse::<turnstile_core::config::Limits>()?)
        })
        .prepare()
        .await?;
    for seller in ["S-a", "S-b", "S-c", "S-d", "S-e"] {
        rig.publish(seller, 60).await?;
    }
    let mut child = support::spawn_consumer(&rig, 16);
    eventually("some registered", || rig.mock.stats().registered >= 40).await;
    let in_flight_at_signal = rig.mock.stats();
    let signalled = std::time::Instant::now();
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let exited = tokio::task::spawn_blocking(move || {
        // A guard against a hang (the replica's own grace is 8 s), not a speed check.
        for _ in 0..600 {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        None
    })
    .await
    .unwrap();
    let took = signalled.elapsed();
    let status = exited.expect("the replica exits after SIGTERM");
    println!(
        "SIGTERM with {} registered: exit {:?} after {took:?}",
        in_flight_at_signal.registered,
        status.code()
    );
    assert_eq!(status.code(), Some(0), "exit code after SIGTERM");

    rig.start_replicas(1, 16).await?;
    let stats = rig.wait_registered(300).await?;
    rig.stop_replicas().await?;
    assert_eq!(
        (stats.registered, stats.duplicates, stats.violations),
        (300, 0, 0),
        "{stats:?}"
    );
    assert_eq!(rig.depth_everywhere().await?, 0);
    rig.cleanup().await
}
