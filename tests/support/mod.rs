//! Test support shared by the integration suites: real servers on loopback ports.
#![allow(dead_code)]

pub mod kube;
pub mod server;

/// The number of random cases of a property or fuzz test: `default`, or `TARGETLEASE_CASES` for
/// longer runs.
pub fn cases(default: u32) -> u32 {
    std::env::var("TARGETLEASE_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
