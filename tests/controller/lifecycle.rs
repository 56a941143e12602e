//! The controller end to end, on a real control plane (`e2e/cluster`) and a real Valkey: each
//! scenario gets its own namespace, Valkey server and controller process (watching only that
//! namespace). A missing control plane or server fails the suite; it never skips.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};
use targetlease_test_support::scenarios;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use targetlease::api::{Phase, TargetLease};
use targetlease::store::{LeaseStore, MAX_TOKEN, MAX_TOKEN_LEAD_MICROS};

use support::admin::Admin;
use support::etcd::EtcdCluster;
use support::kube::{
    ControllerProcess, condition, http_get, lease_yaml, metric, phase_of, token_of,
};
use support::proxy::{Mode, Proxy};
use support::scenario::{SEC, Scenario, run_scenarios};
use support::sentinel::{MASTER, Options, Topology};
use support::server::ServerKind;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};

// 1. kubectl apply leads to Held; kubectl wait works on the condition and on the phase.
async fn apply_leads_to_held(s: Scenario) {
    s.apply("first", "orders-db/migration", "worker-1", "");
    let out = s.cluster.kubectl_ok(&[
        "wait",
        "-n",
        &s.ns,
        "--for=condition=Ready",
        "--timeout=30s",
        "tl/first",
    ]);
    assert!(out.contains("condition met"), "{out}");
    let out = s.cluster.kubectl_ok(&[
        "wait",
        "-n",
        &s.ns,
        "--for=jsonpath={.status.phase}=Held",
        "--timeout=30s",
        "targetlease/first",
    ]);
    assert!(out.contains("condition met"), "{out}");
    let lease = s.get("first").await;
    let status = lease.status.clone().expect("status");
    assert_eq!(status.owner.as_deref(), Some("worker-1"));
    assert!(status.fencing_token.unwrap_or(0) > 0);
    let expires = status.expires_at.expect("expiresAt");
    let acquired = status.acquired_at.expect("acquiredAt");
    // A promise of four TTLs from the grant.
    assert_eq!(expires.duration_since(acquired).as_secs(), 4 * 30);
    assert_eq!(status.observed_generation, lease.metadata.generation);
    assert_eq!(
        condition(&lease, "Held").map(|c| c.status.as_str()),
        Some("True")
    );
    assert!(
        lease
            .finalizers()
            .iter()
            .any(|f| f == "targetlease.dev/release")
    );
    // The lease is in Valkey, with the token the status shows.
    let seen = s.inspect("orders-db/migration").await;
    assert_eq!(
        seen.lease.map(|l| (l.owner, l.token)),
        Some(("worker-1".into(), token_of(&lease)))
    );
    // Printer columns show owner and token.
    let table = s.cluster.kubectl_ok(&["get", "tl", "-n", &s.ns]);
    for column in ["TARGET", "HOLDER", "PHASE", "TOKEN", "EXPIRES", "AGE"] {
        assert!(table.contains(column), "{table}");
    }
    assert!(table.contains(&token_of(&lease).to_string()), "{table}");
}

// 2. A second claim waits; deleting the holder hands over within 1 s with a larger token.
async fn handover_on_delete(s: Scenario) {
    s.apply("holder", "shared", "worker-a", "");
    let held = s.wait_phase("holder", Phase::Held, 30 * SEC).await;
    s.apply("waiter", "shared", "worker-b", "");
    let waiting = s.wait_phase("waiter", Phase::Waiting, 30 * SEC).await;
    let status = waiting.status.clone().expect("status");
    assert_eq!(status.held_by.as_deref(), Some("worker-a"));
    assert_eq!(
        condition(&waiting, "Ready").map(|c| c.reason.as_str()),
        Some("Waiting")
    );

    let mut stream = watcher(
        s.api(),
        watcher::Config::default().fields("metadata.name=waiter"),
    )
    .applied_objects()
    .boxed();
    // Drain the initial state so the clock starts at the delete.
    let _ = tokio::time::timeout(SEC, stream.next()).await;
    // Every write to both, and their deletions, in the API server's order: the deleted holder
    // must be gone or have left Held before the waiter shows Held (its lease is released in the
    // store only after that, and a copy still saying Held then would stand beside the new
    // holder's).
    let both = tokio::spawn({
        let mut writes = watcher(s.api(), watcher::Config::default()).boxed();
        async move {
            let mut latest: BTreeMap<String, Option<Phase>> = BTreeMap::new();
            while let Ok(Some(Ok(event))) = tokio::time::timeout(10 * SEC, writes.next()).await {
                match event {
                    watcher::Event::Apply(lease) | watcher::Event::InitApply(lease) => {
                        latest.insert(lease.name_any(), phase_of(&lease));
                    }
                    watcher::Event::Delete(lease) => {
                        latest.remove(&lease.name_any());
                    }
                    watcher::Event::Init | watcher::Event::InitDone => {}
                }
                let held = |name: &str| latest.get(name) == Some(&Some(Phase::Held));
                if held("waiter") {
                    return if held("holder") {
                        Err("the waiter showed Held while the deleted holder still did".to_string())
                    } else {
                        Ok(())
                    };
                }
            }
            Err("the waiter never showed Held".to_string())
        }
    });
    // Let the second watch start before the delete.
    tokio::time::sleep(SEC / 2).await;
    let start = Instant::now();
    s.delete("holder").await;
    let taken = loop {
        let next = tokio::time::timeout(5 * SEC, stream.next()).await;
        let lease = next
            .expect("hand-over within 5 s")
            .expect("watch")
            .expect("object");
        if phase_of(&lease) == Some(Phase::Held) {
            break lease;
        }
    };
    let took = start.elapsed();
    eprintln!("hand-over took {took:?}");
    assert!(took < SEC, "hand-over took {took:?}");
    assert!(token_of(&taken) > token_of(&held));
    both.await
        .expect("watch task")
        .unwrap_or_else(|e| panic!("{e}"));
    s.wait_gone("holder", 10 * SEC).await;
    // Events at transitions.
    let events = s.cluster.kubectl_ok(&[
        "get",
        "events.events.k8s.io",
        "-n",
        &s.ns,
        "-o",
        "jsonpath={range .items[*]}{.regarding.name}/{.reason}{\"\\n\"}{end}",
    ]);
    for expected in [
        "holder/Acquired",
        "waiter/Waiting",
        "waiter/Acquired",
        "holder/Released",
    ] {
        assert!(
            events.contains(expected),
            "no {expected} event in:\n{events}"
        );
    }
    // Metrics show the transitions and the hand-over.
    let controller = s.controller.as_ref().expect("controller");
    let (code, metrics) = http_get(&controller.http, "/metrics").expect("metrics endpoint");
    assert_eq!(code, 200);
    // The binary that runs names what it was built from.
    let build_info_series = format!(
        "targetlease_build_info{{version=\"{}\",commit=\"{}\",build_date=\"{}\"}} 1",
        targetlease::build_info::VERSION,
        targetlease::build_info::COMMIT,
        targetlease::build_info::BUILD_DATE
    );
    for needle in [
        "targetlease_handovers_total 1",
        "targetlease_transitions_total{phase=\"Held\"} 2",
        "targetlease_transitions_total{phase=\"Waiting\"} 1",
        "targetlease_store_call_seconds_count{op=\"acquire\"}",
        "targetlease_leases{phase=\"Held\"} 1",
        "targetlease_reconciles_total{result=\"ok\"}",
        &build_info_series,
    ] {
        assert!(
            metrics.contains(needle),
            "metrics lack {needle}:\n{metrics}"
        );
    }
    // A deletion that went through is no failure: the reconcile its Released status write
    // queues may run on the cached, deleting copy after the object is gone (seen about one
    // deletion in five), and its cleanup is then done, not failed.
    for _ in 0..15 {
        s.apply("cycled", "cycled", "worker-c", "");
        s.wait_phase("cycled", Phase::Held, 30 * SEC).await;
        s.delete("cycled").await;
        s.wait_gone("cycled", 10 * SEC).await;
    }
    tokio::time::sleep(SEC).await;
    let (_, metrics) = http_get(&controller.http, "/metrics").expect("metrics endpoint");
    // (A status write refused as stale, `kube`, is an expected retry; a finalizer patch is not.)
    let failed: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("targetlease_reconciles_total{result=\"finalizer\"}"))
        .collect();
    assert!(
        failed.is_empty(),
        "finalizer patches failed around deletions: {failed:?}\n{}",
        controller.logs()
    );
}

// 2b. A reconcile queued by a cleanup's own status write can run on the cached, deleting copy
//     after the object is gone: its cleanup must then finish (the object is gone: nothing to
//     remove), and must not touch a new object that took the name meanwhile (a `run` command
//     creates its claim's name again right after deleting it). Called directly with the stale
//     copy, the controller stopped so that nothing else writes the finalizer.
async fn stale_cleanup_touches_only_its_own_object(mut s: Scenario) {
    use kube::runtime::controller::Action;
    use targetlease::api::FINALIZER;
    s.apply("reused", "reused", "worker-a", "");
    s.wait_phase("reused", Phase::Held, 30 * SEC).await;
    let stale = s
        .api()
        .delete("reused", &Default::default())
        .await
        .expect("delete")
        .left()
        .expect("deleting, not gone: the finalizer holds it");
    assert!(stale.metadata.deletion_timestamp.is_some());
    s.wait_gone("reused", 10 * SEC).await;
    s.controller().terminate();
    s.controller = None;
    let stale = Arc::new(stale);
    let cleanup_of_stale = |stale: Arc<TargetLease>| {
        let api = s.api();
        async move {
            targetlease::controller::finalizer::finalizer(
                &api,
                FINALIZER,
                &targetlease::controller::finalizer::Removed::default(),
                stale,
                |event| async move {
                    match event {
                        kube::runtime::finalizer::Event::Cleanup(_) => {
                            Ok::<_, std::io::Error>(Action::await_change())
                        }
                        kube::runtime::finalizer::Event::Apply(_) => {
                            panic!("a deleting copy was applied")
                        }
                    }
                },
            )
            .await
        }
    };
    // Gone: the cleanup is done.
    if let Err(e) = cleanup_of_stale(stale.clone()).await {
        panic!("the stale copy's cleanup, its object gone, failed: {e}");
    }
    // The name taken again, by an object with the controller's finalizer.
    let yaml = lease_yaml(&s.ns, "reused", "reused", "worker-b", "").replace(
        "metadata:\n",
        &format!("metadata:\n  finalizers: [{FINALIZER}]\n"),
    );
    s.cluster.apply(&yaml);
    let new = s.get("reused").await;
    assert_ne!(new.uid(), stale.uid());
    // Its removal is refused (the uid differs) and the cleanup counts as done.
    let finished = cleanup_of_stale(stale.clone()).await;
    let after = s.get("reused").await;
    let kept = after.finalizers().iter().any(|f| f == FINALIZER);
    // Let the namespace go at the end.
    s.api()
        .patch(
            "reused",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("drop the finalizer");
    assert!(
        kept,
        "the stale copy's cleanup removed the finalizer of the new object under its name"
    );
    if let Err(e) = finished {
        panic!("the stale copy's cleanup, its name taken by another object, failed: {e}");
    }
}

// 3. Invalid resources are refused by the API server with a message naming the field.
async fn invalid_resources_are_refused(s: Scenario) {
    let bad: [(&str, &str, &str, &str); 11] = [
        ("empty target", "\"\"", "w", "spec.target"),
        ("braces in target", "\"a{b}\"", "w", "spec.target"),
        ("long target", &"x".repeat(201), "w", "spec.target"),
        ("ttl 0", "t", "w\n  ttlSeconds: 0", "spec.ttlSeconds"),
        (
            "ttl too large",
            "t",
            "w\n  ttlSeconds: 3601",
            "spec.ttlSeconds",
        ),
        (
            "negative maxHold",
            "t",
            "w\n  maxHoldSeconds: -5",
            "spec.maxHoldSeconds",
        ),
        (
            "maxHold below ttl",
            "t",
            "w\n  ttlSeconds: 60\n  maxHoldSeconds: 30",
            "spec.maxHoldSeconds",
        ),
        ("unknown field", "t", "w\n  colour: blue", "colour"),
        ("holder with space", "t", "\"w x\"", "spec.holder"),
        (
            "holderRef kind",
            "t",
            "w\n  holderRef: {kind: Deployment, name: x}",
            "spec.holderRef.kind",
        ),
        (
            "ttl not a number",
            "t",
            "w\n  ttlSeconds: soon",
            "spec.ttlSeconds",
        ),
    ];
    for (i, (what, target, holder_and_more, field)) in bad.iter().enumerate() {
        let yaml = lease_yaml(&s.ns, &format!("bad-{i}"), target, holder_and_more, "");
        let out = s
            .cluster
            .kubectl_with_input(&["apply", "-f", "-"], Some(&yaml));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: accepted:\n{yaml}");
        assert!(
            stderr.contains(field),
            "{what}: message does not name {field}: {stderr}"
        );
    }
    // Immutable fields.
    s.apply("fixed", "t", "w", "");
    for (what, change, field) in [
        (
            "changed target",
            r#"{"spec":{"target":"other"}}"#,
            "target is immutable",
        ),
        (
            "changed holder",
            r#"{"spec":{"holder":"other"}}"#,
            "holder is immutable",
        ),
    ] {
        let out = s.cluster.kubectl(&[
            "patch",
            "tl",
            "fixed",
            "-n",
            &s.ns,
            "--type=merge",
            "-p",
            change,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: accepted");
        assert!(stderr.contains(field), "{what}: {stderr}");
    }
    // A TTL the API server accepts but this controller cannot keep (its call timeout is 1 s:
    // three of them is 3 s) is refused with a condition that says what to do, and taken once
    // the spec is fixed.
    s.apply("hasty", "hasty-target", "w", "ttlSeconds: 2");
    let refused = s
        .wait("hasty", "TTLTooShort", 30 * SEC, |l| {
            condition(l, "Ready").is_some_and(|c| c.reason == "TTLTooShort")
        })
        .await;
    assert_eq!(phase_of(&refused), Some(Phase::Failed));
    let message = condition(&refused, "Ready").map(|c| c.message.clone());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("3 s") && m.contains("raise spec.ttlSeconds")),
        "{message:?}"
    );
    assert!(
        s.inspect("hasty-target").await.lease.is_none(),
        "a lease was taken"
    );
    s.cluster.kubectl_ok(&[
        "patch",
        "tl",
        "hasty",
        "-n",
        &s.ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"ttlSeconds":3}}"#,
    ]);
    s.wait_phase("hasty", Phase::Held, 30 * SEC).await;
}

// 4. holderRef: deleting the holder pod releases the lease and the waiter gets it within 2 s.
async fn holder_pod_gone_releases(s: Scenario) {
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: worker-pod\n  namespace: {}\nspec:\n  containers:\n  - name: main\n    image: example.invalid/worker:1\n",
        s.ns
    );
    s.cluster.apply(&pod);
    s.apply(
        "by-pod",
        "pod-target",
        "worker-pod",
        "holderRef: {kind: Pod, name: worker-pod}",
    );
    let held = s.wait_phase("by-pod", Phase::Held, 30 * SEC).await;
    s.apply("next", "pod-target", "worker-next", "");
    s.wait_phase("next", Phase::Waiting, 30 * SEC).await;
    let start = Instant::now();
    s.cluster.kubectl_ok(&[
        "delete",
        "pod",
        "worker-pod",
        "-n",
        &s.ns,
        "--grace-period=0",
        "--force",
    ]);
    let released = s.wait_phase("by-pod", Phase::Released, 5 * SEC).await;
    let next = s.wait_phase("next", Phase::Held, 5 * SEC).await;
    let took = start.elapsed();
    eprintln!("holder pod deleted -> waiter held in {took:?}");
    assert!(took < 2 * SEC, "took {took:?}");
    assert_eq!(
        condition(&released, "Ready").map(|c| c.reason.as_str()),
        Some("HolderGone")
    );
    assert!(token_of(&next) > token_of(&held));
    // A TargetLease whose holder pod never existed does not hold.
    s.apply(
        "orphan",
        "orphan-target",
        "ghost",
        "holderRef: {kind: Pod, name: ghost}",
    );
    s.wait_phase("orphan", Phase::Released, 30 * SEC).await;
    // A pod of that name with another uid (recreated, as a StatefulSet does) is not the holder;
    // the right uid is.
    s.cluster.apply(&pod);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(s.client.clone(), &s.ns);
    let uid = pods
        .get("worker-pod")
        .await
        .expect("pod")
        .uid()
        .expect("uid");
    s.apply(
        "stale-uid",
        "uid-target",
        "worker-pod",
        "holderRef: {kind: Pod, name: worker-pod, uid: 0b1e7a52-uid-of-an-earlier-pod}",
    );
    let refused = s.wait_phase("stale-uid", Phase::Released, 30 * SEC).await;
    assert_eq!(
        condition(&refused, "Ready").map(|c| c.reason.as_str()),
        Some("HolderGone")
    );
    s.apply(
        "right-uid",
        "uid-target-2",
        "worker-pod",
        &format!("holderRef: {{kind: Pod, name: worker-pod, uid: {uid}}}"),
    );
    s.wait_phase("right-uid", Phase::Held, 30 * SEC).await;
}

// 4b. Holder pods off (--no-holder-pods): a controller whose ServiceAccount may read no pod
// works, keeps a holderRef lease Held (its holder is not tracked), and never asks for a pod. The
// same account with the default scope does ask and is refused: the control that shows the log
// would tell. (--holder-pod-namespaces is the same switch per namespace: unit tests of
// holders::PodScope, and the chart's Roles in tests/packaging/chart.rs.)
async fn holder_pods_narrowed_need_no_pod_access(mut s: Scenario) {
    let ns = s.ns.clone();
    s.cluster.apply(&format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: no-pods, namespace: {ns}}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: no-pods, namespace: {ns}}}\n\
         rules:\n\
         - {{apiGroups: [targetlease.dev], resources: [targetleases], verbs: [list, watch, patch]}}\n\
         - {{apiGroups: [targetlease.dev], resources: [targetleases/status], verbs: [patch]}}\n\
         - {{apiGroups: [events.k8s.io], resources: [events], verbs: [create, patch]}}\n\
         - {{apiGroups: [coordination.k8s.io], resources: [leases], verbs: [create]}}\n\
         - {{apiGroups: [coordination.k8s.io], resources: [leases], resourceNames: [targetlease-installation], verbs: [get]}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: no-pods, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: no-pods}}\n\
         subjects: [{{kind: ServiceAccount, name: no-pods, namespace: {ns}}}]\n"
    ));
    let kubeconfig = s.cluster.service_account_kubeconfig(&ns, "no-pods");
    let forbidden = |logs: &str| logs.contains("pod watch failed") || logs.contains("forbidden");
    s.controller().terminate();
    s.controller = Some(s.start_controller_as(&kubeconfig, &["--no-holder-pods"]));
    s.apply(
        "untracked",
        "untracked-target",
        "ghost",
        "holderRef: {kind: Pod, name: ghost}",
    );
    s.wait_phase("untracked", Phase::Held, 30 * SEC).await;
    // A tracked ghost is released within a reconcile; an untracked one stays Held.
    tokio::time::sleep(3 * SEC).await;
    assert_eq!(phase_of(&s.get("untracked").await), Some(Phase::Held));
    let logs = s.controller().logs();
    assert!(!forbidden(&logs), "the controller asked for pods:\n{logs}");
    s.controller().terminate();
    s.controller = Some(s.start_controller_as(&kubeconfig, &[]));
    let deadline = Instant::now() + 30 * SEC;
    while !forbidden(&s.controller().logs()) {
        assert!(
            Instant::now() < deadline,
            "the control never asked for pods:\n{}",
            s.controller().logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// 5a. SIGKILL and restart within the TTL: owner and token unchanged, renewals carry on.
async fn controller_restart_keeps_leases(mut s: Scenario) {
    s.apply("kept", "restart-target", "worker-1", "ttlSeconds: 6");
    let before = s.wait_phase("kept", Phase::Held, 30 * SEC).await;
    s.controller().kill();
    tokio::time::sleep(2 * SEC).await;
    s.controller = Some(s.start_controller(&[]));
    // Longer than the TTL: only renewals by the new process can keep it.
    tokio::time::sleep(8 * SEC).await;
    let after = s.get("kept").await;
    assert_eq!(phase_of(&after), Some(Phase::Held));
    assert_eq!(token_of(&after), token_of(&before));
    let seen = s.inspect("restart-target").await;
    let lease = seen.lease.expect("still held in Valkey");
    assert_eq!(
        (lease.owner.as_str(), lease.token),
        ("worker-1", token_of(&before))
    );
}

// 5b. Two replicas with leader election: killing the leader, the other carries on.
async fn leader_failover_keeps_leases(mut s: Scenario) {
    let mut a = s.start_replica("replica-a", None);
    // Replace the scenario's plain controller by two electing replicas.
    s.controller.take();
    let b = s.start_replica("replica-b", None);
    s.apply("ha", "ha-target", "worker-1", "ttlSeconds: 9");
    let before = s.wait_phase("ha", Phase::Held, 30 * SEC).await;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(s.client.clone(), &s.ns);
    let leader = leases
        .get("targetlease-controller")
        .await
        .expect("leader Lease")
        .spec
        .and_then(|spec| spec.holder_identity)
        .expect("a leader");
    let (mut leader_proc, survivor) = if leader == "replica-a" {
        (a, b)
    } else {
        (b, a)
    };
    leader_proc.kill();
    a = survivor;
    // Longer than the TTL: the survivor must have taken over the renewals.
    tokio::time::sleep(12 * SEC).await;
    let after = s.get("ha").await;
    assert_eq!(phase_of(&after), Some(Phase::Held), "{}", a.logs());
    assert_eq!(
        token_of(&after),
        token_of(&before),
        "the lease changed hands"
    );
    let seen = s.inspect("ha-target").await;
    assert_eq!(seen.lease.map(|l| l.token), Some(token_of(&before)));
    let now_leading = leases
        .get("targetlease-controller")
        .await
        .expect("leader Lease")
        .spec
        .and_then(|spec| spec.holder_identity);
    assert_ne!(now_leading.as_deref(), Some(leader.as_str()));
    // SIGTERM: clean exit, lease not released.
    let status = a.terminate();
    assert!(status.success(), "controller exited with {status}");
    let seen = s.inspect("ha-target").await;
    assert!(seen.lease.is_some(), "SIGTERM released the lease");
}

// 5c. A leader cut off from the API server only (a proxy that holds its bytes; Valkey still
//     reachable) stops acting before the other replica takes over, and what it had sent arrives
//     later without overwriting a newer status.
async fn cut_off_leader_stops_first(mut s: Scenario) {
    s.controller.take();
    let proxy = Proxy::start(s.cluster.apiserver_port()).await;
    let via_proxy = s.cluster.kubeconfig_via(proxy.port);
    let a = s.start_replica("replica-a", Some(&via_proxy));
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(s.client.clone(), &s.ns);
    let holder_of_lease = || async {
        leases
            .get_opt("targetlease-controller")
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec)
            .and_then(|spec| spec.holder_identity)
    };
    let deadline = Instant::now() + 30 * SEC;
    while holder_of_lease().await.as_deref() != Some("replica-a") {
        assert!(Instant::now() < deadline, "replica-a never led");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = s.start_replica("replica-b", None);
    s.apply("holder", "cut-target", "worker-1", "ttlSeconds: 9");
    let held = s.wait_phase("holder", Phase::Held, 30 * SEC).await;
    s.apply("waiter", "cut-target", "worker-2", "ttlSeconds: 9");
    s.wait_phase("waiter", Phase::Waiting, 30 * SEC).await;
    let leading = |c: &ControllerProcess| scraped(&c.http, "targetlease_leading");
    assert_eq!(leading(&a), 1.0);
    assert_eq!(leading(&b), 0.0);

    // Cut A off from the API server: its requests hang, its Valkey works.
    proxy.set(Mode::Stall);
    let cut = Instant::now();
    let (mut a_stopped, mut b_leads) = (None, None);
    while a_stopped.is_none() || b_leads.is_none() {
        assert!(cut.elapsed() < 30 * SEC, "a={a_stopped:?} b={b_leads:?}");
        if a_stopped.is_none() && leading(&a) == 0.0 {
            a_stopped = Some(cut.elapsed());
        }
        if b_leads.is_none() && leading(&b) == 1.0 {
            b_leads = Some(cut.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (a_stopped, b_leads) = (a_stopped.unwrap_or_default(), b_leads.unwrap_or_default());
    eprintln!("cut-off leader stopped after {a_stopped:?}; the other led after {b_leads:?}");
    assert!(
        a_stopped < b_leads,
        "the cut-off leader acted until {a_stopped:?}, the other led from {b_leads:?}"
    );
    let calls = |c: &ControllerProcess| {
        ["renew", "acquire", "release", "inspect"].map(|op| {
            scraped(
                &c.http,
                &format!("targetlease_store_call_seconds_count{{op=\"{op}\"}}"),
            )
        })
    };
    let a_calls = calls(&a);

    // B acts: the holder is released, the waiter takes the target. A, had it gone on, would
    // renew the holder, learn it lost and write Lost over Released.
    s.api()
        .patch(
            "holder",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"release": true}})),
        )
        .await
        .expect("release the holder");
    let released = s.wait_phase("holder", Phase::Released, 30 * SEC).await;
    let taken = s.wait_phase("waiter", Phase::Held, 30 * SEC).await;
    assert!(token_of(&taken) > token_of(&held));
    // Two renewal intervals, then the partition heals and A's held bytes arrive.
    tokio::time::sleep(6 * SEC).await;
    proxy.set(Mode::Pass);
    tokio::time::sleep(4 * SEC).await;
    let (holder, waiter) = (s.get("holder").await, s.get("waiter").await);
    assert_eq!(
        phase_of(&holder),
        Some(Phase::Released),
        "{:?}",
        holder.status
    );
    assert_eq!(holder.resource_version(), released.resource_version());
    assert_eq!(phase_of(&waiter), Some(Phase::Held), "{:?}", waiter.status);
    assert_eq!(token_of(&waiter), token_of(&taken));
    assert_eq!(calls(&a), a_calls, "the cut-off leader called the store");
    assert_eq!(leading(&a), 0.0, "A leads again after the partition healed");
    assert!(a.logs().contains("leadership lapsed"), "{}", a.logs());
    // What a late write from a stale read would meet: the controller's status patch (forced
    // server-side apply) carries the resourceVersion it was decided on, and the API server
    // refuses it once the object moved on.
    let stale = serde_json::json!({
        "apiVersion": "targetlease.dev/v1beta1",
        "kind": "TargetLease",
        "metadata": {"resourceVersion": held.resource_version()},
        "status": held.status,
    });
    let refused = s
        .api()
        .patch_status(
            "holder",
            &PatchParams::apply(targetlease::api::FIELD_MANAGER).force(),
            &Patch::Apply(&stale),
        )
        .await
        .expect_err("a status write based on a stale read");
    assert!(
        matches!(&refused, kube::Error::Api(e) if e.code == 409),
        "{refused}"
    );
    assert_eq!(phase_of(&s.get("holder").await), Some(Phase::Released));
    drop(b);
}

// 5d. A leader whose leadership lapsed during a short API outage, with no other replica to take
//     over, leads again once its renewal gets through: it must run its work again, not keep the
//     Lease while nothing reconciles.
async fn lapsed_leader_leads_again(mut s: Scenario) {
    s.controller.take();
    let proxy = Proxy::start(s.cluster.apiserver_port()).await;
    let via_proxy = s.cluster.kubeconfig_via(proxy.port);
    let alone = s.start_replica("alone", Some(&via_proxy));
    let leading = |c: &ControllerProcess| scraped(&c.http, "targetlease_leading");
    let wait_leading = |want: f64, limit: Duration| {
        let started = Instant::now();
        while leading(&alone) != want {
            assert!(
                started.elapsed() < limit,
                "targetlease_leading never became {want}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    };
    wait_leading(1.0, 30 * SEC);
    s.apply("before", "lapse-target", "worker-1", "ttlSeconds: 9");
    s.wait_phase("before", Phase::Held, 30 * SEC).await;
    // Long enough for the deadline (2 s after the last renewal) to pass, shorter than anything
    // else would notice.
    proxy.set(Mode::Stall);
    let lapsed = wait_leading(0.0, 10 * SEC);
    eprintln!("leadership lapsed {lapsed:?} into the outage");
    proxy.set(Mode::Pass);
    let back = wait_leading(1.0, 10 * SEC);
    eprintln!("leading again {back:?} after the outage ended");
    s.apply("after", "lapse-target-2", "worker-2", "ttlSeconds: 9");
    s.wait_phase("after", Phase::Held, 30 * SEC).await;
    assert_eq!(phase_of(&s.get("before").await), Some(Phase::Held));
}

// 6. expiresAt stays true: never in the past while Held over 3 x TTL, at the cost of one status
//    write per two renewals (the renewals themselves live in Valkey).
async fn expires_at_stays_true(s: Scenario) {
    s.apply("quiet", "quiet-target", "worker-1", "ttlSeconds: 3");
    let first = s.wait_phase("quiet", Phase::Held, 30 * SEC).await;
    let http = s.controller.as_ref().expect("controller").http.clone();
    let renewals = || scraped(&http, "targetlease_store_call_seconds_count{op=\"renew\"}");
    let renewed_before = renewals();
    let start = Instant::now();
    let mut versions = std::collections::HashSet::new();
    // Five TTLs: the promise of four TTLs made at the grant moves once, when one TTL is left.
    while start.elapsed() < 15 * SEC {
        let lease = s.get("quiet").await;
        assert_eq!(phase_of(&lease), Some(Phase::Held));
        assert_eq!(token_of(&lease), token_of(&first));
        let status = lease.status.clone().expect("status");
        let expires = status.expires_at.expect("expiresAt while Held");
        let now = jiff::Timestamp::now();
        assert!(expires > now, "expiresAt {expires} is in the past at {now}");
        let promised = now + jiff::SignedDuration::from_secs(13);
        assert!(
            expires <= promised,
            "expiresAt {expires} is more than four TTLs ahead at {now}"
        );
        versions.insert(lease.resource_version());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let renewed = renewals() - renewed_before;
    let writes = versions.len() as f64 - 1.0;
    eprintln!("{renewed} renewals, {writes} status writes in 15 s");
    assert!(renewed >= 13.0, "{renewed} renewals");
    assert!(writes >= 1.0, "expiresAt did not move: {writes} writes");
    assert!(
        writes <= renewed / 9.0 + 1.0,
        "{writes} status writes for {renewed} renewals"
    );
}

/// `series` on the `/metrics` page of the controller serving at `http`.
fn scraped(http: &str, series: &str) -> f64 {
    let (_, page) = http_get(http, "/metrics").expect("metrics");
    metric(&page, series)
}

/// An administrator's connection to the scenario's Valkey, as a user of its own, so it keeps
/// working while the controller's user (`default`) is refused.
async fn valkey_admin(s: &Scenario) -> Admin {
    let plain = Admin::single(&s.valkey.url(), None).await;
    plain
        .cmd(&[
            "ACL",
            "SETUSER",
            "tl-admin",
            "on",
            ">admin-pw",
            "~*",
            "&*",
            "+@all",
        ])
        .await;
    let url = format!("redis://tl-admin:admin-pw@127.0.0.1:{}", s.valkey.port);
    Admin::single(&url, None).await
}

/// Changes the rights of the controller's user: `-@scripting` refuses every lease call.
async fn controller_rights(admin: &Admin, rule: &str) {
    admin.cmd(&["ACL", "SETUSER", "default", rule]).await;
}

// 6b. A short ACL refusal changes no phase (Held stays Held with the same token, Ready says
//     why); a refusal that outlasts the expiry the store last granted makes the claim Lost with
//     the Held condition Unknown, never before that expiry (the published expiresAt, a promise
//     the controller can keep only while it reaches the store, is not waited for); with the
//     store back it is Held again.
async fn store_refusals_within_the_expiry_keep_held(s: Scenario) {
    let admin = valkey_admin(&s).await;
    s.apply("blip", "blip-target", "worker-1", "ttlSeconds: 6");
    let held = s.wait_phase("blip", Phase::Held, 30 * SEC).await;
    controller_rights(&admin, "-@scripting").await;
    let refused_at = Instant::now();
    let mut refusal_seen = false;
    while !(refusal_seen && refused_at.elapsed() >= SEC) {
        assert!(refused_at.elapsed() < 10 * SEC, "no renewal was refused");
        let lease = s.get("blip").await;
        assert_eq!(phase_of(&lease), Some(Phase::Held), "{:?}", lease.status);
        assert_eq!(token_of(&lease), token_of(&held));
        refusal_seen |= condition(&lease, "Ready").is_some_and(|c| c.reason == "BackendAuthFailed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    controller_rights(&admin, "+@all").await;
    let ready = s
        .wait("blip", "Ready again", 15 * SEC, |l| {
            condition(l, "Ready").is_some_and(|c| c.status == "True")
        })
        .await;
    assert_eq!(phase_of(&ready), Some(Phase::Held));
    assert_eq!(token_of(&ready), token_of(&held));

    let seen = s.inspect("blip-target").await;
    let left = Duration::from_millis(seen.lease.expect("held in the store").expires_in_ms);
    controller_rights(&admin, "-@scripting").await;
    let store_expiry = Instant::now() + left;
    let lost = s
        .wait("blip", "Lost", 20 * SEC, |l| {
            phase_of(l) == Some(Phase::Lost)
        })
        .await;
    // The controller measured the grant from the send of its renewal, a round trip before the
    // store's clock read it.
    let early = store_expiry.saturating_duration_since(Instant::now());
    assert!(
        early < Duration::from_millis(50),
        "Lost {early:?} before the expiry the store granted"
    );
    assert_eq!(
        condition(&lost, "Held").map(|c| c.status.as_str()),
        Some("Unknown")
    );
    controller_rights(&admin, "+@all").await;
    let back = s.wait_phase("blip", Phase::Held, 30 * SEC).await;
    assert!(token_of(&back) > token_of(&held));
}

// 7. Valkey stopped: BackendUnavailable; deletion keeps the finalizer; a new claim is Pending
//    with that reason; Valkey back: released.
async fn backend_outage_keeps_finalizer(mut s: Scenario) {
    s.apply("outage", "outage-target", "worker-1", "ttlSeconds: 30");
    s.wait_phase("outage", Phase::Held, 30 * SEC).await;
    s.valkey.kill();
    s.delete("outage").await;
    let stuck = s
        .wait("outage", "BackendUnavailable", 30 * SEC, |l| {
            condition(l, "Ready").is_some_and(|c| c.reason == "BackendUnavailable")
        })
        .await;
    assert!(stuck.metadata.deletion_timestamp.is_some());
    // Whoever can read the TargetLease must not learn where Valkey is: the status names the
    // failure and what to do, the address is in the controller's log only.
    let shown = serde_json::to_string(&stuck.status).expect("status json");
    let port = s.valkey.port.to_string();
    assert!(
        !shown.contains(&format!("127.0.0.1:{port}")) && !shown.contains(&port),
        "the status names the Valkey address: {shown}"
    );
    assert!(shown.contains("controller's log"), "{shown}");
    assert!(
        s.controller().logs().contains(&port),
        "the details belong in the controller's log"
    );
    assert!(
        stuck
            .finalizers()
            .iter()
            .any(|f| f == "targetlease.dev/release")
    );
    tokio::time::sleep(2 * SEC).await;
    assert!(
        s.api().get_opt("outage").await.expect("get").is_some(),
        "finalizer dropped during the outage"
    );
    // A claim first reconciled during the outage: Pending, but with the store failure as its
    // reason, which tells it from a claim never reconciled (docs/troubleshooting.md).
    s.apply(
        "outage-new",
        "outage-target-2",
        "worker-2",
        "ttlSeconds: 30",
    );
    let pending = s
        .wait("outage-new", "a store reason", 30 * SEC, |l| {
            condition(l, "Ready").is_some_and(|c| c.reason == "BackendUnavailable")
        })
        .await;
    assert_eq!(phase_of(&pending), Some(Phase::Pending));
    assert_eq!(
        condition(&pending, "Reconciling").map(|c| c.status.as_str()),
        Some("True")
    );
    s.valkey.restart();
    // Valkey restarted without persistence: the lease record is gone, so the release finds
    // nothing to release; the finalizer must still go.
    s.wait_gone("outage", 60 * SEC).await;
    let _ = s.controller();
}

// Fair hand-over: five waiters created 200 ms apart get the target in creation order, and a
// claim with a higher spec.priority overtakes the ones still waiting.
async fn fair_handover_in_creation_order(s: Scenario) {
    s.apply("first", "queue-target", "holder-0", "");
    s.wait_phase("first", Phase::Held, 30 * SEC).await;
    let waiters: Vec<String> = (1..=5).map(|i| format!("waiter-{i}")).collect();
    for (i, name) in waiters.iter().enumerate() {
        s.apply(name, "queue-target", &format!("holder-{}", i + 1), "");
        s.wait_phase(name, Phase::Waiting, 30 * SEC).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut order = vec!["first".to_owned()];
    let mut took = Vec::new();
    let mut current = "first".to_owned();
    for step in 0..5 {
        if step == 2 {
            // Created last, but urgent: it goes before waiter-3, waiter-4 and waiter-5.
            s.apply("urgent", "queue-target", "holder-urgent", "priority: 10");
            s.wait_phase("urgent", Phase::Waiting, 30 * SEC).await;
        }
        let start = Instant::now();
        s.delete(&current).await;
        let next = loop {
            let all = s.api().list(&Default::default()).await.expect("list").items;
            let held: Vec<String> = all
                .iter()
                .filter(|l| {
                    l.metadata.deletion_timestamp.is_none() && phase_of(l) == Some(Phase::Held)
                })
                .map(|l| l.name_any())
                .collect();
            assert!(held.len() <= 1, "two TargetLeases show Held: {held:?}");
            if let Some(name) = held.first() {
                break name.clone();
            }
            assert!(
                start.elapsed() < 10 * SEC,
                "nobody took the target after {current}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        took.push(start.elapsed());
        order.push(next.clone());
        current = next;
    }
    eprintln!("hand-over order {order:?}, latencies {took:?}");
    assert_eq!(
        order,
        [
            "first", "waiter-1", "waiter-2", "urgent", "waiter-3", "waiter-4"
        ],
        "the target must pass in creation order, the priority claim first"
    );
    for t in &took {
        assert!(*t < SEC, "a hand-over took {t:?}");
    }
}

/// Touches a TargetLease's metadata (an annotation), which makes the controller reconcile it.
fn poke(s: &Scenario, name: &str, n: u32) {
    s.cluster.kubectl_ok(&[
        "annotate",
        "tl",
        name,
        "-n",
        &s.ns,
        &format!("poke={n}"),
        "--overwrite",
    ]);
}

// spec.release gives the lease up and keeps the resource; maxHoldSeconds bounds a tenure.
async fn release_flag_and_max_hold(mut s: Scenario) {
    s.apply("gitops", "flag-target", "worker-1", "");
    let held = s.wait_phase("gitops", Phase::Held, 30 * SEC).await;
    s.apply("next", "flag-target", "worker-2", "");
    s.wait_phase("next", Phase::Waiting, 30 * SEC).await;
    s.apply("gitops", "flag-target", "worker-1", "release: true");
    let released = s.wait_phase("gitops", Phase::Released, 10 * SEC).await;
    assert_eq!(
        condition(&released, "Ready").map(|c| (c.status.as_str(), c.reason.as_str())),
        Some(("True", "ReleaseRequested"))
    );
    let next = s.wait_phase("next", Phase::Held, 5 * SEC).await;
    assert!(token_of(&next) > token_of(&held));

    s.apply(
        "bounded",
        "bounded-target",
        "worker-3",
        "ttlSeconds: 30\nmaxHoldSeconds: 30",
    );
    let bounded = s.wait_phase("bounded", Phase::Held, 30 * SEC).await;
    // Pretend the tenure began 29 s ago: the bound is reached within about a second, long
    // before the next renewal (every 10 s).
    let status = bounded.status.clone().expect("status");
    let earlier = status.acquired_at.expect("acquiredAt") - jiff::SignedDuration::from_secs(29);
    let patch = serde_json::json!({"status": {"acquiredAt": earlier}});
    s.api()
        .patch_status("bounded", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch acquiredAt");
    poke(&s, "bounded", 1);
    let done = s.wait_phase("bounded", Phase::Released, 5 * SEC).await;
    assert_eq!(
        condition(&done, "Ready").map(|c| c.reason.as_str()),
        Some("MaxHoldReached")
    );
    // The spent claim stays released: it does not take the target again.
    let still = stays_spent(&s, 2, 2 * SEC, "a spent claim took the target again").await;
    assert_eq!(
        still
            .status
            .as_ref()
            .and_then(|st| st.max_hold_spent_generation),
        still.metadata.generation
    );
    // Through a Valkey outage (which rewrites the conditions) and a controller restart, the
    // spent claim stays spent when Valkey is back.
    s.valkey.kill();
    poke(&s, "bounded", 3);
    s.wait("bounded", "a store failure", 30 * SEC, |l| {
        condition(l, "Ready").is_some_and(|c| c.reason.starts_with("Backend"))
    })
    .await;
    s.valkey.restart();
    s.controller().kill();
    s.controller = Some(s.start_controller(&[]));
    stays_spent(
        &s,
        4,
        3 * SEC,
        "a spent claim took the target again after an outage and a restart",
    )
    .await;
}

/// Pokes the spent claim `bounded`, waits `settle`, and checks it is still Released and the
/// target is free in Valkey; answers the claim as it is then.
async fn stays_spent(s: &Scenario, poke_n: u32, settle: Duration, what: &str) -> TargetLease {
    poke(s, "bounded", poke_n);
    tokio::time::sleep(settle).await;
    let still = s.get("bounded").await;
    assert_eq!(phase_of(&still), Some(Phase::Released), "{what}");
    let seen = s.inspect("bounded-target").await;
    assert!(seen.lease.is_none(), "the target is held again");
    still
}

// 12. A TargetLease status forged by someone with `targetleases/status` rights (a fencing token
//     of 2^53-2, which the CRD's bound allows) neither exhausts the target nor pushes its tokens:
//     the controller ignores a token no store can have issued, and the target keeps handing over.
async fn forged_status_token_is_ignored(mut s: Scenario) {
    s.controller().kill();
    s.apply("forged", "forged-target", "mallory", "");
    s.api()
        .patch_status(
            "forged",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"status": {"phase": "Pending", "fencingToken": MAX_TOKEN - 1}}),
            ),
        )
        .await
        .expect("the status subresource takes any token up to 2^53-1");
    s.apply("claim", "forged-target", "worker", "");
    s.controller = Some(s.start_controller(&[]));
    let clock_bound = |lease: &TargetLease| {
        let now = u64::try_from(jiff::Timestamp::now().as_microsecond()).expect("after 1970");
        let token = token_of(lease);
        assert!(
            token <= now + MAX_TOKEN_LEAD_MICROS,
            "{}: token {token} pushed by the forged status",
            lease.name_any()
        );
    };
    let deadline = Instant::now() + 30 * SEC;
    let (first, second) = loop {
        assert!(Instant::now() < deadline, "neither claim became Held");
        let forged = s.get("forged").await;
        let claim = s.get("claim").await;
        if phase_of(&forged) == Some(Phase::Held) {
            break (forged, "claim");
        }
        if phase_of(&claim) == Some(Phase::Held) {
            break (claim, "forged");
        }
        for lease in [&forged, &claim] {
            assert_ne!(
                condition(lease, "Ready").map(|c| c.reason.as_str()),
                Some("InvalidRequest"),
                "{lease:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    clock_bound(&first);
    s.delete(&first.name_any()).await;
    let next = s.wait_phase(second, Phase::Held, 30 * SEC).await;
    clock_bound(&next);
    assert!(token_of(&next) > token_of(&first));
}

// ---- Leader election: a leader that cannot work steps aside, and a deleted leader Lease ----

/// The leader Lease of scenario `s`.
fn leader_leases(s: &Scenario) -> Api<k8s_openapi::api::coordination::v1::Lease> {
    Api::namespaced(s.client.clone(), &s.ns)
}

/// Who the leader Lease names (None when it is missing or released).
async fn lease_holder(s: &Scenario) -> Option<String> {
    leader_leases(s)
        .get_opt("targetlease-controller")
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|spec| spec.holder_identity)
        .filter(|h| !h.is_empty())
}

/// Waits until the leader Lease names `who`.
async fn wait_holder(s: &Scenario, who: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while lease_holder(s).await.as_deref() != Some(who) {
        assert!(
            Instant::now() < deadline,
            "{who} never held the leader Lease"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A kubeconfig whose ServiceAccount may run the election (Leases) and write TargetLeases, but
/// may not list or watch them: the controller's first list never completes.
fn no_list_kubeconfig(s: &Scenario) -> std::path::PathBuf {
    let ns = &s.ns;
    s.cluster.apply(&format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: no-list, namespace: {ns}}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: no-list, namespace: {ns}}}\n\
         rules:\n\
         - {{apiGroups: [coordination.k8s.io], resources: [leases], verbs: [get, create, update]}}\n\
         - {{apiGroups: [targetlease.dev], resources: [targetleases], verbs: [get, patch]}}\n\
         - {{apiGroups: [targetlease.dev], resources: [targetleases/status], verbs: [patch]}}\n\
         - {{apiGroups: [events.k8s.io], resources: [events], verbs: [create, patch]}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: no-list, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: no-list}}\n\
         subjects: [{{kind: ServiceAccount, name: no-list, namespace: {ns}}}]\n"
    ));
    s.cluster.service_account_kubeconfig(ns, "no-list")
}

/// Whether process `pid` has exited (gone, or a zombie not yet reaped).
fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X")
    })
}

// E1. A leader whose work cannot start (its first TargetLease list is forbidden) stops renewing
//     the leader Lease within the start bound and gives it up: another replica leads and
//     reconciles, and the stuck one no longer reports leading.
async fn stuck_leader_steps_aside(mut s: Scenario) {
    s.controller.take();
    let no_list = no_list_kubeconfig(&s);
    let a = s.start_replica("replica-a", Some(&no_list));
    wait_holder(&s, "replica-a", 30 * SEC).await;
    let led = Instant::now();
    let b = s.start_replica("replica-b", None);
    s.apply("stuck", "stuck-target", "worker-1", "ttlSeconds: 9");
    // The start bound (the 3 s duration), the wind-down and the release: about 5 s.
    let limit = 20 * SEC;
    loop {
        let lease = s.api().get_opt("stuck").await.expect("get TargetLease");
        if lease.as_ref().and_then(phase_of) == Some(Phase::Held) {
            break;
        }
        assert!(
            led.elapsed() < limit,
            "nothing reconciled {:?} after replica-a led: the leader Lease names {:?}, \
             replica-a reports leading {}, replica-b {}\nreplica-a log:\n{}",
            led.elapsed(),
            lease_holder(&s).await,
            scraped(&a.http, "targetlease_leading"),
            scraped(&b.http, "targetlease_leading"),
            a.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("Held {:?} after the stuck replica led", led.elapsed());
    assert_eq!(lease_holder(&s).await.as_deref(), Some("replica-b"));
    assert_eq!(scraped(&a.http, "targetlease_leading"), 0.0);
    assert!(!exited(a.pid()), "the stuck replica exited");
    assert!(
        a.logs().contains("did not start"),
        "no word of why it stepped aside:\n{}",
        a.logs()
    );
}

// E2. SIGTERM to a leader whose first list never completes: the process exits within a bounded
//     time (its leadership deadline plus a retry period, then the release), and gives the Lease
//     up, so the next replica leads at once.
async fn stuck_leader_exits_on_sigterm(mut s: Scenario) {
    s.controller.take();
    let no_list = no_list_kubeconfig(&s);
    let a = s.start_replica("replica-a", Some(&no_list));
    wait_holder(&s, "replica-a", 30 * SEC).await;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(a.pid()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let sent = Instant::now();
    while !exited(a.pid()) {
        assert!(
            sent.elapsed() < 15 * SEC,
            "no exit {:?} after SIGTERM; the leader Lease names {:?}\nlog:\n{}",
            sent.elapsed(),
            lease_holder(&s).await,
            a.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = sent.elapsed();
    eprintln!("exited {took:?} after SIGTERM");
    // 2 s leadership deadline + 0.75 s wind-down + 0.75 s release, and a margin for a busy
    // machine.
    assert!(took < 6 * SEC, "exit took {took:?}");
    assert_eq!(lease_holder(&s).await, None, "the Lease was not given up");
    let started = Instant::now();
    let _b = s.start_replica("replica-b", None);
    s.apply("after", "sigterm-target", "worker-1", "ttlSeconds: 9");
    s.wait_phase("after", Phase::Held, 20 * SEC).await;
    eprintln!(
        "Held {:?} after the next replica started",
        started.elapsed()
    );
}

// E3. Deleting the leader Lease never makes two leaders: the other replica takes a missing Lease
//     only once it has seen it missing for the whole duration, so a leader cut off from the API
//     server has stopped first; a leader that can reach the API server recreates it and carries
//     on. `targetlease_leading` of both replicas is sampled every 20 ms throughout.
async fn deleted_leader_lease_never_two_leaders(mut s: Scenario) {
    s.controller.take();
    let proxy = Proxy::start(s.cluster.apiserver_port()).await;
    let via_proxy = s.cluster.kubeconfig_via(proxy.port);
    let a = s.start_replica("replica-a", Some(&via_proxy));
    wait_holder(&s, "replica-a", 30 * SEC).await;
    let b = s.start_replica("replica-b", None);
    let leading = |http: &str| {
        http_get(http, "/metrics").map(|(_, page)| metric(&page, "targetlease_leading"))
    };
    let origin = Instant::now();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (a, b, stop) = (a.http.clone(), b.http.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let at = origin.elapsed();
                if let (Some(x), Some(y)) = (leading(&a), leading(&b)) {
                    samples.push((at, x, y));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            samples
        })
    };
    while leading(&a.http) != Some(1.0) {
        assert!(
            origin.elapsed() < 10 * SEC,
            "replica-a never reported leading"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let delete = || async {
        leader_leases(&s)
            .delete("targetlease-controller", &Default::default())
            .await
            .expect("delete the leader Lease");
    };
    // The leader cut off from the API server, its Lease deleted.
    proxy.set(Mode::Stall);
    delete().await;
    let deleted = origin.elapsed();
    while leading(&b.http) != Some(1.0) {
        assert!(
            origin.elapsed() < deleted + 15 * SEC,
            "replica-b never led after the deletion"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b_led = origin.elapsed() - deleted;
    proxy.set(Mode::Pass);
    tokio::time::sleep(2 * SEC).await;
    // The leader connected: it recreates the Lease, the follower never takes it. Each
    // deletion waits for the recreated Lease (a loaded machine's leader took over 2 s once).
    let connected = origin.elapsed();
    for round in 0..3 {
        let since = Instant::now();
        while lease_holder(&s).await.is_none() {
            assert!(
                since.elapsed() < 15 * SEC,
                "the leader did not recreate its Lease within 15 s of deletion {round}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        delete().await;
        tokio::time::sleep(2 * SEC).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let samples = sampler.join().expect("sampler");
    let both: Vec<_> = samples
        .iter()
        .filter(|(_, x, y)| *x == 1.0 && *y == 1.0)
        .map(|(at, _, _)| *at)
        .collect();
    let none_connected = samples
        .iter()
        .filter(|(at, x, y)| *at > connected && *x == 0.0 && *y == 0.0)
        .count();
    let follower_led_connected = samples
        .iter()
        .filter(|(at, x, _)| *at > connected && *x == 1.0)
        .count();
    // The longest stretch without a leader while connected. A leader whose renewal outlasts
    // its acting window on a loaded machine stops leading until its next renewal (it fences
    // itself; that is not what this test is about); a leader that gave the deleted Lease up
    // would leave none for the whole duration (3 s) before anyone took it again.
    let longest_none = samples
        .iter()
        .filter(|(at, _, _)| *at > connected)
        .fold(
            (Duration::ZERO, None::<Duration>),
            |(longest, since), (at, x, y)| match (*x == 0.0 && *y == 0.0, since) {
                (true, None) => (longest, Some(*at)),
                (true, Some(start)) => (longest.max(*at - start), Some(start)),
                (false, _) => (longest, None),
            },
        )
        .0;
    let a_stopped = samples
        .iter()
        .find(|(at, x, _)| *at > deleted && *x == 0.0)
        .map(|(at, _, _)| *at - deleted);
    eprintln!(
        "{} samples; cut-off leader stopped {a_stopped:?} after the deletion, the other led \
         {b_led:?} after it; both leading in {} samples ({:?} .. {:?}); no leader in {} \
         samples while connected (longest stretch {longest_none:?})",
        samples.len(),
        both.len(),
        both.first(),
        both.last(),
        none_connected
    );
    assert!(samples.len() > 200, "{} samples", samples.len());
    assert!(both.is_empty(), "two leaders at once at {both:?}");
    // Duration (3 s) plus two retry periods (0.75 s): the first look that sees the Lease
    // missing, and the look that takes it; a second for a busy machine.
    assert!(
        b_led < Duration::from_millis(5500),
        "the other led {b_led:?} after the deletion"
    );
    assert_eq!(
        follower_led_connected, 0,
        "the follower took a Lease its connected leader recreates"
    );
    assert!(
        longest_none < Duration::from_millis(2500),
        "no leader for {longest_none:?} while the leader was connected: it gave the deleted \
         Lease up instead of recreating it"
    );
    assert_eq!(lease_holder(&s).await.as_deref(), Some("replica-b"));
}

// ---- Statuses that claim no more than the controller knows, and the order of the line ----

/// A ServiceAccount `name` in the scenario's namespace with the rights the controller needs
/// there, and the holder-pod rights (get, list, watch) only when `pods` is set; applying it
/// again changes the rights in place. Answers a kubeconfig for it.
fn controller_account(s: &Scenario, name: &str, pods: bool) -> std::path::PathBuf {
    controller_account_with(s, name, pods, true)
}

/// [`controller_account`], with or without the right to write TargetLease statuses.
fn controller_account_with(
    s: &Scenario,
    name: &str,
    pods: bool,
    status: bool,
) -> std::path::PathBuf {
    let ns = &s.ns;
    let pod_rule = if pods {
        "- {apiGroups: [\"\"], resources: [pods], verbs: [get, list, watch]}\n"
    } else {
        ""
    };
    let status_verbs = if status { "[patch]" } else { "[get]" };
    s.cluster.apply(&format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {name}, namespace: {ns}}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: {name}, namespace: {ns}}}\n\
         rules:\n\
         - {{apiGroups: [targetlease.dev], resources: [targetleases], verbs: [list, watch, patch]}}\n\
         - {{apiGroups: [targetlease.dev], resources: [targetleases/status], verbs: {status_verbs}}}\n\
         - {{apiGroups: [events.k8s.io], resources: [events], verbs: [create, patch]}}\n\
         - {{apiGroups: [coordination.k8s.io], resources: [leases], verbs: [create]}}\n\
         - {{apiGroups: [coordination.k8s.io], resources: [leases], resourceNames: [targetlease-installation], verbs: [get]}}\n\
         {pod_rule}---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: {name}, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: {name}}}\n\
         subjects: [{{kind: ServiceAccount, name: {name}, namespace: {ns}}}]\n"
    ));
    let user = format!("system:serviceaccount:{ns}:{name}");
    let rights = [
        (["get", "pods", ""], pods),
        (["patch", "targetleases.targetlease.dev", "status"], status),
    ];
    for ([verb, resource, subresource], granted) in rights {
        let want = if granted { "yes" } else { "no" };
        let deadline = Instant::now() + 10 * SEC;
        let sub = format!("--subresource={subresource}");
        loop {
            let out = s.cluster.kubectl(&[
                "auth", "can-i", verb, resource, &sub, "-n", ns, "--as", &user,
            ]);
            if String::from_utf8_lossy(&out.stdout).trim() == want {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{verb} {resource} never became {want}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    s.cluster.service_account_kubeconfig(ns, name)
}

// A grant whose status write is refused is not granted again: the controller renews what the
// store granted from the moment it answered, and publishes that very grant once it may write
// (here its right to write statuses is withdrawn for four TTLs). A controller that renewed only
// what a status showed let the grant expire and took a second one with a larger token, and a
// late write of the first then stood beside the second in the store (renewals of it answered
// "another claim holds the target").
async fn refused_status_write_takes_no_second_grant(mut s: Scenario) {
    let kubeconfig = controller_account_with(&s, "no-status", true, false);
    s.controller().terminate();
    s.controller = Some(s.start_controller_as(&kubeconfig, &[]));
    s.apply("unwritten", "unwritten-target", "worker-1", "ttlSeconds: 3");
    let store = s.store().await;
    let target = s.target("unwritten-target");
    let start = Instant::now();
    let first = loop {
        let seen = store.inspect(&target).await.expect("inspect");
        if let Some(lease) = seen.lease {
            break lease.token;
        }
        assert!(
            start.elapsed() < 30 * SEC,
            "the store never granted the target"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut tokens = std::collections::BTreeSet::from([first]);
    let watched = Instant::now();
    while watched.elapsed() < 12 * SEC {
        let seen = store.inspect(&target).await.expect("inspect");
        match seen.lease {
            Some(lease) => {
                tokens.insert(lease.token);
            }
            None => panic!(
                "the grant expired {:?} after it was made: it was not renewed while its status \
                 write was refused",
                watched.elapsed()
            ),
        }
        let lease = s.get("unwritten").await;
        assert_ne!(
            phase_of(&lease),
            Some(Phase::Held),
            "written without the right"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(tokens.len(), 1, "granted again: tokens {tokens:?}");
    controller_account_with(&s, "no-status", true, true);
    let held = s.wait_phase("unwritten", Phase::Held, 60 * SEC).await;
    assert_eq!(
        token_of(&held),
        first,
        "published another grant than the first"
    );
    let seen = store.inspect(&target).await.expect("inspect");
    assert_eq!(seen.lease.map(|l| l.token), Some(first));
}

// A holder pod the controller can no longer read (its pod rights removed, then a restart that
// empties its cache) stops no renewal: the lease stays Held with its token and an expiresAt in
// the future, past three TTLs, and Ready=False with reason HolderUnknown says the holder is not
// tracked; a new holderRef claim is taken meanwhile. With the rights back, Ready again.
async fn unreadable_holder_pod_keeps_renewing(mut s: Scenario) {
    let kubeconfig = controller_account(&s, "pod-reader", true);
    s.controller().terminate();
    s.controller = Some(s.start_controller_as(&kubeconfig, &[]));
    s.cluster.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: worker-pod\n  namespace: {}\nspec:\n  containers:\n  - name: main\n    image: example.invalid/worker:1\n",
        s.ns
    ));
    let by_pod = "holderRef: {kind: Pod, name: worker-pod}\nttlSeconds: 3";
    s.apply("by-pod", "unread-target", "worker-pod", by_pod);
    let held = s.wait_phase("by-pod", Phase::Held, 30 * SEC).await;
    controller_account(&s, "pod-reader", false);
    s.controller().kill();
    s.controller = Some(s.start_controller_as(&kubeconfig, &[]));
    s.apply("new-by-pod", "unread-target-2", "worker-pod", by_pod);
    let start = Instant::now();
    let mut unknown_seen = false;
    while start.elapsed() < 9 * SEC {
        let lease = s.get("by-pod").await;
        assert_eq!(phase_of(&lease), Some(Phase::Held), "{:?}", lease.status);
        assert_eq!(token_of(&lease), token_of(&held));
        let expires = lease.status.as_ref().and_then(|st| st.expires_at);
        let now = jiff::Timestamp::now();
        assert!(
            expires.is_some_and(|e| e > now),
            "expiresAt {expires:?} is not after {now}: the lease is no longer renewed"
        );
        unknown_seen |= condition(&lease, "Ready")
            .is_some_and(|c| c.status == "False" && c.reason == "HolderUnknown");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(unknown_seen, "no HolderUnknown condition was written");
    let seen = s.inspect("unread-target").await;
    assert_eq!(seen.lease.map(|l| l.token), Some(token_of(&held)));
    let taken = s.wait_phase("new-by-pod", Phase::Held, 5 * SEC).await;
    assert_eq!(
        condition(&taken, "Ready").map(|c| c.reason.as_str()),
        Some("HolderUnknown")
    );
    controller_account(&s, "pod-reader", true);
    let ready = s
        .wait("by-pod", "Ready again", 15 * SEC, |l| {
            condition(l, "Ready").is_some_and(|c| c.status == "True")
        })
        .await;
    assert_eq!(token_of(&ready), token_of(&held));
}

// A failing Held claim is judged by what the controller measured, never by comparing its own
// wall clock with the store's: here its published expiresAt is an hour ahead of what the store
// granted (what a controller whose clock runs an hour behind Valkey's would take for the
// future), and the claim still becomes Lost, Held Unknown, within its TTL of the refusal.
async fn failing_claim_is_judged_by_the_measured_expiry(s: Scenario) {
    let admin = valkey_admin(&s).await;
    s.apply("skewed", "skew-target", "worker-1", "ttlSeconds: 3");
    s.wait_phase("skewed", Phase::Held, 30 * SEC).await;
    controller_rights(&admin, "-@scripting").await;
    let refused = Instant::now();
    let far = jiff::Timestamp::now() + jiff::SignedDuration::from_hours(1);
    s.api()
        .patch_status(
            "skewed",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"expiresAt": far}})),
        )
        .await
        .expect("patch expiresAt");
    let lost = s
        .wait("skewed", "Lost", 10 * SEC, |l| {
            phase_of(l) == Some(Phase::Lost)
        })
        .await;
    let took = refused.elapsed();
    eprintln!("Lost {took:?} after the store refused");
    assert!(took < 5 * SEC, "Held {took:?} past the refusal, TTL 3 s");
    assert_eq!(
        condition(&lost, "Held").map(|c| c.status.as_str()),
        Some("Unknown")
    );
    controller_rights(&admin, "+@all").await;
    s.wait_phase("skewed", Phase::Held, 30 * SEC).await;
}

// Giving a lease up while its status write meets 409 after 409 (its TargetLease changes all the
// time) never leaves a Held status beside a released lease: no two claims show Held, and
// whenever Valkey shows the giver's lease gone, its status has already left Held.
async fn give_up_under_conflicts_never_shows_two_held(mut s: Scenario) {
    // The controller reaches the API server through 40 ms of latency, and eight writers poke
    // the object directly, one change every few milliseconds: every watch event the
    // controller decides on is already old, so its status writes meet conflicts for certain.
    // (Without the latency a status write follows its watch event within a few milliseconds,
    // and a run on CI once saw no conflict at all, so it tested nothing.)
    s.controller.take();
    let proxy = Proxy::start(s.cluster.apiserver_port()).await;
    let via_proxy = s.cluster.kubeconfig_via(proxy.port);
    s.controller = Some(s.start_controller_as(&via_proxy, &[]));
    proxy.set(Mode::Latency(Duration::from_millis(40)));
    s.apply("giver", "conflict-target", "worker-1", "");
    let held = s.wait_phase("giver", Phase::Held, 30 * SEC).await;
    s.apply("taker", "conflict-target", "worker-2", "");
    s.wait_phase("taker", Phase::Waiting, 30 * SEC).await;
    let pokers: Vec<_> = (0..8)
        .map(|i| {
            let api = s.api();
            tokio::spawn(async move {
                let start = Instant::now();
                let mut n = 0u64;
                while start.elapsed() < 3 * SEC {
                    n += 1;
                    let value = format!("{i}-{n}");
                    let patch = serde_json::json!({"metadata": {"annotations": {"poke": value}}});
                    api.patch("giver", &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .expect("poke");
                }
                n
            })
        })
        .collect();
    s.api()
        .patch(
            "giver",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"release": true}})),
        )
        .await
        .expect("release the giver");
    let store = s.store().await;
    let start = Instant::now();
    let mut taken = None;
    loop {
        let lease = store
            .inspect(&s.target("conflict-target"))
            .await
            .expect("inspect")
            .lease;
        let (giver, taker) = (s.get("giver").await, s.get("taker").await);
        let released_in_valkey = lease.is_none_or(|l| l.token != token_of(&held));
        assert!(
            !(released_in_valkey && phase_of(&giver) == Some(Phase::Held)),
            "{:?} after {:?}: Valkey released the lease, the status still says Held",
            giver.status,
            start.elapsed()
        );
        assert!(
            !(phase_of(&giver) == Some(Phase::Held) && phase_of(&taker) == Some(Phase::Held)),
            "both show Held after {:?}",
            start.elapsed()
        );
        if phase_of(&taker) == Some(Phase::Held) {
            taken.get_or_insert(start.elapsed());
            if pokers.iter().all(|p| p.is_finished()) {
                assert_eq!(phase_of(&giver), Some(Phase::Released));
                assert!(token_of(&taker) > token_of(&held));
                break;
            }
        }
        assert!(start.elapsed() < 20 * SEC, "the taker never got the target");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut pokes = 0;
    for poker in pokers {
        pokes += poker.await.expect("poker");
    }
    let refused = s
        .controller
        .as_ref()
        .expect("controller")
        .logs()
        .matches("status write refused")
        .count();
    eprintln!(
        "{pokes} conflicting writes in 3 s; {refused} status writes refused; the taker held after {taken:?}"
    );
    assert!(refused > 0, "no status write met a conflict");
}

// Claims created in the same second (creationTimestamp has one-second resolution) still go in
// the order they were created, not by name: `zz-older` is created before `aa-newer` and gets
// the target first.
async fn same_second_claims_go_in_creation_order(s: Scenario) {
    s.apply("first", "second-target", "holder-0", "");
    s.wait_phase("first", Phase::Held, 30 * SEC).await;
    let mut pair = None;
    for attempt in 0..5 {
        let (older, newer) = (format!("zz-older-{attempt}"), format!("aa-newer-{attempt}"));
        let yaml = format!(
            "{}---\n{}",
            lease_yaml(&s.ns, &older, "second-target", "holder-1", ""),
            lease_yaml(&s.ns, &newer, "second-target", "holder-2", "")
        );
        s.cluster.apply(&yaml);
        let created = |l: &TargetLease| l.metadata.creation_timestamp.clone();
        if created(&s.get(&older).await) == created(&s.get(&newer).await) {
            pair = Some((older, newer));
            break;
        }
        for name in [&older, &newer] {
            s.delete(name).await;
        }
    }
    let (older, newer) = pair.expect("two claims created in the same second in five attempts");
    s.wait_phase(&older, Phase::Waiting, 30 * SEC).await;
    s.wait_phase(&newer, Phase::Waiting, 30 * SEC).await;
    s.delete("first").await;
    let next = s
        .wait(&older, "Held or passed over", 10 * SEC, |l| {
            phase_of(l) == Some(Phase::Held)
        })
        .await;
    assert_eq!(phase_of(&s.get(&newer).await), Some(Phase::Waiting));
    assert_eq!(next.name_any(), older);
}

// ---- A slow API server ----

/// Faults seen while a check runs, each (what, of whom) recorded once, with when it was first
/// seen: the test goes on measuring after the first one, so the report says how far it went.
#[derive(Default)]
struct Faults {
    seen: BTreeSet<(String, &'static str)>,
    lines: Vec<String>,
}

impl Faults {
    fn note(&mut self, who: &str, what: &'static str, at: Duration, detail: String) {
        if self.seen.insert((who.to_owned(), what)) {
            let detail = if detail.is_empty() {
                detail
            } else {
                format!(": {detail}")
            };
            self.lines
                .push(format!("{who}: {what} at {at:.1?}{detail}"));
        }
    }
}

/// Why `lease` (whose target's store view is `seen`) does not show the truth about its tenure
/// with `token`: Held with that token, and an `expiresAt` that the store's clock has not passed
/// and that the store's lease lasts at least until. `None` when it does.
fn untrue_status(
    lease: &TargetLease,
    token: u64,
    seen: &targetlease::store::Inspection,
) -> Option<String> {
    let Some(status) = lease.status.as_ref() else {
        return Some("no status".to_owned());
    };
    let shown = status.fencing_token;
    if status.phase != Phase::Held || shown != Some(token) {
        return Some(format!(
            "{:?} with token {shown:?}, held with {token}",
            status.phase
        ));
    }
    let Some(view) = seen.lease.as_ref().filter(|v| v.token == token) else {
        return Some(format!(
            "the store holds {:?}, not token {token}",
            seen.lease
        ));
    };
    let Some(expires) = status.expires_at.map(|e| e.as_millisecond()) else {
        return Some("no expiresAt".to_owned());
    };
    let now = i64::try_from(seen.server_time_ms).expect("server time in range");
    let store_until = now + i64::try_from(view.expires_in_ms).expect("ttl in range");
    // A promise the controller keeps while it runs: in the future, and at most four TTLs ahead
    // of the store's clock (whole milliseconds of it, each side rounded once), while the store
    // holds the lease (above).
    let promised = now + 4 * 1000 * i64::from(lease.spec.ttl_seconds);
    if expires <= now || expires > promised + 2 {
        return Some(format!(
            "expiresAt {expires} ms, the store's time {now} ms, its lease until {store_until} ms"
        ));
    }
    None
}

// Every byte of the controller's API connection arrives 5 s late (a proxy's fixed latency,
// throughput kept: a slow API server, not a partition) for four TTLs, while ten TargetLeases
// (TTL 6 s, a renewal every 2 s) and one `targetlease run` (its own API connection direct) hold
// their targets; Valkey stays fast. Holding must not wait for the API server: no TargetLease
// leaves Held or changes token; in Valkey every lease keeps its token and never has less than a
// renewal interval left (which would mean a renewal a whole interval late); no Lost transition
// is counted; the `run` keeps its command to the end and exits 0 (its heartbeats reach the
// controller late on the slow watch, which is not a silent holder); and within two TTLs after the
// latency ends every status is true again: Held, the same token, an expiresAt the store's clock
// has not passed and the store's lease lasts until.
async fn slow_api_server_loses_no_lease(mut s: Scenario) {
    const LEASES: usize = 10;
    const TTL: Duration = Duration::from_secs(6);
    const RUN_TARGET: &str = "slow-run-target";
    let latency = 5 * SEC;
    let slow_for = 4 * TTL;
    let floor_ms = u64::try_from(TTL.as_millis() / 3).expect("small");

    // Only the controller reaches the API server through the proxy; this test's client and the
    // `run` go direct.
    let proxy = controller_behind_a_proxy(&mut s).await;
    let http = s.controller().http.clone();
    // (name, target, token) of every tenure that must last.
    let mut tenures = held_leases(&s, "slow", LEASES, "ttlSeconds: 6").await;
    let dir = tempfile::tempdir().expect("dir");
    let d = dir.path().display();
    let script = format!(
        "echo \"$TARGETLEASE_TOKEN\" > {d}/token; while [ ! -e {d}/stop ]; do \
         date +%s%N >> {d}/ticks; sleep 0.2; done; echo done > {d}/done"
    );
    // No grace: `run` sends SIGTERM only at its bound (2.7 s after the last confirmed heartbeat
    // was sent, at a 6 s TTL), not one and a half heartbeats after it. With a grace, a heartbeat
    // reply later than half a second (an API server on a machine busy with other suites) stops
    // the command, which `run` does by design and which is not what this test is about: its
    // heartbeats go straight to the API server, not through the slow proxy.
    let mut run = s
        .run_command(RUN_TARGET, &["--ttl", "6s", "--grace", "0s"], &script)
        .spawn()
        .expect("run");
    let run_held = s
        .run_lease(RUN_TARGET, 30 * SEC, |l| phase_of(l) == Some(Phase::Held))
        .await;
    let run_name = run_held.name_any();
    let deadline = Instant::now() + 30 * SEC;
    while !dir.path().join("ticks").exists() {
        assert!(Instant::now() < deadline, "the run's command never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let given = std::fs::read_to_string(dir.path().join("token")).expect("the command's token");
    assert_eq!(
        given.trim(),
        token_of(&run_held).to_string(),
        "TARGETLEASE_TOKEN"
    );
    tenures.push((run_name, RUN_TARGET.to_owned(), token_of(&run_held)));
    let lost = || scraped(&http, "targetlease_transitions_total{phase=\"Lost\"}");
    let lost_before = lost();

    let store = s.store().await;
    let mut faults = Faults::default();
    let mut lowest = BTreeMap::new();
    let mut samples = 0u32;
    proxy.set(Mode::Latency(latency));
    let slowed = Instant::now();
    while slowed.elapsed() < slow_for {
        let at = slowed.elapsed();
        let listed = s
            .api()
            .list(&ListParams::default())
            .await
            .expect("list")
            .items;
        for (name, target, token) in &tenures {
            match listed.iter().find(|l| l.name_any() == *name) {
                None => faults.note(name, "TargetLease gone", at, String::new()),
                Some(l) => {
                    let shown = l.status.as_ref().map(|st| (st.phase, st.fencing_token));
                    if shown != Some((Phase::Held, Some(*token))) {
                        let reason = condition(l, "Ready").map(|c| c.reason.clone());
                        faults.note(
                            name,
                            "status left Held",
                            at,
                            format!("{shown:?} ({reason:?}), held with {token}"),
                        );
                    }
                }
            }
            match store
                .inspect(&s.target(target))
                .await
                .expect("inspect")
                .lease
            {
                None => faults.note(name, "lease gone from the store", at, String::new()),
                Some(v) if v.token != *token => faults.note(
                    name,
                    "another token in the store",
                    at,
                    format!("{} instead of {token}", v.token),
                ),
                Some(v) => {
                    let low = lowest.entry(name.clone()).or_insert(u64::MAX);
                    *low = (*low).min(v.expires_in_ms);
                    if v.expires_in_ms < floor_ms {
                        faults.note(
                            name,
                            "renewed late",
                            at,
                            format!("{} ms left of a {TTL:?} TTL", v.expires_in_ms),
                        );
                    }
                }
            }
        }
        if let Some(status) = run.try_wait().expect("run status") {
            faults.note("run", "exited during the latency", at, format!("{status}"));
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    proxy.set(Mode::Pass);
    let healed = Instant::now();
    std::fs::write(dir.path().join("stop"), "").expect("stop the run's command");

    // Every status true again, within two TTLs.
    let mut recovered = None;
    let mut untrue = Vec::new();
    while healed.elapsed() < 2 * TTL {
        untrue.clear();
        for (name, target, token) in &tenures[..LEASES] {
            let lease = s.get(name).await;
            let seen = store.inspect(&s.target(target)).await.expect("inspect");
            if let Some(why) = untrue_status(&lease, *token, &seen) {
                untrue.push((name.clone(), why));
            }
        }
        if untrue.is_empty() {
            recovered = Some(healed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (name, why) in untrue {
        faults.note(
            &name,
            "status not true two TTLs after the latency ended",
            healed.elapsed(),
            why,
        );
    }
    let run_exit = tokio::time::timeout(60 * SEC, run.wait())
        .await
        .expect("the run exits once its command ended")
        .expect("run status");
    if run_exit.code() != Some(0) || !dir.path().join("done").exists() {
        faults.note(
            "run",
            "did not finish its command",
            healed.elapsed(),
            format!(
                "{run_exit}, done marker: {}",
                dir.path().join("done").exists()
            ),
        );
    }
    let lost_during = lost() - lost_before;
    if lost_during > 0.0 {
        faults.note(
            "controller",
            "counted Lost transitions",
            healed.elapsed(),
            format!("{lost_during}"),
        );
    }
    let ticks: Vec<u64> = std::fs::read_to_string(dir.path().join("ticks"))
        .expect("ticks")
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let widest_gap = ticks.windows(2).map(|w| w[1].saturating_sub(w[0])).max();
    let page = http_get(&http, "/metrics").expect("metrics").1;
    eprintln!(
        "{samples} samples over {slow_for:?} at {latency:?} latency; lowest time left in the \
         store (ms) per lease: {lowest:?} (floor {floor_ms}); statuses true {recovered:?} after \
         the latency ended; run exited {run_exit} after {} ticks, widest gap {:?} ms; Lost \
         transitions {lost_during}; reconciles: ok {}, timeout {}, kube {}; status writes {}",
        ticks.len(),
        widest_gap.map(|g| g / 1_000_000),
        metric(&page, "targetlease_reconciles_total{result=\"ok\"}"),
        metric(&page, "targetlease_reconciles_total{result=\"timeout\"}"),
        metric(&page, "targetlease_reconciles_total{result=\"kube\"}"),
        metric(&page, "targetlease_status_writes_total"),
    );
    assert!(samples >= 20, "only {samples} samples in {slow_for:?}");
    assert!(
        faults.lines.is_empty(),
        "with every API request of the controller {latency:?} late:\n{}",
        faults.lines.join("\n")
    );
}

/// Restarts the scenario's controller (without leader election) with its API connection
/// through a proxy of its own; answers the proxy.
async fn controller_behind_a_proxy(s: &mut Scenario) -> Proxy {
    s.controller().terminate();
    let proxy = Proxy::start(s.cluster.apiserver_port()).await;
    let via_proxy = s.cluster.kubeconfig_via(proxy.port);
    s.controller = Some(s.start_controller_as(&via_proxy, &[]));
    proxy
}

/// Applies `n` TargetLeases `{prefix}-{i}`, each on its own target `{prefix}-{i}-target`, with
/// `spec` added, and waits for each to be Held: (name, target, token) of each tenure.
async fn held_leases(
    s: &Scenario,
    prefix: &str,
    n: usize,
    spec: &str,
) -> Vec<(String, String, u64)> {
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let yaml: Vec<String> = names
        .iter()
        .map(|n| lease_yaml(&s.ns, n, &format!("{n}-target"), "worker", spec))
        .collect();
    s.cluster.apply(&yaml.join("---\n"));
    let mut tenures = Vec::new();
    for name in &names {
        let held = s.wait_phase(name, Phase::Held, 30 * SEC).await;
        tenures.push((name.clone(), format!("{name}-target"), token_of(&held)));
    }
    tenures
}

// The API server slow (every byte of the controller's API connection 5 s late) until the
// published expiresAt of a held lease has passed (refreshes shed, as documented), then Valkey
// pauses for 3 s (every lease's renewal times out at least once; the store's leases, renewed every
// 2 s with a TTL of 6 s, outlast the pause). The store still holds every lease for
// most of a TTL and renewals resume after the pause: no TargetLease may leave Held or change
// token, in the store or in its status.
async fn store_blip_while_refreshes_are_shed_loses_no_lease(mut s: Scenario) {
    // More leases than one refresh at a time (the window while slow) can keep promised.
    const LEASES: usize = 8;
    const TTL: Duration = Duration::from_secs(6);
    let proxy = controller_behind_a_proxy(&mut s).await;
    let tenures = held_leases(&s, "blip", LEASES, "ttlSeconds: 6").await;
    let store = s.store().await;
    proxy.set(Mode::Latency(5 * SEC));
    let slowed = Instant::now();
    // Until some Held status shows an expiresAt the store's clock has passed, and the writes
    // sent before the budget knew the API server was slow have been answered (so that the
    // reconciles are idle between probes).
    let mut passed = None;
    while passed.is_none() || slowed.elapsed() < 4 * TTL {
        assert!(
            slowed.elapsed() < 12 * TTL,
            "no published expiresAt passed in {:?}",
            12 * TTL
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        for (name, target, _) in &tenures {
            let lease = s.get(name).await;
            let seen = store.inspect(&s.target(target)).await.expect("inspect");
            let expires = lease
                .status
                .as_ref()
                .and_then(|st| st.expires_at)
                .map(|e| e.as_millisecond());
            let now = i64::try_from(seen.server_time_ms).expect("ms");
            if expires.is_some_and(|e| e < now) && passed.is_none() {
                passed = Some((name.clone(), slowed.elapsed()));
            }
        }
    }
    let out = s.valkey.raw(&["CLIENT", "PAUSE", "3000", "ALL"]);
    let paused = Instant::now();
    let mut faults = Faults::default();
    while paused.elapsed() < 3 * TTL {
        let at = paused.elapsed();
        for (name, target, token) in &tenures {
            let lease = s.get(name).await;
            let shown = lease.status.as_ref().map(|st| (st.phase, st.fencing_token));
            if shown != Some((Phase::Held, Some(*token))) {
                let reason = condition(&lease, "Ready").map(|c| c.reason.clone());
                faults.note(
                    name,
                    "status left Held",
                    at,
                    format!("{shown:?} ({reason:?}), held with {token}"),
                );
            }
            if at < 4 * SEC {
                continue;
            }
            if let Ok(seen) = store.inspect(&s.target(target)).await {
                match seen.lease {
                    None => faults.note(name, "lease gone from the store", at, String::new()),
                    Some(v) if v.token != *token => faults.note(
                        name,
                        "another token in the store",
                        at,
                        format!("{} instead of {token}", v.token),
                    ),
                    Some(_) => {}
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    proxy.set(Mode::Pass);
    let logs = s.controller().logs();
    let failed: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("renewal failed") || l.contains("lease lost"))
        .take(6)
        .collect();
    eprintln!(
        "CLIENT PAUSE answered {out:?}; first passed expiresAt {passed:?}; controller log:\n{}",
        failed.join("\n")
    );
    assert!(
        faults.lines.is_empty(),
        "with the controller's API connection 5 s late and Valkey paused 3 s after {passed:?}:\n{}",
        faults.lines.join("\n")
    );
}

// ttlSeconds raised from 6 to 30 while Held; the renewals in Valkey must follow it.
async fn ttl_edit_while_held_reaches_the_store(s: Scenario) {
    s.apply("ttl-edit", "ttl-edit-target", "worker", "ttlSeconds: 6");
    let held = s.wait_phase("ttl-edit", Phase::Held, 30 * SEC).await;
    s.api()
        .patch(
            "ttl-edit",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"ttlSeconds": 30}})),
        )
        .await
        .expect("patch ttlSeconds");
    // Two renewal intervals of the old TTL, and one of the new would not have come yet.
    tokio::time::sleep(5 * SEC).await;
    let seen = s.inspect("ttl-edit-target").await;
    let view = seen.lease.expect("held in the store");
    assert_eq!(view.token, token_of(&held));
    assert!(
        view.expires_in_ms > 6_000,
        "5 s after ttlSeconds went from 6 to 30 on a Held TargetLease, the store's lease has \
         {} ms left: it is still renewed with the old TTL",
        view.expires_in_ms
    );
}

// Valkey loses its data while "dl-x" is Held and "dl-y" waits on the same target; "dl-y" is
// reconciled (an annotation edit) and the store, which no longer knows "dl-x", grants it the
// target. docs/internals/controller.md: a grant of a permit this process still answers for is
// given back unpublished, and the other tenure is renewed at once. So "dl-y" is never shown Held
// beside "dl-x" (before, for up to one renewal, bounded here at 2 s); "dl-x" learns it lost and,
// first in line, takes the target again under a larger token.
async fn data_loss_never_shows_two_held(s: Scenario) {
    s.apply("dl-x", "dl-target", "wx", "");
    let x = s.wait_phase("dl-x", Phase::Held, 30 * SEC).await;
    s.apply("dl-y", "dl-target", "wy", "");
    s.wait_phase("dl-y", Phase::Waiting, 30 * SEC).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watched = never_more_held_than(&s, "dl-target", 1, stop.clone());
    let out = s.valkey.raw(&["FLUSHALL"]);
    s.api()
        .patch(
            "dl-y",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {"poke": "1"}}})),
        )
        .await
        .expect("poke dl-y");
    let old = token_of(&x);
    let again = s
        .wait(
            "dl-x",
            "Held again under a larger token",
            10 * SEC,
            move |l| phase_of(l) == Some(Phase::Held) && token_of(l) > old,
        )
        .await;
    // Long enough for a second grant beside it to show, were there one.
    tokio::time::sleep(3 * SEC).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let most = watched.await.expect("watch");
    eprintln!(
        "FLUSHALL answered {out:?}; dl-x Held again with {} after {old}; at most {most} Held at once",
        token_of(&again)
    );
    assert_ne!(phase_of(&s.get("dl-y").await), Some(Phase::Held));
    let seen = s.inspect("dl-target").await;
    assert_eq!(
        seen.lease.map(|l| l.token),
        Some(token_of(&again)),
        "the store holds the target for dl-x's new tenure"
    );
}

/// Watches every TargetLease on `target` until `stop`, failing at once if more than `permits`
/// not being deleted show Held at one moment or two share a slot; answers the most seen at once.
fn never_more_held_than(
    s: &Scenario,
    target: &str,
    permits: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    let (api, target) = (s.api(), target.to_owned());
    tokio::spawn(async move {
        let mut most = 0;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let all = api.list(&Default::default()).await.expect("list").items;
            let held: Vec<(String, Option<u32>)> = all
                .iter()
                // Being deleted is not holding: `run` and `wait` stop trusting it at once, and the
                // controller releases it before the object goes.
                .filter(|l| {
                    l.spec.target == target
                        && l.metadata.deletion_timestamp.is_none()
                        && phase_of(l) == Some(Phase::Held)
                })
                .map(|l| (l.name_any(), l.status.as_ref().and_then(|st| st.slot)))
                .collect();
            assert!(
                held.len() <= permits,
                "more than {permits} show Held: {held:?}"
            );
            let slots: BTreeSet<_> = held.iter().map(|(_, s)| *s).collect();
            assert_eq!(slots.len(), held.len(), "two Held share a slot: {held:?}");
            most = most.max(held.len());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        most
    })
}

// Permits 3 on one target, eight claims created 150 ms apart: never more than three Held, in
// distinct slots; the first three hold first; a deleted holder's permit goes to the oldest
// waiter, in the freed slot, with a token above every earlier one; a claim asking another
// permits value waits with PermitsConflict, naming the value in force.
async fn permits_cap_holders_and_pass_in_order(s: Scenario) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = never_more_held_than(&s, "permit-target", 3, stop.clone());
    let names: Vec<String> = (0..8).map(|i| format!("p{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        s.apply(name, "permit-target", &format!("worker-{i}"), "permits: 3");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let mut first = Vec::new();
    for name in &names[..3] {
        first.push(s.wait_phase(name, Phase::Held, 30 * SEC).await);
    }
    for name in &names[3..] {
        s.wait_phase(name, Phase::Waiting, 30 * SEC).await;
    }
    let slot_of = |l: &TargetLease| l.status.as_ref().and_then(|st| st.slot);
    let slots: BTreeSet<_> = first.iter().map(slot_of).collect();
    assert_eq!(slots, [Some(0), Some(1), Some(2)].into_iter().collect());
    assert!(
        first
            .iter()
            .all(|l| l.status.as_ref().and_then(|st| st.permits) == Some(3))
    );
    let seen = s.inspect("permit-target").await;
    assert_eq!(seen.holders().count(), 3);
    // `kubectl targetlease status`, from the API server alone, shows the holders with their
    // slots and tokens as their statuses have them, and the waiters in the order served.
    let shown = plugin_status(&s, "permit-target");
    assert_eq!(shown["permits"], 3, "{shown}");
    let holders: Vec<(String, u64, u64)> = shown["holders"]
        .as_array()
        .expect("holders")
        .iter()
        .map(|h| {
            let name = h["name"].as_str().expect("name").to_owned();
            (
                name,
                h["slot"].as_u64().expect("slot"),
                h["token"].as_u64().expect("token"),
            )
        })
        .collect();
    let mut expected: Vec<(String, u64, u64)> = first
        .iter()
        .map(|l| {
            let slot = slot_of(l).map(u64::from).expect("slot");
            (l.name_any(), slot, token_of(l))
        })
        .collect();
    expected.sort_by_key(|(_, slot, _)| *slot);
    assert_eq!(holders, expected, "{shown}");
    assert_eq!(waiting_order(&shown), names[3..].to_vec(), "{shown}");
    // Each deleted holder's permit goes to the oldest waiter, in the freed slot: the first one
    // `status` lists.
    let mut newest = first.iter().map(token_of).max().expect("tokens");
    for (gone, next) in [(1usize, 3usize), (0, 4), (2, 5)] {
        assert_eq!(
            waiting_order(&plugin_status(&s, "permit-target")).first(),
            Some(&names[next])
        );
        let freed = slot_of(&s.get(&names[gone]).await);
        let start = Instant::now();
        s.delete(&names[gone]).await;
        let took = s.wait_phase(&names[next], Phase::Held, 10 * SEC).await;
        eprintln!(
            "{} took {}'s permit after {:?}",
            names[next],
            names[gone],
            start.elapsed()
        );
        assert_eq!(
            slot_of(&took),
            freed,
            "{} did not take the freed slot",
            names[next]
        );
        assert!(
            token_of(&took) > newest,
            "{} got a token below an earlier one",
            names[next]
        );
        newest = token_of(&took);
        for waiter in &names[next + 1..] {
            assert_eq!(
                phase_of(&s.get(waiter).await),
                Some(Phase::Waiting),
                "{waiter} went before {}",
                names[next]
            );
        }
    }
    // Another permits value is refused while these permits are held.
    s.apply("other-value", "permit-target", "worker-x", "permits: 2");
    let refused = s
        .wait("other-value", "PermitsConflict", 30 * SEC, |l| {
            condition(l, "Ready").is_some_and(|c| c.reason == "PermitsConflict")
        })
        .await;
    let message = &condition(&refused, "Ready").expect("Ready").message;
    assert!(message.contains("permits 3"), "{message}");
    assert_eq!(phase_of(&refused), Some(Phase::Waiting));
    let shown = plugin_status(&s, "permit-target");
    let why = shown["waiting"]
        .as_array()
        .expect("waiting")
        .iter()
        .find(|w| w["name"] == "other-value")
        .map(|w| w["why"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    assert!(why.contains("asks permits 2 while permits 3"), "{shown}");
    // A target that would change the field selector (`,` adds a selector, `=` is not allowed in
    // a name) is refused with the rule, never passed on: listed as `spec.target=permit-target,
    // spec.holder=...`, it would show a part of the target's claims as the whole.
    for hostile in ["permit-target,spec.holder=w-1", "permit-target=x"] {
        let out = plugin(&s, &["status", hostile, "-o", "json"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{hostile}: {stderr}");
        assert!(out.stdout.is_empty(), "{hostile}: printed a report");
        assert!(
            stderr.contains(hostile) && stderr.contains("must be 1 to"),
            "{hostile}: {stderr}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let most = watcher.await.expect("watcher");
    assert_eq!(most, 3, "never saw three held at once");
}

/// `kubectl targetlease status TARGET -o json` in the scenario's namespace, the binary installed
/// as kubectl's plugin (a `kubectl-targetlease` link on the PATH), as docs/workloads.md says.
fn plugin_status(s: &Scenario, target: &str) -> serde_json::Value {
    let out = plugin(s, &["status", target, "-o", "json"]);
    assert!(
        out.status.success(),
        "kubectl targetlease status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("status prints JSON")
}

/// `kubectl targetlease ARGS -n NAMESPACE`, the binary installed as kubectl's plugin.
fn plugin(s: &Scenario, args: &[&str]) -> std::process::Output {
    let plugins = s.cluster.scratch().join("kubectl-plugins");
    let link = plugins.join("kubectl-targetlease");
    std::fs::create_dir_all(&plugins).expect("plugin folder");
    match std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_targetlease"), &link) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => panic!("link the plugin: {e}"),
        _ => {}
    }
    let mut env = s.cluster.envs();
    for (key, value) in &mut env {
        if key == "PATH" {
            *value = format!("{}:{value}", plugins.display());
        }
    }
    std::process::Command::new("kubectl")
        .arg("targetlease")
        .args(args)
        .args(["-n", &s.ns])
        .env_clear()
        .envs(env)
        .output()
        .expect("run kubectl")
}

/// The names `status` lists as waiting, in its order.
fn waiting_order(shown: &serde_json::Value) -> Vec<String> {
    shown["waiting"]
        .as_array()
        .expect("waiting")
        .iter()
        .map(|w| w["name"].as_str().expect("name").to_owned())
        .collect()
}

// A controller watching a list of namespaces (`--watch-namespace a,b`): claims in both are
// served, each namespace's targets apart from the other's (one target name, two holders); a
// namespace off the list is left alone (no finalizer, no status); a deletion in the second
// namespace reaches the controller and releases.
async fn a_list_of_namespaces_is_watched_as_one(mut s: Scenario) {
    let second = format!("{}-second", s.ns);
    let outside = format!("{}-outside", s.ns);
    for ns in [&second, &outside] {
        s.cluster.kubectl_ok(&["create", "namespace", ns]);
    }
    s.controller.take();
    // The scenario's namespace comes first on the controller's command line; the list form
    // adds the second (and names one twice, which is one watch).
    let list = format!("{second},{}", s.ns);
    s.controller = Some(s.start_controller(&["--watch-namespace", &list]));
    s.apply("here", "shared-target", "worker-1", "");
    for ns in [&second, &outside] {
        s.cluster
            .apply(&lease_yaml(ns, "there", "shared-target", "worker-2", ""));
    }
    s.wait_phase("here", Phase::Held, 30 * SEC).await;
    let client = s.client.clone();
    let api_in = |ns: &str| Api::<TargetLease>::namespaced(client.clone(), ns);
    let there = support::kube::await_lease(&api_in(&second), "there", "Held", 30 * SEC, |l| {
        phase_of(l) == Some(Phase::Held)
    })
    .await
    .unwrap_or_else(|why| {
        let logs = s.controller.as_ref().map(|c| c.logs()).unwrap_or_default();
        panic!("{why}\n{logs}")
    });
    assert!(token_of(&there) > 0);
    tokio::time::sleep(2 * SEC).await;
    let untouched = api_in(&outside).get("there").await.expect("get");
    assert!(untouched.status.is_none(), "{:?}", untouched.status);
    assert!(
        untouched.metadata.finalizers.unwrap_or_default().is_empty(),
        "a namespace off the list got a finalizer"
    );
    api_in(&second)
        .delete("there", &Default::default())
        .await
        .expect("delete");
    let gone = tokio::time::timeout(30 * SEC, async {
        while api_in(&second)
            .get_opt("there")
            .await
            .expect("get")
            .is_some()
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(
        gone.is_ok(),
        "the deletion in the second namespace was not finished"
    );
    for ns in [&second, &outside] {
        s.cluster
            .kubectl_ok(&["delete", "namespace", ns, "--wait=false"]);
    }
}

// A primary behind Sentinel fails over (SENTINEL FAILOVER) while ten TargetLeases with a 30 s
// TTL are held by a controller that reaches Valkey through the sentinels: every one shows Held
// with its token at every moment, and the renewals after the switch land on the new primary (the
// old one keeps taking writes for seconds, until Sentinel demotes it).
async fn sentinel_failover_keeps_leases_held(mut s: Scenario) {
    let topology =
        tokio::task::spawn_blocking(|| Topology::start(Options::plain(ServerKind::Valkey91)))
            .await
            .expect("start the sentinel topology");
    let sentinels = topology.sentinel_addrs().join(",");
    s.controller.take();
    let args = [
        "--watch-namespace",
        s.ns.as_str(),
        "--valkey-timeout",
        "1s",
        "--valkey-sentinels",
        sentinels.as_str(),
        "--valkey-sentinel-master",
        MASTER,
    ];
    let kubeconfig = std::path::Path::new(s.cluster.kubeconfig());
    s.controller = Some(ControllerProcess::start_reaching(
        &s.cluster,
        kubeconfig,
        &args,
        &[],
    ));
    let names: Vec<String> = (0..10).map(|i| format!("sentinel-{i}")).collect();
    for name in &names {
        s.apply(
            name,
            &format!("{name}-target"),
            "worker-1",
            "ttlSeconds: 30",
        );
    }
    let mut tokens = BTreeMap::new();
    for name in &names {
        let held = s.wait_phase(name, Phase::Held, 30 * SEC).await;
        tokens.insert(name.clone(), token_of(&held));
    }
    // Every status, all along: Held, with the token it had.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (api, tokens, stop) = (s.api(), tokens.clone(), stop.clone());
        tokio::spawn(async move {
            let mut looks = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                for lease in api.list(&Default::default()).await.expect("list").items {
                    let name = lease.name_any();
                    let Some(token) = tokens.get(&name) else {
                        continue;
                    };
                    assert_eq!(
                        phase_of(&lease),
                        Some(Phase::Held),
                        "{name}: {:?}",
                        lease.status
                    );
                    assert_eq!(token_of(&lease), *token, "{name} changed tokens");
                }
                looks += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            looks
        })
    };
    let old = topology.nodes[0].port;
    let started = Instant::now();
    tokio::task::block_in_place(|| topology.failover());
    let new = tokio::task::block_in_place(|| topology.wait_for_new_primary(old, 20 * SEC));
    support::suite::measured(
        "controller: SENTINEL FAILOVER until the sentinels name the new primary",
        started.elapsed(),
    );
    // One poll interval (1 s) for the controller to leave the old primary, then more than one
    // renewal interval (TTL/3 = 10 s).
    let switched = Instant::now() + Duration::from_millis(1_500);
    tokio::time::sleep(13 * SEC).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let looks = watcher
        .await
        .expect("every status stayed Held with its token");
    assert!(looks > 50, "only {looks} looks at the statuses");
    // On the new primary itself: every lease with its token, renewed after the switch.
    let mut direct = ValkeyConfig::new(
        targetlease::redact::SecretUrl::parse(&format!("redis://127.0.0.1:{new}")).expect("url"),
    );
    direct.key_prefix = "tl".into();
    let on_new = ValkeyStore::connect(direct)
        .await
        .expect("connect to the new primary");
    let since_switch = u64::try_from(switched.elapsed().as_millis()).unwrap_or(u64::MAX);
    for (name, token) in &tokens {
        let seen = on_new
            .inspect(&s.target(&format!("{name}-target")))
            .await
            .expect("inspect");
        let lease = seen
            .lease
            .unwrap_or_else(|| panic!("{name}: no lease on the new primary"));
        assert_eq!(
            lease.token, *token,
            "{name}: another token on the new primary"
        );
        assert!(
            lease.expires_in_ms + since_switch > 30_000,
            "{name}: not renewed on the new primary since the switch ({} ms left, {since_switch} ms since)",
            lease.expires_in_ms
        );
    }
    assert!(
        s.controller().logs().contains("the primary changed"),
        "the controller did not log the switch"
    );
}

// The chart's alerts (PrometheusRule) and Grafana dashboard name only metrics this controller
// exports, with labels they carry: every metric and label in every alert `expr` and dashboard
// query, read by a small PromQL tokenizer, is checked against /metrics of a controller that has
// granted, queued, handed over and failed store calls (so that every labelled family has
// samples to take its label names from).
async fn alerts_and_dashboard_name_real_metrics(mut s: Scenario) {
    s.apply("holder", "metrics", "worker-a", "");
    s.wait_phase("holder", Phase::Held, 30 * SEC).await;
    s.apply("waiter", "metrics", "worker-b", "");
    s.wait_phase("waiter", Phase::Waiting, 30 * SEC).await;
    s.delete("holder").await;
    s.wait_phase("waiter", Phase::Held, 30 * SEC).await;
    s.valkey.kill();
    s.apply("outage", "metrics-outage", "worker-c", "");
    s.wait("outage", "a store failure", 30 * SEC, |l| {
        condition(l, "Ready").is_some_and(|c| c.reason == "BackendUnavailable")
    })
    .await;
    s.valkey.restart();
    s.wait_phase("outage", Phase::Held, 60 * SEC).await;
    let (_, page) = http_get(&s.controller().http, "/metrics").expect("metrics");
    let exported = exported_metrics(&page);

    let tools = support::chart::Tools::load();
    let docs = tools.render_ok(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "grafanaDashboard.enabled=true",
    ]);
    let mut queries: Vec<(String, String)> = Vec::new();
    let rule = support::chart::of_kind(&docs, "PrometheusRule");
    assert_eq!(rule.len(), 1, "one PrometheusRule");
    for r in rule[0]["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules")
    {
        let alert = r["alert"].as_str().expect("alert");
        queries.push((alert.into(), r["expr"].as_str().expect("expr").into()));
    }
    let map = support::chart::of_kind(&docs, "ConfigMap");
    assert_eq!(map.len(), 1, "one dashboard ConfigMap");
    let dashboard: serde_json::Value =
        serde_json::from_str(map[0]["data"]["targetlease.json"].as_str().expect("json"))
            .expect("dashboard JSON");
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let title = format!("panel {:?}", panel["title"]);
            queries.push((title, target["expr"].as_str().expect("expr").into()));
        }
    }
    for var in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(query) = var["query"]["query"].as_str() {
            queries.push((format!("variable {:?}", var["name"]), query.into()));
        }
    }
    assert!(queries.len() >= 15, "{} queries", queries.len());
    let mut problems = Vec::new();
    for (what, expr) in &queries {
        let named = promql_names(expr);
        if named.metrics.is_empty() {
            problems.push(format!("{what}: names no metric: {expr}"));
        }
        let mut labels: BTreeSet<&str> = TARGET_LABELS.iter().copied().collect();
        for metric in &named.metrics {
            match exported.get(metric) {
                Some(carried) => labels.extend(carried.iter().map(String::as_str)),
                None => problems.push(format!("{what}: {metric} is not exported: {expr}")),
            }
        }
        for label in &named.labels {
            if !labels.contains(label.as_str()) {
                problems.push(format!(
                    "{what}: no metric of the expression carries the label {label}: {expr}"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}\n\nexported: {exported:?}",
        problems.join("\n")
    );
}

/// Labels Prometheus (`job`, `instance`) and the Prometheus Operator's ServiceMonitor targets
/// (`namespace`, `pod`, `service`, `endpoint`, `container`) add to every scraped series.
const TARGET_LABELS: [&str; 7] = [
    "job",
    "instance",
    "namespace",
    "pod",
    "service",
    "endpoint",
    "container",
];

/// The series names a `/metrics` page exposes, from its `# TYPE` lines (a counter as
/// `<name>_total`, a histogram as `_bucket`, `_sum` and `_count`), each with the label names
/// its samples carry.
fn exported_metrics(page: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut exported = BTreeMap::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').expect("a TYPE line names a type");
        let names: Vec<String> = match kind {
            "counter" => vec![format!("{name}_total")],
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|s| format!("{name}{s}"))
                .collect(),
            _ => vec![name.to_owned()],
        };
        for name in names {
            exported.insert(name, BTreeSet::new());
        }
    }
    assert!(exported.len() >= 10, "TYPE lines in:\n{page}");
    for line in page
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = exported
            .get_mut(&line[..name_end])
            .unwrap_or_else(|| panic!("sample of no TYPE: {line}"));
        if let Some(inside) = line[name_end..].strip_prefix('{') {
            let inside = &inside[..inside.rfind('}').expect("closing brace")];
            labels.extend(promql_names(&format!("m{{{inside}}}")).labels);
        }
    }
    exported
}

/// What a PromQL expression (or a Grafana `label_values(expr, label)` query) names.
#[derive(Debug, Default)]
struct PromqlNames {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
}

/// PromQL's aggregations and the functions the chart may use; any other word followed by `(`
/// is refused, so a misspelt function is not taken for a metric.
const PROMQL_FUNCTIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "rate",
    "irate",
    "increase",
    "delta",
    "idelta",
    "deriv",
    "changes",
    "resets",
    "histogram_quantile",
    "vector",
    "scalar",
    "absent",
    "absent_over_time",
    "abs",
    "ceil",
    "floor",
    "round",
    "clamp",
    "clamp_min",
    "clamp_max",
    "time",
    "timestamp",
    "label_replace",
    "label_join",
    "sort",
    "sort_desc",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "sum_over_time",
    "count_over_time",
    "last_over_time",
    "predict_linear",
];

/// Reads metric names (identifiers that are no function, keyword or label) and label names (in
/// `{...}` matchers and in by/without/on/ignoring/group_left/group_right lists) out of `expr`.
/// Strings, `[...]` ranges, numbers, durations after `offset` and Grafana's `$variables` are
/// skipped.
fn promql_names(expr: &str) -> PromqlNames {
    let expr = match expr.strip_prefix("label_values(") {
        Some(args) => {
            let args = args.strip_suffix(')').expect("label_values(...)");
            let (inner, label) = args.rsplit_once(',').expect("label_values(expr, label)");
            let mut named = promql_names(inner);
            named.labels.insert(label.trim().to_owned());
            return named;
        }
        None => expr.as_bytes(),
    };
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let word_at = |i: usize| {
        let end = (i..expr.len())
            .find(|&j| !ident(expr[j]))
            .unwrap_or(expr.len());
        (String::from_utf8_lossy(&expr[i..end]).into_owned(), end)
    };
    let skip_spaces = |mut i: usize| {
        while i < expr.len() && expr[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    let skip_string = |i: usize| {
        let quote = expr[i];
        let mut j = i + 1;
        while j < expr.len() && expr[j] != quote {
            j += if expr[j] == b'\\' { 2 } else { 1 };
        }
        j + 1
    };
    let mut named = PromqlNames::default();
    let mut i = 0;
    while i < expr.len() {
        let b = expr[i];
        if b == b'"' || b == b'\'' || b == b'`' {
            i = skip_string(i);
        } else if b == b'[' {
            i = (i..expr.len())
                .find(|&j| expr[j] == b']')
                .expect("closing ]")
                + 1;
        } else if b == b'{' {
            // Matchers: label, operator, string; commas between.
            i += 1;
            loop {
                i = skip_spaces(i);
                match expr.get(i) {
                    Some(b'}') => break i += 1,
                    Some(b',') => i += 1,
                    Some(&c) if ident(c) => {
                        let (label, end) = word_at(i);
                        named.labels.insert(label);
                        i = skip_spaces(end);
                        while matches!(expr.get(i), Some(b'=' | b'!' | b'~')) {
                            i += 1;
                        }
                        i = skip_spaces(i);
                        assert!(
                            matches!(expr.get(i), Some(b'"' | b'\'' | b'`')),
                            "a matcher without a string value in {:?}",
                            String::from_utf8_lossy(expr)
                        );
                        i = skip_string(i);
                    }
                    other => panic!(
                        "unexpected {other:?} in the matchers of {:?}",
                        String::from_utf8_lossy(expr)
                    ),
                }
            }
        } else if b == b'$' {
            i = word_at(i + 1).1;
        } else if b.is_ascii_digit()
            || (b == b'.' && expr.get(i + 1).is_some_and(u8::is_ascii_digit))
        {
            i = (i..expr.len())
                .find(|&j| !(expr[j].is_ascii_alphanumeric() || expr[j] == b'.'))
                .unwrap_or(expr.len());
        } else if ident(b) {
            let (word, end) = word_at(i);
            let next = skip_spaces(end);
            i = end;
            if [
                "by",
                "without",
                "on",
                "ignoring",
                "group_left",
                "group_right",
            ]
            .contains(&word.as_str())
            {
                if expr.get(next) == Some(&b'(') {
                    let close = (next..expr.len()).find(|&j| expr[j] == b')').expect(")");
                    for label in String::from_utf8_lossy(&expr[next + 1..close]).split(',') {
                        let label = label.trim();
                        if !label.is_empty() {
                            named.labels.insert(label.to_owned());
                        }
                    }
                    i = close + 1;
                }
            } else if expr.get(next) == Some(&b'(')
                || ["by", "without"].contains(&word_at(next).0.as_str())
            {
                // A function call, or an aggregation with its grouping first.
                assert!(
                    PROMQL_FUNCTIONS.contains(&word.as_str()),
                    "{word}( is not a PromQL function, in {:?}",
                    String::from_utf8_lossy(expr)
                );
            } else if word == "offset" {
                i = word_at(next).1;
            } else if !["and", "or", "unless", "bool", "inf", "nan", "Inf", "NaN"]
                .contains(&word.as_str())
            {
                named.metrics.insert(word);
            }
        } else {
            i += 1;
        }
    }
    named
}

// Two installations whose scopes overlap (as two teams' Helm releases would be): the second
// controller, on its own key prefix with its own installation id, watches the namespace where
// the first already acts. It never acts on the namespace's TargetLeases: never two Held on the
// target, the holder's token never moves, nothing of it in its store; every TargetLease says so
// (InstallationConflict, naming both installations), its log says so, and the namespace's marker
// names the first. When the holder is deleted, the first hands over as before. (Without the
// marker, the two granted the holder again from their own stores, its token moving 44 times in
// 20 s.)
async fn overlapping_installations_never_both_act(s: Scenario) {
    s.apply("first", "shared", "team-a-1", "ttlSeconds: 6");
    let first = s.wait_phase("first", Phase::Held, 30 * SEC).await;
    let token = token_of(&first);
    s.apply("second", "shared", "team-a-2", "ttlSeconds: 6");
    s.wait_phase("second", Phase::Waiting, 30 * SEC).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = never_more_held_than(&s, "shared", 1, stop.clone());
    let mut other =
        s.start_controller(&["--valkey-key-prefix", "tl2", "--installation-id", "team-b"]);
    // Both TargetLeases say that team-b leaves them to the installation that acts here.
    for name in ["first", "second"] {
        let lease = s
            .wait(name, "InstallationConflict", 30 * SEC, |l| {
                condition(l, "InstallationConflict").is_some_and(|c| c.status == "True")
            })
            .await;
        let said = condition(&lease, "InstallationConflict").expect("condition");
        assert_eq!(said.reason, "OtherInstallation");
        assert!(
            said.message.contains("\"team-b\"")
                && said.message.contains("unnamed (Valkey key prefix tl)"),
            "{}",
            said.message
        );
    }
    // Two renewal periods and more with both running: the holder keeps its token, the waiter waits.
    let until = Instant::now() + 8 * SEC;
    while Instant::now() < until {
        let first = s.get("first").await;
        assert_eq!(phase_of(&first), Some(Phase::Held));
        assert_eq!(token_of(&first), token, "the holder's token moved");
        assert_eq!(phase_of(&s.get("second").await), Some(Phase::Waiting));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logs = other.logs();
    assert!(
        logs.contains("another installation acts on the TargetLeases of this namespace"),
        "{logs}"
    );
    let admin = Admin::single(&s.valkey.url(), None).await;
    // Its installation's claim on its key prefix (tl2:installation), and no lease.
    let theirs = admin.cmd(&["KEYS", "tl2:{*"]).await;
    assert_eq!(
        theirs,
        redis::Value::Array(Vec::new()),
        "the other installation wrote to its store"
    );
    let markers: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(s.client.clone(), &s.ns);
    let marker = markers
        .get("targetlease-installation")
        .await
        .expect("the marker");
    assert_eq!(
        marker.spec.and_then(|m| m.holder_identity).as_deref(),
        Some("unnamed (Valkey key prefix tl)")
    );
    // The installation that acts here hands over as before; the other still does nothing.
    s.delete("first").await;
    let second = s.wait_phase("second", Phase::Held, 10 * SEC).await;
    assert!(token_of(&second) > token);
    tokio::time::sleep(2 * SEC).await;
    assert_eq!(token_of(&s.get("second").await), token_of(&second));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(watcher.await.expect("watcher"), 1);
    other.terminate();
}

// The same two installations starting at once, before any claim: exactly one marker, and the
// claims on one target are never Held twice, nor their tokens moved.
async fn installations_starting_together_pick_one(mut s: Scenario) {
    s.controller().terminate();
    let mut a = s.start_controller(&["--installation-id", "team-a"]);
    let mut b = s.start_controller(&["--valkey-key-prefix", "tl2", "--installation-id", "team-b"]);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = never_more_held_than(&s, "together", 1, stop.clone());
    for i in 0..4 {
        s.apply(
            &format!("claim-{i}"),
            "together",
            &format!("holder-{i}"),
            "ttlSeconds: 6",
        );
    }
    // Whichever installation won the namespace serves the line: one Held, its token fixed.
    let deadline = Instant::now() + 30 * SEC;
    let (holder, token) = loop {
        let all = s.api().list(&Default::default()).await.expect("list").items;
        if let Some(l) = all.iter().find(|l| phase_of(l) == Some(Phase::Held)) {
            break (l.name_any(), token_of(l));
        }
        assert!(Instant::now() < deadline, "nothing Held");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let until = Instant::now() + 6 * SEC;
    while Instant::now() < until {
        assert_eq!(
            token_of(&s.get(&holder).await),
            token,
            "the holder's token moved"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let markers: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(s.client.clone(), &s.ns);
    let winner = markers
        .get("targetlease-installation")
        .await
        .expect("the marker")
        .spec
        .and_then(|m| m.holder_identity)
        .expect("a holder");
    let (loser, loser_logs) = if winner == "team-a" {
        ("team-b", b.logs())
    } else {
        assert_eq!(winner, "team-b");
        ("team-a", a.logs())
    };
    assert!(
        loser_logs.contains("another installation acts on the TargetLeases of this namespace"),
        "{loser} did not say so:\n{loser_logs}"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(watcher.await.expect("watcher"), 1);
    a.terminate();
    b.terminate();
}

/// The suite's scenarios, one at a time on one control plane.
pub fn suite(args: &Arguments) -> Conclusion {
    let scenarios = scenarios![
        apply_leads_to_held,
        overlapping_installations_never_both_act,
        installations_starting_together_pick_one,
        handover_on_delete,
        stale_cleanup_touches_only_its_own_object,
        invalid_resources_are_refused,
        holder_pod_gone_releases,
        holder_pods_narrowed_need_no_pod_access,
        controller_restart_keeps_leases,
        leader_failover_keeps_leases,
        cut_off_leader_stops_first,
        lapsed_leader_leads_again,
        expires_at_stays_true,
        store_refusals_within_the_expiry_keep_held,
        release_flag_and_max_hold,
        backend_outage_keeps_finalizer,
        fair_handover_in_creation_order,
        forged_status_token_is_ignored,
        stuck_leader_steps_aside,
        stuck_leader_exits_on_sigterm,
        deleted_leader_lease_never_two_leaders,
        unreadable_holder_pod_keeps_renewing,
        refused_status_write_takes_no_second_grant,
        failing_claim_is_judged_by_the_measured_expiry,
        give_up_under_conflicts_never_shows_two_held,
        same_second_claims_go_in_creation_order,
        slow_api_server_loses_no_lease,
        store_blip_while_refreshes_are_shed_loses_no_lease,
        ttl_edit_while_held_reaches_the_store,
        data_loss_never_shows_two_held,
        permits_cap_holders_and_pass_in_order,
        a_list_of_namespaces_is_watched_as_one,
        sentinel_failover_keeps_leases_held,
        alerts_and_dashboard_name_real_metrics,
        etcd_backend_holds_hands_over_and_fences,
        a_move_from_valkey_to_etcd_never_shows_two_held,
        a_claim_deleted_mid_acquire_leaves_nothing_held,
    ];
    run_scenarios(args, scenarios.to_vec())
}

/// Replaces the scenario's controller by one on `etcd` (every member an endpoint, the prefix
/// `tl-<namespace>`) with `extra` flags; answers the endpoints and the prefix.
fn controller_on_etcd(s: &mut Scenario, etcd: &EtcdCluster, extra: &[&str]) -> (String, String) {
    let endpoints = etcd.urls().join(",");
    let prefix = format!("tl-{}", s.ns);
    s.controller.take();
    let mut args = vec![
        "--watch-namespace",
        s.ns.as_str(),
        "--backend",
        "etcd",
        "--etcd-endpoints",
        endpoints.as_str(),
        "--etcd-key-prefix",
        prefix.as_str(),
    ];
    args.extend_from_slice(extra);
    let kubeconfig = std::path::Path::new(s.cluster.kubeconfig());
    let controller = ControllerProcess::start_reaching(&s.cluster, kubeconfig, &args, &[]);
    s.controller = Some(controller);
    (endpoints, prefix)
}

// The controller on `--backend etcd`, a three-member cluster: a TargetLease is Held; a second
// one on the same target waits; the etcd leader is killed and the holder stays Held with its
// token all along; the holder's deletion hands the target over with a larger token; and
// `targetlease lease check --backend etcd` calls the old token stale and the new one current.
async fn etcd_backend_holds_hands_over_and_fences(mut s: Scenario) {
    let mut etcd = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .expect("start etcd");
    let (endpoints, prefix) = controller_on_etcd(&mut s, &etcd, &[]);
    s.apply("holder", "etcd-target", "worker-a", "ttlSeconds: 10");
    let held = s.wait_phase("holder", Phase::Held, 30 * SEC).await;
    let first = token_of(&held);
    s.apply("waiter", "etcd-target", "worker-b", "ttlSeconds: 10");
    s.wait_phase("waiter", Phase::Waiting, 30 * SEC).await;

    // The leader killed: the holder stays Held with its token through the election and a
    // renewal or two (every 10/3 s).
    // `targetlease lease ...` on the controller's etcd and prefix, for this namespace's target.
    let lease = |args: &[&str]| -> serde_json::Value {
        let out = std::process::Command::new(support::kube::targetlease_bin())
            .arg("lease")
            .args(args)
            .args(["--backend", "etcd", "--etcd-endpoints", endpoints.as_str()])
            .args(["--etcd-key-prefix", prefix.as_str()])
            .args(["--namespace", s.ns.as_str(), "--target", "etcd-target"])
            .output()
            .expect("run targetlease");
        serde_json::from_slice(&out.stdout).expect("one JSON object")
    };
    let leader = etcd.leader().expect("an etcd leader");
    etcd.kill(leader);
    let watched_until = Instant::now() + 8 * SEC;
    while Instant::now() < watched_until {
        let lease = s.get("holder").await;
        assert_eq!(phase_of(&lease), Some(Phase::Held), "{:?}", lease.status);
        assert_eq!(token_of(&lease), first, "the holder's token changed");
        let waiter = s.get("waiter").await;
        assert_ne!(phase_of(&waiter), Some(Phase::Held), "two holders");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Renewed in etcd meanwhile (every 10/3 s): 8 s after Held, an unrenewed lease would have
    // 2 s left.
    let inspected = lease(&["inspect"]);
    assert_eq!(
        inspected["lease"]["token"].as_u64(),
        Some(first),
        "{inspected}"
    );
    let left = inspected["lease"]["expiresInMs"].as_u64().unwrap_or(0);
    assert!(
        left > 5_000,
        "not renewed while a member was down: {inspected}"
    );
    s.delete("holder").await;
    let taken = s.wait_phase("waiter", Phase::Held, 30 * SEC).await;
    let second = token_of(&taken);
    assert!(second > first, "{second} <= {first}");
    let check = |token: u64| {
        let token = token.to_string();
        lease(&["check", "--token", &token])["outcome"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    assert_eq!(check(first), "stale");
    assert_eq!(check(second), "current");
    etcd.restart(leader);
}

// An installation moved from Valkey to etcd (docs/operations.md, "Moving an installation from
// Valkey to etcd"): a TargetLease Held on Valkey, a second one waiting; the controller stops and
// one on etcd starts in its place. One of the two is Held in etcd with a token above the Valkey
// token (the status tokens are the floor), and at no moment (sampled every 50 ms, until 3 s
// after) do both show Held.
async fn a_move_from_valkey_to_etcd_never_shows_two_held(mut s: Scenario) {
    // The installation keeps its id across the move, as the chart's does (`<namespace>/<release>`):
    // the namespace stays its own. Without an id, each backend names another installation.
    const ID: &str = "shop/targetlease";
    s.controller.take();
    s.controller = Some(s.start_controller(&["--installation-id", ID]));
    s.apply("holder", "moved-target", "worker-a", "ttlSeconds: 10");
    let held = s.wait_phase("holder", Phase::Held, 30 * SEC).await;
    let on_valkey = token_of(&held);
    s.apply("waiter", "moved-target", "worker-b", "ttlSeconds: 10");
    s.wait_phase("waiter", Phase::Waiting, 30 * SEC).await;

    let etcd = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .expect("start etcd");
    controller_on_etcd(&mut s, &etcd, &["--installation-id", ID]);
    // Either the holder is claimed again in etcd (its reconcile comes first) or its renewal
    // finds it missing first (Lost, as after a data loss) and the target passes to the waiter:
    // both are the move documented. One Held, with a token above the Valkey one, either way.
    let until = Instant::now() + 30 * SEC;
    let mut on_etcd = None;
    let mut phases = Vec::new();
    while Instant::now() < until {
        let holder = s.get("holder").await;
        let waiter = s.get("waiter").await;
        let both = (phase_of(&holder), phase_of(&waiter));
        if phases.last() != Some(&both) {
            phases.push(both);
        }
        assert_ne!(
            both,
            (Some(Phase::Held), Some(Phase::Held)),
            "two Held on one target during the move: {phases:?}"
        );
        let held = match both {
            (Some(Phase::Held), _) if token_of(&holder) != on_valkey => Some(("holder", &holder)),
            (_, Some(Phase::Held)) => Some(("waiter", &waiter)),
            _ => None,
        };
        if let Some((who, lease)) = held {
            on_etcd = Some((who, token_of(lease)));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = s.get("holder").await.status;
    let (who, on_etcd) = on_etcd.unwrap_or_else(|| {
        let logs = s.controller.as_ref().map(|c| c.logs()).unwrap_or_default();
        panic!(
            "no TargetLease Held on etcd in 30 s; phases seen: {phases:?}; holder status \
             {last:?}; the controller on etcd said:\n{logs}"
        )
    });
    assert!(
        on_etcd > on_valkey,
        "token {on_etcd} on etcd not above {on_valkey} on Valkey"
    );
    // Hold on a while: the other never shows Held beside it.
    let settle = Instant::now() + 3 * SEC;
    while Instant::now() < settle {
        let both = (
            phase_of(&s.get("holder").await),
            phase_of(&s.get("waiter").await),
        );
        assert_ne!(
            both,
            (Some(Phase::Held), Some(Phase::Held)),
            "two Held on one target after the move: {phases:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("moved: token {on_valkey} on Valkey, {on_etcd} on etcd ({who}); phases {phases:?}");
    s.controller.take();
    tokio::task::spawn_blocking(move || drop(etcd))
        .await
        .expect("stop etcd");
}

// A TargetLease deleted while the controller's acquire for it is in flight (Valkey 300 ms away
// each way, through a proxy): the grant comes back after the delete, so the Held status write,
// which carries the resourceVersion it was decided on, is refused (the object changed); the
// cleanup then asks the store what this lease id holds and releases it. The claim never shows
// Held, the store holds nothing for the target once the object is gone, and the next claim on
// the target is Held at once rather than when the orphaned lease's TTL (30 s) ran out.
async fn a_claim_deleted_mid_acquire_leaves_nothing_held(mut s: Scenario) {
    let proxy = Proxy::start(s.valkey.port).await;
    s.controller.take();
    let valkey = format!("redis://127.0.0.1:{}", proxy.port);
    let kubeconfig = std::path::Path::new(s.cluster.kubeconfig());
    // Deadlines that fit opening a connection (several round trips) at that latency: the pool's
    // connections are opened lazily, so the calls below may each open one.
    let args = [
        "--watch-namespace",
        s.ns.as_str(),
        "--valkey-timeout",
        "5s",
        "--valkey-connect-timeout",
        "5s",
    ];
    s.controller = Some(ControllerProcess::start_as(
        &s.cluster, kubeconfig, &valkey, &args,
    ));
    proxy.set(Mode::Latency(Duration::from_millis(300)));
    // Every change of the claim until the watch sees it deleted (which proves it saw them all).
    let phases = tokio::spawn({
        let mut events = watcher(
            s.api(),
            watcher::Config::default().fields("metadata.name=racer"),
        )
        .boxed();
        async move {
            let mut seen = Vec::new();
            while let Ok(Some(event)) = tokio::time::timeout(60 * SEC, events.next()).await {
                match event {
                    Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                        seen.push(phase_of(&lease));
                    }
                    Ok(watcher::Event::Delete(_)) => return Ok(seen),
                    Ok(watcher::Event::Init | watcher::Event::InitDone) => {}
                    Err(e) => eprintln!("watch error (retrying): {e}"),
                }
            }
            Err(seen)
        }
    });
    s.apply("racer", "raced-target", "worker-a", "ttlSeconds: 30");
    // The finalizer is added first; the acquire is sent right after it.
    s.wait("racer", "its finalizer", 30 * SEC, |l| {
        l.finalizers()
            .iter()
            .any(|f| f == targetlease::api::FINALIZER)
    })
    .await;
    s.delete("racer").await;
    s.wait_gone("racer", 30 * SEC).await;
    proxy.set(Mode::Pass);
    let logs = s.controller().logs();
    assert!(
        logs.contains("acquired lease=racer"),
        "the acquire was not granted, so nothing raced the delete:\n{logs}"
    );
    let seen = s.inspect("raced-target").await;
    assert!(
        seen.lease.is_none(),
        "the store still holds the deleted claim's lease: {:?}",
        seen.lease.map(|l| l.owner)
    );
    s.apply("next", "raced-target", "worker-b", "ttlSeconds: 30");
    s.wait_phase("next", Phase::Held, 5 * SEC).await;
    let phases = match phases.await.expect("watch") {
        Ok(phases) => phases,
        Err(seen) => panic!("the watch never saw the claim deleted; it saw {seen:?}"),
    };
    assert!(
        !phases.contains(&Some(Phase::Held)),
        "the deleted claim showed Held: {phases:?}"
    );
}
