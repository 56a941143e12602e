//! The in-memory backend: the same protocol in one process. It is the single-process default
//! (`--backend memory`) and the fast backend for unit tests, with an injectable clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, DEFAULT_REPLY_TTL,
    Grant, GuardedKey, GuardedValue, Inspection, LeaseHandle, LeaseId, LeaseStore, LeaseView,
    LossReason, MAX_FLOOR_LEAD_MICROS, MAX_TOKEN, MAX_TOKEN_LEAD_MICROS, ReleaseOutcome,
    ReleaseRequest, RenewOutcome, RenewRequest, RepairOutcome, RequestId, StoreError, TargetRef,
    Token, check_token,
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

#[derive(Default, Clone)]
struct TargetState {
    lease: Option<Lease>,
    /// The newest token issued.
    fence: u64,
    /// The request id of the acquire that issued `fence`: spent, even after its cached reply.
    fence_request: Option<String>,
    guarded: HashMap<String, GuardedRecord>,
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
                t.lease.is_some() || t.fence > 0 || !t.guarded.is_empty()
            });
        }
    }
}

impl TargetState {
    fn expire(&mut self, now: u64) {
        if self.lease.as_ref().is_some_and(|l| l.expires_at_us <= now) {
            self.lease = None;
        }
    }

    fn holds(&self, handle: &LeaseHandle) -> Option<&Lease> {
        self.lease.as_ref().filter(|l| {
            l.lease_id == handle.lease_id
                && l.owner == handle.owner.as_str()
                && l.token == handle.token.get()
        })
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
/// [`MAX_TOKEN_LEAD_MICROS`], on every grant (docs/store.md, "The token rule"). A floor more
/// than [`MAX_FLOOR_LEAD_MICROS`] ahead of the clock was not issued by a store and is refused.
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
        // The floor is bound too: a retry with another floor is another call.
        let floor = req.min_token.to_string();
        let bound = binding(&["acquire", req.lease_id.expose(), req.owner.as_str(), &floor]);
        let rid = req.request_id.as_str();
        // A retry is answered with its first grant only while that grant still stands.
        let replay = |t: &TargetState, reply| match reply {
            Reply::Acquire(AcquireOutcome::Acquired(g))
                if !t.lease.as_ref().is_some_and(|l| {
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
            let fence = t.fence;
            if let Some(lease) = t.lease.as_mut() {
                if lease.lease_id != req.lease_id || lease.owner != req.owner.as_str() {
                    let left = micros_to_millis(lease.expires_at_us - now);
                    let held = AcquireOutcome::Held {
                        owner: lease.owner.clone(),
                        expires_in_ms: left,
                    };
                    return Ok((Reply::Acquire(held), false));
                }
                // Ours already: the same token, unless it is not above the floor or is below
                // the fence (a restored record); a lost fence is raised again.
                if lease.token <= req.min_token || lease.token < fence {
                    lease.token = next_token(fence, req.min_token, now)?;
                    t.fence_request = Some(rid.to_owned());
                }
                if t.fence < lease.token {
                    t.fence = lease.token;
                }
                lease.expires_at_us = now + ttl_ms * 1000;
                let grant = Grant {
                    token: lease.token,
                    acquired_at_ms: lease.acquired_ms,
                    server_time_ms: now_ms,
                    expires_in_ms: ttl_ms,
                };
                return Ok((Reply::Acquire(AcquireOutcome::Acquired(grant)), true));
            }
            if t.fence_request.as_deref() == Some(rid) {
                return Err(StoreError::InvalidRequest(format!(
                    "request id already acquired token {fence} on this target and its cached \
                     reply expired; a replay never takes a second tenure: use a new request id"
                )));
            }
            let token = next_token(fence, req.min_token, now)?;
            t.fence = token;
            t.fence_request = Some(rid.to_owned());
            t.lease = Some(Lease {
                lease_id: req.lease_id.clone(),
                owner: req.owner.as_str().to_owned(),
                token,
                acquired_ms: now_ms,
                expires_at_us: now + ttl_ms * 1000,
            });
            let grant = Grant {
                token,
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
        let token = handle.token.to_string();
        let bound = binding(&[
            "renew",
            handle.lease_id.expose(),
            handle.owner.as_str(),
            &token,
        ]);
        // A token below the fence (a restored record) is not the holder's any more; a retry is
        // answered with its first reply only while the lease it renewed still stands.
        let loss = |t: &TargetState| {
            if t.lease.is_none() {
                Some(LossReason::Expired)
            } else if t.holds(handle).is_none() || handle.token.get() < t.fence {
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
            t.fence = handle.token.get();
            if let Some(lease) = t.lease.as_mut() {
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
            t.lease = None;
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
        let bound = binding(&["commit", &token, req.key.as_str(), &sequence, &digest]);
        let reply = self.idempotent(&req.target, &req.request_id, bound, keep, |t, _| {
            let committed = || {
                let committed = CommitOutcome::Committed {
                    token: req.token.get(),
                };
                Ok((Reply::Commit(committed), true))
            };
            let stale = |newest| Ok((Reply::Commit(CommitOutcome::Stale { newest }), false));
            if req.token.get() < t.fence {
                return stale(t.fence);
            }
            if req.token.get() > t.fence {
                return Err(never_issued(req.token.get(), t.fence));
            }
            if let Some(last) = t.guarded.get(req.key.as_str()) {
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
            t.guarded.insert(req.key.as_str().to_owned(), record);
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
        key: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError> {
        let state = self.lock();
        let found = state
            .targets
            .get(target)
            .and_then(|t| t.guarded.get(key.as_str()));
        Ok(found.map(|record| GuardedValue {
            token: record.token,
            value: record.value.clone(),
        }))
    }

    async fn check(&self, target: &TargetRef, token: Token) -> Result<CheckOutcome, StoreError> {
        let token = token.get();
        let fence = self.lock().targets.get(target).map_or(0, |t| t.fence);
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
                lease: None,
            });
        };
        t.expire(now);
        Ok(Inspection {
            fence: t.fence,
            server_time_ms: micros_to_millis(now),
            lease: t.lease.as_ref().map(|l| LeaseView {
                owner: l.owner.clone(),
                token: l.token,
                acquired_at_ms: l.acquired_ms,
                expires_in_ms: micros_to_millis(l.expires_at_us - now),
                lease_id: l.lease_id.clone(),
            }),
        })
    }

    /// Nothing in this process can be unreadable: every record is intact.
    async fn repair(&self, target: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError> {
        check_token("floor", floor, false)?;
        let fence = self.lock().targets.get(target).map_or(0, |t| t.fence);
        Ok(RepairOutcome::Intact { fence })
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
