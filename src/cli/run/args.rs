//! The flags of `targetlease run`.

use std::time::Duration;

use clap::Args;

use super::identity::parse_instance;
use crate::cli::flags::{Span, parse_duration};

/// Flags of `targetlease run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The target to lease.
    #[arg(long)]
    pub(super) target: String,
    /// Who holds it, as `spec.holder` shows it (default: the pod name, else the host name).
    /// Names the holder only; the pod is --pod-name.
    #[arg(long)]
    pub(super) holder: Option<String>,
    /// The pod this runs in (the downward API's metadata.name): holderRef names it and it owns
    /// the TargetLease.
    #[arg(long, env = "POD_NAME")]
    pub(super) pod_name: Option<String>,
    /// UID of that pod (the downward API's metadata.uid): a pod recreated under the same name is
    /// not the holder.
    #[arg(long, env = "POD_UID")]
    pub(super) pod_uid: Option<String>,
    /// How many holders the target admits at once (1 to 100; every claim on the target must
    /// ask the same value). The command gets its slot in TARGETLEASE_SLOT. Several `run`s of
    /// one target from one pod or host each need their own --instance.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::store::MAX_PERMITS)))]
    pub(super) permits: u32,
    /// Lease time-to-live: also the longest `run` trusts its lease without a confirmation.
    #[arg(long, default_value_t = Span(crate::api::DEFAULT_TTL))]
    pub(super) ttl: Span,
    /// Namespace of the TargetLease (default: POD_NAMESPACE, else the kubeconfig's).
    #[arg(long, short = 'n', env = "POD_NAMESPACE")]
    pub(super) namespace: Option<String>,
    /// Give up waiting for the lease after this long (exit status 75).
    #[arg(long, value_parser = parse_duration, default_value = "1h")]
    pub(super) wait_timeout: Duration,
    /// How long the command gets between SIGTERM and SIGKILL.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub(super) grace: Duration,
    /// Which of several `run`s of this target from one pod or host this is (1 to 63 characters
    /// of a-z, 0-9 and '-'): each instance has its own TargetLease, kept across its restarts.
    /// Default: none (one `run` per target per pod or host).
    #[arg(long, value_parser = parse_instance)]
    pub(super) instance: Option<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub(super) command: Vec<String>,
}
