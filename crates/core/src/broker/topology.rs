//! Queue and exchange names, and their idempotent declaration.

use anyhow::Context;
use clap::ValueEnum;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection};
use tracing::warn;

use super::ladder::{AckTimeout, Holds, Hop, LEVELS};
use super::{long_string, table};
use crate::config::ConsumerTimeout;

/// The delivery limit of the quorum queues where a return never means a poison message: the
/// ladder's levels (a held message is returned at every lost connection) and `<q>.dead` (every
/// `dead-letters list`, and every replay that keeps a dead letter, returns it once). RabbitMQ
/// 4.x gives a quorum queue without one a limit of 20 and then drops the message; this one is
/// never reached: a million returns are a listing every 30 s for a year. Not `-1`, which only
/// RabbitMQ 4.0 and later read as unlimited: 3.10.8 accepts it and drops a message at its
/// first return, and a queue keeps its arguments across broker upgrades.
pub const UNREACHED_DELIVERY_LIMIT: u32 = 1_000_000;

/// Returns of one message to a quorum work queue (nacks with requeue, lost connections, killed
/// replicas) after which the broker dead-letters it to `<q>.dead`. A healthy system returns a
/// message a handful of times at most; a poison message that kills every replica it reaches is
/// returned at each kill and stops here (docs/faults.md, "Returned messages").
pub const WORK_DELIVERY_LIMIT: u32 = 500;

/// How `declare` found a queue that turnstile declares with protective arguments (the work
/// queue's delivery limit and dead-letter target, the dead-letter queue's delivery limit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Protection {
    /// Declared with them (new, or already with them).
    Protected,
    /// Already there without them (declared before turnstile started, by an operator or a
    /// producer: a producer may publish once the queue exists), and used as it is: `policy` is
    /// the `rabbitmqctl` command that gives it the same protection (logged as a warning).
    Unprotected { policy: String },
}

/// Why a `reply_to` is refused (see [`Topology::refuses_reply_to`]): the result then goes
/// only to the results exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReplyRefusal {
    /// The work queue `<q>`, or any queue named `<q>.…` (the return queue, the dead letters,
    /// the ladder's levels, and whatever turnstile may name so later): a reply there would be
    /// consumed as a registration, or sit among the dead letters, replayable.
    OwnQueue,
    /// A queue named as another turnstile deployment names its own (`….ready`, `….dead`,
    /// `….wait.<k>`): the same harm, to that deployment.
    TurnstileQueue,
}

impl ReplyRefusal {
    /// Every refusal's label, as [`Self::label`] gives it.
    pub const LABELS: [&'static str; 2] = ["own-queue", "turnstile-queue"];

    /// The refusal's label in `turnstile_replies_refused_total{reason}`.
    pub fn label(self) -> &'static str {
        match self {
            Self::OwnQueue => "own-queue",
            Self::TurnstileQueue => "turnstile-queue",
        }
    }
}

/// What `declare` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Declared {
    /// The work queue `<q>`.
    pub work: Protection,
    /// The dead-letter queue `<q>.dead`.
    pub dead: Protection,
}

/// A queue declared with protective arguments, which a queue declared by someone else may lack.
struct Guarded<'a> {
    /// What the queue is, for the warning.
    role: &'static str,
    name: &'a str,
    /// The protective arguments (on top of the queue type); a broker that has the queue without
    /// them refuses a declaration naming them (PRECONDITION_FAILED).
    protection: Vec<(&'static str, AMQPValue)>,
    /// What the queue risks without them, for the warning.
    risk: &'static str,
}

impl Guarded<'_> {
    /// The policy with the same effect as the protection, for a queue declared without it: the
    /// `rabbitmqctl` command that sets it in `vhost`. Its name is `turnstile-<queue>` and its
    /// pattern matches that one queue exactly, so the work queue's and the dead-letter queue's
    /// policies never apply to the same queue (a queue follows only one policy).
    fn policy_command(&self, vhost: &str) -> String {
        // Every protective argument `x-<key>` has the policy key `<key>`.
        let definition: serde_json::Map<String, serde_json::Value> = self
            .protection
            .iter()
            .map(|(arg, value)| (arg.trim_start_matches("x-").to_owned(), policy_value(value)))
            .collect();
        format!(
            "rabbitmqctl set_policy -p {} {} {} {} --apply-to queues",
            shell_quote(vhost),
            shell_quote(&format!("turnstile-{}", self.name)),
            shell_quote(&format!("^{}$", regex_escape(self.name))),
            shell_quote(&serde_json::Value::Object(definition).to_string()),
        )
    }
}

/// A protective argument's value in a policy definition.
fn policy_value(value: &AMQPValue) -> serde_json::Value {
    match value {
        AMQPValue::LongString(s) => s.to_string().into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        other => unreachable!("turnstile declares no protective argument like {other:?}"),
    }
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
    /// The broker's consumer timeout the ladder holds under (shared by the clones, so that
    /// one the broker names is learned by the whole replica).
    ack_timeout: std::sync::Arc<AckTimeout>,
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
            ack_timeout: Default::default(),
        }
    }

    /// The broker's consumer timeout as the operator set it (RabbitMQ's default, 30 minutes,
    /// unless told): how long the delay ladder may hold a delivery ([`Holds`]).
    pub fn with_consumer_timeout(mut self, timeout: ConsumerTimeout) -> Self {
        self.ack_timeout = std::sync::Arc::new(AckTimeout::new(timeout));
        self
    }

    /// The consumer timeout the ladder holds under: the one set, or the broker's own once it
    /// named a lower one.
    pub fn ack_timeout(&self) -> &AckTimeout {
        &self.ack_timeout
    }

    /// How long the delay ladder holds a delivery now.
    pub fn holds(&self) -> Holds {
        self.ack_timeout.holds()
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
    /// The results exchange's name (`<q>.results`, a topic exchange: see [`super::results`]).
    pub fn results(&self) -> String {
        format!("{}.results", self.work)
    }
    /// The queue of delay level `k` (messages wait 2^k x UNIT in it).
    pub(super) fn level(&self, k: u32) -> String {
        format!("{}.wait.{k}", self.work)
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

    /// The work queue: a quorum queue dead-letters a message returned more than
    /// `delivery_limit` times to `<q>.dead`, at least once (which needs `x-overflow:
    /// reject-publish`; without a length limit it changes nothing else). A classic queue has no
    /// delivery limit; it gets the same dead-letter target, which only an operator's TTL or
    /// length limit could use: turnstile never rejects nor nacks a work message without requeue.
    fn work_queue(&self) -> Guarded<'_> {
        self.protected_like_work("work queue", &self.work)
    }

    /// The return queue: protected as the work queue is.
    fn ready_queue(&self) -> Guarded<'_> {
        self.protected_like_work("return queue", &self.ready)
    }

    fn protected_like_work<'a>(&'a self, role: &'static str, name: &'a str) -> Guarded<'a> {
        let mut protection = vec![
            ("x-dead-letter-exchange", long_string("")),
            ("x-dead-letter-routing-key", long_string(&self.dead)),
        ];
        let risk = match self.queue_type {
            QueueType::Quorum => {
                protection.extend([
                    (
                        "x-delivery-limit",
                        AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
                    ),
                    ("x-dead-letter-strategy", long_string("at-least-once")),
                    ("x-overflow", long_string("reject-publish")),
                ]);
                "without a delivery limit and dead-letter target: RabbitMQ 4.x drops a message \
                 returned more than 20 times (its default limit), RabbitMQ 3.x redelivers a \
                 message that crashes replicas forever"
            }
            QueueType::Classic => {
                "without a dead-letter target: a TTL or length limit set by a policy drops \
                 messages instead of dead-lettering them"
            }
        };
        Guarded {
            role,
            name,
            protection,
            risk,
        }
    }

    /// The dead-letter queue: as a quorum queue with a delivery limit that listings never reach
    /// ([`UNREACHED_DELIVERY_LIMIT`]), and no dead-letter target of its own. A classic queue
    /// has no delivery limit: nothing to declare.
    fn dead_queue(&self) -> Guarded<'_> {
        let protection = match self.queue_type {
            QueueType::Quorum => vec![(
                "x-delivery-limit",
                AMQPValue::LongLongInt(i64::from(UNREACHED_DELIVERY_LIMIT)),
            )],
            QueueType::Classic => Vec::new(),
        };
        Guarded {
            role: "dead-letter queue",
            name: &self.dead,
            protection,
            risk: "without a delivery limit: RabbitMQ 4.x drops a dead letter returned more \
                   than 20 times (its default limit), and every `dead-letters list` (and every \
                   replay that keeps it) returns each dead letter once",
        }
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

    /// Declares `queue` with its protection on `channel`; a queue that already exists without
    /// it (declared by an operator or a producer) is declared again without it (on a new
    /// channel: the refusal closed this one) and used as it is, with a warning naming the queue,
    /// the missing arguments and the policy that gives it the same protection. Any other
    /// difference (e.g. the queue type) fails with the broker's refusal, which names the queue
    /// and the argument.
    async fn declare_guarded(
        &self,
        connection: &Connection,
        channel: &mut Channel,
        queue: &Guarded<'_>,
    ) -> anyhow::Result<Protection> {
        let declared = self
            .declare_queue(channel, queue.name, self.queue_arguments(&queue.protection))
            .await;
        let Err(error) = declared else {
            return Ok(Protection::Protected);
        };
        let Some(refusal) = missing_protection(&error, &queue.protection) else {
            return Err(error);
        };
        *channel = open_channel(connection).await?;
        self.declare_queue(channel, queue.name, self.queue_arguments(&[]))
            .await?;
        let policy = queue.policy_command(&refusal.vhost);
        if first_warning(queue.name) {
            let missing: Vec<&str> = queue.protection.iter().map(|(arg, _)| *arg).collect();
            warn!(
                queue = %queue.name,
                broker = %refusal.message,
                "the {} {:?} already exists, declared by an operator or a producer {}; it is \
                 used as it is (missing: {}). Give it the same protection with: {policy}",
                queue.role,
                queue.name,
                queue.risk,
                missing.join(", "),
            );
        }
        Ok(Protection::Unprotected { policy })
    }

    /// Declares everything on a channel of its own (idempotent: safe for every replica at every
    /// start). A work queue, return queue or dead-letter queue that already exists without its
    /// protection (delivery limit, dead-letter target), as an operator or a producer may have
    /// declared it, is kept as it is, with a warning that names the policy giving it the same
    /// protection; any other difference (e.g. the queue type) fails, naming the queue and the
    /// argument.
    pub async fn declare(&self, connection: &Connection) -> anyhow::Result<Declared> {
        let mut channel = open_channel(connection).await?;
        let work = self
            .declare_guarded(connection, &mut channel, &self.work_queue())
            .await?;
        let dead = self
            .declare_guarded(connection, &mut channel, &self.dead_queue())
            .await?;
        self.declare_guarded(connection, &mut channel, &self.ready_queue())
            .await?;
        for k in 0..LEVELS {
            let mut args = Vec::new();
            if self.delay_type == QueueType::Quorum {
                args.push(("x-queue-type", long_string("quorum")));
                // A held ladder message is returned at every lost connection, and must never be
                // dropped for it.
                args.push((
                    "x-delivery-limit",
                    AMQPValue::LongLongInt(i64::from(UNREACHED_DELIVERY_LIMIT)),
                ));
            }
            self.declare_queue(&channel, &self.level(k), table(&args))
                .await?;
        }
        super::results::declare_exchange(&channel, &self.results()).await?;
        let _ = channel.close(200, "declared".into()).await;
        Ok(Declared { work, dead })
    }

    /// Why a message's `reply_to` may not receive its result, if it may not: a reply is a
    /// publish through the default exchange to whatever queue the producer named, and one that
    /// lands in a queue turnstile consumes or replays from comes back as a message of its own
    /// (see [`ReplyRefusal`]).
    pub fn refuses_reply_to(&self, queue: &str) -> Option<ReplyRefusal> {
        let own = queue
            .strip_prefix(self.work.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'));
        if own {
            return Some(ReplyRefusal::OwnQueue);
        }
        let (rest, last) = queue.rsplit_once('.')?;
        let ladder_level =
            rest.ends_with(".wait") && !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit());
        let named_like_ours = matches!(last, "ready" | "dead") || ladder_level;
        (named_like_ours && !rest.is_empty()).then_some(ReplyRefusal::TurnstileQueue)
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
        channel
            .exchange_delete(
                ShortString::from(self.results()),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await?;
        Ok(())
    }
}

async fn open_channel(connection: &Connection) -> anyhow::Result<Channel> {
    connection
        .create_channel()
        .await
        .context("opening a channel to declare the topology")
}

/// Whether this is the first warning about `queue` in this process: a replica declares its
/// topology again at every reconnect, and one warning per queue says it all.
fn first_warning(queue: &str) -> bool {
    static WARNED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::OnceLock::new();
    WARNED
        .get_or_init(Default::default)
        .lock()
        .expect("never poisoned")
        .insert(queue.to_owned())
}

/// The broker's refusal of a declaration because the existing queue lacks one of its protective
/// arguments.
struct Refusal {
    message: String,
    vhost: String,
}

/// The refusal in `error` if it is PRECONDITION_FAILED for an argument of `protection` that the
/// existing queue does not have (the broker names only the first argument that differs:
/// another difference, e.g. the queue type, shows when the queue is declared again without
/// its protection).
fn missing_protection(error: &anyhow::Error, protection: &[(&str, AMQPValue)]) -> Option<Refusal> {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    error
        .chain()
        .filter_map(|e| e.downcast_ref::<lapin::Error>())
        .find_map(|e| match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp)
                if amqp.kind() == &AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) =>
            {
                let message = amqp.get_message().to_string();
                let missing = protection
                    .iter()
                    .any(|(arg, _)| message.contains(&format!("inequivalent arg '{arg}'")))
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
    fn a_reply_to_naming_a_queue_of_ours_or_one_named_like_it_is_refused() {
        for refusal in [ReplyRefusal::OwnQueue, ReplyRefusal::TurnstileQueue] {
            assert!(ReplyRefusal::LABELS.contains(&refusal.label()));
        }
        let topology = Topology::new("registrations", QueueType::Quorum);
        for queue in topology.queues() {
            assert_eq!(
                topology.refuses_reply_to(&queue),
                Some(ReplyRefusal::OwnQueue),
                "{queue}"
            );
        }
        for queue in [
            "registrations.results",
            "registrations.",
            "registrations.x.y",
        ] {
            assert_eq!(
                topology.refuses_reply_to(queue),
                Some(ReplyRefusal::OwnQueue),
                "{queue}"
            );
        }
        for queue in [
            "orders.ready",
            "orders.dead",
            "orders.wait.0",
            "a.b.wait.11",
        ] {
            assert_eq!(
                topology.refuses_reply_to(queue),
                Some(ReplyRefusal::TurnstileQueue),
                "{queue}"
            );
        }
        for queue in [
            "registrations-replies",
            "registrationsX",
            "replies",
            "amq.gen-JzTY20BRgKO-HjmUJj0wLg",
            "amq.rabbitmq.reply-to.g1h2AA5yZXBseUAyNzk2NjM4OAAAC5oAAAAAWQ==",
            "upload.replies",
            "ready",
            ".ready",
            "dead",
            "orders.wait.",
            "orders.wait.x1",
            "orders.waiting.1",
            "orders.deadline",
        ] {
            assert_eq!(topology.refuses_reply_to(queue), None, "{queue}");
        }
    }

    #[test]
    fn the_policy_commands_match_exactly_their_queue_and_survive_the_shell() {
        let quorum = Topology::new("registrations", QueueType::Quorum);
        assert_eq!(
            quorum.work_queue().policy_command("/"),
            "rabbitmqctl set_policy -p '/' 'turnstile-registrations' '^registrations$' \
             '{\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":\"registrations.dead\",\
             \"dead-letter-strategy\":\"at-least-once\",\"delivery-limit\":500,\
             \"overflow\":\"reject-publish\"}' --apply-to queues"
        );
        // Another name and a pattern that only `registrations.dead` matches (`^registrations$`
        // does not): the two policies never compete for a queue.
        assert_eq!(
            quorum.dead_queue().policy_command("/"),
            "rabbitmqctl set_policy -p '/' 'turnstile-registrations.dead' \
             '^registrations\\.dead$' '{\"delivery-limit\":1000000}' --apply-to queues"
        );
        let classic = Topology::new("it's.v2", QueueType::Classic);
        assert_eq!(
            classic.work_queue().policy_command("prod"),
            r#"rabbitmqctl set_policy -p 'prod' 'turnstile-it'\''s.v2' '^it'\''s\.v2$' '{"dead-letter-exchange":"","dead-letter-routing-key":"it'\''s.v2.dead"}' --apply-to queues"#
        );
        assert!(
            classic.dead_queue().protection.is_empty(),
            "a classic queue has no delivery limit"
        );
    }
}
