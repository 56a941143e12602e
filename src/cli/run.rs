//! `targetlease run --target T -- CMD ARGS...`: runs a command under a lease, as `consul lock`
//! does, with two promises: the command never outlives its lease, and the lease never outlives
//! the command.
//!
//! - The TargetLease has a deterministic name per (pod or host, target). A `run` that finds one
//!   left by an incarnation of itself it can prove dead (same boot, same PID namespace, the
//!   process gone) adopts it, and kills what that incarnation's command left running (only
//!   processes that carry its TargetLease name and token), so a restarted `run` never waits
//!   behind itself; a live one is refused. One it cannot prove dead (another PID namespace or
//!   boot) is waited for like any other holder: until it is deleted, or released by the
//!   controller because its heartbeat stopped, and then replaced by a new one.
//! - While it waits and while the command runs, `run` refreshes the TargetLease's heartbeat
//!   annotation every sixth of the TTL; the controller releases a claim whose heartbeat stops for
//!   half the TTL, so a `run` killed with SIGKILL loses its lease within the TTL, with or without
//!   a pod. In a pod, holderRef names the pod (POD_NAME) with its uid (POD_UID) and the pod owns
//!   the TargetLease.
//! - The command runs in its own process group. A guard process (this binary, `__guard`) holds
//!   the read end of a pipe whose write end only `run` holds: when `run` ends in any way, even
//!   by SIGKILL, the pipe closes and the guard kills the command's whole group, so nothing the
//!   command started outlives `run`. The lease counts as lost when the TargetLease leaves Held,
//!   shows another token, starts being deleted or is gone, or when no heartbeat has been
//!   confirmed for [`Windows::term`]. Then the group gets SIGTERM, SIGKILL after `--grace`, and
//!   `run` exits with [`exit::LOST`] whatever the command returned.
//! - Whatever happens, the command's group is killed by [`Windows::kill`] after the send of the
//!   last heartbeat that the API server confirmed: strictly before the controller can count that
//!   heartbeat as stopped and hand the target to someone else. A `--grace` is cut at that bound.
//! - SIGTERM and SIGINT are handled by one listener from the start: while waiting they delete
//!   the TargetLease; while the command runs they are passed to its group, with the same grace
//!   and SIGKILL, and heartbeats go on meanwhile. `run` then exits with 128 + the signal.

use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use clap::Args;
use futures::{Stream, StreamExt};
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, ResourceExt};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{info, warn};

use super::watch::{Sighting, watch_one};
use super::{Span, exit, lease_client, parse_duration};
use crate::api::{HEARTBEAT_ANNOTATION, HolderRef, Phase, TargetLease, TargetLeaseSpec};
use crate::controller::heartbeat::{released_for_gone_holder, stale_after};

/// Annotation naming the `run` process that owns the TargetLease:
/// `<boot id> <pid namespace> <pid> <start>`.
const PROCESS_ANNOTATION: &str = "targetlease.dev/run-process";
/// Annotation naming the command's process group:
/// `<boot id> <pid namespace> <pgid> <start of its leader> <token>`.
const COMMAND_ANNOTATION: &str = "targetlease.dev/run-command";

/// How far apart the rates of `run`'s clock and the controller's may be, as a fraction: 1/100.
/// Monotonic clocks disciplined by NTP differ by at most 500 ppm; 1 % also covers a VM whose
/// clock is slewed harder.
const CLOCK_RATE_DIVISOR: u32 = 100;

/// How late `run` may act after its timer fires (scheduling, a loaded node), and the time a
/// SIGKILL takes to end a group: a twentieth of the TTL, at least 50 ms.
fn scheduling_margin(ttl: Duration) -> Duration {
    (ttl / 20).max(Duration::from_millis(50))
}

/// The trust windows of `run` for a lease of `ttl` and a `--grace`, each counted on `run`'s
/// monotonic clock from the moment it sent the last heartbeat the API server confirmed (the
/// controller counts a heartbeat's silence from when it sees it, which is later). The inequalities
/// they keep are written out in docs/internals/controller.md ("Trust windows") and tested below for
/// every TTL a TargetLease may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Windows {
    /// How often `run` writes its heartbeat.
    beat: Duration,
    /// SIGTERM to the command once no heartbeat sent this long ago is confirmed.
    term: Duration,
    /// SIGKILL to the command's group at this point, whatever the grace: the controller's
    /// silence bound, less the clock-rate margin and the scheduling margin.
    kill: Duration,
}

impl Windows {
    /// The windows for a lease of `ttl` (whole seconds, as the controller counts it) and a grace.
    pub(crate) fn new(ttl: Duration, grace: Duration) -> Self {
        // A sixth of the TTL: with the controller's silence bound at half of it, that leaves a
        // fifth of the TTL for the grace of a command whose heartbeats stopped.
        let beat = (ttl / 6).max(Duration::from_millis(250));
        let silence = stale_after(ttl);
        let kill = silence - silence / CLOCK_RATE_DIVISOR - scheduling_margin(ttl);
        // Never sooner than one and a half heartbeats: a heartbeat's reply may take half an
        // interval without the command being disturbed.
        let term = kill.saturating_sub(grace).max(beat + beat / 2);
        Self { beat, term, kill }
    }

    /// The grace the command gets when no heartbeat is confirmed: `--grace`, cut at the bound.
    fn silent_grace(&self) -> Duration {
        self.kill - self.term
    }
}

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
    /// How many holders the target admits at once (1 to 100; every claim on the target must
    /// ask the same value). The command gets its slot in TARGETLEASE_SLOT. Several `run`s of
    /// one target from one pod or host each need their own --instance.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::store::MAX_PERMITS)))]
    permits: u32,
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
    /// Which of several `run`s of this target from one pod or host this is (1 to 63 characters
    /// of a-z, 0-9 and '-'): each instance has its own TargetLease, kept across its restarts.
    /// Default: none (one `run` per target per pod or host).
    #[arg(long, value_parser = parse_instance)]
    instance: Option<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// The tenure the command runs under.
#[derive(Debug, Clone, Copy)]
struct Tenure {
    /// Its fencing token.
    token: u64,
    /// Its slot (0 for an exclusive lease).
    slot: u32,
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
    /// Held with this token, in this slot.
    Held(u64, u32),
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

/// The token and slot of a Held TargetLease that is not being deleted.
fn held_token(lease: &TargetLease) -> Option<(u64, u32)> {
    let status = lease.status.as_ref()?;
    let token = status.fencing_token?;
    let slot = status.slot.unwrap_or(0);
    lost_because(lease, token)
        .is_none()
        .then_some((token, slot))
}

/// This boot of the machine: pids and start times mean something only within one boot.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// This process's PID namespace (`pid:[inode]`): pids mean something only within one.
fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|p| p.into_os_string().into_string().ok())
        .unwrap_or_default()
}

/// The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses:
/// counted from the last ')'), so field N of the man page is index N - 3.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// When process `pid` started (clock ticks since boot, field 22 of /proc/PID/stat).
fn start_time(pid: i32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// `<boot id> <pid namespace> <pid> <start>` of a process of ours, for the annotations.
fn describe(pid: i32) -> String {
    format!(
        "{} {} {pid} {}",
        boot_id(),
        pid_namespace(),
        start_time(pid).unwrap_or(0)
    )
}

/// A process an annotation describes, when it is one this process can judge: same boot, same
/// PID namespace (a pid seen from anywhere else says nothing about it).
struct Described<'a> {
    pid: i32,
    start: u64,
    /// What follows the start time (the command's token).
    rest: Vec<&'a str>,
}

/// Parses `<boot id> <pid namespace> <pid> <start> ...`; `Err` says why it cannot be judged.
fn here(description: &str) -> Result<Described<'_>, &'static str> {
    let mut parts = description.split(' ');
    let (Some(boot), Some(ns), Some(pid), Some(start)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("it is recorded in a form this version cannot judge");
    };
    let (Ok(pid), Ok(start)) = (pid.parse(), start.parse()) else {
        return Err("it is recorded in a form this version cannot judge");
    };
    if boot.is_empty() || boot != boot_id() {
        return Err("it ran on another boot or another machine");
    }
    if ns.is_empty() || ns != pid_namespace() {
        return Err("it ran in another PID namespace (another container)");
    }
    Ok(Described {
        pid,
        start,
        rest: parts.collect(),
    })
}

/// What is known of the `run` that an annotation names.
#[derive(Debug, PartialEq)]
enum Predecessor {
    /// Provably dead: same boot and PID namespace, and its pid is gone or another process's.
    Dead,
    /// This very process.
    Me,
    /// Running.
    Alive,
    /// Nothing can be proven, for the reason given: it may be running.
    Unknown(&'static str),
}

/// Judges the `run` process `description` names (`None`: none is recorded).
fn predecessor(description: Option<&str>) -> Predecessor {
    let Some(description) = description else {
        return Predecessor::Unknown("no targetlease run process is recorded on it");
    };
    let process = match here(description) {
        Ok(process) => process,
        Err(why) => return Predecessor::Unknown(why),
    };
    if start_time(process.pid) != Some(process.start) {
        Predecessor::Dead
    } else if process.pid == std::process::id().cast_signed() {
        Predecessor::Me
    } else {
        Predecessor::Alive
    }
}

/// `<boot id> <pid namespace> <pgid> <start of its leader> <token>` of the command's group.
fn describe_command(pgid: i32, token: u64) -> String {
    format!("{} {token}", describe(pgid))
}

/// Whether process `pid` was started by a `run` of TargetLease `name` for the tenure `token`:
/// the command and everything it started inherit both in their environment (a process that
/// replaced its environment is not recognised, and is left alone).
fn started_for(pid: i32, name: &str, token: &str) -> bool {
    let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let want_name = format!("TARGETLEASE_NAME={name}");
    let want_token = format!("TARGETLEASE_TOKEN={token}");
    let vars: Vec<&[u8]> = environ.split(|b| *b == 0).collect();
    vars.contains(&want_name.as_bytes()) && vars.contains(&want_token.as_bytes())
}

/// Kills what is left of a dead incarnation's command, whose group `description` names: only
/// processes it can prove that incarnation started (same boot and PID namespace, in that group,
/// started after its leader, carrying TargetLease `name` and the tenure's token).
fn kill_leftovers(description: &str, name: &str) {
    let Ok(group) = here(description) else {
        return;
    };
    let Some(token) = group.rest.first().copied() else {
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
        let Some(fields) = stat_fields(pid) else {
            continue;
        };
        let pgid = fields.get(2).and_then(|g| g.parse::<i32>().ok());
        let start = fields.get(19).and_then(|s| s.parse::<u64>().ok());
        if pgid == Some(group.pid)
            && start.is_some_and(|s| s >= group.start)
            && started_for(pid, name, token)
        {
            warn!(
                pid,
                pgid = group.pid,
                "killing a process left by an earlier run's command"
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

/// An `--instance` name: it becomes part of a TargetLease name.
fn parse_instance(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(s.to_owned())
    } else {
        Err("an instance is 1 to 63 characters of a-z, 0-9 and '-'".into())
    }
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

/// A heartbeat the API server applied: when `run` sent it, and the TargetLease the reply showed.
#[derive(Clone)]
struct Beat {
    sent: Instant,
    lease: TargetLease,
}

/// What `run` hears about its TargetLease: the watch, its own heartbeat replies and signals.
struct Monitor {
    sightings: std::pin::Pin<Box<dyn Stream<Item = Sighting> + Send>>,
    /// The uid of the TargetLease this `run` made or adopted: another object of that name (one
    /// that replaced it) is not ours.
    uid: String,
    beats: watch::Receiver<Option<Beat>>,
    /// When the newest heartbeat the API server applied was sent (at first the create or the
    /// adoption, which wrote one): the controller cannot count its silence from any earlier.
    last_beat: Instant,
    signals: watch::Receiver<Option<Signal>>,
    /// Whether the signal was reported already: it is reported once.
    signalled: bool,
}

/// One thing `run` heard.
enum Heard {
    /// A version of the TargetLease from the watch.
    Lease(Box<TargetLease>),
    /// The reply to a heartbeat sent at `sent`.
    Beat {
        sent: Instant,
        lease: Box<TargetLease>,
    },
    Gone,
    Signal(Signal),
}

impl Monitor {
    async fn next(&mut self) -> Heard {
        loop {
            if !self.signalled
                && let Some(signal) = *self.signals.borrow_and_update()
            {
                self.signalled = true;
                return Heard::Signal(signal);
            }
            tokio::select! {
                seen = self.sightings.next() => match seen {
                    Some(Sighting::Present(lease)) if lease.uid().as_deref() == Some(&self.uid) => {
                        return Heard::Lease(lease);
                    }
                    Some(Sighting::Present(_) | Sighting::Gone) => return Heard::Gone,
                    // The watch never ends on its own; if it does, the heartbeat still confirms.
                    None => self.sightings = Box::pin(futures::stream::pending()),
                },
                changed = self.beats.changed() => match changed {
                    Ok(()) => if let Some(beat) = self.beats.borrow_and_update().clone() {
                        self.last_beat = self.last_beat.max(beat.sent);
                        return Heard::Beat { sent: beat.sent, lease: Box::new(beat.lease) };
                    },
                    // The heartbeat task ended: nothing confirms any more.
                    Err(_) => {
                        let (_, rx) = watch::channel(None);
                        self.beats = rx;
                    }
                },
                changed = self.signals.changed(), if !self.signalled => if changed.is_err() {
                    // The listener is gone: wait for the other sources only.
                    self.signalled = true;
                },
            }
        }
    }
}

/// How claiming the TargetLease ended.
enum Claimed {
    /// It is ours: its uid, when the heartbeat the create or the adoption wrote was sent, and
    /// the TTL its spec gives the controller.
    Ours {
        uid: String,
        sent: Instant,
        ttl_seconds: u32,
    },
    TimedOut,
    Interrupted(Signal),
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

    /// The TTL the TargetLease gets: whole seconds within the CRD's bounds, which is what the
    /// controller counts with, so every window of `run` derives from the same number.
    fn ttl_seconds(&self) -> u32 {
        u32::try_from(self.ttl.0.as_secs().clamp(1, 3600)).unwrap_or(3600)
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
                ttl_seconds: self.ttl_seconds(),
                permits: self.permits,
                max_hold_seconds: None,
                release: false,
                priority: None,
            },
            status: None,
        }
    }

    async fn execute(self, signals: watch::Receiver<Option<Signal>>) -> Result<u8, String> {
        let (client, namespace) = lease_client(self.namespace.clone()).await?;
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
        let (who, identity) = match &self.instance {
            Some(instance) => (
                format!("{who}-{instance}"),
                format!("{identity}/{instance}"),
            ),
            None => (who, identity),
        };
        let name = lease_name(&who, &identity, &self.target);
        let (uid, sent, ttl_seconds) = match self.claim(&api, &name, &holder, &signals).await? {
            Claimed::Ours {
                uid,
                sent,
                ttl_seconds,
            } => (uid, sent, ttl_seconds),
            Claimed::TimedOut => {
                eprintln!(
                    "targetlease run: TargetLease {namespace}/{name} stayed with another targetlease run for {:?}",
                    self.wait_timeout
                );
                return Ok(exit::NOT_ACQUIRED);
            }
            Claimed::Interrupted(signal) => return Ok(exit::interrupted(signal as i32)),
        };
        info!(%name, target = %self.target, "waiting for the lease");
        // An adopted TargetLease keeps its spec: the controller counts with its TTL if shorter.
        let ttl = Duration::from_secs(u64::from(self.ttl_seconds().min(ttl_seconds)));
        let windows = Windows::new(ttl, self.grace);
        if self.grace > windows.silent_grace() {
            info!(
                grace = ?self.grace,
                cut_to = ?windows.silent_grace(),
                "if the API server stops confirming the lease, the grace is cut to fit within it"
            );
        }

        let (beats_tx, beats) = watch::channel(None);
        let heartbeat = tokio::spawn(heartbeat(
            api.clone(),
            name.clone(),
            uid.clone(),
            windows.beat,
            sent,
            beats_tx,
        ));
        let mut monitor = Monitor {
            sightings: Box::pin(watch_one(api.clone(), &name)),
            uid: uid.clone(),
            beats,
            last_beat: sent,
            signals,
            signalled: false,
        };
        let code = match self.wait_until_held(&mut monitor, &windows).await {
            Waited::Held(token, slot) => {
                let held = Tenure { token, slot };
                self.run_command(&api, &name, &holder, held, &windows, monitor)
                    .await
            }
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
        // Only our own object: one that replaced it under the same name is someone else's.
        let limit = self.ttl.0.min(Duration::from_secs(10));
        let ours = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match tokio::time::timeout(limit, api.delete(&name, &ours)).await {
            Err(_) => {
                warn!(%name, "the API server did not answer the delete in time; the controller releases the lease when the heartbeat stops")
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) if matches!(api_code(&e), Some(404 | 409)) => {}
            Ok(Err(e)) => {
                warn!(%name, error = %refusal(&e), "could not delete the TargetLease; the controller releases it when the heartbeat stops")
            }
        }
        code
    }

    /// Creates the TargetLease, or adopts the one an incarnation of this `run` left when it can
    /// prove that incarnation dead; refuses when a live one in its own PID namespace holds it.
    /// One whose `run` cannot be judged (another PID namespace or boot: another container or
    /// machine under the same name) is waited for: until it is deleted, or the controller
    /// released it because its heartbeat stopped, and then replaced.
    async fn claim(
        &self,
        api: &Api<TargetLease>,
        name: &str,
        holder: &str,
        signals: &watch::Receiver<Option<Signal>>,
    ) -> Result<Claimed, String> {
        let deadline = Instant::now() + self.wait_timeout;
        let mut told = false;
        loop {
            if let Some(signal) = *signals.borrow() {
                return Ok(Claimed::Interrupted(signal));
            }
            let existing = api
                .get_opt(name)
                .await
                .map_err(|e| format!("cannot read TargetLease {name}: {e}"))?;
            let Some(existing) = existing else {
                let sent = Instant::now();
                match api
                    .create(&PostParams::default(), &self.new_lease(name, holder))
                    .await
                {
                    Ok(made) => return ours(&made, sent),
                    // Created by someone else in between: look again.
                    Err(e) if api_code(&e) == Some(409) => continue,
                    Err(e) => return Err(format!("cannot create TargetLease {name}: {e}")),
                }
            };
            if existing.spec.target != self.target {
                return Err(format!(
                    "TargetLease {name} exists for target {}, not {}",
                    existing.spec.target, self.target
                ));
            }
            let annotations = existing.metadata.annotations.clone().unwrap_or_default();
            let process = annotations.get(PROCESS_ANNOTATION).map(String::as_str);
            let judged = predecessor(process);
            if existing.metadata.deletion_timestamp.is_some() {
                // Being released: wait for it to go.
            } else if judged == Predecessor::Alive {
                return Err(format!(
                    "another targetlease run ({}) holds TargetLease {name} for target {}",
                    process.unwrap_or_default(),
                    self.target
                ));
            } else if let Predecessor::Unknown(why) = judged {
                if released_for_gone_holder(&existing) {
                    // No heartbeat for the controller's whole silence bound: that `run` stopped
                    // its command long ago. Replace the object (a new uid), so that even if it
                    // comes back it cannot take this one for its own.
                    info!(%name, "replacing the TargetLease an earlier run left, released since");
                    replace(api, name, &existing).await?;
                } else if !told {
                    warn!(%name, "waiting: another targetlease run may hold this TargetLease and cannot be proven dead ({why}); it is taken over once it is deleted or the controller releases it for a stopped heartbeat");
                    told = true;
                }
            } else {
                info!(%name, "adopting the TargetLease left by an earlier run");
                if let Some(command) = annotations.get(COMMAND_ANNOTATION) {
                    kill_leftovers(command, name);
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
                let sent = Instant::now();
                match api
                    .patch(name, &PatchParams::default(), &Patch::Merge(&adopt))
                    .await
                {
                    Ok(adopted) => return ours(&adopted, sent),
                    // Changed in between (the resourceVersion precondition): look again.
                    Err(e) if api_code(&e) == Some(409) => continue,
                    Err(e) => return Err(format!("cannot adopt TargetLease {name}: {e}")),
                }
            }
            if Instant::now() >= deadline {
                return Ok(Claimed::TimedOut);
            }
            sleep(Duration::from_millis(200)).await;
        }
    }

    async fn wait_until_held(&self, monitor: &mut Monitor, windows: &Windows) -> Waited {
        let deadline = Instant::now() + self.wait_timeout;
        loop {
            tokio::select! {
                _ = sleep_until(deadline) => return Waited::TimedOut,
                heard = monitor.next() => match heard {
                    Heard::Lease(lease) | Heard::Beat { lease, .. }
                        if lease.metadata.deletion_timestamp.is_some() =>
                    {
                        return Waited::Deleted;
                    }
                    // Started only while a recent heartbeat stands: the command must be able to
                    // run until the next one is due. Otherwise the next reply decides.
                    Heard::Lease(lease) | Heard::Beat { lease, .. } => {
                        if let Some((token, slot)) = held_token(&lease)
                            && Instant::now() < monitor.last_beat + windows.term
                        {
                            return Waited::Held(token, slot);
                        }
                    }
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
        held: Tenure,
        windows: &Windows,
        mut monitor: Monitor,
    ) -> Result<u8, String> {
        let Tenure { token, slot } = held;
        info!(%name, token, slot, "lease held; starting the command");
        let (program, args) = self.command.split_first().ok_or("no command given")?;
        let mut command = Command::new(program);
        command
            .args(args)
            .env("TARGETLEASE_TOKEN", token.to_string())
            .env("TARGETLEASE_SLOT", slot.to_string())
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
        let record = json!({"metadata": {
            "uid": monitor.uid,
            "annotations": {COMMAND_ANNOTATION: describe_command(pgid, token)},
        }});
        let (records, recorded) = (api.clone(), name.to_owned());
        tokio::spawn(async move {
            if let Err(e) = records
                .patch(&recorded, &PatchParams::default(), &Patch::Merge(&record))
                .await
            {
                warn!(name = %recorded, error = %refusal(&e), "could not record the command's process group");
            }
        });

        // The send of the newest heartbeat whose reply showed the lease Held with our token; the
        // one the wait ended on, at first.
        let mut confirmed = monitor.last_beat;
        let mut stop: Option<(Stop, Instant)> = None;
        let mut killed = false;
        let status = loop {
            let kill_by = confirmed + windows.kill;
            let term_at = confirmed + windows.term;
            let kill_at = stop
                .as_ref()
                .map_or(kill_by, |(_, graced)| (*graced).min(kill_by));
            let mut why = None;
            tokio::select! {
                status = child.wait() => break status.map_err(|e| format!("waiting for {program}: {e}"))?,
                heard = monitor.next() => match heard {
                    Heard::Beat { sent, lease } => match lost_because(&lease, token) {
                        None => confirmed = confirmed.max(sent),
                        Some(reason) => why = Some(Stop::Lost(reason)),
                    },
                    Heard::Lease(lease) => why = lost_because(&lease, token).map(Stop::Lost),
                    Heard::Gone => why = Some(Stop::Lost("the TargetLease was deleted".into())),
                    Heard::Signal(signal) => why = Some(Stop::Signal(signal)),
                },
                _ = sleep_until(term_at), if stop.is_none() => why = Some(unconfirmed(windows)),
                _ = sleep_until(kill_at), if !killed => {
                    warn!("killing the command's process group: its grace ended, or the lease can no longer be trusted");
                    let _ = killpg(group, Signal::SIGKILL);
                    killed = true;
                    // The SIGTERM bound can come at the same instant (no grace): still a loss.
                    if stop.is_none() {
                        stop = Some((unconfirmed(windows), Instant::now()));
                    }
                }
            }
            if let Some(why) = why
                && stop.is_none()
            {
                stop = Some((why.clone(), self.terminate(group, &why)));
            }
        };
        self.reap_group(group, &mut child, confirmed + windows.kill)
            .await;
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
    /// SIGKILL after the grace, or at `kill_by` (the self-fencing bound) if that comes first.
    /// Nothing it started survives `run`.
    async fn reap_group(&self, group: Pid, child: &mut Child, kill_by: Instant) {
        let _ = child.try_wait();
        if killpg(group, None).is_err() {
            return;
        }
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = (Instant::now() + self.grace).min(kill_by);
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

/// The loss of a `run` whose heartbeats went unconfirmed for too long.
fn unconfirmed(windows: &Windows) -> Stop {
    Stop::Lost(format!(
        "no heartbeat confirmed for {:?}: past it the controller may count this run as gone",
        windows.term
    ))
}

/// A TargetLease the API server answered as ours, its heartbeat sent at `sent`.
fn ours(lease: &TargetLease, sent: Instant) -> Result<Claimed, String> {
    let uid = lease
        .uid()
        .ok_or("the API server answered a TargetLease without a uid")?;
    Ok(Claimed::Ours {
        uid,
        sent,
        ttl_seconds: lease.spec.ttl_seconds.max(1),
    })
}

/// Deletes `existing` (only that object: its uid and resourceVersion as preconditions), for a
/// new TargetLease to take its name once it is gone.
async fn replace(api: &Api<TargetLease>, name: &str, existing: &TargetLease) -> Result<(), String> {
    let that = DeleteParams {
        preconditions: Some(Preconditions {
            uid: existing.uid(),
            resource_version: existing.resource_version(),
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &that).await {
        Ok(_) => Ok(()),
        // Changed or gone in between: the next look decides.
        Err(e) if matches!(api_code(&e), Some(404 | 409)) => Ok(()),
        Err(e) => Err(format!("cannot replace TargetLease {name}: {e}")),
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

/// Refreshes the heartbeat every `interval` after the one sent at `last` (counted from send to
/// send, each request bounded by the interval; a create that took long is followed by a beat at
/// once) and publishes each reply with the instant it was sent: it is also `run`'s confirmation
/// that it holds the lease. It never waits for the reader, so heartbeats go on however busy `run`
/// is. The patch names the uid: it fails on an object that replaced ours.
async fn heartbeat(
    api: Api<TargetLease>,
    name: String,
    uid: String,
    interval: Duration,
    last: Instant,
    replies: watch::Sender<Option<Beat>>,
) {
    let mut next = last + interval;
    loop {
        sleep_until(next).await;
        let sent = Instant::now();
        next = sent + interval;
        let beat = json!({"metadata": {
            "uid": uid,
            "annotations": {HEARTBEAT_ANNOTATION: now_millis().to_string()},
        }});
        let (params, beat) = (PatchParams::default(), Patch::Merge(&beat));
        match tokio::time::timeout(interval, api.patch(&name, &params, &beat)).await {
            Ok(Ok(lease)) => {
                if replies.send(Some(Beat { sent, lease })).is_err() {
                    return;
                }
            }
            Ok(Err(e)) => warn!(%name, error = %refusal(&e), "heartbeat failed; retrying"),
            Err(_) => warn!(%name, "heartbeat not answered within its interval; retrying"),
        }
    }
}

/// An error of a request that names the TargetLease's uid, for the log: the API server's own
/// message may quote the uid (the lease id), so a refusal is given by its code and reason only.
fn refusal(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => format!("{} {}", status.code, status.reason),
        other => other.to_string(),
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
    fn only_a_process_of_this_boot_and_pid_namespace_is_judged() {
        let me = describe(std::process::id().cast_signed());
        assert_eq!(predecessor(Some(&me)), Predecessor::Me, "{me}");
        let mut sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = i32::try_from(sleeper.id()).expect("pid");
        let alive = describe(pid);
        assert_eq!(predecessor(Some(&alive)), Predecessor::Alive, "{alive}");
        let start = start_time(pid).expect("start");
        let (boot, ns) = (boot_id(), pid_namespace());
        assert!(ns.starts_with("pid:["), "{ns}");
        // Same pid, another start time: the pid was reused, the process it named is gone.
        let reused = format!("{boot} {ns} {pid} {}", start + 1);
        assert_eq!(predecessor(Some(&reused)), Predecessor::Dead);
        // Evidence of absence from elsewhere proves nothing: another boot, another PID
        // namespace, the older form without a namespace, nothing recorded.
        for unknown in [
            format!("another-boot {ns} 999999 {start}"),
            format!("{boot} pid:[1] 999999 {start}"),
            format!("{boot} 999999 {start}"),
        ] {
            assert!(
                matches!(predecessor(Some(&unknown)), Predecessor::Unknown(_)),
                "{unknown}"
            );
        }
        assert!(matches!(predecessor(None), Predecessor::Unknown(_)));
        let _ = sleeper.kill();
        let _ = sleeper.wait();
        assert_eq!(predecessor(Some(&alive)), Predecessor::Dead);
    }

    #[test]
    fn leftovers_are_recognised_by_their_lease_name_and_token() {
        let mut ours = std::process::Command::new("sleep")
            .arg("30")
            .env("TARGETLEASE_NAME", "host-0123456789")
            .env("TARGETLEASE_TOKEN", "42")
            .spawn()
            .expect("sleep");
        let pid = i32::try_from(ours.id()).expect("pid");
        // Until the child has exec'd, its environment is still ours.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !started_for(pid, "host-0123456789", "42") {
            assert!(std::time::Instant::now() < deadline, "never recognised");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!started_for(pid, "host-0123456789", "43"));
        assert!(!started_for(pid, "other-0123456789", "42"));
        assert!(!started_for(
            std::process::id().cast_signed(),
            "host-0123456789",
            "42"
        ));
        let _ = ours.kill();
        let _ = ours.wait();
    }

    /// The inequalities of docs/internals/controller.md ("Trust windows"), for every TTL a
    /// TargetLease may have (1 s to 3600 s) and graces from none to an hour.
    #[test]
    fn the_command_is_dead_before_the_controller_may_release_it() {
        for seconds in 1..=3600u64 {
            let ttl = Duration::from_secs(seconds);
            let silence = stale_after(ttl);
            for grace in [0, 1, 10, 40, 3600].map(Duration::from_secs) {
                let w = Windows::new(ttl, grace);
                // SIGKILL, however late the scheduler lets it land, comes before the earliest
                // release even on a controller clock running 1 % fast.
                let latest_kill = w.kill + scheduling_margin(ttl);
                assert!(
                    latest_kill.as_secs_f64() * (1.0 + 1.0 / f64::from(CLOCK_RATE_DIVISOR))
                        <= silence.as_secs_f64() * (1.0 + 1e-9),
                    "ttl {ttl:?}: {w:?}"
                );
                // SIGTERM never before the next heartbeat's reply is due (half an interval of
                // latency allowed), and before the kill.
                assert!(
                    w.term >= w.beat + w.beat / 2 && w.term <= w.kill,
                    "{ttl:?} {w:?}"
                );
                // The grace is the one asked for, or what is left before the kill.
                assert_eq!(w.silent_grace(), grace.min(w.kill - (w.beat + w.beat / 2)));
                // A `run` killed right after a heartbeat loses its lease within the TTL.
                assert!(
                    w.beat + silence <= ttl + Duration::from_millis(250),
                    "{ttl:?}"
                );
            }
        }
        // Measured figures in the docs: TTL 8 s and 30 s with the default grace.
        let eight = Windows::new(Duration::from_secs(8), Duration::from_secs(10));
        assert_eq!(
            (eight.term.as_millis(), eight.kill.as_millis()),
            (1999, 3560)
        );
        let thirty = Windows::new(Duration::from_secs(30), Duration::from_secs(10));
        assert_eq!(
            (thirty.beat, thirty.term, thirty.kill),
            (
                Duration::from_secs(5),
                Duration::from_millis(7500),
                Duration::from_millis(13350)
            )
        );
    }
}
