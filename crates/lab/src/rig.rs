//! An in-process rig: a strict mock downstream, N consumer replicas, a queue topology and key
//! prefix of its own; publishes a workload, waits for it, reports what the downstream saw, and
//! cleans up. Used by `turnstile bench scenario` and `turnstile demo`.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use lapin::BasicProperties;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::mock_api::{MockArgs, MockServer, Stats};
use turnstile_core::broker::{BrokerArgs, DEFAULT_AMQP_URL, Publisher, QueueType, Topology};
use turnstile_core::config::Limit;
use turnstile_core::config::{LimiterArgs, RedisArgs};
use turnstile_core::downstream::DownstreamArgs;
use turnstile_core::permit::{PermitStore, RedisConn};
use turnstile_core::replica::ConsumeArgs;
use turnstile_ops::serve::{HttpArgs, ServeArgs, Served};

/// Where a rig runs: the broker and Redis it uses. Its queue and key prefix are its own
/// (`turnstile-<name>-<random>`, `<prefix>-<name>-<random>`), deleted when it finishes.
#[derive(clap::Args, Debug, Clone)]
pub struct RigArgs {
    #[arg(long = "queue-type", value_enum, default_value_t = QueueType::Quorum)]
    pub queue_type: QueueType,
    #[arg(long = "amqp-url", env = "TURNSTILE_AMQP_URL", default_value = DEFAULT_AMQP_URL, hide_env_values = true)]
    pub amqp_url: String,
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
                amqp_url: self.amqp_url.clone(),
                queue: format!("turnstile-{name}"),
                queue_type: self.queue_type,
                delay_queue_type: self.queue_type,
            },
            workers,
            prefetch: None,
            delay_prefetch: 64,
            max_attempts: 8,
            hold,
            max_pause: Duration::from_secs(3600),
            throttle_deadline: Duration::from_secs(24 * 3600),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            done_ttl: Duration::from_secs(3600),
            shutdown_grace: Duration::from_secs(8),
            downstream: DownstreamArgs {
                url: "http://127.0.0.1:1/{seller_id}".into(),
                token: None,
                timeout: Duration::from_secs(10),
            },
            redis,
            limiter,
        }
    }
}

/// One message to publish: its seller and body.
pub struct Message {
    pub seller: String,
    pub body: Vec<u8>,
}

/// What the downstream saw, and what the replicas did.
#[derive(Debug, Serialize)]
pub struct Report {
    pub published: u64,
    pub registered: u64,
    pub dead_lettered: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub violations: u64,
    pub deliveries: u64,
    pub deliveries_per_message: f64,
    /// Of the deliveries, those taken from the return queue `<queue>.ready` (messages back
    /// from a delay); the rest came from the work queue.
    pub returns: u64,
    /// The latest a delay ladder message was moved into the return queue after its due time,
    /// in ms (the ladder's own lateness).
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
    pub elapsed_s: f64,
    /// Per seller: registered, first and last registration (s after publishing started).
    pub sellers: BTreeMap<String, SellerReport>,
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

/// A running rig.
pub struct Rig {
    pub mock: MockServer,
    pub topology: Topology,
    pub key_prefix: String,
    pub limit: Limit,
    /// The rig's Redis, under its key prefix (upload progress, cleanup).
    store: PermitStore,
    connection: lapin::Connection,
    publisher: Publisher,
    replicas: Vec<Served>,
    /// The settings replicas start with.
    settings: ConsumeArgs,
    /// The endpoints the first replica started serves (off unless set before it starts).
    pub http: HttpArgs,
    stop: CancellationToken,
    stop_mock: CancellationToken,
    published_at_ms: u64,
    published: BTreeMap<String, u64>,
}

impl Rig {
    /// Starts the mock enforcing `base.limiter.limit`, and `replicas` replicas configured as
    /// `base` but on a queue and key prefix of their own (named `<queue>-<random>`), none
    /// serving HTTP (see [`Rig::http`] to have the first one serve the dashboard).
    pub async fn start(base: ConsumeArgs, replicas: usize) -> anyhow::Result<Self> {
        let mock = MockArgs::local(base.limiter.limit);
        Self::start_with(base, mock, replicas).await
    }

    /// As [`Rig::start`], with the mock configured as `mock` (its limit is the replicas').
    pub async fn start_with(
        base: ConsumeArgs,
        mock: MockArgs,
        replicas: usize,
    ) -> anyhow::Result<Self> {
        let mut rig = Self::prepare_with(base, mock).await?;
        rig.start_replicas(replicas).await?;
        Ok(rig)
    }

    /// Starts the mock and declares the queues, without replicas yet (to publish a backlog
    /// before any replica consumes: [`Rig::start_replicas`]).
    pub async fn prepare(base: ConsumeArgs) -> anyhow::Result<Self> {
        let mock = MockArgs::local(base.limiter.limit);
        Self::prepare_with(base, mock).await
    }

    /// As [`Rig::prepare`], with the mock configured as `mock` (its limit is the replicas').
    pub async fn prepare_with(mut base: ConsumeArgs, mock: MockArgs) -> anyhow::Result<Self> {
        let run = format!("{:08x}", rand::random::<u32>());
        base.broker.queue = format!("{}-{run}", base.broker.queue);
        base.redis.key_prefix = format!("{}-{run}", base.redis.key_prefix);
        let stop_mock = CancellationToken::new();
        let mock = MockArgs {
            limit: base.limiter.limit,
            ..mock
        };
        let mock = MockServer::start(mock, stop_mock.clone()).await?;
        base.downstream = DownstreamArgs {
            url: mock.url(),
            token: None,
            timeout: Duration::from_secs(10),
        };
        let redis = RedisConn::connect(&base.redis).await?;
        let (connection, publisher, topology) = base.broker.open("turnstile rig").await?;
        Ok(Self {
            mock,
            topology,
            key_prefix: base.redis.key_prefix.clone(),
            limit: base.limiter.limit,
            store: PermitStore::new(redis, &base.redis.key_prefix, base.limiter.clone()),
            connection,
            publisher,
            replicas: Vec::new(),
            settings: base,
            http: HttpArgs::off(),
            stop: CancellationToken::new(),
            stop_mock,
            published_at_ms: 0,
            published: BTreeMap::new(),
        })
    }

    /// Starts `n` more replicas.
    pub async fn start_replicas(&mut self, n: usize) -> anyhow::Result<()> {
        for _ in 0..n {
            let http = if self.replicas.is_empty() {
                self.http.clone()
            } else {
                HttpArgs::off()
            };
            let settings = ServeArgs {
                consume: self.settings.clone(),
                http,
            };
            self.replicas
                .push(Served::start(settings, self.stop.clone()).await?);
        }
        Ok(())
    }

    /// Publishes the messages in order, confirmed, many in flight at once.
    pub async fn publish(&mut self, messages: Vec<Message>) -> anyhow::Result<()> {
        if self.published.is_empty() {
            self.published_at_ms = self.mock.stats().now_ms;
        }
        for m in &messages {
            *self.published.entry(m.seller.clone()).or_default() += 1;
        }
        let publisher = &self.publisher;
        let queue = self.topology.work().to_owned();
        let results: Vec<_> = futures::stream::iter(messages)
            .map(|m| {
                let queue = queue.clone();
                async move {
                    let properties =
                        BasicProperties::default().with_content_type("application/json".into());
                    publisher.publish("", &queue, &m.body, properties).await
                }
            })
            .buffered(256)
            .collect()
            .await;
        for r in results {
            r.context("publishing the workload")?;
        }
        Ok(())
    }

    /// Where the first replica serves the dashboard, if it does.
    pub fn dashboard(&self) -> Option<std::net::SocketAddr> {
        self.replicas.first().and_then(|r| r.http_addr)
    }

    /// Records an upload of `total` messages, as `turnstile publish` does (for the dashboard
    /// and `turnstile status`).
    pub async fn record_upload(
        &self,
        seller: &turnstile_core::domain::SellerId,
        batch: &turnstile_core::domain::BatchId,
        total: u64,
    ) -> anyhow::Result<()> {
        turnstile_upload::progress::record_published(
            &self.store,
            seller,
            batch,
            total,
            Duration::from_secs(3600),
        )
        .await
        .context("recording the upload")
    }

    pub fn published(&self) -> u64 {
        self.published.values().sum()
    }

    /// Dead letters in the rig's dead-letter queue.
    pub async fn dead_letters(&self) -> anyhow::Result<u64> {
        let channel = self.connection.create_channel().await?;
        let depth = turnstile_core::broker::depth(&channel, self.topology.dead()).await;
        let _ = channel.close(200, "".into()).await;
        Ok(u64::from(depth?))
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
            if stats.registered + self.dead_letters().await? >= self.published()
                || Instant::now() > deadline
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the replicas (draining them), reports, and deletes the rig's queues and keys.
    pub async fn finish(mut self) -> anyhow::Result<Report> {
        self.stop.cancel();
        let (mut deliveries, mut hops, mut returns, mut forfeited) = (0, 0, 0, 0);
        let (mut return_max_late_ms, mut return_late_ms, mut ladder_max_late_ms) = (0, 0, 0);
        for replica in std::mem::take(&mut self.replicas) {
            let (stats, ladder) = (&replica.stats, &replica.stats.ladder);
            deliveries += stats.deliveries.load(Ordering::Relaxed);
            forfeited += stats.forfeited.load(Ordering::Relaxed);
            hops += ladder.hops.load(Ordering::Relaxed);
            returns += ladder.returns.load(Ordering::Relaxed);
            return_late_ms += ladder.return_late_ms.load(Ordering::Relaxed);
            ladder_max_late_ms = ladder_max_late_ms.max(ladder.max_late_ms.load(Ordering::Relaxed));
            return_max_late_ms =
                return_max_late_ms.max(ladder.max_return_late_ms.load(Ordering::Relaxed));
            replica.wait().await?;
        }
        let stats = self.mock.stats();
        let dead_lettered = self.dead_letters().await?;
        let published: u64 = self.published.values().sum();
        let since =
            |ms: Option<u64>| ms.map(|ms| (ms as f64 - self.published_at_ms as f64) / 1000.0);
        let sellers = self
            .published
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
        let report = Report {
            published,
            registered: stats.registered,
            dead_lettered,
            lost: published.saturating_sub(stats.registered + dead_lettered),
            duplicates: stats.duplicates,
            violations: stats.violations,
            deliveries,
            deliveries_per_message: deliveries as f64 / published.max(1) as f64,
            returns,
            ladder_max_late_ms,
            return_max_late_ms,
            return_mean_late_ms: return_late_ms as f64 / returns.max(1) as f64,
            forfeited,
            ladder_hops_per_message: hops as f64 / published.max(1) as f64,
            elapsed_s: (stats.now_ms.saturating_sub(self.published_at_ms)) as f64 / 1000.0,
            sellers,
        };
        let channel = self.connection.create_channel().await?;
        self.topology
            .delete(&channel)
            .await
            .context("deleting the rig's queues")?;
        let _ = self.connection.close(200, "done".into()).await;
        self.store
            .delete_all_keys()
            .await
            .context("deleting the rig's keys")?;
        self.stop_mock.cancel();
        Ok(report)
    }
}

/// A registration body as the contract defines it.
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
