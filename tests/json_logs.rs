//! A message's JSON log lines carry its seller, message id, attempt and trace. In a test binary of
//! its own: the test captures lines with a thread-local subscriber, and tracing's per-callsite
//! interest, shared by the whole process, can hide a thread-local subscriber's debug lines while
//! other tests' threads log at the same call sites.
mod support;

use std::collections::BTreeSet;

use serde_json::Value;
use serde_json::json;
use turnstile_core::broker::long_string;
use turnstile_core::trace::{TRACEPARENT, TraceContext};

#[tokio::test]
async fn a_json_log_line_of_a_message_carries_its_seller_message_id_attempt_and_trace()
-> anyhow::Result<()> {
    // This runtime runs every task on this thread, so a thread-local subscriber sees them all.
    let lines = support::Lines::default();
    let _logging = tracing::subscriber::set_default(turnstile_core::telemetry::subscriber(
        tracing_subscriber::EnvFilter::new("turnstile=debug"),
        turnstile_core::telemetry::Format::Json,
        lines.clone(),
    ));
    let mut rig = support::rig("logs", "100/1s").prepare().await?;
    rig.start_replicas(1, 1).await?;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let body = json!({
        "message_id": "m-log",
        "seller_id": "S-log",
        "batch_id": "b-log",
        "product": {"mock": {"statuses": [503, 200]}},
    });
    let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
    rig.publish_with_headers(
        body.to_string().as_bytes(),
        &[(TRACEPARENT, long_string(&traceparent))],
    )
    .await?;
    rig.wait_settled_registered(1).await?;
    rig.stop_replicas().await?;
    // The span of each call, as the downstream received it.
    let called: BTreeSet<String> = rig
        .mock
        .recent_requests()
        .iter()
        .filter(|r| r.header("idempotency-key") == Some("m-log"))
        .map(|r| {
            let call = TraceContext::parse(r.header(TRACEPARENT).unwrap().as_bytes(), None);
            let call = call.expect("a valid traceparent");
            assert_eq!(call.trace_id().to_string(), trace, "the message's trace");
            call.span_id().to_string()
        })
        .collect();
    assert_eq!(called.len(), 2, "a 503, then a 2xx");
    let text = lines.text();
    let of_message: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("every line is JSON"))
        .filter(|l| l["message_id"] == "m-log")
        .collect();
    let retried = of_message
        .iter()
        .find(|l| l["message"] == "downstream failed; retrying later")
        .unwrap_or_else(|| panic!("the retry is logged in the message's span:\n{text}"));
    // Flat, as log pipelines index them: the span's fields beside the event's own.
    assert_eq!(retried["seller_id"], "S-log");
    assert_eq!(retried["batch_id"], "b-log");
    assert_eq!(retried["attempt"], 0, "the first delivery");
    assert_eq!(retried["failed_attempts"], 1, "{retried}");
    assert!(retried.get("span").is_none(), "{retried}");
    assert!(
        of_message.iter().any(|l| l["attempt"] == 1),
        "the redelivery's lines carry attempt 1:\n{text}"
    );
    // Every line carries the message's trace, and the lines name each call's span.
    for line in &of_message {
        assert_eq!(line["trace_id"], trace, "{line}");
        assert_eq!(line["seller_id"], "S-log", "{line}");
    }
    let logged: BTreeSet<String> = of_message
        .iter()
        .filter_map(|l| l["span_id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(logged, called, "the logs name each call's span:\n{text}");
    rig.cleanup().await
}
