//! Queue and exchange names, and their idempotent declaration.

use anyhow::Context;
use clap::ValueEnum;
use lapin::Channel;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::ladder::{Hop, LEVELS};
use super::{long_string, table};

/// The delivery limit declared on quorum ladder levels: never reached (see `declare`).
const DELIVERY_LIMIT: i64 = 1_000_000;

/// The queue type of every queue turnstile declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QueueType {
    /// Replicated across a broker cluster; at-least-once dead-lettering between queues.
    Quorum,
    /// A single node's queue (lighter; dead-lettering between queues is at-most-once).
    Classic,
}

/// The names derived from the work queue's.
#[derive(Clone, Debug)]
pub struct Topology {
    work: String,
    dead: String,
    queue_type: QueueType,
    delay_type: QueueType,
}

impl Topology {
    /// Every queue is of `queue_type` (see [`Topology::with_delay_type`] for the ladder).
    pub fn new(work: &str, queue_type: QueueType) -> Self {
        Self {
            work: work.to_owned(),
            dead: format!("{work}.dead"),
            queue_type,
            delay_type: queue_type,
        }
    }

    /// The queue type of the delay ladder's levels (quorum by default: at-least-once
    /// dead-lettering from level to level).
    pub fn with_delay_type(mut self, delay_type: QueueType) -> Self {
        self.delay_type = delay_type;
        self
    }
    pub fn work(&self) -> &str {
        &self.work
    }
    pub fn dead(&self) -> &str {
        &self.dead
    }
    /// The queue of delay level `k` (messages wait 2^k x UNIT in it).
    pub(super) fn level(&self, k: u32) -> String {
        format!("{}.wait.{k}", self.work)
    }
    /// Level `k` of the ladder of turnstile before 0.2 (TTL queues and exchanges
    /// `<q>.delay.<k>`), drained if the broker still has it.
    pub(super) fn legacy_level(&self, k: u32) -> String {
        format!("{}.delay.{k}", self.work)
    }

    /// The queue a message enters for `hop` (published through the default exchange).
    pub fn hop_queue(&self, hop: Hop) -> String {
        match hop {
            Hop::Level { level, .. } => self.level(level),
            Hop::Work => self.work.clone(),
        }
    }

    fn queue_arguments(&self, extra: &[(&str, AMQPValue)]) -> FieldTable {
        let mut pairs: Vec<(&str, AMQPValue)> = Vec::new();
        if self.queue_type == QueueType::Quorum {
            pairs.push(("x-queue-type", long_string("quorum")));
        }
        pairs.extend_from_slice(extra);
        table(&pairs)
    }

    async fn declare_queue(
        &self,
        channel: &Channel,
        name: &str,
        args: FieldTable,
    ) -> anyhow::Result<()> {
        channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions { durable: true, ..Default::default() },
                args,
            )
            .await
            .with_context(|| format!("declaring queue {name:?} (if it exists with other arguments, delete it or pick another TURNSTILE_QUEUE)"))?;
        Ok(())
    }

    /// Declares everything (idempotent: safe for every replica at every start).
    pub async fn declare(&self, channel: &Channel) -> anyhow::Result<()> {
        self.declare_queue(channel, &self.work, self.queue_arguments(&[]))
            .await?;
        self.declare_queue(channel, &self.dead, self.queue_arguments(&[]))
            .await?;
        for k in 0..LEVELS {
            let mut args = Vec::new();
            if self.delay_type == QueueType::Quorum {
                args.push(("x-queue-type", long_string("quorum")));
                // RabbitMQ 4.x gives quorum queues a delivery limit of 20 by default: a held
                // ladder message is returned at every lost connection, and must never be
                // dropped for it.
                args.push(("x-delivery-limit", AMQPValue::LongLongInt(DELIVERY_LIMIT)));
            }
            self.declare_queue(channel, &self.level(k), table(&args))
                .await?;
        }
        Ok(())
    }

    /// Every queue of the topology: work, dead letters, ladder levels.
    pub fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.work.clone(), self.dead.clone()];
        queues.extend((0..LEVELS).map(|k| self.level(k)));
        queues
    }

    /// Deletes everything `declare` made (tests, demos and benchmarks clean up with it).
    pub async fn delete(&self, channel: &Channel) -> anyhow::Result<()> {
        for q in self.queues() {
            channel
                .queue_delete(ShortString::from(q), QueueDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}
