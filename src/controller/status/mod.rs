//! The status writer: the one place that writes TargetLease statuses and publishes Events. It
//! owns the write budget ([`budget`]), checks that this replica may still act before every
//! write, and makes every status write a server-side apply that carries the `resourceVersion`
//! it was decided on, so a write based on a stale read (a cut-off leader's late write, a cache
//! behind) is refused with 409 instead of applied. What to write is decided elsewhere, as an
//! [`Observed`] ([`observed`], pure).

pub(crate) mod budget;
pub mod observed;

use std::sync::Arc;

use jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::time::Instant;
use tracing::{debug, warn};

use self::budget::{Priority, StatusBudget, is_overload};
pub use self::observed::Observed;
pub(crate) use self::observed::{priority, published_expiry};
use super::error::Error;
use super::installation::MARKER;
use super::metrics::Metrics;
use crate::api::{Condition, ConditionType, FIELD_MANAGER, Reason, TargetLease};
use crate::election::Leadership;

/// What became of a status write.
pub(crate) enum Written {
    /// The API server wrote it; the TargetLease as it wrote it.
    Wrote(Box<TargetLease>),
    /// Nothing to write: the status says it already.
    Unchanged,
    /// Only `expiresAt` would move and the budget holds refreshes back: the renewal scheduler
    /// wakes the claim again at its next renewal, which tries again.
    Deferred,
}

/// Writes statuses and Events within the budget, while this replica may act.
pub(crate) struct StatusWriter {
    client: Client,
    recorder: Recorder,
    budget: Arc<StatusBudget>,
    /// The TargetLeases this process reported another installation on.
    reported: std::sync::Mutex<std::collections::HashSet<String>>,
    metrics: Arc<Metrics>,
    leadership: Leadership,
}

impl StatusWriter {
    /// A writer for `client`, publishing Events through `recorder`.
    pub(crate) fn new(
        client: Client,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        leadership: Leadership,
    ) -> Self {
        Self {
            client,
            recorder,
            budget: Arc::new(StatusBudget::default()),
            reported: std::sync::Mutex::default(),
            metrics,
            leadership,
        }
    }

    /// Writes the status `observed` describes when it says something new; publishes `event`
    /// with it when it was written.
    pub(crate) async fn settle(
        &self,
        lease: &TargetLease,
        observed: Observed,
        event: Option<(Reason, String)>,
    ) -> Result<Written, Error> {
        let written = self.write(lease, observed).await?;
        if let (Written::Wrote(_), Some((reason, note))) = (&written, event) {
            self.publish(lease, reason, note);
        }
        Ok(written)
    }

    /// Writes `observed` as the status of `lease` when it says something new and the budget
    /// admits it (a refresh of `expiresAt` may be put off; see [`budget`]).
    pub(crate) async fn write(
        &self,
        lease: &TargetLease,
        observed: Observed,
    ) -> Result<Written, Error> {
        let old = lease.status.as_ref();
        let new = observed.into_status(lease.metadata.generation, old, Timestamp::now());
        let Some(priority) = priority(old, &new) else {
            return Ok(Written::Unchanged);
        };
        let phase_changed = old.map(|s| s.phase) != Some(new.phase);
        self.leadership.check()?;
        let Some(admitted) = self.budget.admit(priority, Instant::now()) else {
            self.metrics.shed("refresh");
            return Ok(Written::Deferred);
        };
        let namespace = lease
            .namespace()
            .ok_or(Error::MissingField("metadata.namespace"))?;
        let api: Api<TargetLease> = Api::namespaced(self.client.clone(), &namespace);
        // The resourceVersion the status was decided on is a precondition: a write based on a
        // stale read is refused with 409, not applied.
        let patch = json!({
            "apiVersion": TargetLease::api_version(&()),
            "kind": "TargetLease",
            "metadata": {"resourceVersion": lease.resource_version()},
            "status": new,
        });
        let result = api
            .patch_status(
                &lease.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await;
        admitted.done(
            Instant::now(),
            result.as_ref().err().is_some_and(is_overload),
        );
        let written = result?;
        let phase_name = format!("{:?}", new.phase);
        let held = new
            .conditions
            .iter()
            .find(|c| c.type_ == crate::api::ConditionType::Held.as_str())
            .map(|c| c.reason.as_str());
        debug!(lease = %lease.name_any(), phase = %phase_name, held = ?held, token = ?new.fencing_token, "status written");
        self.metrics
            .status_written(phase_changed.then_some(phase_name.as_str()));
        Ok(Written::Wrote(Box::new(written)))
    }

    /// Says on `lease`, with an `InstallationConflict` condition, that this installation
    /// (`ours`) leaves it alone because another (`owner`) acts in its namespace. Written once
    /// per TargetLease and process, under a field manager of its own, without a
    /// resourceVersion: it owns that one condition and nothing of what the acting
    /// installation writes. A TargetLease without a status yet gets it at a later reconcile.
    pub(crate) async fn report_conflict(&self, lease: &TargetLease, ours: &str, owner: &str) {
        let Some(uid) = lease.uid() else { return };
        let already = lease.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == ConditionType::InstallationConflict.as_str())
        });
        if already
            || lease.status.is_none()
            || !self
                .reported
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(uid.clone())
        {
            return;
        }
        let message = format!(
            "the targetlease installation {ours:?} also watches this namespace and leaves this \
             TargetLease to {owner:?}, which acts here (the Lease {MARKER} of this namespace \
             names it): give the two installations scopes that do not overlap"
        );
        let condition = Condition {
            type_: ConditionType::InstallationConflict.as_str().to_owned(),
            status: "True".to_owned(),
            reason: Reason::OtherInstallation.as_str().to_owned(),
            message,
            observed_generation: lease.metadata.generation,
            last_transition_time: Timestamp::now(),
        };
        let patch = json!({
            "apiVersion": TargetLease::api_version(&()),
            "kind": "TargetLease",
            "status": {"conditions": [condition]},
        });
        let Some(namespace) = lease.namespace() else {
            return;
        };
        let api: Api<TargetLease> = Api::namespaced(self.client.clone(), &namespace);
        let manager = format!("{FIELD_MANAGER}-other-installation");
        if let Err(e) = api
            .patch_status(
                &lease.name_any(),
                &PatchParams::apply(&manager),
                &Patch::Apply(&patch),
            )
            .await
        {
            self.reported
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&uid);
            warn!(error = %e, lease = %lease.name_any(), "could not report the other installation on the TargetLease");
        }
    }

    /// Publishes an Event about `lease`, if the budget has room for it (Events go last), in a
    /// task of its own: an Event is a report, never a step of a hand-over, so the reconcile goes
    /// on (to the release in the store, to the next claim's grant) without waiting for the two
    /// requests an Event costs the API server.
    pub(crate) fn publish(&self, lease: &TargetLease, reason: Reason, note: String) {
        let type_ = if matches!(reason, Reason::Lost | Reason::Expired) {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let event = KubeEvent {
            type_,
            reason: reason.as_str().to_owned(),
            note: Some(note),
            action: reason.as_str().to_owned(),
            secondary: None,
        };
        let reference = lease.object_ref(&());
        let name = lease.name_any();
        let (budget, recorder, metrics) = (
            Arc::clone(&self.budget),
            self.recorder.clone(),
            Arc::clone(&self.metrics),
        );
        tokio::spawn(async move {
            let Some(admitted) = budget.admit(Priority::Event, Instant::now()) else {
                metrics.shed("event");
                return;
            };
            let result = recorder.publish(&event, &reference).await;
            admitted.done(
                Instant::now(),
                result.as_ref().err().is_some_and(is_overload),
            );
            if let Err(e) = result {
                warn!(error = %e, lease = %name, "could not publish event");
            }
        });
    }
}
