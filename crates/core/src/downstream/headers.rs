//! Reads what a downstream answer's headers say about its rate limit.
//!
//! Forms read, newest first:
//!
//! 1. IETF drafts 08 and later (structured fields):
//!    `RateLimit-Policy: "name";q=N;w=W` (a policy's count and window, the name a
//!    string or a token) and `RateLimit: "name";r=N;t=N` (remaining and reset).
//! 2. IETF draft 07 (and the policies of drafts 03–06):
//!    `RateLimit: limit=N, remaining=N, reset=N` and `RateLimit-Policy: N;w=W`.
//! 3. IETF drafts 00–06: `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`.
//! 4. `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
//!
//! Rules:
//!
//! - Each field (limit with its window, remaining, reset) comes from the newest
//!   form above that gives a valid value for it; older forms only fill gaps.
//! - Header names are case-insensitive. A value longer than 4 KiB, or that is not
//!   visible ASCII, is ignored whole. Lists are split on commas outside quoted
//!   strings, and unknown parameters (`pk`, `policy="ip"`, …) are ignored.
//! - Numbers are plain decimal digits, with an optional fraction. Fractions are
//!   rounded conservatively: limit and remaining down; window and reset up.
//!   Anything else (a sign, `-1`, `1e3`, `0x10`, `5 6`, text) is ignored.
//! - A bad value is ignored on its own; the other fields of the same answer are kept.
//! - Limit and remaining above 10^9 are ignored (0 is kept). A window must be 1 s to 1 day;
//!   a policy whose `w` is present but invalid is ignored whole.
//! - Reset is delta seconds, except that a value above 10^9 (in any reset field)
//!   is a unix time in seconds, converted with `now` (a time in the past gives
//!   zero; GitLab sends `RateLimit-Reset` that way). Reset is capped at 1 day.
//! - Several values (a repeated header, or a list): the smallest remaining, the
//!   largest reset, and the policy with the lowest rate (count / window, ties to
//!   the smaller count). A limit with a window beats a limit without one (in the
//!   older drafts `RateLimit-Limit: 10, 10;w=1` repeats the current limit bare);
//!   among limits without a window the smallest wins. A `;w=W` parameter on any
//!   limit item is read as its window; `X-RateLimit-*` usually gives none.
//! - Remaining is never above limit: a larger remaining is lowered to the limit.
//! - `None` when no field of any form is present and valid.

use reqwest::header::HeaderMap;

pub use crate::domain::RateLimitHeaders;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const MAX_COUNT: u64 = 1_000_000_000;
const DAY_SECS: u64 = 86_400;
const EPOCH_ABOVE: u64 = 1_000_000_000;
const MAX_VALUE_LEN: usize = 4096;
const DRAFT00: [&str; 3] = ["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"];
const LEGACY: [&str; 3] = [
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

impl RateLimitHeaders {
    /// Reads every supported form; `None` when no field of any form is present and valid.
    ///
    /// See the module documentation for the forms and the rules.
    pub fn read(headers: &HeaderMap, now: SystemTime) -> Option<Self> {
        let since_epoch = now.duration_since(UNIX_EPOCH).unwrap_or_default();
        let mut forms: [Form; 4] = Default::default();
        let [newest, draft07, draft00, legacy] = &mut forms;

        for item in items(headers, "ratelimit-policy") {
            if number(item[0]).is_some() {
                draft07.limit(item[0], param(&item, "w"));
            } else if let Some(q) = param(&item, "q") {
                newest.limit(q, param(&item, "w"));
            }
        }
        for item in items(headers, "ratelimit") {
            match dictionary_member(item[0]) {
                Some(("limit", value)) => draft07.limit(value, param(&item, "w")),
                Some(("remaining", value)) => draft07.remaining(value),
                Some(("reset", value)) => draft07.reset(value, since_epoch),
                Some(_) => {}
                None => {
                    if let Some(r) = param(&item, "r") {
                        newest.remaining(r);
                    }
                    if let Some(t) = param(&item, "t") {
                        newest.reset(t, since_epoch);
                    }
                }
            }
        }
        for (form, [limit, remaining, reset]) in [(draft00, DRAFT00), (legacy, LEGACY)] {
            for item in items(headers, limit) {
                form.limit(item[0], param(&item, "w"));
            }
            for item in items(headers, remaining) {
                form.remaining(item[0]);
            }
            for item in items(headers, reset) {
                form.reset(item[0], since_epoch);
            }
        }

        let policy = forms.iter().find_map(|f| f.policy);
        let remaining = forms.iter().find_map(|f| f.remaining);
        let reset = forms.iter().find_map(|f| f.reset);
        if policy.is_none() && remaining.is_none() && reset.is_none() {
            return None;
        }
        let limit = policy.map(|p| p.count);
        Some(Self {
            limit,
            window: policy.and_then(|p| p.window).map(Duration::from_secs),
            remaining: remaining.map(|r| limit.map_or(r, |l| r.min(l))),
            reset,
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct Policy {
    count: u64,
    window: Option<u64>,
}

impl Policy {
    fn stricter_than(self, other: Self) -> bool {
        match (self.window, other.window) {
            (Some(w), Some(other_w)) => {
                (self.count * other_w, self.count) < (other.count * w, other.count)
            }
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => self.count < other.count,
        }
    }
}

#[derive(Debug, Default)]
struct Form {
    policy: Option<Policy>,
    remaining: Option<u64>,
    reset: Option<Duration>,
}

impl Form {
    fn limit(&mut self, count: &str, window: Option<&str>) {
        let Some((count, _)) = number(count).filter(|&(c, _)| c <= MAX_COUNT) else {
            return;
        };
        let window = match window.map(number) {
            None => None,
            Some(Some((_, w))) if (1..=DAY_SECS).contains(&w) => Some(w),
            Some(_) => return,
        };
        let policy = Policy { count, window };
        if self.policy.is_none_or(|p| policy.stricter_than(p)) {
            self.policy = Some(policy);
        }
    }

    fn remaining(&mut self, value: &str) {
        if let Some((r, _)) = number(value).filter(|&(r, _)| r <= MAX_COUNT) {
            self.remaining = Some(self.remaining.map_or(r, |old| old.min(r)));
        }
    }

    fn reset(&mut self, value: &str, since_epoch: Duration) {
        let Some((_, secs)) = number(value) else {
            return;
        };
        let reset = if secs > EPOCH_ABOVE {
            Duration::from_secs(secs).saturating_sub(since_epoch)
        } else {
            Duration::from_secs(secs)
        }
        .min(Duration::from_secs(DAY_SECS));
        self.reset = Some(self.reset.map_or(reset, |old| old.max(reset)));
    }
}

/// The items of every value of header `name`, each split into its bare item and
/// its parameters (always at least one element).
fn items<'a>(headers: &'a HeaderMap, name: &'static str) -> impl Iterator<Item = Vec<&'a str>> {
    headers
        .get_all(name)
        .iter()
        .filter(|v| v.len() <= MAX_VALUE_LEN)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| split_unquoted(v, b','))
        .map(|item| split_unquoted(item, b';').into_iter().map(trim).collect())
}

fn split_unquoted(s: &str, separator: u8) -> Vec<&str> {
    let (mut parts, mut start, mut quoted, mut escaped) = (Vec::new(), 0, false, false);
    for (i, b) in s.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            _ if b == separator && !quoted => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn trim(s: &str) -> &str {
    s.trim_matches([' ', '\t'])
}

fn param<'a>(item: &[&'a str], key: &str) -> Option<&'a str> {
    item.iter()
        .skip(1)
        .rev()
        .find_map(|p| p.split_once('=').filter(|(k, _)| trim(k) == key))
        .map(|(_, v)| trim(v))
}

fn dictionary_member(bare: &str) -> Option<(&str, &str)> {
    if bare.starts_with('"') {
        return None;
    }
    bare.split_once('=').map(|(k, v)| (trim(k), trim(v)))
}

/// A plain decimal number with an optional fraction, as `(rounded down, rounded up)`.
fn number(s: &str) -> Option<(u64, u64)> {
    let (int, fraction) = s.split_once('.').unwrap_or((s, "0"));
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if !digits(int) || !digits(fraction) {
        return None;
    }
    let floor: u64 = int.parse().ok()?;
    let ceil = if fraction.bytes().any(|b| b != b'0') {
        floor.checked_add(1)?
    } else {
        floor
    };
    Some((floor, ceil))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use reqwest::header::{HeaderName, HeaderValue};

    const NOW_SECS: u64 = 1_700_000_000;

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(NOW_SECS)
    }

    fn read(pairs: &[(&str, &str)]) -> Option<RateLimitHeaders> {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        RateLimitHeaders::read(&headers, now())
    }

    fn secs(s: u64) -> Option<Duration> {
        Some(Duration::from_secs(s))
    }

    fn expect(
        limit: Option<u64>,
        window: Option<u64>,
        remaining: Option<u64>,
        reset: Option<u64>,
    ) -> Option<RateLimitHeaders> {
        Some(RateLimitHeaders {
            limit,
            window: window.map(Duration::from_secs),
            remaining,
            reset: reset.map(Duration::from_secs),
        })
    }

    #[test]
    fn no_rate_limit_header_gives_none() {
        assert_eq!(read(&[("content-type", "text/plain")]), None);
    }

    #[test]
    fn only_invalid_values_give_none() {
        assert_eq!(
            read(&[("x-ratelimit-limit", "lots"), ("ratelimit", "nope")]),
            None
        );
    }

    #[test]
    fn x_ratelimit_fields_are_read_with_delta_seconds() {
        let read = read(&[
            ("X-RateLimit-Limit", "100"),
            ("X-RateLimit-Remaining", "7"),
            ("X-RateLimit-Reset", "30"),
        ]);
        assert_eq!(read, expect(Some(100), None, Some(7), Some(30)));
    }

    #[test]
    fn x_ratelimit_reset_above_a_billion_is_an_epoch_time() {
        let read = read(&[("x-ratelimit-reset", &(NOW_SECS + 42).to_string())]);
        assert_eq!(read.unwrap().reset, secs(42));
    }

    #[test]
    fn an_epoch_reset_in_the_past_is_zero() {
        let read = read(&[("x-ratelimit-reset", "1000000001")]);
        assert_eq!(read.unwrap().reset, secs(0));
    }

    #[test]
    fn a_reset_of_exactly_a_billion_is_delta_seconds_capped_at_a_day() {
        let read = read(&[("x-ratelimit-reset", "1000000000")]);
        assert_eq!(read.unwrap().reset, secs(DAY_SECS));
    }

    #[test]
    fn ietf_draft_00_fields_are_read_as_delta_seconds() {
        let read = read(&[
            ("RateLimit-Limit", "10"),
            ("RateLimit-Remaining", "5"),
            ("RateLimit-Reset", "3"),
        ]);
        assert_eq!(read, expect(Some(10), None, Some(5), Some(3)));
    }

    #[test]
    fn a_gitlab_epoch_ratelimit_reset_is_converted() {
        let read = read(&[("RateLimit-Reset", &(NOW_SECS + 60).to_string())]);
        assert_eq!(read.unwrap().reset, secs(60));
    }

    #[test]
    fn an_older_draft_limit_list_gives_the_windowed_policy() {
        let read = read(&[("RateLimit-Limit", "10, 10;w=1, 1000;w=3600")]);
        assert_eq!(read, expect(Some(1000), Some(3600), None, None));
    }

    #[test]
    fn draft_07_combined_field_and_policy_are_read() {
        let read = read(&[
            ("RateLimit", "limit=100, remaining=5, reset=3"),
            ("RateLimit-Policy", "100;w=60"),
        ]);
        assert_eq!(read, expect(Some(100), Some(60), Some(5), Some(3)));
    }

    #[test]
    fn draft_07_combined_field_without_policy_has_no_window() {
        let read = read(&[("RateLimit", "limit=10, remaining=5, reset=3")]);
        assert_eq!(read, expect(Some(10), None, Some(5), Some(3)));
    }

    #[test]
    fn draft_08_structured_fields_are_read() {
        let read = read(&[
            ("RateLimit-Policy", "\"default\";q=100;w=60"),
            ("RateLimit", "\"default\";r=50;t=30"),
        ]);
        assert_eq!(read, expect(Some(100), Some(60), Some(50), Some(30)));
    }

    #[test]
    fn draft_08_policy_names_may_be_tokens_and_unknown_parameters_are_ignored() {
        let read = read(&[
            (
                "RateLimit-Policy",
                "burst;q=100;w=60;pk=:abc=:;comment=\"a, b; c=1\"",
            ),
            ("RateLimit", "burst;r=50;t=30;pk=:abc=:"),
        ]);
        assert_eq!(read, expect(Some(100), Some(60), Some(50), Some(30)));
    }

    #[test]
    fn a_draft_08_policy_without_a_window_gives_only_the_count() {
        let read = read(&[("RateLimit-Policy", "\"day\";q=5000")]);
        assert_eq!(read, expect(Some(5000), None, None, None));
    }

    #[test]
    fn among_several_policies_the_lowest_rate_wins() {
        let read = read(&[(
            "RateLimit-Policy",
            "\"burst\";q=10;w=1, \"hour\";q=1000;w=3600",
        )]);
        assert_eq!(read, expect(Some(1000), Some(3600), None, None));
    }

    #[test]
    fn policies_of_equal_rate_keep_the_smaller_count() {
        let read = read(&[("RateLimit-Policy", "600;w=60, 10;w=1")]);
        assert_eq!(read, expect(Some(10), Some(1), None, None));
    }

    #[test]
    fn policies_split_over_repeated_headers_are_all_considered() {
        let read = read(&[
            ("RateLimit-Policy", "\"a\";q=100;w=10"),
            ("RateLimit-Policy", "\"b\";q=50;w=10"),
        ]);
        assert_eq!(read, expect(Some(50), Some(10), None, None));
    }

    #[test]
    fn several_ratelimit_items_give_the_smallest_remaining_and_largest_reset() {
        let read = read(&[("RateLimit", "\"a\";r=50;t=5, \"b\";r=3;t=60")]);
        assert_eq!(read, expect(None, None, Some(3), Some(60)));
    }

    #[test]
    fn a_repeated_x_ratelimit_limit_keeps_the_smallest() {
        let read = read(&[("X-RateLimit-Limit", "100"), ("X-RateLimit-Limit", "40")]);
        assert_eq!(read.unwrap().limit, Some(40));
    }

    #[test]
    fn a_repeated_remaining_keeps_the_smallest_and_a_repeated_reset_the_largest() {
        let read = read(&[
            ("X-RateLimit-Remaining", "0"),
            ("X-RateLimit-Remaining", "9"),
            ("X-RateLimit-Reset", "30"),
            ("X-RateLimit-Reset", "5"),
        ]);
        assert_eq!(read, expect(None, None, Some(0), Some(30)));
    }

    #[test]
    fn the_newest_form_wins_field_by_field() {
        let read = read(&[
            ("RateLimit-Policy", "\"default\";q=100;w=60"),
            ("RateLimit", "\"default\";r=50"),
            ("RateLimit", "limit=10, remaining=1, reset=9"),
            ("RateLimit-Limit", "20"),
            ("X-RateLimit-Limit", "30"),
            ("X-RateLimit-Reset", "99"),
        ]);
        assert_eq!(read, expect(Some(100), Some(60), Some(50), Some(9)));
    }

    #[test]
    fn older_forms_fill_the_fields_newer_ones_lack() {
        let read = read(&[
            ("RateLimit-Policy", "100;w=60"),
            ("X-RateLimit-Remaining", "7"),
            ("X-RateLimit-Reset", "12"),
        ]);
        assert_eq!(read, expect(Some(100), Some(60), Some(7), Some(12)));
    }

    #[test]
    fn remaining_above_limit_is_lowered_to_the_limit() {
        let read = read(&[("RateLimit", "limit=10, remaining=500")]);
        assert_eq!(read, expect(Some(10), None, Some(10), None));
    }

    #[test]
    fn a_zero_limit_is_kept_and_lowers_remaining_to_zero() {
        let read = read(&[("RateLimit", "limit=0, remaining=3")]);
        assert_eq!(read, expect(Some(0), None, Some(0), None));
    }

    #[test]
    fn a_negative_remaining_is_ignored() {
        let read = read(&[("X-RateLimit-Limit", "10"), ("X-RateLimit-Remaining", "-1")]);
        assert_eq!(read, expect(Some(10), None, None, None));
    }

    #[test]
    fn a_bad_field_does_not_discard_the_good_ones() {
        let read = read(&[
            ("RateLimit-Limit", "ten"),
            ("RateLimit-Remaining", "4"),
            ("RateLimit-Reset", "+3"),
        ]);
        assert_eq!(read, expect(None, None, Some(4), None));
    }

    #[test]
    fn a_bad_item_in_a_list_does_not_discard_the_good_ones() {
        let read = read(&[("RateLimit", "\"a\";r=x;t=-2, \"b\";r=4;t=8")]);
        assert_eq!(read, expect(None, None, Some(4), Some(8)));
    }

    #[test]
    fn fractions_round_limit_and_remaining_down_and_reset_and_window_up() {
        let read = read(&[
            ("RateLimit-Policy", "10.9;w=59.1"),
            ("RateLimit", "remaining=4.7, reset=2.01"),
        ]);
        assert_eq!(read, expect(Some(10), Some(60), Some(4), Some(3)));
    }

    #[test]
    fn malformed_numbers_are_ignored() {
        for bad in [
            "", " ", "1e3", "0x10", "1.", ".5", "1.2.3", "5 6", "+5", "-0",
        ] {
            let value = format!("\"p\";q={bad};r={bad};t={bad}");
            assert_eq!(
                read(&[("RateLimit-Policy", &value), ("RateLimit", &value)]),
                None,
                "{bad}"
            );
        }
    }

    #[test]
    fn limit_and_remaining_above_a_billion_are_ignored() {
        let read = read(&[
            ("X-RateLimit-Limit", "1000000001"),
            ("X-RateLimit-Remaining", "18446744073709551616"),
            ("RateLimit-Limit", "1000000000"),
        ]);
        assert_eq!(read, expect(Some(MAX_COUNT), None, None, None));
    }

    #[test]
    fn a_policy_with_a_window_outside_a_second_to_a_day_is_ignored_whole() {
        let read = read(&[(
            "RateLimit-Policy",
            "\"a\";q=1;w=0, \"b\";q=2;w=86401, \"c\";q=500;w=60",
        )]);
        assert_eq!(read, expect(Some(500), Some(60), None, None));
    }

    #[test]
    fn a_reset_beyond_a_day_is_capped_at_a_day() {
        let read = read(&[
            ("RateLimit", "\"a\";t=999999"),
            ("RateLimit-Reset", "99999999999999999999"),
        ]);
        assert_eq!(read.unwrap().reset, secs(DAY_SECS));
    }

    #[test]
    fn a_reset_too_large_for_u64_is_ignored() {
        assert_eq!(
            read(&[("X-RateLimit-Reset", "99999999999999999999999")]),
            None
        );
    }

    #[test]
    fn a_value_over_four_kib_is_ignored() {
        let long = format!("5{}", " ".repeat(MAX_VALUE_LEN));
        assert_eq!(read(&[("X-RateLimit-Remaining", &long)]), None);
        let padded = format!("{}5", " ".repeat(MAX_VALUE_LEN - 1));
        assert_eq!(
            read(&[("X-RateLimit-Remaining", &padded)])
                .unwrap()
                .remaining,
            Some(5)
        );
    }

    #[test]
    fn a_non_ascii_value_is_ignored() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-ratelimit-remaining",
            HeaderValue::from_bytes(b"5\xff").unwrap(),
        );
        headers.insert("x-ratelimit-limit", HeaderValue::from_static("9"));
        let read = RateLimitHeaders::read(&headers, now());
        assert_eq!(read, expect(Some(9), None, None, None));
    }

    #[test]
    fn commas_and_semicolons_inside_quoted_names_do_not_split_items() {
        let read = read(&[("RateLimit-Policy", "\"x,5;w=1\\\";q=1;w=1\";q=100;w=60")]);
        assert_eq!(read, expect(Some(100), Some(60), None, None));
    }

    #[test]
    fn a_clock_before_the_epoch_does_not_panic() {
        let mut headers = HeaderMap::new();
        headers.insert("x-ratelimit-reset", HeaderValue::from_static("4000000000"));
        let before = UNIX_EPOCH - Duration::from_secs(10);
        let read = RateLimitHeaders::read(&headers, before);
        assert_eq!(read.unwrap().reset, secs(DAY_SECS));
    }

    const NAMES: &[&str] = &[
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit-limit",
        "ratelimit-remaining",
        "ratelimit-reset",
        "ratelimit",
        "ratelimit-policy",
    ];

    fn value() -> impl Strategy<Value = Vec<u8>> {
        let n = r"([0-9]{1,5}|-?[0-9]{0,6}(\.[0-9]{0,2})?|[0-9]{7,22})";
        let bare =
            format!(r#"("[a-z,;]{{0,3}}"|[a-z]{{0,3}}|[0-9]{{1,6}}|(limit|remaining|reset)={n})"#);
        let items = format!(r"({bare}(;[qwrtx]={n}){{0,4}}[ ,]{{0,2}}){{0,5}}");
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64),
            proptest::string::string_regex(n)
                .unwrap()
                .prop_map(String::into_bytes),
            proptest::string::string_regex(&items)
                .unwrap()
                .prop_map(String::into_bytes),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn arbitrary_values_never_panic_and_obey_the_caps(
            values in proptest::collection::vec((0..NAMES.len(), value()), 0..12),
            now_secs in prop_oneof![0..4_000_000_000u64, Just(NOW_SECS)],
        ) {
            let mut headers = HeaderMap::new();
            for (name, bytes) in &values {
                if let Ok(v) = HeaderValue::from_bytes(bytes) {
                    headers.append(NAMES[*name], v);
                }
            }
            let now = UNIX_EPOCH + Duration::from_secs(now_secs);
            if let Some(read) = RateLimitHeaders::read(&headers, now) {
                prop_assert_ne!(read, RateLimitHeaders::default());
                prop_assert!(read.limit.is_none_or(|l| l <= MAX_COUNT));
                prop_assert!(read.remaining.is_none_or(|r| r <= read.limit.unwrap_or(MAX_COUNT)));
                let day = Duration::from_secs(DAY_SECS);
                prop_assert!(read.window.is_none_or(|w| w >= Duration::from_secs(1) && w <= day));
                prop_assert!(read.window.is_none() || read.limit.is_some());
                prop_assert!(read.reset.is_none_or(|r| r <= day));
            }
        }
    }
}
