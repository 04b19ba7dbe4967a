//! Redis misbehaving as production Redis does, each on a `redis-server` of its own: refused
//! writes (OOM, MISCONF), state lost to a flush or to eviction. No good message is
//! dead-lettered, no limit is broken, and the backlog resumes when Redis does.
mod support;

use std::time::Duration;

use redis::AsyncCommands;
use support::eventually;
use turnstile_core::permit::{RedisConn, keys_matching};
use turnstile_lab::local_redis::LocalRedis;
use turnstile_lab::rig::Rig;

/// A `redis-server` of the test's own, and a rig (enforcing `limit`) on it.
async fn rig_on_own_redis(what: &str, limit: &str) -> (LocalRedis, Rig) {
    let redis = LocalRedis::start().unwrap();
    let rig = support::rig(what, limit)
        .on_redis(&redis.url())
        .prepare()
        .await
        .unwrap();
    (redis, rig)
}

/// Runs `CONFIG SET name value` on `redis`.
async fn config_set(redis: &LocalRedis, name: &str, value: &str) {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// The answer of a plain write on `redis` now: `Ok` or the server's error code.
async fn write_answer(redis: &LocalRedis) -> Result<(), String> {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    conn.set::<_, _, ()>("probe", "1")
        .await
        .map_err(|e| e.code().unwrap_or("?").to_owned())
}

/// Ways a Redis refuses writes for a while.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    /// `maxmemory` reached under `noeviction`: `-OOM`.
    OutOfMemory,
    /// The last snapshot failed (its folder is gone) with `stop-writes-on-bgsave-error`:
    /// `-MISCONF`.
    FailingDisk,
}

impl Refusal {
    async fn begin(self, redis: &LocalRedis) {
        match self {
            Refusal::OutOfMemory => {
                config_set(redis, "maxmemory-policy", "noeviction").await;
                config_set(redis, "maxmemory", "1").await;
            }
            Refusal::FailingDisk => {
                config_set(redis, "save", "3600 1").await;
                config_set(redis, "stop-writes-on-bgsave-error", "yes").await;
                std::fs::remove_dir_all(redis.dir()).unwrap();
                bgsave(redis).await;
            }
        }
        let expected = match self {
            Refusal::OutOfMemory => "OOM",
            Refusal::FailingDisk => "MISCONF",
        };
        let mut answer = Ok(());
        for _ in 0..200 {
            answer = write_answer(redis).await;
            if answer.as_ref().err().map(String::as_str) == Some(expected) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{self:?}: writes were not refused with {expected}: {answer:?}");
    }

    async fn end(self, redis: &LocalRedis) {
        match self {
            Refusal::OutOfMemory => config_set(redis, "maxmemory", "0").await,
            // (The server's working folder stays the one removed: only this lifts it.)
            Refusal::FailingDisk => config_set(redis, "stop-writes-on-bgsave-error", "no").await,
        }
        eventually_async_ok(redis).await;
    }
}

/// Starts a background save (it fails or succeeds in the background).
async fn bgsave(redis: &LocalRedis) {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: Result<String, _> = redis::cmd("BGSAVE").query_async(&mut conn).await;
}

async fn eventually_async_ok(redis: &LocalRedis) {
    for _ in 0..400 {
        if write_answer(redis).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("writes never resumed");
}

/// A backlog under way, Redis refusing writes for a while (while sellers never seen before
/// send their first messages), then accepting them again: nothing is dead-lettered, everything
/// registers within the limit, once.
async fn refused_writes_are_waited_out(refusal: Refusal, refuse_for: Duration) {
    let (redis, mut rig) = rig_on_own_redis("refused", "10/1s").await;
    let settings = rig.settings(4);
    rig.start_replica(settings).await.unwrap();
    rig.publish("S-backlog", 40).await.unwrap();
    eventually("some registered", || rig.mock.stats().registered >= 12).await;
    refusal.begin(&redis).await;
    for i in 0..10 {
        rig.publish(&format!("S-new-{i}"), 2).await.unwrap();
    }
    tokio::time::sleep(refuse_for).await;
    let dead_meanwhile = rig.dead_lettered().await.unwrap();
    refusal.end(&redis).await;
    let stats = rig.wait_registered(60).await.unwrap();
    wait_settled(&rig, 60).await;
    let dead = rig.dead_lettered().await.unwrap();
    let done = format!("{}:*:done:*", rig.key_prefix);
    let records = keys_matching(
        &RedisConn::connect(&support::redis_args(&redis.url(), "x"))
            .await
            .unwrap(),
        &done,
    )
    .await
    .unwrap()
    .len();
    println!(
        "{refusal:?} for {refuse_for:?}: registered {}, violations {}, duplicates {}, dead letters {dead_meanwhile} then {dead}, completion records {records}",
        stats.registered, stats.violations, stats.duplicates
    );
    assert_eq!(
        dead_meanwhile, 0,
        "{refusal:?}: good messages dead-lettered"
    );
    assert_eq!(
        (
            stats.registered,
            stats.violations,
            stats.duplicates,
            dead,
            records
        ),
        (60, 0, 0, 0, 60),
        "{refusal:?}: {stats:?}"
    );
    rig.stop_replicas().await.unwrap();
    assert_eq!(
        rig.depth_everywhere().await.unwrap(),
        0,
        "nothing left behind"
    );
    rig.cleanup().await.unwrap();
}

async fn wait_settled(rig: &Rig, n: u64) {
    rig.wait_settled_registered(n).await.unwrap();
}

#[tokio::test]
async fn a_redis_out_of_memory_for_a_while_dead_letters_nothing_and_breaks_no_limit() {
    for refuse_for in [Duration::from_millis(1500), Duration::from_secs(6)] {
        refused_writes_are_waited_out(Refusal::OutOfMemory, refuse_for).await;
    }
}

#[tokio::test]
async fn a_redis_that_cannot_persist_for_a_while_dead_letters_nothing_and_breaks_no_limit() {
    for refuse_for in [Duration::from_millis(1500), Duration::from_secs(6)] {
        refused_writes_are_waited_out(Refusal::FailingDisk, refuse_for).await;
    }
}

/// Ways a live Redis loses a seller's limiter state, and the operator's safe way to drop it.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// `FLUSHALL`.
    Flush,
    /// Eviction under `maxmemory` with this policy, until the seller's log is gone.
    Eviction(&'static str),
    /// `turnstile limits reset --seller …` (what to do instead of deleting keys by hand).
    Reset,
}

/// The INFO field `name` of `section`, as text.
async fn info_field(
    conn: &mut redis::aio::MultiplexedConnection,
    section: &str,
    name: &str,
) -> String {
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Waits until `redis` has been up `seconds` (past the cold start of a Redis that has just
/// started, see check_server), and gives a connection to it.
async fn past_cold_start(redis: &LocalRedis, seconds: u64) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    while info_field(&mut conn, "server", "uptime_in_seconds")
        .await
        .parse::<u64>()
        .unwrap()
        < seconds
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    conn
}

impl Loss {
    /// Makes the state of `seller` (keys under `prefix`) go.
    async fn strike(self, redis: &LocalRedis, rig: &Rig, seller: &str) {
        let client = redis::Client::open(redis.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let seller_id = turnstile_core::domain::SellerId::parse(seller).unwrap();
        let log = rig
            .store()
            .keys()
            .state(&seller_id, turnstile_core::config::Algorithm::SlidingWindow);
        let exists = |conn: &mut redis::aio::MultiplexedConnection| {
            let mut conn = conn.clone();
            let log = log.clone();
            async move { conn.exists::<_, bool>(&log).await.unwrap() }
        };
        assert!(exists(&mut conn).await, "the seller has a log to lose");
        match self {
            Loss::Flush => {
                let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
            }
            Loss::Eviction(policy) => {
                let used: u64 = info_field(&mut conn, "memory", "used_memory")
                    .await
                    .parse()
                    .unwrap();
                config_set(redis, "maxmemory-policy", policy).await;
                config_set(redis, "maxmemory", &(used + (4 << 20)).to_string()).await;
                let junk = vec![b'x'; 100_000];
                let mut n = 0;
                while exists(&mut conn).await {
                    assert!(n < 20_000, "{policy}: the seller's log was never evicted");
                    let mut set = redis::cmd("SET");
                    set.arg(format!("junk-{n}")).arg(&junk);
                    if policy.starts_with("volatile") {
                        set.arg("EX").arg(3600);
                    }
                    let _: Result<(), _> = set.query_async(&mut conn).await;
                    n += 1;
                }
                let evicted = info_field(&mut conn, "stats", "evicted_keys").await;
                println!(
                    "{policy}: the seller's log evicted after {n} junk keys ({evicted} keys evicted)"
                );
                config_set(redis, "maxmemory", "0").await;
            }
            Loss::Reset => {
                let paused = rig.admin().reset(&seller_id).await.unwrap();
                assert!(!exists(&mut conn).await, "reset forgets the log");
                println!("reset: paused for {paused:?}");
            }
        }
    }
}

/// A seller took its whole limit, its state goes, and as many messages again arrive at once:
/// the downstream, enforcing the limit on its own clock, sees no window with more than the
/// limit.
async fn lost_state_lets_no_burst_through(loss: Loss) {
    let (redis, mut rig) = rig_on_own_redis("lost-state", "5/3s").await;
    let mut settings = rig.settings(4);
    settings.limiter.redis_durable = false;
    rig.start_replica(settings).await.unwrap();
    past_cold_start(&redis, 4).await;
    rig.publish("S-lost", 5).await.unwrap();
    rig.wait_settled_registered(5).await.unwrap();
    loss.strike(&redis, &rig, "S-lost").await;
    for i in 0..5 {
        let id = format!("S-lost-after-{i}");
        rig.publish_product("S-lost", &id, serde_json::json!({ "sku": id }))
            .await
            .unwrap();
    }
    let stats = rig.wait_registered(10).await.unwrap();
    rig.wait_settled_registered(10).await.unwrap();
    let seller = &stats.sellers["S-lost"];
    println!(
        "{loss:?}: registered {}, violations {}, most in a window {} of 5",
        stats.registered, stats.violations, seller.max_in_window
    );
    assert_eq!(
        (stats.registered, stats.violations, stats.duplicates),
        (10, 0, 0),
        "{loss:?}: a burst went through"
    );
    rig.stop_replicas().await.unwrap();
    rig.cleanup().await.unwrap();
}

#[tokio::test]
async fn a_flushed_redis_lets_no_burst_through() {
    for _ in 0..2 {
        lost_state_lets_no_burst_through(Loss::Flush).await;
    }
}

#[tokio::test]
async fn state_evicted_under_any_policy_lets_no_burst_through() {
    for policy in ["volatile-lru", "allkeys-lru", "volatile-ttl"] {
        lost_state_lets_no_burst_through(Loss::Eviction(policy)).await;
    }
}

#[tokio::test]
async fn a_seller_reset_by_the_operator_lets_no_burst_through() {
    lost_state_lets_no_burst_through(Loss::Reset).await;
}

#[tokio::test]
async fn a_replica_refuses_a_redis_that_may_evict_unless_allowed() {
    let (redis, mut rig) = rig_on_own_redis("evicting", "5/1s").await;
    config_set(&redis, "maxmemory", "100000000").await;
    config_set(&redis, "maxmemory-policy", "volatile-lru").await;
    let refused = rig
        .start_replica(rig.settings(1))
        .await
        .err()
        .expect("refused");
    let said = format!("{refused:#}");
    println!("{said}");
    assert!(
        said.contains("maxmemory-policy volatile-lru") && said.contains("TURNSTILE_ALLOW_EVICTION"),
        "{said}"
    );
    let mut allowed = rig.settings(1);
    allowed.allow_eviction = true;
    rig.start_replica(allowed).await.unwrap();
    rig.publish("S-1", 3).await.unwrap();
    rig.wait_settled_registered(3).await.unwrap();
    rig.stop_replicas().await.unwrap();
    rig.cleanup().await.unwrap();
}

/// A replica on a Redis that started moments ago says why every seller waits and until when,
/// once: the console's Redis cold start (its end one window + guard after Redis's start) and
/// `turnstile_redis_cold_start_pause_seconds` counting down to it; nothing of it when Redis
/// is declared durable.
#[tokio::test]
async fn a_redis_started_moments_ago_is_said_with_the_end_of_its_pause() {
    use turnstile_ops::http::Listen;
    use turnstile_ops::serve::{HttpArgs, ServeArgs};
    let redis = LocalRedis::start().unwrap();
    let mut rig = support::rig("cold-start", "5/30s")
        .on_redis(&redis.url())
        .prepare()
        .await
        .unwrap();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for durable in [false, true] {
        let mut consume = rig.settings(2);
        consume.limiter.redis_durable = durable;
        let http = HttpArgs {
            http_addr: Listen::At("127.0.0.1:0".parse().unwrap()),
            http_token: None,
        };
        rig.start_replica(ServeArgs { consume, http })
            .await
            .unwrap();
        let addr = rig.replicas().last().unwrap().http_addr.unwrap();
        let get = |path: &'static str| async move {
            reqwest::get(format!("http://{addr}{path}"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        };
        let uptime_s: u64 = info_field(&mut conn, "server", "uptime_in_seconds")
            .await
            .parse()
            .unwrap();
        let seconds_left = || async {
            let page = get("/metrics").await;
            page.lines()
                .find_map(|l| l.strip_prefix("turnstile_redis_cold_start_pause_seconds "))
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        if durable {
            assert_eq!(seconds_left().await, Some(0.0), "durable: nothing waits");
            let snapshot: serde_json::Value =
                serde_json::from_str(&get("/api/dashboard").await).unwrap();
            assert!(
                snapshot["replica"]
                    .get("redis_cold_start_until_ms")
                    .is_none(),
                "{}",
                snapshot["replica"]
            );
            continue;
        }
        support::eventually_async("the cold start is read", async || {
            seconds_left().await.is_some_and(|s| s > 0.0)
        })
        .await;
        // 30 s + a guard of 1.5 s from a start at most `uptime_s` (+ 1, whole seconds) ago.
        let left = seconds_left().await.unwrap();
        let most = 31.5 - uptime_s as f64;
        assert!(left <= most, "{left} s left, uptime {uptime_s} s");
        let snapshot: serde_json::Value =
            serde_json::from_str(&get("/api/dashboard").await).unwrap();
        let until = snapshot["replica"]["redis_cold_start_until_ms"]
            .as_u64()
            .expect("the console says until when");
        let now = snapshot["now_ms"].as_u64().unwrap();
        assert!(until > now && until - now <= 31_500, "{until} - {now}");
        rig.stop_replicas().await.unwrap();
    }
    rig.cleanup().await.unwrap();
}

/// A flush of another database of the same Redis leaves this one's sellers alone: each seller's
/// stamp is still there, so nothing it was granted was lost, and it is not paused; a flush of
/// its own database (its stamp gone with its state) still pauses it for one window + guard.
#[tokio::test]
async fn a_flush_of_another_database_pauses_no_seller_but_one_of_its_own_does() {
    use support::asks::decide;
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::SellerId;
    use turnstile_core::permit::{Ask, Decision};
    let redis = LocalRedis::start().unwrap();
    let keys = support::Keys::at(&redis.url(), "other-db").await;
    let mut limiter = support::limiter("5/1s", Algorithm::SlidingWindow);
    limiter.redis_durable = false;
    let store = keys.store(limiter);
    // Past the cold start of a Redis that has just started (one window + guard).
    let mut conn = past_cold_start(&redis, 3).await;
    let seller = SellerId::parse("S-other-db").unwrap();
    let first = decide(&store, Ask::new(&seller)).await;
    assert!(matches!(first, Decision::Granted { .. }), "{first:?}");

    let other = redis::Client::open(format!("{}1", redis.url())).unwrap();
    let mut other = other.get_multiplexed_async_connection().await.unwrap();
    let _: () = other.set("another-app", "x").await.unwrap();
    let () = redis::cmd("FLUSHDB").query_async(&mut other).await.unwrap();
    let after_other = decide(&store, Ask::new(&seller)).await;
    assert!(
        matches!(after_other, Decision::Granted { .. }),
        "a flush of database 1 paused a seller of database 0: {after_other:?}"
    );

    let () = redis::cmd("FLUSHDB").query_async(&mut conn).await.unwrap();
    let after_own = decide(&store, Ask::new(&seller)).await;
    let waits = match &after_own {
        Decision::Wait { retry_after, .. } | Decision::Deferred { retry_after, .. } => *retry_after,
        other => panic!("a flush of its own database paused nothing: {other:?}"),
    };
    println!("after a flush of its own database: told to come back in {waits:?}");
    assert!(
        waits > Duration::from_millis(500),
        "paused for about a window: {after_own:?}"
    );
    keys.cleanup().await;
}
