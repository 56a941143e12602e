//! A real etcd member on loopback ports (the binary the control plane's `e2e/build.sh` builds
//! from Go modules, etcd 3.7), with an administrator's access to its JSON gateway through
//! `curl`: every key under a prefix, to copy, delete or write by hand. A missing binary fails the
//! test; it never skips.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};

use super::kube::{e2e_bin, go_build_in};
use super::server::{free_port, on_other_ports, tail};
use peers::PeerNet;

mod peers;

/// The etcd binary (built once per machine by `e2e/build.sh`).
fn etcd_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = e2e_bin().join("etcd");
        assert!(bin.is_file(), "no etcd at {}", bin.display());
        bin
    })
    .clone()
}

/// Every key and value of a member, as a snapshot holds them.
pub type Snapshot = Vec<(Vec<u8>, Vec<u8>)>;

/// Makes sure the etcd binary is built (by `e2e/build.sh`, which waits for a build already
/// under way), before any trial's time limit starts: a suite with etcd trials calls it first,
/// so that on a machine that has built nothing the wait for the control plane's Go build is
/// not counted against a trial.
pub fn prepare() {
    let _ = etcd_binary();
}

/// [`prepare`], and builds `etcdutl` too (17 s on a machine that has built nothing, more beside
/// other suites), for a suite that restores snapshots: a trial holding leases of a fixed TTL
/// must not wait for a build.
pub fn prepare_restores() {
    prepare();
    let _ = etcdutl_binary();
}

/// One etcd member, its own one-member cluster; killed on drop.
pub struct EtcdServer {
    child: Child,
    /// The client port.
    pub port: u16,
    /// `http` or `https`.
    scheme: &'static str,
    /// What curl needs to reach it (the CA, a client certificate).
    curl: Vec<String>,
    _dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts a member and waits until it has a leader (itself).
    pub fn start() -> EtcdServer {
        Self::start_with(None)
    }

    /// Starts a member serving clients over TLS with `certs`' member certificate (signed by
    /// `ca.crt`), asking for a client certificate signed by it when `mtls`.
    pub fn start_tls(certs: &super::tls::Certs, mtls: bool) -> EtcdServer {
        Self::start_with(Some((certs, mtls)))
    }

    /// Starts the member; when its process exits while starting (its port was taken by another
    /// process between `free_port` and its bind: the suites run side by side), starts it again
    /// on other ports, up to three times.
    fn start_with(tls: Option<(&super::tls::Certs, bool)>) -> EtcdServer {
        on_other_ports("etcd", 3, || Self::try_start(tls))
    }

    /// Starts the member and waits until it leads: `Err` when its process exits first; panics
    /// after 20 s. A port that answers counts only when the member it names has this one's
    /// peer URL: another suite's etcd on a port both drew answers before this one fails to bind.
    fn try_start(tls: Option<(&super::tls::Certs, bool)>) -> Result<EtcdServer, String> {
        let dir = tempfile::tempdir().expect("etcd data folder");
        let (port, peer) = (free_port(), free_port());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{port}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let path = |certs: &super::tls::Certs, n: &str| certs.path(n).display().to_string();
        let (mut tls_args, mut curl) = (Vec::new(), Vec::new());
        if let Some((certs, mtls)) = tls {
            tls_args.push(format!("--cert-file={}", path(certs, "member.crt")));
            tls_args.push(format!("--key-file={}", path(certs, "member.key")));
            curl.extend(["--cacert".to_owned(), path(certs, "ca.crt")]);
            if mtls {
                tls_args.push("--client-cert-auth".into());
                tls_args.push(format!("--trusted-ca-file={}", path(certs, "ca.crt")));
                curl.extend(["--cert".to_owned(), path(certs, "client.crt")]);
                curl.extend(["--key".to_owned(), path(certs, "client.key")]);
            }
        }
        let child = Command::new(etcd_binary())
            .args(&tls_args)
            .arg("--name=contract")
            .arg(format!("--data-dir={}", dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=contract={peer_url}"))
            .args(["--initial-cluster-state=new", "--log-level=error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start etcd");
        let mut server = EtcdServer {
            child,
            port,
            scheme,
            curl,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!("it exited ({status}) on ports {port} and {peer}"));
            }
            let status = server.try_post("/v3/maintenance/status", &json!({}));
            if status
                .as_ref()
                .and_then(|s| s.get("leader"))
                .and_then(Value::as_str)
                .is_some_and(|l| l != "0")
                && server.names_peer(&peer_url)
            {
                return Ok(server);
            }
            assert!(
                Instant::now() < deadline,
                "etcd on port {port} had no leader after 20 s: {status:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the member answering on the client port has `peer_url` as its peer URL.
    fn names_peer(&self, peer_url: &str) -> bool {
        self.try_post("/v3/cluster/member/list", &json!({}))
            .and_then(|list| list.get("members").cloned())
            .and_then(|members| members.as_array().cloned())
            .is_some_and(|members| {
                members.iter().any(|m| {
                    m.get("peerURLs")
                        .and_then(Value::as_array)
                        .is_some_and(|urls| urls.iter().any(|u| u.as_str() == Some(peer_url)))
                })
            })
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.port)
    }

    fn try_post(&self, path: &str, body: &Value) -> Option<Value> {
        self.try_post_as(path, body, None)
    }

    /// A call to the gateway with the auth token `token`, if any.
    pub fn try_post_as(&self, path: &str, body: &Value, token: Option<&str>) -> Option<Value> {
        let mut command = Command::new("curl");
        command
            .args(["-s", "--max-time", "5", "-X", "POST"])
            .args(&self.curl);
        if let Some(token) = token {
            command.args(["-H", &format!("Authorization: {token}")]);
        }
        let output = command
            .arg(format!("{}{path}", self.url()))
            .arg("-d")
            .arg(body.to_string())
            .output()
            .expect("run curl");
        serde_json::from_slice(&output.stdout).ok()
    }

    /// A call to the gateway as an administrator; panics when it fails.
    pub fn post(&self, path: &str, body: &Value) -> Value {
        let reply = self
            .try_post(path, body)
            .unwrap_or_else(|| panic!("etcd {path} gave no JSON"));
        assert!(reply.get("code").is_none(), "etcd {path}: {reply}");
        reply
    }

    /// Every key and value.
    pub fn all(&self) -> Snapshot {
        let reply = self.post(
            "/v3/kv/range",
            &json!({"key": BASE64.encode([0u8]), "range_end": BASE64.encode([0u8])}),
        );
        let decode = |v: Option<&Value>| {
            BASE64
                .decode(v.and_then(Value::as_str).unwrap_or(""))
                .expect("base64")
        };
        reply
            .get("kvs")
            .and_then(Value::as_array)
            .map(|kvs| {
                kvs.iter()
                    .map(|kv| (decode(kv.get("key")), decode(kv.get("value"))))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Deletes every key: all data lost.
    pub fn wipe(&self) {
        self.post(
            "/v3/kv/deleterange",
            &json!({"key": BASE64.encode([0u8]), "range_end": BASE64.encode([0u8])}),
        );
    }

    /// Writes a key.
    pub fn put(&self, key: &[u8], value: &[u8]) {
        self.post(
            "/v3/kv/put",
            &json!({"key": BASE64.encode(key), "value": BASE64.encode(value)}),
        );
    }

    /// The value of a key, if any.
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let reply = self.post("/v3/kv/range", &json!({"key": BASE64.encode(key)}));
        let value = reply
            .pointer("/kvs/0")?
            .get("value")?
            .as_str()
            .unwrap_or("");
        Some(BASE64.decode(value).expect("base64"))
    }

    /// Replaces everything with `data`, as a restore of a snapshot that held it does.
    pub fn restore(&self, data: &Snapshot) {
        self.wipe();
        for (key, value) in data {
            self.put(key, value);
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A three-member etcd cluster on loopback ports, each member killable, restartable (on its
/// data), stoppable (SIGSTOP: a member that stops answering) and cut off from the others by
/// its peer network (a partition: it still answers clients); the whole cluster can be
/// restored from a snapshot, as an operator restores one with `etcdutl`.
pub struct EtcdCluster {
    members: Vec<Member>,
    peers: PeerNet,
    dir: tempfile::TempDir,
}

struct Member {
    /// Its arguments but `--data-dir`.
    args: Vec<String>,
    data_dir: PathBuf,
    /// Where its log goes (every run of it, appended), for a failure's message.
    log: PathBuf,
    port: u16,
    child: Option<Child>,
}

/// What a member says of itself: `(its id, the leader's id)` when it answers and has a leader.
type View = Option<(String, String)>;

/// How many of a member's last log lines a failure's message shows.
const LOG_TAIL: usize = 40;

impl Member {
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("etcd member log");
        let child = Command::new(etcd_binary())
            .args(&self.args)
            .arg(format!("--data-dir={}", self.data_dir.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
    }

    /// How its process ended, when it has (one whose port another process held exits at once).
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// The last lines of its log.
    fn tail(&self) -> String {
        tail(
            &std::fs::read_to_string(&self.log).unwrap_or_default(),
            LOG_TAIL,
        )
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `(its id, the leader's id)` as the member says, when it answers and has a leader.
    fn view(&self) -> View {
        let output = Command::new("curl")
            .args(["-s", "--max-time", "2", "-X", "POST"])
            .arg(format!("{}/v3/maintenance/status", self.url()))
            .args(["-d", "{}"])
            .output()
            .ok()?;
        let status: Value = serde_json::from_slice(&output.stdout).ok()?;
        let me = status.pointer("/header/member_id")?.as_str()?.to_owned();
        let leader = status.get("leader")?.as_str()?.to_owned();
        (leader != "0").then_some((me, leader))
    }
}

/// The cluster token every member and every restore uses.
const CLUSTER_TOKEN: &str = "targetlease-test";

impl EtcdCluster {
    /// Starts three members and waits until every one knows the leader. A member that exits
    /// while starting (its port was taken by another process between `free_port` and its
    /// bind: the suites run side by side) has the cluster started again on other ports, up to
    /// three times.
    pub fn start() -> EtcdCluster {
        on_other_ports("etcd cluster", 3, || {
            let mut cluster = Self::spawn_new();
            cluster
                .until_agreed(&[0, 1, 2], Duration::from_secs(30))
                .map(|()| cluster)
        })
    }

    /// Three new members on new ports, spawned.
    fn spawn_new() -> EtcdCluster {
        let dir = tempfile::tempdir().expect("etcd data folder");
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let peers = PeerNet::start(&ports.iter().map(|(_, peer)| *peer).collect::<Vec<_>>());
        let mut members: Vec<Member> = ports
            .iter()
            .enumerate()
            .map(|(i, (port, peer))| Member {
                args: vec![
                    format!("--name=m{i}"),
                    format!("--listen-client-urls=http://127.0.0.1:{port}"),
                    format!("--advertise-client-urls=http://127.0.0.1:{port}"),
                    format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                    format!("--initial-advertise-peer-urls={}", peer_url(&peers, i)),
                    format!("--initial-cluster={}", initial_cluster(&peers)),
                    "--initial-cluster-state=new".into(),
                    format!("--initial-cluster-token={CLUSTER_TOKEN}"),
                    // Elections and slow disks are logged at info and warn: what a start
                    // that names no leader needs explained.
                    "--log-level=info".into(),
                ],
                data_dir: dir.path().join(format!("m{i}")),
                log: dir.path().join(format!("m{i}.log")),
                port: *port,
                child: None,
            })
            .collect();
        for member in &mut members {
            member.spawn();
        }
        EtcdCluster {
            members,
            peers,
            dir,
        }
    }

    /// The members' client URLs.
    pub fn urls(&self) -> Vec<String> {
        self.members.iter().map(Member::url).collect()
    }

    /// Waits until each of `members` answers and names the same leader, one of them; panics
    /// when one of them exits, or after `limit`, with the members' logs.
    pub fn wait_for_leader(&mut self, members: &[usize], limit: Duration) {
        if let Err(why) = self.until_agreed(members, limit) {
            panic!("etcd {why}");
        }
    }

    /// Waits until each of `members` answers and names the same leader, one of them: `Err`
    /// when one of them exits first (as one restarted on ports another process took while it
    /// was down does; waiting on would only hide why); panics after `limit`, with the
    /// members' logs.
    fn until_agreed(&mut self, members: &[usize], limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        while let Err(views) = self.agreed(members) {
            for &i in members {
                if let Some(status) = self.members[i].exited() {
                    return Err(format!(
                        "member {i} exited ({status}); its log ends:\n{}",
                        self.members[i].tail()
                    ));
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd members {members:?} agree on no leader after {limit:?}: {views:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Whether each of `members` answers and names the same leader, one of them; else what
    /// each said (its id and its leader's, when it answers and has one).
    fn agreed(&self, members: &[usize]) -> Result<(), Vec<View>> {
        let views: Vec<View> = members.iter().map(|&i| self.members[i].view()).collect();
        let leaders: Vec<&str> = views
            .iter()
            .filter_map(|v| v.as_ref().map(|(_, l)| l.as_str()))
            .collect();
        let among = views
            .iter()
            .flatten()
            .any(|(me, _)| Some(me.as_str()) == leaders.first().copied());
        if leaders.len() == members.len() && leaders.windows(2).all(|w| w[0] == w[1]) && among {
            Ok(())
        } else {
            Err(views)
        }
    }

    /// Each member's last log lines, for a failure's message.
    fn logs(&self) -> String {
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| format!("member {i}'s log ends:\n{}", m.tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The index of the member that leads now, if a member that answers says so.
    pub fn leader(&self) -> Option<usize> {
        let views: Vec<View> = self.members.iter().map(Member::view).collect();
        let leader = views.iter().flatten().next()?.1.clone();
        views
            .iter()
            .position(|v| v.as_ref().is_some_and(|(me, _)| *me == leader))
    }

    /// Every key under `prefix` and its value, as the first member that answers has them.
    pub fn under(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let body = json!({"key": BASE64.encode(prefix), "range_end": BASE64.encode(&end)});
        for member in &self.members {
            let output = Command::new("curl")
                .args(["-s", "--max-time", "5", "-X", "POST"])
                .arg(format!("{}/v3/kv/range", member.url()))
                .arg("-d")
                .arg(body.to_string())
                .output();
            let Some(reply) = output
                .ok()
                .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
                .filter(|r| r.get("header").is_some())
            else {
                continue;
            };
            let decode = |v: Option<&Value>| {
                BASE64
                    .decode(v.and_then(Value::as_str).unwrap_or(""))
                    .unwrap_or_default()
            };
            return reply
                .get("kvs")
                .and_then(Value::as_array)
                .map(|kvs| {
                    kvs.iter()
                        .map(|kv| {
                            let key = String::from_utf8_lossy(&decode(kv.get("key"))).into_owned();
                            (key, decode(kv.get("value")))
                        })
                        .collect()
                })
                .unwrap_or_default();
        }
        panic!("no etcd member answered a read of {prefix}");
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its data.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.members[i].spawn();
    }

    /// Stops (`true`, SIGSTOP) or resumes (`false`, SIGCONT) member `i`.
    pub fn pause(&self, i: usize, stopped: bool) {
        if let Some(child) = &self.members[i].child {
            let signal = if stopped { "-STOP" } else { "-CONT" };
            let _ = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
        }
    }
}

impl EtcdCluster {
    /// Cuts member `i` off from the other two (every peer connection to or from it closed,
    /// new ones refused); its client port keeps answering. Panics when it does not answer.
    pub fn partition(&self, i: usize) {
        let (me, _) = self.members[i]
            .view()
            .unwrap_or_else(|| panic!("etcd member {i} does not answer"));
        self.peers.cut(Some((i, &me)));
    }

    /// Waits until member `i` answers and names no leader (one cut off from the others stops
    /// naming one within an election timeout); panics after `limit`.
    pub fn wait_until_leaderless(&self, i: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.members[i].view().is_some() {
            assert!(
                Instant::now() < deadline,
                "etcd member {i} still names a leader after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Joins the cut member to the others again.
    pub fn heal(&self) {
        self.peers.cut(None);
    }

    /// A snapshot of the cluster's data as `etcdctl snapshot save` takes one (the
    /// Maintenance API's stream, which ends with the data's hash), from the first member that
    /// gives a whole one.
    pub fn snapshot(&self) -> Vec<u8> {
        for member in &self.members {
            let output = Command::new("curl")
                .args(["-s", "-N", "--max-time", "30", "-X", "POST"])
                .arg(format!("{}/v3/maintenance/snapshot", member.url()))
                .args(["-d", "{}"])
                .output();
            let Ok(output) = output else { continue };
            let mut data = Vec::new();
            let mut complete = false;
            for part in serde_json::Deserializer::from_slice(&output.stdout).into_iter::<Value>() {
                let Ok(part) = part else { break };
                let Some(blob) = part.pointer("/result/blob").and_then(Value::as_str) else {
                    break;
                };
                data.extend(BASE64.decode(blob).expect("a snapshot's base64"));
                complete = part
                    .pointer("/result/remaining_bytes")
                    .is_none_or(|r| r.as_str().is_none_or(|r| r == "0"));
            }
            if complete && !data.is_empty() {
                return data;
            }
        }
        panic!("no etcd member gave a whole snapshot");
    }

    /// Stops every member and restores each from `snapshot` with `etcdutl snapshot restore`
    /// (the documented procedure: `--bump-revision` by `bump` and `--mark-compacted` when
    /// `bump` is set; without it revisions are handed out again), then starts them on the
    /// restored data and waits for a leader. Everything written since the snapshot is lost.
    pub fn restore(&mut self, snapshot: &[u8], bump: Option<u64>) {
        for i in 0..self.members.len() {
            self.pause(i, false);
            self.kill(i);
        }
        let file = self.dir.path().join("snapshot.db");
        std::fs::write(&file, snapshot).expect("write the snapshot");
        for (i, member) in self.members.iter().enumerate() {
            let _ = std::fs::remove_dir_all(&member.data_dir);
            let mut restore = Command::new(etcdutl_binary());
            restore
                .args(["snapshot", "restore"])
                .arg(&file)
                .arg(format!("--name=m{i}"))
                .arg(format!("--data-dir={}", member.data_dir.display()))
                .arg(format!(
                    "--initial-cluster={}",
                    initial_cluster(&self.peers)
                ))
                .arg(format!("--initial-cluster-token={CLUSTER_TOKEN}"))
                .arg(format!(
                    "--initial-advertise-peer-urls={}",
                    peer_url(&self.peers, i)
                ));
            if let Some(bump) = bump {
                restore.arg(format!("--bump-revision={bump}"));
                restore.arg("--mark-compacted");
            }
            let output = restore.output().expect("run etcdutl");
            assert!(
                output.status.success(),
                "etcdutl snapshot restore failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        for member in &mut self.members {
            member.spawn();
        }
        self.wait_for_leader(&[0, 1, 2], Duration::from_secs(30));
    }
}

/// The peer URL member `i` advertises: its proxy.
fn peer_url(peers: &PeerNet, i: usize) -> String {
    format!("http://127.0.0.1:{}", peers.port(i))
}

/// `--initial-cluster` of the three members.
fn initial_cluster(peers: &PeerNet) -> String {
    (0..3)
        .map(|i| format!("m{i}={}", peer_url(peers, i)))
        .collect::<Vec<_>>()
        .join(",")
}

/// etcdutl at the etcd's version (the Go module in `tests/etcdutl`), built once per process
/// next to the test executables (in Cargo's target folder); built under a name of its own and
/// renamed, so processes that build it at once never run a half-written file.
fn etcdutl_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test executable's path");
        let dir = exe.parent().expect("the test executable's folder");
        let out = dir.join("etcdutl");
        let building = dir.join(format!("etcdutl.{}", std::process::id()));
        go_build_in(
            "tests/etcdutl",
            "go.etcd.io/etcd/etcdutl/v3",
            &building,
            "etcdutl",
        );
        std::fs::rename(&building, &out).expect("move etcdutl in place");
        out
    })
    .clone()
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.pause(i, false);
            self.kill(i);
        }
    }
}
