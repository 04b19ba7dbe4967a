//! What every endpoint of the operator side shares: their state ([`Endpoints`]), JSON answers
//! and errors, the token check.

use std::sync::{Arc, OnceLock};

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;
use turnstile_core::telemetry::Readiness;
use turnstile_core::worker::Stats;

use crate::dashboard::Dashboard;

/// What the endpoints read: readiness, the replica's counters, and its dashboard once the
/// replica has connected to Redis (until then `/api/dashboard` answers 503).
#[derive(Clone)]
pub struct Endpoints {
    /// When set, `/` and `/api/dashboard` need it (see [`require_token`]), and the page may
    /// act (see [`crate::actions`]).
    pub token: Option<SecretString>,
    pub ready: Readiness,
    pub stats: Arc<Stats>,
    pub dashboard: Arc<OnceLock<Arc<Dashboard>>>,
}

/// A JSON answer.
pub(crate) fn json_answer(status: StatusCode, body: serde_json::Value) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body.to_string(),
    )
        .into_response()
}

/// An error as the API answers it: `{"error": …}` with `status`.
pub(crate) fn api_error(status: StatusCode, error: impl std::fmt::Display) -> Response {
    json_answer(status, serde_json::json!({"error": error.to_string()}))
}

/// The cookie that carries the dashboard token after `/?token=…`.
pub(crate) const TOKEN_COOKIE: &str = "turnstile_token";

/// Whether `headers` carry `token`: as `Authorization: Bearer <token>` or as the cookie set by
/// opening `/?token=<token>`. Compared in constant time.
pub(crate) fn carries_token(token: &SecretString, headers: &header::HeaderMap) -> bool {
    let expected = token.expose_secret().as_bytes();
    let matches = |given: &str| bool::from(given.as_bytes().ct_eq(expected));
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| matches(given.trim()));
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .any(|(name, value)| name == TOKEN_COOKIE && matches(value));
    bearer || cookie
}
