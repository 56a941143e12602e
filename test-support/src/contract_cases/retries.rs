//! Retries with the same request id act once and answer the first reply (contract item 6).

use super::*;

// 6a. A retried acquire returns the first reply and acts once; once its grant ended it says so.
pub(super) async fn retried_acquire_returns_first_reply(h: Harness) {
    let t = target("retry-acquire");
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    let first = acquired(&*h.store, &req).await;
    let retried = acquired(&*h.store, &req).await;
    assert_eq!(retried, first, "a retry must return the first reply");
    let released = h
        .store
        .release(&release_req(handle(&t, "lease-a", "alice", first.token)))
        .await
        .unwrap();
    assert_eq!(released, ReleaseOutcome::Released);
    // After the release the first reply is no longer true: the retry learns its grant ended.
    assert_eq!(
        h.store.acquire(&req).await.unwrap(),
        AcquireOutcome::Expired { token: first.token },
        "a retry after a release must not report the released grant"
    );
    let seen = h.store.inspect(&t).await.unwrap();
    assert!(seen.lease.is_none(), "the retry acquired a second time");
    assert_eq!(seen.fence, first.token, "the retry issued another token");
}

// 6b. An acquire whose reply was never read, retried with its request id: the first result.
pub(super) async fn unread_acquire_retried_returns_first_result(h: Harness) {
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
pub(super) async fn send_without_reading(h: &Harness, env: &ServerEnv, req: &AcquireRequest) {
    let keys = h.keys(&req.target);
    let ttl = req.ttl.millis().to_string();
    let call = targetlease::store::valkey::wire::acquire_call(&keys, req, &ttl, "60000");
    let (call_keys, call_args) = call.keys_and_args();
    let count = call_keys.len().to_string();
    let mut command = vec!["EVAL", SCRIPTS.acquire.source, &count];
    command.extend(call_keys.iter().chain(&call_args).map(String::as_str));
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
pub(super) async fn retried_renew_acts_once(h: Harness) {
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
pub(super) async fn retried_release_acts_once(h: Harness) {
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
pub(super) async fn retried_commit_acts_once(h: Harness) {
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
        .read_guarded(&t, Slot::ZERO, &guarded("data"))
        .await
        .unwrap()
        .expect("written");
    assert_eq!(stored.value, "second", "the retried commit wrote again");
}
