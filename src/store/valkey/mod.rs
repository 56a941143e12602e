//! The Valkey backend: every state change is one Lua script run with EVALSHA (falling back to
//! EVAL when the server does not know the script yet), all times come from the server, and a
//! small pool of multiplexed connections carries the calls, each under one deadline that
//! includes reconnects and retries. A single server and a Valkey Cluster are driven by the same
//! code: all keys of a target share one hash slot, so every script runs on one node.
//!
//! Retrying inside a call is safe because every script is idempotent: mutating scripts cache
//! their reply under the request id, the others only read.

mod classify;
pub mod config;
mod connect;
mod info;
pub mod keys;
mod open;
mod pool;
pub mod scripts;
mod sentinel;
pub mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use redis::{Cmd, RedisError, RedisResult, Value};
use tokio::time::Instant;
use tracing::{debug, warn};

use self::classify::{breaks_connection, classify};
pub use self::config::{
    ClientCertificate, DEFAULT_CALL_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE,
    DEFAULT_PREFIX, DEFAULT_RECONNECT_MAX_DELAY, DEFAULT_RECONNECT_MIN_DELAY,
    DEFAULT_SENTINEL_POLL_INTERVAL, Durability, Endpoints, HostPort, PasswordSource, Sentinels,
    TlsConfig, ValkeyConfig,
};
use self::connect::{Conn, Connector};
use self::keys::TargetKeys;
use self::open::Opener;
use self::pool::{Backoff, Pool, PrimaryState};
use self::scripts::LuaScript;
use super::Ttl;
use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, ErrorKind,
    GuardedKey, GuardedValue, Inspection, LeaseStore, ReleaseOutcome, ReleaseRequest, RenewOutcome,
    RenewRequest, RepairOutcome, Slot, StoreError, TargetRef, Token, check_token,
};
use crate::time::millis;

/// The Valkey lease store. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct ValkeyStore {
    inner: Arc<Inner>,
}

struct Inner {
    config: ValkeyConfig,
    pool: Pool,
    /// With a durability setting: the connections durable acquires run on. `WAITAOF` blocks
    /// the connection it is sent on until the replicas confirm or it times out (for a whole
    /// call deadline when a replica has just left in a failover); on connections of their own
    /// it holds up no renewal, release or check.
    durable: Option<Pool>,
    backoff: Backoff,
    reply_ttl_ms: String,
    /// Whether the task that follows the sentinels' view of the primary runs.
    following: AtomicBool,
}

impl std::fmt::Debug for ValkeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ValkeyStore")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// What one script call sends: the script, its keys and arguments, as built by [`wire`] (the
/// only place that names them). Public so that benchmarks and tests that send a call
/// themselves (raw, unread, pipelined) send exactly what the store sends.
///
/// The call is encoded once, as `EVALSHA <sha1> <numkeys> KEYS... ARGV...`, straight from the
/// borrowed keys and arguments: the common path sends it as it is; only a server that answers
/// NOSCRIPT gets it re-encoded as `EVAL <source> ...`.
pub struct ScriptCall<'a> {
    /// The script.
    pub script: &'a LuaScript,
    evalsha: Cmd,
    keys: usize,
}

impl<'a> ScriptCall<'a> {
    fn new(script: &'a LuaScript, keys: &[&str], args: &[&str]) -> Self {
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha
            .arg(script.script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        Self {
            script,
            evalsha,
            keys: keys.len(),
        }
    }

    /// `EVALSHA`: the call as it is sent first.
    pub fn evalsha(&self) -> &Cmd {
        &self.evalsha
    }

    /// `EVAL` with the source, for a server that does not know the script (after a restart, a
    /// failover or SCRIPT FLUSH). EVAL goes to the node that owns the keys, which a cluster-wide
    /// SCRIPT LOAD would not do during a failover.
    pub fn eval(&self) -> Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(self.script.source);
        for arg in self.evalsha.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                cmd.arg(bytes);
            }
        }
        cmd
    }

    /// The call's KEYS and ARGV, for tests and benchmarks that inspect or resend it.
    pub fn keys_and_args(&self) -> (Vec<String>, Vec<String>) {
        let mut all: Vec<String> = self
            .evalsha
            .args_iter()
            .skip(3)
            .filter_map(|arg| match arg {
                redis::Arg::Simple(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
                _ => None,
            })
            .collect();
        let args = all.split_off(self.keys.min(all.len()));
        (all, args)
    }
}

fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

impl ValkeyStore {
    /// Prepares a store without connecting; the first call connects. A controller can start
    /// (and report itself not ready) while Valkey is down. Every new connection checks that the
    /// server can provide the configured durability before it carries a call.
    pub fn new_lazy(config: ValkeyConfig) -> Result<Self, StoreError> {
        config.validate()?;
        let reply_ttl_ms = Ttl::new(config.reply_ttl)?.millis().to_string();
        let backoff = Backoff {
            min: config.reconnect_min_delay,
            max: config.reconnect_max_delay,
        };
        // Both pools ask the sentinels in one order and move to a new primary together.
        let order = Arc::new(sentinel::Order::default());
        let primary = Arc::new(PrimaryState::default());
        let pool = |durable_acquires| {
            Pool::new(
                Opener::new(
                    Connector::new(config.clone(), durable_acquires),
                    order.clone(),
                ),
                config.pool_size,
                config.connect_timeout,
                backoff,
                primary.clone(),
            )
        };
        let durable = (!config.durability.is_none()).then(|| pool(true));
        let pool = pool(false);
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                pool,
                durable,
                backoff,
                reply_ttl_ms,
                following: AtomicBool::new(false),
            }),
        })
    }

    /// Prepares a store, checks that Valkey answers and that it can provide the configured
    /// durability (`WAITAOF`, `appendonly yes` for `local`, N replicas online for
    /// `replicas=N`): a server that cannot is refused here, at start-up, rather than at the
    /// first acquire.
    pub async fn connect(config: ValkeyConfig) -> Result<Self, StoreError> {
        let store = Self::new_lazy(config)?;
        // The first connection checks WAITAOF and AOF (see `Connector::connect`); the health
        // check counts the replicas.
        store.health().await?;
        Ok(store)
    }

    fn config(&self) -> &ValkeyConfig {
        &self.inner.config
    }

    fn endpoint(&self) -> &str {
        self.inner.pool.endpoint()
    }

    fn keys(&self, target: &TargetRef) -> TargetKeys {
        TargetKeys::new(&self.config().key_prefix, target)
    }

    /// Sends `request` on a pooled connection under the call deadline. Transient failures
    /// (connection refused or lost, cluster down, failover) are retried on a fresh connection
    /// with backoff while the deadline allows, which is safe because every request is
    /// idempotent: scripts by their request id, the rest are reads.
    async fn call(&self, request: Request<'_>) -> Result<Value, StoreError> {
        self.follow_failovers();
        let pool = match (&request, &self.inner.durable) {
            (Request::DurableScript(..), Some(durable)) => durable,
            _ => &self.inner.pool,
        };
        let limit = self.config().call_timeout;
        let deadline = Instant::now() + limit;
        let mut attempt = 0;
        // The failure of the attempt before, for when the last one had too little time left to
        // say anything but that (a sentinel round cut to a few milliseconds): the one before
        // says why the call failed.
        let mut earlier: Option<StoreError> = None;
        loop {
            attempt += 1;
            let starved = deadline.saturating_duration_since(Instant::now()) < STARVED_ATTEMPT;
            let failure = match pool.checkout(deadline).await {
                Err(e) => e,
                Ok(mut checkout) => {
                    let sent = request.send(&mut checkout.conn, deadline);
                    match tokio::time::timeout_at(deadline, sent).await {
                        Ok(Ok(value)) => return Ok(value),
                        Ok(Err(e)) => {
                            if breaks_connection(&e) {
                                pool.discard(&checkout);
                            }
                            classify(self.endpoint(), &e, limit, false)
                        }
                        Err(_) => {
                            // The connection may be stalled; do not hand it out again.
                            pool.discard(&checkout);
                            return Err(StoreError::Timeout {
                                endpoint: self.endpoint().to_owned(),
                                after_ms: millis(limit),
                            });
                        }
                    }
                }
            };
            // Only `unavailable` is retried here: the request did not run or may run again
            // harmlessly. A timeout has used up the deadline; everything else does not heal.
            let pause = self.inner.backoff.delay(attempt);
            if failure.kind() != ErrorKind::Unavailable || Instant::now() + pause >= deadline {
                return Err(match earlier {
                    Some(earlier) if starved && failure.kind() == ErrorKind::Unavailable => earlier,
                    _ => failure,
                });
            }
            if !starved {
                earlier = Some(failure.clone());
            }
            debug!(endpoint = %self.endpoint(), error = %failure, attempt, "retrying within the call deadline");
            tokio::time::sleep(pause).await;
        }
    }

    /// Through Sentinel, starts (once, at the first call: a runtime is at hand) the task that
    /// asks the sentinels every poll interval whether the primary changed and, if so, drops the
    /// pooled connections to the old one. The task holds the store weakly and ends with it.
    fn follow_failovers(&self) {
        let Endpoints::Sentinel(sentinels) = &self.config().endpoints else {
            return;
        };
        if self.inner.following.swap(true, Ordering::Relaxed) {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        let mut tick = tokio::time::interval(sentinels.poll_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::spawn(async move {
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else {
                    break;
                };
                // The pools share the primary's generation: one poll moves both.
                inner.pool.follow_primary().await;
            }
        });
    }

    /// Runs one script and returns its reply.
    async fn run(&self, call: ScriptCall<'_>) -> Result<String, StoreError> {
        text(self.call(Request::Script(&call)).await?)
    }

    /// Runs the acquire script followed by `WAITAOF` (see [`Request::DurableScript`]) and
    /// refuses to report a grant the server did not confirm durable.
    async fn run_durable(&self, call: ScriptCall<'_>) -> Result<String, StoreError> {
        let durability = self.config().durability;
        let both = self.call(Request::DurableScript(&call, durability)).await?;
        let (value, acks): (Value, Value) = redis::from_redis_value(both).map_err(|_| {
            StoreError::UnexpectedReply("durable acquire: no pair of replies".into())
        })?;
        let reply = text(value)?;
        if reply.starts_with("acquired ") {
            self.confirm(durability, acks)?;
        }
        Ok(reply)
    }

    /// With `replicas=N`, refuses a server whose primary (on a cluster: any primary) has fewer
    /// than N replicas online: every acquire would run there and then wait in vain until its
    /// deadline (`not_durable`). Counted from `INFO replication`, which blocks nothing; the
    /// WAITAOF probe of a new connection cannot count them without blocking that connection
    /// for its timeout. Whether a replica runs with `appendonly yes` is not visible from its
    /// primary: one without it still fails the first acquire.
    async fn check_replicas(&self) -> Result<(), StoreError> {
        let durability = self.config().durability;
        let wanted = usize::try_from(durability.replicas).unwrap_or(usize::MAX);
        if wanted == 0 {
            return Ok(());
        }
        let mut info = redis::cmd("INFO");
        info.arg("replication");
        let reply = self.call(Request::Command(&info)).await?;
        // A replica in the URL answers role:slave: its writes are refused elsewhere.
        let fewest = info::texts(&reply)
            .iter()
            .filter(|text| info::role(text) == Some("master"))
            .map(|text| info::online_replicas(text))
            .min();
        let primary = match &self.config().endpoints {
            Endpoints::Single(_) => "the primary at",
            Endpoints::Cluster(_) => "a primary of",
            Endpoints::Sentinel(_) => "the primary named by",
        };
        match fewest {
            // Through Sentinel a replica may be resyncing after a failover: that passes.
            Some(online)
                if online < wanted && matches!(self.config().endpoints, Endpoints::Sentinel(_)) =>
            {
                Err(StoreError::Unavailable {
                    endpoint: self.endpoint().to_owned(),
                    cause: format!(
                        "durability {durability} needs {wanted} replica(s) online, and {primary} \
                         {} has {online} online (INFO replication); a replica resyncing after a \
                         failover?",
                        self.endpoint()
                    ),
                })
            }
            Some(online) if online < wanted => Err(StoreError::InvalidConfig(format!(
                "durability {durability} needs {wanted} replica(s) online, and {primary} {} has \
                 {online} online (INFO replication): every acquire would run and then fail \
                 not_durable at its deadline; start or reconnect the replicas, or lower \
                 --valkey-durability",
                self.endpoint()
            ))),
            _ => Ok(()),
        }
    }

    /// Checks WAITAOF's answer `[local fsyncs, replica fsyncs]` against what was asked.
    fn confirm(&self, durability: Durability, acks: Value) -> Result<(), StoreError> {
        let (local, replicas): (i64, i64) = redis::from_redis_value(acks).map_err(|_| {
            StoreError::UnexpectedReply("WAITAOF did not answer two integers".into())
        })?;
        let (want_local, want_replicas) =
            (i64::from(durability.local), i64::from(durability.replicas));
        if local >= want_local && replicas >= want_replicas {
            return Ok(());
        }
        Err(StoreError::NotDurable {
            endpoint: self.endpoint().to_owned(),
            after_ms: millis(self.config().call_timeout),
            detail: format!(
                "asked for {durability}; AOF fsync confirmed on the primary: {local} of \
                 {want_local}, on replicas: {replicas} of {want_replicas}"
            ),
        })
    }
}

/// What one call sends on one connection.
enum Request<'a> {
    /// One script.
    Script(&'a ScriptCall<'a>),
    /// The acquire script and, on the same connection and in the same round trip, `WAITAOF`.
    /// WAITAOF waits for every write this connection made so far; acquire.lua writes on every
    /// path that answers `acquired` (a retry answered from the reply cache too), so the wait
    /// always covers the grant it answers. Answers `[script reply, WAITAOF reply]`.
    DurableScript(&'a ScriptCall<'a>, Durability),
    /// A plain command (PING).
    Command(&'a Cmd),
}

impl Request<'_> {
    async fn send(&self, conn: &mut Conn, deadline: Instant) -> RedisResult<Value> {
        match self {
            Request::Command(cmd) => cmd.query_async(conn).await,
            Request::Script(call) => match call.evalsha().query_async(conn).await {
                Err(e) if is_noscript(&e) => call.eval().query_async(conn).await,
                other => other,
            },
            Request::DurableScript(call, durability) => {
                let mut by_source = false;
                loop {
                    let mut pipe = redis::pipe();
                    let script = if by_source {
                        call.eval()
                    } else {
                        call.evalsha().clone()
                    };
                    pipe.add_command(script)
                        .add_command(waitaof(*durability, deadline))
                        .ignore_errors();
                    let mut replies: Vec<RedisResult<Value>> = pipe.query_async(conn).await?;
                    let (Some(wait), Some(script)) = (replies.pop(), replies.pop()) else {
                        return Err(RedisError::from((
                            redis::ErrorKind::UnexpectedReturnType,
                            "a pipeline of two commands did not answer twice",
                        )));
                    };
                    match script {
                        Err(e) if is_noscript(&e) && !by_source => by_source = true,
                        script => return Ok(Value::Array(vec![script?, wait?])),
                    }
                }
            }
        }
    }
}

/// An attempt that starts with less than this left before the call's deadline is too short to
/// tell why the call fails (see `call`).
const STARVED_ATTEMPT: std::time::Duration = std::time::Duration::from_millis(100);

/// How much of what is left of a call's deadline `WAITAOF` leaves for its reply to arrive: a
/// tenth, and at least this much (a retry late in the deadline has little time left, and a
/// tenth of it is no margin on a loaded machine).
const WAITAOF_REPLY_MARGIN: std::time::Duration = std::time::Duration::from_millis(100);

/// `WAITAOF numlocal numreplicas timeout`, the timeout leaving room for the reply to arrive
/// before the call deadline.
fn waitaof(durability: Durability, deadline: Instant) -> Cmd {
    let left = deadline.saturating_duration_since(Instant::now());
    let margin = (left / 10).max(WAITAOF_REPLY_MARGIN);
    let wait_ms = millis(left.saturating_sub(margin));
    let mut cmd = redis::cmd("WAITAOF");
    cmd.arg(i64::from(durability.local))
        .arg(durability.replicas)
        .arg(wait_ms.max(1));
    cmd
}

/// A script reply as text; scripts only ever answer one string (see `wire`).
fn text(value: Value) -> Result<String, StoreError> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes)
            .map_err(|_| StoreError::UnexpectedReply("reply is not UTF-8".into())),
        Value::SimpleString(s) => Ok(s),
        _ => Err(StoreError::UnexpectedReply(
            "script did not answer a string".into(),
        )),
    }
}

/// Logs a failed call once, with the target but without any secret.
fn logged<T>(op: &str, target: &TargetRef, result: Result<T, StoreError>) -> Result<T, StoreError> {
    if let Err(e) = &result {
        warn!(op, %target, kind = e.kind().as_str(), error = %e, "lease store call failed");
    }
    result
}

#[async_trait]
impl LeaseStore for ValkeyStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome, StoreError> {
        let ttl_ms = req.ttl.millis().to_string();
        check_token("min_token", req.min_token, false)?;
        let call = wire::acquire_call(
            &self.keys(&req.target),
            req,
            &ttl_ms,
            &self.inner.reply_ttl_ms,
        );
        let result = if self.config().durability.is_none() {
            self.run(call).await
        } else {
            self.run_durable(call).await
        }
        .and_then(|r| wire::acquire(&r, req.permits));
        debug!(target = %req.target, lease = %req.lease_id, ?result, "acquire");
        logged("acquire", &req.target, result)
    }

    async fn renew(&self, req: &RenewRequest) -> Result<RenewOutcome, StoreError> {
        let ttl_ms = req.ttl.millis().to_string();
        let lease = &req.lease;
        lease.permits.check_slot(lease.slot)?;
        let keys = self.keys(&lease.target);
        let result = self
            .run(wire::renew_call(
                &keys,
                req,
                &ttl_ms,
                &self.inner.reply_ttl_ms,
            ))
            .await
            .and_then(|r| wire::renew(&r));
        debug!(target = %lease.target, lease = %lease.lease_id, ?result, "renew");
        logged("renew", &lease.target, result)
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
        let lease = &req.lease;
        lease.permits.check_slot(lease.slot)?;
        let keys = self.keys(&lease.target);
        let result = self
            .run(wire::release_call(&keys, req, &self.inner.reply_ttl_ms))
            .await
            .and_then(|r| wire::release(&r));
        debug!(target = %lease.target, lease = %lease.lease_id, ?result, "release");
        logged("release", &lease.target, result)
    }

    async fn commit(&self, req: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        check_token("sequence", req.sequence, false)?;
        let keys = self.keys(&req.target);
        let result = self
            .run(wire::commit_call(&keys, req, &self.inner.reply_ttl_ms))
            .await
            .and_then(|r| wire::commit(&r));
        debug!(target = %req.target, token = req.token.get(), ?result, "commit");
        logged("commit", &req.target, result)
    }

    async fn read_guarded(
        &self,
        target: &TargetRef,
        slot: Slot,
        key: &GuardedKey,
    ) -> Result<Option<GuardedValue>, StoreError> {
        let keys = self.keys(target);
        let result = self
            .run(wire::read_call(&keys, slot, key))
            .await
            .and_then(|r| wire::read(&r));
        logged("read", target, result)
    }

    async fn check(
        &self,
        target: &TargetRef,
        slot: Slot,
        token: Token,
    ) -> Result<CheckOutcome, StoreError> {
        let keys = self.keys(target);
        let result = self
            .run(wire::check_call(&keys, slot, token))
            .await
            .and_then(|r| wire::check(&r));
        logged("check", target, result)
    }

    async fn inspect(&self, target: &TargetRef) -> Result<Inspection, StoreError> {
        let keys = self.keys(target);
        let mut result = self
            .run(wire::inspect_call(&keys, false))
            .await
            .and_then(|r| wire::inspect(&r));
        if let Ok(None) = result {
            // Permits were granted on the target: every slot is read.
            result = self
                .run(wire::inspect_call(&keys, true))
                .await
                .and_then(|r| wire::inspect(&r));
        }
        let result = result.and_then(|seen| {
            seen.ok_or_else(|| {
                StoreError::UnexpectedReply("inspect of every slot answered more".into())
            })
        });
        logged("inspect", target, result)
    }

    async fn repair(&self, target: &TargetRef, floor: u64) -> Result<RepairOutcome, StoreError> {
        check_token("floor", floor, false)?;
        let keys = self.keys(target);
        let result = self
            .run(wire::repair_call(&keys, floor))
            .await
            .and_then(|r| wire::repair(&r));
        warn!(%target, ?result, "repair");
        logged("repair", target, result)
    }

    /// `PING` under the call deadline (on a cluster: every primary), through the pool, so a
    /// readiness probe also drives reconnects; with `replicas=N`, the replicas online too (the
    /// controller's `/readyz`, and every CLI command at start-up).
    async fn health(&self) -> Result<(), StoreError> {
        let pong = self.call(Request::Command(&redis::cmd("PING"))).await?;
        if !redis::from_redis_value::<String>(pong.clone()).is_ok_and(|p| p == "PONG") {
            return Err(StoreError::UnexpectedReply(format!(
                "PING answered {pong:?}"
            )));
        }
        self.check_replicas().await
    }
}
