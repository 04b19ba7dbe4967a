//! The fleet's registry in Redis (`lua/fleet.lua`): each replica's entry, renewed every
//! heartbeat and dropped when it stops, and the algorithms the fleet granted under. What the
//! entries say and what follows from them is `crate::fleet`'s; this is only their storage.

use std::time::Duration;

use super::calls::{FleetAction, FleetAnswer, FleetCall};
use super::{Keyspace, PermitError, RedisConn};
use crate::config::Algorithm;

/// The fleet's registry under a key prefix.
#[derive(Clone)]
pub struct Registry {
    conn: RedisConn,
    keys: Keyspace,
}

/// One live replica's entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    pub id: String,
    /// Its first heartbeat, Redis ms.
    pub since_ms: i64,
    /// Its last heartbeat, Redis ms.
    pub last_ms: i64,
    /// What it announced (JSON, as it wrote it: read it as untrusted).
    pub entry: String,
}

/// The registry as one call saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roll {
    /// Redis's time when it was read, ms.
    pub now_ms: i64,
    /// The live replicas, in no order.
    pub members: Vec<Registered>,
    /// When each algorithm was last granted under (Redis ms).
    pub algorithms: Vec<(Algorithm, i64)>,
}

impl Registry {
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        Self {
            conn,
            keys: Keyspace::new(prefix),
        }
    }

    fn call<'a>(&self, action: FleetAction<'a>) -> FleetCall<'a> {
        FleetCall {
            fleet: self.keys.fleet(),
            algorithms: self.keys.fleet_algorithms(),
            action,
        }
    }

    async fn run(&self, call: FleetCall<'_>) -> Result<Roll, PermitError> {
        let (now_ms, members, algorithms): FleetAnswer = call
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
                })
                .collect(),
            algorithms: algorithms
                .chunks(2)
                .filter_map(|pair| {
                    let algorithm = Algorithm::named(pair.first()?)?;
                    Some((algorithm, pair.get(1)?.parse().ok()?))
                })
                .collect(),
        })
    }

    /// Renews replica `id`'s entry (dropped if not renewed within `expiry`) and notes that it
    /// grants under `algorithm`; the algorithms' record is kept at least `retain`. Answers the
    /// registry with the entry.
    pub async fn beat(
        &self,
        id: &str,
        entry: &str,
        expiry: Duration,
        algorithm: Option<Algorithm>,
        retain: Duration,
    ) -> Result<Roll, PermitError> {
        self.run(self.call(FleetAction::Beat {
            id,
            entry,
            expiry_ms: expiry.as_millis().max(1) as u64,
            algorithm: algorithm.map_or("", |a| a.name()),
            retain_ms: retain.as_millis().max(1) as u64,
        }))
        .await
    }

    /// Takes replica `id`'s entry out; it granted under `algorithm` until now.
    pub async fn leave(&self, id: &str, algorithm: Option<Algorithm>) -> Result<(), PermitError> {
        self.run(self.call(FleetAction::Leave {
            id,
            algorithm: algorithm.map_or("", |a| a.name()),
        }))
        .await
        .map(|_| ())
    }

    /// The live replicas, read only.
    pub async fn read(&self) -> Result<Roll, PermitError> {
        self.run(self.call(FleetAction::Read)).await
    }
}
