//! The etcd backend. Each target is one key, `<prefix>/targets/<namespace>/<target>`, whose
//! value is the target's records (slots, fences, guarded records) as the protocol's rules keep
//! them, in a versioned JSON envelope. Each reply cached for a request id is a key of its own,
//! `<prefix>/replies/<namespace>/<target>/<request id>`, attached to an etcd lease that deletes
//! it some time after it stops counting: a busy target's record does not grow with its calls.
//!
//! A call applies the rules at the store's time to the target's record (this process's last
//! copy of it, or the key read) and to its request id's reply (none expected: request ids are
//! fresh), then writes the result in one transaction that succeeds only if the record still
//! holds what the call read and the reply key is still as the call found it (values compared,
//! not revisions). A call that lost the race applies the rules again to what the refused
//! transaction read. So a call is one round trip when the copy is current, and an answer never
//! comes from an outdated copy: an answer that writes nothing is confirmed by a transaction that
//! only compares. etcd orders the transactions through its consensus: every call acts on the
//! newest state a majority of members agreed on, and a member that missed writes never answers.
//!
//! The store's time: etcd has no clock to read, so the time is the clock of the process that
//! makes the call (the controller's, for every call it makes): leases expire on it and tokens
//! follow the token rule on it (docs/internals/store.md). No other caller's clock is trusted: a
//! caller whose clock is ahead would otherwise make every other caller's leases expire early.
//! Tokens still only grow, whatever the clocks: each is above the slot's fence.

mod client;
pub mod config;
mod proto;
mod tls;

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use self::client::{Expect, Kv, Members, Put, Swapped};
pub use self::config::{
    DEFAULT_ETCD_CALL_TIMEOUT, DEFAULT_ETCD_CONNECT_TIMEOUT, DEFAULT_ETCD_PREFIX, EtcdConfig,
    EtcdTls,
};
use super::memory::{Clock, SystemClock};
use super::rules::{Cached, Target, TargetState, nothing_at};
use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, GuardedKey,
    GuardedValue, Inspection, LeaseStore, MAX_TOKEN_LEAD_MICROS, ReleaseOutcome, ReleaseRequest,
    RenewOutcome, RenewRequest, RepairOutcome, RequestId, Slot, StoreError, TargetRef, Token,
    check_token,
};

/// The format of the keys this version writes (and the only one it reads).
const FORMAT: u32 = 1;

/// A target key's value.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    format: u32,
    /// When it was written, by the writer's clock, in microseconds since the Unix epoch: for an
    /// operator reading the key; no call reads it.
    clock_us: u64,
    records: TargetState,
}

/// A reply key's value.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplyRecord {
    format: u32,
    cached: Cached,
}

/// How many target keys a store keeps its last copy of (see [`EtcdStore::mutate`]).
const KNOWN_KEYS: usize = 16_384;

/// How long one etcd lease takes new reply keys: each lives from its reply TTL to its reply TTL
/// plus this (one lease grant per window, whatever the call rate).
const REPLY_LEASE_WINDOW: Duration = Duration::from_secs(30);

/// The etcd lease store.
pub struct EtcdStore {
    members: Members,
    /// The last copy of each target key this process read or wrote.
    known: Mutex<HashMap<String, Kv>>,
    /// The etcd lease new reply keys are attached to, and until when it takes them.
    reply_lease: tokio::sync::Mutex<Option<(i64, Instant)>>,
    prefix: String,
    reply_ttl: Duration,
    call_timeout: Duration,
    /// The installation this store claims the prefix for, if any.
    installation: Option<String>,
    /// Whether the claim succeeded once: calls then go ahead without asking again (the health
    /// check asks every time).
    claimed: AtomicBool,
}

/// A target key and the call's reply key, as a call found them.
struct Found {
    record: Option<Kv>,
    reply: Option<Kv>,
}

impl EtcdStore {
    /// A store on the members `config` names. Nothing is sent before the first call: the
    /// controller starts, and reports itself not ready, while etcd is down.
    pub fn new(config: EtcdConfig) -> Result<Self, StoreError> {
        config.validate()?;
        Ok(Self {
            members: Members::new(&config)?,
            known: Mutex::new(HashMap::new()),
            reply_lease: tokio::sync::Mutex::new(None),
            prefix: config.key_prefix.clone(),
            reply_ttl: config.reply_ttl,
            call_timeout: config.call_timeout,
            installation: config.installation.clone(),
            claimed: AtomicBool::new(false),
        })
    }

    /// The key that names the installation a prefix belongs to.
    pub fn installation_key(prefix: &str) -> String {
        format!("{prefix}/installation")
    }

    /// Claims the prefix for this installation before the first call (once it succeeded, not
    /// again; `always` asks again, for the health check): one transaction that writes the
    /// installation key if absent and reads it otherwise. Another installation's name there
    /// refuses the call, and every call after it until the key is deleted or names this one.
    async fn claim_prefix(&self, always: bool, deadline: Instant) -> Result<(), StoreError> {
        let Some(id) = &self.installation else {
            return Ok(());
        };
        if !always && self.claimed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let key = Self::installation_key(&self.prefix);
        let expect = [Expect {
            key: &key,
            value: None,
        }];
        let puts = [Put {
            key: &key,
            value: id.as_bytes(),
            lease: None,
        }];
        loop {
            let holder = match self.members.swap(&expect, &puts, deadline).await? {
                Swapped::Done => None,
                // Deleted between the compare and the read: claim it again.
                Swapped::Changed(mut now) => match now.pop().flatten() {
                    Some(holder) => Some(holder),
                    None if Instant::now() < deadline => continue,
                    None => return Err(self.timed_out()),
                },
            };
            return match holder {
                Some(other) if other.value != id.as_bytes() => {
                    self.claimed.store(false, Ordering::Relaxed);
                    Err(StoreError::InvalidConfig(format!(
                        "the etcd key prefix {:?} belongs to another installation ({}); two \
                         installations on one prefix would share leases without a shared \
                         leader: give this one its own --etcd-key-prefix (or delete the key \
                         {key} if that installation is gone)",
                        self.prefix,
                        String::from_utf8_lossy(&other.value)
                    )))
                }
                _ => {
                    self.claimed.store(true, Ordering::Relaxed);
                    Ok(())
                }
            };
        }
    }

    /// The key of a target's records.
    pub fn key(prefix: &str, target: &TargetRef) -> String {
        format!(
            "{prefix}/targets/{}/{}",
            target.namespace(),
            target.target()
        )
    }

    /// The key of the reply cached for `request_id` on a target (a request id has no `/`, so
    /// the last segment names it).
    pub fn reply_key(prefix: &str, target: &TargetRef, request_id: &RequestId) -> String {
        format!(
            "{prefix}/replies/{}/{}/{}",
            target.namespace(),
            target.target(),
            request_id.as_str()
        )
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.call_timeout
    }

    /// A call whose transactions kept losing races until its deadline.
    fn timed_out(&self) -> StoreError {
        StoreError::Timeout {
            endpoint: self.members.endpoint(),
            after_ms: u64::try_from(self.call_timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }

    fn corrupt(key: &str, what: String) -> StoreError {
        StoreError::Corrupt {
            detail: format!("etcd key {key} {what}; `targetlease lease repair` replaces it"),
        }
    }

    /// The envelope a target key holds (an empty one when there is none); a value this version
    /// did not write fails closed.
    fn decode(&self, target: &TargetRef, kv: Option<&Kv>) -> Result<Envelope, StoreError> {
        let Some(kv) = kv else {
            return Ok(Envelope {
                format: FORMAT,
                clock_us: 0,
                records: TargetState::default(),
            });
        };
        let key = Self::key(&self.prefix, target);
        let envelope: Envelope = serde_json::from_slice(&kv.value).map_err(|e| {
            Self::corrupt(
                &key,
                format!(
                    "is not a target record this version reads ({})",
                    unreadable(&e)
                ),
            )
        })?;
        if envelope.format != FORMAT {
            return Err(Self::corrupt(
                &key,
                format!(
                    "has format {} (this version reads {FORMAT})",
                    envelope.format
                ),
            ));
        }
        Ok(envelope)
    }

    /// The reply a reply key holds, if any; a value this version did not write fails closed.
    fn decode_reply(key: &str, kv: Option<&Kv>) -> Result<Option<Cached>, StoreError> {
        let Some(kv) = kv else {
            return Ok(None);
        };
        let record: ReplyRecord = serde_json::from_slice(&kv.value).map_err(|e| {
            Self::corrupt(
                key,
                format!(
                    "is not a cached reply this version reads ({})",
                    unreadable(&e)
                ),
            )
        })?;
        if record.format != FORMAT {
            return Err(Self::corrupt(
                key,
                format!("has format {} (this version reads {FORMAT})", record.format),
            ));
        }
        Ok(Some(record.cached))
    }

    /// The store's time: this process's clock.
    fn now() -> u64 {
        SystemClock.now_micros()
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

    /// The etcd lease to attach a new reply key to: it outlives the reply by at least the reply
    /// TTL. `fresh`: the last one is gone (a data loss took it), grant another.
    async fn reply_lease(&self, fresh: bool, deadline: Instant) -> Result<i64, StoreError> {
        // A grant in flight holds the others up, within their own deadlines.
        let mut lease = tokio::time::timeout_at(deadline, self.reply_lease.lock())
            .await
            .map_err(|_| self.timed_out())?;
        if let Some((id, until)) = *lease
            && !fresh
            && Instant::now() < until
        {
            return Ok(id);
        }
        let ttl = self.reply_ttl + REPLY_LEASE_WINDOW;
        let seconds = i64::try_from(ttl.as_secs() + 1).unwrap_or(i64::MAX);
        let granted = Instant::now();
        let id = self.members.grant_lease(seconds, deadline).await?;
        *lease = Some((id, granted + REPLY_LEASE_WINDOW));
        Ok(id)
    }

    /// Applies `op` to the target's records and to `request_id`'s cached reply at the store's
    /// time, and writes what changed if neither changed meanwhile; otherwise applies it again to
    /// them as they are now (see the module's documentation). A retry of a call whose write
    /// landed but whose answer was lost finds the call's reply, so it is answered, not applied
    /// twice.
    async fn mutate<T>(
        &self,
        target: &TargetRef,
        request_id: &RequestId,
        mut op: impl FnMut(&mut Target, u64, u64) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let key = Self::key(&self.prefix, target);
        let reply_key = Self::reply_key(&self.prefix, target, request_id);
        let rid = request_id.as_str();
        let reply_ttl_us = u64::try_from(self.reply_ttl.as_micros()).unwrap_or(u64::MAX);
        let deadline = self.deadline();
        self.claim_prefix(false, deadline).await?;
        // A fresh request id has no reply yet: with a copy of the record, nothing is read first.
        let (mut found, mut confirmed) = match self.known(&key) {
            Some(copy) => (
                Found {
                    record: Some(copy),
                    reply: None,
                },
                false,
            ),
            None => (self.read_both(target, &reply_key, deadline).await?, true),
        };
        // Whether the etcd lease of new replies was found gone and a new one is to be taken,
        // and whether that was done in this call already (once is enough).
        let (mut fresh_lease, mut lease_renewed) = (false, false);
        loop {
            let envelope = match self.decode(target, found.record.as_ref()) {
                Ok(envelope) => envelope,
                // A copy is never the reason for a refusal: read what the key holds now.
                Err(_) if !confirmed => {
                    self.remember(&key, None);
                    found = self.read_both(target, &reply_key, deadline).await?;
                    confirmed = true;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let cached = Self::decode_reply(&reply_key, found.reply.as_ref())?;
            let now = Self::now();
            let before = encode(&envelope.records)?;
            let cached_before = cached.as_ref().map(encode).transpose()?;
            let replies: BTreeMap<String, Cached> =
                cached.into_iter().map(|c| (rid.to_owned(), c)).collect();
            let mut working = Target::from_parts(envelope.records, replies);
            let outcome = op(&mut working, now, reply_ttl_us);
            let (records, mut replies) = working.into_parts();
            let record = if outcome.is_ok() && encode(&records)? != before {
                let envelope = Envelope {
                    format: FORMAT,
                    clock_us: now,
                    records,
                };
                Some(encode(&envelope)?)
            } else {
                None
            };
            let reply = match replies.remove(rid) {
                Some(cached) if outcome.is_ok() => {
                    let text = encode(&cached)?;
                    (Some(&text) != cached_before.as_ref()).then(|| {
                        encode(&ReplyRecord {
                            format: FORMAT,
                            cached,
                        })
                    })
                }
                _ => None,
            }
            .transpose()?;
            if record.is_none() && reply.is_none() && confirmed {
                return outcome;
            }
            let lease = match &reply {
                Some(_) => Some(self.reply_lease(fresh_lease, deadline).await?),
                None => None,
            };
            fresh_lease = false;
            let expect = [
                Expect {
                    key: &key,
                    value: found.record.as_ref().map(|kv| kv.value.as_slice()),
                },
                Expect {
                    key: &reply_key,
                    value: found.reply.as_ref().map(|kv| kv.value.as_slice()),
                },
            ];
            let mut puts = Vec::new();
            if let Some(value) = &record {
                puts.push(Put {
                    key: &key,
                    value,
                    lease: None,
                });
            }
            if let Some(value) = &reply {
                puts.push(Put {
                    key: &reply_key,
                    value,
                    lease,
                });
            }
            match self.members.swap(&expect, &puts, deadline).await {
                Ok(Swapped::Done) => {
                    if let Some(value) = record {
                        self.remember(&key, Some(&Kv { value }));
                    }
                    return outcome;
                }
                Ok(Swapped::Changed(mut now_there)) => {
                    let reply = now_there.pop().flatten();
                    let record = now_there.pop().flatten();
                    self.remember_readable(target, &key, record.as_ref());
                    found = Found { record, reply };
                    confirmed = true;
                }
                // The lease went with a data loss (or a restore): take a new one, once.
                Err(e) if !lease_renewed && e.to_string().contains("requested lease not found") => {
                    fresh_lease = true;
                    lease_renewed = true;
                }
                Err(e) => return Err(e),
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out());
            }
        }
    }

    /// Reads a target key and a reply key at one revision (and keeps the target's copy when
    /// it is readable).
    async fn read_both(
        &self,
        target: &TargetRef,
        reply_key: &str,
        deadline: Instant,
    ) -> Result<Found, StoreError> {
        let key = Self::key(&self.prefix, target);
        let mut both = self.members.get(&[&key, reply_key], deadline).await?;
        let reply = both.pop().flatten();
        let record = both.pop().flatten();
        self.remember_readable(target, &key, record.as_ref());
        Ok(Found { record, reply })
    }

    /// Keeps `kv` as the copy of `key` if this version can read it; else forgets the copy (an
    /// unreadable value is never answered from: the next call reads the key again, and finds it
    /// repaired if it was).
    fn remember_readable(&self, target: &TargetRef, key: &str, kv: Option<&Kv>) {
        if self.decode(target, kv).is_ok() {
            self.remember(key, kv);
        } else {
            self.remember(key, None);
        }
    }

    /// Reads a target's records (and keeps the copy) and the store's time.
    async fn read(&self, target: &TargetRef) -> Result<(Option<Envelope>, u64), StoreError> {
        let key = Self::key(&self.prefix, target);
        let deadline = self.deadline();
        self.claim_prefix(false, deadline).await?;
        let kv = self.members.get(&[&key], deadline).await?.pop().flatten();
        self.remember_readable(target, &key, kv.as_ref());
        if kv.is_none() {
            return Ok((None, Self::now()));
        }
        let envelope = self.decode(target, kv.as_ref())?;
        Ok((Some(envelope), Self::now()))
    }
}

/// What is wrong with a value that does not parse, without quoting the value (it may hold a
/// lease id).
fn unreadable(e: &serde_json::Error) -> String {
    format!(
        "{:?} at line {} column {}",
        e.classify(),
        e.line(),
        e.column()
    )
}

fn encode(value: &impl Serialize) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value)
        .map_err(|e| StoreError::UnexpectedReply(format!("cannot encode a record: {e}")))
}

/// The target of a read, from its records (no reply is needed to read).
fn readable(envelope: Option<Envelope>) -> Target {
    let records = envelope.map(|e| e.records).unwrap_or_default();
    Target::from_parts(records, BTreeMap::new())
}

#[async_trait]
impl LeaseStore for EtcdStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome, StoreError> {
        self.mutate(&req.target, &req.request_id, |t, now, ttl| {
            t.acquire(req, now, ttl)
        })
        .await
    }

    async fn renew(&self, req: &RenewRequest) -> Result<RenewOutcome, StoreError> {
        self.mutate(&req.lease.target, &req.request_id, |t, now, ttl| {
            t.renew(req, now, ttl)
        })
        .await
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
        self.mutate(&req.lease.target, &req.request_id, |t, now, ttl| {
            t.release(req, now, ttl)
        })
        .await
    }

    async fn commit(&self, req: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        self.mutate(&req.target, &req.request_id, |t, now, ttl| {
            t.commit(req, now, ttl)
        })
        .await
    }

    async fn read_guarded(
        &self,
        target: &TargetRef,
        slot: Slot,
        key: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError> {
        let (envelope, _) = self.read(target).await?;
        Ok(readable(envelope).read_guarded(slot, key))
    }

    async fn check(
        &self,
        target: &TargetRef,
        slot: Slot,
        token: Token,
    ) -> Result<CheckOutcome, StoreError> {
        let (envelope, _) = self.read(target).await?;
        readable(envelope).check(slot, token)
    }

    async fn inspect(&self, target: &TargetRef) -> Result<Inspection, StoreError> {
        match self.read(target).await? {
            (None, now) => Ok(nothing_at(now)),
            (envelope, now) => Ok(readable(envelope).inspect(now)),
        }
    }

    /// A target record this version cannot read is replaced by one whose fence is the largest
    /// of `floor` and the store's time plus [`MAX_TOKEN_LEAD_MICROS`]: every lease in it is
    /// gone, and every token issued from it is refused as stale. Cached replies stay: a retry
    /// of a grant from before is answered `expired`, never granted again.
    async fn repair(&self, target: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError> {
        check_token("floor", floor, false)?;
        let key = Self::key(&self.prefix, target);
        let deadline = self.deadline();
        self.claim_prefix(false, deadline).await?;
        let mut kv = self.members.get(&[&key], deadline).await?.pop().flatten();
        loop {
            if let Ok(envelope) = self.decode(target, kv.as_ref()) {
                self.remember(&key, kv.as_ref());
                return Ok(RepairOutcome::Intact {
                    fence: readable(Some(envelope)).newest(),
                });
            }
            let now = Self::now();
            let fence = floor.max(now.saturating_add(MAX_TOKEN_LEAD_MICROS));
            let value = encode(&Envelope {
                format: FORMAT,
                clock_us: now,
                records: Target::fenced_at(fence),
            })?;
            let expect = [Expect {
                key: &key,
                value: kv.as_ref().map(|kv| kv.value.as_slice()),
            }];
            let puts = [Put {
                key: &key,
                value: &value,
                lease: None,
            }];
            match self.members.swap(&expect, &puts, deadline).await? {
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
                Swapped::Changed(mut now_there) => kv = now_there.pop().flatten(),
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out());
            }
        }
    }

    /// A linearizable read of one key under the prefix: a member answers, a leader and a
    /// quorum are there, and the user may read its prefix (no other right is asked). With an
    /// installation, the claim of the prefix instead (a transaction, so the same proof): a
    /// prefix another installation took since is reported here, not only at the next call.
    async fn health(&self) -> Result<(), StoreError> {
        let deadline = self.deadline();
        if self.installation.is_some() {
            // Claims the prefix, or finds it claimed: a transaction that reads or writes the
            // installation key is as much a health check as the read below.
            return self.claim_prefix(true, deadline).await;
        }
        let key = format!("{}/health", self.prefix);
        self.members.get(&[&key], deadline).await.map(drop)
    }
}
