//! Turns client-library errors into [`StoreError`]s that name the endpoint and say what went
//! wrong in words an operator can act on, and decides which errors make a connection unusable.
//!
//! redis-rs wraps I/O and TLS failures so that the original `rustls::Error` is not reachable by
//! walking `Error::source`; its text is. TLS failures are therefore recognised by the stable
//! `Display` prefixes of `rustls::Error`, which the unit tests below check against rustls itself.

use std::time::Duration;

use redis::{ErrorKind as RedisErrorKind, RedisError, ServerErrorKind};

use crate::store::StoreError;
use crate::time::millis;

/// Maps an error of a call (or of connecting) to a [`StoreError`].
///
/// `connecting` says whether the error happened while a connection was being made: a timeout
/// then means the call never ran (`unavailable`), not that it may have run (`timeout`).
pub(super) fn classify(
    endpoint: &str,
    e: &RedisError,
    limit: Duration,
    connecting: bool,
) -> StoreError {
    let endpoint = endpoint.to_owned();
    let unavailable = |cause: String| StoreError::Unavailable {
        endpoint: endpoint.clone(),
        cause,
    };
    let detail = e.detail().unwrap_or_default().to_owned();
    let text = e.to_string();
    match (e.kind(), e.code()) {
        (_, Some("TLCORRUPT")) => return StoreError::Corrupt { detail },
        (_, Some("TLINVALID")) => return StoreError::InvalidRequest(detail),
        _ => {}
    }
    if let Some(cause) = tls_cause(&text) {
        return StoreError::Tls { endpoint, cause };
    }
    // What the server said, without redis-rs' rendering of the error code.
    let said = e.detail().filter(|d| !d.is_empty()).unwrap_or(&text);
    // A refused command or key arrives as NOPERM; a command refused inside a script as a
    // script error ("ERR ACL failure in script: User ... has no permissions to run ...").
    if e.kind() == RedisErrorKind::Server(ServerErrorKind::NoPerm)
        || e.code() == Some("NOPERM")
        || text.contains("ACL failure")
    {
        return StoreError::AccessDenied {
            endpoint,
            cause: format!("permission denied: {said}"),
        };
    }
    match (e.kind(), e.code()) {
        (RedisErrorKind::AuthenticationFailed, _) | (_, Some("WRONGPASS")) => {
            StoreError::AccessDenied {
                endpoint,
                cause: format!(
                    "authentication failed (wrong username or password, or the user is disabled): {said}"
                ),
            }
        }
        (_, Some("NOAUTH")) => StoreError::AccessDenied {
            endpoint,
            cause: "authentication required: the server wants a password and none is configured"
                .into(),
        },
        (RedisErrorKind::Server(ServerErrorKind::ClusterDown), _) | (_, Some("CLUSTERDOWN")) => {
            unavailable(format!("cluster down: {detail}"))
        }
        (RedisErrorKind::Server(ServerErrorKind::BusyLoading), _) => {
            unavailable("the server is loading its data set".into())
        }
        (RedisErrorKind::Server(ServerErrorKind::ReadOnly), _) => unavailable(format!(
            "connected to a read-only replica (failover in progress?): {detail}"
        )),
        // Refused before anything was written: the server checks min-replicas-to-write at a
        // script's first write, and a script's writes are all or nothing.
        (_, Some("NOREPLICAS")) => unavailable(format!(
            "the primary has too few replicas to accept writes (min-replicas-to-write; \
             isolated from its replicas, or a failover in progress?): {detail}"
        )),
        (RedisErrorKind::Server(ServerErrorKind::MasterDown | ServerErrorKind::TryAgain), _) => {
            unavailable(format!("{}: {detail}", e.code().unwrap_or("server busy")))
        }
        (RedisErrorKind::InvalidClientConfig, _) => {
            StoreError::InvalidConfig(format!("{endpoint}: {text}"))
        }
        // Any other error reply (unknown command, a script that failed): not something a retry
        // fixes, and not something this version expects.
        (RedisErrorKind::Server(_) | RedisErrorKind::Extension, _) => {
            StoreError::UnexpectedReply(format!("{endpoint}: {text}"))
        }
        _ if e.is_timeout() && connecting => {
            unavailable(format!("connect timed out after {} ms", millis(limit)))
        }
        _ if e.is_timeout() => StoreError::Timeout {
            endpoint,
            after_ms: millis(limit),
        },
        _ if e.is_connection_refusal() => unavailable("connection refused".into()),
        _ if e.is_connection_dropped() => unavailable(format!("connection lost: {text}")),
        (RedisErrorKind::Parse | RedisErrorKind::UnexpectedReturnType, _) => {
            StoreError::UnexpectedReply(text)
        }
        _ => unavailable(text),
    }
}

/// Whether the connection that produced `e` should be dropped from the pool: it is broken,
/// stalled, or talks to a node that can no longer take writes.
pub(super) fn breaks_connection(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.kind() == RedisErrorKind::ClusterConnectionNotFound
        || e.kind() == RedisErrorKind::Server(ServerErrorKind::ReadOnly)
        || e.kind() == RedisErrorKind::Server(ServerErrorKind::ClusterDown)
        // A primary cut off from its replicas may no longer be the primary: reconnect, which
        // through Sentinel asks again which server is.
        || e.code() == Some("NOREPLICAS")
}

/// What an operator should read for a TLS failure, recognised by rustls' error text.
fn tls_cause(text: &str) -> Option<String> {
    const CERT: &str = "invalid peer certificate: ";
    const ALERT: &str = "received fatal alert: ";
    if let Some(at) = text.find(CERT) {
        let what = &text[at + CERT.len()..];
        let cause = if what.starts_with("UnknownIssuer") {
            "unknown CA: the server certificate is not signed by a CA in the configured bundle"
                .to_owned()
        } else if what.starts_with("certificate not valid for name") {
            format!("server name mismatch: {what}")
        } else if what.starts_with("certificate expired") {
            format!("expired server certificate: {what}")
        } else {
            format!("invalid server certificate: {what}")
        };
        return Some(cause);
    }
    if let Some(at) = text.find(ALERT) {
        let alert = &text[at + ALERT.len()..];
        let cause =
            if alert.starts_with("CertificateRequired") || alert.starts_with("HandshakeFailure") {
                format!(
                    "the server requires a client certificate (mTLS) and did not accept the \
                 handshake ({alert}); configure a client certificate and key"
                )
            } else if alert.starts_with("UnknownCA")
                || alert.starts_with("BadCertificate")
                || alert.starts_with("DecryptError")
            {
                format!("the server refused the client certificate ({alert})")
            } else {
                format!("the server aborted the handshake ({alert})")
            };
        return Some(cause);
    }
    [
        "received corrupt message",
        "peer is incompatible",
        "peer misbehaved",
        "InvalidContentType",
    ]
    .iter()
    .find(|marker| text.contains(*marker))
    .map(|_| format!("{text} (does the server speak TLS on this port?)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::{AlertDescription, CertificateError, Error as TlsError};

    fn io(e: TlsError) -> RedisError {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e).into()
    }

    fn kind_and_message(e: &RedisError) -> (String, String) {
        let err = classify("h:1", e, Duration::from_millis(1500), true);
        (err.kind().as_str().to_owned(), err.to_string())
    }

    #[test]
    fn tls_failures_are_named() {
        let (kind, msg) = kind_and_message(&io(TlsError::InvalidCertificate(
            CertificateError::UnknownIssuer,
        )));
        assert_eq!(kind, "tls");
        assert!(msg.contains("unknown CA") && msg.contains("h:1"), "{msg}");
        let (kind, msg) = kind_and_message(&io(TlsError::AlertReceived(
            AlertDescription::CertificateRequired,
        )));
        assert_eq!(kind, "tls");
        assert!(msg.contains("client certificate"), "{msg}");
        let (_, msg) =
            kind_and_message(&io(TlsError::InvalidCertificate(CertificateError::Expired)));
        assert!(
            msg.contains("invalid server certificate") || msg.contains("expired"),
            "{msg}"
        );
    }

    #[test]
    fn connect_timeouts_and_refusals() {
        let timeout: RedisError = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        let (kind, msg) = kind_and_message(&timeout);
        assert_eq!(kind, "unavailable");
        assert!(msg.contains("timed out after 1500 ms"), "{msg}");
        let in_call = classify("h:1", &timeout, Duration::from_millis(800), false);
        assert_eq!(in_call.kind().as_str(), "timeout");
        let refused: RedisError =
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert!(kind_and_message(&refused).1.contains("connection refused"));
        assert!(breaks_connection(&refused));
    }

    #[test]
    fn too_few_replicas_to_write_is_retryable_and_reconnects() {
        let e = redis::parse_redis_value(b"-NOREPLICAS Not enough good replicas to write.\r\n")
            .and_then(redis::Value::extract_error)
            .unwrap_err();
        assert_eq!(e.code(), Some("NOREPLICAS"), "{e:?}");
        let (kind, msg) = kind_and_message(&e);
        assert_eq!(kind, "unavailable");
        assert!(msg.contains("min-replicas-to-write"), "{msg}");
        assert!(breaks_connection(&e));
    }
}
