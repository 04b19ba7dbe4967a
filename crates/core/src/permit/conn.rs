//! One Redis connection type over standalone Redis and Redis Cluster.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use redis::AsyncCommands;

use crate::config::{RedisArgs, redact_url};
use crate::permit::error::PermitError;
use crate::permit::keys::Keyspace;

/// A cheap-to-clone, self-reconnecting connection to Redis or to a Redis Cluster.
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// How long a Redis call may take before it fails (the caller then retries with backoff).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A checked Redis configuration, not yet connected: building it catches every configuration
/// error, so that connecting can then be retried for as long as Redis is away.
#[derive(Clone)]
pub struct RedisClient {
    client: Client,
    /// The URLs with passwords hidden, for messages.
    shown: String,
}

#[derive(Clone)]
enum Client {
    Single(redis::Client),
    Cluster(Box<ClusterClient>),
}

impl RedisClient {
    /// Checks `TURNSTILE_REDIS_URL` / `TURNSTILE_REDIS_CLUSTER` without connecting.
    pub fn new(args: &RedisArgs) -> anyhow::Result<Self> {
        let urls: Vec<&str> = args
            .url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        anyhow::ensure!(!urls.is_empty(), "TURNSTILE_REDIS_URL is empty");
        let shown = shown_urls(&urls);
        if urls.len() > 1 || args.cluster {
            let client = ClusterClient::builder(urls.clone())
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(RESPONSE_TIMEOUT)
                .build()
                .with_context(|| format!("TURNSTILE_REDIS_URL {shown:?} is not a valid list of Redis Cluster node URLs"))?;
            Ok(Self {
                client: Client::Cluster(Box::new(client)),
                shown,
            })
        } else {
            let client = redis::Client::open(urls[0]).with_context(|| {
                format!("TURNSTILE_REDIS_URL {shown:?} is not a valid Redis URL")
            })?;
            Ok(Self {
                client: Client::Single(client),
                shown,
            })
        }
    }

    /// Connects; fails when Redis cannot be reached (worth retrying).
    pub async fn connect(&self) -> anyhow::Result<RedisConn> {
        match &self.client {
            Client::Cluster(client) => {
                let conn = client.get_async_connection().await.with_context(|| {
                    format!("cannot connect to Redis Cluster at {}", self.shown)
                })?;
                Ok(RedisConn::Cluster(conn))
            }
            Client::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(RESPONSE_TIMEOUT))
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_secs(1));
                let conn = client
                    .get_connection_manager_with_config(config)
                    .await
                    .with_context(|| format!("cannot connect to Redis at {}", self.shown))?;
                Ok(RedisConn::Single(conn))
            }
        }
    }
}

fn shown_urls(urls: &[&str]) -> String {
    urls.iter()
        .map(|u| redact_url(u))
        .collect::<Vec<_>>()
        .join(",")
}

impl RedisConn {
    /// Connects as `TURNSTILE_REDIS_URL` / `TURNSTILE_REDIS_CLUSTER` say (once, no retry).
    pub async fn connect(args: &RedisArgs) -> anyhow::Result<Self> {
        RedisClient::new(args)?.connect().await
    }
}

/// Requests sent to Redis by this process (a pipeline counts once): what
/// `turnstile bench throughput` divides by the messages registered.
static ROUND_TRIPS: AtomicU64 = AtomicU64::new(0);

/// Requests this process has sent to Redis so far (every connection, a pipeline counting once).
pub fn round_trips() -> u64 {
    ROUND_TRIPS.load(Ordering::Relaxed)
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        ROUND_TRIPS.fetch_add(1, Ordering::Relaxed);
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        ROUND_TRIPS.fetch_add(1, Ordering::Relaxed);
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Every key matching a glob pattern: KEYS on each primary of a cluster, SCAN elsewhere. Meant
/// for operator commands and cleanup over a prefix, not for the hot path.
pub async fn keys_matching(conn: &RedisConn, pattern: &str) -> Result<Vec<String>, PermitError> {
    let mut conn = conn.clone();
    if let RedisConn::Cluster(_) = conn {
        return Ok(redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut conn)
            .await?);
    }
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// Bytes Redis uses for `key` (`MEMORY USAGE key SAMPLES 0`: exact), or `None` if it does not
/// exist. For benchmarks and tests that weigh the limiter's state.
pub async fn memory_usage(conn: &RedisConn, key: &str) -> Result<Option<u64>, PermitError> {
    Ok(redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut conn.clone())
        .await?)
}

/// Bytes Redis uses for every key that starts with `prefix:`.
pub async fn memory_of_prefix(conn: &RedisConn, prefix: &str) -> Result<u64, PermitError> {
    let mut total = 0;
    for key in keys_matching(conn, &Keyspace::new(prefix).everything()).await? {
        total += memory_usage(conn, &key).await?.unwrap_or(0);
    }
    Ok(total)
}

/// Deletes every key that starts with `prefix:` (for demos, benchmarks and tests that clean up
/// after themselves).
pub async fn delete_prefix(conn: &RedisConn, prefix: &str) -> anyhow::Result<()> {
    let mut unlink = conn.clone();
    for key in keys_matching(conn, &Keyspace::new(prefix).everything()).await? {
        let _: i64 = unlink.unlink(&key).await?;
    }
    Ok(())
}
