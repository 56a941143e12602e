//! Network and server faults between the lease store and Valkey 9.1: a TCP proxy written here
//! (test-support/src/proxy.rs) stalls, delays and cuts connections and drops replies after the
//! server ran the script; the server is killed and restarted with and without AOF. Each test
//! keeps one store object throughout: recovery never needs a restart of the client. Measured
//! figures are printed as `measured: ...` lines. A missing server binary fails the suite.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};

use std::time::{Duration, Instant};

use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::valkey::{ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, CommitOutcome, ErrorKind, Grant, LeaseStore, ReleaseOutcome, Slot, TargetRef,
};

use support::admin::Admin;
use support::contract_cases::{
    TTL, acquire_req, acquired, commit_req, guarded, handle, release_req, target, valkey_config,
};
use support::proxy::{Mode, Proxy};
use support::server::{Server, ServerKind};
use support::suite::{self, measured, trial};

const DEADLINE: Duration = Duration::from_millis(500);
/// How much later than its deadline a failed call may return (scheduling on a busy CI box).
const SLACK: Duration = Duration::from_millis(250);

/// Valkey 9.1 behind a proxy, a store through the proxy (one connection, so the test knows
/// which connection a fault hits) and an administrator connection straight to the server.
struct Faulty {
    /// Kept alive for the test's duration.
    _server: Server,
    proxy: Proxy,
    store: ValkeyStore,
    admin: Admin,
}

async fn faulty() -> Faulty {
    let server = Server::start(ServerKind::Valkey91);
    let proxy = Proxy::start(server.port).await;
    let mut config = valkey_config(&format!("redis://127.0.0.1:{}", proxy.port));
    config.pool_size = 1;
    config.call_timeout = DEADLINE;
    config.connect_timeout = DEADLINE;
    let store = ValkeyStore::connect(config)
        .await
        .expect("connect through the proxy");
    let admin = Admin::single(&server.url(), None).await;
    // Load every script (EVALSHA answers NOSCRIPT on a fresh server), so that a fault hits
    // the one round trip of a call, not the NOSCRIPT / EVAL exchange.
    let warm = target("warm-up");
    let g = acquired(&store, &acquire_req(&warm, "lease-w", "w", TTL)).await;
    let lease = handle(&warm, "lease-w", "w", g.token);
    store
        .renew(&support::contract_cases::renew_req(lease.clone(), TTL))
        .await
        .expect("renew");
    store
        .commit(&commit_req(&warm, g.token, "v"))
        .await
        .expect("commit");
    store.inspect(&warm).await.expect("inspect");
    store.release(&release_req(lease)).await.expect("release");
    Faulty {
        _server: server,
        proxy,
        store,
        admin,
    }
}

/// Runs `call`, returning its result and how long it took.
async fn timed<T>(call: impl std::future::Future<Output = T>) -> (T, Duration) {
    let started = Instant::now();
    let result = call.await;
    (result, started.elapsed())
}

async fn stalled_call_fails_at_its_deadline() {
    let f = faulty().await;
    let t = target("stall");
    acquired(&f.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    f.proxy.set(Mode::Stall);
    let (result, took) = timed(f.store.acquire(&acquire_req(&t, "lease-b", "bob", TTL))).await;
    measured("stalled acquire fails after (deadline 500 ms)", took);
    let e = result.expect_err("a stalled call cannot succeed");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("timed out after 500 ms"), "{e}");
    assert!(
        took >= DEADLINE && took <= DEADLINE + SLACK,
        "took {took:?}"
    );
    // The readiness check is bounded the same way.
    let (health, took) = timed(f.store.health()).await;
    measured("stalled health check fails after (deadline 500 ms)", took);
    let e = health.expect_err("not healthy while stalled");
    assert!(e.is_transient(), "{e}");
    assert!(took <= DEADLINE + SLACK, "took {took:?}");
}

async fn calls_succeed_again_once_the_fault_heals() {
    let f = faulty().await;
    let t = target("heal");
    let g = acquired(&f.store, &acquire_req(&t, "lease-a", "alice", TTL)).await;
    // Stall, fail, heal: the stalled connection was dropped and a new one is made.
    f.proxy.set(Mode::Stall);
    let e = f.store.health().await.expect_err("stalled");
    assert!(e.is_transient(), "{e}");
    f.proxy.set(Mode::Pass);
    let healed = Instant::now();
    let (result, _) = timed(f.store.health()).await;
    result.expect("healthy again without restarting anything");
    measured("stall healed until a call succeeds", healed.elapsed());
    // Every connection reset: the next call reconnects within its own deadline. (The reset
    // reaches the client when the proxy's tasks run: on a loaded machine the call could
    // otherwise wait on the old connection until its reset arrives, with its deadline.)
    f.proxy.cut();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (renewed, took) = timed(f.store.renew(&support::contract_cases::renew_req(
        handle(&t, "lease-a", "alice", g.token),
        TTL,
    )))
    .await;
    renewed.expect("a cut connection is replaced inside the call");
    measured("call right after every connection was cut", took);
    // Latency below the deadline is only latency; above it, a timeout.
    f.proxy.set(Mode::Delay(Duration::from_millis(150)));
    let (result, took) = timed(f.store.inspect(&t)).await;
    result.expect("150 ms of latency fits a 500 ms deadline");
    assert!(
        took >= Duration::from_millis(300),
        "request and reply are both delayed: {took:?}"
    );
    f.proxy.set(Mode::Delay(Duration::from_millis(700)));
    let (result, took) = timed(f.store.inspect(&t)).await;
    assert_eq!(result.expect_err("too slow").kind(), ErrorKind::Timeout);
    assert!(took <= DEADLINE + SLACK, "took {took:?}");
    f.proxy.set(Mode::Pass);
    f.store.inspect(&t).await.expect("fine again");
}

async fn dropped_reply_retried_returns_the_first_result() {
    let f = faulty().await;
    let t = target("dropped");
    let keys = TargetKeys::new("tl", &t);
    f.store.health().await.expect("warm connection");
    // The acquire reaches the server and runs; its reply is lost.
    f.proxy.set(Mode::DropReplies);
    let req = acquire_req(&t, "lease-a", "alice", TTL);
    let e = f.store.acquire(&req).await.expect_err("no reply");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let fence: u64 = f
        .admin
        .get(&keys.fence())
        .await
        .expect("the script ran although its reply was lost")
        .parse()
        .expect("fence");
    f.proxy.set(Mode::Pass);
    let retried = acquired(&f.store, &req).await;
    assert_eq!(
        retried.token, fence,
        "the retry must return the first grant"
    );
    let after: Option<String> = f.admin.get(&keys.fence()).await;
    assert_eq!(
        after,
        Some(fence.to_string()),
        "the retry issued another token"
    );

    // The same for a fenced write: the lost commit is not applied twice, and its retry does not
    // overwrite a newer write.
    f.proxy.set(Mode::DropReplies);
    let first = commit_req(&t, retried.token, "first");
    let e = f.store.commit(&first).await.expect_err("no reply");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    f.proxy.set(Mode::Pass);
    f.store
        .commit(&commit_req(&t, retried.token, "second"))
        .await
        .expect("second commit");
    let replayed = f.store.commit(&first).await.expect("retried commit");
    assert_eq!(
        replayed,
        CommitOutcome::Committed {
            token: retried.token
        }
    );
    let stored = f
        .store
        .read_guarded(&t, Slot::ZERO, &guarded("data"))
        .await
        .expect("read")
        .expect("written");
    assert_eq!(stored.value, "second", "the retried commit wrote again");

    // And a release: retried, it reports the first result and leaves the next holder alone.
    f.proxy.set(Mode::DropReplies);
    let release = release_req(handle(&t, "lease-a", "alice", retried.token));
    f.store.release(&release).await.expect_err("no reply");
    f.proxy.set(Mode::Pass);
    let next = acquired(&f.store, &acquire_req(&t, "lease-b", "bob", TTL)).await;
    assert_eq!(
        f.store.release(&release).await.expect("retried"),
        ReleaseOutcome::Released
    );
    let lease = f
        .store
        .inspect(&t)
        .await
        .expect("inspect")
        .lease
        .expect("bob holds");
    assert_eq!((lease.owner.as_str(), lease.token), ("bob", next.token));
}

/// Calls `acquire` (one request id, as a caller retrying one call) until it succeeds.
async fn acquire_until_ok(store: &ValkeyStore, t: &TargetRef) -> Grant {
    let req = acquire_req(t, "lease-r", "restarter", TTL);
    loop {
        match store.acquire(&req).await {
            Ok(AcquireOutcome::Acquired(g)) => return g,
            Ok(other) => panic!("{other:?}"),
            Err(e) => assert!(e.is_transient(), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What a kill and restart left behind.
struct Restarted {
    /// The highest token issued before the kill.
    highest: u64,
    /// The fence the restarted server had (before the store's next call).
    fence_after_restart: Option<u64>,
    /// The first grant after the restart.
    grant: Grant,
}

/// Kills the server, keeps calling while it is down, restarts it and measures how long after
/// it answers again the store succeeds.
async fn kill_and_restart(server: &mut Server, config: ValkeyConfig) -> Restarted {
    let max_delay = config.reconnect_max_delay;
    let store = ValkeyStore::connect(config).await.expect("connect");
    let t = target("restart");
    let mut highest = 0;
    for i in 0..5 {
        let lease = format!("lease-{i}");
        let g = acquired(&store, &acquire_req(&t, &lease, "w", TTL)).await;
        store
            .release(&release_req(handle(&t, &lease, "w", g.token)))
            .await
            .expect("release");
        highest = highest.max(g.token);
    }
    server.kill();
    // Calls while it is down fail quickly, naming the endpoint and the cause.
    let down_until = Instant::now() + Duration::from_secs(3);
    let mut failures = 0;
    while Instant::now() < down_until {
        let (result, took) = timed(store.health()).await;
        let e = result.expect_err("the server is down");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        let text = e.to_string();
        assert!(
            text.contains(&format!("127.0.0.1:{}", server.port)),
            "{text}"
        );
        assert!(
            text.contains("connection refused") || text.contains("connection lost"),
            "{text}"
        );
        assert!(took <= DEADLINE + SLACK, "{took:?}");
        failures += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(failures > 5);
    tokio::task::block_in_place(|| server.restart());
    let fence_after_restart = server
        .raw(&["GET", &TargetKeys::new("tl", &t).fence()])
        .lines()
        .nth(1)
        .and_then(|v| v.parse().ok());
    let up = Instant::now();
    let grant = acquire_until_ok(&store, &t).await;
    let reconnect = up.elapsed();
    measured("server answering again until the store succeeds", reconnect);
    assert!(
        reconnect <= max_delay + DEADLINE,
        "reconnected after {reconnect:?}, the backoff bound is {max_delay:?}"
    );
    Restarted {
        highest,
        fence_after_restart,
        grant,
    }
}

fn restart_config(server: &Server) -> ValkeyConfig {
    let mut config = valkey_config(&server.url());
    config.call_timeout = DEADLINE;
    config.connect_timeout = DEADLINE;
    config.reconnect_min_delay = Duration::from_millis(50);
    config.reconnect_max_delay = Duration::from_secs(1);
    config
}

async fn restart_without_aof_reconnects_and_tokens_grow() {
    let mut server = Server::start(ServerKind::Valkey91);
    let config = restart_config(&server);
    let r = kill_and_restart(&mut server, config).await;
    // The data is gone (no persistence), yet the new token is larger: the server clock floor.
    assert_eq!(r.fence_after_restart, None, "the data should be gone");
    assert!(
        r.grant.token > r.highest,
        "{} <= {}",
        r.grant.token,
        r.highest
    );
}

async fn restart_with_aof_reconnects_and_keeps_the_fence() {
    let mut server = Server::start_with(
        ServerKind::Valkey91,
        &["--appendonly", "yes", "--appendfsync", "always"],
    );
    let config = restart_config(&server);
    let r = kill_and_restart(&mut server, config).await;
    // The fence survived the restart (every write was fsynced), and the next token is larger.
    assert_eq!(r.fence_after_restart, Some(r.highest));
    assert!(
        r.grant.token > r.highest,
        "{} <= {}",
        r.grant.token,
        r.highest
    );
    let admin = Admin::single(&server.url(), None).await;
    let info: String =
        redis::from_redis_value(admin.cmd(&["INFO", "persistence"]).await).expect("info");
    assert!(info.contains("aof_enabled:1"), "{info}");
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let trials = vec![
        trial(
            "faults::stalled_call_fails_at_its_deadline",
            stalled_call_fails_at_its_deadline,
        ),
        trial(
            "faults::calls_succeed_again_once_the_fault_heals",
            calls_succeed_again_once_the_fault_heals,
        ),
        trial(
            "faults::dropped_reply_retried_returns_the_first_result",
            dropped_reply_retried_returns_the_first_result,
        ),
        trial(
            "faults::restart_without_aof_reconnects_and_tokens_grow",
            restart_without_aof_reconnects_and_tokens_grow,
        ),
        trial(
            "faults::restart_with_aof_reconnects_and_keeps_the_fence",
            restart_with_aof_reconnects_and_keeps_the_fence,
        ),
    ];
    suite::run(args, trials)
}
