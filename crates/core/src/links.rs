//! The replica's two links, to the broker and to Redis, and how a partition or a hang of one
//! of them is told apart from a slow answer.
//!
//! A link that resets is seen at once (the connection fails). A link that hangs (the sockets
//! stay open, nothing comes back: a partition, a stuck proxy or load balancer) is seen only by
//! asking: the replica probes the broker and pings Redis every [`PROBE_EVERY`]; a link that has
//! not answered for [`LinkArgs::link_timeout`] is **cut off**. Then:
//! - broker cut off: the replica stops starting calls, ends its broker session and reconnects
//!   (not ready meanwhile); what it held goes back to the other replicas once the broker notices
//!   the connection gone (a reset at once, a hang after two missed heartbeats, see
//!   [`LinkArgs::heartbeat`]);
//! - Redis cut off: the replica can grant nothing, so it hands its work back: it ends its broker
//!   session (every held and delayed message returns to its queue at once, for the healthy
//!   replicas), reports not ready, and consumes again only once Redis answers.
//!
//! The heartbeat is chosen so that the broker hands a hung replica's messages to another one
//! only after that replica stopped starting calls and every call it had started has ended
//! (`2 x heartbeat >= link timeout + downstream timeout + 2 probes`): its completion records are then in
//! Redis, and a redelivered copy is acked as registered, never called again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::duration_arg;

/// How often the replica probes the broker (a round trip on a channel of its own).
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How a replica tells a cut-off link from a slow one (`turnstile consume`).
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Links")]
pub struct LinkArgs {
    /// A link to the broker or to Redis that has not answered for this long is cut off: the
    /// replica stops starting calls, hands its held and delayed messages back to the other
    /// replicas, reports not ready, and consumes again once the link answers.
    #[arg(long = "link-timeout", env = "TURNSTILE_LINK_TIMEOUT", default_value = "5s", value_parser = duration_arg)]
    pub link_timeout: Duration,
    /// The AMQP heartbeat asked of the broker (whole seconds, 1 to 600) [default: the link
    /// timeout plus the downstream timeout, halved, plus 2s: 10s with the defaults]. The broker
    /// redelivers a silent replica's messages after two to three heartbeats.
    #[arg(long = "broker-heartbeat", env = "TURNSTILE_BROKER_HEARTBEAT", value_parser = duration_arg)]
    pub broker_heartbeat: Option<Duration>,
}

impl Default for LinkArgs {
    fn default() -> Self {
        Self {
            link_timeout: Duration::from_secs(5),
            broker_heartbeat: None,
        }
    }
}

impl LinkArgs {
    /// The heartbeat asked of the broker, in whole seconds: the one set, else one whose two
    /// intervals outlast the link timeout and a call (see the module).
    pub fn heartbeat(&self, downstream_timeout: Duration) -> u16 {
        let derived = || (self.link_timeout + downstream_timeout) / 2 + Duration::from_secs(2);
        let heartbeat = self.broker_heartbeat.unwrap_or_else(derived);
        heartbeat.as_secs_f64().ceil().clamp(1.0, 600.0) as u16
    }

    /// A warning when `heartbeat` (seconds, as asked or as the broker negotiated it; 0 = off)
    /// lets the broker redeliver a hung replica's messages while that replica may still be
    /// calling: two heartbeats must outlast the link timeout, a probe's period on each side of
    /// it, and a call (see the module).
    pub fn heartbeat_warning(
        &self,
        heartbeat: u16,
        downstream_timeout: Duration,
    ) -> Option<String> {
        let needed = self.link_timeout + downstream_timeout + PROBE_EVERY * 2;
        let at_least = needed.as_secs_f64() / 2.0;
        if heartbeat == 0 {
            return Some(format!(
                "the broker connection has no heartbeat: a hung link is never dropped by the broker, and its messages stay with this replica until the connection fails; ask for one of at least {}s (TURNSTILE_BROKER_HEARTBEAT, and the broker's heartbeat setting)",
                at_least.ceil()
            ));
        }
        (f64::from(heartbeat) < at_least).then(|| {
            format!(
                "AMQP heartbeat {heartbeat}s: the broker may redeliver a hung replica's messages after {}s, before that replica has seen the hang and its last call has ended ({}s: TURNSTILE_LINK_TIMEOUT + TURNSTILE_DOWNSTREAM_TIMEOUT + 2 probes): a call may then be made twice; use at least {}s (TURNSTILE_BROKER_HEARTBEAT, and the broker's heartbeat setting, whichever is lower applies)",
                u32::from(heartbeat) * 2,
                needed.as_secs(),
                at_least.ceil()
            )
        })
    }
}

/// The replica's links as its parts see them: when Redis last answered, and whether it is cut
/// off now (the broker's probe decides alone, see `replica`). The replica's watcher writes it;
/// its workers read it (a registration whose
/// record cannot be written while Redis is cut off is settled another way, see
/// `worker::Worker::call`). Cheap to clone.
#[derive(Clone, Debug)]
pub struct Links {
    timeout: Duration,
    redis: LastAnswer,
    /// True while Redis is cut off.
    redis_cut: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Default for Links {
    fn default() -> Self {
        Self::new(LinkArgs::default().link_timeout)
    }
}

impl Links {
    /// Links cut off after `timeout` of silence, Redis taken as answering now.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            redis: LastAnswer::default(),
            redis_cut: Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    /// How long a link may stay silent before it is cut off.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Redis answered now.
    pub fn redis_answered(&self) {
        self.redis.answered();
    }

    /// How long since Redis last answered.
    pub fn redis_silent_for(&self) -> Duration {
        self.redis.silent_for()
    }

    /// Looks at Redis's link now: cut off once silent for the timeout, back once it answered
    /// since. `Some(cut)` when that changed.
    pub fn check_redis(&self) -> Option<bool> {
        let cut = self.redis.silent_for() > self.timeout;
        self.redis_cut
            .send_if_modified(|was| {
                let changed = *was != cut;
                *was = cut;
                changed
            })
            .then_some(cut)
    }

    /// Whether Redis is cut off now.
    pub fn redis_cut(&self) -> bool {
        *self.redis_cut.borrow()
    }

    /// Resolves once Redis is cut off (at once if it is).
    pub async fn redis_cut_off(&self) {
        let mut watching = self.redis_cut.subscribe();
        let _ = watching.wait_for(|cut| *cut).await;
    }

    /// Resolves once Redis is not cut off (at once if it is not).
    pub async fn redis_back(&self) {
        let mut watching = self.redis_cut.subscribe();
        let _ = watching.wait_for(|cut| !*cut).await;
    }
}

/// When a link last answered, shared by whoever watches it: a cheap clock of the last success.
#[derive(Clone, Debug)]
pub struct LastAnswer {
    /// Since `origin`, in ms.
    last_ms: Arc<AtomicU64>,
    origin: Instant,
}

impl Default for LastAnswer {
    fn default() -> Self {
        Self {
            last_ms: Arc::new(AtomicU64::new(0)),
            origin: Instant::now(),
        }
    }
}

impl LastAnswer {
    /// The link answered now.
    pub fn answered(&self) {
        let ms = self.origin.elapsed().as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long since it last answered (since its creation if it never did).
    pub fn silent_for(&self) -> Duration {
        let since = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.origin.elapsed().saturating_sub(since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_heartbeat_outlasts_the_link_timeout_and_a_call_in_two_intervals() {
        let links = LinkArgs::default();
        let heartbeat = links.heartbeat(Duration::from_secs(10));
        assert_eq!(heartbeat, 10);
        assert!(
            links
                .heartbeat_warning(heartbeat, Duration::from_secs(10))
                .is_none()
        );
    }

    #[test]
    fn a_heartbeat_too_short_for_a_call_is_warned_about() {
        let links = LinkArgs {
            broker_heartbeat: Some(Duration::from_secs(3)),
            ..LinkArgs::default()
        };
        let heartbeat = links.heartbeat(Duration::from_secs(10));
        assert_eq!(heartbeat, 3);
        let warning = links
            .heartbeat_warning(heartbeat, Duration::from_secs(10))
            .unwrap();
        assert!(warning.contains("use at least 9s"), "{warning}");
        let off = links.heartbeat_warning(0, Duration::from_secs(10)).unwrap();
        assert!(off.contains("no heartbeat"), "{off}");
    }

    #[tokio::test(start_paused = true)]
    async fn redis_is_cut_off_after_the_timeout_of_silence_and_back_at_its_next_answer() {
        let links = Links::new(Duration::from_secs(5));
        assert_eq!(links.check_redis(), None);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(links.check_redis(), None, "silent, not yet cut off");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(links.check_redis(), Some(true));
        assert_eq!(links.check_redis(), None, "a change is said once");
        assert!(links.redis_cut());
        links.redis_cut_off().await;
        links.redis_answered();
        assert_eq!(links.check_redis(), Some(false));
        links.redis_back().await;
        assert!(!links.redis_cut());
    }

    #[tokio::test(start_paused = true)]
    async fn a_link_is_silent_from_its_last_answer() {
        let last = LastAnswer::default();
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(last.silent_for(), Duration::from_secs(3));
        last.answered();
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(last.silent_for(), Duration::from_millis(1500));
    }
}
