//! The line of claims waiting for a target: the index of TargetLeases by target ([`index`]),
//! the order in which waiting claims ask the store ([`queue`]), the wake-ups that hand a
//! released target on at once, and the token floor of the next grant. Everything here reads
//! the controller's cache, which lags the API server by a watch event at most; the store, not
//! the line, decides who holds.

pub(crate) mod index;
pub(crate) mod queue;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio::sync::mpsc::UnboundedSender;
use tracing::warn;

use self::index::TargetIndex;
use super::claim::Claim;
use crate::api::heartbeat::heartbeats;
use crate::api::{Phase, TargetLease};
use crate::store::{MAX_FLOOR_LEAD_MICROS, MAX_TOKEN, TargetRef};

/// The claims on each target, in the controller's cache, and the channel that schedules their
/// reconciles. Cheap to clone; clones share.
#[derive(Clone)]
pub(crate) struct Line {
    leases: Store<TargetLease>,
    targets: TargetIndex,
    wake: UnboundedSender<ObjectRef<TargetLease>>,
    /// The claims (by uid) last seen occupying a permit whose freeing the line waits to be told
    /// about ([`queue::watched_permit`]), with their namespace and target.
    occupying: Arc<Mutex<HashMap<String, (String, String)>>>,
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
            occupying: Arc::default(),
        }
    }

    /// Applies one watch event, after the reflector applied it to the cache: the index follows,
    /// and a claim that stops occupying a watched permit (it left Held or Stopping, or it is
    /// gone) wakes the claims in line for it: by now the cache shows the permit free, so the
    /// claim whose turn it is asks.
    pub(crate) fn observe(&self, event: &watcher::Event<TargetLease>) {
        self.targets.observe(event, &self.leases);
        let freed: Vec<(String, String)> = {
            let mut occupying = self.occupying.lock().unwrap_or_else(|e| e.into_inner());
            match event {
                watcher::Event::Apply(lease) | watcher::Event::InitApply(lease) => {
                    let (Some(uid), Some(ns)) = (lease.uid(), lease.namespace()) else {
                        return;
                    };
                    if queue::occupies(lease) && queue::watched_permit(lease) {
                        occupying.insert(uid, (ns, lease.spec.target.clone()));
                        Vec::new()
                    } else {
                        occupying.remove(&uid).into_iter().collect()
                    }
                }
                watcher::Event::Delete(lease) => lease
                    .uid()
                    .and_then(|uid| occupying.remove(&uid))
                    .into_iter()
                    .collect(),
                // A relist: the claims it no longer lists were deleted while the watch was down.
                watcher::Event::InitDone => {
                    let listed: std::collections::HashSet<String> = self
                        .leases
                        .state()
                        .iter()
                        .filter_map(|lease| lease.uid())
                        .collect();
                    let gone: Vec<String> = occupying
                        .keys()
                        .filter(|uid| !listed.contains(*uid))
                        .cloned()
                        .collect();
                    gone.iter()
                        .filter_map(|uid| occupying.remove(uid))
                        .collect()
                }
                watcher::Event::Init => Vec::new(),
            }
        };
        for (namespace, target) in freed {
            for other in self.leases_on(&namespace, &target) {
                if queue::in_line(&other) {
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

    /// Why this claim must wait its turn (see [`queue`]), when it must; `kept` says which claims
    /// hold their target through this process whatever the cache shows yet.
    pub(crate) fn in_line_after(
        &self,
        claim: &Claim<'_>,
        kept: impl Fn(&TargetLease) -> bool,
    ) -> Option<Behind> {
        let on_target = self.on_target(claim);
        let ahead = queue::ahead_of(
            claim.lease,
            &on_target,
            |l| self.targets.seen_order(l),
            &kept,
        )?;
        if queue::blocks(&ahead) || (heartbeats(&ahead) && kept(&ahead)) {
            return Some(Behind {
                ahead: ahead.name_any(),
                holder: ahead.spec.holder.clone(),
                blocked: true,
            });
        }
        let holder = on_target
            .iter()
            .find(|l| l.status.as_ref().is_some_and(|s| s.phase == Phase::Held))
            .map_or_else(|| ahead.spec.holder.clone(), |l| l.spec.holder.clone());
        Some(Behind {
            ahead: ahead.name_any(),
            holder,
            blocked: false,
        })
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

    /// The slot the cached status of `key` names (0 for an exclusive lease), if it has a status.
    pub(crate) fn cached_slot(&self, key: &ObjectRef<TargetLease>) -> Option<u32> {
        let lease = self.leases.get(key)?;
        lease.status.as_ref().map(|s| s.slot.unwrap_or(0))
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

/// Why a claim waits its turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Behind {
    /// The claim before it: in line, or holding.
    pub(crate) ahead: String,
    /// Who holds the target.
    pub(crate) holder: String,
    /// Whether the claim before it holds a permit that only the controller frees (its holder
    /// acts on its status, or has not been confirmed stopped): nobody asks the store for it.
    pub(crate) blocked: bool,
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
    use kube::runtime::reflector::store::Writer;

    use super::*;
    use crate::api::heartbeat::HEARTBEAT_ANNOTATION;
    use crate::api::{TargetLeaseStatus, test_spec};

    fn lease(name: &str, phase: Option<Phase>, heartbeat: bool) -> TargetLease {
        let mut lease = TargetLease::new(name, test_spec("t", name));
        lease.metadata.namespace = Some("ns".into());
        lease.metadata.uid = Some(format!("uid-{name}"));
        lease.status = phase.map(|phase| TargetLeaseStatus {
            phase,
            ..TargetLeaseStatus::default()
        });
        if heartbeat {
            lease.metadata.annotations =
                Some([(HEARTBEAT_ANNOTATION.to_owned(), "1".to_owned())].into());
        }
        lease
    }

    /// The claims in line are woken when a holder they wait to hear of stops occupying its
    /// permit (it left Held, it is gone, a relist no longer lists it), once, and not at every
    /// heartbeat; the release of a plain exclusive holder wakes them itself.
    #[test]
    fn waiters_are_woken_when_a_watched_permit_frees_up() {
        let (tx, mut woken) = tokio::sync::mpsc::unbounded_channel();
        let mut writer = Writer::<TargetLease>::default();
        let line = Line::new(writer.as_reader(), tx);
        let mut apply = |event: watcher::Event<TargetLease>| {
            writer.apply_watcher_event(&event);
            line.observe(&event);
        };
        let mut wakes = || std::iter::from_fn(|| woken.try_recv().ok()).count();
        apply(watcher::Event::Apply(lease(
            "w",
            Some(Phase::Waiting),
            true,
        )));
        apply(watcher::Event::Apply(lease("h", Some(Phase::Held), true)));
        // Its heartbeats: no wake.
        apply(watcher::Event::Apply(lease("h", Some(Phase::Held), true)));
        assert_eq!(wakes(), 0);
        apply(watcher::Event::Apply(lease(
            "h",
            Some(Phase::Released),
            true,
        )));
        assert_eq!(wakes(), 1, "a freed permit wakes the waiter once");
        apply(watcher::Event::Apply(lease(
            "h",
            Some(Phase::Released),
            true,
        )));
        assert_eq!(wakes(), 0);
        // Deleted while Held.
        apply(watcher::Event::Apply(lease("h", Some(Phase::Held), true)));
        apply(watcher::Event::Delete(lease("h", Some(Phase::Held), true)));
        assert_eq!(wakes(), 1);
        // Gone from a relist.
        apply(watcher::Event::Apply(lease("h2", Some(Phase::Held), true)));
        apply(watcher::Event::Init);
        apply(watcher::Event::InitApply(lease(
            "w",
            Some(Phase::Waiting),
            true,
        )));
        apply(watcher::Event::InitDone);
        assert_eq!(wakes(), 1);
        // A plain exclusive holder is not watched: its release wakes the line itself.
        apply(watcher::Event::Apply(lease("p", Some(Phase::Held), false)));
        apply(watcher::Event::Apply(lease(
            "p",
            Some(Phase::Released),
            false,
        )));
        assert_eq!(wakes(), 0);
    }

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
