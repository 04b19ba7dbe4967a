//! W3C trace context across the hop: a message's `traceparent` / `tracestate` continue on the
//! downstream call as a new span of the same trace; anything that does not parse starts a new
//! trace and never costs the registration; `turnstile publish` makes an upload one trace.
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use lapin::options::BasicGetOptions;
use lapin::types::{AMQPValue, ByteArray, FieldArray, FieldTable};
use serde_json::json;
use support::{redis_url, run};
use turnstile_core::broker::long_string;
use turnstile_core::trace::{TRACEPARENT, TRACESTATE, TraceContext};
use turnstile_lab::mock_api::SeenRequest;

/// AMQP headers to publish a message with.
type Headers = Vec<(&'static str, AMQPValue)>;

const PARENT: &str = "00f067aa0ba902b7";
const STATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";

fn body(seller: &str, id: &str, product: serde_json::Value) -> Vec<u8> {
    json!({"message_id": id, "seller_id": seller, "product": product})
        .to_string()
        .into_bytes()
}

/// A trace id of the test's own: `ab`, zeros, and `n` in hex at the end.
fn trace_id(n: u8) -> String {
    format!("{:032x}", u128::from(n) | (0xab_u128 << 120))
}

/// The requests the downstream received for message `id`, in order.
fn requests_of<'a>(seen: &'a [SeenRequest], id: &str) -> Vec<&'a SeenRequest> {
    seen.iter()
        .filter(|r| r.header("idempotency-key") == Some(id))
        .collect()
}

/// The `traceparent` a request carried, parsed; it must be the canonical version 00 form.
fn traceparent_of(request: &SeenRequest) -> TraceContext {
    let value = request
        .header(TRACEPARENT)
        .expect("every call has a traceparent");
    let trace = TraceContext::parse(value.as_bytes(), None).expect("a valid traceparent");
    assert_eq!(trace.traceparent(), value, "canonical version 00");
    trace
}

#[tokio::test]
async fn a_traceparent_continues_on_the_downstream_call_as_a_new_span_of_the_same_trace()
-> anyhow::Result<()> {
    let mut rig = support::rig("trace", "100/1s").prepare().await?;
    let traced = |n: u8, flags: &str| format!("00-{}-{PARENT}-{flags}", trace_id(n));
    let messages: Vec<(&str, Headers, serde_json::Value)> = vec![
        (
            "m-traced",
            vec![
                (TRACEPARENT, long_string(&traced(1, "01"))),
                (TRACESTATE, long_string(STATE)),
            ],
            json!({"sku": 1}),
        ),
        (
            "m-unsampled",
            vec![(TRACEPARENT, long_string(&traced(2, "00")))],
            json!({"sku": 2}),
        ),
        (
            "m-retried",
            vec![
                (TRACEPARENT, long_string(&traced(3, "01"))),
                (TRACESTATE, long_string(STATE)),
            ],
            json!({"sku": 3, "mock": {"statuses": [503, 200]}}),
        ),
        (
            "m-future",
            vec![(
                TRACEPARENT,
                long_string(&format!("cc-{}-{PARENT}-01-more-fields", trace_id(4))),
            )],
            json!({"sku": 4}),
        ),
        (
            "m-bad-state",
            vec![
                (TRACEPARENT, long_string(&traced(5, "01"))),
                (TRACESTATE, long_string("Not A Key=v")),
            ],
            json!({"sku": 5}),
        ),
    ];
    for (id, headers, product) in &messages {
        rig.publish_with_headers(&body("S-trace", id, product.clone()), headers)
            .await?;
    }
    rig.start_replicas(1, 2).await?;
    let stats = rig.wait_registered(messages.len() as u64).await?;
    rig.stop_replicas().await?;
    assert_eq!((stats.registered, stats.duplicates), (5, 0), "{stats:?}");
    let seen = rig.mock.recent_requests();

    let traced_call = requests_of(&seen, "m-traced");
    assert_eq!(traced_call.len(), 1);
    let call = traceparent_of(traced_call[0]);
    assert_eq!(call.trace_id().to_string(), trace_id(1), "the same trace");
    assert_ne!(call.span_id().to_string(), PARENT, "a new span");
    assert_eq!(call.flags(), 0x01, "the same flags");
    assert_eq!(traced_call[0].header(TRACESTATE), Some(STATE), "unchanged");

    let unsampled = traceparent_of(requests_of(&seen, "m-unsampled")[0]);
    assert_eq!(unsampled.trace_id().to_string(), trace_id(2));
    assert_eq!(unsampled.flags(), 0x00, "not sampled stays not sampled");
    assert_eq!(
        requests_of(&seen, "m-unsampled")[0].header(TRACESTATE),
        None
    );

    // A retry comes back through the broker's delay ladder: the same trace, a span per attempt.
    let attempts = requests_of(&seen, "m-retried");
    assert_eq!(attempts.len(), 2, "a 503, then a 2xx");
    let spans: BTreeSet<String> = attempts
        .iter()
        .map(|r| {
            let call = traceparent_of(r);
            assert_eq!(call.trace_id().to_string(), trace_id(3));
            assert_eq!(r.header(TRACESTATE), Some(STATE));
            call.span_id().to_string()
        })
        .collect();
    assert_eq!(spans.len(), 2, "each attempt is a span of its own");
    assert!(!spans.contains(PARENT));

    let future = traceparent_of(requests_of(&seen, "m-future")[0]);
    assert_eq!(
        (future.trace_id().to_string(), future.flags()),
        (trace_id(4), 0x01),
        "a higher version continues as version 00"
    );

    let bad_state = requests_of(&seen, "m-bad-state")[0];
    assert_eq!(
        traceparent_of(bad_state).trace_id().to_string(),
        trace_id(5)
    );
    assert_eq!(
        bad_state.header(TRACESTATE),
        None,
        "an invalid tracestate is dropped, not the traceparent"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn a_garbage_traceparent_still_registers_once_under_a_new_trace() -> anyhow::Result<()> {
    let mut rig = support::rig("trace-garbage", "100/1s").prepare().await?;
    let given = |n: u8| trace_id(n);
    let mut table = FieldTable::default();
    table.insert("traceparent".into(), long_string("nested"));
    let garbage: Vec<Headers> = vec![
        vec![],
        vec![(
            TRACEPARENT,
            AMQPValue::ByteArray(ByteArray::from(vec![0xff, 0x00, 0xfe, b'-', 0x80])),
        )],
        vec![(TRACEPARENT, AMQPValue::LongLongInt(42))],
        vec![(TRACEPARENT, AMQPValue::Boolean(true))],
        vec![(TRACEPARENT, AMQPValue::Void)],
        vec![(TRACEPARENT, AMQPValue::FieldTable(table))],
        vec![(
            TRACEPARENT,
            AMQPValue::FieldArray(FieldArray::from(vec![long_string(&format!(
                "00-{}-{PARENT}-01",
                given(1)
            ))])),
        )],
        vec![(TRACEPARENT, long_string(&"0".repeat(10 * 1024)))],
        vec![(
            TRACEPARENT,
            long_string(&format!("00-{}-{PARENT}-01{}", given(2), "-x".repeat(5000))),
        )],
        vec![(
            TRACEPARENT,
            long_string(&format!("00-{}-{PARENT}-01", given(3).to_uppercase())),
        )],
        vec![(
            TRACEPARENT,
            long_string(&format!("00-{}-{PARENT}-01", "0".repeat(32))),
        )],
        vec![(
            TRACEPARENT,
            long_string(&format!("00-{}-{}-01", given(4), "0".repeat(16))),
        )],
        vec![(
            TRACEPARENT,
            long_string(&format!("ff-{}-{PARENT}-01", given(5))),
        )],
        // Given twice, in two cases: which one counts is not for the producer to guess.
        vec![
            (
                TRACEPARENT,
                long_string(&format!("00-{}-{PARENT}-01", given(6))),
            ),
            (
                "TraceParent",
                long_string(&format!("00-{}-{PARENT}-01", given(7))),
            ),
        ],
    ];
    let mut ids = Vec::new();
    for (i, headers) in garbage.iter().enumerate() {
        let id = format!("m-garbage-{i}");
        // A valid tracestate beside a bad traceparent is not forwarded.
        let mut headers = headers.clone();
        headers.push((TRACESTATE, long_string(STATE)));
        rig.publish_with_headers(&body("S-garbage", &id, json!({"n": i})), &headers)
            .await?;
        ids.push(id);
    }
    rig.start_replicas(1, 2).await?;
    let stats = rig.wait_registered(ids.len() as u64).await?;
    rig.stop_replicas().await?;
    let n = ids.len() as u64;
    assert_eq!(
        (stats.registered, stats.requests, stats.duplicates),
        (n, n, 0),
        "each registered once: {stats:?}"
    );
    assert_eq!(rig.dead_lettered().await?, 0, "never a dead letter");

    let seen = rig.mock.recent_requests();
    let given: BTreeSet<String> = (1..=7).map(given).collect();
    let mut traces = BTreeMap::new();
    for id in &ids {
        let calls = requests_of(&seen, id);
        assert_eq!(calls.len(), 1, "{id}");
        let call = traceparent_of(calls[0]);
        assert_eq!(call.flags(), TraceContext::SAMPLED, "{id}: a new trace");
        assert!(
            !given.contains(&call.trace_id().to_string().to_lowercase()),
            "{id}: not the garbage's trace"
        );
        assert_eq!(calls[0].header(TRACESTATE), None, "{id}");
        traces.insert(call.trace_id().to_string(), id);
    }
    assert_eq!(traces.len(), ids.len(), "a new trace for each message");
    rig.cleanup().await
}

#[tokio::test]
async fn publish_makes_an_upload_one_trace_and_keeps_its_message_ids() -> anyhow::Result<()> {
    let rig = support::rig("trace-publish", "100/1s").prepare().await?;
    let file = std::env::temp_dir().join(format!("{}.csv", support::unique("trace")));
    std::fs::write(
        &file,
        "sku,name\nA1,one\nA2,two\nA3,three\nA4,four\nA5,five\n",
    )?;
    // The same file twice: two uploads, two traces, the same message ids.
    let mut printed = Vec::new();
    for _ in 0..2 {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        cmd.env("TURNSTILE_QUEUE", rig.topology.work())
            .env("TURNSTILE_KEY_PREFIX", &rig.key_prefix)
            .env("TURNSTILE_REDIS_URL", redis_url())
            .env("RUST_LOG", "warn");
        let (code, out, err) = run(cmd.args([
            "publish",
            file.to_str().unwrap(),
            "--seller",
            "S-trace",
            "--batch",
            "b1",
        ]));
        assert_eq!(code, 0, "{out}\n{err}");
        let trace_id = out
            .split_once("as trace-id ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("the trace id is printed: {out}"))
            .to_owned();
        printed.push(trace_id);
    }
    std::fs::remove_file(&file)?;
    assert_ne!(printed[0], printed[1], "each upload is a trace of its own");

    let channel = rig.connection().create_channel().await?;
    let mut by_trace: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    while let Some(got) = channel
        .basic_get(rig.topology.work().into(), BasicGetOptions { no_ack: true })
        .await?
    {
        let delivery = got.delivery;
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let AMQPValue::LongString(value) = &headers.inner()[TRACEPARENT] else {
            panic!("a traceparent string: {headers:?}");
        };
        let traceparent = String::from_utf8(value.as_bytes().to_vec())?;
        let trace = TraceContext::parse(traceparent.as_bytes(), None).expect("valid");
        assert_eq!(trace.traceparent(), traceparent, "canonical");
        assert_eq!(trace.flags(), TraceContext::SAMPLED);
        assert!(!headers.inner().contains_key(TRACESTATE));
        let message_id = delivery.properties.message_id().clone().unwrap();
        by_trace
            .entry(trace.trace_id().to_string())
            .or_default()
            .push((message_id.to_string(), trace.span_id().to_string()));
    }
    let _ = channel.close(200, "".into()).await;
    assert_eq!(
        by_trace.keys().cloned().collect::<BTreeSet<_>>(),
        printed.iter().cloned().collect(),
        "every message of an upload carries the trace id printed for it"
    );
    let ids = |trace: &str| -> BTreeSet<String> {
        by_trace[trace].iter().map(|(id, _)| id.clone()).collect()
    };
    for trace in &printed {
        let messages = &by_trace[trace];
        assert_eq!(messages.len(), 5, "{messages:?}");
        let spans: BTreeSet<&String> = messages.iter().map(|(_, span)| span).collect();
        assert_eq!(spans.len(), 5, "a span per message");
        assert_eq!(ids(trace).len(), 5);
    }
    assert_eq!(
        ids(&printed[0]),
        ids(&printed[1]),
        "the message ids do not depend on the trace (publishing again registers nothing twice)"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn a_message_without_a_valid_traceparent_keeps_the_trace_it_was_given_through_its_retries()
-> anyhow::Result<()> {
    let mut rig = support::rig("trace-retried", "100/1s").prepare().await?;
    let retried = json!({"sku": 1, "mock": {"statuses": [503, 503, 200]}});
    // Each with a valid tracestate, which belongs to no valid traceparent: never forwarded.
    let untraced: Vec<(&str, Headers)> = vec![
        ("m-untraced", vec![(TRACESTATE, long_string(STATE))]),
        // Bad headers in another case than the one turnstile writes must not stay beside it.
        (
            "m-bad-case",
            vec![
                ("TraceParent", long_string("00-nonsense")),
                ("TraceState", long_string(STATE)),
            ],
        ),
    ];
    for (id, headers) in &untraced {
        rig.publish_with_headers(&body("S-retried", id, retried.clone()), headers)
            .await?;
    }
    rig.start_replicas(1, 2).await?;
    let stats = rig.wait_registered(untraced.len() as u64).await?;
    rig.stop_replicas().await?;
    assert_eq!(stats.duplicates, 0, "{stats:?}");

    let seen = rig.mock.recent_requests();
    for (id, _) in &untraced {
        let requests = requests_of(&seen, id);
        for request in &requests {
            assert_eq!(
                request.header(TRACESTATE),
                None,
                "{id}: no foreign tracestate"
            );
        }
        let calls: Vec<TraceContext> = requests.into_iter().map(traceparent_of).collect();
        assert_eq!(calls.len(), 3, "{id}: two 503s, then a 2xx");
        let traces: BTreeSet<String> = calls.iter().map(|c| c.trace_id().to_string()).collect();
        assert_eq!(
            traces.len(),
            1,
            "{id}: one trace for every attempt: {traces:?}"
        );
        let spans: BTreeSet<String> = calls.iter().map(|c| c.span_id().to_string()).collect();
        assert_eq!(spans.len(), 3, "{id}: a span per attempt");
    }

    // A dead letter carries the trace its call was made in (a replay continues it), though
    // the message came without one and was never delayed.
    rig.publish_with_headers(
        &body(
            "S-retried",
            "m-refused",
            json!({"mock": {"statuses": [400]}}),
        ),
        &[(TRACESTATE, long_string(STATE))],
    )
    .await?;
    rig.start_replicas(1, 2).await?;
    let dead = rig.dead_letters(1).await?;
    rig.stop_replicas().await?;
    let seen = rig.mock.recent_requests();
    let calls: BTreeSet<String> = requests_of(&seen, "m-refused")
        .into_iter()
        .map(|r| traceparent_of(r).trace_id().to_string())
        .collect();
    assert_eq!(calls.len(), 1, "its call's trace: {calls:?}");
    let headers = dead[0].properties.headers().clone().unwrap_or_default();
    let carried = TraceContext::from_headers(Some(&headers)).expect("a valid traceparent");
    assert_eq!(
        BTreeSet::from([carried.trace_id().to_string()]),
        calls,
        "the dead letter's trace is its calls'"
    );
    assert_eq!(carried.tracestate(), None, "no foreign tracestate");
    rig.cleanup().await
}
