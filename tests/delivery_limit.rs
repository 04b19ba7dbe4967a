//! The work queue's delivery limit and dead-letter target: a message returned more often than
//! the limit is dead-lettered to `<q>.dead` (neither lost nor looping forever), then listed and
//! replayed; `<q>.dead` declares a delivery limit that listing it never reaches; a work queue or
//! dead-letter queue that an operator or a producer declared without them before turnstile
//! started is kept with a warning; another difference (the queue type) fails the start.
mod support;

use std::io::Write;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use serde_json::json;
use support::broker::TestBroker;
use support::{run, unique};
use turnstile_core::broker::dead_letters::{Reason, Selection};
use turnstile_core::broker::{
    self, Declared, Protection, QueueType, Topology, UNREACHED_DELIVERY_LIMIT, WORK_DELIVERY_LIMIT,
    dead_letters, long_string,
};
use turnstile_core::replica::Replica;

/// Declares a durable queue on a channel of its own, as another client (an operator, a
/// producer) would.
async fn declare_as_is(
    connection: &Connection,
    name: &str,
    args: &[(&str, AMQPValue)],
) -> Result<(), lapin::Error> {
    let channel = connection.create_channel().await?;
    let mut table = FieldTable::default();
    for (k, v) in args {
        table.insert((*k).into(), v.clone());
    }
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            table,
        )
        .await?;
    let _ = channel.close(200, "".into()).await;
    Ok(())
}

/// Whether a queue exists (a passive declare).
async fn exists(connection: &Connection, name: &str) -> bool {
    let channel = connection.create_channel().await.unwrap();
    broker::depth(&channel, name).await.is_ok()
}

fn quorum() -> (&'static str, AMQPValue) {
    ("x-queue-type", long_string("quorum"))
}

#[tokio::test]
async fn a_message_returned_more_often_than_the_delivery_limit_is_dead_lettered_listed_and_replayed()
 {
    const LIMIT: u32 = 3;
    let topology = Topology::new(&unique("limit"), QueueType::Quorum).with_delivery_limit(LIMIT);
    let broker = TestBroker::undeclared(topology).await;
    assert_eq!(
        broker.topology.declare(&broker.connection).await.unwrap(),
        Declared {
            work: Protection::Protected,
            dead: Protection::Protected
        }
    );
    broker
        .publish(br#"{"message_id":"m-poison","seller_id":"S-1","product":{}}"#)
        .await;
    // Return it as a replica that crashes on it would, and then some: without a limit it
    // would come back forever.
    let mut consumer = broker.consume(broker.queue()).await;
    let mut deliveries = 0;
    while let Ok(Some(delivery)) =
        tokio::time::timeout(Duration::from_secs(2), consumer.next()).await
    {
        let delivery = delivery.unwrap();
        deliveries += 1;
        assert!(
            deliveries <= LIMIT + 5,
            "returned {deliveries} times and still delivered"
        );
        delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let dead = broker.depth(broker.topology.dead()).await;
    println!("limit {LIMIT}: delivered {deliveries} times, then {dead} in the dead-letter queue");
    assert_eq!(
        deliveries,
        LIMIT + 1,
        "delivered once and returned LIMIT times"
    );
    assert_eq!(dead, 1, "dead-lettered, not lost");
    assert_eq!(broker.depth(broker.queue()).await, 0);

    let channel = broker.connection.create_channel().await.unwrap();
    let listed = dead_letters::list(
        &channel,
        &broker.topology,
        &Selection::all().with_reason(Reason::DeliveryLimit),
    )
    .await
    .unwrap();
    println!("listed: {listed:?}");
    assert_eq!(listed.len(), 1, "{listed:?}");
    let letter = &listed[0];
    assert_eq!(letter.reason, dead_letters::DELIVERY_LIMIT_REASON);
    assert_eq!(letter.attempts, None, "the broker does not count attempts");
    assert_eq!(letter.message_id.as_deref(), Some("m-poison"));
    assert_eq!(letter.seller_id.as_deref(), Some("S-1"));
    assert!(
        letter.detail.contains("delivery_limit"),
        "{}",
        letter.detail
    );
    assert!(letter.dead_at_ms.is_some());

    // Listing returns what it read; the quorum queue has it ready again a moment later.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while broker.depth(broker.topology.dead()).await < 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the listed dead letter never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let keys = support::Keys::new(support::Backend::Standalone, "replay-limit").await;
    let permits = keys.store(support::limiter(
        "10/1s",
        turnstile_core::config::Algorithm::SlidingWindow,
    ));
    let replayed = dead_letters::replay(
        &channel,
        &broker.publisher,
        &broker.topology,
        &Selection::message("m-poison"),
        &permits,
        Duration::from_secs(60),
        false,
    )
    .await
    .unwrap();
    assert_eq!(
        (replayed.matched, replayed.replayed, replayed.kept),
        (1, 1, 0)
    );
    let back = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the replayed message is back on the work queue")
        .unwrap()
        .unwrap();
    assert_eq!(
        back.data,
        br#"{"message_id":"m-poison","seller_id":"S-1","product":{}}"#
    );
    let headers = back.properties.headers().clone().unwrap_or_default();
    assert!(
        !headers.inner().keys().any(|k| k.as_str().contains("death")),
        "a replay starts afresh: {headers:?}"
    );
    back.acker.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(broker.depth(broker.topology.dead()).await, 0);
    keys.cleanup().await;
    broker.cleanup().await;
}

/// Puts one dead letter straight into `<q>.dead`, as a replica or the broker would.
async fn put_dead_letter(broker: &TestBroker, message_id: &str) {
    let body = format!(r#"{{"message_id":"{message_id}","seller_id":"S-1","product":{{}}}}"#);
    broker
        .publisher
        .publish(
            "",
            broker.topology.dead(),
            body.as_bytes(),
            BasicProperties::default().with_content_type("application/json".into()),
        )
        .await
        .unwrap();
}

/// Lists the dead letters `times` times through the code of `turnstile dead-letters list`, each
/// time once the quorum queue has the letter the last listing returned ready again (or gave up
/// on it after 3 s: dropped); how many listings saw it.
async fn listings_that_saw_it(broker: &TestBroker, times: u32) -> u32 {
    let channel = broker.connection.create_channel().await.unwrap();
    let dead = broker.topology.dead();
    let mut seen = 0;
    for _ in 0..times {
        let deadline = Instant::now() + Duration::from_secs(3);
        while broker::depth(&channel, dead).await.unwrap() < 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let listed = dead_letters::list(&channel, &broker.topology, &Selection::all())
            .await
            .unwrap();
        match listed.len() {
            0 => break,
            1 => seen += 1,
            n => panic!("{n} dead letters listed: {listed:?}"),
        }
    }
    seen
}

#[tokio::test]
async fn a_dead_letter_listed_more_often_than_rabbitmq_4s_default_limit_is_still_there() {
    const LISTINGS: u32 = 25;
    // What RabbitMQ 4.x does to a quorum `<q>.dead` declared without a delivery limit: its
    // default limit of 20, declared here so that this broker (3.10.8, no default) shows it.
    // Each listing returns the dead letter with a nack, and the broker counts it.
    let topology = Topology::new(&unique("dead-20"), QueueType::Quorum);
    let limited = TestBroker::undeclared(topology).await;
    declare_as_is(
        &limited.connection,
        limited.topology.dead(),
        &[quorum(), ("x-delivery-limit", AMQPValue::LongLongInt(20))],
    )
    .await
    .unwrap();
    put_dead_letter(&limited, "m-dead").await;
    let seen_at_20 = listings_that_saw_it(&limited, LISTINGS).await;
    let left_at_20 = limited.depth(limited.topology.dead()).await;
    limited.cleanup().await;

    // The dead-letter queue as declared now.
    let broker = TestBroker::new("dead-listed", QueueType::Quorum).await;
    put_dead_letter(&broker, "m-dead").await;
    let seen = listings_that_saw_it(&broker, LISTINGS).await;
    let channel = broker.connection.create_channel().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let letter = loop {
        if let Some(letter) = channel
            .basic_get(broker.topology.dead().into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            break letter;
        }
        assert!(Instant::now() < deadline, "the dead letter is gone");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let headers = letter
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    let count = headers.inner().get("x-delivery-count").cloned();
    letter
        .delivery
        .acker
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    println!(
        "{LISTINGS} listings: with RabbitMQ 4.x's default limit of 20 the dead letter was seen \
         by {seen_at_20} and then dropped ({left_at_20} left); with the declared limit of \
         {UNREACHED_DELIVERY_LIMIT} seen by {seen}, still there with x-delivery-count {count:?}"
    );
    assert_eq!(
        (seen_at_20, left_at_20),
        (21, 0),
        "listings count towards a quorum queue's delivery limit"
    );
    assert_eq!(seen, LISTINGS);
    broker.cleanup().await;
}

#[tokio::test]
async fn the_work_and_return_queues_declare_the_production_delivery_limit_and_dead_letter_target() {
    assert_eq!(WORK_DELIVERY_LIMIT, 500);
    let broker = TestBroker::new("limit-args", QueueType::Quorum).await;
    let dead = broker.topology.dead().to_owned();
    let declared = [
        quorum(),
        ("x-delivery-limit", AMQPValue::LongLongInt(500)),
        ("x-dead-letter-exchange", long_string("")),
        ("x-dead-letter-routing-key", long_string(&dead)),
        ("x-dead-letter-strategy", long_string("at-least-once")),
        ("x-overflow", long_string("reject-publish")),
    ];
    // The broker compares every argument on a redeclaration: equal ones pass, others fail.
    declare_as_is(&broker.connection, broker.queue(), &declared)
        .await
        .expect("the work queue has exactly these arguments");
    declare_as_is(&broker.connection, broker.topology.ready(), &declared)
        .await
        .expect("the return queue has the work queue's arguments");
    let mut other_limit = declared.clone();
    other_limit[1].1 = AMQPValue::LongLongInt(20);
    let refused = declare_as_is(&broker.connection, broker.queue(), &other_limit)
        .await
        .unwrap_err();
    println!(
        "quorum work queue redeclared with x-delivery-limit 500, dead letters to {dead:?} \
         at-least-once, x-overflow reject-publish: accepted; with a limit of 20: {refused}"
    );
    broker.cleanup().await;

    let classic = TestBroker::new("limit-args", QueueType::Classic).await;
    let dead = classic.topology.dead().to_owned();
    declare_as_is(
        &classic.connection,
        classic.queue(),
        &[
            ("x-dead-letter-exchange", long_string("")),
            ("x-dead-letter-routing-key", long_string(&dead)),
        ],
    )
    .await
    .expect("a classic work queue has the dead-letter target, no delivery limit");
    declare_as_is(
        &classic.connection,
        classic.topology.ready(),
        &[
            ("x-dead-letter-exchange", long_string("")),
            ("x-dead-letter-routing-key", long_string(&dead)),
        ],
    )
    .await
    .expect("so does a classic return queue");
    classic.cleanup().await;
}

#[tokio::test]
async fn the_dead_letter_queue_declares_a_delivery_limit_that_listings_never_reach() {
    assert_eq!(UNREACHED_DELIVERY_LIMIT, 1_000_000);
    let broker = TestBroker::new("dead-args", QueueType::Quorum).await;
    let dead = broker.topology.dead().to_owned();
    let declared = [
        quorum(),
        ("x-delivery-limit", AMQPValue::LongLongInt(1_000_000)),
    ];
    // The broker compares every argument on a redeclaration: equal ones pass, others fail.
    declare_as_is(&broker.connection, &dead, &declared)
        .await
        .expect("the dead-letter queue has exactly these arguments");
    let mut other_limit = declared.clone();
    other_limit[1].1 = AMQPValue::LongLongInt(20);
    let refused = declare_as_is(&broker.connection, &dead, &other_limit)
        .await
        .unwrap_err();
    let refused_without = declare_as_is(&broker.connection, &dead, &[quorum()])
        .await
        .unwrap_err();
    println!(
        "quorum dead-letter queue redeclared with x-delivery-limit 1000000: accepted; with a \
         limit of 20: {refused}; without a limit: {refused_without}"
    );
    broker.cleanup().await;

    let classic = TestBroker::new("dead-args", QueueType::Classic).await;
    declare_as_is(&classic.connection, classic.topology.dead(), &[])
        .await
        .expect("a classic dead-letter queue has no arguments (no delivery limit)");
    classic.cleanup().await;
}

/// Log lines written while it is the thread's subscriber.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn rabbitmqctl(args: &[&str]) -> String {
    let (code, out, err) = run(Command::new("rabbitmqctl").args(args));
    assert_eq!(code, 0, "rabbitmqctl {args:?}: {err}");
    out
}

/// Declares `topology` with this thread's log lines captured: what it found and what it logged.
async fn declare_logged(topology: &Topology, connection: &Connection) -> (Declared, String) {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let found = {
        let _logging = tracing::subscriber::set_default(subscriber);
        topology.declare(connection).await.unwrap()
    };
    (found, logs.text())
}

#[tokio::test]
async fn a_work_queue_declared_by_a_producer_without_its_protection_is_kept_with_a_warning_and_messages_flow()
-> anyhow::Result<()> {
    let topology = Topology::new(&unique("by-producer"), QueueType::Quorum);
    let broker = TestBroker::undeclared(topology.clone()).await;
    declare_as_is(&broker.connection, topology.work(), &[quorum()])
        .await
        .unwrap();

    let (found, logged) = declare_logged(&topology, &broker.connection).await;
    let Declared {
        work: Protection::Unprotected { policy },
        dead: Protection::Protected,
    } = found
    else {
        panic!("the producer's work queue was taken for a protected one: {found:?}")
    };
    println!("logged: {logged}");
    assert_eq!(logged.lines().count(), 1, "one warning: {logged}");
    let q = topology.work();
    assert!(
        logged.contains("WARN")
            && logged.contains(&format!("the work queue {q:?} already exists"))
            && logged.contains("missing: x-dead-letter-exchange, x-dead-letter-routing-key")
            && logged.contains(&policy),
        "{logged}"
    );
    assert_eq!(
        policy,
        format!(
            "rabbitmqctl set_policy -p '/' 'turnstile-{q}' '^{q}$' \
             '{{\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":\"{q}.dead\",\
             \"dead-letter-strategy\":\"at-least-once\",\"delivery-limit\":500,\
             \"overflow\":\"reject-publish\"}}' --apply-to queues"
        )
    );
    assert!(exists(&broker.connection, topology.dead()).await);
    assert!(exists(&broker.connection, &format!("{q}.wait.11")).await);
    // Declared again (as at every reconnect): no second warning.
    let (again, logged) = declare_logged(&topology, &broker.connection).await;
    assert!(
        matches!(again.work, Protection::Unprotected { .. }),
        "{again:?}"
    );
    assert!(logged.is_empty(), "warned again: {logged}");

    // A replica starts on it (declaring it again) and registers.
    let mut rig = support::rig("by-producer", "100/1s")
        .on_queue(topology.work())
        .prepare()
        .await?;
    rig.start_replicas(1, 2).await?;
    rig.publish_product("S-1", "m-by-producer", json!({}))
        .await?;
    let stats = rig.wait_registered(1).await?;
    println!("registered through the producer's work queue: {stats:?}");
    rig.stop_replicas().await?;

    // The command in the warning is accepted by this broker and applies to the queue.
    let (code, out, err) = run(Command::new("sh").args(["-c", &policy]));
    assert_eq!(code, 0, "{policy}: {out}{err}");
    let queues = rabbitmqctl(&["list_queues", "-q", "name", "policy"]);
    let line = queues.lines().find(|l| l.starts_with(&format!("{q}\t")));
    println!("rabbitmqctl list_queues name policy: {line:?}");
    rabbitmqctl(&["clear_policy", "-p", "/", &format!("turnstile-{q}")]);
    assert_eq!(line, Some(format!("{q}\tturnstile-{q}").as_str()));
    rig.cleanup().await
}

#[tokio::test]
async fn a_dead_letter_queue_declared_by_an_operator_without_its_limit_is_kept_with_a_warning_and_the_replica_runs()
-> anyhow::Result<()> {
    let topology = Topology::new(&unique("by-operator"), QueueType::Quorum);
    let broker = TestBroker::undeclared(topology.clone()).await;
    // What an operator declared before turnstile started: both queues quorum and nothing else;
    // one dead letter.
    for queue in [topology.work(), topology.dead()] {
        declare_as_is(&broker.connection, queue, &[quorum()])
            .await
            .unwrap();
    }
    put_dead_letter(&broker, "m-dead-before").await;

    let (found, logged) = declare_logged(&topology, &broker.connection).await;
    println!("logged: {logged}");
    let Declared {
        work: Protection::Unprotected {
            policy: work_policy,
        },
        dead: Protection::Unprotected {
            policy: dead_policy,
        },
    } = found
    else {
        panic!("the operator's queues were taken for protected ones: {found:?}")
    };
    let q = topology.work();
    assert_eq!(
        dead_policy,
        format!(
            r#"rabbitmqctl set_policy -p '/' 'turnstile-{q}.dead' '^{q}\.dead$' '{{"delivery-limit":1000000}}' --apply-to queues"#
        )
    );
    assert!(
        work_policy.contains(&format!("'turnstile-{q}' '^{q}$'")),
        "{work_policy}"
    );
    let warnings: Vec<&str> = logged.lines().collect();
    assert_eq!(warnings.len(), 2, "one warning a queue: {logged}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains(&work_policy),
        "{logged}"
    );
    assert!(
        warnings[1].contains("WARN")
            && warnings[1].contains(&format!(
                "the dead-letter queue {:?} already exists",
                topology.dead()
            ))
            && warnings[1].contains("missing: x-delivery-limit")
            && warnings[1].contains(&dead_policy),
        "{logged}"
    );
    assert!(exists(&broker.connection, &format!("{q}.wait.11")).await);

    // A replica starts on them (declaring them again) and registers; the dead letter stays.
    let mut rig = support::rig("by-operator", "100/1s")
        .on_queue(topology.work())
        .prepare()
        .await?;
    rig.start_replicas(1, 2).await?;
    rig.publish_product("S-1", "m-by-operator", json!({}))
        .await?;
    let stats = rig.wait_registered(1).await?;
    println!("registered next to the operator's dead-letter queue: {stats:?}");
    rig.stop_replicas().await?;
    assert_eq!(rig.depth(topology.dead()).await?, 1);

    // Both commands are accepted and each policy applies to its own queue only (the policies
    // are cleared before anything is asserted: the broker is shared).
    let applied: Vec<_> = [&work_policy, &dead_policy]
        .map(|policy| run(Command::new("sh").args(["-c", policy])))
        .into();
    let (_, queues, _) =
        run(Command::new("rabbitmqctl").args(["list_queues", "-q", "name", "policy"]));
    for name in [format!("turnstile-{q}"), format!("turnstile-{q}.dead")] {
        run(Command::new("rabbitmqctl").args(["clear_policy", "-p", "/", &name]));
    }
    for ((code, out, err), policy) in applied.iter().zip([&work_policy, &dead_policy]) {
        assert_eq!(*code, 0, "{policy}: {out}{err}");
    }
    let line = |name: &str| {
        queues
            .lines()
            .find(|l| l.starts_with(&format!("{name}\t")))
            .map(str::to_owned)
    };
    let (work_line, dead_line) = (line(q), line(topology.dead()));
    println!("rabbitmqctl list_queues name policy: {work_line:?}, {dead_line:?}");
    assert_eq!(work_line, Some(format!("{q}\tturnstile-{q}")));
    assert_eq!(dead_line, Some(format!("{q}.dead\tturnstile-{q}.dead")));
    rig.cleanup().await
}

#[tokio::test]
async fn a_classic_work_queue_still_fails_a_quorum_replica_start() -> anyhow::Result<()> {
    let rig = support::rig("classic-start", "10/1s").prepare().await?;
    let classic = unique("classic");
    declare_as_is(rig.connection(), &classic, &[])
        .await
        .unwrap();
    let mut settings = rig.settings(1);
    settings.broker.queue.name = classic.clone();
    let started = Replica::start(settings, Default::default()).await;
    let error = match started {
        Ok(_) => panic!("a quorum replica started on the classic queue {classic:?}"),
        Err(error) => error,
    };
    let shown = format!("{error:#}");
    println!("refused: {shown}");
    assert!(broker::is_configuration_error(&error), "{shown}");
    assert!(
        shown.contains("TURNSTILE_QUEUE_TYPE") && shown.contains("inequivalent arg 'x-queue-type'"),
        "{shown}"
    );
    assert!(!exists(rig.connection(), &format!("{classic}.dead")).await);
    Topology::new(&classic, QueueType::Classic)
        .delete(rig.connection().create_channel().await.as_ref().unwrap())
        .await
        .unwrap();
    rig.cleanup().await
}

#[tokio::test]
async fn a_replay_that_fails_half_way_returns_every_dead_letter_it_read_to_the_queue() {
    let broker = TestBroker::new("replay-fails", QueueType::Quorum).await;
    for id in ["m-1", "m-2", "m-3"] {
        put_dead_letter(&broker, id).await;
    }
    // Redis answers nothing: the first replayed message cannot be counted as waiting again.
    let mut redis = turnstile_lab::local_redis::LocalRedis::start().unwrap();
    let conn = turnstile_core::permit::RedisConn::connect(&support::redis_args(&redis.url(), "x"))
        .await
        .unwrap();
    let permits = turnstile_core::permit::PermitStore::new(
        conn,
        "replay-fails",
        support::limiter("10/1s", turnstile_core::config::Algorithm::SlidingWindow),
    );
    redis.stop();
    // On a channel that lives on, as a replica's (the dashboard's) would.
    let channel = broker.connection.create_channel().await.unwrap();
    let failed = dead_letters::replay(
        &channel,
        &broker.publisher,
        &broker.topology,
        &Selection::all(),
        &permits,
        Duration::from_secs(60),
        false,
    )
    .await
    .expect_err("no Redis, no replay");
    let said = format!("{failed:#}");
    assert!(said.contains("0 dead letters were replayed"), "{said}");
    // Every dead letter it read is back, while the channel stays open.
    support::eventually_async("the dead letters are back", async || {
        broker.depth(broker.topology.dead()).await == 3
    })
    .await;
    assert!(channel.status().connected());
    assert_eq!(
        broker.depth(broker.queue()).await,
        0,
        "nothing was replayed"
    );
    let listed = dead_letters::list(&channel, &broker.topology, &Selection::all())
        .await
        .unwrap();
    assert_eq!(listed.len(), 3, "{listed:?}");
    broker.cleanup().await;
}

#[tokio::test]
async fn a_listing_counts_every_dead_letter_selected_and_holds_only_those_it_shows() {
    let broker = TestBroker::new("dead-first", QueueType::Quorum).await;
    for i in 0..7 {
        let seller = if i % 2 == 0 { "S-even" } else { "S-odd" };
        let body = json!({"message_id": format!("m-{i}"), "seller_id": seller, "product": {}});
        broker
            .publisher
            .publish(
                "",
                broker.topology.dead(),
                body.to_string().as_bytes(),
                BasicProperties::default().with_content_type("application/json".into()),
            )
            .await
            .unwrap();
    }
    let channel = broker.connection.create_channel().await.unwrap();
    let (matched, shown) = dead_letters::list_first(
        &channel,
        &broker.topology,
        &Selection::all().with_seller("S-even"),
        2,
    )
    .await
    .unwrap();
    assert_eq!(matched, 4, "every dead letter of the seller counted");
    let ids: Vec<_> = shown
        .iter()
        .map(|l| l.message_id.clone().unwrap())
        .collect();
    assert_eq!(ids, ["m-0", "m-2"], "the first ones, in the queue's order");
    // Those it left come back asynchronously.
    support::eventually_async("the dead letters back", async || {
        broker.depth(broker.topology.dead()).await == 7
    })
    .await;
    let all = dead_letters::list(&channel, &broker.topology, &Selection::all())
        .await
        .unwrap();
    assert_eq!(all.len(), 7, "a listing leaves them all: {all:?}");
    broker.cleanup().await;
}
