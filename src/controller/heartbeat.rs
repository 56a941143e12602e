//! Heartbeats of `targetlease run`: a run refreshes the `targetlease.dev/heartbeat` annotation of
//! its TargetLease every quarter of the TTL, and a claim whose heartbeat has not changed for half
//! the TTL (by this controller's clock, so no two clocks are compared) has lost its holder: its
//! lease is released, whether the run was killed with its pod or on its own (SIGKILL on a laptop,
//! an OOM kill, a liveness probe). A controller that starts (or becomes leader) gives every
//! heartbeat a fresh half TTL from the moment it first sees it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use std::time::Instant;

use crate::api::{HEARTBEAT_ANNOTATION, TargetLease};

/// How long a heartbeat may stay unchanged before its holder counts as gone: half the TTL, so a
/// crashed run's lease is released within the TTL of its last heartbeat.
pub fn stale_after(ttl: Duration) -> Duration {
    (ttl / 2).max(Duration::from_millis(500))
}

/// When each heartbeat was last seen to change.
#[derive(Default)]
pub struct Heartbeats {
    seen: Mutex<HashMap<ObjectRef<TargetLease>, (String, Instant)>>,
}

impl Heartbeats {
    /// For how long the heartbeat of `lease` has not changed as of `now`; `None` when the lease
    /// carries no heartbeat (it is not held by `targetlease run`).
    pub fn silent_for(&self, lease: &TargetLease, now: Instant) -> Option<Duration> {
        let value = lease
            .metadata
            .annotations
            .as_ref()?
            .get(HEARTBEAT_ANNOTATION)?;
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let entry = seen
            .entry(ObjectRef::from_obj(lease))
            .or_insert_with(|| (value.clone(), now));
        if entry.0 != *value {
            *entry = (value.clone(), now);
        }
        Some(now.saturating_duration_since(entry.1))
    }

    /// Forgets a deleted TargetLease.
    pub fn forget(&self, lease: &ObjectRef<TargetLease>) {
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
}
