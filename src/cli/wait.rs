//! `targetlease wait NAME`: blocks until the TargetLease is Held and prints its fencing token
//! (with `--env`, its token and slot as shell assignments).
//! Survives watch errors (retried with backoff), resolves on deletion, never waits past its
//! timeout, and exits on SIGTERM/SIGINT; the exit statuses are in [`super::exit`].
//!
//! With `--follow --token-file F` it never returns on its own: it keeps F holding the current
//! token and slot while the TargetLease is Held, and removes F the moment it is not (lost,
//! released, being deleted, gone), so that a long-running application that only fences reads
//! the token it may write with before each write, and writes nothing without one.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use futures::StreamExt;
use kube::Api;
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};

use super::client::lease_client;
use super::exit;
use super::flags::parse_duration;
use super::watch::{Sighting, watch_one};
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
    /// Never return: keep --token-file holding the current token and slot while Held, and
    /// remove it whenever the TargetLease is not (a sidecar of an application that fences).
    #[arg(long, requires = "token_file")]
    follow: bool,
    /// With --follow: the file that holds `TARGETLEASE_TOKEN=<token>` and
    /// `TARGETLEASE_SLOT=<slot>` lines while Held, written whole (a rename) at each new token,
    /// absent otherwise.
    #[arg(long, requires = "follow")]
    token_file: Option<std::path::PathBuf>,
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
    /// Waits and prints the token (and the slot, with `--env`); with `--follow`, follows.
    pub async fn run(self) -> ExitCode {
        if let (true, Some(file)) = (self.follow, self.token_file.clone()) {
            return self.follow(&file).await;
        }
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

/// What a Held status gives a follower: its token and slot, as an env file.
fn token_lines(lease: &TargetLease) -> Option<String> {
    if !is_held(lease) {
        return None;
    }
    let status = lease.status.as_ref()?;
    Some(format!(
        "TARGETLEASE_TOKEN={}\nTARGETLEASE_SLOT={}\n",
        status.fencing_token?,
        status.slot.unwrap_or(0)
    ))
}

/// Writes `text` to `file` whole: a reader sees the old content or the new one, never a part.
fn write_whole(file: &std::path::Path, text: &str) -> std::io::Result<()> {
    let mut partial = file.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, file)
}

/// Removes `file` if it is there.
fn remove(file: &std::path::Path) -> std::io::Result<()> {
    match std::fs::remove_file(file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

impl WaitArgs {
    /// `--follow`: keeps `file` true to the TargetLease until a signal (the file removed).
    async fn follow(&self, file: &std::path::Path) -> ExitCode {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            eprintln!("targetlease wait: cannot listen for SIGTERM/SIGINT");
            return ExitCode::from(exit::FAILURE);
        };
        // Nothing is known yet: no token.
        if let Err(e) = remove(file) {
            eprintln!("targetlease wait: cannot remove {}: {e}", file.display());
            return ExitCode::from(exit::FAILURE);
        }
        let (client, namespace) = match lease_client(self.namespace.clone()).await {
            Ok(found) => found,
            Err(message) => {
                eprintln!("targetlease wait: {message}");
                return ExitCode::from(exit::FAILURE);
            }
        };
        let api: Api<TargetLease> = Api::namespaced(client, &namespace);
        let what = format!("TargetLease {namespace}/{}", self.name);
        let sightings = watch_one(api, &self.name);
        tokio::pin!(sightings);
        let mut shown: Option<String> = None;
        let stopped = loop {
            let now = tokio::select! {
                _ = term.recv() => break Signal::SIGTERM,
                _ = int.recv() => break Signal::SIGINT,
                seen = sightings.next() => match seen {
                    Some(Sighting::Present(lease)) => token_lines(&lease),
                    Some(Sighting::Gone) => None,
                    None => None,
                },
            };
            if now == shown {
                continue;
            }
            let written = match &now {
                Some(lines) => write_whole(file, lines),
                None => remove(file),
            };
            if let Err(e) = written {
                // A file that cannot be kept true must not be left claiming a token.
                let _ = remove(file);
                eprintln!("targetlease wait: cannot update {}: {e}", file.display());
                return ExitCode::from(exit::FAILURE);
            }
            match &now {
                Some(lines) => println!("{what} is Held: {}", lines.replace('\n', " ").trim()),
                None => println!("{what} is not Held: no token"),
            }
            shown = now;
        };
        let _ = remove(file);
        ExitCode::from(exit::interrupted(stopped as i32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Phase, TargetLeaseStatus, test_spec};

    #[test]
    fn a_follower_shows_a_token_only_while_held() {
        let mut lease = TargetLease::new("l", test_spec("t", "w"));
        assert_eq!(token_lines(&lease), None);
        lease.status = Some(TargetLeaseStatus {
            phase: Phase::Held,
            fencing_token: Some(42),
            slot: Some(1),
            ..TargetLeaseStatus::default()
        });
        assert_eq!(
            token_lines(&lease).as_deref(),
            Some("TARGETLEASE_TOKEN=42\nTARGETLEASE_SLOT=1\n")
        );
        lease.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
        );
        assert_eq!(token_lines(&lease), None, "being deleted");
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("token");
        write_whole(&file, "TARGETLEASE_TOKEN=1\n").expect("write");
        assert_eq!(
            std::fs::read_to_string(&file).expect("read"),
            "TARGETLEASE_TOKEN=1\n"
        );
        remove(&file).expect("remove");
        remove(&file).expect("removing an absent file is fine");
        assert!(!file.exists());
    }
}
