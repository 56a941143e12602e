//! The lease-store contract (`test-support/src/contract_cases/`) against the in-memory store,
//! plain servers (Valkey 9.1, Valkey 8.1 and Redis 7.0) and etcd 3.7, each test on its own server
//! on a free loopback port. A missing server binary fails the suite; it never skips. Prints a closing
//! `contract: N passed, N failed` line and fails when no test ran.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};

use support::contract_cases::{etcd_variants, plain_variants, trials};
use support::suite;

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    support::etcd::prepare();
    let mut variants = plain_variants().to_vec();
    variants.extend(etcd_variants());
    suite::run(args, trials(&variants))
}
