//! The lease-store contract: one set of test bodies that every backend must pass. The suites
//! run them against the in-memory store and plain servers (`tests/store/contract.rs`), as an ACL user,
//! over TLS and mTLS (`tests/store/operations.rs`) and on a Valkey Cluster (`tests/store/cluster.rs`).
//!
//! A suite describes each backend as a [`Variant`]: a factory for a fresh [`Harness`] per test
//! and what the harness offers beyond the store (an administrator connection, a plaintext port
//! for byte-level tricks), so each test runs where it can.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::Trial;
use redis::Value;
use targetlease::redact::SecretUrl;
use targetlease::store::etcd::{EtcdConfig, EtcdStore};
use targetlease::store::memory::{Clock, ManualClock, MemorySnapshot, MemoryStore, SystemClock};
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::scripts::SCRIPTS;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, ErrorKind, Grant,
    GuardedKey, LeaseHandle, LeaseId, LeaseStore, LossReason, MAX_TOKEN_LEAD_MICROS, Owner,
    Permits, ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, RepairOutcome, RequestId,
    Slot, StoreError, TargetRef, Token, Ttl,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::admin::Admin;
use super::etcd::{EtcdServer, Snapshot};
use super::server::{Server, ServerKind, resp};
use super::suite;

mod exclusion;
mod failures;
mod fixtures;
mod harness;
mod hygiene;
mod permits;
mod retries;
mod stale;

pub use fixtures::*;
pub use harness::*;

use exclusion::*;
use failures::*;
use hygiene::*;
use permits::*;
pub use permits::{permit_handle, permit_req, permits, slot};
use retries::*;
pub use stale::*;

/// One test body.
pub type TestFn = fn(Harness) -> Pin<Box<dyn Future<Output = ()>>>;

/// What a test needs from a backend.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Only the store: every backend.
    Store,
    /// An administrator connection: servers and clusters.
    Admin,
    /// Plaintext access to a single server as its default user.
    Raw,
}

/// A list of `(name, needs, body)` from `Needs name, ...`.
#[macro_export]
macro_rules! cases {
    ($($needs:ident $name:ident),* $(,)?) => {
        [$((stringify!($name), $crate::contract_cases::Needs::$needs,
            (|h| Box::pin($name(h))) as $crate::contract_cases::TestFn)),*]
    };
}

/// Every contract test and what it needs.
const CASES: [(&str, Needs, TestFn); 25] = cases![
    Store acquire_free_then_held,
    Store hundred_concurrent_acquires_one_winner,
    Store expiry_then_reacquire_gives_larger_token,
    Store release_then_reacquire_gives_larger_token,
    Store old_owner_refused_after_reacquire,
    Store renew_with_wrong_identity_is_refused,
    Store retried_acquire_returns_first_reply,
    Store unread_acquire_retried_returns_first_result,
    Store retried_renew_acts_once,
    Store retried_release_acts_once,
    Store retried_commit_acts_once,
    Store tokens_grow_after_data_loss,
    Admin corrupt_records_fail_closed,
    Store repair_leaves_readable_records_alone,
    Raw client_sends_only_scripts,
    Raw logs_hide_password_and_lease_id,
    Store two_hundred_racing_for_five_permits_get_five,
    Store permit_retries_never_take_two_slots,
    Store expired_permits_are_reclaimed,
    Store permits_conflict_is_refused,
    Store permit_tokens_grow_across_data_loss,
    Store fencing_is_per_slot,
    Store renew_and_release_are_per_permit,
    Admin corrupt_permit_records_fail_closed,
    Admin slot_zero_fence_keeps_up_with_the_other_slots,
];

/// Makes a fresh harness for one test.
pub type Factory = fn() -> Pin<Box<dyn Future<Output = Harness>>>;

/// One backend the contract runs against.
#[derive(Clone, Copy)]
pub struct Variant {
    /// Prefix of the trial names.
    pub name: &'static str,
    /// A fresh harness per test.
    pub make: Factory,
    /// Whether the harness has an administrator connection.
    pub admin: bool,
    /// Whether the harness has plaintext access to a single server.
    pub raw: bool,
}

/// The in-memory store and one plain server of each kind the suites support (Valkey 9.1, Valkey
/// 8.1, Redis 7.0), each with an administrator and raw access.
pub fn plain_variants() -> [Variant; 4] {
    [
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
    ]
}

/// A one-member etcd 3.7 cluster per test: the store's cases (etcd has no administrator
/// connection or plaintext port of the kind the other cases use).
pub fn etcd_variants() -> [Variant; 1] {
    [Variant {
        name: "etcd-3.7",
        make: || Box::pin(Harness::etcd()),
        admin: false,
        raw: false,
    }]
}

/// The contract's trials for each variant: `<variant>::<test>`.
pub fn trials(variants: &[Variant]) -> Vec<Trial> {
    trials_of(variants, &CASES)
}

/// The trials of `cases` for each variant that offers what they need: `<variant>::<test>`.
pub fn trials_of(variants: &[Variant], cases: &[(&'static str, Needs, TestFn)]) -> Vec<Trial> {
    let mut trials = Vec::new();
    for variant in variants {
        for &(name, needs, test) in cases {
            let offered = match needs {
                Needs::Store => true,
                Needs::Admin => variant.admin,
                Needs::Raw => variant.raw,
            };
            if !offered {
                continue;
            }
            let make = variant.make;
            trials.push(suite::trial(
                format!("{}::{name}", variant.name),
                move || async move { test(make().await).await },
            ));
        }
    }
    trials
}
