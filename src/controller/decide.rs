//! The reconcile's decisions, as pure functions of what it knows and of the time it is given:
//! which store call a claim needs (or none), and what a store's answer or a kept tenure means
//! for the status, the Event and the next look. No I/O, no clock and no state of its own:
//! [`super::reconcile`] gathers the [`Facts`] (the claim's kept tenure among them, as the
//! tenure layer's [`View`]), makes the one store call the [`Plan`] names and writes the one
//! status a [`Step`] carries. Unit-tested below with fixtures, a manual clock and the in-memory
//! store.

use std::time::Duration;

use jiff::Timestamp;

use super::claim::Claim;
use super::holders::HolderFacts;
use super::line::Behind;
use super::status::{Observed, published_expiry};
use super::tenure::{State, View, renew_interval};
use crate::api::heartbeat::{judged_ttl, stale_after, stopping};
use crate::api::{Phase, Reason, TargetLeaseStatus};
use crate::store::{AcquireOutcome, LeaseHandle, LossReason};
use crate::time::timestamp;

/// What a reconcile knows before it decides, besides the claim itself.
#[derive(Clone, Debug)]
pub(crate) struct Facts {
    /// What is known of the holder (gone, unknown, the heartbeat's silence).
    pub(crate) holder: HolderFacts,
    /// Why this claim must wait its turn, when it must.
    pub(crate) in_line_after: Option<Behind>,
    /// The shortest TTL this controller can keep.
    pub(crate) shortest_ttl: Duration,
    /// What the tenure layer keeps for this claim, if anything.
    pub(crate) kept: Option<View>,
}

impl Facts {
    /// The latest the store's clock can read now, by the last answer measured for this claim's
    /// kept tenure; `None` when nothing was measured yet.
    fn server_now(&self) -> Option<Timestamp> {
        self.kept
            .as_ref()
            .and_then(|v| v.server_now_ms)
            .map(timestamp)
    }
}

/// What the reconcile does.
#[derive(Debug, PartialEq)]
pub(crate) enum Plan {
    /// Release whatever the claim holds and settle in Released.
    GiveUp {
        /// Why.
        reason: Reason,
        /// The condition message.
        message: String,
    },
    /// Hand the tenure the status records to the tenure layer, which does not keep it yet
    /// (this process just started or took over): it is renewed at once.
    Keep(LeaseHandle),
    /// Write what the tenure layer last heard of the tenure the status records.
    Judge(View),
    /// Publish a tenure this process holds and the status does not show (a grant whose status
    /// write failed or was refused): no second grant is asked for.
    Publish(View),
    /// The status says the tenure ended and its holder has not been confirmed stopped: pass the
    /// target on when the hand-over rule allows it.
    Stopping,
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
pub(crate) fn plan(claim: &Claim<'_>, facts: &Facts) -> Plan {
    if stopping(claim.lease) {
        // Nothing else until the target of the ended tenure is passed on.
        return Plan::Stopping;
    }
    if let Some((reason, message)) =
        release_reason(claim, facts.holder.gone.clone(), facts.server_now())
    {
        return Plan::GiveUp { reason, message };
    }
    // Only a tenure of this very claim: not one of a deleted object of the same name.
    let kept = facts.kept.as_ref().filter(|k| claim.owns(&k.handle));
    if let Some(handle) = claim.held_handle() {
        return match kept {
            Some(k) if k.handle == handle => Plan::Judge(k.clone()),
            // A newer grant of this process, for this very lease id and owner.
            Some(k) if k.state == State::Renewed && k.handle.token > handle.token => {
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
    if let Some(behind) = &facts.in_line_after {
        // Not this claim's turn: it asks the store nothing. It is woken when the target is
        // released or a grant happens, and looks again at the renewal interval at the latest.
        let Behind {
            ahead,
            holder,
            blocked,
        } = behind;
        let mut observed = Observed::waiting(holder, claim.last_token());
        observed.message = if *blocked {
            format!(
                "target is held by {holder} ({ahead}), whose holder acts on its status: the \
                 target passes on once that holder has stopped"
            )
        } else {
            format!(
                "target is held by {holder}; in line after {ahead} (claims get the target in \
                 the order they were created, higher spec.priority first)"
            )
        };
        return Plan::Settle {
            observed,
            next: Some(renew_interval(claim.ttl())),
        };
    }
    Plan::Acquire
}

/// Why a lease must be given up, if it must. `holder_gone` says why the holder is gone;
/// `server_now` is the store's clock now (the tenure's start is in it), unknown until this
/// process has measured it: the `maxHoldSeconds` bound is then judged after the next renewal.
pub(crate) fn release_reason(
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

/// When to look at a held lease again: the next renewal, or the `maxHoldSeconds` bound if that
/// comes first; `now` is the store's clock (the tenure's start is in it).
pub(crate) fn next_check(claim: &Claim<'_>, now: Timestamp) -> Duration {
    let renew = renew_interval(claim.ttl());
    max_hold_left(claim, now).map_or(renew, |left| renew.min(left))
}

/// When to look again at a held lease the tenure layer keeps: it wakes the claim whenever its
/// answer needs a status write, so only the `maxHoldSeconds` bound needs a timer, and a TTL is
/// the longest wait (a safety net, not a schedule).
pub(crate) fn next_check_kept(claim: &Claim<'_>, now: Timestamp) -> Duration {
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
pub(crate) fn next_look(claim: &Claim<'_>, next: Duration, silent: Option<Duration>) -> Duration {
    match silent {
        Some(silent) => {
            let left = stale_after(judged_ttl(claim.lease)).saturating_sub(silent)
                + Duration::from_millis(20);
            next.min(left)
        }
        None => next,
    }
}

/// After a failed reconcile of a claim that shows Held: look again when its lease stops being
/// known valid (`valid_for`, see [`valid_for`]) at the latest, since if the store is still
/// failing then the status must stop saying Held (see `Observed::store_failed`). Never sooner
/// than 200 ms: a status write that keeps failing must not spin. `None` for a claim that does
/// not show Held.
pub(crate) fn look_again_by_expiry(
    status: Option<&TargetLeaseStatus>,
    valid_for: Duration,
) -> Option<Duration> {
    status.filter(|s| s.phase == Phase::Held)?;
    Some((valid_for + Duration::from_millis(20)).max(Duration::from_millis(200)))
}

/// How long the lease of a claim that shows Held is still known valid: for as long as the tenure
/// layer knows the very tenure the status shows valid ([`View::valid_for`]). The published
/// `expiresAt` plays no part: it is never later than a granted expiry, and it lags behind while
/// the status budget holds refreshes back, which must not turn a store blip into a loss. Zero
/// when the claim does not show Held, or this process keeps another tenure or none (it just
/// started or took over: it knows nothing of the store's clock). A status never says Held
/// longer than this while the store fails.
pub(crate) fn valid_for(claim: &Claim<'_>, kept: Option<&View>) -> Duration {
    match (claim.held_handle(), kept) {
        (Some(shown), Some(view)) if shown.token == view.handle.token => view.valid_for,
        _ => Duration::ZERO,
    }
}

/// What to write after the store answered, which Event goes with it, and when to look again.
#[derive(Debug, PartialEq)]
pub(crate) struct Step {
    /// The status (written only when it is a transition).
    pub(crate) observed: Observed,
    /// The Event published with the write.
    pub(crate) event: Option<(Reason, String)>,
    /// When to look again.
    pub(crate) next: Duration,
}

/// What a kept tenure's latest answer means (it was granted or renewed, or the store said it
/// is lost; [`State::Unconfirmed`] and [`State::Failing`] have no status of their own): Held,
/// with the Acquired Event when the status does not show this tenure yet (a grant just made,
/// or one whose status write failed), or Lost.
pub(crate) fn kept_step(claim: &Claim<'_>, view: &View) -> Step {
    if let State::Lost(reason) = &view.state {
        return lost_step(claim, *reason);
    }
    let shown = claim.held_handle().is_some_and(|h| h == view.handle);
    let permits = view.handle.permits;
    let mut observed = Observed::held(&view.grant, permits, claim.holder());
    if shown {
        // The tenure's start is the one the status published (the maxHoldSeconds bound counts
        // from it).
        if let Some(acquired) = claim.status.and_then(|s| s.acquired_at) {
            observed.acquired_at = Some(acquired);
        }
        // Renewals live in the store; the status is written when something else changed (a new
        // generation, recovery from a failure) or when the published expiry must move forward
        // to stay a promise of more than one TTL (every ninth renewal).
        observed.expires_at = published_expiry(
            claim.status.and_then(|s| s.expires_at),
            timestamp(view.grant.server_time_ms),
            claim.ttl(),
        );
    }
    // A grant the status does not show is renewed at the next interval; one it shows is looked
    // at again by its maxHoldSeconds bound (the tenure layer wakes it for everything else).
    let next = if shown {
        let at = |ms| timestamp(ms);
        view.server_now_ms.map_or_else(
            || next_check(claim, at(view.grant.server_time_ms)),
            |now| next_check_kept(claim, at(now)),
        )
    } else {
        renew_interval(claim.ttl())
    };
    let event = (!shown).then(|| {
        let message = if permits.is_exclusive() {
            format!(
                "acquired {} with fencing token {}",
                claim.target, view.grant.token
            )
        } else {
            format!(
                "acquired slot {} of {permits} permits on {} with fencing token {}",
                view.grant.slot, claim.target, view.grant.token
            )
        };
        (Reason::Acquired, message)
    });
    Step {
        observed: within_max_hold(claim, observed),
        event,
        next,
    }
}

/// The store said the tenure ended.
fn lost_step(claim: &Claim<'_>, reason: LossReason) -> Step {
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

/// What an acquire that granted nothing answered: the target is held, the permits in force
/// differ, or the store's own retry came after the grant had ended. `None` for a grant, which
/// the tenure layer keeps ([`kept_step`] says what it means).
pub(crate) fn refused_step(claim: &Claim<'_>, outcome: &AcquireOutcome) -> Option<Step> {
    Some(match outcome {
        AcquireOutcome::Acquired(_) => return None,
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
            // holder that stopped renewing: try again when the store said the lease expires.
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
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use jiff::SignedDuration;
    use kube::api::ObjectMeta;

    use super::*;
    use crate::api::{TargetLease, TargetLeaseSpec, test_spec};
    use crate::store::memory::{ManualClock, MemoryStore};
    use crate::store::{
        AcquireRequest, Grant, LeaseStore, RenewOutcome, RenewRequest, RequestId, Slot, StoreError,
        Token,
    };
    use crate::time::ms_of;

    const T0: i64 = 1_800_000_000;

    pub(crate) fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(T0 + seconds).expect("time")
    }

    /// A TargetLease named `claim` with `spec` and `status`, generation 1.
    pub(crate) fn fixture(spec: TargetLeaseSpec, status: Option<TargetLeaseStatus>) -> TargetLease {
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

    /// Nothing known but the shortest TTL (6 s): no tenure kept, nothing measured.
    fn facts() -> Facts {
        Facts {
            holder: HolderFacts::default(),
            in_line_after: None,
            shortest_ttl: Duration::from_secs(6),
            kept: None,
        }
    }

    /// The tenure layer keeps `claim`'s status tenure, renewed, its last answer measured with
    /// the store's clock at `now`.
    fn facts_kept(claim: &Claim<'_>, now: Timestamp) -> Facts {
        let handle = claim.held_handle().expect("held");
        let mut view = view_of(claim, handle.token.get(), State::Renewed);
        view.server_now_ms = Some(ms_of(now));
        Facts {
            kept: Some(view),
            ..facts()
        }
    }

    pub(crate) fn held_since(seconds: i64, token: u64) -> TargetLeaseStatus {
        TargetLeaseStatus {
            phase: Phase::Held,
            owner: Some("w".into()),
            fencing_token: Some(token),
            acquired_at: Some(at(seconds)),
            expires_at: Some(at(seconds + 30)),
            ..TargetLeaseStatus::default()
        }
    }

    /// What the tenure layer keeps for `claim`: `token`, in `state`.
    fn view_of(claim: &Claim<'_>, token: u64, state: State) -> View {
        View {
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
            valid_for: Duration::from_secs(30),
            server_now_ms: Some(2_000),
        }
    }

    /// The view of a grant the store just answered for `claim` (as the tenure layer gives it).
    fn granted_view(claim: &Claim<'_>, answer: &AcquireOutcome) -> View {
        let AcquireOutcome::Acquired(grant) = answer else {
            panic!("{answer:?}");
        };
        View {
            handle: LeaseHandle {
                target: claim.target.clone(),
                permits: claim.permits,
                slot: grant.slot,
                lease_id: claim.lease_id.clone(),
                owner: claim.owner.clone(),
                token: Token::new(grant.token).expect("token"),
            },
            grant: grant.clone(),
            state: State::Renewed,
            valid_for: Duration::from_millis(grant.expires_in_ms),
            server_now_ms: Some(grant.server_time_ms),
        }
    }

    #[test]
    fn the_decision_table() {
        let spec = test_spec("t", "w");
        // New: acquire.
        let lease = fixture(spec.clone(), None);
        let claim = Claim::new(&lease).expect("claim");
        assert_eq!(plan(&claim, &facts()), Plan::Acquire);
        // Held: renew with the status's token.
        let lease = fixture(spec.clone(), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        match plan(&claim, &facts()) {
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
            plan(&claim, &facts()),
            Plan::GiveUp {
                reason: Reason::ReleaseRequested,
                ..
            }
        ));
        let lease = fixture(spec.clone(), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        let mut gone = facts();
        gone.holder.gone = Some("pod gone".into());
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
        let mut behind = facts();
        behind.in_line_after = Some(Behind {
            ahead: "older".into(),
            holder: "holder-0".into(),
            blocked: false,
        });
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
        match plan(&claim, &facts()) {
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
        assert!(matches!(plan(&claim, &facts()), Plan::Keep(_)));
    }

    #[test]
    fn max_hold_is_reached_by_the_clock_and_stays_spent() {
        let bounded = TargetLeaseSpec {
            max_hold_seconds: Some(60),
            ..test_spec("t", "w")
        };
        let lease = fixture(bounded.clone(), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        assert!(matches!(
            plan(&claim, &facts_kept(&claim, at(59))),
            Plan::Judge(_)
        ));
        assert!(matches!(
            plan(&claim, &facts_kept(&claim, at(60))),
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
            plan(&claim, &facts()),
            Plan::GiveUp {
                reason: Reason::MaxHoldReached,
                ..
            }
        ));
        // A new generation (the spec changed) is a new claim.
        let mut lease = fixture(bounded, Some(spent));
        lease.metadata.generation = Some(2);
        let claim = Claim::new(&lease).expect("claim");
        assert_eq!(plan(&claim, &facts()), Plan::Acquire);
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

    /// A claim that shows Held is known valid for as long as the tenure layer knows that very
    /// tenure valid, whatever its published expiry says; for another tenure, or none kept (a
    /// controller that just started), not at all, so a failing store makes it Lost with Held
    /// Unknown at once.
    #[test]
    fn validity_is_the_kept_tenures_not_the_published_expiry() {
        let status = held_since(0, 7);
        let lease = fixture(test_spec("t", "w"), Some(status.clone()));
        let claim = Claim::new(&lease).expect("claim");
        let mut view = view_of(&claim, 7, State::Renewed);
        view.valid_for = Duration::from_secs(11);
        assert_eq!(valid_for(&claim, Some(&view)), Duration::from_secs(11));
        // A published expiry an hour later (a forged status, or the wall clock of a controller
        // an hour behind) keeps nothing Held longer; an earlier one (refreshes held back for a
        // slow API server) does not shorten it.
        for shift in [
            SignedDuration::from_hours(1),
            SignedDuration::from_secs(-25),
        ] {
            let mut shifted = status.clone();
            shifted.expires_at = shifted.expires_at.map(|e| e + shift);
            let lease = fixture(test_spec("t", "w"), Some(shifted));
            let claim = Claim::new(&lease).expect("claim");
            assert_eq!(valid_for(&claim, Some(&view)), Duration::from_secs(11));
        }
        let other = view_of(&claim, 8, State::Renewed);
        assert_eq!(valid_for(&claim, Some(&other)), Duration::ZERO);
        assert_eq!(valid_for(&claim, None), Duration::ZERO);
        let failing = Observed::store_failed(
            Some(&status),
            &StoreError::Unavailable {
                endpoint: "x:1".into(),
                cause: "down".into(),
            },
            valid_for(&claim, None),
        );
        assert_eq!(failing.phase, Phase::Lost);
        assert!(failing.held_unknown);
    }

    /// A Held claim is judged by what the tenure layer heard, not renewed by the reconcile; a
    /// grant whose status write failed is published, never asked for again.
    #[test]
    fn kept_tenures_are_judged_and_never_granted_twice() {
        let lease = fixture(test_spec("t", "w"), Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        let with = |view: View| Facts {
            kept: Some(view),
            ..facts()
        };
        assert!(matches!(plan(&claim, &facts()), Plan::Keep(h) if h.token.get() == 7));
        let same = view_of(&claim, 7, State::Renewed);
        assert_eq!(plan(&claim, &with(same.clone())), Plan::Judge(same));
        let lost = view_of(&claim, 7, State::Lost(LossReason::Expired));
        assert_eq!(plan(&claim, &with(lost.clone())), Plan::Judge(lost.clone()));
        // A newer grant of this process: published.
        let newer = view_of(&claim, 9, State::Renewed);
        assert_eq!(
            plan(&claim, &with(newer.clone())),
            Plan::Publish(newer.clone())
        );
        // An older tenure than the status shows (another leader granted since): the status's.
        let older = view_of(&claim, 5, State::Renewed);
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
        let same = view_of(&claim, 7, State::Renewed);
        assert!(matches!(plan(&claim, &with(same)), Plan::GiveUp { .. }));
        // A tenure of a deleted object of the same name (another lease id) is not this claim's.
        let lease = fixture(test_spec("t", "w"), None);
        let claim = Claim::new(&lease).expect("claim");
        let mut stranger = view_of(&claim, 9, State::Renewed);
        stranger.handle.lease_id = crate::store::LeaseId::new("uid-other").expect("id");
        assert_eq!(plan(&claim, &with(stranger)), Plan::Acquire);
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
        let granted = kept_step(&claim, &granted_view(&claim, &answer)).observed;
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
        let granted = kept_step(&claim, &granted_view(&claim, &answer)).observed;
        let acquired = granted.acquired_at.expect("acquiredAt");
        assert_eq!(
            granted.expires_at,
            Some(acquired + SignedDuration::from_secs(120))
        );
    }

    /// A renewal publishes the tenure's start as the status shows it (an operator may have set
    /// it to bring the maxHoldSeconds bound forward): the bound counts from it.
    #[test]
    fn a_renewal_keeps_the_published_start() {
        let lease = fixture(test_spec("t", "w"), Some(held_since(-29, 7)));
        let claim = Claim::new(&lease).expect("claim");
        let view = view_of(&claim, 7, State::Renewed);
        let step = kept_step(&claim, &view);
        assert_eq!(step.observed.acquired_at, Some(at(-29)));
        assert!(step.event.is_none());
    }

    #[test]
    fn max_hold_waits_for_a_measured_clock() {
        let bounded = TargetLeaseSpec {
            max_hold_seconds: Some(60),
            ..test_spec("t", "w")
        };
        let lease = fixture(bounded, Some(held_since(0, 7)));
        let claim = Claim::new(&lease).expect("claim");
        // Nothing measured (a controller that just started): judged after the next renewal.
        assert!(matches!(plan(&claim, &facts()), Plan::Keep(_)));
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
        let step = kept_step(&claim, &granted_view(&claim, &answer));
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
            let Plan::Keep(handle) = plan(&claim, &facts()) else {
                panic!("a held claim renews");
            };
            let step = renewed(&store, &claim, &handle).await;
            assert_eq!(step.observed.phase, Phase::Held);
            assert!(step.event.is_none(), "a renewal publishes no Event");
            let expires = step.observed.expires_at.expect("expiresAt");
            assert!(expires > now + SignedDuration::from_secs(10), "{renewal}");
            let next = step.observed.into_status(Some(1), Some(&status), now);
            if crate::controller::status::priority(Some(&status), &next).is_some() {
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

    /// Renews `handle` in `store` and maps the answer as the tenure layer's view of it.
    async fn renewed(store: &MemoryStore, claim: &Claim<'_>, handle: &LeaseHandle) -> Step {
        let answer = store
            .renew(&RenewRequest {
                lease: handle.clone(),
                ttl: claim.lease_ttl,
                request_id: RequestId::random(),
            })
            .await
            .expect("renew");
        let (state, server_time_ms, expires_in_ms) = match answer {
            RenewOutcome::Renewed {
                server_time_ms,
                expires_in_ms,
            } => (State::Renewed, server_time_ms, expires_in_ms),
            RenewOutcome::Lost { reason } => (State::Lost(reason), 0, 0),
        };
        let view = View {
            handle: handle.clone(),
            grant: Grant {
                token: handle.token.get(),
                slot: handle.slot,
                acquired_at_ms: claim.status.and_then(|s| s.acquired_at).map_or(0, ms_of),
                server_time_ms,
                expires_in_ms,
            },
            state,
            valid_for: Duration::from_millis(expires_in_ms),
            server_now_ms: Some(server_time_ms),
        };
        kept_step(claim, &view)
    }

    fn clock_now(clock: &ManualClock) -> u64 {
        use crate::store::memory::Clock;
        clock.now_micros()
    }
}
