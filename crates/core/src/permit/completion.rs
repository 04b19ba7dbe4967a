//! A message's completion record (see `lua/include/records.lua` and `complete.lua`): the
//! states it holds, how a stored state reads, and the transitions between states, kept here
//! once for Rust and written into `complete.lua` by [`super::scripts`].

/// Whether a completion record's state says registered: `registered`, or `registered <RESULT>`
/// while its result is not yet published (see `lua/include/records.lua`).
pub fn is_registered(state: &str) -> bool {
    state == "registered" || state.starts_with("registered ")
}

/// The result a registered message's record keeps until it is published, if it does.
pub fn pending_result(state: &str) -> Option<&str> {
    state.strip_prefix("registered ").filter(|r| !r.is_empty())
}

/// A message's state, as its completion record holds it (see `complete.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::permit) enum RecordState {
    /// No record (or one that says neither of the others): published, neither registered nor
    /// dead-lettered, or replayed since.
    Waiting,
    /// `registered`, or `registered <RESULT>` while its result is not yet published.
    Registered,
    /// `dead:<REASON>`: dead-lettered for REASON and not replayed since.
    Dead,
}

impl RecordState {
    /// The state of a record that holds `state` (`None`: there is none), and the REASON it is
    /// dead for ('' unless [`RecordState::Dead`]).
    pub fn of(state: Option<&str>) -> (Self, &str) {
        match state {
            Some(state) if is_registered(state) => (Self::Registered, ""),
            Some(state) => match state.strip_prefix("dead:") {
                Some(reason) if !reason.is_empty() => (Self::Dead, reason),
                _ => (Self::Waiting, ""),
            },
            None => (Self::Waiting, ""),
        }
    }

    /// Its name in `complete.lua`'s MOVES.
    pub fn name(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Registered => "registered",
            Self::Dead => "dead",
        }
    }
}

/// The completion record's transitions, their one list: (OUTCOME, FROM, TO), OUTCOME moving a
/// record in state FROM to TO. Any other OUTCOME in any other state changes nothing and counts
/// nothing (a message already dead or registered is not counted dead again; a repeated dead
/// letter only renews its record's TTL). `complete.lua` takes them as its MOVES (written into
/// it by `permit::scripts`); `CompleteAnswer::registered_from` reads them for a record moved
/// without the script. Leaving a state takes the message out of that state's counts in its
/// batch's progress, entering one counts it there (see `complete.lua`).
pub(in crate::permit) const TRANSITIONS: &[(&str, RecordState, RecordState)] = &[
    ("registered", RecordState::Waiting, RecordState::Registered),
    // A copy of a dead letter registered.
    ("registered", RecordState::Dead, RecordState::Registered),
    ("dead", RecordState::Waiting, RecordState::Dead),
    // Before the replay republishes it.
    ("replayed", RecordState::Dead, RecordState::Waiting),
];

/// The state OUTCOME moves a record in state `from` to, if it moves it (see [`TRANSITIONS`]).
pub(in crate::permit) fn moved_to(outcome: &str, from: RecordState) -> Option<RecordState> {
    TRANSITIONS
        .iter()
        .find(|(o, f, _)| *o == outcome && *f == from)
        .map(|(_, _, to)| *to)
}
