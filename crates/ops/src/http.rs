//! The replica's HTTP endpoints: `/metrics` (Prometheus), `/healthz`, `/readyz`, the
//! dashboard (its page at `/` and its data at `/api/dashboard`, see [`crate::dashboard`]), and
//! what the upload service reads: `/api/batches/{batch_id}` and `/api/sellers/{seller_id}`
//! (progress and ETA, see `turnstile_upload::progress`), and `/api/fleet` (the replicas and
//! the terms in force, see `turnstile_core::fleet`); the operator's search and dead letters
//! ([`crate::lookup`]) and actions ([`crate::actions`]).

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use anyhow::Context;
use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use turnstile_upload::progress;

use crate::dashboard::{self, Dashboard};
pub use crate::endpoints::Endpoints;
use crate::endpoints::{TOKEN_COOKIE, api_error, carries_token, json_answer};
pub use turnstile_core::telemetry::Readiness;

/// The process-wide Prometheus recorder (installed on first use).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets(&[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ])
            .expect("static buckets are valid")
            .build_recorder();
        let handle = recorder.handle();
        // Fails only if another recorder is installed already (then this one just renders empty).
        let _ = metrics::set_global_recorder(recorder);
        handle
    })
}

/// `TURNSTILE_HTTP_ADDR`: where to serve the endpoints, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    Off,
    At(SocketAddr),
}

/// Parses `TURNSTILE_HTTP_ADDR`.
pub fn parse_addr(s: &str) -> Result<Listen, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(Listen::Off);
    }
    s.parse()
        .map(Listen::At)
        .map_err(|_| format!("{s:?} is not an address such as 0.0.0.0:9464 (or `off`)"))
}

/// Parses `TURNSTILE_HTTP_TOKEN`: an empty or blank token would look like protection and let
/// anyone in (an empty `?token=` or cookie matches it), so only a token of visible ASCII
/// characters other than `;` and `,` (it travels in a cookie) is accepted.
pub fn parse_token(s: &str) -> Result<SecretString, String> {
    if s.trim().is_empty() {
        return Err("the token is empty: set a real token, or unset TURNSTILE_HTTP_TOKEN to leave the dashboard open".into());
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b';' && b != b',')
    {
        return Err(
            "the token must be visible ASCII characters without spaces, `;` or `,` (it travels in a cookie)"
                .into(),
        );
    }
    Ok(SecretString::from(s.to_owned()))
}

async fn metrics_page(State(endpoints): State<Endpoints>) -> String {
    let stats = &endpoints.stats;
    metrics::gauge!("turnstile_in_flight").set(stats.in_flight.load(Ordering::Relaxed) as f64);
    metrics::gauge!("turnstile_held_messages").set(stats.held.load(Ordering::Relaxed) as f64);
    metrics::gauge!("turnstile_delay_held_messages")
        .set(stats.ladder.held.load(Ordering::Relaxed) as f64);
    crate::process::collect();
    prometheus().render()
}

/// `GET /readyz`: 200 `ready`, or 503 `not ready`, followed by why and since when (Unix ms)
/// when the replica said.
async fn readyz(State(endpoints): State<Endpoints>) -> (StatusCode, String) {
    if endpoints.ready.get() {
        return (StatusCode::OK, "ready\n".to_owned());
    }
    let body = match endpoints.ready.why() {
        Some(said) => format!("not ready: {} (since {} ms)\n", said.why, said.since_ms),
        None => "not ready\n".to_owned(),
    };
    (StatusCode::SERVICE_UNAVAILABLE, body)
}

async fn dashboard_data(State(endpoints): State<Endpoints>) -> Response {
    let unavailable = |error: String| {
        let body = serde_json::json!({ "error": error }).to_string();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    };
    let Some(dashboard) = endpoints.dashboard.get() else {
        return unavailable("not connected to Redis yet".into());
    };
    match dashboard.json().await {
        Ok(json) => (
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            json.as_str().to_owned(),
        )
            .into_response(),
        Err(error) => unavailable(format!("{error:#}")),
    }
}

/// The dashboard whose records and sellers' terms the API reads, and `id` parsed by `parse`; or
/// the answer to give instead (503 before the replica reached Redis, 400 for an id that does not
/// parse).
fn api_input<'a, T, E: std::fmt::Display>(
    endpoints: &'a Endpoints,
    id: &str,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> Result<(&'a Dashboard, T), Box<Response>> {
    let unavailable = || {
        api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not connected to Redis yet",
        )
    };
    let dashboard = endpoints
        .dashboard
        .get()
        .ok_or_else(|| Box::new(unavailable()))?;
    let id = parse(id).map_err(|why| Box::new(api_error(StatusCode::BAD_REQUEST, why)))?;
    Ok((dashboard, id))
}

/// `GET /api/fleet`: the live replicas (each ready or not, and why), those lost lately, whether
/// they agree, and the terms in force (see `turnstile_core::fleet`), as the serving replica's
/// last heartbeat saw them.
async fn fleet_api(State(endpoints): State<Endpoints>) -> Response {
    match endpoints.dashboard.get().and_then(|d| d.fleet()) {
        Some(fleet) => json_answer(StatusCode::OK, serde_json::json!(fleet)),
        None => api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not connected to Redis yet",
        ),
    }
}

/// `GET /api/history[?hours=24]`: what every replica did in each minute of the last `hours`
/// hours (1 to 24): registrations, dead letters, delays and retries, oldest minute first.
async fn history_api(State(endpoints): State<Endpoints>, RawQuery(query): RawQuery) -> Response {
    let Some(dashboard) = endpoints.dashboard.get().cloned() else {
        return api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not connected to Redis yet",
        );
    };
    let most = turnstile_core::permit::HISTORY_HOURS;
    let hours = match query_params(query.as_deref(), ["hours"]).and_then(|[hours]| {
        hours.map_or(Ok(most), |h| match h.trim().parse::<u64>() {
            Ok(n) if (1..=most).contains(&n) => Ok(n),
            _ => Err(format!("hours: a whole number from 1 to {most}")),
        })
    }) {
        Ok(hours) => hours,
        Err(why) => return api_error(StatusCode::BAD_REQUEST, why),
    };
    match dashboard.history(hours).await {
        Ok(minutes) => json_answer(
            StatusCode::OK,
            serde_json::json!({
                "hours": hours,
                "read_ms": turnstile_core::domain::unix_ms(),
                "minutes": minutes,
            }),
        ),
        Err(error) => api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            crate::health::one_line(&error),
        ),
    }
}

/// The values of the query parameters `names` in a request's `query` (`None` for one not
/// given), in order; a parameter given twice is refused, naming it. Other parameters (the
/// dashboard's `token`) are left alone.
fn query_params<const N: usize>(
    query: Option<&str>,
    names: [&str; N],
) -> Result<[Option<String>; N], String> {
    let mut values: [Option<String>; N] = std::array::from_fn(|_| None);
    let Some(url) = query.and_then(|q| reqwest::Url::parse(&format!("http://api/?{q}")).ok())
    else {
        return Ok(values);
    };
    for (name, value) in url.query_pairs() {
        if let Some(i) = names.iter().position(|n| *n == name) {
            if values[i].is_some() {
                return Err(format!("{name}: given more than once"));
            }
            values[i] = Some(value.into_owned());
        }
    }
    Ok(values)
}

/// `GET /api/batches/{batch_id}`: a batch's counts, whether it is done and its ETA; with
/// `?deadline=` (RFC 3339), whether it is expected to be done by then (`meets_deadline`, null
/// while its total is unknown) and the deadline in UTC.
async fn batch_api(
    State(endpoints): State<Endpoints>,
    Path(batch): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let (dashboard, batch) =
        match api_input(&endpoints, &batch, turnstile_core::domain::BatchId::parse) {
            Ok(input) => input,
            Err(answer) => return *answer,
        };
    let deadline = match query_params(query.as_deref(), ["deadline"]).and_then(|[deadline]| {
        deadline
            .map(|d| progress::parse_deadline(&d).map_err(|why| format!("deadline: {why}")))
            .transpose()
    }) {
        Ok(deadline) => deadline,
        Err(why) => return api_error(StatusCode::BAD_REQUEST, why),
    };
    let (admin, records) = (dashboard.admin(), dashboard.records());
    match progress::read_batch(admin, records, &batch).await {
        Ok(Some(report)) => {
            let mut answer = serde_json::json!(report);
            if let Some(deadline) = deadline {
                answer["deadline"] = progress::rfc3339(deadline).into();
                answer["meets_deadline"] = report.meets(deadline, OffsetDateTime::now_utc()).into();
            }
            json_answer(StatusCode::OK, answer)
        }
        Ok(None) => json_answer(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "no message of this batch has been seen (or its record expired)", "batch_id": batch.as_str()}),
        ),
        Err(error) => api_error(StatusCode::SERVICE_UNAVAILABLE, error),
    }
}

/// `GET /api/sellers/{seller_id}`: a seller's backlog, limits, pause and ETA, and its batches;
/// with `?rows=N` and/or `?deadline=` (RFC 3339), its `admission`: when N more rows published
/// now would all be registered behind its backlog, and whether by the deadline (see
/// `progress::Admission`).
async fn seller_api(
    State(endpoints): State<Endpoints>,
    Path(seller): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let (dashboard, seller) =
        match api_input(&endpoints, &seller, turnstile_core::domain::SellerId::parse) {
            Ok(input) => input,
            Err(answer) => return *answer,
        };
    let question =
        match query_params(query.as_deref(), ["rows", "deadline"]).and_then(|[rows, deadline]| {
            progress::Question::from_params(rows.as_deref(), deadline.as_deref())
        }) {
            Ok(question) => question,
            Err(why) => return api_error(StatusCode::BAD_REQUEST, why),
        };
    let (admin, records) = (dashboard.admin(), dashboard.records());
    match progress::read_seller(admin, records, &seller).await {
        Ok(report) => {
            let mut answer = serde_json::json!(report);
            if let Some(question) = question {
                let admission = report.admission(&question, OffsetDateTime::now_utc());
                answer["admission"] = serde_json::json!(admission);
            }
            json_answer(StatusCode::OK, answer)
        }
        Err(error) => api_error(StatusCode::SERVICE_UNAVAILABLE, error),
    }
}

/// With `TURNSTILE_HTTP_TOKEN` set, the dashboard and its data need the token: as
/// `Authorization: Bearer <token>`, as the cookie set by opening `/?token=<token>` once, or in
/// that query. Compared in constant time. /metrics, /healthz and /readyz stay open. (The
/// actions check the token themselves, and never take it from the query: see
/// [`crate::actions`].)
async fn require_token(
    State(endpoints): State<Endpoints>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = &endpoints.token else {
        return next.run(request).await;
    };
    let expected = token.expose_secret().as_bytes();
    let matches = |given: &str| bool::from(given.as_bytes().ct_eq(expected));
    if carries_token(token, request.headers()) {
        return next.run(request).await;
    }
    let in_query = request
        .uri()
        .query()
        .and_then(|q| reqwest::Url::parse(&format!("http://dashboard/?{q}")).ok())
        .is_some_and(|url| {
            url.query_pairs()
                .any(|(name, value)| name == "token" && matches(&value))
        });
    let path = request.uri().path().to_owned();
    if in_query {
        let cookie = format!(
            "{TOKEN_COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
            token.expose_secret()
        );
        // The page opened with the token (the login form, a bookmarked link): to the page
        // without it, so that the token stays in neither the address bar nor the history.
        let mut response = if path == "/" && request.method() == axum::http::Method::GET {
            let rest = without_token(request.uri().query().unwrap_or_default());
            let location = if rest.is_empty() {
                "/".to_owned()
            } else {
                format!("/?{rest}")
            };
            (StatusCode::SEE_OTHER, [(header::LOCATION, location)]).into_response()
        } else {
            next.run(request).await
        };
        if let Ok(value) = header::HeaderValue::from_str(&cookie) {
            response.headers_mut().insert(header::SET_COOKIE, value);
        }
        return response;
    }
    let why = "the dashboard needs TURNSTILE_HTTP_TOKEN: open /?token=<token> or send Authorization: Bearer <token>";
    let challenge = [(header::WWW_AUTHENTICATE, "Bearer")];
    if path.starts_with("/api/") {
        return (
            StatusCode::UNAUTHORIZED,
            challenge,
            axum::Json(serde_json::json!({ "error": why })),
        )
            .into_response();
    }
    if path == "/" {
        return (StatusCode::UNAUTHORIZED, challenge, Html(LOGIN_PAGE)).into_response();
    }
    (StatusCode::UNAUTHORIZED, challenge, format!("{why}\n")).into_response()
}

/// The page a browser gets without the token: a form that opens `/?token=…` (which sets the
/// cookie and sends it on to `/` without the token).
const LOGIN_PAGE: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>turnstile: sign in</title>
<style>body{font:15px system-ui,sans-serif;margin:15vh auto;max-width:26em;color:#1c2330}
input{font:inherit;padding:.4em;width:100%;box-sizing:border-box;margin:.5em 0}
button{font:inherit;padding:.4em 1.2em}</style></head>
<body><h1>turnstile</h1>
<p>This console needs the replicas' <code>TURNSTILE_HTTP_TOKEN</code>.</p>
<form method="get" action="/"><label>Token<input type="password" name="token" autocomplete="current-password" autofocus required></label>
<button type="submit">Open the console</button></form></body></html>
"#;

/// A query string without its `token` parameters (the rest kept as given).
fn without_token(query: &str) -> String {
    query
        .split('&')
        .filter(|pair| !pair.is_empty() && pair.split('=').next() != Some("token"))
        .collect::<Vec<_>>()
        .join("&")
}

/// Serves the endpoints until `shutdown`; returns the bound address (port 0 picks a free one).
pub async fn serve(
    addr: SocketAddr,
    endpoints: Endpoints,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    prometheus();
    let dashboard = Router::new()
        .route("/", get(|| async { Html(dashboard::PAGE) }))
        .route("/api/dashboard", get(dashboard_data))
        .route("/api/fleet", get(fleet_api))
        .route("/api/history", get(history_api))
        .route("/api/batches/{batch_id}", get(batch_api))
        .route("/api/sellers/{seller_id}", get(seller_api))
        .route("/api/search", get(crate::lookup::search))
        .route("/api/dead-letters", get(crate::lookup::dead_letters))
        .route_layer(axum::middleware::from_fn_with_state(
            endpoints.clone(),
            require_token,
        ));
    let app = Router::new()
        .merge(dashboard)
        .merge(crate::actions::routes(&endpoints))
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(endpoints);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("TURNSTILE_HTTP_ADDR: cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        let served = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
        if let Err(error) = served {
            tracing::warn!(%error, "the HTTP endpoint stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod token_tests {
    use super::*;

    #[test]
    fn the_query_gives_the_parameters_asked_for_once_each_and_leaves_the_others() {
        let rows_and_deadline = |q: Option<&str>| query_params(q, ["rows", "deadline"]);
        assert_eq!(rows_and_deadline(None), Ok([None, None]));
        assert_eq!(
            rows_and_deadline(Some("token=t&deadline=2026-11-26T10:00:00%2B09:00")),
            Ok([None, Some("2026-11-26T10:00:00+09:00".to_owned())])
        );
        assert_eq!(
            rows_and_deadline(Some("rows=5&deadline=")),
            Ok([Some("5".to_owned()), Some(String::new())])
        );
        assert_eq!(
            rows_and_deadline(Some("rows=5&rows=6")),
            Err("rows: given more than once".to_owned())
        );
    }

    #[test]
    fn a_blank_token_is_refused_and_a_real_one_kept() {
        for blank in ["", " ", "\t\n "] {
            let said = parse_token(blank).expect_err("refused");
            assert!(said.contains("empty"), "{said}");
        }
        for bad in ["a b", "tok;en", "a,b", "t\u{e9}"] {
            assert!(parse_token(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_token("s3cr3t-T0ken").unwrap().expose_secret(),
            "s3cr3t-T0ken"
        );
    }
}
