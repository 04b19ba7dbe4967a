//! `turnstile bench scenario --preset weighted`: two sellers with deep backlogs under a binding
//! global limit, of weights 4 and 1; how the global budget is shared between them while both
//! have work, against the 4:1 their weights ask for.

use std::time::Duration;

use super::workload::{ScenarioArgs, limits_or, print_outcome};
use crate::rig::{Message, Rig};
use turnstile_core::config::{GlobalLimit, LimiterArgs};
use turnstile_core::domain::SellerId;

/// Runs the preset; `Ok(false)` when anything was lost, duplicated or over a limit.
pub async fn run(args: &ScenarioArgs) -> anyhow::Result<bool> {
    let limit = limits_or(&args.limit, "1000/1s");
    let global = limits_or(&args.global_limit, "100/1s");
    let (replicas, workers) = (args.replicas.unwrap_or(3), args.workers.unwrap_or(16));
    let per_seller = args.big.unwrap_or(1_000);
    let limiter = LimiterArgs {
        global_limit: GlobalLimit(Some(global.clone())),
        ..LimiterArgs::new(limit.clone(), args.algorithm)
    };
    let hold = args.hold.unwrap_or(Duration::from_secs(60));
    let mut settings = args
        .rig
        .replica_settings("weighted", limiter, workers, hold);
    settings.prefetch = Some(args.prefetch.unwrap_or(800));
    eprintln!(
        "weighted: global limit {global} over sellers of {limit}, {replicas} replicas x {workers} workers: \
         sellers `heavy` (weight 4) and `light` (weight 1), {per_seller} messages each, interleaved"
    );
    let mut rig = Rig::build(settings).prepare().await?;
    let store = rig.store();
    store
        .admin()
        .set_weight(&SellerId::parse("heavy")?, 4)
        .await?;
    let mut messages = Vec::new();
    for i in 0..per_seller {
        for seller in ["heavy", "light"] {
            messages.push(Message::numbered(seller, i));
        }
    }
    rig.publish_all(messages).await?;
    rig.start_replicas(replicas, workers).await?;
    // Registrations of each seller, sampled while both have work.
    let mut samples: Vec<(u64, u64)> = Vec::new();
    let units = per_seller as u64;
    let optimum = global.optimum_drain(2 * units);
    rig.wait(optimum * 3 + Duration::from_secs(60), |stats| {
        let of = |s: &str| stats.sellers.get(s).map_or(0, |s| s.registered);
        samples.push((of("heavy"), of("light")));
    })
    .await?;
    let report = rig.finish().await?;
    // From the first sample with both under way to the last before either finished.
    let both: Vec<&(u64, u64)> = samples
        .iter()
        .filter(|(h, l)| *h > 0 && *l > 0 && *h < units && *l < units)
        .collect();
    let (first, last) = (both.first(), both.last());
    print_outcome(&report);
    println!(
        "{:<44} {:>10.2}",
        "broker deliveries per message", report.deliveries_per_message
    );
    let ok = report.lost == 0 && report.violations == 0 && report.duplicates == 0;
    let (Some(&&(h0, l0)), Some(&&(h1, l1))) = (first, last) else {
        println!("the two sellers never had work at once: no share to measure");
        return Ok(ok);
    };
    let (heavy, light) = (h1 - h0, l1 - l0);
    println!(
        "{:<44} {:>10}",
        "heavy (weight 4) while both had work", heavy
    );
    println!(
        "{:<44} {:>10}",
        "light (weight 1) while both had work", light
    );
    let ratio = heavy as f64 / (light as f64).max(1.0);
    println!("{:<44} {:>9.2}:1", "shares (heavy : light)", ratio);
    println!(
        "{:<44} {:>9.1}%",
        "off the 4:1 the weights ask for",
        100.0 * (ratio - 4.0).abs() / 4.0
    );
    Ok(ok)
}
