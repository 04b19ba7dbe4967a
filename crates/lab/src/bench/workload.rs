//! What the scenario benches share: the flags of `turnstile bench scenario` (also read by its
//! presets `weighted` and `adaptive`, each in a module of its own) and the figures every run
//! prints first (`turnstile bench eta`'s too). It depends on no other bench module.

use std::time::Duration;

use clap::Args;

use crate::rig::{Report, RigArgs};
use turnstile_core::config::{Algorithm, Limits};

/// Flags of `turnstile bench scenario`.
#[derive(Args, Debug, Clone)]
pub struct ScenarioArgs {
    /// `bar`: 20/1s, 400 + 20x20, 4 replicas x 8 workers. `deep`: 10/2s, 300 + 30x10.
    /// `backlog`: 20/1s, 3,000 + 5,000x10 in the work queue before the replicas start.
    /// `stacked`: 6/1s,20/5s in cost units, costs 1 to 3, 150 + 30x5 (bar's shape: half the
    /// messages are the big seller's). `global`: a global limit of 100/1s over sellers of
    /// 1000/1s each, 3 replicas, 1,500 + 100x3. `weighted`: the same global limit, two sellers
    /// of weights 4 and 1 with 1,000 messages each (`--big`), their shares while both have work.
    /// `seed`: 100/1m, 500 + 2x150 + 10x50, 4 replicas x 16 workers (the motivating case's scale).
    /// `adaptive`: turnstile told 20/1s, the API allowing 5/1s (`--api-limit`), 300 + 20x3:
    /// the 429s in the second half of the big seller's drain and the drain against the API's
    /// own optimum. `adaptive-drain`: the same limits, one seller's 150 messages alone on
    /// 1 replica x 8 workers; adds the 429s after the first window. `partition`: 10/1s, 60 +
    /// 40 + 20, 2 replicas x 4 workers, one of which loses its link to the broker or Redis, by a
    /// reset or a hang, for 20 s and more: per case, when it said not ready, duplicates,
    /// violations and each seller's drain (`--limit`, `--workers`, `--hold`, `--algorithm`).
    /// Flags given explicitly override the preset.
    #[arg(long, default_value = "bar")]
    pub preset: String,
    /// The limit, or a comma-separated stack, both turnstile's and the mock's.
    #[arg(long, value_parser = turnstile_core::config::limits_arg)]
    pub limit: Option<Limits>,
    /// A global limit over all sellers together, both turnstile's and the mock's.
    #[arg(long = "global-limit", value_parser = turnstile_core::config::limits_arg)]
    pub global_limit: Option<Limits>,
    /// Messages cost 1 to this many units, in turn (the mock counts them from the product's
    /// `cost`).
    #[arg(long = "max-cost")]
    pub max_cost: Option<u32>,
    /// Consumer replicas [default: the preset's].
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Workers of each replica [default: the preset's].
    #[arg(long)]
    pub workers: Option<u32>,
    /// Messages of the busy seller (published first).
    #[arg(long)]
    pub big: Option<usize>,
    /// Small sellers (published after the busy one).
    #[arg(long = "small-sellers")]
    pub small_sellers: Option<usize>,
    /// Messages of each small seller.
    #[arg(long)]
    pub small: Option<usize>,
    /// The consumers' limiter algorithm.
    #[arg(long, value_enum, default_value_t = Algorithm::SlidingWindow)]
    pub algorithm: Algorithm,
    /// How long a replica may hold a waiting message [default: 2s; `global`: 30s].
    #[arg(long, value_parser = turnstile_core::config::duration_arg)]
    pub hold: Option<Duration>,
    /// AMQP prefetch of each replica's consumers [default: 8 x workers, at least 64; `global`:
    /// 700]; with a long --hold, a larger prefetch lets replicas hold a backlog instead of the
    /// delay ladder.
    #[arg(long)]
    pub prefetch: Option<u16>,
    /// Fraction of requests that reach the mock API late (--slow-ms), counted only then: the
    /// limit must hold whatever the latency.
    #[arg(long = "slow-rate", default_value_t = 0.0)]
    pub slow_rate: f64,
    /// How late a slow request (--slow-rate) reaches the mock, in ms.
    #[arg(long = "slow-ms", default_value_t = 300)]
    pub slow_ms: u64,
    #[command(flatten)]
    pub rig: RigArgs,
    /// Print the report as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
    /// The replicas' TURNSTILE_RECORD_DELAY (default: its default, 0).
    #[arg(long, value_parser = turnstile_core::config::delay_arg)]
    pub record_delay: Option<Duration>,
    /// The replicas' TURNSTILE_PERMIT_BLOCK (default: its default; 0 = no permit blocks).
    #[arg(long)]
    pub permit_block: Option<u32>,
    /// `adaptive`: the API's own per-seller limit, while turnstile is told `--limit`.
    #[arg(long = "api-limit", value_parser = turnstile_core::config::limits_arg)]
    pub api_limit: Option<Limits>,
    /// `adaptive`: the rate-limit headers the mock API sends (`none`, `x`, `ietf`).
    #[arg(long = "rate-limit-headers", value_enum, default_value_t = crate::mock_api::RateLimitForm::None)]
    pub rate_limit_headers: crate::mock_api::RateLimitForm,
    /// `adaptive`: the mock API answers a 429 without `Retry-After`.
    #[arg(long = "no-retry-after")]
    pub no_retry_after: bool,
    /// `adaptive`: `off` runs with the configured limit only (the figures before adaptive
    /// limits).
    #[arg(long, default_value = "on", value_name = "ON|OFF", num_args = 0..=1, default_missing_value = "on", action = clap::ArgAction::Set, value_parser = turnstile_core::config::Switch)]
    pub adaptive: bool,
    /// `adaptive`: publish the busy seller's messages in this many waves, one every
    /// optimum / waves (new arrivals while it drains: a raised limit is tested by new
    /// reservations); 1 publishes them all at once.
    #[arg(long, default_value_t = 1)]
    pub waves: usize,
}

/// The head of a scenario's figures: what was published, registered, lost, duplicated and over
/// a limit at the downstream.
pub(super) fn print_outcome(report: &Report) {
    println!("{:<44} {:>10}", "figure", "value");
    println!("{:<44} {:>10}", "published", report.published);
    println!("{:<44} {:>10}", "registered", report.registered);
    println!("{:<44} {:>10}", "lost", report.lost);
    println!(
        "{:<44} {:>10}",
        "duplicates (downstream)", report.duplicates
    );
    println!(
        "{:<44} {:>10}",
        "violations (downstream, strict window)", report.violations
    );
}

/// When the last small seller's last message registered, in seconds after the publish.
pub(super) fn small_sellers_done(report: &Report) -> f64 {
    report
        .sellers
        .iter()
        .filter(|(s, _)| s.starts_with("small-"))
        .filter_map(|(_, r)| r.last_s)
        .fold(0.0f64, f64::max)
}

/// A limits flag as given, or the preset's `default`.
pub(super) fn limits_or(given: &Option<Limits>, default: &str) -> Limits {
    given
        .clone()
        .unwrap_or_else(|| default.parse().expect("preset limits parse"))
}
