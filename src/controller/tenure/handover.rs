//! The one hand-over rule: when may the target of an ended tenure pass to another claim?
//!
//! Every way a tenure ends goes through it: a deletion, `spec.release`, `maxHoldSeconds`, the
//! holder pod gone, heartbeat silence, a loss the store reports, a store failure that outlasts
//! the lease, and a controller that starts after an outage and finds a Held status the store no
//! longer holds. A holder that acts on its Held status (`targetlease run`, which heartbeats)
//! stops its command only when it learns of the end; so for such a holder the target passes on
//! only once
//!
//! - the holder confirmed that the command of that very tenure is gone (its acknowledgment
//!   names the token), or its pod is gone (a pod object disappears only after its containers
//!   stopped), or
//! - the bound has passed by which a holder that never heard of the end has killed its command:
//!   [`stop_bound`](crate::api::heartbeat::stop_bound) from the moment it could no longer have a
//!   heartbeat confirmed Held (`since`: the status that left Held was written, or, for a status
//!   this process did not write, first seen) or the controller last saw its heartbeat change,
//!   whichever came first.
//!
//! Why the bound holds: `run` kills its command at `K` after sending the last heartbeat whose
//! reply showed the TargetLease Held with its token, and `K + margins <= stop_bound`. Every such
//! heartbeat was applied before the status that left Held, so it was sent before `since`, and
//! before the controller saw it change. A holder without a heartbeat (a plain `kubectl apply`,
//! a pod that only fences) keeps today's hand-over: at once.

use std::time::Duration;

use tokio::time::Instant;

/// What is known of an ended tenure's holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    /// Whether it acts on the Held status (it heartbeats).
    pub(crate) acts_on_status: bool,
    /// Whether it confirmed that the ended tenure's command is gone.
    pub(crate) confirmed_stopped: bool,
    /// Whether its pod is gone or finished.
    pub(crate) pod_gone: bool,
    /// When this process last saw its heartbeat change; `None` when it never did.
    pub(crate) last_beat_seen: Option<Instant>,
    /// The bound by which it has killed its command ([`stop_bound`](crate::api::heartbeat::stop_bound)).
    pub(crate) stop_bound: Duration,
}

/// When the target of an ended tenure may pass on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Handover {
    /// Now.
    Now,
    /// At this instant, unless the holder confirms earlier.
    At(Instant),
}

/// The rule, for a tenure that ended at `since` (the status that left Held was answered, or was
/// first seen by this process).
pub(crate) fn handover(holder: &Holder, since: Instant, now: Instant) -> Handover {
    if !holder.acts_on_status || holder.confirmed_stopped || holder.pod_gone {
        return Handover::Now;
    }
    let from = holder.last_beat_seen.map_or(since, |seen| seen.min(since));
    let at = from + holder.stop_bound;
    if now >= at {
        Handover::Now
    } else {
        Handover::At(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::heartbeat::{CLOCK_RATE_DIVISOR, Windows, scheduling_margin, stale_after};

    fn run_holder(stop_bound: Duration) -> Holder {
        Holder {
            acts_on_status: true,
            confirmed_stopped: false,
            pod_gone: false,
            last_beat_seen: None,
            stop_bound,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_holder_that_acts_on_its_status_is_waited_for() {
        let t0 = Instant::now();
        let bound = Duration::from_secs(15);
        let plain = Holder {
            acts_on_status: false,
            ..run_holder(bound)
        };
        assert_eq!(handover(&plain, t0, t0), Handover::Now);
        let run = run_holder(bound);
        assert_eq!(handover(&run, t0, t0), Handover::At(t0 + bound));
        assert_eq!(handover(&run, t0, t0 + bound), Handover::Now);
        let confirmed = Holder {
            confirmed_stopped: true,
            ..run
        };
        assert_eq!(handover(&confirmed, t0, t0), Handover::Now);
        let pod_gone = Holder {
            pod_gone: true,
            ..run
        };
        assert_eq!(handover(&pod_gone, t0, t0), Handover::Now);
        // A heartbeat silent since before the end counts from its last change (a dead run); one
        // that goes on after the end (a run in its grace) does not push the bound out.
        let dead = Holder {
            last_beat_seen: Some(t0),
            ..run
        };
        let later = t0 + Duration::from_secs(10);
        assert_eq!(handover(&dead, later, later), Handover::At(t0 + bound));
        let alive = Holder {
            last_beat_seen: Some(later + Duration::from_secs(3)),
            ..run
        };
        assert_eq!(handover(&alive, later, later), Handover::At(later + bound));
    }

    /// The inequality that keeps two commands apart after every end of a tenure, for every TTL
    /// a TargetLease may have and graces from none to an hour: the holder's `run` has killed
    /// its command (at `K` after the last confirmed heartbeat's send, late by its scheduling
    /// margin, on a clock up to 1 % slow against the controller's) before the bound counted
    /// from a later instant on the controller's clock.
    #[test]
    fn the_bound_comes_after_the_holders_kill_for_every_ttl() {
        for seconds in 1..=u64::from(crate::api::MAX_TTL_SECONDS) {
            let ttl = Duration::from_secs(seconds);
            let bound = stale_after(ttl);
            for grace in [0, 1, 10, 3600].map(Duration::from_secs) {
                let w = Windows::new(ttl, grace);
                let latest_kill = (w.kill + scheduling_margin(ttl)).as_secs_f64()
                    * (1.0 + 1.0 / f64::from(CLOCK_RATE_DIVISOR));
                assert!(
                    latest_kill <= bound.as_secs_f64() * (1.0 + 1e-9),
                    "ttl {ttl:?} grace {grace:?}: killed by {latest_kill} s, handed over after {bound:?}"
                );
            }
        }
    }
}
