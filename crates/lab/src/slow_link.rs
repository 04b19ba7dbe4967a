//! A TCP proxy on loopback that adds a fixed latency each way: a slow link between a replica
//! and Redis or the broker (another region, a congested network, a busy proxy), for fault tests
//! and benches. Bytes keep their order and are delayed, not throttled: a pipeline of requests
//! costs one round trip, as on a real link. It breaks the link two ways, without touching the
//! server behind it (which other tests share), until [`SlowLink::restore`]:
//! - [`SlowLink::cut`]: a link that resets (a partition that resets, a server gone): every
//!   connection closed, every new one closed at once;
//! - [`SlowLink::hang`]: a link that hangs (a partition that drops packets, a stuck proxy or
//!   load balancer): every connection stays open and nothing passes either way, new ones are
//!   accepted and held the same way; seen by a client only through its own timeouts.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
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
    /// True while hung ([`SlowLink::hang`]): no byte forwarded, on any connection.
    hung: watch::Sender<bool>,
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
        let hung = watch::Sender::new(false);
        let holding = hung.subscribe();
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
                let (delay, mut hung) = (delay.clone(), holding.clone());
                tokio::spawn(async move {
                    // Accepted while hung: it reaches the server only once restored.
                    tokio::select! {
                        () = flowing(&mut hung) => {}
                        () = stop.cancelled() => return,
                    }
                    if let Ok(server) = TcpStream::connect(target).await {
                        link(client, server, delay, hung, stop).await;
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
            hung,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the link: closes every connection, and every new one as soon as it is accepted,
    /// until [`SlowLink::restore`]. Connections held by [`SlowLink::hang`] are closed too.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
        let fresh = self.stop.child_token();
        std::mem::replace(&mut *self.links.lock().expect("never poisoned"), fresh).cancel();
    }

    /// Hangs the link: every connection stays open and no byte is forwarded either way (a
    /// close or a reset neither: a peer that closed is seen only once restored), and every new
    /// connection is accepted and held the same way, not yet connected to the server, until
    /// [`SlowLink::restore`]. A client sees nothing but silence: its writes fill the socket
    /// buffers, then block. Bounded: the link stops reading while hung, so each connection
    /// holds at most one chunk (64 KiB) each way beyond the kernel's socket buffers (and, with
    /// a latency, what it read within that latency before the hang); the connections
    /// themselves are not bounded.
    pub fn hang(&self) {
        self.hung.send_replace(true);
    }

    /// Heals the link after [`SlowLink::cut`] or [`SlowLink::hang`]: new connections are
    /// forwarded again. After a hang, as after a healed partition, every held connection
    /// resumes where it stopped: the bytes held are delivered first, in order, then the rest
    /// flows (requests a client gave up on may still reach the server, and answers a client
    /// that moved on; a peer that closed meanwhile is seen now, and its connection closed), and
    /// a connection accepted while hung reaches the server only now.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::Relaxed);
        self.hung.send_replace(false);
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

    /// The broker URL `url` through the link: its host and port replaced by the link's, its
    /// scheme, credentials, vhost and query kept.
    pub fn amqp_url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
        let (authority, path) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
        let user = authority
            .rsplit_once('@')
            .map(|(user, _)| format!("{user}@"))
            .unwrap_or_default();
        format!("{scheme}://{user}{}{path}", self.addr)
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The address of the server a URL names (`amqp://user:pass@host:port/vhost`,
/// `redis://host:port/`; the first of a comma-separated list; the scheme's port when none is
/// given): what a link in front of it forwards to.
pub async fn address_of(url: &str) -> anyhow::Result<SocketAddr> {
    let first = url.split(',').next().unwrap_or_default().trim();
    let (scheme, rest) = first.split_once("://").unwrap_or(("", first));
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let port = match scheme {
        "amqps" => 5671,
        "redis" | "rediss" => 6379,
        _ => 5672,
    };
    let named = if host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host.to_owned()
    } else {
        format!("{host}:{port}")
    };
    tokio::net::lookup_host(&named)
        .await
        .map_err(|e| anyhow::anyhow!("{named} does not resolve: {e}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{named} has no address"))
}

/// Resolves once the link is not hung (at once if it is not, or if the link is gone).
async fn flowing(hung: &mut watch::Receiver<bool>) {
    let _ = hung.wait_for(|hung| !hung).await;
}

/// Forwards both ways until either side closes or `stop`; nothing passes while `hung`.
async fn link(
    client: TcpStream,
    server: TcpStream,
    one_way: Arc<AtomicU64>,
    hung: watch::Receiver<bool>,
    stop: CancellationToken,
) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = delayed(client_read, server_write, one_way.clone(), hung.clone()) => {}
        _ = delayed(server_read, client_write, one_way, hung) => {}
        _ = stop.cancelled() => {}
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read, in order; while `hung`,
/// neither reads nor writes (a chunk read just before is held until then).
async fn delayed(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Arc<AtomicU64>,
    hung: watch::Receiver<bool>,
) {
    let (mut reading, mut writing) = (hung.clone(), hung);
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
            flowing(&mut writing).await;
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
            flowing(&mut reading).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Long enough for a byte to cross loopback many times over: silence for this long means
    /// nothing passes.
    const SILENCE: Duration = Duration::from_millis(500);

    /// An echo server on loopback, counting the bytes it received.
    async fn echo_server() -> (SocketAddr, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(AtomicU64::new(0));
        let counted = received.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    let mut buffer = [0u8; 1024];
                    while let Ok(n @ 1..) = socket.read(&mut buffer).await {
                        counted.fetch_add(n as u64, Ordering::Relaxed);
                        if socket.write_all(&buffer[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, received)
    }

    /// A server on loopback that writes `tick` every 20 ms on each connection, unasked.
    async fn ticking_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    while socket.write_all(b"tick").await.is_ok() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
            }
        });
        addr
    }

    /// Reads exactly `n` bytes, failing after ten seconds (a guard, not a speed check).
    async fn read_exactly(socket: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; n];
        tokio::time::timeout(Duration::from_secs(10), socket.read_exact(&mut bytes))
            .await
            .expect("the bytes came")
            .unwrap();
        bytes
    }

    /// Whether anything at all can be read within [`SILENCE`].
    async fn says_anything(socket: &mut TcpStream) -> bool {
        let mut buffer = [0u8; 1024];
        tokio::time::timeout(SILENCE, socket.read(&mut buffer))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_hung_link_passes_no_byte_on_old_or_new_connections_and_delivers_them_once_restored()
    {
        let (echo, received) = echo_server().await;
        let link = SlowLink::start(echo, Duration::ZERO).await.unwrap();
        let mut old = TcpStream::connect(link.addr()).await.unwrap();
        old.write_all(b"before").await.unwrap();
        assert_eq!(read_exactly(&mut old, 6).await, b"before");

        link.hang();
        old.write_all(b"during").await.unwrap();
        let mut new = TcpStream::connect(link.addr()).await.unwrap();
        new.write_all(b"while hung").await.unwrap();
        assert!(
            !says_anything(&mut old).await,
            "nothing comes back while hung"
        );
        assert!(
            !says_anything(&mut new).await,
            "nor on a connection made while hung"
        );
        assert_eq!(
            received.load(Ordering::Relaxed),
            6,
            "the server received nothing while hung"
        );
        assert_eq!(link.accepted(), 2, "the new connection was accepted");

        link.restore();
        assert_eq!(
            read_exactly(&mut old, 6).await,
            b"during",
            "held bytes flow"
        );
        assert_eq!(read_exactly(&mut new, 10).await, b"while hung");
        old.write_all(b"after").await.unwrap();
        assert_eq!(read_exactly(&mut old, 5).await, b"after", "and new ones");
    }

    #[tokio::test]
    async fn a_hung_link_passes_nothing_from_the_server_until_restored() {
        let link = SlowLink::start(ticking_server().await, Duration::ZERO)
            .await
            .unwrap();
        let mut client = TcpStream::connect(link.addr()).await.unwrap();
        assert_eq!(read_exactly(&mut client, 4).await, b"tick");

        link.hang();
        // What was already on its way when the link hung (a tick or two).
        for _ in 0..10 {
            if !says_anything(&mut client).await {
                break;
            }
        }
        assert!(!says_anything(&mut client).await, "no tick while hung");

        link.restore();
        assert_eq!(read_exactly(&mut client, 4).await, b"tick", "ticks again");
    }

    #[tokio::test]
    async fn a_cut_closes_the_connections_a_hang_holds() {
        let (echo, _) = echo_server().await;
        let link = SlowLink::start(echo, Duration::ZERO).await.unwrap();
        let mut old = TcpStream::connect(link.addr()).await.unwrap();
        old.write_all(b"x").await.unwrap();
        read_exactly(&mut old, 1).await;
        link.hang();
        let mut new = TcpStream::connect(link.addr()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;

        link.cut();
        for socket in [&mut old, &mut new] {
            let mut buffer = [0u8; 16];
            let read = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut buffer))
                .await
                .expect("closed, not silent");
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        }
    }

    #[tokio::test]
    async fn a_broker_url_through_the_link_keeps_its_credentials_vhost_and_query() {
        let link = SlowLink::start("127.0.0.1:5672".parse().unwrap(), Duration::ZERO)
            .await
            .unwrap();
        let at = link.addr();
        assert_eq!(
            link.amqp_url("amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=5"),
            format!("amqp://guest:guest@{at}/%2f?heartbeat=5")
        );
        assert_eq!(
            link.amqp_url("amqps://rabbit.example:5671"),
            format!("amqps://{at}")
        );
    }

    #[tokio::test]
    async fn the_address_of_a_url_is_its_host_and_port_or_the_schemes_port() {
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let of = async |url: &str| address_of(url).await.unwrap();
        assert_eq!(of("amqp://guest:guest@127.0.0.1:5673/%2f").await, at(5673));
        assert_eq!(of("amqp://127.0.0.1").await, at(5672));
        assert_eq!(of("redis://127.0.0.1/0").await, at(6379));
        assert_eq!(
            of("redis://:pw@127.0.0.1:6380/,redis://127.0.0.2:6381/").await,
            at(6380)
        );
    }
}
