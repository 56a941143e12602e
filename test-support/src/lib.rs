//! Test support shared by the integration suites and the benchmarks, compiled once: real
//! servers on loopback ports, clusters, certificates, a misbehaving proxy, a Kubernetes control
//! plane, the contract's test bodies and the suite runner. A dev-dependency of `targetlease`
//! only; suites import it as `support` (`use targetlease_test_support as support;`).

pub mod admin;
pub mod chart;
pub mod cluster;
pub mod contract_cases;
pub mod kube;
pub mod oci;
pub mod proxy;
pub mod scenario;
pub mod server;
pub mod suite;
pub mod tls;

/// The number of random cases of a property or fuzz test: `default`, or `TARGETLEASE_CASES` for
/// longer runs.
pub fn cases(default: u32) -> u32 {
    std::env::var("TARGETLEASE_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
