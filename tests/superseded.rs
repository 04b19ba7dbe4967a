//! Superseded rows (DESIGN "Superseded rows"): of one seller's messages for one
//! `product_key`, the newer supersedes every older one whose call has not started, across
//! replicas, against the real Redis and RabbitMQ.
//!
//! First the decision alone (`lua/supersede.lua`, through `Limiter::supersede`): arrival order,
//! versions, redeliveries, a started call, a reservation taken over, a forced replay. Then a
//! corrected upload through replicas and a strict mock: every row gets one result, the stale
//! rows still waiting take no call, and each product's last call is its newest row's.
mod support;

use std::collections::HashMap;
use std::time::Duration;

use lapin::BasicProperties;
use serde_json::{Value, json};
use support::Backend;
use support::results::Results;
use turnstile_core::broker::Publisher;
use turnstile_core::broker::dead_letters::{self, Replayed, Selection};
use turnstile_core::config::Algorithm;
use turnstile_core::domain::{Cost, MessageId, ProductKey, SellerId, Version};
use turnstile_core::permit::{
    Ask, DeadLetterBook, Decision, Limiter, PermitStore, ProductMessage, Reservation,
    SupersedeStep, Supersession,
};
use turnstile_lab::rig::Rig;

const TTL: Duration = Duration::from_secs(600);

/// The messages of one product of one seller, as the tests name them.
struct Product {
    seller: SellerId,
    key: ProductKey,
}

impl Product {
    fn new(seller: &str, key: &str) -> Self {
        Self {
            seller: SellerId::parse(seller).unwrap(),
            key: ProductKey::parse(key).unwrap(),
        }
    }

    /// Message `id` of the product, with `version`, costing one unit on no route.
    fn message<'a>(&'a self, id: &'a MessageId, version: Option<i64>) -> ProductMessage<'a> {
        ProductMessage {
            seller: &self.seller,
            product: &self.key,
            version: version.map(|v| Version::new(v).unwrap()),
            message: id,
            cost: Cost::ONE,
            route: None,
            ttl: TTL,
        }
    }
}

fn id(s: &str) -> MessageId {
    MessageId::parse(s).unwrap()
}

async fn step(
    store: &PermitStore,
    message: &ProductMessage<'_>,
    step: SupersedeStep<'_>,
) -> Supersession {
    holding(store, message, step, None).await
}

/// As [`step`], for a message that holds the reservation `held`.
async fn holding(
    store: &PermitStore,
    message: &ProductMessage<'_>,
    step: SupersedeStep<'_>,
    held: Option<&Reservation>,
) -> Supersession {
    store
        .supersede(message, step, held)
        .await
        .expect("Redis answers")
}

fn superseded_by(by: &str) -> Supersession {
    Supersession::Superseded {
        by: Some(id(by)),
        reservation_taken: false,
    }
}

const GO: Supersession = Supersession::Latest { took_over: None };

fn store(keys: &support::Keys) -> PermitStore {
    keys.store(support::limiter("1/1s", Algorithm::SlidingWindow))
}

#[tokio::test]
async fn of_two_rows_for_one_product_the_later_arrival_wins_unless_its_call_started() {
    let keys = support::Keys::new(Backend::Standalone, "supersede-order").await;
    let store = store(&keys);
    let product = Product::new("S-1", "SKU-1");
    let (first, second, third) = (id("first"), id("second"), id("third"));
    let (first, second, third) = (
        product.message(&first, None),
        product.message(&second, None),
        product.message(&third, None),
    );
    assert_eq!(step(&store, &first, SupersedeStep::Arrive).await, GO);
    assert_eq!(
        step(&store, &second, SupersedeStep::Arrive).await,
        GO,
        "a later arrival is newer"
    );
    // The first comes back (a redelivery, its delayed copy): superseded, and it stays so.
    assert_eq!(
        step(&store, &first, SupersedeStep::Arrive).await,
        superseded_by("second")
    );
    assert_eq!(
        step(&store, &first, SupersedeStep::Start).await,
        superseded_by("second")
    );
    assert_eq!(
        step(&store, &first, SupersedeStep::Arrive).await,
        superseded_by("second")
    );
    // The second's call starts: a third arrival proceeds too, and the second is never
    // superseded afterwards (a retry after a 503 calls again).
    assert_eq!(step(&store, &second, SupersedeStep::Start).await, GO);
    assert_eq!(step(&store, &third, SupersedeStep::Arrive).await, GO);
    assert_eq!(step(&store, &second, SupersedeStep::Arrive).await, GO);
    assert_eq!(step(&store, &second, SupersedeStep::Start).await, GO);
    assert_eq!(step(&store, &third, SupersedeStep::Start).await, GO);
    // Another seller's product of the same key is another product.
    let elsewhere = Product::new("S-2", "SKU-1");
    let other = id("first");
    assert_eq!(
        step(
            &store,
            &elsewhere.message(&other, None),
            SupersedeStep::Arrive
        )
        .await,
        GO
    );
    keys.cleanup().await;
}

#[tokio::test]
async fn a_higher_version_wins_whatever_order_the_rows_arrive_in() {
    let keys = support::Keys::new(Backend::Standalone, "supersede-version").await;
    let store = store(&keys);
    let product = Product::new("S-1", "SKU-7");
    let (v2, v1, v3, plain) = (id("v2"), id("v1"), id("v3"), id("plain"));
    assert_eq!(
        step(
            &store,
            &product.message(&v2, Some(2)),
            SupersedeStep::Arrive
        )
        .await,
        GO
    );
    // Older by its version though it arrived later: superseded at once.
    assert_eq!(
        step(
            &store,
            &product.message(&v1, Some(1)),
            SupersedeStep::Arrive
        )
        .await,
        superseded_by("v2")
    );
    assert_eq!(
        step(
            &store,
            &product.message(&v3, Some(3)),
            SupersedeStep::Arrive
        )
        .await,
        GO
    );
    assert_eq!(
        step(&store, &product.message(&v2, Some(2)), SupersedeStep::Start).await,
        superseded_by("v3")
    );
    // Without a version of its own, a row is compared by arrival: it is the newer.
    assert_eq!(
        step(
            &store,
            &product.message(&plain, None),
            SupersedeStep::Arrive
        )
        .await,
        GO
    );
    assert_eq!(
        step(
            &store,
            &product.message(&v3, Some(3)),
            SupersedeStep::Arrive
        )
        .await,
        superseded_by("plain")
    );
    // A forced replay makes a superseded row the latest again, and its undo (the republish
    // failed) gives the place back.
    let v1_message = product.message(&v1, Some(1));
    let before = DeadLetterBook::latest_again(&store, &v1_message)
        .await
        .unwrap();
    assert_eq!(before, Some(id("plain")));
    DeadLetterBook::latest_as_before(&store, &v1_message, before.as_ref())
        .await
        .unwrap();
    assert_eq!(
        step(&store, &v1_message, SupersedeStep::Arrive).await,
        superseded_by("plain")
    );
    DeadLetterBook::latest_again(&store, &v1_message)
        .await
        .unwrap();
    assert_eq!(
        step(
            &store,
            &product.message(&v1, Some(1)),
            SupersedeStep::Arrive
        )
        .await,
        GO
    );
    assert_eq!(
        step(&store, &product.message(&v1, Some(1)), SupersedeStep::Start).await,
        GO
    );
    keys.cleanup().await;
}

#[tokio::test]
async fn a_newer_row_takes_over_the_reservation_of_the_row_it_supersedes_and_redeems_it() {
    takes_over_and_redeems(Backend::Standalone).await;
}

#[tokio::test]
async fn on_a_redis_cluster_a_newer_row_takes_over_the_reservation_and_redeems_it() {
    takes_over_and_redeems(Backend::Cluster).await;
}

async fn takes_over_and_redeems(backend: Backend) {
    let keys = support::Keys::new(backend, "supersede-reservation").await;
    let store = store(&keys);
    let product = Product::new("S-1", "SKU-3");
    let seller = product.seller.clone();
    // The seller's one unit a second goes to another row: the old row reserves the next slot.
    let filler = id("filler");
    let filled = store.ask(Ask::new(&seller).message(&filler)).await.unwrap();
    assert!(
        matches!(filled.decision, Decision::Granted { .. }),
        "{:?}",
        filled.decision
    );
    let (old, new) = (id("old"), id("new"));
    let (old, new) = (product.message(&old, None), product.message(&new, None));
    assert_eq!(step(&store, &old, SupersedeStep::Arrive).await, GO);
    let asked = store
        .ask(Ask::new(&seller).message(old.message))
        .await
        .unwrap();
    let Decision::Wait {
        reservation: Some(reservation),
        ..
    } = asked.decision
    else {
        panic!("the old row reserves the next slot: {:?}", asked.decision);
    };
    assert_eq!(
        step(&store, &old, SupersedeStep::Reserved(&reservation)).await,
        GO
    );
    // The corrected row arrives: it holds the old row's reservation now.
    let Supersession::Latest {
        took_over: Some((from, taken)),
    } = step(&store, &new, SupersedeStep::Arrive).await
    else {
        panic!("the new row takes the reservation over");
    };
    assert_eq!((from.as_str(), &taken), ("old", &reservation));
    // The old row, back for its slot, hears it was superseded and must not give the slot back;
    // a slot it held that was not taken over (another copy's, say) it gives back.
    assert_eq!(
        holding(&store, &old, SupersedeStep::Arrive, Some(&reservation)).await,
        Supersession::Superseded {
            by: Some(id("new")),
            reservation_taken: true
        }
    );
    let other = Reservation {
        token: "another-copy".into(),
        ..reservation.clone()
    };
    assert_eq!(
        holding(&store, &old, SupersedeStep::Arrive, Some(&other)).await,
        superseded_by("new")
    );
    // The new row's arrive repeated (its answer lost): it hears the reservation it holds again.
    assert_eq!(
        step(&store, &new, SupersedeStep::Arrive).await,
        Supersession::Latest {
            took_over: Some((id("old"), reservation.clone()))
        }
    );
    // The new row redeems the slot once it is due: granted, not told to queue anew.
    let granted = loop {
        let asked = store
            .ask(Ask::new(&seller).message(new.message).held(Some(&taken)))
            .await
            .unwrap();
        match asked.decision {
            Decision::Granted { slot_us, .. } => break slot_us,
            Decision::Wait {
                retry_after,
                reservation: Some(ref kept),
            } if kept.token == taken.token => tokio::time::sleep(retry_after).await,
            other => panic!("the taken-over reservation is redeemed: {other:?}"),
        }
    };
    assert_eq!(granted, taken.slot_us, "granted at the old row's slot");
    // A row of other units cannot hold the reservation: the one it supersedes gives it back.
    let other = Product::new("S-1", "SKU-4");
    let (cheap, dear) = (id("cheap"), id("dear"));
    let cheap = other.message(&cheap, None);
    let mut dear = other.message(&dear, None);
    dear.cost = Cost::new(2).unwrap();
    assert_eq!(step(&store, &cheap, SupersedeStep::Arrive).await, GO);
    assert_eq!(
        step(&store, &cheap, SupersedeStep::Reserved(&reservation)).await,
        GO
    );
    assert_eq!(
        step(&store, &dear, SupersedeStep::Arrive).await,
        GO,
        "nothing taken over"
    );
    assert_eq!(
        step(&store, &cheap, SupersedeStep::Arrive).await,
        superseded_by("dear")
    );
    keys.cleanup().await;
}

/// Publishes rows `<prefix>-<i>` of `seller`, for products `P-<i>`, in batch `<prefix>`,
/// confirmed.
async fn publish_rows(rig: &Rig, seller: &str, prefix: &str, n: usize) {
    let rows = (0..n).map(|i| {
        let body = json!({
            "message_id": format!("{prefix}-{i}"),
            "seller_id": seller,
            "batch_id": prefix,
            "batch_size": n,
            "product_key": format!("P-{i}"),
            "product": {"sku": format!("P-{i}"), "row": prefix},
        });
        (body, BasicProperties::default())
    });
    support::publish_confirmed(rig, rows).await;
}

#[tokio::test]
async fn a_corrected_upload_supersedes_the_rows_still_waiting_and_every_row_gets_one_result()
-> anyhow::Result<()> {
    let n = 40;
    let mut rig = support::rig("superseded", "5/1s").prepare().await?;
    let results = Results::listen(&rig).await;
    rig.start_replicas(2, 4).await?;
    publish_rows(&rig, "S-sup", "old", n).await;
    results.until(5).await;
    publish_rows(&rig, "S-sup", "new", n).await;
    results.until(2 * n).await;
    rig.stop_replicas().await?;
    // One result per row (a duplicate would carry the same id and outcome).
    let mut outcome: HashMap<String, Value> = HashMap::new();
    for result in results.all() {
        let id = result["message_id"].as_str().unwrap().to_owned();
        if let Some(earlier) = outcome.get(&id) {
            assert_eq!(
                earlier["outcome"], result["outcome"],
                "two outcomes for {id}"
            );
        }
        outcome.insert(id, result);
    }
    assert_eq!(outcome.len(), 2 * n, "{:?}", results.brief());
    let called: Vec<String> = rig
        .mock
        .recent_requests()
        .iter()
        .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect();
    let place = |id: &str| called.iter().position(|c| c == id);
    let mut superseded = 0;
    for i in 0..n {
        let (old, new) = (format!("old-{i}"), format!("new-{i}"));
        assert_eq!(outcome[&new]["outcome"], "registered", "{}", outcome[&new]);
        match outcome[&old]["outcome"].as_str().unwrap() {
            "registered" => assert!(
                place(&old) < place(&new),
                "P-{i}: its stale row was called after its corrected one: {called:?}"
            ),
            "superseded" => {
                superseded += 1;
                assert_eq!(
                    outcome[&old]["superseded_by"],
                    new.as_str(),
                    "{}",
                    outcome[&old]
                );
                assert_eq!(place(&old), None, "a superseded row was called: {old}");
            }
            other => panic!("{old}: {other}"),
        }
    }
    let stats = rig.mock.stats();
    println!(
        "{n} rows at 5/1s, corrected after 5 results: {} calls for {} rows, {superseded} stale rows superseded, {} over the limit",
        called.len(),
        2 * n,
        stats.violations
    );
    assert!(superseded > 0, "no stale row was superseded: {called:?}");
    assert_eq!(
        called.len(),
        2 * n - superseded,
        "every call is one row's, once"
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    // The dead letters say why, and a replay leaves them unless forced.
    let dead = rig.dead_lettered().await?;
    assert_eq!(dead, superseded as u64);
    let stale = (0..n)
        .map(|i| format!("old-{i}"))
        .find(|old| outcome[old]["outcome"] == "superseded")
        .unwrap();
    let replayed = replay(&rig, Selection::all().with_seller("S-sup")).await?;
    assert_eq!(
        (replayed.matched, replayed.replayed, replayed.refused),
        (superseded as u64, 0, superseded as u64),
        "{replayed:?}"
    );
    let forced = replay(&rig, Selection::message(&stale).forced(true)).await?;
    assert_eq!((forced.replayed, forced.refused), (1, 0), "{forced:?}");
    // Its product's latest again: registered, after the newer row it had lost to.
    let calls = called.len() as u64;
    rig.start_replica(rig.settings(2)).await?;
    rig.wait_registered(calls + 1).await?;
    rig.stop_replicas().await?;
    let keys: Vec<String> = rig
        .mock
        .recent_requests()
        .iter()
        .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect();
    assert_eq!(
        keys.last(),
        Some(&stale),
        "the forced replay is called last"
    );
    rig.cleanup().await
}

/// Replays the dead letters `selection` takes, as `turnstile dead-letters replay` does.
async fn replay(rig: &Rig, selection: Selection) -> anyhow::Result<Replayed> {
    let channel = rig.connection().create_channel().await?;
    let publisher = Publisher::open(rig.connection()).await?;
    let store = rig.store();
    let replayed = dead_letters::replay(
        &channel,
        &publisher,
        &rig.topology,
        &selection,
        &store,
        TTL,
        false,
    )
    .await;
    let _ = channel.close(200, "replayed".into()).await;
    replayed
}

#[tokio::test]
async fn product_keys_that_look_alike_are_different_products_and_bad_arguments_write_nothing() {
    let keys = support::Keys::new(Backend::Standalone, "supersede-hostile").await;
    let store = store(&keys);
    let (braced, escaped) = (
        Product::new("S-{1}", "{SKU}:1"),
        Product::new("S-{1}", "%7BSKU%7D:1"),
    );
    let (a, b) = (id("a"), id("b"));
    assert_eq!(
        step(&store, &braced.message(&a, None), SupersedeStep::Arrive).await,
        GO
    );
    assert_eq!(
        step(&store, &escaped.message(&b, None), SupersedeStep::Arrive).await,
        GO,
        "another product: nothing superseded"
    );
    assert_eq!(
        step(&store, &braced.message(&a, None), SupersedeStep::Start).await,
        GO
    );
    // The script checks its arguments before it writes anything.
    let record = store
        .keys()
        .product(&braced.seller, &ProductKey::parse("fresh").unwrap());
    for (step, version, ttl) in [
        ("arrive", "1.5", "1000"),
        ("arrive", "1234567890123456", "1000"),
        ("arrive", "", "0"),
        ("bogus", "", "1000"),
        ("reserved", "", "1000"),
    ] {
        let answer: redis::RedisResult<redis::Value> = turnstile_core::permit::scripts::supersede()
            .key(&record)
            .arg(step)
            .arg("m-1")
            .arg(version)
            .arg(ttl)
            .arg("1|")
            .invoke_async(&mut keys.conn.clone())
            .await;
        assert!(answer.is_err(), "{step} {version:?} {ttl}: {answer:?}");
    }
    let exists: bool = redis::cmd("EXISTS")
        .arg(&record)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert!(!exists, "a refused call wrote the record");
    keys.cleanup().await;
}

#[tokio::test]
async fn a_lost_record_supersedes_nobody_and_a_call_that_did_not_start_is_supersedable_again() {
    let keys = support::Keys::new(Backend::Standalone, "supersede-lost").await;
    let store = store(&keys);
    let product = Product::new("S-1", "SKU-9");
    let (first, second) = (id("first"), id("second"));
    let (first, second) = (
        product.message(&first, None),
        product.message(&second, None),
    );
    let filler = id("filler");
    let asked = store
        .ask(Ask::new(&product.seller).message(&filler))
        .await
        .unwrap();
    assert!(matches!(asked.decision, Decision::Granted { .. }));
    let asked = store
        .ask(Ask::new(&product.seller).message(first.message))
        .await
        .unwrap();
    let Decision::Wait {
        reservation: Some(reservation),
        ..
    } = asked.decision
    else {
        panic!("a slot reserved: {:?}", asked.decision);
    };
    // Redis lost the record between the first step and the next (a failover, an eviction).
    assert_eq!(step(&store, &first, SupersedeStep::Arrive).await, GO);
    redis::cmd("DEL")
        .arg(store.keys().product(&product.seller, &product.key))
        .arg(store.keys().product_arrivals(&product.seller, &product.key))
        .query_async::<()>(&mut keys.conn.clone())
        .await
        .unwrap();
    assert_eq!(
        step(&store, &first, SupersedeStep::Reserved(&reservation)).await,
        GO,
        "a message alone is nobody's to supersede"
    );
    // Its call was about to start, but its grant came too late: it is supersedable again.
    assert_eq!(step(&store, &first, SupersedeStep::Start).await, GO);
    assert_eq!(step(&store, &first, SupersedeStep::Unstart).await, GO);
    assert_eq!(step(&store, &second, SupersedeStep::Arrive).await, GO);
    assert_eq!(
        step(&store, &first, SupersedeStep::Start).await,
        superseded_by("second")
    );
    keys.cleanup().await;
}

#[tokio::test]
async fn a_product_remembers_a_bounded_number_of_its_messages() {
    let keys = support::Keys::new(Backend::Standalone, "supersede-bounded").await;
    let store = store(&keys);
    let product = Product::new("S-1", "SKU-busy");
    let ids: Vec<MessageId> = (0..1100).map(|i| id(&format!("u-{i}"))).collect();
    for id in &ids {
        assert_eq!(
            step(&store, &product.message(id, None), SupersedeStep::Arrive).await,
            GO
        );
    }
    let arrivals: u64 = redis::cmd("ZCARD")
        .arg(store.keys().product_arrivals(&product.seller, &product.key))
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    let fields: u64 = redis::cmd("HLEN")
        .arg(store.keys().product(&product.seller, &product.key))
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    println!("1,100 messages of one product: {arrivals} remembered, {fields} fields");
    assert_eq!(arrivals, 1024);
    assert!(fields <= 1024 + 3, "{fields} fields");
    // The latest is never forgotten, and a recent message still hears it was superseded.
    assert_eq!(
        step(
            &store,
            &product.message(&ids[1050], None),
            SupersedeStep::Arrive
        )
        .await,
        superseded_by("u-1099")
    );
    keys.cleanup().await;
}

#[tokio::test]
async fn a_replica_killed_while_rows_are_superseded_loses_no_row_and_calls_no_stale_row_last()
-> anyhow::Result<()> {
    let n = 30;
    let rig = support::rig("superseded-kill", "5/1s").prepare().await?;
    let results = Results::listen(&rig).await;
    publish_rows(&rig, "S-kill", "old", n).await;
    let mut doomed = support::spawn_consumer(&rig, 4);
    let mut survivor = support::spawn_consumer(&rig, 4);
    support::eventually("some old rows registered", || {
        rig.mock.stats().registered >= 5
    })
    .await;
    publish_rows(&rig, "S-kill", "new", n).await;
    // Killed while the corrected rows arrive and take the stale rows' slots over.
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    support::eventually("every row final", || {
        let mut ids: Vec<String> = results
            .all()
            .iter()
            .filter_map(|r| r["message_id"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        ids.dedup();
        ids.len() >= 2 * n
    })
    .await;
    survivor.kill().unwrap();
    survivor.wait().unwrap();
    let mut outcome: HashMap<String, String> = HashMap::new();
    for result in results.all() {
        let id = result["message_id"].as_str().unwrap().to_owned();
        let said = result["outcome"].as_str().unwrap().to_owned();
        if let Some(earlier) = outcome.get(&id) {
            assert_eq!(
                earlier,
                &said,
                "two outcomes for {id}: {:?}",
                results.brief()
            );
        }
        outcome.insert(id, said);
    }
    let called: Vec<String> = rig
        .mock
        .recent_requests()
        .iter()
        .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect();
    let stats = rig.mock.stats();
    // A row whose call reached the API from the killed replica may be called again (the one
    // case of a repeated call, see README): its repeat may come after its corrected row.
    let repeated: std::collections::HashSet<&str> =
        stats.repeats.iter().map(|r| r.key.as_str()).collect();
    let first_call = |id: &str| called.iter().position(|c| c == id);
    let last_call = |id: &str| called.iter().rposition(|c| c == id);
    let mut superseded = 0;
    for i in 0..n {
        let (old, new) = (format!("old-{i}"), format!("new-{i}"));
        assert_eq!(outcome[&new], "registered", "{new}");
        match outcome[&old].as_str() {
            "registered" if repeated.contains(old.as_str()) => assert!(
                first_call(&old) < last_call(&new),
                "P-{i}: its stale row was first called after its corrected one: {called:?}"
            ),
            "registered" => assert!(
                last_call(&old) < last_call(&new),
                "P-{i}: its stale row was called after its corrected one: {called:?}"
            ),
            "superseded" => {
                superseded += 1;
                assert_eq!(last_call(&old), None, "a superseded row was called: {old}");
            }
            other => panic!("{old}: {other}"),
        }
    }
    println!(
        "a replica killed as {n} corrected rows came: {} calls for {} rows, {superseded} superseded, {} duplicate calls, {} over the limit",
        called.len(),
        2 * n,
        stats.duplicates,
        stats.violations
    );
    assert_eq!(stats.violations, 0, "{stats:?}");
    // A duplicate call only for a row whose 2xx reached the killed replica before its record.
    assert!(stats.duplicates <= 4, "{stats:?}");
    rig.cleanup().await
}
