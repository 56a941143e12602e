//! The renewal scheduler: takes each kept tenure off the schedule when its renewal is due and
//! renews it, at most `--renewal-concurrency` at once, on tokio's clock. It records every answer
//! in the tenure's record and wakes the claim's reconcile when the answer needs a status write.
//! Stopped by dropping it (the renewals in flight with it).

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use kube::runtime::reflector::ObjectRef;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, info};

use super::clock::Reading;
use super::record::{Record, Shared, State, must_republish, renew_interval};
use crate::api::TargetLease;
use crate::store::{LeaseHandle, RenewOutcome, RenewRequest, RequestId, Ttl};
use crate::time::millis;

/// How soon a renewal that failed is tried again: often enough to keep a lease through a short
/// store outage, never more than a few times per call timeout.
pub(super) fn retry_after_failure(ttl: Duration) -> Duration {
    (renew_interval(ttl) / 4).clamp(Duration::from_millis(200), Duration::from_secs(2))
}

/// How often tenures no longer on the schedule (lost ones, which their reconcile takes back)
/// are forgotten when their TargetLease left the cache; those on the schedule are dropped when
/// their renewal comes up.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One renewal taken off the schedule.
struct Due {
    key: ObjectRef<TargetLease>,
    handle: LeaseHandle,
    ttl: Ttl,
    epoch: u64,
    due: Instant,
}

/// The scheduler's loop.
pub(super) async fn run(shared: Arc<Shared>) {
    let mut running = JoinSet::new();
    let mut sweeps = tokio::time::interval(SWEEP_EVERY);
    sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        while running.try_join_next().is_some() {}
        if sweeps.tick().now_or_never().is_some() {
            sweep(&shared);
        }
        let next = shared
            .book()
            .schedule
            .first_key_value()
            .map(|(slot, _)| slot.0);
        match next {
            Some(due) if due <= Instant::now() => {}
            Some(due) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => {}
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

/// Whether the TargetLease `key` names is still in the cache, as the object the tenure was
/// granted to.
fn still_wanted(shared: &Shared, key: &ObjectRef<TargetLease>, kept: &Record) -> bool {
    shared
        .leases
        .get(key)
        .is_some_and(|lease| lease.metadata.uid.as_deref() == Some(kept.handle.lease_id.expose()))
}

/// Forgets every tenure off the schedule whose TargetLease left the cache (deleted without the
/// controller's finalizer, replaced under its name): a lost one is never scheduled again, so
/// nothing else would.
fn sweep(shared: &Shared) {
    let mut book = shared.book();
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
    // Endings of TargetLeases that left the cache: nothing waits for them any more.
    let ended: Vec<_> = book
        .endings
        .keys()
        .filter(|key| shared.leases.get(key).is_none())
        .cloned()
        .collect();
    for key in &ended {
        book.endings.remove(key);
    }
    let kept = book.kept.len();
    drop(book);
    shared.metrics.kept_leases(kept);
}

/// Takes the earliest due renewal off the schedule, if one is due.
fn take_due(shared: &Shared) -> Option<Due> {
    let mut book = shared.book();
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
        handle: kept.handle.clone(),
        ttl: kept.ttl,
        epoch: kept.epoch,
        due: slot.0,
        key,
    })
}

/// Renews the tenure kept for `key` now, in this task (for tests that run no scheduler).
#[cfg(test)]
pub(super) async fn renew_now_here(shared: &Shared, key: &ObjectRef<TargetLease>) {
    let due = {
        let book = shared.book();
        let Some(kept) = book.kept.get(key) else {
            return;
        };
        Due {
            key: key.clone(),
            handle: kept.handle.clone(),
            ttl: kept.ttl,
            epoch: kept.epoch,
            due: Instant::now(),
        }
    };
    renew_one(shared, due).await;
}

/// Renews one tenure and records the answer; wakes the reconcile when the answer needs a status
/// write.
async fn renew_one(shared: &Shared, due: Due) {
    if shared.leadership.check().is_err() {
        // Not leading: this controller is stopping (a successor renews from the statuses).
        // Kept on the schedule all the same, should leadership come back without a restart.
        let mut book = shared.book();
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
    let mut book = shared.book();
    if let Ok(RenewOutcome::Renewed { server_time_ms, .. }) = &result {
        let reading = Reading {
            sent: started,
            answered,
            server_ms: *server_time_ms,
        };
        book.record_clock(&due.handle.target, reading);
    }
    let Some(kept) = book.kept.get_mut(&due.key).filter(|k| k.epoch == due.epoch) else {
        // Stopped or handed over anew while the call ran.
        return;
    };
    let was_failing = matches!(kept.state, State::Failing(_));
    let (wake, next) = match result {
        Ok(RenewOutcome::Renewed {
            server_time_ms,
            expires_in_ms,
        }) => {
            let first = kept.state == State::Unconfirmed;
            kept.reading = Some(Reading {
                sent: started,
                answered,
                server_ms: server_time_ms,
            });
            kept.grant.server_time_ms = server_time_ms;
            if kept.grant.acquired_at_ms == 0 {
                // Taken from a status that did not say when the tenure began.
                kept.grant.acquired_at_ms = server_time_ms;
            }
            kept.grant.expires_in_ms = expires_in_ms;
            kept.state = State::Renewed;
            let publish = must_republish(kept.published_ms, server_time_ms, millis(ttl));
            (
                was_failing || first || publish,
                Some(started + renew_interval(ttl)),
            )
        }
        Ok(RenewOutcome::Lost { reason }) => {
            info!(lease = %due.key.name, target = %due.handle.target, reason = ?reason, "lease lost");
            kept.state = State::Lost(reason);
            (true, None)
        }
        Err(error) => {
            let changed = !matches!(&kept.state, State::Failing(e) if e.kind() == error.kind());
            debug!(lease = %due.key.name, error = %error, "renewal failed; trying again");
            kept.state = State::Failing(error);
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
