//! An in-process rig: a strict mock downstream, consumer replicas, a queue topology and key
//! prefix of its own; publishes registrations, waits for them, reports what the downstream saw,
//! and cleans up (deletes its queues and keys). The one harness of `turnstile bench`,
//! `turnstile demo` and the integration tests.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::mock_api::{MockArgs, MockServer, Stats};
use turnstile_core::broker::{AmqpArgs, BrokerArgs, Publisher, QueueArgs, QueueType, Topology};
use turnstile_core::config::{Algorithm, Limits};
use turnstile_core::config::{LimiterArgs, RedisArgs};
use turnstile_core::downstream::DownstreamArgs;
use turnstile_core::permit::{Admin, PermitStore, Records, RedisConn, delete_prefix};
use turnstile_core::replica::{ConsumeArgs, DoneTtlArgs};
use turnstile_ops::serve::{HttpArgs, ServeArgs, Served};

/// Where a rig runs: the broker and Redis it uses. Its queue and key prefix are its own
/// (`turnstile-<name>-<random>`, `<prefix>-<name>-<random>`), deleted when it finishes.
#[derive(clap::Args, Debug, Clone)]
pub struct RigArgs {
    /// Queue type of the rig's queues.
    #[arg(long = "queue-type", value_enum, default_value_t = QueueType::Quorum)]
    pub queue_type: QueueType,
    #[command(flatten)]
    pub amqp: AmqpArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
}

impl RigArgs {
    /// Settings of the rig's replicas (the downstream URL is set to the rig's mock on start).
    pub fn replica_settings(
        &self,
        name: &str,
        limiter: LimiterArgs,
        workers: u32,
        hold: Duration,
    ) -> ConsumeArgs {
        let mut redis = self.redis.clone();
        redis.key_prefix = format!("{}-{name}", redis.key_prefix);
        ConsumeArgs {
            broker: BrokerArgs {
                amqp: self.amqp.clone(),
                queue: QueueArgs {
                    name: format!("turnstile-{name}"),
                },
                queue_type: self.queue_type,
                delay_queue_type: self.queue_type,
                consumer_timeout: Default::default(),
            },
            workers,
            prefetch: None,
            delay_prefetch: turnstile_core::broker::ladder::DEFAULT_PREFETCH,
            max_attempts: 8,
            hold,
            max_pause: Duration::from_secs(3600),
            throttle_deadline: Duration::from_secs(24 * 3600),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            done: DoneTtlArgs {
                ttl: Duration::from_secs(3600),
            },
            shutdown_grace: Duration::from_secs(8),
            allow_eviction: false,
            allow_stricter_terms: false,
            downstream: DownstreamArgs {
                url: "http://127.0.0.1:1/{seller_id}".into(),
                token: None,
                timeout: Duration::from_secs(10),
                cost_header: None,
            },
            routes: Default::default(),
            redis,
            limiter,
            links: Default::default(),
        }
    }
}

/// One message to publish: its seller and body.
pub struct Message {
    pub seller: String,
    pub body: Vec<u8>,
}

impl Message {
    /// The `i`-th message of `seller`: message id `<seller>-<i>`, product `{"sku": i}`.
    pub fn numbered(seller: &str, i: usize) -> Self {
        Self {
            seller: seller.to_owned(),
            body: registration_body(
                &format!("{seller}-{i}"),
                seller,
                None,
                serde_json::json!({ "sku": i }),
            ),
        }
    }
}

/// What the downstream saw, and what the replicas did.
#[derive(Debug, Serialize)]
pub struct Report {
    pub published: u64,
    pub registered: u64,
    pub dead_lettered: u64,
    pub lost: u64,
    pub duplicates: u64,
    /// The first repeated Idempotency-Keys, with when each was accepted and repeated.
    pub repeats: Vec<crate::mock_api::Repeat>,
    pub violations: u64,
    pub deliveries: u64,
    pub deliveries_per_message: f64,
    /// Of the deliveries, those taken from the return queue `<queue>.ready` (messages back
    /// from a delay); the rest came from the work queue.
    pub returns: u64,
    /// The latest a delay ladder message was handed to the workers (or moved into the return
    /// queue) after its due time, in ms (the ladder's own lateness).
    pub ladder_max_late_ms: u64,
    /// The latest a message was taken from the return queue after its due time, and the mean,
    /// in ms (the ladder's lateness plus the wait in the return queue).
    pub return_max_late_ms: u64,
    pub return_mean_late_ms: f64,
    /// Reserved slots given up at redemption (in a rig without pauses or changes of terms:
    /// the message came back too late for its slot) and reserved anew.
    pub forfeited: u64,
    /// Delay ladder hops (each a delivery to a ladder consumer), per published message.
    pub ladder_hops_per_message: f64,
    /// The broker's cost, every turnstile queue counted: deliveries (work queue, return queue
    /// and each delay ladder delivery, a delivery handed from the ladder to a worker once),
    /// copies of messages published (delays, hops, dead letters), results published, deliveries
    /// acked and requeued.
    pub broker: BrokerWork,
    pub elapsed_s: f64,
    /// Per seller: registered, first and last registration (s after publishing started).
    pub sellers: BTreeMap<String, SellerReport>,
}

/// What the replicas asked of the broker, in all and per published message (see
/// [`Report::broker`]).
#[derive(Debug, Serialize, Clone, Default)]
pub struct BrokerWork {
    /// Deliveries from every queue: `work` + `returns` + `ladder`.
    pub deliveries: u64,
    /// Deliveries from the work queue, the return queue and the delay ladder's queues.
    pub work: u64,
    pub returns: u64,
    pub ladder: u64,
    pub publishes: u64,
    pub results: u64,
    pub acks: u64,
    pub requeues: u64,
    pub deliveries_per_message: f64,
    pub publishes_per_message: f64,
    pub acks_per_message: f64,
}

#[derive(Debug, Serialize, Clone)]
pub struct SellerReport {
    pub published: u64,
    pub registered: u64,
    pub first_s: Option<f64>,
    pub last_s: Option<f64>,
    /// Last registration minus first: how long the seller's messages took to drain.
    pub drain_s: Option<f64>,
}

/// A rig being set up ([`Rig::build`]): the settings its replicas run with, its mock downstream
/// and its work queue. Nothing runs until [`RigBuilder::prepare`] or [`RigBuilder::start`].
#[must_use]
pub struct RigBuilder {
    settings: ConsumeArgs,
    mock: Option<MockArgs>,
    /// The work queue is named exactly as in `settings` (a topology its caller declared).
    exact_queue: bool,
    /// The endpoints the first replica started serves.
    http: HttpArgs,
    /// The mock's own per-seller limit, when it differs from the replicas'.
    api_limit: Option<Limits>,
}

impl RigBuilder {
    /// The mock enforces `limit` per seller, whatever the replicas are told (their limit is a
    /// guess that adaptive limits correct).
    pub fn with_api_limit(mut self, limit: Limits) -> Self {
        self.api_limit = Some(limit);
        self
    }

    /// The first replica started serves the dashboard and the other endpoints as `http` says
    /// (the others serve none).
    pub fn serving(mut self, http: HttpArgs) -> Self {
        self.http = http;
        self
    }

    /// The mock downstream runs with `mock` (its limit is the replicas', unless
    /// [`RigBuilder::with_api_limit`] says otherwise).
    pub fn with_mock(mut self, mock: MockArgs) -> Self {
        self.mock = Some(mock);
        self
    }

    /// The delay ladder's levels are queues of `delay_type`.
    pub fn with_delay_type(mut self, delay_type: QueueType) -> Self {
        self.settings.broker.delay_queue_type = delay_type;
        self
    }

    /// The replicas (and the rig's own permit store) take permits with `algorithm`.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.settings.limiter.algorithm = algorithm;
        self
    }

    /// The replicas use the Redis at `url` (the rig's keys are deleted there).
    pub fn on_redis(mut self, url: &str) -> Self {
        self.settings.redis.url = url.to_owned();
        self
    }

    /// The rig works on the queue `work` and the topology around it, named as given (a topology
    /// its caller declared, maybe as an operator or a producer would); it is still deleted at
    /// cleanup.
    pub fn on_queue(mut self, work: &str) -> Self {
        self.settings.broker.queue.name = work.to_owned();
        self.exact_queue = true;
        self
    }

    /// Starts the mock and declares the queues, without replicas yet (to publish a backlog
    /// before any replica consumes: [`Rig::start_replicas`]). The queue and key prefix get a
    /// random suffix of their own (`<queue>-<random>`, `<prefix>-<random>`).
    pub async fn prepare(self) -> anyhow::Result<Rig> {
        let Self {
            settings: mut base,
            mock,
            exact_queue,
            http,
            api_limit,
        } = self;
        let run = format!("{:08x}", rand::random::<u32>());
        if !exact_queue {
            base.broker.queue.name = format!("{}-{run}", base.broker.queue.name);
        }
        base.redis.key_prefix = format!("{}-{run}", base.redis.key_prefix);
        let stop_mock = CancellationToken::new();
        let mock = MockArgs {
            limit: api_limit.unwrap_or_else(|| base.limiter.limit.clone()),
            global_limit: base.limiter.global_limit.0.clone(),
            ..mock.unwrap_or_else(|| MockArgs::local(base.limiter.limit.clone()))
        };
        let mock = MockServer::start(mock, stop_mock.clone()).await?;
        base.downstream.url = mock.url();
        let redis = RedisConn::connect(&base.redis).await?;
        let (connection, publisher, topology) = base.broker.open("turnstile rig").await?;
        Ok(Rig {
            mock,
            topology,
            key_prefix: base.redis.key_prefix.clone(),
            limit: base.limiter.limit.clone(),
            store: PermitStore::new(redis, &base.redis.key_prefix, base.limiter.clone()),
            connection,
            publisher,
            replicas: Vec::new(),
            counters: Vec::new(),
            settings: base,
            http,
            stop: CancellationToken::new(),
            stop_mock,
            cleaned: false,
            published_at_ms: None,
            published: 0,
            published_by_seller: BTreeMap::new(),
        })
    }

    /// As [`RigBuilder::prepare`], then starts `replicas` replicas with the settings' workers.
    /// Only the first serves HTTP (the dashboard), if [`RigBuilder::serving`] says so.
    pub async fn start(self, replicas: usize) -> anyhow::Result<Rig> {
        let workers = self.settings.workers;
        let mut rig = self.prepare().await?;
        rig.start_replicas(replicas, workers).await?;
        Ok(rig)
    }
}

/// A running rig.
pub struct Rig {
    pub mock: MockServer,
    pub topology: Topology,
    pub key_prefix: String,
    pub limit: Limits,
    /// The rig's Redis, under its key prefix (upload progress, cleanup).
    store: PermitStore,
    connection: lapin::Connection,
    publisher: Publisher,
    /// The replicas running.
    replicas: Vec<Served>,
    /// The counters of every replica the rig started, the stopped ones too.
    counters: Vec<Arc<turnstile_core::worker::Stats>>,
    /// The settings replicas start with.
    settings: ConsumeArgs,
    /// The endpoints the first replica started serves (the others serve none).
    http: HttpArgs,
    stop: CancellationToken,
    stop_mock: CancellationToken,
    /// Its queues and keys are deleted (by [`Rig::cleanup`]); otherwise dropping it deletes them.
    cleaned: bool,
    /// When the first message was published (the mock's clock).
    published_at_ms: Option<u64>,
    published: u64,
    /// Messages published for a known seller (raw bodies count only in `published`).
    published_by_seller: BTreeMap<String, u64>,
}

impl Rig {
    /// A rig whose replicas run with `settings` (from [`RigArgs::replica_settings`]) on a queue
    /// and key prefix of their own, against a strict mock enforcing `settings.limiter.limit`.
    pub fn build(settings: ConsumeArgs) -> RigBuilder {
        RigBuilder {
            settings,
            mock: None,
            exact_queue: false,
            http: HttpArgs::off(),
            api_limit: None,
        }
    }

    /// The settings a replica of this rig starts with, with `workers` workers (to adjust before
    /// [`Rig::start_replica`]).
    pub fn settings(&self, workers: u32) -> ConsumeArgs {
        ConsumeArgs {
            workers,
            ..self.settings.clone()
        }
    }

    /// Starts one replica with `settings` (from [`Rig::settings`], serving no HTTP unless
    /// given as [`ServeArgs`]); returns once it consumes.
    pub async fn start_replica(
        &mut self,
        settings: impl Into<ServeArgs>,
    ) -> anyhow::Result<&Served> {
        let replica = Served::start(settings.into(), self.stop.clone())
            .await
            .context("starting a replica of the rig")?;
        self.counters.push(replica.stats.clone());
        self.replicas.push(replica);
        Ok(self.replicas.last().expect("just started"))
    }

    /// Starts `n` more replicas with `workers` workers each. Only the first replica running
    /// serves HTTP, if [`RigBuilder::serving`] says so.
    pub async fn start_replicas(&mut self, n: usize, workers: u32) -> anyhow::Result<()> {
        for _ in 0..n {
            let http = if self.replicas.is_empty() {
                self.http.clone()
            } else {
                HttpArgs::off()
            };
            let consume = self.settings(workers);
            self.start_replica(ServeArgs { consume, http }).await?;
        }
        Ok(())
    }

    /// The replicas running (for readiness and their counters).
    pub fn replicas(&self) -> impl Iterator<Item = &Served> {
        self.replicas.iter()
    }

    /// A counter summed over every replica the rig started (stopped ones included).
    pub fn total(&self, counter: impl Fn(&turnstile_core::worker::Stats) -> &AtomicU64) -> u64 {
        self.counters
            .iter()
            .map(|stats| counter(stats).load(Ordering::Relaxed))
            .sum()
    }

    /// Stops every replica (as SIGTERM would) and waits for them to drain; replicas started
    /// later run until the next stop.
    pub async fn stop_replicas(&mut self) -> anyhow::Result<()> {
        let stop = std::mem::take(&mut self.stop);
        stop.cancel();
        for replica in self.replicas.drain(..) {
            replica
                .wait()
                .await
                .context("a replica of the rig stopped")?;
        }
        Ok(())
    }

    /// Where the first replica serves the dashboard, if it does.
    pub fn dashboard(&self) -> Option<std::net::SocketAddr> {
        self.replicas.first().and_then(|r| r.http_addr)
    }

    /// The Redis URL of the rig's replicas.
    pub fn redis_url(&self) -> &str {
        &self.settings.redis.url
    }

    /// The rig's permits: its Redis, under its key prefix, with its replicas' limiter.
    pub fn store(&self) -> PermitStore {
        self.store.clone()
    }

    /// Sellers' terms in the rig's Redis, under its key prefix, as an operator reads and sets
    /// them.
    pub fn admin(&self) -> Admin {
        self.store.admin()
    }

    /// The uploads' progress, dead letters and dashboard state in the rig's Redis, under its key
    /// prefix.
    pub fn records(&self) -> Records {
        self.store.records()
    }

    /// The rig's broker connection.
    pub fn connection(&self) -> &lapin::Connection {
        &self.connection
    }

    /// A new broker connection and publisher (after a broker restart).
    pub async fn reconnect(&mut self) -> anyhow::Result<()> {
        let connection =
            turnstile_core::broker::connect(&self.settings.broker.amqp.url, "turnstile rig")
                .await?;
        self.publisher = Publisher::open(&connection).await?;
        self.connection = connection;
        Ok(())
    }

    /// Notes `n` messages published, of `seller` if known.
    fn count_published(&mut self, seller: Option<&str>, n: u64) {
        if self.published_at_ms.is_none() {
            self.published_at_ms = Some(self.mock.stats().now_ms);
        }
        self.published += n;
        if let Some(seller) = seller {
            *self
                .published_by_seller
                .entry(seller.to_owned())
                .or_default() += n;
        }
    }

    /// Publishes one body to the work queue the way a producer does, confirmed.
    async fn send(&self, body: &[u8], headers: FieldTable) -> anyhow::Result<()> {
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_headers(headers);
        self.publisher
            .publish("", self.topology.work(), body, properties)
            .await
            .context("publishing to the rig's work queue")
    }

    /// Publishes `n` registrations of `seller`, one after the other (message ids
    /// `<seller>-<i>`, products `{"sku": i}`).
    pub async fn publish(&mut self, seller: &str, n: usize) -> anyhow::Result<()> {
        for i in 0..n {
            let product = serde_json::json!({ "sku": i });
            self.publish_product(seller, &format!("{seller}-{i}"), product)
                .await?;
        }
        Ok(())
    }

    /// Publishes one registration of `seller`'s `product` as message `message_id`.
    pub async fn publish_product(
        &mut self,
        seller: &str,
        message_id: &str,
        product: serde_json::Value,
    ) -> anyhow::Result<()> {
        self.count_published(Some(seller), 1);
        let body = registration_body(message_id, seller, None, product);
        self.send(&body, FieldTable::default()).await
    }

    /// Publishes one registration of `seller` costing `cost` units (the envelope's `cost`; the
    /// product carries it too, as `"cost"`, for the mock to count) as message `message_id`.
    pub async fn publish_weighed(
        &mut self,
        seller: &str,
        message_id: &str,
        cost: u32,
        product: serde_json::Value,
    ) -> anyhow::Result<()> {
        self.count_published(Some(seller), 1);
        let body = weighed_body(message_id, seller, cost, product);
        self.send(&body, FieldTable::default()).await
    }

    /// Publishes any body (a malformed one too) to the work queue.
    pub async fn publish_body(&mut self, body: &[u8]) -> anyhow::Result<()> {
        self.publish_with_headers(body, &[]).await
    }

    /// Publishes any body with AMQP headers (forged internal ones, say) to the work queue.
    pub async fn publish_with_headers(
        &mut self,
        body: &[u8],
        headers: &[(&str, AMQPValue)],
    ) -> anyhow::Result<()> {
        self.count_published(None, 1);
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert((*name).into(), value.clone());
        }
        self.send(body, table).await
    }

    /// Publishes the messages in order, confirmed, many in flight at once (a backlog of
    /// thousands in seconds).
    pub async fn publish_all(&mut self, messages: Vec<Message>) -> anyhow::Result<()> {
        for m in &messages {
            self.count_published(Some(&m.seller), 1);
        }
        let rig = &*self;
        let results: Vec<_> = futures::stream::iter(messages)
            .map(|m| async move { rig.send(&m.body, FieldTable::default()).await })
            .buffered(256)
            .collect()
            .await;
        for r in results {
            r.context("publishing the workload")?;
        }
        Ok(())
    }

    /// Messages published so far.
    pub fn published(&self) -> u64 {
        self.published
    }

    /// Messages ready in a queue of the rig; read through a connection of its own to another
    /// node when the rig's node went away (a broker cluster's failover).
    pub async fn depth(&self, queue: &str) -> anyhow::Result<u32> {
        if !self.connection.status().connected() {
            let connection =
                turnstile_core::broker::connect(&self.settings.broker.amqp.url, "turnstile rig")
                    .await?;
            let depth = queue_depth(&connection, queue).await;
            let _ = connection.close(200, "".into()).await;
            return depth;
        }
        queue_depth(&self.connection, queue).await
    }

    /// Messages waiting in any queue of the rig (work, delay ladder, dead letters); with no
    /// replica running, every message the broker still holds.
    pub async fn depth_everywhere(&self) -> anyhow::Result<u32> {
        let mut total = 0;
        for queue in self.topology.queues() {
            total += self.depth(&queue).await?;
        }
        Ok(total)
    }

    /// Dead letters waiting in the rig's dead-letter queue.
    pub async fn dead_lettered(&self) -> anyhow::Result<u64> {
        Ok(u64::from(self.depth(self.topology.dead()).await?))
    }

    /// Waits for `n` dead letters and takes them (acked) from the dead-letter queue; fails if
    /// one takes longer than two minutes (a guard against hanging, not a speed check).
    pub async fn dead_letters(&self, n: usize) -> anyhow::Result<Vec<Delivery>> {
        let channel = self.connection.create_channel().await?;
        let mut consumer = channel
            .basic_consume(
                self.topology.dead().into(),
                format!("rig-dead-letters-{:08x}", rand::random::<u32>())
                    .as_str()
                    .into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut taken = Vec::new();
        while taken.len() < n {
            let next = tokio::time::timeout(Duration::from_secs(120), consumer.next())
                .await
                .with_context(|| format!("only {} of {n} dead letters came", taken.len()))?
                .context("the dead-letter consumer ended")??;
            next.acker.ack(BasicAckOptions::default()).await?;
            taken.push(next);
        }
        // Any delivery past the n-th goes back to the queue.
        let _ = channel.close(200, "".into()).await;
        Ok(taken)
    }

    /// Waits until every published message registered or was dead-lettered, or `timeout`;
    /// calls `progress` with the mock's stats about every 100 ms.
    pub async fn wait(
        &self,
        timeout: Duration,
        mut progress: impl FnMut(&Stats),
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let stats = self.mock.stats();
            progress(&stats);
            if stats.registered + self.dead_lettered().await? >= self.published()
                || Instant::now() > deadline
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every queue of the rig but the dead letters' is empty (every message
    /// settled, none waiting in a delay); whether they were within `guard` (a guard against
    /// hanging, not a speed check).
    pub async fn wait_queues_empty(&self, guard: Duration) -> bool {
        let queues: Vec<String> = self
            .topology
            .queues()
            .into_iter()
            .filter(|q| q != self.topology.dead())
            .collect();
        let deadline = Instant::now() + guard;
        loop {
            let mut waiting = 0;
            for queue in &queues {
                waiting += self.depth(queue).await.unwrap_or(1);
            }
            if waiting == 0 {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the mock has registered `n` messages and returns its stats; fails after three
    /// minutes (a guard against hanging, not a speed check: generous on purpose).
    pub async fn wait_registered(&self, n: u64) -> anyhow::Result<Stats> {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let stats = self.mock.stats();
            if stats.registered >= n {
                return Ok(stats);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {} of {n} registered: {stats:?}",
                stats.registered
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the replicas have settled `n` messages as registered (acked, recorded);
    /// fails after three minutes.
    pub async fn wait_settled_registered(&self, n: u64) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(180);
        while self.total(|s| &s.registered) < n {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the replicas settled fewer than {n} as registered"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Stops the replicas (draining them), reports, and deletes the rig's queues and keys.
    pub async fn finish(mut self) -> anyhow::Result<Report> {
        let stopped = self.stop_replicas().await;
        let report = self.report().await;
        self.cleanup().await?;
        stopped?;
        report
    }

    /// What the downstream saw and what the replicas did.
    async fn report(&self) -> anyhow::Result<Report> {
        let sum = |counter: fn(&turnstile_core::worker::Stats) -> &AtomicU64| self.total(counter);
        let max = |counter: fn(&turnstile_core::worker::Stats) -> &AtomicU64| {
            self.counters
                .iter()
                .map(|stats| counter(stats).load(Ordering::Relaxed))
                .max()
                .unwrap_or(0)
        };
        let deliveries = sum(|s| &s.deliveries);
        let per = |n: u64| n as f64 / self.published.max(1) as f64;
        let ladder = sum(|s| &s.ladder.deliveries);
        let returns = sum(|s| &s.ladder.returns);
        let work = deliveries.saturating_sub(returns + sum(|s| &s.ladder.handed));
        let broker_deliveries = work + returns + ladder;
        let (publishes, acks) = (sum(|s| &s.broker.publishes), sum(|s| &s.broker.acks));
        let broker = BrokerWork {
            deliveries: broker_deliveries,
            work,
            returns,
            ladder,
            publishes,
            results: sum(|s| &s.broker.results),
            acks,
            requeues: sum(|s| &s.broker.requeues),
            deliveries_per_message: per(broker_deliveries),
            publishes_per_message: per(publishes),
            acks_per_message: per(acks),
        };
        let forfeited = sum(|s| &s.forfeited);
        let hops = sum(|s| &s.ladder.hops);
        let return_late_ms = sum(|s| &s.ladder.return_late_ms);
        let ladder_max_late_ms = max(|s| &s.ladder.max_late_ms);
        let return_max_late_ms = max(|s| &s.ladder.max_return_late_ms);
        let stats = self.mock.stats();
        let dead_lettered = self.dead_lettered().await?;
        let published = self.published;
        let published_at_ms = self.published_at_ms.unwrap_or(stats.now_ms);
        let since = |ms: Option<u64>| ms.map(|ms| (ms as f64 - published_at_ms as f64) / 1000.0);
        let sellers = self
            .published_by_seller
            .iter()
            .map(|(seller, &n)| {
                let s = stats
                    .sellers
                    .get(
                        &turnstile_core::domain::SellerId::parse(seller)
                            .map(|s| s.header_value())
                            .unwrap_or_default(),
                    )
                    .cloned()
                    .unwrap_or_default();
                let drain = match (s.first_ms, s.last_ms) {
                    (Some(a), Some(b)) => Some((b - a) as f64 / 1000.0),
                    _ => None,
                };
                (
                    seller.clone(),
                    SellerReport {
                        published: n,
                        registered: s.registered,
                        first_s: since(s.first_ms),
                        last_s: since(s.last_ms),
                        drain_s: drain,
                    },
                )
            })
            .collect();
        Ok(Report {
            published,
            registered: stats.registered,
            dead_lettered,
            lost: published.saturating_sub(stats.registered + dead_lettered),
            duplicates: stats.duplicates,
            repeats: stats.repeats.clone(),
            violations: stats.violations,
            deliveries,
            deliveries_per_message: deliveries as f64 / published.max(1) as f64,
            returns,
            ladder_max_late_ms,
            return_max_late_ms,
            return_mean_late_ms: return_late_ms as f64 / returns.max(1) as f64,
            forfeited,
            ladder_hops_per_message: hops as f64 / published.max(1) as f64,
            broker,
            elapsed_s: (stats.now_ms.saturating_sub(published_at_ms)) as f64 / 1000.0,
            sellers,
        })
    }

    /// Stops the replicas and the mock, and deletes the rig's queues and keys (on connections
    /// of their own: the rig's may have seen its server restart). Deletes them even when a
    /// replica failed to stop, then reports that.
    pub async fn cleanup(mut self) -> anyhow::Result<()> {
        let stopped = self.stop_replicas().await;
        self.stop_mock.cancel();
        let _ = self.connection.close(200, "done".into()).await;
        self.cleaned = true; // one attempt: a failure here is reported, not retried on drop
        delete_queues_and_keys(&self.settings, &self.topology, &self.key_prefix).await?;
        stopped
    }
}

impl Drop for Rig {
    /// A rig dropped without [`Rig::cleanup`] (a test that failed half-way, an early `?`) still
    /// deletes what it made: its replicas and mock are told to stop, and its queues and keys
    /// are deleted on a thread of their own (with its own runtime and connections, so that a
    /// blocked or unwinding test runtime cannot hold it up), within [`DROP_CLEANUP`]. Best
    /// effort: replicas still draining when it is dropped may write a few keys afterwards.
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        self.stop.cancel();
        self.stop_mock.cancel();
        let (settings, topology, prefix) = (
            self.settings.clone(),
            self.topology.clone(),
            self.key_prefix.clone(),
        );
        let deleted = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                tokio::time::timeout(
                    DROP_CLEANUP,
                    delete_queues_and_keys(&settings, &topology, &prefix),
                )
                .await
                .context("timed out")?
            })
        })
        .join();
        match deleted {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!("rig dropped: cleanup failed: {error:#}"),
            Err(_) => eprintln!("rig dropped: the cleanup thread panicked"),
        }
    }
}

/// Longest a dropped rig's cleanup may take (a broker that does not answer must not hang the
/// test that dropped it).
const DROP_CLEANUP: Duration = Duration::from_secs(30);

/// Deletes a rig's queues and keys, on connections of its own.
async fn delete_queues_and_keys(
    settings: &ConsumeArgs,
    topology: &Topology,
    key_prefix: &str,
) -> anyhow::Result<()> {
    let connection =
        turnstile_core::broker::connect(&settings.broker.amqp.url, "turnstile rig cleanup").await?;
    let channel = connection.create_channel().await?;
    topology
        .delete(&channel)
        .await
        .context("deleting the rig's queues")?;
    let _ = connection.close(200, "done".into()).await;
    let redis = RedisConn::connect(&settings.redis).await?;
    delete_prefix(&redis, key_prefix)
        .await
        .context("deleting the rig's keys")?;
    Ok(())
}

/// A registration body as the contract defines it.
/// A registration of `cost` units: the envelope's `cost`, and the product's `"cost"` (which the
/// mock counts) set to it.
pub fn weighed_body(
    message_id: &str,
    seller: &str,
    cost: u32,
    mut product: serde_json::Value,
) -> Vec<u8> {
    product["cost"] = cost.into();
    serde_json::json!({"message_id": message_id, "seller_id": seller, "cost": cost, "product": product})
        .to_string()
        .into_bytes()
}

pub fn registration_body(
    message_id: &str,
    seller: &str,
    batch: Option<&str>,
    product: serde_json::Value,
) -> Vec<u8> {
    let mut body =
        serde_json::json!({"message_id": message_id, "seller_id": seller, "product": product});
    if let Some(batch) = batch {
        body["batch_id"] = batch.into();
    }
    body.to_string().into_bytes()
}

/// Messages ready in `queue`, read on a channel of its own.
async fn queue_depth(connection: &lapin::Connection, queue: &str) -> anyhow::Result<u32> {
    let channel = connection.create_channel().await?;
    let depth = turnstile_core::broker::depth(&channel, queue).await;
    let _ = channel.close(200, "".into()).await;
    depth
}
