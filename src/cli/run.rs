//! `targetlease run --target T -- CMD ARGS...`: runs a command under a lease, as `consul lock`
//! does, with two promises: the command never outlives its lease, and the lease never outlives
//! the command.
//!
//! - The TargetLease has a deterministic name per (pod or host, target). A `run` that finds one
//!   left by a dead incarnation of itself adopts it (and kills what that incarnation's command
//!   left running), so a restarted `run` never waits behind itself; a live one is refused.
//! - While it waits and while the command runs, `run` refreshes the TargetLease's heartbeat
//!   annotation every quarter of the TTL; the controller releases a claim whose heartbeat stops
//!   for half the TTL, so a `run` killed with SIGKILL loses its lease within the TTL, with or
//!   without a pod. In a pod, holderRef names the pod (POD_NAME) with its uid (POD_UID) and the
//!   pod owns the TargetLease.
//! - The command runs in its own process group. A guard process (this binary, `__guard`) holds
//!   the read end of a pipe whose write end only `run` holds: when `run` ends in any way, even
//!   by SIGKILL, the pipe closes and the guard kills the command's whole group, so nothing the
//!   command started outlives `run`. The lease counts as lost when the TargetLease leaves Held, shows another token, starts being
//!   deleted or is gone, or when `run` has had no confirmation that it is Held with its token for
//!   longer than the TTL (counted from the last API server answer that showed it). Then the
//!   group gets SIGTERM, SIGKILL after `--grace`, and `run` exits with [`exit::LOST`] whatever
//!   the command returned.
//! - SIGTERM and SIGINT are handled by one listener from the start: while waiting they delete
//!   the TargetLease; while the command runs they are passed to its group, with the same grace
//!   and SIGKILL. `run` then exits with 128 + the signal.

use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use clap::Args;
use futures::{Stream, StreamExt};
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{info, warn};

use super::watch::{Sighting, watch_one};
use super::{Span, exit, kube_client, parse_duration};
use crate::api::{HEARTBEAT_ANNOTATION, HolderRef, Phase, TargetLease, TargetLeaseSpec};

/// Annotation naming the `run` process that owns the TargetLease: `<boot id> <pid> <start>`.
const PROCESS_ANNOTATION: &str = "targetlease.dev/run-process";
/// Annotation naming the command's process group: `<boot id> <pgid> <start of its leader>`.
const COMMAND_ANNOTATION: &str = "targetlease.dev/run-command";

/// Flags of `targetlease run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The target to lease.
    #[arg(long)]
    target: String,
    /// Who holds it, as `spec.holder` shows it (default: the pod name, else the host name).
    /// Names the holder only; the pod is --pod-name.
    #[arg(long)]
    holder: Option<String>,
    /// The pod this runs in (the downward API's metadata.name): holderRef names it and it owns
    /// the TargetLease.
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,
    /// UID of that pod (the downward API's metadata.uid): a pod recreated under the same name is
    /// not the holder.
    #[arg(long, env = "POD_UID")]
    pod_uid: Option<String>,
    /// Lease time-to-live: also the longest `run` trusts its lease without a confirmation.
    #[arg(long, default_value_t = Span(crate::api::DEFAULT_TTL))]
    ttl: Span,
    /// Namespace of the TargetLease (default: POD_NAMESPACE, else the kubeconfig's).
    #[arg(long, short = 'n', env = "POD_NAMESPACE")]
    namespace: Option<String>,
    /// Give up waiting for the lease after this long (exit status 75).
    #[arg(long, value_parser = parse_duration, default_value = "1h")]
    wait_timeout: Duration,
    /// How long the command gets between SIGTERM and SIGKILL.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    grace: Duration,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Why the command was stopped.
#[derive(Debug, Clone)]
enum Stop {
    /// The lease was lost, for the reason given.
    Lost(String),
    /// `run` got this signal.
    Signal(Signal),
}

/// How waiting for the lease ended.
enum Waited {
    Held(u64),
    TimedOut,
    Deleted,
    Interrupted(Signal),
}

/// What a TargetLease says about the tenure with `token`: `None` while it holds it, else why not.
fn lost_because(lease: &TargetLease, token: u64) -> Option<String> {
    if lease.metadata.deletion_timestamp.is_some() {
        return Some("the TargetLease is being deleted".into());
    }
    let status = lease.status.as_ref();
    let phase = status.map(|s| s.phase);
    let current = status.and_then(|s| s.fencing_token);
    (phase != Some(Phase::Held) || current != Some(token)).then(|| {
        format!(
            "phase {:?} with token {current:?}, not Held with token {token}",
            phase.unwrap_or_default()
        )
    })
}

/// The token of a Held TargetLease that is not being deleted.
fn held_token(lease: &TargetLease) -> Option<u64> {
    let token = lease.status.as_ref()?.fencing_token?;
    lost_because(lease, token).is_none().then_some(token)
}

/// This boot of the machine: pids and start times mean something only within one boot.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// When process `pid` started (clock ticks since boot, field 22 of /proc/PID/stat).
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// `<boot id> <pid> <start>` of a process, for the annotations.
fn describe(pid: i32) -> String {
    format!("{} {pid} {}", boot_id(), start_time(pid).unwrap_or(0))
}

/// Parses `<boot id> <pid> <start>` into (pid, start) when it names a process of this boot.
fn this_boot(description: &str) -> Option<(i32, u64)> {
    let mut parts = description.split(' ');
    let (boot, pid, start) = (parts.next()?, parts.next()?, parts.next()?);
    (boot == boot_id()).then_some(())?;
    Some((pid.parse().ok()?, start.parse().ok()?))
}

/// Whether the process an annotation describes is still running (same pid, same start time).
fn still_running(description: &str) -> bool {
    this_boot(description).is_some_and(|(pid, start)| start_time(pid) == Some(start))
}

/// Kills what is left of a dead incarnation's command: every process in its group started
/// after the group's leader (so a recycled group id is not mistaken for it).
fn kill_leftovers(description: &str) {
    let Some((pgid, leader_start)) = this_boot(description) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let group = fields.get(2).and_then(|g| g.parse::<i32>().ok());
        let start = fields.get(19).and_then(|s| s.parse::<u64>().ok());
        if group == Some(pgid) && start.is_some_and(|s| s >= leader_start) {
            warn!(
                pid,
                pgid, "killing a process left by an earlier run's command"
            );
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// A DNS-1123 label fragment from a name.
fn label(name: &str) -> String {
    let fragment: String = name
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    let fragment = fragment.trim_matches('-');
    if fragment.is_empty() {
        "run".into()
    } else {
        fragment.to_owned()
    }
}

/// The TargetLease name of a `run` of `target` from `who` (the pod, or the host): the same for
/// every incarnation, so a restarted `run` finds what the previous one left.
fn lease_name(who: &str, identity: &str, target: &str) -> String {
    let digest = sha1_smol::Sha1::from(format!("{identity}\n{target}"))
        .digest()
        .to_string();
    format!("{}-{}", label(who), &digest[..10])
}

/// SIGTERM and SIGINT, whenever they come: one listener for the whole life of `run`.
fn listen_for_signals() -> watch::Receiver<Option<Signal>> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            warn!("cannot listen for SIGTERM/SIGINT");
            return;
        };
        loop {
            let got = tokio::select! {
                _ = term.recv() => Signal::SIGTERM,
                _ = int.recv() => Signal::SIGINT,
            };
            // Only the first one counts; later ones change nothing.
            if tx.borrow().is_none() {
                let _ = tx.send(Some(got));
            }
        }
    });
    rx
}

/// What `run` hears about its TargetLease: the watch, its own heartbeat replies and signals.
struct Monitor {
    sightings: std::pin::Pin<Box<dyn Stream<Item = Sighting> + Send>>,
    beats: mpsc::Receiver<TargetLease>,
    signals: watch::Receiver<Option<Signal>>,
}

/// One thing `run` heard.
enum Heard {
    Lease(Box<TargetLease>),
    Gone,
    Signal(Signal),
}

impl Monitor {
    async fn next(&mut self) -> Heard {
        loop {
            if let Some(signal) = *self.signals.borrow_and_update() {
                return Heard::Signal(signal);
            }
            tokio::select! {
                seen = self.sightings.next() => match seen {
                    Some(Sighting::Present(lease)) => return Heard::Lease(lease),
                    Some(Sighting::Gone) => return Heard::Gone,
                    // The watch never ends on its own; if it does, the heartbeat still confirms.
                    None => self.sightings = Box::pin(futures::stream::pending()),
                },
                beat = self.beats.recv() => if let Some(lease) = beat {
                    return Heard::Lease(Box::new(lease));
                },
                changed = self.signals.changed() => if changed.is_err() {
                    // The listener is gone: wait for the other sources only.
                    let (_, rx) = watch::channel(None);
                    self.signals = rx;
                },
            }
        }
    }
}

impl RunArgs {
    /// Runs the command under the lease.
    pub async fn run(self) -> ExitCode {
        let signals = listen_for_signals();
        match self.execute(signals).await {
            Ok(code) => ExitCode::from(code),
            Err(message) => {
                eprintln!("targetlease run: {message}");
                ExitCode::from(exit::FAILURE)
            }
        }
    }

    fn heartbeat_interval(&self) -> Duration {
        (self.ttl.0 / 4).max(Duration::from_millis(250))
    }

    fn new_lease(&self, name: &str, holder: &str) -> TargetLease {
        let pod = self.pod_name.as_ref();
        let owner_references = pod.zip(self.pod_uid.as_ref()).map(|(name, uid)| {
            vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: name.clone(),
                    uid: uid.clone(),
                    ..Default::default()
                },
            ]
        });
        TargetLease {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                owner_references,
                annotations: Some(
                    [
                        (HEARTBEAT_ANNOTATION.to_owned(), now_millis().to_string()),
                        (
                            PROCESS_ANNOTATION.to_owned(),
                            describe(std::process::id().cast_signed()),
                        ),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec: TargetLeaseSpec {
                target: self.target.clone(),
                holder: holder.to_owned(),
                holder_ref: pod.map(|name| HolderRef {
                    kind: "Pod".into(),
                    name: name.clone(),
                    uid: self.pod_uid.clone(),
                }),
                ttl_seconds: u32::try_from(self.ttl.0.as_secs().max(1)).unwrap_or(u32::MAX),
                max_hold_seconds: None,
                release: false,
                priority: None,
            },
            status: None,
        }
    }

    async fn execute(self, signals: watch::Receiver<Option<Signal>>) -> Result<u8, String> {
        let (client, namespace) = kube_client(self.namespace.clone()).await?;
        let host = hostname::get()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "run".into());
        let holder = self
            .holder
            .clone()
            .or_else(|| self.pod_name.clone())
            .unwrap_or_else(|| host.clone());
        let (who, identity) = match (&self.pod_name, &self.pod_uid) {
            (Some(pod), Some(uid)) => (pod.clone(), format!("pod-uid:{uid}")),
            (Some(pod), None) => (pod.clone(), format!("pod:{namespace}/{pod}")),
            (None, _) => (host.clone(), format!("host:{host}")),
        };
        let api: Api<TargetLease> = Api::namespaced(client, &namespace);
        let name = lease_name(&who, &identity, &self.target);
        self.claim(&api, &name, &holder).await?;
        info!(%name, target = %self.target, "waiting for the lease");

        let (beats_tx, beats) = mpsc::channel(4);
        let heartbeat = tokio::spawn(heartbeat(
            api.clone(),
            name.clone(),
            self.heartbeat_interval(),
            beats_tx,
        ));
        let mut monitor = Monitor {
            sightings: Box::pin(watch_one(api.clone(), &name)),
            beats,
            signals,
        };
        let code = match self.wait_until_held(&mut monitor).await {
            Waited::Held(token) => self.run_command(&api, &name, &holder, token, monitor).await,
            Waited::TimedOut => {
                eprintln!(
                    "targetlease run: lease on {} not obtained within {:?}",
                    self.target, self.wait_timeout
                );
                Ok(exit::NOT_ACQUIRED)
            }
            Waited::Deleted => {
                eprintln!(
                    "targetlease run: TargetLease {namespace}/{name} was deleted while waiting"
                );
                Ok(exit::DELETED)
            }
            Waited::Interrupted(signal) => {
                info!(%name, ?signal, "interrupted while waiting");
                Ok(exit::interrupted(signal as i32))
            }
        };
        heartbeat.abort();
        // Deleting the TargetLease releases the lease (through the controller's finalizer). It is
        // bounded: with the API server unreachable, the stopped heartbeat releases it instead.
        let limit = self.ttl.0.min(Duration::from_secs(10));
        match tokio::time::timeout(limit, api.delete(&name, &DeleteParams::default())).await {
            Err(_) => {
                warn!(%name, "the API server did not answer the delete in time; the controller releases the lease when the heartbeat stops")
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) if api_code(&e) == Some(404) => {}
            Ok(Err(e)) => {
                warn!(%name, error = %e, "could not delete the TargetLease; the controller releases it when the heartbeat stops")
            }
        }
        code
    }

    /// Creates the TargetLease, or adopts the one a dead incarnation of this `run` left; refuses
    /// when a live one holds it.
    async fn claim(&self, api: &Api<TargetLease>, name: &str, holder: &str) -> Result<(), String> {
        let deadline = Instant::now() + self.wait_timeout;
        loop {
            let existing = api
                .get_opt(name)
                .await
                .map_err(|e| format!("cannot read TargetLease {name}: {e}"))?;
            let Some(existing) = existing else {
                match api
                    .create(&PostParams::default(), &self.new_lease(name, holder))
                    .await
                {
                    Ok(_) => return Ok(()),
                    // Created by someone else in between: look again.
                    Err(e) if api_code(&e) == Some(409) => continue,
                    Err(e) => return Err(format!("cannot create TargetLease {name}: {e}")),
                }
            };
            if existing.metadata.deletion_timestamp.is_some() {
                // An earlier incarnation's TargetLease is being released: wait for it to go.
                if Instant::now() >= deadline {
                    return Err(format!("TargetLease {name} is still being deleted"));
                }
                sleep(Duration::from_millis(200)).await;
                continue;
            }
            if existing.spec.target != self.target {
                return Err(format!(
                    "TargetLease {name} exists for target {}, not {}",
                    existing.spec.target, self.target
                ));
            }
            let annotations = existing.metadata.annotations.clone().unwrap_or_default();
            if let Some(process) = annotations.get(PROCESS_ANNOTATION)
                && still_running(process)
                && this_boot(process).map(|(pid, _)| pid) != Some(std::process::id().cast_signed())
            {
                return Err(format!(
                    "another targetlease run ({process}) holds TargetLease {name} for target {}",
                    self.target
                ));
            }
            info!(%name, "adopting the TargetLease left by an earlier run");
            if let Some(command) = annotations.get(COMMAND_ANNOTATION) {
                kill_leftovers(command);
            }
            let adopt = json!({
                "metadata": {
                    "resourceVersion": existing.resource_version(),
                    "annotations": {
                        HEARTBEAT_ANNOTATION: now_millis().to_string(),
                        PROCESS_ANNOTATION: describe(std::process::id().cast_signed()),
                        COMMAND_ANNOTATION: null,
                    }
                }
            });
            match api
                .patch(name, &PatchParams::default(), &Patch::Merge(&adopt))
                .await
            {
                Ok(_) => return Ok(()),
                // Changed in between (the resourceVersion precondition): look again.
                Err(e) if api_code(&e) == Some(409) => continue,
                Err(e) => return Err(format!("cannot adopt TargetLease {name}: {e}")),
            }
        }
    }

    async fn wait_until_held(&self, monitor: &mut Monitor) -> Waited {
        let deadline = Instant::now() + self.wait_timeout;
        loop {
            tokio::select! {
                _ = sleep_until(deadline) => return Waited::TimedOut,
                heard = monitor.next() => match heard {
                    Heard::Lease(lease) if lease.metadata.deletion_timestamp.is_some() => {
                        return Waited::Deleted;
                    }
                    Heard::Lease(lease) => if let Some(token) = held_token(&lease) {
                        return Waited::Held(token);
                    },
                    Heard::Gone => return Waited::Deleted,
                    Heard::Signal(signal) => return Waited::Interrupted(signal),
                }
            }
        }
    }

    async fn run_command(
        &self,
        api: &Api<TargetLease>,
        name: &str,
        holder: &str,
        token: u64,
        mut monitor: Monitor,
    ) -> Result<u8, String> {
        info!(%name, token, "lease held; starting the command");
        let (program, args) = self.command.split_first().ok_or("no command given")?;
        let mut command = Command::new(program);
        command
            .args(args)
            .env("TARGETLEASE_TOKEN", token.to_string())
            .env("TARGETLEASE_OWNER", holder)
            .env("TARGETLEASE_TARGET", &self.target)
            .env("TARGETLEASE_NAME", name)
            // Its own group, so everything it starts can be signalled together.
            .process_group(0);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                eprintln!("targetlease run: cannot start {program}: {e}");
                return Ok(exit::CANNOT_RUN);
            }
        };
        let Some(pgid) = child.id().and_then(|id| i32::try_from(id).ok()) else {
            return Err(format!("{program} exited before it could be watched"));
        };
        let group = Pid::from_raw(pgid);
        // Held until `run` ends: its closing is the guard's signal.
        let _guard = match start_guard(pgid) {
            Ok(guard) => guard,
            Err(e) => {
                let _ = killpg(group, Signal::SIGKILL);
                return Err(format!("cannot start the guard of the command: {e}"));
            }
        };
        // Recorded for a restarted `run` to clean up after this one; in the background, so an
        // unreachable API server never delays watching the command.
        let record = json!({"metadata": {"annotations": {COMMAND_ANNOTATION: describe(pgid)}}});
        let (records, recorded) = (api.clone(), name.to_owned());
        tokio::spawn(async move {
            if let Err(e) = records
                .patch(&recorded, &PatchParams::default(), &Patch::Merge(&record))
                .await
            {
                warn!(name = %recorded, error = %e, "could not record the command's process group");
            }
        });

        let mut confirmed = Instant::now();
        let mut stop: Option<(Stop, Instant)> = None;
        let mut killed = false;
        let status = loop {
            let trust_until = confirmed + self.ttl.0;
            let grace_ends = stop.as_ref().map(|(_, at)| *at);
            tokio::select! {
                status = child.wait() => break status.map_err(|e| format!("waiting for {program}: {e}"))?,
                heard = monitor.next(), if stop.is_none() => {
                    let why = match heard {
                        Heard::Lease(lease) => match lost_because(&lease, token) {
                            None => {
                                confirmed = Instant::now();
                                None
                            }
                            Some(why) => Some(Stop::Lost(why)),
                        },
                        Heard::Gone => Some(Stop::Lost("the TargetLease was deleted".into())),
                        Heard::Signal(signal) => Some(Stop::Signal(signal)),
                    };
                    if let Some(why) = why {
                        stop = Some((why.clone(), self.terminate(group, &why)));
                    }
                }
                _ = sleep_until(trust_until), if stop.is_none() => {
                    let why = Stop::Lost(format!(
                        "no confirmation that the lease is held for {:?} (its TTL)", self.ttl.0
                    ));
                    stop = Some((why.clone(), self.terminate(group, &why)));
                }
                _ = sleep_until(grace_ends.unwrap_or(trust_until)), if grace_ends.is_some() && !killed => {
                    warn!("command still running {:?} after it was told to stop; killing its process group", self.grace);
                    let _ = killpg(group, Signal::SIGKILL);
                    killed = true;
                }
            }
        };
        self.reap_group(group, &mut child).await;
        Ok(match stop {
            Some((Stop::Lost(_), _)) => exit::LOST,
            Some((Stop::Signal(signal), _)) => exit::interrupted(signal as i32),
            None => exit_code(status),
        })
    }

    /// Tells the command's group to stop; answers when its grace ends.
    fn terminate(&self, group: Pid, why: &Stop) -> Instant {
        let signal = match why {
            Stop::Lost(reason) => {
                warn!("lease lost ({reason}); sending SIGTERM to the command");
                Signal::SIGTERM
            }
            Stop::Signal(signal) => {
                info!(?signal, "passing the signal to the command");
                *signal
            }
        };
        let _ = killpg(group, signal);
        Instant::now() + self.grace
    }

    /// After the command exited: whatever it started and left in its group gets SIGTERM, and
    /// SIGKILL after the grace. Nothing it started survives `run`.
    async fn reap_group(&self, group: Pid, child: &mut Child) {
        let _ = child.try_wait();
        if killpg(group, None).is_err() {
            return;
        }
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = Instant::now() + self.grace;
        while Instant::now() < deadline {
            if killpg(group, None).is_err() {
                return;
            }
            sleep(Duration::from_millis(50)).await;
        }
        warn!("processes the command started are still running after the grace; killing them");
        let _ = killpg(group, Signal::SIGKILL);
    }
}

/// Starts the guard of process group `pgid` and returns the write end of its pipe (with the
/// guard's handle): dropping it, or `run` ending, makes the guard kill the group.
fn start_guard(pgid: i32) -> std::io::Result<(Child, tokio::process::ChildStdin)> {
    let exe = std::env::current_exe()?;
    let mut guard = Command::new(exe)
        .args(["__guard", "--group", &pgid.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        // Its own group: a signal to the command's group or to `run`'s never reaches it.
        .process_group(0)
        .kill_on_drop(false)
        .spawn()?;
    let pipe = guard
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("the guard has no stdin"))?;
    Ok((guard, pipe))
}

/// Flags of the hidden `__guard` subcommand.
#[derive(Debug, Args)]
pub struct GuardArgs {
    /// The process group to kill when standard input closes.
    #[arg(long)]
    group: i32,
}

impl GuardArgs {
    /// Blocks until standard input closes (`run` ended, however), then kills what is left of
    /// the command's process group.
    pub fn run(self) -> ExitCode {
        use std::io::Read;
        // In a process group of its own, a Ctrl-C in the terminal does not reach it.
        let mut sink = [0u8; 64];
        while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
        if self.group > 1 && killpg(Pid::from_raw(self.group), None).is_ok() {
            let _ = killpg(Pid::from_raw(self.group), Signal::SIGKILL);
        }
        ExitCode::SUCCESS
    }
}

/// Refreshes the heartbeat every `interval` and hands each reply (the TargetLease as the API
/// server has it) to the monitor: it is also `run`'s confirmation that it holds the lease.
async fn heartbeat(
    api: Api<TargetLease>,
    name: String,
    interval: Duration,
    replies: mpsc::Sender<TargetLease>,
) {
    loop {
        sleep(interval).await;
        let beat =
            json!({"metadata": {"annotations": {HEARTBEAT_ANNOTATION: now_millis().to_string()}}});
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&beat))
            .await
        {
            Ok(lease) => {
                if replies.send(lease).await.is_err() {
                    return;
                }
            }
            Err(e) => warn!(%name, error = %e, "heartbeat failed; retrying"),
        }
    }
}

/// The HTTP status of an API server refusal.
fn api_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

fn now_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The command's exit status as ours: its code, or 128 + the signal that ended it.
fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(exit::FAILURE),
        (None, Some(signal)) => exit::interrupted(signal),
        _ => exit::FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_stable_per_identity_and_target() {
        let a = lease_name("web-0", "pod-uid:1", "db");
        assert_eq!(a, lease_name("web-0", "pod-uid:1", "db"));
        assert_ne!(a, lease_name("web-0", "pod-uid:2", "db"));
        assert_ne!(a, lease_name("web-0", "pod-uid:1", "db2"));
        assert!(
            a.starts_with("web-0-") && a.len() == "web-0-".len() + 10,
            "{a}"
        );
        assert!(lease_name("My_Laptop.local", "host:x", "t").starts_with("my-laptop-local-"));
    }

    #[test]
    fn this_process_is_running_and_a_made_up_one_is_not() {
        let me = describe(std::process::id().cast_signed());
        assert!(still_running(&me), "{me}");
        let (pid, start) = this_boot(&me).expect("this boot");
        assert!(!still_running(&format!(
            "{} {pid} {}",
            boot_id(),
            start + 1
        )));
        assert!(!still_running(&format!("another-boot {pid} {start}")));
    }
}
