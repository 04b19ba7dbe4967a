//! Bulk calls: one request carrying several rows of one seller and one route, and its answer
//! mapped back to each row (see [`crate::routes::Bulk`]).
//!
//! The request's body is the JSON array of the rows' products in order (each given its
//! `message_id` under the route's `id_field`, when it names one), or that array under the
//! route's `items` field. Its `Idempotency-Key` is derived from the rows' message ids
//! ([`idempotency_key`]), so that the same rows sent again are recognisable as one call.
//!
//! A 2xx answer maps back to the rows ([`map_answer`]): its array (bare, or under `items`)
//! holds one entry per row, in order or matched by `id_field`, each an object with its own
//! integer `status`. Each row's reply is then its entry's, by the contract's response table.
//! Any other answer is every row's. An answer that cannot be mapped is no row's: the rows are
//! retried one at a time.

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::reply::{ApiResponse, EXCERPT, RESPONSE_CAP, Reply, ResponseBody};
use crate::domain::Registration;
use crate::routes::Bulk;

/// Most bytes of a bulk answer read: room for every row's entry at a single answer's cap, up to
/// 4 MiB.
pub fn answer_cap(rows: usize) -> usize {
    RESPONSE_CAP.saturating_mul(rows.max(1)).min(4 << 20)
}

/// The `Idempotency-Key` of a bulk call of `rows`: `bulk-` and the first 32 hex digits of the
/// SHA-256 of their message ids, one per line, in order.
pub fn idempotency_key(rows: &[Registration]) -> String {
    let mut digest = Sha256::new();
    for row in rows {
        digest.update(row.message_id.as_str().as_bytes());
        digest.update(b"\n");
    }
    format!("bulk-{}", &hex::encode(digest.finalize())[..32])
}

/// The product of `row` as a bulk call carries it, and the key its answer's entry is matched
/// by: verbatim, with its `message_id` under `id_field` first when the route names one and the
/// product does not already have that field (the key is then its message id). A product that
/// has it is left as it is: the key is that field's value when it is a string, else its
/// message id (which then matches no entry: the call's answer cannot be mapped, and its rows
/// are retried alone).
fn product_of(row: &Registration, id_field: Option<&str>) -> (String, String) {
    let product = row.product.get().trim();
    let id = row.message_id.as_str().to_owned();
    let Some(field) = id_field else {
        return (product.to_owned(), id);
    };
    let own = serde_json::from_str::<std::collections::HashMap<String, Value>>(product)
        .ok()
        .map(|mut fields| fields.remove(field));
    match own {
        Some(None) if product.starts_with('{') => {
            let rest = product[1..].trim_start();
            let pair = format!(
                "{}:{}",
                Value::String(field.to_owned()),
                Value::String(id.clone())
            );
            let text = if rest.starts_with('}') {
                format!("{{{pair}}}")
            } else {
                format!("{{{pair},{rest}")
            };
            (text, id)
        }
        Some(Some(Value::String(own))) => (product.to_owned(), own),
        _ => (product.to_owned(), id),
    }
}

/// The body of a bulk call of `rows` (see the module docs), and each row's key in its answer
/// (see [`map_answer`]).
pub fn body(bulk: &Bulk, rows: &[Registration]) -> (Vec<u8>, Vec<String>) {
    let mut array = String::from("[");
    let mut keys = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            array.push(',');
        }
        let (product, key) = product_of(row, bulk.id_field.as_deref());
        array.push_str(&product);
        keys.push(key);
    }
    array.push(']');
    let body = match &bulk.items {
        None => array.into_bytes(),
        Some(items) => format!("{{{}:{array}}}", Value::String(items.clone())).into_bytes(),
    };
    (body, keys)
}

/// Why a bulk answer could not be mapped to its rows.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the bulk answer could not be mapped to its rows: {0}")]
pub struct Unmappable(pub String);

/// One reply per row (in the rows' order) from a 2xx bulk answer whose body is `answer`, for
/// the rows whose keys (see [`body`]) are `ids`.
pub fn map_answer(
    bulk: &Bulk,
    ids: &[&str],
    answer: &ApiResponse,
) -> Result<Vec<Reply>, Unmappable> {
    let bad = |why: &str| Unmappable(why.to_owned());
    if answer.truncated {
        return Err(bad("the answer was longer than its cap"));
    }
    let ResponseBody::Json(text) = &answer.body else {
        return Err(bad("the answer is not JSON"));
    };
    let document: Value = serde_json::from_str(text).map_err(|_| bad("the answer is not JSON"))?;
    let entries = match (&document, &bulk.items) {
        (Value::Array(entries), _) => entries,
        (Value::Object(fields), Some(items)) => match fields.get(items) {
            Some(Value::Array(entries)) => entries,
            _ => return Err(Unmappable(format!("no array under {items:?}"))),
        },
        _ => return Err(bad("no array of entries")),
    };
    if entries.len() != ids.len() {
        return Err(Unmappable(format!(
            "{} entries for {} rows",
            entries.len(),
            ids.len()
        )));
    }
    let mut ordered: Vec<Option<&Value>> = vec![None; ids.len()];
    match bulk.id_field.as_deref() {
        Some(field) if ids.len() > 1 => {
            for entry in entries {
                let id = entry
                    .get(field)
                    .and_then(Value::as_str)
                    .ok_or_else(|| Unmappable(format!("an entry without a string {field:?}")))?;
                let row = ids.iter().position(|m| *m == id).ok_or_else(|| {
                    Unmappable(format!("an entry for {id:?}, no row of the call"))
                })?;
                if ordered[row].replace(entry).is_some() {
                    return Err(Unmappable(format!("two entries for {id:?}")));
                }
            }
        }
        _ => {
            for (slot, entry) in ordered.iter_mut().zip(entries) {
                *slot = Some(entry);
            }
        }
    }
    ordered
        .into_iter()
        .map(|entry| entry_reply(entry.expect("every row has its entry")))
        .collect()
}

/// A row's reply from its entry of a bulk answer: the contract's response table applied to
/// the entry's `status`, the entry itself the row's answer.
fn entry_reply(entry: &Value) -> Result<Reply, Unmappable> {
    let status = entry
        .get("status")
        .and_then(Value::as_u64)
        .filter(|s| (100..=599).contains(s))
        .ok_or_else(|| Unmappable("an entry without an integer status from 100 to 599".into()))?
        as u16;
    let text = entry.to_string();
    let response = ApiResponse::new(status, text.as_bytes(), false);
    let response = if text.len() > RESPONSE_CAP {
        ApiResponse::new(status, &text.as_bytes()[..RESPONSE_CAP], true)
    } else {
        response
    };
    Ok(match status {
        200..=299 => Reply::Registered(response),
        429 => Reply::Throttled {
            retry_after: entry
                .get("retry_after")
                .and_then(Value::as_u64)
                .map(std::time::Duration::from_secs),
        },
        408 | 425 | 500 | 502 | 503 | 504 => Reply::Transient {
            why: format!("HTTP {status} for the row in a bulk answer"),
            response: Some(response),
        },
        _ => Reply::Rejected {
            status,
            body: text.chars().take(EXCERPT).collect(),
            response: Some(response),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::BulkCost;

    fn bulk(items: Option<&str>, id_field: Option<&str>) -> Bulk {
        Bulk {
            max_rows: 50,
            linger: std::time::Duration::from_millis(200),
            cost: BulkCost::Call,
            items: items.map(str::to_owned),
            id_field: id_field.map(str::to_owned),
        }
    }

    fn row(id: &str, product: &str) -> Registration {
        let body = format!(r#"{{"message_id":"{id}","seller_id":"S","product":{product}}}"#);
        Registration::parse(body.as_bytes(), None).unwrap()
    }

    fn answer(text: &str) -> ApiResponse {
        ApiResponse::new(200, text.as_bytes(), false)
    }

    #[test]
    fn a_bulk_body_is_the_products_in_order_each_given_its_id_under_the_items_field() {
        let rows = [
            row("m-1", r#"{"sku":"a"}"#),
            row("m-2", "{}"),
            row("m-3", r#"{"message_id":"own"}"#),
        ];
        let (sent, keys) = body(&bulk(Some("items"), Some("message_id")), &rows);
        assert_eq!(keys, ["m-1", "m-2", "own"], "a product's own id is its key");
        let sent: Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(
            sent,
            serde_json::json!({"items": [
                {"message_id": "m-1", "sku": "a"},
                {"message_id": "m-2"},
                {"message_id": "own"},
            ]})
        );
        let (bare, _) = body(&bulk(None, None), &rows[..2]);
        assert_eq!(bare, br#"[{"sku":"a"},{}]"#.to_vec());
    }

    #[test]
    fn a_bulk_calls_idempotency_key_is_the_same_for_the_same_rows_in_the_same_order_only() {
        let (a, b) = (row("m-1", "{}"), row("m-2", "{}"));
        let key = idempotency_key(&[a.clone(), b.clone()]);
        assert!(key.starts_with("bulk-") && key.len() == 37, "{key}");
        assert_eq!(key, idempotency_key(&[a.clone(), b.clone()]));
        assert_ne!(key, idempotency_key(&[b, a.clone()]));
        assert_ne!(key, idempotency_key(&[a]));
    }

    #[test]
    fn each_row_takes_its_own_entrys_status_by_order_or_by_its_id() {
        let ids = ["m-1", "m-2", "m-3", "m-4"];
        let in_order = answer(
            r#"[{"status":201,"id":"p1"},{"status":422,"error":"bad"},{"status":503},{"status":429,"retry_after":3}]"#,
        );
        let replies = map_answer(&bulk(None, None), &ids, &in_order).unwrap();
        assert!(
            matches!(&replies[0], Reply::Registered(r) if r.status == 201 && matches!(&r.body, ResponseBody::Json(t) if t.contains("p1")))
        );
        assert!(matches!(&replies[1], Reply::Rejected { status: 422, .. }));
        assert!(matches!(&replies[2], Reply::Transient { .. }));
        assert_eq!(
            replies[3],
            Reply::Throttled {
                retry_after: Some(std::time::Duration::from_secs(3))
            }
        );
        let by_id = answer(
            r#"{"items":[{"message_id":"m-4","status":200},{"message_id":"m-1","status":400},{"message_id":"m-3","status":200},{"message_id":"m-2","status":200}]}"#,
        );
        let replies = map_answer(&bulk(Some("items"), Some("message_id")), &ids, &by_id).unwrap();
        assert!(matches!(replies[0], Reply::Rejected { status: 400, .. }));
        assert!(matches!(replies[3], Reply::Registered(_)));
    }

    #[test]
    fn an_answer_that_does_not_name_each_row_once_maps_to_no_row() {
        let ids = ["m-1", "m-2"];
        let by_id = bulk(None, Some("message_id"));
        let cases = [
            (
                bulk(None, None),
                r#"[{"status":200}]"#,
                "1 entries for 2 rows",
            ),
            (bulk(None, None), r#"{"status":200}"#, "no array"),
            (
                bulk(Some("items"), None),
                r#"{"rows":[]}"#,
                "no array under",
            ),
            (
                bulk(None, None),
                r#"[{"status":200},{"status":"ok"}]"#,
                "integer status",
            ),
            (bulk(None, None), r#"[{"status":200},7]"#, "integer status"),
            (
                by_id.clone(),
                r#"[{"message_id":"m-1","status":200},{"message_id":"m-1","status":200}]"#,
                "two entries",
            ),
            (
                by_id.clone(),
                r#"[{"message_id":"m-1","status":200},{"message_id":"x","status":200}]"#,
                "no row of the call",
            ),
            (
                by_id,
                r#"[{"message_id":"m-1","status":200},{"status":200}]"#,
                "without a string",
            ),
        ];
        for (bulk, text, why) in cases {
            let error = map_answer(&bulk, &ids, &answer(text)).unwrap_err();
            assert!(error.to_string().contains(why), "{text}: {error}");
        }
        let text = ApiResponse::new(200, b"<html>ok</html>", false);
        assert!(map_answer(&bulk(None, None), &ids, &text).is_err());
        let cut = ApiResponse::new(200, br#"[{"status":200},{"status":200}]"#, true);
        assert!(map_answer(&bulk(None, None), &ids, &cut).is_err());
    }

    #[test]
    fn a_single_row_is_matched_to_a_single_entry_whatever_its_id() {
        let ids = ["m-1"];
        let replies = map_answer(
            &bulk(None, Some("message_id")),
            &ids,
            &answer(r#"[{"message_id":"other","status":200}]"#),
        )
        .unwrap();
        assert!(matches!(replies[0], Reply::Registered(_)));
    }
}
