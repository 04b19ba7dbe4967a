//! `turnstile bench rolling`: what a rolling deploy that changes TURNSTILE_LIMIT does to the
//! limit. Two replicas run as child processes (`<binary> consume`, as a deployment runs them),
//! on one seller's backlog published before the first starts:
//!
//! 1. replica A starts with the old limit and drains the backlog;
//! 2. `--start-b-after` (3 s) after A's first call reached the downstream, replica B starts with
//!    the new limit; the moment B's `/readyz` first answers 200 is R, and `--more-at-ready`
//!    (100) more messages are published then: fresh work either replica may take (A holds or
//!    has reserved most of the backlog by then);
//! 3. `--overlap` (4 s) after R, A gets SIGTERM and drains; it is gone when its process exits;
//! 4. the round ends when every message is registered (or after `--timeout`).
//!
//! Scenario `lower` deploys a lower limit (A `--high-limit`, B `--low-limit`), `raise` a higher
//! one (A `--low-limit`, B `--high-limit`). The downstream is the bench's own recorder, which
//! answers every call 200 at once and refuses nothing: it only notes when each call arrived and
//! its Idempotency-Key. From those arrival times, a limit's windows are counted over the calls
//! of a span only: a call of the span is **over** when the trailing window ending at it holds
//! more than COUNT calls of the span, and **worst** is the most calls of the span any trailing
//! window holds. Figures per round:
//!
//! - `lower`: the new limit from R, and from A gone (after the overlap: B alone);
//! - `raise`: the new limit from R (must be 0), and the old limit from R until A is gone (0
//!   with a fleet that follows the strictest terms of its live replicas);
//! - both: messages lost (published, never registered), duplicate calls, dead letters, the
//!   drain rate after A is gone (registrations after it / time to the last one) and the longest
//!   time without a registration from R.
//!
//! `--old-binary` and `--new-binary` run A and B from other builds (say, one built from an
//! earlier commit); the bench only needs `consume`, its TURNSTILE_* variables, `/readyz` and
//! SIGTERM from them. Each round has a queue and key prefix of its own (the rig's), deleted at
//! its end. The rig's strict mock is not called: the replicas call the recorder.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use clap::{Args, ValueEnum};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::rig::{Message, Rig, RigArgs};
use turnstile_core::config::{Algorithm, Limit, LimiterArgs, duration_arg, limit_arg};

/// Flags of `turnstile bench rolling`.
#[derive(Args, Debug, Clone)]
pub struct RollingArgs {
    /// The executable replica A runs (the terms before the deploy) [default: this one].
    #[arg(long = "old-binary", value_name = "PATH")]
    pub old_binary: Option<PathBuf>,
    /// The executable replica B runs (the terms after the deploy) [default: this one].
    #[arg(long = "new-binary", value_name = "PATH")]
    pub new_binary: Option<PathBuf>,
    /// Rounds of each scenario: each is printed, then the median of every column.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Scenarios to run (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "lower,raise")]
    pub scenarios: Vec<Scenario>,
    /// Messages of the seller's backlog, published before A starts.
    #[arg(long, default_value_t = 400)]
    pub messages: usize,
    /// The lower limit: B's in `lower`, A's in `raise`.
    #[arg(long = "low-limit", default_value = "10/1s", value_parser = limit_arg)]
    pub low_limit: Limit,
    /// The higher limit: A's in `lower`, B's in `raise`.
    #[arg(long = "high-limit", default_value = "20/1s", value_parser = limit_arg)]
    pub high_limit: Limit,
    /// Messages published at R, after the backlog: fresh work that either replica may take
    /// (the backlog itself is mostly held or reserved by A by then).
    #[arg(long = "more-at-ready", default_value_t = 100)]
    pub more_at_ready: usize,
    /// Workers of each replica.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// B starts this long after A's first call reached the downstream.
    #[arg(long = "start-b-after", default_value = "3s", value_parser = duration_arg)]
    pub start_b_after: Duration,
    /// A gets SIGTERM this long after B is ready (R).
    #[arg(long, default_value = "4s", value_parser = duration_arg)]
    pub overlap: Duration,
    /// A round ends when every message is registered, or this long after A's first call.
    #[arg(long, default_value = "3m", value_parser = duration_arg)]
    pub timeout: Duration,
    #[command(flatten)]
    pub rig: RigArgs,
}

/// A rolling deploy's change of limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// A at the high limit, B at the low one.
    Lower,
    /// A at the low limit, B at the high one.
    Raise,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Lower => "lower",
            Scenario::Raise => "raise",
        }
    }

    /// A's limit and B's.
    fn limits(self, args: &RollingArgs) -> (Limit, Limit) {
        match self {
            Scenario::Lower => (args.high_limit, args.low_limit),
            Scenario::Raise => (args.low_limit, args.high_limit),
        }
    }
}

/// The only seller of the backlog.
const SELLER: &str = "rolling";
/// Longest a replica may take to answer `/readyz` with 200 after it is started.
const READY_WITHIN: Duration = Duration::from_secs(30);
/// Longest A may take to exit after SIGTERM (its shutdown grace is 8 s by default).
const EXIT_WITHIN: Duration = Duration::from_secs(30);

/// Runs every round of each scenario and prints them; `Ok(false)` when a message was lost or
/// called twice, or a window held more than a limit in force (see the module docs).
pub async fn run(args: RollingArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.messages > 0, "--messages must be at least 1");
    anyhow::ensure!(args.repeat > 0, "--repeat must be at least 1");
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    let this = std::env::current_exe().context("finding this executable")?;
    let old = args.old_binary.clone().unwrap_or_else(|| this.clone());
    let new = args.new_binary.clone().unwrap_or(this);
    println!(
        "rolling: {} messages of one seller, {} more when B is ready; B starts {} s after A's first call, A gets SIGTERM {} s after B is ready; {} workers each",
        args.messages,
        args.more_at_ready,
        args.start_b_after.as_secs_f64(),
        args.overlap.as_secs_f64(),
        args.workers
    );
    println!("A runs {} ({})", old.display(), version(&old).await?);
    println!("B runs {} ({})", new.display(), version(&new).await?);
    let mut ok = true;
    for &scenario in &args.scenarios {
        let (a_limit, b_limit) = scenario.limits(&args);
        println!();
        println!("{}: A at {a_limit}, then B at {b_limit}", scenario.name());
        let columns = columns(scenario, a_limit, b_limit);
        print_header(&columns);
        let mut rounds = Vec::new();
        for n in 1..=args.repeat {
            eprintln!("{} round {n} of {}", scenario.name(), args.repeat);
            let round = round(&args, scenario, &old, &new).await?;
            print_row(&n.to_string(), &columns, |c| (c.value)(&round));
            ok &= round.clean(scenario);
            rounds.push(round);
        }
        if rounds.len() > 1 {
            print_row("median", &columns, |c| {
                median(rounds.iter().map(|r| (c.value)(r)).collect())
            });
        }
        print_legend(scenario, a_limit, b_limit);
    }
    Ok(ok)
}

/// `<binary> --version`, trimmed.
async fn version(binary: &Path) -> anyhow::Result<String> {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .await
        .with_context(|| format!("running {} --version", binary.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} --version failed: {}",
        binary.display(),
        out.status
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Calls of a span over a limit (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Over {
    /// Calls of the span whose trailing window holds more than COUNT calls of the span.
    calls: usize,
    /// The most calls of the span in any trailing window.
    worst: usize,
}

/// What one round measured; every moment is the time since A's first call.
#[derive(Debug)]
struct Round {
    /// B's `/readyz` first answered 200.
    ready: Duration,
    /// A was sent SIGTERM.
    term: Duration,
    /// A's process exited.
    gone: Duration,
    /// The last first-time registration.
    done: Duration,
    published: u64,
    registered: u64,
    duplicates: u64,
    dead: u64,
    /// B's limit, over the calls from R on.
    new_from_ready: Over,
    /// B's limit, over the calls from A gone on.
    new_from_gone: Over,
    /// A's limit, over the calls from R until A was gone.
    old_until_gone: Over,
    /// First-time registrations after A was gone, per second until the last one.
    drain_after_gone: Option<f64>,
    /// The longest time without a registration from R until the last one.
    longest_gap: Duration,
}

impl Round {
    fn lost(&self) -> u64 {
        self.published.saturating_sub(self.registered)
    }

    /// Nothing lost, nothing called twice, no window over a limit in force.
    fn clean(&self, scenario: Scenario) -> bool {
        let old_in_force = match scenario {
            Scenario::Lower => true,
            Scenario::Raise => self.old_until_gone.calls == 0,
        };
        self.lost() == 0 && self.duplicates == 0 && self.new_from_ready.calls == 0 && old_in_force
    }
}

/// Runs one round of `scenario` on a queue and key prefix of its own, and deletes them.
async fn round(
    args: &RollingArgs,
    scenario: Scenario,
    old: &Path,
    new: &Path,
) -> anyhow::Result<Round> {
    let (a_limit, b_limit) = scenario.limits(args);
    let recorder = Recorder::start().await?;
    let settings = args.rig.replica_settings(
        "rolling",
        LimiterArgs::new(a_limit, Algorithm::SlidingWindow),
        args.workers,
        Duration::from_secs(2),
    );
    let mut rig = Rig::build(settings).prepare().await?;
    let messages = (0..args.messages)
        .map(|i| Message::numbered(SELLER, i))
        .collect();
    rig.publish_all(messages).await?;
    let measured = deploy(args, &mut rig, &recorder, (old, a_limit), (new, b_limit)).await;
    let published = rig.published();
    let dead = rig.dead_lettered().await;
    rig.cleanup().await?;
    let moments = measured?;
    let dead = dead?;
    let calls = recorder.calls();
    Ok(figures(&calls, moments, published, dead, a_limit, b_limit))
}

/// When things happened in a round, as `Instant`s.
struct Moments {
    first_call: Instant,
    ready: Instant,
    term: Instant,
    gone: Instant,
}

/// Starts A, then B, stops A, waits for the backlog to drain and stops B.
async fn deploy(
    args: &RollingArgs,
    rig: &mut Rig,
    recorder: &Recorder,
    (old, a_limit): (&Path, Limit),
    (new, b_limit): (&Path, Limit),
) -> anyhow::Result<Moments> {
    let mut a = Replica::spawn("A", old, a_limit, args, rig, &recorder.url)?;
    a.ready().await?;
    let first_call = loop {
        if let Some(at) = recorder.first_call() {
            break at;
        }
        a.still_running()?;
        anyhow::ensure!(
            a.started.elapsed() < READY_WITHIN,
            "replica A made no call within {} s",
            READY_WITHIN.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let since = |at: Instant| at.saturating_duration_since(first_call).as_secs_f64();
    eprintln!("  A ready; its first call is t=0");
    tokio::time::sleep_until((first_call + args.start_b_after).into()).await;
    let mut b = Replica::spawn("B", new, b_limit, args, rig, &recorder.url)?;
    let ready = b.ready().await?;
    let more = (args.messages..args.messages + args.more_at_ready)
        .map(|i| Message::numbered(SELLER, i))
        .collect();
    rig.publish_all(more).await?;
    let published = rig.published();
    eprintln!(
        "  t={:.2}s B started, t={:.2}s B ready (R); {} registered, {} still in the work queue",
        since(b.started),
        since(ready),
        recorder.registered(),
        rig.depth(rig.topology.work()).await?
    );
    tokio::time::sleep_until((ready + args.overlap).into()).await;
    let term = a.terminate()?;
    let gone = a.exited().await?;
    eprintln!(
        "  t={:.2}s A sent SIGTERM, t={:.2}s A gone; {} of {published} registered",
        since(term),
        since(gone),
        recorder.registered()
    );
    let deadline = first_call + args.timeout;
    while recorder.registered() < published && Instant::now() < deadline {
        b.still_running()?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "  t={:.2}s {} of {published} registered; B sent SIGTERM",
        since(Instant::now()),
        recorder.registered()
    );
    b.terminate()?;
    b.exited().await?;
    Ok(Moments {
        first_call,
        ready,
        term,
        gone,
    })
}

/// A round's figures from the recorder's calls.
fn figures(
    calls: &[Call],
    moments: Moments,
    published: u64,
    dead: u64,
    a_limit: Limit,
    b_limit: Limit,
) -> Round {
    let since = |at: Instant| at.saturating_duration_since(moments.first_call);
    let mut times: Vec<Duration> = calls.iter().map(|c| since(c.at)).collect();
    times.sort();
    let (ready, term, gone) = (
        since(moments.ready),
        since(moments.term),
        since(moments.gone),
    );
    let firsts: Vec<Duration> = calls
        .iter()
        .filter(|c| c.first)
        .map(|c| since(c.at))
        .collect();
    let registered = firsts.len() as u64;
    let done = firsts.iter().copied().max().unwrap_or_default();
    Round {
        ready,
        term,
        gone,
        done,
        published,
        registered,
        duplicates: calls.len() as u64 - registered,
        dead,
        new_from_ready: over_limit(&times, ready, None, b_limit),
        new_from_gone: over_limit(&times, gone, None, b_limit),
        old_until_gone: over_limit(&times, ready, Some(gone), a_limit),
        drain_after_gone: drain_rate(&firsts, gone),
        longest_gap: longest_gap(&firsts, ready),
    }
}

/// The calls among `times` (in ascending order) in `from..=until` over `limit`, counting only those calls
/// (see [`Over`]): a trailing window ending at a call holds the calls of the span in
/// `(t - window, t]`.
fn over_limit(times: &[Duration], from: Duration, until: Option<Duration>, limit: Limit) -> Over {
    let span: Vec<Duration> = times
        .iter()
        .copied()
        .filter(|&t| t >= from && until.is_none_or(|u| t <= u))
        .collect();
    let window = limit.window();
    let mut over = Over::default();
    let mut oldest = 0;
    for (i, &t) in span.iter().enumerate() {
        while t - span[oldest] >= window {
            oldest += 1;
        }
        let end = i + span[i..].partition_point(|&x| x <= t);
        let held = end - oldest;
        over.worst = over.worst.max(held);
        if held > limit.count() as usize {
            over.calls += 1;
        }
    }
    over
}

/// Registrations after `from` per second until the last of them; `None` without any.
fn drain_rate(registrations: &[Duration], from: Duration) -> Option<f64> {
    let after: Vec<Duration> = registrations
        .iter()
        .copied()
        .filter(|&t| t > from)
        .collect();
    let last = after.iter().copied().max()?;
    let span = (last - from).as_secs_f64();
    (span > 0.0).then(|| after.len() as f64 / span)
}

/// The longest time from `from` without a registration, until the last one.
fn longest_gap(registrations: &[Duration], from: Duration) -> Duration {
    let mut after: Vec<Duration> = registrations
        .iter()
        .copied()
        .filter(|&t| t >= from)
        .collect();
    after.sort();
    std::iter::once(from)
        .chain(after.iter().copied())
        .zip(after.iter().copied())
        .map(|(a, b)| b - a)
        .max()
        .unwrap_or_default()
}

/// One printed column: its header, its value in a round, its decimals.
struct Column {
    header: String,
    value: fn(&Round) -> f64,
    decimals: usize,
}

fn column(header: impl Into<String>, decimals: usize, value: fn(&Round) -> f64) -> Column {
    Column {
        header: header.into(),
        value,
        decimals,
    }
}

/// The columns of a scenario's table.
fn columns(scenario: Scenario, a_limit: Limit, b_limit: Limit) -> Vec<Column> {
    let mut columns = vec![
        column("R s", 2, |r| r.ready.as_secs_f64()),
        column("TERM s", 2, |r| r.term.as_secs_f64()),
        column("gone s", 2, |r| r.gone.as_secs_f64()),
        column("done s", 2, |r| r.done.as_secs_f64()),
        column(format!(">{b_limit} from R"), 0, |r| {
            r.new_from_ready.calls as f64
        }),
        column("worst", 0, |r| r.new_from_ready.worst as f64),
    ];
    match scenario {
        Scenario::Lower => {
            columns.push(column(format!(">{b_limit} from gone"), 0, |r| {
                r.new_from_gone.calls as f64
            }));
            columns.push(column("worst", 0, |r| r.new_from_gone.worst as f64));
        }
        Scenario::Raise => {
            columns.push(column(format!(">{a_limit} R..gone"), 0, |r| {
                r.old_until_gone.calls as f64
            }));
            columns.push(column("worst", 0, |r| r.old_until_gone.worst as f64));
        }
    }
    columns.extend([
        column("lost", 0, |r| r.lost() as f64),
        column("dup", 0, |r| r.duplicates as f64),
        column("dead", 0, |r| r.dead as f64),
        column("drain/s after gone", 1, |r| {
            r.drain_after_gone.unwrap_or(f64::NAN)
        }),
        column("gap s", 2, |r| r.longest_gap.as_secs_f64()),
    ]);
    columns
}

fn print_header(columns: &[Column]) {
    let mut line = format!("{:<7}", "round");
    for c in columns {
        line.push_str(&format!(" {:>w$}", c.header, w = width(c)));
    }
    println!("{line}");
}

fn print_row(label: &str, columns: &[Column], value: impl Fn(&Column) -> f64) {
    let mut line = format!("{label:<7}");
    for c in columns {
        let v = value(c);
        let cell = if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.*}", c.decimals)
        };
        line.push_str(&format!(" {cell:>w$}", w = width(c)));
    }
    println!("{line}");
}

fn width(c: &Column) -> usize {
    c.header.len().max(6)
}

fn print_legend(scenario: Scenario, a_limit: Limit, b_limit: Limit) {
    println!(
        "  seconds after A's first call: R = B's /readyz answered 200, TERM = SIGTERM to A, gone = A exited, done = last registration; gap = the longest time without a registration from R"
    );
    println!(
        "  >L from X: calls at or after X whose trailing window of L holds more than L's count of calls at or after X; worst: the most such calls in one window"
    );
    match scenario {
        Scenario::Lower => println!(
            "  the new limit {b_limit} from R, and from A gone (B alone); lost = published, never registered; dup = calls of a key already called"
        ),
        Scenario::Raise => println!(
            "  the new limit {b_limit} from R (0 expected), and the old limit {a_limit} from R until A gone (0 when the fleet follows its strictest live terms)"
        ),
    }
}

/// The median of `values` (NaN ones left out; NaN if none is left).
fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| !v.is_nan());
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// A replica as a child process: `<binary> consume`, told only the round's settings (no other
/// TURNSTILE_* variable of the bench's environment), serving `/readyz` on a port of its own.
struct Replica {
    name: &'static str,
    child: Child,
    readyz: String,
    started: Instant,
}

impl Replica {
    fn spawn(
        name: &'static str,
        binary: &Path,
        limit: Limit,
        args: &RollingArgs,
        rig: &Rig,
        downstream: &str,
    ) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("finding a free port")?
            .port();
        let queue_type = args
            .rig
            .queue_type
            .to_possible_value()
            .context("the queue type's name")?;
        let mut command = Command::new(binary);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("TURNSTILE_") {
                command.env_remove(key);
            }
        }
        command
            .arg("consume")
            .env("TURNSTILE_AMQP_URL", &args.rig.amqp.url)
            .env("TURNSTILE_QUEUE", rig.topology.work())
            .env("TURNSTILE_QUEUE_TYPE", queue_type.get_name())
            .env("TURNSTILE_DELAY_QUEUE_TYPE", queue_type.get_name())
            .env("TURNSTILE_REDIS_URL", rig.redis_url())
            .env("TURNSTILE_KEY_PREFIX", &rig.key_prefix)
            .env("TURNSTILE_DOWNSTREAM_URL", downstream)
            .env("TURNSTILE_LIMIT", limit.to_string())
            .env("TURNSTILE_WORKERS", args.workers.to_string())
            .env("TURNSTILE_HTTP_ADDR", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "error");
        if args.rig.redis.cluster {
            command.env("TURNSTILE_REDIS_CLUSTER", "on");
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} consume", binary.display()))?;
        Ok(Self {
            name,
            child,
            readyz: format!("http://127.0.0.1:{port}/readyz"),
            started: Instant::now(),
        })
    }

    /// Polls `/readyz` until it answers 200 and returns when it did.
    async fn ready(&mut self) -> anyhow::Result<Instant> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()?;
        loop {
            self.still_running()?;
            if let Ok(response) = client.get(&self.readyz).send().await
                && response.status().is_success()
            {
                return Ok(Instant::now());
            }
            anyhow::ensure!(
                self.started.elapsed() < READY_WITHIN,
                "replica {} was not ready within {} s",
                self.name,
                READY_WITHIN.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Fails if the process has exited.
    fn still_running(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait()? {
            Some(status) => anyhow::bail!("replica {} exited: {status}", self.name),
            None => Ok(()),
        }
    }

    /// Sends SIGTERM and returns when it was sent.
    fn terminate(&self) -> anyhow::Result<Instant> {
        let pid = self
            .child
            .id()
            .with_context(|| format!("replica {} has already exited", self.name))?;
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .context("running kill")?;
        anyhow::ensure!(status.success(), "kill -TERM {pid} failed: {status}");
        Ok(Instant::now())
    }

    /// Waits for the process to exit (killed if it takes longer than [`EXIT_WITHIN`]) and
    /// returns when it did.
    async fn exited(&mut self) -> anyhow::Result<Instant> {
        match tokio::time::timeout(EXIT_WITHIN, self.child.wait()).await {
            Ok(status) => {
                let status = status?;
                let at = Instant::now();
                anyhow::ensure!(
                    status.success(),
                    "replica {} exited after SIGTERM with {status}",
                    self.name
                );
                Ok(at)
            }
            Err(_) => {
                let _ = self.child.kill().await;
                anyhow::bail!(
                    "replica {} had not exited {} s after SIGTERM (killed)",
                    self.name,
                    EXIT_WITHIN.as_secs()
                )
            }
        }
    }
}

/// One call the recorder received.
#[derive(Clone, Debug)]
struct Call {
    at: Instant,
    /// The first call with its Idempotency-Key (a registration); later ones are duplicates.
    first: bool,
}

/// What the recorder received; each call is stamped under the lock, so `calls` is in arrival
/// order.
#[derive(Default)]
struct Calls {
    calls: Vec<Call>,
    keys: HashSet<String>,
}

/// The round's downstream: `POST /register/{seller}` answers 200 at once, whatever the rate,
/// and notes when the call arrived and whether its Idempotency-Key was new. It enforces
/// nothing, so the replicas' grants are all there is to count.
struct Recorder {
    url: String,
    calls: Arc<Mutex<Calls>>,
    stop: CancellationToken,
}

impl Recorder {
    async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("the recorder cannot listen")?;
        let addr = listener.local_addr()?;
        let calls = Arc::new(Mutex::new(Calls::default()));
        let router = Router::new()
            .route("/register/{seller}", post(record))
            .with_state(calls.clone());
        let stop = CancellationToken::new();
        let shutdown = stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        });
        Ok(Self {
            url: format!("http://{addr}/register/{{seller_id}}"),
            calls,
            stop,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn first_call(&self) -> Option<Instant> {
        self.lock().calls.first().map(|c| c.at)
    }

    /// Distinct Idempotency-Keys called.
    fn registered(&self) -> u64 {
        self.lock().keys.len() as u64
    }

    /// Every call so far, in arrival order.
    fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn record(
    State(calls): State<Arc<Mutex<Calls>>>,
    headers: HeaderMap,
) -> axum::Json<serde_json::Value> {
    let key = headers
        .get("idempotency-key")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    let mut calls = calls.lock().unwrap_or_else(PoisonError::into_inner);
    let at = Instant::now();
    let first = calls.keys.insert(key.clone());
    calls.calls.push(Call { at, first });
    axum::Json(serde_json::json!({"registered": true, "id": key}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn a_window_counts_only_the_calls_of_its_span() {
        let limit: Limit = "2/1s".parse().unwrap();
        // Four calls within a second, the first before the span.
        let times = ms(&[0, 100, 200, 300, 1_250]);
        let from = Duration::from_millis(50);
        assert_eq!(
            over_limit(&times, from, None, limit),
            Over { calls: 1, worst: 3 }
        );
        assert_eq!(
            over_limit(&times, Duration::ZERO, None, limit),
            Over { calls: 2, worst: 4 }
        );
        // Until 200 ms: two calls of the span, none over.
        assert_eq!(
            over_limit(&times, from, Some(Duration::from_millis(200)), limit),
            Over { calls: 0, worst: 2 }
        );
        // A window is (t - 1 s, t]: the call at 1,250 ms is alone with the one at 300 ms.
        assert_eq!(
            over_limit(&ms(&[300, 1_250, 1_300]), Duration::ZERO, None, limit),
            Over { calls: 0, worst: 2 }
        );
        assert_eq!(
            over_limit(
                &ms(&[300, 1_300]),
                Duration::ZERO,
                None,
                "1/1s".parse().unwrap()
            ),
            Over { calls: 0, worst: 1 }
        );
    }

    #[test]
    fn the_drain_rate_counts_the_registrations_after_a_moment() {
        let times = ms(&[0, 500, 1_000, 1_500, 2_000]);
        assert_eq!(drain_rate(&times, Duration::from_millis(1_000)), Some(2.0));
        assert_eq!(drain_rate(&times, Duration::from_millis(2_000)), None);
    }

    #[test]
    fn the_longest_gap_starts_at_its_moment() {
        let times = ms(&[0, 500, 2_500, 3_000, 3_100]);
        assert_eq!(
            longest_gap(&times, Duration::from_millis(100)),
            Duration::from_secs(2)
        );
        assert_eq!(
            longest_gap(&times, Duration::from_millis(2_600)),
            Duration::from_millis(400)
        );
        assert_eq!(longest_gap(&times, Duration::from_secs(4)), Duration::ZERO);
    }

    #[test]
    fn the_median_leaves_out_missing_values() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, f64::NAN, 2.0, 3.0]), 2.5);
        assert!(median(vec![f64::NAN]).is_nan());
    }
}
