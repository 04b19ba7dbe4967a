//! Group commit for the limiter's hot operations: what a replica's workers ask of Redis at the
//! same moment goes in one `lua/batch.lua` call instead of one call each.
//!
//! An [`Operation`] (acquire, redeem, complete, ended, learn, ..., or a plain command) is sent
//! either at once
//! ([`When::Now`]) or [`When::Within`] a delay, riding along with the next call that goes to
//! the same place anyway. Operations go together only where one script may touch all their
//! keys: on standalone Redis that is any operations; on Redis Cluster, one seller's (its hash
//! tag, so one slot). Per place, at most [`MOST_IN_FLIGHT`] calls are in flight that left
//! within the last [`YOUNG`]; what arrives meanwhile waits for the next one, so a lone operation
//! is sent at once and a busy replica sends fewer, fuller calls. A call out longer than that
//! (a slow link, a busy Redis) no longer holds the next back, up to [`MOST_OUT`] in flight: an
//! operation waits for the batcher at most about [`YOUNG`], not a round trip. A rider waits at
//! most its delay, and only while fewer than [`MOST_RIDERS_WAITING`] wait: the completion records, which must only be written before the
//! message is acked, cost nearly nothing while the replica is busy (see docs/performance.md, "Redis calls
//! per message").
//!
//! A call that fails (connection, timeout) fails every operation in it with the same error; an
//! operation that raised an error (a script's refusal) fails alone.
//!
//! An operation nobody waits for ([`Batcher::send_detached`], such as a result's trim from its
//! completion record, whose failure only leaves the result kept) takes no task and no reply
//! channel, and holds no rider's place: it goes with the next call to its place, or after its
//! delay; at most [`MOST_DETACHED_WAITING`] wait, and one beyond them is sent at once.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::permit::conn::RedisConn;
use crate::permit::error::PermitError;
use crate::permit::keys::hash_tag;
use crate::permit::scripts;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use redis::{ToRedisArgs, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// Calls in flight at once per place (per Redis, or per seller on Redis Cluster) that left
/// within the last [`YOUNG`].
pub const MOST_IN_FLIGHT: usize = 2;
/// How long a call in flight holds the next call to its place back: on a Redis close by, calls
/// are answered well within it, and what arrives meanwhile rides in the next one; through a
/// slow link, what arrives waits this long, not a round trip.
pub const YOUNG: Duration = Duration::from_millis(20);
/// Calls in flight at once per place at most, however long they take.
pub const MOST_OUT: usize = 16;
/// Operations in one call at most (`lua/batch.lua` takes up to 256).
pub const MOST_PER_CALL: usize = 64;
/// Riders waiting at once at most: each holds a message unacked (its prefetch slot), so when
/// rides are rare (one seller's calls on Redis Cluster, many sellers) a rider beyond these is
/// sent at once, as if it had to go now.
pub const MOST_RIDERS_WAITING: usize = 32;
/// Detached operations (see [`Batcher::send_detached`]) waiting at once at most: they hold no
/// message, so only memory bounds them.
pub const MOST_DETACHED_WAITING: usize = 4096;

/// One operation of `lua/batch.lua` (a script's name, its keys and its arguments), or a plain
/// command sent in the same round (a pipeline beside the script call).
#[derive(Debug)]
pub struct Operation {
    name: &'static str,
    keys: Vec<String>,
    args: Vec<Vec<u8>>,
    /// Plain commands instead of a script operation (answered as one array, one answer each).
    plain: Option<Vec<redis::Cmd>>,
}

impl Operation {
    /// An operation of the script `name` (see `lua/batch.lua` for the names).
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            keys: Vec::with_capacity(11),
            args: Vec::with_capacity(12),
            plain: None,
        }
    }

    /// Plain commands on keys of one hash tag (`key` is one of them): what needs no script
    /// costs Redis far less as commands of its own. Answered as an array, one answer per
    /// command, or the first command's error.
    pub fn commands(commands: Vec<redis::Cmd>, key: String) -> Self {
        Self {
            name: "commands",
            keys: vec![key],
            args: Vec::new(),
            plain: Some(commands),
        }
    }

    pub fn key(&mut self, key: String) -> &mut Self {
        self.keys.push(key);
        self
    }

    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// Where it may go with others: its keys' hash tag on Redis Cluster (every key of an
    /// operation carries its seller's), anywhere on standalone Redis.
    fn place(&self, cluster: bool) -> String {
        if !cluster {
            return String::new();
        }
        self.keys
            .first()
            .map(|k| hash_tag(k).to_owned())
            .unwrap_or_default()
    }
}

/// When an operation must be sent.
#[derive(Clone, Copy, Debug)]
pub enum When {
    /// At once (with whatever else is waiting for the same place).
    Now,
    /// With the next call to the same place, and at the latest after this long.
    Within(Duration),
}

struct Request {
    operation: Operation,
    /// `None`: now.
    deadline: Option<Instant>,
    /// `None`: detached, nobody waits for its answer.
    reply: Option<oneshot::Sender<Answered>>,
}

impl Request {
    /// Hands the operation its answer, if anybody waits for it.
    fn answer(self, answered: Answered) {
        answer(self.reply, answered);
    }

    /// Whoever waited for the answer gave up (a detached operation is never given up).
    fn given_up(&self) -> bool {
        self.reply.as_ref().is_some_and(|r| r.is_closed())
    }

    /// A rider that holds a message unacked (counted against [`MOST_RIDERS_WAITING`]).
    fn holds_a_message(&self) -> bool {
        self.deadline.is_some() && self.reply.is_some()
    }

    /// A detached rider (counted against [`MOST_DETACHED_WAITING`]).
    fn detached_rider(&self) -> bool {
        self.deadline.is_some() && self.reply.is_none()
    }
}

/// Hands an answer to whoever waits for it, if anybody does.
fn answer(reply: Option<oneshot::Sender<Answered>>, answered: Answered) {
    if let Some(reply) = reply {
        let _ = reply.send(answered);
    }
}

/// An operation's answer, and when the call that carried it left this replica: whatever Redis
/// did for it (a grant) happened after that moment.
pub type Answered = (Result<Value, PermitError>, Instant);

/// Sends operations in batches; cheap to share. Its task ends once every handle is dropped,
/// after sending what still waits.
pub struct Batcher {
    requests: mpsc::UnboundedSender<Request>,
    calls: Arc<AtomicU64>,
}

impl Batcher {
    /// Starts the task that sends batches over `conn` (must be called within a Tokio runtime).
    pub fn start(conn: RedisConn) -> Self {
        let cluster = matches!(conn, RedisConn::Cluster(_));
        // Unbounded: what waits here is bounded by the callers (a replica's workers and
        // prefetch), each waiting for its own answer.
        let (requests, receiver) = mpsc::unbounded_channel();
        let calls = Arc::new(AtomicU64::new(0));
        tokio::spawn(serve(conn, cluster, receiver, calls.clone()));
        Self { requests, calls }
    }

    /// Calls sent to Redis so far (each with one or more operations).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Runs `operation` (in a batch, see the module) and returns its own answer, with when the
    /// call that carried it was sent (now, if it never was).
    pub async fn run_sent(&self, operation: Operation, when: When) -> Answered {
        let (reply, answer) = oneshot::channel();
        let deadline = match when {
            When::Now => None,
            When::Within(delay) => Some(Instant::now() + delay),
        };
        let request = Request {
            operation,
            deadline,
            reply: Some(reply),
        };
        if self.requests.send(request).is_err() {
            return (Err(stopped()), Instant::now());
        }
        answer
            .await
            .unwrap_or_else(|_| (Err(stopped()), Instant::now()))
    }

    /// Sends `operation` with the next call to its place, within `delay`, and forgets it: its
    /// answer, error included, is dropped. For what needs no answer and whose loss costs
    /// nothing but what it would have saved.
    pub fn send_detached(&self, operation: Operation, delay: Duration) {
        let request = Request {
            operation,
            deadline: Some(Instant::now() + delay),
            reply: None,
        };
        let _ = self.requests.send(request);
    }
}

/// The batcher's task is gone (it only stops once every handle is dropped): like a lost
/// connection, worth asking again.
fn stopped() -> PermitError {
    PermitError::Redis(redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "the batcher stopped",
    )))
}

/// What waits for one place.
#[derive(Default)]
struct Place {
    now: VecDeque<Request>,
    /// Riders, in the order they came, which is the order of their deadlines: every rider of
    /// a batcher waits the same delay (a store's [`super::record_delay`]).
    riders: VecDeque<Request>,
    /// When each call in flight left, oldest first.
    out: VecDeque<Instant>,
    /// The wake-up asked for when the next call waits for a young one to age (see
    /// [`Place::ages_at`]), so that it is asked once.
    wake: Option<Instant>,
}

impl Place {
    fn rider_due(&self, now: Instant) -> bool {
        self.riders
            .front()
            .is_some_and(|r| r.deadline.is_none_or(|d| d <= now))
    }

    fn due(&self, now: Instant, closing: bool) -> bool {
        !self.now.is_empty() || self.rider_due(now) || (closing && !self.riders.is_empty())
    }

    /// The calls in flight that left within [`YOUNG`] of `now`, oldest first.
    fn young(&self, now: Instant) -> impl Iterator<Item = &Instant> {
        self.out
            .iter()
            .filter(move |left| now.saturating_duration_since(**left) < YOUNG)
    }

    /// When a call due now but held back by the young calls in flight may go (the oldest of
    /// them has aged); `None` if it is not held back by them.
    fn ages_at(&self, now: Instant, closing: bool) -> Option<Instant> {
        if !self.due(now, closing) || self.out.len() >= MOST_OUT {
            return None;
        }
        if self.young(now).count() < MOST_IN_FLIGHT {
            return None;
        }
        self.young(now).next().map(|left| *left + YOUNG)
    }

    /// A call that left at `left` was answered.
    fn answered(&mut self, left: Instant) {
        if let Some(i) = self.out.iter().position(|at| *at == left) {
            self.out.remove(i);
        }
    }

    /// The next call's operations: every one waiting to go now, then riders, up to
    /// [`MOST_PER_CALL`]; `None` when nothing is due (or too many calls are in flight).
    fn next_call(&mut self, now: Instant, closing: bool) -> Option<Vec<Request>> {
        if !self.due(now, closing)
            || self.out.len() >= MOST_OUT
            || self.young(now).count() >= MOST_IN_FLIGHT
        {
            return None;
        }
        let mut call: Vec<Request> = Vec::new();
        while call.len() < MOST_PER_CALL
            && let Some(r) = self.now.pop_front()
        {
            // A caller that gave up (shutdown, a lost connection) would never use the answer:
            // a grant or a reservation sent for it would only hold the seller's capacity.
            if !r.given_up() {
                call.push(r);
            }
        }
        while call.len() < MOST_PER_CALL
            && let Some(r) = self.riders.pop_front()
        {
            call.push(r);
        }
        if call.is_empty() {
            return None;
        }
        self.out.push_back(now);
        Some(call)
    }

    fn idle(&self) -> bool {
        self.now.is_empty() && self.riders.is_empty() && self.out.is_empty()
    }
}

async fn serve(
    conn: RedisConn,
    cluster: bool,
    mut receiver: mpsc::UnboundedReceiver<Request>,
    calls: Arc<AtomicU64>,
) {
    let mut places: HashMap<String, Place> = HashMap::new();
    let mut deadlines: BinaryHeap<Reverse<(Instant, String)>> = BinaryHeap::new();
    // The calls in flight run here, polled with the rest (a task each would cost a wake-up and
    // a hop back for every call); each yields its place when it is answered.
    let mut in_flight = FuturesUnordered::new();
    let mut riders_waiting = 0;
    let mut detached_waiting = 0;
    let mut open = true;
    loop {
        if !open && places.is_empty() && in_flight.is_empty() {
            break;
        }
        let next_deadline = deadlines.peek().map(|Reverse((at, _))| *at);
        let mut touched: Vec<String> = Vec::new();
        tokio::select! {
            request = receiver.recv(), if open => match request {
                Some(request) => {
                    let mut request = Some(request);
                    // Whatever else is already waiting goes in the same round.
                    while let Some(r) = request.take().or_else(|| receiver.try_recv().ok()) {
                        let place = r.operation.place(cluster);
                        let entry = places.entry(place.clone()).or_default();
                        let room = if r.reply.is_none() {
                            detached_waiting < MOST_DETACHED_WAITING
                        } else {
                            riders_waiting < MOST_RIDERS_WAITING
                        };
                        match r.deadline {
                            Some(at) if room => {
                                deadlines.push(Reverse((at, place.clone())));
                                riders_waiting += usize::from(r.holds_a_message());
                                detached_waiting += usize::from(r.detached_rider());
                                entry.riders.push_back(r);
                            }
                            _ => entry.now.push_back(Request { deadline: None, ..r }),
                        }
                        touched.push(place);
                    }
                }
                None => {
                    open = false;
                    touched.extend(places.keys().cloned());
                }
            },
            Some((place, left)) = in_flight.next(), if !in_flight.is_empty() => {
                if let Some(p) = places.get_mut(&place) {
                    p.answered(left);
                }
                touched.push(place);
            },
            _ = sleep_until(next_deadline), if next_deadline.is_some() => {
                let now = Instant::now();
                while let Some(Reverse((at, _))) = deadlines.peek()
                    && *at <= now
                {
                    let Reverse((_, place)) = deadlines.pop().expect("peeked");
                    touched.push(place);
                }
            },
        }
        let now = Instant::now();
        touched.sort_unstable();
        touched.dedup();
        for place in touched {
            let Some(p) = places.get_mut(&place) else {
                continue;
            };
            while let Some(call) = p.next_call(now, !open) {
                riders_waiting -= call.iter().filter(|r| r.holds_a_message()).count();
                detached_waiting -= call.iter().filter(|r| r.detached_rider()).count();
                calls.fetch_add(1, Ordering::Relaxed);
                in_flight.push(send(conn.clone(), place.clone(), call, now));
            }
            if let Some(at) = p.ages_at(now, !open)
                && p.wake.is_none_or(|wake| wake <= now || wake > at)
            {
                p.wake = Some(at);
                deadlines.push(Reverse((at, place.clone())));
            }
            if p.idle() {
                places.remove(&place);
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sends one call (the script operations in one script call, the plain commands in one
/// pipeline beside it) and hands each operation its answer; returns the place it went to and
/// `left`, when it was counted in flight there.
async fn send(
    conn: RedisConn,
    place: String,
    call: Vec<Request>,
    left: Instant,
) -> (String, Instant) {
    let sent = Instant::now();
    let (plain, mut scripted): (Vec<Request>, Vec<Request>) =
        call.into_iter().partition(|r| r.operation.plain.is_some());
    let scripts = async {
        if scripted.len() == 1
            && let Some(script) = scripts::operation(scripted[0].operation.name)
        {
            let r = scripted.pop().expect("one");
            let answered = send_alone(conn.clone(), script, &r.operation).await;
            r.answer((answered, sent));
        } else if !scripted.is_empty() {
            send_batch(conn.clone(), scripted, sent).await;
        }
    };
    futures::join!(scripts, send_plain(conn.clone(), plain, sent));
    (place, left)
}

/// Plain commands in one pipeline; each operation gets its own answers (or its own error).
async fn send_plain(mut conn: RedisConn, call: Vec<Request>, sent: Instant) {
    if call.is_empty() {
        return;
    }
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    let mut replies = Vec::with_capacity(call.len());
    for r in call {
        if let Some(commands) = r.operation.plain {
            replies.push((r.reply, commands.len()));
            for command in commands {
                pipe.add_command(command);
            }
        }
    }
    let expected: usize = replies.iter().map(|(_, n)| n).sum();
    let answered: Result<Vec<redis::RedisResult<Value>>, redis::RedisError> =
        pipe.query_async(&mut conn).await;
    match answered {
        Ok(answers) if answers.len() == expected => {
            let mut answers = answers.into_iter();
            for (reply, n) in replies {
                let own: Result<Vec<Value>, redis::RedisError> = answers.by_ref().take(n).collect();
                answer(
                    reply,
                    (own.map(Value::Array).map_err(PermitError::Redis), sent),
                );
            }
        }
        Ok(_) => {
            for (reply, _) in replies {
                answer(reply, (Err(PermitError::Answer("pipeline")), sent));
            }
        }
        Err(error) => {
            for (reply, _) in replies {
                answer(reply, (Err(PermitError::Redis(error.clone())), sent));
            }
        }
    }
}

/// One operation alone, by its own script.
async fn send_alone(
    mut conn: RedisConn,
    script: &'static redis::Script,
    op: &Operation,
) -> Result<Value, PermitError> {
    let mut invocation = script.prepare_invoke();
    for key in &op.keys {
        invocation.key(key);
    }
    for arg in &op.args {
        invocation.arg(arg.as_slice());
    }
    let answer: Value = invocation.invoke_async(&mut conn).await?;
    Ok(answer)
}

async fn send_batch(mut conn: RedisConn, call: Vec<Request>, sent: Instant) {
    let mut invocation = scripts::batch().prepare_invoke();
    invocation.arg(call.len());
    for r in &call {
        let op = &r.operation;
        for key in &op.keys {
            invocation.key(key);
        }
        invocation
            .arg(op.name)
            .arg(op.keys.len())
            .arg(op.args.len());
        for arg in &op.args {
            invocation.arg(arg.as_slice());
        }
    }
    let answered: Result<Value, redis::RedisError> = invocation.invoke_async(&mut conn).await;
    match answered.map(|v| answers(v, call.len())) {
        Ok(Some(answers)) => {
            for (r, answered) in call.into_iter().zip(answers) {
                r.answer((answered, sent));
            }
        }
        Ok(None) => {
            for r in call {
                r.answer((Err(PermitError::Answer("batch")), sent));
            }
        }
        Err(error) => {
            for r in call {
                r.answer((Err(PermitError::Redis(error.clone())), sent));
            }
        }
    }
}

/// Each operation's answer in a batch's reply (`None` if the reply is not one per operation).
fn answers(reply: Value, n: usize) -> Option<Vec<Result<Value, PermitError>>> {
    let Value::Array(entries) = reply else {
        return None;
    };
    if entries.len() != n {
        return None;
    }
    entries
        .into_iter()
        .map(|entry| {
            let Value::Array(mut pair) = entry else {
                return None;
            };
            if pair.len() != 2 {
                return None;
            }
            let answer = pair.pop().expect("two");
            match pair.pop().expect("two") {
                Value::Int(1) => Some(Ok(answer)),
                Value::Int(0) => {
                    let why: String = redis::from_redis_value(answer).ok()?;
                    Some(Err(PermitError::Refused(why)))
                }
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Detached operations, more than may wait at once, each sent (those beyond the bound at
    /// once), with no one waiting for them, on the tests' Redis.
    #[tokio::test]
    async fn every_detached_operation_reaches_redis_even_beyond_those_that_may_wait() {
        let url = std::env::var("TURNSTILE_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let client = redis::Client::open(url).expect("the tests' Redis URL");
        let manager = redis::aio::ConnectionManager::new(client)
            .await
            .expect("the tests' Redis");
        let conn = RedisConn::Single(manager.clone());
        let batcher = Batcher::start(conn);
        let prefix = format!(
            "batch-detached-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let n = MOST_DETACHED_WAITING + 100;
        let keys: Vec<String> = (0..n).map(|i| format!("{prefix}:{i}")).collect();
        for key in &keys {
            let mut set = redis::cmd("SET");
            set.arg(key).arg("x").arg("PX").arg(60_000);
            batcher.send_detached(
                Operation::commands(vec![set], key.clone()),
                Duration::from_millis(20),
            );
        }
        // `command` (EXISTS, DEL) over every key, a thousand at a time: the keys it counted.
        let mut check = manager.clone();
        let mut over_keys = async |command: &str| {
            let mut counted = 0;
            for chunk in keys.chunks(1000) {
                let n: usize = redis::cmd(command)
                    .arg(chunk)
                    .query_async(&mut check)
                    .await
                    .expect("Redis answers");
                counted += n;
            }
            counted
        };
        let mut written = 0;
        for _ in 0..600 {
            written = over_keys("EXISTS").await;
            if written == n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        over_keys("DEL").await;
        assert_eq!(written, n, "every detached operation was sent");
    }

    #[test]
    fn answers_are_one_per_operation_or_none() {
        let ok = Value::Array(vec![Value::Int(1), Value::Int(7)]);
        let refused = Value::Array(vec![
            Value::Int(0),
            Value::BulkString(b"ERR turnstile: no".to_vec()),
        ]);
        let got = answers(Value::Array(vec![ok.clone(), refused]), 2).expect("two answers");
        assert!(matches!(got[0], Ok(Value::Int(7))));
        assert!(matches!(&got[1], Err(PermitError::Refused(why)) if why == "ERR turnstile: no"));
        assert!(answers(Value::Array(vec![ok.clone()]), 2).is_none());
        assert!(answers(Value::Int(1), 1).is_none());
        assert!(
            answers(
                Value::Array(vec![Value::Array(vec![Value::Int(2), Value::Nil])]),
                1
            )
            .is_none()
        );
    }

    #[test]
    fn a_call_out_longer_than_young_holds_the_next_back_no_more() {
        let (reply, _answer) = oneshot::channel();
        let now = Instant::now();
        let mut place = Place::default();
        place.now.push_back(Request {
            operation: Operation::new("ended"),
            deadline: None,
            reply: Some(reply),
        });
        place.out.extend([now - YOUNG / 2, now - YOUNG / 4]);
        assert_eq!(
            place.ages_at(now, false),
            Some(now - YOUNG / 2 + YOUNG),
            "held back until the older young call has aged"
        );
        assert!(place.next_call(now, false).is_none(), "two young calls fly");
        let later = now + YOUNG / 2;
        assert_eq!(place.ages_at(later, false), None, "one of them aged");
        assert!(place.next_call(later, false).is_some(), "and the next goes");
        assert_eq!(place.out.len(), 3);
        place.answered(now - YOUNG / 4);
        assert_eq!(place.out, [now - YOUNG / 2, later]);

        let (reply, _answer) = oneshot::channel();
        place.now.push_back(Request {
            operation: Operation::new("ended"),
            deadline: None,
            reply: Some(reply),
        });
        place.out = std::iter::repeat_n(now - 10 * YOUNG, MOST_OUT).collect();
        assert!(
            place.next_call(now, false).is_none(),
            "no more than MOST_OUT fly, however old"
        );
        assert_eq!(place.ages_at(now, false), None, "and ageing frees none");
    }

    #[test]
    fn a_call_takes_what_must_go_now_then_riders_and_no_more_than_two_fly() {
        let waiting = std::cell::RefCell::new(Vec::new());
        let request = |deadline| {
            let (reply, answer) = oneshot::channel();
            waiting.borrow_mut().push(answer);
            Request {
                operation: Operation::new("ended"),
                deadline,
                reply: Some(reply),
            }
        };
        let now = Instant::now();
        let mut place = Place::default();
        place
            .riders
            .push_back(request(Some(now + Duration::from_secs(1))));
        assert!(place.next_call(now, false).is_none(), "a rider alone waits");
        place.now.push_back(request(None));
        let call = place.next_call(now, false).expect("a call");
        assert_eq!(call.len(), 2, "the rider rides along");
        place.riders.push_back(request(Some(now)));
        assert_eq!(
            place.next_call(now, false).map(|c| c.len()),
            Some(1),
            "a due rider goes"
        );
        place.now.push_back(request(None));
        assert!(
            place.next_call(now, false).is_none(),
            "two calls are in flight"
        );
        place.out.clear();
        for _ in 0..MOST_PER_CALL + 5 {
            place.now.push_back(request(None));
        }
        assert_eq!(
            place.next_call(now, false).map(|c| c.len()),
            Some(MOST_PER_CALL)
        );
        place
            .riders
            .push_back(request(Some(now + Duration::from_secs(9))));
        place.now.clear();
        place.out.clear();
        assert!(
            place.next_call(now, true).is_some(),
            "closing sends every rider"
        );
        place.out.clear();
        let (reply, gave_up) = oneshot::channel();
        drop(gave_up);
        place.now.push_back(Request {
            operation: Operation::new("ended"),
            deadline: None,
            reply: Some(reply),
        });
        assert!(
            place.next_call(now, false).is_none(),
            "nothing is sent for a caller gone"
        );
        assert!(place.idle());
    }
}
