//! Heartbeats of `targetlease run`: a run refreshes the `targetlease.dev/heartbeat` annotation of
//! its TargetLease every sixth of the TTL, and a claim whose heartbeat has not changed for half the
//! TTL (by this controller's clock, so no two clocks are compared) has lost its holder: its lease
//! is released, whether the run was killed with its pod or on its own (SIGKILL on a laptop, an OOM
//! kill, a liveness probe). `run` stops its command before that moment on its own (see the trust
//! windows in docs/internals/controller.md), so the release never hands the target to a second
//! holder while the first command still runs.
//!
//! A controller that starts (or becomes leader) has not seen any heartbeat change: it counts a
//! heartbeat's silence from the moment it first sees it, which is never earlier than the moment
//! the run wrote it, so a live run is never released sooner than it expects. One exception keeps
//! a dead run from taking its target back after a failover: a claim already released because its
//! holder was gone stays silent from the start until its heartbeat changes again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use crate::api::TargetLease;
use crate::api::heartbeat::{
    HEARTBEAT_ANNOTATION, judged_ttl, released_for_gone_holder, stale_after,
};

/// Since when a heartbeat has not changed.
#[derive(Clone, Copy)]
enum Since {
    /// Seen to change (or first seen) at this instant.
    Changed(Instant),
    /// First seen on a claim that was already released for a gone holder: stale from the start.
    Released,
}

/// When each heartbeat was last seen to change.
#[derive(Default)]
pub(crate) struct Heartbeats {
    seen: Mutex<HashMap<ObjectRef<TargetLease>, (String, Since)>>,
}

impl Heartbeats {
    /// For how long the heartbeat of `lease` has not changed as of `now`; `None` when the lease
    /// carries no heartbeat (it is not held by `targetlease run`).
    pub(crate) fn silent_for(&self, lease: &TargetLease, now: Instant) -> Option<Duration> {
        let value = lease
            .metadata
            .annotations
            .as_ref()?
            .get(HEARTBEAT_ANNOTATION)?;
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let entry = seen.entry(ObjectRef::from_obj(lease)).or_insert_with(|| {
            let since = if released_for_gone_holder(lease) {
                Since::Released
            } else {
                Since::Changed(now)
            };
            (value.clone(), since)
        });
        if entry.0 != *value {
            *entry = (value.clone(), Since::Changed(now));
        }
        Some(match entry.1 {
            Since::Changed(at) => now.saturating_duration_since(at),
            Since::Released => stale_after(judged_ttl(lease)),
        })
    }

    /// Forgets a deleted TargetLease.
    pub(crate) fn forget(&self, lease: &ObjectRef<TargetLease>) {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(lease);
    }
}

#[cfg(test)]
mod tests {
    use kube::api::ObjectMeta;

    use super::*;
    use crate::api::test_spec;

    fn lease(beat: Option<&str>) -> TargetLease {
        let mut lease = TargetLease::new("x", test_spec("t", "h"));
        lease.metadata = ObjectMeta {
            name: Some("x".into()),
            namespace: Some("ns".into()),
            annotations: beat.map(|b| [(HEARTBEAT_ANNOTATION.to_owned(), b.to_owned())].into()),
            ..ObjectMeta::default()
        };
        lease
    }

    #[test]
    fn silence_counts_from_the_last_change_seen() {
        let beats = Heartbeats::default();
        let t0 = Instant::now();
        assert_eq!(beats.silent_for(&lease(None), t0), None);
        assert_eq!(
            beats.silent_for(&lease(Some("1")), t0),
            Some(Duration::ZERO)
        );
        let later = t0 + Duration::from_secs(20);
        assert_eq!(
            beats.silent_for(&lease(Some("1")), later),
            Some(Duration::from_secs(20))
        );
        assert_eq!(
            beats.silent_for(&lease(Some("2")), later),
            Some(Duration::ZERO)
        );
        assert!(stale_after(Duration::from_secs(30)) == Duration::from_secs(15));
    }

    /// A new leader has never seen a dead run's heartbeat change: a claim the old leader released
    /// for it must not take the target again for a fresh silence window.
    #[test]
    fn a_claim_released_for_a_gone_holder_stays_stale_after_a_failover() {
        use crate::api::{Condition, Phase, Reason, TargetLeaseStatus};
        let mut released = lease(Some("1"));
        released.status = Some(TargetLeaseStatus {
            phase: Phase::Released,
            conditions: vec![Condition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: Reason::HolderGone.as_str().into(),
                message: "the heartbeat stopped".into(),
                observed_generation: None,
                last_transition_time: jiff::Timestamp::UNIX_EPOCH,
            }],
            ..TargetLeaseStatus::default()
        });
        let ttl = Duration::from_secs(u64::from(released.spec.ttl_seconds));
        let new_leader = Heartbeats::default();
        let t0 = Instant::now();
        let silent = new_leader.silent_for(&released, t0).expect("a heartbeat");
        assert!(silent >= stale_after(ttl), "{silent:?}");
        // The run comes back (a restarted one adopting its claim): the claim may take the target.
        let mut resumed = released.clone();
        resumed.metadata.annotations = Some([(HEARTBEAT_ANNOTATION.to_owned(), "2".into())].into());
        assert_eq!(
            new_leader.silent_for(&resumed, t0 + Duration::from_secs(1)),
            Some(Duration::ZERO)
        );
        // A held claim first seen by a new leader gets a whole window from that moment: its run is
        // alive as far as anyone knows, and the run's own bound counts from an earlier instant.
        let mut held = lease(Some("7"));
        held.metadata.name = Some("y".into());
        assert_eq!(new_leader.silent_for(&held, t0), Some(Duration::ZERO));
    }
}
