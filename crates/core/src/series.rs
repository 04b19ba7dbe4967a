//! Every metric a replica exports, with its help text and the fixed values of its label: the
//! one list [`export_at_zero`] describes and registers at startup, so that the first scrape of
//! `/metrics` already shows each counter and histogram (each label value its own series) at 0,
//! and `rate()` or an alert rule sees 0 rather than "no data" (Prometheus' "avoid missing
//! metrics").
//!
//! Gauges are set by what they report: `turnstile_ready`, `turnstile_build_info` and those
//! marked [`Metric::from_start`] at startup (0 until ready, connected, computed), the
//! replica's own gauges and the process's ([`Metric::is_process`]) at each scrape, and
//! `turnstile_queue_messages` once the broker has been asked (within moments of startup, then
//! every 5 s, with `turnstile_queue_messages_age_seconds` saying how old the last reading is):
//! a depth not yet read is absent rather than a false 0, and a depth the broker stopped
//! answering for is old rather than current.

use crate::config::Algorithm;
use crate::downstream;
use crate::permit::{self, Forfeit, Why};
use crate::worker;

/// What kind of series a metric is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric: its name, kind, help text and (at most one) label with its fixed values.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    pub label: Option<Label>,
    /// A gauge exported at 0 from startup (each label value), where 0 is true until the
    /// replica knows better (not connected yet, nothing computed yet).
    pub from_start: bool,
}

/// A label and every value it takes.
#[derive(Clone, Copy, Debug)]
pub struct Label {
    pub key: &'static str,
    pub values: Values,
}

/// A label's values: a fixed list, or the one a replica runs with.
#[derive(Clone, Copy, Debug)]
pub enum Values {
    Fixed(&'static [&'static str]),
    /// The replica's algorithm (`TURNSTILE_ALGORITHM`): the only value it ever counts under.
    Algorithm,
    /// The routes of the replica's routes file (`TURNSTILE_ROUTES_FILE`; none without one).
    Routes,
}

const fn plain(name: &'static str, kind: Kind, help: &'static str) -> Metric {
    Metric {
        name,
        kind,
        help,
        label: None,
        from_start: false,
    }
}

const fn labelled(
    name: &'static str,
    kind: Kind,
    help: &'static str,
    key: &'static str,
    values: Values,
) -> Metric {
    Metric {
        name,
        kind,
        help,
        label: Some(Label { key, values }),
        from_start: false,
    }
}

impl Metric {
    /// This gauge, exported at 0 from startup.
    const fn zero_from_start(self) -> Self {
        Metric {
            from_start: true,
            ..self
        }
    }
}

const FORFEITS: [&str; 4] = [
    Forfeit::ALL[0].label(),
    Forfeit::ALL[1].label(),
    Forfeit::ALL[2].label(),
    Forfeit::ALL[3].label(),
];
const WHYS: [&str; 3] = [
    Why::ALL[0].label(),
    Why::ALL[1].label(),
    Why::ALL[2].label(),
];

use Kind::{Counter, Gauge, Histogram};

/// Every metric the consume path and the replica's endpoints export (docs/operations.md's "Metrics" table
/// says the same in words; a test keeps the two in step).
pub const METRICS: &[Metric] = &[
    plain(
        "turnstile_deliveries_total",
        Counter,
        "Deliveries received from the work queue and the return queue.",
    ),
    labelled(
        "turnstile_outcomes_total",
        Counter,
        "How deliveries were settled.",
        "outcome",
        Values::Fixed(&worker::OUTCOME_LABELS),
    ),
    labelled(
        "turnstile_dead_letters_total",
        Counter,
        "Dead letters confirmed by the broker, by reason.",
        "reason",
        Values::Fixed(&worker::DEAD_LETTER_REASONS),
    ),
    plain(
        "turnstile_results_published_total",
        Counter,
        "Results of messages that reached a final state, published (confirmed) to the results exchange.",
    ),
    plain(
        "turnstile_results_unrouted_total",
        Counter,
        "Results whose message's reply_to queue did not exist (they went to the results exchange only).",
    ),
    labelled(
        "turnstile_replies_refused_total",
        Counter,
        "Results not sent to their message's reply_to because it names one of turnstile's queues (own-queue) or one named like another deployment's (turnstile-queue); they went to the results exchange only.",
        "reason",
        Values::Fixed(&crate::broker::ReplyRefusal::LABELS),
    ),
    plain(
        "turnstile_returns_rescued_total",
        Counter,
        "Copies the broker returned as unroutable to another publish of the channel, republished to the return queue.",
    ),
    plain(
        "turnstile_batches_completed_total",
        Counter,
        "Batch completion events published (confirmed).",
    ),
    labelled(
        "turnstile_batch_anomalies_total",
        Counter,
        "Batches reported as malformed by kind: mixed_sellers (one batch id used by several sellers).",
        "kind",
        Values::Fixed(&["mixed_sellers"]),
    ),
    labelled(
        "turnstile_permits_granted_total",
        Counter,
        "Permits granted (acquired or redeemed).",
        "algorithm",
        Values::Algorithm,
    ),
    labelled(
        "turnstile_permits_near_limit_total",
        Counter,
        "Grants that left the seller's limit at least 80% taken.",
        "algorithm",
        Values::Algorithm,
    ),
    plain(
        "turnstile_permit_blocks_total",
        Counter,
        "Permit blocks taken: units put in the pool of a seller far from its limits, for its next calls by any replica.",
    ),
    plain(
        "turnstile_permit_block_units_total",
        Counter,
        "Grants that were units claimed from a seller's pool (permit blocks).",
    ),
    labelled(
        "turnstile_permits_denied_total",
        Counter,
        "Permit requests told to wait (over the limit, or back before a reserved slot).",
        "algorithm",
        Values::Algorithm,
    ),
    labelled(
        "turnstile_permits_over_limit_total",
        Counter,
        "Permit requests told to wait because the limit had no room.",
        "algorithm",
        Values::Algorithm,
    ),
    labelled(
        "turnstile_reservations_forfeited_total",
        Counter,
        "Reserved slots given up at redemption, by reason.",
        "reason",
        Values::Fixed(&FORFEITS),
    ),
    plain(
        "turnstile_reservations_released_total",
        Counter,
        "Reserved slots given back by a change of a seller's terms, or by a charge learned from an answer (TURNSTILE_COST_HEADER).",
    ),
    plain(
        "turnstile_reservations_taken_over_total",
        Counter,
        "Reserved slots a product's newer message took over from the older one it superseded (product_key).",
    ),
    plain(
        "turnstile_superseded_total",
        Counter,
        "Messages superseded by a newer message of their product (product_key): finished without a call.",
    ),
    plain(
        "turnstile_reservations_replanned_total",
        Counter,
        "Reserved slots a message gave back to ask anew because the fleet's terms it waited under are no longer in force (a raise, a stricter replica gone).",
    ),
    plain(
        "turnstile_delay_released_total",
        Counter,
        "Delayed messages returned early because their slot was given back.",
    ),
    labelled(
        "turnstile_global_permits_total",
        Counter,
        "Answers of the global limit to seller grants.",
        "outcome",
        Values::Fixed(&permit::GLOBAL_OUTCOMES),
    ),
    labelled(
        "turnstile_seller_leases_total",
        Counter,
        "Leases of a seller's calls in flight (TURNSTILE_SELLER_CONCURRENCY).",
        "outcome",
        Values::Fixed(&permit::LEASE_OUTCOMES),
    ),
    labelled(
        "turnstile_adaptive_changes_total",
        Counter,
        "Changes of a seller's learned limit made by this replica.",
        "why",
        Values::Fixed(&WHYS),
    ),
    plain(
        "turnstile_adaptive_learned_ratio",
        Histogram,
        "At each change, the learned count over the configured one.",
    ),
    labelled(
        "turnstile_shadow_verdicts_total",
        Counter,
        "Decisions judged by a seller's shadow limit.",
        "verdict",
        Values::Fixed(&permit::SHADOW_VERDICTS),
    ),
    labelled(
        "turnstile_downstream_requests_total",
        Counter,
        "Downstream calls by answer class.",
        "class",
        Values::Fixed(&downstream::CLASSES),
    ),
    labelled(
        "turnstile_route_calls_total",
        Counter,
        "Downstream calls made on each route of the routes file, whatever their answer.",
        "route",
        Values::Routes,
    ),
    labelled(
        "turnstile_cost_corrections_total",
        Counter,
        "Units that calls' reported costs (TURNSTILE_COST_HEADER) added to (charged) or removed from (refunded) their sellers' windows.",
        "direction",
        Values::Fixed(&["charged", "refunded"]),
    ),
    labelled(
        "turnstile_downstream_request_duration_seconds",
        Histogram,
        "Time of one downstream call, by answer class.",
        "class",
        Values::Fixed(&downstream::CLASSES),
    ),
    plain(
        "turnstile_downstream_throttled_total",
        Counter,
        "429 answers from the downstream.",
    ),
    plain(
        "turnstile_bulk_calls_total",
        Counter,
        "Bulk calls made (several rows of one seller and route in one downstream call).",
    ),
    plain(
        "turnstile_bulk_rows_total",
        Counter,
        "Rows carried by bulk calls.",
    ),
    plain(
        "turnstile_bulk_unmapped_total",
        Counter,
        "Bulk calls whose 2xx answer could not be mapped to their rows (each row retried alone).",
    ),
    plain(
        "turnstile_calls_claimed_elsewhere_total",
        Counter,
        "Grants given back because a copy of their message was being called on another replica.",
    ),
    plain(
        "turnstile_redis_errors_total",
        Counter,
        "Failed Redis calls.",
    ),
    plain(
        "turnstile_broker_errors_total",
        Counter,
        "Failed republishes, lost broker connections, failed queue-depth reads.",
    ),
    plain(
        "turnstile_reconnects_total",
        Counter,
        "Broker reconnections after a lost connection.",
    ),
    plain("turnstile_ready", Gauge, "1 while /readyz says ready."),
    plain(
        "turnstile_broker_connected",
        Gauge,
        "1 while this replica's broker session is open (consuming), 0 before it first connected and while it reconnects.",
    )
    .zero_from_start(),
    plain(
        "turnstile_redis_connected",
        Gauge,
        "1 while Redis answers this replica (its connection at start, then its fleet heartbeat, a write, every second), 0 before and while it does not.",
    )
    .zero_from_start(),
    plain(
        "turnstile_batches_overdue",
        Gauge,
        "Batches of the 200 newest uploads still waiting past the ETA this replica first gave them, by more than 10 minutes or a quarter of the time they were given (whichever is longer); computed every 30 s by replicas serving /metrics.",
    )
    .zero_from_start(),
    plain(
        "turnstile_batches_stalled",
        Gauge,
        "Batches of the 200 newest uploads that cannot complete as things stand: rows waiting, none of them (or of the seller's earlier batches) counted for 10 minutes or two of the seller's longest windows, with the seller neither paused nor retrying; computed every 30 s by replicas serving /metrics.",
    )
    .zero_from_start(),
    plain(
        "turnstile_build_info",
        Gauge,
        "1, with the build's version and git_sha (unknown unless TURNSTILE_GIT_SHA was set at build time) as labels.",
    ),
    plain(
        "turnstile_redis_may_evict",
        Gauge,
        "1 while a Redis server may evict keys (maxmemory with a policy other than noeviction): a seller whose state is evicted is paused for one window.",
    ),
    plain(
        "turnstile_redis_cold_start_pause_seconds",
        Gauge,
        "Seconds until every seller's permits stop waiting for a Redis that started less than a window ago (one window + guard after its start; 0 when none did, and always with TURNSTILE_REDIS_DURABLE=true).",
    ),
    plain(
        "turnstile_in_flight",
        Gauge,
        "Downstream calls under way in this replica.",
    ),
    plain(
        "turnstile_fleet_replicas",
        Gauge,
        "Live replicas in the fleet's registry, as this replica's last heartbeat saw them.",
    ),
    plain(
        "turnstile_fleet_disagreement",
        Gauge,
        "1 while the live replicas were started with different terms (every grant follows the strictest), else 0.",
    ),
    plain(
        "turnstile_fleet_terms_refused",
        Gauge,
        "1 while this replica's terms are refused: far stricter than the fleet's (TURNSTILE_ALLOW_STRICTER_TERMS off); it does not consume and its terms do not count.",
    )
    .zero_from_start(),
    plain(
        "turnstile_fleet_entries_vanished_total",
        Counter,
        "Live replicas' fleet entries that vanished without their leaving or being found lost (the registry's key deleted, a failover that lost writes); their terms still counted until they would have expired.",
    ),
    plain(
        "turnstile_fleet_replicas_lost",
        Gauge,
        "Replicas lost from the fleet's registry in the last 15 minutes (their entries expired unrenewed: killed, stuck, or cut off from Redis; not those that left), as this replica's last heartbeat saw them.",
    )
    .zero_from_start(),
    plain(
        "turnstile_fleet_replicas_not_ready",
        Gauge,
        "Live replicas whose fleet entry says they do not consume, as this replica's last heartbeat saw them.",
    )
    .zero_from_start(),
    plain(
        "turnstile_held_messages",
        Gauge,
        "Throttled messages held in this replica waiting for their slot.",
    ),
    plain(
        "turnstile_delay_held_messages",
        Gauge,
        "Delay ladder messages this replica holds.",
    ),
    plain(
        "turnstile_delay_handed_total",
        Counter,
        "Due delay ladder messages handed straight to this replica's workers.",
    ),
    plain(
        "turnstile_delay_hops_total",
        Counter,
        "Delay ladder messages republished by this replica (to another level or the return queue).",
    ),
    plain(
        "turnstile_delay_longest_hold_seconds",
        Gauge,
        "How long the delay ladder's top level holds a delivery: TURNSTILE_CONSUMER_TIMEOUT less a quarter (at most 10 minutes less), or under the broker's own timeout once it closed a channel for a shorter one.",
    ),
    plain(
        "turnstile_delay_ack_timeouts_total",
        Counter,
        "Delay ladder channels the broker closed for an ack timeout (the value it named is then held under).",
    ),
    plain(
        "turnstile_delay_overdue_total",
        Counter,
        "Delay ladder hops moved on more than 1 s after their end.",
    ),
    plain(
        "turnstile_delay_late_seconds",
        Histogram,
        "How long after its due time a delayed message was handed to the workers or moved into the return queue.",
    ),
    plain(
        "turnstile_delay_returns_total",
        Counter,
        "Deliveries taken from the return queue.",
    ),
    plain(
        "turnstile_delay_return_late_seconds",
        Histogram,
        "How long after its due time a message was taken from the return queue.",
    ),
    labelled(
        "turnstile_queue_messages",
        Gauge,
        "Messages ready in the work queue, the return queue, the delay ladder and the dead queue.",
        "queue",
        Values::Fixed(&["work", "ready", "delay", "dead"]),
    ),
    plain(
        "turnstile_queue_messages_age_seconds",
        Gauge,
        "Seconds since turnstile_queue_messages was last read from the broker (they are read every 5 s; above 12 they are stale: the broker is down or slow).",
    ),
    // The process metrics, under the names Prometheus' client libraries give them (see
    // `Metric::is_process`).
    plain(
        "process_cpu_seconds_total",
        Counter,
        "Total user and system CPU time spent in seconds (whole seconds).",
    ),
    plain(
        "process_resident_memory_bytes",
        Gauge,
        "Resident memory size in bytes.",
    ),
    plain(
        "process_virtual_memory_bytes",
        Gauge,
        "Virtual memory size in bytes.",
    ),
    plain(
        "process_virtual_memory_max_bytes",
        Gauge,
        "Maximum amount of virtual memory available in bytes (0: unlimited).",
    ),
    plain(
        "process_open_fds",
        Gauge,
        "Number of open file descriptors.",
    ),
    plain(
        "process_max_fds",
        Gauge,
        "Maximum number of open file descriptors (0: unlimited).",
    ),
    plain(
        "process_start_time_seconds",
        Gauge,
        "Start time of the process since unix epoch in seconds.",
    ),
    plain("process_threads", Gauge, "Number of OS threads in the process."),
];

/// The version of this build (`turnstile_build_info`'s `version`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit of this build (`turnstile_build_info`'s `git_sha`): `TURNSTILE_GIT_SHA` at build
/// time (the Dockerfile takes it as a build argument), else `unknown`.
pub const GIT_SHA: &str = match option_env!("TURNSTILE_GIT_SHA") {
    Some(sha) if !sha.is_empty() => sha,
    _ => "unknown",
};

impl Metric {
    /// Whether it is one of the process metrics (`process_*`: CPU, memory, file descriptors,
    /// start time, threads), read from `/proc` by the operator side at each scrape and at
    /// startup, rather than counted by the consume path.
    pub fn is_process(&self) -> bool {
        self.name.starts_with("process_")
    }

    /// Each label value this metric is exported under by a replica running `algorithm` (one
    /// empty entry for a metric without a label).
    pub fn label_values(&self, algorithm: Algorithm, routes: &[String]) -> Vec<String> {
        match self.label.map(|label| label.values) {
            None => vec![String::new()],
            Some(Values::Fixed(values)) => values.iter().map(|v| (*v).to_owned()).collect(),
            Some(Values::Algorithm) => vec![algorithm.name().to_owned()],
            Some(Values::Routes) => routes.to_vec(),
        }
    }
}

/// Describes every metric to the installed recorder, registers each counter and histogram
/// series at 0 (each label value of each) and the gauges marked [`Metric::from_start`], and
/// sets `turnstile_build_info`, for a replica running `algorithm` with `routes` (the names of
/// its routes file's routes). Call once, after the recorder is installed and before serving
/// `/metrics`.
pub fn export_at_zero(algorithm: Algorithm, routes: &[String]) {
    for metric in METRICS {
        let (name, help) = (metric.name, metric.help);
        match metric.kind {
            Counter => metrics::describe_counter!(name, help),
            Gauge => metrics::describe_gauge!(name, help),
            Histogram => metrics::describe_histogram!(name, help),
        }
        for value in metric.label_values(algorithm, routes) {
            let labels: Vec<metrics::Label> = match metric.label {
                Some(label) => vec![metrics::Label::new(label.key, value)],
                None => Vec::new(),
            };
            match metric.kind {
                Counter => metrics::counter!(name, labels).increment(0),
                // A histogram's series appear once registered; no observation is recorded.
                Histogram => drop(metrics::histogram!(name, labels)),
                Gauge if metric.from_start => metrics::gauge!(name, labels).set(0.0),
                Gauge => {}
            }
        }
    }
    metrics::gauge!("turnstile_build_info", "version" => VERSION, "git_sha" => GIT_SHA).set(1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_named_once_and_follows_the_naming_conventions() {
        let mut names: Vec<_> = METRICS.iter().map(|m| m.name).collect();
        names.sort();
        let count = names.len();
        names.dedup();
        assert_eq!(names.len(), count, "a metric is listed twice");
        for metric in METRICS {
            assert!(
                metric.name.starts_with("turnstile_") || metric.is_process(),
                "{}",
                metric.name
            );
            assert!(
                !metric.from_start || metric.kind == Gauge,
                "{}: counters and histograms are all exported at 0",
                metric.name
            );
            assert_eq!(
                metric.kind == Counter,
                metric.name.ends_with("_total"),
                "{}: counters and only counters end in _total",
                metric.name
            );
            if let Some(label) = metric.label {
                assert!(!label.key.is_empty());
                assert!(
                    !metric
                        .label_values(Algorithm::Gcra, &[])
                        .contains(&String::new())
                );
            }
        }
    }
}
