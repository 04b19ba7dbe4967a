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
    assert_eq!((code, first_line(&out)), (0, "S-9: 500/1m (override)"));
    assert!(
        out.contains("500/1m     0 of 500 units taken now, 0 ahead"),
        "{out}"
    );
    let (code, out, _) = turnstile(&[
        "limits",
        "set",
        "--seller",
        "S-9",
        "--limit",
        "500/1h,10/1s",
    ]);
    assert_eq!((code, out.trim()), (0, "S-9: 10/1s,500/1h (override)"));
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-9"]);
    assert_eq!(
        (code, first_line(&out)),
        (0, "S-9: 10/1s,500/1h (override)")
    );
    assert!(out.contains("10/1s      0 of 10 units taken now"), "{out}");
    assert!(
        out.contains("500/1h     0 of 500 units taken now, 0 ahead  <- binds now"),
        "{out}"
    );
    let (code, out, _) = turnstile(&["limits", "set", "--seller", "S-9", "--weight", "5"]);
    assert_eq!((code, out.trim()), (0, "S-9: weight 5"));
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-9"]);
    assert_eq!(
        (code, first_line(&out)),
        (0, "S-9: 10/1s,500/1h (override), weight 5")
    );
    let (code, _, err) = turnstile(&["limits", "set", "--seller", "S-9", "--weight", "0"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = turnstile(&["limits", "set", "--seller", "S-9"]);
    assert_eq!(code, 2, "a limit or a weight is needed: {err}");
    let (code, out, _) = turnstile(&["limits", "set", "--seller", "S-9", "--weight", "1"]);
    assert_eq!((code, out.trim()), (0, "S-9: weight 1"));
    let (code, out, _) = turnstile(&["limits", "clear", "--seller", "S-9"]);
    assert_eq!(
        (code, out.trim()),
        (0, "S-9: override cleared; 100/1m (default) applies")
    );
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-9"]);
    assert_eq!((code, first_line(&out)), (0, "S-9: 100/1m (default)"));
    // A reset forgets the limiter state behind a pause of one window (60 s; sliding-window
    // adds no guard).
    let (code, out, err) = turnstile(&["limits", "reset", "--seller", "S-9"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("S-9: limiter state forgotten; paused for 60.0s"),
        "{out}"
    );
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-9"]);
    assert_eq!(code, 0);
    assert!(out.contains("paused"), "{out}");
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
fn limits_get_shows_the_learned_limit_and_a_shadow_limits_verdicts() {
    use support::asks::{self, call_now};
    use turnstile_core::config::{Algorithm, Limits};
    use turnstile_core::domain::{RateLimitHeaders, SellerId};
    use turnstile_core::permit::Ask;
    let prefix = unique("cli-adaptive");
    let turnstile = |args: &[&str]| {
        run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(args)
            .env("TURNSTILE_KEY_PREFIX", &prefix)
            .env("TURNSTILE_LIMIT", "20/1m"))
    };
    let (code, out, _) = turnstile(&[
        "limits", "set", "--seller", "S-7", "--limit", "2/1m", "--shadow",
    ]);
    assert_eq!(
        (code, out.trim()),
        (0, "S-7: 2/1m (shadow: judged, not enforced)")
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let conn = runtime.block_on(async {
        let args = support::redis_args(&support::redis_url(), &prefix);
        turnstile_core::permit::RedisConn::connect(&args)
            .await
            .unwrap()
    });
    let store = turnstile_core::permit::PermitStore::new(
        conn.clone(),
        &prefix,
        support::limiter("20/1m", Algorithm::SlidingWindow),
    );
    let s = SellerId::parse("S-7").unwrap();
    runtime.block_on(async {
        let mut calls = Vec::new();
        for _ in 0..3 {
            calls.push(call_now(&store, Ask::new(&s).without_reserving()).await);
        }
        let told = RateLimitHeaders {
            limit: Some(8),
            ..RateLimitHeaders::default()
        };
        let last = calls.last().unwrap();
        asks::finish(&store, last, last.granted_us, asks::registered(Some(told))).await;
    });
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-7"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        first_line(&out).starts_with("S-7: 20/1m (default), learned 8/1m (header "),
        "{out}"
    );
    assert!(out.contains("from 20/1m)"), "{out}");
    assert!(out.contains("8/1m       3 of 8 units taken now"), "{out}");
    assert!(
        out.contains("shadow 2/1m: agreed 2, would have held back 1 (by "),
        "{out}"
    );
    assert_eq!(
        runtime
            .block_on(store.admin().learned(&s))
            .unwrap()
            .unwrap()
            .limit,
        "8/1m".parse::<Limits>().unwrap()
    );
    let (code, out, _) = turnstile(&["limits", "clear", "--seller", "S-7", "--shadow"]);
    assert_eq!((code, out.trim()), (0, "S-7: shadow limit cleared"));
    let (code, out, _) = turnstile(&["limits", "get", "--seller", "S-7"]);
    assert!(code == 0 && !out.contains("shadow"), "{out}");
    let (code, _, err) = turnstile(&["limits", "set", "--seller", "S-7", "--shadow"]);
    assert_eq!(code, 2, "--shadow needs --limit: {err}");
    runtime.block_on(async {
        turnstile_core::permit::delete_prefix(&conn, &prefix)
            .await
            .unwrap();
    });
}

fn first_line(out: &str) -> &str {
    out.lines().next().unwrap_or_default()
}

#[test]
fn malformed_limits_are_refused_with_a_clear_error() {
    for (limit, expected) in [
        ("0/1s", "count"),
        ("abc", "COUNT/DURATION"),
        ("10/0s", "duration"),
        ("10/1s,20/1s", "same window"),
        (
            "1/1s,2/2s,3/3s,4/4s,5/5s,6/6s,7/7s,8/8s,9/9s",
            "1 to 8 limits",
        ),
    ] {
        let (code, _, err) = run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["limits", "set", "--seller", "S", "--limit", limit]));
        assert_eq!(code, 2, "{limit}: {err}");
        assert!(err.contains(expected), "{limit}: {err}");
    }
    // A bucket capacity applies to one limit: with a stack it is refused, at start too.
    for args in [
        &["limits", "set", "--seller", "S", "--limit", "6/1s,20/5s"][..],
        &["consume"],
    ] {
        let (code, _, err) = run(Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(args)
            .env("TURNSTILE_LIMIT", "6/1s,20/5s")
            .env("TURNSTILE_ALGORITHM", "token-bucket")
            .env("TURNSTILE_BUCKET_CAPACITY", "10")
            .env("TURNSTILE_HTTP_ADDR", "off")
            .env("TURNSTILE_DOWNSTREAM_URL", "http://127.0.0.1:1/{seller_id}"));
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains("unset the capacity"), "{args:?}: {err}");
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

/// Every Lua script loads (SCRIPT LOAD), and its pieces run on their own: they define helpers
/// and touch nothing (see `permit::scripts`).
#[test]
fn every_lua_script_loads() {
    let mut conn = redis::Client::open(support::redis_url())
        .unwrap()
        .get_connection()
        .unwrap();
    for source in turnstile_core::permit::scripts::sources() {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source.text())
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("{}.lua: {e}", source.name));
        assert_eq!(sha.len(), 40, "{}", source.name);
        let one: i64 = redis::cmd("EVAL")
            .arg(format!("{}\nreturn 1", source.setup))
            .arg(0)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("{}.lua's pieces: {e}", source.name));
        assert_eq!(one, 1, "{}", source.name);
    }
}

/// A seller's far queue (callers a full reserved set turns away, told when to come back) paced
/// under a slow window starts afresh under a faster one (the fleet's terms raised): a caller
/// under the new terms is told to come back at the new pace, not behind tickets told under the
/// old one.
#[tokio::test]
async fn a_far_queue_told_under_a_slower_window_starts_afresh_under_a_faster_one() {
    use std::time::Duration;
    use support::asks::decide;
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::SellerId;
    use turnstile_core::permit::{Ask, Decision};
    let keys = support::Keys::new(Backend::Standalone, "far-pace").await;
    let seller = SellerId::parse("S-far").unwrap();
    let slow = keys.store(support::limiter("3072/1h", Algorithm::SlidingWindow));
    let far_ticket = |decision: Decision| match decision {
        Decision::Wait {
            retry_after,
            reservation: None,
        } => Some(retry_after),
        _ => None,
    };
    // 3,072 granted, 3,072 reserved, then more than 3,072 told far: the far queue moves one
    // window (an hour) on.
    let mut slow_ticket = None;
    for _ in 0..3072 * 3 + 100 {
        if let Some(ticket) = far_ticket(decide(&slow, Ask::new(&seller)).await) {
            slow_ticket = Some(ticket);
        }
    }
    let slow_ticket = slow_ticket.expect("a far ticket under the slow window");
    // The same seller under 3,072/30m: no room before its grants leave the window, and its
    // reserved set is still full, so it is told far, at the new pace from the first slot, not
    // behind the slow queue's tickets.
    let fast = keys.store(support::limiter("3072/30m", Algorithm::SlidingWindow));
    let fast_ticket = far_ticket(decide(&fast, Ask::new(&seller)).await)
        .expect("the reserved set is still full: a far ticket");
    println!("far tickets: under 3072/1h {slow_ticket:?}, then under 3072/30m {fast_ticket:?}");
    assert!(
        slow_ticket > Duration::from_secs(7000),
        "the slow queue moved on: {slow_ticket:?}"
    );
    assert!(
        fast_ticket + Duration::from_secs(1800) < slow_ticket,
        "the far queue kept the slow pace: {fast_ticket:?} after {slow_ticket:?}"
    );
    keys.cleanup().await;
}

/// gcra's state written under a looser stack and read under a far stricter one (a visiting
/// 1/1d): the calls made count in the new window, and the wait is one new window at most, not
/// the old schedule's cells spaced at the new interval (five calls under 20/1s would be five
/// days under 1/1d).
#[tokio::test]
async fn gcra_under_a_stricter_stack_counts_the_calls_made_and_waits_one_window_at_most() {
    use std::time::Duration;
    use support::asks::decide;
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::SellerId;
    use turnstile_core::permit::{Ask, Decision};
    let keys = support::Keys::new(Backend::Standalone, "gcra-lowered").await;
    let seller = SellerId::parse("S-gcra-lowered").unwrap();
    let loose = keys.store(support::limiter("20/1s", Algorithm::Gcra));
    for caller in 0..5 {
        let decision = decide(&loose, Ask::new(&seller)).await;
        assert!(
            matches!(decision, Decision::Granted { .. } | Decision::Wait { .. }),
            "caller {caller} under 20/1s: {decision:?}"
        );
    }
    let strict = keys.store(support::limiter("1/1d", Algorithm::Gcra));
    let decision = decide(&strict, Ask::new(&seller)).await;
    let back = match &decision {
        Decision::Wait { retry_after, .. } | Decision::Deferred { retry_after, .. } => *retry_after,
        other => panic!("under 1/1d after a call in its window: {other:?}"),
    };
    println!("under 1/1d after 5 calls under 20/1s: told to come back in {back:?}");
    let day = Duration::from_secs(86_400);
    assert!(
        back > day - Duration::from_secs(60),
        "the call made under 20/1s counts in the day: {decision:?}"
    );
    assert!(
        back <= day + Duration::from_secs(3),
        "one window (+ its guard) at most: {decision:?}"
    );
    keys.cleanup().await;
}

/// A slot reserved far ahead under a slower window (a visiting replica's 1/1d) holds back no
/// caller under a faster one (the fleet's terms raised when it left), whatever the algorithm:
/// callers under the new terms take the room the new window leaves now, before that slot, not a
/// place after it.
#[tokio::test]
async fn a_slot_reserved_far_ahead_under_a_slower_window_holds_back_no_caller_under_a_faster_one() {
    use std::time::Duration;
    use support::asks::decide;
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::SellerId;
    use turnstile_core::permit::{Ask, Decision};
    let keys = support::Keys::new(Backend::Standalone, "far-slot").await;
    let told_to_come_back = |decision: &Decision| match decision {
        Decision::Granted { .. } => Some(Duration::ZERO),
        Decision::Wait { retry_after, .. } | Decision::Deferred { retry_after, .. } => {
            Some(*retry_after)
        }
        _ => None,
    };
    for algorithm in [
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
        Algorithm::TokenBucket,
        Algorithm::FixedWindow,
    ] {
        let seller = SellerId::parse(&format!("S-far-slot-{algorithm}")).unwrap();
        let slow = keys.store(support::limiter("1/1d", algorithm));
        let first = decide(&slow, Ask::new(&seller)).await;
        assert!(
            matches!(first, Decision::Granted { .. }),
            "{algorithm}: the first call under 1/1d: {first:?}"
        );
        // The next is told a day (fixed-window: until the next UTC day): a slot reserved that
        // far ahead, or (beyond the reserve horizon) come back then.
        let second = decide(&slow, Ask::new(&seller)).await;
        let day_ahead = match algorithm {
            Algorithm::FixedWindow => Duration::ZERO,
            _ => Duration::from_secs(80_000),
        };
        assert!(
            told_to_come_back(&second).is_some_and(|back| back > day_ahead),
            "{algorithm}: the second call under 1/1d waits a day: {second:?}"
        );
        // Under 20/1s, 60 callers: three windows' worth, each told to come back within its turn.
        let fast = keys.store(support::limiter("20/1s", algorithm));
        let mut latest = Duration::ZERO;
        for caller in 0..60 {
            let decision = decide(&fast, Ask::new(&seller)).await;
            let back = told_to_come_back(&decision)
                .unwrap_or_else(|| panic!("{algorithm}: caller {caller}: {decision:?}"));
            latest = latest.max(back);
            assert!(
                back < Duration::from_secs(60),
                "{algorithm}: caller {caller} waits behind the slot reserved under 1/1d: {decision:?}"
            );
        }
        println!("{algorithm}: under 20/1s, 60 callers told to come back within {latest:?}");
    }
    keys.cleanup().await;
}
