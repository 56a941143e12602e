//! The one place that talks to etcd: its JSON gateway (`/v3/...`, served by every member on its
//! client port), over HTTP/1.1 with TLS when the endpoint says `https://`. Three operations
//! only: read keys, write keys if others still hold what was read (one transaction), and grant
//! an etcd lease. A call goes to the member that answered last and moves on to the next one
//! when a member is unreachable, hangs (each is given a share of the deadline) or has no
//! leader, until its deadline; an expired auth token is renewed once. Failures come back as [`StoreError`]s that name the member, never a password.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::time::{Instant, sleep, timeout_at};

use super::config::EtcdConfig;
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

/// A client of the members' JSON gateway.
pub(crate) struct Gateway {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
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

impl Gateway {
    pub(crate) fn new(config: &EtcdConfig) -> Result<Self, StoreError> {
        let tls = tls_config(config)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(config.connect_timeout));
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            http,
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
        let body = json!({"success": ranges(keys)});
        let reply = self.call("/v3/kv/txn", &body, deadline).await?;
        read_back(&reply, keys.len())
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
        let compare: Vec<Value> = expect
            .iter()
            .map(|e| {
                let key = BASE64.encode(e.key);
                match e.value {
                    Some(held) => json!({"key": key, "target": "VALUE", "result": "EQUAL",
                                         "value": BASE64.encode(held)}),
                    None => json!({"key": key, "target": "CREATE", "result": "EQUAL",
                                   "create_revision": "0"}),
                }
            })
            .collect();
        let success: Vec<Value> = puts
            .iter()
            .map(|p| {
                let mut put = json!({"key": BASE64.encode(p.key), "value": BASE64.encode(p.value)});
                if let Some(lease) = p.lease {
                    put["lease"] = json!(lease.to_string());
                }
                json!({ "request_put": put })
            })
            .collect();
        let keys: Vec<&str> = expect.iter().map(|e| e.key).collect();
        let body = json!({"compare": compare, "success": success, "failure": ranges(&keys)});
        let reply = self.call("/v3/kv/txn", &body, deadline).await?;
        if reply.get("succeeded").and_then(Value::as_bool) == Some(true) {
            return Ok(Swapped::Done);
        }
        Ok(Swapped::Changed(read_back(&reply, keys.len())?))
    }

    /// Grants an etcd lease of `ttl_seconds`: what the keys attached to it are deleted with.
    pub(crate) async fn grant_lease(
        &self,
        ttl_seconds: i64,
        deadline: Instant,
    ) -> Result<i64, StoreError> {
        let reply = self
            .call(
                "/v3/lease/grant",
                &json!({"TTL": ttl_seconds.to_string()}),
                deadline,
            )
            .await?;
        reply
            .get("ID")
            .and_then(|id| {
                id.as_str()
                    .and_then(|s| s.parse().ok())
                    .or_else(|| id.as_i64())
            })
            .ok_or_else(|| unexpected("a lease grant without an id"))
    }

    /// One call: each member in turn from the preferred one, in rounds until `deadline`.
    async fn call(&self, path: &str, body: &Value, deadline: Instant) -> Result<Value, StoreError> {
        let body = Bytes::from(body.to_string());
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
        let body = json!({"name": user, "password": password.expose()}).to_string();
        let reply = self
            .send(
                url,
                "/v3/auth/authenticate",
                Bytes::from(body),
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
        let token = reply
            .get("token")
            .and_then(Value::as_str)
            .map(Secret::new)
            .ok_or_else(|| Failed::Final(unexpected("an authentication without a token")))?;
        if let Ok(mut cached) = self.token.lock() {
            *cached = Some(token.clone());
        }
        Ok(Some(token))
    }

    async fn attempt(
        &self,
        url: &SecretUrl,
        path: &str,
        body: Bytes,
        deadline: Instant,
    ) -> Result<Value, Failed> {
        let token = self.auth_token(url, deadline).await?;
        self.send(url, path, body, token.as_ref(), deadline).await
    }

    /// One HTTP request to one member.
    async fn send(
        &self,
        url: &SecretUrl,
        path: &str,
        body: Bytes,
        token: Option<&Secret>,
        deadline: Instant,
    ) -> Result<Value, Failed> {
        let endpoint = url.endpoint().to_owned();
        let uri = format!("{}{path}", url.expose().trim_end_matches('/'));
        let mut request = hyper::Request::post(uri).header("content-type", "application/json");
        if let Some(token) = token {
            request = request.header("authorization", token.expose());
        }
        let request = request.body(Full::new(body)).map_err(|e| {
            Failed::Final(StoreError::InvalidConfig(format!(
                "etcd endpoint {url}: {e}"
            )))
        })?;
        let exchange = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| transport(&endpoint, &e))?;
            let status = response.status();
            let bytes = http_body_util::Limited::new(response.into_body(), MAX_REPLY_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    Failed::Elsewhere(StoreError::UnexpectedReply(format!(
                        "etcd at {endpoint}: the answer could not be read ({e})"
                    )))
                })?
                .to_bytes();
            Ok::<_, Failed>((status, bytes))
        };
        let (status, bytes) = match timeout_at(deadline, exchange).await {
            Err(_) => {
                return Err(Failed::Elsewhere(StoreError::Timeout {
                    endpoint,
                    after_ms: u64::try_from(self.call_timeout.as_millis()).unwrap_or(u64::MAX),
                }));
            }
            Ok(Err(failed)) => return Err(failed),
            Ok(Ok(reply)) => reply,
        };
        let reply: Value = serde_json::from_slice(&bytes).map_err(|_| {
            Failed::Elsewhere(StoreError::UnexpectedReply(format!(
                "etcd at {endpoint} answered HTTP {status} with something other than JSON"
            )))
        })?;
        if status.is_success() {
            return Ok(reply);
        }
        Err(refused(&endpoint, &reply))
    }
}

/// Range requests of `keys`, one each.
fn ranges(keys: &[&str]) -> Vec<Value> {
    keys.iter()
        .map(|k| json!({"request_range": {"key": BASE64.encode(k)}}))
        .collect()
}

/// The `count` ranges a transaction read, in order (the branch it took holds only ranges).
fn read_back(reply: &Value, count: usize) -> Result<Vec<Option<Kv>>, StoreError> {
    let responses = reply
        .get("responses")
        .and_then(Value::as_array)
        .ok_or_else(|| unexpected("a transaction without its reads"))?;
    if responses.len() != count {
        return Err(unexpected("a transaction with another number of reads"));
    }
    responses
        .iter()
        .map(|r| {
            let range = r
                .get("response_range")
                .ok_or_else(|| unexpected("a read that is not a range"))?;
            first_kv(range)
        })
        .collect()
}

/// The first key-value of a range reply, if any.
fn first_kv(range: &Value) -> Result<Option<Kv>, StoreError> {
    let Some(kv) = range.pointer("/kvs/0") else {
        return Ok(None);
    };
    let value = match kv.get("value").and_then(Value::as_str) {
        Some(text) => BASE64
            .decode(text)
            .map_err(|_| unexpected("a value that is not base64"))?,
        // An empty value is left out of the JSON.
        None => Vec::new(),
    };
    Ok(Some(Kv { value }))
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

/// An error answer of the gateway (`{"code": <gRPC code>, "message": ...}`).
fn refused(endpoint: &str, reply: &Value) -> Failed {
    let code = reply.get("code").and_then(Value::as_i64).unwrap_or(-1);
    let message = reply
        .get("message")
        .or_else(|| reply.get("error"))
        .and_then(Value::as_str)
        .unwrap_or("no message")
        .to_owned();
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

/// The TLS settings: the CA file's certificates as the only roots, and the client certificate
/// for mTLS.
fn tls_config(config: &EtcdConfig) -> Result<rustls::ClientConfig, StoreError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let invalid = |what: &str, path: &std::path::Path, e: &dyn std::fmt::Display| {
        StoreError::InvalidConfig(format!("cannot read {what} {}: {e}", path.display()))
    };
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = &config.tls.ca_file {
        let certs =
            CertificateDer::pem_file_iter(path).map_err(|e| invalid("CA file", path, &e))?;
        for cert in certs {
            let cert = cert.map_err(|e| invalid("CA file", path, &e))?;
            roots.add(cert).map_err(|e| invalid("CA file", path, &e))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::InvalidConfig(format!("TLS: {e}")))?
        .with_root_certificates(roots);
    match (&config.tls.cert_file, &config.tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .map_err(|e| invalid("client certificate", cert, &e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid("client certificate", cert, &e))?;
            let key_der =
                PrivateKeyDer::from_pem_file(key).map_err(|e| invalid("client key", key, &e))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| StoreError::InvalidConfig(format!("client certificate: {e}")))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}
