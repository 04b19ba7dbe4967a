//! The permit engine against standalone Redis, and the `limits` command.
mod support;

use std::process::Command;

use support::{Backend, run, unique};

permit_tests!(Backend::Standalone);

#[test]
fn limits_set_get_clear_from_the_command_line() {
    let prefix = unique("cli");
    let turnstile = |args: &[&str]| {
        run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(args)
            .env("TURNSTILE_KEY_PREFIX", &prefix)
            .env("TURNSTILE_LIMIT", "100/1m"))
    };
    let (code, out, _) = turnstile(&["limits", "set", "--seller", "S-9", "--limit", "500/1m"]);
    assert_eq!((code, out.trim()), (0, "S-9: 500/1m (override)"));
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-9"]);
    assert_eq!((code, out.trim()), (0, "S-9: 500/1m (override)"));
    let (code, out, _) = turnstile(&["limits", "clear", "--seller", "S-9"]);
    assert_eq!(
        (code, out.trim()),
        (0, "S-9: override cleared; 100/1m (default) applies")
    );
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-9"]);
    assert_eq!((code, out.trim()), (0, "S-9: 100/1m (default)"));
    // The commands wrote the seller's keys and the shared reschedule log: leave nothing.
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let args = support::redis_args(&support::redis_url(), &prefix);
        let conn = turnstile_core::permit::RedisConn::connect(&args)
            .await
            .unwrap();
        turnstile_core::permit::delete_prefix(&conn, &prefix)
            .await
            .unwrap();
    });
}

#[test]
fn malformed_limits_are_refused_with_a_clear_error() {
    for (limit, expected) in [
        ("0/1s", "count"),
        ("abc", "COUNT/DURATION"),
        ("10/0s", "duration"),
    ] {
        let (code, _, err) = run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["limits", "set", "--seller", "S", "--limit", limit]));
        assert_eq!(code, 2, "{limit}: {err}");
        assert!(err.contains(expected), "{limit}: {err}");
    }
    let (code, _, err) = run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["limits", "get", "--seller", "S"])
        .env("TURNSTILE_LIMIT", "5/1y"));
    assert_eq!(code, 2);
    assert!(
        err.contains("TURNSTILE_LIMIT") || err.contains("--limit"),
        "{err}"
    );
}
