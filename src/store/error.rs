//! The store's one error type, [`StoreError`], and its [`ErrorKind`] labels: what went wrong
//! in a call that produced no outcome, and whether a retry can help.

use thiserror::Error;

/// A failure of the store: the call did not produce an outcome.
///
/// Messages name the endpoint and the cause, never a password or a lease id.
#[derive(Clone, Debug, Error)]
pub enum StoreError {
    /// The backend could not be reached or the connection broke.
    #[error("lease store at {endpoint} is unavailable: {cause}")]
    Unavailable {
        /// Host and port, without credentials.
        endpoint: String,
        /// What went wrong, as the client library reported it.
        cause: String,
    },
    /// The call did not finish within its deadline. It may or may not have run on the server;
    /// retry with the same request id to find out without acting twice.
    #[error("lease store call to {endpoint} timed out after {after_ms} ms")]
    Timeout {
        /// Host and port, without credentials.
        endpoint: String,
        /// The deadline that passed.
        after_ms: u64,
    },
    /// The TLS handshake with the backend failed: unknown CA, a certificate that does not match
    /// the server name, a client certificate the server refused or did not get, ...
    #[error("lease store at {endpoint}: TLS handshake failed: {cause}")]
    Tls {
        /// Host and port, without credentials.
        endpoint: String,
        /// What the handshake reported, in words an operator can act on.
        cause: String,
    },
    /// The backend refused our credentials or our user lacks a permission.
    #[error("lease store at {endpoint} refused access: {cause}")]
    AccessDenied {
        /// Host and port, without credentials.
        endpoint: String,
        /// The server's reason.
        cause: String,
    },
    /// An acquire ran, but the backend did not confirm it durable (AOF fsync, replicas) within the
    /// call deadline. The lease may be granted; retry with the same request id to get the same
    /// token and wait again.
    #[error("lease store at {endpoint} did not confirm durability within {after_ms} ms: {detail}")]
    NotDurable {
        /// Host and port, without credentials.
        endpoint: String,
        /// How long was waited.
        after_ms: u64,
        /// What was asked and what was confirmed.
        detail: String,
    },
    /// The connection settings are unusable (unreadable certificate or password file, a
    /// durability level the server cannot provide, ...). Retrying does not help.
    #[error("lease store configuration: {0}")]
    InvalidConfig(String),
    /// A record in the backend is not what this version wrote; the target is treated as
    /// unavailable rather than free.
    #[error("corrupt record in lease store: {detail}")]
    Corrupt {
        /// Which record and what is wrong with it.
        detail: String,
    },
    /// The request itself is invalid (empty target, zero TTL, ...).
    #[error("invalid lease request: {0}")]
    InvalidRequest(String),
    /// The backend answered something this version does not understand.
    #[error("unexpected reply from lease store: {0}")]
    UnexpectedReply(String),
}

/// A stable, low-cardinality name for each kind of failure: metrics labels and status reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// See [`StoreError::Unavailable`].
    Unavailable,
    /// See [`StoreError::Timeout`].
    Timeout,
    /// See [`StoreError::Tls`].
    Tls,
    /// See [`StoreError::AccessDenied`].
    AccessDenied,
    /// See [`StoreError::NotDurable`].
    NotDurable,
    /// See [`StoreError::InvalidConfig`].
    InvalidConfig,
    /// See [`StoreError::Corrupt`].
    Corrupt,
    /// See [`StoreError::InvalidRequest`].
    InvalidRequest,
    /// See [`StoreError::UnexpectedReply`].
    UnexpectedReply,
}

impl StoreError {
    /// The kind of this failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Unavailable { .. } => ErrorKind::Unavailable,
            StoreError::Timeout { .. } => ErrorKind::Timeout,
            StoreError::Tls { .. } => ErrorKind::Tls,
            StoreError::AccessDenied { .. } => ErrorKind::AccessDenied,
            StoreError::NotDurable { .. } => ErrorKind::NotDurable,
            StoreError::InvalidConfig(_) => ErrorKind::InvalidConfig,
            StoreError::Corrupt { .. } => ErrorKind::Corrupt,
            StoreError::InvalidRequest(_) => ErrorKind::InvalidRequest,
            StoreError::UnexpectedReply(_) => ErrorKind::UnexpectedReply,
        }
    }
}

impl StoreError {
    /// Whether the same call may succeed if retried soon (with the same request id): the
    /// backend was unreachable, busy or failing over. Credentials, TLS, configuration, corrupt
    /// records and invalid requests do not heal by retrying.
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind(),
            ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::NotDurable
        )
    }
}

impl ErrorKind {
    /// The name used in metrics, logs and CLI output.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Tls => "tls",
            ErrorKind::AccessDenied => "access_denied",
            ErrorKind::NotDurable => "not_durable",
            ErrorKind::InvalidConfig => "invalid_config",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::UnexpectedReply => "unexpected_reply",
        }
    }
}
