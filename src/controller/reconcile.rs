//! The reconciler: one watch event -> one decision -> at most one store call -> at most one
//! status write (only on a transition). Held leases are renewed by the renewal scheduler
//! ([`renewals`](super::renewals)), not here: a reconcile of a Held claim reads what the
//! scheduler last heard from the store and writes the status that follows from it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::finalizer::Event as Finalizer;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use super::budget::{Priority, is_overload};
use super::decide::{self, Facts, Measured, Plan, Reading};
use super::finalizer::finalizer;
use super::heartbeat::stale_after;
use super::holders::{Fate, fate_of};
use super::queue;
use super::renewals::{Standing, Start, State};
use super::status::{self, Observed};
use super::{Context, Error};
use crate::api::{FIELD_MANAGER, FINALIZER, HolderRef, Phase, Reason, TargetLease};
use crate::store::{
    AcquireOutcome, AcquireRequest, LeaseHandle, MAX_FLOOR_LEAD_MICROS, MAX_TOKEN, Owner,
    ReleaseOutcome, ReleaseRequest, RenewOutcome, RequestId, StoreError, Token,
};

/// What became of a status write.
enum Written {
    /// The API server wrote it; the TargetLease as it wrote it.
    Wrote(Box<TargetLease>),
    /// Nothing to write: the status says it already.
    Unchanged,
    /// Only `expiresAt` would move and the budget holds refreshes back: the renewal scheduler
    /// wakes the claim again at its next renewal, which tries again.
    Deferred,
}

/// The longest one reconcile may take. Its store calls are bounded by the Valkey call timeout,
/// but the Kubernetes client has no deadline of its own: a request to an API server that cannot
/// be reached (a partition) would otherwise hang the reconcile, and with it the shutdown of a
/// leader whose leadership lapsed.
const RECONCILE_LIMIT: Duration = Duration::from_secs(30);

/// Entry point called by the kube-runtime Controller.
pub async fn reconcile(lease: Arc<TargetLease>, ctx: Arc<Context>) -> Result<Action, Error> {
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

/// A claim being reconciled: the decisions' view of it ([`decide::Claim`]) and the API to write
/// its status with.
struct Claim<'a> {
    view: decide::Claim<'a>,
    api: Api<TargetLease>,
}

impl<'a> std::ops::Deref for Claim<'a> {
    type Target = decide::Claim<'a>;

    fn deref(&self) -> &Self::Target {
        &self.view
    }
}

impl<'a> Claim<'a> {
    fn new(lease: &'a TargetLease, ctx: &Context) -> Result<Self, Error> {
        let view = decide::Claim::new(lease)?;
        let api = Api::namespaced(ctx.client.clone(), view.target.namespace());
        Ok(Self { view, api })
    }

    /// Writes the status for `observed` if it says something new; publishes `event` with it.
    /// Tells the renewal scheduler the `expiresAt` it published.
    async fn settle(
        &self,
        ctx: &Context,
        observed: Observed,
        event: Option<(Reason, String)>,
    ) -> Result<Written, Error> {
        let written = write_status(ctx, &self.api, self.lease, observed).await?;
        let Written::Wrote(lease) = &written else {
            return Ok(written);
        };
        if let Some(status) = lease.status.as_ref().filter(|s| s.phase == Phase::Held)
            && let (Some(token), Some(expires)) = (status.fencing_token, status.expires_at)
        {
            let published = u64::try_from(expires.as_millisecond()).unwrap_or(0);
            ctx.renewals
                .published(&ObjectRef::from_obj(self.lease), token, published);
        }
        if let Some((reason, note)) = event {
            self.publish(ctx, reason, note).await;
        }
        Ok(written)
    }

    /// Publishes an Event, if the status budget has room for it (Events go last).
    async fn publish(&self, ctx: &Context, reason: Reason, note: String) {
        let Some(admitted) = ctx.budget.admit(Priority::Event, Instant::now()) else {
            ctx.metrics.shed("event");
            return;
        };
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
        let result = ctx
            .recorder
            .publish(&event, &self.lease.object_ref(&()))
            .await;
        admitted.done(
            Instant::now(),
            result.as_ref().err().is_some_and(is_overload),
        );
        if let Err(e) = result {
            warn!(error = %e, lease = %self.lease.name_any(), "could not publish event");
        }
    }

    /// Records a store failure in the status (once) and returns it as the reconcile's error.
    async fn fail(&self, ctx: &Context, error: StoreError) -> Error {
        self.record_failure(ctx, &error).await;
        Error::Store(error)
    }

    /// Records a store failure in the status (once); answers whether the status still says
    /// Held (it does until the lease's measured expiry, see `Observed::store_failed`).
    async fn record_failure(&self, ctx: &Context, error: &StoreError) -> bool {
        let valid_for = ctx.measurements.valid_for(self.lease, Instant::now());
        let observed = Observed::store_failed(self.status, error, valid_for);
        let held = observed.phase == Phase::Held;
        match self.settle(ctx, observed, None).await {
            Ok(_) => held,
            Err(e) => {
                warn!(error = %e, "could not record the store failure in the status");
                self.status.is_some_and(|s| s.phase == Phase::Held)
            }
        }
    }
}

/// Writes `observed` as the status of `lease` when it says something new and the status budget
/// admits it (a refresh of `expiresAt` may be put off; see [`budget`](super::budget)).
async fn write_status(
    ctx: &Context,
    api: &Api<TargetLease>,
    lease: &TargetLease,
    observed: Observed,
) -> Result<Written, Error> {
    let old = lease.status.as_ref();
    let new = observed.into_status(lease.metadata.generation, old, Timestamp::now());
    let Some(priority) = status::priority(old, &new) else {
        return Ok(Written::Unchanged);
    };
    let phase_changed = old.map(|s| s.phase) != Some(new.phase);
    ctx.leadership.check()?;
    let now = Instant::now();
    let Some(admitted) = ctx.budget.admit(priority, now) else {
        ctx.metrics.shed("refresh");
        return Ok(Written::Deferred);
    };
    // The resourceVersion the status was decided on is a precondition: a write based on a stale
    // read (a cut-off leader's late write, a cache behind) is refused with 409, not applied.
    let patch = json!({
        "apiVersion": TargetLease::api_version(&()),
        "kind": "TargetLease",
        "metadata": {"resourceVersion": lease.resource_version()},
        "status": new,
    });
    let result = api
        .patch_status(
            &lease.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await;
    admitted.done(
        Instant::now(),
        result.as_ref().err().is_some_and(is_overload),
    );
    let written = result?;
    let phase_name = format!("{:?}", new.phase);
    ctx.metrics
        .status_written(phase_changed.then_some(phase_name.as_str()));
    Ok(Written::Wrote(Box::new(written)))
}

/// A TargetLease the store cannot take (a target or namespace it refuses) gets a Failed status
/// that says why, rather than no status at all.
async fn refuse_claim(lease: &TargetLease, ctx: &Context, error: StoreError) -> Error {
    if let Some(ns) = lease.namespace() {
        let api: Api<TargetLease> = Api::namespaced(ctx.client.clone(), &ns);
        // Nothing was measured of a claim the store cannot even take.
        let observed = Observed::store_failed(lease.status.as_ref(), &error, Duration::ZERO);
        if let Err(e) = write_status(ctx, &api, lease, observed).await {
            warn!(error = %e, lease = %lease.name_any(), "could not record the refusal in the status");
        }
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

/// What the controller knows of a holder pod.
#[derive(Debug, PartialEq)]
enum PodFate {
    /// Not tracked here, or alive.
    Kept,
    /// Gone, finished or another pod of that name.
    Done,
    /// It could not be read: nothing is known of it.
    Unreadable,
}

async fn holder_fate(lease: &TargetLease, holder: &HolderRef, ctx: &Context) -> PodFate {
    let ns = lease.namespace().unwrap_or_default();
    if !ctx.holder_pods.covers(&ns) {
        // Not tracked here (no right to read these pods): the heartbeat of `targetlease run`
        // and the garbage collection of TargetLeases owned by deleted pods still apply.
        return PodFate::Kept;
    }
    let uid = holder.uid.as_deref();
    let done = |fate: Option<Fate>| {
        if fate.is_none_or(|fate| fate == Fate::Done) {
            PodFate::Done
        } else {
            PodFate::Kept
        }
    };
    if let Some(fate) = ctx
        .holders
        .register(ObjectRef::from_obj(lease), &ns, &holder.name, uid)
    {
        return done(Some(fate));
    }
    // The watch has not seen the pod (yet): read it once.
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let pod = match pods.get_opt(&holder.name).await {
        Ok(pod) => pod,
        Err(e) => {
            // A failed read says nothing of the holder: the lease is kept (renewed) rather than
            // lost, and the status says the holder is not tracked (see `holder_unknown`).
            warn!(error = %e, lease = %lease.name_any(), pod = %holder.name, "could not read the holder pod");
            return PodFate::Unreadable;
        }
    };
    let fate = match &pod {
        Some(pod) => fate_of(pod),
        None => Fate::Done,
    };
    let pod_uid = pod.as_ref().and_then(|p| p.metadata.uid.clone());
    ctx.holders.record(&ns, &holder.name, fate, pod_uid);
    done(
        ctx.holders
            .register(ObjectRef::from_obj(lease), &ns, &holder.name, uid),
    )
}

/// What is known of the claim's holder: why it is gone, if it is (its pod is gone, finished or
/// another pod of the same name, or the heartbeat of its `targetlease run` has been `silent`
/// for half the TTL, see [`heartbeat`](super::heartbeat)), else why its fate is unknown, if it
/// is (its pod could not be read).
async fn holder_facts(
    claim: &Claim<'_>,
    ctx: &Context,
    silent: Option<Duration>,
) -> (Option<String>, Option<String>) {
    let lease = claim.lease;
    let mut unknown = None;
    if let Some(holder) = &lease.spec.holder_ref {
        match holder_fate(lease, holder, ctx).await {
            PodFate::Done => {
                let gone = format!(
                    "holder pod {} is gone, has finished or is another pod of that name",
                    holder.name
                );
                return (Some(gone), None);
            }
            PodFate::Unreadable => {
                unknown = Some(format!(
                    "holder pod {} could not be read (details in the controller's log): the \
                     lease is renewed, but the pod's end is not noticed until it can be read \
                     again; check the controller's rights to read pods in this namespace",
                    holder.name
                ));
            }
            PodFate::Kept => {}
        }
    }
    let limit = stale_after(claim.ttl());
    let gone = silent.filter(|s| *s >= limit).map(|s| {
        format!(
            "the heartbeat of targetlease run stopped {} s ago (limit {} ms, half the TTL)",
            s.as_secs(),
            limit.as_millis()
        )
    });
    (gone, unknown)
}

async fn apply(lease: &TargetLease, ctx: &Context) -> Result<Action, Error> {
    let claim = match Claim::new(lease, ctx) {
        Ok(claim) => claim,
        Err(Error::Store(e)) => return Err(refuse_claim(lease, ctx, e).await),
        Err(e) => return Err(e),
    };
    let key = ObjectRef::from_obj(lease);
    let silent = ctx.heartbeats.silent_for(lease, Instant::now());
    let (holder_gone, holder_unknown) = holder_facts(&claim, ctx, silent).await;
    let facts = Facts {
        kept: ctx.renewals.standing(&key),
        holder_gone,
        in_line_after: in_line_after(&claim, ctx),
        holder_unknown,
        shortest_ttl: ctx.shortest_ttl,
        server_now: ctx
            .measurements
            .of(lease)
            .map(|m| m.reading.latest_server_time(Instant::now())),
    };
    let unknown = facts.holder_unknown.as_deref();
    let plan = decide::plan(&claim, &facts);
    if facts.kept.is_some() && matches!(plan, Plan::Settle { .. } | Plan::Acquire) {
        // Kept for a tenure the status left (it went Lost or Unknown): renewed no more.
        ctx.renewals.stop(&key);
    }
    let next = match plan {
        Plan::GiveUp { reason, message } => return give_up(&claim, ctx, reason, message).await,
        Plan::Settle { observed, next } => {
            claim.settle(ctx, observed, None).await?;
            match next {
                Some(next) => next,
                None => return Ok(Action::await_change()),
            }
        }
        Plan::Keep(_) => {
            // The scheduler renews it at once and wakes this claim with the answer.
            ctx.renewals.keep_from_status(&claim);
            decide::renew_interval(claim.ttl())
        }
        Plan::Judge(standing) => judge(&claim, ctx, standing, &facts).await?,
        Plan::Publish(standing) => {
            // The permits it was granted under, whatever the spec says now.
            let permits = standing.handle.permits;
            let step =
                decide::after_acquire(&claim, permits, &AcquireOutcome::Acquired(standing.grant));
            let observed = step.observed.holder_unknown(unknown);
            claim.settle(ctx, observed, step.event).await?;
            step.next
        }
        Plan::Acquire => acquire(&claim, ctx, unknown).await?,
    };
    Ok(Action::requeue(decide::next_look(&claim, next, silent)))
}

/// The claim in line before this one on its target, and who holds the target, when this one
/// must wait its turn (see [`queue`]).
fn in_line_after(claim: &Claim<'_>, ctx: &Context) -> Option<(String, String)> {
    let on_target =
        ctx.targets
            .leases_on(&ctx.leases, claim.target.namespace(), claim.target.target());
    let ahead = queue::ahead_of(claim.lease, &on_target, |l| ctx.targets.seen_order(l))?;
    let holder = on_target
        .iter()
        .find(|l| l.status.as_ref().is_some_and(|s| s.phase == Phase::Held))
        .map_or_else(|| ahead.spec.holder.clone(), |l| l.spec.holder.clone());
    Some((ahead.name_any(), holder))
}

/// Writes what the renewal scheduler last heard of the tenure the status records; answers when
/// to look again.
async fn judge(
    claim: &Claim<'_>,
    ctx: &Context,
    standing: Standing,
    facts: &Facts,
) -> Result<Duration, Error> {
    let key = ObjectRef::from_obj(claim.lease);
    ctx.renewals.set_ttl(&key, claim.lease_ttl);
    let outcome = match standing.state {
        // The scheduler wakes this claim with its first answer.
        State::Unconfirmed => return Ok(decide::renew_interval(claim.ttl())),
        State::Failing(error) => {
            if !claim.record_failure(ctx, &error).await {
                // The status left Held: the tenure is claimed anew once the store answers.
                ctx.renewals.stop(&key);
            }
            return Err(Error::Store(error));
        }
        State::Renewed => RenewOutcome::Renewed {
            server_time_ms: standing.grant.server_time_ms,
            expires_in_ms: standing.grant.expires_in_ms,
        },
        State::Lost(reason) => RenewOutcome::Lost { reason },
    };
    let step = decide::after_renew(claim, &standing.handle, &outcome);
    let observed = step
        .observed
        .holder_unknown(facts.holder_unknown.as_deref());
    claim.settle(ctx, observed, step.event).await?;
    let next = match outcome {
        RenewOutcome::Lost { .. } => {
            // Written Lost: the next reconcile claims the target again.
            ctx.renewals.stop(&key);
            step.next
        }
        // The renewal may be up to an interval old: the maxHoldSeconds bound is counted from
        // the store's clock now.
        RenewOutcome::Renewed { .. } => facts
            .server_now
            .map_or(step.next, |now| decide::next_check_kept(claim, now)),
    };
    Ok(next)
}

/// The highest token any TargetLease status has shown for this target: the floor for the next
/// token, so tokens grow even if Valkey lost its data.
///
/// Statuses are written by whoever has `targetleases/status` rights: a value that no store can
/// have issued (above 2^53-1, which the CRD also refuses, or more than
/// [`MAX_FLOOR_LEAD_MICROS`] ahead of the store's clock, which the store refuses as a floor) is
/// ignored with a warning rather than allowed to refuse every acquire on the target. The store's
/// clock is the earliest it can read by the latest answer measured on the target (the
/// controller's wall clock is never used: one that runs ahead would let a forged token through);
/// when none was measured, the target is inspected once to read it. Ignoring a real token is
/// safe: the store starts a target without a fence above every token it issued.
async fn min_token(claim: &Claim<'_>, ctx: &Context) -> Result<u64, Error> {
    let on_target =
        ctx.targets
            .leases_on(&ctx.leases, claim.target.namespace(), claim.target.target());
    let tokens: Vec<u64> = on_target
        .iter()
        .filter_map(|other| other.status.as_ref().and_then(|s| s.fencing_token))
        .chain(claim.last_token())
        .collect();
    if tokens.is_empty() {
        return Ok(0);
    }
    let reading = match ctx.measurements.clock_of(&claim.target) {
        Some(reading) => reading,
        None => {
            let answer = store_call(ctx, "inspect", ctx.store.inspect(&claim.target)).await?;
            let reading = match &answer.result {
                Ok(seen) => answer.reading(seen.server_time_ms),
                Err(e) => return Err(claim.fail(ctx, e.clone()).await),
            };
            ctx.measurements.record_clock(&claim.target, reading);
            reading
        }
    };
    let clock_us = reading
        .earliest_server_ms(Instant::now())
        .saturating_mul(1000);
    let possible = MAX_TOKEN.min(clock_us.saturating_add(MAX_FLOOR_LEAD_MICROS));
    Ok(tokens
        .into_iter()
        .filter(|token| {
            let issued = *token <= possible;
            if !issued {
                warn!(target = %claim.target, token, "ignoring a status fencing token no store can have issued (above 2^53-1 or more than two hours ahead of the store's clock)");
            }
            issued
        })
        .max()
        .unwrap_or(0))
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
        Err(e) => return Err(claim.fail(ctx, e.clone()).await),
    };
    if let AcquireOutcome::Acquired(grant) = outcome {
        let reading = answer.reading(grant.server_time_ms);
        ctx.measurements.record(
            claim.lease,
            &claim.target,
            Measured::granted(grant, reading),
        );
        // Renewed from now on whatever becomes of the status write below: if it fails, the
        // next reconcile publishes this grant instead of asking for another.
        let handle = LeaseHandle {
            target: claim.target.clone(),
            permits: claim.permits,
            slot: grant.slot,
            lease_id: claim.lease_id.clone(),
            owner: claim.owner.clone(),
            token: Token::new(grant.token)?,
        };
        ctx.renewals.keep(
            &ObjectRef::from_obj(claim.lease),
            handle,
            claim.lease_ttl,
            None,
            Start::Granted {
                grant: grant.clone(),
                reading,
            },
        );
        // Every other claim on the target that this process renews is renewed now, whatever
        // becomes of the status write: one that still says Held (after a data loss or an
        // outage) learns at that renewal that it lost, so at most one shows Held beyond it.
        renew_others_now(claim, ctx);
        info!(lease = %claim.lease.name_any(), target = %claim.target, token = grant.token, "acquired");
    }
    let step = decide::after_acquire(claim, request.permits, outcome);
    let handover = decide::is_handover(claim);
    let observed = step.observed.holder_unknown(holder_unknown);
    claim.settle(ctx, observed, step.event).await?;
    if matches!(outcome, AcquireOutcome::Acquired(_)) {
        if handover {
            ctx.metrics.handover();
        }
        // Then every other claim on the target looks again (after the write, so that their
        // reconciles do not stand in the way of the grant's status on the API server).
        wake_others(claim, ctx, |_| true);
    }
    Ok(step.next)
}

/// Settles in Released and releases the lease (when this resource holds it).
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
) -> Result<Action, Error> {
    let handle = claim.held_handle();
    let observed = Observed::released(reason, message.clone(), claim.last_token());
    let key = ObjectRef::from_obj(claim.lease);
    if handle.is_none() {
        ctx.renewals.stop(&key);
        release_in_store(claim, ctx, None).await?;
        claim.settle(ctx, observed, None).await?;
        return Ok(Action::await_change());
    }
    let event = (
        Reason::Released,
        format!("released {}: {message}", claim.target),
    );
    let written = match claim.settle(ctx, observed, Some(event)).await? {
        Written::Wrote(lease) => Some(lease),
        _ => None,
    };
    // The status no longer says Held: the lease is renewed no more, then released.
    ctx.renewals.stop(&key);
    match written.as_deref().map(|w| Claim::new(w, ctx)).transpose()? {
        // Failures are recorded on the status just written.
        Some(released) => release_in_store(&released, ctx, handle).await?,
        None => release_in_store(claim, ctx, handle).await?,
    }
    Ok(Action::await_change())
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
    match store_call(ctx, "release", ctx.store.release(&request))
        .await?
        .result
    {
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

/// The other TargetLeases on the claim's target that `pick` selects.
fn others_on_target(
    claim: &Claim<'_>,
    ctx: &Context,
    pick: impl Fn(&TargetLease) -> bool,
) -> Vec<ObjectRef<TargetLease>> {
    let me = claim.lease.uid();
    ctx.targets
        .leases_on(&ctx.leases, claim.target.namespace(), claim.target.target())
        .into_iter()
        .filter(|other| other.uid() != me && pick(other))
        .map(|other| ObjectRef::from_obj(other.as_ref()))
        .collect()
}

/// Schedules a reconcile of every other TargetLease on the claim's target that `pick` selects.
fn wake_others(claim: &Claim<'_>, ctx: &Context, pick: impl Fn(&TargetLease) -> bool) {
    for other in others_on_target(claim, ctx, pick) {
        let _ = ctx.wake.send(other);
    }
}

/// Renews, at once, every other tenure on the claim's target that the renewal scheduler keeps.
fn renew_others_now(claim: &Claim<'_>, ctx: &Context) {
    for other in others_on_target(claim, ctx, |_| true) {
        ctx.renewals.renew_now(&other);
    }
}

async fn cleanup(lease: &TargetLease, ctx: &Context) -> Result<Action, Error> {
    let claim = Claim::new(lease, ctx)?;
    // As for any other release, a Held status is left before the store lets the lease go: the
    // finalizer is removed only after the release, and a status still saying Held meanwhile
    // would stand beside the next holder's. A store outage returns an error here: the finalizer
    // stays and the error policy retries with backoff, so no lease is forgotten.
    // A claim that never showed Held has no status to correct: only the store is asked.
    if claim.held_handle().is_some() {
        give_up(
            &claim,
            ctx,
            Reason::ReleaseRequested,
            "resource deleted".to_string(),
        )
        .await?;
    } else {
        ctx.renewals.stop(&ObjectRef::from_obj(lease));
        release_in_store(&claim, ctx, None).await?;
    }
    ctx.holders.unregister(&ObjectRef::from_obj(lease));
    ctx.heartbeats.forget(&ObjectRef::from_obj(lease));
    ctx.measurements.forget(&ObjectRef::from_obj(lease));
    let others =
        ctx.targets
            .leases_on(&ctx.leases, claim.target.namespace(), claim.target.target());
    if others.iter().all(|other| other.uid() == lease.uid()) {
        ctx.measurements.forget_target(&claim.target);
    }
    Ok(Action::await_change())
}
