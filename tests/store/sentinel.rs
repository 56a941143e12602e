//! The lease store through Sentinel, on real servers: one primary, two replicas and three
//! sentinels on loopback ports (Valkey 9.1; TLS with client certificates on Redis 7.0), built per
//! test. The whole contract passes through Sentinel as the documented ACL users (data and
//! sentinel). A planned failover (`SENTINEL FAILOVER`), a SIGKILL of the primary and a SIGSTOP of
//! it past `down-after-milliseconds` happen under a workload: every call succeeds or fails
//! retryably within its deadline, every token granted after the failover is above every token
//! granted before it (the workload passes no floor: the server's token rule alone keeps them
//! growing), no pooled connection is left on the old primary, a grant confirmed with
//! `durability replicas=1` survives the kill, and an isolated primary refuses writes
//! (`min-replicas-to-write 1`). Sentinels that name a replica, never answer, are down, refuse
//! the password or do not know the name are each tested. A missing server binary fails.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use targetlease::redact::{Secret, SecretUrl};
use targetlease::store::valkey::{
    ClientCertificate, DEFAULT_CALL_TIMEOUT, DEFAULT_SENTINEL_POLL_INTERVAL, Durability, Endpoints,
    HostPort, PasswordSource, Sentinels, TlsConfig, ValkeyConfig, ValkeyStore,
};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, ErrorKind, LeaseId, LeaseStore, Owner, Permits, ReleaseOutcome,
    RequestId, StoreError, TargetRef, Ttl,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::admin::Admin;
use support::contract_cases::{
    self, Harness, RawAccess, ServerEnv, TTL, Variant, handle, release_req, target,
};
use support::sentinel::{DOWN_AFTER, MASTER, Options, Topology, text};
use support::server::{Server, ServerKind};
use support::suite::{self, measured, trial, trial_with_limit};
use support::tls::Certs;

const USER: &str = "targetlease";
const PASSWORD: &str = "sentinel-data-pw-5e2a";
const SENTINEL_USER: &str = "targetlease-sentinel";
const SENTINEL_PASSWORD: &str = "sentinel-pw-93c1";
/// Short, so that a grant lost in a failover frees its target soon.
const WORKLOAD_TTL: Duration = Duration::from_secs(2);

/// Starts a topology and adds the documented ACL users: the data user on every data node (ACL
/// rules are per node), the sentinel user on every sentinel.
async fn topology(options: Options) -> Topology {
    tokio::task::spawn_blocking(move || {
        let redis70 = options.kind == ServerKind::Redis70;
        let topology = Topology::start(options);
        let data = support::documented_acl_rule("acl-rule", USER, PASSWORD);
        // As the docs say: Redis 7.0 has neither CLIENT SETINFO nor WAITAOF.
        let data: Vec<&str> = data
            .iter()
            .map(String::as_str)
            .filter(|w| !(redis70 && ["+client|setinfo", "+waitaof"].contains(w)))
            .collect();
        topology.on_every_node(&data);
        let sentinel =
            support::documented_acl_rule("sentinel-acl-rule", SENTINEL_USER, SENTINEL_PASSWORD);
        let sentinel: Vec<&str> = sentinel.iter().map(String::as_str).collect();
        topology.sentinel_acl(SENTINEL_USER, &sentinel[3..]);
        topology
    })
    .await
    .expect("start the sentinel topology")
}

fn addrs(topology: &Topology) -> Vec<HostPort> {
    topology
        .sentinel_addrs()
        .iter()
        .map(|a| a.parse().expect("sentinel address"))
        .collect()
}

/// The store's settings: the sentinels (as given), the master name, both ACL users.
fn config_for(sentinels: Vec<HostPort>) -> ValkeyConfig {
    let mut config = ValkeyConfig::sentinel(Sentinels {
        addrs: sentinels,
        master: MASTER.into(),
        username: Some(SENTINEL_USER.into()),
        password: Some(PasswordSource::Value(Secret::new(SENTINEL_PASSWORD))),
        poll_interval: DEFAULT_SENTINEL_POLL_INTERVAL,
    });
    config.username = Some(USER.into());
    config.password = Some(PasswordSource::Value(Secret::new(PASSWORD)));
    config
}

async fn sentinel_env() -> ServerEnv {
    // The contract never fails over: no need to wait for the sentinels to meet.
    let options = Options {
        failover_ready: false,
        ..Options::plain(ServerKind::Valkey91)
    };
    let topology = topology(options).await;
    let primary = topology.nodes[0].port;
    let admin = Admin::single(&format!("redis://127.0.0.1:{primary}"), None).await;
    ServerEnv {
        kind: ServerKind::Valkey91,
        config: config_for(addrs(&topology)),
        admin,
        raw: Some(RawAccess {
            port: primary,
            password: None,
        }),
        keep: vec![Box::new(topology)],
    }
}

async fn connect(config: ValkeyConfig) -> Arc<dyn LeaseStore> {
    Arc::new(
        ValkeyStore::connect(config)
            .await
            .unwrap_or_else(|e| panic!("connect through the sentinels: {e}")),
    )
}

/// What one call of the workload did.
struct Call {
    started: Instant,
    took: Duration,
    failed: Option<StoreError>,
}

/// What one worker saw on its target.
#[derive(Default)]
struct Seen {
    /// Tokens granted, with when each grant returned.
    grants: Vec<(Instant, u64)>,
    calls: Vec<Call>,
    /// Grants answered `acquired` that a release right after found gone (lost in the failover).
    lost_grants: usize,
}

/// One worker's loop on one target: acquire with no floor (min_token 0: the server's token rule
/// alone must keep tokens growing), release, again; a failed call is retried with its request id.
async fn workload(store: Arc<dyn LeaseStore>, t: TargetRef, until: Instant) -> Seen {
    let mut seen = Seen::default();
    let mut round = 0u64;
    while Instant::now() < until {
        round += 1;
        let lease = format!("lease-{round}");
        let req = AcquireRequest {
            target: t.clone(),
            lease_id: LeaseId::new(lease.clone()).expect("lease id"),
            owner: Owner::new("worker").expect("owner"),
            permits: Permits::ONE,
            ttl: Ttl::new(WORKLOAD_TTL).expect("ttl"),
            min_token: 0,
            request_id: RequestId::random(),
        };
        let token = loop {
            let started = Instant::now();
            let outcome = store.acquire(&req).await;
            let took = started.elapsed();
            match outcome {
                Ok(AcquireOutcome::Acquired(g)) => {
                    seen.calls.push(Call {
                        started,
                        took,
                        failed: None,
                    });
                    seen.grants.push((Instant::now(), g.token));
                    break Some(g.token);
                }
                // A release lost in the failover: the promoted replica still has the lease
                // until its TTL ends.
                Ok(AcquireOutcome::Held { .. }) => {
                    seen.calls.push(Call {
                        started,
                        took,
                        failed: None,
                    });
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                // A retry of a grant that ran but was not answered (a timeout, or a durable
                // acquire not confirmed) and has ended since: the next round asks anew.
                Ok(AcquireOutcome::Expired { .. }) => {
                    seen.calls.push(Call {
                        started,
                        took,
                        failed: None,
                    });
                    break None;
                }
                Ok(other) => panic!("{t}: unexpected {other:?}"),
                Err(e) => {
                    seen.calls.push(Call {
                        started,
                        took,
                        failed: Some(e),
                    });
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        let Some(token) = token else {
            continue;
        };
        let release = release_req(handle(&t, &lease, "worker", token));
        loop {
            let started = Instant::now();
            let outcome = store.release(&release).await;
            let took = started.elapsed();
            match outcome {
                Ok(released) => {
                    seen.calls.push(Call {
                        started,
                        took,
                        failed: None,
                    });
                    if released == ReleaseOutcome::NotHolder {
                        seen.lost_grants += 1;
                    }
                    break;
                }
                Err(e) => {
                    seen.calls.push(Call {
                        started,
                        took,
                        failed: Some(e),
                    });
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    seen
}

/// Runs `workers` workers for `length`, calling `fault` (on a blocking thread, while they run)
/// after `fault_after`; answers what each saw, when the fault was called and what it answered.
async fn under_workload<F, R>(
    store: Arc<dyn LeaseStore>,
    name: &str,
    workers: usize,
    length: Duration,
    fault_after: Duration,
    fault: F,
) -> (Vec<(TargetRef, Seen)>, Instant, R)
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let targets: Vec<TargetRef> = (0..workers)
        .map(|i| target(&format!("{name}-{i}")))
        .collect();
    let until = Instant::now() + length;
    let handles: Vec<_> = targets
        .iter()
        .map(|t| tokio::spawn(workload(store.clone(), t.clone(), until)))
        .collect();
    tokio::time::sleep(fault_after).await;
    let at = Instant::now();
    let answer = tokio::task::spawn_blocking(fault).await.expect("fault");
    let mut all = Vec::new();
    for (t, h) in targets.into_iter().zip(handles) {
        all.push((t, h.await.expect("worker")));
    }
    (all, at, answer)
}

/// The guarantees every failover test checks on the workload's history: every call ended
/// within its deadline and every failure was retryable (`unavailable`, or `timeout` when
/// one of the kinds in `also`: `timeout` for a call on a stopped server, which may have run,
/// `not_durable` for an acquire on a primary whose replica left); tokens strictly grew on every
/// target, and every token granted after `fault` (plus `settled`) is above every token of every
/// target granted before it. Answers the longest time between two successful calls spanning
/// the fault.
fn check_history(
    history: &[(TargetRef, Seen)],
    fault: Instant,
    deadline: Duration,
    also: &[ErrorKind],
) -> Duration {
    let slack = Duration::from_millis(300);
    let mut failures: BTreeMap<&str, usize> = BTreeMap::new();
    for (t, seen) in history {
        for call in &seen.calls {
            assert!(
                call.took <= deadline + slack,
                "{t}: a call took {:?}, beyond its {deadline:?} deadline",
                call.took
            );
            if let Some(e) = &call.failed {
                let kind = e.kind();
                let retryable = kind == ErrorKind::Unavailable || also.contains(&kind);
                assert!(retryable, "{t}: a call failed {}: {e}", kind.as_str());
                *failures.entry(kind.as_str()).or_default() += 1;
            }
        }
        assert!(
            seen.grants.len() > 3,
            "{t}: only {} grants",
            seen.grants.len()
        );
        for pair in seen.grants.windows(2) {
            assert!(
                pair[1].1 > pair[0].1,
                "{t}: token {} after {}",
                pair[1].1,
                pair[0].1
            );
        }
    }
    let before = history
        .iter()
        .flat_map(|(_, s)| s.grants.iter())
        .filter(|(at, _)| *at < fault)
        .map(|(_, token)| *token)
        .max()
        .expect("grants before the fault");
    // Calls in flight at the fault may still return tokens of the old primary.
    let after: Vec<u64> = history
        .iter()
        .flat_map(|(_, s)| s.grants.iter())
        .filter(|(at, _)| *at > fault + deadline + slack)
        .map(|(_, token)| *token)
        .collect();
    assert!(
        after.len() > 3,
        "only {} grants after the failover",
        after.len()
    );
    if let Some(low) = after.iter().min() {
        assert!(
            *low > before,
            "a token granted after the failover ({low}) is not above one granted before ({before})"
        );
    }
    let lost: usize = history.iter().map(|(_, s)| s.lost_grants).sum();
    let granted: usize = history.iter().map(|(_, s)| s.grants.len()).sum();
    eprintln!(
        "failed calls by kind: {failures:?}; grants lost in the failover: {lost} of {granted}"
    );
    history
        .iter()
        .flat_map(|(_, s)| {
            let ok: Vec<Instant> = s
                .calls
                .iter()
                .filter(|c| c.failed.is_none())
                .map(|c| c.started + c.took)
                .collect();
            ok.windows(2)
                .filter(|w| w[1] > fault && w[0] <= fault + Duration::from_secs(30))
                .map(|w| w[1].duration_since(w[0]))
                .collect::<Vec<_>>()
        })
        .max()
        .unwrap_or_default()
}

/// How many connections of the store's data user the server on `port` has (`CLIENT LIST`;
/// Redis 7.0 knows no client library names).
fn our_connections(topology: &Topology, port: u16) -> usize {
    let list = topology
        .query(port, &["CLIENT", "LIST"])
        .unwrap_or_else(|e| panic!("CLIENT LIST on {port}: {e}"));
    text(&list)
        .lines()
        .filter(|l| l.contains(&format!(" user={USER} ")))
        .count()
}

/// How long after the sentinels name the new primary the store has dropped every pooled
/// connection to the old one: one poll interval, and a little for the calls to reconnect.
const SWITCHED: Duration = Duration::from_millis(1_500);

async fn planned_failover_under_a_workload() {
    planned_failover(Options::plain(ServerKind::Valkey91), Durability::NONE).await;
}

/// The settings docs/operations.md recommends: a primary refuses writes without a replica in
/// sync, and an acquire waits for one replica's AOF.
async fn planned_failover_with_the_recommended_settings() {
    let options = Options {
        data_args: [
            "--appendonly",
            "yes",
            // WAITAOF waits for the replica's fsync: every write, not every second.
            "--appendfsync",
            "always",
            "--min-replicas-to-write",
            "1",
            "--min-replicas-max-lag",
            "1",
        ]
        .map(String::from)
        .to_vec(),
        ..Options::plain(ServerKind::Valkey91)
    };
    planned_failover(
        options,
        Durability {
            local: false,
            replicas: 1,
        },
    )
    .await;
}

async fn planned_failover(options: Options, durability: Durability) {
    let topology = Arc::new(topology(options).await);
    let mut config = config_for(addrs(&topology));
    config.durability = durability;
    let deadline = config.call_timeout;
    let store = connect(config).await;
    let old = topology.nodes[0].port;
    let t = topology.clone();
    let (history, fault, (switched, new, left_on_old, old_role)) = under_workload(
        store.clone(),
        "planned",
        8,
        Duration::from_secs(10),
        Duration::from_secs(2),
        move || {
            let started = Instant::now();
            t.failover();
            let new = t.wait_for_new_primary(old, Duration::from_secs(20));
            let switched = started.elapsed();
            // While the workload runs: the old primary still takes writes (Sentinel demotes it
            // seconds later), so only the store's own switch keeps the calls off it. Calls in
            // flight on a dropped connection end within their deadline (a durable acquire waits
            // there for a replica that has left).
            std::thread::sleep(SWITCHED + deadline);
            let old_role = t
                .query(old, &["ROLE"])
                .map(|r| text(&r))
                .unwrap_or_default();
            (switched, new, our_connections(&t, old), old_role)
        },
    )
    .await;
    measured(
        "sentinel: SENTINEL FAILOVER until every sentinel names the new primary",
        switched,
    );
    eprintln!(
        "old primary {:?} after the switch: ROLE {:?}",
        SWITCHED + deadline,
        old_role.lines().next()
    );
    assert_eq!(
        left_on_old,
        0,
        "{left_on_old} connection(s) still on the old primary {:?} after the sentinels named {new}",
        SWITCHED + deadline
    );
    // Only meaningful while the old primary still takes writes: once Sentinel demotes it, it
    // closes every client connection itself.
    assert!(
        old_role.starts_with("master"),
        "the old primary was demoted before the count ({old_role:?}): the count proves nothing"
    );
    // A durable acquire on the old primary waits in WAITAOF for a replica that has left, until
    // its deadline, and holds up the calls behind it on the same multiplexed connection: they
    // fail `timeout` (docs/operations.md, Sentinel).
    let also = if durability.is_none() {
        vec![]
    } else {
        vec![ErrorKind::NotDurable, ErrorKind::Timeout]
    };
    let outage = check_history(&history, fault, deadline, &also);
    measured(
        "sentinel: planned failover, longest pause between successful calls",
        outage,
    );
    assert!(
        our_connections(&topology, new) >= 1,
        "no connection on the new primary {new}"
    );
}

async fn primary_killed_under_a_workload() {
    let topology = Arc::new(std::sync::Mutex::new(
        topology(Options::plain(ServerKind::Valkey91)).await,
    ));
    let (config, old) = {
        let t = topology.lock().expect("topology");
        (config_for(addrs(&t)), t.nodes[0].port)
    };
    let deadline = config.call_timeout;
    let store = connect(config).await;
    let t = topology.clone();
    let (history, fault, (promoted, new)) = under_workload(
        store.clone(),
        "killed",
        8,
        Duration::from_secs(14),
        Duration::from_secs(2),
        move || {
            let started = Instant::now();
            let mut t = t.lock().expect("topology");
            t.node(old).kill();
            let new = t.wait_for_new_primary(old, Duration::from_secs(20));
            (started.elapsed(), new)
        },
    )
    .await;
    measured(
        "sentinel: SIGKILL of the primary until every sentinel names another",
        promoted,
    );
    let outage = check_history(&history, fault, deadline, &[]);
    measured(
        "sentinel: SIGKILL, longest pause between successful calls",
        outage,
    );
    assert!(
        outage >= DOWN_AFTER,
        "the kill did not interrupt the workload: {outage:?}"
    );
    let t = topology.lock().expect("topology");
    // The primary the sentinels name now: on a loaded machine they may have failed over once
    // more (down-after-milliseconds is 1 s), and the store follows whichever it is.
    let now = t.wait_for_new_primary(old, Duration::from_secs(10));
    if now != new {
        eprintln!("sentinel: a second failover moved the primary from {new} to {now}");
    }
    assert!(
        our_connections(&t, now) >= 1,
        "no connection on the primary {now} (promoted first: {new})"
    );
}

/// With `durability replicas=1`, a grant answered `acquired` was on a replica's disk: the
/// primary's death loses none of them. Without durability the loss is measured, not asserted.
async fn confirmed_grants_survive_a_killed_primary() {
    let options = Options {
        data_args: ["--appendonly", "yes", "--appendfsync", "always"]
            .map(String::from)
            .to_vec(),
        ..Options::plain(ServerKind::Valkey91)
    };
    let topology = Arc::new(std::sync::Mutex::new(topology(options).await));
    let (mut config, old) = {
        let t = topology.lock().expect("topology");
        (config_for(addrs(&t)), t.nodes[0].port)
    };
    config.durability = Durability {
        local: false,
        replicas: 1,
    };
    let store = connect(config).await;
    // Acquires of distinct targets, never released: each confirmed grant must be found after.
    let confirmed = Arc::new(std::sync::Mutex::new(Vec::<(TargetRef, u64)>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (store, confirmed, stop) = (store.clone(), confirmed.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    let t = target(&format!("durable-{w}-{i}"));
                    let req = contract_cases::acquire_req(&t, "l", "o", Duration::from_secs(120));
                    if let Ok(AcquireOutcome::Acquired(g)) = store.acquire(&req).await {
                        confirmed.lock().expect("confirmed").push((t, g.token));
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let killed_at = Instant::now();
    let before_kill: Vec<(TargetRef, u64)> = confirmed.lock().expect("confirmed").clone();
    tokio::task::block_in_place(|| topology.lock().expect("topology").node(old).kill());
    let new = tokio::task::block_in_place(|| {
        topology
            .lock()
            .expect("topology")
            .wait_for_new_primary(old, Duration::from_secs(20))
    });
    measured(
        "sentinel: SIGKILL until a new primary (durability replicas=1)",
        killed_at.elapsed(),
    );
    // Writes resume on the new primary.
    let resumed = Instant::now();
    let count = || confirmed.lock().expect("confirmed").len();
    let at_kill = count();
    while count() < at_kill + 20 {
        assert!(
            resumed.elapsed() < Duration::from_secs(20),
            "acquires did not resume on {new}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    measured(
        "sentinel: SIGKILL until durable acquires succeed again",
        killed_at.elapsed(),
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.expect("writer");
    }
    assert!(
        before_kill.len() > 20,
        "only {} grants before the kill",
        before_kill.len()
    );
    let mut lost = Vec::new();
    for (t, token) in &before_kill {
        let inspection = store.inspect(t).await.expect("inspect");
        if inspection.lease.as_ref().map(|l| l.token) != Some(*token) {
            lost.push((t.clone(), *token));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} grants confirmed with durability replicas=1 are gone after the failover: {:?}",
        lost.len(),
        before_kill.len(),
        &lost[..lost.len().min(5)]
    );
}

/// With `durability replicas=2`, a new connection counts the primary's replicas in sync: while
/// one is down, connects are refused (`unavailable`, naming the shortfall) rather than left to
/// run acquires that would wait in vain, and the store works again once the replica is back.
async fn durability_is_checked_against_the_primary_at_every_connect() {
    let options = Options {
        data_args: ["--appendonly", "yes"].map(String::from).to_vec(),
        ..Options::plain(ServerKind::Valkey91)
    };
    let mut topology = topology(options).await;
    let mut config = config_for(addrs(&topology));
    config.durability = Durability {
        local: false,
        replicas: 2,
    };
    let store = connect(config).await;
    let two = target("two");
    let held =
        contract_cases::acquired(&*store, &contract_cases::acquire_req(&two, "l", "o", TTL)).await;
    let primary = topology.nodes[0].port;
    let replica = topology.nodes[2].port;
    topology.node(replica).kill();
    tokio::task::block_in_place(|| {
        topology
            .query(primary, &["CLIENT", "KILL", "TYPE", "normal"])
            .expect("CLIENT KILL");
    });
    let e = store
        .acquire(&contract_cases::acquire_req(
            &target("one-short"),
            "l",
            "o",
            TTL,
        ))
        .await
        .expect_err("a connect to a primary with one replica of two");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        e.to_string().contains(&format!(
            "names 127.0.0.1:{primary}, which has 1 replica(s) online where the durability replicas=2 needs 2"
        )),
        "{e}"
    );
    // A renewal needs no replica: its connections are not refused.
    let renewed = store
        .renew(&contract_cases::renew_req(
            handle(&two, "l", "o", held.token),
            TTL,
        ))
        .await
        .expect("a renewal while a replica is short");
    assert!(
        matches!(renewed, targetlease::store::RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    tokio::task::block_in_place(|| {
        topology.node(replica).restart();
        let primary = &topology.nodes[0];
        assert!(topology.nodes[2].wait_in_sync_with(primary, Duration::from_secs(20)));
    });
    let back = Instant::now();
    let req = contract_cases::acquire_req(&target("two-again"), "l", "o", TTL);
    loop {
        match store.acquire(&req).await {
            Ok(AcquireOutcome::Acquired(_)) => break,
            Ok(other) => panic!("{other:?}"),
            Err(e) => assert!(back.elapsed() < Duration::from_secs(10), "not back: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SIGSTOP of the primary past `down-after-milliseconds`, then SIGCONT: for a while two servers
/// think they are the primary. With `min-replicas-to-write 1` the isolated one refuses every
/// write (its replicas follow the new primary), and the workload's tokens keep growing.
async fn stopped_primary_comes_back_isolated() {
    let options = Options {
        data_args: [
            "--min-replicas-to-write",
            "1",
            "--min-replicas-max-lag",
            "1",
        ]
        .map(String::from)
        .to_vec(),
        ..Options::plain(ServerKind::Valkey91)
    };
    let topology = Arc::new(topology(options).await);
    let config = config_for(addrs(&topology));
    let deadline = config.call_timeout;
    let store = connect(config).await;
    let old = topology.nodes[0].port;
    let pid = topology.nodes[0].pid();
    let t = topology.clone();
    let (history, fault, probes) = under_workload(
        store.clone(),
        "stopped",
        6,
        Duration::from_secs(14),
        Duration::from_secs(2),
        move || {
            let started = Instant::now();
            signal(pid, "STOP");
            let new = t.wait_for_new_primary(old, Duration::from_secs(20));
            assert_ne!(new, old);
            measured(
                "sentinel: SIGSTOP of the primary until every sentinel names another",
                started.elapsed(),
            );
            // Resumed while the workload runs: two servers think they are the primary until
            // Sentinel demotes the old one. Writes sent to it now must be refused.
            signal(pid, "CONT");
            let mut answers: BTreeMap<String, usize> = BTreeMap::new();
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until {
                let answer = match t.query(old, &["SET", "tl:isolated-probe", "x"]) {
                    Ok(reply) => format!("accepted: {}", text(&reply)),
                    Err(e) => e.code().unwrap_or("other error").to_owned(),
                };
                *answers.entry(answer).or_default() += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            answers
        },
    )
    .await;
    eprintln!("writes to the resumed old primary while the workload ran: {probes:?}");
    assert!(
        probes.keys().all(|answer| !answer.starts_with("accepted")),
        "the isolated primary took a write: {probes:?}"
    );
    assert!(
        probes.contains_key("NOREPLICAS"),
        "the old primary was never seen isolated (refusing with NOREPLICAS): {probes:?}"
    );
    // Acquires (as the data user, through the scripts) go straight to the old primary, as a
    // client that never asked the sentinels would send them.
    let mut direct =
        ValkeyConfig::new(SecretUrl::parse(&format!("redis://127.0.0.1:{old}")).expect("url"));
    direct.username = Some(USER.into());
    direct.password = Some(PasswordSource::Value(Secret::new(PASSWORD)));
    direct.call_timeout = Duration::from_millis(500);
    direct.reply_ttl = Duration::from_secs(60);
    let direct = ValkeyStore::new_lazy(direct).expect("direct store");
    let mut refusals: BTreeMap<String, usize> = BTreeMap::new();
    let until = Instant::now() + Duration::from_secs(3);
    let mut i = 0;
    while Instant::now() < until {
        i += 1;
        let t = target(&format!("isolated-{i}"));
        match direct
            .acquire(&contract_cases::acquire_req(&t, "l", "o", TTL))
            .await
        {
            Ok(AcquireOutcome::Acquired(g)) => panic!(
                "the isolated primary granted {t} token {} although it has no replica",
                g.token
            ),
            Ok(other) => panic!("{t}: unexpected {other:?}"),
            Err(e) => {
                let why = e.to_string();
                let what = if why.contains("min-replicas-to-write") {
                    "no replicas"
                } else if why.contains("read-only") {
                    "read-only replica"
                } else {
                    "other"
                };
                *refusals.entry(what.into()).or_default() += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // By now Sentinel may have demoted it (read-only): refused either way, never granted.
    eprintln!("acquires sent straight to the old primary after the workload: {refusals:?}");

    let outage = check_history(&history, fault, deadline, &[ErrorKind::Timeout]);
    measured(
        "sentinel: SIGSTOP of the primary, longest pause between successful calls",
        outage,
    );
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{sig} {pid}");
}

/// A fake sentinel on a loopback port: answers every command with `reply` (or never answers
/// when `None`), as many times as it is asked.
async fn fake_sentinel(reply: Option<String>) -> HostPort {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let reply = reply.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if let Some(reply) = &reply {
                        let _ = socket.write_all(reply.as_bytes()).await;
                    }
                }
            });
        }
    });
    HostPort {
        host: "127.0.0.1".into(),
        port,
    }
}

fn address_reply(port: u16) -> String {
    let port = port.to_string();
    format!("*2\r\n$9\r\n127.0.0.1\r\n${}\r\n{port}\r\n", port.len())
}

/// The store's settings with these sentinels and no sentinel user (the fakes take no AUTH, and
/// the real sentinels' default user has no password).
fn unauthenticated(sentinels: Vec<HostPort>) -> ValkeyConfig {
    let mut config = config_for(sentinels);
    if let Endpoints::Sentinel(s) = &mut config.endpoints {
        s.username = None;
        s.password = None;
    }
    config
}

async fn connect_fails(config: ValkeyConfig) -> StoreError {
    ValkeyStore::connect(config)
        .await
        .expect_err("no primary should be found")
}

/// Closes the store's connections on the primary (`CLIENT KILL TYPE normal`) and answers how
/// long an acquire of `name` then takes, reconnecting through the sentinels.
async fn reconnect_and_acquire(
    topology: &Topology,
    store: &dyn LeaseStore,
    name: &str,
) -> Duration {
    let primary = topology.nodes[0].port;
    tokio::task::block_in_place(|| {
        topology
            .query(primary, &["CLIENT", "KILL", "TYPE", "normal"])
            .expect("CLIENT KILL");
    });
    let started = Instant::now();
    contract_cases::acquired(
        store,
        &contract_cases::acquire_req(&target(name), "l", "o", TTL),
    )
    .await;
    started.elapsed()
}

/// A minority of misleading sentinels is outvoted; a sentinel that never answers costs a share
/// of the connect timeout, not the call (default timeouts), and is not asked first again.
async fn misleading_sentinels_are_outvoted() {
    let topology = topology(Options::plain(ServerKind::Valkey91)).await;
    let real = addrs(&topology);
    let (primary, replica) = (topology.nodes[0].port, topology.nodes[1].port);
    let names_a_replica = fake_sentinel(Some(address_reply(replica))).await;
    let never_answers = fake_sentinel(None).await;
    let mut sentinels = vec![names_a_replica.clone(), never_answers.clone()];
    sentinels.extend(real.clone());
    let started = Instant::now();
    let store = connect(unauthenticated(sentinels)).await;
    let took = started.elapsed();
    measured(
        "sentinel: connect past a sentinel naming a replica and a silent one",
        took,
    );
    assert!(took < DEFAULT_CALL_TIMEOUT, "the connect took {took:?}");
    let t = target("outvoted");
    contract_cases::acquired(&*store, &contract_cases::acquire_req(&t, "l", "o", TTL)).await;
    assert!(
        our_connections(&topology, primary) >= 1,
        "the store is not on the primary"
    );
    assert_eq!(
        our_connections(&topology, replica),
        0,
        "the store is on a replica"
    );
    // The silent one first, default timeouts: the store connects within one call, and once a
    // sentinel answered, reconnects no longer wait for the silent one.
    let mut silent_first = vec![never_answers.clone()];
    silent_first.extend(real.iter().cloned());
    let store = connect(unauthenticated(silent_first)).await;
    let took = reconnect_and_acquire(&topology, &*store, "silent").await;
    measured(
        "sentinel: reconnect with a silent sentinel listed first",
        took,
    );
    assert!(
        took < Duration::from_millis(300),
        "the reconnect asked the silent sentinel first again: {took:?}"
    );
    // A silent sentinel between answering ones: asked last once it was silent, so reconnects do
    // not wait for it again.
    let mut silent_between = vec![real[0].clone(), never_answers.clone()];
    silent_between.extend(real[1..].iter().cloned());
    let store = connect(unauthenticated(silent_between)).await;
    let took = reconnect_and_acquire(&topology, &*store, "silent-between").await;
    assert!(
        took < Duration::from_millis(300),
        "the reconnect waited for the silent sentinel again: {took:?}"
    );
    // A minority naming another server that is a primary too (the old primary of a failover,
    // cut off with a sentinel): outvoted, never connected to, although its role check passes.
    let other = tokio::task::spawn_blocking(|| Server::start(ServerKind::Valkey91))
        .await
        .expect("start another primary");
    let rule = support::documented_acl_rule("acl-rule", USER, PASSWORD);
    let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
    assert!(
        other.raw(&rule).starts_with("+OK"),
        "ACL user on the other primary"
    );
    let names_another_primary = fake_sentinel(Some(address_reply(other.port))).await;
    let mut outvoted = vec![names_another_primary];
    outvoted.extend(real.iter().cloned());
    let store = connect(unauthenticated(outvoted)).await;
    contract_cases::acquired(
        &*store,
        &contract_cases::acquire_req(&target("not-the-other"), "l", "o", TTL),
    )
    .await;
    let on_other = other.raw(&["CLIENT", "LIST"]);
    assert!(
        !on_other.contains(&format!(" user={USER} ")),
        "the store connected to the primary only a minority named: {on_other}"
    );
    // A sentinel that refuses the sentinel password is outvoted too; a majority refusing it
    // is access_denied, a minority refusing it beside unreachable ones unavailable.
    let wrongpass = "-WRONGPASS invalid username-password pair or user is disabled.\r\n";
    let refuses = fake_sentinel(Some(wrongpass.into())).await;
    let also_refuses = fake_sentinel(Some(wrongpass.into())).await;
    let mut one_refuses = vec![refuses.clone()];
    one_refuses.extend(real.iter().cloned());
    let store = connect(config_for(one_refuses)).await;
    contract_cases::acquired(
        &*store,
        &contract_cases::acquire_req(&target("one-refuses"), "l", "o", TTL),
    )
    .await;
    let dead = || HostPort {
        host: "127.0.0.1".into(),
        port: support::server::free_port(),
    };
    let e = connect_fails(config_for(vec![refuses.clone(), also_refuses, dead()])).await;
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    assert!(!e.to_string().contains(SENTINEL_PASSWORD), "{e}");
    let e = connect_fails(config_for(vec![refuses, dead(), dead()])).await;
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

/// Without a majority for one server, nothing is connected to, and the error names each
/// sentinel's answer; a majority naming a replica or an unreachable server is refused after the
/// role check or the connect; a name no majority monitors is a configuration error.
async fn no_majority_no_primary() {
    let topology = topology(Options::plain(ServerKind::Valkey91)).await;
    let real = addrs(&topology);
    let replica = topology.nodes[1].port;
    let names_a_replica = fake_sentinel(Some(address_reply(replica))).await;
    let also_names_the_replica = fake_sentinel(Some(address_reply(replica))).await;
    let never_answers = fake_sentinel(None).await;
    let names_nothing_there = fake_sentinel(Some(address_reply(1))).await;
    let also_nothing_there = fake_sentinel(Some(address_reply(1))).await;
    let unknown = fake_sentinel(Some("*-1\r\n".into())).await;
    let also_unknown = fake_sentinel(Some("*-1\r\n".into())).await;
    let dead = HostPort {
        host: "127.0.0.1".into(),
        port: support::server::free_port(),
    };

    let e = connect_fails(unauthenticated(vec![
        names_a_replica.clone(),
        never_answers.clone(),
        names_nothing_there.clone(),
    ]))
    .await;
    let message = e.to_string();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{message}");
    for says in [
        "no majority of the 3 sentinel(s) (2 needed) names one primary".to_owned(),
        format!("sentinel {names_a_replica}: named 127.0.0.1:{replica}"),
        format!("sentinel {never_answers}: no answer within"),
        format!("sentinel {names_nothing_there}: named 127.0.0.1:1"),
    ] {
        assert!(message.contains(&says), "{says:?} not in {message}");
    }
    assert!(!message.contains(PASSWORD), "{message}");

    let e = connect_fails(unauthenticated(vec![
        names_a_replica.clone(),
        also_names_the_replica,
        real[0].clone(),
    ]))
    .await;
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        e.to_string().contains(&format!(
            "majority names 127.0.0.1:{replica}, which answers role:slave"
        )),
        "{e}"
    );

    let e = connect_fails(unauthenticated(vec![
        names_nothing_there,
        also_nothing_there,
        real[0].clone(),
    ]))
    .await;
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        e.to_string()
            .contains("majority names 127.0.0.1:1, which failed"),
        "{e}"
    );

    for alone in [
        vec![unknown.clone()],
        vec![unknown.clone(), also_unknown.clone(), dead.clone()],
    ] {
        let e = connect_fails(unauthenticated(alone)).await;
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
        assert!(
            e.to_string()
                .contains(&format!("monitors no primary named \"{MASTER}\"")),
            "{e}"
        );
    }
    // Data ports listed as sentinels: they do not know SENTINEL, a configuration to fix.
    let data_ports: Vec<HostPort> = topology
        .nodes
        .iter()
        .map(|n| HostPort {
            host: "127.0.0.1".into(),
            port: n.port,
        })
        .collect();
    let e = connect_fails(unauthenticated(data_ports)).await;
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains("are these sentinels"), "{e}");
    // One sentinel that does not know the name, the others unreachable: it may be restarting.
    let other_dead = HostPort {
        host: "127.0.0.1".into(),
        port: support::server::free_port(),
    };
    let e = connect_fails(unauthenticated(vec![unknown, dead, other_dead])).await;
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

async fn sentinels_down_wrong_password_and_unknown_name() {
    let mut topology = topology(Options::plain(ServerKind::Valkey91)).await;
    let sentinels = addrs(&topology);
    // A store already running loses the sentinel it asked last, then its connections.
    let store = connect(config_for(sentinels.clone())).await;
    topology.sentinels[0].kill();
    tokio::task::block_in_place(|| {
        let primary = topology.nodes[0].port;
        topology
            .query(primary, &["CLIENT", "KILL", "TYPE", "normal"])
            .expect("CLIENT KILL");
    });
    contract_cases::acquired(
        &*store,
        &contract_cases::acquire_req(&target("one-down"), "l", "o", TTL),
    )
    .await;
    // A new store with one of three sentinels down.
    let store = connect(config_for(sentinels.clone())).await;
    contract_cases::acquired(
        &*store,
        &contract_cases::acquire_req(&target("one-down-new"), "l", "o", TTL),
    )
    .await;
    // A wrong sentinel password is access_denied, on every sentinel that answers.
    let mut wrong = config_for(sentinels.clone());
    if let Endpoints::Sentinel(s) = &mut wrong.endpoints {
        s.addrs.remove(0);
        s.password = Some(PasswordSource::Value(Secret::new("not-the-password")));
    }
    let e = ValkeyStore::connect(wrong)
        .await
        .expect_err("wrong sentinel password");
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    assert!(!e.to_string().contains("not-the-password"), "{e}");
    // The data password is checked on the primary the sentinels name.
    let mut wrong_data = config_for(sentinels.clone());
    wrong_data.password = Some(PasswordSource::Value(Secret::new("not-the-data-password")));
    let e = ValkeyStore::connect(wrong_data)
        .await
        .expect_err("wrong data password");
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    // A master name the sentinels do not monitor.
    let mut unknown = config_for(sentinels.clone());
    if let Endpoints::Sentinel(s) = &mut unknown.endpoints {
        s.master = "not-monitored".into();
    }
    let e = ValkeyStore::connect(unknown)
        .await
        .expect_err("unknown master");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains("\"not-monitored\""), "{e}");
    // Every sentinel down: the error names each of them.
    for s in &mut topology.sentinels {
        s.kill();
    }
    let e = ValkeyStore::connect(config_for(sentinels.clone()))
        .await
        .expect_err("all down");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    for s in &sentinels {
        assert!(
            e.to_string()
                .contains(&format!("sentinel {s}: connection refused")),
            "{e}"
        );
    }
}

/// TLS with client certificates on sentinels and data nodes (Redis 7.0): connects, follows a
/// planned failover, checks every certificate against the TLS server name when one is set,
/// and names a wrong CA as a TLS failure.
async fn tls_sentinels_and_failover() {
    let certs = Arc::new(Certs::generate());
    let options = Options {
        tls: Some(certs.clone()),
        ..Options::plain(ServerKind::Redis70)
    };
    let topology = topology(options).await;
    let tls = TlsConfig {
        ca_file: Some(certs.path("ca.crt")),
        client: Some(ClientCertificate {
            cert_file: certs.path("client.crt"),
            key_file: certs.path("client.key"),
        }),
        server_name: None,
        insecure: false,
    };
    let mut config = config_for(addrs(&topology));
    config.tls = Some(tls.clone());
    config.connect_timeout = Duration::from_secs(5);
    let store = connect(config.clone()).await;
    let t = target("tls");
    let first =
        contract_cases::acquired(&*store, &contract_cases::acquire_req(&t, "l1", "o", TTL)).await;
    let old = topology.nodes[0].port;
    tokio::task::block_in_place(|| topology.failover());
    let new =
        tokio::task::block_in_place(|| topology.wait_for_new_primary(old, Duration::from_secs(20)));
    tokio::time::sleep(SWITCHED).await;
    let release = release_req(handle(&t, "l1", "o", first.token));
    let started = Instant::now();
    loop {
        match store.release(&release).await {
            Ok(_) => break,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "no release after the failover: {e}"
                );
            }
        }
    }
    let second =
        contract_cases::acquired(&*store, &contract_cases::acquire_req(&t, "l2", "o", TTL)).await;
    assert!(second.token > first.token);
    assert!(our_connections(&topology, new) >= 1);
    assert_eq!(our_connections(&topology, old), 0);
    // Every node checked against one name (the certificates carry valkey.test).
    let mut named = config.clone();
    named.tls = Some(TlsConfig {
        server_name: Some("valkey.test".into()),
        ..tls.clone()
    });
    let store = connect(named).await;
    contract_cases::acquired(
        &*store,
        &contract_cases::acquire_req(&target("named"), "l", "o", TTL),
    )
    .await;
    let mut mismatch = config.clone();
    mismatch.tls = Some(TlsConfig {
        server_name: Some("other.test".into()),
        ..tls.clone()
    });
    let e = ValkeyStore::connect(mismatch)
        .await
        .expect_err("server name mismatch");
    assert_eq!(e.kind(), ErrorKind::Tls, "{e}");
    let mut wrong_ca = config.clone();
    wrong_ca.tls = Some(TlsConfig {
        ca_file: Some(certs.path("other-ca.crt")),
        ..tls.clone()
    });
    let e = ValkeyStore::connect(wrong_ca).await.expect_err("wrong CA");
    assert_eq!(e.kind(), ErrorKind::Tls, "{e}");
    assert!(e.to_string().contains("unknown CA"), "{e}");
    let mut no_client_cert = config;
    no_client_cert.tls = Some(TlsConfig {
        client: None,
        ..tls
    });
    let e = ValkeyStore::connect(no_client_cert)
        .await
        .expect_err("mTLS without a certificate");
    assert_eq!(e.kind(), ErrorKind::Tls, "{e}");
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let variants = [Variant {
        name: "valkey-9.1-sentinel",
        make: || Box::pin(async { Harness::server(sentinel_env().await).await }),
        admin: true,
        raw: true,
    }];
    let mut trials = contract_cases::trials(&variants);
    let long = Duration::from_secs(240);
    trials.extend([
        trial_with_limit(
            "sentinel::planned_failover_under_a_workload",
            long,
            planned_failover_under_a_workload,
        ),
        trial_with_limit(
            "sentinel::planned_failover_with_the_recommended_settings",
            long,
            planned_failover_with_the_recommended_settings,
        ),
        trial_with_limit(
            "sentinel::primary_killed_under_a_workload",
            long,
            primary_killed_under_a_workload,
        ),
        trial_with_limit(
            "sentinel::confirmed_grants_survive_a_killed_primary",
            long,
            confirmed_grants_survive_a_killed_primary,
        ),
        trial_with_limit(
            "sentinel::durability_is_checked_against_the_primary_at_every_connect",
            long,
            durability_is_checked_against_the_primary_at_every_connect,
        ),
        trial_with_limit(
            "sentinel::stopped_primary_comes_back_isolated",
            long,
            stopped_primary_comes_back_isolated,
        ),
        trial(
            "sentinel::misleading_sentinels_are_outvoted",
            misleading_sentinels_are_outvoted,
        ),
        trial("sentinel::no_majority_no_primary", no_majority_no_primary),
        trial(
            "sentinel::sentinels_down_wrong_password_and_unknown_name",
            sentinels_down_wrong_password_and_unknown_name,
        ),
        trial_with_limit(
            "sentinel::tls_sentinels_and_failover",
            long,
            tls_sentinels_and_failover,
        ),
    ]);
    suite::run(args, trials)
}
