//! A Redis connection recovers after its server restarts, whether or not it was used meanwhile.
mod support;

use std::time::Duration;

use turnstile_core::permit::RedisConn;
use turnstile_lab::local_redis::LocalRedis;

async fn ping(conn: &RedisConn) -> Result<String, redis::RedisError> {
    redis::cmd("PING").query_async(&mut conn.clone()).await
}

#[tokio::test]
async fn an_idle_connection_recovers_after_its_server_restarts() {
    let mut redis = LocalRedis::start().unwrap();
    let conn = RedisConn::connect(&support::redis_args(&redis.url(), "x"))
        .await
        .unwrap();
    assert_eq!(ping(&conn).await.unwrap(), "PONG");
    redis.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    redis.restart().unwrap();
    let mut errors = Vec::new();
    for _ in 0..50 {
        match ping(&conn).await {
            Ok(_) => {
                println!("recovered after {} errors: {errors:?}", errors.len());
                return;
            }
            Err(e) => errors.push(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never recovered: {errors:?}");
}
