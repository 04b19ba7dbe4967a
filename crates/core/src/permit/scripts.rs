//! The Lua scripts, loaded once; `redis::Script` runs them by EVALSHA and reloads them after
//! NOSCRIPT (e.g. a Redis restart).
//!
//! A script's file starts with `-- @include PIECE` lines naming the pieces of `lua/include/`
//! whose helpers it uses; a piece starts the same way with the pieces it needs. Loading a script
//! puts the pieces it names, directly or through another piece, before it: each once, each
//! after the pieces it needs, and of each only the top-level definitions (`local function NAME`,
//! `local NAME = ...`, each with the comment above it) that the script reaches, directly or
//! through another definition it keeps, in their order (see [`reached`]). Redis runs all of it
//! on every call (defining the helpers is part of each call's cost: `turnstile bench
//! lua-setup`), so a script carries only what it uses.
//! `lua/batch.lua` runs several scripts as functions of one script (see [`batch`]).
//!
//! What Rust and the scripts must agree on is written once: a Lua file's `from_rust('NAME')`
//! stands for Lua text written from Rust's own value NAME (see [`from_rust`]); the constants
//! both keep are checked equal by this module's tests.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use redis::Script;

use crate::config::Algorithm;
use crate::permit::conn::RedisConn;
use crate::permit::error::PermitError;

/// The pieces of `lua/include/`, by name.
static PIECES: &[(&str, &str)] = &[
    ("acquire", include_str!("../../lua/include/acquire.lua")),
    ("args", include_str!("../../lua/include/args.lua")),
    ("batches", include_str!("../../lua/include/batches.lua")),
    ("blocks", include_str!("../../lua/include/blocks.lua")),
    ("calendar", include_str!("../../lua/include/calendar.lua")),
    ("calls", include_str!("../../lua/include/calls.lua")),
    ("charges", include_str!("../../lua/include/charges.lua")),
    ("far", include_str!("../../lua/include/far.lua")),
    ("fit", include_str!("../../lua/include/fit.lua")),
    ("learned", include_str!("../../lua/include/learned.lua")),
    ("limits", include_str!("../../lua/include/limits.lua")),
    ("losses", include_str!("../../lua/include/losses.lua")),
    ("pauses", include_str!("../../lua/include/pauses.lua")),
    ("ranks", include_str!("../../lua/include/ranks.lua")),
    ("routes", include_str!("../../lua/include/routes.lua")),
    ("records", include_str!("../../lua/include/records.lua")),
    (
        "reservations",
        include_str!("../../lua/include/reservations.lua"),
    ),
    ("shadow", include_str!("../../lua/include/shadow.lua")),
    ("states", include_str!("../../lua/include/states.lua")),
    ("terms", include_str!("../../lua/include/terms.lua")),
    (
        "terms_change",
        include_str!("../../lua/include/terms_change.lua"),
    ),
    ("tats", include_str!("../../lua/include/tats.lua")),
    ("time", include_str!("../../lua/include/time.lua")),
    ("units", include_str!("../../lua/include/units.lua")),
];

/// The scripts of `lua/`, by file name without `.lua` (`batch` is put together with the
/// operations it runs, see [`BATCH_OPERATIONS`]).
static SCRIPTS: &[(&str, &str)] = &[
    (
        "sliding_window",
        include_str!("../../lua/sliding_window.lua"),
    ),
    ("gcra", include_str!("../../lua/gcra.lua")),
    ("token_bucket", include_str!("../../lua/token_bucket.lua")),
    ("fixed_window", include_str!("../../lua/fixed_window.lua")),
    ("redeem", include_str!("../../lua/redeem.lua")),
    ("pause", include_str!("../../lua/pause.lua")),
    ("complete", include_str!("../../lua/complete.lua")),
    ("usage", include_str!("../../lua/usage.lua")),
    ("reschedule", include_str!("../../lua/reschedule.lua")),
    ("tally", include_str!("../../lua/tally.lua")),
    ("ended", include_str!("../../lua/ended.lua")),
    ("global", include_str!("../../lua/global.lua")),
    ("global_end", include_str!("../../lua/global_end.lua")),
    ("release", include_str!("../../lua/release.lua")),
    ("lease", include_str!("../../lua/lease.lua")),
    ("learn", include_str!("../../lua/learn.lua")),
    ("global_usage", include_str!("../../lua/global_usage.lua")),
    ("reset", include_str!("../../lua/reset.lua")),
    ("unreserve", include_str!("../../lua/unreserve.lua")),
    ("recost", include_str!("../../lua/recost.lua")),
    ("batch_seen", include_str!("../../lua/batch_seen.lua")),
    (
        "batch_event_sent",
        include_str!("../../lua/batch_event_sent.lua"),
    ),
    ("retry", include_str!("../../lua/retry.lua")),
    ("retries", include_str!("../../lua/retries.lua")),
    ("batch", include_str!("../../lua/batch.lua")),
    ("fleet", include_str!("../../lua/fleet.lua")),
    ("supersede", include_str!("../../lua/supersede.lua")),
];

/// The operations `lua/batch.lua` runs: each is the script of that file, wrapped in a function
/// `op_<file>` of the batch.
const BATCH_OPERATIONS: &[&str] = &[
    "sliding_window",
    "gcra",
    "token_bucket",
    "fixed_window",
    "redeem",
    "complete",
    "ended",
    "learn",
];

/// The names a Lua file's leading `-- @include NAME` lines give.
fn includes(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map_while(|line| line.strip_prefix("-- @include "))
        .map(str::trim)
}

/// `name` and its text in `table`, a table of KIND (`piece` or `script`); panics when there is
/// none.
fn lookup(
    table: &[(&'static str, &'static str)],
    kind: &str,
    name: &str,
) -> (&'static str, &'static str) {
    *table
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no Lua {kind} `{name}`"))
}

/// The pieces of `table` that `roots` name, directly or through the pieces they need: each once,
/// each after the pieces it needs. Panics on an unknown piece or pieces that need each other.
fn resolve<'a>(
    table: &[(&'static str, &'static str)],
    roots: impl IntoIterator<Item = &'a str>,
) -> Vec<&'static str> {
    fn visit(
        table: &[(&'static str, &'static str)],
        name: &str,
        order: &mut Vec<&'static str>,
        path: &mut Vec<&'static str>,
    ) {
        let (name, text) = lookup(table, "piece", name);
        if order.contains(&name) {
            return;
        }
        if path.contains(&name) {
            panic!(
                "Lua pieces include each other: {} -> {name}",
                path.join(" -> ")
            );
        }
        path.push(name);
        for needed in includes(text) {
            visit(table, needed, order, path);
        }
        path.pop();
        order.push(name);
    }
    let mut order = Vec::new();
    for root in roots {
        visit(table, root, &mut order, &mut Vec::new());
    }
    order
}

/// A script as Redis runs it.
pub struct Source {
    /// Its file in `lua/`, without `.lua`.
    pub name: &'static str,
    /// The pieces it includes, in the order they are put before it.
    pub pieces: Vec<&'static str>,
    /// What runs before the script's own file: the definitions of its pieces it reaches (and
    /// for `batch`, its operations, each a function).
    pub setup: String,
    /// The script's own file (its `from_rust('NAME')` written in).
    pub body: String,
}

impl Source {
    /// The whole script.
    pub fn text(&self) -> String {
        format!("{}\n{}", self.setup, self.body)
    }
}

/// The pieces' texts, one after another.
fn joined(pieces: &[&str]) -> String {
    with_rust_values(
        &pieces
            .iter()
            .map(|name| lookup(PIECES, "piece", name).1)
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

/// The Lua text `from_rust('NAME')` stands for in a script: Rust's value NAME. Panics on a
/// NAME it does not know.
fn from_rust(name: &str) -> String {
    match name {
        "TRANSITIONS" => transitions(),
        _ => panic!("no Rust value `{name}` for the Lua scripts"),
    }
}

/// The completion record's transitions ([`super::completion::TRANSITIONS`]) as a Lua table:
/// `t[OUTCOME][FROM] = TO`, on one line.
fn transitions() -> String {
    let mut outcomes: Vec<&str> = Vec::new();
    for (outcome, _, _) in super::completion::TRANSITIONS {
        if !outcomes.contains(outcome) {
            outcomes.push(outcome);
        }
    }
    let table: Vec<String> = outcomes
        .iter()
        .map(|outcome| {
            let moves: Vec<String> = super::completion::TRANSITIONS
                .iter()
                .filter(|(o, _, _)| o == outcome)
                .map(|(_, from, to)| format!("['{}'] = '{}'", from.name(), to.name()))
                .collect();
            format!("['{outcome}'] = {{{}}}", moves.join(", "))
        })
        .collect();
    format!("{{{}}}", table.join(", "))
}

/// `text` with every `from_rust('NAME')` replaced by what it stands for (see [`from_rust`]).
fn with_rust_values(text: &str) -> String {
    const CALL: &str = "from_rust('";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(CALL) {
        let after = &rest[at + CALL.len()..];
        let end = after
            .find("')")
            .unwrap_or_else(|| panic!("an unclosed {CALL}...') in a Lua file"));
        out.push_str(&rest[..at]);
        out.push_str(&from_rust(&after[..end]));
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Lua text without its comments and string literals (each string becomes `''`), so that
/// neither counts as a use of a name. Long brackets (`[[...]]`, `--[[...]]`) are not read: no
/// Lua file uses them (a test checks).
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '-' if chars.peek() == Some(&'-') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '\'' | '"' => {
                while let Some(d) = chars.next() {
                    if d == '\\' {
                        chars.next();
                    } else if d == c {
                        break;
                    }
                }
                out.push_str("''");
            }
            c => out.push(c),
        }
    }
    out
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The words of Lua code, each with the character before it and the text after it.
fn words(code: &str) -> Vec<(Option<char>, &str, &str)> {
    let mut found = Vec::new();
    let mut start = None;
    for (i, c) in code.char_indices().chain([(code.len(), ' ')]) {
        match (start, is_word(c)) {
            (None, true) => start = Some(i),
            (Some(s), false) => {
                found.push((code[..s].chars().next_back(), &code[s..i], &code[i..]));
                start = None;
            }
            _ => {}
        }
    }
    found
}

/// The names Lua text may refer to: its words, but for fields and methods (`x.name`,
/// `x:name`).
fn names(text: &str) -> BTreeSet<String> {
    words(&code(text))
        .into_iter()
        .filter(|(before, _, _)| !matches!(before, Some('.' | ':')))
        .map(|(_, word, _)| word.to_owned())
        .collect()
}

/// A top-level definition of a piece: `local function NAME` or `local NAME, ... = ...` (a
/// line that starts with `local `), through what follows it up to the next one, with the
/// comment lines right above it.
struct Definition {
    /// The names it defines.
    defines: Vec<String>,
    /// The names its text refers to.
    uses: BTreeSet<String>,
    text: String,
}

/// A piece's top-level definitions, in order (its header, the text before the first, is
/// left out). Every line of a piece that is not indented is a definition's start, its `end`,
/// a comment or blank (a test checks), so nothing else runs at its top level.
fn definitions(piece: &str) -> Vec<Definition> {
    let lines: Vec<&str> = piece.split_inclusive('\n').collect();
    let mut starts: Vec<usize> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("local ") {
            let mut start = i;
            while start > 0 && lines[start - 1].starts_with("--") {
                start -= 1;
            }
            starts.push(start.max(starts.last().map_or(0, |s| s + 1)));
        }
    }
    let ends = starts.iter().skip(1).copied().chain([lines.len()]);
    starts
        .iter()
        .zip(ends)
        .map(|(&start, end)| {
            let mut text: String = lines[start..end].concat();
            if !text.ends_with('\n') {
                text.push('\n');
            }
            let statement = lines[start..end]
                .iter()
                .find_map(|line| line.strip_prefix("local "))
                .unwrap_or_default();
            let statement = statement.strip_prefix("function ").unwrap_or(statement);
            let defines = statement
                .split(['=', '('])
                .next()
                .unwrap_or_default()
                .split(',')
                .map(|name| name.trim().to_owned())
                .collect();
            Definition {
                defines,
                uses: names(&text),
                text,
            }
        })
        .collect()
}

/// The definitions of `pieces` (in their order) that `roots` reach: those defining a name a
/// root refers to, and then those defining a name a definition kept refers to; each kept whole,
/// in order. Keeping a definition that is not needed (a name that is only a local of the same
/// name, or a table's key) costs a little; leaving one out that is needed would fail the
/// script, so every word counts as a use.
fn reached<'a>(pieces: &[&str], roots: impl IntoIterator<Item = &'a str>) -> String {
    let definitions: Vec<Definition> = pieces
        .iter()
        .flat_map(|name| definitions(&with_rust_values(lookup(PIECES, "piece", name).1)))
        .collect();
    let mut by_name: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, definition) in definitions.iter().enumerate() {
        for name in &definition.defines {
            by_name.insert(name, i);
        }
    }
    let mut kept = vec![false; definitions.len()];
    let mut wanted: Vec<String> = roots.into_iter().flat_map(names).collect();
    while let Some(name) = wanted.pop() {
        if let Some(&i) = by_name.get(name.as_str())
            && !kept[i]
        {
            kept[i] = true;
            wanted.extend(definitions[i].uses.iter().cloned());
        }
    }
    definitions
        .into_iter()
        .zip(kept)
        .filter_map(|(definition, kept)| kept.then_some(definition.text))
        .collect()
}

/// The script `name` of `lua/` with what it includes. Panics on an unknown script or piece, or
/// pieces that need each other.
pub fn source(name: &str) -> Source {
    let (name, body) = lookup(SCRIPTS, "script", name);
    let body = with_rust_values(body);
    if name != "batch" {
        let pieces = resolve(PIECES, includes(&body));
        return Source {
            name,
            setup: reached(&pieces, [body.as_str()]),
            pieces,
            body,
        };
    }
    let operations: Vec<(&str, String)> = BATCH_OPERATIONS
        .iter()
        .map(|op| {
            let (op, text) = lookup(SCRIPTS, "script", op);
            (op, with_rust_values(text))
        })
        .collect();
    let pieces = resolve(
        PIECES,
        includes(&body).chain(operations.iter().flat_map(|(_, text)| includes(text))),
    );
    let roots = std::iter::once(body.as_str()).chain(operations.iter().map(|(_, t)| t.as_str()));
    let mut setup = reached(&pieces, roots);
    for (op, text) in &operations {
        setup.push_str(&format!("\nlocal function op_{op}()\n{text}\nend\n"));
    }
    Source {
        name,
        pieces,
        setup,
        body,
    }
}

/// Every script of `lua/`, as Redis runs it.
pub fn sources() -> Vec<Source> {
    SCRIPTS.iter().map(|(name, _)| source(name)).collect()
}

/// Every piece of `lua/include/`, each after the pieces it needs: what every script ran before
/// the pieces were split (`lua/prelude.lua`).
pub fn all_pieces() -> String {
    joined(&resolve(PIECES, PIECES.iter().map(|(name, _)| *name)))
}

macro_rules! script {
    ($name:literal) => {
        LazyLock::new(|| Script::new(&source($name).text()))
    };
}

static SLIDING_WINDOW: LazyLock<Script> = script!("sliding_window");
static GCRA: LazyLock<Script> = script!("gcra");
static TOKEN_BUCKET: LazyLock<Script> = script!("token_bucket");
static FIXED_WINDOW: LazyLock<Script> = script!("fixed_window");
static REDEEM: LazyLock<Script> = script!("redeem");
static PAUSE: LazyLock<Script> = script!("pause");
static COMPLETE: LazyLock<Script> = script!("complete");
static USAGE: LazyLock<Script> = script!("usage");
static RESCHEDULE: LazyLock<Script> = script!("reschedule");
static TALLY: LazyLock<Script> = script!("tally");
static ENDED: LazyLock<Script> = script!("ended");
static GLOBAL: LazyLock<Script> = script!("global");
static GLOBAL_END: LazyLock<Script> = script!("global_end");
static RELEASE: LazyLock<Script> = script!("release");
static LEASE: LazyLock<Script> = script!("lease");
static LEARN: LazyLock<Script> = script!("learn");
static GLOBAL_USAGE: LazyLock<Script> = script!("global_usage");
static RESET: LazyLock<Script> = script!("reset");
static UNRESERVE: LazyLock<Script> = script!("unreserve");
static RECOST: LazyLock<Script> = script!("recost");
static BATCH_SEEN: LazyLock<Script> = script!("batch_seen");
static BATCH_EVENT_SENT: LazyLock<Script> = script!("batch_event_sent");
static RETRY: LazyLock<Script> = script!("retry");
static RETRIES: LazyLock<Script> = script!("retries");
static BATCH: LazyLock<Script> = script!("batch");
static FLEET: LazyLock<Script> = script!("fleet");
static SUPERSEDE: LazyLock<Script> = script!("supersede");

/// Every script of this module.
fn every() -> [&'static Script; 27] {
    [
        &SLIDING_WINDOW,
        &GCRA,
        &TOKEN_BUCKET,
        &FIXED_WINDOW,
        &REDEEM,
        &PAUSE,
        &COMPLETE,
        &USAGE,
        &RESCHEDULE,
        &TALLY,
        &ENDED,
        &GLOBAL,
        &GLOBAL_END,
        &RELEASE,
        &LEASE,
        &LEARN,
        &GLOBAL_USAGE,
        &RESET,
        &UNRESERVE,
        &RECOST,
        &BATCH_SEEN,
        &BATCH_EVENT_SENT,
        &RETRY,
        &RETRIES,
        &BATCH,
        &FLEET,
        &SUPERSEDE,
    ]
}

/// Loads every script into Redis (`SCRIPT LOAD`, all sent at once; on Redis Cluster to every
/// primary), so that a replica's first calls find them: a script Redis does not know costs its
/// caller two more round trips (NOSCRIPT, then the load), which through a slow link can make
/// the first grants too old to call. A script this leaves unloaded (an error, a Redis restarted
/// since) is loaded at its first NOSCRIPT, as ever.
pub async fn load_every(conn: &RedisConn) -> Result<(), PermitError> {
    let loads = every().map(|script| {
        let mut conn = conn.clone();
        async move { script.prepare_invoke().load_async(&mut conn).await }
    });
    futures::future::try_join_all(loads).await?;
    Ok(())
}

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

/// Ends a call the global limit granted: answered, or never sent (see `lua/global_end.lua`).
pub fn global_end() -> &'static Script {
    &GLOBAL_END
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

/// Makes a granted call's units what the downstream reported it cost (see `lua/recost.lua`).
pub fn recost() -> &'static Script {
    &RECOST
}

/// The replicas' registry (see `lua/fleet.lua`).
pub fn fleet() -> &'static Script {
    &FLEET
}

/// Which message of a product is the latest (see `lua/supersede.lua`).
pub fn supersede() -> &'static Script {
    &SUPERSEDE
}

/// Notes a batch as a replica first sees one of its messages (see `lua/batch_seen.lua`).
pub fn batch_seen() -> &'static Script {
    &BATCH_SEEN
}

/// Says that a batch's completion event was published (see `lua/batch_event_sent.lua`).
pub fn batch_event_sent() -> &'static Script {
    &BATCH_EVENT_SENT
}

/// Notes a message of a batch waiting out a retry's backoff, for the ETA (see `lua/retry.lua`).
pub fn retry() -> &'static Script {
    &RETRY
}

/// Reads a seller's retries not due yet (see `lua/retries.lua`); writes nothing.
pub fn retries() -> &'static Script {
    &RETRIES
}

#[cfg(test)]
mod tests;
