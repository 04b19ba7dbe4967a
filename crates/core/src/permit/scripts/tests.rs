//! The scripts as put together: every name defined before use, the constants Rust and Lua
//! both keep equal, the completion record's transitions, sizes.

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
            piece("reservations"),
            "SLOW_LINK_LATE",
            crate::permit::SLOW_LINK_LATENESS.as_micros() as u64,
        ),
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
        let arg = crate::permit::terms::Terms::guard_arg_of(guard);
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
            .map(|w| crate::config::guard_for(guard, Duration::from_micros(*w)).as_micros() as u64)
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

#[test]
fn every_script_is_among_those_a_replica_loads_at_start() {
    let loaded: BTreeSet<String> = every()
        .iter()
        .map(|script| script.get_hash().to_owned())
        .collect();
    for (name, _) in SCRIPTS {
        let hash = Script::new(&source(name).text()).get_hash().to_owned();
        assert!(loaded.contains(&hash), "{name} is not loaded at start");
    }
    assert_eq!(loaded.len(), every().len(), "no script twice");
}
