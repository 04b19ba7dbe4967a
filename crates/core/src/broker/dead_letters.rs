//! Inspecting dead letters and replaying chosen ones onto the work queue: [`list`] and
//! [`replay`] take the dead letters a [`Selection`] names (by message, seller, batch, reason),
//! and a replay may be a dry run.
//!
//! Most dead letters were published by a replica with the reason in [`headers::REASON`]. The
//! broker dead-letters too: a quorum work queue moves a message returned more than its
//! delivery limit to `<q>.dead` with only its `x-death` history, whose reason `delivery_limit`
//! (RabbitMQ 3.10 and later) is listed as `delivery-limit`; the other broker reasons (an
//! operator's TTL or length limit: `expired`, `maxlen`; a reject by another client:
//! `rejected`) as `broker-expired`, `broker-maxlen`, `broker-rejected` (see [`Reason`]).
//!
//! Listing reads the queue with `basic.get`, one message at a time, and returns every message
//! it read when it ends (the dead-letter queue's delivery limit is far beyond what listings
//! reach); of each letter only its [`DeadLetter`] (bounded) and its acker are kept.
//!
//! Every broker step is bounded ([`STEP_TIMEOUT`]) and fails at once when its channel fails,
//! which lapin never reports to the step itself: a dead letter whose headers exceed the
//! connection's frame_max makes the client close the connection in the middle of a read.

use std::time::Duration;

use anyhow::Context;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};

use crate::domain::{BatchSize, Identity};
use crate::permit::{DeadLetterBook, InBatch, PermitError, ProductMessage};

use super::{Publisher, Topology, depth, header_str, headers, identity_of, is_death_history};

/// The reason listed for a message the broker dead-lettered after too many returns.
pub const DELIVERY_LIMIT_REASON: &str = "delivery-limit";

/// Longest one broker step of a listing or a replay may take (a read, an ack, a confirm): a
/// broker that stops answering fails the command instead of hanging it.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a step looks whether its channel failed.
const CHANNEL_CHECK: Duration = Duration::from_millis(50);

/// What a read that lost its connection most likely met.
const UNREADABLE: &str = "most likely the dead letter's headers are larger than the broker's \
    frame_max, which no AMQP client can receive (turnstile's own dead letters always fit; the \
    broker's x-death can push a message published at the limit over it): raise frame_max in \
    rabbitmq.conf to read it, or take it off with the management UI";

/// Runs one broker `step` on `channel` (`what` names it in the error): within
/// [`STEP_TIMEOUT`], and failing as soon as the channel fails.
async fn step<T, E>(
    channel: &Channel,
    what: &str,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> anyhow::Result<T>
where
    E: Into<anyhow::Error>,
{
    tokio::select! {
        done = tokio::time::timeout(STEP_TIMEOUT, step) => match done {
            Ok(done) => done.map_err(Into::into).with_context(|| what.to_owned()),
            Err(_) => anyhow::bail!("{what}: no answer from the broker within {STEP_TIMEOUT:?}"),
        },
        () = failed(channel) => anyhow::bail!("{what}: the broker connection failed"),
    }
}

/// Completes when `channel` is no longer open.
async fn failed(channel: &Channel) {
    while channel.status().connected() {
        tokio::time::sleep(CHANNEL_CHECK).await;
    }
}

/// Why a message is dead: the reasons turnstile dead-letters with (`x-turnstile-reason`), and
/// those listed for a message the broker dead-lettered itself (from its `x-death` history).
/// Written and parsed as [`Reason::as_str`] gives it (`invalid-message`, `delivery-limit`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Reason {
    /// The body is not a valid registration (or its headers leave no room for a copy, or the
    /// limiter refused it repeatedly, or its cost exceeds what the seller's limit can grant).
    InvalidMessage,
    /// The downstream refused it (a 4xx other than 408, 425 and 429, or a 3xx).
    Rejected,
    /// Every attempt failed (5xx, timeouts, connection errors): TURNSTILE_MAX_ATTEMPTS.
    AttemptsExhausted,
    /// The downstream answered 429 for longer than TURNSTILE_THROTTLE_DEADLINE.
    Throttled,
    /// Its `deadline` came before the earliest time it could be called (never called late).
    Expired,
    /// A newer message of its product (`product_key`) took its place before its call started;
    /// replayed only when asked explicitly (`Selection::force`).
    Superseded,
    /// The broker dead-lettered it after too many returns (a quorum queue's delivery limit):
    /// a message that kept crashing or disconnecting replicas.
    DeliveryLimit,
    /// The broker dead-lettered it because a client rejected it without requeueing (x-death
    /// reason `rejected`: not turnstile, which dead-letters by publishing).
    BrokerRejected,
    /// The broker dead-lettered it when a TTL (an operator's policy) ran out.
    BrokerExpired,
    /// The broker dead-lettered it for a queue length limit (an operator's policy).
    BrokerMaxlen,
    /// Neither turnstile's reason nor a broker history it knows: published to the dead-letter
    /// queue by something else, or a reason of a newer turnstile (named in the detail).
    Unknown,
}

impl Reason {
    /// Every reason, in the order they are listed.
    pub const ALL: [Reason; 11] = [
        Reason::InvalidMessage,
        Reason::Rejected,
        Reason::AttemptsExhausted,
        Reason::Throttled,
        Reason::Expired,
        Reason::Superseded,
        Reason::DeliveryLimit,
        Reason::BrokerRejected,
        Reason::BrokerExpired,
        Reason::BrokerMaxlen,
        Reason::Unknown,
    ];

    /// The reason as it is written: in listings, `--reason`, results and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidMessage => "invalid-message",
            Reason::Rejected => "rejected",
            Reason::AttemptsExhausted => "attempts-exhausted",
            Reason::Throttled => "throttled",
            Reason::Expired => "expired",
            Reason::Superseded => "superseded",
            Reason::DeliveryLimit => DELIVERY_LIMIT_REASON,
            Reason::BrokerRejected => "broker-rejected",
            Reason::BrokerExpired => "broker-expired",
            Reason::BrokerMaxlen => "broker-maxlen",
            Reason::Unknown => "unknown",
        }
    }

    /// Whether the broker dead-lettered the message itself (no replica saw it die).
    pub const fn is_brokers(self) -> bool {
        matches!(
            self,
            Reason::DeliveryLimit
                | Reason::BrokerRejected
                | Reason::BrokerExpired
                | Reason::BrokerMaxlen
        )
    }

    /// The reason a replica wrote in `x-turnstile-reason`, if it is one turnstile writes.
    fn of_turnstile(written: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|r| !r.is_brokers() && *r != Reason::Unknown && r.as_str() == written)
    }

    /// The reason of an `x-death` entry (`delivery_limit`, `rejected`, `expired`, `maxlen`).
    fn of_broker(x_death: &str) -> Option<Self> {
        match x_death {
            "delivery_limit" => Some(Reason::DeliveryLimit),
            "rejected" => Some(Reason::BrokerRejected),
            "expired" => Some(Reason::BrokerExpired),
            "maxlen" => Some(Reason::BrokerMaxlen),
            _ => None,
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reason that is none of [`Reason::ALL`]; says which are.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dead-letter reason {given:?}; the reasons are: {}", Reason::ALL.map(Reason::as_str).join(", "))]
pub struct UnknownReason {
    /// What was given.
    pub given: String,
}

impl std::str::FromStr for Reason {
    type Err = UnknownReason;

    /// Exactly as [`Reason::as_str`] writes it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownReason {
                given: s.to_owned(),
            })
    }
}

impl serde::Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Reason {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl PartialEq<str> for Reason {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Reason {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// Which dead letters a listing or a replay takes: those matching every part given (AND);
/// [`Selection::all`] (nothing given) takes every one. Ids are compared exactly, as
/// [`DeadLetter`] lists them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Selection {
    /// Only the dead letters of this message (every copy of it).
    pub message_id: Option<String>,
    /// Only this seller's.
    pub seller_id: Option<String>,
    /// Only this batch's (upload's).
    pub batch_id: Option<String>,
    /// Only those dead for this reason.
    pub reason: Option<Reason>,
    /// Only those whose detail is exactly this (a [`Group`] of a listing names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// A replay also takes superseded dead letters (a newer message of their product took
    /// their place: replaying one makes it its product's latest again). Without it a replay
    /// leaves them where they are and counts them in [`Replayed::refused`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

impl Selection {
    /// Every dead letter.
    pub fn all() -> Self {
        Self::default()
    }

    /// The dead letters of one message (by its id as listed; every copy of it).
    pub fn message(message_id: impl Into<String>) -> Self {
        Self::all().with_message_id(message_id)
    }

    /// Also only the dead letters of this message.
    pub fn with_message_id(mut self, message_id: impl Into<String>) -> Self {
        self.message_id = Some(message_id.into());
        self
    }

    /// Also only this seller's.
    pub fn with_seller(mut self, seller_id: impl Into<String>) -> Self {
        self.seller_id = Some(seller_id.into());
        self
    }

    /// Also only this batch's.
    pub fn with_batch(mut self, batch_id: impl Into<String>) -> Self {
        self.batch_id = Some(batch_id.into());
        self
    }

    /// Also only those dead for `reason`.
    pub fn with_reason(mut self, reason: Reason) -> Self {
        self.reason = Some(reason);
        self
    }

    /// Also only those whose detail is exactly `detail`.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Also superseded dead letters, on a replay (see [`Selection::force`]).
    pub fn forced(mut self, force: bool) -> Self {
        self.force = force;
        self
    }

    /// Whether it takes every dead letter.
    pub fn is_all(&self) -> bool {
        Self {
            force: false,
            ..self.clone()
        } == Self::all()
    }

    /// Whether `letter` is selected: it matches every part given.
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        let same = |wanted: &Option<String>, has: &Option<String>| {
            wanted.is_none() || wanted.as_deref() == has.as_deref()
        };
        same(&self.message_id, &letter.message_id)
            && same(&self.seller_id, &letter.seller_id)
            && same(&self.batch_id, &letter.batch_id)
            && self.reason.is_none_or(|r| r == letter.reason)
            && self.detail.as_ref().is_none_or(|d| *d == letter.detail)
    }
}

impl std::fmt::Display for Selection {
    /// `every dead letter`, or the parts given: `message m-1, seller S-1, reason rejected`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        for (what, value) in [
            ("message", &self.message_id),
            ("seller", &self.seller_id),
            ("batch", &self.batch_id),
        ] {
            if let Some(value) = value {
                parts.push(format!("{what} {value:?}"));
            }
        }
        if let Some(reason) = self.reason {
            parts.push(format!("reason {reason}"));
        }
        if let Some(detail) = &self.detail {
            parts.push(format!("detail {detail:?}"));
        }
        if parts.is_empty() {
            f.write_str("every dead letter")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// Most bytes of a dead letter's body its listing shows ([`DeadLetter::body_excerpt`]).
pub const EXCERPT_BYTES: usize = 200;

/// One dead letter as listed. Every text in it comes from the message (its body, its headers)
/// and is untrusted: escape it before showing it (a terminal, a page). Its size is bounded
/// whatever the message's: ids as the domain bounds them, the detail to
/// [`budget::DETAIL_MAX`](super::budget::DETAIL_MAX), the body to [`EXCERPT_BYTES`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeadLetter {
    /// The message's id (its body's `message_id`, else the AMQP message-id property, else a
    /// digest of the body: the identity every result and count uses).
    pub message_id: Option<String>,
    /// Its body's `seller_id`, if the body has a valid one.
    pub seller_id: Option<String>,
    /// Its body's `batch_id`, if the body has a valid one.
    pub batch_id: Option<String>,
    pub reason: Reason,
    /// What the reason was about: the parse error, the status and a body excerpt of the
    /// downstream's answer, the broker's history.
    pub detail: String,
    /// When it died (RFC 3339, ms; the broker's second for the broker's own dead letters).
    pub dead_at: Option<String>,
    /// The same as Unix ms.
    pub dead_at_ms: Option<u64>,
    /// The calls that counted as attempts, the last one included (a 429 is not an attempt), as
    /// the replica that dead-lettered it counted them; `None` when unknown (the broker's own
    /// dead letters).
    pub attempts: Option<u32>,
    /// The body's size in bytes.
    pub bytes: usize,
    /// The body's first [`EXCERPT_BYTES`] bytes at most, as UTF-8 (an invalid sequence is
    /// replaced by U+FFFD; a character cut at the end is left out).
    pub body_excerpt: String,
    /// Whether `body_excerpt` is only the start of the body.
    pub body_truncated: bool,
}

/// The start of a body as text, and whether it is cut (see [`DeadLetter::body_excerpt`]).
fn excerpt(body: &[u8]) -> (String, bool) {
    let truncated = body.len() > EXCERPT_BYTES;
    let head = &body[..body.len().min(EXCERPT_BYTES)];
    let mut text = String::with_capacity(head.len());
    let mut chunks = head.utf8_chunks().peekable();
    while let Some(chunk) = chunks.next() {
        text.push_str(chunk.valid());
        // At the cut, invalid bytes are most likely a character cut in two: left out.
        let cut_there = truncated && chunks.peek().is_none();
        if !chunk.invalid().is_empty() && !cut_there {
            text.push(char::REPLACEMENT_CHARACTER);
        }
    }
    (text, truncated)
}

/// Unix ms as RFC 3339 with ms; `None` beyond the year 9999 (a forged header, say).
fn rfc3339(ms: u64) -> Option<String> {
    const YEAR_10000_MS: u64 = 253_402_300_800_000;
    (ms < YEAR_10000_MS).then(|| crate::domain::rfc3339(ms))
}

/// The broker's latest dead-lettering of a message: the first entry of its `x-death` header.
struct Death {
    reason: String,
    queue: String,
    count: u64,
    at_ms: Option<u64>,
}

fn latest_death(delivery: &Delivery) -> Option<Death> {
    let headers = delivery.properties.headers().as_ref()?;
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(entry) = deaths.as_slice().first()? else {
        return None;
    };
    let text = |name: &str| match entry.inner().get(name) {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        Some(AMQPValue::ShortString(s)) => Some(s.to_string()),
        _ => None,
    };
    Some(Death {
        reason: text("reason")?,
        queue: text("queue").unwrap_or_default(),
        count: match entry.inner().get("count") {
            Some(AMQPValue::LongLongInt(n)) => u64::try_from(*n).unwrap_or(0),
            Some(AMQPValue::LongInt(n)) => u64::try_from(*n).unwrap_or(0),
            _ => 0,
        },
        at_ms: match entry.inner().get("time") {
            Some(AMQPValue::Timestamp(seconds)) => seconds.checked_mul(1000),
            _ => None,
        },
    })
}

/// Why a dead letter is dead, the detail, and when it died (Unix ms). A broker's dead letter
/// carries its `x-death` history, which turnstile's never do (its copies drop the history):
/// that is read first, so that a producer's forged `x-turnstile-reason` cannot relabel it;
/// else turnstile's headers.
fn reason_of(delivery: &Delivery) -> (Reason, String, Option<u64>) {
    if let Some(death) = latest_death(delivery) {
        let detail = format!(
            "dead-lettered by the broker from {:?} ({}, {} time(s))",
            death.queue, death.reason, death.count
        );
        let reason = Reason::of_broker(&death.reason).unwrap_or(Reason::Unknown);
        return (reason, clip(detail), death.at_ms);
    }
    let Some(written) = header_str(delivery, headers::REASON) else {
        return (Reason::Unknown, String::new(), None);
    };
    let detail = header_str(delivery, headers::DETAIL).unwrap_or_default();
    let dead_at = super::header_u64(delivery, headers::DEAD_AT);
    match Reason::of_turnstile(&written) {
        Some(reason) => (reason, clip(detail), dead_at),
        None => (
            Reason::Unknown,
            clip(format!("reason {written:?}: {detail}")),
            dead_at,
        ),
    }
}

/// A detail cut to [`budget::DETAIL_MAX`](super::budget::DETAIL_MAX) bytes.
fn clip(detail: String) -> String {
    match super::budget::clip_detail(&detail) {
        clipped if clipped.len() == detail.len() => detail,
        clipped => clipped.to_owned(),
    }
}

/// A dead letter as listed; never fails, whatever its body and headers.
pub fn describe(delivery: &Delivery) -> DeadLetter {
    let identity = identity_of(delivery);
    let (reason, detail, dead_at_ms) = reason_of(delivery);
    let attempts = (!reason.is_brokers())
        .then(|| super::header_u64(delivery, headers::ATTEMPTS))
        .flatten()
        .map(|a| u32::try_from(a).unwrap_or(u32::MAX));
    let (body_excerpt, body_truncated) = excerpt(&delivery.data);
    DeadLetter {
        message_id: identity.message_id.map(|m| m.as_str().to_owned()),
        seller_id: identity.seller_id.map(|s| s.as_str().to_owned()),
        batch_id: identity.batch_id.map(|b| b.as_str().to_owned()),
        reason,
        detail,
        dead_at: dead_at_ms.and_then(rfc3339),
        dead_at_ms,
        attempts,
        bytes: delivery.data.len(),
        body_excerpt,
        body_truncated,
    }
}

/// What a replay did, or on a dry run would do.
#[derive(Debug, Default, serde::Serialize)]
pub struct Replayed {
    /// A dry run: nothing was moved.
    pub dry_run: bool,
    /// Dead letters selected: moved back to the work queue, or on a dry run that would be.
    pub matched: u64,
    /// Dead letters moved back to the work queue (0 on a dry run).
    pub replayed: u64,
    /// Dead letters not selected: they stay in the dead-letter queue.
    pub kept: u64,
    /// Superseded dead letters selected but not replayed, for want of [`Selection::force`]:
    /// they stay (counted in `matched` too).
    pub refused: u64,
    /// The selected dead letters, as listed, in the queue's order.
    pub letters: Vec<DeadLetter>,
}

impl Replayed {
    /// Dead letters selected that a replay moves (or on a dry run would): all but the
    /// superseded ones it leaves without [`Selection::force`].
    pub fn movable(&self) -> u64 {
        self.matched - self.refused
    }
}

/// Visits each dead letter present now exactly once: `visit` answers true to take it off the
/// dead-letter queue (after it was handled), false to leave it there, and hands the delivery
/// back either way. Messages are held unacked while visiting and the ones left are returned at
/// the end, so none is seen twice or lost; of a message left, only its acker is kept meanwhile
/// (not its body), so visiting a large dead-letter queue holds a few dozen bytes per message,
/// not the messages. A failure (of `visit` or of the broker) stops the visit and returns every
/// message read and not taken at once, so that a channel that lives on (a replica's) holds none
/// of them; a failed channel's are returned by the broker when it closes.
async fn visit<F, Fut>(channel: &Channel, topology: &Topology, mut visit: F) -> anyhow::Result<()>
where
    F: FnMut(Delivery) -> Fut,
    Fut: std::future::Future<Output = (anyhow::Result<bool>, Delivery)>,
{
    let mut keep = Vec::new();
    let visited = async {
        let present = step(
            channel,
            "reading the dead-letter queue's depth",
            depth(channel, topology.dead()),
        )
        .await?;
        for _ in 0..present {
            let Some(message) = next(channel, topology).await? else {
                break;
            };
            let (take, delivery) = visit(message.delivery).await;
            match take {
                Ok(true) => {
                    let ack = delivery.acker.ack(BasicAckOptions::default());
                    step(channel, "removing a replayed dead letter", ack).await?;
                }
                Ok(false) => keep.push(delivery.acker),
                Err(error) => {
                    keep.push(delivery.acker);
                    return Err(error);
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    let requeue = BasicNackOptions {
        requeue: true,
        ..Default::default()
    };
    let mut returned = Ok(());
    for acker in keep {
        returned = step(channel, "leaving a dead letter", acker.nack(requeue))
            .await
            .map(drop);
        if returned.is_err() {
            break;
        }
    }
    visited.and(returned)
}

/// The next dead letter, held unacked; a connection lost while reading it is explained.
async fn next(
    channel: &Channel,
    topology: &Topology,
) -> anyhow::Result<Option<lapin::message::BasicGetMessage>> {
    let what = format!("reading a dead letter from {:?}", topology.dead());
    let get = channel.basic_get(topology.dead().into(), BasicGetOptions::default());
    step(channel, &what, get).await.map_err(|error| {
        if channel.status().connected() {
            error
        } else {
            anyhow::anyhow!("{error:#}; {UNREADABLE}")
        }
    })
}

/// Most groups a [`Listing`] keeps apart; dead letters of further (reason, detail) pairs are
/// counted in [`Listing::other`].
pub const MOST_GROUPS: usize = 100;

/// Dead letters of one reason and one detail, as a listing groups them (30 identical 422s are
/// one line).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Group {
    pub reason: Reason,
    pub detail: String,
    /// Dead letters of the group the selection took.
    pub count: u64,
    /// The sellers among them: how many, and the first few.
    pub sellers: u64,
    pub some_sellers: Vec<String>,
    /// When the first and the last of them died (Unix ms), when known.
    pub first_dead_ms: Option<u64>,
    pub last_dead_ms: Option<u64>,
}

/// Sellers a [`Group`] names.
const GROUP_SELLERS_NAMED: usize = 5;
/// Sellers a [`Group`] tells apart to count them; beyond, it counts at least this many.
const GROUP_SELLERS_COUNTED: usize = 1000;

/// A page of the dead letters a selection takes, with every one of them counted and grouped.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Listing {
    /// Dead letters the selection took.
    pub matched: u64,
    /// They by reason and detail, largest group first (at most [`MOST_GROUPS`]).
    pub groups: Vec<Group>,
    /// Dead letters of groups beyond [`MOST_GROUPS`].
    pub other: u64,
    /// Taken dead letters skipped before the page.
    pub skipped: u64,
    /// The page: the taken dead letters after the skipped ones, in the queue's order.
    pub letters: Vec<DeadLetter>,
}

/// Groups being counted, with the sellers each has seen (bounded, see [`Group`]).
#[derive(Default)]
struct Grouping {
    groups: Vec<(Group, std::collections::HashSet<String>)>,
    index: std::collections::HashMap<(Reason, String), usize>,
    other: u64,
}

impl Grouping {
    fn count(&mut self, letter: &DeadLetter) {
        let key = (letter.reason, letter.detail.clone());
        let at = match self.index.get(&key) {
            Some(&at) => at,
            None if self.groups.len() < MOST_GROUPS => {
                self.groups.push((
                    Group {
                        reason: letter.reason,
                        detail: letter.detail.clone(),
                        count: 0,
                        sellers: 0,
                        some_sellers: Vec::new(),
                        first_dead_ms: None,
                        last_dead_ms: None,
                    },
                    std::collections::HashSet::new(),
                ));
                self.index.insert(key, self.groups.len() - 1);
                self.groups.len() - 1
            }
            None => {
                self.other += 1;
                return;
            }
        };
        let (group, sellers) = &mut self.groups[at];
        group.count += 1;
        if let Some(seller) = &letter.seller_id
            && sellers.len() < GROUP_SELLERS_COUNTED
            && sellers.insert(seller.clone())
        {
            group.sellers += 1;
            if group.some_sellers.len() < GROUP_SELLERS_NAMED {
                group.some_sellers.push(seller.clone());
            }
        }
        if let Some(at) = letter.dead_at_ms {
            group.first_dead_ms = Some(group.first_dead_ms.map_or(at, |f| f.min(at)));
            group.last_dead_ms = Some(group.last_dead_ms.map_or(at, |l| l.max(at)));
        }
    }

    /// The groups, largest first (then by reason and detail).
    fn into_groups(self) -> (Vec<Group>, u64) {
        let mut groups: Vec<Group> = self.groups.into_iter().map(|(g, _)| g).collect();
        groups.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then_with(|| a.reason.as_str().cmp(b.reason.as_str()))
                .then_with(|| a.detail.cmp(&b.detail))
        });
        (groups, self.other)
    }
}

/// Counts and groups every dead letter `selection` takes and lists `keep` of them after the
/// first `skip`, in the queue's order; leaves them all where they are. Only the page and the
/// groups are held, however many the queue has.
pub async fn list_page(
    channel: &Channel,
    topology: &Topology,
    selection: &Selection,
    skip: u64,
    keep: usize,
) -> anyhow::Result<Listing> {
    let mut listing = Listing::default();
    let mut grouping = Grouping::default();
    visit(channel, topology, |delivery| {
        let letter = describe(&delivery);
        if selection.matches(&letter) {
            listing.matched += 1;
            grouping.count(&letter);
            if listing.matched > skip && listing.letters.len() < keep {
                listing.letters.push(letter);
            }
        }
        async move { (Ok(false), delivery) }
    })
    .await?;
    listing.skipped = skip.min(listing.matched);
    (listing.groups, listing.other) = grouping.into_groups();
    Ok(listing)
}

/// Counts `letter` as selected (`matched`, listed while fewer than `shown` are) or not
/// (`kept`), as a replay or a discard visits it; whether `selection` takes it.
fn tally(
    selection: &Selection,
    letter: DeadLetter,
    shown: usize,
    (matched, kept, letters): (&mut u64, &mut u64, &mut Vec<DeadLetter>),
) -> bool {
    let selected = selection.matches(&letter);
    if selected {
        *matched += 1;
        if letters.len() < shown {
            letters.push(letter);
        }
    } else {
        *kept += 1;
    }
    selected
}

/// What a discard did, or on a dry run would do.
#[derive(Debug, Default, serde::Serialize)]
pub struct Discarded {
    /// A dry run: nothing was removed.
    pub dry_run: bool,
    /// Dead letters selected: removed, or on a dry run that would be.
    pub matched: u64,
    /// Dead letters removed from the dead-letter queue (0 on a dry run).
    pub discarded: u64,
    /// Dead letters not selected: they stay.
    pub kept: u64,
    /// The first of those selected (at most the discard's `shown`), in the queue's order.
    pub letters: Vec<DeadLetter>,
}

/// Removes the dead letters `selection` takes from the dead-letter queue for good: they are
/// not republished, and their messages stay counted dead (their records, their uploads'
/// progress and the dead letters by reason are unchanged: the outcome was published, and
/// stays what happened). A `dry_run` reads the same dead letters, reports exactly those it
/// would remove, and removes nothing. Lists at most `shown` of those selected.
pub async fn discard(
    channel: &Channel,
    topology: &Topology,
    selection: &Selection,
    dry_run: bool,
    shown: usize,
) -> anyhow::Result<Discarded> {
    let mut done = Discarded {
        dry_run,
        ..Discarded::default()
    };
    let visited = visit(channel, topology, |delivery| {
        let selected = tally(
            selection,
            describe(&delivery),
            shown,
            (&mut done.matched, &mut done.kept, &mut done.letters),
        );
        let take = selected && !dry_run;
        done.discarded += u64::from(take);
        async move { (Ok(take), delivery) }
    })
    .await;
    visited
        .with_context(|| format!("{} dead letters were discarded before this", done.discarded))?;
    Ok(done)
}

/// Lists the dead letters `selection` takes, in the queue's order; leaves them all where they
/// are.
pub async fn list(
    channel: &Channel,
    topology: &Topology,
    selection: &Selection,
) -> anyhow::Result<Vec<DeadLetter>> {
    Ok(list_first(channel, topology, selection, usize::MAX)
        .await?
        .1)
}

/// Counts the dead letters `selection` takes and lists the first `keep` of them, in the
/// queue's order; leaves them all where they are. Only those `keep` are held, however many
/// the queue has (a listing for a page reads every dead letter but shows a few).
pub async fn list_first(
    channel: &Channel,
    topology: &Topology,
    selection: &Selection,
    keep: usize,
) -> anyhow::Result<(u64, Vec<DeadLetter>)> {
    let mut matched = 0u64;
    let mut out = Vec::new();
    visit(channel, topology, |delivery| {
        let letter = describe(&delivery);
        if selection.matches(&letter) {
            matched += 1;
            if out.len() < keep {
                out.push(letter);
            }
        }
        async move { (Ok(false), delivery) }
    })
    .await?;
    Ok((matched, out))
}

/// Moves the dead letters `selection` takes back to the work queue: the body as it was,
/// turnstile's own headers and the broker's dead-letter history removed (a fresh start:
/// attempts at zero), confirmed before the dead letter is removed. Each message is counted as
/// waiting again before it is republished (`revive`), so no replica can register or
/// dead-letter it while it still counts as dead; if the republish fails, it is counted dead
/// again (with `ttl`, the completion records' TTL), and the replay stops with the error.
///
/// A `dry_run` reads the same dead letters and reports exactly those it would move, and moves
/// nothing, writing nothing to Redis.
pub async fn replay(
    channel: &Channel,
    publisher: &Publisher,
    topology: &Topology,
    selection: &Selection,
    permits: &dyn DeadLetterBook,
    ttl: Duration,
    dry_run: bool,
) -> anyhow::Result<Replayed> {
    replay_showing(
        channel,
        publisher,
        topology,
        selection,
        permits,
        ttl,
        dry_run,
        usize::MAX,
    )
    .await
}

/// As [`replay`], listing in [`Replayed::letters`] only the first `shown` dead letters taken
/// (all are counted in [`Replayed::matched`]): a replay of a large queue holds no more.
#[allow(clippy::too_many_arguments)]
pub async fn replay_showing(
    channel: &Channel,
    publisher: &Publisher,
    topology: &Topology,
    selection: &Selection,
    permits: &dyn DeadLetterBook,
    ttl: Duration,
    dry_run: bool,
    shown: usize,
) -> anyhow::Result<Replayed> {
    let mut done = Replayed {
        dry_run,
        ..Replayed::default()
    };
    let moved = std::sync::atomic::AtomicU64::new(0);
    let visited = visit(channel, topology, |delivery| {
        let letter = describe(&delivery);
        let superseded = letter.reason == Reason::Superseded;
        let selected = tally(
            selection,
            letter,
            shown,
            (&mut done.matched, &mut done.kept, &mut done.letters),
        );
        let refused = selected && superseded && !selection.force;
        done.refused += u64::from(refused);
        let take = selected && !refused && !dry_run;
        let work = topology.work().to_owned();
        let publisher = publisher.clone();
        let moved = &moved;
        async move {
            if !take {
                return (Ok(false), delivery);
            }
            let mut kept = FieldTable::default();
            if let Some(table) = delivery.properties.headers() {
                for (k, v) in table.inner() {
                    if !k.as_str().starts_with("x-turnstile-") && !is_death_history(k.as_str()) {
                        kept.insert(k.clone(), v.clone());
                    }
                }
            }
            let properties: BasicProperties = delivery.properties.clone().with_headers(kept);
            let revived = match revive(permits, &delivery, ttl).await {
                Ok(revived) => revived,
                Err(error) => {
                    let error = anyhow::Error::from(error)
                        .context("counting a replayed message as waiting again");
                    return (Err(error), delivery);
                }
            };
            let registration = super::registration_of(&delivery).ok();
            let product = registration
                .as_ref()
                .filter(|_| superseded)
                .and_then(|r| ProductMessage::of(r, ttl));
            // A superseded message made its product's latest, with the latest before it.
            let mut latest_before = None;
            if let Some(product) = product {
                match permits.latest_again(&product).await {
                    Ok(previous) => latest_before = Some((product, previous)),
                    Err(error) => {
                        revived.undo(permits, ttl).await;
                        let error = anyhow::Error::from(error)
                            .context("making a replayed superseded message its product's latest");
                        return (Err(error), delivery);
                    }
                }
            }
            let publish = publisher.publish("", &work, &delivery.data, properties);
            let republished = step(publisher.channel(), "republishing a dead letter", publish);
            if let Err(error) = republished.await {
                revived.undo(permits, ttl).await;
                if let Some((product, previous)) = &latest_before {
                    let _ = permits.latest_as_before(product, previous.as_ref()).await;
                }
                return (Err(error), delivery);
            }
            moved.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (Ok(true), delivery)
        }
    })
    .await;
    done.replayed = moved.into_inner();
    visited.with_context(|| {
        format!(
            "{} dead letters were replayed to {:?} before this",
            done.replayed,
            topology.work()
        )
    })?;
    Ok(done)
}

/// What [`revive`] changed, to be undone if the republish fails.
enum Revived {
    /// Nothing was counted dead for it (already registered, counted as waiting, or a duplicate
    /// copy whose message was revived already).
    Nothing,
    /// Its completion record went from dead (for this reason) back to waiting.
    Message(Identity, Option<BatchSize>, String),
    /// A body without an identity left the dead letters by reason.
    Unidentified(&'static str),
}

/// Counts a dead letter's message as waiting again, before it is republished: its completion
/// record goes from dead back to waiting (`lua/complete.lua`, which also lowers its upload's
/// `dead` and the dead letters by reason), once however many copies are replayed. A body
/// without an identity (counted per dead letter, always as `invalid-message`) leaves the dead
/// letters by reason.
async fn revive(
    permits: &dyn DeadLetterBook,
    delivery: &Delivery,
    ttl: Duration,
) -> Result<Revived, PermitError> {
    let was_dead_for = header_str(delivery, headers::REASON).unwrap_or_default();
    let identity = identity_of(delivery);
    let batch_size = super::registration_of(delivery)
        .ok()
        .and_then(|r| r.batch_size);
    match (&identity.seller_id, &identity.message_id) {
        (Some(seller), Some(message)) => {
            let batch = identity.batch_id.as_ref().map(|id| InBatch {
                id,
                size: batch_size,
            });
            let revived = permits.revive(seller, message, batch, ttl).await?;
            Ok(if revived {
                Revived::Message(identity, batch_size, was_dead_for)
            } else {
                Revived::Nothing
            })
        }
        _ if was_dead_for == INVALID => {
            permits.tally_dead(INVALID, -1).await?;
            Ok(Revived::Unidentified(INVALID))
        }
        _ => Ok(Revived::Nothing),
    }
}

/// The reason of a dead letter whose body does not parse.
const INVALID: &str = Reason::InvalidMessage.as_str();

impl Revived {
    /// Counts the message as dead again (its republish failed: it stays a dead letter). A
    /// failure here leaves it counted as waiting, never as done.
    async fn undo(self, permits: &dyn DeadLetterBook, ttl: Duration) {
        let undone = match &self {
            Revived::Nothing => Ok(()),
            Revived::Message(identity, size, reason) => {
                permits.dead_again(identity, *size, reason, ttl).await
            }
            Revived::Unidentified(reason) => permits.tally_dead(reason, 1).await,
        };
        if let Err(error) = undone {
            tracing::warn!(%error, "not republished, and still counted as waiting");
        }
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{FieldArray, FieldTable, LongString, ShortString};

    use super::*;

    fn delivery(body: &[u8], headers: &[(&str, AMQPValue)]) -> Delivery {
        let mut delivery = Delivery::mock(1, "".into(), "q.dead".into(), false, body.to_vec());
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(ShortString::from(*name), value.clone());
        }
        delivery.properties = BasicProperties::default().with_headers(table);
        delivery
    }

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
    }

    fn letter(message: &str, seller: &str, batch: Option<&str>, reason: Reason) -> DeadLetter {
        DeadLetter {
            message_id: Some(message.into()),
            seller_id: Some(seller.into()),
            batch_id: batch.map(Into::into),
            reason,
            detail: String::new(),
            dead_at: None,
            dead_at_ms: None,
            attempts: None,
            bytes: 0,
            body_excerpt: String::new(),
            body_truncated: false,
        }
    }

    #[test]
    fn every_reason_parses_back_from_how_it_is_written() {
        for reason in Reason::ALL {
            assert_eq!(reason.as_str().parse::<Reason>(), Ok(reason));
            assert_eq!(reason.to_string(), reason.as_str());
            assert_eq!(
                serde_json::to_string(&reason).unwrap(),
                format!("\"{reason}\"")
            );
            let back: Reason = serde_json::from_str(&format!("\"{reason}\"")).unwrap();
            assert_eq!(back, reason);
        }
    }

    #[test]
    fn every_reason_a_replica_writes_is_one_of_turnstiles() {
        for written in crate::worker::DEAD_LETTER_REASONS {
            let reason = Reason::of_turnstile(written).expect(written);
            assert!(!reason.is_brokers(), "{reason}");
            assert_eq!(reason.as_str(), written);
        }
        // And no reason of turnstile's is missing from what replicas write.
        let turnstiles = Reason::ALL
            .into_iter()
            .filter(|r| !r.is_brokers() && *r != Reason::Unknown)
            .count();
        assert_eq!(turnstiles, crate::worker::DEAD_LETTER_REASONS.len());
    }

    #[test]
    fn an_unknown_reason_is_refused_with_the_list_of_reasons() {
        for given in [
            "bogus",
            "rejectd",
            "",
            "Rejected",
            " rejected",
            "delivery_limit",
        ] {
            let error = given.parse::<Reason>().unwrap_err();
            assert_eq!(error.given, given);
            let said = error.to_string();
            assert!(said.contains(&format!("{given:?}")), "{said}");
            for reason in Reason::ALL {
                assert!(said.contains(reason.as_str()), "{said} lacks {reason}");
            }
        }
        assert!(serde_json::from_str::<Reason>("\"bogus\"").is_err());
    }

    #[test]
    fn a_selection_takes_the_letters_matching_every_part_given() {
        let a = letter("m-1", "S-1", Some("b-1"), Reason::Rejected);
        let b = letter("m-2", "S-1", None, Reason::InvalidMessage);
        let c = letter("m-3", "S-2", Some("b-1"), Reason::Rejected);
        let all = [&a, &b, &c];
        let taken = |s: &Selection| -> Vec<&str> {
            all.iter()
                .filter(|l| s.matches(l))
                .map(|l| l.message_id.as_deref().unwrap())
                .collect()
        };
        assert!(Selection::all().is_all());
        assert_eq!(taken(&Selection::all()), ["m-1", "m-2", "m-3"]);
        assert_eq!(taken(&Selection::message("m-2")), ["m-2"]);
        assert_eq!(taken(&Selection::message("m-")), Vec::<&str>::new());
        assert_eq!(taken(&Selection::all().with_seller("S-1")), ["m-1", "m-2"]);
        assert_eq!(taken(&Selection::all().with_batch("b-1")), ["m-1", "m-3"]);
        let rejected = Selection::all().with_reason(Reason::Rejected);
        assert_eq!(taken(&rejected), ["m-1", "m-3"]);
        assert_eq!(taken(&rejected.clone().with_seller("S-2")), ["m-3"]);
        assert_eq!(
            taken(
                &rejected
                    .with_seller("S-1")
                    .with_batch("b-1")
                    .with_message_id("m-1")
            ),
            ["m-1"]
        );
        assert_eq!(
            taken(&Selection::all().with_reason(Reason::DeliveryLimit)),
            Vec::<&str>::new()
        );
        // A letter without a seller is never one seller's.
        let mut anonymous = letter("m-4", "S-1", None, Reason::InvalidMessage);
        anonymous.seller_id = None;
        assert!(!Selection::all().with_seller("S-1").matches(&anonymous));
        assert!(Selection::all().matches(&anonymous));
        assert_eq!(Selection::all().to_string(), "every dead letter");
        assert_eq!(
            Selection::message("m-1")
                .with_reason(Reason::Throttled)
                .to_string(),
            "message \"m-1\", reason throttled"
        );
    }

    #[test]
    fn a_body_excerpt_is_bounded_and_never_cuts_a_character() {
        assert_eq!(excerpt(b"{\"a\":1}"), ("{\"a\":1}".into(), false));
        assert_eq!(excerpt(b""), (String::new(), false));
        let long = "é".repeat(EXCERPT_BYTES);
        let (text, cut) = excerpt(long.as_bytes());
        assert!(cut);
        assert_eq!(text, "é".repeat(EXCERPT_BYTES / 2));
        // Shifted by one byte, the cut falls inside a character: it is left out.
        let shifted = format!("x{long}");
        let (text, cut) = excerpt(shifted.as_bytes());
        assert!(cut && text.len() < EXCERPT_BYTES, "{text}");
        assert_eq!(text, format!("x{}", "é".repeat(EXCERPT_BYTES / 2 - 1)));
        // Invalid bytes are replaced, not trusted; a body of them all is bounded too.
        assert_eq!(excerpt(b"a\xffb"), ("a\u{FFFD}b".into(), false));
        let (text, cut) = excerpt(&[0xff; 10_000]);
        assert!(cut);
        assert_eq!(text.chars().count(), EXCERPT_BYTES - 1);
        assert!(text.chars().all(|c| c == char::REPLACEMENT_CHARACTER));
    }

    #[test]
    fn a_replicas_dead_letter_is_described_from_its_headers() {
        let body = br#"{"message_id":"m-1","seller_id":"S-1","batch_id":"b-1","product":{}}"#;
        let d = describe(&delivery(
            body,
            &[
                (headers::REASON, text("rejected")),
                (headers::DETAIL, text("HTTP 400: no")),
                (headers::DEAD_AT, AMQPValue::LongLongInt(1_777_636_800_123)),
                (headers::ATTEMPTS, AMQPValue::LongLongInt(3)),
            ],
        ));
        assert_eq!(
            (
                d.message_id.as_deref(),
                d.seller_id.as_deref(),
                d.batch_id.as_deref()
            ),
            (Some("m-1"), Some("S-1"), Some("b-1"))
        );
        assert_eq!(d.reason, Reason::Rejected);
        assert_eq!(d.detail, "HTTP 400: no");
        assert_eq!(d.dead_at_ms, Some(1_777_636_800_123));
        assert_eq!(d.dead_at.as_deref(), Some("2026-05-01T12:00:00.123Z"));
        assert_eq!(d.attempts, Some(3));
        assert_eq!(
            (d.bytes, d.body_excerpt.as_bytes(), d.body_truncated),
            (body.len(), &body[..], false)
        );
    }

    #[test]
    fn a_brokers_dead_letter_is_described_from_its_history_whatever_its_own_headers_say() {
        let mut death = FieldTable::default();
        death.insert("reason".into(), text("delivery_limit"));
        death.insert("queue".into(), text("q"));
        death.insert("count".into(), AMQPValue::LongLongInt(1));
        death.insert("time".into(), AMQPValue::Timestamp(1_777_636_800));
        let history = AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)]));
        let body = br#"{"message_id":"m-p","seller_id":"S-1","product":{}}"#;
        // A producer's forged reason and attempts do not relabel it.
        let d = describe(&delivery(
            body,
            &[
                ("x-death", history),
                (headers::REASON, text("rejected")),
                (headers::ATTEMPTS, AMQPValue::LongLongInt(7)),
            ],
        ));
        assert_eq!(d.reason, Reason::DeliveryLimit);
        assert!(d.detail.contains("delivery_limit"), "{}", d.detail);
        assert_eq!(d.dead_at.as_deref(), Some("2026-05-01T12:00:00.000Z"));
        assert_eq!(d.attempts, None);
    }

    #[test]
    fn any_body_and_headers_are_described_without_failing() {
        // Garbage: the id is the body's digest, as everywhere else.
        let d = describe(&delivery(b"\xff\xfegarbage\x1b[31m", &[]));
        assert_eq!(d.reason, Reason::Unknown);
        assert!(d.message_id.is_some() && d.seller_id.is_none());
        assert_eq!(d.body_excerpt, "\u{FFFD}\u{FFFD}garbage\u{1b}[31m");
        // A reason turnstile does not write, a huge detail and an impossible time.
        let d = describe(&delivery(
            br#"{"seller_id":"S-1"}"#,
            &[
                (headers::REASON, text("expired-someday")),
                (headers::DETAIL, text(&"d".repeat(100_000))),
                (headers::DEAD_AT, AMQPValue::LongLongInt(i64::MAX)),
                (headers::ATTEMPTS, text("not a number")),
            ],
        ));
        assert_eq!(d.reason, Reason::Unknown);
        assert!(d.detail.starts_with("reason \"expired-someday\""));
        assert!(d.detail.len() <= super::super::budget::DETAIL_MAX);
        assert_eq!((d.dead_at, d.attempts), (None, None));
        assert_eq!(d.seller_id.as_deref(), Some("S-1"));
        // An x-death of another shape, and one of an unknown reason.
        let d = describe(&delivery(b"{}", &[("x-death", text("not an array"))]));
        assert_eq!(d.reason, Reason::Unknown);
        let mut death = FieldTable::default();
        death.insert("reason".into(), text("something-new"));
        let history = AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)]));
        let d = describe(&delivery(b"{}", &[("x-death", history)]));
        assert_eq!(d.reason, Reason::Unknown);
        assert!(d.detail.contains("something-new"), "{}", d.detail);
        let mut death = FieldTable::default();
        death.insert("reason".into(), text("expired"));
        death.insert("time".into(), AMQPValue::Timestamp(u64::MAX));
        let history = AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)]));
        let d = describe(&delivery(b"{}", &[("x-death", history)]));
        assert_eq!((d.reason, d.dead_at_ms), (Reason::BrokerExpired, None));
    }
}
