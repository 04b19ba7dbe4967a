//! In-memory fakes of the worker's adapters, for unit tests of [`Worker::handle`] in tokio's
//! paused time: a scripted [`FakeLimiter`], a scripted [`FakeApi`], a [`FakeResults`] and a
//! [`FakeProgress`]. Every fake writes what it is asked into one shared [`Journal`], stamped
//! with the (paused) time, so that a test can assert on the order of everything the worker did
//! across its adapters as well as on what each was asked.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Carried, Interruptions, Outcome, Reporting, Worker, WorkerSettings};
use crate::broker::results::{ReplyTo, ResultSink};
use crate::broker::{PublishError, QueueType, Topology};
use crate::domain::{
    BatchId, BatchSize, Cost, Identity, MessageId, RateLimitHeaders, Registration, SellerId,
};
use crate::downstream::{Answered, Api, ApiResponse, Reply};
use crate::permit::{
    Ask, Asked, BatchEvent, BatchSeen, CallClaim, Decision, Ended, Finished, Grant, InBatch,
    Limiter, Orphan, PermitError, ProductMessage, Progress, Recorded, Reservation, SupersedeStep,
    Supersession, UploadProgress,
};
use crate::trace::TraceContext;

/// Settings as a replica might have them: 5 attempts, a 2 s hold for 10 messages, pauses of at
/// most 60 s, a 600 s throttle deadline, retries from 1 s to 30 s.
pub(super) fn settings() -> WorkerSettings {
    WorkerSettings {
        max_attempts: 5,
        hold: Duration::from_secs(2),
        max_pause: Duration::from_secs(60),
        throttle_deadline: Duration::from_secs(600),
        hold_capacity: 10,
        done_ttl: Duration::from_secs(3_600),
        retry_min: Duration::from_secs(1),
        retry_max: Duration::from_secs(30),
    }
}

/// A registration of seller `S-1` with the id `id` and no batch.
pub(super) fn registration(id: &str) -> Registration {
    let body = format!(r#"{{"message_id":"{id}","seller_id":"S-1","product":{{"title":"t"}}}}"#);
    Registration::parse(body.as_bytes(), None).expect("a registration")
}

/// A transient permit error: Redis refused the connection.
pub(super) fn unreachable_redis() -> PermitError {
    PermitError::Redis(redis::RedisError::from(std::io::Error::from(
        std::io::ErrorKind::ConnectionRefused,
    )))
}

/// What one of the fakes was asked, in the worker's order.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Event {
    /// [`Limiter::ask`], with the reservation the message came back with.
    Asked {
        message: String,
        held: Option<Reservation>,
    },
    /// [`Limiter::answered`] for the grant that named the call `call`.
    Answered { call: String },
    /// [`Limiter::finish`], with how the call ended.
    Finished { call: String, ended: Finish },
    /// [`Limiter::claim_call`] found the message's call claimed by another copy (a claim
    /// that is ours is not noted).
    CalledElsewhere { message: String },
    /// [`Limiter::unsent`]: a grant given back without a call.
    Unsent { call: String },
    /// [`Limiter::pause`].
    Paused { seller: String, pause: Duration },
    /// [`Limiter::unreserve`].
    Unreserved { seller: String, token: String },
    /// [`Limiter::recost`]: the downstream said the call cost `actual`.
    Recosted { call: String, actual: u32 },
    /// [`Api::call`].
    Called { message: String },
    /// [`ResultSink::publish_result`].
    Published { outcome: String },
    /// [`ResultSink::publish_event`]: a batch's completion event.
    BatchCompleted { batch: String },
    /// Any [`Progress`] record, by its method's name.
    Progress(&'static str),
}

/// [`Ended`], owned, as the fake limiter saw it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Finish {
    Registered {
        told: Option<RateLimitHeaders>,
        batch: Option<String>,
        ttl: Duration,
    },
    Throttled {
        told: Option<RateLimitHeaders>,
    },
    Failed,
}

impl From<Ended<'_>> for Finish {
    fn from(ended: Ended<'_>) -> Self {
        match ended {
            Ended::Registered {
                told, batch, ttl, ..
            } => Finish::Registered {
                told,
                batch: batch.map(|b| b.id.as_str().to_owned()),
                ttl,
            },
            Ended::Throttled { told } => Finish::Throttled { told },
            Ended::Failed => Finish::Failed,
        }
    }
}

/// Everything the fakes were asked, in order, each with the (paused) time it was asked at.
#[derive(Clone, Default)]
pub(super) struct Journal(Arc<Mutex<Vec<(Instant, Event)>>>);

impl Journal {
    fn note(&self, event: Event) {
        self.0
            .lock()
            .expect("never poisoned")
            .push((Instant::now(), event));
    }

    /// The events, in order.
    pub(super) fn events(&self) -> Vec<Event> {
        self.entries().into_iter().map(|(_, e)| e).collect()
    }

    /// The events with their times, in order.
    pub(super) fn entries(&self) -> Vec<(Instant, Event)> {
        self.0.lock().expect("never poisoned").clone()
    }

    /// How many events `is` picks.
    pub(super) fn count(&self, is: impl Fn(&Event) -> bool) -> usize {
        self.events().iter().filter(|e| is(e)).count()
    }

    /// When the events `is` picks happened.
    pub(super) fn times(&self, is: impl Fn(&Event) -> bool) -> Vec<Instant> {
        self.entries()
            .into_iter()
            .filter(|(_, e)| is(e))
            .map(|(at, _)| at)
            .collect()
    }
}

/// What the fake limiter answers to one ask.
#[derive(Debug)]
pub(super) enum Script {
    /// A grant, at once.
    Grant,
    /// A grant that takes `.0` (paused time) to come: the request that made it left when the
    /// ask began, as a real one that waited for Redis or the batcher.
    SlowGrant(Duration),
    /// Wait `.0`, with a slot reserved that far ahead.
    Wait(Duration),
    /// Wait `.0`, nothing reserved.
    WaitUnreserved(Duration),
    /// Registered before.
    AlreadyDone,
    /// No decision.
    Fail(PermitError),
}

/// What the fake limiter keeps between calls.
#[derive(Default)]
struct LimiterState {
    script: VecDeque<Script>,
    calls: u32,
    reservations: u32,
    /// Sellers paused, until when.
    paused: HashMap<String, Instant>,
    /// Finishes of a registration that fail (transiently) before one is written.
    failing_records: u32,
    /// What a 429's finish says: whether it lowered the learned limit.
    lowers: bool,
    /// Whether pauses fail (Redis out of reach).
    pauses_fail: bool,
    /// What [`Limiter::slots_wait_for_answers`] says.
    slots_wait_for_answers: bool,
    /// Whether a grant is counted at its grant only (a global limit): no asking ahead.
    grants_counted_at_grant: bool,
    /// Claims of a call that find it claimed by another copy, before one is ours.
    called_elsewhere: u32,
    /// Claims ended without a call ([`Limiter::unclaim_call`]).
    unclaimed: u32,
    /// Products' messages, as `lua/supersede.lua` keeps them (no reservation taken over).
    products: HashMap<String, FakeProduct>,
}

/// One product's messages in [`FakeLimiter`]: the latest, each message seen with its arrival
/// and version, those whose call started.
#[derive(Default)]
struct FakeProduct {
    latest: Option<String>,
    seen: HashMap<String, (u64, Option<i64>)>,
    started: std::collections::HashSet<String>,
}

impl FakeProduct {
    /// `lua/supersede.lua`'s answer to `step` of `message` (version `version`): `None` to go,
    /// else the latest that superseded it.
    fn step(
        &mut self,
        step: &SupersedeStep<'_>,
        message: &str,
        version: Option<i64>,
    ) -> Option<String> {
        let arrivals = self.seen.len() as u64;
        if self.started.contains(message) {
            return None;
        }
        let latest = self.latest.clone();
        let superseded = match step {
            SupersedeStep::Unstart => {
                self.started.remove(message);
                return None;
            }
            SupersedeStep::Start | SupersedeStep::Reserved(_) => {
                latest.as_deref().is_some_and(|l| l != message)
            }
            SupersedeStep::Arrive => match (self.seen.get(message), &latest) {
                (Some(_), Some(l)) => l != message,
                (Some(_), None) => false,
                (None, None) => false,
                (None, Some(l)) => {
                    // A first sight is the latest arrival: older only by a lower version.
                    let theirs = self.seen[l].1;
                    let older =
                        matches!((version, theirs), (Some(mine), Some(theirs)) if mine < theirs);
                    self.seen
                        .insert(message.to_owned(), (arrivals + 1, version));
                    older
                }
            },
        };
        if superseded {
            return latest;
        }
        self.seen
            .entry(message.to_owned())
            .or_insert((arrivals + 1, version));
        if matches!(step, SupersedeStep::Start) {
            self.started.insert(message.to_owned());
        }
        if !matches!(step, SupersedeStep::Reserved(_)) {
            self.latest = Some(message.to_owned());
        }
        None
    }
}

/// A per-seller limiter that answers asks from a script, in order, keeps Redis time as the
/// paused clock, and notes every call in the journal. As the real limiter's scripts do, and
/// without taking an answer from the script, it tells a seller paused through
/// [`Limiter::pause`] to wait for the pause's end (with a slot reserved there), and a message
/// redeeming its reservation before the slot to wait for it. An ask the script has no answer
/// for fails the test.
pub(super) struct FakeLimiter {
    journal: Journal,
    state: Mutex<LimiterState>,
    /// The instant of Redis time [`Self::EPOCH_US`] (when the fake was made).
    epoch: Instant,
}

impl FakeLimiter {
    /// Redis time when the test began (µs).
    const EPOCH_US: i64 = 1_700_000_000_000_000;

    pub(super) fn new(journal: &Journal, script: impl IntoIterator<Item = Script>) -> Self {
        Self {
            journal: journal.clone(),
            state: Mutex::new(LimiterState {
                script: script.into_iter().collect(),
                ..LimiterState::default()
            }),
            epoch: Instant::now(),
        }
    }

    /// Its slots wait for the answers of the calls that fill their windows (as
    /// sliding-window's do).
    pub(super) fn waiting_for_answers(self) -> Self {
        self.lock().slots_wait_for_answers = true;
        self
    }

    /// The first `n` claims of a call find it claimed by another copy of its message.
    pub(super) fn called_elsewhere(self, n: u32) -> Self {
        self.lock().called_elsewhere = n;
        self
    }

    /// Claims that led to no call ended ([`Limiter::unclaim_call`]) so far.
    pub(super) fn unclaimed(&self) -> u32 {
        self.lock().unclaimed
    }

    /// Its grants are counted at the grant only (as a global limit's are).
    pub(super) fn counting_at_grants(self) -> Self {
        self.lock().grants_counted_at_grant = true;
        self
    }

    /// The first `n` finishes of a registration fail (transiently): its record is written at
    /// the `n + 1`-th.
    /// Records written from now on succeed (after [`Self::failing_records`]).
    pub(super) fn records_succeed(&self) {
        self.lock().failing_records = 0;
    }

    pub(super) fn failing_records(self, n: u32) -> Self {
        self.lock().failing_records = n;
        self
    }

    /// Every 429's finish says it lowered the seller's learned limit.
    pub(super) fn lowering(self) -> Self {
        self.lock().lowers = true;
        self
    }

    /// Every pause fails (Redis out of reach), recording nothing.
    pub(super) fn failing_pauses(self) -> Self {
        self.lock().pauses_fail = true;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LimiterState> {
        self.state.lock().expect("never poisoned")
    }

    /// Redis time now (µs), by the paused clock.
    pub(super) fn redis_now_us(&self) -> i64 {
        self.us_at(Instant::now())
    }

    /// Redis time (µs) at the instant `at`.
    pub(super) fn us_at(&self, at: Instant) -> i64 {
        Self::EPOCH_US + (at - self.epoch).as_micros() as i64
    }

    /// The instant of Redis time `us`.
    pub(super) fn at(&self, us: i64) -> Instant {
        self.epoch + Duration::from_micros((us - Self::EPOCH_US) as u64)
    }

    /// A reservation of a slot `ahead` of now.
    pub(super) fn reservation(&self, ahead: Duration) -> Reservation {
        let now = self.redis_now_us();
        let n = {
            let mut state = self.lock();
            state.reservations += 1;
            state.reservations
        };
        Reservation {
            slot_us: now + ahead.as_micros() as i64,
            limits: "1/1s".parse().expect("a limit"),
            reserved_at_us: now,
            token: format!("r-{n}"),
            cost: None,
        }
    }

    /// A grant named `call-N` (N counting the grants), of the slot `held` if the message came
    /// back with one, whose request left at `sent`.
    fn grant(&self, held: Option<&Reservation>, sent: std::time::Instant) -> Decision {
        let now = self.redis_now_us();
        let n = {
            let mut state = self.lock();
            state.calls += 1;
            state.calls
        };
        Decision::Granted {
            slot_us: held.map_or(now, |r| r.slot_us),
            granted_us: now,
            used_permille: if held.is_some() { 1_000 } else { 500 },
            call: format!("call-{n}"),
            sent,
        }
    }
}

impl Limiter for FakeLimiter {
    fn ask<'a>(&'a self, ask: Ask<'a>) -> BoxFuture<'a, Result<Asked, PermitError>> {
        async move {
            let began = Instant::now();
            self.journal.note(Event::Asked {
                message: ask
                    .message
                    .map(|m| m.as_str().to_owned())
                    .unwrap_or_default(),
                held: ask.held.cloned(),
            });
            let paused = self.lock().paused.get(ask.seller.as_str()).copied();
            if let Some(until) = paused.filter(|until| *until > began) {
                let left = until - began;
                let decision = Decision::Wait {
                    retry_after: left,
                    reservation: Some(self.reservation(left)),
                };
                return Ok(Asked {
                    decision,
                    forfeit: None,
                    cost: ask.cost,
                });
            }
            // A redeem before its slot is told to wait for it (the real redeem answers
            // "early"), keeping its reservation.
            if let Some(held) = ask.held.filter(|r| r.slot_us > self.us_at(began)) {
                let left = Duration::from_micros((held.slot_us - self.us_at(began)) as u64);
                let decision = Decision::Wait {
                    retry_after: left,
                    reservation: Some(held.clone()),
                };
                return Ok(Asked {
                    decision,
                    forfeit: None,
                    cost: ask.cost,
                });
            }
            let script = self.lock().script.pop_front();
            let script = script.unwrap_or_else(|| {
                panic!("the limiter was asked more often than scripted: {ask:?}")
            });
            let decision = match script {
                Script::Grant => self.grant(ask.held, std::time::Instant::now()),
                Script::SlowGrant(took) => {
                    tokio::time::sleep(took).await;
                    // The worker ages a grant by the standard clock, which pausing tokio's
                    // does not touch: the request left `took` ago by the paused clock, so
                    // `sent` is dated back that far on the standard one.
                    let sent = std::time::Instant::now() - began.elapsed();
                    self.grant(ask.held, sent)
                }
                Script::Wait(wait) => Decision::Wait {
                    retry_after: wait,
                    reservation: Some(self.reservation(wait)),
                },
                Script::WaitUnreserved(wait) => Decision::Wait {
                    retry_after: wait,
                    reservation: None,
                },
                Script::AlreadyDone => Decision::AlreadyDone,
                Script::Fail(error) => return Err(error),
            };
            Ok(Asked {
                decision,
                forfeit: None,
                cost: ask.cost,
            })
        }
        .boxed()
    }

    fn answered<'a>(&'a self, grant: &'a Grant) -> BoxFuture<'a, ()> {
        async move {
            self.journal.note(Event::Answered {
                call: grant.call().to_owned(),
            });
        }
        .boxed()
    }

    fn finish<'a>(
        &'a self,
        grant: &'a Grant,
        _answered_us: i64,
        answer: Ended<'a>,
    ) -> BoxFuture<'a, Result<Finished, PermitError>> {
        async move {
            let ended = Finish::from(answer);
            self.journal.note(Event::Finished {
                call: grant.call().to_owned(),
                ended: ended.clone(),
            });
            let mut state = self.lock();
            match ended {
                Finish::Registered { .. } if state.failing_records > 0 => {
                    state.failing_records -= 1;
                    Err(unreachable_redis())
                }
                Finish::Registered { .. } => Ok(Finished {
                    recorded: Some(Recorded {
                        changed: true,
                        ..Recorded::default()
                    }),
                    lowered: false,
                }),
                Finish::Throttled { .. } => Ok(Finished {
                    recorded: None,
                    lowered: state.lowers,
                }),
                Finish::Failed => Ok(Finished::default()),
            }
        }
        .boxed()
    }

    fn claim_call<'a>(
        &'a self,
        _seller: &'a SellerId,
        message: &'a MessageId,
        _token: &'a str,
    ) -> BoxFuture<'a, Result<CallClaim, PermitError>> {
        async move {
            let claim = {
                let mut state = self.lock();
                if state.called_elsewhere > 0 {
                    state.called_elsewhere -= 1;
                    CallClaim::Elsewhere
                } else {
                    CallClaim::Taken
                }
            };
            if claim == CallClaim::Elsewhere {
                self.journal.note(Event::CalledElsewhere {
                    message: message.as_str().to_owned(),
                });
            }
            Ok(claim)
        }
        .boxed()
    }

    fn supersede<'a>(
        &'a self,
        message: &'a ProductMessage<'a>,
        step: SupersedeStep<'a>,
        _held: Option<&'a Reservation>,
    ) -> BoxFuture<'a, Result<Supersession, PermitError>> {
        async move {
            let by = self
                .lock()
                .products
                .entry(message.product.as_str().to_owned())
                .or_default()
                .step(
                    &step,
                    message.message.as_str(),
                    message.version.map(|v| v.get()),
                );
            Ok(match by {
                None => Supersession::Latest { took_over: None },
                Some(by) => Supersession::Superseded {
                    by: MessageId::parse(&by).ok(),
                    reservation_taken: false,
                },
            })
        }
        .boxed()
    }

    fn note_call(&self, _grant: &Grant) {}

    fn renew_claim(&self, _seller: &SellerId, _message: &MessageId) {}

    fn unclaim_call(&self, _seller: &SellerId, _message: &MessageId) {
        self.lock().unclaimed += 1;
    }

    fn unsent(&self, grant: Grant) -> BoxFuture<'_, ()> {
        async move {
            self.journal.note(Event::Unsent {
                call: grant.call().to_owned(),
            });
        }
        .boxed()
    }

    fn pause<'a>(
        &'a self,
        seller: &'a SellerId,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        async move {
            self.journal.note(Event::Paused {
                seller: seller.as_str().to_owned(),
                pause,
            });
            let until = Instant::now() + pause;
            let mut state = self.lock();
            if state.pauses_fail {
                return Err(unreachable_redis());
            }
            let paused = state
                .paused
                .entry(seller.as_str().to_owned())
                .or_insert(until);
            // A pause only extends.
            *paused = (*paused).max(until);
            Ok(())
        }
        .boxed()
    }

    fn unreserve<'a>(
        &'a self,
        seller: &'a SellerId,
        reservation: &'a Reservation,
        _cost: Cost,
        _route: Option<&'a Arc<crate::routes::Route>>,
    ) -> BoxFuture<'a, Result<bool, PermitError>> {
        async move {
            self.journal.note(Event::Unreserved {
                seller: seller.as_str().to_owned(),
                token: reservation.token.clone(),
            });
            Ok(true)
        }
        .boxed()
    }

    fn recost<'a>(&'a self, grant: &'a Grant, actual: u32) -> BoxFuture<'a, ()> {
        async move {
            self.journal.note(Event::Recosted {
                call: grant.call().to_owned(),
                actual,
            });
        }
        .boxed()
    }

    fn now_us(&self) -> Option<i64> {
        Some(self.redis_now_us())
    }

    fn shortest_window(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn slots_wait_for_answers(&self) -> bool {
        self.lock().slots_wait_for_answers
    }

    fn grants_may_wait(&self) -> bool {
        !self.lock().grants_counted_at_grant
    }
}

/// What the fake API answers to one call.
#[derive(Clone, Debug)]
pub(super) enum Answer {
    /// 201 `{"product_id":7}`, with the rate-limit headers `told`.
    Created { told: Option<RateLimitHeaders> },
    /// 201 `{"product_id":7}`, whose cost header says the call cost `actual`.
    CreatedCosting { actual: u32 },
    /// 429, with its Retry-After and rate-limit headers.
    TooMany {
        retry_after: Option<Duration>,
        told: Option<RateLimitHeaders>,
    },
    /// 503 `down for maintenance`.
    Unavailable,
    /// 400 `missing title`.
    BadRequest,
}

impl Answer {
    /// The answer a 201 carries in the message's result.
    pub(super) fn created_response() -> ApiResponse {
        ApiResponse::new(201, br#"{"product_id":7}"#, false)
    }

    /// The answer a 503 carries in the message's result.
    pub(super) fn unavailable_response() -> ApiResponse {
        ApiResponse::new(503, b"down for maintenance", false)
    }

    /// The answer a 400 carries in the message's result.
    pub(super) fn bad_request_response() -> ApiResponse {
        ApiResponse::new(400, b"missing title", false)
    }

    /// As `downstream::classify` reads it.
    fn answered(self) -> Answered {
        match self {
            Answer::Created { told } => Answered {
                reply: Reply::Registered(Self::created_response()),
                rate_limit: told,
                cost: None,
            },
            Answer::CreatedCosting { actual } => Answered {
                reply: Reply::Registered(Self::created_response()),
                rate_limit: None,
                cost: Some(actual),
            },
            Answer::TooMany { retry_after, told } => Answered {
                reply: Reply::Throttled { retry_after },
                rate_limit: told,
                cost: None,
            },
            Answer::Unavailable => Answered {
                reply: Reply::Transient {
                    why: "HTTP 503".into(),
                    response: Some(Self::unavailable_response()),
                },
                rate_limit: None,
                cost: None,
            },
            Answer::BadRequest => Answered {
                reply: Reply::Rejected {
                    status: 400,
                    body: "missing title".into(),
                    response: Some(Self::bad_request_response()),
                },
                rate_limit: None,
                cost: None,
            },
        }
    }
}

/// The registration API, answering calls from a script in order (a call the script has no
/// answer for fails the test) after `latency` of paused time, and refusing to name the
/// sellers it is told to refuse.
pub(super) struct FakeApi {
    journal: Journal,
    script: Mutex<VecDeque<Answer>>,
    latency: Duration,
    unnamable: Vec<String>,
}

impl FakeApi {
    pub(super) fn new(journal: &Journal, script: impl IntoIterator<Item = Answer>) -> Self {
        Self {
            journal: journal.clone(),
            script: Mutex::new(script.into_iter().collect()),
            latency: Duration::from_millis(40),
            unnamable: Vec::new(),
        }
    }

    /// A seller the API's URL cannot name ([`Api::check_seller`] refuses it).
    pub(super) fn refusing(mut self, seller: &str) -> Self {
        self.unnamable.push(seller.to_owned());
        self
    }

    /// How long each call takes (paused time).
    pub(super) fn latency(&self) -> Duration {
        self.latency
    }
}

impl Api for FakeApi {
    fn check_seller(&self, seller: &SellerId) -> Result<(), String> {
        if self.unnamable.iter().any(|s| s == seller.as_str()) {
            return Err(format!(
                "seller_id {:?} cannot be one path segment of TURNSTILE_DOWNSTREAM_URL",
                seller.as_str()
            ));
        }
        Ok(())
    }

    fn call<'a>(
        &'a self,
        registration: &'a Registration,
        _trace: &'a TraceContext,
    ) -> BoxFuture<'a, Answered> {
        async move {
            self.journal.note(Event::Called {
                message: registration.message_id.as_str().to_owned(),
            });
            let answer = self.script.lock().expect("never poisoned").pop_front();
            let answer = answer.unwrap_or_else(|| {
                panic!(
                    "the API was called more often than scripted: {} {:?}",
                    registration.message_id.as_str(),
                    self.journal.events()
                )
            });
            tokio::time::sleep(self.latency).await;
            answer.answered()
        }
        .boxed()
    }
}

/// The results exchange: notes every result and event published (all confirmed).
pub(super) struct FakeResults {
    journal: Journal,
    /// The results' bodies, as JSON, in order.
    bodies: Mutex<Vec<serde_json::Value>>,
}

impl FakeResults {
    pub(super) fn new(journal: &Journal) -> Self {
        Self {
            journal: journal.clone(),
            bodies: Mutex::default(),
        }
    }

    /// The bodies of the results published, in order.
    pub(super) fn bodies(&self) -> Vec<serde_json::Value> {
        self.bodies.lock().expect("never poisoned").clone()
    }
}

impl ResultSink for FakeResults {
    fn publish_result<'a>(
        &'a self,
        outcome: &'a str,
        _message_id: Option<&'a str>,
        body: &'a [u8],
        _reply: &'a ReplyTo,
    ) -> BoxFuture<'a, Result<bool, PublishError>> {
        async move {
            self.journal.note(Event::Published {
                outcome: outcome.to_owned(),
            });
            let body = serde_json::from_slice(body).expect("a result is JSON");
            self.bodies.lock().expect("never poisoned").push(body);
            Ok(true)
        }
        .boxed()
    }

    fn publish_event<'a>(
        &'a self,
        batch_id: &'a str,
        _body: &'a [u8],
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        async move {
            self.journal.note(Event::BatchCompleted {
                batch: batch_id.to_owned(),
            });
            Ok(())
        }
        .boxed()
    }
}

/// The uploads' records: notes every call and keeps nothing (no batch is ever complete) but
/// the results given to [`FakeProgress::keep_result`].
pub(super) struct FakeProgress {
    journal: Journal,
    /// Results kept in registered messages' records, by message id.
    kept: Mutex<std::collections::HashMap<String, String>>,
    /// The messages whose records say registered, by id.
    registered: Mutex<std::collections::HashSet<String>>,
}

impl FakeProgress {
    pub(super) fn new(journal: &Journal) -> Self {
        Self {
            journal: journal.clone(),
            kept: Mutex::default(),
            registered: Mutex::default(),
        }
    }

    /// A registered message (its result published).
    pub(super) fn register(&self, message: &str) {
        let mut registered = self.registered.lock().expect("never poisoned");
        registered.insert(message.to_owned());
    }

    /// A registered message whose record keeps its result, unpublished.
    pub(super) fn keep_result(&self, message: &str, result: &str) {
        self.register(message);
        let mut kept = self.kept.lock().expect("never poisoned");
        kept.insert(message.to_owned(), result.to_owned());
    }

    /// Whether the record of `message` still keeps its result.
    pub(super) fn keeps_result(&self, message: &str) -> bool {
        self.kept
            .lock()
            .expect("never poisoned")
            .contains_key(message)
    }
}

impl Progress for FakeProgress {
    fn batch_seen<'a>(
        &'a self,
        _seller: &'a SellerId,
        _batch: &'a BatchId,
        _size: Option<BatchSize>,
        _ttl: Duration,
        _rows_per_call: u32,
    ) -> BoxFuture<'a, Result<BatchSeen, PermitError>> {
        self.journal.note(Event::Progress("batch_seen"));
        futures::future::ready(Ok(BatchSeen {
            event: None,
            sellers: 1,
            orphans: Vec::new(),
        }))
        .boxed()
    }

    fn dead_in_batch<'a>(
        &'a self,
        _seller: &'a SellerId,
        _message: &'a MessageId,
        _batch: InBatch<'a>,
        _reason: &'static str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Recorded, PermitError>> {
        self.journal.note(Event::Progress("dead_in_batch"));
        futures::future::ready(Ok(Recorded::default())).boxed()
    }

    fn dead<'a>(
        &'a self,
        _identity: &'a Identity,
        _reason: &'static str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<(SellerId, BatchEvent)>, PermitError>> {
        self.journal.note(Event::Progress("dead"));
        futures::future::ready(Ok(None)).boxed()
    }

    fn adopt_orphans<'a>(
        &'a self,
        _seller: &'a SellerId,
        _batch: &'a BatchId,
        _orphans: &'a [Orphan],
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<BatchEvent>, PermitError>> {
        self.journal.note(Event::Progress("adopt_orphans"));
        futures::future::ready(Ok(None)).boxed()
    }

    fn pending_event<'a>(
        &'a self,
        _seller: &'a SellerId,
        _batch: &'a BatchId,
    ) -> BoxFuture<'a, Result<Option<BatchEvent>, PermitError>> {
        self.journal.note(Event::Progress("pending_event"));
        futures::future::ready(Ok(None)).boxed()
    }

    fn pending_result<'a>(
        &'a self,
        _seller: &'a SellerId,
        message: &'a MessageId,
    ) -> BoxFuture<'a, Result<Option<String>, PermitError>> {
        self.journal.note(Event::Progress("pending_result"));
        let kept = self.kept.lock().expect("never poisoned");
        futures::future::ready(Ok(kept.get(message.as_str()).cloned())).boxed()
    }

    fn is_registered<'a>(
        &'a self,
        _seller: &'a SellerId,
        message: &'a MessageId,
    ) -> BoxFuture<'a, Result<bool, PermitError>> {
        let registered = self.registered.lock().expect("never poisoned");
        futures::future::ready(Ok(registered.contains(message.as_str()))).boxed()
    }

    fn result_published(&self, _seller: &SellerId, message: &MessageId) {
        self.journal.note(Event::Progress("result_published"));
        self.kept
            .lock()
            .expect("never poisoned")
            .remove(message.as_str());
    }

    fn batch_progress<'a>(
        &'a self,
        _seller: &'a SellerId,
        _batch: &'a BatchId,
    ) -> BoxFuture<'a, Result<Option<UploadProgress>, PermitError>> {
        self.journal.note(Event::Progress("batch_progress"));
        futures::future::ready(Ok(None)).boxed()
    }

    fn event_sent<'a>(
        &'a self,
        _seller: &'a SellerId,
        _batch: &'a BatchId,
        _event: BatchEvent,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        self.journal.note(Event::Progress("event_sent"));
        futures::future::ready(Ok(())).boxed()
    }

    fn retry_due<'a>(
        &'a self,
        _seller: &'a SellerId,
        _message: &'a MessageId,
        _batch: &'a BatchId,
        _cost: Cost,
        _delay: Duration,
    ) -> BoxFuture<'a, Result<(), PermitError>> {
        self.journal.note(Event::Progress("retry_due"));
        futures::future::ready(Ok(())).boxed()
    }
}

impl Worker {
    /// A worker of 4 workers (and a due lane of 1) with [`settings`], on a quorum queue
    /// `orders`, reaching its adapters through `limiter`, `progress` and `downstream` (as
    /// `replica::new_worker` builds one).
    pub(super) fn for_test(
        limiter: Arc<dyn Limiter>,
        progress: Arc<dyn Progress>,
        downstream: Arc<dyn Api>,
    ) -> Self {
        let (reschedules, _) = tokio::sync::broadcast::channel(16);
        let workers = 4;
        Worker {
            limiter,
            progress,
            downstream,
            routes: Arc::default(),
            topology: Topology::new("orders", QueueType::Quorum),
            settings: settings(),
            workers: Arc::new(Semaphore::new(workers)),
            due_lane: Arc::new(Semaphore::new((workers / 4).max(1))),
            ask_ahead: super::ahead::AskAhead::new(workers),
            stats: Arc::default(),
            reschedules,
            terms: tokio::sync::watch::channel(Default::default()).1,
            records_in_writing: Default::default(),
            seller_waits: Default::default(),
            seen_batches: Default::default(),
            links: Default::default(),
            records_later: Default::default(),
            gathers: Default::default(),
        }
    }
}

impl Reporting {
    /// Where `registration`'s result goes in a test: `results`, no `reply_to`.
    pub(super) fn for_test(results: Arc<dyn ResultSink>, registration: &Registration) -> Self {
        Self {
            results,
            reply: ReplyTo::default(),
            identity: Identity::from(registration),
            batch_size: registration.batch_size,
            cost: registration.cost,
            first_seen_ms: crate::domain::unix_ms(),
        }
    }
}

/// A worker over fresh fakes sharing one journal, and the tokens that may interrupt it.
pub(super) struct Harness {
    pub(super) journal: Journal,
    pub(super) limiter: Arc<FakeLimiter>,
    pub(super) api: Arc<FakeApi>,
    pub(super) results: Arc<FakeResults>,
    pub(super) progress: Arc<FakeProgress>,
    pub(super) worker: Worker,
    pub(super) shutdown: CancellationToken,
    pub(super) connection_lost: CancellationToken,
}

impl Harness {
    /// A worker whose limiter answers `asks` and whose API answers `answers`, in order.
    pub(super) fn new(
        asks: impl IntoIterator<Item = Script>,
        answers: impl IntoIterator<Item = Answer>,
    ) -> Self {
        Self::with(|journal| {
            (
                FakeLimiter::new(journal, asks),
                FakeApi::new(journal, answers),
            )
        })
    }

    /// A worker over the limiter and API that `fakes` makes (on the shared journal).
    pub(super) fn with(fakes: impl FnOnce(&Journal) -> (FakeLimiter, FakeApi)) -> Self {
        let journal = Journal::default();
        let (limiter, api) = fakes(&journal);
        let (limiter, api) = (Arc::new(limiter), Arc::new(api));
        let results = Arc::new(FakeResults::new(&journal));
        let progress = Arc::new(FakeProgress::new(&journal));
        let worker = Worker::for_test(limiter.clone(), progress.clone(), api.clone());
        Self {
            journal,
            limiter,
            api,
            results,
            progress,
            worker,
            shutdown: CancellationToken::new(),
            connection_lost: CancellationToken::new(),
        }
    }

    /// Decides `registration`, delivered carrying `carried`, as [`Worker::process`] does
    /// before it settles the delivery.
    pub(super) async fn handle(&self, registration: &Registration, carried: Carried) -> Outcome {
        let reporting = Reporting::for_test(self.results.clone(), registration);
        let interruptions = Interruptions {
            shutdown: &self.shutdown,
            connection_lost: &self.connection_lost,
        };
        let trace = TraceContext::start();
        self.worker
            .handle(registration, &trace, carried, &reporting, interruptions)
            .await
    }

    /// What [`Worker::process`] settles `registration` with when it was decided as `outcome`.
    pub(super) async fn unless_registered(
        &self,
        registration: &Registration,
        outcome: Outcome,
    ) -> Outcome {
        let reporting = Reporting::for_test(self.results.clone(), registration);
        let interruptions = Interruptions {
            shutdown: &self.shutdown,
            connection_lost: &self.connection_lost,
        };
        self.worker
            .unless_registered(outcome, &reporting, interruptions)
            .await
    }

    /// What [`Worker::settle`] does before it acks a copy of a message registered before:
    /// `false` if the copy must go back unacked.
    pub(super) async fn report_already_done(&self, registration: &Registration) -> bool {
        let reporting = Reporting::for_test(self.results.clone(), registration);
        let interruptions = Interruptions {
            shutdown: &self.shutdown,
            connection_lost: &self.connection_lost,
        };
        self.worker
            .report_already_done(&reporting, interruptions)
            .await
    }
}
