//! Fair hand-over: the claims waiting for a target get it in the order they were created, unless
//! `spec.priority` puts one ahead (higher first). `creationTimestamp` has a resolution of one
//! second; within one second the order is the one the controller's watch first delivered the
//! claims in ([`TargetIndex::seen_order`](super::index::TargetIndex::seen_order)), then the name.
//! A claim
//! only asks the store for the target when no claim that goes before it is still waiting, so a
//! stream of new claims can never starve an old one, and on a release the next claim in line
//! takes the target instead of whichever reconciles first.
//!
//! With `spec.permits` N, the first claims in line ask the store together, as many as there are
//! free permits (N minus the claims the cache shows Held, at least one): each freed permit goes
//! to the oldest claim waiting, and no claim behind the free permits' worth asks before them. The
//! claim at the head of the line always asks, so a cache that still shows a holder that is gone
//! can delay a hand-over by one watch event, never stop it. Claims asking another permits value
//! are not in this line: the store refuses them while these permits are held, and they must
//! not block it.
//!
//! Pure functions over the controller's cache, unit-tested below. The cache lags the API server
//! by a watch event at most; a claim the cache does not show yet is simply not in line yet.

use std::cmp::Reverse;
use std::sync::Arc;

use jiff::Timestamp;
use kube::ResourceExt;

use crate::api::heartbeat::{heartbeats, stopping};
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

/// The claims in line for a target ([`in_line`]), in the order they are served; `seen` gives
/// each claim's place in the order the controller first saw them (a reader outside the
/// controller, which cannot know it, passes a constant: the name then breaks ties).
pub(crate) fn in_order<'a>(
    on_target: impl IntoIterator<Item = &'a TargetLease>,
    seen: impl Fn(&TargetLease) -> u64,
) -> Vec<&'a TargetLease> {
    let mut line: Vec<_> = on_target
        .into_iter()
        .filter(|lease| in_line(lease))
        .map(|lease| (place(lease, &seen), lease))
        .collect();
    line.sort_by(|a, b| a.0.cmp(&b.0));
    line.into_iter().map(|(_, lease)| lease).collect()
}

/// Whether a claim is in line for the target (waiting for it): it wants it (no release asked,
/// not spent, not being deleted), does not hold it, and can take it (not Failed, not Released).
/// The one definition of "waiting": the line's order, the wake-ups of a release and of a freed
/// permit all read it.
pub(crate) fn in_line(lease: &TargetLease) -> bool {
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

fn shows_held(lease: &TargetLease) -> bool {
    lease
        .status
        .as_ref()
        .is_some_and(|s| s.phase == Phase::Held)
}

/// Whether a claim occupies one of the target's permits in the cache: it shows Held, or its
/// tenure ended and its holder has not been confirmed stopped (`Stopping`).
pub(crate) fn occupies(lease: &TargetLease) -> bool {
    shows_held(lease) || stopping(lease)
}

/// Whether a claim occupies its permit until the controller itself frees it, whatever the store
/// says: a Held one whose holder acts on the status (it heartbeats), or a stopping one. The
/// store may answer such a permit free (its lease expired while no controller ran, or the
/// store lost it), and passing it on then would start a second command beside the first: the
/// hand-over rule ([`handover`](crate::controller::tenure::handover)) frees it.
pub(crate) fn blocks(lease: &TargetLease) -> bool {
    (shows_held(lease) && heartbeats(lease)) || stopping(lease)
}

/// The head of the line before `me` on the same target when `me` must wait its turn: as many
/// claims are in line before it as there are free permits (see the module's doc), or more.
/// `seen` gives each claim's place in the order the controller first saw them.
/// `kept` says which claims hold their target through this process whatever the cache shows
/// yet (a grant whose Held status is in flight): one whose holder heartbeats blocks its permit.
pub(crate) fn ahead_of(
    me: &TargetLease,
    on_target: &[Arc<TargetLease>],
    seen: impl Fn(&TargetLease) -> u64,
    kept: impl Fn(&TargetLease) -> bool,
) -> Option<Arc<TargetLease>> {
    let others = || on_target.iter().filter(|other| other.uid() != me.uid());
    let permits = usize::try_from(me.spec.permits).unwrap_or(usize::MAX);
    let blocking = || others().filter(|other| blocks(other) || (heartbeats(other) && kept(other)));
    // A blocked permit granted under another permits value blocks the whole target for me: its
    // holder counted on that value (an exclusive one, on running alone), and a store that lost
    // its lease would grant me a slot beside it.
    if let Some(other) = blocking().find(|other| {
        other
            .status
            .as_ref()
            .and_then(|s| s.permits)
            .unwrap_or(other.spec.permits)
            != me.spec.permits
    }) {
        return Some(other.clone());
    }
    // Every permit blocked until the controller frees it: nobody asks the store.
    let mut blocked = blocking();
    if let Some(first) = blocked.next()
        && 1 + blocked.count() >= permits
    {
        return Some(first.clone());
    }
    let held = others().filter(|other| occupies(other)).count();
    let free = permits.saturating_sub(held).max(1);
    let mine = place(me, &seen);
    let mut ahead: Vec<_> = others()
        .filter(|other| in_line(other) && other.spec.permits == me.spec.permits)
        .map(|other| (place(other, &seen), other))
        .filter(|(theirs, _)| *theirs < mine)
        .collect();
    if ahead.len() < free {
        return None;
    }
    ahead.sort_by(|a, b| a.0.cmp(&b.0));
    ahead.first().map(|(_, other)| (*other).clone())
}

/// Whether a claim's permit, once it stops occupying it ([`occupies`]), is one the claims in
/// line wait to be told about: on a target with permits above 1 (the head of the line polls
/// only the permit that ends first), or one a holder that acts on its status blocked
/// ([`blocks`]: nobody asks the store for it meanwhile). The release of an exclusive lease
/// without such a holder wakes its waiters itself.
pub(crate) fn watched_permit(lease: &TargetLease) -> bool {
    lease.spec.permits > 1 || heartbeats(lease) || stopping(lease)
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
        super::ahead_of(me, all, |_| 0, |_| false)
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
        assert_eq!(
            names(super::ahead_of(&mid, &both, &mid_first, |_| false)),
            None
        );
        assert_eq!(
            names(super::ahead_of(&twin, &both, &mid_first, |_| false)),
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
                &late_seen,
                |_| false
            )),
            Some("old".into())
        );
    }

    /// Permits 3: with one held, the two oldest waiters ask, the rest wait; with none held, the
    /// three oldest; with all held, only the head (it polls the expiry). A claim asking another
    /// permits value is not in this line.
    #[test]
    fn as_many_ask_as_there_are_free_permits() {
        let with = |name: &str, created: i64, phase: Option<Phase>, permits: u32| {
            let mut lease = (*claim(name, created, None, phase)).clone();
            lease.spec.permits = permits;
            Arc::new(lease)
        };
        let holder = with("holder", -10, Some(Phase::Held), 3);
        let waiters: Vec<_> = (0..5)
            .map(|i| with(&format!("w{i}"), i, Some(Phase::Waiting), 3))
            .collect();
        let asking = |all: &[Arc<TargetLease>]| -> Vec<String> {
            all.iter()
                .filter(|l| l.status.as_ref().is_none_or(|s| s.phase != Phase::Held))
                .filter(|l| ahead_of(l, all).is_none())
                .map(|l| l.name_any())
                .collect()
        };
        let mut one_held = vec![holder.clone()];
        one_held.extend(waiters.iter().cloned());
        assert_eq!(asking(&one_held), ["w0", "w1"]);
        assert_eq!(names(ahead_of(&waiters[2], &one_held)), Some("w0".into()));
        assert_eq!(asking(&waiters), ["w0", "w1", "w2"]);
        let mut all_held = vec![holder.clone(), with("h2", -9, Some(Phase::Held), 3)];
        all_held.push(with("h3", -8, Some(Phase::Held), 3));
        all_held.extend(waiters.iter().cloned());
        assert_eq!(asking(&all_held), ["w0"]);
        // An older claim asking permits 2 blocks none of them and is not blocked by them.
        let mut mixed = vec![holder, with("other-value", -5, Some(Phase::Waiting), 2)];
        mixed.extend(waiters.iter().cloned());
        assert_eq!(asking(&mixed), ["other-value", "w0", "w1"]);
        // Permits 1 is the exclusive line: only the head asks, whatever the cache shows held.
        let exclusive: Vec<_> = (0..3)
            .map(|i| with(&format!("x{i}"), i, Some(Phase::Waiting), 1))
            .collect();
        assert_eq!(asking(&exclusive), ["x0"]);
    }

    /// A claim whose holder acts on its Held status (it heartbeats), or whose ended tenure's
    /// holder is not confirmed stopped, blocks its permit: nobody asks the store for it, since
    /// the store may answer it free after an outage or a data loss. Other holders only occupy
    /// theirs (the store decides), and the head of the line asks.
    #[test]
    fn a_holder_that_acts_on_its_status_blocks_its_permit() {
        use crate::api::heartbeat::HEARTBEAT_ANNOTATION;
        use crate::api::{Condition, Reason};
        let beating = |mut lease: TargetLease| {
            lease.metadata.annotations =
                Some([(HEARTBEAT_ANNOTATION.to_owned(), "1 ttl=30".to_owned())].into());
            lease
        };
        let stopping = |phase: Phase| {
            let mut lease = beating((*claim("h", -10, None, Some(phase))).clone());
            if let Some(status) = lease.status.as_mut() {
                status.conditions = vec![Condition {
                    type_: "Held".into(),
                    status: "False".into(),
                    reason: Reason::Stopping.as_str().into(),
                    message: String::new(),
                    observed_generation: None,
                    last_transition_time: Timestamp::UNIX_EPOCH,
                }];
            }
            Arc::new(lease)
        };
        let plain_holder = claim("h", -10, None, Some(Phase::Held));
        let run_holder = Arc::new(beating((*plain_holder).clone()));
        let waiter = claim("w", 0, None, Some(Phase::Waiting));
        assert!(occupies(&plain_holder) && !blocks(&plain_holder));
        assert!(occupies(&run_holder) && blocks(&run_holder));
        for phase in [Phase::Released, Phase::Lost] {
            let ended = stopping(phase);
            assert!(occupies(&ended) && blocks(&ended), "{phase:?}");
            assert!(watched_permit(&ended));
        }
        let released = claim("h", -10, None, Some(Phase::Released));
        assert!(!occupies(&released) && !blocks(&released));
        // The head of the line asks behind a plain holder, not behind one that blocks.
        assert_eq!(
            names(ahead_of(&waiter, &[plain_holder.clone(), waiter.clone()])),
            None
        );
        assert_eq!(
            names(ahead_of(&waiter, &[run_holder.clone(), waiter.clone()])),
            Some("h".into())
        );
        assert_eq!(
            names(ahead_of(
                &waiter,
                &[stopping(Phase::Released), waiter.clone()]
            )),
            Some("h".into())
        );
        // Permits 2 with one blocked: the other permit is asked for.
        let with_permits = |lease: &TargetLease| {
            let mut lease = lease.clone();
            lease.spec.permits = 2;
            Arc::new(lease)
        };
        let (holder2, waiter2) = (with_permits(&run_holder), with_permits(&waiter));
        assert_eq!(
            names(ahead_of(&waiter2, &[holder2.clone(), waiter2.clone()])),
            None
        );
        // A blocking holder granted under another permits value blocks a claim asking more
        // permits too: its command counted on the value it was granted under (an exclusive
        // one on running alone), and the store, which lost it, would grant the other value a
        // slot beside it.
        for blocker in [stopping(Phase::Lost), run_holder.clone()] {
            assert_eq!(
                names(ahead_of(&waiter2, &[blocker, waiter2.clone()])),
                Some("h".into())
            );
        }
        // A grant this process made to a run holder whose Held status the cache does not show
        // yet blocks all the same.
        let granted = Arc::new(beating(
            (*claim("h", -10, None, Some(Phase::Waiting))).clone(),
        ));
        let kept = |l: &TargetLease| l.name_any() == "h";
        assert_eq!(
            names(super::ahead_of(
                &waiter,
                &[granted.clone(), waiter.clone()],
                |_| 0,
                kept
            )),
            Some("h".into())
        );
        // Which permits the line waits to be told about when they free up.
        assert!(watched_permit(&run_holder) && !watched_permit(&plain_holder));
        assert!(watched_permit(&holder2));
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
