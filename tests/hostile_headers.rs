//! Every `x-turnstile-*` header is untrusted: anyone can publish one, and the broker can
//! duplicate a message. Forged, copied or malformed bookkeeping must never let a call through,
//! stop a worker, or hold up other sellers.
mod support;

use std::sync::atomic::Ordering;

use lapin::types::AMQPValue;
use serde_json::json;
use support::asks::decide;
use turnstile_core::broker::{headers, long_string};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::{Ask, Decision, Reservation};

fn body(seller: &str, id: &str) -> Vec<u8> {
    json!({"message_id": id, "seller_id": seller, "product": {"id": id}})
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn forged_and_copied_reservations_never_let_a_call_through() -> anyhow::Result<()> {
    let mut rig = support::rig("forged", "2/3s").prepare().await?;
    let store = rig.store();
    let seller = SellerId::parse("S-forged").unwrap();
    // Take the seller's limit (out of the downstream's sight) and reserve one genuine slot.
    let genuine = loop {
        match decide(&store, Ask::new(&seller)).await {
            Decision::Granted { .. } => continue,
            Decision::Wait {
                reservation: Some(r),
                ..
            } => break r,
            other => panic!("expected a reservation: {other:?}"),
        }
    };
    let header = |r: &Reservation| (headers::RESERVATION, long_string(&r.encode()));
    // Three copies of the genuine reservation (a duplicated ladder message, a lost ack) ...
    for i in 0..3 {
        rig.publish_with_headers(&body("S-forged", &format!("copy-{i}")), &[header(&genuine)])
            .await?;
    }
    // ... and six reservations nobody made, for the same slot, on the same Redis.
    for i in 0..6 {
        let forged = Reservation {
            token: format!("forged-{i}"),
            ..genuine.clone()
        };
        rig.publish_with_headers(
            &body("S-forged", &format!("forged-{i}")),
            &[header(&forged)],
        )
        .await?;
    }
    rig.start_replicas(1, 4).await?;
    let stats = rig.wait_registered(9).await?;
    let not_reserved = rig.total(|s| &s.forfeited);
    rig.stop_replicas().await?;
    println!("forged and copied reservations: {stats:?}, {not_reserved} reservations refused");
    assert_eq!(stats.violations, 0, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert!(
        not_reserved >= 8,
        "the genuine slot was redeemed once, the rest acquired anew"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn malformed_internal_headers_neither_stop_a_replica_nor_block_other_sellers()
-> anyhow::Result<()> {
    let mut rig = support::rig("malformed", "100/1s").prepare().await?;
    rig.start_replicas(1, 2).await?;
    let forged: Vec<(&str, AMQPValue)> = vec![
        (headers::RESERVATION, long_string("garbage")),
        (headers::RESERVATION, long_string("1/0/1/abc")), // the old form, with a count of 0
        (headers::RESERVATION, long_string("1/0/1/abc/tok")),
        (headers::RESERVATION, long_string("-5/2/1000/abc/tok")),
        (headers::RESERVATION, long_string("5/2/1000/not-hex/tok")),
        (headers::RESERVATION, long_string("5/2/1000/ab/bad token!")),
        (headers::RESERVATION, AMQPValue::LongLongInt(42)),
        (headers::ATTEMPT, long_string("many")),
        (headers::ATTEMPT, AMQPValue::LongLongInt(-5)),
        (headers::ATTEMPT, AMQPValue::LongLongInt(i64::MAX)),
        (headers::DELAYS, long_string("\u{0}")),
    ];
    for (i, header) in forged.iter().enumerate() {
        rig.publish_with_headers(
            &body("S-odd", &format!("odd-{i}")),
            std::slice::from_ref(header),
        )
        .await?;
    }
    rig.publish("S-normal", 3).await?;
    let stats = rig.wait_registered(forged.len() as u64 + 3).await?;
    rig.wait_settled_registered(forged.len() as u64 + 3).await?;
    let dead = rig.total(|s| &s.dead_lettered);
    let ready = rig.replicas().all(|r| r.ready.get());
    let in_flight: usize = rig
        .replicas()
        .map(|r| r.stats.in_flight.load(Ordering::Relaxed))
        .sum();
    rig.stop_replicas().await?;
    assert_eq!(stats.sellers["S-normal"].registered, 3, "{stats:?}");
    assert_eq!(stats.violations, 0);
    assert_eq!(dead, 0, "odd headers are ignored, not fatal");
    assert!(ready);
    assert_eq!(in_flight, 0);
    rig.cleanup().await
}
