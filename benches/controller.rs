//! The controller on a real local control plane (`e2e/cluster up`) and a real Valkey 9.1.
//!
//! `cargo bench --bench controller` (options after `--`, see `HELP` and
//! docs/internals/performance.md).
//!
//! Phases, each with a fresh release-build controller watching its own namespace:
//! 1. scale: N TargetLeases on distinct targets created at once (a bounded number in flight);
//!    seconds until a watch saw all of them Held, API requests and status writes per lease,
//!    controller peak RSS and CPU; then all of them deleted and the seconds until they are gone.
//! 2. hand-over on an idle controller: pairs (holder, waiter) on one target each; the holder is
//!    deleted and the time until a watch sees the waiter Held is recorded, one pair at a time,
//!    in blocks alternating with the hand-over's floor (the API requests on a hand-over's path,
//!    made by this benchmark alone; see `Floor`); then the controller's figures over the floor's.
//! 3. scale again with the large N, then the steady state for two TTLs (API writes per second,
//!    Valkey commands per second, controller CPU), then hand-overs again with all of those leases
//!    held and renewed in the background.
//!
//! Nothing here asserts on speed. Bounds on waiting only keep a broken run from hanging.

use targetlease_test_support as support;

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use targetlease::api::{Phase, TargetLease, TargetLeaseSpec};
use tokio::sync::mpsc;

use clap::Parser;
use common::{CommonArgs, cpu_seconds, loadavg, machine, quantile, status_kib};
use support::etcd::EtcdCluster;
use support::kube::{Cluster, ControllerProcess, condition, http_get, metric, phase_of};
use support::proxy::{Mode, Proxy};
use support::server::{Server, ServerKind};

/// Options after `cargo bench --bench controller --`.
#[derive(Debug, Parser)]
#[command(name = "cargo bench --bench controller --")]
struct Options {
    /// Leases of the first scale phase [default: 1000; smoke: 10]
    #[arg(long)]
    small: Option<usize>,
    /// Leases of the second scale phase and the steady state [default: 10000; smoke: 20]
    #[arg(long)]
    large: Option<usize>,
    /// Hand-overs per hand-over phase [default: 200; smoke: 3]
    #[arg(long)]
    handovers: Option<usize>,
    /// Concurrent create requests
    #[arg(long, default_value_t = 32)]
    in_flight: usize,
    /// ttlSeconds of the scale phases' leases [default: 30; smoke: 2]
    #[arg(long)]
    ttl: Option<u32>,
    /// Length of the steady state in TTLs
    #[arg(long, default_value_t = 2.0)]
    steady_ttls: f64,
    /// Which of api,small,handover,large,overload to run, comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "api,small,handover,large,overload"
    )]
    phases: Vec<String>,
    /// Latency the overload phase adds to each chunk of the controller's API connection, each
    /// way, in ms [default: 3000; smoke: 1000]
    #[arg(long)]
    overload_latency_ms: Option<u64>,
    /// How long the overload phase keeps the latency, in TTLs
    #[arg(long, default_value_t = 3.0)]
    overload_ttls: f64,
    /// Objects per request kind in the api phase [default: 1000; smoke: 10]
    #[arg(long)]
    api_ops: Option<usize>,
    /// Where the controller keeps its leases: valkey, or etcd (three members; the small and
    /// handover phases only)
    #[arg(long, default_value = "valkey", value_parser = ["valkey", "etcd"])]
    store: String,
    #[command(flatten)]
    common: CommonArgs,
}

/// Every wait is bounded so that a broken run ends; these are not speed goals.
const WAIT_LIMIT: Duration = Duration::from_secs(900);
const HANDOVER_LIMIT: Duration = Duration::from_secs(30);
/// Hand-overs per block: the controller's and the floor's alternate in blocks of this many.
const FLOOR_BLOCK: usize = 25;

struct Bench {
    cluster: Arc<Cluster>,
    client: Client,
    /// Valkey: the store, or (with etcd) only the clock `truth` reads, this machine's.
    valkey: Server,
    /// Three etcd members when the controller keeps its leases there.
    etcd: Option<EtcdCluster>,
    valkey_conn: redis::aio::MultiplexedConnection,
    in_flight: usize,
    ttl: u32,
    out: std::path::PathBuf,
    report: String,
    json: serde_json::Map<String, serde_json::Value>,
    checks: Vec<(String, bool)>,
}

/// What a watch saw of one TargetLease, with the instant it saw it.
struct Seen {
    name: String,
    phase: Option<Phase>,
    token: Option<u64>,
    expires_at: Option<jiff::Timestamp>,
    /// The `Ready` condition's reason: why a lease is Lost.
    reason: String,
    /// Whether it has a deletion timestamp (deleted, its finalizer not yet removed) or is gone.
    deleting: bool,
    /// Whether the watch saw it removed (no finalizer left).
    gone: bool,
    resource_version: Option<String>,
    at: Instant,
}

/// Streams what a watch sees of every TargetLease change in `ns` matching `labels`; the watch
/// stops when the receiver is dropped.
fn watch_phases(client: &Client, ns: &str, labels: &str) -> mpsc::UnboundedReceiver<Seen> {
    let api: Api<TargetLease> = Api::namespaced(client.clone(), ns);
    let (tx, rx) = mpsc::unbounded_channel();
    let config = watcher::Config::default().labels(labels);
    tokio::spawn(async move {
        let stream = watcher(api, config).default_backoff();
        futures::pin_mut!(stream);
        loop {
            let next = tokio::select! {
                next = stream.try_next() => next,
                () = tx.closed() => return,
            };
            let (obj, gone) = match next {
                Ok(Some(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj))) => {
                    (obj, false)
                }
                Ok(Some(watcher::Event::Delete(obj))) => (obj, true),
                Ok(Some(_)) => continue,
                Ok(None) => return,
                Err(e) => {
                    eprintln!("watch error (retrying): {e}");
                    continue;
                }
            };
            let status = obj.status.as_ref();
            let seen = Seen {
                name: obj.name_any(),
                phase: phase_of(&obj),
                token: status.and_then(|s| s.fencing_token),
                expires_at: status.and_then(|s| s.expires_at),
                reason: condition(&obj, "Ready").map_or_else(String::new, |c| c.reason.clone()),
                deleting: gone || obj.metadata.deletion_timestamp.is_some(),
                gone,
                resource_version: obj.resource_version(),
                at: Instant::now(),
            };
            if tx.send(seen).is_err() {
                return;
            }
        }
    });
    rx
}

/// A change the watch saw that a healthy lease should never make.
enum LossKind {
    /// A move to Lost, with the `Ready` reason.
    Lost(String),
    /// Held under a new fencing token by a lease that already had one: a second grant, so the
    /// first tenure ended (whether or not a Lost status was written in between).
    NewToken,
}

struct Loss {
    name: String,
    at: Instant,
    kind: LossKind,
}

/// Latest state per name, fed from a watch, and every [`Loss`] it saw.
struct Phases {
    rx: mpsc::UnboundedReceiver<Seen>,
    now: HashMap<String, Seen>,
    losses: Vec<Loss>,
    /// When the watch first saw each name being deleted.
    deleting_seen: HashMap<String, Instant>,
    /// When the watch first saw each name Released.
    released_seen: HashMap<String, Instant>,
}

impl Phases {
    fn new(rx: mpsc::UnboundedReceiver<Seen>) -> Self {
        Self {
            rx,
            now: HashMap::new(),
            losses: Vec::new(),
            deleting_seen: HashMap::new(),
            released_seen: HashMap::new(),
        }
    }

    fn record(&mut self, seen: Seen) {
        let before = self.now.get(&seen.name);
        let was_lost = before.is_some_and(|b| b.phase == Some(Phase::Lost));
        if seen.phase == Some(Phase::Lost) && !was_lost {
            self.losses.push(Loss {
                name: seen.name.clone(),
                at: seen.at,
                kind: LossKind::Lost(seen.reason.clone()),
            });
        }
        if seen.deleting {
            self.deleting_seen
                .entry(seen.name.clone())
                .or_insert(seen.at);
        }
        if seen.phase == Some(Phase::Released) {
            self.released_seen
                .entry(seen.name.clone())
                .or_insert(seen.at);
        }
        let old_token = before.and_then(|b| b.token);
        if seen.phase == Some(Phase::Held) && old_token.is_some() && seen.token != old_token {
            self.losses.push(Loss {
                name: seen.name.clone(),
                at: seen.at,
                kind: LossKind::NewToken,
            });
        }
        self.now.insert(seen.name.clone(), seen);
    }

    /// Records everything the watch has delivered so far.
    fn drain(&mut self) {
        while let Ok(seen) = self.rx.try_recv() {
            self.record(seen);
        }
    }

    /// Records what the watch delivers for `d`.
    async fn follow(&mut self, d: Duration) {
        let deadline = tokio::time::Instant::now() + d;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(seen)) => self.record(seen),
                // A watch that ended still leaves `d` to wait: the caller's window keeps its length.
                Ok(None) => return tokio::time::sleep_until(deadline).await,
                Err(_) => return,
            }
        }
    }

    fn phase(&self, name: &str) -> Option<Phase> {
        self.now.get(name).and_then(|s| s.phase)
    }

    fn count(&self, names: &HashSet<String>, phase: Phase) -> usize {
        names
            .iter()
            .filter(|n| self.phase(n) == Some(phase))
            .count()
    }

    /// The losses the watch saw in `[from, to)`.
    fn losses(&self, from: Instant, to: Instant) -> Losses {
        let mut out = Losses::default();
        let mut lost_names = HashSet::new();
        for loss in self.losses.iter().filter(|l| from <= l.at && l.at < to) {
            match &loss.kind {
                LossKind::NewToken => out.new_tokens += 1,
                LossKind::Lost(reason) => {
                    out.transitions += 1;
                    lost_names.insert(loss.name.as_str());
                    *out.reasons.entry(reason.clone()).or_default() += 1;
                }
            }
        }
        out.leases = lost_names.len();
        out
    }

    /// Waits until every name in `names` is in `phase`; returns the instant the last one was seen.
    async fn wait_all(
        &mut self,
        names: &HashSet<String>,
        phase: Phase,
        limit: Duration,
    ) -> Option<Instant> {
        let deadline = Instant::now() + limit;
        let mut last = Instant::now();
        while self.count(names, phase) < names.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(seen)) => {
                    last = seen.at;
                    self.record(seen);
                }
                _ => {
                    eprintln!(
                        "only {} of {} {phase:?} after {limit:?}",
                        self.count(names, phase),
                        names.len()
                    );
                    return None;
                }
            }
        }
        Some(last)
    }

    /// Waits until `name` is seen in `phase`; returns the instant it was seen.
    async fn wait_one(&mut self, name: &str, phase: Phase, limit: Duration) -> Option<Instant> {
        self.wait_for(limit, |seen| seen.name == name && seen.phase == Some(phase))
            .await
            .map(|(at, _)| at)
    }

    /// Waits until the watch delivers a change `hit` accepts; returns the instant it was seen
    /// and its resourceVersion.
    async fn wait_for(
        &mut self,
        limit: Duration,
        hit: impl Fn(&Seen) -> bool,
    ) -> Option<(Instant, Option<String>)> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(seen)) => {
                    let hit = hit(&seen).then(|| (seen.at, seen.resource_version.clone()));
                    self.record(seen);
                    if hit.is_some() {
                        return hit;
                    }
                }
                _ => return None,
            }
        }
    }
}

/// Losses in a window, as the watch saw them.
#[derive(Default)]
struct Losses {
    /// Moves to Lost.
    transitions: usize,
    /// Leases that moved to Lost at least once.
    leases: usize,
    /// Moves to Lost by the `Ready` reason.
    reasons: BTreeMap<String, usize>,
    /// Held again under a new fencing token.
    new_tokens: usize,
}

impl Losses {
    fn line(&self) -> String {
        let reasons = if self.reasons.is_empty() {
            String::new()
        } else {
            let by: Vec<String> = self
                .reasons
                .iter()
                .map(|(r, n)| format!("{r} {n}"))
                .collect();
            format!(" (reasons: {})", by.join(", "))
        };
        format!(
            "{} moves to Lost by {} leases{reasons}; {} grants under a new token",
            self.transitions, self.leases, self.new_tokens
        )
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "lostTransitions": self.transitions,
            "lostLeases": self.leases,
            "lostReasons": self.reasons,
            "newTokens": self.new_tokens,
        })
    }
}

fn lease(name: &str, target: &str, holder: &str, ttl: u32, label: &str) -> TargetLease {
    let mut lease = TargetLease::new(
        name,
        TargetLeaseSpec {
            target: target.to_owned(),
            holder: holder.to_owned(),
            holder_ref: None,
            ttl_seconds: ttl,
            permits: 1,
            max_hold_seconds: None,
            release: false,
            priority: None,
        },
    );
    lease.metadata = ObjectMeta {
        name: Some(name.to_owned()),
        labels: Some([("bench".to_owned(), label.to_owned())].into()),
        ..ObjectMeta::default()
    };
    lease
}

/// `n` TargetLeases labelled `label`, each on a target of its own, and their names.
fn own_targets(n: usize, ttl: u32, label: &str) -> (Vec<TargetLease>, HashSet<String>) {
    let leases: Vec<TargetLease> = (0..n)
        .map(|i| {
            lease(
                &format!("lease-{i:05}"),
                &format!("target-{i:05}"),
                &format!("worker-{i:05}"),
                ttl,
                label,
            )
        })
        .collect();
    let names = leases.iter().map(ResourceExt::name_any).collect();
    (leases, names)
}

/// Creates `leases` with at most `in_flight` requests at a time; returns the seconds it took.
async fn create_all(api: &Api<TargetLease>, leases: Vec<TargetLease>, in_flight: usize) -> f64 {
    let started = Instant::now();
    let results: Vec<Result<TargetLease, kube::Error>> = futures::stream::iter(leases)
        .map(|l| {
            let api = api.clone();
            async move { api.create(&PostParams::default(), &l).await }
        })
        .buffer_unordered(in_flight)
        .collect()
        .await;
    let failed = results.iter().filter(|r| r.is_err()).count();
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        eprintln!("{failed} creates failed; first: {e}");
    }
    started.elapsed().as_secs_f64()
}

/// `apiserver_request_total` summed over codes: (verb, resource/subresource) -> (all, non-2xx,
/// seconds spent: the sum of `apiserver_request_duration_seconds`).
type ApiCounts = BTreeMap<(String, String), (u64, u64, f64)>;

fn verb_resource(labels: &HashMap<&str, &str>) -> (String, String) {
    let resource = match labels.get("subresource").copied().unwrap_or("") {
        "" => labels.get("resource").copied().unwrap_or("").to_owned(),
        sub => format!("{}/{sub}", labels.get("resource").copied().unwrap_or("")),
    };
    (
        labels.get("verb").copied().unwrap_or("").to_owned(),
        resource,
    )
}

fn labels_of(s: &str) -> HashMap<&str, &str> {
    let mut out = HashMap::new();
    let mut rest = s;
    while let Some((key, after)) = rest.split_once("=\"") {
        let Some((value, tail)) = after.split_once('"') else {
            break;
        };
        out.insert(key.trim_start_matches(','), value);
        rest = tail;
    }
    out
}

async fn api_counts(client: &Client) -> ApiCounts {
    let request = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("metrics request");
    let text = client
        .request_text(request)
        .await
        .expect("API server /metrics");
    let mut counts = ApiCounts::new();
    for line in text.lines() {
        let (rest, is_duration) = if let Some(rest) = line.strip_prefix("apiserver_request_total{")
        {
            (rest, false)
        } else if let Some(rest) = line.strip_prefix("apiserver_request_duration_seconds_sum{") {
            (rest, true)
        } else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let labels = labels_of(labels);
        let value: f64 = value.trim().parse().unwrap_or(0.0);
        let entry = counts.entry(verb_resource(&labels)).or_default();
        if is_duration {
            entry.2 += value;
            continue;
        }
        entry.0 += value as u64;
        if !labels.get("code").is_some_and(|c| c.starts_with('2')) {
            entry.1 += value as u64;
        }
    }
    counts
}

fn api_delta(before: &ApiCounts, after: &ApiCounts) -> ApiCounts {
    after
        .iter()
        .filter_map(|(k, (n, bad, secs))| {
            let (n0, bad0, secs0) = before.get(k).copied().unwrap_or((0, 0, 0.0));
            let d = (n.saturating_sub(n0), bad.saturating_sub(bad0), secs - secs0);
            (d.0 > 0).then(|| (k.clone(), d))
        })
        .collect()
}

/// Adds `delta` to `into`.
fn add_counts(into: &mut ApiCounts, delta: &ApiCounts) {
    for (key, (n, bad, secs)) in delta {
        let entry = into.entry(key.clone()).or_default();
        entry.0 += n;
        entry.1 += bad;
        entry.2 += secs;
    }
}

const WRITE_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// Requests the controller makes: its writes to TargetLeases (finalizer, status) and Events.
/// The benchmark itself only creates, deletes, lists and watches; the kube-controller-manager's
/// garbage collector only lists and watches TargetLeases.
fn controller_writes(delta: &ApiCounts) -> u64 {
    delta
        .iter()
        .filter(|((verb, resource), _)| {
            let tl_write = resource.starts_with("targetleases")
                && matches!(verb.as_str(), "PATCH" | "APPLY" | "PUT");
            let event = resource == "events" && matches!(verb.as_str(), "POST" | "PATCH");
            tl_write || event
        })
        .map(|(_, (n, _, _))| n)
        .sum()
}

fn count(delta: &ApiCounts, verb: &str, resource: &str) -> u64 {
    delta
        .get(&(verb.to_owned(), resource.to_owned()))
        .map_or(0, |(n, _, _)| *n)
}

fn api_table(delta: &ApiCounts, per: f64, per_name: &str) -> String {
    let mut out = format!(
        "| verb | resource | requests | non-2xx | per {per_name} | mean latency ms |\n|---|---|---|---|---|---|\n"
    );
    for ((verb, resource), (n, bad, secs)) in delta {
        let _ = writeln!(
            out,
            "| {verb} | {resource} | {n} | {bad} | {:.3} | {:.1} |",
            *n as f64 / per,
            secs / *n as f64 * 1000.0
        );
    }
    out
}

async fn controller_metrics(controller: &ControllerProcess) -> String {
    let addr = controller.http.clone();
    tokio::task::spawn_blocking(move || http_get(&addr, "/metrics"))
        .await
        .ok()
        .flatten()
        .map(|(_, body)| body)
        .unwrap_or_default()
}

/// Valkey's total_commands_processed and EVALSHA calls.
async fn valkey_counts(conn: &mut redis::aio::MultiplexedConnection) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("everything")
        .query_async(conn)
        .await
        .expect("INFO");
    let mut total = 0;
    let mut evalsha = 0;
    for line in info.lines() {
        if let Some(v) = line.trim().strip_prefix("total_commands_processed:") {
            total = v.parse().unwrap_or(0);
        }
        if let Some(v) = line.trim().strip_prefix("cmdstat_evalsha:") {
            evalsha = v
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
        }
    }
    (total, evalsha)
}

/// Valkey's EVALSHA calls and the microseconds it spent in them (`INFO commandstats`).
async fn evalsha_stats(conn: &mut redis::aio::MultiplexedConnection) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    let field = |line: &str, key: &str| {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    info.lines()
        .find_map(|l| l.trim().strip_prefix("cmdstat_evalsha:"))
        .map_or((0, 0), |l| (field(l, "calls="), field(l, "usec=")))
}

/// The steps of each hand-over, in ms, from the instants the benchmark saw: its delete sent and
/// answered, the holder seen deleted and seen Released by its watch, the waiter seen Held.
#[derive(Default)]
struct Steps {
    /// The delete request, sent to answered.
    delete: Vec<f64>,
    /// The delete answered to the watch showing it: one watch delay.
    watch: Vec<f64>,
    /// Shown deleted to shown Released: the controller's watch delay, the holder's reconcile
    /// and its status write, the watch delay back.
    released: Vec<f64>,
    /// Shown Released to the waiter shown Held: the release in the store, the wake, the
    /// waiter's reconcile, its acquire and its status write, the watch delay back.
    held: Vec<f64>,
}

impl Steps {
    fn record(
        &mut self,
        start: Instant,
        deleted: Instant,
        deleting: Option<Instant>,
        released: Option<Instant>,
        held: Instant,
    ) {
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1000.0;
        self.delete.push(ms(start, deleted));
        if let (Some(deleting), Some(released)) = (deleting, released) {
            self.watch.push(ms(deleted, deleting));
            self.released.push(ms(deleting, released));
            self.held.push(ms(released, held));
        }
    }

    fn rows(&self) -> [(&'static str, &Vec<f64>); 4] {
        [
            ("delete request (sent -> answered)", &self.delete),
            ("watch shows the delete (answered -> seen)", &self.watch),
            (
                "holder Released (seen deleted -> seen Released: controller watch, reconcile, status write)",
                &self.released,
            ),
            (
                "waiter Held (seen Released -> seen Held: release, wake, acquire, status write)",
                &self.held,
            ),
        ]
    }

    fn table(&self) -> String {
        let mut out = String::from(
            "  | step | count | p50 ms | p90 ms | p99 ms |\n  |---|---|---|---|---|\n",
        );
        for (name, samples) in self.rows() {
            let mut sorted: Vec<u64> = samples.iter().map(|ms| (ms * 1000.0) as u64).collect();
            sorted.sort_unstable();
            let q = |p: f64| common::quantile(&sorted, p) as f64 / 1000.0;
            let _ = writeln!(
                out,
                "  | {name} | {} | {:.1} | {:.1} | {:.1} |",
                sorted.len(),
                q(0.5),
                q(0.9),
                q(0.99)
            );
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for (name, samples) in self.rows() {
            out.insert(name.to_owned(), serde_json::json!(samples));
        }
        serde_json::Value::Object(out)
    }
}

/// The floor of a hand-over: the API requests on a hand-over's path, made by this benchmark
/// itself in a namespace no controller watches, with nothing between them but its own watch. A
/// controller's hand-over cannot be faster than its floor on the same API server, so each
/// hand-over phase alternates blocks of the controller's hand-overs and of the floor's (the API
/// requests of the controller's table are counted around its blocks only) and prints the ratio.
/// The requests a controller makes beside the path (the deleted holder's finalizer removal, two
/// Events) are off the floor's clock: what they cost the controller's hand-over, by loading the
/// API server at the moment of the waiter's write, counts in the controller's share.
///
/// - With the status rule (a deleted holder never shows Held beside its successor): the holder
///   (with the finalizer) deleted; the watch shows it; the holder's `Released` status applied;
///   the waiter's Held status applied; the watch shows it. Three requests one after the other,
///   as the controller makes them (each status apply as the controller's field manager, with
///   the resourceVersion it was decided on).
/// - Without it and without a finalizer (for comparison: the fewest requests any hand-over
///   after a delete can make): a holder without finalizer deleted; the watch shows it gone; the
///   waiter's Held status applied; the watch shows it.
struct Floor {
    api: Api<TargetLease>,
    phases: Phases,
    label: String,
    pairs: usize,
    rule: Vec<f64>,
    plain: Vec<f64>,
    missed: usize,
}

/// The holder's and the waiter's statuses, as the controller would write them.
struct FloorStatuses {
    held: targetlease::api::TargetLeaseStatus,
    next_held: targetlease::api::TargetLeaseStatus,
    released: targetlease::api::TargetLeaseStatus,
    waiting: targetlease::api::TargetLeaseStatus,
}

impl FloorStatuses {
    fn new() -> Self {
        use targetlease::api::Reason;
        use targetlease::controller::status::Observed;
        use targetlease::store::{Grant, Permits, Slot};
        let now = jiff::Timestamp::now();
        let server_ms = u64::try_from(now.as_millisecond()).unwrap_or(0);
        let grant = |token| Grant {
            token,
            slot: Slot::ZERO,
            acquired_at_ms: server_ms,
            server_time_ms: server_ms,
            expires_in_ms: 30_000,
        };
        let held = Observed::held(&grant(7), Permits::ONE, "first").into_status(Some(1), None, now);
        let waiting = Observed::waiting("first", None).into_status(Some(1), None, now);
        Self {
            next_held: Observed::held(&grant(8), Permits::ONE, "second").into_status(
                Some(1),
                Some(&waiting),
                now,
            ),
            released: Observed::released(
                Reason::ReleaseRequested,
                "resource deleted".to_owned(),
                Some(7),
            )
            .into_status(Some(1), Some(&held), now),
            held,
            waiting,
        }
    }
}

impl Floor {
    /// Creates `pairs` holder/waiter pairs of each kind in `ns`, shown Held and Waiting.
    async fn new(
        bench: &Bench,
        ns: &str,
        label: &str,
        pairs: usize,
        statuses: &FloorStatuses,
    ) -> Option<Floor> {
        bench.cluster.kubectl_ok(&["create", "namespace", ns]);
        let api: Api<TargetLease> = Api::namespaced(bench.client.clone(), ns);
        let mut phases = Phases::new(watch_phases(&bench.client, ns, "bench=floor"));
        let mut leases = Vec::new();
        for i in 0..pairs {
            for kind in ["rule", "plain"] {
                let target = format!("floor/{kind}-{i:04}");
                let mut holder = lease(&format!("{kind}-h-{i:04}"), &target, "first", 30, "floor");
                if kind == "rule" {
                    holder.metadata.finalizers = Some(vec![targetlease::api::FINALIZER.to_owned()]);
                }
                leases.push((holder, &statuses.held));
                let waiter = lease(&format!("{kind}-w-{i:04}"), &target, "second", 30, "floor");
                leases.push((waiter, &statuses.waiting));
            }
        }
        let shown_as = |status: &targetlease::api::TargetLeaseStatus| -> HashSet<String> {
            leases
                .iter()
                .filter(|(_, s)| s.phase == status.phase)
                .map(|(l, _)| l.name_any())
                .collect()
        };
        let (holders, waiters) = (shown_as(&statuses.held), shown_as(&statuses.waiting));
        for (lease, status) in leases {
            let name = lease.name_any();
            let created = api.create(&PostParams::default(), &lease).await;
            if let Err(e) = created.map(|_| ()) {
                eprintln!("floor: create {name}: {e}");
                return None;
            }
            if let Err(e) = Self::apply(&api, &name, status, None).await {
                eprintln!("floor: status of {name}: {e}");
                return None;
            }
        }
        phases.wait_all(&holders, Phase::Held, WAIT_LIMIT).await?;
        phases
            .wait_all(&waiters, Phase::Waiting, WAIT_LIMIT)
            .await?;
        Some(Floor {
            api,
            phases,
            label: label.to_owned(),
            pairs,
            rule: Vec::new(),
            plain: Vec::new(),
            missed: 0,
        })
    }

    /// Hand-over `i` of each kind; records its time, from the delete sent to the watch showing
    /// the waiter Held.
    async fn hand_over(&mut self, i: usize, statuses: &FloorStatuses) {
        for kind in ["rule", "plain"] {
            let (holder, waiter) = (format!("{kind}-h-{i:04}"), format!("{kind}-w-{i:04}"));
            let waiter_version = self
                .phases
                .now
                .get(&waiter)
                .and_then(|s| s.resource_version.clone());
            let rule = kind == "rule";
            match self
                .one(&holder, &waiter, waiter_version, statuses, rule)
                .await
            {
                Ok(ms) if rule => self.rule.push(ms),
                Ok(ms) => self.plain.push(ms),
                Err(e) => {
                    eprintln!("floor {}: {holder}: {e}", self.label);
                    self.missed += 1;
                }
            }
            if rule {
                // Off the clock, as the controller's finalizer patch is off the path.
                let patch = serde_json::json!({"metadata": {"finalizers": null}});
                let removed = self
                    .api
                    .patch(
                        &holder,
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(&patch),
                    )
                    .await;
                if let Err(e) = removed {
                    eprintln!("floor {}: finalizer of {holder}: {e}", self.label);
                }
            }
        }
        self.phases.drain();
    }

    /// One floor hand-over of `holder` to `waiter`: with the status rule (`rule`: the holder's
    /// `Released` apply once the watch shows the delete) or without it (the watch shows the
    /// holder gone). Answers its time, from the delete sent to the watch showing the waiter Held.
    async fn one(
        &mut self,
        holder: &str,
        waiter: &str,
        waiter_version: Option<String>,
        statuses: &FloorStatuses,
        rule: bool,
    ) -> Result<f64, String> {
        let start = Instant::now();
        self.api
            .delete(holder, &DeleteParams::default())
            .await
            .map_err(|e| format!("delete: {e}"))?;
        let (_, version) = self
            .phases
            .wait_for(HANDOVER_LIMIT, |s| {
                s.name == holder && if rule { s.deleting } else { s.gone }
            })
            .await
            .ok_or("the watch never showed the delete")?;
        if rule {
            Self::apply(&self.api, holder, &statuses.released, version)
                .await
                .map_err(|e| format!("Released: {e}"))?;
        }
        Self::apply(&self.api, waiter, &statuses.next_held, waiter_version)
            .await
            .map_err(|e| format!("Held: {e}"))?;
        let at = self
            .phases
            .wait_one(waiter, Phase::Held, HANDOVER_LIMIT)
            .await
            .ok_or("the watch never showed the waiter Held")?;
        Ok((at - start).as_secs_f64() * 1000.0)
    }

    /// The floor's figures beside the controller's `controller` hand-overs (in blocks alternating
    /// with these), as report lines and JSON.
    fn report(&self, controller: &[f64]) -> (String, serde_json::Value) {
        let figures = |samples: &[f64]| {
            let mut sorted: Vec<u64> = samples.iter().map(|ms| (ms * 1000.0) as u64).collect();
            sorted.sort_unstable();
            [0.5, 0.9, 0.99, 0.0].map(|p| common::quantile(&sorted, p) as f64 / 1000.0)
        };
        let [c50, _, c99, _] = figures(controller);
        let mut lines = String::new();
        let mut json = serde_json::Map::new();
        for (name, what, samples) in [
            (
                "with the status rule",
                "delete, the watch shows it, the holder's Released apply, the waiter's Held apply, the watch shows it",
                &self.rule,
            ),
            (
                "without the status rule",
                "a holder without finalizer deleted, the watch shows it gone, the waiter's Held apply, the watch shows it",
                &self.plain,
            ),
        ] {
            let [p50, p90, p99, min] = figures(samples);
            // No sample: no ratio (NaN, `null` in the JSON) rather than a division by zero.
            let over = |c: f64, f: f64| if f > 0.0 { c / f } else { f64::NAN };
            let _ = writeln!(
                lines,
                "- floor {name} ({what}; this benchmark alone, in blocks alternating with the controller's): \
                 p50 {p50:.1} ms, p90 {p90:.1} ms, p99 {p99:.1} ms, min {min:.1} ms ({} hand-overs); \
                 the controller's / this floor: p50 {:.2}, p99 {:.2}",
                samples.len(),
                over(c50, p50),
                over(c99, p99),
            );
            json.insert(
                name.replace(' ', "-"),
                serde_json::json!({
                    "count": samples.len(), "p50Ms": p50, "p90Ms": p90, "p99Ms": p99, "minMs": min,
                    "controllerOverFloorP50": over(c50, p50), "controllerOverFloorP99": over(c99, p99),
                    "samplesMs": samples,
                }),
            );
        }
        json.insert("missed".into(), serde_json::json!(self.missed));
        (lines, serde_json::Value::Object(json))
    }

    /// Whether every floor hand-over was measured.
    fn complete(&self) -> bool {
        self.missed == 0 && self.rule.len() == self.pairs && self.plain.len() == self.pairs
    }

    /// One status apply, as the controller makes it.
    async fn apply(
        api: &Api<TargetLease>,
        name: &str,
        status: &targetlease::api::TargetLeaseStatus,
        resource_version: Option<String>,
    ) -> Result<(), kube::Error> {
        use kube::api::{Patch, PatchParams};
        let mut patch = serde_json::json!({
            "apiVersion": "targetlease.dev/v1beta1",
            "kind": "TargetLease",
            "status": status,
        });
        if let Some(version) = resource_version {
            patch["metadata"] = serde_json::json!({ "resourceVersion": version });
        }
        api.patch_status(
            name,
            &PatchParams::apply(targetlease::api::FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map(|_| ())
    }
}

/// CPU seconds of the controller, kube-apiserver, etcd and valkey, for one phase's window.
struct Cpu {
    pids: Vec<(&'static str, u32)>,
    start: Vec<f64>,
    at: Instant,
}

impl Cpu {
    fn start(pids: Vec<(&'static str, u32)>) -> Cpu {
        let start = pids.iter().map(|(_, p)| cpu_seconds(*p)).collect();
        Cpu {
            pids,
            start,
            at: Instant::now(),
        }
    }

    fn stop(&self) -> Vec<(&'static str, f64, f64)> {
        let wall = self.at.elapsed().as_secs_f64();
        self.pids
            .iter()
            .zip(&self.start)
            .map(|((name, pid), s)| {
                let used = cpu_seconds(*pid) - s;
                (*name, used, used / wall * 100.0)
            })
            .collect()
    }
}

/// Samples the controller's open sockets and threads every 250 ms and keeps the maxima.
struct Sampler {
    stop: tokio::sync::oneshot::Sender<()>,
    done: tokio::task::JoinHandle<(usize, usize)>,
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let done = tokio::spawn(async move {
            let (mut sockets, mut threads) = (0, 0);
            loop {
                let n = std::fs::read_dir(format!("/proc/{pid}/fd"))
                    .map(|d| {
                        d.filter_map(Result::ok)
                            .filter(|e| {
                                std::fs::read_link(e.path())
                                    .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                            })
                            .count()
                    })
                    .unwrap_or(0);
                sockets = sockets.max(n);
                threads = threads.max(status_kib(pid, "Threads") as usize);
                tokio::select! {
                    _ = &mut stopped => return (sockets, threads),
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
            }
        });
        Sampler { stop, done }
    }

    async fn stop(self) -> (usize, usize) {
        let _ = self.stop.send(());
        self.done.await.unwrap_or((0, 0))
    }
}

/// The start of a measured window: what the API server, the controller and /proc said then.
struct Window {
    api: ApiCounts,
    metrics: String,
    cpu: Cpu,
}

/// What happened in a window.
struct Measured {
    from: Instant,
    to: Instant,
    secs: f64,
    api: ApiCounts,
    before: String,
    after: String,
    cpu: Vec<(&'static str, f64, f64)>,
}

impl Window {
    async fn start(bench: &Bench, controller: &ControllerProcess) -> Window {
        Window {
            api: api_counts(&bench.client).await,
            metrics: controller_metrics(controller).await,
            cpu: Cpu::start(bench.cpu_pids(controller)),
        }
    }

    /// Ends the window now; the request counts are read `settle` later, so that requests in
    /// flight at the end are counted.
    async fn stop(
        self,
        bench: &Bench,
        controller: &ControllerProcess,
        settle: Duration,
    ) -> Measured {
        let cpu = self.cpu.stop();
        let to = Instant::now();
        tokio::time::sleep(settle).await;
        let api_after = api_counts(&bench.client).await;
        let after = controller_metrics(controller).await;
        Measured {
            from: self.cpu.at,
            to,
            secs: (to - self.cpu.at).as_secs_f64(),
            api: api_delta(&self.api, &api_after),
            before: self.metrics,
            after,
            cpu,
        }
    }
}

impl Measured {
    /// The increase of a controller counter (a name, or a name with its full label set).
    fn counter(&self, series: &str) -> f64 {
        metric(&self.after, series) - metric(&self.before, series)
    }

    fn api_requests(&self) -> u64 {
        self.api.values().map(|(n, _, _)| n).sum()
    }

    fn api_writes(&self) -> u64 {
        self.api
            .iter()
            .filter(|((verb, _), _)| WRITE_VERBS.contains(&verb.as_str()))
            .map(|(_, (n, _, _))| n)
            .sum()
    }

    fn cpu_percent(&self, name: &str) -> Option<f64> {
        self.cpu
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, _, pct)| *pct)
    }

    /// Losses, reconciles, write rates, renewal lateness and the API server's CPU, one line each.
    fn lines(&self, losses: &Losses) -> String {
        let per_sec = |n: f64| n / self.secs.max(f64::MIN_POSITIVE);
        let status_writes = self.counter(STATUS_WRITES);
        format!(
            "- Lost, seen by the watch: {}; the controller's transitions_total{{phase=\"Lost\"}}: {:.0}\n\
             - reconciles by result: {}\n\
             - status writes: {status_writes:.0} ({:.1}/s); API requests (all clients): {} ({:.1}/s), \
             of which writes {} ({:.1}/s)\n\
             - renewal lateness: {}\n\
             - renewals' store calls: {}\n\
             - kube-apiserver CPU: {}\n",
            losses.line(),
            self.counter(LOST_TRANSITIONS),
            results_line(&reconciles_by_result(&self.before, &self.after)),
            per_sec(status_writes),
            self.api_requests(),
            per_sec(self.api_requests() as f64),
            self.api_writes(),
            per_sec(self.api_writes() as f64),
            lateness(&self.before, &self.after).0,
            renew_calls(&self.before, &self.after).0,
            self.cpu_percent("kube-apiserver")
                .map_or("n/a".into(), |p| format!("{p:.0}% of one core")),
        )
    }

    fn json(&self, losses: &Losses) -> serde_json::Value {
        let per_sec = |n: f64| n / self.secs.max(f64::MIN_POSITIVE);
        serde_json::json!({
            "seconds": self.secs,
            "losses": losses.json(),
            "controllerLostTransitions": self.counter(LOST_TRANSITIONS),
            "reconciles": reconciles_by_result(&self.before, &self.after),
            "statusWritesPerSec": per_sec(self.counter(STATUS_WRITES)),
            "apiRequestsPerSec": per_sec(self.api_requests() as f64),
            "apiWritesPerSec": per_sec(self.api_writes() as f64),
            "renewalLateness": lateness(&self.before, &self.after).1,
            "renewStoreCalls": renew_calls(&self.before, &self.after).1,
            "apiserverCpuPercent": self.cpu_percent("kube-apiserver"),
            "cpuSeconds": self.cpu.iter().map(|(n, s, _)| (n.to_string(), *s)).collect::<BTreeMap<_, _>>(),
        })
    }
}

fn cpu_line(cpu: &[(&str, f64, f64)]) -> String {
    cpu.iter()
        .map(|(n, s, pct)| format!("{n} {s:.1} s ({pct:.0}% of one core)"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Bench {
    fn check(&mut self, name: &str, ok: bool) {
        eprintln!("check {name}: {}", if ok { "ok" } else { "FAILED" });
        self.checks.push((name.to_owned(), ok));
    }

    fn say(&mut self, text: &str) {
        println!("{text}");
        self.report.push_str(text);
        self.report.push('\n');
    }

    /// A controller for `ns`, reaching the API server through `kubeconfig` (a proxy's) or
    /// directly.
    fn start_controller(&self, ns: &str, kubeconfig: Option<&Path>) -> ControllerProcess {
        // The controller refuses a TTL shorter than three Valkey call timeouts: the smoke run's
        // 2 s TTL needs a shorter call timeout than the default 2 s.
        let timeout = if self.ttl < 6 { "500ms" } else { "2s" };
        let kubeconfig = kubeconfig.unwrap_or(Path::new(self.cluster.kubeconfig()));
        // The production default; the tests use debug.
        let log = [("TARGETLEASE_LOG", "info")];
        let controller = match &self.etcd {
            Some(etcd) => {
                let endpoints = etcd.urls().join(",");
                ControllerProcess::start_reaching(
                    &self.cluster,
                    kubeconfig,
                    &[
                        "--watch-namespace",
                        ns,
                        "--backend",
                        "etcd",
                        "--etcd-endpoints",
                        &endpoints,
                        "--etcd-timeout",
                        timeout,
                    ],
                    &log,
                )
            }
            None => ControllerProcess::start_with(
                &self.cluster,
                kubeconfig,
                &self.valkey.url(),
                &["--watch-namespace", ns, "--valkey-timeout", timeout],
                &log,
            ),
        };
        eprintln!("controller for {ns}: pid {}", controller.pid());
        controller
    }

    fn cpu_pids(&self, controller: &ControllerProcess) -> Vec<(&'static str, u32)> {
        let mut pids = vec![("controller", controller.pid())];
        for name in ["kube-apiserver", "etcd"] {
            if let Some(pid) = self.cluster.pid(name) {
                pids.push((name, pid));
            }
        }
        pids
    }

    /// CPU the API server and etcd spend per request of each kind the controller makes (and per
    /// create), measured without any controller, `in_flight` requests at a time.
    async fn api_costs(&mut self, ns: &str, n: usize) {
        use kube::Resource;
        use kube::api::{Patch, PatchParams};
        use kube::runtime::events::{Event, EventType, Recorder, Reporter};
        use targetlease::controller::status::Observed;
        use targetlease::store::Grant;

        let api: Api<TargetLease> = Api::namespaced(self.client.clone(), ns);
        let mut pids = Vec::new();
        for name in ["kube-apiserver", "etcd"] {
            if let Some(pid) = self.cluster.pid(name) {
                pids.push((name, pid));
            }
        }
        let names: Vec<String> = (0..n).map(|i| format!("api-{i:05}")).collect();
        let in_flight = self.in_flight;
        let mut rows = Vec::new();
        let mut measure = async |what: &str,
                                 op: &(
                                      dyn Fn(
            String,
        ) -> futures::future::BoxFuture<
            'static,
            Result<(), kube::Error>,
        > + Sync
                                  )| {
            let cpu = Cpu::start(pids.clone());
            let started = Instant::now();
            let results: Vec<Result<(), kube::Error>> = futures::stream::iter(names.clone())
                .map(op)
                .buffer_unordered(in_flight)
                .collect()
                .await;
            let wall = started.elapsed().as_secs_f64();
            let used = cpu.stop();
            let failed = results.iter().filter(|r| r.is_err()).count();
            if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                eprintln!("{what}: {failed} failed; first: {e}");
            }
            let per = |name: &str| {
                used.iter()
                    .find(|(n, _, _)| *n == name)
                    .map_or(f64::NAN, |(_, s, _)| s / n as f64 * 1000.0)
            };
            let row = format!(
                "| {what} | {n} | {failed} | {:.0} | {:.2} | {:.2} |",
                n as f64 / wall,
                per("kube-apiserver"),
                per("etcd")
            );
            eprintln!("{row}");
            rows.push((row, failed == 0));
        };
        let ttl = self.ttl;
        let create = {
            let api = api.clone();
            move |name: String| {
                let api = api.clone();
                let l = lease(&name, &format!("t-{name}"), "worker", ttl, "api");
                Box::pin(async move { api.create(&PostParams::default(), &l).await.map(|_| ()) })
                    as futures::future::BoxFuture<'static, _>
            }
        };
        measure("POST targetleases (create)", &create).await;
        let finalizer = {
            let api = api.clone();
            move |name: String| {
                let api = api.clone();
                Box::pin(async move {
                    let patch = serde_json::json!({"metadata": {"finalizers": ["targetlease.dev/release"]}});
                    api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map(|_| ())
                }) as futures::future::BoxFuture<'static, _>
            }
        };
        measure("PATCH targetleases (finalizer, merge patch)", &finalizer).await;
        let status = |token: u64, apply: bool| {
            let api = api.clone();
            move |name: String| {
                let api = api.clone();
                let grant = Grant {
                    token,
                    slot: targetlease::store::Slot::ZERO,
                    acquired_at_ms: 1_764_000_000_000,
                    server_time_ms: 1_764_000_000_000,
                    expires_in_ms: 30_000,
                };
                let new = Observed::held(&grant, targetlease::store::Permits::ONE, "worker")
                    .into_status(Some(1), None, jiff::Timestamp::now());
                Box::pin(async move {
                    if apply {
                        let patch = serde_json::json!({
                            "apiVersion": "targetlease.dev/v1beta1",
                            "kind": "TargetLease",
                            "status": new,
                        });
                        api.patch_status(
                            &name,
                            &PatchParams::apply("targetlease-controller").force(),
                            &Patch::Apply(&patch),
                        )
                        .await
                        .map(|_| ())
                    } else {
                        let patch = serde_json::json!({ "status": new });
                        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await
                            .map(|_| ())
                    }
                }) as futures::future::BoxFuture<'static, _>
            }
        };
        measure(
            "APPLY targetleases/status (server-side apply, as the controller)",
            &status(7, true),
        )
        .await;
        measure(
            "PATCH targetleases/status (merge patch, same content)",
            &status(8, false),
        )
        .await;
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: "targetlease-bench".into(),
                instance: None,
            },
        );
        let event = {
            let api = api.clone();
            move |name: String| {
                let api = api.clone();
                let recorder = recorder.clone();
                Box::pin(async move {
                    let obj = api.get(&name).await?;
                    let event = Event {
                        type_: EventType::Normal,
                        reason: "Acquired".into(),
                        note: Some(format!("acquired t-{name} with fencing token 7")),
                        action: "Acquired".into(),
                        secondary: None,
                    };
                    recorder.publish(&event, &obj.object_ref(&())).await
                }) as futures::future::BoxFuture<'static, _>
            }
        };
        measure(
            "GET targetlease + POST events (as the controller's Recorder)",
            &event,
        )
        .await;
        self.say(&format!(
            "\n### API server cost per request, no controller ({n} of each, {in_flight} in flight, load {})\n",
            loadavg()
        ));
        self.say("| request | count | failed | requests/s | kube-apiserver CPU ms/request | etcd CPU ms/request |\n|---|---|---|---|---|---|");
        let ok = rows.iter().all(|(_, ok)| *ok);
        for (row, _) in rows {
            self.say(&row);
        }
        self.check("api-costs", ok);
        let _ = api
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
    }

    /// Phase (e): `n` leases at once, until all are Held.
    async fn scale(
        &mut self,
        ns: &str,
        n: usize,
        controller: &ControllerProcess,
    ) -> (serde_json::Value, Phases) {
        let api: Api<TargetLease> = Api::namespaced(self.client.clone(), ns);
        let label = format!("scale-{n}");
        let mut phases = Phases::new(watch_phases(&self.client, ns, &format!("bench={label}")));
        let (leases, names) = own_targets(n, self.ttl, &label);
        let load_before = loadavg();
        let window = Window::start(self, controller).await;
        let sampler = Sampler::start(controller.pid());
        let started = Instant::now();
        let creating = {
            let api = api.clone();
            let in_flight = self.in_flight;
            tokio::spawn(async move { create_all(&api, leases, in_flight).await })
        };
        let all_held = phases.wait_all(&names, Phase::Held, WAIT_LIMIT).await;
        let create_secs = creating.await.expect("create task");
        let held_secs = all_held.map(|t| (t - started).as_secs_f64());
        let (sockets, threads) = sampler.stop().await;
        // Let in-flight Events land before counting requests.
        let burst = window.stop(self, controller, Duration::from_secs(2)).await;
        phases.drain();
        let losses = phases.losses(burst.from, Instant::now());
        let delta = &burst.api;
        let writes = controller_writes(delta);
        let status_writes = burst.counter(STATUS_WRITES);
        let failed_reconciles = burst.counter("targetlease_reconciles_total")
            - (reconciles_ok(&burst.after) - reconciles_ok(&burst.before));
        let hwm = status_kib(controller.pid(), "VmHWM");
        let rss = status_kib(controller.pid(), "VmRSS");
        let finalizer_patches = count(delta, "PATCH", "targetleases");
        let status_patches = count(delta, "APPLY", "targetleases/status")
            + count(delta, "PATCH", "targetleases/status");
        let events = count(delta, "POST", "events") + count(delta, "PATCH", "events");
        let per = n as f64;
        self.say(&format!(
            "\n### {n} TargetLeases applied at once ({} in flight)\n",
            self.in_flight
        ));
        self.say(&format!(
            "- creates done after {create_secs:.1} s; all {n} Held (watch) after {}\n\
             - writes to reach Held, per lease: {:.2} finalizer patches + {:.2} status writes = {:.2} \
             (controller's status_writes_total: {:.2}/lease); Events: {:.2}/lease\n\
             - controller API writes in all (TargetLeases and Events): {writes} = {:.2}/lease; failed reconciles: {failed_reconciles}\n\
             - controller peak RSS (VmHWM) {:.1} MiB, RSS now {:.1} MiB; at most {sockets} sockets and {threads} threads open\n\
             - CPU during the phase: {}\n\
             {}\
             - load average before: {load_before}, after: {}\n",
            held_secs.map_or("NOT all Held".into(), |s| format!("{s:.1} s")),
            finalizer_patches as f64 / per,
            status_patches as f64 / per,
            (finalizer_patches + status_patches) as f64 / per,
            status_writes / per,
            events as f64 / per,
            writes as f64 / per,
            hwm as f64 / 1024.0,
            rss as f64 / 1024.0,
            cpu_line(&burst.cpu),
            burst.lines(&losses),
            loadavg(),
        ));
        self.say(&format!(
            "API server requests during the phase (all clients; the benchmark made the POSTs and a watch):\n\n{}",
            api_table(delta, per, "lease")
        ));
        self.check(&format!("scale-{n}-all-held"), held_secs.is_some());
        let json = serde_json::json!({
            "leases": n,
            "inFlight": self.in_flight,
            "createSeconds": create_secs,
            "allHeldSeconds": held_secs,
            "finalizerPatchesPerLease": finalizer_patches as f64 / per,
            "statusWritesPerLease": status_patches as f64 / per,
            "eventsPerLease": events as f64 / per,
            "controllerWritesPerLease": writes as f64 / per,
            "failedReconciles": failed_reconciles,
            "controllerPeakRssMiB": hwm as f64 / 1024.0,
            "controllerMaxSockets": sockets,
            "cpuSeconds": burst.cpu.iter().map(|(n, s, _)| (n.to_string(), *s)).collect::<BTreeMap<_,_>>(),
            "burst": burst.json(&losses),
            "loadBefore": load_before,
            "loadAfter": loadavg(),
        });
        (json, phases)
    }

    /// Deletes every lease in `ns` and waits until they are gone.
    async fn delete_all(&mut self, ns: &str, n: usize) {
        let api: Api<TargetLease> = Api::namespaced(self.client.clone(), ns);
        let started = Instant::now();
        let deleted = api
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        if let Err(e) = deleted {
            eprintln!("delete collection failed: {e}");
        }
        let deadline = Instant::now() + WAIT_LIMIT;
        let gone = loop {
            let left = api
                .list_metadata(&ListParams::default().limit(1))
                .await
                .map(|l| l.items.len())
                .unwrap_or(1);
            if left == 0 {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let secs = started.elapsed().as_secs_f64();
        self.say(&format!(
            "- deleting all {n} (released in Valkey, finalizers removed): gone after {secs:.1} s (load {})\n",
            loadavg()
        ));
        self.json
            .insert(format!("deleteAll{n}Seconds"), serde_json::json!(secs));
        self.check(&format!("delete-{n}-gone"), gone);
    }

    /// Phase (f): `pairs` hand-overs, one at a time.
    /// `pairs` targets with `permits` each: every permit held, one claim waiting; then one
    /// holder per target deleted after the other, each time measuring until its waiter shows
    /// Held (the freed permit passing to the claim in line).
    async fn handover(&mut self, ns: &str, pairs: usize, label: &str, permits: u32) -> Vec<f64> {
        let api: Api<TargetLease> = Api::namespaced(self.client.clone(), ns);
        let mut phases = Phases::new(watch_phases(&self.client, ns, &format!("bench={label}")));
        // Holder `k` of target `i` is `<label>-h-<i>` for k = 0 (the one deleted), then
        // `<label>-h-<i>-<k>`.
        let holder_name = |i: usize, k: u32| match k {
            0 => format!("{label}-h-{i:04}"),
            k => format!("{label}-h-{i:04}-{k}"),
        };
        let holders: HashSet<String> = (0..pairs)
            .flat_map(|i| (0..permits).map(move |k| (i, k)))
            .map(|(i, k)| holder_name(i, k))
            .collect();
        let waiters: HashSet<String> = (0..pairs).map(|i| format!("{label}-w-{i:04}")).collect();
        let claim = |name: String, i: usize, holder: &str| {
            let mut lease = lease(
                &name,
                &format!("{label}/target-{i:04}"),
                &format!("{holder}-{i:04}"),
                30,
                label,
            );
            lease.spec.permits = permits;
            lease
        };
        let first: Vec<TargetLease> = (0..pairs)
            .flat_map(|i| (0..permits).map(move |k| (i, k)))
            .map(|(i, k)| claim(holder_name(i, k), i, &format!("first{k}")))
            .collect();
        create_all(&api, first, self.in_flight).await;
        let held = phases.wait_all(&holders, Phase::Held, WAIT_LIMIT).await;
        let second: Vec<TargetLease> = (0..pairs)
            .map(|i| claim(format!("{label}-w-{i:04}"), i, "second"))
            .collect();
        create_all(&api, second, self.in_flight).await;
        let waiting = phases.wait_all(&waiters, Phase::Waiting, WAIT_LIMIT).await;
        if held.is_none() || waiting.is_none() {
            self.check(&format!("handover-{label}-setup"), false);
            return Vec::new();
        }
        let floor_statuses = FloorStatuses::new();
        let Some(mut floor) = Floor::new(
            self,
            &format!("floor-{label}"),
            label,
            pairs,
            &floor_statuses,
        )
        .await
        else {
            self.check(&format!("handover-{label}-floor-setup"), false);
            return Vec::new();
        };
        let load_before = loadavg();
        let mut latencies = Vec::with_capacity(pairs);
        let mut steps = Steps::default();
        let mut missed = 0;
        let mut requests = ApiCounts::new();
        let (mut store_calls, mut store_usec) = (0, 0);
        // The controller's hand-overs and the floor's alternate in blocks, so that both meet the
        // same moments of the machine; the API requests and store calls are counted around the
        // controller's blocks only.
        for block in (0..pairs).collect::<Vec<_>>().chunks(FLOOR_BLOCK) {
            let api_before = api_counts(&self.client).await;
            let store_before = evalsha_stats(&mut self.valkey_conn).await;
            for &i in block {
                let holder = format!("{label}-h-{i:04}");
                let waiter = format!("{label}-w-{i:04}");
                let start = Instant::now();
                if let Err(e) = api.delete(&holder, &DeleteParams::default()).await {
                    eprintln!("delete {holder}: {e}");
                    missed += 1;
                    continue;
                }
                let deleted = Instant::now();
                match phases.wait_one(&waiter, Phase::Held, HANDOVER_LIMIT).await {
                    Some(at) => {
                        latencies.push((at - start).as_secs_f64() * 1000.0);
                        phases.drain();
                        steps.record(
                            start,
                            deleted,
                            phases.deleting_seen.get(&holder).copied(),
                            phases.released_seen.get(&holder).copied(),
                            at,
                        );
                    }
                    None => {
                        eprintln!("{waiter} was not Held within {HANDOVER_LIMIT:?}");
                        missed += 1;
                    }
                }
            }
            add_counts(
                &mut requests,
                &api_delta(&api_before, &api_counts(&self.client).await),
            );
            let store_after = evalsha_stats(&mut self.valkey_conn).await;
            store_calls += store_after.0.saturating_sub(store_before.0);
            store_usec += store_after.1.saturating_sub(store_before.1);
            for &i in block {
                floor.hand_over(i, &floor_statuses).await;
            }
        }
        let (floor_lines, floor_json) = floor.report(&latencies);
        self.check(&format!("handover-{label}-floor"), floor.complete());
        let mut sorted: Vec<u64> = latencies.iter().map(|ms| (ms * 1000.0) as u64).collect();
        sorted.sort_unstable();
        let q = |p: f64| quantile(&sorted, p) as f64 / 1000.0;
        let max = sorted.last().copied().unwrap_or(0) as f64 / 1000.0;
        self.say(&format!(
            "- {} hand-overs (holder deleted -> waiter Held, seen by a watch): p50 {:.1} ms, p90 {:.1} ms, \
             p99 {:.1} ms, max {max:.1} ms, min {:.1} ms; missed {missed}; load before {load_before}, after {}\n",
            latencies.len(),
            q(0.5),
            q(0.9),
            q(0.99),
            q(0.0),
            loadavg()
        ));
        let per = latencies.len().max(1) as f64;
        let store_line = if self.etcd.is_some() {
            "  store: etcd, three members (its calls are not counted here)\n".to_owned()
        } else {
            format!(
                "  store: {:.2} script calls per hand-over, {:.0} µs each in Valkey\n",
                store_calls as f64 / per,
                store_usec as f64 / store_calls.max(1) as f64,
            )
        };
        self.say(&format!(
            "  step by step (each hand-over's instants as this benchmark saw them; the waiter's \
             side is the release in the store, the wake, the waiter's acquire and its status \
             write):\n{}{store_line}  API requests during these hand-overs, per hand-over:\n{}\n",
            steps.table(),
            api_table(&requests, per, "hand-over"),
        ));
        self.say(&floor_lines);
        let svg = self.out.join(format!("handover-{label}.svg"));
        let title = format!(
            "TargetLease hand-over latency ({label}): p50 {:.1} ms, p99 {:.1} ms",
            q(0.5),
            q(0.99)
        );
        if let Err(e) = common::svg_histogram(&svg, &title, &latencies) {
            eprintln!("could not write {}: {e}", svg.display());
        }
        self.json.insert(
            format!("handover-{label}"),
            serde_json::json!({
                "count": latencies.len(),
                "missed": missed,
                "p50Ms": q(0.5), "p90Ms": q(0.9), "p99Ms": q(0.99), "maxMs": max,
                "samplesMs": latencies,
                "steps": steps.json(),
                "storeCallsPerHandover": store_calls as f64 / per,
                "storeMicrosPerCall": store_usec as f64 / store_calls.max(1) as f64,
                "loadBefore": load_before,
                "loadAfter": loadavg(),
                "floor": floor_json,
            }),
        );
        self.check(
            &format!("handover-{label}"),
            missed == 0 && latencies.len() == pairs,
        );
        latencies
    }

    /// How many of `names` have a true status now: Held with an `expiresAt` still ahead of the
    /// store's clock. The status is the benchmark's watch's (straight to the API server, not
    /// through the controller's proxy); the clock is Valkey's `TIME`, the clock `expiresAt` is
    /// written in (another host's clock, the API server's included, may differ from it).
    async fn truth(&mut self, phases: &Phases, names: &HashSet<String>) -> Truth {
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut self.valkey_conn)
            .await
            .expect("Valkey TIME");
        let store_now = jiff::Timestamp::from_microsecond(secs * 1_000_000 + micros)
            .expect("Valkey TIME is a timestamp");
        let mut truth = Truth::default();
        for name in names {
            let seen = phases.now.get(name);
            match seen.and_then(|s| s.phase) {
                Some(Phase::Held)
                    if seen
                        .and_then(|s| s.expires_at)
                        .is_some_and(|e| e > store_now) =>
                {
                    truth.held += 1;
                }
                Some(Phase::Held) => truth.stale += 1,
                Some(Phase::Lost) => truth.lost += 1,
                _ => truth.other += 1,
            }
        }
        truth
    }

    /// Follows the watch for `d`, sampling the statuses' truth every second; the sample with
    /// the fewest true statuses (the first is taken at once).
    async fn follow_worst(
        &mut self,
        phases: &mut Phases,
        names: &HashSet<String>,
        d: Duration,
    ) -> Truth {
        let end = Instant::now() + d;
        let mut worst = self.truth(phases, names).await;
        while Instant::now() < end {
            let step = end
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1));
            phases.follow(step).await;
            worst = worst.worse(self.truth(phases, names).await);
        }
        worst
    }

    /// Phase (h): `n` leases held by a controller whose API connection goes through a proxy
    /// that adds `latency` to every chunk in both directions for `seconds`, then forwards at
    /// once again. Reports what was lost, the write rates, the API server's CPU and the
    /// renewal lateness before, during and after, and the time until every status is true
    /// again. Losses are reported, not asserted.
    async fn overload(&mut self, ns: &str, n: usize, latency: Duration, seconds: f64) {
        let proxy = Proxy::start(self.cluster.apiserver_port()).await;
        let via_proxy = self.cluster.kubeconfig_via(proxy.port);
        let controller = self.start_controller(ns, Some(&via_proxy));
        let api: Api<TargetLease> = Api::namespaced(self.client.clone(), ns);
        let label = "overload";
        let mut phases = Phases::new(watch_phases(&self.client, ns, &format!("bench={label}")));
        let (leases, names) = own_targets(n, self.ttl, label);
        let ttl = Duration::from_secs(u64::from(self.ttl));
        self.say(&format!(
            "\n### Overload: {n} held leases (ttlSeconds {}), the controller's API connection \
             {} ms slower each way for {seconds:.0} s\n",
            self.ttl,
            latency.as_millis()
        ));
        create_all(&api, leases, self.in_flight).await;
        if phases
            .wait_all(&names, Phase::Held, WAIT_LIMIT)
            .await
            .is_none()
        {
            self.check("overload-setup", false);
            return;
        }
        // Let the creation's tail (Events, first renewals) pass.
        phases.follow(Duration::from_secs(5)).await;
        let load_before = loadavg();

        let window = Window::start(self, &controller).await;
        let worst_before = self.follow_worst(&mut phases, &names, ttl).await;
        let before = window.stop(self, &controller, Duration::ZERO).await;

        let on = Instant::now();
        proxy.set(Mode::Latency(latency));
        let window = Window::start(self, &controller).await;
        let worst_during = self
            .follow_worst(&mut phases, &names, Duration::from_secs_f64(seconds))
            .await;
        let at_removal = self.truth(&phases, &names).await;
        let during = window.stop(self, &controller, Duration::ZERO).await;

        let removed = Instant::now();
        proxy.set(Mode::Pass);
        let window = Window::start(self, &controller).await;
        let limit = recovery_limit(self.ttl);
        let mut recovered = None;
        let mut worst_after = self.truth(&phases, &names).await;
        while removed.elapsed() < limit {
            phases.follow(Duration::from_millis(250)).await;
            let now = self.truth(&phases, &names).await;
            worst_after = worst_after.worse(now);
            if now.held == n {
                recovered = Some(removed.elapsed());
                break;
            }
        }
        // One TTL more: what the controller does once it caught up.
        let worst_after = worst_after.worse(self.follow_worst(&mut phases, &names, ttl).await);
        let after = window.stop(self, &controller, Duration::ZERO).await;
        phases.drain();

        // Losses are counted in back-to-back spans, so that none falls between two windows.
        let windows = [
            (
                "before (no latency, one TTL)",
                "before",
                &before,
                worst_before,
                before.from,
                on,
            ),
            (
                "during the latency",
                "during",
                &during,
                worst_during,
                on,
                removed,
            ),
            (
                "after (from the removal until every status was true, then one TTL)",
                "after",
                &after,
                worst_after,
                removed,
                Instant::now(),
            ),
        ];
        let mut json = serde_json::json!({
            "leases": n,
            "ttlSeconds": self.ttl,
            "latencyMs": latency.as_millis(),
            "latencySeconds": seconds,
            "atRemoval": at_removal.json(),
            "recoverySeconds": recovered.map(|d| d.as_secs_f64()),
            "loadBefore": load_before,
            "loadAfter": loadavg(),
        });
        for (title, key, measured, worst, from, to) in windows {
            let losses = phases.losses(from, to);
            self.say(&format!(
                "{title}, {:.0} s:\n\n{}- fewest true statuses in a sample (one a second, four a second while recovering): {}\n",
                measured.secs,
                measured.lines(&losses),
                worst.line(n),
            ));
            let mut figures = measured.json(&losses);
            merge(&mut figures, serde_json::json!({ "worst": worst.json() }));
            merge(&mut json, serde_json::json!({ key: figures }));
        }
        self.say(&format!(
            "- at the removal of the latency: {}\n\
             - every status true again (Held, expiresAt ahead of Valkey's clock, seen by the \
             benchmark's own watch) {} after the removal\n\
             - load average before: {load_before}, after: {}\n",
            at_removal.line(n),
            recovered.map_or(format!("NOT within {limit:?}"), |d| format!(
                "{:.1} s",
                d.as_secs_f64()
            )),
            loadavg(),
        ));
        self.json.insert("overload".into(), json);
        self.check("overload-measured", during.api_requests() > 0);
        self.check("overload-recovered", recovered.is_some());
    }

    /// Phase (g): nothing changes for `seconds`; what does the controller still do? `phases`
    /// is the watch of the `n` leases.
    async fn steady(
        &mut self,
        controller: &ControllerProcess,
        phases: &mut Phases,
        n: usize,
        seconds: f64,
    ) {
        let valkey_before = valkey_counts(&mut self.valkey_conn).await;
        let load_before = loadavg();
        let window = Window::start(self, controller).await;
        phases.follow(Duration::from_secs_f64(seconds)).await;
        let steady = window.stop(self, controller, Duration::ZERO).await;
        let valkey_after = valkey_counts(&mut self.valkey_conn).await;
        phases.drain();
        let losses = phases.losses(steady.from, steady.to);
        let wall = steady.secs;
        let writes = controller_writes(&steady.api);
        // The INFO call is one command.
        let commands = valkey_after.0.saturating_sub(valkey_before.0 + 1) as f64;
        let evalsha = valkey_after.1.saturating_sub(valkey_before.1) as f64;
        let held = metric_labeled(&steady.after, "targetlease_leases", "phase=\"Held\"");
        self.say(&format!(
            "\n### Steady state: {n} held leases (ttlSeconds {}), {seconds:.0} s\n\n\
             - controller API writes: {writes} ({:.3}/s)\n\
             {}\
             - Valkey: {:.0} commands/s as counted by total_commands_processed, {:.0} EVALSHA/s \
             (renewals: {n} leases / (ttl/3) = {:.0}/s expected)\n\
             - leases Held per the controller's gauge: {held}\n\
             - CPU: {}\n\
             - load average before: {load_before}, after: {}\n",
            self.ttl,
            writes as f64 / wall,
            steady.lines(&losses),
            commands / wall,
            evalsha / wall,
            n as f64 / (f64::from(self.ttl) / 3.0),
            cpu_line(&steady.cpu),
            loadavg()
        ));
        self.say(&format!(
            "API server requests during the steady state (all clients):\n\n{}",
            api_table(&steady.api, wall, "second")
        ));
        let mut json = serde_json::json!({
            "leases": n,
            "controllerApiWritesPerSec": writes as f64 / wall,
            "allApiWritesPerSec": steady.api_writes() as f64 / wall,
            "valkeyCommandsPerSec": commands / wall,
            "valkeyEvalshaPerSec": evalsha / wall,
            "loadBefore": load_before,
            "loadAfter": loadavg(),
        });
        merge(&mut json, steady.json(&losses));
        self.json.insert("steady".into(), json);
        self.check("steady-measured", evalsha > 0.0);
    }
}

/// How long the overload phase waits for every status to be true again: a bound that only
/// keeps a broken run from hanging.
fn recovery_limit(ttl: u32) -> Duration {
    Duration::from_secs(20 * u64::from(ttl)).max(Duration::from_secs(120))
}

/// The statuses of a set of leases at one instant, against the store's clock.
#[derive(Clone, Copy, Default)]
struct Truth {
    /// Held, `expiresAt` ahead: true.
    held: usize,
    /// Held, `expiresAt` passed (or missing): a status the reader must not trust.
    stale: usize,
    lost: usize,
    /// Any other phase, or not seen yet.
    other: usize,
}

impl Truth {
    /// The sample with fewer true statuses.
    fn worse(self, other: Truth) -> Truth {
        if other.held < self.held { other } else { self }
    }

    fn line(&self, n: usize) -> String {
        format!(
            "{} of {n} true, {} Held with expiresAt passed, {} Lost, {} other",
            self.held, self.stale, self.lost, self.other
        )
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "true": self.held, "stale": self.stale, "lost": self.lost, "other": self.other,
        })
    }
}

/// Adds the fields of object `more` to object `into`.
fn merge(into: &mut serde_json::Value, more: serde_json::Value) {
    if let (Some(into), serde_json::Value::Object(more)) = (into.as_object_mut(), more) {
        into.extend(more);
    }
}

fn reconciles_ok(text: &str) -> f64 {
    metric_labeled(text, "targetlease_reconciles_total", "result=\"ok\"")
}

/// `targetlease_reconciles_total` by result between two scrapes of the controller.
fn reconciles_by_result(before: &str, after: &str) -> BTreeMap<String, f64> {
    let by_result = |page: &str| -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for line in page.lines() {
            let Some(rest) = line.strip_prefix("targetlease_reconciles_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let result = labels_of(labels)
                .get("result")
                .copied()
                .unwrap_or("")
                .to_owned();
            *out.entry(result).or_default() += value.trim().parse::<f64>().unwrap_or(0.0);
        }
        out
    };
    let old = by_result(before);
    by_result(after)
        .into_iter()
        .map(|(result, n)| {
            let d = n - old.get(&result).copied().unwrap_or(0.0);
            (result, d)
        })
        .filter(|(_, d)| *d > 0.0)
        .collect()
}

fn results_line(results: &BTreeMap<String, f64>) -> String {
    if results.is_empty() {
        return "none".into();
    }
    let timeouts = results.get("timeout").copied().unwrap_or(0.0);
    let all: Vec<String> = results.iter().map(|(r, n)| format!("{r} {n:.0}")).collect();
    format!("{} (timeouts: {timeouts:.0})", all.join(", "))
}

const LOST_TRANSITIONS: &str = "targetlease_transitions_total{phase=\"Lost\"}";
const STATUS_WRITES: &str = "targetlease_status_writes_total";
const LATENESS: &str = "targetlease_renewal_lateness_seconds";
const STORE_CALLS: &str = "targetlease_store_call_seconds";

/// A Prometheus histogram's cumulative buckets (upper bound, count; `+Inf` last), summed over
/// every other label.
#[derive(Clone, Debug, Default)]
struct Histogram {
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The histogram `name` in a scrape, only its series with label `only` when given;
    /// `None` when the controller does not export it.
    fn parse(page: &str, name: &str, only: Option<&str>) -> Option<Histogram> {
        let prefix = format!("{name}_bucket{{");
        let mut by_bound: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for line in page.lines() {
            let Some(rest) = line.strip_prefix(&prefix) else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            if only.is_some_and(|label| !labels.contains(label)) {
                continue;
            }
            let Some(le) = labels_of(labels).get("le").copied() else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                let Ok(b) = le.parse::<f64>() else { continue };
                b
            };
            let count = value.trim().parse::<f64>().unwrap_or(0.0);
            // Bounds are keyed by their bits: every positive f64 orders like its bits.
            by_bound.entry(bound.to_bits()).or_insert((bound, 0.0)).1 += count;
        }
        (!by_bound.is_empty()).then(|| Histogram {
            buckets: by_bound.into_values().collect(),
        })
    }

    /// What was observed between an earlier scrape and this one.
    fn since(&self, earlier: Option<&Histogram>) -> Histogram {
        let old = |bound: f64| {
            earlier
                .and_then(|e| e.buckets.iter().find(|(b, _)| *b == bound))
                .map_or(0.0, |(_, c)| *c)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|(b, c)| (*b, c - old(*b)))
                .collect(),
        }
    }

    fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |(_, c)| *c)
    }

    /// How many observations were at most `x`, interpolated linearly inside its bucket as
    /// Prometheus' `histogram_quantile` does; exact when `x` is a bucket bound.
    fn at_most(&self, x: f64) -> f64 {
        let mut lower = (0.0, 0.0);
        for &(bound, count) in &self.buckets {
            if x <= bound {
                if bound.is_infinite() {
                    return lower.1;
                }
                let share = (x - lower.0) / (bound - lower.0);
                return lower.1 + (count - lower.1) * share;
            }
            lower = (bound, count);
        }
        lower.1
    }

    /// The `q` quantile estimated from the buckets; the largest finite bound when it falls in
    /// the `+Inf` bucket (then the text says "above").
    fn quantile(&self, q: f64) -> Option<(f64, bool)> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return Some((lower.0, true));
                }
                let share = (rank - lower.1) / (count - lower.1).max(f64::MIN_POSITIVE);
                return Some((lower.0 + (bound - lower.0) * share, false));
            }
            lower = (bound, count);
        }
        Some((lower.0, true))
    }
}

/// Histogram `name` between two scrapes (only the series labelled `only`, e.g. `op="renew"`,
/// when given): p50 and p99 estimated from the buckets and how many were above 1 s, as text
/// and JSON; `None` when the controller does not export it.
fn histogram_figures(
    before: &str,
    after: &str,
    name: &str,
    only: Option<&str>,
) -> Option<(String, serde_json::Value)> {
    let now = Histogram::parse(after, name, only)?;
    let window = now.since(Histogram::parse(before, name, only).as_ref());
    let count = window.count();
    let above = count - window.at_most(1.0);
    let exact = window.buckets.iter().any(|(b, _)| *b == 1.0);
    let show = |q: f64| match window.quantile(q) {
        None => "-".to_owned(),
        Some((v, true)) => format!("above {:.0} ms", v * 1000.0),
        Some((v, false)) => format!("{:.1} ms", v * 1000.0),
    };
    let text = format!(
        "{count:.0}: p50 {}, p99 {} (estimated from the buckets); {}{above:.0} above 1 s",
        show(0.5),
        show(0.99),
        if exact { "" } else { "about " },
    );
    let value = |q: f64| window.quantile(q).map(|(v, _)| v);
    let json = serde_json::json!({
        "count": count,
        "p50Seconds": value(0.5),
        "p99Seconds": value(0.99),
        "above1s": above,
    });
    Some((text, json))
}

/// Renewal lateness between two scrapes; "n/a" when the controller does not export it.
fn lateness(before: &str, after: &str) -> (String, serde_json::Value) {
    histogram_figures(before, after, LATENESS, None).unwrap_or_else(|| {
        (
            "n/a (the controller exports no renewal lateness)".into(),
            serde_json::Value::Null,
        )
    })
}

/// How long the store took to answer renewals between two scrapes.
fn renew_calls(before: &str, after: &str) -> (String, serde_json::Value) {
    histogram_figures(before, after, STORE_CALLS, Some("op=\"renew\"")).unwrap_or_else(|| {
        (
            "n/a (the controller exports no store call latency)".into(),
            serde_json::Value::Null,
        )
    })
}

fn metric_labeled(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

fn main() {
    let Options {
        small,
        large,
        handovers,
        in_flight,
        ttl,
        steady_ttls,
        phases,
        overload_latency_ms,
        overload_ttls,
        api_ops,
        store,
        common,
    } = Options::parse();
    let overload_latency = Duration::from_millis(common.pick(overload_latency_ms, 3000, 1000));
    let small = common.pick(small, 1000, 10);
    let large = common.pick(large, 10_000, 20);
    let handovers = common.pick(handovers, 200, 3);
    let ttl = common.pick(ttl, 30, 2);
    let api_ops = common.pick(api_ops, 1000, 10);
    let run = |p: &str| phases.iter().any(|x| x == p);
    let out = common.out_dir("controller");
    let binary = env!("CARGO_BIN_EXE_targetlease");

    let started = Instant::now();
    let cluster = Cluster::start();
    cluster.install_crd();
    let cluster = Arc::new(cluster);
    let valkey = Server::start(ServerKind::Valkey91);
    let etcd = (store == "etcd").then(|| {
        let unsupported: Vec<&String> = phases
            .iter()
            .filter(|p| !["small", "handover"].contains(&p.as_str()))
            .collect();
        assert!(
            unsupported.is_empty(),
            "--store etcd runs the small and handover phases only, not {unsupported:?}: give --phases small,handover"
        );
        EtcdCluster::start()
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let checks = runtime.block_on(async {
        let client = cluster.client().await;
        let valkey_conn = redis::Client::open(valkey.url())
            .expect("valkey client")
            .get_multiplexed_async_connection()
            .await
            .expect("valkey connection");
        let mut bench = Bench {
            cluster: cluster.clone(),
            client,
            valkey,
            etcd,
            valkey_conn,
            in_flight,
            ttl,
            out: out.clone(),
            report: String::new(),
            json: serde_json::Map::new(),
            checks: Vec::new(),
        };
        let header = format!(
            "machine: {}\ncontroller: {binary}\ncluster up and CRD installed in {:.1} s; load average {}",
            machine(),
            started.elapsed().as_secs_f64(),
            loadavg()
        );
        bench.say(&format!("```\n{header}\n```"));
        if !binary.contains("/release/") {
            bench.say("**warning: the controller is not a release build** (smoke runs use the test profile)");
        }

        for ns in [
            "bench-api",
            "bench-small",
            "bench-handover",
            "bench-large",
            "bench-overload",
        ] {
            bench.cluster.kubectl_ok(&["create", "namespace", ns]);
        }

        // 0. What one API request of each kind costs the API server, without a controller.
        if run("api") {
            bench.api_costs("bench-api", api_ops).await;
        }

        // 1. Scale, small N, then delete them all.
        if run("small") {
            let controller = bench.start_controller("bench-small", None);
            let (scaled, _) = bench.scale("bench-small", small, &controller).await;
            bench.json.insert(format!("scale{small}"), scaled);
            bench.delete_all("bench-small", small).await;
        }

        // 2. Hand-over on an idle controller.
        if run("handover") {
            let _controller = bench.start_controller("bench-handover", None);
            bench.say("\n### Hand-over, idle controller\n");
            bench.handover("bench-handover", handovers, "idle", 1).await;
            bench.delete_all("bench-handover", handovers * 2).await;
            // The same with permits: three holders per target, the freed permit passing on.
            bench.say("\n### Hand-over of a permit (permits 3), idle controller\n");
            bench
                .handover("bench-handover", handovers, "permits-3", 3)
                .await;
            bench.delete_all("bench-handover", handovers * 4).await;
        }

        // 3. Scale, large N; steady state; hand-over with all of them held.
        if run("large") {
            let controller = bench.start_controller("bench-large", None);
            let (scaled, mut phases) = bench.scale("bench-large", large, &controller).await;
            bench.json.insert(format!("scale{large}"), scaled);
            // Let the creation's tail (Events, first renewals) pass.
            phases.follow(Duration::from_secs(5)).await;
            bench
                .steady(&controller, &mut phases, large, steady_ttls * f64::from(ttl))
                .await;
            bench.say(&format!(
                "\n### Hand-over with {large} leases held and renewed by the same controller\n"
            ));
            let handovers_from = Instant::now();
            bench.handover("bench-large", handovers, "loaded", 1).await;
            phases.drain();
            let in_handovers = phases.losses(handovers_from, Instant::now());
            let losses = phases.losses(started, Instant::now());
            let hwm = status_kib(controller.pid(), "VmHWM");
            bench.say(&format!(
                "- controller peak RSS (VmHWM) at the end: {:.1} MiB\n\
                 - the {large} leases, seen by the watch, during the hand-overs (the controller's and their floor's): {}\n\
                 - the {large} leases, seen by the watch, over the whole phase (burst, steady \
                 state, hand-overs and the pauses between): {}\n",
                hwm as f64 / 1024.0,
                in_handovers.line(),
                losses.line()
            ));
            bench
                .json
                .insert("finalPeakRssMiB".into(), serde_json::json!(hwm as f64 / 1024.0));
            bench.json.insert(
                "largeLosses".into(),
                serde_json::json!({"handovers": in_handovers.json(), "phase": losses.json()}),
            );
        }

        // 4. The large N held while the controller's API connection is slow.
        if run("overload") {
            bench
                .overload(
                    "bench-overload",
                    large,
                    overload_latency,
                    overload_ttls * f64::from(ttl),
                )
                .await;
        }

        bench.say(&format!(
            "\nwhole benchmark: {:.0} s; load average at the end {}",
            started.elapsed().as_secs_f64(),
            loadavg()
        ));
        std::fs::write(out.join("controller.md"), &bench.report).expect("write controller.md");
        std::fs::write(
            out.join("controller.json"),
            serde_json::Value::Object(bench.json.clone()).to_string(),
        )
        .expect("write controller.json");
        println!("results: {}", out.display());
        bench.checks.clone()
    });
    drop(runtime);
    drop(cluster);
    let failed = checks.iter().filter(|(_, ok)| !ok).count();
    println!("bench: {} passed, {failed} failed", checks.len() - failed);
    if failed > 0 || checks.is_empty() {
        std::process::exit(1);
    }
}
