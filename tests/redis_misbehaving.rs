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
    let redis = LocalRedis::start().unwrap();
    let mut rig = support::rig("refused", "10/1s")
        .on_redis(&redis.url())
        .prepare()
        .await
        .unwrap();
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
