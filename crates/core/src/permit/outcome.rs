//! The vocabulary of a call's end: a message's completion states, a call's answer as it is
//! recorded, a batch's completion event, the lessons adaptive limits learn.

use crate::domain::{BatchId, BatchSize, Cost, RateLimitHeaders};

/// What happened to a message, as its completion record keeps it (see `lua/complete.lua`):
/// each message is in one state, and counted in its upload's progress in that one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion<'a> {
    /// The downstream accepted it (2xx).
    Registered,
    /// Dead-lettered (confirmed by the broker) with this reason: counted once, however many
    /// copies are dead-lettered, and not at all if it already registered.
    Dead(&'a str),
    /// Taken out of the dead letters to be republished to the work queue: waiting again.
    Replayed,
}

impl Completion<'_> {
    /// The script's OUTCOME argument.
    pub(in crate::permit) fn outcome(self) -> &'static str {
        match self {
            Completion::Registered => "registered",
            Completion::Dead(_) => "dead",
            Completion::Replayed => "replayed",
        }
    }
}

/// A call's answer, as `PermitStore::complete_call` records it: the call's name (see
/// [`Decision::Granted`]), its cost, and when the answer came back (Redis µs, an upper bound: the
/// grant's time plus the time from asking for the permit to the answer; `None`: when recorded).
#[derive(Clone, Copy, Debug)]
pub struct CallAnswer<'a> {
    pub call: &'a str,
    pub cost: Cost,
    pub answered_us: Option<i64>,
    /// The message's result (JSON), kept in its record until published (see
    /// [`Progress::result_published`]); `None`: nothing to keep.
    pub result: Option<&'a str>,
}

/// What recording a message's state did ([`PermitStore::complete`],
/// `PermitStore::complete_call`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Whether the message's state changed (and was counted).
    pub changed: bool,
    /// Whether a learned limit of its seller is due to change: a raise, or a correction of the
    /// last decrease ([`Lesson::Recovery`]).
    pub raise_due: bool,
    /// The completion event of its batch, pending publication (see [`BatchEvent`]).
    pub event: Option<BatchEvent>,
}

/// A batch's completion event waiting to be published: the batch completed at `completed_ms`
/// (Unix ms, Redis time). Whoever publishes it says so with [`Records::batch_event_sent`];
/// until then the message that completed the batch, its redeliveries (recorded again, or acked
/// as registered before) and a replica first seeing the batch find it pending; a message
/// counted after the batch completed (one more than its total) does not, so that it is not
/// published twice at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchEvent {
    pub completed_ms: u64,
}

impl BatchEvent {
    /// The event a script's EVENT answer names ('' when none is pending).
    pub(in crate::permit) fn parse(event: &str) -> Option<Self> {
        event.parse().ok().map(|completed_ms| Self { completed_ms })
    }
}

/// A message's batch as its completion is counted: the batch's id and the `batch_size` the
/// message gave.
#[derive(Clone, Copy, Debug)]
pub struct InBatch<'a> {
    pub id: &'a BatchId,
    pub size: Option<BatchSize>,
}

impl<'a> InBatch<'a> {
    /// The batch of a registration, if it names one.
    pub fn of(registration: &'a crate::domain::Registration) -> Option<Self> {
        Some(Self {
            id: registration.batch_id.as_ref()?,
            size: registration.batch_size,
        })
    }
}

/// What the downstream's answers taught about a seller's real limit (see `lua/learn.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lesson {
    /// A 429 for the call granted at `granted_us` (Redis µs), with what its rate-limit headers
    /// said, if anything.
    Throttled {
        granted_us: i64,
        told: Option<RateLimitHeaders>,
    },
    /// `PermitStore::complete_call` said a learned limit is due to change: a raise, or a
    /// correction of the last decrease.
    Recovery,
    /// A 2xx answer's rate-limit headers.
    Told(RateLimitHeaders),
}

/// Why a learned limit last changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// A 429 lowered it.
    Throttled,
    /// Sustained success raised it.
    Recovery,
    /// Rate-limit headers set it.
    Header,
}

impl Why {
    pub const ALL: [Why; 3] = [Why::Throttled, Why::Recovery, Why::Header];

    pub(in crate::permit) fn parse(s: &str) -> Option<Self> {
        match s {
            "429" => Some(Why::Throttled),
            "recovery" => Some(Why::Recovery),
            "header" => Some(Why::Header),
            _ => None,
        }
    }

    /// The metric label and the name shown: `429`, `recovery` or `header`.
    pub const fn label(self) -> &'static str {
        match self {
            Why::Throttled => "429",
            Why::Recovery => "recovery",
            Why::Header => "header",
        }
    }
}

/// A change of a seller's learned limit (see `PermitStore::learn`): its counts now, and
/// whether a count went down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LearnedChange {
    pub counts: String,
    pub why: Why,
    pub lowered: bool,
}
