//! What goes over the wire and into the logs: only scripts, no secrets (items 9 and 10).

use super::*;

// 9. Besides connection set-up and health, the backend sends only scripts.
pub(super) async fn client_sends_only_scripts(h: Harness) {
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
    store
        .check(&t, Slot::ZERO, token_of(g.token))
        .await
        .unwrap();
    store
        .read_guarded(&t, Slot::ZERO, &guarded("data"))
        .await
        .unwrap();
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
        // Commands run inside a script are listed with the client "lua": they are atomic. A
        // primary behind Sentinel also shows the sentinels' hello messages, every 2 s: another
        // client's.
        if line.contains(" lua]")
            || line.contains("\"ECHO\"")
            || line.contains("\"__sentinel__:hello\"")
        {
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
pub(super) async fn logs_hide_password_and_lease_id(h: Harness) {
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
