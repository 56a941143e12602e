//! The members' peer network: each member advertises a proxy in front of its peer port, so a
//! test can cut one member off from the others while its client port keeps answering (a
//! partition, unlike SIGSTOP, which silences the member for clients too).
//!
//! Raft traffic (the message streams, pipelines and snapshots of etcd's `rafthttp`) names its
//! sender in the `X-Server-From` header of each connection's first request, and every request
//! on a connection comes from the member that opened it. A proxy reads that head before it
//! connects on, so it refuses (and, at the cut, closes) every connection to the cut member and
//! every connection from it. A request without the header (version probes, lease forwarding)
//! is refused towards the cut member only: one from it to the others still passes.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The proxies of all members and which member, if any, is cut off.
pub(super) struct PeerNet {
    shared: Arc<Shared>,
    /// `(proxy port, member peer port)` of each member.
    routes: Vec<(u16, u16)>,
}

#[derive(Default)]
struct Shared {
    /// The cut member: its index and its id as `X-Server-From` spells it (hex).
    cut: Mutex<Option<(usize, String)>>,
    /// Every open connection.
    open: Mutex<Vec<Connection>>,
    next: AtomicU64,
    stopped: AtomicBool,
}

/// An open connection: its number, its sender (if named), the member it goes to, and the two
/// sockets to shut down at a cut.
type Connection = (u64, Option<String>, usize, TcpStream, TcpStream);

impl Shared {
    fn refuses(&self, from: Option<&str>, to: usize) -> bool {
        match &*self.cut.lock().expect("cut") {
            Some((member, id)) => *member == to || from == Some(id.as_str()),
            None => false,
        }
    }
}

impl PeerNet {
    /// A proxy for each of `peer_ports` (a member's own peer port), on a port of its own.
    pub(super) fn start(peer_ports: &[u16]) -> PeerNet {
        let shared = Arc::new(Shared::default());
        let mut routes = Vec::new();
        for (to, &peer) in peer_ports.iter().enumerate() {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind a peer proxy");
            let port = listener.local_addr().expect("proxy address").port();
            routes.push((port, peer));
            let shared = shared.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if shared.stopped.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Ok(conn) = conn {
                        let shared = shared.clone();
                        std::thread::spawn(move || forward(&shared, conn, to, peer));
                    }
                }
            });
        }
        PeerNet { shared, routes }
    }

    /// The port member `i` advertises to its peers.
    pub(super) fn port(&self, i: usize) -> u16 {
        self.routes[i].0
    }

    /// Cuts member `i` (whose id is `id`, decimal as the gateway prints it) off from the
    /// others, closing every connection to or from it; `None` heals the network.
    pub(super) fn cut(&self, member: Option<(usize, &str)>) {
        let cut = member.map(|(i, id)| {
            let hex = id
                .parse::<u64>()
                .map(|n| format!("{n:x}"))
                .expect("member id");
            (i, hex)
        });
        *self.shared.cut.lock().expect("cut") = cut;
        for (_, from, to, a, b) in self.shared.open.lock().expect("open").iter() {
            if self.shared.refuses(from.as_deref(), *to) {
                let _ = a.shutdown(Shutdown::Both);
                let _ = b.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Drop for PeerNet {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        for (port, _) in &self.routes {
            // Wakes the accept loop, which then sees `stopped`.
            let _ = TcpStream::connect(("127.0.0.1", *port));
        }
        for (_, _, _, a, b) in self.shared.open.lock().expect("open").drain(..) {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }
}

/// Reads the first request's head, refuses it when the network says so, else connects to the
/// member and copies both ways until either side closes or a cut shuts the sockets down.
fn forward(shared: &Shared, mut conn: TcpStream, to: usize, peer: u16) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > 64 * 1024 {
            return;
        }
    }
    let from = sender(&head);
    if shared.refuses(from.as_deref(), to) {
        return;
    }
    let Ok(mut upstream) = TcpStream::connect(("127.0.0.1", peer)) else {
        return;
    };
    let _ = conn.set_read_timeout(None);
    if upstream.write_all(&head).is_err() {
        return;
    }
    let (Ok(conn_copy), Ok(up_copy)) = (conn.try_clone(), upstream.try_clone()) else {
        return;
    };
    let number = shared.next.fetch_add(1, Ordering::SeqCst);
    {
        let mut open = shared.open.lock().expect("open");
        // A cut that came between the check above and this registration closes it too.
        if shared.refuses(from.as_deref(), to) {
            return;
        }
        open.push((number, from, to, conn_copy, up_copy));
    }
    let (mut back_from, mut back_to) = match (upstream.try_clone(), conn.try_clone()) {
        (Ok(a), Ok(b)) => (a, b),
        _ => return,
    };
    let back = std::thread::spawn(move || {
        let _ = std::io::copy(&mut back_from, &mut back_to);
        let _ = back_to.shutdown(Shutdown::Both);
        let _ = back_from.shutdown(Shutdown::Both);
    });
    let _ = std::io::copy(&mut conn, &mut upstream);
    let _ = upstream.shutdown(Shutdown::Both);
    let _ = conn.shutdown(Shutdown::Both);
    let _ = back.join();
    shared
        .open
        .lock()
        .expect("open")
        .retain(|(n, ..)| *n != number);
}

/// The `X-Server-From` header of a request head, if any.
fn sender(head: &[u8]) -> Option<String> {
    String::from_utf8_lossy(head)
        .split("\r\n")
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("x-server-from"))
        .map(|(_, value)| value.trim().to_owned())
}
