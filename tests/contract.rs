//! The lease-store contract (`tests/support/contract_cases.rs`) against the in-memory store and
//! plain servers: Valkey 9.1, Valkey 8.1 and Redis 7.0, each test on its own server on a free
//! loopback port. A missing server binary fails the suite; it never skips. Prints a closing
//! `contract: N passed, N failed` line and fails when no test ran.

mod support;

use support::contract_cases::{Harness, Variant, trials};
use support::server::ServerKind;
use support::suite;

fn main() {
    let variants = [
        Variant {
            name: "memory",
            make: || Box::pin(async { Harness::memory() }),
            admin: false,
            raw: false,
        },
        Variant {
            name: ServerKind::Valkey91.name(),
            make: || Box::pin(Harness::plain(ServerKind::Valkey91)),
            admin: true,
            raw: true,
        },
        Variant {
            name: ServerKind::Valkey81.name(),
            make: || Box::pin(Harness::plain(ServerKind::Valkey81)),
            admin: true,
            raw: true,
        },
        Variant {
            name: ServerKind::Redis70.name(),
            make: || Box::pin(Harness::plain(ServerKind::Redis70)),
            admin: true,
            raw: true,
        },
    ];
    suite::run("contract", trials(&variants));
}
