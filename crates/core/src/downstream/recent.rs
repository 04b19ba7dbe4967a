//! What the downstream answered recently, as one replica saw it: calls by answer class and
//! their latency, over the last [`WINDOW`], for the dashboard. Bounded whatever the traffic:
//! a ring of [`SLICES`] time slices of [`SLICE`] each, every slice a count per class and a
//! fixed-bucket latency histogram ([`BUCKETS`] buckets, each about 19% wider than the one
//! before, from 100 µs to about 100 s), about 10 KiB in all. No seller is named: a replica's
//! memory does not grow with the number of sellers either.
//!
//! Quantiles are read from the buckets (interpolated within the bucket), so each is within a
//! bucket's width (19%) of the true value, usually much closer; the slowest call of the window
//! is kept exactly.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::CLASSES;

/// How long one slice of the ring lasts.
pub const SLICE: Duration = Duration::from_secs(10);
/// Slices in the ring: [`WINDOW`] in all.
pub const SLICES: usize = 30;
/// The window the figures cover (the current slice included, so up to one slice less of
/// history at its start).
pub const WINDOW: Duration = Duration::from_secs(SLICE.as_secs() * SLICES as u64);
/// Latency buckets per slice: bucket `i` holds latencies up to `FIRST_US × 2^(i/4)`; the last
/// one everything longer.
pub const BUCKETS: usize = 82;
/// The upper bound of the first bucket, µs.
const FIRST_US: f64 = 100.0;
/// Buckets per doubling.
const PER_OCTAVE: f64 = 4.0;

/// The classes counted as errors: every answer but a 2xx or a 429 (which is the downstream's
/// limit speaking, counted on its own).
const ERRORS: [&str; 4] = ["4xx", "5xx", "timeout", "error"];

/// One slice of the ring.
#[derive(Clone)]
struct Slot {
    /// Which slice it holds (slices since the ring's start); `u64::MAX`: none yet.
    slice: u64,
    classes: [u64; CLASSES.len()],
    buckets: [u32; BUCKETS],
    max_us: u64,
}

impl Slot {
    const EMPTY: Slot = Slot {
        slice: u64::MAX,
        classes: [0; CLASSES.len()],
        buckets: [0; BUCKETS],
        max_us: 0,
    };
}

/// The downstream's recent answers (see the module's doc). Written by the downstream client
/// after each call, read by the dashboard.
pub struct Recent {
    started: Instant,
    ring: Mutex<Vec<Slot>>,
}

impl Default for Recent {
    fn default() -> Self {
        Self::starting_at(Instant::now())
    }
}

impl std::fmt::Debug for Recent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recent")
            .field("calls", &self.summary().calls)
            .finish()
    }
}

/// The recent answers as the dashboard shows them (see [`Recent::summary`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Recently {
    /// Seconds the figures cover: [`WINDOW`], or less while the replica is younger.
    pub window_s: u64,
    /// Calls answered (or failed) in the window.
    pub calls: u64,
    /// Calls by class (`2xx`, `429`, `4xx`, `5xx`, `timeout`, `error`), every class present.
    pub classes: BTreeMap<&'static str, u64>,
    /// Calls that failed: `4xx`, `5xx`, `timeout` and `error` (429s are counted apart).
    pub errors: u64,
    /// `errors / calls` (0 without calls).
    pub error_ratio: f64,
    /// 429s over calls (0 without calls).
    pub throttled_ratio: f64,
    /// Latency quantiles of every call in the window, ms (within a bucket's width, 19%);
    /// `None` without calls.
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// The slowest call of the window, ms (exact).
    pub max_ms: Option<f64>,
    /// Calls and errors of each slice, oldest first ([`SLICES`] of them, [`SLICE`] each; the
    /// last is the current slice, still filling).
    pub slices: Vec<SliceCount>,
}

/// The recent answers in brief, as a replica announces them to the fleet (see
/// [`Recently::brief`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Brief {
    /// Seconds the figures cover.
    pub window_s: u64,
    pub calls: u64,
    /// Calls that failed (4xx, 5xx, timeouts, connection errors), and 429s.
    pub errors: u64,
    pub throttled: u64,
    /// Latency quantiles, ms (`None` without calls).
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

impl Recently {
    /// The figures in brief.
    pub fn brief(&self) -> Brief {
        Brief {
            window_s: self.window_s,
            calls: self.calls,
            errors: self.errors,
            throttled: self.classes.get("429").copied().unwrap_or(0),
            p50_ms: self.p50_ms,
            p99_ms: self.p99_ms,
        }
    }
}

/// Calls and errors of one slice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SliceCount {
    pub calls: u64,
    pub errors: u64,
}

/// The bucket of a latency.
fn bucket_of(took: Duration) -> usize {
    let us = took.as_secs_f64() * 1e6;
    if us <= FIRST_US {
        return 0;
    }
    let i = ((us / FIRST_US).log2() * PER_OCTAVE).ceil();
    (i as usize).min(BUCKETS - 1)
}

/// The upper bound of bucket `i`, µs.
fn upper_us(i: usize) -> f64 {
    FIRST_US * (i as f64 / PER_OCTAVE).exp2()
}

impl Recent {
    /// A ring whose slices count from `started`.
    pub fn starting_at(started: Instant) -> Self {
        Self {
            started,
            ring: Mutex::new(vec![Slot::EMPTY; SLICES]),
        }
    }

    fn slice_at(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.started).as_millis() / SLICE.as_millis()) as u64
    }

    /// Notes a call of `class` (one of [`CLASSES`]; any other counts as `error`) that took
    /// `took`, answered now.
    pub fn record(&self, class: &str, took: Duration) {
        self.record_at(Instant::now(), class, took);
    }

    /// Notes a call answered at `at` (see [`Recent::record`]).
    pub fn record_at(&self, at: Instant, class: &str, took: Duration) {
        let slice = self.slice_at(at);
        let class = CLASSES
            .iter()
            .position(|c| *c == class)
            .unwrap_or(CLASSES.len() - 1);
        let mut ring = self.ring.lock().expect("never poisoned");
        let slot = &mut ring[(slice % SLICES as u64) as usize];
        if slot.slice != slice {
            *slot = Slot {
                slice,
                ..Slot::EMPTY
            };
        }
        slot.classes[class] += 1;
        let bucket = &mut slot.buckets[bucket_of(took)];
        *bucket = bucket.saturating_add(1);
        slot.max_us = slot.max_us.max(took.as_micros() as u64);
    }

    /// The answers of the last [`WINDOW`], now.
    pub fn summary(&self) -> Recently {
        self.summary_at(Instant::now())
    }

    /// The answers of the [`WINDOW`] that ends at `at`.
    pub fn summary_at(&self, at: Instant) -> Recently {
        let now = self.slice_at(at);
        let oldest = now.saturating_sub(SLICES as u64 - 1);
        let mut classes = [0u64; CLASSES.len()];
        let mut buckets = [0u64; BUCKETS];
        let mut max_us = 0;
        let mut slices = vec![SliceCount::default(); SLICES];
        let error_classes: Vec<usize> = ERRORS
            .iter()
            .filter_map(|e| CLASSES.iter().position(|c| c == e))
            .collect();
        {
            let ring = self.ring.lock().expect("never poisoned");
            for slot in ring.iter().filter(|s| (oldest..=now).contains(&s.slice)) {
                for (sum, n) in classes.iter_mut().zip(slot.classes) {
                    *sum += n;
                }
                for (sum, n) in buckets.iter_mut().zip(slot.buckets) {
                    *sum += u64::from(n);
                }
                max_us = max_us.max(slot.max_us);
                let count = &mut slices[SLICES - 1 - (now - slot.slice) as usize];
                count.calls = slot.classes.iter().sum();
                count.errors = error_classes.iter().map(|&i| slot.classes[i]).sum();
            }
        }
        let calls: u64 = classes.iter().sum();
        let errors: u64 = error_classes.iter().map(|&i| classes[i]).sum();
        let throttled = CLASSES
            .iter()
            .position(|c| *c == "429")
            .map_or(0, |i| classes[i]);
        let ratio = |n: u64| {
            if calls == 0 {
                0.0
            } else {
                n as f64 / calls as f64
            }
        };
        let quantile = |q: f64| quantile_ms(&buckets, calls, q, max_us);
        let elapsed = at.saturating_duration_since(self.started);
        Recently {
            window_s: elapsed.min(WINDOW).as_secs(),
            calls,
            classes: CLASSES.iter().copied().zip(classes).collect(),
            errors,
            error_ratio: ratio(errors),
            throttled_ratio: ratio(throttled),
            p50_ms: quantile(0.5),
            p90_ms: quantile(0.9),
            p99_ms: quantile(0.99),
            max_ms: (calls > 0).then(|| max_us as f64 / 1000.0),
            slices,
        }
    }
}

/// The `q`-quantile of `calls` latencies in `buckets`, ms, interpolated geometrically within
/// its bucket and never above the slowest call (`max_us`); `None` without calls.
fn quantile_ms(buckets: &[u64; BUCKETS], calls: u64, q: f64, max_us: u64) -> Option<f64> {
    if calls == 0 {
        return None;
    }
    // The rank of the quantile, 1-based: the smallest latency with at least q × calls at or
    // below it.
    let rank = ((q * calls as f64).ceil() as u64).clamp(1, calls);
    let mut below = 0;
    for (i, &n) in buckets.iter().enumerate() {
        if n == 0 {
            continue;
        }
        if below + n >= rank {
            let low = if i == 0 { 0.0 } else { upper_us(i - 1) };
            let high = upper_us(i);
            let within = (rank - below) as f64 / n as f64;
            let us = if i == 0 {
                high * within
            } else {
                low * (high / low).powf(within)
            };
            return Some(us.min(max_us as f64).round() / 1000.0);
        }
        below += n;
    }
    Some(max_us as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn no_calls_means_no_quantiles_and_no_ratio() {
        let recent = Recent::default();
        let s = recent.summary();
        assert_eq!(s.calls, 0);
        assert_eq!(s.p50_ms, None);
        assert_eq!(s.max_ms, None);
        assert_eq!(s.error_ratio, 0.0);
        assert_eq!(s.classes.len(), CLASSES.len(), "every class present");
        assert_eq!(s.slices.len(), SLICES);
    }

    #[test]
    fn quantiles_follow_the_latencies_within_ten_percent() {
        let start = Instant::now();
        let recent = Recent::starting_at(start);
        // 1 ms to 1000 ms, one call each.
        for n in 1..=1000 {
            recent.record_at(start, "2xx", ms(n));
        }
        let s = recent.summary_at(start);
        assert_eq!(s.calls, 1000);
        for (got, want) in [(s.p50_ms, 500.0), (s.p90_ms, 900.0), (s.p99_ms, 990.0)] {
            let got = got.unwrap();
            assert!((got - want).abs() <= want * 0.1, "{got} vs {want}");
        }
        assert_eq!(s.max_ms, Some(1000.0));
        // A single call: every quantile is at most it.
        let one = Recent::starting_at(start);
        one.record_at(start, "2xx", Duration::from_micros(3_300));
        let s = one.summary_at(start);
        assert!(s.p50_ms.unwrap() <= 3.3 && s.p50_ms.unwrap() > 2.7, "{s:?}");
        assert_eq!(s.p99_ms, s.p50_ms);
    }

    #[test]
    fn classes_errors_and_ratios() {
        let start = Instant::now();
        let recent = Recent::starting_at(start);
        for (class, n) in [("2xx", 6), ("429", 2), ("5xx", 1), ("timeout", 1)] {
            for _ in 0..n {
                recent.record_at(start, class, ms(5));
            }
        }
        recent.record_at(start, "nonsense", ms(5));
        let s = recent.summary_at(start);
        assert_eq!(s.calls, 11);
        assert_eq!(s.classes["2xx"], 6);
        assert_eq!(s.classes["error"], 1, "an unknown class counts as an error");
        assert_eq!(s.errors, 3);
        assert!((s.error_ratio - 3.0 / 11.0).abs() < 1e-9);
        assert!((s.throttled_ratio - 2.0 / 11.0).abs() < 1e-9);
        assert_eq!(
            s.slices.last().unwrap(),
            &SliceCount {
                calls: 11,
                errors: 3
            }
        );
        let brief = s.brief();
        assert_eq!((brief.calls, brief.errors, brief.throttled), (11, 3, 2));
        assert_eq!(brief.p99_ms, s.p99_ms);
    }

    #[test]
    fn old_slices_leave_the_window_and_memory_stays_bounded() {
        let start = Instant::now();
        let recent = Recent::starting_at(start);
        recent.record_at(start, "5xx", ms(2000));
        let later = start + SLICE * 3;
        recent.record_at(later, "2xx", ms(10));
        let s = recent.summary_at(later);
        assert_eq!((s.calls, s.errors), (2, 1));
        assert_eq!(s.max_ms, Some(2000.0));
        assert_eq!(s.window_s, 30);
        // Once the first slice is older than the window, only the later call counts.
        let s = recent.summary_at(start + WINDOW);
        assert_eq!((s.calls, s.errors), (1, 0), "{s:?}");
        assert_eq!(s.max_ms, Some(10.0));
        assert_eq!(s.window_s, WINDOW.as_secs());
        // A whole day of calls, one per slice: the ring never holds more than its slices.
        for i in 0..(24 * 360) {
            recent.record_at(start + SLICE * i, "2xx", ms(1));
        }
        assert_eq!(recent.ring.lock().unwrap().len(), SLICES);
        assert_eq!(
            recent.summary_at(start + SLICE * (24 * 360 - 1)).calls,
            SLICES as u64
        );
    }

    #[test]
    fn extreme_latencies_land_in_the_end_buckets() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert_eq!(bucket_of(Duration::from_micros(100)), 0);
        assert_eq!(bucket_of(Duration::from_micros(101)), 1);
        assert_eq!(bucket_of(Duration::from_secs(3600)), BUCKETS - 1);
        assert!(
            upper_us(BUCKETS - 2) > 90e6,
            "the buckets reach about 100 s"
        );
    }
}
