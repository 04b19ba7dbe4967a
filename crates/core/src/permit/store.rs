//! The store: [`PermitStore`], its connection, keys and batcher, the terms it grants under
//! (see [`super::applied`]), Redis's clock as the answers tell it, and the keyspace utilities
//! the operator's tools and tests share.

use crate::permit::admin;
use crate::permit::admin::{Admin, Rescheduled};
use crate::permit::applied::Applied;
use crate::permit::batch::{Batcher, Operation, When};
use crate::permit::block::{BLOCK_HOLD, Blocks};
use crate::permit::calls::OnRoute;
use crate::permit::conn::RedisConn;
use crate::permit::decision::CALL_ALLOWANCE;
use crate::permit::error::PermitError;
use crate::permit::keys::Keyspace;
use crate::permit::records::Records;
use crate::permit::terms::Terms;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::config::{Algorithm, LimiterArgs, Limits, RedisArgs};
use crate::domain::SellerId;
use crate::routes::Route;

/// The per-seller limiter over Redis, shared by all replicas through Redis.
#[derive(Clone)]
pub struct PermitStore {
    pub(super) conn: RedisConn,
    pub(super) keys: Keyspace,
    /// The terms it grants under now (see [`applied`]): read once per operation.
    pub(super) applied: Arc<Applied>,
    pub(super) call_bound: Duration,
    /// Sends the hot operations in batches (see [`batch`]); started at first use.
    pub(super) batcher: Arc<OnceLock<Batcher>>,
    /// How long a completion record may wait to ride along with another call (see
    /// [`record_delay`]).
    pub(super) record_delay: Duration,
    pub(super) clock: Arc<RedisClock>,
    /// Permit blocks, with `TURNSTILE_PERMIT_BLOCK` > 0 (see [`block`]); they apply under
    /// terms that allow them (see [`PermitStore::pooled`]).
    /// The routes of the routes file (see [`crate::routes`]): a change of a seller's terms
    /// gives back their reservations in their logs too.
    pub(super) routes: Arc<crate::routes::Routes>,
    pub(super) blocks: Option<Arc<Blocks>>,
    /// Whether the task that writes what calls made with pool units answered was started (see
    /// `start_writing_answers`).
    pub(super) writing_answers: Arc<OnceLock<()>>,
    /// The sellers this store reserved slots for lately (see [`PermitStore::reserving`]).
    pub(super) reserving: Arc<std::sync::Mutex<HashMap<SellerId, std::time::Instant>>>,
    /// The sellers this store learned a 429 of lately: what their calls made with pool units
    /// answered may correct the decrease once written (see `write_answers`).
    pub(super) throttled: Arc<std::sync::Mutex<HashMap<SellerId, std::time::Instant>>>,
    /// Whether calls ask for the charge learned from their endpoint's answers
    /// (`TURNSTILE_COST_HEADER`, see `PermitStore::cost_to_ask`).
    pub(super) learns_charges: bool,
    /// Whether Redis takes `SET … NX … GET` (7.0 and later; see
    /// [`PermitStore::probe_set_nx_get`]): a call's claim is then one command, not two.
    pub(super) set_nx_get: Arc<std::sync::atomic::AtomicBool>,
}

/// Most sellers [`PermitStore::reserving`] keeps (beyond it, the ones not seen for
/// [`RESERVING_FOR`] are forgotten, then new ones are not noted).
pub(super) const MOST_RESERVING: usize = 10_000;

/// How long a seller stays in [`PermitStore::reserving`] after its last reservation: longer than
/// any slot is reserved ahead but for the deepest backlogs.
pub(super) const RESERVING_FOR: Duration = Duration::from_secs(3600);

/// Most sellers [`PermitStore::throttled`] keeps (beyond it, it starts over).
pub(super) const MOST_THROTTLED: usize = 4096;

/// How long after a 429 of a seller learned here what its calls made with pool units answered
/// is looked at for a correction of the decrease (see `write_answers`): longer than the pool's
/// answers wait to be written, shorter than the accepted log is kept at the shortest window.
pub(super) const THROTTLED_FOR: Duration = Duration::from_secs(2);

/// How long a completion record (or a call's end, or a lesson from a 2xx) may wait to ride
/// along with another call to the same place before it is sent by itself:
/// `TURNSTILE_RECORD_DELAY`, or a quarter of the default limit's shortest window if that is less
/// (a record should land well before the next window's calls are decided; it carries when the
/// answer came, so a late one is still exact).
pub fn record_delay(limiter: &LimiterArgs) -> Duration {
    (limiter.limit.shortest_window() / 4).min(limiter.record_delay)
}

/// This replica's estimate of Redis's clock, from the Redis time in the limiter's answers. A
/// sample `redis_now - local_now` (the local side on a monotonic clock, taken when the answer
/// arrived) is at most the true offset, since Redis read its clock before the answer arrived;
/// the largest sample of the last [`RedisClock::FRESH`] is used, so an estimate is not ahead of
/// the clock of the Redis that answered it (on Redis Cluster, of the node with the fastest
/// clock). It only decides how long a message waits before it asks: Redis decides the rest.
pub(super) struct RedisClock {
    base: std::time::Instant,
    /// (offset µs, local µs when observed), once observed.
    sample: std::sync::Mutex<Option<(i64, i64)>>,
}

impl Default for RedisClock {
    fn default() -> Self {
        Self {
            base: std::time::Instant::now(),
            sample: std::sync::Mutex::new(None),
        }
    }
}

impl RedisClock {
    const FRESH: i64 = 10_000_000;

    pub(super) fn local_us(&self) -> i64 {
        self.base.elapsed().as_micros().min(i64::MAX as u128) as i64
    }

    pub(super) fn observe(&self, redis_now_us: i64) {
        let local = self.local_us();
        let offset = redis_now_us - local;
        let mut sample = self
            .sample
            .lock()
            .expect("the clock's lock is never poisoned");
        let newer = match *sample {
            None => true,
            Some((kept, at)) => offset > kept || local - at > Self::FRESH,
        };
        if newer {
            *sample = Some((offset, local));
        }
    }

    pub(super) fn now_us(&self) -> Option<i64> {
        let sample = *self
            .sample
            .lock()
            .expect("the clock's lock is never poisoned");
        sample.map(|(offset, _)| self.local_us() + offset)
    }
}

/// How often a replica reads the reschedule log.
pub const RESCHEDULE_POLL: Duration = Duration::from_millis(250);

/// Reads the shared reschedule log every [`RESCHEDULE_POLL`] until `shutdown`, and sends each
/// new entry to `notices` (the messages this replica holds listen there). Starts from the Redis
/// time at its first read. Each read looks two seconds behind the newest entry seen,
/// so that an entry written late (its time is taken in the script, its log entry is written
/// just after) is not skipped; entries already sent are not sent again. A Redis error is logged
/// at debug level and the next poll tries again.
pub async fn watch_reschedules(
    store: PermitStore,
    notices: tokio::sync::broadcast::Sender<Rescheduled>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let admin = store.admin();
    let lookback = RESCHEDULE_LOOKBACK.as_micros() as i64;
    let mut cursor: Option<i64> = None;
    let mut sent: std::collections::HashSet<(String, i64)> = Default::default();
    let mut ticker = tokio::time::interval(RESCHEDULE_POLL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        let Some(since) = cursor else {
            match admin.redis_time_us().await {
                Ok(now) => cursor = Some(now),
                Err(error) => tracing::debug!(%error, "reading the reschedule log: no Redis time"),
            }
            continue;
        };
        match admin.rescheduled_since(since - lookback).await {
            Ok(entries) => {
                for entry in entries {
                    cursor = cursor.max(Some(entry.at_us));
                    if sent.insert((entry.seller.clone(), entry.at_us)) {
                        // The seller's terms changed: its block (granted under the old ones)
                        // is not used further.
                        if let Ok(seller) = SellerId::parse(&entry.seller) {
                            store.drop_block(&seller);
                        }
                        let _ = notices.send(entry);
                    }
                }
                let oldest = cursor.unwrap_or(since) - lookback;
                sent.retain(|(_, at)| *at > oldest);
            }
            Err(error) => tracing::debug!(%error, "reading the reschedule log failed"),
        }
    }
}

/// How far behind the newest entry seen the reschedule log is read again.
pub(super) const RESCHEDULE_LOOKBACK: Duration = Duration::from_secs(2);

impl PermitStore {
    pub async fn connect(redis: &RedisArgs, limiter: &LimiterArgs) -> anyhow::Result<Self> {
        Ok(Self::new(
            RedisConn::connect(redis).await?,
            &redis.key_prefix,
            limiter.clone(),
        ))
    }

    pub fn new(conn: RedisConn, prefix: &str, limiter: LimiterArgs) -> Self {
        let blocks = (limiter.permit_block > 0)
            .then(|| Arc::new(Blocks::new(limiter.permit_block, BLOCK_HOLD)));
        Self {
            conn,
            keys: Keyspace::new(prefix),
            record_delay: record_delay(&limiter),
            blocks,
            writing_answers: Arc::default(),
            throttled: Arc::default(),
            reserving: Arc::default(),
            applied: Arc::new(Applied::new(limiter)),
            routes: Arc::default(),
            call_bound: Duration::ZERO,
            batcher: Arc::default(),
            clock: Arc::default(),
            learns_charges: false,
            set_nx_get: Arc::default(),
        }
    }

    /// Finds out whether Redis takes `SET … NX … GET` (Redis 7.0 and later), with a key of the
    /// prefix's that expires within a second: a call's claim
    /// ([`claim_call`](crate::permit::Limiter::claim_call)) is then
    /// one command instead of `SET NX` and `GET`. Without an answer, the two are used.
    pub async fn probe_set_nx_get(&self) {
        let mut conn = self.conn.clone();
        let probed: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(self.keys.set_nx_get_probe())
            .arg("1")
            .arg("NX")
            .arg("PX")
            .arg(1000)
            .arg("GET")
            .query_async(&mut conn)
            .await;
        self.set_nx_get
            .store(probed.is_ok(), std::sync::atomic::Ordering::Relaxed);
    }

    /// With `on` (`TURNSTILE_COST_HEADER` set), calls ask for the charge learned from their
    /// endpoint's answers (see `Self::cost_to_ask`); off, they ask their message's cost and
    /// nothing is read.
    pub fn with_learned_charges(mut self, on: bool) -> Self {
        self.learns_charges = on;
        self
    }

    /// Runs a hot operation through the batcher (see [`batch`]) and reads its answer as `T`.
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        operation: Operation,
        when: When,
    ) -> Result<T, PermitError> {
        Ok(self.run_sent(operation, when).await?.0)
    }

    /// Sends a hot operation nobody waits for through the batcher, with the next call within
    /// `delay` (see [`Batcher::send_detached`]).
    pub(super) fn send_detached(&self, operation: Operation, delay: Duration) {
        self.batcher().send_detached(operation, delay);
    }

    /// The store's batcher, started at its first use.
    fn batcher(&self) -> &Batcher {
        self.batcher
            .get_or_init(|| Batcher::start(self.conn.clone()))
    }

    /// As [`Self::run`], with when the call that carried the operation left this replica.
    pub(super) async fn run_sent<T: redis::FromRedisValue>(
        &self,
        operation: Operation,
        when: When,
    ) -> Result<(T, std::time::Instant), PermitError> {
        let (answer, sent) = self.batcher().run_sent(operation, when).await;
        if let (Err(PermitError::Redis(_)), Some(blocks)) = (&answer, &self.blocks) {
            blocks.forget_pools();
        }
        let value = redis::from_redis_value(answer?).map_err(|e| PermitError::Redis(e.into()))?;
        Ok((value, sent.into_std()))
    }

    /// Calls to Redis this store (and its clones) sent for the limiter's hot operations so
    /// far, each carrying one or more operations (see `batch`).
    pub fn batched_calls(&self) -> u64 {
        self.batcher.get().map_or(0, Batcher::calls)
    }

    /// Redis's time now as this replica estimates it from the limiter's answers (never ahead
    /// of Redis's, see `RedisClock`); `None` before the first answer.
    pub fn redis_now_us(&self) -> Option<i64> {
        self.clock.now_us()
    }

    /// Calls granted by this store are sent within [`CALL_ALLOWANCE`] of their grant and
    /// answered (or timed out) within `timeout` of being sent: each holds its place in the
    /// seller's window until its answer is recorded, and at most until grant + allowance +
    /// timeout (see `calls_gate` in `lua/include/calls.lua`). Without it (zero), a call counts at its
    /// grant only, as a point.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_bound = CALL_ALLOWANCE + timeout;
        self
    }

    pub(super) fn call_bound_us(&self) -> u64 {
        self.call_bound.as_micros() as u64
    }

    /// The algorithm it grants under now.
    pub fn algorithm(&self) -> Algorithm {
        self.limiter().algorithm
    }

    /// The default stack it grants under now (the fleet's, see [`applied`]).
    pub fn default_limit(&self) -> Limits {
        self.limiter().limit.clone()
    }

    /// The terms it grants under now, for one operation (see [`Applied::current`]).
    pub fn limiter(&self) -> Arc<LimiterArgs> {
        self.applied.current()
    }

    /// The terms it grants under, as the fleet replaces them (see [`applied`]).
    pub fn applied(&self) -> &Arc<Applied> {
        &self.applied
    }

    /// The connection to Redis this store uses.
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The keys this store uses (see [`keys`]).
    pub fn keys(&self) -> &Keyspace {
        &self.keys
    }

    /// Sellers' terms under this store's connection and prefix, read under the terms it grants
    /// under, as the fleet replaces them (see [`Admin`]).
    pub fn admin(&self) -> Admin {
        Admin::following(self.conn.clone(), self.keys.prefix(), self.applied.clone())
            .with_routes(&self.routes)
    }

    /// The routes it was given (see [`Self::with_routes`]).
    pub fn routes(&self) -> &Arc<crate::routes::Routes> {
        &self.routes
    }

    /// Knows the routes of the routes file: a change of a seller's terms (a lesson of adaptive
    /// limits, a pause, a limit set) gives back reservations on them in their logs too.
    pub fn with_routes(mut self, routes: Arc<crate::routes::Routes>) -> Self {
        self.routes = routes;
        self
    }

    /// The seller's logs of every route (see [`Self::with_routes`]).
    pub(super) fn route_logs(&self, seller: &SellerId) -> Vec<String> {
        self.routes
            .iter()
            .map(|route| self.keys.route_log(seller, &route.name))
            .collect()
    }

    /// The uploads' progress, the dead letters by reason and the dashboard's shared state under
    /// this store's connection and prefix (see [`Records`]).
    pub fn records(&self) -> Records {
        Records::new(self.conn.clone(), self.keys.prefix())
    }

    /// Pauses the seller on every replica for `duration` (as a 429 asks): see [`Admin::pause`].
    pub async fn pause(
        &self,
        seller: &SellerId,
        duration: Duration,
    ) -> Result<Duration, PermitError> {
        self.admin().pause(seller, duration).await
    }

    /// A call's route as the scripts take it (see [`OnRoute`]), under `limiter`'s stack for it
    /// (the fleet's, see [`LimiterArgs::route_limits`]) or else its own.
    pub(super) fn on_route(
        &self,
        limiter: &LimiterArgs,
        seller: &SellerId,
        route: Option<&Route>,
    ) -> Option<OnRoute> {
        route.map(|route| {
            let limits = limiter
                .route_limits
                .get(&route.name)
                .unwrap_or(&route.limits);
            OnRoute {
                log: self.keys.route_log(seller, &route.name),
                limit: self.keys.route_limit(seller, &route.name),
                counts: limits.counts_arg(),
                windows: limits.windows_arg(),
            }
        })
    }

    /// The key holding the seller's limiter state for the configured algorithm.
    pub(super) fn state_key(&self, limiter: &LimiterArgs, seller: &SellerId) -> String {
        self.keys.state(seller, limiter.algorithm)
    }

    /// The seller's learned state, passed to the scripts that apply it only with adaptive
    /// limits on.
    pub(super) fn learned_key(&self, limiter: &LimiterArgs, seller: &SellerId) -> Option<String> {
        limiter.adaptive.then(|| self.keys.learned(seller))
    }

    /// Notes that the seller holds a slot this store reserved (bounded, see
    /// [`MOST_RESERVING`]).
    pub(super) fn noted_reserving(&self, seller: &SellerId) {
        let mut reserving = self
            .reserving
            .lock()
            .expect("the reserving sellers' lock is never poisoned");
        let now = std::time::Instant::now();
        if reserving.len() >= MOST_RESERVING && !reserving.contains_key(seller) {
            reserving.retain(|_, at| now.duration_since(*at) < RESERVING_FOR);
            if reserving.len() >= MOST_RESERVING {
                return;
            }
        }
        reserving.insert(seller.clone(), now);
    }

    /// The sellers this store reserved slots for in the last hour (at most
    /// `MOST_RESERVING`): those whose backlog a change of the default terms re-plans (see
    /// [`PermitStore::release_reserved`]).
    pub fn reserving(&self) -> Vec<SellerId> {
        let now = std::time::Instant::now();
        self.reserving
            .lock()
            .expect("the reserving sellers' lock is never poisoned")
            .iter()
            .filter(|(_, at)| now.duration_since(**at) < RESERVING_FOR)
            .map(|(seller, _)| seller.clone())
            .collect()
    }

    /// Gives back every slot reserved for each of `sellers`, made under the terms `before`
    /// (as `turnstile limits set` does for one seller, and announced the same way), so that
    /// the terms now in force apply at once to their whole backlogs: their messages reserve
    /// anew. Returns how many sellers were re-planned; stops at the first Redis error.
    pub async fn release_reserved(
        &self,
        before: &LimiterArgs,
        sellers: &[SellerId],
    ) -> Result<usize, PermitError> {
        let admin = Admin::new(self.conn.clone(), self.keys.prefix(), Terms::from(before))
            .with_routes(&self.routes);
        for seller in sellers {
            admin.reschedule(seller, admin::Change::Release).await?;
        }
        Ok(sellers.len())
    }
}
