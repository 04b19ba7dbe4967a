//! Finding things from the dashboard (read only; behind `TURNSTILE_HTTP_TOKEN` when set, like
//! the page):
//! - `GET /api/search?q=<id>[&kind=any|seller|batch|message][&seller=<seller>]`: a seller (its
//!   limits, their use, pause, backlog, batches and retries waiting), a batch (its progress and
//!   ETA, as `/api/batches/{id}`), a message (its dead letters, and what its completion record
//!   says: registered, dead, or nothing), each found or said plainly not to be;
//! - `GET /api/dead-letters[?message_id=…][&seller=…][&batch=…][&reason=…][&detail=…]
//!   [&offset=0][&limit=100]`: the dead letters, browsable a page at a time (reason, detail,
//!   seller, batch, message id, when, body excerpt), every one selected counted and grouped by
//!   reason and detail (`groups`, largest first, at most 100; `other_groups` counts the rest).
//!
//! What turnstile cannot find, it says: a message's completion record is kept per seller (a
//! message id alone finds it only through its dead letters), records expire after
//! `TURNSTILE_DONE_TTL`, and results are published to `<queue>.results`, never kept.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::json;
use turnstile_core::domain::SellerId;
use turnstile_core::domain::unix_ms;
use turnstile_upload::progress;

use crate::broker_link::DeadLetterQuery;
use crate::dashboard::{Dashboard, LimitRow, RetryMessage};
use crate::endpoints::{Endpoints, api_error, json_answer};
use crate::health::one_line;
use crate::ids::{batch_id, message_id, seller_id};

/// Dead letters a listing shows by default, and at most.
const LISTED: usize = 100;
const LISTED_MAX: usize = 500;
/// What `/api/dead-letters` takes.
const PARAMETERS: [&str; 7] = [
    "message_id",
    "seller",
    "batch",
    "reason",
    "detail",
    "offset",
    "limit",
];
/// Retries waiting shown in a seller's view.
const RETRIES_SHOWN: usize = 20;

/// `/api/search`'s query.
#[derive(Deserialize)]
pub struct SearchQuery {
    q: String,
    #[serde(default)]
    kind: Kind,
    seller: Option<String>,
}

/// What a search looks for.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A seller, a batch and a message by that id.
    #[default]
    Any,
    Seller,
    Batch,
    Message,
}

/// A seller as a search shows it.
#[derive(Serialize)]
struct SellerView {
    /// Backlog, limits in force, pause, ETA and batches (as `/api/sellers/{id}`).
    #[serde(flatten)]
    report: progress::SellerReport,
    /// Each limit of its stack: used of capacity now, reserved ahead.
    limits: Vec<LimitRow>,
    binding: String,
    paused_ms: u64,
    /// Its messages waiting for a retry, soonest first (at most 20).
    retries: Vec<RetryMessage>,
    /// Its messages the replicas hold in their delay ladders (throttled, waiting for their
    /// slot), as each live replica last said it (every 5 s): how many, when the first and
    /// last are due, and the 20 soonest.
    held: Vec<HeldBy>,
    /// Whether anything of it is recorded at all (a batch, a pause, an override, use of its
    /// limit, a retry).
    known: bool,
}

/// What one replica holds of a seller.
#[derive(Serialize)]
struct HeldBy {
    replica: String,
    #[serde(flatten)]
    summary: turnstile_core::broker::ladder::HeldSummary,
}

/// A message as a search shows it.
#[derive(Serialize)]
struct MessageView {
    message_id: String,
    /// Its dead letters now (every copy).
    dead_letters: Vec<turnstile_core::broker::dead_letters::DeadLetter>,
    /// What its completion record says, per seller it was looked up under.
    records: Vec<RecordView>,
}

/// A completion record.
#[derive(Serialize)]
struct RecordView {
    seller: String,
    /// `registered`, `dead:<reason>`, or null (waiting, never seen, or expired).
    state: Option<String>,
    /// How long the record is kept yet, seconds.
    expires_in_s: Option<u64>,
}

/// `GET /api/search`: a seller, a batch or a message by id (see the module's doc).
pub async fn search(
    State(endpoints): State<Endpoints>,
    Query(query): Query<SearchQuery>,
) -> Response {
    let Some(dashboard) = endpoints.dashboard.get().cloned() else {
        return api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not connected to Redis yet",
        );
    };
    let q = query.q.trim().to_owned();
    if q.is_empty() {
        return api_error(
            StatusCode::BAD_REQUEST,
            "search for a seller id, a batch id or a message id: ?q=<id>",
        );
    }
    let wants = |kind: Kind| query.kind == Kind::Any || query.kind == kind;
    let mut said: Vec<String> = Vec::new();
    // An id that cannot be what is asked for (any of them, for `any`) is a 400.
    let parsed = [
        (Kind::Seller, seller_id(&q).map(drop)),
        (Kind::Batch, batch_id(&q).map(drop)),
        (Kind::Message, message_id(&q).map(drop)),
    ];
    if let Some((_, Err(why))) = parsed.iter().find(|(kind, _)| *kind == query.kind) {
        return api_error(StatusCode::BAD_REQUEST, why);
    }
    if query.kind == Kind::Any
        && let Some(why) = parsed
            .iter()
            .map(|(_, p)| p.clone().err())
            .collect::<Option<Vec<String>>>()
    {
        return api_error(
            StatusCode::BAD_REQUEST,
            format!("{q:?} cannot be an id: {}", why.join("; ")),
        );
    }
    let also_seller = match query
        .seller
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        Some(s) => match seller_id(s) {
            Ok(seller) => Some(seller),
            Err(why) => return api_error(StatusCode::BAD_REQUEST, why),
        },
        None => None,
    };

    let seller = match SellerId::parse(&q).ok().filter(|_| wants(Kind::Seller)) {
        Some(seller) => match seller_view(&dashboard, &seller).await {
            Ok(view) if view.known || query.kind == Kind::Seller => Some(view),
            Ok(_) => {
                said.push(format!(
                    "no seller {q:?} is known: no batch, pause, override, use of its limit or retry of it is recorded"
                ));
                None
            }
            Err(error) => return api_error(StatusCode::SERVICE_UNAVAILABLE, error),
        },
        None => None,
    };
    let batch = match batch_id(&q).ok().filter(|_| wants(Kind::Batch)) {
        Some(batch) => {
            match progress::read_batch(dashboard.admin(), dashboard.records(), &batch).await {
                Ok(Some(report)) => Some(report),
                Ok(None) => {
                    said.push(format!(
                        "no batch {q:?} has been seen (no replica saw a message of it, or its record expired after 7 days)"
                    ));
                    None
                }
                Err(error) => return api_error(StatusCode::SERVICE_UNAVAILABLE, error),
            }
        }
        None => None,
    };
    let message = match message_id(&q).ok().filter(|_| wants(Kind::Message)) {
        Some(_) => match message_view(
            &dashboard,
            &q,
            also_seller.as_ref(),
            endpoints.token.is_some(),
            &mut said,
        )
        .await
        {
            Ok(view) => view,
            Err(error) => return api_error(StatusCode::SERVICE_UNAVAILABLE, error),
        },
        None => None,
    };
    json_answer(
        StatusCode::OK,
        json!({
            "query": q,
            "seller": seller,
            "batch": batch,
            "message": message,
            "said": said,
        }),
    )
}

/// A seller's view: its report, limits, pause and retries.
async fn seller_view(dashboard: &Dashboard, seller: &SellerId) -> anyhow::Result<SellerView> {
    let (admin, records) = (dashboard.admin(), dashboard.records());
    let (report, retries, held) = tokio::try_join!(
        async { Ok(progress::read_seller(admin, records, seller).await?) },
        async {
            records
                .retries_due(seller)
                .await
                .map_err(anyhow::Error::from)
        },
        dashboard.held_of(seller.as_str()),
    )?;
    let usage = &report.usage;
    let known = !report.batches.is_empty()
        || usage.overridden
        || !usage.paused_for.is_zero()
        || usage.used > 0
        || usage.ahead > 0
        || !retries.is_empty()
        || !held.is_empty();
    Ok(SellerView {
        held: held
            .into_iter()
            .map(|(replica, summary)| HeldBy { replica, summary })
            .collect(),
        limits: usage.per_limit.iter().map(LimitRow::from).collect(),
        binding: usage.per_limit[usage.binding].limit.to_string(),
        paused_ms: usage.paused_for.as_millis() as u64,
        retries: retries
            .iter()
            .take(RETRIES_SHOWN)
            .map(|r| RetryMessage {
                message: r.message.clone(),
                batch: r.batch.clone(),
                due_in_ms: r.due_in.as_millis() as u64,
            })
            .collect(),
        known,
        report,
    })
}

/// A message's view: its dead letters, and its completion record under each seller known for
/// it (the one given, and those of its dead letters); `None` (with what was said) when
/// nothing of it is found.
async fn message_view(
    dashboard: &Dashboard,
    id: &str,
    seller: Option<&SellerId>,
    may_read_dead: bool,
    said: &mut Vec<String>,
) -> anyhow::Result<Option<MessageView>> {
    let message = message_id(id).map_err(anyhow::Error::msg)?;
    if !may_read_dead {
        said.push(format!(
            "{DEAD_LETTERS_NEED_TOKEN}: message {id:?} may be among them"
        ));
    }
    let dead_letters = match dashboard.broker().filter(|_| may_read_dead) {
        Some(link) => {
            let query =
                DeadLetterQuery::parse(Some(id), None, None, None).map_err(anyhow::Error::msg)?;
            match link.list_dead(&query, 0, LISTED_MAX).await {
                Ok(listed) => listed.letters,
                Err(error) => {
                    said.push(format!(
                        "the dead letters could not be read ({}): message {id:?} may be among them",
                        one_line(&error)
                    ));
                    Vec::new()
                }
            }
        }
        None => Vec::new(),
    };
    let mut sellers: Vec<SellerId> = seller.into_iter().cloned().collect();
    for letter in &dead_letters {
        if let Some(s) = letter
            .seller_id
            .as_deref()
            .and_then(|s| SellerId::parse(s).ok())
            && !sellers.contains(&s)
        {
            sellers.push(s);
        }
    }
    let mut records = Vec::new();
    for seller in &sellers {
        let state = dashboard.records().message_state(seller, &message).await?;
        records.push(RecordView {
            seller: seller.as_str().to_owned(),
            expires_in_s: state.as_ref().and_then(|(_, ttl)| ttl.map(|t| t.as_secs())),
            state: state.map(|(state, _)| state),
        });
    }
    let recorded = records.iter().any(|r| r.state.is_some());
    if dead_letters.is_empty() {
        said.push(format!("message {id:?} is not among the dead letters now"));
    }
    if sellers.is_empty() {
        said.push(format!(
            "message {id:?}: its completion record is kept under its seller; give the seller too (?seller=…) to look it up"
        ));
    } else {
        for r in records.iter().filter(|r| r.state.is_none()) {
            said.push(format!(
                "message {id:?} of seller {:?} has no completion record: it is waiting (never finished, or replayed since), was never seen, or its record expired (TURNSTILE_DONE_TTL)",
                r.seller
            ));
        }
    }
    if dead_letters.is_empty() && !recorded {
        said.push(
            "results are published to the results exchange and not kept by turnstile: the upload service has them".into(),
        );
        return Ok(None);
    }
    Ok(Some(MessageView {
        message_id: id.to_owned(),
        dead_letters,
        records,
    }))
}

/// Why dead letters are not read without TURNSTILE_HTTP_TOKEN.
const DEAD_LETTERS_NEED_TOKEN: &str = "reading dead letters needs TURNSTILE_HTTP_TOKEN (a listing takes them off their queue and puts them back, which counts toward the broker's delivery limit, and shows their bodies)";

/// `GET /api/dead-letters`: the dead letters the query selects (see the module's doc); only
/// with TURNSTILE_HTTP_TOKEN set.
pub async fn dead_letters(
    State(endpoints): State<Endpoints>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if endpoints.token.is_none() {
        return api_error(StatusCode::FORBIDDEN, DEAD_LETTERS_NEED_TOKEN);
    }
    let Some(dashboard) = endpoints.dashboard.get().cloned() else {
        return api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not connected to Redis yet",
        );
    };
    let given = |name: &str| query.get(name).map(|v| v.trim()).filter(|v| !v.is_empty());
    if let Some(unknown) = query.keys().find(|k| !PARAMETERS.contains(&k.as_str())) {
        return api_error(
            StatusCode::BAD_REQUEST,
            format!("unknown parameter {unknown:?}: {}", PARAMETERS.join(", ")),
        );
    }
    let selection = match DeadLetterQuery::parse(
        given("message_id"),
        given("seller"),
        given("batch"),
        given("reason"),
    )
    .and_then(|q| q.with_detail(query.get("detail").map(String::as_str)))
    {
        Ok(selection) => selection,
        Err(why) => return api_error(StatusCode::BAD_REQUEST, why),
    };
    let offset = match given("offset").map(str::parse::<u64>) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return api_error(StatusCode::BAD_REQUEST, "offset: a whole number >= 0");
        }
    };
    let limit = match given("limit").map(str::parse::<usize>) {
        None => LISTED,
        Some(Ok(n)) if (1..=LISTED_MAX).contains(&n) => n,
        Some(_) => {
            return api_error(
                StatusCode::BAD_REQUEST,
                format!("limit: a number from 1 to {LISTED_MAX}"),
            );
        }
    };
    let Some(link) = dashboard.broker() else {
        return api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this replica has no broker link for dead letters (it serves no HTTP)",
        );
    };
    match link.list_dead(&selection, offset, limit).await {
        Ok(listing) => json_answer(
            StatusCode::OK,
            json!({
                "selection": selection.describe(),
                "queue": link.topology().dead(),
                "read_ms": unix_ms(),
                "matched": listing.matched,
                "offset": listing.skipped,
                "limit": limit,
                "shown": listing.letters.len(),
                "groups": listing.groups,
                "other_groups": listing.other,
                "letters": listing.letters,
            }),
        ),
        Err(error) => api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("reading the dead letters: {}", one_line(&error)),
        ),
    }
}
