//! What flows back to the upload service (DESIGN "Results"), against the real RabbitMQ and
//! Redis: each final message's result on its `reply_to` queue and on `<queue>.results`, the
//! downstream's answer capped and kept as text when it is not JSON, invalid messages counted
//! in their batch, one `batch.completed` event per batch, a results exchange deleted at
//! runtime declared again without losing a result, a batch id shared by two sellers, the ETA
//! of a seller whose message waits out a retry's backoff, and admission: whether more rows
//! published now would be registered by a deadline.
//!
//! The test listens with queues of its own (exclusive, on a connection of its own, gone when
//! it ends) bound to the rig's results exchange with `#`, and declares its own `reply_to`
//! queues. Every wait is a bounded poll that fails naming what did come.
mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ExchangeKind};
use serde_json::{Value, json};
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, UtcOffset};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use turnstile_core::broker::{Publisher, header_str, headers};
use turnstile_core::domain::{BatchId, SellerId};
use turnstile_core::downstream::RESPONSE_CAP;
use turnstile_lab::rig::Rig;
use turnstile_ops::http::Listen;
use turnstile_ops::serve::{HttpArgs, ServeArgs};
use turnstile_upload::progress;

/// A guard against hanging, not a speed check: generous on purpose.
const PATIENCE: Duration = Duration::from_secs(120);

/// One message that came to a queue the test listens to.
#[derive(Clone, Debug)]
struct Got {
    /// The queue it came to.
    queue: String,
    routing_key: String,
    correlation_id: Option<String>,
    message_id: Option<String>,
    kind: Option<String>,
    content_type: Option<String>,
    body: Value,
}

impl Got {
    fn of(queue: &str, delivery: &lapin::message::Delivery) -> Self {
        let text = |s: &Option<lapin::types::ShortString>| s.as_ref().map(|s| s.to_string());
        let p = &delivery.properties;
        Self {
            queue: queue.to_owned(),
            routing_key: delivery.routing_key.to_string(),
            correlation_id: text(p.correlation_id()),
            message_id: text(p.message_id()),
            kind: text(p.kind()),
            content_type: text(p.content_type()),
            body: serde_json::from_slice(&delivery.data).unwrap_or_else(|e| {
                panic!(
                    "a message on {queue} is not JSON ({e}): {:?}",
                    String::from_utf8_lossy(&delivery.data)
                )
            }),
        }
    }

    /// A result's `message_id`.
    fn of_message(&self) -> Option<&str> {
        self.body["message_id"].as_str()
    }

    fn is_event(&self) -> bool {
        self.routing_key == "batch.completed"
    }
}

/// Everything that came to the queues the test listens to, in arrival order.
#[derive(Clone, Default)]
struct Inbox(Arc<Mutex<Vec<Got>>>);

impl Inbox {
    fn all(&self) -> Vec<Got> {
        self.0.lock().unwrap().clone()
    }

    /// Waits (bounded) until `done` holds for what came so far, and returns it.
    async fn until(&self, what: &str, done: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let all = self.all();
            if done(&all) {
                return all;
            }
            assert!(
                Instant::now() < deadline,
                "never happened: {what}; what came:\n{}",
                all.iter()
                    .map(|g| format!("  {} {} {}", g.queue, g.routing_key, g.body))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The results of `message_id` that came to `queue`.
    fn results_of(all: &[Got], queue: &str, message_id: &str) -> Vec<Got> {
        all.iter()
            .filter(|g| g.queue == queue && !g.is_event() && g.of_message() == Some(message_id))
            .cloned()
            .collect()
    }
}

/// The test's side of the broker: a connection of its own (its queues are exclusive to it and
/// go with it), a confirming publisher to the rig's work queue, and what came back.
struct Upload {
    connection: Connection,
    publisher: Publisher,
    work: String,
    exchange: String,
    inbox: Inbox,
}

impl Upload {
    async fn new(rig: &Rig) -> Self {
        let support::broker::TestBroker {
            connection,
            publisher,
            ..
        } = support::broker::TestBroker::undeclared(rig.topology.clone()).await;
        Self {
            connection,
            publisher,
            work: rig.topology.work().to_owned(),
            exchange: rig.topology.results(),
            inbox: Inbox::default(),
        }
    }

    /// A new exclusive queue (named by the broker), listened to.
    async fn queue(&self) -> String {
        let inbox = self.inbox.clone();
        support::listen(&self.connection, move |queue, delivery| {
            inbox.0.lock().unwrap().push(Got::of(queue, delivery));
        })
        .await
    }

    /// Binds `queue` to the results exchange with `#`: every result and event. `Err` when the
    /// exchange does not exist (the broker then closes the channel used, which is dropped).
    async fn bind(&self, queue: &str) -> lapin::Result<()> {
        let channel = self.connection.create_channel().await?;
        channel
            .queue_bind(
                queue.into(),
                self.exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
    }

    /// A new queue bound to the results exchange, listened to.
    async fn listener(&self) -> String {
        let queue = self.queue().await;
        self.bind(&queue)
            .await
            .expect("the results exchange exists and the listener is bound to it");
        queue
    }

    /// Whether the results exchange exists now (a passive declare, on a channel of its own).
    async fn exchange_exists(&self) -> bool {
        let channel = self.connection.create_channel().await.unwrap();
        channel
            .exchange_declare(
                self.exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok()
    }

    /// Publishes `body` to the work queue as a producer does, with `reply_to` and
    /// `correlation_id` when given; confirmed.
    async fn send(&self, body: &Value, reply: Option<(&str, &str)>) {
        let mut properties =
            BasicProperties::default().with_content_type("application/json".into());
        if let Some((queue, correlation)) = reply {
            properties = properties
                .with_reply_to(queue.into())
                .with_correlation_id(correlation.into());
        }
        self.publisher
            .publish("", &self.work, body.to_string().as_bytes(), properties)
            .await
            .expect("published to the work queue");
    }

    /// Publishes a marker straight to the results exchange (routing key `test.marker`): once it
    /// came to a listener, everything the exchange took before it has come too (one queue, one
    /// consumer: in order).
    async fn mark(&self, marker: &str) {
        self.publisher
            .publish_to(
                &self.exchange,
                "test.marker",
                json!({ "marker": marker }).to_string().as_bytes(),
                BasicProperties::default(),
                turnstile_core::broker::Routing::Mandatory,
            )
            .await
            .expect("the marker reached a listener");
    }
}

/// A registration body; `batch` is its batch id and `batch_size` (any JSON, a bad one too).
fn registration(
    message_id: &str,
    seller: &str,
    batch: Option<(&str, Value)>,
    product: Value,
) -> Value {
    let mut body = json!({"message_id": message_id, "seller_id": seller, "product": product});
    if let Some((id, size)) = batch {
        body["batch_id"] = id.into();
        if !size.is_null() {
            body["batch_size"] = size;
        }
    }
    body
}

/// The HTTP endpoints on a free port, without a token.
fn http() -> HttpArgs {
    HttpArgs {
        http_addr: Listen::At("127.0.0.1:0".parse().unwrap()),
        http_token: None,
    }
}

/// `GET <path>` on the rig's first replica, as JSON.
async fn api(rig: &Rig, path: &str) -> (u16, Value) {
    let addr = rig.dashboard().expect("the rig serves HTTP");
    let answer = reqwest::get(format!("http://{addr}{path}"))
        .await
        .expect("the replica answers HTTP");
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or(Value::Null))
}

/// A counter's value on the rig's first replica's /metrics (0 when absent).
async fn metric(rig: &Rig, name: &str) -> f64 {
    let addr = rig.dashboard().expect("the rig serves HTTP");
    let page = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .expect("the replica answers /metrics")
        .text()
        .await
        .unwrap();
    page.lines()
        .filter_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .filter_map(|value| value.trim().parse::<f64>().ok())
        .sum()
}

/// Waits (bounded) until the rig's replicas settled `registered` messages as registered and
/// `dead` as dead-lettered (each acked after its result and record).
async fn settled(rig: &Rig, registered: u64, dead: u64) {
    support::eventually(
        &format!("the replicas settled {registered} registered and {dead} dead-lettered"),
        || rig.total(|s| &s.registered) >= registered && rig.total(|s| &s.dead_lettered) >= dead,
    )
    .await;
}

/// Asserts what every result carries, whatever its outcome.
fn assert_result_shape(result: &Value) {
    for field in [
        "message_id",
        "seller_id",
        "batch_id",
        "outcome",
        "status",
        "response",
        "response_truncated",
        "detail",
        "attempts",
        "first_seen",
        "finished",
    ] {
        assert!(result.get(field).is_some(), "no {field}: {result}");
    }
    let (first, finished) = (
        result["first_seen"].as_str().unwrap(),
        result["finished"].as_str().unwrap(),
    );
    // RFC 3339, UTC, to the millisecond (fixed width: compared as text).
    for time in [first, finished] {
        assert!(
            time.len() == "2024-01-01T00:00:00.000Z".len() && time.ends_with('Z'),
            "not RFC 3339 UTC to the ms: {time}"
        );
    }
    assert!(first <= finished, "first seen after finished: {result}");
}

#[tokio::test]
async fn a_result_goes_to_the_reply_to_queue_with_its_correlation_id_and_to_the_results_exchange()
-> anyhow::Result<()> {
    let mut rig = support::rig("results-reply", "100/1s").prepare().await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    let reply = upload.queue().await;
    rig.start_replicas(1, 2).await?;

    let (seller, message) = ("S-reply", support::unique("m"));
    let correlation = support::unique("corr");
    upload
        .send(
            &registration(&message, seller, None, json!({"sku": "R-1"})),
            Some((&reply, &correlation)),
        )
        .await;
    let all = upload
        .inbox
        .until("the result on the reply queue and the exchange", |all| {
            !Inbox::results_of(all, &reply, &message).is_empty()
                && !Inbox::results_of(all, &listener, &message).is_empty()
        })
        .await;
    settled(&rig, 1, 0).await;

    let replied = &Inbox::results_of(&all, &reply, &message)[0];
    assert_eq!(
        replied.correlation_id.as_deref(),
        Some(correlation.as_str())
    );
    assert_eq!(
        replied.routing_key, reply,
        "sent through the default exchange"
    );
    assert_eq!(replied.message_id.as_deref(), Some(message.as_str()));
    assert_eq!(replied.kind.as_deref(), Some("turnstile.result"));
    assert_eq!(replied.content_type.as_deref(), Some("application/json"));
    let result = &replied.body;
    assert_result_shape(result);
    assert_eq!(result["outcome"], "registered", "{result}");
    assert_eq!(result["seller_id"], seller, "{result}");
    assert_eq!(result["batch_id"], Value::Null, "{result}");
    assert_eq!(result["status"], 200, "{result}");
    // The mock's JSON answer, kept as JSON.
    assert_eq!(
        result["response"],
        json!({"registered": true, "id": message}),
        "{result}"
    );
    assert_eq!(result["response_truncated"], false, "{result}");
    assert_eq!(result["detail"], Value::Null, "{result}");
    assert_eq!(result["attempts"], 1, "{result}");

    let fanned = &Inbox::results_of(&all, &listener, &message)[0];
    assert_eq!(fanned.routing_key, "result.registered");
    assert_eq!(fanned.message_id.as_deref(), Some(message.as_str()));
    assert_eq!(&fanned.body, result, "both copies say the same");

    let stats = rig.mock.stats();
    assert_eq!((stats.registered, stats.duplicates), (1, 0), "{stats:?}");
    rig.cleanup().await
}

#[tokio::test]
async fn a_missing_reply_to_queue_loses_nothing() -> anyhow::Result<()> {
    let mut rig = support::rig("results-no-reply", "100/1s")
        .serving(http())
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    let reply = upload.queue().await;
    rig.start_replicas(1, 2).await?;
    let unrouted = "turnstile_results_unrouted_total";
    let unrouted_before = metric(&rig, unrouted).await;

    let seller = "S-no-reply";
    let missing = support::unique("no-such-queue");
    let lost = support::unique("m-lost-reply");
    upload
        .send(
            &registration(&lost, seller, None, json!({"sku": 1})),
            Some((&missing, "corr-lost")),
        )
        .await;
    let all = upload
        .inbox
        .until(
            "the result of the message whose reply_to is missing",
            |all| !Inbox::results_of(all, &listener, &lost).is_empty(),
        )
        .await;
    let result = &Inbox::results_of(&all, &listener, &lost)[0];
    assert_eq!(result.routing_key, "result.registered");
    assert_eq!(result.body["outcome"], "registered", "{:?}", result.body);
    assert_eq!(result.correlation_id.as_deref(), Some("corr-lost"));
    support::eventually_async("the reply that found no queue is counted", async || {
        metric(&rig, unrouted).await > unrouted_before
    })
    .await;

    // Nothing stuck: later messages, with and without a reply_to (a missing one again too),
    // go through, all at once. Each reply's return is its own: counted for the messages whose
    // reply_to is missing, and no other publish takes it (and fails, and is sent again).
    let later: Vec<String> = (0..9).map(|i| format!("{lost}-later-{i}")).collect();
    let reply_of = |i: usize| match i % 3 {
        0 => Some(missing.as_str()),
        1 => Some(reply.as_str()),
        _ => None,
    };
    for (i, m) in later.iter().enumerate() {
        let body = registration(m, seller, None, json!({ "sku": i }));
        upload
            .send(&body, reply_of(i).map(|q| (q, m.as_str())))
            .await;
    }
    settled(&rig, 1 + later.len() as u64, 0).await;
    let marker = support::unique("marker");
    upload.mark(&marker).await;
    let all = upload
        .inbox
        .until("the later messages' results and the marker", |all| {
            all.iter().any(|g| g.body["marker"] == marker.as_str())
        })
        .await;
    for (i, m) in later.iter().enumerate() {
        let results = Inbox::results_of(&all, &listener, m);
        assert_eq!(results.len(), 1, "one result for {m}: {results:?}");
        let replies = Inbox::results_of(&all, &reply, m);
        if reply_of(i) == Some(reply.as_str()) {
            assert_eq!(replies.len(), 1, "one reply for {m}: {replies:?}");
            assert_eq!(replies[0].correlation_id.as_deref(), Some(m.as_str()));
        } else {
            assert!(replies.is_empty(), "{replies:?}");
        }
    }
    let missing_replies = later.iter().enumerate().filter(|(i, _)| i % 3 == 0).count();
    support::eventually_async("every missing reply is counted", async || {
        metric(&rig, unrouted).await >= unrouted_before + 1.0 + missing_replies as f64
    })
    .await;
    let stats = rig.mock.stats();
    assert_eq!(
        (stats.registered, stats.duplicates),
        (1 + later.len() as u64, 0),
        "{stats:?}"
    );
    assert_eq!(rig.dead_lettered().await?, 0);
    assert!(
        !rig.topology.queues().contains(&missing),
        "the missing queue was never made"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn a_reply_to_naming_a_turnstile_queue_is_refused_and_the_result_still_goes_out()
-> anyhow::Result<()> {
    let mut rig = support::rig("results-reply-ours", "100/1s")
        .serving(http())
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    rig.start_replicas(1, 2).await?;
    let refused = |reason: &str| format!("turnstile_replies_refused_total{{reason=\"{reason}\"}}");

    // Every queue turnstile declares, a name under `<queue>.` that it does not, and queues
    // named as another deployment names its own.
    let work = rig.topology.work().to_owned();
    let mut ours = rig.topology.queues();
    ours.push(format!("{work}.results"));
    ours.push(format!("{work}.wait.99"));
    let others = ["orders.ready", "orders.dead", "orders.wait.3"];
    let seller = "S-reply-ours";
    let messages: Vec<(String, String)> = ours
        .iter()
        .chain(
            others
                .iter()
                .map(|q| q.to_string())
                .collect::<Vec<_>>()
                .iter(),
        )
        .enumerate()
        .map(|(i, queue)| (support::unique(&format!("m-ours-{i}")), queue.clone()))
        .collect();
    for (i, (message, queue)) in messages.iter().enumerate() {
        let body = registration(message, seller, None, json!({ "sku": i }));
        upload.send(&body, Some((queue, message))).await;
    }
    let n = messages.len() as u64;
    // Each result and reply is confirmed before its message is acked and counted.
    settled(&rig, n, 0).await;
    let marker = support::unique("marker");
    upload.mark(&marker).await;
    let all = upload
        .inbox
        .until("the marker, after every result", |all| {
            all.iter().any(|g| g.body["marker"] == marker.as_str())
        })
        .await;
    for (message, queue) in &messages {
        let results = Inbox::results_of(&all, &listener, message);
        let outcomes: Vec<&Value> = results.iter().map(|g| &g.body["outcome"]).collect();
        assert_eq!(
            outcomes,
            vec!["registered"],
            "one result, registered, for the message replying to {queue}"
        );
        assert_eq!(results[0].correlation_id.as_deref(), Some(message.as_str()));
    }
    // No reply reached a queue of ours: nothing waits anywhere (a reply to `<queue>.dead`
    // would), nothing more was delivered than was sent, nothing was dead-lettered.
    assert_eq!(
        rig.depth_everywhere().await?,
        0,
        "nothing in any queue of ours"
    );
    assert_eq!(
        rig.total(|s| &s.deliveries),
        n,
        "only the messages sent were delivered"
    );
    assert_eq!(rig.total(|s| &s.dead_lettered), 0);
    assert_eq!(
        metric(&rig, &refused("own-queue")).await,
        ours.len() as f64,
        "each reply to a queue of ours refused once"
    );
    assert_eq!(
        metric(&rig, &refused("turnstile-queue")).await,
        others.len() as f64
    );
    let stats = rig.mock.stats();
    assert_eq!((stats.registered, stats.duplicates), (n, 0), "{stats:?}");
    rig.cleanup().await
}

#[tokio::test]
async fn nothing_that_names_a_registered_message_gives_it_a_later_failed_result()
-> anyhow::Result<()> {
    let mut rig = support::rig("results-stay-registered", "100/1s")
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    rig.start_replicas(1, 2).await?;

    let (seller, batch) = ("S-stays", support::unique("batch"));
    let message = support::unique("m-stays");
    let body = registration(
        &message,
        seller,
        Some((&batch, json!(1))),
        json!({"sku": 1}),
    );
    upload.send(&body, None).await;
    let all = upload
        .inbox
        .until("the message's result and its batch's event", |all| {
            !Inbox::results_of(all, &listener, &message).is_empty()
                && all
                    .iter()
                    .any(|g| g.is_event() && g.body["batch_id"] == batch.as_str())
        })
        .await;
    let result = Inbox::results_of(&all, &listener, &message)[0].clone();
    assert_eq!(result.body["outcome"], "registered", "{:?}", result.body);
    settled(&rig, 1, 0).await;

    // Its result, come back into the work queue and the return queue by another route (a
    // binding, a shovel, a reply_to of an older build), as the broker would deliver it.
    let as_result = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_type("turnstile.result".into())
        .with_message_id(message.as_str().into());
    for queue in [rig.topology.work(), rig.topology.ready()] {
        upload
            .publisher
            .publish(
                "",
                queue,
                result.body.to_string().as_bytes(),
                as_result.clone(),
            )
            .await
            .expect("published");
    }
    // A copy of the message itself, now past its deadline; and one routed nowhere known.
    let mut late = body.clone();
    late["deadline"] = "2020-01-01T00:00:00Z".into();
    upload.send(&late, None).await;
    let mut unroutable = body.clone();
    unroutable["route"] = "no-such-route".into();
    upload.send(&unroutable, None).await;

    support::eventually("the four deliveries naming it are settled", || {
        rig.total(|s| &s.deliveries) >= 5
            && rig.total(|s| &s.already_done) + rig.total(|s| &s.dead_lettered) >= 4
    })
    .await;
    let marker = support::unique("marker");
    upload.mark(&marker).await;
    let all = upload
        .inbox
        .until("the marker, after every result", |all| {
            all.iter().any(|g| g.body["marker"] == marker.as_str())
        })
        .await;
    let outcomes: Vec<Value> = Inbox::results_of(&all, &listener, &message)
        .iter()
        .map(|g| g.body["outcome"].clone())
        .collect();
    assert!(
        outcomes.iter().all(|o| o == "registered"),
        "every result of a registered message says registered: {outcomes:?}"
    );
    let events = all
        .iter()
        .filter(|g| g.is_event() && g.body["batch_id"] == batch.as_str())
        .count();
    assert_eq!(events, 1, "its batch completed once");
    assert_eq!(rig.total(|s| &s.dead_lettered), 0);
    assert_eq!(rig.total(|s| &s.already_done), 4);
    assert_eq!(rig.dead_lettered().await?, 0, "no forged dead letter");
    let progress = rig
        .records()
        .batch_progress(
            &SellerId::parse(seller).unwrap(),
            &BatchId::parse(&batch).unwrap(),
        )
        .await?
        .expect("the batch is recorded");
    assert_eq!((progress.registered, progress.dead), (1, 0), "{progress:?}");
    assert_eq!(rig.mock.stats().registered, 1);
    rig.cleanup().await
}

/// What reusing a batch id does (docs/results.md, "A batch id used again"): the batch keeps
/// its first total and completes once; a re-upload under it gets no completion event of its
/// own.
#[tokio::test]
async fn a_batch_id_used_again_keeps_its_first_round_and_completes_once() -> anyhow::Result<()> {
    let mut rig = support::rig("results-batch-again", "100/1s")
        .serving(http())
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    rig.start_replicas(1, 2).await?;

    let (seller, batch) = ("S-again", support::unique("batch"));
    let id = |i: usize| format!("{batch}-{i}");
    // The downstream rejects row 2 at its first call and accepts it at its second.
    let row = |i: usize| {
        let product = match i {
            2 => json!({"sku": i, "mock": {"statuses": [422, 200]}}),
            _ => json!({"sku": i}),
        };
        registration(&id(i), seller, Some((&batch, json!(3))), product)
    };
    for i in 0..3 {
        upload.send(&row(i), None).await;
    }
    let events = |all: &[Got]| -> Vec<Value> {
        all.iter()
            .filter(|g| g.is_event() && g.body["batch_id"] == batch.as_str())
            .map(|g| g.body.clone())
            .collect()
    };
    upload
        .inbox
        .until("the first upload's completion", |all| {
            !events(all).is_empty()
                && (0..3).all(|i| !Inbox::results_of(all, &listener, &id(i)).is_empty())
        })
        .await;
    settled(&rig, 2, 1).await;
    let records = rig.records();
    let sid = SellerId::parse(seller).unwrap();
    for i in 0..2 {
        let message = turnstile_core::domain::MessageId::parse(&id(i)).unwrap();
        support::eventually_async(
            "the registered rows' results are published and trimmed",
            async || {
                records
                    .pending_result(&sid, &message)
                    .await
                    .unwrap()
                    .is_none()
            },
        )
        .await;
    }

    // The same file again (the same ids), then one row more under the same batch id.
    for i in 0..3 {
        upload.send(&row(i), None).await;
    }
    upload.send(&row(3), None).await;
    settled(&rig, 4, 1).await;
    support::eventually(
        "the copies of the registered rows are acked as registered",
        || rig.total(|s| &s.already_done) >= 2,
    )
    .await;
    let marker = support::unique("marker");
    upload.mark(&marker).await;
    let all = upload
        .inbox
        .until("the marker, after every result", |all| {
            all.iter().any(|g| g.body["marker"] == marker.as_str())
        })
        .await;

    let outcomes = |i: usize| -> Vec<Value> {
        Inbox::results_of(&all, &listener, &id(i))
            .iter()
            .map(|g| g.body["outcome"].clone())
            .collect()
    };
    assert_eq!(
        outcomes(0),
        vec!["registered"],
        "a registered row's copy: no result"
    );
    assert_eq!(outcomes(1), vec!["registered"]);
    assert_eq!(
        outcomes(2),
        vec!["rejected", "registered"],
        "a dead row is called again"
    );
    assert_eq!(outcomes(3), vec!["registered"]);
    let events = events(&all);
    assert_eq!(events.len(), 1, "one event, the first round's: {events:?}");
    assert_eq!(events[0]["total"], 3, "{events:?}");
    assert_eq!(events[0]["registered"], 2, "{events:?}");

    let (status, report) = api(&rig, &format!("/api/batches/{batch}")).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["total"], 3, "the first total stays: {report}");
    assert_eq!(report["registered"], 4, "{report}");
    assert_eq!(
        support::dead_counts(&report["dead"]),
        BTreeMap::new(),
        "{report}"
    );
    assert_eq!(report["extra"], 1, "{report}");
    assert_eq!(report["done"], true, "{report}");
    let stats = rig.mock.stats();
    assert_eq!(stats.registered, 4, "{stats:?}");
    rig.cleanup().await
}

/// A downstream of the test's own, on a raw socket: answers `200` with a JSON document of about
/// 1 MiB to a product `{"answer": "huge"}`, with bytes that are not UTF-8 (as
/// `application/octet-stream`) to `{"answer": "binary"}`; notes each Idempotency-Key it answered.
async fn odd_api() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let seen = keys.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(answer_oddly(socket, seen.clone()));
        }
    });
    (format!("http://{addr}/register/{{seller_id}}"), keys)
}

/// The huge answer's size.
const HUGE: usize = 1 << 20;

async fn answer_oddly(mut socket: tokio::net::TcpStream, keys: Arc<Mutex<Vec<String>>>) {
    let mut read = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(at) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => read.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&read[..head_end]).into_owned();
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    };
    let length: usize = header("content-length")
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    while read.len() < head_end + length {
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => read.extend_from_slice(&chunk[..n]),
        }
    }
    let product: Value = serde_json::from_slice(&read[head_end..head_end + length]).unwrap();
    let (content_type, body) = match product["answer"].as_str() {
        Some("huge") => {
            let mut body = br#"{"data":""#.to_vec();
            body.resize(HUGE, b'x');
            body.extend_from_slice(br#""}"#);
            ("application/json", body)
        }
        Some("binary") => {
            let mut body = b"\x89PNG\r\n\x1a\n".to_vec();
            body.extend((0..=255u8).rev());
            ("application/octet-stream", body)
        }
        _ => ("application/json", br#"{"registered":true}"#.to_vec()),
    };
    keys.lock()
        .unwrap()
        .push(header("idempotency-key").unwrap_or_default());
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    // The replica stops reading past its cap and closes: the rest is refused, as it should be.
    let _ = socket.write_all(head.as_bytes()).await;
    let _ = socket.write_all(&body).await;
    let _ = socket.shutdown().await;
}

#[tokio::test]
async fn a_huge_or_binary_answer_is_capped_and_kept_as_text() -> anyhow::Result<()> {
    let mut rig = support::rig("results-odd-answers", "100/1s")
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    let (url, answered) = odd_api().await;
    let mut settings = rig.settings(2);
    settings.downstream.url = url;
    rig.start_replica(settings).await?;

    let (seller, batch) = ("S-odd", support::unique("batch"));
    let (huge, binary) = (format!("{batch}-huge"), format!("{batch}-binary"));
    for (m, answer) in [(&huge, "huge"), (&binary, "binary")] {
        let in_batch = Some((batch.as_str(), json!(2)));
        let body = registration(m, seller, in_batch, json!({ "answer": answer }));
        upload.send(&body, None).await;
    }
    let all = upload
        .inbox
        .until("both results", |all| {
            [&huge, &binary]
                .iter()
                .all(|m| !Inbox::results_of(all, &listener, m).is_empty())
        })
        .await;
    settled(&rig, 2, 0).await;

    let huge_result = &Inbox::results_of(&all, &listener, &huge)[0];
    let result = &huge_result.body;
    assert_result_shape(result);
    assert_eq!(huge_result.routing_key, "result.registered");
    assert_eq!(
        (&result["outcome"], &result["status"]),
        (&json!("registered"), &json!(200))
    );
    assert_eq!(result["response_truncated"], true, "a 1 MiB answer is cut");
    let text = result["response"].as_str().unwrap_or_else(|| {
        panic!(
            "JSON cut by the cap is kept as text: {}",
            result["response"]
        )
    });
    // ASCII: its first RESPONSE_CAP bytes are the text, whole.
    assert_eq!(text.len(), RESPONSE_CAP, "cut at the cap (16 KiB)");
    assert!(text.starts_with(r#"{"data":"xxx"#), "{}", &text[..32]);

    let binary_result = &Inbox::results_of(&all, &listener, &binary)[0].body;
    assert_result_shape(binary_result);
    assert_eq!(binary_result["outcome"], "registered", "{binary_result}");
    assert_eq!(
        binary_result["response_truncated"], false,
        "{binary_result}"
    );
    let text = binary_result["response"]
        .as_str()
        .unwrap_or_else(|| panic!("a binary answer is kept as text: {binary_result}"));
    assert!(text.starts_with("\u{FFFD}PNG"), "{text:?}");
    assert!(
        text.contains('\u{FFFD}'),
        "invalid UTF-8 is replaced: {text:?}"
    );

    // Both registered once, and recorded: their batch counts them.
    let mut keys = answered.lock().unwrap().clone();
    keys.sort();
    let mut expected = vec![huge.clone(), binary.clone()];
    expected.sort();
    assert_eq!(keys, expected, "each called once");
    let report = progress::read_batch(
        &rig.admin(),
        &rig.records(),
        &BatchId::parse(&batch).unwrap(),
    )
    .await?
    .expect("the batch is recorded");
    assert_eq!((report.registered, report.done), (2, true), "{report:?}");
    rig.cleanup().await
}

#[tokio::test]
async fn a_bad_batch_size_is_dead_lettered_and_counted_in_its_batch() -> anyhow::Result<()> {
    let mut rig = support::rig("results-bad-size", "100/1s")
        .serving(http())
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    rig.start_replicas(1, 2).await?;

    let (seller, batch) = ("S-bad-size", support::unique("batch"));
    let zero = format!("{batch}-zero");
    let text = format!("{batch}-text");
    let good = format!("{batch}-good");
    for (message, size) in [(&zero, json!(0)), (&text, json!("5")), (&good, json!(3))] {
        upload
            .send(
                &registration(
                    message,
                    seller,
                    Some((&batch, size)),
                    json!({"sku": message}),
                ),
                None,
            )
            .await;
    }
    let dead = rig.dead_letters(2).await?;
    for d in &dead {
        let reason = header_str(d, headers::REASON).unwrap_or_default();
        let detail = header_str(d, headers::DETAIL).unwrap_or_default();
        assert_eq!(reason, "invalid-message", "{detail}");
        assert!(detail.contains("batch_size"), "{detail}");
    }
    let all = upload
        .inbox
        .until("the three results and the batch's completion", |all| {
            [&zero, &text, &good]
                .iter()
                .all(|m| !Inbox::results_of(all, &listener, m).is_empty())
                && all
                    .iter()
                    .any(|g| g.is_event() && g.body["batch_id"] == batch.as_str())
        })
        .await;
    for m in [&zero, &text] {
        let got = &Inbox::results_of(&all, &listener, m)[0];
        let result = &got.body;
        assert_result_shape(result);
        assert_eq!(got.routing_key, "result.invalid-message");
        assert_eq!(result["outcome"], "invalid-message", "{result}");
        // Read from the body, although it is not a valid registration.
        assert_eq!(result["seller_id"], seller, "{result}");
        assert_eq!(result["batch_id"], batch.as_str(), "{result}");
        assert_eq!(result["status"], Value::Null, "{result}");
        assert_eq!(result["response"], Value::Null, "{result}");
        let detail = result["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("batch_size"), "{result}");
    }
    let registered = &Inbox::results_of(&all, &listener, &good)[0].body;
    assert_eq!(registered["outcome"], "registered", "{registered}");

    // The batch counts both as dead for invalid-message, and completes with the valid
    // message's total.
    let event = all
        .iter()
        .find(|g| g.is_event() && g.body["batch_id"] == batch.as_str())
        .unwrap();
    assert_eq!(event.body["total"], 3, "{}", event.body);
    assert_eq!(event.body["registered"], 1, "{}", event.body);
    let want = BTreeMap::from([("invalid-message".to_owned(), 2)]);
    assert_eq!(
        support::dead_counts(&event.body["dead"]),
        want,
        "{}",
        event.body
    );
    settled(&rig, 1, 2).await;
    let (status, report) = api(&rig, &format!("/api/batches/{batch}")).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["seller_id"], seller, "{report}");
    assert_eq!(report["total"], 3, "{report}");
    assert_eq!(report["registered"], 1, "{report}");
    assert_eq!(support::dead_counts(&report["dead"]), want, "{report}");
    assert_eq!(
        (&report["waiting"], &report["done"]),
        (&json!(0), &json!(true)),
        "{report}"
    );
    let progress = rig
        .records()
        .batch_progress(
            &SellerId::parse(seller).unwrap(),
            &BatchId::parse(&batch).unwrap(),
        )
        .await?
        .expect("the batch is recorded");
    assert_eq!(progress.dead_by_reason, want, "{progress:?}");
    rig.cleanup().await
}

/// A row of a batch whose body names no seller is dead-lettered `invalid-message` and still
/// counted in its batch, whether it comes before any of the batch's other rows or after all of
/// them: both batches complete, once each, and the row is counted once in the dead letters.
#[tokio::test]
async fn a_row_without_a_seller_is_counted_in_its_batch_whenever_it_comes() -> anyhow::Result<()> {
    let mut rig = support::rig("results-orphan", "100/1s")
        .serving(http())
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    rig.start_replicas(1, 2).await?;
    let seller = "S-orphans";
    let (first, last) = (
        support::unique("orphan-first"),
        support::unique("orphan-last"),
    );
    let sellerless = |batch: &str| {
        json!({"message_id": format!("{batch}-none"), "batch_id": batch, "batch_size": 3,
               "product": {"sku": "no seller"}})
    };
    let rows = |batch: &str| {
        (0..2)
            .map(|n| {
                registration(
                    &format!("{batch}-{n}"),
                    seller,
                    Some((batch, json!(3))),
                    json!({"sku": n}),
                )
            })
            .collect::<Vec<_>>()
    };

    // Before any other row of its batch: kept until the batch is first seen.
    upload.send(&sellerless(&first), None).await;
    let dead = rig.dead_letters(1).await?;
    assert_eq!(
        header_str(&dead[0], headers::REASON).as_deref(),
        Some("invalid-message")
    );
    for row in rows(&first) {
        upload.send(&row, None).await;
    }
    // After every other row of its batch.
    for row in rows(&last) {
        upload.send(&row, None).await;
    }
    settled(&rig, 4, 1).await;
    upload.send(&sellerless(&last), None).await;
    rig.dead_letters(1).await?;

    let all = upload
        .inbox
        .until("both batches' completion events", |all| {
            [&first, &last].iter().all(|b| {
                all.iter()
                    .any(|g| g.is_event() && g.body["batch_id"] == b.as_str())
            })
        })
        .await;
    let want = BTreeMap::from([("invalid-message".to_owned(), 1)]);
    for batch in [&first, &last] {
        let events: Vec<_> = all
            .iter()
            .filter(|g| g.is_event() && g.body["batch_id"] == batch.as_str())
            .collect();
        assert_eq!(events.len(), 1, "{batch}: one completion event");
        let event = &events[0].body;
        assert_eq!(
            (&event["total"], &event["registered"]),
            (&json!(3), &json!(2)),
            "{event}"
        );
        assert_eq!(support::dead_counts(&event["dead"]), want, "{event}");
        let result = &Inbox::results_of(&all, &listener, &format!("{batch}-none"))[0].body;
        assert_eq!(result["outcome"], "invalid-message", "{result}");
        assert_eq!(result["batch_id"], batch.as_str(), "{result}");
        let (status, report) = api(&rig, &format!("/api/batches/{batch}")).await;
        assert_eq!(status, 200, "{report}");
        assert_eq!(
            (&report["waiting"], &report["done"]),
            (&json!(0), &json!(true)),
            "{report}"
        );
    }
    let tally = rig.records().dead_now().await?;
    assert_eq!(tally.get("invalid-message"), Some(&2), "{tally:?}");
    rig.cleanup().await
}

#[tokio::test]
async fn a_batch_completes_once_with_counts_per_outcome_and_reports_extra_messages()
-> anyhow::Result<()> {
    let mut rig = support::rig("results-batch-once", "100/1s")
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    rig.start_replicas(1, 4).await?;

    let (seller, batch) = ("S-batch-once", support::unique("batch"));
    let message = |i: usize| format!("{batch}-{i}");
    let product = |i: usize| match i {
        1 => json!({"sku": i, "mock": {"statuses": [422]}}),
        _ => json!({"sku": i}),
    };
    for i in 0..3 {
        upload
            .send(
                &registration(&message(i), seller, Some((&batch, json!(3))), product(i)),
                None,
            )
            .await;
    }
    let events = |all: &[Got]| -> Vec<Value> {
        all.iter()
            .filter(|g| g.is_event() && g.body["batch_id"] == batch.as_str())
            .map(|g| g.body.clone())
            .collect()
    };
    let all = upload
        .inbox
        .until("the batch's completion event", |all| {
            !events(all).is_empty()
        })
        .await;
    let event = &events(&all)[0];
    assert_eq!(event["seller_id"], seller, "{event}");
    assert_eq!(event["total"], 3, "{event}");
    assert_eq!(event["registered"], 2, "{event}");
    assert_eq!(
        support::dead_counts(&event["dead"]),
        BTreeMap::from([("rejected".to_owned(), 1)]),
        "{event}"
    );
    assert_eq!(event["extra"], 0, "{event}");
    let (started, finished) = (
        event["started"].as_str().unwrap(),
        event["finished"].as_str().unwrap(),
    );
    assert!(started <= finished, "{event}");
    // Each message's result came before the event (each is published before its record).
    for i in 0..3 {
        assert!(
            !Inbox::results_of(&all, &listener, &message(i)).is_empty(),
            "no result for {}",
            message(i)
        );
    }
    let rejected = &Inbox::results_of(&all, &listener, &message(1))[0];
    assert_eq!(rejected.routing_key, "result.rejected");
    assert_eq!(rejected.body["status"], 422);
    assert_eq!(rejected.body["response"], json!({"error": "scripted 422"}));

    // A fourth message of a batch of 3: registered, counted as extra, no second event.
    settled(&rig, 2, 1).await;
    upload
        .send(
            &registration(&message(3), seller, Some((&batch, json!(3))), product(3)),
            None,
        )
        .await;
    settled(&rig, 3, 1).await;

    // The same with all four in flight at once: the fourth may be counted while the event of
    // the third is being published, and must leave it to the third.
    let racing = support::unique("batch");
    for i in 0..4 {
        let m = format!("{racing}-{i}");
        let body = registration(&m, seller, Some((&racing, json!(3))), json!({ "sku": i }));
        upload.send(&body, None).await;
    }
    settled(&rig, 7, 1).await;

    // Once the marker came, every event published before it (each is confirmed before its
    // message is acked) came too.
    let marker = support::unique("marker");
    upload.mark(&marker).await;
    let all = upload
        .inbox
        .until("the marker after the fourth messages", |all| {
            all.iter().any(|g| g.body["marker"] == marker.as_str())
        })
        .await;
    assert!(!Inbox::results_of(&all, &listener, &message(3)).is_empty());
    let events_of = |batch: &str| -> Vec<String> {
        all.iter()
            .filter(|g| g.is_event() && g.body["batch_id"] == batch)
            .map(|g| g.body.to_string())
            .collect()
    };
    assert_eq!(
        events_of(&batch).len(),
        1,
        "one event: {:?}",
        events_of(&batch)
    );
    assert_eq!(
        events_of(&racing).len(),
        1,
        "one event: {:?}",
        events_of(&racing)
    );

    let report = progress::read_batch(
        &rig.admin(),
        &rig.records(),
        &BatchId::parse(&batch).unwrap(),
    )
    .await?
    .expect("the batch is recorded");
    assert_eq!(report.extra, 1, "{report:?}");
    assert_eq!(report.total, Some(3), "{report:?}");
    assert_eq!(report.registered, 3, "{report:?}");
    assert_eq!(
        report.dead,
        BTreeMap::from([("rejected".to_owned(), 1)]),
        "{report:?}"
    );
    assert!(report.done, "{report:?}");
    assert_eq!(report.waiting, Some(0), "{report:?}");
    let report = progress::read_batch(
        &rig.admin(),
        &rig.records(),
        &BatchId::parse(&racing).unwrap(),
    )
    .await?
    .expect("the racing batch is recorded");
    assert_eq!(
        (report.total, report.registered, report.extra, report.done),
        (Some(3), 4, 1, true),
        "{report:?}"
    );
    rig.cleanup().await
}

#[tokio::test]
async fn a_results_exchange_deleted_at_runtime_is_declared_again_and_no_result_is_lost()
-> anyhow::Result<()> {
    let mut rig = support::rig("results-exchange-gone", "100/1s")
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    let reply = upload.queue().await;
    rig.start_replicas(1, 4).await?;
    let seller = "S-exchange-gone";
    let names = |phase: &str, n: usize| -> Vec<String> {
        (0..n)
            .map(|i| format!("{}-{phase}-{i}", rig.key_prefix))
            .collect()
    };

    // Before: results reach the listener.
    let before = names("before", 3);
    for m in &before {
        upload
            .send(&registration(m, seller, None, json!({"sku": m})), None)
            .await;
    }
    upload
        .inbox
        .until("the results before the exchange is deleted", |all| {
            before
                .iter()
                .all(|m| !Inbox::results_of(all, &listener, m).is_empty())
        })
        .await;

    // The exchange is deleted (with the listener's binding) while the replica consumes. The
    // next messages carry a reply_to: their results are published to both, and their replies
    // are what the test can always see (a result the exchange took before the listener was
    // bound again went to no queue, as the exchange's results do when no one listens).
    let channel = upload.connection.create_channel().await?;
    channel
        .exchange_delete(
            upload.exchange.as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await?;
    drop(channel);
    assert!(!upload.exchange_exists().await, "the exchange is gone");
    let during = names("during", 4);
    for m in &during {
        upload
            .send(
                &registration(m, seller, None, json!({"sku": m})),
                Some((&reply, m)),
            )
            .await;
    }
    // The replica declares it again as its first publish fails; bind again once it exists.
    let deadline = Instant::now() + PATIENCE;
    while upload.bind(&listener).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the replica never declared the results exchange again"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let all = upload
        .inbox
        .until(
            "every result published while the exchange was gone",
            |all| {
                during
                    .iter()
                    .all(|m| !Inbox::results_of(all, &reply, m).is_empty())
            },
        )
        .await;
    for m in &during {
        let replied = &Inbox::results_of(&all, &reply, m)[0];
        assert_eq!(replied.correlation_id.as_deref(), Some(m.as_str()));
        assert_eq!(replied.body["outcome"], "registered", "{:?}", replied.body);
    }

    // After: the replica keeps registering, and its results reach the listener again.
    let after = names("after", 3);
    for m in &after {
        upload
            .send(&registration(m, seller, None, json!({"sku": m})), None)
            .await;
    }
    let all = upload
        .inbox
        .until("the results after the exchange came back", |all| {
            after
                .iter()
                .all(|m| !Inbox::results_of(all, &listener, m).is_empty())
        })
        .await;
    let total = (before.len() + during.len() + after.len()) as u64;
    settled(&rig, total, 0).await;
    for m in before.iter().chain(&during).chain(&after) {
        let copies =
            Inbox::results_of(&all, &listener, m).len() + Inbox::results_of(&all, &reply, m).len();
        assert!(copies >= 1, "no result for {m}");
    }
    let stats = rig.mock.stats();
    assert_eq!(
        (stats.registered, stats.duplicates),
        (total, 0),
        "each registered once: {stats:?}"
    );
    assert_eq!(rig.dead_lettered().await?, 0, "nothing dead-lettered");
    assert_eq!(
        rig.depth(rig.topology.work()).await?,
        0,
        "nothing left behind"
    );
    assert!(upload.exchange_exists().await);
    rig.cleanup().await
}

#[tokio::test]
async fn a_mixed_seller_batch_is_reported_not_crashed_on() -> anyhow::Result<()> {
    let mut rig = support::rig("results-mixed", "100/1s")
        .serving(http())
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    let listener = upload.listener().await;
    rig.start_replicas(1, 2).await?;
    let batch = support::unique("batch");
    let batch_id = BatchId::parse(&batch).unwrap();
    let (first, other) = ("S-mix-first", "S-mix-other");

    // The first seller's two messages, seen first.
    let firsts = [format!("{batch}-a0"), format!("{batch}-a1")];
    for m in &firsts {
        upload
            .send(
                &registration(m, first, Some((&batch, json!(2))), json!({"sku": m})),
                None,
            )
            .await;
    }
    upload
        .inbox
        .until("the first seller's results", |all| {
            firsts
                .iter()
                .all(|m| !Inbox::results_of(all, &listener, m).is_empty())
        })
        .await;
    support::eventually_async("the first seller's batch is recorded", async || {
        progress::read_batch(&rig.admin(), &rig.records(), &batch_id)
            .await
            .unwrap()
            .is_some_and(|b| b.seller_id == first)
    })
    .await;

    // Another seller's message with the same batch id.
    let others = format!("{batch}-b0");
    upload
        .send(
            &registration(&others, other, Some((&batch, json!(1))), json!({"sku": 0})),
            None,
        )
        .await;
    let all = upload
        .inbox
        .until("the other seller's result and both completions", |all| {
            let completed = |seller: &str| {
                all.iter()
                    .any(|g| g.is_event() && g.body["seller_id"] == seller)
            };
            !Inbox::results_of(all, &listener, &others).is_empty()
                && completed(first)
                && completed(other)
        })
        .await;
    for m in firsts.iter().chain([&others]) {
        let result = &Inbox::results_of(&all, &listener, m)[0].body;
        assert_eq!(result["outcome"], "registered", "{result}");
        assert_eq!(result["batch_id"], batch.as_str(), "{result}");
    }
    // Each seller's messages are a batch of their own.
    let completed: BTreeMap<String, Value> = all
        .iter()
        .filter(|g| g.is_event())
        .map(|g| {
            (
                g.body["seller_id"].as_str().unwrap().to_owned(),
                g.body.clone(),
            )
        })
        .collect();
    assert_eq!(completed[first]["total"], 2, "{completed:?}");
    assert_eq!(completed[first]["registered"], 2, "{completed:?}");
    assert_eq!(completed[other]["total"], 1, "{completed:?}");
    assert_eq!(completed[other]["registered"], 1, "{completed:?}");
    settled(&rig, 3, 0).await;

    // The batch id is reported as the first seller's, naming the other.
    support::eventually_async("the batch names the other seller", async || {
        progress::read_batch(&rig.admin(), &rig.records(), &batch_id)
            .await
            .unwrap()
            .is_some_and(|b| b.also_sellers == [other])
    })
    .await;
    let report = progress::read_batch(&rig.admin(), &rig.records(), &batch_id)
        .await?
        .unwrap();
    assert_eq!(report.seller_id, first, "{report:?}");
    assert_eq!(
        (report.total, report.registered),
        (Some(2), 2),
        "{report:?}"
    );
    assert!(report.done, "{report:?}");
    let (status, api_report) = api(&rig, &format!("/api/batches/{batch}")).await;
    assert_eq!(status, 200, "{api_report}");
    assert_eq!(api_report["seller_id"], first, "{api_report}");
    assert_eq!(api_report["also_sellers"], json!([other]), "{api_report}");
    let others_progress = rig
        .records()
        .batch_progress(&SellerId::parse(other).unwrap(), &batch_id)
        .await?
        .expect("the other seller's part is recorded");
    assert_eq!(
        (others_progress.total, others_progress.registered),
        (Some(1), 1),
        "{others_progress:?}"
    );
    let stats = rig.mock.stats();
    assert_eq!(stats.sellers[first].registered, 2, "{stats:?}");
    assert_eq!(stats.sellers[other].registered, 1, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    rig.cleanup().await
}

/// Polls `GET /api/sellers/{seller}` until its ETA is above zero, bounded: that report, with
/// the moment its answer came (at or after the ETA was computed).
async fn eta_above_zero(rig: &Rig, seller: &str, what: &str) -> (Value, Instant) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (status, report) = api(rig, &format!("/api/sellers/{seller}")).await;
        let read = Instant::now();
        assert_eq!(status, 200, "{report}");
        if report["eta_s"].as_f64().is_some_and(|eta| eta > 0.0) {
            return (report, read);
        }
        assert!(
            Instant::now() < deadline,
            "never happened: {what}; last: {report}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The operator's report: a downstream answering 503 for a while, its messages retried with
/// backoff, and an ETA of "~1s" throughout. A message waiting out its backoff holds its
/// seller's and its batch's ETA until its retry is due, at least: every retry is due one
/// backoff (at least TURNSTILE_RETRY_MIN) after a 503 that came after the message was
/// published, so an ETA read at `t` is at least `published + n x backoff - t` for the n-th
/// retry. Once the message is registered the batch is done and nothing is waiting.
#[tokio::test]
async fn the_eta_is_not_before_a_retry_waiting_out_its_backoff_is_due() -> anyhow::Result<()> {
    let mut rig = support::rig("results-retry-eta", "100/1s")
        .prepare()
        .await?;
    let backoff = Duration::from_secs(3);
    let mut consume = rig.settings(2);
    (consume.retry_min, consume.retry_max) = (backoff, backoff);
    rig.start_replica(ServeArgs {
        consume,
        http: http(),
    })
    .await?;
    let upload = Upload::new(&rig).await;
    let (seller, batch) = ("S-retry-eta", support::unique("batch"));
    let published = Instant::now();
    let scripts = [json!([201]), json!([503, 503, 201])];
    for (i, statuses) in scripts.into_iter().enumerate() {
        let product = json!({"sku": i, "mock": {"statuses": statuses}});
        let body = registration(
            &format!("{batch}-{i}"),
            seller,
            Some((&batch, json!(2))),
            product,
        );
        upload.send(&body, None).await;
    }
    // The first is registered: the other is all the batch has waiting.
    settled(&rig, 1, 0).await;

    for n in 1..=2u32 {
        support::eventually(&format!("retry {n} of the 503ing message"), || {
            rig.total(|s| &s.retried) >= u64::from(n)
        })
        .await;
        // Read once the retry is noted (in the background, after its delayed copy is
        // confirmed): before, nothing but the limit holds the one message waiting.
        let (report, read) = eta_above_zero(&rig, seller, &format!("an ETA for retry {n}")).await;
        let eta = report["eta_s"].as_f64().unwrap();
        let due_after_read = (published + backoff * n).saturating_duration_since(read);
        // 10 ms: the whole milliseconds the due time is kept and read in.
        assert!(
            eta + 0.01 >= due_after_read.as_secs_f64(),
            "retry {n}: an ETA of {eta} s, the retry due in at least {due_after_read:?}: {report}"
        );
        assert_eq!(report["retrying"], 1, "{report}");
        let listed = report["batches"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["batch_id"] == batch.as_str())
            .cloned()
            .unwrap_or_else(|| panic!("the batch is listed: {report}"));
        assert_eq!(
            (&listed["waiting"], &listed["retrying"]),
            (&json!(1), &json!(1)),
            "{listed}"
        );
        // Its only batch: the batch's ETA is the seller's.
        assert!(
            listed["eta_s"].as_f64().unwrap() + 0.01 >= due_after_read.as_secs_f64(),
            "{listed}"
        );
    }

    settled(&rig, 2, 0).await;
    let (status, report) = api(&rig, &format!("/api/batches/{batch}")).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(
        (&report["done"], &report["eta_s"], &report["retrying"]),
        (&json!(true), &json!(0.0), &json!(0)),
        "{report}"
    );
    let (_, report) = api(&rig, &format!("/api/sellers/{seller}")).await;
    assert_eq!(
        (&report["backlog"], &report["eta_s"], &report["retrying"]),
        (&json!(0), &json!(0.0), &json!(0)),
        "{report}"
    );
    assert_eq!(rig.mock.stats().violations, 0);
    rig.cleanup().await
}

/// `t` as RFC 3339 at +09:00, for a query (its `+` escaped).
fn at_plus_nine(t: OffsetDateTime) -> String {
    let tokyo = UtcOffset::from_hms(9, 0, 0).unwrap();
    t.to_offset(tokyo)
        .format(&Rfc3339)
        .unwrap()
        .replace('+', "%2B")
}

fn rfc3339(text: &Value) -> OffsetDateTime {
    OffsetDateTime::parse(text.as_str().expect("a string"), &Rfc3339)
        .unwrap_or_else(|e| panic!("{text} is RFC 3339: {e}"))
}

/// An upload service asks before publishing. A seller at 10/10s whose window holds its first 10
/// registrations has 20 rows waiting: 5 more rows published now finish a window after its
/// backlog, about 30 s out, so not by a deadline 5 s away and by one 60 s away; its batch the
/// same way. A bad deadline, rows=0 and rows over a million are 400s naming the parameter.
#[tokio::test]
async fn an_upload_service_learns_whether_more_rows_would_be_registered_by_a_deadline()
-> anyhow::Result<()> {
    let mut rig = support::rig("results-admission", "10/10s")
        .serving(http())
        .prepare()
        .await?;
    let upload = Upload::new(&rig).await;
    rig.start_replicas(1, 2).await?;
    let (seller, batch) = ("S-admission", support::unique("batch"));
    for i in 0..30 {
        let body = registration(
            &format!("{batch}-{i}"),
            seller,
            Some((&batch, json!(30))),
            json!({"sku": i}),
        );
        upload.send(&body, None).await;
    }
    settled(&rig, 10, 0).await;

    let asked = OffsetDateTime::now_utc();
    let (in_5s, in_60s) = (
        at_plus_nine(asked + Duration::from_secs(5)),
        at_plus_nine(asked + Duration::from_secs(60)),
    );
    let (status, soon) = api(
        &rig,
        &format!("/api/sellers/{seller}?rows=5&deadline={in_5s}"),
    )
    .await;
    let answered = OffsetDateTime::now_utc();
    assert_eq!(status, 200, "{soon}");
    let admission = &soon["admission"];
    assert_eq!(admission["rows"], 5, "{soon}");
    // The window holds 10 answered units taken less than a window ago and `backlog_units` wait
    // (20 while the first window lasts): the 5 rows are granted in the window after the
    // backlog's last, 10 x (ceil((10 + backlog + 5) / 10) - 1) s after the window's first.
    let backlog = soon["backlog_units"].as_u64().unwrap();
    let window_after = 10.0 * ((10 + backlog + 5).div_ceil(10) - 1) as f64;
    let finish_in = admission["finish_in_s"].as_f64().unwrap();
    assert!(
        window_after - 10.0 < finish_in && finish_in <= window_after,
        "{backlog} units waiting: {soon}"
    );
    let eta = soon["eta_s"].as_f64().unwrap();
    assert!(
        (finish_in - eta - 10.0).abs() < 1e-6,
        "one window after the backlog: {soon}"
    );
    // `finish_at` is the replica's now (between asking and the answer) + `finish_in_s`, to the
    // millisecond, in UTC.
    let finish_at = rfc3339(&admission["finish_at"]);
    let finish_in = Duration::from_secs_f64(finish_in);
    assert!(
        asked + finish_in - Duration::from_millis(1) <= finish_at
            && finish_at <= answered + finish_in,
        "asked at {asked}, answered at {answered}: {soon}"
    );
    assert!(admission["finish_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(admission["meets_deadline"], false, "{soon}");
    let echoed = &admission["deadline"];
    assert_eq!(rfc3339(echoed), asked + Duration::from_secs(5), "{soon}");
    assert!(echoed.as_str().unwrap().ends_with('Z'), "{echoed}");

    let (status, later) = api(
        &rig,
        &format!("/api/sellers/{seller}?rows=5&deadline={in_60s}"),
    )
    .await;
    assert_eq!(status, 200, "{later}");
    assert_eq!(later["admission"]["meets_deadline"], true, "{later}");

    // Its batch: due with the backlog, 20 s at most, so after 5 s and before 60 s.
    for (deadline, meets) in [(&in_5s, false), (&in_60s, true)] {
        let (status, report) =
            api(&rig, &format!("/api/batches/{batch}?deadline={deadline}")).await;
        assert_eq!(status, 200, "{report}");
        assert_eq!(report["meets_deadline"], meets, "{report}");
        assert!(
            report["deadline"].as_str().unwrap().ends_with('Z'),
            "{report}"
        );
    }

    // Only rows: no deadline to meet. Neither: no admission.
    let (_, rows_only) = api(&rig, &format!("/api/sellers/{seller}?rows=5")).await;
    let keys: Vec<_> = rows_only["admission"]
        .as_object()
        .unwrap_or_else(|| panic!("an admission: {rows_only}"))
        .keys()
        .cloned()
        .collect();
    assert_eq!(
        keys,
        [
            "basis",
            "finish_at",
            "finish_in_s",
            "observed_per_s",
            "rows"
        ],
        "{rows_only}"
    );
    let (_, plain) = api(&rig, &format!("/api/sellers/{seller}")).await;
    assert!(plain.get("admission").is_none(), "{plain}");

    for (query, error) in [
        (
            "deadline=tomorrow",
            "deadline: expected an RFC 3339 date-time such as 2026-11-26T10:00:00+09:00",
        ),
        (
            "rows=0",
            "rows: expected a whole number of rows from 1 to 1000000",
        ),
        (
            "rows=1000001",
            "rows: expected a whole number of rows from 1 to 1000000",
        ),
    ] {
        let (status, answer) = api(&rig, &format!("/api/sellers/{seller}?{query}")).await;
        assert_eq!(
            (status, &answer),
            (400, &json!({"error": error})),
            "{query}"
        );
    }
    let (status, answer) = api(&rig, &format!("/api/batches/{batch}?deadline=2026-11-26")).await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().starts_with("deadline: "),
        "{answer}"
    );
    rig.cleanup().await
}

/// A registration's completion record keeps its result only until the result is out: the trims
/// nobody waits for (they ride along with the replica's next calls to Redis) reach Redis, and
/// every record ends as `registered` alone, with its TTL.
#[tokio::test]
async fn once_its_result_is_out_a_registered_message_record_no_longer_keeps_it()
-> anyhow::Result<()> {
    let mut rig = support::rig("results-trim", "1000/1s").prepare().await?;
    rig.start_replicas(1, 8).await?;
    let seller = "S-trim";
    rig.publish(seller, 40).await?;
    settled(&rig, 40, 0).await;

    let store = rig.store();
    let seller_id = SellerId::parse(seller)?;
    let keys: Vec<String> = (0..40)
        .map(|i| {
            let message = turnstile_core::domain::MessageId::parse(&format!("{seller}-{i}"))?;
            Ok(store.keys().done(&seller_id, &message))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut redis = redis::Client::open(rig.redis_url())?
        .get_multiplexed_async_connection()
        .await?;
    let mut records: Vec<Option<String>> = Vec::new();
    support::eventually_async("every record trimmed to `registered`", async || {
        records = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut redis)
            .await
            .expect("Redis answers");
        records.iter().all(|r| r.as_deref() == Some("registered"))
    })
    .await;
    let ttls: Vec<i64> = {
        let mut pipe = redis::pipe();
        for key in &keys {
            pipe.cmd("PTTL").arg(key);
        }
        pipe.query_async(&mut redis).await?
    };
    assert!(ttls.iter().all(|&t| t > 0), "each keeps its TTL: {ttls:?}");
    rig.cleanup().await
}
