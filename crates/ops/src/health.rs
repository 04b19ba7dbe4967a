//! How an outside system (the broker, Redis) looks from this replica's operator side: up or
//! down, since when, and the last error with when it happened. Fed by the checks the operator
//! side makes anyway (the queue depths every 5 s, the dashboard's samples every second), so a
//! page can say "Redis down since 03:12:09: connection refused" instead of showing old figures
//! as if they were current.

use std::sync::Mutex;

use serde::Serialize;
use tracing::{info, warn};
use turnstile_core::domain::unix_ms;

/// Longest error text kept (characters).
const ERROR_CHARS: usize = 500;

/// An error and its causes in one line, without a cause its error already says (lapin's I/O
/// errors repeat their source: "IO error: Connection refused: Connection refused").
pub fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Up, down, or not checked yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Not checked yet.
    #[default]
    Unknown,
    /// The last check succeeded.
    Up,
    /// The last check failed.
    Down,
}

/// A system's health as last checked (see [`Health`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Status {
    pub state: State,
    /// When it entered `state` (Unix ms, this replica's clock).
    pub since_ms: Option<u64>,
    /// The last check that succeeded (Unix ms).
    pub last_ok_ms: Option<u64>,
    /// The last error and when it happened (Unix ms), kept after the system is back.
    pub last_error: Option<String>,
    pub last_error_ms: Option<u64>,
    /// Failed checks since the replica started.
    pub failures: u64,
}

/// One system's health, updated by every check (see the module's doc).
#[derive(Debug)]
pub struct Health {
    /// The system's name in logs ("the broker", "Redis").
    what: &'static str,
    status: Mutex<Status>,
}

impl Health {
    /// A system not checked yet.
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            status: Mutex::new(Status::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().expect("never poisoned")
    }

    /// A check succeeded now.
    pub fn ok(&self) {
        self.ok_at(unix_ms());
    }

    /// A check succeeded at `now` (Unix ms).
    pub fn ok_at(&self, now: u64) {
        let mut status = self.lock();
        if status.state != State::Up {
            if status.state == State::Down {
                info!(target: "turnstile::ops", system = self.what, "the operator side reaches {} again", self.what);
            }
            status.state = State::Up;
            status.since_ms = Some(now);
        }
        status.last_ok_ms = Some(now);
    }

    /// A check failed now with `error`.
    pub fn failed(&self, error: &str) {
        self.failed_at(unix_ms(), error);
    }

    /// A check failed at `now` (Unix ms) with `error`.
    pub fn failed_at(&self, now: u64, error: &str) {
        let mut status = self.lock();
        if status.state != State::Down {
            warn!(target: "turnstile::ops", system = self.what, error, "the operator side cannot reach {}", self.what);
            status.state = State::Down;
            status.since_ms = Some(now);
        }
        status.last_error = Some(error.chars().take(ERROR_CHARS).collect());
        status.last_error_ms = Some(now);
        status.failures += 1;
    }

    /// Whether the last check failed.
    pub fn is_down(&self) -> bool {
        self.lock().state == State::Down
    }

    /// The status now.
    pub fn status(&self) -> Status {
        self.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_line_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let error = anyhow::Error::new(io)
            .context("IO error: Connection refused")
            .context("cannot connect to RabbitMQ at amqp://***@h/%2f");
        assert_eq!(
            one_line(&error),
            "cannot connect to RabbitMQ at amqp://***@h/%2f: IO error: Connection refused"
        );
    }

    #[test]
    fn a_failure_is_dated_from_its_first_check_and_kept_once_the_system_is_back() {
        let health = Health::new("Redis");
        assert_eq!(health.status().state, State::Unknown);
        health.ok_at(1_000);
        health.ok_at(2_000);
        let up = health.status();
        assert_eq!(
            (up.state, up.since_ms, up.last_ok_ms),
            (State::Up, Some(1_000), Some(2_000))
        );
        health.failed_at(3_000, "connection refused");
        health.failed_at(4_000, "connection reset");
        let down = health.status();
        assert_eq!(down.state, State::Down);
        assert_eq!(down.since_ms, Some(3_000), "down since the first failure");
        assert_eq!(down.last_error.as_deref(), Some("connection reset"));
        assert_eq!(down.last_error_ms, Some(4_000));
        assert_eq!(down.failures, 2);
        assert!(health.is_down());
        health.ok_at(5_000);
        let back = health.status();
        assert_eq!((back.state, back.since_ms), (State::Up, Some(5_000)));
        assert_eq!(back.last_error.as_deref(), Some("connection reset"), "kept");
        health.failed_at(6_000, &"x".repeat(2 * ERROR_CHARS));
        assert_eq!(health.status().last_error.unwrap().len(), ERROR_CHARS);
    }
}
