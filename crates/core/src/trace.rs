//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>, Level 1) across the hop from the
//! broker to the downstream: a message's `traceparent` / `tracestate` AMQP headers, parsed once
//! at the edge into a [`TraceContext`], and each downstream call sent as a span of its own in
//! that trace ([`TraceContext::child`]).
//!
//! Every byte of a header is untrusted (anyone can publish one): a value that does not parse is
//! ignored, never an error. The trace is not part of a registration's validity, so a bad
//! `traceparent` starts a new trace ([`TraceContext::start`]) and a bad `tracestate` is dropped
//! (the `traceparent` stays).

use std::fmt;

use lapin::types::{AMQPValue, FieldTable};

/// The header naming a message's (or a call's) place in a trace.
pub const TRACEPARENT: &str = "traceparent";
/// The header carrying the tracing vendors' own state along with `traceparent`.
pub const TRACESTATE: &str = "tracestate";

/// A trace: 16 random bytes, never all zero.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId([u8; 16]);

/// A span (`parent-id` in `traceparent`): 8 random bytes, never all zero.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId([u8; 8]);

/// N random bytes, not all zero (an all-zero id is invalid).
fn random_id<const N: usize>() -> [u8; N] {
    loop {
        let bytes: [u8; N] = rand::random();
        if bytes != [0; N] {
            return bytes;
        }
    }
}

impl TraceId {
    /// A new trace.
    pub fn random() -> Self {
        Self(random_id())
    }
}

impl SpanId {
    /// A new span.
    pub fn random() -> Self {
        Self(random_id())
    }
}

/// Lowercase hex of an id (at most 16 bytes), written at once: a message's ids are written
/// into its log span and into every call's `traceparent`.
fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = [0u8; 32];
    for (pair, byte) in text.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0x0f)];
    }
    let len = 2 * bytes.len().min(16);
    f.write_str(std::str::from_utf8(&text[..len]).expect("hex digits are ASCII"))
}

/// `Display` and `Debug` as lowercase hex, as in `traceparent`.
macro_rules! lowercase_hex {
    ($($id:ty),*) => {$(
        impl fmt::Display for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_hex(f, &self.0)
            }
        }

        impl fmt::Debug for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_hex(f, &self.0)
            }
        }
    )*};
}

lowercase_hex!(TraceId, SpanId);

/// A valid, non-empty `tracestate`: at most [`TraceState::MAX_MEMBERS`] `key=value` members
/// with distinct keys, at most [`TraceState::MAX_LEN`] characters, keys and values as the
/// spec's grammar says. Kept as received (less the whitespace around it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceState(String);

impl TraceState {
    /// Most list members (the spec's limit).
    pub const MAX_MEMBERS: usize = 32;
    /// Longest value propagated (the spec asks to propagate at least 512 characters; a longer
    /// one is dropped whole, not truncated).
    pub const MAX_LEN: usize = 512;

    /// Parses a `tracestate` value; `None` if it is invalid or has no member.
    pub fn parse(value: &[u8]) -> Option<Self> {
        let value = trim_ows(value);
        if value.len() > Self::MAX_LEN {
            return None;
        }
        // Every valid character is ASCII: anything else fails below.
        let text = std::str::from_utf8(value).ok()?;
        let mut keys: Vec<&str> = Vec::new();
        for member in text.split(',') {
            let member = member.trim_matches([' ', '\t']);
            if member.is_empty() {
                continue;
            }
            let (key, value) = member.split_once('=')?;
            if !valid_key(key) || !valid_value(value) || keys.contains(&key) {
                return None;
            }
            keys.push(key);
            if keys.len() > Self::MAX_MEMBERS {
                return None;
            }
        }
        (!keys.is_empty()).then(|| Self(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `key = simple-key / multi-tenant-key` (Level 1):
/// `simple-key = lcalpha 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/")`,
/// `multi-tenant-key = tenant-id "@" system-id`,
/// `tenant-id = (lcalpha / DIGIT) 0*240(…)`, `system-id = lcalpha 0*13(…)`.
fn valid_key(key: &str) -> bool {
    fn part(s: &str, max: usize, digit_first: bool) -> bool {
        let tail = |b: &u8| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'*' | b'/')
        };
        match s.as_bytes().split_first() {
            Some((first, rest)) => {
                (first.is_ascii_lowercase() || (digit_first && first.is_ascii_digit()))
                    && s.len() <= max
                    && rest.iter().all(tail)
            }
            None => false,
        }
    }
    match key.split_once('@') {
        None => part(key, 256, false),
        Some((tenant, system)) => part(tenant, 241, true) && part(system, 14, false),
    }
}

/// `value = 0*255(chr) nblk-chr`, `chr = %x20 / nblk-chr`,
/// `nblk-chr = %x21-2B / %x2D-3C / %x3E-7E` (printable ASCII but `,` and `=`, not ending in a
/// space).
fn valid_value(value: &str) -> bool {
    let nblk = |b: &u8| matches!(b, 0x21..=0x2b | 0x2d..=0x3c | 0x3e..=0x7e);
    match value.as_bytes().split_last() {
        Some((last, rest)) => {
            value.len() <= 256 && nblk(last) && rest.iter().all(|b| *b == b' ' || nblk(b))
        }
        None => false,
    }
}

/// Spaces and tabs around a header value (HTTP's OWS) are not part of it.
fn trim_ows(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

/// Two lowercase hex digits.
fn hex_byte(pair: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    match pair {
        [hi, lo] => Some((digit(*hi)? << 4) | digit(*lo)?),
        _ => None,
    }
}

/// `N` bytes from `2N` lowercase hex digits.
fn hex_bytes<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    if digits.len() != 2 * N {
        return None;
    }
    let mut bytes = [0; N];
    for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = hex_byte(pair)?;
    }
    Some(bytes)
}

/// A place in a trace: the trace, a span of it, the flags, and the vendors' `tracestate`.
/// Built once, at the edge, from a message's headers ([`TraceContext::from_headers`]) or anew
/// ([`TraceContext::start`]); [`TraceContext::traceparent`] is always the canonical version
/// `00` form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: TraceId,
    span_id: SpanId,
    flags: u8,
    tracestate: Option<TraceState>,
}

impl TraceContext {
    /// The `sampled` flag.
    pub const SAMPLED: u8 = 0x01;
    /// The flags a version `00` trace keeps: `sampled` and Level 2's `random` (the trace id
    /// is random; it stays the same trace id). The spec reserves the others, and a vendor must
    /// set them to zero.
    pub const KNOWN_FLAGS: u8 = 0x03;

    /// A new trace (a random trace id and span id, no `tracestate`), flagged `sampled`:
    /// turnstile logs every registration with its trace id, a recording decision the spec
    /// says the flag should reflect.
    pub fn start() -> Self {
        Self {
            trace_id: TraceId::random(),
            span_id: SpanId::random(),
            flags: Self::SAMPLED,
            tracestate: None,
        }
    }

    /// The trace a message's AMQP headers continue: its `traceparent`, with its `tracestate`
    /// when that is valid; `None` when the `traceparent` is missing or invalid (the caller then
    /// starts a new trace, and a `tracestate` is not even read). A header name matches in any
    /// case; its value is a string (long or short) or a byte array; a header given twice (in
    /// two cases) or as another type is invalid.
    pub fn from_headers(headers: Option<&FieldTable>) -> Option<Self> {
        let headers = headers?;
        let traceparent = header_bytes(headers, TRACEPARENT)?;
        let tracestate = header_bytes(headers, TRACESTATE);
        Self::parse(traceparent, tracestate)
    }

    /// Parses `traceparent` (and, if it is valid, `tracestate`; an invalid one is dropped).
    ///
    /// Version `00` is exactly `00-<32 hex>-<16 hex>-<2 hex>`, lowercase hex, trace id and
    /// parent id not all zero; its flags are kept but for those no version defines, which are
    /// zeroed as the spec asks (see [`Self::KNOWN_FLAGS`]). Version `ff` is invalid. A higher
    /// version is read as the spec says (its `00` fields, then the end or a `-`); only its
    /// `sampled` flag is kept, and it continues as version `00`.
    pub fn parse(traceparent: &[u8], tracestate: Option<&[u8]>) -> Option<Self> {
        let value = trim_ows(traceparent);
        let version = hex_byte(value.get(..2)?)?;
        if version == 0xff || value.len() < 55 {
            return None;
        }
        if [value[2], value[35], value[52]] != [b'-'; 3] {
            return None;
        }
        let trace_id = hex_bytes::<16>(&value[3..35])?;
        let span_id = hex_bytes::<8>(&value[36..52])?;
        let flags = hex_byte(&value[53..55])?;
        let flags = match version {
            0 if value.len() == 55 => flags & Self::KNOWN_FLAGS,
            0 => return None,
            _ if value.len() == 55 || value[55] == b'-' => flags & Self::SAMPLED,
            _ => return None,
        };
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id: TraceId(trace_id),
            span_id: SpanId(span_id),
            flags,
            tracestate: tracestate.and_then(TraceState::parse),
        })
    }

    /// A new span of this trace, child of this one: the same trace id, flags and
    /// `tracestate`, a new random span id. Each downstream call is one.
    pub fn child(&self) -> Self {
        Self {
            span_id: SpanId::random(),
            tracestate: self.tracestate.clone(),
            ..*self
        }
    }

    pub fn trace_id(&self) -> TraceId {
        self.trace_id
    }

    pub fn span_id(&self) -> SpanId {
        self.span_id
    }

    pub fn flags(&self) -> u8 {
        self.flags
    }

    pub fn tracestate(&self) -> Option<&TraceState> {
        self.tracestate.as_ref()
    }

    /// The `traceparent` value: `00-<trace id>-<span id>-<flags>`.
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-{:02x}", self.trace_id, self.span_id, self.flags)
    }

    /// The AMQP headers that carry it (as a producer publishes them).
    pub fn amqp_headers(&self) -> Vec<(&'static str, AMQPValue)> {
        let mut headers = vec![(
            TRACEPARENT,
            AMQPValue::LongString(self.traceparent().into()),
        )];
        if let Some(state) = &self.tracestate {
            headers.push((TRACESTATE, AMQPValue::LongString(state.as_str().into())));
        }
        headers
    }
}

/// The bytes of the one header named `name` in any case, if it is a string or a byte array.
fn header_bytes<'a>(headers: &'a FieldTable, name: &str) -> Option<&'a [u8]> {
    let mut found = headers
        .inner()
        .iter()
        .filter(|(key, _)| key.as_str().eq_ignore_ascii_case(name));
    let (_, value) = found.next()?;
    if found.next().is_some() {
        return None;
    }
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        AMQPValue::ByteArray(b) => Some(b.as_slice()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{ByteArray, LongString, ShortString};
    use proptest::prelude::*;

    use super::*;

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PARENT: &str = "00f067aa0ba902b7";

    fn parent(value: &str) -> Option<TraceContext> {
        TraceContext::parse(value.as_bytes(), None)
    }

    fn state(value: &str) -> Option<String> {
        TraceState::parse(value.as_bytes()).map(|s| s.as_str().to_owned())
    }

    #[test]
    fn a_valid_traceparent_is_read_field_by_field_and_written_back_as_it_came() {
        for flags in ["01", "00", "03"] {
            let value = format!("00-{TRACE}-{PARENT}-{flags}");
            let trace = parent(&value).expect("valid");
            assert_eq!(trace.trace_id().to_string(), TRACE);
            assert_eq!(trace.span_id().to_string(), PARENT);
            assert_eq!(format!("{:02x}", trace.flags()), flags);
            assert_eq!(trace.traceparent(), value);
        }
        for (given, kept) in [("ff", 0x03), ("04", 0x00), ("83", 0x03), ("02", 0x02)] {
            let trace = parent(&format!("00-{TRACE}-{PARENT}-{given}")).expect("valid");
            assert_eq!(
                trace.flags(),
                kept,
                "flags {given}: the reserved ones are zeroed"
            );
        }
        let padded = format!(" \t00-{TRACE}-{PARENT}-01 ");
        assert_eq!(
            parent(&padded).unwrap().traceparent(),
            format!("00-{TRACE}-{PARENT}-01")
        );
    }

    #[test]
    fn every_malformed_traceparent_is_refused() {
        let upper = TRACE.to_uppercase();
        let cases = [
            String::new(),
            "garbage".into(),
            format!("00-{upper}-{PARENT}-01"),
            format!("00-{TRACE}-00F067AA0BA902B7-01"),
            format!("00-{TRACE}-{PARENT}-0A"),
            format!("0A-{TRACE}-{PARENT}-01"),
            format!("00-{}-{PARENT}-01", "0".repeat(32)),
            format!("00-{TRACE}-{}-01", "0".repeat(16)),
            format!("ff-{TRACE}-{PARENT}-01"),
            format!("00-{TRACE}-{PARENT}-01-"),
            format!("00-{TRACE}-{PARENT}-01-extra"),
            format!("00-{TRACE}-{PARENT}-1"),
            format!("00-{}-{PARENT}-01", &TRACE[1..]),
            format!("00-{TRACE}0-{PARENT}-01"),
            format!("00_{TRACE}_{PARENT}_01"),
            format!("00-{TRACE}-{PARENT}"),
            format!("0-{TRACE}-{PARENT}-01"),
            format!("00-{}g-{PARENT}-01", &TRACE[1..]),
            format!("00-{TRACE}-{PARENT}-01\n"),
            format!("00-+{}-{PARENT}-01", &TRACE[1..]),
        ];
        for value in cases {
            assert_eq!(parent(&value), None, "{value:?}");
        }
    }

    #[test]
    fn a_higher_version_is_read_by_its_version_00_fields_and_continues_as_version_00() {
        let exact = parent(&format!("cc-{TRACE}-{PARENT}-01")).expect("the 00 fields alone");
        assert_eq!(exact.traceparent(), format!("00-{TRACE}-{PARENT}-01"));
        let longer = parent(&format!("cc-{TRACE}-{PARENT}-09-what-the-future-holds"))
            .expect("the 00 fields then `-`");
        assert_eq!(longer.trace_id().to_string(), TRACE);
        assert_eq!(longer.flags(), 0x01, "only the sampled flag is known");
        assert_eq!(longer.traceparent(), format!("00-{TRACE}-{PARENT}-01"));
        for bad in [
            format!("cc-{TRACE}-{PARENT}-01x"),
            format!("cc-{TRACE}-{PARENT}"),
            format!("ff-{TRACE}-{PARENT}-01-more"),
            format!("cc-{}-{PARENT}-01-more", "0".repeat(32)),
        ] {
            assert_eq!(parent(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_tracestate_is_kept_as_it_came_when_every_member_is_valid() {
        let spec = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";
        assert_eq!(state(spec).as_deref(), Some(spec));
        assert_eq!(state(&format!("  {spec}\t")).as_deref(), Some(spec));
        for valid in [
            "a=1",
            "a= leading space kept",
            "tenant@system=v",
            "0tenant@sys-id_1*/=v",
            "k=v,,  ,k2=v2",
            "k=~!\"#$%&'()*+-./:;<>?@[\\]^_`{|}",
        ] {
            assert_eq!(state(valid).as_deref(), Some(valid), "{valid:?}");
        }
    }

    #[test]
    fn an_invalid_tracestate_is_dropped_whole() {
        let members = |n: usize| {
            (0..n)
                .map(|i| format!("k{i}=v"))
                .collect::<Vec<_>>()
                .join(",")
        };
        assert!(state(&members(32)).is_some());
        assert_eq!(state(&members(33)), None, "more than 32 members");
        // 256 + 1 + 255 characters.
        let longest = format!("a={},b={}", "v".repeat(254), "v".repeat(253));
        assert_eq!(longest.len(), TraceState::MAX_LEN);
        assert!(state(&longest).is_some());
        assert_eq!(
            state(&format!("{longest}v")),
            None,
            "longer than 512 characters"
        );
        for invalid in [
            "",
            " , ,",
            "Upper=v",
            "0digit=v",
            "k=",
            "k",
            "=v",
            "k=v=w",
            "k=v,k=w",
            "k=tab\tinside",
            "k=caf\u{e9}",
            "k=v\n",
            "tenant@=v",
            "@system=v",
            "tenant@0system=v",
            "tenant@system-longer-than-14=v",
            "a@b@c=v",
            "k=v;k2=v2",
            "k = v",
        ] {
            assert_eq!(state(invalid), None, "{invalid:?}");
        }
        assert_eq!(state(&format!("{}=v", "k".repeat(257))), None);
        assert_eq!(state(&format!("k={}", "v".repeat(257))), None);
        assert!(state(&format!("k={}", "v".repeat(256))).is_some());
    }

    #[test]
    fn an_invalid_tracestate_does_not_cost_the_traceparent() {
        let value = format!("00-{TRACE}-{PARENT}-01");
        let trace = TraceContext::parse(value.as_bytes(), Some(b"Bad Key=v")).unwrap();
        assert_eq!(trace.tracestate(), None);
        assert_eq!(trace.traceparent(), value);
    }

    #[test]
    fn a_child_is_a_new_span_of_the_same_trace_with_the_same_flags_and_state() {
        let value = format!("00-{TRACE}-{PARENT}-00");
        let trace = TraceContext::parse(value.as_bytes(), Some(b"congo=t61rcWkgMzE")).unwrap();
        let (a, b) = (trace.child(), trace.child());
        for child in [&a, &b] {
            assert_eq!(child.trace_id(), trace.trace_id());
            assert_eq!(child.flags(), 0);
            assert_eq!(child.tracestate(), trace.tracestate());
            assert_ne!(child.span_id(), trace.span_id());
        }
        assert_ne!(a.span_id(), b.span_id(), "each call is a span of its own");
        let started = TraceContext::start();
        assert_eq!(started.flags(), TraceContext::SAMPLED);
        assert_eq!(started.tracestate(), None);
        assert_ne!(started.trace_id(), TraceContext::start().trace_id());
        assert_eq!(parent(&started.traceparent()), Some(started));
    }

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut table = FieldTable::default();
        for (name, value) in pairs {
            table.insert(ShortString::from(*name), value.clone());
        }
        table
    }

    #[test]
    fn headers_are_read_in_any_case_as_strings_or_bytes_and_once() {
        let value = format!("00-{TRACE}-{PARENT}-01");
        let long = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
        let read = |pairs: &[(&str, AMQPValue)]| TraceContext::from_headers(Some(&table(pairs)));
        let traced = read(&[
            ("traceparent", long(&value)),
            ("tracestate", long("congo=t61rcWkgMzE")),
        ])
        .expect("continued");
        assert_eq!(traced.tracestate().unwrap().as_str(), "congo=t61rcWkgMzE");
        assert!(read(&[("TraceParent", long(&value))]).is_some());
        assert!(
            read(&[(
                "traceparent",
                AMQPValue::ShortString(ShortString::from(value.as_str()))
            )])
            .is_some()
        );
        assert!(
            read(&[(
                "traceparent",
                AMQPValue::ByteArray(ByteArray::from(value.as_bytes().to_vec()))
            )])
            .is_some()
        );
        assert_eq!(TraceContext::from_headers(None), None);
        assert_eq!(read(&[]), None);
        assert_eq!(
            read(&[("traceparent", AMQPValue::LongLongInt(42))]),
            None,
            "not a string"
        );
        assert_eq!(
            read(&[("traceparent", long(&value)), ("TRACEPARENT", long(&value))]),
            None,
            "given twice"
        );
        assert_eq!(
            read(&[("traceparent", long(&"0".repeat(10_000)))]),
            None,
            "huge"
        );
        let without_state = read(&[
            ("traceparent", long(&value)),
            ("tracestate", AMQPValue::Boolean(true)),
        ])
        .expect("a bad tracestate costs only itself");
        assert_eq!(without_state.tracestate(), None);
    }

    /// Bytes that look like a traceparent more often than arbitrary ones do.
    fn near_traceparent() -> impl Strategy<Value = Vec<u8>> {
        "[0-9a-fA-F]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[ -~]{0,8}|[ -~]{0,2})?"
            .prop_map(String::into_bytes)
    }

    proptest! {
        #[test]
        fn any_bytes_parse_without_panicking_and_anything_accepted_is_canonical(
            traceparent in prop_oneof![proptest::collection::vec(any::<u8>(), 0..80), near_traceparent()],
            tracestate in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            if let Some(trace) = TraceContext::parse(&traceparent, Some(&tracestate)) {
                let canonical = trace.traceparent();
                prop_assert_eq!(canonical.len(), 55);
                prop_assert!(canonical.starts_with("00-"));
                prop_assert!(canonical.bytes().all(|b| b == b'-' || b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
                let again = TraceContext::parse(canonical.as_bytes(), Some(&tracestate));
                prop_assert_eq!(again.as_ref(), Some(&trace));
                if traceparent.starts_with(b"00") {
                    let given = trim_ows(&traceparent);
                    prop_assert_eq!(&canonical.as_bytes()[..53], &given[..53]);
                    let flags = u8::from_str_radix(std::str::from_utf8(&given[53..]).unwrap(), 16).unwrap();
                    prop_assert_eq!(trace.flags(), flags & TraceContext::KNOWN_FLAGS);
                }
            }
            if let Some(state) = TraceState::parse(&tracestate) {
                prop_assert!(state.as_str().len() <= TraceState::MAX_LEN);
                prop_assert_eq!(TraceState::parse(state.as_str().as_bytes()), Some(state.clone()));
                prop_assert!(reqwest::header::HeaderValue::from_str(state.as_str()).is_ok());
            }
        }

        #[test]
        fn any_tracestate_of_valid_members_is_kept_as_it_came(
            members in proptest::collection::btree_map("[a-z][a-z0-9_*/-]{0,8}", "[!-+\\--<>-~][ !-+\\--<>-~]{0,8}[!-+\\--<>-~]", 1..=32),
        ) {
            let value = members.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
            prop_assume!(value.len() <= TraceState::MAX_LEN);
            prop_assert_eq!(TraceState::parse(value.as_bytes()).map(|s| s.0), Some(value));
        }
    }
}
