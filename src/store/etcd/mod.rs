//! The etcd backend: each target is one key, `<prefix>/targets/<namespace>/<target>`, whose
//! value is the target's records as the protocol's rules keep them ([`Target`], JSON, in a
//! versioned envelope). A call reads the key (or starts from this process's last copy of it),
//! applies the rules at the store's time, and writes the result back only if the key still
//! holds what the call read (a transaction comparing the value); a call that lost the race
//! applies the rules again to what the transaction read instead. etcd orders the transactions through its consensus, so every call acts on the
//! newest state a majority of members agreed on, and a member that missed writes never answers
//! a read.
//!
//! The store's time: etcd has no clock to read, so the time is this process's clock, kept
//! monotonic per target by the envelope, which records the latest time any caller wrote with
//! (a caller whose clock is behind uses that instead). Leases expire on that time; tokens
//! follow the token rule on it (docs/internals/store.md).

mod client;
pub mod config;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use self::client::{Gateway, Kv, Swapped};
pub use self::config::{
    DEFAULT_ETCD_CALL_TIMEOUT, DEFAULT_ETCD_CONNECT_TIMEOUT, DEFAULT_ETCD_PREFIX, EtcdConfig,
    EtcdTls,
};
use super::memory::{Clock, SystemClock};
use super::rules::{Target, nothing_at};
use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, GuardedKey,
    GuardedValue, Inspection, LeaseStore, MAX_TOKEN_LEAD_MICROS, ReleaseOutcome, ReleaseRequest,
    RenewOutcome, RenewRequest, RepairOutcome, Slot, StoreError, TargetRef, Token, check_token,
};

/// The format of the envelope this version writes (and the only one it reads).
const FORMAT: u32 = 1;

/// A target's key's value.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    format: u32,
    /// The latest store time written with, in microseconds since the Unix epoch.
    clock_us: u64,
    target: Target,
}

/// How many target keys a store keeps its last copy of (see [`EtcdStore::mutate`]).
const KNOWN_KEYS: usize = 16_384;

/// The etcd lease store.
pub struct EtcdStore {
    gateway: Gateway,
    /// The last copy of each target key this process read or wrote.
    known: Mutex<HashMap<String, Kv>>,
    prefix: String,
    reply_ttl_us: u64,
    call_timeout: Duration,
}

impl EtcdStore {
    /// A store on the members `config` names. Nothing is sent before the first call: the
    /// controller starts, and reports itself not ready, while etcd is down.
    pub fn new(config: EtcdConfig) -> Result<Self, StoreError> {
        config.validate()?;
        Ok(Self {
            gateway: Gateway::new(&config)?,
            known: Mutex::new(HashMap::new()),
            prefix: config.key_prefix.clone(),
            reply_ttl_us: u64::try_from(config.reply_ttl.as_micros()).unwrap_or(u64::MAX),
            call_timeout: config.call_timeout,
        })
    }

    /// The key of a target.
    pub fn key(prefix: &str, target: &TargetRef) -> String {
        format!(
            "{prefix}/targets/{}/{}",
            target.namespace(),
            target.target()
        )
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.call_timeout
    }

    /// A call whose transactions kept losing races until its deadline.
    fn timed_out(&self) -> StoreError {
        StoreError::Timeout {
            endpoint: self.gateway.endpoint(),
            after_ms: u64::try_from(self.call_timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// The envelope a key holds (an empty one when there is none); a value this version did
    /// not write fails closed.
    fn decode(&self, target: &TargetRef, kv: Option<&Kv>) -> Result<Envelope, StoreError> {
        let Some(kv) = kv else {
            return Ok(Envelope {
                format: FORMAT,
                clock_us: 0,
                target: Target::default(),
            });
        };
        let corrupt = |what: String| StoreError::Corrupt {
            detail: format!(
                "etcd key {} {what}; `targetlease lease repair` replaces it",
                Self::key(&self.prefix, target)
            ),
        };
        let envelope: Envelope = serde_json::from_slice(&kv.value)
            .map_err(|e| corrupt(format!("is not a target record this version reads ({e})")))?;
        if envelope.format != FORMAT {
            return Err(corrupt(format!(
                "has format {} (this version reads {FORMAT})",
                envelope.format
            )));
        }
        Ok(envelope)
    }

    /// The store's time for a target last written at `clock_us`.
    fn now(clock_us: u64) -> u64 {
        SystemClock.now_micros().max(clock_us)
    }

    /// Reads a target and its store time.
    async fn read(&self, target: &TargetRef) -> Result<(Envelope, u64), StoreError> {
        let kv = self.get(target).await?;
        let envelope = self.decode(target, kv.as_ref())?;
        let now = Self::now(envelope.clock_us);
        Ok((envelope, now))
    }

    /// The copy of `key` this process read or wrote last, if it kept one.
    fn known(&self, key: &str) -> Option<Kv> {
        self.known.lock().ok()?.get(key).cloned()
    }

    /// Keeps `kv` as the copy of `key` (none: the key is absent), within [`KNOWN_KEYS`].
    fn remember(&self, key: &str, kv: Option<&Kv>) {
        let Ok(mut known) = self.known.lock() else {
            return;
        };
        match kv {
            Some(kv) => {
                if known.len() >= KNOWN_KEYS && !known.contains_key(key) {
                    // Any one: the copies only spare a round trip, never decide an answer.
                    if let Some(evicted) = known.keys().next().cloned() {
                        known.remove(&evicted);
                    }
                }
                known.insert(key.to_owned(), kv.clone());
            }
            None => {
                known.remove(key);
            }
        }
    }

    /// Applies `op` to the target at the store's time and writes the result back if the
    /// target did not change meanwhile; otherwise applies it again to the target as it is now.
    /// It starts from this process's last copy of the key when it has one, unread: the
    /// transaction that writes the result compares the key's value with the copy, so an
    /// answer never comes from an outdated copy (an answer that writes nothing, a refusal
    /// included, is confirmed by a transaction that compares only). A retry of a call whose
    /// write landed but whose answer was lost finds the call's reply cached in the target, so
    /// it is answered, not applied twice.
    async fn mutate<T>(
        &self,
        target: &TargetRef,
        mut op: impl FnMut(&mut Target, u64, u64) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let key = Self::key(&self.prefix, target);
        let deadline = self.deadline();
        let (mut kv, mut confirmed) = match self.known(&key) {
            Some(copy) => (Some(copy), false),
            None => (self.gateway.get(&key, deadline).await?, true),
        };
        loop {
            let mut envelope = self.decode(target, kv.as_ref())?;
            let now = Self::now(envelope.clock_us);
            let before = encode(&envelope.target)?;
            let outcome = op(&mut envelope.target, now, self.reply_ttl_us);
            let changed = outcome.is_ok() && encode(&envelope.target)? != before;
            if !changed && confirmed {
                return outcome;
            }
            let value = if changed {
                envelope.clock_us = now;
                Some(encode(&envelope)?)
            } else {
                None
            };
            let expected = kv.as_ref().map(|kv| kv.value.as_slice());
            match self
                .gateway
                .swap(&key, expected, value.as_deref(), deadline)
                .await?
            {
                Swapped::Done => {
                    if let Some(value) = value {
                        self.remember(&key, Some(&Kv { value }));
                    }
                    return outcome;
                }
                Swapped::Changed(now_there) => {
                    self.remember(&key, now_there.as_ref());
                    kv = now_there;
                    confirmed = true;
                }
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out());
            }
        }
    }

    /// Reads a target's key (and keeps the copy).
    async fn get(&self, target: &TargetRef) -> Result<Option<Kv>, StoreError> {
        let key = Self::key(&self.prefix, target);
        let kv = self.gateway.get(&key, self.deadline()).await?;
        self.remember(&key, kv.as_ref());
        Ok(kv)
    }
}

fn encode(value: &impl Serialize) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value)
        .map_err(|e| StoreError::UnexpectedReply(format!("cannot encode a target record: {e}")))
}

#[async_trait]
impl LeaseStore for EtcdStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome, StoreError> {
        self.mutate(&req.target, |t, now, ttl| t.acquire(req, now, ttl))
            .await
    }

    async fn renew(&self, req: &RenewRequest) -> Result<RenewOutcome, StoreError> {
        self.mutate(&req.lease.target, |t, now, ttl| t.renew(req, now, ttl))
            .await
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
        self.mutate(&req.lease.target, |t, now, ttl| t.release(req, now, ttl))
            .await
    }

    async fn commit(&self, req: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        self.mutate(&req.target, |t, now, ttl| t.commit(req, now, ttl))
            .await
    }

    async fn read_guarded(
        &self,
        target: &TargetRef,
        slot: Slot,
        key: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError> {
        let (envelope, _) = self.read(target).await?;
        Ok(envelope.target.read_guarded(slot, key))
    }

    async fn check(
        &self,
        target: &TargetRef,
        slot: Slot,
        token: Token,
    ) -> Result<CheckOutcome, StoreError> {
        let (envelope, _) = self.read(target).await?;
        envelope.target.check(slot, token)
    }

    async fn inspect(&self, target: &TargetRef) -> Result<Inspection, StoreError> {
        let kv = self.get(target).await?;
        if kv.is_none() {
            return Ok(nothing_at(SystemClock.now_micros()));
        }
        let mut envelope = self.decode(target, kv.as_ref())?;
        let now = Self::now(envelope.clock_us);
        Ok(envelope.target.inspect(now))
    }

    /// A target record this version cannot read is replaced by an empty one whose fence is the
    /// largest of `floor` and the store's time plus [`MAX_TOKEN_LEAD_MICROS`]: every lease in it
    /// is gone, and every token issued from it is refused as stale.
    async fn repair(&self, target: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError> {
        check_token("floor", floor, false)?;
        let key = Self::key(&self.prefix, target);
        let deadline = self.deadline();
        let mut kv = self.gateway.get(&key, deadline).await?;
        loop {
            if let Ok(envelope) = self.decode(target, kv.as_ref()) {
                return Ok(RepairOutcome::Intact {
                    fence: envelope.target.newest(),
                });
            }
            let now = SystemClock.now_micros();
            let fence = floor.max(now.saturating_add(MAX_TOKEN_LEAD_MICROS));
            let envelope = Envelope {
                format: FORMAT,
                clock_us: now,
                target: Target::fenced_at(fence),
            };
            let expected = kv.as_ref().map(|kv| kv.value.as_slice());
            let value = encode(&envelope)?;
            match self
                .gateway
                .swap(&key, expected, Some(&value), deadline)
                .await?
            {
                Swapped::Done => {
                    self.remember(&key, Some(&Kv { value }));
                    return Ok(RepairOutcome::Repaired {
                        fence,
                        what: format!(
                            "the target's record was unreadable: replaced by one that holds no \
                             lease, fenced at {fence}"
                        ),
                    });
                }
                Swapped::Changed(now_there) => {
                    self.remember(&key, now_there.as_ref());
                    kv = now_there;
                }
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out());
            }
        }
    }

    async fn health(&self) -> Result<(), StoreError> {
        self.gateway.status(self.deadline()).await
    }
}
