//! The budget of a message's headers.
//!
//! A message's properties and headers travel in one content header frame, which AMQP cannot
//! split, and the connection's negotiated frame_max (RabbitMQ's default: 131,072 bytes) bounds
//! it. A publish whose header frame is larger makes the broker close the whole connection
//! (FRAME_ERROR), and a delivery larger than the client's frame_max makes the client close it:
//! every unacked message of the connection goes back to its queue. turnstile's copies of a
//! message (a ladder hop, a delayed copy, a dead letter) add headers of their own, and the
//! broker adds its own when it redelivers a message from a quorum queue (`x-delivery-count`)
//! or dead-letters it (`x-death`, `x-first-death-*`), so:
//!
//! - a delivery whose header frame leaves less than [`RESERVED`] bytes of the frame is
//!   dead-lettered at its first delivery ([`admit`]), before any permit is taken;
//! - every copy leaves [`BROKER_ROOM`] bytes ([`fits_copy`]): a copy that would not drops the
//!   message's foreign headers, the trace headers last, then its own ([`Keep`]);
//! - nothing larger than the frame is ever sent ([`fits_frame`]).

use lapin::BasicProperties;
use lapin::protocol::basic::gen_properties;

use crate::trace::{TRACEPARENT, TRACESTATE};

/// Bytes of a content header frame besides the properties: the frame's type, channel, size and
/// end octet (8), and the class, weight and body size (12).
pub const HEADER_FRAME_OVERHEAD: usize = 20;
/// Room every copy leaves in the frame for the headers the broker may add to it: `x-death` and
/// `x-first-death-*` when it dead-letters it, `x-delivery-count` when a quorum queue delivers
/// it again.
pub const BROKER_ROOM: usize = 2_048;
/// Room for the headers turnstile adds to a copy: its bookkeeping, a dead letter's reason and
/// detail (at most [`DETAIL_MAX`]), the trace it started.
pub const OWN_ROOM: usize = 2_048;
/// Room a delivery must leave in the frame to be handled: its copies' and the broker's.
pub const RESERVED: usize = OWN_ROOM + BROKER_ROOM;
/// Longest detail (bytes) a dead letter carries; a longer one is cut.
pub const DETAIL_MAX: usize = 1_024;

/// The size of the content header frame that carries `properties`.
pub fn header_frame_size(properties: &BasicProperties) -> usize {
    let write = gen_properties::<Vec<u8>>(properties);
    let encoded = write(Vec::with_capacity(256).into()).map_or(usize::MAX, |w| w.write.len());
    encoded.saturating_add(HEADER_FRAME_OVERHEAD)
}

/// A message whose headers leave no room for a copy of it in the broker's frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "headers too large: {bytes} bytes, the broker's frame_max is {frame_max} (a copy needs {RESERVED} bytes more)"
)]
pub struct TooLarge {
    /// The content header frame (properties and headers), in bytes.
    pub bytes: usize,
    /// The connection's negotiated frame_max.
    pub frame_max: u32,
}

/// Whether a delivery whose content header frame takes `frame` bytes can be handled: its
/// copies fit the frame whatever turnstile and the broker add ([`RESERVED`]).
pub fn admit(frame: usize, frame_max: u32) -> Result<(), TooLarge> {
    if frame.saturating_add(RESERVED) <= frame_max as usize {
        Ok(())
    } else {
        Err(TooLarge {
            bytes: frame,
            frame_max,
        })
    }
}

/// Whether a copy whose content header frame takes `frame` bytes leaves the broker its room.
pub fn fits_copy(frame: usize, frame_max: u32) -> bool {
    frame.saturating_add(BROKER_ROOM) <= frame_max as usize
}

/// Whether a content header frame of `frame` bytes may be sent at all.
pub fn fits_frame(frame: usize, frame_max: u32) -> bool {
    frame <= frame_max as usize
}

/// Which of a message's headers a copy of it keeps (besides those the copy sets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Every one.
    All,
    /// turnstile's own (`x-turnstile-*`) and the trace context (`traceparent`, `tracestate`).
    OwnAndTrace,
    /// turnstile's own.
    Own,
    /// None: only the headers the copy sets (a last resort against forged own headers).
    Nothing,
}

impl Keep {
    /// From the most kept to the least: a copy takes the first that fits.
    pub const LEAST_LOST_FIRST: [Keep; 4] =
        [Keep::All, Keep::OwnAndTrace, Keep::Own, Keep::Nothing];

    /// Whether a copy keeping `self` keeps the message's header `name`.
    pub fn keeps(self, name: &str) -> bool {
        match self {
            Keep::All => true,
            Keep::OwnAndTrace => is_own(name) || is_trace(name),
            Keep::Own => is_own(name),
            Keep::Nothing => false,
        }
    }
}

/// The prefix of turnstile's own headers.
const OWN_PREFIX: &str = "x-turnstile-";

/// Whether a header is turnstile's own (`x-turnstile-*`, in any case).
fn is_own(name: &str) -> bool {
    name.as_bytes()
        .get(..OWN_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(OWN_PREFIX.as_bytes()))
}

/// Whether a header is the trace context (in any case, as [`crate::trace`] reads it).
fn is_trace(name: &str) -> bool {
    name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE)
}

/// The copy (`copy` builds it keeping some of the foreign headers) that keeps the most and
/// still fits [`fits_copy`], and what it kept; the one keeping nothing if none does.
pub fn fitting_copy(
    frame_max: u32,
    copy: impl Fn(Keep) -> BasicProperties,
) -> (BasicProperties, Keep) {
    for keep in Keep::LEAST_LOST_FIRST {
        let properties = copy(keep);
        if keep == Keep::Nothing || fits_copy(header_frame_size(&properties), frame_max) {
            return (properties, keep);
        }
    }
    unreachable!("the last way keeps nothing and is always taken")
}

/// `detail` cut to at most [`DETAIL_MAX`] bytes, on a character boundary.
pub fn clip_detail(detail: &str) -> &str {
    if detail.len() <= DETAIL_MAX {
        return detail;
    }
    let mut end = DETAIL_MAX;
    while !detail.is_char_boundary(end) {
        end -= 1;
    }
    &detail[..end]
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString};

    use super::*;

    const FRAME_MAX: u32 = 131_072;

    fn with_header(name: &str, len: usize) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(
            name.into(),
            AMQPValue::LongString(LongString::from(vec![b'x'; len])),
        );
        BasicProperties::default().with_headers(headers)
    }

    #[test]
    fn a_header_frame_counts_the_frame_the_class_and_every_header_byte() {
        // Flags (2) only.
        assert_eq!(header_frame_size(&BasicProperties::default()), 20 + 2);
        // Flags, the table's length (4), then the name (1 + 4), the type (1), the length (4)
        // and the value.
        assert_eq!(
            header_frame_size(&with_header("blob", 100)),
            20 + 2 + 4 + 5 + 5 + 100
        );
        let typed = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        assert_eq!(header_frame_size(&typed), 20 + 2 + 17 + 1);
    }

    #[test]
    fn a_delivery_is_handled_only_if_its_copies_leave_the_broker_its_room() {
        let limit = FRAME_MAX as usize - RESERVED;
        assert_eq!(admit(limit, FRAME_MAX), Ok(()));
        let refused = admit(limit + 1, FRAME_MAX).unwrap_err();
        assert_eq!(refused.bytes, limit + 1);
        assert_eq!(
            refused.to_string(),
            format!(
                "headers too large: {} bytes, the broker's frame_max is 131072 (a copy needs 4096 bytes more)",
                limit + 1
            )
        );
        // The message of the report: one header of 130,990 bytes, accepted by the broker.
        let reported = header_frame_size(&with_header("x-big", 130_990));
        assert!(fits_frame(reported, FRAME_MAX));
        assert!(admit(reported, FRAME_MAX).is_err());
        // The smallest frame_max AMQP allows still takes ordinary messages.
        assert_eq!(admit(400, 8_192), Ok(()));
    }

    #[test]
    fn a_copy_leaves_the_broker_its_room_and_a_frame_is_never_exceeded() {
        let limit = FRAME_MAX as usize - BROKER_ROOM;
        assert!(fits_copy(limit, FRAME_MAX));
        assert!(!fits_copy(limit + 1, FRAME_MAX));
        assert!(fits_frame(FRAME_MAX as usize, FRAME_MAX));
        assert!(!fits_frame(FRAME_MAX as usize + 1, FRAME_MAX));
        assert!(!fits_copy(usize::MAX, FRAME_MAX));
    }

    #[test]
    fn a_copy_drops_the_foreign_headers_it_must_trace_headers_last() {
        let small = |_| with_header("x-small", 10);
        assert_eq!(fitting_copy(FRAME_MAX, small).1, Keep::All);
        let big_foreign = |keep: Keep| {
            if keep == Keep::All {
                with_header("x-big", 130_000)
            } else {
                with_header(TRACEPARENT, 55)
            }
        };
        let (properties, keep) = fitting_copy(FRAME_MAX, big_foreign);
        assert_eq!(keep, Keep::OwnAndTrace);
        assert_eq!(properties, with_header(TRACEPARENT, 55));
        let big_trace = |keep: Keep| match keep {
            Keep::All | Keep::OwnAndTrace => with_header(TRACESTATE, 130_000),
            _ => BasicProperties::default(),
        };
        assert_eq!(fitting_copy(FRAME_MAX, big_trace).1, Keep::Own);
        let forged_own = |keep: Keep| match keep {
            Keep::Nothing => BasicProperties::default(),
            _ => with_header("x-turnstile-reservation", 130_000),
        };
        assert_eq!(fitting_copy(FRAME_MAX, forged_own).1, Keep::Nothing);
    }

    #[test]
    fn each_way_of_keeping_keeps_its_headers_in_any_case() {
        let keeps = |keep: Keep| {
            [
                "x-big",
                "TraceParent",
                "tracestate",
                "X-Turnstile-Attempt",
                "x-turnstile",
                "é",
            ]
            .map(|name| keep.keeps(name))
        };
        assert_eq!(keeps(Keep::All), [true; 6]);
        assert_eq!(
            keeps(Keep::OwnAndTrace),
            [false, true, true, true, false, false]
        );
        assert_eq!(keeps(Keep::Own), [false, false, false, true, false, false]);
        assert_eq!(keeps(Keep::Nothing), [false; 6]);
    }

    #[test]
    fn a_long_detail_is_cut_on_a_character_boundary() {
        assert_eq!(clip_detail("HTTP 422: no"), "HTTP 422: no");
        let long = "é".repeat(DETAIL_MAX);
        let cut = clip_detail(&long);
        assert!(cut.len() <= DETAIL_MAX && cut.len() >= DETAIL_MAX - 1);
        assert!(long.starts_with(cut));
    }
}
