//! How a tenure ends: the hand-over rule ([`handover`]) applied to a claim (released, lost,
//! deleted), the `Stopping` status while its holder is waited for, the release in the store and
//! the wake of the claims in line. Every end of a tenure the reconciler sees comes through here.

use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::calls::{settle, store_call};
use crate::api::heartbeat::{heartbeats, stop_bound, stopped_token};
use crate::api::{ConditionType, Phase, Reason, TargetLease};
use crate::controller::claim::Claim;
use crate::controller::context::Context;
use crate::controller::decide;
use crate::controller::error::Error;
use crate::controller::holders::HolderFacts;
use crate::controller::status::{Observed, Written};
use crate::controller::tenure::handover::{self, Handover};
use crate::store::{
    LeaseHandle, Owner, ReleaseOutcome, ReleaseRequest, RequestId, StoreError, Token,
};

/// What became of a claim whose tenure ends.
pub(super) enum Ended {
    /// The target is passed on (the lease released, waiters woken).
    Done,
    /// The holder is waited for (see [`handover`]), for this long at the most.
    Waiting(Duration),
}

impl Ended {
    /// The reconcile's answer for a claim that is not being deleted.
    pub(super) fn action(self) -> Action {
        match self {
            Ended::Done => Action::await_change(),
            Ended::Waiting(wait) => Action::requeue(wait),
        }
    }
}

/// What the hand-over rule ([`handover`]) needs to know of `claim`'s holder at `now`; without
/// facts, nothing is known of its pod or of when its heartbeat last changed.
fn holder_of(claim: &Claim<'_>, facts: Option<&HolderFacts>, now: Instant) -> handover::Holder {
    let lease = claim.lease;
    let token = claim.last_token();
    handover::Holder {
        acts_on_status: heartbeats(lease),
        confirmed_stopped: token.is_some() && stopped_token(lease) == token,
        pod_gone: facts.is_some_and(|f| f.pod_gone),
        last_beat_seen: facts
            .and_then(|f| f.silent)
            .and_then(|silent| now.checked_sub(silent)),
        stop_bound: stop_bound(lease),
    }
}

/// How long from now until the target of `claim`'s tenure, ended at `since`, may pass on, if it
/// may not yet.
pub(super) fn until_handover(
    claim: &Claim<'_>,
    holder: &HolderFacts,
    since: Instant,
) -> Option<Duration> {
    let now = Instant::now();
    match handover::handover(&holder_of(claim, Some(holder), now), since, now) {
        Handover::Now => None,
        Handover::At(at) => Some(at.saturating_duration_since(now) + Duration::from_millis(20)),
    }
}

/// The status that ends a Held tenure (`observed`, Released or Lost): with the `Stopping` mark
/// when its holder must be waited for (the token of the ended tenure is answered then).
pub(super) fn ending(
    claim: &Claim<'_>,
    observed: Observed,
    holder: Option<&HolderFacts>,
) -> (Observed, Option<u64>) {
    let now = Instant::now();
    let known = holder_of(claim, holder, now);
    let rule = handover::handover(&known, now, now);
    debug!(lease = %claim.lease.name_any(), holder = ?known, ?rule, "the tenure ends");
    match rule {
        Handover::Now => (observed, None),
        Handover::At(at) => {
            let bound = at.saturating_duration_since(now);
            let until = format!(
                "at the latest {} ms after this status was written, when a targetlease run that \
                 never heard of the end has killed its command",
                bound.as_millis()
            );
            (observed.stopping(&until), claim.last_token())
        }
    }
}

/// Settles in Released and releases the lease (when this resource holds it), or, when its
/// holder acts on its Held status and must be waited for, writes Released with the `Stopping`
/// mark and keeps the lease (renewed) until the hand-over rule lets the target pass on.
///
/// A claim that shows Held leaves Held in its status before the store lets the lease go: the
/// status write carries the resourceVersion it was decided on, and when it is refused (409, the
/// object changed since it was read) nothing has been released yet, so a Held status never
/// stands beside a released lease (which a waiter could take while the holder's `run` still
/// trusts its Held). If the release then fails, the next reconcile releases by lease id. A
/// claim that does not show Held releases first, then settles, so a store that keeps failing
/// costs no status write per retry.
pub(super) async fn give_up(
    claim: &Claim<'_>,
    ctx: &Context,
    reason: Reason,
    message: String,
    holder: &HolderFacts,
) -> Result<Ended, Error> {
    let handle = claim.held_handle();
    let observed = Observed::released(reason, message.clone(), claim.last_token());
    let key = ObjectRef::from_obj(claim.lease);
    if handle.is_none() {
        ctx.tenures.stop(&key);
        release_in_store(claim, ctx, None).await?;
        settle(claim, ctx, observed, None).await?;
        return Ok(Ended::Done);
    }
    let event = (
        Reason::Released,
        format!("released {}: {message}", claim.target),
    );
    let (observed, waited_for) = ending(claim, observed, Some(holder));
    let written = match settle(claim, ctx, observed, Some(event)).await? {
        Written::Wrote(lease) => Some(lease),
        _ => None,
    };
    if let Some(token) = waited_for {
        // Kept (renewed) until the holder stopped: no other claim can take the target.
        let since = ctx.tenures.ended_since(&key, token, Instant::now());
        return Ok(match until_handover(claim, holder, since) {
            Some(wait) => Ended::Waiting(wait),
            None => Ended::Done,
        });
    }
    // The status no longer says Held: the lease is renewed no more, then released.
    ctx.tenures.stop(&key);
    match written.as_deref().map(Claim::new).transpose()? {
        // Failures are recorded on the status just written.
        Some(released) => release_in_store(&released, ctx, handle).await?,
        None => release_in_store(claim, ctx, handle).await?,
    }
    Ok(Ended::Done)
}

/// A claim whose status says its tenure ended with its holder not confirmed stopped: once the
/// hand-over rule allows it, releases what the claim holds in the store, writes the status
/// without the `Stopping` mark and wakes the claims in line.
pub(super) async fn pass_on(
    claim: &Claim<'_>,
    ctx: &Context,
    holder: &HolderFacts,
) -> Result<Ended, Error> {
    let key = ObjectRef::from_obj(claim.lease);
    let Some(token) = claim.last_token() else {
        return Err(Error::MissingField("status.fencingToken"));
    };
    let since = ctx.tenures.ended_since(&key, token, Instant::now());
    if let Some(wait) = until_handover(claim, holder, since) {
        return Ok(Ended::Waiting(wait));
    }
    let kept = ctx
        .tenures
        .view(&key)
        .filter(|v| v.handle.token.get() == token);
    ctx.tenures.stop(&key);
    // Before the release wakes the line: the claim whose turn it is must not find this tenure
    // still waited for (it would give its grant back).
    ctx.tenures.handed_over(&key);
    match kept {
        Some(view) => release_handle(claim, ctx, view.handle, true).await?,
        None => release_by_lease_id(claim, ctx).await?,
    }
    settle(claim, ctx, ended_status(claim), None).await?;
    info!(lease = %claim.lease.name_any(), target = %claim.target, token, "the holder stopped; the target passes on");
    Ok(Ended::Done)
}

/// The status of an ended tenure whose holder stopped: what the `Stopping` status said, without
/// the mark.
fn ended_status(claim: &Claim<'_>) -> Observed {
    let ready = claim.status.and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == ConditionType::Ready.as_str())
    });
    let reason = ready
        .and_then(|c| Reason::parse(&c.reason))
        .unwrap_or(Reason::Released);
    let message = ready
        .and_then(|c| c.message.split("; the target passes on once").next())
        .unwrap_or_default()
        .to_owned();
    let phase = claim.status.map(|s| s.phase);
    let mut observed = if phase == Some(Phase::Released) {
        Observed::released(reason, message, claim.last_token())
    } else {
        Observed::lost(reason, message, claim.last_token())
    };
    observed.held_unknown = false;
    observed
}

/// Releases `handle`, or whatever this resource holds in the store, and wakes the target's
/// waiters. Without a handle (the status does not say Held: a crash between acquire and the
/// status write), the store is asked whether this lease id holds the target, so nothing is left
/// behind. Failures are recorded on `claim`'s status.
async fn release_in_store(
    claim: &Claim<'_>,
    ctx: &Context,
    handle: Option<LeaseHandle>,
) -> Result<(), Error> {
    match handle {
        Some(handle) => release_handle(claim, ctx, handle, true).await,
        None => release_by_lease_id(claim, ctx).await,
    }
}

/// Asks the store what this lease id holds on the target and releases it.
async fn release_by_lease_id(claim: &Claim<'_>, ctx: &Context) -> Result<(), Error> {
    let handle = match store_call(ctx, "inspect", ctx.store.inspect(&claim.target))
        .await?
        .result
    {
        Ok(seen) => seen
            .holders()
            .find(|l| l.lease_id == claim.lease_id)
            .and_then(|l| {
                // What the store reports is what it validated when it granted the lease.
                Some(LeaseHandle {
                    target: claim.target.clone(),
                    permits: l.permits,
                    slot: l.slot,
                    lease_id: claim.lease_id.clone(),
                    owner: Owner::new(l.owner.clone()).ok()?,
                    token: Token::new(l.token).ok()?,
                })
            }),
        Err(e) => return Err(fail(claim, ctx, e).await),
    };
    let Some(handle) = handle else {
        ctx.line.wake_waiters(claim);
        return Ok(());
    };
    release_handle(claim, ctx, handle, false).await
}

/// Releases `handle`; `from_status` when it came from the status rather than the store.
async fn release_handle(
    claim: &Claim<'_>,
    ctx: &Context,
    handle: LeaseHandle,
    from_status: bool,
) -> Result<(), Error> {
    match release_call(ctx, handle).await? {
        Ok(ReleaseOutcome::Released) => {
            info!(lease = %claim.lease.name_any(), target = %claim.target, "released");
            ctx.line.wake_waiters(claim);
            Ok(())
        }
        Ok(ReleaseOutcome::NotHolder) if from_status => {
            // The status's token is stale (a re-entrant acquire gave this claim a new one, or a
            // status write was lost): ask the store what this lease id holds and release that,
            // rather than leave it held until its TTL runs out.
            debug!(lease = %claim.lease.name_any(), "the status's token no longer holds; asking the store by lease id");
            Box::pin(release_by_lease_id(claim, ctx)).await
        }
        Ok(ReleaseOutcome::NotHolder) => {
            debug!(lease = %claim.lease.name_any(), "nothing to release: the lease had expired or was taken");
            ctx.line.wake_waiters(claim);
            Ok(())
        }
        Err(e) => Err(fail(claim, ctx, e).await),
    }
}

/// Gives a grant back to the store unpublished (nobody was told of it, so nobody acts on it),
/// waking nobody: the permit is not free, the store only lost track of its holder.
pub(super) async fn give_back(
    claim: &Claim<'_>,
    ctx: &Context,
    handle: LeaseHandle,
) -> Result<(), Error> {
    match release_call(ctx, handle).await? {
        Ok(_) => Ok(()),
        Err(e) => Err(fail(claim, ctx, e).await),
    }
}

/// The store's `release` of `handle`, under a request id of its own.
async fn release_call(
    ctx: &Context,
    handle: LeaseHandle,
) -> Result<Result<ReleaseOutcome, StoreError>, Error> {
    let request = ReleaseRequest {
        lease: handle,
        request_id: RequestId::random(),
    };
    Ok(store_call(ctx, "release", ctx.store.release(&request))
        .await?
        .result)
}

pub(super) async fn cleanup(lease: &TargetLease, ctx: &Context) -> Result<Action, Error> {
    let claim = Claim::new(lease)?;
    let key = ObjectRef::from_obj(lease);
    let holder = ctx.holders.facts(&claim).await;
    // As for any other release, a Held status is left before the store lets the lease go: the
    // finalizer is removed only after the release, and a status still saying Held meanwhile
    // would stand beside the next holder's. A store outage returns an error here: the finalizer
    // stays and the error policy retries with backoff, so no lease is forgotten. A holder that
    // acts on its status is waited for (the finalizer stays meanwhile).
    // A claim that never showed Held has no status to correct: only the store is asked.
    let ended = if heartbeat_stopping(lease) {
        pass_on(&claim, ctx, &holder).await?
    } else if claim.held_handle().is_some() {
        give_up(
            &claim,
            ctx,
            Reason::ReleaseRequested,
            "resource deleted".to_string(),
            &holder,
        )
        .await?
    } else {
        ctx.tenures.stop(&key);
        release_in_store(&claim, ctx, None).await?;
        Ended::Done
    };
    if let Ended::Waiting(wait) = ended {
        return Err(Error::Stopping(wait));
    }
    ctx.holders.forget(&key);
    if ctx.line.alone_on_target(&claim) {
        ctx.tenures.forget_target(&claim.target);
    }
    Ok(Action::await_change())
}

/// Whether the status says the claim's tenure ended and its holder is waited for.
fn heartbeat_stopping(lease: &TargetLease) -> bool {
    crate::api::heartbeat::stopping(lease)
}

/// Records a store failure in the status (once) and returns it as the reconcile's error.
pub(super) async fn fail(claim: &Claim<'_>, ctx: &Context, error: StoreError) -> Error {
    record_failure(claim, ctx, &error).await;
    Error::Store(error)
}

/// Records a store failure in the status (once); answers whether the status still says Held (it
/// does while the lease is known valid, see `Observed::store_failed`).
pub(super) async fn record_failure(claim: &Claim<'_>, ctx: &Context, error: &StoreError) -> bool {
    let key = ObjectRef::from_obj(claim.lease);
    let kept = ctx.tenures.view(&key);
    let valid_for = decide::valid_for(claim, kept.as_ref());
    let observed = Observed::store_failed(claim.status, error, valid_for);
    let held = observed.phase == Phase::Held;
    // A Held status that leaves Held ends the tenure: its holder is waited for.
    let leaves_held = !held && claim.held_handle().is_some();
    let (observed, ending) = if leaves_held {
        ending(claim, observed, None)
    } else {
        (observed, None)
    };
    match settle(claim, ctx, observed, None).await {
        Ok(_) => {
            if let Some(token) = ending {
                ctx.tenures.ended_since(&key, token, Instant::now());
            }
            held
        }
        Err(e) => {
            warn!(error = %e, "could not record the store failure in the status");
            claim.status.is_some_and(|s| s.phase == Phase::Held)
        }
    }
}
