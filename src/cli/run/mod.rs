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
//! - The command runs in its own process group. A guard process (this binary, `__guard`, named
//!   `tl-guard`) holds the read end of a pipe whose write end only `run` holds: when `run` ends
//!   in any way, even by SIGKILL, the pipe closes and the guard kills the command's whole group
//!   and whatever carries its marks, so nothing the command started outlives `run`. The guard
//!   is in place and named before the command starts. The lease counts as lost when the TargetLease leaves Held,
//!   shows another token, starts being deleted or is gone, or when no heartbeat has been
//!   confirmed for [`Windows::term`]. Then the group gets SIGTERM, SIGKILL after `--grace`, and
//!   `run` exits with [`exit::LOST`] whatever the command returned.
//! - Whatever happens, the command's group is killed by [`Windows::kill`] after the send of the
//!   last heartbeat that the API server confirmed: strictly before the controller can count that
//!   heartbeat as stopped and hand the target to someone else. A `--grace` is cut at that bound.
//! - SIGTERM and SIGINT are handled by one listener from the start: while waiting they delete
//!   the TargetLease; while the command runs they are passed to its group, with the same grace
//!   and SIGKILL, and heartbeats go on meanwhile. `run` then exits with 128 + the signal.

mod args;
mod claim;
mod identity;
mod monitor;
mod procfs;
mod session;
mod supervise;
mod tree;
mod trust;

use std::process::ExitCode;
use std::time::Duration;

use kube::Api;
use kube::api::{DeleteParams, Preconditions};
use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tracing::{info, warn};

pub use self::args::RunArgs;
use self::claim::Claimed;
use self::identity::lease_name;
use self::monitor::{Heard, Monitor, heartbeat, listen_for_signals};
use self::session::{Holding, Session, held_token};
pub use self::supervise::{ExecArgs, GuardArgs};
use self::trust::Trust;
use super::client::{api_code, lease_client, refusal};
use super::exit;
use super::watch::watch_one;
use crate::api::heartbeat::STOPPED_ANNOTATION;
use crate::api::{MAX_TTL_SECONDS, TargetLease};

/// How waiting for the lease ended.
enum Waited {
    /// Held with this token, in this slot.
    Held(u64, u32),
    TimedOut,
    Deleted,
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
