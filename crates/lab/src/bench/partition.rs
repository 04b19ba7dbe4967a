//! `turnstile bench scenario --preset partition`: one replica of two loses one of its links, to
//! the broker or to Redis, in the middle of three sellers' backlogs (60 + 40 + 20 messages at
//! 10/1s, 4 workers each). The link, a [`SlowLink`] in front of that replica only, resets
//! ([`SlowLink::cut`]) or hangs ([`SlowLink::hang`]: the sockets stay open, nothing comes back)
//! for [`BROKEN_FOR`] at least, then until every message registered, and heals. Per link and
//! mode, one line: how soon the replica cut off said it was not ready (its
//! TURNSTILE_LINK_TIMEOUT is [`LINK_TIMEOUT`], its AMQP heartbeat [`HEARTBEAT`]) and why, calls
//! made twice and over the limit, what the other replica registered meanwhile, and each seller's
//! drain beside the optimum its limit allows. [`one_replica_loses`] is the scenario
//! `tests/partitions.rs` asserts on.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::workload::ScenarioArgs;
use crate::rig::{Message, Report, Rig, RigBuilder};
use crate::slow_link::{self, SlowLink};
use turnstile_core::config::{LimiterArgs, Limits};
use turnstile_core::replica::ConsumeArgs;

/// The link one replica loses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Link {
    Broker,
    Redis,
}

/// How it breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Mode {
    /// Every connection reset, every new one closed at once ([`SlowLink::cut`]).
    Reset,
    /// Every connection silent, every new one held ([`SlowLink::hang`]).
    Hang,
}

/// Every link with every mode, in the order the preset runs them.
pub const CASES: [(Link, Mode); 4] = [
    (Link::Broker, Mode::Reset),
    (Link::Broker, Mode::Hang),
    (Link::Redis, Mode::Reset),
    (Link::Redis, Mode::Hang),
];

/// The sellers and their backlogs, published in this order.
pub const SELLERS: [(&str, usize); 3] = [("S-60", 60), ("S-40", 40), ("S-20", 20)];
/// The preset's limit, at the API and in the replicas.
pub const LIMIT: &str = "10/1s";
/// The preset's workers per replica.
pub const WORKERS: u32 = 4;
/// The cut replica's TURNSTILE_LINK_TIMEOUT.
pub const LINK_TIMEOUT: Duration = Duration::from_secs(2);
/// The cut replica's AMQP heartbeat when it loses the broker: two intervals outlast the link
/// timeout and a call, so the broker hands a hung replica's messages on only after its last call
/// ended; the broker notices a silent replica after two or three.
pub const HEARTBEAT: Duration = Duration::from_secs(7);
/// How long the link stays broken at least; then until every message registered (the other
/// replica served them all, the cut one's included: for a hung broker link, once the broker
/// noticed), or [`GUARD`].
pub const BROKEN_FOR: Duration = Duration::from_secs(20);
/// The longest the link stays broken, and the longest any other wait lasts (a guard against
/// hanging, not a speed check).
pub const GUARD: Duration = Duration::from_secs(180);

/// What one case measured.
#[derive(Debug, Serialize)]
pub struct Outcome {
    pub link: Link,
    pub mode: Mode,
    /// What the downstream saw and what the replicas did, the run over.
    pub report: Report,
    /// From the break to the cut replica first seen not ready, in s (`None`: never, while
    /// broken).
    pub not_ready_after_s: Option<f64>,
    /// Why it said it was not ready (`None`: no reason given).
    pub why: Option<String>,
    /// Whether it was still not ready when the link healed.
    pub not_ready_at_heal: bool,
    /// From the heal to the cut replica ready again, in s (`None`: never, within [`GUARD`]).
    pub ready_after_s: Option<f64>,
    /// Registrations of the other replica from the cut one's not ready to the heal.
    pub other_while_not_ready: u64,
    /// Whether every message registered before the link healed.
    pub drained_while_broken: bool,
    /// When the link broke and healed, in s after publishing (the clock of the report's
    /// sellers).
    pub broke_s: f64,
    pub healed_s: f64,
    /// Whether the rig's queues (dead letters aside) held nothing ready at the end (`false`:
    /// not within [`GUARD`]).
    pub queues_empty: bool,
    /// Per seller: its drain (first registration to last) and the optimum its limit allows, in
    /// s.
    pub drains: Vec<Drain>,
}

/// One seller's drain beside its optimum.
#[derive(Debug, Serialize)]
pub struct Drain {
    pub seller: String,
    pub messages: usize,
    pub drain_s: Option<f64>,
    pub optimum_s: f64,
}

impl Outcome {
    /// The case's figures on one line (for docs/faults.md).
    pub fn line(&self) -> String {
        let report = &self.report;
        let seconds = |s: Option<f64>| s.map_or("never".into(), |s| format!("{s:.1} s"));
        let drains: Vec<String> = self
            .drains
            .iter()
            .map(|d| {
                format!(
                    "{} ({}) {} (optimum {:.1} s)",
                    d.seller,
                    d.messages,
                    seconds(d.drain_s),
                    d.optimum_s
                )
            })
            .collect();
        format!(
            "{:?} link, {:?} (broken {:.1} s to {:.1} s after publishing): not ready {} after the \
             break ({}), {} when it healed, ready {} after; duplicates {}, violations {}, \
             registered {}/{} ({} before the heal), dead-lettered {}, queues empty at the end: \
             {}; the other replica registered {} while the cut one was not ready; drains: {}",
            self.link,
            self.mode,
            self.broke_s,
            self.healed_s,
            seconds(self.not_ready_after_s),
            self.why.as_deref().unwrap_or("no reason given"),
            if self.not_ready_at_heal {
                "still not ready"
            } else {
                "ready"
            },
            seconds(self.ready_after_s),
            report.duplicates,
            report.violations,
            report.registered,
            report.published,
            if self.drained_while_broken {
                "all"
            } else {
                "not all"
            },
            report.dead_lettered,
            self.queues_empty,
            self.other_while_not_ready,
            drains.join(", "),
        )
    }

    /// No call twice, none over the limit, nothing lost or dead-lettered.
    pub fn clean(&self) -> bool {
        let r = &self.report;
        r.duplicates == 0
            && r.violations == 0
            && r.lost == 0
            && r.dead_lettered == 0
            && r.registered == r.published
    }
}

/// Runs the preset: every case of [`CASES`] in turn, one rig each; `Ok(false)` when a call was
/// made twice or over the limit, or a message lost.
pub async fn run(args: &ScenarioArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        !args.rig.redis.cluster,
        "--preset partition puts a link in front of one Redis: not with a Redis Cluster"
    );
    let limit = args
        .limit
        .clone()
        .unwrap_or_else(|| LIMIT.parse().expect("the preset's limit parses"));
    let workers = args.workers.unwrap_or(WORKERS);
    let hold = args.hold.unwrap_or(Duration::from_secs(2));
    eprintln!(
        "partition: 2 replicas x {workers} workers at {limit}, sellers {SELLERS:?}; one replica's \
         link (TURNSTILE_LINK_TIMEOUT {LINK_TIMEOUT:?}, AMQP heartbeat {HEARTBEAT:?}) broken \
         {BROKEN_FOR:?} at least, then until everything registered"
    );
    let mut outcomes = Vec::new();
    for (link, mode) in CASES {
        let limiter = LimiterArgs::new(limit.clone(), args.algorithm);
        let settings = args
            .rig
            .replica_settings("partition", limiter, workers, hold);
        let outcome = one_replica_loses(Rig::build(settings), workers, link, mode).await?;
        println!("{}", outcome.line());
        outcomes.push(outcome);
    }
    if args.json {
        println!("{}", serde_json::to_string(&outcomes)?);
    }
    Ok(outcomes.iter().all(Outcome::clean))
}

/// The settings of a replica of `workers` workers on `rig` whose `link` (to the broker or to
/// Redis) goes through a [`SlowLink`] of its own, with [`LINK_TIMEOUT`] (and [`HEARTBEAT`] for
/// the broker), and that link, to break.
pub async fn behind_a_link(
    rig: &Rig,
    workers: u32,
    link: Link,
) -> anyhow::Result<(ConsumeArgs, SlowLink)> {
    let mut settings = rig.settings(workers);
    settings.links.link_timeout = LINK_TIMEOUT;
    let proxy = match link {
        Link::Broker => {
            let node = settings
                .broker
                .amqp
                .url
                .split(',')
                .next()
                .unwrap_or_default()
                .to_owned();
            let proxy =
                SlowLink::start(slow_link::address_of(&node).await?, Duration::ZERO).await?;
            settings.broker.amqp.url = proxy.amqp_url(&node);
            settings.links.broker_heartbeat = Some(HEARTBEAT);
            proxy
        }
        Link::Redis => {
            let redis = slow_link::address_of(rig.redis_url()).await?;
            let proxy = SlowLink::start(redis, Duration::ZERO).await?;
            settings.redis.url = proxy.redis_url();
            proxy
        }
    };
    Ok((settings, proxy))
}

/// Two replicas of `workers` workers on the rig `builder` makes, the first through a
/// [`SlowLink`] to `link` (with [`LINK_TIMEOUT`], and [`HEARTBEAT`] for the broker); the
/// backlogs of [`SELLERS`] published; once both replicas registered a few, the link breaks as
/// `mode` says, for [`BROKEN_FOR`] at least and until every message registered (or
/// [`GUARD`]), then heals; waits until every message registered, then for the queues to empty,
/// and finishes the rig (its queues and keys deleted). Fails only when the rig does; what
/// happened is in the outcome.
pub async fn one_replica_loses(
    builder: RigBuilder,
    workers: u32,
    link: Link,
    mode: Mode,
) -> anyhow::Result<Outcome> {
    let mut rig = builder.prepare().await?;
    let (settings, proxy) = behind_a_link(&rig, workers, link).await?;
    let cut = rig.start_replica(settings).await?;
    let (ready, cut_stats) = (cut.ready.clone(), cut.stats.clone());
    let other = rig.start_replica(rig.settings(workers)).await?;
    let other_stats = other.stats.clone();
    let published_ms = rig.mock.stats().now_ms;
    let messages = SELLERS
        .iter()
        .flat_map(|&(seller, n)| (0..n).map(move |i| Message::numbered(seller, i)))
        .collect();
    rig.publish_all(messages).await?;
    let registering = waited(async || {
        cut_stats.registered.load(Ordering::Relaxed) >= 3
            && other_stats.registered.load(Ordering::Relaxed) >= 3
    })
    .await;
    anyhow::ensure!(
        registering.is_some(),
        "the two replicas never both registered"
    );

    let since_published =
        |rig: &Rig| rig.mock.stats().now_ms.saturating_sub(published_ms) as f64 / 1000.0;
    let broke_s = since_published(&rig);
    let broke = Instant::now();
    match mode {
        Mode::Reset => proxy.cut(),
        Mode::Hang => proxy.hang(),
    }
    let (mut not_ready_after, mut why, mut other_at_not_ready) = (None, None, 0);
    let mut drained_while_broken = false;
    while broke.elapsed() < BROKEN_FOR || !(drained_while_broken || broke.elapsed() > GUARD) {
        drained_while_broken = rig.mock.stats().registered >= rig.published();
        if not_ready_after.is_none() && !ready.get() {
            not_ready_after = Some(broke.elapsed());
            other_at_not_ready = other_stats.registered.load(Ordering::Relaxed);
        }
        if why.is_none() {
            why = ready.why().map(|n| n.why);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let not_ready_at_heal = !ready.get();
    let other_while_not_ready = match not_ready_after {
        Some(_) => other_stats.registered.load(Ordering::Relaxed) - other_at_not_ready,
        None => 0,
    };
    let healed_s = since_published(&rig);
    proxy.restore();
    let ready_after = waited(async || ready.get()).await;

    rig.wait(GUARD, |_| {}).await?;
    let queues_empty = rig.wait_queues_empty(GUARD).await;
    let limit: Limits = rig.limit.clone();
    let report = rig.finish().await?;
    drop(proxy);
    let drains = SELLERS
        .iter()
        .map(|&(seller, messages)| Drain {
            seller: seller.to_owned(),
            messages,
            drain_s: report.sellers.get(seller).and_then(|s| s.drain_s),
            optimum_s: limit.optimum_drain(messages as u64).as_secs_f64(),
        })
        .collect();
    Ok(Outcome {
        link,
        mode,
        report,
        not_ready_after_s: not_ready_after.map(|d| d.as_secs_f64()),
        why,
        not_ready_at_heal,
        ready_after_s: ready_after.map(|d| d.as_secs_f64()),
        other_while_not_ready,
        drained_while_broken,
        broke_s,
        healed_s,
        queues_empty,
        drains,
    })
}

/// How long `done` took to hold, polled every 20 ms, or `None` after [`GUARD`].
async fn waited(mut done: impl AsyncFnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while !done().await {
        if started.elapsed() > GUARD {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(started.elapsed())
}
