//! `turnstile mock-api`: a strict stand-in for the product-registration API, used by tests,
//! benchmarks and the demo.
//!
//! Endpoints:
//! - `POST /register/{seller}`: registers the JSON object in the body. Requires
//!   `Content-Type: application/json` and `Idempotency-Key`; the seller counted is
//!   `X-Seller-Id` verbatim (percent-encoded UTF-8 for non-ASCII ids), or else the path segment
//!   encoded the same way. Enforces an exact sliding window per seller on the server's own
//!   monotonic clock, for every limit of its stack (`--limit 6/1s,20/5s`), in units: a
//!   registration whose product has an integer `"cost"` of at least 1 takes that many units,
//!   any other one unit. `200 {"registered": true, "id": KEY}` while every limit's trailing
//!   window has room for the request's units, otherwise `429` with `Retry-After` (a violation).
//!   An already accepted key is replayed with `200` and counted as a duplicate, not again.
//!   With `--global-limit`, every seller's registrations together are held to that stack as
//!   strictly (a request over it is a `429` and a violation, counted in `global_violations`).
//!   Each seller's most requests in flight at once is recorded (`max_in_flight`), and the
//!   headers of the last [`RECENT_REQUESTS`] requests ([`MockServer::recent_requests`]).
//! - `POST|PUT|PATCH|DELETE /routes/{route}/{seller}` (with `--route NAME=LIMIT`): the same
//!   request to one of several endpoints of one provider. Each route holds each seller to its
//!   own stack (`LIMIT`), and every request of a seller, on any route or on `/register`, is also
//!   held to `--limit` (the seller's budget over all of them), as strictly: a request over
//!   either is a `429` and a violation (a route's are counted in its [`RouteStats`] too).
//! - With `--cost-header NAME`, a product's integer `"charge"` (0 or more) is what the request
//!   really costs: its units are counted at that charge instead of its `cost` (checked at the
//!   `cost` on arrival, as a provider that charges a query's requested cost and refunds down to
//!   its actual cost), and the answer says so in header NAME. A charge above the `cost` may so
//!   take a window over the limit: each such registration is counted in
//!   [`SellerStats::over_limit`].
//! - With `--bulk call|row`, a body that is a JSON array of products (or that array under
//!   `--bulk-items`) is a bulk call: held to the limits as one request of one unit (`call`) or
//!   of the sum of its rows' units (`row`), refused whole with a `429` (a violation) when over,
//!   else answered `200` with one entry per row in order (`{"status": …, "registered": true,
//!   "id": KEY}`, with the row's `--bulk-id-field` when it has one). A row's key is its
//!   `--bulk-id-field` value (else the call's Idempotency-Key and its index); each row is
//!   registered (or replayed, counted as a duplicate) on its own. A row's `"mock"` script
//!   answers its entry by attempt, and `"garble": N` makes the first N bulk calls carrying it
//!   answer `200` with an entry missing, registering nothing ([`Stats::garbled`]), or with
//!   `"whole": STATUS` answer the whole call with that status. With
//!   `--fail-rate`, a bulk call is answered `503` whole at that rate.
//! - `GET /stats`: [`Stats`] as JSON. `POST /reset`: forgets everything and restarts the clock.
//!
//! A product object with a `"mock"` object scripts its answers by attempt, for tests:
//! `{"mock": {"statuses": [503, 503, 200], "delay_ms": 0, "retry_after": "2"}}` answers the
//! n-th request with that Idempotency-Key with `statuses[n]` (the last one repeats), after
//! `delay_ms`, with `Retry-After: retry_after` on a 429 and `Location: /login` on a 3xx (the
//! login page answers 200, as an SSO proxy's would). A scripted 2xx goes through the limit
//! check and registration like any request; a scripted non-2xx is counted in
//! [`Stats::scripted`] only. Scripted requests are exempt from `--fail-rate`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use turnstile_core::config::Limits;
use turnstile_core::domain::SellerId;

/// Settings of the mock registration API (`turnstile mock-api`).
#[derive(clap::Args, Clone, Debug)]
pub struct MockArgs {
    /// Per-seller limit the mock enforces, COUNT/DURATION (e.g. 20/1s, 100/1m), or a
    /// comma-separated stack that must all hold (e.g. 6/1s,20/5s), in units (see the module docs).
    #[arg(long, default_value = "20/1s", value_parser = turnstile_core::config::limits_arg)]
    pub limit: Limits,
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: SocketAddr,
    /// Milliseconds added to every response (after the decision, which is made on arrival).
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Fraction of requests (0 to 1) answered 503 at random, before the limit check.
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub fail_rate: f64,
    /// Fraction of requests (0 to 1), at random, that reach the API late: held --slow-ms before
    /// they are counted (a new connection, a TLS handshake, a pause on the way).
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub slow_rate: f64,
    /// How late a slow request (--slow-rate) is counted, in ms.
    #[arg(long, default_value_t = 300)]
    pub slow_ms: u64,
    /// A limit (or stack) over every seller's registrations together, in units, enforced as
    /// strictly as the per-seller one (a request over it is a 429 and a violation).
    #[arg(long = "global-limit", value_parser = turnstile_core::config::limits_arg)]
    pub global_limit: Option<Limits>,
    /// Rate-limit headers sent with every 200 and 429, for the seller's first limit: `x`
    /// (`X-RateLimit-Limit`, `-Remaining`, `-Reset` in seconds), `ietf` (`RateLimit-Policy:
    /// "default";q=COUNT;w=SECONDS` and `RateLimit: "default";r=REMAINING;t=SECONDS`) or `none`.
    #[arg(long = "rate-limit-headers", value_enum, default_value_t = RateLimitForm::None)]
    pub rate_limit_headers: RateLimitForm,
    /// Answer a 429 without `Retry-After`.
    #[arg(long = "no-retry-after")]
    pub no_retry_after: bool,
    /// A route `NAME=LIMIT` (repeatable): `/routes/NAME/{seller}` holds each seller to LIMIT (a
    /// stack, in units) as well as to `--limit`.
    #[arg(long = "route", value_parser = route_limit_arg)]
    pub routes: Vec<(String, Limits)>,
    /// Report a request's real cost (its product's `"charge"`) in this response header.
    #[arg(long = "cost-header")]
    pub cost_header: Option<String>,
    /// Take bulk calls (a JSON array of products, see the module docs), each counted as one
    /// unit (`call`) or as its rows' units (`row`).
    #[arg(long = "bulk", value_enum)]
    pub bulk: Option<BulkCount>,
    /// The field of a bulk call's JSON object that holds its rows (without it, a bare array).
    #[arg(long = "bulk-items")]
    pub bulk_items: Option<String>,
    /// The field that names a bulk row (its key, and its answer's entry).
    #[arg(long = "bulk-id-field", default_value = "message_id")]
    pub bulk_id_field: String,
}

/// How the mock counts a bulk call (`--bulk`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkCount {
    /// One unit per call.
    Call,
    /// The sum of the rows' units.
    Row,
}

/// `--route NAME=LIMIT`.
fn route_limit_arg(s: &str) -> Result<(String, Limits), String> {
    let (name, limit) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=LIMIT"))?;
    let limit = turnstile_core::config::limits_arg(limit)?;
    Ok((name.to_owned(), limit))
}

/// Which rate-limit headers the mock sends (see [`MockArgs::rate_limit_headers`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RateLimitForm {
    #[default]
    None,
    X,
    Ietf,
}

/// A seller's quota under the mock's first limit, as its rate-limit headers tell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QuotaView {
    form: RateLimitForm,
    limit: u64,
    window_secs: u64,
    remaining: u64,
    /// Whole seconds (rounded up) until the oldest unit in the window leaves it; 0 if none.
    reset_secs: u64,
}

impl QuotaView {
    fn of(
        form: RateLimitForm,
        times: &VecDeque<(Instant, u32)>,
        limits: &Limits,
        now: Instant,
    ) -> Self {
        let first = limits
            .iter()
            .next()
            .expect("a stack holds at least one limit");
        let window = first.window();
        let in_window = times.iter().filter(|(t, _)| now - *t < window);
        let held: u64 = in_window.clone().map(|(_, u)| u64::from(*u)).sum();
        let reset = in_window
            .map(|(t, _)| (*t + window).saturating_duration_since(now))
            .next()
            .unwrap_or_default();
        Self {
            form,
            limit: u64::from(first.count()),
            window_secs: window.as_secs().max(1),
            remaining: u64::from(first.count()).saturating_sub(held),
            reset_secs: u64::try_from(reset.as_nanos().div_ceil(1_000_000_000)).unwrap_or(u64::MAX),
        }
    }

    fn write(self, headers: &mut HeaderMap) {
        let mut put = |name: &'static str, value: String| {
            if let Ok(value) = HeaderValue::from_str(&value) {
                headers.insert(name, value);
            }
        };
        match self.form {
            RateLimitForm::None => {}
            RateLimitForm::X => {
                put("x-ratelimit-limit", self.limit.to_string());
                put("x-ratelimit-remaining", self.remaining.to_string());
                put("x-ratelimit-reset", self.reset_secs.to_string());
            }
            RateLimitForm::Ietf => {
                put(
                    "ratelimit-policy",
                    format!("\"default\";q={};w={}", self.limit, self.window_secs),
                );
                put(
                    "ratelimit",
                    format!("\"default\";r={};t={}", self.remaining, self.reset_secs),
                );
            }
        }
    }
}

impl MockArgs {
    /// A mock enforcing `limit` on a free loopback port, answering at once, never failing.
    pub fn local(limit: impl Into<Limits>) -> Self {
        Self {
            limit: limit.into(),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            latency_ms: 0,
            fail_rate: 0.0,
            slow_rate: 0.0,
            slow_ms: 300,
            global_limit: None,
            rate_limit_headers: RateLimitForm::None,
            no_retry_after: false,
            routes: Vec::new(),
            cost_header: None,
            bulk: None,
            bulk_items: None,
            bulk_id_field: "message_id".into(),
        }
    }
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|f| (0.0..=1.0).contains(f))
        .ok_or_else(|| format!("{s:?} is not a fraction from 0 to 1"))
}

/// Counters of everything the mock saw since it started or was last reset.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    /// Every `POST /register/…` request, whatever its answer (including 400s).
    pub requests: u64,
    /// Registrations accepted for the first time (duplicates excluded).
    pub registered: u64,
    /// Requests refused with 429 because the seller's window was full.
    pub violations: u64,
    /// Requests refused with 429 because the global limit's window was full (`--global-limit`;
    /// also counted in `violations`).
    #[serde(default)]
    pub global_violations: u64,
    /// The most units of accepted registrations, every seller's together, seen in any
    /// trailing window of the global stack's first limit (never above its COUNT).
    #[serde(default)]
    pub max_global_in_window: u64,
    /// Requests replaying an Idempotency-Key that was already accepted.
    pub duplicates: u64,
    /// The first [`MOST_REPEATS`] of those replays: which key, and when it was accepted and
    /// repeated (what tells a call made while the first was in flight from a record missed).
    #[serde(default)]
    pub repeats: Vec<Repeat>,
    /// Requests answered 503 by `--fail-rate`.
    pub injected_failures: u64,
    /// Requests answered with a scripted non-2xx status.
    pub scripted: u64,
    /// Bulk calls received (also counted in `requests`), and the rows they carried.
    #[serde(default)]
    pub bulk_calls: u64,
    #[serde(default)]
    pub bulk_rows: u64,
    /// Bulk calls answered with an entry missing (a row's `"garble"`).
    #[serde(default)]
    pub garbled: u64,
    /// The mock's clock when this snapshot was taken (ms since start or reset), the clock of
    /// `first_ms` and `last_ms`.
    #[serde(default)]
    pub now_ms: u64,
    /// Per-seller counters, keyed by the seller as counted (see the module docs).
    pub sellers: BTreeMap<String, SellerStats>,
    /// Per-route counters (`--route`), keyed by the route's name.
    #[serde(default)]
    pub routes: BTreeMap<String, RouteStats>,
}

/// How many replays [`Stats::repeats`] keeps.
pub const MOST_REPEATS: usize = 20;

/// One replay of an accepted Idempotency-Key.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Repeat {
    pub key: String,
    pub seller: String,
    /// When the key was first accepted and when it came again, in ms (the clock of
    /// `first_ms`).
    pub accepted_ms: u64,
    pub again_ms: u64,
}

/// Counters of one route (`--route`), every seller's together.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RouteStats {
    /// Requests the route received, whatever their answer.
    pub requests: u64,
    /// Registrations accepted for the first time on the route.
    pub registered: u64,
    /// Requests refused with 429 because the seller's window of the route was full (also
    /// counted in [`Stats::violations`]).
    pub violations: u64,
    /// The most units of one seller's accepted requests seen in any trailing window of the
    /// route's first limit (never above its COUNT).
    pub max_in_window: u64,
    /// Units of the requests accepted, as charged.
    pub units: u64,
    /// Milliseconds from the server's start (or last reset) to the route's first and last
    /// accepted request.
    #[serde(default)]
    pub first_ms: Option<u64>,
    #[serde(default)]
    pub last_ms: Option<u64>,
}

/// Counters of one seller.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SellerStats {
    /// Registrations accepted for the first time.
    pub registered: u64,
    /// Requests refused with 429.
    pub violations: u64,
    /// Replays of an already accepted Idempotency-Key.
    pub duplicates: u64,
    /// Milliseconds from the server's start (or last reset) to the first accepted registration.
    pub first_ms: Option<u64>,
    /// Milliseconds from the server's start (or last reset) to the last accepted registration.
    pub last_ms: Option<u64>,
    /// The most units of accepted registrations seen in any trailing window of the stack's
    /// first (shortest) limit (never above its COUNT, but with `--cost-header`: a request is
    /// checked at its `cost` and counted at its `charge`).
    pub max_in_window: u64,
    /// Accepted registrations whose charge (`--cost-header`) left the trailing window of the
    /// stack's first limit, with them counted, over its COUNT: the windows over the limit that
    /// the mock let through because it checks a request at its `cost`.
    #[serde(default)]
    pub over_limit: u64,
    /// Units of the registrations accepted (one per registration without a `cost`).
    #[serde(default)]
    pub units: u64,
    /// The most requests of the seller in flight at once (arrived, not yet answered).
    #[serde(default)]
    pub max_in_flight: u64,
    /// The first requests refused with 429 (at most [`MOST_VIOLATIONS_KEPT`]): when each arrived
    /// and its Idempotency-Key, so that a test that sees a violation can say which call it was.
    #[serde(default)]
    pub first_violations: Vec<Violation>,
    /// Of each product whose registrations carry a string `sku` and an integer `version`, the
    /// version of the last one accepted: what the API holds for it now (at most
    /// [`MOST_PRODUCTS_KEPT`] products).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub versions: BTreeMap<String, i64>,
}

/// How many of a seller's refused requests [`SellerStats::first_violations`] keeps.
pub const MOST_VIOLATIONS_KEPT: usize = 16;

/// How many products' versions [`SellerStats::versions`] keeps.
pub const MOST_PRODUCTS_KEPT: usize = 10_000;

/// A request the mock refused with 429.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Violation {
    /// Milliseconds from the server's start (or last reset) to its arrival.
    pub at_ms: u64,
    /// Its Idempotency-Key.
    pub key: String,
}

/// How many of the latest requests' headers the mock keeps ([`MockServer::recent_requests`]).
pub const RECENT_REQUESTS: usize = 1_000;

/// One request as the mock received it: its headers, names in lowercase, values as text
/// (lossy), in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenRequest {
    pub headers: Vec<(String, String)>,
}

impl SeenRequest {
    fn of(headers: &HeaderMap) -> Self {
        let headers = headers
            .iter()
            .map(|(name, value)| {
                let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                (name.as_str().to_owned(), value)
            })
            .collect();
        Self { headers }
    }

    /// The first value of header `name` (lowercase), if the request had one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A running mock API.
pub struct MockServer {
    addr: SocketAddr,
    app: Arc<App>,
    task: JoinHandle<std::io::Result<()>>,
}

impl MockServer {
    /// Binds `args.addr`, starts serving in the background and returns at once. The server
    /// stops when `shutdown` is cancelled; responses still sleeping are then sent at once.
    pub async fn start(args: MockArgs, shutdown: CancellationToken) -> anyhow::Result<MockServer> {
        anyhow::ensure!(
            (0.0..=1.0).contains(&args.fail_rate) && (0.0..=1.0).contains(&args.slow_rate),
            "--fail-rate and --slow-rate must be fractions from 0 to 1, got {} and {}",
            args.fail_rate,
            args.slow_rate
        );
        let listener = tokio::net::TcpListener::bind(args.addr)
            .await
            .with_context(|| format!("mock-api cannot listen on {}", args.addr))?;
        let addr = listener.local_addr()?;
        let app = Arc::new(App {
            limit: args.limit.clone(),
            global_limit: args.global_limit.clone(),
            rate_limit_headers: args.rate_limit_headers,
            no_retry_after: args.no_retry_after,
            latency: Duration::from_millis(args.latency_ms),
            fail_rate: args.fail_rate,
            slow_rate: args.slow_rate,
            slow: Duration::from_millis(args.slow_ms),
            shutdown: shutdown.clone(),
            routes: args.routes.iter().cloned().collect(),
            cost_header: args.cost_header.clone(),
            bulk: args
                .bulk
                .map(|count| (count, args.bulk_items.clone(), args.bulk_id_field.clone())),
            state: Mutex::new(Ledger::new()),
        });
        let router = Router::new()
            .route("/register/{seller}", post(register))
            .route(
                "/routes/{route}/{seller}",
                post(on_route)
                    .put(on_route)
                    .patch(on_route)
                    .delete(on_route),
            )
            .route("/stats", get(stats))
            .route("/login", get(login).post(login))
            .route("/reset", post(reset))
            .with_state(app.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        });
        tracing::info!(%addr, limit = %args.limit, latency_ms = args.latency_ms,
            fail_rate = args.fail_rate, "mock registration API listening");
        Ok(MockServer { addr, app, task })
    }

    /// The address actually bound (with the chosen port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The registration URL template, `http://ADDR/register/{seller_id}`, for
    /// `TURNSTILE_DOWNSTREAM_URL`; an unspecified listen address becomes loopback.
    pub fn url(&self) -> String {
        let mut addr = self.addr;
        if addr.ip().is_unspecified() {
            addr.set_ip(match addr.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        format!("http://{addr}/register/{{seller_id}}")
    }

    /// A route's URL template (`--route`), `http://ADDR/routes/NAME/{seller_id}`, for a routes
    /// file.
    pub fn route_url(&self, route: &str) -> String {
        self.url()
            .replace("/register/", &format!("/routes/{route}/"))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.app.lock().snapshot()
    }

    /// The last [`RECENT_REQUESTS`] `POST /register/…` requests (every one, whatever its
    /// answer), oldest first.
    pub fn recent_requests(&self) -> Vec<SeenRequest> {
        self.app.lock().recent.iter().cloned().collect()
    }

    /// Waits until `shutdown` is cancelled and the server has stopped.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task
            .await
            .context("mock-api server task failed")?
            .context("mock-api server failed")
    }
}

/// Fetches [`Stats`] from a mock running elsewhere. `base` is `http://HOST:PORT` (a bare
/// `HOST:PORT` or the [`MockServer::url`] template are accepted too).
pub async fn fetch_stats(base: &str) -> anyhow::Result<Stats> {
    let mut base = base.trim();
    if let Some(i) = base.find("/register/") {
        base = &base[..i];
    }
    let base = base.trim_end_matches('/');
    let url = if base.contains("://") {
        format!("{base}/stats")
    } else {
        format!("http://{base}/stats")
    };
    let response = reqwest::get(&url)
        .await
        .with_context(|| format!("cannot reach the mock API at {url}"))?
        .error_for_status()
        .with_context(|| format!("{url} answered with an error"))?;
    response
        .json::<Stats>()
        .await
        .with_context(|| format!("{url} did not answer with mock statistics"))
}

/// Whether `units` more fit every limit of `limits` now, given the accepted registrations
/// `times` (when, and their units; those older than the longest window are dropped): `None`
/// if they fit, else how long until the oldest that must leave for them has left; and the
/// units the first (shortest) limit's window would hold with them.
fn room_for(
    times: &mut VecDeque<(Instant, u32)>,
    limits: &Limits,
    now: Instant,
    units: u32,
) -> (Option<Duration>, u64) {
    let longest = limits.iter().map(|l| l.window()).max().unwrap_or_default();
    while times.front().is_some_and(|&(t, _)| now - t >= longest) {
        times.pop_front();
    }
    let mut wait = None::<Duration>;
    let mut first_window_units = 0;
    for (i, limit) in limits.iter().enumerate() {
        let window = limit.window();
        // A calendar limit's window started at its last reset (on the wall clock) and ends at
        // the next; a sliding one is the trailing window.
        let (starts, ends_in) = match limit.reset() {
            Some(reset) => {
                let wall_us = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_micros() as u64;
                let window_us = limit.window_us();
                let since = (wall_us + window_us - reset.phase_us() % window_us) % window_us;
                let since = Duration::from_micros(since);
                (
                    Some(now.checked_sub(since).unwrap_or(now)),
                    Some(window - since),
                )
            }
            None => (None, None),
        };
        let in_window: Vec<&(Instant, u32)> = times
            .iter()
            .filter(|(t, _)| match starts {
                Some(start) => *t >= start,
                None => now - *t < window,
            })
            .collect();
        let held: u64 = in_window.iter().map(|(_, u)| u64::from(*u)).sum();
        if i == 0 {
            first_window_units = held + u64::from(units);
        }
        let excess = (held + u64::from(units)).saturating_sub(u64::from(limit.count()));
        if let Some(ends_in) = ends_in.filter(|_| excess > 0) {
            wait = Some(wait.map_or(ends_in, |x: Duration| x.max(ends_in)));
        } else if excess > 0 {
            let mut left = excess;
            let mut leaves = now;
            for (t, u) in &in_window {
                leaves = *t + window;
                if u64::from(*u) >= left {
                    break;
                }
                left -= u64::from(*u);
            }
            let w = leaves.saturating_duration_since(now);
            wait = Some(wait.map_or(w, |x: Duration| x.max(w)));
        }
    }
    (wait, first_window_units)
}

struct App {
    limit: Limits,
    global_limit: Option<Limits>,
    rate_limit_headers: RateLimitForm,
    no_retry_after: bool,
    latency: Duration,
    fail_rate: f64,
    slow_rate: f64,
    slow: Duration,
    shutdown: CancellationToken,
    /// Each route's per-seller stack (`--route`).
    routes: HashMap<String, Limits>,
    cost_header: Option<String>,
    /// Bulk calls taken, and how they are counted (`--bulk`, `--bulk-items`,
    /// `--bulk-id-field`).
    bulk: Option<(BulkCount, Option<String>, String)>,
    state: Mutex<Ledger>,
}

impl App {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Ledger {
    epoch: Instant,
    /// The wall clock at `epoch` (see [`Ledger::now`]).
    epoch_wall: std::time::SystemTime,
    /// The latest [`Ledger::now`] handed out: never goes back.
    latest: Instant,
    /// Per seller, the accepted registrations of the longest window: when, and their units.
    windows: HashMap<String, VecDeque<(Instant, u32)>>,
    /// Every seller's accepted registrations of the global limit's longest window.
    global_times: VecDeque<(Instant, u32)>,
    /// Per route and seller, the accepted requests of the route's longest window.
    route_windows: HashMap<(String, String), VecDeque<(Instant, u32)>>,
    /// Per seller, requests arrived and not yet answered.
    in_flight: HashMap<String, u64>,
    /// Every accepted Idempotency-Key, and when it was accepted (ms, the clock of `first_ms`).
    accepted: HashMap<String, u64>,
    attempts: HashMap<String, usize>,
    stats: Stats,
    /// The last [`RECENT_REQUESTS`] requests.
    recent: VecDeque<SeenRequest>,
}

impl Ledger {
    fn snapshot(&self) -> Stats {
        Stats {
            now_ms: self.wall_now().duration_since(self.epoch).as_millis() as u64,
            ..self.stats.clone()
        }
    }

    /// Now on the wall clock, on the ledger's axis (`epoch` + the wall time since it), never
    /// before the latest now handed out. The API counts its windows on its own wall clock, as a
    /// real one does (NTP-disciplined, as Redis's is, whose TIME the limiter counts on): a machine
    /// whose wall clock runs at another rate than its monotonic one (a VM's, seen running 0.5%
    /// fast for a while) would otherwise have the mock count a window Redis measured as one
    /// second as shorter, and report calls spaced exactly by the limit as violations.
    fn wall_now(&self) -> Instant {
        let elapsed = std::time::SystemTime::now()
            .duration_since(self.epoch_wall)
            .unwrap_or_default();
        (self.epoch + elapsed).max(self.latest)
    }

    /// [`Self::wall_now`], noted as the latest.
    fn now(&mut self) -> Instant {
        self.latest = self.wall_now();
        self.latest
    }

    fn new() -> Self {
        let epoch = Instant::now();
        Self {
            epoch,
            epoch_wall: std::time::SystemTime::now(),
            latest: epoch,
            windows: HashMap::new(),
            global_times: VecDeque::new(),
            route_windows: HashMap::new(),
            in_flight: HashMap::new(),
            accepted: HashMap::new(),
            attempts: HashMap::new(),
            stats: Stats::default(),
            recent: VecDeque::new(),
        }
    }
}

/// A test's scripted answers, from the product's `"mock"` object.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Script {
    statuses: Vec<u16>,
    /// The first this many bulk calls carrying the row answer with an entry missing (or
    /// whole with the status `whole`).
    #[serde(default)]
    garble: usize,
    #[serde(default)]
    whole: Option<u16>,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    retry_after: Option<String>,
}

struct ValidScript {
    statuses: Vec<StatusCode>,
    garble: usize,
    whole: Option<StatusCode>,
    delay: Duration,
    retry_after: Option<HeaderValue>,
}

struct Request {
    seller: String,
    key: String,
    /// The product's `cost` (a positive integer), else 1.
    units: u32,
    /// With `--cost-header`, the product's `charge` (an integer >= 0): the units counted.
    charge: Option<u32>,
    /// The route requested (`/routes/{route}/…`), if any.
    route: Option<String>,
    script: Option<ValidScript>,
    /// The product's string `sku` and integer `version`, when it carries both.
    version: Option<(String, i64)>,
}

enum Answer {
    Registered {
        status: StatusCode,
        id: String,
        quota: Option<QuotaView>,
        /// The units charged, reported in `--cost-header`.
        charged: Option<(String, u32)>,
    },
    Limited {
        retry_after_secs: Option<u64>,
        quota: Option<QuotaView>,
    },
    Injected,
    Scripted {
        status: StatusCode,
        retry_after: Option<HeaderValue>,
    },
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

fn parse_request(path_seller: &str, headers: &HeaderMap, body: &[u8]) -> Result<Request, String> {
    let content_type = headers
        .get(CONTENT_TYPE)
        .ok_or("missing Content-Type: application/json")?
        .to_str()
        .map_err(|_| "Content-Type is not ASCII")?;
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    if !essence.eq_ignore_ascii_case("application/json") {
        return Err(format!(
            "Content-Type must be application/json, got {content_type:?}"
        ));
    }
    let key = headers
        .get("idempotency-key")
        .ok_or("missing Idempotency-Key")?
        .to_str()
        .map_err(|_| "Idempotency-Key must be ASCII (percent-encoded UTF-8)")?;
    if key.is_empty() {
        return Err("empty Idempotency-Key".into());
    }
    let seller = match headers.get("x-seller-id") {
        Some(value) => {
            let value = value
                .to_str()
                .map_err(|_| "X-Seller-Id must be ASCII (percent-encoded UTF-8)")?;
            if value.is_empty() {
                return Err("empty X-Seller-Id".into());
            }
            value.to_owned()
        }
        None => SellerId::parse(path_seller)
            .map(|id| id.header_value())
            .unwrap_or_else(|_| path_seller.to_owned()),
    };
    let product: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| format!("the body must be a JSON object: {e}"))?;
    let script = match product.get("mock") {
        Some(mock @ Value::Object(_)) => Some(validate_script(mock)?),
        _ => None,
    };
    let units = product
        .get("cost")
        .and_then(Value::as_u64)
        .and_then(|c| u32::try_from(c).ok())
        .filter(|c| *c >= 1)
        .unwrap_or(1);
    let charge = product
        .get("charge")
        .and_then(Value::as_u64)
        .and_then(|c| u32::try_from(c).ok());
    let version = match (product.get("sku"), product.get("version")) {
        (Some(Value::String(sku)), Some(version)) => version.as_i64().map(|v| (sku.clone(), v)),
        _ => None,
    };
    Ok(Request {
        seller,
        key: key.to_owned(),
        units,
        charge,
        route: None,
        script,
        version,
    })
}

fn validate_script(mock: &Value) -> Result<ValidScript, String> {
    let script = Script::deserialize(mock).map_err(|e| format!("invalid mock script: {e}"))?;
    if script.statuses.is_empty() {
        return Err("invalid mock script: statuses must not be empty".into());
    }
    let statuses = script
        .statuses
        .iter()
        .map(|&s| {
            StatusCode::from_u16(s)
                .ok()
                .filter(|c| (200..600).contains(&c.as_u16()))
                .ok_or_else(|| format!("invalid mock script: {s} is not a status from 200 to 599"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let retry_after = script
        .retry_after
        .map(|r| {
            HeaderValue::from_str(&r).map_err(|_| {
                format!("invalid mock script: retry_after {r:?} is not a header value")
            })
        })
        .transpose()?;
    let whole = script
        .whole
        .map(|s| {
            StatusCode::from_u16(s)
                .ok()
                .filter(|c| (200..600).contains(&c.as_u16()))
                .ok_or_else(|| {
                    format!("invalid mock script: whole {s} is not a status from 200 to 599")
                })
        })
        .transpose()?;
    Ok(ValidScript {
        statuses,
        garble: script.garble,
        whole,
        delay: Duration::from_millis(script.delay_ms),
        retry_after,
    })
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl App {
    fn decide(&self, req: &Request, roll: f64) -> Answer {
        let mut ledger = self.lock();
        let now = ledger.now();
        let Ledger {
            epoch,
            windows,
            global_times,
            route_windows,
            accepted,
            attempts,
            stats,
            ..
        } = &mut *ledger;
        stats.requests += 1;
        let mut status = StatusCode::OK;
        if let Some(script) = &req.script {
            let attempt = attempts.entry(req.key.clone()).or_default();
            status = script.statuses[(*attempt).min(script.statuses.len() - 1)];
            *attempt += 1;
            if !status.is_success() {
                stats.scripted += 1;
                return Answer::Scripted {
                    status,
                    retry_after: script.retry_after.clone(),
                };
            }
        } else if roll < self.fail_rate {
            stats.injected_failures += 1;
            return Answer::Injected;
        }
        let charged = self
            .cost_header
            .as_ref()
            .map(|header| (header.clone(), req.charge.unwrap_or(req.units)));
        let answer = Answer::Registered {
            status,
            id: req.key.clone(),
            quota: None,
            charged: charged.clone(),
        };
        if let Some(&accepted_ms) = accepted.get(&req.key) {
            tracing::debug!(key = %req.key, seller = %req.seller, "mock API: a repeated Idempotency-Key");
            stats.duplicates += 1;
            if stats.repeats.len() < MOST_REPEATS {
                stats.repeats.push(Repeat {
                    key: req.key.clone(),
                    seller: req.seller.clone(),
                    accepted_ms,
                    again_ms: millis(now - *epoch),
                });
            }
            stats
                .sellers
                .entry(req.seller.clone())
                .or_default()
                .duplicates += 1;
            return answer;
        }
        // A route's own limit, for the seller.
        let mut route_wait = None;
        let mut route_units = 0;
        if let Some(route) = &req.route {
            let limits = &self.routes[route];
            let times = route_windows
                .entry((route.clone(), req.seller.clone()))
                .or_default();
            (route_wait, route_units) = room_for(times, limits, now, req.units);
            let counters = stats.routes.entry(route.clone()).or_default();
            counters.requests += 1;
            if route_wait.is_some() {
                counters.violations += 1;
            }
        }
        let times = windows.entry(req.seller.clone()).or_default();
        let seller = stats.sellers.entry(req.seller.clone()).or_default();
        let (wait, first_window_units) = room_for(times, &self.limit, now, req.units);
        let wait = wait.max(route_wait);
        // The global limit, over every seller's registrations together.
        let (global_wait, global_units) = match &self.global_limit {
            Some(global) => room_for(global_times, global, now, req.units),
            None => (None, 0),
        };
        if global_wait.is_some() {
            stats.global_violations += 1;
        }
        if let Some(wait) = wait.max(global_wait) {
            stats.violations += 1;
            seller.violations += 1;
            if seller.first_violations.len() < MOST_VIOLATIONS_KEPT {
                seller.first_violations.push(Violation {
                    at_ms: millis(now - *epoch),
                    key: req.key.clone(),
                });
            }
            let retry_after_secs = u64::try_from(wait.as_nanos().div_ceil(1_000_000_000))
                .unwrap_or(u64::MAX)
                .max(1);
            return Answer::Limited {
                retry_after_secs: (!self.no_retry_after).then_some(retry_after_secs),
                quota: self.quota(times, now),
            };
        }
        // What the request is counted at: its charge, when the mock reports one.
        let counted = charged.as_ref().map_or(req.units, |(_, units)| *units);
        let first_window_units = first_window_units + u64::from(counted) - u64::from(req.units);
        if self.global_limit.is_some() {
            global_times.push_back((now, counted));
            stats.max_global_in_window = stats.max_global_in_window.max(global_units);
        }
        if let Some(route) = &req.route {
            route_windows
                .entry((route.clone(), req.seller.clone()))
                .or_default()
                .push_back((now, counted));
            let at = millis(now - *epoch);
            let counters = stats.routes.entry(route.clone()).or_default();
            counters.registered += 1;
            counters.units += u64::from(counted);
            counters.first_ms.get_or_insert(at);
            counters.last_ms = Some(at);
            let in_window = route_units + u64::from(counted) - u64::from(req.units);
            counters.max_in_window = counters.max_in_window.max(in_window);
        }
        let times = windows.entry(req.seller.clone()).or_default();
        let seller = stats.sellers.entry(req.seller.clone()).or_default();
        times.push_back((now, counted));
        let at = millis(now - *epoch);
        accepted.insert(req.key.clone(), at);
        stats.registered += 1;
        seller.registered += 1;
        seller.units += u64::from(counted);
        seller.first_ms.get_or_insert(at);
        seller.last_ms = Some(at);
        if let Some((sku, version)) = &req.version
            && (seller.versions.len() < MOST_PRODUCTS_KEPT || seller.versions.contains_key(sku))
        {
            seller.versions.insert(sku.clone(), *version);
        }
        seller.max_in_window = seller.max_in_window.max(first_window_units);
        if self
            .limit
            .iter()
            .next()
            .is_some_and(|first| first_window_units > u64::from(first.count()))
        {
            seller.over_limit += 1;
        }
        Answer::Registered {
            status,
            id: req.key.clone(),
            quota: self.quota(times, now),
            charged,
        }
    }

    /// The seller's quota for its rate-limit headers, if the mock sends them.
    fn quota(&self, times: &VecDeque<(Instant, u32)>, now: Instant) -> Option<QuotaView> {
        (self.rate_limit_headers != RateLimitForm::None)
            .then(|| QuotaView::of(self.rate_limit_headers, times, &self.limit, now))
    }

    /// A request of `seller` is in flight from its arrival until its answer is sent.
    fn arrived(&self, seller: &str) {
        let mut ledger = self.lock();
        let in_flight = ledger.in_flight.entry(seller.to_owned()).or_default();
        *in_flight += 1;
        let now = *in_flight;
        let stats = ledger.stats.sellers.entry(seller.to_owned()).or_default();
        stats.max_in_flight = stats.max_in_flight.max(now);
    }

    fn answered(&self, seller: &str) {
        if let Some(n) = self.lock().in_flight.get_mut(seller) {
            *n = n.saturating_sub(1);
        }
    }

    async fn pause(&self, delay: Duration) {
        if delay.is_zero() {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = self.shutdown.cancelled() => {}
        }
    }
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        match self {
            Answer::Registered {
                status,
                id,
                quota,
                charged,
            } => {
                let mut response =
                    (status, axum::Json(json!({ "registered": true, "id": id }))).into_response();
                if let Some(quota) = quota {
                    quota.write(response.headers_mut());
                }
                if let Some((header, units)) = charged
                    && let Ok(name) = axum::http::HeaderName::from_bytes(header.as_bytes())
                {
                    response
                        .headers_mut()
                        .insert(name, HeaderValue::from(units));
                }
                response
            }
            Answer::Limited {
                retry_after_secs,
                quota,
            } => {
                let mut response = error(StatusCode::TOO_MANY_REQUESTS, "seller limit reached");
                if let Some(secs) = retry_after_secs {
                    response
                        .headers_mut()
                        .insert(RETRY_AFTER, HeaderValue::from(secs));
                }
                if let Some(quota) = quota {
                    quota.write(response.headers_mut());
                }
                response
            }
            Answer::Injected => error(StatusCode::SERVICE_UNAVAILABLE, "injected failure"),
            Answer::Scripted {
                status,
                retry_after,
            } => {
                let mut response = error(status, format!("scripted {}", status.as_u16()));
                if let Some(value) = retry_after.filter(|_| status == StatusCode::TOO_MANY_REQUESTS)
                {
                    response.headers_mut().insert(RETRY_AFTER, value);
                }
                if status.is_redirection() {
                    // What an SSO proxy in front of an API does to an unauthenticated POST.
                    response.headers_mut().insert(
                        axum::http::header::LOCATION,
                        HeaderValue::from_static("/login"),
                    );
                }
                response
            }
        }
    }
}

async fn register(
    State(app): State<Arc<App>>,
    Path(seller): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    request(app, None, seller, headers, body).await
}

async fn on_route(
    State(app): State<Arc<App>>,
    Path((route, seller)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !app.routes.contains_key(&route) {
        return error(StatusCode::NOT_FOUND, format!("no route {route:?}"));
    }
    request(app, Some(route), seller, headers, body).await
}

async fn request(
    app: Arc<App>,
    route: Option<String>,
    seller: String,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let seen = SeenRequest::of(&headers);
    {
        let mut ledger = app.lock();
        if ledger.recent.len() == RECENT_REQUESTS {
            ledger.recent.pop_front();
        }
        ledger.recent.push_back(seen);
    }
    if let Some(bulk) = &app.bulk
        && let Some(rows) = bulk_rows(&body, bulk.1.as_deref())
    {
        return bulk_request(&app, route, &seller, &headers, rows).await;
    }
    let req = match parse_request(&seller, &headers, &body) {
        Ok(req) => Request { route, ..req },
        Err(why) => {
            app.lock().stats.requests += 1;
            return error(StatusCode::BAD_REQUEST, why);
        }
    };
    if rand::random::<f64>() < app.slow_rate {
        app.pause(app.slow).await;
    }
    app.arrived(&req.seller);
    let answer = app.decide(&req, rand::random::<f64>());
    let scripted_delay = req.script.as_ref().map_or(Duration::ZERO, |s| s.delay);
    app.pause(app.latency + scripted_delay).await;
    app.answered(&req.seller);
    answer.into_response()
}

/// A bulk call's rows, if `body` is one: a JSON array, or one under `items`.
fn bulk_rows(body: &[u8], items: Option<&str>) -> Option<Vec<Value>> {
    match serde_json::from_slice::<Value>(body).ok()? {
        Value::Array(rows) => Some(rows),
        Value::Object(mut fields) => match fields.remove(items?)? {
            Value::Array(rows) => Some(rows),
            _ => None,
        },
        _ => None,
    }
}

/// One row of a bulk call.
struct BulkRow {
    key: String,
    /// Its `--bulk-id-field`, when it has one (echoed in its entry).
    id: Option<String>,
    units: u32,
    script: Option<ValidScript>,
    version: Option<(String, i64)>,
}

/// A bulk call (see the module docs).
async fn bulk_request(
    app: &Arc<App>,
    route: Option<String>,
    path_seller: &str,
    headers: &HeaderMap,
    rows: Vec<Value>,
) -> Response {
    let (count, items, id_field) = app.bulk.clone().expect("a bulk call only with --bulk");
    let mut parsed = Vec::with_capacity(rows.len());
    let mut seller = String::new();
    for (i, row) in rows.iter().enumerate() {
        let body = serde_json::to_vec(row).unwrap_or_default();
        let req = match parse_request(path_seller, headers, &body) {
            Ok(req) => req,
            Err(why) => {
                app.lock().stats.requests += 1;
                return error(StatusCode::BAD_REQUEST, format!("row {i}: {why}"));
            }
        };
        let id = row
            .get(&id_field)
            .and_then(Value::as_str)
            .map(str::to_owned);
        seller = req.seller;
        parsed.push(BulkRow {
            key: id.clone().unwrap_or_else(|| format!("{}#{i}", req.key)),
            id,
            units: req.units,
            script: req.script,
            version: req.version,
        });
    }
    if parsed.is_empty() {
        app.lock().stats.requests += 1;
        return error(StatusCode::BAD_REQUEST, "a bulk call without rows");
    }
    app.arrived(&seller);
    let answer = app.decide_bulk(&seller, route.as_deref(), count, &parsed, rand::random());
    app.pause(app.latency).await;
    app.answered(&seller);
    match answer {
        Ok(entries) => {
            let entries = Value::Array(entries);
            let body = match &items {
                Some(items) => json!({ items.as_str(): entries }),
                None => entries,
            };
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        Err(answer) => answer.into_response(),
    }
}

impl App {
    /// A bulk call of `rows` of `seller` (on `route`): its entries, or the whole call's answer.
    fn decide_bulk(
        &self,
        seller: &str,
        route: Option<&str>,
        count: BulkCount,
        rows: &[BulkRow],
        roll: f64,
    ) -> Result<Vec<Value>, Answer> {
        let mut ledger = self.lock();
        let now = ledger.now();
        let Ledger {
            epoch,
            windows,
            global_times,
            route_windows,
            accepted,
            attempts,
            stats,
            ..
        } = &mut *ledger;
        stats.requests += 1;
        stats.bulk_calls += 1;
        stats.bulk_rows += rows.len() as u64;
        // A row that garbles this call's answer: nothing is registered.
        let mut garbled = false;
        for row in rows {
            if let Some(script) = &row.script {
                let seen = attempts.entry(format!("garble:{}", row.key)).or_default();
                if *seen < script.garble {
                    *seen += 1;
                    if let Some(status) = script.whole {
                        stats.scripted += 1;
                        return Err(Answer::Scripted {
                            status,
                            retry_after: None,
                        });
                    }
                    garbled = true;
                }
            }
        }
        if !garbled && roll < self.fail_rate {
            stats.injected_failures += 1;
            return Err(Answer::Injected);
        }
        if garbled {
            stats.garbled += 1;
            let entries = rows[1..].iter().map(|_| json!({"status": 200})).collect();
            return Ok(entries);
        }
        let units = match count {
            BulkCount::Call => 1,
            BulkCount::Row => rows.iter().map(|r| r.units).sum(),
        };
        let (mut wait, first_window_units) = room_for(
            windows.entry(seller.to_owned()).or_default(),
            &self.limit,
            now,
            units,
        );
        if let Some(route) = route {
            let times = route_windows
                .entry((route.to_owned(), seller.to_owned()))
                .or_default();
            let (route_wait, _) = room_for(times, &self.routes[route], now, units);
            let counters = stats.routes.entry(route.to_owned()).or_default();
            counters.requests += 1;
            if route_wait.is_some() {
                counters.violations += 1;
            }
            wait = wait.max(route_wait);
        }
        if let Some(global) = &self.global_limit {
            let (global_wait, _) = room_for(global_times, global, now, units);
            if global_wait.is_some() {
                stats.global_violations += 1;
            }
            wait = wait.max(global_wait);
        }
        let at = millis(now - *epoch);
        let counters = stats.sellers.entry(seller.to_owned()).or_default();
        if let Some(wait) = wait {
            stats.violations += 1;
            counters.violations += 1;
            if counters.first_violations.len() < MOST_VIOLATIONS_KEPT {
                counters.first_violations.push(Violation {
                    at_ms: at,
                    key: rows[0].key.clone(),
                });
            }
            return Err(Answer::Limited {
                retry_after_secs: (!self.no_retry_after).then(|| wait.as_secs().max(1)),
                quota: None,
            });
        }
        windows
            .entry(seller.to_owned())
            .or_default()
            .push_back((now, units));
        if let Some(route) = route {
            route_windows
                .entry((route.to_owned(), seller.to_owned()))
                .or_default()
                .push_back((now, units));
        }
        if self.global_limit.is_some() {
            global_times.push_back((now, units));
        }
        counters.max_in_window = counters.max_in_window.max(first_window_units);
        counters.units += u64::from(units);
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            let mut status = StatusCode::OK;
            let mut retry_after = None;
            if let Some(script) = &row.script {
                let attempt = attempts.entry(row.key.clone()).or_default();
                status = script.statuses[(*attempt).min(script.statuses.len() - 1)];
                *attempt += 1;
                retry_after = script
                    .retry_after
                    .as_ref()
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            }
            let mut entry = json!({"status": status.as_u16()});
            if let Some(id) = &row.id {
                entry["message_id"] = id.clone().into();
            }
            if !status.is_success() {
                stats.scripted += 1;
                entry["error"] = format!("scripted {}", status.as_u16()).into();
                if let Some(secs) = retry_after.filter(|_| status == StatusCode::TOO_MANY_REQUESTS)
                {
                    entry["retry_after"] = secs.into();
                }
                entries.push(entry);
                continue;
            }
            entry["registered"] = true.into();
            entry["id"] = row.key.clone().into();
            let counters = stats.sellers.entry(seller.to_owned()).or_default();
            if let Some(&accepted_ms) = accepted.get(&row.key) {
                stats.duplicates += 1;
                counters.duplicates += 1;
                if stats.repeats.len() < MOST_REPEATS {
                    stats.repeats.push(Repeat {
                        key: row.key.clone(),
                        seller: seller.to_owned(),
                        accepted_ms,
                        again_ms: at,
                    });
                }
            } else {
                accepted.insert(row.key.clone(), at);
                stats.registered += 1;
                counters.registered += 1;
                counters.first_ms.get_or_insert(at);
                counters.last_ms = Some(at);
                if let Some((sku, version)) = &row.version
                    && (counters.versions.len() < MOST_PRODUCTS_KEPT
                        || counters.versions.contains_key(sku))
                {
                    counters.versions.insert(sku.clone(), *version);
                }
                if let Some(route) = route {
                    let route = stats.routes.entry(route.to_owned()).or_default();
                    route.registered += 1;
                }
            }
            entries.push(entry);
        }
        Ok(entries)
    }
}

/// The page a scripted 3xx points to: a 200 that is not a registration.
async fn login() -> &'static str {
    "please log in"
}

async fn stats(State(app): State<Arc<App>>) -> axum::Json<Stats> {
    axum::Json(app.lock().snapshot())
}

async fn reset(State(app): State<Arc<App>>) -> StatusCode {
    *app.lock() = Ledger::new();
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        mock: MockArgs,
    }

    #[test]
    fn flags_default_to_a_quiet_local_mock_and_refuse_bad_fractions() {
        let args = Cli::try_parse_from(["mock"]).unwrap().mock;
        assert_eq!(args.limit, "20/1s".parse().unwrap());
        assert_eq!(args.addr, "127.0.0.1:8080".parse().unwrap());
        assert_eq!((args.latency_ms, args.fail_rate), (0, 0.0));
        assert!(Cli::try_parse_from(["mock", "--fail-rate", "1.5"]).is_err());
        assert!(Cli::try_parse_from(["mock", "--limit", "0/1s"]).is_err());
    }
}
