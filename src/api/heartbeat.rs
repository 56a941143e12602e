//! The heartbeat protocol between `targetlease run` and the controller, written once for both
//! sides.
//!
//! `run` refreshes the annotation [`HEARTBEAT_ANNOTATION`] of its TargetLease every
//! [`Windows::beat`] (a sixth of the tenure's TTL). The controller counts a heartbeat's silence
//! on its own monotonic clock from the moment it saw the value change, and a claim silent for
//! [`stale_after`] (half the TTL) has lost its holder. `run` trusts its lease only while the API
//! server confirms it: it kills its command at [`Windows::kill`] after sending the last
//! heartbeat whose reply showed the TargetLease Held with its token, which is strictly before
//! the controller can count that heartbeat as stopped. The inequalities are in
//! docs/internals/controller.md ("Trust windows") and tested below for every TTL a TargetLease may have.

use std::time::Duration;

use super::{Phase, Reason, TargetLease};

/// Annotation that `targetlease run` refreshes every sixth of the TTL ([`Windows::beat`]): a
/// TargetLease carrying it whose value has not changed for half the TTL has lost its holder and
/// is released.
pub const HEARTBEAT_ANNOTATION: &str = "targetlease.dev/heartbeat";

/// How long a heartbeat may stay unchanged before its holder counts as gone: half the TTL, so a
/// crashed run's lease is released within the TTL of its last heartbeat; a live run, which beats
/// every sixth of the TTL, stops its command before this on its own.
pub fn stale_after(ttl: Duration) -> Duration {
    (ttl / 2).max(Duration::from_millis(500))
}

/// How far apart the rates of `run`'s clock and the controller's may be, as a fraction: 1/100.
/// Monotonic clocks disciplined by NTP differ by at most 500 ppm; 1 % also covers a VM whose
/// clock is slewed harder.
pub const CLOCK_RATE_DIVISOR: u32 = 100;

/// How late `run` may act after its timer fires (scheduling, a loaded node), and the time a
/// SIGKILL takes to end a group: a twentieth of the TTL, at least 50 ms.
pub fn scheduling_margin(ttl: Duration) -> Duration {
    (ttl / 20).max(Duration::from_millis(50))
}

/// The trust windows of `run` for a lease of `ttl` and a `--grace`, each counted on `run`'s
/// monotonic clock from the moment it sent the last heartbeat the API server confirmed (the
/// controller counts a heartbeat's silence from when it sees it, which is later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    /// How often `run` writes its heartbeat: a sixth of the TTL, at least 250 ms.
    pub beat: Duration,
    /// SIGTERM to the command once no heartbeat sent this long ago is confirmed.
    pub term: Duration,
    /// SIGKILL to the command and everything it started at this point, whatever the grace: the
    /// controller's silence bound, less the clock-rate margin and the scheduling margin.
    pub kill: Duration,
}

impl Windows {
    /// The windows for a lease of `ttl` (whole seconds, as the controller counts it) and a grace.
    pub fn new(ttl: Duration, grace: Duration) -> Self {
        // A sixth of the TTL: with the controller's silence bound at half of it, that leaves a
        // fifth of the TTL for the grace of a command whose heartbeats stopped.
        let beat = (ttl / 6).max(Duration::from_millis(250));
        let silence = stale_after(ttl);
        let kill = silence - silence / CLOCK_RATE_DIVISOR - scheduling_margin(ttl);
        // Never sooner than one and a half heartbeats: a heartbeat's reply may take half an
        // interval without the command being disturbed.
        let term = kill.saturating_sub(grace).max(beat + beat / 2);
        Self { beat, term, kill }
    }

    /// The grace the command gets when no heartbeat is confirmed: `--grace`, cut at the bound.
    pub fn silent_grace(&self) -> Duration {
        self.kill - self.term
    }
}

/// Whether the status says the claim was released because its holder was gone (its pod, or its
/// heartbeat for [`stale_after`]): no holder has written its heartbeat since, as far as the
/// controller saw.
pub fn released_for_gone_holder(lease: &TargetLease) -> bool {
    lease.status.as_ref().is_some_and(|s| {
        s.phase == Phase::Released
            && s.conditions
                .iter()
                .any(|c| c.reason == Reason::HolderGone.as_str())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inequalities of docs/internals/controller.md ("Trust windows"), for every TTL a TargetLease may
    /// have (1 s to 3600 s) and graces from none to an hour.
    #[test]
    fn the_command_is_dead_before_the_controller_may_release_it() {
        for seconds in 1..=u64::from(super::super::MAX_TTL_SECONDS) {
            let ttl = Duration::from_secs(seconds);
            let silence = stale_after(ttl);
            for grace in [0, 1, 10, 40, 3600].map(Duration::from_secs) {
                let w = Windows::new(ttl, grace);
                // SIGKILL, however late the scheduler lets it land, comes before the earliest
                // release even on a controller clock running 1 % fast.
                let latest_kill = w.kill + scheduling_margin(ttl);
                assert!(
                    latest_kill.as_secs_f64() * (1.0 + 1.0 / f64::from(CLOCK_RATE_DIVISOR))
                        <= silence.as_secs_f64() * (1.0 + 1e-9),
                    "ttl {ttl:?}: {w:?}"
                );
                // SIGTERM never before the next heartbeat's reply is due (half an interval of
                // latency allowed), and before the kill.
                assert!(
                    w.term >= w.beat + w.beat / 2 && w.term <= w.kill,
                    "{ttl:?} {w:?}"
                );
                // The grace is the one asked for, or what is left before the kill.
                assert_eq!(w.silent_grace(), grace.min(w.kill - (w.beat + w.beat / 2)));
                // A `run` killed right after a heartbeat loses its lease within the TTL.
                assert!(
                    w.beat + silence <= ttl + Duration::from_millis(250),
                    "{ttl:?}"
                );
            }
        }
        // Measured figures in the docs: TTL 8 s and 30 s with the default grace.
        let eight = Windows::new(Duration::from_secs(8), Duration::from_secs(10));
        assert_eq!(
            (eight.term.as_millis(), eight.kill.as_millis()),
            (1999, 3560)
        );
        let thirty = Windows::new(Duration::from_secs(30), Duration::from_secs(10));
        assert_eq!(
            (thirty.beat, thirty.term, thirty.kill),
            (
                Duration::from_secs(5),
                Duration::from_millis(7500),
                Duration::from_millis(13350)
            )
        );
    }
}
