//! The reconciler: one watch event -> one decision -> at most one store call -> at most one
//! status write (only on a transition).

use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use super::heartbeat::stale_after;
use super::holders::{Fate, fate_of};
use super::queue;
use super::status::{Observed, is_transition, published_expiry};
use super::{Context, Error};
use crate::api::{
    FIELD_MANAGER, FINALIZER, HolderRef, Phase, Reason, TargetLease, TargetLeaseStatus,
};
use crate::store::{
    AcquireOutcome, AcquireRequest, LeaseHandle, LeaseId, LossReason, MAX_TOKEN,
    MAX_TOKEN_LEAD_MICROS, ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, RequestId,
    StoreError, TargetRef,
};

/// Entry point called by the kube-runtime Controller.
pub async fn reconcile(lease: Arc<TargetLease>, ctx: Arc<Context>) -> Result<Action, Error> {
    // A replica whose leadership lapsed does nothing, the finalizer patch included.
    ctx.leadership.check()?;
    let ns = lease
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<TargetLease> = Api::namespaced(ctx.client.clone(), &ns);
    let result = finalizer(&api, FINALIZER, lease, |event| async {
        match event {
            Finalizer::Apply(lease) => apply(&lease, &ctx).await,
            Finalizer::Cleanup(lease) => cleanup(&lease, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    ctx.metrics
        .reconciled(result.as_ref().map_or_else(Error::metric_label, |_| "ok"));
    result
}

/// Everything a reconcile needs to know about one TargetLease, resolved once.
struct Claim<'a> {
    lease: &'a TargetLease,
    api: Api<TargetLease>,
    target: TargetRef,
    lease_id: LeaseId,
    status: Option<&'a TargetLeaseStatus>,
}

impl<'a> Claim<'a> {
    fn new(lease: &'a TargetLease, ctx: &Context) -> Result<Self, Error> {
        let ns = lease
            .namespace()
            .ok_or(Error::MissingField("metadata.namespace"))?;
        let uid = lease.uid().ok_or(Error::MissingField("metadata.uid"))?;
        Ok(Self {
            lease,
            api: Api::namespaced(ctx.client.clone(), &ns),
            target: TargetRef::new(&ns, &lease.spec.target)?,
            lease_id: LeaseId::new(uid)?,
            status: lease.status.as_ref(),
        })
    }

    fn holder(&self) -> &str {
        &self.lease.spec.holder
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs(u64::from(self.lease.spec.ttl_seconds.max(1)))
    }

    /// The handle of the tenure the status records, if it says Held.
    fn held_handle(&self) -> Option<LeaseHandle> {
        let status = self.status?;
        if status.phase != Phase::Held {
            return None;
        }
        Some(LeaseHandle {
            target: self.target.clone(),
            lease_id: self.lease_id.clone(),
            owner: self.holder().to_owned(),
            token: status.fencing_token?,
        })
    }

    fn last_token(&self) -> Option<u64> {
        self.status.and_then(|s| s.fencing_token)
    }

    /// Writes the status for `observed` if it is a transition; publishes `event` with it.
    async fn settle(
        &self,
        ctx: &Context,
        observed: Observed,
        event: Option<(Reason, String)>,
    ) -> Result<(), Error> {
        if !write_status(ctx, &self.api, self.lease, observed).await? {
            return Ok(());
        }
        if let Some((reason, note)) = event {
            self.publish(ctx, reason, note).await;
        }
        Ok(())
    }

    async fn publish(&self, ctx: &Context, reason: Reason, note: String) {
        let type_ = if matches!(reason, Reason::Lost | Reason::Expired) {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let event = KubeEvent {
            type_,
            reason: reason.as_str().to_owned(),
            note: Some(note),
            action: reason.as_str().to_owned(),
            secondary: None,
        };
        if let Err(e) = ctx
            .recorder
            .publish(&event, &self.lease.object_ref(&()))
            .await
        {
            warn!(error = %e, lease = %self.lease.name_any(), "could not publish event");
        }
    }

    /// Records a store failure in the status (once) and returns it as the reconcile's error.
    async fn fail(&self, ctx: &Context, error: StoreError) -> Error {
        let observed = Observed::store_failed(self.status, &error, Timestamp::now());
        if let Err(e) = self.settle(ctx, observed, None).await {
            warn!(error = %e, "could not record the store failure in the status");
        }
        Error::Store(error)
    }
}

/// Writes `observed` as the status of `lease` when it is a transition; answers whether it wrote.
async fn write_status(
    ctx: &Context,
    api: &Api<TargetLease>,
    lease: &TargetLease,
    observed: Observed,
) -> Result<bool, Error> {
    let old = lease.status.as_ref();
    let new = observed.into_status(lease.metadata.generation, old, Timestamp::now());
    if !is_transition(old, &new) {
        return Ok(false);
    }
    let phase_changed = old.map(|s| s.phase) != Some(new.phase);
    ctx.leadership.check()?;
    // The resourceVersion the status was decided on is a precondition: a write based on a stale
    // read (a cut-off leader's late write, a cache behind) is refused with 409, not applied.
    let patch = json!({
        "apiVersion": "targetlease.dev/v1alpha1",
        "kind": "TargetLease",
        "metadata": {"resourceVersion": lease.resource_version()},
        "status": new,
    });
    api.patch_status(
        &lease.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    let phase_name = format!("{:?}", new.phase);
    ctx.metrics
        .status_written(phase_changed.then_some(phase_name.as_str()));
    Ok(true)
}

/// A TargetLease the store cannot take (a target or namespace it refuses) gets a Failed status
/// that says why, rather than no status at all.
async fn refuse_claim(lease: &TargetLease, ctx: &Context, error: StoreError) -> Error {
    if let Some(ns) = lease.namespace() {
        let api: Api<TargetLease> = Api::namespaced(ctx.client.clone(), &ns);
        let observed = Observed::store_failed(lease.status.as_ref(), &error, Timestamp::now());
        if let Err(e) = write_status(ctx, &api, lease, observed).await {
            warn!(error = %e, lease = %lease.name_any(), "could not record the refusal in the status");
        }
    }
    Error::Store(error)
}

/// Makes one store call, if this replica may still act, and times it for the metrics. The outer
/// error is the refusal to act; the inner result is the store's answer.
async fn store_call<T>(
    ctx: &Context,
    op: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<Result<T, StoreError>, Error> {
    ctx.leadership.check()?;
    let start = Instant::now();
    let result = call.await;
    let kind = result.as_ref().err().map(|e| e.kind().as_str());
    ctx.metrics.store_call(op, start.elapsed(), kind);
    Ok(result)
}

/// Why a lease must be given up, if it must. `holder_gone` says why the holder is gone, if it is.
fn release_reason(claim: &Claim<'_>, holder_gone: Option<String>) -> Option<(Reason, String)> {
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
    // A spent claim stays released until its spec changes: otherwise the same TargetLease would
    // take the target again at once and the bound would bound nothing. The mark is a status field
    // of its own, kept through store failures (which rewrite the conditions) and restarts.
    let spent = status.max_hold_spent_generation.is_some()
        && status.max_hold_spent_generation == claim.lease.metadata.generation;
    if spent {
        return Some((
            Reason::MaxHoldReached,
            format!("held for {max} s, the maxHoldSeconds bound"),
        ));
    }
    let acquired = status.acquired_at.filter(|_| status.phase == Phase::Held)?;
    let held_for = Timestamp::now().duration_since(acquired);
    (held_for.as_secs() >= i64::from(max)).then(|| {
        (
            Reason::MaxHoldReached,
            format!("held for {max} s, the maxHoldSeconds bound"),
        )
    })
}

async fn holder_done(
    lease: &TargetLease,
    holder: &HolderRef,
    ctx: &Context,
) -> Result<bool, Error> {
    let ns = lease.namespace().unwrap_or_default();
    let uid = holder.uid.as_deref();
    if let Some(fate) = ctx
        .holders
        .register(ObjectRef::from_obj(lease), &ns, &holder.name, uid)
    {
        return Ok(fate == Fate::Done);
    }
    // The watch has not seen the pod (yet): read it once.
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let pod = pods.get_opt(&holder.name).await?;
    let fate = match &pod {
        Some(pod) => fate_of(pod),
        None => Fate::Done,
    };
    let pod_uid = pod.as_ref().and_then(|p| p.metadata.uid.clone());
    ctx.holders.record(&ns, &holder.name, fate, pod_uid);
    Ok(ctx
        .holders
        .register(ObjectRef::from_obj(lease), &ns, &holder.name, uid)
        .is_none_or(|fate| fate == Fate::Done))
}

/// Why the holder is gone, if it is: its pod is gone, finished or another pod of the same name,
/// or the heartbeat of its `targetlease run` has been `silent` for half the TTL (see
/// [`heartbeat`](super::heartbeat)).
async fn holder_gone(
    claim: &Claim<'_>,
    ctx: &Context,
    silent: Option<Duration>,
) -> Result<Option<String>, Error> {
    let lease = claim.lease;
    if let Some(holder) = &lease.spec.holder_ref
        && holder_done(lease, holder, ctx).await?
    {
        return Ok(Some(format!(
            "holder pod {} is gone, has finished or is another pod of that name",
            holder.name
        )));
    }
    let limit = stale_after(claim.ttl());
    Ok(silent.filter(|s| *s >= limit).map(|s| {
        format!(
            "the heartbeat of targetlease run stopped {} s ago (limit {} ms, half the TTL)",
            s.as_secs(),
            limit.as_millis()
        )
    }))
}

async fn apply(lease: &TargetLease, ctx: &Context) -> Result<Action, Error> {
    let claim = match Claim::new(lease, ctx) {
        Ok(claim) => claim,
        Err(Error::Store(e)) => return Err(refuse_claim(lease, ctx, e).await),
        Err(e) => return Err(e),
    };
    let silent = ctx.heartbeats.silent_for(lease, Instant::now());
    let gone = holder_gone(&claim, ctx, silent).await?;
    if let Some((reason, message)) = release_reason(&claim, gone) {
        return give_up(&claim, ctx, reason, message).await;
    }
    let next = match claim.held_handle() {
        Some(handle) => renew(&claim, ctx, handle).await,
        None if claim.ttl() < ctx.shortest_ttl => {
            // A lease held already is kept (its workload runs); a new one is not taken.
            let message = format!(
                "ttlSeconds {} is shorter than {} s, the shortest TTL this controller can keep \
                 (three Valkey call timeouts, and with leader election the time a successor \
                 needs to take over and renew); raise spec.ttlSeconds",
                claim.ttl().as_secs(),
                ctx.shortest_ttl.as_secs()
            );
            let observed = Observed::refused(Reason::TtlTooShort, message, claim.last_token());
            claim.settle(ctx, observed, None).await?;
            return Ok(Action::await_change());
        }
        None => acquire(&claim, ctx).await,
    }?;
    // A claim with a heartbeat is looked at again when it would go stale, so a crashed run's
    // lease is released within half a TTL of its last heartbeat.
    let next = match silent {
        Some(silent) => {
            let left = stale_after(claim.ttl()).saturating_sub(silent) + Duration::from_millis(20);
            next.min(left)
        }
        None => next,
    };
    Ok(Action::requeue(next))
}

/// The renewal interval: a third of the TTL, so two renewals can fail before the lease expires.
fn renew_interval(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(300))
}

/// When to look at a held lease again: the next renewal, or the `maxHoldSeconds` bound if that
/// comes first.
fn next_check(claim: &Claim<'_>) -> Duration {
    let renew = renew_interval(claim.ttl());
    let acquired = claim.status.and_then(|s| s.acquired_at);
    match (claim.lease.spec.max_hold_seconds, acquired) {
        (Some(max), Some(acquired)) => {
            let held_ms = Timestamp::now().duration_since(acquired).as_millis().max(0);
            let left_ms = (i128::from(max) * 1000 - held_ms).max(0);
            renew.min(Duration::from_millis(
                u64::try_from(left_ms).unwrap_or(u64::MAX),
            ))
        }
        _ => renew,
    }
}

/// Renews the lease; answers when to look at the claim again.
async fn renew(claim: &Claim<'_>, ctx: &Context, handle: LeaseHandle) -> Result<Duration, Error> {
    let request = RenewRequest {
        lease: handle,
        ttl: claim.ttl(),
        request_id: RequestId::random(),
    };
    match store_call(ctx, "renew", ctx.store.renew(&request)).await? {
        Ok(RenewOutcome::Renewed {
            server_time_ms,
            expires_in_ms,
        }) => {
            // Renewals live in Valkey; the status is written when something else changed (a new
            // generation, recovery from a failure) or when the published expiry must move
            // forward to stay in the future (every second renewal).
            let grant = crate::store::Grant {
                token: request.lease.token,
                acquired_at_ms: claim
                    .status
                    .and_then(|s| s.acquired_at)
                    .map_or(server_time_ms, |t| t.as_millisecond().max(0) as u64),
                server_time_ms,
                expires_in_ms,
            };
            let mut observed = Observed::held(&grant, claim.holder());
            observed.expires_at = published_expiry(
                claim.status.and_then(|s| s.expires_at),
                observed.expires_at,
                Timestamp::from_millisecond(i64::try_from(server_time_ms).unwrap_or(i64::MAX))
                    .unwrap_or_else(|_| Timestamp::now()),
                renew_interval(claim.ttl()),
            );
            claim.settle(ctx, observed, None).await?;
            Ok(next_check(claim))
        }
        Ok(RenewOutcome::Lost { reason }) => {
            let (reason, message) = match reason {
                LossReason::Expired => (Reason::Expired, "the lease expired before it was renewed"),
                LossReason::NotHolder => (Reason::Lost, "another claim holds the target"),
            };
            info!(lease = %claim.lease.name_any(), target = %claim.target, %reason, "lease lost");
            let observed = Observed::lost(reason, message.to_owned(), claim.last_token());
            claim
                .settle(ctx, observed, Some((reason, message.to_owned())))
                .await?;
            // Try again at once: a new tenure can only get a larger token.
            Ok(Duration::from_millis(100))
        }
        Err(e) => Err(claim.fail(ctx, e).await),
    }
}

/// The highest token any TargetLease status has shown for this target: the floor for the next
/// token, so tokens grow even if Valkey lost its data.
///
/// Statuses are written by whoever has `targetleases/status` rights: a value that no store can
/// have issued (above 2^53-1, which the CRD also refuses, or more than
/// [`MAX_TOKEN_LEAD_MICROS`] ahead of the clock, which the store refuses as a floor) is ignored
/// with a warning rather than allowed to refuse every acquire on the target. Ignoring a real
/// token is safe: the store starts a target without a fence above every token it issued.
fn min_token(claim: &Claim<'_>, ctx: &Context) -> u64 {
    let now_us = u64::try_from(jiff::Timestamp::now().as_microsecond()).unwrap_or(0);
    let possible = MAX_TOKEN.min(now_us.saturating_add(MAX_TOKEN_LEAD_MICROS));
    ctx.targets
        .leases_on(&ctx.leases, claim.target.namespace(), claim.target.target())
        .iter()
        .filter_map(|other| other.status.as_ref().and_then(|s| s.fencing_token))
        .chain(claim.last_token())
        .filter(|token| {
            let issued = *token <= possible;
            if !issued {
                warn!(target = %claim.target, token, "ignoring a status fencing token no store can have issued (above 2^53-1 or more than an hour ahead of the clock)");
            }
            issued
        })
        .max()
        .unwrap_or(0)
}

/// Tries to take the target, in its turn; answers when to look at the claim again.
async fn acquire(claim: &Claim<'_>, ctx: &Context) -> Result<Duration, Error> {
    let on_target =
        ctx.targets
            .leases_on(&ctx.leases, claim.target.namespace(), claim.target.target());
    if let Some(ahead) = queue::ahead_of(claim.lease, &on_target) {
        // Not this claim's turn: it asks the store nothing. It is woken when the target is
        // released or a grant happens, and looks again at the renewal interval at the latest.
        let holder = on_target
            .iter()
            .find(|l| l.status.as_ref().is_some_and(|s| s.phase == Phase::Held))
            .map_or_else(|| ahead.spec.holder.clone(), |l| l.spec.holder.clone());
        let mut observed = Observed::waiting(&holder, claim.last_token());
        observed.message = format!(
            "target is held by {holder}; in line after {} (claims get the target in the order \
             they were created, higher spec.priority first)",
            ahead.name_any()
        );
        claim.settle(ctx, observed, None).await?;
        return Ok(renew_interval(claim.ttl()));
    }
    let request = AcquireRequest {
        target: claim.target.clone(),
        lease_id: claim.lease_id.clone(),
        owner: claim.holder().to_owned(),
        ttl: claim.ttl(),
        min_token: min_token(claim, ctx),
        request_id: RequestId::random(),
    };
    match store_call(ctx, "acquire", ctx.store.acquire(&request)).await? {
        Ok(AcquireOutcome::Acquired(grant)) => {
            let previous = claim.status.map(|s| s.phase);
            let note = format!(
                "acquired {} with fencing token {}",
                claim.target, grant.token
            );
            info!(lease = %claim.lease.name_any(), target = %claim.target, token = grant.token, "acquired");
            claim
                .settle(
                    ctx,
                    Observed::held(&grant, claim.holder()),
                    Some((Reason::Acquired, note)),
                )
                .await?;
            // A hand-over is a target passing to a claim that waited for it; a Lost claim taking
            // its target back is not one.
            if previous == Some(Phase::Waiting) {
                ctx.metrics.handover();
            }
            // Every other claim on the target looks again now, Held ones included: one that
            // still says Held (after a data loss or an outage) learns at its renewal that it
            // lost, so at most one shows Held beyond this reconcile.
            wake_others(claim, ctx, |_| true);
            Ok(renew_interval(claim.ttl()))
        }
        Ok(AcquireOutcome::Held {
            owner,
            expires_in_ms,
        }) => {
            let note = format!("{} is held by {owner}", claim.target);
            claim
                .settle(
                    ctx,
                    Observed::waiting(&owner, claim.last_token()),
                    Some((Reason::Waiting, note)),
                )
                .await?;
            // A release through this controller wakes waiters at once; this requeue covers a
            // holder that stopped renewing: try again when Valkey said the lease expires.
            Ok(Duration::from_millis(expires_in_ms) + Duration::from_millis(20))
        }
        Err(e) => Err(claim.fail(ctx, e).await),
    }
}

/// Releases the lease (when this resource holds it) and settles in Released.
async fn give_up(
    claim: &Claim<'_>,
    ctx: &Context,
    reason: Reason,
    message: String,
) -> Result<Action, Error> {
    let was_held = claim.held_handle().is_some();
    release_in_store(claim, ctx).await?;
    let event = was_held.then(|| {
        (
            Reason::Released,
            format!("released {}: {message}", claim.target),
        )
    });
    claim
        .settle(
            ctx,
            Observed::released(reason, message, claim.last_token()),
            event,
        )
        .await?;
    Ok(Action::await_change())
}

/// Releases whatever this resource holds in the store and wakes the target's waiters. When the
/// status does not say Held (a crash between acquire and the status write), the store is asked
/// whether this lease id holds the target, so nothing is left behind.
async fn release_in_store(claim: &Claim<'_>, ctx: &Context) -> Result<(), Error> {
    match claim.held_handle() {
        Some(handle) => release_handle(claim, ctx, handle, true).await,
        None => release_by_lease_id(claim, ctx).await,
    }
}

/// Asks the store what this lease id holds on the target and releases it.
async fn release_by_lease_id(claim: &Claim<'_>, ctx: &Context) -> Result<(), Error> {
    let handle = match store_call(ctx, "inspect", ctx.store.inspect(&claim.target)).await? {
        Ok(seen) => seen
            .lease
            .filter(|l| l.lease_id == claim.lease_id)
            .map(|l| LeaseHandle {
                target: claim.target.clone(),
                lease_id: claim.lease_id.clone(),
                owner: l.owner,
                token: l.token,
            }),
        Err(e) => return Err(claim.fail(ctx, e).await),
    };
    let Some(handle) = handle else {
        wake_waiters(claim, ctx);
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
    match store_call(ctx, "release", ctx.store.release(&request)).await? {
        Ok(ReleaseOutcome::Released) => {
            info!(lease = %claim.lease.name_any(), target = %claim.target, "released");
            wake_waiters(claim, ctx);
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
            wake_waiters(claim, ctx);
            Ok(())
        }
        Err(e) => Err(claim.fail(ctx, e).await),
    }
}

/// Hand-over is event-driven: every other TargetLease on the target that waits for it is
/// reconciled now rather than at its next requeue (the next in line takes it).
fn wake_waiters(claim: &Claim<'_>, ctx: &Context) {
    wake_others(claim, ctx, |other| {
        let status = other.status.as_ref();
        let waiting = status.is_none_or(|s| !matches!(s.phase, Phase::Held | Phase::Released));
        waiting && !other.spec.release
    });
}

/// Schedules a reconcile of every other TargetLease on the claim's target that `pick` selects.
fn wake_others(claim: &Claim<'_>, ctx: &Context, pick: impl Fn(&TargetLease) -> bool) {
    let me = claim.lease.uid();
    let on_target =
        ctx.targets
            .leases_on(&ctx.leases, claim.target.namespace(), claim.target.target());
    for other in on_target {
        if other.uid() != me && pick(&other) {
            let _ = ctx.wake.send(ObjectRef::from_obj(other.as_ref()));
        }
    }
}

async fn cleanup(lease: &TargetLease, ctx: &Context) -> Result<Action, Error> {
    let claim = Claim::new(lease, ctx)?;
    // A store outage returns an error here: the finalizer stays and the error policy retries
    // with backoff, so no lease is forgotten.
    release_in_store(&claim, ctx).await?;
    ctx.holders.unregister(&ObjectRef::from_obj(lease));
    ctx.heartbeats.forget(&ObjectRef::from_obj(lease));
    if claim.held_handle().is_some() {
        claim
            .publish(
                ctx,
                Reason::Released,
                format!("released {}: resource deleted", claim.target),
            )
            .await;
    }
    Ok(Action::await_change())
}
