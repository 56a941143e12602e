//! The lease-store protocol: what the controller and the CLI ask of a backend.
//!
//! Outcomes a caller expects (held by someone else, lost, not the holder, stale token) are
//! values; [`StoreError`] is for failures only. No backend type leaks out of this module's
//! interface, so a backend with other consistency properties can be added without touching a
//! caller.

mod error;
pub mod etcd;
pub mod memory;
mod names;
mod protocol;
mod rules;
pub mod valkey;

use async_trait::async_trait;

pub use error::{ErrorKind, StoreError};
pub use names::{
    DEFAULT_REPLY_TTL, GuardedKey, LeaseId, MAX_FLOOR_LEAD_MICROS, MAX_PERMITS, MAX_TOKEN,
    MAX_TOKEN_LEAD_MICROS, Owner, Permits, RequestId, Slot, TargetRef, Token, Ttl, check_token,
};
pub use protocol::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, Grant,
    GuardedValue, Inspection, LeaseHandle, LeaseView, LossReason, ReleaseOutcome, ReleaseRequest,
    RenewOutcome, RenewRequest, RepairOutcome,
};

/// A backend that keeps leases and fencing tokens.
///
/// Every mutating call is atomic on the backend and idempotent by its request id: a retried call
/// with the same [`RequestId`] returns the first call's outcome and acts once. A request id is
/// bound to the call that first used it (operation, lease id, owner, floor, token, guarded key,
/// sequence and value): the same id with other arguments is refused with
/// [`StoreError::InvalidRequest`], never answered with another caller's reply.
#[async_trait]
pub trait LeaseStore: Send + Sync {
    /// Claims the target when it is free or its lease has expired; with permits N, claims a free
    /// slot (the lowest) while fewer than N are held. The same lease id and owner get their
    /// current slot and token back with a fresh TTL.
    async fn acquire(&self, request: &AcquireRequest) -> Result<AcquireOutcome, StoreError>;

    /// Extends a lease, only for the exact (lease id, owner, token) that holds it.
    async fn renew(&self, request: &RenewRequest) -> Result<RenewOutcome, StoreError>;

    /// Gives a lease up, only for the exact (lease id, owner, token) that holds it.
    async fn release(&self, request: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError>;

    /// Writes a value to a guarded record of the target if the token is not stale: the fencing
    /// check for data kept in the store itself.
    async fn commit(&self, request: &CommitRequest) -> Result<CommitOutcome, StoreError>;

    /// Reads a guarded record of a slot written by [`LeaseStore::commit`].
    async fn read_guarded(
        &self,
        target: &TargetRef,
        slot: Slot,
        key: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError>;

    /// Read-only fencing check: is `token` still the newest grant of the target's `slot` (slot 0
    /// for an exclusive lease)?
    async fn check(
        &self,
        target: &TargetRef,
        slot: Slot,
        token: Token,
    ) -> Result<CheckOutcome, StoreError>;

    /// Read-only view of a target, for operators.
    async fn inspect(&self, target: &TargetRef) -> Result<Inspection, StoreError>;

    /// Replaces the records of a target that fail closed (an unreadable target record is
    /// deleted, an unreadable fence is set to the largest of `floor`, the readable lease token
    /// and the backend's clock in microseconds plus [`MAX_TOKEN_LEAD_MICROS`]); readable records
    /// are left alone. For
    /// operators, after a restore or a tool wrote what this version cannot read.
    async fn repair(&self, target: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError>;

    /// Reachability check used by readiness probes.
    async fn health(&self) -> Result<(), StoreError>;
}
