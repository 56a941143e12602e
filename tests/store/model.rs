//! Model-based property tests: random sequences of acquire / renew / release / commit by several
//! clients, with replays of earlier request ids and clock advances, run against the in-memory
//! store and against real Valkey / Redis servers, and compared step by step with a small
//! reference model that shares no code with the stores.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};
use support::suite;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use targetlease::redact::SecretUrl;
use targetlease::store::memory::{ManualClock, MemoryStore};
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, CommitOutcome, CommitRequest, ErrorKind, GuardedKey,
    LeaseHandle, LeaseId, LeaseStore, LossReason, MAX_TOKEN, Owner, Permits, ReleaseOutcome,
    ReleaseRequest, RenewOutcome, RenewRequest, RequestId, Slot, StoreError, TargetRef, Token, Ttl,
};

use support::cases;
use support::server::{Server, ServerKind};

const CLIENTS: usize = 3;
const TARGETS: usize = 2;
const REPLY_TTL_MS: u64 = 60_000;

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        client: usize,
        target: usize,
        /// The caller's token floor: mostly none, sometimes at or past the largest token.
        floor: u64,
    },
    Renew {
        client: usize,
        target: usize,
        pick: usize,
    },
    Release {
        client: usize,
        target: usize,
        pick: usize,
    },
    Commit {
        client: usize,
        target: usize,
        pick: usize,
        /// Reuses a sequence number below the last write's: a late replay of an earlier write.
        rewind: bool,
    },
    /// Re-sends the n-th earlier state-changing call with its request id.
    Replay { nth: usize },
    /// Sends the n-th earlier state-changing call's request id with another client's identity
    /// (a request id reused by another caller): must be refused while the first reply is cached.
    Reuse { nth: usize },
    /// Moves the clock (in-memory store only; a real server's clock cannot be moved).
    Advance { ms: u64 },
}

/// Which of a client's tokens for a target it uses: mostly its latest, sometimes an older one
/// (a stale holder), sometimes an off-by-one (a wrong token).
fn pick() -> impl Strategy<Value = usize> {
    prop_oneof![6 => Just(0usize), 2 => 1usize..4, 1 => Just(usize::MAX)]
}

/// Floors from here up are hostile: far more than an hour ahead of any store's clock for
/// centuries, so a store refuses them wherever it would issue a token.
const FAR_AHEAD: u64 = MAX_TOKEN - 3;

/// A token floor: mostly none, sometimes hostile (at, around or far past the largest token).
fn floor() -> impl Strategy<Value = u64> {
    prop_oneof![
        12 => Just(0u64),
        1 => (MAX_TOKEN - 3)..=(MAX_TOKEN + 2),
        1 => Just(u64::MAX),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let c = 0..CLIENTS;
    let t = 0..TARGETS;
    prop_oneof![
        4 => (c.clone(), t.clone(), floor()).prop_map(|(client, target, floor)| Op::Acquire { client, target, floor }),
        2 => (c.clone(), t.clone(), pick()).prop_map(|(client, target, pick)| Op::Renew { client, target, pick }),
        2 => (c.clone(), t.clone(), pick()).prop_map(|(client, target, pick)| Op::Release { client, target, pick }),
        2 => (c, t, pick(), prop::bool::weighted(0.2)).prop_map(|(client, target, pick, rewind)| Op::Commit { client, target, pick, rewind }),
        2 => (0usize..64).prop_map(|nth| Op::Replay { nth }),
        1 => (0usize..64).prop_map(|nth| Op::Reuse { nth }),
        2 => (0u64..1_500).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// What the store answered, reduced to what the model can predict exactly.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Acquired {
        token: u64,
    },
    Held {
        owner: String,
    },
    /// A retried acquire whose grant has ended.
    Expired {
        token: u64,
    },
    Renewed,
    Lost(LossReason),
    Released,
    NotHolder,
    Committed {
        token: u64,
    },
    Stale {
        newest: u64,
    },
    /// Refused as an invalid request (a reused request id, a token never issued, a floor or
    /// fence at the largest token): nothing changed.
    Invalid,
}

/// A call that changed state, kept for replays.
#[derive(Clone)]
enum Call {
    Acquire(AcquireRequest),
    Renew(RenewRequest),
    Release(ReleaseRequest),
    Commit(CommitRequest),
}

struct Holder {
    client: usize,
    token: u64,
    expires_ms: u64,
}

/// The reference model of one target.
#[derive(Default)]
struct TargetModel {
    holder: Option<Holder>,
    fence: u64,
    /// The last accepted write: (token, sequence, value).
    guarded: Option<(u64, u64, String)>,
}

struct World {
    store: Arc<dyn LeaseStore>,
    clock: Option<ManualClock>,
    ns: String,
    now_ms: u64,
    ttl_ms: u64,
    model: Vec<TargetModel>,
    /// Every token each client was granted per target, oldest first.
    tokens: HashMap<(usize, usize), Vec<u64>>,
    history: Vec<(Call, Seen, u64)>,
    /// The next commit sequence number.
    sequence: u64,
}

fn owner(client: usize) -> Owner {
    Owner::new(format!("worker-{client}")).expect("owner")
}

impl World {
    fn target(&self, t: usize) -> TargetRef {
        TargetRef::new(&self.ns, &format!("target-{t}")).expect("target")
    }

    /// A token the client has seen (or one past it): always a valid token, since none reaches
    /// 2^53-1 here.
    fn token(&self, client: usize, target: usize, pick: usize) -> Token {
        Token::new(self.token_number(client, target, pick)).expect("a valid token")
    }

    fn token_number(&self, client: usize, target: usize, pick: usize) -> u64 {
        let granted = self
            .tokens
            .get(&(client, target))
            .map_or(&[][..], Vec::as_slice);
        let Some(latest) = granted.last() else {
            return 1;
        };
        match pick {
            0 => *latest,
            usize::MAX => latest + 1,
            n => granted[granted.len() - 1 - (n % granted.len())],
        }
    }

    fn handle(&self, client: usize, target: usize, pick: usize) -> LeaseHandle {
        LeaseHandle {
            target: self.target(target),
            permits: Permits::ONE,
            slot: Slot::ZERO,
            lease_id: LeaseId::new(format!("lease-{client}")).expect("lease id"),
            owner: owner(client),
            token: self.token(client, target, pick),
        }
    }

    fn expire(&mut self, target: usize) {
        let now = self.now_ms;
        let m = &mut self.model[target];
        if m.holder.as_ref().is_some_and(|h| h.expires_ms <= now) {
            m.holder = None;
        }
    }

    async fn send(&self, call: &Call) -> Seen {
        let store = &self.store;
        /// An invalid request is an outcome the model predicts; any other failure is a bug.
        fn refused<T>(result: Result<T, StoreError>, seen: impl FnOnce(T) -> Seen) -> Seen {
            match result {
                Ok(outcome) => seen(outcome),
                Err(e) if e.kind() == ErrorKind::InvalidRequest => Seen::Invalid,
                Err(e) => panic!("store call failed: {e}"),
            }
        }
        match call {
            Call::Acquire(r) => refused(store.acquire(r).await, |o| match o {
                AcquireOutcome::Acquired(g) => Seen::Acquired { token: g.token },
                AcquireOutcome::Held { owner, .. } => Seen::Held { owner },
                AcquireOutcome::Expired { token } => Seen::Expired { token },
                AcquireOutcome::PermitsConflict { in_force } => {
                    panic!("every claim asks one permit, yet permits {in_force} are in force")
                }
            }),
            Call::Renew(r) => refused(store.renew(r).await, |o| match o {
                RenewOutcome::Renewed { .. } => Seen::Renewed,
                RenewOutcome::Lost { reason } => Seen::Lost(reason),
            }),
            Call::Release(r) => refused(store.release(r).await, |o| match o {
                ReleaseOutcome::Released => Seen::Released,
                ReleaseOutcome::NotHolder => Seen::NotHolder,
            }),
            Call::Commit(r) => refused(store.commit(r).await, |o| match o {
                CommitOutcome::Committed { token } => Seen::Committed { token },
                CommitOutcome::Stale { newest } => Seen::Stale { newest },
            }),
        }
    }

    /// The n-th fresh earlier call with its request id but another client's identity (on the
    /// same target, where the cached reply lives).
    fn reused(&self, nth: usize) -> Option<Call> {
        let fresh = self.fresh_history();
        if fresh.is_empty() {
            return None;
        }
        let (call, _, _) = fresh[nth % fresh.len()].clone();
        let other = |owner: &str| (client_of(owner) + 1) % CLIENTS;
        Some(match call {
            Call::Acquire(mut r) => {
                let c = other(r.owner.as_str());
                r.owner = owner(c);
                r.lease_id = LeaseId::new(format!("lease-{c}")).expect("id");
                Call::Acquire(r)
            }
            Call::Renew(mut r) => {
                let c = other(r.lease.owner.as_str());
                r.lease.owner = owner(c);
                r.lease.lease_id = LeaseId::new(format!("lease-{c}")).expect("id");
                Call::Renew(r)
            }
            Call::Release(mut r) => {
                let c = other(r.lease.owner.as_str());
                r.lease.owner = owner(c);
                r.lease.lease_id = LeaseId::new(format!("lease-{c}")).expect("id");
                Call::Release(r)
            }
            Call::Commit(mut r) => {
                r.value = format!("{} (reused)", r.value);
                Call::Commit(r)
            }
        })
    }

    /// What a replay of `call`, whose first reply was `first`, answers now: the first reply,
    /// unless it reported a grant or a renewal of a lease that has ended since (then the
    /// acquire learns its grant expired, the renewal that its lease is lost).
    fn replayed(&mut self, call: &Call, first: Seen) -> Seen {
        let (target, lease) = match call {
            Call::Acquire(r) => (&r.target, None),
            Call::Renew(r) => (&r.lease.target, Some(&r.lease)),
            _ => return first,
        };
        let Some(index) = (0..self.model.len()).find(|&i| self.target(i) == *target) else {
            return first;
        };
        self.expire(index);
        let holder = self.model[index].holder.as_ref();
        let stands = |client: usize, token: u64| {
            holder.is_some_and(|h| h.client == client && h.token == token)
        };
        match (first, lease) {
            (Seen::Acquired { token }, None) => {
                let Call::Acquire(r) = call else {
                    unreachable!()
                };
                if stands(client_of(r.owner.as_str()), token) {
                    Seen::Acquired { token }
                } else {
                    Seen::Expired { token }
                }
            }
            (Seen::Renewed, Some(l)) => match holder {
                None => Seen::Lost(LossReason::Expired),
                Some(_) if stands(client_of(l.owner.as_str()), l.token.get()) => Seen::Renewed,
                Some(_) => Seen::Lost(LossReason::NotHolder),
            },
            (first, _) => first,
        }
    }

    /// Earlier state-changing calls whose replies are surely still cached.
    fn fresh_history(&self) -> Vec<&(Call, Seen, u64)> {
        self.history
            .iter()
            .filter(|(_, _, at)| self.now_ms < at + REPLY_TTL_MS - 1_000)
            .collect()
    }

    async fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let ttl = Ttl::new(Duration::from_millis(self.ttl_ms)).expect("ttl");
        let (call, target) = match *op {
            Op::Advance { ms } => {
                if let Some(clock) = &self.clock {
                    clock.advance(Duration::from_millis(ms));
                    self.now_ms += ms;
                }
                return Ok(());
            }
            Op::Reuse { nth } => {
                let Some(call) = self.reused(nth) else {
                    return Ok(());
                };
                let seen = self.send(&call).await;
                prop_assert_eq!(
                    &seen,
                    &Seen::Invalid,
                    "a request id reused with other arguments must be refused"
                );
                return Ok(());
            }
            Op::Replay { nth } => {
                let fresh = self.fresh_history();
                if fresh.is_empty() {
                    return Ok(());
                }
                let (call, first, _) = fresh[nth % fresh.len()].clone();
                let expected = self.replayed(&call, first);
                let again = self.send(&call).await;
                prop_assert_eq!(
                    &again,
                    &expected,
                    "a replay returns its first reply while the grant it reports stands"
                );
                return Ok(());
            }
            Op::Acquire {
                client,
                target,
                floor,
            } => (
                Call::Acquire(AcquireRequest {
                    target: self.target(target),
                    lease_id: LeaseId::new(format!("lease-{client}")).expect("id"),
                    owner: owner(client),
                    permits: Permits::ONE,
                    ttl,
                    min_token: floor,
                    request_id: RequestId::random(),
                }),
                target,
            ),
            Op::Renew {
                client,
                target,
                pick,
            } => (
                Call::Renew(RenewRequest {
                    lease: self.handle(client, target, pick),
                    ttl,
                    request_id: RequestId::random(),
                }),
                target,
            ),
            Op::Release {
                client,
                target,
                pick,
            } => (
                Call::Release(ReleaseRequest {
                    lease: self.handle(client, target, pick),
                    request_id: RequestId::random(),
                }),
                target,
            ),
            Op::Commit {
                client,
                target,
                pick,
                rewind,
            } => {
                self.sequence += 1;
                let sequence = match (&self.model[target].guarded, rewind) {
                    (Some((_, last, _)), true) => last.saturating_sub(1),
                    _ => self.sequence,
                };
                (
                    Call::Commit(CommitRequest {
                        target: self.target(target),
                        slot: Slot::ZERO,
                        token: self.token(client, target, pick),
                        key: GuardedKey::new("data").expect("key"),
                        value: format!("by {client} #{sequence}"),
                        sequence,
                        request_id: RequestId::random(),
                    }),
                    target,
                )
            }
        };
        self.expire(target);
        let seen = self.send(&call).await;
        let now = self.now_ms;
        let ttl_ms = self.ttl_ms;
        let m = &mut self.model[target];
        let changed = match (&call, &seen) {
            (Call::Acquire(r), Seen::Invalid) => {
                // Only a floor past the largest token, or (where a new token is needed) one far
                // ahead of the clock, refuses an acquire: its request id is fresh.
                let client = client_of(r.owner.as_str());
                let held_by_other = m.holder.as_ref().is_some_and(|h| h.client != client);
                let needs_new = m
                    .holder
                    .as_ref()
                    .is_none_or(|h| h.token <= r.min_token || h.token < m.fence);
                prop_assert!(
                    r.min_token >= MAX_TOKEN
                        || (!held_by_other && needs_new && r.min_token >= FAR_AHEAD),
                    "acquire refused with floor {} and fence {}",
                    r.min_token,
                    m.fence
                );
                false
            }
            (Call::Acquire(r), Seen::Acquired { token }) => {
                let client = client_of(r.owner.as_str());
                prop_assert!(*token <= MAX_TOKEN, "token {} above 2^53-1", token);
                prop_assert!(
                    *token > r.min_token,
                    "token {} not above the floor {}",
                    token,
                    r.min_token
                );
                match &mut m.holder {
                    Some(h) => {
                        prop_assert_eq!(h.client, client, "acquired a target held by another");
                        if h.token > r.min_token {
                            prop_assert_eq!(
                                h.token,
                                *token,
                                "a re-entrant acquire changed the token"
                            );
                        } else {
                            prop_assert!(*token > m.fence, "re-issued token not above the fence");
                            m.fence = *token;
                            h.token = *token;
                        }
                        h.expires_ms = now + ttl_ms;
                    }
                    None => {
                        prop_assert!(
                            *token > m.fence,
                            "token {} not above fence {}",
                            token,
                            m.fence
                        );
                        m.fence = *token;
                        m.holder = Some(Holder {
                            client,
                            token: *token,
                            expires_ms: now + ttl_ms,
                        });
                    }
                }
                let granted = self.tokens.entry((client, target)).or_default();
                if granted.last() != Some(token) {
                    granted.push(*token);
                }
                true
            }
            (Call::Acquire(r), Seen::Held { owner: o }) => {
                prop_assert!(r.min_token < MAX_TOKEN, "a floor at 2^53-1 was not refused");
                let h = m.holder.as_ref();
                prop_assert!(h.is_some(), "held reported for a free target");
                prop_assert!(h.is_some_and(|h| h.client != client_of(r.owner.as_str())));
                let holder = owner(h.map_or(0, |h| h.client));
                prop_assert_eq!(o.as_str(), holder.as_str());
                false
            }
            (Call::Renew(r), outcome) => {
                let expected = match &m.holder {
                    None => Seen::Lost(LossReason::Expired),
                    Some(h)
                        if h.client == client_of(r.lease.owner.as_str())
                            && h.token == r.lease.token.get() =>
                    {
                        Seen::Renewed
                    }
                    Some(_) => Seen::Lost(LossReason::NotHolder),
                };
                prop_assert_eq!(outcome, &expected);
                if let (Seen::Renewed, Some(h)) = (outcome, m.holder.as_mut()) {
                    h.expires_ms = now + ttl_ms;
                }
                *outcome == Seen::Renewed
            }
            (Call::Release(r), outcome) => {
                let holds = m.holder.as_ref().is_some_and(|h| {
                    h.client == client_of(r.lease.owner.as_str()) && h.token == r.lease.token.get()
                });
                prop_assert_eq!(
                    outcome,
                    if holds {
                        &Seen::Released
                    } else {
                        &Seen::NotHolder
                    }
                );
                if holds {
                    m.holder = None;
                }
                holds
            }
            (Call::Commit(r), outcome) => {
                let token = r.token.get();
                let ours = (token, r.sequence);
                let expected = if token < m.fence {
                    Seen::Stale { newest: m.fence }
                } else if token > m.fence {
                    Seen::Invalid
                } else {
                    match &m.guarded {
                        Some((t, q, v))
                            if ours < (*t, *q) || (ours == (*t, *q) && *v != r.value) =>
                        {
                            Seen::Stale { newest: *t }
                        }
                        _ => Seen::Committed { token },
                    }
                };
                prop_assert_eq!(outcome, &expected);
                if let Seen::Committed { token } = outcome {
                    m.guarded = Some((*token, r.sequence, r.value.clone()));
                }
                matches!(outcome, Seen::Committed { .. })
            }
            (call, seen) => {
                return Err(TestCaseError::fail(format!(
                    "impossible outcome {seen:?} for {}",
                    match call {
                        Call::Acquire(_) => "acquire",
                        Call::Renew(_) => "renew",
                        Call::Release(_) => "release",
                        Call::Commit(_) => "commit",
                    }
                )));
            }
        };
        if changed {
            self.history.push((call, seen, now));
        }
        Ok(())
    }
}

fn client_of(owner: &str) -> usize {
    owner
        .strip_prefix("worker-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX)
}

/// Runs `cases` random sequences against stores made by `make`.
/// `runtime` must be the one the stores' connections were made on: a current-thread runtime only
/// drives their background tasks inside its own `block_on`.
fn check(
    runtime: &tokio::runtime::Runtime,
    cases: u32,
    make: impl Fn(u32) -> (Arc<dyn LeaseStore>, Option<ManualClock>),
) {
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    let case = std::cell::Cell::new(0u32);
    let result = runner.run(&proptest::collection::vec(op(), 1..48), |ops| {
        case.set(case.get() + 1);
        let case = case.get();
        let (store, clock) = make(case);
        let mut world = World {
            store,
            ttl_ms: if clock.is_some() { 1_000 } else { 60_000 },
            clock,
            ns: format!("model-{case}"),
            now_ms: 0,
            model: (0..TARGETS).map(|_| TargetModel::default()).collect(),
            tokens: HashMap::new(),
            history: Vec::new(),
            sequence: 0,
        };
        runtime.block_on(async {
            for op in &ops {
                world.step(op).await?;
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

fn memory_store_matches_the_model() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    check(&runtime, cases(512), |_| {
        let clock = ManualClock::new();
        let store =
            MemoryStore::with_clock(Arc::new(clock.clone()), Duration::from_millis(REPLY_TTL_MS));
        (Arc::new(store), Some(clock))
    });
}

fn server_matches_the_model(kind: ServerKind) {
    let server = Server::start(kind);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let url = SecretUrl::parse(&server.url()).expect("url");
    let store: Arc<dyn LeaseStore> = Arc::new(
        runtime
            .block_on(ValkeyStore::connect(ValkeyConfig::new(url)))
            .expect("connect"),
    );
    // Each case uses its own namespace, so cases do not see each other's keys.
    check(&runtime, cases(96), |_| (store.clone(), None));
}

fn etcd_matches_the_model() {
    let server = support::etcd::EtcdServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let url = SecretUrl::parse(&server.url()).expect("url");
    let store: Arc<dyn LeaseStore> = Arc::new(
        targetlease::store::etcd::EtcdStore::new(targetlease::store::etcd::EtcdConfig::new(vec![
            url,
        ]))
        .expect("etcd store"),
    );
    // Each case uses its own namespace, so cases do not see each other's keys.
    check(&runtime, cases(96), |_| (store.clone(), None));
}

fn valkey_9_1_matches_the_model() {
    server_matches_the_model(ServerKind::Valkey91);
}

fn valkey_8_1_matches_the_model() {
    server_matches_the_model(ServerKind::Valkey81);
}

fn redis_7_0_matches_the_model() {
    server_matches_the_model(ServerKind::Redis70);
}

/// The suite's trials (each holds a server and a runtime of its own).
pub fn suite(args: &Arguments) -> Conclusion {
    support::etcd::prepare();
    suite::run(
        args,
        vec![
            suite::blocking_trial(
                "memory_store_matches_the_model",
                memory_store_matches_the_model,
            ),
            suite::blocking_trial("valkey_9_1_matches_the_model", valkey_9_1_matches_the_model),
            suite::blocking_trial("valkey_8_1_matches_the_model", valkey_8_1_matches_the_model),
            suite::blocking_trial("redis_7_0_matches_the_model", redis_7_0_matches_the_model),
            suite::blocking_trial("etcd_3_7_matches_the_model", etcd_matches_the_model),
        ],
    )
}
