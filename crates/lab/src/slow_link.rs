//! A TCP proxy on loopback that adds a fixed latency each way: a slow link between a replica
//! and Redis or the broker (another region, a congested network, a busy proxy), for fault tests
//! and benches. Bytes keep their order and are delayed, not throttled: a pipeline of requests
//! costs one round trip, as on a real link. [`SlowLink::cut`] takes the link down (a network
//! partition, a server gone: every connection closed, every new one closed at once) without
//! touching the server behind it, which other tests share, until [`SlowLink::restore`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A running slow link; it stops (closing every connection) when dropped.
pub struct SlowLink {
    addr: SocketAddr,
    stop: CancellationToken,
    /// The latency each way, in µs (changed with [`SlowLink::set_one_way`]).
    one_way_us: Arc<AtomicU64>,
    /// While set, every connection accepted is closed at once.
    cut: Arc<AtomicBool>,
    /// Cancelled by [`SlowLink::cut`]: closes the connections forwarded until then.
    links: Arc<Mutex<CancellationToken>>,
    /// Connections accepted so far (forwarded, or closed while cut).
    accepted: Arc<AtomicU64>,
}

impl SlowLink {
    /// Listens on a free loopback port and forwards each connection to `target`, delaying the
    /// bytes by `one_way` in each direction (a round trip of twice that).
    pub async fn start(target: SocketAddr, one_way: Duration) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let accepting = stop.clone();
        let one_way_us = Arc::new(AtomicU64::new(one_way.as_micros() as u64));
        let delay = one_way_us.clone();
        let cut = Arc::new(AtomicBool::new(false));
        let links = Arc::new(Mutex::new(stop.child_token()));
        let accepted = Arc::new(AtomicU64::new(0));
        let (refusing, current, counted) = (cut.clone(), links.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                    _ = accepting.cancelled() => return,
                };
                counted.fetch_add(1, Ordering::Relaxed);
                if refusing.load(Ordering::Relaxed) {
                    drop(client);
                    continue;
                }
                let stop = current.lock().expect("never poisoned").clone();
                let delay = delay.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(target).await {
                        link(client, server, delay, stop).await;
                    }
                });
            }
        });
        Ok(Self {
            addr,
            stop,
            one_way_us,
            cut,
            links,
            accepted,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the link: closes every connection, and every new one as soon as it is accepted,
    /// until [`SlowLink::restore`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
        let fresh = self.stop.child_token();
        std::mem::replace(&mut *self.links.lock().expect("never poisoned"), fresh).cancel();
    }

    /// Forwards new connections again after [`SlowLink::cut`].
    pub fn restore(&self) {
        self.cut.store(false, Ordering::Relaxed);
    }

    /// How many connections it accepted so far (those closed while cut included).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Changes the latency each way, for the bytes read from now on (e.g. none, to tear a
    /// test down quickly).
    pub fn set_one_way(&self, one_way: Duration) {
        self.one_way_us
            .store(one_way.as_micros() as u64, Ordering::Relaxed);
    }

    /// A `redis://` URL through the link.
    pub fn redis_url(&self) -> String {
        format!("redis://{}/", self.addr)
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Forwards both ways until either side closes or `stop`.
async fn link(
    client: TcpStream,
    server: TcpStream,
    one_way: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = delayed(client_read, server_write, one_way.clone()) => {}
        _ = delayed(server_read, client_write, one_way) => {}
        _ = stop.cancelled() => {}
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read, in order.
async fn delayed(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Arc<AtomicU64>,
) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = async move {
        let mut pending = VecDeque::new();
        loop {
            let Some((at, bytes)) = (match pending.pop_front() {
                Some(next) => Some(next),
                None => due.recv().await,
            }) else {
                return;
            };
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
            while let Ok(next) = due.try_recv() {
                pending.push_back(next);
            }
        }
    };
    let reader = async move {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let delay = Duration::from_micros(delay.load(Ordering::Relaxed));
                    if chunks
                        .send((Instant::now() + delay, buffer[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    };
    tokio::join!(reader, writer);
}
