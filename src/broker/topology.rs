//! Queue and exchange names, and their idempotent declaration.

use anyhow::Context;
use clap::ValueEnum;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection};
use tracing::warn;

use super::ladder::{Hop, LEVELS};
use super::{long_string, table};

/// The delivery limit declared on quorum ladder levels: never reached (see `declare`).
const LADDER_DELIVERY_LIMIT: i64 = 1_000_000;

/// Returns of one message to a quorum work queue (nacks with requeue, lost connections, killed
/// replicas) after which the broker dead-letters it to `<q>.dead`. A healthy system returns a
/// message a handful of times at most; a poison message that kills every replica it reaches is
/// returned at each kill and stops here (README, "Faults").
pub const WORK_DELIVERY_LIMIT: u32 = 500;

/// The work queue arguments that older turnstiles did not declare: a broker that has the queue
/// without them refuses a declaration naming them (PRECONDITION_FAILED).
const PROTECTION_ARGS: [&str; 5] = [
    "x-delivery-limit",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-dead-letter-strategy",
    "x-overflow",
];

/// How `declare` found the work queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkQueue {
    /// Declared with its delivery limit (quorum) and dead-letter target.
    Protected,
    /// Declared by an older turnstile without them, and used as it is: `policy` is the
    /// `rabbitmqctl` command that gives it the same protection (logged as a warning).
    Legacy { policy: String },
}

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
    ready: String,
    dead: String,
    queue_type: QueueType,
    delay_type: QueueType,
    delivery_limit: u32,
}

impl Topology {
    /// Every queue is of `queue_type` (see [`Topology::with_delay_type`] for the ladder).
    pub fn new(work: &str, queue_type: QueueType) -> Self {
        Self {
            work: work.to_owned(),
            ready: format!("{work}.ready"),
            dead: format!("{work}.dead"),
            queue_type,
            delay_type: queue_type,
            delivery_limit: WORK_DELIVERY_LIMIT,
        }
    }

    /// Another delivery limit for the work queue than [`WORK_DELIVERY_LIMIT`] (tests reach a
    /// small one quickly; replicas always use the default).
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// The queue type of the delay ladder's levels (quorum by default: at-least-once
    /// dead-lettering from level to level).
    pub fn with_delay_type(mut self, delay_type: QueueType) -> Self {
        self.delay_type = delay_type;
        self
    }
    /// The work queue's name.
    pub fn work(&self) -> &str {
        &self.work
    }
    /// The return queue's name (`<q>.ready`): where every message comes back into the consume
    /// path after a delay (the end of a ladder hop, a release, a return at shutdown), consumed
    /// beside the work queue so that it is never queued behind the work queue's backlog.
    pub fn ready(&self) -> &str {
        &self.ready
    }
    /// The dead-letter queue's name (`<q>.dead`).
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
            Hop::Ready => self.ready.clone(),
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

    /// The work queue's arguments, which the return queue shares: a quorum queue dead-letters a
    /// message returned more than `delivery_limit` times to `<q>.dead`, at least once (which
    /// needs `x-overflow: reject-publish`; without a length limit it changes nothing else). A
    /// classic queue has no delivery limit; it gets the same dead-letter target, which only an
    /// operator's TTL or length limit could use: turnstile never rejects nor nacks a work
    /// message without requeue.
    fn work_arguments(&self) -> FieldTable {
        let mut extra = vec![
            ("x-dead-letter-exchange", long_string("")),
            ("x-dead-letter-routing-key", long_string(&self.dead)),
        ];
        if self.queue_type == QueueType::Quorum {
            extra.extend([
                (
                    "x-delivery-limit",
                    AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
                ),
                ("x-dead-letter-strategy", long_string("at-least-once")),
                ("x-overflow", long_string("reject-publish")),
            ]);
        }
        self.queue_arguments(&extra)
    }

    /// The policy with the same effect as [`Topology::work_arguments`], for a work queue
    /// declared without them: the `rabbitmqctl` command that sets it in `vhost`.
    fn policy_command(&self, vhost: &str) -> String {
        let mut definition = serde_json::json!({
            "dead-letter-exchange": "",
            "dead-letter-routing-key": self.dead,
        });
        if self.queue_type == QueueType::Quorum {
            definition["delivery-limit"] = self.delivery_limit.into();
            definition["dead-letter-strategy"] = "at-least-once".into();
            definition["overflow"] = "reject-publish".into();
        }
        format!(
            "rabbitmqctl set_policy -p {} {} {} {} --apply-to queues",
            shell_quote(vhost),
            shell_quote(&format!("turnstile-{}", self.work)),
            shell_quote(&format!("^{}$", regex_escape(&self.work))),
            shell_quote(&definition.to_string()),
        )
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

    /// Declares everything on a channel of its own (idempotent: safe for every replica at every
    /// start). A work queue that an older turnstile declared without the delivery limit and
    /// dead-letter target is kept as it is, with a warning that names the policy giving it the
    /// same protection; any other difference (e.g. the queue type) fails.
    pub async fn declare(&self, connection: &Connection) -> anyhow::Result<WorkQueue> {
        let mut channel = open_channel(connection).await?;
        let work = match self
            .declare_queue(&channel, &self.work, self.work_arguments())
            .await
        {
            Ok(()) => WorkQueue::Protected,
            Err(error) => {
                let Some(refusal) = missing_protection(&error) else {
                    return Err(error);
                };
                // The refusal closed the channel.
                channel = open_channel(connection).await?;
                self.declare_queue(&channel, &self.work, self.queue_arguments(&[]))
                    .await?;
                let policy = self.policy_command(&refusal.vhost);
                let risk = match self.queue_type {
                    QueueType::Quorum => {
                        "without a delivery limit and dead-letter target: RabbitMQ 4.x drops a \
                         message returned more than 20 times (its default limit), RabbitMQ 3.x \
                         redelivers a message that crashes replicas forever"
                    }
                    QueueType::Classic => {
                        "without a dead-letter target: a TTL or length limit set by a policy \
                         drops messages instead of dead-lettering them"
                    }
                };
                warn!(
                    queue = %self.work,
                    broker = %refusal.message,
                    "the work queue was declared by an older turnstile {risk}; it is used as it \
                     is. Give it the same protection with: {policy}"
                );
                WorkQueue::Legacy { policy }
            }
        };
        self.declare_queue(&channel, &self.dead, self.queue_arguments(&[]))
            .await?;
        // The return queue is new (issue 13): no older turnstile declared it without its
        // protection, so it needs no fallback.
        self.declare_queue(&channel, &self.ready, self.work_arguments())
            .await?;
        for k in 0..LEVELS {
            let mut args = Vec::new();
            if self.delay_type == QueueType::Quorum {
                args.push(("x-queue-type", long_string("quorum")));
                // RabbitMQ 4.x gives quorum queues a delivery limit of 20 by default: a held
                // ladder message is returned at every lost connection, and must never be
                // dropped for it.
                args.push((
                    "x-delivery-limit",
                    AMQPValue::LongLongInt(LADDER_DELIVERY_LIMIT),
                ));
            }
            self.declare_queue(&channel, &self.level(k), table(&args))
                .await?;
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(work)
    }

    /// Every queue of the topology: work, return queue, dead letters, ladder levels.
    pub fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.work.clone(), self.ready.clone(), self.dead.clone()];
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

async fn open_channel(connection: &Connection) -> anyhow::Result<Channel> {
    connection
        .create_channel()
        .await
        .context("opening a channel to declare the topology")
}

/// The broker's refusal of a declaration because the existing queue lacks one of the
/// [`PROTECTION_ARGS`].
struct Refusal {
    message: String,
    vhost: String,
}

/// The refusal in `error` if it is PRECONDITION_FAILED for an argument of [`PROTECTION_ARGS`]
/// that the existing queue does not have (the broker names only the first argument that
/// differs: another difference, e.g. the queue type, shows when the queue is declared as
/// before).
fn missing_protection(error: &anyhow::Error) -> Option<Refusal> {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    error
        .chain()
        .filter_map(|e| e.downcast_ref::<lapin::Error>())
        .find_map(|e| match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp)
                if amqp.kind() == &AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) =>
            {
                let message = amqp.get_message().to_string();
                let missing = PROTECTION_ARGS
                    .iter()
                    .any(|arg| message.contains(&format!("inequivalent arg '{arg}'")))
                    && message.ends_with("but current is none");
                missing.then(|| Refusal {
                    vhost: quoted_after(&message, "in vhost '")
                        .unwrap_or("/")
                        .to_owned(),
                    message,
                })
            }
            _ => None,
        })
}

/// The text between `prefix` and the next `'`.
fn quoted_after<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let start = text.find(prefix)? + prefix.len();
    let len = text[start..].find('\'')?;
    Some(&text[start..start + len])
}

/// `s` as one single-quoted POSIX shell word.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `s` with the regular expression metacharacters escaped (policy patterns are regexes).
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.^$|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_command_matches_exactly_the_work_queue_and_survives_the_shell() {
        let quorum = Topology::new("registrations", QueueType::Quorum);
        assert_eq!(
            quorum.policy_command("/"),
            "rabbitmqctl set_policy -p '/' 'turnstile-registrations' '^registrations$' \
             '{\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":\"registrations.dead\",\
             \"dead-letter-strategy\":\"at-least-once\",\"delivery-limit\":500,\
             \"overflow\":\"reject-publish\"}' --apply-to queues"
        );
        let classic = Topology::new("it's.v2", QueueType::Classic);
        assert_eq!(
            classic.policy_command("prod"),
            r#"rabbitmqctl set_policy -p 'prod' 'turnstile-it'\''s.v2' '^it'\''s\.v2$' '{"dead-letter-exchange":"","dead-letter-routing-key":"it'\''s.v2.dead"}' --apply-to queues"#
        );
    }
}
