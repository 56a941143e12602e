//! Supervising the command: started through `__exec` (which makes it die with `run`, even by
//! SIGKILL: PR_SET_PDEATHSIG), in its own process group, with a guard that kills what it
//! started when `run` ends in any way; SIGTERM and SIGKILL to its whole tree ([`Tree`]) on a
//! loss or a signal and at the self-fencing bound ([`Trust`]); and, when it exits, the reaping
//! of everything it started, wherever that went.

use std::ffi::OsString;
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

use super::args::RunArgs;
use super::identity::{COMMAND_ANNOTATION, describe_command};
use super::monitor::Heard;
use super::procfs::start_time;
use super::session::{Holding, Session, lost_because};
use super::tree::{Tree, kill_marked};
use crate::api::TargetLease;
use crate::cli::client::refusal;
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
fn unconfirmed() -> Stop {
    Stop::Lost(
        "no heartbeat confirmed in time: past it the controller may count this run as gone".into(),
    )
}

/// How the command ended.
pub(super) struct Ran {
    /// `run`'s exit status.
    pub(super) code: u8,
    /// Whether nothing it started runs any more (what may be acknowledged to the controller).
    pub(super) all_gone: bool,
}

/// The guard of a command: a process of its own (`__guard`) that kills what the command started
/// when `run` ends in any way, even by SIGKILL (its pipe from `run` closes then).
struct Guard {
    process: Child,
    /// Its standard input: the command's process group is written on it; its closing (this
    /// dropped, or `run` gone) is the guard's signal.
    pipe: tokio::process::ChildStdin,
}

/// How long a guard may take to say it is in place.
const GUARD_READY_WITHIN: Duration = Duration::from_secs(10);

impl Guard {
    /// Starts the guard of the command that is about to run under TargetLease `name` and tenure
    /// `token`, and returns once it is in place: already named apart from `targetlease` (so that
    /// `pkill targetlease` never takes it with `run`) and watching its pipe. The command is
    /// started only after this: no instant exists in which it runs unguarded.
    async fn start(name: &str, token: u64) -> std::io::Result<Self> {
        use tokio::io::AsyncReadExt;
        let exe = std::env::current_exe()?;
        let mut process = Command::new(exe)
            .args(["__guard", "--name", name, "--token", &token.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            // Its own group: a signal to the command's group or to `run`'s never reaches it.
            .process_group(0)
            .kill_on_drop(false)
            .spawn()?;
        let pipe = process.stdin.take();
        let ready = process.stdout.take();
        let (Some(pipe), Some(mut ready)) = (pipe, ready) else {
            let _ = process.start_kill();
            return Err(std::io::Error::other("the guard has no pipes"));
        };
        let mut byte = [0u8; 1];
        match tokio::time::timeout(GUARD_READY_WITHIN, ready.read(&mut byte)).await {
            Ok(Ok(1)) => Ok(Self { process, pipe }),
            outcome => {
                let _ = process.start_kill();
                Err(std::io::Error::other(match outcome {
                    Err(_) => format!("it did not say it was ready within {GUARD_READY_WITHIN:?}"),
                    Ok(Err(e)) => e.to_string(),
                    Ok(Ok(_)) => "it exited before it was ready".into(),
                }))
            }
        }
    }

    /// Tells the guard the command's process group.
    async fn watch(&mut self, pgid: i32) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        self.pipe.write_all(format!("{pgid}\n").as_bytes()).await?;
        self.pipe.flush().await
    }

    /// The guard's pid (which signals to the command's tree must spare).
    fn pid(&self) -> Option<i32> {
        self.process.id().and_then(|id| i32::try_from(id).ok())
    }
}

/// Flags of the hidden `__guard` subcommand.
#[derive(Debug, Args)]
pub struct GuardArgs {
    /// The TargetLease the command runs under (in its environment).
    #[arg(long)]
    name: String,
    /// The token of the tenure it runs under (in its environment).
    #[arg(long)]
    token: u64,
}

impl GuardArgs {
    /// Says it is ready (one byte on standard output), reads the command's process group from
    /// standard input and blocks until that closes (`run` ended, however); then kills what is
    /// left of the command: its process group, and whatever carries its TargetLease and token
    /// and started after it (a descendant that left the group). If `run` ended before it said
    /// which group, whatever carries the marks and started after the guard is killed.
    pub fn run(self) -> ExitCode {
        use std::io::{Read, Write};
        // Named apart from `targetlease`, so that `pkill targetlease` does not take the guard
        // down with `run`; before it says it is ready, so that the name is in place before the
        // command starts.
        if let Ok(name) = std::ffi::CString::new("tl-guard") {
            let _ = nix::sys::prctl::set_name(&name);
        }
        let me = i32::try_from(std::process::id()).unwrap_or(0);
        let guard_started = start_time(me).unwrap_or(0);
        let mut stdout = std::io::stdout();
        if stdout
            .write_all(b"r")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return ExitCode::from(exit::FAILURE);
        }
        // In a process group of its own, a Ctrl-C in the terminal does not reach it.
        let mut said = Vec::new();
        let mut sink = [0u8; 64];
        while let Ok(n @ 1..) = std::io::stdin().read(&mut sink) {
            if said.len() < 32 {
                said.extend_from_slice(&sink[..n]);
            }
        }
        let group = std::str::from_utf8(&said)
            .ok()
            .and_then(|text| text.lines().next()?.trim().parse::<i32>().ok())
            .filter(|group| *group > 1);
        let started = match group {
            Some(group) => {
                let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
                start_time(group).unwrap_or(guard_started)
            }
            None => guard_started,
        };
        kill_marked(&self.name, &self.token.to_string(), started);
        ExitCode::SUCCESS
    }
}

/// Flags of the hidden `__exec` subcommand.
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The process that must be alive: `run`.
    #[arg(long)]
    parent: i32,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

impl ExecArgs {
    /// Becomes the command, set to be killed when `run` dies (PR_SET_PDEATHSIG survives exec).
    pub fn run(self) -> ExitCode {
        use std::os::unix::process::CommandExt;
        if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
            eprintln!("targetlease run: cannot tie the command to run's life: {e}");
        }
        // `run` may have died before the tie was made: then nothing would kill the command.
        if nix::unistd::getppid().as_raw() != self.parent {
            return ExitCode::from(exit::interrupted(Signal::SIGKILL as i32));
        }
        let Some((program, args)) = self.command.split_first() else {
            return ExitCode::from(exit::CANNOT_RUN);
        };
        let error = std::process::Command::new(program).args(args).exec();
        eprintln!(
            "targetlease run: cannot start {}: {error}",
            program.to_string_lossy()
        );
        ExitCode::from(exit::CANNOT_RUN)
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
    /// Runs the command under the tenure `held` until it exits, the lease is lost or a signal
    /// comes; everything it started is gone when this returns, or as much as can be killed.
    pub(super) async fn run_command(
        &self,
        api: &Api<TargetLease>,
        holder: &str,
        held: Holding,
        session: &mut Session,
    ) -> Result<Ran, String> {
        let Holding { token, slot } = held;
        let name = session.name.clone();
        info!(%name, token, slot, "lease held; starting the command");
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find this program to start the command: {e}"))?;
        let parent = std::process::id().to_string();
        // Held until `run` ends: its closing is the guard's signal.
        let mut guard = Guard::start(&name, token)
            .await
            .map_err(|e| format!("cannot start the guard of the command: {e}"))?;
        let mut command = Command::new(exe);
        command
            .args(["__exec", "--parent", &parent, "--"])
            .args(&self.command)
            .env("TARGETLEASE_TOKEN", token.to_string())
            .env("TARGETLEASE_SLOT", slot.to_string())
            .env("TARGETLEASE_OWNER", holder)
            .env("TARGETLEASE_TARGET", &self.target)
            .env("TARGETLEASE_NAME", &name)
            // Its own group, so everything it starts can be signalled together.
            .process_group(0);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                eprintln!("targetlease run: cannot start the command: {e}");
                return Ok(Ran {
                    code: exit::CANNOT_RUN,
                    all_gone: true,
                });
            }
        };
        let Some(pgid) = child.id().and_then(|id| i32::try_from(id).ok()) else {
            return Err("the command exited before it could be watched".into());
        };
        let group = Pid::from_raw(pgid);
        if let Err(e) = guard.watch(pgid).await {
            let _ = killpg(group, Signal::SIGKILL);
            return Err(format!("the guard of the command is gone: {e}"));
        }
        let tree = Tree {
            group,
            except: guard.pid().into_iter().collect(),
        };
        // Recorded for a restarted `run` to clean up after this one; in the background, so an
        // unreachable API server never delays watching the command.
        let record = json!({"metadata": {
            "uid": session.uid,
            "annotations": {COMMAND_ANNOTATION: describe_command(pgid, token)},
        }});
        let (records, recorded) = (api.clone(), name.clone());
        tokio::spawn(async move {
            if let Err(e) = records
                .patch(&recorded, &PatchParams::default(), &Patch::Merge(&record))
                .await
            {
                warn!(name = %recorded, error = %refusal(&e), "could not record the command's process group");
            }
        });

        let mut stop: Option<(Stop, Instant)> = None;
        let mut killed = false;
        let status = loop {
            let kill_by = session.trust.kill_at();
            let term_at = session.trust.term_at();
            let kill_at = stop
                .as_ref()
                .map_or(kill_by, |(_, graced)| (*graced).min(kill_by));
            let mut why = None;
            tokio::select! {
                status = child.wait() => break status.map_err(|e| format!("waiting for the command: {e}"))?,
                heard = session.monitor.next() => match heard {
                    Heard::Beat { sent, ttl, lease } => {
                        session.follow(&lease);
                        match lost_because(&lease, token) {
                            None => session.trust.confirm(sent, ttl),
                            Some(reason) => why = Some(Stop::Lost(reason)),
                        }
                    }
                    Heard::Lease(lease) => {
                        session.follow(&lease);
                        why = lost_because(&lease, token).map(Stop::Lost);
                    }
                    Heard::Gone => why = Some(Stop::Lost("the TargetLease was deleted".into())),
                    Heard::Signal(signal) => why = Some(Stop::Signal(signal)),
                },
                _ = sleep_until(term_at), if stop.is_none() => why = Some(unconfirmed()),
                _ = sleep_until(kill_at), if !killed => {
                    warn!("killing the command and everything it started: its grace ended, or the lease can no longer be trusted");
                    tree.signal(Signal::SIGKILL);
                    killed = true;
                    // The SIGTERM bound can come at the same instant (no grace): still a loss.
                    if stop.is_none() {
                        stop = Some((unconfirmed(), Instant::now()));
                    }
                }
            }
            if let Some(why) = why
                && stop.is_none()
            {
                stop = Some((why.clone(), self.terminate(&tree, &why)));
            }
        };
        let all_gone = self.reap(&tree, &mut child, session.trust.kill_at()).await;
        drop(guard);
        let code = match stop {
            Some((Stop::Lost(_), _)) => exit::LOST,
            Some((Stop::Signal(signal), _)) => exit::interrupted(signal as i32),
            None => exit_code(status),
        };
        Ok(Ran { code, all_gone })
    }

    /// Tells the command's group to stop; answers when its grace ends.
    fn terminate(&self, tree: &Tree, why: &Stop) -> Instant {
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
        tree.signal(signal);
        Instant::now() + self.grace
    }

    /// After the command exited: whatever it started (in its group or not) gets SIGTERM, and
    /// SIGKILL after the grace, or at `kill_by` (the self-fencing bound) if that comes first.
    /// Answers whether nothing it started runs any more.
    async fn reap(&self, tree: &Tree, child: &mut Child, kill_by: Instant) -> bool {
        let _ = child.try_wait();
        if !tree.alive() {
            return true;
        }
        tree.signal(Signal::SIGTERM);
        let deadline = (Instant::now() + self.grace).min(kill_by);
        while Instant::now() < deadline {
            if !tree.alive() {
                return true;
            }
            sleep(Duration::from_millis(50)).await;
        }
        warn!("processes the command started are still running after the grace; killing them");
        // Killed until none is left (a process may fork while it is being killed), for a while.
        let give_up = Instant::now() + Duration::from_secs(5);
        while tree.signal(Signal::SIGKILL) && Instant::now() < give_up {
            sleep(Duration::from_millis(20)).await;
        }
        !tree.alive()
    }
}
