//! The tenure layer on tokio's paused clock, against the in-memory store whose clock follows
//! it: renewals without reconciles, a backlog that never shows a passed grant as renewed, and
//! tenures forgotten with their TargetLease. Nothing here sleeps in real time.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::time::Instant;

use super::schedule::retry_after_failure;
use super::*;
use crate::store::StoreError;
use crate::store::memory::{Clock, MemoryStore};
use crate::store::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, GuardedKey,
    GuardedValue, Inspection, LeaseId, Owner, ReleaseOutcome, ReleaseRequest, RenewOutcome,
    RenewRequest, RepairOutcome, RequestId, Slot, Token,
};

/// The store's clock, moving with tokio's (paused) clock from the system time at its start.
#[derive(Clone)]
pub(crate) struct TokioClock {
    base_us: u64,
    start: Instant,
}

impl TokioClock {
    pub(crate) fn new() -> Self {
        Self {
            base_us: crate::store::memory::SystemClock.now_micros(),
            start: Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now_micros(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.base_us.saturating_add(elapsed)
    }
}

/// An in-memory store on tokio's clock (a reply cache of a minute).
pub(crate) fn store_on_tokio_clock() -> MemoryStore {
    MemoryStore::with_clock(Arc::new(TokioClock::new()), Duration::from_secs(60))
}

#[test]
fn retries_after_failures_are_bounded() {
    assert_eq!(
        retry_after_failure(Duration::from_secs(1)),
        Duration::from_millis(200)
    );
    assert_eq!(
        retry_after_failure(Duration::from_secs(30)),
        Duration::from_millis(2_500).min(Duration::from_secs(2))
    );
}

/// The TargetLease `name` in namespace `ns` with `uid`, as the controller's cache holds it.
pub(crate) fn lease_object(name: &str, uid: &str) -> TargetLease {
    let mut lease = TargetLease::new(name, crate::api::test_spec(name, "w"));
    lease.metadata.namespace = Some("ns".into());
    lease.metadata.uid = Some(uid.to_owned());
    lease
}

/// A running tenure layer over `store`, `concurrency` renewals at once, that judges which
/// tenures are still wanted by `leases`; the reconciles it wakes; its scheduler's task.
pub(crate) fn started(
    store: Arc<dyn LeaseStore>,
    concurrency: usize,
    leases: Store<TargetLease>,
) -> (
    Tenures,
    tokio::sync::mpsc::UnboundedReceiver<ObjectRef<TargetLease>>,
    tokio::task::JoinHandle<()>,
) {
    let (wake, woken) = tokio::sync::mpsc::unbounded_channel();
    let (tenures, scheduler) = Tenures::new(Wiring {
        store,
        metrics: Arc::new(Metrics::new()),
        leadership: Leadership::unconditional(),
        wake,
        concurrency,
        leases,
    });
    (tenures, woken, tokio::spawn(scheduler))
}

pub(crate) fn key(name: &str) -> ObjectRef<TargetLease> {
    ObjectRef::new(name).within("ns")
}

/// Acquires target `name` in `store` for the lease id `uid-{name}`; the handle, the grant and
/// the acquire's answer on this process's clock.
pub(crate) async fn granted(
    store: &dyn LeaseStore,
    name: &str,
    ttl: Ttl,
) -> (LeaseHandle, Grant, Reading) {
    let request = AcquireRequest {
        target: TargetRef::new("ns", name).expect("target"),
        lease_id: LeaseId::new(format!("uid-{name}")).expect("lease id"),
        owner: Owner::new("w").expect("owner"),
        permits: crate::store::Permits::ONE,
        ttl,
        min_token: 0,
        request_id: RequestId::random(),
    };
    let sent = Instant::now();
    let outcome = store.acquire(&request).await.expect("acquire");
    let answered = Instant::now();
    let AcquireOutcome::Acquired(grant) = outcome else {
        panic!("{outcome:?}");
    };
    let handle = LeaseHandle {
        target: request.target,
        permits: request.permits,
        slot: grant.slot,
        lease_id: request.lease_id,
        owner: request.owner,
        token: Token::new(grant.token).expect("token"),
    };
    let reading = Reading {
        sent,
        answered,
        server_ms: grant.server_time_ms,
    };
    (handle, grant, reading)
}

/// Acquires target `name` and hands the grant to `tenures`.
pub(crate) async fn keep_granted(
    tenures: &Tenures,
    store: &dyn LeaseStore,
    name: &str,
    ttl: Ttl,
) -> LeaseHandle {
    let (handle, grant, reading) = granted(store, name, ttl).await;
    tenures.granted(&key(name), handle.clone(), ttl, &grant, reading);
    handle
}

/// At the end of the first list, every Held status is renewed by the scheduler at once, before
/// any reconcile: a new leader whose reconciles wait for the API server keeps the leases all the
/// same. Claims that do not show Held are left alone.
#[tokio::test(start_paused = true)]
async fn every_held_status_is_kept_when_the_list_completes() {
    let store = Arc::new(store_on_tokio_clock());
    let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
    let (leases, mut cache) = kube::runtime::reflector::store();
    let mut handles = Vec::new();
    for (name, held) in [("held-a", true), ("held-b", true), ("waiting", false)] {
        let (handle, grant, _) = granted(store.as_ref(), name, ttl).await;
        let mut lease = lease_object(name, &format!("uid-{name}"));
        lease.spec.ttl_seconds = 1;
        lease.status = Some(crate::api::TargetLeaseStatus {
            phase: if held {
                crate::api::Phase::Held
            } else {
                crate::api::Phase::Waiting
            },
            fencing_token: Some(grant.token),
            ..crate::api::TargetLeaseStatus::default()
        });
        cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease));
        handles.push((name, held, handle));
    }
    let (tenures, _woken, _scheduler) = started(store.clone(), 4, leases.clone());
    tenures.keep_all_held(&leases);
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (name, held, handle) in handles {
        let seen = store.inspect(&handle.target).await.expect("inspect");
        if held {
            assert_eq!(
                tenures.view(&key(name)).map(|v| v.state),
                Some(State::Renewed),
                "{name}"
            );
            assert_eq!(
                seen.lease.map(|l| l.token),
                Some(handle.token.get()),
                "{name}"
            );
        } else {
            assert!(tenures.view(&key(name)).is_none(), "{name}");
            assert!(seen.lease.is_none(), "{name} was renewed");
        }
    }
}

/// Renewals run on their own: kept leases outlive many TTLs without any reconcile, a lost one
/// wakes its reconcile and is renewed no more, and a stopped one is left alone. A TTL of one
/// second, on the paused clock.
#[tokio::test(start_paused = true)]
async fn kept_leases_are_renewed_without_reconciles() {
    let store = Arc::new(store_on_tokio_clock());
    let (leases, mut cache) = kube::runtime::reflector::store();
    for name in ["a", "b", "c", "gone"] {
        // "gone" was deleted and another object of that name made: its uid differs.
        let uid = if name == "gone" {
            "uid-of-another-object".to_owned()
        } else {
            format!("uid-{name}")
        };
        cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease_object(
            name, &uid,
        )));
    }
    let (tenures, mut woken, _scheduler) = started(store.clone(), 2, leases);
    let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
    let mut handles = Vec::new();
    for name in ["a", "b", "c"] {
        handles.push(keep_granted(&tenures, store.as_ref(), name, ttl).await);
    }
    // A tenure whose TargetLease is no longer in the cache (deleted without the finalizer,
    // another object made under its name) is not renewed.
    keep_granted(&tenures, store.as_ref(), "gone", ttl).await;
    // Four TTLs.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(tenures.view(&key("gone")).is_none());
    let seen = store
        .inspect(&TargetRef::new("ns", "gone").expect("target"))
        .await
        .expect("inspect");
    assert!(
        seen.lease.is_none(),
        "a lease of a gone TargetLease was renewed"
    );
    for (name, handle) in ["a", "b", "c"].iter().zip(&handles) {
        let view = tenures.view(&key(name)).expect("kept");
        assert_eq!(view.state, State::Renewed, "{name}");
        let seen = store.inspect(&handle.target).await.expect("inspect");
        assert_eq!(
            seen.lease.map(|l| l.token),
            Some(handle.token.get()),
            "{name}"
        );
    }
    // Woken to publish (nothing publishes here, so at every renewal from the second on), never
    // for a loss.
    let wakes = std::iter::from_fn(|| woken.try_recv().ok()).count();
    assert!(wakes >= 3, "{wakes} wakes");
    // "b" is released behind the scheduler's back: its next renewal says lost, wakes, and it
    // is renewed no more. "c" is stopped: its lease runs out.
    store
        .release(&ReleaseRequest {
            lease: handles[1].clone(),
            request_id: RequestId::random(),
        })
        .await
        .expect("release");
    tenures.stop(&key("c"));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(matches!(
        tenures.view(&key("b")).map(|v| v.state),
        Some(State::Lost(_))
    ));
    assert!(tenures.view(&key("c")).is_none());
    let woken_for: Vec<_> = std::iter::from_fn(|| woken.try_recv().ok()).collect();
    assert!(woken_for.contains(&key("b")));
    let seen = store.inspect(&handles[2].target).await.expect("inspect");
    assert!(seen.lease.is_none(), "a stopped lease was renewed");
    assert_eq!(
        tenures.view(&key("a")).map(|v| v.state),
        Some(State::Renewed)
    );
}

/// A store whose renewals take `delay` each (a loaded Valkey, answering within the call
/// timeout, never failing).
struct SlowRenewals {
    inner: MemoryStore,
    delay: Duration,
}

#[async_trait]
impl LeaseStore for SlowRenewals {
    async fn acquire(&self, r: &AcquireRequest) -> Result<AcquireOutcome, StoreError> {
        self.inner.acquire(r).await
    }
    async fn renew(&self, r: &RenewRequest) -> Result<RenewOutcome, StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.renew(r).await
    }
    async fn release(&self, r: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
        self.inner.release(r).await
    }
    async fn commit(&self, r: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        self.inner.commit(r).await
    }
    async fn read_guarded(
        &self,
        t: &TargetRef,
        slot: Slot,
        k: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError> {
        self.inner.read_guarded(t, slot, k).await
    }
    async fn check(
        &self,
        t: &TargetRef,
        slot: Slot,
        token: Token,
    ) -> Result<CheckOutcome, StoreError> {
        self.inner.check(t, slot, token).await
    }
    async fn inspect(&self, t: &TargetRef) -> Result<Inspection, StoreError> {
        self.inner.inspect(t).await
    }
    async fn repair(&self, t: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError> {
        self.inner.repair(t, floor).await
    }
    async fn health(&self) -> Result<(), StoreError> {
        self.inner.health().await
    }
}

/// More due renewals than `--renewal-concurrency` can serve (each renewal answered, slowly):
/// renewals start late, leases run out in the store, and the view a reconcile judges must then
/// not say `Renewed` (which it publishes as Held, with the passed grant as `expiresAt`, while a
/// waiter may acquire the target).
#[tokio::test(start_paused = true)]
async fn a_renewal_backlog_never_shows_a_passed_grant_as_renewed() {
    let clock = TokioClock::new();
    let store = Arc::new(SlowRenewals {
        inner: MemoryStore::with_clock(Arc::new(clock.clone()), Duration::from_secs(60)),
        delay: Duration::from_millis(250),
    });
    let (leases, mut cache) = kube::runtime::reflector::store();
    let names: Vec<String> = (0..6).map(|i| format!("b{i}")).collect();
    for name in &names {
        let lease = lease_object(name, &format!("uid-{name}"));
        cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease));
    }
    let (tenures, _woken, _scheduler) = started(store.clone(), 1, leases);
    let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
    for name in &names {
        keep_granted(&tenures, &store.inner, name, ttl).await;
    }
    let started = Instant::now();
    let mut worst: Option<(String, u64)> = None;
    while started.elapsed() < Duration::from_secs(3) {
        let now_ms = clock.now_micros() / 1000;
        for name in &names {
            let Some(view) = tenures.view(&key(name)) else {
                continue;
            };
            if view.state != State::Renewed {
                continue;
            }
            let until = view.grant.expires_at_ms();
            let passed = now_ms.saturating_sub(until);
            if passed > worst.as_ref().map_or(0, |w| w.1) {
                worst = Some((name.clone(), passed));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        worst.is_none(),
        "a view said Renewed {} ms after the store's grant for {} had run out (TTL 1 s, 6 leases, \
         1 renewal in flight, 250 ms per renewal): a reconcile judging it then writes Held",
        worst.as_ref().map_or(0, |w| w.1),
        worst.as_ref().map_or("", |w| w.0.as_str()),
    );
}

/// A tenure the store said was lost waits (unscheduled) for its reconcile to stop it. If its
/// TargetLease is gone meanwhile (deleted after a user removed the finalizer, so no cleanup
/// runs), the sweep forgets it: it leaves memory and `targetlease_renewed_leases`.
#[tokio::test(start_paused = true)]
async fn a_lost_tenure_of_a_deleted_lease_is_forgotten() {
    let store = Arc::new(store_on_tokio_clock());
    let (leases, mut cache) = kube::runtime::reflector::store();
    let lease = lease_object("l", "uid-l");
    cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease.clone()));
    let (tenures, _woken, _scheduler) = started(store.clone(), 1, leases);
    let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
    let handle = keep_granted(&tenures, store.as_ref(), "l", ttl).await;
    store
        .release(&ReleaseRequest {
            lease: handle,
            request_id: RequestId::random(),
        })
        .await
        .expect("release");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(matches!(
        tenures.view(&key("l")).map(|v| v.state),
        Some(State::Lost(_))
    ));
    // Deleted without the finalizer: no cleanup, no reconcile.
    cache.apply_watcher_event(&kube::runtime::watcher::Event::Delete(lease));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        tenures.view(&key("l")).is_none(),
        "3 s (3 TTLs) after its TargetLease left the cache, the lost tenure is still kept: {:?}",
        tenures.view(&key("l")).map(|v| v.state)
    );
}

/// What a view says of how long a lease is known valid follows the latest answer, measured from
/// the send of that call: a renewal whose answer took long does not stretch it.
#[tokio::test(start_paused = true)]
async fn a_view_is_valid_until_the_granted_expiry_from_the_send() {
    let store = Arc::new(store_on_tokio_clock());
    let (leases, mut cache) = kube::runtime::reflector::store();
    cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease_object(
        "v", "uid-v",
    )));
    let (tenures, _woken, _scheduler) = started(store.clone(), 1, leases);
    let ttl = Ttl::new(Duration::from_secs(30)).expect("ttl");
    let (handle, grant, mut reading) = granted(store.as_ref(), "v", ttl).await;
    // The answer came 400 ms after the call was sent.
    reading.answered = reading.sent + Duration::from_millis(400);
    let view = tenures.granted(&key("v"), handle, ttl, &grant, reading);
    assert_eq!(view.state, State::Renewed);
    assert_eq!(view.valid_for, Duration::from_secs(30));
    tokio::time::sleep(Duration::from_secs(12)).await;
    let later = tenures.view(&key("v")).expect("view");
    // Renewed at 10 s: valid for 30 s from that renewal's send, so 28 s from now.
    assert_eq!(later.valid_for, Duration::from_secs(28));
    assert_eq!(later.grant.acquired_at_ms, grant.acquired_at_ms);
}

/// The store's clock an hour ahead of this process's wall clock, and an hour behind: a tenure
/// is known valid exactly as long as measured on this process's monotonic clock from the moment
/// its grant was sent, whatever the wall clocks say. (No scheduler runs: nothing renews.)
#[tokio::test(start_paused = true)]
async fn validity_is_measured_whatever_the_clocks_say() {
    use crate::store::memory::ManualClock;
    for skew_s in [-3600i64, 0, 3600] {
        let clock = ManualClock::new();
        let by = Duration::from_secs(skew_s.unsigned_abs());
        if skew_s < 0 {
            clock.rewind(by);
        } else {
            clock.advance(by);
        }
        let store = MemoryStore::with_clock(Arc::new(clock), Duration::from_secs(60));
        let (leases, _cache) = kube::runtime::reflector::store();
        let (wake, _woken) = tokio::sync::mpsc::unbounded_channel();
        let (tenures, _not_running) = Tenures::new(Wiring {
            store: Arc::new(MemoryStore::new()),
            metrics: Arc::new(Metrics::new()),
            leadership: Leadership::unconditional(),
            wake,
            concurrency: 1,
            leases,
        });
        let ttl = Ttl::new(Duration::from_secs(30)).expect("ttl");
        let (handle, grant, mut reading) = granted(&store, "skew", ttl).await;
        // Sent at 0 ms, answered at 40 ms: the store read its clock in between.
        let t0 = Instant::now();
        reading.sent = t0;
        reading.answered = t0 + Duration::from_millis(40);
        tenures.granted(&key("skew"), handle, ttl, &grant, reading);
        let valid_at = |ms: u64| {
            let view = tenures
                .book()
                .view(&key("skew"), t0 + Duration::from_millis(ms));
            view.map(|v| v.valid_for)
        };
        assert_eq!(
            valid_at(0),
            Some(Duration::from_secs(30)),
            "skew {skew_s} s"
        );
        assert_eq!(
            valid_at(29_990),
            Some(Duration::from_millis(10)),
            "skew {skew_s} s"
        );
        assert_eq!(valid_at(30_000), Some(Duration::ZERO), "skew {skew_s} s");
        // Past it the view says the scheduler fell behind, never Renewed.
        let late = tenures
            .book()
            .view(&key("skew"), t0 + Duration::from_secs(31))
            .expect("view");
        assert!(matches!(late.state, State::Failing(_)), "{:?}", late.state);
        // The store's clock as bounded by the reading, a second in.
        assert_eq!(
            tenures
                .book()
                .view(&key("skew"), t0 + Duration::from_millis(1_000))
                .and_then(|v| v.server_now_ms),
            Some(grant.server_time_ms + 1_000)
        );
    }
}

/// While the API server is slow the budget sheds `expiresAt` refreshes, so the published
/// expiry falls behind the store's. One renewal that fails then (a store call timing out once)
/// must not make the claim Lost: the store granted the lease for most of a TTL more, and the
/// scheduler retries within a twelfth of it. A reconcile feeds the kept tenure's validity into
/// `Observed::store_failed` exactly as below.
#[tokio::test(start_paused = true)]
async fn one_failed_renewal_while_refreshes_are_shed_keeps_the_claim_held() {
    use crate::api::Phase;
    use crate::controller::decide::tests::{fixture, held_since};
    use crate::controller::status::Observed;

    let store = Arc::new(store_on_tokio_clock());
    let (leases, mut cache) = kube::runtime::reflector::store();
    let mut lease = fixture(crate::api::test_spec("t", "w"), None);
    cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease.clone()));
    let (tenures, _woken, _scheduler) = started(store.clone(), 4, leases);
    let ttl = Ttl::new(Duration::from_secs(30)).expect("ttl");
    let claim = Claim::new(&lease).expect("claim");
    let request = AcquireRequest {
        target: claim.target.clone(),
        lease_id: claim.lease_id.clone(),
        owner: claim.owner.clone(),
        permits: claim.permits,
        ttl,
        min_token: 0,
        request_id: RequestId::random(),
    };
    let sent = Instant::now();
    let AcquireOutcome::Acquired(grant) = store.acquire(&request).await.expect("acquire") else {
        panic!("not granted");
    };
    let handle = LeaseHandle {
        target: claim.target.clone(),
        permits: claim.permits,
        slot: grant.slot,
        lease_id: claim.lease_id.clone(),
        owner: claim.owner.clone(),
        token: Token::new(grant.token).expect("token"),
    };
    let reading = Reading {
        sent,
        answered: Instant::now(),
        server_ms: grant.server_time_ms,
    };
    let key = ObjectRef::from_obj(&lease);
    tenures.granted(&key, handle, ttl, &grant, reading);
    // The grant's status is the last one the API server took, and its promise has lagged behind
    // the store's grant since (every refresh shed): 30 s after the grant.
    let mut status = held_since(0, grant.token);
    status.acquired_at = Some(crate::time::timestamp(grant.acquired_at_ms));
    status.expires_at = Some(crate::time::timestamp(grant.acquired_at_ms + 30_000));
    lease.status = Some(status);
    // Renewed at 10, 20, 30 and 40 s; just before the renewal at 50 s, which times out:
    tokio::time::sleep(Duration::from_millis(49_900)).await;
    let claim = Claim::new(&lease).expect("claim");
    let view = tenures.view(&key);
    let valid_for = crate::controller::decide::valid_for(&claim, view.as_ref());
    let failing = Observed::store_failed(
        lease.status.as_ref(),
        &StoreError::Timeout {
            endpoint: "x:1".into(),
            after_ms: 2_000,
        },
        valid_for,
    );
    assert!(
        failing.phase == Phase::Held,
        "one timed-out renewal 50 s into a tenure whose store lease runs until 70 s made the \
         claim {:?} (held_unknown {}): known valid for {valid_for:?}",
        failing.phase,
        failing.held_unknown
    );
    assert!(valid_for >= Duration::from_secs(19), "{valid_for:?}");
}
