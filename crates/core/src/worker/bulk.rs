//! Bulk calls: the rows of one seller and one route gathered into one call (see
//! [`crate::routes::Bulk`]).
//!
//! A [`Gather`] is one seller's and one route's: another seller's rows never wait for it. Its
//! leader is the row that makes the call: once it holds a permit, the gather is open for the
//! route's `linger` (never past the moment its grant must be called by) or until `max_rows`
//! rows are in it (on a route whose rows are counted one by one, also until no row joined for
//! [`QUIET`]: each row pays its own units, so a call need not wait to be fuller); then it
//! closes and the leader makes the call for all of them. A row that
//! joined waits for its own entry of the answer without a worker, then finishes as if it had
//! made the call itself (its completion record, its result, its retry).
//!
//! How rows come into a gather depends on how the route counts a call:
//! - `cost = "row"`: every row takes its own permit for its own units, and a granted row joins
//!   the open gather ([`Gathers::join`]), or leads a new one.
//! - `cost = "call"`: only the leader takes a permit (the route's cost, once). A row with no
//!   slot of its own first attaches to the gather of its seller and route
//!   ([`Gathers::attach`]): while the leader asks, or holds for its slot, the row waits with it
//!   (pending); once the leader is granted, every attached row is given a grant to ride with
//!   ([`crate::permit::Grant::riding`], holding no units) and joins. A leader that goes
//!   through the delay ladder instead releases its riders with its delay, so that they come
//!   back when it does; one that leaves otherwise releases them to ask on their own. A row
//!   that finds no gather taking rows leads a new one ([`Gathers::lead`]), so a backlog of N
//!   rows holds about N / `max_rows` reserved slots.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use crate::domain::{MessageId, Registration, RouteName, SellerId};
use crate::downstream::Answered;
use crate::permit::{CALL_ALLOWANCE, Grant};

/// How long before a grant's allowance ([`CALL_ALLOWANCE`]) ends the call it is in must
/// start: time for the leader to close its gather and send the call.
pub const CALL_MARGIN: Duration = Duration::from_millis(100);

/// When a call with a grant sent at `sent` must start by, at the latest.
pub fn due(sent: std::time::Instant) -> Instant {
    Instant::from_std(sent) + CALL_ALLOWANCE.saturating_sub(CALL_MARGIN)
}

/// How long a gather of rows that each hold their own permit waits for the next row before
/// its call (see [`Gather::gathered`]): the rows a window opens for are granted together.
pub const QUIET: Duration = Duration::from_millis(20);

/// A gather's seller and route (none: the default endpoint).
pub type GatherKey = (SellerId, Option<RouteName>);

/// The gather `registration` goes in: its seller's and route's.
pub fn key_of(registration: &Registration) -> GatherKey {
    (registration.seller_id.clone(), registration.route.clone())
}

/// What a row that joined a gather gets back: its entry of the answer, and whether the answer
/// could not be mapped to the rows (the row is then retried alone).
pub type RowAnswer = (Answered, bool);

/// What a row attached to a pending gather ([`Gathers::attach`]) is told.
pub enum Attached {
    /// The leader is granted: ride in its call (join this gather, [`Gathers::ride_in`]) with
    /// this grant.
    Ride(Grant, Arc<Gather>),
    /// The leader left without a call: come back after its delay (`Some`), or ask alone.
    Released(Option<Duration>),
}

/// The gathers pending or open on a replica: the one of each seller and route that rows come
/// into, and every one by its leader.
#[derive(Default)]
pub struct Gathers {
    open: Mutex<Maps>,
}

#[derive(Default)]
struct Maps {
    /// The gather rows of a seller and route attach to or join.
    current: HashMap<GatherKey, Arc<Gather>>,
    /// Every gather not closed, by its seller and leader (a full one is no longer current).
    led: HashMap<(SellerId, MessageId), Arc<Gather>>,
}

/// Rows of one seller and one route waiting for one call.
pub struct Gather {
    /// The row that makes the call.
    leader: MessageId,
    max_rows: usize,
    rows: Mutex<Rows>,
    /// Told when a row joins it or gives its place up.
    changed: Notify,
}

/// Where a gather is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Its leader asks for its permit, or holds for its slot.
    Pending,
    /// Its leader is granted; its call starts by then.
    Open(Instant),
    /// Its call is being made, or its leader left: no row joins it.
    Closed,
}

struct Rows {
    phase: Phase,
    /// Places taken besides the leader's: rows attached or joined.
    seats: usize,
    /// Rows attached and not yet told (see [`Attached`]).
    waiting: Vec<oneshot::Sender<Attached>>,
    /// Rows that joined, each with where its answer goes.
    joined: Vec<(Registration, oneshot::Sender<RowAnswer>)>,
    /// On a route whose calls count once: the grant riders ride with.
    lead: Option<Grant>,
}

impl Gather {
    fn new(leader: &MessageId, max_rows: usize, phase: Phase) -> Self {
        Self {
            leader: leader.clone(),
            max_rows,
            rows: Mutex::new(Rows {
                phase,
                seats: 0,
                waiting: Vec::new(),
                joined: Vec::new(),
                lead: None,
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Rows> {
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether it has a place for one more row.
    fn has_room(&self, rows: &Rows) -> bool {
        rows.seats + 1 < self.max_rows
    }

    /// Whether every place is taken by a row that joined: its call need not wait.
    fn complete(&self, rows: &Rows) -> bool {
        !self.has_room(rows) && rows.joined.len() >= rows.seats
    }

    /// Whether an open gather takes a row whose call must start by `due` (see [`due`]): its
    /// call starts by then. (It takes rows until its leader closes it.)
    fn in_time(phase: Phase, due: Instant) -> bool {
        matches!(phase, Phase::Open(start_by) if start_by <= due)
    }

    /// Waits until every place is taken by a row that joined, or its call must start, or (with
    /// `quiet`) no row joined for that long while none that took a place is still on its way.
    pub async fn gathered(&self, quiet: Option<Duration>) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let (phase, settled) = {
                let rows = self.lock();
                if self.complete(&rows) {
                    return;
                }
                (rows.phase, rows.joined.len() >= rows.seats)
            };
            let Phase::Open(start_by) = phase else {
                return;
            };
            let quiet = quiet.filter(|_| settled);
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep_until(start_by) => return,
                _ = tokio::time::sleep(quiet.unwrap_or_default()), if quiet.is_some() => return,
            }
        }
    }
}

impl Gathers {
    fn lock(&self) -> MutexGuard<'_, Maps> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The gather rows of `key` come into, if one is not closed.
    fn current(&self, key: &GatherKey) -> Option<Arc<Gather>> {
        let gather = self.lock().current.get(key)?.clone();
        let closed = gather.lock().phase == Phase::Closed;
        (!closed).then_some(gather)
    }

    /// The gather `leader` (of `key`'s seller) leads, if it is not closed.
    fn led_by(&self, key: &GatherKey, leader: &MessageId) -> Option<Arc<Gather>> {
        let gather = self
            .lock()
            .led
            .get(&(key.0.clone(), leader.clone()))?
            .clone();
        let closed = gather.lock().phase == Phase::Closed;
        (!closed).then_some(gather)
    }

    /// A new gather led by `leader`, the one rows of `key` come into from now.
    fn start(&self, key: GatherKey, leader: &MessageId, max_rows: usize) -> Arc<Gather> {
        let gather = Arc::new(Gather::new(leader, max_rows, Phase::Pending));
        let mut maps = self.lock();
        maps.led
            .insert((key.0.clone(), leader.clone()), gather.clone());
        maps.current.insert(key, gather.clone());
        gather
    }

    /// Attaches a row of a route whose calls count once to the gather of `key`, if one has room
    /// and is pending or open in time: told at once to ride when it is open, else when its
    /// leader is granted or leaves (see [`Attached`]). `None`: the row leads a gather of its
    /// own ([`Self::lead`]), or asks again for the one it leads.
    pub fn attach(&self, key: &GatherKey, row: &MessageId) -> Option<oneshot::Receiver<Attached>> {
        let gather = self.current(key)?;
        if gather.leader == *row || self.led_by(key, row).is_some() {
            // A leader asking again never waits for itself.
            return None;
        }
        let mut rows = gather.lock();
        if !gather.has_room(&rows) {
            return None;
        }
        let (tell, told) = oneshot::channel();
        match rows.phase {
            Phase::Pending => rows.waiting.push(tell),
            Phase::Open(_) => {
                let lead = rows.lead.as_ref()?;
                let _ = tell.send(Attached::Ride(riding(lead), gather.clone()));
            }
            _ => return None,
        }
        rows.seats += 1;
        Some(told)
    }

    /// Makes `leader` the leader of a new pending gather of `key` (of up to `max_rows` rows)
    /// that rows attach to while it asks for its permit, unless it leads the current one.
    pub fn lead(&self, key: GatherKey, leader: &MessageId, max_rows: usize) {
        if self.led_by(&key, leader).is_none() {
            self.start(key, leader, max_rows);
        }
    }

    /// `leader` is granted: its gather of `key` (the pending one it leads, or a new one of up
    /// to `max_rows` rows) is open until `start_by`; `lead`, on a route whose calls count
    /// once, is the grant its riders ride with, given to every row attached.
    pub fn open(
        &self,
        key: GatherKey,
        leader: &MessageId,
        max_rows: usize,
        start_by: Instant,
        lead: Option<Grant>,
    ) -> Arc<Gather> {
        let gather = match self.led_by(&key, leader) {
            Some(gather) => gather,
            None => self.start(key, leader, max_rows),
        };
        {
            let mut rows = gather.lock();
            rows.phase = Phase::Open(start_by);
            for tell in std::mem::take(&mut rows.waiting) {
                if let Some(lead) = &lead {
                    let _ = tell.send(Attached::Ride(riding(lead), gather.clone()));
                }
            }
            rows.lead = lead;
        }
        gather
    }

    /// Joins `registration` (whose own grant must be called by `due`, see [`due`]) to the open
    /// gather of `key`, if it is in time and has room: its answer comes on the receiver. For a
    /// row with a permit of its own, on a route whose rows are counted one by one.
    pub fn join(
        &self,
        key: &GatherKey,
        registration: &Registration,
        due: Instant,
    ) -> Option<oneshot::Receiver<RowAnswer>> {
        let gather = self.current(key)?;
        if gather.leader == registration.message_id {
            return None;
        }
        let mut rows = gather.lock();
        if !Gather::in_time(rows.phase, due) || !gather.has_room(&rows) {
            return None;
        }
        rows.seats += 1;
        Some(Self::joined(&gather, &mut rows, registration))
    }

    /// Joins a row told to ride in `gather` ([`Attached::Ride`]: its place is its own already)
    /// to it, if it is still open: its answer comes on the receiver.
    pub fn ride_in(
        &self,
        gather: &Arc<Gather>,
        registration: &Registration,
    ) -> Option<oneshot::Receiver<RowAnswer>> {
        let mut rows = gather.lock();
        if !matches!(rows.phase, Phase::Open(_)) {
            return None;
        }
        Some(Self::joined(gather, &mut rows, registration))
    }

    /// `registration` joins `gather`, whose rows are `rows`.
    fn joined(
        gather: &Gather,
        rows: &mut Rows,
        registration: &Registration,
    ) -> oneshot::Receiver<RowAnswer> {
        let (answer, answered) = oneshot::channel();
        rows.joined.push((registration.clone(), answer));
        gather.changed.notify_one();
        answered
    }

    /// Whether `gather` is open (a row told to ride in it may still join).
    pub fn is_open(&self, gather: &Gather) -> bool {
        matches!(gather.lock().phase, Phase::Open(_))
    }

    /// Gives up the place of `row`, told to ride in `gather`, unless it joined it.
    pub fn leave_unless_joined(&self, gather: &Gather, row: &MessageId) {
        let joined = gather
            .lock()
            .joined
            .iter()
            .any(|(r, _)| r.message_id == *row);
        if !joined {
            self.leave(gather);
        }
    }

    /// A row told to ride in `gather` will not join it (its call was claimed elsewhere, it was
    /// superseded, it expired, it was interrupted): its place is given up, so that the leader
    /// does not wait for it.
    pub fn leave(&self, gather: &Gather) {
        let mut rows = gather.lock();
        rows.seats = rows.seats.saturating_sub(1);
        gather.changed.notify_one();
    }

    /// Closes `gather` (of `key`): no row joins it from now; the rows that joined, in order.
    pub fn close(
        &self,
        key: &GatherKey,
        gather: &Arc<Gather>,
    ) -> Vec<(Registration, oneshot::Sender<RowAnswer>)> {
        self.forget(key, gather);
        let mut rows = gather.lock();
        rows.phase = Phase::Closed;
        std::mem::take(&mut rows.joined)
    }

    /// `leader` leaves without a call: the pending gather of `key` it leads closes, and its
    /// attached rows are released with `delay` (see [`Attached::Released`]).
    pub fn release(&self, key: &GatherKey, leader: &MessageId, delay: Option<Duration>) {
        let Some(gather) = self.led_by(key, leader) else {
            return;
        };
        let waiting = {
            let mut rows = gather.lock();
            if rows.phase != Phase::Pending {
                return;
            }
            rows.phase = Phase::Closed;
            std::mem::take(&mut rows.waiting)
        };
        self.forget(key, &gather);
        for tell in waiting {
            let _ = tell.send(Attached::Released(delay));
        }
    }

    /// Takes `gather` (of `key`) out of the maps.
    fn forget(&self, key: &GatherKey, gather: &Arc<Gather>) {
        let mut maps = self.lock();
        if maps
            .current
            .get(key)
            .is_some_and(|g| Arc::ptr_eq(g, gather))
        {
            maps.current.remove(key);
        }
        let led = (key.0.clone(), gather.leader.clone());
        if maps.led.get(&led).is_some_and(|g| Arc::ptr_eq(g, gather)) {
            maps.led.remove(&led);
        }
    }

    /// How many gathers are pending or open (each holds its rows in memory until its call).
    pub fn open_count(&self) -> usize {
        self.lock().led.len()
    }
}

/// A grant to ride with in `lead`'s call, for a row not named yet: the row makes it its own
/// with [`Grant::riding`].
fn riding(lead: &Grant) -> Grant {
    Grant::riding(lead, None, lead.cost())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration(seller: &str, id: &str) -> Registration {
        let body = format!(r#"{{"message_id":"{id}","seller_id":"{seller}","product":{{}}}}"#);
        Registration::parse(body.as_bytes(), None).unwrap()
    }

    fn key(seller: &str) -> GatherKey {
        (SellerId::parse(seller).unwrap(), None)
    }

    fn id(m: &str) -> MessageId {
        MessageId::parse(m).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn rows_join_the_open_gather_of_their_seller_until_it_is_full_and_never_another_sellers()
    {
        let gathers = Gathers::default();
        let start_by = Instant::now() + Duration::from_millis(200);
        let far = Instant::now() + Duration::from_secs(1);
        let gather = gathers.open(key("S-1"), &id("lead"), 3, start_by, None);
        let join =
            |seller: &str, m: &str, due| gathers.join(&key(seller), &registration(seller, m), due);
        assert!(join("S-2", "x", far).is_none());
        assert!(join("S-1", "a", far).is_some());
        // Its grant must be called before the gather's call would start: not taken.
        assert!(join("S-1", "b", Instant::now() + Duration::from_millis(100)).is_none());
        assert!(join("S-1", "b", far).is_some());
        // Full with the leader's own row: the leader stops waiting at once.
        assert!(join("S-1", "c", far).is_none());
        let waited = Instant::now();
        gather.gathered(None).await;
        assert_eq!(waited.elapsed(), Duration::ZERO);
        let joined = gathers.close(&key("S-1"), &gather);
        let ids: Vec<&str> = joined.iter().map(|(r, _)| r.message_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(gathers.open_count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gather_waits_for_rows_until_its_call_must_start_and_takes_none_after_it_closed() {
        let gathers = Gathers::default();
        let far = Instant::now() + Duration::from_secs(1);
        let start_by = Instant::now() + Duration::from_millis(200);
        let gather = gathers.open(key("S-1"), &id("lead"), 50, start_by, None);
        let waited = Instant::now();
        gather.gathered(None).await;
        assert_eq!(waited.elapsed(), Duration::from_millis(200));
        // Until its leader closes it, a row whose grant is in time still joins.
        let late = registration("S-1", "late");
        assert!(gathers.join(&key("S-1"), &late, far).is_some());
        assert_eq!(gathers.close(&key("S-1"), &gather).len(), 1);
        assert!(gathers.join(&key("S-1"), &late, far).is_none());
        let start_by = Instant::now() + Duration::from_millis(200);
        let again = gathers.open(key("S-1"), &id("lead-2"), 50, start_by, None);
        gathers.close(&key("S-1"), &gather);
        assert_eq!(
            gathers.open_count(),
            1,
            "closing an old gather leaves the new one open"
        );
        let far = Instant::now() + Duration::from_secs(1);
        assert!(
            gathers
                .join(&key("S-1"), &registration("S-1", "new"), far)
                .is_some()
        );
        assert_eq!(gathers.close(&key("S-1"), &again).len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn rows_attached_while_their_leader_asks_are_released_with_its_delay_when_it_leaves() {
        let gathers = Gathers::default();
        gathers.lead(key("S-1"), &id("lead"), 3);
        let attach = |seller: &str, row: &str| gathers.attach(&key(seller), &id(row));
        assert!(
            attach("S-1", "lead").is_none(),
            "its leader asking again never waits for itself"
        );
        let first = attach("S-1", "a").expect("a pending gather takes rows");
        let second = attach("S-1", "b").expect("room for a second");
        assert!(attach("S-1", "c").is_none(), "full with its leader");
        assert!(attach("S-2", "x").is_none(), "another seller's");
        // Another row leaving releases nothing; the leader leaving for the ladder does.
        gathers.release(&key("S-1"), &id("other"), None);
        gathers.release(&key("S-1"), &id("lead"), Some(Duration::from_secs(3)));
        for told in [first, second] {
            assert!(
                matches!(told.await.unwrap(), Attached::Released(Some(d)) if d == Duration::from_secs(3))
            );
        }
        assert_eq!(gathers.open_count(), 0);
        assert!(gathers.attach(&key("S-1"), &id("d")).is_none());
    }

    fn lead_grant() -> Grant {
        use crate::permit::{Ask, Decision};
        let seller = SellerId::parse("S-1").unwrap();
        let decision = Decision::Granted {
            slot_us: 1,
            granted_us: 1,
            used_permille: 0,
            call: "lead-call".into(),
            sent: std::time::Instant::now(),
        };
        let grant = Grant::of(Ask::new(&seller), &decision, crate::domain::Cost::ONE).unwrap();
        Grant::riding(&grant, None, crate::domain::Cost::ONE)
    }

    #[tokio::test(start_paused = true)]
    async fn rows_attached_to_a_pending_gather_ride_in_that_gather_whichever_is_current_later() {
        let gathers = Gathers::default();
        gathers.lead(key("S-1"), &id("lead"), 3);
        let a = gathers.attach(&key("S-1"), &id("a")).unwrap();
        let b = gathers.attach(&key("S-1"), &id("b")).unwrap();
        // Full: the next row leads a gather of its own, now the current one.
        assert!(gathers.attach(&key("S-1"), &id("c")).is_none());
        gathers.lead(key("S-1"), &id("c"), 3);
        let start_by = Instant::now() + Duration::from_millis(200);
        let first = gathers.open(key("S-1"), &id("lead"), 3, start_by, Some(lead_grant()));
        let Ok(Attached::Ride(grant, gather)) = a.await else {
            panic!("a rides once its leader is granted");
        };
        assert!(grant.rides());
        assert!(Arc::ptr_eq(&gather, &first), "in its own leader's gather");
        assert!(
            gathers
                .ride_in(&gather, &registration("S-1", "a"))
                .is_some()
        );
        let Ok(Attached::Ride(_, gather)) = b.await else {
            panic!("b rides too");
        };
        // b gives its place up: the leader stops waiting with a only.
        gathers.leave(&gather);
        let waited = Instant::now();
        first.gathered(None).await;
        assert_eq!(
            waited.elapsed(),
            Duration::from_millis(200),
            "room again: it waits its linger"
        );
        let rows = gathers.close(&key("S-1"), &first);
        assert_eq!(rows.len(), 1);
        assert!(
            gathers.ride_in(&first, &registration("S-1", "b")).is_none(),
            "closed"
        );
        assert_eq!(gathers.open_count(), 1, "c's gather is still pending");
    }

    #[tokio::test(start_paused = true)]
    async fn a_gather_of_rows_with_their_own_permits_calls_once_no_row_joined_for_a_moment() {
        let gathers = Gathers::default();
        let far = Instant::now() + Duration::from_secs(1);
        let start_by = Instant::now() + Duration::from_millis(200);
        let gather = gathers.open(key("S-1"), &id("lead"), 50, start_by, None);
        let joining = async {
            tokio::time::sleep(Duration::from_millis(15)).await;
            gathers
                .join(&key("S-1"), &registration("S-1", "a"), far)
                .map(|_answer| ())
        };
        let waited = Instant::now();
        let (_, joined) = tokio::join!(gather.gathered(Some(QUIET)), joining);
        assert!(joined.is_some());
        assert_eq!(
            waited.elapsed(),
            Duration::from_millis(35),
            "a row joined at 15 ms, then 20 ms quiet"
        );
        assert_eq!(gathers.close(&key("S-1"), &gather).len(), 1);
    }
}
