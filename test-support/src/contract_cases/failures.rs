//! Data loss and corrupt records: tokens still grow, records fail closed (items 7 and 8).

use super::*;

// 7. After all data is lost the next token is still larger than every token issued before.
pub(super) async fn tokens_grow_after_data_loss(h: Harness) {
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
pub(super) async fn corrupt_records_fail_closed(h: Harness) {
    let admin = h.admin();
    let cases: [(&str, &[&[&str]], &str); 8] = [
        ("string-lease", &[&["SET", "{lease}", "junk"]], "not a hash"),
        (
            "foreign-hash",
            &[&["HSET", "{lease}", "colour", "blue"]],
            "lacks field record_version",
        ),
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
        // The spent grant's request id is read where a free target is granted.
        (
            "grant-wrong-type",
            &[&["LPUSH", "{grant}", "r1"]],
            "grant record",
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
                        .replace("{grant}", &keys.grant())
                })
                .collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            admin.cmd(&args).await;
        }
        let dump = async || -> Vec<Value> {
            let mut all = Vec::new();
            for key in [keys.lease(), keys.grant(), keys.fence()] {
                all.push(admin.cmd(&["DUMP", &key]).await);
            }
            all
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
            // The grant only where a free target is granted.
            if name.starts_with("grant") && op != "acquire" {
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
        // `repair` makes the target usable again, whichever of its records was unreadable.
        match h.store.repair(&t, 0).await.expect("repair") {
            RepairOutcome::Repaired { .. } => {}
            other => panic!("{name}: repair answered {other:?} and left the record"),
        }
        let e = h
            .store
            .acquire(&acquire_req(&t, "lease-b", "bob", TTL))
            .await
            .err();
        assert!(e.is_none(), "{name}: acquire after the repair: {e:?}");
    }
    // A corrupt cached reply is refused too, not replayed.
    let t = target("bad-reply");
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    let keys = h.keys(&t);
    // Neither `<binding> <reply>` (40 hex digits, a space, the reply) nor an earlier version's
    // JSON of strings.
    for junk in [
        "{not json",
        r#"{"b":"x","o":"acquire","r":["acquired",5]}"#,
        "acquired 5 1000 1 1",
        &format!("{} ", "0".repeat(40)),
        &format!("{} acquired 5 1000 1 1", "z".repeat(40)),
    ] {
        admin
            .cmd(&["SET", &keys.reply(&req.request_id), junk])
            .await;
        let e = h.store.acquire(&req).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{junk}: {e}");
    }
}

// 8b. `repair` of readable records changes nothing: it answers the fence, and the lease held
//     stays held.
pub(super) async fn repair_leaves_readable_records_alone(h: Harness) {
    let t = target("readable");
    assert_eq!(
        h.store.repair(&t, 0).await.expect("repair"),
        RepairOutcome::Intact { fence: 0 }
    );
    let g = acquired(&*h.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    assert_eq!(
        h.store.repair(&t, 0).await.expect("repair"),
        RepairOutcome::Intact { fence: g.token }
    );
    let renewed = h
        .store
        .renew(&renew_req(handle(&t, "lease-a", "alice", g.token), TTL))
        .await
        .expect("renew");
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
}
