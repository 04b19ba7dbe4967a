//! What the integration tests need, spawned with unique names so tests run in parallel and leave
//! nothing behind: rigs (`turnstile_lab::rig`: queues, keys, a strict mock downstream, replicas)
//! with the tests' settings, Redis connections (standalone, or a local 3-node Redis Cluster
//! started on demand), key prefixes, limiter settings. Tracing is quiet unless TEST_LOG is set.
#![allow(dead_code)]

use std::process::Command;
use std::sync::Once;
use std::time::Duration;

use turnstile_core::broker::QueueType;
use turnstile_core::config::{Algorithm, LimiterArgs, RedisArgs};
use turnstile_core::permit::{PermitStore, RedisConn, delete_prefix};
use turnstile_lab::rig::{Rig, RigArgs, RigBuilder};

pub mod asks;
pub mod broker;
pub mod cluster;
pub mod permit_cases;
pub mod results;

static TRACING: Once = Once::new();

/// Installs tracing once per test binary; output only when TEST_LOG is set.
pub fn init_tracing() {
    TRACING.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(std::env::var("TEST_LOG").unwrap_or_else(|_| "info".into()))
                .with_test_writer()
                .try_init();
        }
    });
}

/// A name no other test (or earlier run) uses: `t-<what>-<random>`.
pub fn unique(what: &str) -> String {
    format!("t-{what}-{:08x}", rand::random::<u32>())
}

pub fn redis_url() -> String {
    std::env::var("TURNSTILE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}

pub fn redis_args(url: &str, key_prefix: &str) -> RedisArgs {
    RedisArgs {
        url: url.to_owned(),
        cluster: false,
        key_prefix: key_prefix.to_owned(),
    }
}

pub fn limiter(limit: &str, algorithm: Algorithm) -> LimiterArgs {
    LimiterArgs {
        // The shared test Redis may have started less than a window ago; the cold-start wait
        // has its own test on a Redis of its own.
        redis_durable: true,
        ..LimiterArgs::new(
            limit.parse::<turnstile_core::config::Limits>().unwrap(),
            algorithm,
        )
    }
}

/// A rig for one test, on the test broker and Redis: its queues `turnstile-<what>-<random>`,
/// keys `t-<what>-<random>`, a strict mock enforcing `limit`; its replicas take permits with the
/// sliding window, hold a message up to 2 s, and retry a failed call quickly (100 ms to 1 s).
pub fn rig(what: &str, limit: &str) -> RigBuilder {
    rig_with(what, limiter(limit, Algorithm::SlidingWindow))
}

/// As [`rig`], with the limiter settings `limiter`.
pub fn rig_with(what: &str, limiter: LimiterArgs) -> RigBuilder {
    init_tracing();
    let place = RigArgs {
        queue_type: QueueType::Quorum,
        amqp: turnstile_core::broker::AmqpArgs {
            url: broker::amqp_url(),
        },
        redis: redis_args(&redis_url(), "t"),
    };
    let mut settings = place.replica_settings(what, limiter, 1, Duration::from_secs(2));
    settings.retry_min = Duration::from_millis(100);
    settings.retry_max = Duration::from_secs(1);
    settings.done.ttl = Duration::from_secs(600);
    settings.downstream.token = Some("secret-token".into());
    settings.downstream.timeout = Duration::from_secs(5);
    Rig::build(settings)
}

/// Which Redis a test runs against.
#[derive(Clone, Copy, Debug)]
pub enum Backend {
    Standalone,
    Cluster,
}

impl Backend {
    pub fn url(self) -> String {
        match self {
            Backend::Standalone => redis_url(),
            Backend::Cluster => cluster::urls().join(","),
        }
    }
    pub async fn connect(self) -> RedisConn {
        init_tracing();
        RedisConn::connect(&redis_args(&self.url(), "unused"))
            .await
            .expect("Redis is reachable")
    }
}

/// A key prefix of its own for one test; its keys are deleted when the test calls `cleanup`.
pub struct Keys {
    pub conn: RedisConn,
    pub prefix: String,
    url: String,
}

impl Keys {
    pub async fn new(backend: Backend, what: &str) -> Self {
        Self::at(&backend.url(), what).await
    }

    /// Keys on the Redis at `url` (e.g. a private one from `LocalRedis`).
    pub async fn at(url: &str, what: &str) -> Self {
        init_tracing();
        let conn = RedisConn::connect(&redis_args(url, "unused"))
            .await
            .expect("Redis is reachable");
        Self {
            conn,
            prefix: unique(what),
            url: url.to_owned(),
        }
    }

    pub fn store(&self, limiter: LimiterArgs) -> PermitStore {
        PermitStore::new(self.conn.clone(), &self.prefix, limiter)
    }

    pub async fn cleanup(self) {
        delete_keys(&self.url, &self.prefix).await;
    }
}

/// Deletes every key under `prefix` on the Redis at `url`, through a fresh connection (the
/// test's may have seen its server restart).
pub async fn delete_keys(url: &str, prefix: &str) {
    let conn = RedisConn::connect(&redis_args(url, "unused"))
        .await
        .expect("Redis is reachable");
    delete_prefix(&conn, prefix).await.expect("cleanup");
}

/// Runs a command and returns (exit code, stdout, stderr).
pub fn run(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd.output().expect("command runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The largest number of `times` (µs, any order) inside any half-open window of `window_us`.
pub fn max_in_any_window(times: &[i64], window_us: i64) -> usize {
    let mut sorted = times.to_vec();
    sorted.sort_unstable();
    let mut best = 0;
    let mut start = 0;
    for end in 0..sorted.len() {
        while sorted[end] - sorted[start] >= window_us {
            start += 1;
        }
        best = best.max(end - start + 1);
    }
    best
}

/// The most units among grants `(at µs, units)`, any order, inside any half-open window of
/// `window_us`.
pub fn max_units_in_any_window(grants: &[(i64, u32)], window_us: i64) -> u64 {
    let mut sorted = grants.to_vec();
    sorted.sort_unstable();
    let (mut best, mut held, mut start) = (0, 0, 0);
    for end in 0..sorted.len() {
        held += u64::from(sorted[end].1);
        while sorted[end].0 - sorted[start].0 >= window_us {
            held -= u64::from(sorted[start].1);
            start += 1;
        }
        best = best.max(held);
    }
    best
}

/// Waits until `done` holds (a guard against hanging, not a speed check: generous on purpose).
pub async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// As [`eventually`], for a check that needs to await.
pub async fn eventually_async(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !done().await {
        assert!(
            std::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A TCP port with nothing listening on it (yet).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The counts of a result's or a batch report's `dead` (reason -> count), without zeros.
pub fn dead_counts(dead: &serde_json::Value) -> std::collections::BTreeMap<String, u64> {
    dead.as_object()
        .unwrap_or_else(|| panic!("dead is an object of counts: {dead}"))
        .iter()
        .map(|(reason, n)| (reason.clone(), n.as_u64().unwrap()))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Log lines written into a shared buffer: the writer of a test's tracing subscriber.
#[derive(Clone, Default)]
pub struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Lines {
    /// What was written so far (kept).
    #[allow(dead_code)]
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// What was written since the last call (taken).
    #[allow(dead_code)]
    pub fn take(&self) -> String {
        String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap()
    }
}

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Lines {
    type Writer = Lines;
    fn make_writer(&'w self) -> Self::Writer {
        self.clone()
    }
}

/// A new exclusive queue on `connection` (named by the broker, gone with the connection), its
/// deliveries handed to `each` with the queue's name as they come (no ack needed); returns the
/// name.
pub async fn listen(
    connection: &lapin::Connection,
    mut each: impl FnMut(&str, &lapin::message::Delivery) + Send + 'static,
) -> String {
    use futures::StreamExt;
    use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let channel = connection.create_channel().await.unwrap();
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .name()
        .to_string();
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            unique("listener").as_str().into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let name = queue.clone();
    tokio::spawn(async move {
        // The channel lives as long as its consumer.
        let _channel = channel;
        while let Some(Ok(delivery)) = consumer.next().await {
            each(&name, &delivery);
        }
    });
    queue
}

/// A `turnstile consume` process (the test binary's own build) on the rig's queue, keys, mock
/// and limit, with `workers` workers and no HTTP port; quiet but for warnings, not shown.
pub fn spawn_consumer(rig: &Rig, workers: u32) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("consume")
        .env("TURNSTILE_QUEUE", rig.topology.work())
        .env("TURNSTILE_KEY_PREFIX", &rig.key_prefix)
        .env("TURNSTILE_REDIS_URL", rig.redis_url())
        .env("TURNSTILE_REDIS_DURABLE", "true")
        .env("TURNSTILE_DOWNSTREAM_URL", rig.mock.url())
        .env("TURNSTILE_LIMIT", rig.limit.to_string())
        .env("TURNSTILE_HTTP_ADDR", "off")
        .env("TURNSTILE_WORKERS", workers.to_string())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("turnstile consume starts")
}

/// Publishes each JSON body with its properties (made persistent and `application/json`) to
/// the rig's work queue, in order, each confirmed before the next.
pub async fn publish_confirmed(
    rig: &Rig,
    messages: impl IntoIterator<Item = (serde_json::Value, lapin::BasicProperties)>,
) {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let channel = rig.connection().create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for (body, properties) in messages {
        let properties = properties
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        channel
            .basic_publish(
                "".into(),
                rig.topology.work().into(),
                BasicPublishOptions::default(),
                &serde_json::to_vec(&body).unwrap(),
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let _ = channel.close(200, "published".into()).await;
}
