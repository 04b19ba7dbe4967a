//! `turnstile bench scenario --preset adaptive`: turnstile is told a limit (20/1s) above what
//! the API really allows (5/1s, `--api-limit`); one busy seller's backlog (300) ahead of small
//! sellers (20 x 3), 4 replicas x 8 workers. `--preset adaptive-drain`: the same limits, one
//! seller's 150 messages alone, 1 replica x 8 workers (the first burst is a few workers' calls
//! answered at once, not a whole fleet's). Prints the share of the busy seller's calls answered
//! 429 in each half of its drain and after its first window, and the drain against the API's
//! own optimum (its greedy schedule at the API's limit). `--adaptive off` gives the figures
//! without adaptive limits; `--rate-limit-headers` makes the API say its limit.

use std::time::Duration;

use super::workload::{ScenarioArgs, limits_or, print_outcome, small_sellers_done};
use crate::mock_api::{MockArgs, SellerStats};
use crate::rig::{Message, Rig};
use turnstile_core::config::LimiterArgs;

/// The busy seller's calls and 429s so far, at a time on the mock's clock (ms).
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    at_ms: u64,
    calls: u64,
    throttled: u64,
}

impl Sample {
    fn of(at_ms: u64, seller: Option<&SellerStats>) -> Self {
        let seller = seller.cloned().unwrap_or_default();
        Sample {
            at_ms,
            calls: seller.registered + seller.violations + seller.duplicates,
            throttled: seller.violations,
        }
    }
}

/// The defaults of a preset, each overridden by its flag.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub replicas: usize,
    pub workers: u32,
    pub big: usize,
    pub small_sellers: usize,
    pub small: usize,
}

/// `--preset adaptive`: 4 replicas x 8 workers, 300 + 20 x 3.
pub const FLEET: Shape = Shape {
    replicas: 4,
    workers: 8,
    big: 300,
    small_sellers: 20,
    small: 3,
};

/// `--preset adaptive-drain`: 1 replica x 8 workers, one seller's 150 messages alone.
pub const DRAIN: Shape = Shape {
    replicas: 1,
    workers: 8,
    big: 150,
    small_sellers: 0,
    small: 0,
};

/// Runs the preset of `shape`; `Ok(false)` when anything was lost or registered twice.
pub async fn run(args: &ScenarioArgs, shape: Shape) -> anyhow::Result<bool> {
    let told = limits_or(&args.limit, "20/1s");
    let api = limits_or(&args.api_limit, "5/1s");
    let replicas = args.replicas.unwrap_or(shape.replicas);
    let workers = args.workers.unwrap_or(shape.workers);
    let big = args.big.unwrap_or(shape.big);
    let small_sellers = args.small_sellers.unwrap_or(shape.small_sellers);
    let small = args.small.unwrap_or(shape.small);
    let limiter = LimiterArgs {
        adaptive: args.adaptive,
        ..LimiterArgs::new(told.clone(), args.algorithm)
    };
    let hold = args.hold.unwrap_or(Duration::from_secs(2));
    let mut settings = args
        .rig
        .replica_settings("adaptive", limiter, workers, hold);
    settings.prefetch = args.prefetch;
    eprintln!(
        "adaptive: turnstile told {told}, the API allows {api} (rate-limit headers: {:?}, \
         Retry-After: {}), adaptive limits {}, {replicas} replicas x {workers} workers: one \
         seller's {big} messages (in {} wave(s)) ahead of {small_sellers} sellers with {small} each",
        args.rate_limit_headers,
        if args.no_retry_after { "no" } else { "yes" },
        if args.adaptive { "on" } else { "off" },
        args.waves.max(1)
    );
    let mock = MockArgs {
        rate_limit_headers: args.rate_limit_headers,
        no_retry_after: args.no_retry_after,
        ..MockArgs::local(api.clone())
    };
    let mut rig = Rig::build(settings)
        .with_mock(mock)
        .with_api_limit(api.clone())
        .start(replicas)
        .await?;
    let waves = args.waves.clamp(1, big.max(1));
    let optimum = api.optimum_drain(big as u64);
    let mut samples = Vec::new();
    for wave in 0..waves {
        let mut messages: Vec<Message> = (wave * big / waves..(wave + 1) * big / waves)
            .map(|i| Message::numbered("big", i))
            .collect();
        if wave == 0 {
            for s in 0..small_sellers {
                messages.extend((0..small).map(|i| Message::numbered(&format!("small-{s}"), i)));
            }
        }
        rig.publish_all(messages).await?;
        if wave + 1 < waves {
            let next = tokio::time::Instant::now() + optimum / waves as u32;
            while tokio::time::Instant::now() < next {
                let stats = rig.mock.stats();
                samples.push(Sample::of(stats.now_ms, stats.sellers.get("big")));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    rig.wait(optimum * 4 + Duration::from_secs(60), |stats| {
        samples.push(Sample::of(stats.now_ms, stats.sellers.get("big")));
    })
    .await?;
    let stats = rig.mock.stats();
    let learned = rig
        .admin()
        .learned(&turnstile_core::domain::SellerId::parse("big")?)
        .await?;
    let report = rig.finish().await?;

    let seller = stats.sellers.get("big").cloned().unwrap_or_default();
    let (first, last) = (seller.first_ms.unwrap_or(0), seller.last_ms.unwrap_or(0));
    let middle = (first + last) / 2;
    let start = Sample::default();
    let at_middle = samples
        .iter()
        .rev()
        .find(|s| s.at_ms <= middle)
        .copied()
        .unwrap_or(start);
    let end = Sample::of(stats.now_ms, Some(&seller));
    let first_window_end = first + api.shortest_window().as_millis() as u64;
    let after_first_window = samples
        .iter()
        .find(|s| s.at_ms >= first_window_end)
        .copied()
        .unwrap_or(end);
    let share = |from: Sample, to: Sample| {
        100.0 * (to.throttled - from.throttled) as f64 / (to.calls - from.calls).max(1) as f64
    };
    let drain = (last - first) as f64 / 1000.0;
    let ratio = drain / optimum.as_secs_f64().max(f64::EPSILON);
    let after_share = share(after_first_window, end);
    print_outcome(&report);
    println!(
        "{:<44} {:>10}",
        "429s of the big seller (all)", end.throttled
    );
    println!(
        "{:<44} {:>9.1}%",
        "429s: share of its calls, first half",
        share(start, at_middle)
    );
    println!(
        "{:<44} {:>9.1}%",
        "429s: share of its calls, second half",
        share(at_middle, end)
    );
    println!(
        "{:<44} {:>9.1}%",
        "429s: share of its calls, after the first window", after_share
    );
    println!(
        "{:<44} {:>10.2}",
        "big seller: calls per registration",
        end.calls as f64 / seller.registered.max(1) as f64
    );
    println!(
        "{:<44} {:>10.2}",
        "broker deliveries per message", report.deliveries_per_message
    );
    println!(
        "{:<44} {:>9.2}s",
        "big seller drain (first to last registration)", drain
    );
    println!(
        "{:<44} {:>9.2}s",
        format!("API optimum ({big} at {api})"),
        optimum.as_secs_f64()
    );
    println!("{:<44} {:>9.3}x", "drain / API optimum", ratio);
    if small_sellers > 0 {
        println!(
            "{:<44} {:>9.2}s",
            "small sellers: last registered after publish",
            small_sellers_done(&report)
        );
    }
    let learned = learned.map(|learned| learned.limit.to_string());
    if let Some(learned) = &learned {
        println!(
            "{:<44} {:>10}",
            "big seller: learned limit at the end", learned
        );
    }
    println!(
        "summary: {replicas}x{workers} headers={:?} drain={drain:.2}s optimum={:.2}s \
         ratio={ratio:.3}x 429s_after_first_window={after_share:.1}% 429s={} violations={} \
         lost={} duplicates={} learned={}",
        args.rate_limit_headers,
        optimum.as_secs_f64(),
        end.throttled,
        report.violations,
        report.lost,
        report.duplicates,
        learned.as_deref().unwrap_or("-")
    );
    Ok(report.lost == 0 && report.duplicates == 0)
}
