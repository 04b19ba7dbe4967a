//! What the downstream answered, as the worker and a message's result read it: the
//! contract's response table ([`Reply`]) and the answer's status and capped body
//! ([`ApiResponse`]).

use std::time::Duration;

/// What the downstream answered, classified by the contract's response table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// 2xx: registered, with what the API said (for a registration API, the new product's id).
    Registered(ApiResponse),
    /// 429: the seller is over the downstream's limit; pause it for `retry_after` (or a window).
    Throttled { retry_after: Option<Duration> },
    /// 408, 425, 500, 502, 503, 504, a timeout or a connection error: retry later. `response`
    /// is the answer, when one came (a message whose attempts run out carries the last).
    Transient {
        why: String,
        response: Option<ApiResponse>,
    },
    /// Any other 4xx, a 3xx (never followed; `body` then names the Location) and other
    /// unexpected statuses: dead-letter at once. `body` is the excerpt for the dead letter's
    /// detail, `response` the answer as the message's result carries it (none when no request
    /// was sent).
    Rejected {
        status: u16,
        body: String,
        response: Option<ApiResponse>,
    },
}

impl Reply {
    /// A call that got no answer (a timeout, a connection error): retried.
    pub fn unanswered(why: String) -> Self {
        Reply::Transient {
            why,
            response: None,
        }
    }
}

/// Most bytes of a downstream answer's body a result carries ([`ApiResponse`]); a longer body
/// is cut there and marked truncated. No more than this (and one byte) is ever read.
pub const RESPONSE_CAP: usize = 16 * 1024;

/// What the downstream answered, as a message's result carries it: the status and the body,
/// read up to [`RESPONSE_CAP`] bytes. A JSON body is kept as JSON; any other (text, HTML,
/// binary, JSON cut by the cap) as text, invalid UTF-8 replaced by U+FFFD.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiResponse {
    pub status: u16,
    pub body: ResponseBody,
    /// Whether the body was longer than [`RESPONSE_CAP`] (or could not be read to its end).
    pub truncated: bool,
}

/// A downstream answer's body (see [`ApiResponse`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResponseBody {
    /// No body.
    Empty,
    /// A whole JSON document, as its text (valid JSON, checked when read).
    Json(String),
    /// Anything else, as text.
    Text(String),
}

impl ApiResponse {
    /// The answer with status `status` and body `bytes` (already capped), `truncated` if more
    /// was sent.
    pub fn new(status: u16, bytes: &[u8], truncated: bool) -> Self {
        let body = if bytes.iter().all(u8::is_ascii_whitespace) {
            ResponseBody::Empty
        } else {
            match std::str::from_utf8(bytes) {
                Ok(text)
                    if !truncated
                        && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok() =>
                {
                    ResponseBody::Json(text.trim().to_owned())
                }
                _ => ResponseBody::Text(String::from_utf8_lossy(bytes).into_owned()),
            }
        };
        Self {
            status,
            body,
            truncated,
        }
    }
}

/// Longest body excerpt kept for a dead letter's reason (characters); at most four times as
/// many bytes of a body are ever read.
pub(super) const EXCERPT: usize = 300;
