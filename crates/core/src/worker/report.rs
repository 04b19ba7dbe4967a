//! What flows back to the upload service, built from plain values: a message's result and a
//! batch's completion event, as the JSON the contract names (see `broker::results` for where
//! they go).

use serde::Serialize;
use serde_json::value::RawValue;

use super::plan::Report;
use crate::domain::{Identity, rfc3339};
use crate::downstream::ResponseBody;
use crate::permit::UploadProgress;

/// A message's final state, as its result says it.
pub struct Final<'a> {
    pub identity: &'a Identity,
    /// `registered`, or the dead-letter reason.
    pub outcome: &'a str,
    /// The dead letter's detail (none for a registration).
    pub detail: Option<&'a str>,
    pub report: &'a Report,
    /// When turnstile first saw the message and when it reached this state (Unix ms).
    pub first_seen_ms: u64,
    pub finished_ms: u64,
}

#[derive(Serialize)]
struct ResultBody<'a> {
    message_id: Option<&'a str>,
    seller_id: Option<&'a str>,
    batch_id: Option<&'a str>,
    outcome: &'a str,
    status: Option<u16>,
    response: Option<Box<RawValue>>,
    response_truncated: bool,
    detail: Option<&'a str>,
    /// A superseded message's successor, present only then.
    #[serde(skip_serializing_if = "Option::is_none")]
    superseded_by: Option<&'a str>,
    attempts: u32,
    first_seen: String,
    finished: String,
}

impl Final<'_> {
    /// The result's JSON body.
    pub fn body(&self) -> Vec<u8> {
        let answer = self.report.response.as_ref();
        let response = answer.and_then(|a| match &a.body {
            ResponseBody::Empty => None,
            ResponseBody::Json(text) => RawValue::from_string(text.clone()).ok(),
            ResponseBody::Text(text) => serde_json::to_string(text)
                .ok()
                .and_then(|quoted| RawValue::from_string(quoted).ok()),
        });
        let body = ResultBody {
            message_id: self.identity.message_id.as_ref().map(|m| m.as_str()),
            seller_id: self.identity.seller_id.as_ref().map(|s| s.as_str()),
            batch_id: self.identity.batch_id.as_ref().map(|b| b.as_str()),
            outcome: self.outcome,
            status: answer.map(|a| a.status).filter(|s| *s != 0),
            response,
            response_truncated: answer.is_some_and(|a| a.truncated),
            detail: self.detail,
            superseded_by: self.report.superseded_by.as_ref().map(|m| m.as_str()),
            attempts: self.report.attempts,
            first_seen: rfc3339(self.first_seen_ms.min(self.finished_ms)),
            finished: rfc3339(self.finished_ms),
        };
        serde_json::to_vec(&body).expect("a result always serializes")
    }
}

#[derive(Serialize)]
struct CompletedBody<'a> {
    batch_id: &'a str,
    seller_id: &'a str,
    total: Option<u64>,
    registered: u64,
    dead: &'a std::collections::BTreeMap<String, u64>,
    extra: u64,
    started: Option<String>,
    finished: String,
}

/// A batch's completion event (routing key `batch.completed`): its counts as its progress
/// holds them when it completed at `completed_ms`.
pub fn completed_body(progress: &UploadProgress, completed_ms: u64) -> Vec<u8> {
    let body = CompletedBody {
        batch_id: &progress.batch,
        seller_id: &progress.seller,
        total: progress.total,
        registered: progress.registered,
        dead: &progress.dead_by_reason,
        extra: progress.extra(),
        started: progress.first_ms.map(rfc3339),
        finished: rfc3339(completed_ms),
    };
    serde_json::to_vec(&body).expect("an event always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{BatchId, MessageId, SellerId};
    use crate::downstream::ApiResponse;

    fn identity() -> Identity {
        Identity {
            message_id: Some(MessageId::parse("m-17").unwrap()),
            seller_id: Some(SellerId::parse("S-1").unwrap()),
            batch_id: Some(BatchId::parse("upload-9").unwrap()),
        }
    }

    fn parsed(body: Vec<u8>) -> serde_json::Value {
        serde_json::from_slice(&body).unwrap()
    }

    #[test]
    fn a_registration_result_carries_the_apis_json_answer_as_json() {
        let report = Report {
            response: Some(ApiResponse::new(201, br#"{"product_id":12345}"#, false)),
            attempts: 2,
            superseded_by: None,
        };
        let result = Final {
            identity: &identity(),
            outcome: "registered",
            detail: None,
            report: &report,
            first_seen_ms: 1_700_000_000_000,
            finished_ms: 1_700_000_001_500,
        };
        assert_eq!(
            parsed(result.body()),
            serde_json::json!({
                "message_id": "m-17", "seller_id": "S-1", "batch_id": "upload-9",
                "outcome": "registered", "status": 201, "response": {"product_id": 12345},
                "response_truncated": false, "detail": null, "attempts": 2,
                "first_seen": "2023-11-14T22:13:20.000Z", "finished": "2023-11-14T22:13:21.500Z"
            })
        );
    }

    #[test]
    fn a_rejection_result_carries_text_as_text_and_an_invalid_message_what_it_could_read() {
        let report = Report {
            response: Some(ApiResponse::new(422, b"invalid category", false)),
            attempts: 1,
            superseded_by: None,
        };
        let rejected = Final {
            identity: &identity(),
            outcome: "rejected",
            detail: Some("HTTP 422: invalid category"),
            report: &report,
            first_seen_ms: 5,
            finished_ms: 3,
        };
        let value = parsed(rejected.body());
        assert_eq!(value["response"], "invalid category");
        assert_eq!(value["status"], 422);
        assert_eq!(
            value["first_seen"], value["finished"],
            "never after it finished"
        );
        let unknown = Identity::default();
        let invalid = Final {
            identity: &unknown,
            outcome: "invalid-message",
            detail: Some("body is not valid UTF-8"),
            report: &Report::default(),
            first_seen_ms: 0,
            finished_ms: 0,
        };
        let value = parsed(invalid.body());
        assert_eq!(value["seller_id"], serde_json::Value::Null);
        assert_eq!(value["status"], serde_json::Value::Null);
        assert_eq!(value["response"], serde_json::Value::Null);
    }

    #[test]
    fn a_completion_event_counts_each_outcome() {
        let progress = UploadProgress {
            seller: "S-1".into(),
            batch: "upload-9".into(),
            total: Some(3),
            registered: 2,
            dead: 1,
            dead_by_reason: [("rejected".to_owned(), 1)].into(),
            first_ms: Some(0),
            ..UploadProgress::default()
        };
        let value: serde_json::Value =
            serde_json::from_slice(&completed_body(&progress, 60_000)).unwrap();
        assert_eq!(value["total"], 3);
        assert_eq!(value["registered"], 2);
        assert_eq!(value["dead"], serde_json::json!({"rejected": 1}));
        assert_eq!(value["extra"], 0);
        assert_eq!(value["finished"], "1970-01-01T00:01:00.000Z");
    }
}
