//! The registration API: one POST per registration, and what its answer means.

use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::Args;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};

use crate::domain::Registration;

/// Where and how to call the registration API.
#[derive(Args, Clone)]
pub struct DownstreamArgs {
    /// Registration endpoint; `{seller_id}` is replaced by the URL-encoded seller id.
    #[arg(
        id = "downstream_url",
        long = "downstream-url",
        env = "TURNSTILE_DOWNSTREAM_URL"
    )]
    pub url: String,
    /// Sent as `Authorization: Bearer <token>`; never logged.
    #[arg(
        long = "downstream-token",
        env = "TURNSTILE_DOWNSTREAM_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// How long one call may take before it counts as a timeout (retried).
    #[arg(id = "downstream_timeout", long = "downstream-timeout", env = "TURNSTILE_DOWNSTREAM_TIMEOUT", default_value = "10s", value_parser = crate::config::duration_arg)]
    pub timeout: Duration,
}

impl std::fmt::Debug for DownstreamArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownstreamArgs")
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// What the downstream answered, classified by DESIGN.md's response table.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// 2xx: registered.
    Registered,
    /// 429: the seller is over the downstream's limit; pause it for `retry_after` (or a window).
    Throttled { retry_after: Option<Duration> },
    /// 408, 425, 500, 502, 503, 504, a timeout or a connection error: retry later.
    Transient(String),
    /// Any other 4xx (and other unexpected statuses): dead-letter at once.
    Rejected { status: u16, body: String },
}

/// Longest body excerpt kept for a dead letter's reason.
const EXCERPT: usize = 300;

/// The registration API client.
#[derive(Clone)]
pub struct Downstream {
    client: reqwest::Client,
    url: String,
    authorization: Option<HeaderValue>,
}

impl Downstream {
    pub fn new(args: &DownstreamArgs) -> anyhow::Result<Self> {
        let probe = args.url.replace("{seller_id}", "probe");
        let parsed = reqwest::Url::parse(&probe).with_context(|| {
            format!(
                "TURNSTILE_DOWNSTREAM_URL {:?} is not a valid URL",
                crate::permit::redact_url(&args.url)
            )
        })?;
        anyhow::ensure!(
            matches!(parsed.scheme(), "http" | "https"),
            "TURNSTILE_DOWNSTREAM_URL must be an http or https URL"
        );
        let authorization = match &args.token {
            Some(token) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
                    .map_err(|_| anyhow::anyhow!("TURNSTILE_DOWNSTREAM_TOKEN contains characters not allowed in an HTTP header"))?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let client = reqwest::Client::builder()
            .timeout(args.timeout)
            .connect_timeout(args.timeout.min(Duration::from_secs(5)))
            .pool_max_idle_per_host(256)
            .build()
            .context("building the HTTP client")?;
        Ok(Self {
            client,
            url: args.url.clone(),
            authorization,
        })
    }

    /// POSTs the product verbatim with the contract's headers and classifies the answer.
    pub async fn register(&self, registration: &Registration) -> Reply {
        let url = self.url.replace(
            "{seller_id}",
            &urlencoding::encode(registration.seller_id.as_str()),
        );
        let mut request = self
            .client
            .post(url)
            .header(CONTENT_TYPE, "application/json")
            .header("Idempotency-Key", registration.message_id.header_value())
            .header("X-Seller-Id", registration.seller_id.header_value())
            .body(registration.product.get().to_owned());
        if let Some(batch) = &registration.batch_id {
            request = request.header("X-Batch-Id", batch.header_value());
        }
        if let Some(auth) = &self.authorization {
            request = request.header(reqwest::header::AUTHORIZATION, auth.clone());
        }
        let started = std::time::Instant::now();
        let (reply, class) = match request.send().await {
            Ok(response) => {
                let class = status_class(response.status());
                (classify(response).await, class)
            }
            Err(error) if error.is_timeout() => (Reply::Transient("timeout".into()), "timeout"),
            Err(error) if error.is_connect() => {
                (Reply::Transient("connection error".into()), "error")
            }
            Err(error) => (
                Reply::Transient(format!("request failed: {}", error.without_url())),
                "error",
            ),
        };
        metrics::counter!("turnstile_downstream_requests_total", "class" => class).increment(1);
        metrics::histogram!("turnstile_downstream_request_duration_seconds", "class" => class)
            .record(started.elapsed().as_secs_f64());
        reply
    }
}

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
        return Reply::Registered;
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
        return Reply::Transient(format!("HTTP {}", status.as_u16()));
    }
    let body = response.text().await.unwrap_or_default();
    let body: String = body.chars().take(EXCERPT).collect();
    Reply::Rejected {
        status: status.as_u16(),
        body,
    }
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

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        assert_eq!(parse_retry_after("3"), Some(Duration::from_secs(3)));
        let later = SystemTime::now() + Duration::from_secs(120);
        let parsed = parse_retry_after(&httpdate::fmt_http_date(later)).unwrap();
        assert!(parsed > Duration::from_secs(100) && parsed <= Duration::from_secs(120));
        assert_eq!(parse_retry_after("soon"), None);
    }
}
