//! The lease store layer, on real servers: the contract on every backend (etcd's own trials
//! too), the store under attack, the ACL user, TLS and durability, Valkey Cluster and Sentinel, network and server
//! faults, the model-based property tests and fuzzing, the script upgrades, and the
//! linearizability of a history of killed clients. One binary, one suite after the other; a
//! name filter selects trials by their suite's prefix (`cargo test --test store -- sentinel::`).

mod adversarial;
mod cluster;
mod contract;
mod etcd;
mod faults;
mod fuzz;
mod linearizability;
mod model;
mod operations;
mod sentinel;
mod upgrade;

fn main() {
    targetlease_test_support::suite::layer(
        "store",
        // The suites without etcd first: on a machine that has built nothing, the others wait
        // (outside their trials' limits) for the control plane's Go build, which builds etcd.
        &[
            ("operations", operations::suite),
            ("cluster", cluster::suite),
            ("sentinel", sentinel::suite),
            ("faults", faults::suite),
            ("fuzz", fuzz::suite),
            ("upgrade", upgrade::suite),
            ("contract", contract::suite),
            ("adversarial", adversarial::suite),
            ("model", model::suite),
            ("linearizability", linearizability::suite),
            ("etcd", etcd::suite),
        ],
    )
}
