//! The reconcile against a mocked API server and the in-memory store: the decisions that the
//! control-plane suites reach only by timing (a status write refused, a 409, a deletion
//! mid-tenure, a missing or unreadable holder pod, a claim behind in line), each checked request
//! by request.

use std::sync::Arc;

use http::StatusCode;
use kube::runtime::controller::Action;
use serde_json::json;
use tokio::task::JoinHandle;

use super::reconcile;
use crate::api::{HolderRef, Phase, TargetLease, TargetLeaseSpec, test_spec};
use crate::controller::error::Error;
use crate::controller::fixtures::{Fixture, claim};

/// Runs one reconcile of `lease` in the background (the test answers its requests meanwhile).
fn reconciling(fx: &Fixture, lease: &TargetLease) -> JoinHandle<Result<Action, Error>> {
    tokio::spawn(reconcile(Arc::new(lease.clone()), fx.ctx.clone()))
}

/// A claim acquired by a reconcile whose status write the API server applied: the object as
/// written, and its token.
async fn held(fx: &mut Fixture, name: &str, spec: TargetLeaseSpec) -> (TargetLease, u64) {
    let new = claim(name, spec);
    fx.cache(&new);
    let running = reconciling(fx, &new);
    let written = fx.api.write_status(&new).await;
    assert_eq!(fx.api.event().await, "Acquired");
    running.await.expect("task").expect("reconcile");
    let status = written.status.clone().expect("status");
    assert_eq!(status.phase, Phase::Held);
    fx.cache(&written);
    (written, status.fencing_token.expect("token"))
}

/// A grant whose status write is refused (409: the object changed since it was read) is kept,
/// and the next reconcile publishes that very grant: the store is never asked for a second one.
#[tokio::test]
async fn a_refused_status_write_never_costs_a_second_grant() {
    let mut fx = Fixture::new();
    let new = claim("a", test_spec("t", "w"));
    fx.cache(&new);
    let running = reconciling(&fx, &new);
    let (status, sent) = fx.api.status_write(&new).await;
    assert_eq!(status.phase, Phase::Held);
    let token = status.fencing_token.expect("token");
    sent.refuse(409, "Conflict");
    let error = running
        .await
        .expect("task")
        .expect_err("a refused write fails");
    assert!(error.is_stale_read(), "{error}");
    // The store holds the grant all the same.
    let seen = fx.inspect("t").await;
    assert_eq!(seen.lease.as_ref().map(|l| l.token), Some(token));
    // Again, on the same (stale) object: the same grant is published.
    let running = reconciling(&fx, &new);
    let written = fx.api.write_status(&new).await;
    assert_eq!(fx.api.event().await, "Acquired");
    running.await.expect("task").expect("reconcile");
    let status = written.status.expect("status");
    assert_eq!(
        (status.phase, status.fencing_token),
        (Phase::Held, Some(token))
    );
    let seen = fx.inspect("t").await;
    assert_eq!(seen.lease.map(|l| l.token), Some(token));
    assert_eq!(seen.fence, token, "a second token was issued");
}

/// A deleted holder leaves Held in its status before the store lets the lease go, then its
/// finalizer goes: a waiter can never be granted the target while the holder still shows Held.
#[tokio::test]
async fn a_deleted_holder_shows_released_before_the_store_lets_go() {
    let mut fx = Fixture::new();
    let (held, token) = held(&mut fx, "a", test_spec("t", "w")).await;
    let mut waiter = claim("b", test_spec("t", "w2"));
    waiter.status = Some(crate::api::TargetLeaseStatus {
        phase: Phase::Waiting,
        ..Default::default()
    });
    fx.cache(&waiter);
    while fx.woken.try_recv().is_ok() {}
    let mut deleting = held.clone();
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    );
    fx.cache(&deleting);
    let running = reconciling(&fx, &deleting);
    let (status, sent) = fx.api.status_write(&deleting).await;
    assert_eq!(status.phase, Phase::Released);
    assert_eq!(status.fencing_token, Some(token));
    // At the moment of the write, the lease is still held in the store.
    let seen = fx.inspect("t").await;
    assert_eq!(seen.lease.as_ref().map(|l| l.token), Some(token));
    let mut written = deleting.clone();
    written.status = Some(status);
    written.metadata.resource_version = Some("3".into());
    sent.answer(
        StatusCode::OK,
        &serde_json::to_value(&written).expect("JSON"),
    );
    assert_eq!(fx.api.event().await, "Released");
    fx.api.remove_finalizer(&deleting).await;
    running.await.expect("task").expect("reconcile");
    assert!(fx.inspect("t").await.lease.is_none(), "not released");
    // The waiter is woken to take the target at once.
    let woken: Vec<_> = std::iter::from_fn(|| fx.woken.try_recv().ok()).collect();
    assert!(
        woken.contains(&kube::runtime::reflector::ObjectRef::from_obj(&waiter)),
        "{woken:?}"
    );
}

/// The same deletion, with the Released write refused (409): nothing is released, the lease is
/// still kept, and the finalizer stays.
#[tokio::test]
async fn a_refused_release_write_releases_nothing() {
    let mut fx = Fixture::new();
    let (held, token) = held(&mut fx, "a", test_spec("t", "w")).await;
    let mut deleting = held.clone();
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    );
    let running = reconciling(&fx, &deleting);
    let (status, sent) = fx.api.status_write(&deleting).await;
    assert_eq!(status.phase, Phase::Released);
    sent.refuse(409, "Conflict");
    let error = running.await.expect("task").expect_err("refused");
    assert!(error.is_stale_read(), "{error}");
    fx.api.quiet().await;
    let seen = fx.inspect("t").await;
    assert_eq!(
        seen.lease.map(|l| l.token),
        Some(token),
        "released behind a Held status"
    );
    let key = kube::runtime::reflector::ObjectRef::from_obj(&held);
    assert!(fx.ctx.tenures.view(&key).is_some(), "no longer renewed");
}

/// A claim whose holder pod does not exist (deleted while nobody watched) is released as
/// HolderGone, its status first.
#[tokio::test]
async fn a_missing_holder_pod_releases_its_claim() {
    let mut fx = Fixture::new();
    let spec = TargetLeaseSpec {
        holder_ref: Some(HolderRef {
            kind: "Pod".into(),
            name: "worker-0".into(),
            uid: None,
        }),
        ..test_spec("t", "w")
    };
    let new = claim("a", spec);
    fx.cache(&new);
    // The first reconcile reads the pod (the watch has not seen it): alive.
    let running = reconciling(&fx, &new);
    let get = fx.api.next().await;
    assert!(get.uri.contains("/pods/worker-0"), "{}", get.uri);
    get.answer(
        StatusCode::OK,
        &json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "worker-0", "namespace": "ns", "uid": "p1"},
                "status": {"phase": "Running"}}),
    );
    let written = fx.api.write_status(&new).await;
    assert_eq!(fx.api.event().await, "Acquired");
    running.await.expect("task").expect("reconcile");
    fx.cache(&written);
    let token = written.status.as_ref().and_then(|s| s.fencing_token);
    // The pod watch then sees it deleted.
    fx.ctx.holders.pod_deleted_for_tests("ns", "worker-0");
    let running = reconciling(&fx, &written);
    let (status, sent) = fx.api.status_write(&written).await;
    assert_eq!(status.phase, Phase::Released);
    let reason = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.reason.clone());
    assert_eq!(reason.as_deref(), Some("HolderGone"));
    assert_eq!(fx.inspect("t").await.lease.map(|l| l.token), token);
    let mut released = written.clone();
    released.status = Some(status);
    sent.answer(
        StatusCode::OK,
        &serde_json::to_value(&released).expect("JSON"),
    );
    assert_eq!(fx.api.event().await, "Released");
    running.await.expect("task").expect("reconcile");
    assert!(fx.inspect("t").await.lease.is_none());
}

/// A holder pod the controller may not read says nothing of the holder: the lease is taken all
/// the same and the status says why the holder is not tracked.
#[tokio::test]
async fn an_unreadable_holder_pod_keeps_the_lease_and_says_so() {
    let mut fx = Fixture::new();
    let spec = TargetLeaseSpec {
        holder_ref: Some(HolderRef {
            kind: "Pod".into(),
            name: "worker-0".into(),
            uid: None,
        }),
        ..test_spec("t", "w")
    };
    let new = claim("a", spec);
    fx.cache(&new);
    let running = reconciling(&fx, &new);
    let get = fx.api.next().await;
    assert!(get.uri.contains("/pods/worker-0"), "{}", get.uri);
    get.refuse(403, "Forbidden");
    let written = fx.api.write_status(&new).await;
    assert_eq!(fx.api.event().await, "Acquired");
    running.await.expect("task").expect("reconcile");
    let status = written.status.expect("status");
    assert_eq!(status.phase, Phase::Held);
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "HolderUnknown")
    );
    assert!(fx.inspect("t").await.lease.is_some());
}

/// A claim behind another in line asks the store nothing: it says whom it waits behind.
#[tokio::test]
async fn a_claim_behind_in_line_asks_the_store_nothing() {
    let mut fx = Fixture::new();
    let mut older = claim("older", test_spec("t", "w1"));
    older.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::from_second(1_800_000_000).expect("time"),
    ));
    let mut newer = claim("newer", test_spec("t", "w2"));
    newer.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::from_second(1_800_000_005).expect("time"),
    ));
    fx.cache(&older);
    fx.cache(&newer);
    let running = reconciling(&fx, &newer);
    let written = fx.api.write_status(&newer).await;
    running.await.expect("task").expect("reconcile");
    let status = written.status.expect("status");
    assert_eq!(status.phase, Phase::Waiting);
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready");
    assert!(
        ready.message.contains("in line after older"),
        "{}",
        ready.message
    );
    assert!(fx.inspect("t").await.lease.is_none(), "the store was asked");
    fx.api.quiet().await;
}

/// `claim` as a `targetlease run` holds it: with its heartbeat.
fn beating(mut lease: TargetLease) -> TargetLease {
    lease.metadata.annotations = Some(
        [(
            crate::api::heartbeat::HEARTBEAT_ANNOTATION.to_owned(),
            "1700000000000 ttl=1".to_owned(),
        )]
        .into(),
    );
    lease
}

fn deleting(lease: &TargetLease) -> TargetLease {
    let mut deleting = lease.clone();
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    );
    deleting
}

fn held_reason(lease: &TargetLease) -> Option<String> {
    lease
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Held")
        .map(|c| c.reason.clone())
}

/// A deleted claim held by a `run` keeps its lease in the store (and its finalizer) until the
/// run confirms that its command stopped: the status says Released with the Held condition
/// `Stopping`, no waiter can take the target meanwhile, and the run's acknowledgment passes it
/// on at once.
#[tokio::test]
async fn a_deleted_run_holder_keeps_the_lease_until_its_command_stopped() {
    let mut fx = Fixture::new();
    let spec = TargetLeaseSpec {
        ttl_seconds: 1,
        ..test_spec("t", "w")
    };
    let (held, token) = held(&mut fx, "a", spec).await;
    let held = beating(held);
    let gone = deleting(&held);
    fx.cache(&gone);
    let running = reconciling(&fx, &gone);
    let stopping = fx.api.write_status(&gone).await;
    assert_eq!(fx.api.event().await, "Released");
    let error = running
        .await
        .expect("task")
        .expect_err("waits for the holder");
    assert!(error.stopping().is_some(), "{error}");
    assert_eq!(
        stopping.status.as_ref().map(|s| s.phase),
        Some(Phase::Released)
    );
    assert_eq!(held_reason(&stopping).as_deref(), Some("Stopping"));
    fx.api.quiet().await;
    assert_eq!(
        fx.inspect("t").await.lease.map(|l| l.token),
        Some(token),
        "released before the holder stopped"
    );
    // A waiter asks nothing meanwhile.
    fx.cache(&stopping);
    let waiter = claim("b", test_spec("t", "w2"));
    fx.cache(&waiter);
    let running = reconciling(&fx, &waiter);
    let waiting = fx.api.write_status(&waiter).await;
    running.await.expect("task").expect("reconcile");
    assert_eq!(waiting.status.map(|s| s.phase), Some(Phase::Waiting));
    // The run confirms: the target passes on.
    let mut confirmed = stopping.clone();
    confirmed
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            crate::api::heartbeat::STOPPED_ANNOTATION.into(),
            token.to_string(),
        );
    fx.cache(&confirmed);
    let running = reconciling(&fx, &confirmed);
    let done = fx.api.write_status(&confirmed).await;
    assert_eq!(held_reason(&done).as_deref(), Some("ReleaseRequested"));
    fx.api.remove_finalizer(&confirmed).await;
    running.await.expect("task").expect("reconcile");
    assert!(fx.inspect("t").await.lease.is_none(), "not released");
}

/// A run that never answers (its node gone with it, say) is not waited for past the bound by
/// which it has killed its command: half the TTL after the status left Held.
#[tokio::test]
async fn a_silent_run_holder_is_passed_on_at_the_bound() {
    let mut fx = Fixture::new();
    let spec = TargetLeaseSpec {
        ttl_seconds: 1,
        release: false,
        ..test_spec("t", "w")
    };
    let (held, _) = held(&mut fx, "a", spec).await;
    let mut released = beating(held);
    released.spec.release = true;
    fx.cache(&released);
    let started = std::time::Instant::now();
    let running = reconciling(&fx, &released);
    let stopping = fx.api.write_status(&released).await;
    assert_eq!(fx.api.event().await, "Released");
    running.await.expect("task").expect("reconcile");
    assert_eq!(held_reason(&stopping).as_deref(), Some("Stopping"));
    fx.cache(&stopping);
    // Before the bound: nothing passes on.
    let running = reconciling(&fx, &stopping);
    running.await.expect("task").expect("reconcile");
    fx.api.quiet().await;
    assert!(fx.inspect("t").await.lease.is_some());
    // At the bound (half the 1 s TTL): passed on.
    tokio::time::sleep(std::time::Duration::from_millis(600).saturating_sub(started.elapsed()))
        .await;
    let running = reconciling(&fx, &stopping);
    let done = fx.api.write_status(&stopping).await;
    running.await.expect("task").expect("reconcile");
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(held_reason(&done).as_deref(), Some("ReleaseRequested"));
    assert!(fx.inspect("t").await.lease.is_none());
}

/// After an outage longer than the TTL the store no longer holds a run holder's lease while
/// its status still says Held (its run still working, its heartbeats confirmed): a waiter never
/// asks the store then; the holder's own reconcile learns of the loss and waits for its run.
#[tokio::test]
async fn a_waiter_never_asks_while_a_run_holder_shows_held() {
    let mut fx = Fixture::new();
    let mut holder = beating(claim("a", test_spec("t", "w")));
    holder.status = Some(crate::controller::decide::tests::held_since(0, 7));
    holder.metadata.creation_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::from_second(1_800_000_000).expect("time"),
        ));
    fx.cache(&holder);
    let waiter = claim("b", test_spec("t", "w2"));
    fx.cache(&waiter);
    assert!(fx.inspect("t").await.lease.is_none(), "the store lost it");
    let running = reconciling(&fx, &waiter);
    let written = fx.api.write_status(&waiter).await;
    running.await.expect("task").expect("reconcile");
    assert_eq!(written.status.map(|s| s.phase), Some(Phase::Waiting));
    assert!(
        fx.inspect("t").await.lease.is_none(),
        "the waiter asked the store"
    );
}

/// The store lost a run holder's lease (a data loss, an outage longer than the TTL): its status
/// goes Lost with the Held condition `Stopping`, so that no waiter is granted the target before
/// the run stopped its command.
#[tokio::test]
async fn a_lost_tenure_of_a_run_holder_waits_for_it() {
    let mut fx = Fixture::new();
    let (held, token) = held(&mut fx, "a", test_spec("t", "w")).await;
    let held = beating(held);
    fx.cache(&held);
    fx.store.forget_everything();
    let key = kube::runtime::reflector::ObjectRef::from_obj(&held);
    fx.ctx.tenures.renew_now_for_tests(&key).await;
    let running = reconciling(&fx, &held);
    let lost = fx.api.write_status(&held).await;
    assert_eq!(fx.api.event().await, "Expired");
    running.await.expect("task").expect("reconcile");
    assert_eq!(lost.status.as_ref().map(|s| s.phase), Some(Phase::Lost));
    assert_eq!(held_reason(&lost).as_deref(), Some("Stopping"));
    assert_eq!(
        lost.status.as_ref().and_then(|s| s.fencing_token),
        Some(token)
    );
    // A waiter asks nothing while it stops.
    fx.cache(&lost);
    let waiter = claim("b", test_spec("t", "w2"));
    fx.cache(&waiter);
    let running = reconciling(&fx, &waiter);
    let waiting = fx.api.write_status(&waiter).await;
    running.await.expect("task").expect("reconcile");
    assert_eq!(waiting.status.map(|s| s.phase), Some(Phase::Waiting));
    assert!(
        fx.inspect("t").await.lease.is_none(),
        "the waiter was granted"
    );
}

/// A deleted holder whose cleanup removed its finalizer: the reconcile its own status write
/// queued runs on the cached copy, still deleting and still carrying the finalizer, and sends
/// nothing. (Before, it asked the store what the lease id held and patched the finalizer again:
/// a request refused with 404, made while the next claim's grant was being written.)
#[tokio::test]
async fn a_finished_cleanup_is_not_done_twice() {
    let mut fx = Fixture::new();
    let (held, _) = held(&mut fx, "a", test_spec("t", "w")).await;
    let mut deleting = held.clone();
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    );
    fx.cache(&deleting);
    let running = reconciling(&fx, &deleting);
    let written = fx.api.write_status(&deleting).await;
    fx.api.remove_finalizer(&deleting).await;
    running.await.expect("task").expect("reconcile");
    assert_eq!(fx.api.event().await, "Released");
    fx.cache(&written);
    reconciling(&fx, &written)
        .await
        .expect("task")
        .expect("reconcile");
    fx.api.quiet().await;
}

/// The store lost a permit (a data loss, a failover to a replica that missed it) while its
/// holder's status still says Held and this process still renews it: the next claim asks on a
/// target with a free permit and the store answers with the lost one. The grant is given back
/// unpublished (no status, no Event), so two commands never run in one slot. (Before, the
/// waiter was shown Held in slot 0 beside the holder until the holder's next renewal, and a
/// 15-minute chaos run saw two `run` commands in one slot for up to 2.4 s.)
#[tokio::test]
async fn a_permit_the_store_lost_is_not_granted_twice() {
    let mut fx = Fixture::new();
    let spec = |holder: &str| {
        let mut spec = test_spec("t", holder);
        spec.permits = 2;
        spec
    };
    let (held, _) = held(&mut fx, "a", spec("w")).await;
    assert_eq!(held.status.as_ref().and_then(|s| s.slot), Some(0));
    fx.cache(&beating(held));
    fx.store.forget_everything();
    let waiter = claim("b", spec("w2"));
    fx.cache(&waiter);
    reconciling(&fx, &waiter)
        .await
        .expect("task")
        .expect("reconcile");
    fx.api.quiet().await;
    let seen = fx.inspect("t").await;
    assert!(
        seen.holders().next().is_none(),
        "the lost permit was granted to the waiter: {seen:?}"
    );
}

/// The same on an exclusive target whose holder does not heartbeat, after an outage longer
/// than the TTL: the restarted controller keeps the holder from its Held status, and the
/// waiter's grant is given back until the holder's renewal said it lost. Then the holder shows
/// Lost, and the waiter waits its turn behind it: never two Held.
#[tokio::test]
async fn an_expired_holder_still_shown_held_is_not_granted_beside() {
    let mut fx = Fixture::new();
    let (held, _) = held(&mut fx, "a", test_spec("t", "w")).await;
    fx.store.forget_everything();
    let waiter = claim("b", test_spec("t", "w2"));
    fx.cache(&waiter);
    reconciling(&fx, &waiter)
        .await
        .expect("task")
        .expect("reconcile");
    fx.api.quiet().await;
    assert!(fx.inspect("t").await.lease.is_none(), "granted beside");
    // The holder's renewal: lost; its reconcile says so; then the waiter is granted.
    let key = kube::runtime::reflector::ObjectRef::from_obj(&held);
    fx.ctx.tenures.renew_now_for_tests(&key).await;
    let running = reconciling(&fx, &held);
    let lost = fx.api.write_status(&held).await;
    assert_eq!(fx.api.event().await, "Expired");
    running.await.expect("task").expect("reconcile");
    assert_eq!(lost.status.as_ref().map(|s| s.phase), Some(Phase::Lost));
    fx.cache(&lost);
    // The holder, older, is first in line to take its target back; the waiter says it waits.
    let running = reconciling(&fx, &waiter);
    let waiting = fx.api.write_status(&waiter).await;
    running.await.expect("task").expect("reconcile");
    assert_eq!(waiting.status.map(|s| s.phase), Some(Phase::Waiting));
    assert!(fx.inspect("t").await.lease.is_none(), "granted out of turn");
}
