//! A broker topology of its own for one test (unique queue name), deleted at cleanup.

use lapin::options::{BasicConsumeOptions, QueuePurgeOptions};
use lapin::types::FieldTable;
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
        let topology = Topology::new(&super::unique(what), queue_type);
        let broker = Self::undeclared(topology).await;
        broker
            .topology
            .declare(&broker.connection)
            .await
            .expect("the topology is declared");
        broker
    }

    /// Connects for `topology` without declaring anything (the test declares it, maybe after
    /// declaring queues as an operator or a producer would); `cleanup` still deletes the whole
    /// topology.
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

    /// Moves the delay ladder on (as every replica does) until the returned token is cancelled,
    /// due messages going to the return queue.
    pub async fn run_ladder(&self) -> tokio_util::sync::CancellationToken {
        self.run_ladder_handing(None).await.0
    }

    /// As [`Self::run_ladder`], due messages going to `handoff` (as a replica's go to its
    /// workers) when given; also returns the ladder's stats.
    pub async fn run_ladder_handing(
        &self,
        handoff: Option<broker::ladder::Handoff>,
    ) -> (
        tokio_util::sync::CancellationToken,
        std::sync::Arc<broker::ladder::LadderStats>,
    ) {
        let stop = tokio_util::sync::CancellationToken::new();
        let ladder = std::sync::Arc::new(broker::ladder::Ladder {
            topology: self.topology.clone(),
            publisher: self.publisher.clone(),
            stats: Default::default(),
            cost: Default::default(),
            prefetch: 64,
            releases: tokio::sync::broadcast::channel(1).0,
            terms: tokio::sync::watch::channel(Default::default()).1,
            handoff,
        });
        let tracker = tokio_util::task::TaskTracker::new();
        ladder
            .start(&self.connection, &tracker, &stop, &stop.child_token())
            .await
            .expect("the ladder starts");
        (stop, ladder.stats.clone())
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
