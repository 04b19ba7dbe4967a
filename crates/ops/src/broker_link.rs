//! The operator side's own link to the broker: a connection apart from the replica's (the
//! consume path's connection, channels and consumers stay its own, see
//! `turnstile_core::replica`), opened by the composition root (`serve`) from the same
//! settings. Over it the dashboard reads the queue depths every 5 s, which also tells it
//! whether the broker answers ([`Health`]), and the operator lists and replays dead letters
//! (`turnstile_core::broker::dead_letters`), one listing or replay at a time per replica.
//! A slow listing never holds up the replica's deliveries: they are on another connection.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::debug;
use turnstile_core::broker::dead_letters::{
    self, DeadLetter, Discarded, Listing, Reason, Selection, UnknownReason,
};
use turnstile_core::broker::{self, Topology};
use turnstile_core::domain::unix_ms;
use turnstile_core::permit::PermitStore;

use crate::health::Health;

/// How often the queue depths are read.
pub const QUEUES_EVERY: Duration = Duration::from_secs(5);

/// Queue depths older than this are stale (two reads missed, or the broker down).
pub const DEPTHS_STALE_AFTER: Duration = Duration::from_secs(12);

/// Longest a connection to the broker may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Messages in the replica's queues, as last read from the broker.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct QueueDepths {
    /// Ready in the work queue.
    pub work: u64,
    /// Back from a delay and ready in the return queue `<queue>.ready` (taken beside the work
    /// queue, not behind it).
    pub returning: u64,
    /// In the delay ladder (throttled or retried, coming back later).
    pub delayed: u64,
    /// In `<queue>.dead`.
    pub dead: u64,
    /// When they were read (unix ms).
    pub read_ms: u64,
}

impl QueueDepths {
    /// Sets the `turnstile_queue_messages` gauges.
    fn export(&self) {
        for (queue, n) in [
            ("work", self.work),
            ("ready", self.returning),
            ("delay", self.delayed),
            ("dead", self.dead),
        ] {
            metrics::gauge!("turnstile_queue_messages", "queue" => queue).set(n as f64);
        }
    }

    /// Sets `turnstile_queue_messages_age_seconds`: how old these depths are at `now_ms`, so
    /// that a scrape during a broker outage tells frozen depths from current ones (stale
    /// beyond [`DEPTHS_STALE_AFTER`], as the console marks them).
    fn export_age(&self, now_ms: u64) {
        let age = now_ms.saturating_sub(self.read_ms) as f64 / 1000.0;
        metrics::gauge!("turnstile_queue_messages_age_seconds").set(age);
    }
}

/// Whether `error` is the broker's answer to a request (a queue not found, say): the broker
/// is there.
fn refused_by_broker(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|e| e.downcast_ref::<lapin::Error>())
        .any(|e| matches!(e.kind(), lapin::ErrorKind::ProtocolError(_)))
}

/// The operator side's connection to the broker (see the module's doc).
pub struct BrokerLink {
    nodes: broker::Nodes,
    topology: Topology,
    /// The connection's name, as the broker's management UI shows it.
    name: String,
    connection: tokio::sync::Mutex<Option<Arc<lapin::Connection>>>,
    health: Health,
    depths: Mutex<Option<QueueDepths>>,
    /// Held by a dead-letter listing or replay: they take every dead letter off the queue
    /// for a moment, so two at once would each see part of them.
    pub(crate) dead_letters: tokio::sync::Mutex<()>,
}

impl BrokerLink {
    /// A link to the broker at `amqp_url` (one URL or a cluster's list) for `topology`'s
    /// queues; it connects at its first use.
    pub fn new(amqp_url: &str, topology: Topology) -> anyhow::Result<Self> {
        Ok(Self {
            nodes: broker::Nodes::parse(amqp_url)?,
            name: format!(
                "turnstile {} operator side pid {}",
                topology.work(),
                std::process::id()
            ),
            topology,
            connection: tokio::sync::Mutex::default(),
            health: Health::new("the broker"),
            depths: Mutex::default(),
            dead_letters: tokio::sync::Mutex::default(),
        })
    }

    /// The queues it reads.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The broker's health as this link last found it.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The queue depths last read, if any were.
    pub fn depths(&self) -> Option<QueueDepths> {
        *self.depths.lock().expect("never poisoned")
    }

    /// The open connection, or a new one.
    pub(crate) async fn connection(&self) -> anyhow::Result<Arc<lapin::Connection>> {
        let mut open = self.connection.lock().await;
        if let Some(connection) = open.as_ref()
            && connection.status().connected()
        {
            return Ok(connection.clone());
        }
        *open = None;
        let connection = tokio::time::timeout(CONNECT_TIMEOUT, self.nodes.connect(&self.name))
            .await
            .map_err(|_| {
                anyhow::anyhow!("the broker did not accept a connection within {CONNECT_TIMEOUT:?}")
            })??;
        let connection = Arc::new(connection);
        *open = Some(connection.clone());
        Ok(connection)
    }

    /// Notes the outcome of a broker operation: its health, and a failed one's connection
    /// dropped (the next use opens another).
    pub(crate) async fn note<T>(&self, done: &anyhow::Result<T>) {
        match done {
            Ok(_) => self.health.ok(),
            Err(error) => {
                self.health.failed(&crate::health::one_line(error));
                let dropped = self.connection.lock().await.take();
                if let Some(connection) = dropped {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        connection.close(320, "reopening".into()),
                    )
                    .await;
                }
            }
        }
    }

    /// Reads the depth of each of the topology's queues (the delay ladder's summed), on a
    /// channel of its own.
    async fn read_depths(&self) -> anyhow::Result<QueueDepths> {
        let connection = self.connection().await?;
        let channel = connection
            .create_channel()
            .await
            .context("opening a channel")?;
        let mut depths = QueueDepths {
            read_ms: unix_ms(),
            ..Default::default()
        };
        for queue in self.topology.queues() {
            let n = u64::from(broker::depth(&channel, &queue).await?);
            if queue == self.topology.work() {
                depths.work = n;
            } else if queue == self.topology.ready() {
                depths.returning = n;
            } else if queue == self.topology.dead() {
                depths.dead = n;
            } else {
                depths.delayed += n;
            }
        }
        let _ = channel.close(200, "read".into()).await;
        Ok(depths)
    }

    /// Reads the queue depths every [`QUEUES_EVERY`] until `stop`, for the page, the
    /// `turnstile_queue_messages` gauges and the broker's health; then closes the connection.
    pub async fn watch(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(QUEUES_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => break,
            }
            let read = tokio::select! {
                read = tokio::time::timeout(QUEUES_EVERY, self.read_depths()) => read
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("reading the queue depths took longer than {QUEUES_EVERY:?}"))),
                _ = stop.cancelled() => break,
            };
            // A queue not declared yet (the replica declares its topology once it reaches the
            // broker) fails its read, not the broker: the broker answered.
            match &read {
                Err(error) if refused_by_broker(error) && self.connection_ok().await => {
                    self.health.ok();
                }
                _ => self.note(&read).await,
            }
            match read {
                Ok(depths) => {
                    depths.export();
                    *self.depths.lock().expect("never poisoned") = Some(depths);
                }
                Err(error) => {
                    metrics::counter!("turnstile_broker_errors_total").increment(1);
                    debug!(error = format!("{error:#}"), "could not read queue depths");
                }
            }
            if let Some(depths) = self.depths() {
                depths.export_age(unix_ms());
            }
        }
        if let Some(connection) = self.connection.lock().await.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                connection.close(200, "stopping".into()),
            )
            .await;
        }
    }
}

/// Which dead letters an operator chose (see `turnstile_core::broker::dead_letters::Selection`),
/// each part parsed as the message body's is: a message id, a seller, a batch, a reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterQuery(Selection);

impl DeadLetterQuery {
    /// The selection of the parts given (blank ones are not given); a part that does not parse
    /// says why.
    pub fn parse(
        message_id: Option<&str>,
        seller: Option<&str>,
        batch: Option<&str>,
        reason: Option<&str>,
    ) -> Result<Self, String> {
        fn given(part: Option<&str>) -> Option<&str> {
            part.map(str::trim).filter(|p| !p.is_empty())
        }
        let mut selection = Selection::all();
        if let Some(id) = given(message_id) {
            selection = selection.with_message_id(crate::ids::message_id(id)?.as_str());
        }
        if let Some(id) = given(seller) {
            selection = selection.with_seller(crate::ids::seller_id(id)?.as_str());
        }
        if let Some(id) = given(batch) {
            selection = selection.with_batch(crate::ids::batch_id(id)?.as_str());
        }
        if let Some(reason) = given(reason) {
            let reason: Reason = reason.parse().map_err(|e: UnknownReason| e.to_string())?;
            selection = selection.with_reason(reason);
        }
        Ok(Self(selection))
    }

    /// Also only the dead letters whose detail is exactly `detail` (blank: not given), as a
    /// listing's group names it; longer than any detail kept, it is refused.
    pub fn with_detail(mut self, detail: Option<&str>) -> Result<Self, String> {
        let Some(detail) = detail.filter(|d| !d.trim().is_empty()) else {
            return Ok(self);
        };
        if detail.len() > turnstile_core::broker::budget::DETAIL_MAX {
            return Err(format!(
                "detail: at most {} bytes (as a listing's group names it)",
                turnstile_core::broker::budget::DETAIL_MAX
            ));
        }
        self.0 = self.0.with_detail(detail);
        Ok(self)
    }

    /// Also superseded dead letters, on a replay (see `Selection::force`).
    pub fn forced(mut self, force: bool) -> Self {
        self.0 = self.0.forced(force);
        self
    }

    /// Whether it names no message, seller or batch (a reason alone, or nothing).
    pub fn names_nothing(&self) -> bool {
        self.0.message_id.is_none() && self.0.seller_id.is_none() && self.0.batch_id.is_none()
    }

    /// What it takes, in words: `seller "S-1", reason rejected`.
    pub fn describe(&self) -> String {
        self.0.to_string()
    }

    /// The core's selection.
    pub fn selection(&self) -> &Selection {
        &self.0
    }
}

/// What a replay did, or on a dry run would do.
#[derive(Debug, Serialize)]
pub struct Replay {
    pub dry_run: bool,
    /// Dead letters the selection took: moved back to the work queue, or on a dry run that
    /// would be.
    pub moved: u64,
    /// Dead letters not taken: they stay.
    pub kept: u64,
    /// Superseded dead letters selected but left, for want of `force`.
    pub refused: u64,
    /// The first of those taken (at most the replay's limit), in the queue's order.
    pub letters: Vec<DeadLetter>,
    /// Whether `letters` is only the start of them.
    pub truncated: bool,
}

/// Longest a whole dead-letter listing or replay may take.
const DEAD_LETTERS_TIMEOUT: Duration = Duration::from_secs(120);

/// Longest a listing or replay waits for the dead letters it left to be counted again.
const BACK_WITHIN: Duration = Duration::from_secs(5);

impl BrokerLink {
    /// Runs `op` on a fresh channel of the link's connection (one listing or replay at a
    /// time), within [`DEAD_LETTERS_TIMEOUT`]; notes the broker's health. `op` answers with
    /// how many dead letters it took off the queue; before the next listing or replay may
    /// start, the others are back where the broker counts them (a listing takes every dead
    /// letter for a moment, and their return is asynchronous: the next one would count too
    /// few).
    async fn on_dead_letters<T, F, Fut>(&self, op: F) -> anyhow::Result<T>
    where
        F: FnOnce(Arc<lapin::Connection>, lapin::Channel) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<(T, u64)>>,
    {
        let _one_at_a_time = self.dead_letters.lock().await;
        let dead = self.topology.dead().to_owned();
        let run = async {
            let connection = self.connection().await?;
            let channel = connection
                .create_channel()
                .await
                .context("opening a channel")?;
            let before = broker::depth(&channel, &dead).await?;
            let done = op(connection.clone(), channel.clone()).await;
            if channel.status().connected() {
                let _ = channel.close(200, "done".into()).await;
            }
            if let Ok((_, taken)) = &done {
                let back = u64::from(before).saturating_sub(*taken);
                self.until_back(&connection, &dead, back).await;
            }
            done.map(|(answer, _)| answer)
        };
        let done = tokio::time::timeout(DEAD_LETTERS_TIMEOUT, run)
            .await
            .unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "the broker took longer than {DEAD_LETTERS_TIMEOUT:?}"
                ))
            });
        // A dead letter the broker cannot hand over fails the listing, not the broker.
        if done.is_ok() || !self.connection_ok().await {
            self.note(&done).await;
        }
        done
    }

    /// Waits (at most [`BACK_WITHIN`]) until the queue `dead` holds at least `back` messages
    /// again.
    async fn until_back(&self, connection: &lapin::Connection, dead: &str, back: u64) {
        let deadline = tokio::time::Instant::now() + BACK_WITHIN;
        let Ok(channel) = connection.create_channel().await else {
            return;
        };
        while tokio::time::Instant::now() < deadline {
            match broker::depth(&channel, dead).await {
                Ok(n) if u64::from(n) >= back => break,
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(_) => return,
            }
        }
        let _ = channel.close(200, "counted".into()).await;
    }

    /// Whether the link's connection is still open.
    async fn connection_ok(&self) -> bool {
        self.connection
            .lock()
            .await
            .as_ref()
            .is_some_and(|c| c.status().connected())
    }

    /// The dead letters `query` takes: how many, grouped by reason and detail, and `limit` of
    /// them after the first `skip` (leaves them all where they are).
    pub async fn list_dead(
        &self,
        query: &DeadLetterQuery,
        skip: u64,
        limit: usize,
    ) -> anyhow::Result<Listing> {
        let topology = self.topology.clone();
        self.on_dead_letters(|_, channel| async move {
            let listed =
                dead_letters::list_page(&channel, &topology, query.selection(), skip, limit)
                    .await?;
            Ok((listed, 0))
        })
        .await
    }

    /// Removes the dead letters `query` takes from the dead-letter queue for good (see
    /// `turnstile_core::broker::dead_letters::discard`: their messages stay counted dead); a
    /// `dry_run` removes nothing and reports what would go. Lists at most `shown` of them.
    pub async fn discard_dead(
        &self,
        query: &DeadLetterQuery,
        dry_run: bool,
        shown: usize,
    ) -> anyhow::Result<Discarded> {
        let topology = self.topology.clone();
        let selection = query.selection().clone();
        self.on_dead_letters(|_, channel| async move {
            let done =
                dead_letters::discard(&channel, &topology, &selection, dry_run, shown).await?;
            let taken = done.discarded;
            Ok((done, taken))
        })
        .await
    }

    /// Moves the dead letters `query` takes back to the work queue (see
    /// `turnstile_core::broker::dead_letters::replay`), counted as waiting again in
    /// `controls`' store; a `dry_run` moves nothing and reports what would move. Lists at most
    /// `shown` of them.
    pub async fn replay_dead(
        &self,
        query: &DeadLetterQuery,
        controls: &Controls,
        dry_run: bool,
        shown: usize,
    ) -> anyhow::Result<Replay> {
        let topology = self.topology.clone();
        let selection = query.selection().clone();
        let controls = controls.clone();
        let replayed = self
            .on_dead_letters(|connection, channel| async move {
                let publisher = broker::Publisher::open(&connection)
                    .await
                    .context("opening a publishing channel")?;
                // One more than shown: whether the list is cut.
                let replayed = dead_letters::replay_showing(
                    &channel,
                    &publisher,
                    &topology,
                    &selection,
                    &controls.permits,
                    controls.done_ttl,
                    dry_run,
                    shown.saturating_add(1),
                )
                .await;
                let _ = publisher.channel().close(200, "done".into()).await;
                let replayed = replayed?;
                let taken = replayed.replayed;
                Ok((replayed, taken))
            })
            .await?;
        let moved = if dry_run {
            replayed.movable()
        } else {
            replayed.replayed
        };
        let mut letters = replayed.letters;
        let truncated = letters.len() > shown;
        letters.truncate(shown);
        Ok(Replay {
            dry_run,
            moved,
            kept: replayed.kept,
            refused: replayed.refused,
            letters,
            truncated,
        })
    }
}

/// What the operator's actions need beyond the dashboard's views: the replica's permit store
/// (the terms a new limit is checked against; a replayed message counts as waiting again in
/// it) and how long completion records are kept (`TURNSTILE_DONE_TTL`).
#[derive(Clone)]
pub struct Controls {
    pub permits: PermitStore,
    pub done_ttl: Duration,
}
