//! `targetlease wait NAME`: blocks until the TargetLease is Held, prints its fencing token.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use kube::Api;
use kube::runtime::wait::await_condition;

use super::{kube_client, parse_duration};
use crate::api::{Phase, TargetLease};

/// Flags of `targetlease wait`.
#[derive(Debug, Args)]
pub struct WaitArgs {
    /// Name of the TargetLease.
    name: String,
    /// Namespace (default: the kubeconfig's or the pod's namespace).
    #[arg(long, short = 'n')]
    namespace: Option<String>,
    /// Give up after this long (exit status 1).
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    timeout: Duration,
}

/// Whether the lease is held: the condition `wait` and `run` wait for.
pub fn is_held(lease: Option<&TargetLease>) -> bool {
    lease
        .and_then(|l| l.status.as_ref())
        .is_some_and(|s| s.phase == Phase::Held && s.fencing_token.is_some())
}

impl WaitArgs {
    /// Waits and prints the token.
    pub async fn run(self) -> ExitCode {
        match self.wait().await {
            Ok(token) => {
                println!("{token}");
                ExitCode::SUCCESS
            }
            Err(message) => {
                eprintln!("targetlease wait: {message}");
                ExitCode::FAILURE
            }
        }
    }

    async fn wait(&self) -> Result<u64, String> {
        let (client, namespace) = kube_client(self.namespace.clone()).await?;
        let api: Api<TargetLease> = Api::namespaced(client, &namespace);
        let held = await_condition(api, &self.name, is_held);
        let lease = tokio::time::timeout(self.timeout, held)
            .await
            .map_err(|_| {
                format!(
                    "TargetLease {namespace}/{} was not Held within {:?}",
                    self.name, self.timeout
                )
            })?
            .map_err(|e| format!("watching TargetLease {namespace}/{}: {e}", self.name))?;
        lease
            .as_ref()
            .and_then(|l| l.status.as_ref())
            .and_then(|s| s.fencing_token)
            .ok_or_else(|| format!("TargetLease {namespace}/{} was deleted", self.name))
    }
}
