//! The world of one end-to-end scenario on the real control plane: its own namespace, Valkey
//! server and controller process (watching only that namespace), and the runner that starts one
//! control plane per suite and runs the scenarios one at a time.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::{Api, DeleteParams, ListParams};
use libtest_mimic::{Arguments, Conclusion, Trial};
use targetlease::api::{Phase, TargetLease};
use targetlease::redact::SecretUrl;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{Inspection, LeaseStore, TargetRef};

use super::kube::{Cluster, ControllerProcess, await_lease, lease_yaml, phase_of, targetlease_bin};
use super::server::{Server, ServerKind};
use super::suite;

/// One second.
pub const SEC: Duration = Duration::from_secs(1);

/// One scenario's world.
pub struct Scenario {
    /// The control plane, shared by the suite.
    pub cluster: Arc<Cluster>,
    /// This scenario's namespace.
    pub ns: String,
    /// A client of the control plane.
    pub client: Client,
    /// This scenario's Valkey.
    pub valkey: Server,
    /// The controller process, while it runs.
    pub controller: Option<ControllerProcess>,
}

impl Scenario {
    /// A new scenario named `name`, with its controller running.
    pub async fn new(cluster: Arc<Cluster>, name: &str) -> Scenario {
        let ns = format!("tl-{name}");
        cluster.kubectl_ok(&["create", "namespace", &ns]);
        let valkey = Server::start(ServerKind::Valkey91);
        let client = cluster.client().await;
        let mut scenario = Scenario {
            cluster,
            ns,
            client,
            valkey,
            controller: None,
        };
        scenario.controller = Some(scenario.start_controller(&[]));
        scenario
    }

    /// Starts a controller on this scenario's namespace and Valkey, with `extra` flags. Its
    /// Valkey call timeout is 1 s, so the short TTLs of the tests (3 s and up) are ones it can
    /// keep (three call timeouts; docs/internals/controller.md).
    pub fn start_controller(&self, extra: &[&str]) -> ControllerProcess {
        self.start_controller_as(Path::new(self.cluster.kubeconfig()), extra)
    }

    /// Like [`Scenario::start_controller`], reaching the API server as `kubeconfig` says.
    pub fn start_controller_as(&self, kubeconfig: &Path, extra: &[&str]) -> ControllerProcess {
        let mut args = vec!["--watch-namespace", &self.ns, "--valkey-timeout", "1s"];
        args.extend_from_slice(extra);
        ControllerProcess::start_as(&self.cluster, kubeconfig, &self.valkey.url(), &args)
    }

    /// Starts one replica of an electing controller (leader election in this namespace, a 3 s
    /// claim) as `identity`, reaching the API server as `kubeconfig` says (the admin's when
    /// `None`).
    pub fn start_replica(&self, identity: &str, kubeconfig: Option<&Path>) -> ControllerProcess {
        let args = [
            "--leader-election",
            "--leader-election-namespace",
            self.ns.as_str(),
            "--leader-election-seconds",
            "3",
            "--identity",
            identity,
        ];
        let admin = Path::new(self.cluster.kubeconfig());
        self.start_controller_as(kubeconfig.unwrap_or(admin), &args)
    }

    /// The running controller.
    pub fn controller(&mut self) -> &mut ControllerProcess {
        self.controller.as_mut().expect("controller running")
    }

    /// TargetLeases of this namespace.
    pub fn api(&self) -> Api<TargetLease> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Applies a TargetLease.
    pub fn apply(&self, name: &str, target: &str, holder: &str, extra: &str) {
        self.cluster
            .apply(&lease_yaml(&self.ns, name, target, holder, extra));
    }

    /// Reads a TargetLease.
    pub async fn get(&self, name: &str) -> TargetLease {
        self.api().get(name).await.expect("get TargetLease")
    }

    /// Waits (by watch) until `name` satisfies `pred`.
    pub async fn wait(
        &self,
        name: &str,
        what: &str,
        limit: Duration,
        pred: impl Fn(&TargetLease) -> bool + Send + 'static,
    ) -> TargetLease {
        match await_lease(&self.api(), name, what, limit, pred).await {
            Ok(lease) => lease,
            Err(why) => panic!(
                "{why}\ncontroller log:\n{}",
                self.controller
                    .as_ref()
                    .map(|c| c.logs())
                    .unwrap_or_default()
            ),
        }
    }

    /// Waits until `name` is in `phase`.
    pub async fn wait_phase(&self, name: &str, phase: Phase, limit: Duration) -> TargetLease {
        self.wait(name, &format!("{phase:?}"), limit, move |l| {
            phase_of(l) == Some(phase)
        })
        .await
    }

    /// A store on this scenario's Valkey.
    pub async fn store(&self) -> ValkeyStore {
        let url = SecretUrl::parse(&self.valkey.url()).expect("url");
        ValkeyStore::connect(ValkeyConfig::new(url))
            .await
            .expect("connect to valkey")
    }

    /// What this scenario's Valkey holds for `target` in this namespace (a fresh connection).
    pub async fn inspect(&self, target: &str) -> Inspection {
        self.store()
            .await
            .inspect(&self.target(target))
            .await
            .expect("inspect")
    }

    /// A target in this namespace.
    pub fn target(&self, target: &str) -> TargetRef {
        TargetRef::new(&self.ns, target).expect("target")
    }

    /// `targetlease run -n NS --target T EXTRA... -- sh -c SCRIPT` with the cluster's environment
    /// (reaching the API server directly) and no pod identity; killed on drop.
    pub fn run_command(
        &self,
        target: &str,
        extra: &[&str],
        script: &str,
    ) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(targetlease_bin());
        command
            .args(["run", "-n", &self.ns, "--target", target])
            .args(extra)
            .args(["--", "sh", "-c", script])
            .envs(self.cluster.envs())
            .env_remove("POD_NAME")
            .env_remove("POD_UID")
            .env_remove("POD_NAMESPACE")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// The TargetLease a `run` made for `target`, once `pred` holds for it (polled: its name is
    /// `run`'s to choose).
    pub async fn run_lease(
        &self,
        target: &str,
        limit: Duration,
        pred: impl Fn(&TargetLease) -> bool,
    ) -> TargetLease {
        let deadline = Instant::now() + limit;
        loop {
            let items = self
                .api()
                .list(&ListParams::default())
                .await
                .expect("list")
                .items;
            if let Some(lease) = items
                .into_iter()
                .find(|l| l.spec.target == target && pred(l))
            {
                return lease;
            }
            assert!(
                Instant::now() < deadline,
                "no TargetLease of a run on {target} got there within {limit:?}\ncontroller log:\n{}",
                self.controller
                    .as_ref()
                    .map(|c| c.logs())
                    .unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Deletes a TargetLease.
    pub async fn delete(&self, name: &str) {
        self.api()
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete TargetLease");
    }

    /// Waits until `name` no longer exists.
    pub async fn wait_gone(&self, name: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.api().get_opt(name).await.expect("get").is_some() {
            assert!(
                Instant::now() < deadline,
                "{name} still exists after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        self.controller.take();
        let _ = self
            .cluster
            .kubectl(&["delete", "namespace", &self.ns, "--wait=false"]);
    }
}

/// One scenario body.
pub type ScenarioFn = fn(Scenario) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

/// `[(name, body)]` from scenario function names.
#[macro_export]
macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        [$((stringify!($name), (|s| Box::pin($name(s))) as $crate::scenario::ScenarioFn)),*]
    };
}

/// The suite's control plane with the CRD installed, started by the first trial that needs it.
pub fn shared_control_plane(slot: &std::sync::OnceLock<Arc<Cluster>>) -> Arc<Cluster> {
    slot.get_or_init(|| {
        let cluster = Cluster::start();
        cluster.install_crd();
        Arc::new(cluster)
    })
    .clone()
}

/// Runs `scenarios` one at a time (they measure latencies and kill processes: one at a time on
/// a 2-core machine) on one control plane, started only when one of them is wanted.
pub fn run_scenarios(args: &Arguments, scenarios: Vec<(&'static str, ScenarioFn)>) -> Conclusion {
    let mut args = args.clone();
    args.test_threads = Some(1);
    let cluster: Arc<std::sync::OnceLock<Arc<Cluster>>> = Arc::default();
    let trials: Vec<Trial> = scenarios
        .into_iter()
        .map(|(name, body)| {
            let cluster = cluster.clone();
            suite::trial(name, move || {
                // The shared control plane starts before the trial's time limit runs: on a
                // machine that has not built its binaries yet, that start waits for the build
                // (minutes), which is no part of the scenario.
                let cluster = shared_control_plane(&cluster);
                async move {
                    let scenario = Scenario::new(cluster, &name.replace('_', "-")).await;
                    body(scenario).await;
                }
            })
        })
        .collect();
    let conclusion = suite::run(&args, trials);
    // The control plane stops before the closing line.
    drop(cluster);
    conclusion
}
