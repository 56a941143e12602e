//! The store where it meets stale state: a replica promoted after it missed grants, a restart
//! from an older snapshot, a retry that arrives after the grant it asks about has ended, and a
//! script that an ACL rule stops half-way. Each body tries to make the store hand out a token
//! twice, answer for a grant that is gone, or leave a record a later call cannot read.

use super::*;

/// Grants `rounds` tenures on `t` in turn (acquire, release), returning the tokens.
async fn tenures(store: &dyn LeaseStore, t: &TargetRef, who: &str, rounds: usize) -> Vec<u64> {
    let mut tokens = Vec::new();
    for round in 0..rounds {
        let lease = format!("{who}-{round}");
        let g = acquired(store, &acquire_req(t, &lease, who, TTL)).await;
        let released = store
            .release(&release_req(handle(t, &lease, who, g.token)))
            .await
            .expect("release");
        assert_eq!(released, ReleaseOutcome::Released);
        tokens.push(g.token);
    }
    tokens
}

/// After a stale copy of the data took over, the next grant is above every token the lost
/// writes issued, and the newest lost token is no longer current there.
async fn assert_above_lost_tokens(store: &dyn LeaseStore, t: &TargetRef, lost: &[u64]) {
    let newest_lost = lost.iter().copied().max().expect("lost grants");
    let g = acquired(store, &acquire_req(t, "after", "carol", TTL)).await;
    assert!(
        g.token > newest_lost,
        "token {} issued again after the failover (lost grants: {lost:?})",
        g.token
    );
    assert!(matches!(
        store
            .check(t, Slot::ZERO, token_of(newest_lost))
            .await
            .expect("check"),
        CheckOutcome::Stale { .. }
    ));
    assert!(matches!(
        store
            .check(t, Slot::ZERO, token_of(g.token))
            .await
            .expect("check"),
        CheckOutcome::Current { .. }
    ));
}

/// A replica that stopped replicating before the newest grants is promoted: the grants it
/// missed must not be issued again, within the first hour of the target's life too.
pub async fn tokens_grow_past_a_promoted_replica(h: Harness) {
    let t = target("promoted");
    tenures(&*h.store, &t, "alice", 1).await;
    let replica = h.lagging_replica().await;
    let lost = tenures(&*h.store, &t, "bob", 3).await;
    h.pass(Duration::from_millis(5)).await;
    assert_above_lost_tokens(&*replica.store, &t, &lost).await;
}

/// The server restarts from a snapshot older than its newest grants.
pub async fn tokens_grow_past_a_restored_snapshot(h: Harness) {
    let t = target("restored");
    tenures(&*h.store, &t, "alice", 1).await;
    h.save_snapshot().await;
    let lost = tenures(&*h.store, &t, "bob", 3).await;
    h.restore_snapshot().await;
    h.pass(Duration::from_millis(5)).await;
    assert_above_lost_tokens(&*h.store, &t, &lost).await;
}

/// A retried acquire is answered with its first reply only while that grant still stands:
/// after an expiry, a release, another holder's tenures or a new token, the retry learns that
/// its grant ended and takes nothing.
pub async fn a_retry_never_answers_for_an_ended_grant(h: Harness) {
    // Expired, then taken by another holder.
    let t = target("retry-expired");
    let first = acquire_req(&t, "lease-x", "xavier", SHORT_TTL);
    let x = acquired(&*h.store, &first).await;
    h.pass(PAST_SHORT_TTL).await;
    let y = acquired(&*h.store, &acquire_req(&t, "lease-y", "yvonne", TTL)).await;
    assert_ended(h.store.acquire(&first).await, x.token, "after an expiry");
    assert_eq!(
        holder_token(&h, &t).await,
        Some(y.token),
        "the retry took the target"
    );

    // Released, another tenure, released: the retry within its reply TTL takes no tenure.
    let t = target("retry-released");
    let first = acquire_req(&t, "lease-x", "xavier", TTL);
    let x = acquired(&*h.store, &first).await;
    let released = h
        .store
        .release(&release_req(handle(&t, "lease-x", "xavier", x.token)))
        .await
        .expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    assert_ended(h.store.acquire(&first).await, x.token, "after a release");
    tenures(&*h.store, &t, "yvonne", 1).await;
    assert_ended(
        h.store.acquire(&first).await,
        x.token,
        "after another tenure",
    );
    assert_eq!(
        holder_token(&h, &t).await,
        None,
        "the retry took a second tenure"
    );

    // Still standing: the retry answers the same grant.
    let t = target("retry-standing");
    let first = acquire_req(&t, "lease-x", "xavier", TTL);
    let x = acquired(&*h.store, &first).await;
    assert_eq!(acquired(&*h.store, &first).await.token, x.token);

    // A renewal retried after its lease expired does not report the lease renewed.
    let t = target("retry-renew");
    let x = acquired(&*h.store, &acquire_req(&t, "lease-x", "xavier", TTL)).await;
    let renew = renew_req(handle(&t, "lease-x", "xavier", x.token), SHORT_TTL);
    assert!(matches!(
        h.store.renew(&renew).await.expect("renew"),
        RenewOutcome::Renewed { .. }
    ));
    h.pass(PAST_SHORT_TTL).await;
    assert_eq!(
        h.store.renew(&renew).await.expect("retried renew"),
        RenewOutcome::Lost {
            reason: LossReason::Expired
        }
    );
    acquired(&*h.store, &acquire_req(&t, "lease-y", "yvonne", TTL)).await;
    assert_eq!(
        h.store.renew(&renew).await.expect("retried renew"),
        RenewOutcome::Lost {
            reason: LossReason::NotHolder
        }
    );
}

fn assert_ended(outcome: Result<AcquireOutcome, StoreError>, token: u64, when: &str) {
    match outcome {
        Ok(AcquireOutcome::Expired { token: t }) => assert_eq!(t, token, "{when}"),
        other => panic!("{when}: a retry of an ended grant was answered {other:?}"),
    }
}

async fn holder_token(h: &Harness, t: &TargetRef) -> Option<u64> {
    let seen = h.store.inspect(t).await.expect("inspect");
    seen.lease.map(|l| l.token)
}

/// The commands of the documented controller ACL rule (`+cmd` words), and the rule itself for
/// `user` with `password`.
fn documented_rule(user: &str, password: &str) -> Vec<String> {
    documented_acl_rule("acl-rule", password)
        .into_iter()
        .map(|w| {
            if w == "targetlease" {
                user.to_owned()
            } else {
                w
            }
        })
        .collect()
}

/// A script that an ACL rule refuses one command half-way must leave nothing that a fully
/// privileged call then reads as corrupt: every script, as a user missing each command of the
/// documented rule in turn; then the targets read, and the next acquire is answered.
pub async fn scripts_refused_half_way_leave_nothing_unreadable(h: Harness) {
    let kind = h.env().kind;
    let raw = h.raw().clone();
    let full = documented_rule("probe", "pw");
    let commands: Vec<String> = full
        .iter()
        .filter(|w| w.starts_with('+'))
        .map(|w| w.to_owned())
        .collect();
    let privileged = &*h.store;
    for (i, missing) in commands.iter().enumerate() {
        let user = format!("partial-{i}");
        let password = format!("pw-{i}");
        let mut rule = documented_rule(&user, &password);
        rule.retain(|w| w != missing);
        if kind == ServerKind::Redis70 {
            // Commands Redis 7.0 does not know (docs/operations.md says to drop them).
            rule.retain(|w| w != "+client|setinfo" && w != "+waitaof");
        }
        let args: Vec<&str> = rule.iter().map(String::as_str).collect();
        let reply = crate::server::raw_command(raw.port, raw.password.as_deref(), &args)
            .expect("ACL SETUSER");
        assert!(reply.starts_with("+OK"), "{args:?}: {reply}");
        let mut config = h.env().config.clone();
        config.username = Some(user.clone());
        config.password = Some(targetlease::store::valkey::PasswordSource::Value(
            targetlease::redact::Secret::new(password.clone()),
        ));
        config.call_timeout = Duration::from_millis(500);
        config.reply_ttl = Duration::from_secs(2);
        // A rule without a connection command cannot even connect: nothing ran.
        let Ok(partial) = ValkeyStore::connect(config).await else {
            continue;
        };
        let t = target(&format!("partial-{i}"));
        let held = target(&format!("partial-held-{i}"));
        // Fresh grant, re-entrant grant, renew, release and commit as the partial user; each
        // may be refused, none may leave the target unreadable.
        let first = acquire_req(&t, "lease-p", "p", TTL);
        let _ = partial.acquire(&first).await;
        // Its retry (the cached path) too.
        let _ = partial.acquire(&first).await;
        let g = acquired(privileged, &acquire_req(&held, "lease-h", "h", TTL)).await;
        let mut floor = acquire_req(&held, "lease-h", "h", TTL);
        floor.min_token = g.token;
        let _ = partial.acquire(&floor).await;
        let now = privileged.inspect(&held).await;
        let token = match &now {
            Ok(seen) => seen.lease.as_ref().map_or(g.token, |l| l.token),
            Err(e) => panic!("without {missing}: a re-entrant acquire left {e}"),
        };
        let lease = handle(&held, "lease-h", "h", token);
        let _ = partial.renew(&renew_req(lease.clone(), TTL)).await;
        let _ = partial.commit(&commit_req(&held, token, "v")).await;
        let _ = partial.release(&release_req(lease.clone())).await;
        for target in [&t, &held] {
            if let Err(e) = privileged.inspect(target).await {
                panic!("without {missing}: a refused script left {target:?} unreadable: {e}");
            }
            let after = acquire_req(target, "lease-after", "after", TTL);
            match privileged.acquire(&after).await {
                Ok(_) => {}
                Err(e) => panic!("without {missing}: the next acquire on {target:?} failed: {e}"),
            }
        }
    }
}
