//! The TargetLease controller: watches TargetLeases, keeps their leases in the store, and writes
//! status on transitions.

mod claim;
mod context;
mod decide;
mod error;
pub mod finalizer;
#[cfg(test)]
mod fixtures;
mod holders;
pub mod http;
pub mod installation;
pub(crate) mod line;
pub mod metrics;
mod reconcile;
mod scope;
pub mod status;
mod tenure;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use self::claim::Claim;
use self::context::{Context, Parts};
pub use self::error::Error;
use self::holders::Holders;
pub(crate) use self::holders::PodScope;
use self::installation::Installations;
use self::line::Line;
use self::metrics::Metrics;
use self::status::StatusWriter;
pub(crate) use self::tenure::DEFAULT_CONCURRENCY as DEFAULT_RENEWAL_CONCURRENCY;
use self::tenure::Tenures;
use crate::api::{FIELD_MANAGER, TargetLease};
use crate::election::{self, Leadership};
use crate::store::LeaseStore;

/// Where and as whom the controller runs.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// The namespaces watched: these (one or several), or every namespace when empty.
    pub(crate) namespaces: Vec<String>,
    /// Where holder pods are read (see [`PodScope`]).
    pub(crate) holder_pods: PodScope,
    /// This replica's name, in events.
    pub(crate) identity: String,
    /// The shortest `ttlSeconds` this controller can keep (see [`shortest_ttl`]).
    pub(crate) shortest_ttl: Duration,
    /// Reconciles running at once, at most.
    pub(crate) reconcile_concurrency: u16,
    /// Renewals in flight at once, at most.
    pub(crate) renewal_concurrency: usize,
    /// This installation's id: the namespaces it acts in are marked with it
    /// ([`installation`]).
    pub(crate) installation: String,
}

/// Reconciles running at once by default. Each makes at most one store call and one status
/// write; bounding them keeps a burst of new TargetLeases from putting thousands of requests in
/// flight on the API server at once (which then time out together), while renewals do not wait
/// for reconciles at all.
pub(crate) const DEFAULT_RECONCILE_CONCURRENCY: u16 = 64;

/// The shortest TTL this controller can keep a lease for, from its own timings: a renewal
/// (every TTL/3) must be able to take a whole call timeout before the next one is due, and with
/// leader election, after the leader's last renewal (up to TTL/3 before it died) a successor
/// must take over, start and renew within the two thirds of the TTL that are left:
/// `max(3 x call timeout, 1.5 x (take-over + call timeout + 1 s to start))`, in whole seconds.
pub(crate) fn shortest_ttl(
    call_timeout: Duration,
    election: Option<&election::Election>,
) -> Duration {
    let renewing = call_timeout * 3;
    let failover = election.map_or(Duration::ZERO, |e| {
        (e.takeover() + call_timeout + Duration::from_secs(1)) * 3 / 2
    });
    let ms = crate::time::millis(renewing.max(failover));
    Duration::from_secs(ms.div_ceil(1000).max(1))
}

/// Drops what the controller never reads before an object enters the cache: `managedFields`
/// and kubectl's copy of the last applied object are most of an object's size, and the cache
/// holds every TargetLease. The controller only writes the finalizer (a JSON patch) and the
/// status (server-side apply), neither of which needs them.
fn slim(lease: &mut TargetLease) {
    lease.metadata.managed_fields = None;
    if let Some(annotations) = lease.metadata.annotations.as_mut() {
        annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
        if annotations.is_empty() {
            lease.metadata.annotations = None;
        }
    }
}

/// The wait before the next try of an object that has been failing for `failing_for`: as long
/// again, between `shortest` and `longest`. Tries that keep failing so wait 0.5, 1, 2, 4 s ...
/// (doubling), and failures that come faster than the tries do not make the wait grow faster:
/// each failed status write brings a watch event, and with it another reconcile that fails, so
/// a count of failures would reach minutes within seconds.
fn backoff(failing_for: Duration, shortest: Duration, longest: Duration) -> Duration {
    failing_for.clamp(shortest, longest)
}

/// The wait after an object's first failure.
const FIRST_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between two tries of a failing object.
const LONGEST_RETRY: Duration = Duration::from_secs(300);

fn error_policy(lease: Arc<TargetLease>, error: &Error, ctx: Arc<Context>) -> Action {
    if let Some(wait) = error.stopping() {
        // Not a failure: a deleted claim waits for its holder to stop (see tenure::handover).
        return Action::requeue(wait);
    }
    let key = ObjectRef::from_obj(lease.as_ref());
    let failing_for = ctx.failing_for(key.clone(), Instant::now());
    if error.is_stale_read() {
        // The status write was based on an object the cache had not caught up with (or a newer
        // leader wrote since): the watch brings the newer object, which is reconciled anew.
        // Soon, but backing off while the cache stays behind (a watch that is relisting).
        let wait = backoff(
            failing_for,
            Duration::from_millis(100),
            Duration::from_secs(5),
        );
        debug!(lease = %lease.name_any(), retry_in_ms = crate::time::millis(wait), "status write refused: the object changed since it was read");
        return Action::requeue(wait);
    }
    let valid_for = Claim::new(&lease).map_or(Duration::ZERO, |claim| {
        decide::valid_for(&claim, ctx.tenures.view(&key).as_ref())
    });
    let until_expiry = decide::look_again_by_expiry(lease.status.as_ref(), valid_for);
    let backoff = backoff(failing_for, FIRST_RETRY, LONGEST_RETRY);
    let wait = until_expiry.map_or(backoff, |u| backoff.min(u));
    warn!(lease = %lease.name_any(), namespace = ?lease.namespace(), error = %error, retry_in_ms = crate::time::millis(wait), "reconcile failed");
    Action::requeue(wait)
}

/// Runs the controller until `shutdown` resolves. In-flight reconciles finish first; leases are
/// not released (a successor carries on renewing them).
pub(crate) async fn run(
    client: Client,
    store: Arc<dyn LeaseStore>,
    metrics: Arc<Metrics>,
    settings: Settings,
    leadership: Leadership,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (wake, woken) = mpsc::unbounded_channel();
    let (leases, writer) = reflector::store();
    let line = Line::new(leases.clone(), wake.clone());
    let (tenures, renewing) = Tenures::new(tenure::Wiring {
        store: store.clone(),
        metrics: metrics.clone(),
        leadership: leadership.clone(),
        wake: wake.clone(),
        concurrency: settings.renewal_concurrency,
        leases: leases.clone(),
    });
    let removed = Arc::new(finalizer::Removed::default());
    let stream = {
        let (leases, line, tenures) = (leases.clone(), line.clone(), tenures.clone());
        let removed = removed.clone();
        let started = leadership.clone();
        scope::watch_targetleases(&client, &settings.namespaces, slim)
            .reflect(writer)
            .inspect_ok(move |event| {
                line.observe(event);
                match event {
                    watcher::Event::Delete(lease) => {
                        if let Some(uid) = lease.uid() {
                            removed.forget(&uid);
                        }
                    }
                    watcher::Event::InitDone => {
                        removed.retain(&leases.state().iter().filter_map(|l| l.uid()).collect())
                    }
                    _ => {}
                }
                // The cache is whole: reconciles can start. A leader renews its Lease only
                // once this has happened (or not for long).
                if matches!(event, watcher::Event::InitDone) {
                    started.work_started();
                    // Every held lease is renewed from now on, whatever the reconciles wait for.
                    tenures.keep_all_held(&leases);
                }
            })
            .applied_objects()
    };
    let controller = Controller::for_stream(stream, leases.clone()).with_config(
        kube::runtime::controller::Config::default().concurrency(settings.reconcile_concurrency),
    );
    metrics.count_leases_in(Some(leases.clone()));
    let holders = Holders::new(client.clone(), settings.holder_pods.clone(), wake.clone());
    let reporter = Reporter {
        controller: FIELD_MANAGER.to_owned(),
        instance: Some(settings.identity.clone()),
    };
    let _watching = Watching {
        tasks: holders
            .watches(&settings.namespaces)
            .into_iter()
            .map(tokio::spawn)
            .chain([tokio::spawn(renewing)])
            .collect(),
        metrics: metrics.clone(),
    };
    let ctx = Arc::new(Context::new(Parts {
        status: StatusWriter::new(
            client.clone(),
            Recorder::new(client.clone(), reporter),
            metrics.clone(),
            leadership.clone(),
        ),
        installations: Installations::new(client.clone(), settings.installation.clone()),
        client,
        store,
        tenures,
        line,
        holders,
        leadership,
        metrics,
        shortest_ttl: settings.shortest_ttl,
        removed,
    }));
    let woken = futures::stream::unfold(woken, |mut rx| async move {
        rx.recv().await.map(|obj| (obj, rx))
    });
    info!(namespaces = ?settings.namespaces, holder_pods = ?settings.holder_pods, identity = %settings.identity, "controller started");
    let failures_ctx = ctx.clone();
    controller
        .reconcile_on(woken)
        .graceful_shutdown_on(shutdown)
        .run(reconcile::reconcile, error_policy, ctx)
        .for_each(|result| {
            match result {
                Ok((obj, _)) => failures_ctx.succeeded(&obj),
                Err(e) => debug!(error = %e, "reconcile did not complete"),
            }
            futures::future::ready(())
        })
        .await;
    info!("controller stopped");
}

/// What [`run`] started beside the controller (the pod watches, the renewal scheduler),
/// stopped when it returns or is cancelled (a controller that could not wind down in time is
/// dropped).
struct Watching {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    metrics: Arc<Metrics>,
}

impl Drop for Watching {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        // No longer leading: nothing to count.
        self.metrics.count_leases_in(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn election(seconds: u64) -> election::Election {
        election::Election {
            namespace: "ns".into(),
            name: "lease".into(),
            identity: "me".into(),
            duration_seconds: seconds,
        }
    }

    #[test]
    fn the_wait_doubles_with_the_tries_not_with_the_failures() {
        let wait = |failing_for| backoff(failing_for, FIRST_RETRY, LONGEST_RETRY);
        // Tries that fail at once, each after the wait before it: 0.5, 1, 2, 4 s ...
        let mut failing_for = Duration::ZERO;
        let mut waits = Vec::new();
        for _ in 0..5 {
            let next = wait(failing_for);
            waits.push(next.as_millis());
            failing_for += next;
        }
        assert_eq!(waits, [500, 500, 1000, 2000, 4000]);
        // Ten failures within 4 s (the watch events of its own failed writes): the wait is
        // 4 s, not the minutes ten doublings would give.
        assert_eq!(wait(Duration::from_secs(4)), Duration::from_secs(4));
        assert_eq!(wait(Duration::from_secs(3600)), LONGEST_RETRY);
    }

    #[test]
    fn shortest_ttl_follows_the_timings() {
        // Alone: three call timeouts.
        assert_eq!(shortest_ttl(Duration::from_secs(2), None).as_secs(), 6);
        assert_eq!(shortest_ttl(Duration::from_secs(1), None).as_secs(), 3);
        assert_eq!(shortest_ttl(Duration::from_millis(100), None).as_secs(), 1);
        // With the default election (10 s, take-over 12.5 s) and call timeout (2 s):
        // 1.5 x (12.5 + 2 + 1) = 23.25 s, so 24 s; the default TTL (30 s) is above it.
        let default = shortest_ttl(Duration::from_secs(2), Some(&election(10)));
        assert_eq!(default.as_secs(), 24);
        assert!(u64::from(crate::api::DEFAULT_TTL_SECONDS) >= default.as_secs());
        // The chaos run's replicas: 3 s election, 1 s timeout.
        assert_eq!(
            shortest_ttl(Duration::from_secs(1), Some(&election(3))).as_secs(),
            9
        );
    }
}
