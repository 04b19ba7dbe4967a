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

/// The completion record's transitions ([`super::calls::TRANSITIONS`]) as a Lua table:
/// `t[OUTCOME][FROM] = TO`, on one line.
fn transitions() -> String {
    let mut outcomes: Vec<&str> = Vec::new();
    for (outcome, _, _) in super::calls::TRANSITIONS {
        if !outcomes.contains(outcome) {
            outcomes.push(outcome);
        }
    }
    let table: Vec<String> = outcomes
        .iter()
        .map(|outcome| {
            let moves: Vec<String> = super::calls::TRANSITIONS
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
mod tests {
    use super::*;

    /// What a piece defines for others: its top-level `local function NAME` and `local NAME`.
    fn top_level(text: &str) -> BTreeSet<String> {
        code(text)
            .lines()
            .filter_map(|line| line.strip_prefix("local "))
            .flat_map(|rest| {
                let rest = rest.strip_prefix("function ").unwrap_or(rest);
                let names = rest.split(['=', '(']).next().unwrap_or("");
                names
                    .split(',')
                    .map(|n| n.trim().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The names a piece's header says it defines (`-- Defines: a, b,` and its continuation
    /// lines, `--   c`).
    fn declared(text: &str) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        let mut lines = text.lines().skip_while(|l| !l.starts_with("-- Defines: "));
        let Some(first) = lines.next() else {
            return names;
        };
        let continued = lines.take_while(|l| l.starts_with("--   "));
        for line in std::iter::once(&first["-- Defines: ".len()..]).chain(continued) {
            let line = line.trim_start_matches("--").trim();
            names.extend(
                line.split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned),
            );
        }
        names
    }

    /// Every name some piece defines, with the piece.
    fn definitions() -> BTreeMap<String, &'static str> {
        let mut defined = BTreeMap::new();
        for (piece, text) in PIECES {
            for name in top_level(text) {
                if let Some(other) = defined.insert(name.clone(), *piece) {
                    panic!("`{name}` is defined by both {other} and {piece}");
                }
            }
        }
        defined
    }

    /// The pieces' names that `text` uses: functions it calls (`name(`, not `x.name(`) and
    /// constants (capitalized) it reads; not the names it defines itself.
    fn uses(text: &str, defined: &BTreeMap<String, &'static str>) -> BTreeSet<String> {
        let code = code(text);
        // Every `local NAME, ...` and `local function NAME`, at any depth.
        let own: BTreeSet<&str> = words(&code)
            .into_iter()
            .filter(|(_, word, _)| *word == "local")
            .flat_map(|(_, _, after)| {
                let statement = after.lines().next().unwrap_or("").trim_start();
                let statement = statement.strip_prefix("function ").unwrap_or(statement);
                let names = statement.split(['=', '(']).next().unwrap_or("");
                names.split(',').map(str::trim)
            })
            .collect();
        words(&code)
            .into_iter()
            .filter(|(before, word, after)| {
                let called = after.trim_start().starts_with('(');
                let constant = word.chars().all(|c| c.is_ascii_uppercase() || c == '_');
                !matches!(before, Some('.' | ':'))
                    && (called || constant)
                    && defined.contains_key(*word)
                    && !own.contains(word)
                    && !matches!(*word, "KEYS" | "ARGV")
            })
            .map(|(_, word, _)| word.to_owned())
            .collect()
    }

    /// What is wrong with the includes of the Lua file `name` (a piece or a script): a name it
    /// uses that no piece it includes (directly or through another) defines, and for a piece,
    /// reading KEYS or ARGV without including `args` (in a batch they must be its locals).
    fn missing(name: &str, text: &str, own_piece: Option<&str>) -> Vec<String> {
        let defined = definitions();
        let included = resolve(PIECES, includes(text).chain(own_piece));
        let mut problems: Vec<String> = uses(text, &defined)
            .into_iter()
            .filter(|used| !included.contains(&defined[used]))
            .map(|used| {
                let piece = defined[&used];
                format!("{name} uses `{used}` of {piece} without including it")
            })
            .collect();
        let reads_call = words(&code(text))
            .iter()
            .any(|(_, w, _)| matches!(*w, "KEYS" | "ARGV"));
        if own_piece.is_some_and(|p| p != "args") && reads_call && !included.contains(&"args") {
            problems.push(format!("{name} reads KEYS or ARGV without including args"));
        }
        problems
    }

    /// The locals Lua code declares (`local function NAME` declares one, `local A, B = ...`
    /// two), each with where its statement starts in `code` (Lua code, see [`code`]) and
    /// whether it is one of the main chunk's. Lua allows at most 200 locals in one function.
    fn locals(code: &str) -> Vec<(&str, usize, bool)> {
        let mut depth = 0usize;
        let mut found = Vec::new();
        let all = words(code);
        for (i, (before, word, after)) in all.iter().enumerate() {
            if matches!(before, Some('.' | ':')) {
                continue;
            }
            match *word {
                "function" | "do" | "if" | "repeat" => depth += 1,
                "end" | "until" => depth -= 1,
                "local" => {
                    let at = code.len() - after.len() - word.len();
                    let main = depth == 0;
                    match all.get(i + 1) {
                        Some((_, "function", _)) => found.push((all[i + 2].1, at, main)),
                        _ => {
                            let statement = after.lines().next().unwrap_or("");
                            let names = statement.split('=').next().unwrap_or("");
                            found.extend(names.split(',').map(|name| (name.trim(), at, main)));
                        }
                    }
                }
                _ => {}
            }
        }
        found
    }

    /// How many locals the main chunk of the Lua `text` declares.
    fn top_level_locals(text: &str) -> usize {
        let code = code(text);
        locals(&code).iter().filter(|(_, _, main)| *main).count()
    }

    /// Prints, for every script, the Lua lines Redis runs on each call and the locals of its
    /// main chunk (`cargo test -p turnstile-core --lib scripts_sizes -- --nocapture`).
    #[test]
    fn scripts_sizes() {
        println!("{:<18} {:>6} {:>8}", "script", "lines", "locals");
        for source in sources() {
            let text = source.text();
            println!(
                "{:<18} {:>6} {:>8}",
                source.name,
                text.lines().count(),
                top_level_locals(&text)
            );
        }
    }

    /// The integer a Lua file sets at its top level: its one `local NAME = INTEGER` line.
    fn lua_integer(file: &str, text: &str, name: &str) -> u64 {
        let prefix = format!("local {name} = ");
        let values: Vec<&str> = text
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .collect();
        let [value] = values[..] else {
            panic!("{file} sets {name} {} times", values.len());
        };
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{file}: {name} = {value} is not an integer"))
    }

    #[test]
    fn the_constants_rust_shares_with_the_scripts_are_equal() {
        use crate::permit::{admin, batch, block};
        let piece = |name| {
            (
                format!("include/{name}.lua"),
                lookup(PIECES, "piece", name).1,
            )
        };
        let script = |name| (format!("{name}.lua"), lookup(SCRIPTS, "script", name).1);
        let equal = [
            (
                piece("args"),
                "MAX_COST",
                u64::from(crate::domain::Cost::MAX),
            ),
            (
                piece("limits"),
                "MAX_STACK",
                crate::config::Limits::MAX as u64,
            ),
            (
                piece("ranks"),
                "MAX_PRIORITY",
                u64::from(crate::domain::Priority::MAX),
            ),
            (
                piece("ranks"),
                "AGING_US",
                crate::permit::AGING.as_micros() as u64,
            ),
            (
                piece("ranks"),
                "GIVE_WAY_REACH",
                u64::from(crate::permit::GIVE_WAY_REACH),
            ),
            (
                piece("ranks"),
                "GIVE_WAY_STEPS_PER_S",
                u64::from(crate::permit::GIVE_WAY_STEPS_PER_SECOND),
            ),
            (
                piece("ranks"),
                "GIVE_WAY_STEPS_SAVED",
                u64::from(crate::permit::GIVE_WAY_STEPS_SAVED),
            ),
            (piece("blocks"), "MAX_BLOCK", u64::from(block::MOST_UNITS)),
            (
                piece("shadow"),
                "MAX_SHADOW_LOG",
                u64::from(admin::MAX_SHADOW_COUNT),
            ),
            (script("global"), "MAX_WEIGHT", u64::from(admin::MAX_WEIGHT)),
        ];
        for ((file, text), name, rust) in equal {
            assert_eq!(lua_integer(&file, text, name), rust, "{file}: {name}");
        }
        let (file, text) = script("batch");
        assert!(batch::MOST_PER_CALL as u64 <= lua_integer(&file, text, "MOST_OPERATIONS"));
        let (file, text) = piece("blocks");
        assert!(
            crate::permit::block::BLOCK_HOLD.as_micros() as u64
                <= lua_integer(&file, text, "MAX_HOLD_US")
        );
        // A token carries its priority as one digit (see `rank_of` in include/ranks.lua).
        assert_eq!(crate::domain::Priority::MAX.to_string().len(), 1);
    }

    /// A connection to the Redis the tests use.
    fn redis() -> redis::Connection {
        let url = std::env::var("TURNSTILE_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        redis::Client::open(url)
            .and_then(|client| client.get_connection())
            .expect("the tests' Redis")
    }

    /// What Redis answers to `code` run after `pieces` (and what they need), with `args` as ARGV
    /// and no keys.
    fn eval<T: redis::FromRedisValue>(pieces: &[&str], code: &str, args: &[String]) -> T {
        let text = format!(
            "{}\n{code}",
            joined(&resolve(PIECES, pieces.iter().copied()))
        );
        redis::cmd("EVAL")
            .arg(text)
            .arg(0)
            .arg(args)
            .query(&mut redis())
            .unwrap_or_else(|e| panic!("{code}: {e}"))
    }

    #[test]
    fn the_guard_is_the_scripts() {
        use std::time::Duration;
        let windows_us: [u64; 10] = [
            1,
            19_999,
            499_999,
            500_001,
            1_000_000,
            7_777_777,
            39_999_999,
            40_000_000,
            3_600_000_000,
            86_400_000_000,
        ];
        let guards = [None, Some(Duration::ZERO), Some(Duration::from_millis(7))];
        for guard in guards {
            let arg = crate::permit::admin::Terms::guard_arg_of(guard);
            let args: Vec<String> = std::iter::once(arg.to_string())
                .chain(windows_us.iter().map(u64::to_string))
                .collect();
            let lua: Vec<u64> = eval(
                &["limits"],
                "local g, out = tonumber(ARGV[1]), {}\n\
                 for i = 2, #ARGV do out[i - 1] = guard_for(tonumber(ARGV[i]), g) end\n\
                 return out",
                &args,
            );
            let rust: Vec<u64> = windows_us
                .iter()
                .map(|w| {
                    crate::config::guard_for(guard, Duration::from_micros(*w)).as_micros() as u64
                })
                .collect();
            assert_eq!(lua, rust, "guard {guard:?}");
        }
    }

    #[test]
    fn a_tokens_rank_reads_in_the_scripts_as_rust_wrote_it() {
        use crate::domain::Priority;
        use crate::permit::Rank;
        // {PRIORITY, DEADLINE_US or -1, ARRIVAL_US or -1, 1 when routed} as the scripts read
        // TOKEN (after checking it as they check every TOKEN).
        let read = |token: &str| -> Vec<i64> {
            eval(
                &["ranks"],
                "local t = token_arg(1)\n\
                 local r = rank_of(t)\n\
                 return {r.priority, r.deadline or -1, r.arrival or -1, routed(t) and 1 or 0}",
                &[token.to_owned()],
            )
        };
        let ranks = [
            Rank::default(),
            Rank {
                priority: Priority::from_amqp(Some(Priority::MAX)),
                deadline_ms: Some(4_102_444_800_000),
                arrival_ms: 4_102_444_799_999,
            },
            Rank {
                priority: Priority::from_amqp(Some(3)),
                deadline_ms: None,
                arrival_ms: 1_700_000_000_123,
            },
        ];
        for rank in ranks {
            let token = Rank::token(Some(&rank), false);
            let wanted = [
                i64::from(rank.priority.get()),
                rank.deadline_ms.map_or(-1, |d| d as i64 * 1000),
                rank.arrival_ms as i64 * 1000,
                0,
            ];
            assert_eq!(read(&token), wanted, "{token}");
        }
        let plain = Rank::token(None, false);
        assert_eq!(read(&plain), [0, -1, -1, 0], "{plain}");
        let routed = Rank::token(None, true);
        assert_eq!(read(&routed), [0, -1, -1, 1], "{routed}");
    }

    #[test]
    fn every_script_defines_each_name_of_its_pieces_it_refers_to_before_it() {
        let defined = definitions();
        for source in sources() {
            let code = code(&source.text());
            let locals = locals(&code);
            // A name a function declares for itself (`local due = {}`) is not the piece's.
            let own: BTreeSet<&str> = locals
                .iter()
                .filter(|(_, _, main)| !main)
                .map(|(name, _, _)| *name)
                .collect();
            // Without `args`, KEYS and ARGV are Redis's own.
            let globals: &[&str] = if source.pieces.contains(&"args") {
                &[]
            } else {
                &["KEYS", "ARGV"]
            };
            for (before, word, after) in words(&code) {
                if matches!(before, Some('.' | ':'))
                    || !defined.contains_key(word)
                    || own.contains(word)
                    || globals.contains(&word)
                {
                    continue;
                }
                let at = code.len() - after.len() - word.len();
                assert!(
                    locals
                        .iter()
                        .any(|(name, from, main)| *main && *name == word && *from <= at),
                    "{}.lua refers to `{word}` of {} before defining it (or never)",
                    source.name,
                    defined[word]
                );
            }
        }
    }

    #[test]
    fn a_script_carries_only_what_it_reaches() {
        let complete = source("complete");
        assert!(complete.pieces.contains(&"limits"));
        assert!(complete.setup.contains("local function with_spans("));
        // Limits' definitions complete.lua does not reach.
        assert!(!complete.setup.contains("local function within("));
        let pause = source("pause");
        assert!(!pause.setup.contains("local function token_arg("));
        // Each definition whole, with its comment, in its piece's order.
        let args = lookup(PIECES, "piece", "args").1;
        let kept = reached(&["args"], ["return int_arg(1, 0) + MAX_COST"]);
        // int_arg reads ARGV, the piece's local.
        let argv = &args[args.find("-- The call's keys and arguments").unwrap()..];
        let int_arg = &argv[argv.find("-- ARGV[i] as an integer").unwrap()..];
        let int_arg = &int_arg[..int_arg.find("\n\n").unwrap() + 1];
        let argv = &argv[..argv.find("\n\n").unwrap() + 1];
        let max_cost = &args[args.find("-- Most units one call").unwrap()..];
        assert_eq!(kept, format!("{argv}\n{int_arg}\n{max_cost}"));
    }

    #[test]
    fn the_batch_keeps_well_below_luas_200_locals() {
        let locals = top_level_locals(&source("batch").text());
        assert!(
            locals <= 150,
            "the batch script's main chunk has {locals} locals"
        );
    }

    #[test]
    fn a_piece_runs_nothing_but_its_definitions() {
        for (piece, text) in PIECES {
            for line in text.lines() {
                let top_level = line.starts_with(|c: char| !c.is_whitespace());
                assert!(
                    !top_level || ["local ", "end", "--"].iter().any(|s| line.starts_with(s)),
                    "include/{piece}.lua: `{line}` at its top level"
                );
            }
        }
        for (file, text) in PIECES.iter().chain(SCRIPTS) {
            assert!(
                !text.contains("[["),
                "{file}.lua: a long bracket (see `code`)"
            );
            assert!(
                !text.contains("[="),
                "{file}.lua: a long bracket (see `code`)"
            );
        }
    }

    #[test]
    fn every_script_loads_its_pieces_each_once_after_what_they_need() {
        for source in sources() {
            let mut seen = BTreeSet::new();
            for piece in &source.pieces {
                assert!(seen.insert(piece), "{}: {piece} twice", source.name);
                for needed in includes(lookup(PIECES, "piece", piece).1) {
                    assert!(
                        seen.contains(&needed),
                        "{}: {piece} comes before {needed}, which it needs",
                        source.name
                    );
                }
            }
            assert!(source.text().ends_with(&source.body));
            assert!(!source.text().contains("from_rust("), "{}", source.name);
        }
        // Every piece is used by some script.
        let used: BTreeSet<&str> = sources().iter().flat_map(|s| s.pieces.clone()).collect();
        for (piece, _) in PIECES {
            assert!(used.contains(piece), "no script includes {piece}");
        }
    }

    #[test]
    fn every_name_a_script_or_piece_uses_is_defined_by_a_piece_it_includes() {
        let mut problems = Vec::new();
        for (piece, text) in PIECES {
            problems.extend(missing(&format!("include/{piece}.lua"), text, Some(piece)));
            let (defines, declares) = (top_level(text), declared(text));
            if defines != declares {
                problems.push(format!(
                    "include/{piece}.lua defines {defines:?} but its header says {declares:?}"
                ));
            }
        }
        for (script, text) in SCRIPTS {
            problems.extend(missing(&format!("{script}.lua"), text, None));
        }
        // The batch reassigns KEYS and ARGV for each operation: they must be its locals.
        assert!(source("batch").pieces.contains(&"args"));
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn a_missing_include_is_found() {
        let script = "-- @include time\nlocal now = now_us()\nreturn int_arg(1, 0) + now\n";
        assert_eq!(
            missing("test.lua", script, None),
            ["test.lua uses `int_arg` of args without including it"]
        );
        // Through a piece: `terms` needs `limits`, which needs `args`.
        let script = "-- @include terms\nreturn with_spans(limits_arg(1), int_arg(3, -1))\n";
        assert!(missing("test.lua", script, None).is_empty());
        // A method or a field of the same name is not a use.
        assert!(missing("test.lua", "return string.now_us(x.int_arg)\n", None).is_empty());
        // Nor a name the file defines itself.
        assert!(
            missing(
                "test.lua",
                "local function int_arg() end\nint_arg()\n",
                None
            )
            .is_empty()
        );
        // A piece that reads ARGV without `args`.
        assert_eq!(
            missing(
                "include/x.lua",
                "local function f() return ARGV[1] end\n",
                Some("time")
            ),
            ["include/x.lua reads KEYS or ARGV without including args"]
        );
    }

    #[test]
    #[should_panic(expected = "no Lua piece `nowhere`")]
    fn an_unknown_piece_panics() {
        resolve(PIECES, ["args", "nowhere"]);
    }

    #[test]
    #[should_panic(expected = "Lua pieces include each other: a -> b -> a")]
    fn pieces_that_need_each_other_panic() {
        let table = [
            ("a", "-- @include b\nlocal x = 1\n"),
            ("b", "-- @include a\nlocal y = 2\n"),
        ];
        resolve(&table, ["a"]);
    }

    #[test]
    fn a_piece_comes_after_what_it_needs_and_once() {
        let table = [
            ("a", "-- @include b\n-- @include c\n"),
            ("b", "-- @include c\n"),
            ("c", "-- c\n"),
        ];
        assert_eq!(resolve(&table, ["a", "c", "b"]), ["c", "b", "a"]);
    }
}
