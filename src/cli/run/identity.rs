//! Who a `run` is, and who ran before it: the identity of a process as `/proc` shows it (boot,
//! PID namespace, pid, start time), the annotations that record it on the TargetLease, the
//! judgement of a predecessor (dead only on proof), the cleanup of what a dead predecessor's
//! command left running, and the TargetLease's name, the same for every incarnation.

use nix::sys::signal::kill;
use nix::unistd::Pid;

use super::procfs::start_time;

/// Annotation naming the `run` process that owns the TargetLease:
/// `<boot id> <pid namespace> <pid> <start>`.
pub(super) const PROCESS_ANNOTATION: &str = "targetlease.dev/run-process";

/// Annotation naming the command's process group:
/// `<boot id> <pid namespace> <pgid> <start of its leader> <token>`.
pub(super) const COMMAND_ANNOTATION: &str = "targetlease.dev/run-command";

/// This boot of the machine: pids and start times mean something only within one boot.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// This process's PID namespace (`pid:[inode]`): pids mean something only within one.
fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|p| p.into_os_string().into_string().ok())
        .unwrap_or_default()
}

/// `<boot id> <pid namespace> <pid> <start>` of a process of ours, for the annotations.
pub(super) fn describe(pid: i32) -> String {
    format!(
        "{} {} {pid} {}",
        boot_id(),
        pid_namespace(),
        start_time(pid).unwrap_or(0)
    )
}

/// A process an annotation describes, when it is one this process can judge: same boot, same
/// PID namespace (a pid seen from anywhere else says nothing about it).
struct Described<'a> {
    pid: i32,
    start: u64,
    /// What follows the start time (the command's token).
    rest: Vec<&'a str>,
}

/// Parses `<boot id> <pid namespace> <pid> <start> ...`; `Err` says why it cannot be judged.
fn here(description: &str) -> Result<Described<'_>, &'static str> {
    let mut parts = description.split(' ');
    let (Some(boot), Some(ns), Some(pid), Some(start)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("it is recorded in a form this version cannot judge");
    };
    let (Ok(pid), Ok(start)) = (pid.parse(), start.parse()) else {
        return Err("it is recorded in a form this version cannot judge");
    };
    if boot.is_empty() || boot != boot_id() {
        return Err("it ran on another boot or another machine");
    }
    if ns.is_empty() || ns != pid_namespace() {
        return Err("it ran in another PID namespace (another container)");
    }
    Ok(Described {
        pid,
        start,
        rest: parts.collect(),
    })
}

/// What is known of the `run` that an annotation names.
#[derive(Debug, PartialEq)]
pub(super) enum Predecessor {
    /// Provably dead: same boot and PID namespace, and its pid is gone or another process's.
    Dead,
    /// This very process.
    Me,
    /// Running.
    Alive,
    /// Nothing can be proven, for the reason given: it may be running.
    Unknown(&'static str),
}

/// Judges the `run` process `description` names (`None`: none is recorded).
pub(super) fn predecessor(description: Option<&str>) -> Predecessor {
    let Some(description) = description else {
        return Predecessor::Unknown("no targetlease run process is recorded on it");
    };
    let process = match here(description) {
        Ok(process) => process,
        Err(why) => return Predecessor::Unknown(why),
    };
    if process.pid == std::process::id().cast_signed() {
        return Predecessor::Me;
    }
    match start_time(process.pid) {
        Some(start) if start == process.start => Predecessor::Alive,
        // Another process under that pid: the recorded one ended.
        Some(_) => Predecessor::Dead,
        // Unreadable: a process that is not there (ESRCH) is proven gone; one that exists but
        // cannot be read (hidepid, another user's, ProtectProc) proves nothing.
        None => match kill(Pid::from_raw(process.pid), None) {
            Err(nix::errno::Errno::ESRCH) => Predecessor::Dead,
            _ => Predecessor::Unknown(
                "its process exists but cannot be read here (another user's, or /proc hides it)",
            ),
        },
    }
}

/// `<boot id> <pid namespace> <pgid> <start of its leader> <token>` of the command's group.
pub(super) fn describe_command(pgid: i32, token: u64) -> String {
    format!("{} {token}", describe(pgid))
}

/// Kills what is left of a dead incarnation's command, whose group `description` names: only
/// processes it can prove that incarnation started (same boot and PID namespace, in that group,
/// started after its leader, carrying TargetLease `name` and the tenure's token).
pub(super) fn kill_leftovers(description: &str, name: &str) {
    let Ok(group) = here(description) else {
        return;
    };
    let Some(token) = group.rest.first().copied() else {
        return;
    };
    // In its group or not (a descendant that called setsid): what carries this TargetLease's
    // name and the tenure's token and started after the command.
    super::tree::kill_marked(name, token, group.start);
}

/// A DNS-1123 label fragment from a name.
fn label(name: &str) -> String {
    let fragment: String = name
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    let fragment = fragment.trim_matches('-');
    if fragment.is_empty() {
        "run".into()
    } else {
        fragment.to_owned()
    }
}

/// The TargetLease name of a `run` of `target` from `who` (the pod, or the host): the same for
/// every incarnation, so a restarted `run` finds what the previous one left.
pub(super) fn lease_name(who: &str, identity: &str, target: &str) -> String {
    let digest = sha1_smol::Sha1::from(format!("{identity}\n{target}"))
        .digest()
        .to_string();
    format!("{}-{}", label(who), &digest[..10])
}

/// An `--instance` name: it becomes part of a TargetLease name.
pub(super) fn parse_instance(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(s.to_owned())
    } else {
        Err("an instance is 1 to 63 characters of a-z, 0-9 and '-'".into())
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn names_are_stable_per_identity_and_target() {
        let a = lease_name("web-0", "pod-uid:1", "db");
        assert_eq!(a, lease_name("web-0", "pod-uid:1", "db"));
        assert_ne!(a, lease_name("web-0", "pod-uid:2", "db"));
        assert_ne!(a, lease_name("web-0", "pod-uid:1", "db2"));
        assert!(
            a.starts_with("web-0-") && a.len() == "web-0-".len() + 10,
            "{a}"
        );
        assert!(lease_name("My_Laptop.local", "host:x", "t").starts_with("my-laptop-local-"));
    }

    #[test]
    fn only_a_process_of_this_boot_and_pid_namespace_is_judged() {
        let me = describe(std::process::id().cast_signed());
        assert_eq!(predecessor(Some(&me)), Predecessor::Me, "{me}");
        let mut sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = i32::try_from(sleeper.id()).expect("pid");
        let alive = describe(pid);
        assert_eq!(predecessor(Some(&alive)), Predecessor::Alive, "{alive}");
        let start = start_time(pid).expect("start");
        let (boot, ns) = (boot_id(), pid_namespace());
        assert!(ns.starts_with("pid:["), "{ns}");
        // Same pid, another start time: the pid was reused, the process it named is gone.
        let reused = format!("{boot} {ns} {pid} {}", start + 1);
        assert_eq!(predecessor(Some(&reused)), Predecessor::Dead);
        // Evidence of absence from elsewhere proves nothing: another boot, another PID
        // namespace, the older form without a namespace, nothing recorded.
        for unknown in [
            format!("another-boot {ns} 999999 {start}"),
            format!("{boot} pid:[1] 999999 {start}"),
            format!("{boot} 999999 {start}"),
        ] {
            assert!(
                matches!(predecessor(Some(&unknown)), Predecessor::Unknown(_)),
                "{unknown}"
            );
        }
        assert!(matches!(predecessor(None), Predecessor::Unknown(_)));
        let _ = sleeper.kill();
        let _ = sleeper.wait();
        assert_eq!(predecessor(Some(&alive)), Predecessor::Dead);
    }
}
