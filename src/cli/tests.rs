//! The command line's own rules, checked over every command: each argument has help, a flag
//! read from `TURNSTILE_X` is `--x`, the connection flags go before or after the command,
//! switches take every spelling, the completions and docs/configuration.md agree with it.

use std::collections::{BTreeMap, BTreeSet};

use clap::{Arg, Command, FromArgMatches};

use super::{CONNECTION, Cli, command};

/// The command line, built (global flags propagated), as the binary parses it.
fn built() -> Command {
    let mut cmd = command();
    cmd.build();
    cmd
}

/// Every command of the tree with its path (`["limits", "get"]`), the top level first.
fn commands(cmd: &Command) -> Vec<(Vec<String>, &Command)> {
    let mut out = vec![(Vec::new(), cmd)];
    let mut i = 0;
    while i < out.len() {
        let (path, at) = out[i].clone();
        for sub in at.get_subcommands().filter(|s| s.get_name() != "help") {
            let mut path = path.clone();
            path.push(sub.get_name().to_owned());
            out.push((path, sub));
        }
        i += 1;
    }
    out
}

/// Every argument of every command, with the command's path.
fn arguments(cmd: &Command) -> Vec<(String, &Arg)> {
    commands(cmd)
        .into_iter()
        .flat_map(|(path, c)| {
            c.get_arguments()
                .map(move |a| (format!("turnstile {}", path.join(" ")), a))
        })
        .collect()
}

fn parse(argv: &[&str]) -> Result<Cli, clap::Error> {
    let mut cmd = command();
    let matches =
        cmd.try_get_matches_from_mut(std::iter::once("turnstile").chain(argv.iter().copied()))?;
    super::check_connection_flags(&mut cmd, &matches)?;
    Cli::from_arg_matches(&matches)
}

/// Each leaf command (how many words name it) with the arguments it cannot go without.
const LEAVES: &[(usize, &[&str])] = &[
    (1, &["consume", "--downstream-url", "http://h/{seller_id}"]),
    (1, &["mock-api"]),
    (1, &["publish", "f.csv", "--seller", "S"]),
    (1, &["status"]),
    (1, &["demo"]),
    (2, &["dead-letters", "list"]),
    (2, &["dead-letters", "discard"]),
    (2, &["dead-letters", "replay"]),
    (2, &["limits", "set", "--seller", "S", "--weight", "2"]),
    (2, &["limits", "get", "--seller", "S"]),
    (2, &["limits", "clear", "--seller", "S"]),
    (2, &["limits", "pause", "--seller", "S"]),
    (2, &["limits", "resume", "--seller", "S"]),
    (2, &["limits", "reset", "--seller", "S"]),
    (2, &["bench", "permits"]),
    (2, &["bench", "scenario"]),
    (2, &["bench", "throughput"]),
    (2, &["bench", "faults"]),
    (2, &["bench", "sellers"]),
    (2, &["bench", "eta"]),
    (2, &["bench", "rolling"]),
    (2, &["bench", "routes"]),
    (2, &["bench", "lua-setup"]),
    (2, &["bench", "depth"]),
    (2, &["bench", "give-way"]),
    (2, &["bench", "passes"]),
    (2, &["bench", "supersede"]),
    (2, &["bench", "bulk"]),
    (1, &["completions", "bash"]),
];

#[test]
fn the_command_line_is_well_formed() {
    command().debug_assert();
}

#[test]
fn every_leaf_command_is_listed_and_parses_with_its_defaults() {
    let cmd = built();
    let leaves: BTreeSet<String> = commands(&cmd)
        .into_iter()
        .filter(|(path, c)| !path.is_empty() && !c.has_subcommands())
        .map(|(path, _)| path.join(" "))
        .collect();
    let listed: BTreeSet<String> = LEAVES.iter().map(|(n, l)| l[..*n].join(" ")).collect();
    assert_eq!(leaves, listed, "LEAVES lists every leaf command");
    for (_, leaf) in LEAVES {
        if let Err(error) = parse(leaf) {
            panic!("{leaf:?}: {error}");
        }
    }
    for args in [
        &[
            "consume",
            "--downstream-url",
            "http://h/{seller_id}",
            "--http-addr",
            "off",
        ][..],
        &["--redis-cluster", "limits", "get", "--seller", "S"],
        &["limits", "--redis-cluster", "get", "--seller", "S"],
    ] {
        if let Err(error) = parse(args) {
            panic!("{args:?}: {error}");
        }
    }
}

#[test]
fn a_bad_value_read_from_a_variable_is_named_by_the_variable_and_its_flag() {
    use std::ffi::OsString;
    let consume = ["consume", "--downstream-url", "http://h/{seller_id}"];
    let argv = |extra: &[&str]| -> Vec<OsString> {
        std::iter::once("turnstile")
            .chain(consume)
            .chain(extra.iter().copied())
            .map(OsString::from)
            .collect()
    };
    let refused = |extra: &[&str]| {
        parse(&[&consume[..], extra].concat())
            .map(|_| ())
            .expect_err("a bad value")
    };
    let cases = [
        ("TURNSTILE_WORKERS", "--workers", "x"),
        ("TURNSTILE_ADAPTIVE", "--adaptive", "maybe"),
        ("TURNSTILE_HTTP_ADDR", "--http-addr", "nope"),
        ("TURNSTILE_ALGORITHM", "--algorithm", "foo"),
    ];
    for (variable, flag, value) in cases {
        let set = |v: &str| (v == variable).then(|| OsString::from(value));
        let from_variable = super::naming_the_variable(
            refused(&[&format!("{flag}={value}")]),
            &built(),
            &argv(&[]),
            set,
        )
        .to_string();
        assert!(
            from_variable.contains(&format!(
                "invalid value '{value}' for '{variable} ({flag})'"
            )),
            "{from_variable}"
        );
        for given in [&[flag, value][..], &[&format!("{flag}={value}")]] {
            let from_flag =
                super::naming_the_variable(refused(given), &built(), &argv(given), set).to_string();
            assert!(
                from_flag.contains(&format!("invalid value '{value}' for '{flag}"))
                    && !from_flag.contains(variable),
                "{from_flag}"
            );
        }
    }
}

#[test]
fn every_argument_has_help() {
    let cmd = built();
    let missing: Vec<String> = arguments(&cmd)
        .into_iter()
        .filter(|(_, a)| {
            a.get_help().is_none_or(|h| h.to_string().trim().is_empty())
                && a.get_long_help()
                    .is_none_or(|h| h.to_string().trim().is_empty())
        })
        .map(|(at, a)| format!("{at}: {}", a.get_id()))
        .collect();
    assert!(
        missing.is_empty(),
        "arguments without help:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_command_has_an_about() {
    let cmd = built();
    let missing: Vec<String> = commands(&cmd)
        .into_iter()
        .filter(|(_, c)| c.get_about().is_none())
        .map(|(path, _)| path.join(" "))
        .collect();
    assert!(missing.is_empty(), "commands without about: {missing:?}");
}

/// The long flag of a `TURNSTILE_*` variable: `TURNSTILE_LIMIT_GUARD` -> `limit-guard`.
fn derived_long(env: &str) -> Option<String> {
    env.strip_prefix("TURNSTILE_")
        .map(|name| name.to_ascii_lowercase().replace('_', "-"))
}

#[test]
fn every_flag_read_from_a_variable_is_named_after_it() {
    // No exception: the contract forces none.
    let cmd = built();
    let mut wrong = Vec::new();
    for (at, a) in arguments(&cmd) {
        let Some(env) = a.get_env() else { continue };
        let env = env.to_string_lossy();
        let derived = derived_long(&env);
        if derived.is_none() || a.get_long() != derived.as_deref() {
            wrong.push(format!(
                "{at}: {env} is --{}",
                a.get_long().unwrap_or("(none)")
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// What must be equal wherever one variable is read: its flag, default, value, parsing and
/// help (it is declared once, see tests/cli_settings.rs).
fn shape(a: &Arg) -> String {
    format!(
        "--{} default {:?} values {:?} {:?} {:?} possible {:?} hidden env values {} help {:?} {:?}",
        a.get_long().unwrap_or(""),
        a.get_default_values(),
        a.get_value_names(),
        a.get_num_args(),
        a.get_action(),
        a.get_possible_values()
            .iter()
            .map(|v| v.get_name().to_owned())
            .collect::<Vec<_>>(),
        a.is_hide_env_values_set(),
        a.get_help().map(ToString::to_string),
        a.get_long_help().map(ToString::to_string),
    )
}

#[test]
fn a_variable_read_by_several_commands_is_the_same_flag_in_each() {
    let cmd = built();
    let mut seen: BTreeMap<String, (String, String)> = BTreeMap::new();
    for (at, a) in arguments(&cmd) {
        let Some(env) = a.get_env() else { continue };
        let env = env.to_string_lossy().into_owned();
        let shape = shape(a);
        match seen.get(&env) {
            Some((first_at, first)) => {
                assert_eq!(&shape, first, "{env}: {at} differs from {first_at}")
            }
            None => {
                seen.insert(env, (at, shape));
            }
        }
    }
}

#[test]
fn the_connection_flags_are_global_wherever_a_command_defines_them() {
    let cmd = command();
    for (path, c) in commands(&cmd) {
        for a in c
            .get_arguments()
            .filter(|a| CONNECTION.contains(&a.get_id().as_str()))
        {
            // The top level's are not (a command that uses none does not list them); every
            // other definition is, so that clap hands it the value given before the command.
            assert_eq!(
                a.is_global_set(),
                !path.is_empty(),
                "{path:?}: {}",
                a.get_id()
            );
        }
    }
    let top: BTreeSet<&str> = cmd.get_arguments().map(|a| a.get_id().as_str()).collect();
    assert!(CONNECTION.iter().all(|id| top.contains(id)), "{top:?}");
}

/// The value of `id` at every level of the parsed command line, top first.
fn values_along(argv: &[&str], id: &str) -> Result<Vec<Option<String>>, clap::Error> {
    let mut cmd = command();
    let matches =
        cmd.try_get_matches_from_mut(std::iter::once("turnstile").chain(argv.iter().copied()))?;
    super::check_connection_flags(&mut cmd, &matches)?;
    let mut out = Vec::new();
    let mut at = Some(&matches);
    while let Some(m) = at {
        let value = m
            .try_get_raw(id)
            .ok()
            .flatten()
            .map(|mut v| v.next().unwrap().to_string_lossy().into_owned());
        out.push(value);
        at = m.subcommand().map(|(_, sub)| sub);
    }
    Ok(out)
}

#[test]
fn a_connection_flag_goes_before_or_after_the_command_that_uses_it() {
    let cmd = built();
    let given = [
        ("amqp_url", "--amqp-url", "amqp://u:p@broker:5672/v"),
        ("queue", "--queue", "q-given"),
        ("redis_url", "--redis-url", "redis://given:6380/"),
        ("redis_cluster", "--redis-cluster", "yes"),
        ("key_prefix", "--key-prefix", "kp-given"),
    ];
    let mut used = BTreeMap::new();
    for &(depth, leaf) in LEAVES {
        let mut leaf_cmd = &cmd;
        for name in &leaf[..depth] {
            leaf_cmd = leaf_cmd.find_subcommand(name).unwrap();
        }
        for (id, flag, value) in given {
            let uses = leaf_cmd.get_arguments().any(|a| a.get_id() == id);
            let before: Vec<&str> = [flag, value]
                .into_iter()
                .chain(leaf.iter().copied())
                .collect();
            let after: Vec<&str> = leaf.iter().copied().chain([flag, value]).collect();
            let between: Vec<&str> = leaf[..1]
                .iter()
                .copied()
                .chain([flag, value])
                .chain(leaf[1..].iter().copied())
                .collect();
            // Between a command and its action where the command itself takes it (`limits`,
            // `dead-letters`; `bench`'s measurements each take their own).
            let top = cmd.find_subcommand(leaf[0]).unwrap();
            let mid_uses = top.get_arguments().any(|a| a.get_id() == id);
            let places = if depth == 2 && !mid_uses {
                vec![&before, &after]
            } else {
                vec![&before, &after, &between]
            };
            for argv in places {
                match values_along(argv, id) {
                    Ok(values) if uses => assert!(
                        // Every level that defines it has it (the top one too).
                        values.last().unwrap().as_deref() == Some(value)
                            && values[0].as_deref() == Some(value)
                            && values.iter().flatten().all(|v| v == value),
                        "{argv:?}: {id} is {values:?}"
                    ),
                    Ok(values) => {
                        panic!("{argv:?} is accepted ({values:?}), but does not use {flag}")
                    }
                    Err(error) if uses => panic!("{argv:?}: {error}"),
                    Err(_) => {}
                }
            }
            if uses {
                used.entry(leaf[..depth].join(" "))
                    .or_insert_with(Vec::new)
                    .push(flag);
            }
        }
    }
    // Which command uses which: a command lists only the connection flags it reads.
    let all = [
        "--amqp-url",
        "--queue",
        "--redis-url",
        "--redis-cluster",
        "--key-prefix",
    ];
    let redis = &all[2..];
    let amqp_redis = [
        "--amqp-url",
        "--redis-url",
        "--redis-cluster",
        "--key-prefix",
    ];
    let expected: BTreeMap<String, Vec<&str>> = [
        ("consume", &all[..]),
        ("publish", &all),
        ("status", redis),
        ("demo", &amqp_redis),
        ("dead-letters list", &all[..2]),
        ("dead-letters replay", &all),
        ("dead-letters discard", &all),
        ("limits set", redis),
        ("limits get", redis),
        ("limits clear", redis),
        ("limits pause", redis),
        ("limits resume", redis),
        ("limits reset", redis),
        ("bench permits", redis),
        ("bench scenario", &amqp_redis),
        ("bench throughput", &amqp_redis),
        ("bench faults", &all[..1]),
        ("bench sellers", &all[..1]),
        ("bench eta", &amqp_redis),
        ("bench rolling", &amqp_redis),
        ("bench routes", &amqp_redis),
        ("bench supersede", &amqp_redis),
        ("bench bulk", &amqp_redis),
        ("bench depth", redis),
        ("bench lua-setup", redis),
        ("bench give-way", redis),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_vec()))
    .collect();
    assert_eq!(used, expected);
}

#[test]
fn the_parsed_settings_take_the_connection_flags_from_either_place() {
    for argv in [
        &[
            "--key-prefix",
            "kp",
            "--redis-url",
            "redis://h:1/",
            "limits",
            "get",
            "--seller",
            "S",
        ][..],
        &[
            "limits",
            "get",
            "--seller",
            "S",
            "--key-prefix",
            "kp",
            "--redis-url",
            "redis://h:1/",
        ],
        &[
            "limits",
            "--key-prefix",
            "kp",
            "get",
            "--redis-url",
            "redis://h:1/",
            "--seller",
            "S",
        ],
    ] {
        let Ok(Cli {
            command: super::Command::Limits(args),
            ..
        }) = parse(argv)
        else {
            panic!("{argv:?}")
        };
        assert_eq!(
            (args.redis.key_prefix.as_str(), args.redis.url.as_str()),
            ("kp", "redis://h:1/")
        );
    }
    for argv in [
        &[
            "--queue",
            "q",
            "--amqp-url",
            "amqp://h:1/v",
            "consume",
            "--downstream-url",
            "http://h/",
        ][..],
        &[
            "consume",
            "--downstream-url",
            "http://h/",
            "--queue",
            "q",
            "--amqp-url",
            "amqp://h:1/v",
        ],
    ] {
        let Ok(Cli {
            command: super::Command::Consume(args),
            ..
        }) = parse(argv)
        else {
            panic!("{argv:?}")
        };
        assert_eq!(
            (
                args.consume.broker.queue.name.as_str(),
                args.consume.broker.amqp.url.as_str()
            ),
            ("q", "amqp://h:1/v")
        );
    }
    // Given in both places, the later (the command's own) wins.
    let Ok(Cli {
        command: super::Command::Status(args),
        ..
    }) = parse(&["--key-prefix", "first", "status", "--key-prefix", "second"])
    else {
        panic!()
    };
    assert_eq!(args.redis.key_prefix, "second");
    let refused = parse(&["--queue", "q", "status"]).unwrap_err().to_string();
    assert!(
        refused.contains("`turnstile status` does not use --queue"),
        "{refused}"
    );
}

/// The spellings of a switch and what they mean.
const SPELLINGS: [(&str, bool); 10] = [
    ("on", true),
    ("off", false),
    ("true", true),
    ("false", false),
    ("1", true),
    ("0", false),
    ("yes", true),
    ("no", false),
    ("OFF", false),
    ("Yes", true),
];

#[test]
fn every_switch_takes_on_off_true_false_1_0_yes_no_in_each_form() {
    let consume = ["consume", "--downstream-url", "http://h/"];
    let switches = |cli: Cli| match cli.command {
        super::Command::Consume(args) => vec![
            ("--adaptive", args.consume.limiter.adaptive),
            ("--redis-durable", args.consume.limiter.redis_durable),
            ("--allow-eviction", args.consume.allow_eviction),
            ("--allow-stricter-terms", args.consume.allow_stricter_terms),
            ("--redis-cluster", args.consume.redis.cluster),
        ],
        super::Command::Status(args) => vec![
            ("--adaptive", args.terms.adaptive),
            ("--redis-cluster", args.redis.cluster),
        ],
        super::Command::Bench {
            which: turnstile_lab::bench::BenchCommand::Scenario(args),
        } => vec![
            ("--adaptive", args.adaptive),
            ("--redis-cluster", args.rig.redis.cluster),
        ],
        other => panic!("{other:?}"),
    };
    let cases: [(&[&str], &[&str]); 3] = [
        (
            &consume,
            &[
                "--adaptive",
                "--redis-durable",
                "--allow-eviction",
                "--allow-stricter-terms",
                "--redis-cluster",
            ],
        ),
        (&["status"], &["--adaptive", "--redis-cluster"]),
        (&["bench", "scenario"], &["--adaptive", "--redis-cluster"]),
    ];
    let mut tested = BTreeSet::new();
    for (command, flags) in cases {
        for (spelling, on) in SPELLINGS {
            let spaced: Vec<String> = flags
                .iter()
                .flat_map(|f| [f.to_string(), spelling.to_owned()])
                .collect();
            let joined: Vec<String> = flags.iter().map(|f| format!("{f}={spelling}")).collect();
            for given in [spaced, joined] {
                let argv: Vec<&str> = command
                    .iter()
                    .copied()
                    .chain(given.iter().map(String::as_str))
                    .collect();
                let cli = parse(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
                for (flag, value) in switches(cli) {
                    assert_eq!(value, on, "{argv:?}: {flag}");
                }
            }
        }
        // Alone, a switch is on.
        let argv: Vec<&str> = command.iter().chain(flags.iter()).copied().collect();
        for (flag, value) in switches(parse(&argv).unwrap()) {
            assert!(value, "{argv:?}: {flag}");
        }
        tested.extend(flags.iter().map(|f| f.to_string()));
        assert!(parse(&[command, &[flags[0], "maybe"]].concat()).is_err());
    }
    // Before a subcommand, a switch alone does not take the subcommand's name as its value.
    assert!(parse(&["--redis-cluster", "status"]).is_ok());
    // Every switch of the command line is one of those.
    let cmd = built();
    let switches: BTreeSet<String> = arguments(&cmd)
        .into_iter()
        .filter(|(_, a)| {
            let names: Vec<String> = a
                .get_possible_values()
                .iter()
                .map(|v| v.get_name().to_owned())
                .collect();
            names == ["on", "off"]
        })
        .filter_map(|(_, a)| Some(format!("--{}", a.get_long()?)))
        .collect();
    assert_eq!(switches, tested);
    // Every other flag that takes a yes or no is a plain flag: present or not.
    let plain: Vec<String> = arguments(&cmd)
        .into_iter()
        .filter(|(_, a)| {
            a.get_env().is_some()
                && matches!(
                    a.get_action(),
                    clap::ArgAction::SetTrue | clap::ArgAction::SetFalse
                )
        })
        .map(|(at, a)| format!("{at}: {}", a.get_id()))
        .collect();
    assert!(
        plain.is_empty(),
        "on/off settings that are not switches: {plain:?}"
    );
}

#[test]
fn the_bash_completions_know_the_commands() {
    let mut out = Vec::new();
    super::completions::script(clap_complete::Shell::Bash, &mut command(), &mut out);
    let script = String::from_utf8(out).unwrap();
    for word in [
        "limits",
        "dead-letters",
        "--key-prefix",
        "--limit-guard",
        "completions",
    ] {
        assert!(script.contains(word), "{word}");
    }
    for shell in [clap_complete::Shell::Zsh, clap_complete::Shell::Fish] {
        let mut out = Vec::new();
        super::completions::script(shell, &mut command(), &mut out);
        assert!(
            String::from_utf8(out).unwrap().contains("limits"),
            "{shell}"
        );
    }
}

#[test]
fn no_help_cites_an_issue_or_an_earlier_version() {
    let cmd = built();
    let mut texts: Vec<(String, String)> = Vec::new();
    for (path, c) in commands(&cmd) {
        for text in [
            c.get_about(),
            c.get_long_about(),
            c.get_after_help(),
            c.get_after_long_help(),
        ]
        .into_iter()
        .flatten()
        {
            texts.push((path.join(" "), text.to_string()));
        }
        for a in c.get_arguments() {
            for text in [a.get_help(), a.get_long_help()].into_iter().flatten() {
                texts.push((
                    format!("{} {}", path.join(" "), a.get_id()),
                    text.to_string(),
                ));
            }
            for v in a.get_possible_values() {
                if let Some(help) = v.get_help() {
                    texts.push((
                        format!("{} {}", path.join(" "), a.get_id()),
                        help.to_string(),
                    ));
                }
            }
        }
    }
    for (at, text) in texts {
        let lower = text.to_ascii_lowercase();
        let cites_issue = text
            .match_indices('#')
            .any(|(i, _)| text[i + 1..].starts_with(|c: char| c.is_ascii_digit()));
        assert!(
            !cites_issue
                && !lower.contains("older turnstile")
                && !lower.contains("earlier version")
                && !lower.contains("older version")
                && !lower.contains("issue "),
            "{at}: {text}"
        );
    }
}

/// docs/configuration.md.
fn configuration_doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_configuration_doc_lists_every_dead_letter_reason_a_reason_flag_takes() {
    let doc = configuration_doc();
    let row = doc
        .lines()
        .find(|l| l.contains("| `--reason` |"))
        .expect("docs/configuration.md has a `--reason` row");
    for reason in turnstile_core::broker::dead_letters::Reason::ALL {
        assert!(
            row.contains(&format!("`{reason}`")),
            "{reason} is missing: {row}"
        );
    }
}

#[test]
fn the_configuration_doc_says_operator_commands_read_the_fleets_terms_from_redis() {
    let doc = configuration_doc();
    let section = doc
        .split("## Operator commands")
        .nth(1)
        .and_then(|s| s.split("### ").next())
        .expect("docs/configuration.md has an Operator commands section");
    assert!(
        section.contains("fleet's terms") && section.contains("Redis"),
        "{section}"
    );
    assert!(
        !section.contains("set them as the replicas have them"),
        "{section}"
    );
}

/// The variables read beside the flags (not by clap), as docs/configuration.md lists them.
const READ_BESIDE_FLAGS: [&str; 2] = ["TURNSTILE_LOG_FORMAT", "RUST_LOG"];

/// The rows of the doc's variable tables: variable -> (flag, default) as written.
fn variable_rows(doc: &str) -> BTreeMap<String, (String, String)> {
    let mut rows = BTreeMap::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // `| NAME | flag | default | meaning |` splits into ["", NAME, flag, default, ...].
        if cells.len() < 6 || !(cells[1].starts_with("TURNSTILE_") || cells[1] == "RUST_LOG") {
            continue;
        }
        let previous = rows.insert(
            cells[1].to_owned(),
            (cells[2].to_owned(), cells[3].to_owned()),
        );
        assert!(previous.is_none(), "{} is listed twice", cells[1]);
    }
    rows
}

/// A default as the doc states it: `` `x` `` is the value x; anything else is prose.
fn stated(cell: &str) -> Option<&str> {
    cell.strip_prefix('`')?
        .strip_suffix('`')
        .filter(|v| !v.contains('`'))
}

#[test]
fn the_configuration_doc_lists_every_setting_of_consume_as_the_command_line_has_it() {
    let doc = configuration_doc();
    let rows = variable_rows(&doc);
    let cmd = built();
    let consume = cmd.find_subcommand("consume").unwrap();
    let mut wrong = Vec::new();
    for a in consume.get_arguments() {
        let Some(env) = a.get_env() else { continue };
        let env = env.to_string_lossy().into_owned();
        let Some((flag, default)) = rows.get(&env) else {
            wrong.push(format!("{env} is not in the doc"));
            continue;
        };
        let long = format!("`--{}`", a.get_long().unwrap_or_default());
        if *flag != long {
            wrong.push(format!(
                "{env}: the doc says {flag}, the command line {long}"
            ));
        }
        let defaults: Vec<String> = a
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        match (defaults.is_empty(), stated(default)) {
            (false, Some(value)) if value == defaults.join(",") => {}
            (true, None) => {}
            (_, said) => wrong.push(format!(
                "{env}: the doc's default is {default:?} ({said:?}), the command line's {defaults:?}"
            )),
        }
    }
    // Every variable of the doc is one turnstile reads, with its flag.
    let mut by_env: BTreeMap<String, String> = BTreeMap::new();
    for (_, a) in arguments(&cmd) {
        if let (Some(env), Some(long)) = (a.get_env(), a.get_long()) {
            by_env.insert(env.to_string_lossy().into_owned(), format!("`--{long}`"));
        }
    }
    for (env, (flag, _)) in &rows {
        match by_env.get(env) {
            Some(long) if long == flag => {}
            Some(long) => wrong.push(format!(
                "{env}: the doc says {flag}, the command line {long}"
            )),
            None if READ_BESIDE_FLAGS.contains(&env.as_str()) && flag == "—" => {}
            None => wrong.push(format!("{env} is in the doc but no flag reads it")),
        }
    }
    let mentioned: BTreeSet<&str> = doc
        .match_indices("TURNSTILE_")
        .map(|(i, _)| {
            let rest = &doc[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|name| name.len() > "TURNSTILE_".len())
        .collect();
    for name in mentioned {
        if !by_env.contains_key(name) && !READ_BESIDE_FLAGS.contains(&name) {
            wrong.push(format!(
                "the doc mentions {name}, which turnstile does not read"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/configuration.md:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_configuration_doc_lists_every_flag_of_the_operator_commands() {
    let doc = configuration_doc();
    let cmd = built();
    let connection: BTreeSet<String> = cmd
        .find_subcommand("consume")
        .unwrap()
        .get_arguments()
        .filter(|a| a.get_help_heading() == Some("Connection"))
        .filter_map(|a| Some(format!("--{}", a.get_long()?)))
        .collect();
    let mut wrong = Vec::new();
    for name in ["publish", "status", "limits", "dead-letters"] {
        let heading = format!("### `turnstile {name}");
        let Some(start) = doc.find(&heading) else {
            wrong.push(format!("no section {heading}`"));
            continue;
        };
        let section = &doc[start..];
        let section = &section[..section[4..]
            .find("\n#")
            .map_or(section.len(), |end| end + 4)];
        for (_, c) in commands(cmd.find_subcommand(name).unwrap()) {
            for a in c.get_arguments() {
                if a.get_id() == "help" {
                    continue;
                }
                let word = match a.get_long() {
                    Some(long) => format!("--{long}"),
                    None => a.get_value_names().unwrap()[0].to_string(),
                };
                if !connection.contains(&word) && !section.contains(&format!("`{word}`")) {
                    wrong.push(format!("turnstile {name}: {word} is not in its section"));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/configuration.md:\n{}",
        wrong.join("\n")
    );
}
