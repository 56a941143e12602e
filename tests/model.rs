//! Model-based property tests: random sequences of acquire / renew / release / commit by several
//! clients, with replays of earlier request ids and clock advances, run against the in-memory
//! store and against real Valkey / Redis servers, and compared step by step with a small
//! reference model that shares no code with the stores.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use targetlease::redact::SecretUrl;
use targetlease::store::memory::{ManualClock, MemoryStore};
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, CommitOutcome, CommitRequest, LeaseHandle, LeaseId, LeaseStore,
    LossReason, ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, RequestId, TargetRef,
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
    },
    /// Re-sends the n-th earlier state-changing call with its request id.
    Replay {
        nth: usize,
    },
    /// Moves the clock (in-memory store only; a real server's clock cannot be moved).
    Advance {
        ms: u64,
    },
}

/// Which of a client's tokens for a target it uses: mostly its latest, sometimes an older one
/// (a stale holder), sometimes an off-by-one (a wrong token).
fn pick() -> impl Strategy<Value = usize> {
    prop_oneof![6 => Just(0usize), 2 => 1usize..4, 1 => Just(usize::MAX)]
}

fn op() -> impl Strategy<Value = Op> {
    let c = 0..CLIENTS;
    let t = 0..TARGETS;
    prop_oneof![
        4 => (c.clone(), t.clone()).prop_map(|(client, target)| Op::Acquire { client, target }),
        2 => (c.clone(), t.clone(), pick()).prop_map(|(client, target, pick)| Op::Renew { client, target, pick }),
        2 => (c.clone(), t.clone(), pick()).prop_map(|(client, target, pick)| Op::Release { client, target, pick }),
        2 => (c, t, pick()).prop_map(|(client, target, pick)| Op::Commit { client, target, pick }),
        2 => (0usize..64).prop_map(|nth| Op::Replay { nth }),
        2 => (0u64..1_500).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// What the store answered, reduced to what the model can predict exactly.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Acquired { token: u64 },
    Held { owner: String },
    Renewed,
    Lost(LossReason),
    Released,
    NotHolder,
    Committed { token: u64 },
    Stale { newest: u64 },
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
    guarded: Option<u64>,
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
}

fn owner(client: usize) -> String {
    format!("worker-{client}")
}

impl World {
    fn target(&self, t: usize) -> TargetRef {
        TargetRef::new(&self.ns, &format!("target-{t}")).expect("target")
    }

    fn token(&self, client: usize, target: usize, pick: usize) -> u64 {
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
        match call {
            Call::Acquire(r) => match store.acquire(r).await.expect("acquire") {
                AcquireOutcome::Acquired(g) => Seen::Acquired { token: g.token },
                AcquireOutcome::Held { owner, .. } => Seen::Held { owner },
            },
            Call::Renew(r) => match store.renew(r).await.expect("renew") {
                RenewOutcome::Renewed { .. } => Seen::Renewed,
                RenewOutcome::Lost { reason } => Seen::Lost(reason),
            },
            Call::Release(r) => match store.release(r).await.expect("release") {
                ReleaseOutcome::Released => Seen::Released,
                ReleaseOutcome::NotHolder => Seen::NotHolder,
            },
            Call::Commit(r) => match store.commit(r).await.expect("commit") {
                CommitOutcome::Committed { token } => Seen::Committed { token },
                CommitOutcome::Stale { newest } => Seen::Stale { newest },
            },
        }
    }

    async fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let ttl = Duration::from_millis(self.ttl_ms);
        let (call, target) = match *op {
            Op::Advance { ms } => {
                if let Some(clock) = &self.clock {
                    clock.advance(Duration::from_millis(ms));
                    self.now_ms += ms;
                }
                return Ok(());
            }
            Op::Replay { nth } => {
                let fresh: Vec<&(Call, Seen, u64)> = self
                    .history
                    .iter()
                    .filter(|(_, _, at)| self.now_ms < at + REPLY_TTL_MS - 1_000)
                    .collect();
                if fresh.is_empty() {
                    return Ok(());
                }
                let (call, first, _) = fresh[nth % fresh.len()].clone();
                let again = self.send(&call).await;
                prop_assert_eq!(&again, &first, "a replay must return the first reply");
                return Ok(());
            }
            Op::Acquire { client, target } => (
                Call::Acquire(AcquireRequest {
                    target: self.target(target),
                    lease_id: LeaseId::new(format!("lease-{client}")).expect("id"),
                    owner: owner(client),
                    ttl,
                    min_token: 0,
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
            } => (
                Call::Commit(CommitRequest {
                    target: self.target(target),
                    token: self.token(client, target, pick),
                    key: "data".into(),
                    value: format!("by {client}"),
                    request_id: RequestId::random(),
                }),
                target,
            ),
        };
        self.expire(target);
        let seen = self.send(&call).await;
        let now = self.now_ms;
        let ttl_ms = self.ttl_ms;
        let m = &mut self.model[target];
        let changed = match (&call, &seen) {
            (Call::Acquire(r), Seen::Acquired { token }) => {
                let client = client_of(&r.owner);
                match &mut m.holder {
                    Some(h) => {
                        prop_assert_eq!(h.client, client, "acquired a target held by another");
                        prop_assert_eq!(h.token, *token, "a re-entrant acquire changed the token");
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
                let h = m.holder.as_ref();
                prop_assert!(h.is_some(), "held reported for a free target");
                prop_assert!(h.is_some_and(|h| h.client != client_of(&r.owner)));
                prop_assert_eq!(o, &owner(h.map_or(0, |h| h.client)));
                false
            }
            (Call::Renew(r), outcome) => {
                let expected = match &m.holder {
                    None => Seen::Lost(LossReason::Expired),
                    Some(h)
                        if h.client == client_of(&r.lease.owner) && h.token == r.lease.token =>
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
                    h.client == client_of(&r.lease.owner) && h.token == r.lease.token
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
                let expected = if r.token < m.fence {
                    Seen::Stale { newest: m.fence }
                } else if let Some(last) = m.guarded.filter(|last| r.token < *last) {
                    Seen::Stale { newest: last }
                } else {
                    Seen::Committed { token: r.token }
                };
                prop_assert_eq!(outcome, &expected);
                if let Seen::Committed { token } = outcome {
                    m.guarded = Some(*token);
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

#[test]
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

#[test]
fn valkey_9_1_matches_the_model() {
    server_matches_the_model(ServerKind::Valkey91);
}

#[test]
fn valkey_8_1_matches_the_model() {
    server_matches_the_model(ServerKind::Valkey81);
}

#[test]
fn redis_7_0_matches_the_model() {
    server_matches_the_model(ServerKind::Redis70);
}
