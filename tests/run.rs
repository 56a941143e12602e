//! `targetlease run` and `targetlease wait` end to end, on a real control plane and Valkey, with
//! the controller running: each scenario tries to make a command outlive its lease, or a lease
//! outlive its command. A missing control plane or server fails the suite; it never skips.

use targetlease_test_support as support;
use targetlease_test_support::scenarios;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, ListParams};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use targetlease::api::{Phase, TargetLease};
use targetlease::store::LeaseStore;
use targetlease::store::valkey::keys::TargetKeys;
use tokio::process::{Child, Command};

use support::kube::{http_get, metric, phase_of, token_of};
use support::proxy::{Mode, Proxy};
use support::scenario::{SEC, Scenario, run_suite};

/// Exit statuses of `run` and `wait` (docs/controller.md).
const EXIT_LOST: i32 = 76;
const EXIT_DELETED: i32 = 79;
const EXIT_SIGTERM: i32 = 143;

/// `targetlease run -n NS --target T EXTRA... -- sh -c SCRIPT` with the cluster's environment.
fn run_cmd(s: &Scenario, target: &str, extra: &[&str], script: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_targetlease"));
    command
        .args(["run", "-n", &s.ns, "--target", target])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .envs(s.cluster.envs())
        .env_remove("POD_NAME")
        .env_remove("POD_UID")
        .env_remove("POD_NAMESPACE")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// The TargetLease a `run` made for `target`, once `pred` holds for it.
async fn run_lease(
    s: &Scenario,
    target: &str,
    limit: Duration,
    pred: impl Fn(&TargetLease) -> bool,
) -> TargetLease {
    let deadline = Instant::now() + limit;
    loop {
        let items = s
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
            s.controller.as_ref().map(|c| c.logs()).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn held(lease: &TargetLease) -> bool {
    phase_of(lease) == Some(Phase::Held)
}

/// Whether `pid` is a live process (a zombie counts as dead).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Waits until `path` holds a pid, and returns it.
async fn pid_in(path: &Path) -> i32 {
    let deadline = Instant::now() + 30 * SEC;
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "{} never got a pid",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every pid in `pids` is gone; panics after `limit`.
async fn all_gone(pids: &[i32], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            Instant::now() < deadline,
            "{what}: still running after {limit:?}: {pids:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The exit status of `child`, which must exit within `limit`.
async fn exits(child: &mut Child, limit: Duration) -> Option<i32> {
    tokio::time::timeout(limit, child.wait())
        .await
        .unwrap_or_else(|_| panic!("run did not exit within {limit:?}"))
        .expect("run status")
        .code()
}

/// A command that records its pid and a grandchild's pid (which ignores SIGTERM) in `dir`, then
/// loops.
fn family_script(dir: &Path) -> String {
    format!(
        "echo $$ > {d}/child; sh -c 'trap \"\" TERM; while :; do sleep 0.2; done' & echo $! > {d}/grandchild; while :; do sleep 0.2; done",
        d = dir.display()
    )
}

/// A pod object (no kubelet runs it) and its uid.
async fn pod(s: &Scenario, name: &str) -> String {
    let yaml = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {}\nspec:\n  containers:\n  - name: main\n    image: example.invalid/worker:1\n",
        s.ns
    );
    s.cluster.apply(&yaml);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(s.client.clone(), &s.ns);
    pods.get(name).await.expect("pod").uid().expect("pod uid")
}

// 1. (and 2.) Deleting the TargetLease of a running `run` stops the command and a grandchild
//    that ignores SIGTERM within the grace, and `run` exits "lost".
async fn delete_stops_command_and_grandchildren(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let mut run = run_cmd(
        &s,
        "deleted-target",
        &["--grace", "2s"],
        &family_script(dir.path()),
    )
    .spawn()
    .expect("run");
    let lease = run_lease(&s, "deleted-target", 30 * SEC, held).await;
    let child = pid_in(&dir.path().join("child")).await;
    let grandchild = pid_in(&dir.path().join("grandchild")).await;
    let start = Instant::now();
    s.delete(&lease.name_any()).await;
    assert_eq!(exits(&mut run, 20 * SEC).await, Some(EXIT_LOST));
    all_gone(&[child, grandchild], 5 * SEC, "after the delete").await;
    let took = start.elapsed();
    eprintln!("TargetLease deleted -> command and grandchild gone in {took:?}");
    assert!(took < 2 * SEC + 3 * SEC, "took {took:?} with a 2 s grace");
    s.wait_gone(&lease.name_any(), 30 * SEC).await;
}

// 3. A `run` killed with SIGKILL loses its lease within the TTL, without a pod and with one,
//    and its command dies with it.
async fn sigkilled_run_frees_the_target(s: Scenario) {
    for with_pod in [false, true] {
        let target = format!("killed-{}", if with_pod { "pod" } else { "host" });
        let dir = tempfile::tempdir().expect("dir");
        let mut command = run_cmd(&s, &target, &["--ttl", "4s"], &family_script(dir.path()));
        if with_pod {
            let uid = pod(&s, "killed-pod").await;
            command.env("POD_NAME", "killed-pod").env("POD_UID", uid);
        }
        let mut run = command.spawn().expect("run");
        run_lease(&s, &target, 30 * SEC, held).await;
        let child = pid_in(&dir.path().join("child")).await;
        let grandchild = pid_in(&dir.path().join("grandchild")).await;
        s.apply("waiter", &target, "waiter", "ttlSeconds: 4");
        s.wait_phase("waiter", Phase::Waiting, 30 * SEC).await;
        let start = Instant::now();
        run.start_kill().expect("SIGKILL");
        let _ = run.wait().await;
        s.wait_phase("waiter", Phase::Held, 6 * SEC).await;
        let took = start.elapsed();
        eprintln!("run SIGKILLed (pod: {with_pod}) -> waiter held in {took:?}");
        assert!(took <= 4 * SEC, "freed after {took:?}, the TTL is 4 s");
        all_gone(&[child, grandchild], 5 * SEC, "the command of a killed run").await;
        s.delete("waiter").await;
        s.wait_gone("waiter", 30 * SEC).await;
    }
}

// 3b. A `run` restarted after SIGKILL (same pod) adopts its own TargetLease instead of waiting
//     behind it, and first kills what its dead incarnation's command left running.
async fn restarted_run_adopts_its_lease(s: Scenario) {
    let uid = pod(&s, "restarted-pod").await;
    let dir = tempfile::tempdir().expect("dir");
    let in_pod = |command: &mut Command| {
        command
            .env("POD_NAME", "restarted-pod")
            .env("POD_UID", &uid);
    };
    let mut first = run_cmd(&s, "restart-target", &[], &family_script(dir.path()));
    in_pod(&mut first);
    let mut first = first.spawn().expect("run");
    let held_before = run_lease(&s, "restart-target", 30 * SEC, held).await;
    let grandchild = pid_in(&dir.path().join("grandchild")).await;
    first.start_kill().expect("SIGKILL");
    let _ = first.wait().await;

    let marker = dir.path().join("second");
    let start = Instant::now();
    let mut second = run_cmd(
        &s,
        "restart-target",
        &[],
        &format!("echo \"$TARGETLEASE_TOKEN\" > {}", marker.display()),
    );
    in_pod(&mut second);
    let status = tokio::time::timeout(20 * SEC, second.status())
        .await
        .expect("the restarted run got its lease without waiting a TTL")
        .expect("run");
    assert!(status.success(), "{status}");
    let took = start.elapsed();
    eprintln!("restarted run adopted its TargetLease and ran in {took:?}");
    let token: u64 = std::fs::read_to_string(&marker)
        .expect("the command ran")
        .trim()
        .parse()
        .expect("token");
    assert!(token >= token_of(&held_before));
    // The guard killed the dead incarnation's command group at once (had the guard been killed
    // too, the restarted run would have killed the leftovers itself).
    all_gone(&[grandchild], 5 * SEC, "the dead incarnation's leftovers").await;
}

// 4. `--holder X` inside a pod gets the lease: holderRef names the pod (POD_NAME, POD_UID),
//    not the holder.
async fn holder_name_in_a_pod_gets_the_lease(s: Scenario) {
    let uid = pod(&s, "named-pod").await;
    let status = run_cmd(
        &s,
        "named-target",
        &["--holder", "nightly-export", "--wait-timeout", "20s"],
        "test \"$TARGETLEASE_OWNER\" = nightly-export",
    )
    .env("POD_NAME", "named-pod")
    .env("POD_UID", &uid)
    .status()
    .await
    .expect("run");
    assert!(status.success(), "{status}");
}

// 5. Deletion while waiting ends `run` and `wait` at once with "deleted", not at the timeout.
async fn delete_while_waiting(s: Scenario) {
    s.apply("holder", "busy-target", "someone", "");
    s.wait_phase("holder", Phase::Held, 30 * SEC).await;
    let mut run = run_cmd(&s, "busy-target", &["--wait-timeout", "1h"], "true")
        .spawn()
        .expect("run");
    let waiting = run_lease(&s, "busy-target", 30 * SEC, |l| {
        phase_of(l) == Some(Phase::Waiting)
    })
    .await;
    let mut wait = Command::new(env!("CARGO_BIN_EXE_targetlease"))
        .args(["wait", &waiting.name_any(), "-n", &s.ns, "--timeout", "1h"])
        .envs(s.cluster.envs())
        .kill_on_drop(true)
        .spawn()
        .expect("wait");
    tokio::time::sleep(SEC).await;
    s.delete(&waiting.name_any()).await;
    assert_eq!(exits(&mut run, 15 * SEC).await, Some(EXIT_DELETED));
    assert_eq!(exits(&mut wait, 15 * SEC).await, Some(EXIT_DELETED));
}

// 6. SIGTERM while waiting deletes the TargetLease and exits 143; SIGTERM while running passes
//    it to the command and exits 143 after it, whatever the command returns.
async fn sigterm_while_waiting_and_running(s: Scenario) {
    s.apply("holder", "term-target", "someone", "");
    s.wait_phase("holder", Phase::Held, 30 * SEC).await;
    let mut run = run_cmd(&s, "term-target", &[], "true")
        .spawn()
        .expect("run");
    let waiting = run_lease(&s, "term-target", 30 * SEC, |l| {
        l.spec.holder != "someone" && phase_of(l) == Some(Phase::Waiting)
    })
    .await;
    signal(&run, Signal::SIGTERM);
    assert_eq!(exits(&mut run, 15 * SEC).await, Some(EXIT_SIGTERM));
    s.wait_gone(&waiting.name_any(), 30 * SEC).await;

    let dir = tempfile::tempdir().expect("dir");
    let got = dir.path().join("got");
    let script = format!(
        "trap 'echo term > {}; exit 0' TERM; while :; do sleep 0.1; done",
        got.display()
    );
    let mut run = run_cmd(&s, "term-running", &[], &script)
        .spawn()
        .expect("run");
    let lease = run_lease(&s, "term-running", 30 * SEC, held).await;
    tokio::time::sleep(SEC).await;
    signal(&run, Signal::SIGTERM);
    assert_eq!(exits(&mut run, 15 * SEC).await, Some(EXIT_SIGTERM));
    assert_eq!(
        std::fs::read_to_string(&got)
            .expect("SIGTERM reached the command")
            .trim(),
        "term"
    );
    s.wait_gone(&lease.name_any(), 30 * SEC).await;
}

fn signal(child: &Child, signal: Signal) {
    let pid = child.id().and_then(|p| i32::try_from(p).ok()).expect("pid");
    kill(Pid::from_raw(pid), signal).expect("signal");
}

/// A copy of the cluster's kubeconfig whose server is `127.0.0.1:port`.
fn kubeconfig_via(s: &Scenario, port: u16, dir: &Path) -> (PathBuf, u16) {
    let text = std::fs::read_to_string(s.cluster.kubeconfig()).expect("kubeconfig");
    let server = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: https://127.0.0.1:"))
        .and_then(|p| p.trim().parse::<u16>().ok())
        .expect("the kubeconfig's API server port");
    let rewritten = text.replace(
        &format!("server: https://127.0.0.1:{server}"),
        &format!("server: https://127.0.0.1:{port}"),
    );
    let path = dir.join("kubeconfig");
    std::fs::write(&path, rewritten).expect("write kubeconfig");
    (path, server)
}

// 7. With the API server unreachable for longer than the TTL, `run` stops trusting its lease:
//    the command is stopped one TTL after the last confirmation, and `run` exits "lost".
async fn unreachable_api_server_stops_the_command(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let (_, api_port) = kubeconfig_via(&s, 0, dir.path());
    let proxy = Proxy::start(api_port).await;
    let (kubeconfig, _) = kubeconfig_via(&s, proxy.port, dir.path());
    let mut run = run_cmd(
        &s,
        "cut-target",
        &["--ttl", "4s", "--grace", "1s"],
        &family_script(dir.path()),
    )
    .env("KUBECONFIG", &kubeconfig)
    .spawn()
    .expect("run");
    run_lease(&s, "cut-target", 30 * SEC, held).await;
    let child = pid_in(&dir.path().join("child")).await;
    let grandchild = pid_in(&dir.path().join("grandchild")).await;
    tokio::time::sleep(SEC).await;
    let start = Instant::now();
    proxy.set(Mode::Stall);
    // The last confirmation came at most a heartbeat (TTL/4) before the stall: the command is
    // stopped by TTL + grace after the stall at the latest.
    all_gone(
        &[child, grandchild],
        4 * SEC + SEC + SEC,
        "after the self-fencing bound",
    )
    .await;
    let took = start.elapsed();
    eprintln!("API server unreachable -> run stopped its command in {took:?}");
    assert!(
        took >= 2 * SEC,
        "stopped after {took:?}, before it could know"
    );
    // `run` gives up deleting its TargetLease through the stalled API server after a bound.
    assert_eq!(exits(&mut run, 20 * SEC).await, Some(EXIT_LOST));
    proxy.set(Mode::Pass);
}

// 8. After a loss, `run` exits "lost" even when the command exits 0 on SIGTERM; the existing
//    behaviour stays: the token in the environment, release when the command exits, the
//    command's own status otherwise.
async fn lost_lease_exit_status_and_basics(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let out_file = dir.path().join("token");
    let script = format!(
        "echo \"$TARGETLEASE_TOKEN $TARGETLEASE_OWNER $TARGETLEASE_TARGET\" > {}",
        out_file.display()
    );
    let status = run_cmd(&s, "run-target", &["--holder", "job-1"], &script)
        .status()
        .await
        .expect("run");
    assert!(status.success(), "{status}");
    let written = std::fs::read_to_string(&out_file).expect("the command ran");
    let parts: Vec<&str> = written.split_whitespace().collect();
    assert_eq!(parts.len(), 3, "{written}");
    assert!(parts[0].parse::<u64>().expect("token") > 0);
    assert_eq!(&parts[1..], ["job-1", "run-target"]);
    let deadline = Instant::now() + 10 * SEC;
    while s
        .store()
        .await
        .inspect(&s.target("run-target"))
        .await
        .expect("inspect")
        .lease
        .is_some()
    {
        assert!(Instant::now() < deadline, "the lease was not released");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = run_cmd(&s, "run-target", &["--holder", "job-2"], "exit 3")
        .status()
        .await
        .expect("run");
    assert_eq!(status.code(), Some(3));

    // Someone wipes the lease in Valkey: the controller's next renewal finds it lost.
    let term_file = dir.path().join("term");
    let script = format!(
        "trap 'echo term > {}; exit 0' TERM; while true; do sleep 0.1; done",
        term_file.display()
    );
    let mut run = run_cmd(&s, "lost-target", &["--ttl", "3"], &script)
        .spawn()
        .expect("run");
    let lease = run_lease(&s, "lost-target", 30 * SEC, held).await;
    let keys = TargetKeys::new("tl", &s.target("lost-target"));
    s.valkey.raw(&["DEL", &keys.lease()]);
    assert_eq!(
        exits(&mut run, 30 * SEC).await,
        Some(EXIT_LOST),
        "a command that exits 0 on SIGTERM after a loss must not look successful"
    );
    assert_eq!(
        std::fs::read_to_string(&term_file)
            .expect("SIGTERM reached the command")
            .trim(),
        "term"
    );
    s.wait_gone(&lease.name_any(), 30 * SEC).await;
}

// The heartbeat's cost, measured from the controller's /metrics: one `run` holding a lease at
// TTL 4 s for 6 s. Heartbeats come every TTL/4 (1 s) and each wakes one reconcile, which renews
// the lease once in Valkey; renewals also come every TTL/3 on their own.
async fn heartbeat_cost(s: Scenario) {
    let mut run = run_cmd(&s, "beat-target", &["--ttl", "4s"], "sleep 9")
        .spawn()
        .expect("run");
    run_lease(&s, "beat-target", 30 * SEC, held).await;
    let http = s.controller.as_ref().expect("controller").http.clone();
    let page = || http_get(&http, "/metrics").expect("metrics").1;
    let before = page();
    let window = 6.0;
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let after = page();
    let per_second = |series: &str| (metric(&after, series) - metric(&before, series)) / window;
    let reconciles = per_second("targetlease_reconciles_total");
    let renewals = per_second("targetlease_store_call_seconds_count{op=\"renew\"}");
    let writes = per_second("targetlease_status_writes_total");
    eprintln!(
        "measured: one run at TTL 4 s: {reconciles:.2} reconciles/s, {renewals:.2} renewals/s, {writes:.2} status writes/s"
    );
    // A loose bound that catches a loop, not a speed: heartbeats (1/s) plus renewals (0.75/s).
    assert!(reconciles < 4.0, "{reconciles} reconciles/s");
    // Heartbeats write no status; the only writes move expiresAt forward, each when less than
    // 1.5 renewal intervals (2 s) are left of the 4 s it granted: at most one per 2 s, plus one
    // that the 6 s window may catch at an edge.
    assert!(
        writes <= 0.5 + 1.0 / window,
        "{writes} status writes/s: heartbeats must not write status"
    );
    assert_eq!(exits(&mut run, 30 * SEC).await, Some(0));
}

fn main() {
    let scenarios = scenarios![
        lost_lease_exit_status_and_basics,
        delete_stops_command_and_grandchildren,
        sigkilled_run_frees_the_target,
        restarted_run_adopts_its_lease,
        holder_name_in_a_pod_gets_the_lease,
        delete_while_waiting,
        sigterm_while_waiting_and_running,
        unreachable_api_server_stops_the_command,
        heartbeat_cost,
    ];
    run_suite("run", scenarios.to_vec());
}
