//! The lease-store protocol's requests and outcomes: what a caller asks of a backend and what
//! it answers, over the validated names of [`super::names`].

use serde::{Deserialize, Serialize};

use super::names::{GuardedKey, LeaseId, Owner, Permits, RequestId, Slot, TargetRef, Token, Ttl};

/// Everything that identifies a lease that was granted: renew and release need all of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseHandle {
    /// The target the lease is on.
    pub target: TargetRef,
    /// The permits it was granted under.
    pub permits: Permits,
    /// Its slot (0 for an exclusive lease).
    pub slot: Slot,
    /// The claim's identity.
    pub lease_id: LeaseId,
    /// Who the lease was claimed for.
    pub owner: Owner,
    /// The fencing token the lease was granted with.
    pub token: Token,
}

/// A request to claim a target.
#[derive(Clone, Debug)]
pub struct AcquireRequest {
    /// The target to claim.
    pub target: TargetRef,
    /// The claim's identity.
    pub lease_id: LeaseId,
    /// Who the lease is claimed for.
    pub owner: Owner,
    /// How many holders the target admits: every claim on a target must ask the same value
    /// while any permit is held, or it is refused with [`AcquireOutcome::PermitsConflict`].
    pub permits: Permits,
    /// Lease time-to-live, kept by the backend.
    pub ttl: Ttl,
    /// The new token will be larger than this: the highest token the caller has seen for the
    /// target, so tokens grow even when the backend lost its data.
    pub min_token: u64,
    /// Makes retries of this call act once.
    pub request_id: RequestId,
}

/// A request to extend a lease.
#[derive(Clone, Debug)]
pub struct RenewRequest {
    /// The lease to extend.
    pub lease: LeaseHandle,
    /// The new time-to-live from now.
    pub ttl: Ttl,
    /// Makes retries of this call act once.
    pub request_id: RequestId,
}

/// A request to give a lease up.
#[derive(Clone, Debug)]
pub struct ReleaseRequest {
    /// The lease to give up.
    pub lease: LeaseHandle,
    /// Makes retries of this call act once.
    pub request_id: RequestId,
}

/// A fenced write of `value` to the guarded record `key` of a target's slot.
#[derive(Clone, Debug)]
pub struct CommitRequest {
    /// The target whose fence guards the write.
    pub target: TargetRef,
    /// The slot whose fence guards the write; each slot has its own guarded records.
    pub slot: Slot,
    /// The writer's fencing token.
    pub token: Token,
    /// Name of the guarded record within the target.
    pub key: GuardedKey,
    /// The value to store.
    pub value: String,
    /// The writer's number for this write within its tenure: (token, sequence) must be above
    /// the last accepted write's, so a late replay of an earlier write is refused as stale. The
    /// same (token, sequence) with the same value is answered `committed` without writing.
    pub sequence: u64,
    /// Makes retries of this call act once.
    pub request_id: RequestId,
}

impl CommitRequest {
    /// The guarded record's name as a request id binds it: with its slot (slot 0's as it is),
    /// so one request id never commits to two slots.
    pub fn bound_key(&self) -> String {
        match self.slot.get() {
            0 => self.key.as_str().to_owned(),
            s => format!("slot {s} {}", self.key.as_str()),
        }
    }
}

/// The outcome of [`crate::store::LeaseStore::repair`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RepairOutcome {
    /// Every record of the target was readable: nothing was changed.
    Intact {
        /// The fence as it is.
        fence: u64,
    },
    /// Unreadable records were replaced.
    Repaired {
        /// The fence now: the next token is larger.
        fence: u64,
        /// What was done.
        what: String,
    },
}

/// A granted lease as the backend reported it. All times are the backend's clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Grant {
    /// The fencing token: larger than every token issued for the target before, in any slot.
    pub token: u64,
    /// The slot granted: 0 to permits-1 (0 for an exclusive lease).
    pub slot: Slot,
    /// When this tenure began, in ms since the Unix epoch.
    pub acquired_at_ms: u64,
    /// The backend's time when it answered, in ms since the Unix epoch.
    pub server_time_ms: u64,
    /// Remaining time-to-live when the backend answered, in ms.
    pub expires_in_ms: u64,
}

impl Grant {
    /// When the lease expires unless renewed, in ms since the Unix epoch (backend clock).
    pub fn expires_at_ms(&self) -> u64 {
        self.server_time_ms + self.expires_in_ms
    }
}

/// The outcome of [`crate::store::LeaseStore::acquire`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum AcquireOutcome {
    /// The caller holds the target.
    Acquired(Grant),
    /// Someone else holds the target.
    #[serde(rename_all = "camelCase")]
    Held {
        /// The current owner.
        owner: String,
        /// Remaining time-to-live of their lease, in ms.
        expires_in_ms: u64,
    },
    /// A retry of an acquire whose grant has ended since (expired, released, or replaced by a
    /// newer token): nothing was taken, the caller holds nothing. Use a new request id to claim
    /// the target again.
    Expired {
        /// The token the first call was granted.
        token: u64,
    },
    /// Permits granted under another value are held on the target: nothing was taken. Admitted
    /// once the claim asks the value in force, or once no permit granted under it is held.
    #[serde(rename_all = "camelCase")]
    PermitsConflict {
        /// The permits value the target's current holders were granted under.
        in_force: u32,
    },
}

/// Why a lease is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossReason {
    /// Nobody holds the target: the lease expired (or the backend lost it).
    Expired,
    /// Another claim (or another token) holds the target.
    NotHolder,
}

/// The outcome of [`crate::store::LeaseStore::renew`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RenewOutcome {
    /// The lease was extended.
    #[serde(rename_all = "camelCase")]
    Renewed {
        /// The backend's time when it answered, in ms since the Unix epoch.
        server_time_ms: u64,
        /// Remaining time-to-live, in ms.
        expires_in_ms: u64,
    },
    /// The lease is no longer the caller's.
    Lost {
        /// Why.
        reason: LossReason,
    },
}

/// The outcome of [`crate::store::LeaseStore::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReleaseOutcome {
    /// The lease was given up.
    Released,
    /// The caller did not hold the lease (expired or taken): nothing was changed.
    NotHolder,
}

/// The outcome of [`crate::store::LeaseStore::commit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum CommitOutcome {
    /// The value was written.
    Committed {
        /// The token it was written with.
        token: u64,
    },
    /// Refused: a newer token exists.
    Stale {
        /// The newest token the store knows.
        newest: u64,
    },
}

/// A guarded record and the token of the write that produced it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GuardedValue {
    /// The token the value was committed with.
    pub token: u64,
    /// The value.
    pub value: String,
}

/// The outcome of [`crate::store::LeaseStore::check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum CheckOutcome {
    /// No newer token has been issued.
    Current {
        /// The newest token the store knows.
        newest: u64,
    },
    /// A newer token has been issued: the caller must not act.
    Stale {
        /// The newest token the store knows.
        newest: u64,
    },
}

/// A read-only view of one target.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Inspection {
    /// The fencing high-water mark: the newest token issued, in any slot.
    pub fence: u64,
    /// The backend's time when it answered, in ms since the Unix epoch.
    pub server_time_ms: u64,
    /// What the held permits were granted under (the largest value, should they differ; 1 when
    /// the exclusive lease or nothing is held).
    pub permits: u32,
    /// The live lease of slot 0 (the exclusive lease), if any.
    pub lease: Option<LeaseView>,
    /// The live leases of slots 1 and up, by slot.
    pub slots: Vec<LeaseView>,
}

impl Inspection {
    /// Every live lease, slot 0 first.
    pub fn holders(&self) -> impl Iterator<Item = &LeaseView> {
        self.lease.iter().chain(self.slots.iter())
    }
}

/// A live lease as seen by [`Inspection`]. The lease id is shown hashed only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseView {
    /// The slot it holds.
    pub slot: Slot,
    /// The permits it was granted under (1: the exclusive lease).
    pub permits: Permits,
    /// The holder.
    pub owner: String,
    /// The holder's fencing token.
    pub token: u64,
    /// When the tenure began, ms since the Unix epoch.
    pub acquired_at_ms: u64,
    /// Remaining time-to-live, in ms.
    pub expires_in_ms: u64,
    /// The claim's identity, hashed when displayed or serialized.
    #[serde(serialize_with = "serialize_hashed")]
    pub lease_id: LeaseId,
}

fn serialize_hashed<S: serde::Serializer>(id: &LeaseId, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(id)
}
