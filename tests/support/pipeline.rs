//! A whole pipeline for one test: its own queues, key prefix and strict mock downstream, and
//! in-process replicas started on demand.

use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use tokio_util::sync::CancellationToken;
use turnstile_core::broker::QueueType;
use turnstile_core::config::Algorithm;
use turnstile_core::downstream::DownstreamArgs;
use turnstile_core::replica::ConsumeArgs;
use turnstile_lab::mock_api::{MockArgs, MockServer, Stats};
use turnstile_ops::serve::{HttpArgs, ServeArgs, Served};

use super::broker::{TestBroker, amqp_url};
use super::{Keys, limiter, redis_args};

pub struct Pipeline {
    pub broker: TestBroker,
    pub keys: Keys,
    pub mock: MockServer,
    pub limit: String,
    pub redis_url: String,
    pub delay_type: QueueType,
    stop_mock: CancellationToken,
    replicas: Vec<(CancellationToken, Served)>,
}

impl Pipeline {
    /// Queues, keys and a strict mock enforcing `limit`.
    pub async fn new(what: &str, limit: &str) -> Self {
        Self::with_mock(what, limit, 0).await
    }

    pub async fn with_mock(what: &str, limit: &str, latency_ms: u64) -> Self {
        let mock = MockArgs {
            latency_ms,
            ..MockArgs::local(limit.parse().unwrap())
        };
        Self::with_mock_args(what, limit, mock).await
    }

    /// A pipeline whose mock runs with `mock` (its limit is `limit`'s).
    pub async fn with_mock_args(what: &str, limit: &str, mock: MockArgs) -> Self {
        Self::build(what, limit, mock, &super::redis_url(), QueueType::Quorum).await
    }

    /// A pipeline whose delay ladder levels are of `delay_type`.
    pub async fn with_delay_type(what: &str, limit: &str, delay_type: QueueType) -> Self {
        let mock = MockArgs::local(limit.parse().unwrap());
        Self::build(what, limit, mock, &super::redis_url(), delay_type).await
    }

    /// A pipeline whose replicas use the Redis at `redis_url`.
    pub async fn on_redis(what: &str, limit: &str, redis_url: &str) -> Self {
        let mock = MockArgs::local(limit.parse().unwrap());
        Self::build(what, limit, mock, redis_url, QueueType::Quorum).await
    }

    /// A pipeline on a topology the test has declared itself (quorum ladder levels).
    pub async fn on_broker(what: &str, limit: &str, broker: TestBroker) -> Self {
        let mock = MockArgs::local(limit.parse().unwrap());
        Self::around(
            broker,
            what,
            limit,
            mock,
            &super::redis_url(),
            QueueType::Quorum,
        )
        .await
    }

    async fn build(
        what: &str,
        limit: &str,
        mock: MockArgs,
        redis_url: &str,
        delay_type: QueueType,
    ) -> Self {
        let broker = TestBroker::with_delay_type(what, QueueType::Quorum, delay_type).await;
        Self::around(broker, what, limit, mock, redis_url, delay_type).await
    }

    async fn around(
        broker: TestBroker,
        what: &str,
        limit: &str,
        mock: MockArgs,
        redis_url: &str,
        delay_type: QueueType,
    ) -> Self {
        let keys = Keys::at(redis_url, what).await;
        let redis_url = redis_url.to_owned();
        let stop_mock = CancellationToken::new();
        let mock = MockServer::start(
            MockArgs {
                limit: limit.parse().unwrap(),
                ..mock
            },
            stop_mock.clone(),
        )
        .await
        .unwrap();
        Self {
            broker,
            keys,
            mock,
            limit: limit.to_owned(),
            redis_url,
            delay_type,
            stop_mock,
            replicas: Vec::new(),
        }
    }

    /// The settings a replica of this pipeline runs with (tests adjust them before starting).
    pub fn settings(&self, workers: u32) -> ConsumeArgs {
        ConsumeArgs {
            broker: turnstile_core::broker::BrokerArgs {
                amqp_url: amqp_url(),
                queue: self.broker.queue().to_owned(),
                queue_type: QueueType::Quorum,
                delay_queue_type: self.delay_type,
            },
            workers,
            prefetch: None,
            delay_prefetch: 64,
            max_attempts: 8,
            hold: Duration::from_secs(2),
            max_pause: Duration::from_secs(3600),
            throttle_deadline: Duration::from_secs(24 * 3600),
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(1),
            done_ttl: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(8),
            downstream: DownstreamArgs {
                url: self.mock.url(),
                token: Some("secret-token".into()),
                timeout: Duration::from_secs(5),
            },
            redis: redis_args(&self.redis_url, &self.keys.prefix),
            limiter: limiter(&self.limit, Algorithm::SlidingWindow),
        }
    }

    /// Starts `n` in-process replicas with `workers` each.
    pub async fn start_replicas(&mut self, n: usize, workers: u32) {
        for _ in 0..n {
            let settings = self.settings(workers);
            self.start_replica(settings).await;
        }
    }

    /// Starts one replica with `settings`, serving no HTTP.
    pub async fn start_replica(&mut self, settings: ConsumeArgs) {
        self.start_replica_serving(settings, HttpArgs::off()).await;
    }

    /// Starts one replica with `settings`, serving its endpoints as `http` says.
    pub async fn start_replica_serving(&mut self, settings: ConsumeArgs, http: HttpArgs) {
        let token = CancellationToken::new();
        let settings = ServeArgs {
            consume: settings,
            http,
        };
        let replica = Served::start(settings, token.clone())
            .await
            .expect("replica starts");
        self.replicas.push((token, replica));
    }

    /// Deliveries received by all replicas so far.
    pub fn deliveries(&self) -> u64 {
        self.replicas
            .iter()
            .map(|(_, r)| {
                r.stats
                    .deliveries
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum()
    }

    /// Sum of a counter over all replicas.
    pub fn total(
        &self,
        counter: impl Fn(&turnstile_core::worker::Stats) -> &std::sync::atomic::AtomicU64,
    ) -> u64 {
        self.replicas
            .iter()
            .map(|(_, r)| counter(&r.stats).load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// Waits until the replicas have settled `n` messages as registered (acked, recorded).
    pub async fn wait_settled_registered(&self, n: u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        while self.total(|s| &s.registered) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "replicas settled fewer than {n}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Publishes `n` registrations for a seller (ids `<seller>-<i>`).
    pub async fn publish(&self, seller: &str, n: usize) {
        for i in 0..n {
            self.publish_product(
                seller,
                &format!("{seller}-{i}"),
                serde_json::json!({"sku": i}),
            )
            .await;
        }
    }

    pub async fn publish_product(
        &self,
        seller: &str,
        message_id: &str,
        product: serde_json::Value,
    ) {
        let body =
            serde_json::json!({"message_id": message_id, "seller_id": seller, "product": product});
        self.broker.publish(body.to_string().as_bytes()).await;
    }

    /// Waits until the mock has registered `n` messages (a guard against hanging, not a speed
    /// check: generous on purpose).
    pub async fn wait_registered(&self, n: u64) -> Stats {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            let stats = self.mock.stats();
            if stats.registered >= n {
                return stats;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "only {} of {n} registered: {stats:?}",
                stats.registered
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for `n` dead letters and returns them (acked).
    pub async fn dead_letters(&self, n: usize) -> Vec<Delivery> {
        let mut consumer = self.broker.consume(self.broker.topology.dead()).await;
        let mut out = Vec::new();
        while out.len() < n {
            let next = tokio::time::timeout(Duration::from_secs(120), consumer.next()).await;
            let delivery = next
                .expect("dead letter within the guard time")
                .unwrap()
                .unwrap();
            delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .unwrap();
            out.push(delivery);
        }
        out
    }

    /// Stops every replica (as SIGTERM would) and waits for them to drain.
    /// The replicas started so far (for readiness and counters).
    pub fn replicas(&self) -> impl Iterator<Item = &Served> {
        self.replicas.iter().map(|(_, r)| r)
    }

    pub async fn stop_replicas(&mut self) {
        for (token, _) in &self.replicas {
            token.cancel();
        }
        for (_, replica) in self.replicas.drain(..) {
            replica.wait().await.expect("replica stops cleanly");
        }
    }

    pub async fn cleanup(mut self) {
        self.stop_replicas().await;
        self.stop_mock.cancel();
        self.broker.cleanup().await;
        self.keys.cleanup().await;
    }
}
