//! The registration domain: a message body parsed once, at the edge, into types that cannot be
//! invalid afterwards.

use std::borrow::Cow;
use std::fmt;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use serde::Deserialize;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

/// Largest message body accepted; larger ones are dead-lettered.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Bytes outside visible ASCII, plus `%` itself, are percent-encoded in HTTP headers, so the
/// header value is ASCII and decodes back (RFC 3986 percent-decoding of UTF-8) to the exact id.
const HEADER_UNSAFE: &AsciiSet = &CONTROLS.add(b' ').add(b'%').add(b'"').add(b'\\').add(0x7f);

/// A seller: 1–128 characters, no control characters. Any other character is allowed;
/// Redis keys use [`SellerId::key_tag`], never the raw id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SellerId(String);

/// A message's stable identity (also the downstream Idempotency-Key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MessageId(String);

/// An upload batch (optional): groups the registrations of one spreadsheet.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BatchId(String);

/// A route of the routes file (`TURNSTILE_ROUTES_FILE`): 1 to 64 ASCII letters, digits, `_` or
/// `-`, so that it stands in Redis keys and metric labels as it is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteName(String);

impl RouteName {
    /// Most characters in a route's name.
    pub const MAX_LEN: usize = 64;

    /// A route's name, if it is 1 to [`RouteName::MAX_LEN`] ASCII letters, digits, `_` or `-`.
    pub fn parse(s: &str) -> Result<Self, &'static str> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err("must be 1 to 64 characters");
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err("must be ASCII letters, digits, _ or -");
        }
        Ok(Self(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a message cannot be registered; the text goes into the dead letter's reason header.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidMessage {
    #[error("empty body")]
    Empty,
    #[error("body of {0} bytes exceeds the {MAX_BODY_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("body is not valid UTF-8")]
    NotUtf8,
    #[error("body is not a JSON object: {0}")]
    NotJson(String),
    #[error("invalid seller_id: {0}")]
    Seller(&'static str),
    #[error("invalid {field}: {why}")]
    Field {
        field: &'static str,
        why: &'static str,
    },
}

fn check_text(s: &str, max: usize) -> Result<(), &'static str> {
    let chars = s.chars().count();
    if chars == 0 {
        Err("must not be empty")
    } else if chars > max {
        Err("too long")
    } else if s.chars().any(char::is_control) {
        Err("must not contain control characters")
    } else {
        Ok(())
    }
}

impl SellerId {
    pub const MAX_CHARS: usize = 128;

    pub fn parse(s: &str) -> Result<Self, InvalidMessage> {
        check_text(s, Self::MAX_CHARS).map_err(InvalidMessage::Seller)?;
        Ok(Self(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The id as it goes into a Redis key and hash tag: ASCII letters, digits, `-`, `_` and `.`
    /// stay, every other byte becomes `%XX`. Injective, and free of `{`, `}` and `:`, so two
    /// sellers never share a key and the hash tag is always the whole id.
    pub fn key_tag(&self) -> Cow<'_, str> {
        key_part(&self.0)
    }
    /// The id as sent in `X-Seller-Id`: visible ASCII except `%` as is, anything else
    /// percent-encoded UTF-8 (so `größe` is sent as `gr%C3%B6%C3%9Fe`).
    pub fn header_value(&self) -> String {
        header_encode(&self.0)
    }
}

/// Text as it goes into a Redis key: ASCII letters, digits, `-`, `_` and `.` as is, every other
/// byte `%XX` (injective; never `{`, `}`, `:` or a space). Borrowed when nothing needs encoding,
/// as most ids (every key of a message is built from them).
pub fn key_part(s: &str) -> Cow<'_, str> {
    const KEEP: &AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.');
    utf8_percent_encode(s, KEEP).into()
}

fn header_encode(s: &str) -> String {
    utf8_percent_encode(s, HEADER_UNSAFE).to_string()
}

impl fmt::Display for SellerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl MessageId {
    pub const MAX_CHARS: usize = 256;

    pub fn parse(s: &str) -> Result<Self, InvalidMessage> {
        check_text(s, Self::MAX_CHARS).map_err(|why| InvalidMessage::Field {
            field: "message_id",
            why,
        })?;
        Ok(Self(s.to_owned()))
    }
    /// The fallback identity of a message without one: a digest of its body.
    pub fn digest_of(body: &[u8]) -> Self {
        Self(format!(
            "sha256:{}",
            hex::encode(&Sha256::digest(body)[..16])
        ))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The id as sent in `Idempotency-Key` (same encoding as `X-Seller-Id`).
    pub fn header_value(&self) -> String {
        header_encode(&self.0)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl BatchId {
    pub fn parse(s: &str) -> Result<Self, InvalidMessage> {
        check_text(s, 256).map_err(|why| InvalidMessage::Field {
            field: "batch_id",
            why,
        })?;
        Ok(Self(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    pub fn header_value(&self) -> String {
        header_encode(&self.0)
    }
}

/// The seller's own identity of a product (the body's optional `product_key`, e.g. its SKU):
/// 1–256 characters, no control characters. Of one seller's messages with one product key,
/// the latest supersedes the older ones still waiting (see `permit::Supersession`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProductKey(String);

impl ProductKey {
    pub const MAX_CHARS: usize = 256;

    pub fn parse(s: &str) -> Result<Self, InvalidMessage> {
        check_text(s, Self::MAX_CHARS).map_err(|why| InvalidMessage::Field {
            field: "product_key",
            why,
        })?;
        Ok(Self(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A product's version (the body's optional `version`, read only beside a `product_key`): an
/// integer of at most 15 digits, so that Redis's Lua compares it exactly. Of two messages for one
/// product that both carry one, the higher is the newer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(i64);

impl Version {
    /// The largest magnitude a version may have (15 digits).
    pub const MAX: i64 = 999_999_999_999_999;

    /// A version of `v`, if its magnitude is at most [`Version::MAX`].
    pub fn new(v: i64) -> Option<Self> {
        (-Self::MAX..=Self::MAX).contains(&v).then_some(Self(v))
    }
    pub fn get(self) -> i64 {
        self.0
    }

    /// The `version` of an envelope: a JSON integer of at most 15 digits (`"3"` and `3.0` are
    /// refused).
    fn parse(raw: &RawValue) -> Result<Self, InvalidMessage> {
        let why = "must be an integer of at most 15 digits";
        let v: i64 = serde_json::from_str(raw.get()).map_err(|_| InvalidMessage::Field {
            field: "version",
            why,
        })?;
        Version::new(v).ok_or(InvalidMessage::Field {
            field: "version",
            why,
        })
    }
}

/// What one registration takes of every limit of its seller: 1 to [`Cost::MAX`] units
/// (the envelope's `cost`, default 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cost(u32);

impl Cost {
    /// Most units one registration may take (as MAX_COST in `lua/include/args.lua`).
    pub const MAX: u32 = 10_000;
    /// One unit: a registration without a `cost`.
    pub const ONE: Cost = Cost(1);

    /// A cost of `units`, if it is 1 to [`Cost::MAX`].
    pub fn new(units: u32) -> Option<Self> {
        (1..=Self::MAX).contains(&units).then_some(Self(units))
    }
    pub fn units(self) -> u32 {
        self.0
    }

    /// The `cost` of an envelope: a JSON integer from 1 to [`Cost::MAX`] (`2.0`, `"2"`, `0`
    /// and `-1` are refused).
    fn parse(raw: &RawValue) -> Result<Self, InvalidMessage> {
        let why = "must be an integer from 1 to 10000";
        let units: u64 = serde_json::from_str(raw.get())
            .map_err(|_| InvalidMessage::Field { field: "cost", why })?;
        u32::try_from(units)
            .ok()
            .and_then(Cost::new)
            .ok_or(InvalidMessage::Field { field: "cost", why })
    }
}

/// How many messages a batch has in all (the envelope's optional `batch_size`): 1 to
/// [`BatchSize::MAX`]. The first one the consume side sees for a batch is its total.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchSize(u32);

impl BatchSize {
    /// Most messages one batch may have.
    pub const MAX: u32 = 1_000_000;

    /// A size of `n`, if it is 1 to [`BatchSize::MAX`].
    pub fn new(n: u32) -> Option<Self> {
        (1..=Self::MAX).contains(&n).then_some(Self(n))
    }
    pub fn get(self) -> u32 {
        self.0
    }

    /// The `batch_size` of an envelope: a JSON integer from 1 to [`BatchSize::MAX`] (`0`,
    /// `"5"` and `5.0` are refused).
    fn parse(raw: &RawValue) -> Result<Self, InvalidMessage> {
        let why = "must be an integer from 1 to 1000000";
        let n: u64 = serde_json::from_str(raw.get()).map_err(|_| InvalidMessage::Field {
            field: "batch_size",
            why,
        })?;
        u32::try_from(n)
            .ok()
            .and_then(BatchSize::new)
            .ok_or(InvalidMessage::Field {
                field: "batch_size",
                why,
            })
    }
}

impl Default for Cost {
    fn default() -> Self {
        Cost::ONE
    }
}

impl fmt::Display for Cost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What one answer of the downstream said about the seller's rate limit there (its rate-limit
/// headers, read by `downstream::headers`; learned from by `permit`, see `lua/learn.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitHeaders {
    /// The quota's COUNT (requests allowed per window), if given.
    pub limit: Option<u64>,
    /// The quota's window, if the form gives one.
    pub window: Option<std::time::Duration>,
    /// Requests left in the current window, if given.
    pub remaining: Option<u64>,
    /// Time from the answer until the quota resets, if given.
    pub reset: Option<std::time::Duration>,
}

/// One product registration, as received.
#[derive(Clone, Debug)]
pub struct Registration {
    pub message_id: MessageId,
    pub seller_id: SellerId,
    pub batch_id: Option<BatchId>,
    /// How many messages its batch has in all, when the producer says so.
    pub batch_size: Option<BatchSize>,
    /// Units of every limit its call takes.
    pub cost: Cost,
    /// Whether the body gave `cost` (else a route's default cost applies, see
    /// `crate::routes::Routes::resolve`).
    pub cost_given: bool,
    /// The route its call takes (the body's optional `route`), when the body names one.
    pub route: Option<RouteName>,
    /// When its call must have been made by, if the producer said (`deadline`).
    pub deadline: Option<Deadline>,
    /// The product it registers, as the seller names it (`product_key`), and its `version`:
    /// the latest message of a product supersedes the older ones still waiting.
    pub product_key: Option<(ProductKey, Option<Version>)>,
    /// Its place among its seller's waiting messages (the AMQP `priority` property; set by the
    /// consumer from the delivery, [`Priority::DEFAULT`] from [`Registration::parse`]).
    pub priority: Priority,
    /// The `product` object exactly as it arrived (forwarded verbatim).
    pub product: Box<RawValue>,
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(default, borrow)]
    message_id: Option<&'a RawValue>,
    #[serde(borrow)]
    seller_id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    batch_id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    batch_size: Option<&'a RawValue>,
    #[serde(default, borrow)]
    cost: Option<&'a RawValue>,
    #[serde(default, borrow)]
    deadline: Option<&'a RawValue>,
    #[serde(default, borrow)]
    route: Option<&'a RawValue>,
    #[serde(default, borrow)]
    product_key: Option<&'a RawValue>,
    #[serde(default, borrow)]
    version: Option<&'a RawValue>,
    #[serde(borrow)]
    product: Option<&'a RawValue>,
}

fn string_field(raw: &RawValue, field: &'static str) -> Result<String, InvalidMessage> {
    serde_json::from_str::<String>(raw.get()).map_err(|_| InvalidMessage::Field {
        field,
        why: "must be a string",
    })
}

impl Registration {
    /// Parses a message body; `amqp_message_id` is the AMQP `message-id` property, used when the
    /// body has no `message_id`; failing both, the id is a digest of the body.
    pub fn parse(body: &[u8], amqp_message_id: Option<&str>) -> Result<Self, InvalidMessage> {
        if body.is_empty() {
            return Err(InvalidMessage::Empty);
        }
        if body.len() > MAX_BODY_BYTES {
            return Err(InvalidMessage::TooLarge(body.len()));
        }
        let text = std::str::from_utf8(body).map_err(|_| InvalidMessage::NotUtf8)?;
        if !text.trim_start().starts_with('{') {
            return Err(InvalidMessage::NotJson("expected an object".into()));
        }
        let wire: Wire =
            serde_json::from_str(text).map_err(|e| InvalidMessage::NotJson(e.to_string()))?;
        let seller = wire.seller_id.ok_or(InvalidMessage::Seller("missing"))?;
        let seller = serde_json::from_str::<String>(seller.get())
            .map_err(|_| InvalidMessage::Seller("must be a string"))?;
        let seller_id = SellerId::parse(&seller)?;
        let product = wire.product.ok_or(InvalidMessage::Field {
            field: "product",
            why: "missing",
        })?;
        if !product.get().starts_with('{') {
            return Err(InvalidMessage::Field {
                field: "product",
                why: "must be a JSON object",
            });
        }
        let message_id = match wire.message_id.filter(|raw| raw.get() != "null") {
            Some(raw) => MessageId::parse(&string_field(raw, "message_id")?)?,
            None => match amqp_message_id.filter(|id| !id.is_empty()) {
                Some(id) => MessageId::parse(id)?,
                None => MessageId::digest_of(body),
            },
        };
        let batch_id = match wire.batch_id.filter(|raw| raw.get() != "null") {
            Some(raw) => Some(BatchId::parse(&string_field(raw, "batch_id")?)?),
            None => None,
        };
        let batch_size = match wire.batch_size.filter(|raw| raw.get() != "null") {
            Some(raw) => Some(BatchSize::parse(raw)?),
            None => None,
        };
        let cost = match wire.cost.filter(|raw| raw.get() != "null") {
            Some(raw) => Cost::parse(raw)?,
            None => Cost::ONE,
        };
        let cost_given = wire.cost.is_some_and(|raw| raw.get() != "null");
        let route =
            match wire.route.filter(|raw| raw.get() != "null") {
                Some(raw) => Some(RouteName::parse(&string_field(raw, "route")?).map_err(
                    |why| InvalidMessage::Field {
                        field: "route",
                        why,
                    },
                )?),
                None => None,
            };
        let deadline = match wire.deadline.filter(|raw| raw.get() != "null") {
            Some(raw) => Some(Deadline::parse(&string_field(raw, "deadline")?)?),
            None => None,
        };
        // `version` means something only beside a `product_key`; without one the message is
        // read as it always was.
        let product_key = match wire.product_key.filter(|raw| raw.get() != "null") {
            Some(raw) => {
                let key = ProductKey::parse(&string_field(raw, "product_key")?)?;
                let version = match wire.version.filter(|raw| raw.get() != "null") {
                    Some(raw) => Some(Version::parse(raw)?),
                    None => None,
                };
                Some((key, version))
            }
            None => None,
        };
        Ok(Self {
            message_id,
            seller_id,
            batch_id,
            batch_size,
            cost,
            cost_given,
            route,
            deadline,
            product_key,
            priority: Priority::DEFAULT,
            product: product.to_owned(),
        })
    }
}

/// When a message's call must have been made by: its body's optional `deadline`, an RFC 3339
/// date-time with any offset (`2026-11-26T10:00:00+09:00`), kept as Unix ms. A message that
/// cannot be called by then is dead-lettered as `expired`, never called late.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(u64);

impl Deadline {
    /// Parses an RFC 3339 date-time; one before 1970 or after 9999 is refused.
    pub fn parse(text: &str) -> Result<Self, InvalidMessage> {
        let invalid = InvalidMessage::Field {
            field: "deadline",
            why: "must be an RFC 3339 date-time such as 2026-11-26T10:00:00+09:00",
        };
        let at = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
            .map_err(|_| invalid.clone())?;
        let ms = at.unix_timestamp_nanos() / 1_000_000;
        u64::try_from(ms).map(Self).map_err(|_| invalid)
    }

    /// The deadline at `ms` (Unix ms).
    pub fn from_unix_ms(ms: u64) -> Self {
        Self(ms)
    }

    /// Unix ms.
    pub fn unix_ms(self) -> u64 {
        self.0
    }
}

/// A message's priority within its seller: the AMQP `priority` property, 0 (the default, also
/// when absent) to 9, higher first; a larger value counts as 9.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(u8);

impl Priority {
    /// No priority property.
    pub const DEFAULT: Priority = Priority(0);
    /// The highest priority.
    pub const MAX: u8 = 9;

    /// From the AMQP property.
    pub fn from_amqp(priority: Option<u8>) -> Self {
        Self(priority.unwrap_or(0).min(Self::MAX))
    }

    /// 0 to 9.
    pub fn get(self) -> u8 {
        self.0
    }
}

/// Who a message is, as far as its body says, even when it is not a valid registration: the
/// identity its result and its batch's counts use. Each part is read on its own and only if it
/// parses (`message_id` falls back as [`Registration::parse`]'s does).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    pub message_id: Option<MessageId>,
    pub seller_id: Option<SellerId>,
    pub batch_id: Option<BatchId>,
}

impl Identity {
    /// The identity of a body that may not parse as a registration (of one that does, the
    /// same ids as [`Registration::parse`] gives).
    pub fn of(body: &[u8], amqp_message_id: Option<&str>) -> Self {
        let wire = std::str::from_utf8(body)
            .ok()
            .filter(|text| body.len() <= MAX_BODY_BYTES && text.trim_start().starts_with('{'))
            .and_then(|text| serde_json::from_str::<Wire>(text).ok());
        let text = |raw: Option<&RawValue>| {
            raw.and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        };
        let fallback = || match amqp_message_id.filter(|id| !id.is_empty()) {
            Some(id) => MessageId::parse(id).ok(),
            None if !body.is_empty() => Some(MessageId::digest_of(body)),
            None => None,
        };
        let Some(wire) = wire else {
            return Self {
                message_id: fallback(),
                ..Self::default()
            };
        };
        Self {
            message_id: text(wire.message_id)
                .and_then(|id| MessageId::parse(&id).ok())
                .or_else(fallback),
            seller_id: text(wire.seller_id).and_then(|s| SellerId::parse(&s).ok()),
            batch_id: text(wire.batch_id).and_then(|b| BatchId::parse(&b).ok()),
        }
    }
}

impl From<&Registration> for Identity {
    fn from(r: &Registration) -> Self {
        Self {
            message_id: Some(r.message_id.clone()),
            seller_id: Some(r.seller_id.clone()),
            batch_id: r.batch_id.clone(),
        }
    }
}

/// When this process started (Unix ms): the first time this is asked, which `main` does first
/// (through `telemetry::init`).
pub fn process_started_ms() -> u64 {
    static STARTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *STARTED.get_or_init(unix_ms)
}

/// Unix ms as RFC 3339 (UTC, to the millisecond).
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

/// Unix time in ms on this replica's clock (the ladder's hops and header timestamps; never
/// a limit, which Redis's clock measures).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_an_rfc_3339_date_time_with_any_offset() {
        let parse = |deadline: &str| {
            let body = format!(r#"{{"seller_id":"S","deadline":{deadline},"product":{{}}}}"#);
            Registration::parse(body.as_bytes(), None).map(|r| r.deadline.map(Deadline::unix_ms))
        };
        assert_eq!(parse(r#""1970-01-01T00:00:01Z""#), Ok(Some(1_000)));
        assert_eq!(parse(r#""1970-01-01T09:00:01.5+09:00""#), Ok(Some(1_500)));
        assert_eq!(parse("null"), Ok(None));
        for bad in [
            r#""tomorrow""#,
            r#""2026-11-26 10:00""#,
            r#""2026-13-01T00:00:00Z""#,
            r#""1969-12-31T23:59:59Z""#,
            "5",
            "true",
        ] {
            assert!(
                matches!(
                    parse(bad),
                    Err(InvalidMessage::Field {
                        field: "deadline",
                        ..
                    })
                ),
                "{bad}: {:?}",
                parse(bad)
            );
        }
    }

    #[test]
    fn a_priority_is_zero_to_nine() {
        assert_eq!(Priority::from_amqp(None).get(), 0);
        assert_eq!(Priority::from_amqp(Some(7)).get(), 7);
        assert_eq!(Priority::from_amqp(Some(200)).get(), 9);
    }

    #[test]
    fn a_batch_size_is_a_whole_number_from_one() {
        let parse = |size: &str| {
            let body =
                format!(r#"{{"seller_id":"S","batch_id":"b","batch_size":{size},"product":{{}}}}"#);
            Registration::parse(body.as_bytes(), None).map(|r| r.batch_size.map(BatchSize::get))
        };
        assert_eq!(parse("500"), Ok(Some(500)));
        assert_eq!(parse("null"), Ok(None));
        for bad in ["0", "-1", "\"5\"", "5.5", "1000001", "true"] {
            assert!(
                matches!(
                    parse(bad),
                    Err(InvalidMessage::Field {
                        field: "batch_size",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn an_invalid_message_keeps_whatever_identity_parses() {
        let body = br#"{"message_id":"m-1","seller_id":"S-1","batch_id":"b-1","batch_size":"5","product":{}}"#;
        assert!(Registration::parse(body, None).is_err());
        let identity = Identity::of(body, None);
        assert_eq!(identity.message_id.unwrap().as_str(), "m-1");
        assert_eq!(identity.seller_id.unwrap().as_str(), "S-1");
        assert_eq!(identity.batch_id.unwrap().as_str(), "b-1");
        let garbage = Identity::of(b"\xff\xfe", Some("amqp-7"));
        assert_eq!(garbage.message_id.unwrap().as_str(), "amqp-7");
        assert_eq!(garbage.seller_id, None);
        assert_eq!(Identity::of(b"", None), Identity::default());
        // Of a valid registration, the ids its parse gives, fallbacks included.
        for (valid, amqp) in [
            (
                &br#"{"message_id":"m-2","seller_id":"S","batch_id":"b","product":{}}"#[..],
                None,
            ),
            (
                br#"{"message_id":null,"seller_id":"S","product":{}}"#,
                Some("amqp-9"),
            ),
            (br#"{"seller_id":"S","product":{}}"#, None),
        ] {
            let parsed = Registration::parse(valid, amqp).unwrap();
            assert_eq!(Identity::of(valid, amqp), Identity::from(&parsed));
        }
    }

    #[test]
    fn a_full_message_parses_and_keeps_the_product_verbatim() {
        let body = br#"{"message_id":"m1","seller_id":"S-1001","batch_id":"b","product":{"sku": "A1",  "n":1.50}}"#;
        let r = Registration::parse(body, None).unwrap();
        assert_eq!(r.message_id.as_str(), "m1");
        assert_eq!(r.seller_id.as_str(), "S-1001");
        assert_eq!(r.batch_id.unwrap().as_str(), "b");
        assert_eq!(r.product.get(), r#"{"sku": "A1",  "n":1.50}"#);
    }

    #[test]
    fn the_message_id_falls_back_to_the_amqp_property_then_to_a_digest() {
        let body = br#"{"seller_id":"S","product":{}}"#;
        assert_eq!(
            Registration::parse(body, Some("amqp-1"))
                .unwrap()
                .message_id
                .as_str(),
            "amqp-1"
        );
        let a = Registration::parse(body, None).unwrap().message_id;
        let b = Registration::parse(body, None).unwrap().message_id;
        assert_eq!(a, b);
        assert!(a.as_str().starts_with("sha256:"));
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        let cases: &[&[u8]] = &[
            b"",
            b"not json",
            b"[1,2]",
            b"\xff\xfe",
            br#"{"product":{}}"#,
            br#"{"seller_id":7,"product":{}}"#,
            br#"{"seller_id":"","product":{}}"#,
            br#"{"seller_id":"a\u0001b","product":{}}"#,
            br#"{"seller_id":"S"}"#,
            br#"{"seller_id":"S","product":[1]}"#,
            br#"{"seller_id":"S","product":{},"message_id":5}"#,
        ];
        for body in cases {
            assert!(
                Registration::parse(body, None).is_err(),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        let long = format!(r#"{{"seller_id":"{}","product":{{}}}}"#, "x".repeat(129));
        assert_eq!(
            Registration::parse(long.as_bytes(), None).unwrap_err(),
            InvalidMessage::Seller("too long")
        );
        let deep = format!(
            r#"{{"seller_id":"S","product":{}{}}}"#,
            "[".repeat(1000),
            "]".repeat(1000)
        );
        assert!(Registration::parse(deep.as_bytes(), None).is_err());
    }

    #[test]
    fn a_cost_is_a_whole_number_of_units_from_one_to_the_most() {
        let cost = |c: &str| {
            let body = format!(r#"{{"seller_id":"S","cost":{c},"product":{{}}}}"#);
            Registration::parse(body.as_bytes(), None).map(|r| r.cost.units())
        };
        assert_eq!(cost("3"), Ok(3));
        assert_eq!(cost("null"), Ok(1));
        assert_eq!(cost("10000"), Ok(10_000));
        let refused = InvalidMessage::Field {
            field: "cost",
            why: "must be an integer from 1 to 10000",
        };
        for bad in [
            "0",
            "-1",
            "2.5",
            "2.0",
            "\"2\"",
            "10001",
            "1e3",
            "[1]",
            "99999999999999999999",
        ] {
            assert_eq!(cost(bad), Err(refused.clone()), "{bad}");
        }
        let none = Registration::parse(br#"{"seller_id":"S","product":{}}"#, None).unwrap();
        assert_eq!(none.cost, Cost::ONE);
    }

    #[test]
    fn a_product_key_is_read_with_its_version_and_a_version_alone_is_ignored_as_before() {
        let parse = |fields: &str| {
            let body = format!(r#"{{"seller_id":"S",{fields}"product":{{}}}}"#);
            Registration::parse(body.as_bytes(), None).map(|r| {
                r.product_key
                    .map(|(k, v)| (k.as_str().to_owned(), v.map(Version::get)))
            })
        };
        assert_eq!(parse(""), Ok(None));
        assert_eq!(parse(r#""product_key":null,"#), Ok(None));
        assert_eq!(
            parse(r#""product_key":"SKU-1","#),
            Ok(Some(("SKU-1".into(), None)))
        );
        assert_eq!(
            parse(r#""product_key":"SKU-1","version":-7,"#),
            Ok(Some(("SKU-1".into(), Some(-7))))
        );
        assert_eq!(
            parse(r#""product_key":"SKU-1","version":999999999999999,"#),
            Ok(Some(("SKU-1".into(), Some(Version::MAX))))
        );
        // Without a product key, `version` is what it always was: part of nobody's contract.
        assert_eq!(parse(r#""version":"anything","#), Ok(None));
        for bad in [
            r#""product_key":"","#,
            r#""product_key":5,"#,
            r#""product_key":"a\u0007b","#,
        ] {
            assert!(
                matches!(
                    parse(bad),
                    Err(InvalidMessage::Field {
                        field: "product_key",
                        ..
                    })
                ),
                "{bad}: {:?}",
                parse(bad)
            );
        }
        let long = format!(r#""product_key":"{}","#, "k".repeat(257));
        assert!(parse(&long).is_err());
        for bad in ["1.5", "\"3\"", "1000000000000000", "true"] {
            let fields = format!(r#""product_key":"SKU-1","version":{bad},"#);
            assert!(
                matches!(
                    parse(&fields),
                    Err(InvalidMessage::Field {
                        field: "version",
                        ..
                    })
                ),
                "{bad}: {:?}",
                parse(&fields)
            );
        }
    }

    #[test]
    fn key_tags_are_injective_and_free_of_hash_tag_characters() {
        let ids = ["{brace}", "a:b:c", "a b", "größe", "%7Bbrace%7D", "S-1001"];
        let tags: Vec<String> = ids
            .iter()
            .map(|s| SellerId::parse(s).unwrap().key_tag().into_owned())
            .collect();
        for (i, t) in tags.iter().enumerate() {
            assert!(!t.contains(['{', '}', ':', ' ']), "{t}");
            assert_eq!(
                tags.iter().filter(|u| *u == t).count(),
                1,
                "{} collides",
                ids[i]
            );
        }
        assert_eq!(tags[5], "S-1001");
    }

    #[test]
    fn non_ascii_seller_ids_are_percent_encoded_in_headers() {
        assert_eq!(
            SellerId::parse("größe").unwrap().header_value(),
            "gr%C3%B6%C3%9Fe"
        );
        assert_eq!(SellerId::parse("{a:b}").unwrap().header_value(), "{a:b}");
        assert_eq!(
            SellerId::parse("50% off").unwrap().header_value(),
            "50%25%20off"
        );
    }
}
