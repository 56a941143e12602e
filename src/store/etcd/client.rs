//! The one place that talks to etcd: its gRPC API (served by every member on its client port),
//! over HTTP/2, with TLS when the endpoint says `https://`. Three operations only: read keys,
//! write keys if others still hold what was read (one transaction), and grant an etcd lease. A
//! call goes to the member that answered last and moves on to the next one when a member is
//! unreachable, hangs (each is given a share of the deadline) or has no leader, until its
//! deadline; an expired auth token is renewed once. Failures come back as [`StoreError`]s that
//! name the member, never a password.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::HeaderMap;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::{Instant, sleep, timeout_at};

use super::config::EtcdConfig;
use super::proto::{
    self, AuthenticateRequest, AuthenticateResponse, Compare, CompareWith, LeaseGrantRequest,
    LeaseGrantResponse, PutRequest, RangeRequest, Request, RequestOp, Response, TxnRequest,
    TxnResponse,
};
use super::tls;
use crate::redact::{Secret, SecretUrl};
use crate::store::StoreError;
use crate::store::valkey::PasswordSource;

/// How long to wait before trying the members again after every one failed.
const ROUND_PAUSE: Duration = Duration::from_millis(50);

/// The least time one member is given, however many are left to ask.
const MIN_ATTEMPT: Duration = Duration::from_millis(200);

/// The largest answer read (a target's record and a reply are a few KiB; etcd's own request
/// limit is 1.5 MiB).
const MAX_REPLY_BYTES: usize = 8 * 1024 * 1024;

/// A key's value as read (no `Debug`: a value may hold lease ids).
#[derive(Clone)]
pub(crate) struct Kv {
    pub(crate) value: Vec<u8>,
}

/// What a conditional write did.
pub(crate) enum Swapped {
    /// Written (or, with nothing to write, found as expected).
    Done,
    /// Not written: a key changed since it was read; this is how the expected keys are now, in
    /// their order.
    Changed(Vec<Option<Kv>>),
}

/// A key a transaction expects to hold a value (`None`: to be absent).
pub(crate) struct Expect<'a> {
    pub(crate) key: &'a str,
    pub(crate) value: Option<&'a [u8]>,
}

/// A key a transaction writes, attached to an etcd lease or not.
pub(crate) struct Put<'a> {
    pub(crate) key: &'a str,
    pub(crate) value: &'a [u8],
    pub(crate) lease: Option<i64>,
}

/// A client of the members' gRPC API.
pub(crate) struct Members {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// The TLS settings the connections use, for [`tls::refusal`].
    tls: Arc<rustls::ClientConfig>,
    endpoints: Vec<SecretUrl>,
    /// The member that answered last: calls start there.
    preferred: AtomicUsize,
    credentials: Option<(String, PasswordSource)>,
    /// The auth token of `credentials`, once authenticated.
    token: Mutex<Option<Secret>>,
    call_timeout: Duration,
}

/// Why one attempt on one member failed.
enum Failed {
    /// Try another member (unreachable, no leader, a timeout on its side).
    Elsewhere(StoreError),
    /// The auth token expired or was revoked: authenticate again.
    Reauthenticate,
    /// No member will answer otherwise (refused access, a bad request, TLS).
    Final(StoreError),
}

impl Members {
    pub(crate) fn new(config: &EtcdConfig) -> Result<Self, StoreError> {
        let tls = Arc::new(tls::client_config(config)?);
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(config.connect_timeout));
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_or_http()
            .enable_http2()
            .wrap_connector(http);
        // One HTTP/2 connection per member, calls multiplexed on it (without TLS, HTTP/2 from
        // the first byte, as gRPC clients speak to etcd). Pings find a connection that went
        // dead without a word (a partition that drops packets) so the next call opens another.
        let http = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .http2_keep_alive_interval(Duration::from_secs(10))
            .http2_keep_alive_timeout(Duration::from_secs(5))
            .http2_keep_alive_while_idle(true)
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            http,
            tls,
            endpoints: config.endpoints.clone(),
            preferred: AtomicUsize::new(0),
            credentials: config.username.clone().zip(config.password.clone()),
            token: Mutex::new(None),
            call_timeout: config.call_timeout,
        })
    }

    /// The member calls start at, for messages.
    pub(crate) fn endpoint(&self) -> String {
        let i = self.preferred.load(Ordering::Relaxed) % self.endpoints.len().max(1);
        self.endpoints
            .get(i)
            .map_or_else(String::new, |u| u.endpoint().to_owned())
    }

    /// Reads `keys` at one revision (linearizable reads: they reflect every write
    /// acknowledged before them).
    pub(crate) async fn get(
        &self,
        keys: &[&str],
        deadline: Instant,
    ) -> Result<Vec<Option<Kv>>, StoreError> {
        let txn = TxnRequest {
            success: ranges(keys),
            ..TxnRequest::default()
        };
        let reply: TxnResponse = self.call(proto::TXN, &txn, deadline).await?;
        read_back(reply, keys.len())
    }

    /// Writes `puts` if every key of `expect` still holds what it expects; otherwise answers
    /// how those keys are now, read in the same transaction. Without puts, only confirms them
    /// (a linearizable read that sends nothing back when nothing changed).
    ///
    /// Values are compared, not the keys' revisions: a revision can come back with other
    /// contents after a restore of a snapshot without `--bump-revision`; a value cannot be the
    /// same and mean another state.
    pub(crate) async fn swap(
        &self,
        expect: &[Expect<'_>],
        puts: &[Put<'_>],
        deadline: Instant,
    ) -> Result<Swapped, StoreError> {
        let compare = expect
            .iter()
            .map(|e| match e.value {
                Some(held) => Compare {
                    result: 0,
                    target: proto::TARGET_VALUE,
                    key: e.key.as_bytes().to_vec(),
                    with: Some(CompareWith::Value(held.to_vec())),
                },
                None => Compare {
                    result: 0,
                    target: proto::TARGET_CREATE,
                    key: e.key.as_bytes().to_vec(),
                    with: Some(CompareWith::CreateRevision(0)),
                },
            })
            .collect();
        let success = puts
            .iter()
            .map(|p| RequestOp {
                request: Some(Request::Put(PutRequest {
                    key: p.key.as_bytes().to_vec(),
                    value: p.value.to_vec(),
                    lease: p.lease.unwrap_or(0),
                })),
            })
            .collect();
        let keys: Vec<&str> = expect.iter().map(|e| e.key).collect();
        let txn = TxnRequest {
            compare,
            success,
            failure: ranges(&keys),
        };
        let reply: TxnResponse = self.call(proto::TXN, &txn, deadline).await?;
        if reply.succeeded {
            return Ok(Swapped::Done);
        }
        Ok(Swapped::Changed(read_back(reply, keys.len())?))
    }

    /// Grants an etcd lease of `ttl_seconds`: what the keys attached to it are deleted with.
    pub(crate) async fn grant_lease(
        &self,
        ttl_seconds: i64,
        deadline: Instant,
    ) -> Result<i64, StoreError> {
        let request = LeaseGrantRequest { ttl: ttl_seconds };
        let reply: LeaseGrantResponse = self.call(proto::LEASE_GRANT, &request, deadline).await?;
        if !reply.error.is_empty() || reply.id == 0 {
            return Err(unexpected(&format!(
                "a lease grant without an id ({})",
                reply.error
            )));
        }
        Ok(reply.id)
    }

    /// One call: each member in turn from the preferred one, in rounds until `deadline`.
    async fn call<M: prost::Message + Default>(
        &self,
        path: &str,
        request: &impl prost::Message,
        deadline: Instant,
    ) -> Result<M, StoreError> {
        let body = Bytes::from(proto::frame(request));
        let count = self.endpoints.len().max(1);
        let mut member = self.preferred.load(Ordering::Relaxed);
        let (mut tried, mut reauthenticated) = (0, false);
        let mut last: Option<StoreError>;
        loop {
            let Some(url) = self.endpoints.get(member % count) else {
                return Err(StoreError::InvalidConfig("no etcd endpoint".into()));
            };
            // One member gets a share of what is left, so that a member that hangs (stopped,
            // or behind a partition that drops packets) leaves time to ask the next one.
            let left = deadline.saturating_duration_since(Instant::now());
            let share = (left / u32::try_from(count - tried % count).unwrap_or(1))
                .max(MIN_ATTEMPT)
                .min(left);
            let attempt = Instant::now() + share;
            match self.attempt(url, path, body.clone(), attempt).await {
                Ok(reply) => {
                    self.preferred.store(member % count, Ordering::Relaxed);
                    return Ok(reply);
                }
                Err(Failed::Final(e)) => return Err(e),
                Err(Failed::Reauthenticate) if !reauthenticated => {
                    reauthenticated = true;
                    self.forget_token();
                    continue;
                }
                Err(Failed::Reauthenticate) => {
                    return Err(StoreError::AccessDenied {
                        endpoint: url.endpoint().to_owned(),
                        cause: "etcd refused a fresh auth token".into(),
                    });
                }
                Err(Failed::Elsewhere(e)) => {
                    // The next call starts at the next member, not at this one again.
                    let _ = self.preferred.compare_exchange(
                        member % count,
                        (member + 1) % count,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                    last = Some(e);
                }
            }
            member += 1;
            tried += 1;
            let pause = if tried % count == 0 {
                ROUND_PAUSE
            } else {
                Duration::ZERO
            };
            if Instant::now() + pause >= deadline {
                return Err(last.unwrap_or_else(|| self.timed_out()));
            }
            sleep(pause).await;
        }
    }

    fn timed_out(&self) -> StoreError {
        StoreError::Timeout {
            endpoint: self.endpoint(),
            after_ms: u64::try_from(self.call_timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }

    fn forget_token(&self) {
        if let Ok(mut token) = self.token.lock() {
            *token = None;
        }
    }

    /// The auth token, authenticating first when there is none.
    async fn auth_token(
        &self,
        url: &SecretUrl,
        deadline: Instant,
    ) -> Result<Option<Secret>, Failed> {
        let Some((user, password)) = &self.credentials else {
            return Ok(None);
        };
        if let Some(token) = self.token.lock().ok().and_then(|t| t.clone()) {
            return Ok(Some(token));
        }
        let password = password.load().map_err(Failed::Final)?;
        let request = AuthenticateRequest {
            name: user.clone(),
            password: password.expose().to_owned(),
        };
        let reply: AuthenticateResponse = self
            .send(
                url,
                proto::AUTHENTICATE,
                Bytes::from(proto::frame(&request)),
                None,
                deadline,
            )
            .await
            .map_err(|failed| match failed {
                // A refused password is final, never "expired token".
                Failed::Reauthenticate => Failed::Final(StoreError::AccessDenied {
                    endpoint: url.endpoint().to_owned(),
                    cause: "etcd refused the user name or password".into(),
                }),
                other => other,
            })?;
        if reply.token.is_empty() {
            return Err(Failed::Final(unexpected(
                "an authentication without a token",
            )));
        }
        let token = Secret::new(&reply.token);
        if let Ok(mut cached) = self.token.lock() {
            *cached = Some(token.clone());
        }
        Ok(Some(token))
    }

    async fn attempt<M: prost::Message + Default>(
        &self,
        url: &SecretUrl,
        path: &str,
        body: Bytes,
        deadline: Instant,
    ) -> Result<M, Failed> {
        let token = self.auth_token(url, deadline).await?;
        self.send(url, path, body, token.as_ref(), deadline).await
    }

    /// One gRPC call to one member: its answer, or why it failed (`grpc-status`, in the
    /// headers of an answer without a body or in the trailers after it).
    async fn send<M: prost::Message + Default>(
        &self,
        url: &SecretUrl,
        path: &str,
        body: Bytes,
        token: Option<&Secret>,
        deadline: Instant,
    ) -> Result<M, Failed> {
        let endpoint = url.endpoint().to_owned();
        let uri = format!("{}{path}", url.expose().trim_end_matches('/'));
        let mut request = hyper::Request::post(uri)
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        if let Some(token) = token {
            request = request.header("token", token.expose());
        }
        let request = request.body(Full::new(body)).map_err(|e| {
            Failed::Final(StoreError::InvalidConfig(format!(
                "etcd endpoint {url}: {e}"
            )))
        })?;
        let exchange = async {
            let response = match self.http.request(request).await {
                Ok(response) => response,
                Err(e) => {
                    return Err(match tls::refusal(&self.tls, url).await {
                        Some(tls) => Failed::Final(StoreError::Tls {
                            endpoint: endpoint.clone(),
                            cause: tls.to_string(),
                        }),
                        None => transport(&endpoint, &e),
                    });
                }
            };
            let (head, body) = response.into_parts();
            let collected = http_body_util::Limited::new(body, MAX_REPLY_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    Failed::Elsewhere(StoreError::UnexpectedReply(format!(
                        "etcd at {endpoint}: the answer could not be read ({e})"
                    )))
                })?;
            let trailers = collected.trailers().cloned();
            Ok::<_, Failed>((head, trailers, collected.to_bytes()))
        };
        let (head, trailers, bytes) = match timeout_at(deadline, exchange).await {
            Err(_) => {
                return Err(Failed::Elsewhere(StoreError::Timeout {
                    endpoint,
                    after_ms: u64::try_from(self.call_timeout.as_millis()).unwrap_or(u64::MAX),
                }));
            }
            Ok(Err(failed)) => return Err(failed),
            Ok(Ok(reply)) => reply,
        };
        if !head.status.is_success() {
            // Not a gRPC answer: something else listens there, or a proxy refused.
            return Err(Failed::Elsewhere(StoreError::Unavailable {
                endpoint,
                cause: format!("answered HTTP {} instead of gRPC", head.status),
            }));
        }
        let status = trailers
            .as_ref()
            .and_then(grpc_status)
            .or_else(|| grpc_status(&head.headers));
        match status {
            Some((0, _)) => proto::unframe(&bytes).ok_or_else(|| {
                Failed::Elsewhere(StoreError::UnexpectedReply(format!(
                    "etcd at {endpoint} answered with something other than the message asked for"
                )))
            }),
            Some((code, message)) => Err(refused(&endpoint, code, message)),
            None => Err(Failed::Elsewhere(StoreError::Unavailable {
                endpoint,
                cause: "the answer ended without a gRPC status".into(),
            })),
        }
    }
}

/// `grpc-status` and `grpc-message` (percent-decoded) of headers or trailers, if there.
fn grpc_status(headers: &HeaderMap) -> Option<(i64, String)> {
    let code = headers.get("grpc-status")?.to_str().ok()?.parse().ok()?;
    let message = headers
        .get("grpc-message")
        .map(|m| percent_decode(m.as_bytes()))
        .unwrap_or_default();
    Some((code, message))
}

/// gRPC's percent-encoding of a status message (`%XX` for bytes outside printable ASCII and
/// `%` itself).
fn percent_decode(text: &[u8]) -> String {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let hex = text
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (text[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Range requests of `keys`, one each.
fn ranges(keys: &[&str]) -> Vec<RequestOp> {
    keys.iter()
        .map(|k| RequestOp {
            request: Some(Request::Range(RangeRequest {
                key: k.as_bytes().to_vec(),
            })),
        })
        .collect()
}

/// The `count` ranges a transaction read, in order (the branch it took holds only ranges):
/// the first key-value of each, if any.
fn read_back(reply: TxnResponse, count: usize) -> Result<Vec<Option<Kv>>, StoreError> {
    if reply.responses.len() != count {
        return Err(unexpected("a transaction with another number of reads"));
    }
    reply
        .responses
        .into_iter()
        .map(|r| match r.response {
            Some(Response::Range(range)) => Ok(range
                .kvs
                .into_iter()
                .next()
                .map(|kv| Kv { value: kv.value })),
            _ => Err(unexpected("a read that is not a range")),
        })
        .collect()
}

fn unexpected(what: &str) -> StoreError {
    StoreError::UnexpectedReply(format!("etcd answered {what}"))
}

/// A request that never got its answer: a TLS failure is final, the rest is for another member.
fn transport(endpoint: &str, error: &(dyn std::error::Error + 'static)) -> Failed {
    let mut causes = Vec::new();
    // rustls's error arrives wrapped in I/O errors (by tokio-rustls, then hyper-rustls), whose
    // `source` skips the error they wrap: each wrapped error is looked into as well.
    let mut pending: Vec<&(dyn std::error::Error + 'static)> = vec![error];
    while let Some(e) = pending.pop() {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Failed::Final(StoreError::Tls {
                endpoint: endpoint.to_owned(),
                cause: tls.to_string(),
            });
        }
        if causes.last() != Some(&e.to_string()) {
            causes.push(e.to_string());
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            pending.push(inner);
        }
        if let Some(next) = e.source() {
            pending.push(next);
        }
    }
    Failed::Elsewhere(StoreError::Unavailable {
        endpoint: endpoint.to_owned(),
        cause: causes.join(": "),
    })
}

/// A gRPC error status of a member: `code` and its message.
fn refused(endpoint: &str, code: i64, message: String) -> Failed {
    let endpoint = endpoint.to_owned();
    match code {
        // An expired or revoked token, or one from before a change of users or roles (etcd's
        // own client takes a new token on both).
        16 | 3 | 9
            if message.contains("invalid auth token")
                || message.contains("revision of auth store is old") =>
        {
            Failed::Reauthenticate
        }
        // Unauthenticated, a wrong user or password (invalid argument), a missing permission.
        16 | 7 => Failed::Final(StoreError::AccessDenied {
            endpoint,
            cause: message,
        }),
        3 if message.contains("authentication failed") || message.contains("user name") => {
            Failed::Final(StoreError::AccessDenied {
                endpoint,
                cause: message,
            })
        }
        // Unavailable, deadline exceeded (no leader, leader changed, a slow member), aborted,
        // too many requests.
        14 | 4 | 10 | 8 => Failed::Elsewhere(StoreError::Unavailable {
            endpoint,
            cause: message,
        }),
        _ => Failed::Final(StoreError::UnexpectedReply(format!(
            "etcd at {endpoint} refused the call (code {code}): {message}"
        ))),
    }
}
