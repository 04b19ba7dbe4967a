//! The calendar, against the real RabbitMQ: a wait longer than the delay ladder's top level
//! holds is published once, to the calendar queue of its due time; the replicas consume that
//! queue from its slot's opening and hand each message to their workers when it is due, also
//! after a replica holding it stopped.
mod support;

use std::time::Duration;

use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use turnstile_core::broker::ladder::{LEVELS, calendar_slot};
use turnstile_core::broker::{self, QueueType, unix_ms};

#[tokio::test]
async fn a_wait_of_hours_is_published_once_to_the_calendar_queue_of_its_due_time() {
    let broker = support::broker::TestBroker::new("calendar-publish", QueueType::Quorum).await;
    broker
        .publish(br#"{"seller_id":"S-cal","message_id":"m-1","product":{}}"#)
        .await;
    let channel = broker.connection.create_channel().await.unwrap();
    let mut consumer = channel
        .basic_consume(
            broker.queue().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let delivery = consumer.next().await.unwrap().unwrap();
    let wait = Duration::from_secs(3 * 3600);
    let due = unix_ms() + wait.as_millis() as u64;
    broker
        .publisher
        .delay(&broker.topology, &delivery, wait, &[])
        .await
        .expect("published to the calendar");
    let _ = channel.close(200, "".into()).await;
    // The delay read the clock a moment after `due` was: its slot, or the next.
    let slot = calendar_slot(due);
    let mut in_calendar = 0;
    for slot in [slot, slot + 1] {
        let channel = broker.connection.create_channel().await.unwrap();
        in_calendar += broker::depth(&channel, &broker.topology.calendar(slot))
            .await
            .unwrap_or(0);
    }
    let mut in_levels = 0;
    for k in 0..LEVELS {
        in_levels += broker.depth(&format!("{}.wait.{k}", broker.queue())).await;
    }
    println!(
        "a wait of 3 h: {in_calendar} in its slot's calendar queue, {in_levels} in the levels"
    );
    assert_eq!(in_calendar, 1);
    assert_eq!(in_levels, 0);
    broker.cleanup().await;
}

#[tokio::test]
async fn an_open_slots_messages_are_handed_on_when_due_also_after_their_replica_stopped()
-> anyhow::Result<()> {
    let mut rig = support::rig("calendar-open", "100/1s").prepare().await?;
    let queue = support::park_in_open_calendar_slot(&rig, "S-cal", 3, 4_000).await;
    rig.start_replica(rig.settings(2)).await?;
    support::eventually_async("the replica holds the slot's messages", async || {
        rig.total(|s| &s.ladder.deliveries) >= 3
    })
    .await;
    assert_eq!(rig.mock.stats().registered, 0, "held until due, not called");
    // Stopped while holding them: they go back to the slot's queue, and the next replica,
    // probing the open slots as it starts, takes them and hands them on when due.
    rig.stop_replicas().await?;
    rig.start_replica(rig.settings(2)).await?;
    support::eventually_async("3 registered", async || rig.mock.stats().registered >= 3).await;
    rig.stop_replicas().await?;
    let stats = rig.mock.stats();
    let left = {
        let channel = rig.connection().create_channel().await?;
        let left = broker::depth(&channel, &queue).await?;
        let _ = channel.close(200, "".into()).await;
        left
    };
    println!(
        "3 messages parked in an open calendar slot: {} registered, {} duplicates, {left} left",
        stats.registered, stats.duplicates
    );
    assert_eq!(stats.registered, 3);
    assert_eq!(stats.duplicates, 0);
    assert_eq!(left, 0);
    rig.cleanup().await
}
