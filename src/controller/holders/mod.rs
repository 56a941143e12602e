//! What the controller knows of the holders of its claims: their pods (`spec.holderRef`,
//! [`pods`]) and the heartbeats of `targetlease run` ([`heartbeat`]). A reconcile asks one
//! question, [`Holders::facts`]: is the holder gone, and if its fate is unknown, why.

pub(crate) mod heartbeat;
pub(crate) mod pods;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, ResourceExt};
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;
use tracing::warn;

use self::heartbeat::Heartbeats;
pub use self::pods::PodScope;
use self::pods::{Fate, Pods, fate_of};
use super::claim::Claim;
use crate::api::heartbeat::{judged_ttl, stale_after};
use crate::api::{HolderRef, TargetLease};

/// What is known of a claim's holder.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct HolderFacts {
    /// Why the holder is gone, if it is (its pod is gone, finished or another pod of that name,
    /// or its `targetlease run`'s heartbeat has been silent for half the TTL).
    pub(crate) gone: Option<String>,
    /// Why the holder's fate is unknown, if it is (its pod could not be read).
    pub(crate) unknown: Option<String>,
    /// How long its heartbeat has not changed; `None` when it carries none.
    pub(crate) silent: Option<Duration>,
    /// Whether its pod is gone or finished (its containers stopped).
    pub(crate) pod_gone: bool,
}

/// What the controller knows of a holder pod.
#[derive(Debug, PartialEq)]
enum PodFate {
    /// Not tracked here, or alive.
    Kept,
    /// Gone, finished or another pod of that name.
    Done,
    /// It could not be read: nothing is known of it.
    Unreadable,
}

/// The holder pods named by `spec.holderRef` and the heartbeats of `targetlease run`.
pub(crate) struct Holders {
    client: Client,
    scope: PodScope,
    pods: Pods,
    heartbeats: Heartbeats,
}

impl Holders {
    /// Holders read through `client` within `scope`; a change of a holder pod wakes its claims
    /// through `wake`.
    pub(crate) fn new(
        client: Client,
        scope: PodScope,
        wake: UnboundedSender<ObjectRef<TargetLease>>,
    ) -> Self {
        Self {
            client,
            scope,
            pods: Pods::new(wake),
            heartbeats: Heartbeats::default(),
        }
    }

    /// The pod watches to run (one per namespace of the scope, given the TargetLease watch's
    /// namespace), each until the stream ends.
    pub(crate) fn watches(
        &self,
        watched: &[String],
    ) -> Vec<impl Future<Output = ()> + Send + 'static> {
        self.scope
            .watches(watched)
            .into_iter()
            .map(|namespace| self.pods.clone().watch(self.client.clone(), namespace))
            .collect()
    }

    /// What is known of `claim`'s holder now.
    pub(crate) async fn facts(&self, claim: &Claim<'_>) -> HolderFacts {
        let lease = claim.lease;
        let silent = self.heartbeats.silent_for(lease, Instant::now());
        let mut facts = HolderFacts {
            silent,
            ..HolderFacts::default()
        };
        if let Some(holder) = &lease.spec.holder_ref {
            match self.pod_fate(lease, holder).await {
                PodFate::Done => {
                    facts.pod_gone = true;
                    facts.gone = Some(format!(
                        "holder pod {} is gone, has finished or is another pod of that name",
                        holder.name
                    ));
                    return facts;
                }
                PodFate::Unreadable => {
                    facts.unknown = Some(format!(
                        "holder pod {} could not be read (details in the controller's log): the \
                         lease is renewed, but the pod's end is not noticed until it can be read \
                         again; check the controller's rights to read pods in this namespace",
                        holder.name
                    ));
                }
                PodFate::Kept => {}
            }
        }
        let limit = stale_after(judged_ttl(lease));
        facts.gone = silent.filter(|s| *s >= limit).map(|s| {
            format!(
                "the heartbeat of targetlease run stopped {} s ago (limit {} ms, half the TTL)",
                s.as_secs(),
                limit.as_millis()
            )
        });
        facts
    }

    async fn pod_fate(&self, lease: &TargetLease, holder: &HolderRef) -> PodFate {
        let ns = lease.namespace().unwrap_or_default();
        if !self.scope.covers(&ns) {
            // Not tracked here (no right to read these pods): the heartbeat of `targetlease run`
            // and the garbage collection of TargetLeases owned by deleted pods still apply.
            return PodFate::Kept;
        }
        let uid = holder.uid.as_deref();
        let done = |fate: Option<Fate>| {
            if fate.is_none_or(|fate| fate == Fate::Done) {
                PodFate::Done
            } else {
                PodFate::Kept
            }
        };
        let key = ObjectRef::from_obj(lease);
        if let Some(fate) = self.pods.register(key.clone(), &ns, &holder.name, uid) {
            return done(Some(fate));
        }
        // The watch has not seen the pod (yet): read it once.
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let pod = match pods.get_opt(&holder.name).await {
            Ok(pod) => pod,
            Err(e) => {
                // A failed read says nothing of the holder: the lease is kept (renewed) rather
                // than lost, and the status says the holder is not tracked.
                warn!(error = %e, lease = %lease.name_any(), pod = %holder.name, "could not read the holder pod");
                return PodFate::Unreadable;
            }
        };
        let fate = pod.as_ref().map_or(Fate::Done, fate_of);
        let pod_uid = pod.as_ref().and_then(|p| p.metadata.uid.clone());
        self.pods.record(&ns, &holder.name, fate, pod_uid);
        done(self.pods.register(key, &ns, &holder.name, uid))
    }

    /// What the pod watch does when it sees pod `namespace/name` deleted.
    #[cfg(test)]
    pub(crate) fn pod_deleted_for_tests(&self, namespace: &str, name: &str) {
        let mut pod = Pod::default();
        pod.metadata.name = Some(name.into());
        pod.metadata.namespace = Some(namespace.into());
        self.pods
            .apply(&None, kube::runtime::watcher::Event::Delete(pod));
    }

    /// Forgets a deleted TargetLease.
    pub(crate) fn forget(&self, key: &ObjectRef<TargetLease>) {
        self.pods.unregister(key);
        self.heartbeats.forget(key);
    }
}
