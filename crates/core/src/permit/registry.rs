//! The fleet's registry in Redis (`lua/fleet.lua`): each replica's entry, renewed every
//! heartbeat and taken out when it stops, the replicas lost lately (their entries expired
//! unrenewed), and the algorithms the fleet granted under. What the
//! entries say and what follows from them is `crate::fleet`'s; this is only their storage.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::config::Algorithm;
use crate::permit::calls::{FleetAction, FleetAnswer, FleetCall};
use crate::permit::conn::RedisConn;
use crate::permit::error::PermitError;
use crate::permit::keys::Keyspace;

/// Calls of `lua/fleet.lua` by this process (every registry: heartbeats, joins, leaves): the
/// fleet's fixed cost to Redis, which `turnstile bench scenario` reports apart from the
/// registrations'.
static FLEET_CALLS: AtomicU64 = AtomicU64::new(0);

/// Calls of `lua/fleet.lua` this process has sent so far (see [`FLEET_CALLS`]).
pub fn fleet_calls() -> u64 {
    FLEET_CALLS.load(Ordering::Relaxed)
}

/// The fleet's registry under a key prefix.
#[derive(Clone)]
pub struct Registry {
    conn: RedisConn,
    keys: Keyspace,
}

/// One replica's entry: a live one's, or a lost one's last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    pub id: String,
    /// Its first heartbeat (since it was last live), Redis ms.
    pub since_ms: i64,
    /// Its last heartbeat, Redis ms.
    pub last_ms: i64,
    /// What it announced (JSON, as it wrote it: read it as untrusted).
    pub entry: String,
    /// When its entry expired unrenewed (its last heartbeat + its expiry), Redis ms: `Some`
    /// for a lost replica only.
    pub lost_ms: Option<i64>,
}

/// The registry as one call saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roll {
    /// Redis's time when it was read, ms.
    pub now_ms: i64,
    /// The live replicas, in no order.
    pub members: Vec<Registered>,
    /// The replicas lost within the retention asked for (their entries expired unrenewed;
    /// not those that left), in no order.
    pub lost: Vec<Registered>,
    /// When each algorithm was last granted under (Redis ms).
    pub algorithms: Vec<(Algorithm, i64)>,
    /// The replicas that left lately (stopped cleanly: not lost), by id.
    pub left: Vec<String>,
}

impl Registry {
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        Self {
            conn,
            keys: Keyspace::new(prefix),
        }
    }

    fn call<'a>(&self, action: FleetAction<'a>, lost_for: Duration) -> FleetCall<'a> {
        FleetCall {
            fleet: self.keys.fleet(),
            algorithms: self.keys.fleet_algorithms(),
            lost: self.keys.fleet_lost(),
            left: self.keys.fleet_left(),
            action,
            lost_retain_ms: lost_for.as_millis().max(1) as u64,
        }
    }

    async fn run(&self, call: FleetCall<'_>) -> Result<Roll, PermitError> {
        FLEET_CALLS.fetch_add(1, Ordering::Relaxed);
        let (now_ms, members, algorithms, lost, left): FleetAnswer = call
            .invocation()
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(Roll {
            now_ms,
            members: members
                .into_iter()
                .map(|(id, since_ms, last_ms, entry)| Registered {
                    id,
                    since_ms,
                    last_ms,
                    entry,
                    lost_ms: None,
                })
                .collect(),
            lost: lost
                .into_iter()
                .map(|(id, lost_ms, last_ms, since_ms, entry)| Registered {
                    id,
                    since_ms,
                    last_ms,
                    entry,
                    lost_ms: Some(lost_ms),
                })
                .collect(),
            algorithms: algorithms
                .chunks(2)
                .filter_map(|pair| {
                    let algorithm = Algorithm::named(pair.first()?)?;
                    Some((algorithm, pair.get(1)?.parse().ok()?))
                })
                .collect(),
            left,
        })
    }

    /// Renews replica `id`'s entry (lost if not renewed within `expiry`; no longer lost if it
    /// was) and notes that it grants under `algorithm`; the algorithms' record is kept at least
    /// `retain`, a lost replica listed `lost_for`. Answers the registry with the entry.
    pub async fn beat(
        &self,
        id: &str,
        entry: &str,
        expiry: Duration,
        algorithm: Option<Algorithm>,
        retain: Duration,
        lost_for: Duration,
    ) -> Result<Roll, PermitError> {
        let action = FleetAction::Beat {
            id,
            entry,
            expiry_ms: expiry.as_millis().max(1) as u64,
            algorithm: algorithm.map_or("", |a| a.name()),
            retain_ms: retain.as_millis().max(1) as u64,
        };
        self.run(self.call(action, lost_for)).await
    }

    /// Takes replica `id`'s entry out (it is not lost: it left); it granted under `algorithm`
    /// until now. A lost replica is listed `lost_for`.
    pub async fn leave(
        &self,
        id: &str,
        algorithm: Option<Algorithm>,
        lost_for: Duration,
    ) -> Result<(), PermitError> {
        let action = FleetAction::Leave {
            id,
            algorithm: algorithm.map_or("", |a| a.name()),
        };
        self.run(self.call(action, lost_for)).await.map(|_| ())
    }

    /// The live replicas and those lost within `lost_for` (an expired entry is moved to the
    /// lost ones by this read as by any call).
    pub async fn read(&self, lost_for: Duration) -> Result<Roll, PermitError> {
        self.run(self.call(FleetAction::Read, lost_for)).await
    }
}
