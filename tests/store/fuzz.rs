//! Fuzzing with proptest: arbitrary script replies, arbitrary lease records in a real Valkey, and
//! arbitrary TargetLease documents. Nothing may panic; bad input must come back as an error, and a
//! record the scripts cannot read must never be treated as a free target.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};
use support::suite;

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use targetlease::api::TargetLease;
use targetlease::redact::SecretUrl;
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::wire;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, CommitRequest, ErrorKind, GuardedKey, LeaseHandle, LeaseId,
    LeaseStore, MAX_PERMITS, MAX_TOKEN, Owner, Permits, ReleaseRequest, RenewRequest, RequestId,
    Slot, StoreError, TargetRef, Token, Ttl,
};

use support::cases;
use support::server::{Server, ServerKind};

fn element() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("acquired".to_owned()),
        Just("held".to_owned()),
        Just("renewed".to_owned()),
        Just("lost".to_owned()),
        Just("expired".to_owned()),
        Just("not_holder".to_owned()),
        Just("released".to_owned()),
        Just("committed".to_owned()),
        Just("stale".to_owned()),
        Just("current".to_owned()),
        Just("free".to_owned()),
        Just("present".to_owned()),
        Just("absent".to_owned()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        ".*",
    ]
}

fn reply_decoders_never_panic() {
    let mut runner = TestRunner::new(Config {
        cases: cases(20_000),
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(element(), 0..10), |parts| {
            // Fields joined as the scripts join them, and once more with the spaces doubled.
            for reply in [parts.join(" "), parts.join("  ")] {
                for permits in [1, 3, MAX_PERMITS] {
                    let permits = Permits::new(permits).expect("permits");
                    let _ = wire::acquire(&reply, permits);
                }
                let _ = wire::renew(&reply);
                let _ = wire::release(&reply);
                let _ = wire::commit(&reply);
                let _ = wire::check(&reply);
                let _ = wire::read(&reply);
                let _ = wire::inspect(&reply);
                let _ = wire::repair(&reply);
            }
            Ok(())
        })
        .expect("decoders");
}

fn targetlease_documents_never_panic() {
    let mut runner = TestRunner::new(Config {
        cases: cases(5_000),
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(any::<u8>(), 0..512), |bytes| {
            let _ = serde_json::from_slice::<TargetLease>(&bytes);
            let _ = serde_yaml::from_slice::<TargetLease>(&bytes);
            Ok(())
        })
        .expect("raw bytes");
    let field = prop_oneof![
        Just(serde_json::Value::Null),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<bool>().prop_map(serde_json::Value::from),
        ".{0,20}".prop_map(serde_json::Value::from),
        Just(serde_json::json!({"kind": "Pod", "name": "p"})),
        Just(serde_json::json!([1, 2])),
    ];
    let spec = proptest::collection::btree_map(
        prop_oneof![
            Just("target"),
            Just("holder"),
            Just("ttlSeconds"),
            Just("maxHoldSeconds"),
            Just("release"),
            Just("holderRef"),
            Just("other")
        ],
        field,
        0..7,
    );
    runner
        .run(&spec, |spec| {
            let doc = serde_json::json!({
                "apiVersion": "targetlease.dev/v1beta1",
                "kind": "TargetLease",
                "metadata": {"name": "x", "namespace": "y"},
                "spec": spec,
            });
            let _ = serde_json::from_value::<TargetLease>(doc);
            Ok(())
        })
        .expect("structured documents");
}

/// A Valkey 9.1 server, a current-thread runtime and a store connected on it (the store's
/// connections are driven only inside that runtime's `block_on`).
fn valkey_store() -> (Server, tokio::runtime::Runtime, Arc<ValkeyStore>) {
    let server = Server::start(ServerKind::Valkey91);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = Arc::new(
        runtime
            .block_on(ValkeyStore::connect(ValkeyConfig::new(
                SecretUrl::parse(&server.url()).expect("url"),
            )))
            .expect("connect"),
    );
    (server, runtime, store)
}

/// Random contents of a lease hash: a valid lease with fields dropped at random and random fields
/// written over it (valid-looking values, junk), so that valid and corrupt records both come up.
fn record() -> impl Strategy<Value = Vec<(String, String)>> {
    let value = prop_oneof![
        Just("1".to_owned()),
        Just("2".to_owned()),
        Just("0".to_owned()),
        Just("".to_owned()),
        any::<u64>().prop_map(|n| n.to_string()),
        "[a-z0-9.{}-]{0,12}",
    ];
    let name = prop_oneof![
        Just("record_version".to_owned()),
        Just("lease_id".to_owned()),
        Just("owner".to_owned()),
        Just("token".to_owned()),
        Just("acquired_ms".to_owned()),
        "[a-z_]{1,8}",
    ];
    let held: &[(&str, &str)] = &[
        ("record_version", "1"),
        ("lease_id", "l"),
        ("owner", "o"),
        ("token", "5"),
        ("acquired_ms", "1"),
    ];
    (
        proptest::collection::vec(proptest::bool::weighted(0.85), held.len()),
        proptest::collection::vec((name, value), 0..3),
    )
        .prop_map(move |(keep, over)| {
            let mut fields: Vec<(String, String)> = held
                .iter()
                .zip(keep)
                .filter(|(_, keep)| *keep)
                .map(|((k, v), _)| ((*k).to_owned(), (*v).to_owned()))
                .chain(over)
                .collect();
            if fields.is_empty() {
                fields.push(("junk".into(), "x".into()));
            }
            fields
        })
}

/// What the record rules of docs/internals/store.md make of a lease hash holding `fields` (the last
/// value of a field wins, as with HSET): `None` when it must fail closed, `Some(true)` when it is a
/// lease (never FUZZ-OWNER's, so the target is held). Written from the documented rules, not from
/// the script.
fn lease_holds(fields: &[(String, String)], has_ttl: bool) -> Option<bool> {
    let map: std::collections::HashMap<&str, &str> = fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if map.get("record_version") != Some(&"1") {
        return None;
    }
    let canonical = |v: &str| -> Option<u64> {
        let ok = v == "0" || (v.len() <= 16 && !v.starts_with('0'));
        v.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| v.parse::<u64>().ok())
            .flatten()
            .filter(|n| ok && *n <= MAX_TOKEN)
    };
    let present = |f: &str| map.get(f).filter(|v| !v.is_empty()).copied();
    present("lease_id")?;
    present("owner")?;
    canonical(present("token")?).filter(|t| *t > 0)?;
    canonical(present("acquired_ms")?)?;
    // A lease without a TTL would be held forever: corrupt.
    has_ttl.then_some(true)
}

fn arbitrary_lease_records_fail_closed() {
    let (server, runtime, store) = valkey_store();
    let mut runner = TestRunner::new(Config {
        cases: cases(400),
        ..Config::default()
    });
    let case = std::cell::Cell::new(0u32);
    let (held, refused) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0u32));
    let count = |c: &std::cell::Cell<u32>| c.set(c.get() + 1);
    runner
        .run(&record(), |fields| {
            case.set(case.get() + 1);
            let case = case.get();
            let target = TargetRef::new("fuzz", &format!("t{case}")).expect("target");
            let key = TargetKeys::new("tl", &target).lease();
            let mut args = vec!["HSET".to_owned(), key.clone()];
            for (k, v) in &fields {
                args.push(k.clone());
                args.push(v.clone());
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            server.raw(&args);
            // Most records expire like a lease; the rest have no TTL (a restore that dropped it).
            let has_ttl = !case.is_multiple_of(4);
            if has_ttl {
                server.raw(&["PEXPIRE", &key, "60000"]);
            }
            let request = AcquireRequest {
                target,
                lease_id: LeaseId::new("FUZZ-LEASE").expect("id"),
                owner: Owner::new("FUZZ-OWNER").expect("owner"),
                permits: Permits::ONE,
                ttl: Ttl::new(Duration::from_secs(30)).expect("ttl"),
                min_token: 0,
                request_id: RequestId::random(),
            };
            let outcome = runtime.block_on(store.acquire(&request));
            match (outcome, lease_holds(&fields, has_ttl)) {
                (Ok(AcquireOutcome::Held { .. }), Some(true)) => count(&held),
                (Err(e), None) => {
                    prop_assert_eq!(e.kind(), ErrorKind::Corrupt, "{}", e);
                    count(&refused);
                }
                (outcome, expected) => {
                    return Err(TestCaseError::fail(format!(
                        "record {fields:?} (TTL: {has_ttl}) answered {outcome:?}, the rules say \
                         {expected:?} (None: corrupt, Some(true): held)"
                    )));
                }
            }
            Ok(())
        })
        .expect("records");
    // The generator reaches both outcomes, or the property says little.
    let (held, refused) = (held.get(), refused.get());
    assert!(held > 0 && refused > 0, "held {held}, refused {refused}");
}

/// A token-like value chosen to hurt: around 0, around 2^53, around 2^64, or anything.
fn hostile_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..3,
        (MAX_TOKEN - 2)..=(MAX_TOKEN + 2),
        (u64::MAX - 2)..=u64::MAX,
        any::<u64>(),
    ]
}

/// One call with hostile arguments.
#[derive(Clone, Debug)]
enum Hostile {
    Acquire {
        floor: u64,
        owner: String,
        lease: String,
        rid: u8,
    },
    Renew {
        token: u64,
        owner: String,
        lease: String,
        rid: u8,
    },
    Release {
        token: u64,
        owner: String,
        lease: String,
        rid: u8,
    },
    Commit {
        token: u64,
        sequence: u64,
        value: String,
        rid: u8,
    },
    Check {
        token: u64,
    },
}

fn hostile() -> impl Strategy<Value = Hostile> {
    // Few distinct names and request ids, so calls collide with each other on purpose.
    let name = prop_oneof![Just("a".to_owned()), Just("b".to_owned()), "\\PC{1,8}"];
    let rid = 0u8..4;
    prop_oneof![
        (hostile_u64(), name.clone(), name.clone(), rid.clone()).prop_map(
            |(floor, owner, lease, rid)| Hostile::Acquire {
                floor,
                owner,
                lease,
                rid
            }
        ),
        (hostile_u64(), name.clone(), name.clone(), rid.clone()).prop_map(
            |(token, owner, lease, rid)| Hostile::Renew {
                token,
                owner,
                lease,
                rid
            }
        ),
        (hostile_u64(), name.clone(), name.clone(), rid.clone()).prop_map(
            |(token, owner, lease, rid)| Hostile::Release {
                token,
                owner,
                lease,
                rid
            }
        ),
        (hostile_u64(), hostile_u64(), ".{0,64}", rid).prop_map(|(token, sequence, value, rid)| {
            Hostile::Commit {
                token,
                sequence,
                value,
                rid,
            }
        }),
        hostile_u64().prop_map(|token| Hostile::Check { token }),
    ]
}

/// Hostile argument values against a real server: huge, zero and boundary tokens, floors and
/// sequences, odd names, request ids reused across operations and callers. Nothing may panic,
/// a refusal is an invalid request (never a corrupt record or an unexpected reply: the store
/// must never write what it cannot read back), and every token issued is at most 2^53-1,
/// above the caller's floor, and above every token issued before on the target.
fn hostile_arguments_are_refused_cleanly() {
    let (_server, runtime, store) = valkey_store();
    let mut runner = TestRunner::new(Config {
        cases: cases(120),
        ..Config::default()
    });
    let case = std::cell::Cell::new(0u32);
    runner
        .run(&proptest::collection::vec(hostile(), 1..24), |calls| {
            case.set(case.get() + 1);
            let target = TargetRef::new("hostile", &format!("t{}", case.get())).expect("target");
            let rid = |n: u8| RequestId::new(&format!("rid-{n}")).expect("rid");
            let lease_id = |s: &str| LeaseId::new(s.to_owned()).expect("lease id");
            // Hostile values go through the protocol's types, as they would from a flag or a
            // status: those refuse what no store accepts (the scripts check again, see
            // tests/store/adversarial.rs), and the refusal must be an invalid request too.
            let handle =
                |token: u64, owner: &str, lease: &str| -> Result<LeaseHandle, StoreError> {
                    Ok(LeaseHandle {
                        target: target.clone(),
                        permits: Permits::ONE,
                        slot: Slot::ZERO,
                        lease_id: lease_id(lease),
                        owner: Owner::new(owner)?,
                        token: Token::new(token)?,
                    })
                };
            let ttl = Ttl::new(Duration::from_secs(30)).expect("ttl");
            let mut highest = 0u64;
            for call in calls {
                let result: Result<Option<(u64, u64)>, _> = runtime.block_on(async {
                    match &call {
                        Hostile::Acquire {
                            floor,
                            owner,
                            lease,
                            rid: n,
                        } => match Owner::new(owner.clone()) {
                            Ok(owner) => store
                                .acquire(&AcquireRequest {
                                    target: target.clone(),
                                    lease_id: lease_id(lease),
                                    owner,
                                    permits: Permits::ONE,
                                    ttl,
                                    min_token: *floor,
                                    request_id: rid(*n),
                                })
                                .await
                                .map(|o| match o {
                                    AcquireOutcome::Acquired(g) => Some((g.token, *floor)),
                                    AcquireOutcome::Held { .. }
                                    | AcquireOutcome::Expired { .. }
                                    | AcquireOutcome::PermitsConflict { .. } => None,
                                }),
                            Err(e) => Err(e),
                        },
                        Hostile::Renew {
                            token,
                            owner,
                            lease,
                            rid: n,
                        } => match handle(*token, owner, lease) {
                            Ok(lease) => store
                                .renew(&RenewRequest {
                                    lease,
                                    ttl,
                                    request_id: rid(*n),
                                })
                                .await
                                .map(|_| None),
                            Err(e) => Err(e),
                        },
                        Hostile::Release {
                            token,
                            owner,
                            lease,
                            rid: n,
                        } => match handle(*token, owner, lease) {
                            Ok(lease) => store
                                .release(&ReleaseRequest {
                                    lease,
                                    request_id: rid(*n),
                                })
                                .await
                                .map(|_| None),
                            Err(e) => Err(e),
                        },
                        Hostile::Commit {
                            token,
                            sequence,
                            value,
                            rid: n,
                        } => match Token::new(*token) {
                            Ok(token) => store
                                .commit(&CommitRequest {
                                    target: target.clone(),
                                    slot: Slot::ZERO,
                                    token,
                                    key: GuardedKey::new("data").expect("key"),
                                    value: value.clone(),
                                    sequence: *sequence,
                                    request_id: rid(*n),
                                })
                                .await
                                .map(|_| None),
                            Err(e) => Err(e),
                        },
                        Hostile::Check { token } => match Token::new(*token) {
                            Ok(token) => {
                                store.check(&target, Slot::ZERO, token).await.map(|_| None)
                            }
                            Err(e) => Err(e),
                        },
                    }
                });
                match result {
                    Ok(Some((token, floor))) => {
                        prop_assert!(
                            token <= MAX_TOKEN,
                            "{:?}: token {} above 2^53-1",
                            call,
                            token
                        );
                        prop_assert!(
                            token > floor,
                            "{:?}: token {} not above its floor",
                            call,
                            token
                        );
                        prop_assert!(
                            token >= highest,
                            "{:?}: token {} went back from {}",
                            call,
                            token,
                            highest
                        );
                        highest = token;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        prop_assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{:?}: {}", call, e)
                    }
                }
                let fence = runtime
                    .block_on(store.inspect(&target))
                    .map_err(|e| {
                        TestCaseError::fail(format!("{call:?} left an unreadable target: {e}"))
                    })?
                    .fence;
                prop_assert!(
                    fence >= highest && fence <= MAX_TOKEN,
                    "fence {} after {:?}",
                    fence,
                    call
                );
            }
            Ok(())
        })
        .expect("hostile arguments");
}

/// The suite's trials (each holds a server and a runtime of its own).
pub fn suite(args: &Arguments) -> Conclusion {
    suite::run(
        args,
        vec![
            suite::blocking_trial("reply_decoders_never_panic", reply_decoders_never_panic),
            suite::blocking_trial(
                "targetlease_documents_never_panic",
                targetlease_documents_never_panic,
            ),
            suite::blocking_trial(
                "arbitrary_lease_records_fail_closed",
                arbitrary_lease_records_fail_closed,
            ),
            suite::blocking_trial(
                "hostile_arguments_are_refused_cleanly",
                hostile_arguments_are_refused_cleanly,
            ),
        ],
    )
}
