//! `turnstile bench scenario`: one busy seller's backlog published ahead of many small sellers,
//! against a strict downstream; prints the figures the design is held to. `--preset backlog`:
//! the whole workload (53,000 messages) is in the work queue before the replicas start, so the
//! busy seller's messages come back from the delay ladder while tens of thousands wait in the
//! work queue. `--preset stacked`: a stack of two limits (6/1s,20/5s) enforced by the mock in
//! cost units, every message costing 1 to 3 units. `--preset weighted`, `--preset adaptive` and
//! `--preset adaptive-drain` run in modules of their own (`shares`, `adaptive`), and so does
//! `--preset partition` (`partition`).

use std::time::Duration;

use crate::mock_api::MockArgs;
use crate::rig::{Message, Rig, registration_body, weighed_body};
use turnstile_core::config::{GlobalLimit, LimiterArgs, Limits};
use turnstile_core::permit::{RedisConn, fleet_calls, round_trips};

use super::commandstats::command_calls;
pub use super::workload::ScenarioArgs;
use super::workload::{print_outcome, small_sellers_done};

struct Preset {
    limit: &'static str,
    replicas: usize,
    workers: u32,
    big: usize,
    /// Sellers with a backlog of their own, published between the big seller's and the small
    /// sellers', and how many messages each.
    mid_sellers: usize,
    mid: usize,
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
        return super::adaptive::run(&args, super::adaptive::FLEET).await;
    }
    if args.preset == "adaptive-drain" {
        return super::adaptive::run(&args, super::adaptive::DRAIN).await;
    }
    if args.preset == "partition" {
        return super::partition::run(&args).await;
    }
    let preset = match args.preset.as_str() {
        "bar" => Preset {
            limit: "20/1s",
            replicas: 4,
            workers: 8,
            big: 400,
            mid_sellers: 0,
            mid: 0,
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
            mid_sellers: 0,
            mid: 0,
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
            mid_sellers: 0,
            mid: 0,
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
            mid_sellers: 0,
            mid: 0,
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
            mid_sellers: 0,
            mid: 0,
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
        "seed" => Preset {
            limit: "100/1m",
            replicas: 4,
            workers: 16,
            big: 500,
            mid_sellers: 2,
            mid: 150,
            small_sellers: 10,
            small: 50,
            prefill: false,
            max_cost: 1,
            global: None,
            hold: Duration::from_secs(2),
            prefetch: None,
        },
        other => anyhow::bail!(
            "--preset {other:?}: choose bar, deep, backlog, stacked, global, seed, weighted, adaptive, adaptive-drain or partition"
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
        "scenario: limit {limit}{}, {replicas} replicas x {workers} workers, {}: one seller's {big} messages published ahead of {}{small_sellers} sellers with {small} each{}{}",
        global
            .as_ref()
            .map(|g| format!(", global limit {g}"))
            .unwrap_or_default(),
        args.algorithm,
        if preset.mid_sellers > 0 {
            format!(
                "{} sellers with {} each and ",
                preset.mid_sellers, preset.mid
            )
        } else {
            String::new()
        },
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
    let fleet_before = (fleet_calls(), std::time::Instant::now());
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
    for s in 0..preset.mid_sellers {
        let seller = format!("mid-{s}");
        for i in 0..preset.mid {
            messages.push(message(&seller, i));
        }
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
    let fleet_run = (fleet_calls() - fleet_before.0, fleet_before.1.elapsed());
    let rig_stats = rig.mock.stats();
    let report = rig.finish().await?;
    let (scripts_per_message, commands_per_message) = redis_after
        .0
        .per_message_since(&redis_before.0, report.registered);
    let requests_per_message =
        (redis_after.1 - redis_before.1) as f64 / report.registered.max(1) as f64;
    // The fleet's fixed cost (heartbeats, joins, leaves: `lua/fleet.lua`), apart.
    let fleet_per_registration = fleet_run.0 as f64 / report.registered.max(1) as f64;
    let fleet_per_replica_second =
        fleet_run.0 as f64 / (replicas.max(1) as f64 * fleet_run.1.as_secs_f64().max(f64::EPSILON));
    let redis_time = redis_after
        .0
        .time_per_message_since(&redis_before.0, report.registered);

    let big_drain = report
        .sellers
        .get("big")
        .and_then(|s| s.drain_s)
        .unwrap_or(f64::NAN);
    let ratio = big_drain / optimum.as_secs_f64().max(f64::EPSILON);
    let small_latency = small_sellers_done(&report);
    print_outcome(&report);
    println!("{:<44} {:>10}", "dead-lettered", report.dead_lettered);
    let broker = &report.broker;
    let per = |n: u64| n as f64 / report.published.max(1) as f64;
    println!(
        "{:<44} {:>10.2}",
        "broker deliveries per message (every queue)", broker.deliveries_per_message
    );
    println!("{:<44} {:>10.2}", "  from the work queue", per(broker.work));
    println!(
        "{:<44} {:>10.2}",
        "  from the return queue",
        per(broker.returns)
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the delay ladder",
        per(broker.ladder)
    );
    println!(
        "{:<44} {:>10.2}",
        "broker publishes per message (copies)", broker.publishes_per_message
    );
    println!(
        "{:<44} {:>10.2}",
        "broker acks per message", broker.acks_per_message
    );
    println!(
        "{:<44} {:>10.2}",
        "  requeues per message",
        per(broker.requeues)
    );
    println!(
        "{:<44} {:>10.2}",
        "results published per message",
        per(broker.results)
    );
    println!(
        "{:<44} {:>10.2}",
        "delay ladder hops per message", report.ladder_hops_per_message
    );
    // Only the big (and mid) sellers wait (every small seller's messages fit in one window),
    // so every return and every ladder delivery is one of theirs, and the work queue delivered
    // the small sellers' once each.
    let waiting = big + preset.mid_sellers * preset.mid;
    let small_published = report.published.saturating_sub(waiting as u64);
    let big_work = broker.work.saturating_sub(small_published);
    let per_big = |n: u64| n as f64 / (waiting as f64).max(1.0);
    println!(
        "{:<44} {:>10.2}",
        if preset.mid_sellers > 0 {
            "big and mid sellers: deliveries per message"
        } else {
            "big seller: deliveries per message"
        },
        per_big(big_work + broker.returns + broker.ladder)
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the work queue",
        per_big(big_work)
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the return queue",
        per_big(broker.returns)
    );
    println!(
        "{:<44} {:>10.2}",
        "  from the delay ladder",
        per_big(broker.ladder)
    );
    println!(
        "{:<44} {:>10}",
        "reserved slots forfeited (came back late)", report.forfeited
    );
    println!(
        "{:<44} {:>8}ms",
        "ladder: latest handed on after due", report.ladder_max_late_ms
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
        if preset.mid_sellers > 0 {
            let mid_optimum = limit.optimum_drain_of((0..preset.mid).map(cost_of));
            let worst = (0..preset.mid_sellers)
                .filter_map(|s| report.sellers.get(&format!("mid-{s}"))?.drain_s)
                .fold(0.0f64, f64::max);
            println!(
                "{:<44} {:>9.3}x",
                "mid sellers: slowest drain / optimum",
                worst / mid_optimum.as_secs_f64().max(f64::EPSILON)
            );
        }
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
        "  the fleet's (heartbeats, joins, leaves)", fleet_per_registration
    );
    println!(
        "{:<44} {:>10.2}",
        "  the registrations' (the fleet's left out)",
        scripts_per_message - fleet_per_registration
    );
    println!(
        "{:<44} {:>10.2}",
        "the fleet's script calls per replica per second", fleet_per_replica_second
    );
    println!(
        "{:<44} {:>10.2}",
        "  requests the replicas sent (pipeline = 1)", requests_per_message
    );
    println!(
        "{:<44} {:>10.1}",
        "  commands run, inside scripts included", commands_per_message
    );
    super::commandstats::print_time("Redis (INFO commandstats)", "registration", &redis_time);
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
        value["redis_time_per_message"] = serde_json::to_value(&redis_time)?;
        value["redis_fleet_scripts_per_message"] = fleet_per_registration.into();
        value["redis_fleet_scripts_per_replica_second"] = fleet_per_replica_second.into();
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
