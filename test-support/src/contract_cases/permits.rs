//! Permits: up to N holders of one target, each in its own slot with its own fencing token. Each
//! body tries to get more than N grants at once, two slots for one claim or one retry, a token
//! issued twice across slots or across a data loss, a grant under a permits value that another
//! holder does not share, or a check that passes a token against the wrong slot.

use std::collections::BTreeSet;

use super::*;

/// `n` permits.
pub fn permits(n: u32) -> Permits {
    Permits::new(n).expect("permits")
}

/// A slot the test knows to be valid.
pub fn slot(n: u32) -> Slot {
    Slot::new(n).expect("slot")
}

/// An acquire of one of `n` permits with a fresh request id and no token floor.
pub fn permit_req(
    t: &TargetRef,
    lease: &str,
    owner: &str,
    n: u32,
    ttl: Duration,
) -> AcquireRequest {
    AcquireRequest {
        permits: permits(n),
        ..acquire_req(t, lease, owner, ttl)
    }
}

/// The handle of a permit granted under `n` permits in `grant`'s slot.
pub fn permit_handle(
    t: &TargetRef,
    lease: &str,
    owner: &str,
    n: u32,
    grant: &Grant,
) -> LeaseHandle {
    LeaseHandle {
        permits: permits(n),
        slot: grant.slot,
        ..handle(t, lease, owner, grant.token)
    }
}

/// How many leases the store shows held on `t`, and in which slots.
async fn held_slots(store: &dyn LeaseStore, t: &TargetRef) -> Vec<u32> {
    let seen = store.inspect(t).await.expect("inspect");
    seen.holders().map(|l| l.slot.get()).collect()
}

// P1. 200 claims race for 5 permits: exactly 5 grants, in 5 distinct slots, with 5 distinct
//     tokens, each above every token the target had before; the rest are told it is held.
pub(super) async fn two_hundred_racing_for_five_permits_get_five(h: Harness) {
    let t = target("five-permits");
    // A first tenure, released, so every grant below must be above its token.
    let first = acquired(&*h.store, &permit_req(&t, "first", "zed", 5, TTL)).await;
    let released = h
        .store
        .release(&release_req(permit_handle(&t, "first", "zed", 5, &first)))
        .await
        .expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    // 50 connections, four calls each, all released at once.
    let mut stores = Vec::new();
    for _ in 0..50 {
        stores.push(h.another_connection().await);
    }
    let start = Arc::new(tokio::sync::Barrier::new(200));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..200 {
        let (store, start) = (stores[i % stores.len()].clone(), start.clone());
        let req = permit_req(&t, &format!("lease-{i}"), &format!("w{i}"), 5, TTL);
        tasks.spawn(async move {
            start.wait().await;
            store.acquire(&req).await.expect("acquire")
        });
    }
    let mut grants = Vec::new();
    let mut refused = 0;
    while let Some(done) = tasks.join_next().await {
        match done.expect("task") {
            AcquireOutcome::Acquired(g) => grants.push(g),
            AcquireOutcome::Held { .. } => refused += 1,
            other => panic!("a fresh request id was answered {other:?}"),
        }
    }
    assert_eq!(refused, 195);
    assert_eq!(grants.len(), 5, "{grants:?}");
    let slots: BTreeSet<u32> = grants.iter().map(|g| g.slot.get()).collect();
    assert_eq!(slots, (0..5).collect(), "{grants:?}");
    let tokens: BTreeSet<u64> = grants.iter().map(|g| g.token).collect();
    assert_eq!(tokens.len(), 5, "a token was issued twice: {grants:?}");
    assert!(tokens.iter().all(|t| *t > first.token), "{grants:?}");
    // Tokens grow in the order the grants happened: the later the grant, the larger the token,
    // whatever its slot (a grant's slot is the lowest free one, so slot order is grant order).
    let mut by_slot = grants.clone();
    by_slot.sort_by_key(|g| g.slot);
    assert!(
        by_slot.windows(2).all(|w| w[0].token < w[1].token),
        "{by_slot:?}"
    );
    let seen = h.store.inspect(&t).await.expect("inspect");
    assert_eq!(seen.permits, 5);
    assert_eq!(seen.holders().count(), 5);
    assert_eq!(seen.fence, *tokens.last().expect("tokens"));
}

// P2. A retry with the request id of a grant answers that grant (same slot, same token) and
//     never takes a second slot; a second acquire of the same claim gets its own slot back;
//     after the permit ends, the retry takes nothing.
pub(super) async fn permit_retries_never_take_two_slots(h: Harness) {
    let t = target("permit-retry");
    let other = acquired(&*h.store, &permit_req(&t, "other", "bob", 3, TTL)).await;
    let req = permit_req(&t, "lease-a", "alice", 3, TTL);
    let g = acquired(&*h.store, &req).await;
    assert_eq!(g.slot, slot(1));
    for _ in 0..3 {
        let again = acquired(&*h.store, &req).await;
        assert_eq!((again.slot, again.token), (g.slot, g.token));
    }
    // The same claim with a new request id: re-entrant, same slot and token.
    let same_claim = acquired(&*h.store, &permit_req(&t, "lease-a", "alice", 3, TTL)).await;
    assert_eq!((same_claim.slot, same_claim.token), (g.slot, g.token));
    assert_eq!(held_slots(&*h.store, &t).await, vec![0, 1]);
    // The retry's binding includes the permits: the same request id with another value is
    // another call, refused.
    let other_value = AcquireRequest {
        permits: permits(4),
        ..req.clone()
    };
    let e = h.store.acquire(&other_value).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    // Released: the retry learns its grant ended and takes no slot.
    let released = h
        .store
        .release(&release_req(permit_handle(&t, "lease-a", "alice", 3, &g)))
        .await
        .expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    assert_eq!(
        h.store.acquire(&req).await.expect("retry"),
        AcquireOutcome::Expired { token: g.token }
    );
    assert_eq!(held_slots(&*h.store, &t).await, vec![0]);
    // The other permit is untouched by all of it.
    let renewed = h
        .store
        .renew(&renew_req(
            permit_handle(&t, "other", "bob", 3, &other),
            TTL,
        ))
        .await
        .expect("renew");
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
}

// P3. An expired permit's slot is free again: the lowest free slot is taken, with a token above
//     every token issued on the target, and the expired holder's renew is refused.
pub(super) async fn expired_permits_are_reclaimed(h: Harness) {
    let t = target("permit-expiry");
    // Long enough for the three grants below on a loaded machine (a TLS connect each): with
    // 300 ms the short one expired before the third grant once.
    let short_ttl = Duration::from_secs(2);
    let short = acquired(&*h.store, &permit_req(&t, "short", "sam", 3, short_ttl)).await;
    let long_a = acquired(&*h.store, &permit_req(&t, "long-a", "ann", 3, TTL)).await;
    let long_b = acquired(&*h.store, &permit_req(&t, "long-b", "ben", 3, TTL)).await;
    assert_eq!(
        [short.slot, long_a.slot, long_b.slot],
        [slot(0), slot(1), slot(2)]
    );
    let full = h
        .store
        .acquire(&permit_req(&t, "late", "lou", 3, TTL))
        .await
        .expect("acquire");
    match full {
        // The holder that expires first is named.
        AcquireOutcome::Held { owner, .. } => assert_eq!(owner, "sam"),
        other => panic!("a fourth permit of three: {other:?}"),
    }
    h.pass(short_ttl + Duration::from_millis(300)).await;
    let late = acquired(&*h.store, &permit_req(&t, "late", "lou", 3, TTL)).await;
    assert_eq!(late.slot, slot(0), "the expired slot is the one reclaimed");
    assert!(late.token > long_b.token, "{late:?} after {long_b:?}");
    let renewed = h
        .store
        .renew(&renew_req(
            permit_handle(&t, "short", "sam", 3, &short),
            TTL,
        ))
        .await
        .expect("renew");
    assert!(matches!(renewed, RenewOutcome::Lost { .. }), "{renewed:?}");
    assert_eq!(held_slots(&*h.store, &t).await, vec![0, 1, 2]);
}

// P4. A claim asking another permits value than the held permits were granted under is refused
//     and names the value in force, whichever way round (exclusive against permits, permits
//     against other permits); once the last holder is released, the other value is admitted at
//     once.
pub(super) async fn permits_conflict_is_refused(h: Harness) {
    let t = target("permit-conflict");
    let a = acquired(&*h.store, &permit_req(&t, "a", "ann", 3, TTL)).await;
    // In slot 0, so an exclusive claim sees it in the exclusive lease's own record...
    assert_eq!(a.slot, slot(0));
    let b = acquired(&*h.store, &permit_req(&t, "b", "ben", 3, TTL)).await;
    for asked in [1, 2, 4, 100] {
        let refused = h
            .store
            .acquire(&permit_req(&t, "c", "cat", asked, TTL))
            .await
            .expect("acquire");
        assert_eq!(
            refused,
            AcquireOutcome::PermitsConflict { in_force: 3 },
            "permits {asked}"
        );
    }
    // ...and when slot 0 is free, by the value in force.
    h.store
        .release(&release_req(permit_handle(&t, "a", "ann", 3, &a)))
        .await
        .expect("release");
    let refused = h
        .store
        .acquire(&acquire_req(&t, "c", "cat", TTL))
        .await
        .expect("acquire");
    assert_eq!(refused, AcquireOutcome::PermitsConflict { in_force: 3 });
    // The last holder released: an exclusive claim is admitted at once.
    h.store
        .release(&release_req(permit_handle(&t, "b", "ben", 3, &b)))
        .await
        .expect("release");
    let exclusive = acquired(&*h.store, &acquire_req(&t, "c", "cat", TTL)).await;
    assert!(exclusive.token > b.token);
    // Now the other way round: permits against the exclusive lease.
    let refused = h
        .store
        .acquire(&permit_req(&t, "d", "dan", 3, TTL))
        .await
        .expect("acquire");
    assert_eq!(refused, AcquireOutcome::PermitsConflict { in_force: 1 });
    // A holder's own renew under another value is refused, not answered as if it agreed.
    let wrong = LeaseHandle {
        permits: permits(2),
        ..handle(&t, "c", "cat", exclusive.token)
    };
    let e = h.store.renew(&renew_req(wrong, TTL)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
}

// P5. Tokens grow across slots and across a data loss: after FLUSHALL (or a restart without
//     persistence) the next grants of every slot are above every token issued before it.
pub(super) async fn permit_tokens_grow_across_data_loss(h: Harness) {
    let t = target("permit-loss");
    let mut before = Vec::new();
    for i in 0..4 {
        before.push(acquired(&*h.store, &permit_req(&t, &format!("p{i}"), "w", 4, TTL)).await);
    }
    let newest = before.iter().map(|g| g.token).max().expect("grants");
    h.wipe().await;
    h.pass(Duration::from_millis(5)).await;
    for i in 0..4 {
        let g = acquired(&*h.store, &permit_req(&t, &format!("q{i}"), "w", 4, TTL)).await;
        assert!(
            g.token > newest,
            "slot {} issued {} after a loss of {newest}",
            g.slot,
            g.token
        );
    }
}

// P6. Fencing is per slot: a token is current for its own slot while it is that slot's newest
//     grant, whatever other slots grant; it is stale for its slot after a newer grant there, and
//     was never issued for another slot. Guarded records are per slot.
pub(super) async fn fencing_is_per_slot(h: Harness) {
    let t = target("permit-fencing");
    let a = acquired(&*h.store, &permit_req(&t, "a", "ann", 2, SHORT_TTL)).await;
    let b = acquired(&*h.store, &permit_req(&t, "b", "ben", 2, TTL)).await;
    assert_eq!((a.slot, b.slot), (slot(0), slot(1)));
    let current = |o: CheckOutcome| matches!(o, CheckOutcome::Current { .. });
    // Slot 1's newer grant does not make slot 0's token stale.
    assert!(current(
        h.store
            .check(&t, a.slot, token_of(a.token))
            .await
            .expect("check")
    ));
    assert!(current(
        h.store
            .check(&t, b.slot, token_of(b.token))
            .await
            .expect("check")
    ));
    // A token checked against the wrong slot is refused either way: a's is below slot 1's
    // newest (stale), b's was never issued for slot 0.
    assert!(matches!(
        h.store
            .check(&t, b.slot, token_of(a.token))
            .await
            .expect("check"),
        CheckOutcome::Stale { .. }
    ));
    let e = h
        .store
        .check(&t, a.slot, token_of(b.token))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    // Each slot writes its own guarded record.
    for (g, value) in [(&a, "from slot 0"), (&b, "from slot 1")] {
        let commit = CommitRequest {
            slot: g.slot,
            ..commit_req(&t, g.token, value)
        };
        let done = h.store.commit(&commit).await.expect("commit");
        assert_eq!(done, CommitOutcome::Committed { token: g.token });
    }
    for (g, value) in [(&a, "from slot 0"), (&b, "from slot 1")] {
        let read = h
            .store
            .read_guarded(&t, g.slot, &data_key())
            .await
            .expect("read");
        assert_eq!(read.map(|v| v.value), Some(value.to_owned()));
    }
    // Slot 0 passes to a new holder: a's token is stale for it, b's is still current.
    h.pass(PAST_SHORT_TTL).await;
    let c = acquired(&*h.store, &permit_req(&t, "c", "cat", 2, TTL)).await;
    assert_eq!(c.slot, slot(0));
    assert!(matches!(
        h.store
            .check(&t, slot(0), token_of(a.token))
            .await
            .expect("check"),
        CheckOutcome::Stale { .. }
    ));
    let stale_commit = CommitRequest {
        slot: slot(0),
        ..commit_req(&t, a.token, "late write")
    };
    assert!(matches!(
        h.store.commit(&stale_commit).await.expect("commit"),
        CommitOutcome::Stale { .. }
    ));
    assert!(current(
        h.store
            .check(&t, b.slot, token_of(b.token))
            .await
            .expect("check")
    ));
}

// P7. Releases and renewals are per permit: a renew or release naming another slot than the
//     permit's is refused; releasing one permit leaves the others held and renewable.
pub(super) async fn renew_and_release_are_per_permit(h: Harness) {
    let t = target("permit-identity");
    let a = acquired(&*h.store, &permit_req(&t, "a", "ann", 3, TTL)).await;
    let b = acquired(&*h.store, &permit_req(&t, "b", "ben", 3, TTL)).await;
    let misplaced = LeaseHandle {
        slot: b.slot,
        ..permit_handle(&t, "a", "ann", 3, &a)
    };
    let renewed = h
        .store
        .renew(&renew_req(misplaced.clone(), TTL))
        .await
        .expect("renew");
    assert!(matches!(renewed, RenewOutcome::Lost { .. }), "{renewed:?}");
    assert_eq!(
        h.store
            .release(&release_req(misplaced))
            .await
            .expect("release"),
        ReleaseOutcome::NotHolder
    );
    // A slot beyond the permits is refused before anything is sent.
    let beyond = LeaseHandle {
        slot: slot(3),
        ..permit_handle(&t, "a", "ann", 3, &a)
    };
    let e = h.store.renew(&renew_req(beyond, TTL)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    assert_eq!(
        h.store
            .release(&release_req(permit_handle(&t, "a", "ann", 3, &a)))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    assert_eq!(held_slots(&*h.store, &t).await, vec![b.slot.get()]);
    let renewed = h
        .store
        .renew(&renew_req(permit_handle(&t, "b", "ben", 3, &b), TTL))
        .await
        .expect("renew");
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    // The freed slot is the next one granted.
    let c = acquired(&*h.store, &permit_req(&t, "c", "cat", 3, TTL)).await;
    assert_eq!(c.slot, a.slot);
}

// P8. Unreadable permit records fail closed, in any slot and in the permits value in force; no
//     call admits a holder past them, and `repair` makes the target usable again.
pub(super) async fn corrupt_permit_records_fail_closed(h: Harness) {
    let admin = h.admin();
    for case in [
        "slot-lease",
        "permits-value",
        "permits-without-expiry",
        "slot-grant",
    ] {
        let t = target(case);
        let keys = h.keys(&t);
        let a = acquired(&*h.store, &permit_req(&t, "a", "ann", 3, TTL)).await;
        match case {
            "slot-lease" => admin.cmd(&["SET", &keys.lease_of(slot(2)), "junk"]).await,
            "permits-value" => {
                admin
                    .cmd(&["SET", &keys.permits(), "7x", "PX", "60000"])
                    .await
            }
            "permits-without-expiry" => admin.cmd(&["PERSIST", &keys.permits()]).await,
            _ => admin.cmd(&["LPUSH", &keys.grant_of(slot(1)), "r"]).await,
        };
        let e = h
            .store
            .acquire(&permit_req(&t, "b", "ben", 3, TTL))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{case}: {e}");
        // An exclusive claim is not admitted past it either.
        let exclusive = h.store.acquire(&acquire_req(&t, "x", "xi", TTL)).await;
        assert!(
            !matches!(exclusive, Ok(AcquireOutcome::Acquired(_))),
            "{case}: {exclusive:?}"
        );
        match h.store.repair(&t, 0).await.expect("repair") {
            RepairOutcome::Repaired { .. } => {}
            other => panic!("{case}: repair answered {other:?}"),
        }
        // The held permit survived the repair, and the value in force with it.
        assert_eq!(
            h.store
                .acquire(&acquire_req(&t, "x", "xi", TTL))
                .await
                .expect("acquire"),
            AcquireOutcome::PermitsConflict { in_force: 3 },
            "{case}"
        );
        let b = acquired(&*h.store, &permit_req(&t, "b", "ben", 3, TTL)).await;
        assert_ne!(b.slot, a.slot, "{case}");
    }
}

// P9. Slot 0's fence carries the newest token of the other slots: lost (a partial restore, an
//     operator's DEL) while permits are held, the next renewal of such a permit writes it back,
//     so an exclusive claim still sees the permits held; and a slot's fence reset by `repair`
//     to the operator's floor raises it too, so the next grant of any slot is above the floor.
pub(super) async fn slot_zero_fence_keeps_up_with_the_other_slots(h: Harness) {
    let admin = h.admin();
    let t = target("top-kept");
    let keys = h.keys(&t);
    let a = acquired(&*h.store, &permit_req(&t, "a", "ann", 2, TTL)).await;
    let b = acquired(&*h.store, &permit_req(&t, "b", "ben", 2, TTL)).await;
    assert_eq!((a.slot, b.slot), (slot(0), slot(1)));
    admin.cmd(&["DEL", &keys.fence()]).await;
    let renewed = h
        .store
        .renew(&renew_req(permit_handle(&t, "b", "ben", 2, &b), TTL))
        .await
        .expect("renew");
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    h.store
        .release(&release_req(permit_handle(&t, "a", "ann", 2, &a)))
        .await
        .expect("release");
    // Slot 0 is free, slot 1 held: an exclusive claim must be refused, not granted beside it.
    assert_eq!(
        h.store
            .acquire(&acquire_req(&t, "x", "xi", TTL))
            .await
            .expect("acquire"),
        AcquireOutcome::PermitsConflict { in_force: 2 }
    );

    // Slot 1's fence unreadable; the operator repairs with a floor above every token.
    let t = target("top-repaired");
    let keys = h.keys(&t);
    acquired(&*h.store, &permit_req(&t, "a", "ann", 2, TTL)).await;
    let second = acquired(&*h.store, &permit_req(&t, "b", "ben", 2, TTL)).await;
    h.store
        .release(&release_req(permit_handle(&t, "b", "ben", 2, &second)))
        .await
        .expect("release");
    admin.cmd(&["SET", &keys.fence_of(slot(1)), "junk"]).await;
    let floor = second.token + 600_000_000;
    match h.store.repair(&t, floor).await.expect("repair") {
        RepairOutcome::Repaired { fence, .. } => assert!(fence >= floor, "{fence} < {floor}"),
        other => panic!("{other:?}"),
    }
    let next = acquired(&*h.store, &permit_req(&t, "c", "cat", 2, TTL)).await;
    assert_eq!(next.slot, slot(1));
    assert!(
        next.token > floor,
        "{} is not above the floor {floor}",
        next.token
    );
    assert!(matches!(
        h.store
            .check(&t, next.slot, token_of(next.token))
            .await
            .expect("check"),
        CheckOutcome::Current { .. }
    ));
}
