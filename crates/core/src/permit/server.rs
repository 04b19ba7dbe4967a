//! What the Redis server says about itself that decides whether turnstile's state can be lost
//! while it runs: whether it may evict keys (`maxmemory` with a policy other than
//! `noeviction`). A replica refuses to start on such a server unless told it may
//! (`TURNSTILE_ALLOW_EVICTION`), and keeps watching it. Whatever the policy, state lost to an
//! eviction or a flush pauses the sellers it may concern (`losses_since` in
//! `lua/include/losses.lua`).

use std::time::Duration;

use crate::permit::conn::RedisConn;
use crate::permit::error::PermitError;
use redis::Value;
use tokio_util::sync::CancellationToken;
use tracing::error;

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
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
        };
        Some(Self {
            maxmemory: field("maxmemory")?.parse().ok()?,
            policy: field("maxmemory_policy")?.to_owned(),
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

/// The memory settings of every server behind `conn` (each primary of a cluster).
pub async fn memory_policies(conn: &RedisConn) -> Result<Vec<MemoryPolicy>, PermitError> {
    let answer: Value = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn.clone())
        .await?;
    let mut texts = Vec::new();
    collect_texts(answer, &mut texts);
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
}
