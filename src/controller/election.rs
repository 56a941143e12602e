//! Leader election on a coordination.k8s.io Lease, written so that a leader fences itself.
//!
//! A replica leads until a deadline on its own monotonic clock: the moment it sent its last
//! successful renewal plus the Lease duration, minus a safety margin. Every store call and every
//! status write checks [`Leadership::check`] first, so a replica cut off from the API server
//! stops acting at that deadline even while its renewal requests hang. Another replica takes over
//! only after it has seen the Lease unchanged for the whole duration on *its* monotonic clock
//! (client-go's rule: no two clocks are compared), which is after the old leader's deadline by at
//! least the margin. What a cut-off leader sent before its deadline and arrives later is refused
//! by the resourceVersion precondition of every status write.
//!
//! kube-lease-manager (used before) reported leadership until the Lease expired by the local
//! clock only after it re-read the Lease, and never reported `false` while it could not reach the
//! API server; fixing that meant replacing its state machine, which is this file.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

/// How long a leader's claim lasts without renewal unless configured otherwise, in seconds
/// (`--leader-election-seconds`, the chart's `controller.leaderElection.leaseDurationSeconds`).
pub const DEFAULT_DURATION_SECONDS: u64 = 10;

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

    /// The longest a replica that stopped renewing keeps the Lease before another takes over.
    pub fn takeover(&self) -> Duration {
        self.duration() + self.retry()
    }
}

/// Whether this replica may act: always without leader election, or until a deadline on this
/// process's monotonic clock that each renewal of the leader Lease moves forward.
#[derive(Clone, Debug)]
pub struct Leadership(Option<Arc<Mutex<Option<Instant>>>>);

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
        Self(Some(Arc::new(Mutex::new(None))))
    }

    fn deadline(&self) -> Option<Instant> {
        let cell = self.0.as_ref()?;
        *cell.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, deadline: Option<Instant>) {
        if let Some(cell) = &self.0 {
            *cell.lock().unwrap_or_else(|e| e.into_inner()) = deadline;
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

    /// Resolves once the leadership has lapsed (never for an unconditional one).
    pub async fn lapsed(&self) {
        if self.0.is_none() {
            return std::future::pending().await;
        }
        loop {
            match self.deadline() {
                Some(d) if Instant::now() < d => tokio::time::sleep_until(d).await,
                _ => return,
            }
        }
    }
}

/// A future that completes when the work must stop.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send + Sync>>;

/// Resolves once `stop` turns true (or its sender is gone).
pub async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

fn now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

/// What one look at the Lease found.
enum Look {
    /// This replica holds the Lease; the renewal was sent at the instant given.
    Leading(Instant),
    /// Another replica holds it.
    Following,
}

/// The state of one replica between looks: the Lease version it last saw and since when.
struct Elector {
    api: Api<Lease>,
    election: Election,
    seen: Option<(String, Instant)>,
}

impl Elector {
    /// Creates, renews or takes over the Lease, or notes who holds it.
    async fn look(&mut self) -> Result<Look, kube::Error> {
        let sent = Instant::now();
        let me = self.election.identity.clone();
        let Some(mut lease) = self.api.get_opt(&self.election.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.election.name.clone()),
                    namespace: Some(self.election.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec_for_me(0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Look::Leading(sent)),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(Look::Following),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        if holder.as_deref() == Some(me.as_str()) {
            let mut renewed = spec;
            renewed.renew_time = Some(now());
            renewed.lease_duration_seconds = Some(self.duration_field());
            lease.spec = Some(renewed);
            return self.replace(&lease, sent).await;
        }
        let version = lease.resource_version().unwrap_or_default();
        let since = match &self.seen {
            Some((v, since)) if *v == version => *since,
            _ => {
                self.seen = Some((version, Instant::now()));
                Instant::now()
            }
        };
        let claimed_for = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(0))
                .unwrap_or(0)
                .max(self.election.duration_seconds),
        );
        if holder.is_some() && since.elapsed() < claimed_for {
            return Ok(Look::Following);
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + 1;
        lease.spec = Some(self.spec_for_me(transitions));
        info!(identity = %me, previous = ?holder, "taking over the leader Lease");
        self.replace(&lease, sent).await
    }

    fn duration_field(&self) -> i32 {
        i32::try_from(self.election.duration_seconds).unwrap_or(i32::MAX)
    }

    fn spec_for_me(&self, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.election.identity.clone()),
            lease_duration_seconds: Some(self.duration_field()),
            acquire_time: Some(now()),
            renew_time: Some(now()),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Replaces the Lease; its resourceVersion makes this a compare-and-swap.
    async fn replace(&self, lease: &Lease, sent: Instant) -> Result<Look, kube::Error> {
        match self
            .api
            .replace(&self.election.name, &PostParams::default(), lease)
            .await
        {
            Ok(_) => Ok(Look::Leading(sent)),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(Look::Following),
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up (a clean shutdown), so a successor takes over at once. Bounded by the
    /// retry period: a replica cut off from the API server must not hang its shutdown.
    async fn release(&self) {
        if tokio::time::timeout(self.election.retry(), self.give_up())
            .await
            .is_err()
        {
            warn!("could not release the leader Lease in time; a successor waits for it to expire");
        }
    }

    async fn give_up(&self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.election.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.election.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = Some(now());
        if let Err(e) = self
            .api
            .replace(&self.election.name, &PostParams::default(), &lease)
            .await
        {
            warn!(error = %e, "could not release the leader Lease; a successor waits for it to expire");
        }
    }
}

/// Runs `work` whenever this replica leads, until `stop` turns true. `work` gets a signal that
/// fires when leadership lapses or the process stops, and the [`Leadership`] to check before
/// acting; it must wind down when the signal fires.
pub async fn lead<F, Fut>(
    client: Client,
    election: Election,
    stop: watch::Receiver<bool>,
    leading_gauge: Gauge,
    mut work: F,
) -> Result<(), kube::Error>
where
    F: FnMut(StopSignal, Leadership) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut elector = Elector {
        api: Api::namespaced(client, &election.namespace),
        election: election.clone(),
        seen: None,
    };
    let leadership = Leadership::elected();
    // The elector runs beside the work, so renewals go on while it runs; it ends when `stop`
    // turns true and hands the elector back for the release.
    let (leading_tx, mut leading) = watch::channel(false);
    let renewals = {
        let (leadership, election) = (leadership.clone(), election.clone());
        let mut stop = stop.clone();
        async move {
            loop {
                match tokio::time::timeout(election.retry(), elector.look()).await {
                    Ok(Ok(Look::Leading(sent))) => {
                        leadership.set(Some(sent + election.duration() - election.margin()));
                    }
                    Ok(Ok(Look::Following)) => leadership.set(None),
                    Ok(Err(e)) => warn!(error = %e, "could not renew or read the leader Lease"),
                    Err(_) => warn!("the leader Lease call timed out"),
                }
                // After every look, changed or not: a leader whose leadership lapsed and came back
                // between two looks (a short API outage) must be woken to run its work again.
                leading_tx.send_replace(leadership.check().is_ok());
                tokio::select! {
                    _ = tokio::time::sleep(election.retry()) => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
            elector
        }
    };
    tokio::pin!(renewals);
    let elector = 'run: loop {
        if *stop.borrow() {
            break (&mut renewals).await;
        }
        // Wait until this replica leads; `renewals` ends only when the process stops.
        while leadership.check().is_err() {
            tokio::select! {
                elector = &mut renewals => break 'run elector,
                _ = leading.changed() => {}
            }
        }
        info!(identity = %election.identity, lease = %election.name, "became leader");
        leading_gauge.set(1);
        let signal: StopSignal = {
            let (stop, leadership) = (stop.clone(), leadership.clone());
            let gauge = leading_gauge.clone();
            Box::pin(async move {
                tokio::select! {
                    _ = stopped(stop) => {}
                    _ = leadership.lapsed() => {
                        gauge.set(0);
                        warn!("leadership lapsed (the leader Lease could not be renewed in time); stopping");
                    }
                }
            })
        };
        let running = work(signal, leadership.clone());
        tokio::pin!(running);
        // Keep renewing while the work runs; the work ends on its own once its signal fired.
        tokio::select! {
            _ = &mut running => {}
            elector = &mut renewals => {
                running.await;
                leading_gauge.set(0);
                break 'run elector;
            }
        }
        leading_gauge.set(0);
    };
    // A clean stop gives the Lease up: a successor takes over at once instead of waiting out
    // the duration. Only after the work has ended, so two replicas never act at once.
    if leadership.check().is_ok() {
        leadership.set(None);
        elector.release().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
