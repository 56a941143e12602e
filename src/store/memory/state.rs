//! The in-memory store's state: each target's slots, fences and guarded records as the
//! scripts keep them in Valkey, the reply cache, and the rules they share with the scripts
//! (the token rule, a request id bound to its call).

use std::collections::{BTreeMap, HashMap};

use crate::store::{
    AcquireOutcome, CommitOutcome, LeaseHandle, LeaseId, MAX_FLOOR_LEAD_MICROS, MAX_TOKEN,
    MAX_TOKEN_LEAD_MICROS, ReleaseOutcome, RenewOutcome, Slot, StoreError, TargetRef,
};

#[derive(Default, Clone)]
pub(super) struct State {
    pub(super) targets: HashMap<TargetRef, TargetState>,
    pub(super) replies: HashMap<(TargetRef, String), Cached>,
    pub(super) calls_since_sweep: u32,
}

/// A cached reply and the call it answered.
#[derive(Clone)]
pub(super) struct Cached {
    pub(super) reply: Reply,
    pub(super) binding: String,
    pub(super) expires_us: u64,
}

/// One target: its slots (slot 0 is the exclusive lease's), as the scripts keep them.
#[derive(Default, Clone)]
pub(super) struct TargetState {
    pub(super) slots: BTreeMap<u32, SlotState>,
    /// The newest token issued in any slot from 1 (with slot 0's fence, the target's newest),
    /// kept as the scripts keep it in slot 0's fence: from the first grant of such a slot until
    /// an exclusive grant, which is above it and needs no permit check after it.
    pub(super) top: Option<u64>,
    /// The permits value in force and when it expires: kept while a permit granted under a
    /// value above 1 may be held.
    pub(super) permits: Option<(u32, u64)>,
    /// Guarded records by slot and name.
    pub(super) guarded: HashMap<(Slot, String), GuardedRecord>,
}

#[derive(Default, Clone)]
pub(super) struct SlotState {
    pub(super) lease: Option<Lease>,
    /// The newest token granted in this slot.
    pub(super) fence: u64,
    /// The request id of the acquire that issued `fence`: spent, even after its cached reply.
    pub(super) fence_request: Option<String>,
}

#[derive(Clone)]
pub(super) struct GuardedRecord {
    pub(super) token: u64,
    pub(super) sequence: u64,
    pub(super) value: String,
}

#[derive(Clone)]
pub(super) struct Lease {
    pub(super) lease_id: LeaseId,
    pub(super) owner: String,
    /// What it was granted under (1: the exclusive lease).
    pub(super) permits: u32,
    pub(super) token: u64,
    pub(super) acquired_ms: u64,
    pub(super) expires_at_us: u64,
}

#[derive(Clone)]
pub(super) enum Reply {
    Acquire(AcquireOutcome),
    Renew(RenewOutcome),
    Release(ReleaseOutcome),
    Commit(CommitOutcome),
}

impl State {
    /// Drops expired cached replies now and then, so the cache stays bounded.
    pub(super) fn sweep(&mut self, now: u64) {
        self.calls_since_sweep += 1;
        if self.calls_since_sweep >= 1024 {
            self.calls_since_sweep = 0;
            self.replies.retain(|_, cached| cached.expires_us > now);
            self.targets.retain(|_, t| {
                t.expire(now);
                t.top.is_some()
                    || !t.guarded.is_empty()
                    || t.slots.values().any(|s| s.lease.is_some() || s.fence > 0)
            });
        }
    }
}

impl TargetState {
    pub(super) fn expire(&mut self, now: u64) {
        for slot in self.slots.values_mut() {
            if slot.lease.as_ref().is_some_and(|l| l.expires_at_us <= now) {
                slot.lease = None;
            }
        }
        if self.permits.is_some_and(|(_, expires)| expires <= now) {
            self.permits = None;
        }
    }

    pub(super) fn slot(&self, slot: Slot) -> Option<&SlotState> {
        self.slots.get(&slot.get())
    }

    pub(super) fn slot_mut(&mut self, slot: Slot) -> &mut SlotState {
        self.slots.entry(slot.get()).or_default()
    }

    pub(super) fn lease(&self, slot: Slot) -> Option<&Lease> {
        self.slot(slot).and_then(|s| s.lease.as_ref())
    }

    pub(super) fn fence(&self, slot: Slot) -> u64 {
        self.slot(slot).map_or(0, |s| s.fence)
    }

    /// The newest token issued on the target, in any slot.
    pub(super) fn newest(&self) -> u64 {
        self.fence(Slot::ZERO).max(self.top.unwrap_or(0))
    }

    pub(super) fn holds(&self, handle: &LeaseHandle) -> Option<&Lease> {
        self.lease(handle.slot).filter(|l| {
            l.lease_id == handle.lease_id
                && l.owner == handle.owner.as_str()
                && l.token == handle.token.get()
        })
    }

    /// Records a token just issued (above every token of the target) as `slot`'s newest grant.
    /// An exclusive grant leaves no `top`: it is above every permit's token, and no permit is
    /// held beside it.
    pub(super) fn issued_to(&mut self, slot: Slot, token: u64, shared: bool) {
        self.slot_mut(slot).fence = token;
        if !shared {
            self.top = None;
        } else if slot != Slot::ZERO {
            self.top = Some(token);
        }
    }

    /// Raises `slot`'s fence, lost or lowered while its lease survived, to the lease's token;
    /// `top` only grows.
    pub(super) fn restore_fence(&mut self, slot: Slot, token: u64) {
        self.slot_mut(slot).fence = token;
        if slot != Slot::ZERO {
            self.top = Some(self.top.unwrap_or(0).max(token));
        }
    }

    /// Keeps the permits value in force for at least `ttl_ms` more.
    pub(super) fn keep_permits(&mut self, permits: u32, now: u64, ttl_ms: u64) {
        let until = now + ttl_ms * 1000;
        match &mut self.permits {
            Some((_, expires)) if *expires >= until => {}
            other => *other = Some((permits, until)),
        }
    }
}

/// A replay answered with its first reply as it is: releases and commits (a release that was
/// answered stays answered; a commit is checked against the record anyway).
pub(super) fn keep(_: &TargetState, reply: Reply) -> Reply {
    reply
}

pub(super) fn micros_to_millis(us: u64) -> u64 {
    us / 1000
}

impl Reply {
    pub(super) fn operation(&self) -> &'static str {
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
pub(super) fn binding(parts: &[&str]) -> String {
    parts.iter().map(|p| format!("{}:{p},", p.len())).collect()
}

pub(super) fn reused_request_id(first: &str) -> StoreError {
    StoreError::InvalidRequest(format!(
        "request id already used for another call ({first} with other arguments) on this \
         target; a request id names one call and its retries: use a new one"
    ))
}

pub(super) fn unexpected(op: &str) -> StoreError {
    StoreError::UnexpectedReply(format!(
        "request id was first used for another kind of call than {op}"
    ))
}

/// The next token: above the fence and the floor, and at least the clock in microseconds plus
/// [`MAX_TOKEN_LEAD_MICROS`], on every grant (docs/internals/store.md, "The token rule"). A floor more
/// than [`MAX_FLOOR_LEAD_MICROS`] ahead of the clock was not issued by a store and is refused.
pub(super) fn next_token(fence: u64, min_token: u64, now_us: u64) -> Result<u64, StoreError> {
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

pub(super) fn exhausted(fence: u64, min_token: u64) -> StoreError {
    StoreError::InvalidRequest(format!(
        "no token can be issued: the fence ({fence}) or the floor ({min_token}) is at the \
         largest token 2^53-1"
    ))
}

/// Refuses a renew or a release naming other permits than the lease was granted under.
pub(super) fn granted_under(lease: Option<&Lease>, permits: u32) -> Result<(), StoreError> {
    match lease {
        Some(lease) if lease.permits != permits => Err(StoreError::InvalidRequest(format!(
            "permits {permits} is not what this lease was granted under ({})",
            lease.permits
        ))),
        _ => Ok(()),
    }
}

pub(super) fn never_issued(token: u64, fence: u64) -> StoreError {
    StoreError::InvalidRequest(format!(
        "token {token} was never issued for this target (the newest is {fence}; 0 means none, \
         or the store lost its data)"
    ))
}
