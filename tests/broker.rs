//! The broker topology: idempotent declaration and the delay ladder.
mod support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;
use support::broker::TestBroker;
use turnstile_core::broker::{QueueType, headers};

async fn ladder_returns_messages_after_their_delay(queue_type: QueueType) {
    let broker = TestBroker::new("ladder", queue_type).await;
    broker
        .topology
        .declare(&broker.connection)
        .await
        .expect("declaring twice is fine");
    let ladder = broker.run_ladder().await;
    let mut consumer = broker.consume(broker.queue()).await;
    let mut returns = broker.consume(broker.topology.ready()).await;
    // Publish a message, consume it, and send it through the ladder with several delays, the
    // longest first: none waits behind a longer one. Each comes back on the return queue.
    let delays = [3000u64, 1250, 250, 0];
    for (i, _) in delays.iter().enumerate() {
        broker.publish(format!(r#"{{"n":{i}}}"#).as_bytes()).await;
    }
    let mut originals: Vec<Delivery> = Vec::new();
    for _ in delays {
        originals.push(consumer.next().await.unwrap().unwrap());
    }
    let started = Instant::now();
    for (delivery, delay) in originals.iter().zip(delays) {
        broker
            .publisher
            .delay(
                &broker.topology,
                delivery,
                Duration::from_millis(delay),
                &[(headers::ATTEMPT, AMQPValue::LongLongInt(2))],
            )
            .await
            .unwrap();
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
    }
    let mut arrivals = Vec::new();
    for _ in delays {
        let d = returns.next().await.unwrap().unwrap();
        let n: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(
            turnstile_core::broker::header_u64(&d, headers::ATTEMPT),
            Some(2)
        );
        assert_eq!(
            turnstile_core::broker::header_u64(&d, headers::DELAYS),
            Some(1)
        );
        arrivals.push((n["n"].as_u64().unwrap() as usize, started.elapsed()));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    let order: Vec<usize> = arrivals.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        order,
        vec![3, 2, 1, 0],
        "shorter delays came back first: {arrivals:?}"
    );
    for (n, at) in &arrivals {
        assert!(
            *at >= Duration::from_millis(delays[*n]),
            "message {n} came back early: {at:?}"
        );
        println!(
            "{queue_type:?}: delay {} ms came back after {} ms",
            delays[*n],
            at.as_millis()
        );
    }
    ladder.cancel();
    broker.cleanup().await;
}

#[tokio::test]
async fn the_delay_ladder_returns_messages_after_their_delay_on_quorum_queues() {
    ladder_returns_messages_after_their_delay(QueueType::Quorum).await;
}

#[tokio::test]
async fn the_delay_ladder_returns_messages_after_their_delay_on_classic_queues() {
    ladder_returns_messages_after_their_delay(QueueType::Classic).await;
}

#[tokio::test]
async fn a_message_delayed_again_through_the_same_level_still_comes_back() {
    let broker = TestBroker::new("again", QueueType::Quorum).await;
    let ladder = broker.run_ladder().await;
    let mut consumer = broker.consume(broker.queue()).await;
    let mut returns = broker.consume(broker.topology.ready()).await;
    broker.publish(br#"{"n":1}"#).await;
    let mut delivery = consumer.next().await.unwrap().unwrap();
    for round in 0..3 {
        broker
            .publisher
            .delay(&broker.topology, &delivery, Duration::from_millis(750), &[])
            .await
            .unwrap();
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
        let next = tokio::time::timeout(Duration::from_secs(30), returns.next()).await;
        delivery = next
            .unwrap_or_else(|_| panic!("round {round}: the message did not come back"))
            .unwrap()
            .unwrap();
        assert_eq!(
            turnstile_core::broker::header_u64(&delivery, headers::DELAYS),
            Some(round + 1)
        );
    }
    delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .unwrap();
    ladder.cancel();
    broker.cleanup().await;
}

/// One message waits 13 s on two ladders: under a consumer timeout of 8 s (the longest hold 6
/// s) it is republished twice on its way (at 6 s and 12 s, each publish confirmed before the
/// ack), under the default 30 minutes it is held once; both come back after their wait.
#[tokio::test]
async fn a_wait_longer_than_the_consumer_timeout_allows_is_held_in_passes_and_a_raised_timeout_holds_it_once()
 {
    use turnstile_core::broker::Topology;
    use turnstile_core::config::ConsumerTimeout;

    async fn wait_through(timeout: ConsumerTimeout) -> (u64, u64, Duration) {
        let topology = Topology::new(&support::unique("passes"), QueueType::Quorum)
            .with_consumer_timeout(timeout);
        let broker = TestBroker::undeclared(topology).await;
        broker.topology.declare(&broker.connection).await.unwrap();
        let (ladder, stats) = broker.run_ladder_handing(None).await;
        let mut consumer = broker.consume(broker.queue()).await;
        let mut returns = broker.consume(broker.topology.ready()).await;
        broker.publish(br#"{"n":1}"#).await;
        let delivery = consumer.next().await.unwrap().unwrap();
        let started = Instant::now();
        broker
            .publisher
            .delay(&broker.topology, &delivery, Duration::from_secs(13), &[])
            .await
            .unwrap();
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
        let back = tokio::time::timeout(Duration::from_secs(60), returns.next())
            .await
            .expect("the message comes back")
            .unwrap()
            .unwrap();
        let waited = started.elapsed();
        back.acker.ack(BasicAckOptions::default()).await.unwrap();
        let seen = (
            stats.deliveries.load(std::sync::atomic::Ordering::Relaxed),
            stats.hops.load(std::sync::atomic::Ordering::Relaxed),
        );
        ladder.cancel();
        broker.cleanup().await;
        (seen.0, seen.1, waited)
    }

    let short: ConsumerTimeout = "8s".parse().unwrap();
    let ((short_deliveries, short_hops, short_wait), (long_deliveries, long_hops, long_wait)) = tokio::join!(
        wait_through(short),
        wait_through(ConsumerTimeout::default())
    );
    assert_eq!(
        (short_deliveries, short_hops),
        (3, 3),
        "under 8 s: levels 5, 4 and 2, republished twice on the way and once to the return queue"
    );
    assert_eq!(
        (long_deliveries, long_hops),
        (1, 1),
        "under 30 minutes: held once, then to the return queue"
    );
    for waited in [short_wait, long_wait] {
        assert!(waited >= Duration::from_millis(13_000 - 250), "{waited:?}");
    }
}

/// A ladder that hands its due messages to the workers: each delayed message is delivered once
/// from its level, whatever its wait, in the order of its due time, never early, and settled
/// by whoever it was handed to; a message that keeps coming back to its level (requeued, as at
/// a lost connection or a crash) goes through the return queue after `HANDED_RETURNS` returns.
#[tokio::test]
async fn the_ladder_hands_due_messages_to_the_workers_once_each() {
    use turnstile_core::broker::ladder::HANDED_RETURNS;
    let broker = TestBroker::new("handoff", QueueType::Quorum).await;
    let (handed_tx, mut handed) = tokio::sync::mpsc::unbounded_channel();
    let handoff: turnstile_core::broker::ladder::Handoff =
        std::sync::Arc::new(move |delivery, settler| {
            let _ = handed_tx.send((delivery, settler));
        });
    let (stop, stats) = broker.run_ladder_handing(Some(handoff)).await;
    let mut consumer = broker.consume(broker.queue()).await;
    let delays = [5_000u64, 3_100, 700];
    for (i, _) in delays.iter().enumerate() {
        broker.publish(format!(r#"{{"n":{i}}}"#).as_bytes()).await;
    }
    let started = Instant::now();
    for delay in delays {
        let delivery = consumer.next().await.unwrap().unwrap();
        broker
            .publisher
            .delay(
                &broker.topology,
                &delivery,
                Duration::from_millis(delay),
                &[],
            )
            .await
            .unwrap();
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
    }
    let mut order = Vec::new();
    for _ in delays {
        let (delivery, settler) = handed.recv().await.unwrap();
        let at = started.elapsed();
        let n = serde_json::from_slice::<serde_json::Value>(&delivery.data).unwrap()["n"]
            .as_u64()
            .unwrap() as usize;
        assert!(
            at >= Duration::from_millis(delays[n]),
            "message {n} came back early: {at:?}"
        );
        assert!(!delivery.redelivered);
        println!(
            "delay {} ms handed on after {} ms",
            delays[n],
            at.as_millis()
        );
        order.push(n);
        // The last one goes back to its level, as at a lost connection; the others are done.
        if n == 0 {
            settler.requeue(delivery.delivery_tag).await.unwrap();
        } else {
            settler.ack(delivery.delivery_tag);
        }
    }
    assert_eq!(order, [2, 1, 0], "in the order of their due times");
    // Due and back in its level: handed on at once, until it came back too often.
    for _ in 1..HANDED_RETURNS {
        let (delivery, settler) = handed.recv().await.unwrap();
        assert!(delivery.redelivered);
        settler.requeue(delivery.delivery_tag).await.unwrap();
    }
    let mut returns = broker.consume(broker.topology.ready()).await;
    let back = tokio::time::timeout(Duration::from_secs(30), returns.next())
        .await
        .expect("the message returned too often comes back through the return queue")
        .unwrap()
        .unwrap();
    back.acker.ack(BasicAckOptions::default()).await.unwrap();
    let counted = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    // The ladder counts its republish once the broker confirmed it, which may be after the
    // copy reached the return queue's consumer.
    for _ in 0..100 {
        if counted(&stats.hops) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let returned = HANDED_RETURNS;
    assert_eq!(
        counted(&stats.deliveries),
        3 + returned,
        "one delivery from a level each, and one for each return"
    );
    assert_eq!(counted(&stats.handed), 2 + returned);
    assert_eq!(
        counted(&stats.hops),
        1,
        "only the one returned too often was republished"
    );
    assert!(handed.try_recv().is_err(), "nothing was handed twice");
    stop.cancel();
    tokio::time::sleep(Duration::from_millis(200)).await;
    for queue in broker.topology.queues() {
        assert_eq!(broker.depth(&queue).await, 0, "{queue} is empty");
    }
    broker.cleanup().await;
}

/// A message with forged hop end and due time far ahead, published straight to the shortest
/// level, is held no longer than that level's hold: it moves on to the top level (its due time
/// cut to the longest delay), and is not handed to the workers.
#[tokio::test]
async fn a_forged_hop_end_is_held_no_longer_than_its_level() {
    let broker = TestBroker::new("forged", QueueType::Quorum).await;
    let handed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let handoff: turnstile_core::broker::ladder::Handoff = {
        let handed = handed.clone();
        std::sync::Arc::new(move |delivery, settler| {
            handed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            settler.ack(delivery.delivery_tag);
        })
    };
    let (stop, stats) = broker.run_ladder_handing(Some(handoff)).await;
    let mut table = lapin::types::FieldTable::default();
    table.insert(headers::HOP.into(), AMQPValue::LongLongInt(i64::MAX));
    table.insert(headers::DUE.into(), AMQPValue::LongLongInt(i64::MAX));
    let properties = lapin::BasicProperties::default().with_headers(table);
    let shortest = format!("{}.wait.0", broker.queue());
    broker
        .publisher
        .publish("", &shortest, br#"{"n":1}"#, properties)
        .await
        .unwrap();
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    support::eventually("moved on from the shortest level", || {
        load(&stats.hops) == 1
    })
    .await;
    support::eventually("held by the top level's consumer", || {
        load(&stats.deliveries) == 2
    })
    .await;
    assert_eq!(load(&handed), 0, "not due: not handed to the workers");
    stop.cancel();
    broker.cleanup().await;
}

/// A connection of its own consuming the test's work queue as `tag`, on one channel.
async fn consume(
    broker: &TestBroker,
    tag: &str,
) -> (lapin::Connection, lapin::Channel, lapin::Consumer) {
    let connection = turnstile_core::broker::connect(
        &support::broker::amqp_url(),
        &format!("turnstile test {tag}"),
    )
    .await
    .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let consumer = channel
        .basic_consume(
            broker.queue().into(),
            tag.into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    (connection, channel, consumer)
}

#[tokio::test]
async fn batched_acks_settle_exactly_what_was_acked_in_any_order() {
    let broker = TestBroker::new("settle", QueueType::Quorum).await;
    for i in 1..=10 {
        broker.publish(format!(r#"{{"n":{i}}}"#).as_bytes()).await;
    }
    let (connection, channel, mut consumer) = consume(&broker, "settle").await;
    let settler = turnstile_core::broker::Settler::new(channel.clone());
    let mut tags = Vec::new();
    for _ in 0..10 {
        let delivery = consumer.next().await.unwrap().unwrap();
        settler.received(delivery.delivery_tag);
        tags.push(delivery.delivery_tag);
    }
    // Out of order: the first two stay unsettled for a while, the fifth is requeued, and
    // one (the last) is never settled at all.
    for &tag in &tags[2..9] {
        if tag == tags[4] {
            settler.requeue(tag).await.unwrap();
        } else {
            settler.ack(tag);
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    settler.ack(tags[1]);
    settler.ack(tags[0]);
    settler.flush().await.unwrap();
    // Closing the channel returns what it still holds: the requeued one (redelivered to this
    // consumer meanwhile, or still ready) and the unsettled last one.
    channel.close(200, "done".into()).await.unwrap();
    connection.close(200, "done".into()).await.unwrap();
    assert_eq!(
        broker.depth(broker.queue()).await,
        2,
        "exactly the requeued and the never-settled message are left"
    );
    broker.cleanup().await;
}

/// A settler that acks singly never covers a delivery it was not told of: the ladder's channel
/// has a consumer per level, each recording its own deliveries, not in the channel's tag order.
#[tokio::test]
async fn a_single_acking_settler_never_acks_a_delivery_not_yet_recorded() {
    let broker = TestBroker::new("singly", QueueType::Quorum).await;
    for i in 1..=3 {
        broker.publish(format!(r#"{{"n":{i}}}"#).as_bytes()).await;
    }
    let (connection, channel, mut consumer) = consume(&broker, "singly").await;
    let settler = turnstile_core::broker::Settler::new(channel.clone()).singly();
    let mut tags = Vec::new();
    for _ in 0..3 {
        tags.push(consumer.next().await.unwrap().unwrap().delivery_tag);
    }
    // The first is not recorded yet (its consumer's task has not run), the second is acked.
    settler.received(tags[1]);
    settler.received(tags[2]);
    settler.ack(tags[1]);
    settler.flush().await.unwrap();
    channel.close(200, "done".into()).await.unwrap();
    connection.close(200, "done".into()).await.unwrap();
    assert_eq!(
        broker.depth(broker.queue()).await,
        2,
        "the unrecorded first and the unsettled third are left"
    );
    broker.cleanup().await;
}

/// Replicas given a list of broker nodes whose first never answers (`TURNSTILE_AMQP_URL`
/// comma-separated, as for a cluster) connect to one that answers and register everything; a
/// list with a malformed URL is refused before anything connects, naming the node.
#[tokio::test]
async fn replicas_given_several_broker_nodes_use_one_that_answers() -> anyhow::Result<()> {
    use turnstile_core::config::Algorithm;
    use turnstile_lab::rig::{Rig, RigArgs};
    let place = RigArgs {
        queue_type: QueueType::Quorum,
        amqp: turnstile_core::broker::AmqpArgs {
            url: format!(
                "amqp://guest:guest@127.0.0.1:1/%2f,{}",
                support::broker::amqp_url()
            ),
        },
        redis: support::redis_args(&support::redis_url(), "t"),
    };
    let limiter = support::limiter("50/1s", Algorithm::SlidingWindow);
    let settings = place.replica_settings("nodes", limiter, 4, Duration::from_secs(2));
    let mut rig = Rig::build(settings).prepare().await?;
    rig.publish("S-nodes", 10).await?;
    rig.start_replicas(2, 4).await?;
    let stats = rig.wait_registered(10).await?;
    assert_eq!((stats.registered, stats.duplicates), (10, 0), "{stats:?}");
    rig.cleanup().await?;

    let refused = turnstile_core::broker::Nodes::parse(&format!(
        "{},amqp://guest:secret@127.0.0.1:5672/%2f?heartbeat=x",
        support::broker::amqp_url()
    ))
    .unwrap_err();
    let said = format!("{refused:#}");
    assert!(
        said.contains("node 2 of 2") && !said.contains("secret"),
        "{said}"
    );
    Ok(())
}
