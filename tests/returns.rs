//! A copy the broker returns as unroutable (its queue deleted at runtime) is never confirmed as
//! delivered: the AMQP client hands a return to whichever publish of the channel is confirmed
//! next, and that publish republishes it to the return queue.

mod support;

use futures::StreamExt;
use lapin::BasicProperties;
use support::broker::TestBroker;
use turnstile_core::broker::{PublishError, Publisher, QueueType, Routing};

/// Publishes `n` messages to an exchange no queue is bound to (not mandatory: confirmed at once,
/// often several in one multiple ack) and `n` copies to a queue that does not exist (mandatory:
/// returned), interleaved, all at once on one channel; returns how many of the latter were
/// reported unroutable to their own publish, and whether every one of the former was
/// confirmed.
async fn publish_beside_a_missing_queue(
    broker: &TestBroker,
    publisher: &Publisher,
    n: usize,
) -> (usize, bool) {
    let gone = format!("{}.gone", broker.queue());
    let sends = (0..2 * n).map(|i| {
        let (exchange, queue, body, routing) = if i % 2 == 0 {
            (
                "",
                broker.queue().to_owned(),
                format!("work-{i}"),
                Routing::Optional,
            )
        } else {
            ("", gone.clone(), format!("gone-{i}"), Routing::Mandatory)
        };
        async move {
            let properties = BasicProperties::default();
            let sent = publisher
                .publish_to(exchange, &queue, body.as_bytes(), properties, routing)
                .await;
            (queue, sent)
        }
    });
    let results: Vec<_> = futures::stream::iter(sends)
        .buffer_unordered(2 * n)
        .collect()
        .await;
    let unroutable = results
        .iter()
        .filter(|(q, sent)| *q == gone && matches!(sent, Err(PublishError::Unroutable(_))))
        .count();
    let work_confirmed = results
        .iter()
        .filter(|(q, _)| *q != gone)
        .all(|(_, sent)| sent.is_ok());
    (unroutable, work_confirmed)
}

#[tokio::test]
async fn a_copy_returned_to_another_publish_is_republished_to_the_return_queue() {
    let broker = TestBroker::new("returns", QueueType::Classic).await;
    let publisher = broker
        .publisher
        .clone()
        .rescuing_to(broker.topology.ready());
    // A return lands on another publish now and then (in about one round in four here without
    // the rescue): several rounds.
    let (n, rounds) = (200, 8);
    let mut unroutable = 0;
    for _ in 0..rounds {
        let (reported, work_confirmed) =
            publish_beside_a_missing_queue(&broker, &publisher, n).await;
        assert!(work_confirmed, "a publish took another's return");
        unroutable += reported;
    }
    let rescued = broker.depth(broker.topology.ready()).await as usize;
    assert_eq!(
        unroutable + rescued,
        n * rounds,
        "every copy to the missing queue is reported unroutable or rescued ({unroutable} + {rescued})"
    );
    broker.cleanup().await;
}
