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
use tracing::{debug, info, warn};

use super::claim::Claim;
use super::context::Context;
use super::decide::{self, Facts, Plan, Step};
use super::finalizer::finalizer;
use super::holders::HolderFacts;
use super::status::{Observed, Written};
use super::tenure::clock::Reading;
use super::tenure::handover::{self, Handover};
use super::tenure::{State, View, renew_interval};
use super::{Error, line};
use crate::api::heartbeat::{heartbeats, stop_bound, stopped_token};
use crate::api::{ConditionType, FINALIZER, Phase, Reason, TargetLease};
use crate::store::{
    AcquireOutcome, AcquireRequest, LeaseHandle, Owner, ReleaseOutcome, ReleaseRequest, RequestId,
    StoreError, Token,
};
use crate::time::ms_of;

/// The longest one reconcile may take. Its store calls are bounded by the store's call timeout,
/// but the Kubernetes client has no deadline of its own: a request to an API server that cannot
/// be reached (a partition) would otherwise hang the reconcile, and with it the shutdown of a
/// leader whose leadership lapsed.
const RECONCILE_LIMIT: Duration = Duration::from_secs(30);

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
    let api: Api<TargetLease> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, lease, |event| async {
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

/// Writes the status `observed` describes when it says something new, with `event`; tells the
/// tenure layer the `expiresAt` a Held status published.
async fn settle(
    claim: &Claim<'_>,
    ctx: &Context,
    observed: Observed,
    event: Option<(Reason, String)>,
) -> Result<Written, Error> {
    let written = ctx.status.settle(claim.lease, observed, event).await?;
    if let Written::Wrote(lease) = &written
        && let Some(status) = lease.status.as_ref().filter(|s| s.phase == Phase::Held)
        && let (Some(token), Some(expires)) = (status.fencing_token, status.expires_at)
    {
        ctx.tenures
            .published(&ObjectRef::from_obj(claim.lease), token, ms_of(expires));
    }
    Ok(written)
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

/// Records a store failure in the status (once) and returns it as the reconcile's error.
async fn fail(claim: &Claim<'_>, ctx: &Context, error: StoreError) -> Error {
    record_failure(claim, ctx, &error).await;
    Error::Store(error)
}

/// Records a store failure in the status (once); answers whether the status still says Held (it
/// does while the lease is known valid, see `Observed::store_failed`).
async fn record_failure(claim: &Claim<'_>, ctx: &Context, error: &StoreError) -> bool {
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

/// The store's answer to one call, with when it was sent and answered on this process's
/// monotonic clock.
struct Answer<T> {
    result: Result<T, StoreError>,
    sent: Instant,
    answered: Instant,
}

impl<T> Answer<T> {
    /// The store's clock `server_ms` in this answer, placed on this process's clock.
    fn reading(&self, server_ms: u64) -> Reading {
        Reading {
            sent: self.sent,
            answered: self.answered,
            server_ms,
        }
    }
}

/// Makes one store call, if this replica may still act, and times it for the metrics. The outer
/// error is the refusal to act; the inner result is the store's answer.
async fn store_call<T>(
    ctx: &Context,
    op: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<Answer<T>, Error> {
    ctx.leadership.check()?;
    let sent = Instant::now();
    let result = call.await;
    let answered = Instant::now();
    let kind = result.as_ref().err().map(|e| e.kind().as_str());
    ctx.metrics.store_call(op, answered - sent, kind);
    Ok(Answer {
        result,
        sent,
        answered,
    })
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

/// What became of a claim whose tenure ends.
pub(super) enum Ended {
    /// The target is passed on (the lease released, waiters woken).
    Done,
    /// The holder is waited for (see [`handover`]), for this long at the most.
    Waiting(Duration),
}

impl Ended {
    /// The reconcile's answer for a claim that is not being deleted.
    fn action(self) -> Action {
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
fn until_handover(claim: &Claim<'_>, holder: &HolderFacts, since: Instant) -> Option<Duration> {
    let now = Instant::now();
    match handover::handover(&holder_of(claim, Some(holder), now), since, now) {
        Handover::Now => None,
        Handover::At(at) => Some(at.saturating_duration_since(now) + Duration::from_millis(20)),
    }
}

/// The status that ends a Held tenure (`observed`, Released or Lost): with the `Stopping` mark
/// when its holder must be waited for (the token of the ended tenure is answered then).
fn ending(
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
async fn give_up(
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
async fn pass_on(claim: &Claim<'_>, ctx: &Context, holder: &HolderFacts) -> Result<Ended, Error> {
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
    match kept {
        Some(view) => release_handle(claim, ctx, view.handle, true).await?,
        None => release_by_lease_id(claim, ctx).await?,
    }
    settle(claim, ctx, ended_status(claim), None).await?;
    ctx.tenures.handed_over(&key);
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
    let request = ReleaseRequest {
        lease: handle,
        request_id: RequestId::random(),
    };
    match store_call(ctx, "release", ctx.store.release(&request))
        .await?
        .result
    {
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

async fn cleanup(lease: &TargetLease, ctx: &Context) -> Result<Action, Error> {
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

#[cfg(test)]
mod tests;
