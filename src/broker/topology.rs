//! Queue and exchange names, and their idempotent declaration.

use std::time::Duration;

use anyhow::Context;
use clap::ValueEnum;
use lapin::Channel;
use lapin::ExchangeKind;
use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::{LEVELS, UNIT, long_string, table};

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
    fn level(&self, k: u32) -> String {
        format!("{}.delay.{k}", self.work)
    }
    fn out(&self) -> String {
        format!("{}.delay.out", self.work)
    }

    /// The exchange and routing key that delay a message by `delay`, rounded down to UNIT and
    /// capped at the ladder's maximum (a longer wait simply goes round again).
    pub fn delay_route(&self, delay: Duration) -> (String, String) {
        let max = (1u64 << LEVELS) - 1;
        let units = ((delay.as_millis() / UNIT.as_millis()) as u64).min(max);
        let key = (0..LEVELS)
            .rev()
            .map(|k| if units & (1 << k) != 0 { "1" } else { "0" })
            .collect::<Vec<_>>()
            .join(".");
        (self.level(LEVELS - 1), key)
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

    async fn declare_exchange(
        &self,
        channel: &Channel,
        name: &str,
        kind: ExchangeKind,
    ) -> anyhow::Result<()> {
        channel
            .exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("declaring exchange {name:?}"))
    }

    /// Declares everything (idempotent: safe for every replica at every start).
    pub async fn declare(&self, channel: &Channel) -> anyhow::Result<()> {
        self.declare_queue(channel, &self.work, self.queue_arguments(&[]))
            .await?;
        self.declare_queue(channel, &self.dead, self.queue_arguments(&[]))
            .await?;
        let out = self.out();
        self.declare_exchange(channel, &out, ExchangeKind::Fanout)
            .await?;
        channel
            .queue_bind(
                self.work.as_str().into(),
                out.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .context("binding the work queue to the delay ladder's exit")?;
        for k in 0..LEVELS {
            let name = self.level(k);
            let next = if k == 0 {
                out.clone()
            } else {
                self.level(k - 1)
            };
            let ttl_ms = (UNIT.as_millis() as i64) << k;
            let mut extra = vec![
                ("x-message-ttl", AMQPValue::LongLongInt(ttl_ms)),
                ("x-dead-letter-exchange", long_string(&next)),
            ];
            if self.delay_type == QueueType::Quorum {
                extra.push(("x-queue-type", long_string("quorum")));
                extra.push(("x-dead-letter-strategy", long_string("at-least-once")));
                extra.push(("x-overflow", long_string("reject-publish")));
            }
            self.declare_queue(channel, &name, super::table(&extra))
                .await?;
            self.declare_exchange(channel, &name, ExchangeKind::Topic)
                .await?;
            let position = "*.".repeat((LEVELS - 1 - k) as usize);
            channel
                .queue_bind(
                    name.as_str().into(),
                    name.as_str().into(),
                    format!("{position}1.#").into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .with_context(|| format!("binding delay level {k}"))?;
            channel
                .exchange_bind(
                    next.as_str().into(),
                    name.as_str().into(),
                    format!("{position}0.#").into(),
                    ExchangeBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .with_context(|| format!("binding delay level {k} to the next"))?;
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
        let mut exchanges = vec![self.out()];
        exchanges.extend((0..LEVELS).map(|k| self.level(k)));
        for q in self.queues() {
            channel
                .queue_delete(ShortString::from(q), QueueDeleteOptions::default())
                .await?;
        }
        for e in exchanges {
            channel
                .exchange_delete(ShortString::from(e), ExchangeDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_written_in_binary_from_the_top_level() {
        let t = Topology::new("q", QueueType::Quorum);
        let (exchange, key) = t.delay_route(Duration::from_millis(1300));
        assert_eq!(exchange, format!("q.delay.{}", LEVELS - 1));
        let bits: Vec<&str> = key.split('.').collect();
        assert_eq!(bits.len(), LEVELS as usize);
        assert_eq!(bits[bits.len() - 3..], ["1", "0", "1"]); // 5 units = 1250 ms
        assert!(bits[..bits.len() - 3].iter().all(|b| *b == "0"));
    }
}
