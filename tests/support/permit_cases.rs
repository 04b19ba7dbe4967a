//! The permit engine's behaviour, written once and run against standalone Redis
//! (tests/permits.rs) and the local Redis Cluster (tests/permits_cluster.rs).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use turnstile_core::config::{Algorithm, Limits};
use turnstile_core::domain::{Cost, SellerId};
use turnstile_core::permit::{Ask, Decision, Ended, Forfeit, Keyspace, PermitStore};

use super::asks::{self, call_in_time, call_now, decide, redeem};
use super::{Backend, Keys, limiter, max_in_any_window, max_units_in_any_window};

fn seller(s: &str) -> SellerId {
    SellerId::parse(s).unwrap()
}

/// What a consumer does: acquire (reserving), wait the returned time, come back with the
/// reservation; returns the slot it was granted at.
pub async fn acquire_until_granted(store: &PermitStore, seller: &SellerId) -> i64 {
    acquire_units_until_granted(store, seller, Cost::ONE).await
}

/// As [`acquire_until_granted`], for a call of `cost` units.
pub async fn acquire_units_until_granted(
    store: &PermitStore,
    seller: &SellerId,
    cost: Cost,
) -> i64 {
    call_in_time(store, Ask::new(seller).cost(cost))
        .await
        .slot_us
}

/// 64 callers on one seller for several windows: no trailing window holds more than COUNT
/// grants, and reserving hands out the most the limit allows (no slot wasted).
pub async fn exact_under_contention(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "exact").await;
    let mut settings = limiter("10/400ms", algorithm);
    settings.guard = Some(Duration::from_millis(100));
    // The script's own schedule: a unit of a permit block is counted at the block's grant.
    settings.permit_block = 0;
    let store = Arc::new(keys.store(settings));
    let seller = seller("S-busy");
    let span_us = 500_000; // window + guard

    // Everyone reserves at once: the slots form the tightest schedule the limit allows.
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (store, seller) = (store.clone(), seller.clone());
        tasks.push(tokio::spawn(async move {
            decide(&store, Ask::new(&seller)).await
        }));
    }
    let mut slots = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Decision::Granted { slot_us, .. } => slots.push(slot_us),
            Decision::Wait {
                reservation: Some(r),
                ..
            } => slots.push(r.slot_us),
            other => panic!("a reserving caller was denied without a slot: {other:?}"),
        }
    }
    slots.sort_unstable();
    assert_eq!(
        max_in_any_window(&slots, span_us),
        10,
        "{algorithm}: slots {slots:?}"
    );
    let first = slots[0];
    match algorithm {
        Algorithm::SlidingWindow => {
            for i in 10..slots.len() {
                assert_eq!(
                    slots[i] - slots[i - 10],
                    span_us,
                    "{algorithm}: slot {i} not tight"
                );
            }
        }
        Algorithm::Gcra => {
            for (i, slot) in slots.iter().enumerate() {
                let expected = first + (i as i64) * span_us / 10;
                assert!(
                    (slot - expected).abs() <= 1,
                    "{algorithm}: slot {i} at {slot}, expected {expected}"
                );
            }
        }
        _ => unreachable!(),
    }

    // Then 64 callers keep asking the way a consumer does, for three more windows' worth.
    let granted = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (store, seller, granted) = (store.clone(), seller.clone(), granted.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..2 {
                let slot = acquire_until_granted(&store, &seller).await;
                granted.lock().await.push(slot);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut all = granted.lock().await.clone();
    all.extend(&slots);
    assert_eq!(all.len(), 64 * 3);
    assert!(
        max_in_any_window(&all, 400_000) <= 10,
        "{algorithm}: more than COUNT in a window"
    );
    keys.cleanup().await;
}

/// A caller that waits the returned time is granted; a denied attempt (no reserving) writes
/// nothing, so it takes no quota.
pub async fn waiting_caller_is_granted_and_denials_take_no_quota(
    backend: Backend,
    algorithm: Algorithm,
) {
    let keys = Keys::new(backend, "wait").await;
    // Denials under a window long enough that no window edge passes during the test.
    let store = keys.store(limiter("3/1h", algorithm));
    let s = seller("S-wait");
    let mut granted = 0;
    while let Decision::Granted { .. } = decide(&store, Ask::new(&s).without_reserving()).await {
        granted += 1;
    }
    assert!(
        (1..=3).contains(&granted),
        "{algorithm}: {granted} granted at once under 3/1h"
    );
    let state_key = store.keys().state(&s, algorithm);
    let dump = || async {
        let bytes: Vec<u8> = redis::cmd("DUMP")
            .arg(&state_key)
            .query_async(&mut keys.conn.clone())
            .await
            .unwrap();
        bytes
    };
    let before = dump().await;
    for _ in 0..20 {
        match decide(&store, Ask::new(&s).without_reserving()).await {
            Decision::Wait {
                retry_after,
                reservation: None,
            } => assert!(retry_after > Duration::ZERO),
            other => panic!("{algorithm}: expected a denial, got {other:?}"),
        }
    }
    assert_eq!(
        before,
        dump().await,
        "{algorithm}: a denial changed the seller's state"
    );

    // A caller told to wait, who waits, is granted.
    let mut settings = limiter("3/300ms", algorithm);
    settings.guard = Some(Duration::from_millis(100));
    let store = keys.store(settings);
    let s = seller("S-waits");
    let (retry_after, held) = loop {
        if let Decision::Wait {
            retry_after,
            reservation: Some(held),
        } = decide(&store, Ask::new(&s)).await
        {
            break (retry_after, held);
        }
    };
    tokio::time::sleep(retry_after).await;
    let redeemed = redeem(&store, Ask::new(&s).held(Some(&held))).await;
    assert!(
        matches!(redeemed, Ok(Decision::Granted { .. })),
        "{algorithm}: {redeemed:?}"
    );
    keys.cleanup().await;
}

/// Seller ids with braces, colons, spaces, unicode and 128 characters never share quota.
pub async fn unusual_seller_ids_are_isolated(backend: Backend) {
    let keys = Keys::new(backend, "ids").await;
    let store = keys.store(limiter("1/1h", Algorithm::SlidingWindow));
    let long = "x".repeat(128);
    let ids = [
        "{brace}",
        "brace",
        "}{",
        "a:b:c",
        "a:b",
        "with space",
        "größe",
        "店舗-1",
        long.as_str(),
        "%7Bbrace%7D",
    ];
    for id in ids {
        let decision = decide(&store, Ask::new(&seller(id)).without_reserving()).await;
        assert!(
            matches!(decision, Decision::Granted { .. }),
            "{id:?} was not granted: {decision:?}"
        );
    }
    for id in ids {
        let decision = decide(&store, Ask::new(&seller(id)).without_reserving()).await;
        assert!(
            matches!(decision, Decision::Wait { .. }),
            "{id:?} got a second permit in the hour"
        );
    }
    keys.cleanup().await;
}

/// Every key a seller leaves behind expires once the seller is idle.
pub async fn keys_expire_after_idleness(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "idle").await;
    let mut settings = limiter("2/200ms", algorithm);
    settings.guard = Some(Duration::from_millis(50));
    let store = keys.store(settings);
    let s = seller("S-idle");
    for _ in 0..5 {
        decide(&store, Ask::new(&s)).await;
    }
    let key = store.keys().state(&s, algorithm);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert!(ttl > 0, "{algorithm}: state key has no expiry (PTTL {ttl})");
    tokio::time::sleep(Duration::from_millis(ttl as u64 + 5)).await;
    let exists: bool = redis::cmd("EXISTS")
        .arg(&key)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert!(!exists, "{algorithm}: state key outlived its idleness");
    keys.cleanup().await;
}

/// A pause blocks every caller until it ends, and a slot reserved inside it is given up.
pub async fn pause_blocks_all_callers_until_it_ends(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "pause").await;
    let mut settings = limiter("100/1s", algorithm);
    settings.guard = Some(Duration::from_millis(100));
    let store = keys.store(settings.clone());
    let other_replica = keys.store(settings);
    let s = seller("S-paused");
    // Two held slots: a reservation made before the pause must not be honoured during it.
    let early_slot = loop {
        if let Decision::Wait {
            reservation: Some(held),
            ..
        } = decide(&store, Ask::new(&s)).await
        {
            break held;
        }
    };
    let paused = store.pause(&s, Duration::from_millis(1500)).await.unwrap();
    assert!(paused > Duration::from_millis(1000));
    match decide(&other_replica, Ask::new(&s).without_reserving()).await {
        Decision::Wait { retry_after, .. } => {
            assert!(retry_after >= paused - Duration::from_millis(100))
        }
        other => panic!("{algorithm}: granted during a pause: {other:?}"),
    }
    match decide(&other_replica, Ask::new(&s)).await {
        Decision::Wait {
            retry_after,
            reservation: Some(_),
        } => {
            assert!(retry_after >= paused - Duration::from_millis(100))
        }
        other => panic!("{algorithm}: expected a slot after the pause: {other:?}"),
    }
    assert_eq!(
        redeem(&store, Ask::new(&s).held(Some(&early_slot))).await,
        Err(Forfeit::Paused)
    );
    // A shorter pause does not cut the longer one short.
    let still = store.pause(&s, Duration::from_millis(10)).await.unwrap();
    assert!(still > Duration::from_millis(1000));
    keys.cleanup().await;
}

/// An override takes effect at once on every replica, and clearing it restores the default.
pub async fn overrides_take_effect(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "override").await;
    let mut settings = limiter("2/1h", algorithm);
    settings.gcra_burst = 5; // so that gcra, too, grants a whole window's worth at once
    let store = keys.store(settings);
    let s = seller("S-vip");
    assert_eq!(
        store.admin().effective_limit(&s).await.unwrap().to_string(),
        "2/1h"
    );
    store
        .admin()
        .set_limit(&s, "5/1h".parse::<Limits>().unwrap())
        .await
        .unwrap();
    assert_eq!(
        store
            .admin()
            .limit_override(&s)
            .await
            .unwrap()
            .unwrap()
            .to_string(),
        "5/1h"
    );
    let mut granted = 0;
    while let Decision::Granted { .. } = decide(&store, Ask::new(&s).without_reserving()).await {
        granted += 1;
        assert!(granted <= 5, "{algorithm}: more than the override allows");
    }
    assert_eq!(granted, 5, "{algorithm}");
    let Decision::Wait {
        reservation: Some(held),
        ..
    } = decide(&store, Ask::new(&s)).await
    else {
        panic!("{algorithm}: expected a reservation");
    };
    assert!(store.admin().clear_limit(&s).await.unwrap());
    assert_eq!(
        redeem(&store, Ask::new(&s).held(Some(&held))).await,
        Err(Forfeit::NotReserved),
        "{algorithm}: a change of limit gives reserved slots back"
    );
    assert_eq!(
        store.admin().effective_limit(&s).await.unwrap().to_string(),
        "2/1h"
    );
    keys.cleanup().await;
}

/// Reserves `n` slots for the seller (granting what is due); returns the reservations.
async fn reserve_backlog(
    store: &PermitStore,
    s: &SellerId,
    n: usize,
) -> Vec<turnstile_core::permit::Reservation> {
    let mut held = Vec::new();
    for _ in 0..n {
        if let Decision::Wait {
            reservation: Some(r),
            ..
        } = decide(store, Ask::new(s)).await
        {
            held.push(r);
        }
    }
    held
}

/// Every one of `held` was given back: its holder finds no reservation.
async fn all_given_back(
    store: &PermitStore,
    s: &SellerId,
    held: Vec<turnstile_core::permit::Reservation>,
    algorithm: Algorithm,
) {
    for r in held {
        assert_eq!(
            redeem(store, Ask::new(s).held(Some(&r))).await,
            Err(Forfeit::NotReserved),
            "{algorithm}"
        );
    }
}

/// The wait a new caller is told (zero when granted at once).
async fn wait_of_a_new_caller(store: &PermitStore, s: &SellerId) -> Duration {
    match decide(store, Ask::new(s)).await {
        Decision::Granted { .. } => Duration::ZERO,
        Decision::Wait { retry_after, .. } => retry_after,
        Decision::AlreadyDone => unreachable!("no completion record is passed"),
        Decision::Deferred { .. } => unreachable!("no global limit, no leases"),
        Decision::TooCostly { .. } => unreachable!("one unit always passes"),
    }
}

/// A limit raised in the middle of a reserved backlog applies to the whole backlog at once:
/// every slot reserved under the old limit is given back in the same step (its holder finds it
/// gone and reserves anew), so a new caller is not scheduled behind the old schedule.
pub async fn a_raised_limit_applies_at_once_to_a_reserved_backlog(
    backend: Backend,
    algorithm: Algorithm,
) {
    let keys = Keys::new(backend, "raise").await;
    let store = keys.store(limiter("2/10s", algorithm));
    let s = seller("S-raised");
    let held = reserve_backlog(&store, &s, 20).await;
    assert!(held.len() >= 17, "{algorithm}: {} reserved", held.len());
    let last = held.iter().map(|r| r.slot_us).max().unwrap() - held[0].reserved_at_us;
    assert!(
        last > 60_000_000,
        "{algorithm}: the old schedule ends {last} µs ahead"
    );
    let before = wait_of_a_new_caller(&store, &s).await;
    assert!(before > Duration::from_secs(60), "{algorithm}: {before:?}");

    store
        .admin()
        .set_limit(&s, "1000/10s".parse::<Limits>().unwrap())
        .await
        .unwrap();
    let after = wait_of_a_new_caller(&store, &s).await;
    println!("{algorithm}: a new caller waits {before:?} under 2/10s, {after:?} after the raise");
    assert!(
        after < Duration::from_secs(1),
        "{algorithm}: still scheduled behind the old backlog: {after:?}"
    );
    all_given_back(&store, &s, held, algorithm).await;
    keys.cleanup().await;
}

/// Lifting a pause gives the paused backlog's slots back as a limit change does: the backlog
/// is scheduled from now, not from the end of the pause (gcra, whose one number cannot tell
/// the calls before the pause from the jump to its end, at most one window + guard from now).
pub async fn a_lifted_pause_reschedules_the_backlog(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "resume").await;
    let store = keys.store(limiter("5/10s", algorithm));
    let s = seller("S-resumed");
    store.pause(&s, Duration::from_secs(3600)).await.unwrap();
    let held = reserve_backlog(&store, &s, 5).await;
    assert_eq!(held.len(), 5, "{algorithm}: all wait for the pause");
    assert!(store.admin().resume(&s).await.unwrap());
    let after = wait_of_a_new_caller(&store, &s).await;
    println!("{algorithm}: after a 1 h pause is lifted, a new caller waits {after:?}");
    assert!(
        after <= Duration::from_millis(10_500),
        "{algorithm}: scheduled after the lifted pause: {after:?}"
    );
    all_given_back(&store, &s, held, algorithm).await;
    keys.cleanup().await;
}

/// A reservation forfeited at redemption (here: a pause covers its slot) gives its slot back in
/// the same step, so the next caller gets it instead of a slot behind it. Not gcra: one TAT
/// cannot free a slot inside its schedule (docs/algorithms.md, "Reservations").
pub async fn a_forfeited_slot_goes_back_to_the_next_caller(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "giveback").await;
    let mut settings = limiter("1/2s", algorithm);
    settings.guard = Some(Duration::from_millis(100));
    let store = keys.store(settings);
    let s = seller("S-forfeit");
    assert!(matches!(
        decide(&store, Ask::new(&s)).await,
        Decision::Granted { .. }
    ));
    let held = reserve_backlog(&store, &s, 1)
        .await
        .pop()
        .expect("one reservation");
    // A pause past the slot: the reservation is forfeited when redeemed.
    let slot_in = Duration::from_micros((held.slot_us - held.reserved_at_us) as u64);
    store
        .pause(&s, slot_in + Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(
        redeem(&store, Ask::new(&s).held(Some(&held))).await,
        Err(Forfeit::Paused),
        "{algorithm}"
    );
    // The next caller is scheduled at the end of the pause, in the slot given back, not one
    // whole interval later.
    let wait = wait_of_a_new_caller(&store, &s).await;
    println!("{algorithm}: after a forfeit, the next caller waits {wait:?}");
    assert!(
        wait < slot_in + Duration::from_millis(1500),
        "{algorithm}: the forfeited slot was not given back (waits {wait:?})"
    );
    keys.cleanup().await;
}

/// 10,000 callers of one seller at 100/30m: at most 3,072 hold a reserved slot; the others
/// are told when to come back, 100 per half hour from when the first reserved slot is due (the
/// pace at which slots free up), so the seller's state stays bounded however deep the backlog.
/// (Half an hour, so that no reserved slot falls due while the test runs on a loaded machine;
/// `turnstile bench depth` measures 100/1m up to 1,000,000 callers.)
pub async fn a_deep_backlog_keeps_the_sellers_state_bounded(
    backend: Backend,
    algorithm: Algorithm,
) {
    let keys = Keys::new(backend, "deep").await;
    let store = keys.store(limiter("100/30m", algorithm));
    let s = seller("S-deep");
    let (mut reserved, mut far) = (0, Vec::new());
    for _ in 0..10_000 {
        match decide(&store, Ask::new(&s)).await {
            Decision::Wait {
                reservation: Some(_),
                ..
            } => reserved += 1,
            Decision::Wait {
                retry_after,
                reservation: None,
            } => far.push(retry_after),
            _ => {}
        }
    }
    let bytes = turnstile_core::permit::memory_of_prefix(&keys.conn, &keys.prefix)
        .await
        .unwrap();
    println!(
        "{algorithm}: 10,000 callers at 100/30m: {reserved} reserved, {} told to come back \
         (from {:?} to {:?}), {bytes} bytes in Redis",
        far.len(),
        far.first().unwrap(),
        far.last().unwrap()
    );
    assert_eq!(reserved, 3072, "{algorithm}");
    assert!(bytes < 1 << 20, "{algorithm}: {bytes} bytes");
    // At most 100 per half hour come back.
    let spread = far.last().unwrap().saturating_sub(*far.first().unwrap());
    let expected = Duration::from_secs(1800) * (far.len() as u32 / 100 - 1);
    assert!(
        spread >= expected,
        "{algorithm}: {} come back within {spread:?}",
        far.len()
    );
    keys.cleanup().await;
}

/// sliding-window holds one log member per unit: a backlog of weighed calls stops reserving once
/// the log holds 3,072 units beyond the largest COUNT, and is told when to come back, so the
/// seller's state stays bounded whatever the costs. At 100/30m and 50 units a call, two calls
/// are granted (100 units) and reservations stop once the next would pass 3,072 + 100: 61 of
/// them (3,150 units), where 998 would be 49,900 log members.
pub async fn a_weighed_backlog_keeps_the_sliding_log_bounded(backend: Backend) {
    let keys = Keys::new(backend, "weighed-deep").await;
    let store = keys.store(limiter("100/30m", Algorithm::SlidingWindow));
    let s = seller("S-weighed-deep");
    let cost = Cost::new(50).unwrap();
    let (mut granted, mut reserved, mut far) = (0, 0, 0);
    for _ in 0..1_000 {
        match decide(&store, Ask::new(&s).cost(cost)).await {
            Decision::Granted { .. } => granted += 1,
            Decision::Wait {
                reservation: Some(_),
                ..
            } => reserved += 1,
            Decision::Wait {
                reservation: None, ..
            } => far += 1,
            other => panic!("{other:?}"),
        }
    }
    let bytes = turnstile_core::permit::memory_of_prefix(&keys.conn, &keys.prefix)
        .await
        .unwrap();
    assert_eq!((granted, reserved, far), (2, 61, 937), "{bytes} bytes");
    assert!(bytes < 1 << 20, "{bytes} bytes");
    keys.cleanup().await;
}

/// An override key holding anything but the form turnstile writes (a stack sorted by window,
/// no two windows alike, plain integers) — written by hand, or restored from elsewhere — is
/// ignored by every script: the default applies, and a reservation made under it stays good.
pub async fn a_malformed_override_is_ignored_and_the_default_applies(backend: Backend) {
    let keys = Keys::new(backend, "malformed-override").await;
    let store = keys.store(limiter("6/1s,20/5s", Algorithm::SlidingWindow));
    let space = Keyspace::new(&keys.prefix);
    for (i, odd) in [
        "20,6 5000000,1000000",
        "6,20 1000000,1000000",
        "06,20 1000000,5000000",
        "6,,20 1000000,,5000000",
        "6,20 1000000",
        "6, 20 1000000,5000000",
        "0 1000000",
        "6,20,30,40,50,60,70,80,90 1,2,3,4,5,6,7,8,9",
    ]
    .into_iter()
    .enumerate()
    {
        let s = seller(&format!("S-odd-{i}"));
        let _: () = redis::cmd("SET")
            .arg(space.limit(&s))
            .arg(odd)
            .query_async(&mut keys.conn.clone())
            .await
            .unwrap();
        let usage = store.admin().usage(&s).await.unwrap();
        assert_eq!(
            (usage.limit.to_string(), usage.overridden),
            ("6/1s,20/5s".to_owned(), false),
            "{odd:?}"
        );
        assert!(
            matches!(decide(&store, Ask::new(&s)).await, Decision::Granted { .. }),
            "{odd:?}"
        );
    }
    keys.cleanup().await;
}

/// Invalid inputs are refused before anything is written.
pub async fn scripts_check_inputs_before_writing(backend: Backend) {
    let keys = Keys::new(backend, "inputs").await;
    let (space, x) = (Keyspace::new(&keys.prefix), seller("x"));
    let key = space.state(&x, Algorithm::SlidingWindow);
    let err = turnstile_core::permit::scripts::acquire(Algorithm::SlidingWindow)
        .key(&key)
        .key(space.limit(&x))
        .key(space.pause(&x))
        .arg(0) // COUNT 0 is invalid
        .arg(1_000_000)
        .arg(-1)
        .arg(1)
        .arg(1_000_000)
        .arg("token")
        .invoke_async::<redis::Value>(&mut keys.conn.clone())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ARGV[1]"), "{err}");
    let exists: bool = redis::cmd("EXISTS")
        .arg(&key)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert!(!exists);
    keys.cleanup().await;
}

/// The dashboard's view of a seller: grants count as used, reservations as promised ahead, each
/// grant tells how much of the limit it leaves taken (near-limit), and pauses and overrides show.
pub async fn usage_shows_grants_reservations_pauses_and_overrides(
    backend: Backend,
    algorithm: Algorithm,
) {
    let keys = Keys::new(backend, "usage").await;
    let mut settings = limiter("5/1h", algorithm);
    settings.gcra_burst = 5; // gcra's capacity is its burst
    let store = keys.store(settings);
    let s = seller("S-usage");
    let fresh = store.admin().usage(&s).await.unwrap();
    assert_eq!(
        (fresh.used, fresh.capacity, fresh.ahead),
        (0, 5, 0),
        "{algorithm:?}"
    );

    let mut taken = Vec::new();
    for _ in 0..5 {
        match decide(&store, Ask::new(&s)).await {
            Decision::Granted { used_permille, .. } => taken.push(used_permille),
            other => panic!("{algorithm:?}: the first five are granted: {other:?}"),
        }
    }
    // Refill and clock drift between calls may shave a thousandth off.
    for (i, permille) in taken.iter().enumerate() {
        let expected = (i as u32 + 1) * 200;
        assert!(
            (expected - 5..=expected).contains(permille),
            "{algorithm:?}: grant {} left {permille}/1000 taken",
            i + 1
        );
    }
    assert!(taken[0] < turnstile_core::permit::NEAR_LIMIT_PERMILLE);
    assert!(taken[4] >= turnstile_core::permit::NEAR_LIMIT_PERMILLE);
    for _ in 0..2 {
        assert!(
            matches!(
                decide(&store, Ask::new(&s)).await,
                Decision::Wait {
                    reservation: Some(_),
                    ..
                }
            ),
            "{algorithm:?}: the next ones reserve"
        );
    }
    let busy = store.admin().usage(&s).await.unwrap();
    assert_eq!(
        (busy.used, busy.capacity, busy.ahead),
        (5, 5, 2),
        "{algorithm:?}"
    );
    assert!(!busy.overridden && busy.paused_for.is_zero());

    store.pause(&s, Duration::from_secs(60)).await.unwrap();
    let limit: turnstile_core::config::Limit = "7/1h".parse().unwrap();
    store.admin().set_limit(&s, limit).await.unwrap();
    let steered = store.admin().usage(&s).await.unwrap();
    assert!(steered.paused_for > Duration::from_secs(50), "{steered:?}");
    assert!(steered.paused_for <= Duration::from_secs(60), "{steered:?}");
    assert_eq!((steered.limit, steered.overridden), (limit.into(), true));
    keys.cleanup().await;
}

/// A seller's retries waiting (the ETA's bookkeeping): a message once, at its latest retry;
/// only those not due yet are read; at most `RetryDue::KEPT`, the latest due; the key expires
/// when its latest retry is due.
pub async fn retries_keep_the_latest_due_once_per_message_and_expire(backend: Backend) {
    use turnstile_core::domain::{BatchId, MessageId};
    use turnstile_core::permit::RetryDue;
    let keys = Keys::new(backend, "retries").await;
    let store = keys.store(limiter("10/1s", Algorithm::SlidingWindow));
    let records = store.records();
    let (s, batch) = (seller("S-retries"), BatchId::parse("b:1 größe").unwrap());
    let message = |i: usize| MessageId::parse(&format!("m:{i}")).unwrap();
    let secs = Duration::from_secs;
    let note = async |s: &SellerId, i: usize, units: u32, delay: Duration| {
        let cost = Cost::new(units).unwrap();
        records
            .retry_due(s, &message(i), &batch, cost, delay)
            .await
            .unwrap();
    };
    note(&s, 1, 2, secs(30)).await;
    note(&s, 2, 1, secs(10)).await;
    // Its next retry replaces a message's entry.
    note(&s, 1, 2, secs(20)).await;
    // Due now: the message is back, not waiting.
    note(&s, 3, 1, Duration::ZERO).await;
    let due = records.retries_due(&s).await.unwrap();
    let got: Vec<(&str, u64)> = due.iter().map(|r| (r.batch.as_str(), r.units)).collect();
    assert_eq!(got, [(batch.as_str(), 1), (batch.as_str(), 2)], "{due:?}");
    assert!(
        due[0].due_in <= secs(10) && due[0].due_in > secs(9),
        "{due:?}"
    );
    assert!(
        due[1].due_in <= secs(20) && due[1].due_in > secs(19),
        "{due:?}"
    );
    let key = store.keys().retries(&s);
    let pttl = |key: String| {
        let mut conn = keys.conn.clone();
        async move {
            redis::cmd("PTTL")
                .arg(&key)
                .query_async::<i64>(&mut conn)
                .await
                .unwrap()
        }
    };
    let ttl = pttl(key.clone()).await;
    assert!(
        ttl > 19_000 && ttl <= 20_000,
        "expires with its latest retry: {ttl}"
    );

    // Many retries: the latest due are kept.
    for i in 0..RetryDue::KEPT + 10 {
        note(&s, 100 + i, 1, secs(100 + i as u64)).await;
    }
    let due = records.retries_due(&s).await.unwrap();
    assert_eq!(due.len(), RetryDue::KEPT);
    assert!(
        due[0].due_in > secs(109),
        "the soonest were dropped: {:?}",
        due[0]
    );

    // A short one expires with its retry.
    let other = seller("S-retries-2");
    note(&other, 1, 1, Duration::from_millis(100)).await;
    let key = store.keys().retries(&other);
    let ttl = pttl(key.clone()).await;
    assert!(ttl > 0 && ttl <= 100, "{ttl}");
    tokio::time::sleep(Duration::from_millis(ttl as u64 + 20)).await;
    assert!(records.retries_due(&other).await.unwrap().is_empty());
    assert_eq!(pttl(key).await, -2, "the key is gone");
    keys.cleanup().await;
}

/// A message's completion record moves it between waiting, registered and dead, and its upload
/// and the dead letters by reason count it in the one state it is in: repeats change nothing,
/// a dead letter's record does not suppress a call, and counts never go below zero.
pub async fn completion_records_count_each_message_once(backend: Backend) {
    use turnstile_core::domain::{BatchId, BatchSize, MessageId};
    use turnstile_core::permit::Completion::{Dead, Registered, Replayed};
    use turnstile_core::permit::InBatch;
    let keys = Keys::new(backend, "once").await;
    let store = keys.store(limiter("1000/1s", Algorithm::SlidingWindow));
    let (s, batch) = (seller("S-once"), BatchId::parse("b").unwrap());
    let m = MessageId::parse("m-1").unwrap();
    let ttl = Duration::from_secs(60);
    let size = BatchSize::new(1);
    let in_batch = |id| Some(InBatch { id, size });
    store
        .records()
        .batch_seen(&s, &batch, size, ttl)
        .await
        .unwrap();
    let counts = async || {
        let p = turnstile_upload::progress::list(&store.records(), Some(&s), Some(&batch))
            .await
            .unwrap();
        let tally = store.records().dead_now().await.unwrap();
        let tally = |r: &str| tally.get(r).copied().unwrap_or(0);
        (
            p[0].registered,
            p[0].dead,
            p[0].waiting().unwrap(),
            tally("rejected"),
            tally("throttled"),
        )
    };
    let done = async |algorithm| {
        let store = keys.store(limiter("1000/1s", algorithm));
        decide(&store, Ask::new(&s).message(&m).without_reserving()).await == Decision::AlreadyDone
    };
    // (transition, changed, then (registered, dead, waiting, rejected, throttled))
    for (step, (completion, changed, then)) in [
        (Dead("rejected"), true, (0, 1, 0, 1, 0)),
        (Dead("rejected"), false, (0, 1, 0, 1, 0)),
        (Dead("throttled"), false, (0, 1, 0, 1, 0)),
        (Replayed, true, (0, 0, 1, 0, 0)),
        (Replayed, false, (0, 0, 1, 0, 0)),
        (Dead("throttled"), true, (0, 1, 0, 0, 1)),
        (Registered, true, (1, 0, 0, 0, 0)),
        (Registered, false, (1, 0, 0, 0, 0)),
        (Dead("rejected"), false, (1, 0, 0, 0, 0)),
        (Replayed, false, (1, 0, 0, 0, 0)),
    ]
    .into_iter()
    .enumerate()
    {
        let was = store
            .complete(&s, &m, in_batch(&batch), completion, ttl)
            .await
            .unwrap()
            .changed;
        assert_eq!(
            (was, counts().await),
            (changed, then),
            "step {step}: {completion:?}"
        );
        // Only a registered message is done: a dead letter's copy or a replay is called again.
        let registered = then.0 == 1;
        for algorithm in Algorithm::ALL {
            assert_eq!(
                done(algorithm).await,
                registered,
                "step {step}: {algorithm:?}"
            );
        }
    }

    // A decrement never recreates an upload that is gone, nor takes a count below zero.
    let gone = BatchId::parse("gone").unwrap();
    let m2 = MessageId::parse("m-2").unwrap();
    store
        .complete(&s, &m2, in_batch(&gone), Dead("rejected"), ttl)
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(store.keys().batch(&s, &gone))
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    store.records().tally_dead("rejected", -5).await.unwrap();
    assert!(
        store
            .complete(&s, &m2, in_batch(&gone), Replayed, ttl)
            .await
            .unwrap()
            .changed
    );
    let exists: bool = redis::cmd("EXISTS")
        .arg(store.keys().batch(&s, &gone))
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert!(!exists, "a replay recreated an expired upload");
    assert!(store.records().dead_now().await.unwrap().is_empty());

    // A reason that is not a plain word is refused before anything is written.
    let err = store
        .complete(&s, &m2, in_batch(&batch), Dead("bad reason"), ttl)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("REASON"), "{err}");
    assert_eq!(counts().await, (1, 0, 0, 0, 0));
    keys.cleanup().await;
}

/// Generates one test per case for a backend.
/// 24 callers with costs of 1 to 3 units on one seller under the stack 6/300ms,11/1s, two
/// calls each, the way a consumer asks (none comes back late, so none loses its slot): no
/// window of either limit holds more than its COUNT in units, and every unit asked for is
/// granted. (gcra's interval at 11/1s, 1.05 s / 9, is not a whole µs.)
pub async fn a_weighed_stack_is_exact_under_contention(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "weighed").await;
    let mut settings = limiter("6/300ms,11/1s", algorithm);
    settings.guard = Some(Duration::from_millis(50));
    settings.gcra_burst = 3; // the largest cost: gcra takes a cost of at most its burst
    let store = Arc::new(keys.store(settings));
    let seller = seller("S-weighed");
    let mut tasks = Vec::new();
    for i in 0..24u32 {
        let (store, seller) = (store.clone(), seller.clone());
        let cost = Cost::new(i % 3 + 1).unwrap();
        tasks.push(tokio::spawn(async move {
            let mut grants = Vec::new();
            for _ in 0..2 {
                let slot = acquire_units_until_granted(&store, &seller, cost).await;
                grants.push((slot, cost.units()));
            }
            grants
        }));
    }
    let mut grants = Vec::new();
    for task in tasks {
        grants.extend(task.await.unwrap());
    }
    let units: u64 = grants.iter().map(|(_, u)| u64::from(*u)).sum();
    assert_eq!(units, 2 * 8 * (1 + 2 + 3), "{algorithm}");
    for (window_us, count) in [(350_000, 6), (1_050_000, 11)] {
        let most = max_units_in_any_window(&grants, window_us);
        assert!(
            most <= count,
            "{algorithm}: {most} units in {window_us} µs: {grants:?}"
        );
    }
    // The stack binds: the longer limit's window was filled to its count at least once, but
    // for the one or two units a cost of up to 3 may leave unused.
    let most = max_units_in_any_window(&grants, 1_050_000);
    assert!(
        most >= 9,
        "{algorithm}: at most {most} units in a window of 11/1s: {grants:?}"
    );
    keys.cleanup().await;
}

/// A call that costs more than the stack can ever grant at once is told so, and takes nothing.
pub async fn a_cost_beyond_the_stack_never_passes_and_takes_nothing(
    backend: Backend,
    algorithm: Algorithm,
) {
    let keys = Keys::new(backend, "costly").await;
    let mut settings = limiter("6/1s,20/5s", algorithm);
    settings.gcra_burst = 6;
    let store = keys.store(settings.clone());
    let s = seller("S-costly");
    let units = |n| Cost::new(n).unwrap();
    let expect_too_costly = |decision: Decision, most: u32, limits: &str| match decision {
        Decision::TooCostly {
            cost,
            most: m,
            limits: l,
            ..
        } => {
            assert_eq!((m, l.to_string()), (most, limits.to_owned()), "{algorithm}");
            assert!(cost.units() > most, "{algorithm}");
        }
        other => panic!("{algorithm}: {other:?}"),
    };
    expect_too_costly(
        decide(&store, Ask::new(&s).cost(units(7))).await,
        6,
        "6/1s,20/5s",
    );
    let usage = store.admin().usage(&s).await.unwrap();
    assert!(
        usage.per_limit.iter().all(|u| u.used == 0 && u.ahead == 0),
        "{algorithm}: {usage:?}"
    );
    // The most the stack grants at once passes at once.
    assert!(
        matches!(
            decide(&store, Ask::new(&s).cost(units(6))).await,
            Decision::Granted { .. }
        ),
        "{algorithm}"
    );
    // A seller's own stack decides what can pass.
    store
        .admin()
        .set_limit(&s, "2/1s,50/1m".parse::<Limits>().unwrap())
        .await
        .unwrap();
    expect_too_costly(
        decide(&store, Ask::new(&s).cost(units(3))).await,
        2,
        "2/1s,50/1m",
    );
    if algorithm == Algorithm::Gcra {
        // gcra takes a cost of at most its burst.
        settings.gcra_burst = 1;
        let store = keys.store(settings);
        let other = seller("S-paced");
        expect_too_costly(
            decide(&store, Ask::new(&other).cost(units(2))).await,
            1,
            "6/1s,20/5s",
        );
    }
    keys.cleanup().await;
}

/// Seed-style token-bucket requests of more than one token (Spring Cloud Gateway's `requested`):
/// a request takes that many tokens, one that finds too few is denied and takes none, and a
/// smaller one then still passes.
pub async fn token_bucket_requests_take_that_many_tokens(backend: Backend) {
    let keys = Keys::new(backend, "requested").await;
    let mut settings = limiter("10/1h", Algorithm::TokenBucket);
    settings.bucket_capacity = 10;
    let store = keys.store(settings);
    let s = seller("S-bucket");
    let units = |n| Cost::new(n).unwrap();
    for _ in 0..2 {
        assert!(matches!(
            decide(&store, Ask::new(&s).cost(units(4)).without_reserving()).await,
            Decision::Granted { .. }
        ));
    }
    assert_eq!(store.admin().usage(&s).await.unwrap().used, 8);
    match decide(&store, Ask::new(&s).cost(units(4)).without_reserving()).await {
        Decision::Wait {
            reservation: None,
            retry_after,
        } => {
            // Two tokens short at 10 per hour (+ guard): about 12 minutes.
            assert!(retry_after > Duration::from_secs(600), "{retry_after:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store.admin().usage(&s).await.unwrap().used,
        8,
        "a denial takes nothing"
    );
    assert!(matches!(
        decide(&store, Ask::new(&s).cost(units(2)).without_reserving()).await,
        Decision::Granted { .. }
    ));
    assert_eq!(store.admin().usage(&s).await.unwrap().used, 10);
    keys.cleanup().await;
}

/// A reservation is redeemed only for the cost it was made for: another cost finds no such
/// reservation and leaves it in place for its holder.
pub async fn a_reservation_is_good_only_for_its_cost(backend: Backend, algorithm: Algorithm) {
    let keys = Keys::new(backend, "bound-cost").await;
    let mut settings = limiter("2/1s", algorithm);
    settings.gcra_burst = 2;
    let store = keys.store(settings);
    let s = seller("S-bound");
    let two = Cost::new(2).unwrap();
    assert!(matches!(
        decide(&store, Ask::new(&s).cost(two)).await,
        Decision::Granted { .. }
    ));
    // Asked again until the limit is full: with fixed-window the first grant may have been the
    // last of a window that ended just then.
    let mut asked = 0;
    let (wait, held) = loop {
        asked += 1;
        match decide(&store, Ask::new(&s).cost(two)).await {
            Decision::Granted { .. } if asked < 5 => continue,
            Decision::Wait {
                retry_after,
                reservation: Some(r),
            } => break (retry_after, r),
            other => panic!("{algorithm}: {other:?}"),
        }
    };
    assert_eq!(
        redeem(&store, Ask::new(&s).held(Some(&held))).await,
        Err(Forfeit::NotReserved),
        "{algorithm}"
    );
    tokio::time::sleep(wait).await;
    let redeemed = loop {
        match redeem(&store, Ask::new(&s).cost(two).held(Some(&held))).await {
            Ok(Decision::Wait { retry_after, .. }) => tokio::time::sleep(retry_after).await,
            other => break other,
        }
    };
    assert!(
        matches!(redeemed, Ok(Decision::Granted { .. })),
        "{algorithm}: {redeemed:?}"
    );
    keys.cleanup().await;
}

#[macro_export]
macro_rules! permit_tests {
    ($backend:expr) => {
        use turnstile_core::config::Algorithm::*;
        use $crate::support::permit_cases as cases;

        #[tokio::test]
        async fn sliding_window_grants_are_exact_under_contention() {
            cases::exact_under_contention($backend, SlidingWindow).await;
        }
        #[tokio::test]
        async fn gcra_grants_are_exact_under_contention() {
            cases::exact_under_contention($backend, Gcra).await;
        }
        #[tokio::test]
        async fn sliding_window_keeps_a_weighed_stack_exact_under_contention() {
            cases::a_weighed_stack_is_exact_under_contention($backend, SlidingWindow).await;
        }
        #[tokio::test]
        async fn gcra_keeps_a_weighed_stack_exact_under_contention() {
            cases::a_weighed_stack_is_exact_under_contention($backend, Gcra).await;
        }
        #[tokio::test]
        async fn callers_asking_together_share_calls_and_the_limit_holds() {
            cases::callers_asking_together_share_calls_and_the_limit_holds($backend).await;
        }
        #[tokio::test]
        async fn an_operation_refused_in_a_batch_fails_alone() {
            cases::an_operation_refused_in_a_batch_fails_alone($backend).await;
        }
        #[tokio::test]
        async fn a_seller_far_from_its_limit_gets_a_block_whose_unused_units_are_given_back() {
            cases::a_seller_far_from_its_limit_gets_a_block_whose_unused_units_are_given_back(
                $backend,
            )
            .await;
        }
        #[tokio::test]
        async fn units_a_replica_does_not_use_go_to_another_replicas_calls() {
            cases::units_a_replica_does_not_use_go_to_another_replicas_calls($backend).await;
        }
        #[tokio::test]
        async fn a_pool_made_by_one_replica_serves_another_replicas_calls() {
            cases::a_pool_made_by_one_replica_serves_another_replicas_calls($backend).await;
        }
        #[tokio::test]
        async fn a_pool_unit_a_call_could_outlive_is_not_used() {
            cases::a_pool_unit_a_call_could_outlive_is_not_used($backend).await;
        }
        #[tokio::test]
        async fn a_pool_on_a_server_that_did_not_write_it_is_dropped() {
            cases::a_pool_on_a_server_that_did_not_write_it_is_dropped($backend).await;
        }
        #[tokio::test]
        async fn a_change_of_terms_takes_back_the_pools_unclaimed_units() {
            cases::a_change_of_terms_takes_back_the_pools_unclaimed_units($backend).await;
        }
        #[tokio::test]
        async fn a_later_grant_never_shortens_the_life_of_a_blocks_units() {
            cases::a_later_grant_never_shortens_the_life_of_a_blocks_units($backend).await;
        }
        #[tokio::test]
        async fn replicas_taking_blocks_together_keep_the_limit_exact() {
            cases::replicas_taking_blocks_together_keep_the_limit_exact($backend).await;
        }
        #[tokio::test]
        async fn a_record_waiting_to_ride_goes_with_the_next_call() {
            cases::a_record_waiting_to_ride_goes_with_the_next_call($backend).await;
        }
        #[tokio::test]
        async fn a_record_keeping_its_result_is_done_before_and_after_it_is_trimmed() {
            cases::a_record_keeping_its_result_is_done_before_and_after_it_is_trimmed($backend)
                .await;
        }
        #[tokio::test]
        async fn a_message_s_call_is_claimed_by_one_delivery_at_a_time_until_its_call_ends() {
            cases::a_message_s_call_is_claimed_by_one_delivery_at_a_time_until_its_call_ends(
                $backend,
            )
            .await;
        }
        #[tokio::test]
        async fn a_late_record_ends_the_call_at_its_answer() {
            cases::a_late_record_ends_the_call_at_its_answer($backend).await;
        }
        #[tokio::test]
        async fn a_cost_beyond_the_stack_never_passes_and_takes_nothing() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::a_cost_beyond_the_stack_never_passes_and_takes_nothing($backend, algorithm)
                    .await;
            }
        }
        #[tokio::test]
        async fn token_bucket_requests_take_that_many_tokens() {
            cases::token_bucket_requests_take_that_many_tokens($backend).await;
        }
        #[tokio::test]
        async fn a_reservation_is_good_only_for_its_cost() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::a_reservation_is_good_only_for_its_cost($backend, algorithm).await;
            }
        }
        #[tokio::test]
        async fn a_caller_who_waits_is_granted_and_denials_take_no_quota() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::waiting_caller_is_granted_and_denials_take_no_quota($backend, algorithm)
                    .await;
            }
        }
        #[tokio::test]
        async fn unusual_seller_ids_are_isolated() {
            cases::unusual_seller_ids_are_isolated($backend).await;
        }
        #[tokio::test]
        async fn keys_expire_after_idleness() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::keys_expire_after_idleness($backend, algorithm).await;
            }
        }
        #[tokio::test]
        async fn a_pause_blocks_every_caller_until_it_ends() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::pause_blocks_all_callers_until_it_ends($backend, algorithm).await;
            }
        }
        #[tokio::test]
        async fn overrides_take_effect_and_clear() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::overrides_take_effect($backend, algorithm).await;
            }
        }
        #[tokio::test]
        async fn usage_shows_grants_reservations_pauses_and_overrides() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::usage_shows_grants_reservations_pauses_and_overrides($backend, algorithm)
                    .await;
            }
        }
        #[tokio::test]
        async fn a_raised_limit_applies_at_once_to_a_reserved_backlog() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::a_raised_limit_applies_at_once_to_a_reserved_backlog($backend, algorithm)
                    .await;
            }
        }
        #[tokio::test]
        async fn a_lifted_pause_reschedules_the_backlog() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::a_lifted_pause_reschedules_the_backlog($backend, algorithm).await;
            }
        }
        #[tokio::test]
        async fn a_forfeited_slot_goes_back_to_the_next_caller() {
            for algorithm in [SlidingWindow, FixedWindow, TokenBucket] {
                cases::a_forfeited_slot_goes_back_to_the_next_caller($backend, algorithm).await;
            }
        }
        #[tokio::test]
        async fn completion_records_count_each_message_once() {
            cases::completion_records_count_each_message_once($backend).await;
        }
        #[tokio::test]
        async fn a_deep_backlog_keeps_the_sellers_state_bounded() {
            for algorithm in turnstile_core::config::Algorithm::ALL {
                cases::a_deep_backlog_keeps_the_sellers_state_bounded($backend, algorithm).await;
            }
        }
        #[tokio::test]
        async fn a_weighed_backlog_keeps_the_sliding_log_bounded() {
            cases::a_weighed_backlog_keeps_the_sliding_log_bounded($backend).await;
        }
        #[tokio::test]
        async fn a_malformed_override_is_ignored_and_the_default_applies() {
            cases::a_malformed_override_is_ignored_and_the_default_applies($backend).await;
        }
        #[tokio::test]
        async fn scripts_check_inputs_before_writing() {
            cases::scripts_check_inputs_before_writing($backend).await;
        }
        #[tokio::test]
        async fn retries_keep_the_latest_due_once_per_message_and_expire() {
            cases::retries_keep_the_latest_due_once_per_message_and_expire($backend).await;
        }
    };
}

/// Forty callers of one seller asking at the same moment: the store sends them in fewer calls
/// to Redis than callers (one seller's operations may share a call on any Redis), and the
/// limit holds exactly as if each had asked alone.
pub async fn callers_asking_together_share_calls_and_the_limit_holds(backend: Backend) {
    let keys = Keys::new(backend, "together").await;
    let store = keys.store(limiter("10/1m", Algorithm::SlidingWindow));
    let s = seller("S-together");
    let asks = (0..40).map(|_| decide(&store, Ask::new(&s).without_reserving()));
    let decisions = futures::future::join_all(asks).await;
    let granted = decisions
        .iter()
        .filter(|d| matches!(d, Decision::Granted { .. }))
        .count();
    let told_to_wait = decisions
        .iter()
        .filter(|d| matches!(d, Decision::Wait { .. }))
        .count();
    assert_eq!((granted, told_to_wait), (10, 30));
    let calls = store.batched_calls();
    assert!(
        (1..40).contains(&calls),
        "40 operations went in {calls} calls"
    );
    keys.cleanup().await;
}

/// An operation the batch script refuses fails alone: the others of its call are answered
/// and written, and a malformed batch runs nothing.
pub async fn an_operation_refused_in_a_batch_fails_alone(backend: Backend) {
    let keys = Keys::new(backend, "refused").await;
    let ks = Keyspace::new(&keys.prefix);
    let s = seller("S-refused");
    let done = |m: &str| ks.done(&s, &turnstile_core::domain::MessageId::parse(m).unwrap());
    let mut conn = keys.conn.clone();
    let registered = |key: &str| {
        let mut conn = keys.conn.clone();
        let key = key.to_owned();
        async move {
            let state: Option<String> = redis::AsyncCommands::get(&mut conn, key).await.unwrap();
            state
        }
    };
    let answers: Vec<(i64, redis::Value)> = turnstile_core::permit::scripts::batch()
        .key(done("m-1"))
        .key(ks.calls(&s))
        .key(done("m-2"))
        .key(ks.calls(&s))
        .arg(2)
        .arg("complete")
        .arg(2)
        .arg(4)
        .arg(60_000)
        .arg("registered")
        .arg("")
        .arg("")
        .arg("complete")
        .arg(2)
        .arg(4)
        .arg(60_000)
        .arg("no-such-outcome")
        .arg("")
        .arg("")
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(answers[0].0, 1, "the first operation was answered");
    assert_eq!(answers[1].0, 0, "the second was refused");
    let why: String = redis::from_redis_value(answers[1].1.clone()).unwrap();
    assert!(why.contains("OUTCOME must be"), "{why}");
    assert_eq!(
        registered(&done("m-1")).await.as_deref(),
        Some("registered")
    );
    assert_eq!(registered(&done("m-2")).await, None);
    let malformed: Result<redis::Value, _> = turnstile_core::permit::scripts::batch()
        .key(done("m-3"))
        .key(ks.calls(&s))
        .arg(1)
        .arg("complete")
        .arg(2)
        .arg(9)
        .arg(60_000)
        .arg("registered")
        .invoke_async(&mut conn)
        .await;
    let error = malformed.expect_err("a batch that names more arguments than it has");
    assert!(error.to_string().contains("malformed batch"), "{error}");
    assert_eq!(registered(&done("m-3")).await, None);
    keys.cleanup().await;
}

/// Of two deliveries of one message asking at once (on two replicas), one holds the claim of
/// its call; the claim holds for the call's bound once the call starts, ends when the call is
/// answered without registering, and a claim that led to no call ends when its delivery says so.
pub async fn a_message_s_call_is_claimed_by_one_delivery_at_a_time_until_its_call_ends(
    backend: Backend,
) {
    use turnstile_core::domain::MessageId;
    use turnstile_core::permit::{CLAIM_ASKING, CallClaim, Limiter};
    let keys = Keys::new(backend, "claimed").await;
    let timeout = Duration::from_secs(10);
    let replica = || {
        keys.store(limiter("10/1s", Algorithm::SlidingWindow))
            .with_call_timeout(timeout)
    };
    let (first, other) = (replica(), replica());
    // One claims with `SET … NX … GET` where Redis takes it, the other with `SET NX` and `GET`.
    first.probe_set_nx_get().await;
    let s = seller("S-claimed");
    let m = MessageId::parse("m-1").unwrap();
    let key = Keyspace::new(&keys.prefix).calling(&s, &m);
    let claim_left = || {
        let mut conn = keys.conn.clone();
        let key = key.clone();
        async move {
            let left: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            left
        }
    };

    let (one, two) = tokio::join!(
        first.claim_call(&s, &m, "delivery-1"),
        other.claim_call(&s, &m, "delivery-2")
    );
    let (one, two) = (one.unwrap(), two.unwrap());
    let mut answers = [one, two];
    answers.sort_by_key(|c| *c != CallClaim::Taken);
    assert_eq!(
        answers,
        [CallClaim::Taken, CallClaim::Elsewhere],
        "one claim of two"
    );
    let (holder, holder_token, waiter, waiter_token) = if one == CallClaim::Taken {
        (&first, "delivery-1", &other, "delivery-2")
    } else {
        (&other, "delivery-2", &first, "delivery-1")
    };
    assert_eq!(
        holder.claim_call(&s, &m, holder_token).await.unwrap(),
        CallClaim::Held,
        "a delivery asking again finds its own claim"
    );
    let left = claim_left().await;
    assert!(
        left > 0 && left <= CLAIM_ASKING.as_millis() as i64,
        "a question's claim holds a moment: {left} ms"
    );

    let ask = Ask::new(&s).message(&m).without_reserving();
    let here = call_now(holder, ask).await;
    holder.note_call(&here.grant);
    // The call's claim rides along with the next calls to Redis.
    let mut held = claim_left().await;
    for _ in 0..50 {
        if held > CLAIM_ASKING.as_millis() as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        held = claim_left().await;
    }
    assert!(
        held > CLAIM_ASKING.as_millis() as i64
            && held <= (timeout + Duration::from_secs(8)).as_millis() as i64,
        "held for the call's bound once it starts: {held} ms"
    );
    assert_eq!(
        waiter.claim_call(&s, &m, waiter_token).await.unwrap(),
        CallClaim::Elsewhere,
        "a copy's call is claimed while the first is in flight"
    );

    asks::finish(holder, &here, here.granted_us + 1, Ended::Failed).await;
    let mut claimed = waiter.claim_call(&s, &m, waiter_token).await.unwrap();
    // The first call's claim ends riding along with the next calls to Redis.
    for _ in 0..50 {
        if claimed == CallClaim::Taken {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        claimed = waiter.claim_call(&s, &m, waiter_token).await.unwrap();
    }
    assert_eq!(
        claimed,
        CallClaim::Taken,
        "claimed once the first call ended"
    );

    waiter.unclaim_call(&s, &m);
    let mut claimed = holder.claim_call(&s, &m, "delivery-3").await.unwrap();
    for _ in 0..50 {
        if claimed == CallClaim::Taken {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        claimed = holder.claim_call(&s, &m, "delivery-3").await.unwrap();
    }
    assert_eq!(
        claimed,
        CallClaim::Taken,
        "a claim that led to no call ends when its delivery leaves"
    );
    keys.cleanup().await;
}

/// A call's answer recorded after a while (riding along with other calls) ends the call when
/// its answer came, as the caller measured it, never later than the record and never in
/// Redis's future.
pub async fn a_late_record_ends_the_call_at_its_answer(backend: Backend) {
    let keys = Keys::new(backend, "answered").await;
    let store = keys
        .store(limiter("10/1m", Algorithm::SlidingWindow))
        .with_call_timeout(Duration::from_secs(10));
    let ks = Keyspace::new(&keys.prefix);
    let s = seller("S-answered");
    let end_of = |call: String| {
        let mut conn = keys.conn.clone();
        let key = ks.calls(&s);
        async move {
            let end: Option<f64> = redis::AsyncCommands::zscore(&mut conn, key, call)
                .await
                .unwrap();
            end.expect("the call is tracked") as i64
        }
    };
    let call = call_now(&store, Ask::new(&s).without_reserving()).await;
    let granted_us = call.granted_us;
    assert!(
        end_of(call.name().to_owned()).await > granted_us + 10_000_000,
        "in flight: its bound"
    );
    asks::finish(&store, &call, granted_us + 1, Ended::Failed).await;
    // (Recorded a round trip after the grant at least, so after the answer it names.)
    assert_eq!(end_of(call.name().to_owned()).await, granted_us + 1);
    let message = turnstile_core::domain::MessageId::parse("m-late").unwrap();
    let call = call_now(&store, Ask::new(&s).message(&message).without_reserving()).await;
    let granted_us = call.granted_us;
    let answered_us = granted_us + 3_600_000_000;
    asks::finish(&store, &call, answered_us, asks::registered(None)).await;
    let recorded_by = store.admin().redis_time_us().await.unwrap();
    let end = end_of(call.name().to_owned()).await;
    assert!(
        end >= granted_us && end <= recorded_by,
        "an answer claimed in the future ends when recorded: {end} vs {granted_us}..{recorded_by}"
    );
    keys.cleanup().await;
}

/// With TURNSTILE_RECORD_DELAY, a completion record waits to ride along: the next call to the
/// same place carries it, and nothing is sent for the record alone.
pub async fn a_record_waiting_to_ride_goes_with_the_next_call(backend: Backend) {
    let keys = Keys::new(backend, "ride").await;
    let mut settings = limiter("10/1m", Algorithm::SlidingWindow);
    settings.record_delay = Duration::from_secs(5);
    let store = keys.store(settings);
    let s = seller("S-ride");
    let message = turnstile_core::domain::MessageId::parse("m-ride").unwrap();
    let ask = Ask::new(&s).message(&message).without_reserving();
    let call = call_now(&store, ask).await;
    let calls_before = store.batched_calls();
    let record = asks::answered(&store, &call);
    let next = decide(&store, ask);
    // The record is asked for first; the acquire then goes at once, and the record with it.
    let (_, next) = tokio::join!(record, next);
    assert!(matches!(
        next,
        Decision::Granted { .. } | Decision::AlreadyDone
    ));
    assert_eq!(
        store.batched_calls() - calls_before,
        1,
        "the record rode in the acquire's call"
    );
    assert_eq!(
        decide(&store, ask).await,
        Decision::AlreadyDone,
        "and it was written"
    );
    keys.cleanup().await;
}

/// A registration's record keeps its result until the result is published: with every
/// algorithm, a copy of the message is done (never granted a second call) while the result is
/// kept and after it is trimmed; the kept result reads back as written, and the trim keeps the
/// record and its TTL.
pub async fn a_record_keeping_its_result_is_done_before_and_after_it_is_trimmed(backend: Backend) {
    for algorithm in Algorithm::ALL {
        let keys = Keys::new(backend, "kept").await;
        let store = keys.store(limiter("10/1m", algorithm));
        let s = seller("S-kept");
        let message = turnstile_core::domain::MessageId::parse("m-kept").unwrap();
        let ask = Ask::new(&s).message(&message).without_reserving();
        let call = asks::call(&store, ask)
            .await
            .unwrap_or_else(|| panic!("{algorithm}: the first call is granted"));
        let result = r#"{"message_id":"m-kept","outcome":"registered","status":201}"#;
        let answer = Ended::Registered {
            told: None,
            batch: None,
            ttl: Duration::from_secs(60),
            result: Some(result),
        };
        asks::finish(&store, &call, call.granted_us, answer).await;
        let copy = || decide(&store, ask);
        assert_eq!(
            copy().await,
            Decision::AlreadyDone,
            "{algorithm}: a copy is not called while its result is kept"
        );
        let records = store.records();
        assert_eq!(
            records
                .pending_result(&s, &message)
                .await
                .unwrap()
                .as_deref(),
            Some(result),
            "{algorithm}: the kept result reads back as written"
        );
        let state = records.message_state(&s, &message).await.unwrap();
        assert_eq!(state.map(|(state, _)| state).as_deref(), Some("registered"));
        store.result_published(&s, &message);
        // Nobody waits for the trim: it rides along with the store's next call within its
        // record delay.
        super::eventually_async("the kept result trimmed", async || {
            records
                .pending_result(&s, &message)
                .await
                .unwrap()
                .is_none()
        })
        .await;
        let (state, ttl) = records.message_state(&s, &message).await.unwrap().unwrap();
        assert_eq!(
            state, "registered",
            "{algorithm}: trimmed, still registered"
        );
        assert!(
            ttl.is_some_and(|t| t > Duration::from_secs(50)),
            "{algorithm}: its TTL kept"
        );
        assert_eq!(
            copy().await,
            Decision::AlreadyDone,
            "{algorithm}: and a copy is still not called"
        );
        keys.cleanup().await;
    }
}

/// How many members the sorted set `key` holds.
async fn members(keys: &Keys, key: &str) -> usize {
    redis::cmd("ZCARD")
        .arg(key)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap()
}

fn message(id: &str) -> turnstile_core::domain::MessageId {
    turnstile_core::domain::MessageId::parse(id).unwrap()
}

/// A grant of a seller far from its limit brings a block into the seller's pool: the next
/// calls are units of it (`<token>-2`, ...), a message already registered takes none, and the
/// units no call used leave the seller's log at the first acquire after their hold.
pub async fn a_seller_far_from_its_limit_gets_a_block_whose_unused_units_are_given_back(
    backend: Backend,
) {
    let keys = Keys::new(backend, "block").await;
    let store = keys.store(limiter("100/1m", Algorithm::SlidingWindow));
    let (space, s) = (Keyspace::new(&keys.prefix), seller("S-block"));
    let log = space.state(&s, Algorithm::SlidingWindow);
    let grant = |id: &'static str| {
        let store = &store;
        let s = &s;
        async move {
            let message = message(id);
            call_now(store, Ask::new(s).message(&message)).await
        }
    };
    let first = grant("m-1").await.name().to_owned();
    assert!(
        !first.contains('-'),
        "the first call is the acquire's own: {first}"
    );
    let block = members(&keys, &space.pool(&s)).await;
    assert_eq!(block, 16, "a new seller's first block");
    assert_eq!(members(&keys, &log).await, 1 + block);
    let mut units: Vec<asks::Call> = Vec::new();
    for id in ["m-2", "m-3", "m-4"] {
        let unit = grant(id).await;
        assert!(
            unit.name().starts_with(&format!("{first}-"))
                && !units.iter().any(|u| u.name() == unit.name()),
            "a unit of the block, each once: {}",
            unit.name()
        );
        units.push(unit);
    }
    assert_eq!(members(&keys, &space.pool(&s)).await, block - 3);

    asks::answered(&store, &units[0]).await;
    assert_eq!(
        decide(&store, Ask::new(&s).message(&message("m-2"))).await,
        Decision::AlreadyDone,
        "a registered message is not called again from a block"
    );

    // After the hold, the next acquire gives the units no call used back before it decides.
    tokio::time::sleep(turnstile_core::permit::block::BLOCK_HOLD + Duration::from_millis(200))
        .await;
    let last = grant("m-5").await;
    let pool = members(&keys, &space.pool(&s)).await;
    assert!(
        !last.name().contains('-'),
        "an acquire's own call: {}",
        last.name()
    );
    assert_eq!(
        members(&keys, &log).await,
        4 + 1 + pool,
        "the four calls made and the last stay in the log with a new block; the units not \
         called left it"
    );
    assert_eq!(members(&keys, &space.calls(&s)).await, 4 + 1 + pool);
    store.write_pool_answers().await;
    keys.cleanup().await;
}

/// One replica's grant fills the seller's pool, and another replica's calls of the seller are
/// units of it: the first claimed by its acquire, the next by plain claims; a registration
/// made with a unit brings the unit's end forward to its answer.
pub async fn a_pool_made_by_one_replica_serves_another_replicas_calls(backend: Backend) {
    let keys = Keys::new(backend, "pool-shared").await;
    let maker = keys.store(limiter("100/1m", Algorithm::SlidingWindow));
    let user = keys.store(limiter("100/1m", Algorithm::SlidingWindow));
    let (space, s) = (Keyspace::new(&keys.prefix), seller("S-shared"));
    let first = call_now(&maker, Ask::new(&s)).await.name().to_owned();
    let pool = members(&keys, &space.pool(&s)).await;
    assert!(pool > 2, "a block was taken: {pool}");
    let mut calls = Vec::new();
    for i in 0..2 {
        let message = message(&format!("u-{i}"));
        let call = call_now(&user, Ask::new(&s).message(&message)).await;
        assert!(
            call.name().starts_with(&format!("{first}-")),
            "a unit of the pool is granted: {}",
            call.name()
        );
        calls.push(call);
    }
    assert_eq!(members(&keys, &space.pool(&s)).await, pool - 2);
    asks::answered(&user, &calls[1]).await;
    user.write_pool_answers().await;
    let (call, granted_us) = (calls[1].name(), &calls[1].granted_us);
    let end: f64 = redis::cmd("ZSCORE")
        .arg(space.calls(&s))
        .arg(call)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert_eq!(
        end as i64, *granted_us,
        "the unit's end came forward to its answer"
    );
    let accepted: Option<f64> = redis::cmd("ZSCORE")
        .arg(space.accepted(&s))
        .arg(call)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert_eq!(
        accepted.map(|a| a as i64),
        Some(*granted_us),
        "noted accepted"
    );
    keys.cleanup().await;
}

/// A unit whose end in the seller's calls comes before a call claimed now could answer (its
/// hold is over) is never used: neither a plain claim nor an acquire takes it, and the acquire
/// gives the pool's stale units back before it decides.
pub async fn a_pool_unit_a_call_could_outlive_is_not_used(backend: Backend) {
    let keys = Keys::new(backend, "pool-late").await;
    let store = keys
        .store(limiter("100/1m", Algorithm::SlidingWindow))
        .with_call_timeout(Duration::from_secs(10));
    let (space, s) = (Keyspace::new(&keys.prefix), seller("S-late"));
    decide(&store, Ask::new(&s)).await;
    let pool = space.pool(&s);
    let units: Vec<String> = redis::cmd("ZRANGE")
        .arg(&pool)
        .arg(0)
        .arg(-1)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert!(!units.is_empty(), "a block was taken");
    // Every unit now ends one second from now: before a call claimed now could answer (its
    // bound is 1 s + the 10 s timeout).
    let (secs, micros): (i64, i64) = redis::cmd("TIME")
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    let soon = secs * 1_000_000 + micros + 1_000_000;
    for unit in &units {
        let _: () = redis::pipe()
            .cmd("ZADD")
            .arg(&pool)
            .arg("XX")
            .arg(soon)
            .arg(unit)
            .ignore()
            .cmd("ZADD")
            .arg(space.calls(&s))
            .arg("XX")
            .arg(soon)
            .arg(unit)
            .ignore()
            .query_async(&mut keys.conn.clone())
            .await
            .unwrap();
    }
    let call = call_now(&store, Ask::new(&s)).await;
    let call = call.name();
    assert!(!call.contains('-'), "no late unit was used: {call}");
    let left: Vec<String> = redis::cmd("ZRANGE")
        .arg(&pool)
        .arg(0)
        .arg(-1)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert!(
        left.iter().all(|u| !units.contains(u)),
        "the late units left the pool: {left:?}"
    );
    keys.cleanup().await;
}

/// A seller asked about on a Redis server that did not write its state (restarted with writes
/// lost, failed over) loses its pool with the first acquire: a pool restored with units claimed
/// since is never claimed from; its units stay counted until they end.
pub async fn a_pool_on_a_server_that_did_not_write_it_is_dropped(backend: Backend) {
    let keys = Keys::new(backend, "pool-server").await;
    let store = keys.store(turnstile_core::config::LimiterArgs {
        redis_durable: false,
        ..limiter("100/1m", Algorithm::SlidingWindow)
    });
    let (space, s) = (Keyspace::new(&keys.prefix), seller("S-server"));
    decide(&store, Ask::new(&s)).await;
    let units = members(&keys, &space.pool(&s)).await;
    assert!(units > 0, "a block was taken");
    // As after a restore: the state carries another server's stamp.
    let _: () = redis::cmd("SET")
        .arg(space.server(&s))
        .arg("another-server")
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    let other = keys.store(turnstile_core::config::LimiterArgs {
        redis_durable: false,
        ..limiter("100/1m", Algorithm::SlidingWindow)
    });
    let decision = decide(&other, Ask::new(&s)).await;
    let Decision::Wait { reservation, .. } = decision else {
        panic!("the seller is paused first: {decision:?}");
    };
    assert_eq!(
        members(&keys, &space.pool(&s)).await,
        0,
        "the pool was dropped"
    );
    assert_eq!(
        members(&keys, &space.state(&s, Algorithm::SlidingWindow)).await,
        1 + units + usize::from(reservation.is_some()),
        "its units stay in the log (beside the slot reserved after the pause)"
    );
    keys.cleanup().await;
}

/// A change of the seller's terms takes back the units of its pool no call claimed yet, in
/// the same step: none granted under the old terms is claimed under the new ones.
pub async fn a_change_of_terms_takes_back_the_pools_unclaimed_units(backend: Backend) {
    let keys = Keys::new(backend, "pool-terms").await;
    let store = keys.store(limiter("100/1m", Algorithm::SlidingWindow));
    let (space, s) = (Keyspace::new(&keys.prefix), seller("S-terms"));
    decide(&store, Ask::new(&s)).await;
    assert!(
        members(&keys, &space.pool(&s)).await > 0,
        "a block was taken"
    );
    store
        .admin()
        .set_limit(&s, "50/1m".parse::<Limits>().unwrap())
        .await
        .unwrap();
    assert_eq!(members(&keys, &space.pool(&s)).await, 0);
    assert_eq!(
        members(&keys, &space.state(&s, Algorithm::SlidingWindow)).await,
        1,
        "only the call made stays in the log"
    );
    assert_eq!(members(&keys, &space.calls(&s)).await, 1);
    let call = call_now(&store, Ask::new(&s)).await;
    let call = call.name();
    assert!(
        !call.contains('-'),
        "an acquire's own call, no old unit: {call}"
    );
    keys.cleanup().await;
}

/// Two replicas' stores under `limit` (sliding-window): one taking permit blocks, one not.
fn with_and_without_blocks(keys: &Keys, limit: &str) -> (PermitStore, PermitStore) {
    let with = keys.store(limiter(limit, Algorithm::SlidingWindow));
    let without = keys.store(turnstile_core::config::LimiterArgs {
        permit_block: 0,
        ..limiter(limit, Algorithm::SlidingWindow)
    });
    (with, without)
}

/// Units in a seller's pool no one uses never keep a call waiting: an acquire short of room
/// takes them back, and the replica that made the pool finds it empty and asks again.
pub async fn units_a_replica_does_not_use_go_to_another_replicas_calls(backend: Backend) {
    let keys = Keys::new(backend, "reclaim").await;
    let (holder, other) = with_and_without_blocks(&keys, "16/1h");
    let (space, s) = (Keyspace::new(&keys.prefix), seller("S-reclaim"));
    let decision = decide(&holder, Ask::new(&s)).await;
    assert!(matches!(decision, Decision::Granted { .. }));
    assert_eq!(
        members(&keys, &space.pool(&s)).await,
        4,
        "a block is at most a quarter of the count"
    );
    let mut granted = 0;
    while let Decision::Granted { .. } = decide(&other, Ask::new(&s).without_reserving()).await {
        granted += 1;
        assert!(granted <= 15, "more than the limit");
    }
    assert_eq!(granted, 15, "the whole limit but the holder's one call");
    let decision = decide(&holder, Ask::new(&s)).await;
    assert!(
        matches!(decision, Decision::Wait { .. }),
        "the holder's unit was taken back: it asks and waits ({decision:?})"
    );
    assert_eq!(
        members(&keys, &space.calls(&s)).await,
        16,
        "the calls made: the holder's one and the other's 15; no unit left over"
    );
    keys.cleanup().await;
}

/// Two replicas whose callers take blocks (while the seller is far from its limit) and
/// contend for it (after), answering each call at once: no window of the limit holds more than
/// COUNT calls, counted at the time each was granted or handed out.
pub async fn replicas_taking_blocks_together_keep_the_limit_exact(backend: Backend) {
    let keys = Keys::new(backend, "blocks-exact").await;
    let stores = [
        Arc::new(keys.store(limiter("40/1s", Algorithm::SlidingWindow))),
        Arc::new(keys.store(limiter("40/1s", Algorithm::SlidingWindow))),
    ];
    let s = seller("S-blocks");
    let granted = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for store in &stores {
        for _ in 0..8 {
            let (store, s, granted) = (store.clone(), s.clone(), granted.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    let call = call_in_time(&store, Ask::new(&s)).await;
                    // A call is made when it is granted (a reserved slot may be granted after
                    // it, once the calls of its window are answered).
                    let from_block = call.name().contains('-');
                    granted.lock().await.push((call.granted_us, from_block));
                    asks::answered(&store, &call).await;
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let granted = granted.lock().await.clone();
    assert_eq!(granted.len(), 2 * 8 * 10);
    assert!(
        granted.iter().any(|(_, from_block)| *from_block),
        "some calls came from blocks"
    );
    let slots: Vec<i64> = granted.iter().map(|(slot, _)| *slot).collect();
    let most = max_in_any_window(&slots, 1_000_000);
    assert!(most <= 40, "more than COUNT in a window: {most}");
    for store in &stores {
        store.write_pool_answers().await;
    }
    keys.cleanup().await;
}

/// A block's units are in flight until the end of its hold plus their bound; a plain grant
/// made afterwards (shorter bound) must not let the seller's calls expire before them.
pub async fn a_later_grant_never_shortens_the_life_of_a_blocks_units(backend: Backend) {
    let keys = Keys::new(backend, "block-ttl").await;
    let (holder, other) = with_and_without_blocks(&keys, "100/1s");
    let (space, s) = (Keyspace::new(&keys.prefix), seller("S-ttl"));
    decide(&holder, Ask::new(&s)).await;
    assert!(
        members(&keys, &space.pool(&s)).await > 0,
        "a block was taken"
    );
    assert!(matches!(
        decide(&other, Ask::new(&s).without_reserving()).await,
        Decision::Granted { .. }
    ));
    let calls = space.calls(&s);
    let (time, ttl_ms, last): (Vec<i64>, i64, Vec<(String, f64)>) = redis::pipe()
        .cmd("TIME")
        .cmd("PTTL")
        .arg(&calls)
        .cmd("ZRANGE")
        .arg(&calls)
        .arg(-1)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    let now_us = time[0] * 1_000_000 + time[1];
    let last_end_us = last[0].1 as i64;
    assert!(
        now_us + ttl_ms * 1000 >= last_end_us,
        "the calls expire {} ms before the block's last unit ends",
        (last_end_us - now_us) / 1000 - ttl_ms
    );
    keys.cleanup().await;
}
