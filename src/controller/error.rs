//! The controller's one error type: what can go wrong in a reconcile, each with the
//! low-cardinality label its metrics carry (a store failure's is its [`ErrorKind`]).

use thiserror::Error;

use crate::api::Reason;
use crate::store::{ErrorKind, StoreError};

/// Everything a reconcile can fail with.
#[derive(Debug, Error)]
pub enum Error {
    /// The lease store failed; the lease's status says so in its conditions.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API call failed: {0}")]
    Kube(#[source] Box<kube::Error>),
    /// Adding or removing the finalizer, or the wrapped reconcile, failed.
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// The object lacks something the API server always sets (namespace, uid).
    #[error("object is missing {0}")]
    MissingField(&'static str),
    /// This replica may not act: its leadership lapsed.
    #[error(transparent)]
    NotLeading(#[from] crate::election::NotLeading),
    /// The reconcile did not finish in time (an API server that does not answer).
    #[error("the reconcile did not finish within {0:?}")]
    TimedOut(std::time::Duration),
    /// A deleted claim's tenure ended and its holder has not been confirmed stopped: the
    /// finalizer stays, and the claim is looked at again after this long at the latest.
    #[error("waiting up to {0:?} for the holder to stop its command before the target passes on")]
    Stopping(std::time::Duration),
}

impl From<kube::Error> for Error {
    fn from(e: kube::Error) -> Self {
        Error::Kube(Box::new(e))
    }
}

impl Error {
    /// A low-cardinality label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Store(e) => e.kind().as_str(),
            Error::Kube(_) => "kube",
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.metric_label(),
                _ => "finalizer",
            },
            Error::MissingField(_) => "missing_field",
            Error::NotLeading(_) => "not_leading",
            Error::TimedOut(_) => "timeout",
            Error::Stopping(_) => "stopping",
        }
    }

    /// How long until a deleted claim whose holder is stopping is looked at again, if this is
    /// that wait (not a failure).
    pub fn stopping(&self) -> Option<std::time::Duration> {
        match self {
            Error::Stopping(d) => Some(*d),
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::CleanupFailed(e) => e.stopping(),
                _ => None,
            },
            _ => None,
        }
    }

    /// A write refused by its resourceVersion precondition: what it was based on is stale.
    pub fn is_stale_read(&self) -> bool {
        match self {
            Error::Kube(e) => matches!(e.as_ref(), kube::Error::Api(s) if s.code == 409),
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.is_stale_read(),
                _ => false,
            },
            _ => false,
        }
    }
}

/// The condition reason for a store failure: one word a person can act on.
pub fn store_reason(kind: ErrorKind) -> Reason {
    match kind {
        ErrorKind::Unavailable => Reason::BackendUnavailable,
        ErrorKind::Timeout => Reason::BackendTimeout,
        ErrorKind::Tls => Reason::BackendTlsFailed,
        ErrorKind::AccessDenied => Reason::BackendAuthFailed,
        ErrorKind::NotDurable => Reason::BackendNotDurable,
        ErrorKind::InvalidConfig => Reason::BackendMisconfigured,
        ErrorKind::Corrupt => Reason::CorruptRecord,
        ErrorKind::InvalidRequest => Reason::InvalidRequest,
        ErrorKind::UnexpectedReply => Reason::BackendUnexpectedReply,
    }
}

/// The condition message for a store failure: what happened and what to do, for everyone who
/// can read the TargetLease. It never carries the endpoint, the ACL user or the server's words
/// (the controller's log has them); only the validation of our own request and the name of an
/// unreadable record, which hold nothing secret, are passed on.
pub fn store_message(error: &StoreError) -> String {
    let see_log = "details in the controller's log";
    match error {
        StoreError::Unavailable { .. } => format!(
            "the lease store cannot be reached; the controller retries with backoff ({see_log})"
        ),
        StoreError::Timeout { .. } => format!(
            "a lease store call timed out and may have run; it is retried, and the retry acts once \
             (an acquire by the same claim answers the token it already holds) ({see_log})"
        ),
        StoreError::Tls { .. } => format!(
            "the TLS handshake with the lease store failed: check the CA, the client certificate \
             and the server name settings ({see_log})"
        ),
        StoreError::AccessDenied { .. } => format!(
            "the lease store refused the controller's credentials or rights: check the ACL user, \
             its password and its rule ({see_log})"
        ),
        StoreError::NotDurable { .. } => format!(
            "the lease store did not confirm the acquire durable in time; it is retried ({see_log})"
        ),
        StoreError::InvalidConfig(_) => {
            format!("the controller's lease store settings are unusable ({see_log})")
        }
        StoreError::Corrupt { detail } => format!(
            "a record in the lease store is unreadable ({detail}); an operator inspects it and \
             runs `targetlease lease repair`"
        ),
        StoreError::InvalidRequest(why) => format!("the lease store refused the request: {why}"),
        StoreError::UnexpectedReply(_) => format!(
            "the lease store answered something this version does not understand ({see_log})"
        ),
    }
}
