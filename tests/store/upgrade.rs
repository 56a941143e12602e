//! The upgrades from earlier releases' scripts to the current ones, while leases are held, on
//! every server kind. From the release with table replies and JSON reply caches
//! (`tests/fixtures/lua-v1`), from the release before permits (`tests/fixtures/lua-v2`) and
//! from the acquire with an exclusive path of its own (`tests/fixtures/lua-two-paths`), all
//! unchanged: leases are held by the earlier scripts, the current store takes over, and the
//! test checks that no lease is lost, no token goes down, no retry acts twice across the switch,
//! and that a client of the earlier release still running keeps working beside the new one (a
//! rolling upgrade, or a rollback), except on a target whose permits above 1 are held, where
//! it fails closed rather than take the target beside them.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};
use support::suite;

use std::time::Duration;

use redis::Value;
use targetlease::redact::SecretUrl;
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::wire;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, ErrorKind, LeaseHandle, LeaseId, LeaseStore, Owner, Permits,
    ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, RequestId, Slot, TargetRef, Token,
    Ttl,
};

use support::admin::Admin;
use support::server::{Server, ServerKind};

const V1_LIB: &str = include_str!("../fixtures/lua-v1/lib.lua");
const TTL_MS: u64 = 30_000;

/// Sends `lib` and `source` (an earlier release's prelude and script) with EVAL, as that
/// release's client did.
async fn eval_script(
    admin: &Admin,
    lib: &str,
    source: &str,
    keys: &[String],
    args: &[&str],
) -> Result<Value, String> {
    let source = format!("{lib}\n{source}");
    let count = keys.len().to_string();
    let mut argv = vec!["EVAL", source.as_str(), count.as_str()];
    argv.extend(keys.iter().map(String::as_str));
    argv.extend(args);
    admin.try_cmd(&argv).await.map_err(|e| e.to_string())
}

/// A client of the previous release: its scripts sent with EVAL, KEYS and ARGV as its `wire.rs`
/// built them.
struct V1<'a> {
    admin: &'a Admin,
}

impl V1<'_> {
    async fn eval(&self, op: &str, keys: &[String], args: &[&str]) -> Result<Vec<String>, String> {
        let source = match op {
            "acquire" => include_str!("../fixtures/lua-v1/acquire.lua"),
            "renew" => include_str!("../fixtures/lua-v1/renew.lua"),
            "release" => include_str!("../fixtures/lua-v1/release.lua"),
            "check" => include_str!("../fixtures/lua-v1/check.lua"),
            "inspect" => include_str!("../fixtures/lua-v1/inspect.lua"),
            "commit" => include_str!("../fixtures/lua-v1/commit.lua"),
            other => panic!("no version 1 script {other}"),
        };
        match eval_script(self.admin, V1_LIB, source, keys, args).await {
            Ok(Value::Array(items)) => Ok(items
                .into_iter()
                .map(|v| match v {
                    Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                    other => format!("{other:?}"),
                })
                .collect()),
            Ok(other) => Err(format!("version 1 {op} answered {other:?}")),
            Err(e) => Err(e),
        }
    }

    async fn acquire(&self, k: &TargetKeys, who: &str, ttl_ms: u64, rid: &str) -> Vec<String> {
        let rid_ = RequestId::new(rid).expect("request id");
        let ttl = ttl_ms.to_string();
        let lease_id = format!("lease-{who}");
        self.eval(
            "acquire",
            &[k.lease(), k.fence(), k.reply(&rid_), k.grant()],
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
            &[k.lease(), k.fence(), k.reply(&rid)],
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
            &[k.lease(), k.reply(&rid)],
            &[&lease_id, who, &token, "60000"],
        )
        .await
        .expect("version 1 release")
    }
}

/// A client of the release before permits: its scripts sent with EVAL, KEYS and ARGV as its
/// `wire.rs` built them (one-string replies).
struct V2<'a> {
    admin: &'a Admin,
}

impl V2<'_> {
    async fn eval(&self, op: &str, keys: &[String], args: &[&str]) -> Result<String, String> {
        let source = match op {
            "acquire" => include_str!("../fixtures/lua-v2/acquire.lua"),
            "renew" => include_str!("../fixtures/lua-v2/renew.lua"),
            "release" => include_str!("../fixtures/lua-v2/release.lua"),
            "check" => include_str!("../fixtures/lua-v2/check.lua"),
            "commit" => include_str!("../fixtures/lua-v2/commit.lua"),
            other => panic!("no script {other} in the release before permits"),
        };
        let lib = include_str!("../fixtures/lua-v2/lib.lua");
        match eval_script(self.admin, lib, source, keys, args).await? {
            Value::BulkString(b) => Ok(String::from_utf8_lossy(&b).into_owned()),
            other => Err(format!(
                "{op} of the release before permits answered {other:?}"
            )),
        }
    }

    async fn acquire(&self, k: &TargetKeys, who: &str, rid: &str) -> Result<String, String> {
        let rid_ = RequestId::new(rid).expect("request id");
        let (lease_id, ttl) = (format!("lease-{who}"), TTL_MS.to_string());
        self.eval(
            "acquire",
            &[k.lease(), k.fence(), k.reply(&rid_), k.grant()],
            &[&lease_id, who, &ttl, "0", "60000", rid],
        )
        .await
    }

    async fn renew(
        &self,
        k: &TargetKeys,
        who: &str,
        token: u64,
        rid: &str,
    ) -> Result<String, String> {
        let rid = RequestId::new(rid).expect("request id");
        let (lease_id, token, ttl) = (
            format!("lease-{who}"),
            token.to_string(),
            TTL_MS.to_string(),
        );
        self.eval(
            "renew",
            &[k.lease(), k.fence(), k.reply(&rid)],
            &[&lease_id, who, &token, &ttl, "60000"],
        )
        .await
    }

    async fn release(
        &self,
        k: &TargetKeys,
        who: &str,
        token: u64,
        rid: &str,
    ) -> Result<String, String> {
        let rid = RequestId::new(rid).expect("request id");
        let (lease_id, token) = (format!("lease-{who}"), token.to_string());
        self.eval(
            "release",
            &[k.lease(), k.reply(&rid)],
            &[&lease_id, who, &token, "60000"],
        )
        .await
    }
}

/// The token of an `acquired ...` one-string reply.
fn v2_token(reply: &str) -> u64 {
    let mut fields = reply.split(' ');
    assert_eq!(fields.next(), Some("acquired"), "{reply}");
    fields.next().and_then(|t| t.parse().ok()).expect("token")
}

fn permit_req(t: &TargetRef, who: &str, rid: &str, permits: u32) -> AcquireRequest {
    AcquireRequest {
        permits: Permits::new(permits).expect("permits"),
        ..acquire_req(t, who, rid)
    }
}

/// The release before permits and the current one side by side: exclusive leases pass between
/// them in both directions with their keys and replies unchanged; on a target whose permits
/// above 1 are held, the earlier release's acquire never takes the target beside them.
async fn upgrade_from_the_release_before_permits(kind: ServerKind) {
    let server = Server::start(kind);
    let admin = Admin::single(&server.url(), None).await;
    let v2 = V2 { admin: &admin };
    let keys = |name: &str| TargetKeys::new("tl", &target(name));
    let (a, f, p) = (keys("v2-a"), keys("v2-f"), keys("v2-p"));
    let store = ValkeyStore::connect(ValkeyConfig::new(
        SecretUrl::parse(&server.url()).expect("url"),
    ))
    .await
    .expect("connect");

    // a: held by the earlier release; the current one sees it, replays its acquire with the
    // very reply it cached, renews and releases it.
    let first = v2.acquire(&a, "alice", "a1").await.expect("acquire");
    let token_a = v2_token(&first);
    assert!(matches!(
        store.acquire(&acquire_req(&target("v2-a"), "dave", "d1")).await,
        Ok(AcquireOutcome::Held { ref owner, .. }) if owner == "alice"
    ));
    match store
        .acquire(&acquire_req(&target("v2-a"), "alice", "a1"))
        .await
        .expect("retry")
    {
        AcquireOutcome::Acquired(g) => assert_eq!(
            format!(
                "acquired {} {} {} {}",
                g.token, g.expires_in_ms, g.server_time_ms, g.acquired_at_ms
            ),
            first
        ),
        other => panic!("{other:?}"),
    }
    assert!(
        v2.renew(&a, "alice", token_a, "a2")
            .await
            .expect("renew")
            .starts_with("renewed ")
    );
    let renewed = store
        .renew(&RenewRequest {
            lease: handle(&target("v2-a"), "alice", token_a),
            ttl: Ttl::new(Duration::from_millis(TTL_MS)).expect("ttl"),
            request_id: RequestId::new("a3").expect("id"),
        })
        .await
        .expect("renew");
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    assert_eq!(
        store
            .release(&ReleaseRequest {
                lease: handle(&target("v2-a"), "alice", token_a),
                request_id: RequestId::new("a4").expect("id"),
            })
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let token_a2 = v2_token(&v2.acquire(&a, "erin", "e1").await.expect("acquire"));
    assert!(token_a2 > token_a);

    // f: the other way round (a rollback): the current store's exclusive lease is held for
    // the earlier release, which renews and releases it.
    let token_f = granted(&store, &acquire_req(&target("v2-f"), "gina", "g1")).await;
    assert!(
        v2.acquire(&f, "hank", "h1")
            .await
            .expect("acquire")
            .starts_with("held ")
    );
    assert!(
        v2.renew(&f, "gina", token_f, "g2")
            .await
            .expect("renew")
            .starts_with("renewed ")
    );
    assert_eq!(
        v2.release(&f, "gina", token_f, "g3")
            .await
            .expect("release"),
        "released"
    );

    // p: two permits of three held by the current store. While slot 0 is held the earlier
    // release sees the target held; once only slot 1 is, it cannot read slot 0's fence and
    // fails closed: it never grants an exclusive lease beside a permit.
    let t = target("v2-p");
    let slot0 = match store
        .acquire(&permit_req(&t, "pat", "p1", 3))
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(g) => g,
        other => panic!("{other:?}"),
    };
    let slot1 = match store
        .acquire(&permit_req(&t, "quin", "q1", 3))
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(g) => g,
        other => panic!("{other:?}"),
    };
    assert_eq!((slot0.slot.get(), slot1.slot.get()), (0, 1));
    assert!(
        v2.acquire(&p, "old", "o1")
            .await
            .expect("acquire")
            .starts_with("held ")
    );
    let release = |who: &str, g: &targetlease::store::Grant, rid: &str| ReleaseRequest {
        lease: LeaseHandle {
            permits: Permits::new(3).expect("permits"),
            slot: g.slot,
            ..handle(&t, who, g.token)
        },
        request_id: RequestId::new(rid).expect("id"),
    };
    assert_eq!(
        store
            .release(&release("pat", &slot0, "p2"))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let refused = v2.acquire(&p, "old", "o2").await;
    assert!(
        matches!(&refused, Err(e) if e.contains("TLCORRUPT")),
        "the earlier release's acquire beside a held permit: {refused:?}"
    );
    // The last permit released and an exclusive grant made, the target is the earlier release's
    // to use again.
    assert_eq!(
        store
            .release(&release("quin", &slot1, "q2"))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let token_p = granted(&store, &acquire_req(&t, "rita", "r1")).await;
    assert!(token_p > slot1.token);
    assert!(
        v2.acquire(&p, "old", "o3")
            .await
            .expect("acquire")
            .starts_with("held ")
    );
    assert_eq!(
        v2.eval("check", &[p.fence()], &[&token_p.to_string()])
            .await
            .expect("check"),
        format!("current {token_p}")
    );
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
        permits: Permits::ONE,
        ttl: Ttl::new(Duration::from_millis(TTL_MS)).expect("ttl"),
        min_token: 0,
        request_id: RequestId::new(rid).expect("request id"),
    }
}

fn handle(t: &TargetRef, who: &str, token: u64) -> LeaseHandle {
    LeaseHandle {
        target: t.clone(),
        permits: Permits::ONE,
        slot: Slot::ZERO,
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
    let (a, b, c, f) = (keys("a"), keys("b"), keys("c"), keys("f"));

    // The previous release at work: alice holds a; bob held b and released it; carol holds c
    // and renewed it; erin's lease on e expired.
    let acquired_a = v1.acquire(&a, "alice", TTL_MS, "a1").await;
    let token_a = token_of(&acquired_a);
    let token_b = token_of(&v1.acquire(&b, "bob", TTL_MS, "b1").await);
    assert_eq!(v1.release(&b, "bob", token_b, "b2").await, ["released"]);
    let token_c = token_of(&v1.acquire(&c, "carol", TTL_MS, "c1").await);
    let renewed_c = v1.renew(&c, "carol", token_c, "c2").await;
    assert_eq!(renewed_c[0], "renewed");
    let token_e = token_of(&v1.acquire(&keys("e"), "erin", 200, "e1").await);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The current store takes over.
    let store = ValkeyStore::connect(ValkeyConfig::new(
        SecretUrl::parse(&server.url()).expect("url"),
    ))
    .await
    .expect("connect");

    // a: still alice's; another claim is refused; alice renews through the current store.
    let seen = store.inspect(&target("a")).await.expect("inspect");
    let lease = seen.lease.expect("alice's lease survived the switch");
    assert_eq!((lease.owner.as_str(), lease.token), ("alice", token_a));
    assert!(lease.expires_in_ms > 25_000, "{}", lease.expires_in_ms);
    assert_eq!(seen.fence, token_a);
    assert!(matches!(
        store.acquire(&acquire_req(&target("a"), "dave", "d1")).await,
        Ok(AcquireOutcome::Held { ref owner, .. }) if owner == "alice"
    ));
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
    // Alice's acquire retried across the switch answers its first reply (a JSON cache entry of
    // the previous release) to the millisecond, not a re-entrant grant of the current moment.
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
    // A client of the previous release still running (a rolling upgrade) sees the same lease:
    // refused as another claim, and alice's own renewal through it still works.
    let refused = v1.acquire(&a, "dave", TTL_MS, "d2").await;
    assert_eq!(
        (refused[0].as_str(), refused[1].as_str()),
        ("held", "alice")
    );
    assert_eq!(v1.renew(&a, "alice", token_a, "a3").await[0], "renewed");
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
    // Once its cached reply is gone, a replay of alice's spent acquire is refused, never a
    // second tenure.
    admin
        .cmd(&["DEL", &a.reply(&RequestId::new("a1").expect("id"))])
        .await;
    let spent = store
        .acquire(&acquire_req(&target("a"), "alice", "a1"))
        .await
        .expect_err("a replay of a spent acquire");
    assert!(spent.to_string().contains("already acquired"), "{spent}");
    let token_a2 = granted(&store, &acquire_req(&target("a"), "dave", "d3")).await;
    // The previous release's fencing check and commit agree with the current token.
    assert_eq!(
        v1.eval("check", &[a.fence()], &[&token_a2.to_string()])
            .await
            .expect("check"),
        ["current", &token_a2.to_string()]
    );
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
        .expect("commit of the previous release");
    assert_eq!(committed, ["committed", &token_a2.to_string()]);
    // A retry by the previous release of a call the current one cached fails closed: it cannot
    // read the new cache entry, and never acts again.
    let d3 = v1
        .eval(
            "acquire",
            &[
                a.lease(),
                a.fence(),
                a.reply(&RequestId::new("d3").expect("id")),
                a.grant(),
            ],
            &["lease-dave", "dave", "30000", "0", "60000", "d3"],
        )
        .await;
    assert!(matches!(&d3, Err(e) if e.contains("TLCORRUPT")), "{d3:?}");

    // b: bob's acquire replayed across the switch reads its first reply (a JSON cache entry
    // of the previous release) and learns that the grant ended with his release; once that
    // reply has expired, the spent request id is refused.
    assert_eq!(
        store
            .acquire(&acquire_req(&target("b"), "bob", "b1"))
            .await
            .expect("retry"),
        AcquireOutcome::Expired { token: token_b }
    );
    admin
        .cmd(&["DEL", &b.reply(&RequestId::new("b1").expect("id"))])
        .await;
    let spent = store
        .acquire(&acquire_req(&target("b"), "bob", "b1"))
        .await
        .expect_err("a replay of a spent acquire");
    assert_eq!(spent.kind(), ErrorKind::InvalidRequest, "{spent}");
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

    // e: expired before the switch, free after it; the token still grows.
    assert!(
        store
            .inspect(&target("e"))
            .await
            .expect("inspect")
            .lease
            .is_none()
    );
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

    // f, the other way round (a rollback): a lease taken by the current store is held for the
    // previous release's clients and renewed and released by them.
    let token_f = granted(&store, &acquire_req(&target("f"), "gina", "g1")).await;
    let refused = v1.acquire(&f, "hank", TTL_MS, "h1").await;
    assert_eq!((refused[0].as_str(), refused[1].as_str()), ("held", "gina"));
    assert_eq!(v1.renew(&f, "gina", token_f, "g2").await[0], "renewed");
    assert_eq!(v1.release(&f, "gina", token_f, "g3").await, ["released"]);
    assert!(
        store
            .inspect(&target("f"))
            .await
            .expect("inspect")
            .lease
            .is_none()
    );
}

/// A grant the two-path acquire cached (an exclusive grant named no slot) is answered to its
/// retry by the current store as the same grant, to the millisecond, in slot 0; each script
/// sees the other's grant as held; and a retry of a current grant by the two-path script (a
/// rollback) gets that grant in the form its clients read.
async fn upgrade_from_the_two_path_acquire(kind: ServerKind) {
    let server = Server::start(kind);
    let admin = Admin::single(&server.url(), None).await;
    let store = ValkeyStore::connect(ValkeyConfig::new(
        SecretUrl::parse(&server.url()).expect("url"),
    ))
    .await
    .expect("connect");
    let two_paths = |req: &AcquireRequest| {
        let keys = TargetKeys::new("tl", &req.target);
        let (keys, args) =
            wire::acquire_call(&keys, req, &TTL_MS.to_string(), "60000").keys_and_args();
        let admin = &admin;
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match eval_script(
                admin,
                include_str!("../../lua/lib.lua"),
                include_str!("../fixtures/lua-two-paths/acquire.lua"),
                &keys,
                &args,
            )
            .await
            {
                Ok(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                other => panic!("the two-path acquire answered {other:?}"),
            }
        }
    };

    let t = target("two-paths");
    let first = two_paths(&acquire_req(&t, "alice", "a1")).await;
    assert_eq!(
        first.split(' ').count(),
        5,
        "an exclusive grant without a slot: {first}"
    );
    assert!(matches!(
        store.acquire(&acquire_req(&t, "dave", "d1")).await,
        Ok(AcquireOutcome::Held { ref owner, .. }) if owner == "alice"
    ));
    match store
        .acquire(&acquire_req(&t, "alice", "a1"))
        .await
        .expect("retry")
    {
        AcquireOutcome::Acquired(g) => {
            assert_eq!(g.slot, Slot::ZERO);
            assert_eq!(
                format!(
                    "acquired {} {} {} {}",
                    g.token, g.expires_in_ms, g.server_time_ms, g.acquired_at_ms
                ),
                first
            );
        }
        other => panic!("{other:?}"),
    }
    let token = v2_token(&first);
    assert_eq!(
        store
            .release(&ReleaseRequest {
                lease: handle(&t, "alice", token),
                request_id: RequestId::new("a2").expect("id"),
            })
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    // The other way round (a rollback): the current grant is held for the two-path script, and
    // a retry of it there gets the grant in the form that script's clients read.
    let next = match store
        .acquire(&acquire_req(&t, "erin", "e1"))
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(g) => g,
        other => panic!("{other:?}"),
    };
    assert!(next.token > token);
    let refused = two_paths(&acquire_req(&t, "hank", "h1")).await;
    assert!(refused.starts_with("held "), "{refused}");
    assert_eq!(
        two_paths(&acquire_req(&t, "erin", "e1")).await,
        format!(
            "acquired {} {} {} {}",
            next.token, next.expires_in_ms, next.server_time_ms, next.acquired_at_ms
        ),
        "a retry across a rollback"
    );
}

fn run(kind: ServerKind) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(upgrade_while_leases_are_held(kind));
    runtime.block_on(upgrade_from_the_release_before_permits(kind));
    runtime.block_on(upgrade_from_the_two_path_acquire(kind));
}

fn upgrade_on_valkey_9_1() {
    run(ServerKind::Valkey91);
}

fn upgrade_on_valkey_8_1() {
    run(ServerKind::Valkey81);
}

fn upgrade_on_redis_7_0() {
    run(ServerKind::Redis70);
}

/// The suite's trials (each holds a server and a runtime of its own).
pub fn suite(args: &Arguments) -> Conclusion {
    suite::run(
        args,
        vec![
            suite::blocking_trial("upgrade_on_valkey_9_1", upgrade_on_valkey_9_1),
            suite::blocking_trial("upgrade_on_valkey_8_1", upgrade_on_valkey_8_1),
            suite::blocking_trial("upgrade_on_redis_7_0", upgrade_on_redis_7_0),
        ],
    )
}
