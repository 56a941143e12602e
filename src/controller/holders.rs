//! Tracks the pods named by `spec.holderRef`, so a lease is released as soon as its holder is
//! deleted or has finished. Pods are watched, but only the fate of referenced pods is kept:
//! memory grows with the number of holders, not with the number of pods in the cluster.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use crate::api::TargetLease;

/// What became of a holder pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// The pod exists and has not finished.
    Alive,
    /// The pod reached Succeeded or Failed, or is gone.
    Done,
}

type PodKey = (String, String);

#[derive(Default)]
struct State {
    fates: HashMap<PodKey, Fate>,
    referrers: HashMap<PodKey, HashSet<ObjectRef<TargetLease>>>,
}

/// Shared between the reconciler (which registers references) and the pod watch (which records
/// fates and wakes the referring TargetLeases).
#[derive(Clone)]
pub struct Holders {
    state: Arc<Mutex<State>>,
    wake: UnboundedSender<ObjectRef<TargetLease>>,
}

/// The fate of a pod object.
pub fn fate_of(pod: &Pod) -> Fate {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    match phase {
        Some("Succeeded" | "Failed") => Fate::Done,
        _ => Fate::Alive,
    }
}

impl Holders {
    /// An empty tracker that wakes TargetLeases through `wake`.
    pub fn new(wake: UnboundedSender<ObjectRef<TargetLease>>) -> Self {
        Self {
            state: Arc::default(),
            wake,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers that `lease` depends on pod `namespace/name` and returns the pod's fate if the
    /// watch has seen it.
    pub fn register(
        &self,
        lease: ObjectRef<TargetLease>,
        namespace: &str,
        name: &str,
    ) -> Option<Fate> {
        let key = (namespace.to_owned(), name.to_owned());
        let mut state = self.lock();
        state
            .referrers
            .entry(key.clone())
            .or_default()
            .insert(lease);
        state.fates.get(&key).copied()
    }

    /// Records a fate learned by a direct read (the watch had not seen the pod yet).
    pub fn record(&self, namespace: &str, name: &str, fate: Fate) {
        let key = (namespace.to_owned(), name.to_owned());
        let mut state = self.lock();
        if state.referrers.contains_key(&key) {
            state.fates.insert(key, fate);
        }
    }

    /// Forgets that `lease` depends on any pod (it was deleted).
    pub fn unregister(&self, lease: &ObjectRef<TargetLease>) {
        let mut state = self.lock();
        let State { fates, referrers } = &mut *state;
        referrers.retain(|key, leases| {
            leases.remove(lease);
            let keep = !leases.is_empty();
            if !keep {
                fates.remove(key);
            }
            keep
        });
    }

    /// Applies a pod event: referenced pods get their fate recorded and their TargetLeases woken
    /// when the fate changed; other pods are dropped on the spot.
    fn observe(&self, namespace: &str, name: &str, fate: Fate) {
        let key = (namespace.to_owned(), name.to_owned());
        let to_wake: Vec<ObjectRef<TargetLease>> = {
            let mut state = self.lock();
            let Some(referrers) = state.referrers.get(&key) else {
                return;
            };
            let referrers: Vec<_> = referrers.iter().cloned().collect();
            if state.fates.insert(key, fate) == Some(fate) {
                return;
            }
            referrers
        };
        for lease in to_wake {
            debug!(pod = %name, namespace, ?fate, "holder changed, waking its TargetLease");
            let _ = self.wake.send(lease);
        }
    }

    /// Watches pods (in one namespace or all) until the stream ends; restarts on errors with the
    /// watcher's own backoff.
    pub async fn watch(self, client: Client, namespace: Option<String>) {
        let api: Api<Pod> = match &namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        };
        let stream = watcher(api, watcher::Config::default().any_semantic());
        let stream = kube::runtime::WatchStreamExt::default_backoff(stream);
        futures::pin_mut!(stream);
        loop {
            match stream.try_next().await {
                Ok(Some(event)) => self.apply(event),
                Ok(None) => return,
                Err(e) => warn!(error = %e, "pod watch failed; retrying"),
            }
        }
    }

    fn apply(&self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                let ns = pod.namespace().unwrap_or_default();
                self.observe(&ns, &pod.name_any(), fate_of(&pod));
            }
            watcher::Event::Delete(pod) => {
                let ns = pod.namespace().unwrap_or_default();
                self.observe(&ns, &pod.name_any(), Fate::Done);
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }
}
