//! Real pods on a real node (`e2e/cluster up --node`: scheduler, containerd, kubelet,
//! kube-proxy): the controller image built by `scripts/image.sh` and run by the kubelet, the
//! chart installed with `helm install` as users install it, and the examples applied unchanged
//! but for the application image. Nothing runs on the host except the control plane, the node
//! and Valkey. The tests share one cluster and run one at a time, in order. A node that cannot
//! start fails the suite; it never skips.

use targetlease_test_support as support;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Conclusion};
use serde_json::Value;

use support::kube::{Cluster, http_get, metric, repo};
use support::oci::{Layout, build_controller_image, unpack};
use support::sentinel::{MASTER as SENTINEL_MASTER, Options as SentinelOptions, Topology};
use support::server::{Server, ServerKind};

const SYSTEM_NS: &str = "targetlease-system";
const RELEASE: &str = "tl";
const APP_NS: &str = "shop";
const PASSWORD: &str = "node-suite-secret";
/// The application image the examples' `registry.example.com/...` references are replaced by:
/// busybox (a shell), the targetlease binary and the two programs the examples start.
const APP_IMAGE: &str = "localhost/targetlease-examples-app:test";

/// What every test shares. Fields drop in order: Valkey before the cluster.
struct World {
    valkey: Server,
    /// The controller image: `name@sha256:manifest-digest`.
    controller_image: String,
    /// Its image id (the digest of its configuration), as the kubelet reports it.
    controller_image_id: String,
    cluster: Cluster,
}

/// The shared world, started by the first test that needs it. A start that failed fails every
/// test with its message instead of starting another node.
static WORLD: Mutex<Option<Result<Arc<World>, String>>> = Mutex::new(None);

fn world() -> Arc<World> {
    let mut slot = WORLD.lock().unwrap_or_else(|e| e.into_inner());
    let started = slot.get_or_insert_with(|| {
        std::panic::catch_unwind(World::start)
            .map(Arc::new)
            .map_err(|panic| support::suite::panic_message(&*panic))
    });
    match started {
        Ok(world) => world.clone(),
        Err(message) => panic!("the node suite's cluster did not start: {message}"),
    }
}

impl World {
    fn start() -> World {
        let started = Instant::now();
        let cluster = Cluster::start_with_node();
        let node_ip = cluster.node_ip();
        // Pods reach Valkey on the node's address, with a password, as they would a Valkey
        // service of the cluster.
        let valkey = Server::start_with(
            ServerKind::Valkey91,
            &["--requirepass", PASSWORD, "--bind", "127.0.0.1", &node_ip],
        );
        let (tarball, controller_image) = build_controller_image();
        cluster.import_image(&tarball);
        let controller = unpack(&tarball);
        let controller_image_id = controller.config_digest.clone();
        cluster.import_image(&app_image(&cluster, &controller));
        for ns in [SYSTEM_NS, APP_NS] {
            cluster.kubectl_ok(&["create", "namespace", ns]);
            cluster.kubectl_ok(&[
                "label",
                "namespace",
                ns,
                "pod-security.kubernetes.io/enforce=restricted",
                "pod-security.kubernetes.io/warn=restricted",
            ]);
        }
        // The examples' ServiceAccount and Role (every example needs them).
        cluster.kubectl_ok(&[
            "apply",
            "-f",
            &repo().join("examples/rbac.yaml").display().to_string(),
        ]);
        let url = format!("redis://{node_ip}:{}", valkey.port);
        cluster.valkey_secret(SYSTEM_NS, "valkey", &url, PASSWORD);
        let chart = repo().join("charts/targetlease").display().to_string();
        let mut args = vec!["install", RELEASE, &chart, "-n", SYSTEM_NS];
        args.extend(Cluster::NODE_CHART_SETTINGS);
        let install = cluster.helm(&args);
        assert!(
            install.status.success(),
            "helm install failed: {}",
            String::from_utf8_lossy(&install.stderr)
        );
        support::suite::measured("node, images and chart install", started.elapsed());
        World {
            valkey,
            controller_image,
            controller_image_id,
            cluster,
        }
    }

    fn kubectl_json(&self, args: &[&str]) -> Value {
        self.cluster.kubectl_json(args)
    }

    /// Polls `probe` every 200 ms until it returns Some, or panics after `limit` with `what`
    /// and the events of `ns`.
    fn until<T>(
        &self,
        what: &str,
        ns: &str,
        limit: Duration,
        mut probe: impl FnMut() -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(value) = probe() {
                return value;
            }
            if Instant::now() > deadline {
                let events =
                    self.cluster
                        .kubectl(&["get", "events", "-n", ns, "--sort-by=.lastTimestamp"]);
                let pods = self
                    .cluster
                    .kubectl(&["get", "pods", "-n", ns, "-o", "wide"]);
                panic!(
                    "{what}: not within {limit:?}\npods:\n{}\nevents:\n{}",
                    String::from_utf8_lossy(&pods.stdout),
                    String::from_utf8_lossy(&events.stdout)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn controller_pods(&self) -> Vec<Value> {
        let pods = self.kubectl_json(&[
            "get",
            "pods",
            "-n",
            SYSTEM_NS,
            "-l",
            "app.kubernetes.io/name=targetlease",
        ]);
        pods["items"].as_array().cloned().unwrap_or_default()
    }

    fn lease(&self, name: &str) -> Option<Value> {
        let out = self
            .cluster
            .kubectl(&["get", "targetlease", name, "-n", APP_NS, "-o", "json"]);
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).expect("json"))
    }

    /// The TargetLease `targetlease run` made for `pod` (its holderRef names the pod).
    fn lease_of_pod(&self, pod: &str) -> Option<Value> {
        let leases = self.kubectl_json(&["get", "targetleases", "-n", APP_NS]);
        leases["items"]
            .as_array()?
            .iter()
            .find(|l| l["spec"]["holderRef"]["name"] == pod)
            .cloned()
    }

    fn phase_of_pod(&self, pod: &str) -> Option<String> {
        self.lease_of_pod(pod)
            .and_then(|l| l["status"]["phase"].as_str().map(str::to_owned))
    }

    fn phase(&self, name: &str) -> Option<String> {
        self.lease(name)
            .and_then(|l| l["status"]["phase"].as_str().map(str::to_owned))
    }

    fn logs(&self, args: &[&str]) -> String {
        let mut full = vec!["logs", "-n", APP_NS];
        full.extend(args);
        self.cluster.kubectl_ok(&full)
    }

    /// An example file with its application image replaced by [`APP_IMAGE`].
    fn example(&self, file: &str) -> String {
        let text = std::fs::read_to_string(repo().join("examples").join(file)).expect("example");
        let mut replaced = 0;
        let text: String = text
            .lines()
            .map(|line| {
                if line
                    .trim_start()
                    .starts_with("image: registry.example.com/")
                {
                    replaced += 1;
                    let indent = &line[..line.len() - line.trim_start().len()];
                    format!("{indent}image: {APP_IMAGE}\n")
                } else {
                    format!("{line}\n")
                }
            })
            .collect();
        assert_eq!(replaced, 1, "{file} names one application image");
        text
    }
}

/// Builds the application image for the examples: busybox, the controller image's targetlease
/// binary at /usr/local/bin (as the examples' comment tells users to copy it), and
/// /app/reports-writer and /app/migrate and /app/report, which print the token (and slot) they
/// were given.
fn app_image(cluster: &Cluster, controller: &Layout) -> PathBuf {
    let programs = [
        (
            "app/reports-writer",
            "#!/bin/sh\n# The follow example's application: shows the token file's token whenever it changes.\ntrap 'exit 0' TERM\nlast=none\nwhile :; do\n  token=$(sed -n 's/^TARGETLEASE_TOKEN=//p' \"$TARGETLEASE_TOKEN_FILE\" 2>/dev/null)\n  [ -n \"$token\" ] || token=none\n  if [ \"$token\" != \"$last\" ]; then echo \"reports-writer: token=$token\"; last=$token; fi\n  sleep 0.05\ndone\n",
        ),
        (
            "app/scheduler",
            "#!/bin/sh\n# The standby example's application: its token once, then a tick every 100 ms until stopped.\ntrap 'exit 0' TERM\necho \"scheduler: start token=$TARGETLEASE_TOKEN\"\nwhile :; do echo tick; sleep 0.1; done\n",
        ),
        (
            "app/report",
            "#!/bin/sh\n# The permits Job example's report: shows its slot, token and arguments, works a little, exits.\necho \"report: start slot=$TARGETLEASE_SLOT token=$TARGETLEASE_TOKEN args=$*\"\nsleep \"${REPORT_SECONDS:-6}\"\necho \"report: done slot=$TARGETLEASE_SLOT\"\n",
        ),
        (
            "app/migrate",
            "#!/bin/sh\n# The Job example's migration: shows its token and arguments, works a little, exits.\necho \"migrate: start token=$TARGETLEASE_TOKEN args=$*\"\nsleep \"${MIGRATE_SECONDS:-8}\"\necho \"migrate: done token=$TARGETLEASE_TOKEN\"\n",
        ),
    ];
    let binary = controller.binary(&cluster.scratch().join("controller-binary"));
    support::oci::app_image(cluster.scratch(), APP_IMAGE, &binary, &programs)
}

fn ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// The chart's two controller pods run the image built here, under the restricted Pod Security
/// level, and both become Ready (their probes pass) without a restart.
fn chart_pods_run_and_are_ready() {
    let w = &*world();
    let started = Instant::now();
    let pods = w.until(
        "two Ready controller pods",
        SYSTEM_NS,
        Duration::from_secs(120),
        || {
            let pods = w.controller_pods();
            (pods.len() == 2 && pods.iter().all(ready)).then_some(pods)
        },
    );
    support::suite::measured("controller pods Ready after install", started.elapsed());
    let name = w.controller_image.split('@').next().expect("name");
    for pod in &pods {
        let status = &pod["status"]["containerStatuses"][0];
        assert_eq!(status["image"].as_str(), Some(name), "{status}");
        assert_eq!(status["restartCount"], 0, "{status}");
        // The kubelet reports the id (configuration digest) of the image it runs: built here.
        assert_eq!(
            status["imageID"].as_str(),
            Some(w.controller_image_id.as_str())
        );
        assert_eq!(pod["status"]["phase"], "Running");
        assert_eq!(
            pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"],
            true
        );
    }
    // The restricted level is enforced: a privileged pod is refused in the same namespace.
    let refused = w.cluster.kubectl_with_input(
        &["apply", "-n", SYSTEM_NS, "-f", "-"],
        Some(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: privileged\nspec:\n  containers:\n  - name: c\n    image: {name}\n    securityContext:\n      privileged: true\n"
        )),
    );
    assert!(!refused.status.success(), "a privileged pod was admitted");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("restricted"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// One pod leads (the election Lease names it, its `targetlease_leading` is 1, the other's 0),
/// and both serve metrics on their pod address, reached from the host through the node's
/// network.
fn one_leader_and_metrics_served() {
    let w = &*world();
    let pods = w.controller_pods();
    let names: Vec<&str> = pods
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str())
        .collect();
    let holder = w.until(
        "an elected leader",
        SYSTEM_NS,
        Duration::from_secs(60),
        || {
            // On a fresh install the Lease does not exist yet: a replica creates a missing
            // leader Lease only after seeing it missing for the whole election duration.
            let name = format!("{RELEASE}-targetlease-controller");
            let out = w
                .cluster
                .kubectl(&["get", "lease", &name, "-n", SYSTEM_NS, "-o", "json"]);
            let lease: Value = serde_json::from_slice(&out.stdout).ok()?;
            lease["spec"]["holderIdentity"].as_str().map(str::to_owned)
        },
    );
    assert!(
        names.contains(&holder.as_str()),
        "{holder} is not one of {names:?}"
    );
    let mut leading = Vec::new();
    for pod in &pods {
        let ip = pod["status"]["podIP"].as_str().expect("pod ip");
        let (code, page) = w.until("metrics", SYSTEM_NS, Duration::from_secs(30), || {
            http_get(&format!("{ip}:8080"), "/metrics")
        });
        assert_eq!(code, 200);
        leading.push(metric(&page, "targetlease_leading"));
    }
    leading.sort_by(f64::total_cmp);
    assert_eq!(leading, vec![0.0, 1.0], "exactly one replica leads");
}

/// A TargetLease applied by a user is Held through the controller in the pod: the pod reached
/// the API server through the `kubernetes` Service and Valkey with the mounted password.
fn lease_held_through_the_pod_controller() {
    let w = &*world();
    w.cluster.apply(&format!(
        "apiVersion: targetlease.dev/v1beta1\nkind: TargetLease\nmetadata:\n  name: first\n  namespace: {APP_NS}\nspec:\n  target: node/first\n  holder: node-suite\n"
    ));
    let started = Instant::now();
    w.until(
        "TargetLease first Held",
        SYSTEM_NS,
        Duration::from_secs(60),
        || (w.phase("first").as_deref() == Some("Held")).then_some(()),
    );
    support::suite::measured("TargetLease Held", started.elapsed());
    let token = w.lease("first").expect("lease")["status"]["fencingToken"]
        .as_u64()
        .expect("token");
    let fence = w
        .valkey
        .raw(&["GET", &format!("tl:{{{APP_NS}/node/first}}:fence")]);
    assert!(
        fence.contains(&token.to_string()),
        "Valkey's fence {fence:?} is not {token}"
    );
}

/// The names of the pods `selector` selects in the examples' namespace.
fn pods_of(w: &World, selector: &str) -> Vec<String> {
    let pods = w.kubectl_json(&["get", "pods", "-n", APP_NS, "-l", selector]);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .collect()
}

/// The last token line (`PREFIX<token>`) in a container's log, if any (`None` for `none`).
fn last_token(w: &World, pod: &str, container: &str, prefix: &str) -> Option<u64> {
    let out = w
        .cluster
        .kubectl(&["logs", "-n", APP_NS, pod, "-c", container]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .next_back()
        .and_then(|t| t.trim().parse().ok())
}

/// examples/deployment-follow.yaml: two replicas share the target; each one's sidecar (the
/// controller image: `targetlease run` around `targetlease wait --follow`) keeps a token file,
/// which the application reads. Only the holder's application has a token; when its pod is
/// deleted, the other replica's application gets the new, larger token.
fn deployment_follows_its_lease() {
    let w = &*world();
    w.cluster.apply(&w.example("deployment-follow.yaml"));
    let selector = "app=reports-writer";
    let prefix = "reports-writer: token=";
    let (holder, token) = w.until(
        "a reports-writer application with a token",
        APP_NS,
        Duration::from_secs(120),
        || {
            let pods = pods_of(w, selector);
            (pods.len() == 2).then_some(())?;
            pods.iter()
                .find_map(|pod| Some((pod.clone(), last_token(w, pod, "writer", prefix)?)))
        },
    );
    let status_token = w.lease_of_pod(&holder).expect("lease")["status"]["fencingToken"]
        .as_u64()
        .expect("token");
    assert_eq!(
        token, status_token,
        "the application's token is not its status's"
    );
    let other = pods_of(w, selector)
        .into_iter()
        .find(|p| *p != holder)
        .expect("the other replica");
    assert_eq!(
        last_token(w, &other, "writer", prefix),
        None,
        "two replicas' applications had a token at once"
    );
    let started = Instant::now();
    w.cluster
        .kubectl_ok(&["delete", "pod", &holder, "-n", APP_NS, "--wait=false"]);
    let next = w.until(
        "the other replica's application with a new token",
        APP_NS,
        Duration::from_secs(60),
        || last_token(w, &other, "writer", prefix).filter(|t| *t > token),
    );
    support::suite::measured(
        "follow: holder pod deleted -> the other replica's application has the new token",
        started.elapsed(),
    );
    assert!(next > token);
    w.cluster.kubectl_ok(&[
        "delete",
        "-n",
        APP_NS,
        "-f",
        &repo()
            .join("examples/deployment-follow.yaml")
            .display()
            .to_string(),
        "--wait=false",
    ]);
}

/// The host pid of the first process of `pod`'s container, when it is the `targetlease run`
/// of that pod (its environment names the pod).
fn container_run_pid(pod: &str) -> Option<i32> {
    let want = format!("POD_NAME={pod}");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            if comm.trim() != "targetlease" {
                return None;
            }
            let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let named = environ.split(|b| *b == 0).any(|v| v == want.as_bytes());
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let first = status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|ids| ids.split_whitespace().next_back())
                == Some("1");
            (named && first).then_some(pid)
        })
}

/// Follows the timestamped log of `pod`'s scheduler container (every container of it, across
/// restarts) into a file of `dir`, until the returned flag is set.
fn follow_scheduler_logs(
    w: &World,
    pod: &str,
    dir: &std::path::Path,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (pod, file, stopping) = (pod.to_owned(), dir.join(format!("{pod}.log")), stop.clone());
    let envs = w.cluster.envs();
    let handle = std::thread::spawn(move || {
        let mut seen = 0usize;
        while !stopping.load(std::sync::atomic::Ordering::Relaxed) {
            // The whole log of the current container, then of any earlier one: every tick
            // line is kept once (by its timestamp), whatever restarts happen.
            for previous in [false, true] {
                let mut args = vec![
                    "logs",
                    "-n",
                    APP_NS,
                    &pod,
                    "-c",
                    "scheduler",
                    "--timestamps",
                ];
                if previous {
                    args.push("--previous");
                }
                let out = std::process::Command::new("kubectl")
                    .args(&args)
                    .envs(envs.iter().cloned())
                    .output();
                if let Ok(out) = out
                    && out.status.success()
                {
                    let text = String::from_utf8_lossy(&out.stdout).into_owned();
                    let mut known = std::fs::read_to_string(&file).unwrap_or_default();
                    let mut lines: std::collections::BTreeSet<String> =
                        known.lines().map(str::to_owned).collect();
                    lines.extend(text.lines().map(str::to_owned));
                    if lines.len() != seen {
                        seen = lines.len();
                        known = lines.into_iter().collect::<Vec<_>>().join("\n");
                        let _ = std::fs::write(&file, known);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    (stop, handle)
}

/// Each container run's ticks in a followed log: `(first, last, token)`, split where a `start`
/// line begins a new run.
fn runs_in(file: &std::path::Path) -> Vec<(jiff::Timestamp, jiff::Timestamp, u64)> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let mut runs: Vec<(jiff::Timestamp, jiff::Timestamp, u64)> = Vec::new();
    for line in text.lines() {
        let Some((stamp, message)) = line.split_once(' ') else {
            continue;
        };
        let Ok(at) = stamp.parse::<jiff::Timestamp>() else {
            continue;
        };
        if let Some(token) = message.strip_prefix("scheduler: start token=") {
            runs.push((at, at, token.trim().parse().unwrap_or(0)));
        } else if message == "tick"
            && let Some(run) = runs.last_mut()
        {
            run.1 = run.1.max(at);
        }
    }
    runs
}

/// How often `pod`'s containers restarted.
fn restarts(w: &World, pod: &str) -> u64 {
    let pod = w.kubectl_json(&["get", "pod", pod, "-n", APP_NS]);
    pod["status"]["containerStatuses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["restartCount"].as_u64())
        .sum()
}

/// examples/deployment-standby.yaml: two replicas, each application under `targetlease run`
/// (copied in by an init container). The holder pod deleted, then the new holder's node-local
/// `run` killed with SIGKILL: the applications never work at once (their ticks, timestamped by
/// the container runtime), a standby's application starts with a larger token, and a restarted
/// container's (its `run` adopting the pod's lease) with its own.
fn standby_replicas_never_work_at_once() {
    let w = &*world();
    w.cluster.apply(&w.example("deployment-standby.yaml"));
    let selector = "app=payouts-scheduler";
    let prefix = "scheduler: start token=";
    let logs = tempfile::tempdir().expect("dir");
    let mut followers = Vec::new();
    let mut followed = std::collections::BTreeSet::new();
    let mut follow = |w: &World, followers: &mut Vec<_>| {
        for pod in pods_of(w, selector) {
            if followed.insert(pod.clone()) {
                followers.push(follow_scheduler_logs(w, &pod, logs.path()));
            }
        }
    };
    let (first, token) = w.until(
        "a payouts-scheduler application started",
        APP_NS,
        Duration::from_secs(120),
        || {
            let pods = pods_of(w, selector);
            (pods.len() == 2).then_some(())?;
            pods.iter()
                .find_map(|pod| Some((pod.clone(), last_token(w, pod, "scheduler", prefix)?)))
        },
    );
    follow(w, &mut followers);
    let second = pods_of(w, selector)
        .into_iter()
        .find(|p| *p != first)
        .expect("the other replica");
    std::thread::sleep(Duration::from_secs(2));
    // The holder pod deleted (with its grace): its `run` stops the application and confirms.
    let started = Instant::now();
    w.cluster
        .kubectl_ok(&["delete", "pod", &first, "-n", APP_NS, "--wait=false"]);
    let next = w.until(
        "the standby's application started",
        APP_NS,
        Duration::from_secs(60),
        || last_token(w, &second, "scheduler", prefix).filter(|t| *t > token),
    );
    support::suite::measured(
        "standby: holder pod deleted -> standby's application started",
        started.elapsed(),
    );
    follow(w, &mut followers);
    std::thread::sleep(Duration::from_secs(2));
    // The new holder's `run`, its container's first process, killed with SIGKILL on the node.
    let pid = w.until(
        "the holder's run on the node",
        APP_NS,
        Duration::from_secs(10),
        || container_run_pid(&second),
    );
    let started = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL");
    // Its container dies with it and restarts: the new `run` adopts the pod's own TargetLease
    // (the killed one is provably gone, and its application with it) and starts the application
    // again under the same token; or a standby takes over with a larger one.
    let third = w.until(
        "an application started after the holder's run was killed",
        APP_NS,
        Duration::from_secs(90),
        || {
            follow(w, &mut followers);
            pods_of(w, selector).into_iter().find_map(|pod| {
                let t = last_token(w, &pod, "scheduler", prefix)?;
                (t > next || (pod == second && restarts(w, &pod) > 0)).then_some(t)
            })
        },
    );
    support::suite::measured(
        "standby: holder's run SIGKILLed -> an application started again",
        started.elapsed(),
    );
    assert!(third >= next, "tokens went down: {third} after {next}");
    // The third run may be seen (a restarted container) before its start line reached the
    // followed logs: wait for it there, then let the followers read a little more.
    w.until(
        "the third application run in the followed logs",
        APP_NS,
        Duration::from_secs(60),
        || {
            follow(w, &mut followers);
            let runs: usize = std::fs::read_dir(logs.path())
                .ok()?
                .flatten()
                .map(|entry| runs_in(&entry.path()).len())
                .sum();
            (runs >= 3).then_some(())
        },
    );
    std::thread::sleep(Duration::from_secs(3));
    for (stop, _) in &followers {
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    for (_, handle) in followers {
        let _ = handle.join();
    }
    let mut all: Vec<(jiff::Timestamp, jiff::Timestamp, u64, String)> = Vec::new();
    for entry in std::fs::read_dir(logs.path()).expect("logs").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        for (from, to, token) in runs_in(&entry.path()) {
            all.push((from, to, token, name.clone()));
        }
    }
    all.sort();
    assert!(
        all.len() >= 3,
        "fewer application runs than hand-overs: {all:?}"
    );
    for pair in all.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            b.0 > a.1,
            "two applications worked at once: {} (token {}) until {}, {} (token {}) from {}",
            a.3,
            a.2,
            a.1,
            b.3,
            b.2,
            b.0
        );
        // A token passes to another pod only larger; a pod whose container restarted keeps its
        // own tenure's token.
        assert!(
            b.2 > a.2 || (b.2 == a.2 && b.3 == a.3),
            "a token went down or passed to another pod: {all:?}"
        );
    }
    w.cluster.kubectl_ok(&[
        "delete",
        "-n",
        APP_NS,
        "-f",
        &repo()
            .join("examples/deployment-standby.yaml")
            .display()
            .to_string(),
        "--wait=false",
    ]);
}

/// Runs the Job example under `name`, with the application image of the suite.
fn apply_job(w: &World, name: &str) {
    let yaml =
        w.example("job-run.yaml")
            .replacen("name: orders-migration", &format!("name: {name}"), 1);
    w.cluster.apply(&yaml);
}

fn job_complete(w: &World, name: &str) -> Option<()> {
    let job = w.kubectl_json(&["get", "job", name, "-n", APP_NS]);
    job["status"]["conditions"]
        .as_array()?
        .iter()
        .any(|c| c["type"] == "Complete" && c["status"] == "True")
        .then_some(())
}

/// The pod of Job `job`, once there is one.
fn job_pod_opt(w: &World, job: &str) -> Option<String> {
    let pods = w.kubectl_json(&[
        "get",
        "pods",
        "-n",
        APP_NS,
        "-l",
        &format!("job-name={job}"),
    ]);
    pods["items"].get(0)?["metadata"]["name"]
        .as_str()
        .map(str::to_owned)
}

/// Waits until the TargetLease of Job `job`'s pod is in `phase`; returns the pod's name.
fn await_job_lease(w: &World, job: &str, phase: &str) -> String {
    w.until(
        &format!("{job}'s TargetLease {phase}"),
        APP_NS,
        Duration::from_secs(60),
        || {
            let pod = job_pod_opt(w, job)?;
            (w.phase_of_pod(&pod).as_deref() == Some(phase)).then_some(pod)
        },
    )
}

fn job_pod(w: &World, job: &str) -> String {
    job_pod_opt(w, job).unwrap_or_else(|| panic!("no pod of Job {job}"))
}

/// examples/job-run.yaml: the Job runs its command under `targetlease run` (its TargetLease,
/// whose holderRef names the pod, is Held while it runs), completes, and its TargetLease is gone.
fn job_runs_under_its_lease() {
    let w = &*world();
    apply_job(w, "migration-a");
    let running = await_job_lease(w, "migration-a", "Held");
    w.until(
        "Job migration-a complete",
        APP_NS,
        Duration::from_secs(120),
        || job_complete(w, "migration-a"),
    );
    let pod = job_pod(w, "migration-a");
    assert_eq!(pod, running);
    let log = w.logs(&[&pod]);
    assert!(log.contains("migrate: start token="), "{log}");
    assert!(log.contains("migrate: done token="), "{log}");
    assert!(
        log.contains("args=--fencing-token-from-env=TARGETLEASE_TOKEN"),
        "{log}"
    );
    w.until(
        "the Job's TargetLease deleted",
        APP_NS,
        Duration::from_secs(30),
        || w.lease_of_pod(&pod).is_none().then_some(()),
    );
}

fn token_in(log: &str, prefix: &str) -> u64 {
    log.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no `{prefix}N` in:\n{log}"))
}

/// Two Jobs on one target: the second waits while the first's container runs, and gets the
/// target (with a larger token) once that container has exited.
fn holder_container_exit_hands_over() {
    let w = &*world();
    apply_job(w, "migration-b");
    await_job_lease(w, "migration-b", "Held");
    apply_job(w, "migration-c");
    let pod_c = await_job_lease(w, "migration-c", "Waiting");
    for job in ["migration-b", "migration-c"] {
        w.until(
            &format!("Job {job} complete"),
            APP_NS,
            Duration::from_secs(120),
            || job_complete(w, job),
        );
    }
    let log_b = w.logs(&[&job_pod(w, "migration-b")]);
    let log_c = w.logs(&[&pod_c]);
    let (b, c) = (
        token_in(&log_b, "migrate: done token="),
        token_in(&log_c, "migrate: start token="),
    );
    assert!(
        c > b,
        "the second holder's token {c} is not above the first's {b}"
    );
}

/// A holder pod deleted with its grace period: `targetlease run` passes the SIGTERM on, its
/// command exits, the lease is released, and a waiting pod gets the target.
fn deleted_holder_pod_hands_over() {
    let w = &*world();
    let job = |name: &str| {
        format!(
            "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: {name}\n  namespace: {APP_NS}\nspec:\n  backoffLimit: 0\n  template:\n    spec:\n      serviceAccountName: lease-user\n      restartPolicy: Never\n      terminationGracePeriodSeconds: 20\n      securityContext:\n        runAsNonRoot: true\n        runAsUser: 10001\n        seccompProfile:\n          type: RuntimeDefault\n      containers:\n        - name: hold\n          image: {APP_IMAGE}\n          command: [targetlease, run, --target=node/handover, --ttl=30s, --, sleep, \"3600\"]\n          env:\n            - name: POD_NAME\n              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}\n            - name: POD_NAMESPACE\n              valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}\n            - name: POD_UID\n              valueFrom: {{fieldRef: {{fieldPath: metadata.uid}}}}\n          securityContext:\n            allowPrivilegeEscalation: false\n            readOnlyRootFilesystem: true\n            capabilities: {{drop: [ALL]}}\n"
        )
    };
    w.cluster.apply(&job("holder-d"));
    let pod_d = await_job_lease(w, "holder-d", "Held");
    w.cluster.apply(&job("holder-e"));
    let pod_e = await_job_lease(w, "holder-e", "Waiting");
    let token_d = w.lease_of_pod(&pod_d).expect("lease")["status"]["fencingToken"]
        .as_u64()
        .expect("token");
    let started = Instant::now();
    w.cluster
        .kubectl_ok(&["delete", "pod", &pod_d, "-n", APP_NS, "--wait=false"]);
    w.until(
        "holder-e Held after holder-d's pod was deleted",
        APP_NS,
        Duration::from_secs(30),
        || (w.phase_of_pod(&pod_e).as_deref() == Some("Held")).then_some(()),
    );
    let took = started.elapsed();
    support::suite::measured("hand-over after a holder pod was deleted", took);
    // Within seconds, through `run` passing the SIGTERM on and releasing: the grace period
    // (20 s), the heartbeat (half the 30 s TTL) and the garbage collection all take longer.
    assert!(took < Duration::from_secs(5), "hand-over took {took:?}");
    let token_e = w.lease_of_pod(&pod_e).expect("lease")["status"]["fencingToken"]
        .as_u64()
        .expect("token");
    assert!(token_e > token_d, "{token_e} is not above {token_d}");
}

/// examples/job-permits.yaml: four pods in parallel on a target with two permits. Never more
/// than two of their TargetLeases show Held (watched all along), the two running at once have
/// slots 0 and 1, every pod runs once a permit is free, and the Job completes.
fn permits_cap_a_parallel_job() {
    let w = &*world();
    w.cluster.apply(&w.example("job-permits.yaml"));
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut most = 0;
    loop {
        let leases = w.kubectl_json(&["get", "targetleases", "-n", APP_NS]);
        let held: Vec<(String, u64)> = leases["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter(|l| {
                        l["spec"]["target"] == "reports-db/nightly"
                            && l["metadata"]["deletionTimestamp"].is_null()
                            && l["status"]["phase"] == "Held"
                    })
                    .map(|l| {
                        let name = l["metadata"]["name"].as_str().unwrap_or("?").to_owned();
                        (name, l["status"]["slot"].as_u64().unwrap_or(u64::MAX))
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert!(held.len() <= 2, "more than two permits held: {held:?}");
        let slots: std::collections::BTreeSet<u64> = held.iter().map(|(_, s)| *s).collect();
        assert_eq!(
            slots.len(),
            held.len(),
            "two holders share a slot: {held:?}"
        );
        assert!(
            slots.iter().all(|s| *s < 2),
            "a slot beyond the permits: {held:?}"
        );
        most = most.max(held.len());
        if job_complete(w, "nightly-reports").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Job nightly-reports did not complete"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(most, 2, "never two pods at work at once");
    let log = w.logs(&["-l", "job-name=nightly-reports", "--tail=-1"]);
    let starts = log
        .lines()
        .filter(|l| l.starts_with("report: start slot="))
        .count();
    assert_eq!(starts, 4, "{log}");
    assert!(
        log.lines()
            .filter(|l| l.starts_with("report: start"))
            .all(|l| l.starts_with("report: start slot=0 ")
                || l.starts_with("report: start slot=1 ")),
        "{log}"
    );
}

/// The chart against Valkey behind Sentinel (one primary, two replicas, three sentinels on the
/// node's address, with a password): `helm upgrade` to `valkey.sentinel.*`, then a TargetLease
/// is Held through the primary the sentinels name, keeps its token through `SENTINEL FAILOVER`
/// (and stays in the new primary), and a new one is granted there above it. Runs after the
/// others that use the release: it stays on Sentinel afterwards.
fn chart_follows_a_sentinel_failover() {
    let w = &*world();
    let topology = Topology::start(SentinelOptions {
        host: Some(w.cluster.node_ip()),
        password: Some(PASSWORD.into()),
        ..SentinelOptions::plain(ServerKind::Valkey91)
    });
    let addresses = topology.sentinel_addrs().join(",");
    let chart = repo().join("charts/targetlease").display().to_string();
    let upgrade = w.cluster.helm(&[
        "upgrade",
        RELEASE,
        &chart,
        "-n",
        SYSTEM_NS,
        "--reuse-values",
        "--set",
        &format!("valkey.sentinel.addresses={{{addresses}}}"),
        "--set",
        &format!("valkey.sentinel.masterName={SENTINEL_MASTER}"),
    ]);
    assert!(
        upgrade.status.success(),
        "helm upgrade to Sentinel failed: {}",
        String::from_utf8_lossy(&upgrade.stderr)
    );
    let started = Instant::now();
    w.until(
        "two Ready controller pods on Sentinel",
        SYSTEM_NS,
        Duration::from_secs(180),
        || {
            let pods = w.controller_pods();
            let on_sentinel = |pod: &Value| {
                pod["spec"]["containers"][0]["env"]
                    .as_array()
                    .is_some_and(|env| {
                        env.iter()
                            .any(|e| e["name"] == "TARGETLEASE_VALKEY_SENTINELS")
                    })
            };
            (pods.len() == 2 && pods.iter().all(|p| ready(p) && on_sentinel(p))).then_some(())
        },
    );
    support::suite::measured(
        "controller pods Ready on Sentinel after helm upgrade",
        started.elapsed(),
    );
    let apply = |name: &str| {
        w.cluster.apply(&format!(
            "apiVersion: targetlease.dev/v1beta1\nkind: TargetLease\nmetadata:\n  name: {name}\n  namespace: {APP_NS}\nspec:\n  target: node/{name}\n  holder: node-suite\n  ttlSeconds: 30\n"
        ));
        w.until(
            &format!("TargetLease {name} Held"),
            SYSTEM_NS,
            Duration::from_secs(60),
            || (w.phase(name).as_deref() == Some("Held")).then_some(()),
        );
        w.lease(name).expect("lease")["status"]["fencingToken"]
            .as_u64()
            .expect("token")
    };
    let fence = |port: u16, name: &str| {
        let reply = topology
            .query(
                port,
                &["GET", &format!("tl:{{{APP_NS}/node/{name}}}:fence")],
            )
            .unwrap_or_else(|e| panic!("GET the fence of {name} on {port}: {e}"));
        support::sentinel::text(&reply)
    };
    let first = apply("sentinel-first");
    let old = topology.primary_port().expect("a primary");
    assert!(
        fence(old, "sentinel-first").contains(&first.to_string()),
        "the grant is not on the primary {old}"
    );
    topology.failover();
    let new = topology.wait_for_new_primary(old, Duration::from_secs(30));
    // Past a renewal (TTL/3) on the new primary.
    for _ in 0..12 {
        std::thread::sleep(Duration::from_secs(1));
        let lease = w.lease("sentinel-first").expect("lease");
        assert_eq!(lease["status"]["phase"], "Held", "{}", lease["status"]);
        assert_eq!(
            lease["status"]["fencingToken"].as_u64(),
            Some(first),
            "{}",
            lease["status"]
        );
    }
    let pttl = topology
        .query(
            new,
            &[
                "PTTL",
                &format!("tl:{{{APP_NS}/node/sentinel-first}}:lease"),
            ],
        )
        .map(|r| support::sentinel::text(&r))
        .unwrap_or_default();
    assert!(
        pttl.parse::<i64>().is_ok_and(|ms| ms > 0),
        "the lease is not on the new primary {new}: PTTL {pttl}"
    );
    let second = apply("sentinel-second");
    assert!(
        second > first,
        "token {second} after the failover is not above {first}"
    );
    assert!(
        fence(new, "sentinel-second").contains(&second.to_string()),
        "the new grant is not on the new primary {new}"
    );
}

/// `helm test` as a user runs it: the chart's test pod (its own ServiceAccount, restricted Pod
/// Security, the controller image) runs `targetlease run` and passes; its command printed the
/// token of the TargetLease it ran under, which is Valkey's fence of the target, and the
/// TargetLease is gone afterwards. The Role the release installed for it is exactly the workload
/// Role of examples/rbac.yaml, and without `create` in it `helm test` fails.
fn helm_test_passes() {
    let w = &*world();
    let helm_ok = |args: &[&str]| {
        let out = w.cluster.helm(args);
        assert!(
            out.status.success(),
            "helm {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let name = format!("{RELEASE}-targetlease-helm-test");
    let hooks = support::chart::documents(&helm_ok(&["get", "hooks", RELEASE, "-n", SYSTEM_NS]));
    let role = support::chart::object(&hooks, "Role", &name);
    assert_eq!(role["rules"], support::chart::workload_rules());
    let binding = support::chart::object(&hooks, "RoleBinding", &name);
    assert_eq!(binding["roleRef"]["name"], name.as_str());
    assert_eq!(
        binding["subjects"],
        serde_json::json!([{"kind": "ServiceAccount", "name": name, "namespace": SYSTEM_NS}])
    );

    // The control: the same chart with a Role that lacks `create`.
    let chart = repo().join("charts/targetlease");
    let broken = w.cluster.scratch().join("chart-without-create");
    support::oci::sh(
        "cp",
        &[
            "-r",
            &chart.display().to_string(),
            &broken.display().to_string(),
        ],
    );
    let template = broken.join("templates/tests/helm-test.yaml");
    let text = std::fs::read_to_string(&template).expect("helm-test.yaml");
    let all = r#"verbs: ["create", "get", "list", "watch", "patch", "delete"]"#;
    assert_eq!(text.matches(all).count(), 1, "the test Role's verbs");
    let without = text.replace(all, r#"verbs: ["get", "list", "watch", "patch", "delete"]"#);
    std::fs::write(&template, without).expect("write");
    let upgrade = |chart: &std::path::Path| {
        let chart = chart.display().to_string();
        helm_ok(&[
            "upgrade",
            RELEASE,
            &chart,
            "-n",
            SYSTEM_NS,
            "--reuse-values",
        ]);
    };
    upgrade(&broken);
    let refused = w
        .cluster
        .helm(&["test", RELEASE, "-n", SYSTEM_NS, "--timeout", "3m"]);
    assert!(
        !refused.status.success(),
        "helm test passed with a Role that cannot create TargetLeases: {}",
        String::from_utf8_lossy(&refused.stdout)
    );
    // Failed for the missing right (the failed pod is kept; the next helm test replaces it).
    let log = w.cluster.kubectl_ok(&["logs", &name, "-n", SYSTEM_NS]);
    assert!(
        log.contains("forbidden") || log.contains("Forbidden"),
        "the test pod failed, not for want of create:\n{log}"
    );

    upgrade(&chart);
    let started = Instant::now();
    let out = helm_ok(&[
        "test",
        RELEASE,
        "-n",
        SYSTEM_NS,
        "--timeout",
        "3m",
        "--logs",
    ]);
    support::suite::measured("helm test", started.elapsed());
    assert!(out.contains("Succeeded"), "{out}");
    // The command's output: the token alone on a line (targetlease wait).
    let tokens: Vec<u64> = out.lines().filter_map(|l| l.trim().parse().ok()).collect();
    assert_eq!(tokens.len(), 1, "one token in the test's log:\n{out}");
    // No refused call on the way: a missing verb only warns (heartbeat, delete).
    for refusal in ["Forbidden", "could not"] {
        assert!(
            !out.contains(refusal),
            "{refusal} in the test's log:\n{out}"
        );
    }
    let fence = w.valkey.raw(&[
        "GET",
        &format!("tl:{{{SYSTEM_NS}/helm-test-{RELEASE}}}:fence"),
    ]);
    assert!(
        fence.contains(&tokens[0].to_string()),
        "Valkey's fence {fence:?} is not the test's token {}",
        tokens[0]
    );
    w.until(
        "the helm test's TargetLease gone",
        SYSTEM_NS,
        Duration::from_secs(30),
        || {
            let leases = w.kubectl_json(&["get", "targetleases", "-n", SYSTEM_NS]);
            let items = leases["items"].as_array().cloned().unwrap_or_default();
            (!items
                .iter()
                .any(|l| l["spec"]["target"] == format!("helm-test-{RELEASE}")))
            .then_some(())
        },
    );
    // Nothing of the test is left behind once it passed (hook-succeeded).
    for kind in ["pod", "serviceaccount", "role", "rolebinding"] {
        let out = w.cluster.kubectl(&["get", kind, &name, "-n", SYSTEM_NS]);
        assert!(!out.status.success(), "{kind} {name} left after the test");
    }
}

/// docs/quickstart/README.md as a reader runs it, on this node, from the release kit: block 1's
/// `scripts/release.sh` built the kit (once, for the release suite too); the kit's image is
/// imported with containerd, as the `kind` and `k3s` commands of block 2 do (the page names
/// theirs; this node's is its own); then every other `sh` block of the page runs verbatim in one
/// shell from the repository root: the checksums, the chart from the kit's package with the
/// in-memory store, a TargetLease Held, the move to Valkey through a Secret, a second one Held,
/// `helm test`. The suite's own release gives way first, as the page's readers would make room:
/// uninstalled (its CRD stays, adopted by the page's `--take-ownership`), its namespace deleted,
/// its claim on the key prefix removed (docs/operations.md, "One key prefix per installation").
fn quickstart_page_reaches_held_from_the_kit() {
    let w = world();
    let kit = super::release::kit();
    // Nothing in the release namespace may wait for a finalizer once its controller is gone.
    let _ = w.cluster.kubectl(&[
        "delete",
        "targetleases",
        "--all",
        "-n",
        SYSTEM_NS,
        "--timeout=60s",
    ]);
    let out = w
        .cluster
        .helm(&["uninstall", RELEASE, "-n", SYSTEM_NS, "--wait"]);
    assert!(
        out.status.success(),
        "helm uninstall: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    w.cluster
        .kubectl_ok(&["delete", "namespace", SYSTEM_NS, "--timeout=180s"]);
    let gone = w.valkey.raw(&["DEL", "tl:installation"]);
    assert!(
        gone.starts_with(":1"),
        "the suite's release claimed no prefix: {gone}"
    );
    let version = env!("CARGO_PKG_VERSION");
    w.cluster
        .import_image(&kit.path(&format!("targetlease-{version}.oci.tar")));
    let page = std::fs::read_to_string(repo().join("docs/quickstart/README.md")).expect("page");
    let blocks: Vec<&str> = page
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .collect();
    assert!(
        blocks.len() >= 5 && blocks[0].contains("scripts/release.sh"),
        "the page's first block builds the kit, then come the others: {blocks:?}"
    );
    let script = format!("set -euo pipefail\n{}", blocks[1..].join("\n"));
    let url = format!(
        "redis://:{PASSWORD}@{}:{}",
        w.cluster.node_ip(),
        w.valkey.port
    );
    let out = std::process::Command::new("timeout")
        .args(["900", "bash", "-c", &script])
        .current_dir(repo())
        .envs(w.cluster.envs())
        .env("KIT", kit.path(""))
        .env("VALKEY_URL", url)
        .output()
        .expect("run the page's commands");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // What the reader would look at next: the claims and the controller's log.
        let look = |args: &[&str]| {
            let out = w.cluster.kubectl(args);
            format!(
                "$ kubectl {}\n{}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        };
        let seen = [
            look(&["describe", "targetleases", "-n", "quickstart"]),
            look(&["get", "pods", "-n", SYSTEM_NS, "-o", "wide"]),
            look(&[
                "logs",
                "-n",
                SYSTEM_NS,
                "-l",
                "app.kubernetes.io/instance=targetlease",
                "--tail=40",
                "--prefix",
            ]),
        ];
        panic!(
            "the quick start's commands failed ({}):\n{stdout}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            seen.join("\n")
        );
    }
    for name in ["first", "second"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("{name} ")) && l.contains(" Held ")),
            "{name} not shown Held:\n{stdout}"
        );
    }
}

/// The suite's trials, in order.
pub fn suite(args: &Arguments) -> Conclusion {
    let mut args = args.clone();
    // One cluster, one node: the tests build on each other, in this order.
    args.test_threads = Some(1);
    let test = support::suite::blocking_trial;
    let trials = vec![
        test("chart_pods_run_and_are_ready", chart_pods_run_and_are_ready),
        test(
            "one_leader_and_metrics_served",
            one_leader_and_metrics_served,
        ),
        test(
            "lease_held_through_the_pod_controller",
            lease_held_through_the_pod_controller,
        ),
        test("deployment_follows_its_lease", deployment_follows_its_lease),
        test(
            "standby_replicas_never_work_at_once",
            standby_replicas_never_work_at_once,
        ),
        test("job_runs_under_its_lease", job_runs_under_its_lease),
        test(
            "holder_container_exit_hands_over",
            holder_container_exit_hands_over,
        ),
        test(
            "deleted_holder_pod_hands_over",
            deleted_holder_pod_hands_over,
        ),
        test("permits_cap_a_parallel_job", permits_cap_a_parallel_job),
        test("helm_test_passes", helm_test_passes),
        test(
            "chart_follows_a_sentinel_failover",
            chart_follows_a_sentinel_failover,
        ),
        // Last: the suite's release gives way to the page's.
        test(
            "quickstart_page_reaches_held_from_the_kit",
            quickstart_page_reaches_held_from_the_kit,
        ),
    ];
    let conclusion = support::suite::run(&args, trials);
    // Valkey stops and the node is torn down before the closing line.
    drop(WORLD.lock().unwrap_or_else(|e| e.into_inner()).take());
    conclusion
}
