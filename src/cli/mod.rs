//! The command line: one binary, one subcommand per use.

mod client;
mod controller;
mod etcd_args;
pub mod exit;
mod flags;
mod lease;
mod reference;
mod run;
mod status;
mod store_args;
mod valkey_args;
mod wait;
mod watch;

use self::client::kube_client;
pub use self::flags::{Span, parse_duration};
pub use valkey_args::{PASSWORD_ENV, ValkeyArgs};

use std::process::ExitCode;

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
    /// Print the TargetLease CRD as YAML (or the chart's CRD template).
    Crd {
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
    /// Show who holds a target and who waits for it, in the order they will be served, from the
    /// API server alone (as kubectl's plugin: `kubectl targetlease status TARGET`).
    Status(status::StatusArgs),
    /// Talk to the lease store directly: for operators debugging a target, and for tests.
    #[command(subcommand)]
    Lease(lease::LeaseCommand),
    /// Print a page of the reference (docs/reference/), generated from the code and the chart.
    Reference {
        /// The page.
        page: reference::Page,
    },
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
            Command::Crd {
                chart,
                storage_version,
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
            Command::Status(args) => args.run().await,
            Command::Guard(args) => args.run(),
            Command::Exec(args) => args.run(),
            Command::Reference { page } => {
                print!("{}", page.render(&<Cli as clap::CommandFactory>::command()));
                ExitCode::SUCCESS
            }
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;
    use super::reference::Page;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn committed_reference_pages_match_the_code() {
        let command = Cli::command();
        let stale: Vec<String> = <Page as clap::ValueEnum>::value_variants()
            .iter()
            .filter(|page| {
                let path = format!(
                    "{}/docs/reference/{}",
                    env!("CARGO_MANIFEST_DIR"),
                    page.file()
                );
                std::fs::read_to_string(path).ok() != Some(page.render(&command))
            })
            .map(|page| {
                format!(
                    "cargo run -- reference {} > docs/reference/{}",
                    page.file().trim_end_matches(".md"),
                    page.file()
                )
            })
            .collect();
        assert!(stale.is_empty(), "stale reference pages; run: {stale:#?}");
    }
}
