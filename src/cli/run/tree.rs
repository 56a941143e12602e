//! Everything the command started, wherever it went: its process group, and every descendant,
//! including those that left the group (`setsid`, a double fork). `run` is a child subreaper,
//! so an orphan of the command is re-parented to `run` rather than to init: while `run` lives,
//! the command's whole tree is `run`'s descendants. When `run` itself is gone, what the command
//! started is still recognised by its environment: every process it started inherits the
//! TargetLease's name and the tenure's token (`TARGETLEASE_NAME`, `TARGETLEASE_TOKEN`), which
//! the guard and a restarted `run` use. What escapes all of these (a process started through a
//! daemon, such as a container, or one that replaced its environment and left after `run` and
//! its guard were both killed) is written down in docs/workloads.md.

use std::collections::{HashMap, HashSet};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::Pid;
use tracing::warn;

use super::procfs::{parent, start_time, started_for, stat_fields};

/// Makes this process a child subreaper (orphans of its descendants are re-parented to it). A
/// kernel that refuses leaves the process group and the environment marks to find them.
pub(super) fn become_subreaper() {
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        warn!(error = %e, "cannot become a child subreaper: descendants that leave the command's process group are found by their environment only");
    }
}

/// Every process's parent, as /proc shows them now.
fn parents() -> HashMap<i32, i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, parent(pid)?)))
        .collect()
}

/// The descendants of this process, but `except` (the guard) and its own descendants.
pub(super) fn descendants(except: &[i32]) -> Vec<i32> {
    let me = i32::try_from(std::process::id()).unwrap_or(0);
    let parents = parents();
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (pid, ppid) in &parents {
        children.entry(*ppid).or_default().push(*pid);
    }
    let mut found = Vec::new();
    let mut seen: HashSet<i32> = except.iter().copied().collect();
    let mut next = vec![me];
    while let Some(pid) = next.pop() {
        for child in children.get(&pid).into_iter().flatten() {
            if seen.insert(*child) {
                found.push(*child);
                next.push(*child);
            }
        }
    }
    found
}

/// The command's tree: its process group `group` and this process's descendants but `except`.
pub(super) struct Tree {
    pub(super) group: Pid,
    pub(super) except: Vec<i32>,
}

impl Tree {
    /// Sends `signal` to everything in the tree; answers whether anything was left to signal.
    pub(super) fn signal(&self, signal: Signal) -> bool {
        let in_group = killpg(self.group, signal).is_ok();
        let mut any = in_group;
        for pid in descendants(&self.except) {
            any |= kill(Pid::from_raw(pid), signal).is_ok() && !is_zombie(pid);
        }
        self.reap();
        any
    }

    /// Whether anything of the tree still runs.
    pub(super) fn alive(&self) -> bool {
        self.reap();
        killpg(self.group, None).is_ok()
            || descendants(&self.except)
                .into_iter()
                .any(|pid| !is_zombie(pid))
    }

    /// Collects the exit status of every orphan of the tree that was re-parented to this
    /// process and has ended (the command itself is collected by its own handle).
    fn reap(&self) {
        let me = i32::try_from(std::process::id()).unwrap_or(0);
        for pid in descendants(&self.except) {
            let ours = parent(pid) == Some(me);
            if ours && is_zombie(pid) && pid != self.group.as_raw() {
                let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
            }
        }
    }
}

/// Whether `pid` has ended and waits to be collected.
fn is_zombie(pid: i32) -> bool {
    stat_fields(pid).is_some_and(|f| f.first().is_some_and(|state| state == "Z"))
}

/// Kills every process of this boot and PID namespace that a command under TargetLease `name`
/// and tenure `token` started (both are in its environment) and that started no earlier than
/// `started_after` (clock ticks since boot): what is left of a command whose `run` is gone.
/// Answers how many were killed.
pub(super) fn kill_marked(name: &str, token: &str, started_after: u64) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let me = i32::try_from(std::process::id()).unwrap_or(0);
    let mut killed = 0;
    for pid in entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
    {
        let start = start_time(pid);
        if start.is_some_and(|s| s >= started_after) && started_for(pid, name, token) {
            warn!(pid, "killing a process left by a command whose run is gone");
            match kill(Pid::from_raw(pid), Signal::SIGKILL) {
                Ok(()) => killed += 1,
                Err(Errno::ESRCH) => {}
                Err(e) => warn!(pid, error = %e, "could not kill it"),
            }
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// A grandchild that left the group with `setsid` is still found: while this process lives,
    /// as a descendant (a child subreaper keeps the orphan), and by its environment.
    #[test]
    fn a_descendant_that_left_the_group_is_found_and_killed() {
        become_subreaper();
        // A marker of this run alone: a process left by an earlier, interrupted run of this test
        // carries another.
        let name = format!("tree-test-{}", std::process::id());
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!; exit 0",
            ])
            .env("TARGETLEASE_NAME", &name)
            .env("TARGETLEASE_TOKEN", "7")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("sh");
        let mut out = String::new();
        std::io::Read::read_to_string(child.stdout.as_mut().expect("stdout"), &mut out)
            .expect("read");
        let _ = child.wait();
        let orphan: i32 = out.trim().parse().expect("pid");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !descendants(&[]).contains(&orphan) {
            assert!(
                Instant::now() < deadline,
                "the orphan was not re-parented here"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!started_for(orphan, &name, "8"));
        let killed = kill_marked(&name, "7", 0);
        assert_eq!(killed, 1);
        while !is_zombie(orphan) && stat_fields(orphan).is_some() {
            assert!(Instant::now() < deadline, "not killed");
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = waitpid(Pid::from_raw(orphan), None);
    }
}
