//! Warnings that repeat, folded: a warning (or error) is written the first time its call site
//! logs, and again at most once per [`INTERVAL`] while it keeps repeating; the repeats in
//! between are counted, and [`report`] writes each count once per interval ("a warning
//! repeated", with `repeated`, `warning` and `from`). A call site quiet for an interval starts
//! over: its next warning is written at once, as the change of state it is. So a Redis outage
//! that makes every worker warn fifty times a second writes a few lines a minute, not
//! thousands. Lines below WARN are never folded, nor the operators' audit trail.
//!
//! A call site is one `warn!` or `error!` in the code (its metadata's name, which names its file
//! and line): warnings from one call site with
//! different fields (another message id, another error) fold together; the line written once
//! per interval shows the latest of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// How long a call site's repeats are folded into one count.
pub const INTERVAL: Duration = Duration::from_secs(30);

/// The target of the lines that report the counts (never folded themselves).
pub const TARGET: &str = "turnstile_core::telemetry::repeats";

/// Targets whose lines are never folded: the counts themselves, and the operators' audit
/// trail (`turnstile::audit`: every refused action is its own line).
const NEVER_FOLDED: [&str; 2] = [TARGET, "turnstile::audit"];

/// One call site's warnings: what was last written, and the repeats not written since.
#[derive(Debug)]
struct Site {
    /// The text (`message`) of the last warning written from it.
    message: String,
    target: &'static str,
    /// When a warning from it was last written, and last logged at all.
    written: Instant,
    last: Instant,
    /// Repeats not written since the count was last reported.
    folded: u64,
}

/// What [`Repeats::admit`] decides for one warning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Written: the first from its call site, the first after a quiet interval, or the first
    /// after an interval of repeats.
    Write,
    /// Folded into its call site's count.
    Fold,
}

/// The warnings seen, by call site (bounded by the call sites in the code).
#[derive(Debug, Default)]
pub struct Repeats {
    sites: Mutex<HashMap<&'static str, Site>>,
}

/// A count of folded repeats, as [`Repeats::take`] gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Folded {
    pub message: String,
    pub target: &'static str,
    pub repeated: u64,
}

impl Repeats {
    /// The repeats of the process's subscriber ([`super::init`]), which [`report`] reports.
    pub fn shared() -> Arc<Self> {
        static SHARED: OnceLock<Arc<Repeats>> = OnceLock::new();
        SHARED.get_or_init(Arc::default).clone()
    }

    /// Decides for a warning from call site `site` (its metadata's name, `event <file>:<line>`)
    /// logged at `now` (`message` gives its text, read only when it is written).
    pub fn admit(
        &self,
        site: &'static str,
        target: &'static str,
        now: Instant,
        message: impl FnOnce() -> String,
    ) -> Verdict {
        let mut sites = self.sites.lock().unwrap_or_else(|p| p.into_inner());
        match sites.get_mut(&site) {
            Some(seen)
                if now.saturating_duration_since(seen.last) < INTERVAL
                    && now.saturating_duration_since(seen.written) < INTERVAL =>
            {
                seen.last = now;
                seen.folded += 1;
                Verdict::Fold
            }
            Some(seen) => {
                seen.written = now;
                seen.last = now;
                seen.message = message();
                Verdict::Write
            }
            None => {
                sites.insert(
                    site,
                    Site {
                        message: message(),
                        target,
                        written: now,
                        last: now,
                        folded: 0,
                    },
                );
                Verdict::Write
            }
        }
    }

    /// The repeats folded since the last call, one count per call site that had any.
    pub fn take(&self) -> Vec<Folded> {
        let mut sites = self.sites.lock().unwrap_or_else(|p| p.into_inner());
        sites
            .values_mut()
            .filter(|s| s.folded > 0)
            .map(|s| Folded {
                message: s.message.clone(),
                target: s.target,
                repeated: std::mem::take(&mut s.folded),
            })
            .collect()
    }
}

/// Writes a line for each count of folded repeats in `repeats` (see [`Repeats::take`]).
pub fn report_now(repeats: &Repeats) {
    for folded in repeats.take() {
        tracing::warn!(
            target: TARGET,
            repeated = folded.repeated,
            warning = %folded.message,
            from = folded.target,
            "a warning repeated"
        );
    }
}

/// Reports the process's folded repeats ([`Repeats::shared`]) every [`INTERVAL`] until
/// `stop`, and once more then.
pub async fn report(stop: tokio_util::sync::CancellationToken) {
    let repeats = Repeats::shared();
    let mut tick = tokio::time::interval(INTERVAL);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => report_now(&repeats),
            () = stop.cancelled() => break,
        }
    }
    report_now(&repeats);
}

/// The layer that folds repeated warnings (see the module's documentation).
pub struct FoldRepeats {
    repeats: Arc<Repeats>,
}

impl FoldRepeats {
    pub fn new(repeats: Arc<Repeats>) -> Self {
        Self { repeats }
    }
}

impl<S: Subscriber> Layer<S> for FoldRepeats {
    fn event_enabled(&self, event: &Event<'_>, _: Context<'_, S>) -> bool {
        let meta = event.metadata();
        if *meta.level() > Level::WARN || NEVER_FOLDED.contains(&meta.target()) {
            return true;
        }
        let message = || {
            let mut text = MessageText(String::new());
            event.record(&mut text);
            text.0
        };
        let verdict = self
            .repeats
            .admit(meta.name(), meta.target(), Instant::now(), message);
        verdict == Verdict::Write
    }
}

/// An event's `message` field as text.
struct MessageText(String);

impl Visit for MessageText {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SITE: &str = "event crates/core/src/worker/plan.rs:556";

    fn admit(repeats: &Repeats, site: &'static str, at: Instant) -> Verdict {
        repeats.admit(site, "turnstile_core::worker", at, || {
            format!("{site} at {at:?}")
        })
    }

    #[test]
    fn a_warning_repeated_is_written_once_per_interval_and_counted_in_between() {
        let repeats = Repeats::default();
        let start = Instant::now();
        let ms = |n: u64| start + Duration::from_millis(n);
        assert_eq!(admit(&repeats, SITE, ms(0)), Verdict::Write);
        // Fifty a second for a whole interval: folded.
        let every = 20;
        let folded = (1..INTERVAL.as_millis() as u64 / every)
            .filter(|n| admit(&repeats, SITE, ms(n * every)) == Verdict::Fold)
            .count() as u64;
        assert_eq!(folded, INTERVAL.as_millis() as u64 / every - 1);
        // Another call site is its own.
        assert_eq!(
            admit(&repeats, "event elsewhere.rs:1", ms(100)),
            Verdict::Write
        );
        // An interval after it was written, the next one is written again.
        let again = INTERVAL.as_millis() as u64;
        assert_eq!(admit(&repeats, SITE, ms(again)), Verdict::Write);
        assert_eq!(admit(&repeats, SITE, ms(again + every)), Verdict::Fold);
        let counts = repeats.take();
        assert_eq!(counts.len(), 1, "{counts:?}");
        assert_eq!(counts[0].repeated, folded + 1);
        assert!(
            counts[0].message.starts_with(SITE),
            "the latest written: {counts:?}"
        );
        assert_eq!(repeats.take(), [], "each count is taken once");
    }

    #[test]
    fn a_call_site_quiet_for_an_interval_is_written_at_once() {
        let repeats = Repeats::default();
        let start = Instant::now();
        assert_eq!(admit(&repeats, SITE, start), Verdict::Write);
        assert_eq!(
            admit(&repeats, SITE, start + Duration::from_secs(1)),
            Verdict::Fold
        );
        let back = start + Duration::from_secs(1) + INTERVAL;
        assert_eq!(admit(&repeats, SITE, back), Verdict::Write);
    }
}
