//! Exit statuses of `targetlease run`, `wait` and `lease`: one table, rendered into
//! docs/reference/cli.md (`targetlease reference cli`). Clap's own usage errors exit with 2, so
//! no outcome of ours uses 2.

/// Declares each exit status as a constant and lists them all in [`ALL`], with their doc
/// comments, so that the reference page cannot drift from the code.
macro_rules! exit_statuses {
    ($($(#[doc = $doc:literal])+ $name:ident = $code:literal,)+) => {
        $($(#[doc = $doc])+ pub const $name: u8 = $code;)+

        /// Every fixed exit status: its number, its constant's name and its doc comment.
        pub const ALL: &[(u8, &str, &str)] = &[$(($code, stringify!($name), concat!($($doc, "\n"),+)),)+];
    };
}

exit_statuses! {
    /// Success; for `run`, the command's own status when it ran to the end under its lease.
    OK = 0,
    /// A failure: the API server or the store could not be reached, bad settings, ...
    FAILURE = 1,
    /// `lease ...`: the store refused (held, lost, not_holder, stale, permits_conflict); `lease
    /// read`: no record under the key (absent), so that a script can tell "nothing written yet"
    /// from a value.
    REFUSED = 3,
    /// `lease acquire`: a retry (the same request id) of an acquire whose grant has ended since
    /// (outcome `expired`): nothing is held; claim again with a new request id.
    GRANT_ENDED = 4,
    /// `run`, `wait`: the lease was not Held within the wait timeout (EX_TEMPFAIL).
    NOT_ACQUIRED = 75,
    /// `run`: the lease was lost while the command ran (another phase or token, the TargetLease
    /// deleted, or no confirmation for longer than the TTL), whatever the command returned.
    LOST = 76,
    /// `run`, `wait`: the TargetLease was deleted before it was Held.
    DELETED = 79,
    /// `run`: the command could not be started (not found, not executable).
    CANNOT_RUN = 127,
}

/// `run`, `wait`: interrupted by `signal` (SIGINT, SIGTERM): 128 + its number, as shells do.
pub fn interrupted(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(FAILURE)
}
