//! Tracks the pods named by `spec.holderRef`, so a lease is released as soon as its holder is
//! deleted or has finished. Pods are watched, but only the fate of referenced pods is kept:
//! memory grows with the number of holders, not with the number of pods in the cluster. A
//! relist (after a 410 Gone or an API server restart) marks every referenced pod it did not
//! list as gone: pods deleted while the watch was down are noticed. A holderRef with a `uid`
//! matches only the pod with that uid: a pod recreated under the same name is not the holder.
//!
//! Reading pods is the widest right the controller has (RBAC cannot limit it to some fields or
//! some pods: whoever may read a pod reads its env too), so [`PodScope`] narrows it to the
//! namespaces where holder pods run, or turns it off: a holder that is not tracked is released
//! when its `targetlease run` stops its heartbeat, or deletes its TargetLease, or when the
//! garbage collector deletes a TargetLease owned by a deleted pod.

use std::collections::{BTreeSet, HashMap, HashSet};
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
pub(crate) enum Fate {
    /// The pod exists and has not finished.
    Alive,
    /// The pod reached Succeeded or Failed, or is gone.
    Done,
}

type PodKey = (String, String);

/// What the watch (or a direct read) last saw of a pod: its fate and its uid.
type Seen = (Fate, Option<String>);

/// Where the controller reads holder pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodScope {
    /// Every namespace the controller watches TargetLeases in (the default).
    Watched,
    /// Only these namespaces; holderRefs elsewhere are not tracked.
    Namespaces(BTreeSet<String>),
    /// No pod anywhere: no holderRef is tracked.
    Off,
}

impl PodScope {
    /// Whether holder pods in `namespace` are tracked.
    pub(crate) fn covers(&self, namespace: &str) -> bool {
        match self {
            PodScope::Watched => true,
            PodScope::Namespaces(namespaces) => namespaces.contains(namespace),
            PodScope::Off => false,
        }
    }

    /// The pod watches to run: one per namespace (`None`: every namespace), given the
    /// namespaces TargetLeases are watched in (none: every namespace).
    pub(crate) fn watches(&self, watched: &[String]) -> Vec<Option<String>> {
        match self {
            PodScope::Watched if watched.is_empty() => vec![None],
            PodScope::Watched => watched.iter().cloned().map(Some).collect(),
            PodScope::Namespaces(namespaces) => namespaces.iter().cloned().map(Some).collect(),
            PodScope::Off => Vec::new(),
        }
    }
}

#[derive(Default)]
struct State {
    seen: HashMap<PodKey, Seen>,
    referrers: HashMap<PodKey, HashSet<ObjectRef<TargetLease>>>,
    /// Referenced pods listed so far by the relists in progress, per watch (by its namespace,
    /// `None` for every namespace): one watch's relist says nothing of another's pods.
    relisted: HashMap<Option<String>, HashSet<PodKey>>,
}

/// The fate of the holder a TargetLease names, given what was seen of the pod of that name.
fn fate_for(seen: &Seen, uid: Option<&str>) -> Fate {
    match (seen, uid) {
        ((Fate::Alive, Some(pod_uid)), Some(wanted)) if pod_uid != wanted => Fate::Done,
        ((fate, _), _) => *fate,
    }
}

/// Shared between the reconciler (which registers references) and the pod watch (which records
/// fates and wakes the referring TargetLeases).
#[derive(Clone)]
pub(crate) struct Pods {
    state: Arc<Mutex<State>>,
    wake: UnboundedSender<ObjectRef<TargetLease>>,
}

/// The fate of a pod object.
pub(crate) fn fate_of(pod: &Pod) -> Fate {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    match phase {
        Some("Succeeded" | "Failed") => Fate::Done,
        _ => Fate::Alive,
    }
}

impl Pods {
    /// An empty tracker that wakes TargetLeases through `wake`.
    pub(crate) fn new(wake: UnboundedSender<ObjectRef<TargetLease>>) -> Self {
        Self {
            state: Arc::default(),
            wake,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers that `lease` depends on pod `namespace/name` (with `uid`, when the holderRef
    /// names one) and returns the holder's fate if the watch has seen the pod.
    pub(crate) fn register(
        &self,
        lease: ObjectRef<TargetLease>,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
    ) -> Option<Fate> {
        let key = (namespace.to_owned(), name.to_owned());
        let mut state = self.lock();
        state
            .referrers
            .entry(key.clone())
            .or_default()
            .insert(lease);
        state.seen.get(&key).map(|seen| fate_for(seen, uid))
    }

    /// Records what a direct read found (the watch had not seen the pod yet).
    pub(crate) fn record(&self, namespace: &str, name: &str, fate: Fate, uid: Option<String>) {
        let key = (namespace.to_owned(), name.to_owned());
        let mut state = self.lock();
        if state.referrers.contains_key(&key) {
            state.seen.insert(key, (fate, uid));
        }
    }

    /// Forgets that `lease` depends on any pod (it was deleted).
    pub(crate) fn unregister(&self, lease: &ObjectRef<TargetLease>) {
        let mut state = self.lock();
        let State {
            seen, referrers, ..
        } = &mut *state;
        referrers.retain(|key, leases| {
            leases.remove(lease);
            let keep = !leases.is_empty();
            if !keep {
                seen.remove(key);
            }
            keep
        });
    }

    /// Applies what was seen of a pod: referenced pods get it recorded and their TargetLeases
    /// woken when it changed; other pods are dropped on the spot.
    fn observe(&self, key: PodKey, now: Seen) {
        let to_wake: Vec<ObjectRef<TargetLease>> = {
            let mut state = self.lock();
            let Some(referrers) = state.referrers.get(&key) else {
                return;
            };
            let referrers: Vec<_> = referrers.iter().cloned().collect();
            for (scope, relisted) in state.relisted.iter_mut() {
                if scope.as_ref().is_none_or(|ns| *ns == key.0) {
                    relisted.insert(key.clone());
                }
            }
            if state.seen.get(&key) == Some(&now) {
                return;
            }
            state.seen.insert(key.clone(), now.clone());
            referrers
        };
        for lease in to_wake {
            debug!(pod = %key.1, namespace = %key.0, fate = ?now.0, "holder changed, waking its TargetLease");
            let _ = self.wake.send(lease);
        }
    }

    /// A relist of the watch of `scope` ended: every referenced pod in its scope that it did
    /// not list is gone (deleted while the watch was down).
    fn relist_done(&self, scope: &Option<String>) {
        let gone: Vec<PodKey> = {
            let mut state = self.lock();
            let Some(listed) = state.relisted.remove(scope) else {
                return;
            };
            state
                .referrers
                .keys()
                .filter(|key| scope.as_ref().is_none_or(|ns| *ns == key.0))
                .filter(|key| !listed.contains(*key))
                .cloned()
                .collect()
        };
        for key in gone {
            self.observe(key, (Fate::Done, None));
        }
    }

    /// Watches pods (in one namespace or all) until the stream ends; restarts on errors with the
    /// watcher's own backoff.
    pub(crate) async fn watch(self, client: Client, namespace: Option<String>) {
        let api: Api<Pod> = match &namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        };
        let stream = watcher(api, watcher::Config::default().any_semantic());
        let stream = kube::runtime::WatchStreamExt::default_backoff(stream);
        futures::pin_mut!(stream);
        loop {
            match stream.try_next().await {
                Ok(Some(event)) => self.apply(&namespace, event),
                Ok(None) => return,
                Err(e) => warn!(error = %e, "pod watch failed; retrying"),
            }
        }
    }

    pub(super) fn apply(&self, scope: &Option<String>, event: watcher::Event<Pod>) {
        let key = |pod: &Pod| (pod.namespace().unwrap_or_default(), pod.name_any());
        match event {
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                self.observe(key(&pod), (fate_of(&pod), pod.metadata.uid.clone()));
            }
            watcher::Event::Delete(pod) => self.observe(key(&pod), (Fate::Done, None)),
            watcher::Event::Init => {
                self.lock().relisted.insert(scope.clone(), HashSet::new());
            }
            watcher::Event::InitDone => self.relist_done(scope),
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::api::ObjectMeta;
    use tokio::sync::mpsc;

    use super::*;

    fn pod(name: &str, uid: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn lease(name: &str) -> ObjectRef<TargetLease> {
        ObjectRef::new(name).within("ns")
    }

    #[test]
    fn a_relist_without_the_pod_means_it_is_gone() {
        let (tx, mut woken) = mpsc::unbounded_channel();
        let holders = Pods::new(tx);
        assert_eq!(holders.register(lease("l"), "ns", "p", None), None);
        holders.apply(&None, watcher::Event::Apply(pod("p", "u1")));
        assert_eq!(woken.try_recv().ok(), Some(lease("l")));
        assert_eq!(
            holders.register(lease("l"), "ns", "p", None),
            Some(Fate::Alive)
        );
        // The pod is deleted while the watch is down; the relist does not list it.
        holders.apply(&None, watcher::Event::Init);
        holders.apply(&None, watcher::Event::InitApply(pod("other", "u9")));
        holders.apply(&None, watcher::Event::InitDone);
        assert_eq!(
            holders.register(lease("l"), "ns", "p", None),
            Some(Fate::Done)
        );
        assert_eq!(woken.try_recv().ok(), Some(lease("l")));
    }

    #[test]
    fn a_relist_speaks_only_for_its_own_namespace() {
        let (tx, _woken) = mpsc::unbounded_channel();
        let holders = Pods::new(tx);
        let mut other = pod("q", "u2");
        other.metadata.namespace = Some("other".into());
        assert_eq!(holders.register(lease("l"), "ns", "p", None), None);
        assert_eq!(holders.register(lease("m"), "other", "q", None), None);
        let (ns, elsewhere) = (Some("ns".to_owned()), Some("other".to_owned()));
        holders.apply(&ns, watcher::Event::Apply(pod("p", "u1")));
        holders.apply(&elsewhere, watcher::Event::Apply(other));
        // The watch of "other" relists without "p": "p" is not its to judge.
        holders.apply(&elsewhere, watcher::Event::Init);
        holders.apply(&elsewhere, watcher::Event::InitDone);
        assert_eq!(
            holders.register(lease("l"), "ns", "p", None),
            Some(Fate::Alive)
        );
        assert_eq!(
            holders.register(lease("m"), "other", "q", None),
            Some(Fate::Done)
        );
    }

    #[test]
    fn scopes_cover_and_watch_what_they_name() {
        let some: PodScope = PodScope::Namespaces(["a".to_owned(), "b".to_owned()].into());
        assert!(PodScope::Watched.covers("x"));
        assert!(some.covers("a") && !some.covers("x"));
        assert!(!PodScope::Off.covers("a"));
        let w = ["w".to_owned()];
        let several = ["v".to_owned(), "w".to_owned()];
        assert_eq!(PodScope::Watched.watches(&[]), vec![None]);
        assert_eq!(PodScope::Watched.watches(&w), vec![Some("w".to_owned())]);
        assert_eq!(
            PodScope::Watched.watches(&several),
            vec![Some("v".to_owned()), Some("w".to_owned())]
        );
        assert_eq!(
            some.watches(&[]),
            vec![Some("a".to_owned()), Some("b".to_owned())]
        );
        assert!(PodScope::Off.watches(&w).is_empty());
    }

    #[test]
    fn a_pod_recreated_under_the_name_is_not_the_holder() {
        let (tx, _woken) = mpsc::unbounded_channel();
        let holders = Pods::new(tx);
        assert_eq!(
            holders.register(lease("l"), "ns", "web-0", Some("old")),
            None
        );
        holders.apply(&None, watcher::Event::Apply(pod("web-0", "old")));
        assert_eq!(
            holders.register(lease("l"), "ns", "web-0", Some("old")),
            Some(Fate::Alive)
        );
        holders.apply(&None, watcher::Event::Delete(pod("web-0", "old")));
        holders.apply(&None, watcher::Event::Apply(pod("web-0", "new")));
        assert_eq!(
            holders.register(lease("l"), "ns", "web-0", Some("old")),
            Some(Fate::Done)
        );
        assert_eq!(
            holders.register(lease("m"), "ns", "web-0", None),
            Some(Fate::Alive)
        );
    }
}
