//! The status-write budget: what the controller asks of the API server, by priority. A grant,
//! a loss or a release (a transition) is always written, at once. Moving a held lease's
//! `expiresAt` forward (a refresh) and publishing an Event use only what the API server has to
//! spare: they may have a window of writes in flight, which grows by one at each answer that
//! came within [`TARGET`] and halves (at most once per round trip) at each one that did not, so
//! their rate follows what the API server serves without its latency growing; Events get half
//! of the window, none while it is one. After an answer that says the API server is overloaded
//! (429, a 5xx, a write that never answered), none goes for a back-off window that doubles while
//! such answers go on (1 s to 30 s). So a slow API server gets fewer writes from this
//! controller, not more, and the refreshes resume within a few round trips after it recovers.
//! Renewals never wait for any of this (see [`renewals`](super::renewals)): a shed refresh only
//! leaves `expiresAt` behind, never a lease unrenewed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The latency of a write above which the API server counts as busy: refreshes and Events
/// narrow their window.
pub(crate) const TARGET: Duration = Duration::from_millis(100);

/// The widest window of refreshes and Events in flight.
pub(crate) const WIDEST: usize = 16;

const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const LONGEST_BACKOFF: Duration = Duration::from_secs(30);

/// What a write is for, highest priority first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Priority {
    /// A phase, token, owner or condition changes: always written.
    Transition,
    /// Only `expiresAt` moves forward: written within the window.
    Refresh,
    /// An events.k8s.io Event: published within half the window.
    Event,
}

#[derive(Debug)]
struct Health {
    /// When the newest answered write was sent.
    latest_sent: Option<Instant>,
    /// Refreshes and Events allowed in flight.
    window: usize,
    /// When the window last halved: only a write sent after that may halve it again.
    narrowed_at: Option<Instant>,
    /// After an overloaded answer, refreshes and Events wait until then.
    overloaded_until: Option<Instant>,
    /// The next back-off window.
    backoff: Duration,
}

/// Shared by every reconcile; no clock of its own (each call is given `now`).
#[derive(Debug)]
pub(crate) struct StatusBudget {
    /// Refreshes and Events in flight.
    spare_in_flight: AtomicUsize,
    health: Mutex<Health>,
}

impl Default for StatusBudget {
    fn default() -> Self {
        Self {
            spare_in_flight: AtomicUsize::new(0),
            health: Mutex::new(Health {
                latest_sent: None,
                window: WIDEST,
                narrowed_at: None,
                overloaded_until: None,
                backoff: FIRST_BACKOFF,
            }),
        }
    }
}

/// A write admitted by [`StatusBudget::admit`]. Report how it went with [`Admitted::done`]; one
/// dropped without a report (its reconcile cancelled at its bound: no answer came) counts as an
/// overloaded answer.
#[must_use]
pub(crate) struct Admitted<'a> {
    budget: &'a StatusBudget,
    sent: Instant,
    spare: bool,
    done: bool,
}

impl Admitted<'_> {
    /// Records how the write went: `overloaded` when it failed in a way that says the API server
    /// is overloaded (see [`is_overload`]).
    pub(crate) fn done(mut self, now: Instant, overloaded: bool) {
        self.done = true;
        self.budget.record(self.sent, now, overloaded);
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if self.spare {
            self.budget.spare_in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        if !self.done {
            self.budget.record(self.sent, Instant::now(), true);
        }
    }
}

/// Whether a failed API request says the API server is overloaded: too many requests, a
/// server error, or no answer in time.
pub(crate) fn is_overload(error: &kube::Error) -> bool {
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
    /// at the lease's next renewal, an Event is dropped).
    pub(crate) fn admit(&self, priority: Priority, now: Instant) -> Option<Admitted<'_>> {
        let spare = priority != Priority::Transition;
        if spare {
            let health = self.health();
            let limit = match priority {
                Priority::Event => health.window / 2,
                _ => health.window,
            };
            let overloaded = health.overloaded_until.is_some_and(|until| now < until);
            if overloaded || self.spare_in_flight.load(Ordering::SeqCst) >= limit {
                return None;
            }
            self.spare_in_flight.fetch_add(1, Ordering::SeqCst);
        }
        Some(Admitted {
            budget: self,
            sent: now,
            spare,
            done: false,
        })
    }

    fn record(&self, sent: Instant, answered: Instant, overloaded: bool) {
        let mut health = self.health();
        let took = answered.saturating_duration_since(sent);
        let newest = health.latest_sent.is_none_or(|latest| sent >= latest);
        if newest {
            health.latest_sent = Some(sent);
        }
        let may_narrow = health.narrowed_at.is_none_or(|at| sent > at);
        if overloaded {
            health.overloaded_until = Some(answered + health.backoff);
            health.backoff = (health.backoff * 2).min(LONGEST_BACKOFF);
            health.window = 1;
            health.narrowed_at = Some(answered);
        } else if took > TARGET {
            if may_narrow {
                health.window = (health.window / 2).max(1);
                health.narrowed_at = Some(answered);
            }
        } else if newest {
            health.window = (health.window + 1).min(WIDEST);
            health.backoff = FIRST_BACKOFF;
        }
    }

    #[cfg(test)]
    /// Refreshes and Events allowed in flight now.
    pub(crate) fn window(&self) -> usize {
        self.health().window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Whether a write of `priority` is admitted at `now`; if it is, it answers at once.
    fn admitted(budget: &StatusBudget, priority: Priority, now: Instant) -> bool {
        budget
            .admit(priority, now)
            .map(|write| write.done(now, false))
            .is_some()
    }

    fn answered(budget: &StatusBudget, sent: Instant, took: Duration, overloaded: bool) {
        budget
            .admit(Priority::Transition, sent)
            .expect("transitions always go")
            .done(sent + took, overloaded);
    }

    #[test]
    fn transitions_always_go_refreshes_and_events_share_the_window() {
        let budget = StatusBudget::default();
        let now = Instant::now();
        let mut held = Vec::new();
        for _ in 0..WIDEST / 2 {
            held.push(budget.admit(Priority::Refresh, now).expect("refresh"));
        }
        assert!(
            budget.admit(Priority::Event, now).is_none(),
            "events get half"
        );
        for _ in WIDEST / 2..WIDEST {
            held.push(budget.admit(Priority::Refresh, now).expect("refresh"));
        }
        assert!(budget.admit(Priority::Refresh, now).is_none());
        answered(&budget, now, 5 * MS, false);
        for write in held.drain(..) {
            write.done(now + 5 * MS, false);
        }
        assert!(admitted(&budget, Priority::Event, now));
    }

    #[test]
    fn slow_answers_narrow_the_window_once_per_round_trip_and_fast_ones_widen_it() {
        let budget = StatusBudget::default();
        let t0 = Instant::now();
        // Three slow answers of writes sent together: one halving.
        for _ in 0..3 {
            answered(&budget, t0, 3000 * MS, false);
        }
        assert_eq!(budget.window(), WIDEST / 2);
        // Sent after that halving, slow again: halves again, down to one.
        let mut at = t0 + 3001 * MS;
        for _ in 0..10 {
            answered(&budget, at, 3000 * MS, false);
            at += 3001 * MS;
        }
        assert_eq!(budget.window(), 1);
        assert!(
            budget.admit(Priority::Event, at).is_none(),
            "no Events at one"
        );
        let probe = budget.admit(Priority::Refresh, at).expect("one refresh");
        assert!(budget.admit(Priority::Refresh, at).is_none());
        // It comes back in time: the window widens by one per fast answer.
        probe.done(at + 10 * MS, false);
        assert_eq!(budget.window(), 2);
        // A write sent before it, answered slowly after it, is old news: no halving.
        answered(&budget, at - 5 * MS, 4000 * MS, false);
        assert_eq!(budget.window(), 2);
        for i in 0..WIDEST {
            answered(&budget, at + (20 + i as u32) * MS, 10 * MS, false);
        }
        assert_eq!(budget.window(), WIDEST);
    }

    #[test]
    fn overloaded_answers_shed_for_a_doubling_window() {
        let budget = StatusBudget::default();
        let mut at = Instant::now();
        answered(&budget, at, 5 * MS, true);
        at += 5 * MS;
        for window in [1, 2, 4, 8, 16, 30, 30] {
            let window = Duration::from_secs(window);
            assert!(budget.admit(Priority::Refresh, at + window - MS).is_none());
            at += window;
            let write = budget
                .admit(Priority::Refresh, at)
                .expect("after the window");
            // Overloaded again: the next window is twice as long.
            write.done(at + 5 * MS, true);
            at += 5 * MS;
        }
        // A good answer resets the back-off to its first window.
        answered(&budget, at, 5 * MS, false);
        answered(&budget, at + 10 * MS, 5 * MS, true);
        assert!(budget.admit(Priority::Refresh, at + 1014 * MS).is_none());
        assert!(admitted(&budget, Priority::Refresh, at + 1016 * MS));
    }
}

#[cfg(test)]
mod hung_write_tests {
    use super::*;

    /// A write whose answer never comes: the reconcile is cancelled at its 30 s bound and the
    /// `Admitted` dropped without `done`. docs/internals/controller.md counts "no answer" as an
    /// overload answer (refreshes and Events wait for a back-off window); the budget must not go on
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
        let hung: Vec<_> = (0..WIDEST)
            .map(|_| budget.admit(Priority::Refresh, t0).expect("refresh"))
            .collect();
        drop(hung);
        let later = t0 + Duration::from_secs(30);
        let admitted = budget.admit(Priority::Refresh, later).is_some();
        assert!(
            !admitted,
            "after {WIDEST} refreshes that never answered (each cancelled at 30 s), \
             the next refresh was admitted at once: no back-off, the budget still thinks the \
             API server keeps up"
        );
    }
}
