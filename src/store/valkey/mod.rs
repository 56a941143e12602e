//! The Valkey backend: every state change is one Lua script run with EVALSHA (reloaded
//! transparently on NOSCRIPT), all times come from the server, and a multiplexed connection with
//! automatic reconnect carries the calls, each under a deadline.

pub mod keys;
pub mod reply;
pub mod scripts;

use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind as RedisErrorKind, RedisError, ServerErrorKind, Value};
use tracing::{debug, warn};

use self::keys::{TargetKeys, check_prefix};
use self::scripts::SCRIPTS;
use super::memory::DEFAULT_REPLY_TTL;
use super::types::{check_guarded_key, check_owner, ttl_millis};
use super::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, GuardedValue,
    Inspection, LeaseStore, ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, StoreError,
    TargetRef,
};
use crate::redact::SecretUrl;

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "tl";

/// How to reach Valkey and how long to wait for it.
#[derive(Clone, Debug)]
pub struct ValkeyConfig {
    /// `redis://`, `rediss://`, `valkey://` or `valkeys://` URL; may hold credentials.
    pub url: SecretUrl,
    /// Prefix of every key (default `tl`).
    pub key_prefix: String,
    /// Deadline for establishing a connection.
    pub connect_timeout: Duration,
    /// Deadline for one call, including any reconnect it waits for.
    pub call_timeout: Duration,
    /// How long a reply stays cached for retries with the same request id.
    pub reply_ttl: Duration,
}

impl ValkeyConfig {
    /// Defaults for everything but the URL: prefix `tl`, 2 s to connect, 2 s per call, replies
    /// cached for 60 s.
    pub fn new(url: SecretUrl) -> Self {
        Self {
            url,
            key_prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(2),
            reply_ttl: DEFAULT_REPLY_TTL,
        }
    }
}

/// The Valkey lease store. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct ValkeyStore {
    connection: ConnectionManager,
    config: ValkeyConfig,
    reply_ttl_ms: u64,
}

impl std::fmt::Debug for ValkeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ValkeyStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl ValkeyStore {
    /// Prepares a store without connecting; the first call connects. A controller can start
    /// (and report itself not ready) while Valkey is down.
    pub fn new_lazy(config: ValkeyConfig) -> Result<Self, StoreError> {
        check_prefix(&config.key_prefix)?;
        let reply_ttl_ms = ttl_millis(config.reply_ttl)?;
        let endpoint = config.url.endpoint().to_owned();
        let client = redis::Client::open(config.url.expose())
            .map_err(|e| classify(&endpoint, config.call_timeout, e))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.call_timeout))
            .set_number_of_retries(3)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(2));
        let connection = ConnectionManager::new_lazy_with_config(client, manager_config)
            .map_err(|e| classify(&endpoint, config.call_timeout, e))?;
        Ok(Self {
            connection,
            config,
            reply_ttl_ms,
        })
    }

    /// Prepares a store and checks that Valkey answers.
    pub async fn connect(config: ValkeyConfig) -> Result<Self, StoreError> {
        let store = Self::new_lazy(config)?;
        store.health().await?;
        Ok(store)
    }

    fn keys(&self, target: &TargetRef) -> TargetKeys {
        TargetKeys::new(&self.config.key_prefix, target)
    }

    fn endpoint(&self) -> &str {
        self.config.url.endpoint()
    }

    /// Runs `call` under the call deadline and maps any failure to a [`StoreError`].
    async fn deadline<T>(
        &self,
        call: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        let limit = self.config.call_timeout;
        match tokio::time::timeout(limit, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(classify(self.endpoint(), limit, e)),
            Err(_) => Err(StoreError::Timeout {
                endpoint: self.endpoint().to_owned(),
                after_ms: millis(limit),
            }),
        }
    }

    /// Runs one script and returns its reply as strings.
    async fn run(
        &self,
        script: &redis::Script,
        keys: &[String],
        args: &[&str],
    ) -> Result<Vec<String>, StoreError> {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let mut connection = self.connection.clone();
        let value: Value = self
            .deadline(invocation.invoke_async(&mut connection))
            .await?;
        strings(value)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Flattens a script reply into strings; scripts only ever answer arrays of strings.
fn strings(value: Value) -> Result<Vec<String>, StoreError> {
    let Value::Array(items) = value else {
        return Err(StoreError::UnexpectedReply(
            "script did not answer an array".into(),
        ));
    };
    items
        .into_iter()
        .map(|item| match item {
            Value::BulkString(bytes) => String::from_utf8(bytes)
                .map_err(|_| StoreError::UnexpectedReply("reply is not UTF-8".into())),
            Value::SimpleString(s) => Ok(s),
            Value::Int(n) => Ok(n.to_string()),
            _ => Err(StoreError::UnexpectedReply(
                "reply element is not a string".into(),
            )),
        })
        .collect()
}

/// Maps a client error to a [`StoreError`] that names the endpoint and the cause.
fn classify(endpoint: &str, limit: Duration, e: RedisError) -> StoreError {
    let endpoint = endpoint.to_owned();
    let detail = e.detail().unwrap_or_default().to_owned();
    match (e.kind(), e.code()) {
        (_, Some("TLCORRUPT")) => StoreError::Corrupt { detail },
        (_, Some("TLINVALID")) => StoreError::InvalidRequest(detail),
        (RedisErrorKind::AuthenticationFailed, _)
        | (RedisErrorKind::Server(ServerErrorKind::NoPerm), _)
        | (_, Some("WRONGPASS" | "NOAUTH" | "NOPERM")) => StoreError::AccessDenied {
            endpoint,
            cause: e.to_string(),
        },
        _ if e.is_timeout() => StoreError::Timeout {
            endpoint,
            after_ms: millis(limit),
        },
        (RedisErrorKind::Parse | RedisErrorKind::UnexpectedReturnType, _) => {
            StoreError::UnexpectedReply(e.to_string())
        }
        _ => StoreError::Unavailable {
            endpoint,
            cause: e.to_string(),
        },
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
        let ttl_ms = ttl_millis(req.ttl)?.to_string();
        check_owner(&req.owner)?;
        let keys = self.keys(&req.target);
        let result = self
            .run(
                &SCRIPTS.acquire.script,
                &[keys.lease(), keys.fence(), keys.reply(&req.request_id)],
                &[
                    req.lease_id.expose(),
                    &req.owner,
                    &ttl_ms,
                    &req.min_token.to_string(),
                    &self.reply_ttl_ms.to_string(),
                ],
            )
            .await
            .and_then(|r| reply::acquire(&r));
        debug!(target = %req.target, lease = %req.lease_id, ?result, "acquire");
        logged("acquire", &req.target, result)
    }

    async fn renew(&self, req: &RenewRequest) -> Result<RenewOutcome, StoreError> {
        let ttl_ms = ttl_millis(req.ttl)?.to_string();
        let lease = &req.lease;
        let keys = self.keys(&lease.target);
        let result = self
            .run(
                &SCRIPTS.renew.script,
                &[keys.lease(), keys.reply(&req.request_id)],
                &[
                    lease.lease_id.expose(),
                    &lease.owner,
                    &lease.token.to_string(),
                    &ttl_ms,
                    &self.reply_ttl_ms.to_string(),
                ],
            )
            .await
            .and_then(|r| reply::renew(&r));
        debug!(target = %lease.target, lease = %lease.lease_id, ?result, "renew");
        logged("renew", &lease.target, result)
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<ReleaseOutcome, StoreError> {
        let lease = &req.lease;
        let keys = self.keys(&lease.target);
        let result = self
            .run(
                &SCRIPTS.release.script,
                &[keys.lease(), keys.reply(&req.request_id)],
                &[
                    lease.lease_id.expose(),
                    &lease.owner,
                    &lease.token.to_string(),
                    &self.reply_ttl_ms.to_string(),
                ],
            )
            .await
            .and_then(|r| reply::release(&r));
        debug!(target = %lease.target, lease = %lease.lease_id, ?result, "release");
        logged("release", &lease.target, result)
    }

    async fn commit(&self, req: &CommitRequest) -> Result<CommitOutcome, StoreError> {
        check_guarded_key(&req.key)?;
        let keys = self.keys(&req.target);
        let result = self
            .run(
                &SCRIPTS.commit.script,
                &[
                    keys.fence(),
                    keys.guarded(&req.key),
                    keys.reply(&req.request_id),
                ],
                &[
                    &req.token.to_string(),
                    &req.value,
                    &self.reply_ttl_ms.to_string(),
                ],
            )
            .await
            .and_then(|r| reply::commit(&r));
        debug!(target = %req.target, token = req.token, ?result, "commit");
        logged("commit", &req.target, result)
    }

    async fn read_guarded(
        &self,
        target: &TargetRef,
        key: &str,
    ) -> Result<Option<GuardedValue>, StoreError> {
        check_guarded_key(key)?;
        let keys = self.keys(target);
        let result = self
            .run(&SCRIPTS.read.script, &[keys.guarded(key)], &[])
            .await
            .and_then(|r| reply::read(&r));
        logged("read", target, result)
    }

    async fn check(&self, target: &TargetRef, token: u64) -> Result<CheckOutcome, StoreError> {
        let keys = self.keys(target);
        let result = self
            .run(
                &SCRIPTS.check.script,
                &[keys.fence()],
                &[&token.to_string()],
            )
            .await
            .and_then(|r| reply::check(&r));
        logged("check", target, result)
    }

    async fn inspect(&self, target: &TargetRef) -> Result<Inspection, StoreError> {
        let keys = self.keys(target);
        let result = self
            .run(&SCRIPTS.inspect.script, &[keys.lease(), keys.fence()], &[])
            .await
            .and_then(|r| reply::inspect(&r));
        logged("inspect", target, result)
    }

    async fn health(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        let pong: String = self
            .deadline(redis::cmd("PING").query_async(&mut connection))
            .await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(StoreError::UnexpectedReply(format!(
                "PING answered {pong:?}"
            )))
        }
    }
}
