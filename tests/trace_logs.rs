//! A message's log lines carry its trace: `trace_id` from its `traceparent` and, once a call is
//! made, that call's `span_id`, the same one the downstream received. (Its own test binary: it
//! installs the process's log subscriber.)
mod support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use turnstile_core::broker::long_string;
use turnstile_core::telemetry;
use turnstile_core::trace::{TRACEPARENT, TraceContext};

/// Log lines written into a shared buffer.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'w> MakeWriter<'w> for Lines {
    type Writer = Lines;
    fn make_writer(&'w self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_log_lines_carry_its_trace_id_and_each_calls_span_id() -> anyhow::Result<()> {
    let lines = Lines::default();
    let filter = EnvFilter::new("info,turnstile_core::worker=debug");
    tracing::subscriber::set_global_default(telemetry::subscriber(filter, true, lines.clone()))?;

    let mut rig = support::rig("trace-logs", "100/1s").prepare().await?;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let id = "m-logged";
    let body = json!({
        "message_id": id,
        "seller_id": "S-logged",
        "product": {"sku": 1, "mock": {"statuses": [503, 200]}},
    });
    rig.publish_with_headers(
        body.to_string().as_bytes(),
        &[(
            TRACEPARENT,
            long_string(&format!("00-{trace}-00f067aa0ba902b7-01")),
        )],
    )
    .await?;
    rig.start_replicas(1, 2).await?;
    rig.wait_registered(1).await?;
    rig.stop_replicas().await?;

    // What the downstream received: two calls, each its own span of the trace.
    let called: BTreeSet<String> = rig
        .mock
        .recent_requests()
        .iter()
        .filter(|r| r.header("idempotency-key") == Some(id))
        .map(|r| {
            let parent = TraceContext::parse(r.header(TRACEPARENT).unwrap().as_bytes(), None);
            let parent = parent.expect("a valid traceparent");
            assert_eq!(parent.trace_id().to_string(), trace);
            parent.span_id().to_string()
        })
        .collect();
    assert_eq!(called.len(), 2, "a 503, then a 2xx");

    // What was logged about the message, in its span.
    let text = String::from_utf8(lines.0.lock().unwrap().clone())?;
    let logged: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["span"]["message"] == id)
        .collect();
    assert!(!logged.is_empty(), "no line of the message:\n{text}");
    for line in &logged {
        assert_eq!(line["span"]["trace_id"], trace, "{line}");
    }
    let spans: BTreeSet<String> = logged
        .iter()
        .filter_map(|l| l["span"]["span_id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        spans, called,
        "the logs name each call's span:\n{logged:#?}"
    );
    rig.cleanup().await
}
