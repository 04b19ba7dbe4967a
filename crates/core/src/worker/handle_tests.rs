//! [`Worker::handle`] alone: what it asks of the limiter, the API and the results for one
//! registration, and the [`Outcome`] it decides, against the in-memory fakes of [`super::fakes`]
//! in tokio's paused time (every wait is exact: the clock moves only when all is idle, to the
//! next timer).

use std::time::Duration;

use tokio::time::Instant;

use super::fakes::{
    Answer, Event, FakeApi, FakeLimiter, Finish, Harness, Script, registration, unreachable_redis,
};
use super::{Carried, Outcome, Report};
use crate::domain::RateLimitHeaders;
use crate::permit::{CALL_ALLOWANCE, CallClaim, PermitError};

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);

fn asked(e: &Event) -> bool {
    matches!(e, Event::Asked { .. })
}

fn called(e: &Event) -> bool {
    matches!(e, Event::Called { .. })
}

fn answered(e: &Event) -> bool {
    matches!(e, Event::Answered { .. })
}

fn finished(e: &Event) -> bool {
    matches!(e, Event::Finished { .. })
}

fn asked_with(held: Option<crate::permit::Reservation>) -> Event {
    Event::Asked {
        message: "m-1".into(),
        held,
    }
}

fn call(n: u32) -> String {
    format!("call-{n}")
}

/// What a quota's rate-limit headers said: 100 per minute, 41 left, reset in 20 s.
fn quota() -> RateLimitHeaders {
    RateLimitHeaders {
        limit: Some(100),
        window: Some(60 * SECOND),
        remaining: Some(41),
        reset: Some(20 * SECOND),
    }
}

fn registered(attempts: u32) -> Outcome {
    Outcome::Registered(Report {
        response: Some(Answer::created_response()),
        attempts,
        superseded_by: None,
    })
}

#[tokio::test(start_paused = true)]
async fn a_granted_registration_is_called_once_and_recorded_with_its_result_before_it_is_published()
{
    let h = Harness::new(
        [Script::Grant],
        [Answer::Created {
            told: Some(quota()),
        }],
    );
    let start = Instant::now();

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;
    tokio::task::yield_now().await;

    assert_eq!(outcome, registered(1));
    let registered = Finish::Registered {
        told: Some(quota()),
        batch: None,
        ttl: super::fakes::settings().done_ttl,
    };
    assert_eq!(
        h.journal.events(),
        [
            asked_with(None),
            Event::Called {
                message: "m-1".into()
            },
            Event::Answered { call: call(1) },
            Event::Finished {
                call: call(1),
                ended: registered
            },
            Event::Published {
                outcome: "registered".into()
            },
            Event::Progress("result_published"),
        ],
        "the record (keeping the result) is written before anything waits on the broker, and \
         trimmed once the result is out"
    );
    // The limiter's calls per message: one before the call, two after it.
    assert_eq!(h.journal.count(asked), 1);
    assert_eq!(h.journal.count(answered), 1);
    assert_eq!(h.journal.count(finished), 1);
    assert_eq!(h.journal.count(called), 1);
    // Nothing waited but the call itself.
    assert_eq!(start.elapsed(), h.api.latency());
    let result = &h.results.bodies()[0];
    assert_eq!(result["outcome"], "registered");
    assert_eq!(result["status"], 201);
    assert_eq!(result["response"]["product_id"], 7);
    assert_eq!(result["attempts"], 1);
    let stats = &h.worker.stats;
    assert_eq!(
        stats.in_flight.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn a_call_whose_answer_reports_its_cost_has_its_units_corrected_before_it_is_recorded() {
    let h = Harness::new([Script::Grant], [Answer::CreatedCosting { actual: 3 }]);

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(outcome, registered(1));
    let events = h.journal.events();
    let recosted = Event::Recosted {
        call: call(1),
        actual: 3,
    };
    let at = |wanted: &Event| events.iter().position(|e| e == wanted);
    let recost = at(&recosted).expect("the reported cost reaches the limiter");
    assert!(recost > at(&Event::Answered { call: call(1) }).unwrap());
    assert!(recost < events.iter().position(finished).unwrap());
}

#[tokio::test(start_paused = true)]
async fn a_message_told_to_wait_300_ms_with_a_reservation_is_held_and_called_no_earlier_than_its_slot()
 {
    let h = Harness::new(
        [Script::Wait(300 * MS), Script::Grant],
        [Answer::Created { told: None }],
    );
    let start = Instant::now();

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(outcome, registered(1));
    let entries = h.journal.entries();
    let asks: Vec<_> = entries
        .iter()
        .filter_map(|(at, e)| match e {
            Event::Asked { held, .. } => Some((*at, held.clone())),
            _ => None,
        })
        .collect();
    let [(first, None), (second, Some(held))] = &asks[..] else {
        panic!("asks once, then again with its reservation: {asks:?}");
    };
    assert_eq!(*first, start);
    let slot = h.limiter.at(held.slot_us);
    assert_eq!(slot, start + 300 * MS, "the slot reserved 300 ms ahead");
    assert_eq!(*second, slot, "held until its slot, then redeemed at once");
    let calls = h.journal.times(called);
    assert_eq!(calls.len(), 1);
    assert!(calls[0] >= slot, "called before its slot");
    assert_eq!(calls[0], start + 300 * MS);
    assert_eq!(h.journal.count(finished), 1);
    assert_eq!(
        h.worker
            .stats
            .held
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no longer counted as held"
    );
}

#[tokio::test(start_paused = true)]
async fn a_message_back_before_its_reserved_slot_is_held_for_it_without_asking() {
    let h = Harness::new([Script::Grant], [Answer::Created { told: None }]);
    let start = Instant::now();
    let reservation = h.limiter.reservation(500 * MS);
    let carried = Carried {
        reservation: Some(reservation.clone()),
        ..Carried::default()
    };

    let outcome = h.handle(&registration("m-1"), carried).await;

    assert_eq!(outcome, registered(1));
    assert_eq!(h.journal.count(asked), 1, "asks only once the slot is due");
    assert_eq!(h.journal.events()[0], asked_with(Some(reservation)));
    assert_eq!(h.journal.times(asked), [start + 500 * MS]);
    assert_eq!(h.journal.times(called), [start + 500 * MS]);
}

#[tokio::test(start_paused = true)]
async fn a_message_told_to_wait_without_a_reservation_is_delayed_through_the_ladder_for_all_of_it()
{
    let h = Harness::new([Script::WaitUnreserved(5 * SECOND)], []);
    let start = Instant::now();

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(
        outcome,
        Outcome::Delay {
            after: 5 * SECOND,
            carried: Carried::default()
        }
    );
    assert_eq!(start.elapsed(), Duration::ZERO, "not held here");
    assert_eq!(h.journal.events(), [asked_with(None)]);
}

#[tokio::test(start_paused = true)]
async fn a_429_pauses_the_seller_through_the_limiter_and_the_message_is_delayed_to_its_slot_after_the_pause()
 {
    let told = RateLimitHeaders {
        remaining: Some(0),
        ..quota()
    };
    let h = Harness::new(
        [Script::Grant],
        [Answer::TooMany {
            retry_after: Some(30 * SECOND),
            told: Some(told),
        }],
    );
    let start = Instant::now();

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    let paused_at = start + h.api.latency();
    assert_eq!(
        h.journal.events(),
        [
            asked_with(None),
            Event::Called {
                message: "m-1".into()
            },
            Event::Answered { call: call(1) },
            Event::Finished {
                call: call(1),
                ended: Finish::Throttled { told: Some(told) }
            },
            Event::Paused {
                seller: "S-1".into(),
                pause: 30 * SECOND
            },
            asked_with(None),
        ]
    );
    assert_eq!(
        h.journal.times(|e| matches!(e, Event::Paused { .. })),
        [paused_at]
    );
    // The paused seller's next slot is at the pause's end: 30 s away, beyond the 2 s hold, so
    // the message goes through the ladder and comes back one lead (1 s) before it.
    let Outcome::Delay { after, carried } = outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(after, 29 * SECOND);
    let reservation = carried.reservation.as_ref().expect("its reserved slot");
    assert_eq!(h.limiter.at(reservation.slot_us), paused_at + 30 * SECOND);
    assert_eq!(carried.attempt, 0, "a 429 is not an attempt");
    assert!(carried.throttled_since_ms.is_some(), "throttled since now");
    assert_eq!(h.journal.count(called), 1);
    assert_eq!(
        h.worker
            .stats
            .throttled
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_short_429_pause_is_held_and_the_message_called_again_when_it_ends() {
    let h = Harness::new(
        [Script::Grant, Script::Grant],
        [
            Answer::TooMany {
                retry_after: Some(2 * SECOND),
                told: None,
            },
            Answer::Created { told: None },
        ],
    );

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(outcome, registered(1), "the 429 was not an attempt");
    let paused = h.journal.times(|e| matches!(e, Event::Paused { .. }));
    let calls = h.journal.times(called);
    assert_eq!(paused.len(), 1);
    assert_eq!(calls.len(), 2);
    assert_eq!(
        calls[1],
        paused[0] + 2 * SECOND,
        "called again as the pause ends"
    );
    assert_eq!(h.journal.count(asked), 3, "granted, told to wait, redeemed");
    let finishes: Vec<_> = h
        .journal
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Finished { call, ended } => Some((call, ended)),
            _ => None,
        })
        .collect();
    assert!(matches!(
        &finishes[..],
        [
            (first, Finish::Throttled { told: None }),
            (second, Finish::Registered { .. })
        ] if *first == call(1) && *second == call(2)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_429_whose_pause_cannot_be_recorded_delays_the_message_for_the_pause() {
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, [Script::Grant]).failing_pauses(),
            FakeApi::new(
                journal,
                [Answer::TooMany {
                    retry_after: Some(5 * SECOND),
                    told: None,
                }],
            ),
        )
    });

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    let Outcome::Delay { after, carried } = outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(after, 5 * SECOND);
    assert_eq!(carried.reservation, None, "the call spent it");
    assert_eq!(carried.attempt, 0);
    assert!(carried.throttled_since_ms.is_some());
    assert_eq!(h.journal.count(|e| matches!(e, Event::Paused { .. })), 1);
    assert_eq!(h.journal.count(asked), 1, "not asked again");
}

#[tokio::test(start_paused = true)]
async fn a_429_that_lowered_the_learned_limit_asks_again_without_pausing_the_seller() {
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, [Script::Grant, Script::Grant]).lowering(),
            FakeApi::new(
                journal,
                [
                    Answer::TooMany {
                        retry_after: None,
                        told: None,
                    },
                    Answer::Created { told: None },
                ],
            ),
        )
    });

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(outcome, registered(1));
    assert_eq!(h.journal.count(|e| matches!(e, Event::Paused { .. })), 0);
    assert_eq!(h.journal.count(asked), 2);
    assert_eq!(h.journal.count(called), 2);
}

#[tokio::test(start_paused = true)]
async fn a_503_is_finished_as_failed_and_retried_later_with_its_attempt_counted() {
    let h = Harness::new([Script::Grant], [Answer::Unavailable]);

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    let Outcome::Delay { after, carried } = outcome else {
        panic!("{outcome:?}");
    };
    // The first backoff: retry_min (1 s), plus up to as much again.
    assert!((SECOND..=2 * SECOND).contains(&after), "{after:?}");
    assert_eq!(
        carried,
        Carried {
            attempt: 1,
            ..Carried::default()
        }
    );
    assert_eq!(
        h.journal.events(),
        [
            asked_with(None),
            Event::Called {
                message: "m-1".into()
            },
            Event::Answered { call: call(1) },
            Event::Finished {
                call: call(1),
                ended: Finish::Failed
            },
        ],
        "no result for a message that is retried"
    );
    assert_eq!(
        h.worker
            .stats
            .retried
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_503_at_the_last_attempt_dead_letters_the_message_with_the_last_answer_in_its_report() {
    let h = Harness::new([Script::Grant], [Answer::Unavailable]);
    let max = super::fakes::settings().max_attempts;
    let carried = Carried {
        attempt: max - 1,
        ..Carried::default()
    };

    let outcome = h.handle(&registration("m-1"), carried).await;

    assert_eq!(
        outcome,
        Outcome::DeadLetter {
            reason: "attempts-exhausted",
            detail: format!("{max} attempts failed; last: HTTP 503"),
            report: Report {
                response: Some(Answer::unavailable_response()),
                attempts: max,
                superseded_by: None,
            },
        }
    );
    assert_eq!(h.journal.count(called), 1);
    assert_eq!(
        h.journal.count(|e| matches!(
            e,
            Event::Finished {
                ended: Finish::Failed,
                ..
            }
        )),
        1
    );
    // Its result goes out when the dead letter is settled, not here.
    assert!(h.results.bodies().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_400_is_finished_as_failed_and_dead_lettered_as_rejected_at_once() {
    let h = Harness::new([Script::Grant], [Answer::BadRequest]);

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(
        outcome,
        Outcome::DeadLetter {
            reason: "rejected",
            detail: "HTTP 400: missing title".into(),
            report: Report {
                response: Some(Answer::bad_request_response()),
                attempts: 1,
                superseded_by: None,
            },
        }
    );
    assert_eq!(h.journal.count(called), 1);
    assert_eq!(
        h.journal.count(|e| matches!(
            e,
            Event::Finished {
                ended: Finish::Failed,
                ..
            }
        )),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_grant_older_than_the_call_allowance_is_given_back_unsent_and_asked_for_again_without_its_reservation()
 {
    let slow = 2 * SECOND;
    assert!(slow > CALL_ALLOWANCE);
    let h = Harness::new(
        [Script::SlowGrant(slow), Script::Grant],
        [Answer::Created { told: None }],
    );
    let start = Instant::now();
    let reservation = h.limiter.reservation(Duration::ZERO);
    let carried = Carried {
        reservation: Some(reservation.clone()),
        ..Carried::default()
    };

    let outcome = h.handle(&registration("m-1"), carried).await;

    assert_eq!(outcome, registered(1));
    assert_eq!(
        h.journal.entries(),
        [
            (start, asked_with(Some(reservation))),
            (start + slow, Event::Unsent { call: call(1) }),
            (start + slow, asked_with(None)),
            (
                start + slow,
                Event::Called {
                    message: "m-1".into()
                }
            ),
            (
                start + slow + h.api.latency(),
                Event::Answered { call: call(2) }
            ),
            (
                start + slow + h.api.latency(),
                Event::Finished {
                    call: call(2),
                    ended: Finish::Registered {
                        told: None,
                        batch: None,
                        ttl: super::fakes::settings().done_ttl
                    }
                }
            ),
            (
                start + slow + h.api.latency(),
                Event::Published {
                    outcome: "registered".into()
                }
            ),
            (
                start + slow + h.api.latency(),
                Event::Progress("result_published")
            ),
        ],
        "the late grant is never called: the one call is the second grant's"
    );
}

#[tokio::test(start_paused = true)]
async fn a_message_registered_before_is_not_called() {
    let h = Harness::new([Script::AlreadyDone], []);

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(outcome, Outcome::AlreadyDone);
    assert_eq!(h.journal.events(), [asked_with(None)]);
}

#[tokio::test(start_paused = true)]
async fn a_message_whose_call_another_copy_claimed_is_given_back_its_grant_and_asks_again_without_calling()
 {
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, [Script::Grant, Script::AlreadyDone]).called_elsewhere(1),
            FakeApi::new(journal, []),
        )
    });
    let start = Instant::now();

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(
        outcome,
        Outcome::AlreadyDone,
        "acked once the other copy's call is recorded"
    );
    assert_eq!(
        h.journal.events(),
        [
            asked_with(None),
            Event::CalledElsewhere {
                message: "m-1".into()
            },
            Event::Unsent { call: call(1) },
            asked_with(None),
        ],
        "never called, its grant given back"
    );
    let asked = h.journal.times(|e| matches!(e, Event::Asked { .. }));
    assert_eq!(
        asked[1] - start,
        super::CLAIM_RECHECK,
        "asked again a moment later"
    );
}

#[tokio::test(start_paused = true)]
async fn a_claim_that_led_to_no_call_is_ended_when_the_delivery_leaves_and_a_called_one_is_not() {
    let waits = Harness::new(
        [Script::Wait(Duration::from_secs(30))],
        [Answer::Created { told: None }],
    );
    let outcome = waits.handle(&registration("m-1"), Carried::default()).await;
    assert!(matches!(outcome, Outcome::Delay { .. }), "{outcome:?}");
    assert_eq!(
        waits.limiter.unclaimed(),
        1,
        "the delayed message's claim ends"
    );

    let called = Harness::new([Script::Grant], [Answer::Created { told: None }]);
    let outcome = called
        .handle(&registration("m-1"), Carried::default())
        .await;
    assert_eq!(outcome, registered(1));
    assert_eq!(
        called.limiter.unclaimed(),
        0,
        "a called message's claim is left to its call"
    );
}

#[tokio::test(start_paused = true)]
async fn redis_out_of_reach_is_waited_out_and_asked_again_keeping_the_reservation_never_calling_without_a_grant()
 {
    let h = Harness::new(
        [
            Script::Fail(unreachable_redis()),
            Script::Fail(unreachable_redis()),
            Script::Grant,
        ],
        [Answer::Created { told: None }],
    );
    let start = Instant::now();
    let reservation = h.limiter.reservation(Duration::ZERO);
    let carried = Carried {
        reservation: Some(reservation.clone()),
        ..Carried::default()
    };

    let outcome = h.handle(&registration("m-1"), carried).await;

    assert_eq!(outcome, registered(1));
    let events = h.journal.events();
    assert_eq!(
        events[..4],
        [
            asked_with(Some(reservation.clone())),
            asked_with(Some(reservation.clone())),
            asked_with(Some(reservation)),
            Event::Called {
                message: "m-1".into()
            },
        ],
        "called only after the grant"
    );
    // The Redis backoff: 50 ms, then 100 ms, each plus up to as much again.
    let asks = h.journal.times(asked);
    let waits = [asks[1] - asks[0], asks[2] - asks[1]];
    assert_eq!(asks[0], start);
    assert!((50 * MS..=100 * MS).contains(&waits[0]), "{waits:?}");
    assert!((100 * MS..=200 * MS).contains(&waits[1]), "{waits:?}");
    assert_eq!(h.journal.times(called), [asks[2]]);
}

#[tokio::test(start_paused = true)]
async fn a_limiter_that_refuses_three_times_dead_letters_the_message_uncalled() {
    let refusal = || Script::Fail(PermitError::Answer("redeem"));
    let h = Harness::new([refusal(), refusal(), refusal()], []);
    let reservation = h.limiter.reservation(Duration::ZERO);
    let carried = Carried {
        reservation: Some(reservation.clone()),
        ..Carried::default()
    };

    let outcome = h.handle(&registration("m-1"), carried).await;

    assert_eq!(
        outcome,
        Outcome::dead(
            "invalid-message",
            "the limiter refused it 3 times: unexpected answer from the redeem script",
            0
        )
    );
    assert_eq!(
        h.journal.events(),
        [
            asked_with(Some(reservation)),
            asked_with(None),
            asked_with(None)
        ],
        "a refusal drops the reservation"
    );
}

#[tokio::test(start_paused = true)]
async fn a_seller_the_api_cannot_name_is_dead_lettered_as_invalid_without_asking_the_limiter() {
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, []),
            FakeApi::new(journal, []).refusing("S-1"),
        )
    });

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    let Outcome::DeadLetter {
        reason,
        detail,
        report,
    } = outcome
    else {
        panic!("{outcome:?}");
    };
    assert_eq!(reason, "invalid-message");
    assert!(detail.contains("\"S-1\""), "{detail}");
    assert_eq!(report, Report::after(0));
    assert_eq!(h.journal.events(), [], "neither the limiter nor the API");
}

#[tokio::test(start_paused = true)]
async fn a_quota_reset_beyond_max_pause_reaches_the_limiter_capped_at_max_pause() {
    let told = RateLimitHeaders {
        reset: Some(3_600 * SECOND),
        ..quota()
    };
    let h = Harness::new([Script::Grant], [Answer::Created { told: Some(told) }]);

    h.handle(&registration("m-1"), Carried::default()).await;

    let max_pause = super::fakes::settings().max_pause;
    let capped = RateLimitHeaders {
        reset: Some(max_pause),
        ..told
    };
    assert!(h.journal.events().contains(&Event::Finished {
        call: call(1),
        ended: Finish::Registered {
            told: Some(capped),
            batch: None,
            ttl: super::fakes::settings().done_ttl
        }
    }));
}

#[tokio::test(start_paused = true)]
async fn a_registration_whose_record_fails_is_recorded_again_after_a_backoff_its_result_published_once()
 {
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, [Script::Grant]).failing_records(2),
            FakeApi::new(journal, [Answer::Created { told: None }]),
        )
    });

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(outcome, registered(1));
    assert_eq!(h.journal.count(called), 1);
    assert_eq!(h.journal.count(answered), 1);
    assert_eq!(h.journal.count(finished), 3, "written at the third try");
    assert_eq!(h.journal.count(|e| matches!(e, Event::Published { .. })), 1);
    let finishes = h.journal.times(finished);
    assert!(finishes[1] - finishes[0] >= 50 * MS);
    assert!(finishes[2] - finishes[1] >= 100 * MS);
}

#[tokio::test(start_paused = true)]
async fn two_copies_of_one_message_granted_at_once_make_one_call_the_second_done_after_it() {
    // The first copy's grant comes late: the second is granted and calls meanwhile.
    let h = Harness::new(
        [
            Script::SlowGrant(100 * MS),
            Script::Grant,
            Script::AlreadyDone,
        ],
        [Answer::Created { told: None }],
    );
    let (first, second) = (registration("m-1"), registration("m-1"));

    let (a, b) = tokio::join!(h.handle(&first, Carried::default()), async {
        tokio::time::sleep(10 * MS).await;
        h.handle(&second, Carried::default()).await
    });

    assert_eq!(h.journal.count(called), 1, "one call for the two copies");
    assert_eq!(
        h.journal.count(|e| matches!(e, Event::Unsent { .. })),
        1,
        "the late grant given back unused"
    );
    assert_eq!(
        a,
        Outcome::AlreadyDone,
        "the first asks again after the call"
    );
    assert_eq!(b, registered(1));
}

#[tokio::test(start_paused = true)]
async fn a_copy_of_a_registered_message_publishes_the_result_its_record_kept() {
    let h = Harness::new([], []);
    let kept = r#"{"message_id":"m-1","outcome":"registered","status":201}"#;
    h.progress.keep_result("m-1", kept);

    let reported = h.report_already_done(&registration("m-1")).await;
    tokio::task::yield_now().await;

    assert!(reported);
    assert_eq!(
        h.results.bodies(),
        [serde_json::from_str::<serde_json::Value>(kept).unwrap()]
    );
    assert!(!h.progress.keeps_result("m-1"), "trimmed once published");
    assert!(h.report_already_done(&registration("m-1")).await);
    assert_eq!(
        h.results.bodies().len(),
        1,
        "published once it is no longer kept"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dead_letter_naming_a_registered_message_is_acked_as_registered_instead() {
    let h = Harness::new([], []);
    let late = |id: &str| {
        let body = format!(
            r#"{{"message_id":"{id}","seller_id":"S-1","deadline":"2020-01-01T00:00:00Z","product":{{}}}}"#
        );
        crate::domain::Registration::parse(body.as_bytes(), None).expect("a registration")
    };
    h.progress.register("m-1");

    for id in ["m-1", "m-2"] {
        let outcome = h.handle(&late(id), Carried::default()).await;
        assert!(
            matches!(
                outcome,
                Outcome::DeadLetter {
                    reason: "expired",
                    ..
                }
            ),
            "{outcome:?}"
        );
        let settled = h.unless_registered(&late(id), outcome).await;
        if id == "m-1" {
            assert_eq!(
                settled,
                Outcome::AlreadyDone,
                "a copy of a registered message"
            );
        } else {
            assert!(
                matches!(
                    settled,
                    Outcome::DeadLetter {
                        reason: "expired",
                        ..
                    }
                ),
                "a message not registered is dead-lettered: {settled:?}"
            );
        }
    }
    let requeue = || Outcome::Requeue { holding: None };
    assert_eq!(
        h.unless_registered(&late("m-1"), requeue()).await,
        requeue()
    );
    assert!(h.results.bodies().is_empty(), "nothing published");
}

#[tokio::test(start_paused = true)]
async fn a_registration_whose_record_waits_for_redis_cut_off_is_published_acked_and_recorded_later()
{
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, [Script::Grant]).failing_records(u32::MAX),
            FakeApi::new(journal, [Answer::Created { told: None }]),
        )
    });
    let links = h.worker.links.clone();
    let watching = tokio::spawn(async move {
        loop {
            tokio::time::sleep(250 * MS).await;
            links.check_redis();
        }
    });

    let outcome = h.handle(&registration("m-1"), Carried::default()).await;

    assert_eq!(outcome, registered(1), "acked");
    assert_eq!(h.results.bodies().len(), 1, "its result out before the ack");
    assert!(h.worker.links.redis_cut());
    let failed = h.journal.count(finished);
    h.limiter.records_succeed();
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(
        h.journal.count(finished),
        failed,
        "not tried again while Redis is cut off"
    );
    h.worker.links.redis_answered();
    tokio::time::sleep(SECOND).await;
    assert_eq!(
        h.journal.count(finished),
        failed + 1,
        "its record written in the background once Redis answers"
    );
    assert_eq!(
        h.journal
            .count(|e| matches!(e, Event::Progress("result_published"))),
        1,
        "and kept without its result, already published"
    );
    assert_eq!(h.journal.count(called), 1);
    watching.abort();
}

#[tokio::test(start_paused = true)]
async fn a_held_message_goes_back_with_its_reservation_at_shutdown() {
    let h = Harness::new([Script::Wait(SECOND)], []);
    let start = Instant::now();

    let message = registration("m-1");
    let (outcome, ()) = tokio::join!(h.handle(&message, Carried::default()), async {
        tokio::time::sleep(400 * MS).await;
        h.shutdown.cancel();
    });

    let Outcome::Delay { after, carried } = outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(
        after,
        Duration::ZERO,
        "back through the return queue at once"
    );
    let reservation = carried.reservation.expect("keeps its reservation");
    assert_eq!(h.limiter.at(reservation.slot_us), start + SECOND);
    assert_eq!(start.elapsed(), 400 * MS, "left the hold at shutdown");
    assert_eq!(h.journal.count(called), 0);
}

#[tokio::test(start_paused = true)]
async fn a_held_message_whose_connection_is_lost_is_requeued_holding_its_reservation() {
    let h = Harness::new([Script::Wait(SECOND)], []);

    let message = registration("m-1");
    let (outcome, ()) = tokio::join!(h.handle(&message, Carried::default()), async {
        tokio::time::sleep(400 * MS).await;
        h.connection_lost.cancel();
    });

    let Outcome::Requeue {
        holding: Some(reservation),
    } = outcome
    else {
        panic!("{outcome:?}");
    };
    assert_eq!(
        reservation.token, "r-1",
        "the reservation it was told to wait with"
    );
    assert_eq!(h.journal.count(called), 0);
}

#[tokio::test(start_paused = true)]
async fn a_grant_that_finds_every_worker_busy_waits_for_one_only_while_it_is_young_then_is_given_back()
 {
    // Asked while a worker was free (so without one); every worker is taken while the grant
    // comes, half a second late, and given back only at 1.8 s.
    let h = Harness::new(
        [Script::SlowGrant(500 * MS), Script::Grant],
        [Answer::Created { told: None }],
    );
    let start = Instant::now();
    let workers = h.worker.workers.clone();
    let busy = async {
        tokio::time::sleep(100 * MS).await;
        let all = workers.available_permits() as u32;
        let taken = workers.acquire_many(all).await.expect("open");
        tokio::time::sleep(1_700 * MS).await;
        drop(taken);
    };
    let message = registration("m-1");

    let (outcome, ()) = tokio::join!(h.handle(&message, Carried::default()), busy);

    assert_eq!(outcome, registered(1));
    let events = h.journal.events();
    assert_eq!(
        events[..4],
        [
            asked_with(None),
            Event::Unsent { call: call(1) },
            asked_with(None),
            Event::Called {
                message: "m-1".into()
            },
        ],
        "given back unsent, asked again ahead of a free worker, then called"
    );
    // Given back when the grant is CALL_ALLOWANCE old. Its age is read on the standard clock,
    // which the paused one does not stop: the real time the test took may end the wait that
    // much (under a millisecond) early.
    let unsent = h.journal.times(|e| matches!(e, Event::Unsent { .. }))[0];
    let allowance = start + CALL_ALLOWANCE;
    assert!(
        allowance - 20 * MS <= unsent && unsent <= allowance,
        "{:?}",
        unsent - start
    );
    // Asked again at once, ahead of a free worker (calls are fast), and called once one is.
    assert_eq!(h.journal.times(asked)[1], unsent);
    assert_eq!(h.journal.times(called), [start + 1_800 * MS]);
    assert_eq!(h.journal.count(called), 1);
}

#[tokio::test(start_paused = true)]
async fn with_every_worker_busy_a_new_message_asks_ahead_and_is_called_the_moment_one_is_free() {
    let h = Harness::new([Script::Grant], [Answer::Created { told: None }]);

    let start = asked_while_every_worker_was_busy_for(&h, 300 * MS).await;

    assert_eq!(h.journal.times(asked), [start], "asked at once");
    assert_eq!(h.journal.times(called), [start + 300 * MS]);
}

#[tokio::test(start_paused = true)]
async fn with_every_worker_busy_and_a_slow_downstream_a_new_message_waits_for_a_worker_to_ask() {
    let h = Harness::new([Script::Grant], [Answer::Created { told: None }]);
    for _ in 0..20 {
        h.worker.ask_ahead.called(3 * SECOND);
    }
    let start = asked_while_every_worker_was_busy_for(&h, 300 * MS).await;

    assert_eq!(
        h.journal.times(asked),
        [start + 300 * MS],
        "asked with a worker"
    );
    assert_eq!(h.journal.times(called), [start + 300 * MS]);
}

#[tokio::test(start_paused = true)]
async fn where_slots_wait_for_answers_a_message_asks_for_its_slot_one_typical_call_late() {
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, [Script::Wait(300 * MS), Script::Grant])
                .waiting_for_answers(),
            FakeApi::new(journal, [Answer::Created { told: None }]),
        )
    });
    for _ in 0..40 {
        h.worker.ask_ahead.called(20 * MS);
    }
    let typical = h.worker.ask_ahead.typical_call();
    let start = Instant::now();
    let message = registration("m-1");

    let outcome = h.handle(&message, Carried::default()).await;

    assert_eq!(outcome, registered(1));
    let asks = h.journal.times(asked);
    assert!(typical > 15 * MS, "{typical:?}");
    assert_eq!(asks.len(), 2);
    assert_eq!(asks[0], start);
    // Tokio's timer counts whole milliseconds, rounding up.
    let expected = start + 300 * MS + typical + 2 * MS;
    assert!(
        expected <= asks[1] && asks[1] <= expected + MS,
        "the slot, one typical call and the margin later: {:?}",
        asks[1] - start
    );
}

#[tokio::test(start_paused = true)]
async fn under_a_limit_that_counts_calls_at_their_grant_a_new_message_waits_for_a_worker_to_ask() {
    let h = Harness::with(|journal| {
        (
            FakeLimiter::new(journal, [Script::Grant]).counting_at_grants(),
            FakeApi::new(journal, [Answer::Created { told: None }]),
        )
    });
    let start = asked_while_every_worker_was_busy_for(&h, 300 * MS).await;

    assert_eq!(
        h.journal.times(asked),
        [start + 300 * MS],
        "asked with a worker"
    );
}

/// Takes every worker of `h` now and frees them all once `d` has passed (await the result).
async fn every_worker_busy_for(h: &Harness, d: Duration) -> impl std::future::Future<Output = ()> {
    let workers = h.worker.workers.clone();
    let all = workers.available_permits() as u32;
    let taken = workers.acquire_many_owned(all).await.expect("open");
    async move {
        tokio::time::sleep(d).await;
        drop(taken);
    }
}

/// Handles one message, registered, while every worker of `h` is busy for `d` from the start;
/// returns the start.
async fn asked_while_every_worker_was_busy_for(h: &Harness, d: Duration) -> Instant {
    let start = Instant::now();
    let busy = every_worker_busy_for(h, d).await;
    let message = registration("m-1");
    let (outcome, ()) = tokio::join!(h.handle(&message, Carried::default()), busy);
    assert_eq!(outcome, registered(1));
    start
}

#[tokio::test(start_paused = true)]
async fn a_claim_is_renewed_while_fresh_and_never_relied_on_once_it_is_not() {
    let claim = super::DeliveryClaim::new();
    assert!(!claim.answered(&Ok(CallClaim::Taken), Instant::now()));
    assert_eq!(claim.stale_for(), None, "fresh once taken");

    tokio::time::advance(super::CLAIM_FRESH / 2).await;
    assert!(
        claim.answered(&Ok(CallClaim::Held), Instant::now()),
        "asked again while fresh: renewed"
    );
    tokio::time::advance(super::CLAIM_FRESH / 2 + Duration::from_millis(1)).await;
    assert_eq!(claim.stale_for(), None, "fresh from its renewal");

    tokio::time::advance(super::CLAIM_FRESH).await;
    assert!(
        !claim.answered(&Ok(CallClaim::Held), Instant::now()),
        "no longer fresh: not renewed (it may end before a renewal lands)"
    );
    let left = claim.stale_for().expect("stale");
    assert!(left < crate::permit::CLAIM_ASKING, "let end: {left:?}");
    assert!(
        !claim.fresh(),
        "and not ended by the delivery: it may be another copy's by then"
    );

    claim.called();
    assert_eq!(
        claim.stale_for(),
        Some(Duration::ZERO),
        "one of an earlier call is not relied on"
    );
    claim.answered(&Ok(CallClaim::Elsewhere), Instant::now());
    assert!(!claim.fresh());
}

/// Message `id` of seller S-1 for product `SKU-1`.
fn product_row(id: &str) -> crate::domain::Registration {
    let body = format!(
        r#"{{"message_id":"{id}","seller_id":"S-1","product_key":"SKU-1","product":{{"title":"t"}}}}"#
    );
    crate::domain::Registration::parse(body.as_bytes(), None).expect("a registration")
}

#[tokio::test(start_paused = true)]
async fn a_row_a_newer_one_superseded_while_it_waited_finishes_superseded_without_a_call() {
    let h = Harness::new(
        [Script::Wait(10 * SECOND), Script::Grant],
        [Answer::Created { told: None }],
    );
    // The old row reserves a slot and goes through the ladder; the corrected row comes and is
    // registered; then the old row comes back.
    let old = h.handle(&product_row("old"), Carried::default()).await;
    let Outcome::Delay { carried, .. } = old else {
        panic!("the old row waits for its slot: {old:?}");
    };
    assert_eq!(
        h.handle(&product_row("new"), Carried::default()).await,
        registered(1)
    );
    let back = h.handle(&product_row("old"), carried).await;
    let Outcome::DeadLetter { reason, report, .. } = &back else {
        panic!("the old row is superseded: {back:?}");
    };
    assert_eq!(*reason, "superseded");
    assert_eq!(
        report.superseded_by.as_ref().map(|m| m.as_str()),
        Some("new")
    );
    assert_eq!(
        h.journal.count(called),
        1,
        "only the corrected row is called"
    );
    assert_eq!(h.journal.count(asked), 2, "the old row asks nothing more");
}

#[tokio::test(start_paused = true)]
async fn a_row_whose_call_started_is_not_superseded_when_it_comes_back_for_a_retry() {
    let h = Harness::new(
        [Script::Grant, Script::Grant, Script::Grant],
        [
            Answer::Unavailable,
            Answer::Created { told: None },
            Answer::Created { told: None },
        ],
    );
    let first = h.handle(&product_row("first"), Carried::default()).await;
    let Outcome::Delay { carried, .. } = first else {
        panic!("a 503 is retried later: {first:?}");
    };
    assert_eq!(
        h.handle(&product_row("second"), Carried::default()).await,
        registered(1)
    );
    // Its call started before the second row came: it is called again, not superseded.
    assert!(matches!(
        h.handle(&product_row("first"), carried).await,
        Outcome::Registered(_)
    ));
    assert_eq!(h.journal.count(called), 3);
}
