//! Valkey as operators run it: an ACL user restricted to the key prefix (the rule in
//! docs/operations.md), TLS and mutual TLS (Redis 7.0 from Debian, TLS-only, certificates made at
//! test time), durability with WAITAOF (Valkey 9.1 primary and replica with `appendonly yes`),
//! and the CLI's connection settings. The lease-store contract runs as the ACL user, over TLS
//! and over mTLS; the other tests check that each misconfiguration fails with a clear error.
//! Servers are real and started per test; a missing binary fails the suite.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};

use std::process::Command;
use std::time::{Duration, Instant};

use targetlease::redact::Secret;
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::{
    ClientCertificate, Durability, PasswordSource, TlsConfig, ValkeyConfig, ValkeyStore,
};
use targetlease::store::{ErrorKind, LeaseStore, StoreError};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use support::admin::Admin;
use support::contract_cases::{
    self, Harness, RawAccess, ServerEnv, TTL, Variant, acquire_req, acquired, handle, renew_req,
    target, valkey_config,
};
use support::proxy::{Mode, Proxy};
use support::server::{Listen, Server, ServerKind, resp};
use support::suite::{self, measured, trial};
use support::tls::Certs;

const ADMIN_PASSWORD: &str = "admin-pw-5b1f0c";
const APP_USER: &str = "targetlease";
const APP_PASSWORD: &str = "app-pw-9c2e7a-never-logged";

/// The ACL rule from docs/operations.md for `user` with `password`, as command arguments: the
/// tests use exactly what the documentation tells operators to run.
fn documented_acl_rule(user: &str, password: &str) -> Vec<String> {
    support::documented_acl_rule("acl-rule", user, password)
}

/// Valkey 9.1 whose default user has a password, with `user` set up by `rule`.
fn acl_server(rule: &[String]) -> Server {
    let server = Server::start_with(ServerKind::Valkey91, &["--requirepass", ADMIN_PASSWORD]);
    let args: Vec<&str> = rule.iter().map(String::as_str).collect();
    let reply = server.raw(&args);
    assert!(reply.starts_with("+OK"), "{args:?}: {reply}");
    server
}

/// A store config for the ACL user.
fn app_config(port: u16, user: &str, password: &str) -> ValkeyConfig {
    let mut config = valkey_config(&format!("redis://127.0.0.1:{port}"));
    config.username = Some(user.into());
    config.password = Some(PasswordSource::Value(Secret::new(password)));
    config
}

async fn acl_env() -> ServerEnv {
    let server = acl_server(&documented_acl_rule(APP_USER, APP_PASSWORD));
    let port = server.port;
    let admin = Admin::single(&format!("redis://:{ADMIN_PASSWORD}@127.0.0.1:{port}"), None).await;
    ServerEnv {
        kind: ServerKind::Valkey91,
        config: app_config(port, APP_USER, APP_PASSWORD),
        admin,
        raw: Some(RawAccess {
            port,
            password: Some(ADMIN_PASSWORD.into()),
        }),
        keep: vec![Box::new(server)],
    }
}

/// A TLS-only Redis 7.0 (`--port 0 --tls-port N`), requiring client certificates when `mtls`.
fn tls_server(certs: &Certs, mtls: bool) -> Server {
    let args = certs.server_args(mtls);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start_listening(ServerKind::Redis70, Listen::Tls, &args)
}

/// A store config trusting the test CA, presenting the client certificate when `mtls`.
fn tls_config(certs: &Certs, port: u16, mtls: bool) -> ValkeyConfig {
    let mut config = valkey_config(&format!("rediss://127.0.0.1:{port}"));
    config.tls = Some(TlsConfig {
        ca_file: Some(certs.path("ca.crt")),
        client: mtls.then(|| ClientCertificate {
            cert_file: certs.path("client.crt"),
            key_file: certs.path("client.key"),
        }),
        ..TlsConfig::default()
    });
    config
}

async fn tls_env(mtls: bool) -> ServerEnv {
    let certs = Certs::generate();
    let server = tls_server(&certs, mtls);
    let url = format!("rediss://127.0.0.1:{}", server.port);
    let admin = Admin::single(&url, Some(certs.admin_certs())).await;
    let mut config = tls_config(&certs, server.port, mtls);
    // The contract opens 100 pools at once; 100 TLS handshakes in a debug build on two cores
    // take longer than the default 2 s.
    config.connect_timeout = Duration::from_secs(15);
    config.call_timeout = Duration::from_secs(15);
    ServerEnv {
        kind: ServerKind::Redis70,
        config,
        admin,
        raw: None,
        keep: vec![Box::new(server), Box::new(certs)],
    }
}

/// Expects `connect` to fail with `kind`, naming the endpoint, containing `words` and never
/// `secret`.
async fn refused(
    config: ValkeyConfig,
    kind: ErrorKind,
    words: &[&str],
    secret: &str,
) -> StoreError {
    let endpoint = config.endpoints.describe();
    let e = ValkeyStore::connect(config)
        .await
        .expect_err("connect must fail");
    let text = e.to_string();
    eprintln!("error as reported: {text}");
    assert_eq!(e.kind(), kind, "{text}");
    assert!(
        text.contains(&endpoint),
        "the error does not name {endpoint}: {text}"
    );
    for word in words {
        assert!(text.contains(word), "expected {word:?} in: {text}");
    }
    assert!(!text.contains(secret), "the error shows a secret: {text}");
    e
}

// ---- ACL ----

async fn acl_wrong_password_is_access_denied() {
    let server = acl_server(&documented_acl_rule(APP_USER, APP_PASSWORD));
    let wrong = format!("{APP_PASSWORD}-wrong");
    refused(
        app_config(server.port, APP_USER, &wrong),
        ErrorKind::AccessDenied,
        &["authentication failed"],
        &wrong,
    )
    .await;
}

// A password rotated in its file (a Secret the kubelet updates, as the chart mounts it) is used
// at the next connection without a restart: the store reads the file at every connect.
async fn acl_password_file_rotation_needs_no_restart() {
    let server = acl_server(&documented_acl_rule(APP_USER, APP_PASSWORD));
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("password");
    std::fs::write(&file, format!("{APP_PASSWORD}\n")).expect("write the password file");
    let mut config = app_config(server.port, APP_USER, APP_PASSWORD);
    config.password = Some(PasswordSource::File(file.clone()));
    let store = ValkeyStore::connect(config).await.expect("connect");
    let t = target("rotated");
    acquired(&store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    // Rotate: the server gets the new password, the file too; open connections are cut (as a
    // server restart or a network blip would), so the next call reconnects.
    let rotated = "app-pw-rotated-3e1d";
    let reply = server.raw(&[
        "ACL",
        "SETUSER",
        APP_USER,
        "resetpass",
        &format!(">{rotated}"),
    ]);
    assert!(reply.starts_with("+OK"), "{reply}");
    std::fs::write(&file, format!("{rotated}\n")).expect("rotate the password file");
    server.raw(&["CLIENT", "KILL", "USER", APP_USER]);
    let seen = store
        .inspect(&t)
        .await
        .expect("the rotated password from the file");
    assert_eq!(seen.lease.map(|l| l.owner), Some("alice".to_owned()));
}

async fn acl_user_without_rights_is_access_denied() {
    // Can connect, PING and read INFO (the eviction check), but may not run scripts.
    let rule: Vec<String> =
        "ACL SETUSER no-scripts on >pw1 resetkeys ~tl:* -@all +ping +hello +auth +client|setinfo +info"
            .split_whitespace()
            .map(str::to_owned)
            .collect();
    let server = acl_server(&rule);
    let store = ValkeyStore::connect(app_config(server.port, "no-scripts", "pw1"))
        .await
        .expect("PING is allowed");
    let e = store
        .acquire(&acquire_req(&target("rights"), "lease-a", "alice", TTL))
        .await
        .expect_err("EVALSHA is not allowed");
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    assert!(e.to_string().contains("evalsha"), "{e}");

    // May run scripts, but not every command they need: the script fails as a whole, with the
    // ACL's reason (not disguised as a corrupt record), and writes nothing.
    let mut rule = documented_acl_rule("no-hset", "pw2");
    rule.retain(|w| w != "+hset");
    let args: Vec<&str> = rule.iter().map(String::as_str).collect();
    assert!(server.raw(&args).starts_with("+OK"));
    let store = ValkeyStore::connect(app_config(server.port, "no-hset", "pw2"))
        .await
        .expect("connect");
    let t = target("rights-hset");
    let e = store
        .acquire(&acquire_req(&t, "lease-a", "alice", TTL))
        .await
        .expect_err("HSET is not allowed");
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    assert!(e.to_string().contains("hset"), "{e}");
    let fence = TargetKeys::new("tl", &t).fence();
    assert!(
        server.raw(&["EXISTS", &fence]).starts_with(":0"),
        "a refused script wrote"
    );
}

async fn acl_key_outside_the_prefix_is_refused() {
    let server = acl_server(&documented_acl_rule(APP_USER, APP_PASSWORD));
    let mut config = app_config(server.port, APP_USER, APP_PASSWORD);
    config.key_prefix = "other".into();
    let store = ValkeyStore::connect(config).await.expect("connect");
    let e = store
        .acquire(&acquire_req(&target("outside"), "lease-a", "alice", TTL))
        .await
        .expect_err("keys outside ~tl:* are refused");
    assert_eq!(e.kind(), ErrorKind::AccessDenied, "{e}");
    assert!(e.to_string().contains("permission denied"), "{e}");
    assert!(
        server.raw(&["DBSIZE"]).starts_with(":0"),
        "something was written"
    );
}

// ---- TLS ----

async fn tls_wrong_ca_is_named() {
    let certs = Certs::generate();
    let server = tls_server(&certs, false);
    let mut config = tls_config(&certs, server.port, false);
    if let Some(tls) = config.tls.as_mut() {
        tls.ca_file = Some(certs.path("other-ca.crt"));
    }
    refused(
        config,
        ErrorKind::Tls,
        &["TLS handshake failed", "unknown CA"],
        "-----",
    )
    .await;
}

async fn mtls_without_client_certificate_is_named() {
    let certs = Certs::generate();
    let server = tls_server(&certs, true);
    refused(
        tls_config(&certs, server.port, false),
        ErrorKind::Tls,
        &["TLS handshake failed", "client certificate"],
        "-----",
    )
    .await;
}

async fn mtls_with_a_foreign_client_certificate_is_named() {
    let certs = Certs::generate();
    let server = tls_server(&certs, true);
    let mut config = tls_config(&certs, server.port, true);
    if let Some(tls) = config.tls.as_mut() {
        tls.client = Some(ClientCertificate {
            cert_file: certs.path("other-client.crt"),
            key_file: certs.path("other-client.key"),
        });
    }
    refused(
        config,
        ErrorKind::Tls,
        &["TLS handshake failed", "client certificate"],
        "-----",
    )
    .await;
}

async fn tls_server_name_is_verified() {
    let certs = Certs::generate();
    let server = tls_server(&certs, false);
    // The certificate names valkey.test; we connect to 127.0.0.1 and say which name to expect.
    let mut config = tls_config(&certs, server.port, false);
    if let Some(tls) = config.tls.as_mut() {
        tls.server_name = Some("valkey.test".into());
    }
    let store = ValkeyStore::connect(config.clone())
        .await
        .expect("the right server name");
    acquired(
        &store,
        &acquire_req(&target("named"), "lease-a", "alice", TTL),
    )
    .await;
    if let Some(tls) = config.tls.as_mut() {
        tls.server_name = Some("elsewhere.test".into());
    }
    refused(
        config,
        ErrorKind::Tls,
        &["server name mismatch", "elsewhere.test"],
        "-----",
    )
    .await;
}

/// The pool makes one connection per slot however many calls arrive on an empty pool at once:
/// calls on a slot that is connecting wait for that one attempt instead of connecting beside it
/// (the live connection is taken without an async lock, the connect is serialised per slot).
async fn pool_connects_each_slot_once() {
    let server = Server::start(ServerKind::Valkey91);
    // Connections ever accepted: a burst of connections dropped again still counts.
    let connections = || {
        server
            .raw(&["INFO", "stats"])
            .lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|n| n.trim().parse::<usize>().ok())
            .expect("total_connections_received")
    };
    let before = connections();
    let mut config = valkey_config(&server.url());
    config.pool_size = 4;
    let store = std::sync::Arc::new(ValkeyStore::new_lazy(config).expect("lazy store"));
    let t = target("pool-burst");
    let calls: Vec<_> = (0..200)
        .map(|_| {
            let (store, t) = (store.clone(), t.clone());
            tokio::spawn(async move { store.inspect(&t).await })
        })
        .collect();
    for call in calls {
        call.await.expect("task").expect("inspect");
    }
    // Four for the pool, one for `raw`'s own INFO connection.
    assert_eq!(
        connections(),
        before + 4 + 1,
        "200 calls at once on a pool of 4"
    );
}

async fn tls_to_a_plain_server_is_named() {
    let server = Server::start(ServerKind::Valkey91);
    let mut config = valkey_config(&format!("rediss://127.0.0.1:{}", server.port));
    config.connect_timeout = Duration::from_millis(500);
    config.call_timeout = Duration::from_millis(500);
    refused(
        config,
        ErrorKind::Unavailable,
        &[
            "timed out after 500 ms",
            "does the server speak TLS on this port?",
        ],
        "-----",
    )
    .await;
}

async fn tls_insecure_connects_and_warns() {
    let certs = Certs::generate();
    let server = tls_server(&certs, false);
    let mut config = valkey_config(&format!("rediss://127.0.0.1:{}", server.port));
    config.tls = Some(TlsConfig {
        insecure: true,
        ..TlsConfig::default()
    });
    let (logs, guard) = suite::capture_logs();
    let store = ValkeyStore::connect(config)
        .await
        .expect("insecure accepts any certificate");
    drop(guard);
    acquired(
        &store,
        &acquire_req(&target("insecure"), "lease-a", "alice", TTL),
    )
    .await;
    let logs = logs.text();
    assert!(
        logs.contains("WARN") && logs.contains("verification is DISABLED"),
        "{logs}"
    );
}

// ---- Durability ----

/// A Valkey 9.1 primary and replica, both `appendonly yes`; the replica reaches the primary
/// through a proxy so that the test can hold replication back.
struct Replicated {
    primary: Server,
    replica: Server,
    link: Proxy,
}

async fn replicated() -> Replicated {
    let aof = ["--appendonly", "yes", "--appendfsync", "always"];
    let primary = Server::start_with(ServerKind::Valkey91, &aof);
    let link = Proxy::start(primary.port).await;
    let replica = Server::start_with(
        ServerKind::Valkey91,
        &[
            &aof[..],
            &["--replicaof", "127.0.0.1", &link.port.to_string()],
        ]
        .concat(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !replica
        .raw(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(
            Instant::now() < deadline,
            "replica did not sync: {}",
            replica.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Replicated {
        primary,
        replica,
        link,
    }
}

fn fence_on(server: &Server, keys: &TargetKeys) -> Option<u64> {
    let reply = server.raw(&["GET", &keys.fence()]);
    reply.lines().nth(1).and_then(|v| v.parse().ok())
}

async fn durability_replicas_waits_for_the_replica() {
    let r = replicated().await;
    let url = format!("redis://127.0.0.1:{}", r.primary.port);
    let mut config = valkey_config(&url);
    config.durability = "replicas=1".parse().expect("durability");
    config.call_timeout = Duration::from_millis(1500);
    let store = ValkeyStore::connect(config.clone()).await.expect("connect");
    // Every acquire's fence is on the replica the moment acquire returns.
    for i in 0..20 {
        let t = target(&format!("durable-{i}"));
        let g = acquired(&store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
        let keys = TargetKeys::new("tl", &t);
        assert_eq!(
            fence_on(&r.replica, &keys),
            Some(g.token),
            "acquire {i} returned before the replica had it"
        );
    }
    // Hold replication back: the acquire runs on the primary but is not confirmed durable.
    r.link.set(Mode::Stall);
    let t = target("durable-held-back");
    let keys = TargetKeys::new("tl", &t);
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    let started = Instant::now();
    let e = store
        .acquire(&req)
        .await
        .expect_err("no replica can confirm");
    measured(
        "durable acquire refused at its deadline (1500 ms)",
        started.elapsed(),
    );
    assert_eq!(e.kind(), ErrorKind::NotDurable, "{e}");
    assert!(e.to_string().contains("replicas: 0 of 1"), "{e}");
    assert_eq!(fence_on(&r.replica, &keys), None);
    // Without the option an acquire returns although the replica has nothing: what the option
    // buys.
    let plain = ValkeyStore::connect(valkey_config(&url))
        .await
        .expect("connect");
    let other = target("not-durable");
    acquired(&plain, &acquire_req(&other, "lease-a", "alice", TTL)).await;
    assert_eq!(fence_on(&r.replica, &TargetKeys::new("tl", &other)), None);
    // Once replication flows again, the retry (same request id) returns the first grant, now
    // confirmed on the replica.
    r.link.set(Mode::Pass);
    let first_token = match r.primary.raw(&["GET", &keys.fence()]).lines().nth(1) {
        Some(v) => v.parse::<u64>().expect("fence"),
        None => panic!("the first acquire did not run"),
    };
    let g = acquired(&store, &req).await;
    assert_eq!(g.token, first_token, "the retry issued another token");
    assert_eq!(fence_on(&r.replica, &keys), Some(g.token));
}

/// A durable acquire waiting for a replica that does not answer (replication held back, as when
/// a replica leaves in a failover) holds up no renewal: durable acquires have connections of
/// their own, even with a pool of one.
async fn durability_wait_holds_up_no_renewal() {
    let r = replicated().await;
    let mut config = valkey_config(&format!("redis://127.0.0.1:{}", r.primary.port));
    config.durability = "replicas=1".parse().expect("durability");
    config.call_timeout = Duration::from_millis(1500);
    config.pool_size = 1;
    let store = std::sync::Arc::new(ValkeyStore::connect(config).await.expect("connect"));
    let held = target("renewed-meanwhile");
    let g = acquired(&*store, &acquire_req(&held, "lease-a", "alice", TTL)).await;
    r.link.set(Mode::Stall);
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move {
            let t = target("waits-for-the-replica");
            store.acquire(&acquire_req(&t, "lease-b", "bob", TTL)).await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let renewed = store
        .renew(&renew_req(handle(&held, "lease-a", "alice", g.token), TTL))
        .await
        .expect("renew beside a waiting durable acquire");
    let took = started.elapsed();
    measured(
        "renew beside a durable acquire waiting for its replica",
        took,
    );
    assert!(
        matches!(renewed, targetlease::store::RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    assert!(
        took < Duration::from_millis(500),
        "the renew waited {took:?} behind WAITAOF"
    );
    let e = waiting.await.expect("task").expect_err("not confirmed");
    assert_eq!(e.kind(), ErrorKind::NotDurable, "{e}");
    r.link.set(Mode::Pass);
}

async fn durability_needs_waitaof_and_aof() {
    let redis = Server::start(ServerKind::Redis70);
    let mut config = valkey_config(&redis.url());
    config.durability = "replicas=1".parse().expect("durability");
    refused(
        config,
        ErrorKind::InvalidConfig,
        &["WAITAOF", "replicas=1"],
        "-----",
    )
    .await;

    let no_aof = Server::start(ServerKind::Valkey81);
    let mut config = valkey_config(&no_aof.url());
    config.durability = Durability {
        local: true,
        replicas: 0,
    };
    refused(
        config,
        ErrorKind::InvalidConfig,
        &["appendonly yes"],
        "-----",
    )
    .await;
    // A lazy store (the controller's) checks on its first connection: the first acquire is
    // refused before any script runs.
    let mut config = valkey_config(&no_aof.url());
    config.durability = "local".parse().expect("durability");
    let lazy = ValkeyStore::new_lazy(config).expect("lazy store");
    let e = lazy
        .acquire(&acquire_req(&target("lazy"), "lease-a", "alice", TTL))
        .await
        .expect_err("no AOF");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(no_aof.raw(&["DBSIZE"]).starts_with(":0"), "the acquire ran");

    let aof = Server::start_with(ServerKind::Valkey81, &["--appendonly", "yes"]);
    let mut config = valkey_config(&aof.url());
    config.durability = "local".parse().expect("durability");
    let store = ValkeyStore::connect(config)
        .await
        .expect("local durability with AOF");
    acquired(
        &store,
        &acquire_req(&target("local"), "lease-a", "alice", TTL),
    )
    .await;
}

async fn durability_replicas_are_counted_at_start_up() {
    let server = Server::start_with(ServerKind::Valkey91, &["--appendonly", "yes"]);
    let mut config = valkey_config(&server.url());
    config.durability = "replicas=1".parse().expect("durability");
    config.call_timeout = Duration::from_millis(1500);
    let started = Instant::now();
    refused(
        config.clone(),
        ErrorKind::InvalidConfig,
        &["replicas=1", "has 0 online"],
        "-----",
    )
    .await;
    let took = started.elapsed();
    measured("start-up refused without a replica", took);
    assert!(
        took < Duration::from_millis(500),
        "refused after {took:?}: not at start-up but at a deadline"
    );
    // The controller's lazy store: its readiness check says the same, and nothing ran.
    let lazy = ValkeyStore::new_lazy(config).expect("lazy store");
    let e = lazy.health().await.expect_err("ready without a replica");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(server.raw(&["DBSIZE"]).starts_with(":0"), "something ran");
    // The CLI: exit status 1 at once, the same message.
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_targetlease"))
        .args([
            "lease",
            "inspect",
            "--target",
            "t",
            "--valkey-durability",
            "replicas=1",
        ])
        .env("TARGETLEASE_VALKEY_URL", server.url())
        .output()
        .expect("run targetlease");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("\"kind\":\"invalid_config\""), "{text}");
    assert!(text.contains("has 0 online"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

async fn durable_acquire_sends_scripts_and_waitaof_only() {
    let server = Server::start_with(ServerKind::Valkey91, &["--appendonly", "yes"]);
    let mut monitor = BufReader::new(
        tokio::net::TcpStream::connect(("127.0.0.1", server.port))
            .await
            .expect("connect"),
    );
    monitor
        .get_mut()
        .write_all(&resp(&["MONITOR"]))
        .await
        .expect("monitor");
    let mut line = String::new();
    monitor.read_line(&mut line).await.expect("monitor reply");
    let mut config = valkey_config(&server.url());
    config.durability = "local".parse().expect("durability");
    // One connection, so one start-up probe.
    config.pool_size = 1;
    let store = ValkeyStore::connect(config).await.expect("connect");
    let t = target("monitored-durable");
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    acquired(&store, &req).await;
    acquired(&store, &req).await;
    server.raw(&["ECHO", "monitor-done"]);
    let mut commands = Vec::new();
    loop {
        line.clear();
        tokio::time::timeout(Duration::from_secs(5), monitor.read_line(&mut line))
            .await
            .expect("monitor output")
            .expect("read");
        if line.contains("\"monitor-done\"") {
            break;
        }
        if line.contains(" lua]") {
            continue;
        }
        let name = line
            .split("] \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next());
        commands.push(name.unwrap_or("?").to_ascii_uppercase());
    }
    // INFO is the eviction check of every new connection.
    let allowed = [
        "EVALSHA", "EVAL", "WAITAOF", "HELLO", "AUTH", "CLIENT", "PING", "SELECT", "INFO",
    ];
    let others: Vec<&String> = commands
        .iter()
        .filter(|c| !allowed.contains(&c.as_str()))
        .collect();
    assert!(others.is_empty(), "unexpected commands: {others:?}");
    // The probe when each connection was made (one per INFO, the eviction check of a new
    // connection; acquires have connections of their own), then every script (EVALSHA, or EVAL
    // after NOSCRIPT) immediately followed by WAITAOF on the same connection.
    let calls: Vec<&str> = commands
        .iter()
        .map(String::as_str)
        .filter(|c| *c != "CLIENT")
        .collect();
    let scripts = calls.iter().filter(|c| c.starts_with("EVAL")).count();
    assert!(scripts >= 2, "{calls:?}");
    for (i, call) in calls.iter().enumerate() {
        if call.starts_with("EVAL") {
            assert_eq!(calls.get(i + 1), Some(&"WAITAOF"), "{calls:?}");
        }
    }
    let connections = calls.iter().filter(|c| **c == "INFO").count();
    assert!(connections >= 1, "{calls:?}");
    assert_eq!(
        calls.iter().filter(|c| **c == "WAITAOF").count(),
        scripts + connections,
        "{calls:?}"
    );
}

// ---- The CLI ----

/// The exit statuses docs/reference/cli.md ("Exit statuses") gives for `lease read`: 0 with the value,
/// 3 when no record is under the key.
async fn cli_read_exits_3_for_a_missing_record() {
    let server = Server::start(ServerKind::Valkey91);
    let lease = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_targetlease"))
            .arg("lease")
            .args(args)
            .args(["--namespace", "shop", "--target", "cli-read"])
            .env("TARGETLEASE_VALKEY_URL", server.url())
            .output()
            .expect("run targetlease");
        let body: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
        (out.status.code(), body)
    };
    let (code, body) = lease(&["read", "--key", "progress"]);
    assert_eq!(code, Some(3), "{body}");
    assert_eq!(body["outcome"], "absent", "{body}");
    let (code, body) = lease(&["acquire", "--lease-id", "L1", "--owner", "w"]);
    assert_eq!(code, Some(0), "{body}");
    let token = body["token"].to_string();
    let (code, body) = lease(&[
        "commit", "--token", &token, "--key", "progress", "--value", "42",
    ]);
    assert_eq!(code, Some(0), "{body}");
    let (code, body) = lease(&["read", "--key", "progress"]);
    assert_eq!(code, Some(0), "{body}");
    assert_eq!(body["value"], "42", "{body}");
}

async fn cli_reads_credentials_from_file_and_environment() {
    let server = acl_server(&documented_acl_rule(APP_USER, APP_PASSWORD));
    let dir = tempfile::tempdir().expect("temp dir");
    let password_file = dir.path().join("password");
    std::fs::write(&password_file, format!("{APP_PASSWORD}\n")).expect("write password file");
    let cli = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_targetlease"))
            .args(args)
            .env_remove("TARGETLEASE_VALKEY_PASSWORD")
            .env(
                "TARGETLEASE_VALKEY_URL",
                format!("redis://127.0.0.1:{}", server.port),
            )
            .env("TARGETLEASE_VALKEY_USERNAME", APP_USER)
            .envs(env.iter().copied())
            .output()
            .expect("run targetlease");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !text.contains(APP_PASSWORD),
            "the password was printed: {text}"
        );
        (out.status.code(), text)
    };
    let acquire = [
        "lease",
        "acquire",
        "--target",
        "cli",
        "--lease-id",
        "L1",
        "--owner",
        "w",
    ];
    let file = password_file.display().to_string();
    let (code, text) = cli(&acquire, &[("TARGETLEASE_VALKEY_PASSWORD_FILE", &file)]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("\"outcome\":\"acquired\""), "{text}");
    let (code, text) = cli(&acquire, &[("TARGETLEASE_VALKEY_PASSWORD", APP_PASSWORD)]);
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = cli(&acquire, &[("TARGETLEASE_VALKEY_PASSWORD", "nope")]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("\"kind\":\"access_denied\""), "{text}");
    // --help shows no password flag and no value of a password variable.
    let (_, help) = cli(
        &["lease", "acquire", "--help"],
        &[("TARGETLEASE_VALKEY_PASSWORD", APP_PASSWORD)],
    );
    assert!(help.contains("--valkey-password-file"), "{help}");
    assert!(!help.contains("--valkey-password "), "{help}");
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let variants = [
        Variant {
            name: "valkey-9.1+acl",
            make: || Box::pin(async { Harness::server(acl_env().await).await }),
            admin: true,
            raw: true,
        },
        Variant {
            name: "redis-7.0+tls",
            make: || Box::pin(async { Harness::server(tls_env(false).await).await }),
            admin: true,
            raw: false,
        },
        Variant {
            name: "redis-7.0+mtls",
            make: || Box::pin(async { Harness::server(tls_env(true).await).await }),
            admin: true,
            raw: false,
        },
    ];
    let mut trials = contract_cases::trials(&variants);
    trials.extend([
        trial(
            "acl::wrong_password_is_access_denied",
            acl_wrong_password_is_access_denied,
        ),
        trial(
            "acl::password_file_rotation_needs_no_restart",
            acl_password_file_rotation_needs_no_restart,
        ),
        trial(
            "acl::user_without_rights_is_access_denied",
            acl_user_without_rights_is_access_denied,
        ),
        trial(
            "acl::key_outside_the_prefix_is_refused",
            acl_key_outside_the_prefix_is_refused,
        ),
        trial(
            "pool::connects_each_slot_once",
            pool_connects_each_slot_once,
        ),
        trial("tls::wrong_ca_is_named", tls_wrong_ca_is_named),
        trial(
            "tls::mtls_without_client_certificate_is_named",
            mtls_without_client_certificate_is_named,
        ),
        trial(
            "tls::mtls_with_a_foreign_client_certificate_is_named",
            mtls_with_a_foreign_client_certificate_is_named,
        ),
        trial("tls::server_name_is_verified", tls_server_name_is_verified),
        trial(
            "tls::to_a_plain_server_is_named",
            tls_to_a_plain_server_is_named,
        ),
        trial(
            "tls::insecure_connects_and_warns",
            tls_insecure_connects_and_warns,
        ),
        trial(
            "durability::replicas_waits_for_the_replica",
            durability_replicas_waits_for_the_replica,
        ),
        trial(
            "durability::wait_holds_up_no_renewal",
            durability_wait_holds_up_no_renewal,
        ),
        trial(
            "durability::needs_waitaof_and_aof",
            durability_needs_waitaof_and_aof,
        ),
        trial(
            "durability::replicas_are_counted_at_start_up",
            durability_replicas_are_counted_at_start_up,
        ),
        trial(
            "durability::durable_acquire_sends_scripts_and_waitaof_only",
            durable_acquire_sends_scripts_and_waitaof_only,
        ),
        trial(
            "cli::reads_credentials_from_file_and_environment",
            cli_reads_credentials_from_file_and_environment,
        ),
        trial(
            "cli::read_exits_3_for_a_missing_record",
            cli_read_exits_3_for_a_missing_record,
        ),
        trial(
            "fencing_wire::from_python_as_the_page_says",
            fencing_wire_from_python_as_the_page_says,
        ),
    ]);
    suite::run(args, trials)
}

// ---- Fencing from another language ----

/// The ```python block of docs/reference/fencing-wire.md, as a reader copies it.
fn fencing_wire_page_python() -> String {
    let page = include_str!("../../docs/reference/fencing-wire.md");
    let start = page
        .find("```python\n")
        .expect("a python block on the page")
        + "```python\n".len();
    let end = start + page[start..].find("```").expect("the python block ends");
    page[start..end].to_owned()
}

/// Runs `python3` on `program` from the repository root (where the page's `lua/` folder is),
/// with `env`; returns the exit status, stdout and stderr.
fn python(program: &str, env: &[(&str, String)]) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("fencing.py");
    std::fs::write(&file, program).expect("write the program");
    let out = Command::new("python3")
        .arg(&file)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR")))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("run python3");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The page's Python, run with the `valkey` package exactly as written, as the workload ACL user
/// of docs/operations.md, against leases the binary granted: its commit lands and the binary
/// reads it back; its script texts are the ones the binary ships (the SHA-1s the binary loaded);
/// after a newer grant the same program is refused and stops; its check and read follow the
/// binary's, in slot 0 (whose fence then reads `<fence> <top>`) and in another slot; a token never
/// issued is a `TLINVALID` error.
async fn fencing_wire_from_python_as_the_page_says() {
    const WORKLOAD_PASSWORD: &str = "workload-pw-3e1d";
    let rule = support::documented_acl_rule(
        "acl-workload-rule",
        "targetlease-workload",
        WORKLOAD_PASSWORD,
    );
    let server = acl_server(&rule);
    let admin_url = format!("redis://default:{ADMIN_PASSWORD}@127.0.0.1:{}", server.port);
    let workload_url = format!(
        "redis://targetlease-workload:{WORKLOAD_PASSWORD}@127.0.0.1:{}",
        server.port
    );
    let lease = |target: &str, args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_targetlease"))
            .arg("lease")
            .args(args)
            .args(["--namespace", "shop", "--target", target])
            .env("TARGETLEASE_VALKEY_URL", &admin_url)
            .output()
            .expect("run targetlease");
        let body: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {body}");
        body
    };
    let target = "orders-db/migration";
    let first = lease(target, &["acquire", "--lease-id", "L1", "--owner", "w1"]);
    let old_token = first["token"].as_u64().expect("token");
    // The binary loads its scripts first, so that their SHA-1s are in the server's cache before
    // Python sends a byte.
    lease(
        target,
        &[
            "commit",
            "--token",
            &old_token.to_string(),
            "--key",
            "warm",
            "--value",
            "x",
        ],
    );
    lease(target, &["check", "--token", &old_token.to_string()]);
    lease(target, &["read", "--key", "warm"]);

    let page = fencing_wire_page_python();
    let library = page
        .split("\nr = valkey.Valkey.from_url")
        .next()
        .expect("the page's functions")
        .to_owned();
    let same_scripts = format!(
        "{library}\nimport hashlib\nadmin = valkey.Valkey.from_url(os.environ['ADMIN_URL'])\n\
         shas = [hashlib.sha1(s.encode()).hexdigest() for s in (COMMIT, CHECK, READ)]\n\
         print(admin.script_exists(*shas))\n"
    );
    let (code, out, err) = python(&same_scripts, &[("ADMIN_URL", admin_url.clone())]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out.trim(),
        "[True, True, True]",
        "the page builds other script texts: {err}"
    );

    let env = |token: u64| {
        vec![
            ("TARGETLEASE_VALKEY_URL", workload_url.clone()),
            ("TARGETLEASE_TOKEN", token.to_string()),
        ]
    };
    let (code, out, err) = python(&page, &env(old_token));
    assert_eq!(code, Some(0), "the page's program failed: {err}");
    assert_eq!(out.trim(), format!("({old_token}, '42')"), "{err}");
    let read = lease(target, &["read", "--key", "progress"]);
    assert_eq!(read["value"], "42", "{read}");
    assert_eq!(read["token"].as_u64(), Some(old_token), "{read}");

    // A newer tenure: the same program with the old token is refused and stops.
    lease(
        target,
        &[
            "release",
            "--lease-id",
            "L1",
            "--owner",
            "w1",
            "--token",
            &old_token.to_string(),
        ],
    );
    let second = lease(target, &["acquire", "--lease-id", "L2", "--owner", "w2"]);
    let new_token = second["token"].as_u64().expect("token");
    assert!(new_token > old_token);
    let (code, _, err) = python(&page, &env(old_token));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("a newer holder has token {new_token}: stop")),
        "{err}"
    );

    // check and read, in slot 0 and in slot 1 of a target with two permits; and the errors.
    let permits = "reports";
    let a = lease(
        permits,
        &[
            "acquire",
            "--lease-id",
            "A",
            "--owner",
            "a",
            "--permits",
            "2",
        ],
    );
    let b = lease(
        permits,
        &[
            "acquire",
            "--lease-id",
            "B",
            "--owner",
            "b",
            "--permits",
            "2",
        ],
    );
    let (token_a, token_b) = (
        a["token"].as_u64().expect("a"),
        b["token"].as_u64().expect("b"),
    );
    assert_eq!(
        (a["slot"].as_u64(), b["slot"].as_u64()),
        (Some(0), Some(1)),
        "{a} {b}"
    );
    let driver = format!(
        "{library}\n\
         r = valkey.Valkey.from_url(os.environ['TARGETLEASE_VALKEY_URL'], decode_responses=True)\n\
         print(check(r, 'shop', '{target}', {old_token}))\n\
         print(check(r, 'shop', '{target}', {new_token}))\n\
         print(check(r, 'shop', '{permits}', {token_a}))\n\
         print(check(r, 'shop', '{permits}', {token_b}, slot=1))\n\
         print(commit(r, 'shop', '{permits}', {token_b}, 'k', 'in slot 1', slot=1))\n\
         print(read(r, 'shop', '{permits}', 'k', slot=1))\n\
         print(read(r, 'shop', '{permits}', 'k'))\n\
         try:\n    check(r, 'shop', '{permits}', {token_b} + 1000, slot=1)\n\
         except valkey.exceptions.ResponseError as e:\n    print(str(e).split()[0])\n"
    );
    let (code, out, err) = python(&driver, &env(new_token));
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            format!("('stale', {new_token})").as_str(),
            format!("('current', {new_token})").as_str(),
            format!("('current', {token_a})").as_str(),
            format!("('current', {token_b})").as_str(),
            format!("('committed', {token_b})").as_str(),
            format!("({token_b}, 'in slot 1')").as_str(),
            "None",
            "TLINVALID",
        ],
        "{err}"
    );
    let read = lease(permits, &["read", "--key", "k", "--slot", "1"]);
    assert_eq!(read["value"], "in slot 1", "{read}");
}
