//! A kept tenure's record and the book of all of them: what the store last said of each lease
//! this controller keeps (its [`State`], the latest reading of the store's clock, the grant),
//! the renewal schedule, the latest clock reading per target and the tenures that ended and wait
//! for their hand-over; the [`View`] a reconcile reads; the arithmetic of the published
//! `expiresAt` promise. Owned by [`Tenures`](super::Tenures), renewed by
//! [`schedule`](super::schedule).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

use super::clock::Reading;
use crate::api::TargetLease;
use crate::controller::metrics::Metrics;
use crate::election::Leadership;
use crate::store::{Grant, LeaseHandle, LeaseStore, LossReason, StoreError, TargetRef, Ttl};

/// The renewal interval: a third of the TTL, so two renewals can fail before the lease expires.
pub(crate) fn renew_interval(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(300))
}

/// What the store last said of a kept tenure.
#[derive(Clone, Debug)]
pub(crate) enum State {
    /// Taken from a status this process has not confirmed yet: the first renewal is due at once.
    Unconfirmed,
    /// Granted or renewed by the latest answer.
    Renewed,
    /// The store said the tenure ended (it is no longer renewed).
    Lost(LossReason),
    /// The latest renewal failed (renewals go on), or one did not come in time.
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

/// One kept tenure.
pub(super) struct Record {
    pub(super) handle: LeaseHandle,
    pub(super) ttl: Ttl,
    /// The tenure as the latest answer granted it: its start, and the store's time and the TTL
    /// of that answer (the status's while unconfirmed, with no TTL).
    pub(super) grant: Grant,
    pub(super) state: State,
    /// The latest answer that granted or renewed it, on this process's clock; `None` while
    /// unconfirmed.
    pub(super) reading: Option<Reading>,
    /// The `expiresAt` the status publishes, in the store's clock.
    pub(super) published_ms: Option<u64>,
    /// Bumped at every hand-over, so that a late answer for an earlier one is dropped.
    pub(super) epoch: u64,
    /// Its place in the schedule, while one is scheduled.
    pub(super) slot: Option<(Instant, u64)>,
}

impl Record {
    /// How long the lease is still known valid at `now`: until the expiry the store granted in
    /// the latest answer, counted from the moment that call was sent.
    pub(super) fn valid_for(&self, now: Instant) -> Duration {
        match (&self.state, self.reading) {
            (State::Renewed | State::Failing(_), Some(reading)) => {
                reading.left_until(self.grant.expires_at_ms(), now)
            }
            _ => Duration::ZERO,
        }
    }
}

/// What a reconcile reads of a kept tenure.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct View {
    /// The tenure.
    pub(crate) handle: LeaseHandle,
    /// The tenure as the latest answer granted it (see [`Record`]).
    pub(crate) grant: Grant,
    /// What the store last said of it. A renewal that did not come in time (more renewals due
    /// than `--renewal-concurrency` lets through) shows as a failure once the last measured
    /// grant has passed, never as `Renewed`.
    pub(crate) state: State,
    /// How long the lease is still known valid: until the expiry the store granted in the latest
    /// answer, counted on this process's clock from the moment that call was sent. Zero while
    /// unconfirmed, once lost, and once that may have passed.
    pub(crate) valid_for: Duration,
    /// The latest the store's clock can read now, by the latest answer (ms); `None` while
    /// unconfirmed.
    pub(crate) server_now_ms: Option<u64>,
}

#[derive(Default)]
pub(super) struct Book {
    pub(super) kept: HashMap<ObjectRef<TargetLease>, Record>,
    pub(super) schedule: BTreeMap<(Instant, u64), ObjectRef<TargetLease>>,
    pub(super) next_epoch: u64,
    /// The latest reading of the store's clock per target (any answer that carries it).
    pub(super) clocks: HashMap<TargetRef, Reading>,
    /// The tenures that ended and whose target is not passed on yet (see [`handover`]): the
    /// ended tenure's token and since when it counts as ended.
    pub(super) endings: HashMap<ObjectRef<TargetLease>, (u64, Instant)>,
}

impl Book {
    pub(super) fn unschedule(&mut self, key: &ObjectRef<TargetLease>) {
        if let Some(slot) = self.kept.get_mut(key).and_then(|k| k.slot.take()) {
            self.schedule.remove(&slot);
        }
    }

    pub(super) fn schedule(&mut self, key: &ObjectRef<TargetLease>, due: Instant) {
        self.unschedule(key);
        self.next_epoch += 1;
        let slot = (due, self.next_epoch);
        if let Some(kept) = self.kept.get_mut(key) {
            kept.slot = Some(slot);
            self.schedule.insert(slot, key.clone());
        }
    }

    pub(super) fn record_clock(&mut self, target: &TargetRef, reading: Reading) {
        let latest = self.clocks.entry(target.clone()).or_insert(reading);
        if reading.answered > latest.answered {
            *latest = reading;
        }
    }

    pub(super) fn view(&self, key: &ObjectRef<TargetLease>, now: Instant) -> Option<View> {
        Some(self.kept.get(key)?.view(now))
    }
}

impl Record {
    /// What a reconcile reads of this tenure at `now`.
    pub(super) fn view(&self, now: Instant) -> View {
        let kept = self;
        let valid_for = kept.valid_for(now);
        let state = match &kept.state {
            State::Renewed if valid_for.is_zero() => State::Failing(StoreError::Timeout {
                endpoint: "the renewal scheduler (behind its schedule)".into(),
                after_ms: kept.reading.map_or(0, |r| {
                    r.latest_server_ms(now)
                        .saturating_sub(kept.grant.expires_at_ms())
                }),
            }),
            state => state.clone(),
        };
        View {
            handle: kept.handle.clone(),
            grant: kept.grant.clone(),
            state,
            valid_for,
            server_now_ms: kept.reading.map(|r| r.latest_server_ms(now)),
        }
    }
}

pub(super) struct Shared {
    pub(super) book: Mutex<Book>,
    pub(super) changed: Notify,
    pub(super) store: Arc<dyn LeaseStore>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) leadership: Leadership,
    pub(super) wake: UnboundedSender<ObjectRef<TargetLease>>,
    pub(super) in_flight: Arc<Semaphore>,
    pub(super) leases: Store<TargetLease>,
}

impl Shared {
    pub(super) fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How far ahead the published `expiresAt` is set, in TTLs: the controller promises to keep the
/// lease in the store until then while it runs (it renews every TTL/3), and moves it forward
/// when less than one TTL is left, so a held lease costs one status write per three TTLs.
pub(crate) const PROMISED_TTLS: u64 = 4;

/// The `expiresAt` that a grant or renewal answered at store time `server_ms` lets the
/// controller promise, for a lease of `ttl_ms`.
pub(crate) fn promise(server_ms: u64, ttl_ms: u64) -> u64 {
    server_ms.saturating_add(ttl_ms.saturating_mul(PROMISED_TTLS))
}

/// Whether the published `expiresAt` (`published_ms`) must move forward at store time
/// `server_ms`, for a lease of `ttl_ms`: at most one TTL is left on it.
pub(crate) fn must_republish(published_ms: Option<u64>, server_ms: u64, ttl_ms: u64) -> bool {
    published_ms.is_none_or(|p| p.saturating_sub(server_ms) <= ttl_ms)
}
