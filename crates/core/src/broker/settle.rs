//! Settling the deliveries of one consumer channel, acks batched with `basic.ack multiple`.
//!
//! Acking each delivery on its own costs the broker one settle per message (a Raft command on a
//! quorum queue) and the client one frame: measured on this project's bench, per-message acks
//! are most of a bare consume loop's cost, and batching them made the loop about five times
//! faster. So acks are collected and sent as runs: every delivery tag below the lowest one still
//! unsettled in the replica has been acked or nacked, so one `basic.ack multiple` of the highest
//! acked tag below it covers exactly the acked ones. A nack is sent at once, and its tag leaves
//! the unsettled set only after the nack went out, so a multiple ack can never cover a tag
//! that was meant to be requeued. Acks stuck above a long-held delivery are sent one by one
//! after [`STRAGGLER`]. Only one task at a time takes acks out and sends them (the `sending`
//! lock is held from taking to the last frame): two senders could otherwise race, a multiple
//! ack overtaking a single ack it covers, which the broker refuses as an unknown tag.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tokio::sync::mpsc;

/// How long the flusher waits after the first new ack, to gather more into one frame.
const LINGER: Duration = Duration::from_millis(2);
/// How long an ack may wait behind a lower, still unsettled delivery before it is sent alone.
const STRAGGLER: Duration = Duration::from_millis(25);

/// Settles the deliveries of one channel; cheap to clone. The flusher task ends (after a last
/// flush) when every clone is dropped.
#[derive(Clone)]
pub struct Settler {
    /// Shared: a settler is cloned for every delivery, and a lapin `Channel` is a dozen `Arc`s.
    channel: Arc<Channel>,
    state: Arc<Mutex<State>>,
    sending: Arc<tokio::sync::Mutex<()>>,
    wake: mpsc::Sender<()>,
    /// Where its acks and requeues are counted, if anywhere.
    cost: Option<Arc<super::BrokerCost>>,
}

#[derive(Default)]
struct State {
    /// Never ack with `multiple` (see [`Settler::singly`]).
    singly: bool,
    /// Delivered and neither acked nor nacked yet.
    unsettled: BTreeSet<u64>,
    /// Acked by the replica, not yet sent to the broker, with when.
    acked: BTreeMap<u64, Instant>,
}

impl Settler {
    /// Starts the flusher for `channel` (the channel the deliveries come from).
    pub fn new(channel: Channel) -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let sending = Arc::new(tokio::sync::Mutex::new(()));
        let (wake, woken) = mpsc::channel(1);
        tokio::spawn(flusher(
            channel.clone(),
            state.clone(),
            sending.clone(),
            woken,
        ));
        Self {
            channel: Arc::new(channel),
            state,
            sending,
            wake,
            cost: None,
        }
    }

    /// Acks every delivery alone, never with `multiple`: for a channel whose deliveries are
    /// recorded as received by several tasks (several consumers), so not in delivery-tag order,
    /// where a multiple ack could cover a delivery received but not yet recorded.
    pub fn singly(self) -> Self {
        self.lock().singly = true;
        self
    }

    /// Counts every delivery it acks or requeues in `cost`.
    pub fn counting(mut self, cost: Arc<super::BrokerCost>) -> Self {
        self.cost = Some(cost);
        self
    }

    fn count(&self, counter: fn(&super::BrokerCost) -> &std::sync::atomic::AtomicU64) {
        if let Some(cost) = &self.cost {
            super::BrokerCost::count(counter(cost));
        }
    }

    /// Records a delivery as it arrives (in delivery-tag order, before it is handled).
    pub fn received(&self, tag: u64) {
        self.lock().unsettled.insert(tag);
    }

    /// Acks a delivery at once, alone: for a delivery that was republished (delayed or
    /// dead-lettered), whose ack lost with a connection would leave a second copy behind.
    pub async fn ack_now(&self, tag: u64) -> Result<(), lapin::Error> {
        let _sending = self.sending.lock().await;
        self.lock().unsettled.remove(&tag);
        let sent = self
            .channel
            .basic_ack(tag, BasicAckOptions::default())
            .await;
        if sent.is_ok() {
            self.count(|c| &c.acks);
        }
        sent
    }

    /// Acks a delivery: sent with the next batch.
    pub fn ack(&self, tag: u64) {
        {
            let mut state = self.lock();
            state.unsettled.remove(&tag);
            state.acked.insert(tag, Instant::now());
        }
        self.count(|c| &c.acks);
        let _ = self.wake.try_send(());
    }

    /// Returns a delivery to its queue (nack with requeue), at once.
    pub async fn requeue(&self, tag: u64) -> Result<(), lapin::Error> {
        let sent = self
            .channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    multiple: false,
                    requeue: true,
                },
            )
            .await;
        // Only now may a multiple ack pass this tag (see the module docs). If the nack failed
        // the channel is gone: the tag stays unsettled and nothing passes it any more.
        if sent.is_ok() {
            self.count(|c| &c.requeues);
            self.lock().unsettled.remove(&tag);
            let _ = self.wake.try_send(());
        }
        sent
    }

    /// Sends every ack collected so far (before closing the channel).
    pub async fn flush(&self) -> Result<(), lapin::Error> {
        flush(&self.channel, &self.state, &self.sending, true).await
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

/// The state, even after a panic elsewhere (its sets stay consistent at every step).
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

async fn flusher(
    channel: Channel,
    state: Arc<Mutex<State>>,
    sending: Arc<tokio::sync::Mutex<()>>,
    mut woken: mpsc::Receiver<()>,
) {
    loop {
        let waiting = !lock(&state).acked.is_empty();
        let wake = if waiting {
            tokio::time::timeout(STRAGGLER, woken.recv()).await
        } else {
            Ok(woken.recv().await)
        };
        if let Ok(None) = wake {
            let _ = flush(&channel, &state, &sending, true).await;
            return;
        }
        tokio::time::sleep(LINGER).await;
        if let Err(error) = flush(&channel, &state, &sending, false).await {
            tracing::debug!(%error, "acks not sent (the channel is gone; the broker redelivers)");
        }
    }
}

/// Sends one multiple ack for the acked run below the lowest unsettled tag, and single acks for
/// acks older than [`STRAGGLER`] above it (all of them when `everything`).
async fn flush(
    channel: &Channel,
    state: &Mutex<State>,
    sending: &tokio::sync::Mutex<()>,
    everything: bool,
) -> Result<(), lapin::Error> {
    let _sending = sending.lock().await;
    let (run_end, singles) = {
        let mut state = lock(state);
        let singly = state.singly;
        let lowest_unsettled = if singly {
            0
        } else {
            state.unsettled.first().copied().unwrap_or(u64::MAX)
        };
        let run_end = state
            .acked
            .range(..lowest_unsettled)
            .next_back()
            .map(|(tag, _)| *tag);
        state.acked = state.acked.split_off(&lowest_unsettled);
        let now = Instant::now();
        let singles: Vec<u64> = state
            .acked
            .iter()
            .filter(|(_, at)| everything || singly || now.duration_since(**at) >= STRAGGLER)
            .map(|(tag, _)| *tag)
            .collect();
        for tag in &singles {
            state.acked.remove(tag);
        }
        (run_end, singles)
    };
    if let Some(tag) = run_end {
        channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await?;
    }
    for tag in singles {
        channel.basic_ack(tag, BasicAckOptions::default()).await?;
    }
    Ok(())
}
