//! A private `redis-server` on a free loopback port, as a child process that can be stopped
//! and started again (empty, as a Redis without persistence restarts). For fault injection in
//! tests and `turnstile bench faults`; never touches the Redis turnstile is configured with.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

pub struct LocalRedis {
    port: u16,
    child: Option<Child>,
    /// Where the server keeps its snapshot (`dump.rdb`), if it loads one at start.
    snapshots: Option<std::path::PathBuf>,
}

impl LocalRedis {
    /// Starts `redis-server` on a free port and waits until it answers.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_in(None)
    }

    /// As [`LocalRedis::start`], with RDB snapshots in `dir`: the server saves only when told
    /// (`SAVE`), and at every (re)start loads the last snapshot saved, as a Redis restarted
    /// after a crash does with Debian's default persistence.
    pub fn start_with_snapshots(dir: &std::path::Path) -> anyhow::Result<Self> {
        Self::start_in(Some(dir.to_owned()))
    }

    fn start_in(snapshots: Option<std::path::PathBuf>) -> anyhow::Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut redis = Self {
            port,
            child: None,
            snapshots,
        };
        redis.restart()?;
        Ok(redis)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The folder the server keeps its files in (its working directory).
    pub fn dir(&self) -> std::path::PathBuf {
        self.snapshots.clone().unwrap_or_else(|| self.scratch_dir())
    }

    /// The folder of a server without snapshots (removed when it is dropped).
    fn scratch_dir(&self) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("turnstile-redis-{}", self.port))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (its data is gone, as with a crash of a Redis without persistence).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port: empty, or from its last snapshot.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        let mut command = Command::new("redis-server");
        command.args([
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]);
        // Its files (a snapshot, or the copy a replica receives from its primary) go to a
        // folder of its own, never to the caller's working directory.
        let dir = match &self.snapshots {
            Some(dir) => dir.clone(),
            None => {
                let dir = self.scratch_dir();
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                dir
            }
        };
        command
            .arg("--dir")
            .arg(&dir)
            .args(["--dbfilename", "dump.rdb"]);
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server (is it installed?)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "redis-server did not start on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for LocalRedis {
    fn drop(&mut self) {
        self.stop();
        if self.snapshots.is_none() {
            let _ = std::fs::remove_dir_all(self.scratch_dir());
        }
    }
}
