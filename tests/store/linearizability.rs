//! Linearizability of the lease store on a real server, judged by an independent checker.
//!
//! Concurrent clients (each call one `targetlease lease ...` process, as an operator or a
//! script runs it) acquire, renew, release and check leases on a few targets of one Valkey
//! server; some calls are killed with SIGKILL mid-call, so their outcome is unknown. The history
//! (call and return times, inputs, replies) goes to `tests/porcupine`, a Porcupine model of the
//! protocol written apart from the store (it shares no code with it), which decides whether some
//! order of the calls, each placed within its window, explains every reply. Mutated copies of
//! the same history (a token that does not grow, a grant while another holds) must be refused:
//! the checker is shown to catch what it is there to catch. Half-way through, the server fails
//! over to a replica that missed its newest writes (detached, the old primary kept serving until
//! it granted more, then killed): every token after that must still be above every token before.
//! A second history does the same with permits 3 (no failover): eight clients share two targets
//! of three permits each, so that every slot is often held; some claims ask two permits (a
//! permits conflict while permits granted under three are held); forged handles name a token
//! one below the real one or the neighbouring slot, and tokens are checked against another
//! slot's fence. Its mutations: a token of another slot, a fourth holder, a grant under another
//! permits value, a token current in another slot's fence.
//! A third history runs the exclusive workload on a three-member etcd whose leader is killed
//! and restarted mid-run.
//! A missing server or Go fails the suite; it never skips.

use targetlease_test_support as support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Conclusion};
use serde_json::{Value, json};

use support::etcd::EtcdCluster;
use support::kube::{go_build, targetlease_bin};
use support::server::{Server, ServerKind};

const TARGETS: usize = 3;
const WORKERS: usize = 5;
const TTL_MS: u64 = 1200;
/// The share of calls killed mid-call (per mille).
const KILL_PER_MILLE: u64 = 120;
/// How many recent calls that ran to their end the kill moment is drawn against.
const RECENT_CALLS: usize = 64;

/// A small xorshift generator: the workers' choices repeat with the printed seed
/// (`TARGETLEASE_LINEARIZABILITY_SEED`); their timing does not.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What a worker holds: the handle its acquire returned.
struct Held {
    target: String,
    lease: String,
    token: u64,
    /// The permits value it was granted under, and its slot (1 and 0: the exclusive lease).
    permits: u32,
    slot: u32,
}

struct Recorder {
    /// The environment of new calls: the store they go to (the primary, then the promoted
    /// replica; or the etcd members).
    env: Mutex<Vec<(String, String)>>,
    bin: PathBuf,
    started: Instant,
    calls: Mutex<Vec<Value>>,
    /// How long the latest calls not picked for killing took, newest last (at most
    /// `RECENT_CALLS`).
    recent: Mutex<std::collections::VecDeque<Duration>>,
}

impl Recorder {
    /// A recorder of calls to the Valkey server at `url`.
    fn on_valkey(url: String) -> Recorder {
        Self::with_env(vec![("TARGETLEASE_VALKEY_URL".into(), url)])
    }

    fn with_env(env: Vec<(String, String)>) -> Recorder {
        Recorder {
            env: Mutex::new(env),
            bin: targetlease_bin(),
            started: Instant::now(),
            calls: Mutex::new(Vec::new()),
            recent: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// When to kill a call picked for killing: `draw` (0 to 999) placed in the second half of
    /// the median call's run. A process call spends most of its time starting; the store runs
    /// the command only near the end, so a kill drawn from a fixed window (it was 2 to 12 ms)
    /// lands before the command on a machine where starting takes longer, and a history then
    /// holds no killed call that had run (a CI run lost two trials to that). Drawn against the
    /// calls' own length, some kills land after the store ran the command on any machine.
    /// Before any call has ended: 2 to 12 ms. (The permits history keeps the fixed window: see
    /// `permits_worker`.)
    fn kill_after(&self, draw: u64) -> Duration {
        let mut recent: Vec<Duration> = self
            .recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        if recent.is_empty() {
            return Duration::from_micros(2_000 + draw * 10);
        }
        recent.sort();
        let median = recent[recent.len() / 2];
        median / 2 + median * draw as u32 / 2_000
    }

    /// The calls recorded so far; says how long the recent ones took, which the kills were
    /// drawn against.
    fn history(&self) -> Vec<Value> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let mut sorted: Vec<Duration> = recent.iter().copied().collect();
        sorted.sort();
        if let Some(median) = sorted.get(sorted.len() / 2) {
            eprintln!(
                "linearizability: the latest {} calls took {median:?} at the median (an exclusive history kills calls 0.5 to 1 times that after their start)",
                sorted.len()
            );
        }
        drop(recent);
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn env(&self) -> Vec<(String, String)> {
        self.env.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn nanos(&self) -> i64 {
        self.started.elapsed().as_nanos() as i64
    }

    /// Runs one CLI call, killing it after `kill_after` if given, and records it. Returns the
    /// reply when the client printed one.
    fn call(
        &self,
        client: usize,
        input: Value,
        args: &[String],
        kill_after: Option<Duration>,
    ) -> Option<Value> {
        let mut command = Command::new(&self.bin);
        command
            .arg("lease")
            .arg(input["op"].as_str().expect("op"))
            .args(args)
            .envs(self.env())
            .env("TARGETLEASE_LOG", "off")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let call = self.nanos();
        let mut child = command.spawn().expect("spawn targetlease");
        let mut killed = false;
        if let Some(after) = kill_after {
            std::thread::sleep(after);
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                killed = true;
            }
        }
        let kill_time = self.nanos();
        let output = child.wait_with_output().expect("wait");
        let ret = self.nanos();
        // Only calls never picked for killing: one picked that ended before its kill came has
        // the wait for it in its length.
        if kill_after.is_none() {
            let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            recent.push_back(Duration::from_nanos((ret - call) as u64));
            if recent.len() > RECENT_CALLS {
                recent.pop_front();
            }
        }
        let reply: Option<Value> = if killed {
            None
        } else {
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .last()
                .and_then(|l| serde_json::from_str(l).ok())
        };
        let mut record = input;
        record["client"] = json!(client);
        record["call"] = json!(call);
        record["return"] = json!(ret);
        record["killed"] = json!(killed);
        // A killed call ran, if at all, within moments of the kill (the server runs what it
        // received in microseconds): half a second is generous.
        record["settle"] = json!(if killed { kill_time } else { ret } + 500_000_000);
        record["out"] = reply.clone().unwrap_or(Value::Null);
        record["exit"] = json!(output.status.code());
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
        reply
    }
}

/// Starts `clients` threads running `work` for 8 s, each with its own seed derived from `seed`.
fn spawn_workers(
    rec: &Arc<Recorder>,
    clients: usize,
    seed: u64,
    work: fn(&Recorder, usize, u64, Instant),
) -> Vec<std::thread::JoinHandle<()>> {
    let until = Instant::now() + Duration::from_secs(8);
    (0..clients)
        .map(|client| {
            let rec = rec.clone();
            std::thread::spawn(move || {
                work(&rec, client, seed.wrapping_add(client as u64 * 7919), until)
            })
        })
        .collect()
}

fn worker(rec: &Recorder, client: usize, seed: u64, until: Instant) {
    let mut rng = Rng(seed | 1);
    let mut held: Option<Held> = None;
    let mut seen: Vec<(String, u64)> = Vec::new();
    let mut n = 0;
    while Instant::now() < until {
        n += 1;
        let kill = (rng.below(1000) < KILL_PER_MILLE).then(|| rec.kill_after(rng.below(1000)));
        let pick = rng.below(100);
        let base = |op: &str, target: &str| json!({"op": op, "target": target, "lease": "", "owner": "", "token": 0, "ttl_ms": 0});
        match &held {
            // A forged handle (a token one below the real one, never issued): renew and release
            // must refuse it and leave the real holder alone. The worker keeps its handle.
            Some(h) if pick < 10 => {
                let op = if rng.below(2) == 0 {
                    "renew"
                } else {
                    "release"
                };
                let forged = Held {
                    target: h.target.clone(),
                    lease: h.lease.clone(),
                    token: h.token - 1,
                    permits: 1,
                    slot: 0,
                };
                let mut input = base(op, &h.target);
                input["lease"] = json!(h.lease);
                input["owner"] = json!(format!("w{client}"));
                input["token"] = json!(forged.token);
                input["forged"] = json!(true);
                let ttl = (op == "renew").then_some(TTL_MS);
                input["ttl_ms"] = json!(ttl.unwrap_or(0));
                let args = handle_args(&forged, client, ttl);
                rec.call(client, input, &args, kill);
            }
            Some(h) if pick < 45 => {
                let mut input = base("renew", &h.target);
                input["lease"] = json!(h.lease);
                input["owner"] = json!(format!("w{client}"));
                input["token"] = json!(h.token);
                input["ttl_ms"] = json!(TTL_MS);
                let args = handle_args(h, client, Some(TTL_MS));
                let reply = rec.call(client, input, &args, kill);
                if !reply.is_some_and(|r| r["outcome"] == "renewed") {
                    held = None;
                }
            }
            Some(h) if pick < 60 => {
                let input = json!({"op": "check", "target": h.target, "lease": "", "owner": "", "token": h.token, "ttl_ms": 0});
                let args = vec![
                    "--target".into(),
                    h.target.clone(),
                    "--token".into(),
                    h.token.to_string(),
                ];
                rec.call(client, input, &args, kill);
            }
            Some(h) => {
                let mut input = base("release", &h.target);
                input["lease"] = json!(h.lease);
                input["owner"] = json!(format!("w{client}"));
                input["token"] = json!(h.token);
                let args = handle_args(h, client, None);
                rec.call(client, input, &args, kill);
                held = None;
            }
            None if pick < 25 && !seen.is_empty() => {
                let (target, token) = seen[rng.below(seen.len() as u64) as usize].clone();
                let input = json!({"op": "check", "target": target, "lease": "", "owner": "", "token": token, "ttl_ms": 0});
                let args = vec![
                    "--target".into(),
                    target,
                    "--token".into(),
                    token.to_string(),
                ];
                rec.call(client, input, &args, kill);
            }
            None => {
                let target = format!("t{}", rng.below(TARGETS as u64));
                let lease = format!("w{client}-{:x}-{n}", seed & 0xffff_ffff);
                let mut input = base("acquire", &target);
                input["lease"] = json!(lease);
                input["owner"] = json!(format!("w{client}"));
                input["ttl_ms"] = json!(TTL_MS);
                let args = vec![
                    "--target".into(),
                    target.clone(),
                    "--lease-id".into(),
                    lease.clone(),
                    "--owner".into(),
                    format!("w{client}"),
                    "--ttl".into(),
                    format!("{TTL_MS}ms"),
                ];
                let reply = rec.call(client, input, &args, kill);
                if let Some(r) = reply.filter(|r| r["outcome"] == "acquired") {
                    let token = r["token"].as_u64().expect("token");
                    seen.push((target.clone(), token));
                    held = Some(Held {
                        target,
                        lease,
                        token,
                        permits: 1,
                        slot: 0,
                    });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5 + rng.below(60)));
    }
}

/// When the failover happened on the recorder's clock: from the replica's detach to the old
/// primary's death.
struct Failover {
    detached: i64,
    done: i64,
    /// Grants the old primary answered after the replica was detached: lost with it.
    lost_grants: usize,
}

/// Promotes `replica` (in sync with `primary` until now) while the workers run: detaches it,
/// lets the old primary serve until it granted at least one more lease (the replica misses it),
/// then sends every new call to the replica and kills the old primary.
fn fail_over(rec: &Recorder, primary: &mut Server, replica: &mut Server) -> Failover {
    let grants_after = |at: i64| {
        rec.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|c| outcome(c) == "acquired" && c["call"].as_i64() >= Some(at))
            .count()
    };
    let detached = rec.nanos();
    replica.promote();
    let deadline = Instant::now() + Duration::from_secs(3);
    while grants_after(detached) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    *rec.env.lock().unwrap_or_else(|e| e.into_inner()) =
        vec![("TARGETLEASE_VALKEY_URL".into(), replica.url())];
    primary.kill();
    let done = rec.nanos();
    Failover {
        detached,
        done,
        lost_grants: grants_after(detached),
    }
}

fn handle_args(h: &Held, client: usize, ttl_ms: Option<u64>) -> Vec<String> {
    let mut args = vec![
        "--target".into(),
        h.target.clone(),
        "--lease-id".into(),
        h.lease.clone(),
        "--owner".into(),
        format!("w{client}"),
        "--token".into(),
        h.token.to_string(),
        "--permits".into(),
        h.permits.to_string(),
        "--slot".into(),
        h.slot.to_string(),
    ];
    if let Some(ttl) = ttl_ms {
        args.extend(["--ttl".into(), format!("{ttl}ms")]);
    }
    args
}

/// The folder of the histories, the checker and its visualizations: removed after a pass, kept
/// (and named in the failure) after a failure.
struct Evidence(PathBuf);

impl Evidence {
    fn new(name: &str) -> Evidence {
        let dir = std::env::temp_dir().join(format!(
            "targetlease-linearizability-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("evidence folder");
        Evidence(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Evidence {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("linearizability: histories kept in {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Builds the Porcupine checker (tests/porcupine, a Go module) into `dir`.
fn build_checker(dir: &Path) -> PathBuf {
    let out = dir.join("linearize");
    go_build("tests/porcupine", &out, "the checker");
    out
}

/// Runs the checker on `history`; its exit status and output.
fn check(checker: &Path, history: &[Value], dir: &Path, name: &str) -> (i32, String) {
    check_within(checker, history, dir, name, FULL_SEARCH)
}

/// [`check`] with the checker's search bounded by `limit` (then exit status 2, "Unknown").
fn check_within(
    checker: &Path,
    history: &[Value],
    dir: &Path,
    name: &str,
    limit: Duration,
) -> (i32, String) {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec(history).expect("json")).expect("write history");
    let html = dir.join(format!("{name}.html"));
    let out = Command::new(checker)
        .env("LINEARIZE_TIMEOUT", format!("{}ms", limit.as_millis()))
        .arg(&path)
        .arg(&html)
        .output()
        .expect("run the checker");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// The workers' seed: `TARGETLEASE_LINEARIZABILITY_SEED`, else the clock.
fn seed() -> u64 {
    std::env::var("TARGETLEASE_LINEARIZABILITY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        })
}

fn outcome(call: &Value) -> &str {
    call["out"]["outcome"].as_str().unwrap_or("?")
}

fn history_of_killed_clients_is_linearizable() {
    let dir = Evidence::new("exclusive");
    let checker = build_checker(dir.path());
    let mut valkey = Server::start(ServerKind::Valkey91);
    let port = valkey.port.to_string();
    let mut replica =
        Server::start_with(ServerKind::Valkey91, &["--replicaof", "127.0.0.1", &port]);
    let seed = seed();
    eprintln!("linearizability: seed {seed}");
    let rec = Arc::new(Recorder::on_valkey(valkey.url()));
    let workers = spawn_workers(&rec, WORKERS, seed, worker);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        replica.wait_in_sync_with(&valkey, Duration::from_secs(15)),
        "the replica did not catch up"
    );
    let failover = fail_over(&rec, &mut valkey, &mut replica);
    for w in workers {
        w.join().expect("worker");
    }
    let mut history = top_up(&rec, WORKERS, seed, worker, exclusive_coverage);
    // A call cut off by the old primary's death failed (unavailable, timeout) without knowing
    // whether it ran: an unknown outcome, as for a killed client.
    for c in history.iter_mut() {
        let cut_off = c["call"].as_i64() <= Some(failover.done)
            && c["return"].as_i64() >= Some(failover.detached);
        if cut_off && c["out"]["outcome"] == "error" {
            c["killed"] = json!(true);
            c["settle"] = json!(c["return"].as_i64().unwrap_or(0) + 500_000_000);
            c["out"] = Value::Null;
        }
    }
    for t in 0..TARGETS {
        history.push(
            json!({"op": "failover", "target": format!("t{t}"), "client": WORKERS,
            "lease": "", "owner": "", "token": 0, "ttl_ms": TTL_MS, "call": failover.detached,
            "return": failover.done, "killed": false, "settle": failover.done,
            "out": {"outcome": "failover"}}),
        );
    }
    history.sort_by_key(|c| c["call"].as_i64());
    eprintln!(
        "linearizability: failed over to a replica that missed {} grants, {:.0} ms from detach to switch",
        failover.lost_grants,
        (failover.done - failover.detached) as f64 / 1e6
    );
    assert!(
        failover.lost_grants > 0,
        "the promoted replica missed no grant: the failover proves nothing"
    );
    judge_exclusive(&checker, dir.path(), &history, Some(&failover));
}

/// The exclusive history on etcd (three members): the leader is killed 3 s into the run and
/// started again 2 s later. A call that failed with a transient error meanwhile (no leader, a
/// member gone) is an unknown outcome: it may have taken effect, up to the next leader's first
/// commits, or not at all. No grant may be lost: the history is judged without a failover.
fn etcd_history_with_a_killed_leader_is_linearizable() {
    let dir = Evidence::new("etcd");
    let checker = build_checker(dir.path());
    let mut cluster = EtcdCluster::start();
    let seed = seed();
    eprintln!("linearizability (etcd): seed {seed}");
    let rec = Arc::new(Recorder::with_env(vec![
        ("TARGETLEASE_BACKEND".into(), "etcd".into()),
        (
            "TARGETLEASE_ETCD_ENDPOINTS".into(),
            cluster.urls().join(","),
        ),
    ]));
    let workers = spawn_workers(&rec, WORKERS, seed, worker);
    std::thread::sleep(Duration::from_secs(3));
    let leader = cluster.leader().expect("an etcd leader");
    let killed_at = rec.nanos();
    cluster.kill(leader);
    std::thread::sleep(Duration::from_secs(2));
    cluster.restart(leader);
    cluster.wait_for_leader(&[0, 1, 2], Duration::from_secs(30));
    let back_at = rec.nanos();
    for w in workers {
        w.join().expect("worker");
    }
    let mut history = top_up(&rec, WORKERS, seed, worker, exclusive_coverage);
    let mut unknown = 0;
    for c in history.iter_mut() {
        let around_the_kill =
            c["return"].as_i64() >= Some(killed_at) && c["call"].as_i64() <= Some(back_at);
        let transient = matches!(c["out"]["kind"].as_str(), Some("timeout" | "unavailable"));
        if around_the_kill && c["out"]["outcome"] == "error" && transient {
            unknown += 1;
            c["killed"] = json!(true);
            c["settle"] = json!(c["return"].as_i64().unwrap_or(0) + 5_000_000_000);
            c["out"] = Value::Null;
        }
    }
    history.sort_by_key(|c| c["call"].as_i64());
    eprintln!(
        "linearizability (etcd): leader killed for {:.1} s; {unknown} calls failed meanwhile (unknown outcomes)",
        (back_at - killed_at) as f64 / 1e9
    );
    judge_exclusive(&checker, dir.path(), &history, None);
}

/// What a history must contain to be worth checking: (what, how many, at least).
type Coverage = Vec<(&'static str, usize, usize)>;

/// What an exclusive history must contain to be worth checking: (what, how many, at least).
/// A history that never contended, never lost a client or never saw a stale token proves
/// little.
fn exclusive_coverage(history: &[Value]) -> Coverage {
    let count = |pred: &dyn Fn(&Value) -> bool| history.iter().filter(|c| pred(c)).count();
    let killed = count(&|c| c["killed"] == true);
    let acquired = count(&|c| outcome(c) == "acquired");
    let held = count(&|c| outcome(c) == "held");
    let renewed = count(&|c| outcome(c) == "renewed");
    let released = count(&|c| outcome(c) == "released");
    let stale = count(&|c| outcome(c) == "stale");
    let current = count(&|c| outcome(c) == "current");
    let refused_forgery =
        count(&|c| c["forged"] == true && matches!(outcome(c), "not_holder" | "lost"));
    eprintln!(
        "linearizability: {} calls: {killed} killed, {acquired} acquired, {held} held, {renewed} renewed, {released} released, {stale} stale and {current} current checks, {refused_forgery} forged handles refused",
        history.len()
    );
    let ghosts = ghosts(history);
    eprintln!("linearizability: {ghosts} refusals name a holder whose acquire was killed");
    vec![
        ("killed calls", killed, 5),
        ("grants", acquired, 20),
        ("refusals (held)", held, 10),
        ("renewals", renewed, 5),
        ("releases", released, 5),
        ("killed calls that had run", ghosts, 1),
        ("stale checks", stale, 1),
        ("current checks", current, 1),
        ("forged handles refused", refused_forgery, 1),
    ]
}

/// Killed calls that had run, as a history (sorted by call time) shows them: refusals naming a
/// worker as the holder when that worker's last acquire on the target was killed (it never
/// learned it held the target, or a permit of it). An over-count: a worker whose killed release
/// never ran still holds what it held before, and a refusal naming it counts too.
fn ghosts(history: &[Value]) -> usize {
    (0..history.len())
        .filter(|&i| outcome(&history[i]) == "held")
        .filter(|&i| {
            let owner = history[i]["out"]["owner"].as_str().unwrap_or_default();
            history[..i]
                .iter()
                .rev()
                .find(|c| {
                    c["op"] == "acquire"
                        && c["target"] == history[i]["target"]
                        && c["owner"] == owner
                })
                .is_some_and(|c| c["killed"] == true)
        })
        .count()
}

/// The cases a coverage list lacks, as messages.
fn lacking(coverage: &[(&str, usize, usize)]) -> Vec<String> {
    coverage
        .iter()
        .filter(|(_, n, least)| n < least)
        .map(|(what, n, least)| format!("only {n} {what} in the history (at least {least} wanted)"))
        .collect()
}

/// How many rounds of workers a history may take to hold every case worth checking.
const ROUNDS: u64 = 3;

/// Adds rounds of workers (after the first, which the trial ran) to `rec`'s history while it
/// lacks a case of `coverage`, up to [`ROUNDS`] in all: the kills land at random moments, so a
/// history on a loaded machine can lack, say, a killed call that had run. Returns the history,
/// sorted by call time; panics when the last round still lacks a case.
fn top_up(
    rec: &Arc<Recorder>,
    clients: usize,
    seed: u64,
    work: fn(&Recorder, usize, u64, Instant),
    coverage: fn(&[Value]) -> Coverage,
) -> Vec<Value> {
    let mut round = 1;
    loop {
        let mut history = rec.history();
        history.sort_by_key(|c| c["call"].as_i64());
        let lacking = lacking(&coverage(&history));
        if lacking.is_empty() {
            return history;
        }
        assert!(round < ROUNDS, "after {ROUNDS} rounds: {lacking:?}");
        eprintln!("linearizability: round {round} lacks {lacking:?}; another round");
        for w in spawn_workers(rec, clients, seed.wrapping_add(round * 104_729), work) {
            w.join().expect("worker");
        }
        round += 1;
    }
}

/// Judges a recorded exclusive history (sorted by call time): it must hold every kind of call
/// worth checking, be linearizable, and the checker must refuse each mutation of it that a
/// broken store would have answered. `failover`: when the server failed over to a replica that
/// missed writes (the model knows its state only before, or once every earlier lease expired).
fn judge_exclusive(checker: &Path, dir: &Path, history: &[Value], failover: Option<&Failover>) {
    let detached = failover.map(|f| f.detached);

    // Before the failover, or once every lease from before it has certainly expired: where the
    // model knows the promoted server's state, as the mutations below need.
    let ttl_ns = TTL_MS as i64 * 1_000_000;
    let known = |c: &Value| {
        failover.is_none_or(|f| {
            c["return"].as_i64() < Some(f.detached)
                || c["call"].as_i64() > Some(f.done + ttl_ns + 2_000_000)
        })
    };
    // Only a killed call may lack an answer: an error or no reply from a call that ran to its
    // end is a failure of the store, not an unknown outcome.
    let unanswered: Vec<&Value> = history
        .iter()
        .filter(|c| c["killed"] != true && !c["out"]["outcome"].is_string())
        .chain(history.iter().filter(|c| {
            // A check of a token the promoted server never saw is refused: the model allows it.
            let unseen = c["op"] == "check"
                && c["out"]["kind"] == "invalid_request"
                && detached.is_some_and(|d| c["call"].as_i64() > Some(d));
            c["out"]["outcome"] == "error" && !unseen
        }))
        .collect();
    assert!(
        unanswered.is_empty(),
        "calls that were not killed failed or printed no reply: {unanswered:#?}"
    );
    let lacking = lacking(&exclusive_coverage(history));
    assert!(lacking.is_empty(), "{lacking:?}");

    let (code, text) = check(checker, history, dir, "recorded");
    assert_eq!(code, 0, "the recorded history is not linearizable:\n{text}");
    eprint!("{text}");

    // The checker must refuse what it exists to refuse. Each mutation below changes one call
    // into what a broken store would have answered.
    let grants: Vec<usize> = (0..history.len())
        .filter(|&i| outcome(&history[i]) == "acquired")
        .collect();
    let newest_token = history
        .iter()
        .filter_map(|c| c["out"]["token"].as_u64())
        .max()
        .unwrap_or(0);
    let token = |i: usize| history[i]["out"]["token"].clone();
    // The grant on call `j`'s target just before it, when its token differs from `j`'s.
    let previous_grant = |j: usize| {
        grants
            .iter()
            .rev()
            .find(|&&g| g < j && history[g]["target"] == history[j]["target"])
            .copied()
            .filter(|&g| token(g) != token(j))
    };
    // A grant of the promoted server on a target that lost a grant in the failover (one the
    // old primary issued after the replica was detached): that lost grant.
    let lost_before = |j: usize| {
        let f = failover?;
        let lost = |c: &Value| {
            outcome(c) == "acquired"
                && c["call"].as_i64() >= Some(f.detached)
                && c["return"].as_i64() <= Some(f.done)
        };
        (history[j]["call"].as_i64() > Some(f.done))
            .then(|| {
                grants
                    .iter()
                    .copied()
                    .find(|&g| lost(&history[g]) && history[g]["target"] == history[j]["target"])
            })
            .flatten()
    };
    // A refusal while its holder certainly held the target: the refusal ran within the TTL of
    // that holder's grant, and the refusal itself says it had not been released.
    let certainly_held = |i: usize| {
        let c = &history[i];
        let at = |v: &Value, k: &str| v[k].as_i64().unwrap_or(0);
        outcome(c) == "held"
            && known(c)
            && grants
                .iter()
                .rev()
                .find(|&&g| {
                    g < i
                        && history[g]["target"] == c["target"]
                        && history[g]["owner"] == c["out"]["owner"]
                })
                .is_some_and(|&g| {
                    if !known(&history[g]) {
                        return false;
                    }
                    // No release by the holder from its grant to the refusal's end: the flipped
                    // call could otherwise come after it.
                    let released = history.iter().any(|r| {
                        r["op"] == "release"
                            && r["target"] == c["target"]
                            && r["owner"] == c["out"]["owner"]
                            && at(r, "call") >= at(&history[g], "call")
                            && at(r, "call") <= at(c, "return")
                    });
                    !released
                        && at(&history[g], "return") < at(c, "call")
                        && at(c, "return") < at(&history[g], "call") + ttl_ns
                })
    };
    // A stale check whose newer token was granted before the check began (placing the check
    // before that grant, where "current" would be right, is then out of order), before the
    // failover (after it the promoted server's fence may be lower).
    let stale_before_failover = |i: usize| {
        let c = &history[i];
        outcome(c) == "stale"
            && detached.is_none_or(|d| c["return"].as_i64() < Some(d))
            && history.iter().any(|g| {
                outcome(g) == "acquired"
                    && g["target"] == c["target"]
                    && g["out"]["token"] == c["out"]["newest"]
                    && g["return"].as_i64() < c["call"].as_i64()
            })
    };
    let flips = [
        // A grant that repeats the token of the grant before it on its target (tokens must
        // grow).
        Flip {
            name: "repeated-token",
            what: "a repeated token",
            candidate: &|j| outcome(&history[j]) == "acquired" && previous_grant(j).is_some(),
            change: &|j| {
                changed(&history[j], |c| {
                    c["out"]["token"] = previous_grant(j).map(token).into()
                })
            },
        },
        // A grant of the promoted server that repeats a token the old primary issued after
        // the replica was detached (what a token rule that adds the lead only to a target's
        // first token does).
        Flip {
            name: "reissued-after-failover",
            what: "a token issued again after the failover",
            candidate: &|j| outcome(&history[j]) == "acquired" && lost_before(j).is_some(),
            change: &|j| {
                changed(&history[j], |c| {
                    c["out"]["token"] = lost_before(j).map(token).into()
                })
            },
        },
        // A refusal turned into a grant, with a made-up token above every token seen: only
        // exclusion can refuse it.
        Flip {
            name: "two-holders",
            what: "a second holder",
            candidate: &certainly_held,
            change: &|i| {
                changed(&history[i], |c| {
                    c["out"] = json!({"outcome": "acquired", "token": newest_token + 1})
                })
            },
        },
        Flip {
            name: "stale-as-current",
            what: "a stale token answered current",
            candidate: &stale_before_failover,
            change: &|i| {
                changed(&history[i], |c| {
                    c["out"] = json!({"outcome": "current", "newest": history[i]["token"]})
                })
            },
        },
        // A forged handle obeyed: a renew or release with a token never issued answered renewed
        // or released (both kinds: a short history may hold few forgeries of either).
        Flip {
            name: "forged-handle",
            what: "a forged handle obeyed",
            candidate: &|i| {
                history[i]["forged"] == true
                    && known(&history[i])
                    && matches!(outcome(&history[i]), "not_holder" | "lost")
            },
            change: &|i| {
                changed(&history[i], |c| {
                    let done = if c["op"] == "renew" {
                        "renewed"
                    } else {
                        "released"
                    };
                    c["out"] = json!({ "outcome": done })
                })
            },
        },
    ];
    // Without a failover no grant was lost, so none can be issued again.
    for flip in flips
        .iter()
        .filter(|f| failover.is_some() || f.name != "reissued-after-failover")
    {
        refuse_a_flip(checker, dir, history, flip, Cuts::KilledFirst);
    }
}

/// The permits of the targets of the permits history, and how many targets and workers share
/// them: more workers than permits, so that every slot is often held and claims are refused.
const PERMITS: u32 = 3;
const PERMIT_TARGETS: usize = 2;
const PERMIT_WORKERS: usize = 8;
/// The share of acquires (per mille) that ask another permits value than the targets' (2):
/// refused while permits granted under 3 are held, granted (and then refusing the others)
/// when none is.
const OTHER_PERMITS_PER_MILLE: u64 = 60;

/// A worker of the permits history: acquires one of `PERMITS` permits of a target, renews,
/// checks its slot's fence, releases, and tries what must be refused (a token one below its
/// own, its handle in a neighbouring slot, its token checked against another slot's fence).
fn permits_worker(rec: &Recorder, client: usize, seed: u64, until: Instant) {
    let mut rng = Rng(seed | 1);
    let mut held: Option<Held> = None;
    let mut seen: Vec<(String, u32, u64)> = Vec::new();
    let mut n = 0;
    let owner = format!("w{client}");
    while Instant::now() < until {
        n += 1;
        // Kills early, in a fixed window (mostly before the command): the permits checker's
        // search grows with every killed grant that ran (its slot and token unknown), and with
        // kills drawn against the calls' length 3 of 6 runs ran out of search time on a
        // mutation. The coverage's count of killed calls that had run is still met (see
        // `ghosts`, which also counts what a killed release left held), or another round runs.
        let kill = (rng.below(1000) < KILL_PER_MILLE)
            .then(|| Duration::from_micros(2_000 + rng.below(10_000)));
        let pick = rng.below(100);
        let call = |h: &Held, op: &str, token: u64, slot: u32| {
            json!({"op": op, "target": h.target, "lease": h.lease, "owner": owner,
                "token": token, "ttl_ms": if op == "renew" { TTL_MS } else { 0 },
                "permits": h.permits, "slot": slot})
        };
        let check_args = |target: &str, slot: u32, token: u64| -> Vec<String> {
            vec![
                "--target".into(),
                target.into(),
                "--slot".into(),
                slot.to_string(),
                "--token".into(),
                token.to_string(),
            ]
        };
        match &held {
            // A forged handle: a token one below the real one (never this lease's; perhaps
            // another slot's), or the real one in the next slot. Renew and release must refuse
            // it and leave every holder alone. The worker keeps its handle.
            Some(h) if pick < 10 => {
                let op = if rng.below(2) == 0 {
                    "renew"
                } else {
                    "release"
                };
                let forged = if pick < 5 {
                    Held {
                        token: h.token - 1,
                        target: h.target.clone(),
                        lease: h.lease.clone(),
                        ..*h
                    }
                } else {
                    Held {
                        slot: (h.slot + 1) % h.permits,
                        target: h.target.clone(),
                        lease: h.lease.clone(),
                        ..*h
                    }
                };
                let mut input = call(&forged, op, forged.token, forged.slot);
                input["forged"] = json!(true);
                let ttl = (op == "renew").then_some(TTL_MS);
                rec.call(client, input, &handle_args(&forged, client, ttl), kill);
            }
            // Its token against another slot's fence: never current there.
            Some(h) if pick < 20 => {
                let slot = (h.slot + 1 + rng.below(u64::from(h.permits) - 1) as u32) % h.permits;
                let mut input = call(h, "check", h.token, slot);
                input["wrong_slot"] = json!(true);
                rec.call(client, input, &check_args(&h.target, slot, h.token), kill);
            }
            Some(h) if pick < 50 => {
                let input = call(h, "renew", h.token, h.slot);
                let reply = rec.call(client, input, &handle_args(h, client, Some(TTL_MS)), kill);
                if !reply.is_some_and(|r| r["outcome"] == "renewed") {
                    held = None;
                }
            }
            Some(h) if pick < 65 => {
                let input = call(h, "check", h.token, h.slot);
                rec.call(client, input, &check_args(&h.target, h.slot, h.token), kill);
            }
            Some(h) => {
                let input = call(h, "release", h.token, h.slot);
                rec.call(client, input, &handle_args(h, client, None), kill);
                held = None;
            }
            None if pick < 20 && !seen.is_empty() => {
                let (target, slot, token) = seen[rng.below(seen.len() as u64) as usize].clone();
                let input = json!({"op": "check", "target": target, "lease": "", "owner": "",
                    "token": token, "ttl_ms": 0, "permits": PERMITS, "slot": slot});
                rec.call(client, input, &check_args(&target, slot, token), kill);
            }
            None => {
                let target = format!("p{}", rng.below(PERMIT_TARGETS as u64));
                // The seed tells the rounds of one history apart: a lease id is never reused.
                let lease = format!("w{client}-{:x}-{n}", seed & 0xffff_ffff);
                let permits = if rng.below(1000) < OTHER_PERMITS_PER_MILLE {
                    PERMITS - 1
                } else {
                    PERMITS
                };
                let input = json!({"op": "acquire", "target": target, "lease": lease,
                    "owner": owner, "token": 0, "ttl_ms": TTL_MS, "permits": permits, "slot": 0});
                let args = vec![
                    "--target".into(),
                    target.clone(),
                    "--lease-id".into(),
                    lease.clone(),
                    "--owner".into(),
                    owner.clone(),
                    "--ttl".into(),
                    format!("{TTL_MS}ms"),
                    "--permits".into(),
                    permits.to_string(),
                ];
                let reply = rec.call(client, input, &args, kill);
                if let Some(r) = reply.filter(|r| r["outcome"] == "acquired") {
                    let token = r["token"].as_u64().expect("token");
                    let slot = r["slot"].as_u64().expect("slot") as u32;
                    seen.push((target.clone(), slot, token));
                    held = Some(Held {
                        target,
                        lease,
                        token,
                        permits,
                        slot,
                    });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5 + rng.below(60)));
    }
}

/// Whether slot `slot` of call `i`'s target was certainly held by a live lease granted under
/// permits `permits` for all of call `i`'s window: its newest grant returned before `i` began,
/// `i` ended within the TTL of that grant's call, and no release of that lease began before
/// `i` ended (nor could a killed call have taken the slot: it was never free meanwhile).
fn certainly_held(history: &[Value], i: usize, slot: u64, permits: u64) -> bool {
    let at = |v: &Value, k: &str| v[k].as_i64().unwrap_or(0);
    let c = &history[i];
    let ttl_ns = TTL_MS as i64 * 1_000_000;
    let Some(g) = history[..i].iter().rev().find(|g| {
        outcome(g) == "acquired" && g["target"] == c["target"] && g["out"]["slot"] == json!(slot)
    }) else {
        return false;
    };
    let released = history.iter().any(|r| {
        r["op"] == "release"
            && r["target"] == c["target"]
            && r["lease"] == g["lease"]
            && at(r, "call") <= at(c, "return")
            && at(r, "call") >= at(g, "call")
    });
    g["permits"] == json!(permits)
        && !released
        && at(g, "return") < at(c, "call")
        && at(c, "return") < at(g, "call") + ttl_ns
}

/// A copy of `call` with `edit` applied: what a mutation makes of a recorded call.
fn changed(call: &Value, edit: impl FnOnce(&mut Value)) -> Value {
    let mut c = call.clone();
    edit(&mut c);
    c
}

/// A mutation of a recorded history the checker must refuse.
struct Flip<'a> {
    /// The file name of the mutated history.
    name: &'a str,
    /// What it makes up, for the messages.
    what: &'a str,
    /// Which calls it may change (by index in the history).
    candidate: &'a dyn Fn(usize) -> bool,
    /// What it makes of such a call.
    change: &'a dyn Fn(usize) -> Value,
}

/// What a permits history must contain to be worth checking: (what, how many, at least). The
/// kills land at random moments, so a history on a loaded machine can lack one; the trial then
/// runs the workers again, adding to the same history.
fn permits_coverage(history: &[Value]) -> Coverage {
    let count = |pred: &dyn Fn(&Value) -> bool| history.iter().filter(|c| pred(c)).count();
    let killed = count(&|c| c["killed"] == true);
    let acquired = count(&|c| outcome(c) == "acquired");
    let last_slot = count(&|c| outcome(c) == "acquired" && c["out"]["slot"] == json!(PERMITS - 1));
    let held = count(&|c| outcome(c) == "held");
    let conflicts = count(&|c| outcome(c) == "permits_conflict");
    let renewed = count(&|c| outcome(c) == "renewed");
    let released = count(&|c| outcome(c) == "released");
    let stale = count(&|c| outcome(c) == "stale" && c["wrong_slot"] != true);
    let current = count(&|c| outcome(c) == "current");
    let wrong_slot = count(&|c| c["wrong_slot"] == true && c["killed"] != true);
    let refused_forgery =
        count(&|c| c["forged"] == true && matches!(outcome(c), "not_holder" | "lost"));
    eprintln!(
        "linearizability (permits {PERMITS}): {} calls: {killed} killed, {acquired} acquired ({last_slot} in slot {}), {held} held, {conflicts} permits conflicts, {renewed} renewed, {released} released, {stale} stale and {current} current checks, {wrong_slot} checks against another slot, {refused_forgery} forged handles refused",
        history.len(),
        PERMITS - 1
    );
    // What the fourth-holder mutation turns into a grant: without one, that mutation has no
    // candidate (a slow run of 347 calls had none).
    let p = u64::from(PERMITS);
    let full = (0..history.len())
        .filter(|&i| {
            outcome(&history[i]) == "held"
                && history[i]["permits"] == json!(PERMITS)
                && (0..p).all(|s| certainly_held(history, i, s, p))
        })
        .count();
    let ghosts = ghosts(history);
    // Or a check whose slot's newest token is none a client was told: a killed grant's.
    let told: std::collections::BTreeSet<u64> = history
        .iter()
        .filter(|c| outcome(c) == "acquired")
        .filter_map(|c| c["out"]["token"].as_u64())
        .collect();
    let unseen = count(&|c| {
        c["op"] == "check"
            && c["out"]["newest"]
                .as_u64()
                .is_some_and(|t| !told.contains(&t))
    });
    eprintln!(
        "linearizability (permits {PERMITS}): {ghosts} refusals name a holder whose acquire was killed, {unseen} checks see a token only a killed client was granted"
    );
    let ghosts = ghosts + unseen;
    vec![
        ("killed calls", killed, 5),
        ("grants", acquired, 20),
        ("grants of the last slot (every permit held)", last_slot, 3),
        ("refusals while every permit was certainly held", full, 1),
        ("refusals (held)", held, 10),
        ("permits conflicts", conflicts, 1),
        ("renewals", renewed, 5),
        ("releases", released, 5),
        ("killed calls that had run", ghosts, 1),
        ("stale checks", stale, 1),
        ("current checks", current, 1),
        ("checks against another slot", wrong_slot, 2),
        ("forged handles refused", refused_forgery, 3),
    ]
}

fn permits_history_of_killed_clients_is_linearizable() {
    let dir = Evidence::new("permits");
    let checker = build_checker(dir.path());
    let valkey = Server::start(ServerKind::Valkey91);
    let seed = seed();
    eprintln!("linearizability (permits {PERMITS}): seed {seed}");
    let rec = Arc::new(Recorder::on_valkey(valkey.url()));
    for w in spawn_workers(&rec, PERMIT_WORKERS, seed, permits_worker) {
        w.join().expect("worker");
    }
    let history = top_up(&rec, PERMIT_WORKERS, seed, permits_worker, permits_coverage);
    // Only a killed call may lack an answer; the only error allowed is a check of a token
    // against a slot that never granted it (the checker decides whether that was so).
    let unanswered: Vec<&Value> = history
        .iter()
        .filter(|c| {
            let refused_check = c["op"] == "check" && c["out"]["kind"] == "invalid_request";
            c["killed"] != true
                && (!c["out"]["outcome"].is_string() || outcome(c) == "error")
                && !refused_check
        })
        .collect();
    assert!(
        unanswered.is_empty(),
        "calls that were not killed failed or printed no reply: {unanswered:#?}"
    );

    let (code, text) = check(&checker, &history, dir.path(), "recorded");
    assert_eq!(code, 0, "the recorded history is not linearizable:\n{text}");
    eprint!("{text}");

    // The checker must refuse what it exists to refuse. A grant that repeats the token of an
    // earlier grant in another slot of the target, above every token its own slot had granted
    // (a token rule kept per slot would allow it; tokens grow across slots). A refusal turned
    // into a grant while it could not be right: every permit certainly held (a fourth holder),
    // or a grant to a claim asking another permits value while a permit granted under the
    // targets' value is certainly held in another slot (two permits values at once). A check against another slot's fence
    // answered current. The made-up token is above every token seen, so only the permits and
    // the slots' fences can refuse it (`refuse_a_flip` says how the history is cut).
    let newest_token = history
        .iter()
        .filter_map(|c| c["out"]["token"].as_u64())
        .max()
        .unwrap_or(0);
    let p = u64::from(PERMITS);
    let fourth = json!({"outcome": "acquired", "token": newest_token + 1, "slot": 0});
    let grants: Vec<usize> = (0..history.len())
        .filter(|&i| outcome(&history[i]) == "acquired")
        .collect();
    let token = |i: usize| history[i]["out"]["token"].as_u64().unwrap_or(0);
    // The newest grant before `j` on its target in another slot, when its token is above every
    // earlier grant of `j`'s slot.
    let other_slot = |j: usize| -> Option<usize> {
        let same = |g: &usize| *g < j && history[*g]["target"] == history[j]["target"];
        let mine = |g: &usize| history[*g]["out"]["slot"] == history[j]["out"]["slot"];
        let own = grants
            .iter()
            .filter(|g| same(g) && mine(g))
            .map(|&g| token(g))
            .max();
        grants
            .iter()
            .rev()
            .find(|g| same(g) && !mine(g))
            .copied()
            .filter(|&i| own.is_none_or(|t| token(i) > t))
    };
    let flips = [
        Flip {
            name: "token-of-another-slot",
            what: "a token of another slot",
            candidate: &|j| outcome(&history[j]) == "acquired" && other_slot(j).is_some(),
            change: &|j| {
                changed(&history[j], |c| {
                    c["out"]["token"] = json!(other_slot(j).map(token))
                })
            },
        },
        Flip {
            name: "fourth-holder",
            what: "a holder above the permits",
            candidate: &|i| {
                outcome(&history[i]) == "held"
                    && history[i]["permits"] == json!(PERMITS)
                    && (0..p).all(|s| certainly_held(&history, i, s, p))
            },
            change: &|i| changed(&history[i], |c| c["out"] = fourth.clone()),
        },
        Flip {
            name: "two-permits-values",
            what: "a grant under another permits value",
            candidate: &|i| {
                outcome(&history[i]) == "acquired"
                    && history[i]["permits"] == json!(PERMITS)
                    && history[i]["out"]["slot"].as_u64() < Some(p - 1)
                    && (0..p).any(|s| {
                        json!(s) != history[i]["out"]["slot"] && certainly_held(&history, i, s, p)
                    })
            },
            // The same grant, of a claim that asked one permit fewer.
            change: &|i| changed(&history[i], |c| c["permits"] = json!(PERMITS - 1)),
        },
        // A token checked against another slot's fence answered current.
        Flip {
            name: "current-in-another-slot",
            what: "a token current in another slot's fence",
            candidate: &|i| history[i]["wrong_slot"] == true && history[i]["killed"] != true,
            change: &|i| {
                changed(&history[i], |c| {
                    c["out"] = json!({"outcome": "current", "newest": history[i]["token"]})
                })
            },
        },
    ];
    for flip in &flips {
        refuse_a_flip(&checker, dir.path(), &history, flip, Cuts::KnownFirst);
    }
}

/// Which cuts of a history [`refuse_a_flip`] tries first.
#[derive(Clone, Copy)]
enum Cuts {
    /// With the killed calls first: the checker must then refuse the flip while the model is
    /// unsure of fences and tokens (a killed grant's token is unknown), which the known calls
    /// alone never make it. For the exclusive history, whose cuts hold fewer killed calls.
    KilledFirst,
    /// Without the killed calls first: for histories whose many killed calls (the permits
    /// history's) put every cut's search out of reach.
    KnownFirst,
}

/// Turns one of the calls of `history` that `flip` may change into what the checker must refuse,
/// and requires the checker to refuse it. The history is cut after that call, so what the flip makes
/// up contradicts nothing later, and the earliest candidates are tried first: refusing a history
/// means searching every order of it, and every killed call, which may have run at any moment of
/// its long window or never, multiplies the orders (a 714-call cut with 82 killed calls ran past
/// the checker's two minutes on CI). So cuts are tried with their killed calls and without them
/// (searched in moments), in the order `cuts` says. The cut history without the flip must pass
/// first: a killed call left out, or a call that began after the cut, may have explained one in
/// it, and such a cut is skipped. A search that runs past [`FLIP_SEARCH`] is counted and the next
/// cut tried, for at most [`FLIP_BUDGET`] in all (half of it for the first kind of cut); a flip
/// the checker accepts fails at once.
fn refuse_a_flip(checker: &Path, dir: &Path, history: &[Value], flip: &Flip, cuts: Cuts) {
    let Flip { name, what, .. } = flip;
    let candidates: Vec<usize> = (0..history.len())
        .filter(|&i| (flip.candidate)(i))
        .collect();
    let started = Instant::now();
    let (with, without) = ((true, 5), (false, 30));
    let order = match cuts {
        Cuts::KilledFirst => [with, without],
        Cuts::KnownFirst => [without, with],
    };
    let mut undecided = 0;
    let ran_out = |text: &str| text.contains("Unknown");
    // The first kind of cut may use half the budget: searches that time out there must leave
    // time for the other kind.
    for ((with_killed, tries), budget) in order.into_iter().zip([FLIP_BUDGET / 2, FLIP_BUDGET]) {
        for &i in candidates.iter().take(tries) {
            if started.elapsed() > budget {
                break;
            }
            let cut = history[i]["return"].as_i64().unwrap_or(0);
            let truncated: Vec<Value> = history
                .iter()
                .filter(|c| c["call"].as_i64().unwrap_or(0) <= cut)
                .filter(|c| with_killed || c["killed"] != true)
                .cloned()
                .collect();
            match check_within(checker, &truncated, dir, "cut", FLIP_SEARCH) {
                (0, _) => {}
                (2, text) if ran_out(&text) => {
                    undecided += 1;
                    continue;
                }
                _ => continue,
            }
            let at = truncated
                .iter()
                .position(|c| {
                    c["call"] == history[i]["call"] && c["client"] == history[i]["client"]
                })
                .expect("the call is in the cut history");
            let mut flipped = truncated;
            flipped[at] = (flip.change)(i);
            match check_within(checker, &flipped, dir, name, FLIP_SEARCH) {
                (1, _) => {
                    let killed = flipped.iter().filter(|c| c["killed"] == true).count();
                    eprintln!(
                        "linearizability: {name} refused: a cut of {} calls ({killed} killed), {undecided} searches past {FLIP_SEARCH:?} before it, {:.1?}",
                        flipped.len(),
                        started.elapsed()
                    );
                    return;
                }
                (2, text) if ran_out(&text) => undecided += 1,
                (0, text) => panic!("{what} passed the checker:\n{text}"),
                (code, text) => panic!("the checker failed (exit {code}) on {what}:\n{text}"),
            }
        }
    }
    panic!(
        "no call to turn into {what} ({} candidates, {undecided} searches past {FLIP_SEARCH:?}, {:.0?} spent)",
        candidates.len(),
        started.elapsed()
    );
}

/// How long all the searches for one mutation may take: a failing run ends in minutes, not
/// hours.
const FLIP_BUDGET: Duration = Duration::from_secs(240);

/// How long the checker may search the whole recorded history (or a copy changed in one call).
const FULL_SEARCH: Duration = Duration::from_secs(120);

/// How long the checker may search one cut, flipped or not, before the next cut is tried.
const FLIP_SEARCH: Duration = Duration::from_secs(40);

/// The suite's two histories.
pub fn suite(args: &Arguments) -> Conclusion {
    support::etcd::prepare();
    let mut args = args.clone();
    // One history at a time unless asked otherwise: two recorders sharing the cores would slow
    // each other's clients, and fewer calls contend less.
    args.test_threads = args.test_threads.or(Some(1));
    let trials = vec![
        support::suite::blocking_trial(
            "history_of_killed_clients_is_linearizable",
            history_of_killed_clients_is_linearizable,
        ),
        support::suite::blocking_trial(
            "permits_history_of_killed_clients_is_linearizable",
            permits_history_of_killed_clients_is_linearizable,
        ),
        support::suite::blocking_trial(
            "etcd_history_with_a_killed_leader_is_linearizable",
            etcd_history_with_a_killed_leader_is_linearizable,
        ),
    ];
    support::suite::run(&args, trials)
}
