//! The protocol's rules applied to one target's records, for the backends that have no scripts:
//! the in-memory store keeps each [`Target`] in a map under a mutex, etcd keeps each one as a
//! record it replaces by compare-and-swap. Each call takes the backend's clock (`now`, in
//! microseconds) and answers as the Lua scripts do on Valkey: same outcomes, same refusals, same
//! token rule, a request id bound to its call and answered once.

mod state;

pub(crate) use self::state::{Cached, TargetState};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use self::state::*;
use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, Grant, GuardedKey,
    GuardedValue, Inspection, LeaseView, LossReason, MAX_TOKEN, Permits, ReleaseOutcome,
    ReleaseRequest, RenewOutcome, RenewRequest, RequestId, Slot, StoreError, Token, check_token,
};

/// Below this many cached replies a target's cache is not swept (see [`Target::idempotent`]).
const SWEEP_FROM: usize = 16;

/// One target's records and the replies cached for its request ids.
#[derive(Default, Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Target {
    records: TargetState,
    replies: BTreeMap<String, Cached>,
    /// The cache's size after its last sweep: the next sweep comes when it has doubled, so a
    /// call costs amortised constant time however many replies a busy target caches.
    #[serde(skip)]
    swept_at: usize,
}

impl Target {
    /// Whether nothing of the target is left at `now` (no lease, fence, guarded record or live
    /// cached reply): a target a backend may forget.
    pub(crate) fn is_empty(&mut self, now: u64) -> bool {
        self.records.expire(now);
        self.replies.retain(|_, cached| cached.expires_us > now);
        let t = &self.records;
        self.replies.is_empty()
            && t.top.is_none()
            && t.guarded.is_empty()
            && t.slots.values().all(|s| s.lease.is_none() && s.fence == 0)
    }

    /// Runs one mutating call: returns the cached reply of `request_id` if there is one (and
    /// refuses the id when it was first used for another call), as `replay` says it reads
    /// against the target now; otherwise runs `op` and caches its reply when it changed state.
    fn idempotent(
        &mut self,
        request_id: &RequestId,
        binding: String,
        now: u64,
        reply_ttl_us: u64,
        replay: impl FnOnce(&TargetState, Reply) -> Reply,
        op: impl FnOnce(&mut TargetState, u64) -> Result<(Reply, bool), StoreError>,
    ) -> Result<Reply, StoreError> {
        if self.replies.len() >= SWEEP_FROM.max(self.swept_at.saturating_mul(2)) {
            self.replies.retain(|_, cached| cached.expires_us > now);
            self.swept_at = self.replies.len();
        }
        self.records.expire(now);
        let rid = request_id.as_str();
        let cached = match self.replies.get(rid) {
            Some(cached) if cached.expires_us > now => {
                if cached.binding != binding {
                    return Err(reused_request_id(cached.reply.operation()));
                }
                Some(cached.reply.clone())
            }
            _ => None,
        };
        if let Some(reply) = cached {
            let answer = replay(&self.records, reply);
            // A replayed grant is cached anew, as the scripts do (they refresh the entry so the
            // durability wait covers the grant): its retries keep finding it.
            if matches!(answer, Reply::Acquire(AcquireOutcome::Acquired(_)))
                && let Some(entry) = self.replies.get_mut(rid)
            {
                entry.expires_us = now.saturating_add(reply_ttl_us);
            }
            return Ok(answer);
        }
        let (reply, changed) = op(&mut self.records, now)?;
        if changed {
            let cached = Cached {
                reply: reply.clone(),
                binding,
                expires_us: now.saturating_add(reply_ttl_us),
            };
            self.replies.insert(rid.to_owned(), cached);
        }
        Ok(reply)
    }

    pub(crate) fn acquire(
        &mut self,
        req: &AcquireRequest,
        now: u64,
        reply_ttl_us: u64,
    ) -> Result<AcquireOutcome, StoreError> {
        let ttl_ms = req.ttl.millis();
        check_token("min_token", req.min_token, false)?;
        if req.min_token >= MAX_TOKEN {
            return Err(exhausted(0, req.min_token));
        }
        let permits = req.permits.get();
        let shared = permits > 1;
        // The floor and the permits are bound too: a retry with another is another call.
        let floor = req.min_token.to_string();
        let permits_text = permits.to_string();
        let mut parts = vec!["acquire", req.lease_id.expose(), req.owner.as_str(), &floor];
        if shared {
            parts.push(&permits_text);
        }
        let bound = binding(&parts);
        let rid = req.request_id.as_str();
        // A retry is answered with its first grant only while that grant still stands.
        let replay = |t: &TargetState, reply| match reply {
            Reply::Acquire(AcquireOutcome::Acquired(g))
                if !t.lease(g.slot).is_some_and(|l| {
                    l.lease_id == req.lease_id
                        && l.owner == req.owner.as_str()
                        && l.token == g.token
                }) =>
            {
                Reply::Acquire(AcquireOutcome::Expired { token: g.token })
            }
            other => other,
        };
        let reply = self.idempotent(
            &req.request_id,
            bound,
            now,
            reply_ttl_us,
            replay,
            |t, now| {
                let now_ms = micros_to_millis(now);
                let answer = |outcome| Ok((Reply::Acquire(outcome), false));
                // Every slot is read before anything is decided, as the script does.
                let (mut mine, mut free, mut first_out, mut conflict) = (None, None, None, None);
                for slot in req.permits.slots() {
                    let Some(lease) = t.lease(slot) else {
                        free = free.or(Some(slot));
                        continue;
                    };
                    if lease.permits != permits {
                        conflict = Some(lease.permits);
                    }
                    if lease.lease_id == req.lease_id && lease.owner == req.owner.as_str() {
                        mine = Some(slot);
                    } else if first_out
                        .as_ref()
                        .is_none_or(|(_, at): &(String, u64)| lease.expires_at_us < *at)
                    {
                        first_out = Some((lease.owner.clone(), lease.expires_at_us));
                    }
                }
                let held = |first_out: Option<(String, u64)>| {
                    let (owner, at) = first_out.unwrap_or_default();
                    AcquireOutcome::Held {
                        owner,
                        expires_in_ms: micros_to_millis(at.saturating_sub(now)),
                    }
                };
                if let Some(in_force) = conflict {
                    return answer(AcquireOutcome::PermitsConflict { in_force });
                }
                if !shared && first_out.is_some() {
                    return answer(held(first_out));
                }
                // An exclusive claim reads the value in force only once permits were granted in a
                // slot from 1 (the scripts learn it from slot 0's fence at no cost).
                let in_force = t.permits.filter(|_| shared || t.top.is_some());
                if let Some((in_force, _)) = in_force.filter(|(n, _)| *n != permits) {
                    return answer(AcquireOutcome::PermitsConflict { in_force });
                }
                let newest = t.newest();
                if let Some(slot) = mine {
                    // Ours already: the same slot and token, unless it is not above the floor or is
                    // below the slot's fence (a restored record); a lost fence is raised again.
                    if shared {
                        t.keep_permits(permits, now, ttl_ms);
                    }
                    let slot_fence = t.fence(slot);
                    let mut token = t.lease(slot).map_or(0, |l| l.token);
                    if token <= req.min_token || token < slot_fence {
                        token = next_token(newest, req.min_token, now)?;
                        t.issued_to(slot, token, shared);
                        t.slot_mut(slot).fence_request = Some(rid.to_owned());
                    } else if slot_fence < token {
                        t.restore_fence(slot, token);
                    }
                    let lease = t
                        .slot_mut(slot)
                        .lease
                        .as_mut()
                        .ok_or_else(|| unexpected("acquire"))?;
                    lease.token = token;
                    lease.expires_at_us = now + ttl_ms * 1000;
                    let grant = Grant {
                        token,
                        slot,
                        acquired_at_ms: lease.acquired_ms,
                        server_time_ms: now_ms,
                        expires_in_ms: ttl_ms,
                    };
                    return Ok((Reply::Acquire(AcquireOutcome::Acquired(grant)), true));
                }
                let Some(slot) = free else {
                    return answer(held(first_out));
                };
                if req.permits.slots().any(|s| {
                    t.slot(s)
                        .is_some_and(|s| s.fence_request.as_deref() == Some(rid))
                }) {
                    return Err(StoreError::InvalidRequest(
                        "request id already acquired a token on this target and its cached reply \
                     expired; a replay never takes a second tenure: use a new request id"
                            .into(),
                    ));
                }
                let token = next_token(newest, req.min_token, now)?;
                if shared {
                    t.keep_permits(permits, now, ttl_ms);
                }
                t.issued_to(slot, token, shared);
                let state = t.slot_mut(slot);
                state.fence_request = Some(rid.to_owned());
                state.lease = Some(Lease {
                    lease_id: req.lease_id.clone(),
                    owner: req.owner.as_str().to_owned(),
                    permits,
                    token,
                    acquired_ms: now_ms,
                    expires_at_us: now + ttl_ms * 1000,
                });
                let grant = Grant {
                    token,
                    slot,
                    acquired_at_ms: now_ms,
                    server_time_ms: now_ms,
                    expires_in_ms: ttl_ms,
                };
                Ok((Reply::Acquire(AcquireOutcome::Acquired(grant)), true))
            },
        )?;
        match reply {
            Reply::Acquire(outcome) => Ok(outcome),
            _ => Err(unexpected("acquire")),
        }
    }

    pub(crate) fn renew(
        &mut self,
        req: &RenewRequest,
        now: u64,
        reply_ttl_us: u64,
    ) -> Result<RenewOutcome, StoreError> {
        let ttl_ms = req.ttl.millis();
        let handle = &req.lease;
        handle.permits.check_slot(handle.slot)?;
        let permits = handle.permits.get();
        let token = handle.token.to_string();
        let bound = binding(&[
            "renew",
            handle.lease_id.expose(),
            handle.owner.as_str(),
            &token,
        ]);
        // A token below the slot's fence (a restored record) is not the holder's any more; a
        // retry is answered with its first reply only while the lease it renewed still stands.
        let loss = |t: &TargetState| {
            if t.lease(handle.slot).is_none() {
                Some(LossReason::Expired)
            } else if t.holds(handle).is_none() || handle.token.get() < t.fence(handle.slot) {
                Some(LossReason::NotHolder)
            } else {
                None
            }
        };
        let replay = |t: &TargetState, reply| match loss(t) {
            Some(reason) => Reply::Renew(RenewOutcome::Lost { reason }),
            None => reply,
        };
        let reply = self.idempotent(
            &req.request_id,
            bound,
            now,
            reply_ttl_us,
            replay,
            |t, now| {
                if let Some(reason) = loss(t) {
                    return Ok((Reply::Renew(RenewOutcome::Lost { reason }), false));
                }
                granted_under(t.holds(handle), permits)?;
                // The slot's fence and `top` at least at the holder's token, as the script keeps them.
                t.restore_fence(handle.slot, handle.token.get());
                if permits > 1 {
                    t.keep_permits(permits, now, ttl_ms);
                }
                if let Some(lease) = t.slot_mut(handle.slot).lease.as_mut() {
                    lease.expires_at_us = now + ttl_ms * 1000;
                }
                let renewed = RenewOutcome::Renewed {
                    server_time_ms: micros_to_millis(now),
                    expires_in_ms: ttl_ms,
                };
                Ok((Reply::Renew(renewed), true))
            },
        )?;
        match reply {
            Reply::Renew(outcome) => Ok(outcome),
            _ => Err(unexpected("renew")),
        }
    }

    pub(crate) fn release(
        &mut self,
        req: &ReleaseRequest,
        now: u64,
        reply_ttl_us: u64,
    ) -> Result<ReleaseOutcome, StoreError> {
        let handle = &req.lease;
        handle.permits.check_slot(handle.slot)?;
        let permits = handle.permits.get();
        let token = handle.token.to_string();
        let bound = binding(&[
            "release",
            handle.lease_id.expose(),
            handle.owner.as_str(),
            &token,
        ]);
        let reply = self.idempotent(&req.request_id, bound, now, reply_ttl_us, keep, |t, _| {
            if t.holds(handle).is_none() {
                return Ok((Reply::Release(ReleaseOutcome::NotHolder), false));
            }
            granted_under(t.holds(handle), permits)?;
            t.slot_mut(handle.slot).lease = None;
            // The permits value in force goes with the last permit released.
            if permits > 1 && !handle.permits.slots().any(|s| t.lease(s).is_some()) {
                t.permits = None;
            }
            Ok((Reply::Release(ReleaseOutcome::Released), true))
        })?;
        match reply {
            Reply::Release(outcome) => Ok(outcome),
            _ => Err(unexpected("release")),
        }
    }

    pub(crate) fn commit(
        &mut self,
        req: &CommitRequest,
        now: u64,
        reply_ttl_us: u64,
    ) -> Result<CommitOutcome, StoreError> {
        check_token("sequence", req.sequence, false)?;
        let (token, sequence) = (req.token.to_string(), req.sequence.to_string());
        let digest = sha1_smol::Sha1::from(req.value.as_bytes())
            .digest()
            .to_string();
        let key = req.bound_key();
        let bound = binding(&["commit", &token, &key, &sequence, &digest]);
        let reply = self.idempotent(&req.request_id, bound, now, reply_ttl_us, keep, |t, _| {
            let committed = || {
                let committed = CommitOutcome::Committed {
                    token: req.token.get(),
                };
                Ok((Reply::Commit(committed), true))
            };
            let stale = |newest| Ok((Reply::Commit(CommitOutcome::Stale { newest }), false));
            let fence = t.fence(req.slot);
            if req.token.get() < fence {
                return stale(fence);
            }
            if req.token.get() > fence {
                return Err(never_issued(req.token.get(), fence));
            }
            if let Some(last) = t.guarded(req.slot, req.key.as_str()) {
                let ours = (req.token.get(), req.sequence);
                let theirs = (last.token, last.sequence);
                if ours < theirs || (ours == theirs && last.value != req.value) {
                    return stale(last.token);
                }
                if ours == theirs {
                    // This very write is already there: answer as the first call did.
                    return committed();
                }
            }
            let record = GuardedRecord {
                token: req.token.get(),
                sequence: req.sequence,
                value: req.value.clone(),
            };
            t.guarded
                .entry(req.slot.get())
                .or_default()
                .insert(req.key.as_str().to_owned(), record);
            committed()
        })?;
        match reply {
            Reply::Commit(outcome) => Ok(outcome),
            _ => Err(unexpected("commit")),
        }
    }

    pub(crate) fn read_guarded(&self, slot: Slot, key: &GuardedKey) -> Option<GuardedValue> {
        let record = self.records.guarded(slot, key.as_str())?;
        Some(GuardedValue {
            token: record.token,
            value: record.value.clone(),
        })
    }

    pub(crate) fn check(&self, slot: Slot, token: Token) -> Result<CheckOutcome, StoreError> {
        let (token, fence) = (token.get(), self.records.fence(slot));
        match token.cmp(&fence) {
            std::cmp::Ordering::Less => Ok(CheckOutcome::Stale { newest: fence }),
            std::cmp::Ordering::Equal => Ok(CheckOutcome::Current { newest: fence }),
            std::cmp::Ordering::Greater => Err(never_issued(token, fence)),
        }
    }

    /// The newest token issued on the target, in any slot.
    pub(crate) fn newest(&self) -> u64 {
        self.records.newest()
    }

    pub(crate) fn inspect(&mut self, now: u64) -> Inspection {
        let t = &mut self.records;
        t.expire(now);
        let mut views = t.slots.iter().filter_map(|(slot, state)| {
            let l = state.lease.as_ref()?;
            Some(LeaseView {
                slot: Slot::new(*slot).ok()?,
                permits: Permits::new(l.permits).ok()?,
                owner: l.owner.clone(),
                token: l.token,
                acquired_at_ms: l.acquired_ms,
                expires_in_ms: micros_to_millis(l.expires_at_us.saturating_sub(now)),
                lease_id: l.lease_id.clone(),
            })
        });
        let lease = t.lease(Slot::ZERO).and_then(|_| views.next());
        let slots: Vec<LeaseView> = views.collect();
        let held_under = t
            .slots
            .values()
            .filter_map(|s| s.lease.as_ref().map(|l| l.permits))
            .max();
        Inspection {
            fence: t.newest(),
            server_time_ms: micros_to_millis(now),
            permits: held_under.unwrap_or(1),
            lease,
            slots,
        }
    }
}

/// What an empty target inspects as at `now`.
pub(crate) fn nothing_at(now: u64) -> Inspection {
    Inspection {
        fence: 0,
        server_time_ms: micros_to_millis(now),
        permits: 1,
        lease: None,
        slots: Vec::new(),
    }
}

impl Target {
    /// Records that replace an unreadable record: nothing held, every slot fenced at `fence`
    /// (the next grant in any slot is above it).
    pub(crate) fn fenced_at(fence: u64) -> TargetState {
        let mut records = TargetState::default();
        records.restore_fence(Slot::ZERO, fence);
        records.top = Some(fence);
        records
    }

    /// A target from its records and the replies a backend that keeps them apart found for
    /// the call at hand.
    pub(crate) fn from_parts(records: TargetState, replies: BTreeMap<String, Cached>) -> Target {
        Target {
            records,
            replies,
            swept_at: 0,
        }
    }

    /// Its records and its cached replies.
    pub(crate) fn into_parts(self) -> (TargetState, BTreeMap<String, Cached>) {
        (self.records, self.replies)
    }
}
