//! Readings of the store's clock, placed on this process's monotonic clock. Times in the store's
//! clock are compared with this process's only through a reading, never with its wall clock, so
//! a controller whose clock is off decides the same; what is assumed is only that both clocks
//! advance at the rate of real time between two answers (docs/internals/controller.md, "Clocks").
//!
//! The monotonic clock is tokio's, so that the renewal scheduler and the decisions that read it
//! are tested with a paused clock instead of sleeping.

use std::time::Duration;

use tokio::time::Instant;

use crate::time::millis;

/// One answer of the store: it read its clock as `server_ms` at some instant between `sent` and
/// `answered`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reading {
    /// When the call was sent (monotonic).
    pub(crate) sent: Instant,
    /// When its answer arrived (monotonic).
    pub(crate) answered: Instant,
    /// The store's clock in the answer, ms since the Unix epoch.
    pub(crate) server_ms: u64,
}

impl Reading {
    /// How long, from `now`, until the store's clock can read `at_ms`: it read `server_ms` no
    /// earlier than `sent`, so `at_ms` comes no earlier than `sent + (at_ms - server_ms)`. Zero
    /// once that may have passed; the answer is never later than the truth.
    pub(crate) fn left_until(&self, at_ms: u64, now: Instant) -> Duration {
        let ahead = at_ms.saturating_sub(self.server_ms);
        let elapsed = millis(now.saturating_duration_since(self.sent));
        Duration::from_millis(ahead.saturating_sub(elapsed))
    }

    /// The earliest the store's clock can read at `now`, in ms: it read `server_ms` no later
    /// than `answered`.
    pub(crate) fn earliest_server_ms(&self, now: Instant) -> u64 {
        self.server_ms
            .saturating_add(millis(now.saturating_duration_since(self.answered)))
    }

    /// The latest the store's clock can read at `now`, in ms: it read `server_ms` no earlier
    /// than `sent`.
    pub(crate) fn latest_server_ms(&self, now: Instant) -> u64 {
        self.server_ms
            .saturating_add(millis(now.saturating_duration_since(self.sent)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading taken 100 ms into a call that took 200 ms: the store's clock is bounded on both
    /// sides, and an expiry is never placed later than it can be.
    #[tokio::test(start_paused = true)]
    async fn a_reading_bounds_the_store_clock_both_ways() {
        let sent = Instant::now();
        let reading = Reading {
            sent,
            answered: sent + Duration::from_millis(200),
            server_ms: 10_000,
        };
        let now = sent + Duration::from_millis(1_200);
        assert_eq!(reading.earliest_server_ms(now), 11_000);
        assert_eq!(reading.latest_server_ms(now), 11_200);
        // An expiry at 40,000 in the store's clock: at most 28.8 s from `now`.
        assert_eq!(
            reading.left_until(40_000, now),
            Duration::from_millis(28_800)
        );
        assert_eq!(reading.left_until(5_000, now), Duration::ZERO);
        // Before the call was sent (a stale `now`): nothing underflows.
        assert_eq!(
            reading.latest_server_ms(sent - Duration::from_secs(1)),
            10_000
        );
    }
}
