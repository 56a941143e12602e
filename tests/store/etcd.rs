//! The etcd backend beyond the contract: the CLI answers as it does on Valkey, a record this
//! version did not write fails closed and `repair` replaces it above every token, an
//! unreachable member is skipped and an unreachable cluster is an error with its member named,
//! never a hang or a panic. Each trial on its own etcd 3.7 member (a missing binary fails).

use targetlease_test_support as support;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Conclusion};
use serde_json::Value;
use targetlease::redact::SecretUrl;
use targetlease::store::etcd::{EtcdConfig, EtcdStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, ErrorKind, LeaseId, LeaseStore, Owner, Permits, RepairOutcome,
    RequestId, Slot, StoreError, TargetRef, Token, Ttl,
};

use support::etcd::{EtcdCluster, EtcdServer};
use support::server::{Server, ServerKind, free_port};
use support::suite::{self, trial};
use support::tls::Certs;

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    support::etcd::prepare_restores();
    suite::run(
        args,
        vec![
            trial("cli::answers_as_on_valkey", cli_answers_as_on_valkey),
            trial(
                "records::unreadable_fail_closed_until_repaired",
                unreadable_record_fails_closed_until_repaired,
            ),
            trial(
                "records::a_stale_copy_never_answers",
                a_stale_copy_never_answers,
            ),
            trial(
                "records::replies_are_keys_that_expire",
                replies_are_keys_that_expire,
            ),
            trial(
                "records::two_installations_never_share_a_prefix",
                two_installations_never_share_a_prefix,
            ),
            trial(
                "members::unreachable_are_skipped_then_named",
                unreachable_members_are_skipped_then_named,
            ),
            trial(
                "members::a_hanging_member_is_skipped",
                a_hanging_member_is_skipped,
            ),
            trial("tls::a_wrong_ca_is_named", tls_wrong_ca_is_named),
            trial(
                "tls::client_certificates_are_sent_and_their_absence_named",
                mtls_client_certificates,
            ),
            trial(
                "auth::the_documented_role_suffices_and_refusals_are_access_denied",
                auth_documented_role,
            ),
            suite::trial_with_limit(
                "faults::a_restored_snapshot_grants_above_every_lost_token",
                Duration::from_secs(120),
                a_restored_snapshot_grants_above_every_lost_token,
            ),
            suite::trial_with_limit(
                "faults::members_killed_paused_and_cut_off_never_give_two_holders",
                Duration::from_secs(120),
                members_killed_paused_and_cut_off_never_give_two_holders,
            ),
        ],
    )
}

fn store_on(urls: &[String]) -> EtcdStore {
    let endpoints = urls
        .iter()
        .map(|u| SecretUrl::parse(u).expect("URL"))
        .collect();
    EtcdStore::new(EtcdConfig::new(endpoints)).expect("etcd store")
}

fn target() -> TargetRef {
    TargetRef::new("shop", "db-migrate").expect("target")
}

fn acquire_request(lease_id: &str, floor: u64) -> AcquireRequest {
    AcquireRequest {
        target: target(),
        lease_id: LeaseId::new(lease_id).expect("lease id"),
        owner: Owner::new("worker").expect("owner"),
        permits: Permits::new(1).expect("permits"),
        ttl: Ttl::new(Duration::from_secs(30)).expect("ttl"),
        min_token: floor,
        request_id: RequestId::random(),
    }
}

/// `targetlease lease ...` with `env`, answering its exit status and its one JSON object.
fn lease(args: &[&str], env: &[(&str, String)]) -> (Option<i32>, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_targetlease"))
        .arg("lease")
        .args(args)
        .args(["--namespace", "shop", "--target", "cli"])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("run targetlease");
    let body = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not one JSON object on stdout ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), body)
}

/// The shape of an answer: its fields, with numbers replaced by their kind (tokens and times
/// differ between backends, their presence and meaning must not).
fn shape(body: &Value) -> Value {
    match body {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        ("requestId", _) => Value::String("id".into()),
                        ("leaseId", _) => Value::String("hashed".into()),
                        (_, Value::Number(_)) => Value::String("number".into()),
                        _ => shape(v),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(shape).collect()),
        other => other.clone(),
    }
}

// `targetlease lease acquire --backend etcd --etcd-endpoints ...` answers the same JSON, with the
// same exit statuses, as on Valkey, call after call: acquire, held, renew, check, commit, read,
// inspect, release, and a refusal.
async fn cli_answers_as_on_valkey() {
    let etcd = EtcdServer::start();
    let valkey = Server::start(ServerKind::Valkey91);
    let on_etcd = vec![
        ("TARGETLEASE_BACKEND", "etcd".to_string()),
        ("TARGETLEASE_ETCD_ENDPOINTS", etcd.url()),
    ];
    let on_valkey = vec![("TARGETLEASE_VALKEY_URL", valkey.url())];
    let mut tokens = Vec::new();
    for env in [&on_valkey, &on_etcd] {
        let mut answers = Vec::new();
        let mut call = |args: &[&str]| {
            let (code, body) = lease(args, env);
            answers.push((args[0].to_string(), code, shape(&body)));
            body
        };
        let claim = ["--lease-id", "L1", "--owner", "w"];
        let granted = call(&[&["acquire"][..], &claim, &["--ttl", "30s"]].concat());
        let token = granted["token"].as_u64().expect("a token").to_string();
        call(&["acquire", "--lease-id", "L2", "--owner", "x"]);
        call(&[&["renew"][..], &claim, &["--token", &token, "--ttl", "30s"]].concat());
        call(&["check", "--token", &token]);
        call(&["commit", "--token", &token, "--key", "k", "--value", "v"]);
        call(&["read", "--key", "k"]);
        call(&["inspect"]);
        call(&[&["release"][..], &claim, &["--token", &token]].concat());
        call(&["check", "--token", "1"]);
        tokens.push(answers);
    }
    let (valkey_answers, etcd_answers) = (&tokens[0], &tokens[1]);
    for (on_valkey, on_etcd) in valkey_answers.iter().zip(etcd_answers) {
        assert_eq!(on_etcd, on_valkey, "etcd answered otherwise than Valkey");
    }
    assert_eq!(valkey_answers.len(), etcd_answers.len());
    // Not the same failure twice: every outcome the calls should give is there.
    let outcomes: Vec<&str> = etcd_answers
        .iter()
        .filter_map(|(_, _, body)| body["outcome"].as_str())
        .collect();
    for wanted in [
        "acquired",
        "held",
        "renewed",
        "current",
        "committed",
        "released",
        "stale",
    ] {
        assert!(outcomes.contains(&wanted), "no {wanted} in {outcomes:?}");
    }
}

// A target's record that this version did not write (garbage, a later format, an unknown field)
// fails closed: no call answers from it, and it is left as it was. `repair` replaces it with one
// fenced above the floor and the clock; the next grant is above that.
async fn unreadable_record_fails_closed_until_repaired() {
    let etcd = EtcdServer::start();
    let store = store_on(&[etcd.url()]);
    let key = EtcdStore::key("targetlease", &target());
    let granted = match store
        .acquire(&acquire_request("L1", 0))
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(g) => g,
        other => panic!("{other:?}"),
    };
    let valid = etcd.get(key.as_bytes()).expect("the record");
    let text = String::from_utf8(valid.clone()).expect("JSON");
    let later_format = text.replacen("\"format\":1", "\"format\":2", 1);
    let unknown_field = text.replacen("\"format\":1", "\"format\":1,\"fences2\":[]", 1);
    assert_ne!(later_format, text);
    assert_ne!(unknown_field, text);
    let floor = granted.token + 1_000;
    for bad in [
        b"{not json".to_vec(),
        later_format.into_bytes(),
        unknown_field.into_bytes(),
    ] {
        etcd.put(key.as_bytes(), &bad);
        let refused = store
            .acquire(&acquire_request("L2", 0))
            .await
            .expect_err("an acquire on an unreadable record");
        assert_eq!(refused.kind(), ErrorKind::Corrupt, "{refused}");
        assert!(refused.to_string().contains("repair"), "{refused}");
        let token = Token::new(granted.token).expect("token");
        let refused = store.check(&target(), Slot::ZERO, token).await;
        assert_eq!(
            refused.map_err(|e| e.kind()).err(),
            Some(ErrorKind::Corrupt)
        );
        assert_eq!(
            etcd.get(key.as_bytes()),
            Some(bad),
            "the record was rewritten"
        );
    }
    // Repaired by another process (an operator's CLI): this store forgets its copy of the
    // unreadable key and reads the repaired one.
    let operator = store_on(&[etcd.url()]);
    let repaired = operator.repair(&target(), floor).await.expect("repair");
    let RepairOutcome::Repaired { fence, .. } = repaired else {
        panic!("{repaired:?}")
    };
    assert!(fence >= floor, "{fence} < {floor}");
    assert_eq!(
        store.repair(&target(), floor).await.expect("repair"),
        RepairOutcome::Intact { fence }
    );
    match store
        .acquire(&acquire_request("L3", 0))
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(g) => assert!(g.token > fence, "{} <= {fence}", g.token),
        other => panic!("{other:?}"),
    }
    // The old holder is fenced.
    let old = Token::new(granted.token).expect("token");
    assert!(matches!(
        store.check(&target(), Slot::ZERO, old).await,
        Ok(targetlease::store::CheckOutcome::Stale { .. })
    ));
}

// A member that does not answer is skipped for the next; when none answers, the call fails
// within its deadline with the member named and a kind a caller retries on.
async fn unreachable_members_are_skipped_then_named() {
    let etcd = EtcdServer::start();
    let dead = format!("http://127.0.0.1:{}", free_port());
    let store = Arc::new(store_on(&[dead.clone(), etcd.url()]));
    assert!(matches!(
        store.acquire(&acquire_request("L1", 0)).await,
        Ok(AcquireOutcome::Acquired(_))
    ));
    store
        .health()
        .await
        .expect("health through the live member");
    let nowhere = store_on(std::slice::from_ref(&dead));
    let started = Instant::now();
    let e = nowhere
        .acquire(&acquire_request("L1", 0))
        .await
        .expect_err("no member answers");
    assert!(e.is_transient(), "{e}");
    assert!(e.to_string().contains(&dead[7..]), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(nowhere.health().await.is_err());
}

/// What the clients of the fault trial saw.
#[derive(Default)]
struct Seen {
    /// Every grant: when it returned, its target, request id and token.
    grants: Vec<(Instant, usize, String, u64)>,
    /// What broke a guarantee.
    violations: Vec<String>,
    /// Calls that failed after every retry within their deadline.
    failed_calls: usize,
}

/// `call` until it succeeds or fails for good, retried with the same request (so with the same
/// request id) while the failure is transient, for up to 20 s.
async fn with_retries<T, F, Fut>(mut call: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        match call().await {
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

// Three members; eight clients claim two targets over and over (acquire, renew, hold 30 ms,
// release, every call retried with its request id while it fails transiently) while the leader
// is killed and restarted, a follower is paused (SIGSTOP) and resumed, the leader is paused
// until the others elect another and resumed, a follower is cut off from the others (a
// partition: it still answers clients, and a read it served from its own data would be stale)
// and joined again, and the leader is cut off until the others elect another. At no time do two clients hold one target
// (a counter of holders inside the critical section, entered after the grant and left before
// the release); every grant's token is above every token granted before its acquire began;
// no request id is granted two tokens; no renewal 30 ms into a tenure finds it lost; and
// clients are granted leases after every fault.
async fn members_killed_paused_and_cut_off_never_give_two_holders() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    let cluster = EtcdCluster::start();
    let urls = cluster.urls();
    let targets = [
        TargetRef::new("shop", "faults-a").expect("target"),
        TargetRef::new("shop", "faults-b").expect("target"),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let holders: Arc<[AtomicU32; 2]> = Arc::new([AtomicU32::new(0), AtomicU32::new(0)]);
    let newest: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut clients = Vec::new();
    for client in 0..8usize {
        let (stop, holders, newest, seen) =
            (stop.clone(), holders.clone(), newest.clone(), seen.clone());
        let store = store_on(&urls);
        let target = targets[client % 2].clone();
        let t = client % 2;
        clients.push(tokio::spawn(async move {
            let note = |what: String| seen.lock().expect("lock").violations.push(what);
            while !stop.load(Ordering::SeqCst) {
                let mut req = acquire_request(&format!("client-{client}"), 0);
                req.target = target.clone();
                req.ttl = Ttl::new(Duration::from_secs(5)).expect("ttl");
                let before = newest[t].load(Ordering::SeqCst);
                let granted = match with_retries(|| store.acquire(&req)).await {
                    Ok(AcquireOutcome::Acquired(g)) => g,
                    Ok(AcquireOutcome::Held { .. }) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    Ok(other) => {
                        note(format!(
                            "client {client}: a retried acquire answered {other:?}"
                        ));
                        continue;
                    }
                    Err(_) => {
                        seen.lock().expect("lock").failed_calls += 1;
                        continue;
                    }
                };
                newest[t].fetch_max(granted.token, Ordering::SeqCst);
                seen.lock().expect("lock").grants.push((
                    Instant::now(),
                    t,
                    req.request_id.as_str().to_owned(),
                    granted.token,
                ));
                if granted.token <= before {
                    note(format!(
                        "client {client}: token {} not above {before}, granted before its acquire",
                        granted.token
                    ));
                }
                let inside = holders[t].fetch_add(1, Ordering::SeqCst);
                if inside != 0 {
                    note(format!(
                        "client {client}: granted token {} on target {t} beside {inside} holder(s)",
                        granted.token
                    ));
                }
                let handle = targetlease::store::LeaseHandle {
                    target: target.clone(),
                    permits: req.permits,
                    slot: granted.slot,
                    lease_id: req.lease_id.clone(),
                    owner: req.owner.clone(),
                    token: Token::new(granted.token).expect("token"),
                };
                let renew = targetlease::store::RenewRequest {
                    lease: handle.clone(),
                    ttl: req.ttl,
                    request_id: RequestId::random(),
                };
                match with_retries(|| store.renew(&renew)).await {
                    Ok(targetlease::store::RenewOutcome::Renewed { .. }) => {}
                    Ok(lost) => note(format!("client {client}: renewal found {lost:?}")),
                    Err(_) => seen.lock().expect("lock").failed_calls += 1,
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
                holders[t].fetch_sub(1, Ordering::SeqCst);
                let release = targetlease::store::ReleaseRequest {
                    lease: handle,
                    request_id: RequestId::random(),
                };
                if with_retries(|| store.release(&release)).await.is_err() {
                    seen.lock().expect("lock").failed_calls += 1;
                }
            }
        }));
    }
    // The faults, on a thread of their own (they wait on processes).
    let faults = std::thread::spawn(move || {
        let mut cluster = cluster;
        let mut recovered = Vec::new();
        let pause = |d: u64| std::thread::sleep(Duration::from_millis(d));
        pause(1_500);
        let leader = cluster.leader().expect("a leader");
        cluster.kill(leader);
        pause(2_000);
        cluster.restart(leader);
        cluster.wait_for_leader(&[0, 1, 2], Duration::from_secs(30));
        recovered.push(("the leader killed and restarted", Instant::now()));
        pause(1_500);
        let leader = cluster.leader().expect("a leader");
        let follower = (leader + 1) % 3;
        cluster.pause(follower, true);
        pause(2_000);
        cluster.pause(follower, false);
        cluster.wait_for_leader(&[0, 1, 2], Duration::from_secs(30));
        recovered.push(("a follower paused and resumed", Instant::now()));
        pause(1_500);
        let leader = cluster.leader().expect("a leader");
        cluster.pause(leader, true);
        let others: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
        cluster.wait_for_leader(&others, Duration::from_secs(30));
        pause(1_000);
        cluster.pause(leader, false);
        cluster.wait_for_leader(&[0, 1, 2], Duration::from_secs(30));
        recovered.push((
            "the leader paused until replaced, then resumed",
            Instant::now(),
        ));
        pause(1_500);
        let leader = cluster.leader().expect("a leader");
        let follower = (leader + 1) % 3;
        cluster.partition(follower);
        cluster.wait_until_leaderless(follower, Duration::from_secs(10));
        pause(1_000);
        cluster.heal();
        cluster.wait_for_leader(&[0, 1, 2], Duration::from_secs(30));
        recovered.push(("a follower cut off and joined again", Instant::now()));
        pause(1_500);
        let leader = cluster.leader().expect("a leader");
        cluster.partition(leader);
        let others: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
        cluster.wait_for_leader(&others, Duration::from_secs(30));
        pause(1_000);
        cluster.heal();
        cluster.wait_for_leader(&[0, 1, 2], Duration::from_secs(30));
        recovered.push((
            "the leader cut off until replaced, then joined again",
            Instant::now(),
        ));
        pause(1_500);
        (cluster, recovered)
    });
    let (cluster, recovered) = tokio::task::spawn_blocking(move || faults.join())
        .await
        .expect("join")
        .expect("the faults ran");
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.expect("client");
    }
    drop(cluster);
    let seen = seen.lock().expect("lock");
    assert!(seen.violations.is_empty(), "{:#?}", seen.violations);
    let mut tokens_of = std::collections::HashMap::new();
    for (_, _, request, token) in &seen.grants {
        let first = *tokens_of.entry(request.clone()).or_insert(*token);
        assert_eq!(first, *token, "request id granted two tokens");
    }
    for (fault, at) in &recovered {
        let after = seen.grants.iter().filter(|(when, ..)| when > at).count();
        assert!(after > 0, "no grant after {fault}");
    }
    println!(
        "{} grants on two targets, {} calls failed after every retry; faults: {:?}",
        seen.grants.len(),
        seen.failed_calls,
        recovered.iter().map(|(f, _)| *f).collect::<Vec<_>>()
    );
    assert!(seen.grants.len() >= 40, "only {} grants", seen.grants.len());
}

// The whole cluster restored from a snapshot, as an operator restores one with `etcdutl`
// (with `--bump-revision`, the documented way, and without it, when revisions are handed out
// again): everything written since the snapshot is gone (a release, the next grant and its
// reply, a fenced write). The tenure the snapshot holds is the holder again (its process renews
// and releases it); the lost tenure is told it lost, its token is refused for writes and
// checks, and a retry of its acquire takes nothing; the next grant's token is above every token
// issued before the restore. The store process keeps its copies of the key across the restore
// (they predate it) and answers from the key as it is.
async fn a_restored_snapshot_grants_above_every_lost_token() {
    use targetlease::store::{
        CheckOutcome, CommitOutcome, CommitRequest, GuardedKey, LeaseHandle, ReleaseOutcome,
        ReleaseRequest, RenewOutcome, RenewRequest,
    };
    let mut cluster = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .expect("start etcd");
    let store = store_on(&cluster.urls());
    for bump in [Some(1_000_000_000), None] {
        let target =
            TargetRef::new("shop", &format!("restore-bump-{}", bump.is_some())).expect("target");
        // Five minutes: the restored holder must still hold after the snapshot, the restore
        // and the calls between, however slow the machine (a grant that expired meanwhile
        // would free the target, and the lost claim's retry would rightly take it).
        let claim = |lease_id: &str| AcquireRequest {
            target: target.clone(),
            ttl: Ttl::new(Duration::from_secs(300)).expect("ttl"),
            ..acquire_request(lease_id, 0)
        };
        let handle = |req: &AcquireRequest, slot: Slot, token: u64| LeaseHandle {
            target: target.clone(),
            permits: req.permits,
            slot,
            lease_id: req.lease_id.clone(),
            owner: req.owner.clone(),
            token: Token::new(token).expect("token"),
        };
        let acquired = |outcome: Result<AcquireOutcome, StoreError>| match outcome {
            Ok(AcquireOutcome::Acquired(grant)) => grant,
            other => panic!("expected a grant, got {other:?}"),
        };
        let a = claim("holder-a");
        let granted_a = acquired(store.acquire(&a).await);
        let a_lease = handle(&a, granted_a.slot, granted_a.token);
        let snapshot = {
            let taken = tokio::task::spawn_blocking(move || {
                let snapshot = cluster.snapshot();
                (cluster, snapshot)
            })
            .await
            .expect("snapshot");
            cluster = taken.0;
            taken.1
        };
        let release_a = ReleaseRequest {
            lease: a_lease.clone(),
            request_id: RequestId::random(),
        };
        assert_eq!(
            store.release(&release_a).await.expect("release"),
            ReleaseOutcome::Released
        );
        let b = claim("holder-b");
        let granted_b = acquired(store.acquire(&b).await);
        assert!(granted_b.token > granted_a.token);
        let b_lease = handle(&b, granted_b.slot, granted_b.token);
        let write = |sequence: u64| CommitRequest {
            target: target.clone(),
            slot: granted_b.slot,
            token: b_lease.token,
            key: GuardedKey::new("schema").expect("key"),
            value: format!("written by b, {sequence}"),
            sequence,
            request_id: RequestId::random(),
        };
        assert!(matches!(
            store.commit(&write(1)).await,
            Ok(CommitOutcome::Committed { .. })
        ));

        cluster = tokio::task::spawn_blocking(move || {
            cluster.restore(&snapshot, bump);
            cluster
        })
        .await
        .expect("restore");
        let after = |what: &str| format!("after a restore (bump {bump:?}): {what}");

        // The lost tenure: told it lost, fenced out, and its retried acquire takes nothing.
        let renew_b = RenewRequest {
            lease: b_lease.clone(),
            ttl: b.ttl,
            request_id: RequestId::random(),
        };
        let renewed = with_retries(|| store.renew(&renew_b)).await;
        assert!(
            matches!(renewed, Ok(RenewOutcome::Lost { .. })),
            "{}",
            after(&format!("the lost tenure renewed: {renewed:?}"))
        );
        let second = write(2);
        let committed = with_retries(|| store.commit(&second)).await;
        assert!(
            !matches!(committed, Ok(CommitOutcome::Committed { .. })),
            "{}",
            after(&format!("the lost tenure's token wrote: {committed:?}"))
        );
        let checked = store.check(&target, granted_b.slot, b_lease.token).await;
        assert!(
            !matches!(checked, Ok(CheckOutcome::Current { .. })),
            "{}",
            after(&format!("the lost tenure's token is current: {checked:?}"))
        );
        let read = store
            .read_guarded(
                &target,
                granted_b.slot,
                &GuardedKey::new("schema").expect("key"),
            )
            .await
            .expect("read the guarded record");
        assert_eq!(read, None, "{}", after("the lost write is still there"));
        let retried = store.acquire(&b).await;
        assert!(
            matches!(retried, Ok(AcquireOutcome::Held { .. })),
            "{}",
            after(&format!("the lost acquire, retried: {retried:?}"))
        );
        let c = claim("holder-c");
        let refused = store.acquire(&c).await;
        assert!(
            matches!(refused, Ok(AcquireOutcome::Held { .. })),
            "{}",
            after(&format!(
                "a new claim beside the restored holder: {refused:?}"
            ))
        );

        // The restored holder carries on, then hands over above every token issued before.
        let renew_a = RenewRequest {
            lease: a_lease.clone(),
            ttl: a.ttl,
            request_id: RequestId::random(),
        };
        let renewed = store.renew(&renew_a).await;
        assert!(
            matches!(renewed, Ok(RenewOutcome::Renewed { .. })),
            "{}",
            after(&format!("the restored holder's renewal: {renewed:?}"))
        );
        let release_a = ReleaseRequest {
            lease: a_lease,
            request_id: RequestId::random(),
        };
        assert_eq!(
            store.release(&release_a).await.expect("release"),
            ReleaseOutcome::Released,
            "{}",
            after("the restored holder's release")
        );
        let c = claim("holder-c");
        let granted_c = acquired(store.acquire(&c).await);
        assert!(
            granted_c.token > granted_b.token,
            "{}",
            after(&format!(
                "token {} granted, not above the lost token {}",
                granted_c.token, granted_b.token
            ))
        );
        let fresh = store_on(&cluster.urls());
        let seen = fresh
            .check(
                &target,
                granted_c.slot,
                Token::new(granted_c.token).expect("token"),
            )
            .await;
        assert!(
            matches!(seen, Ok(CheckOutcome::Current { .. })),
            "{}",
            after(&format!("another process sees the new grant as {seen:?}"))
        );
        println!(
            "bump {bump:?}: tokens {} (kept) < {} (lost) < {} (granted after the restore)",
            granted_a.token, granted_b.token, granted_c.token
        );
    }
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .expect("stop etcd");
}

// Two installations on one prefix: the first claims it at its first call; the second is
// refused on every kind of call and at its health check, naming the first, and writes nothing;
// the first carries on and a process of it that starts again is let in; the second on its own
// prefix works; once the first's key is deleted (the documented way to hand a prefix over), the
// second claims it, and the first's health check then reports the prefix taken. A process
// without an installation (a `targetlease lease` command) is not asked.
async fn two_installations_never_share_a_prefix() {
    let etcd = EtcdServer::start();
    let store_of = |installation: &str, prefix: &str| {
        let mut config = EtcdConfig::new(vec![SecretUrl::parse(&etcd.url()).expect("URL")]);
        config.installation = Some(installation.into());
        config.key_prefix = prefix.into();
        EtcdStore::new(config).expect("etcd store")
    };
    let first = store_of("prod/targetlease", "shared");
    let granted = first.acquire(&acquire_request("L1", 0)).await;
    assert!(
        matches!(granted, Ok(AcquireOutcome::Acquired(_))),
        "{granted:?}"
    );
    let marker = EtcdStore::installation_key("shared");
    assert_eq!(
        etcd.get(marker.as_bytes()).as_deref(),
        Some(&b"prod/targetlease"[..])
    );

    let second = store_of("staging/targetlease", "shared");
    let other_target = TargetRef::new("shop", "other").expect("target");
    let refusals = [
        second
            .acquire(&AcquireRequest {
                target: other_target.clone(),
                ..acquire_request("L2", 0)
            })
            .await
            .map(drop),
        second.inspect(&target()).await.map(drop),
        second
            .check(
                &target(),
                Slot::new(0).expect("slot"),
                Token::new(1).expect("token"),
            )
            .await
            .map(drop),
        second.repair(&target(), 0).await.map(drop),
        second.health().await,
    ];
    for refused in refusals {
        let e = refused.expect_err("the second installation is refused");
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
        assert!(e.to_string().contains("prod/targetlease"), "{e}");
    }
    let key = EtcdStore::key("shared", &other_target);
    assert_eq!(
        etcd.get(key.as_bytes()),
        None,
        "the refused installation wrote"
    );

    first
        .health()
        .await
        .expect("the first installation's health");
    let restarted = store_of("prod/targetlease", "shared");
    restarted
        .health()
        .await
        .expect("the first installation, started again");
    let inspected = restarted.inspect(&target()).await.expect("inspect");
    assert!(
        inspected.lease.is_some(),
        "the first installation's lease is gone"
    );
    let elsewhere = store_of("staging/targetlease", "staging");
    assert!(matches!(
        elsewhere.acquire(&acquire_request("L3", 0)).await,
        Ok(AcquireOutcome::Acquired(_))
    ));
    let command = store_on(&[etcd.url()]);
    command
        .inspect(&target())
        .await
        .expect("no installation, no claim");

    etcd.post(
        "/v3/kv/deleterange",
        &serde_json::json!({"key": base64_of(&marker)}),
    );
    second.health().await.expect("the prefix handed over");
    let e = first
        .health()
        .await
        .expect_err("the prefix is the other's now");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains("staging/targetlease"), "{e}");
}

// A store starts a call from its last copy of the target's key; another process changed the
// key since. Each answer is the one the key as it is now gives: a refusal that the copy would
// have granted, a grant that the copy would have refused, a renewal of a lease the copy still
// holds found lost, after a delete of every key the copy's grant gone.
async fn a_stale_copy_never_answers() {
    let etcd = EtcdServer::start();
    let (mine, theirs) = (store_on(&[etcd.url()]), store_on(&[etcd.url()]));
    let granted = |o: AcquireOutcome| match o {
        AcquireOutcome::Acquired(g) => g,
        other => panic!("{other:?}"),
    };
    let first = acquire_request("L1", 0);
    let g1 = granted(mine.acquire(&first).await.expect("acquire"));
    let handle = |req: &AcquireRequest, token: u64| targetlease::store::LeaseHandle {
        target: req.target.clone(),
        permits: req.permits,
        slot: Slot::ZERO,
        lease_id: req.lease_id.clone(),
        owner: req.owner.clone(),
        token: Token::new(token).expect("token"),
    };
    // Released and taken by another process: my copy still says L1 holds it.
    let release = targetlease::store::ReleaseRequest {
        lease: handle(&first, g1.token),
        request_id: RequestId::random(),
    };
    theirs.release(&release).await.expect("release");
    let mut other = acquire_request("L2", 0);
    other.owner = Owner::new("other").expect("owner");
    let g2 = granted(theirs.acquire(&other).await.expect("acquire"));
    let renew = targetlease::store::RenewRequest {
        lease: handle(&first, g1.token),
        ttl: Ttl::new(Duration::from_secs(30)).expect("ttl"),
        request_id: RequestId::random(),
    };
    assert!(matches!(
        mine.renew(&renew).await.expect("renew"),
        targetlease::store::RenewOutcome::Lost { .. }
    ));
    match mine
        .acquire(&acquire_request("L3", 0))
        .await
        .expect("acquire")
    {
        AcquireOutcome::Held { owner, .. } => assert_eq!(owner, "other"),
        other => panic!("a stale copy answered {other:?}"),
    }
    // Released by its holder elsewhere: my copy (now showing L2) would refuse; the key grants.
    let release = targetlease::store::ReleaseRequest {
        lease: handle(&other, g2.token),
        request_id: RequestId::random(),
    };
    theirs.release(&release).await.expect("release");
    let g3 = granted(
        mine.acquire(&acquire_request("L3", 0))
            .await
            .expect("acquire"),
    );
    assert!(g3.token > g2.token);
    // Every key deleted (data lost): my copy's grant is gone; a claim above the floor gets a
    // larger token.
    etcd.wipe();
    let renew = targetlease::store::RenewRequest {
        lease: handle(&acquire_request("L3", 0), g3.token),
        ttl: Ttl::new(Duration::from_secs(30)).expect("ttl"),
        request_id: RequestId::random(),
    };
    assert!(matches!(
        mine.renew(&renew).await.expect("renew"),
        targetlease::store::RenewOutcome::Lost { .. }
    ));
    let g4 = granted(
        mine.acquire(&acquire_request("L4", g3.token))
            .await
            .expect("acquire"),
    );
    assert!(g4.token > g3.token);
}

// Each cached reply is a key of its own on an etcd lease: a target claimed and released 400
// times keeps a record of the same size, its replies are 800 keys attached to a lease that
// outlives the reply TTL, a retry still finds its reply, and when the lease is revoked (what a
// data loss or a restore does to it) the next call takes a new one.
async fn replies_are_keys_that_expire() {
    let etcd = EtcdServer::start();
    let store = store_on(&[etcd.url()]);
    let key = EtcdStore::key("targetlease", &target());
    let mut sizes = Vec::new();
    let mut first = None;
    for round in 0..400 {
        let req = acquire_request("L1", 0);
        let g = match store.acquire(&req).await.expect("acquire") {
            AcquireOutcome::Acquired(g) => g,
            other => panic!("{other:?}"),
        };
        first.get_or_insert((req.clone(), g.token));
        let release = targetlease::store::ReleaseRequest {
            lease: targetlease::store::LeaseHandle {
                target: target(),
                permits: req.permits,
                slot: g.slot,
                lease_id: req.lease_id.clone(),
                owner: req.owner.clone(),
                token: Token::new(g.token).expect("token"),
            },
            request_id: RequestId::random(),
        };
        store.release(&release).await.expect("release");
        if round % 100 == 99 {
            sizes.push(etcd.get(key.as_bytes()).expect("the record").len());
        }
    }
    assert!(
        sizes.iter().all(|s| *s == sizes[0] && *s < 2_048),
        "the record grew with the calls: {sizes:?} bytes"
    );
    let replies = etcd.post(
        "/v3/kv/range",
        &serde_json::json!({
            "key": base64_of("targetlease/replies/"),
            "range_end": base64_of("targetlease/replies0"),
            "count_only": true,
        }),
    );
    assert_eq!(replies["count"].as_str(), Some("800"), "{replies}");
    let leases = etcd.post("/v3/lease/leases", &serde_json::json!({}));
    let ids: Vec<String> = leases["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .filter_map(|l| l["ID"].as_str().map(String::from))
        .collect();
    assert_eq!(
        ids.len(),
        1,
        "one lease for every reply of the window: {leases}"
    );
    let ttl = etcd.post(
        "/v3/lease/timetolive",
        &serde_json::json!({"ID": ids[0], "keys": false}),
    );
    let granted: u64 = ttl["grantedTTL"]
        .as_str()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0);
    assert!(
        granted > 60,
        "the lease must outlive the 60 s reply TTL: {ttl}"
    );
    // A retry of the first acquire finds its reply (answered expired: its grant ended).
    let (req, token) = first.expect("a first grant");
    assert_eq!(
        store.acquire(&req).await.expect("retry"),
        AcquireOutcome::Expired { token }
    );
    // The lease revoked: the next call takes another.
    etcd.post("/v3/lease/revoke", &serde_json::json!({"ID": ids[0]}));
    assert!(matches!(
        store.acquire(&acquire_request("L2", 0)).await,
        Ok(AcquireOutcome::Acquired(_))
    ));
}

fn base64_of(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

// A follower that hangs (SIGSTOP: what a partition that drops packets looks like) is the first
// endpoint: one call, not retried, is answered within its deadline by another member, and the
// next call does not start at the hung one. (A follower: a hung leader stops every member's
// writes until the others elect another.)
async fn a_hanging_member_is_skipped() {
    let cluster = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .expect("start etcd");
    let leader = cluster.leader().expect("an etcd leader");
    let hung = (leader + 1) % 3;
    let urls = cluster.urls();
    let mut endpoints = vec![urls[hung].clone()];
    endpoints.extend((0..3).filter(|i| *i != hung).map(|i| urls[i].clone()));
    let store = store_on(&endpoints);
    cluster.pause(hung, true);
    let started = Instant::now();
    let first = store.acquire(&acquire_request("L1", 0)).await;
    let first_took = started.elapsed();
    let started = Instant::now();
    let second = store.acquire(&acquire_request("L2", 0)).await;
    let second_took = started.elapsed();
    cluster.pause(hung, false);
    assert!(
        matches!(first, Ok(AcquireOutcome::Acquired(_))),
        "{first:?}"
    );
    assert!(first_took < Duration::from_secs(2), "{first_took:?}");
    assert!(
        matches!(second, Ok(AcquireOutcome::Held { .. })),
        "{second:?}"
    );
    assert!(
        second_took < Duration::from_millis(500),
        "the next call asked the hung member: {second_took:?}"
    );
}

fn tls_store(server: &EtcdServer, certs: &Certs, ca: &str, client: bool) -> EtcdStore {
    let mut config = EtcdConfig::new(vec![SecretUrl::parse(&server.url()).expect("URL")]);
    config.tls.ca_file = Some(certs.path(ca));
    if client {
        config.tls.cert_file = Some(certs.path("client.crt"));
        config.tls.key_file = Some(certs.path("client.key"));
    }
    EtcdStore::new(config).expect("etcd store")
}

// A member whose certificate another CA signed: the error is `tls`, at once (retrying does not
// help), naming the member; the right CA works.
async fn tls_wrong_ca_is_named() {
    let certs = Certs::generate();
    let server = EtcdServer::start_tls(&certs, false);
    let started = Instant::now();
    let e = tls_store(&server, &certs, "other-ca.crt", false)
        .acquire(&acquire_request("L1", 0))
        .await
        .expect_err("a certificate of another CA");
    assert_eq!(e.kind(), ErrorKind::Tls, "{e}");
    assert!(e.to_string().contains(&server.port.to_string()), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let store = tls_store(&server, &certs, "ca.crt", false);
    assert!(matches!(
        store.acquire(&acquire_request("L1", 0)).await,
        Ok(AcquireOutcome::Acquired(_))
    ));
    store.health().await.expect("health over TLS");
}

// A member that asks for client certificates: one signed by its CA works; none is refused
// with an error that says TLS and names the certificate, not a hang, a closed connection or an
// unexpected reply.
async fn mtls_client_certificates() {
    let certs = Certs::generate();
    let server = EtcdServer::start_tls(&certs, true);
    let store = tls_store(&server, &certs, "ca.crt", true);
    assert!(matches!(
        store.acquire(&acquire_request("L1", 0)).await,
        Ok(AcquireOutcome::Acquired(_))
    ));
    let e = tls_store(&server, &certs, "ca.crt", false)
        .acquire(&acquire_request("L2", 0))
        .await
        .expect_err("no client certificate");
    // The member refuses after the handshake (TLS 1.3): the alert it sends is what the error
    // names, not "connection closed".
    assert_eq!(e.kind(), ErrorKind::Tls, "{e}");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    println!("without a client certificate: {e}");
}

fn user_store(server: &EtcdServer, user: &str, password: &str) -> EtcdStore {
    let mut config = EtcdConfig::new(vec![SecretUrl::parse(&server.url()).expect("URL")]);
    config.username = Some(user.into());
    config.password = Some(targetlease::store::valkey::PasswordSource::Value(
        targetlease::redact::Secret::new(password),
    ));
    EtcdStore::new(config).expect("etcd store")
}

// Authentication on, with the role docs/operations.md tells operators to make (read and write on
// the prefix only): that user claims, renews and checks health; a wrong password and a user
// without the role are refused with `access_denied`, never a retry loop or an unexpected reply;
// no message carries the password.
async fn auth_documented_role() {
    let server = EtcdServer::start();
    let setup = [
        ("/v3/auth/role/add", serde_json::json!({"name": "root"})),
        (
            "/v3/auth/user/add",
            serde_json::json!({"name": "root", "password": "root-secret"}),
        ),
        (
            "/v3/auth/user/grant",
            serde_json::json!({"user": "root", "role": "root"}),
        ),
        (
            "/v3/auth/role/add",
            serde_json::json!({"name": "targetlease"}),
        ),
        (
            "/v3/auth/role/grant",
            serde_json::json!({"name": "targetlease", "perm": {"permType": "READWRITE",
                "key": base64_of("targetlease/"), "range_end": base64_of("targetlease0")}}),
        ),
        (
            "/v3/auth/user/add",
            serde_json::json!({"name": "targetlease", "password": "app-secret"}),
        ),
        (
            "/v3/auth/user/grant",
            serde_json::json!({"user": "targetlease", "role": "targetlease"}),
        ),
        (
            "/v3/auth/user/add",
            serde_json::json!({"name": "nobody", "password": "nobody-secret"}),
        ),
        ("/v3/auth/enable", serde_json::json!({})),
    ];
    for (path, body) in setup {
        server.post(path, &body);
    }
    let app = user_store(&server, "targetlease", "app-secret");
    app.health().await.expect("health as the documented user");
    let g = match app
        .acquire(&acquire_request("L1", 0))
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(g) => g,
        other => panic!("{other:?}"),
    };
    let renew = targetlease::store::RenewRequest {
        lease: targetlease::store::LeaseHandle {
            target: target(),
            permits: Permits::new(1).expect("permits"),
            slot: g.slot,
            lease_id: LeaseId::new("L1").expect("id"),
            owner: Owner::new("worker").expect("owner"),
            token: Token::new(g.token).expect("token"),
        },
        ttl: Ttl::new(Duration::from_secs(30)).expect("ttl"),
        request_id: RequestId::random(),
    };
    assert!(matches!(
        app.renew(&renew).await,
        Ok(targetlease::store::RenewOutcome::Renewed { .. })
    ));
    for (store, why) in [
        (
            user_store(&server, "targetlease", "wrong-secret"),
            "a wrong password",
        ),
        (
            user_store(&server, "nobody", "nobody-secret"),
            "a user without the role",
        ),
    ] {
        let started = Instant::now();
        let e = store
            .acquire(&acquire_request("L2", 0))
            .await
            .expect_err(why);
        assert_eq!(e.kind(), ErrorKind::AccessDenied, "{why}: {e}");
        assert!(!e.to_string().contains("secret"), "{why}: {e}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{why}: {:?}",
            started.elapsed()
        );
    }
}
