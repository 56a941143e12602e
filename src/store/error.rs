use thiserror::Error;

/// A failure of the store: the call did not produce an outcome.
///
/// Messages name the endpoint and the cause, never a password or a lease id.
#[derive(Debug, Error)]
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
    /// The backend refused our credentials or our user lacks a permission.
    #[error("lease store at {endpoint} refused access: {cause}")]
    AccessDenied {
        /// Host and port, without credentials.
        endpoint: String,
        /// The server's reason.
        cause: String,
    },
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
    /// See [`StoreError::AccessDenied`].
    AccessDenied,
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
            StoreError::AccessDenied { .. } => ErrorKind::AccessDenied,
            StoreError::Corrupt { .. } => ErrorKind::Corrupt,
            StoreError::InvalidRequest(_) => ErrorKind::InvalidRequest,
            StoreError::UnexpectedReply(_) => ErrorKind::UnexpectedReply,
        }
    }
}

impl ErrorKind {
    /// The name used in metrics, logs and CLI output.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::AccessDenied => "access_denied",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::UnexpectedReply => "unexpected_reply",
        }
    }
}
