//! The Lua scripts, loaded once. Each is `lua/prelude.lua` followed by the script's own file;
//! `redis::Script` runs them by EVALSHA and reloads them after NOSCRIPT (e.g. a Redis restart).

use std::sync::LazyLock;

use redis::Script;

use crate::config::Algorithm;

macro_rules! script {
    ($file:literal) => {
        LazyLock::new(|| {
            Script::new(concat!(
                include_str!("../../lua/prelude.lua"),
                "\n",
                include_str!(concat!("../../lua/", $file))
            ))
        })
    };
}

static SLIDING_WINDOW: LazyLock<Script> = script!("sliding_window.lua");
static GCRA: LazyLock<Script> = script!("gcra.lua");
static TOKEN_BUCKET: LazyLock<Script> = script!("token_bucket.lua");
static FIXED_WINDOW: LazyLock<Script> = script!("fixed_window.lua");
static REDEEM: LazyLock<Script> = script!("redeem.lua");
static PAUSE: LazyLock<Script> = script!("pause.lua");
static COMPLETE: LazyLock<Script> = script!("complete.lua");
static USAGE: LazyLock<Script> = script!("usage.lua");
static RESCHEDULE: LazyLock<Script> = script!("reschedule.lua");
static TALLY: LazyLock<Script> = script!("tally.lua");
static ENDED: LazyLock<Script> = script!("ended.lua");
static GLOBAL: LazyLock<Script> = script!("global.lua");
static RELEASE: LazyLock<Script> = script!("release.lua");
static LEASE: LazyLock<Script> = script!("lease.lua");
static LEARN: LazyLock<Script> = script!("learn.lua");
static GLOBAL_USAGE: LazyLock<Script> = script!("global_usage.lua");
static RESET: LazyLock<Script> = script!("reset.lua");
static UNRESERVE: LazyLock<Script> = script!("unreserve.lua");
static BATCH_SEEN: LazyLock<Script> = script!("batch_seen.lua");
static BATCH_EVENT_SENT: LazyLock<Script> = script!("batch_event_sent.lua");

/// `lua/batch.lua` after the prelude and, wrapped each in a function of its own, the scripts it
/// runs as operations.
macro_rules! operation {
    ($name:literal, $file:literal) => {
        concat!(
            "\nlocal function op_",
            $name,
            "()\n",
            include_str!(concat!("../../lua/", $file)),
            "\nend\n"
        )
    };
}

static BATCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../../lua/prelude.lua"),
        operation!("sliding_window", "sliding_window.lua"),
        operation!("gcra", "gcra.lua"),
        operation!("token_bucket", "token_bucket.lua"),
        operation!("fixed_window", "fixed_window.lua"),
        operation!("redeem", "redeem.lua"),
        operation!("complete", "complete.lua"),
        operation!("ended", "ended.lua"),
        operation!("learn", "learn.lua"),
        include_str!("../../lua/batch.lua")
    ))
});

/// The acquire script of an algorithm.
pub fn acquire(algorithm: Algorithm) -> &'static Script {
    match algorithm {
        Algorithm::SlidingWindow => &SLIDING_WINDOW,
        Algorithm::Gcra => &GCRA,
        Algorithm::TokenBucket => &TOKEN_BUCKET,
        Algorithm::FixedWindow => &FIXED_WINDOW,
    }
}

/// Pauses a seller (see `lua/pause.lua`).
pub fn pause() -> &'static Script {
    &PAUSE
}

/// Reads how much of a seller's limit is taken (see `lua/usage.lua`); writes nothing.
pub fn usage() -> &'static Script {
    &USAGE
}

/// Changes a seller's terms and gives back its reserved slots (see `lua/reschedule.lua`).
pub fn reschedule() -> &'static Script {
    &RESCHEDULE
}

/// Adds to a count of a hash, never below zero (see `lua/tally.lua`).
pub fn tally() -> &'static Script {
    &TALLY
}

/// Takes units of the global limit, fairly among sellers (see `lua/global.lua`).
pub fn global() -> &'static Script {
    &GLOBAL
}

/// Gives back a seller's grant that will not be called (see `lua/release.lua`).
pub fn release() -> &'static Script {
    &RELEASE
}

/// Takes one of a seller's leases of calls in flight (see `lua/lease.lua`).
pub fn lease() -> &'static Script {
    &LEASE
}

/// Reads how much of the global limit is taken, and by whom (see `lua/global_usage.lua`).
pub fn global_usage() -> &'static Script {
    &GLOBAL_USAGE
}

/// Several operations (acquire, redeem, complete, ended, learn) in one call (see
/// `lua/batch.lua` and `permit::batch`).
pub fn batch() -> &'static Script {
    &BATCH
}

/// The script of one batch operation by its name in `lua/batch.lua` (what a call of a single
/// operation runs: its own script is smaller than the batch's, so it costs Redis less to run).
pub fn operation(name: &str) -> Option<&'static Script> {
    Some(match name {
        "sliding-window" => &SLIDING_WINDOW,
        "gcra" => &GCRA,
        "token-bucket" => &TOKEN_BUCKET,
        "fixed-window" => &FIXED_WINDOW,
        "redeem" => &REDEEM,
        "complete" => &COMPLETE,
        "ended" => &ENDED,
        "learn" => &LEARN,
        _ => return None,
    })
}

/// Forgets a seller's limiter state behind a pause of one window (see `lua/reset.lua`).
pub fn reset() -> &'static Script {
    &RESET
}

/// Gives back a reserved slot whose message will not come back for it (see
/// `lua/unreserve.lua`).
pub fn unreserve() -> &'static Script {
    &UNRESERVE
}

/// Notes a batch as a replica first sees one of its messages (see `lua/batch_seen.lua`).
pub fn batch_seen() -> &'static Script {
    &BATCH_SEEN
}

/// Says that a batch's completion event was published (see `lua/batch_event_sent.lua`).
pub fn batch_event_sent() -> &'static Script {
    &BATCH_EVENT_SENT
}
