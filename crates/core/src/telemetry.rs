//! Tracing: human-readable lines by default, JSON lines with `TURNSTILE_LOG_FORMAT=json`;
//! the filter comes from `RUST_LOG` (default [`DEFAULT_FILTER`]); and [`Readiness`], the
//! replica's ready flag that `/readyz` and a gauge report.
//!
//! A JSON line is one object: `timestamp`, `level`, `target`, the event's fields at the top level
//! (`message` is the text) and the current span under `span`, e.g. a message's
//! `{"name": "registration", "seller": "S-1", "message": "<message id>", "attempt": 0,
//! "trace_id": "<32 hex>", "span_id": "<16 hex>"}` (`span_id`: the downstream call's span, once
//! it is made; see `crate::trace`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::Subscriber;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt;

/// Installs the global subscriber (once; later calls do nothing). Logs go to stderr.
pub fn init() {
    let filter = filter_from(std::env::var("RUST_LOG").ok().as_deref());
    let json = std::env::var("TURNSTILE_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let _ = subscriber(filter, json, std::io::stderr).try_init();
}

/// The filter for `RUST_LOG`: [`DEFAULT_FILTER`] without it (or when it does not parse);
/// otherwise `RUST_LOG`, plus `lapin::channel=off` unless it says something of lapin itself
/// (`RUST_LOG=warn` alone would log each channel turnstile closes on purpose as an ERROR).
pub fn filter_from(rust_log: Option<&str>) -> EnvFilter {
    let Some(directives) = rust_log.map(str::trim).filter(|d| !d.is_empty()) else {
        return EnvFilter::new(DEFAULT_FILTER);
    };
    let directives = if directives.contains("lapin") {
        directives.to_owned()
    } else {
        format!("{directives},lapin::channel=off")
    };
    EnvFilter::try_new(directives).unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER))
}

/// The subscriber `init` installs, writing to `writer` (tests capture lines with it).
/// What `/readyz` reports and the `turnstile_ready` gauge shows: connected to the broker and
/// Redis, and consuming. Set by the replica, read by the operator side.
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
        metrics::gauge!("turnstile_ready").set(if ready { 1.0 } else { 0.0 });
    }
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The filter without `RUST_LOG`: `info`, but not lapin's own line for every channel the broker
/// closes. turnstile closes channels on purpose (a passive check for an old queue, a
/// declaration the broker refuses and that is retried with other arguments) and logs every
/// refusal it does not expect itself, with its context; lapin would log each one as an ERROR.
pub const DEFAULT_FILTER: &str = "info,lapin::channel=off";

pub fn subscriber<W>(filter: EnvFilter, json: bool, writer: W) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    if json {
        Box::new(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false)
                .finish(),
        )
    } else {
        Box::new(builder.finish())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer into a shared buffer.
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

    #[test]
    fn rust_log_keeps_lapins_channel_lines_off_unless_it_names_lapin() {
        assert_eq!(
            filter_from(None).to_string(),
            EnvFilter::new(DEFAULT_FILTER).to_string()
        );
        assert_eq!(
            filter_from(Some("  ")).to_string(),
            EnvFilter::new(DEFAULT_FILTER).to_string()
        );
        let warn = filter_from(Some("warn")).to_string();
        assert!(
            warn.contains("lapin::channel=off") && warn.contains("warn"),
            "{warn}"
        );
        let lapin = filter_from(Some("info,lapin=debug")).to_string();
        assert!(!lapin.contains("channel=off"), "{lapin}");
        let bad = filter_from(Some("[[[")).to_string();
        assert_eq!(bad, EnvFilter::new(DEFAULT_FILTER).to_string());
    }

    #[test]
    fn a_json_line_carries_the_span_of_the_message() {
        let lines = Lines::default();
        let subscriber = subscriber(EnvFilter::new("info"), true, lines.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "registration",
                seller = "S-1",
                message = "m-7",
                attempt = 2u32
            );
            let _entered = span.enter();
            tracing::warn!(status = 503, "downstream failed; retrying later");
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON line");
        assert_eq!(line["message"], "downstream failed; retrying later");
        assert_eq!(line["status"], 503);
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["span"]["name"], "registration");
        assert_eq!(line["span"]["seller"], "S-1");
        assert_eq!(line["span"]["message"], "m-7");
        assert_eq!(line["span"]["attempt"], 2);
    }

    #[test]
    fn a_json_line_carries_the_trace_of_the_message_and_the_span_of_its_call_once_made() {
        let lines = Lines::default();
        let subscriber = subscriber(EnvFilter::new("info"), true, lines.clone());
        let trace = crate::trace::TraceContext::start();
        let call = trace.child();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "registration",
                seller = "S-1",
                trace_id = %trace.trace_id(),
                span_id = tracing::field::Empty
            );
            let _entered = span.enter();
            tracing::info!("before the call");
            span.record("span_id", tracing::field::display(call.span_id()));
            tracing::info!("after the call");
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        assert_eq!(lines.len(), 2);
        let trace_id = trace.trace_id().to_string();
        assert_eq!(lines[0]["span"]["trace_id"], trace_id.as_str());
        assert!(lines[0]["span"].get("span_id").is_none(), "{}", lines[0]);
        assert_eq!(lines[1]["span"]["trace_id"], trace_id.as_str());
        assert_eq!(
            lines[1]["span"]["span_id"],
            call.span_id().to_string().as_str()
        );
    }
}
