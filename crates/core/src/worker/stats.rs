//! What one replica reports to whoever watches it: counters, the sellers seen, permit latencies.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_util::storage::Summary;

#[cfg(doc)]
use crate::permit::PermitStore;

/// What one replica reports to whoever watches it: its counters (also exported as Prometheus
/// metrics) and the sellers it has seen. This is the consume path's whole interface to the
/// operator side: the dashboard and `/metrics` read it; the worker writes it and knows nothing
/// of them. (Dead letters are counted in Redis, through [`PermitStore::count_dead`].)
#[derive(Debug, Default)]
pub struct Stats {
    pub deliveries: AtomicU64,
    pub registered: AtomicU64,
    pub already_done: AtomicU64,
    pub delayed: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub requeued: AtomicU64,
    pub throttled: AtomicU64,
    pub forfeited: AtomicU64,
    /// Broker sessions opened again after the previous one was lost.
    pub reconnects: AtomicU64,
    pub held: AtomicUsize,
    pub in_flight: AtomicUsize,
    /// What the delay ladder's consumers did in this replica.
    pub ladder: Arc<crate::broker::ladder::LadderStats>,
    /// What the replica's publishes and settlements cost the broker.
    pub broker: Arc<crate::broker::BrokerCost>,
    /// How long each permit decision took (one Redis round trip, or more after errors).
    pub permit_latency: LatencySummary,
    /// The downstream's answers over the last minutes: classes and latencies (bounded; see
    /// [`crate::downstream::recent`]).
    pub downstream: Arc<crate::downstream::Recent>,
    /// Sellers asked about since the dashboard sampler last took them (at most
    /// [`Stats::MAX_SELLERS`]; the sampler records them in Redis every second).
    pub sellers: Mutex<HashSet<String>>,
    /// Until when (Unix ms) every seller waits because Redis started less than a window ago
    /// (0: it does not; see `permit::server::watch_cold_start`).
    pub redis_cold_start_until_ms: Arc<std::sync::atomic::AtomicU64>,
}

impl Stats {
    /// Most sellers remembered between two samples.
    pub const MAX_SELLERS: usize = 10_000;

    /// Notes that the replica asked for a permit for `seller`.
    pub fn touch(&self, seller: &crate::domain::SellerId) {
        let mut sellers = self.sellers.lock().expect("never poisoned");
        if sellers.len() < Self::MAX_SELLERS && !sellers.contains(seller.as_str()) {
            sellers.insert(seller.as_str().to_owned());
        }
    }

    /// The sellers noted since the last call.
    pub fn take_sellers(&self) -> HashSet<String> {
        std::mem::take(&mut *self.sellers.lock().expect("never poisoned"))
    }
}

/// Latencies for quantiles, in metrics-util's [`Summary`] (a DDSketch: quantiles within 1% of
/// the true value, from 1 µs up), behind a lock held only to add or read samples.
pub struct LatencySummary {
    summary: Mutex<Summary>,
}

impl LatencySummary {
    /// Relative error of a quantile.
    const ALPHA: f64 = 0.01;
    /// Most buckets: each is about 2% wide, so 2048 of them span 1 µs to well beyond a day.
    const MAX_BUCKETS: u32 = 2_048;
    /// Shorter latencies (seconds) count as zero.
    const MIN_SECONDS: f64 = 1e-6;

    /// Adds one sample.
    pub fn record(&self, took: Duration) {
        self.lock().add(took.as_secs_f64());
    }

    /// Samples recorded so far.
    pub fn count(&self) -> u64 {
        self.lock().count() as u64
    }

    /// The `q`-quantile (0..=1) of the samples so far, or zero.
    pub fn quantile(&self, q: f64) -> Duration {
        let seconds = self.lock().quantile(q.clamp(0.0, 1.0));
        seconds.map_or(Duration::ZERO, |s| Duration::from_secs_f64(s.max(0.0)))
    }

    /// Adds another summary's samples to this one (to sum over replicas).
    pub fn absorb(&self, other: &LatencySummary) {
        let theirs = other.lock().clone();
        self.lock()
            .merge(&theirs)
            .expect("every latency summary has the same parameters");
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Summary> {
        self.summary.lock().expect("never poisoned")
    }
}

impl Default for LatencySummary {
    fn default() -> Self {
        Self {
            summary: Mutex::new(Summary::new(
                Self::ALPHA,
                Self::MAX_BUCKETS,
                Self::MIN_SECONDS,
            )),
        }
    }
}

impl std::fmt::Debug for LatencySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencySummary")
            .field("count", &self.count())
            .field("p50", &self.quantile(0.5))
            .field("p99", &self.quantile(0.99))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn latency_quantiles_follow_the_samples_within_a_percent() {
        let latencies = LatencySummary::default();
        assert_eq!(latencies.quantile(0.5), Duration::ZERO, "no samples yet");
        for micros in 1..=100u64 {
            latencies.record(Duration::from_micros(micros * 10));
        }
        assert_eq!(latencies.count(), 100);
        let p50 = latencies.quantile(0.5).as_secs_f64() * 1e6;
        let p99 = latencies.quantile(0.99).as_secs_f64() * 1e6;
        assert!((495.0..=505.0).contains(&p50), "{p50}");
        assert!((980.0..=1_000.0).contains(&p99), "{p99}");
    }

    #[test]
    fn absorbed_latencies_count_in_the_quantiles() {
        let (fast, slow) = (LatencySummary::default(), LatencySummary::default());
        for _ in 0..50 {
            fast.record(Duration::from_micros(100));
            slow.record(Duration::from_millis(10));
        }
        fast.absorb(&slow);
        assert_eq!(fast.count(), 100);
        let p99 = fast.quantile(0.99).as_secs_f64() * 1e3;
        assert!((9.9..=10.1).contains(&p99), "{p99}");
        assert_eq!(slow.count(), 50, "the absorbed summary keeps its samples");
    }
}
