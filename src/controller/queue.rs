//! Fair hand-over: the claims waiting for a target get it in the order they were created, unless
//! `spec.priority` puts one ahead (higher first). `creationTimestamp` has a resolution of one
//! second; within one second the order is the one the controller's watch first delivered the
//! claims in ([`TargetIndex::seen_order`](super::index::TargetIndex::seen_order)), then the name.
//! A claim
//! only asks the store for the target when no claim that goes before it is still waiting, so a
//! stream of new claims can never starve an old one, and on a release the next claim in line
//! takes the target instead of whichever reconciles first.
//!
//! Pure functions over the controller's cache, unit-tested below. The cache lags the API server
//! by a watch event at most; a claim the cache does not show yet is simply not in line yet.

use std::cmp::Reverse;
use std::sync::Arc;

use jiff::Timestamp;
use kube::ResourceExt;

use crate::api::{Phase, TargetLease};

/// Where a claim stands in line: higher priority first, then older, then first seen, then by
/// name.
type Place = (Reverse<i32>, Option<Timestamp>, u64, String);

fn place(lease: &TargetLease, seen: &impl Fn(&TargetLease) -> u64) -> Place {
    (
        Reverse(lease.spec.priority.unwrap_or(0)),
        lease.metadata.creation_timestamp.as_ref().map(|t| t.0),
        seen(lease),
        lease.name_any(),
    )
}

/// Whether a claim is in line for the target: it wants it (no release asked, not spent, not
/// being deleted), does not hold it, and can take it (not Failed, not Released).
fn in_line(lease: &TargetLease) -> bool {
    let status = lease.status.as_ref();
    let phase = status.map(|s| s.phase);
    let spent = status
        .and_then(|s| s.max_hold_spent_generation)
        .is_some_and(|g| Some(g) == lease.metadata.generation);
    lease.metadata.deletion_timestamp.is_none()
        && !lease.spec.release
        && !spent
        && !matches!(phase, Some(Phase::Held | Phase::Released | Phase::Failed))
}

/// The claim in line before `me` on the same target, if any: then `me` waits its turn. `seen`
/// gives each claim's place in the order the controller first saw them.
pub fn ahead_of(
    me: &TargetLease,
    on_target: &[Arc<TargetLease>],
    seen: impl Fn(&TargetLease) -> u64,
) -> Option<Arc<TargetLease>> {
    let mine = place(me, &seen);
    on_target
        .iter()
        .filter(|other| other.uid() != me.uid() && in_line(other))
        .map(|other| (place(other, &seen), other))
        .filter(|(theirs, _)| *theirs < mine)
        .min_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, other)| other.clone())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;

    use super::*;
    use crate::api::{TargetLeaseSpec, TargetLeaseStatus, test_spec};

    fn claim(
        name: &str,
        created_s: i64,
        priority: Option<i32>,
        phase: Option<Phase>,
    ) -> Arc<TargetLease> {
        let mut lease = TargetLease::new(
            name,
            TargetLeaseSpec {
                priority,
                ..test_spec("t", name)
            },
        );
        lease.metadata = ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            uid: Some(format!("uid-{name}")),
            generation: Some(1),
            creation_timestamp: Some(Time(
                Timestamp::from_second(1_700_000_000 + created_s).expect("time"),
            )),
            ..ObjectMeta::default()
        };
        lease.status = phase.map(|phase| TargetLeaseStatus {
            phase,
            ..TargetLeaseStatus::default()
        });
        Arc::new(lease)
    }

    fn names(of: Option<Arc<TargetLease>>) -> Option<String> {
        of.map(|l| l.name_any())
    }

    /// Seen in the order of `names`; others last.
    fn seen_in(names: &[&str]) -> impl Fn(&TargetLease) -> u64 {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        move |l: &TargetLease| {
            names
                .iter()
                .position(|n| *n == l.name_any())
                .map_or(u64::MAX, |i| i as u64)
        }
    }

    fn ahead_of(me: &TargetLease, all: &[Arc<TargetLease>]) -> Option<Arc<TargetLease>> {
        super::ahead_of(me, all, |_| 0)
    }

    #[test]
    fn waiters_go_in_creation_order_and_new_ones_never_jump() {
        let old = claim("old", 0, None, Some(Phase::Waiting));
        let mid = claim("mid", 1, None, Some(Phase::Waiting));
        let new = claim("new", 2, None, None);
        let all = vec![old.clone(), mid.clone(), new.clone()];
        assert_eq!(names(ahead_of(&old, &all)), None);
        assert_eq!(names(ahead_of(&mid, &all)), Some("old".into()));
        assert_eq!(names(ahead_of(&new, &all)), Some("old".into()));
        // Same second: in the order first seen, whatever the names.
        let twin = claim("a-twin", 1, None, Some(Phase::Waiting));
        let both = [mid.clone(), twin.clone()];
        let mid_first = seen_in(&["mid", "a-twin"]);
        assert_eq!(names(super::ahead_of(&mid, &both, &mid_first)), None);
        assert_eq!(
            names(super::ahead_of(&twin, &both, &mid_first)),
            Some("mid".into())
        );
        // Seen in the same place (not seen at all): by name.
        assert_eq!(names(ahead_of(&mid, &both)), Some("a-twin".into()));
        // An older second goes first, whenever it was seen.
        let late_seen = seen_in(&["mid", "old"]);
        assert_eq!(
            names(super::ahead_of(
                &mid,
                &[old.clone(), mid.clone()],
                &late_seen
            )),
            Some("old".into())
        );
    }

    #[test]
    fn priority_overtakes_and_holders_and_finished_claims_are_not_in_line() {
        let old = claim("old", 0, None, Some(Phase::Waiting));
        let urgent = claim("urgent", 5, Some(10), None);
        let all = vec![old.clone(), urgent.clone()];
        assert_eq!(names(ahead_of(&urgent, &all)), None);
        assert_eq!(names(ahead_of(&old, &all)), Some("urgent".into()));
        let holder = claim("holder", -5, None, Some(Phase::Held));
        let failed = claim("failed", -4, None, Some(Phase::Failed));
        let released = claim("released", -3, None, Some(Phase::Released));
        let all = vec![old.clone(), holder, failed, released];
        assert_eq!(names(ahead_of(&old, &all)), None);
    }
}
