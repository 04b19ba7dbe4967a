//! What the Redis server says about itself that decides whether turnstile's state can be lost
//! while it runs: whether it may evict keys (`maxmemory` with a policy other than
//! `noeviction`). A replica refuses to start on such a server unless told it may
//! (`TURNSTILE_ALLOW_EVICTION`), and keeps watching it. Whatever the policy, state lost to an
//! eviction or a flush pauses the sellers it may concern (`losses_since` in
//! `lua/include/losses.lua`). And whether it started less than a window ago: its sellers then
//! wait (`check_server` in the same file), which a replica says once ([`watch_cold_start`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::permit::conn::RedisConn;
use crate::permit::error::PermitError;
use redis::Value;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// One Redis server's memory settings, as `INFO memory` gives them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPolicy {
    /// `maxmemory` in bytes (0: no limit, nothing is ever evicted).
    pub maxmemory: u64,
    /// `maxmemory-policy`, e.g. `noeviction`, `volatile-lru`, `allkeys-lru`.
    pub policy: String,
}

impl MemoryPolicy {
    /// Reads the settings from the text of `INFO memory` (`None` if it does not say).
    pub fn parse(info: &str) -> Option<Self> {
        Some(Self {
            maxmemory: info_field(info, "maxmemory")?.parse().ok()?,
            policy: info_field(info, "maxmemory_policy")?.to_owned(),
        })
    }

    /// Whether the server may evict keys when memory runs short. Every limiter key has a TTL,
    /// so a `volatile-*` policy evicts exactly those.
    pub(crate) fn may_evict(&self) -> bool {
        self.maxmemory > 0 && self.policy != "noeviction"
    }
}

impl std::fmt::Display for MemoryPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "maxmemory-policy {} with maxmemory {}",
            self.policy, self.maxmemory
        )
    }
}

/// One round trip to Redis (PING): whether the link answers, not whether the server accepts
/// writes. On Redis Cluster, to one primary at random (a PING of the whole cluster fails while
/// any one shard fails over): one shard down is not the replica cut off.
pub async fn ping(conn: &RedisConn) -> Result<(), PermitError> {
    match conn {
        RedisConn::Single(manager) => {
            let _: String = redis::cmd("PING").query_async(&mut manager.clone()).await?;
        }
        RedisConn::Cluster(cluster) => {
            use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
            let anyone = RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary);
            cluster
                .clone()
                .route_command(redis::cmd("PING"), anyone)
                .await?;
        }
    }
    Ok(())
}

/// The value of `name` in the text of an INFO section (`name:value` lines).
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
}

/// The text of INFO `section` of every server behind `conn` (each primary of a cluster).
async fn info_texts(conn: &RedisConn, section: &str) -> Result<Vec<String>, PermitError> {
    let answer: Value = redis::cmd("INFO")
        .arg(section)
        .query_async(&mut conn.clone())
        .await?;
    let mut texts = Vec::new();
    collect_texts(answer, &mut texts);
    Ok(texts)
}

/// The memory settings of every server behind `conn` (each primary of a cluster).
pub async fn memory_policies(conn: &RedisConn) -> Result<Vec<MemoryPolicy>, PermitError> {
    let texts = info_texts(conn, "memory").await?;
    let policies: Vec<MemoryPolicy> = texts
        .iter()
        .filter_map(|t| MemoryPolicy::parse(t))
        .collect();
    if policies.is_empty() {
        return Err(PermitError::Answer("INFO memory"));
    }
    Ok(policies)
}

/// The first server of `policies` that may evict keys, if any; the gauge
/// `turnstile_redis_may_evict` says whether there is one.
pub fn evicting(policies: &[MemoryPolicy]) -> Option<&MemoryPolicy> {
    let evicting = policies.iter().find(|p| p.may_evict());
    metrics::gauge!("turnstile_redis_may_evict").set(f64::from(u8::from(evicting.is_some())));
    evicting
}

/// The texts in an answer of INFO: one string, or one per node (a cluster's map).
fn collect_texts(answer: Value, into: &mut Vec<String>) {
    match answer {
        Value::BulkString(bytes) => into.push(String::from_utf8_lossy(&bytes).into_owned()),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => into.push(text),
        Value::Map(pairs) => pairs.into_iter().for_each(|(_, v)| collect_texts(v, into)),
        Value::Array(values) => values.into_iter().for_each(|v| collect_texts(v, into)),
        _ => {}
    }
}

/// How often a running replica looks at the servers' memory settings again.
pub(crate) const WATCH_EVERY: Duration = Duration::from_secs(30);

/// Looks at the servers' memory settings again every [`WATCH_EVERY`] until `stop` (a replica
/// looked once at start): while one may evict keys, says so loudly (an ERROR line each time;
/// the gauge, see [`evicting`]).
pub async fn watch_memory_policy(conn: RedisConn, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(WATCH_EVERY) => {}
            _ = stop.cancelled() => return,
        }
        if let Ok(policies) = memory_policies(&conn).await
            && let Some(policy) = evicting(&policies)
        {
            error!(%policy, "Redis may evict turnstile's keys: a seller whose state is evicted is paused for one window; set maxmemory-policy noeviction");
        }
    }
}

/// One server's start, as `INFO server` gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerStart {
    /// `run_id`: new at every start, different on every server.
    pub run_id: String,
    /// `uptime_in_seconds`: the start is taken as late as it can have been (whole seconds).
    pub uptime: Duration,
}

impl ServerStart {
    /// Reads the start from the text of `INFO server` (`None` if it does not say).
    pub fn parse(info: &str) -> Option<Self> {
        Some(Self {
            run_id: info_field(info, "run_id")?.to_owned(),
            uptime: Duration::from_secs(info_field(info, "uptime_in_seconds")?.parse().ok()?),
        })
    }
}

/// The start of every server behind `conn` (each primary of a cluster).
pub async fn server_starts(conn: &RedisConn) -> Result<Vec<ServerStart>, PermitError> {
    let texts = info_texts(conn, "server").await?;
    let starts: Vec<ServerStart> = texts.iter().filter_map(|t| ServerStart::parse(t)).collect();
    if starts.is_empty() {
        return Err(PermitError::Answer("INFO server"));
    }
    Ok(starts)
}

/// Until when (Unix ms) the sellers on a server of `starts` that started less than `span` ago
/// wait at `now_ms`: `span` after the latest such start (every grant its lost state held was
/// made before it, so none is in any window by then); `None` when none did.
pub fn cold_start_until(starts: &[ServerStart], span: Duration, now_ms: u64) -> Option<u64> {
    starts
        .iter()
        .filter(|s| s.uptime < span)
        .map(|s| now_ms.saturating_sub(s.uptime.as_millis() as u64) + span.as_millis() as u64)
        .max()
}

/// How often a running replica looks at the servers' starts.
pub(crate) const COLD_START_EVERY: Duration = Duration::from_secs(5);

/// Looks at the servers' starts at once and then every [`COLD_START_EVERY`] until `stop`: while
/// one started less than `span` (the longest window + guard of the replica's limits) ago, its
/// sellers wait until `span` after its start (see `check_server` in `lua/include/losses.lua`),
/// which is said once per start (a WARN line with the end and the setting that skips it, an
/// INFO line when it is over), kept in `until_ms` (Unix ms, 0 when none: the console reads it)
/// and in the gauge `turnstile_redis_cold_start_pause_seconds` (seconds left). Nothing waits,
/// and nothing is said, with `durable` (`TURNSTILE_REDIS_DURABLE`).
pub async fn watch_cold_start(
    conn: RedisConn,
    span: Duration,
    durable: bool,
    until_ms: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    if durable {
        return;
    }
    let mut said: Option<u64> = None;
    loop {
        if let Ok(starts) = server_starts(&conn).await {
            let now_ms = crate::domain::unix_ms();
            let until = cold_start_until(&starts, span, now_ms).filter(|u| *u > now_ms);
            match (until, said) {
                (Some(until), Some(before)) if until.abs_diff(before) < 2_000 => {}
                (Some(until), _) => {
                    let uptime = starts.iter().map(|s| s.uptime).min().unwrap_or_default();
                    warn!(
                        uptime_s = uptime.as_secs(),
                        until = %crate::domain::rfc3339(until),
                        "Redis started {}s ago (a restart, a restore or a failover): every seller waits until {} (one window + guard after the start), as grants its lost state held may still count at the downstream; set TURNSTILE_REDIS_DURABLE=true if Redis keeps every acknowledged write",
                        uptime.as_secs(),
                        crate::domain::rfc3339(until)
                    );
                    said = Some(until);
                }
                (None, Some(_)) => {
                    info!("Redis's cold-start pause is over: sellers are granted again");
                    said = None;
                }
                (None, None) => {}
            }
            let left_ms = until.map_or(0, |u| u.saturating_sub(now_ms));
            until_ms.store(until.unwrap_or(0), Ordering::Relaxed);
            metrics::gauge!("turnstile_redis_cold_start_pause_seconds")
                .set(left_ms as f64 / 1000.0);
        }
        tokio::select! {
            _ = tokio::time::sleep(COLD_START_EVERY) => {}
            _ = stop.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_may_evict_only_with_a_memory_limit_and_an_evicting_policy() {
        let info = "# Memory\r\nused_memory:1000\r\nmaxmemory:0\r\nmaxmemory_human:0B\r\nmaxmemory_policy:allkeys-lru\r\n";
        let unlimited = MemoryPolicy::parse(info).unwrap();
        assert_eq!(unlimited.policy, "allkeys-lru");
        assert!(!unlimited.may_evict());
        let limited =
            MemoryPolicy::parse(&info.replace("maxmemory:0", "maxmemory:1048576")).unwrap();
        assert!(limited.may_evict());
        for policy in [
            "volatile-lru",
            "volatile-ttl",
            "allkeys-random",
            "volatile-lfu",
        ] {
            let p = MemoryPolicy {
                maxmemory: 1,
                policy: policy.into(),
            };
            assert!(p.may_evict(), "{policy}");
        }
        let safe = MemoryPolicy {
            maxmemory: 1,
            policy: "noeviction".into(),
        };
        assert!(!safe.may_evict());
        assert_eq!(evicting(&[safe, limited.clone()]), Some(&limited));
        assert!(MemoryPolicy::parse("# Memory\r\nused_memory:1\r\n").is_none());
    }

    #[test]
    fn a_server_started_less_than_a_window_ago_makes_sellers_wait_a_window_from_its_start() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:4f1d\r\nuptime_in_seconds:20\r\n";
        let fresh = ServerStart::parse(info).unwrap();
        assert_eq!(fresh.uptime, Duration::from_secs(20));
        let old = ServerStart {
            run_id: "9a".into(),
            uptime: Duration::from_secs(3600),
        };
        let minute = Duration::from_secs(60) + Duration::from_secs(2);
        let now = 1_000_000;
        assert_eq!(
            cold_start_until(&[old.clone(), fresh.clone()], minute, now),
            Some(now - 20_000 + 62_000)
        );
        assert_eq!(cold_start_until(&[old], minute, now), None);
        assert_eq!(
            cold_start_until(&[fresh], Duration::from_secs(10), now),
            None
        );
        assert!(ServerStart::parse("# Server\r\nrun_id:4f1d\r\n").is_none());
    }
}
