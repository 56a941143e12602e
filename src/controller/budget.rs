//! The status-write budget: what the controller asks of the API server, by priority. A grant,
//! a loss or a release (a transition) is always written; moving a held lease's `expiresAt`
//! forward (a refresh) is written only while the API server keeps up; an Event only while it is
//! idle enough. The API server counts as slow while the write sent last (of those answered)
//! took longer than [`SLOW`]: refreshes then go one at a time, as probes, and Events are
//! dropped, until a probe comes back in time. After an answer that says the API server is
//! overloaded (429, a 5xx, no answer), refreshes and Events wait for a back-off window that
//! doubles while such answers go on (1 s to 30 s). So a slow API server gets fewer writes from
//! this controller, not more, and the refreshes resume one round trip after it recovers.
//! Renewals never wait for any of this (see [`renewals`](super::renewals)): a shed refresh only
//! leaves `expiresAt` behind, never a lease unrenewed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A write answered later than this counts as slow.
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
    /// The answered write that was sent last: when, and how long it took.
    latest: Option<(Instant, Duration)>,
    /// After an overloaded answer, refreshes and Events wait until then.
    overloaded_until: Option<Instant>,
    /// The next back-off window.
    backoff: Duration,
    /// Whether a probe (a refresh let through while slow) is in flight.
    probing: bool,
}

impl Health {
    fn slow(&self) -> bool {
        self.latest.is_some_and(|(_, took)| took > SLOW)
    }

    fn overloaded(&self, now: Instant) -> bool {
        self.overloaded_until.is_some_and(|until| now < until)
    }
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
                latest: None,
                overloaded_until: None,
                backoff: FIRST_BACKOFF,
                probing: false,
            }),
        }
    }
}

/// A write admitted by [`StatusBudget::admit`]: counted in flight until it is dropped; report
/// how it went with [`Admitted::done`].
#[must_use]
pub struct Admitted<'a> {
    budget: &'a StatusBudget,
    sent: Instant,
    probe: bool,
}

impl Admitted<'_> {
    /// Records how the write went: `overloaded` when it failed in a way that says the API server
    /// is overloaded (see [`is_overload`]).
    pub fn done(self, now: Instant, overloaded: bool) {
        self.budget.record(self.sent, now, overloaded);
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.budget.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.probe {
            self.budget.health().probing = false;
        }
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
        let mut probe = false;
        if priority != Priority::Transition {
            let limit = match priority {
                Priority::Event => EVENT_IN_FLIGHT,
                _ => REFRESH_IN_FLIGHT,
            };
            let mut health = self.health();
            if health.overloaded(now) || self.in_flight.load(Ordering::SeqCst) >= limit {
                return None;
            }
            if health.slow() {
                if priority == Priority::Event || health.probing {
                    return None;
                }
                health.probing = true;
                probe = true;
            }
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Some(Admitted {
            budget: self,
            sent: now,
            probe,
        })
    }

    /// When a shed refresh should be tried again: at the end of the back-off window, or after
    /// the last write's round trip (at least a second, at most the longest window).
    pub fn retry_after(&self, now: Instant) -> Duration {
        let health = self.health();
        if let Some(until) = health.overloaded_until.filter(|until| now < *until) {
            return until - now;
        }
        health
            .latest
            .map_or(FIRST_BACKOFF, |(_, took)| took)
            .clamp(FIRST_BACKOFF, LONGEST_BACKOFF)
    }

    fn record(&self, sent: Instant, answered: Instant, overloaded: bool) {
        let mut health = self.health();
        // Only news counts: a write sent before the latest one answered says less about now.
        if health.latest.is_none_or(|(latest, _)| sent >= latest) {
            health.latest = Some((sent, answered.saturating_duration_since(sent)));
        }
        if overloaded {
            health.overloaded_until = Some(answered + health.backoff);
            health.backoff = (health.backoff * 2).min(LONGEST_BACKOFF);
        } else if !health.slow() {
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
    fn a_slow_api_server_gets_probes_until_it_recovers() {
        let budget = StatusBudget::default();
        let t0 = Instant::now();
        // A write that took 3 s: slow.
        budget
            .admit(Priority::Transition, t0)
            .expect("transition")
            .done(t0 + 3000 * MS, false);
        let now = t0 + 3000 * MS;
        assert!(
            budget.admit(Priority::Event, now).is_none(),
            "no Events while slow"
        );
        assert!(budget.admit(Priority::Transition, now).is_some());
        // One refresh at a time goes, as a probe.
        let probe = budget.admit(Priority::Refresh, now).expect("a probe");
        assert!(
            budget.admit(Priority::Refresh, now).is_none(),
            "one probe at a time"
        );
        assert_eq!(budget.retry_after(now), Duration::from_secs(3));
        // A write sent before the probe answers slowly after it: old news, ignored.
        let late = budget
            .admit(Priority::Transition, now - 10 * MS)
            .expect("transition");
        probe.done(now + 20 * MS, false);
        late.done(now + 5000 * MS, false);
        // The probe came back in time: refreshes and Events go again.
        let later = now + 5000 * MS;
        let first = budget.admit(Priority::Refresh, later).expect("refresh");
        let second = budget.admit(Priority::Refresh, later).expect("refresh");
        assert!(budget.admit(Priority::Event, later).is_some());
        drop((first, second));
    }

    #[test]
    fn a_probe_that_never_answers_lets_the_next_one_go() {
        let budget = StatusBudget::default();
        let t0 = Instant::now();
        budget
            .admit(Priority::Transition, t0)
            .expect("transition")
            .done(t0 + 2000 * MS, false);
        let now = t0 + 2000 * MS;
        drop(budget.admit(Priority::Refresh, now).expect("a probe"));
        assert!(
            budget.admit(Priority::Refresh, now).is_some(),
            "the next probe"
        );
    }

    #[test]
    fn overloaded_answers_shed_for_a_doubling_window() {
        let budget = StatusBudget::default();
        let mut now = Instant::now();
        for window in [1, 2, 4, 8, 16, 30, 30] {
            budget
                .admit(Priority::Transition, now)
                .expect("transition")
                .done(now + 5 * MS, true);
            now += 5 * MS;
            assert!(budget.admit(Priority::Refresh, now).is_none());
            assert_eq!(budget.retry_after(now), Duration::from_secs(window));
            now += Duration::from_secs(window);
            assert!(budget.admit(Priority::Refresh, now).is_some(), "{window} s");
        }
        // A good answer resets the window.
        budget
            .admit(Priority::Transition, now)
            .expect("transition")
            .done(now + 5 * MS, false);
        budget
            .admit(Priority::Transition, now + 5 * MS)
            .expect("transition")
            .done(now + 10 * MS, true);
        assert_eq!(budget.retry_after(now + 10 * MS), FIRST_BACKOFF);
    }
}

#[cfg(test)]
mod review_tests {
    use super::*;

    /// A write whose answer never comes: the reconcile is cancelled at its 30 s bound and the
    /// `Admitted` dropped without `done`. docs/controller.md counts "no answer" as an overload
    /// answer (refreshes and Events wait for a back-off window); the budget must not go on
    /// admitting refreshes as if the API server kept up.
    #[test]
    fn a_write_that_never_answers_counts_as_overload() {
        let budget = StatusBudget::default();
        let t0 = Instant::now();
        // Healthy so far.
        budget
            .admit(Priority::Transition, t0)
            .expect("transition")
            .done(t0 + Duration::from_millis(5), false);
        // 32 refreshes sent; none answered within the reconcile bound: all dropped.
        let hung: Vec<_> = (0..REFRESH_IN_FLIGHT)
            .map(|_| budget.admit(Priority::Refresh, t0).expect("refresh"))
            .collect();
        drop(hung);
        let later = t0 + Duration::from_secs(30);
        let admitted = budget.admit(Priority::Refresh, later).is_some();
        assert!(
            !admitted,
            "after {REFRESH_IN_FLIGHT} refreshes that never answered (each cancelled at 30 s), \
             the next refresh was admitted at once: no back-off, the budget still thinks the \
             API server keeps up"
        );
    }
}
