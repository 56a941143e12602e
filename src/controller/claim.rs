//! One TargetLease as the store sees it: its target, its lease id (the resource's uid), the
//! holder it names and the tenure its status records. Resolved once per reconcile; every store
//! name in it is validated, so nothing further down checks them again.

use std::time::Duration;

use kube::ResourceExt;

use super::error::Error;
use crate::api::{Phase, TargetLease, TargetLeaseStatus};
use crate::store::{LeaseHandle, LeaseId, Owner, Permits, Slot, TargetRef, Token, Ttl};

/// A TargetLease resolved for the store.
pub(crate) struct Claim<'a> {
    /// The resource.
    pub(crate) lease: &'a TargetLease,
    /// The target in the store.
    pub(crate) target: TargetRef,
    /// The lease id: the resource's uid.
    pub(crate) lease_id: LeaseId,
    /// The status as last written.
    pub(crate) status: Option<&'a TargetLeaseStatus>,
    /// The holder the spec names: the store's owner.
    pub(crate) owner: Owner,
    /// The lease's time-to-live, as the spec asks it.
    pub(crate) lease_ttl: Ttl,
    /// How many holders the spec says the target admits.
    pub(crate) permits: Permits,
}

impl<'a> Claim<'a> {
    /// Resolves the claim; refuses a resource without namespace or uid, or whose target or
    /// namespace the store cannot take.
    pub(crate) fn new(lease: &'a TargetLease) -> Result<Self, Error> {
        let ns = lease
            .namespace()
            .ok_or(Error::MissingField("metadata.namespace"))?;
        let uid = lease.uid().ok_or(Error::MissingField("metadata.uid"))?;
        Ok(Self {
            lease,
            target: TargetRef::new(&ns, &lease.spec.target)?,
            lease_id: LeaseId::new(uid)?,
            status: lease.status.as_ref(),
            owner: Owner::new(lease.spec.holder.clone())?,
            lease_ttl: Ttl::new(Duration::from_secs(u64::from(
                lease.spec.ttl_seconds.max(1),
            )))?,
            permits: Permits::new(lease.spec.permits)?,
        })
    }

    /// The holder the spec names (the store's owner).
    pub(crate) fn holder(&self) -> &str {
        self.owner.as_str()
    }

    /// The lease's time-to-live.
    pub(crate) fn ttl(&self) -> Duration {
        self.lease_ttl.duration()
    }

    /// The handle of the tenure the status records, if it says Held: its slot and the permits
    /// it was granted under as the status records them (a status without them is an exclusive
    /// lease's, as written before permits existed).
    pub(crate) fn held_handle(&self) -> Option<LeaseHandle> {
        let status = self.status?;
        if status.phase != Phase::Held {
            return None;
        }
        // A slot or permits no store can have granted holds nothing.
        let permits = Permits::new(status.permits.unwrap_or(1)).ok()?;
        let slot = Slot::new(status.slot.unwrap_or(0)).ok()?;
        permits.check_slot(slot).ok()?;
        Some(LeaseHandle {
            target: self.target.clone(),
            permits,
            slot,
            lease_id: self.lease_id.clone(),
            owner: self.owner.clone(),
            // A status token no store can have issued (0, above 2^53-1) holds nothing.
            token: Token::new(status.fencing_token?).ok()?,
        })
    }

    /// Whether `handle` is a tenure of this very claim (its target, lease id and owner): not one
    /// of a deleted object of the same name.
    pub(crate) fn owns(&self, handle: &LeaseHandle) -> bool {
        handle.lease_id == self.lease_id
            && handle.target == self.target
            && handle.owner == self.owner
    }

    /// The token of the current or last tenure.
    pub(crate) fn last_token(&self) -> Option<u64> {
        self.status.and_then(|s| s.fencing_token)
    }

    /// Whether the claim was Waiting: a grant to it is a hand-over (a Lost claim taking its
    /// target back is not one).
    pub(crate) fn was_waiting(&self) -> bool {
        self.status.map(|s| s.phase) == Some(Phase::Waiting)
    }
}
