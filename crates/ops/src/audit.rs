//! The audit trail of what operators did from the dashboard, the HTTP API and the command line
//! (`turnstile limits`, `turnstile dead-letters replay`: [`Entry::from_command_line`]): every
//! action (and every refused attempt) is logged under the tracing target `turnstile::audit` with who (remote address,
//! user agent, the operator's name the page asks for), what (the action, its seller, batch or
//! message, dry run or not, the outcome) and when. Every action that was carried out or tried
//! is also kept in Redis (`Records::note_action`: the newest [`KEPT`], for [`KEPT_FOR`]), so
//! that every replica's page lists the recent actions, whichever replica served them.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use turnstile_core::domain::unix_ms;
use turnstile_core::permit::Records;

/// Most actions kept in Redis (the newest).
pub const KEPT: usize = 200;
/// How long the list is kept after its last action.
pub const KEPT_FOR: Duration = Duration::from_secs(30 * 24 * 3600);
/// Longest user agent recorded (characters).
const AGENT_CHARS: usize = 200;

/// Who asked: what the request says of its sender (the operator's name is what the page was
/// told; the forwarded-for header is recorded as sent, never trusted).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Who {
    /// The peer's address as the replica saw it.
    pub remote: String,
    /// `X-Forwarded-For`, as sent (a proxy's word, or anyone's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarded_for: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
    /// The name the operator typed into the page (or sent as `operator`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
}

impl Who {
    /// Who sent `headers` from `remote`.
    pub fn of(remote: Option<std::net::SocketAddr>, headers: &axum::http::HeaderMap) -> Self {
        let header = |name: &str, chars: usize| {
            headers.get(name).map(|v| {
                String::from_utf8_lossy(v.as_bytes())
                    .chars()
                    .take(chars)
                    .collect()
            })
        };
        Self {
            remote: remote.map_or_else(|| "unknown".to_owned(), |a| a.to_string()),
            forwarded_for: header("x-forwarded-for", AGENT_CHARS),
            user_agent: header("user-agent", AGENT_CHARS),
            operator: None,
        }
    }
}

/// What was asked and what came of it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    /// When (Unix ms, the serving replica's clock).
    pub at_ms: u64,
    /// `pause`, `resume`, `set-limit`, `clear-limit`, `replay`.
    pub action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seller: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The action's own argument: a pause's duration, a new limit, a replay's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argument: Option<String>,
    pub dry_run: bool,
    /// `done`, `failed` (the action was tried and failed) or `refused` (not tried).
    pub outcome: String,
    /// What it did or why it failed, in a sentence.
    pub result: String,
    #[serde(flatten)]
    pub who: Who,
    /// The replica that served it.
    pub replica: String,
}

/// What an entry on dead letters records beside their ids: the reason and the detail that
/// selected them (`rejected: HTTP 422…`), either alone, or nothing.
pub fn dead_letters_argument(reason: Option<&str>, detail: Option<&str>) -> Option<String> {
    match (reason, detail) {
        (Some(reason), Some(detail)) => Some(format!("{reason}: {detail}")),
        (reason, detail) => reason.or(detail).map(str::to_owned),
    }
}

impl Entry {
    /// An entry for `action`, asked now by `who` on `replica`; the rest to fill in.
    pub fn new(action: &str, who: Who, replica: &str) -> Self {
        Self {
            at_ms: unix_ms(),
            action: action.to_owned(),
            seller: None,
            batch: None,
            message: None,
            argument: None,
            dry_run: false,
            outcome: String::new(),
            result: String::new(),
            who,
            replica: replica.to_owned(),
        }
    }

    /// An entry for `action` asked from the command line on this host by `operator` (see
    /// [`operator_name`]); the rest to fill in.
    pub fn from_command_line(action: &str, operator: &str) -> Self {
        let host = turnstile_core::fleet::host_name();
        let who = Who {
            remote: format!("command line on {host}"),
            forwarded_for: None,
            user_agent: Some(format!(
                "turnstile {} (command line)",
                env!("CARGO_PKG_VERSION")
            )),
            operator: Some(operator.to_owned()),
        };
        Self::new(action, who, &host)
    }

    /// Logs it under `turnstile::audit`.
    pub fn log(&self) {
        let Entry {
            at_ms,
            action,
            seller,
            batch,
            message,
            argument,
            dry_run,
            outcome,
            result,
            who,
            replica,
        } = self;
        let at = turnstile_core::domain::rfc3339(*at_ms);
        macro_rules! audit {
            ($level:ident) => {
                $level!(
                    target: "turnstile::audit",
                    %at, action, seller, batch, message_id = message, argument, dry_run, outcome, result,
                    remote = %who.remote, forwarded_for = who.forwarded_for, user_agent = who.user_agent,
                    operator = who.operator, replica,
                    "operator action {outcome}: {action}"
                )
            };
        }
        if outcome == "done" {
            audit!(info);
        } else {
            audit!(warn);
        }
    }

    /// Logs it, and keeps it in Redis for every replica's page (a failure to keep it is
    /// logged: the action stands, and the log line has it).
    pub async fn record(&self, records: &Records) {
        self.log();
        // What a refused request gave is kept only in part: a stored entry stays small.
        let mut kept = self.clone();
        for given in [
            &mut kept.seller,
            &mut kept.batch,
            &mut kept.message,
            &mut kept.argument,
        ]
        .into_iter()
        .flatten()
        {
            clip(given, GIVEN_KEPT);
        }
        clip(&mut kept.result, RESULT_KEPT);
        let json = serde_json::to_string(&kept).expect("an entry is always JSON");
        if let Err(error) = records.note_action(&json, KEPT, KEPT_FOR).await {
            metrics::counter!("turnstile_redis_errors_total").increment(1);
            warn!(target: "turnstile::audit", %error, action = %self.action, "the action was not kept in Redis: only this log line records it");
        }
    }
}

/// The operator's name for an action from the command line: `given` (`--operator`,
/// `TURNSTILE_OPERATOR`), else the login name (`USER`, `LOGNAME`), else `unknown`; trimmed to
/// at most 64 characters, control characters dropped.
pub fn operator_name(given: Option<&str>) -> String {
    let name = given
        .map(str::to_owned)
        .or_else(|| std::env::var("USER").ok())
        .or_else(|| std::env::var("LOGNAME").ok())
        .unwrap_or_default();
    let name: String = name
        .trim()
        .chars()
        .filter(|c| !c.is_control())
        .take(64)
        .collect();
    if name.is_empty() {
        "unknown".to_owned()
    } else {
        name
    }
}

/// The `n` most recent actions kept in Redis, newest first (entries that do not parse are
/// skipped).
pub async fn recent(
    records: &Records,
    n: usize,
) -> Result<Vec<Entry>, turnstile_core::permit::PermitError> {
    Ok(records
        .recent_actions(n)
        .await?
        .iter()
        .filter_map(|json| serde_json::from_str(json).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_kept_as_flat_json_and_read_back() {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("user-agent", "curl/8".parse().unwrap());
        let mut who = Who::of(Some("10.0.0.7:51000".parse().unwrap()), &headers);
        who.operator = Some("ana".into());
        let mut entry = Entry::new("pause", who, "host-1-ab12");
        entry.seller = Some("S-1".into());
        entry.argument = Some("15m".into());
        entry.outcome = "done".into();
        entry.result = "paused for 15m".into();
        let json: serde_json::Value = serde_json::to_value(&entry).unwrap();
        assert_eq!(json["remote"], "10.0.0.7:51000");
        assert_eq!(json["operator"], "ana");
        assert_eq!(json["user_agent"], "curl/8");
        assert!(json.get("batch").is_none(), "absent fields are left out");
        let back: Entry = serde_json::from_value(json).unwrap();
        assert_eq!(back, entry);
    }
}

/// Bytes of an id or argument a stored entry keeps.
const GIVEN_KEPT: usize = 256;
/// Bytes of a result a stored entry keeps.
const RESULT_KEPT: usize = 1024;

/// Cuts `text` to at most `most` bytes on a character boundary, marking the cut with `…`.
fn clip(text: &mut String, most: usize) {
    if text.len() <= most {
        return;
    }
    let mut end = most;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push('…');
}

#[cfg(test)]
mod clip_tests {
    use super::clip;

    #[test]
    fn a_long_text_is_cut_on_a_character_boundary_and_marked() {
        let mut long = "é".repeat(200);
        clip(&mut long, 255);
        assert_eq!(long, format!("{}…", "é".repeat(127)));
        let mut short = String::from("S-1");
        clip(&mut short, 255);
        assert_eq!(short, "S-1");
    }
}
