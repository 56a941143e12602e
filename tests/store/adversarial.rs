//! The lease store under attack: request ids reused by another caller, tokens at and past 2^53,
//! floors and fences that a re-entrant acquire must respect, tokens that were never issued,
//! replays that arrive after their cached reply expired, lease records without a TTL, lost
//! fences, servers that evict keys, workloads with the controller's credentials and two
//! installations on one prefix; stale servers (a promoted replica that missed grants, an older
//! snapshot restored), retries of grants that ended, scripts stopped half-way by an ACL rule.
//! Each test was written to fail on the store as it was before and to pass now, run on every backend of the
//! contract suite that offers what the test needs (memory, Valkey 9.1, Valkey 8.1, Redis 7.0, etcd 3.7).
//! Prints a closing `adversarial: N passed, N failed` line.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};
use targetlease_test_support::cases;

use std::path::Path;
use std::time::Duration;

use targetlease::redact::Secret;
use targetlease::store::valkey::scripts::SCRIPTS;
use targetlease::store::valkey::{PasswordSource, ValkeyStore};
use targetlease::store::{
    CheckOutcome, CommitOutcome, CommitRequest, ErrorKind, LeaseStore, MAX_FLOOR_LEAD_MICROS,
    MAX_TOKEN, MAX_TOKEN_LEAD_MICROS, ReleaseOutcome, RenewOutcome, RepairOutcome, RequestId, Slot,
    StoreError, Token,
};

use support::contract_cases::{
    Harness, TTL, a_retry_never_answers_for_an_ended_grant, acquire_req, acquired, commit_req,
    etcd_variants, guarded, handle, permit_req, plain_variants, release_req, renew_req,
    scripts_refused_half_way_leave_nothing_unreadable, slot, target, token_of,
    tokens_grow_past_a_promoted_replica, tokens_grow_past_a_restored_snapshot, trials_of,
    valkey_config,
};
use support::server::{Server, ServerKind};
use support::suite;

/// Asserts that `result` is an invalid-request refusal whose message contains `words`.
fn refused<T: std::fmt::Debug>(result: Result<T, StoreError>, words: &str) -> StoreError {
    match result {
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
            assert!(e.to_string().contains(words), "expected {words:?} in: {e}");
            e
        }
        Ok(outcome) => panic!("expected a refusal ({words}), got {outcome:?}"),
    }
}

// 1. A request id reused by another caller is refused, never answered with the first reply.
async fn reused_request_id_is_refused(h: Harness) {
    let t = target("reuse");
    let job = RequestId::new("job-1").expect("request id");
    let mut a = acquire_req(&t, "lease-a", "alice", TTL);
    a.request_id = job.clone();
    let granted = acquired(&*h.store, &a).await;
    let mut b = acquire_req(&t, "lease-b", "bob", TTL);
    b.request_id = job.clone();
    refused(h.store.acquire(&b).await, "request id already used");
    let seen = h.store.inspect(&t).await.expect("inspect");
    assert_eq!(seen.lease.map(|l| l.owner), Some("alice".to_owned()));
    // Alice's own retry still gets her grant.
    assert_eq!(acquired(&*h.store, &a).await, granted);
    // Her id with a higher floor is another call: refused, never answered with a token below
    // the floor it asks for.
    let mut higher = a.clone();
    higher.min_token = granted.token;
    refused(h.store.acquire(&higher).await, "request id already used");

    // release: Bob's release with the id Alice's release used does not answer `released`.
    let mut release = release_req(handle(&t, "lease-a", "alice", granted.token));
    release.request_id = RequestId::new("job-1-release").expect("id");
    assert_eq!(
        h.store.release(&release).await.expect("release"),
        ReleaseOutcome::Released
    );
    let bob = acquired(&*h.store, &acquire_req(&t, "lease-b", "bob", TTL)).await;
    let mut theirs = release_req(handle(&t, "lease-b", "bob", bob.token));
    theirs.request_id = release.request_id.clone();
    refused(h.store.release(&theirs).await, "request id already used");
    let seen = h.store.inspect(&t).await.expect("inspect");
    assert_eq!(seen.lease.map(|l| l.token), Some(bob.token), "Bob's lease");

    // renew: the same id with another token.
    let mut renew = renew_req(handle(&t, "lease-b", "bob", bob.token), TTL);
    renew.request_id = RequestId::new("job-1-renew").expect("id");
    assert!(matches!(
        h.store.renew(&renew).await.expect("renew"),
        RenewOutcome::Renewed { .. }
    ));
    let mut other = renew_req(handle(&t, "lease-a", "alice", granted.token), TTL);
    other.request_id = renew.request_id.clone();
    refused(h.store.renew(&other).await, "request id already used");

    // commit: the id of a commit to `x` replayed for a commit to `y` writes nothing and says so.
    let mut to_x = commit_req(&t, bob.token, "for x");
    to_x.key = guarded("x");
    to_x.request_id = RequestId::new("job-1-commit").expect("id");
    assert!(matches!(
        h.store.commit(&to_x).await.expect("commit"),
        CommitOutcome::Committed { .. }
    ));
    let mut to_y = commit_req(&t, bob.token, "for y");
    to_y.key = guarded("y");
    to_y.request_id = to_x.request_id.clone();
    refused(h.store.commit(&to_y).await, "request id already used");
    assert_eq!(
        h.store
            .read_guarded(&t, Slot::ZERO, &guarded("y"))
            .await
            .expect("read"),
        None
    );
    // Another operation with the same id is refused too.
    let mut as_acquire = acquire_req(&t, "lease-c", "carol", TTL);
    as_acquire.request_id = renew.request_id.clone();
    refused(
        h.store.acquire(&as_acquire).await,
        "request id already used",
    );
}

// 2. Tokens are bounded to 2^53-1: a floor at or past it is refused, the token issued is always
//    above the floor, and nothing unparseable is ever stored.
async fn tokens_at_and_past_2_53(h: Harness) {
    let t = target("huge");
    for floor in [MAX_TOKEN, MAX_TOKEN + 2, u64::MAX] {
        let mut req = acquire_req(&t, "lease-a", "alice", TTL);
        req.min_token = floor;
        let e = h
            .store
            .acquire(&req)
            .await
            .expect_err("a floor at 2^53-1 or past it");
        assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{floor}: {e}");
        assert!(e.to_string().contains("2^53-1"), "{e}");
    }
    assert_eq!(
        h.store.inspect(&t).await.expect("inspect").fence,
        0,
        "wrote"
    );
    // Just below the bound: no store issues such a token for centuries, so it is refused as a
    // floor too (it did not come from a store) rather than allowed to exhaust the target.
    let mut req = acquire_req(&t, "lease-a", "alice", TTL);
    req.min_token = MAX_TOKEN - 1;
    refused(h.store.acquire(&req).await, "ahead of the server clock");
    assert_eq!(h.store.inspect(&t).await.expect("inspect").fence, 0);
    // A token past the bound (or 0) cannot even be given to a store: the protocol's Token is
    // built at the edge (a flag, a status) and refuses it; the scripts refuse it too, for a
    // caller that goes around the client (`script_arguments_are_checked_again`).
    refused(Token::new(MAX_TOKEN + 1), "2^53-1");
    refused(Token::new(u64::MAX), "2^53-1");
    refused(Token::new(0), "out of range");
    assert_eq!(Token::new(MAX_TOKEN).map(Token::get).ok(), Some(MAX_TOKEN));
    refused(h.store.repair(&t, u64::MAX).await, "2^53-1");
}

// 2a. A fence at 2^53-2 (left by an older version, or a tool): the last token there is is
//     issued once, strictly above it, and then the target refuses to issue rather than repeat.
async fn last_token_is_issued_once(h: Harness) {
    let t = target("last-token");
    h.admin()
        .cmd(&["SET", &h.keys(&t).fence(), &(MAX_TOKEN - 1).to_string()])
        .await;
    let last = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert_eq!(last.token, MAX_TOKEN);
    h.store
        .release(&release_req(handle(&t, "lease-a", "alice", last.token)))
        .await
        .expect("release");
    refused(
        h.store
            .acquire(&acquire_req(&t, "lease-b", "bob", TTL))
            .await,
        "no token can be issued",
    );
}

// 2c. A floor more than two hours ahead of the store's clock (a hostile TargetLease status, a
//     typo) did not come from a store: it is refused, so it cannot exhaust a target. One up to
//     an hour beyond the lead is a token from a server whose clock was ahead of this one (a
//     failover to a server whose clock is behind): taken, and the token issued is above it.
async fn floor_far_ahead_of_the_clock_is_refused(h: Harness) {
    let t = target("far-ahead");
    let mut req = acquire_req(&t, "lease-a", "alice", TTL);
    req.min_token = h.clock_micros() + MAX_FLOOR_LEAD_MICROS + 600_000_000;
    refused(h.store.acquire(&req).await, "ahead of the server clock");
    assert_eq!(h.store.inspect(&t).await.expect("inspect").fence, 0);
    // Just inside the bound it is a floor like any other.
    req.min_token = h.clock_micros() + MAX_FLOOR_LEAD_MICROS - 600_000_000;
    assert!(acquired(&*h.store, &req).await.token > req.min_token);
    // A token issued by a server whose clock runs 30 minutes ahead of this one's.
    let behind = target("clock-behind");
    let mut req = acquire_req(&behind, "lease-a", "alice", TTL);
    req.min_token = h.clock_micros() + MAX_TOKEN_LEAD_MICROS + 1_800_000_000;
    assert!(acquired(&*h.store, &req).await.token > req.min_token);
}

// 2d. A caller that goes around the client (its own EVAL of the scripts, with the controller's
//     credentials) meets the same bounds: tokens of 0 or past 2^53-1, numbers that are not
//     canonical digits, zero TTLs, empty owners are refused by the scripts themselves, with
//     TLINVALID, and change nothing.
async fn script_arguments_are_checked_again(h: Harness) {
    let t = target("raw-args");
    let k = h.keys(&t);
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let before = h.store.inspect(&t).await.expect("inspect");
    let reply = k.reply(&RequestId::new("raw-1").expect("id"));
    let commit_reply = k.commit_reply(&RequestId::new("raw-2").expect("id"));
    let guarded = k.guarded("data");
    let (lease, fence) = (k.lease(), k.fence());
    let eval = |script: &'static str, keys: Vec<String>, args: Vec<String>| {
        let admin = h.admin().clone();
        async move {
            let mut argv: Vec<String> = vec!["EVAL".into(), script.into(), keys.len().to_string()];
            argv.extend(keys);
            argv.extend(args);
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            admin.try_cmd(&argv).await
        }
    };
    let token = g.token.to_string();
    let s = |v: &str| v.to_owned();
    for bad in [
        "0",
        "9007199254740992",
        "18446744073709551615",
        "-1",
        "1e3",
        "01",
        " 1",
        "x",
        "",
    ] {
        let calls = [
            (
                "renew",
                eval(
                    SCRIPTS.renew.source,
                    vec![lease.clone(), fence.clone(), reply.clone()],
                    vec![s("lease-a"), s("alice"), s(bad), s("30000"), s("60000")],
                ),
            ),
            (
                "release",
                eval(
                    SCRIPTS.release.source,
                    vec![lease.clone(), reply.clone()],
                    vec![s("lease-a"), s("alice"), s(bad), s("60000")],
                ),
            ),
            (
                "check",
                eval(SCRIPTS.check.source, vec![fence.clone()], vec![s(bad)]),
            ),
            (
                "commit",
                eval(
                    SCRIPTS.commit.source,
                    vec![fence.clone(), guarded.clone(), commit_reply.clone()],
                    vec![s(bad), s("v"), s("60000"), s("1"), s("data")],
                ),
            ),
        ];
        for (op, call) in calls {
            match call.await {
                Err(e) => assert!(e.to_string().contains("TLINVALID"), "{op} {bad:?}: {e}"),
                Ok(v) => panic!("{op} with token {bad:?} answered {v:?}"),
            }
        }
    }
    for (what, owner, ttl) in [
        ("empty owner", "", "30000"),
        ("zero ttl", "bob", "0"),
        // Longer than a lease may last (the client's `Ttl` refuses it too).
        ("ttl over 24 h", "bob", "86400001"),
    ] {
        let refused = eval(
            SCRIPTS.acquire.source,
            vec![lease.clone(), fence.clone(), reply.clone(), k.grant()],
            vec![
                s("lease-b"),
                s(owner),
                s(ttl),
                s("0"),
                s("60000"),
                s("raw-3"),
            ],
        )
        .await;
        assert!(
            matches!(&refused, Err(e) if e.to_string().contains("TLINVALID")),
            "{what}: {refused:?}"
        );
    }
    let renewed = eval(
        SCRIPTS.renew.source,
        vec![lease.clone(), fence.clone(), reply.clone()],
        vec![s("lease-a"), s("alice"), token, s("0"), s("60000")],
    )
    .await;
    assert!(
        matches!(&renewed, Err(e) if e.to_string().contains("TLINVALID")),
        "zero ttl: {renewed:?}"
    );
    let after = h.store.inspect(&t).await.expect("inspect");
    assert_eq!(after.fence, before.fence);
    assert_eq!(
        after.lease.map(|l| (l.owner, l.token)),
        Some(("alice".to_owned(), g.token))
    );
    assert_eq!(
        h.store
            .read_guarded(&t, Slot::ZERO, &support::contract_cases::guarded("data"))
            .await
            .expect("read"),
        None
    );
}

// 2b. A stored fence that cannot be a token (written by an older version or a tool) fails
//     closed, and `repair` makes the target usable again with a token above the bad state.
async fn unparseable_fence_fails_closed_and_repairs(h: Harness) {
    let t = target("poisoned");
    let keys = h.keys(&t);
    h.admin()
        .cmd(&["SET", &keys.fence(), "18446744073709551615"])
        .await;
    let e = h
        .store
        .acquire(&acquire_req(&t, "lease-a", "alice", TTL))
        .await
        .expect_err("an unparseable fence");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("repair"), "{e}");
    // A floor further ahead than any store issues is refused here too.
    let hostile = h.clock_micros() + MAX_FLOOR_LEAD_MICROS + 600_000_000;
    refused(
        h.store.repair(&t, hostile).await,
        "ahead of the server clock",
    );
    // The reset fence is above the floor and where a target without a fence starts.
    let floor = h.clock_micros() + 60_000_000;
    match h.store.repair(&t, floor).await.expect("repair") {
        RepairOutcome::Repaired { fence, .. } => {
            assert!(fence >= h.clock_micros() + MAX_TOKEN_LEAD_MICROS - 60_000_000);
            assert!(fence >= floor);
        }
        other => panic!("expected a repair, got {other:?}"),
    }
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert!(g.token > floor);
    assert!(matches!(
        h.store.repair(&t, 0).await.expect("repair"),
        RepairOutcome::Intact { .. }
    ));
    // An unreadable lease record is deleted; the readable fence stays.
    h.admin().cmd(&["SET", &keys.lease(), "junk"]).await;
    match h.store.repair(&t, 0).await.expect("repair") {
        RepairOutcome::Repaired { fence, what } => {
            assert_eq!(fence, g.token);
            assert!(what.contains("lease"), "{what}");
        }
        other => panic!("expected a repair, got {other:?}"),
    }
    let next = acquired(&*h.store, &acquire_req(&t, "lease-b", "bob", TTL)).await;
    assert!(next.token > g.token);
}

// 3. Re-entrant acquire respects the caller's floor and the fence: the token it answers is
//    above both, and the fence follows it.
async fn reentrant_acquire_respects_floor_and_fence(h: Harness) {
    let t = target("reentrant");
    let first = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let mut again = acquire_req(&t, "lease-a", "alice", TTL);
    // The floor is a token seen elsewhere (the same one: a status written before a restore).
    again.min_token = first.token;
    let second = acquired(&*h.store, &again).await;
    assert!(
        second.token > again.min_token,
        "a re-entrant acquire answered {} under the floor {}",
        second.token,
        again.min_token
    );
    let seen = h.store.inspect(&t).await.expect("inspect");
    assert_eq!(
        seen.fence, second.token,
        "the fence must follow the new token"
    );
    assert_eq!(seen.lease.map(|l| l.token), Some(second.token));
    // The old token is stale now; the new one is current.
    assert_eq!(
        h.store
            .check(&t, Slot::ZERO, token_of(first.token))
            .await
            .expect("check"),
        CheckOutcome::Stale {
            newest: second.token
        }
    );
    // Without a floor the token stays (a plain retry is not a new tenure).
    let third = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert_eq!(third.token, second.token);
}

// 3b. A restore that brings back an older lease record under a newer fence: the holder's token
//     is below the fence, so renew says it is not the holder and a re-entrant acquire issues a
//     larger token instead of publishing the older one.
async fn restored_older_record_gets_a_larger_token(h: Harness) {
    let t = target("restored");
    let keys = h.keys(&t);
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let newer = g.token + 1_000;
    h.admin()
        .cmd(&["SET", &keys.fence(), &newer.to_string()])
        .await;
    assert_eq!(
        h.store
            .renew(&renew_req(handle(&t, "lease-a", "alice", g.token), TTL))
            .await
            .expect("renew"),
        RenewOutcome::Lost {
            reason: targetlease::store::LossReason::NotHolder
        }
    );
    let again = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert!(again.token > newer, "{} <= {newer}", again.token);
}

// 4. commit and check refuse a token that was never issued: a typo or another target's token
//    cannot lock the record for the legitimate holder.
async fn tokens_never_issued_are_refused(h: Harness) {
    let t = target("never-issued");
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    let typo = g.token + 12_345;
    refused(
        h.store.check(&t, Slot::ZERO, token_of(typo)).await,
        "never issued",
    );
    refused(
        h.store.commit(&commit_req(&t, typo, "typo")).await,
        "never issued",
    );
    assert_eq!(
        h.store
            .read_guarded(&t, Slot::ZERO, &guarded("data"))
            .await
            .expect("read"),
        None
    );
    // The holder is not locked out.
    assert_eq!(
        h.store
            .commit(&commit_req(&t, g.token, "mine"))
            .await
            .expect("commit"),
        CommitOutcome::Committed { token: g.token }
    );
    assert_eq!(
        h.store
            .check(&t, Slot::ZERO, token_of(g.token))
            .await
            .expect("check"),
        CheckOutcome::Current { newest: g.token }
    );
    // A target that never had a token accepts none.
    refused(
        h.store
            .check(&target("nothing-here"), Slot::ZERO, token_of(7))
            .await,
        "never issued",
    );
}

// 5a. A late replay of an earlier commit (after its cached reply expired) cannot roll the
//     record back: (token, sequence) must grow.
async fn late_commit_replay_cannot_roll_back(h: Harness) {
    let (store, expiry) = h.short_replies().await;
    let t = target("rollback");
    let g = acquired(
        &*store,
        &acquire_req(&t, "lease-a", "alice", Duration::from_secs(600)),
    )
    .await;
    let v1 = commit_req(&t, g.token, "v1");
    let v2 = commit_req(&t, g.token, "v2");
    let first = store.commit(&v1).await.expect("commit v1");
    assert_eq!(first, CommitOutcome::Committed { token: g.token });
    store.commit(&v2).await.expect("commit v2");
    h.pass(expiry).await;
    assert_eq!(
        store.commit(&v1).await.expect("late replay"),
        CommitOutcome::Stale { newest: g.token },
        "a late replay of v1 must be refused"
    );
    let stored = store
        .read_guarded(&t, Slot::ZERO, &guarded("data"))
        .await
        .expect("read");
    assert_eq!(stored.map(|v| v.value), Some("v2".to_owned()));
    // The same write again (same token, sequence and value) is harmless: answered, not redone.
    assert_eq!(
        store.commit(&v2).await.expect("retry of v2"),
        CommitOutcome::Committed { token: g.token }
    );
    // The same sequence with another value is refused.
    let mut other = v2.clone();
    other.value = "v2'".into();
    other.request_id = RequestId::random();
    assert!(matches!(
        store.commit(&other).await.expect("conflict"),
        CommitOutcome::Stale { .. }
    ));
}

// 5b. An acquire replayed after a release and after its cached reply expired does not take a
//     second tenure.
async fn late_acquire_replay_takes_no_second_tenure(h: Harness) {
    let (store, expiry) = h.short_replies().await;
    let t = target("replayed-acquire");
    let req = acquire_req(&t, "lease-a", "alice", Duration::from_secs(600));
    let g = acquired(&*store, &req).await;
    assert_eq!(
        store
            .release(&release_req(handle(&t, "lease-a", "alice", g.token)))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    h.pass(expiry).await;
    refused(
        store.acquire(&req).await,
        "replay never takes a second tenure",
    );
    let seen = store.inspect(&t).await.expect("inspect");
    assert!(seen.lease.is_none(), "the replay took a second tenure");
    assert_eq!(seen.fence, g.token, "the replay issued another token");
}

// 5c. A reply TTL that does not cover the caller's retries is refused by the configuration.
async fn reply_ttl_shorter_than_retries_is_refused(h: Harness) {
    let mut config = h.env().config.clone();
    config.call_timeout = Duration::from_secs(2);
    config.reply_ttl = Duration::from_secs(5);
    let e = ValkeyStore::new_lazy(config).expect_err("a reply TTL under 4 call timeouts");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains("reply TTL"), "{e}");
}

// 6. A lease record without a TTL fails closed instead of being held forever at "0 ms left".
async fn lease_without_ttl_fails_closed(h: Harness) {
    let t = target("persisted");
    let keys = h.keys(&t);
    acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    h.admin().cmd(&["PERSIST", &keys.lease()]).await;
    let e = h
        .store
        .acquire(&acquire_req(&t, "lease-b", "bob", TTL))
        .await
        .expect_err("a lease record without expiry");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("no expiry"), "{e}");
    let e = h.store.inspect(&t).await.expect_err("inspect too");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
}

// 7. A fence lost while the lease survived is raised again by the holder's re-entrant acquire
//    and by its renew, so the next tenure's token is still above the holder's.
async fn lost_fence_is_raised_again(h: Harness) {
    let t = target("lost-fence");
    let keys = h.keys(&t);
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    h.admin().cmd(&["DEL", &keys.fence()]).await;
    let again = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert_eq!(again.token, g.token);
    assert_eq!(h.store.inspect(&t).await.expect("inspect").fence, g.token);
    h.admin().cmd(&["DEL", &keys.fence()]).await;
    h.store
        .renew(&renew_req(handle(&t, "lease-a", "alice", g.token), TTL))
        .await
        .expect("renew");
    assert_eq!(
        h.store.inspect(&t).await.expect("inspect").fence,
        g.token,
        "renew must raise a lost fence"
    );
    // A fence lowered below the holder's token is raised the same way.
    h.admin().cmd(&["SET", &keys.fence(), "5"]).await;
    acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert_eq!(h.store.inspect(&t).await.expect("inspect").fence, g.token);
    // And by a retry answered from the reply cache.
    let other = target("lost-fence-replay");
    let req = acquire_req(&other, "lease-b", "bob", TTL);
    let first = acquired(&*h.store, &req).await;
    h.admin().cmd(&["DEL", &h.keys(&other).fence()]).await;
    assert_eq!(acquired(&*h.store, &req).await, first);
    assert_eq!(
        h.store.inspect(&other).await.expect("inspect").fence,
        first.token,
        "a replayed grant must raise a lost fence"
    );
}

// 8. A server that may evict keys is refused at connect, with the reason; allowed explicitly,
//    it is accepted.
async fn evicting_server_is_refused(h: Harness) {
    let admin = h.admin();
    admin
        .cmd(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"])
        .await;
    let e = ValkeyStore::connect(h.env().config.clone())
        .await
        .expect_err("a server that may evict keys");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains("allkeys-lru"), "{e}");
    let mut allowed = h.env().config.clone();
    allowed.allow_eviction = true;
    let store = ValkeyStore::connect(allowed)
        .await
        .expect("eviction allowed");
    acquired(&store, &acquire_req(&target("evictable"), "l", "o", TTL)).await;
    admin
        .cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .await;
    ValkeyStore::connect(h.env().config.clone())
        .await
        .expect("noeviction is accepted");
}

/// The workload ACL rule from docs/operations.md for `password`.
fn documented_workload_rule(password: &str) -> Vec<String> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"))
            .expect("docs/operations.md");
    let line = doc
        .lines()
        .skip_while(|l| !l.contains("<!-- acl-workload-rule:begin -->"))
        .find(|l| l.starts_with("ACL SETUSER"))
        .expect("the documented workload rule");
    line.split_whitespace()
        .map(|w| match w {
            ">CHANGE-ME" => format!(">{password}"),
            other => other.to_owned(),
        })
        .collect()
}

// 9a. Workloads get a user that can commit, check and read, and nothing else: no lease, no
//     fence write, not even from a script of their own.
async fn workload_user_cannot_touch_leases(h: Harness) {
    let kind = h.env().kind;
    let password = "workload-pw-1c9e";
    let server = Server::start(kind);
    let mut rule = documented_workload_rule(password);
    if kind == ServerKind::Redis70 {
        // Redis 7.0 does not know CLIENT SETINFO (docs/operations.md says to drop it).
        rule.retain(|w| w != "+client|setinfo");
    }
    let args: Vec<&str> = rule.iter().map(String::as_str).collect();
    let reply = server.raw(&args);
    assert!(reply.starts_with("+OK"), "{args:?}: {reply}");
    let controller = ValkeyStore::connect(valkey_config(&server.url()))
        .await
        .expect("controller");
    let mut config = valkey_config(&server.url());
    config.username = Some("targetlease-workload".into());
    config.password = Some(PasswordSource::Value(Secret::new(password)));
    let workload = ValkeyStore::connect(config)
        .await
        .expect("workload connects");

    let t = target("workload");
    let g = acquired(&controller, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert_eq!(
        workload
            .commit(&commit_req(&t, g.token, "by the workload"))
            .await
            .expect("commit"),
        CommitOutcome::Committed { token: g.token }
    );
    assert!(matches!(
        workload
            .check(&t, Slot::ZERO, token_of(g.token))
            .await
            .expect("check"),
        CheckOutcome::Current { .. }
    ));
    assert!(
        workload
            .read_guarded(&t, Slot::ZERO, &guarded("data"))
            .await
            .expect("read")
            .is_some()
    );
    // A permit's slot has its own fence and guarded records: the rule reaches them too.
    let permits_target = target("workload-permits");
    let p = acquired(
        &controller,
        &permit_req(&permits_target, "lease-p", "pat", 3, TTL),
    )
    .await;
    let p2 = acquired(
        &controller,
        &permit_req(&permits_target, "lease-q", "quin", 3, TTL),
    )
    .await;
    assert_eq!(p2.slot, slot(1));
    let commit = CommitRequest {
        slot: p2.slot,
        ..commit_req(&permits_target, p2.token, "slot one")
    };
    assert_eq!(
        workload.commit(&commit).await.expect("commit to slot 1"),
        CommitOutcome::Committed { token: p2.token }
    );
    assert!(matches!(
        workload
            .check(&permits_target, p2.slot, token_of(p2.token))
            .await
            .expect("check slot 1"),
        CheckOutcome::Current { .. }
    ));
    assert!(matches!(
        workload
            .check(&permits_target, p.slot, token_of(p.token))
            .await
            .expect("check slot 0"),
        CheckOutcome::Current { .. }
    ));
    let denied = |r: Result<(), StoreError>, what: &str| match r {
        Err(e) => assert_eq!(e.kind(), ErrorKind::AccessDenied, "{what}: {e}"),
        Ok(()) => panic!("{what}: the workload user was allowed"),
    };
    let lease = handle(&t, "lease-a", "alice", g.token);
    denied(
        workload
            .acquire(&acquire_req(&t, "lease-m", "mallory", TTL))
            .await
            .map(drop),
        "acquire",
    );
    denied(
        workload
            .renew(&renew_req(lease.clone(), TTL))
            .await
            .map(drop),
        "renew",
    );
    denied(
        workload.release(&release_req(lease)).await.map(drop),
        "release",
    );
    denied(workload.inspect(&t).await.map(drop), "inspect");
    // A script of the workload's own that writes the fence or the lease is refused too.
    let keys = h.keys(&t);
    for key in [keys.fence(), keys.lease(), keys.grant()] {
        let auth = ["AUTH", "targetlease-workload", password];
        let write = [
            "EVAL",
            "return redis.call('SET', KEYS[1], '1')",
            "1",
            key.as_str(),
        ];
        let reply = server.raw_as(&auth, &write);
        // Valkey says NOPERM; Redis 7.0 says the user "can't access" the key.
        assert!(
            reply.starts_with('-')
                && ["NOPERM", "permission", "can't access"]
                    .iter()
                    .any(|w| reply.contains(w)),
            "{key}: {reply}"
        );
    }
    assert_eq!(
        controller.inspect(&t).await.expect("inspect").fence,
        g.token,
        "the fence changed"
    );
}

// 9b. Two installations on one prefix: the second is refused, naming the first; the same
//     installation reconnects; another prefix is fine.
async fn two_installations_never_share_a_prefix(h: Harness) {
    let mut first = h.env().config.clone();
    first.installation = Some("prod/targetlease".into());
    let a = ValkeyStore::connect(first.clone()).await.expect("first");
    a.health().await.expect("health");
    let mut second = first.clone();
    second.installation = Some("staging/targetlease".into());
    let e = ValkeyStore::connect(second.clone())
        .await
        .expect_err("a second installation on the prefix");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains("prod/targetlease"), "{e}");
    ValkeyStore::connect(first)
        .await
        .expect("same installation");
    second.key_prefix = "staging-tl".into();
    ValkeyStore::connect(second).await.expect("its own prefix");
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let cases = cases![
        Store reused_request_id_is_refused,
        Store tokens_at_and_past_2_53,
        Admin last_token_is_issued_once,
        Store floor_far_ahead_of_the_clock_is_refused,
        Admin script_arguments_are_checked_again,
        Admin unparseable_fence_fails_closed_and_repairs,
        Store reentrant_acquire_respects_floor_and_fence,
        Admin restored_older_record_gets_a_larger_token,
        Store tokens_never_issued_are_refused,
        Store late_commit_replay_cannot_roll_back,
        Store late_acquire_replay_takes_no_second_tenure,
        Admin reply_ttl_shorter_than_retries_is_refused,
        Admin lease_without_ttl_fails_closed,
        Admin lost_fence_is_raised_again,
        Admin evicting_server_is_refused,
        Admin workload_user_cannot_touch_leases,
        Admin two_installations_never_share_a_prefix,
        Store tokens_grow_past_a_promoted_replica,
        Store tokens_grow_past_a_restored_snapshot,
        Store a_retry_never_answers_for_an_ended_grant,
        Admin scripts_refused_half_way_leave_nothing_unreadable,
    ];
    support::etcd::prepare();
    let mut variants = plain_variants().to_vec();
    variants.extend(etcd_variants());
    suite::run(args, trials_of(&variants, &cases))
}
