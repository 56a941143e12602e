//! A TCP proxy on a loopback port, between a client and a server, that can misbehave on
//! command: stall (hold bytes in both directions), delay (add latency to every chunk), cut
//! (reset every open connection), refuse (close new connections at once), drop replies (the
//! server executes what it receives, but nothing it answers reaches the client) and add latency
//! (every chunk arrives a fixed time after it was sent, as over a long network path: a slow
//! server, not a narrow one).

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// What the proxy does to traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Pass,
    /// Hold every byte (both directions, open and new connections) until the mode changes.
    Stall,
    /// Forward every chunk after this delay, one chunk at a time: delays add up, so a busy
    /// connection (a watch) falls further and further behind.
    Delay(Duration),
    /// Forward every chunk this long after it was read, however many are in flight: a fixed
    /// latency with the connection's throughput kept (a slow API server, a long network path).
    Latency(Duration),
    /// Forward requests, discard every reply.
    DropReplies,
    /// Close new connections at once (open ones keep working).
    Refuse,
}

/// The running proxy; stops with its runtime.
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    mode: Arc<watch::Sender<Mode>>,
    cuts: Arc<watch::Sender<u64>>,
    upstream: Arc<AtomicU16>,
}

impl Proxy {
    /// Starts a proxy to `127.0.0.1:upstream`.
    pub async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let mode = Arc::new(watch::channel(Mode::Pass).0);
        let cuts = Arc::new(watch::channel(0u64).0);
        let (mode_tx, cuts_tx) = (mode.clone(), cuts.clone());
        let upstream = Arc::new(AtomicU16::new(upstream));
        let target = upstream.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if *mode_tx.borrow() == Mode::Refuse {
                    drop(client);
                    continue;
                }
                let (mode, cuts) = (mode_tx.subscribe(), cuts_tx.subscribe());
                let upstream = target.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let up = pump(client_read, server_write, mode.clone(), false);
                    let down = pump(server_read, client_write, mode, true);
                    let mut cuts = cuts;
                    let cut = async move {
                        let _ = cuts.changed().await;
                    };
                    // Whichever ends first ends the connection: both halves drop, so both
                    // sockets close (a cut looks like a reset network path).
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                        _ = cut => {}
                    }
                });
            }
        });
        Proxy {
            port,
            mode,
            cuts,
            upstream,
        }
    }

    /// Sends new connections to `127.0.0.1:upstream` from now on (a failover's new primary);
    /// open ones stay where they are until [`Proxy::cut`].
    pub fn retarget(&self, upstream: u16) {
        self.upstream.store(upstream, Ordering::SeqCst);
    }

    /// Changes what the proxy does; held bytes of a stall flow on when it ends.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Closes every open connection.
    pub fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }
}

/// Copies one direction, applying the mode to each chunk. Chunks are read as they come and
/// written by a second task, so that a latency delays each chunk without holding up the reads.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    replies: bool,
) {
    let (chunks, mut pending) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = async move {
        while let Some((due, chunk)) = pending.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // Hold the chunk while stalled.
            while *mode.borrow_and_update() == Mode::Stall {
                if mode.changed().await.is_err() {
                    return;
                }
            }
            let current = *mode.borrow();
            let due = match current {
                Mode::Delay(d) => {
                    tokio::time::sleep(d).await;
                    Instant::now()
                }
                Mode::Latency(d) => Instant::now() + d,
                Mode::DropReplies if replies => continue,
                _ => Instant::now(),
            };
            if chunks.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    // The writer drains what was read before the reader ended (a closed connection still
    // delivers its last, delayed bytes); a failed write ends both.
    tokio::select! {
        _ = writer => {}
        _ = async { reader.await; std::future::pending::<()>().await } => {}
    }
}
