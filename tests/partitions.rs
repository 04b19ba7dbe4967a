//! One replica of two loses one of its links, to the broker or to Redis, in the middle of three
//! sellers' backlogs (`turnstile_lab::bench::partition`, also `turnstile bench scenario --preset
//! partition`): the link resets (`SlowLink::cut`) or hangs (`SlowLink::hang`: the sockets stay
//! open, nothing comes back) for 20 s and until every message registered, then heals. The
//! replica cut off reports not ready while cut (a hang is seen within its
//! TURNSTILE_LINK_TIMEOUT, 2 s here), hands its held and delayed messages back, and consumes
//! again once the link heals; the other replica keeps serving. What is asserted: no message
//! called twice, no call over the limit, nothing lost, the cut replica not ready while cut and
//! ready again after. The figures (how soon the replica saw the break, duplicates, each seller's
//! drain beside the optimum its limit allows) are printed, one line per case, not asserted.
mod support;

use turnstile_lab::bench::partition::{self, LIMIT, Link, Mode, Outcome, WORKERS};

/// Runs the case on a rig of the tests' own and prints its figures.
async fn one_replica_loses(link: Link, mode: Mode) -> Outcome {
    let rig = support::rig(
        &format!("partition-{link:?}-{mode:?}").to_lowercase(),
        LIMIT,
    );
    let outcome = partition::one_replica_loses(rig, WORKERS, link, mode)
        .await
        .unwrap();
    println!("{}", outcome.line());
    outcome
}

/// What every case must show.
fn assert_nothing_twice_nothing_over_nothing_lost(outcome: &Outcome) {
    let case = format!("{:?} link, {:?}", outcome.link, outcome.mode);
    let report = &outcome.report;
    assert_eq!(
        report.duplicates, 0,
        "{case}: no message is called twice (the API saw {} repeated Idempotency-Keys: {:?})",
        report.duplicates, report.repeats
    );
    assert_eq!(
        report.violations, 0,
        "{case}: no call goes over the limit (the API refused {})",
        report.violations
    );
    assert_eq!(
        (report.registered, report.dead_lettered, report.lost),
        (report.published, 0, 0),
        "{case}: every message registers once, none is dead-lettered or lost"
    );
    assert!(
        outcome.queues_empty,
        "{case}: nothing is left in the queues once everything registered"
    );
    assert!(
        outcome.not_ready_after_s.is_some(),
        "{case}: the replica cut off reports not ready while its link is broken"
    );
    assert!(outcome.why.is_some(), "{case}: it says why it is not ready");
    assert!(
        outcome.not_ready_at_heal,
        "{case}: it is still not ready when the link heals"
    );
    assert!(
        outcome.ready_after_s.is_some(),
        "{case}: it is ready again once the link heals"
    );
}

/// What a replica cut off from Redis must show besides: the other one kept registering while
/// the cut one was not ready.
fn assert_the_other_replica_kept_serving(outcome: &Outcome) {
    assert!(
        outcome.other_while_not_ready > 0,
        "Redis link, {:?}: the other replica keeps registering while the cut one is not ready",
        outcome.mode
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_link_that_resets_makes_no_duplicate_call_and_loses_nothing() {
    let outcome = one_replica_loses(Link::Broker, Mode::Reset).await;
    assert_nothing_twice_nothing_over_nothing_lost(&outcome);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_broker_link_makes_no_duplicate_call() {
    let outcome = one_replica_loses(Link::Broker, Mode::Hang).await;
    assert_nothing_twice_nothing_over_nothing_lost(&outcome);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_redis_link_resets_hands_its_messages_to_the_other() {
    let outcome = one_replica_loses(Link::Redis, Mode::Reset).await;
    assert_nothing_twice_nothing_over_nothing_lost(&outcome);
    assert_the_other_replica_kept_serving(&outcome);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_redis_link_hangs_hands_its_messages_to_the_other() {
    let outcome = one_replica_loses(Link::Redis, Mode::Hang).await;
    assert_nothing_twice_nothing_over_nothing_lost(&outcome);
    assert_the_other_replica_kept_serving(&outcome);
}

/// Four sellers of one message each, an API answering in 2 s, one replica behind a link to
/// the broker: once it has the four calls in flight, a second replica starts and the first one's
/// broker link resets; with `published_again`, every message is then published once more (a
/// producer's duplicates). What the API and the queues say once every message is registered,
/// and whether every copy was acked within [`partition::GUARD`].
async fn calls_in_flight_when_the_link_resets(
    what: &str,
    published_again: bool,
) -> (turnstile_lab::rig::Report, bool) {
    use std::time::Duration;
    use turnstile_lab::mock_api::MockArgs;
    use turnstile_lab::rig::Message;

    let limit: turnstile_core::config::Limits = LIMIT.parse().expect("the limit parses");
    let mut rig = support::rig(what, LIMIT)
        .with_mock(MockArgs {
            latency_ms: 2_000,
            ..MockArgs::local(limit)
        })
        .prepare()
        .await
        .unwrap();
    let (settings, link) = partition::behind_a_link(&rig, WORKERS, Link::Broker)
        .await
        .unwrap();
    let _cut = rig.start_replica(settings).await.unwrap();
    let messages = || {
        (0..SELLERS_IN_FLIGHT)
            .map(|i| Message::numbered(&format!("S-{i}"), 0))
            .collect::<Vec<_>>()
    };
    rig.publish_all(messages()).await.unwrap();
    while rig.mock.stats().requests < SELLERS_IN_FLIGHT {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _other = rig.start_replica(rig.settings(WORKERS)).await.unwrap();
    link.cut();
    if published_again {
        rig.publish_all(messages()).await.unwrap();
    }
    rig.wait_registered(SELLERS_IN_FLIGHT).await.unwrap();
    let settled = rig.wait_queues_empty(partition::GUARD).await;
    let report = rig.finish().await.unwrap();
    drop(link);
    (report, settled)
}

/// The sellers of [`calls_in_flight_when_the_link_resets`].
const SELLERS_IN_FLIGHT: u64 = 4;

/// A replica whose broker link resets with calls in flight: the broker hands those messages to
/// the other replica at once, which has room to call them (four sellers of one message each)
/// while the first calls are still waiting for the API's answer (2 s). The copies wait for
/// those calls' answers and records and are acked as registered: each message is called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_when_the_broker_link_resets_are_not_made_again_by_the_other_replica() {
    let (report, settled) =
        calls_in_flight_when_the_link_resets("partition-in-flight", false).await;
    assert_eq!(
        (report.duplicates, report.registered, report.lost),
        (0, SELLERS_IN_FLIGHT, 0),
        "each message called once, all registered (repeated: {:?})",
        report.repeats
    );
    assert!(
        settled,
        "the copies are acked once the first calls are recorded"
    );
}

/// A producer's duplicate (the same message published again) arriving while the first copy's
/// call is in flight on another replica: once the first replica's broker link resets with its
/// calls in flight, every copy, the broker's redeliveries and the duplicates published then,
/// goes to the other replica, which has room in the limit to call them. Each finds the first
/// call's claim, gives its grant back and asks again until that call is recorded, then is
/// acked as registered: each message is called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_duplicate_is_not_called_while_the_first_copy_is_called_on_another_replica() {
    let (report, settled) = calls_in_flight_when_the_link_resets("partition-duplicate", true).await;
    // (The rig counts the duplicates as messages published, so its `lost` counts them too.)
    assert_eq!(
        (report.duplicates, report.registered, report.dead_lettered),
        (0, SELLERS_IN_FLIGHT, 0),
        "each message called once, all registered (repeated: {:?})",
        report.repeats
    );
    assert!(
        settled,
        "every copy is acked once the first calls are recorded"
    );
}
