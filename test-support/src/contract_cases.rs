//! The lease-store contract: one set of test bodies that every backend must pass. The suites
//! run them against the in-memory store and plain servers (`tests/contract.rs`), as an ACL user,
//! over TLS and mTLS (`tests/operations.rs`) and on a Valkey Cluster (`tests/cluster.rs`).
//!
//! A suite describes each backend as a [`Variant`]: a factory for a fresh [`Harness`] per test
//! and what the harness offers beyond the store (an administrator connection, a plaintext port
//! for byte-level tricks), so each test runs where it can.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::Trial;
use redis::Value;
use targetlease::redact::SecretUrl;
use targetlease::store::memory::{Clock, ManualClock, MemoryStore, SystemClock};
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::scripts::SCRIPTS;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, ErrorKind, Grant,
    LeaseHandle, LeaseId, LeaseStore, LossReason, MAX_TOKEN_LEAD_MICROS, ReleaseOutcome,
    ReleaseRequest, RenewOutcome, RenewRequest, RequestId, StoreError, TargetRef,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::admin::Admin;
use super::server::{Server, ServerKind, resp};
use super::suite;

/// Plaintext access to a server as its default user: for MONITOR and for bytes sent by hand.
#[derive(Clone, Debug)]
pub struct RawAccess {
    /// The plaintext port.
    pub port: u16,
    /// The default user's password, if any.
    pub password: Option<String>,
}

/// A server (or cluster) under test, with how the store reaches it and how an administrator
/// does.
pub struct ServerEnv {
    /// The server flavour (for a cluster: of its nodes).
    pub kind: ServerKind,
    /// How the store under test connects (ACL user, TLS, cluster seeds, ...).
    pub config: ValkeyConfig,
    /// The administrator's connection.
    pub admin: Admin,
    /// Plaintext access as the default user, when the server offers it.
    pub raw: Option<RawAccess>,
    /// Whatever must live as long as the test: servers, clusters, certificate folders.
    pub keep: Vec<Box<dyn std::any::Any + Send>>,
}

/// One backend instance for one test.
pub struct Harness {
    /// The store under test.
    pub store: Arc<dyn LeaseStore>,
    memory: Option<(Arc<MemoryStore>, ManualClock)>,
    env: Option<ServerEnv>,
}

/// A config for a plain test server URL.
pub fn valkey_config(url: &str) -> ValkeyConfig {
    ValkeyConfig::new(SecretUrl::parse(url).expect("test URL parses"))
}

impl Harness {
    /// The in-memory store on a manual clock.
    pub fn memory() -> Harness {
        let clock = ManualClock::new();
        let store = Arc::new(MemoryStore::with_clock(
            Arc::new(clock.clone()),
            Duration::from_secs(60),
        ));
        Harness {
            store: store.clone(),
            memory: Some((store, clock)),
            env: None,
        }
    }

    /// A store connected to `env` as `env.config` says.
    pub async fn server(env: ServerEnv) -> Harness {
        let store = ValkeyStore::connect(env.config.clone())
            .await
            .unwrap_or_else(|e| panic!("connect to the test server: {e}"));
        Harness {
            store: Arc::new(store),
            memory: None,
            env: Some(env),
        }
    }

    /// A plain server of `kind`, reached by URL, with raw access.
    pub async fn plain(kind: ServerKind) -> Harness {
        let server = Server::start(kind);
        let admin = Admin::single(&server.url(), None).await;
        let env = ServerEnv {
            kind,
            config: valkey_config(&server.url()),
            admin,
            raw: Some(RawAccess {
                port: server.port,
                password: None,
            }),
            keep: vec![Box::new(server)],
        };
        Harness::server(env).await
    }

    /// A store on its own pool (the same store for the in-memory backend).
    async fn another_connection(&self) -> Arc<dyn LeaseStore> {
        match &self.env {
            Some(env) => Arc::new(
                ValkeyStore::connect(env.config.clone())
                    .await
                    .expect("connect"),
            ),
            None => self.store.clone(),
        }
    }

    /// A store whose cached replies expire soon, and how long to let pass until they have:
    /// the in-memory store itself (its manual clock jumps past its 60 s reply TTL), or a second
    /// store on the server with a 1 s reply TTL (and a call timeout that the 4x rule allows).
    pub async fn short_replies(&self) -> (Arc<dyn LeaseStore>, Duration) {
        match &self.env {
            None => (self.store.clone(), Duration::from_secs(61)),
            Some(env) => {
                let mut config = env.config.clone();
                config.reply_ttl = Duration::from_secs(1);
                config.call_timeout = Duration::from_millis(250);
                let store = ValkeyStore::connect(config).await.expect("connect");
                (Arc::new(store), Duration::from_millis(1_200))
            }
        }
    }

    /// Lets time pass: the manual clock moves, a real server is waited for.
    pub async fn pass(&self, d: Duration) {
        match &self.memory {
            Some((_, clock)) => clock.advance(d),
            None => tokio::time::sleep(d).await,
        }
    }

    /// The store's clock in microseconds: the manual clock, or this machine's clock for a server
    /// on this machine (close enough for tests that keep a minute of margin).
    pub fn clock_micros(&self) -> u64 {
        match &self.memory {
            Some((_, clock)) => clock.now_micros(),
            None => SystemClock.now_micros(),
        }
    }

    /// Loses all data, as FLUSHALL or a restart without persistence does.
    pub async fn wipe(&self) {
        match (&self.memory, &self.env) {
            (Some((store, _)), _) => store.forget_everything(),
            (_, Some(env)) => env.admin.flushall().await,
            _ => unreachable!(),
        }
    }

    /// The server under test (server backends only).
    pub fn env(&self) -> &ServerEnv {
        self.env.as_ref().expect("server backend")
    }

    /// The administrator's connection (server backends only).
    pub fn admin(&self) -> &Admin {
        &self.env().admin
    }

    fn raw(&self) -> &RawAccess {
        self.env().raw.as_ref().expect("raw access")
    }

    /// The keys of a target under the store's prefix.
    pub fn keys(&self, t: &TargetRef) -> TargetKeys {
        let prefix = self
            .env
            .as_ref()
            .map_or("tl", |e| e.config.key_prefix.as_str());
        TargetKeys::new(prefix, t)
    }
}

/// A target in the contract's namespace.
pub fn target(name: &str) -> TargetRef {
    TargetRef::new("contract", name).expect("valid target")
}

/// An acquire request with a fresh request id and no token floor.
pub fn acquire_req(t: &TargetRef, lease: &str, owner: &str, ttl: Duration) -> AcquireRequest {
    AcquireRequest {
        target: t.clone(),
        lease_id: LeaseId::new(lease).expect("lease id"),
        owner: owner.into(),
        ttl,
        min_token: 0,
        request_id: RequestId::random(),
    }
}

/// A lease handle.
pub fn handle(t: &TargetRef, lease: &str, owner: &str, token: u64) -> LeaseHandle {
    LeaseHandle {
        target: t.clone(),
        lease_id: LeaseId::new(lease).expect("lease id"),
        owner: owner.into(),
        token,
    }
}

/// A renew request with a fresh request id.
pub fn renew_req(h: LeaseHandle, ttl: Duration) -> RenewRequest {
    RenewRequest {
        lease: h,
        ttl,
        request_id: RequestId::random(),
    }
}

/// A release request with a fresh request id.
pub fn release_req(h: LeaseHandle) -> ReleaseRequest {
    ReleaseRequest {
        lease: h,
        request_id: RequestId::random(),
    }
}

/// A commit to the guarded record `data` with a fresh request id and a sequence number larger
/// than every earlier one of this process (so each new call is a later write).
pub fn commit_req(t: &TargetRef, token: u64, value: &str) -> CommitRequest {
    static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    CommitRequest {
        target: t.clone(),
        token,
        key: "data".into(),
        value: value.into(),
        sequence: SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
        request_id: RequestId::random(),
    }
}

/// Acquires and expects a grant.
pub async fn acquired(store: &dyn LeaseStore, req: &AcquireRequest) -> Grant {
    match store.acquire(req).await.expect("acquire call") {
        AcquireOutcome::Acquired(grant) => grant,
        other => panic!("expected acquired, got {other:?}"),
    }
}

/// The usual lease TTL of the contract.
pub const TTL: Duration = Duration::from_secs(30);
const SHORT_TTL: Duration = Duration::from_millis(300);
const PAST_SHORT_TTL: Duration = Duration::from_millis(500);

// 1. A free target is acquired; a second claim sees who holds it.
async fn acquire_free_then_held(h: Harness) {
    let t = target("free");
    let grant = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert!(grant.token > 0);
    assert_eq!(grant.expires_in_ms, 30_000);
    assert_eq!(grant.expires_at_ms(), grant.server_time_ms + 30_000);
    match h
        .store
        .acquire(&acquire_req(&t, "lease-b", "bob", TTL))
        .await
        .unwrap()
    {
        AcquireOutcome::Held {
            owner,
            expires_in_ms,
        } => {
            assert_eq!(owner, "alice");
            assert!(
                expires_in_ms > 0 && expires_in_ms <= 30_000,
                "{expires_in_ms}"
            );
        }
        other => panic!("expected held, got {other:?}"),
    }
    let seen = h.store.inspect(&t).await.unwrap();
    let lease = seen.lease.expect("a live lease");
    assert_eq!((lease.owner.as_str(), lease.token), ("alice", grant.token));
    assert_eq!(seen.fence, grant.token);
}

// 2. 100 concurrent claims on separate connections: exactly one owner, one token.
async fn hundred_concurrent_acquires_one_winner(h: Harness) {
    let t = target("race");
    let mut stores = Vec::new();
    for _ in 0..100 {
        stores.push(h.another_connection().await);
    }
    let start = Arc::new(tokio::sync::Barrier::new(100));
    let mut tasks = tokio::task::JoinSet::new();
    for (i, store) in stores.into_iter().enumerate() {
        let (t, start) = (t.clone(), start.clone());
        tasks.spawn(async move {
            start.wait().await;
            let req = acquire_req(&t, &format!("lease-{i}"), &format!("worker-{i}"), TTL);
            (i, store.acquire(&req).await.expect("acquire"))
        });
    }
    let mut winners = Vec::new();
    let mut held_by = Vec::new();
    while let Some(done) = tasks.join_next().await {
        match done.expect("task") {
            (i, AcquireOutcome::Acquired(g)) => winners.push((i, g.token)),
            (_, AcquireOutcome::Held { owner, .. }) => held_by.push(owner),
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let (winner, token) = winners[0];
    assert_eq!(held_by.len(), 99);
    assert!(held_by.iter().all(|o| *o == format!("worker-{winner}")));
    let seen = h.store.inspect(&t).await.unwrap();
    assert_eq!(seen.lease.map(|l| l.token), Some(token));
}

// 3a. Expiry then reacquire: strictly larger token.
async fn expiry_then_reacquire_gives_larger_token(h: Harness) {
    let t = target("expiry");
    let first = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", SHORT_TTL)).await;
    h.pass(PAST_SHORT_TTL).await;
    assert!(
        h.store.inspect(&t).await.unwrap().lease.is_none(),
        "lease should have expired"
    );
    let second = acquired(&*h.store, &acquire_req(&t, "lease-b", "bob", TTL)).await;
    assert!(
        second.token > first.token,
        "{} <= {}",
        second.token,
        first.token
    );
}

// 3b. Release then reacquire: strictly larger token.
async fn release_then_reacquire_gives_larger_token(h: Harness) {
    let t = target("release");
    let first = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let released = h
        .store
        .release(&release_req(handle(&t, "lease-a", "alice", first.token)))
        .await
        .unwrap();
    assert_eq!(released, ReleaseOutcome::Released);
    let second = acquired(&*h.store, &acquire_req(&t, "lease-b", "bob", TTL)).await;
    assert!(second.token > first.token);
    assert_eq!(h.store.inspect(&t).await.unwrap().fence, second.token);
}

// 4. After someone else reacquired, the old owner can neither renew, release nor commit.
async fn old_owner_refused_after_reacquire(h: Harness) {
    let t = target("takeover");
    let old = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", SHORT_TTL)).await;
    h.pass(PAST_SHORT_TTL).await;
    let new = acquired(&*h.store, &acquire_req(&t, "lease-b", "bob", TTL)).await;
    let stale = handle(&t, "lease-a", "alice", old.token);
    assert_eq!(
        h.store.renew(&renew_req(stale.clone(), TTL)).await.unwrap(),
        RenewOutcome::Lost {
            reason: LossReason::NotHolder
        }
    );
    assert_eq!(
        h.store.release(&release_req(stale)).await.unwrap(),
        ReleaseOutcome::NotHolder
    );
    assert_eq!(
        h.store
            .commit(&commit_req(&t, old.token, "from alice"))
            .await
            .unwrap(),
        CommitOutcome::Stale { newest: new.token }
    );
    assert_eq!(
        h.store.check(&t, old.token).await.unwrap(),
        CheckOutcome::Stale { newest: new.token }
    );
    // The new holder is untouched and can commit.
    let lease = h.store.inspect(&t).await.unwrap().lease.expect("bob holds");
    assert_eq!((lease.owner.as_str(), lease.token), ("bob", new.token));
    assert_eq!(
        h.store
            .commit(&commit_req(&t, new.token, "from bob"))
            .await
            .unwrap(),
        CommitOutcome::Committed { token: new.token }
    );
    // ... and an old commit is refused by the guarded record even if it came later.
    assert!(matches!(
        h.store
            .commit(&commit_req(&t, old.token, "late"))
            .await
            .unwrap(),
        CommitOutcome::Stale { .. }
    ));
    let stored = h
        .store
        .read_guarded(&t, "data")
        .await
        .unwrap()
        .expect("written");
    assert_eq!(
        (stored.token, stored.value.as_str()),
        (new.token, "from bob")
    );
    // A renewal that expired without a successor reports the lease as expired.
    let gone = target("gone");
    let g = acquired(
        &*h.store,
        &acquire_req(&gone, "lease-c", "carol", SHORT_TTL),
    )
    .await;
    h.pass(PAST_SHORT_TTL).await;
    assert_eq!(
        h.store
            .renew(&renew_req(handle(&gone, "lease-c", "carol", g.token), TTL))
            .await
            .unwrap(),
        RenewOutcome::Lost {
            reason: LossReason::Expired
        }
    );
}

// 5. Renew with a wrong lease id, owner or token is refused and does not extend the TTL.
async fn renew_with_wrong_identity_is_refused(h: Harness) {
    let t = target("identity");
    let ttl = Duration::from_secs(10);
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", ttl)).await;
    let long = Duration::from_secs(600);
    for wrong in [
        handle(&t, "lease-x", "alice", g.token),
        handle(&t, "lease-a", "mallory", g.token),
        handle(&t, "lease-a", "alice", g.token + 1),
        handle(&t, "lease-a", "alice", g.token - 1),
    ] {
        assert_eq!(
            h.store
                .renew(&renew_req(wrong.clone(), long))
                .await
                .unwrap(),
            RenewOutcome::Lost {
                reason: LossReason::NotHolder
            },
            "{wrong:?}"
        );
        assert_eq!(
            h.store.release(&release_req(wrong)).await.unwrap(),
            ReleaseOutcome::NotHolder
        );
    }
    let left = h
        .store
        .inspect(&t)
        .await
        .unwrap()
        .lease
        .expect("still held")
        .expires_in_ms;
    assert!(
        left <= 10_000,
        "TTL was extended to {left} ms by a refused renew"
    );
    // The right identity does extend it: the check above is not vacuous.
    let renewed = h
        .store
        .renew(&renew_req(handle(&t, "lease-a", "alice", g.token), long))
        .await
        .unwrap();
    assert!(matches!(
        renewed,
        RenewOutcome::Renewed {
            expires_in_ms: 600_000,
            ..
        }
    ));
    let left = h
        .store
        .inspect(&t)
        .await
        .unwrap()
        .lease
        .expect("held")
        .expires_in_ms;
    assert!(left > 500_000, "{left}");
}

// 6a. A retried acquire returns the first reply and acts once.
async fn retried_acquire_returns_first_reply(h: Harness) {
    let t = target("retry-acquire");
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    let first = acquired(&*h.store, &req).await;
    let released = h
        .store
        .release(&release_req(handle(&t, "lease-a", "alice", first.token)))
        .await
        .unwrap();
    assert_eq!(released, ReleaseOutcome::Released);
    let retried = acquired(&*h.store, &req).await;
    assert_eq!(retried, first, "a retry must return the first reply");
    let seen = h.store.inspect(&t).await.unwrap();
    assert!(seen.lease.is_none(), "the retry acquired a second time");
    assert_eq!(seen.fence, first.token, "the retry issued another token");
}

// 6b. An acquire whose reply was never read, retried with its request id: the first result.
async fn unread_acquire_retried_returns_first_result(h: Harness) {
    let t = target("retry-unread");
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    match &h.env {
        None => {
            // In one process "never read" is a dropped result.
            let _ = h.store.acquire(&req).await;
        }
        Some(env) => send_without_reading(&h, env, &req).await,
    }
    let before = h.store.inspect(&t).await.unwrap();
    let token = before.lease.as_ref().expect("the unread acquire ran").token;
    let retried = acquired(&*h.store, &req).await;
    assert_eq!(retried.token, token);
    let after = h.store.inspect(&t).await.unwrap();
    assert_eq!(after.fence, before.fence, "the retry issued another token");
}

/// Sends the acquire script without ever reading its reply (the client crashed, or the reply
/// was lost on the way): on a raw connection closed once the script has run where the server
/// offers plaintext access, otherwise through the administrator's connection with the reply
/// discarded.
async fn send_without_reading(h: &Harness, env: &ServerEnv, req: &AcquireRequest) {
    let keys = h.keys(&req.target);
    let ttl = req.ttl.as_millis().to_string();
    let min = req.min_token.to_string();
    let command = [
        "EVAL",
        SCRIPTS.acquire.source,
        "4",
        &keys.lease(),
        &keys.fence(),
        &keys.reply(&req.request_id),
        &keys.grant(),
        req.lease_id.expose(),
        &req.owner,
        &ttl,
        &min,
        "60000",
        req.request_id.as_str(),
    ];
    let Some(raw) = &env.raw else {
        let _ = env.admin.try_cmd(&command).await;
        assert!(
            env.admin.exists(&keys.lease()).await,
            "the unread acquire never ran"
        );
        return;
    };
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", raw.port))
        .await
        .expect("raw connection");
    if let Some(pw) = &raw.password {
        stream.write_all(&resp(&["AUTH", pw])).await.expect("auth");
    }
    stream.write_all(&resp(&command)).await.expect("send");
    for _ in 0..200 {
        if env.admin.exists(&keys.lease()).await {
            drop(stream);
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the unread acquire never ran");
}

// 6c. A retried renew returns the first reply and does not extend again.
async fn retried_renew_acts_once(h: Harness) {
    let t = target("retry-renew");
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let lease = handle(&t, "lease-a", "alice", g.token);
    let long = renew_req(lease.clone(), Duration::from_secs(600));
    let first = h.store.renew(&long).await.unwrap();
    let short = renew_req(lease, Duration::from_secs(5));
    assert!(matches!(
        h.store.renew(&short).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    assert_eq!(h.store.renew(&long).await.unwrap(), first);
    let left = h
        .store
        .inspect(&t)
        .await
        .unwrap()
        .lease
        .expect("held")
        .expires_in_ms;
    assert!(
        left <= 5_000,
        "the retried renew extended the lease again: {left} ms"
    );
}

// 6d. A retried release returns the first reply and does not touch the next holder.
async fn retried_release_acts_once(h: Harness) {
    let t = target("retry-release");
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let release = release_req(handle(&t, "lease-a", "alice", g.token));
    assert_eq!(
        h.store.release(&release).await.unwrap(),
        ReleaseOutcome::Released
    );
    let next = acquired(&*h.store, &acquire_req(&t, "lease-b", "bob", TTL)).await;
    assert_eq!(
        h.store.release(&release).await.unwrap(),
        ReleaseOutcome::Released
    );
    let lease = h
        .store
        .inspect(&t)
        .await
        .unwrap()
        .lease
        .expect("bob still holds");
    assert_eq!((lease.owner.as_str(), lease.token), ("bob", next.token));
}

// 6e. A retried commit returns the first reply and does not write again.
async fn retried_commit_acts_once(h: Harness) {
    let t = target("retry-commit");
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let first = commit_req(&t, g.token, "first");
    let committed = h.store.commit(&first).await.unwrap();
    assert_eq!(committed, CommitOutcome::Committed { token: g.token });
    h.store
        .commit(&commit_req(&t, g.token, "second"))
        .await
        .unwrap();
    assert_eq!(h.store.commit(&first).await.unwrap(), committed);
    let stored = h
        .store
        .read_guarded(&t, "data")
        .await
        .unwrap()
        .expect("written");
    assert_eq!(stored.value, "second", "the retried commit wrote again");
}

// 7. After all data is lost the next token is still larger than every token issued before.
async fn tokens_grow_after_data_loss(h: Harness) {
    let mut highest = 0;
    for name in ["loss-1", "loss-2"] {
        let t = target(name);
        for round in 0..3 {
            let lease = format!("lease-{round}");
            let g = acquired(&*h.store, &acquire_req(&t, &lease, "w", TTL)).await;
            h.store
                .release(&release_req(handle(&t, &lease, "w", g.token)))
                .await
                .unwrap();
            highest = highest.max(g.token);
        }
    }
    h.wipe().await;
    assert_eq!(
        h.store.inspect(&target("loss-1")).await.unwrap().fence,
        0,
        "data was not lost"
    );
    h.pass(Duration::from_millis(1)).await;
    // Without any floor from the caller: the server clock covers it.
    let g = acquired(
        &*h.store,
        &acquire_req(&target("loss-1"), "lease-x", "w", TTL),
    )
    .await;
    assert!(g.token > highest, "{} <= {highest}", g.token);
    // A token pushed ahead of the clock by a floor (up to an hour ahead, the most a store
    // accepts) is not forgotten with the data: a target without a fence starts an hour ahead
    // of the clock, above every token issued before.
    let ahead = target("loss-ahead");
    let mut req = acquire_req(&ahead, "lease-y", "w", TTL);
    req.min_token = h.clock_micros() + MAX_TOKEN_LEAD_MICROS - 60_000_000;
    let pushed = acquired(&*h.store, &req).await;
    assert!(pushed.token > req.min_token);
    h.store
        .release(&release_req(handle(&ahead, "lease-y", "w", pushed.token)))
        .await
        .unwrap();
    h.wipe().await;
    h.pass(Duration::from_millis(1)).await;
    let after = acquired(&*h.store, &acquire_req(&ahead, "lease-z", "w", TTL)).await;
    assert!(
        after.token > pushed.token,
        "after the loss {} <= {} issued before it",
        after.token,
        pushed.token
    );
    // With the caller's floor (what the controller passes): larger than the floor.
    h.wipe().await;
    let mut req = acquire_req(&target("loss-2"), "lease-y", "w", TTL);
    req.min_token = after.token;
    assert!(acquired(&*h.store, &req).await.token > after.token);
}

// 8. Corrupt records fail closed with a clear error and are left as they were.
async fn corrupt_records_fail_closed(h: Harness) {
    let admin = h.admin();
    let cases: [(&str, &[&[&str]], &str); 6] = [
        ("string-lease", &[&["SET", "{lease}", "junk"]], "not a hash"),
        (
            "unknown-version",
            &[&[
                "HSET",
                "{lease}",
                "record_version",
                "99",
                "lease_id",
                "x",
                "owner",
                "o",
                "token",
                "5",
                "acquired_ms",
                "1",
            ]],
            "unknown record_version",
        ),
        (
            "missing-field",
            &[&[
                "HSET",
                "{lease}",
                "record_version",
                "1",
                "lease_id",
                "x",
                "owner",
                "o",
                "acquired_ms",
                "1",
            ]],
            "lacks field token",
        ),
        (
            "bad-token",
            &[&[
                "HSET",
                "{lease}",
                "record_version",
                "1",
                "lease_id",
                "x",
                "owner",
                "o",
                "token",
                "12abc",
                "acquired_ms",
                "1",
            ]],
            "non-numeric token",
        ),
        ("bad-fence", &[&["SET", "{fence}", "many"]], "fence"),
        ("fence-wrong-type", &[&["LPUSH", "{fence}", "1"]], "fence"),
    ];
    for (name, writes, expected) in cases {
        let t = target(name);
        let keys = h.keys(&t);
        for write in writes {
            let args: Vec<String> = write
                .iter()
                .map(|a| {
                    a.replace("{lease}", &keys.lease())
                        .replace("{fence}", &keys.fence())
                })
                .collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            admin.cmd(&args).await;
        }
        let dump = async || -> (Value, Value) {
            (
                admin.cmd(&["DUMP", &keys.lease()]).await,
                admin.cmd(&["DUMP", &keys.fence()]).await,
            )
        };
        let dump_before = dump().await;
        let lease = handle(&t, "lease-a", "alice", 5);
        let results: Vec<(&str, Result<(), StoreError>)> = vec![
            (
                "acquire",
                h.store
                    .acquire(&acquire_req(&t, "lease-a", "alice", TTL))
                    .await
                    .map(drop),
            ),
            (
                "renew",
                h.store
                    .renew(&renew_req(lease.clone(), TTL))
                    .await
                    .map(drop),
            ),
            (
                "release",
                h.store.release(&release_req(lease)).await.map(drop),
            ),
            ("inspect", h.store.inspect(&t).await.map(drop)),
        ];
        let fence_case = name.contains("fence");
        for (op, result) in results {
            // A corrupt fence is only read where a token is issued or compared.
            if fence_case && (op == "renew" || op == "release") {
                continue;
            }
            match result {
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::Corrupt, "{name}/{op}: {e}");
                    assert!(e.to_string().contains(expected), "{name}/{op}: {e}");
                }
                Ok(()) => panic!("{name}/{op}: a corrupt record was accepted"),
            }
        }
        if fence_case {
            let e = h.store.commit(&commit_req(&t, 7, "v")).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{name}/commit: {e}");
        }
        let dump_after = dump().await;
        assert_eq!(
            dump_before, dump_after,
            "{name}: the corrupt record was changed"
        );
    }
    // A corrupt cached reply is refused too, not replayed.
    let t = target("bad-reply");
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    let keys = h.keys(&t);
    admin
        .cmd(&["SET", &keys.reply(&req.request_id), "{not json"])
        .await;
    let e = h.store.acquire(&req).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
}

// 9. Besides connection set-up and health, the backend sends only scripts.
async fn client_sends_only_scripts(h: Harness) {
    let raw = h.raw().clone();
    h.admin().cmd(&["SCRIPT", "FLUSH"]).await;
    let mut monitor = BufReader::new(
        tokio::net::TcpStream::connect(("127.0.0.1", raw.port))
            .await
            .expect("connect"),
    );
    let mut line = String::new();
    if let Some(pw) = &raw.password {
        monitor
            .get_mut()
            .write_all(&resp(&["AUTH", pw]))
            .await
            .expect("auth");
        monitor.read_line(&mut line).await.expect("auth reply");
        line.clear();
    }
    monitor
        .get_mut()
        .write_all(&resp(&["MONITOR"]))
        .await
        .expect("monitor");
    monitor.read_line(&mut line).await.expect("monitor reply");
    assert!(line.starts_with("+OK"), "{line}");

    let store = h.another_connection().await;
    let t = target("monitored");
    let g = acquired(&*store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let lease = handle(&t, "lease-a", "alice", g.token);
    store.renew(&renew_req(lease.clone(), TTL)).await.unwrap();
    store.commit(&commit_req(&t, g.token, "v")).await.unwrap();
    store.check(&t, g.token).await.unwrap();
    store.read_guarded(&t, "data").await.unwrap();
    store.inspect(&t).await.unwrap();
    store.release(&release_req(lease)).await.unwrap();
    store.health().await.unwrap();
    h.admin().cmd(&["ECHO", "monitor-done"]).await;

    let mut commands = Vec::new();
    loop {
        line.clear();
        let n = tokio::time::timeout(Duration::from_secs(5), monitor.read_line(&mut line))
            .await
            .expect("monitor output")
            .expect("read");
        assert!(n > 0, "monitor connection closed");
        if line.contains("\"monitor-done\"") {
            break;
        }
        // Commands run inside a script are listed with the client "lua": they are atomic.
        if line.contains(" lua]") || line.contains("\"ECHO\"") {
            continue;
        }
        let name = line
            .split("] \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next());
        commands.push(name.unwrap_or("?").to_ascii_uppercase());
    }
    // INFO is the connection's maxmemory-policy check.
    let allowed = [
        "EVALSHA", "EVAL", "HELLO", "AUTH", "CLIENT", "PING", "SELECT", "INFO",
    ];
    let others: Vec<&String> = commands
        .iter()
        .filter(|c| !allowed.contains(&c.as_str()))
        .collect();
    assert!(
        others.is_empty(),
        "the client sent non-script commands: {others:?}"
    );
    let evalsha = commands.iter().filter(|c| *c == "EVALSHA").count();
    assert!(
        evalsha >= 7,
        "expected every call as EVALSHA, saw {commands:?}"
    );
    assert!(
        commands.iter().any(|c| c == "EVAL"),
        "scripts were flushed, so a transparent EVAL of the source was expected: {commands:?}"
    );
}

// 10. Logs of a run with a password in the URL contain neither the password nor a lease id.
async fn logs_hide_password_and_lease_id(h: Harness) {
    let kind = h.env().kind;
    let password = "pw-4f9c1e77-do-not-log";
    let server = Server::start_with(kind, &["--requirepass", password]);
    let lease_id = "3b0e8f6a-51c2-4d4e-9e0f-5a7d2c1b9e44";
    let (captured, _guard) = suite::capture_logs();

    let config = valkey_config(&server.url());
    tracing::info!(?config, "connecting");
    let store = ValkeyStore::connect(config)
        .await
        .expect("connect with password");
    tracing::info!(?store, "connected");
    let t = target("logged");
    let g = acquired(&store, &acquire_req(&t, lease_id, "alice", TTL)).await;
    let lease = handle(&t, lease_id, "alice", g.token);
    store.renew(&renew_req(lease.clone(), TTL)).await.unwrap();
    store.release(&release_req(lease)).await.unwrap();
    // Failures are logged too: a wrong password and a corrupt record.
    let wrong = format!("redis://:{password}-wrong@127.0.0.1:{}", server.port);
    let bad = ValkeyStore::new_lazy(valkey_config(&wrong)).expect("lazy store");
    let e = bad
        .acquire(&acquire_req(&t, lease_id, "alice", TTL))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    tracing::error!(error = %e, "as a caller would log it");
    server.raw(&[
        "SET",
        &TargetKeys::new("tl", &target("logged-corrupt")).lease(),
        "junk",
    ]);
    let _ = store
        .acquire(&acquire_req(&target("logged-corrupt"), lease_id, "a", TTL))
        .await;
    drop(_guard);

    let logs = captured.text();
    assert!(
        logs.contains("lease#"),
        "expected hashed lease ids in the logs:\n{logs}"
    );
    assert!(
        logs.contains("refused access"),
        "expected the auth failure in the logs:\n{logs}"
    );
    assert!(
        logs.contains("***"),
        "expected the masked URL in the logs:\n{logs}"
    );
    assert!(
        !logs.contains(password),
        "password leaked into logs:\n{logs}"
    );
    assert!(
        !logs.contains(lease_id),
        "lease id leaked into logs:\n{logs}"
    );
    assert!(
        !logs.contains("3b0e8f6a"),
        "part of the lease id leaked into logs:\n{logs}"
    );
}

/// One test body.
pub type TestFn = fn(Harness) -> Pin<Box<dyn Future<Output = ()>>>;

/// What a test needs from a backend.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Only the store: every backend.
    Store,
    /// An administrator connection: servers and clusters.
    Admin,
    /// Plaintext access to a single server as its default user.
    Raw,
}

/// A list of `(name, needs, body)` from `Needs name, ...`.
#[macro_export]
macro_rules! cases {
    ($($needs:ident $name:ident),* $(,)?) => {
        [$((stringify!($name), $crate::contract_cases::Needs::$needs,
            (|h| Box::pin($name(h))) as $crate::contract_cases::TestFn)),*]
    };
}

/// Every contract test and what it needs.
const CASES: [(&str, Needs, TestFn); 15] = cases![
    Store acquire_free_then_held,
    Store hundred_concurrent_acquires_one_winner,
    Store expiry_then_reacquire_gives_larger_token,
    Store release_then_reacquire_gives_larger_token,
    Store old_owner_refused_after_reacquire,
    Store renew_with_wrong_identity_is_refused,
    Store retried_acquire_returns_first_reply,
    Store unread_acquire_retried_returns_first_result,
    Store retried_renew_acts_once,
    Store retried_release_acts_once,
    Store retried_commit_acts_once,
    Store tokens_grow_after_data_loss,
    Admin corrupt_records_fail_closed,
    Raw client_sends_only_scripts,
    Raw logs_hide_password_and_lease_id,
];

/// Makes a fresh harness for one test.
pub type Factory = fn() -> Pin<Box<dyn Future<Output = Harness>>>;

/// One backend the contract runs against.
#[derive(Clone, Copy)]
pub struct Variant {
    /// Prefix of the trial names.
    pub name: &'static str,
    /// A fresh harness per test.
    pub make: Factory,
    /// Whether the harness has an administrator connection.
    pub admin: bool,
    /// Whether the harness has plaintext access to a single server.
    pub raw: bool,
}

/// The in-memory store and one plain server of each kind the suites support (Valkey 9.1, Valkey
/// 8.1, Redis 7.0), each with an administrator and raw access.
pub fn plain_variants() -> [Variant; 4] {
    [
        Variant {
            name: "memory",
            make: || Box::pin(async { Harness::memory() }),
            admin: false,
            raw: false,
        },
        Variant {
            name: ServerKind::Valkey91.name(),
            make: || Box::pin(Harness::plain(ServerKind::Valkey91)),
            admin: true,
            raw: true,
        },
        Variant {
            name: ServerKind::Valkey81.name(),
            make: || Box::pin(Harness::plain(ServerKind::Valkey81)),
            admin: true,
            raw: true,
        },
        Variant {
            name: ServerKind::Redis70.name(),
            make: || Box::pin(Harness::plain(ServerKind::Redis70)),
            admin: true,
            raw: true,
        },
    ]
}

/// The contract's trials for each variant: `<variant>::<test>`.
pub fn trials(variants: &[Variant]) -> Vec<Trial> {
    trials_of(variants, &CASES)
}

/// The trials of `cases` for each variant that offers what they need: `<variant>::<test>`.
pub fn trials_of(variants: &[Variant], cases: &[(&'static str, Needs, TestFn)]) -> Vec<Trial> {
    let mut trials = Vec::new();
    for variant in variants {
        for &(name, needs, test) in cases {
            let offered = match needs {
                Needs::Store => true,
                Needs::Admin => variant.admin,
                Needs::Raw => variant.raw,
            };
            if !offered {
                continue;
            }
            let make = variant.make;
            trials.push(suite::trial(
                format!("{}::{name}", variant.name),
                move || async move { test(make().await).await },
            ));
        }
    }
    trials
}
