//! Leader election on a coordination.k8s.io Lease, written so that a leader fences itself.
//!
//! A replica leads until a deadline on its own monotonic clock: the moment it sent its last
//! successful renewal plus the Lease duration, minus a safety margin. Every store call and every
//! status write checks [`Leadership::check`] first, so a replica cut off from the API server
//! stops acting at that deadline even while its renewal requests hang. Another replica takes over
//! only after it has seen the Lease unchanged for the whole duration on *its* monotonic clock
//! (client-go's rule: no two clocks are compared), which is after the old leader's deadline by at
//! least the margin. What a cut-off leader sent before its deadline and arrives later is refused
//! by the resourceVersion precondition of every status write. A missing Lease is waited for the
//! same way (seen missing for the whole duration), since the deadline of whoever held it can no
//! longer be read; only the leader itself recreates it at once.
//!
//! Holding the Lease is worth something only while the work runs: a leader renews only while its
//! work has not returned and has reported, within the start bound, that it started (a controller
//! whose first list never completes would otherwise hold the Lease and do nothing). The work is
//! cancelled when it does not wind down in time, and the Lease given up only after that.
//!
//! kube-lease-manager (used before) reported leadership until the Lease expired by the local
//! clock only after it re-read the Lease, and never reported `false` while it could not reach the
//! API server; fixing that meant replacing its state machine, which is this file.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::warn;

/// The election's moves and the Lease's reads and writes; a controller starts it with
/// [`elector::lead`].
pub(crate) mod elector;

/// How long a leader's claim lasts without renewal unless configured otherwise, in seconds
/// (`--leader-election-seconds`, the chart's `controller.leaderElection.leaseDurationSeconds`).
pub const DEFAULT_DURATION_SECONDS: u64 = 10;

/// The longest the work gets to finish after it is told to stop (SIGTERM) before it is
/// cancelled. A leader gets less when its leadership ends sooner: after that it may not act.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Which Lease to compete for, and as whom.
#[derive(Clone, Debug)]
pub struct Election {
    /// Namespace of the coordination Lease (the controller's own).
    pub namespace: String,
    /// Name of the coordination Lease.
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a leader's claim lasts without renewal, in seconds.
    pub duration_seconds: u64,
}

impl Election {
    fn duration(&self) -> Duration {
        Duration::from_secs(self.duration_seconds.max(1))
    }

    /// How long before the others may take over a leader stops acting: a fifth of the
    /// duration, at least one second, at most half of it (so a leader acts at all).
    fn margin(&self) -> Duration {
        (self.duration() / 5)
            .max(Duration::from_secs(1))
            .min(self.duration() / 2)
    }

    /// How often the leader renews and a follower looks: a quarter of the duration, so a
    /// leader gets at least two attempts before its deadline.
    fn retry(&self) -> Duration {
        (self.duration() / 4).max(Duration::from_millis(100))
    }

    /// How long a leader acts after it sent its last successful renewal.
    fn acting(&self) -> Duration {
        self.duration() - self.margin()
    }

    /// The longest a replica that stopped renewing keeps the Lease before another takes over.
    pub fn takeover(&self) -> Duration {
        self.duration() + self.retry()
    }

    /// How long after it starts leading the work must have started (its first list of
    /// TargetLeases completed) for the leader to renew again: the duration.
    fn start_bound(&self) -> Duration {
        self.duration()
    }

    /// How long a replica whose work did not start stays out of the election after giving the
    /// Lease up, so that another replica takes it first.
    fn sit_out(&self) -> Duration {
        self.takeover()
    }

    /// How long the release of the Lease may take: a retry period, at most [`STOP_GRACE`].
    fn release_bound(&self) -> Duration {
        self.retry().min(STOP_GRACE)
    }

    #[cfg(test)]
    /// The longest from SIGTERM to the end of [`lead`](elector::lead): the work's grace (never past the
    /// leadership deadline), then the release of the Lease.
    pub fn stop_bound(&self) -> Duration {
        STOP_GRACE.min(self.acting()) + self.release_bound()
    }
}

/// Whether this replica may act: always without leader election, or until a deadline on this
/// process's monotonic clock that each renewal of the leader Lease moves forward.
#[derive(Clone, Debug)]
pub struct Leadership(Option<Arc<Term>>);

/// The shared state of an elected replica's leadership (its term).
#[derive(Debug)]
struct Term {
    /// Until when this replica may act; `None` while it does not lead.
    deadline: watch::Sender<Option<Instant>>,
    /// Whether the work of the current term has started.
    started: watch::Sender<bool>,
}

/// The refusal of [`Leadership::check`].
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error("this replica is not the leader (it could not confirm its leader Lease in time)")]
pub struct NotLeading;

impl Leadership {
    /// A replica that runs alone: it may always act.
    pub fn unconditional() -> Self {
        Self(None)
    }

    fn elected() -> Self {
        Self(Some(Arc::new(Term {
            deadline: watch::channel(None).0,
            started: watch::channel(false).0,
        })))
    }

    fn deadline(&self) -> Option<Instant> {
        *self.0.as_ref()?.deadline.borrow()
    }

    fn set(&self, deadline: Option<Instant>) {
        if let Some(t) = &self.0 {
            t.deadline.send_replace(deadline);
        }
    }

    /// Whether this replica may act now. Called before every store call and status write.
    pub fn check(&self) -> Result<(), NotLeading> {
        match &self.0 {
            None => Ok(()),
            Some(_) => match self.deadline() {
                Some(d) if Instant::now() < d => Ok(()),
                _ => Err(NotLeading),
            },
        }
    }

    /// Resolves once the leadership has lapsed (never for an unconditional one): at its
    /// deadline, or at once when this replica learns that another holds the Lease.
    pub async fn lapsed(&self) {
        let Some(t) = &self.0 else {
            return std::future::pending().await;
        };
        let mut deadline = t.deadline.subscribe();
        loop {
            match *deadline.borrow_and_update() {
                Some(d) if Instant::now() < d => {}
                _ => return,
            }
            let until = (*deadline.borrow()).unwrap_or_else(Instant::now);
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                _ = deadline.changed() => {}
            }
        }
    }

    /// Resolves once this replica leads.
    async fn leading(&self) {
        let Some(t) = &self.0 else {
            return;
        };
        let mut deadline = t.deadline.subscribe();
        while self.check().is_err() {
            if deadline.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Reports that the work under this leadership really runs: its first list of
    /// TargetLeases completed. Until then a leader renews its Lease only for
    /// [`Election::start_bound`], then gives it up.
    pub fn work_started(&self) {
        if let Some(t) = &self.0 {
            t.started.send_replace(true);
        }
    }

    fn begin_term(&self) {
        if let Some(t) = &self.0 {
            t.started.send_replace(false);
        }
    }

    fn has_started(&self) -> bool {
        self.0.as_ref().is_none_or(|t| *t.started.borrow())
    }
}

/// A future that completes when the work must stop.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send + Sync>>;

/// Resolves once `stop` turns true (or its sender is gone).
pub async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Waits for `work` until `by`, then cancels it (the caller drops it): a work that cannot wind
/// down (a controller whose first list never completed) must not hold the process or the Lease.
/// Returns whether it ended on its own.
async fn finish_by<Fut: Future<Output = ()>>(work: Pin<&mut Fut>, by: Instant) -> bool {
    let ended = tokio::time::timeout_at(by, work).await.is_ok();
    if !ended {
        warn!("the controller did not wind down in time; cancelling it");
    }
    ended
}

/// Runs `work` on a replica without leader election until `stop` turns true, then gives it
/// [`STOP_GRACE`] to finish and cancels it.
pub async fn run_alone<F, Fut>(work: F, stop: watch::Receiver<bool>, leading_gauge: Gauge)
where
    F: FnOnce(StopSignal, Leadership) -> Fut,
    Fut: Future<Output = ()>,
{
    leading_gauge.set(1);
    let mut running = Box::pin(work(
        Box::pin(stopped(stop.clone())),
        Leadership::unconditional(),
    ));
    tokio::select! {
        _ = &mut running => {}
        _ = stopped(stop) => {
            finish_by(running.as_mut(), Instant::now() + STOP_GRACE).await;
        }
    }
    leading_gauge.set(0);
}

#[cfg(test)]
mod tests {
    use super::elector::{Move, decide};
    use super::*;

    fn election(seconds: u64) -> Election {
        Election {
            namespace: "ns".into(),
            name: "lease".into(),
            identity: "me".into(),
            duration_seconds: seconds,
        }
    }

    /// A leader stops acting before anyone may take over, for every duration the flag allows,
    /// and renews at least twice before it must stop.
    #[test]
    fn a_leader_acts_and_stops_before_a_take_over() {
        for seconds in [2, 3, 10, 60, 3600] {
            let e = election(seconds);
            let acting = e.duration() - e.margin();
            assert!(acting > Duration::ZERO, "{seconds} s: a leader never acts");
            assert!(e.margin() >= Duration::from_secs(1).min(e.duration() / 2));
            assert!(
                e.retry() * 2 <= acting,
                "{seconds} s: fewer than two renewals"
            );
            assert!(e.takeover() > acting, "{seconds} s");
        }
    }

    /// A missing Lease is taken only by the leader at once, by anyone else only after the
    /// whole duration; a released one at once; one naming this replica is renewed; another's
    /// only once unchanged for what it claimed.
    #[test]
    fn a_missing_lease_waits_the_whole_duration() {
        let d = Duration::from_secs(3);
        let just_under = d - Duration::from_millis(1);
        assert_eq!(decide(false, None, "me", false, just_under, d), Move::Wait);
        assert_eq!(decide(false, None, "me", false, d, d), Move::Take);
        assert_eq!(
            decide(false, None, "me", true, Duration::ZERO, d),
            Move::Take,
            "the leader recreates its Lease"
        );
        assert_eq!(
            decide(true, None, "me", false, Duration::ZERO, d),
            Move::Take
        );
        assert_eq!(
            decide(true, Some("me"), "me", false, Duration::ZERO, d),
            Move::Renew
        );
        assert_eq!(
            decide(true, Some("other"), "me", false, just_under, d),
            Move::Wait
        );
        assert_eq!(decide(true, Some("other"), "me", false, d, d), Move::Take);
        assert_eq!(
            decide(true, Some("other"), "me", true, just_under, d),
            Move::Wait,
            "a Lease that names another is never taken early"
        );
    }

    /// The work's start bound leaves renewals to come before the deadline; a stop is bounded
    /// below the Kubernetes default grace period (30 s) for every duration the flag allows.
    #[test]
    fn start_and_stop_are_bounded() {
        for seconds in [2, 3, 10, 60, 3600] {
            let e = election(seconds);
            assert!(e.start_bound() >= e.retry() * 2, "{seconds} s");
            assert!(e.stop_bound() < Duration::from_secs(30), "{seconds} s");
            assert!(e.sit_out() >= e.takeover(), "{seconds} s");
        }
        assert_eq!(election(3).stop_bound(), Duration::from_millis(2750));
        assert_eq!(election(10).stop_bound(), Duration::from_millis(7500));
    }

    /// A work that never winds down is cancelled at the bound; one that does is not waited for
    /// longer than it takes.
    #[tokio::test(start_paused = true)]
    async fn a_stuck_work_is_cancelled_at_the_bound() {
        let start = Instant::now();
        let mut stuck = Box::pin(std::future::pending::<()>());
        assert!(!finish_by(stuck.as_mut(), start + Duration::from_secs(2)).await);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        let start = Instant::now();
        let mut quick = Box::pin(tokio::time::sleep(Duration::from_millis(300)));
        assert!(finish_by(quick.as_mut(), start + Duration::from_secs(2)).await);
        assert_eq!(start.elapsed(), Duration::from_millis(300));
    }

    /// Without election, SIGTERM ends a work that ignores its signal within the grace.
    #[tokio::test(start_paused = true)]
    async fn run_alone_is_bounded() {
        let (stop_tx, stop) = watch::channel(false);
        let gauge = Gauge::default();
        let start = Instant::now();
        let run = run_alone(
            |_signal, _leadership| std::future::pending::<()>(),
            stop,
            gauge.clone(),
        );
        let sigterm = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert_eq!(gauge.get(), 1);
            stop_tx.send_replace(true);
        };
        tokio::join!(run, sigterm);
        assert_eq!(start.elapsed(), Duration::from_secs(1) + STOP_GRACE);
        assert_eq!(gauge.get(), 0);
    }

    /// Learning that another replica holds the Lease ends the leadership at once, not at the
    /// old deadline.
    #[tokio::test(start_paused = true)]
    async fn lapsed_wakes_when_the_leadership_is_withdrawn() {
        let l = Leadership::elected();
        l.set(Some(Instant::now() + Duration::from_secs(10)));
        let start = Instant::now();
        let withdraw = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            l.set(None);
        };
        tokio::join!(l.lapsed(), withdraw);
        assert_eq!(start.elapsed(), Duration::from_millis(500));
        assert!(!l.has_started());
        l.work_started();
        assert!(l.has_started());
        l.begin_term();
        assert!(!l.has_started(), "a new term starts unstarted");
        assert!(Leadership::unconditional().has_started());
    }

    #[tokio::test(start_paused = true)]
    async fn leadership_lapses_at_its_deadline_and_can_come_back() {
        assert!(Leadership::unconditional().check().is_ok());
        let l = Leadership::elected();
        assert!(l.check().is_err(), "not leading before the first renewal");
        l.set(Some(Instant::now() + Duration::from_secs(2)));
        assert!(l.check().is_ok());
        tokio::time::advance(Duration::from_millis(1999)).await;
        assert!(l.check().is_ok());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(l.check().is_err(), "acted at its deadline");
        l.lapsed().await;
        l.set(Some(Instant::now() + Duration::from_secs(2)));
        assert!(l.check().is_ok(), "a renewal after a lapse leads again");
    }
}
