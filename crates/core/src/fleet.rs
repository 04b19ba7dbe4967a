//! The fleet: the replicas that share a key prefix, and the one set of terms they grant under.
//!
//! Each replica announces itself in Redis every [`HEARTBEAT`] (`permit::Registry`,
//! `lua/fleet.lua`): its id, host, version, the terms it was started with ([`FleetTerms`]:
//! limit stack, algorithm, global limit, seller concurrency, adaptive limits), the terms it
//! grants under now (`applies`), its calls in flight, its rate and, in brief, what the
//! downstream answered it lately, and whether it is ready (and why not). An entry not renewed
//! within [`EXPIRY`] is no longer live, so a replica killed with SIGKILL or cut off from Redis
//! stops counting within a few heartbeats; it is listed as lost ([`LostReplica`]) for
//! [`LOST_RETENTION`], unless it beats again (live again) or leaves.
//!
//! **The strictest live terms apply** ([`strictest`]): every replica grants under the strictest
//! terms of any live replica, its own included, so a rolling deploy that lowers a limit takes
//! effect when the first new replica registers, and one that raises it when the last old one
//! is gone. The rules:
//! - limit stacks (and global limits): every limit of every stack holds (a union), the lowest
//!   count kept for one window, a limit implied by another dropped (at most `b` calls in a
//!   window `w` already bounds every shorter window to `b`), then at most eight limits (two
//!   neighbours merged into the lower count over the longer window, stricter than both);
//! - seller concurrency: the lowest; adaptive limits: on if any replica has them on, with the
//!   lowest floor;
//! - the algorithm: the one of the longest-running replica (each algorithm counts only its own
//!   grants, so a fleet grants under one at a time); when it changes, grants under the new one
//!   wait until every grant under the old one has left the longest window of the stack
//!   ([`fence_until_ms`], enforced by `permit::Applied`).
//!
//! **A replica consumes only once the fleet applies its terms** ([`Member::join`]): it waits
//! until every live replica reports that it grants under the strictest terms, the new ones
//! included. A replica that cannot renew its entry for most of [`EXPIRY`] stops granting
//! (`permit::Applied`), so a replica the others no longer see never grants under terms the
//! others no longer follow. Runtime overrides (`turnstile limits set`) apply on top, as before.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{Algorithm, GlobalLimit, Limit, LimiterArgs, Limits, SellerConcurrency};
use crate::domain::RouteName;
use crate::permit::{Applied, PermitError, PermitStore, RedisConn, Registered, Registry, Roll};
use crate::telemetry::{NotReady, Readiness};
use crate::worker::Stats;

/// How often a replica renews its entry.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// How long an entry lives without being renewed.
pub const EXPIRY: Duration = Duration::from_secs(5);

/// How long a lost replica (its entry expired unrenewed) stays listed: long enough for an
/// operator to see it and what it last said after an alert, short enough that crash-looping
/// replicas (a new id at each start) do not fill the list (at most 1,000 kept, see
/// `lua/fleet.lua`).
pub const LOST_RETENTION: Duration = Duration::from_secs(15 * 60);

/// How soon a replica beats again after its terms were replaced (see [`Member::run`]).
const REPORT_SOON: Duration = Duration::from_millis(50);

/// How long a replica trusts the terms it last confirmed, from when it sent that heartbeat:
/// less than [`EXPIRY`], so it stops granting before the others can have dropped its entry
/// (with room for its clock to run a little slower than Redis's).
const TRUST: Duration = Duration::from_secs(4);

/// The terms a replica grants under that the fleet shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetTerms {
    /// `TURNSTILE_LIMIT`: the default stack.
    pub limit: Limits,
    /// `TURNSTILE_ALGORITHM`.
    pub algorithm: Algorithm,
    /// `TURNSTILE_GLOBAL_LIMIT`.
    pub global_limit: GlobalLimit,
    /// `TURNSTILE_SELLER_CONCURRENCY`.
    pub seller_concurrency: SellerConcurrency,
    /// `TURNSTILE_ADAPTIVE`.
    pub adaptive: bool,
    /// `TURNSTILE_ADAPTIVE_MIN`.
    pub adaptive_min: NonZeroU32,
    /// The stacks of the routes of its routes file (`TURNSTILE_ROUTES_FILE`), by name.
    pub routes: BTreeMap<RouteName, Limits>,
}

impl FleetTerms {
    /// The fleet's share of a replica's limiter settings.
    pub fn of(limiter: &LimiterArgs) -> Self {
        Self {
            limit: limiter.limit.clone(),
            algorithm: limiter.algorithm,
            global_limit: limiter.global_limit.clone(),
            seller_concurrency: limiter.seller_concurrency,
            adaptive: limiter.adaptive,
            adaptive_min: limiter.adaptive_min,
            routes: limiter.route_limits.clone(),
        }
    }

    /// `limiter` with these terms in place of its own (its other settings kept). A token
    /// bucket's capacity applies to one limit only: under a stack it is dropped.
    pub fn apply_to(&self, limiter: &LimiterArgs) -> LimiterArgs {
        let Self {
            limit,
            algorithm,
            global_limit,
            seller_concurrency,
            adaptive,
            adaptive_min,
            routes,
        } = self.clone();
        LimiterArgs {
            bucket_capacity: if limit.is_stack() {
                0
            } else {
                limiter.bucket_capacity
            },
            limit,
            algorithm,
            global_limit,
            seller_concurrency,
            adaptive,
            adaptive_min,
            route_limits: routes,
            ..limiter.clone()
        }
    }

    /// One line that names the terms, equal for equal terms (what a replica reports it
    /// applies).
    pub fn digest(&self) -> String {
        let wire = Wire::from(self);
        format!(
            "{} {} global={} concurrency={} adaptive={}",
            wire.algorithm,
            wire.limit,
            wire.global_limit,
            wire.seller_concurrency
                .map_or_else(|| "off".to_owned(), |n| n.to_string()),
            if wire.adaptive {
                format!("on/{}", wire.adaptive_min)
            } else {
                "off".to_owned()
            }
        ) + &if wire.routes.is_empty() {
            String::new()
        } else {
            let routes: Vec<String> = wire
                .routes
                .iter()
                .map(|(name, stack)| format!("{name}:{stack}"))
                .collect();
            format!(" routes={}", routes.join(";"))
        }
    }
}

/// [`FleetTerms`] as JSON writes them: stacks as `TURNSTILE_LIMIT` is written.
#[derive(Serialize, Deserialize)]
struct Wire {
    limit: String,
    algorithm: String,
    global_limit: String,
    seller_concurrency: Option<u32>,
    adaptive: bool,
    adaptive_min: u32,
    /// Absent from a replica of an older version, or without a routes file.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    routes: BTreeMap<String, String>,
}

impl From<&FleetTerms> for Wire {
    fn from(terms: &FleetTerms) -> Self {
        Self {
            limit: terms.limit.to_string(),
            algorithm: terms.algorithm.name().to_owned(),
            global_limit: terms.global_limit.to_string(),
            seller_concurrency: terms.seller_concurrency.0.map(NonZeroU32::get),
            adaptive: terms.adaptive,
            adaptive_min: terms.adaptive_min.get(),
            routes: terms
                .routes
                .iter()
                .map(|(name, stack)| (name.to_string(), stack.to_string()))
                .collect(),
        }
    }
}

impl TryFrom<Wire> for FleetTerms {
    type Error = String;

    fn try_from(wire: Wire) -> Result<Self, String> {
        let global_limit = if wire.global_limit == "off" {
            GlobalLimit(None)
        } else {
            GlobalLimit(Some(wire.global_limit.parse().map_err(|e| {
                format!("global_limit {:?}: {e}", wire.global_limit)
            })?))
        };
        Ok(Self {
            limit: wire
                .limit
                .parse()
                .map_err(|e| format!("limit {:?}: {e}", wire.limit))?,
            algorithm: Algorithm::named(&wire.algorithm)
                .ok_or_else(|| format!("algorithm {:?} is not one", wire.algorithm))?,
            global_limit,
            seller_concurrency: SellerConcurrency(
                wire.seller_concurrency.and_then(NonZeroU32::new),
            ),
            adaptive: wire.adaptive,
            adaptive_min: NonZeroU32::new(wire.adaptive_min).ok_or("adaptive_min is 0")?,
            routes: wire
                .routes
                .iter()
                .map(|(name, stack)| {
                    let name =
                        RouteName::parse(name).map_err(|e| format!("route name {name:?}: {e}"))?;
                    let stack = stack
                        .parse()
                        .map_err(|e| format!("route {name} limit {stack:?}: {e}"))?;
                    Ok((name, stack))
                })
                .collect::<Result<_, String>>()?,
        })
    }
}

impl Serialize for FleetTerms {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        Wire::from(self).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for FleetTerms {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Wire::deserialize(deserializer)?
            .try_into()
            .map_err(serde::de::Error::custom)
    }
}

/// What a replica announces in its entry.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    pub host: String,
    pub pid: u32,
    pub version: String,
    /// The work queue it consumes.
    pub queue: String,
    /// The terms it was started with.
    pub terms: FleetTerms,
    /// The digest ([`FleetTerms::digest`]) of the terms it grants under now, once it applies
    /// the fleet's.
    pub applies: Option<String>,
    /// Whether it consumes.
    pub ready: bool,
    /// Why it does not consume, and since when (Unix ms, its own clock): absent while it does,
    /// when no reason was given (starting, joining the fleet, draining), and from a replica of
    /// an older version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<NotReady>,
    pub in_flight: u64,
    /// Messages it registered per second since its previous heartbeat.
    pub registered_per_s: f64,
    /// What the downstream answered it over the last minutes, in brief (absent from a replica
    /// of an older version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downstream: Option<crate::downstream::recent::Brief>,
    /// Why its terms were refused (far stricter than the fleet's, see [`far_stricter`]): it
    /// does not consume and its terms do not count. Absent when they were not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// When its process started (Unix ms, its own clock; absent from a replica of an older
    /// version): its entry's first heartbeat is when it last joined the registry, later after
    /// a rejoin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_started_ms: Option<u64>,
}

/// A live replica, as the registry shows it.
#[derive(Clone, Debug, Serialize)]
pub struct Replica {
    pub id: String,
    /// When its process started (RFC 3339, its own clock), or, from a replica of an older
    /// version, its first heartbeat (Redis's clock).
    pub started: String,
    /// Its last heartbeat (RFC 3339, Redis's clock).
    pub last_seen: String,
    #[serde(flatten)]
    pub entry: Entry,
    #[serde(skip)]
    since_ms: i64,
}

/// A replica lost from the registry: its entry expired unrenewed (killed, stuck, or cut off
/// from Redis: it may still hold messages), as its last entry showed it. Its terms no longer
/// count. Listed for [`LOST_RETENTION`], unless it beats again or leaves.
#[derive(Clone, Debug, Serialize)]
pub struct LostReplica {
    pub id: String,
    pub host: String,
    pub pid: u32,
    pub version: String,
    /// When its process started (RFC 3339, its own clock), or its first heartbeat (Redis's
    /// clock) from a replica of an older version.
    pub started: String,
    /// Its last heartbeat (RFC 3339, Redis's clock).
    pub last_seen: String,
    /// When its entry expired: its last heartbeat + [`EXPIRY`] (RFC 3339, Redis's clock).
    pub lost_since: String,
    /// Whether it consumed, as of its last heartbeat.
    pub ready: bool,
    /// Why it did not, and since when, as of its last heartbeat.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<NotReady>,
    /// Its calls in flight, as of its last heartbeat.
    pub in_flight: u64,
    #[serde(skip)]
    lost_ms: i64,
}

/// What a lost replica's last entry says, read leniently: whatever it holds, the replica is
/// listed.
#[derive(Default, Deserialize)]
#[serde(default)]
struct LastKnown {
    host: String,
    pid: u32,
    version: String,
    ready: bool,
    not_ready: Option<NotReady>,
    in_flight: u64,
    process_started_ms: Option<u64>,
}

/// The fleet as one read of the registry shows it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct View {
    /// The live replicas, longest-running first.
    pub replicas: Vec<Replica>,
    /// The replicas lost lately (their entries expired unrenewed; not those that left), the
    /// latest lost first. Their terms do not count.
    pub lost: Vec<LostReplica>,
    /// Whether every live replica (and every one remembered, see [`Remembered`]) was started
    /// with the same terms.
    pub agree: bool,
    /// The terms in force: the strictest of the live replicas' (none without a live replica).
    pub effective: Option<FleetTerms>,
    /// Whether every live replica grants under them already.
    pub applied: bool,
    /// The replicas whose terms still count though their entries vanished from the registry
    /// (see [`Remembered`]), by id.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub remembered: Vec<String>,
    /// Entries that could not be read (skipped; each is logged).
    pub unreadable: usize,
    /// Until when grants under the algorithm in force wait for those under another to leave
    /// their window (RFC 3339, Redis's clock; `None`: they do not wait; see
    /// [`fence_until_ms`]).
    pub algorithm_fence_until: Option<String>,
    /// When the algorithms' record says the current algorithm's grants may start (Redis ms;
    /// 0: at once; see [`fence_until_ms`]).
    #[serde(skip)]
    pub fence_until_ms: i64,
    /// Redis's time of the read, ms.
    #[serde(skip)]
    pub now_ms: i64,
}

/// The strictest of several stacks: every limit of every stack, the lowest count per window,
/// a limit implied by another dropped (see the module's doc), at most [`Limits::MAX`].
pub fn strictest_stack<'a>(stacks: impl IntoIterator<Item = &'a Limits>) -> Option<Limits> {
    let mut all: Vec<Limit> = stacks
        .into_iter()
        .flat_map(|stack| stack.iter().copied())
        .collect();
    if all.is_empty() {
        return None;
    }
    loop {
        all.sort_by_key(|l| (l.window(), l.count()));
        // Implied: another limit allows no more calls over a window at least as long.
        let kept: Vec<Limit> = all
            .iter()
            .enumerate()
            .filter(|(i, l)| {
                !all.iter().enumerate().any(|(j, o)| {
                    j != *i
                        && o.count() <= l.count()
                        && o.window() >= l.window()
                        && (o.count() < l.count() || o.window() > l.window() || j < *i)
                })
            })
            .map(|(_, l)| *l)
            .collect();
        all = kept;
        if all.len() <= Limits::MAX {
            break;
        }
        // Shortest window first, counts rising: merge the two neighbours whose windows are
        // closest (by ratio) into the lower count over the longer window.
        let at = (0..all.len() - 1)
            .min_by(|&a, &b| {
                let ratio = |i: usize| all[i + 1].window_us() as f64 / all[i].window_us() as f64;
                ratio(a).total_cmp(&ratio(b))
            })
            .expect("more than eight limits");
        let merged = Limit::new(all[at].count(), all[at + 1].window())
            .expect("a count and a window of valid limits");
        all.splice(at..=at + 1, [merged]);
    }
    Limits::new(&all).ok()
}

/// Whether the stack `after` is stricter than `before`: different, and implying it (the
/// strictest of the two is `after`).
pub fn lowers(before: &Limits, after: &Limits) -> bool {
    before != after && strictest_stack([before, after]).as_ref() == Some(after)
}

/// How many times stricter than the fleet's a replica's own limits may be (over any window)
/// and still join without `TURNSTILE_ALLOW_STRICTER_TERMS`: a limit lowered tenfold or more in
/// one step is far more often a mistake (a unit, a zero, a shell pointed at production) than a
/// plan, and every seller of the fleet would wait under it.
pub const MOST_STRICTER: f64 = 10.0;

/// The calls `stack` allows at most over `window`.
fn allowed_over(stack: &Limits, window: Duration) -> f64 {
    stack
        .iter()
        .map(|l| f64::from(l.count()) * (window.as_secs_f64() / l.window().as_secs_f64()).ceil())
        .fold(f64::INFINITY, f64::min)
}

/// How many times fewer calls `own` allows than `fleet` over the window where they differ most
/// (at least 1: a looser stack is not stricter), and that window.
pub fn stricter_by(own: &Limits, fleet: &Limits) -> (f64, Duration) {
    own.iter()
        .chain(fleet.iter())
        .map(|l| {
            let w = l.window();
            (allowed_over(fleet, w) / allowed_over(own, w), w)
        })
        .fold((1.0, Duration::ZERO), |most, this| {
            if this.0 > most.0 { this } else { most }
        })
}

/// Why a replica started with `own` terms must not join a fleet granting under `fleet`: its
/// limit stack, or its global limit, allows more than [`MOST_STRICTER`] times fewer calls over
/// some window. `None` when it may join.
pub fn far_stricter(own: &FleetTerms, fleet: &FleetTerms) -> Option<String> {
    let mut stacks = vec![("TURNSTILE_LIMIT", &own.limit, &fleet.limit)];
    if let (Some(own), Some(fleet)) = (&own.global_limit.0, &fleet.global_limit.0) {
        stacks.push(("TURNSTILE_GLOBAL_LIMIT", own, fleet));
    }
    let routes: Vec<(String, &Limits, &Limits)> = own
        .routes
        .iter()
        .filter_map(|(name, stack)| {
            Some((
                format!("route {name} limit"),
                stack,
                fleet.routes.get(name)?,
            ))
        })
        .collect();
    let routes = routes
        .iter()
        .map(|(name, own, fleet)| (name.as_str(), *own, *fleet));
    stacks.into_iter().chain(routes).find_map(|(name, own, fleet)| {
        let (times, window) = stricter_by(own, fleet);
        (times > MOST_STRICTER).then(|| {
            format!(
                "its {name}={own} allows {times:.0} times fewer calls per {} than the fleet's {fleet} (more than {MOST_STRICTER:.0} times): refused, its terms not counted; start it with the fleet's terms, or with TURNSTILE_ALLOW_STRICTER_TERMS=on if the fleet is meant to grant under them",
                humantime::format_duration(window)
            )
        })
    })
}

/// The strictest terms of `members` (each with its first heartbeat, Redis ms, and id):
/// see the module's doc. `None` without a member.
pub fn strictest(members: &[(i64, &str, &FleetTerms)]) -> Option<FleetTerms> {
    let incumbent = members.iter().min_by_key(|(since, id, _)| (*since, *id))?.2;
    let limit = strictest_stack(members.iter().map(|(_, _, t)| &t.limit))?;
    let globals: Vec<&Limits> = members
        .iter()
        .filter_map(|(_, _, t)| t.global_limit.0.as_ref())
        .collect();
    Some(FleetTerms {
        limit,
        algorithm: incumbent.algorithm,
        global_limit: GlobalLimit(strictest_stack(globals)),
        seller_concurrency: SellerConcurrency(
            members
                .iter()
                .filter_map(|(_, _, t)| t.seller_concurrency.0)
                .min(),
        ),
        adaptive: members.iter().any(|(_, _, t)| t.adaptive),
        adaptive_min: members
            .iter()
            .filter(|(_, _, t)| t.adaptive)
            .map(|(_, _, t)| t.adaptive_min)
            .min()
            .unwrap_or(NonZeroU32::MIN),
        routes: strictest_routes(members.iter().map(|(_, _, t)| &t.routes)),
    })
}

/// Every route any of `routes` names, each under the strictest of the stacks given for it.
fn strictest_routes<'a>(
    routes: impl Iterator<Item = &'a BTreeMap<RouteName, Limits>>,
) -> BTreeMap<RouteName, Limits> {
    let mut stacks: BTreeMap<&RouteName, Vec<&Limits>> = BTreeMap::new();
    for (name, stack) in routes.flatten() {
        stacks.entry(name).or_default().push(stack);
    }
    stacks
        .into_iter()
        .filter_map(|(name, stacks)| Some((name.clone(), strictest_stack(stacks)?)))
        .collect()
}

/// When grants under `algorithm` may start, Redis ms (0: at once): once every grant under
/// another algorithm (each last made at most [`EXPIRY`] after the record's time: a replica
/// grants only while its heartbeats are renewed) has left `window` (the stack's longest window
/// and its guard).
pub fn fence_until_ms(
    algorithms: &[(Algorithm, i64)],
    algorithm: Algorithm,
    window: Duration,
) -> i64 {
    algorithms
        .iter()
        .filter(|(other, _)| *other != algorithm)
        .map(|(_, last_ms)| last_ms + (EXPIRY + window).as_millis() as i64)
        .max()
        .unwrap_or(0)
}

/// The longest window of `terms`' stack with its guard (`guard`: `TURNSTILE_LIMIT_GUARD`).
fn longest_window(terms: &FleetTerms, guard: Option<Duration>) -> Duration {
    terms
        .limit
        .iter()
        .chain(terms.global_limit.0.iter().flat_map(Limits::iter))
        .map(|l| l.window() + crate::config::guard_for(guard, l.window()))
        .max()
        .unwrap_or_default()
}

/// The fleet as `roll` shows it (entries that cannot be read are skipped and logged).
pub fn view(roll: &Roll, guard: Option<Duration>) -> View {
    view_remembering(roll, guard, &[])
}

/// A replica whose terms still count though its entry is not in the registry now: it was
/// live lately and neither left nor was found lost (its entry vanished with the registry's key,
/// or with a failover's last writes), so it may still grant under them (see [`Member::beat`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Remembered {
    pub id: String,
    /// Its first heartbeat, as last seen (Redis ms).
    pub since_ms: i64,
    pub terms: FleetTerms,
}

/// The fleet as `roll` shows it, the terms of the `remembered` replicas not live in it counted
/// with the live ones' (see [`Remembered`]; a live one remembered with an earlier start keeps
/// it); refused replicas' terms are not counted.
pub fn view_remembering(roll: &Roll, guard: Option<Duration>, remembered: &[Remembered]) -> View {
    let mut unreadable = 0;
    let mut replicas: Vec<Replica> = roll
        .members
        .iter()
        .filter_map(|member| match replica(member) {
            Ok(replica) => Some(replica),
            Err(error) => {
                unreadable += 1;
                warn!(id = %member.id, %error, "a fleet entry could not be read: skipped");
                None
            }
        })
        .collect();
    for replica in &mut replicas {
        if let Some(seen) = remembered.iter().find(|m| m.id == replica.id)
            && seen.since_ms < replica.since_ms
        {
            replica.since_ms = seen.since_ms;
            if replica.entry.process_started_ms.is_none() {
                replica.started = stamp(seen.since_ms);
            }
        }
    }
    replicas.sort_by(|a, b| (a.since_ms, &a.id).cmp(&(b.since_ms, &b.id)));
    let counted = || replicas.iter().filter(|r| r.entry.refused.is_none());
    let members: Vec<(i64, &str, &FleetTerms)> = counted()
        .map(|r| (r.since_ms, r.id.as_str(), &r.entry.terms))
        .chain(
            remembered
                .iter()
                .filter(|m| !replicas.iter().any(|r| r.id == m.id))
                .map(|m| (m.since_ms, m.id.as_str(), &m.terms)),
        )
        .collect();
    let effective = strictest(&members);
    let digest = effective.as_ref().map(FleetTerms::digest);
    let fence_until_ms = effective.as_ref().map_or(0, |terms| {
        fence_until_ms(
            &roll.algorithms,
            terms.algorithm,
            longest_window(terms, guard),
        )
    });
    let mut lost: Vec<LostReplica> = roll.lost.iter().map(lost_replica).collect();
    lost.sort_by(|a, b| (b.lost_ms, &a.id).cmp(&(a.lost_ms, &b.id)));
    let counted: Vec<&Replica> = counted().collect();
    View {
        remembered: remembered
            .iter()
            .filter(|m| !replicas.iter().any(|r| r.id == m.id))
            .map(|m| m.id.clone())
            .collect(),
        lost,
        // The remembered replicas' terms count: they are compared too.
        agree: members.windows(2).all(|pair| pair[0].2 == pair[1].2),
        applied: digest.is_some()
            && counted
                .iter()
                .all(|r| r.entry.applies.as_deref() == digest.as_deref()),
        replicas,
        effective,
        unreadable,
        algorithm_fence_until: (fence_until_ms > roll.now_ms)
            .then(|| crate::domain::rfc3339(fence_until_ms as u64)),
        fence_until_ms,
        now_ms: roll.now_ms,
    }
}

fn replica(member: &Registered) -> Result<Replica, serde_json::Error> {
    let entry: Entry = serde_json::from_str(&member.entry)?;
    Ok(Replica {
        id: member.id.clone(),
        started: started(entry.process_started_ms, member.since_ms),
        last_seen: stamp(member.last_ms),
        entry,
        since_ms: member.since_ms,
    })
}

/// When a replica started: its process's start (its clock) if its entry says, else its first
/// heartbeat (Redis ms), as the view shows it (RFC 3339).
fn started(process_started_ms: Option<u64>, since_ms: i64) -> String {
    process_started_ms.map_or_else(|| stamp(since_ms), crate::domain::rfc3339)
}

/// A registry time (Redis ms) as the view shows it (RFC 3339).
fn stamp(ms: i64) -> String {
    crate::domain::rfc3339(ms.max(0) as u64)
}

fn lost_replica(member: &Registered) -> LostReplica {
    let last: LastKnown = serde_json::from_str(&member.entry).unwrap_or_default();
    let lost_ms = member.lost_ms.unwrap_or(member.last_ms);
    LostReplica {
        id: member.id.clone(),
        host: last.host,
        pid: last.pid,
        version: last.version,
        started: started(last.process_started_ms, member.since_ms),
        last_seen: stamp(member.last_ms),
        lost_since: stamp(lost_ms),
        ready: last.ready,
        not_ready: last.not_ready,
        in_flight: last.in_flight,
        lost_ms,
    }
}

/// The fleet under `prefix` (operator tools; an expired entry is moved to the lost ones by
/// the read, as by any heartbeat).
pub async fn read(conn: &RedisConn, prefix: &str) -> Result<View, PermitError> {
    let roll = Registry::new(conn.clone(), prefix)
        .read(LOST_RETENTION)
        .await?;
    Ok(view(&roll, None))
}

/// The terms an operator tool reads and changes sellers' state under.
#[derive(Clone, Debug)]
pub struct ToolTerms {
    /// The fleet's terms over the tool's own other settings, or the tool's own settings when
    /// no replica is alive.
    pub limiter: LimiterArgs,
    /// The fleet, when a replica is alive or was lost lately.
    pub fleet: Option<View>,
}

impl ToolTerms {
    /// What a tool says about the terms it used: nothing while they are the fleet's; with no
    /// replica alive, that the figures assume the tool's own settings.
    pub fn note(&self, prefix: &str) -> Option<String> {
        match self.fleet.as_ref().and_then(|f| f.effective.as_ref()) {
            Some(_) => None,
            None => Some(format!(
                "no turnstile replica is alive under key prefix {prefix:?}: the fleet's terms are unknown; figures assume this shell's (TURNSTILE_ALGORITHM={}, TURNSTILE_LIMIT={}, TURNSTILE_GLOBAL_LIMIT={})",
                self.limiter.algorithm, self.limiter.limit, self.limiter.global_limit
            )),
        }
    }
}

/// The terms operator tools use under `prefix`: the fleet's strictest while a replica is alive
/// (whatever the tool's own environment says), else `own`.
pub async fn tool_terms(
    conn: &RedisConn,
    prefix: &str,
    own: LimiterArgs,
) -> Result<ToolTerms, PermitError> {
    let fleet = read(conn, prefix).await?;
    Ok(match &fleet.effective {
        Some(effective) => ToolTerms {
            limiter: effective.apply_to(&own),
            fleet: Some(fleet),
        },
        None => ToolTerms {
            limiter: own,
            fleet: (!fleet.lost.is_empty()).then_some(fleet),
        },
    })
}

/// This replica as a member of the fleet: its entry, its heartbeats, and the terms it applies.
pub struct Member {
    registry: Registry,
    id: String,
    /// Its own settings (the fleet's terms replace their share, see [`FleetTerms::apply_to`]).
    own: LimiterArgs,
    /// Its limiter, whose terms it replaces and whose sellers' backlogs it re-plans.
    permits: PermitStore,
    applied: Arc<Applied>,
    stats: Arc<Stats>,
    ready: Readiness,
    queue: String,
    /// Its host name, read once.
    host: String,
    /// The fleet's share of its own settings, as it announces them.
    own_terms: FleetTerms,
    /// Whether it may join a fleet far looser than its own terms (see [`far_stricter`]).
    allow_stricter: bool,
    state: Mutex<State>,
}

/// A live replica's terms as this member last saw them, and when (see [`Remembered`]).
struct Seen {
    since_ms: i64,
    terms: FleetTerms,
    at: Instant,
    /// Whether its vanishing was logged.
    vanished: bool,
}

/// What a member keeps between heartbeats.
#[derive(Default)]
struct State {
    view: View,
    /// The terms applied and their digest, once applied.
    applied: Option<FleetTerms>,
    /// The terms replaced last, until every operation under them is done: only then is the
    /// digest of the new ones reported.
    replaced: Option<Arc<LimiterArgs>>,
    /// Registered count and when, at the previous heartbeat (for the rate).
    registered: Option<(u64, Instant)>,
    /// Whether the fleet agreed at the last heartbeat (for the log line when that changes).
    agreed: Option<bool>,
    /// The lost replicas listed at the last heartbeat (for the log line when one is lost;
    /// `None` before the first).
    lost: Option<Vec<String>>,
    /// Why this replica's terms were refused, if they were: it never consumes.
    refused: Option<String>,
    /// The counted replicas seen live within [`EXPIRY`], by id: the terms of one whose entry
    /// vanished without leaving or being found lost still count until then.
    seen: std::collections::HashMap<String, Seen>,
    /// This replica's own first heartbeat as the registry last answered it, and when the
    /// registry last lost it (its entry re-created: the key deleted, a failover): while the
    /// registry loses entries, the replicas remembered do not age out.
    own_since: Option<i64>,
    wiped_at: Option<Instant>,
}

impl Member {
    /// A member for a replica with these settings and this limiter (`stats` and `ready`: what
    /// it announces of its work).
    pub fn new(
        permits: &PermitStore,
        prefix: &str,
        own: LimiterArgs,
        stats: Arc<Stats>,
        ready: Readiness,
        queue: &str,
    ) -> Self {
        let host = host_name();
        let mut own = own;
        own.route_limits = permits
            .routes()
            .iter()
            .map(|route| (route.name.clone(), route.limits.clone()))
            .collect();
        let own_terms = FleetTerms::of(&own);
        let id = format!(
            "{host}-{}-{:04x}",
            std::process::id(),
            rand::random::<u16>()
        );
        Self {
            registry: Registry::new(permits.conn().clone(), prefix),
            id,
            own,
            applied: permits.applied().clone(),
            permits: permits.clone(),
            stats,
            ready,
            queue: queue.to_owned(),
            own_terms,
            host,
            allow_stricter: false,
            state: Mutex::default(),
        }
    }

    /// Lets it join a fleet far looser than its own terms (`TURNSTILE_ALLOW_STRICTER_TERMS`).
    pub fn allowing_stricter_terms(mut self, allow: bool) -> Self {
        self.allow_stricter = allow;
        self
    }

    /// Why its terms are refused, if they are.
    pub fn refused(&self) -> Option<String> {
        self.lock().refused.clone()
    }

    /// Its id in the registry.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The fleet as its last heartbeat saw it.
    pub fn view(&self) -> View {
        self.lock().view.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("the fleet member's lock is never poisoned")
    }

    /// The entry to announce now.
    fn entry(&self, state: &mut State) -> Entry {
        let registered = self
            .stats
            .registered
            .load(std::sync::atomic::Ordering::Relaxed);
        let now = Instant::now();
        let registered_per_s = state.registered.map_or(0.0, |(before, at)| {
            let secs = now.duration_since(at).as_secs_f64();
            if secs > 0.0 {
                registered.saturating_sub(before) as f64 / secs
            } else {
                0.0
            }
        });
        state.registered = Some((registered, now));
        // The new terms are reported applied once no operation runs under the replaced ones.
        if state
            .replaced
            .as_ref()
            .is_some_and(|old| Arc::strong_count(old) == 1)
        {
            state.replaced = None;
        }
        Entry {
            host: self.host.clone(),
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            queue: self.queue.clone(),
            terms: self.own_terms.clone(),
            applies: state
                .applied
                .as_ref()
                .filter(|_| state.replaced.is_none())
                .map(FleetTerms::digest),
            ready: self.ready.get(),
            not_ready: self.ready.why(),
            in_flight: self
                .stats
                .in_flight
                .load(std::sync::atomic::Ordering::Relaxed) as u64,
            registered_per_s: (registered_per_s * 10.0).round() / 10.0,
            downstream: Some(self.stats.downstream.summary().brief()),
            refused: state.refused.clone(),
            process_started_ms: Some(crate::domain::process_started_ms()),
        }
    }

    /// One heartbeat: renews the entry, reads the fleet, applies its strictest terms (and the
    /// algorithm's fence), and trusts them until [`TRUST`] after the heartbeat was sent. Whether
    /// Redis answered it is the gauge `turnstile_redis_connected`.
    pub async fn beat(&self) -> Result<View, PermitError> {
        let sent = Instant::now();
        let (entry, algorithm) = {
            let mut state = self.lock();
            let entry = self.entry(&mut state);
            (entry, state.applied.as_ref().map(|t| t.algorithm))
        };
        let entry = serde_json::to_string(&entry).expect("an entry is always JSON");
        let retain = longest_window(&self.own_terms, self.own.guard) + EXPIRY * 2;
        let roll = self
            .registry
            .beat(&self.id, &entry, EXPIRY, algorithm, retain, LOST_RETENTION)
            .await;
        metrics::gauge!("turnstile_redis_connected").set(if roll.is_ok() { 1.0 } else { 0.0 });
        let roll = roll?;
        let mut state = self.lock();
        let remembered = self.remember(&mut state, &roll);
        let view = view_remembering(&roll, self.own.guard, &remembered);
        if let Some(effective) = &view.effective
            && state.applied.as_ref() != Some(effective)
        {
            let old = self.applied.replace_in_force(
                effective.apply_to(&self.own),
                crate::permit::applied::InForce {
                    tag: crate::permit::applied::terms_tag(&effective.digest()),
                    routes: Arc::new(effective.routes.keys().cloned().collect()),
                },
            );
            match &state.applied {
                Some(before) => {
                    info!(from = %before.digest(), to = %effective.digest(), "the fleet's terms changed: granting under the new ones");
                    if lowers(&before.limit, &effective.limit) {
                        self.replan(LimiterArgs::clone(&old));
                    }
                }
                None => info!(terms = %effective.digest(), "granting under the fleet's terms"),
            }
            state.replaced = Some(old);
            state.applied = Some(effective.clone());
        }
        let fence_ahead = view.fence_until_ms > view.now_ms;
        self.applied.fence_until(if fence_ahead {
            view.fence_until_ms * 1000
        } else {
            0
        });
        self.applied.trust_until(sent + TRUST);
        let agrees = view.agree;
        if state.agreed != Some(agrees) {
            if agrees {
                info!(
                    replicas = view.replicas.len(),
                    "the fleet agrees on its terms"
                );
            } else {
                warn!(replicas = view.replicas.len(), effective = %view.effective.as_ref().map_or_else(|| "none".to_owned(), FleetTerms::digest), "the fleet's replicas run with different terms: every grant follows the strictest");
            }
            state.agreed = Some(agrees);
        }
        let lost: Vec<String> = view.lost.iter().map(|r| r.id.clone()).collect();
        if let Some(before) = &state.lost {
            for replica in view.lost.iter().filter(|r| !before.contains(&r.id)) {
                warn!(id = %replica.id, host = %replica.host, last_seen = %replica.last_seen, in_flight = replica.in_flight, "a replica of the fleet stopped renewing its entry (killed, stuck, or cut off from Redis): listed as lost, its terms no longer count");
            }
        }
        state.lost = Some(lost);
        metrics::gauge!("turnstile_fleet_replicas").set(view.replicas.len() as f64);
        metrics::gauge!("turnstile_fleet_disagreement").set(if agrees { 0.0 } else { 1.0 });
        metrics::gauge!("turnstile_fleet_replicas_lost").set(view.lost.len() as f64);
        metrics::gauge!("turnstile_fleet_replicas_not_ready")
            .set(view.replicas.iter().filter(|r| !r.entry.ready).count() as f64);
        state.view = view.clone();
        Ok(view)
    }

    /// Notes the counted live replicas of `roll`, and answers them with those whose terms
    /// still count though their entry is gone: seen within [`EXPIRY`] (or at any time since
    /// the registry last lost this replica's own entry, until it has kept it for [`EXPIRY`]),
    /// neither left nor found lost (their entries vanished otherwise: the registry's key deleted, a failover that lost
    /// its last writes), each with the earliest start seen (a re-created entry keeps its place
    /// as the longest-running). Without them a replica would grant under looser terms, for up to a heartbeat,
    /// as soon as the registry forgot a stricter one; each such vanishing is logged and counted
    /// (`turnstile_fleet_entries_vanished_total`).
    fn remember(&self, state: &mut State, roll: &Roll) -> Vec<Remembered> {
        let now = Instant::now();
        for member in &roll.members {
            if let Ok(replica) = replica(member)
                && replica.entry.refused.is_none()
            {
                let seen = Seen {
                    since_ms: state
                        .seen
                        .get(&member.id)
                        .map_or(member.since_ms, |s| s.since_ms.min(member.since_ms)),
                    terms: replica.entry.terms,
                    at: now,
                    vanished: false,
                };
                state.seen.insert(member.id.clone(), seen);
            }
        }
        let own = roll
            .members
            .iter()
            .find(|m| m.id == self.id)
            .map(|m| m.since_ms);
        if state.own_since.is_some() && own.is_some() && own != state.own_since {
            state.wiped_at = Some(now);
        }
        state.own_since = own;
        // A replica not seen for EXPIRY while the registry kept its entries would have expired
        // anyway; while the registry loses entries (a deletion storm), nothing ages out.
        let intact = state
            .wiped_at
            .is_none_or(|at| now.duration_since(at) >= EXPIRY);
        let gone = |id: &String| {
            roll.left.contains(id) || roll.lost.iter().any(|r| &r.id == id) || *id == self.id
        };
        state
            .seen
            .retain(|id, seen| (now.duration_since(seen.at) < EXPIRY || !intact) && !gone(id));
        state
            .seen
            .iter_mut()
            .map(|(id, seen)| {
                if seen.at != now && !seen.vanished {
                    seen.vanished = true;
                    metrics::counter!("turnstile_fleet_entries_vanished_total").increment(1);
                    warn!(%id, terms = %seen.terms.digest(), "a live replica's fleet entry vanished without its leaving (the registry's key deleted, or a failover lost writes): its terms still count until it would have expired");
                }
                Remembered {
                    id: id.clone(),
                    since_ms: seen.since_ms,
                    terms: seen.terms.clone(),
                }
            })
            .collect()
    }

    /// Re-plans, in the background, the backlogs of the sellers this replica reserved slots for
    /// under the terms `before`, when the fleet's stack was lowered: their reserved slots are
    /// given back, so that the new limit applies at once to the waiting messages, not only to
    /// new ones (each replica re-plans the sellers it reserved for). Without it, the slots
    /// reserved under the looser stack would hold back every new slot until they passed. A
    /// raise leaves the slots where they are (they come back at their time and are granted). The limit never depends on it: a slot reserved under looser
    /// terms is not granted under stricter ones anyway (see `lua/redeem.lua`).
    fn replan(&self, before: LimiterArgs) {
        let permits = self.permits.clone();
        tokio::spawn(async move {
            let sellers = permits.reserving();
            match permits.release_reserved(&before, &sellers).await {
                Ok(n) if n > 0 => {
                    info!(
                        sellers = n,
                        "re-planned the reserved backlogs under the fleet's new terms"
                    )
                }
                Ok(_) => {}
                Err(error) => {
                    warn!(%error, "could not re-plan every reserved backlog under the fleet's new terms; their messages keep their slots where the new terms allow them")
                }
            }
        });
    }

    /// Whether this replica may consume under `view`: every other live replica grants under
    /// the fleet's terms already, and this one does (no operation runs under the terms it
    /// replaced). A replica alone joins at its first heartbeat.
    fn may_consume(&self, view: &View) -> bool {
        let Some(digest) = view.effective.as_ref().map(FleetTerms::digest) else {
            return false;
        };
        let others_apply = view
            .replicas
            .iter()
            .filter(|r| r.id != self.id && r.entry.refused.is_none())
            .all(|r| r.entry.applies.as_deref() == Some(digest.as_str()));
        let state = self.lock();
        let applies_own = state.applied.as_ref().map(FleetTerms::digest) == Some(digest)
            && state
                .replaced
                .as_ref()
                .is_none_or(|old| Arc::strong_count(old) == 1);
        others_apply && applies_own
    }

    /// Beats until every live replica grants under the fleet's terms (this one's included), so
    /// that the replica may consume; `false` if `shutdown` came first. Redis errors are
    /// retried (logged).
    pub async fn join(&self, shutdown: &CancellationToken) -> bool {
        let started = Instant::now();
        let mut said = Instant::now();
        if !self.allow_stricter && !self.check_own_terms(shutdown).await {
            return false;
        }
        loop {
            if self.lock().refused.is_some() {
                // Refused: it stays listed (not ready, why) and never consumes.
                let _ = self.beat().await;
                tokio::select! {
                    () = shutdown.cancelled() => return false,
                    () = tokio::time::sleep(HEARTBEAT) => continue,
                }
            }
            match self.beat().await {
                Ok(view) if self.may_consume(&view) => {
                    info!(replicas = view.replicas.len(), terms = %view.effective.as_ref().map_or_else(|| "none".to_owned(), FleetTerms::digest), waited_ms = started.elapsed().as_millis() as u64, "joined the fleet");
                    return true;
                }
                Ok(view) => {
                    if said.elapsed() >= Duration::from_secs(5) {
                        let waiting: Vec<&str> = view
                            .replicas
                            .iter()
                            .filter(|r| {
                                r.entry.applies != view.effective.as_ref().map(FleetTerms::digest)
                            })
                            .map(|r| r.id.as_str())
                            .collect();
                        warn!(
                            ?waiting,
                            "waiting for the fleet's replicas to apply its terms before consuming"
                        );
                        said = Instant::now();
                    }
                }
                Err(error) => {
                    if said.elapsed() >= Duration::from_secs(5) {
                        warn!(%error, "could not join the fleet's registry; retrying");
                        said = Instant::now();
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep(HEARTBEAT / 5) => {}
            }
        }
    }

    /// Before it announces its terms: refuses them if they are far stricter than those the
    /// live replicas grant under ([`far_stricter`]), said at `/readyz`, in the log and by
    /// `turnstile_fleet_terms_refused`. `false` if `shutdown` came before Redis answered.
    async fn check_own_terms(&self, shutdown: &CancellationToken) -> bool {
        let roll = loop {
            match self.registry.read(LOST_RETENTION).await {
                Ok(roll) => break roll,
                Err(error) => warn!(%error, "could not read the fleet's registry; retrying"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep(HEARTBEAT) => {}
            }
        };
        let fleet = view(&roll, self.own.guard);
        let refused = fleet
            .effective
            .as_ref()
            .and_then(|terms| far_stricter(&self.own_terms, terms));
        metrics::gauge!("turnstile_fleet_terms_refused").set(if refused.is_some() {
            1.0
        } else {
            0.0
        });
        if let Some(why) = refused {
            tracing::error!(own = %self.own_terms.digest(), fleet = %fleet.effective.as_ref().map_or_else(String::new, FleetTerms::digest), "this replica's terms are refused: {why}");
            self.ready.not_ready(format!("terms refused: {why}"));
            self.lock().refused = Some(why);
        }
        true
    }

    /// Beats every [`HEARTBEAT`] until `stop`, then takes the entry out of the registry.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut failing = false;
        loop {
            // Terms just replaced are reported applied as soon as no operation runs under the
            // old ones, not a heartbeat later: a replica waiting to join waits that much less.
            let next = if self.lock().replaced.is_some() {
                REPORT_SOON
            } else {
                HEARTBEAT
            };
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(next) => {}
            }
            match self.beat().await {
                Ok(_) if failing => {
                    info!("the fleet's registry answers again");
                    failing = false;
                }
                Ok(_) => {}
                Err(error) if !failing => {
                    warn!(%error, "could not renew this replica's fleet entry; it stops granting if this lasts");
                    failing = true;
                }
                Err(_) => {}
            }
        }
        self.leave().await;
    }

    /// Takes this replica out of the registry (noting its algorithm's last use); a failure
    /// leaves the entry to expire.
    pub async fn leave(&self) {
        let algorithm = self.lock().applied.as_ref().map(|t| t.algorithm);
        if let Err(error) = self
            .registry
            .leave(&self.id, algorithm, LOST_RETENTION)
            .await
        {
            warn!(%error, "could not take this replica out of the fleet's registry; it expires");
        }
    }
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else `HOSTNAME`, else "unknown").
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(s: &str) -> Limits {
        s.parse().unwrap()
    }

    fn terms(limit: &str, algorithm: Algorithm) -> FleetTerms {
        FleetTerms::of(&LimiterArgs::new(stack(limit), algorithm))
    }

    #[test]
    fn applied_terms_replace_the_fleets_share_and_keep_the_rest() {
        let fleet = FleetTerms {
            global_limit: GlobalLimit(Some(stack("50/1s"))),
            seller_concurrency: SellerConcurrency(NonZeroU32::new(3)),
            adaptive: false,
            adaptive_min: NonZeroU32::new(2).unwrap(),
            routes: [(RouteName::parse("images").unwrap(), stack("2/1s"))].into(),
            ..terms("5/1s", Algorithm::Gcra)
        };
        let own = LimiterArgs {
            guard: Some(Duration::from_millis(7)),
            gcra_burst: 4,
            bucket_capacity: 9,
            permit_block: 5,
            ..LimiterArgs::new(stack("20/1s"), Algorithm::TokenBucket)
        };
        let applied = fleet.apply_to(&own);
        assert_eq!(FleetTerms::of(&applied), fleet);
        assert_eq!(
            (
                applied.guard,
                applied.gcra_burst,
                applied.bucket_capacity,
                applied.permit_block
            ),
            (Some(Duration::from_millis(7)), 4, 9, 5)
        );
        let stacked = terms("5/1s,100/1m", Algorithm::TokenBucket).apply_to(&own);
        assert_eq!(
            stacked.bucket_capacity, 0,
            "a capacity applies to one limit only"
        );
    }

    #[test]
    fn the_strictest_stack_keeps_every_limit_at_its_lowest_count() {
        let s = |stacks: &[&str]| {
            let stacks: Vec<Limits> = stacks.iter().map(|s| stack(s)).collect();
            strictest_stack(&stacks).unwrap().to_string()
        };
        assert_eq!(s(&["20/1s", "10/1s"]), "10/1s");
        assert_eq!(s(&["100/1m", "10/1s"]), "10/1s,100/1m");
        assert_eq!(s(&["100/1m,2000/1d", "50/1m"]), "50/1m,2000/1d");
        // 10 in a minute already allows at most 10 in any second.
        assert_eq!(s(&["20/1s", "10/1m"]), "10/1m");
        assert_eq!(s(&["10/1s", "10/1s"]), "10/1s");
    }

    #[test]
    fn only_a_stricter_stack_lowers_the_terms() {
        assert!(lowers(&stack("20/1s"), &stack("10/1s")));
        assert!(lowers(&stack("100/1m"), &stack("10/1s,100/1m")));
        assert!(!lowers(&stack("10/1s"), &stack("20/1s")));
        assert!(!lowers(&stack("10/1s"), &stack("10/1s")));
        // Neither implies the other: not a lowering of every window.
        assert!(!lowers(&stack("10/1s"), &stack("100/1m")));
    }

    #[test]
    fn a_replica_far_stricter_than_the_fleet_is_refused_and_a_plain_lowering_is_not() {
        let fleet = terms("20/1s", Algorithm::SlidingWindow);
        let refused = |limit: &str| far_stricter(&terms(limit, Algorithm::SlidingWindow), &fleet);
        let why = refused("1/1d").expect("a day's single call against 20 a second");
        assert!(why.contains("1728000 times fewer calls per 1day"), "{why}");
        assert!(why.contains("TURNSTILE_ALLOW_STRICTER_TERMS"), "{why}");
        assert_eq!(refused("10/1s"), None, "halved: a deploy's lowering");
        assert_eq!(refused("2/1s"), None, "ten times: still allowed");
        assert!(refused("1/1s").is_some(), "twenty times stricter");
        assert!(
            refused("20/1s,100/1h").is_some(),
            "a limit the fleet's stack allows 720 times over"
        );
        assert_eq!(refused("40/1s"), None, "looser is never refused");
        assert_eq!(
            stricter_by(&stack("100/1m"), &stack("20/1s")),
            (12.0, Duration::from_secs(60))
        );
        let mut global = terms("20/1s", Algorithm::SlidingWindow);
        global.global_limit = GlobalLimit(Some(stack("1/1m")));
        let mut fleet_global = fleet.clone();
        fleet_global.global_limit = GlobalLimit(Some(stack("1000/1s")));
        assert!(
            far_stricter(&global, &fleet_global)
                .unwrap()
                .contains("TURNSTILE_GLOBAL_LIMIT")
        );
        assert_eq!(
            far_stricter(&global, &fleet),
            None,
            "a global limit the fleet has none of"
        );
    }

    #[test]
    fn a_remembered_replicas_terms_count_until_it_is_live_again_and_keep_its_start() {
        let old = terms("20/1s", Algorithm::SlidingWindow);
        let new = terms("10/1s", Algorithm::Gcra);
        // The registry was deleted: only the old replica beat since, as if it were the first.
        let roll = Roll {
            now_ms: 9_000,
            members: vec![member("old", 8_900, &old, Some(&old))],
            ..Roll::default()
        };
        assert_eq!(
            view(&roll, None).effective.unwrap().limit.to_string(),
            "20/1s"
        );
        let remembered = [
            Remembered {
                id: "new".into(),
                since_ms: 2_000,
                terms: new.clone(),
            },
            Remembered {
                id: "old".into(),
                since_ms: 1_000,
                terms: old.clone(),
            },
        ];
        let fleet = view_remembering(&roll, None, &remembered);
        let effective = fleet.effective.unwrap();
        assert_eq!(
            effective.limit.to_string(),
            "10/1s",
            "the vanished one still counts"
        );
        assert_eq!(
            effective.algorithm,
            Algorithm::SlidingWindow,
            "the old one keeps its start, hence the algorithm"
        );
        assert_eq!(fleet.replicas.len(), 1, "only live replicas are listed");
        assert!(
            !fleet.agree,
            "a remembered replica's other terms are a disagreement"
        );
        assert_eq!(fleet.remembered, ["new"]);
        assert_eq!(fleet.replicas[0].started, stamp(1_000));
    }

    #[test]
    fn more_than_eight_limits_merge_into_stricter_ones() {
        let stacks: Vec<Limits> = (1..=12)
            .map(|i| Limits::single(Limit::new(i * 10, Duration::from_secs(u64::from(i))).unwrap()))
            .collect();
        let merged = strictest_stack(&stacks).unwrap();
        assert!(merged.len() <= Limits::MAX);
        // Every original limit is implied by one of the merged ones.
        for original in stacks.iter().flat_map(|s| s.iter()) {
            assert!(
                merged
                    .iter()
                    .any(|m| m.count() <= original.count() && m.window() >= original.window()),
                "{original} not implied by {merged}"
            );
        }
    }

    #[test]
    fn the_strictest_terms_follow_every_replica_and_the_oldest_ones_algorithm() {
        let mut old = terms("20/1s", Algorithm::Gcra);
        old.global_limit = GlobalLimit(Some(stack("100/1s")));
        let mut new = terms("10/1s", Algorithm::SlidingWindow);
        new.seller_concurrency = SellerConcurrency(NonZeroU32::new(4));
        new.adaptive = false;
        let effective = strictest(&[(2, "b", &new), (1, "a", &old)]).unwrap();
        assert_eq!(effective.limit.to_string(), "10/1s");
        assert_eq!(effective.algorithm, Algorithm::Gcra, "the longest-running");
        assert_eq!(effective.global_limit.to_string(), "100/1s");
        assert_eq!(effective.seller_concurrency.0, NonZeroU32::new(4));
        assert!(effective.adaptive);
        assert_eq!(strictest(&[]), None);
    }

    #[test]
    fn terms_read_back_as_written_and_bad_ones_are_refused() {
        let mut t = terms("100/1m,2000/1d", Algorithm::TokenBucket);
        t.global_limit = GlobalLimit(Some(stack("500/1s")));
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains(r#""limit":"100/1m,2000/1d""#), "{json}");
        assert_eq!(serde_json::from_str::<FleetTerms>(&json).unwrap(), t);
        for bad in [
            r#"{"limit":"0/1s","algorithm":"gcra","global_limit":"off","seller_concurrency":null,"adaptive":true,"adaptive_min":1}"#,
            r#"{"limit":"1/1s","algorithm":"magic","global_limit":"off","seller_concurrency":null,"adaptive":true,"adaptive_min":1}"#,
            r#"{"limit":"1/1s","algorithm":"gcra","global_limit":"off","seller_concurrency":null,"adaptive":true,"adaptive_min":0}"#,
        ] {
            assert!(serde_json::from_str::<FleetTerms>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn another_algorithms_grants_keep_the_new_one_waiting_until_they_left_the_window() {
        let window = Duration::from_secs(60);
        let record = [(Algorithm::Gcra, 1_000), (Algorithm::SlidingWindow, 9_000)];
        let until = fence_until_ms(&record, Algorithm::SlidingWindow, window);
        assert_eq!(until, 1_000 + 5_000 + 60_000);
        assert_eq!(
            fence_until_ms(&record[1..], Algorithm::SlidingWindow, window),
            0
        );
    }

    fn member(
        id: &str,
        since: i64,
        terms: &FleetTerms,
        applies: Option<&FleetTerms>,
    ) -> Registered {
        let entry = Entry {
            host: "h".into(),
            pid: 1,
            version: "0".into(),
            queue: "q".into(),
            terms: terms.clone(),
            applies: applies.map(FleetTerms::digest),
            ready: true,
            not_ready: None,
            in_flight: 0,
            registered_per_s: 0.0,
            downstream: None,
            refused: None,
            process_started_ms: None,
        };
        Registered {
            id: id.into(),
            since_ms: since,
            last_ms: since,
            entry: serde_json::to_string(&entry).unwrap(),
            lost_ms: None,
        }
    }

    #[test]
    fn a_view_says_whether_the_fleet_agrees_and_applies_its_terms() {
        let a = terms("20/1s", Algorithm::SlidingWindow);
        let b = terms("10/1s", Algorithm::SlidingWindow);
        let both = strictest(&[(1, "a", &a), (2, "b", &b)]).unwrap();
        let roll = |applies_a: &FleetTerms| Roll {
            now_ms: 5,
            members: vec![
                member("b", 2, &b, Some(&both)),
                member("a", 1, &a, Some(applies_a)),
                Registered {
                    id: "junk".into(),
                    since_ms: 0,
                    last_ms: 0,
                    entry: "{not json".into(),
                    lost_ms: None,
                },
            ],
            lost: vec![],
            algorithms: vec![],
            left: vec![],
        };
        let waiting = view(&roll(&a), None);
        assert!(!waiting.agree);
        assert!(!waiting.applied, "a still grants under its own");
        assert_eq!(waiting.unreadable, 1);
        assert_eq!(waiting.replicas[0].id, "a", "longest-running first");
        assert_eq!(
            waiting.effective.as_ref().unwrap().limit.to_string(),
            "10/1s"
        );
        assert!(view(&roll(&both), None).applied);
    }

    /// `member`, lost: its entry expired at `lost_ms`, not ready at its last heartbeat.
    fn lost(id: &str, since: i64, terms: &FleetTerms, lost_ms: i64) -> Registered {
        let mut lost = member(id, since, terms, Some(terms));
        let mut entry: Entry = serde_json::from_str(&lost.entry).unwrap();
        entry.ready = false;
        entry.not_ready = Some(NotReady {
            why: "the broker did not answer within 5s".into(),
            since_ms: 1_700_000_000_000,
        });
        lost.entry = serde_json::to_string(&entry).unwrap();
        lost.last_ms = lost_ms - EXPIRY.as_millis() as i64;
        lost.lost_ms = Some(lost_ms);
        lost
    }

    #[test]
    fn a_replica_started_is_when_its_process_started_not_when_it_last_joined() {
        let t = terms("20/1s", Algorithm::SlidingWindow);
        let mut rejoined = member("rejoined", 1_700_000_164_000, &t, Some(&t));
        let mut entry: Entry = serde_json::from_str(&rejoined.entry).unwrap();
        entry.process_started_ms = Some(1_700_000_000_000);
        rejoined.entry = serde_json::to_string(&entry).unwrap();
        let older = member("older-version", 1_700_000_100_000, &t, Some(&t));
        let roll = Roll {
            now_ms: 1_700_000_200_000,
            members: vec![rejoined, older],
            lost: vec![],
            algorithms: vec![],
            left: vec![],
        };
        let fleet = view(&roll, None);
        let started = |id: &str| {
            let r = fleet.replicas.iter().find(|r| r.id == id).unwrap();
            r.started.clone()
        };
        assert_eq!(
            started("rejoined"),
            crate::domain::rfc3339(1_700_000_000_000)
        );
        assert_eq!(started("older-version"), stamp(1_700_000_100_000));
    }

    #[test]
    fn a_lost_replica_is_listed_with_its_last_state_and_its_terms_no_longer_count() {
        let live = terms("20/1s", Algorithm::SlidingWindow);
        let stricter = terms("5/1s", Algorithm::Gcra);
        let roll = Roll {
            now_ms: 1_700_000_100_000,
            members: vec![member("live", 1_700_000_050_000, &live, Some(&live))],
            lost: vec![
                lost("cut-off", 1_700_000_000_000, &stricter, 1_700_000_090_000),
                lost("earlier", 1_700_000_000_000, &stricter, 1_700_000_080_000),
                Registered {
                    id: "junk".into(),
                    since_ms: 1_700_000_000_000,
                    last_ms: 1_700_000_060_000,
                    entry: "{not json".into(),
                    lost_ms: Some(1_700_000_065_000),
                },
            ],
            algorithms: vec![],
            left: vec![],
        };
        let fleet = view(&roll, None);
        assert_eq!(fleet.replicas.len(), 1);
        assert!(fleet.agree, "a lost replica's terms are not compared");
        assert!(fleet.applied);
        let effective = fleet.effective.as_ref().unwrap();
        assert_eq!(
            effective.limit.to_string(),
            "20/1s",
            "a lost replica's terms do not apply"
        );
        assert_eq!(effective.algorithm, Algorithm::SlidingWindow);
        let ids: Vec<&str> = fleet.lost.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["cut-off", "earlier", "junk"], "the latest lost first");
        let cut_off = &fleet.lost[0];
        assert_eq!(cut_off.host, "h");
        assert_eq!(
            cut_off.lost_since,
            crate::domain::rfc3339(1_700_000_090_000)
        );
        assert_eq!(cut_off.last_seen, crate::domain::rfc3339(1_700_000_085_000));
        assert_eq!(cut_off.started, crate::domain::rfc3339(1_700_000_000_000));
        assert!(!cut_off.ready);
        assert_eq!(
            cut_off.not_ready.as_ref().map(|n| n.why.as_str()),
            Some("the broker did not answer within 5s")
        );
        assert_eq!(
            fleet.unreadable, 0,
            "a lost entry is listed whatever it holds"
        );
        let json = serde_json::to_value(&fleet).unwrap();
        assert_eq!(json["lost"][0]["id"], "cut-off");
        assert_eq!(
            json["lost"][0]["not_ready"]["why"],
            "the broker did not answer within 5s"
        );
        assert!(json["lost"][0].get("lost_ms").is_none());
        assert!(
            json["replicas"][0].get("not_ready").is_none(),
            "absent while ready"
        );

        // Lost alone: no terms in force.
        let alone = view(
            &Roll {
                members: vec![],
                ..roll
            },
            None,
        );
        assert!(alone.effective.is_none());
        assert_eq!(alone.lost.len(), 3);
    }

    #[test]
    fn an_entry_of_an_older_replica_without_readiness_reasons_is_read() {
        let mut json = serde_json::to_value(Entry {
            host: "h".into(),
            pid: 1,
            version: "0".into(),
            queue: "q".into(),
            terms: terms("10/1s", Algorithm::Gcra),
            applies: None,
            ready: false,
            not_ready: None,
            in_flight: 0,
            registered_per_s: 0.0,
            downstream: None,
            refused: None,
            process_started_ms: None,
        })
        .unwrap();
        assert!(json.get("not_ready").is_none());
        json.as_object_mut().unwrap().remove("downstream");
        let entry: Entry = serde_json::from_value(json.clone()).unwrap();
        assert!(entry.not_ready.is_none());
        json["not_ready"] = serde_json::json!({"why": "Redis did not answer", "since_ms": 7});
        let entry: Entry = serde_json::from_value(json).unwrap();
        assert_eq!(entry.not_ready.unwrap().since_ms, 7);
    }
}
