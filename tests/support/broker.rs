//! A broker topology of its own for one test (unique queue name), deleted at cleanup.

use lapin::options::{BasicConsumeOptions, QueuePurgeOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use turnstile_core::broker::{self, Publisher, QueueType, Topology};

pub fn amqp_url() -> String {
    std::env::var("TURNSTILE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub struct TestBroker {
    pub connection: Connection,
    pub publisher: Publisher,
    pub topology: Topology,
}

impl TestBroker {
    /// Declares a fresh topology named `t-<what>-<random>`.
    pub async fn new(what: &str, queue_type: QueueType) -> Self {
        Self::with_delay_type(what, queue_type, queue_type).await
    }

    /// A fresh topology whose delay ladder levels are of `delay_type`.
    pub async fn with_delay_type(what: &str, queue_type: QueueType, delay_type: QueueType) -> Self {
        let topology = Topology::new(&super::unique(what), queue_type).with_delay_type(delay_type);
        let broker = Self::undeclared(topology).await;
        broker
            .topology
            .declare(&broker.connection)
            .await
            .expect("the topology is declared");
        broker
    }

    /// Connects for `topology` without declaring anything (the test declares it, maybe after
    /// setting up what an older turnstile left); `cleanup` still deletes the whole topology.
    pub async fn undeclared(topology: Topology) -> Self {
        super::init_tracing();
        let connection = broker::connect(&amqp_url(), "turnstile test")
            .await
            .expect("RabbitMQ is reachable");
        let publisher = Publisher::open(&connection).await.unwrap();
        Self {
            connection,
            publisher,
            topology,
        }
    }

    /// A new connection and publisher (after a broker restart).
    pub async fn reconnect(&mut self) {
        self.connection = broker::connect(&amqp_url(), "turnstile test")
            .await
            .expect("RabbitMQ is reachable");
        self.publisher = Publisher::open(&self.connection).await.unwrap();
    }

    pub fn queue(&self) -> &str {
        self.topology.work()
    }

    /// Publishes a JSON body to the work queue the way a producer does.
    pub async fn publish(&self, body: &[u8]) {
        let properties = BasicProperties::default().with_content_type("application/json".into());
        self.publisher
            .publish("", self.topology.work(), body, properties)
            .await
            .unwrap();
    }

    /// Publishes JSON bodies to the work queue, confirmed, many in flight at once (a backlog of
    /// thousands in seconds).
    pub async fn publish_all(&self, bodies: Vec<Vec<u8>>) {
        use futures::StreamExt;
        let queue = self.topology.work();
        let published: Vec<_> = futures::stream::iter(bodies)
            .map(|body| async move {
                let properties =
                    BasicProperties::default().with_content_type("application/json".into());
                self.publisher.publish("", queue, &body, properties).await
            })
            .buffer_unordered(256)
            .collect()
            .await;
        for result in published {
            result.expect("the broker confirmed the publish");
        }
    }

    /// Publishes a JSON body to the work queue with AMQP headers (e.g. forged internal ones).
    pub async fn publish_with_headers(&self, body: &[u8], headers: &[(&str, AMQPValue)]) {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert((*name).into(), value.clone());
        }
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_headers(table);
        self.publisher
            .publish("", self.topology.work(), body, properties)
            .await
            .unwrap();
    }

    /// A consumer on any queue of this topology.
    pub async fn consume(&self, queue: &str) -> lapin::Consumer {
        let channel = self.connection.create_channel().await.unwrap();
        channel
            .basic_consume(
                queue.into(),
                super::unique("c").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap()
    }

    /// Messages ready in a queue.
    /// Messages ready in a queue (on a fresh connection: the test's may have seen a restart).
    pub async fn depth(&self, queue: &str) -> u32 {
        let connection = broker::connect(&amqp_url(), "turnstile test depth")
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let depth = broker::depth(&channel, queue).await.unwrap();
        let _ = connection.close(200, "".into()).await;
        depth
    }

    /// Messages waiting in any queue of the topology (work, delay ladder, dead letters); with
    /// no consumer running, that is every message the broker still holds.
    pub async fn depth_everywhere(&self) -> u32 {
        let mut total = 0;
        for queue in self.topology.queues() {
            total += self.depth(&queue).await;
        }
        total
    }

    /// Moves the delay ladder on (as every replica does) until the returned token is cancelled.
    pub async fn run_ladder(&self) -> tokio_util::sync::CancellationToken {
        let stop = tokio_util::sync::CancellationToken::new();
        let ladder = std::sync::Arc::new(broker::ladder::Ladder {
            topology: self.topology.clone(),
            publisher: self.publisher.clone(),
            stats: Default::default(),
            prefetch: 64,
            releases: tokio::sync::broadcast::channel(1).0,
        });
        let tracker = tokio_util::task::TaskTracker::new();
        ladder
            .start(&self.connection, &tracker, &stop, &stop.child_token())
            .await
            .expect("the ladder starts");
        stop
    }

    pub async fn purge(&self, queue: &str) {
        let channel = self.connection.create_channel().await.unwrap();
        channel
            .queue_purge(queue.into(), QueuePurgeOptions::default())
            .await
            .unwrap();
    }

    /// Deletes the topology (on a fresh connection: the test's may have seen a broker restart).
    pub async fn cleanup(self) {
        let connection = broker::connect(&amqp_url(), "turnstile test cleanup")
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        self.topology.delete(&channel).await.unwrap();
        let _ = connection.close(200, "".into()).await;
    }
}
