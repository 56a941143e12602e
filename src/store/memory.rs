//! The in-memory backend: the same protocol in one process. It is the single-process default
//! (`--backend memory`) and the fast backend for unit tests, with an injectable clock.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, DEFAULT_REPLY_TTL,
    Grant, GuardedKey, GuardedValue, Inspection, LeaseHandle, LeaseId, LeaseStore, LeaseView,
    LossReason, MAX_FLOOR_LEAD_MICROS, MAX_TOKEN, MAX_TOKEN_LEAD_MICROS, ReleaseOutcome,
    ReleaseRequest, RenewOutcome, RenewRequest, RepairOutcome, RequestId, Slot, StoreError,
    TargetRef, Token, check_token,
};

/// A source of time for the in-memory backend, in microseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    /// The current time.
    fn now_micros(&self) -> u64;
}

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_micros(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that moves only when told to; clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock starting at the current system time.
    pub fn new() -> Self {
        Self(Arc::new(AtomicU64::new(SystemClock.now_micros())))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.0.fetch_add(us, Ordering::SeqCst);
    }

    /// Moves the clock backwards, as a restored or failed-over server's clock might.
    pub fn rewind(&self, by: Duration) {
        let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.0.fetch_sub(us, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// The in-memory lease store.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    reply_ttl_us: u64,
    state: Mutex<State>,
}

/// What [`MemoryStore::snapshot`] copied.
pub struct MemorySnapshot(State);

#[derive(Default, Clone)]
struct State {
    targets: HashMap<TargetRef, TargetState>,
    replies: HashMap<(TargetRef, String), Cached>,
    calls_since_sweep: u32,
}

/// A cached reply and the call it answered.
#[derive(Clone)]
struct Cached {
    reply: Reply,
    binding: String,
    expires_us: u64,
}

/// One target: its slots (slot 0 is the exclusive lease's), as the scripts keep them.
#[derive(Default, Clone)]
struct TargetState {
    slots: BTreeMap<u32, SlotState>,
    /// The newest token issued in any slot from 1 (with slot 0's fence, the target's newest),
    /// kept as the scripts keep it in slot 0's fence: from the first grant of such a slot until
    /// an exclusive grant, which is above it and needs no permit check after it.
    top: Option<u64>,
    /// The permits value in force and when it expires: kept while a permit granted under a
    /// value above 1 may be held.
    permits: Option<(u32, u64)>,
    /// Guarded records by slot and name.
    guarded: HashMap<(Slot, String), GuardedRecord>,
}

#[derive(Default, Clone)]
struct SlotState {
    lease: Option<Lease>,
    /// The newest token granted in this slot.
    fence: u64,
    /// The request id of the acquire that issued `fence`: spent, even after its cached reply.
    fence_request: Option<String>,
}

#[derive(Clone)]
struct GuardedRecord {
    token: u64,
    sequence: u64,
    value: String,
}

#[derive(Clone)]
struct Lease {
    lease_id: LeaseId,
    owner: String,
    /// What it was granted under (1: the exclusive lease).
    permits: u32,
    token: u64,
    acquired_ms: u64,
    expires_at_us: u64,
}

#[derive(Clone)]
enum Reply {
    Acquire(AcquireOutcome),
    Renew(RenewOutcome),
    Release(ReleaseOutcome),
    Commit(CommitOutcome),
}

impl MemoryStore {
    /// A store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock), DEFAULT_REPLY_TTL)
    }

    /// A store on the given clock, caching replies for `reply_ttl`.
    pub fn with_clock(clock: Arc<dyn Clock>, reply_ttl: Duration) -> Self {
        Self {
            clock,
            reply_ttl_us: u64::try_from(reply_ttl.as_micros()).unwrap_or(u64::MAX),
            state: Mutex::new(State::default()),
        }
    }

    /// Drops every lease, fence and cached reply: what a Valkey `FLUSHALL` or a restart
    /// without persistence does. For tests of the token floor.
    pub fn forget_everything(&self) {
        *self.lock() = State::default();
    }

    /// A copy of everything the store holds now: what a replica in sync at this moment, or a
    /// snapshot saved now, would hold. For tests of stale servers.
    pub fn snapshot(&self) -> MemorySnapshot {
        MemorySnapshot(self.lock().clone())
    }

    /// Brings the store back to `snapshot`, losing everything written since: what a restart
    /// from an older snapshot does. For tests of stale servers.
    pub fn restore(&self, snapshot: &MemorySnapshot) {
        *self.lock() = snapshot.0.clone();
    }

    /// A second store on the same clock holding `snapshot`: what a replica that stopped
    /// replicating at the snapshot holds once it is promoted. For tests of stale servers.
    pub fn promoted(&self, snapshot: &MemorySnapshot) -> MemoryStore {
        Self {
            clock: self.clock.clone(),
            reply_ttl_us: self.reply_ttl_us,
            state: Mutex::new(snapshot.0.clone()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-written: every mutation
        // below is a single assignment after all checks.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one mutating call: returns the cached reply of `request_id` if there is one (and
    /// refuses the id when it was first used for another call), as `replay` says it reads
    /// against the target now; otherwise runs `op` and caches its reply when it changed state.
    fn idempotent(
        &self,
        target: &TargetRef,
        request_id: &RequestId,
        binding: String,
        replay: impl FnOnce(&TargetState, Reply) -> Reply,
        op: impl FnOnce(&mut TargetState, u64) -> Result<(Reply, bool), StoreError>,
    ) -> Result<Reply, StoreError> {
        let now = self.clock.now_micros();
        let mut state = self.lock();
        state.sweep(now);
        let cache_key = (target.clone(), request_id.as_str().to_owned());
        let cached = match state.replies.get(&cache_key) {
            Some(cached) if cached.expires_us > now => {
                if cached.binding != binding {
                    return Err(reused_request_id(cached.reply.operation()));
                }
                Some(cached.reply.clone())
            }
            _ => None,
        };
        let entry = state.targets.entry(target.clone()).or_default();
        entry.expire(now);
        if let Some(reply) = cached {
            let answer = replay(entry, reply);
            // A replayed grant is cached anew, as the scripts do (they refresh the entry so the
            // durability wait covers the grant): its retries keep finding it.
            if matches!(answer, Reply::Acquire(AcquireOutcome::Acquired(_)))
                && let Some(entry) = state.replies.get_mut(&cache_key)
            {
                entry.expires_us = now.saturating_add(self.reply_ttl_us);
            }
            return Ok(answer);
        }
        let (reply, changed) = op(entry, now)?;
        if changed {
            let cached = Cached {
                reply: reply.clone(),
                binding,
                expires_us: now.saturating_add(self.reply_ttl_us),
            };
            state.replies.insert(cache_key, cached);
        }
        Ok(reply)
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl State {
    /// Drops expired cached replies now and then, so the cache stays bounded.
    fn sweep(&mut self, now: u64) {
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
    fn expire(&mut self, now: u64) {
        for slot in self.slots.values_mut() {
            if slot.lease.as_ref().is_some_and(|l| l.expires_at_us <= now) {
                slot.lease = None;
            }
        }
        if self.permits.is_some_and(|(_, expires)| expires <= now) {
            self.permits = None;
        }
    }

    fn slot(&self, slot: Slot) -> Option<&SlotState> {
        self.slots.get(&slot.get())
    }

    fn slot_mut(&mut self, slot: Slot) -> &mut SlotState {
        self.slots.entry(slot.get()).or_default()
    }

    fn lease(&self, slot: Slot) -> Option<&Lease> {
        self.slot(slot).and_then(|s| s.lease.as_ref())
    }

    fn fence(&self, slot: Slot) -> u64 {
        self.slot(slot).map_or(0, |s| s.fence)
    }

    /// The newest token issued on the target, in any slot.
    fn newest(&self) -> u64 {
        self.fence(Slot::ZERO).max(self.top.unwrap_or(0))
    }

    fn holds(&self, handle: &LeaseHandle) -> Option<&Lease> {
        self.lease(handle.slot).filter(|l| {
            l.lease_id == handle.lease_id
                && l.owner == handle.owner.as_str()
                && l.token == handle.token.get()
        })
    }

    /// Records a token just issued (above every token of the target) as `slot`'s newest grant.
    /// An exclusive grant leaves no `top`: it is above every permit's token, and no permit is
    /// held beside it.
    fn issued_to(&mut self, slot: Slot, token: u64, shared: bool) {
        self.slot_mut(slot).fence = token;
        if !shared {
            self.top = None;
        } else if slot != Slot::ZERO {
            self.top = Some(token);
        }
    }

    /// Raises `slot`'s fence, lost or lowered while its lease survived, to the lease's token;
    /// `top` only grows.
    fn restore_fence(&mut self, slot: Slot, token: u64) {
        self.slot_mut(slot).fence = token;
        if slot != Slot::ZERO {
            self.top = Some(self.top.unwrap_or(0).max(token));
        }
    }

    /// Keeps the permits value in force for at least `ttl_ms` more.
    fn keep_permits(&mut self, permits: u32, now: u64, ttl_ms: u64) {
        let until = now + ttl_ms * 1000;
        match &mut self.permits {
            Some((_, expires)) if *expires >= until => {}
            other => *other = Some((permits, until)),
        }
    }
}

/// A replay answered with its first reply as it is: releases and commits (a release that was
/// answered stays answered; a commit is checked against the record anyway).
fn keep(_: &TargetState, reply: Reply) -> Reply {
    reply
}

fn micros_to_millis(us: u64) -> u64 {
    us / 1000
}

impl Reply {
    fn operation(&self) -> &'static str {
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
fn binding(parts: &[&str]) -> String {
    parts.iter().map(|p| format!("{}:{p},", p.len())).collect()
}

fn reused_request_id(first: &str) -> StoreError {
    StoreError::InvalidRequest(format!(
        "request id already used for another call ({first} with other arguments) on this \
         target; a request id names one call and its retries: use a new one"
    ))
}

fn unexpected(op: &str) -> StoreError {
    StoreError::UnexpectedReply(format!(
        "request id was first used for another kind of call than {op}"
    ))
}

/// The next token: above the fence and the floor, and at least the clock in microseconds plus
/// [`MAX_TOKEN_LEAD_MICROS`], on every grant (docs/internals/store.md, "The token rule"). A floor
/// more than [`MAX_FLOOR_LEAD_MICROS`] ahead of the clock was not issued by a store and is refused.
fn next_token(fence: u64, min_token: u64, now_us: u64) -> Result<u64, StoreError> {
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

fn exhausted(fence: u64, min_token: u64) -> StoreError {
    StoreError::InvalidRequest(format!(
        "no token can be issued: the fence ({fence}) or the floor ({min_token}) is at the \
         largest token 2^53-1"
    ))
}

/// Refuses a renew or a release naming other permits than the lease was granted under.
fn granted_under(lease: Option<&Lease>, permits: u32) -> Result<(), StoreError> {
    match lease {
        Some(lease) if lease.permits != permits => Err(StoreError::InvalidRequest(format!(
            "permits {permits} is not what this lease was granted under ({})",
            lease.permits
        ))),
        _ => Ok(()),
    }
}

fn never_issued(token: u64, fence: u64) -> StoreError {
    StoreError::InvalidRequest(format!(
        "token {token} was never issued for this target (the newest is {fence}; 0 means none, \
         or the store lost its data)"
    ))
}

#[async_trait]
impl LeaseStore for MemoryStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome, StoreError> {
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
        let reply = self.idempotent(&req.target, &req.request_id, bound, replay, |t, now| {
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
        })?;
        match reply {
            Reply::Acquire(outcome) => Ok(outcome),
            _ => Err(unexpected("acquire")),
        }
    }

    async fn renew(&self, req: &RenewRequest) -> Result<RenewOutcome, StoreError> {
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
        let reply = self.idempotent(&handle.target, &req.request_id, bound, replay, |t, now| {
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
        })?;
        match reply {
            Reply::Renew(outcome) => Ok(outcome),
            _ => Err(unexpected("renew")),
        }
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
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
        let reply = self.idempotent(&handle.target, &req.request_id, bound, keep, |t, _| {
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

    async fn commit(&self, req: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        check_token("sequence", req.sequence, false)?;
        let (token, sequence) = (req.token.to_string(), req.sequence.to_string());
        let digest = sha1_smol::Sha1::from(req.value.as_bytes())
            .digest()
            .to_string();
        let key = req.bound_key();
        let bound = binding(&["commit", &token, &key, &sequence, &digest]);
        let reply = self.idempotent(&req.target, &req.request_id, bound, keep, |t, _| {
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
            let record_key = (req.slot, req.key.as_str().to_owned());
            if let Some(last) = t.guarded.get(&record_key) {
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
            t.guarded.insert(record_key, record);
            committed()
        })?;
        match reply {
            Reply::Commit(outcome) => Ok(outcome),
            _ => Err(unexpected("commit")),
        }
    }

    async fn read_guarded(
        &self,
        target: &TargetRef,
        slot: Slot,
        key: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError> {
        let state = self.lock();
        let found = state
            .targets
            .get(target)
            .and_then(|t| t.guarded.get(&(slot, key.as_str().to_owned())));
        Ok(found.map(|record| GuardedValue {
            token: record.token,
            value: record.value.clone(),
        }))
    }

    async fn check(
        &self,
        target: &TargetRef,
        slot: Slot,
        token: Token,
    ) -> Result<CheckOutcome, StoreError> {
        let token = token.get();
        let fence = self.lock().targets.get(target).map_or(0, |t| t.fence(slot));
        match token.cmp(&fence) {
            std::cmp::Ordering::Less => Ok(CheckOutcome::Stale { newest: fence }),
            std::cmp::Ordering::Equal => Ok(CheckOutcome::Current { newest: fence }),
            std::cmp::Ordering::Greater => Err(never_issued(token, fence)),
        }
    }

    async fn inspect(&self, target: &TargetRef) -> Result<Inspection, StoreError> {
        let now = self.clock.now_micros();
        let mut state = self.lock();
        let Some(t) = state.targets.get_mut(target) else {
            return Ok(Inspection {
                fence: 0,
                server_time_ms: micros_to_millis(now),
                permits: 1,
                lease: None,
                slots: Vec::new(),
            });
        };
        t.expire(now);
        let mut views = t.slots.iter().filter_map(|(slot, state)| {
            let l = state.lease.as_ref()?;
            Some(LeaseView {
                slot: Slot::new(*slot).ok()?,
                permits: super::Permits::new(l.permits).ok()?,
                owner: l.owner.clone(),
                token: l.token,
                acquired_at_ms: l.acquired_ms,
                expires_in_ms: micros_to_millis(l.expires_at_us - now),
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
        Ok(Inspection {
            fence: t.newest(),
            server_time_ms: micros_to_millis(now),
            permits: held_under.unwrap_or(1),
            lease,
            slots,
        })
    }

    /// Nothing in this process can be unreadable: every record is intact.
    async fn repair(&self, target: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError> {
        check_token("floor", floor, false)?;
        let fence = self.lock().targets.get(target).map_or(0, |t| t.newest());
        Ok(RepairOutcome::Intact { fence })
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
