//! What an operator does from the dashboard, on every replica at once: pause or resume a
//! seller, set or clear its limit (as `turnstile limits set` / `clear`: the seller's reserved
//! slots are re-planned under the new terms), and replay or discard dead letters (one
//! message, a seller's, a batch's, one reason and detail among them), a dry run first.
//!
//! **Who may act.** Actions are off unless `TURNSTILE_HTTP_TOKEN` is set (a replica without it
//! answers 403 and the page shows them disabled, saying why). With it, an action needs the
//! token as `Authorization: Bearer <token>` or as the HttpOnly, SameSite=Strict cookie the page
//! gets from `/?token=…`; never from the query string (it would land in logs and history).
//!
//! **Cross-site requests** cannot act: every action is a POST with a JSON body
//! (`Content-Type: application/json`, else 415), must carry the header
//! `X-Turnstile-Action: 1`, that value once (which a cross-site form cannot send, and a cross-site script can
//! only with a CORS preflight that turnstile never grants), and is refused (403) when the
//! browser says it is cross-site: `Sec-Fetch-Site` other than `same-origin`, or an `Origin`
//! other than the dashboard's own (`http(s)://<Host>`). These checks come before the token's,
//! so a request with a stolen cookie from another site is refused all the same.
//!
//! **Inputs are untrusted**: seller, batch and message ids are parsed as the message body's
//! are (`turnstile_core::domain`), limits as `TURNSTILE_LIMIT` is and checked against the
//! fleet's terms as `turnstile limits set` does, a pause at most 24 h, the operator's name
//! 1 to 64 characters without control characters; anything else is a 400 saying what is
//! wrong, and unknown fields are refused.
//!
//! **Every action is audited** ([`crate::audit`]): logged under `turnstile::audit` and kept in
//! Redis for every replica's page, whether it was done, failed or refused for its input.
//! Requests refused before their input is read (no token, cross-site) are logged only.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use turnstile_core::config::{Limits, format_duration};
use turnstile_core::domain::SellerId;
use turnstile_core::permit::pause_span;

use crate::audit::{Entry, Who};
use crate::broker_link::DeadLetterQuery;
use crate::dashboard::ACTIONS_OFF;
use crate::dashboard::Dashboard;
use crate::endpoints::{Endpoints, api_error, carries_token, json_answer};
use crate::health::one_line;
use crate::ids::seller_id;

/// The header every action must carry (see the module's doc).
pub const ACTION_HEADER: &str = "x-turnstile-action";
/// Largest body an action takes.
const BODY_LIMIT: usize = 16 * 1024;
/// Longest operator name (characters).
const OPERATOR_CHARS: usize = 64;
/// Dead letters a dry run lists (it counts them all).
const DRY_RUN_SHOWN: usize = 200;

/// The actions' routes, each behind [`guard`].
pub fn routes(endpoints: &Endpoints) -> Router<Endpoints> {
    Router::new()
        .route("/api/actions/pause", post(pause))
        .route("/api/actions/resume", post(resume))
        .route("/api/actions/set-limit", post(set_limit))
        .route("/api/actions/clear-limit", post(clear_limit))
        .route("/api/actions/replay", post(replay))
        .route("/api/actions/discard", post(discard))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .route_layer(axum::middleware::from_fn_with_state(
            endpoints.clone(),
            guard,
        ))
}

/// The peer's address, when the server records it.
fn remote_of(request: &Request) -> Option<SocketAddr> {
    request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0)
}

/// Why a request is not the dashboard's own page (or an API client) asking, if it is not.
fn cross_site(headers: &HeaderMap) -> Option<&'static str> {
    let text = |name: &str| headers.get(name).map(|v| v.to_str().unwrap_or("\u{fffd}"));
    if let Some(site) = text("sec-fetch-site")
        && site != "same-origin"
    {
        return Some(
            "cross-site request refused: the browser says it comes from another site (Sec-Fetch-Site)",
        );
    }
    if let Some(origin) = text(header::ORIGIN.as_str()) {
        let host = text(header::HOST.as_str()).unwrap_or_default();
        let ours = !host.is_empty()
            && (origin == format!("http://{host}") || origin == format!("https://{host}"));
        if !ours {
            return Some(
                "cross-site request refused: its Origin is not this dashboard's (a proxy in front must pass the Host header through)",
            );
        }
    }
    let mut action = headers.get_all(ACTION_HEADER).iter();
    match (action.next(), action.next()) {
        (None, _) => Some(
            "refused: an action needs the header X-Turnstile-Action: 1 (the page sends it; a cross-site form cannot)",
        ),
        (Some(value), None) if value.as_bytes() == b"1" => None,
        _ => Some(
            "refused: the header X-Turnstile-Action must be exactly 1, once (the page sends it; a cross-site form cannot)",
        ),
    }
}

/// Whether the body is declared JSON.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// Lets an action through only with the token, from the dashboard's own origin, as JSON (see
/// the module's doc); logs every refusal under `turnstile::audit`.
async fn guard(
    State(endpoints): State<Endpoints>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    // Any other method gets the router's 405: an action is a POST.
    if request.method() != axum::http::Method::POST {
        return next.run(request).await;
    }
    let headers = request.headers();
    let refusal = match &endpoints.token {
        None => Some((StatusCode::FORBIDDEN, ACTIONS_OFF)),
        Some(token) => {
            if let Some(why) = cross_site(headers) {
                Some((StatusCode::FORBIDDEN, why))
            } else if !is_json(headers) {
                Some((
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "an action takes a JSON body: Content-Type: application/json",
                ))
            } else if !carries_token(token, headers) {
                Some((
                    StatusCode::UNAUTHORIZED,
                    "an action needs TURNSTILE_HTTP_TOKEN: as Authorization: Bearer <token>, or the cookie the page gets from /?token=<token>",
                ))
            } else {
                None
            }
        }
    };
    let Some((status, why)) = refusal else {
        // On a task of its own: a client that goes away (or times out) drops its request's
        // future, which would cut an action between its steps (a replay between a letter's
        // republish and its removal) and lose its audit entry. The action runs to its end and
        // is audited whatever the client does.
        return match tokio::spawn(next.run(request)).await {
            Ok(response) => response,
            Err(error) => api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the action did not finish: {error}"),
            ),
        };
    };
    let action = request
        .uri()
        .path()
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    let replica = endpoints.dashboard.get().map_or_else(
        || format!("pid {}", std::process::id()),
        |d| d.replica_name(),
    );
    let mut entry = Entry::new(&action, Who::of(remote_of(&request), headers), &replica);
    entry.outcome = "refused".into();
    entry.result = why.to_owned();
    entry.log();
    api_error(status, why)
}

/// An action under way: the dashboard it acts through and its audit entry.
struct Action {
    dashboard: Arc<Dashboard>,
    entry: Entry,
}

impl Action {
    /// Reads an action's request: who sent it and its body as `T` (unknown fields refused);
    /// or the answer to give (400 for a body that does not parse, recorded; 503 before the
    /// replica has reached Redis).
    async fn read<T: DeserializeOwned + Operated>(
        endpoints: &Endpoints,
        request: Request,
        name: &str,
    ) -> Result<(Self, T), Response> {
        let Some(dashboard) = endpoints.dashboard.get().cloned() else {
            return Err(api_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "not connected to Redis yet",
            ));
        };
        let who = Who::of(remote_of(&request), request.headers());
        let entry = Entry::new(name, who, &dashboard.replica_name());
        let mut action = Self { dashboard, entry };
        let body = match axum::body::to_bytes(request.into_body(), BODY_LIMIT).await {
            Ok(body) => body,
            Err(_) => {
                return Err(action
                    .refuse(format!("the body is larger than {BODY_LIMIT} bytes"))
                    .await);
            }
        };
        let asked: T = match serde_json::from_slice(&body) {
            Ok(asked) => asked,
            Err(error) => return Err(action.refuse(format!("the body: {error}")).await),
        };
        match operator(asked.operator()) {
            Ok(name) => action.entry.who.operator = name,
            Err(why) => return Err(action.refuse(why).await),
        }
        action.entry.argument = asked.argument();
        Ok((action, asked))
    }

    /// Reads an action on one seller ([`Action::read`]) and its seller's id; or the answer to
    /// give (400 for an id that cannot be a seller's, recorded).
    async fn read_for_seller<T: DeserializeOwned + Operated>(
        endpoints: &Endpoints,
        request: Request,
        name: &str,
    ) -> Result<(Self, T, SellerId), Response> {
        let (mut action, asked) = Self::read::<T>(endpoints, request, name).await?;
        let given = asked.seller().unwrap_or_default().to_owned();
        action.entry.seller = Some(given.clone());
        match seller_id(&given) {
            Ok(seller) => Ok((action, asked, seller)),
            Err(why) => Err(action.refuse(why).await),
        }
    }

    /// Refuses it for its input (400), recorded.
    async fn refuse(mut self, why: String) -> Response {
        self.entry.outcome = "refused".into();
        self.entry.result = why.clone();
        self.entry.record(self.dashboard.records()).await;
        api_error(StatusCode::BAD_REQUEST, why)
    }

    /// It was tried and failed (Redis or the broker did not do it): 503, recorded.
    async fn failed(mut self, error: impl std::fmt::Display) -> Response {
        let why = error.to_string();
        self.entry.outcome = "failed".into();
        self.entry.result = why.clone();
        self.entry.record(self.dashboard.records()).await;
        api_error(StatusCode::SERVICE_UNAVAILABLE, why)
    }

    /// It was done: `result` says what it did, `details` add to the answer; recorded.
    async fn done(mut self, result: String, details: serde_json::Value) -> Response {
        self.entry.outcome = "done".into();
        self.entry.result = result.clone();
        self.entry.record(self.dashboard.records()).await;
        self.dashboard.invalidate().await;
        let mut answer =
            json!({"action": self.entry.action, "result": result, "dry_run": self.entry.dry_run});
        if let (Some(answer), serde_json::Value::Object(details)) =
            (answer.as_object_mut(), details)
        {
            answer.extend(details);
        }
        json_answer(StatusCode::OK, answer)
    }
}

/// A request body that may name its operator.
trait Operated {
    fn operator(&self) -> Option<&str>;
    /// The seller the action is on, for one on a seller.
    fn seller(&self) -> Option<&str> {
        None
    }
    /// What the audit entry records beside the seller (a duration, a limit).
    fn argument(&self) -> Option<String> {
        None
    }
}

/// The operator's name as given: trimmed, `None` when blank; 1 to 64 characters without
/// control characters.
fn operator(name: Option<&str>) -> Result<Option<String>, String> {
    let Some(name) = name.map(str::trim).filter(|n| !n.is_empty()) else {
        return Ok(None);
    };
    if name.chars().count() > OPERATOR_CHARS || name.chars().any(char::is_control) {
        return Err(format!(
            "operator: at most {OPERATOR_CHARS} characters, without control characters"
        ));
    }
    Ok(Some(name.to_owned()))
}

/// `{"seller": …, "for": "15m"}` (`for` left out: until resumed).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    seller: String,
    #[serde(rename = "for")]
    duration: Option<String>,
    operator: Option<String>,
}

/// `{"seller": …}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SellerBody {
    seller: String,
    operator: Option<String>,
}

/// `{"seller": …, "limit": "10/1s,500/1h"}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitBody {
    seller: String,
    limit: String,
    operator: Option<String>,
}

/// `{"message_id"?, "seller"?, "batch"?, "reason"?, "detail"?, "dry_run": true}`: the dead
/// letters a replay or a discard takes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeadLettersBody {
    message_id: Option<String>,
    seller: Option<String>,
    batch: Option<String>,
    reason: Option<String>,
    detail: Option<String>,
    dry_run: bool,
    /// A replay takes superseded dead letters too (see `Selection::force`).
    #[serde(default)]
    force: bool,
    operator: Option<String>,
}

impl DeadLettersBody {
    /// The dead letters it takes, its parts recorded in `entry`; refused when it names no
    /// message, seller or batch, or (unless a dry run) no operator.
    fn query(&self, entry: &mut Entry, verb: &str) -> Result<DeadLetterQuery, String> {
        entry.seller = self.seller.clone();
        entry.batch = self.batch.clone();
        entry.message = self.message_id.clone();
        entry.argument =
            crate::audit::dead_letters_argument(self.reason.as_deref(), self.detail.as_deref());
        entry.dry_run = self.dry_run;
        let query = DeadLetterQuery::parse(
            self.message_id.as_deref(),
            self.seller.as_deref(),
            self.batch.as_deref(),
            self.reason.as_deref(),
        )
        .and_then(|q| q.with_detail(self.detail.as_deref()))?
        .forced(self.force);
        if query.names_nothing() {
            return Err(format!(
                "choose what to {verb}: a message id, a seller or a batch (to {verb} every dead letter, use `turnstile dead-letters {verb}`)"
            ));
        }
        // It moves or removes messages: the audit trail names who did it.
        if !self.dry_run && entry.who.operator.is_none() {
            return Err(format!(
                "operator: a {verb} needs your name (for the audit trail)"
            ));
        }
        Ok(query)
    }
}

impl Operated for PauseBody {
    fn operator(&self) -> Option<&str> {
        self.operator.as_deref()
    }
    fn seller(&self) -> Option<&str> {
        Some(&self.seller)
    }
    fn argument(&self) -> Option<String> {
        self.duration.clone()
    }
}
impl Operated for SellerBody {
    fn operator(&self) -> Option<&str> {
        self.operator.as_deref()
    }
    fn seller(&self) -> Option<&str> {
        Some(&self.seller)
    }
}
impl Operated for LimitBody {
    fn operator(&self) -> Option<&str> {
        self.operator.as_deref()
    }
    fn seller(&self) -> Option<&str> {
        Some(&self.seller)
    }
    fn argument(&self) -> Option<String> {
        Some(self.limit.clone())
    }
}
impl Operated for DeadLettersBody {
    fn operator(&self) -> Option<&str> {
        self.operator.as_deref()
    }
}

/// `POST /api/actions/pause`: pauses a seller on every replica for `for` (at most 24 h;
/// without it, until resumed, at most 24 h), as `turnstile limits pause` does: a longer pause
/// already in place is kept, and the slots reserved for its waiting messages are given back
/// (they reserve anew after the pause).
async fn pause(State(endpoints): State<Endpoints>, request: Request) -> Response {
    let (mut action, asked, seller) =
        match Action::read_for_seller::<PauseBody>(&endpoints, request, "pause").await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    // As `turnstile limits pause`: at most 24h, and without a duration until resumed.
    let asked_for = match asked.duration.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(given) => match turnstile_core::config::duration_arg(given) {
            Ok(d) => Some(d),
            Err(why) => return action.refuse(format!("for {given:?}: {why}")).await,
        },
    };
    let duration = match pause_span(asked_for) {
        Ok(d) => d,
        Err(why) => return action.refuse(format!("for: {why}")).await,
    };
    action.entry.argument = Some(match asked_for {
        Some(_) => format_duration(duration),
        None => format!("until resumed (at most {})", format_duration(duration)),
    });
    match action.dashboard.admin().pause_now(&seller, duration).await {
        Ok(lasts) => {
            let result = if lasts > duration + Duration::from_secs(1) {
                format!(
                    "{seller} was already paused longer: the pause lasts {}s more",
                    lasts.as_secs()
                )
            } else {
                format!(
                    "{seller} paused for {} on every replica",
                    format_duration(duration)
                )
            };
            action
                .done(
                    result,
                    json!({"seller": seller.as_str(), "paused_for_s": lasts.as_secs_f64()}),
                )
                .await
        }
        Err(error) => action.failed(format!("pausing {seller}: {error}")).await,
    }
}

/// `POST /api/actions/resume`: lifts a seller's pause on every replica.
async fn resume(State(endpoints): State<Endpoints>, request: Request) -> Response {
    let (action, _, seller) =
        match Action::read_for_seller::<SellerBody>(&endpoints, request, "resume").await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    match action.dashboard.admin().resume(&seller).await {
        Ok(was) => {
            let result = if was {
                format!("{seller}: pause lifted on every replica")
            } else {
                format!("{seller} was not paused")
            };
            action
                .done(
                    result,
                    json!({"seller": seller.as_str(), "was_paused": was}),
                )
                .await
        }
        Err(error) => action.failed(format!("resuming {seller}: {error}")).await,
    }
}

/// `POST /api/actions/set-limit`: a seller's limit override (one limit or a stack), on every
/// replica at once, its reserved slots re-planned (as `turnstile limits set`).
async fn set_limit(State(endpoints): State<Endpoints>, request: Request) -> Response {
    let (mut action, asked, seller) =
        match Action::read_for_seller::<LimitBody>(&endpoints, request, "set-limit").await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    let limit: Limits = match turnstile_core::config::limits_arg(asked.limit.trim()) {
        Ok(limit) => limit,
        Err(why) => {
            return action
                .refuse(format!("limit {:?}: {why}", asked.limit))
                .await;
        }
    };
    action.entry.argument = Some(limit.to_string());
    // As `turnstile limits set`: the new stack must hold under the fleet's terms.
    if let Some(controls) = action.dashboard.controls() {
        let checked = turnstile_core::config::LimiterArgs {
            limit: limit.clone(),
            ..(*controls.permits.limiter()).clone()
        }
        .check();
        if let Err(why) = checked {
            return action.refuse(format!("limit {limit}: {why}")).await;
        }
    }
    match action
        .dashboard
        .admin()
        .set_limit(&seller, limit.clone())
        .await
    {
        Ok(()) => {
            let result = format!(
                "{seller}: limit {limit} (override) on every replica; its reserved slots re-planned"
            );
            action
                .done(
                    result,
                    json!({"seller": seller.as_str(), "limit": limit.to_string()}),
                )
                .await
        }
        Err(error) => {
            action
                .failed(format!("setting {seller}'s limit: {error}"))
                .await
        }
    }
}

/// `POST /api/actions/clear-limit`: removes a seller's override (the default applies again).
async fn clear_limit(State(endpoints): State<Endpoints>, request: Request) -> Response {
    let (action, _, seller) =
        match Action::read_for_seller::<SellerBody>(&endpoints, request, "clear-limit").await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    let admin = action.dashboard.admin().clone();
    match admin.clear_limit(&seller).await {
        Ok(had) => {
            let default = admin.default_limit();
            let result = if had {
                format!("{seller}: override cleared; the default {default} applies")
            } else {
                format!("{seller} had no override; the default {default} applies")
            };
            action
                .done(
                    result,
                    json!({"seller": seller.as_str(), "had_override": had, "limit": default.to_string()}),
                )
                .await
        }
        Err(error) => {
            action
                .failed(format!("clearing {seller}'s limit: {error}"))
                .await
        }
    }
}

/// `POST /api/actions/replay`: moves the chosen dead letters back to the work queue (attempts
/// reset, counted as waiting again): those of one message, a seller or a batch (and, among
/// them, of one reason). With `"dry_run": true` nothing moves: the answer lists what would.
async fn replay(State(endpoints): State<Endpoints>, request: Request) -> Response {
    let (mut action, asked) =
        match Action::read::<DeadLettersBody>(&endpoints, request, "replay").await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    let query = match asked.query(&mut action.entry, "replay") {
        Ok(query) => query,
        Err(why) => return action.refuse(why).await,
    };
    let (Some(link), Some(controls)) = (
        action.dashboard.broker().cloned(),
        action.dashboard.controls().cloned(),
    ) else {
        return action.failed(NO_BROKER_LINK).await;
    };
    match link
        .replay_dead(&query, &controls, asked.dry_run, DRY_RUN_SHOWN)
        .await
    {
        Ok(replayed) => {
            let what = query.describe();
            let mut result = if asked.dry_run {
                format!(
                    "dry run: {} dead letter(s) of {what} would move back to the work queue; nothing moved",
                    replayed.moved
                )
            } else {
                format!(
                    "{} dead letter(s) of {what} moved back to the work queue",
                    replayed.moved
                )
            };
            if replayed.refused > 0 {
                result.push_str(&format!(
                    "; {} superseded dead letter(s) left (a newer message of their product took their place; replay with force to move them too)",
                    replayed.refused
                ));
            }
            action
                .done(result, serde_json::to_value(&replayed).unwrap_or_default())
                .await
        }
        Err(error) => {
            action
                .failed(format!("replaying: {}", one_line(&error)))
                .await
        }
    }
}

/// What a dead-letter action answers on a replica without the operator side's broker link.
const NO_BROKER_LINK: &str = "this replica has no broker link for dead letters (it serves no HTTP)";

/// `POST /api/actions/discard`: removes the chosen dead letters from the dead-letter queue for
/// good (not republished; their messages stay counted dead): those of one message, a seller
/// or a batch (and, among them, of one reason and one detail). With `"dry_run": true` nothing
/// goes: the answer lists what would.
async fn discard(State(endpoints): State<Endpoints>, request: Request) -> Response {
    let (mut action, asked) =
        match Action::read::<DeadLettersBody>(&endpoints, request, "discard").await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    let query = match asked.query(&mut action.entry, "discard") {
        Ok(query) => query,
        Err(why) => return action.refuse(why).await,
    };
    let Some(link) = action.dashboard.broker().cloned() else {
        return action.failed(NO_BROKER_LINK).await;
    };
    match link
        .discard_dead(&query, asked.dry_run, DRY_RUN_SHOWN)
        .await
    {
        Ok(done) => {
            let what = query.describe();
            let result = if asked.dry_run {
                format!(
                    "dry run: {} dead letter(s) of {what} would be discarded; nothing removed",
                    done.matched
                )
            } else {
                format!("{} dead letter(s) of {what} discarded", done.discarded)
            };
            action
                .done(result, serde_json::to_value(&done).unwrap_or_default())
                .await
        }
        Err(error) => {
            action
                .failed(format!("discarding: {}", one_line(&error)))
                .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        headers
    }

    #[test]
    fn only_a_same_origin_request_with_the_action_header_gets_through() {
        let host = ("host", "127.0.0.1:9464");
        let ours = [host, (ACTION_HEADER, "1")];
        assert_eq!(cross_site(&headers(&ours)), None, "an API client");
        let page = [
            host,
            (ACTION_HEADER, "1"),
            ("origin", "http://127.0.0.1:9464"),
            ("sec-fetch-site", "same-origin"),
        ];
        assert_eq!(cross_site(&headers(&page)), None, "the page itself");
        for bad in [
            vec![host, (ACTION_HEADER, "1"), ("sec-fetch-site", "cross-site")],
            vec![host, (ACTION_HEADER, "1"), ("sec-fetch-site", "same-site")],
            vec![
                host,
                (ACTION_HEADER, "1"),
                ("origin", "http://evil.example"),
            ],
            vec![host, (ACTION_HEADER, "1"), ("origin", "null")],
            vec![(ACTION_HEADER, "1"), ("origin", "http://127.0.0.1:9464")],
            vec![host, ("origin", "http://127.0.0.1:9464")],
        ] {
            assert!(cross_site(&headers(&bad)).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn the_action_header_must_say_1_and_nothing_else() {
        let host = ("host", "127.0.0.1:9464");
        for value in ["0", "", "true", "yes", "11", " 1", "1 ", "01", "1,1"] {
            let why = cross_site(&headers(&[host, (ACTION_HEADER, value)]));
            assert!(
                why.is_some_and(|w| w.contains("X-Turnstile-Action")),
                "{value:?}: {why:?}"
            );
        }
        let mut twice = headers(&[host, (ACTION_HEADER, "1")]);
        twice.append(ACTION_HEADER, "0".parse().unwrap());
        assert!(cross_site(&twice).is_some(), "a second value other than 1");
    }

    #[test]
    fn only_json_bodies_are_actions() {
        assert!(is_json(&headers(&[("content-type", "application/json")])));
        assert!(is_json(&headers(&[(
            "content-type",
            "Application/JSON; charset=utf-8"
        )])));
        for form in [
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "text/plain",
        ] {
            assert!(!is_json(&headers(&[("content-type", form)])), "{form}");
        }
        assert!(!is_json(&HeaderMap::new()));
    }

    #[test]
    fn inputs_are_checked() {
        assert_eq!(operator(None), Ok(None));
        assert_eq!(operator(Some("  ")), Ok(None));
        assert_eq!(operator(Some(" ana ")), Ok(Some("ana".into())));
        assert!(operator(Some("a\nb")).is_err());
        assert!(operator(Some(&"x".repeat(65))).is_err());
        assert!(seller_id("").is_err());
        assert!(seller_id(&"s".repeat(129)).is_err());
        assert!(seller_id("S {1}: ü").is_ok());
    }
}
