//! The key layout. Every key of one target carries the same hash tag, `{<namespace>/<target>}`,
//! so a target's keys live in one cluster slot and one script can touch them all. Targets cannot
//! contain braces (see [`TargetRef::new`]), so the tag cannot be broken.

use crate::store::{RequestId, Slot, StoreError, TargetRef};

/// The keys of one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetKeys {
    base: String,
}

impl TargetKeys {
    /// The keys of `target` under `prefix`.
    pub fn new(prefix: &str, target: &TargetRef) -> Self {
        Self {
            base: format!("{prefix}:{{{}/{}}}", target.namespace(), target.target()),
        }
    }

    /// The lease hash; its TTL is the lease's.
    pub fn lease(&self) -> String {
        format!("{}:lease", self.base)
    }

    /// The fencing high-water mark: never expires, never decreases.
    pub fn fence(&self) -> String {
        format!("{}:fence", self.base)
    }

    /// The request id of the acquire that issued the newest token: never expires, so a replay of
    /// that acquire after its cached reply expired is refused instead of taking a second tenure.
    pub fn grant(&self) -> String {
        format!("{}:grant", self.base)
    }

    /// The lease hash of `slot`: slot 0's is [`TargetKeys::lease`], so an exclusive lease and
    /// slot 0 of permits are one record.
    pub fn lease_of(&self, slot: Slot) -> String {
        match slot.get() {
            0 => self.lease(),
            s => format!("{}:slot:{s}:lease", self.base),
        }
    }

    /// The fence of `slot`: the newest token granted in it (slot 0's is [`TargetKeys::fence`],
    /// which also carries the newest token of the other slots once one was granted).
    pub fn fence_of(&self, slot: Slot) -> String {
        match slot.get() {
            0 => self.fence(),
            s => format!("{}:slot:{s}:fence", self.base),
        }
    }

    /// The grant record of `slot`: the request id of its newest grant (slot 0's is
    /// [`TargetKeys::grant`]).
    pub fn grant_of(&self, slot: Slot) -> String {
        match slot.get() {
            0 => self.grant(),
            s => format!("{}:slot:{s}:grant", self.base),
        }
    }

    /// The permits value in force while permits granted under a value above 1 may be held.
    pub fn permits(&self) -> String {
        format!("{}:permits", self.base)
    }

    /// The cached reply of one request id.
    pub fn reply(&self, request_id: &RequestId) -> String {
        format!("{}:req:{}", self.base, request_id.as_str())
    }

    /// The cached reply of one commit. Apart from the lease and reply keys of the controller,
    /// so that the workload ACL rule (docs/operations.md) can grant `tl:{*}:commit-req:*`
    /// without any right on the controller's keys.
    pub fn commit_reply(&self, request_id: &RequestId) -> String {
        format!("{}:commit-req:{}", self.base, request_id.as_str())
    }

    /// A guarded record written by fenced commits.
    pub fn guarded(&self, key: &str) -> String {
        format!("{}:guarded:{key}", self.base)
    }

    /// A guarded record of `slot` (slot 0's are [`TargetKeys::guarded`]'s).
    pub fn guarded_of(&self, slot: Slot, key: &str) -> String {
        match slot.get() {
            0 => self.guarded(key),
            s => format!("{}:slot:{s}:guarded:{key}", self.base),
        }
    }
}

/// Checks a key prefix: 1 to 64 characters of `[A-Za-z0-9._:-]` (no braces: they would add a
/// second hash tag).
pub fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    if crate::store::names::is_name(prefix, 64, b"._:-") {
        Ok(())
    } else {
        Err(StoreError::InvalidRequest(format!(
            "key prefix {prefix:?} must be 1 to 64 characters of A-Z, a-z, 0-9 and . _ : -"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keys_share_one_hash_tag() {
        let t = TargetRef::new("shop", "orders-db/migration").unwrap();
        let k = TargetKeys::new("tl", &t);
        let rid = RequestId::new("r1").unwrap();
        for key in [
            k.lease(),
            k.fence(),
            k.reply(&rid),
            k.commit_reply(&rid),
            k.grant(),
            k.guarded("x"),
            k.permits(),
            k.lease_of(Slot::new(7).unwrap()),
            k.fence_of(Slot::new(7).unwrap()),
            k.grant_of(Slot::new(7).unwrap()),
            k.guarded_of(Slot::new(7).unwrap(), "x"),
        ] {
            assert!(key.starts_with("tl:{shop/orders-db/migration}:"), "{key}");
            assert_eq!(key.matches('{').count(), 1);
        }
        // Slot 0 is the exclusive lease's record; other slots' keys are their own.
        assert_eq!(k.lease_of(Slot::ZERO), k.lease());
        assert_eq!(k.fence_of(Slot::ZERO), k.fence());
        assert_eq!(k.guarded_of(Slot::ZERO, "x"), k.guarded("x"));
        assert_ne!(
            k.guarded_of(Slot::new(1).unwrap(), "x"),
            k.guarded("slot:1:x")
        );
        assert!(check_prefix("tl").is_ok());
        assert!(check_prefix("a{b").is_err());
    }
}
