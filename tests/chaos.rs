//! Chaos: two controller replicas, a real control plane and a real Valkey (behind a TCP proxy),
//! TargetLeases created and deleted at random, holders writing to a fenced store, and faults
//! injected at random: controller SIGKILL, leader change, Valkey SIGKILL with and without its
//! data, connection cuts and stalls, API server crash, the leader partitioned from the API
//! server (a proxy per replica holds its bytes), the leader Lease deleted, a failover to a
//! replica that missed the newest writes, and `targetlease run` holders partitioned from the
//! API server. An independent checker, sharing no code with the controller's decision logic,
//! watches every status, owns the fenced store, and reads the timestamps the `run` holders'
//! commands write while they run: two commands on one target must never run at the same time.
//!
//! `TARGETLEASE_CHAOS_SECONDS` sets the length of the fault phase (default 150 s).

use targetlease_test_support as support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use libtest_mimic::Arguments;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use targetlease::api::{Phase, TargetLease};
use tokio::process::{Child, Command};

use support::kube::{Cluster, ControllerProcess};
use support::proxy::{Mode, Proxy};
use support::server::{Server, ServerKind};
use support::suite;

const NS: &str = "chaos";
const TARGETS: usize = 6;
const PER_TARGET: usize = 3;
// The shortest TTL the replicas below can keep: 1.5 x (take-over 3.75 s + call timeout 1 s +
// 1 s to start), rounded up (docs/controller.md).
const TTL_SECONDS: u64 = 9;

/// What the checker has seen of one target.
#[derive(Default)]
struct TargetView {
    /// The largest token any status has shown as Held.
    max_token: u64,
    /// Every (resource uid, token) pair shown as Held.
    seen: HashSet<(String, u64)>,
}

/// The independent checker: the statuses it saw, the fenced store it owns, the violations.
#[derive(Default)]
struct Checker {
    targets: Mutex<HashMap<String, TargetView>>,
    /// Resources whose latest status says Held: uid -> (target, token).
    holding: Mutex<HashMap<String, (String, u64)>>,
    /// The fenced store: per target, the highest token it accepted a write with.
    fenced: Mutex<HashMap<String, u64>>,
    violations: Mutex<Vec<String>>,
    accepted: AtomicU64,
    refused: AtomicU64,
    held_events: AtomicU64,
}

impl Checker {
    fn violation(&self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.lock().unwrap().push(what);
    }

    /// Invariant 1: per target, a newly shown Held token is larger than every token shown before,
    /// so no two resources ever show the same token.
    fn observe(&self, lease: &TargetLease) -> Option<(String, (String, u64))> {
        let uid = lease.uid()?;
        let status = lease.status.as_ref()?;
        if status.phase != Phase::Held {
            return None;
        }
        let token = status.fencing_token?;
        let target = lease.spec.target.clone();
        let mut targets = self.targets.lock().unwrap();
        let view = targets.entry(target.clone()).or_default();
        if view.seen.insert((uid.clone(), token)) {
            self.held_events.fetch_add(1, Ordering::Relaxed);
            if token <= view.max_token {
                self.violation(format!(
                    "{target}: {} shows Held with token {token}, not above {} shown before",
                    lease.name_any(),
                    view.max_token
                ));
            }
            view.max_token = view.max_token.max(token);
        }
        Some((uid, (target, token)))
    }

    /// Invariant 2: the fenced store accepts a write only with a token >= the highest it accepted;
    /// a holder whose token is the newest shown for its target is never refused.
    fn commit(&self, target: &str, token: u64) {
        let newest = self
            .targets
            .lock()
            .unwrap()
            .get(target)
            .map_or(0, |v| v.max_token);
        let mut fenced = self.fenced.lock().unwrap();
        let highest = fenced.entry(target.to_owned()).or_default();
        if token >= *highest {
            *highest = token;
            self.accepted.fetch_add(1, Ordering::Relaxed);
        } else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            if token == newest {
                self.violation(format!(
                    "{target}: the newest holder (token {token}) was refused; the store accepted {highest}"
                ));
            }
        }
    }

    /// Follows every TargetLease status (re-listing after API server restarts).
    async fn watch(self: Arc<Self>, api: Api<TargetLease>) {
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut relist: Option<HashMap<String, (String, u64)>> = None;
        while let Some(event) = stream.next().await {
            let Ok(event) = event else { continue };
            match event {
                watcher::Event::Init => relist = Some(HashMap::new()),
                watcher::Event::InitApply(lease) => {
                    if let (Some(buffer), Some((uid, held))) =
                        (relist.as_mut(), self.observe(&lease))
                    {
                        buffer.insert(uid, held);
                    }
                }
                watcher::Event::InitDone => {
                    if let Some(buffer) = relist.take() {
                        *self.holding.lock().unwrap() = buffer;
                    }
                }
                watcher::Event::Apply(lease) => {
                    let uid = lease.uid().unwrap_or_default();
                    match self.observe(&lease) {
                        Some((uid, held)) => {
                            self.holding.lock().unwrap().insert(uid, held);
                        }
                        None => {
                            self.holding.lock().unwrap().remove(&uid);
                        }
                    }
                }
                watcher::Event::Delete(lease) => {
                    self.holding
                        .lock()
                        .unwrap()
                        .remove(&lease.uid().unwrap_or_default());
                }
            }
        }
    }

    /// Invariant 3: no two resources on one target show Held for longer than
    /// [`DOUBLE_HELD_LIMIT`] (a grant wakes every other claim on its target, so one that still
    /// shows Held learns within one reconcile that it lost). Sampled every 50 ms.
    async fn double_held(self: Arc<Self>, until: Instant) {
        let mut since: HashMap<String, Instant> = HashMap::new();
        let mut reported: HashSet<String> = HashSet::new();
        while Instant::now() < until {
            let mut per_target: HashMap<String, Vec<u64>> = HashMap::new();
            for (target, token) in self.holding.lock().unwrap().values() {
                per_target.entry(target.clone()).or_default().push(*token);
            }
            let now = Instant::now();
            since.retain(|target, _| per_target.get(target).is_some_and(|t| t.len() > 1));
            for (target, tokens) in per_target.iter().filter(|(_, t)| t.len() > 1) {
                let first = *since.entry(target.clone()).or_insert(now);
                if now - first > DOUBLE_HELD_LIMIT && reported.insert(target.clone()) {
                    self.violation(format!(
                        "{target}: {} resources show Held (tokens {tokens:?}) for more than {DOUBLE_HELD_LIMIT:?}",
                        tokens.len()
                    ));
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Holders: every resource whose status says Held writes every 100 ms with its token.
    async fn holders(self: Arc<Self>, until: Instant) {
        while Instant::now() < until {
            let holding: Vec<(String, u64)> =
                self.holding.lock().unwrap().values().cloned().collect();
            for (target, token) in holding {
                self.commit(&target, token);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    ControllerKill,
    LeaderChange,
    ValkeyRestartWithData,
    ValkeyRestartDataLost,
    ConnectionCut,
    ConnectionStall,
    ApiServerCrash,
    LeaderPartition,
    LeaderLeaseDeleted,
    ValkeyFailoverToLaggingReplica,
    RunPartition,
}

const FAULTS: [Fault; 11] = [
    Fault::ControllerKill,
    Fault::LeaderChange,
    Fault::ValkeyRestartWithData,
    Fault::ValkeyRestartDataLost,
    Fault::ConnectionCut,
    Fault::ConnectionStall,
    Fault::ApiServerCrash,
    Fault::LeaderPartition,
    Fault::LeaderLeaseDeleted,
    Fault::ValkeyFailoverToLaggingReplica,
    Fault::RunPartition,
];

/// The `run` holders alive now: their serial number and their proxy to the API server.
type RunSlots = Arc<Mutex<Vec<(u64, Arc<Proxy>)>>>;

/// Targets held by `targetlease run` processes, two at a time on each.
const RUN_TARGETS: usize = 2;
const RUNS_PER_TARGET: usize = 2;

struct World {
    cluster: Arc<Cluster>,
    client: Client,
    valkey: Server,
    /// A replica of `valkey` with its own AOF: promoted, after being detached while `valkey`
    /// keeps granting, by the failover fault.
    standby: Server,
    proxy: Proxy,
    /// The `run` holders alive now, each with the proxy between it and the API server.
    runs: RunSlots,
    /// When each fault that loses Valkey data happened.
    data_lost: Arc<Mutex<Vec<Instant>>>,
    /// One proxy per replica between it and the API server: a partition holds its bytes.
    api_proxies: Vec<Proxy>,
    replicas: Vec<Option<ControllerProcess>>,
}

impl World {
    fn api(&self) -> Api<TargetLease> {
        Api::namespaced(self.client.clone(), NS)
    }

    fn replica(&self, i: usize) -> ControllerProcess {
        let url = format!("redis://127.0.0.1:{}", self.proxy.port);
        let name = format!("replica-{i}");
        let kubeconfig = self.cluster.kubeconfig_via(self.api_proxies[i].port);
        ControllerProcess::start_as(
            &self.cluster,
            &kubeconfig,
            &url,
            &[
                "--watch-namespace",
                NS,
                "--leader-election",
                "--leader-election-namespace",
                NS,
                "--leader-election-seconds",
                "3",
                "--identity",
                &name,
                "--valkey-timeout",
                "1s",
            ],
        )
    }

    async fn leader(&self) -> Option<usize> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), NS);
        let lease = leases.get_opt("targetlease-controller").await.ok()??;
        let holder = lease.spec?.holder_identity?;
        holder.strip_prefix("replica-")?.parse().ok()
    }

    async fn inject(&mut self, fault: Fault, rng: &mut impl Rng) {
        match fault {
            Fault::ControllerKill => {
                let i = rng.random_range(0..self.replicas.len());
                if let Some(mut p) = self.replicas[i].take() {
                    p.kill();
                }
                tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
                self.replicas[i] = Some(self.replica(i));
            }
            Fault::LeaderChange => {
                let i = self
                    .leader()
                    .await
                    .unwrap_or(0)
                    .min(self.replicas.len() - 1);
                if let Some(mut p) = self.replicas[i].take() {
                    p.terminate();
                }
                tokio::time::sleep(Duration::from_millis(1000)).await;
                self.replicas[i] = Some(self.replica(i));
            }
            Fault::ValkeyRestartWithData => {
                self.valkey.kill();
                self.valkey.restart();
            }
            Fault::ValkeyRestartDataLost => {
                self.data_lost.lock().unwrap().push(Instant::now());
                self.valkey.kill();
                for entry in std::fs::read_dir(self.valkey.dir())
                    .expect("valkey dir")
                    .flatten()
                {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if name.starts_with("appendonly") || name.ends_with(".rdb") {
                        let path = entry.path();
                        let _ =
                            std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
                    }
                }
                self.valkey.restart();
            }
            Fault::ConnectionCut => self.proxy.cut(),
            Fault::ConnectionStall => {
                self.proxy.set(Mode::Stall);
                tokio::time::sleep(Duration::from_millis(rng.random_range(1000..3000))).await;
                self.proxy.set(Mode::Pass);
            }
            Fault::ApiServerCrash => self.cluster.restart("kube-apiserver", true),
            Fault::LeaderLeaseDeleted => {
                let leases: Api<Lease> = Api::namespaced(self.client.clone(), NS);
                let _ = leases
                    .delete("targetlease-controller", &DeleteParams::default())
                    .await;
            }
            Fault::ValkeyFailoverToLaggingReplica => {
                // The standby has every write; detached, it misses what the primary grants
                // from now on, until the primary dies and every client is sent to it.
                if !self
                    .standby
                    .wait_in_sync_with(&self.valkey, Duration::from_secs(10))
                {
                    eprintln!("    the standby did not catch up: failover skipped");
                    return;
                }
                self.standby.promote();
                self.data_lost.lock().unwrap().push(Instant::now());
                tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
                self.valkey.kill();
                self.proxy.retarget(self.standby.port);
                self.proxy.cut();
                let fresh = durable_valkey(Some(&self.standby));
                self.valkey = std::mem::replace(&mut self.standby, fresh);
            }
            Fault::RunPartition => {
                // One `run` loses the API server (its node is partitioned) for longer than it
                // may trust its lease, while the `run` waiting behind it does not: the first must
                // stop its command before the controller gives the target to the second.
                let slots: Vec<Arc<Proxy>> = self
                    .runs
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(_, p)| p.clone())
                    .collect();
                let Some(proxy) = slots.choose(rng).cloned() else {
                    return;
                };
                proxy.set(Mode::Stall);
                tokio::time::sleep(Duration::from_millis(rng.random_range(4000..8000))).await;
                proxy.set(Mode::Pass);
            }
            Fault::LeaderPartition => {
                // The leader loses the API server (its requests hang), not Valkey; longer than
                // the election's 3 s, so the other replica takes over while it is cut off.
                let i = self
                    .leader()
                    .await
                    .unwrap_or(0)
                    .min(self.replicas.len() - 1);
                self.api_proxies[i].set(Mode::Stall);
                tokio::time::sleep(Duration::from_millis(rng.random_range(4000..8000))).await;
                self.api_proxies[i].set(Mode::Pass);
            }
        }
    }
}

/// A Valkey 9.1 that fsyncs its AOF on every write; a replica of `primary` when given.
fn durable_valkey(primary: Option<&Server>) -> Server {
    let port = primary.map(|p| p.port.to_string());
    let mut args = vec!["--appendonly", "yes", "--appendfsync", "always"];
    if let Some(port) = &port {
        args.extend(["--replicaof", "127.0.0.1", port]);
    }
    Server::start_with(ServerKind::Valkey91, &args)
}

/// Targets that have live resources but no resource whose status says Held.
async fn targets_without_holder(api: &Api<TargetLease>) -> Option<Vec<String>> {
    let list = api.list(&ListParams::default()).await.ok()?;
    let mut by_target: BTreeMap<String, bool> = BTreeMap::new();
    for lease in list
        .items
        .iter()
        .filter(|l| l.metadata.deletion_timestamp.is_none() && !l.spec.release)
    {
        let held = lease
            .status
            .as_ref()
            .is_some_and(|s| s.phase == Phase::Held);
        *by_target.entry(lease.spec.target.clone()).or_default() |= held;
    }
    Some(
        by_target
            .into_iter()
            .filter(|(_, held)| !held)
            .map(|(t, _)| t)
            .collect(),
    )
}

async fn recovery_time(api: &Api<TargetLease>, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if targets_without_holder(api)
            .await
            .is_some_and(|missing| missing.is_empty())
        {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

/// Creates and deletes TargetLeases at random until `until`.
async fn workload(api: Api<TargetLease>, until: Instant, ops: Arc<AtomicU64>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut serial = 0u64;
    while Instant::now() < until {
        let target = format!("target-{}", rng.random_range(0..TARGETS));
        let Ok(list) = api.list(&ListParams::default()).await else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        let on_target: Vec<&TargetLease> = list
            .items
            .iter()
            .filter(|l| l.spec.target == target && l.metadata.deletion_timestamp.is_none())
            .collect();
        if on_target.len() < PER_TARGET && rng.random_bool(0.6) {
            serial += 1;
            let name = format!("{target}-{serial}");
            let lease = TargetLease::new(
                &name,
                targetlease::api::TargetLeaseSpec {
                    target: target.clone(),
                    holder: format!("holder-{serial}"),
                    holder_ref: None,
                    ttl_seconds: TTL_SECONDS as u32,
                    permits: 1,
                    max_hold_seconds: None,
                    release: false,
                    priority: None,
                },
            );
            if api.create(&PostParams::default(), &lease).await.is_ok() {
                ops.fetch_add(1, Ordering::Relaxed);
            }
        } else if let Some(victim) = on_target.choose(&mut rng)
            && api
                .delete(&victim.name_any(), &DeleteParams::default())
                .await
                .is_ok()
        {
            ops.fetch_add(1, Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..700))).await;
    }
}

/// The `targetlease run` holders: on each run target, up to two `run`s at a time (each through a
/// proxy of its own to the API server, listed in `slots`), each running a command that appends
/// its token once and then the time in nanoseconds every 50 ms for 2 to 10 s (longer than the
/// controller's heartbeat bound, so a cut-off holder's command outlives it unless `run` stops
/// it), to a file of its own in `dir`.
async fn run_holders(
    cluster: Arc<Cluster>,
    slots: RunSlots,
    dir: std::path::PathBuf,
    until: Instant,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7275);
    let mut running: Vec<(usize, u64, Child)> = Vec::new();
    let mut serial = 0u64;
    let alive = |running: &mut Vec<(usize, u64, Child)>| {
        running.retain_mut(|(_, _, child)| matches!(child.try_wait(), Ok(None)));
        let live: HashSet<u64> = running.iter().map(|(_, n, _)| *n).collect();
        slots.lock().unwrap().retain(|(n, _)| live.contains(n));
    };
    while Instant::now() < until {
        alive(&mut running);
        for target in 0..RUN_TARGETS {
            if running.iter().filter(|(t, _, _)| *t == target).count() >= RUNS_PER_TARGET {
                continue;
            }
            serial += 1;
            let proxy = Arc::new(Proxy::start(cluster.apiserver_port()).await);
            let kubeconfig = cluster.kubeconfig_via(proxy.port);
            let file = dir.join(format!("run-{target}-{serial}.log"));
            let ticks = rng.random_range(40..200);
            let script = format!(
                "echo \"token $TARGETLEASE_TOKEN\" >> {f}; n=0; while [ $n -lt {ticks} ]; do date +%s%N >> {f}; sleep 0.05; n=$((n+1)); done",
                f = file.display()
            );
            // Each `run` in a UTS namespace of its own, named like a pod of its own: one host
            // runs one `run` per target (the TargetLease is named after the host).
            let child = Command::new("unshare")
                .args(["--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\""])
                .arg(format!("runner-{serial}"))
                .arg(support::kube::targetlease_bin())
                .args(["run", "-n", NS, "--target", &format!("run-{target}")])
                .args([
                    "--holder",
                    &format!("runner-{serial}"),
                    "--ttl",
                    &format!("{TTL_SECONDS}s"),
                ])
                .args([
                    "--grace",
                    "1s",
                    "--wait-timeout",
                    "120s",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ])
                .envs(cluster.envs())
                .env("KUBECONFIG", &kubeconfig)
                .env("TARGETLEASE_LOG", "warn")
                .env_remove("POD_NAME")
                .env_remove("POD_UID")
                .env_remove("POD_NAMESPACE")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn();
            match child {
                Ok(child) => {
                    running.push((target, serial, child));
                    slots.lock().unwrap().push((serial, proxy));
                }
                Err(e) => eprintln!("    run could not start: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
    }
    // Let the last commands end under their leases, then stop what is left.
    let deadline = Instant::now() + Duration::from_secs(TTL_SECONDS + 20);
    while Instant::now() < deadline && !running.is_empty() {
        alive(&mut running);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (_, _, child) in running.iter_mut() {
        let _ = child.start_kill();
    }
}

/// One `run` holder's command, as its file tells: the token it ran with, and the first and
/// last moments it was seen running (nanoseconds since the epoch).
struct Ran {
    file: String,
    token: u64,
    first: u128,
    last: u128,
}

/// Reads every command's file in `dir`, per run target, in the order the commands started.
fn commands_ran(dir: &std::path::Path) -> BTreeMap<usize, Vec<Ran>> {
    let mut by_target: BTreeMap<usize, Vec<Ran>> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("run folder").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(target) = name
            .strip_prefix("run-")
            .and_then(|r| r.split('-').next())
            .and_then(|t| t.parse().ok())
        else {
            continue;
        };
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        let token = text
            .lines()
            .find_map(|l| l.strip_prefix("token "))
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        let times: Vec<u128> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if let (Some(&first), Some(&last)) = (times.iter().min(), times.iter().max()) {
            by_target.entry(target).or_default().push(Ran {
                file: name,
                token,
                first,
                last,
            });
        }
    }
    for ran in by_target.values_mut() {
        ran.sort_by_key(|r| r.first);
    }
    by_target
}

/// Invariant 4: on one target, a command starts only after every command that started before
/// it was last seen running, and with a larger token. The bound is zero: both times come from
/// the commands themselves on one clock, and a stopped command writes nothing, so any measured
/// overlap is a real one. After a fault that lost Valkey data (the new holder's grant cannot
/// see the old lease), the old holder runs on until its next renewal finds the lease gone:
/// such an overlap is allowed up to [`DATA_LOSS_OVERLAP`], with a larger token.
fn check_commands(
    checker: &Checker,
    dir: &std::path::Path,
    data_lost: &[std::time::SystemTime],
) -> usize {
    let mut count = 0;
    for (target, ran) in commands_ran(dir) {
        count += ran.len();
        for (i, later) in ran.iter().enumerate() {
            for earlier in &ran[..i] {
                if later.token <= earlier.token {
                    checker.violation(format!(
                        "run-{target}: {} ran with token {}, not above {} of {} before it",
                        later.file, later.token, earlier.token, earlier.file
                    ));
                }
                if later.first > earlier.last {
                    continue;
                }
                let overlap = Duration::from_nanos((earlier.last - later.first) as u64);
                let at = std::time::UNIX_EPOCH + Duration::from_nanos(later.first as u64);
                let after_loss = data_lost.iter().any(|lost| {
                    *lost <= at
                        && at.duration_since(*lost).unwrap_or_default()
                            < Duration::from_secs(2 * TTL_SECONDS)
                });
                if !(after_loss && overlap <= DATA_LOSS_OVERLAP) {
                    checker.violation(format!(
                        "run-{target}: {} (token {}) started while {} (token {}) ran: {overlap:?} together{}",
                        later.file,
                        later.token,
                        earlier.file,
                        earlier.token,
                        if after_loss { " after a data loss" } else { "" }
                    ));
                }
            }
        }
    }
    count
}

/// How long an old holder's command may run beside the next one after Valkey lost the old
/// lease: until the controller's next renewal finds it gone (a third of the TTL), the call's
/// deadline (1 s), the status write and `run`'s watch seeing it (1 s), and the command's SIGTERM.
const DATA_LOSS_OVERLAP: Duration = Duration::from_secs(TTL_SECONDS / 3 + 3);

/// Length of the fault phase: `TARGETLEASE_CHAOS_SECONDS`, 150 s by default.
/// How long two resources on one target may both show Held: the new holder's grant wakes the
/// old one, whose renewal finds it lost; a few reconciles under load.
const DOUBLE_HELD_LIMIT: Duration = Duration::from_secs(3);

fn fault_seconds() -> u64 {
    std::env::var("TARGETLEASE_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150)
}

async fn chaos(cluster: Arc<Cluster>) {
    let seconds = fault_seconds();
    cluster.kubectl_ok(&["create", "namespace", NS]);
    let client = cluster.client().await;
    let valkey = durable_valkey(None);
    let standby = durable_valkey(Some(&valkey));
    let proxy = Proxy::start(valkey.port).await;
    let runs_dir = tempfile::tempdir().expect("run folder");
    let api_proxies = vec![
        Proxy::start(cluster.apiserver_port()).await,
        Proxy::start(cluster.apiserver_port()).await,
    ];
    let mut world = World {
        cluster: cluster.clone(),
        client: client.clone(),
        valkey,
        standby,
        proxy,
        runs: RunSlots::default(),
        data_lost: Arc::new(Mutex::new(Vec::new())),
        api_proxies,
        replicas: Vec::new(),
    };
    world.replicas = vec![Some(world.replica(0)), Some(world.replica(1))];
    let api = world.api();

    let checker = Arc::new(Checker::default());
    let fault_phase_end = Instant::now() + Duration::from_secs(seconds);
    tokio::spawn(checker.clone().watch(api.clone()));
    let holders_end = fault_phase_end + Duration::from_secs(TTL_SECONDS + 20);
    tokio::spawn(checker.clone().holders(holders_end));
    tokio::spawn(checker.clone().double_held(holders_end));
    let ops = Arc::new(AtomicU64::new(0));
    let seed: u64 = std::env::var("TARGETLEASE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!("chaos seed {seed} (TARGETLEASE_CHAOS_SEED={seed} repeats the same choices)");
    let load = tokio::spawn(workload(api.clone(), fault_phase_end, ops.clone(), seed));
    let runs = tokio::spawn(run_holders(
        cluster.clone(),
        world.runs.clone(),
        runs_dir.path().to_owned(),
        fault_phase_end,
        seed,
    ));

    // `TARGETLEASE_CHAOS_FAULTS=RunPartition,LeaderLeaseDeleted` injects only those.
    let faults: Vec<Fault> = match std::env::var("TARGETLEASE_CHAOS_FAULTS") {
        Ok(names) => FAULTS
            .into_iter()
            .filter(|f| names.split(',').any(|n| n.trim() == format!("{f:?}")))
            .collect(),
        Err(_) => FAULTS.to_vec(),
    };
    assert!(
        !faults.is_empty(),
        "TARGETLEASE_CHAOS_FAULTS names no fault"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut injected: BTreeMap<Fault, u32> = BTreeMap::new();
    let mut longest_recovery = Duration::ZERO;
    let mut unrecovered = Vec::new();
    tokio::time::sleep(Duration::from_secs(5)).await;
    while Instant::now() + Duration::from_secs(20) < fault_phase_end {
        let fault = *faults.choose(&mut rng).expect("faults");
        eprintln!(
            "[{:>5.1}s] fault: {fault:?}",
            (Instant::now() + Duration::from_secs(seconds) - fault_phase_end).as_secs_f64()
        );
        world.inject(fault, &mut rng).await;
        *injected.entry(fault).or_default() += 1;
        match recovery_time(&api, Duration::from_secs(TTL_SECONDS + 25)).await {
            Some(took) => longest_recovery = longest_recovery.max(took),
            None => unrecovered.push(fault),
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(2000..5000))).await;
    }
    let _ = load.await;
    let _ = runs.await;

    // Faults and churn have stopped: within TTL + 10 s every target with waiters has a holder and
    // no lease is left in Valkey for a deleted resource.
    let settle = Instant::now();
    let limit = Duration::from_secs(TTL_SECONDS + 10);
    let (missing, leaked) = loop {
        let missing = targets_without_holder(&api)
            .await
            .unwrap_or_else(|| vec!["(list failed)".into()]);
        let leaked = leaked_leases(&world, &api).await;
        if (missing.is_empty() && leaked.is_empty()) || settle.elapsed() > limit {
            break (missing, leaked);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    for t in &missing {
        checker.violation(format!(
            "{t}: has waiters but no holder {limit:?} after the faults stopped"
        ));
    }
    for l in &leaked {
        checker.violation(format!("lease left in Valkey for a deleted resource: {l}"));
    }
    for fault in &unrecovered {
        checker.violation(format!(
            "no recovery within {}s after {fault:?}",
            TTL_SECONDS + 25
        ));
    }

    // Wall-clock times of the data losses, to compare with the commands' own timestamps.
    let lost_at: Vec<std::time::SystemTime> = {
        let (now, wall) = (Instant::now(), std::time::SystemTime::now());
        world
            .data_lost
            .lock()
            .unwrap()
            .iter()
            .map(|at| wall - (now - *at))
            .collect()
    };
    let commands = check_commands(&checker, runs_dir.path(), &lost_at);

    let violations = checker.violations.lock().unwrap().clone();
    println!(
        "chaos summary ({seconds} s of faults, 2 controller replicas, {TARGETS} targets, ttl {TTL_SECONDS} s):"
    );
    for (fault, n) in &injected {
        println!("  faults injected: {fault:?} x{n}");
    }
    println!(
        "  operations (creates + deletes): {}",
        ops.load(Ordering::Relaxed)
    );
    println!(
        "  Held transitions seen: {}",
        checker.held_events.load(Ordering::Relaxed)
    );
    println!(
        "  commits accepted: {}, refused: {}",
        checker.accepted.load(Ordering::Relaxed),
        checker.refused.load(Ordering::Relaxed)
    );
    println!("  run holders' commands: {commands}");
    println!("  longest recovery after a fault: {longest_recovery:?}");
    println!("  settled after the faults in {:?}", settle.elapsed());
    println!("  violations: {}", violations.len());
    assert!(!injected.is_empty(), "no fault was injected");
    assert!(
        checker.accepted.load(Ordering::Relaxed) > 0,
        "no holder ever committed: the run proves nothing"
    );
    assert!(
        commands >= 4,
        "only {commands} run holders' commands ran: the run proves nothing"
    );
    assert!(
        violations.is_empty(),
        "violations:\n{}",
        violations.join("\n")
    );
}

/// Leases in Valkey whose lease id is not the uid of a live TargetLease.
async fn leaked_leases(world: &World, api: &Api<TargetLease>) -> Vec<String> {
    let Ok(list) = api.list(&ListParams::default()).await else {
        return vec!["(list failed)".into()];
    };
    let live: HashSet<String> = list.items.iter().filter_map(|l| l.uid()).collect();
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{}", world.valkey.port)) else {
        return vec!["(valkey unreachable)".into()];
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return vec!["(valkey unreachable)".into()];
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("tl:{{{NS}/*}}:lease"))
        .query_async(&mut conn)
        .await
        .unwrap_or_default();
    let mut leaked = Vec::new();
    for key in keys {
        let id: Option<String> = redis::cmd("HGET")
            .arg(&key)
            .arg("lease_id")
            .query_async(&mut conn)
            .await
            .unwrap_or(None);
        if id.is_some_and(|id| !live.contains(&id)) {
            leaked.push(key);
        }
    }
    leaked
}

fn main() {
    let args = Arguments::from_args();
    let cluster = Arc::new({
        let cluster = Cluster::start();
        cluster.install_crd();
        cluster
    });
    let seconds = fault_seconds();
    let limit = Duration::from_secs(seconds + 300);
    let trial = {
        let cluster = cluster.clone();
        suite::trial_with_limit("chaos_with_independent_checker", limit, move || {
            chaos(cluster)
        })
    };
    let conclusion = libtest_mimic::run(&args, vec![trial]);
    drop(cluster);
    suite::finish("chaos", conclusion);
}
