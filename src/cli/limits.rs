//! `turnstile limits`: show or change per-seller limit overrides, shadow limits and pauses
//! (stored in Redis, effective on every replica at once), and show what adaptive limits learned.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use serde_json::json;
use turnstile_core::config::{LimiterArgs, Limits, RedisArgs, TermsArgs};
use turnstile_core::domain::{RouteName, SellerId};
use turnstile_core::fleet;
use turnstile_core::permit::{
    Admin, Learned, MAX_SHADOW_COUNT, MAX_WEIGHT, RedisConn, Terms, Usage, pause_span,
};
use turnstile_core::routes::{Routes, RoutesArgs};

use super::{Json, Operator, seller_value};
use turnstile_ops::audit;

/// `turnstile limits`: its action, where the limits live and the replicas' terms they are read
/// and changed under. The terms go before the action (`turnstile limits --algorithm gcra get
/// --seller S`): after it, `limits set`'s `--limit` is the seller's new limit.
#[derive(clap::Args, Debug)]
#[command(
    subcommand_precedence_over_arg = true,
    after_help = "Sellers are read and changed under the fleet's terms (the strictest of the live replicas'). With no replica alive, under the terms given here (--limit, --algorithm, ...: the TURNSTILE_* variables, or flags before the action: `turnstile limits --limit 100/1m get --seller S`)."
)]
pub struct LimitsArgs {
    #[command(subcommand)]
    pub action: LimitsAction,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub terms: TermsArgs,
    #[command(flatten)]
    pub routes: RoutesArgs,
    #[command(flatten)]
    pub operator: Operator,
}

#[derive(Subcommand, Debug)]
pub enum LimitsAction {
    /// Set a seller's limit, e.g. `--limit 500/1m`, or a stack that must all hold, e.g.
    /// `--limit 10/1s,500/1h`; and/or its weight under the global limit, e.g. `--weight 5`.
    /// With `--shadow`, the limit is only judged beside the enforced one, never enforced:
    /// `limits get`, the dashboard and `turnstile_shadow_verdicts_total` show what it would
    /// have done.
    #[command(group(clap::ArgGroup::new("what").required(true).multiple(true).args(["new_limit", "weight"])))]
    Set {
        /// The seller.
        #[arg(long, value_parser = seller_value)]
        seller: SellerId,
        /// The seller's new limit (an override of the default), COUNT/DURATION, or a
        /// comma-separated stack that must all hold.
        #[arg(long = "limit", value_parser = turnstile_core::config::limits_arg)]
        new_limit: Option<Limits>,
        /// Set `--limit` as the seller's shadow limit (its verdicts start from zero).
        #[arg(long, requires = "new_limit")]
        shadow: bool,
        /// The seller's share of TURNSTILE_GLOBAL_LIMIT when it binds, relative to the others'
        /// (default 1; 1 to 1000).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_WEIGHT)))]
        weight: Option<u32>,
        /// Set `--limit` as the seller's override of this route's stack (routes file) instead
        /// of its budget.
        #[arg(long, value_parser = route_value, requires = "new_limit", conflicts_with_all = ["shadow", "weight"])]
        route: Option<RouteName>,
        #[command(flatten)]
        json: Json,
    },
    /// Show each limit that applies to a seller (an override or the default, and what adaptive
    /// limits learned of it), how much of it is taken, which one binds now, any pause, and the
    /// shadow limit's verdicts.
    Get {
        /// The seller.
        #[arg(long, value_parser = seller_value)]
        seller: SellerId,
        #[command(flatten)]
        json: Json,
    },
    /// Remove a seller's override (the default applies again), or with `--shadow` its shadow
    /// limit.
    Clear {
        /// The seller.
        #[arg(long, value_parser = seller_value)]
        seller: SellerId,
        /// Remove the seller's shadow limit instead.
        #[arg(long)]
        shadow: bool,
        /// Remove the seller's override of this route's stack instead (the routes file's
        /// applies again).
        #[arg(long, value_parser = route_value, conflicts_with = "shadow")]
        route: Option<RouteName>,
        #[command(flatten)]
        json: Json,
    },
    /// Pause a seller on every replica at once: no call of it starts until the pause ends or
    /// `limits resume` lifts it; its messages wait in the delay ladder, holding no worker, and
    /// other sellers are not slowed. Without `--for`, until `limits resume` (at most 24h). A
    /// longer pause in force (a 429's, an earlier one) is kept.
    Pause {
        /// The seller.
        #[arg(long, value_parser = seller_value)]
        seller: SellerId,
        /// How long, e.g. `10m`, `2h` (more than 0, at most 24h: the replicas reserve a waiting
        /// message's slot at most 24h ahead by default, and `limits resume` reaches only
        /// those) [default: until `limits resume`, at most 24h].
        #[arg(long = "for", value_name = "DURATION", value_parser = pause_arg)]
        for_: Option<Duration>,
        /// Why, for the audit trail and the console's Paused sellers panel.
        #[arg(long)]
        why: Option<String>,
        #[command(flatten)]
        json: Json,
    },
    /// Lift a seller's pause (a 429's, or `limits pause`) on every replica at once: its waiting
    /// messages come back at once.
    Resume {
        /// The seller.
        #[arg(long, value_parser = seller_value)]
        seller: SellerId,
        #[command(flatten)]
        json: Json,
    },
    /// Forget a seller's limiter state (its grants, reserved slots, learned limit) safely: the
    /// seller is paused for one window first, so that no call of the forgotten state shares a
    /// window with a new one. Its override, weight and completion records are kept. (Deleting
    /// its keys by hand instead lets a second window of calls through.)
    Reset {
        /// The seller.
        #[arg(long, value_parser = seller_value)]
        seller: SellerId,
        #[command(flatten)]
        json: Json,
    },
}

/// Runs `turnstile limits`.
pub async fn run(
    LimitsArgs {
        action,
        redis,
        terms,
        routes,
        operator,
    }: LimitsArgs,
) -> anyhow::Result<ExitCode> {
    let routes = Routes::load(&routes)?;
    let conn = RedisConn::connect(&redis).await?;
    let records = turnstile_core::permit::Records::new(conn.clone(), &redis.key_prefix);
    let audited = audited(&action);
    let terms = fleet::tool_terms(&conn, &redis.key_prefix, LimiterArgs::with_terms(terms)).await?;
    if let Some(note) = terms.note(&redis.key_prefix) {
        eprintln!("{note}");
    }
    let limiter = terms.limiter;
    let store = Admin::new(conn, &redis.key_prefix, Terms::from(&limiter)).with_routes(&routes);
    let (json, said) = match action {
        LimitsAction::Set {
            seller,
            new_limit: Some(new_limit),
            route: Some(route),
            json,
            ..
        } => {
            known_route(&routes, &route)?;
            store
                .set_route_limit(&seller, &route, &new_limit)
                .await
                .context("setting the route's limit")?;
            let document = json!({
                "seller": seller.as_str(),
                "route": route.as_str(),
                "limit": new_limit.to_string(),
            });
            (
                json.then(document),
                format!("{seller}: {new_limit} on route {route} (override)"),
            )
        }
        LimitsAction::Clear {
            seller,
            route: Some(route),
            json,
            ..
        } => {
            known_route(&routes, &route)?;
            let had = store
                .clear_route_limit(&seller, &route)
                .await
                .context("clearing the route's limit")?;
            let what = if had {
                format!("override of route {route} cleared")
            } else {
                format!("had no override of route {route}")
            };
            let document = json!({
                "seller": seller.as_str(),
                "route": route.as_str(),
                "cleared": had,
            });
            (json.then(document), format!("{seller}: {what}"))
        }
        LimitsAction::Set {
            seller,
            new_limit,
            weight,
            shadow,
            json,
            ..
        } => {
            let mut said = Vec::new();
            if let Some(new_limit) = new_limit.clone().filter(|_| shadow) {
                anyhow::ensure!(
                    new_limit.iter().all(|l| l.count() <= MAX_SHADOW_COUNT),
                    "refusing the shadow limit {new_limit}: a shadow COUNT may be at most {MAX_SHADOW_COUNT} (its log keeps that many units per seller)"
                );
                store
                    .set_shadow(&seller, new_limit.clone())
                    .await
                    .context("setting the shadow limit")?;
                said.push(format!("{new_limit} (shadow: judged, not enforced)"));
            } else if let Some(new_limit) = new_limit.clone() {
                LimiterArgs {
                    limit: new_limit.clone(),
                    ..limiter.clone()
                }
                .check()
                .map_err(anyhow::Error::msg)
                .context("refusing the new limit")?;
                said.push(format!("{new_limit} (override)"));
                store
                    .set_limit(&seller, new_limit)
                    .await
                    .context("setting the limit")?;
            }
            if let Some(weight) = weight {
                store
                    .set_weight(&seller, weight)
                    .await
                    .context("setting the weight")?;
                said.push(format!("weight {weight}"));
            }
            let document = json!({
                "seller": seller.as_str(),
                "limit": new_limit.map(|l| l.to_string()),
                "shadow": shadow,
                "weight": weight,
            });
            (
                json.then(document),
                format!("{seller}: {}", said.join(", ")),
            )
        }
        LimitsAction::Get { seller, json } => {
            let got = get(&store, &seller).await?;
            (json.then(got.json()), got.text())
        }
        LimitsAction::Pause {
            seller, for_, json, ..
        } => {
            let span = pause_span(for_).map_err(anyhow::Error::msg)?;
            let paused = store
                .pause_now(&seller, span)
                .await
                .context("pausing the seller")?;
            let until = turnstile_core::domain::rfc3339(
                turnstile_core::domain::unix_ms() + paused.as_millis() as u64,
            );
            let kept = paused > span + Duration::from_secs(1);
            let mut line = format!(
                "{seller}: paused on every replica for {} (until {until}{})",
                shown(paused),
                if for_.is_none() {
                    ", or until `limits resume`"
                } else {
                    ""
                }
            );
            if kept {
                line += &format!(
                    "; a longer pause was in force and is kept (asked {}; `limits resume` lifts it)",
                    shown(span)
                );
            }
            let document = json!({
                "seller": seller.as_str(),
                "requested_s": for_.map(|d| d.as_secs_f64()),
                "until_resumed": for_.is_none(),
                "longer_kept": kept,
                "paused_for_s": millis(paused),
                "paused_until": until,
            });
            (json.then(document), line)
        }
        LimitsAction::Reset { seller, json } => {
            let paused = store
                .reset(&seller)
                .await
                .context("resetting the seller's limiter state")?;
            let document = json!({
                "seller": seller.as_str(),
                "paused_for_s": millis(paused),
            });
            let line = format!(
                "{seller}: limiter state forgotten; paused for {:.1}s so that no call of the forgotten state shares a window with a new one",
                paused.as_secs_f64()
            );
            (json.then(document), line)
        }
        LimitsAction::Resume { seller, json } => {
            let was = store.resume(&seller).await.context("lifting the pause")?;
            let what = if was {
                "pause lifted"
            } else {
                "was not paused"
            };
            let document = json!({"seller": seller.as_str(), "resumed": was});
            (json.then(document), format!("{seller}: {what}"))
        }
        LimitsAction::Clear {
            seller,
            shadow: true,
            json,
            ..
        } => {
            let had = store
                .clear_shadow(&seller)
                .await
                .context("clearing the shadow limit")?;
            let what = if had {
                "shadow limit cleared"
            } else {
                "had no shadow limit"
            };
            let document = json!({
                "seller": seller.as_str(),
                "shadow": true,
                "cleared": had,
                "default_limit": store.default_limit().to_string(),
            });
            (json.then(document), format!("{seller}: {what}"))
        }
        LimitsAction::Clear {
            seller,
            shadow: false,
            json,
            ..
        } => {
            let had = store
                .clear_limit(&seller)
                .await
                .context("clearing the limit")?;
            let what = if had {
                "override cleared"
            } else {
                "had no override"
            };
            let document = json!({
                "seller": seller.as_str(),
                "shadow": false,
                "cleared": had,
                "default_limit": store.default_limit().to_string(),
            });
            let line = format!(
                "{seller}: {what}; {} (default) applies",
                store.default_limit()
            );
            (json.then(document), line)
        }
    };
    if let Some((name, seller, argument)) = audited {
        let mut entry = audit::Entry::from_command_line(name, &operator.name());
        entry.seller = Some(seller);
        entry.argument = argument;
        entry.outcome = "done".into();
        entry.result = said.clone();
        entry.record(&records).await;
    }
    match json {
        Some(document) => println!("{}", serde_json::to_string_pretty(&document)?),
        None => println!("{said}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// What the audit trail records of `action`: its name (as the console's actions are named),
/// its seller and argument; `None` for one that changes nothing (`get`).
fn audited(action: &LimitsAction) -> Option<(&'static str, String, Option<String>)> {
    let seller = |s: &SellerId| s.as_str().to_owned();
    Some(match action {
        LimitsAction::Get { .. } => return None,
        LimitsAction::Set {
            seller: s,
            new_limit,
            weight,
            shadow,
            route,
            ..
        } => {
            let mut what = Vec::new();
            if let Some(limit) = new_limit {
                what.push(format!("{}{limit}", if *shadow { "shadow " } else { "" }));
            }
            if let Some(route) = route {
                what.push(format!("route {route}"));
            }
            if let Some(weight) = weight {
                what.push(format!("weight {weight}"));
            }
            ("set-limit", seller(s), Some(what.join(", ")))
        }
        LimitsAction::Clear {
            seller: s,
            shadow,
            route,
            ..
        } => {
            let what = match (shadow, route) {
                (_, Some(route)) => Some(format!("route {route}")),
                (true, None) => Some("shadow".to_owned()),
                (false, None) => None,
            };
            ("clear-limit", seller(s), what)
        }
        LimitsAction::Pause {
            seller: s,
            for_,
            why,
            ..
        } => {
            let span = for_.map_or_else(|| "until resumed".to_owned(), shown);
            let argument = match why {
                Some(why) => format!("{span}: {why}"),
                None => span,
            };
            ("pause", seller(s), Some(argument))
        }
        LimitsAction::Resume { seller: s, .. } => ("resume", seller(s), None),
        LimitsAction::Reset { seller: s, .. } => ("reset", seller(s), None),
    })
}

/// `--for`: a duration from 1µs to 24h (see `permit::pause_span`).
fn pause_arg(s: &str) -> Result<Duration, String> {
    let given = turnstile_core::config::delay_arg(s)?;
    pause_span(Some(given))
        .map_err(|e| e.to_string())
        .map(|_| given)
}

/// A duration as shown: `10m`, `1d`, `1h30m`-like spellings to the second (`599.9996s` is
/// `10m`); under a minute, to the tenth of a second.
fn shown(d: Duration) -> String {
    if d < Duration::from_secs(60) {
        return format!("{:.1}s", d.as_secs_f64());
    }
    let secs = d.as_secs() + u64::from(d.subsec_millis() >= 500);
    turnstile_core::config::format_duration(Duration::from_secs(secs))
}

/// Seconds with ms precision, as the JSON fields `*_s` carry them.
fn millis(d: Duration) -> f64 {
    d.as_millis() as f64 / 1000.0
}

/// What `limits get` shows of a seller.
struct Got {
    seller: SellerId,
    usage: Usage,
    learned: Option<Learned>,
    weight: u32,
    shadow: Option<turnstile_core::permit::Shadow>,
}

/// Reads what `limits get` shows of a seller.
async fn get(store: &Admin, seller: &SellerId) -> anyhow::Result<Got> {
    let usage = store.usage(seller).await.context("reading the limit")?;
    let learned = store
        .learned(seller)
        .await
        .context("reading the learned limit")?;
    let weight = store.weight(seller).await.context("reading the weight")?;
    let shadow = store.shadow(seller).await.context("reading the shadow")?;
    Ok(Got {
        seller: seller.clone(),
        usage,
        learned,
        weight,
        shadow,
    })
}

impl Got {
    /// The stack configured for the seller (its override or the default).
    fn configured(&self) -> &Limits {
        self.learned
            .as_ref()
            .map_or(&self.usage.limit, |learned| &learned.configured)
    }

    /// The stack that applies to a seller, whether it is an override, and its pause; then a
    /// line per limit: how much of it is taken now and promised ahead, and which one binds now.
    fn text(&self) -> String {
        let Got {
            seller,
            usage,
            learned,
            weight,
            shadow,
        } = self;
        let whose = if usage.overridden {
            "override"
        } else {
            "default"
        };
        let mut line = format!("{seller}: {} ({whose})", self.configured());
        if let Some(learned) = learned {
            line += &learned_line(learned);
        }
        if *weight != 1 {
            line += &format!(", weight {weight}");
        }
        if !usage.paused_for.is_zero() {
            line += &format!(", paused for {:.1}s", usage.paused_for.as_secs_f64());
        }
        for (i, u) in usage.per_limit.iter().enumerate() {
            line += &format!(
                "\n  {:<10} {} of {} units taken now, {} ahead{}",
                u.limit.to_string(),
                u.used,
                u.capacity,
                u.ahead,
                if i == usage.binding && usage.per_limit.len() > 1 {
                    "  <- binds now"
                } else {
                    ""
                }
            );
        }
        if let Some(shadow) = shadow {
            line += &format!(
                "\n  shadow {}: agreed {}, would have held back {} (by {:.1}s in all), would have let {} go at once",
                shadow.limit,
                shadow.agree,
                shadow.stricter,
                shadow.delay.as_secs_f64(),
                shadow.looser
            );
        }
        line
    }

    /// The same as one JSON document.
    fn json(&self) -> serde_json::Value {
        let Got {
            seller,
            usage,
            learned,
            weight,
            shadow,
        } = self;
        let limits: Vec<_> = usage
            .per_limit
            .iter()
            .enumerate()
            .map(|(i, u)| {
                json!({
                    "limit": u.limit.to_string(),
                    "used": u.used,
                    "capacity": u.capacity,
                    "ahead": u.ahead,
                    "binds": i == usage.binding,
                })
            })
            .collect();
        let learned = learned.as_ref().map(|l| {
            json!({
                "limit": l.limit.to_string(),
                "from": l.from.as_ref().map(ToString::to_string),
                "why": l.why.map(|w| w.label()),
                "changed_ago_s": l.changed_ago.map(millis),
                "patience": l.patience,
                "quota": l.quota.map(|q| json!({"left": q.left, "resets_in_s": millis(q.resets_in)})),
            })
        });
        let shadow = shadow.as_ref().map(|s| {
            json!({
                "limit": s.limit.to_string(),
                "agree": s.agree,
                "stricter": s.stricter,
                "stricter_delay_s": millis(s.delay),
                "looser": s.looser,
            })
        });
        json!({
            "seller": seller.as_str(),
            "limit": self.configured().to_string(),
            "override": usage.overridden,
            "applies": usage.limit.to_string(),
            "learned": learned,
            "weight": weight,
            "paused_for_s": millis(usage.paused_for),
            "in_flight": usage.in_flight,
            "limits": limits,
            "shadow": shadow,
        })
    }
}

/// What adaptive limits learned of a seller: the limit that applies, why and when it last
/// changed, and the downstream's quota.
fn learned_line(learned: &turnstile_core::permit::Learned) -> String {
    let mut line = String::new();
    if learned.limit != learned.configured {
        line += &format!(", learned {}", learned.limit);
    } else {
        line += ", learned: as configured";
    }
    if let (Some(why), Some(ago)) = (learned.why, learned.changed_ago) {
        line += &format!(" ({} {:.1}s ago", why.label(), ago.as_secs_f64());
        if let Some(from) = &learned.from {
            line += &format!(", from {from}");
        }
        line += ")";
    }
    if learned.limit != learned.configured {
        line += &format!("; raised after {} window(s) of full use", learned.patience);
    }
    if let Some(quota) = learned.quota {
        line += &format!(
            "; downstream quota {} left, resets in {:.1}s",
            quota.left,
            quota.resets_in.as_secs_f64()
        );
    }
    line
}

/// `--route`: a route's name (1 to 64 ASCII letters, digits, `_` or `-`).
fn route_value(s: &str) -> Result<RouteName, String> {
    RouteName::parse(s).map_err(|why| format!("a route's name {why}"))
}

/// With TURNSTILE_ROUTES_FILE given, a route it names; without, any (the replicas' file
/// decides which routes exist).
fn known_route(routes: &Routes, route: &RouteName) -> anyhow::Result<()> {
    anyhow::ensure!(
        routes.is_empty() || routes.get(route).is_some(),
        "TURNSTILE_ROUTES_FILE names no route {route:?}"
    );
    Ok(())
}
