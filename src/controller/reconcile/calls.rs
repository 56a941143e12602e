//! The two kinds of call a reconcile makes, each in one place: one store call (only while this
//! replica may act, timed for the metrics, its answer placed on this process's clock) and one
//! status write (only when it says something new; a Held status tells the tenure layer the
//! `expiresAt` it published).

use std::future::Future;

use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use crate::api::{Phase, Reason};
use crate::controller::claim::Claim;
use crate::controller::context::Context;
use crate::controller::error::Error;
use crate::controller::status::{Observed, Written};
use crate::controller::tenure::clock::Reading;
use crate::store::StoreError;
use crate::time::ms_of;

/// Writes the status `observed` describes when it says something new, with `event`; tells the
/// tenure layer the `expiresAt` a Held status published.
pub(super) async fn settle(
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

/// The store's answer to one call, with when it was sent and answered on this process's
/// monotonic clock.
pub(super) struct Answer<T> {
    pub(super) result: Result<T, StoreError>,
    pub(super) sent: Instant,
    pub(super) answered: Instant,
}

impl<T> Answer<T> {
    /// The store's clock `server_ms` in this answer, placed on this process's clock.
    pub(super) fn reading(&self, server_ms: u64) -> Reading {
        Reading {
            sent: self.sent,
            answered: self.answered,
            server_ms,
        }
    }
}

/// Makes one store call, if this replica may still act, and times it for the metrics. The outer
/// error is the refusal to act; the inner result is the store's answer.
pub(super) async fn store_call<T>(
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
