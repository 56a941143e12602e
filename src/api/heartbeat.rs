//! The heartbeat protocol between `targetlease run` and the controller, written once for both
//! sides.
//!
//! `run` refreshes the annotation [`HEARTBEAT_ANNOTATION`] of its TargetLease every
//! [`Windows::beat`] (a sixth of the tenure's TTL). The controller counts a heartbeat's silence
//! on its own monotonic clock from the moment it saw the value change, and a claim silent for
//! [`stale_after`] (half the TTL) has lost its holder. `run` trusts its lease only while the API
//! server confirms it: it kills its command at [`Windows::kill`] after sending the last
//! heartbeat whose reply showed the TargetLease Held with its token, which is strictly before
//! the controller can count that heartbeat as stopped. Each heartbeat names the TTL its `run`
//! counts with ([`Beat`]): the controller judges silence with the longer of that and the spec's,
//! so an edit of `spec.ttlSeconds` never lets it judge a silence that `run` still trusts (`run`
//! follows a shorter TTL by announcing it first). When a tenure ends, `run` confirms that its
//! command and everything it started are gone ([`STOPPED_ANNOTATION`]); until then, or until the
//! bound by which a `run` that never heard of the end has killed it ([`stop_bound`]), the
//! controller passes the target on to no one. The inequalities are in
//! docs/internals/controller.md ("Trust windows") and tested below for every TTL a TargetLease may have.

use std::time::Duration;

use super::{Phase, Reason, TargetLease};

/// Annotation that `targetlease run` refreshes every sixth of the TTL ([`Windows::beat`]): a
/// TargetLease carrying it whose value has not changed for half the TTL has lost its holder and
/// is released.
pub const HEARTBEAT_ANNOTATION: &str = "targetlease.dev/heartbeat";

/// Annotation `targetlease run` writes once the command it ran under a tenure, and everything
/// that command started, is gone: its value is that tenure's fencing token. The controller
/// passes the target of an ended tenure on as soon as it sees it.
pub const STOPPED_ANNOTATION: &str = "targetlease.dev/stopped";

/// One heartbeat's value: this machine's wall clock in ms (what makes it change; never compared
/// with another clock) and the TTL, in whole seconds, that the `run` writing it counts its
/// windows with. Written as `<ms> ttl=<seconds>`; a value without the TTL (written by an older
/// `run`) names none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Beat {
    /// The wall clock when it was written, in ms.
    pub wall_ms: u64,
    /// The TTL `run` counts with, in whole seconds.
    pub ttl_seconds: Option<u32>,
}

impl Beat {
    /// The annotation's value.
    pub fn value(&self) -> String {
        match self.ttl_seconds {
            Some(ttl) => format!("{} ttl={ttl}", self.wall_ms),
            None => self.wall_ms.to_string(),
        }
    }

    /// Reads an annotation's value; anything unreadable names no TTL.
    pub fn parse(value: &str) -> Self {
        let mut words = value.split_whitespace();
        let wall_ms = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        let ttl_seconds = words
            .find_map(|w| w.strip_prefix("ttl="))
            .and_then(|t| t.parse().ok())
            .filter(|t| (1..=super::MAX_TTL_SECONDS).contains(t));
        Self {
            wall_ms,
            ttl_seconds,
        }
    }
}

/// The TTL by which a holder's heartbeat is judged: the longer of the spec's and the one its
/// latest heartbeat names (a `run` that announced a shorter TTL counts with it from that
/// heartbeat on; one that has not yet announced the spec's new, shorter TTL still counts with
/// its old one).
pub fn judged_ttl(lease: &TargetLease) -> Duration {
    let spec = lease.spec.ttl_seconds.clamp(1, super::MAX_TTL_SECONDS);
    let beat = annotation(lease, HEARTBEAT_ANNOTATION)
        .and_then(|v| Beat::parse(v).ttl_seconds)
        .unwrap_or(spec);
    Duration::from_secs(u64::from(spec.max(beat)))
}

/// The bound by which a holder that acts on the Held status has killed its command, counted from
/// the moment it can no longer have a heartbeat confirmed Held (the status write that left
/// Held was answered) or the controller last saw its heartbeat change, whichever came first:
/// [`stale_after`] the TTL it is judged by. [`Windows::kill`], plus the margins for clock rates
/// and scheduling, ends before it.
pub fn stop_bound(lease: &TargetLease) -> Duration {
    stale_after(judged_ttl(lease))
}

/// Whether the claim is held by something that heartbeats (`targetlease run`): a holder that
/// acts on the Held status, so that every end of its tenure waits for it to stop.
pub fn heartbeats(lease: &TargetLease) -> bool {
    annotation(lease, HEARTBEAT_ANNOTATION).is_some()
}

/// The token whose command the holder confirmed stopped, if it did.
pub fn stopped_token(lease: &TargetLease) -> Option<u64> {
    annotation(lease, STOPPED_ANNOTATION)?.trim().parse().ok()
}

/// Whether the status says the tenure it names ended and its holder has not been confirmed
/// stopped yet (reason `Stopping` on the Held condition): the target is not passed on.
pub fn stopping(lease: &TargetLease) -> bool {
    lease.status.as_ref().is_some_and(|s| {
        s.phase != Phase::Held
            && s.conditions.iter().any(|c| {
                c.type_ == super::ConditionType::Held.as_str()
                    && c.reason == Reason::Stopping.as_str()
            })
    })
}

fn annotation<'a>(lease: &'a TargetLease, key: &str) -> Option<&'a str> {
    lease
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

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
