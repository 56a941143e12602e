use thiserror::Error;

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
        }
    }
}

/// The condition reason for a store failure: one word a person can act on.
pub fn store_reason(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Unavailable => "BackendUnavailable",
        ErrorKind::Timeout => "BackendTimeout",
        ErrorKind::Tls => "BackendTLSFailed",
        ErrorKind::AccessDenied => "BackendAuthFailed",
        ErrorKind::NotDurable => "BackendNotDurable",
        ErrorKind::InvalidConfig => "BackendMisconfigured",
        ErrorKind::Corrupt => "CorruptRecord",
        ErrorKind::InvalidRequest => "InvalidRequest",
        ErrorKind::UnexpectedReply => "BackendUnexpectedReply",
    }
}
