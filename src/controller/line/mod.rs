//! The line of claims waiting for a target: the index of TargetLeases by target ([`index`]),
//! the order in which waiting claims ask the store ([`queue`]), the wake-ups that hand a
//! released target on at once, and the token floor of the next grant. Everything here reads
//! the controller's cache, which lags the API server by a watch event at most; the store, not
//! the line, decides who holds.

pub(crate) mod index;
pub(crate) mod queue;

use std::sync::Arc;

use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio::sync::mpsc::UnboundedSender;
use tracing::warn;

use self::index::TargetIndex;
use super::claim::Claim;
use crate::api::{Phase, TargetLease};
use crate::store::{MAX_FLOOR_LEAD_MICROS, MAX_TOKEN, TargetRef};

/// The claims on each target, in the controller's cache, and the channel that schedules their
/// reconciles. Cheap to clone; clones share.
#[derive(Clone)]
pub(crate) struct Line {
    leases: Store<TargetLease>,
    targets: TargetIndex,
    wake: UnboundedSender<ObjectRef<TargetLease>>,
}

impl Line {
    /// The line over the cache `leases`, waking claims through `wake`.
    pub(crate) fn new(
        leases: Store<TargetLease>,
        wake: UnboundedSender<ObjectRef<TargetLease>>,
    ) -> Self {
        Self {
            leases,
            targets: TargetIndex::default(),
            wake,
        }
    }

    /// Applies one watch event, after the reflector applied it to the cache: the index follows,
    /// and a claim that frees a permit wakes the claims in line for it.
    pub(crate) fn observe(&self, event: &watcher::Event<TargetLease>) {
        self.targets.observe(event, &self.leases);
        let (lease, deleted) = match event {
            watcher::Event::Apply(lease) => (lease, false),
            watcher::Event::Delete(lease) => (lease, true),
            _ => return,
        };
        // By now the cache shows the permit free, so the claim whose turn it is asks.
        if queue::frees_a_permit(lease, deleted)
            && let Some(namespace) = lease.metadata.namespace.as_deref()
        {
            let me = lease.uid();
            for other in self.leases_on(namespace, &lease.spec.target) {
                if queue::in_line(&other) && other.uid() != me {
                    let _ = self.wake.send(ObjectRef::from_obj(other.as_ref()));
                }
            }
        }
    }

    /// The TargetLeases on `target` in `namespace`.
    pub(crate) fn leases_on(&self, namespace: &str, target: &str) -> Vec<Arc<TargetLease>> {
        self.targets.leases_on(&self.leases, namespace, target)
    }

    /// The claims on `claim`'s target, itself included.
    fn on_target(&self, claim: &Claim<'_>) -> Vec<Arc<TargetLease>> {
        self.leases_on(claim.target.namespace(), claim.target.target())
    }

    /// The claim in line before this one on its target, and who holds the target, when this one
    /// must wait its turn (see [`queue`]).
    pub(crate) fn in_line_after(&self, claim: &Claim<'_>) -> Option<(String, String)> {
        let on_target = self.on_target(claim);
        let ahead = queue::ahead_of(claim.lease, &on_target, |l| self.targets.seen_order(l))?;
        let holder = on_target
            .iter()
            .find(|l| l.status.as_ref().is_some_and(|s| s.phase == Phase::Held))
            .map_or_else(|| ahead.spec.holder.clone(), |l| l.spec.holder.clone());
        Some((ahead.name_any(), holder))
    }

    /// Every fencing token a status on `claim`'s target shows (the claim's own last one
    /// included): the candidates for the floor of its next grant (see [`floor`]).
    pub(crate) fn tokens_on_target(&self, claim: &Claim<'_>) -> Vec<u64> {
        self.on_target(claim)
            .iter()
            .filter_map(|other| other.status.as_ref().and_then(|s| s.fencing_token))
            .chain(claim.last_token())
            .collect()
    }

    /// Whether no TargetLease but `claim` names its target any more.
    pub(crate) fn alone_on_target(&self, claim: &Claim<'_>) -> bool {
        let me = claim.lease.uid();
        self.on_target(claim).iter().all(|other| other.uid() == me)
    }

    /// The other claims on `claim`'s target that `pick` selects.
    pub(crate) fn others(
        &self,
        claim: &Claim<'_>,
        pick: impl Fn(&TargetLease) -> bool,
    ) -> Vec<ObjectRef<TargetLease>> {
        let me = claim.lease.uid();
        self.on_target(claim)
            .into_iter()
            .filter(|other| other.uid() != me && pick(other))
            .map(|other| ObjectRef::from_obj(other.as_ref()))
            .collect()
    }

    /// Schedules a reconcile of every other claim on `claim`'s target that `pick` selects.
    pub(crate) fn wake_others(&self, claim: &Claim<'_>, pick: impl Fn(&TargetLease) -> bool) {
        for other in self.others(claim, pick) {
            let _ = self.wake.send(other);
        }
    }

    /// Hand-over is event-driven: every claim in line for `claim`'s target is reconciled now
    /// rather than at its next requeue (the next in line takes it).
    pub(crate) fn wake_waiters(&self, claim: &Claim<'_>) {
        self.wake_others(claim, queue::in_line);
    }
}

/// The floor of the next token on `target`: the highest of `tokens` (what statuses on the
/// target have shown) that a store can have issued, given the earliest the store's clock can
/// read now (`clock_ms`), so that tokens grow even if the store lost its data.
///
/// Statuses are written by whoever has `targetleases/status` rights: a value that no store can
/// have issued (above 2^53-1, which the CRD also refuses, or more than
/// [`MAX_FLOOR_LEAD_MICROS`] ahead of the store's clock, which the store refuses as a floor) is
/// ignored with a warning rather than allowed to refuse every acquire on the target. Ignoring a
/// real token is safe: the store starts a target without a fence above every token it issued.
pub(crate) fn floor(target: &TargetRef, tokens: &[u64], clock_ms: u64) -> u64 {
    let possible = MAX_TOKEN.min(
        clock_ms
            .saturating_mul(1000)
            .saturating_add(MAX_FLOOR_LEAD_MICROS),
    );
    tokens
        .iter()
        .copied()
        .filter(|token| {
            let issued = *token <= possible;
            if !issued {
                warn!(%target, token, "ignoring a status fencing token no store can have issued (above 2^53-1 or more than two hours ahead of the store's clock)");
            }
            issued
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_ignores_tokens_no_store_can_have_issued() {
        let target = TargetRef::new("ns", "t").expect("target");
        let clock_ms = 1_800_000_000_000;
        let real = clock_ms * 1000 + 3_600_000_000;
        let forged = clock_ms * 1000 + MAX_FLOOR_LEAD_MICROS + 1;
        assert_eq!(floor(&target, &[7, real], clock_ms), real);
        assert_eq!(floor(&target, &[7, forged], clock_ms), 7);
        assert_eq!(floor(&target, &[MAX_TOKEN + 1], u64::MAX), 0);
        assert_eq!(floor(&target, &[], clock_ms), 0);
    }
}
