//! The reconciler, an orchestrator: one watch event -> the facts -> one decision ([`decide`])
//! -> at most one store call -> at most one status write (only on a transition). Held leases are
//! renewed by the tenure layer ([`tenure`](super::tenure)), not here: a reconcile of a Held claim
//! reads what the tenure layer last heard from the store and writes the status that follows.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::Action;
use kube::runtime::finalizer::Event as Finalizer;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tokio::time::Instant;
use tracing::{info, warn};

use self::calls::{settle, store_call};
use self::end::{
    cleanup, ending, fail, give_back, give_up, pass_on, record_failure, until_handover,
};
use super::claim::Claim;
use super::context::Context;
use super::decide::{self, Facts, Plan, Step};
use super::error::Error;
use super::finalizer::finalizer;
use super::holders::HolderFacts;
use super::installation::Standing;
use super::line;
use super::status::Observed;
use super::tenure::{State, View, renew_interval};
use crate::api::{FINALIZER, TargetLease};
use crate::store::{AcquireOutcome, AcquireRequest, LeaseHandle, RequestId, StoreError, Token};

/// The longest one reconcile may take. Its store calls are bounded by the store's call timeout,
/// but the Kubernetes client has no deadline of its own: a request to an API server that cannot
/// be reached (a partition) would otherwise hang the reconcile, and with it the shutdown of a
/// leader whose leadership lapsed.
const RECONCILE_LIMIT: Duration = Duration::from_secs(30);
// A deleted object's removed finalizer is remembered longer than a reconcile that took its copy
// before the object went can run (see `Removed`).
const _: () = assert!(RECONCILE_LIMIT.as_secs() < super::finalizer::KEPT_AFTER_GONE.as_secs());

/// When a claim whose grant was given back (another claim still holds that permit as far as
/// this process knows) asks again, unless the end of that tenure wakes it first.
const GIVEN_BACK_RETRY: Duration = Duration::from_secs(1);

/// Entry point called by the kube-runtime Controller.
pub(crate) async fn reconcile(lease: Arc<TargetLease>, ctx: Arc<Context>) -> Result<Action, Error> {
    let result = match tokio::time::timeout(RECONCILE_LIMIT, reconcile_once(lease, &ctx)).await {
        Ok(result) => result,
        Err(_) => Err(Error::TimedOut(RECONCILE_LIMIT)),
    };
    ctx.metrics
        .reconciled(result.as_ref().map_or_else(Error::metric_label, |_| "ok"));
    result
}

async fn reconcile_once(lease: Arc<TargetLease>, ctx: &Context) -> Result<Action, Error> {
    // A replica whose leadership lapsed does nothing, the finalizer patch included.
    ctx.leadership.check()?;
    let ns = lease
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    if let Standing::Theirs(owner) = ctx.installations.standing(&ns).await? {
        // Another installation acts here: nothing of this one touches the claim, its
        // finalizer included, but for one condition that says so.
        ctx.installations.warn_once(&ns, &owner);
        ctx.tenures.stop(&ObjectRef::from_obj(&*lease));
        ctx.status
            .report_conflict(&lease, ctx.installations.id(), &owner)
            .await;
        return Ok(Action::await_change());
    }
    let uid = lease.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let deleting = lease.metadata.deletion_timestamp.is_some();
    if deleting && ctx.removed.contains(&uid) {
        // Its cleanup is done and its finalizer gone: this is a copy of an object on its way
        // out, or already gone (a reconcile woken by another claim's grant can start on a copy
        // taken just before the watch said so: see `Removed`).
        return Ok(Action::await_change());
    }
    let api: Api<TargetLease> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, &ctx.removed, lease, |event| async {
        match event {
            Finalizer::Apply(lease) => apply(&lease, ctx).await,
            Finalizer::Cleanup(lease) => cleanup(&lease, ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

async fn apply(lease: &TargetLease, ctx: &Context) -> Result<Action, Error> {
    let claim = match Claim::new(lease) {
        Ok(claim) => claim,
        Err(Error::Store(e)) => return Err(refuse_claim(lease, ctx, e).await),
        Err(e) => return Err(e),
    };
    let key = ObjectRef::from_obj(lease);
    let holder = ctx.holders.facts(&claim).await;
    let kept = |other: &TargetLease| ctx.tenures.keeps(&ObjectRef::from_obj(other));
    let facts = Facts {
        in_line_after: ctx.line.in_line_after(&claim, kept),
        shortest_ttl: ctx.shortest_ttl,
        kept: ctx.tenures.view(&key),
        holder,
    };
    let unknown = facts.holder.unknown.as_deref();
    let plan = decide::plan(&claim, &facts);
    if facts.kept.is_some() && matches!(plan, Plan::Settle { .. } | Plan::Acquire) {
        // Kept for a tenure the status left (it went Lost or Unknown): renewed no more.
        ctx.tenures.stop(&key);
    }
    let next = match plan {
        Plan::GiveUp { reason, message } => {
            return Ok(give_up(&claim, ctx, reason, message, &facts.holder)
                .await?
                .action());
        }
        Plan::Stopping => return Ok(pass_on(&claim, ctx, &facts.holder).await?.action()),
        Plan::Settle { observed, next } => {
            settle(&claim, ctx, observed, None).await?;
            match next {
                Some(next) => next,
                None => return Ok(Action::await_change()),
            }
        }
        Plan::Keep(_) => {
            // The tenure layer renews it at once and wakes this claim with the answer.
            ctx.tenures.keep_from_status(&claim);
            renew_interval(claim.ttl())
        }
        Plan::Judge(view) => judge(&claim, ctx, view, &facts.holder).await?,
        Plan::Publish(view) => {
            write_step(&claim, ctx, decide::kept_step(&claim, &view), unknown).await?
        }
        Plan::Acquire => acquire(&claim, ctx, unknown).await?,
    };
    Ok(Action::requeue(decide::next_look(
        &claim,
        next,
        facts.holder.silent,
    )))
}

/// Writes a step's status (with the holder's unknown fate, when it is) and answers its next look.
async fn write_step(
    claim: &Claim<'_>,
    ctx: &Context,
    step: Step,
    holder_unknown: Option<&str>,
) -> Result<Duration, Error> {
    let observed = step.observed.holder_unknown(holder_unknown);
    settle(claim, ctx, observed, step.event).await?;
    Ok(step.next)
}

/// A TargetLease the store cannot take (a target or namespace it refuses) gets a Failed status
/// that says why, rather than no status at all.
async fn refuse_claim(lease: &TargetLease, ctx: &Context, error: StoreError) -> Error {
    // Nothing was measured of a claim the store cannot even take.
    let observed = Observed::store_failed(lease.status.as_ref(), &error, Duration::ZERO);
    if let Err(e) = ctx.status.write(lease, observed).await {
        warn!(error = %e, lease = %lease.name_any(), "could not record the refusal in the status");
    }
    Error::Store(error)
}

/// Writes what the tenure layer last heard of the tenure the status records; answers when to
/// look again.
async fn judge(
    claim: &Claim<'_>,
    ctx: &Context,
    view: View,
    holder: &HolderFacts,
) -> Result<Duration, Error> {
    let holder_unknown = holder.unknown.as_deref();
    let key = ObjectRef::from_obj(claim.lease);
    ctx.tenures.set_ttl(&key, claim.lease_ttl);
    match &view.state {
        // The tenure layer wakes this claim with its first answer.
        State::Unconfirmed => Ok(renew_interval(claim.ttl())),
        State::Failing(error) => {
            if !record_failure(claim, ctx, error).await {
                // The status left Held: the tenure is claimed anew once the store answers.
                ctx.tenures.stop(&key);
            }
            Err(Error::Store(error.clone()))
        }
        State::Renewed => {
            write_step(claim, ctx, decide::kept_step(claim, &view), holder_unknown).await
        }
        State::Lost(_) => {
            // The store says the tenure ended: its holder is waited for, like every other end.
            let step = decide::kept_step(claim, &view);
            let (observed, ending) = ending(claim, step.observed, Some(holder));
            settle(claim, ctx, observed, step.event).await?;
            ctx.tenures.stop(&key);
            match ending {
                Some(token) => {
                    let since = ctx.tenures.ended_since(&key, token, Instant::now());
                    Ok(until_handover(claim, holder, since).unwrap_or(step.next))
                }
                // Written Lost: the next reconcile claims the target again.
                None => Ok(step.next),
            }
        }
    }
}

/// The floor of the next token on the claim's target (see [`line::floor`]): the store's clock is
/// the earliest it can read by the latest answer measured on the target (the controller's wall
/// clock is never used: one that runs ahead would let a forged token through); when none was
/// measured, the target is inspected once to read it.
async fn min_token(claim: &Claim<'_>, ctx: &Context) -> Result<u64, Error> {
    let tokens = ctx.line.tokens_on_target(claim);
    if tokens.is_empty() {
        return Ok(0);
    }
    let clock_ms = match ctx.tenures.earliest_server_ms(&claim.target) {
        Some(clock_ms) => clock_ms,
        None => {
            let answer = store_call(ctx, "inspect", ctx.store.inspect(&claim.target)).await?;
            let reading = match &answer.result {
                Ok(seen) => answer.reading(seen.server_time_ms),
                Err(e) => return Err(fail(claim, ctx, e.clone()).await),
            };
            ctx.tenures.record_clock(&claim.target, reading);
            reading.earliest_server_ms(Instant::now())
        }
    };
    Ok(line::floor(&claim.target, &tokens, clock_ms))
}

/// Asks the store for the target (the claim's turn has come); answers when to look again.
/// `holder_unknown` says why the holder's fate is unknown, if it is.
async fn acquire(
    claim: &Claim<'_>,
    ctx: &Context,
    holder_unknown: Option<&str>,
) -> Result<Duration, Error> {
    let request = AcquireRequest {
        target: claim.target.clone(),
        lease_id: claim.lease_id.clone(),
        owner: claim.owner.clone(),
        permits: claim.permits,
        ttl: claim.lease_ttl,
        min_token: min_token(claim, ctx).await?,
        request_id: RequestId::random(),
    };
    let answer = store_call(ctx, "acquire", ctx.store.acquire(&request)).await?;
    let outcome = match &answer.result {
        Ok(outcome) => outcome,
        Err(e) => return Err(fail(claim, ctx, e.clone()).await),
    };
    let step = match outcome {
        AcquireOutcome::Acquired(grant) => {
            let handle = LeaseHandle {
                target: claim.target.clone(),
                permits: claim.permits,
                slot: grant.slot,
                lease_id: claim.lease_id.clone(),
                owner: claim.owner.clone(),
                token: Token::new(grant.token)?,
            };
            let taken = ctx.tenures.slot_held_by_others(
                &ctx.line.others(claim, |_| true),
                grant.slot.get(),
                |key| ctx.line.cached_slot(key),
            );
            if !taken.is_empty() {
                // The store granted a permit this process still answers for: it lost that
                // tenure (a data loss, a failover to a replica that missed it, an outage longer
                // than the TTL) while its holder may still act on its Held status. The grant is
                // given back unpublished; the holder's renewal, now, says it lost, its tenure
                // ends through the hand-over rule, and this claim asks again.
                warn!(lease = %claim.lease.name_any(), target = %claim.target, slot = grant.slot.get(), "the store granted a permit another claim still holds as far as this controller knows (the store lost it?): given back until that tenure has ended");
                for other in &taken {
                    ctx.tenures.renew_now(other);
                }
                give_back(claim, ctx, handle).await?;
                return Ok(GIVEN_BACK_RETRY);
            }
            // Renewed from now on whatever becomes of the status write below: if it fails, the
            // next reconcile publishes this grant instead of asking for another.
            let key = ObjectRef::from_obj(claim.lease);
            let reading = answer.reading(grant.server_time_ms);
            let view = ctx
                .tenures
                .granted(&key, handle, claim.lease_ttl, grant, reading);
            // Every other claim on the target that this process keeps is renewed now, whatever
            // becomes of the status write: one that still says Held (after a data loss or an
            // outage) learns at that renewal that it lost, so at most one shows Held beyond it.
            for other in ctx.line.others(claim, |_| true) {
                ctx.tenures.renew_now(&other);
            }
            info!(lease = %claim.lease.name_any(), target = %claim.target, token = grant.token, "acquired");
            decide::kept_step(claim, &view)
        }
        refused => decide::refused_step(claim, refused).ok_or(Error::MissingField("a refusal"))?,
    };
    let acquired = matches!(outcome, AcquireOutcome::Acquired(_));
    let handover = claim.was_waiting();
    let next = write_step(claim, ctx, step, holder_unknown).await?;
    if acquired {
        if handover {
            ctx.metrics.handover();
        }
        // Then every other claim on the target looks again (after the write, so that their
        // reconciles do not stand in the way of the grant's status on the API server).
        ctx.line.wake_others(claim, |_| true);
    }
    Ok(next)
}

mod calls;
mod end;
#[cfg(test)]
mod tests;
