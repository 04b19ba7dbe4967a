//! Priorities and deadlines within a seller, against the real RabbitMQ and Redis and a strict
//! downstream: a priority row takes its seller's next free slot ahead of the backlog, a row that
//! cannot be called by its deadline is dead-lettered as `expired` at once and never called, the
//! earliest deadline goes first, and a row that has waited long enough is no longer passed. No
//! window is ever over the limit.
mod support;

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::Value;
use support::results::Results;
use turnstile_lab::rig::Rig;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Publishes rows of `seller` with ids `<prefix>-<i>`, each with `priority` and `deadline`
/// (Unix ms), and `headers`, confirmed.
async fn publish(
    rig: &Rig,
    seller: &str,
    prefix: &str,
    n: usize,
    priority: Option<u8>,
    deadline: Option<u64>,
    headers: &[(&str, AMQPValue)],
) {
    let rows = (0..n).map(|i| {
        let mut body = serde_json::json!({
            "message_id": format!("{prefix}-{i}"),
            "seller_id": seller,
            "product": {"sku": i},
        });
        if let Some(deadline) = deadline {
            body["deadline"] = rfc3339(deadline).into();
        }
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert((*name).into(), value.clone());
        }
        let mut properties = BasicProperties::default().with_headers(table);
        if let Some(priority) = priority {
            properties = properties.with_priority(priority);
        }
        (body, properties)
    });
    support::publish_confirmed(rig, rows).await;
}

/// The message ids the downstream was called with.
fn called(rig: &Rig) -> HashSet<String> {
    rig.mock
        .recent_requests()
        .iter()
        .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn priority_rows_take_their_sellers_next_free_slots_ahead_of_its_backlog()
-> anyhow::Result<()> {
    let mut rig = support::rig("priority", "10/1s").prepare().await?;
    let results = Results::listen(&rig).await;
    rig.start_replica(rig.settings(4)).await?;
    publish(&rig, "S-prio", "plain", 200, None, None, &[]).await;
    results.until(20).await;
    publish(&rig, "S-prio", "urgent", 5, Some(9), None, &[]).await;
    results.until(205).await;
    rig.stop_replicas().await?;
    let registered = results.with_outcome("registered");
    assert_eq!(registered.len(), 205, "{:?}", results.brief());
    let last_urgent = registered
        .iter()
        .rposition(|id| id.starts_with("urgent-"))
        .unwrap();
    // Plain rows registered after the first 20 and before the last urgent one: those whose
    // slots were due when the urgent rows came, and those sharing the urgent rows' window.
    let passed_by = registered[20..last_urgent]
        .iter()
        .filter(|id| id.starts_with("plain-"))
        .count();
    let stats = rig.mock.stats();
    println!(
        "200 rows at 10/1s, then 5 of priority 9: {passed_by} plain rows registered between them \
         and the last priority row (without priorities: about 180); {} windows over the limit",
        stats.violations
    );
    assert!(
        passed_by <= 20,
        "priority rows waited behind {passed_by} plain rows: more than two windows of 10"
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    rig.cleanup().await
}

#[tokio::test]
async fn hopeless_rows_expire_at_once_and_the_earliest_deadline_goes_first() -> anyhow::Result<()> {
    let mut rig = support::rig("deadline", "10/10s").prepare().await?;
    let results = Results::listen(&rig).await;
    rig.start_replica(rig.settings(4)).await?;
    // The window full, then 20 rows waiting for the next two windows.
    publish(&rig, "S-dl", "first", 10, None, None, &[]).await;
    results.until(10).await;
    publish(&rig, "S-dl", "waiting", 20, None, None, &[]).await;
    // 20 rows due in 3 s: no order can meet that (the next window opens in about 10 s).
    let soon = now_ms() + 3_000;
    publish(&rig, "S-dl", "due-3s", 20, None, Some(soon), &[]).await;
    results.until(30).await;
    // 5 rows due in 14 s: ahead of the 20 without a deadline, they make the next window.
    let later = now_ms() + 14_000;
    publish(&rig, "S-dl", "due-14s", 5, None, Some(later), &[]).await;
    results.until(55).await;
    rig.stop_replicas().await?;

    let expired = results.with_outcome("expired");
    let registered = results.with_outcome("registered");
    let all = results.all();
    println!(
        "10/10s, window full, 20 waiting: {} expired ({:?}...), {} registered",
        expired.len(),
        all.iter()
            .find(|r| r["outcome"] == "expired")
            .map(|r| r["detail"].clone()),
        registered.len()
    );
    assert_eq!(expired.len(), 20, "{:?}", results.brief());
    assert!(
        expired.iter().all(|id| id.starts_with("due-3s-")),
        "{expired:?}"
    );
    assert_eq!(registered.len(), 35, "{:?}", results.brief());
    let called = called(&rig);
    assert!(
        called.iter().all(|id| !id.starts_with("due-3s-")),
        "an expired row was called"
    );
    // Every expired row was told before any row of the next window registered.
    let first_after_window = all
        .iter()
        .position(|r| {
            r["outcome"] == "registered" && !r["message_id"].as_str().unwrap().starts_with("first-")
        })
        .unwrap();
    let last_expired = all.iter().rposition(|r| r["outcome"] == "expired").unwrap();
    assert!(last_expired < first_after_window, "{:?}", results.brief());
    // The rows due in 14 s registered in the next window, before it, ahead of the rows without.
    for r in all.iter().filter(|r| {
        r["message_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("due-14s-"))
    }) {
        assert_eq!(r["outcome"], "registered", "{r}");
        let finished = time_of(&r["finished"]);
        assert!(finished <= later, "{r} registered after its deadline");
    }
    let position = |prefix: &str| {
        registered
            .iter()
            .rposition(|id| id.starts_with(prefix))
            .unwrap()
    };
    let last_due = position("due-14s-");
    let waiting_before = registered[..last_due]
        .iter()
        .filter(|id| id.starts_with("waiting-"))
        .count();
    assert!(waiting_before <= 5, "{registered:?}");
    let stats = rig.mock.stats();
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    rig.cleanup().await
}

#[tokio::test]
async fn a_row_that_has_waited_nine_minutes_is_passed_by_no_later_priority_row()
-> anyhow::Result<()> {
    let mut rig = support::rig("aging", "10/5s").prepare().await?;
    let results = Results::listen(&rig).await;
    rig.start_replica(rig.settings(4)).await?;
    publish(&rig, "S-age", "first", 10, None, None, &[]).await;
    results.until(10).await;
    // Rows first seen ten minutes ago (as a delayed copy says), without a priority, then new
    // ones, each reserved in turn; then rows of priority 9 with a deadline an hour away.
    let long_ago = now_ms() - 10 * 60 * 1_000;
    let seen = [(
        "x-turnstile-first-seen-ms",
        AMQPValue::LongLongInt(long_ago as i64),
    )];
    publish(&rig, "S-age", "old", 10, None, None, &seen).await;
    support::eventually("the old rows reserved", || rig.total(|s| &s.delayed) >= 10).await;
    publish(&rig, "S-age", "young", 10, None, None, &[]).await;
    support::eventually("the young rows reserved", || {
        rig.total(|s| &s.delayed) >= 20
    })
    .await;
    let in_an_hour = now_ms() + 3_600_000;
    publish(&rig, "S-age", "urgent", 5, Some(9), Some(in_an_hour), &[]).await;
    results.until(35).await;
    rig.stop_replicas().await?;
    let registered = results.with_outcome("registered");
    let last_old = registered
        .iter()
        .rposition(|id| id.starts_with("old-"))
        .unwrap();
    let first_urgent = registered
        .iter()
        .position(|id| id.starts_with("urgent-"))
        .unwrap();
    let last_urgent = registered
        .iter()
        .rposition(|id| id.starts_with("urgent-"))
        .unwrap();
    // The aged rows keep the next window; the priority rows take the one after, whose other
    // five slots go to the first young rows (in which order those ten register is a race).
    let young_before = registered[..last_urgent]
        .iter()
        .filter(|id| id.starts_with("young-"))
        .count();
    println!("order: {registered:?}");
    assert!(
        last_old < first_urgent,
        "an aged row was passed: {registered:?}"
    );
    assert!(young_before <= 5, "young rows went first: {registered:?}");
    assert_eq!(rig.mock.stats().violations, 0);
    rig.cleanup().await
}

#[tokio::test]
async fn a_bad_deadline_is_an_invalid_message() -> anyhow::Result<()> {
    let mut rig = support::rig("bad-deadline", "10/1s").prepare().await?;
    let results = Results::listen(&rig).await;
    rig.start_replica(rig.settings(2)).await?;
    for (i, bad) in ["tomorrow", "2026-13-01T00:00:00Z", "2026-11-26 10:00"]
        .iter()
        .enumerate()
    {
        let body = serde_json::json!({
            "message_id": format!("bad-{i}"), "seller_id": "S-bad", "deadline": bad, "product": {},
        });
        rig.publish_body(&serde_json::to_vec(&body)?).await?;
    }
    let body = serde_json::json!({"message_id": "bad-3", "seller_id": "S-bad", "deadline": 5, "product": {}});
    rig.publish_body(&serde_json::to_vec(&body)?).await?;
    results.until(4).await;
    rig.stop_replicas().await?;
    assert_eq!(
        results.with_outcome("invalid-message").len(),
        4,
        "{:?}",
        results.brief()
    );
    assert!(called(&rig).is_empty());
    rig.cleanup().await
}

/// Unix ms of an RFC 3339 date-time.
fn time_of(value: &Value) -> u64 {
    let text = value.as_str().unwrap();
    humantime::parse_rfc3339(text)
        .unwrap()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test]
async fn a_moved_reservation_is_redeemed_at_its_new_slot_and_given_back_from_its_old_one() {
    use support::asks::{decide, redeem};
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::{Cost, Priority, SellerId};
    use turnstile_core::permit::{Ask, Decision, Limiter, Rank, Reservation};
    for algorithm in [Algorithm::SlidingWindow, Algorithm::Gcra] {
        let keys = support::Keys::new(support::Backend::Standalone, "moved").await;
        let store = keys.store(support::limiter("1/1s", algorithm));
        let seller = SellerId::parse("S-move").unwrap();
        let rank = |priority| Rank {
            priority: Priority::from_amqp(Some(priority)),
            deadline_ms: None,
            arrival_ms: now_ms(),
        };
        let ask = async |priority| decide(&store, Ask::new(&seller).rank(rank(priority))).await;
        let reserved = |decision: Decision| match decision {
            Decision::Wait {
                reservation: Some(reservation),
                ..
            } => reservation,
            other => panic!("{algorithm}: not reserved: {other:?}"),
        };
        assert!(matches!(ask(0).await, Decision::Granted { .. }));
        let a: Reservation = reserved(ask(0).await);
        let b = reserved(ask(0).await);
        let p = reserved(ask(9).await);
        assert_eq!(
            p.slot_us, a.slot_us,
            "{algorithm}: the priority call takes the first slot"
        );
        // A comes back for its old slot: told its new one, B's old slot, and keeps it.
        let moved = redeem(&store, Ask::new(&seller).held(Some(&a)))
            .await
            .expect("still reserved");
        let Decision::Wait {
            reservation: Some(now_a),
            ..
        } = moved
        else {
            panic!("{algorithm}: {moved:?}");
        };
        assert_eq!(now_a.slot_us, b.slot_us, "{algorithm}");
        assert_eq!(now_a.token, a.token);
        // B, moved to the priority call's first slot, is given back from its old one.
        assert!(
            store.unreserve(&seller, &b, Cost::ONE, None).await.unwrap(),
            "{algorithm}: a moved reservation is given back"
        );
        assert!(!store.unreserve(&seller, &b, Cost::ONE, None).await.unwrap());
        keys.cleanup().await;
    }
}

/// What one seller's reserved set holds (member → slot), and for sliding-window the slot of
/// each reservation's unit in its log.
async fn reserved_slots(
    conn: &turnstile_core::permit::RedisConn,
    keys: &turnstile_core::permit::Keyspace,
    seller: &turnstile_core::domain::SellerId,
    algorithm: turnstile_core::config::Algorithm,
) -> std::collections::BTreeMap<String, (i64, Option<i64>)> {
    let mut conn = conn.clone();
    let held: Vec<(String, i64)> = redis::cmd("ZRANGE")
        .arg(keys.reserved(seller, algorithm))
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut slots = std::collections::BTreeMap::new();
    for (member, slot) in held {
        let token = member.rsplit_once('+').unwrap().0.to_owned();
        let unit = if algorithm == turnstile_core::config::Algorithm::SlidingWindow {
            redis::cmd("ZSCORE")
                .arg(keys.state(seller, algorithm))
                .arg(&token)
                .query_async::<Option<i64>>(&mut conn)
                .await
                .unwrap()
        } else {
            None
        };
        slots.insert(member, (slot, unit));
    }
    slots
}

/// How a give-way changed a seller's reserved set from `before` to `after` (one reservation
/// more: the message that gave way): the reservations it moved, after checking that the seller
/// holds the same slots plus the new message's, that each moved one took the next moved one's
/// slot (the last the slot the new message reserved first) and its units in the log moved with
/// it, and that the new message took the first moved one's slot.
fn moved_by_one_give_way(
    before: &std::collections::BTreeMap<String, (i64, Option<i64>)>,
    after: &std::collections::BTreeMap<String, (i64, Option<i64>)>,
) -> usize {
    // Reservations whose slot passed long ago were pruned meanwhile.
    let before: std::collections::BTreeMap<_, _> = before
        .iter()
        .filter(|(member, _)| after.contains_key(*member))
        .map(|(member, slot)| (member.clone(), *slot))
        .collect();
    assert_eq!(after.len(), before.len() + 1, "one reservation more");
    let mut slots_before: Vec<i64> = before.values().map(|s| s.0).collect();
    let mut slots_after: Vec<i64> = after.values().map(|s| s.0).collect();
    slots_before.sort_unstable();
    slots_after.sort_unstable();
    let new_slot = *slots_after.last().unwrap();
    slots_before.push(new_slot);
    slots_before.sort_unstable();
    assert_eq!(
        slots_before, slots_after,
        "the seller holds the same slots, and the new message's at the end"
    );
    for (slot, unit) in after.values() {
        if let Some(unit) = unit {
            assert_eq!(unit, slot, "a reservation's unit in the log is at its slot");
        }
    }
    let mut moved: Vec<(i64, i64)> = before
        .iter()
        .filter_map(|(member, (from, _))| {
            let to = after[member].0;
            (to != *from).then_some((*from, to))
        })
        .collect();
    moved.sort_unstable();
    let newcomer = after
        .iter()
        .find(|(member, _)| !before.contains_key(*member))
        .map(|(_, (slot, _))| *slot)
        .unwrap();
    if let Some(first) = moved.first() {
        assert_eq!(
            newcomer, first.0,
            "the new message takes the first moved slot"
        );
        for pair in moved.windows(2) {
            assert_eq!(
                pair[0].1, pair[1].0,
                "a moved reservation moves back one place"
            );
        }
        assert_eq!(moved.last().unwrap().1, new_slot);
    }
    moved.len()
}

/// Reserves `n` plain slots of `seller` one after another (the first calls are granted): at
/// 1/100ms, each at a slot of its own.
async fn backlog(
    store: &turnstile_core::permit::PermitStore,
    seller: &turnstile_core::domain::SellerId,
    n: usize,
) {
    use turnstile_core::domain::Priority;
    use turnstile_core::permit::{Ask, Rank};
    for _ in 0..n {
        let rank = Rank {
            priority: Priority::DEFAULT,
            deadline_ms: None,
            arrival_ms: now_ms(),
        };
        support::asks::decide(store, Ask::new(seller).rank(rank)).await;
    }
}

/// A priority acquire of `seller` with `deadline_ms`, told to wait.
async fn priority_acquire(
    store: &turnstile_core::permit::PermitStore,
    seller: &turnstile_core::domain::SellerId,
    deadline_ms: Option<u64>,
) {
    use turnstile_core::domain::Priority;
    use turnstile_core::permit::{Ask, Decision, Rank};
    let rank = Rank {
        priority: Priority::from_amqp(Some(9)),
        deadline_ms,
        arrival_ms: now_ms(),
    };
    let decision = support::asks::decide(store, Ask::new(seller).rank(rank)).await;
    assert!(
        matches!(
            decision,
            Decision::Wait {
                reservation: Some(_),
                ..
            }
        ),
        "{decision:?}"
    );
}

#[tokio::test]
async fn one_give_way_moves_at_most_its_reach_and_the_seller_keeps_its_slots() {
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::SellerId;
    use turnstile_core::permit::{GIVE_WAY_REACH, Keyspace};
    for algorithm in [Algorithm::SlidingWindow, Algorithm::Gcra] {
        let keys = support::Keys::new(support::Backend::Standalone, "reach").await;
        let store = keys.store(support::limiter("1/100ms", algorithm));
        let keyspace = Keyspace::new(&keys.prefix);
        let seller = SellerId::parse("S-reach").unwrap();
        let other = SellerId::parse("S-reach-other").unwrap();
        let depth = 2 * GIVE_WAY_REACH as usize + 100;
        backlog(&store, &seller, depth).await;
        backlog(&store, &other, 20).await;
        let before = reserved_slots(&keys.conn, &keyspace, &seller, algorithm).await;
        let others_before = reserved_slots(&keys.conn, &keyspace, &other, algorithm).await;
        assert!(before.len() > 2 * GIVE_WAY_REACH as usize, "{algorithm}");
        priority_acquire(&store, &seller, None).await;
        let after = reserved_slots(&keys.conn, &keyspace, &seller, algorithm).await;
        let moved = moved_by_one_give_way(&before, &after);
        println!(
            "{algorithm}: one priority message behind {} reservations moved {moved}",
            before.len()
        );
        assert_eq!(
            moved, GIVE_WAY_REACH as usize,
            "{algorithm}: the reservations right before its slot move, no more than the reach"
        );
        assert_eq!(
            reserved_slots(&keys.conn, &keyspace, &other, algorithm).await,
            others_before,
            "{algorithm}: another seller's reservations never move"
        );
        keys.cleanup().await;
    }
}

#[tokio::test]
async fn a_sellers_give_way_budget_bounds_the_moves_of_its_priority_flood() {
    use std::time::Instant;
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::SellerId;
    use turnstile_core::permit::{
        GIVE_WAY_REACH, GIVE_WAY_STEPS_PER_SECOND, GIVE_WAY_STEPS_SAVED, Keyspace,
    };
    let algorithm = Algorithm::SlidingWindow;
    let keys = support::Keys::new(support::Backend::Standalone, "budget").await;
    let store = keys.store(support::limiter("1/100ms", algorithm));
    let keyspace = Keyspace::new(&keys.prefix);
    let seller = SellerId::parse("S-budget").unwrap();
    backlog(&store, &seller, 2 * GIVE_WAY_REACH as usize + 100).await;
    // Each full give-way reads and moves GIVE_WAY_REACH reservations: twice that many steps.
    let flood = GIVE_WAY_STEPS_SAVED / (2 * GIVE_WAY_REACH) + 8;
    let mut moves = Vec::new();
    let started = Instant::now();
    for _ in 0..flood {
        let before = reserved_slots(&keys.conn, &keyspace, &seller, algorithm).await;
        priority_acquire(&store, &seller, Some(now_ms() + 3_600_000)).await;
        let after = reserved_slots(&keys.conn, &keyspace, &seller, algorithm).await;
        moves.push(moved_by_one_give_way(&before, &after));
    }
    let secs = started.elapsed().as_secs_f64();
    let total: usize = moves.iter().sum();
    // The budget holds GIVE_WAY_STEPS_SAVED steps and refills at GIVE_WAY_STEPS_PER_SECOND;
    // each moved reservation was read, then moved: two steps.
    let most = ((GIVE_WAY_STEPS_SAVED as f64 + GIVE_WAY_STEPS_PER_SECOND as f64 * secs) / 2.0)
        .ceil() as usize;
    println!("{flood} priority messages in {secs:.2}s moved {moves:?} ({total}; at most {most})");
    assert!(moves[0] > 0, "the first gives way: {moves:?}");
    assert!(total <= most, "{moves:?}: {total} moves, more than {most}");
    keys.cleanup().await;
}
