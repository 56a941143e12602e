//! `targetlease run` and `targetlease wait` end to end, on a real control plane and Valkey, with
//! the controller running: each scenario tries to make a command outlive its lease, or a lease
//! outlive its command. A missing control plane or server fails the suite; it never skips.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};
use targetlease_test_support::scenarios;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kube::ResourceExt;
use kube::api::Api;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use targetlease::api::{Phase, TargetLease};
use targetlease::store::LeaseStore;
use targetlease::store::valkey::keys::TargetKeys;
use tokio::process::{Child, Command};

use support::kube::{http_get, metric, phase_of, token_of};
use support::proxy::{Mode, Proxy};
use support::scenario::{SEC, Scenario, run_scenarios};

/// Exit statuses of `run` and `wait` (docs/reference/cli.md).
const EXIT_LOST: i32 = 76;
const EXIT_DELETED: i32 = 79;
const EXIT_SIGTERM: i32 = 143;

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
    loop {
        let running: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if running.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still running after {limit:?}: {running:?} of {pids:?}"
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
    let mut run = s
        .run_command(
            "deleted-target",
            &["--grace", "2s"],
            &family_script(dir.path()),
        )
        .spawn()
        .expect("run");
    let lease = s.run_lease("deleted-target", 30 * SEC, held).await;
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
        let mut command = s.run_command(&target, &["--ttl", "4s"], &family_script(dir.path()));
        if with_pod {
            let uid = pod(&s, "killed-pod").await;
            command.env("POD_NAME", "killed-pod").env("POD_UID", uid);
        }
        let mut run = command.spawn().expect("run");
        s.run_lease(&target, 30 * SEC, held).await;
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
    let mut first = s.run_command("restart-target", &[], &family_script(dir.path()));
    in_pod(&mut first);
    let mut first = first.spawn().expect("run");
    let held_before = s.run_lease("restart-target", 30 * SEC, held).await;
    let grandchild = pid_in(&dir.path().join("grandchild")).await;
    first.start_kill().expect("SIGKILL");
    let _ = first.wait().await;

    let marker = dir.path().join("second");
    let start = Instant::now();
    let mut second = s.run_command(
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
    let status = s
        .run_command(
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
    let mut run = s
        .run_command("busy-target", &["--wait-timeout", "1h"], "true")
        .spawn()
        .expect("run");
    let waiting = s
        .run_lease("busy-target", 30 * SEC, |l| {
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
    let mut run = s
        .run_command("term-target", &[], "true")
        .spawn()
        .expect("run");
    let waiting = s
        .run_lease("term-target", 30 * SEC, |l| {
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
    let mut run = s
        .run_command("term-running", &[], &script)
        .spawn()
        .expect("run");
    let lease = s.run_lease("term-running", 30 * SEC, held).await;
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

// 7. With the API server unreachable, `run` stops trusting its lease: the command (and a
//    grandchild that ignores SIGTERM) is dead before the controller may count the heartbeat as
//    stopped (half the TTL after it saw the last one), and `run` exits "lost".
async fn unreachable_api_server_stops_the_command(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let (_, api_port) = kubeconfig_via(&s, 0, dir.path());
    let proxy = Proxy::start(api_port).await;
    let (kubeconfig, _) = kubeconfig_via(&s, proxy.port, dir.path());
    let mut run = s
        .run_command(
            "cut-target",
            &["--ttl", "4s", "--grace", "1s"],
            &family_script(dir.path()),
        )
        .env("KUBECONFIG", &kubeconfig)
        .spawn()
        .expect("run");
    s.run_lease("cut-target", 30 * SEC, held).await;
    let child = pid_in(&dir.path().join("child")).await;
    let grandchild = pid_in(&dir.path().join("grandchild")).await;
    tokio::time::sleep(SEC).await;
    let start = Instant::now();
    proxy.set(Mode::Stall);
    // The last heartbeat the API server confirmed was sent before the stall, and the controller
    // cannot count its silence from any earlier: TTL/2 after the stall is a bound to spare.
    all_gone(
        &[child, grandchild],
        2 * SEC,
        "after the self-fencing bound",
    )
    .await;
    let took = start.elapsed();
    eprintln!("API server unreachable -> run stopped its command in {took:?}");
    // Not before one and a half heartbeats (TTL/6 each) could have failed.
    assert!(
        took >= Duration::from_millis(300),
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
    let status = s
        .run_command("run-target", &["--holder", "job-1"], &script)
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
    let status = s
        .run_command("run-target", &["--holder", "job-2"], "exit 3")
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
    let mut run = s
        .run_command("lost-target", &["--ttl", "3"], &script)
        .spawn()
        .expect("run");
    let lease = s.run_lease("lost-target", 30 * SEC, held).await;
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
// TTL 4 s for 6 s. Heartbeats come every TTL/6 (0.67 s) and each wakes one reconcile, which
// makes no store call; renewals come every TTL/3 on their own.
async fn heartbeat_cost(s: Scenario) {
    let mut run = s
        .run_command("beat-target", &["--ttl", "4s"], "sleep 9")
        .spawn()
        .expect("run");
    s.run_lease("beat-target", 30 * SEC, held).await;
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
    // A loose bound that catches a loop, not a speed: heartbeats (1.5/s) plus renewals (0.75/s).
    assert!(reconciles < 4.0, "{reconciles} reconciles/s");
    // Renewals keep their own schedule, whatever the heartbeats wake.
    assert!(
        (0.5..1.2).contains(&renewals),
        "{renewals} renewals/s at TTL 4 s"
    );
    // Heartbeats write no status; the only writes move expiresAt forward, each when one TTL is
    // left of a promise of four: one per 12 s, and one more that the 6 s window may catch at an
    // edge.
    assert!(
        writes <= 1.0 / 12.0 + 1.0 / window,
        "{writes} status writes/s: heartbeats must not write status"
    );
    assert_eq!(exits(&mut run, 30 * SEC).await, Some(0));
}

/// A command that records when it started (ns since the epoch, in DIR/NAME.start) and its pid
/// (DIR/NAME.pid), then loops; on SIGTERM it exits at once, or, with `ignore_term`, goes on until
/// SIGKILL.
fn recording_script(dir: &Path, name: &str, ignore_term: bool) -> String {
    let trap = if ignore_term {
        "trap '' TERM"
    } else {
        "trap 'exit 0' TERM"
    };
    format!(
        "{trap}; echo $$ > {d}/{name}.pid; date +%s%N > {d}/{name}.start; while :; do sleep 0.05; done",
        d = dir.display()
    )
}

/// When the command `recording_script` started as `name` recorded its start, once it did.
async fn started_at(dir: &Path, name: &str, limit: Duration) -> SystemTime {
    let path = dir.join(format!("{name}.start"));
    let deadline = Instant::now() + limit;
    loop {
        if let Some(ns) = std::fs::read_to_string(&path)
            .ok()
            .filter(|s| s.ends_with('\n'))
            .and_then(|s| s.trim().parse::<u64>().ok())
        {
            return UNIX_EPOCH + Duration::from_nanos(ns);
        }
        assert!(
            Instant::now() < deadline,
            "the command {name} did not start within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Watches `pid` every 5 ms and answers the first instant it was seen gone: never earlier than
/// its real end.
fn death_of(pid: i32) -> tokio::task::JoinHandle<SystemTime> {
    tokio::spawn(async move {
        while alive(pid) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        SystemTime::now()
    })
}

/// Seconds from `a` to `b` (negative when `b` is earlier).
/// Waits (up to `limit`) for the second command to start and for the first to end (`ended`),
/// prints both relative to `since` (what happened to the first: `what`), and asserts that the
/// second started only after the first ended. Returns when the first ended.
async fn assert_handed_over_after(
    what: &str,
    since: SystemTime,
    dir: &Path,
    limit: Duration,
    ended: tokio::task::JoinHandle<SystemTime>,
) -> SystemTime {
    let second_started = started_at(dir, "second", limit).await;
    let first_ended = tokio::time::timeout(30 * SEC, ended)
        .await
        .expect("the first command never ended")
        .expect("watch");
    eprintln!(
        "{what}: first command ended {:.2} s after it, second started {:.2} s after it",
        secs_between(since, first_ended),
        secs_between(since, second_started)
    );
    assert!(
        second_started > first_ended,
        "both commands ran for {:.2} s",
        secs_between(second_started, first_ended)
    );
    first_ended
}

fn secs_between(a: SystemTime, b: SystemTime) -> f64 {
    match b.duration_since(a) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// A second `run` on `target` that waits behind the first: in a pod of its own (another
/// TargetLease name than a `run` on this host), recording as `second` in `dir`.
async fn second_run(s: &Scenario, target: &str, ttl: &str, dir: &Path) -> Child {
    let uid = pod(s, &format!("{target}-second")).await;
    let run = s
        .run_command(
            target,
            &["--ttl", ttl],
            &recording_script(dir, "second", false),
        )
        .env("POD_NAME", format!("{target}-second"))
        .env("POD_UID", uid)
        .spawn()
        .expect("second run");
    s.run_lease(target, 30 * SEC, |l| {
        l.spec.holder.ends_with("-second") && phase_of(l) == Some(Phase::Waiting)
    })
    .await;
    // Two heartbeats, so the controller has seen it beat.
    tokio::time::sleep(3 * SEC).await;
    assert!(
        !dir.join("second.start").exists(),
        "the second command started while the first held the target"
    );
    run
}

// 7b. A `run` cut off from the API server stops its command before the controller can count its
//     heartbeat as stopped: a second `run` waiting for the same target starts its command only
//     after the first one's command ended.
async fn partitioned_run_stops_before_the_target_is_handed_over(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let (_, api_port) = kubeconfig_via(&s, 0, dir.path());
    let proxy = Proxy::start(api_port).await;
    let (kubeconfig, _) = kubeconfig_via(&s, proxy.port, dir.path());
    let mut first = s
        .run_command(
            "split-target",
            &["--ttl", "8s", "--grace", "1s"],
            &recording_script(dir.path(), "first", false),
        )
        .env("KUBECONFIG", &kubeconfig)
        .spawn()
        .expect("run");
    s.run_lease("split-target", 30 * SEC, held).await;
    let first_pid = pid_in(&dir.path().join("first.pid")).await;
    let mut second = second_run(&s, "split-target", "8s", dir.path()).await;
    let ended = death_of(first_pid);
    let cut = SystemTime::now();
    proxy.set(Mode::Stall);
    assert_handed_over_after("TTL 8 s, API server cut", cut, dir.path(), 30 * SEC, ended).await;
    assert_eq!(exits(&mut first, 30 * SEC).await, Some(EXIT_LOST));
    proxy.set(Mode::Pass);
    signal(&second, Signal::SIGTERM);
    assert_eq!(exits(&mut second, 15 * SEC).await, Some(EXIT_SIGTERM));
}

// 6b. SIGTERM to a `run` whose command takes its whole grace (longer than the TTL): heartbeats go
//     on meanwhile, so the lease is kept through the grace and handed over only after the
//     command was killed.
async fn long_grace_keeps_the_lease_until_the_command_ends(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let mut first = s
        .run_command(
            "grace-target",
            &["--ttl", "4s", "--grace", "12s"],
            &recording_script(dir.path(), "first", true),
        )
        .spawn()
        .expect("run");
    s.run_lease("grace-target", 30 * SEC, held).await;
    let first_pid = pid_in(&dir.path().join("first.pid")).await;
    let mut second = second_run(&s, "grace-target", "4s", dir.path()).await;
    let ended = death_of(first_pid);
    let stopped = SystemTime::now();
    signal(&first, Signal::SIGTERM);
    let what = "TTL 4 s, grace 12 s, SIGTERM";
    let first_ended = assert_handed_over_after(what, stopped, dir.path(), 40 * SEC, ended).await;
    // The grace was not cut: the API server kept confirming the lease.
    assert!(
        secs_between(stopped, first_ended) >= 11.5,
        "the command got {:.2} s of its 12 s grace",
        secs_between(stopped, first_ended)
    );
    assert_eq!(exits(&mut first, 15 * SEC).await, Some(EXIT_SIGTERM));
    signal(&second, Signal::SIGTERM);
    assert_eq!(exits(&mut second, 15 * SEC).await, Some(EXIT_SIGTERM));
}

// 3c. A second `run` for the same target on the same host but in another PID namespace (another
//     container) cannot see the first one's process: it must not take that for death. It waits,
//     signals nothing, and runs its command only once the first one is done.
async fn run_in_another_pid_namespace_does_not_adopt(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let mut first = s
        .run_command(
            "twin-target",
            &[],
            &recording_script(dir.path(), "first", false),
        )
        .spawn()
        .expect("run");
    let lease = s.run_lease("twin-target", 30 * SEC, held).await;
    let first_pid = pid_in(&dir.path().join("first.pid")).await;
    let mut twin = Command::new("unshare");
    twin.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_targetlease"))
        .args(["run", "-n", &s.ns, "--target", "twin-target", "--"])
        .args(["sh", "-c"])
        .arg(format!(
            "date +%s%N > {d}/twin.start; echo \"$TARGETLEASE_TOKEN\" > {d}/twin.token",
            d = dir.path().display()
        ))
        .envs(s.cluster.envs())
        .env_remove("POD_NAME")
        .env_remove("POD_UID")
        .env_remove("POD_NAMESPACE")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let mut twin = twin.spawn().expect("unshare");
    tokio::time::sleep(4 * SEC).await;
    assert!(
        !dir.path().join("twin.start").exists(),
        "the run in another PID namespace ran its command while the first one held the lease"
    );
    assert!(alive(first_pid), "the first command was killed");
    assert!(
        matches!(twin.try_wait(), Ok(None)),
        "the twin gave up instead of waiting"
    );
    let ended = death_of(first_pid);
    signal(&first, Signal::SIGTERM);
    assert_eq!(exits(&mut first, 15 * SEC).await, Some(EXIT_SIGTERM));
    let first_ended = ended.await.expect("watch");
    let twin_started = started_at(dir.path(), "twin", 30 * SEC).await;
    assert!(twin_started > first_ended);
    assert_eq!(exits(&mut twin, 30 * SEC).await, Some(0));
    let token: u64 = std::fs::read_to_string(dir.path().join("twin.token"))
        .expect("token")
        .trim()
        .parse()
        .expect("token");
    assert!(
        token > token_of(&lease),
        "{token} after {}",
        token_of(&lease)
    );
}

// 3d. After a controller restart (a failover), a claim that was released because its `run` died
//     does not take its target again: the new controller has never seen its heartbeat change,
//     which is no reason to give it a fresh silence window.
async fn dead_runs_claim_stays_released_after_a_controller_restart(mut s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let mut run = s
        .run_command("restart-ctl", &["--ttl", "8s"], &family_script(dir.path()))
        .spawn()
        .expect("run");
    let lease = s.run_lease("restart-ctl", 30 * SEC, held).await;
    run.start_kill().expect("SIGKILL");
    let _ = run.wait().await;
    s.wait_phase(&lease.name_any(), Phase::Released, 15 * SEC)
        .await;
    s.controller = None;
    s.controller = Some(s.start_controller(&[]));
    s.controller().wait_ready(30 * SEC);
    let deadline = Instant::now() + 3 * SEC;
    while Instant::now() < deadline {
        let now = s.get(&lease.name_any()).await;
        assert_ne!(
            phase_of(&now),
            Some(Phase::Held),
            "the dead run's claim took its target again after the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.apply("later", "restart-ctl", "later", "ttlSeconds: 8");
    s.wait_phase("later", Phase::Held, 2 * SEC).await;
}

// 3e. A `run` in a new container (another PID namespace) after its predecessor died there: it
//     cannot prove the death, so it waits until the controller released the old TargetLease for
//     its stopped heartbeat, then replaces it with one of its own; the old uid no longer writes.
async fn run_replaces_a_dead_twins_lease_once_released(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let mut twin = Command::new("unshare");
    twin.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_targetlease"))
        .args([
            "run", "-n", &s.ns, "--target", "reborn", "--ttl", "4s", "--",
        ])
        .args(["sh", "-c", "while :; do sleep 0.1; done"])
        .envs(s.cluster.envs())
        .env_remove("POD_NAME")
        .env_remove("POD_UID")
        .env_remove("POD_NAMESPACE")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let mut twin = twin.spawn().expect("unshare");
    let old = s.run_lease("reborn", 30 * SEC, held).await;
    twin.start_kill().expect("SIGKILL");
    let _ = twin.wait().await;
    let died = Instant::now();
    let marker = dir.path().join("token");
    let status = tokio::time::timeout(
        20 * SEC,
        s.run_command(
            "reborn",
            &["--ttl", "4s"],
            &format!("echo \"$TARGETLEASE_TOKEN\" > {}", marker.display()),
        )
        .status(),
    )
    .await
    .expect("the new run never got its lease")
    .expect("run");
    assert!(status.success(), "{status}");
    let took = died.elapsed();
    eprintln!("run in a new PID namespace after its twin died: ran after {took:?}");
    // Not before the controller released the dead twin's claim (half the 4 s TTL of silence).
    assert!(
        took >= 2 * SEC,
        "took over after {took:?}, before the release"
    );
    let token: u64 = std::fs::read_to_string(&marker)
        .expect("the command ran")
        .trim()
        .parse()
        .expect("token");
    assert!(token > token_of(&old));
    // A heartbeat of the dead twin (its uid) cannot land on a TargetLease of that name now.
    let mut retry = s
        .run_command("reborn", &["--ttl", "4s"], "sleep 30")
        .spawn()
        .expect("run");
    let new = s
        .run_lease("reborn", 30 * SEC, |l| {
            held(l) && l.metadata.deletion_timestamp.is_none() && l.uid() != old.uid()
        })
        .await;
    assert_eq!(new.name_any(), old.name_any());
    let stale = serde_json::json!({"metadata": {
        "uid": old.uid(),
        "annotations": {"targetlease.dev/heartbeat": "1"},
    }});
    let answer = s
        .api()
        .patch(
            &new.name_any(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&stale),
        )
        .await;
    match answer {
        // Only the code and reason in the failure message: the API server's quotes the uid.
        Err(kube::Error::Api(refusal)) => assert!(
            refusal.code == 422 && refusal.message.contains("metadata.uid"),
            "refused with {} {}",
            refusal.code,
            refusal.reason
        ),
        Err(e) => panic!("a patch with the old uid failed otherwise: {e}"),
        Ok(_) => panic!("a patch with the old uid was applied"),
    }
    signal(&retry, Signal::SIGTERM);
    assert_eq!(exits(&mut retry, 15 * SEC).await, Some(EXIT_SIGTERM));
}

// 3f. A controller restart (a failover) never releases a live `run`'s claim (the new controller
//     counts each heartbeat's silence from when it first sees it), and releases a `run` that died
//     while no controller ran within half the TTL of the new one's start.
async fn controller_restart_keeps_a_live_run_and_frees_a_dead_one(mut s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let mut run = s
        .run_command(
            "failover-target",
            &["--ttl", "4s"],
            &family_script(dir.path()),
        )
        .spawn()
        .expect("run");
    let lease = s.run_lease("failover-target", 30 * SEC, held).await;
    let child = pid_in(&dir.path().join("child")).await;
    s.controller = None;
    s.controller = Some(s.start_controller(&[]));
    s.controller().wait_ready(30 * SEC);
    // Three times the silence bound: the live run keeps its lease and its command.
    let deadline = Instant::now() + 6 * SEC;
    while Instant::now() < deadline {
        assert!(
            alive(child),
            "the live run's command was stopped by the restart"
        );
        assert!(
            held(&s.get(&lease.name_any()).await),
            "released by the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The run dies while no controller runs; the next one frees its target.
    s.controller = None;
    run.start_kill().expect("SIGKILL");
    let _ = run.wait().await;
    all_gone(&[child], 5 * SEC, "the killed run's command").await;
    s.apply("waiter", "failover-target", "waiter", "ttlSeconds: 4");
    s.controller = Some(s.start_controller(&[]));
    let started = Instant::now();
    s.wait_phase("waiter", Phase::Held, 10 * SEC).await;
    let took = started.elapsed();
    eprintln!("controller restarted after a run died -> waiter held in {took:?}");
    assert!(
        took <= 2 * SEC + 2 * SEC,
        "freed {took:?} after the restart"
    );
}

// Three `run --permits 2` of one target from one host (each its own --instance) at once: never
// more than two commands run together, the two running have distinct slots (TARGETLEASE_SLOT),
// and the third runs once a permit is free.
async fn runs_with_permits_never_exceed_them(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let d = dir.path().display().to_string();
    let mut runs = Vec::new();
    for i in 0..3 {
        let script = format!(
            "touch {d}/running-{i}; n=$(ls {d} | grep -c '^running-'); \
             echo \"{i} $TARGETLEASE_SLOT $n $TARGETLEASE_TOKEN\" >> {d}/log; sleep 2; rm {d}/running-{i}"
        );
        let instance = format!("i{i}");
        let extra = ["--permits", "2", "--instance", &instance];
        runs.push(
            s.run_command("permit-run", &extra, &script)
                .spawn()
                .expect("run"),
        );
    }
    for run in &mut runs {
        assert_eq!(exits(run, 60 * SEC).await, Some(0), "a run failed");
    }
    let log = std::fs::read_to_string(dir.path().join("log")).expect("the commands ran");
    let lines: Vec<Vec<u64>> = log
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|f| f.parse().expect("number"))
                .collect()
        })
        .collect();
    assert_eq!(lines.len(), 3, "{log}");
    for line in &lines {
        assert!(line[2] <= 2, "three commands ran together: {log}");
        assert!(line[1] < 2, "a slot beyond the permits: {log}");
    }
    assert_ne!(
        lines[0][1], lines[1][1],
        "the first two ran in one slot: {log}"
    );
    // The third got a token above both earlier ones.
    assert!(lines[2][3] > lines[0][3].max(lines[1][3]), "{log}");
}

/// The suite's scenarios, one at a time on one control plane.
pub fn suite(args: &Arguments) -> Conclusion {
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
        partitioned_run_stops_before_the_target_is_handed_over,
        long_grace_keeps_the_lease_until_the_command_ends,
        run_in_another_pid_namespace_does_not_adopt,
        dead_runs_claim_stays_released_after_a_controller_restart,
        run_replaces_a_dead_twins_lease_once_released,
        controller_restart_keeps_a_live_run_and_frees_a_dead_one,
        runs_with_permits_never_exceed_them,
        deleted_holder_is_dead_before_the_target_passes_on,
        released_holder_is_dead_before_the_target_passes_on,
        ttl_edit_never_hands_over_a_running_command,
        controller_outage_longer_than_the_ttl_never_overlaps,
        a_hidden_live_run_is_not_taken_for_dead,
        nothing_the_command_started_survives_run,
        the_guard_kills_its_group_and_the_marked_and_nothing_older,
        wait_follow_keeps_a_token_file_true,
    ];
    run_scenarios(args, scenarios.to_vec())
}

// The workload edge: every end of a `run`'s tenure waits for its command. Each scenario runs a
// holder whose command ignores SIGTERM (it is killed at the end of its grace) and a second
// `run` waiting for the same target, ends the first one's tenure one way, and asserts that the
// second command started only after the first one ended (the overlap, if any, is printed).

/// The first `run` on `target`, whose command ignores SIGTERM, with `ttl` and `grace`; once it
/// holds, the second one waits behind it. Answers both, the first's TargetLease and when its
/// command ends.
async fn holder_and_waiter(
    s: &Scenario,
    target: &str,
    ttl: &str,
    grace: &str,
    dir: &Path,
) -> (
    Child,
    Child,
    TargetLease,
    tokio::task::JoinHandle<SystemTime>,
) {
    let first = s
        .run_command(
            target,
            &["--ttl", ttl, "--grace", grace],
            &recording_script(dir, "first", true),
        )
        .spawn()
        .expect("run");
    let lease = s.run_lease(target, 30 * SEC, held).await;
    let first_pid = pid_in(&dir.join("first.pid")).await;
    let second = second_run(s, target, ttl, dir).await;
    (first, second, lease, death_of(first_pid))
}

/// Ends the test's `run`s.
async fn stop_both(mut first: Child, mut second: Child) {
    for run in [&mut first, &mut second] {
        if let Ok(None) = run.try_wait() {
            signal(run, Signal::SIGTERM);
        }
        let _ = exits(run, 20 * SEC).await;
    }
}

// 12a. `kubectl delete` of a running `run`'s TargetLease: the target passes on only once the
//      command (which ignores SIGTERM for its 3 s grace) is dead.
async fn deleted_holder_is_dead_before_the_target_passes_on(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let (first, second, lease, ended) =
        holder_and_waiter(&s, "edge-delete", "6s", "3s", dir.path()).await;
    let at = SystemTime::now();
    s.delete(&lease.name_any()).await;
    assert_handed_over_after(
        "delete (TTL 6 s, grace 3 s)",
        at,
        dir.path(),
        30 * SEC,
        ended,
    )
    .await;
    stop_both(first, second).await;
}

// 12b. `spec.release: true` on a running `run`'s TargetLease.
async fn released_holder_is_dead_before_the_target_passes_on(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let (first, second, lease, ended) =
        holder_and_waiter(&s, "edge-release", "6s", "3s", dir.path()).await;
    let at = SystemTime::now();
    let patch = serde_json::json!({"spec": {"release": true}});
    s.api()
        .patch(
            &lease.name_any(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .expect("release");
    assert_handed_over_after(
        "spec.release (TTL 6 s, grace 3 s)",
        at,
        dir.path(),
        30 * SEC,
        ended,
    )
    .await;
    stop_both(first, second).await;
}

// 12c. `spec.ttlSeconds` cut from 30 to 6 under a running `run` (heartbeat every 5 s): the
//      controller must not judge the old heartbeat by the new TTL, and the target never passes
//      on while the command runs; deleted afterwards, it passes on once the command is dead.
async fn ttl_edit_never_hands_over_a_running_command(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let (first, second, lease, ended) =
        holder_and_waiter(&s, "edge-ttl", "30s", "10s", dir.path()).await;
    let patch = serde_json::json!({"spec": {"ttlSeconds": 6}});
    s.api()
        .patch(
            &lease.name_any(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .expect("edit ttlSeconds");
    // Two of the old heartbeat intervals, four times the new silence bound.
    tokio::time::sleep(12 * SEC).await;
    let now = s.get(&lease.name_any()).await;
    assert_eq!(
        phase_of(&now),
        Some(Phase::Held),
        "the holder lost its lease to a TTL edit while its run was alive: {:?}",
        now.status
    );
    assert!(
        !dir.path().join("second.start").exists(),
        "the second command started after a TTL edit while the first ran"
    );
    let at = SystemTime::now();
    s.delete(&lease.name_any()).await;
    assert_handed_over_after(
        "delete after a TTL edit 30 s -> 6 s",
        at,
        dir.path(),
        40 * SEC,
        ended,
    )
    .await;
    stop_both(first, second).await;
}

// 12d. No controller for two TTLs (scaled to zero, a node drained): the store's lease expires
//      while the `run` goes on (the API server confirms its heartbeats against its Held status).
//      When a controller comes back, the waiter is granted only once the first command is dead.
async fn controller_outage_longer_than_the_ttl_never_overlaps(mut s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let (first, second, _, ended) =
        holder_and_waiter(&s, "edge-outage", "6s", "3s", dir.path()).await;
    s.controller = None;
    tokio::time::sleep(12 * SEC).await;
    let at = SystemTime::now();
    s.controller = Some(s.start_controller(&[]));
    let second_started = started_at(dir.path(), "second", 40 * SEC).await;
    let first_ended = tokio::time::timeout(30 * SEC, ended)
        .await
        .expect("the first command never ended")
        .expect("watch");
    eprintln!(
        "a controller back after 12 s (TTL 6 s, grace 3 s): first command ended {:.2} s after it, \
         second started {:.2} s after it",
        secs_between(at, first_ended),
        secs_between(at, second_started)
    );
    assert!(
        second_started > first_ended,
        "both commands ran for {:.2} s; controller log:\n{}",
        secs_between(second_started, first_ended),
        s.controller().logs()
    );
    stop_both(first, second).await;
}

// 12e. A second `run` of the same target on the same host, as another user whose /proc hides
//      the first (`hidepid=2`): it cannot read the first one's process, which proves nothing of
//      its death. It must neither adopt the TargetLease nor start its command beside the first.
async fn a_hidden_live_run_is_not_taken_for_dead(s: Scenario) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut first = s
        .run_command(
            "edge-hidden",
            &[],
            &recording_script(dir.path(), "first", false),
        )
        .spawn()
        .expect("run");
    let lease = s.run_lease("edge-hidden", 30 * SEC, held).await;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::copy(s.cluster.kubeconfig(), &kubeconfig).expect("kubeconfig");
    std::fs::set_permissions(&kubeconfig, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    // The binary where the other user can run it (and its guard and command starter with it).
    let binary = dir.path().join("targetlease");
    std::fs::copy(env!("CARGO_BIN_EXE_targetlease"), &binary).expect("copy the binary");
    let mut second = Command::new("unshare");
    second
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(
            "mount -t proc -o hidepid=2 proc /proc && exec setpriv --reuid=65534 --regid=65534 \
             --clear-groups \"$@\"",
        )
        .arg("sh")
        .arg(&binary)
        .args(["run", "-n", &s.ns, "--target", "edge-hidden"])
        .args(["--wait-timeout", "6s", "--"])
        .args(["sh", "-c"])
        .arg(format!(
            "date +%s%N > {}/second.start",
            dir.path().display()
        ))
        .envs(s.cluster.envs())
        .env("KUBECONFIG", &kubeconfig)
        .env("HOME", dir.path())
        .env_remove("POD_NAME")
        .env_remove("POD_UID")
        .env_remove("POD_NAMESPACE")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let mut second = second.spawn().expect("unshare");
    let code = exits(&mut second, 30 * SEC).await;
    assert!(
        !dir.path().join("second.start").exists(),
        "a run that could not read the first one's process adopted its TargetLease and ran beside it"
    );
    assert_eq!(code, Some(75), "not refused by its wait timeout");
    let now = s.get(&lease.name_any()).await;
    assert_eq!(now.uid(), lease.uid(), "the TargetLease was replaced");
    assert_eq!(phase_of(&now), Some(Phase::Held));
    assert!(
        alive(pid_in(&dir.path().join("first.pid")).await),
        "the first command was stopped"
    );
    signal(&first, Signal::SIGTERM);
    let _ = exits(&mut first, 20 * SEC).await;
}

/// The pids of the processes named `targetlease` in the process tree of `root` (itself
/// included).
fn named_targetlease_in_tree(root: i32) -> Vec<i32> {
    let mut pids = Vec::new();
    let mut next = vec![root];
    let entries: Vec<(i32, i32, String)> = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let name = stat[stat.find('(')? + 1..stat.rfind(')')?].to_owned();
            let ppid = stat[stat.rfind(')')? + 1..]
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid, name))
        })
        .collect();
    while let Some(pid) = next.pop() {
        if let Some((_, _, name)) = entries.iter().find(|(p, _, _)| *p == pid)
            && name == "targetlease"
        {
            pids.push(pid);
        }
        next.extend(
            entries
                .iter()
                .filter(|(_, pp, _)| *pp == pid)
                .map(|(p, _, _)| *p),
        );
    }
    pids
}

/// A command that records its pid, starts a writer that leaves its process group (`setsid`) and
/// ignores SIGTERM, records that one's pid, and then exits or loops (`then`).
fn escaping_script(dir: &Path, then: &str) -> String {
    format!(
        "for p in $(cat /proc/$PPID/task/*/children); do cat /proc/$p/comm; done > {d}/siblings 2>/dev/null; echo $$ > {d}/command.pid; setsid sh -c 'trap \"\" TERM; while :; do date +%s%N >> {d}/escaped.beat; sleep 0.05; done' </dev/null >/dev/null 2>&1 & echo $! > {d}/escaped.pid; {then}",
        d = dir.display()
    )
}

// 12f. Nothing the command started survives `run`: a writer that left the command's process
//      group (`setsid`) and ignores SIGTERM is killed when the command exits, and when every
//      process named `targetlease` of this `run` (run itself; its guard is named apart) is
//      killed with SIGKILL, the command dies with `run` and the writer with it.
async fn nothing_the_command_started_survives_run(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    // The command exits at once, its writer left behind.
    let mut run = s
        .run_command(
            "edge-escape",
            &["--grace", "1s"],
            &escaping_script(
                dir.path(),
                &format!(
                    "while [ ! -s {d}/escaped.beat ]; do sleep 0.01; done; exit 0",
                    d = dir.path().display()
                ),
            ),
        )
        .spawn()
        .expect("run");
    let escaped = pid_in(&dir.path().join("escaped.pid")).await;
    assert_eq!(exits(&mut run, 30 * SEC).await, Some(0));
    all_gone(&[escaped], 2 * SEC, "the setsid writer after run exited").await;

    // `pkill -9 targetlease`, for this `run`: its command and the writer die with it.
    let dir = tempfile::tempdir().expect("dir");
    let mut run = s
        .run_command(
            "edge-escape",
            &["--grace", "1s"],
            &escaping_script(dir.path(), "while :; do sleep 0.05; done"),
        )
        .spawn()
        .expect("run");
    let command = pid_in(&dir.path().join("command.pid")).await;
    let escaped = pid_in(&dir.path().join("escaped.pid")).await;
    // Read by the command as its first step: its guard was already there, and already named
    // apart, so no instant exists in which a `pkill targetlease` takes the guard with `run`.
    let siblings = std::fs::read_to_string(dir.path().join("siblings")).expect("siblings");
    let siblings: Vec<&str> = siblings.lines().map(str::trim).collect();
    assert!(
        siblings.contains(&"tl-guard") && !siblings.contains(&"targetlease"),
        "run's children when the command started: {siblings:?}"
    );
    let run_pid = run.id().and_then(|p| i32::try_from(p).ok()).expect("pid");
    let named = named_targetlease_in_tree(run_pid);
    assert!(named.contains(&run_pid), "{named:?}");
    for pid in &named {
        let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
    }
    let _ = exits(&mut run, 10 * SEC).await;
    all_gone(
        &[command, escaped],
        2 * SEC,
        "the command and its setsid writer after run and every process named targetlease got SIGKILL",
    )
    .await;
}

/// Starts `sleep 60` with the marks of TargetLease `name` and tenure `token` in its environment,
/// in a session of its own (`setsid`: out of every group but its own).
fn marked_sleeper(name: &str, token: &str) -> Child {
    Command::new("setsid")
        .args(["sleep", "60"])
        .env("TARGETLEASE_NAME", name)
        .env("TARGETLEASE_TOKEN", token)
        .kill_on_drop(true)
        .spawn()
        .expect("sleep")
}

fn pid_of(child: &Child) -> i32 {
    child.id().and_then(|p| i32::try_from(p).ok()).expect("pid")
}

/// Starts `targetlease __guard` for `name` and `token` and waits for its ready byte; answers it
/// with its name at that moment.
async fn ready_guard(name: &str, token: &str) -> (Child, String) {
    use tokio::io::AsyncReadExt;
    let mut guard = Command::new(env!("CARGO_BIN_EXE_targetlease"))
        .args(["__guard", "--name", name, "--token", token])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("guard");
    let mut byte = [0u8; 1];
    let read = guard
        .stdout
        .as_mut()
        .expect("stdout")
        .read(&mut byte)
        .await
        .expect("ready byte");
    assert_eq!(read, 1, "the guard exited before it said it was ready");
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", pid_of(&guard))).expect("comm");
    (guard, comm.trim().to_string())
}

// 12g. `run`'s guard, driven as `run` drives it: it is named `tl-guard` by the time it says it
//      is ready (`run` starts the command only then); when its pipe closes it kills the process
//      group it was told and whatever carries the command's marks and started after it, and
//      nothing that carries them but is older. Told no group (`run` died between starting the
//      guard and the command), it still kills whatever carries the marks and started after the
//      guard itself.
async fn the_guard_kills_its_group_and_the_marked_and_nothing_older(_s: Scenario) {
    use tokio::io::AsyncWriteExt;
    let name = format!("guard-trial-{}", std::process::id());
    let token = "7";
    for told_group in [true, false] {
        let older = marked_sleeper(&name, token);
        // Start times count in clock ticks (10 ms): this one is plainly older than the guard.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (mut guard, comm) = ready_guard(&name, token).await;
        assert_eq!(
            comm, "tl-guard",
            "the guard's name when it said it was ready"
        );
        // The command's group (unmarked: only the group tells) and a marked escapee.
        let group = Command::new("sleep")
            .arg("60")
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("group");
        let escaped = marked_sleeper(&name, token);
        let mut pipe = guard.stdin.take().expect("stdin");
        if told_group {
            pipe.write_all(format!("{}\n", pid_of(&group)).as_bytes())
                .await
                .expect("tell the group");
        }
        drop(pipe);
        assert_eq!(exits(&mut guard, 10 * SEC).await, Some(0));
        let mut gone = vec![pid_of(&escaped)];
        if told_group {
            gone.push(pid_of(&group));
        }
        all_gone(&gone, 2 * SEC, &format!("told the group: {told_group}")).await;
        assert!(
            alive(pid_of(&older)),
            "a marked process older than the guard was killed (told the group: {told_group})"
        );
        if !told_group {
            assert!(
                alive(pid_of(&group)),
                "a group it was never told was killed"
            );
        }
    }
}

/// The token `file` holds (`TARGETLEASE_TOKEN=...`), once `want` holds for it (`None`: the file
/// is absent), polled every 10 ms; answers how long that took.
async fn token_file_becomes(
    file: &Path,
    want: impl Fn(Option<u64>) -> bool,
    limit: Duration,
    what: &str,
) -> Duration {
    let started = Instant::now();
    loop {
        let token = std::fs::read_to_string(file).ok().and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("TARGETLEASE_TOKEN="))
                .and_then(|t| t.parse().ok())
        });
        if want(token) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "{what}: the token file still says {token:?} after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// 13. A long-running application that only fences follows its lease: `wait --follow` keeps a
//     token file true (the token while Held, no file otherwise) across a release, a new tenure
//     with a larger token and a deletion, until SIGTERM.
async fn wait_follow_keeps_a_token_file_true(s: Scenario) {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("lease");
    let mut follow = Command::new(env!("CARGO_BIN_EXE_targetlease"))
        .args(["wait", "follower", "-n", &s.ns, "--follow", "--token-file"])
        .arg(&file)
        .envs(s.cluster.envs())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("wait --follow");
    tokio::time::sleep(SEC).await;
    assert!(!file.exists(), "a token before there is a TargetLease");
    s.apply("follower", "follow-target", "app", "");
    let first = token_of(&s.wait_phase("follower", Phase::Held, 30 * SEC).await);
    let took = token_file_becomes(&file, |t| t == Some(first), 10 * SEC, "Held").await;
    eprintln!("token file written {took:?} after Held was seen");
    s.apply("follower", "follow-target", "app", "release: true");
    let took = token_file_becomes(&file, |t| t.is_none(), 10 * SEC, "released").await;
    eprintln!("token file removed {took:?} after the release was applied");
    s.apply("follower", "follow-target", "app", "release: false");
    let second = token_of(&s.wait_phase("follower", Phase::Held, 30 * SEC).await);
    assert!(second > first);
    token_file_becomes(&file, |t| t == Some(second), 10 * SEC, "held again").await;
    s.delete("follower").await;
    token_file_becomes(&file, |t| t.is_none(), 10 * SEC, "deleted").await;
    signal(&follow, Signal::SIGTERM);
    assert_eq!(exits(&mut follow, 10 * SEC).await, Some(EXIT_SIGTERM));
    assert!(!file.exists());
}
