//! The in-memory backend: the same protocol in one process. It is the single-process default
//! (`--backend memory`) and the fast backend for unit tests, with an injectable clock.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;

use std::collections::HashMap;

use super::rules::{Target, nothing_at};
use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, DEFAULT_REPLY_TTL,
    GuardedKey, GuardedValue, Inspection, LeaseStore, ReleaseOutcome, ReleaseRequest, RenewOutcome,
    RenewRequest, RepairOutcome, Slot, StoreError, TargetRef, Token, check_token,
};

mod clock;

pub use self::clock::{Clock, ManualClock, SystemClock};

/// Every target the store knows, and how many calls since targets left empty were forgotten.
#[derive(Default, Clone)]
struct State {
    targets: HashMap<TargetRef, Target>,
    calls_since_sweep: u32,
}

/// The in-memory lease store.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    reply_ttl_us: u64,
    state: Mutex<State>,
}

/// What [`MemoryStore::snapshot`] copied.
pub struct MemorySnapshot(State);

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

    /// Runs `op` on `target`'s records at the clock's time, forgetting now and then the
    /// targets that have nothing left, so the map stays bounded.
    fn on_target<T>(&self, target: &TargetRef, op: impl FnOnce(&mut Target, u64) -> T) -> T {
        let now = self.clock.now_micros();
        let mut state = self.lock();
        state.calls_since_sweep += 1;
        if state.calls_since_sweep >= 1024 {
            state.calls_since_sweep = 0;
            state.targets.retain(|_, t| !t.is_empty(now));
        }
        op(state.targets.entry(target.clone()).or_default(), now)
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl LeaseStore for MemoryStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome, StoreError> {
        self.on_target(&req.target, |t, now| t.acquire(req, now, self.reply_ttl_us))
    }

    async fn renew(&self, req: &RenewRequest) -> Result<RenewOutcome, StoreError> {
        self.on_target(&req.lease.target, |t, now| {
            t.renew(req, now, self.reply_ttl_us)
        })
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
        self.on_target(&req.lease.target, |t, now| {
            t.release(req, now, self.reply_ttl_us)
        })
    }

    async fn commit(&self, req: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        self.on_target(&req.target, |t, now| t.commit(req, now, self.reply_ttl_us))
    }

    async fn read_guarded(
        &self,
        target: &TargetRef,
        slot: Slot,
        key: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError> {
        let state = self.lock();
        Ok(state
            .targets
            .get(target)
            .and_then(|t| t.read_guarded(slot, key)))
    }

    async fn check(
        &self,
        target: &TargetRef,
        slot: Slot,
        token: Token,
    ) -> Result<CheckOutcome, StoreError> {
        match self.lock().targets.get(target) {
            Some(t) => t.check(slot, token),
            None => Target::default().check(slot, token),
        }
    }

    async fn inspect(&self, target: &TargetRef) -> Result<Inspection, StoreError> {
        let now = self.clock.now_micros();
        let mut state = self.lock();
        Ok(match state.targets.get_mut(target) {
            Some(t) => t.inspect(now),
            None => nothing_at(now),
        })
    }

    /// Nothing in this process can be unreadable: every record is intact.
    async fn repair(&self, target: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError> {
        check_token("floor", floor, false)?;
        let fence = self.lock().targets.get(target).map_or(0, Target::newest);
        Ok(RepairOutcome::Intact { fence })
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
