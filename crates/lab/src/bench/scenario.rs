//! `turnstile bench scenario`: one busy seller's backlog published ahead of many small sellers,
//! against a strict downstream; prints the figures the design is held to. `--preset backlog`
//! is issue 13's case: the whole workload (53,000 messages) is in the work queue before the
//! replicas start, so the busy seller's messages come back from the delay ladder while tens of
//! thousands wait in the work queue. `--preset stacked` is issue 15's: a stack of two limits
//! (6/1s,20/5s) enforced by the mock in cost units, every message costing 1 to 3 units.

use std::time::Duration;

use clap::Args;

use crate::mock_api::MockArgs;
use crate::rig::{Message, Rig, RigArgs, registration_body, weighed_body};
use turnstile_core::config::{Algorithm, GlobalLimit, LimiterArgs, Limits};
use turnstile_core::permit::{RedisConn, round_trips};

use super::command_calls;

#[derive(Args, Debug, Clone)]
pub struct ScenarioArgs {
    /// `bar`: 20/1s, 400 + 20x20, 4 replicas x 8 workers. `deep`: 10/2s, 300 + 30x10.
    /// `backlog`: 20/1s, 3,000 + 5,000x10 in the work queue before the replicas start.
    /// `stacked`: 6/1s,20/5s in cost units, costs 1 to 3, 150 + 30x5 (bar's shape: half the
    /// messages are the big seller's). `global`: a global limit of 100/1s over sellers of
    /// 1000/1s each, 3 replicas, 1,500 + 100x3. `weighted`: the same global limit, two sellers
    /// of weights 4 and 1 with 1,000 messages each (`--big`), their shares while both have work.
    /// `adaptive`: turnstile told 20/1s, the API allowing 5/1s (`--api-limit`), 300 + 20x3:
    /// the 429s in the second half of the big seller's drain and the drain against the API's
    /// own optimum. Flags given explicitly override the preset.
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

struct Preset {
    limit: &'static str,
    replicas: usize,
    workers: u32,
    big: usize,
    small_sellers: usize,
    small: usize,
    /// Publish everything before starting the replicas (a deep work queue from the start).
    prefill: bool,
    /// Messages cost 1, 2, … up to this many units, in turn.
    max_cost: u32,
    /// The global limit over all sellers, if any.
    global: Option<&'static str>,
    /// How long a replica holds a waiting message, and its prefetch (None: the default).
    hold: Duration,
    prefetch: Option<u16>,
}

pub async fn run(args: ScenarioArgs) -> anyhow::Result<bool> {
    if args.preset == "weighted" {
        return super::shares::run(&args).await;
    }
    if args.preset == "adaptive" {
        return super::adaptive::run(&args).await;
    }
    let preset = match args.preset.as_str() {
        "bar" => Preset {
            limit: "20/1s",
            replicas: 4,
            workers: 8,
            big: 400,
            small_sellers: 20,
            small: 20,
            prefill: false,
            max_cost: 1,
            global: None,
            hold: Duration::from_secs(2),
            prefetch: None,
        },
        "deep" => Preset {
            limit: "10/2s",
            replicas: 4,
            workers: 8,
            big: 300,
            small_sellers: 30,
            small: 10,
            prefill: false,
            max_cost: 1,
            global: None,
            hold: Duration::from_secs(2),
            prefetch: None,
        },
        "backlog" => Preset {
            limit: "20/1s",
            replicas: 4,
            workers: 8,
            big: 3_000,
            small_sellers: 5_000,
            small: 10,
            prefill: true,
            max_cost: 1,
            global: None,
            hold: Duration::from_secs(2),
            prefetch: None,
        },
        "stacked" => Preset {
            limit: "6/1s,20/5s",
            replicas: 4,
            workers: 8,
            big: 150,
            small_sellers: 30,
            small: 5,
            prefill: false,
            max_cost: 3,
            global: None,
            hold: Duration::from_secs(2),
            prefetch: None,
        },
        "global" => Preset {
            limit: "1000/1s",
            replicas: 3,
            workers: 16,
            big: 1_500,
            small_sellers: 100,
            small: 3,
            prefill: false,
            max_cost: 1,
            global: Some("100/1s"),
            // The replicas hold the backlog behind the global limit (1,800 messages) instead of
            // the delay ladder: one delivery per message.
            hold: Duration::from_secs(30),
            prefetch: Some(700),
        },
        other => anyhow::bail!(
            "--preset {other:?}: choose bar, deep, backlog, stacked, global, weighted or adaptive"
        ),
    };
    let limit = args
        .limit
        .unwrap_or_else(|| preset.limit.parse().expect("preset limits parse"));
    let replicas = args.replicas.unwrap_or(preset.replicas);
    let workers = args.workers.unwrap_or(preset.workers);
    let big = args.big.unwrap_or(preset.big);
    let small_sellers = args.small_sellers.unwrap_or(preset.small_sellers);
    let small = args.small.unwrap_or(preset.small);
    let max_cost = args
        .max_cost
        .unwrap_or(preset.max_cost)
        .clamp(1, limit.min_count());
    let cost_of = |i: usize| (i as u32 % max_cost) + 1;

    let global = args.global_limit.or_else(|| {
        preset
            .global
            .map(|g| g.parse().expect("preset limits parse"))
    });
    let limiter = LimiterArgs {
        // gcra takes a cost of at most its burst.
        gcra_burst: max_cost,
        global_limit: GlobalLimit(global.clone()),
        record_delay: args
            .record_delay
            .unwrap_or(LimiterArgs::new(limit.clone(), args.algorithm).record_delay),
        permit_block: args
            .permit_block
            .unwrap_or(LimiterArgs::new(limit.clone(), args.algorithm).permit_block),
        ..LimiterArgs::new(limit.clone(), args.algorithm)
    };
    let mut settings = args.rig.replica_settings(
        "scenario",
        limiter,
        workers,
        args.hold.unwrap_or(preset.hold),
    );
    settings.prefetch = args.prefetch.or(preset.prefetch);
    eprintln!(
        "scenario: limit {limit}{}, {replicas} replicas x {workers} workers, {}: one seller's {big} messages published ahead of {small_sellers} sellers with {small} each{}{}",
        global
            .as_ref()
            .map(|g| format!(", global limit {g}"))
            .unwrap_or_default(),
        args.algorithm,
        if max_cost > 1 {
            format!(", costing 1 to {max_cost} units in turn")
        } else {
            String::new()
        },
        if preset.prefill {
            ", all in the work queue before the replicas start"
        } else {
            ""
        }
    );
    let mock = MockArgs {
        slow_rate: args.slow_rate,
        slow_ms: args.slow_ms,
        ..MockArgs::local(limit.clone())
    };
    let rig = Rig::build(settings).with_mock(mock);
    let mut rig = if preset.prefill {
        rig.prepare().await?
    } else {
        rig.start(replicas).await?
    };
    let redis = RedisConn::connect(&args.rig.redis).await?;
    let redis_before = (command_calls(&redis).await?, round_trips());
    let mut messages = Vec::new();
    let message = |seller: &str, i: usize| {
        let id = format!("{seller}-{i}");
        let body = if max_cost > 1 {
            let cost = cost_of(i);
            weighed_body(&id, seller, cost, serde_json::json!({ "sku": i }))
        } else {
            registration_body(&id, seller, None, serde_json::json!({"sku": i}))
        };
        Message {
            seller: seller.to_owned(),
            body,
        }
    };
    for i in 0..big {
        messages.push(message("big", i));
    }
    for s in 0..small_sellers {
        let seller = format!("small-{s}");
        for i in 0..small {
            messages.push(message(&seller, i));
        }
    }
    let published_at = std::time::Instant::now();
    rig.publish_all(messages).await?;
    if preset.prefill {
        eprintln!(
            "published {} messages in {:.1} s; starting the replicas",
            rig.published(),
            published_at.elapsed().as_secs_f64()
        );
        rig.start_replicas(replicas, workers).await?;
    }
    let optimum = limit.optimum_drain_of((0..big).map(cost_of));
    // Taken in any order, the units can do no better than one unit a call (order-free bound).
    let units: u64 = (0..big).map(|i| u64::from(cost_of(i))).sum();
    let lower_bound = limit.optimum_drain(units);
    rig.wait(optimum * 3 + Duration::from_secs(60), |_| {})
        .await?;
    let redis_after = (command_calls(&redis).await?, round_trips());
    let rig_stats = rig.mock.stats();
    let report = rig.finish().await?;
    let (scripts_per_message, commands_per_message) = redis_after
        .0
        .per_message_since(&redis_before.0, report.registered);
    let requests_per_message =
        (redis_after.1 - redis_before.1) as f64 / report.registered.max(1) as f64;

    let big_drain = report
        .sellers
        .get("big")
        .and_then(|s| s.drain_s)
        .unwrap_or(f64::NAN);
    let ratio = big_drain / optimum.as_secs_f64().max(f64::EPSILON);
    let small_latency = small_sellers_done(&report);
    print_outcome(&report);
    println!("{:<44} {:>10}", "dead-lettered", report.dead_lettered);
    println!(
        "{:<44} {:>10.2}",
        "broker deliveries per message", report.deliveries_per_message
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the work queue",
        (report.deliveries - report.returns) as f64 / report.published.max(1) as f64
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the return queue",
        report.returns as f64 / report.published.max(1) as f64
    );
    println!(
        "{:<44} {:>10.2}",
        "delay ladder hops per message", report.ladder_hops_per_message
    );
    // Only the big seller waits (every small seller's messages fit in one window), so every
    // return is one of its messages, and the work queue delivered the small sellers' once each.
    let small_published = report.published.saturating_sub(big as u64);
    let big_work = (report.deliveries - report.returns).saturating_sub(small_published);
    let per_big = |n: u64| n as f64 / (big as f64).max(1.0);
    println!(
        "{:<44} {:>10.2}",
        "big seller: deliveries per message",
        per_big(big_work + report.returns)
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the work queue",
        per_big(big_work)
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the return queue",
        per_big(report.returns)
    );
    println!(
        "{:<44} {:>10}",
        "reserved slots forfeited (came back late)", report.forfeited
    );
    println!(
        "{:<44} {:>8}ms",
        "ladder: latest move to the return queue", report.ladder_max_late_ms
    );
    println!(
        "{:<44} {:>8.0}ms",
        "return queue: taken after due, mean", report.return_mean_late_ms
    );
    println!(
        "{:<44} {:>8}ms",
        "return queue: taken after due, latest", report.return_max_late_ms
    );
    println!(
        "{:<44} {:>9.2}s",
        "big seller drain (first to last registration)", big_drain
    );
    // Under a global limit the seller's own limit does not bind: its optimum says nothing.
    if global.is_none() {
        println!(
            "{:<44} {:>9.2}s",
            "optimum (greedy schedule, arrival order)",
            optimum.as_secs_f64()
        );
        println!("{:<44} {:>9.3}x", "drain / optimum", ratio);
    }
    if max_cost > 1 {
        println!(
            "{:<44} {:>9.2}s",
            format!("order-free lower bound ({units} units)"),
            lower_bound.as_secs_f64()
        );
        println!(
            "{:<44} {:>9.3}x",
            "drain / order-free lower bound",
            big_drain / lower_bound.as_secs_f64().max(f64::EPSILON)
        );
    }
    println!(
        "{:<44} {:>9.2}s",
        "small sellers: last registered after publish", small_latency
    );
    println!(
        "{:<44} {:>10.2}",
        "Redis: script calls per registration", scripts_per_message
    );
    println!(
        "{:<44} {:>10.2}",
        "  requests the replicas sent (pipeline = 1)", requests_per_message
    );
    println!(
        "{:<44} {:>10.1}",
        "  commands run, inside scripts included", commands_per_message
    );
    if let Some(global) = &global {
        print_global(&report, &rig_stats, global);
    }
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        value["big_drain_s"] = big_drain.into();
        value["optimum_s"] = optimum.as_secs_f64().into();
        value["drain_ratio"] = ratio.into();
        value["small_max_latency_s"] = small_latency.into();
        value["redis_scripts_per_message"] = scripts_per_message.into();
        value["redis_requests_per_message"] = requests_per_message.into();
        value["redis_commands_per_message"] = commands_per_message.into();
        value
            .as_object_mut()
            .expect("a report is an object")
            .remove("sellers");
        println!("{value}");
    }
    Ok(report.lost == 0 && report.violations == 0 && report.duplicates == 0)
}

/// The global limit's figures: requests the mock refused for it, the most units it saw in one
/// window, and how much of the budget was used from the first registration to the last (the
/// optimum drain of every registered unit through the global stack, over the real one).
fn print_global(report: &crate::rig::Report, stats: &crate::mock_api::Stats, global: &Limits) {
    let first = report
        .sellers
        .values()
        .filter_map(|s| s.first_s)
        .fold(f64::INFINITY, f64::min);
    let last = report
        .sellers
        .values()
        .filter_map(|s| s.last_s)
        .fold(0.0f64, f64::max);
    let units: u64 = stats.sellers.values().map(|s| s.units).sum();
    let optimum = global.optimum_drain(units).as_secs_f64();
    println!(
        "{:<44} {:>10}",
        "global: refused over the global limit", stats.global_violations
    );
    println!(
        "{:<44} {:>10}",
        format!(
            "global: most units in one {} window",
            global.iter().next().expect("a stack")
        ),
        stats.max_global_in_window
    );
    println!(
        "{:<44} {:>9.2}s",
        "global: first to last registration",
        last - first
    );
    println!(
        "{:<44} {:>9.2}s",
        format!("global: optimum for {units} units"),
        optimum
    );
    let slowest = global.slowest();
    let rate = f64::from(slowest.count()) / slowest.window().as_secs_f64();
    println!(
        "{:<44} {:>9.1}%",
        "global: budget used while there was work",
        100.0 * units as f64 / (rate * (last - first)).max(f64::EPSILON)
    );
    println!(
        "{:<44} {:>9.3}x",
        "global: drain / optimum",
        (last - first) / optimum.max(f64::EPSILON)
    );
}

/// The head of a scenario's figures: what was published, registered, lost, duplicated and over
/// a limit at the downstream.
pub(super) fn print_outcome(report: &crate::rig::Report) {
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
pub(super) fn small_sellers_done(report: &crate::rig::Report) -> f64 {
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
