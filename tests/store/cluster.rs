//! The lease store on a real Valkey Cluster (Valkey 9.1: three primaries, three replicas on
//! loopback ports, built per test): the contract passes on it as the documented ACL user, a
//! target's keys share one slot, and killing a primary (SIGKILL) during a workload ends, after
//! its replica is promoted, with every operation succeeding again and tokens still strictly
//! larger than any issued before. A missing server binary fails the suite.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};

use std::sync::Arc;
use std::time::{Duration, Instant};

use targetlease::redact::{Secret, SecretUrl};
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::{PasswordSource, ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, LeaseId, LeaseStore, Owner, Permits, ReleaseOutcome, RequestId,
    Slot, TargetRef, Ttl,
};

use support::admin::Admin;
use support::cluster::Cluster;
use support::contract_cases::{
    self, Harness, ServerEnv, TTL, Variant, guarded, handle, release_req, target,
};
use support::server::ServerKind;
use support::suite::{self, measured, trial};

const USER: &str = "targetlease";
/// Short, so that a lease whose release was lost in the failover frees the target soon.
const WORKLOAD_TTL: Duration = Duration::from_secs(2);
const PASSWORD: &str = "cluster-pw-71d3";

/// The documented ACL rule, set on every node (ACLs are per node in a cluster).
fn add_acl_user(cluster: &Cluster) {
    let rule = support::documented_acl_rule("acl-rule", USER, PASSWORD);
    let args: Vec<&str> = rule.iter().map(String::as_str).collect();
    for node in &cluster.nodes {
        let reply = node.raw(&args);
        assert!(reply.starts_with("+OK"), "{reply}");
    }
}

fn store_config(cluster: &Cluster) -> ValkeyConfig {
    let seeds = cluster
        .seeds()
        .iter()
        .map(|s| SecretUrl::parse(s).expect("seed URL"))
        .collect();
    let mut config = ValkeyConfig::cluster(seeds);
    config.username = Some(USER.into());
    config.password = Some(PasswordSource::Value(Secret::new(PASSWORD)));
    // One cluster client per store: the contract opens a hundred stores at once.
    config.pool_size = 1;
    config
}

async fn cluster_env() -> ServerEnv {
    let cluster = tokio::task::spawn_blocking(|| Cluster::start(ServerKind::Valkey91, &[]))
        .await
        .expect("start cluster");
    add_acl_user(&cluster);
    let admin = Admin::cluster(&cluster.seeds()).await;
    ServerEnv {
        kind: ServerKind::Valkey91,
        config: store_config(&cluster),
        admin,
        raw: None,
        keep: vec![Box::new(cluster)],
    }
}

async fn keys_of_a_target_share_one_slot() {
    let mut cluster = tokio::task::spawn_blocking(|| Cluster::start(ServerKind::Valkey91, &[]))
        .await
        .expect("start cluster");
    let mut slots_seen = Vec::new();
    for name in ["orders-db/migration", "a", "b:c/d", "x.y_z-1"] {
        let t = target(name);
        let keys = TargetKeys::new("tl", &t);
        let request = RequestId::new("r-1").expect("request id");
        let all = [
            keys.lease(),
            keys.fence(),
            keys.reply(&request),
            keys.guarded("data"),
        ];
        let slots: Vec<u16> = all.iter().map(|k| cluster.keyslot(k)).collect();
        assert!(
            slots.iter().all(|s| *s == slots[0]),
            "{name}: {all:?} -> {slots:?}"
        );
        slots_seen.push(slots[0]);
    }
    slots_seen.sort_unstable();
    slots_seen.dedup();
    assert!(
        slots_seen.len() > 1,
        "the targets should not all land in one slot"
    );
    // And the scripts run there: one acquire and commit per target on the real cluster.
    add_acl_user(&cluster);
    let store = ValkeyStore::connect(store_config(&cluster))
        .await
        .expect("connect");
    for name in ["orders-db/migration", "a", "b:c/d", "x.y_z-1"] {
        let t = target(name);
        let g =
            contract_cases::acquired(&store, &contract_cases::acquire_req(&t, "l", "o", TTL)).await;
        let committed = store
            .commit(&contract_cases::commit_req(&t, g.token, "v"))
            .await
            .expect("commit");
        assert!(matches!(
            committed,
            targetlease::store::CommitOutcome::Committed { .. }
        ));
    }
}

/// What one worker saw.
#[derive(Default)]
struct Seen {
    /// Tokens granted, in order.
    tokens: Vec<u64>,
    /// When each successful call returned.
    successes: Vec<Instant>,
    /// Calls that failed (and were retried).
    errors: usize,
}

/// One worker's loop on one target: acquire (with the highest token seen as floor, as the
/// controller does), release, again; each call retried with its request id until it succeeds.
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
            min_token: seen.tokens.last().copied().unwrap_or(0),
            request_id: RequestId::random(),
        };
        let token = loop {
            match store.acquire(&req).await {
                Ok(AcquireOutcome::Acquired(g)) => {
                    seen.successes.push(Instant::now());
                    break g.token;
                }
                // A release acknowledged by a primary that died before replicating it: the
                // promoted replica still has the old lease until its TTL ends (asynchronous
                // replication; see docs/internals/store.md). Wait for it.
                Ok(AcquireOutcome::Held { .. }) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(AcquireOutcome::Expired { token }) => {
                    panic!("a fresh request id was answered as a retry of token {token}")
                }
                Ok(AcquireOutcome::PermitsConflict { in_force }) => {
                    panic!("one permit asked, yet permits {in_force} are in force")
                }
                Err(_) => {
                    seen.errors += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        seen.tokens.push(token);
        let release = release_req(handle(&t, &lease, "worker", token));
        loop {
            match store.release(&release).await {
                // Not the holder: the release ran on a primary that died before replicating
                // the grant; there is nothing left to release.
                Ok(ReleaseOutcome::Released | ReleaseOutcome::NotHolder) => {
                    seen.successes.push(Instant::now());
                    break;
                }
                Err(_) => {
                    seen.errors += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    seen
}

async fn primary_killed_during_a_workload() {
    let mut cluster = tokio::task::spawn_blocking(|| Cluster::start(ServerKind::Valkey91, &[]))
        .await
        .expect("start cluster");
    add_acl_user(&cluster);
    let store: Arc<dyn LeaseStore> = Arc::new(
        ValkeyStore::connect(store_config(&cluster))
            .await
            .expect("connect"),
    );
    // Targets on every primary; the victim is the primary of the first one.
    let targets: Vec<TargetRef> = (0..9).map(|i| target(&format!("failover-{i}"))).collect();
    let slot = cluster.keyslot(&TargetKeys::new("tl", &targets[0]).fence());
    let victim = cluster.primary_of_slot(slot);
    let until = Instant::now() + Duration::from_secs(12);
    let workers: Vec<_> = targets
        .iter()
        .map(|t| tokio::spawn(workload(store.clone(), t.clone(), until)))
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Tokens issued before the kill, per target, as the admin sees them on the cluster.
    let killed_at = Instant::now();
    cluster.nodes[victim].kill();
    let mut promoted_after = None;
    while promoted_after.is_none() && killed_at.elapsed() < Duration::from_secs(20) {
        let now_primary = tokio::task::block_in_place(|| cluster.primary_of_slot_if_any(slot));
        if now_primary.is_some_and(|p| p != victim) {
            promoted_after = Some(killed_at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let promoted_after = promoted_after.expect("the replica was promoted within 20 s");
    measured(
        "cluster: SIGKILL of a primary until its replica is primary",
        promoted_after,
    );
    let mut all = Vec::new();
    for worker in workers {
        all.push(worker.await.expect("worker"));
    }
    // The victim's target stalled while its primary was gone: the longest wait between two
    // successful calls that spans the kill is the outage as a caller sees it (calls retry
    // inside their deadline, so it may show as slow calls rather than errors).
    let victim = &all[0];
    let outage = victim
        .successes
        .windows(2)
        .filter(|w| w[1] > killed_at && w[0] <= killed_at + promoted_after)
        .map(|w| w[1].duration_since(w[0]))
        .max()
        .expect("calls on the victim's target before and after the kill");
    measured(
        "cluster: longest pause between successful calls on the killed primary's slot",
        outage,
    );
    eprintln!(
        "cluster: calls that failed and were retried on that target: {}",
        victim.errors
    );
    assert!(
        outage >= Duration::from_millis(500),
        "the kill did not hit the target: {outage:?}"
    );
    let after_kill = victim
        .successes
        .iter()
        .filter(|s| **s > killed_at + promoted_after)
        .count();
    assert!(
        after_kill > 3,
        "only {after_kill} successful calls after the promotion"
    );
    for (t, seen) in targets.iter().zip(&all) {
        assert!(
            seen.tokens.len() > 3,
            "{t}: only {} grants",
            seen.tokens.len()
        );
        for pair in seen.tokens.windows(2) {
            assert!(
                pair[1] > pair[0],
                "{t}: token {} after {}",
                pair[1],
                pair[0]
            );
        }
    }
    // A new store whose seeds include the dead node connects through the others.
    let store: Arc<dyn LeaseStore> = Arc::new(
        ValkeyStore::connect(store_config(&cluster))
            .await
            .expect("connect with a dead seed"),
    );
    // After the workload, every target is usable and its tokens keep growing.
    for (t, seen) in targets.iter().zip(&all) {
        let req = contract_cases::acquire_req(t, "after", "w", TTL);
        let g = contract_cases::acquired(&*store, &req).await;
        let last = seen.tokens.last().copied().unwrap_or(0);
        assert!(g.token > last, "{t}: {} is not above {last}", g.token);
    }
}

async fn slot_moved_between_primaries() {
    let mut cluster = tokio::task::spawn_blocking(|| Cluster::start(ServerKind::Valkey91, &[]))
        .await
        .expect("start cluster");
    add_acl_user(&cluster);
    let store = ValkeyStore::connect(store_config(&cluster))
        .await
        .expect("connect");
    let t = target("moving");
    let g = contract_cases::acquired(
        &store,
        &contract_cases::acquire_req(&t, "lease-a", "alice", TTL),
    )
    .await;
    let lease = handle(&t, "lease-a", "alice", g.token);
    store
        .commit(&contract_cases::commit_req(&t, g.token, "before"))
        .await
        .expect("commit");
    let slot = cluster.keyslot(&TargetKeys::new("tl", &t).fence());
    let from = cluster.primary_of_slot(slot);
    let to = (from + 1) % 3;
    let renewing = std::sync::Mutex::new(None);
    // While the slot migrates, the old owner answers ASK; the client follows it (ASKING).
    // Reads of keys that all moved already work; a call that also creates a key (the reply
    // cache) gets TRYAGAIN until the migration ends, and retries inside its deadline.
    let during = async {
        let seen = store
            .inspect(&t)
            .await
            .expect("inspect during the migration (ASK)");
        assert_eq!(seen.fence, g.token);
        let (store, lease) = (store.clone(), lease.clone());
        *renewing.lock().unwrap() = Some(tokio::spawn(async move {
            store.renew(&contract_cases::renew_req(lease, TTL)).await
        }));
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    cluster.move_slot(slot, from, to, during).await;
    let renew = renewing.lock().unwrap().take().expect("renew started");
    let renewed = renew
        .await
        .expect("renew task")
        .expect("renew across the migration");
    assert!(
        matches!(renewed, targetlease::store::RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    assert_eq!(cluster.primary_of_slot(slot), to);
    // The slot map the client holds is stale: MOVED, refresh, retry on the new owner.
    let t = target("moving");
    let read = store
        .read_guarded(&t, Slot::ZERO, &guarded("data"))
        .await
        .expect("read after the move (MOVED)");
    assert_eq!(read.map(|v| v.value).as_deref(), Some("before"));
    let released = store
        .release(&release_req(lease))
        .await
        .expect("release after the move");
    assert_eq!(released, ReleaseOutcome::Released);
    let next = contract_cases::acquired(
        &store,
        &contract_cases::acquire_req(&t, "lease-b", "bob", TTL),
    )
    .await;
    assert!(next.token > g.token, "{} <= {}", next.token, g.token);
}

async fn durable_acquire_waits_for_the_replica_of_its_slot() {
    let mut cluster = tokio::task::spawn_blocking(|| {
        Cluster::start(ServerKind::Valkey91, &["--appendonly", "yes"])
    })
    .await
    .expect("start cluster");
    add_acl_user(&cluster);
    let mut config = store_config(&cluster);
    config.durability = "replicas=1".parse().expect("durability");
    let store = ValkeyStore::connect(config).await.expect("connect");
    for i in 0..12 {
        let t = target(&format!("durable-{i}"));
        let fence = TargetKeys::new("tl", &t).fence();
        let g =
            contract_cases::acquired(&store, &contract_cases::acquire_req(&t, "l", "o", TTL)).await;
        // WAITAOF went to the primary that ran the script (the pipeline is routed by the
        // script's keys), so that primary's replica has the fence already.
        let slot = cluster.keyslot(&fence);
        let primary = cluster.primary_of_slot(slot);
        let replica = &cluster.nodes[primary + 3];
        let on_replica = Admin::single(&format!("redis://127.0.0.1:{}", replica.port), None).await;
        on_replica.cmd(&["READONLY"]).await;
        assert_eq!(
            on_replica.get(&fence).await,
            Some(g.token.to_string()),
            "{t}: acquire returned before the replica had it"
        );
    }
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let variants = [Variant {
        name: "valkey-9.1-cluster",
        make: || Box::pin(async { Harness::server(cluster_env().await).await }),
        admin: true,
        raw: false,
    }];
    let mut trials = contract_cases::trials(&variants);
    trials.extend([
        trial(
            "cluster::keys_of_a_target_share_one_slot",
            keys_of_a_target_share_one_slot,
        ),
        trial(
            "cluster::primary_killed_during_a_workload",
            primary_killed_during_a_workload,
        ),
        trial(
            "cluster::slot_moved_between_primaries",
            slot_moved_between_primaries,
        ),
        trial(
            "cluster::durable_acquire_waits_for_the_replica_of_its_slot",
            durable_acquire_waits_for_the_replica_of_its_slot,
        ),
    ]);
    suite::run(args, trials)
}
