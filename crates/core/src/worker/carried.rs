//! What a message carries from one delivery to the next, in `x-turnstile-*` headers: read
//! once at the edge ([`Carried::from_delivery`]) and written on each copy
//! ([`Carried::headers`]), so that the worker's decisions (`plan`) see plain values.

use lapin::message::Delivery;
use lapin::types::AMQPValue;

use crate::broker::{header_str, header_u64, headers, long_string};
use crate::permit::Reservation;
use crate::trace::TraceContext;

/// What a message carries from one delivery to the next, in `x-turnstile-*` headers. Read once
/// at the edge, and untrusted: anything that does not parse is ignored (a reservation must
/// also be live in Redis to count, see `permit::Reservation`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Carried {
    /// Failed downstream attempts so far (429s are not counted).
    pub attempt: u32,
    /// The permit slot reserved for the message.
    pub reservation: Option<Reservation>,
    /// Since when (Unix ms) the downstream has answered 429 to this message.
    pub throttled_since_ms: Option<u64>,
    /// The trace this replica started for a message that came without a valid `traceparent`:
    /// its delayed copies and its dead letter carry it (as `traceparent`), so that all its
    /// attempts, and a replay of its dead letter, are one trace.
    pub started_trace: Option<TraceContext>,
    /// When turnstile first saw the message (Unix ms, never after now), for its result.
    pub first_seen_ms: u64,
    /// The tag of the fleet's terms its wait was decided under (see
    /// `permit::applied::terms_tag`); `None` when it never waited under a fleet's terms.
    pub terms_tag: Option<u64>,
    /// Whether its call is made alone, not shared with other rows of a bulk route: its last
    /// bulk answer could not be mapped to its rows.
    pub alone: bool,
}

impl Carried {
    /// Reads the headers of a delivery received at `now_ms` (a throttling start in the future
    /// counts from now).
    pub fn from_delivery(delivery: &Delivery, now_ms: u64) -> Self {
        Self {
            attempt: Self::attempt_of(delivery),
            reservation: Self::reservation_of(delivery),
            throttled_since_ms: header_u64(delivery, headers::THROTTLED_SINCE)
                .map(|t| t.min(now_ms)),
            started_trace: None,
            first_seen_ms: header_u64(delivery, headers::FIRST_SEEN)
                .map_or(now_ms, |t| t.min(now_ms)),
            terms_tag: Self::terms_tag_of(delivery),
            alone: header_u64(delivery, headers::ALONE) == Some(1),
        }
    }

    /// The tag of the terms a delivery says it waited under (any number: a forged one only
    /// makes the message ask anew).
    pub fn terms_tag_of(delivery: &Delivery) -> Option<u64> {
        header_u64(delivery, headers::TERMS)
    }

    /// The reservation a delivery carries, if its header has the exact form.
    pub(super) fn reservation_of(delivery: &Delivery) -> Option<Reservation> {
        header_str(delivery, headers::RESERVATION).and_then(|r| Reservation::decode(&r))
    }

    /// Failed attempts a delivery says it had (saturating; 0 when the header does not parse).
    pub(super) fn attempt_of(delivery: &Delivery) -> u32 {
        header_u64(delivery, headers::ATTEMPT).map_or(0, |a| u32::try_from(a).unwrap_or(u32::MAX))
    }

    /// The headers that carry it on.
    pub(super) fn headers(&self) -> Vec<(&'static str, AMQPValue)> {
        let mut headers = vec![
            (
                headers::ATTEMPT,
                AMQPValue::LongLongInt(i64::from(self.attempt)),
            ),
            (
                headers::RESERVATION,
                long_string(
                    &self
                        .reservation
                        .as_ref()
                        .map(Reservation::encode)
                        .unwrap_or_default(),
                ),
            ),
        ];
        if self.first_seen_ms > 0 {
            headers.push(first_seen_header(self.first_seen_ms));
        }
        if let Some(tag) = self.terms_tag {
            headers.push((headers::TERMS, long_string(&tag.to_string())));
        }
        if let Some(since) = self.throttled_since_ms {
            headers.push((
                headers::THROTTLED_SINCE,
                AMQPValue::LongLongInt(since as i64),
            ));
        }
        if self.alone {
            headers.push((headers::ALONE, AMQPValue::LongLongInt(1)));
        }
        headers.extend(started_trace_headers(self.started_trace.as_ref()));
        headers
    }
}

/// The header that carries when turnstile first saw a message (Unix ms) on its copies.
pub(super) fn first_seen_header(first_seen_ms: u64) -> (&'static str, AMQPValue) {
    (
        headers::FIRST_SEEN,
        AMQPValue::LongLongInt(first_seen_ms.min(i64::MAX as u64) as i64),
    )
}

/// The headers that carry the trace a replica started for a message (see
/// [`Carried::started_trace`]) on its delayed copies and its dead letter; none without one.
pub(super) fn started_trace_headers(
    started: Option<&TraceContext>,
) -> Vec<(&'static str, AMQPValue)> {
    let Some(trace) = started else {
        return Vec::new();
    };
    let mut headers = trace.amqp_headers();
    // The message's own tracestate belonged to the traceparent that was invalid: an empty one
    // (which means none) replaces it, whatever the case of its name.
    if trace.tracestate().is_none() {
        headers.push((crate::trace::TRACESTATE, long_string("")));
    }
    headers
}
