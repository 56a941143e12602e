//! Upgrades as users run them, on a real node (`e2e/cluster up --node`): the previous release's
//! chart and image (built by this suite from the commit `e2e/previous-release.env` names, cached
//! under the cache folder, never stored in git) are installed with `helm install`; 50
//! TargetLeases are Held, and `targetlease run` and `targetlease wait` workloads of the previous
//! release run against them. Then, in turn: `helm upgrade` to this chart and image, `helm
//! rollback` to the previous release, `helm upgrade` again, a rolling restart of the
//! controller, and the API version move (`crds.storageVersion=v1beta1` and `targetlease
//! migrate-storage`), after which a rollback to the previous release is refused.
//!
//! Throughout, a sampler reads every TargetLease (as `v1alpha1`, the version every phase serves)
//! about three times a second and checks the guarantees across each seam: no declared lease stops
//! being Held or changes its token, no token on a target is ever lower than one seen before on
//! it, never two Held on one target. The `run` workload's commands print `start` and `end`
//! lines, timestamped by the container runtime: no two overlap, and their tokens grow. The
//! `wait` workload keeps getting its lease's token.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use serde_json::Value;

use support::kube::{Cluster, repo};
use support::oci::{build_controller_image, sh};
use support::server::{Server, ServerKind};
use targetlease::store::TargetRef;
use targetlease::store::valkey::keys::TargetKeys;

const SYSTEM_NS: &str = "targetlease-system";
const APP_NS: &str = "shop";
const RELEASE: &str = "tl";
const PASSWORD: &str = "upgrade-suite-secret";
/// Declared TargetLeases held through every phase.
const LEASES: usize = 50;
/// The workloads' image: busybox and the previous release's targetlease.
const APP_IMAGE: &str = "localhost/targetlease-upgrade-app:previous";
/// The target the `run` workload's two replicas take turns on.
const RUN_TARGET: &str = "upgrade/run";
const SEC: Duration = Duration::from_secs(1);

/// The suite's one trial.
pub fn suite(args: &Arguments) -> Conclusion {
    support::suite::run(
        args,
        vec![support::suite::blocking_trial(
            "upgrade_and_rollback_keep_leases_held",
            upgrade_and_rollback_keep_leases_held,
        )],
    )
}

/// The previous release, built from its commit.
struct Previous {
    version: String,
    commit: String,
    /// Its controller image (OCI tarball).
    image: PathBuf,
    /// Its `targetlease` binary.
    binary: PathBuf,
    /// Its chart.
    chart: PathBuf,
}

/// Builds the previous release once per commit: its sources from git, its binary in a target
/// folder seeded from this checkout's static build (same flags and dependencies: only what
/// changed compiles), its image by its own `scripts/image.sh`.
fn previous_release() -> Previous {
    let pins = std::fs::read_to_string(repo().join("e2e/previous-release.env"))
        .expect("read e2e/previous-release.env");
    let pin = |key: &str| {
        pins.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("e2e/previous-release.env has no {key}"))
            .trim()
            .to_owned()
    };
    let (version, commit) = (
        pin("PREVIOUS_RELEASE_VERSION"),
        pin("PREVIOUS_RELEASE_COMMIT"),
    );
    let cache_root = std::env::var("TARGETLEASE_CACHE_DIR").map_or_else(
        |_| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/targetlease"),
        PathBuf::from,
    );
    let cache = cache_root.join("previous-release").join(&commit);
    let previous = Previous {
        image: cache.join("image.oci.tar"),
        binary: cache.join("targetlease"),
        chart: cache.join("chart"),
        version,
        commit,
    };
    if cache.join("complete").exists() {
        return previous;
    }
    let started = Instant::now();
    let _ = std::fs::remove_dir_all(&cache);
    let src = cache.join("src");
    std::fs::create_dir_all(&src).expect("cache dir");
    let repo_dir = repo().display().to_string();
    let has_commit = std::process::Command::new("git")
        .args(["-C", &repo_dir, "cat-file", "-e"])
        .arg(format!("{}^{{commit}}", previous.commit))
        .status()
        .expect("run git");
    assert!(
        has_commit.success(),
        "the previous release's commit {} is not in this clone: the upgrade suite needs the \
         history (a full clone, not a shallow one)",
        previous.commit
    );
    sh(
        "bash",
        &[
            "-c",
            &format!(
                "git -C '{repo_dir}' archive --format=tar {} | tar -x -C '{}'",
                previous.commit,
                src.display()
            ),
        ],
    );
    // Seed the build with this checkout's compiled dependencies.
    let here = std::env::var("CARGO_TARGET_DIR").expect("scripts/env.sh sets CARGO_TARGET_DIR");
    let target = cache.join("target");
    for sub in ["release", "x86_64-unknown-linux-gnu/release"] {
        let from = Path::new(&here).join(sub);
        if from.exists() {
            let to = target.join(sub);
            std::fs::create_dir_all(&to).expect("target dir");
            for part in ["deps", "build", ".fingerprint"] {
                if from.join(part).exists() {
                    sh(
                        "cp",
                        &[
                            "-a",
                            &from.join(part).display().to_string(),
                            &to.display().to_string(),
                        ],
                    );
                }
            }
        }
    }
    // The binary is built with this checkout's static flags (scripts/env.sh): the previous
    // release's own flags embedded its checkout's path, and every dependency would compile
    // again. Its own scripts/image.sh then packages it, with `cargo` stubbed out: the binary
    // is already where the script's build would leave it.
    let build = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source '{}/scripts/env.sh' && cd '{}' && static_cargo build --locked --release --bin targetlease",
            repo().display(),
            src.display()
        ))
        .env("CARGO_TARGET_DIR", &target)
        .stdout(std::process::Stdio::inherit())
        .stderr(std::process::Stdio::inherit())
        .status()
        .expect("build the previous release");
    assert!(build.success(), "the previous release did not build");
    let stub = cache.join("stub");
    std::fs::create_dir_all(&stub).expect("stub dir");
    std::fs::write(stub.join("cargo"), "#!/bin/sh\nexit 0\n").expect("stub cargo");
    std::fs::set_permissions(
        stub.join("cargo"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let path = format!(
        "{}:{}",
        stub.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("bash")
        .arg(src.join("scripts/image.sh"))
        .env("CARGO_TARGET_DIR", &target)
        .env("PATH", path)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run the previous release's scripts/image.sh");
    assert!(
        out.status.success(),
        "the previous release's image did not build"
    );
    let tarball = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    std::fs::rename(&tarball, &previous.image).expect("keep the image");
    std::fs::rename(
        target.join("x86_64-unknown-linux-gnu/release/targetlease"),
        &previous.binary,
    )
    .expect("keep the binary");
    std::fs::rename(src.join("charts/targetlease"), &previous.chart).expect("keep the chart");
    for scratch in [&target, &src, &stub] {
        let _ = std::fs::remove_dir_all(scratch);
    }
    std::fs::write(cache.join("complete"), "").expect("mark the cache complete");
    support::suite::measured("previous release built", started.elapsed());
    previous
}

/// The longest the sampler may go without a successful read: a read that fails through a whole
/// upgrade would otherwise check nothing.
const MAX_READ_GAP: Duration = Duration::from_secs(10);
/// How long a TargetLease may stay in deletion, Held or not: a finalizer that stays fails the
/// suite. Longer than a leader hand-over (the previous release keeps a deleted claim's Held
/// status until its finalizer goes, and a deletion during a rollout waits for the next leader).
const DELETING_AT_MOST: Duration = Duration::from_secs(60);
/// The longest the `run` workload may go without starting a command while this release's controller
/// runs (docs/internals/controller.md, with the chart's 10 s election): the command (2 s) and the
/// loop's pause (1 s), a rollout's leader change (the old leader gives the Lease up within 7.5 s of
/// SIGTERM, the next takes it within a renewal period, 2.5 s), the new leader's first list, and
/// the hand-over: the workload runs the previous release's `targetlease run`, which never
/// confirms that its command stopped, so this release passes its target on at the stop bound,
/// half the TTL (15 s) after the last heartbeat it saw (CHANGELOG.md, docs/upgrading): about
/// 29 s, doubled. A hand-over that waited for the store's TTL after that bound fails it. Seen
/// (with the previous release's hand-over, at once): at most 7.2 s outside the rollback phase.
const RUN_STALL_AT_MOST: Duration = Duration::from_secs(60);
/// A phase this short may pass without a `run` command starting under this release's controller:
/// one cycle of the workload (the command, 2 s, the loop's pause, 1 s, a rollout's leader change,
/// 10 s, and the hand-over at the stop bound, 15 s). Longer phases must each see a start; every
/// gap is bounded above. Seen: a rolling restart of 20.7 s without a start.
const RUN_CYCLE_AT_MOST: Duration = Duration::from_secs(30);
/// The same while the previous release's controller runs (the rollback phase), whose timings
/// this release does not document: a TTL and a take-over (12.5 s). Seen: 13.5 to 15.2 s.
const RUN_STALL_AT_MOST_PREVIOUS: Duration = Duration::from_secs(45);
/// The phase in which the previous release's controller runs.
const ROLLBACK_PHASE: &str = "helm rollback to the previous release";
/// A TargetLease in deletion longer than this gets its controller log lines printed.
const EXPLAIN_DELETING: Duration = Duration::from_secs(20);

/// What the sampler saw that breaks a guarantee, and what it saw at all.
#[derive(Default)]
struct Seen {
    violations: Vec<String>,
    /// Declared lease -> its token.
    declared: HashMap<String, u64>,
    /// Target -> the largest token seen on it.
    max_token: HashMap<String, u64>,
    samples: usize,
    /// Failed reads (the API server restarting a watch cache, ...): bounded by MAX_READ_GAP.
    failed_reads: usize,
    last_read: Option<Instant>,
    /// TargetLease being deleted (by uid: a `run` claim's name comes back with each command)
    /// -> when it was first seen so.
    deleting_since: HashMap<String, Instant>,
    /// The longest a TargetLease being deleted was seen Held: how long, which, in which phase.
    longest_held_while_deleting: Option<(Duration, String, String)>,
    /// TargetLeases whose controller log lines the suite prints: those of a violation, and those
    /// in deletion longer than [`EXPLAIN_DELETING`].
    suspects: std::collections::BTreeSet<String>,
    /// Phase -> when it began (for the workloads' progress per phase).
    phases: Vec<(String, Timestamp)>,
}

impl Seen {
    fn check(&mut self, list: &Value, phase: &str) {
        let now = Instant::now();
        self.read_gap(now, phase);
        self.last_read = Some(now);
        self.samples += 1;
        let mut held_by_target: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut missing: Vec<&String> = self.declared.keys().collect();
        for item in list["items"].as_array().into_iter().flatten() {
            let name = item["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            missing.retain(|m| **m != name);
            let target = item["spec"]["target"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let status = &item["status"];
            let held = status["phase"] == "Held";
            let token = status["fencingToken"].as_u64();
            if let Some(want) = self.declared.get(&name)
                && (!held || token != Some(*want))
            {
                self.suspects.insert(name.clone());
                self.violations.push(format!(
                    "{phase}: declared lease {name} was Held with token {want}, now {} {:?}",
                    status["phase"], token
                ));
            }
            if !item["metadata"]["deletionTimestamp"].is_null() {
                let uid = item["metadata"]["uid"].as_str().unwrap_or_default();
                let since = *self.deleting_since.entry(uid.to_owned()).or_insert(now);
                let deleting_for = now.duration_since(since);
                if held
                    && self
                        .longest_held_while_deleting
                        .as_ref()
                        .is_none_or(|(longest, _, _)| deleting_for > *longest)
                {
                    self.longest_held_while_deleting =
                        Some((deleting_for, name.clone(), phase.to_owned()));
                }
                if deleting_for > EXPLAIN_DELETING {
                    self.suspects.insert(name.clone());
                }
                if deleting_for > DELETING_AT_MOST {
                    self.violations.push(format!(
                        "{phase}: {name} is still being deleted after {deleting_for:?} ({})",
                        status["phase"]
                    ));
                }
                if held {
                    // Released in the store already (or about to be): bounded above, and left
                    // out of the two-holder check.
                    continue;
                }
            }
            if held {
                held_by_target
                    .entry(target.clone())
                    .or_default()
                    .push(name.clone());
                if let Some(token) = token {
                    let max = self.max_token.entry(target.clone()).or_insert(token);
                    if token < *max {
                        self.suspects.insert(name.clone());
                        self.violations.push(format!(
                            "{phase}: {name} Held on {target} with token {token}, below {max} seen \
                             before on it"
                        ));
                    }
                    *max = (*max).max(token);
                }
            }
        }
        let missing: Vec<String> = missing.into_iter().cloned().collect();
        self.suspects.extend(missing.iter().cloned());
        if !missing.is_empty() {
            self.violations
                .push(format!("{phase}: declared leases gone: {missing:?}"));
        }
        for (target, names) in held_by_target {
            if names.len() > 1 {
                self.suspects.extend(names.iter().cloned());
                self.violations
                    .push(format!("{phase}: two Held on {target}: {names:?}"));
            }
        }
    }

    /// A violation when the last successful read is longer ago than [`MAX_READ_GAP`].
    fn read_gap(&mut self, now: Instant, phase: &str) {
        if let Some(last) = self.last_read
            && now.duration_since(last) > MAX_READ_GAP
        {
            self.violations.push(format!(
                "{phase}: no successful read of the TargetLeases for {:?}",
                now.duration_since(last)
            ));
        }
    }
}

/// Reads every TargetLease until stopped, checking each sample.
struct Sampler {
    seen: Arc<Mutex<Seen>>,
    phase: Arc<Mutex<String>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(cluster: &Cluster, declared: HashMap<String, u64>) -> Sampler {
        let seen = Arc::new(Mutex::new(Seen {
            declared,
            ..Seen::default()
        }));
        let phase = Arc::new(Mutex::new("installed".to_string()));
        let stop = Arc::new(AtomicBool::new(false));
        let (kubectl, env) = (cluster.bin().join("kubectl"), cluster.envs());
        let thread = {
            let (seen, phase, stop) = (seen.clone(), phase.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let out = std::process::Command::new(&kubectl)
                        .args(["get", "targetleases.v1alpha1.targetlease.dev", "-n", APP_NS])
                        .args(["-o", "json", "--request-timeout=5s"])
                        .envs(env.iter().map(|(k, v)| (k, v)))
                        .output();
                    let list = out
                        .ok()
                        .filter(|o| o.status.success())
                        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok());
                    let phase = phase.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                    match list {
                        Some(list) => seen.check(&list, &phase),
                        None => seen.failed_reads += 1,
                    }
                    drop(seen);
                    std::thread::sleep(Duration::from_millis(300));
                }
            })
        };
        Sampler {
            seen,
            phase,
            stop,
            thread: Some(thread),
        }
    }

    fn phase(&self, name: &str) {
        eprintln!("upgrade suite: phase {name}");
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = name.to_owned();
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .phases
            .push((name.to_owned(), Timestamp::now()));
    }

    /// Samples taken so far.
    fn samples(&self) -> usize {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).samples
    }

    fn finish(mut self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("sampler thread");
        }
        let mut seen = std::mem::take(&mut *self.seen.lock().unwrap_or_else(|e| e.into_inner()));
        seen.read_gap(Instant::now(), "the end");
        seen
    }
}

/// Follows the logs of every controller pod of every phase into files (a pod's logs go with it
/// when a rollout deletes it), so that a violation can be explained by what the controllers said.
struct ControllerLogs {
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ControllerLogs {
    fn start(cluster: &Cluster) -> ControllerLogs {
        let dir = cluster.scratch().join("controller-logs");
        std::fs::create_dir_all(&dir).expect("controller log dir");
        let stop = Arc::new(AtomicBool::new(false));
        let (kubectl, env) = (cluster.bin().join("kubectl"), cluster.envs());
        let thread = {
            let (dir, stop) = (dir.clone(), stop.clone());
            std::thread::spawn(move || {
                let kubectl_cmd = |args: &[&str]| {
                    let mut command = std::process::Command::new(&kubectl);
                    command
                        .args(args)
                        .args(["-n", SYSTEM_NS])
                        .envs(env.iter().map(|(k, v)| (k, v)));
                    command
                };
                // Pod -> its follower. One that ended while its pod is still listed (it started
                // before the container did, or the container restarted) is started again from
                // the last line it wrote (the repeated line goes at the end: lines are deduped).
                let mut followers: HashMap<String, std::process::Child> = HashMap::new();
                while !stop.load(Ordering::Relaxed) {
                    let pods = kubectl_cmd(&[
                        "get",
                        "pods",
                        "-l",
                        "app.kubernetes.io/component=controller",
                        "-o",
                        "name",
                        "--request-timeout=10s",
                    ])
                    .output();
                    let names = pods.map_or_else(
                        |_| String::new(),
                        |o| String::from_utf8_lossy(&o.stdout).into_owned(),
                    );
                    for pod in names.lines().filter_map(|l| l.strip_prefix("pod/")) {
                        let file = dir.join(format!("{pod}.log"));
                        let running = followers
                            .get_mut(pod)
                            .is_some_and(|child| matches!(child.try_wait(), Ok(None)));
                        if running {
                            continue;
                        }
                        let Ok(out) = std::fs::OpenOptions::new()
                            .create(true)
                            .append(true)
                            .open(&file)
                        else {
                            continue;
                        };
                        let since = std::fs::read_to_string(&file)
                            .ok()
                            .and_then(|t| {
                                t.lines()
                                    .last()
                                    .and_then(|l| l.split_once(' '))
                                    .map(|(stamp, _)| stamp.to_owned())
                            })
                            .map(|stamp| format!("--since-time={stamp}"));
                        let mut args = vec!["logs", "-f", "--timestamps", pod];
                        args.extend(since.as_deref());
                        let follow = kubectl_cmd(&args)
                            .stdout(out)
                            .stderr(std::process::Stdio::null())
                            .spawn();
                        if let Ok(child) = follow {
                            followers.insert(pod.to_owned(), child);
                        }
                    }
                    std::thread::sleep(Duration::from_secs(2));
                }
                for child in followers.values_mut() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            })
        };
        ControllerLogs {
            dir,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops following (the thread kills its followers); a second call does nothing.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Stops following; every controller line that names one of `names`, oldest first.
    fn finish(mut self, names: &[String]) -> Vec<String> {
        self.stop();
        let mut lines: Vec<String> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|entry| {
                let pod = entry.file_name().to_string_lossy().into_owned();
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                text.lines()
                    .filter(|l| names.iter().any(|n| l.contains(n.as_str())))
                    .map(|l| match l.split_once(' ') {
                        Some((stamp, rest)) => format!("{stamp} [{pod}] {rest}"),
                        None => l.to_owned(),
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        lines.sort();
        lines.dedup();
        lines
    }
}

/// A suite that panics before `finish` leaves no follower running.
impl Drop for ControllerLogs {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Suite {
    cluster: Cluster,
    chart: String,
    current_image: String,
}

impl Suite {
    fn json(&self, args: &[&str]) -> Value {
        self.cluster.kubectl_json(args)
    }

    fn helm_ok(&self, args: &[&str]) -> String {
        let out = self.cluster.helm(args);
        assert!(
            out.status.success(),
            "helm {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the controller Deployment has rolled out and every pod runs `image`.
    fn controller_runs(&self, image: &str) {
        let deployment = format!("deployment/{RELEASE}-targetlease");
        self.cluster.kubectl_ok(&[
            "rollout",
            "status",
            &deployment,
            "-n",
            SYSTEM_NS,
            "--timeout=180s",
        ]);
        let started = Instant::now();
        loop {
            let pods = self.json(&[
                "get",
                "pods",
                "-n",
                SYSTEM_NS,
                "-l",
                "app.kubernetes.io/component=controller",
            ]);
            let images: Vec<String> = pods["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
                .map(|p| {
                    p["spec"]["containers"][0]["image"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned()
                })
                .collect();
            if !images.is_empty() && images.iter().all(|i| i == image) {
                return;
            }
            assert!(
                started.elapsed() < 120 * SEC,
                "controller pods do not all run {image}: {images:?}"
            );
            std::thread::sleep(SEC);
        }
    }

    /// The installed CRD stores v1beta1, and records v1beta1 alone as stored.
    fn assert_stage_two(&self) {
        let crd = self.json(&["get", "crd", targetlease::api::CRD_NAME]);
        assert_eq!(
            support::chart::storage_versions(&crd),
            ["v1beta1"],
            "the CRD's storage version"
        );
        assert_eq!(
            crd["status"]["storedVersions"],
            serde_json::json!(["v1beta1"])
        );
    }

    fn served_versions(&self) -> Vec<String> {
        let crd = self.json(&["get", "crd", targetlease::api::CRD_NAME]);
        crd["spec"]["versions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| v["name"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

/// Holds the leases for a while after a phase, so that a renewal (TTL/3) and a hand-over of the
/// `run` workload fall inside each phase.
fn soak(sampler: &Sampler, how_long: Duration) {
    let before = sampler.samples();
    std::thread::sleep(how_long);
    assert!(
        sampler.samples() > before + 5,
        "the sampler stopped sampling ({} samples)",
        sampler.samples()
    );
}

fn upgrade_and_rollback_keep_leases_held() {
    let started = Instant::now();
    // This release's image first: its static build is what the previous release's build is
    // seeded from.
    let (tarball, current_image) = build_controller_image();
    let previous = previous_release();
    let cluster = Cluster::start_with_node();
    let node_ip = cluster.node_ip();
    let valkey = Server::start_with(
        ServerKind::Valkey91,
        &["--requirepass", PASSWORD, "--bind", "127.0.0.1", &node_ip],
    );
    cluster.import_image(&tarball);
    cluster.import_image(&previous.image);
    let previous_image = std::fs::read_to_string(format!("{}.ref", previous.image.display()))
        .ok()
        .and_then(|r| r.split('@').next().map(str::to_owned))
        .unwrap_or_else(|| format!("ghcr.io/targetlease/targetlease:{}", previous.version));
    let current_image = current_image.split('@').next().expect("name").to_owned();
    assert_ne!(
        previous_image, current_image,
        "the two releases' images have one name"
    );
    let critical = "#!/bin/sh\n# One critical section: marks its start and end with its token.\necho \"start $TARGETLEASE_TOKEN\"\nsleep 2\necho \"end $TARGETLEASE_TOKEN\"\n";
    let app = support::oci::app_image(
        cluster.scratch(),
        APP_IMAGE,
        &previous.binary,
        &[("app/critical", critical)],
    );
    cluster.import_image(&app);
    for ns in [SYSTEM_NS, APP_NS] {
        cluster.kubectl_ok(&["create", "namespace", ns]);
        cluster.kubectl_ok(&[
            "label",
            "namespace",
            ns,
            "pod-security.kubernetes.io/enforce=restricted",
        ]);
    }
    let url = format!("redis://{node_ip}:{}", valkey.port);
    cluster.valkey_secret(SYSTEM_NS, "valkey", &url, PASSWORD);
    let suite = Suite {
        chart: repo().join("charts/targetlease").display().to_string(),
        current_image,
        cluster,
    };
    let cluster = &suite.cluster;

    // The previous release, as its users installed it.
    let previous_chart = previous.chart.display().to_string();
    let mut install = vec!["install", RELEASE, &previous_chart, "-n", SYSTEM_NS];
    install.extend(Cluster::NODE_CHART_SETTINGS);
    install.extend(["--wait", "--timeout=180s"]);
    suite.helm_ok(&install);
    suite.controller_runs(&previous_image);
    assert_eq!(
        suite.served_versions(),
        ["v1alpha1"],
        "the previous release's CRD"
    );
    cluster.kubectl_ok(&[
        "apply",
        "-f",
        &repo().join("examples/rbac.yaml").display().to_string(),
    ]);
    // 50 declared leases, written as the previous release's users wrote them, and the one the
    // `wait` workload waits for.
    let mut yaml = String::new();
    for i in 0..=LEASES {
        let name = if i == LEASES {
            "waited".to_string()
        } else {
            format!("held-{i:02}")
        };
        yaml.push_str(&format!(
            "---\napiVersion: targetlease.dev/v1alpha1\nkind: TargetLease\nmetadata:\n  name: {name}\n  namespace: {APP_NS}\nspec:\n  target: upgrade/{name}\n  holder: upgrade-suite\n  ttlSeconds: 30\n"
        ));
    }
    let out = cluster.kubectl_with_input(&["apply", "-f", "-"], Some(&yaml));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let declared = wait_all_held(&suite);
    let workloads = workloads_yaml();
    let out = cluster.kubectl_with_input(&["apply", "-f", "-"], Some(&workloads));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    cluster.kubectl_ok(&[
        "rollout",
        "status",
        "deployment/upgrade-run",
        "-n",
        APP_NS,
        "--timeout=120s",
    ]);
    let controller_logs = ControllerLogs::start(cluster);
    let sampler = Sampler::start(cluster, declared.clone());
    soak(&sampler, 12 * SEC);

    sampler.phase("helm upgrade to this release");
    let upgrade = |extra: &[&str]| {
        let mut args = vec![
            "upgrade",
            RELEASE,
            suite.chart.as_str(),
            "-n",
            SYSTEM_NS,
            "--reuse-values",
            "--wait",
            "--timeout=180s",
        ];
        args.extend(extra);
        suite.helm_ok(&args);
    };
    upgrade(&[]);
    suite.controller_runs(&suite.current_image);
    assert_eq!(
        suite.served_versions(),
        ["v1alpha1", "v1beta1"],
        "the CRD upgraded by the chart"
    );
    // A claim written through v1beta1 (by a user and by this release's controller): after the
    // rollback, the previous release must still be able to write its status.
    let late = format!(
        "apiVersion: targetlease.dev/v1beta1\nkind: TargetLease\nmetadata:\n  name: late\n  namespace: {APP_NS}\nspec:\n  target: upgrade/late\n  holder: upgrade-suite\n  ttlSeconds: 30\n"
    );
    let out = cluster.kubectl_with_input(&["apply", "--server-side", "-f", "-"], Some(&late));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    phase_within(&suite, "late", "Held", 60 * SEC);
    soak(&sampler, 12 * SEC);

    sampler.phase(ROLLBACK_PHASE);
    suite.helm_ok(&[
        "rollback",
        RELEASE,
        "1",
        "-n",
        SYSTEM_NS,
        "--wait",
        "--timeout=180s",
    ]);
    suite.controller_runs(&previous_image);
    assert_eq!(
        suite.served_versions(),
        ["v1alpha1"],
        "the CRD rolled back by the chart"
    );
    // The API server refuses server-side apply (the previous release's status writes) on
    // objects with field-manager entries of a version it no longer serves, until this
    // release's migrate-storage moves them (docs/upgrading/0.1-to-0.2.md).
    let repaired = migrate_storage(cluster);
    assert!(
        repaired.contains("moved the field managers of"),
        "{repaired}"
    );
    // Every entry moved, not only some: one left behind would refuse that object's status
    // writes by the previous release (renewals write no status, so the sampler would not see).
    let unserved = format!("{}/v1beta1", targetlease::api::GROUP);
    let listed = suite.json(&[
        "get",
        "targetleases.v1alpha1.targetlease.dev",
        "-A",
        "--show-managed-fields",
    ]);
    let managers = |o: &Value| -> Vec<(String, String)> {
        o["metadata"]["managedFields"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| {
                let field = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
                (field("manager"), field("apiVersion"))
            })
            .collect()
    };
    let items = listed["items"].as_array().cloned().unwrap_or_default();
    // Not vacuous: the claim applied through v1beta1 keeps its applier's entry, moved.
    let late_managers = items
        .iter()
        .find(|o| o["metadata"]["name"] == "late")
        .map(managers)
        .unwrap_or_default();
    assert!(
        late_managers
            .iter()
            .any(|(m, v)| m == "kubectl" && v == "targetlease.dev/v1alpha1"),
        "late's field managers after migrate-storage: {late_managers:?}"
    );
    let left: Vec<String> = items
        .iter()
        .filter(|o| managers(o).iter().any(|(_, v)| *v == unserved))
        .map(|o| {
            o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(
        left.is_empty(),
        "field managers of {unserved}, which is no longer served, left on {left:?}"
    );
    let out = cluster.kubectl_with_input(
        &["apply", "--server-side", "-f", "-"],
        Some(
            &late
                .replace("targetlease.dev/v1beta1", "targetlease.dev/v1alpha1")
                .replace("ttlSeconds: 30\n", "ttlSeconds: 30\n  release: true\n"),
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    phase_within(&suite, "late", "Released", 60 * SEC);
    // This release's binaries, against the previous release's CRD: they stop at once, saying
    // why, instead of waiting on a version that is not served.
    for args in [
        &["wait", "held-00", "-n", APP_NS, "--timeout=60s"][..],
        &[
            "controller",
            "--http-addr",
            "127.0.0.1:0",
            "--valkey-url",
            "redis://127.0.0.1:1",
        ][..],
    ] {
        let started = Instant::now();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_targetlease"))
            .args(args)
            .envs(cluster.envs())
            .output()
            .expect("run targetlease");
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !out.status.success(),
            "{args:?} ran against a CRD without v1beta1"
        );
        assert!(
            said.contains("does not serve targetlease.dev/v1beta1") && said.contains("Upgrading"),
            "{args:?}: {said}"
        );
        assert!(
            started.elapsed() < 20 * SEC,
            "{args:?} took {:?} to say so",
            started.elapsed()
        );
    }
    soak(&sampler, 12 * SEC);

    sampler.phase("helm upgrade again");
    upgrade(&[]);
    suite.controller_runs(&suite.current_image);
    soak(&sampler, 8 * SEC);

    sampler.phase("rolling restart");
    cluster.kubectl_ok(&[
        "rollout",
        "restart",
        &format!("deployment/{RELEASE}-targetlease"),
        "-n",
        SYSTEM_NS,
    ]);
    suite.controller_runs(&suite.current_image);
    soak(&sampler, 8 * SEC);

    sampler.phase("storage version move");
    upgrade(&["--set", "crds.storageVersion=v1beta1"]);
    // The revision to go back to when a rollback past this point is refused.
    let stage_two: Value = serde_json::from_str(&suite.helm_ok(&[
        "status",
        RELEASE,
        "-n",
        SYSTEM_NS,
        "--output=json",
    ]))
    .expect("helm status JSON");
    let stage_two = stage_two["version"].as_u64().expect("revision").to_string();
    let said = migrate_storage(cluster);
    let rewritten = support::chart::migrate_rewrote(&said);
    // It counts what it re-encoded (a status refresh since the switch re-encodes too, so the
    // count is not fixed); every declared lease is read back from etcd below.
    assert!(rewritten > 0 && said.contains("now [v1beta1]"), "{said}");
    suite.assert_stage_two();
    for name in declared.keys().map(String::as_str).chain(["late"]) {
        assert_eq!(
            cluster.stored_api_version(APP_NS, name),
            "targetlease.dev/v1beta1",
            "{name} in etcd after the migration"
        );
    }
    soak(&sampler, 8 * SEC);

    sampler.phase("rollback refused once v1beta1 is stored");
    let refused = cluster.helm(&["rollback", RELEASE, "1", "-n", SYSTEM_NS, "--timeout=120s"]);
    let message = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(
        !refused.status.success(),
        "a rollback past the storage move succeeded"
    );
    assert!(message.contains("storedVersions"), "{message}");
    // Helm updates the release's other objects even when the CRD is refused: say what runs.
    let after = suite.json(&[
        "get",
        "deployment",
        &format!("{RELEASE}-targetlease"),
        "-n",
        SYSTEM_NS,
    ]);
    eprintln!(
        "upgrade suite: after the refused rollback the Deployment asks for {}",
        after["spec"]["template"]["spec"]["containers"][0]["image"]
    );
    // Helm leaves no revision deployed: the refused one is failed, and `helm upgrade
    // --reuse-values` would reuse its values, those of the revision rolled back to. The way back
    // (docs/upgrading/0.1-to-0.2.md) is a rollback to the last good revision, which restores its
    // chart, values and image, and keeps the storage version.
    eprintln!(
        "upgrade suite: helm history after the refused rollback:\n{}",
        suite.helm_ok(&["history", RELEASE, "-n", SYSTEM_NS])
    );
    // The upgrade that would reuse those values keeps the storage version all the same: the
    // chart reads it from the installed CRD when the values do not name one.
    let reused = suite.helm_ok(&[
        "upgrade",
        RELEASE,
        suite.chart.as_str(),
        "-n",
        SYSTEM_NS,
        "--reuse-values",
        "--dry-run=server",
        "--output=json",
    ]);
    assert_eq!(
        support::chart::dry_run_storage_versions(&reused),
        ["v1beta1"],
        "helm upgrade --reuse-values after the refused rollback"
    );
    suite.helm_ok(&[
        "rollback",
        RELEASE,
        &stage_two,
        "-n",
        SYSTEM_NS,
        "--wait",
        "--timeout=180s",
    ]);
    suite.controller_runs(&suite.current_image);
    suite.assert_stage_two();
    // Like every phase, one that ends with work under the restored controller: the two
    // rollouts above (to the previous image and back) can take the whole phase so far.
    soak(&sampler, 8 * SEC);
    // Longer than a TTL: a controller that stopped renewing would let leases expire in the
    // store while their statuses still say Held.
    sampler.phase("held past a TTL");
    soak(&sampler, 40 * SEC);

    let mut seen = sampler.finish();
    let sampled_until = Timestamp::now();
    // Every declared lease is still held in the store, by the token its status shows.
    for (name, token) in &declared {
        let keys = TargetKeys::new(
            "tl",
            &TargetRef::new(APP_NS, &format!("upgrade/{name}")).expect("target"),
        );
        let ttl = valkey.raw(&["PTTL", &keys.lease()]);
        let ms: i64 = ttl.trim().trim_start_matches(':').parse().unwrap_or(-3);
        let fence = valkey.raw(&["GET", &keys.fence()]);
        let problem = if ms <= 0 {
            Some(format!("its lease has no time left in Valkey ({ttl:?})"))
        } else if !fence.contains(&token.to_string()) {
            Some(format!("Valkey's fence {fence:?} is not its token {token}"))
        } else {
            None
        };
        if let Some(problem) = problem {
            seen.suspects.insert(name.clone());
            seen.violations.push(format!("the end: {name}: {problem}"));
        }
    }
    eprintln!(
        "upgrade suite: {} samples ({} failed reads) in {:?}",
        seen.samples,
        seen.failed_reads,
        started.elapsed()
    );
    if let Some((held_for, name, phase)) = &seen.longest_held_while_deleting {
        eprintln!(
            "upgrade suite: the longest a deleted TargetLease still showed Held: {held_for:?} \
             ({name}, phase {phase})"
        );
    }
    let suspects: Vec<String> = seen.suspects.iter().cloned().collect();
    let explained = controller_logs.finish(&suspects);
    if !suspects.is_empty() {
        eprintln!(
            "upgrade suite: what the controllers logged about {suspects:?} ({} lines):",
            explained.len()
        );
        for line in explained.iter().take(300) {
            eprintln!("  {line}");
        }
    }
    assert!(
        seen.violations.is_empty(),
        "{} violations, first ones:\n{}",
        seen.violations.len(),
        seen.violations
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    check_run_commands(&suite, &seen.phases, sampled_until);
    check_wait_workload(&suite, declared["waited"]);
    let table = cluster.kubectl_ok(&["get", "tl", "-n", APP_NS]);
    assert!(
        table.contains("held-49") && table.contains("Held"),
        "{table}"
    );
    support::suite::measured("upgrade suite", started.elapsed());
    drop(valkey);
}

/// `targetlease migrate-storage` of this release; what it printed.
fn migrate_storage(cluster: &Cluster) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_targetlease"))
        .arg("migrate-storage")
        .envs(cluster.envs())
        .output()
        .expect("run migrate-storage");
    assert!(
        out.status.success(),
        "migrate-storage: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("upgrade suite: migrate-storage: {}", said.trim());
    said
}

/// Waits until TargetLease `name` shows `phase`.
fn phase_within(suite: &Suite, name: &str, phase: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        let lease = suite.json(&[
            "get",
            "targetleases.v1alpha1.targetlease.dev",
            name,
            "-n",
            APP_NS,
        ]);
        if lease["status"]["phase"] == phase {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{name} is not {phase} within {limit:?}: {}",
            lease["status"]
        );
        std::thread::sleep(SEC);
    }
}

/// Waits until every declared lease is Held; name -> token.
fn wait_all_held(suite: &Suite) -> HashMap<String, u64> {
    let started = Instant::now();
    loop {
        let list = suite.json(&["get", "targetleases.v1alpha1.targetlease.dev", "-n", APP_NS]);
        let held: HashMap<String, u64> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|i| i["status"]["phase"] == "Held")
            .filter_map(|i| {
                Some((
                    i["metadata"]["name"].as_str()?.to_owned(),
                    i["status"]["fencingToken"].as_u64()?,
                ))
            })
            .collect();
        if held.len() == LEASES + 1 {
            return held;
        }
        if started.elapsed() > 90 * SEC {
            let logs = suite.cluster.kubectl(&[
                "logs",
                "-n",
                SYSTEM_NS,
                "-l",
                "app.kubernetes.io/component=controller",
                "--tail=20",
                "--prefix",
            ]);
            panic!(
                "only {} of {} declared leases Held; one of them: {}\ncontroller logs:\n{}{}",
                held.len(),
                LEASES + 1,
                list["items"][0],
                String::from_utf8_lossy(&logs.stdout),
                String::from_utf8_lossy(&logs.stderr)
            );
        }
        std::thread::sleep(SEC);
    }
}

/// The previous release's `run` (two replicas taking turns on one target, each command two
/// seconds) and `wait` (asking for the declared lease's token every two seconds).
fn workloads_yaml() -> String {
    let pod_env = "
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - name: POD_NAMESPACE
              valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
            - name: POD_UID
              valueFrom: {fieldRef: {fieldPath: metadata.uid}}";
    let security = "
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            runAsNonRoot: true
            capabilities: {drop: [ALL]}
            seccompProfile: {type: RuntimeDefault}";
    let deployment = |name: &str, replicas: u32, script: &str| {
        format!(
            "---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: {APP_NS}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
      serviceAccountName: lease-user
      terminationGracePeriodSeconds: 5
      containers:
        - name: work
          image: {APP_IMAGE}
          imagePullPolicy: Never
          command: [sh, -c, '{script}']
          env:{pod_env}{security}
"
        )
    };
    let run = format!(
        "while true; do targetlease run --target {RUN_TARGET} --ttl 30s --wait-timeout 120s -- /app/critical; sleep 1; done"
    );
    let wait = "while true; do t=$(targetlease wait waited --timeout 60s) && echo \"waited $t\"; sleep 2; done";
    deployment("upgrade-run", 2, &run) + &deployment("upgrade-wait", 1, wait)
}

/// `12.3 s`.
fn seconds(span: jiff::SignedDuration) -> String {
    format!("{:.1} s", span.as_secs_f64())
}

/// Pods' log lines with the container runtime's timestamps.
fn timestamped_logs(suite: &Suite, app: &str) -> Vec<(Timestamp, String)> {
    let text = suite.cluster.kubectl_ok(&[
        "logs",
        "-n",
        APP_NS,
        "-l",
        &format!("app={app}"),
        "--timestamps",
        "--tail=-1",
        "--prefix",
        "--max-log-requests=10",
    ]);
    text.lines()
        .filter_map(|line| {
            // "[pod/NAME/work] 2026-12-02T05:00:01.123456789Z start 17"
            let (_, rest) = line.split_once("] ")?;
            let (stamp, message) = rest.split_once(' ')?;
            Some((stamp.parse().ok()?, message.to_owned()))
        })
        .collect()
}

/// No two `run` commands overlapped, their tokens grew, and enough of them ran.
fn check_run_commands(suite: &Suite, phases: &[(String, Timestamp)], sampled_until: Timestamp) {
    let mut lines = timestamped_logs(suite, "upgrade-run");
    lines.sort();
    let mut sections: Vec<(Timestamp, Option<Timestamp>, u64)> = Vec::new();
    let mut open: HashMap<u64, usize> = HashMap::new();
    for (at, message) in &lines {
        if let Some(token) = message
            .strip_prefix("start ")
            .and_then(|t| t.trim().parse().ok())
        {
            open.insert(token, sections.len());
            sections.push((*at, None, token));
        } else if let Some(token) = message
            .strip_prefix("end ")
            .and_then(|t| t.trim().parse::<u64>().ok())
            && let Some(i) = open.remove(&token)
        {
            sections[i].1 = Some(*at);
        }
    }
    assert!(
        sections.len() >= 10,
        "only {} commands ran under the run workload's lease:\n{lines:?}",
        sections.len()
    );
    for pair in sections.windows(2) {
        let ((_, end, token), (start, _, next)) = (pair[0], pair[1]);
        // Only the last command may still be running: one cut short lost its lease.
        let end = end.unwrap_or_else(|| {
            panic!("the command under token {token} never ended (its lease was lost)")
        });
        // The times are the container runtime's, taken when it reads each line from the
        // container's output: a loaded node stamps a line some milliseconds late (seen: a
        // command's last line stamped 1.7 ms after the next command's first, whose grant came
        // 12 ms before that stamp). An overlap of commands (the 2.2 s this check once caught)
        // is far above that.
        let stamp_lag = jiff::SignedDuration::from_millis(100);
        assert!(
            end <= start + stamp_lag,
            "two commands on {RUN_TARGET} at once: token {token} ran until {end}, token {next} \
             started at {start}"
        );
        assert!(next > token, "token {next} started after token {token}");
    }
    // Work went on in every phase: a command started in each. Every phase's figures are
    // printed first, so that a phase without work shows how long it lasted.
    let starts: Vec<Timestamp> = sections.iter().map(|(at, _, _)| *at).collect();
    let phase_at = |at: Timestamp| {
        phases
            .iter()
            .rev()
            .find(|(_, began)| *began <= at)
            .map_or("installed", |(phase, _)| phase.as_str())
    };
    let mut idle = Vec::new();
    for (i, (phase, began)) in phases.iter().enumerate() {
        let ended = phases.get(i + 1).map(|(_, t)| *t);
        let started = starts
            .iter()
            .filter(|at| *at >= began && ended.is_none_or(|end| **at < end))
            .count();
        let lasted = ended.unwrap_or(sampled_until).duration_since(*began);
        eprintln!(
            "upgrade suite: phase {phase}: {started} run commands started in {}{}",
            seconds(lasted),
            if ended.is_none() {
                " (the last phase)"
            } else {
                ""
            }
        );
        if started == 0 && lasted.unsigned_abs() >= RUN_CYCLE_AT_MOST {
            idle.push(phase.clone());
        }
    }
    assert!(idle.is_empty(), "no run command started during {idle:?}");
    // And it never stalled, whatever was being upgraded: from one command's start to the next,
    // and from the last one to the end of the sampling.
    let mut gaps: Vec<(jiff::SignedDuration, Timestamp)> = starts
        .windows(2)
        .map(|w| (w[1].duration_since(w[0]), w[1]))
        .collect();
    if let Some(last) = starts.last() {
        gaps.push((sampled_until.duration_since(*last), sampled_until));
    }
    let limit = |at: Timestamp| match phase_at(at) {
        ROLLBACK_PHASE => RUN_STALL_AT_MOST_PREVIOUS,
        _ => RUN_STALL_AT_MOST,
    };
    if let Some((gap, at)) = gaps.iter().max() {
        eprintln!(
            "upgrade suite: the longest time without a run command starting: {} (up to {at}, \
             phase {})",
            seconds(*gap),
            phase_at(*at)
        );
    }
    for (gap, at) in gaps {
        assert!(
            gap.unsigned_abs() <= limit(at),
            "no run command started for {} up to {at} (phase {}, at most {:?})",
            seconds(gap),
            phase_at(at),
            limit(at)
        );
    }
    eprintln!(
        "upgrade suite: {} run commands, none overlapping",
        sections.len()
    );
}

/// The `wait` workload got the declared lease's token throughout, and nothing else.
fn check_wait_workload(suite: &Suite, token: u64) {
    let lines = timestamped_logs(suite, "upgrade-wait");
    let waited: Vec<&str> = lines
        .iter()
        .filter_map(|(_, m)| m.strip_prefix("waited "))
        .collect();
    assert!(waited.len() >= 10, "the wait workload printed {waited:?}");
    assert!(
        waited.iter().all(|t| t.trim() == token.to_string()),
        "wait printed another token than {token}: {waited:?}"
    );
}
