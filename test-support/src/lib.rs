//! Test support shared by the integration suites and the benchmarks, compiled once: real
//! servers on loopback ports, clusters, certificates, a misbehaving proxy, a Kubernetes control
//! plane, the contract's test bodies and the suite runner. A dev-dependency of `targetlease`
//! only; suites import it as `support` (`use targetlease_test_support as support;`).

pub mod admin;
pub mod chart;
pub mod cluster;
pub mod contract_cases;
pub mod etcd;
pub mod kube;
pub mod oci;
pub mod proxy;
pub mod release;
pub mod scenario;
pub mod sentinel;
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

/// An ACL rule documented in docs/operations.md between `<!-- MARKER:begin -->` and
/// `<!-- MARKER:end -->`, as `ACL SETUSER` arguments, with the user and the placeholder
/// password `>CHANGE-ME` replaced: the suites run as the user the docs tell operators to make.
pub fn documented_acl_rule(marker: &str, user: &str, password: &str) -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operations.md");
    let doc = std::fs::read_to_string(path).expect("docs/operations.md");
    let begin = format!("<!-- {marker}:begin -->");
    let start = doc
        .find(&begin)
        .unwrap_or_else(|| panic!("{begin} in docs/operations.md"));
    let end = doc[start..]
        .find(&format!("<!-- {marker}:end -->"))
        .unwrap_or_else(|| panic!("{marker}:end after {begin}"));
    let line = doc[start..start + end]
        .lines()
        .find(|l| l.starts_with("ACL SETUSER"))
        .unwrap_or_else(|| panic!("an ACL SETUSER line between the {marker} markers"));
    let mut words = line.split_whitespace().map(str::to_owned);
    // `ACL SETUSER <documented user> rules...`
    let _ = (words.next(), words.next(), words.next());
    ["ACL".to_owned(), "SETUSER".to_owned(), user.to_owned()]
        .into_iter()
        .chain(words.map(|word| {
            if word == ">CHANGE-ME" {
                format!(">{password}")
            } else {
                word
            }
        }))
        .collect()
}
