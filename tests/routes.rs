//! Routes: several endpoints of one provider, each with its own per-seller limit, under one
//! budget per seller (TURNSTILE_LIMIT), against a strict mock that enforces every one of them;
//! and the cost a call's answer reports replacing its requested cost.
mod support;

use std::path::PathBuf;

use turnstile_core::broker::{header_str, headers};
use turnstile_core::config::Limits;
use turnstile_core::replica::Starting;
use turnstile_lab::mock_api::MockArgs;
use turnstile_lab::rig::Rig;

fn limits(s: &str) -> Limits {
    s.parse().unwrap()
}

/// A routes file of `routes` (name, method, URL, limit) written for the test, removed on drop.
struct RoutesFile(PathBuf);

impl RoutesFile {
    fn write(test: &str, routes: &[(&str, &str, String, &str)]) -> Self {
        let mut text = String::new();
        for (name, method, url, limit) in routes {
            text.push_str(&format!(
                "[routes.{name}]\nmethod = \"{method}\"\nurl = \"{url}\"\nlimit = \"{limit}\"\n\n"
            ));
        }
        let path = std::env::temp_dir().join(format!(
            "turnstile-routes-{test}-{:08x}.toml",
            rand::random::<u32>()
        ));
        std::fs::write(&path, text).unwrap();
        Self(path)
    }
}

impl Drop for RoutesFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A message of `seller` on `route` (none: the default endpoint) costing `cost` units, whose
/// product tells the mock what it really costs (`charge`), if given.
fn body(id: &str, seller: &str, route: Option<&str>, cost: u32, charge: Option<u32>) -> Vec<u8> {
    let mut product = serde_json::json!({ "sku": id, "cost": cost });
    if let Some(charge) = charge {
        product["charge"] = charge.into();
    }
    let mut body = serde_json::json!({
        "message_id": id, "seller_id": seller, "cost": cost, "product": product,
    });
    if let Some(route) = route {
        body["route"] = route.into();
    }
    body.to_string().into_bytes()
}

/// Routes of `(name, limit)`, as a routes file gives them (the URLs are never called).
fn routes_of(routes: &[(&str, &str)]) -> std::sync::Arc<turnstile_core::routes::Routes> {
    let text: String = routes
        .iter()
        .map(|(name, limit)| {
            format!(
                "[routes.{name}]\nmethod = \"POST\"\nurl = \"http://127.0.0.1:1/{{seller_id}}\"\nlimit = \"{limit}\"\n"
            )
        })
        .collect();
    std::sync::Arc::new(turnstile_core::routes::Routes::parse(&text).unwrap())
}

/// The route `name` of `routes`.
fn route_in(
    routes: &turnstile_core::routes::Routes,
    name: &str,
) -> std::sync::Arc<turnstile_core::routes::Route> {
    let name = turnstile_core::domain::RouteName::parse(name).unwrap();
    routes.get(&name).unwrap().clone()
}

/// One unit asked for on `route` for `seller`: its slot (µs, Redis time), and whether it was
/// granted now (else reserved).
async fn ask_on(
    store: &turnstile_core::permit::PermitStore,
    seller: &turnstile_core::domain::SellerId,
    route: &std::sync::Arc<turnstile_core::routes::Route>,
) -> (i64, bool) {
    use turnstile_core::permit::{Ask, Decision};
    match support::asks::decide(store, Ask::new(seller).route(Some(route))).await {
        Decision::Granted { slot_us, .. } => (slot_us, true),
        Decision::Wait {
            reservation: Some(r),
            ..
        } => (r.slot_us, false),
        other => panic!("{other:?}"),
    }
}

async fn publish(rig: &mut Rig, bodies: impl IntoIterator<Item = Vec<u8>>) -> anyhow::Result<()> {
    for body in bodies {
        rig.publish_body(&body).await?;
    }
    Ok(())
}

/// Budget 10/1s per seller; `register` (POST) 6/1s and `price` (PUT) 4/1s per seller. Seller A
/// sends 30 on each route and 10 to the default endpoint, seller B 20 on `price`; 2 replicas of
/// 4 workers; one request in ten reaches the API 300 ms late. The mock holds every seller to
/// the budget over all its requests and to each route's limit: it never answers 429.
#[tokio::test]
async fn calls_on_several_routes_stay_within_each_routes_limit_and_the_sellers_budget()
-> anyhow::Result<()> {
    let mock = MockArgs {
        routes: vec![
            ("register".into(), limits("6/1s")),
            ("price".into(), limits("4/1s")),
        ],
        slow_rate: 0.1,
        slow_ms: 300,
        ..MockArgs::local(limits("10/1s"))
    };
    let mut rig = support::rig("routes", "10/1s")
        .with_mock(mock)
        .prepare()
        .await?;
    let file = RoutesFile::write(
        "routes",
        &[
            ("register", "POST", rig.mock.route_url("register"), "6/1s"),
            ("price", "PUT", rig.mock.route_url("price"), "4/1s"),
        ],
    );
    let mut settings = rig.settings(4);
    settings.routes.file = Some(file.0.clone());
    rig.start_replica(settings.clone()).await?;
    rig.start_replica(settings).await?;
    let mut bodies = Vec::new();
    for i in 0..30 {
        bodies.push(body(&format!("A-r{i}"), "S-A", Some("register"), 1, None));
        bodies.push(body(&format!("A-p{i}"), "S-A", Some("price"), 1, None));
        if i < 10 {
            bodies.push(body(&format!("A-d{i}"), "S-A", None, 1, None));
        }
        if i < 20 {
            bodies.push(body(&format!("B-p{i}"), "S-B", Some("price"), 1, None));
        }
    }
    publish(&mut rig, bodies).await?;
    let stats = rig.wait_registered(90).await?;
    rig.stop_replicas().await?;
    let (register, price) = (&stats.routes["register"], &stats.routes["price"]);
    let a = &stats.sellers["S-A"];
    println!(
        "budget 10/1s, register 6/1s, price 4/1s: {} violations; most in a window: seller A {} \
         (budget), register {}, price {}; seller A drained in {} ms (price alone needs 7.25 s)",
        stats.violations,
        a.max_in_window,
        register.max_in_window,
        price.max_in_window,
        a.last_ms.unwrap_or(0) - a.first_ms.unwrap_or(0)
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!((register.registered, price.registered), (30, 50));
    assert_eq!(stats.sellers["S-A"].registered, 70);
    assert_eq!(stats.sellers["S-B"].registered, 20);
    assert!(a.max_in_window <= 10 && register.max_in_window <= 6 && price.max_in_window <= 4);
    assert_eq!(rig.dead_lettered().await?, 0);
    rig.cleanup().await
}

/// A message naming a route the file does not have is dead-lettered as `invalid-message`, never
/// called; one naming a route is called on that route's method and URL.
#[tokio::test]
async fn a_message_naming_an_unknown_route_is_dead_lettered_as_invalid() -> anyhow::Result<()> {
    let mock = MockArgs {
        routes: vec![("stock".into(), limits("5/1s"))],
        ..MockArgs::local(limits("10/1s"))
    };
    let mut rig = support::rig("routes-unknown", "10/1s")
        .with_mock(mock)
        .prepare()
        .await?;
    let file = RoutesFile::write(
        "unknown",
        &[("stock", "PATCH", rig.mock.route_url("stock"), "5/1s")],
    );
    let mut settings = rig.settings(2);
    settings.routes.file = Some(file.0.clone());
    rig.start_replica(settings).await?;
    publish(
        &mut rig,
        [
            body("u-1", "S-U", Some("images"), 1, None),
            body("u-2", "S-U", Some("stock"), 1, None),
        ],
    )
    .await?;
    let dead = rig.dead_letters(1).await?;
    let stats = rig.wait_registered(1).await?;
    rig.stop_replicas().await?;
    let reason = header_str(&dead[0], headers::REASON);
    let detail = header_str(&dead[0], headers::DETAIL);
    println!("dead letter: {reason:?} {detail:?}");
    assert_eq!(reason.as_deref(), Some("invalid-message"));
    assert!(detail.unwrap_or_default().contains("route"));
    assert_eq!(stats.routes["stock"].registered, 1);
    assert_eq!(
        stats.requests, 1,
        "the unknown route was never called: {stats:?}"
    );
    let seen = rig.mock.recent_requests();
    assert_eq!(seen.len(), 1);
    rig.cleanup().await
}

/// A bad routes file stops the replica before it connects anywhere, in one line naming the
/// route and the field.
#[tokio::test]
async fn a_bad_routes_file_stops_startup_with_one_line_naming_the_route_and_the_field()
-> anyhow::Result<()> {
    let rig = support::rig("routes-bad", "10/1s").prepare().await?;
    let file = RoutesFile::write(
        "bad",
        &[("price", "PUT", rig.mock.route_url("price"), "ten/1s")],
    );
    let mut settings = rig.settings(1);
    settings.routes.file = Some(file.0.clone());
    let error = Starting::new(settings).err().expect("refused").to_string();
    println!("{error}");
    assert!(error.contains("route \"price\": field `limit`"), "{error}");
    assert!(!error.contains('\n'));
    let mut settings = rig.settings(1);
    settings.routes.file = Some(file.0.with_extension("missing"));
    let error = Starting::new(settings).err().expect("refused").to_string();
    assert!(error.contains("TURNSTILE_ROUTES_FILE"), "{error}");
    rig.cleanup().await
}

/// The mock reports each call's real cost in `X-Request-Cost`: messages ask for 5 units of a
/// 10/1s budget and really cost 1. The reported cost replaces the requested one in the seller's
/// windows, for every replica: the units refunded are free at once for the next calls, so more
/// than two calls (what 5 units each allow) go through in one window, and none over the API's
/// limit.
#[tokio::test]
async fn a_refund_reported_by_the_api_frees_its_units_for_the_next_calls() -> anyhow::Result<()> {
    let mock = MockArgs {
        cost_header: Some("X-Request-Cost".into()),
        ..MockArgs::local(limits("10/1s"))
    };
    let mut rig = support::rig("routes-cost", "10/1s")
        .with_mock(mock)
        .prepare()
        .await?;
    let mut settings = rig.settings(4);
    settings.downstream.cost_header = Some("x-request-cost".parse()?);
    rig.start_replica(settings).await?;
    publish(
        &mut rig,
        (0..40).map(|i| body(&format!("c-{i}"), "S-C", None, 5, Some(1))),
    )
    .await?;
    let stats = rig.wait_registered(40).await?;
    rig.stop_replicas().await?;
    let seller = &stats.sellers["S-C"];
    println!(
        "40 asking 5 units of 10/1s, charged 1: {} violations, most units in a window {}, \
         drained in {} ms (20 s at the requested cost)",
        stats.violations,
        seller.max_in_window,
        seller.last_ms.unwrap_or(0) - seller.first_ms.unwrap_or(0)
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert!(
        seller.max_in_window > 2,
        "refunds let more than two calls into a window: {stats:?}"
    );
    assert_eq!(seller.units, 40);
    rig.cleanup().await
}

/// The mock charges 4 units for calls that ask 1 of a 10/1s budget, says so in
/// `X-Request-Cost`, and counts the charge (it only checks the 1 unit asked on arrival, so it
/// lets a window go over: `over_limit`). Seller A's first call teaches 2 replicas of 4 workers
/// the charge; then 16 of its messages are published at once: every one is asked at the charge
/// learned, so no window of the API holds more than 10 units. Seller C does the same on a route
/// (`price`, 10/1s), whose charge is learned apart. Seller B publishes 16 at once with nothing
/// learned yet: only the calls granted before its first answer came back, at the cost asked,
/// may go over; the reservations made at that cost are given back when the charge is learned
/// and asked again at it.
#[tokio::test]
async fn a_charge_reported_by_the_api_is_asked_for_before_the_next_calls() -> anyhow::Result<()> {
    let mock = MockArgs {
        cost_header: Some("X-Request-Cost".into()),
        routes: vec![("price".into(), limits("10/1s"))],
        ..MockArgs::local(limits("10/1s"))
    };
    let mut rig = support::rig("routes-charge", "10/1s")
        .with_mock(mock)
        .prepare()
        .await?;
    let file = RoutesFile::write(
        "charge",
        &[("price", "PUT", rig.mock.route_url("price"), "10/1s")],
    );
    for _ in 0..2 {
        let mut settings = rig.settings(4);
        settings.downstream.cost_header = Some("x-request-cost".parse()?);
        settings.routes.file = Some(file.0.clone());
        rig.start_replica(settings).await?;
    }
    publish(
        &mut rig,
        [
            body("a-first", "S-A", None, 1, Some(4)),
            body("c-first", "S-C", Some("price"), 1, Some(4)),
        ],
    )
    .await?;
    rig.wait_registered(2).await?;
    let batch = |seller: &str, route: Option<&str>| {
        (0..16)
            .map(|i| body(&format!("{seller}-{i}"), seller, route, 1, Some(4)))
            .collect::<Vec<_>>()
    };
    let mut bodies = batch("S-A", None);
    bodies.extend(batch("S-C", Some("price")));
    publish(&mut rig, bodies).await?;
    rig.wait_registered(34).await?;
    publish(&mut rig, batch("S-B", None)).await?;
    let stats = rig.wait_registered(50).await?;
    rig.stop_replicas().await?;
    let (a, b, c) = (
        &stats.sellers["S-A"],
        &stats.sellers["S-B"],
        &stats.sellers["S-C"],
    );
    let drained =
        |s: &turnstile_lab::mock_api::SellerStats| s.last_ms.unwrap_or(0) - s.first_ms.unwrap_or(0);
    println!(
        "asking 1 unit of 10/1s, charged 4: the charge learned first: {} calls over the limit, \
         {} refused, most units in a window {}, 17 in {} ms; on a route: {} over, {} refused, \
         17 in {} ms; 16 published with nothing learned: {} over, {} refused, most units in a \
         window {}, in {} ms",
        a.over_limit,
        a.violations,
        a.max_in_window,
        drained(a),
        c.over_limit,
        c.violations,
        drained(c),
        b.over_limit,
        b.violations,
        b.max_in_window,
        drained(b)
    );
    assert_eq!((a.over_limit, a.violations), (0, 0), "{stats:?}");
    assert_eq!((c.over_limit, c.violations), (0, 0), "{stats:?}");
    // Granted at 1 unit before the first answer: at most 10 (10 units in flight), of which the
    // first 2 fit at 4 units each.
    assert!(b.over_limit <= 8, "{stats:?}");
    assert_eq!(
        (a.units, b.units, c.units),
        (17 * 4, 16 * 4, 17 * 4),
        "{stats:?}"
    );
    rig.cleanup().await
}

/// The scripts alone: a call on a route takes units of the route's log and of the seller's
/// log in one step; when the seller's terms change (a limit set), the route's reservations
/// leave the route's log with the seller's, so the backlog is slotted afresh on both; a
/// reservation given back by its message leaves both too.
#[tokio::test]
async fn a_routes_reservations_leave_its_log_with_the_sellers_when_they_are_given_back() {
    use support::{Backend, Keys, limiter};
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::{Cost, SellerId};
    use turnstile_core::permit::{Ask, Limiter, keys_matching};

    let keys = Keys::new(Backend::Standalone, "route-logs").await;
    let routes = routes_of(&[("price", "2/10s")]);
    let route = route_in(&routes, "price");
    let store = keys
        .store(limiter("5/10s", Algorithm::SlidingWindow))
        .with_routes(routes.clone());
    let s = SellerId::parse("S-logs").unwrap();
    let mut held = Vec::new();
    let mut granted = 0;
    for _ in 0..6 {
        match support::asks::decide(&store, Ask::new(&s).route(Some(&route))).await {
            turnstile_core::permit::Decision::Granted { .. } => granted += 1,
            turnstile_core::permit::Decision::Wait {
                reservation: Some(r),
                ..
            } => held.push(r),
            other => panic!("{other:?}"),
        }
    }
    // The route's 2/10s binds, not the seller's 5/10s: two calls now, the rest reserved at
    // the route's pace, each slot also held in the seller's log.
    assert_eq!((granted, held.len()), (2, 4));
    let gap = held[2].slot_us - held[0].slot_us;
    assert!(gap >= 10_000_000, "route slots 10 s apart: {gap} µs");
    let conn = keys.conn.clone();
    let card = |key: String| {
        let mut conn = conn.clone();
        async move {
            redis::AsyncCommands::zcard::<_, u64>(&mut conn, key)
                .await
                .unwrap()
        }
    };
    let found = keys_matching(&keys.conn, &format!("{}:*route:price:log", keys.prefix))
        .await
        .unwrap();
    assert_eq!(found.len(), 1);
    let route_log = found[0].clone();
    let seller_log = route_log.replace("route:price:log", "log");
    assert_eq!(
        (
            card(route_log.clone()).await,
            card(seller_log.clone()).await
        ),
        (6, 6)
    );

    // Given back by its message: both logs.
    assert!(
        store
            .unreserve(&s, &held[3], Cost::ONE, Some(&route))
            .await
            .unwrap()
    );
    assert_eq!(
        (
            card(route_log.clone()).await,
            card(seller_log.clone()).await
        ),
        (5, 5)
    );

    // A change of the seller's terms gives every reservation back, in the route's log too.
    store.admin().set_limit(&s, limits("6/10s")).await.unwrap();
    assert_eq!(
        (
            card(route_log.clone()).await,
            card(seller_log.clone()).await
        ),
        (2, 2)
    );
    keys.cleanup().await;
}

/// The scripts alone: a charge reported above the requested cost is learned per seller and
/// endpoint, and asked for by the next calls; when it is learned, the endpoint's reservations
/// made for fewer units are given back (their messages find their slot gone and reserve again
/// at the charge, saying so in their reservation); a call asked at the charge and charged its
/// own cost forgets it; the key is read as untrusted; a route's charge is the route's alone.
#[tokio::test]
async fn a_charge_is_learned_per_endpoint_and_gives_back_the_reservations_made_for_less() {
    use std::sync::Arc;
    use support::asks::{Call, call_now};
    use support::{Backend, Keys, limiter};
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::{Cost, SellerId};
    use turnstile_core::permit::{Ask, Decision, Forfeit, Limiter, PermitStore};
    use turnstile_core::routes::Route;

    let keys = Keys::new(Backend::Standalone, "charges").await;
    let routes = routes_of(&[("price", "10/10s")]);
    let route = route_in(&routes, "price");
    let store = keys
        .store(limiter("10/10s", Algorithm::SlidingWindow))
        .with_routes(routes.clone())
        .with_learned_charges(true);
    let s = SellerId::parse("S-charges").unwrap();
    let one = Cost::ONE;
    let cost = |units| Cost::new(units).unwrap();
    // The units a call of `units` on `route` (none: the default endpoint) asks for, asked of a
    // seller whose window is full: told to wait, without reserving, it takes nothing.
    let asks_for = async |store: &PermitStore, units: Cost, route: Option<&Arc<Route>>| {
        let ask = Ask::new(&s).cost(units).route(route).without_reserving();
        let asked = store.ask(ask).await.unwrap();
        assert!(
            matches!(
                asked.decision,
                Decision::Wait {
                    reservation: None,
                    ..
                }
            ),
            "{:?}",
            asked.decision
        );
        asked.cost
    };
    // 10 calls of one unit, asking for one (no charge learned), then 2 reserved for the next
    // window.
    let mut calls = Vec::new();
    let mut held = Vec::new();
    for _ in 0..12 {
        let ask = Ask::new(&s);
        let asked = store.ask(ask).await.unwrap();
        assert_eq!(asked.cost, one);
        match &asked.decision {
            Decision::Granted { .. } => {
                calls.push(Call::of(ask, &asked.decision, asked.cost).unwrap());
            }
            Decision::Wait {
                reservation: Some(r),
                ..
            } => held.push(r.clone()),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((calls.len(), held.len()), (10, 2));
    let reserved_key = format!("{}:{{S-charges}}:reserved:sliding-window", keys.prefix);
    let mut conn = keys.conn.clone();
    let reserved = async |conn: &mut turnstile_core::permit::RedisConn| -> u64 {
        redis::AsyncCommands::zcard(conn, &reserved_key)
            .await
            .unwrap()
    };
    assert_eq!(reserved(&mut conn).await, 2);
    let used = async || store.admin().usage(&s).await.unwrap().used;
    assert_eq!(used().await, 10);

    // The first call's answer: charged 4 for 1 asked. Its 3 units more are counted; the charge
    // is learned; the slots reserved at 1 unit on the default endpoint are given back.
    store.recost(&calls[0].grant, 4).await;
    assert_eq!(used().await, 13);
    assert_eq!(asks_for(&store, one, None).await, cost(4));
    assert_eq!(asks_for(&store, cost(6), None).await, cost(6));
    assert_eq!(reserved(&mut conn).await, 0);
    // Not on the route: its charge is its own.
    assert_eq!(asks_for(&store, one, Some(&route)).await, one);

    // A message back for its slot finds it gone and reserves again at the charge, saying so.
    let asked = store.ask(Ask::new(&s).held(Some(&held[0]))).await.unwrap();
    assert_eq!(asked.forfeit, Some(Forfeit::NotReserved));
    assert_eq!(asked.cost, cost(4));
    let Decision::Wait {
        reservation: Some(again),
        ..
    } = asked.decision
    else {
        panic!("{:?}", asked.decision)
    };
    assert_eq!(again.cost, Some(cost(4)));
    // Given back by its message at the units it was reserved for.
    assert!(store.unreserve(&s, &again, one, None).await.unwrap());

    // A call granted before the charge was learned and charged less says nothing new.
    store.recost(&calls[1].grant, 2).await;
    assert_eq!(asks_for(&store, one, None).await, cost(4));

    // One asked at the charge and charged its own cost forgets it (a seller with room for a
    // call at the charge: one call, charged 4).
    let roomy = SellerId::parse("S-roomy").unwrap();
    let first = call_now(&store, Ask::new(&roomy)).await;
    store.recost(&first.grant, 4).await;
    let at_the_charge = call_now(&store, Ask::new(&roomy)).await;
    assert_eq!(at_the_charge.grant.cost(), cost(4));
    store.recost(&at_the_charge.grant, 1).await;
    let after = call_now(&store, Ask::new(&roomy)).await;
    assert_eq!(after.grant.cost(), one);

    // On the route, and capped at the smallest COUNT of the stacks the call takes.
    let on_route = call_now(&store, Ask::new(&roomy).route(Some(&route))).await;
    assert_eq!(on_route.grant.cost(), one);
    store.recost(&on_route.grant, 40).await;
    let roomy_asks_for = async |units: Cost, route: Option<&Arc<Route>>| {
        let ask = Ask::new(&roomy)
            .cost(units)
            .route(route)
            .without_reserving();
        let asked = store.ask(ask).await.unwrap();
        assert!(
            !matches!(asked.decision, Decision::Granted { .. }),
            "40 units counted: {:?}",
            asked.decision
        );
        asked.cost
    };
    assert_eq!(roomy_asks_for(one, Some(&route)).await, cost(10));
    assert_eq!(roomy_asks_for(one, None).await, one);

    // Whatever else the key holds is no charge.
    let charge_key = format!("{}:{{S-charges}}:charge", keys.prefix);
    for junk in ["junk", "0", "-3", "4.5", "99999"] {
        let () = redis::AsyncCommands::set(&mut conn, &charge_key, junk)
            .await
            .unwrap();
        assert_eq!(asks_for(&store, one, None).await, one, "{junk}");
    }
    // A seller whose override holds less than the charge is asked at the override's smallest
    // COUNT, never refused as too costly for a charge.
    let () = redis::AsyncCommands::set(&mut conn, &charge_key, "4")
        .await
        .unwrap();
    let small = SellerId::parse("S-small").unwrap();
    let small_charge = format!("{}:{{S-small}}:charge", keys.prefix);
    let () = redis::AsyncCommands::set(&mut conn, &small_charge, "8")
        .await
        .unwrap();
    store
        .admin()
        .set_limit(&small, limits("3/10s"))
        .await
        .unwrap();
    let message = turnstile_core::domain::MessageId::parse("m-small").unwrap();
    let asked = store.ask(Ask::new(&small).message(&message)).await.unwrap();
    assert!(
        matches!(asked.decision, Decision::Granted { .. }),
        "{:?}",
        asked.decision
    );
    assert_eq!(asked.cost, cost(3));

    // Off (no TURNSTILE_COST_HEADER), nothing is read.
    let off = keys.store(limiter("10/10s", Algorithm::SlidingWindow));
    assert_eq!(asks_for(&off, one, None).await, one);
    assert_eq!(asks_for(&store, one, None).await, cost(4));
    keys.cleanup().await;
}

/// The wall clock's time of day `ahead` from now, as `HH:MM:SS` (UTC).
fn time_of_day_in(ahead: std::time::Duration) -> String {
    let secs = (std::time::SystemTime::now() + ahead)
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 86_400;
    format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

/// A daily quota on the provider's clock, crossing its reset: the budget 100/1s,8/1d and the
/// route `stock` 5/1d both reset at the same time of day, a few seconds from now. Seller Q
/// sends 7 on `stock` and 5 to the default endpoint: 8 go before the reset (5 on `stock`), the
/// other 4 wait for it, reserved, and go after it; the strict mock, holding each day to its
/// count on its own wall clock, never answers 429.
#[tokio::test]
async fn a_daily_quota_waits_for_its_reset_and_never_goes_over_either_day() -> anyhow::Result<()> {
    let reset_in = std::time::Duration::from_secs(20);
    let at = time_of_day_in(reset_in);
    let reset_at = std::time::Instant::now() + reset_in;
    let budget = format!("100/1s,8/1d@{at}Z");
    let stock = format!("5/1d@{at}Z");
    let mock = MockArgs {
        routes: vec![("stock".into(), limits(&stock))],
        ..MockArgs::local(limits(&budget))
    };
    let mut rig = support::rig("calendar", &budget)
        .with_mock(mock)
        .prepare()
        .await?;
    let file = RoutesFile::write(
        "calendar",
        &[("stock", "POST", rig.mock.route_url("stock"), stock.as_str())],
    );
    let mut settings = rig.settings(4);
    settings.routes.file = Some(file.0.clone());
    // A call may be answered up to its timeout after its grant: only calls granted that close
    // to the reset count in both days.
    settings.downstream.timeout = std::time::Duration::from_secs(1);
    rig.start_replica(settings).await?;
    let mut bodies: Vec<Vec<u8>> = (0..7)
        .map(|i| body(&format!("q-s{i}"), "S-Q", Some("stock"), 1, None))
        .collect();
    bodies.extend((0..5).map(|i| body(&format!("q-d{i}"), "S-Q", None, 1, None)));
    publish(&mut rig, bodies).await?;
    let before = rig.wait_registered(8).await?;
    let mut held_until_reset = None;
    if std::time::Instant::now() + std::time::Duration::from_secs(3) < reset_at {
        // Nothing more goes until the reset.
        while std::time::Instant::now() + std::time::Duration::from_millis(1500) < reset_at {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        held_until_reset = Some(rig.mock.stats().registered);
    }
    let after = rig.wait_registered(12).await?;
    let deliveries = rig.total(|s| &s.deliveries);
    rig.stop_replicas().await?;
    println!(
        "8/1d and stock 5/1d resetting at {at}Z: {} registered before the reset ({:?} just \
         before it), 12 after; {} violations; {deliveries} deliveries for 12 messages",
        before.registered, held_until_reset, after.violations
    );
    assert_eq!(after.violations, 0, "{after:?}");
    assert_eq!(after.duplicates, 0);
    assert_eq!(after.routes["stock"].registered, 7);
    if let Some(held) = held_until_reset {
        assert_eq!(held, 8, "the day's quota held until its reset");
    }
    rig.cleanup().await
}

/// `limits set --seller S --route R --limit L`: the seller's override of a route's stack
/// applies on its next call; `limits clear --route R` brings back the routes file's.
#[tokio::test]
async fn a_sellers_override_of_a_routes_limit_applies_and_clears() {
    use support::{Backend, Keys, limiter};
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::{RouteName, SellerId};

    let keys = Keys::new(Backend::Standalone, "route-override").await;
    let routes = routes_of(&[("stock", "2/10s")]);
    let name = RouteName::parse("stock").unwrap();
    let route = route_in(&routes, "stock");
    let store = keys
        .store(limiter("100/10s", Algorithm::SlidingWindow))
        .with_routes(routes.clone());
    let granted_now = |seller: &'static str| {
        let (store, route) = (store.clone(), route.clone());
        async move {
            let s = SellerId::parse(seller).unwrap();
            let mut granted = 0;
            for _ in 0..6 {
                granted += u32::from(ask_on(&store, &s, &route).await.1);
            }
            granted
        }
    };
    let admin = store.admin();
    let s = SellerId::parse("S-over").unwrap();
    admin
        .set_route_limit(&s, &name, &limits("4/10s"))
        .await
        .unwrap();
    assert_eq!(
        admin.route_limit(&s, &name).await.unwrap(),
        Some(limits("4/10s"))
    );
    assert_eq!(
        granted_now("S-over").await,
        4,
        "the override's 4, not the file's 2"
    );
    assert_eq!(
        granted_now("S-other").await,
        2,
        "another seller keeps the file's"
    );
    assert!(admin.clear_route_limit(&s, &name).await.unwrap());
    assert_eq!(admin.route_limit(&s, &name).await.unwrap(), None);
    keys.cleanup().await;
}

/// A call on a route takes room the seller's log left before its latest slot: 10 messages on a
/// slow route (2/10s) reserve the budget (10/10s) sparsely far ahead; 8 messages on a fast route
/// asked after them take the budget's room of the first window, not slots after the slow
/// route's last, and every window of both logs stays within its count.
#[tokio::test]
async fn a_call_on_a_route_takes_the_room_left_before_the_sellers_last_slot() {
    use support::{Backend, Keys, limiter};
    use turnstile_core::config::Algorithm;
    use turnstile_core::domain::SellerId;

    let keys = Keys::new(Backend::Standalone, "route-gaps").await;
    let routes = routes_of(&[("slow", "2/10s"), ("fast", "10/10s")]);
    let store = keys
        .store(limiter("10/10s", Algorithm::SlidingWindow))
        .with_routes(routes.clone());
    let s = SellerId::parse("S-gaps").unwrap();
    let mut slots = Vec::new();
    for name in std::iter::repeat_n("slow", 10).chain(std::iter::repeat_n("fast", 8)) {
        slots.push((name, ask_on(&store, &s, &route_in(&routes, name)).await.0));
    }
    let first = slots[0].1;
    let at = |name: &str| -> Vec<i64> {
        slots
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, s)| (s - first) / 1_000_000)
            .collect()
    };
    println!("slow at {:?} s, fast at {:?} s", at("slow"), at("fast"));
    assert!(
        at("slow").last().unwrap() >= &40,
        "the slow route's pace: 2 per 10 s"
    );
    assert!(
        at("fast").iter().all(|s| *s < 10),
        "the fast route's messages fill the budget's first window"
    );
    // Every window of 10 s holds at most 10 of the budget, 2 of slow and 10 of fast.
    for (name, count) in [("slow", 2), ("fast", 10), ("", 10)] {
        let mut times: Vec<i64> = slots
            .iter()
            .filter(|(n, _)| name.is_empty() || *n == name)
            .map(|(_, s)| *s)
            .collect();
        times.sort();
        for (i, t) in times.iter().enumerate() {
            let within = times[i..].iter().filter(|u| **u < t + 10_000_000).count();
            assert!(within <= count, "{name:?}: {within} in 10 s from {t}");
        }
    }
    keys.cleanup().await;
}

/// A rolling deploy of a routes file: the new replica adds route `stock` (2/1s) and lowers
/// `register` from 5/1s to 3/1s while the old one runs. Route stacks are fleet terms: the old
/// replica grants `register` under 3/1s, and a `stock` message it takes waits for a replica
/// that knows the route instead of being dead-lettered; the API, enforcing 3/1s and 2/1s, sees
/// no call over either, and every message is registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_deploy_of_a_routes_file_applies_the_strictest_routes_and_loses_no_new_route()
-> anyhow::Result<()> {
    let mock = MockArgs {
        routes: vec![
            ("register".into(), limits("3/1s")),
            ("stock".into(), limits("2/1s")),
        ],
        ..MockArgs::local(limits("50/1s"))
    };
    let mut rig = support::rig("routes-deploy", "50/1s")
        .with_mock(mock)
        .prepare()
        .await?;
    let old_file = RoutesFile::write(
        "deploy-old",
        &[("register", "POST", rig.mock.route_url("register"), "5/1s")],
    );
    let new_file = RoutesFile::write(
        "deploy-new",
        &[
            ("register", "POST", rig.mock.route_url("register"), "3/1s"),
            ("stock", "PATCH", rig.mock.route_url("stock"), "2/1s"),
        ],
    );
    let mut old = rig.settings(4);
    old.routes.file = Some(old_file.0.clone());
    old.limiter.adaptive = false;
    let mut new = old.clone();
    new.routes.file = Some(new_file.0.clone());
    rig.start_replica(old).await?;
    rig.start_replica(new).await?;
    let mut bodies = Vec::new();
    for i in 0..20 {
        bodies.push(body(&format!("r{i}"), "S-1", Some("register"), 1, None));
        bodies.push(body(&format!("s{i}"), "S-1", Some("stock"), 1, None));
    }
    publish(&mut rig, bodies).await?;
    let stats = rig.wait_registered(40).await?;
    rig.stop_replicas().await?;
    println!(
        "register 3/1s, stock 2/1s: {} violations; most in a window: register {}, stock {}; {} dead letters",
        stats.violations,
        stats.routes["register"].max_in_window,
        stats.routes["stock"].max_in_window,
        rig.dead_lettered().await?
    );
    assert_eq!(
        rig.dead_lettered().await?,
        0,
        "no stock message dead-lettered"
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(
        (
            stats.routes["register"].registered,
            stats.routes["stock"].registered
        ),
        (20, 20)
    );
    rig.cleanup().await
}
