//! Linearizability of the lease store on a real server, judged by an independent checker.
//!
//! Concurrent clients (each call one `targetlease lease ...` process, as an operator or a
//! script runs it) acquire, renew, release and check leases on a few targets of one Valkey
//! server; some calls are killed with SIGKILL mid-call, so their outcome is unknown. The history
//! (call and return times, inputs, replies) goes to `tests/porcupine`, a Porcupine model of the
//! protocol written apart from the store (it shares no code with it), which decides whether some
//! order of the calls, each placed within its window, explains every reply. Mutated copies of
//! the same history (a token that does not grow, a grant while another holds) must be refused:
//! the checker is shown to catch what it is there to catch. A missing server or Go fails the
//! suite; it never skips.

use targetlease_test_support as support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::Arguments;
use serde_json::{Value, json};

use support::kube::{repo, targetlease_bin};
use support::server::{Server, ServerKind};

const TARGETS: usize = 3;
const WORKERS: usize = 5;
const TTL_MS: u64 = 1200;
/// The share of calls killed mid-call (per mille).
const KILL_PER_MILLE: u64 = 120;

/// A small xorshift generator: reproducible from the printed seed.
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
}

struct Recorder {
    valkey_url: String,
    bin: PathBuf,
    started: Instant,
    calls: Mutex<Vec<Value>>,
}

impl Recorder {
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
            .env("TARGETLEASE_VALKEY_URL", &self.valkey_url)
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
        // A killed call ran, if at all, within moments of the kill: two seconds is generous.
        record["settle"] = json!(if killed { kill_time } else { ret } + 2_000_000_000);
        record["out"] = reply.clone().unwrap_or(Value::Null);
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
        reply
    }
}

fn worker(rec: &Recorder, client: usize, seed: u64, until: Instant) {
    let mut rng = Rng(seed | 1);
    let mut held: Option<Held> = None;
    let mut seen: Vec<(String, u64)> = Vec::new();
    let mut n = 0;
    while Instant::now() < until {
        n += 1;
        let kill = (rng.below(1000) < KILL_PER_MILLE)
            .then(|| Duration::from_micros(2_000 + rng.below(10_000)));
        let pick = rng.below(100);
        let base = |op: &str, target: &str| json!({"op": op, "target": target, "lease": "", "owner": "", "token": 0, "ttl_ms": 0});
        match &held {
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
                let lease = format!("w{client}-{n}");
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
                    });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5 + rng.below(60)));
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
    ];
    if let Some(ttl) = ttl_ms {
        args.extend(["--ttl".into(), format!("{ttl}ms")]);
    }
    args
}

/// Builds the Porcupine checker (tests/porcupine, a Go module) into `dir`.
fn build_checker(dir: &Path) -> PathBuf {
    let out = dir.join("linearize");
    // As e2e/build.sh finds it: on PATH, else where the Go tarball installs itself.
    let go = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("go"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("/usr/local/go/bin/go"));
    let status = Command::new(go)
        .args(["build", "-o"])
        .arg(&out)
        .arg(".")
        .current_dir(repo().join("tests/porcupine"))
        .status()
        .expect("go is not installed (the checker is a Go program)");
    assert!(status.success(), "building tests/porcupine failed");
    out
}

/// Runs the checker on `history`; its exit status and output.
fn check(checker: &Path, history: &[Value], dir: &Path, name: &str) -> (i32, String) {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec(history).expect("json")).expect("write history");
    let html = dir.join(format!("{name}.html"));
    let out = Command::new(checker)
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

fn outcome(call: &Value) -> &str {
    call["out"]["outcome"].as_str().unwrap_or("?")
}

fn history_of_killed_clients_is_linearizable() {
    let dir = tempfile::tempdir().expect("dir");
    let checker = build_checker(dir.path());
    let valkey = Server::start(ServerKind::Valkey91);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(7);
    eprintln!("linearizability: seed {seed}");
    let rec = Arc::new(Recorder {
        valkey_url: valkey.url(),
        bin: targetlease_bin(),
        started: Instant::now(),
        calls: Mutex::new(Vec::new()),
    });
    let until = Instant::now() + Duration::from_secs(8);
    let workers: Vec<_> = (0..WORKERS)
        .map(|client| {
            let rec = rec.clone();
            std::thread::spawn(move || {
                worker(&rec, client, seed.wrapping_add(client as u64 * 7919), until)
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
    let mut history = rec.calls.lock().unwrap_or_else(|e| e.into_inner()).clone();
    history.sort_by_key(|c| c["call"].as_i64());
    let count = |pred: &dyn Fn(&Value) -> bool| history.iter().filter(|c| pred(c)).count();
    let killed = count(&|c| c["killed"] == true);
    let acquired = count(&|c| outcome(c) == "acquired");
    let held = count(&|c| outcome(c) == "held");
    let renewed = count(&|c| outcome(c) == "renewed");
    let released = count(&|c| outcome(c) == "released");
    let stale = count(&|c| outcome(c) == "stale");
    eprintln!(
        "linearizability: {} calls: {killed} killed, {acquired} acquired, {held} held, {renewed} renewed, {released} released, {stale} stale checks",
        history.len()
    );
    // Killed calls that had run: a refusal naming a worker as the holder when that worker's
    // last acquire on the target was killed (it never learned it held the target).
    let ghosts = (0..history.len())
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
        .count();
    eprintln!("linearizability: {ghosts} refusals name a holder whose acquire was killed");
    // A history that never contended, never lost a client or never saw a stale token proves
    // little: refuse it.
    for (what, n, least) in [
        ("killed calls", killed, 5),
        ("grants", acquired, 20),
        ("refusals (held)", held, 10),
        ("renewals", renewed, 5),
        ("releases", released, 5),
        ("killed calls that had run", ghosts, 1),
    ] {
        assert!(
            n >= least,
            "only {n} {what} in the history (at least {least} wanted)"
        );
    }

    let (code, text) = check(&checker, &history, dir.path(), "recorded");
    assert_eq!(code, 0, "the recorded history is not linearizable:\n{text}");
    eprint!("{text}");

    // The checker must refuse what it exists to refuse. A grant that repeats an earlier token
    // on the same target (tokens must grow):
    let grants: Vec<usize> = (0..history.len())
        .filter(|&i| outcome(&history[i]) == "acquired")
        .collect();
    let (first, second) = grants
        .iter()
        .find_map(|&i| {
            grants
                .iter()
                .find(|&&j| j > i && history[j]["target"] == history[i]["target"])
                .map(|&j| (i, j))
        })
        .expect("two grants on one target");
    let mut repeated = history.clone();
    repeated[second]["out"]["token"] = history[first]["out"]["token"].clone();
    let (code, text) = check(&checker, &repeated, dir.path(), "repeated-token");
    assert_eq!(code, 1, "a repeated token passed the checker:\n{text}");

    // A refusal turned into a grant: two holders at once.
    // (One with a later grant on its target: the made-up token must be passed by nothing.)
    let refusal = (0..history.len())
        .find(|&i| {
            outcome(&history[i]) == "held"
                && grants
                    .iter()
                    .any(|&j| j > i && history[j]["target"] == history[i]["target"])
        })
        .expect("a refusal followed by a grant on its target");
    let mut doubled = history.clone();
    let newest = history
        .iter()
        .filter_map(|c| c["out"]["token"].as_u64())
        .max()
        .unwrap_or(0);
    doubled[refusal]["out"] = json!({"outcome": "acquired", "token": newest + 1_000_000_000});
    let (code, text) = check(&checker, &doubled, dir.path(), "two-holders");
    assert_eq!(code, 1, "a second holder passed the checker:\n{text}");
}

fn main() {
    let args = Arguments::from_args();
    let trials = vec![support::suite::blocking_trial(
        "history_of_killed_clients_is_linearizable",
        history_of_killed_clients_is_linearizable,
    )];
    support::suite::finish("linearizability", libtest_mimic::run(&args, trials));
}
