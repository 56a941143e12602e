//! A real Sentinel topology on loopback ports: one primary, two replicas and three sentinels
//! (quorum 2), optionally TLS-only (Redis 7.0, the one server here built with TLS) with client
//! certificates required everywhere. Short Sentinel timings (`down-after-milliseconds` 1000,
//! `failover-timeout` 3000) make an unplanned failover take a few seconds.
//!
//! The sentinels run the same `valkey-server`/`redis-server` binary with `--sentinel`. They
//! keep the default user without a password (so they reach each other), and the test adds the
//! ACL users it needs with [`Topology::sentinel_acl`].

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{Client, Value};

use super::server::{
    Listen, Server, ServerKind, answering_process, free_port, on_other_ports, tail,
};
use super::tls::Certs;

/// The master name the sentinels monitor.
pub const MASTER: &str = "mymaster";

/// `down-after-milliseconds` of the test sentinels.
pub const DOWN_AFTER: Duration = Duration::from_millis(1000);

/// How a topology is built.
#[derive(Clone)]
pub struct Options {
    /// The server flavour of every process.
    pub kind: ServerKind,
    /// Extra arguments of every data node (e.g. `--min-replicas-to-write 1`).
    pub data_args: Vec<String>,
    /// TLS-only everywhere, client certificates required, with these certificates.
    pub tls: Option<Arc<Certs>>,
    /// The address every process also listens on and the sentinels announce (the node's
    /// address, for pods); loopback only when `None`.
    pub host: Option<String>,
    /// The default user's password on the data nodes (the sentinels and replicas use it too).
    pub password: Option<String>,
    /// Wait until every sentinel knows the other two and both replicas, as a failover needs.
    /// Without it, start returns once the sentinels answer for the primary (a few seconds
    /// sooner), enough for tests that never fail over.
    pub failover_ready: bool,
}

impl Options {
    /// Plain TCP, no extra arguments.
    pub fn plain(kind: ServerKind) -> Options {
        Options {
            kind,
            data_args: Vec::new(),
            tls: None,
            host: None,
            password: None,
            failover_ready: true,
        }
    }
}

/// One sentinel process; killed on drop.
pub struct Sentinel {
    /// Its port.
    pub port: u16,
    child: Child,
    dir: tempfile::TempDir,
}

impl Sentinel {
    /// Stops the sentinel (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The sentinel's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The running topology.
pub struct Topology {
    /// The data nodes; node 0 is the first primary, 1 and 2 replicate it.
    pub nodes: Vec<Server>,
    /// The three sentinels.
    pub sentinels: Vec<Sentinel>,
    options: Options,
}

impl Topology {
    /// Starts the data nodes and the sentinels; returns once every replica is in sync and every
    /// sentinel knows the other two and both replicas. Panics with the sentinels' view after
    /// 30 s.
    pub fn start(options: Options) -> Topology {
        // Replicas sync at once rather than after the default 5 s wait for more replicas.
        let mut node_args: Vec<String> = ["--repl-diskless-sync-delay", "0"]
            .map(String::from)
            .to_vec();
        node_args.extend(options.data_args.iter().cloned());
        let listen = if let Some(certs) = &options.tls {
            node_args.extend(tls_args(certs));
            node_args.extend(["--tls-replication".into(), "yes".into()]);
            Listen::Tls
        } else {
            Listen::Plain
        };
        if let Some(host) = &options.host {
            node_args.extend(["--bind".into(), "127.0.0.1".into(), host.clone()]);
        }
        if let Some(password) = &options.password {
            node_args.extend(["--requirepass".into(), password.clone()]);
            node_args.extend(["--masterauth".into(), password.clone()]);
        }
        let start = |extra: &[&str]| {
            let mut all: Vec<&str> = node_args.iter().map(String::as_str).collect();
            all.extend_from_slice(extra);
            Server::start_listening(options.kind, listen, &all)
        };
        let primary = start(&[]);
        let port = primary.port.to_string();
        let host = options.host.clone().unwrap_or_else(|| "127.0.0.1".into());
        let replica_of = ["--replicaof", host.as_str(), port.as_str()];
        let replicas = [start(&replica_of), start(&replica_of)];
        let mut nodes = vec![primary];
        nodes.extend(replicas);
        let primary_port = nodes[0].port;
        let sentinels = (0..3)
            .map(|_| spawn_sentinel(&options, primary_port))
            .collect();
        let topology = Topology {
            nodes,
            sentinels,
            options,
        };
        topology.wait(
            "replicas in sync and sentinels acquainted",
            Duration::from_secs(30),
            |t| {
                t.nodes[1..].iter().all(|n| {
                    t.query(n.port, &["INFO", "replication"])
                        .is_ok_and(|info| text(&info).contains("master_link_status:up"))
                }) && t.sentinels.iter().all(|s| {
                    t.query(s.port, &["SENTINEL", "MASTER", MASTER])
                        .is_ok_and(|m| {
                            !t.options.failover_ready
                                || (field(&m, "num-other-sentinels") == Some("2".into())
                                    && field(&m, "num-slaves") == Some("2".into()))
                        })
                })
            },
        );
        topology
    }

    /// `<host>:<port>` of every sentinel.
    pub fn sentinel_addrs(&self) -> Vec<String> {
        let host = self.options.host.as_deref().unwrap_or("127.0.0.1");
        self.sentinels
            .iter()
            .map(|s| format!("{host}:{}", s.port))
            .collect()
    }

    /// The port the first sentinel that answers names as the primary.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| self.named_by(s.port))
    }

    /// The primary's port as the sentinel on `port` names it.
    fn named_by(&self, port: u16) -> Option<u16> {
        let reply = self
            .query(port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER])
            .ok()?;
        match reply {
            Value::Array(items) => text(items.get(1)?).parse().ok(),
            _ => None,
        }
    }

    /// The data node on `port`.
    pub fn node(&mut self, port: u16) -> &mut Server {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }

    /// Asks the first sentinel for a planned failover (`SENTINEL FAILOVER`).
    pub fn failover(&self) {
        let reply = self
            .query(self.sentinels[0].port, &["SENTINEL", "FAILOVER", MASTER])
            .unwrap_or_else(|e| panic!("SENTINEL FAILOVER: {e}"));
        assert_eq!(text(&reply), "OK", "SENTINEL FAILOVER");
    }

    /// Waits until every running sentinel names a primary other than `old` and that node
    /// answers role:master; returns its port.
    pub fn wait_for_new_primary(&self, old: u16, limit: Duration) -> u16 {
        let mut found = 0;
        self.wait("a new primary", limit, |t| {
            let named: Vec<Option<u16>> = t
                .sentinels
                .iter()
                .map(|s| t.named_by(s.port))
                .filter(Option::is_some)
                .collect();
            let Some(Some(port)) = named.first().copied() else {
                return false;
            };
            found = port;
            port != old
                && named.iter().all(|n| *n == Some(port))
                && t.query(port, &["INFO", "replication"])
                    .is_ok_and(|info| text(&info).contains("role:master"))
        });
        found
    }

    /// Runs `rule` (`ACL SETUSER` arguments after the user name, e.g. `on >pw -@all ...`) for
    /// `user` on every sentinel.
    pub fn sentinel_acl(&self, user: &str, rule: &[&str]) {
        for s in &self.sentinels {
            let mut args = vec!["ACL", "SETUSER", user];
            args.extend_from_slice(rule);
            let reply = self
                .query(s.port, &args)
                .unwrap_or_else(|e| panic!("ACL SETUSER on sentinel {}: {e}", s.port));
            assert_eq!(text(&reply), "OK", "ACL SETUSER on sentinel {}", s.port);
        }
    }

    /// Runs `args` on every data node (ACL rules are per node).
    pub fn on_every_node(&self, args: &[&str]) {
        for n in &self.nodes {
            let reply = self
                .query(n.port, args)
                .unwrap_or_else(|e| panic!("{args:?} on node {}: {e}", n.port));
            assert_eq!(text(&reply), "OK", "{:?} on node {}", args[0], n.port);
        }
    }

    /// One command as the default user on the process at `port` (TLS when the topology is).
    pub fn query(&self, port: u16, args: &[&str]) -> redis::RedisResult<Value> {
        // The data nodes' default user has the password; the sentinels' has none.
        let auth = match &self.options.password {
            Some(pw) if self.nodes.iter().any(|n| n.port == port) => format!(":{pw}@"),
            _ => String::new(),
        };
        let client = match &self.options.tls {
            None => Client::open(format!("redis://{auth}127.0.0.1:{port}")),
            Some(certs) => {
                Client::build_with_tls(format!("rediss://127.0.0.1:{port}"), certs.admin_certs())
            }
        }?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn)
    }

    /// The sentinels' logs, for failure messages.
    pub fn sentinel_logs(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| format!("--- sentinel {}\n{}", s.port, tail(&s.log(), 30)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn wait(&self, what: &str, limit: Duration, mut done: impl FnMut(&Topology) -> bool) {
        let deadline = Instant::now() + limit;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "sentinel topology: {what} not reached within {limit:?}\n{}",
                self.sentinel_logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// TLS arguments of a process: it presents the server certificate to those connecting and the
/// client certificate when it connects out (a replica to its primary, a sentinel to anyone),
/// and requires a client certificate of the test CA.
fn tls_args(certs: &Certs) -> Vec<String> {
    let p = |file: &str| certs.path(file).display().to_string();
    [
        ("--tls-cert-file", p("server.crt")),
        ("--tls-key-file", p("server.key")),
        ("--tls-client-cert-file", p("client.crt")),
        ("--tls-client-key-file", p("client.key")),
        ("--tls-ca-cert-file", p("ca.crt")),
        ("--tls-auth-clients", "yes".into()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_owned(), v])
    .collect()
}

fn spawn_sentinel(options: &Options, primary_port: u16) -> Sentinel {
    let dir = tempfile::tempdir().expect("temp dir");
    let binary = options.kind.binary();
    let what = format!("{} sentinel", options.kind.name());
    let (port, child) = on_other_ports(&what, 5, || {
        let port = free_port();
        let mut conf = String::new();
        match &options.tls {
            None => conf.push_str(&format!("port {port}\n")),
            Some(tls) => {
                conf.push_str(&format!("port 0\ntls-port {port}\ntls-replication yes\n"));
                for pair in tls_args(tls).chunks(2) {
                    conf.push_str(&format!(
                        "{} {}\n",
                        pair[0].trim_start_matches("--"),
                        pair[1]
                    ));
                }
            }
        }
        let host = options.host.as_deref().unwrap_or("127.0.0.1");
        let bind = match &options.host {
            Some(host) => format!("127.0.0.1 {host}"),
            None => "127.0.0.1".into(),
        };
        conf.push_str(&format!(
            "bind {bind}\ndir {dir}\nlogfile {dir}/sentinel.log\n\
             sentinel monitor {MASTER} {host} {primary_port} 2\n\
             sentinel down-after-milliseconds {MASTER} {down}\n\
             sentinel failover-timeout {MASTER} 3000\n\
             sentinel parallel-syncs {MASTER} 2\n",
            dir = dir.path().display(),
            down = DOWN_AFTER.as_millis()
        ));
        // After `sentinel monitor`, which it refers to.
        if let Some(password) = &options.password {
            conf.push_str(&format!("sentinel auth-pass {MASTER} {password}\n"));
        }
        let path = dir.path().join("sentinel.conf");
        std::fs::write(&path, conf).expect("write sentinel.conf");
        let mut child = Command::new(&binary)
            .arg(&path)
            .arg("--sentinel")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a sentinel");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(dir.path().join("sentinel.log"));
                return Err(format!(
                    "sentinel exited with {status}: {}",
                    tail(&log.unwrap_or_default(), 5)
                ));
            }
            // Plain TCP: ready when INFO names this child (until it does, the port may be
            // another process's, answering before this one fails to bind and exits). Over TLS,
            // without a TLS client at hand, a listening socket is the signal.
            let ready = match options.tls {
                None => answering_process(port, None) == Some(child.id()),
                Some(_) => std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
            };
            if ready {
                return Ok((port, child));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err("sentinel did not listen within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    Sentinel { port, child, dir }
}

/// A reply as text (a bulk or simple string; arrays joined by newlines).
pub fn text(value: &Value) -> String {
    match value {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Okay => "OK".into(),
        Value::VerbatimString { text, .. } => text.clone(),
        Value::Int(i) => i.to_string(),
        Value::Array(items) => items.iter().map(text).collect::<Vec<_>>().join("\n"),
        other => format!("{other:?}"),
    }
}

/// A field of a flat `[name, value, name, value, ...]` reply (`SENTINEL MASTER`).
fn field(reply: &Value, name: &str) -> Option<String> {
    let Value::Array(items) = reply else {
        return None;
    };
    items
        .chunks(2)
        .find(|pair| text(&pair[0]) == name)
        .and_then(|pair| pair.get(1).map(text))
}
