//! Tracing: human-readable lines by default, JSON lines with `TURNSTILE_LOG_FORMAT=json`;
//! the filter comes from `RUST_LOG` (default [`DEFAULT_FILTER`]); and [`Readiness`], the
//! replica's ready flag that `/readyz` and a gauge report.
//!
//! Text lines are coloured (ANSI escapes) only when stderr is a terminal and `NO_COLOR` is
//! unset or empty ([`Format::choose`]): a file, a pipe or a container's log driver gets plain
//! text.
//!
//! A JSON line is one flat object ([`FlatJson`]): `timestamp`, `level`, `message` (the event's
//! text), `target`, then the fields of every span the event is in (outermost first), then the
//! event's own fields, all at the top level, as log pipelines index them. A message's lines
//! carry its span's `seller_id`, `message_id`, `batch_id` (when it has one), `attempt` (the
//! failed attempts it was delivered with), `trace_id` and, once its downstream call is made,
//! that call's `span_id` (see `crate::trace`), e.g.
//! `{"timestamp":"…","level":"WARN","message":"downstream failed; retrying later","target":
//! "turnstile_core::worker","attempt":0,"batch_id":"b-1","message_id":"m-7","seller_id":"S-1",
//! "span_id":"<16 hex>","trace_id":"<32 hex>","failed_attempts":1,"why":"HTTP 503"}` (a span's
//! fields in the order of their names). A field named like an outer one replaces it (the
//! event's own fields come last); `timestamp`, `level`, `message` and `target` are always the
//! line's own.

pub mod repeats;

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::Value;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormattedFields, MakeWriter};
use tracing_subscriber::layer::{Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// Installs the global subscriber (once; later calls do nothing). Logs go to stderr, in the
/// format [`Format::from_env`] picks.
/// Warnings that repeat are folded ([`repeats`]: once per call site and interval, with a count);
/// [`repeats::report`] writes the counts. Notes the process's start
/// ([`crate::domain::process_started_ms`]).
pub fn init() {
    crate::domain::process_started_ms();
    let filter = filter_from(std::env::var("RUST_LOG").ok().as_deref());
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(repeats::FoldRepeats::new(repeats::Repeats::shared()))
        .with(layer(Format::from_env(), std::io::stderr))
        .try_init();
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Human-readable lines, coloured with ANSI escapes when `ansi`.
    Text { ansi: bool },
    /// One flat JSON object per line ([`FlatJson`]).
    Json,
}

impl Format {
    /// The format for this process, from `TURNSTILE_LOG_FORMAT`, `NO_COLOR` and whether stderr
    /// is a terminal (see [`Format::choose`]).
    pub fn from_env() -> Self {
        Self::choose(
            std::env::var("TURNSTILE_LOG_FORMAT").ok().as_deref(),
            std::env::var_os("NO_COLOR").as_deref(),
            std::io::stderr().is_terminal(),
        )
    }

    /// JSON when `log_format` is `json` (any case); otherwise text, coloured only when the
    /// lines go to a `terminal` and `no_color` (`NO_COLOR`, <https://no-color.org>) is unset or
    /// empty.
    pub fn choose(
        log_format: Option<&str>,
        no_color: Option<&std::ffi::OsStr>,
        terminal: bool,
    ) -> Self {
        if log_format.is_some_and(|f| f.trim().eq_ignore_ascii_case("json")) {
            return Format::Json;
        }
        let no_color = no_color.is_some_and(|v| !v.is_empty());
        Format::Text {
            ansi: terminal && !no_color,
        }
    }
}

/// The filter for `RUST_LOG`: [`DEFAULT_FILTER`] without it (or when it does not parse);
/// otherwise `RUST_LOG`, plus `lapin=off` unless it says something of lapin itself
/// (`RUST_LOG=warn` alone would let lapin's own ERROR lines through, see [`DEFAULT_FILTER`]).
pub fn filter_from(rust_log: Option<&str>) -> EnvFilter {
    let Some(directives) = rust_log.map(str::trim).filter(|d| !d.is_empty()) else {
        return EnvFilter::new(DEFAULT_FILTER);
    };
    let directives = if directives.contains("lapin") {
        directives.to_owned()
    } else {
        format!("{directives},{LAPIN_OFF}")
    };
    EnvFilter::try_new(directives).unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER))
}

/// The filter without `RUST_LOG`: `info`, without lapin's own lines.
///
/// lapin logs a lost connection as several ERROR lines, in Debug format, from its I/O thread,
/// from each consumer and from each channel (every channel the broker closes, including those
/// turnstile closes on purpose: a passive check for an old queue, a declaration the broker
/// refuses and that is retried with other arguments). turnstile meets each of those errors in
/// the operation that failed and logs it there, with its context: the broker connection as
/// one line per change of state (lost, connected again), other refusals where they are not
/// expected. `RUST_LOG=info,lapin=warn` brings lapin's lines back.
pub const DEFAULT_FILTER: &str = "info,lapin=off";

/// The directive that silences lapin's own lines (see [`DEFAULT_FILTER`]).
const LAPIN_OFF: &str = "lapin=off";

/// The subscriber `init` installs, writing lines in `format` to `writer` (tests capture lines
/// with it).
pub fn subscriber<W>(
    filter: EnvFilter,
    format: Format,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    Box::new(
        tracing_subscriber::registry()
            .with(filter)
            .with(layer(format, writer)),
    )
}

/// The layer that writes lines in `format` to `writer`, without a filter (for a subscriber of
/// one's own, as [`subscriber`] builds).
pub fn layer<S, W>(format: Format, writer: W) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let lines = tracing_subscriber::fmt::layer().with_writer(writer);
    match format {
        Format::Text { ansi } => lines.with_ansi(ansi).boxed(),
        Format::Json => lines
            .with_ansi(false)
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .boxed(),
    }
}

/// The error and its causes as `{:#}` prints an `anyhow::Error` (`outer: cause: …`), without
/// a cause whose text the error before it already shows (lapin's `IO error: Connection refused
/// (os error 111)` has, as its cause, the `io::Error` it prints).
pub fn error_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    let mut last = String::new();
    for cause in error.chain() {
        let said = cause.to_string();
        if last.contains(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
        last = said;
    }
    text
}

/// What `/readyz` reports and the `turnstile_ready` gauge shows: connected to the broker and
/// Redis, and consuming; when not, why and since when (the fleet entry, `/readyz` and the
/// console say it). Set by the replica, read by the operator side.
#[derive(Clone, Default)]
pub struct Readiness(Arc<ReadyState>);

#[derive(Default)]
struct ReadyState {
    ready: AtomicBool,
    /// Why not ready, and since when (Unix ms); `None` while ready or before a reason was given.
    why: std::sync::Mutex<Option<NotReady>>,
}

/// Why a replica is not ready, and since when.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NotReady {
    /// What is wrong, in a few words (e.g. "the broker did not answer within 5s").
    pub why: String,
    /// Since when (Unix ms).
    pub since_ms: u64,
}

impl Readiness {
    /// Says whether the replica is ready (and sets the gauge); not ready without a reason
    /// keeps the reason given last, if any.
    pub fn set(&self, ready: bool) {
        self.0.ready.store(ready, Ordering::Relaxed);
        if ready {
            *self.lock() = None;
        }
        metrics::gauge!("turnstile_ready").set(if ready { 1.0 } else { 0.0 });
    }
    /// Says the replica is not ready, and why: the first reason of an outage is kept with its
    /// time, a later one replaces only its text.
    pub fn not_ready(&self, why: impl Into<String>) {
        self.0.ready.store(false, Ordering::Relaxed);
        let why = why.into();
        let mut held = self.lock();
        let since_ms = held
            .as_ref()
            .map_or_else(crate::domain::unix_ms, |n| n.since_ms);
        *held = Some(NotReady { why, since_ms });
        drop(held);
        metrics::gauge!("turnstile_ready").set(0.0);
    }
    /// Whether the replica is ready.
    pub fn get(&self) -> bool {
        self.0.ready.load(Ordering::Relaxed)
    }
    /// Why it is not ready and since when, when a reason was given (`None` while ready).
    pub fn why(&self) -> Option<NotReady> {
        if self.get() {
            return None;
        }
        self.lock().clone()
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<NotReady>> {
        self.0.why.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The JSON line format: one flat object per event (see the module's documentation). It reads
/// the spans' fields as `tracing_subscriber`'s [`JsonFields`] stores them.
#[derive(Clone, Copy, Debug, Default)]
pub struct FlatJson;

/// The keys of every line, which no span or event field replaces.
const LINE_KEYS: [&str; 4] = ["timestamp", "level", "message", "target"];

impl<S> FormatEvent<S, JsonFields> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let mut own = EventFields::default();
        event.record(&mut own);
        let metadata = event.metadata();
        let mut line = Fields(vec![
            ("timestamp".into(), timestamp.into()),
            ("level".into(), metadata.level().as_str().into()),
            (
                "message".into(),
                own.message.take().unwrap_or_default().into(),
            ),
            ("target".into(), metadata.target().into()),
        ]);
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let extensions = span.extensions();
                let Some(stored) = extensions.get::<FormattedFields<JsonFields>>() else {
                    continue;
                };
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(stored) {
                    for (key, value) in fields {
                        line.set(key, value);
                    }
                }
            }
        }
        for (key, value) in own.fields {
            line.set(key, value);
        }
        writeln!(writer, "{}", line.to_json())
    }
}

/// A line's fields in order, each key once.
struct Fields(Vec<(String, Value)>);

impl Fields {
    /// Sets a span's or the event's field `key`, in its place if it is there already, else
    /// last; never one of [`LINE_KEYS`].
    fn set(&mut self, key: String, value: Value) {
        if LINE_KEYS.contains(&key.as_str()) {
            return;
        }
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, old)) => *old = value,
            None => self.0.push((key, value)),
        }
    }

    fn to_json(&self) -> String {
        let fields: Vec<String> = self
            .0
            .iter()
            .map(|(key, value)| format!("{}:{value}", Value::from(key.as_str())))
            .collect();
        format!("{{{}}}", fields.join(","))
    }
}

/// An event's text and its other fields, as JSON values.
#[derive(Default)]
struct EventFields {
    message: Option<String>,
    fields: Vec<(String, Value)>,
}

impl EventFields {
    fn put(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = Some(match value {
                Value::String(text) => text,
                other => other.to_string(),
            });
        } else {
            self.fields.push((field.name().to_owned(), value));
        }
    }
}

impl Visit for EventFields {
    fn record_f64(&mut self, field: &Field, value: f64) {
        let value = serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number);
        self.put(field, value);
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Lines {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
        fn json(&self) -> Vec<Value> {
            self.text()
                .lines()
                .map(|l| serde_json::from_str(l).expect("every line is one JSON object"))
                .collect()
        }
    }

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

    /// What `format` writes for a warning with a field, in a span with a field.
    fn written(format: Format) -> String {
        let lines = Lines::default();
        let subscriber = subscriber(EnvFilter::new("info"), format, lines.clone());
        tracing::subscriber::with_default(subscriber, || {
            let _entered = tracing::info_span!("registration", seller_id = "S-1").entered();
            tracing::warn!(status = 503, "downstream failed; retrying later");
        });
        lines.text()
    }

    #[test]
    fn rust_log_keeps_lapins_lines_off_unless_it_names_lapin() {
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
            warn.contains("lapin=off") && warn.contains("warn"),
            "{warn}"
        );
        let lapin = filter_from(Some("info,lapin=debug")).to_string();
        assert!(!lapin.contains("lapin=off"), "{lapin}");
        let bad = filter_from(Some("[[[")).to_string();
        assert_eq!(bad, EnvFilter::new(DEFAULT_FILTER).to_string());
    }

    #[test]
    fn a_flood_of_one_warning_is_written_once_and_then_as_a_count() {
        let lines = Lines::default();
        let folds = Arc::new(repeats::Repeats::default());
        let subscriber = tracing_subscriber::registry()
            .with(filter_from(None))
            .with(repeats::FoldRepeats::new(folds.clone()))
            .with(layer(Format::Json, lines.clone()));
        tracing::subscriber::with_default(subscriber, || {
            for n in 0..1000 {
                tracing::warn!(retry_in_ms = n, "no permit decision (Redis); not calling");
                tracing::info!(n, "an info line is never folded");
            }
            tracing::warn!("another warning");
            for _ in 0..3 {
                tracing::warn!(target: "turnstile::audit", "operator action refused: pause");
            }
            repeats::report_now(&folds);
        });
        let lines = lines.json();
        let audit = lines.iter().filter(|l| l["target"] == "turnstile::audit");
        assert_eq!(audit.count(), 3, "the audit trail is never folded");
        let warnings: Vec<_> = lines
            .iter()
            .filter(|l| l["level"] == "WARN" && l["target"] != "turnstile::audit")
            .collect();
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert_eq!(
            warnings[0]["message"],
            "no permit decision (Redis); not calling"
        );
        assert_eq!(warnings[1]["message"], "another warning");
        assert_eq!(warnings[2]["message"], "a warning repeated");
        assert_eq!(warnings[2]["repeated"], 999);
        assert_eq!(
            warnings[2]["warning"],
            "no permit decision (Redis); not calling"
        );
        assert_eq!(warnings[2]["from"], "turnstile_core::telemetry::tests");
        assert_eq!(lines.iter().filter(|l| l["level"] == "INFO").count(), 1000);
    }

    #[test]
    fn the_default_filter_silences_lapins_connection_errors_and_keeps_turnstiles_lines() {
        for filter in [filter_from(None), filter_from(Some("warn"))] {
            let lines = Lines::default();
            let subscriber = subscriber(filter, Format::Json, lines.clone());
            tracing::subscriber::with_default(subscriber, || {
                tracing::error!(target: "lapin::io_loop", "error doing IO");
                tracing::error!(target: "lapin::channels", "Connection error");
                tracing::error!(target: "lapin::consumer", "consumer already has an error");
                tracing::error!(target: "lapin::channel", "channel closed");
                tracing::error!(target: "lapin::heartbeat", "missed heartbeats");
                tracing::warn!("broker connection lost; reconnecting");
            });
            let lines = lines.json();
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert_eq!(lines[0]["message"], "broker connection lost; reconnecting");
        }
    }

    #[test]
    fn text_is_coloured_only_on_a_terminal_without_no_color() {
        let text = |format, colours: bool| {
            let written = written(format);
            assert_eq!(
                written.contains('\u{1b}'),
                colours,
                "{format:?}: {written:?}"
            );
            assert!(
                written.contains("downstream failed; retrying later"),
                "{written}"
            );
        };
        let piped = Format::choose(None, None, false);
        assert_eq!(piped, Format::Text { ansi: false });
        text(piped, false);
        let terminal = Format::choose(None, None, true);
        assert_eq!(terminal, Format::Text { ansi: true });
        text(terminal, true);
        let no_color = Format::choose(None, Some("1".as_ref()), true);
        assert_eq!(no_color, Format::Text { ansi: false });
        text(no_color, false);
        // An empty NO_COLOR says nothing (no-color.org).
        assert_eq!(
            Format::choose(None, Some("".as_ref()), true),
            Format::Text { ansi: true }
        );
        assert_eq!(
            Format::choose(Some("JSON"), None, true),
            Format::Json,
            "JSON is never coloured"
        );
        assert!(!written(Format::Json).contains('\u{1b}'));
        assert_eq!(
            Format::choose(Some("text"), None, false),
            Format::Text { ansi: false }
        );
    }

    #[test]
    fn a_json_line_is_flat_with_the_span_fields_beside_the_events() {
        let lines = Lines::default();
        let subscriber = subscriber(EnvFilter::new("info"), Format::Json, lines.clone());
        tracing::subscriber::with_default(subscriber, || {
            let outer = tracing::info_span!("upload", batch_id = "b-1", attempt = 9u32);
            let _outer = outer.enter();
            let span = tracing::info_span!(
                "registration",
                seller_id = "S-1",
                message_id = "m-7",
                attempt = 2u32
            );
            let _entered = span.enter();
            tracing::warn!(
                status = 503,
                ok = false,
                ratio = 0.5,
                why = %"HTTP 503",
                level = "shadowed",
                "downstream failed; retrying later"
            );
        });
        let lines = lines.json();
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line = &lines[0];
        assert_eq!(line["message"], "downstream failed; retrying later");
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["target"], module_path!());
        assert!(line["timestamp"].as_str().unwrap().ends_with('Z'), "{line}");
        assert_eq!(line["seller_id"], "S-1");
        assert_eq!(line["message_id"], "m-7");
        assert_eq!(line["batch_id"], "b-1", "an outer span's field");
        assert_eq!(line["attempt"], 2, "the inner span's value");
        assert_eq!(
            (&line["status"], &line["ok"], &line["ratio"]),
            (&Value::from(503), &Value::from(false), &Value::from(0.5))
        );
        assert_eq!(line["why"], "HTTP 503");
        assert!(
            line.get("span").is_none() && line.get("fields").is_none(),
            "{line}"
        );
        assert_eq!(
            line.as_object().unwrap().len(),
            12,
            "each key once, `level` the line's own: {line}"
        );
    }

    #[test]
    fn a_json_line_carries_the_trace_of_the_message_and_the_span_of_its_call_once_made() {
        let lines = Lines::default();
        let subscriber = subscriber(EnvFilter::new("info"), Format::Json, lines.clone());
        let trace = crate::trace::TraceContext::start();
        let call = trace.child();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "registration",
                seller_id = "S-1",
                trace_id = %trace.trace_id(),
                span_id = tracing::field::Empty
            );
            let _entered = span.enter();
            tracing::info!("before the call");
            span.record("span_id", tracing::field::display(call.span_id()));
            tracing::info!("after the call");
        });
        let lines = lines.json();
        assert_eq!(lines.len(), 2);
        let trace_id = trace.trace_id().to_string();
        assert_eq!(lines[0]["trace_id"], trace_id.as_str());
        assert!(lines[0].get("span_id").is_none(), "{}", lines[0]);
        assert_eq!(lines[1]["trace_id"], trace_id.as_str());
        assert_eq!(lines[1]["span_id"], call.span_id().to_string().as_str());
        assert_eq!(lines[1]["seller_id"], "S-1");
    }

    #[test]
    fn a_json_line_outside_any_span_has_the_events_fields_only() {
        let lines = Lines::default();
        let subscriber = subscriber(EnvFilter::new("info"), Format::Json, lines.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(queue = "q", "consuming");
        });
        let text = lines.text();
        let at: Vec<usize> = ["timestamp", "level", "message", "target", "queue"]
            .iter()
            .map(|key| text.find(&format!("\"{key}\":")).expect(key))
            .collect();
        assert!(at.is_sorted() && at[0] == 1, "{text}");
        assert_eq!(lines.json()[0].as_object().unwrap().len(), 5, "{text}");
    }

    #[test]
    fn an_error_chain_shows_each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let said = io.to_string();
        #[derive(Debug)]
        struct Wrapping(std::io::Error);
        impl std::fmt::Display for Wrapping {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "IO error: {}", self.0)
            }
        }
        impl std::error::Error for Wrapping {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let error = anyhow::Error::new(Wrapping(io))
            .context("cannot connect to RabbitMQ at amqp://***@127.0.0.1:1/%2f");
        let text = error_chain(&error);
        assert_eq!(
            text,
            format!("cannot connect to RabbitMQ at amqp://***@127.0.0.1:1/%2f: IO error: {said}")
        );
        assert_eq!(text.matches(&said).count(), 1, "{text}");
        assert_eq!(format!("{error:#}").matches(&said).count(), 2);
    }
}
