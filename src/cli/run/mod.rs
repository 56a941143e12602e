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

mod claim;
mod identity;
mod monitor;
mod supervise;
mod tree;
mod trust;

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use kube::Api;
use kube::api::{DeleteParams, Preconditions};
use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tracing::{info, warn};

use self::claim::Claimed;
use self::identity::{lease_name, parse_instance};
use self::monitor::{Heard, Monitor, heartbeat, listen_for_signals};
pub use self::supervise::{ExecArgs, GuardArgs};
use self::trust::Trust;
use super::watch::watch_one;
use super::{Span, exit, lease_client, parse_duration};
use crate::api::heartbeat::STOPPED_ANNOTATION;
use crate::api::{MAX_TTL_SECONDS, Phase, TargetLease};

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

/// The tenure the command runs under, as its status showed it.
#[derive(Debug, Clone, Copy)]
struct Holding {
    /// Its fencing token.
    token: u64,
    /// Its slot (0 for an exclusive lease).
    slot: u32,
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
        let seconds = self.ttl.0.as_secs().clamp(1, u64::from(MAX_TTL_SECONDS));
        u32::try_from(seconds).unwrap_or(MAX_TTL_SECONDS)
    }

    async fn execute(self, signals: watch::Receiver<Option<Signal>>) -> Result<u8, String> {
        // Orphans of the command are re-parented here, so nothing it started gets away.
        tree::become_subreaper();
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
        // The TTL counted with is the TargetLease's (an adopted one keeps its spec), announced
        // in every heartbeat; an edit of it is followed (see `Trust`).
        let ttl = Duration::from_secs(u64::from(ttl_seconds));
        let trust = Trust::new(ttl, self.grace, sent);
        if self.grace > trust.silent_grace() {
            info!(
                grace = ?self.grace,
                cut_to = ?trust.silent_grace(),
                "if the API server stops confirming the lease, the grace is cut to fit within it"
            );
        }
        let (beats_tx, beats) = watch::channel(None);
        let (ttl_tx, ttl_rx) = watch::channel(ttl);
        let heartbeat = tokio::spawn(heartbeat(
            api.clone(),
            name.clone(),
            uid.clone(),
            ttl_rx,
            sent,
            beats_tx,
        ));
        let mut session = Session {
            monitor: Monitor {
                sightings: Box::pin(watch_one(api.clone(), &name)),
                uid: uid.clone(),
                beats,
                signals,
                signalled: false,
            },
            name: name.clone(),
            uid: uid.clone(),
            trust,
            ttl: ttl_tx,
            seen_token: None,
        };
        let (code, ran_under) = match self.wait_until_held(&mut session).await {
            Waited::Held(token, slot) => {
                let held = Holding { token, slot };
                let ran = self.run_command(&api, &holder, held, &mut session).await?;
                // Nothing to acknowledge while something it started may still run.
                (ran.code, ran.all_gone.then_some(token))
            }
            Waited::TimedOut => {
                eprintln!(
                    "targetlease run: lease on {} not obtained within {:?}",
                    self.target, self.wait_timeout
                );
                (exit::NOT_ACQUIRED, session.seen_token)
            }
            Waited::Deleted => {
                eprintln!(
                    "targetlease run: TargetLease {namespace}/{name} was deleted while waiting"
                );
                (exit::DELETED, session.seen_token)
            }
            Waited::Interrupted(signal) => {
                info!(%name, ?signal, "interrupted while waiting");
                (exit::interrupted(signal as i32), session.seen_token)
            }
        };
        heartbeat.abort();
        if let Some(token) = ran_under {
            self.acknowledge(&api, &name, &uid, token).await;
        }
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
        Ok(code)
    }

    /// Tells the controller that nothing started under the tenure `token` runs any more, so
    /// that it passes the target on at once (see `targetlease.dev/stopped`): bounded, and only on
    /// our own object. Without it, the controller waits out the bound by which this `run` must
    /// have killed its command.
    async fn acknowledge(&self, api: &Api<TargetLease>, name: &str, uid: &str, token: u64) {
        let patch = serde_json::json!({"metadata": {
            "uid": uid,
            "annotations": {STOPPED_ANNOTATION: token.to_string()},
        }});
        let params = kube::api::PatchParams::default();
        let patch = kube::api::Patch::Merge(&patch);
        let sent = api.patch(name, &params, &patch);
        let limit = self.ttl.0.min(Duration::from_secs(10));
        match tokio::time::timeout(limit, sent).await {
            Ok(Ok(_)) => info!(%name, token, "the command and everything it started are gone"),
            Ok(Err(e)) if matches!(api_code(&e), Some(404 | 409)) => {}
            Ok(Err(e)) => {
                warn!(%name, error = %refusal(&e), "could not tell the controller that the command stopped; it waits out its bound instead")
            }
            Err(_) => {
                warn!(%name, "the API server did not answer in time; the controller waits out its bound instead")
            }
        }
    }

    async fn wait_until_held(&self, session: &mut Session) -> Waited {
        let deadline = Instant::now() + self.wait_timeout;
        loop {
            tokio::select! {
                _ = sleep_until(deadline) => return Waited::TimedOut,
                heard = session.monitor.next() => match heard {
                    Heard::Lease(lease) | Heard::Beat { lease, .. }
                        if lease.metadata.deletion_timestamp.is_some() =>
                    {
                        session.saw(&lease);
                        return Waited::Deleted;
                    }
                    // Started only while a recent heartbeat stands: the command must be able to
                    // run until the next one is due. Otherwise the next reply decides.
                    heard @ (Heard::Lease(_) | Heard::Beat { .. }) => {
                        let lease = match heard {
                            Heard::Beat { sent, ttl, lease } => {
                                // Any applied heartbeat: the controller counts silence from it.
                                session.trust.confirm(sent, ttl);
                                lease
                            }
                            Heard::Lease(lease) => lease,
                            _ => continue,
                        };
                        session.saw(&lease);
                        session.follow(&lease);
                        if let Some((token, slot)) = held_token(&lease)
                            && Instant::now() < session.trust.term_at()
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
}

/// One `run`'s hold on its TargetLease: what it hears, how far it trusts the lease, and the TTL
/// its heartbeats announce.
struct Session {
    monitor: Monitor,
    name: String,
    uid: String,
    trust: Trust,
    ttl: watch::Sender<Duration>,
    /// The token of the last Held status seen while no command ran.
    seen_token: Option<u64>,
}

impl Session {
    /// Follows the TTL the TargetLease's spec asks (see [`Trust::follow`]).
    fn follow(&mut self, lease: &TargetLease) {
        let seconds = lease.spec.ttl_seconds.clamp(1, MAX_TTL_SECONDS);
        let wanted = Duration::from_secs(u64::from(seconds));
        if *self.ttl.borrow() != wanted {
            info!(name = %self.name, ttl = ?wanted, "ttlSeconds changed: following it");
            self.trust.follow(wanted, Instant::now());
            let _ = self.ttl.send(wanted);
        }
    }

    /// Remembers the token of a Held status seen while waiting.
    fn saw(&mut self, lease: &TargetLease) {
        if let Some(status) = lease.status.as_ref().filter(|s| s.phase == Phase::Held) {
            self.seen_token = status.fencing_token.or(self.seen_token);
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
