//! The upgrade from layout version 1 (a lease hash with a TTL, a grant string, JSON reply
//! caches) to the target record, while leases are held, on every server kind: leases are
//! held by version 1's own scripts (`tests/fixtures/lua-v1`, unchanged), the current store
//! takes over, and the test checks that no lease is lost, no token goes down, no retry acts
//! twice across the switch, and that a version 1 client still running afterwards can neither
//! take a moved target nor a target created after the upgrade.

use targetlease_test_support as support;

use std::time::Duration;

use redis::Value;
use targetlease::redact::SecretUrl;
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, ErrorKind, LeaseHandle, LeaseId, LeaseStore, Owner,
    ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, RepairOutcome, RequestId,
    TargetRef, Token, Ttl,
};

use support::admin::Admin;
use support::server::{Server, ServerKind};

const V1_LIB: &str = include_str!("fixtures/lua-v1/lib.lua");
const TTL_MS: u64 = 30_000;
/// The owner version 2 leaves at a moved version 1 lease key (lua/lib.lua, MOVED_OWNER).
const MOVED_OWNER: &str = "targetlease-record-v2 (upgrade this client)";

/// A version 1 client: version 1's scripts sent with EVAL, KEYS and ARGV as version 1's
/// `wire.rs` built them.
struct V1<'a> {
    admin: &'a Admin,
}

impl V1<'_> {
    async fn eval(&self, op: &str, keys: &[String], args: &[&str]) -> Result<Vec<String>, String> {
        let source = match op {
            "acquire" => include_str!("fixtures/lua-v1/acquire.lua"),
            "renew" => include_str!("fixtures/lua-v1/renew.lua"),
            "release" => include_str!("fixtures/lua-v1/release.lua"),
            "check" => include_str!("fixtures/lua-v1/check.lua"),
            "inspect" => include_str!("fixtures/lua-v1/inspect.lua"),
            "commit" => include_str!("fixtures/lua-v1/commit.lua"),
            "repair" => include_str!("fixtures/lua-v1/repair.lua"),
            other => panic!("no version 1 script {other}"),
        };
        let source = format!("{V1_LIB}\n{source}");
        let count = keys.len().to_string();
        let mut argv = vec!["EVAL", source.as_str(), count.as_str()];
        argv.extend(keys.iter().map(String::as_str));
        argv.extend(args);
        match self.admin.try_cmd(&argv).await {
            Ok(Value::Array(items)) => Ok(items
                .into_iter()
                .map(|v| match v {
                    Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                    other => format!("{other:?}"),
                })
                .collect()),
            Ok(other) => Err(format!("version 1 {op} answered {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    async fn acquire(&self, k: &TargetKeys, who: &str, ttl_ms: u64, rid: &str) -> Vec<String> {
        let rid_ = RequestId::new(rid).expect("request id");
        let ttl = ttl_ms.to_string();
        let lease_id = format!("lease-{who}");
        self.eval(
            "acquire",
            &[k.v1_lease(), k.fence(), k.reply(&rid_), k.v1_grant()],
            &[&lease_id, who, &ttl, "0", "60000", rid],
        )
        .await
        .expect("version 1 acquire")
    }

    async fn renew(&self, k: &TargetKeys, who: &str, token: u64, rid: &str) -> Vec<String> {
        let rid = RequestId::new(rid).expect("request id");
        let (lease_id, token) = (format!("lease-{who}"), token.to_string());
        let ttl = TTL_MS.to_string();
        self.eval(
            "renew",
            &[k.v1_lease(), k.fence(), k.reply(&rid)],
            &[&lease_id, who, &token, &ttl, "60000"],
        )
        .await
        .expect("version 1 renew")
    }

    async fn release(&self, k: &TargetKeys, who: &str, token: u64, rid: &str) -> Vec<String> {
        let rid = RequestId::new(rid).expect("request id");
        let (lease_id, token) = (format!("lease-{who}"), token.to_string());
        self.eval(
            "release",
            &[k.v1_lease(), k.reply(&rid)],
            &[&lease_id, who, &token, "60000"],
        )
        .await
        .expect("version 1 release")
    }
}

fn target(name: &str) -> TargetRef {
    TargetRef::new("upgrade", name).expect("target")
}

fn token_of(v1_reply: &[String]) -> u64 {
    assert_eq!(
        v1_reply.first().map(String::as_str),
        Some("acquired"),
        "{v1_reply:?}"
    );
    v1_reply[1].parse().expect("token")
}

fn acquire_req(t: &TargetRef, who: &str, rid: &str) -> AcquireRequest {
    AcquireRequest {
        target: t.clone(),
        lease_id: LeaseId::new(format!("lease-{who}")).expect("lease id"),
        owner: Owner::new(who).expect("owner"),
        ttl: Ttl::new(Duration::from_millis(TTL_MS)).expect("ttl"),
        min_token: 0,
        request_id: RequestId::new(rid).expect("request id"),
    }
}

fn handle(t: &TargetRef, who: &str, token: u64) -> LeaseHandle {
    LeaseHandle {
        target: t.clone(),
        lease_id: LeaseId::new(format!("lease-{who}")).expect("lease id"),
        owner: Owner::new(who).expect("owner"),
        token: Token::new(token).expect("token"),
    }
}

async fn granted(store: &ValkeyStore, req: &AcquireRequest) -> u64 {
    match store.acquire(req).await.expect("acquire") {
        AcquireOutcome::Acquired(g) => g.token,
        other => panic!("{}: expected a grant, got {other:?}", req.target),
    }
}

async fn upgrade_while_leases_are_held(kind: ServerKind) {
    let server = Server::start(kind);
    let admin = Admin::single(&server.url(), None).await;
    let v1 = V1 { admin: &admin };
    let keys = |name: &str| TargetKeys::new("tl", &target(name));
    let (a, b, c, e, f) = (keys("a"), keys("b"), keys("c"), keys("e"), keys("f"));

    // Version 1 at work: alice holds a; bob held b and released it; carol holds c and renewed
    // it; erin's lease on e expired.
    let acquired_a = v1.acquire(&a, "alice", TTL_MS, "a1").await;
    let token_a = token_of(&acquired_a);
    let token_b = token_of(&v1.acquire(&b, "bob", TTL_MS, "b1").await);
    assert_eq!(v1.release(&b, "bob", token_b, "b2").await, ["released"]);
    let token_c = token_of(&v1.acquire(&c, "carol", TTL_MS, "c1").await);
    let renewed_c = v1.renew(&c, "carol", token_c, "c2").await;
    assert_eq!(renewed_c[0], "renewed");
    let token_e = token_of(&v1.acquire(&e, "erin", 200, "e1").await);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The current store takes over.
    let store = ValkeyStore::connect(ValkeyConfig::new(
        SecretUrl::parse(&server.url()).expect("url"),
    ))
    .await
    .expect("connect");

    // a: still alice's, read from the version 1 keys; a refusal writes nothing.
    let seen = store.inspect(&target("a")).await.expect("inspect");
    let lease = seen.lease.expect("alice's lease survived the switch");
    assert_eq!((lease.owner.as_str(), lease.token), ("alice", token_a));
    assert!(lease.expires_in_ms > 25_000, "{}", lease.expires_in_ms);
    assert_eq!(seen.fence, token_a);
    assert!(matches!(
        store.acquire(&acquire_req(&target("a"), "dave", "d1")).await,
        Ok(AcquireOutcome::Held { ref owner, .. }) if owner == "alice"
    ));
    assert!(
        !admin.exists(&a.record()).await,
        "a refusal moved the target"
    );
    // Alice's renewal through the current store moves the target into the record.
    let renewed = store
        .renew(&RenewRequest {
            lease: handle(&target("a"), "alice", token_a),
            ttl: Ttl::new(Duration::from_millis(TTL_MS)).expect("ttl"),
            request_id: RequestId::new("a2").expect("id"),
        })
        .await
        .expect("renew");
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    assert!(
        admin.exists(&a.record()).await,
        "the renewal did not move the target"
    );
    assert!(
        !admin.exists(&a.v1_grant()).await,
        "the version 1 grant stayed"
    );
    // Alice's acquire retried across the switch answers its first reply (a version 1 JSON
    // cache entry) to the millisecond, not a re-entrant grant of the current moment.
    match store
        .acquire(&acquire_req(&target("a"), "alice", "a1"))
        .await
        .expect("retry")
    {
        AcquireOutcome::Acquired(g) => assert_eq!(
            [g.token, g.expires_in_ms, g.server_time_ms, g.acquired_at_ms].map(|n| n.to_string()),
            [1, 2, 3, 4].map(|i| acquired_a[i].clone()),
        ),
        other => panic!("{other:?}"),
    }

    // A version 1 client still running: refused everywhere on the moved target, and told why.
    let refused = v1.acquire(&a, "dave", TTL_MS, "d2").await;
    assert_eq!(
        (refused[0].as_str(), refused[1].as_str()),
        ("held", MOVED_OWNER)
    );
    assert_eq!(
        v1.renew(&a, "alice", token_a, "a3").await,
        ["lost", "not_holder"]
    );
    assert_eq!(v1.release(&a, "alice", token_a, "a4").await, ["not_holder"]);
    // The fence did not move, so version 1's fencing check still agrees.
    assert_eq!(
        v1.eval("check", &[a.fence()], &[&token_a.to_string()])
            .await
            .expect("check"),
        ["current", &token_a.to_string()]
    );
    let lease = store
        .inspect(&target("a"))
        .await
        .expect("inspect")
        .lease
        .expect("alice still holds a");
    assert_eq!((lease.owner.as_str(), lease.token), ("alice", token_a));
    assert_eq!(
        store
            .release(&ReleaseRequest {
                lease: handle(&target("a"), "alice", token_a),
                request_id: RequestId::new("a5").expect("id"),
            })
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    // Alice's grant moved into the record with the lease: once its cached reply is gone, a
    // replay is refused as spent, never a second tenure.
    admin
        .cmd(&["DEL", &a.reply(&RequestId::new("a1").expect("id"))])
        .await;
    let spent = store
        .acquire(&acquire_req(&target("a"), "alice", "a1"))
        .await
        .expect_err("a replay of a spent acquire, moved");
    assert!(spent.to_string().contains("already acquired"), "{spent}");
    let token_a2 = granted(&store, &acquire_req(&target("a"), "dave", "d3")).await;
    // A version 1 workload's fenced commit still works with the current token: the fence is
    // the same key.
    let committed = v1
        .eval(
            "commit",
            &[
                a.fence(),
                a.guarded("progress"),
                a.commit_reply(&RequestId::new("w1").expect("id")),
            ],
            &[&token_a2.to_string(), "42", "60000", "1", "progress"],
        )
        .await
        .expect("version 1 commit");
    assert_eq!(committed, ["committed", &token_a2.to_string()]);

    // b: bob's acquire replayed across the switch answers its first reply; once that reply has
    // expired, the spent request id (version 1's grant) is refused, never a second tenure.
    assert_eq!(
        granted(&store, &acquire_req(&target("b"), "bob", "b1")).await,
        token_b
    );
    admin
        .cmd(&["DEL", &b.reply(&RequestId::new("b1").expect("id"))])
        .await;
    let spent = store
        .acquire(&acquire_req(&target("b"), "bob", "b1"))
        .await
        .expect_err("a replay of a spent acquire");
    assert_eq!(spent.kind(), ErrorKind::InvalidRequest, "{spent}");
    assert!(spent.to_string().contains("already acquired"), "{spent}");
    let token_b2 = granted(&store, &acquire_req(&target("b"), "frank", "f1")).await;

    // c: carol's renewal retried across the switch answers its first reply and acts no more.
    let retried = store
        .renew(&RenewRequest {
            lease: handle(&target("c"), "carol", token_c),
            ttl: Ttl::new(Duration::from_millis(TTL_MS)).expect("ttl"),
            request_id: RequestId::new("c2").expect("id"),
        })
        .await
        .expect("renew");
    assert_eq!(
        retried,
        RenewOutcome::Renewed {
            expires_in_ms: renewed_c[1].parse().expect("pttl"),
            server_time_ms: renewed_c[2].parse().expect("time"),
        }
    );
    let lease = store
        .inspect(&target("c"))
        .await
        .expect("inspect")
        .lease
        .expect("carol's lease survived the switch");
    assert_eq!((lease.owner.as_str(), lease.token), ("carol", token_c));

    // e: expired before the switch, free after it; the token still grows.
    let seen = store.inspect(&target("e")).await.expect("inspect");
    assert!(seen.lease.is_none());
    let token_e2 = granted(&store, &acquire_req(&target("e"), "erin", "e2")).await;

    // No token went down: on every target, the token issued after the switch is above the
    // one before it (tokens are per target).
    for (what, before, after) in [
        ("a", token_a, token_a2),
        ("b", token_b, token_b2),
        ("e", token_e, token_e2),
    ] {
        assert!(after > before, "{what}: {after} is not above {before}");
    }

    // f: a target first used after the upgrade cannot be taken by a version 1 client either.
    granted(&store, &acquire_req(&target("f"), "gina", "g1")).await;
    let refused = v1.acquire(&f, "hank", TTL_MS, "h1").await;
    assert_eq!(
        (refused[0].as_str(), refused[1].as_str()),
        ("held", MOVED_OWNER)
    );
    let inspected = v1.eval("inspect", &[f.v1_lease(), f.fence()], &[]).await;
    assert!(
        matches!(&inspected, Ok(r) if r[0] == "held" && r[3] == MOVED_OWNER),
        "{inspected:?}"
    );
    // A version 1 caller that names itself like the marker does not pass for one: its lease
    // holds the target (it cannot get the marker's token 1).
    let g = keys("g");
    let forged = v1
        .eval(
            "acquire",
            &[
                g.v1_lease(),
                g.fence(),
                g.reply(&RequestId::new("x1").expect("id")),
                g.v1_grant(),
            ],
            &[
                "moved-to-record-v2:forged",
                MOVED_OWNER,
                "30000",
                "0",
                "60000",
                "x1",
            ],
        )
        .await
        .expect("version 1 acquire");
    assert_eq!(forged[0], "acquired");
    assert!(matches!(
        store.acquire(&acquire_req(&target("g"), "jack", "j1")).await,
        Ok(AcquireOutcome::Held { ref owner, .. }) if owner == MOVED_OWNER
    ));

    // Repair keeps the marker in place: deleted (or left without its TTL by a restore), it is
    // written again, so version 1 clients stay refused.
    admin.cmd(&["DEL", &f.v1_lease()]).await;
    let repaired = store.repair(&target("f"), 0).await.expect("repair");
    assert!(
        matches!(&repaired, RepairOutcome::Repaired { what, .. } if what.contains("marker")),
        "{repaired:?}"
    );
    let refused = v1.acquire(&f, "hank", TTL_MS, "h2").await;
    assert_eq!(
        (refused[0].as_str(), refused[1].as_str()),
        ("held", MOVED_OWNER)
    );
    admin.cmd(&["PERSIST", &f.v1_lease()]).await;
    assert!(matches!(
        store.repair(&target("f"), 0).await.expect("repair"),
        RepairOutcome::Repaired { .. }
    ));
    assert!(
        matches!(admin.cmd(&["PTTL", &f.v1_lease()]).await, Value::Int(ms) if ms > 86_400_000),
        "the marker got its TTL back"
    );
    // A version 1 lease granted beside a record (the marker deleted while a version 1 client
    // ran) is refused by repair, never chosen between.
    admin.cmd(&["DEL", &f.v1_lease()]).await;
    token_of(&v1.acquire(&f, "hank", TTL_MS, "h3").await);
    let both = store
        .repair(&target("f"), 0)
        .await
        .expect_err("two layouts hold the target");
    assert_eq!(both.kind(), ErrorKind::Corrupt, "{both}");
    assert!(both.to_string().contains("beside the record"), "{both}");
    admin.cmd(&["DEL", &f.v1_lease()]).await;
    store.repair(&target("f"), 0).await.expect("repair");

    // The marker is never mistaken for a lease: with the record lost (a partial restore, a
    // hand-deleted key), the target reads as free and the next token is still above the fence.
    let fence = store.inspect(&target("f")).await.expect("inspect").fence;
    admin.cmd(&["DEL", &f.record()]).await;
    let seen = store.inspect(&target("f")).await.expect("inspect");
    assert!(seen.lease.is_none(), "{seen:?}");
    assert!(granted(&store, &acquire_req(&target("f"), "ivy", "i1")).await > fence);
}

/// Repair on targets without a record: an unreadable version 1 lease hash or grant is deleted,
/// as version 1's own repair did, and the target is free afterwards.
async fn repair_reads_version_1_keys(kind: ServerKind) {
    let server = Server::start(kind);
    let admin = Admin::single(&server.url(), None).await;
    let store = ValkeyStore::connect(ValkeyConfig::new(
        SecretUrl::parse(&server.url()).expect("url"),
    ))
    .await
    .expect("connect");
    for (name, write, what) in [
        ("junk-lease", ["SET", "v1_lease", "junk"], "version 1 lease"),
        ("junk-grant", ["LPUSH", "v1_grant", "x"], "version 1 grant"),
    ] {
        let k = TargetKeys::new("tl", &target(name));
        let key = if write[1] == "v1_lease" {
            k.v1_lease()
        } else {
            k.v1_grant()
        };
        admin.cmd(&[write[0], &key, write[2]]).await;
        let e = store
            .acquire(&acquire_req(&target(name), "kim", "k1"))
            .await
            .expect_err("corrupt");
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{name}: {e}");
        match store.repair(&target(name), 0).await.expect("repair") {
            RepairOutcome::Repaired { what: done, .. } => assert!(done.contains(what), "{done}"),
            other => panic!("{name}: {other:?}"),
        }
        granted(&store, &acquire_req(&target(name), "kim", "k2")).await;
    }
}

fn run(kind: ServerKind) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            upgrade_while_leases_are_held(kind).await;
            repair_reads_version_1_keys(kind).await;
        });
}

#[test]
fn upgrade_on_valkey_9_1() {
    run(ServerKind::Valkey91);
}

#[test]
fn upgrade_on_valkey_8_1() {
    run(ServerKind::Valkey81);
}

#[test]
fn upgrade_on_redis_7_0() {
    run(ServerKind::Redis70);
}
