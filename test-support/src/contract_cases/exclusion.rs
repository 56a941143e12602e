//! One holder at a time, tokens that grow, stale owners refused (contract items 1 to 5).

use super::*;

// 1. A free target is acquired; a second claim sees who holds it.
pub(super) async fn acquire_free_then_held(h: Harness) {
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
pub(super) async fn hundred_concurrent_acquires_one_winner(h: Harness) {
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
            (i, other) => panic!("worker-{i}: a fresh request id was answered {other:?}"),
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
pub(super) async fn expiry_then_reacquire_gives_larger_token(h: Harness) {
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
pub(super) async fn release_then_reacquire_gives_larger_token(h: Harness) {
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
pub(super) async fn old_owner_refused_after_reacquire(h: Harness) {
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
        h.store
            .check(&t, Slot::ZERO, token_of(old.token))
            .await
            .unwrap(),
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
        .read_guarded(&t, Slot::ZERO, &guarded("data"))
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
pub(super) async fn renew_with_wrong_identity_is_refused(h: Harness) {
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
