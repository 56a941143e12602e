//! The Helm chart on a real control plane (`e2e/cluster`): installed into a namespace enforcing
//! the restricted Pod Security Standard, the controller binary run on the host with the chart's
//! ServiceAccount token (so the chart's RBAC is what it gets), `kubectl auth can-i` as that
//! ServiceAccount, kstatus and the Argo CD health check on objects the controller wrote, the
//! workload example, upgrade and uninstall. The tests share one release and run one at a time,
//! in order (the last one uninstalls it). A missing tool or control plane fails the suite; it
//! never skips.

use targetlease_test_support as support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use libtest_mimic::{Arguments, Conclusion, Trial};
use serde::Deserialize;
use serde_json::{Value, json};
use targetlease::api::{Phase, SERVED_VERSIONS, StorageVersion, TargetLease, VERSION};
use targetlease::store::TargetRef;
use targetlease::store::valkey::keys::TargetKeys;

use support::chart::*;
use support::kube::{
    Cluster, ControllerProcess, await_lease, condition, lease_yaml, phase_of, repo, run_with_input,
    token_of,
};
use support::server::{Server, ServerKind};
use support::suite;

/// The control plane with the chart installed and the controller running on the host as the
/// chart's ServiceAccount. Fields drop in order: the controller and Valkey before the cluster.
struct World {
    controller: Mutex<Option<ControllerProcess>>,
    valkey: Server,
    sa_kubeconfig: PathBuf,
    install: Output,
    install_took: Duration,
    /// From the start of `helm install` until the ReplicaSet had created both pods (None: not
    /// within 60 s).
    pods_admitted: Option<Duration>,
    cluster: Cluster,
}

impl World {
    fn start() -> World {
        let cluster = Cluster::start();
        cluster.kubectl_ok(&["create", "namespace", RELEASE_NS]);
        restrict(&cluster, RELEASE_NS);
        let chart = chart_dir().display().to_string();
        let started = Instant::now();
        let install = cluster.helm(&["install", RELEASE, &chart, "-n", RELEASE_NS]);
        let install_took = started.elapsed();
        assert!(
            install.status.success(),
            "helm install failed:\n{}{}",
            stdout(&install),
            stderr(&install)
        );
        let deadline = started + 60 * SEC;
        let pods_admitted = loop {
            if release_pods(&cluster, RELEASE_NS, RELEASE).len() == 2 {
                break Some(started.elapsed());
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        cluster.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=30s",
            &format!("crd/{CRD}"),
        ]);
        let sa_kubeconfig = cluster.service_account_kubeconfig(RELEASE_NS, FULLNAME);
        let valkey = Server::start(ServerKind::Valkey91);
        let controller =
            host_controller(&cluster, &sa_kubeconfig, &valkey, RELEASE_NS, RELEASE, &[]);
        World {
            controller: Mutex::new(Some(controller)),
            valkey,
            sa_kubeconfig,
            install,
            install_took,
            pods_admitted,
            cluster,
        }
    }

    /// Stops the host controller until the guard drops (then it starts again).
    fn pause_controller(&self) -> PausedController<'_> {
        if let Some(mut controller) = self.take_controller() {
            let status = controller.terminate();
            assert!(status.success(), "controller exit: {status}");
        }
        PausedController(self)
    }

    fn take_controller(&self) -> Option<ControllerProcess> {
        self.controller
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn controller_log(&self) -> String {
        self.controller
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|c| c.logs())
            .unwrap_or_default()
    }

    /// kubectl as the chart's ServiceAccount.
    fn kubectl_as_controller(&self, args: &[&str]) -> Output {
        self.cluster.kubectl_as(&self.sa_kubeconfig, args)
    }

    fn json(&self, args: &[&str]) -> Value {
        self.cluster.kubectl_json(args)
    }

    /// A fresh namespace for one test.
    fn namespace(&self, name: &str) -> String {
        self.cluster.kubectl_ok(&["create", "namespace", name]);
        name.to_owned()
    }
}

/// Restarts the host controller when dropped.
struct PausedController<'a>(&'a World);

impl Drop for PausedController<'_> {
    fn drop(&mut self) {
        let world = self.0;
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            host_controller(
                &world.cluster,
                &world.sa_kubeconfig,
                &world.valkey,
                RELEASE_NS,
                RELEASE,
                &[],
            )
        }));
        match started {
            Ok(controller) => {
                *world.controller.lock().unwrap_or_else(|e| e.into_inner()) = Some(controller);
            }
            Err(panic) => eprintln!(
                "could not restart the host controller: {}",
                suite::panic_message(&*panic)
            ),
        }
    }
}

/// `targetlease controller` on the host with a release's ServiceAccount kubeconfig, electing a
/// leader the way the chart's pods do (its Lease in the release namespace); `extra` flags last.
fn host_controller(
    cluster: &Cluster,
    kubeconfig: &Path,
    valkey: &Server,
    release_ns: &str,
    release: &str,
    extra: &[&str],
) -> ControllerProcess {
    let lease = election_lease(release);
    let identity = format!("host-{release}");
    let mut args = vec![
        "--leader-election",
        "--leader-election-namespace",
        release_ns,
        "--leader-election-name",
        lease.as_str(),
        "--leader-election-seconds",
        "5",
        "--identity",
        identity.as_str(),
    ];
    args.extend_from_slice(extra);
    ControllerProcess::start_as(cluster, kubeconfig, &valkey.url(), &args)
}

/// The chart's full name for `release` (what _helpers.tpl computes).
fn fullname(release: &str) -> String {
    if release.contains("targetlease") {
        release.to_owned()
    } else {
        format!("{release}-targetlease")
    }
}

/// The leader-election Lease of `release`.
fn election_lease(release: &str) -> String {
    format!("{}-controller", fullname(release))
}

/// Labels a namespace to enforce (and warn about) the restricted Pod Security Standard.
fn restrict(cluster: &Cluster, ns: &str) {
    cluster.kubectl_ok(&[
        "label",
        "namespace",
        ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
        "pod-security.kubernetes.io/warn=restricted",
        "pod-security.kubernetes.io/warn-version=latest",
    ]);
}

/// Polls `check` every 200 ms until it returns `Some`, for at most `limit`.
fn poll<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The controller's pods of a release (the ReplicaSet controller made them; no kubelet runs
/// them, so they stay Pending).
fn release_pods(cluster: &Cluster, ns: &str, release: &str) -> Vec<Value> {
    let selector =
        format!("app.kubernetes.io/instance={release},app.kubernetes.io/component=controller");
    cluster.kubectl_json(&["get", "pods", "-n", ns, "-l", &selector])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The FailedCreate events in a namespace (both event APIs show them), as "reason: message".
fn failed_creates(world: &World, ns: &str) -> Vec<String> {
    world.json(&["get", "events", "-n", ns])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|e| e["reason"] == "FailedCreate")
        .map(|e| {
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            format!(
                "{} {}: {}",
                text(&e["involvedObject"]["kind"]),
                text(&e["involvedObject"]["name"]),
                text(&e["message"])
            )
        })
        .collect()
}

fn install_under_restricted_pod_security(world: &World) {
    eprintln!("measured: helm install {:?}", world.install_took);
    let warnings = stderr(&world.install);
    assert!(
        !warnings.contains("PodSecurity"),
        "helm install printed Pod Security warnings:\n{warnings}"
    );
    let status = world.cluster.helm(&["status", RELEASE, "-n", RELEASE_NS]);
    assert!(
        stdout(&status).contains("STATUS: deployed"),
        "{}",
        stdout(&status)
    );
    let admitted = world
        .pods_admitted
        .expect("the ReplicaSet did not create 2 pods within 60 s");
    eprintln!("measured: both controller pods admitted {admitted:?} after helm install began");
    let pods = release_pods(&world.cluster, RELEASE_NS, RELEASE);
    assert_eq!(pods.len(), 2);
    for pod in &pods {
        assert_eq!(pod["spec"]["serviceAccountName"], FULLNAME);
        assert_eq!(
            pod["status"]["phase"], "Pending",
            "no kubelet runs pods here"
        );
    }
    let refused = failed_creates(world, RELEASE_NS);
    assert!(refused.is_empty(), "pods refused: {refused:?}");
    let ns = world.json(&["get", "namespace", RELEASE_NS]);
    assert_eq!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "restricted"
    );

    // Control: the same chart with privilege escalation allowed is refused in the same kind of
    // namespace, and the refusal is visible where the check above looks for it.
    let ns = world.namespace("targetlease-insecure");
    restrict(&world.cluster, &ns);
    let chart = chart_dir().display().to_string();
    let out = world.cluster.helm(&[
        "install",
        "insecure",
        &chart,
        "-n",
        &ns,
        "--set",
        "crds.enabled=false",
        "--set",
        "securityContext.allowPrivilegeEscalation=true",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("would violate PodSecurity")
            && stderr(&out).contains("allowPrivilegeEscalation != false"),
        "no Pod Security warning for the insecure Deployment: {}",
        stderr(&out)
    );
    let refused = poll(
        60 * SEC,
        "a FailedCreate event for the insecure ReplicaSet",
        || {
            let refused = failed_creates(world, &ns);
            (!refused.is_empty()).then_some(refused)
        },
    );
    assert!(
        refused
            .iter()
            .any(|r| r.starts_with("ReplicaSet") && r.contains("violates PodSecurity")),
        "{refused:?}"
    );
    assert!(release_pods(&world.cluster, &ns, "insecure").is_empty());
    let out = world.cluster.helm(&["uninstall", "insecure", "-n", &ns]);
    assert!(out.status.success(), "{}", stderr(&out));
}

async fn chart_rbac_runs_the_controller(world: &World) {
    // The host controller (as the chart's ServiceAccount) leads through the chart's Role.
    let lease: Value = poll(30 * SEC, "the host controller leads", || {
        let out = world.cluster.kubectl(&[
            "get",
            "lease",
            ELECTION_LEASE,
            "-n",
            RELEASE_NS,
            "-o",
            "json",
        ]);
        let lease: Value = serde_json::from_slice(&out.stdout).ok()?;
        (lease["spec"]["holderIdentity"] == format!("host-{RELEASE}")).then_some(lease)
    });
    assert_eq!(lease["metadata"]["namespace"], RELEASE_NS);
    let ns = world.namespace("chart-rbac");
    lease_scenario(world, &ns, &|| world.controller_log()).await;
}

/// The controller's end-to-end scenario in `ns`, run by whichever controller watches it
/// (`log` shows its log): apply -> Held, a second claim Waiting, delete -> hand-over with a
/// larger token, events (created, and patched into a series), holderRef pods watched, and no
/// refused API call in the log.
async fn lease_scenario(world: &World, ns: &str, log: &(dyn Fn() -> String + Sync)) {
    let ns = ns.to_owned();
    let client: Client = world.cluster.client().await;
    let api: Api<TargetLease> = Api::namespaced(client.clone(), &ns);
    let wait = |name: &'static str, phase: Phase| {
        let api = api.clone();
        async move {
            await_lease(&api, name, &format!("{phase:?}"), 30 * SEC, move |l| {
                phase_of(l) == Some(phase)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\ncontroller log:\n{}", log()))
        }
    };
    // apply -> Held; a second claim -> Waiting; delete -> hand-over with a larger token.
    world
        .cluster
        .apply(&lease_yaml(&ns, "holder", "shared", "worker-a", ""));
    let held = wait("holder", Phase::Held).await;
    assert!(
        held.finalizers()
            .iter()
            .any(|f| f == "targetlease.dev/release")
    );
    world
        .cluster
        .apply(&lease_yaml(&ns, "waiter", "shared", "worker-b", ""));
    let waiting = wait("waiter", Phase::Waiting).await;
    assert_eq!(
        waiting.status.as_ref().and_then(|s| s.held_by.as_deref()),
        Some("worker-a")
    );
    let started = Instant::now();
    api.delete("holder", &DeleteParams::default())
        .await
        .expect("delete");
    let taken = wait("waiter", Phase::Held).await;
    eprintln!(
        "measured: hand-over as the chart's ServiceAccount {:?}",
        started.elapsed()
    );
    assert!(token_of(&taken) > token_of(&held));

    // Give the lease up and take it again: a repeated event is patched into a series.
    let patch = |release: bool| Patch::Merge(json!({"spec": {"release": release}}));
    api.patch("waiter", &PatchParams::default(), &patch(true))
        .await
        .expect("patch");
    wait("waiter", Phase::Released).await;
    api.patch("waiter", &PatchParams::default(), &patch(false))
        .await
        .expect("patch");
    let again = wait("waiter", Phase::Held).await;
    assert!(token_of(&again) > token_of(&taken));
    let events = poll(
        10 * SEC,
        "events, with the repeated Acquired as a series",
        || {
            let events = world.json(&["get", "events.events.k8s.io", "-n", &ns])["items"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let series = events.iter().any(|e| {
                e["regarding"]["name"] == "waiter"
                    && e["reason"] == "Acquired"
                    && e["series"]["count"].as_i64().unwrap_or(0) >= 2
            });
            series.then_some(events)
        },
    );
    let seen: BTreeSet<String> = events
        .iter()
        .map(|e| {
            format!(
                "{}/{}",
                e["regarding"]["name"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or("")
            )
        })
        .collect();
    for expected in [
        "holder/Acquired",
        "holder/Released",
        "waiter/Waiting",
        "waiter/Acquired",
        "waiter/Released",
    ] {
        assert!(seen.contains(expected), "no {expected} event in {seen:?}");
    }
    assert!(
        events
            .iter()
            .all(|e| e["reportingController"] == "targetlease-controller")
    );

    // holderRef: the pod watch (cluster-wide list/watch on pods) sees the holder go.
    world.cluster.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: worker-pod\n  namespace: {ns}\nspec:\n  containers:\n  - name: main\n    image: example.invalid/worker:1\n"
    ));
    world.cluster.apply(&lease_yaml(
        &ns,
        "by-pod",
        "pod-target",
        "worker-pod",
        "holderRef: {kind: Pod, name: worker-pod}",
    ));
    wait("by-pod", Phase::Held).await;
    let started = Instant::now();
    world.cluster.kubectl_ok(&[
        "delete",
        "pod",
        "worker-pod",
        "-n",
        &ns,
        "--grace-period=0",
        "--force",
    ]);
    let released = await_lease(&api, "by-pod", "Released", 5 * SEC, |l| {
        phase_of(l) == Some(Phase::Released)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontroller log:\n{}", log()));
    eprintln!(
        "measured: holder pod deleted -> Released {:?}",
        started.elapsed()
    );
    assert_eq!(
        condition(&released, "Ready").map(|c| c.reason.as_str()),
        Some("HolderGone")
    );

    let text = log();
    // Any refused call would show here: a denied watch, patch or event.
    for needle in [
        "forbidden",
        "Forbidden",
        "could not publish event",
        "pod watch failed",
    ] {
        assert!(
            !text.contains(needle),
            "controller log contains {needle:?}:\n{text}"
        );
    }
}

/// controller.watchNamespace: the chart grants Roles only (no ClusterRole), and they are enough
/// for the controller watching that one namespace.
async fn watch_namespace_mode_needs_only_roles(world: &World) {
    let release = "team-a";
    let release_ns = "targetlease-team-a";
    let watched = world.namespace("team-a");
    world.namespace(release_ns);
    restrict(&world.cluster, release_ns);
    let chart = chart_dir().display().to_string();
    let out = world.cluster.helm(&[
        "install",
        release,
        &chart,
        "-n",
        release_ns,
        "--set",
        "crds.enabled=false",
        "--set",
        &format!("controller.watchNamespace={watched}"),
    ]);
    assert!(out.status.success(), "helm install: {}", stderr(&out));
    let name = fullname(release);
    let out = world
        .cluster
        .kubectl(&["get", "clusterrole", &format!("{name}-{release_ns}")]);
    assert!(
        stderr(&out).contains("NotFound"),
        "a ClusterRole in namespaced mode"
    );
    let kubeconfig = world.cluster.service_account_kubeconfig(release_ns, &name);
    let can = |args: &[&str]| {
        let mut all = vec!["auth", "can-i"];
        all.extend_from_slice(args);
        let out = world.cluster.kubectl_as(&kubeconfig, &all);
        stdout(&out).trim() == "yes"
    };
    for (args, want) in [
        (
            &["watch", "targetleases.targetlease.dev", "-n", "team-a"][..],
            true,
        ),
        (
            &[
                "patch",
                "targetleases.targetlease.dev",
                "--subresource=status",
                "-n",
                "team-a",
            ],
            true,
        ),
        (&["watch", "pods", "-n", "team-a"], true),
        (&["create", "events.events.k8s.io", "-n", "team-a"], true),
        (
            &["watch", "targetleases.targetlease.dev", "--all-namespaces"],
            false,
        ),
        (&["watch", "pods", "--all-namespaces"], false),
        (&["get", "pods", "-n", "shop"], false),
        (&["create", "events.events.k8s.io", "-n", "shop"], false),
        (&["list", "secrets", "-n", "team-a"], false),
    ] {
        assert_eq!(can(args), want, "can-i {}", args.join(" "));
    }
    // Only this controller may act on team-a's leases while the scenario runs.
    let paused = world.pause_controller();
    let controller = host_controller(
        &world.cluster,
        &kubeconfig,
        &world.valkey,
        release_ns,
        release,
        &["--watch-namespace", &watched],
    );
    lease_scenario(world, &watched, &|| controller.logs()).await;
    drop(controller);
    drop(paused);
    let out = world
        .cluster
        .helm(&["uninstall", release, "-n", release_ns]);
    assert!(out.status.success(), "helm uninstall: {}", stderr(&out));
}

/// `kubectl auth can-i` as the chart's ServiceAccount: (arguments, allowed?).
fn can_i(world: &World, args: &[&str]) -> bool {
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    let out = world.kubectl_as_controller(&all);
    match (out.status.code(), stdout(&out).trim()) {
        (Some(0), "yes") => true,
        (Some(1), "no") => false,
        _ => panic!(
            "kubectl auth can-i {args:?}: {}{}",
            stdout(&out),
            stderr(&out)
        ),
    }
}

/// The can-i checks docs/reference/rbac.md lists (its `can ...` / `cannot ...` lines): (allowed?,
/// arguments). The docs are the one list; this suite and the docs test both run it.
fn documented_can_i_checks() -> Vec<(bool, Vec<String>)> {
    let doc = std::fs::read_to_string(repo().join("docs/reference/rbac.md"))
        .expect("docs/reference/rbac.md");
    let block = doc
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|block| block.contains("auth can-i"))
        .expect("docs/reference/rbac.md has the can-i block");
    block
        .lines()
        .filter_map(|line| {
            let line = line.split('#').next().unwrap_or_default().trim();
            let (want, args) = match (line.strip_prefix("can "), line.strip_prefix("cannot ")) {
                (Some(args), _) => (true, args),
                (_, Some(args)) => (false, args),
                _ => return None,
            };
            Some((want, args.split_whitespace().map(str::to_owned).collect()))
        })
        .collect()
}

/// Kubernetes' built-in roles reach TargetLeases through the chart's aggregated ClusterRoles: a
/// user bound to `view` in a namespace lists them (`kubectl get all` included, the CRD being in
/// the `all` category) and changes none; one bound to `edit` creates and deletes them; neither
/// writes a status. The workload ClusterRole, bound in a namespace, is what `run` needs.
fn default_roles_reach_targetleases(world: &World) {
    let ns = world.namespace("roles");
    for (user, role) in [("viewer", "view"), ("editor", "edit")] {
        world.cluster.kubectl_ok(&[
            "create",
            "rolebinding",
            user,
            "-n",
            &ns,
            "--clusterrole",
            role,
            "--user",
            user,
        ]);
    }
    let as_user = |user: &str, args: &[&str]| -> bool {
        let mut all = vec!["auth", "can-i"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-n", &ns, "--as", user]);
        stdout(&world.cluster.kubectl(&all)).trim() == "yes"
    };
    let tl = "targetleases.targetlease.dev";
    // The aggregation controller fills the built-in roles in shortly after the install.
    poll(Duration::from_secs(30), "view reaches TargetLeases", || {
        as_user("viewer", &["list", tl]).then_some(())
    });
    for verb in ["get", "list", "watch"] {
        assert!(as_user("viewer", &[verb, tl]), "view cannot {verb}");
    }
    for verb in ["create", "patch", "delete"] {
        assert!(!as_user("viewer", &[verb, tl]), "view may {verb}");
        assert!(as_user("editor", &[verb, tl]), "edit cannot {verb}");
    }
    for user in ["viewer", "editor"] {
        assert!(
            !as_user(user, &["patch", tl, "--subresource=status"]),
            "{user} may write a status"
        );
    }
    let all = world
        .cluster
        .kubectl(&["get", "all", "-n", &ns, "--as", "viewer"]);
    assert!(
        all.status.success(),
        "kubectl get all as a viewer: {}",
        stderr(&all)
    );
    // `targetlease status` needs no more than view: a ServiceAccount bound to it sees a claim.
    world
        .cluster
        .kubectl_ok(&["create", "serviceaccount", "viewer-sa", "-n", &ns]);
    world.cluster.kubectl_ok(&[
        "create",
        "rolebinding",
        "viewer-sa",
        "-n",
        &ns,
        "--clusterrole",
        "view",
        &format!("--serviceaccount={ns}:viewer-sa"),
    ]);
    let made = apply_yaml(
        world,
        &ns,
        &lease_with_priority("viewed", "viewed-target", 0),
    );
    assert!(made.status.success(), "{}", stderr(&made));
    let kubeconfig = world.cluster.service_account_kubeconfig(&ns, "viewer-sa");
    let out = targetlease_as(
        world,
        &kubeconfig,
        &["status", "viewed-target", "-n", &ns, "-o", "json"],
    );
    assert!(out.status.success(), "status as a viewer: {}", stderr(&out));
    let shown: Value = serde_json::from_str(&stdout(&out)).expect("status JSON");
    let listed = ["holders", "waiting", "others"]
        .iter()
        .flat_map(|part| shown[part].as_array().cloned().unwrap_or_default())
        .any(|claim| claim["name"] == "viewed");
    assert!(listed, "{shown}");
    let workload = format!("{}-{RELEASE_NS}-workload", fullname(RELEASE));
    world.cluster.kubectl_ok(&[
        "create",
        "rolebinding",
        "worker",
        "-n",
        &ns,
        "--clusterrole",
        &workload,
        "--user",
        "worker",
    ]);
    for verb in ["create", "get", "list", "watch", "patch", "delete"] {
        assert!(
            as_user("worker", &[verb, tl]),
            "the workload role cannot {verb}"
        );
    }
    assert!(!as_user("worker", &["patch", tl, "--subresource=status"]));
}

fn service_account_is_least_privilege(world: &World) {
    let checks = documented_can_i_checks();
    let allowed = checks.iter().filter(|(want, _)| *want).count();
    assert!(
        allowed >= 10 && checks.len() - allowed >= 30,
        "docs/reference/rbac.md lists {allowed} allowed and {} refused checks",
        checks.len() - allowed
    );
    let mut wrong = Vec::new();
    for (want, args) in &checks {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        if can_i(world, &args) != *want {
            wrong.push(format!("can-i {} -> {}", args.join(" "), !want));
        }
    }
    assert!(
        wrong.is_empty(),
        "unexpected answers:\n{}",
        wrong.join("\n")
    );
    // A real request, not only the review: listing Secrets is Forbidden.
    let out = world.kubectl_as_controller(&["get", "secrets", "-n", RELEASE_NS]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("Forbidden"), "{}", stderr(&out));
    // Everything the ServiceAccount may do in a workload namespace, from the API server's view,
    // beyond what any ServiceAccount may do: exactly the chart's rules.
    let nobody = world
        .cluster
        .kubectl(&["create", "serviceaccount", "nobody", "-n", RELEASE_NS]);
    assert!(nobody.status.success(), "{}", stderr(&nobody));
    let baseline = world
        .cluster
        .service_account_kubeconfig(RELEASE_NS, "nobody");
    let list = |kubeconfig: &Path| -> BTreeSet<String> {
        let out = world
            .cluster
            .kubectl_as(kubeconfig, &["auth", "can-i", "--list", "-n", "shop"]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect()
    };
    let everyone = list(&baseline);
    assert!(
        everyone
            .iter()
            .any(|r| r.starts_with("selfsubjectaccessreviews")),
        "{everyone:?}"
    );
    let rows: BTreeSet<String> = list(&world.sa_kubeconfig)
        .difference(&everyone)
        .cloned()
        .collect();
    let expected: BTreeSet<String> = [
        "events.events.k8s.io [] [] [create patch]",
        "leases.coordination.k8s.io [] [] [create]",
        "leases.coordination.k8s.io [] [targetlease-installation] [get]",
        "pods [] [] [get list watch]",
        "targetleases.targetlease.dev/status [] [] [patch]",
        "targetleases.targetlease.dev [] [] [list watch patch]",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(
        rows, expected,
        "can-i --list -n shop, beyond any ServiceAccount's"
    );
}

async fn gitops_status_of_real_objects(world: &World, tools: &Tools) {
    let ns = world.namespace("chart-gitops");
    let client = world.cluster.client().await;
    let api: Api<TargetLease> = Api::namespaced(client, &ns);
    let wait = |name: &'static str, phase: Phase| {
        let api = api.clone();
        async move {
            await_lease(&api, name, &format!("{phase:?}"), 30 * SEC, move |l| {
                phase_of(l) == Some(phase)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\ncontroller log:\n{}", world.controller_log()))
        }
    };
    world
        .cluster
        .apply(&lease_yaml(&ns, "held", "report", "worker-1", ""));
    wait("held", Phase::Held).await;
    world
        .cluster
        .apply(&lease_yaml(&ns, "waiting", "report", "worker-2", ""));
    wait("waiting", Phase::Waiting).await;
    world.cluster.apply(&lease_yaml(
        &ns,
        "released",
        "other",
        "worker-3",
        "release: true",
    ));
    wait("released", Phase::Released).await;
    // A lease record of the wrong type: the controller fails closed (Failed, Stalled=True).
    let keys = TargetKeys::new("tl", &TargetRef::new(&ns, "broken").expect("target"));
    world.valkey.raw(&["SET", &keys.lease(), "not-a-hash"]);
    world
        .cluster
        .apply(&lease_yaml(&ns, "failed", "broken", "worker-4", ""));
    wait("failed", Phase::Failed).await;

    for (name, kstatus_want, argocd_want) in [
        ("held", "Current", "Healthy"),
        ("waiting", "InProgress", "Progressing"),
        ("released", "Current", "Healthy"),
        ("failed", "Failed", "Degraded"),
    ] {
        // The object exactly as kubectl returns it.
        let object = world.json(&["get", "targetlease", name, "-n", &ns]);
        let (status, message) = tools.kstatus(&object);
        eprintln!("kstatus {name}: {status} ({message})");
        assert_eq!(
            status, kstatus_want,
            "kstatus of {name}: {message}\n{object:#}"
        );
        let (health, message) = argocd_health(&object);
        eprintln!("argocd health {name}: {health} ({message})");
        assert_eq!(health, argocd_want, "Argo CD health of {name}: {message}");
    }
}

async fn workload_rbac_example_runs_run_and_wait(world: &World) {
    let ns = world.namespace("shop");
    let examples = repo().join("examples");
    let apply = |file: &str| {
        let path = examples.join(file).display().to_string();
        world.cluster.kubectl_ok(&["apply", "-n", &ns, "-f", &path]);
    };
    apply("rbac.yaml");
    apply("gitops/leases/reports-writer.yaml");
    // The workload examples are valid for the API server (no kubelet runs them here).
    for file in [
        "job-run.yaml",
        "deployment-follow.yaml",
        "deployment-standby.yaml",
    ] {
        let path = examples.join(file).display().to_string();
        world
            .cluster
            .kubectl_ok(&["apply", "--dry-run=server", "-n", &ns, "-f", &path]);
    }
    let kubeconfig = world.cluster.service_account_kubeconfig(&ns, "lease-user");
    let targetlease = |args: &[&str]| targetlease_as(world, &kubeconfig, args);
    // wait: the declared lease is Held; its token comes back.
    let out = targetlease(&["wait", "reports-writer", "--timeout=30s"]);
    assert!(
        out.status.success(),
        "targetlease wait as lease-user: {}",
        stderr(&out)
    );
    let token: u64 = stdout(&out).trim().parse().expect("a token");
    let client = world.cluster.client().await;
    let declared = Api::<TargetLease>::namespaced(client, &ns)
        .get("reports-writer")
        .await
        .expect("get");
    assert_eq!(token, token_of(&declared));
    // run: creates its TargetLease, runs the command with the token, deletes it.
    let out = targetlease(&[
        "run",
        "--target=orders-db/migration",
        "--holder=orders-migration",
        "--",
        "sh",
        "-c",
        "test -n \"$TARGETLEASE_TOKEN\" && echo \"ran with $TARGETLEASE_TARGET\"",
    ]);
    assert!(
        out.status.success(),
        "targetlease run as lease-user: {}",
        stderr(&out)
    );
    assert!(
        stdout(&out).contains("ran with orders-db/migration"),
        "{}",
        stdout(&out)
    );
    // The workload cannot write a status (and so cannot forge a token).
    let out = world.cluster.kubectl_as(
        &kubeconfig,
        &[
            "patch",
            "targetlease",
            "reports-writer",
            "--subresource=status",
            "--type=merge",
            "-p",
            "{\"status\":{\"fencingToken\":1}}",
        ],
    );
    assert!(
        !out.status.success() && stderr(&out).contains("Forbidden"),
        "{}",
        stderr(&out)
    );
    let out = world.cluster.kubectl_as(&kubeconfig, &["get", "secrets"]);
    assert!(stderr(&out).contains("Forbidden"), "{}", stderr(&out));
}

/// `targetlease ARGS` on the host with `kubeconfig`'s credentials, outside any pod.
fn targetlease_as(world: &World, kubeconfig: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_targetlease"));
    command
        .args(args)
        .envs(world.cluster.envs())
        .env("KUBECONFIG", kubeconfig)
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE");
    run_with_input(command, None)
}

/// The verbs of the workload RBAC table in docs/workloads.md ("RBAC for workloads"), as written.
fn documented_workload_verbs() -> Vec<String> {
    let doc = std::fs::read_to_string(repo().join("docs/workloads.md")).expect("docs/workloads.md");
    let section = doc
        .split("### RBAC for workloads")
        .nth(1)
        .expect("docs/workloads.md has the workload RBAC section");
    let verbs: Vec<String> = section
        .lines()
        .skip_while(|line| !line.starts_with("| verbs |"))
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .filter_map(|row| row.split('|').nth(1))
        .flat_map(|cell| {
            cell.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!verbs.is_empty(), "no verbs in the workload RBAC table");
    verbs
}

/// The verbs `examples/rbac.yaml` grants on TargetLeases.
fn example_workload_verbs() -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("examples/rbac.yaml")).expect("rbac.yaml");
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde_yaml::Value::deserialize(doc).expect("examples/rbac.yaml"))
        .filter(|doc| doc["kind"].as_str() == Some("Role"))
        .flat_map(|role| role["rules"].as_sequence().cloned().unwrap_or_default())
        .flat_map(|rule| rule["verbs"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|verb| verb.as_str().map(str::to_owned))
        .collect()
}

/// A Role built from exactly what docs/workloads.md's workload table grants keeps a `run` Held:
/// its command runs past half the TTL (where the controller releases a claim whose heartbeat
/// stopped) and the run ends with the command's own status, not a loss.
async fn workload_rbac_table_keeps_a_run_held(world: &World) {
    let verbs = documented_workload_verbs();
    let ns = world.namespace("table-rbac");
    let quoted: Vec<String> = verbs.iter().map(|verb| format!("{verb:?}")).collect();
    world.cluster.apply(&format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata: {{name: table-user, namespace: {ns}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: table-user, namespace: {ns}}}
rules:
  - apiGroups: ["targetlease.dev"]
    resources: ["targetleases"]
    verbs: [{verbs}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: table-user, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: table-user}}
subjects: [{{kind: ServiceAccount, name: table-user, namespace: {ns}}}]
"#,
        verbs = quoted.join(", ")
    ));
    let kubeconfig = world.cluster.service_account_kubeconfig(&ns, "table-user");
    let started = Instant::now();
    let out = targetlease_as(
        world,
        &kubeconfig,
        &[
            "run",
            "--target=table/report",
            "--holder=table-report",
            "--ttl=20s",
            "--",
            "sh",
            "-c",
            "sleep 11 && echo \"held past half the TTL with $TARGETLEASE_TOKEN\"",
        ],
    );
    assert!(
        out.status.success(),
        "targetlease run under the documented verbs {verbs:?} ended with {:?} after {:?}: {}\ncontroller log:\n{}",
        out.status.code(),
        started.elapsed(),
        stderr(&out),
        world.controller_log()
    );
    assert!(
        stdout(&out).contains("held past half the TTL with"),
        "{}",
        stdout(&out)
    );
    // The example grants the same: a Role copied from either works.
    let mut table = verbs.clone();
    table.sort();
    let mut example = example_workload_verbs();
    example.sort();
    assert_eq!(
        table, example,
        "docs/workloads.md's workload table and examples/rbac.yaml grant different verbs"
    );
}

/// The kubectl command docs/gitops.md gives for installing the Argo CD health check, run against
/// a stand-in argocd-cm: it adds exactly the Lua file under the documented key and keeps the rest.
fn argocd_cm_command_from_docs(world: &World) {
    let doc = std::fs::read_to_string(repo().join("docs/gitops.md")).expect("docs/gitops.md");
    let block = doc
        .split("```bash\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|block| block.contains("argocd-health.lua"))
        .expect("docs/gitops.md has the argocd-cm command block");
    world.namespace("argocd");
    world.cluster.kubectl_ok(&[
        "create",
        "configmap",
        "argocd-cm",
        "-n",
        "argocd",
        "--from-literal=url=https://argocd.example.com",
    ]);
    let mut command = Command::new("bash");
    command
        .args(["-euo", "pipefail", "-c", block])
        .current_dir(repo())
        .envs(world.cluster.envs());
    let out = run_with_input(command, None);
    assert!(
        out.status.success(),
        "{block}\n{}{}",
        stdout(&out),
        stderr(&out)
    );
    let cm = world.json(&["get", "configmap", "argocd-cm", "-n", "argocd"]);
    let lua = std::fs::read_to_string(repo().join("docs/gitops/argocd-health.lua")).expect("lua");
    assert_eq!(
        cm["data"]["resource.customizations.health.targetlease.dev_TargetLease"],
        lua.as_str()
    );
    assert_eq!(
        cm["data"]["url"], "https://argocd.example.com",
        "other keys kept"
    );
}

fn replica_sets(world: &World) -> Vec<(String, String, i64)> {
    let selector = format!("app.kubernetes.io/instance={RELEASE}");
    let mut sets: Vec<(String, String, i64)> =
        world.json(&["get", "replicasets", "-n", RELEASE_NS, "-l", &selector])["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|rs| {
                (
                    rs["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    rs["metadata"]["labels"]["pod-template-hash"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    rs["spec"]["replicas"].as_i64().unwrap_or(0),
                )
            })
            .collect();
    sets.sort();
    sets
}

/// `kubectl apply` of `yaml` (from stdin) in `ns`; the output, whether it succeeded or not.
fn apply_yaml(world: &World, ns: &str, yaml: &str) -> Output {
    world
        .cluster
        .kubectl_with_input(&["apply", "-n", ns, "-f", "-"], Some(yaml))
}

/// A TargetLease `name` on `target` asking `priority`, as YAML.
fn lease_with_priority(name: &str, target: &str, priority: i32) -> String {
    format!(
        "apiVersion: targetlease.dev/v1beta1\nkind: TargetLease\nmetadata: {{name: {name}}}\n\
         spec: {{target: {target}, holder: {name}, priority: {priority}}}\n"
    )
}

/// Removes the applied policy (and its binding) when dropped, whatever the trial's outcome: the
/// policy is cluster-scoped and the cluster is shared with the other trials.
struct AppliedPolicy<'a> {
    world: &'a World,
    yaml: String,
}

impl AppliedPolicy<'_> {
    fn apply<'a>(world: &'a World, yaml: String) -> AppliedPolicy<'a> {
        let applied = apply_yaml(world, "default", &yaml);
        assert!(applied.status.success(), "{}", stderr(&applied));
        AppliedPolicy { world, yaml }
    }
}

impl Drop for AppliedPolicy<'_> {
    fn drop(&mut self) {
        let _ = self.world.cluster.kubectl_with_input(
            &["delete", "--ignore-not-found", "-f", "-"],
            Some(&self.yaml),
        );
    }
}

/// The chart's priority cap (priorityCap.*), rendered with its values and applied: the API
/// server refuses a priority above the cap with the chart's message (an absent priority counts
/// as 0), lets a TargetLease that already asks more be changed and lowered but not raised, lets
/// the exempt groups through, and with controller.watchNamespace caps that namespace only.
fn priority_cap_refuses_priorities_above_it(world: &World, tools: &Tools) {
    let ns = world.namespace("capped");
    let elsewhere = world.namespace("uncapped");
    let render = |extra: &[&str]| -> String {
        let mut args = vec![
            "--set",
            "priorityCap.enabled=true",
            "--show-only",
            "templates/priority-cap.yaml",
        ];
        args.extend_from_slice(extra);
        let docs = tools.render_ok(&args);
        assert_eq!(docs.len(), 2, "a policy and its binding: {docs:?}");
        docs.iter().map(|d| format!("{d}\n---\n")).collect()
    };
    // Whether the API server admits a TargetLease asking `priority` (none: no field) in `ns`,
    // asked with a server-side dry run under a fresh name; the refusal's text when it does not.
    let attempt = std::cell::Cell::new(0);
    let admits = |ns: &str, priority: Option<i32>| -> Result<(), String> {
        attempt.set(attempt.get() + 1);
        let mut yaml = lease_with_priority(&format!("probe-{}", attempt.get()), "capped-target", 0);
        yaml = match priority {
            Some(p) => yaml.replace("priority: 0", &format!("priority: {p}")),
            None => yaml.replace(", priority: 0", ""),
        };
        let out = world.cluster.kubectl_with_input(
            &["create", "--dry-run=server", "-n", ns, "-f", "-"],
            Some(&yaml),
        );
        if out.status.success() {
            Ok(())
        } else {
            Err(stderr(&out))
        }
    };
    // Made before the cap: it may keep its priority, and lower it.
    let before = apply_yaml(
        world,
        &ns,
        &lease_with_priority("early-high", "capped-target", 5),
    );
    assert!(before.status.success(), "{}", stderr(&before));
    {
        let _policy = AppliedPolicy::apply(world, render(&["--set", "priorityCap.maxPriority=2"]));
        // The API server enforces a new policy once its informers saw it: asked until refused.
        let refusal = poll(
            Duration::from_secs(30),
            "the cap refuses priority 3",
            || admits(&ns, Some(3)).err(),
        );
        assert!(
            refusal.contains("spec.priority may be at most 2 in this cluster")
                && refusal.contains("priorityCap.maxPriority"),
            "{refusal}"
        );
        assert_eq!(admits(&ns, Some(2)), Ok(()));
        assert_eq!(admits(&ns, None), Ok(()));
        assert_eq!(admits(&elsewhere, Some(3)).map_err(|_| ()), Err(()));
        let patch = |body: &str| {
            world.cluster.kubectl(&[
                "patch",
                "targetlease",
                "early-high",
                "-n",
                &ns,
                "--type=merge",
                "-p",
                body,
            ])
        };
        for allowed in [
            "{\"spec\":{\"release\":true}}",
            "{\"spec\":{\"priority\":4}}",
        ] {
            let out = patch(allowed);
            assert!(out.status.success(), "{allowed}: {}", stderr(&out));
        }
        let raise = patch("{\"spec\":{\"priority\":6}}");
        assert!(
            !raise.status.success() && stderr(&raise).contains("may be at most 2"),
            "{}",
            stderr(&raise)
        );
        // The controller's own writes on a TargetLease that asks more than the cap, by a user the
        // cap applies to (no exempt group): its status (a subresource the policy does not match)
        // and its finalizer (an update that leaves the priority as it was).
        let status = world.cluster.kubectl(&[
            "patch",
            "targetlease",
            "early-high",
            "-n",
            &ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            "{\"status\":{\"phase\":\"Waiting\"}}",
        ]);
        assert!(status.status.success(), "status write: {}", stderr(&status));
        for finalizers in [
            "{\"metadata\":{\"finalizers\":[\"targetlease.dev/release\"]}}",
            "{\"metadata\":{\"finalizers\":null}}",
        ] {
            let out = patch(finalizers);
            assert!(out.status.success(), "{finalizers}: {}", stderr(&out));
        }
    }
    {
        // An exempt group (the admin's) may set more.
        let _policy = AppliedPolicy::apply(
            world,
            render(&[
                "--set",
                "priorityCap.maxPriority=2",
                "--set",
                "priorityCap.exemptGroups={system:masters}",
            ]),
        );
        poll(
            Duration::from_secs(30),
            "the exempt group may set priority 3",
            || admits(&ns, Some(3)).ok(),
        );
    }
    {
        // A namespaced release's cap, below 0: its namespace only, and an absent priority is 0.
        let _policy = AppliedPolicy::apply(
            world,
            render(&[
                "--set",
                "priorityCap.maxPriority=-1",
                "--set",
                &format!("controller.watchNamespace={ns}"),
            ]),
        );
        let refusal = poll(
            Duration::from_secs(30),
            "the cap refuses no priority",
            || admits(&ns, None).err(),
        );
        assert!(refusal.contains("may be at most -1"), "{refusal}");
        assert_eq!(admits(&ns, Some(-1)), Ok(()));
        assert_eq!(admits(&elsewhere, None), Ok(()));
    }
    for namespace in [&ns, &elsewhere] {
        world
            .cluster
            .kubectl_ok(&["delete", "namespace", namespace, "--wait=false"]);
    }
}

/// A TargetLease until it is Held; its token.
async fn held_token(api: &Api<TargetLease>, name: &str) -> u64 {
    let lease = await_lease(api, name, "Held", 30 * SEC, |l| {
        phase_of(l) == Some(Phase::Held)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    token_of(&lease)
}

/// Every TargetLease example applied as each served version, side by side: the controller
/// (speaking v1beta1) holds them all, `kubectl get tl` and both versions' URLs list them,
/// the field selectors work, `targetlease wait` reads an object created as v1alpha1, and the
/// API server stores them in the chart's storage version (v1alpha1) whatever they were
/// written as.
async fn examples_work_under_both_versions(world: &World) {
    let examples = repo().join("examples/gitops/leases");
    let client = world.cluster.client().await;
    let kubeconfig = PathBuf::from(world.cluster.kubeconfig());
    for version in SERVED_VERSIONS {
        let ns = world.namespace(&format!("examples-{version}"));
        let api: Api<TargetLease> = Api::namespaced(client.clone(), &ns);
        for file in ["reports-writer.yaml", "orders-maintenance.yaml"] {
            let text = std::fs::read_to_string(examples.join(file)).expect("example");
            let current = format!("apiVersion: targetlease.dev/{VERSION}");
            assert!(text.contains(&current), "{file} is written as {VERSION}");
            let text = text.replace(&current, &format!("apiVersion: targetlease.dev/{version}"));
            let out = apply_yaml(world, &ns, &text);
            assert!(
                out.status.success(),
                "apply {file} as {version}: {}",
                stderr(&out)
            );
            // Both versions are current while v1alpha1 is stored: no deprecation warning.
            assert!(!stderr(&out).contains("deprecated"), "{}", stderr(&out));
        }
        let writer = held_token(&api, "reports-writer").await;
        held_token(&api, "orders-maintenance").await;
        // `targetlease wait` speaks v1beta1; the object may have been created as v1alpha1.
        let out = targetlease_as(world, &kubeconfig, &["wait", "reports-writer", "-n", &ns]);
        assert!(out.status.success(), "wait: {}", stderr(&out));
        assert_eq!(stdout(&out).trim(), writer.to_string());
        // The short name, and each version's own URL, list both with their tokens.
        let listed = |resource: &str| {
            let list = world.json(&["get", resource, "-n", &ns]);
            let mut names: Vec<String> = list["items"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|o| {
                    assert!(o["status"]["fencingToken"].as_u64().is_some(), "{o}");
                    o["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned()
                })
                .collect();
            names.sort();
            names
        };
        for resource in [
            "tl".to_string(),
            format!("targetleases.v1alpha1.{}", targetlease::api::GROUP),
            format!("targetleases.v1beta1.{}", targetlease::api::GROUP),
        ] {
            assert_eq!(
                listed(&resource),
                ["orders-maintenance", "reports-writer"],
                "{resource}"
            );
        }
        let table = world.cluster.kubectl_ok(&["get", "tl", "-n", &ns]);
        assert!(
            table.contains("reports-db/writer") && table.contains("Held"),
            "{table}"
        );
        // Field selectors on the spec's target and holder (the CRD's selectableFields).
        for selector in [
            "spec.target=reports-db/writer",
            "spec.holder=reports-writer",
        ] {
            let found = world.json(&["get", "tl", "-n", &ns, "--field-selector", selector]);
            let names: Vec<_> = found["items"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|o| o["metadata"]["name"].clone())
                .collect();
            assert_eq!(names, [json!("reports-writer")], "{selector}");
        }
        for name in ["reports-writer", "orders-maintenance"] {
            assert_eq!(
                world.cluster.stored_api_version(&ns, name),
                "targetlease.dev/v1alpha1",
                "{ns}/{name} is stored in the chart's default storage version"
            );
        }
    }
}

/// The CRD with only v1alpha1, as a release before v1beta1 installs it.
fn v1alpha1_only_crd() -> String {
    let mut crd = targetlease::api::crd(StorageVersion::V1alpha1);
    crd.spec.versions.retain(|v| v.name == "v1alpha1");
    serde_yaml::to_string(&crd).expect("CRD yaml")
}

fn stored_versions(world: &World) -> Vec<String> {
    let crd = world.json(&["get", "crd", targetlease::api::CRD_NAME]);
    serde_json::from_value(crd["status"]["storedVersions"].clone()).expect("storedVersions")
}

/// The versions the installed CRD marks for storage.
fn storage_versions(world: &World) -> Vec<String> {
    support::chart::storage_versions(&world.json(&["get", "crd", targetlease::api::CRD_NAME]))
}

/// The storage move and back, as docs/upgrading/0.1-to-0.2.md tells it: `helm upgrade` with
/// `crds.storageVersion=v1beta1`, `targetlease migrate-storage` (every object re-encoded, read
/// from etcd itself, and only then `storedVersions` narrowed), the deprecation warning for
/// v1alpha1 clients, a v1alpha1-only CRD refused while v1beta1 is stored, a second run that
/// rewrites every object only when asked (`--rewrite-all`), upgrades whose values lack the key
/// keeping the storage version the cluster has, and the way back that makes the v1alpha1-only
/// CRD accepted again. Held leases keep their tokens throughout.
async fn storage_moves_to_v1beta1_and_back(world: &World) {
    let ns = world.namespace("storage-move");
    let client = world.cluster.client().await;
    let api: Api<TargetLease> = Api::namespaced(client, &ns);
    let names: Vec<String> = (0..3).map(|i| format!("moved-{i}")).collect();
    let mut tokens = Vec::new();
    for name in &names {
        world.cluster.apply(&lease_yaml(
            &ns,
            name,
            &format!("storage/{name}"),
            "mover",
            "",
        ));
        tokens.push(held_token(&api, name).await);
    }
    let migrate = |extra: &[&str]| {
        let mut args = vec!["migrate-storage"];
        args.extend(extra);
        let out = targetlease_as(world, Path::new(world.cluster.kubeconfig()), &args);
        assert!(out.status.success(), "migrate-storage: {}", stderr(&out));
        stdout(&out)
    };
    let chart = chart_dir().display().to_string();
    let set_storage = |version: &str| {
        let set = format!("crds.storageVersion={version}");
        let out = world.cluster.helm(&[
            "upgrade",
            RELEASE,
            &chart,
            "-n",
            RELEASE_NS,
            "--reuse-values",
            "--set",
            &set,
        ]);
        assert!(out.status.success(), "helm upgrade {set}: {}", stderr(&out));
    };
    let stored = |version: &str| {
        for name in &names {
            assert_eq!(
                world.cluster.stored_api_version(&ns, name),
                format!("targetlease.dev/{version}"),
                "{name} in etcd"
            );
        }
    };
    let old_crd_dry_run = || {
        world.cluster.kubectl_with_input(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--dry-run=server",
                "-f",
                "-",
            ],
            Some(&v1alpha1_only_crd()),
        )
    };
    stored("v1alpha1");
    assert_eq!(stored_versions(world), ["v1alpha1"]);
    assert!(
        old_crd_dry_run().status.success(),
        "{}",
        stderr(&old_crd_dry_run())
    );
    {
        // No status writes while the stored encoding is watched (a write re-encodes too).
        let _paused = world.pause_controller();
        set_storage("v1beta1");
        // The objects stay as they were written until something writes them.
        stored("v1alpha1");
        assert_eq!(stored_versions(world), ["v1alpha1", "v1beta1"]);
        // v1alpha1 clients are warned, and still served.
        let out = apply_yaml(
            world,
            &ns,
            &lease_yaml(&ns, "late", "storage/late", "mover", "")
                .replace("targetlease.dev/v1beta1", "targetlease.dev/v1alpha1"),
        );
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(targetlease::api::V1ALPHA1_DEPRECATION),
            "no deprecation warning: {}",
            stderr(&out)
        );
        assert_eq!(
            world.cluster.stored_api_version(&ns, "late"),
            "targetlease.dev/v1beta1"
        );
        // A release that serves only v1alpha1 cannot be installed while v1beta1 may be stored.
        let refused = old_crd_dry_run();
        assert!(
            !refused.status.success(),
            "a v1alpha1-only CRD was accepted"
        );
        assert!(
            stderr(&refused).contains("storedVersions"),
            "{}",
            stderr(&refused)
        );
        let said = migrate(&[]);
        assert!(
            said.contains("rewrote") && said.contains("as v1beta1"),
            "{said}"
        );
        stored("v1beta1");
        assert_eq!(stored_versions(world), ["v1beta1"]);
        assert!(migrate(&[]).contains("nothing to do"));
        // With several API servers, one that took the change late may have stored a write in
        // v1alpha1 since, which storedVersions no longer shows (done here past the API server,
        // in etcd): a plain run cannot know, a run with --rewrite-all writes it again.
        world
            .cluster
            .store_as_api_version(&ns, &names[0], "targetlease.dev/v1alpha1");
        assert!(migrate(&[]).contains("nothing to do"));
        assert_eq!(
            world.cluster.stored_api_version(&ns, &names[0]),
            "targetlease.dev/v1alpha1"
        );
        let said = migrate(&["--rewrite-all"]);
        let rewritten = support::chart::migrate_rewrote(&said);
        // It counts what it re-encoded: the object left behind, not those already stored so.
        assert!(
            (1..names.len()).contains(&rewritten) && said.contains("now [v1beta1]"),
            "{said}"
        );
        stored("v1beta1");
        assert_eq!(stored_versions(world), ["v1beta1"]);
        // An upgrade whose values leave the key empty keeps v1beta1: the chart reads the
        // storage version from the installed CRD.
        set_storage("");
        assert_eq!(storage_versions(world), ["v1beta1"]);
        assert_eq!(stored_versions(world), ["v1beta1"]);
        // So does one whose values lack it (a values file without it, --reuse-values from an
        // older release or after a refused rollback), rendered by the API server's dry run.
        let out = world.cluster.helm(&[
            "upgrade",
            RELEASE,
            &chart,
            "-n",
            RELEASE_NS,
            "--reset-values",
            "--set",
            "crds.storageVersion=null",
            "--dry-run=server",
            "--output=json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(
            support::chart::dry_run_storage_versions(&stdout(&out)),
            ["v1beta1"],
            "without crds.storageVersion"
        );
        // Still refused: v1beta1 is what is stored now.
        assert!(!old_crd_dry_run().status.success());
        // The way back, asked for by name: store v1alpha1 again, migrate, and the old CRD is
        // accepted.
        set_storage("v1alpha1");
        assert_eq!(storage_versions(world), ["v1alpha1"]);
        let said = migrate(&[]);
        assert!(said.contains("as v1alpha1"), "{said}");
        stored("v1alpha1");
        assert_eq!(stored_versions(world), ["v1alpha1"]);
        assert!(
            old_crd_dry_run().status.success(),
            "{}",
            stderr(&old_crd_dry_run())
        );
    }
    // The leases were never given up: the same tokens, Held again under the restarted
    // controller.
    for (name, token) in names.iter().zip(&tokens) {
        assert_eq!(held_token(&api, name).await, *token, "{name}");
    }
}

fn upgrade_rolls_the_deployment(world: &World) {
    let before = replica_sets(world);
    assert_eq!(before.len(), 1, "{before:?}");
    let old_hash = before[0].1.clone();
    let chart = chart_dir().display().to_string();
    let upgrade = |sets: &[&str]| {
        let mut args = vec![
            "upgrade",
            RELEASE,
            chart.as_str(),
            "-n",
            RELEASE_NS,
            "--reuse-values",
        ];
        for set in sets {
            args.extend(["--set", set]);
        }
        let started = Instant::now();
        let out = world.cluster.helm(&args);
        assert!(out.status.success(), "helm upgrade: {}", stderr(&out));
        started.elapsed()
    };
    // Same values: the pod template (with the Valkey URL checksum) does not change.
    let took = upgrade(&[]);
    eprintln!("measured: helm upgrade without changes {took:?}");
    std::thread::sleep(2 * SEC);
    assert_eq!(
        replica_sets(world).len(),
        1,
        "an unchanged upgrade rolled the pods"
    );
    // A ReplicaSet none of `before` has, once it has pods.
    let rolled = |before: &[&str]| {
        poll(60 * SEC, "a new ReplicaSet with pods", || {
            replica_sets(world)
                .into_iter()
                .map(|(_, hash, _)| hash)
                .find(|hash| !before.contains(&hash.as_str()))
                .filter(|hash| {
                    let selector = format!("pod-template-hash={hash}");
                    !world.json(&["get", "pods", "-n", RELEASE_NS, "-l", &selector])["items"]
                        .as_array()
                        .is_none_or(Vec::is_empty)
                })
        })
    };
    // A new Valkey URL: the Secret changes and the pods roll.
    let started = Instant::now();
    let took = upgrade(&["valkey.url=redis://valkey.other-namespace:6379"]);
    let new_hash = rolled(&[&old_hash]);
    eprintln!(
        "measured: helm upgrade {took:?}; first pod of the new ReplicaSet {:?} after the upgrade began",
        started.elapsed()
    );
    // Only the password in the URL changes: the pods roll too (they read the URL at start).
    upgrade(&["valkey.url=redis://:rotated-pw@valkey.other-namespace:6379"]);
    rolled(&[&old_hash, &new_hash]);
    let secret = world.json(&[
        "get",
        "secret",
        &format!("{FULLNAME}-valkey"),
        "-n",
        RELEASE_NS,
    ]);
    assert!(secret["data"]["url"].is_string());
    let deploy = world.json(&["get", "deployment", FULLNAME, "-n", RELEASE_NS]);
    assert_eq!(
        deploy["metadata"]["generation"], 3,
        "{}",
        deploy["metadata"]
    );
    assert_ne!(new_hash, old_hash);
    let history = world.cluster.helm(&["history", RELEASE, "-n", RELEASE_NS]);
    assert!(
        stdout(&history).lines().count() >= 4,
        "{}",
        stdout(&history)
    );
    assert!(failed_creates(world, RELEASE_NS).is_empty());
}

async fn uninstall_keeps_crd_and_leases(world: &World) {
    let ns = world.namespace("chart-keep");
    let client = world.cluster.client().await;
    let api: Api<TargetLease> = Api::namespaced(client, &ns);
    world
        .cluster
        .apply(&lease_yaml(&ns, "kept", "kept-target", "worker-1", ""));
    await_lease(&api, "kept", "Held", 30 * SEC, |l| {
        phase_of(l) == Some(Phase::Held)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // The controller's ServiceAccount goes with the release: stop the controller first.
    if let Some(mut controller) = world.take_controller() {
        let status = controller.terminate();
        assert!(status.success(), "controller exit: {status}");
    }
    let started = Instant::now();
    let out = world
        .cluster
        .helm(&["uninstall", RELEASE, "-n", RELEASE_NS]);
    eprintln!("measured: helm uninstall {:?}", started.elapsed());
    assert!(out.status.success(), "helm uninstall: {}", stderr(&out));
    let said = format!("{}{}", stdout(&out), stderr(&out));
    assert!(said.contains("kept due to the resource policy"), "{said}");
    // The CRD and every TargetLease remain; the release's other objects are gone.
    world.cluster.kubectl_ok(&["get", "crd", CRD]);
    let kept = api
        .get("kept")
        .await
        .expect("the TargetLease survived the uninstall");
    assert_eq!(phase_of(&kept), Some(Phase::Held));
    let cluster_role = cluster_role();
    for (kind, name, ns) in [
        ("clusterrole", cluster_role.as_str(), None),
        ("clusterrolebinding", cluster_role.as_str(), None),
        ("serviceaccount", FULLNAME, Some(RELEASE_NS)),
        ("deployment", FULLNAME, Some(RELEASE_NS)),
        ("role", "targetlease-leader-election", Some(RELEASE_NS)),
    ] {
        let mut args = vec!["get", kind, name];
        if let Some(ns) = ns {
            args.extend(["-n", ns]);
        }
        let out = world.cluster.kubectl(&args);
        assert!(
            stderr(&out).contains("NotFound"),
            "{kind}/{name} left behind: {}",
            stdout(&out)
        );
    }
    // The ServiceAccount's token died with it.
    let out = world.kubectl_as_controller(&["get", "targetleases", "-A"]);
    assert!(
        !out.status.success(),
        "the deleted ServiceAccount's token still works"
    );
}

/// The world every test works in, started by the first test that runs; if starting it failed,
/// every test fails with the same message.
type Shared = Arc<Mutex<Option<Result<Arc<World>, String>>>>;

fn world(shared: &Shared) -> Arc<World> {
    let mut slot = shared.lock().unwrap_or_else(|e| e.into_inner());
    let result = slot.get_or_insert_with(|| {
        std::panic::catch_unwind(World::start)
            .map(Arc::new)
            .map_err(|panic| suite::panic_message(&*panic))
    });
    match result {
        Ok(world) => world.clone(),
        Err(e) => panic!("the cluster could not be set up: {e}"),
    }
}

/// A trial on the shared world.
macro_rules! on_world {
    ($shared:expr, $name:literal, |$world:ident, $tools:ident| $body:expr) => {{
        let shared = $shared.clone();
        let tools = TOOLS.clone();
        suite::trial($name, move || {
            // The cluster and the release start before the trial's time limit runs: a machine
            // that has not built the control plane yet waits for that build first.
            let started = world(&shared);
            async move {
                let $world = &*started;
                let $tools = &*tools;
                let _ = $tools;
                $body
            }
        })
    }};
}

static TOOLS: std::sync::LazyLock<Arc<Tools>> =
    std::sync::LazyLock::new(|| Arc::new(Tools::load()));

/// The suite's trials, in order, on one release.
pub fn suite(args: &Arguments) -> Conclusion {
    let mut args = args.clone();
    // One at a time, in order: the tests share one release, and the last one uninstalls it.
    args.test_threads = Some(1);
    let shared: Shared = Arc::default();
    let trials: Vec<Trial> = vec![
        on_world!(
            shared,
            "install_under_restricted_pod_security",
            |world, tools| install_under_restricted_pod_security(world)
        ),
        on_world!(shared, "chart_rbac_runs_the_controller", |world, tools| {
            chart_rbac_runs_the_controller(world).await
        }),
        on_world!(
            shared,
            "service_account_is_least_privilege",
            |world, tools| service_account_is_least_privilege(world)
        ),
        on_world!(
            shared,
            "default_roles_reach_targetleases",
            |world, tools| default_roles_reach_targetleases(world)
        ),
        on_world!(
            shared,
            "priority_cap_refuses_priorities_above_it",
            |world, tools| priority_cap_refuses_priorities_above_it(world, tools)
        ),
        on_world!(shared, "gitops_status_of_real_objects", |world, tools| {
            gitops_status_of_real_objects(world, tools).await
        }),
        on_world!(shared, "argocd_cm_command_from_docs", |world, tools| {
            argocd_cm_command_from_docs(world)
        }),
        on_world!(
            shared,
            "workload_rbac_example_runs_run_and_wait",
            |world, tools| workload_rbac_example_runs_run_and_wait(world).await
        ),
        on_world!(
            shared,
            "workload_rbac_table_keeps_a_run_held",
            |world, tools| workload_rbac_table_keeps_a_run_held(world).await
        ),
        on_world!(
            shared,
            "watch_namespace_mode_needs_only_roles",
            |world, tools| watch_namespace_mode_needs_only_roles(world).await
        ),
        on_world!(
            shared,
            "examples_work_under_both_versions",
            |world, tools| examples_work_under_both_versions(world).await
        ),
        on_world!(
            shared,
            "storage_moves_to_v1beta1_and_back",
            |world, tools| storage_moves_to_v1beta1_and_back(world).await
        ),
        on_world!(shared, "upgrade_rolls_the_deployment", |world, tools| {
            upgrade_rolls_the_deployment(world)
        }),
        // Last: it uninstalls the release.
        on_world!(shared, "uninstall_keeps_crd_and_leases", |world, tools| {
            uninstall_keeps_crd_and_leases(world).await
        }),
    ];
    let conclusion = suite::run(&args, trials);
    // Stop the controller, Valkey and the cluster before reporting.
    drop(shared.lock().unwrap_or_else(|e| e.into_inner()).take());
    conclusion
}
