//! The in-memory backend: the same protocol in one process. It is the single-process default
//! (`--backend memory`) and the fast backend for unit tests, with an injectable clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use super::types::{check_guarded_key, check_owner, ttl_millis};
use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, Grant,
    GuardedValue, Inspection, LeaseHandle, LeaseId, LeaseStore, LeaseView, LossReason,
    ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, StoreError, TargetRef,
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

/// How long a reply stays cached for retries, unless configured otherwise.
pub const DEFAULT_REPLY_TTL: Duration = Duration::from_secs(60);

/// The in-memory lease store.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    reply_ttl_us: u64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    targets: HashMap<TargetRef, TargetState>,
    replies: HashMap<(TargetRef, String), (Reply, u64)>,
    calls_since_sweep: u32,
}

#[derive(Default)]
struct TargetState {
    lease: Option<Lease>,
    fence: u64,
    guarded: HashMap<String, (u64, String)>,
}

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

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-written: every mutation
        // below is a single assignment after all checks.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one mutating call: returns the cached reply of `request_id` if there is one,
    /// otherwise runs `op` and caches its reply when it changed state.
    fn idempotent(
        &self,
        target: &TargetRef,
        request_id: &str,
        op: impl FnOnce(&mut TargetState, u64) -> (Reply, bool),
    ) -> Reply {
        let now = self.clock.now_micros();
        let mut state = self.lock();
        state.sweep(now);
        let cache_key = (target.clone(), request_id.to_owned());
        if let Some((reply, expires)) = state.replies.get(&cache_key)
            && *expires > now
        {
            return reply.clone();
        }
        let entry = state.targets.entry(target.clone()).or_default();
        entry.expire(now);
        let (reply, changed) = op(entry, now);
        if changed {
            let expires = now.saturating_add(self.reply_ttl_us);
            state.replies.insert(cache_key, (reply.clone(), expires));
        }
        reply
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
            self.replies.retain(|_, (_, expires)| *expires > now);
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
            l.lease_id == handle.lease_id && l.owner == handle.owner && l.token == handle.token
        })
    }
}

fn micros_to_millis(us: u64) -> u64 {
    us / 1000
}

fn unexpected(op: &str) -> StoreError {
    StoreError::UnexpectedReply(format!(
        "request id was first used for another kind of call than {op}"
    ))
}

#[async_trait]
impl LeaseStore for MemoryStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome, StoreError> {
        let ttl_ms = ttl_millis(req.ttl)?;
        check_owner(&req.owner)?;
        let reply = self.idempotent(&req.target, req.request_id.as_str(), |t, now| {
            let now_ms = micros_to_millis(now);
            if let Some(lease) = t.lease.as_mut() {
                if lease.lease_id != req.lease_id || lease.owner != req.owner {
                    let left = micros_to_millis(lease.expires_at_us - now);
                    let held = AcquireOutcome::Held {
                        owner: lease.owner.clone(),
                        expires_in_ms: left,
                    };
                    return (Reply::Acquire(held), false);
                }
                lease.expires_at_us = now + ttl_ms * 1000;
                let grant = Grant {
                    token: lease.token,
                    acquired_at_ms: lease.acquired_ms,
                    server_time_ms: now_ms,
                    expires_in_ms: ttl_ms,
                };
                return (Reply::Acquire(AcquireOutcome::Acquired(grant)), true);
            }
            let token = (t.fence + 1).max(req.min_token.saturating_add(1)).max(now);
            t.fence = token;
            t.lease = Some(Lease {
                lease_id: req.lease_id.clone(),
                owner: req.owner.clone(),
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
            (Reply::Acquire(AcquireOutcome::Acquired(grant)), true)
        });
        match reply {
            Reply::Acquire(outcome) => Ok(outcome),
            _ => Err(unexpected("acquire")),
        }
    }

    async fn renew(&self, req: &RenewRequest) -> Result<RenewOutcome, StoreError> {
        let ttl_ms = ttl_millis(req.ttl)?;
        let handle = &req.lease;
        let reply = self.idempotent(&handle.target, req.request_id.as_str(), |t, now| {
            if t.lease.is_none() {
                let lost = RenewOutcome::Lost {
                    reason: LossReason::Expired,
                };
                return (Reply::Renew(lost), false);
            }
            if t.holds(handle).is_none() {
                let lost = RenewOutcome::Lost {
                    reason: LossReason::NotHolder,
                };
                return (Reply::Renew(lost), false);
            }
            if let Some(lease) = t.lease.as_mut() {
                lease.expires_at_us = now + ttl_ms * 1000;
            }
            let renewed = RenewOutcome::Renewed {
                server_time_ms: micros_to_millis(now),
                expires_in_ms: ttl_ms,
            };
            (Reply::Renew(renewed), true)
        });
        match reply {
            Reply::Renew(outcome) => Ok(outcome),
            _ => Err(unexpected("renew")),
        }
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
        let handle = &req.lease;
        let reply = self.idempotent(&handle.target, req.request_id.as_str(), |t, _| {
            if t.holds(handle).is_none() {
                return (Reply::Release(ReleaseOutcome::NotHolder), false);
            }
            t.lease = None;
            (Reply::Release(ReleaseOutcome::Released), true)
        });
        match reply {
            Reply::Release(outcome) => Ok(outcome),
            _ => Err(unexpected("release")),
        }
    }

    async fn commit(&self, req: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        check_guarded_key(&req.key)?;
        if req.token == 0 {
            return Err(StoreError::InvalidRequest(
                "token must be a positive integer".into(),
            ));
        }
        let reply = self.idempotent(&req.target, req.request_id.as_str(), |t, _| {
            if req.token < t.fence {
                let stale = CommitOutcome::Stale { newest: t.fence };
                return (Reply::Commit(stale), false);
            }
            if let Some((last, _)) = t.guarded.get(&req.key)
                && req.token < *last
            {
                let stale = CommitOutcome::Stale { newest: *last };
                return (Reply::Commit(stale), false);
            }
            t.guarded
                .insert(req.key.clone(), (req.token, req.value.clone()));
            let committed = CommitOutcome::Committed { token: req.token };
            (Reply::Commit(committed), true)
        });
        match reply {
            Reply::Commit(outcome) => Ok(outcome),
            _ => Err(unexpected("commit")),
        }
    }

    async fn read_guarded(
        &self,
        target: &TargetRef,
        key: &str,
    ) -> Result<Option<GuardedValue>, StoreError> {
        check_guarded_key(key)?;
        let state = self.lock();
        let found = state.targets.get(target).and_then(|t| t.guarded.get(key));
        Ok(found.map(|(token, value)| GuardedValue {
            token: *token,
            value: value.clone(),
        }))
    }

    async fn check(&self, target: &TargetRef, token: u64) -> Result<CheckOutcome, StoreError> {
        if token == 0 {
            return Err(StoreError::InvalidRequest(
                "token must be a positive integer".into(),
            ));
        }
        let fence = self.lock().targets.get(target).map_or(0, |t| t.fence);
        Ok(if token < fence {
            CheckOutcome::Stale { newest: fence }
        } else {
            CheckOutcome::Current {
                newest: fence.max(token),
            }
        })
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

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
