//! The status-write budget: what the controller asks of the API server, by priority. A grant,
//! a loss or a release (a transition) is always written; moving a held lease's `expiresAt`
//! forward (a refresh) is written only while the API server keeps up; an Event only while it is
//! idle enough. When writes get slow (their latency, smoothed, above [`SLOW`]) or fail with a
//! sign of overload (a timeout, 429, a 5xx), refreshes and Events are shed for a back-off window
//! that doubles while the trouble lasts (1 s to 30 s), so a slow API server gets fewer writes
//! from this controller, not more. Renewals never wait for any of this (see
//! [`renewals`](super::renewals)): a shed refresh only leaves `expiresAt` behind, never a lease
//! unrenewed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Write latency (smoothed) above which the API server counts as slow.
pub const SLOW: Duration = Duration::from_secs(1);

/// Writes in flight at once above which refreshes wait.
const REFRESH_IN_FLIGHT: usize = 32;

/// Writes in flight at once above which Events are dropped.
const EVENT_IN_FLIGHT: usize = 8;

const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const LONGEST_BACKOFF: Duration = Duration::from_secs(30);

/// What a write is for, highest priority first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// A phase, token, owner or condition changes: always written.
    Transition,
    /// Only `expiresAt` moves forward: written while the API server keeps up.
    Refresh,
    /// An events.k8s.io Event: published only while few writes are in flight and none is slow.
    Event,
}

#[derive(Debug)]
struct Health {
    /// Smoothed latency of recent writes.
    latency: Duration,
    /// Refreshes and Events are shed until then.
    shed_until: Option<Instant>,
    /// The current back-off window.
    backoff: Duration,
}

/// Shared by every reconcile; no clock of its own (each call is given `now`).
#[derive(Debug)]
pub struct StatusBudget {
    in_flight: AtomicUsize,
    health: Mutex<Health>,
}

impl Default for StatusBudget {
    fn default() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            health: Mutex::new(Health {
                latency: Duration::ZERO,
                shed_until: None,
                backoff: FIRST_BACKOFF,
            }),
        }
    }
}

/// A write admitted by [`StatusBudget::admit`]: counted in flight until it is dropped; report
/// how it went with [`Admitted::done`].
#[must_use]
pub struct Admitted<'a> {
    budget: &'a StatusBudget,
    started: Instant,
}

impl Admitted<'_> {
    /// Records how the write went: `overloaded` when it failed in a way that says the API server
    /// is overloaded (see [`is_overload`]).
    pub fn done(self, now: Instant, overloaded: bool) {
        self.budget
            .record(now.saturating_duration_since(self.started), overloaded, now);
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.budget.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether a failed API request says the API server is overloaded: too many requests, a
/// server error, or no answer in time.
pub fn is_overload(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) => status.code == 429 || status.code >= 500,
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

impl StatusBudget {
    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a write of `priority` may go now; `None` means shed it (a refresh is tried again
    /// after [`StatusBudget::retry_after`], an Event is dropped).
    pub fn admit(&self, priority: Priority, now: Instant) -> Option<Admitted<'_>> {
        if priority != Priority::Transition {
            let in_flight = self.in_flight.load(Ordering::SeqCst);
            let limit = match priority {
                Priority::Event => EVENT_IN_FLIGHT,
                _ => REFRESH_IN_FLIGHT,
            };
            let health = self.health();
            let shedding = health.shed_until.is_some_and(|until| now < until);
            if shedding || health.latency > SLOW || in_flight >= limit {
                return None;
            }
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Some(Admitted {
            budget: self,
            started: now,
        })
    }

    /// When a shed refresh should be tried again: at the end of the back-off window, or in a
    /// second (the latency or the writes in flight must drop first).
    pub fn retry_after(&self, now: Instant) -> Duration {
        let health = self.health();
        health
            .shed_until
            .map(|until| until.saturating_duration_since(now))
            .filter(|left| !left.is_zero())
            .unwrap_or(FIRST_BACKOFF)
    }

    fn record(&self, took: Duration, overloaded: bool, now: Instant) {
        let mut health = self.health();
        // An exponentially weighted mean over about the last five writes.
        health.latency = (health.latency * 4 + took) / 5;
        if overloaded || took > SLOW {
            health.shed_until = Some(now + health.backoff);
            health.backoff = (health.backoff * 2).min(LONGEST_BACKOFF);
        } else if health.shed_until.is_none_or(|until| now >= until) {
            health.shed_until = None;
            health.backoff = FIRST_BACKOFF;
        }
    }

    /// Writes in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn transitions_always_go_refreshes_and_events_wait_their_turn() {
        let budget = StatusBudget::default();
        let now = Instant::now();
        let mut held = Vec::new();
        for _ in 0..EVENT_IN_FLIGHT {
            held.push(budget.admit(Priority::Refresh, now).expect("refresh"));
        }
        assert!(
            budget.admit(Priority::Event, now).is_none(),
            "events go last"
        );
        for _ in EVENT_IN_FLIGHT..REFRESH_IN_FLIGHT {
            held.push(budget.admit(Priority::Refresh, now).expect("refresh"));
        }
        assert!(budget.admit(Priority::Refresh, now).is_none());
        assert!(budget.admit(Priority::Transition, now).is_some());
        held.clear();
        assert_eq!(budget.in_flight(), 0);
        assert!(budget.admit(Priority::Event, now).is_some());
    }

    #[test]
    fn a_slow_api_server_gets_fewer_writes_until_it_recovers() {
        let budget = StatusBudget::default();
        let mut now = Instant::now();
        // Five writes of 3 s each: slow.
        for _ in 0..5 {
            budget
                .admit(Priority::Transition, now)
                .expect("transition")
                .done(now + 3000 * MS, false);
        }
        now += 3000 * MS;
        assert!(budget.admit(Priority::Refresh, now).is_none());
        assert!(budget.admit(Priority::Event, now).is_none());
        assert!(budget.admit(Priority::Transition, now).is_some());
        let wait = budget.retry_after(now);
        assert!(wait > Duration::ZERO && wait <= LONGEST_BACKOFF, "{wait:?}");
        // The back-off doubled at each slow write, up to its bound.
        assert_eq!(budget.health().backoff, Duration::from_secs(30));
        // Fast writes again: the smoothed latency falls, then the window ends.
        for _ in 0..20 {
            budget
                .admit(Priority::Transition, now)
                .expect("transition")
                .done(now + 10 * MS, false);
        }
        assert!(
            budget.admit(Priority::Refresh, now).is_none(),
            "still in the window"
        );
        now += LONGEST_BACKOFF;
        budget
            .admit(Priority::Transition, now)
            .expect("transition")
            .done(now + 10 * MS, false);
        assert!(budget.admit(Priority::Refresh, now + 10 * MS).is_some());
        assert_eq!(budget.health().backoff, FIRST_BACKOFF);
    }

    #[test]
    fn an_overloaded_answer_sheds_at_once() {
        let budget = StatusBudget::default();
        let now = Instant::now();
        budget
            .admit(Priority::Transition, now)
            .expect("transition")
            .done(now + 5 * MS, true);
        assert!(budget.admit(Priority::Refresh, now + 10 * MS).is_none());
        assert!(budget.admit(Priority::Refresh, now + 1100 * MS).is_some());
    }
}
