//! What `/proc` says of a process: its `stat` fields, when it started, and whether it carries
//! the environment a `run`'s command passes to everything it starts. Read by the identity of a
//! `run` (who ran before it), by the tree of the command (what it started) and by the guard.

/// The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses:
/// counted from the last ')'), so field N of the man page is index N - 3.
pub(super) fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// The parent of process `pid` (field 4 of /proc/PID/stat).
pub(super) fn parent(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// When process `pid` started (clock ticks since boot, field 22 of /proc/PID/stat).
pub(super) fn start_time(pid: i32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Whether process `pid` was started by a `run` of TargetLease `name` for the tenure `token`:
/// the command and everything it started inherit both in their environment (a process that
/// replaced its environment is not recognised, and is left alone).
pub(super) fn started_for(pid: i32, name: &str, token: &str) -> bool {
    let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let want_name = format!("TARGETLEASE_NAME={name}");
    let want_token = format!("TARGETLEASE_TOKEN={token}");
    let vars: Vec<&[u8]> = environ.split(|b| *b == 0).collect();
    vars.contains(&want_name.as_bytes()) && vars.contains(&want_token.as_bytes())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn leftovers_are_recognised_by_their_lease_name_and_token() {
        let mut ours = std::process::Command::new("sleep")
            .arg("30")
            .env("TARGETLEASE_NAME", "host-0123456789")
            .env("TARGETLEASE_TOKEN", "42")
            .spawn()
            .expect("sleep");
        let pid = i32::try_from(ours.id()).expect("pid");
        // Until the child has exec'd, its environment is still ours.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !started_for(pid, "host-0123456789", "42") {
            assert!(std::time::Instant::now() < deadline, "never recognised");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!started_for(pid, "host-0123456789", "43"));
        assert!(!started_for(pid, "other-0123456789", "42"));
        assert!(!started_for(
            std::process::id().cast_signed(),
            "host-0123456789",
            "42"
        ));
        let _ = ours.kill();
        let _ = ours.wait();
    }
}
