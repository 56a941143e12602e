//! `targetlease wait NAME`: blocks until the TargetLease is Held and prints its fencing token
//! (with `--env`, its token and slot as shell assignments).
//! Survives watch errors (retried with backoff), resolves on deletion, never waits past its
//! timeout, and exits on SIGTERM/SIGINT; the exit statuses are in [`super::exit`].

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use futures::StreamExt;
use kube::Api;
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};

use super::watch::{Sighting, watch_one};
use super::{exit, lease_client, parse_duration};
use crate::api::{Phase, TargetLease};

/// Flags of `targetlease wait`.
#[derive(Debug, Args)]
pub struct WaitArgs {
    /// Name of the TargetLease (default: TARGETLEASE_NAME, which `targetlease run` gives its
    /// command: the TargetLease it runs under).
    #[arg(env = "TARGETLEASE_NAME")]
    name: String,
    /// Namespace (default: the kubeconfig's or the pod's namespace).
    #[arg(long, short = 'n')]
    namespace: Option<String>,
    /// Give up after this long (exit status 75).
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    timeout: Duration,
    /// Print `TARGETLEASE_TOKEN=<token>` and `TARGETLEASE_SLOT=<slot>` lines (for `eval`, or an
    /// env file) instead of the token alone; the slot is 0 for an exclusive lease.
    #[arg(long)]
    env: bool,
}

/// Whether the lease is held: Held with a token, and not being deleted.
pub fn is_held(lease: &TargetLease) -> bool {
    lease.metadata.deletion_timestamp.is_none()
        && lease
            .status
            .as_ref()
            .is_some_and(|s| s.phase == Phase::Held && s.fencing_token.is_some())
}

impl WaitArgs {
    /// Waits and prints the token (and the slot, with `--env`).
    pub async fn run(self) -> ExitCode {
        let (code, message) = match self.wait().await {
            Ok((token, slot)) if self.env => {
                println!("TARGETLEASE_TOKEN={token}\nTARGETLEASE_SLOT={slot}");
                (exit::OK, None)
            }
            Ok((token, _)) => {
                println!("{token}");
                (exit::OK, None)
            }
            Err((code, message)) => (code, Some(message)),
        };
        if let Some(message) = message {
            eprintln!("targetlease wait: {message}");
        }
        ExitCode::from(code)
    }

    async fn wait(&self) -> Result<(u64, u32), (u8, String)> {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return Err((exit::FAILURE, "cannot listen for SIGTERM/SIGINT".into()));
        };
        let (client, namespace) = lease_client(self.namespace.clone())
            .await
            .map_err(|m| (exit::FAILURE, m))?;
        let api: Api<TargetLease> = Api::namespaced(client, &namespace);
        let what = format!("TargetLease {namespace}/{}", self.name);
        let sightings = watch_one(api, &self.name);
        tokio::pin!(sightings);
        let deadline = tokio::time::sleep(self.timeout);
        tokio::pin!(deadline);
        // A TargetLease that does not exist yet (applied with the pod that waits for it) is
        // waited for; one that existed and is gone was deleted.
        let mut existed = false;
        loop {
            tokio::select! {
                _ = &mut deadline => {
                    return Err((exit::NOT_ACQUIRED, format!("{what} was not Held within {:?}", self.timeout)));
                }
                _ = term.recv() => return Err((exit::interrupted(Signal::SIGTERM as i32), "interrupted (SIGTERM)".into())),
                _ = int.recv() => return Err((exit::interrupted(Signal::SIGINT as i32), "interrupted (SIGINT)".into())),
                seen = sightings.next() => match seen {
                    Some(Sighting::Present(lease)) if lease.metadata.deletion_timestamp.is_some() => {
                        return Err((exit::DELETED, format!("{what} is being deleted")));
                    }
                    Some(Sighting::Present(lease)) => {
                        existed = true;
                        if is_held(&lease)
                            && let Some(status) = lease.status.as_ref()
                            && let Some(token) = status.fencing_token
                        {
                            return Ok((token, status.slot.unwrap_or(0)));
                        }
                    }
                    Some(Sighting::Gone) if existed => return Err((exit::DELETED, format!("{what} was deleted"))),
                    Some(Sighting::Gone) => {}
                    None => return Err((exit::FAILURE, format!("the watch of {what} ended"))),
                },
            }
        }
    }
}
