//! Chaos: two controller replicas, a real control plane and a real Valkey, TargetLeases created
//! and deleted at random on exclusive targets and on targets with permits 2 and 3, holders
//! writing to a fenced store, and faults injected at random, in two trials.
//!
//! `chaos_with_independent_checker` reaches one Valkey behind a TCP proxy. Its faults:
//! controller SIGKILL, leader change, Valkey SIGKILL with and without its data, connection cuts
//! and stalls, API server crash, the leader partitioned from the API server (a proxy per replica
//! holds its bytes), the leader Lease deleted, a failover to a replica that missed the newest
//! writes, and `targetlease run` holders partitioned from the API server.
//!
//! `chaos_through_sentinel` reaches a Sentinel topology (one primary, two replicas, three
//! sentinels) through `--valkey-sentinels` alone. Its faults: a planned failover (`SENTINEL
//! FAILOVER`), a SIGKILL of the current primary (started again as a replica of the new one), and
//! those of the first trial that do not act on Valkey; both Sentinel faults come first, and the
//! trial fails unless each was injected. The TCP proxy is not on this path (the sentinels name
//! the servers' own ports), so its faults are not in this trial. Both Sentinel faults count as
//! data loss, as the failover to the lagging replica does: replication is asynchronous, and a
//! demoted primary takes writes on open connections until the store follows the new one.
//!
//! An independent checker, sharing no code with the controller's decision logic, watches every
//! status, owns the fenced store, and reads the timestamps the `run` holders' commands write
//! while they run: never more Held than a target's permits, never two on one slot, never more
//! commands at once than the permits.
//!
//! `chaos_on_etcd` keeps the leases in a three-member etcd (`--backend etcd`). Its faults: the
//! etcd leader killed and started again, a member stopped (SIGSTOP) and resumed, each for 1 to
//! 4 s, and those of the first trial that do not act on Valkey; both etcd faults come first.
//! None of them counts as data loss: etcd acknowledges a write once a majority has it, so the
//! checker allows no excess at any moment.
//!
//! `TARGETLEASE_CHAOS_SECONDS` sets the length of the first trial's fault phase (default 150 s);
//! the Sentinel and etcd trials' last 30% of it, at least 45 s.

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
use libtest_mimic::{Arguments, Conclusion};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use targetlease::api::{Phase, TargetLease};
use tokio::process::{Child, Command};

use support::etcd::EtcdCluster;
use support::kube::{Cluster, ControllerProcess};
use support::proxy::{Mode, Proxy};
use support::scenario::shared_control_plane;
use support::sentinel::{self, MASTER, Topology, text};
use support::server::{Server, ServerKind};
use support::suite;

/// The key prefix of the etcd trial's controllers.
const ETCD_PREFIX: &str = "chaos-etcd";

/// The permits of each workload target (`target-<i>`): half exclusive, half shared.
const PERMITS: [u32; 6] = [1, 2, 1, 3, 1, 2];
const TARGETS: usize = PERMITS.len();
/// Claims at once on a target beyond its permits, so that some always wait.
const WAITING: usize = 2;
/// One create in this many asks a permits value other than its target's: the store must refuse
/// it (PermitsConflict) while permits granted under the target's value are held.
const WRONG_PERMITS_ONE_IN: u32 = 8;
/// How long after a fault that lost Valkey data a breach of the bound is counted, not reported:
/// the store cannot see a lease it granted before, and the old holder shows Held until its next
/// renewal (TTL/3) finds the lease gone, or its status write runs late.
const DATA_LOSS_WINDOW: Duration = Duration::from_secs(2 * TTL_SECONDS);

/// The same for a planned Sentinel failover, which loses only the grants made on the old primary
/// between the promotion and the store's switch (one sentinel poll after the sentinels name the
/// new primary, about 2.5 s after `SENTINEL FAILOVER` answers): their holders show Held until
/// their next renewal, TTL/3 later. One TTL covers that with room; a store that did not follow
/// the sentinels would write to the old primary until Sentinel demotes it (more than 10 s), and
/// its breaches fall outside.
const PLANNED_FAILOVER_WINDOW: Duration = Duration::from_secs(TTL_SECONDS);

// The shortest TTL the replicas below can keep: 1.5 x (take-over 3.75 s + call timeout 1 s +
// 1 s to start), rounded up (docs/internals/controller.md).
const TTL_SECONDS: u64 = 9;

/// The permits value a claim asks when it asks the wrong one for a target with `permits`: more
/// (the dangerous direction: one more holder beside them), or exclusive for the largest.
fn wrong_permits(permits: u32) -> u32 {
    if permits >= 3 { 1 } else { permits + 1 }
}

/// What the checker has seen of one target.
#[derive(Default)]
struct TargetView {
    /// The largest token any status has shown as Held, in any slot.
    max_token: u64,
    /// Per slot, the largest token any status has shown as Held in it.
    max_in_slot: HashMap<u32, u64>,
    /// Every (resource uid, token) pair shown as Held.
    seen: HashSet<(String, u64)>,
    /// Which resource each token was shown Held by: a token belongs to one tenure.
    owner_of: HashMap<u64, String>,
}

/// A resource whose latest status says Held.
#[derive(Clone, Debug)]
struct Holding {
    name: String,
    target: String,
    token: u64,
    slot: u32,
    /// The permits value the tenure was granted under (`status.permits`).
    permits: u32,
    /// Being deleted: the controller may have released it already.
    deleting: bool,
}

/// The independent checker: the statuses it saw, the fenced store it owns, the violations.
#[derive(Default)]
struct Checker {
    targets: Mutex<HashMap<String, TargetView>>,
    /// Resources whose latest status says Held, by uid.
    holding: Mutex<HashMap<String, Holding>>,
    /// Per (target, holder): the largest token shown Held on the target before that claim was
    /// created. Its grant comes after, so its token must be larger.
    floors: Mutex<HashMap<(String, String), u64>>,
    /// The fenced store: per (target, slot), the highest token it accepted a write with.
    fenced: Mutex<HashMap<(String, u32), u64>>,
    /// When each fault that loses Valkey data happened (shared with the fault injector).
    data_lost: Arc<Mutex<Vec<(Instant, Duration)>>>,
    /// Bound breaches already reported (target and the uids involved), so one is told once.
    reported: Mutex<HashSet<String>>,
    violations: Mutex<Vec<String>>,
    accepted: AtomicU64,
    refused: AtomicU64,
    held_events: AtomicU64,
    /// Watch events checked against the permits bound.
    moments: AtomicU64,
    /// Moments above the bound within two TTLs of a data loss (allowed, for 3 s at most).
    excused: AtomicU64,
    /// Since when the watch has been cut off (an error, until its next event, or the end of its
    /// next re-list): the statuses seen are then older than the API server's.
    stale_since: Mutex<Option<Instant>>,
    /// Per target, the most resources not being deleted shown Held at one moment.
    peaks: Mutex<BTreeMap<String, usize>>,
    /// Claims shown waiting with PermitsConflict, by uid.
    conflicts: Mutex<HashSet<String>>,
}

impl Checker {
    fn violation(&self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.lock().unwrap().push(what);
    }

    /// Called just before a claim for `target` by `holder` is created: its tokens must be above
    /// every token shown so far on the target.
    fn claiming(&self, target: &str, holder: &str) {
        let floor = self
            .targets
            .lock()
            .unwrap()
            .get(target)
            .map_or(0, |v| v.max_token);
        self.floors
            .lock()
            .unwrap()
            .insert((target.to_owned(), holder.to_owned()), floor);
    }

    /// Invariant 1, per target across all its slots: a token shown Held belongs to one resource
    /// only; it is above every token shown on the target before the claim was created (each
    /// grant's token is above every token issued before on the target); and in its slot it is
    /// above every token shown in that slot before (the slot's holders follow one another).
    /// Two grants in different slots can be shown in either order, so the newest token shown on
    /// the target bounds only claims created after it.
    fn observe(&self, lease: &TargetLease) -> Option<(String, Holding)> {
        let uid = lease.uid()?;
        let status = lease.status.as_ref()?;
        if status.phase != Phase::Held
            && status
                .conditions
                .iter()
                .any(|c| c.reason == "PermitsConflict")
        {
            self.conflicts.lock().unwrap().insert(uid.clone());
        }
        if status.phase != Phase::Held {
            return None;
        }
        let name = lease.name_any();
        let target = lease.spec.target.clone();
        let Some(token) = status.fencing_token else {
            self.violation(format!("{target}: {name} shows Held without a token"));
            return None;
        };
        let permits = status.permits.unwrap_or(1);
        let slot = match status.slot {
            Some(slot) if slot < permits => slot,
            other => {
                self.violation(format!(
                    "{target}: {name} shows Held in slot {other:?}, not one of 0..{permits}"
                ));
                other.unwrap_or(0)
            }
        };
        if permits != lease.spec.permits {
            self.violation(format!(
                "{target}: {name} asks permits {} but shows Held under permits {permits}",
                lease.spec.permits
            ));
        }
        let floor = self
            .floors
            .lock()
            .unwrap()
            .get(&(target.clone(), lease.spec.holder.clone()))
            .copied();
        let mut targets = self.targets.lock().unwrap();
        let view = targets.entry(target.clone()).or_default();
        if view.seen.insert((uid.clone(), token)) {
            self.held_events.fetch_add(1, Ordering::Relaxed);
            if let Some(other) = view.owner_of.insert(token, uid.clone())
                && other != uid
            {
                self.violation(format!(
                    "{target}: {name} shows Held with token {token}, shown before by uid {other}"
                ));
            }
            if let Some(floor) = floor
                && token <= floor
            {
                self.violation(format!(
                    "{target}: {name} shows Held with token {token}, not above {floor} shown before it was created"
                ));
            }
            let in_slot = view.max_in_slot.entry(slot).or_default();
            if token <= *in_slot {
                self.violation(format!(
                    "{target}: {name} shows Held in slot {slot} with token {token}, not above {} shown in that slot before",
                    *in_slot
                ));
            }
            *in_slot = (*in_slot).max(token);
            view.max_token = view.max_token.max(token);
        }
        let holding = Holding {
            name,
            target,
            token,
            slot,
            permits,
            deleting: lease.metadata.deletion_timestamp.is_some(),
        };
        Some((uid, holding))
    }

    /// Whether a fault lost Valkey data within two TTLs: the store then cannot see a lease it
    /// granted before, and grants the slot again while the old holder still shows Held.
    fn after_data_loss(&self) -> bool {
        let now = Instant::now();
        self.data_lost
            .lock()
            .unwrap()
            .iter()
            .any(|(lost, window)| now.duration_since(*lost) < *window)
    }

    /// Invariant 2, at every moment the watch shows (each event is one state of the API server,
    /// in order): on each target, the resources not being deleted that show Held were all
    /// granted under one permits value, are at most that many, and hold distinct slots. Within
    /// two TTLs of a data loss a breach is counted, not reported: invariant 3 bounds it.
    fn check_bound(&self, holding: &HashMap<String, Holding>) {
        self.moments.fetch_add(1, Ordering::Relaxed);
        let mut per_target: BTreeMap<&str, Vec<(&String, &Holding)>> = BTreeMap::new();
        for (uid, h) in holding.iter().filter(|(_, h)| !h.deleting) {
            per_target.entry(&h.target).or_default().push((uid, h));
        }
        for (target, held) in per_target {
            let mut peaks = self.peaks.lock().unwrap();
            let peak = peaks.entry(target.to_owned()).or_default();
            *peak = (*peak).max(held.len());
            drop(peaks);
            let Some(breach) = breach(&held) else {
                continue;
            };
            if self.after_data_loss() {
                eprintln!("    above the bound after a data loss (counted): {target}: {breach}");
                self.excused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let mut uids: Vec<&str> = held.iter().map(|(u, _)| u.as_str()).collect();
            uids.sort_unstable();
            if self
                .reported
                .lock()
                .unwrap()
                .insert(format!("{target} {uids:?}"))
            {
                self.violation(format!("{target}: {breach}"));
            }
        }
    }

    /// Invariant 4: the fenced store keeps one fence per slot and accepts a write only with a
    /// token >= the highest it accepted in that slot (at most permits writers, one per slot); a
    /// holder whose token is the newest shown in its slot is never refused.
    fn commit(&self, h: &Holding) {
        let newest = self
            .targets
            .lock()
            .unwrap()
            .get(&h.target)
            .and_then(|v| v.max_in_slot.get(&h.slot).copied())
            .unwrap_or(0);
        let mut fenced = self.fenced.lock().unwrap();
        let highest = fenced.entry((h.target.clone(), h.slot)).or_default();
        if h.token >= *highest {
            *highest = h.token;
            self.accepted.fetch_add(1, Ordering::Relaxed);
        } else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            if h.token == newest {
                self.violation(format!(
                    "{}: the newest holder of slot {} (token {}) was refused; the store accepted {highest}",
                    h.target, h.slot, h.token
                ));
            }
        }
    }

    /// Follows every TargetLease status (re-listing after API server restarts), and checks the
    /// permits bound after every event.
    async fn watch(self: Arc<Self>, api: Api<TargetLease>) {
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut relist: Option<HashMap<String, Holding>> = None;
        while let Some(event) = stream.next().await {
            let Ok(event) = event else {
                self.stale_since
                    .lock()
                    .unwrap()
                    .get_or_insert_with(Instant::now);
                continue;
            };
            match event {
                watcher::Event::Init => {
                    relist = Some(HashMap::new());
                    continue;
                }
                watcher::Event::InitApply(lease) => {
                    if let (Some(buffer), Some((uid, held))) =
                        (relist.as_mut(), self.observe(&lease))
                    {
                        buffer.insert(uid, held);
                    }
                    continue;
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
            // An event after a cut: the watch has resumed (or re-listed) where it was cut off.
            *self.stale_since.lock().unwrap() = None;
            let holding = self.holding.lock().unwrap().clone();
            self.check_bound(&holding);
        }
    }

    /// Invariant 3: on no target do more resources show Held than their permits, or two show
    /// Held in one slot, for longer than [`DOUBLE_HELD_LIMIT`], counting those being deleted and
    /// the moments after a data loss too (a grant wakes every other claim on its target, so one
    /// that still shows Held learns within one reconcile that it lost). Sampled every 50 ms; the
    /// time the watch is cut off (an API server restart) is not counted, as what it shows then
    /// is not the API server's state.
    async fn double_held(self: Arc<Self>, until: Instant) {
        let mut since: HashMap<String, Instant> = HashMap::new();
        let mut reported: HashSet<String> = HashSet::new();
        while Instant::now() < until {
            if self.stale_since.lock().unwrap().is_some() {
                since.clear();
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let holding = self.holding.lock().unwrap().clone();
            let mut per_target: HashMap<&str, Vec<(&String, &Holding)>> = HashMap::new();
            for (uid, h) in &holding {
                per_target.entry(&h.target).or_default().push((uid, h));
            }
            let breaches: HashMap<&str, String> = per_target
                .iter()
                .filter_map(|(target, held)| Some((*target, breach(held)?)))
                .collect();
            let now = Instant::now();
            since.retain(|target, _| breaches.contains_key(target.as_str()));
            for (target, what) in &breaches {
                let first = *since.entry((*target).to_owned()).or_insert(now);
                if now - first > DOUBLE_HELD_LIMIT && reported.insert((*target).to_owned()) {
                    self.violation(format!(
                        "{target}: for more than {DOUBLE_HELD_LIMIT:?}: {what}"
                    ));
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Holders: every resource whose status says Held writes every 100 ms with its token.
    async fn holders(self: Arc<Self>, until: Instant) {
        while Instant::now() < until {
            let holding: Vec<Holding> = self.holding.lock().unwrap().values().cloned().collect();
            for h in &holding {
                self.commit(h);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// What is wrong with the resources showing Held on one target, if anything: granted under
/// different permits values, more than the smallest of them, or two in one slot.
fn breach(held: &[(&String, &Holding)]) -> Option<String> {
    let describe = || {
        let mut shown: Vec<String> = held
            .iter()
            .map(|(_, h)| {
                format!(
                    "{} slot {} of {} token {}{}",
                    h.name,
                    h.slot,
                    h.permits,
                    h.token,
                    if h.deleting { " (being deleted)" } else { "" }
                )
            })
            .collect();
        shown.sort();
        shown.join(", ")
    };
    let permits: HashSet<u32> = held.iter().map(|(_, h)| h.permits).collect();
    let fewest = permits.iter().copied().min()?;
    if permits.len() > 1 {
        return Some(format!(
            "Held under different permits values at once: {}",
            describe()
        ));
    }
    if held.len() > fewest as usize {
        return Some(format!(
            "{} resources show Held, permits {fewest}: {}",
            held.len(),
            describe()
        ));
    }
    let slots: HashSet<u32> = held.iter().map(|(_, h)| h.slot).collect();
    if slots.len() < held.len() {
        return Some(format!(
            "two resources show Held in one slot: {}",
            describe()
        ));
    }
    None
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
    RunDeleted,
    RunReleased,
    RunTtlEdited,
    ControllerOutage,
    SentinelFailover,
    SentinelPrimaryKilled,
    EtcdLeaderKilled,
    EtcdMemberPaused,
}

const FAULTS: [Fault; 15] = [
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
    Fault::RunDeleted,
    Fault::RunReleased,
    Fault::RunTtlEdited,
    Fault::ControllerOutage,
];

/// The faults of the Sentinel trial: the Valkey faults act on the topology through Sentinel (the
/// TCP proxy is not on the controllers' path there: the sentinels name the servers' own ports);
/// the others are those that do not touch Valkey.
const SENTINEL_FAULTS: [Fault; 12] = [
    Fault::ControllerKill,
    Fault::LeaderChange,
    Fault::ApiServerCrash,
    Fault::LeaderPartition,
    Fault::LeaderLeaseDeleted,
    Fault::RunPartition,
    Fault::RunDeleted,
    Fault::RunReleased,
    Fault::RunTtlEdited,
    Fault::ControllerOutage,
    Fault::SentinelFailover,
    Fault::SentinelPrimaryKilled,
];

/// The faults of the etcd trial: those that do not touch Valkey, and the members' own.
const ETCD_FAULTS: [Fault; 12] = [
    Fault::ControllerKill,
    Fault::LeaderChange,
    Fault::ApiServerCrash,
    Fault::LeaderPartition,
    Fault::LeaderLeaseDeleted,
    Fault::RunPartition,
    Fault::RunDeleted,
    Fault::RunReleased,
    Fault::RunTtlEdited,
    Fault::ControllerOutage,
    Fault::EtcdLeaderKilled,
    Fault::EtcdMemberPaused,
];

/// The faults the etcd trial must inject at least once: they come first.
const ETCD_REQUIRED: [Fault; 2] = [Fault::EtcdLeaderKilled, Fault::EtcdMemberPaused];

/// The faults the Sentinel trial must inject at least once (it fails otherwise): they come
/// first, in this order, and one skipped (no replica in sync) is tried again next.
const SENTINEL_REQUIRED: [Fault; 2] = [Fault::SentinelPrimaryKilled, Fault::SentinelFailover];

/// One chaos trial: where its resources live, how its controllers reach Valkey, its faults.
struct Setup {
    name: &'static str,
    /// The namespace of its TargetLeases, its leader Lease and its `run`s.
    ns: &'static str,
    /// Where the controllers keep their leases.
    store: StoreKind,
    /// Length of the fault phase.
    seconds: u64,
    faults: Vec<Fault>,
    /// Faults injected first, each until it was injected once.
    required: Vec<Fault>,
}

impl Setup {
    /// The trials: `TARGETLEASE_CHAOS_FAULTS=RunPartition,LeaderLeaseDeleted` keeps only the
    /// faults named; a trial left without any is ignored.
    fn all() -> Vec<Setup> {
        let chosen = |all: &[Fault]| -> Vec<Fault> {
            match std::env::var("TARGETLEASE_CHAOS_FAULTS") {
                Ok(names) => all
                    .iter()
                    .copied()
                    .filter(|f| names.split(',').any(|n| n.trim() == format!("{f:?}")))
                    .collect(),
                Err(_) => all.to_vec(),
            }
        };
        let sentinel_faults = chosen(&SENTINEL_FAULTS);
        let required = SENTINEL_REQUIRED
            .into_iter()
            .filter(|f| sentinel_faults.contains(f))
            .collect();
        let etcd_faults = chosen(&ETCD_FAULTS);
        let etcd_required = ETCD_REQUIRED
            .into_iter()
            .filter(|f| etcd_faults.contains(f))
            .collect();
        vec![
            Setup {
                name: "chaos_with_independent_checker",
                ns: "chaos",
                store: StoreKind::Proxied,
                seconds: fault_seconds(),
                faults: chosen(&FAULTS),
                required: Vec::new(),
            },
            Setup {
                name: "chaos_through_sentinel",
                ns: "chaos-sentinel",
                store: StoreKind::Sentinel,
                seconds: sentinel_fault_seconds(),
                faults: sentinel_faults,
                required,
            },
            Setup {
                name: "chaos_on_etcd",
                ns: "chaos-etcd",
                store: StoreKind::Etcd,
                seconds: sentinel_fault_seconds(),
                faults: etcd_faults,
                required: etcd_required,
            },
        ]
    }
}

/// Where a trial's controllers keep their leases.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StoreKind {
    /// One Valkey behind a TCP proxy.
    Proxied,
    /// A Valkey primary with replicas, through three sentinels.
    Sentinel,
    /// A three-member etcd cluster (`--backend etcd`).
    Etcd,
}

/// The `run` holders alive now: their serial number and their proxy to the API server.
type RunSlots = Arc<Mutex<Vec<(u64, Arc<Proxy>)>>>;

/// Targets held by `targetlease run` processes (`run-<i>`): their permits and how many `run`s
/// at a time on each, one more than the permits so that one always waits.
const RUN_TARGETS: [(u32, usize); 2] = [(1, 2), (2, 3)];

/// The permits of run target `target` (`run-<i>`, or the name's number).
fn run_permits(target: usize) -> u32 {
    RUN_TARGETS.get(target).map_or(1, |(permits, _)| *permits)
}

/// The Valkey the controllers reach.
enum Valkey {
    /// One primary, reached through a TCP proxy.
    Proxied {
        valkey: Server,
        /// A replica of `valkey` with its own AOF: promoted, after being detached while
        /// `valkey` keeps granting, by the failover fault.
        standby: Server,
        proxy: Proxy,
    },
    /// A primary with two replicas and three sentinels, reached through the sentinels.
    Sentinel(Topology),
    /// Three etcd members (`--backend etcd`, every member an endpoint).
    Etcd(EtcdCluster),
}

struct World {
    cluster: Arc<Cluster>,
    client: Client,
    ns: &'static str,
    valkey: Valkey,
    /// How long each Sentinel failover took, from the fault until every sentinel named the
    /// new primary.
    failovers: Vec<Duration>,
    /// The `run` holders alive now, each with the proxy between it and the API server.
    runs: RunSlots,
    /// When each fault that loses Valkey data happened.
    data_lost: Arc<Mutex<Vec<(Instant, Duration)>>>,
    /// One proxy per replica between it and the API server: a partition holds its bytes.
    api_proxies: Vec<Proxy>,
    replicas: Vec<Option<ControllerProcess>>,
}

impl World {
    fn api(&self) -> Api<TargetLease> {
        Api::namespaced(self.client.clone(), self.ns)
    }

    fn replica(&self, i: usize) -> ControllerProcess {
        let name = format!("replica-{i}");
        let kubeconfig = self.cluster.kubeconfig_via(self.api_proxies[i].port);
        let mut args = vec![
            "--watch-namespace",
            self.ns,
            "--leader-election",
            "--leader-election-namespace",
            self.ns,
            "--leader-election-seconds",
            "3",
            "--identity",
            &name,
            "--valkey-timeout",
            "1s",
        ];
        match &self.valkey {
            Valkey::Proxied { proxy, .. } => {
                let url = format!("redis://127.0.0.1:{}", proxy.port);
                ControllerProcess::start_as(&self.cluster, &kubeconfig, &url, &args)
            }
            Valkey::Sentinel(topology) => {
                let sentinels = topology.sentinel_addrs().join(",");
                args.extend([
                    "--valkey-sentinels",
                    &sentinels,
                    "--valkey-sentinel-master",
                    MASTER,
                ]);
                ControllerProcess::start_reaching(&self.cluster, &kubeconfig, &args, &[])
            }
            Valkey::Etcd(etcd) => {
                let endpoints = etcd.urls().join(",");
                args.extend([
                    "--backend",
                    "etcd",
                    "--etcd-endpoints",
                    &endpoints,
                    "--etcd-key-prefix",
                    ETCD_PREFIX,
                    "--etcd-timeout",
                    "1s",
                ]);
                ControllerProcess::start_reaching(&self.cluster, &kubeconfig, &args, &[])
            }
        }
    }

    /// The single Valkey behind the proxy; the Valkey faults other than Sentinel's are only in
    /// that trial's list.
    fn proxied(&mut self) -> (&mut Server, &mut Server, &mut Proxy) {
        match &mut self.valkey {
            Valkey::Proxied {
                valkey,
                standby,
                proxy,
            } => (valkey, standby, proxy),
            _ => panic!("a proxied Valkey fault in another trial"),
        }
    }

    /// The port of the server that holds the leases now.
    fn primary_port(&self) -> Option<u16> {
        match &self.valkey {
            Valkey::Proxied { valkey, .. } => Some(valkey.port),
            Valkey::Sentinel(topology) => tokio::task::block_in_place(|| topology.primary_port()),
            Valkey::Etcd(_) => None,
        }
    }

    /// A `run` holder's TargetLease that shows Held now, chosen at random.
    async fn run_holder(&self, rng: &mut impl Rng) -> Option<String> {
        let leases = self.api().list(&ListParams::default()).await.ok()?.items;
        let held: Vec<String> = leases
            .iter()
            .filter(|l| l.spec.target.starts_with("run-"))
            .filter(|l| l.metadata.deletion_timestamp.is_none())
            .filter(|l| l.status.as_ref().is_some_and(|s| s.phase == Phase::Held))
            .map(|l| l.name_any())
            .collect();
        held.choose(rng).cloned()
    }

    async fn leader(&self) -> Option<usize> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), self.ns);
        let lease = leases.get_opt("targetlease-controller").await.ok()??;
        let holder = lease.spec?.holder_identity?;
        holder.strip_prefix("replica-")?.parse().ok()
    }

    /// Injects `fault`; false when it was skipped (the Valkey replicas were not in sync, or a
    /// `run` target had no `run`).
    async fn inject(&mut self, fault: Fault, rng: &mut impl Rng) -> bool {
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
                let (valkey, _, _) = self.proxied();
                valkey.kill();
                valkey.restart();
            }
            Fault::ValkeyRestartDataLost => {
                self.data_lost
                    .lock()
                    .unwrap()
                    .push((Instant::now(), DATA_LOSS_WINDOW));
                let (valkey, _, _) = self.proxied();
                valkey.kill();
                for entry in std::fs::read_dir(valkey.dir())
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
                valkey.restart();
            }
            Fault::ConnectionCut => self.proxied().2.cut(),
            Fault::ConnectionStall => {
                self.proxied().2.set(Mode::Stall);
                tokio::time::sleep(Duration::from_millis(rng.random_range(1000..3000))).await;
                self.proxied().2.set(Mode::Pass);
            }
            Fault::ApiServerCrash => self.cluster.restart("kube-apiserver", true),
            Fault::LeaderLeaseDeleted => {
                let leases: Api<Lease> = Api::namespaced(self.client.clone(), self.ns);
                let _ = leases
                    .delete("targetlease-controller", &DeleteParams::default())
                    .await;
            }
            Fault::ValkeyFailoverToLaggingReplica => {
                // The standby has every write; detached, it misses what the primary grants
                // from now on, until the primary dies and every client is sent to it.
                let data_lost = self.data_lost.clone();
                let (valkey, standby, _) = self.proxied();
                if !standby.wait_in_sync_with(valkey, Duration::from_secs(10)) {
                    eprintln!("    the standby did not catch up: failover skipped");
                    return false;
                }
                standby.promote();
                data_lost
                    .lock()
                    .unwrap()
                    .push((Instant::now(), DATA_LOSS_WINDOW));
                tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
                let (valkey, standby, proxy) = self.proxied();
                valkey.kill();
                proxy.retarget(standby.port);
                proxy.cut();
                let fresh = durable_valkey(Some(standby));
                *valkey = std::mem::replace(standby, fresh);
            }
            Fault::SentinelFailover | Fault::SentinelPrimaryKilled => {
                let Valkey::Sentinel(topology) = &mut self.valkey else {
                    panic!("a Sentinel fault in the proxied trial");
                };
                let kill = fault == Fault::SentinelPrimaryKilled;
                let data_lost = self.data_lost.clone();
                let outcome =
                    tokio::task::block_in_place(|| sentinel_failover(topology, kill, &data_lost));
                match outcome {
                    Ok(took) => {
                        eprintln!("    every sentinel named the new primary after {took:?}");
                        self.failovers.push(took);
                    }
                    Err(why) => {
                        eprintln!("    {why}: skipped");
                        return false;
                    }
                }
            }
            Fault::EtcdLeaderKilled | Fault::EtcdMemberPaused => {
                let Valkey::Etcd(etcd) = &mut self.valkey else {
                    panic!("an etcd fault in a Valkey trial");
                };
                let down = Duration::from_millis(rng.random_range(1000..4000));
                let member = if fault == Fault::EtcdLeaderKilled {
                    tokio::task::block_in_place(|| etcd.leader())
                } else {
                    Some(rng.random_range(0..3))
                };
                let Some(member) = member else {
                    eprintln!("    no etcd member names a leader: skipped");
                    return false;
                };
                let kill = fault == Fault::EtcdLeaderKilled;
                if kill {
                    etcd.kill(member);
                } else {
                    etcd.pause(member, true);
                }
                tokio::time::sleep(down).await;
                let Valkey::Etcd(etcd) = &mut self.valkey else {
                    unreachable!()
                };
                if kill {
                    etcd.restart(member);
                } else {
                    etcd.pause(member, false);
                }
                eprintln!("    member {member} down for {down:?}");
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
                    return false;
                };
                proxy.set(Mode::Stall);
                tokio::time::sleep(Duration::from_millis(rng.random_range(4000..8000))).await;
                proxy.set(Mode::Pass);
            }
            Fault::RunDeleted | Fault::RunReleased | Fault::RunTtlEdited => {
                // A `run` holder's TargetLease deleted (`kubectl delete`), released
                // (`spec.release`) or its TTL edited while its command runs: the command must be
                // dead before the target passes on, however it ignores SIGTERM.
                let Some(name) = self.run_holder(rng).await else {
                    return false;
                };
                let patch = |spec: serde_json::Value| serde_json::json!({"spec": spec});
                let result = match fault {
                    Fault::RunDeleted => self
                        .api()
                        .delete(&name, &DeleteParams::default())
                        .await
                        .map(|_| ()),
                    Fault::RunReleased => self
                        .api()
                        .patch(
                            &name,
                            &kube::api::PatchParams::default(),
                            &kube::api::Patch::Merge(&patch(serde_json::json!({"release": true}))),
                        )
                        .await
                        .map(|_| ()),
                    _ => {
                        let ttl = [TTL_SECONDS, TTL_SECONDS * 2, TTL_SECONDS * 3]
                            .choose(rng)
                            .copied()
                            .unwrap_or(TTL_SECONDS);
                        eprintln!("    ttlSeconds of {name} -> {ttl}");
                        self.api()
                            .patch(
                                &name,
                                &kube::api::PatchParams::default(),
                                &kube::api::Patch::Merge(&patch(
                                    serde_json::json!({"ttlSeconds": ttl}),
                                )),
                            )
                            .await
                            .map(|_| ())
                    }
                };
                if let Err(e) = result {
                    eprintln!("    {fault:?} of {name} failed: {e}");
                    return false;
                }
                eprintln!("    {fault:?}: {name}");
            }
            Fault::ControllerOutage => {
                // Every replica down for longer than the TTL (a scale to zero, a node drain):
                // the store's leases expire while the `run` holders' heartbeats are still
                // confirmed by the API server against their Held statuses.
                for replica in self.replicas.iter_mut() {
                    if let Some(mut p) = replica.take() {
                        p.kill();
                    }
                }
                let out = Duration::from_millis(
                    rng.random_range((TTL_SECONDS * 1300)..(TTL_SECONDS * 2200)),
                );
                eprintln!("    no controller for {out:?}");
                tokio::time::sleep(out).await;
                for i in 0..self.replicas.len() {
                    self.replicas[i] = Some(self.replica(i));
                }
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
        true
    }
}

/// A failover of the topology's primary: planned (`SENTINEL FAILOVER`) or by SIGKILL, after
/// which the killed node is started again as a replica of the new primary (without persistence
/// it would come back empty and as a primary). Both lose grants the old primary acknowledged
/// and had not replicated: replication is asynchronous, and a demoted primary takes writes on
/// open connections until the store's poll or Sentinel moves them (they vanish when it resyncs
/// from the new one). Returns how long until every sentinel named the new primary, or why the
/// failover was not done: a replica must be in sync first, or the promoted one could miss far
/// more than that window. The other replica may still be syncing (a node restarted after a
/// SIGKILL) or be the old primary of a planned failover, which the sentinels make a replica
/// only at their next look at it (up to 10 s): the faults do not wait for a whole topology.
fn sentinel_failover(
    topology: &mut Topology,
    kill: bool,
    data_lost: &Mutex<Vec<(Instant, Duration)>>,
) -> Result<Duration, String> {
    let old = topology
        .primary_port()
        .ok_or("no sentinel names a primary")?;
    let waiting = Instant::now();
    let deadline = waiting + Duration::from_secs(15);
    while synced_replicas(topology, old) < 1 {
        if Instant::now() > deadline {
            return Err(format!("primary {old} has no replica in sync"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if waiting.elapsed() > Duration::from_secs(1) {
        eprintln!("    waited {:?} for a replica in sync", waiting.elapsed());
    }
    let started = Instant::now();
    if kill {
        data_lost.lock().unwrap().push((started, DATA_LOSS_WINDOW));
        topology.node(old).kill();
    } else {
        let reply = topology
            .query(
                topology.sentinels[0].port,
                &["SENTINEL", "FAILOVER", MASTER],
            )
            .map_err(|e| format!("SENTINEL FAILOVER: {e}"))?;
        if text(&reply) != "OK" {
            return Err(format!("SENTINEL FAILOVER: {}", text(&reply)));
        }
        // The promotion follows the reply: no write is lost before it.
        data_lost
            .lock()
            .unwrap()
            .push((Instant::now(), PLANNED_FAILOVER_WINDOW));
    }
    let new = topology.wait_for_new_primary(old, Duration::from_secs(20));
    let took = started.elapsed();
    if kill {
        let restarting = Instant::now();
        topology.node(old).restart_as_replica_of(new);
        eprintln!(
            "    {old} restarted as a replica of {new} in {:?}",
            restarting.elapsed()
        );
    }
    Ok(took)
}

/// How many data nodes replicate the server on `port` with their sync done, as they tell it
/// themselves: a replica still in its first full sync (one restarted after a SIGKILL, or one
/// moved to a new primary) can be listed by the primary as online while it holds nothing yet.
fn synced_replicas(topology: &Topology, port: u16) -> usize {
    let master = format!("master_port:{port}");
    topology
        .nodes
        .iter()
        .filter(|n| n.port != port)
        .filter(|n| {
            topology
                .query(n.port, &["INFO", "replication"])
                .is_ok_and(|info| {
                    let info = text(&info);
                    let has = |line: &str| info.lines().any(|l| l.trim() == line);
                    has("role:slave")
                        && has(&master)
                        && has("master_link_status:up")
                        && has("master_sync_in_progress:0")
                })
        })
        .count()
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

/// Targets where a claim waits but no resource's status says Held, or where fewer than the
/// permits are Held while a claim asking those permits waits; each with what its claims show.
/// A claim that ended (Released, Failed) waits for nothing.
async fn targets_without_holder(api: &Api<TargetLease>) -> Option<Vec<String>> {
    let list = api.list(&ListParams::default()).await.ok()?;
    // Per target: the permits of each resource showing Held, the permits each waiting claim
    // asks, and every live claim as it stands.
    type Shown = (Vec<u32>, Vec<u32>, Vec<String>);
    let mut by_target: BTreeMap<String, Shown> = BTreeMap::new();
    for lease in list
        .items
        .iter()
        .filter(|l| l.metadata.deletion_timestamp.is_none() && !l.spec.release)
    {
        let (held, waiting, shown) = by_target.entry(lease.spec.target.clone()).or_default();
        let status = lease.status.as_ref();
        let reason = status
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Held"))
            .map_or("", |c| c.reason.as_str());
        shown.push(format!(
            "{} {:?} {reason} (permits {})",
            lease.name_any(),
            status.map(|s| s.phase),
            lease.spec.permits
        ));
        match status {
            Some(s) if s.phase == Phase::Held => held.push(s.permits.unwrap_or(1)),
            Some(s) if matches!(s.phase, Phase::Released | Phase::Failed) => {}
            _ => waiting.push(lease.spec.permits),
        }
    }
    Some(
        by_target
            .into_iter()
            // Only where a claim waits: a target whose only claim is Released (a `run` cut off
            // from the API server after the workload stopped starting new ones) needs no holder.
            .filter(|(_, (held, waiting, _))| match held.first() {
                None => !waiting.is_empty(),
                Some(&permits) => held.len() < permits as usize && waiting.contains(&permits),
            })
            .map(|(t, (_, _, shown))| format!("{t} ({})", shown.join(", ")))
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

/// Creates and deletes TargetLeases at random until `until`: on each target up to its permits
/// plus [`WAITING`] claims, one create in [`WRONG_PERMITS_ONE_IN`] asking a wrong permits value;
/// on a target with permits, one delete in four deletes every holder at once.
async fn workload(
    api: Api<TargetLease>,
    checker: Arc<Checker>,
    until: Instant,
    ops: Arc<AtomicU64>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut serial = 0u64;
    while Instant::now() < until {
        let index = rng.random_range(0..TARGETS);
        let target = format!("target-{index}");
        let Ok(list) = api.list(&ListParams::default()).await else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        let on_target: Vec<&TargetLease> = list
            .items
            .iter()
            .filter(|l| l.spec.target == target && l.metadata.deletion_timestamp.is_none())
            .collect();
        if on_target.len() < PERMITS[index] as usize + WAITING && rng.random_bool(0.6) {
            serial += 1;
            let name = format!("{target}-{serial}");
            let holder = format!("holder-{serial}");
            let permits = if rng.random_ratio(1, WRONG_PERMITS_ONE_IN) {
                wrong_permits(PERMITS[index])
            } else {
                PERMITS[index]
            };
            let lease = TargetLease::new(
                &name,
                targetlease::api::TargetLeaseSpec {
                    target: target.clone(),
                    holder: holder.clone(),
                    holder_ref: None,
                    ttl_seconds: TTL_SECONDS as u32,
                    permits,
                    max_hold_seconds: None,
                    release: false,
                    priority: None,
                },
            );
            checker.claiming(&target, &holder);
            if api.create(&PostParams::default(), &lease).await.is_ok() {
                ops.fetch_add(1, Ordering::Relaxed);
            }
        } else if PERMITS[index] > 1 && rng.random_ratio(1, 4) {
            // Every holder of a target with permits goes at once: the claims waiting take the
            // freed permits together, in concurrent grants.
            let held = on_target
                .iter()
                .filter(|l| l.status.as_ref().is_some_and(|s| s.phase == Phase::Held));
            let deletes = held.map(|l| {
                let name = l.name_any();
                let api = api.clone();
                async move { api.delete(&name, &DeleteParams::default()).await.is_ok() }
            });
            let done = futures::future::join_all(deletes).await;
            ops.fetch_add(
                done.iter().filter(|ok| **ok).count() as u64,
                Ordering::Relaxed,
            );
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

/// The `targetlease run` holders: on each run target, its permits plus one `run`s at a time
/// (each through a proxy of its own to the API server, listed in `slots`), each running a command
/// that appends its token and slot once and then the time in nanoseconds every 50 ms for 2 to 10 s
/// (longer than the controller's heartbeat bound, so a cut-off holder's command outlives it
/// unless `run` stops it), to a file of its own in `dir`, which first gets the time `run` was
/// started. On an exclusive target each `run` is on a host of its own; on a target with permits
/// the `run`s share one host, each with its own `--instance`.
async fn run_holders(
    cluster: Arc<Cluster>,
    ns: &'static str,
    checker: Arc<Checker>,
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
        for (target, &(permits, at_once)) in RUN_TARGETS.iter().enumerate() {
            if running.iter().filter(|(t, _, _)| *t == target).count() >= at_once {
                continue;
            }
            serial += 1;
            let proxy = Arc::new(Proxy::start(cluster.apiserver_port()).await);
            let kubeconfig = cluster.kubeconfig_via(proxy.port);
            let file = dir.join(format!("run-{target}-{serial}.log"));
            let ticks = rng.random_range(40..200);
            // Half of the commands ignore SIGTERM for their whole grace (they are killed): the
            // hand-over must wait for them all the same.
            let deaf = if rng.random_bool(0.5) {
                "trap '' TERM; "
            } else {
                ""
            };
            let grace = format!("{}ms", rng.random_range(500..3000));
            let script = format!(
                "{deaf}echo \"token $TARGETLEASE_TOKEN\" >> {f}; echo \"slot $TARGETLEASE_SLOT\" >> {f}; n=0; while [ $n -lt {ticks} ]; do date +%s%N >> {f}; sleep 0.05; n=$((n+1)); done",
                f = file.display()
            );
            // Each `run` in a UTS namespace of its own, named like a pod of its own: one host
            // runs one `run` per target (the TargetLease is named after the host), unless each
            // has its own --instance, as on the targets with permits.
            let (host, instance) = if permits > 1 {
                (format!("runners-{target}"), Some(format!("i{serial}")))
            } else {
                (format!("runner-{serial}"), None)
            };
            let started = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            if let Err(e) = std::fs::write(&file, format!("spawned {started}\n")) {
                eprintln!("    run file could not be written: {e}");
                continue;
            }
            checker.claiming(&format!("run-{target}"), &format!("runner-{serial}"));
            let child = Command::new("unshare")
                .args(["--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\""])
                .arg(&host)
                .arg(support::kube::targetlease_bin())
                .args(["run", "-n", ns, "--target", &format!("run-{target}")])
                .args([
                    "--holder",
                    &format!("runner-{serial}"),
                    "--ttl",
                    &format!("{TTL_SECONDS}s"),
                    "--permits",
                    &permits.to_string(),
                ])
                .args(instance.iter().flat_map(|i| ["--instance", i.as_str()]))
                .args([
                    "--grace",
                    grace.as_str(),
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

/// One `run` holder's command, as its file tells: when its `run` was started, the token and
/// slot it ran with, and the first and last moments it was seen running (nanoseconds since the
/// epoch).
struct Ran {
    file: String,
    spawned: u128,
    token: u64,
    slot: u32,
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
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|t| t.trim().parse::<u128>().ok())
        };
        let token = field("token ").map_or(0, |t| t as u64);
        // A slot the command was not given is reported by check_commands as out of range.
        let slot = field("slot ").map_or(u32::MAX, |s| s as u32);
        let spawned = field("spawned ").unwrap_or(0);
        let times: Vec<u128> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if let (Some(&first), Some(&last)) = (times.iter().min(), times.iter().max()) {
            by_target.entry(target).or_default().push(Ran {
                file: name,
                spawned,
                token,
                slot,
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

/// Invariant 6, per run target with permits N:
/// - every command ran with a slot below N and a token of its own (no two share one);
/// - a command whose `run` was started after another command had started ran with a larger
///   token (its grant came after that one's, and every grant's token is above every token
///   issued before on the target, in any slot);
/// - in one slot, a command starts only after every command that started before it in that
///   slot was last seen running, with a larger token (one writer per slot);
/// - at no moment do more than N commands run (checked at every start).
///
/// The bound is zero, with no excuse: all times come from the commands themselves on one clock,
/// and a stopped command writes nothing, so any measured overlap is a real one. A data loss
/// excuses nothing: a `run`'s command starts only once its Held status is published, and a
/// target whose holder heartbeats passes on only when that holder stopped (the hand-over rule),
/// whatever the store says after losing the old lease.
fn check_commands(
    checker: &Checker,
    dir: &std::path::Path,
    data_lost: &[(std::time::SystemTime, Duration)],
) -> (usize, BTreeMap<usize, usize>) {
    let after_loss = |at: u128| {
        let at = std::time::UNIX_EPOCH + Duration::from_nanos(at as u64);
        data_lost.iter().any(|(lost, window)| {
            *lost <= at && at.duration_since(*lost).unwrap_or_default() < *window
        })
    };
    let mut count = 0;
    let mut peaks: BTreeMap<usize, usize> = BTreeMap::new();
    for (target, ran) in commands_ran(dir) {
        count += ran.len();
        let permits = run_permits(target);
        let mut owner_of: HashMap<u64, &str> = HashMap::new();
        for (i, later) in ran.iter().enumerate() {
            if later.slot >= permits {
                checker.violation(format!(
                    "run-{target}: {} ran in slot {}, not one of 0..{permits}",
                    later.file, later.slot
                ));
            }
            if let Some(other) = owner_of.insert(later.token, &later.file) {
                checker.violation(format!(
                    "run-{target}: {} and {other} both ran with token {}",
                    later.file, later.token
                ));
            }
            for earlier in ran.iter().filter(|e| e.first < later.spawned) {
                if later.token <= earlier.token {
                    checker.violation(format!(
                        "run-{target}: {} ran with token {}, not above {} of {}, which ran before its run started",
                        later.file, later.token, earlier.token, earlier.file
                    ));
                }
            }
            // Running when `later` starts: at most permits - 1 others, but for an old holder
            // left running by a data loss, for a bounded time.
            let beside: Vec<&Ran> = ran[..i].iter().filter(|e| e.last >= later.first).collect();
            let peak = peaks.entry(target).or_default();
            *peak = (*peak).max(beside.len() + 1);
            if beside.len() + 1 > permits as usize {
                let names: Vec<String> = beside
                    .iter()
                    .map(|e| format!("{} (slot {}, token {})", e.file, e.slot, e.token))
                    .collect();
                checker.violation(format!(
                    "run-{target}: {} (slot {}, token {}) started while {} ran, permits {permits}",
                    later.file,
                    later.slot,
                    later.token,
                    names.join(", ")
                ));
            }
            for earlier in ran[..i].iter().filter(|e| e.slot == later.slot) {
                if later.token <= earlier.token {
                    checker.violation(format!(
                        "run-{target}: {} ran in slot {} with token {}, not above {} of {} before it in that slot",
                        later.file, later.slot, later.token, earlier.token, earlier.file
                    ));
                }
                if later.first > earlier.last {
                    continue;
                }
                let overlap = Duration::from_nanos((earlier.last - later.first) as u64);
                let lost = after_loss(later.first);
                {
                    checker.violation(format!(
                        "run-{target}: {} (token {}) started in slot {} while {} (token {}) ran in it: {overlap:?} together{}",
                        later.file,
                        later.token,
                        later.slot,
                        earlier.file,
                        earlier.token,
                        if lost { " after a data loss" } else { "" }
                    ));
                }
            }
        }
    }
    (count, peaks)
}

/// How long more resources than a target's permits, or two in one slot, may show Held: the new
/// holder's grant wakes the old one, whose renewal finds it lost; a few reconciles under load.
const DOUBLE_HELD_LIMIT: Duration = Duration::from_secs(3);

/// Length of the fault phase: `TARGETLEASE_CHAOS_SECONDS`, 150 s by default.
fn fault_seconds() -> u64 {
    std::env::var("TARGETLEASE_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150)
}

/// Length of the Sentinel trial's fault phase: 30% of [`fault_seconds`], at least 45 s (time
/// for its two Sentinel faults and two others).
fn sentinel_fault_seconds() -> u64 {
    (fault_seconds() * 3 / 10).max(45)
}

async fn chaos(cluster: Arc<Cluster>, setup: Setup) {
    let seconds = setup.seconds;
    let ns = setup.ns;
    cluster.kubectl_ok(&["create", "namespace", ns]);
    let client = cluster.client().await;
    let valkey = if setup.store == StoreKind::Sentinel {
        let topology = tokio::task::spawn_blocking(|| {
            Topology::start(sentinel::Options::plain(ServerKind::Valkey91))
        })
        .await
        .expect("start the Sentinel topology");
        Valkey::Sentinel(topology)
    } else if setup.store == StoreKind::Etcd {
        let etcd = tokio::task::spawn_blocking(EtcdCluster::start)
            .await
            .expect("start etcd");
        Valkey::Etcd(etcd)
    } else {
        let valkey = durable_valkey(None);
        let standby = durable_valkey(Some(&valkey));
        let proxy = Proxy::start(valkey.port).await;
        Valkey::Proxied {
            valkey,
            standby,
            proxy,
        }
    };
    let runs_dir = tempfile::tempdir().expect("run folder");
    let api_proxies = vec![
        Proxy::start(cluster.apiserver_port()).await,
        Proxy::start(cluster.apiserver_port()).await,
    ];
    let mut world = World {
        cluster: cluster.clone(),
        client: client.clone(),
        ns,
        valkey,
        failovers: Vec::new(),
        runs: RunSlots::default(),
        data_lost: Arc::new(Mutex::new(Vec::new())),
        api_proxies,
        replicas: Vec::new(),
    };
    world.replicas = vec![Some(world.replica(0)), Some(world.replica(1))];
    let api = world.api();

    let checker = Arc::new(Checker {
        data_lost: world.data_lost.clone(),
        ..Checker::default()
    });
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
    let load = tokio::spawn(workload(
        api.clone(),
        checker.clone(),
        fault_phase_end,
        ops.clone(),
        seed,
    ));
    let runs = tokio::spawn(run_holders(
        cluster.clone(),
        ns,
        checker.clone(),
        world.runs.clone(),
        runs_dir.path().to_owned(),
        fault_phase_end,
        seed,
    ));

    let faults = setup.faults;
    assert!(
        !faults.is_empty(),
        "TARGETLEASE_CHAOS_FAULTS names no fault"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    // The required faults first, in their order (popped from the end).
    let mut pending: Vec<Fault> = setup.required.iter().rev().copied().collect();
    let mut injected: BTreeMap<Fault, u32> = BTreeMap::new();
    let mut skipped: BTreeMap<Fault, u32> = BTreeMap::new();
    let mut longest_recovery = Duration::ZERO;
    let mut unrecovered = Vec::new();
    tokio::time::sleep(Duration::from_secs(5)).await;
    while Instant::now() + Duration::from_secs(20) < fault_phase_end {
        let fault = match pending.pop() {
            Some(fault) => fault,
            None => *faults.choose(&mut rng).expect("faults"),
        };
        eprintln!(
            "[{:>5.1}s] fault: {fault:?}",
            (Instant::now() + Duration::from_secs(seconds) - fault_phase_end).as_secs_f64()
        );
        if !world.inject(fault, &mut rng).await {
            *skipped.entry(fault).or_default() += 1;
            // Tried again after the other required faults.
            if setup.required.contains(&fault) && !injected.contains_key(&fault) {
                pending.insert(0, fault);
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(2000..5000))).await;
            continue;
        }
        *injected.entry(fault).or_default() += 1;
        match recovery_time(&api, Duration::from_secs(TTL_SECONDS + 25)).await {
            Some(took) => {
                eprintln!("    recovered in {took:?}");
                longest_recovery = longest_recovery.max(took);
            }
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
            "{t}: has waiters but no holder, or a free permit a claim waits for, {limit:?} after the faults stopped"
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
    let lost_at: Vec<(std::time::SystemTime, Duration)> = {
        let (now, wall) = (Instant::now(), std::time::SystemTime::now());
        world
            .data_lost
            .lock()
            .unwrap()
            .iter()
            .map(|(at, window)| (wall - (now - *at), *window))
            .collect()
    };
    let (commands, command_peaks) = check_commands(&checker, runs_dir.path(), &lost_at);

    let violations = checker.violations.lock().unwrap().clone();
    let store = match setup.store {
        StoreKind::Sentinel => "Valkey through 3 sentinels (1 primary, 2 replicas)",
        StoreKind::Etcd => "etcd, 3 members",
        StoreKind::Proxied => "Valkey behind a TCP proxy",
    };
    println!(
        "chaos summary of {} ({seconds} s of faults, 2 controller replicas, {store}, {TARGETS} targets with permits {PERMITS:?}, ttl {TTL_SECONDS} s):",
        setup.name
    );
    for (fault, n) in &injected {
        println!("  faults injected: {fault:?} x{n}");
    }
    for (fault, n) in &skipped {
        println!("  faults skipped: {fault:?} x{n}");
    }
    if setup.store == StoreKind::Sentinel {
        println!(
            "  Sentinel failovers: {}, longest until every sentinel named the new primary: {:?}",
            world.failovers.len(),
            world.failovers.iter().max().copied().unwrap_or_default()
        );
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
        "  moments checked against the permits bound: {}, above it within two TTLs of a data loss: {}",
        checker.moments.load(Ordering::Relaxed),
        checker.excused.load(Ordering::Relaxed)
    );
    let peaks = checker.peaks.lock().unwrap().clone();
    println!("  most resources shown Held at once, per target: {peaks:?}");
    println!(
        "  claims that waited with PermitsConflict: {}",
        checker.conflicts.lock().unwrap().len()
    );
    println!(
        "  commits accepted: {}, refused: {}",
        checker.accepted.load(Ordering::Relaxed),
        checker.refused.load(Ordering::Relaxed)
    );
    println!(
        "  run holders' commands: {commands}; most running at once, per run target: {command_peaks:?}"
    );
    println!("  longest recovery after a fault: {longest_recovery:?}");
    println!("  settled after the faults in {:?}", settle.elapsed());
    println!("  violations: {}", violations.len());
    for fault in &setup.required {
        assert!(
            injected.contains_key(fault),
            "{fault:?} was never injected: the run proves nothing about it"
        );
    }
    assert!(!injected.is_empty(), "no fault was injected");
    assert!(
        checker.accepted.load(Ordering::Relaxed) > 0,
        "no holder ever committed: the run proves nothing"
    );
    let shared_peak = peaks
        .iter()
        .filter(|(t, _)| t.starts_with("target-"))
        .map(|(_, n)| *n)
        .max()
        .unwrap_or(0);
    assert!(
        shared_peak >= 2,
        "no target ever showed two holders at once: the permits were never used"
    );
    assert!(
        peaks.get("run-1").is_some_and(|n| *n >= 2),
        "the run target with permits never had two `run`s holding at once"
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

/// Leases in the store whose lease id is not the uid of a live TargetLease.
async fn leaked_leases(world: &World, api: &Api<TargetLease>) -> Vec<String> {
    let Ok(list) = api.list(&ListParams::default()).await else {
        return vec!["(list failed)".into()];
    };
    let live: HashSet<String> = list.items.iter().filter_map(|l| l.uid()).collect();
    if let Valkey::Etcd(etcd) = &world.valkey {
        let ns = world.ns;
        let records =
            tokio::task::block_in_place(|| etcd.under(&format!("{ETCD_PREFIX}/targets/{ns}/")));
        let mut leaked = Vec::new();
        for (key, value) in records {
            let Ok(record) = serde_json::from_slice::<serde_json::Value>(&value) else {
                leaked.push(format!("{key} (unreadable)"));
                continue;
            };
            let slots = record["records"]["slots"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            for (slot, state) in slots {
                if let Some(id) = state["lease"]["lease_id"].as_str()
                    && !live.contains(id)
                {
                    leaked.push(format!("{key} slot {slot}"));
                }
            }
        }
        return leaked;
    }
    let Some(port) = world.primary_port() else {
        return vec!["(no primary named)".into()];
    };
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
        return vec!["(valkey unreachable)".into()];
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return vec!["(valkey unreachable)".into()];
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("tl:{{{}/*}}:lease", world.ns))
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

/// The suite's chaos runs, one after the other on one control plane, started only when one of
/// them is wanted.
pub fn suite(args: &Arguments) -> Conclusion {
    let mut args = args.clone();
    // One after the other: they share the control plane (its crashes) and the two cores.
    args.test_threads = Some(1);
    let cluster: Arc<std::sync::OnceLock<Arc<Cluster>>> = Arc::default();
    let trials = Setup::all()
        .into_iter()
        .map(|setup| {
            let cluster = cluster.clone();
            let limit = Duration::from_secs(setup.seconds + 300);
            let ignored = setup.faults.is_empty();
            suite::trial_with_limit(setup.name, limit, move || {
                // Started outside the trial's time limit (see `shared_control_plane`).
                let cluster = shared_control_plane(&cluster);
                async move { chaos(cluster, setup).await }
            })
            .with_ignored_flag(ignored)
        })
        .collect();
    let conclusion = suite::run(&args, trials);
    drop(cluster);
    conclusion
}
