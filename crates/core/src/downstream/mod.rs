//! The registration API: one POST per registration (or one per bulk call of several, see
//! [`bulk`]), and what its answer means.

use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::Args;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use secrecy::{ExposeSecret, SecretString};

use crate::config::{UrlTemplate, UrlTemplateError};
use crate::domain::Registration;

/// How a refusal names the registration endpoint's URL template.
const DOWNSTREAM_URL: &str = "TURNSTILE_DOWNSTREAM_URL";
use crate::routes::Routes;
use crate::trace::TraceContext;

pub mod bulk;
pub mod headers;
pub mod recent;
mod reply;
pub use headers::RateLimitHeaders;
pub use recent::Recent;
use reply::EXCERPT;
pub use reply::{ApiResponse, RESPONSE_CAP, Reply, ResponseBody};

/// Where and how to call the registration API.
#[derive(Args, Clone)]
#[command(next_help_heading = "Downstream")]
pub struct DownstreamArgs {
    /// Registration endpoint; `{seller_id}` is replaced by the URL-encoded seller id.
    #[arg(
        id = "downstream_url",
        long = "downstream-url",
        env = "TURNSTILE_DOWNSTREAM_URL",
        hide_env_values = true
    )]
    pub url: String,
    /// Sent as `Authorization: Bearer <token>`; never logged.
    #[arg(
        long = "downstream-token",
        env = "TURNSTILE_DOWNSTREAM_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<SecretString>,
    /// How long one call may take before it counts as a timeout (retried).
    #[arg(id = "downstream_timeout", long = "downstream-timeout", env = "TURNSTILE_DOWNSTREAM_TIMEOUT", default_value = "10s", value_parser = crate::config::duration_arg)]
    pub timeout: Duration,
    /// A response header whose value (an integer from 0 to 10000) is what the call really
    /// cost: it replaces the call's requested cost in the seller's windows (sliding-window).
    #[arg(long = "cost-header", env = "TURNSTILE_COST_HEADER", value_parser = cost_header_arg)]
    pub cost_header: Option<reqwest::header::HeaderName>,
}

/// `TURNSTILE_COST_HEADER`: a valid HTTP header name.
fn cost_header_arg(s: &str) -> Result<reqwest::header::HeaderName, String> {
    reqwest::header::HeaderName::from_bytes(s.trim().as_bytes())
        .map_err(|_| format!("{s:?} is not an HTTP header name"))
}

impl std::fmt::Debug for DownstreamArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownstreamArgs")
            .field("url", &crate::config::redact_url(&self.url))
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("timeout", &self.timeout)
            .field("cost_header", &self.cost_header)
            .finish()
    }
}

/// The registration API client.
#[derive(Clone)]
pub struct Downstream {
    client: reqwest::Client,
    url: UrlTemplate,
    authorization: Option<HeaderValue>,
    /// Where each call's class and latency are noted for the dashboard, if anywhere.
    recent: Option<std::sync::Arc<Recent>>,
    /// The routes a message may name, each with its method and URL.
    routes: std::sync::Arc<Routes>,
    /// The header that says what a call really cost (`TURNSTILE_COST_HEADER`).
    cost_header: Option<reqwest::header::HeaderName>,
}

impl Downstream {
    /// Notes each call's answer class and latency in `recent` (the replica's, which the
    /// dashboard reads).
    pub fn recording(mut self, recent: std::sync::Arc<Recent>) -> Self {
        self.recent = Some(recent);
        self
    }

    /// Calls a message's route (method and URL) when it names one.
    pub fn with_routes(mut self, routes: std::sync::Arc<Routes>) -> Self {
        self.routes = routes;
        self
    }

    pub fn new(args: &DownstreamArgs) -> anyhow::Result<Self> {
        let url = UrlTemplate::parse(&args.url).map_err(|e| match e {
            UrlTemplateError::Invalid(why) => anyhow::anyhow!(why).context(format!(
                "TURNSTILE_DOWNSTREAM_URL {:?} is not a valid URL",
                crate::config::redact_url(&args.url)
            )),
            UrlTemplateError::Scheme => {
                anyhow::anyhow!("TURNSTILE_DOWNSTREAM_URL must be an http or https URL")
            }
            UrlTemplateError::UnknownPlaceholder(_) | UrlTemplateError::Unclosed => {
                anyhow::anyhow!(
                    "TURNSTILE_DOWNSTREAM_URL {:?}: {e}",
                    crate::config::redact_url(&args.url)
                )
            }
        })?;
        let authorization = match &args.token {
            Some(token) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {}", token.expose_secret()))
                    .map_err(|_| anyhow::anyhow!("TURNSTILE_DOWNSTREAM_TOKEN contains characters not allowed in an HTTP header"))?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        // A redirect is never followed: a POST answered `302 Location: /login` by an SSO proxy
        // must not pass for a registration when the login page answers 200.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(args.timeout)
            .connect_timeout(args.timeout.min(Duration::from_secs(5)))
            .pool_max_idle_per_host(256)
            .build()
            .context("building the HTTP client")?;
        Ok(Self {
            client,
            url,
            authorization,
            recent: None,
            routes: Default::default(),
            cost_header: args.cost_header.clone(),
        })
    }

    /// The URL for a seller: `{seller_id}` replaced by the percent-encoded id, so that `/`,
    /// `?`, `#`, `%` and spaces stay inside one path segment or query value. An id of `.` or
    /// `..` cannot be one path segment (URL parsers remove such segments, encoded or not), so
    /// it is refused when `{seller_id}` stands in the path.
    pub fn url_for(&self, seller: &crate::domain::SellerId) -> Result<String, String> {
        self.url.fill(seller, DOWNSTREAM_URL)
    }

    /// The method and URL of `registration`'s call: its route's, or the registration endpoint
    /// (POST) when it names none.
    fn target(&self, registration: &Registration) -> Result<(reqwest::Method, String), String> {
        let seller = &registration.seller_id;
        let Some(name) = &registration.route else {
            return Ok((reqwest::Method::POST, self.url_for(seller)?));
        };
        let route = self
            .routes
            .get(name)
            .ok_or_else(|| format!("route {name:?} is not in the routes file"))?;
        let url = route.url.fill(seller, &format!("route {name:?}'s URL"))?;
        Ok((route.method.clone(), url))
    }

    /// Whether the seller's id can stand where `{seller_id}` does (see [`Self::url_for`]),
    /// without building the URL.
    pub fn check_seller(&self, seller: &crate::domain::SellerId) -> Result<(), String> {
        self.url.check_seller(seller, DOWNSTREAM_URL)
    }

    /// POSTs the product verbatim with the contract's headers, as the first span of a new
    /// trace, and classifies the answer.
    pub async fn register(&self, registration: &Registration) -> Reply {
        self.call(registration, &TraceContext::start()).await.reply
    }

    /// As [`Self::register`], as the span `trace` (the call's own: see
    /// [`TraceContext::child`]), with what a 2xx or 429 answer's rate-limit headers said (see
    /// [`headers`]).
    pub async fn call(&self, registration: &Registration, trace: &TraceContext) -> Answered {
        let request = match self.request(registration, trace) {
            Ok(request) => request,
            Err(why) => return Answered::refused(why),
        };
        let mut request = request
            .header("Idempotency-Key", registration.message_id.header_value())
            .body(registration.product.get().to_owned());
        if let Some(batch) = &registration.batch_id {
            request = request.header("X-Batch-Id", batch.header_value());
        }
        let (sent, class, started) = self.send(request).await;
        let answered = match sent {
            Sent::Answered(response, rate_limit, cost) => Answered {
                reply: classify(response).await,
                rate_limit,
                cost,
            },
            Sent::Unanswered(reply) => Answered::only(reply),
        };
        self.note(class, registration, started);
        answered
    }

    /// One call for `rows` (at least one; all of one seller and one route) as the bulk route
    /// `bulk` makes it (see [`bulk`]), as the span `trace`: each row's reply, in the rows'
    /// order. What the answer's headers said goes with the first row's.
    pub async fn call_bulk(
        &self,
        bulk: &crate::routes::Bulk,
        rows: &[Registration],
        trace: &TraceContext,
    ) -> BulkAnswered {
        let first = &rows[0];
        let every = |reply: Reply| vec![reply; rows.len()];
        let request = match self.request(first, trace) {
            Ok(request) => request,
            Err(why) => return BulkAnswered::of(every(Answered::refused(why).reply), None, None),
        };
        let (body, keys) = bulk::body(bulk, rows);
        let mut request = request
            .header("Idempotency-Key", bulk::idempotency_key(rows))
            .body(body);
        if let Some(batch) = &first.batch_id
            && rows.iter().all(|r| r.batch_id.as_ref() == Some(batch))
        {
            request = request.header("X-Batch-Id", batch.header_value());
        }
        metrics::counter!("turnstile_bulk_calls_total").increment(1);
        metrics::counter!("turnstile_bulk_rows_total").increment(rows.len() as u64);
        let (sent, class, started) = self.send(request).await;
        let (response, rate_limit, cost) = match sent {
            Sent::Unanswered(reply) => {
                self.note(class, first, started);
                return BulkAnswered::of(every(reply), None, None);
            }
            Sent::Answered(response, rate_limit, cost) => (response, rate_limit, cost),
        };
        if !response.status().is_success() {
            let reply = classify(response).await;
            self.note(class, first, started);
            return BulkAnswered::of(every(reply), rate_limit, cost);
        }
        let answer = read_capped(response, bulk::answer_cap(rows.len())).await;
        self.note(class, first, started);
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        match bulk::map_answer(bulk, &keys, &answer) {
            Ok(replies) => BulkAnswered::of(replies, rate_limit, cost),
            Err(unmappable) => {
                metrics::counter!("turnstile_bulk_unmapped_total").increment(1);
                let shown = match &answer.body {
                    ResponseBody::Json(t) | ResponseBody::Text(t) if t.len() > RESPONSE_CAP => {
                        let cut = (0..=RESPONSE_CAP).rev().find(|i| t.is_char_boundary(*i));
                        ApiResponse::new(answer.status, &t.as_bytes()[..cut.unwrap_or(0)], true)
                    }
                    _ => answer.clone(),
                };
                let reply = Reply::Transient {
                    why: unmappable.to_string(),
                    response: Some(shown),
                };
                BulkAnswered {
                    unmapped: true,
                    ..BulkAnswered::of(every(reply), rate_limit, cost)
                }
            }
        }
    }

    /// The request of `registration`'s call with the headers every call carries (the
    /// Idempotency-Key, the body and the batch are the caller's), or why it cannot be made.
    fn request(
        &self,
        registration: &Registration,
        trace: &TraceContext,
    ) -> Result<reqwest::RequestBuilder, String> {
        let (method, url) = self.target(registration)?;
        let mut request = self
            .client
            .request(method, url)
            .header(CONTENT_TYPE, "application/json")
            .header("X-Seller-Id", registration.seller_id.header_value());
        if let Some(auth) = &self.authorization {
            request = request.header(reqwest::header::AUTHORIZATION, auth.clone());
        }
        Ok(with_trace(request, trace))
    }

    /// Sends `request`: the response with what its headers said (rate limits for a 2xx or
    /// 429, the cost header), or the reply of a call that got no answer; the answer's class;
    /// when it was sent.
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> (Sent, &'static str, std::time::Instant) {
        let started = std::time::Instant::now();
        let (sent, class) = match request.send().await {
            Ok(response) => {
                let class = status_class(response.status());
                let cost = self
                    .cost_header
                    .as_ref()
                    .and_then(|header| reported_cost(response.headers(), header));
                let rate_limit = if matches!(class, "2xx" | "429") {
                    RateLimitHeaders::read(response.headers(), std::time::SystemTime::now())
                } else {
                    None
                };
                (Sent::Answered(response, rate_limit, cost), class)
            }
            Err(error) if error.is_timeout() => (
                Sent::Unanswered(Reply::unanswered("timeout".into())),
                "timeout",
            ),
            Err(error) if error.is_connect() => (
                Sent::Unanswered(Reply::unanswered("connection error".into())),
                "error",
            ),
            Err(error) => (
                Sent::Unanswered(Reply::unanswered(format!(
                    "request failed: {}",
                    error.without_url()
                ))),
                "error",
            ),
        };
        (sent, class, started)
    }

    /// Counts a call of `registration`'s route answered in `class`, sent at `started`.
    fn note(&self, class: &'static str, registration: &Registration, started: std::time::Instant) {
        metrics::counter!("turnstile_downstream_requests_total", "class" => class).increment(1);
        if let Some(route) = &registration.route {
            metrics::counter!("turnstile_route_calls_total", "route" => route.as_str().to_owned())
                .increment(1);
        }
        let took = started.elapsed();
        metrics::histogram!("turnstile_downstream_request_duration_seconds", "class" => class)
            .record(took.as_secs_f64());
        if let Some(recent) = &self.recent {
            recent.record(class, took);
        }
    }
}

/// What sending a request came to.
enum Sent {
    /// An answer, with what its rate-limit headers and its cost header said.
    Answered(reqwest::Response, Option<RateLimitHeaders>, Option<u32>),
    /// No answer: the reply that stands for it.
    Unanswered(Reply),
}

/// A bulk call's answer ([`Downstream::call_bulk`]).
#[derive(Debug)]
pub struct BulkAnswered {
    /// One per row, in the rows' order.
    pub answers: Vec<Answered>,
    /// Whether its 2xx answer could not be mapped to its rows: every row's reply is then
    /// retryable, and each row is retried alone.
    pub unmapped: bool,
}

impl BulkAnswered {
    /// One answer per reply, in the rows' order; what the answer's headers said goes with the
    /// first row's (its permit is the one that learns from it).
    fn of(replies: Vec<Reply>, rate_limit: Option<RateLimitHeaders>, cost: Option<u32>) -> Self {
        let answers = replies
            .into_iter()
            .enumerate()
            .map(|(i, reply)| Answered {
                reply,
                rate_limit: rate_limit.filter(|_| i == 0),
                cost: cost.filter(|_| i == 0),
            })
            .collect();
        Self {
            answers,
            unmapped: false,
        }
    }
}

/// What the answer's `header` says the call cost: one integer from 0 to [`Cost::MAX`]
/// (`crate::domain::Cost`); anything else (absent, repeated, not a number, out of range) says
/// nothing, and the requested cost stays counted.
fn reported_cost(
    headers: &reqwest::header::HeaderMap,
    header: &reqwest::header::HeaderName,
) -> Option<u32> {
    let mut values = headers.get_all(header).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let text = value.to_str().ok()?.trim();
    if text.is_empty() || text.len() > 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u32>()
        .ok()
        .filter(|units| *units <= crate::domain::Cost::MAX)
}

/// `traceparent`, and `tracestate` when there is one. Both are ASCII by construction; a value
/// that a header could not carry would be left out rather than fail the call.
fn with_trace(
    mut request: reqwest::RequestBuilder,
    trace: &TraceContext,
) -> reqwest::RequestBuilder {
    if let Ok(value) = HeaderValue::from_str(&trace.traceparent()) {
        request = request.header(crate::trace::TRACEPARENT, value);
    }
    let state = trace
        .tracestate()
        .map(|s| HeaderValue::from_str(s.as_str()));
    if let Some(Ok(value)) = state {
        request = request.header(crate::trace::TRACESTATE, value);
    }
    request
}

/// The registration API as a worker calls it (a test can fake it).
pub trait Api: Send + Sync {
    /// Whether the seller can be named in the call (see [`Downstream::check_seller`]).
    fn check_seller(&self, seller: &crate::domain::SellerId) -> Result<(), String>;

    /// Calls the API for `registration` as the span `trace` (see [`Downstream::call`]).
    fn call<'a>(
        &'a self,
        registration: &'a Registration,
        trace: &'a TraceContext,
    ) -> futures::future::BoxFuture<'a, Answered>;

    /// One bulk call for `rows` (see [`Downstream::call_bulk`]). By default, one call per row
    /// in turn (for an API that makes no bulk calls).
    fn call_bulk<'a>(
        &'a self,
        bulk: &'a crate::routes::Bulk,
        rows: &'a [Registration],
        trace: &'a TraceContext,
    ) -> futures::future::BoxFuture<'a, BulkAnswered> {
        let _ = bulk;
        futures::FutureExt::boxed(async move {
            let mut answers = Vec::with_capacity(rows.len());
            for row in rows {
                answers.push(self.call(row, trace).await);
            }
            BulkAnswered {
                answers,
                unmapped: false,
            }
        })
    }
}

impl Api for Downstream {
    fn check_seller(&self, seller: &crate::domain::SellerId) -> Result<(), String> {
        Downstream::check_seller(self, seller)
    }

    fn call<'a>(
        &'a self,
        registration: &'a Registration,
        trace: &'a TraceContext,
    ) -> futures::future::BoxFuture<'a, Answered> {
        futures::FutureExt::boxed(Downstream::call(self, registration, trace))
    }

    fn call_bulk<'a>(
        &'a self,
        bulk: &'a crate::routes::Bulk,
        rows: &'a [Registration],
        trace: &'a TraceContext,
    ) -> futures::future::BoxFuture<'a, BulkAnswered> {
        futures::FutureExt::boxed(Downstream::call_bulk(self, bulk, rows, trace))
    }
}

/// A call's classified answer, and what its rate-limit headers said (2xx and 429 only).
#[derive(Debug)]
pub struct Answered {
    pub reply: Reply,
    pub rate_limit: Option<RateLimitHeaders>,
    /// What the answer said the call really cost (`TURNSTILE_COST_HEADER`), if it did.
    pub cost: Option<u32>,
}

impl Answered {
    /// An answer that is only `reply`: no headers said anything.
    pub fn only(reply: Reply) -> Self {
        Answered {
            reply,
            rate_limit: None,
            cost: None,
        }
    }

    /// A call that could not be made (`why`): rejected without a request.
    fn refused(why: String) -> Self {
        Self::only(Reply::Rejected {
            status: 0,
            body: why,
            response: None,
        })
    }
}

/// Every value of the `class` label of `turnstile_downstream_requests_total` and
/// `turnstile_downstream_request_duration_seconds`.
pub const CLASSES: [&str; 6] = ["2xx", "429", "4xx", "5xx", "timeout", "error"];

/// The `class` label of a downstream answer: `2xx`, `429`, `4xx`, `5xx`, or `error` for any
/// other status (`timeout` and `error` also stand for calls that got no answer).
pub fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200..=299 => "2xx",
        429 => "429",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "error",
    }
}

async fn classify(response: reqwest::Response) -> Reply {
    let status = response.status();
    if status.is_success() {
        // A body that fails midway is kept as far as it came: the registration happened.
        return Reply::Registered(read_capped(response, RESPONSE_CAP).await);
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        return Reply::Throttled { retry_after };
    }
    if matches!(status.as_u16(), 408 | 425 | 500 | 502 | 503 | 504) {
        return Reply::Transient {
            why: format!("HTTP {}", status.as_u16()),
            response: Some(read_capped(response, RESPONSE_CAP).await),
        };
    }
    let location = status.is_redirection().then(|| {
        response
            .headers()
            .get(reqwest::header::LOCATION)
            .map(|l| {
                String::from_utf8_lossy(l.as_bytes())
                    .chars()
                    .take(EXCERPT)
                    .collect::<String>()
            })
            .unwrap_or_default()
    });
    let answer = read_capped(response, RESPONSE_CAP).await;
    let excerpt: String = match &answer.body {
        ResponseBody::Empty => String::new(),
        ResponseBody::Json(text) | ResponseBody::Text(text) => text.chars().take(EXCERPT).collect(),
    };
    let body = match location {
        Some(location) => format!("redirect not followed, Location: {location:?}; {excerpt}"),
        None => excerpt,
    };
    Reply::Rejected {
        status: status.as_u16(),
        body,
        response: Some(answer),
    }
}

/// The answer's status and body, reading at most `cap` (a single call's: [`RESPONSE_CAP`]) + 1
/// bytes of it (a downstream may answer with gigabytes); a body that fails midway is kept as
/// far as it came.
async fn read_capped(mut response: reqwest::Response, cap: usize) -> ApiResponse {
    let status = response.status().as_u16();
    let mut bytes = Vec::new();
    let mut truncated = false;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = cap - bytes.len();
                if chunk.len() > room {
                    bytes.extend_from_slice(&chunk[..room]);
                    truncated = true;
                    break;
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(_) => {
                truncated = true;
                break;
            }
        }
    }
    ApiResponse::new(status, &bytes, truncated)
}

/// `Retry-After`: whole seconds, or an HTTP date.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn downstream(url: &str) -> Downstream {
        Downstream::new(&DownstreamArgs {
            url: url.into(),
            token: None,
            timeout: Duration::from_secs(1),
            cost_header: None,
        })
        .unwrap()
    }

    #[test]
    fn every_status_falls_in_one_of_the_classes_exported_at_zero() {
        for code in 100..=999 {
            let status = StatusCode::from_u16(code).expect("a valid status code");
            assert!(CLASSES.contains(&status_class(status)), "{code}");
        }
    }

    #[test]
    fn a_seller_id_is_always_one_path_segment_or_one_query_value() {
        let d = downstream("http://api.test/sellers/{seller_id}/products");
        let url = |id: &str| {
            d.url_for(&crate::domain::SellerId::parse(id).unwrap())
                .map(|u| reqwest::Url::parse(&u).unwrap().path().to_owned())
        };
        assert_eq!(url("a/b").unwrap(), "/sellers/a%2Fb/products");
        assert_eq!(url("a?b#c").unwrap(), "/sellers/a%3Fb%23c/products");
        assert_eq!(url("...").unwrap(), "/sellers/.../products");
        assert_eq!(url("%2e%2e").unwrap(), "/sellers/%252e%252e/products");
        assert!(url("..").is_err() && url(".").is_err());
        let q = downstream("http://api.test/products?seller={seller_id}");
        let query = |id: &str| {
            let u = q
                .url_for(&crate::domain::SellerId::parse(id).unwrap())
                .unwrap();
            let u = reqwest::Url::parse(&u).unwrap();
            let pairs: Vec<(String, String)> = u.query_pairs().into_owned().collect();
            (u.path().to_owned(), pairs)
        };
        assert_eq!(
            query(".."),
            ("/products".into(), vec![("seller".into(), "..".into())])
        );
        assert_eq!(
            query("a&b=c#d"),
            (
                "/products".into(),
                vec![("seller".into(), "a&b=c#d".into())]
            )
        );
    }

    #[test]
    fn an_answer_keeps_json_as_json_and_anything_else_as_text() {
        let json = ApiResponse::new(201, br#" {"product_id": 12345} "#, false);
        assert_eq!(
            json.body,
            ResponseBody::Json(r#"{"product_id": 12345}"#.into())
        );
        let text = ApiResponse::new(400, b"invalid category", false);
        assert_eq!(text.body, ResponseBody::Text("invalid category".into()));
        let cut = ApiResponse::new(200, br#"{"product_id": 1"#, true);
        assert_eq!(cut.body, ResponseBody::Text(r#"{"product_id": 1"#.into()));
        let binary = ApiResponse::new(200, &[0xff, 0x00, 0x41], false);
        assert_eq!(binary.body, ResponseBody::Text("\u{fffd}\u{0}A".into()));
        assert_eq!(ApiResponse::new(204, b"", false).body, ResponseBody::Empty);
    }

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        assert_eq!(parse_retry_after("3"), Some(Duration::from_secs(3)));
        let later = SystemTime::now() + Duration::from_secs(120);
        let parsed = parse_retry_after(&httpdate::fmt_http_date(later)).unwrap();
        assert!(parsed > Duration::from_secs(100) && parsed <= Duration::from_secs(120));
        assert_eq!(parse_retry_after("soon"), None);
    }
}
