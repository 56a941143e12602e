//! The elector: competes for the coordination.k8s.io Lease, renews it while the work runs, and
//! moves this replica's [`Leadership`] deadline with every renewal (see the module above for
//! the rules it keeps).

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{Election, Leadership, STOP_GRACE, StopSignal, finish_by, stopped};

pub(super) fn now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

/// What one look at the Lease found.
pub(super) enum Look {
    /// This replica holds the Lease; the renewal was sent at the instant given.
    Leading(Instant),
    /// Another replica holds it, or nobody may take it yet.
    Following,
}

/// What a look may do with the Lease it read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Move {
    /// It names this replica: renew it (a compare-and-swap, so only if nobody took it since).
    Renew,
    /// Take it (create it when it is missing, else replace it).
    Take,
    /// Leave it: another replica may still act.
    Wait,
}

/// The election's rule. `present`: the Lease exists; `holder`: whom it names (empty when
/// released); `leading`: this replica leads now; `unchanged_for`: how long this replica has
/// seen the Lease in this state (missing, or at this resourceVersion) on its own clock;
/// `claimed_for`: the longest duration a holder may have claimed.
///
/// A missing Lease is taken like an unrenewed one, once seen missing for the whole duration:
/// its last holder acts until its own deadline, which no one else can read once it is gone.
/// Only the leader recreates it at once. A released Lease (no holder) was given up after the
/// work stopped, so it is taken at once.
pub(super) fn decide(
    present: bool,
    holder: Option<&str>,
    me: &str,
    leading: bool,
    unchanged_for: Duration,
    claimed_for: Duration,
) -> Move {
    match (present, holder) {
        (true, Some(h)) if h == me => Move::Renew,
        (true, None) => Move::Take,
        (false, _) if leading => Move::Take,
        _ if unchanged_for >= claimed_for => Move::Take,
        _ => Move::Wait,
    }
}

/// What a follower saw of the Lease, and since when on its monotonic clock.
struct Seen {
    /// The resourceVersion, or `None` for a missing Lease.
    version: Option<String>,
    since: Instant,
}

/// The state of one replica between looks: the Lease version it last saw and since when.
struct Elector {
    api: Api<Lease>,
    election: Election,
    seen: Option<Seen>,
    /// The longest duration a Lease seen so far claimed: a missing Lease is waited for as long.
    claimed: Duration,
}

impl Elector {
    /// Creates, renews or takes over the Lease, or notes who holds it. `leading`: whether this
    /// replica leads now (only a leader recreates a missing Lease at once).
    async fn look(&mut self, leading: bool) -> Result<Look, kube::Error> {
        let sent = Instant::now();
        let me = self.election.identity.clone();
        let lease = self.api.get_opt(&self.election.name).await?;
        let spec = lease
            .as_ref()
            .and_then(|l| l.spec.clone())
            .unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let version = lease
            .as_ref()
            .map(|l| l.resource_version().unwrap_or_default());
        let since = match &self.seen {
            Some(seen) if seen.version == version => seen.since,
            _ => {
                let since = Instant::now();
                self.seen = Some(Seen { version, since });
                since
            }
        };
        if let Some(seconds) = spec.lease_duration_seconds {
            let claimed = Duration::from_secs(u64::try_from(seconds).unwrap_or(0));
            self.claimed = self.election.duration().max(claimed);
        }
        let step = decide(
            lease.is_some(),
            holder.as_deref(),
            &me,
            leading,
            since.elapsed(),
            self.claimed,
        );
        match (step, lease) {
            (Move::Wait, _) => Ok(Look::Following),
            (_, None) => {
                info!(identity = %me, "creating the leader Lease");
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.election.name.clone()),
                        namespace: Some(self.election.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(self.spec_for_me(0)),
                };
                match self.api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(Look::Leading(sent)),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(Look::Following),
                    Err(e) => Err(e),
                }
            }
            (Move::Renew, Some(mut lease)) => {
                let mut renewed = spec;
                renewed.renew_time = Some(now());
                renewed.lease_duration_seconds = Some(self.duration_field());
                lease.spec = Some(renewed);
                self.replace(&lease, sent).await
            }
            (Move::Take, Some(mut lease)) => {
                let transitions = spec.lease_transitions.unwrap_or(0) + 1;
                lease.spec = Some(self.spec_for_me(transitions));
                info!(identity = %me, previous = ?holder, "taking over the leader Lease");
                self.replace(&lease, sent).await
            }
        }
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

    /// One look bounded by the retry period; a renewal moves the deadline forward, a look
    /// that finds another holder ends the leadership at once. Returns whether this replica
    /// leads.
    async fn look_and_set(&mut self, leadership: &Leadership) -> bool {
        let leading = leadership.check().is_ok();
        match tokio::time::timeout(self.election.retry(), self.look(leading)).await {
            Ok(Ok(Look::Leading(sent))) => {
                leadership.set(Some(sent + self.election.acting()));
            }
            Ok(Ok(Look::Following)) => leadership.set(None),
            Ok(Err(e)) => warn!(error = %e, "could not renew or read the leader Lease"),
            Err(_) => warn!("the leader Lease call timed out"),
        }
        leadership.check().is_ok()
    }

    /// Looks every retry period until this replica leads (true) or `stop` turns true (false).
    async fn follow(&mut self, leadership: &Leadership, stop: &mut watch::Receiver<bool>) -> bool {
        loop {
            tokio::select! {
                leads = self.look_and_set(leadership) => if leads {
                    return true;
                },
                _ = stop.wait_for(|s| *s) => return false,
            }
            tokio::select! {
                _ = tokio::time::sleep(self.election.retry()) => {}
                _ = stop.wait_for(|s| *s) => return false,
            }
        }
    }

    /// Renews every retry period while the work is alive and has started; returns when it
    /// has not started within the start bound, or another replica holds the Lease.
    async fn renew(&mut self, leadership: &Leadership, began: Instant) -> Ended {
        loop {
            tokio::time::sleep(self.election.retry()).await;
            if !leadership.has_started() && began.elapsed() >= self.election.start_bound() {
                warn!(
                    bound_ms = self.election.start_bound().as_millis() as u64,
                    "the controller did not start within the bound (its first list of \
                     TargetLeases has not completed): giving the leader Lease up"
                );
                return Ended::Stuck;
            }
            if !self.look_and_set(leadership).await && leadership.deadline().is_none() {
                return Ended::Lost;
            }
        }
    }

    /// Gives the Lease up (a clean shutdown), so a successor takes over at once. Bounded: a
    /// replica cut off from the API server must not hang its shutdown.
    async fn release(&self) {
        if tokio::time::timeout(self.election.release_bound(), self.give_up())
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

/// Why a term ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    /// The process is stopping.
    Stop,
    /// The leadership lapsed, or another replica holds the Lease.
    Lost,
    /// The work did not start within the start bound, or returned on its own.
    Stuck,
}

/// Runs `work` whenever this replica leads, until `stop` turns true. `work` gets a signal that
/// fires when it must stop, and the [`Leadership`] to check before acting and to report, with
/// [`Leadership::work_started`], that it really runs.
///
/// The Lease is renewed only while the work has not returned and has started within
/// [`Election::start_bound`]. A work told to stop gets until the leadership deadline, at most
/// [`STOP_GRACE`], and is then cancelled; only after it is gone is the Lease given up (on stop,
/// or when the work did not start), so two replicas never act at once.
pub async fn lead<F, Fut>(
    client: Client,
    election: Election,
    mut stop: watch::Receiver<bool>,
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
        claimed: election.duration(),
    };
    let leadership = Leadership::elected();
    // The gauge follows the leadership itself, so it reads 0 from the deadline on even while
    // the work winds down.
    let gauge = {
        let (leadership, leading_gauge) = (leadership.clone(), leading_gauge.clone());
        async move {
            loop {
                leadership.leading().await;
                leading_gauge.set(1);
                leadership.lapsed().await;
                leading_gauge.set(0);
            }
        }
    };
    let terms = async {
        while elector.follow(&leadership, &mut stop).await {
            leadership.begin_term();
            let began = Instant::now();
            info!(identity = %election.identity, lease = %election.name, "became leader");
            let (end, ended) = watch::channel(false);
            let mut running = Box::pin(work(Box::pin(stopped(ended)), leadership.clone()));
            let (why, returned) = tokio::select! {
                _ = &mut running => {
                    warn!("the controller stopped on its own; giving the leader Lease up");
                    (Ended::Stuck, true)
                }
                why = elector.renew(&leadership, began) => (why, false),
                _ = leadership.lapsed() => {
                    warn!("leadership lapsed (the leader Lease could not be renewed in time); stopping");
                    (Ended::Lost, false)
                }
                _ = stop.wait_for(|s| *s) => (Ended::Stop, false),
            };
            if why == Ended::Stuck {
                // It did nothing: there is nothing to let finish.
                leadership.set(None);
            }
            end.send_replace(true);
            if !returned {
                let now = Instant::now();
                let by = leadership
                    .deadline()
                    .map_or(now, |d| d.max(now))
                    .min(now + STOP_GRACE);
                finish_by(running.as_mut(), by).await;
            }
            drop(running);
            leadership.set(None);
            match why {
                Ended::Stop => {
                    elector.release().await;
                    return;
                }
                Ended::Stuck => {
                    elector.release().await;
                    tokio::select! {
                        _ = tokio::time::sleep(election.sit_out()) => {}
                        _ = stop.wait_for(|s| *s) => return,
                    }
                }
                Ended::Lost => {}
            }
        }
    };
    tokio::select! {
        _ = terms => {}
        _ = gauge => {}
    }
    leading_gauge.set(0);
    Ok(())
}
