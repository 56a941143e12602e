//! The command line: one binary, one subcommand per use.

mod controller;
pub mod exit;
mod lease;
mod run;
mod valkey_args;
mod wait;
mod watch;

pub use valkey_args::{PASSWORD_ENV, ValkeyArgs};

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::telemetry::{self, LogFormat};

/// Exclusive, fenced leases on named targets, kept in Valkey and driven through Kubernetes.
#[derive(Debug, Parser)]
#[command(name = "targetlease", version = crate::build_info::LONG_VERSION, about)]
pub struct Cli {
    /// Log line format (logs go to stderr).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t,
        env = "TARGETLEASE_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the TargetLease controller.
    Controller(controller::ControllerArgs),
    /// Print the TargetLease CRD as YAML (or the chart's CRD template, or the API reference).
    Crd {
        /// Print the API reference (docs/reference/api.md) rendered from the CRD schema instead.
        #[arg(long, conflicts_with = "chart")]
        markdown: bool,
        /// Print the Helm chart's CRD template (charts/targetlease/templates/crd.yaml) instead.
        #[arg(long, conflicts_with = "storage_version")]
        chart: bool,
        /// The version the API server stores TargetLeases in (the chart's
        /// crds.storageVersion); see docs/install.md "Upgrading".
        #[arg(long, value_enum, default_value_t)]
        storage_version: crate::api::StorageVersion,
    },
    /// Rewrite every stored TargetLease in the CRD's storage version and record it as the only
    /// stored version (after a change of crds.storageVersion; see docs/install.md "Upgrading").
    MigrateStorage {
        /// Rewrite every TargetLease even when the CRD records one stored version: with several
        /// API servers, one that took the storage change late may have stored writes in the old
        /// version after an earlier run.
        #[arg(long)]
        rewrite_all: bool,
    },
    /// Wait until a TargetLease is Held and print its fencing token.
    Wait(wait::WaitArgs),
    /// Run a command under a lease (creates a TargetLease, waits, runs, releases).
    Run(run::RunArgs),
    /// Talk to the lease store directly: for operators debugging a target, and for tests.
    #[command(subcommand)]
    Lease(lease::LeaseCommand),
    /// Copy this binary to DIR/targetlease (an init container's job: an application image that
    /// lacks the binary gets it in a shared volume, to run under `targetlease run`).
    CopyBinary {
        /// The folder to copy it to.
        dir: std::path::PathBuf,
    },
    /// Internal: the guard `run` starts next to the command (see `targetlease run`).
    #[command(name = "__guard", hide = true)]
    Guard(run::GuardArgs),
    /// Internal: becomes `run`'s command, tied to `run`'s life (see `targetlease run`).
    #[command(name = "__exec", hide = true)]
    Exec(run::ExecArgs),
}

impl Cli {
    /// Runs the chosen subcommand and returns the process exit code.
    pub async fn run(self) -> ExitCode {
        telemetry::init(self.log_format);
        match self.command {
            Command::Controller(args) => args.run().await,
            Command::Crd { markdown: true, .. } => {
                print!("{}", crate::api::reference::markdown());
                ExitCode::SUCCESS
            }
            Command::Crd {
                chart,
                storage_version,
                ..
            } => match if chart {
                crate::api::chart_crd_template()
            } else {
                crate::api::crd_yaml(storage_version)
            } {
                Ok(yaml) => {
                    print!("{yaml}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("cannot render the CRD: {e}");
                    ExitCode::FAILURE
                }
            },
            Command::MigrateStorage { rewrite_all } => migrate_storage(rewrite_all).await,
            Command::Wait(args) => args.run().await,
            Command::Run(args) => args.run().await,
            Command::Guard(args) => args.run(),
            Command::Exec(args) => args.run(),
            Command::CopyBinary { dir } => copy_binary(&dir),
            Command::Lease(command) => command.run().await,
        }
    }
}

/// `targetlease copy-binary DIR`: this binary as DIR/targetlease, executable by everyone.
fn copy_binary(dir: &std::path::Path) -> ExitCode {
    use std::os::unix::fs::PermissionsExt;
    let to = dir.join("targetlease");
    let copied = std::env::current_exe()
        .and_then(|exe| std::fs::copy(exe, &to))
        .and_then(|_| std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)));
    match copied {
        Ok(()) => {
            println!("copied to {}", to.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cannot copy this binary to {}: {e}", to.display());
            ExitCode::FAILURE
        }
    }
}

/// `targetlease migrate-storage`: one line on stdout saying what was done.
async fn migrate_storage(rewrite_all: bool) -> ExitCode {
    let client = match kube_client(None).await {
        Ok((client, _)) => client,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::FAILURE;
        }
    };
    match crate::api::storage::migrate(&client, rewrite_all).await {
        Ok(done) => {
            if let Some(rewritten) = done.rewritten {
                println!(
                    "rewrote {rewritten} TargetLeases as {}; stored versions were [{}], now [{}]",
                    done.storage,
                    done.stored_before.join(", "),
                    done.storage
                );
            }
            if done.repaired > 0 {
                println!(
                    "moved the field managers of {} TargetLeases from a version no longer served \
                     to {}",
                    done.repaired, done.storage
                );
            }
            if done.rewritten.is_none() && done.repaired == 0 {
                println!(
                    "every TargetLease is stored as {}: nothing to do",
                    done.storage
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// A Kubernetes client and the namespace to use: `namespace`, else the kubeconfig's (or the
/// pod's) default.
pub async fn kube_client(namespace: Option<String>) -> Result<(kube::Client, String), String> {
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("cannot configure the Kubernetes client: {e}"))?;
    let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_owned());
    Ok((client, namespace))
}

/// [`kube_client`] for `run` and `wait`, after [`ensure_served`]: without it every call would
/// fail with a bare 404, and a workload image newer than the installed chart is the likely
/// cause.
pub async fn lease_client(namespace: Option<String>) -> Result<(kube::Client, String), String> {
    let (client, namespace) = kube_client(namespace).await?;
    ensure_served(&client).await?;
    Ok((client, namespace))
}

/// Checks that the API server serves the TargetLease version this binary speaks; the error says
/// to upgrade the chart (or the CRD) first.
pub async fn ensure_served(client: &kube::Client) -> Result<(), String> {
    use kube::Resource as _;
    let group_version = format!("{}/{}", crate::api::GROUP, crate::api::VERSION);
    let plural = crate::api::TargetLease::plural(&());
    // A CRD that was just updated is served a moment later: asked again for a few seconds.
    let deadline = tokio::time::Instant::now() + ENSURE_SERVED_PATIENCE;
    loop {
        let served = match client.list_api_group_resources(&group_version).await {
            Ok(list) => list.resources.iter().any(|r| r.name == plural),
            Err(kube::Error::Api(status)) if status.code == 404 => false,
            // Anything else (unreachable, forbidden) surfaces at the first real call.
            Err(_) => true,
        };
        if served {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!(
        "the API server does not serve {group_version} TargetLeases: install or upgrade the \
             targetlease chart (it serves {group_version} from 0.2.0 on; with crds.enabled=false, \
             apply this release's crds/ file) before this targetlease runs; see \
             docs/install.md, \"Upgrading\""
    ))
}

/// How long [`ensure_served`] waits for the API version to be served.
const ENSURE_SERVED_PATIENCE: Duration = Duration::from_secs(5);

/// A duration as flags write it (`30s`, `500ms`, `2m`), parsed by [`parse_duration`] and shown
/// the same way, so a flag's default is written once, as the `Duration` constant the rest of the
/// code uses (`default_value_t = Span(CONSTANT)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span(pub Duration);

impl std::str::FromStr for Span {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        parse_duration(text).map(Span)
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}s", d.as_secs_f64())
        }
    }
}

/// Parses a duration: a plain number is seconds; otherwise a number with `ms`, `s`, `m` or `h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (try 30, 30s, 500ms, 2m)"))?;
    let seconds = match unit {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use ms, s, m or h)"
            ));
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("{text:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_read_back_what_they_show() {
        for d in [
            Duration::from_secs(2),
            Duration::from_millis(50),
            Duration::from_millis(1500),
            Duration::from_secs(60),
            Duration::from_micros(1500),
        ] {
            let shown = Span(d).to_string();
            assert_eq!(shown.parse::<Span>(), Ok(Span(d)), "{shown}");
        }
        assert_eq!(Span(Duration::from_millis(50)).to_string(), "50ms");
        assert_eq!(Span(Duration::from_secs(2)).to_string(), "2s");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
