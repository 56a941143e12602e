//! The tenure layer: one record per lease this controller keeps, and its one owner.
//!
//! A tenure is handed over here when the reconciler acquires ([`Tenures::granted`]) or finds a
//! Held status this process does not keep yet (a restart, a new leader:
//! [`Tenures::keep_from_status`]), and taken back when the claim gives the lease up
//! ([`Tenures::stop`]). The renewal scheduler ([`schedule`]) renews every kept tenure every TTL/3
//! whatever the reconcile queue, the API server and the status writes are doing: a lease is lost
//! only when the store says so, never because an API request was slow. It wakes the claim's
//! reconcile when the latest answer needs a status write (the lease was lost, the store started
//! or stopped failing, or the published `expiresAt` must move forward); it never talks to the
//! API server.
//!
//! Everything this process measured of a tenure lives in its record: the latest answer of the
//! store placed on this process's clock ([`clock::Reading`]), and so how long the lease is known
//! valid. Reconciles read one [`View`] of it and own no state of their own. The latest reading of
//! the store's clock per target is kept here too, for the token floor of the next acquire.

pub(crate) mod clock;
pub(crate) mod handover;
mod record;
mod schedule;

use std::sync::{Arc, Mutex, MutexGuard};

use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

use self::clock::Reading;
use self::record::{Book, Record, Shared};
pub(crate) use self::record::{State, View, must_republish, promise, renew_interval};
use super::claim::Claim;
use super::metrics::Metrics;
use crate::api::TargetLease;
use crate::election::Leadership;
use crate::store::{Grant, LeaseHandle, LeaseStore, TargetRef, Ttl};
use crate::time::ms_of;

/// Renewals in flight at once, at most. A renewal is one short script on the store; this
/// bounds what a burst of due renewals (a new leader taking over every lease at once) asks of
/// the store's connection pool, and what it leaves for acquires and releases.
pub(crate) const DEFAULT_CONCURRENCY: u16 = 64;

/// The tenure layer's handle, shared by the reconciles. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Tenures {
    shared: Arc<Shared>,
}

/// What [`Tenures::new`] needs.
pub(crate) struct Wiring {
    /// The lease store.
    pub(crate) store: Arc<dyn LeaseStore>,
    /// Where renewals are counted and timed.
    pub(crate) metrics: Arc<Metrics>,
    /// Checked before every renewal.
    pub(crate) leadership: Leadership,
    /// Schedules a reconcile of a TargetLease whose tenure needs a status write.
    pub(crate) wake: UnboundedSender<ObjectRef<TargetLease>>,
    /// Renewals in flight at most.
    pub(crate) concurrency: usize,
    /// The controller's cache: a tenure whose TargetLease is gone from it (deleted without the
    /// controller's finalizer, or replaced by another object of that name) is renewed no more.
    pub(crate) leases: Store<TargetLease>,
}

impl Tenures {
    /// The tenure layer, and its renewal scheduler (spawn it; dropping it stops every renewal).
    pub(crate) fn new(wiring: Wiring) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let shared = Arc::new(Shared {
            book: Mutex::default(),
            changed: Notify::new(),
            store: wiring.store,
            metrics: wiring.metrics,
            leadership: wiring.leadership,
            wake: wiring.wake,
            in_flight: Arc::new(Semaphore::new(wiring.concurrency.max(1))),
            leases: wiring.leases,
        });
        let tenures = Self {
            shared: shared.clone(),
        };
        (tenures, schedule::run(shared))
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.shared.book()
    }

    /// Puts `record` in the book for `key` (replacing whatever was kept), schedules its first
    /// renewal at `due` and answers its view.
    fn insert(&self, key: &ObjectRef<TargetLease>, mut record: Record, due: Instant) -> View {
        let mut book = self.book();
        book.unschedule(key);
        book.next_epoch += 1;
        record.epoch = book.next_epoch;
        let now = Instant::now();
        let view = record.view(now);
        book.kept.insert(key.clone(), record);
        book.schedule(key, due);
        let kept = book.kept.len();
        drop(book);
        self.shared.metrics.kept_leases(kept);
        self.shared.changed.notify_one();
        view
    }

    /// A grant the store made now for `key` (`reading` its answer): renewed from now on whatever
    /// becomes of its status write, one interval after the call was sent. Answers its view.
    pub(crate) fn granted(
        &self,
        key: &ObjectRef<TargetLease>,
        handle: LeaseHandle,
        ttl: Ttl,
        grant: &Grant,
        reading: Reading,
    ) -> View {
        let mut book = self.book();
        book.record_clock(&handle.target, reading);
        if let Some(kept) = book.kept.get_mut(key).filter(|k| k.handle == handle) {
            // The same tenure again (a re-entrant acquire): this is its newest answer.
            kept.grant = grant.clone();
            kept.reading = Some(reading);
            kept.state = State::Renewed;
            kept.ttl = ttl;
            return kept.view(Instant::now());
        }
        drop(book);
        let due = reading.sent + renew_interval(ttl.duration());
        let record = Record {
            handle,
            ttl,
            grant: grant.clone(),
            state: State::Renewed,
            reading: Some(reading),
            published_ms: Some(promise(grant.server_time_ms, grant.expires_in_ms)),
            epoch: 0,
            slot: None,
        };
        self.insert(key, record, due)
    }

    /// Renews the tenure `claim`'s status records as Held, if it does and that tenure is not
    /// kept already: at once, since nothing is known here of when it was last renewed.
    pub(crate) fn keep_from_status(&self, claim: &Claim<'_>) {
        let Some(handle) = claim.held_handle() else {
            return;
        };
        let key = ObjectRef::from_obj(claim.lease);
        let status = claim.status;
        let published_ms = status.and_then(|s| s.expires_at).map(ms_of);
        {
            let mut book = self.book();
            if let Some(kept) = book.kept.get_mut(&key)
                && kept.handle == handle
            {
                // The spec's TTL may have changed: the next renewal asks for the new one.
                kept.ttl = claim.lease_ttl;
                kept.published_ms = published_ms.or(kept.published_ms);
                return;
            }
        }
        let acquired_at_ms = status.and_then(|s| s.acquired_at).map_or(0, ms_of);
        let record = Record {
            grant: Grant {
                token: handle.token.get(),
                slot: handle.slot,
                acquired_at_ms,
                server_time_ms: acquired_at_ms,
                expires_in_ms: 0,
            },
            handle,
            ttl: claim.lease_ttl,
            state: State::Unconfirmed,
            reading: None,
            published_ms,
            epoch: 0,
            slot: None,
        };
        self.insert(&key, record, Instant::now());
    }

    /// Hands every Held status in `leases` to the scheduler (see
    /// [`Tenures::keep_from_status`]): called when the controller's first list completes, so
    /// that a new leader renews every held lease at once, before any reconcile has run.
    pub(crate) fn keep_all_held(&self, leases: &Store<TargetLease>) {
        for lease in leases.state() {
            if let Ok(claim) = Claim::new(&lease) {
                self.keep_from_status(&claim);
            }
        }
    }

    /// Whether a tenure of `key` is kept and not lost: its target is held through this process
    /// (whether or not the cache shows it yet).
    pub(crate) fn keeps(&self, key: &ObjectRef<TargetLease>) -> bool {
        self.book()
            .kept
            .get(key)
            .is_some_and(|k| !matches!(k.state, State::Lost(_)))
    }

    /// Renews the tenure kept for `key` now, in this task (tests run no scheduler).
    #[cfg(test)]
    pub(crate) async fn renew_now_for_tests(&self, key: &ObjectRef<TargetLease>) {
        schedule::renew_now_here(&self.shared, key).await;
    }

    /// What is kept for `key`, if anything.
    pub(crate) fn view(&self, key: &ObjectRef<TargetLease>) -> Option<View> {
        self.book().view(key, Instant::now())
    }

    /// Records the `expiresAt` a status write published for `token`.
    pub(crate) fn published(&self, key: &ObjectRef<TargetLease>, token: u64, published_ms: u64) {
        if let Some(kept) = self.book().kept.get_mut(key)
            && kept.handle.token.get() == token
        {
            kept.published_ms = Some(published_ms);
        }
    }

    /// Renews the tenure kept for `key` now rather than at its turn: another claim was granted
    /// its target (after a data loss or an outage), so this one has probably lost, and its
    /// status must say so within one renewal.
    pub(crate) fn renew_now(&self, key: &ObjectRef<TargetLease>) {
        let mut book = self.book();
        if book.kept.get(key).is_some_and(|k| k.slot.is_some()) {
            book.schedule(key, Instant::now());
            drop(book);
            self.shared.changed.notify_one();
        }
    }

    /// Sets the TTL the next renewals of `key` ask for (the spec changed); a shorter one is
    /// renewed at once, so the lease never runs on the longer interval.
    pub(crate) fn set_ttl(&self, key: &ObjectRef<TargetLease>, ttl: Ttl) {
        let mut book = self.book();
        let Some(kept) = book.kept.get_mut(key).filter(|k| k.ttl != ttl) else {
            return;
        };
        kept.ttl = ttl;
        if kept.slot.is_some() {
            book.schedule(key, Instant::now());
            drop(book);
            self.shared.changed.notify_one();
        }
    }

    /// Stops renewing whatever is kept for `key`. A renewal in flight may still reach the
    /// store; its answer is dropped.
    pub(crate) fn stop(&self, key: &ObjectRef<TargetLease>) {
        let mut book = self.book();
        book.unschedule(key);
        book.kept.remove(key);
        let kept = book.kept.len();
        drop(book);
        self.shared.metrics.kept_leases(kept);
    }

    /// Records a reading of the store's clock on `target` (an inspect, say), so that its clock
    /// is read once, not before every acquire; the latest answered is kept. It makes no tenure
    /// known valid.
    pub(crate) fn record_clock(&self, target: &TargetRef, reading: Reading) {
        self.book().record_clock(target, reading);
    }

    /// The earliest the store's clock on `target` can read now, by the latest reading measured
    /// there (it outlives the claims it was measured for, so a hand-over needs no extra call to
    /// read the clock).
    pub(crate) fn earliest_server_ms(&self, target: &TargetRef) -> Option<u64> {
        let reading = self.book().clocks.get(target).copied()?;
        Some(reading.earliest_server_ms(Instant::now()))
    }

    /// Forgets the clock of a target no TargetLease names any more.
    pub(crate) fn forget_target(&self, target: &TargetRef) {
        self.book().clocks.remove(target);
    }

    /// Since when the tenure with `token` of `key` counts as ended (see [`handover`]): the first
    /// instant this process recorded it, `now` if it never did.
    pub(crate) fn ended_since(
        &self,
        key: &ObjectRef<TargetLease>,
        token: u64,
        now: Instant,
    ) -> Instant {
        let mut book = self.book();
        let entry = book.endings.entry(key.clone()).or_insert((token, now));
        if entry.0 != token {
            *entry = (token, now);
        }
        entry.1
    }

    /// Which of `others` this process still answers for in `slot`: a tenure it keeps there (in
    /// any state: a loss whose status is not written yet included), or an ended one whose
    /// holder it still waits for, in the slot `cached_slot` gives (its status's). The store
    /// granting such a permit to another claim means it lost that tenure.
    pub(crate) fn slot_held_by_others(
        &self,
        others: &[ObjectRef<TargetLease>],
        slot: u32,
        cached_slot: impl Fn(&ObjectRef<TargetLease>) -> Option<u32>,
    ) -> Vec<ObjectRef<TargetLease>> {
        let book = self.book();
        others
            .iter()
            .filter(|key| match book.kept.get(*key) {
                Some(kept) => kept.handle.slot.get() == slot,
                None => book.endings.contains_key(*key) && cached_slot(key) == Some(slot),
            })
            .cloned()
            .collect()
    }

    /// The target of `key`'s ended tenure was passed on: nothing more to wait for.
    pub(crate) fn handed_over(&self, key: &ObjectRef<TargetLease>) {
        self.book().endings.remove(key);
    }
}

#[cfg(test)]
mod tests;
