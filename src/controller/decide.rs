//! The reconcile's decisions, as pure functions of what it knows and of the time it is given:
//! which store call a claim needs (or none), and what the store's answer means for the status,
//! the Event and the next look. No I/O and no clock of its own: [`super::reconcile`] gathers the
//! [`Facts`], makes the one store call the [`Plan`] names and writes the one status a [`Step`]
//! carries. Unit-tested below with fixtures, a manual clock and the in-memory store.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::Error;
use super::heartbeat::stale_after;
use super::renewals::{Standing, State};
use super::status::{Observed, published_expiry};
use crate::api::{Phase, Reason, TargetLease, TargetLeaseStatus};
use crate::store::{
    AcquireOutcome, Grant, LeaseHandle, LeaseId, LossReason, Owner, Permits, RenewOutcome, Slot,
    TargetRef, Token, Ttl,
};

/// One TargetLease as the store sees it: its target, its lease id (the resource's uid) and what
/// its status says.
pub struct Claim<'a> {
    /// The resource.
    pub lease: &'a TargetLease,
    /// The target in the store.
    pub target: TargetRef,
    /// The lease id: the resource's uid.
    pub lease_id: LeaseId,
    /// The status as last written.
    pub status: Option<&'a TargetLeaseStatus>,
    /// The holder the spec names: the store's owner.
    pub owner: Owner,
    /// The lease's time-to-live.
    pub lease_ttl: Ttl,
    /// How many holders the spec says the target admits.
    pub permits: Permits,
}

impl<'a> Claim<'a> {
    /// Resolves the claim; refuses a resource without namespace or uid, or whose target or
    /// namespace the store cannot take.
    pub fn new(lease: &'a TargetLease) -> Result<Self, Error> {
        let ns = lease
            .namespace()
            .ok_or(Error::MissingField("metadata.namespace"))?;
        let uid = lease.uid().ok_or(Error::MissingField("metadata.uid"))?;
        Ok(Self {
            lease,
            target: TargetRef::new(&ns, &lease.spec.target)?,
            lease_id: LeaseId::new(uid)?,
            status: lease.status.as_ref(),
            owner: Owner::new(lease.spec.holder.clone())?,
            lease_ttl: Ttl::new(Duration::from_secs(u64::from(
                lease.spec.ttl_seconds.max(1),
            )))?,
            permits: Permits::new(lease.spec.permits)?,
        })
    }

    /// The holder the spec names (the store's owner).
    pub fn holder(&self) -> &str {
        self.owner.as_str()
    }

    /// The lease's time-to-live.
    pub fn ttl(&self) -> Duration {
        self.lease_ttl.duration()
    }

    /// The handle of the tenure the status records, if it says Held: its slot and the permits
    /// it was granted under as the status records them (a status without them is an exclusive
    /// lease's, as written before permits existed).
    pub fn held_handle(&self) -> Option<LeaseHandle> {
        let status = self.status?;
        if status.phase != Phase::Held {
            return None;
        }
        // A slot or permits no store can have granted holds nothing.
        let permits = Permits::new(status.permits.unwrap_or(1)).ok()?;
        let slot = Slot::new(status.slot.unwrap_or(0)).ok()?;
        permits.check_slot(slot).ok()?;
        Some(LeaseHandle {
            target: self.target.clone(),
            permits,
            slot,
            lease_id: self.lease_id.clone(),
            owner: self.owner.clone(),
            // A status token no store can have issued (0, above 2^53-1) holds nothing.
            token: Token::new(status.fencing_token?).ok()?,
        })
    }

    /// The token of the current or last tenure.
    pub fn last_token(&self) -> Option<u64> {
        self.status.and_then(|s| s.fencing_token)
    }
}

/// What a reconcile knows before it decides, besides the claim itself.
#[derive(Clone, Debug)]
pub struct Facts {
    /// Why the holder is gone, if it is (its pod is done, its `run` stopped beating).
    pub holder_gone: Option<String>,
    /// When this claim must wait its turn: the claim in line before it, and who holds the target.
    pub in_line_after: Option<(String, String)>,
    /// Why the holder pod's fate is unknown, if it is (the pod could not be read).
    pub holder_unknown: Option<String>,
    /// The shortest TTL this controller can keep.
    pub shortest_ttl: Duration,
    /// The latest the store's clock can read now, by this claim's last measured answer
    /// ([`Reading::latest_server_time`]); `None` when this process has not measured it yet.
    pub server_now: Option<Timestamp>,
    /// What the renewal scheduler keeps for this claim, if anything.
    pub kept: Option<Standing>,
}

/// What the reconcile does.
#[derive(Debug, PartialEq)]
pub enum Plan {
    /// Release whatever the claim holds and settle in Released.
    GiveUp {
        /// Why.
        reason: Reason,
        /// The condition message.
        message: String,
    },
    /// Hand the tenure the status records to the renewal scheduler, which does not keep it yet
    /// (this process just started or took over): it is renewed at once.
    Keep(LeaseHandle),
    /// Write what the renewal scheduler last said of the tenure the status records.
    Judge(Standing),
    /// Publish a tenure this process holds and the status does not show (a grant whose status
    /// write failed or was refused): no second grant is asked for.
    Publish(Standing),
    /// Ask the store for the target.
    Acquire,
    /// Ask the store nothing: write `observed`, look again after `next` (or on a change).
    Settle {
        /// The status to write.
        observed: Observed,
        /// When to look again; `None` waits for a change of the resource.
        next: Option<Duration>,
    },
}

/// Decides what the reconcile of `claim` does.
pub fn plan(claim: &Claim<'_>, facts: &Facts) -> Plan {
    if let Some((reason, message)) =
        release_reason(claim, facts.holder_gone.clone(), facts.server_now)
    {
        return Plan::GiveUp { reason, message };
    }
    // Only a tenure of this very claim: not one of a deleted object of the same name.
    let kept = facts.kept.as_ref().filter(|k| {
        k.handle.lease_id == claim.lease_id
            && k.handle.target == claim.target
            && k.handle.owner == claim.owner
    });
    if let Some(handle) = claim.held_handle() {
        return match kept {
            Some(k) if k.handle == handle => Plan::Judge(k.clone()),
            // A newer grant of this process, for this very lease id and owner.
            Some(k) if k.state == State::Renewed && same_claim(&k.handle, &handle) => {
                Plan::Publish(k.clone())
            }
            _ => Plan::Keep(handle),
        };
    }
    if let Some(k) = kept.filter(|k| k.state == State::Renewed) {
        return Plan::Publish(k.clone());
    }
    if claim.ttl() < facts.shortest_ttl {
        // A lease held already is renewed above (its workload runs); a new one is not taken.
        let message = format!(
            "ttlSeconds {} is shorter than {} s, the shortest TTL this controller can keep \
             (three Valkey call timeouts, and with leader election the time a successor needs \
             to take over and renew); raise spec.ttlSeconds",
            claim.ttl().as_secs(),
            facts.shortest_ttl.as_secs()
        );
        let observed = Observed::refused(Reason::TtlTooShort, message, claim.last_token());
        return Plan::Settle {
            observed,
            next: None,
        };
    }
    if let Some((ahead, holder)) = &facts.in_line_after {
        // Not this claim's turn: it asks the store nothing. It is woken when the target is
        // released or a grant happens, and looks again at the renewal interval at the latest.
        let mut observed = Observed::waiting(holder, claim.last_token());
        observed.message = format!(
            "target is held by {holder}; in line after {ahead} (claims get the target in the \
             order they were created, higher spec.priority first)"
        );
        return Plan::Settle {
            observed,
            next: Some(renew_interval(claim.ttl())),
        };
    }
    Plan::Acquire
}

/// Whether two handles are tenures of the same claim (lease id and owner), the second newer.
fn same_claim(newer: &LeaseHandle, older: &LeaseHandle) -> bool {
    newer.lease_id == older.lease_id
        && newer.owner == older.owner
        && newer.target == older.target
        && newer.token.get() > older.token.get()
}

/// Why a lease must be given up, if it must. `holder_gone` says why the holder is gone;
/// `server_now` is the store's clock now (the tenure's start is in it), unknown until this
/// process has measured it: the `maxHoldSeconds` bound is then judged after the next renewal.
pub fn release_reason(
    claim: &Claim<'_>,
    holder_gone: Option<String>,
    server_now: Option<Timestamp>,
) -> Option<(Reason, String)> {
    let spec = &claim.lease.spec;
    if spec.release {
        return Some((Reason::ReleaseRequested, "spec.release is true".to_owned()));
    }
    if let Some(why) = holder_gone {
        return Some((Reason::HolderGone, why));
    }
    let (Some(max), Some(status)) = (spec.max_hold_seconds, claim.status) else {
        return None;
    };
    let reached = || {
        (
            Reason::MaxHoldReached,
            format!("held for {max} s, the maxHoldSeconds bound"),
        )
    };
    // A spent claim stays released until its spec changes: otherwise the same TargetLease would
    // take the target again at once and the bound would bound nothing. The mark is a status field
    // of its own, kept through store failures (which rewrite the conditions) and restarts.
    let spent = status.max_hold_spent_generation.is_some()
        && status.max_hold_spent_generation == claim.lease.metadata.generation;
    if spent {
        return Some(reached());
    }
    let acquired = status.acquired_at.filter(|_| status.phase == Phase::Held)?;
    (server_now?.duration_since(acquired).as_secs() >= i64::from(max)).then(reached)
}

/// The renewal interval: a third of the TTL, so two renewals can fail before the lease expires.
pub fn renew_interval(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(300))
}

/// When to look at a held lease again: the next renewal, or the `maxHoldSeconds` bound if that
/// comes first; `now` is the store's clock (the tenure's start is in it).
pub fn next_check(claim: &Claim<'_>, now: Timestamp) -> Duration {
    let renew = renew_interval(claim.ttl());
    max_hold_left(claim, now).map_or(renew, |left| renew.min(left))
}

/// When to look again at a held lease the renewal scheduler keeps: it wakes the claim whenever
/// its answer needs a status write, so only the `maxHoldSeconds` bound needs a timer, and a TTL
/// is the longest wait (a safety net, not a schedule).
pub fn next_check_kept(claim: &Claim<'_>, now: Timestamp) -> Duration {
    let ttl = claim.ttl();
    max_hold_left(claim, now).map_or(ttl, |left| ttl.min(left))
}

/// What is left of the `maxHoldSeconds` bound at `now` (the store's clock), if there is one.
fn max_hold_left(claim: &Claim<'_>, now: Timestamp) -> Option<Duration> {
    let max = claim.lease.spec.max_hold_seconds?;
    let acquired = claim.status.and_then(|s| s.acquired_at)?;
    let held_ms = now.duration_since(acquired).as_millis().max(0);
    let left_ms = (i128::from(max) * 1000 - held_ms).max(0);
    Some(Duration::from_millis(
        u64::try_from(left_ms).unwrap_or(u64::MAX),
    ))
}

/// A claim with a heartbeat is looked at again when it would go stale, so a crashed `run`'s
/// lease is released within half a TTL of its last heartbeat; `silent` is how long it has been.
pub fn next_look(claim: &Claim<'_>, next: Duration, silent: Option<Duration>) -> Duration {
    match silent {
        Some(silent) => {
            let left = stale_after(claim.ttl()).saturating_sub(silent) + Duration::from_millis(20);
            next.min(left)
        }
        None => next,
    }
}

/// After a failed reconcile of a claim that shows Held: look again when its lease stops being
/// known valid (`valid_for`, see [`known_valid_for`]) at the latest, since if the store is still
/// failing then the status must stop saying Held (see `Observed::store_failed`). Never sooner
/// than 200 ms: a status write that keeps failing must not spin. `None` for a claim that does
/// not show Held.
pub fn look_again_by_expiry(
    status: Option<&TargetLeaseStatus>,
    valid_for: Duration,
) -> Option<Duration> {
    status.filter(|s| s.phase == Phase::Held)?;
    Some((valid_for + Duration::from_millis(20)).max(Duration::from_millis(200)))
}

/// One answer of the store placed on this process's monotonic clock: the store read its clock
/// as `server_ms` at some instant between `sent` and `answered`. Times in the store's clock are
/// compared with this process's only through a reading, never with its wall clock, so a
/// controller whose clock is off decides the same; what is assumed is only that both clocks
/// advance at the rate of real time between two answers (docs/internals/controller.md, clocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// When the call was sent (monotonic).
    pub sent: Instant,
    /// When its answer arrived (monotonic).
    pub answered: Instant,
    /// The store's clock in the answer, ms since the Unix epoch.
    pub server_ms: u64,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Reading {
    /// How long, from `now`, until the store's clock can read `at_ms`: it read `server_ms` no
    /// earlier than `sent`, so `at_ms` comes no earlier than `sent + (at_ms - server_ms)`. Zero
    /// once that may have passed; the answer is never later than the truth.
    pub fn left_until(&self, at_ms: u64, now: Instant) -> Duration {
        let ahead = at_ms.saturating_sub(self.server_ms);
        let elapsed = ms(now.saturating_duration_since(self.sent));
        Duration::from_millis(ahead.saturating_sub(elapsed))
    }

    /// The earliest the store's clock can read at `now`, in ms: it read `server_ms` no later
    /// than `answered`.
    pub fn earliest_server_ms(&self, now: Instant) -> u64 {
        self.server_ms
            .saturating_add(ms(now.saturating_duration_since(self.answered)))
    }

    /// The latest the store's clock can read at `now`: it read `server_ms` no earlier than
    /// `sent`.
    pub fn latest_server_time(&self, now: Instant) -> Timestamp {
        let latest = self
            .server_ms
            .saturating_add(ms(now.saturating_duration_since(self.sent)));
        millis_to_time(latest)
    }
}

/// What this process measured of a claim's tenure: the last answer of the store that granted or
/// renewed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Measured {
    /// The tenure's token.
    pub token: u64,
    /// The answer, on this process's clock.
    pub reading: Reading,
    /// The expiry the store granted in it, in the store's clock (ms since the Unix epoch).
    pub granted_until_ms: u64,
}

impl Measured {
    /// A grant measured as `reading`.
    pub fn granted(grant: &Grant, reading: Reading) -> Self {
        Self {
            token: grant.token,
            reading,
            granted_until_ms: grant.expires_at_ms(),
        }
    }
}

/// How long the lease of a claim that shows Held is still known to be valid at `now`: until the
/// expiry the store granted in the last answer this process measured for that very tenure,
/// counted on this process's monotonic clock from the moment that call was sent. The published
/// `expiresAt` plays no part: it is never later than a granted expiry, and it lags behind
/// while the status budget holds refreshes back, which must not turn a store blip into a loss. Zero when the claim does not show Held, when this process has
/// measured no answer for its token (it just started or took over: it knows nothing of the
/// store's clock), or once that may have passed. A status never says Held longer than this
/// while the store fails.
pub fn known_valid_for(
    status: Option<&TargetLeaseStatus>,
    measured: Option<&Measured>,
    now: Instant,
) -> Duration {
    let (Some(status), Some(measured)) = (status.filter(|s| s.phase == Phase::Held), measured)
    else {
        return Duration::ZERO;
    };
    if status.fencing_token != Some(measured.token) {
        return Duration::ZERO;
    }
    measured.reading.left_until(measured.granted_until_ms, now)
}

/// The [`Measured`] answers of this process, per TargetLease, and the latest reading of the
/// store's clock per target. Shared by the reconciles, the renewal scheduler and the error
/// policy; holds no clock of its own.
#[derive(Default)]
pub struct Measurements {
    by_claim: Mutex<HashMap<ObjectRef<TargetLease>, Measured>>,
    by_target: Mutex<HashMap<TargetRef, Reading>>,
}

impl Measurements {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectRef<TargetLease>, Measured>> {
        self.by_claim.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn targets(&self) -> std::sync::MutexGuard<'_, HashMap<TargetRef, Reading>> {
        self.by_target.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records what the store answered for `lease` on `target`.
    pub fn record(&self, lease: &TargetLease, target: &TargetRef, measured: Measured) {
        self.record_for(&ObjectRef::from_obj(lease), target, measured);
    }

    /// Records what the store answered for the TargetLease `lease` refers to, on `target`.
    pub fn record_for(
        &self,
        lease: &ObjectRef<TargetLease>,
        target: &TargetRef,
        measured: Measured,
    ) {
        self.lock().insert(lease.clone(), measured);
        self.record_clock(target, measured.reading);
    }

    /// Records a reading of the store's clock on `target` (any answer that carries the store's
    /// time, an inspect too), so that its clock is read once, not before every acquire; the
    /// latest answered is kept. It makes no tenure known valid.
    pub fn record_clock(&self, target: &TargetRef, reading: Reading) {
        let mut targets = self.targets();
        let latest = targets.entry(target.clone()).or_insert(reading);
        if reading.answered > latest.answered {
            *latest = reading;
        }
    }

    /// The latest reading of the store's clock measured on `target`: it outlives the claims it
    /// was measured for, so a hand-over (the holder deleted, its waiter acquiring) needs no
    /// extra call to read the clock.
    pub fn clock_of(&self, target: &TargetRef) -> Option<Reading> {
        self.targets().get(target).copied()
    }

    /// The last answer measured for `lease`.
    pub fn of(&self, lease: &TargetLease) -> Option<Measured> {
        self.lock().get(&ObjectRef::from_obj(lease)).copied()
    }

    /// How long the lease of `lease` is known valid at `now` (see [`known_valid_for`]).
    pub fn valid_for(&self, lease: &TargetLease, now: Instant) -> Duration {
        known_valid_for(lease.status.as_ref(), self.of(lease).as_ref(), now)
    }

    /// Forgets a deleted TargetLease.
    pub fn forget(&self, lease: &ObjectRef<TargetLease>) {
        self.lock().remove(lease);
    }

    /// Forgets the clock of a target no TargetLease names any more.
    pub fn forget_target(&self, target: &TargetRef) {
        self.targets().remove(target);
    }
}

/// What to write after the store answered, which Event goes with it, and when to look again.
#[derive(Debug, PartialEq)]
pub struct Step {
    /// The status (written only when it is a transition).
    pub observed: Observed,
    /// The Event published with the write.
    pub event: Option<(Reason, String)>,
    /// When to look again.
    pub next: Duration,
}

fn millis_to_time(ms: u64) -> Timestamp {
    Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX)).unwrap_or(Timestamp::MAX)
}

/// What a renewal of `handle`'s tenure answered.
pub fn after_renew(claim: &Claim<'_>, handle: &LeaseHandle, outcome: &RenewOutcome) -> Step {
    match outcome {
        RenewOutcome::Renewed {
            server_time_ms,
            expires_in_ms,
        } => {
            // Renewals live in Valkey; the status is written when something else changed (a new
            // generation, recovery from a failure) or when the published expiry must move
            // forward to stay a promise of more than one TTL (every ninth renewal).
            let grant = Grant {
                token: handle.token.get(),
                slot: handle.slot,
                acquired_at_ms: claim
                    .status
                    .and_then(|s| s.acquired_at)
                    .map_or(*server_time_ms, |t| {
                        u64::try_from(t.as_millisecond()).unwrap_or(0)
                    }),
                server_time_ms: *server_time_ms,
                expires_in_ms: *expires_in_ms,
            };
            let mut observed = Observed::held(&grant, handle.permits, claim.holder());
            observed.expires_at = published_expiry(
                claim.status.and_then(|s| s.expires_at),
                millis_to_time(*server_time_ms),
                claim.ttl(),
            );
            let observed = within_max_hold(claim, observed);
            Step {
                observed,
                event: None,
                next: next_check(claim, millis_to_time(*server_time_ms)),
            }
        }
        RenewOutcome::Lost { reason } => {
            let (reason, message) = match reason {
                LossReason::Expired => (Reason::Expired, "the lease expired before it was renewed"),
                LossReason::NotHolder => (Reason::Lost, "another claim holds the target"),
            };
            Step {
                observed: Observed::lost(reason, message.to_owned(), claim.last_token()),
                event: Some((reason, message.to_owned())),
                // Try again at once: a new tenure can only get a larger token.
                next: Duration::from_millis(100),
            }
        }
    }
}

/// Caps the `expiresAt` of a held `observed` at the end of the `maxHoldSeconds` bound, when
/// there is one: the controller releases the lease then, so it promises nothing beyond.
fn within_max_hold(claim: &Claim<'_>, mut observed: Observed) -> Observed {
    let bound = claim
        .lease
        .spec
        .max_hold_seconds
        .zip(observed.acquired_at)
        .and_then(|(max, acquired)| {
            acquired
                .checked_add(jiff::SignedDuration::from_secs(i64::from(max)))
                .ok()
        });
    if let (Some(expires), Some(bound)) = (observed.expires_at, bound) {
        observed.expires_at = Some(expires.min(bound));
    }
    observed
}

/// What an acquire under `permits` answered (the spec's for a new grant; the kept tenure's when
/// a grant this process holds is published).
pub fn after_acquire(claim: &Claim<'_>, permits: Permits, outcome: &AcquireOutcome) -> Step {
    match outcome {
        AcquireOutcome::Acquired(grant) => Step {
            observed: within_max_hold(claim, Observed::held(grant, permits, claim.holder())),
            event: Some((
                Reason::Acquired,
                if permits.is_exclusive() {
                    format!(
                        "acquired {} with fencing token {}",
                        claim.target, grant.token
                    )
                } else {
                    format!(
                        "acquired slot {} of {permits} permits on {} with fencing token {}",
                        grant.slot, claim.target, grant.token
                    )
                },
            )),
            next: renew_interval(claim.ttl()),
        },
        AcquireOutcome::Held {
            owner,
            expires_in_ms,
        } => Step {
            observed: Observed::waiting(owner, claim.last_token()),
            event: Some((
                Reason::Waiting,
                format!("{} is held by {owner}", claim.target),
            )),
            // A release through this controller wakes waiters at once; this requeue covers a
            // holder that stopped renewing: try again when Valkey said the lease expires.
            next: Duration::from_millis(*expires_in_ms) + Duration::from_millis(20),
        },
        // Permits granted under another value are held: this claim waits until they are all
        // gone or its spec agrees. A release on the target wakes it; the requeue covers holders
        // that expire.
        AcquireOutcome::PermitsConflict { in_force } => {
            let target = claim.target.to_string();
            let observed =
                Observed::permits_conflict(&target, *in_force, claim.permits, claim.last_token());
            Step {
                event: Some((Reason::PermitsConflict, observed.message.clone())),
                observed,
                next: renew_interval(claim.ttl()),
            }
        }
        // The store's own retry of this call came after the grant had already ended (a TTL
        // shorter than the call's retries): nothing is held; claim again at once with a new
        // request id, which can only get a larger token.
        AcquireOutcome::Expired { .. } => {
            let message = "the lease expired before its grant was confirmed";
            Step {
                observed: Observed::lost(Reason::Expired, message.to_owned(), claim.last_token()),
                event: Some((Reason::Expired, message.to_owned())),
                next: Duration::from_millis(100),
            }
        }
    }
}

/// Whether a grant to `claim` is a hand-over: the target passing to a claim that waited for it
/// (a Lost claim taking its target back is not one).
pub fn is_handover(claim: &Claim<'_>) -> bool {
    claim.status.map(|s| s.phase) == Some(Phase::Waiting)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use jiff::SignedDuration;
    use kube::api::ObjectMeta;

    use super::*;
    use crate::api::{TargetLeaseSpec, test_spec};
    use crate::store::memory::{ManualClock, MemoryStore};
    use crate::store::{AcquireRequest, LeaseStore, RenewRequest, RequestId};

    const T0: i64 = 1_800_000_000;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(T0 + seconds).expect("time")
    }

    /// A TargetLease named `name` with `spec` and `status`, generation 1.
    fn fixture(spec: TargetLeaseSpec, status: Option<TargetLeaseStatus>) -> TargetLease {
        let mut lease = TargetLease::new("claim", spec);
        lease.metadata = ObjectMeta {
            name: Some("claim".into()),
            namespace: Some("ns".into()),
            uid: Some("uid-claim".into()),
            generation: Some(1),
            ..ObjectMeta::default()
        };
        lease.status = status;
        lease
    }

    fn facts(now: Timestamp) -> Facts {
        Facts {
            holder_gone: None,
            in_line_after: None,
            holder_unknown: None,
            shortest_ttl: Duration::from_secs(6),
            server_now: Some(now),
            kept: None,
        }
    }

    fn held_since(seconds: i64, token: u64) -> TargetLeaseStatus {
        TargetLeaseStatus {
            phase: Phase::Held,
            owner: Some("w".into()),
            fencing_token: Some(token),
            acquired_at: Some(at(seconds)),
            expires_at: Some(at(seconds + 30)),
            ..TargetLeaseStatus::default()
        }
    }

    #[test]
    fn the_decision_table() {
        let spec = test_spec("t", "w");
        // New: acquire.
        let lease = fixture(spec.clone(), None);
        let claim = Claim::new(&lease).expect("claim");
        assert_eq!(plan(&claim, &facts(at(0))), Plan::Acquire);
        // Held: renew with the status's token.
        let lease = fixture(spec.clone(), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        match plan(&claim, &facts(at(10))) {
            Plan::Keep(handle) => assert_eq!(handle.token.get(), 7),
            other => panic!("{other:?}"),
        }
        // Asked to release, or the holder is gone: give up, Held or not.
        let lease = fixture(
            TargetLeaseSpec {
                release: true,
                ..spec.clone()
            },
            Some(held_since(0, 7)),
        );
        let claim = Claim::new(&lease).expect("claim");
        assert!(matches!(
            plan(&claim, &facts(at(1))),
            Plan::GiveUp {
                reason: Reason::ReleaseRequested,
                ..
            }
        ));
        let lease = fixture(spec.clone(), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        let mut gone = facts(at(1));
        gone.holder_gone = Some("pod gone".into());
        assert!(matches!(
            plan(&claim, &gone),
            Plan::GiveUp {
                reason: Reason::HolderGone,
                ..
            }
        ));
        // Not its turn: Waiting, no store call, a look at the renewal interval.
        let lease = fixture(spec.clone(), None);
        let claim = Claim::new(&lease).expect("claim");
        let mut behind = facts(at(0));
        behind.in_line_after = Some(("older".into(), "holder-0".into()));
        match plan(&claim, &behind) {
            Plan::Settle { observed, next } => {
                assert_eq!(observed.phase, Phase::Waiting);
                assert!(observed.message.contains("in line after older"));
                assert_eq!(next, Some(Duration::from_secs(10)));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_ttl_the_controller_cannot_keep_is_refused_unless_held() {
        let short = TargetLeaseSpec {
            ttl_seconds: 5,
            ..test_spec("t", "w")
        };
        let lease = fixture(short.clone(), None);
        let claim = Claim::new(&lease).expect("claim");
        match plan(&claim, &facts(at(0))) {
            Plan::Settle {
                observed,
                next: None,
            } => {
                assert_eq!(observed.phase, Phase::Failed);
                assert_eq!(observed.reason, Reason::TtlTooShort);
                assert!(observed.message.contains("6 s"), "{}", observed.message);
            }
            other => panic!("{other:?}"),
        }
        let lease = fixture(short, Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        assert!(matches!(plan(&claim, &facts(at(1))), Plan::Keep(_)));
    }

    #[test]
    fn max_hold_is_reached_by_the_clock_and_stays_spent() {
        let bounded = TargetLeaseSpec {
            max_hold_seconds: Some(60),
            ..test_spec("t", "w")
        };
        let lease = fixture(bounded.clone(), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        assert!(matches!(plan(&claim, &facts(at(59))), Plan::Keep(_)));
        assert!(matches!(
            plan(&claim, &facts(at(60))),
            Plan::GiveUp {
                reason: Reason::MaxHoldReached,
                ..
            }
        ));
        // The next look comes at the bound, not a renewal later.
        assert_eq!(next_check(&claim, at(55)), Duration::from_secs(5));
        // Released and spent for this generation: still given up, whatever the phase says.
        let spent = TargetLeaseStatus {
            phase: Phase::Released,
            max_hold_spent_generation: Some(1),
            ..TargetLeaseStatus::default()
        };
        let lease = fixture(bounded.clone(), Some(spent.clone()));
        let claim = Claim::new(&lease).expect("claim");
        assert!(matches!(
            plan(&claim, &facts(at(1000))),
            Plan::GiveUp {
                reason: Reason::MaxHoldReached,
                ..
            }
        ));
        // A new generation (the spec changed) is a new claim.
        let mut lease = fixture(bounded, Some(spent));
        lease.metadata.generation = Some(2);
        let claim = Claim::new(&lease).expect("claim");
        assert_eq!(plan(&claim, &facts(at(1000))), Plan::Acquire);
    }

    #[test]
    fn a_failing_held_claim_is_looked_at_by_its_expiry() {
        let held = held_since(0, 7);
        assert_eq!(
            look_again_by_expiry(Some(&held), Duration::from_secs(5)),
            Some(Duration::from_millis(5_020))
        );
        // Past it, soon but not in a spin.
        assert_eq!(
            look_again_by_expiry(Some(&held), Duration::ZERO),
            Some(Duration::from_millis(200))
        );
        let waiting = TargetLeaseStatus {
            phase: Phase::Waiting,
            ..held
        };
        assert_eq!(look_again_by_expiry(Some(&waiting), Duration::ZERO), None);
        assert_eq!(look_again_by_expiry(None, Duration::ZERO), None);
    }

    /// A manual monotonic clock: instants as offsets from one base.
    struct Mono(Instant);

    impl Mono {
        fn at(&self, ms: u64) -> Instant {
            self.0 + Duration::from_millis(ms)
        }
    }

    /// The store's clock an hour ahead of the controller's wall clock, and an hour behind: a
    /// failing claim is Held exactly as long as measured on the controller's monotonic clock
    /// from the moment its renewal was sent, whatever the wall clocks say.
    #[tokio::test]
    async fn validity_is_measured_whatever_the_clocks_say() {
        let mono = Mono(Instant::now());
        for skew_s in [-3600i64, 0, 3600] {
            // The store's clock, skewed from the controller's wall clock.
            let clock = ManualClock::new();
            let by = Duration::from_secs(skew_s.unsigned_abs());
            if skew_s < 0 {
                clock.rewind(by);
            } else {
                clock.advance(by);
            }
            let store = MemoryStore::with_clock(Arc::new(clock.clone()), Duration::from_secs(60));
            let lease = fixture(test_spec("t", "w"), None);
            let claim = Claim::new(&lease).expect("claim");
            // Sent at 0 ms, answered at 40 ms: the store read its clock in between.
            let answer = store.acquire(&acquire_of(&claim)).await.expect("acquire");
            let AcquireOutcome::Acquired(grant) = &answer else {
                panic!("{answer:?}");
            };
            let reading = Reading {
                sent: mono.at(0),
                answered: mono.at(40),
                server_ms: grant.server_time_ms,
            };
            let measured = Measured::granted(grant, reading);
            let status = after_acquire(&claim, claim.permits, &answer)
                .observed
                .into_status(Some(1), None, Timestamp::now());
            // TTL 30 s from the send: valid until 30 s on the monotonic clock, not a
            // millisecond longer, whatever the skew.
            let valid = |ms| known_valid_for(Some(&status), Some(&measured), mono.at(ms));
            assert_eq!(valid(0), Duration::from_secs(30), "skew {skew_s} s");
            assert_eq!(valid(29_990), Duration::from_millis(10), "skew {skew_s} s");
            assert_eq!(valid(30_000), Duration::ZERO, "skew {skew_s} s");
            // The store's clock as bounded by the reading.
            assert_eq!(
                reading.earliest_server_ms(mono.at(1_040)),
                grant.server_time_ms + 1_000
            );
            assert_eq!(
                reading.latest_server_time(mono.at(1_000)).as_millisecond(),
                i64::try_from(grant.server_time_ms + 1_000).expect("ms")
            );
            // A published expiry an hour later than the grant (a forged status, or the wall
            // clock of a controller an hour behind) keeps nothing Held longer.
            let mut forged = status.clone();
            forged.expires_at = forged.expires_at.map(|e| e + SignedDuration::from_hours(1));
            assert_eq!(
                known_valid_for(Some(&forged), Some(&measured), mono.at(30_000)),
                Duration::ZERO
            );
            // An earlier published expiry (refreshes held back for a slow API server) does not
            // shorten it: the measured grant is what the lease is valid until.
            let mut earlier = status.clone();
            earlier.expires_at = earlier
                .expires_at
                .map(|e| e - SignedDuration::from_secs(10));
            assert_eq!(
                known_valid_for(Some(&earlier), Some(&measured), mono.at(19_000)),
                Duration::from_secs(11)
            );
            // Measured for another token, or not at all (a controller that just started): not
            // known valid, so a failing store makes the claim Lost with Held Unknown at once.
            let other = Measured {
                token: grant.token + 1,
                ..measured
            };
            assert_eq!(
                known_valid_for(Some(&status), Some(&other), mono.at(0)),
                Duration::ZERO
            );
            assert_eq!(
                known_valid_for(Some(&status), None, mono.at(0)),
                Duration::ZERO
            );
            let failing = Observed::store_failed(
                Some(&status),
                &crate::store::StoreError::Unavailable {
                    endpoint: "x:1".into(),
                    cause: "down".into(),
                },
                known_valid_for(Some(&status), Some(&measured), mono.at(30_000)),
            );
            assert_eq!(failing.phase, Phase::Lost, "skew {skew_s} s");
            assert!(failing.held_unknown);
        }
    }

    /// What the renewal scheduler keeps for `claim`: `token`, in `state`.
    fn kept(claim: &Claim<'_>, token: u64, state: State) -> Standing {
        Standing {
            handle: LeaseHandle {
                target: claim.target.clone(),
                permits: claim.permits,
                slot: Slot::ZERO,
                lease_id: claim.lease_id.clone(),
                owner: claim.owner.clone(),
                token: Token::new(token).expect("token"),
            },
            grant: Grant {
                token,
                slot: Slot::ZERO,
                acquired_at_ms: 1_000,
                server_time_ms: 2_000,
                expires_in_ms: 30_000,
            },
            state,
        }
    }

    /// A Held claim is judged by what the renewal scheduler heard, not renewed by the
    /// reconcile; a grant whose status write failed is published, never asked for again.
    #[test]
    fn kept_tenures_are_judged_and_never_granted_twice() {
        let lease = fixture(test_spec("t", "w"), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        let with = |standing: Standing| Facts {
            kept: Some(standing),
            ..facts(at(1))
        };
        assert!(matches!(plan(&claim, &facts(at(1))), Plan::Keep(h) if h.token.get() == 7));
        let same = kept(&claim, 7, State::Renewed);
        assert_eq!(plan(&claim, &with(same.clone())), Plan::Judge(same));
        let lost = kept(&claim, 7, State::Lost(LossReason::Expired));
        assert_eq!(plan(&claim, &with(lost.clone())), Plan::Judge(lost.clone()));
        // A newer grant of this process: published.
        let newer = kept(&claim, 9, State::Renewed);
        assert_eq!(
            plan(&claim, &with(newer.clone())),
            Plan::Publish(newer.clone())
        );
        // An older tenure than the status shows (another leader granted since): the status's.
        let older = kept(&claim, 5, State::Renewed);
        assert!(matches!(plan(&claim, &with(older)), Plan::Keep(h) if h.token.get() == 7));
        // The status went Lost (a loss whose write landed, a renewal that failed too long): a
        // grant this process still renews is published, not acquired anew.
        let mut gone = held_since(0, 7);
        gone.phase = Phase::Lost;
        let lease = fixture(test_spec("t", "w"), Some(gone));
        let claim = Claim::new(&lease).expect("claim");
        assert_eq!(plan(&claim, &with(newer.clone())), Plan::Publish(newer));
        assert_eq!(plan(&claim, &with(lost)), Plan::Acquire);
        // A release request wins over everything kept.
        let mut released = fixture(test_spec("t", "w"), Some(held_since(0, 7)));
        released.spec.release = true;
        let claim = Claim::new(&released).expect("claim");
        let same = kept(&claim, 7, State::Renewed);
        assert!(matches!(plan(&claim, &with(same)), Plan::GiveUp { .. }));
    }

    /// The published promise never runs past the maxHoldSeconds bound (the controller releases
    /// then), at the grant and at a renewal; without a bound it is four TTLs.
    #[tokio::test]
    async fn the_promise_stops_at_the_max_hold_bound() {
        let store = MemoryStore::new();
        let bounded = TargetLeaseSpec {
            max_hold_seconds: Some(45),
            ..test_spec("t", "w")
        };
        let lease = fixture(bounded.clone(), None);
        let claim = Claim::new(&lease).expect("claim");
        let answer = store.acquire(&acquire_of(&claim)).await.expect("acquire");
        let granted = after_acquire(&claim, claim.permits, &answer).observed;
        let acquired = granted.acquired_at.expect("acquiredAt");
        assert_eq!(
            granted.expires_at,
            Some(acquired + SignedDuration::from_secs(45))
        );
        let status = granted.into_status(Some(1), None, Timestamp::now());
        let lease = fixture(bounded, Some(status));
        let claim = Claim::new(&lease).expect("claim");
        let handle = claim.held_handle().expect("held");
        let step = renewed(&store, &claim, &handle).await;
        assert!(step.observed.expires_at <= Some(acquired + SignedDuration::from_secs(45)));
        let free = fixture(test_spec("t2", "w"), None);
        let claim = Claim::new(&free).expect("claim");
        let answer = store.acquire(&acquire_of(&claim)).await.expect("acquire");
        let granted = after_acquire(&claim, claim.permits, &answer).observed;
        let acquired = granted.acquired_at.expect("acquiredAt");
        assert_eq!(
            granted.expires_at,
            Some(acquired + SignedDuration::from_secs(120))
        );
    }

    #[test]
    fn max_hold_waits_for_a_measured_clock() {
        let bounded = TargetLeaseSpec {
            max_hold_seconds: Some(60),
            ..test_spec("t", "w")
        };
        let lease = fixture(bounded, Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        let mut unmeasured = facts(at(1000));
        unmeasured.server_now = None;
        assert!(matches!(plan(&claim, &unmeasured), Plan::Keep(_)));
    }

    #[test]
    fn a_heartbeat_brings_the_next_look_forward() {
        let lease = fixture(test_spec("t", "w"), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        // TTL 30 s: stale after 15 s of silence; silent for 10 s, so look again in 5 s.
        let next = next_look(
            &claim,
            Duration::from_secs(10),
            Some(Duration::from_secs(10)),
        );
        assert_eq!(next, Duration::from_millis(5_020));
        assert_eq!(
            next_look(&claim, Duration::from_secs(10), None),
            Duration::from_secs(10)
        );
    }

    /// The acquire the controller sends for `claim`, without a floor.
    fn acquire_of(claim: &Claim<'_>) -> AcquireRequest {
        AcquireRequest {
            target: claim.target.clone(),
            lease_id: claim.lease_id.clone(),
            owner: claim.owner.clone(),
            permits: claim.permits,
            ttl: claim.lease_ttl,
            min_token: 0,
            request_id: RequestId::random(),
        }
    }

    /// The store's real answers, on a manual clock, mapped to statuses: a grant, renewals that
    /// move `expiresAt` every ninth time (one TTL left of a promise of four), a loss after the
    /// lease expired unrenewed.
    #[tokio::test]
    async fn store_answers_become_statuses() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()), Duration::from_secs(60));
        let lease = fixture(test_spec("t", "w"), None);
        let claim = Claim::new(&lease).expect("claim");
        let answer = store.acquire(&acquire_of(&claim)).await.expect("acquire");
        let step = after_acquire(&claim, claim.permits, &answer);
        assert_eq!(step.observed.phase, Phase::Held);
        assert_eq!(step.next, Duration::from_secs(10));
        assert!(matches!(step.event, Some((Reason::Acquired, _))));
        let granted_at =
            Timestamp::from_microsecond(i64::try_from(clock_now(&clock)).expect("time"))
                .expect("time");
        let mut status = step.observed.into_status(Some(1), None, granted_at);
        let first_expiry = status.expires_at.expect("expiresAt");

        let mut writes = 0;
        for renewal in 1..=18 {
            clock.advance(Duration::from_secs(10));
            let now = granted_at + SignedDuration::from_secs(10 * renewal);
            let lease = fixture(test_spec("t", "w"), Some(status.clone()));
            let claim = Claim::new(&lease).expect("claim");
            let Plan::Keep(handle) = plan(&claim, &facts(now)) else {
                panic!("a held claim renews");
            };
            let step = renewed(&store, &claim, &handle).await;
            assert_eq!(step.observed.phase, Phase::Held);
            let expires = step.observed.expires_at.expect("expiresAt");
            assert!(expires > now + SignedDuration::from_secs(10), "{renewal}");
            let next = step.observed.into_status(Some(1), Some(&status), now);
            if super::super::status::is_transition(Some(&status), &next) {
                writes += 1;
            }
            status = next;
        }
        assert_eq!(writes, 2, "one status write per nine renewals");
        assert!(status.expires_at > Some(first_expiry));

        // Unrenewed past its TTL: the store says expired, the claim shows Lost and tries again.
        clock.advance(Duration::from_secs(31));
        let lease = fixture(test_spec("t", "w"), Some(status.clone()));
        let claim = Claim::new(&lease).expect("claim");
        let handle = claim.held_handle().expect("held");
        let step = renewed(&store, &claim, &handle).await;
        assert_eq!(step.observed.phase, Phase::Lost);
        assert_eq!(step.next, Duration::from_millis(100));
        assert!(matches!(step.event, Some((Reason::Expired, _))));
    }

    /// Renews `handle` in `store` and maps the answer.
    async fn renewed(store: &MemoryStore, claim: &Claim<'_>, handle: &LeaseHandle) -> Step {
        after_renew(claim, handle, &renew_in(store, claim, handle).await)
    }

    fn clock_now(clock: &ManualClock) -> u64 {
        use crate::store::memory::Clock;
        clock.now_micros()
    }

    /// Renews `handle` in `store`: the store's answer.
    async fn renew_in(
        store: &MemoryStore,
        claim: &Claim<'_>,
        handle: &LeaseHandle,
    ) -> RenewOutcome {
        store
            .renew(&RenewRequest {
                lease: handle.clone(),
                ttl: claim.lease_ttl,
                request_id: RequestId::random(),
            })
            .await
            .expect("renew")
    }

    /// While the API server is slow the budget sheds `expiresAt` refreshes, so the published
    /// expiry falls behind the store's. One renewal that fails then (a store call timing out
    /// once) must not make the claim Lost: the store granted the lease for most of a TTL more,
    /// and the renewal scheduler retries within a twelfth of it. `judge` feeds
    /// `Measurements::valid_for` into `Observed::store_failed` exactly as below.
    #[tokio::test]
    async fn one_failed_renewal_while_refreshes_are_shed_keeps_the_claim_held() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()), Duration::from_secs(60));
        let unheld = fixture(test_spec("t", "w"), None);
        let claim = Claim::new(&unheld).expect("claim");
        let answer = store.acquire(&acquire_of(&claim)).await.expect("acquire");
        let AcquireOutcome::Acquired(grant) = &answer else {
            panic!("{answer:?}");
        };
        // The grant's status is the last one the API server took, and its promise has lagged
        // behind the store's grant since (every refresh shed): 30 s after the grant.
        let mut status = after_acquire(&claim, claim.permits, &answer)
            .observed
            .into_status(Some(1), None, Timestamp::now());
        status.expires_at = status
            .acquired_at
            .map(|a| a + SignedDuration::from_secs(30));
        let lease = fixture(test_spec("t", "w"), Some(status));
        let claim = Claim::new(&lease).expect("claim");
        let handle = claim.held_handle().expect("held");
        // The scheduler renews every 10 s; every refresh is shed. Renewal at 40 s:
        let base = Instant::now();
        let mut last = None;
        for s in [10u64, 20, 30, 40] {
            clock.advance(Duration::from_secs(10));
            let renewed = renew_in(&store, &claim, &handle).await;
            let RenewOutcome::Renewed {
                server_time_ms,
                expires_in_ms,
            } = renewed
            else {
                panic!("{renewed:?}");
            };
            last = Some(Measured {
                token: grant.token,
                reading: Reading {
                    sent: base + Duration::from_secs(s),
                    answered: base + Duration::from_secs(s) + Duration::from_millis(5),
                    server_ms: server_time_ms,
                },
                granted_until_ms: server_time_ms + expires_in_ms,
            });
        }
        let measurements = Measurements::default();
        measurements.record(&lease, &claim.target, last.expect("renewed"));
        // The next renewal, at 50 s, times out once.
        let now = base + Duration::from_secs(50);
        let valid_for = measurements.valid_for(&lease, now);
        let failing = Observed::store_failed(
            lease.status.as_ref(),
            &crate::store::StoreError::Timeout {
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
    }
}
