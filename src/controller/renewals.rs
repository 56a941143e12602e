//! Renewals on their own schedule. Every lease this controller holds for a TargetLease is
//! renewed in the store every TTL/3 by this one scheduler, whatever the reconcile queue, the API
//! server and the status writes are doing: a lease is lost only when the store says so (expired,
//! another holder), never because an API request was slow.
//!
//! The reconciler hands a tenure over ([`Renewals::keep`]) when it acquires, or when it finds a
//! Held status this process is not renewing yet (a restart, a new leader), and takes it back
//! ([`Renewals::stop`]) when it gives the lease up. It reads the latest answer
//! ([`Renewals::standing`]) instead of calling the store itself, and it is woken when that answer
//! needs a status write: the lease was lost, the store started or stopped failing, or the
//! published `expiresAt` must move forward (see [`must_republish`]). The scheduler never talks
//! to the API server.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::FutureExt;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, info};

use super::decide::{Claim, Measured, Measurements, Reading, renew_interval};
use super::election::Leadership;
use super::metrics::Metrics;
use super::status::must_republish;
use crate::api::TargetLease;
use crate::store::{
    Grant, LeaseHandle, LeaseStore, LossReason, RenewOutcome, RenewRequest, RequestId, StoreError,
    Ttl,
};

/// Renewals in flight at once, at most. A renewal is one short script on the store; this
/// bounds what a burst of due renewals (a new leader taking over every lease at once) asks of
/// the store's connection pool, and what it leaves for acquires and releases.
pub const DEFAULT_CONCURRENCY: u16 = 64;

/// How soon a renewal that failed is tried again: often enough to keep a lease through a short
/// store outage, never more than a few times per call timeout.
fn retry_after_failure(ttl: Duration) -> Duration {
    (renew_interval(ttl) / 4).clamp(Duration::from_millis(200), Duration::from_secs(2))
}

/// What the store last said of a kept tenure.
#[derive(Clone, Debug)]
pub enum State {
    /// Handed over from a status this process has not confirmed yet: the first renewal is due
    /// at once.
    Unconfirmed,
    /// Granted or renewed; the grant's times are those of the latest answer.
    Renewed,
    /// The store said the tenure ended (it is no longer renewed).
    Lost(LossReason),
    /// The latest renewal failed (renewals go on).
    Failing(StoreError),
}

impl PartialEq for State {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Unconfirmed, Self::Unconfirmed) | (Self::Renewed, Self::Renewed) => true,
            (Self::Lost(a), Self::Lost(b)) => a == b,
            (Self::Failing(a), Self::Failing(b)) => {
                a.kind() == b.kind() && a.to_string() == b.to_string()
            }
            _ => false,
        }
    }
}

/// A tenure as the scheduler keeps it: its handle, its grant as of the latest answer, and what
/// that answer said.
#[derive(Clone, Debug, PartialEq)]
pub struct Standing {
    /// The tenure renewed.
    pub handle: LeaseHandle,
    /// The grant, with `server_time_ms` and `expires_in_ms` of the latest answer that renewed it
    /// (of the status when unconfirmed).
    pub grant: Grant,
    /// What the latest answer said.
    pub state: State,
}

/// How the first renewal of a tenure handed to [`Renewals::keep`] is scheduled.
pub enum Start {
    /// The store granted it now: `grant` as measured by `reading`; the first renewal is one
    /// interval after the call was sent.
    Granted {
        /// The grant.
        grant: Grant,
        /// The acquire's answer on this process's clock.
        reading: Reading,
    },
    /// Taken from a status (`acquired_at_ms` its start): renew at once, since nothing is known
    /// of when it was last renewed.
    FromStatus {
        /// The tenure's start, in the store's clock.
        acquired_at_ms: u64,
    },
}

struct Kept {
    standing: Standing,
    ttl: Ttl,
    /// Until when the latest grant or renewal is known valid, on this process's clock (from the
    /// send of that call); `None` while unconfirmed.
    valid_until: Option<Instant>,
    /// The `expiresAt` the status publishes, in the store's clock.
    published_ms: Option<u64>,
    /// Bumped at every hand-over, so that a late answer for an earlier one is dropped.
    epoch: u64,
    /// Its place in the schedule, while one is scheduled.
    slot: Option<(Instant, u64)>,
}

#[derive(Default)]
struct Book {
    kept: HashMap<ObjectRef<TargetLease>, Kept>,
    schedule: BTreeMap<(Instant, u64), ObjectRef<TargetLease>>,
    next_epoch: u64,
}

impl Book {
    fn unschedule(&mut self, key: &ObjectRef<TargetLease>) {
        if let Some(slot) = self.kept.get_mut(key).and_then(|k| k.slot.take()) {
            self.schedule.remove(&slot);
        }
    }

    fn schedule(&mut self, key: &ObjectRef<TargetLease>, due: Instant) {
        self.unschedule(key);
        self.next_epoch += 1;
        let slot = (due, self.next_epoch);
        if let Some(kept) = self.kept.get_mut(key) {
            kept.slot = Some(slot);
            self.schedule.insert(slot, key.clone());
        }
    }
}

struct Shared {
    book: Mutex<Book>,
    changed: Notify,
    store: Arc<dyn LeaseStore>,
    metrics: Arc<Metrics>,
    measurements: Arc<Measurements>,
    leadership: Leadership,
    wake: UnboundedSender<ObjectRef<TargetLease>>,
    in_flight: Arc<Semaphore>,
    leases: Store<TargetLease>,
}

/// The renewal scheduler's handle, shared by the reconciles. Cheap to clone.
#[derive(Clone)]
pub struct Renewals {
    shared: Arc<Shared>,
}

/// What [`Renewals::new`] needs.
pub struct Wiring {
    /// The lease store.
    pub store: Arc<dyn LeaseStore>,
    /// Where renewals are counted and timed.
    pub metrics: Arc<Metrics>,
    /// Where each answer is recorded (the reconciles judge expiries from it).
    pub measurements: Arc<Measurements>,
    /// Checked before every renewal.
    pub leadership: Leadership,
    /// Schedules a reconcile of a TargetLease whose standing needs a status write.
    pub wake: UnboundedSender<ObjectRef<TargetLease>>,
    /// Renewals in flight at most.
    pub concurrency: usize,
    /// The controller's cache: a tenure whose TargetLease is gone from it (deleted without the
    /// controller's finalizer, or replaced by another object of that name) is renewed no more.
    pub leases: Store<TargetLease>,
}

impl Renewals {
    /// The scheduler, and the loop that runs it (spawn it; dropping it stops every renewal).
    pub fn new(wiring: Wiring) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let shared = Arc::new(Shared {
            book: Mutex::default(),
            changed: Notify::new(),
            store: wiring.store,
            metrics: wiring.metrics,
            measurements: wiring.measurements,
            leadership: wiring.leadership,
            wake: wiring.wake,
            in_flight: Arc::new(Semaphore::new(wiring.concurrency.max(1))),
            leases: wiring.leases,
        });
        let renewals = Self {
            shared: shared.clone(),
        };
        (renewals, run(shared))
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.shared.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Renews `handle` from now on (replacing whatever was kept for `lease`), unless that very
    /// tenure is kept already; `published_ms` is the `expiresAt` its status shows.
    pub fn keep(
        &self,
        lease: &ObjectRef<TargetLease>,
        handle: LeaseHandle,
        ttl: Ttl,
        published_ms: Option<u64>,
        start: Start,
    ) {
        let mut book = self.book();
        if let Some(kept) = book.kept.get_mut(lease)
            && kept.standing.handle == handle
        {
            // The spec's TTL may have changed: the next renewal asks for the new one.
            kept.ttl = ttl;
            kept.published_ms = published_ms.or(kept.published_ms);
            return;
        }
        let (grant, state, due, valid_until) = match start {
            Start::Granted { grant, reading } => (
                grant.clone(),
                State::Renewed,
                reading.sent + renew_interval(ttl.duration()),
                Some(reading.sent + Duration::from_millis(grant.expires_in_ms)),
            ),
            Start::FromStatus { acquired_at_ms } => (
                Grant {
                    token: handle.token.get(),
                    slot: handle.slot,
                    acquired_at_ms,
                    server_time_ms: acquired_at_ms,
                    expires_in_ms: 0,
                },
                State::Unconfirmed,
                Instant::now(),
                None,
            ),
        };
        book.unschedule(lease);
        book.next_epoch += 1;
        let epoch = book.next_epoch;
        book.kept.insert(
            lease.clone(),
            Kept {
                standing: Standing {
                    handle,
                    grant,
                    state,
                },
                ttl,
                valid_until,
                published_ms,
                epoch,
                slot: None,
            },
        );
        book.schedule(lease, due);
        let kept = book.kept.len();
        drop(book);
        self.shared.metrics.kept_leases(kept);
        self.shared.changed.notify_one();
    }

    /// Renews the tenure `claim`'s status records as Held, if it does and that tenure is not
    /// kept already: at once, since nothing is known here of when it was last renewed.
    pub fn keep_from_status(&self, claim: &Claim<'_>) {
        let Some(handle) = claim.held_handle() else {
            return;
        };
        let millis =
            |t: Option<jiff::Timestamp>| t.and_then(|t| u64::try_from(t.as_millisecond()).ok());
        let status = claim.status;
        self.keep(
            &ObjectRef::from_obj(claim.lease),
            handle,
            claim.lease_ttl,
            millis(status.and_then(|s| s.expires_at)),
            Start::FromStatus {
                acquired_at_ms: millis(status.and_then(|s| s.acquired_at)).unwrap_or(0),
            },
        );
    }

    /// Hands every Held status in `leases` to the scheduler (see
    /// [`Renewals::keep_from_status`]): called when the controller's first list completes, so
    /// that a new leader renews every held lease at once, before any reconcile has run.
    pub fn keep_all_held(&self, leases: &Store<TargetLease>) {
        for lease in leases.state() {
            if let Ok(claim) = Claim::new(&lease) {
                self.keep_from_status(&claim);
            }
        }
    }

    /// Records the `expiresAt` a status write published for `token`.
    pub fn published(&self, lease: &ObjectRef<TargetLease>, token: u64, published_ms: u64) {
        if let Some(kept) = self.book().kept.get_mut(lease)
            && kept.standing.handle.token.get() == token
        {
            kept.published_ms = Some(published_ms);
        }
    }

    /// What the store last said of the tenure kept for `lease`, if one is. A renewal that has
    /// not come in time (more renewals due than `--renewal-concurrency` lets through) shows as
    /// a failure once the last measured grant has passed, never as `Renewed`.
    pub fn standing(&self, lease: &ObjectRef<TargetLease>) -> Option<Standing> {
        let book = self.book();
        let kept = book.kept.get(lease)?;
        let mut standing = kept.standing.clone();
        let now = Instant::now();
        if standing.state == State::Renewed
            && let Some(until) = kept.valid_until.filter(|until| now >= *until)
        {
            standing.state = State::Failing(StoreError::Timeout {
                endpoint: "the renewal scheduler (behind its schedule)".into(),
                after_ms: u64::try_from((now - until).as_millis()).unwrap_or(u64::MAX),
            });
        }
        Some(standing)
    }

    /// Renews the tenure kept for `lease` now rather than at its turn: another claim was
    /// granted its target (after a data loss or an outage), so this one has probably lost, and
    /// its status must say so within one renewal.
    pub fn renew_now(&self, lease: &ObjectRef<TargetLease>) {
        let mut book = self.book();
        let scheduled = book.kept.get(lease).is_some_and(|k| k.slot.is_some());
        if scheduled {
            book.schedule(lease, Instant::now());
            drop(book);
            self.shared.changed.notify_one();
        }
    }

    /// Sets the TTL the next renewals of `lease` ask for (the spec changed); a shorter one is
    /// renewed at once, so the lease never runs on the longer interval.
    pub fn set_ttl(&self, lease: &ObjectRef<TargetLease>, ttl: Ttl) {
        let mut book = self.book();
        let Some(kept) = book.kept.get_mut(lease).filter(|k| k.ttl != ttl) else {
            return;
        };
        kept.ttl = ttl;
        if kept.slot.is_some() {
            book.schedule(lease, Instant::now());
            drop(book);
            self.shared.changed.notify_one();
        }
    }

    /// Stops renewing whatever is kept for `lease`. A renewal in flight may still reach the
    /// store; its answer is dropped.
    pub fn stop(&self, lease: &ObjectRef<TargetLease>) {
        let mut book = self.book();
        book.unschedule(lease);
        book.kept.remove(lease);
        let kept = book.kept.len();
        drop(book);
        self.shared.metrics.kept_leases(kept);
    }
}

/// One renewal taken off the schedule.
struct Due {
    key: ObjectRef<TargetLease>,
    handle: LeaseHandle,
    ttl: Ttl,
    epoch: u64,
    due: Instant,
}

/// The scheduler: takes each renewal off the schedule when it is due and runs it, at most
/// [`Wiring::concurrency`] at once. Stopped by dropping it (the renewals in flight with it).
async fn run(shared: Arc<Shared>) {
    let mut running = JoinSet::new();
    let mut sweeps = tokio::time::interval(SWEEP_EVERY);
    sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        while running.try_join_next().is_some() {}
        if sweeps.tick().now_or_never().is_some() {
            sweep(&shared);
        }
        let next = shared
            .book
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .schedule
            .first_key_value()
            .map(|(slot, _)| slot.0);
        match next {
            Some(due) if due <= Instant::now() => {}
            Some(due) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(due.into()) => {}
                    _ = shared.changed.notified() => {}
                    _ = sweeps.tick() => sweep(&shared),
                    Some(_) = running.join_next(), if !running.is_empty() => {}
                }
                continue;
            }
            None => {
                tokio::select! {
                    _ = shared.changed.notified() => {}
                    _ = sweeps.tick() => sweep(&shared),
                    Some(_) = running.join_next(), if !running.is_empty() => {}
                }
                continue;
            }
        }
        // A permit first, so that a renewal waits here (and its lateness is measured) rather
        // than in the store's pool.
        let Ok(permit) = shared.in_flight.clone().acquire_owned().await else {
            return;
        };
        let Some(due) = take_due(&shared) else {
            continue;
        };
        let shared = shared.clone();
        running.spawn(async move {
            renew_one(&shared, due).await;
            drop(permit);
        });
    }
}

/// How often tenures no longer on the schedule (lost ones, which their reconcile takes back)
/// are forgotten when their TargetLease left the cache; those on the schedule are dropped when
/// their renewal comes up.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Whether the TargetLease `key` names is still in the cache, as the object the tenure was
/// granted to.
fn still_wanted(shared: &Shared, key: &ObjectRef<TargetLease>, kept: &Kept) -> bool {
    shared.leases.get(key).is_some_and(|lease| {
        lease.metadata.uid.as_deref() == Some(kept.standing.handle.lease_id.expose())
    })
}

/// Forgets every tenure off the schedule whose TargetLease left the cache (deleted without the
/// controller's finalizer, replaced under its name): a lost one is never scheduled again, so
/// nothing else would.
fn sweep(shared: &Shared) {
    let mut book = shared.book.lock().unwrap_or_else(|e| e.into_inner());
    let gone: Vec<_> = book
        .kept
        .iter()
        .filter(|(key, kept)| kept.slot.is_none() && !still_wanted(shared, key, kept))
        .map(|(key, _)| key.clone())
        .collect();
    for key in &gone {
        book.unschedule(key);
        book.kept.remove(key);
    }
    let kept = book.kept.len();
    drop(book);
    shared.metrics.kept_leases(kept);
}

/// Takes the earliest due renewal off the schedule, if one is due.
fn take_due(shared: &Shared) -> Option<Due> {
    let mut book = shared.book.lock().unwrap_or_else(|e| e.into_inner());
    let (&slot, _) = book.schedule.first_key_value()?;
    if slot.0 > Instant::now() {
        return None;
    }
    let key = book.schedule.remove(&slot)?;
    let kept = book.kept.get_mut(&key)?;
    kept.slot = None;
    if !still_wanted(shared, &key, kept) {
        // Its TargetLease is gone: the lease runs out at its TTL.
        debug!(lease = %key.name, "not renewed: its TargetLease is gone");
        book.kept.remove(&key);
        let kept = book.kept.len();
        shared.metrics.kept_leases(kept);
        return None;
    }
    Some(Due {
        handle: kept.standing.handle.clone(),
        ttl: kept.ttl,
        epoch: kept.epoch,
        due: slot.0,
        key,
    })
}

/// Renews one tenure and records the answer; wakes the reconcile when the answer needs a status
/// write.
async fn renew_one(shared: &Shared, due: Due) {
    if shared.leadership.check().is_err() {
        // Not leading: this controller is stopping (a successor renews from the statuses).
        // Kept on the schedule all the same, should leadership come back without a restart.
        let mut book = shared.book.lock().unwrap_or_else(|e| e.into_inner());
        if book
            .kept
            .get(&due.key)
            .is_some_and(|k| k.epoch == due.epoch)
        {
            let retry = Instant::now() + retry_after_failure(due.ttl.duration());
            book.schedule(&due.key, retry);
        }
        return;
    }
    let started = Instant::now();
    shared
        .metrics
        .renewal_started(started.saturating_duration_since(due.due));
    let request = RenewRequest {
        lease: due.handle.clone(),
        ttl: due.ttl,
        request_id: RequestId::random(),
    };
    let result = shared.store.renew(&request).await;
    let answered = Instant::now();
    let kind = result.as_ref().err().map(|e| e.kind().as_str());
    shared.metrics.store_call("renew", answered - started, kind);
    let ttl = due.ttl.duration();
    let mut book = shared.book.lock().unwrap_or_else(|e| e.into_inner());
    let Some(kept) = book.kept.get_mut(&due.key).filter(|k| k.epoch == due.epoch) else {
        // Stopped or handed over anew while the call ran.
        return;
    };
    let was_failing = matches!(kept.standing.state, State::Failing(_));
    let (wake, next) = match result {
        Ok(RenewOutcome::Renewed {
            server_time_ms,
            expires_in_ms,
        }) => {
            let reading = Reading {
                sent: started,
                answered,
                server_ms: server_time_ms,
            };
            shared.measurements.record_for(
                &due.key,
                &due.handle.target,
                Measured {
                    token: due.handle.token.get(),
                    reading,
                    granted_until_ms: server_time_ms.saturating_add(expires_in_ms),
                },
            );
            let first = kept.standing.state == State::Unconfirmed;
            kept.valid_until = Some(started + Duration::from_millis(expires_in_ms));
            kept.standing.grant.server_time_ms = server_time_ms;
            kept.standing.grant.expires_in_ms = expires_in_ms;
            kept.standing.state = State::Renewed;
            let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
            let publish = must_republish(kept.published_ms, server_time_ms, ttl_ms);
            (
                was_failing || first || publish,
                Some(started + renew_interval(ttl)),
            )
        }
        Ok(RenewOutcome::Lost { reason }) => {
            info!(lease = %due.key.name, target = %due.handle.target, reason = ?reason, "lease lost");
            kept.standing.state = State::Lost(reason);
            (true, None)
        }
        Err(error) => {
            let changed =
                !matches!(&kept.standing.state, State::Failing(e) if e.kind() == error.kind());
            debug!(lease = %due.key.name, error = %error, "renewal failed; trying again");
            kept.standing.state = State::Failing(error);
            (changed, Some(answered + retry_after_failure(ttl)))
        }
    };
    if let Some(next) = next {
        book.schedule(&due.key, next);
    }
    drop(book);
    if wake {
        let _ = shared.wake.send(due.key);
    }
    shared.changed.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::{AcquireOutcome, AcquireRequest, LeaseId, Owner, TargetRef};

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

    /// At the end of the first list, every Held status is renewed by the scheduler at once,
    /// before any reconcile: a new leader whose reconciles wait for the API server keeps the
    /// leases all the same. Claims that do not show Held are left alone.
    #[tokio::test]
    async fn every_held_status_is_kept_when_the_list_completes() {
        let store = Arc::new(MemoryStore::new());
        let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
        let (leases, mut cache) = kube::runtime::reflector::store();
        let mut handles = Vec::new();
        for (name, held) in [("held-a", true), ("held-b", true), ("waiting", false)] {
            let (handle, grant, _) = granted(&store, name, ttl).await;
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
        let (renewals, _woken, _scheduler) = started(store.clone(), 4, leases.clone());
        renewals.keep_all_held(&leases);
        tokio::time::sleep(Duration::from_secs(3)).await;
        for (name, held, handle) in handles {
            let seen = store.inspect(&handle.target).await.expect("inspect");
            if held {
                assert_eq!(
                    renewals.standing(&key(name)).map(|s| s.state),
                    Some(State::Renewed),
                    "{name}"
                );
                assert_eq!(
                    seen.lease.map(|l| l.token),
                    Some(handle.token.get()),
                    "{name}"
                );
            } else {
                assert!(renewals.standing(&key(name)).is_none(), "{name}");
                assert!(seen.lease.is_none(), "{name} was renewed");
            }
        }
    }

    /// The TargetLease `name` in namespace `ns` with `uid`, as the controller's cache holds it.
    pub(super) fn lease_object(name: &str, uid: &str) -> TargetLease {
        let mut lease = TargetLease::new(name, crate::api::test_spec(name, "w"));
        lease.metadata.namespace = Some("ns".into());
        lease.metadata.uid = Some(uid.to_owned());
        lease
    }

    /// A running scheduler over `store`, `concurrency` renewals at once, that judges which
    /// tenures are still wanted by `leases`; the reconciles it wakes; its task (dropped, it
    /// stops).
    pub(super) fn started(
        store: Arc<dyn LeaseStore>,
        concurrency: usize,
        leases: Store<TargetLease>,
    ) -> (
        Renewals,
        tokio::sync::mpsc::UnboundedReceiver<ObjectRef<TargetLease>>,
        tokio::task::JoinHandle<()>,
    ) {
        let (wake, woken) = tokio::sync::mpsc::unbounded_channel();
        let (renewals, scheduler) = Renewals::new(Wiring {
            store,
            metrics: Arc::new(Metrics::new()),
            measurements: Arc::default(),
            leadership: Leadership::unconditional(),
            wake,
            concurrency,
            leases,
        });
        (renewals, woken, tokio::spawn(scheduler))
    }

    pub(super) fn key(name: &str) -> ObjectRef<TargetLease> {
        ObjectRef::new(name).within("ns")
    }

    /// Acquires target `name` in `store` for the lease id `uid-{name}`; the handle, the grant
    /// and the acquire's answer on this process's clock.
    pub(super) async fn granted(
        store: &MemoryStore,
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
        let AcquireOutcome::Acquired(grant) = store.acquire(&request).await.expect("acquire")
        else {
            panic!("not acquired");
        };
        let reading = Reading {
            sent,
            answered: Instant::now(),
            server_ms: grant.server_time_ms,
        };
        let handle = LeaseHandle {
            target: request.target,
            permits: request.permits,
            slot: grant.slot,
            lease_id: request.lease_id,
            owner: request.owner,
            token: crate::store::Token::new(grant.token).expect("token"),
        };
        (handle, grant, reading)
    }

    /// Acquires target `name` (see [`granted`]) and hands the grant to `renewals`.
    pub(super) async fn keep_granted(
        renewals: &Renewals,
        store: &MemoryStore,
        name: &str,
        ttl: Ttl,
    ) -> LeaseHandle {
        let (handle, grant, reading) = granted(store, name, ttl).await;
        renewals.keep(
            &key(name),
            handle.clone(),
            ttl,
            Some(grant.expires_at_ms()),
            Start::Granted { grant, reading },
        );
        handle
    }

    /// Renewals run on their own: kept leases outlive many TTLs without any reconcile, a lost
    /// one wakes its reconcile and is renewed no more, and a stopped one is left alone. Real
    /// time (the scheduler reads the monotonic clock), a TTL of one second.
    #[tokio::test]
    async fn kept_leases_are_renewed_without_reconciles() {
        let store = Arc::new(MemoryStore::new());
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
        let (renewals, mut woken, _scheduler) = started(store.clone(), 2, leases);
        let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
        let mut handles = Vec::new();
        for name in ["a", "b", "c"] {
            handles.push(keep_granted(&renewals, &store, name, ttl).await);
        }
        // A tenure whose TargetLease is no longer in the cache (deleted without the finalizer,
        // another object made under its name) is not renewed.
        keep_granted(&renewals, &store, "gone", ttl).await;
        // Four TTLs.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(renewals.standing(&key("gone")).is_none());
        let seen = store
            .inspect(&TargetRef::new("ns", "gone").expect("target"))
            .await
            .expect("inspect");
        assert!(
            seen.lease.is_none(),
            "a lease of a gone TargetLease was renewed"
        );
        for (name, handle) in ["a", "b", "c"].iter().zip(&handles) {
            let standing = renewals.standing(&key(name)).expect("kept");
            assert_eq!(standing.state, State::Renewed, "{name}");
            let seen = store.inspect(&handle.target).await.expect("inspect");
            assert_eq!(
                seen.lease.map(|l| l.token),
                Some(handle.token.get()),
                "{name}"
            );
        }
        // Woken to publish (nothing publishes here, so at every renewal from the second on),
        // never for a loss.
        let wakes = std::iter::from_fn(|| woken.try_recv().ok()).count();
        assert!(wakes >= 3, "{wakes} wakes");
        // "b" is released behind the scheduler's back: its next renewal says lost, wakes, and
        // it is renewed no more. "c" is stopped: its lease runs out.
        store
            .release(&crate::store::ReleaseRequest {
                lease: handles[1].clone(),
                request_id: RequestId::random(),
            })
            .await
            .expect("release");
        renewals.stop(&key("c"));
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(matches!(
            renewals.standing(&key("b")).map(|s| s.state),
            Some(State::Lost(_))
        ));
        assert!(renewals.standing(&key("c")).is_none());
        let woken_for: Vec<_> = std::iter::from_fn(|| woken.try_recv().ok()).collect();
        assert!(woken_for.contains(&key("b")));
        let seen = store.inspect(&handles[2].target).await.expect("inspect");
        assert!(seen.lease.is_none(), "a stopped lease was renewed");
        assert_eq!(
            renewals.standing(&key("a")).map(|s| s.state),
            Some(State::Renewed)
        );
    }
}

#[cfg(test)]
mod backlog_tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::{
        AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, GuardedKey,
        GuardedValue, Inspection, ReleaseOutcome, ReleaseRequest, RepairOutcome, Slot, TargetRef,
        Token,
    };
    use async_trait::async_trait;

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

    fn unix_ms() -> u64 {
        u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_millis(),
        )
        .expect("ms")
    }

    /// More due renewals than `--renewal-concurrency` can serve (each renewal answered, slowly):
    /// renewals start late, leases run out in the store, and the standing a reconcile judges
    /// must then not say `Renewed` (which `judge` publishes as Held, with the passed grant as
    /// `expiresAt`, while a waiter may acquire the target).
    #[tokio::test]
    async fn a_renewal_backlog_never_shows_a_passed_grant_as_renewed() {
        let store = Arc::new(SlowRenewals {
            inner: MemoryStore::new(),
            delay: Duration::from_millis(250),
        });
        let (leases, mut cache) = kube::runtime::reflector::store();
        let names: Vec<String> = (0..6).map(|i| format!("b{i}")).collect();
        for name in &names {
            let lease = super::tests::lease_object(name, &format!("uid-{name}"));
            cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease));
        }
        let (renewals, _woken, _scheduler) = super::tests::started(store.clone(), 1, leases);
        let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
        for name in &names {
            super::tests::keep_granted(&renewals, &store.inner, name, ttl).await;
        }
        let started = Instant::now();
        let mut worst: Option<(String, u64)> = None;
        while started.elapsed() < Duration::from_secs(3) {
            let now_ms = unix_ms();
            for name in &names {
                let Some(standing) = renewals.standing(&ObjectRef::new(name).within("ns")) else {
                    continue;
                };
                if standing.state != State::Renewed {
                    continue;
                }
                let until = standing.grant.server_time_ms + standing.grant.expires_in_ms;
                let passed = now_ms.saturating_sub(until);
                if passed > worst.as_ref().map_or(0, |w| w.1) {
                    worst = Some((name.clone(), passed));
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            worst.is_none(),
            "a standing said Renewed {} ms after the store's grant for {} had run out (TTL 1 s, \
             6 leases, 1 renewal in flight, 250 ms per renewal): a reconcile judging it then \
             writes Held",
            worst.as_ref().map_or(0, |w| w.1),
            worst.as_ref().map_or("", |w| w.0.as_str()),
        );
    }
}

#[cfg(test)]
mod leak_tests {
    use super::*;
    use crate::store::ReleaseRequest;
    use crate::store::memory::MemoryStore;

    /// A tenure the store said was lost waits (unscheduled) for its reconcile to stop it. If its
    /// TargetLease is gone meanwhile (deleted after a user removed the finalizer, so no cleanup
    /// runs), nothing ever removes it: `take_due` only looks at scheduled entries. It stays in
    /// memory and in `targetlease_renewed_leases`, although nothing renews it.
    #[tokio::test]
    async fn a_lost_tenure_of_a_deleted_lease_is_forgotten() {
        let store = Arc::new(MemoryStore::new());
        let (leases, mut cache) = kube::runtime::reflector::store();
        let lease = super::tests::lease_object("l", "uid-l");
        cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lease.clone()));
        let (renewals, _woken, _scheduler) = super::tests::started(store.clone(), 1, leases);
        let ttl = Ttl::new(Duration::from_secs(1)).expect("ttl");
        let handle = super::tests::keep_granted(&renewals, &store, "l", ttl).await;
        let key = super::tests::key("l");
        store
            .release(&ReleaseRequest {
                lease: handle,
                request_id: RequestId::random(),
            })
            .await
            .expect("release");
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(matches!(
            renewals.standing(&key).map(|s| s.state),
            Some(State::Lost(_))
        ));
        // Deleted without the finalizer: no cleanup, no reconcile.
        cache.apply_watcher_event(&kube::runtime::watcher::Event::Delete(lease));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            renewals.standing(&key).is_none(),
            "3 s (3 TTLs) after its TargetLease left the cache, the lost tenure is still kept: {:?}",
            renewals.standing(&key).map(|s| s.state)
        );
    }
}
