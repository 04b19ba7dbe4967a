//! `turnstile bench routes`: a mixed backlog on several routes of one provider under one budget
//! per seller. Each of `--sellers` sellers publishes `--per-route` messages on every route of
//! `--route NAME=LIMIT` and `--default` to the default endpoint, interleaved; the strict mock
//! enforces the budget (`--budget`) over all of a seller's requests and each route's stack. The
//! drain of each seller (its first to its last registration at the mock) is set beside the
//! greedy optimum of the same backlog in the same order: each message at the earliest moment
//! its route's stack and the budget both have room for it in every window, given the messages
//! before it ([`greedy_drain`]). The baseline, run next on the same machine: the same backlog
//! with every message sent to the default endpoint, under the budget alone, against its own
//! greedy optimum.

use std::time::Duration;

use clap::Args;

use crate::mock_api::MockArgs;
use crate::rig::{Message, Rig, RigArgs};
use turnstile_core::config::{Algorithm, LimiterArgs, Limits};

/// Flags of `turnstile bench routes`.
#[derive(Args, Debug, Clone)]
pub struct RoutesBenchArgs {
    /// The sellers' budget over every route (TURNSTILE_LIMIT), both turnstile's and the mock's.
    #[arg(long, default_value = "20/1s", value_parser = turnstile_core::config::limits_arg)]
    pub budget: Limits,
    /// A route, `NAME=LIMIT` (repeatable).
    #[arg(long = "route", value_parser = route_arg, default_values = ["register=10/1s", "price=8/1s", "stock=5/1s"])]
    pub routes: Vec<(String, Limits)>,
    /// Messages of each seller on each route.
    #[arg(long = "per-route", default_value_t = 40)]
    pub per_route: usize,
    /// Messages of each seller to the default endpoint (the budget only).
    #[arg(long = "default", default_value_t = 20)]
    pub default: usize,
    /// Sellers, each with the same backlog.
    #[arg(long, default_value_t = 3)]
    pub sellers: usize,
    /// Consumer replicas.
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Workers of each replica.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// TURNSTILE_PERMIT_BLOCK of the replicas.
    #[arg(long = "permit-block", default_value_t = 32)]
    pub permit_block: u32,
    #[command(flatten)]
    pub rig: RigArgs,
}

fn route_arg(s: &str) -> Result<(String, Limits), String> {
    let (name, limit) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=LIMIT"))?;
    Ok((name.to_owned(), turnstile_core::config::limits_arg(limit)?))
}

/// One seller's backlog in publish order: each message's route (its index in `routes`), or
/// `None` for the default endpoint, interleaved round by round.
fn backlog(args: &RoutesBenchArgs) -> Vec<Option<usize>> {
    let mut order = Vec::new();
    for n in 0..args.per_route.max(args.default) {
        if n < args.per_route {
            order.extend((0..args.routes.len()).map(Some));
        }
        if n < args.default {
            order.push(None);
        }
    }
    order
}

/// What one run measured: each seller's drain (first to last registration at the mock), and
/// the run's report and the mock's counters.
struct Run {
    drains: Vec<(String, Duration)>,
    report: crate::rig::Report,
    stats: crate::mock_api::Stats,
}

/// Runs every seller's backlog `order` on the routes of `args` (`routed`), or with every
/// message sent to the default endpoint under the budget alone (the baseline).
async fn run_once(
    args: &RoutesBenchArgs,
    order: &[Option<usize>],
    routed: bool,
) -> anyhow::Result<Run> {
    let mut settings = args.rig.replica_settings(
        if routed { "routes" } else { "routes-baseline" },
        LimiterArgs::new(args.budget.clone(), Algorithm::SlidingWindow),
        args.workers,
        Duration::from_secs(2),
    );
    settings.limiter.permit_block = args.permit_block;
    let routes = if routed {
        args.routes.clone()
    } else {
        Vec::new()
    };
    let mock = MockArgs {
        routes: routes.clone(),
        ..MockArgs::local(args.budget.clone())
    };
    let mut rig = Rig::build(settings).with_mock(mock).prepare().await?;
    let mut consume = rig.settings(args.workers);
    let mut path = None;
    if routed {
        let mut file = String::new();
        for (name, limit) in &routes {
            file.push_str(&format!(
                "[routes.{name}]\nmethod = \"POST\"\nurl = \"{}\"\nlimit = \"{limit}\"\n\n",
                rig.mock.route_url(name)
            ));
        }
        let file_path = std::env::temp_dir().join(format!(
            "turnstile-bench-routes-{:08x}.toml",
            rand::random::<u32>()
        ));
        std::fs::write(&file_path, file)?;
        consume.routes.file = Some(file_path.clone());
        path = Some(file_path);
    }
    let started = async {
        for _ in 0..args.replicas {
            rig.start_replica(consume.clone()).await?;
        }
        anyhow::Ok(())
    }
    .await;
    if let Some(path) = path {
        let _ = std::fs::remove_file(path);
    }
    started?;
    let mut messages = Vec::new();
    for s in 0..args.sellers {
        let seller = format!("mixed-{s}");
        for (i, route) in order.iter().enumerate() {
            let mut body = serde_json::json!({
                "message_id": format!("{seller}-{i}"), "seller_id": seller,
                "product": {"sku": i},
            });
            if let Some(r) = route.filter(|_| routed) {
                body["route"] = routes[r].0.clone().into();
            }
            messages.push(Message {
                seller: seller.clone(),
                body: body.to_string().into_bytes(),
            });
        }
    }
    rig.publish_all(messages).await?;
    rig.wait(Duration::from_secs(600), |_| {}).await?;
    let stats = rig.mock.stats();
    let report = rig.finish().await?;
    let drains = stats
        .sellers
        .iter()
        .map(|(seller, s)| {
            let ms = s.last_ms.unwrap_or(0) - s.first_ms.unwrap_or(0);
            (seller.clone(), Duration::from_millis(ms))
        })
        .collect();
    Ok(Run {
        drains,
        report,
        stats,
    })
}

/// Runs the backlog on the routes, then the same backlog on the budget alone, and prints both
/// against their optimums; `Ok(false)` when anything was lost, duplicated or over a limit.
pub async fn run(args: RoutesBenchArgs) -> anyhow::Result<bool> {
    let order = backlog(&args);
    let optimum = greedy_drain(&args.budget, &args.routes, &order);
    let baseline_optimum = greedy_drain(&args.budget, &[], &vec![None; order.len()]);
    let bound = args
        .routes
        .iter()
        .map(|(_, limit)| limit.optimum_drain(args.per_route as u64))
        .chain(std::iter::once(
            args.budget.optimum_drain(order.len() as u64),
        ))
        .max()
        .unwrap_or_default();
    eprintln!(
        "routes: {} sellers x ({} on each of {} routes + {} to the default endpoint) under {}, \
         {} replicas x {} workers; then the same backlog on the budget alone",
        args.sellers,
        args.per_route,
        args.routes.len(),
        args.default,
        args.budget,
        args.replicas,
        args.workers
    );
    let routed = run_once(&args, &order, true).await?;
    let baseline = run_once(&args, &order, false).await?;
    println!(
        "greedy optimum on the routes {:.2} s (the longest any one limit allows alone {:.2} s); \
         on the budget alone {:.2} s",
        optimum.as_secs_f64(),
        bound.as_secs_f64(),
        baseline_optimum.as_secs_f64()
    );
    println!("| seller | on the routes: drain / optimum | on the budget alone: drain / optimum |");
    println!("|---|---|---|");
    let ratio = |d: Duration, o: Duration| d.as_secs_f64() / o.as_secs_f64().max(1e-9);
    let mut worst: f64 = 0.0;
    for ((seller, drain), (_, base)) in routed.drains.iter().zip(&baseline.drains) {
        let r = ratio(*drain, optimum);
        worst = worst.max(r);
        println!(
            "| {seller} | {:.2} s, {r:.3}x | {:.2} s, {:.3}x |",
            drain.as_secs_f64(),
            base.as_secs_f64(),
            ratio(*base, baseline_optimum)
        );
    }
    let first = routed
        .stats
        .sellers
        .values()
        .filter_map(|s| s.first_ms)
        .min()
        .unwrap_or(0);
    for (name, route) in &routed.stats.routes {
        println!(
            "route {name}: {} registered, {} over its limit, at most {} of one seller in a \
             window; first and last {:.2} s and {:.2} s after the first registration",
            route.registered,
            route.violations,
            route.max_in_window,
            route.first_ms.unwrap_or(0).saturating_sub(first) as f64 / 1000.0,
            route.last_ms.unwrap_or(0).saturating_sub(first) as f64 / 1000.0
        );
    }
    for (what, r) in [
        ("routes", &routed.report),
        ("budget alone", &baseline.report),
    ] {
        println!(
            "{what}: {} of {} registered, {} lost, {} duplicates, {} violations; {:.2} broker \
             deliveries per message, {} reserved slots forfeited",
            r.registered,
            r.published,
            r.lost,
            r.duplicates,
            r.violations,
            r.deliveries_per_message,
            r.forfeited
        );
    }
    println!("worst drain / optimum on the routes {worst:.3}x");
    Ok([&routed.report, &baseline.report]
        .iter()
        .all(|r| r.lost == 0 && r.duplicates == 0 && r.violations == 0))
}

/// Units at moments (µs), kept sorted, under a stack of sliding windows.
struct Schedule {
    limits: Vec<(u64, u64)>,
    at: Vec<u64>,
}

impl Schedule {
    fn new(limits: &Limits) -> Self {
        Self {
            limits: limits
                .iter()
                .map(|l| (u64::from(l.count()), l.window_us()))
                .collect(),
            at: Vec::new(),
        }
    }

    /// Whether one more unit at `t` leaves every window of every limit within its count.
    fn fits(&self, t: u64) -> bool {
        self.limits.iter().all(|&(count, window)| {
            // Every window [x, x + window) holding t starts in (t - window, t]: the fullest
            // starts just after t - window or at a unit.
            let from = t.saturating_sub(window - 1);
            let starts = std::iter::once(from)
                .chain(self.at.iter().copied().filter(|&u| u > from && u <= t));
            starts.into_iter().all(|x| {
                let held = self
                    .at
                    .iter()
                    .filter(|&&u| u >= x && u < x + window)
                    .count() as u64;
                held < count
            })
        })
    }

    fn add(&mut self, t: u64) {
        let i = self.at.partition_point(|&u| u <= t);
        self.at.insert(i, t);
    }
}

/// The greedy schedule of one seller's messages in `order` (each its route's index, `None`
/// for the default endpoint): each at the earliest moment its route's stack and the budget
/// both have room for it, given the messages before it. Returns when the last one goes.
pub fn greedy_drain(
    budget: &Limits,
    routes: &[(String, Limits)],
    order: &[Option<usize>],
) -> Duration {
    let mut seller = Schedule::new(budget);
    let mut by_route: Vec<Schedule> = routes.iter().map(|(_, l)| Schedule::new(l)).collect();
    let mut last = 0;
    for route in order {
        // The earliest moment is 0, a moment a unit is at, or one a unit leaves a window at.
        let mut candidates: Vec<u64> = std::iter::once(0)
            .chain(
                seller
                    .at
                    .iter()
                    .flat_map(|&u| seller.limits.iter().map(move |&(_, w)| u + w).chain([u])),
            )
            .chain(route.iter().flat_map(|&r| {
                let s = &by_route[r];
                s.at.iter()
                    .flat_map(|&u| s.limits.iter().map(move |&(_, w)| u + w))
                    .collect::<Vec<_>>()
            }))
            .collect();
        candidates.sort_unstable();
        candidates.dedup();
        let t = candidates
            .into_iter()
            .find(|&t| seller.fits(t) && route.is_none_or(|r| by_route[r].fits(t)))
            .expect("a moment after every unit always fits");
        seller.add(t);
        if let Some(r) = *route {
            by_route[r].add(t);
        }
        last = last.max(t);
    }
    Duration::from_micros(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(s: &str) -> Limits {
        s.parse().unwrap()
    }

    #[test]
    fn the_greedy_drain_of_one_limit_is_its_optimum() {
        let order = vec![None; 25];
        let drain = greedy_drain(&limits("10/1s"), &[], &order);
        assert_eq!(drain, limits("10/1s").optimum_drain(25));
    }

    #[test]
    fn a_route_slower_than_the_budget_sets_the_pace_of_its_messages() {
        let routes = vec![("slow".to_owned(), limits("2/1s"))];
        // 6 on the slow route and 6 to the default endpoint, interleaved, under 10/1s: the
        // slow route's 6 need 2 more windows; the budget's 12 would fit in 2 windows.
        let order: Vec<Option<usize>> = (0..12).map(|i| (i % 2 == 0).then_some(0)).collect();
        assert_eq!(
            greedy_drain(&limits("10/1s"), &routes, &order),
            Duration::from_secs(2)
        );
    }
}
