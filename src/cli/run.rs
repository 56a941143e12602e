//! `targetlease run --target T -- CMD ARGS...`: runs a command under a lease, as `consul lock`
//! does. Creates a TargetLease (owned by this pod when POD_NAME/POD_UID are set), waits until it
//! is Held, runs the command with the token in its environment, sends it SIGTERM if the lease is
//! lost, deletes the TargetLease when the command exits and exits with the command's status.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use futures::StreamExt;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::runtime::wait::await_condition;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::Command;
use tracing::{info, warn};

use super::controller::wait_for_signal;
use super::wait::is_held;
use super::{kube_client, parse_duration};
use crate::api::{HolderRef, Phase, TargetLease, TargetLeaseSpec};

/// Flags of `targetlease run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The target to lease.
    #[arg(long)]
    target: String,
    /// Who holds it (default: POD_NAME, else the host name).
    #[arg(long, env = "POD_NAME")]
    holder: Option<String>,
    /// Lease time-to-live.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    ttl: Duration,
    /// Namespace of the TargetLease (default: POD_NAMESPACE, else the kubeconfig's).
    #[arg(long, short = 'n', env = "POD_NAMESPACE")]
    namespace: Option<String>,
    /// Give up waiting for the lease after this long (exit status 75).
    #[arg(long, value_parser = parse_duration, default_value = "1h")]
    wait_timeout: Duration,
    /// How long the command gets between SIGTERM and SIGKILL after the lease is lost.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    grace: Duration,
    /// UID of the pod this runs in: the TargetLease is then owned by the pod (garbage-collected
    /// with it) and released as soon as the pod is gone.
    #[arg(long, env = "POD_UID")]
    pod_uid: Option<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Exit status when the lease was not obtained in time (EX_TEMPFAIL).
const EXIT_NOT_ACQUIRED: u8 = 75;

/// A DNS-1123 prefix for generateName, from a holder name.
fn name_prefix(holder: &str) -> String {
    let mut prefix: String = holder
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    prefix = prefix.trim_matches('-').to_owned();
    if prefix.is_empty() {
        prefix = "run".into();
    }
    format!("{prefix}-")
}

impl RunArgs {
    /// Runs the command under the lease.
    pub async fn run(self) -> ExitCode {
        match self.execute().await {
            Ok(code) => code,
            Err(message) => {
                eprintln!("targetlease run: {message}");
                ExitCode::FAILURE
            }
        }
    }

    fn new_lease(&self, holder: &str) -> TargetLease {
        let pod = self.pod_uid.as_ref().zip(self.holder.as_ref());
        let owner_references = pod.map(|(uid, name)| {
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
                generate_name: Some(name_prefix(holder)),
                owner_references,
                ..Default::default()
            },
            spec: TargetLeaseSpec {
                target: self.target.clone(),
                holder: holder.to_owned(),
                holder_ref: pod.map(|(_, name)| HolderRef {
                    kind: "Pod".into(),
                    name: name.clone(),
                }),
                ttl_seconds: u32::try_from(self.ttl.as_secs().max(1)).unwrap_or(u32::MAX),
                max_hold_seconds: None,
                release: false,
            },
            status: None,
        }
    }

    async fn execute(self) -> Result<ExitCode, String> {
        let (client, namespace) = kube_client(self.namespace.clone()).await?;
        let holder = self.holder.clone().unwrap_or_else(|| {
            hostname::get()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "run".into())
        });
        let api: Api<TargetLease> = Api::namespaced(client, &namespace);
        let created = api
            .create(&PostParams::default(), &self.new_lease(&holder))
            .await
            .map_err(|e| format!("cannot create a TargetLease in {namespace}: {e}"))?;
        let name = created.name_any();
        info!(%name, target = %self.target, "waiting for the lease");
        let outcome = self.hold_and_run(&api, &name, &holder).await;
        // Deleting the TargetLease releases the lease (through the controller's finalizer).
        if let Err(e) = api.delete(&name, &DeleteParams::default()).await {
            warn!(%name, error = %e, "could not delete the TargetLease; it will be released when its holder is gone or its lease expires");
        }
        outcome
    }

    async fn hold_and_run(
        &self,
        api: &Api<TargetLease>,
        name: &str,
        holder: &str,
    ) -> Result<ExitCode, String> {
        let held = tokio::select! {
            held = tokio::time::timeout(self.wait_timeout, await_condition(api.clone(), name, is_held)) => held,
            _ = wait_for_signal() => return Ok(ExitCode::from(130)),
        };
        let lease = match held {
            Err(_) => {
                eprintln!(
                    "targetlease run: lease on {} not obtained within {:?}",
                    self.target, self.wait_timeout
                );
                return Ok(ExitCode::from(EXIT_NOT_ACQUIRED));
            }
            Ok(Err(e)) => return Err(format!("watching TargetLease {name}: {e}")),
            Ok(Ok(None)) => return Err(format!("TargetLease {name} was deleted while waiting")),
            Ok(Ok(Some(lease))) => lease,
        };
        let token = lease
            .status
            .as_ref()
            .and_then(|s| s.fencing_token)
            .ok_or("the Held status carries no token")?;
        info!(%name, token, "lease held; starting the command");
        let (program, args) = self.command.split_first().ok_or("no command given")?;
        let mut child = Command::new(program)
            .args(args)
            .env("TARGETLEASE_TOKEN", token.to_string())
            .env("TARGETLEASE_OWNER", holder)
            .env("TARGETLEASE_TARGET", &self.target)
            .env("TARGETLEASE_NAME", name)
            .spawn()
            .map_err(|e| format!("cannot start {program}: {e}"))?;
        let pid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw);

        let lost = lease_lost(api.clone(), name.to_owned(), token);
        tokio::pin!(lost);
        let signal = wait_for_signal();
        tokio::pin!(signal);
        let mut terminated = false;
        let status = loop {
            tokio::select! {
                status = child.wait() => break status.map_err(|e| format!("waiting for {program}: {e}"))?,
                why = &mut lost, if !terminated => {
                    warn!(%name, "{why}; sending SIGTERM to the command");
                    terminated = true;
                    if let Some(pid) = pid {
                        let _ = kill(pid, Signal::SIGTERM);
                    }
                    let grace = self.grace;
                    let deadline = tokio::time::sleep(grace);
                    tokio::select! {
                        status = child.wait() => break status.map_err(|e| format!("waiting for {program}: {e}"))?,
                        _ = deadline => {
                            warn!("command still running {grace:?} after SIGTERM; killing it");
                            let _ = child.kill().await;
                        }
                    }
                }
                _ = &mut signal, if !terminated => {
                    terminated = true;
                    if let Some(pid) = pid {
                        let _ = kill(pid, Signal::SIGTERM);
                    }
                }
            }
        };
        Ok(exit_code(status))
    }
}

/// The command's exit status as ours: its code, or 128 + the signal that ended it.
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        (None, Some(sig)) => ExitCode::from(u8::try_from(128 + sig).unwrap_or(1)),
        _ => ExitCode::FAILURE,
    }
}

/// Resolves with a reason when the TargetLease stops holding the tenure with `token`: another
/// phase, another token, or the object is gone.
async fn lease_lost(api: Api<TargetLease>, name: String, token: u64) -> String {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher(api, config).default_backoff().applied_objects();
    tokio::pin!(stream);
    let mut seen = false;
    while let Some(item) = stream.next().await {
        let Ok(lease) = item else { continue };
        seen = true;
        let status = lease.status.as_ref();
        let phase = status.map(|s| s.phase);
        let current = status.and_then(|s| s.fencing_token);
        if phase != Some(Phase::Held) || current != Some(token) {
            return format!(
                "lease lost (phase {:?}, token {:?} instead of {token})",
                phase.unwrap_or_default(),
                current
            );
        }
    }
    if seen {
        "the TargetLease watch ended".into()
    } else {
        "the TargetLease is gone".into()
    }
}
