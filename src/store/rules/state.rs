//! One target's records as every backend keeps them: its slots, fences and guarded records,
//! the replies cached for its request ids, and the rules the calls share with the Lua scripts
//! (the token rule, a request id bound to its call). Serializable, so that a backend without
//! scripts (etcd) keeps them as one record per target; unknown fields are refused, so a record
//! written by a later version fails closed instead of being written back without them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::store::{
    AcquireOutcome, CommitOutcome, LeaseHandle, LeaseId, MAX_FLOOR_LEAD_MICROS, MAX_TOKEN,
    MAX_TOKEN_LEAD_MICROS, ReleaseOutcome, RenewOutcome, Slot, StoreError,
};

/// A cached reply and the call it answered.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Cached {
    pub(crate) reply: Reply,
    /// The call's arguments, lease id included: kept whole for the comparison, never shown.
    pub(crate) binding: String,
    pub(crate) expires_us: u64,
}

impl std::fmt::Debug for Cached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cached")
            .field("reply", &self.reply)
            .field("binding", &"***")
            .field("expires_us", &self.expires_us)
            .finish()
    }
}

/// One target: its slots (slot 0 is the exclusive lease's), as the scripts keep them.
#[derive(Default, Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TargetState {
    pub(crate) slots: BTreeMap<u32, SlotState>,
    /// The newest token issued in any slot from 1 (with slot 0's fence, the target's newest),
    /// kept as the scripts keep it in slot 0's fence: from the first grant of such a slot until
    /// an exclusive grant, which is above it and needs no permit check after it.
    pub(crate) top: Option<u64>,
    /// The permits value in force and when it expires: kept while a permit granted under a
    /// value above 1 may be held.
    pub(crate) permits: Option<(u32, u64)>,
    /// Guarded records by slot and name.
    pub(crate) guarded: BTreeMap<u32, BTreeMap<String, GuardedRecord>>,
}

#[derive(Default, Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SlotState {
    pub(crate) lease: Option<Lease>,
    /// The newest token granted in this slot.
    pub(crate) fence: u64,
    /// The request id of the acquire that issued `fence`: spent, even after its cached reply.
    pub(crate) fence_request: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GuardedRecord {
    pub(crate) token: u64,
    pub(crate) sequence: u64,
    pub(crate) value: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Lease {
    #[serde(with = "lease_id_text")]
    pub(crate) lease_id: LeaseId,
    pub(crate) owner: String,
    /// What it was granted under (1: the exclusive lease).
    pub(crate) permits: u32,
    pub(crate) token: u64,
    pub(crate) acquired_ms: u64,
    pub(crate) expires_at_us: u64,
}

/// A lease id kept whole in the store's own records (and nowhere else), checked when read.
mod lease_id_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::store::LeaseId;

    pub(crate) fn serialize<S: Serializer>(id: &LeaseId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(id.expose())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<LeaseId, D::Error> {
        LeaseId::new(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Reply {
    Acquire(AcquireOutcome),
    Renew(RenewOutcome),
    Release(ReleaseOutcome),
    Commit(CommitOutcome),
}

impl TargetState {
    pub(crate) fn expire(&mut self, now: u64) {
        for slot in self.slots.values_mut() {
            if slot.lease.as_ref().is_some_and(|l| l.expires_at_us <= now) {
                slot.lease = None;
            }
        }
        if self.permits.is_some_and(|(_, expires)| expires <= now) {
            self.permits = None;
        }
    }

    pub(crate) fn guarded(&self, slot: Slot, key: &str) -> Option<&GuardedRecord> {
        self.guarded.get(&slot.get())?.get(key)
    }

    pub(crate) fn slot(&self, slot: Slot) -> Option<&SlotState> {
        self.slots.get(&slot.get())
    }

    pub(crate) fn slot_mut(&mut self, slot: Slot) -> &mut SlotState {
        self.slots.entry(slot.get()).or_default()
    }

    pub(crate) fn lease(&self, slot: Slot) -> Option<&Lease> {
        self.slot(slot).and_then(|s| s.lease.as_ref())
    }

    pub(crate) fn fence(&self, slot: Slot) -> u64 {
        self.slot(slot).map_or(0, |s| s.fence)
    }

    /// The newest token issued on the target, in any slot.
    pub(crate) fn newest(&self) -> u64 {
        self.fence(Slot::ZERO).max(self.top.unwrap_or(0))
    }

    pub(crate) fn holds(&self, handle: &LeaseHandle) -> Option<&Lease> {
        self.lease(handle.slot).filter(|l| {
            l.lease_id == handle.lease_id
                && l.owner == handle.owner.as_str()
                && l.token == handle.token.get()
        })
    }

    /// Records a token just issued (above every token of the target) as `slot`'s newest grant.
    /// An exclusive grant leaves no `top`: it is above every permit's token, and no permit is
    /// held beside it.
    pub(crate) fn issued_to(&mut self, slot: Slot, token: u64, shared: bool) {
        self.slot_mut(slot).fence = token;
        if !shared {
            self.top = None;
        } else if slot != Slot::ZERO {
            self.top = Some(token);
        }
    }

    /// Raises `slot`'s fence, lost or lowered while its lease survived, to the lease's token;
    /// `top` only grows.
    pub(crate) fn restore_fence(&mut self, slot: Slot, token: u64) {
        self.slot_mut(slot).fence = token;
        if slot != Slot::ZERO {
            self.top = Some(self.top.unwrap_or(0).max(token));
        }
    }

    /// Keeps the permits value in force for at least `ttl_ms` more.
    pub(crate) fn keep_permits(&mut self, permits: u32, now: u64, ttl_ms: u64) {
        let until = now + ttl_ms * 1000;
        match &mut self.permits {
            Some((_, expires)) if *expires >= until => {}
            other => *other = Some((permits, until)),
        }
    }
}

/// A replay answered with its first reply as it is: releases and commits (a release that was
/// answered stays answered; a commit is checked against the record anyway).
pub(crate) fn keep(_: &TargetState, reply: Reply) -> Reply {
    reply
}

pub(crate) fn micros_to_millis(us: u64) -> u64 {
    us / 1000
}

impl Reply {
    pub(crate) fn operation(&self) -> &'static str {
        match self {
            Reply::Acquire(_) => "acquire",
            Reply::Renew(_) => "renew",
            Reply::Release(_) => "release",
            Reply::Commit(_) => "commit",
        }
    }
}

/// What a request id is bound to: the operation and every argument that identifies the call,
/// each length-prefixed so no two argument lists give the same text.
pub(crate) fn binding(parts: &[&str]) -> String {
    parts.iter().map(|p| format!("{}:{p},", p.len())).collect()
}

pub(crate) fn reused_request_id(first: &str) -> StoreError {
    StoreError::InvalidRequest(format!(
        "request id already used for another call ({first} with other arguments) on this \
         target; a request id names one call and its retries: use a new one"
    ))
}

pub(crate) fn unexpected(op: &str) -> StoreError {
    StoreError::UnexpectedReply(format!(
        "request id was first used for another kind of call than {op}"
    ))
}

/// The next token: above the fence and the floor, and at least the clock in microseconds plus
/// [`MAX_TOKEN_LEAD_MICROS`], on every grant (docs/internals/store.md, "The token rule"). A floor more
/// than [`MAX_FLOOR_LEAD_MICROS`] ahead of the clock was not issued by a store and is refused.
pub(crate) fn next_token(fence: u64, min_token: u64, now_us: u64) -> Result<u64, StoreError> {
    let lead = now_us.saturating_add(MAX_TOKEN_LEAD_MICROS);
    if min_token > now_us.saturating_add(MAX_FLOOR_LEAD_MICROS) {
        return Err(StoreError::InvalidRequest(format!(
            "floor {min_token} is more than two hours ahead of the server clock ({now_us} \
             microseconds): no token a store issues is that large, so it came from another \
             store, or from a server whose clock was more than an hour ahead of this one"
        )));
    }
    let token = fence
        .saturating_add(1)
        .max(min_token.saturating_add(1))
        .max(lead);
    if token > MAX_TOKEN {
        return Err(exhausted(fence, min_token));
    }
    Ok(token)
}

pub(crate) fn exhausted(fence: u64, min_token: u64) -> StoreError {
    StoreError::InvalidRequest(format!(
        "no token can be issued: the fence ({fence}) or the floor ({min_token}) is at the \
         largest token 2^53-1"
    ))
}

/// Refuses a renew or a release naming other permits than the lease was granted under.
pub(crate) fn granted_under(lease: Option<&Lease>, permits: u32) -> Result<(), StoreError> {
    match lease {
        Some(lease) if lease.permits != permits => Err(StoreError::InvalidRequest(format!(
            "permits {permits} is not what this lease was granted under ({})",
            lease.permits
        ))),
        _ => Ok(()),
    }
}

pub(crate) fn never_issued(token: u64, fence: u64) -> StoreError {
    StoreError::InvalidRequest(format!(
        "token {token} was never issued for this target (the newest is {fence}; 0 means none, \
         or the store lost its data)"
    ))
}
