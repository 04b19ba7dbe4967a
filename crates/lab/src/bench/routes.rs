//! `turnstile bench routes`: a mixed backlog on several routes of one provider under one budget
//! per seller. Each of `--sellers` sellers publishes `--per-route` messages on every route of
//! `--route NAME=LIMIT` and `--default` to the default endpoint, interleaved; the strict mock
//! enforces the budget (`--budget`) over all of a seller's requests and each route's stack. The
//! drain of each seller (its first to its last registration at the mock) is set beside the
//! greedy optimum of the same backlog in the same order: each message at the earliest moment
//! its route's stack and the budget both have room for it in every window, given the messages
//! before it ([`greedy_drain`]); and beside the longest any one limit allows alone (the budget
//! over every unit, each route over its own), which no schedule beats.

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
    #[command(flatten)]
    pub rig: RigArgs,
}

fn route_arg(s: &str) -> Result<(String, Limits), String> {
    let (name, limit) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=LIMIT"))?;
    Ok((name.to_owned(), turnstile_core::config::limits_arg(limit)?))
}

/// Runs the backlog and prints its figures; `Ok(false)` when anything was lost, duplicated or
/// over a limit.
pub async fn run(args: RoutesBenchArgs) -> anyhow::Result<bool> {
    let settings = args.rig.replica_settings(
        "routes",
        LimiterArgs::new(args.budget.clone(), Algorithm::SlidingWindow),
        args.workers,
        Duration::from_secs(2),
    );
    let mock = MockArgs {
        routes: args.routes.clone(),
        ..MockArgs::local(args.budget.clone())
    };
    let mut rig = Rig::build(settings).with_mock(mock).prepare().await?;
    let mut file = String::new();
    for (name, limit) in &args.routes {
        file.push_str(&format!(
            "[routes.{name}]\nmethod = \"POST\"\nurl = \"{}\"\nlimit = \"{limit}\"\n\n",
            rig.mock.route_url(name)
        ));
    }
    let path = std::env::temp_dir().join(format!(
        "turnstile-bench-routes-{:08x}.toml",
        rand::random::<u32>()
    ));
    std::fs::write(&path, file)?;
    let mut consume = rig.settings(args.workers);
    consume.routes.file = Some(path.clone());
    let started = async {
        for _ in 0..args.replicas {
            rig.start_replica(consume.clone()).await?;
        }
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_file(&path);
    started?;

    let mut messages = Vec::new();
    for s in 0..args.sellers {
        let seller = format!("mixed-{s}");
        let mut i = 0;
        for n in 0..args.per_route.max(args.default) {
            let targets = args
                .routes
                .iter()
                .map(|(name, _)| Some(name.as_str()))
                .filter(|_| n < args.per_route)
                .chain((n < args.default).then_some(None));
            for route in targets {
                let mut body = serde_json::json!({
                    "message_id": format!("{seller}-{i}"), "seller_id": seller,
                    "product": {"sku": i},
                });
                if let Some(route) = route {
                    body["route"] = route.into();
                }
                messages.push(Message {
                    seller: seller.clone(),
                    body: body.to_string().into_bytes(),
                });
                i += 1;
            }
        }
    }
    let total = messages.len() as u64;
    let per_seller = total / args.sellers as u64;
    let bound = args
        .routes
        .iter()
        .map(|(_, limit)| limit.optimum_drain(args.per_route as u64))
        .chain(std::iter::once(args.budget.optimum_drain(per_seller)))
        .max()
        .unwrap_or_default();
    // One seller's messages in publish order, by route (every seller's are alike).
    let order: Vec<Option<usize>> = messages
        .iter()
        .take(per_seller as usize)
        .map(|m| {
            let body: serde_json::Value = serde_json::from_slice(&m.body).unwrap_or_default();
            body["route"]
                .as_str()
                .and_then(|r| args.routes.iter().position(|(name, _)| name == r))
        })
        .collect();
    let optimum = greedy_drain(&args.budget, &args.routes, &order);
    eprintln!(
        "routes: {} sellers x ({} on each of {} routes + {} to the default endpoint) under {}, \
         {} replicas x {} workers",
        args.sellers,
        args.per_route,
        args.routes.len(),
        args.default,
        args.budget,
        args.replicas,
        args.workers
    );
    rig.publish_all(messages).await?;
    rig.wait(optimum * 4 + Duration::from_secs(60), |_| {})
        .await?;
    println!(
        "greedy optimum of the same backlog {:.2} s; the longest any one limit allows alone {:.2} s",
        optimum.as_secs_f64(),
        bound.as_secs_f64()
    );
    let stats = rig.mock.stats();
    let report = rig.finish().await?;
    println!("| seller | drain | greedy optimum | drain / optimum |");
    println!("|---|---|---|---|");
    let mut worst: f64 = 0.0;
    for (seller, s) in stats.sellers.iter() {
        let drain = Duration::from_millis(s.last_ms.unwrap_or(0) - s.first_ms.unwrap_or(0));
        let ratio = drain.as_secs_f64() / optimum.as_secs_f64().max(1e-9);
        worst = worst.max(ratio);
        println!(
            "| {seller} | {:.2} s | {:.2} s | {ratio:.3}x |",
            drain.as_secs_f64(),
            optimum.as_secs_f64()
        );
    }
    for (name, route) in &stats.routes {
        println!(
            "route {name}: {} registered, {} over its limit, at most {} of one seller in a window",
            route.registered, route.violations, route.max_in_window
        );
    }
    println!(
        "worst drain / optimum {worst:.3}x; {} of {total} registered, {} lost, {} duplicates, \
         {} violations (budget or route); {:.2} broker deliveries per message, {} reserved \
         slots forfeited, latest return {} ms after its slot",
        report.registered,
        report.lost,
        report.duplicates,
        report.violations,
        report.deliveries_per_message,
        report.forfeited,
        report.return_max_late_ms
    );
    Ok(report.lost == 0 && report.duplicates == 0 && report.violations == 0)
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
