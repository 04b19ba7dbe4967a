//! A local 3-node Redis Cluster for the cluster tests, started from `redis-server` on first use
//! (or taken from TURNSTILE_TEST_CLUSTER_URLS, e.g. one that `.ci/run` started). Idempotent and
//! safe across test binaries running at once: a lock directory serialises the start.

use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub const PORTS: [u16; 3] = [7101, 7102, 7103];

fn cluster_ok(port: u16) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string(), "cluster", "info"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok"))
        .unwrap_or(false)
}

fn start() {
    let dir = std::env::temp_dir().join("turnstile-test-cluster");
    std::fs::create_dir_all(&dir).unwrap();
    let lock = dir.join("lock");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::create_dir(&lock).is_err() {
        assert!(
            Instant::now() < deadline,
            "cluster start lock held too long: {lock:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    if !cluster_ok(PORTS[0]) {
        for port in PORTS {
            let _ = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "shutdown", "nosave"])
                .output();
            let conf = dir.join(format!("nodes-{port}.conf"));
            let _ = std::fs::remove_file(&conf);
            let status = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--daemonize",
                    "yes",
                ])
                .args(["--cluster-enabled", "yes", "--cluster-config-file"])
                .arg(&conf)
                .args(["--save", "", "--appendonly", "no", "--dir"])
                .arg(&dir)
                .arg("--logfile")
                .arg(dir.join(format!("redis-{port}.log")))
                .status()
                .expect("redis-server runs");
            assert!(
                status.success(),
                "redis-server on port {port} did not start"
            );
        }
        std::thread::sleep(Duration::from_millis(300));
        let nodes: Vec<String> = PORTS.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        while !PORTS.iter().all(|p| cluster_ok(*p)) {
            assert!(
                Instant::now() < deadline,
                "the local Redis Cluster did not become ready"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let _ = std::fs::remove_dir(&lock);
}

/// The node URLs of the test cluster, starting it if needed.
pub fn urls() -> Vec<String> {
    static URLS: OnceLock<Vec<String>> = OnceLock::new();
    URLS.get_or_init(|| {
        if let Ok(urls) = std::env::var("TURNSTILE_TEST_CLUSTER_URLS") {
            return urls.split(',').map(str::to_owned).collect();
        }
        start();
        PORTS
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}/"))
            .collect()
    })
    .clone()
}
