//! Exit statuses of `targetlease run`, `wait` and `lease`: one table, documented in
//! docs/workloads.md ("Exit statuses"). Clap's own usage errors exit with 2, so no outcome of
//! ours uses 2.

/// Success; for `run`, the command's own status when it ran to the end under its lease.
pub const OK: u8 = 0;
/// A failure: the API server or the store could not be reached, bad settings, ...
pub const FAILURE: u8 = 1;
/// `lease ...`: the store refused (held, lost, not_holder, stale); `lease read`: no record under
/// the key (absent), so that a script can tell "nothing written yet" from a value.
pub const REFUSED: u8 = 3;
/// `lease acquire`: a retry (the same request id) of an acquire whose grant has ended since
/// (outcome `expired`): nothing is held; claim again with a new request id.
pub const GRANT_ENDED: u8 = 4;
/// `run`, `wait`: the lease was not Held within the wait timeout (EX_TEMPFAIL).
pub const NOT_ACQUIRED: u8 = 75;
/// `run`: the lease was lost while the command ran (another phase or token, the TargetLease
/// deleted, or no confirmation for longer than the TTL), whatever the command returned.
pub const LOST: u8 = 76;
/// `run`, `wait`: the TargetLease was deleted before it was Held.
pub const DELETED: u8 = 79;
/// `run`: the command could not be started (not found, not executable).
pub const CANNOT_RUN: u8 = 127;

/// `run`, `wait`: interrupted by `signal` (SIGINT, SIGTERM): 128 + its number, as shells do.
pub fn interrupted(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(FAILURE)
}
