//! Supervising the command: its own process group, the guard that kills the group when `run`
//! ends in any way, SIGTERM and SIGKILL on a loss or a signal, the self-fencing bound, and the
//! reaping of whatever the command left in its group.

use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use clap::Args;
use kube::Api;
use kube::api::{Patch, PatchParams};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, sleep_until};
use tracing::{info, warn};

use super::identity::{COMMAND_ANNOTATION, describe_command};
use super::monitor::{Heard, Monitor};
use super::{Holding, RunArgs, lost_because, refusal};
use crate::api::TargetLease;
use crate::api::heartbeat::Windows;
use crate::cli::exit;

/// Why the command was stopped.
#[derive(Debug, Clone)]
pub(super) enum Stop {
    /// The lease was lost, for the reason given.
    Lost(String),
    /// `run` got this signal.
    Signal(Signal),
}

/// The loss of a `run` whose heartbeats went unconfirmed for too long.
pub(super) fn unconfirmed(windows: &Windows) -> Stop {
    Stop::Lost(format!(
        "no heartbeat confirmed for {:?}: past it the controller may count this run as gone",
        windows.term
    ))
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

/// The command's exit status as ours: its code, or 128 + the signal that ended it.
fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(exit::FAILURE),
        (None, Some(signal)) => exit::interrupted(signal),
        _ => exit::FAILURE,
    }
}

impl RunArgs {
    pub(super) async fn run_command(
        &self,
        api: &Api<TargetLease>,
        name: &str,
        holder: &str,
        held: Holding,
        windows: &Windows,
        mut monitor: Monitor,
    ) -> Result<u8, String> {
        let Holding { token, slot } = held;
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
