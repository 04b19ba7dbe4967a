//! The work queue's delivery limit and dead-letter target (issue 12): a message returned more
//! often than the limit is dead-lettered to `<q>.dead` (neither lost nor looping forever), then
//! listed and replayed; a work queue declared by an older turnstile is kept with a warning;
//! another difference (the queue type) still fails the start.
mod support;

use std::io::Write;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;
use support::broker::TestBroker;
use support::pipeline::Pipeline;
use support::{run, unique};
use turnstile::broker::{
    self, QueueType, Topology, WORK_DELIVERY_LIMIT, WorkQueue, dead_letters, long_string,
};
use turnstile::replica::Replica;

/// Declares a durable queue on a channel of its own, as another client (or an older
/// turnstile) would.
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
        WorkQueue::Protected
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
    let listed = dead_letters::list(&channel, &broker.topology, Some("delivery-limit"))
        .await
        .unwrap();
    println!("listed: {listed:?}");
    assert_eq!(listed.len(), 1, "{listed:?}");
    let letter = &listed[0];
    assert_eq!(letter.reason, dead_letters::DELIVERY_LIMIT_REASON);
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
        turnstile::config::Algorithm::SlidingWindow,
    ));
    let replayed = dead_letters::replay(
        &channel,
        &broker.publisher,
        &broker.topology,
        Some("delivery-limit"),
        &permits,
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    assert_eq!((replayed.replayed, replayed.kept), (1, 0));
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

#[tokio::test]
async fn a_work_queue_declared_by_an_older_turnstile_is_kept_with_a_warning_and_messages_flow() {
    let topology = Topology::new(&unique("legacy"), QueueType::Quorum);
    let broker = TestBroker::undeclared(topology.clone()).await;
    declare_as_is(&broker.connection, topology.work(), &[quorum()])
        .await
        .unwrap();

    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let found = {
        let _logging = tracing::subscriber::set_default(subscriber);
        topology.declare(&broker.connection).await.unwrap()
    };
    let WorkQueue::Legacy { policy } = found else {
        panic!("the old work queue was taken for a new one: {found:?}")
    };
    let logged = logs.text();
    println!("logged: {logged}");
    assert_eq!(logged.lines().count(), 1, "one warning: {logged}");
    assert!(
        logged.contains("WARN") && logged.contains(&policy),
        "{logged}"
    );
    let q = topology.work();
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

    // A replica starts on it (declaring it again) and registers.
    let mut p = Pipeline::on_broker("legacy", "100/1s", broker).await;
    p.start_replicas(1, 2).await;
    p.publish_product("S-1", "m-legacy", json!({})).await;
    let stats = p.wait_registered(1).await;
    println!("registered through the old work queue: {stats:?}");
    p.stop_replicas().await;

    // The command in the warning is accepted by this broker and applies to the queue.
    let (code, out, err) = run(Command::new("sh").args(["-c", &policy]));
    assert_eq!(code, 0, "{policy}: {out}{err}");
    let queues = rabbitmqctl(&["list_queues", "-q", "name", "policy"]);
    let line = queues.lines().find(|l| l.starts_with(&format!("{q}\t")));
    println!("rabbitmqctl list_queues name policy: {line:?}");
    rabbitmqctl(&["clear_policy", "-p", "/", &format!("turnstile-{q}")]);
    assert_eq!(line, Some(format!("{q}\tturnstile-{q}").as_str()));
    p.cleanup().await;
}

#[tokio::test]
async fn a_classic_work_queue_still_fails_a_quorum_replica_start() {
    let p = Pipeline::new("classic-start", "10/1s").await;
    let classic = unique("classic");
    declare_as_is(&p.broker.connection, &classic, &[])
        .await
        .unwrap();
    let mut settings = p.settings(1);
    settings.broker.queue = classic.clone();
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
    assert!(!exists(&p.broker.connection, &format!("{classic}.dead")).await);
    Topology::new(&classic, QueueType::Classic)
        .delete(p.broker.connection.create_channel().await.as_ref().unwrap())
        .await
        .unwrap();
    p.cleanup().await;
}
