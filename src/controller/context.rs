//! What every reconcile gets: a few typed parts, each the one owner of its state.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use super::finalizer::Removed;
use super::holders::Holders;
use super::installation::Installations;
use super::line::Line;
use super::metrics::Metrics;
use super::status::StatusWriter;
use super::tenure::Tenures;
use crate::api::TargetLease;
use crate::election::Leadership;
use crate::store::LeaseStore;

/// What every reconcile gets.
pub(crate) struct Context {
    /// Kubernetes client (the finalizer's patches).
    pub(crate) client: Client,
    /// The lease store.
    pub(crate) store: Arc<dyn LeaseStore>,
    /// Every lease this controller keeps, renewed on its own schedule.
    pub(crate) tenures: Tenures,
    /// The claims on each target, and who waits for it.
    pub(crate) line: Line,
    /// The namespaces this installation acts in.
    pub(crate) installations: Installations,
    /// Holder pods and heartbeats.
    pub(crate) holders: Holders,
    /// Status writes and Events, within the write budget.
    pub(crate) status: StatusWriter,
    /// Whether this replica may act; checked before every store call and write.
    pub(crate) leadership: Leadership,
    /// Prometheus metrics.
    pub(crate) metrics: Arc<Metrics>,
    /// The shortest `ttlSeconds` this controller accepts.
    pub(crate) shortest_ttl: Duration,
    /// The deleted objects whose finalizer this process removed: nothing is left to do for them.
    pub(crate) removed: Arc<Removed>,
    /// Objects whose reconciles fail, each with when its run of failures began (for the
    /// backoff); removed at its next reconcile that succeeds.
    failures: Mutex<HashMap<ObjectRef<TargetLease>, Instant>>,
}

/// The parts of a [`Context`].
pub(crate) struct Parts {
    pub(crate) client: Client,
    pub(crate) store: Arc<dyn LeaseStore>,
    pub(crate) tenures: Tenures,
    pub(crate) line: Line,
    pub(crate) installations: Installations,
    pub(crate) holders: Holders,
    pub(crate) status: StatusWriter,
    pub(crate) leadership: Leadership,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) shortest_ttl: Duration,
    pub(crate) removed: Arc<Removed>,
}

impl Context {
    /// A context of `parts`, with no failures recorded.
    pub(crate) fn new(parts: Parts) -> Self {
        let Parts {
            client,
            store,
            tenures,
            line,
            installations,
            holders,
            status,
            leadership,
            metrics,
            shortest_ttl,
            removed,
        } = parts;
        Self {
            client,
            store,
            tenures,
            line,
            installations,
            holders,
            status,
            leadership,
            metrics,
            shortest_ttl,
            removed,
            failures: Mutex::default(),
        }
    }

    /// How long `key`'s reconciles have been failing as of `now` (zero at the first failure).
    pub(crate) fn failing_for(&self, key: ObjectRef<TargetLease>, now: Instant) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        now.duration_since(*failures.entry(key).or_insert(now))
    }

    /// `key`'s reconcile succeeded: its run of failures ended.
    pub(crate) fn succeeded(&self, key: &ObjectRef<TargetLease>) {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }
}
