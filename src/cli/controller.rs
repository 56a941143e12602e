//! `targetlease controller`: runs the TargetLease controller with its HTTP endpoints.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use kube::Client;
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::store_args::StoreArgs;
use crate::controller::http::{self, Probe};
use crate::controller::metrics::Metrics;
use crate::controller::{self, PodScope, Settings};
use crate::election::{self, Election, stopped};
use crate::store::{LeaseStore, StoreError};

/// Flags of `targetlease controller`.
#[derive(Debug, Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Watch only these namespaces, comma-separated (default: every namespace). Each gets a
    /// watch of its own; the controller starts once every one has listed.
    #[arg(long, env = "TARGETLEASE_WATCH_NAMESPACE", value_delimiter = ',')]
    watch_namespace: Vec<String>,
    /// Read holder pods (`spec.holderRef`) only in these namespaces, comma-separated (default:
    /// every watched namespace). Holders elsewhere are released through the heartbeat of
    /// `targetlease run` instead of the moment their pod is gone or finished.
    #[arg(
        long,
        env = "TARGETLEASE_HOLDER_POD_NAMESPACES",
        value_delimiter = ',',
        conflicts_with = "no_holder_pods"
    )]
    holder_pod_namespaces: Vec<String>,
    /// Read no pod at all: no holderRef is tracked (releases come from `targetlease run`'s own
    /// release, its heartbeat, or the garbage collection of TargetLeases owned by deleted pods).
    #[arg(long, env = "TARGETLEASE_NO_HOLDER_PODS")]
    no_holder_pods: bool,
    /// Address of /healthz, /readyz and /metrics (port 0: one the kernel picks; the start-up log
    /// names the address bound).
    #[arg(long, env = "TARGETLEASE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Elect a leader among replicas through a coordination.k8s.io Lease.
    #[arg(long, env = "TARGETLEASE_LEADER_ELECTION")]
    leader_election: bool,
    /// Namespace of the leader-election Lease (the controller's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    leader_election_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "targetlease-controller")]
    leader_election_name: String,
    /// How long a leader's claim lasts without renewal (seconds). It sets the shortest
    /// TargetLease TTL this controller accepts: 1.5 x (take-over + call timeout + 1 s).
    #[arg(long, default_value_t = election::DEFAULT_DURATION_SECONDS, value_parser = clap::value_parser!(u64).range(2..=3600))]
    leader_election_seconds: u64,
    /// This replica's name (events, leader election).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// This installation's identity (the chart sets `<namespace>/<release>`): the controller
    /// claims the store's key prefix (Valkey's or etcd's) for it and refuses to work on a prefix that another
    /// installation claimed, so two installations never share leases by accident; and it acts
    /// only in namespaces whose Lease `targetlease-installation` names it (it creates the Lease
    /// where there is none), so two installations never act on one TargetLease. Without it, the
    /// store's name stands in (`unnamed (Valkey key prefix tl)`).
    #[arg(long, env = "TARGETLEASE_INSTALLATION_ID")]
    installation_id: Option<String>,
    /// Reconciles running at once, at most (each makes at most one store call and one status
    /// write; renewals do not wait for them).
    #[arg(long, env = "TARGETLEASE_RECONCILE_CONCURRENCY", default_value_t = controller::DEFAULT_RECONCILE_CONCURRENCY, value_parser = clap::value_parser!(u16).range(1..=4096))]
    reconcile_concurrency: u16,
    /// Renewals of held leases in flight at once, at most.
    #[arg(long, env = "TARGETLEASE_RENEWAL_CONCURRENCY", default_value_t = controller::DEFAULT_RENEWAL_CONCURRENCY, value_parser = clap::value_parser!(u16).range(1..=4096))]
    renewal_concurrency: u16,
}

impl ControllerArgs {
    fn open_store(&self) -> Result<Arc<dyn LeaseStore>, StoreError> {
        self.store.open_lazy(self.installation_id.clone())
    }

    /// This installation's id: `--installation-id`, else a name for the store it uses (two
    /// controllers on one key prefix are one installation; the chart always sets an id).
    fn installation(&self) -> String {
        match &self.installation_id {
            Some(id) if !id.is_empty() => id.clone(),
            _ => controller::installation::default_id(&self.store.describe()),
        }
    }

    /// This replica's name: `--identity` (the pod's name in the chart), else the host name. Never
    /// empty: an empty holder would read as a free leader Lease to the other replicas. Two
    /// processes must not share one (pod names are unique; elsewhere, set it).
    fn identity(&self) -> String {
        self.identity
            .clone()
            .filter(|i| !i.is_empty())
            .unwrap_or_else(|| {
                hostname::get()
                    .ok()
                    .and_then(|h| h.into_string().ok())
                    .unwrap_or_else(|| format!("targetlease-{}", std::process::id()))
            })
    }

    /// The namespaces TargetLeases are watched in (none: every namespace).
    fn watched_namespaces(&self) -> Result<Vec<String>, String> {
        Ok(namespace_names("--watch-namespace", &self.watch_namespace)?
            .into_iter()
            .collect())
    }

    /// Where holder pods are read: within the watched namespaces, if some are named.
    fn holder_pods(&self) -> Result<PodScope, String> {
        if self.no_holder_pods {
            return Ok(PodScope::Off);
        }
        if self.holder_pod_namespaces.is_empty() {
            return Ok(PodScope::Watched);
        }
        let namespaces = namespace_names("--holder-pod-namespaces", &self.holder_pod_namespaces)?;
        let watched = self.watched_namespaces()?;
        if !watched.is_empty() && namespaces.iter().any(|ns| !watched.contains(ns)) {
            return Err(format!(
                "--holder-pod-namespaces names namespaces other than the watched ones ({}): \
                 TargetLeases elsewhere are not reconciled",
                watched.join(",")
            ));
        }
        Ok(PodScope::Namespaces(namespaces))
    }

    /// Runs until SIGTERM or SIGINT.
    pub async fn run(self) -> ExitCode {
        match self.serve().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => {
                error!("{message}");
                ExitCode::FAILURE
            }
        }
    }

    async fn serve(self) -> Result<(), String> {
        let client = Client::try_default()
            .await
            .map_err(|e| format!("cannot configure the Kubernetes client: {e}"))?;
        // A rolling upgrade onto a CRD that does not serve this version (crds.enabled=false
        // with the previous release's CRD) stops here: the new pods never get Ready, so the
        // rollout waits and the running controller keeps the leases.
        super::client::ensure_served(&client).await?;
        let store = self.open_store().map_err(|e| e.to_string())?;
        if let Err(e) = store.health().await {
            // Not fatal: the controller starts, reports not ready, and retries per object. Not
            // only "unreachable": a durability the server cannot give fails here too.
            warn!(
                error = %e,
                kind = e.kind().as_str(),
                "the lease store failed its start-up check; not ready until it passes"
            );
        }
        let metrics = Arc::new(Metrics::new());
        if let Some(timeout) = self.store.call_timeout() {
            metrics.store_call_timeout(timeout);
        }
        let probe = Arc::new(Probe {
            client: client.clone(),
            store: store.clone(),
            metrics: metrics.clone(),
        });
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(async move {
            wait_for_signal().await;
            info!("shutting down: finishing in-flight reconciles; leases stay held");
            let _ = stop_tx.send(true);
        });
        let listener = tokio::net::TcpListener::bind(self.http_addr)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", self.http_addr))?;
        // The bound address, not the flag: with port 0 the kernel picks one, and this line is
        // how a person (or a test) learns which.
        let bound = listener
            .local_addr()
            .map_or_else(|_| self.http_addr.to_string(), |a| a.to_string());
        info!("serving probes and metrics on {bound}");
        let http = tokio::spawn(http::serve(listener, probe.clone(), stopped(stop.clone())));

        let election = self.leader_election.then(|| Election {
            namespace: self.leader_election_namespace.clone(),
            name: self.leader_election_name.clone(),
            identity: self.identity(),
            duration_seconds: self.leader_election_seconds,
        });
        let holder_pods = self.holder_pods()?;
        match &holder_pods {
            PodScope::Watched => {}
            PodScope::Namespaces(namespaces) => warn!(
                ?namespaces,
                "holder pods are tracked in these namespaces only: elsewhere a holderRef lease is \
                 released by targetlease run, its heartbeat or the garbage collector, not when \
                 its pod goes"
            ),
            PodScope::Off => warn!(
                "holder pods are not tracked (--no-holder-pods): a holderRef lease is released by \
                 targetlease run, its heartbeat or the garbage collector, not when its pod goes"
            ),
        }
        let settings = Settings {
            namespaces: self.watched_namespaces()?,
            holder_pods,
            identity: self.identity(),
            // The in-memory store never waits; the Valkey deadline stands in, as it always has.
            shortest_ttl: controller::shortest_ttl(
                self.store
                    .call_timeout()
                    .unwrap_or(self.store.valkey.valkey_timeout.0),
                election.as_ref(),
            ),
            reconcile_concurrency: self.reconcile_concurrency,
            renewal_concurrency: usize::from(self.renewal_concurrency),
            installation: self.installation(),
        };
        info!(
            shortest_ttl_seconds = settings.shortest_ttl.as_secs(),
            "TargetLeases with a shorter ttlSeconds are refused"
        );
        let work = |signal: election::StopSignal, leadership: election::Leadership| {
            controller::run(
                client.clone(),
                store.clone(),
                metrics.clone(),
                settings.clone(),
                leadership,
                signal,
            )
        };
        if let Some(election) = election {
            election::elector::lead(
                client.clone(),
                election,
                stop.clone(),
                metrics.leading.clone(),
                work,
            )
            .await
            .map_err(|e| format!("leader election failed: {e}"))?;
        } else {
            election::run_alone(work, stop.clone(), metrics.leading.clone()).await;
        }
        match http.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("HTTP server on {} failed: {e}", self.http_addr)),
            Err(e) => Err(format!("HTTP server task failed: {e}")),
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The namespaces a comma-separated `flag` names, each a DNS label: anything else (an empty
/// entry too) would watch nothing and fail open or warn forever.
fn namespace_names(flag: &str, given: &[String]) -> Result<BTreeSet<String>, String> {
    let mut namespaces = BTreeSet::new();
    for ns in given {
        let ns = ns.trim();
        let label = !ns.is_empty()
            && ns.len() <= 63
            && ns
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !ns.starts_with('-')
            && !ns.ends_with('-');
        if !label {
            return Err(format!(
                "{flag}: {ns:?} is not a namespace name (a DNS label)"
            ));
        }
        namespaces.insert(ns.to_owned());
    }
    Ok(namespaces)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::flags::Span;
    use crate::store::valkey::{DEFAULT_CALL_TIMEOUT, DEFAULT_PREFIX};

    /// An empty identity (an empty POD_NAME) would read as a free leader Lease to the others.
    #[test]
    fn an_empty_identity_means_the_host_name() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ControllerArgs,
        }
        let named = Cli::parse_from(["t", "--identity", "replica-a"]).args;
        assert_eq!(named.identity(), "replica-a");
        let empty = Cli::parse_from(["t", "--identity", ""]).args;
        assert!(!empty.identity().is_empty());
        assert_eq!(empty.identity(), Cli::parse_from(["t"]).args.identity());
        // A duration the election cannot work with is refused at the flag.
        assert!(Cli::try_parse_from(["t", "--leader-election-seconds", "1"]).is_err());
    }

    /// Holder pod scopes from the flags: names checked, an empty entry refused (it must not
    /// fail open to every namespace), the watched namespace respected.
    #[test]
    fn holder_pod_flags_make_a_scope() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ControllerArgs,
        }
        let scope = |args: &[&str]| {
            let mut all = vec!["t"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all)
                .map_err(|e| e.to_string())?
                .args
                .holder_pods()
        };
        assert_eq!(scope(&[]), Ok(PodScope::Watched));
        assert_eq!(scope(&["--no-holder-pods"]), Ok(PodScope::Off));
        assert_eq!(
            scope(&["--holder-pod-namespaces", "b,a"]),
            Ok(PodScope::Namespaces(
                ["a".to_owned(), "b".to_owned()].into()
            ))
        );
        for bad in ["", "a,,b", "Team_A", "-a", &"x".repeat(64)] {
            assert!(
                scope(&[&format!("--holder-pod-namespaces={bad}")]).is_err(),
                "{bad:?} was accepted"
            );
        }
        assert!(scope(&["--watch-namespace", "a", "--holder-pod-namespaces", "b"]).is_err());
        assert!(scope(&["--watch-namespace", "a", "--holder-pod-namespaces", "a"]).is_ok());
        assert!(
            Cli::try_parse_from(["t", "--no-holder-pods", "--holder-pod-namespaces", "a"]).is_err()
        );
    }

    /// The chart's values.yaml repeats some defaults of the flags (so that `helm show values`
    /// tells the truth); they must be the code's, which are written once as constants.
    #[test]
    fn chart_values_match_the_flag_defaults() {
        let values: serde_yaml::Value =
            serde_yaml::from_str(include_str!("../../charts/targetlease/values.yaml"))
                .expect("values.yaml parses");
        let at = |path: &[&str]| {
            let mut v = &values;
            for key in path {
                v = &v[*key];
            }
            match v {
                serde_yaml::Value::String(s) => s.clone(),
                serde_yaml::Value::Number(n) => n.to_string(),
                other => panic!("values.yaml {path:?} is {other:?}"),
            }
        };
        assert_eq!(
            at(&["valkey", "timeout"]),
            Span(DEFAULT_CALL_TIMEOUT).to_string()
        );
        assert_eq!(at(&["valkey", "keyPrefix"]), DEFAULT_PREFIX);
        assert_eq!(
            at(&["valkey", "durability"]),
            crate::store::valkey::Durability::NONE.to_string()
        );
        assert_eq!(
            at(&["controller", "leaderElection", "leaseDurationSeconds"]),
            election::DEFAULT_DURATION_SECONDS.to_string()
        );
    }
}
