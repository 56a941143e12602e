//! What this binary was built from: the crate version, the commit and the build date, as
//! `targetlease --version` prints them and the `targetlease_build_info` metric labels them.
//! build.rs finds the commit and the date; both are `unknown` outside a git checkout.

/// The crate version (Cargo.toml).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The first 12 hex digits of the commit built, or `unknown`.
pub const COMMIT: &str = env!("TARGETLEASE_COMMIT");

/// The build date, `YYYY-MM-DD` in UTC: SOURCE_DATE_EPOCH's, else the commit's (never the
/// clock's, so that one commit always gives one binary), or `unknown`.
pub const BUILD_DATE: &str = env!("TARGETLEASE_BUILD_DATE");

/// What `--version` prints after the program name: `0.2.0 (commit 1a2b3c4d5e6f, built 2026-12-02)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TARGETLEASE_COMMIT"),
    ", built ",
    env!("TARGETLEASE_BUILD_DATE"),
    ")"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_version_names_every_fact() {
        assert_eq!(
            LONG_VERSION,
            format!("{VERSION} (commit {COMMIT}, built {BUILD_DATE})")
        );
        assert!(
            COMMIT == "unknown"
                || (COMMIT.len() == 12 && COMMIT.bytes().all(|b| b.is_ascii_hexdigit())),
            "{COMMIT}"
        );
        let date = BUILD_DATE.as_bytes();
        assert!(
            BUILD_DATE == "unknown" || (date.len() == 10 && date[4] == b'-' && date[7] == b'-'),
            "{BUILD_DATE}"
        );
    }
}
