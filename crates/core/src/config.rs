//! Settings shared by every subcommand: parsed once from flags and `TURNSTILE_*` variables into
//! typed values, with errors that name the setting and what is wrong.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// A downstream URL with `{seller_id}` where a seller's id goes (TURNSTILE_DOWNSTREAM_URL, a
/// route's `url`): an http or https URL, checked once.
#[derive(Clone, Debug)]
pub struct UrlTemplate {
    text: String,
    /// Whether `{seller_id}` stands in the URL's path (else in its query or nowhere).
    seller_in_path: bool,
}

/// The placeholders a URL template may hold, each written in braces (`{seller_id}`).
pub const PLACEHOLDERS: [&str; 1] = ["seller_id"];

/// Why a URL template was refused.
#[derive(Debug, thiserror::Error)]
pub enum UrlTemplateError {
    /// Not a URL, even with a seller's id in place (the parser's reason).
    #[error("{0}")]
    Invalid(String),
    /// Not an http or https URL.
    #[error("must be an http or https URL")]
    Scheme,
    /// A `{name}` that is none of [`PLACEHOLDERS`] (a typo such as `{seller}` would be sent
    /// as written).
    #[error("unknown placeholder {{{0}}}: {known}", known = known_placeholders())]
    UnknownPlaceholder(String),
    /// A `{` with no `}` after it.
    #[error("a `{{` with no `}}` after it: {known}", known = known_placeholders())]
    Unclosed,
}

/// The placeholders a template may hold, as an error says them.
fn known_placeholders() -> String {
    let braced: Vec<String> = PLACEHOLDERS.iter().map(|p| format!("{{{p}}}")).collect();
    match braced.as_slice() {
        [one] => format!("the only placeholder is {one}"),
        many => format!("the placeholders are {}", many.join(", ")),
    }
}

/// Refuses any `{...}` in `text` that is not one of [`PLACEHOLDERS`].
fn check_placeholders(text: &str) -> Result<(), UrlTemplateError> {
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let close = after.find('}').ok_or(UrlTemplateError::Unclosed)?;
        let name = &after[..close];
        if !PLACEHOLDERS.contains(&name) {
            return Err(UrlTemplateError::UnknownPlaceholder(name.to_owned()));
        }
        rest = &after[close + 1..];
    }
    Ok(())
}

impl UrlTemplate {
    /// The template `text`, if it is an http or https URL with an id in place of `{seller_id}`
    /// and no other `{...}` (see [`PLACEHOLDERS`]).
    pub fn parse(text: &str) -> Result<Self, UrlTemplateError> {
        check_placeholders(text)?;
        let probe = text.replace("{seller_id}", "probe");
        let parsed =
            reqwest::Url::parse(&probe).map_err(|e| UrlTemplateError::Invalid(e.to_string()))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(UrlTemplateError::Scheme);
        }
        let path = text.split(['?', '#']).next().unwrap_or_default();
        Ok(Self {
            text: text.to_owned(),
            seller_in_path: path.contains("{seller_id}"),
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether `{seller_id}` stands in the URL's path.
    pub fn seller_in_path(&self) -> bool {
        self.seller_in_path
    }

    /// Whether the seller's id can stand where `{seller_id}` does: an id of `.` or `..` cannot
    /// be one path segment (URL parsers remove such segments, encoded or not). `whose` names the
    /// template in the refusal.
    pub fn check_seller(
        &self,
        seller: &crate::domain::SellerId,
        whose: &str,
    ) -> Result<(), String> {
        let id = seller.as_str();
        if self.seller_in_path && (id == "." || id == "..") {
            return Err(format!(
                "seller id {id:?} cannot be a path segment of {whose}"
            ));
        }
        Ok(())
    }

    /// The URL for a seller: `{seller_id}` replaced by the percent-encoded id, so that `/`,
    /// `?`, `#`, `%` and spaces stay inside one path segment or query value (see
    /// [`Self::check_seller`]).
    pub fn fill(&self, seller: &crate::domain::SellerId, whose: &str) -> Result<String, String> {
        self.check_seller(seller, whose)?;
        Ok(self
            .text
            .replace("{seller_id}", &urlencoding::encode(seller.as_str())))
    }
}

/// A per-seller limit: at most `count` registrations in any trailing `window`, or, for a
/// calendar limit (`reset`), in each day that starts at the reset's time of day.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    count: u32,
    window: Duration,
    reset: Option<Reset>,
}

/// When a calendar limit's day starts: a time of day in a fixed UTC offset, as a provider
/// states its quota's reset (`@00:00+09:00`). Two resets are the same when they fall at the
/// same instant (`@15:00Z` is `@00:00+09:00`).
#[derive(Clone, Copy, Debug)]
pub struct Reset {
    /// Seconds after midnight, in `offset_minutes`.
    second_of_day: u32,
    /// The offset from UTC it is written in, in minutes (-23:59 to +23:59).
    offset_minutes: i16,
}

/// Seconds in a day: a calendar limit's window.
const DAY_SECS: i64 = 86_400;

impl Reset {
    /// When the day starts, in seconds after midnight UTC.
    fn utc_second(&self) -> i64 {
        (i64::from(self.second_of_day) - i64::from(self.offset_minutes) * 60).rem_euclid(DAY_SECS)
    }

    /// When the day starts, in µs after midnight UTC (the scripts' PHASE).
    pub fn phase_us(&self) -> u64 {
        self.utc_second() as u64 * 1_000_000
    }

    /// `HH:MM[:SS]` then `Z` or `±HH:MM`.
    fn parse(s: &str) -> Option<Self> {
        let split = s.find(['+', '-', 'Z', 'z'])?;
        let (time, offset) = s.split_at(split);
        let parts: Vec<&str> = time.split(':').collect();
        let number = |p: &str, max: u32| {
            (p.len() == 2 && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u32>().ok())
                .flatten()
                .filter(|n| *n <= max)
        };
        let (h, m, sec) = match parts.as_slice() {
            [h, m] => (number(h, 23)?, number(m, 59)?, 0),
            [h, m, sec] => (number(h, 23)?, number(m, 59)?, number(sec, 59)?),
            _ => return None,
        };
        let offset_minutes = match offset {
            "Z" | "z" => 0,
            _ => {
                let sign: i16 = if offset.starts_with('-') { -1 } else { 1 };
                let (oh, om) = offset[1..].split_once(':')?;
                let minutes = number(oh, 23)? * 60 + number(om, 59)?;
                sign * minutes as i16
            }
        };
        Some(Self {
            second_of_day: h * 3600 + m * 60 + sec,
            offset_minutes,
        })
    }

    /// The reset at `phase_us` after midnight UTC (as the scripts' PHASE), written in UTC.
    fn of_phase_us(phase_us: u64) -> Option<Self> {
        let secs = phase_us / 1_000_000;
        (phase_us.is_multiple_of(1_000_000) && secs < DAY_SECS as u64).then_some(Self {
            second_of_day: secs as u32,
            offset_minutes: 0,
        })
    }
}

impl PartialEq for Reset {
    fn eq(&self, other: &Self) -> bool {
        self.utc_second() == other.utc_second()
    }
}

impl Eq for Reset {}

impl fmt::Display for Reset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.second_of_day;
        write!(f, "{:02}:{:02}", s / 3600, s / 60 % 60)?;
        if !s.is_multiple_of(60) {
            write!(f, ":{:02}", s % 60)?;
        }
        let o = self.offset_minutes;
        let sign = if o < 0 { '-' } else { '+' };
        write!(
            f,
            "{sign}{:02}:{:02}",
            o.unsigned_abs() / 60,
            o.unsigned_abs() % 60
        )
    }
}

/// Why a limit such as `100/60s` was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitError {
    #[error("a limit is COUNT/DURATION, e.g. 100/60s, 20/1s, 100/1m or 5000/1h; got {0:?}")]
    Shape(String),
    #[error("the count in {0:?} must be a whole number from 1 to 1000000000")]
    Count(String),
    #[error("the duration in {0:?} must be a positive number with a unit: ms, s, m, h or d")]
    Window(String),
    #[error(
        "a calendar limit is COUNT/1d@HH:MM±HH:MM (a day starting at that time in that offset, e.g. 1000/1d@00:00+09:00 or 500/1d@06:30Z); got {0:?}"
    )]
    Calendar(String),
}

impl Limit {
    /// Builds a limit; `count` and `window` must be positive.
    pub fn new(count: u32, window: Duration) -> Option<Self> {
        (count > 0 && !window.is_zero() && window.as_micros() <= u64::MAX as u128).then_some(Self {
            count,
            window,
            reset: None,
        })
    }

    /// A calendar limit: at most `count` in each day starting at `reset`.
    pub fn calendar(count: u32, reset: Reset) -> Option<Self> {
        Some(Self {
            reset: Some(reset),
            ..Self::new(count, Duration::from_secs(DAY_SECS as u64))?
        })
    }

    /// When a calendar limit's day starts (`None`: a sliding window).
    pub fn reset(&self) -> Option<Reset> {
        self.reset
    }

    /// The window as the scripts take it: µs, and `@PHASE_US` for a calendar limit.
    fn window_arg(&self) -> String {
        match self.reset {
            None => self.window_us().to_string(),
            Some(reset) => format!("{}@{}", self.window_us(), reset.phase_us()),
        }
    }
    pub fn count(&self) -> u32 {
        self.count
    }
    pub fn window(&self) -> Duration {
        self.window
    }
    pub fn window_us(&self) -> u64 {
        self.window.as_micros() as u64
    }
    /// The shortest time in which `n` registrations can be made from an idle start:
    /// `(ceil(n / COUNT) - 1)` windows.
    pub fn optimum_drain(&self, n: u64) -> Duration {
        let windows = n.div_ceil(self.count as u64).saturating_sub(1);
        self.window * windows as u32
    }
}

impl FromStr for Limit {
    type Err = LimitError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (count, window) = s
            .trim()
            .split_once('/')
            .ok_or_else(|| LimitError::Shape(s.to_owned()))?;
        let count: u32 = count
            .trim()
            .parse()
            .ok()
            .filter(|c| (1..=1_000_000_000).contains(c))
            .ok_or_else(|| LimitError::Count(s.to_owned()))?;
        if let Some((window, reset)) = window.split_once('@') {
            let calendar = || LimitError::Calendar(s.trim().to_owned());
            if parse_duration(window) != Some(Duration::from_secs(DAY_SECS as u64)) {
                return Err(calendar());
            }
            let reset = Reset::parse(reset.trim()).ok_or_else(calendar)?;
            return Limit::calendar(count, reset).ok_or_else(calendar);
        }
        let window = parse_duration(window).ok_or_else(|| LimitError::Window(s.to_owned()))?;
        Limit::new(count, window).ok_or_else(|| LimitError::Window(s.to_owned()))
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, format_duration(self.window))?;
        if let Some(reset) = self.reset {
            write!(f, "@{reset}")?;
        }
        Ok(())
    }
}

/// A stack of per-seller limits that must all hold, e.g. `100/1m,2000/1d`: 1 to
/// [`Limits::MAX`] limits, ordered by window, no two with the same window. A call of cost N takes
/// N units of every limit of the stack.
#[derive(Clone)]
pub struct Limits {
    /// The limits, shortest window first (shared: a stack is cloned into every reservation).
    items: std::sync::Arc<[Limit]>,
}

/// Why a stack such as `6/1s,20/5s` was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitsError {
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("a stack holds 1 to 8 limits, comma-separated (e.g. 100/1m,2000/1d); got {0:?}")]
    Size(String),
    #[error("two limits of {0:?} have the same window {1}: keep only the stricter one")]
    SameWindow(String, String),
}

impl Limits {
    /// Most limits in a stack (as MAX_STACK in `lua/include/limits.lua`).
    pub const MAX: usize = 8;

    /// A stack of one limit.
    pub fn single(limit: Limit) -> Self {
        Self {
            items: std::sync::Arc::new([limit]),
        }
    }

    /// A stack of `limits` (ordered by window here), or why not.
    pub fn new(limits: &[Limit]) -> Result<Self, LimitsError> {
        let shown = || {
            limits
                .iter()
                .map(Limit::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        if limits.is_empty() || limits.len() > Self::MAX {
            return Err(LimitsError::Size(shown()));
        }
        let mut items = limits.to_vec();
        items.sort_by_key(|l| (l.window, l.count));
        if let Some(pair) = items
            .windows(2)
            .find(|pair| pair[0].window == pair[1].window)
        {
            return Err(LimitsError::SameWindow(
                shown(),
                format_duration(pair[0].window),
            ));
        }
        Ok(Self {
            items: items.into(),
        })
    }

    /// The limits, shortest window first.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &Limit> + '_ {
        self.items.iter()
    }
    pub fn as_slice(&self) -> &[Limit] {
        &self.items
    }
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// Always false: a stack holds at least one limit.
    pub fn is_empty(&self) -> bool {
        false
    }
    pub fn is_stack(&self) -> bool {
        self.items.len() > 1
    }

    /// The shortest window of the stack.
    pub fn shortest_window(&self) -> Duration {
        self.items[0].window
    }

    /// The most units one call may take: the smallest COUNT of the stack.
    pub fn min_count(&self) -> u32 {
        self.iter().map(Limit::count).min().unwrap_or(1)
    }

    /// The limit with the lowest long-run rate (COUNT per window): the one that binds a long
    /// backlog.
    pub fn slowest(&self) -> Limit {
        *self
            .iter()
            .min_by(|a, b| {
                (u128::from(a.count) * b.window.as_nanos())
                    .cmp(&(u128::from(b.count) * a.window.as_nanos()))
            })
            .expect("a stack is never empty")
    }

    /// The counts as the scripts take them: `6,20`.
    pub fn counts_arg(&self) -> String {
        self.iter()
            .map(|l| l.count.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The windows in µs as the scripts take them: `1000000,5000000`; a calendar limit's as
    /// `WINDOW_US@PHASE_US` (its day's start in µs after midnight UTC).
    pub fn windows_arg(&self) -> String {
        self.iter()
            .map(Limit::window_arg)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Whether a limit of the stack is a calendar limit (sliding-window only).
    pub fn has_calendar(&self) -> bool {
        self.iter().any(|l| l.reset.is_some())
    }

    /// The stack the scripts answer (`counts_arg`, `windows_arg`), or `None` if malformed.
    pub fn from_args(counts: &str, windows: &str) -> Option<Self> {
        let counts: Vec<u32> = counts
            .split(',')
            .map(|c| c.parse().ok())
            .collect::<Option<_>>()?;
        let windows: Vec<(u64, Option<u64>)> = windows
            .split(',')
            .map(|w| match w.split_once('@') {
                Some((w, phase)) => Some((w.parse().ok()?, Some(phase.parse().ok()?))),
                None => Some((w.parse().ok()?, None)),
            })
            .collect::<Option<_>>()?;
        if counts.len() != windows.len() {
            return None;
        }
        let limits: Vec<Limit> = counts
            .into_iter()
            .zip(windows)
            .map(|(c, (w, phase))| match phase {
                None => Limit::new(c, Duration::from_micros(w)),
                Some(phase) => (w == DAY_SECS as u64 * 1_000_000)
                    .then(|| Limit::calendar(c, Reset::of_phase_us(phase)?))
                    .flatten(),
            })
            .collect::<Option<_>>()?;
        Self::new(&limits).ok()
    }

    /// The shortest time in which `units` units can be registered from an idle start, one unit
    /// per call: see [`Self::optimum_drain_of`].
    pub fn optimum_drain(&self, units: u64) -> Duration {
        let mut shaper = Shaper::new(self);
        let mut left = units;
        let mut at = 0;
        while left > 0 {
            at = shaper.earliest(at, 1);
            let batch = shaper.room(at).min(left);
            shaper.grant(at, batch);
            left -= batch;
        }
        Duration::from_micros(at)
    }

    /// The shortest time in which calls of these costs, in this order, can be registered from
    /// an idle start: each at the earliest moment every limit of the stack has room for its
    /// cost in each trailing window (the greedy schedule, which no other schedule of the same
    /// calls in the same order beats: it is the network-calculus greedy shaper). For one limit
    /// and unit costs, `(ceil(n / COUNT) - 1)` windows.
    pub fn optimum_drain_of(&self, costs: impl IntoIterator<Item = u32>) -> Duration {
        let mut shaper = Shaper::new(self);
        let mut at = 0;
        for cost in costs {
            let cost = u64::from(cost.clamp(1, self.min_count()));
            at = shaper.earliest(at, cost);
            shaper.grant(at, cost);
        }
        Duration::from_micros(at)
    }
}

/// The greedy schedule of a stack, in µs from an idle start: every grant so far and, per limit,
/// where its trailing window starts in them and how many units it holds.
struct Shaper {
    grants: Vec<(u64, u64)>,
    limits: Vec<(u64, u64, usize, u64)>,
}

impl Shaper {
    fn new(limits: &Limits) -> Self {
        Self {
            grants: Vec::new(),
            limits: limits
                .iter()
                .map(|l| (u64::from(l.count), l.window_us(), 0, 0))
                .collect(),
        }
    }

    /// Moves each limit's window to end at `at`.
    fn slide(&mut self, at: u64) {
        for (_, window, start, held) in &mut self.limits {
            while *start < self.grants.len() && self.grants[*start].0 + *window <= at {
                *held -= self.grants[*start].1;
                *start += 1;
            }
        }
    }

    /// The earliest moment from `at` on when every limit has room for `cost` more units.
    fn earliest(&mut self, mut at: u64, cost: u64) -> u64 {
        loop {
            self.slide(at);
            let later = self
                .limits
                .iter()
                .filter(|(count, _, _, held)| held + cost > *count)
                .map(|(count, window, start, held)| {
                    // The oldest grants that must leave for `cost` more to fit.
                    let mut excess = held + cost - count;
                    let mut i = *start;
                    while excess > self.grants[i].1 {
                        excess -= self.grants[i].1;
                        i += 1;
                    }
                    self.grants[i].0 + window
                })
                .max();
            match later {
                Some(later) => at = later,
                None => return at,
            }
        }
    }

    /// How many units every limit still has room for at `at`.
    fn room(&mut self, at: u64) -> u64 {
        self.slide(at);
        self.limits
            .iter()
            .map(|(count, _, _, held)| count - held)
            .min()
            .unwrap_or(0)
    }

    fn grant(&mut self, at: u64, units: u64) {
        match self.grants.last_mut() {
            Some((t, n)) if *t == at => *n += units,
            _ => self.grants.push((at, units)),
        }
        for (_, _, _, held) in &mut self.limits {
            *held += units;
        }
    }
}

impl FromStr for Limits {
    type Err = LimitsError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let limits: Vec<Limit> = s
            .split(',')
            .map(str::parse)
            .collect::<Result<_, LimitError>>()?;
        Self::new(&limits)
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, limit) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{limit}")?;
        }
        Ok(())
    }
}

impl PartialEq for Limits {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Limits {}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Limits({self})")
    }
}

impl From<Limit> for Limits {
    fn from(limit: Limit) -> Self {
        Self::single(limit)
    }
}

/// Parses `250ms`, `1s`, `1.5s`, `2m`, `1h`, `1d`; a bare number means seconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: f64 = number.parse().ok()?;
    let unit_secs = match unit.trim() {
        "ms" => 0.001,
        "" | "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        _ => return None,
    };
    let secs = number * unit_secs;
    (secs.is_finite() && secs > 0.0 && secs < 1e9).then(|| Duration::from_secs_f64(secs))
}

/// The shortest exact spelling of a duration (`60s` prints as `1m`).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if !d.subsec_nanos().is_multiple_of(1_000_000) || ms == 0 {
        return format!("{}us", d.as_micros());
    }
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// The limiter algorithm (one Lua script each, see `lua/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Algorithm {
    /// Exact: at most COUNT in any trailing window; reserves future slots for waiting callers.
    SlidingWindow,
    /// Exact pacing with O(1) state (theoretical arrival time); bursts only as configured.
    Gcra,
    /// Rate plus a bucket of CAPACITY tokens; allows up to CAPACITY + COUNT in one window.
    TokenBucket,
    /// A counter per aligned window; allows up to 2 x COUNT across a window edge.
    FixedWindow,
}

impl Algorithm {
    pub const ALL: [Algorithm; 4] = [
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
        Algorithm::TokenBucket,
        Algorithm::FixedWindow,
    ];
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::SlidingWindow => "sliding-window",
            Algorithm::Gcra => "gcra",
            Algorithm::TokenBucket => "token-bucket",
            Algorithm::FixedWindow => "fixed-window",
        }
    }

    /// The algorithm of that name (as [`Algorithm::name`] writes it).
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Whether no trailing window ever holds more than COUNT grants (sliding-window, gcra);
    /// token-bucket and fixed-window allow up to twice that across a refill or a window edge.
    pub fn is_exact(&self) -> bool {
        matches!(self, Algorithm::SlidingWindow | Algorithm::Gcra)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a limit flag (`COUNT/DURATION`, e.g. `20/1s`) with an error that says what is wrong.
pub fn limit_arg(s: &str) -> Result<Limit, String> {
    s.parse().map_err(|e: LimitError| e.to_string())
}

/// Parses a stack flag (`COUNT/DURATION[,COUNT/DURATION…]`, e.g. `6/1s,20/5s`) with an error
/// that says what is wrong.
pub fn limits_arg(s: &str) -> Result<Limits, String> {
    s.parse().map_err(|e: LimitsError| e.to_string())
}

/// `TURNSTILE_LIMIT`'s default.
pub const DEFAULT_LIMIT: &str = "100/60s";

fn parse_limits(s: &str) -> Result<Limits, String> {
    limits_arg(s).map_err(|e| format!("{e} (TURNSTILE_LIMIT)"))
}

fn parse_key_prefix(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 64 {
        return Err("must be 1 to 64 characters".into());
    }
    if s.contains(['{', '}']) || s.chars().any(char::is_control) {
        return Err("must not contain braces (they would change the Redis Cluster hash tag) or control characters".into());
    }
    Ok(s.to_owned())
}

/// Where Redis is and how to reach it. Its `Debug` hides the URL's password.
///
/// Connection flags are global: the command line takes them before or after the subcommand of
/// any command that uses them (`turnstile --key-prefix p limits get ...` as well as
/// `turnstile limits get ... --key-prefix p`), so every definition of them is `global`.
#[derive(Args, Clone)]
#[command(next_help_heading = "Connection")]
pub struct RedisArgs {
    /// Redis URL; a comma-separated list of node URLs means Redis Cluster.
    #[arg(
        id = "redis_url",
        long = "redis-url",
        env = "TURNSTILE_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/",
        hide_env_values = true,
        value_name = "URL",
        global = true
    )]
    pub url: String,
    /// Force Redis Cluster mode with a single seed URL.
    #[arg(id = "redis_cluster", long = "redis-cluster", env = "TURNSTILE_REDIS_CLUSTER", default_value = "off", value_name = "ON|OFF", num_args = 0..=1, default_missing_value = "on", action = clap::ArgAction::Set, value_parser = Switch, global = true)]
    pub cluster: bool,
    /// Prefix of every Redis key (1 to 64 characters, no braces).
    #[arg(id = "key_prefix", long = "key-prefix", env = "TURNSTILE_KEY_PREFIX", default_value = "turnstile", value_parser = parse_key_prefix, value_name = "PREFIX", global = true)]
    pub key_prefix: String,
}

impl std::fmt::Debug for RedisArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisArgs")
            .field("url", &redact_url(&self.url))
            .field("cluster", &self.cluster)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}

/// How permits are decided: the default limit, the algorithm and its tuning (everything
/// `turnstile consume` runs with). The one declaration of these settings: the operator
/// commands read a part of them only ([`TermsArgs`], [`DefaultLimitArgs`], [`GlobalLimitArgs`]),
/// whose flags they take from here (flag, variable, default, parser and help).
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Limits")]
pub struct LimiterArgs {
    /// Default per-seller limit, COUNT/DURATION (e.g. 20/1s, 100/1m, 5000/1h); a
    /// comma-separated stack must all hold (e.g. 100/1m,2000/1d).
    #[arg(long, env = "TURNSTILE_LIMIT", default_value = DEFAULT_LIMIT, value_parser = parse_limits)]
    pub limit: Limits,
    /// The limiter algorithm.
    #[arg(long, env = "TURNSTILE_ALGORITHM", value_enum, default_value_t = Algorithm::SlidingWindow)]
    pub algorithm: Algorithm,
    /// Time added to every window against a downstream counting with a coarser or drifting
    /// clock [default: none with sliding-window and for the global limit, whose calls hold
    /// their place until their answer; window/20, between 25ms and 2s, for a seller's limits
    /// under the other algorithms].
    #[arg(long = "limit-guard", env = "TURNSTILE_LIMIT_GUARD", value_parser = parse_duration_arg, value_name = "DURATION")]
    pub guard: Option<Duration>,
    /// gcra: grants allowed at once after idleness (1 = pure pacing at COUNT per window).
    #[arg(long, env = "TURNSTILE_GCRA_BURST", default_value_t = 1)]
    pub gcra_burst: u32,
    /// token-bucket: bucket capacity (0 = COUNT).
    #[arg(long, env = "TURNSTILE_BUCKET_CAPACITY", default_value_t = 0)]
    pub bucket_capacity: u32,
    /// Farthest ahead a waiting caller may reserve a slot.
    #[arg(long = "reserve-horizon", env = "TURNSTILE_RESERVE_HORIZON", default_value = "24h", value_parser = parse_duration_arg, value_name = "DURATION")]
    pub horizon: Duration,
    /// Redis keeps its data across restarts (AOF, replicas): skip the wait of one window that
    /// otherwise follows a Redis start, when grants made before it may have been lost.
    #[arg(long = "redis-durable", env = "TURNSTILE_REDIS_DURABLE", default_value = "off", value_name = "ON|OFF", num_args = 0..=1, default_missing_value = "on", action = clap::ArgAction::Set, value_parser = Switch)]
    pub redis_durable: bool,
    /// One limit (or a comma-separated stack) for all sellers together, in cost units, shared
    /// fairly among the sellers with work by their weights; `off` disables it.
    #[arg(long = "global-limit", env = "TURNSTILE_GLOBAL_LIMIT", default_value = "off", value_parser = parse_global_limit)]
    pub global_limit: GlobalLimit,
    /// Most calls of one seller in flight at once across every replica (leases in Redis that
    /// expire if a replica dies); `off` disables it.
    #[arg(long = "seller-concurrency", env = "TURNSTILE_SELLER_CONCURRENCY", default_value = "off", value_parser = parse_concurrency)]
    pub seller_concurrency: SellerConcurrency,
    /// Adaptive limits: a 429 lowers the seller's limit to what the downstream accepted,
    /// sustained success raises it again up to the configured one, and rate-limit headers set
    /// it (shared by every replica through Redis); `off` keeps the configured limits only.
    #[arg(long = "adaptive", env = "TURNSTILE_ADAPTIVE", default_value = "on", value_name = "ON|OFF", num_args = 0..=1, default_missing_value = "on", action = clap::ArgAction::Set, value_parser = Switch)]
    pub adaptive: bool,
    /// Lowest count a learned limit goes to, per window of each limit (a configured COUNT below
    /// it is kept).
    #[arg(
        long = "adaptive-min",
        env = "TURNSTILE_ADAPTIVE_MIN",
        default_value = "1"
    )]
    pub adaptive_min: std::num::NonZeroU32,
    /// Longest a completion record (or a call's end, or what a 2xx's headers teach) waits to
    /// ride along with another call to Redis; also at most a quarter of the shortest window. A
    /// replica killed in that time leaves the message to be called again (docs/performance.md, "Redis calls
    /// per message"); `0` (the default) sends each as soon as the calls in flight allow, as
    /// strict as a record written at once. At most 1 s.
    #[arg(long = "record-delay", env = "TURNSTILE_RECORD_DELAY", default_value = "0", value_parser = delay_arg)]
    pub record_delay: Duration,
    /// Permit blocks (sliding-window): with a grant, up to this many more units go at once into
    /// the seller's pool for its next calls by any replica, while the seller is far from its
    /// limits (every limit at most half used); they are claimed within 2 s of the grant and
    /// counted in flight until then plus the call's bound, so the limit stays exact (docs/performance.md,
    /// "Permit blocks"). `0` turns blocks off for this replica: one acquire per call, no claim
    /// from a pool. At most 64.
    #[arg(long = "permit-block", env = "TURNSTILE_PERMIT_BLOCK", default_value_t = 32, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub permit_block: u32,
    /// The fleet's stacks of the routes, by name (the strictest of every live replica's routes
    /// file, see `crate::fleet`): a call on a route takes its stack from here when it is named,
    /// else from the route itself. Not a flag: set when the fleet's terms apply.
    #[arg(skip)]
    pub route_limits: std::collections::BTreeMap<crate::domain::RouteName, Limits>,
}

/// `on`/`off` (also `true`/`false`, `1`/`0`, `yes`/`no`, in any case).
pub fn parse_switch(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(format!(
            "{s:?} is not on or off (also true/false, 1/0, yes/no)"
        )),
    }
}

/// The value parser of every on/off setting, for its flag and its environment variable alike:
/// `on`/`off`, also `true`/`false`, `1`/`0`, `yes`/`no`, in any case (see [`parse_switch`]).
/// Such a flag takes its value as `--flag off` or `--flag=off`, and alone means `on`
/// (`num_args = 0..=1, default_missing_value = "on"`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Switch;

impl clap::builder::TypedValueParser for Switch {
    type Value = bool;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<bool, clap::Error> {
        use clap::error::{ContextKind, ContextValue, ErrorKind};
        let text = value.to_string_lossy();
        parse_switch(&text).map_err(|_| {
            let mut error = clap::Error::new(ErrorKind::InvalidValue).with_cmd(cmd);
            if let Some(arg) = arg {
                error.insert(
                    ContextKind::InvalidArg,
                    ContextValue::String(arg.to_string()),
                );
            }
            error.insert(
                ContextKind::InvalidValue,
                ContextValue::String(text.into_owned()),
            );
            error.insert(
                ContextKind::ValidValue,
                ContextValue::Strings(
                    ["on", "off", "true", "false", "1", "0", "yes", "no"]
                        .map(String::from)
                        .to_vec(),
                ),
            );
            error
        })
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        use clap::builder::PossibleValue;
        Some(Box::new(
            [
                PossibleValue::new("on").aliases(["true", "1", "yes"]),
                PossibleValue::new("off").aliases(["false", "0", "no"]),
            ]
            .into_iter(),
        ))
    }
}

/// `TURNSTILE_SELLER_CONCURRENCY`: most calls of one seller in flight, or no such cap (`off`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SellerConcurrency(pub Option<std::num::NonZeroU32>);

fn parse_concurrency(s: &str) -> Result<SellerConcurrency, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(SellerConcurrency(None));
    }
    s.trim()
        .parse::<std::num::NonZeroU32>()
        .map(|n| SellerConcurrency(Some(n)))
        .map_err(|_| {
            format!("{s:?} is not a number of calls >= 1 or off (TURNSTILE_SELLER_CONCURRENCY)")
        })
}

/// `TURNSTILE_GLOBAL_LIMIT`: a stack of limits for all sellers together, or none (`off`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GlobalLimit(pub Option<Limits>);

impl fmt::Display for GlobalLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(limits) => write!(f, "{limits}"),
            None => f.write_str("off"),
        }
    }
}

fn parse_global_limit(s: &str) -> Result<GlobalLimit, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(GlobalLimit(None));
    }
    limits_arg(s)
        .map(|limits| GlobalLimit(Some(limits)))
        .map_err(|e| format!("{e} (TURNSTILE_GLOBAL_LIMIT: a limit, a stack, or off)"))
}

fn parse_duration_arg(s: &str) -> Result<Duration, String> {
    parse_duration(s)
        .ok_or_else(|| format!("{s:?} is not a duration such as 500ms, 30s, 5m or 24h"))
}

/// Parses a delay flag: a duration, or zero (`0`, `0ms`, `0s`).
pub fn delay_arg(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let digits = t
        .strip_suffix("ms")
        .or_else(|| t.strip_suffix('s'))
        .unwrap_or(t);
    if digits.contains('0') && digits.chars().all(|c| c == '0' || c == '.') {
        return Ok(Duration::ZERO);
    }
    parse_duration_arg(s)
}

/// The broker's consumer timeout as the operator set it (`TURNSTILE_CONSUMER_TIMEOUT`): RabbitMQ
/// closes a channel whose oldest unacked delivery is older than this (`consumer_timeout`, 30
/// minutes by default, counted from the delivery); `None` when the broker enforces none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConsumerTimeout(Option<Duration>);

impl ConsumerTimeout {
    /// RabbitMQ's default `consumer_timeout`.
    pub const DEFAULT: Duration = Duration::from_secs(30 * 60);
    /// The shortest accepted: below it a delivery's hold and its call would not fit.
    pub const SHORTEST: Duration = Duration::from_secs(5);

    /// `Some(timeout)`, or `None` for a broker that enforces no consumer timeout.
    pub fn new(timeout: Option<Duration>) -> Self {
        Self(timeout)
    }

    /// The timeout, if the broker enforces one.
    pub fn get(self) -> Option<Duration> {
        self.0
    }
}

impl Default for ConsumerTimeout {
    fn default() -> Self {
        Self(Some(Self::DEFAULT))
    }
}

impl std::fmt::Display for ConsumerTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(timeout) => f.write_str(&format_duration(timeout)),
            None => f.write_str("off"),
        }
    }
}

impl std::str::FromStr for ConsumerTimeout {
    type Err = String;

    /// A duration (`30m`, `2h`, `1800000ms`) of at least [`ConsumerTimeout::SHORTEST`], or
    /// `off` for a broker without one.
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("off") {
            return Ok(Self(None));
        }
        let timeout = duration_arg(s).map_err(|e| {
            format!("{e} (TURNSTILE_CONSUMER_TIMEOUT: the broker's consumer_timeout, or off)")
        })?;
        if timeout < Self::SHORTEST {
            return Err(format!(
                "TURNSTILE_CONSUMER_TIMEOUT {s:?} is shorter than {}s: a held delivery and its call would not fit in it",
                Self::SHORTEST.as_secs()
            ));
        }
        Ok(Self(Some(timeout)))
    }
}

/// Parses a duration flag (`500ms`, `30s`, `5m`, `24h`) with an error that shows the value.
pub fn duration_arg(s: &str) -> Result<Duration, String> {
    parse_duration_arg(s)
}

impl LimiterArgs {
    /// The defaults of every tuning setting, with a limit and an algorithm.
    pub fn new(limit: impl Into<Limits>, algorithm: Algorithm) -> Self {
        Self {
            limit: limit.into(),
            algorithm,
            ..Self::declared_defaults().clone()
        }
    }

    /// Every setting at the default its flag declares (no variable is read): the defaults are
    /// stated once, on the flags.
    fn declared_defaults() -> &'static Self {
        static DEFAULTS: std::sync::OnceLock<LimiterArgs> = std::sync::OnceLock::new();
        DEFAULTS.get_or_init(|| {
            let matches = Self::augment_args(clap::Command::new("defaults"))
                .mut_args(|a| a.env(None))
                .try_get_matches_from(["defaults"])
                .expect("every limiter setting has a default");
            <Self as clap::FromArgMatches>::from_arg_matches(&matches)
                .expect("every limiter setting has a default")
        })
    }

    /// Refuses settings that cannot work together, with what to use instead (checked at start).
    pub fn check(&self) -> Result<(), String> {
        if self.record_delay > Duration::from_secs(1) {
            return Err(format!(
                "TURNSTILE_RECORD_DELAY={} is longer than 1s: a completion record would wait that \
                 long before its message is acked; use 1s or less",
                format_duration(self.record_delay)
            ));
        }
        if self.limit.has_calendar() && self.algorithm != Algorithm::SlidingWindow {
            return Err(format!(
                "TURNSTILE_LIMIT={} has a calendar limit, which needs TURNSTILE_ALGORITHM=sliding-window \
                 (the calls of the day are kept in its log)",
                self.limit
            ));
        }
        if self
            .global_limit
            .0
            .as_ref()
            .is_some_and(Limits::has_calendar)
        {
            return Err("TURNSTILE_GLOBAL_LIMIT cannot hold a calendar limit (COUNT/1d@...): use a sliding 1d".into());
        }
        if self.limit.is_stack()
            && self.algorithm == Algorithm::TokenBucket
            && self.bucket_capacity > 0
        {
            return Err(format!(
                "TURNSTILE_BUCKET_CAPACITY={} applies to a single limit, but TURNSTILE_LIMIT={} is a \
                 stack, whose buckets each hold their own COUNT: unset the capacity, or use one limit",
                self.bucket_capacity, self.limit
            ));
        }
        Ok(())
    }

    /// The guard in effect for a window of the seller's own stack (see [`seller_guard`]).
    pub fn guard_for(&self, window: Duration) -> Duration {
        guard_for(self.seller_guard(), window)
    }

    /// The guard of the seller's own windows: see [`seller_guard`].
    pub fn seller_guard(&self) -> Option<Duration> {
        seller_guard(self.algorithm, self.guard)
    }

    /// The guard of the global limit's windows: see [`global_guard`].
    pub fn global_guard(&self) -> Duration {
        global_guard(self.guard)
    }
}

/// The guard of the global limit's windows: the configured one (`TURNSTILE_LIMIT_GUARD`), else
/// none: each call holds its place in the global log from its grant until its answer, so that
/// no window of the downstream can hold more than COUNT whatever each call's latency
/// (`lua/global.lua`), and a guard would only leave budget unused.
pub fn global_guard(configured: Option<Duration>) -> Duration {
    configured.unwrap_or(Duration::ZERO)
}

/// The guard of a seller's own windows under `algorithm`: the configured one
/// (`TURNSTILE_LIMIT_GUARD`), else none with sliding-window, whose calls hold their place in
/// the seller's windows from their grant until their answer, so that no window of the
/// downstream can hold more than COUNT whatever each call's latency, and a guard would only slow
/// the drain (docs/guarantees.md, "Exact whatever the latency"); else (`None`) the default of
/// [`guard_for`]. The global limit has its own, [`global_guard`].
pub fn seller_guard(algorithm: Algorithm, configured: Option<Duration>) -> Option<Duration> {
    match (configured, algorithm) {
        (Some(guard), _) => Some(guard),
        (None, Algorithm::SlidingWindow) => Some(Duration::ZERO),
        (None, _) => None,
    }
}

/// The guard in effect for a window: the configured one (`TURNSTILE_LIMIT_GUARD`), or
/// window/20 within [25ms, 2s] (as `guard_for` in `lua/include/limits.lua` computes it).
pub fn guard_for(configured: Option<Duration>, window: Duration) -> Duration {
    configured
        .unwrap_or_else(|| (window / 20).clamp(Duration::from_millis(25), Duration::from_secs(2)))
}

/// The heading of the limiter's settings an operator command reads.
const TERMS_HEADING: &str = "Terms (as the replicas run with them)";

/// `cmd` with the arguments of [`LimiterArgs`] whose ids are `ids`, as LimiterArgs declares
/// them (flag, variable, default, parser, help), in that order under `heading`: how a command
/// that reads a part of the limiter's settings takes it from their one declaration.
fn limiter_part(cmd: clap::Command, heading: &'static str, ids: &[&str]) -> clap::Command {
    let declared = LimiterArgs::augment_args(clap::Command::new("limiter"));
    ids.iter().fold(cmd.next_help_heading(heading), |cmd, id| {
        let arg = declared
            .get_arguments()
            .find(|a| a.get_id() == *id)
            .unwrap_or_else(|| panic!("LimiterArgs declares no argument {id:?}"))
            .clone();
        cmd.arg(arg.help_heading(heading).display_order(None))
    })
}

/// The value of `id`, an argument of a part of [`LimiterArgs`] (each has a default).
fn part_value<T: Clone + Send + Sync + 'static>(
    matches: &clap::ArgMatches,
    id: &str,
) -> Result<T, clap::Error> {
    matches.get_one::<T>(id).cloned().ok_or_else(|| {
        clap::Error::raw(
            clap::error::ErrorKind::MissingRequiredArgument,
            format!("no value for {id}"),
        )
    })
}

/// The terms under which a seller's limits are read and changed from outside a replica
/// (`turnstile status`, `turnstile limits`): the default limit, the algorithm with the settings
/// its state is read by, the guard and adaptive limits. They must be the replicas' own
/// (`TURNSTILE_LIMIT`, ...): a part of [`LimiterArgs`], whose flags it takes from there. A full
/// [`LimiterArgs`] is built from them with the defaults of every other setting
/// ([`LimiterArgs::with_terms`]).
#[derive(Clone, Debug)]
pub struct TermsArgs {
    /// [`LimiterArgs::limit`].
    pub limit: Limits,
    /// [`LimiterArgs::algorithm`].
    pub algorithm: Algorithm,
    /// [`LimiterArgs::guard`].
    pub guard: Option<Duration>,
    /// [`LimiterArgs::gcra_burst`].
    pub gcra_burst: u32,
    /// [`LimiterArgs::bucket_capacity`].
    pub bucket_capacity: u32,
    /// [`LimiterArgs::adaptive`].
    pub adaptive: bool,
}

impl TermsArgs {
    /// The ids of its arguments in [`LimiterArgs`], in the order they are listed.
    const IDS: [&str; 6] = [
        "limit",
        "algorithm",
        "guard",
        "gcra_burst",
        "bucket_capacity",
        "adaptive",
    ];
}

impl Args for TermsArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        limiter_part(cmd, TERMS_HEADING, &Self::IDS)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for TermsArgs {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self {
            limit: part_value(matches, "limit")?,
            algorithm: part_value(matches, "algorithm")?,
            guard: matches.get_one::<Duration>("guard").copied(),
            gcra_burst: part_value(matches, "gcra_burst")?,
            bucket_capacity: part_value(matches, "bucket_capacity")?,
            adaptive: part_value(matches, "adaptive")?,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

/// The replicas' global limit, for the commands that read its use (`turnstile status`): a part
/// of [`LimiterArgs`], whose flag it takes from there.
#[derive(Clone, Debug)]
pub struct GlobalLimitArgs {
    /// [`LimiterArgs::global_limit`].
    pub global_limit: GlobalLimit,
}

impl Args for GlobalLimitArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        limiter_part(cmd, TERMS_HEADING, &["global_limit"])
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for GlobalLimitArgs {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self {
            global_limit: part_value(matches, "global_limit")?,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

/// The replicas' default limit alone, for a command that only estimates with it (`turnstile
/// publish`: how long an upload takes at the seller's limit): a part of [`LimiterArgs`], whose
/// flag it takes from there.
#[derive(Clone, Debug)]
pub struct DefaultLimitArgs {
    /// [`LimiterArgs::limit`].
    pub limit: Limits,
}

impl Args for DefaultLimitArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        limiter_part(cmd, TERMS_HEADING, &["limit"])
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for DefaultLimitArgs {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self {
            limit: part_value(matches, "limit")?,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl LimiterArgs {
    /// The replicas' terms, with the defaults of every other setting.
    pub fn with_terms(terms: TermsArgs) -> Self {
        let TermsArgs {
            limit,
            algorithm,
            guard,
            gcra_burst,
            bucket_capacity,
            adaptive,
        } = terms;
        Self {
            guard,
            gcra_burst,
            bucket_capacity,
            adaptive,
            ..Self::new(limit, algorithm)
        }
    }

    /// These settings under a global limit.
    pub fn with_global_limit(self, global: GlobalLimitArgs) -> Self {
        Self {
            global_limit: global.global_limit,
            ..self
        }
    }
}

impl From<DefaultLimitArgs> for LimiterArgs {
    /// The default limit, with the defaults of every other setting.
    fn from(default: DefaultLimitArgs) -> Self {
        Self {
            limit: default.limit,
            ..Self::default()
        }
    }
}

impl Default for LimiterArgs {
    /// Every setting's default (for a command that reads none of them).
    fn default() -> Self {
        Self::declared_defaults().clone()
    }
}

/// The URL (or comma-separated URLs) with passwords and query values hidden, for messages.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(redact_one_url)
        .collect::<Vec<_>>()
        .join(",")
}

/// One URL with its user info (`user:password@`) and its query (API keys) hidden.
fn redact_one_url(url: &str) -> String {
    let (base, query) = match url.split_once(['?', '#']) {
        Some((base, _)) => (base, "?***"),
        None => (url, ""),
    };
    let Some((scheme, rest)) = base.split_once("://") else {
        return format!("{base}{query}");
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{path}{query}"),
        None => format!("{base}{query}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_template_with_a_placeholder_other_than_seller_id_is_refused_naming_both() {
        let error = UrlTemplate::parse("http://api.test/register/{seller}")
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "unknown placeholder {seller}: the only placeholder is {seller_id}"
        );
        for text in [
            "http://api.test/{seller_id}/{batch_id}",
            "http://api.test/r?seller={Seller_ID}",
            "http://api.test/r/{}",
        ] {
            assert!(
                matches!(
                    UrlTemplate::parse(text),
                    Err(UrlTemplateError::UnknownPlaceholder(_))
                ),
                "{text}"
            );
        }
        assert!(matches!(
            UrlTemplate::parse("http://api.test/r/{seller_id"),
            Err(UrlTemplateError::Unclosed)
        ));
        for text in [
            "http://api.test/register/{seller_id}",
            "http://api.test/s/{seller_id}/p?again={seller_id}",
            "http://api.test/register",
        ] {
            assert!(UrlTemplate::parse(text).is_ok(), "{text}");
        }
    }

    #[test]
    fn a_sellers_sliding_window_has_no_guard_unless_one_is_configured_and_the_others_keep_theirs() {
        let ms = Duration::from_millis;
        assert_eq!(
            seller_guard(Algorithm::SlidingWindow, None),
            Some(Duration::ZERO)
        );
        assert_eq!(
            seller_guard(Algorithm::SlidingWindow, Some(ms(7))),
            Some(ms(7))
        );
        for algorithm in [
            Algorithm::Gcra,
            Algorithm::TokenBucket,
            Algorithm::FixedWindow,
        ] {
            assert_eq!(seller_guard(algorithm, None), None, "{algorithm:?}");
        }
        let sliding = LimiterArgs::new(limit_arg("10/1s").unwrap(), Algorithm::SlidingWindow);
        assert_eq!(sliding.guard_for(ms(1_000)), Duration::ZERO);
        let gcra = LimiterArgs::new(limit_arg("10/1s").unwrap(), Algorithm::Gcra);
        assert_eq!(gcra.guard_for(ms(1_000)), ms(50));
    }

    #[test]
    fn the_guard_is_a_twentieth_of_the_window_within_25_ms_and_2_s_unless_one_is_configured() {
        let ms = Duration::from_millis;
        for (window, guard) in [(100, 25), (1_000, 50), (30_000, 1_500), (3_600_000, 2_000)] {
            assert_eq!(guard_for(None, ms(window)), ms(guard), "{window} ms");
            assert_eq!(guard_for(Some(ms(7)), ms(window)), ms(7), "{window} ms");
        }
    }

    #[test]
    fn a_record_delay_may_be_zero_but_not_garbage() {
        for zero in ["0", "0ms", "0s", "0.0s"] {
            assert_eq!(delay_arg(zero), Ok(Duration::ZERO), "{zero}");
        }
        assert_eq!(delay_arg("100ms"), Ok(Duration::from_millis(100)));
        for bad in ["", "ms", "-1ms", "soon", "0x"] {
            assert!(delay_arg(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_calendar_limit_resets_at_its_time_of_day_in_its_offset() {
        let tokyo: Limits = "100/1m,1000/1d@00:00+09:00".parse().unwrap();
        assert_eq!(tokyo.to_string(), "100/1m,1000/1d@00:00+09:00");
        assert!(tokyo.has_calendar());
        // Midnight in Tokyo is 15:00 UTC: the day starts 54,000 s after midnight UTC.
        assert_eq!(tokyo.windows_arg(), "60000000,86400000000@54000000000");
        let back = Limits::from_args(&tokyo.counts_arg(), &tokyo.windows_arg()).unwrap();
        assert_eq!(back, tokyo, "the same instant, written in UTC");
        assert_eq!(back.to_string(), "100/1m,1000/1d@15:00+00:00");
        let utc: Limit = "500/1d@06:30:15Z".parse().unwrap();
        assert_eq!(
            utc.reset().unwrap().phase_us(),
            (6 * 3600 + 30 * 60 + 15) * 1_000_000
        );
        let west: Limit = "5/1d@20:00-05:00".parse().unwrap();
        assert_eq!(west.reset().unwrap().phase_us(), 3600 * 1_000_000);
        for bad in [
            "5/1h@00:00Z",
            "5/1d@24:00Z",
            "5/1d@9:00Z",
            "5/1d@09:00",
            "5/1d@09:00+9",
            "5/1d@",
            "0/1d@00:00Z",
        ] {
            assert!(bad.parse::<Limit>().is_err(), "{bad}");
        }
        assert!(
            "5/1d,9/1d@00:00Z".parse::<Limits>().is_err(),
            "one limit per window"
        );
        let sliding = LimiterArgs::new(tokyo.clone(), Algorithm::SlidingWindow);
        assert!(sliding.check().is_ok());
        let gcra = LimiterArgs::new(tokyo, Algorithm::Gcra);
        assert!(gcra.check().unwrap_err().contains("sliding-window"));
    }

    #[test]
    fn limits_parse_with_units() {
        assert_eq!(
            "20/1s".parse(),
            Ok(Limit::new(20, Duration::from_secs(1)).unwrap())
        );
        assert_eq!(
            "100/1m".parse(),
            Ok(Limit::new(100, Duration::from_secs(60)).unwrap())
        );
        assert_eq!(
            "5000/1h".parse(),
            Ok(Limit::new(5000, Duration::from_secs(3600)).unwrap())
        );
        assert_eq!(
            "10/500ms".parse(),
            Ok(Limit::new(10, Duration::from_millis(500)).unwrap())
        );
        assert_eq!("100/60s".parse::<Limit>().unwrap().to_string(), "100/1m");
    }

    #[test]
    fn malformed_limits_are_refused_with_the_reason() {
        assert!(matches!("0/1s".parse::<Limit>(), Err(LimitError::Count(_))));
        assert!(matches!("abc".parse::<Limit>(), Err(LimitError::Shape(_))));
        assert!(matches!(
            "10/0s".parse::<Limit>(),
            Err(LimitError::Window(_))
        ));
        assert!(matches!(
            "10/5y".parse::<Limit>(),
            Err(LimitError::Window(_))
        ));
        assert!(matches!(
            "-1/1s".parse::<Limit>(),
            Err(LimitError::Count(_))
        ));
    }

    #[test]
    fn optimum_drain_counts_whole_windows_after_the_first() {
        let limit: Limit = "20/1s".parse().unwrap();
        assert_eq!(limit.optimum_drain(400), Duration::from_secs(19));
        assert_eq!(limit.optimum_drain(20), Duration::ZERO);
        assert_eq!(limit.optimum_drain(21), Duration::from_secs(1));
    }

    #[test]
    fn stacks_parse_in_window_order_and_print_back() {
        let stack: Limits = "2000/1d, 100/1m".parse().unwrap();
        assert_eq!(stack.to_string(), "100/1m,2000/1d");
        assert_eq!(stack.len(), 2);
        assert_eq!(stack.min_count(), 100);
        assert_eq!(stack.counts_arg(), "100,2000");
        assert_eq!(stack.windows_arg(), "60000000,86400000000");
        assert_eq!(
            Limits::from_args(&stack.counts_arg(), &stack.windows_arg()),
            Some(stack.clone())
        );
        assert_eq!(stack.slowest().to_string(), "2000/1d");
        let one: Limits = "20/1s".parse().unwrap();
        assert!(!one.is_stack());
        assert_eq!(one, Limits::single("20/1s".parse().unwrap()));
    }

    #[test]
    fn malformed_stacks_are_refused_with_the_reason() {
        assert!(matches!(
            "10/1s,15/1s".parse::<Limits>(),
            Err(LimitsError::SameWindow(_, _))
        ));
        assert!(matches!(
            "10/1s,".parse::<Limits>(),
            Err(LimitsError::Limit(_))
        ));
        let nine = (1..=9)
            .map(|i| format!("{i}/{i}s"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(matches!(nine.parse::<Limits>(), Err(LimitsError::Size(_))));
        assert_eq!(Limits::from_args("1,2", "1000"), None);
        assert_eq!(Limits::from_args("0", "1000"), None);
    }

    #[test]
    fn the_optimum_of_a_stack_is_its_greedy_schedule() {
        let stack: Limits = "6/1s,20/5s".parse().unwrap();
        // 6, 6, 6, 2 at 0-3 s (20 in 5 s), again at 5-8 s and 10-13 s.
        assert_eq!(stack.optimum_drain(60), Duration::from_secs(13));
        assert_eq!(stack.optimum_drain(6), Duration::ZERO);
        assert_eq!(stack.optimum_drain(7), Duration::from_secs(1));
        // Costs of 3 fill 6/1s with two calls a second; 20/5s then fits 6 calls (18 units).
        assert_eq!(stack.optimum_drain_of([3; 6]), Duration::from_secs(2));
        assert_eq!(stack.optimum_drain_of([3; 7]), Duration::from_secs(5));
        let one: Limits = "20/1s".parse().unwrap();
        assert_eq!(one.optimum_drain(400), Duration::from_secs(19));
        assert_eq!(one.optimum_drain_of([1; 400]), Duration::from_secs(19));
    }

    #[test]
    fn a_bucket_capacity_is_refused_with_a_stack() {
        let mut args = LimiterArgs::new(
            "6/1s,20/5s".parse::<Limits>().unwrap(),
            Algorithm::TokenBucket,
        );
        assert_eq!(args.check(), Ok(()));
        args.bucket_capacity = 10;
        assert!(args.check().unwrap_err().contains("unset the capacity"));
    }

    /// Parses `argv` (after the program name) into `A` alone, as a subcommand would.
    fn parse_as<A: clap::FromArgMatches + Args>(argv: &[&str]) -> A {
        let matches = A::augment_args(clap::Command::new("t"))
            .try_get_matches_from(std::iter::once("t").chain(argv.iter().copied()))
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        A::from_arg_matches(&matches).unwrap()
    }

    #[test]
    fn the_operator_commands_take_each_term_from_the_limiter() {
        fn shapes(command: clap::Command) -> std::collections::BTreeMap<String, String> {
            let mut command = command;
            command.build();
            command
                .get_arguments()
                .filter(|a| a.get_id() != "help")
                .filter_map(|a| {
                    let shape = format!(
                        "{:?} {:?} {:?} {:?} {:?} {:?} {:?}",
                        a.get_help().map(ToString::to_string),
                        a.get_env(),
                        a.get_default_values(),
                        a.get_value_names(),
                        a.get_num_args(),
                        a.get_action(),
                        a.get_possible_values()
                            .iter()
                            .map(|v| v.get_name().to_owned())
                            .collect::<Vec<_>>(),
                    );
                    Some((a.get_long()?.to_owned(), shape))
                })
                .collect()
        }
        let limiter = shapes(LimiterArgs::augment_args(clap::Command::new("t")));
        for part in [
            TermsArgs::augment_args(clap::Command::new("t")),
            GlobalLimitArgs::augment_args(clap::Command::new("t")),
            DefaultLimitArgs::augment_args(clap::Command::new("t")),
        ] {
            let mut part = part;
            part.build();
            for a in part.get_arguments().filter(|a| a.get_id() != "help") {
                assert_eq!(a.get_help_heading(), Some(TERMS_HEADING), "{}", a.get_id());
            }
            for (long, shape) in shapes(part) {
                assert_eq!(limiter.get(&long), Some(&shape), "--{long}");
            }
        }
    }

    #[test]
    fn limiter_settings_built_from_the_terms_are_those_consume_parses() {
        for argv in [
            &[][..],
            &[
                "--limit",
                "5/1s,50/1m",
                "--algorithm",
                "gcra",
                "--limit-guard",
                "100ms",
                "--gcra-burst",
                "3",
                "--adaptive",
                "off",
            ],
            &["--algorithm", "token-bucket", "--bucket-capacity", "7"],
        ] {
            let built = LimiterArgs::with_terms(parse_as::<TermsArgs>(argv));
            assert_eq!(
                format!("{built:?}"),
                format!("{:?}", parse_as::<LimiterArgs>(argv)),
                "{argv:?}"
            );
        }
        let global = parse_as::<GlobalLimitArgs>(&["--global-limit", "10/1s"]);
        let built = LimiterArgs::default().with_global_limit(global);
        assert_eq!(built.global_limit.to_string(), "10/1s");
        let default = parse_as::<DefaultLimitArgs>(&["--limit", "7/1s"]);
        assert_eq!(LimiterArgs::from(default).limit.to_string(), "7/1s");
        assert_eq!(
            format!("{:?}", LimiterArgs::default()),
            format!("{:?}", parse_as::<LimiterArgs>(&[]))
        );
    }

    #[test]
    fn a_switch_takes_every_spelling_as_a_flag_value() {
        for (spelling, on) in [
            ("on", true),
            ("off", false),
            ("true", true),
            ("false", false),
            ("1", true),
            ("0", false),
            ("yes", true),
            ("no", false),
            ("OFF", false),
            ("Yes", true),
        ] {
            for argv in [
                vec!["--adaptive", spelling, "--redis-durable", spelling],
                vec![
                    format!("--adaptive={spelling}").leak(),
                    format!("--redis-durable={spelling}").leak(),
                ],
            ] {
                let args = parse_as::<LimiterArgs>(&argv);
                assert_eq!((args.adaptive, args.redis_durable), (on, on), "{argv:?}");
            }
        }
        let bare = parse_as::<LimiterArgs>(&["--redis-durable", "--adaptive"]);
        assert!(bare.redis_durable && bare.adaptive);
        let defaults = parse_as::<LimiterArgs>(&[]);
        assert!(!defaults.redis_durable && defaults.adaptive);
        let refused = LimiterArgs::augment_args(clap::Command::new("t"))
            .try_get_matches_from(["t", "--adaptive", "maybe"])
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("maybe") && refused.contains("--adaptive"),
            "{refused}"
        );
    }

    #[test]
    fn urls_are_shown_without_passwords_or_query_values() {
        assert_eq!(redact_url("redis://:pw@h:6379/0"), "redis://***@h:6379/0");
        assert_eq!(
            redact_url("redis://u:p@a:1/,redis://u:p@b:2/"),
            "redis://***@a:1/,redis://***@b:2/"
        );
        assert_eq!(
            redact_url("https://api.test/s/{seller_id}?api_key=SECRET"),
            "https://api.test/s/{seller_id}?***"
        );
        assert_eq!(redact_url("amqp://g:g@h/%2f"), "amqp://***@h/%2f");
        assert_eq!(redact_url("http://h/a@b"), "http://h/a@b");
    }
}
