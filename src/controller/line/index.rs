//! TargetLeases by target, so that the token floor of an acquire and the waiters of a release
//! are found without scanning every TargetLease the controller knows (which made a burst of N
//! new leases cost O(N²)).
//!
//! The index only narrows the search: it maps (namespace, target) to names, and every lookup
//! reads the objects from the reflector's store and checks their target again, so an entry that
//! went stale (a delete missed while the watch was down) never yields a wrong object.
//!
//! It also numbers the TargetLeases in the order the watch first delivered them: the order of
//! the line within one second of `creationTimestamp` (see [`queue`](super::queue)).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use crate::api::TargetLease;

type TargetKey = (String, String);
type NameKey = (String, String);

#[derive(Default)]
struct Inner {
    by_target: HashMap<TargetKey, HashSet<String>>,
    target_of: HashMap<NameKey, String>,
    /// By uid: the number of the event that first delivered the object.
    seen: HashMap<String, u64>,
    next_seen: u64,
}

impl Inner {
    fn insert(&mut self, lease: &TargetLease) {
        let (Some(ns), name) = (lease.metadata.namespace.as_deref(), lease.name_any()) else {
            return;
        };
        if let Some(uid) = lease.metadata.uid.as_ref()
            && !self.seen.contains_key(uid)
        {
            self.seen.insert(uid.clone(), self.next_seen);
            self.next_seen += 1;
        }
        let target = &lease.spec.target;
        let name_key = (ns.to_owned(), name.clone());
        match self.target_of.get(&name_key) {
            Some(known) if known == target => return,
            // Recreated under the same name with another target.
            Some(_) => self.remove_name(&name_key),
            None => {}
        }
        self.by_target
            .entry((ns.to_owned(), target.clone()))
            .or_default()
            .insert(name);
        self.target_of.insert(name_key, target.clone());
    }

    fn remove_name(&mut self, name_key: &NameKey) {
        let Some(target) = self.target_of.remove(name_key) else {
            return;
        };
        let target_key = (name_key.0.clone(), target);
        if let Some(names) = self.by_target.get_mut(&target_key) {
            names.remove(&name_key.1);
            if names.is_empty() {
                self.by_target.remove(&target_key);
            }
        }
    }
}

/// (namespace, target) -> names of the TargetLeases on it. Cheap to clone; clones share.
#[derive(Clone, Default)]
pub(crate) struct TargetIndex {
    inner: Arc<Mutex<Inner>>,
}

impl TargetIndex {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies one watch event; call it after the reflector applied the event to `store`.
    pub(crate) fn observe(&self, event: &watcher::Event<TargetLease>, store: &Store<TargetLease>) {
        match event {
            watcher::Event::Apply(lease) | watcher::Event::InitApply(lease) => {
                self.lock().insert(lease);
            }
            watcher::Event::Delete(lease) => {
                let mut inner = self.lock();
                if let Some(ns) = lease.metadata.namespace.clone() {
                    inner.remove_name(&(ns, lease.name_any()));
                }
                if let Some(uid) = lease.metadata.uid.as_ref() {
                    inner.seen.remove(uid);
                }
            }
            // A relist replaced the store: rebuild from it, dropping whatever was deleted while
            // the watch was down. The numbers of the objects still there are kept (the line's
            // order does not change with a relist); those listed for the first time come after.
            watcher::Event::InitDone => {
                let mut inner = self.lock();
                let mut fresh = Inner {
                    next_seen: inner.next_seen,
                    ..Inner::default()
                };
                let state = store.state();
                for lease in &state {
                    if let Some(uid) = lease.metadata.uid.as_ref()
                        && let Some(n) = inner.seen.get(uid)
                    {
                        fresh.seen.insert(uid.clone(), *n);
                    }
                }
                for lease in &state {
                    fresh.insert(lease);
                }
                *inner = fresh;
            }
            watcher::Event::Init => {}
        }
    }

    /// The place of `lease` in the order the watch first delivered TargetLeases: for a watch
    /// that runs, the order they were created in; for those that existed when it started (a
    /// restart, a new leader), the order of its first list, by name within a namespace. A lease
    /// not seen yet comes after every one seen.
    pub(crate) fn seen_order(&self, lease: &TargetLease) -> u64 {
        lease
            .metadata
            .uid
            .as_ref()
            .and_then(|uid| self.lock().seen.get(uid).copied())
            .unwrap_or(u64::MAX)
    }

    /// The TargetLeases on `target` in `namespace`, read from `store`.
    pub(crate) fn leases_on(
        &self,
        store: &Store<TargetLease>,
        namespace: &str,
        target: &str,
    ) -> Vec<Arc<TargetLease>> {
        let names: Vec<String> = self
            .lock()
            .by_target
            .get(&(namespace.to_owned(), target.to_owned()))
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default();
        names
            .into_iter()
            .filter_map(|name| store.get(&ObjectRef::new(&name).within(namespace)))
            .filter(|lease| lease.spec.target == target)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::test_spec;
    use kube::runtime::reflector::store::Writer;

    fn lease(ns: &str, name: &str, target: &str) -> TargetLease {
        let mut l = TargetLease::new(name, test_spec(target, "h"));
        l.metadata.namespace = Some(ns.into());
        l.metadata.uid = Some(format!("uid-{ns}-{name}"));
        l
    }

    fn apply(
        writer: &mut Writer<TargetLease>,
        index: &TargetIndex,
        event: watcher::Event<TargetLease>,
    ) {
        writer.apply_watcher_event(&event);
        index.observe(&event, &writer.as_reader());
    }

    fn names(index: &TargetIndex, store: &Store<TargetLease>, ns: &str, t: &str) -> Vec<String> {
        let mut v: Vec<String> = index
            .leases_on(store, ns, t)
            .iter()
            .map(|l| l.name_any())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn finds_leases_by_target_and_forgets_deleted_ones() {
        let mut writer = Writer::<TargetLease>::default();
        let store = writer.as_reader();
        let index = TargetIndex::default();
        apply(
            &mut writer,
            &index,
            watcher::Event::Apply(lease("a", "x", "t1")),
        );
        apply(
            &mut writer,
            &index,
            watcher::Event::Apply(lease("a", "y", "t1")),
        );
        apply(
            &mut writer,
            &index,
            watcher::Event::Apply(lease("b", "z", "t1")),
        );
        apply(
            &mut writer,
            &index,
            watcher::Event::Apply(lease("a", "w", "t2")),
        );
        assert_eq!(names(&index, &store, "a", "t1"), ["x", "y"]);
        assert_eq!(names(&index, &store, "b", "t1"), ["z"]);
        apply(
            &mut writer,
            &index,
            watcher::Event::Delete(lease("a", "x", "t1")),
        );
        assert_eq!(names(&index, &store, "a", "t1"), ["y"]);
        // Recreated with another target.
        apply(
            &mut writer,
            &index,
            watcher::Event::Apply(lease("a", "y", "t3")),
        );
        assert!(names(&index, &store, "a", "t1").is_empty());
        assert_eq!(names(&index, &store, "a", "t3"), ["y"]);
    }

    #[test]
    fn relist_drops_what_was_deleted_meanwhile() {
        let mut writer = Writer::<TargetLease>::default();
        let store = writer.as_reader();
        let index = TargetIndex::default();
        apply(
            &mut writer,
            &index,
            watcher::Event::Apply(lease("a", "x", "t1")),
        );
        apply(
            &mut writer,
            &index,
            watcher::Event::Apply(lease("a", "y", "t1")),
        );
        apply(&mut writer, &index, watcher::Event::Init);
        apply(
            &mut writer,
            &index,
            watcher::Event::InitApply(lease("a", "y", "t1")),
        );
        apply(&mut writer, &index, watcher::Event::InitDone);
        assert_eq!(names(&index, &store, "a", "t1"), ["y"]);
        assert_eq!(index.lock().target_of.len(), 1);
        assert_eq!(index.lock().seen.len(), 1);
    }

    /// The order the watch first delivered each object in: kept through updates and relists,
    /// new for an object recreated under the same name (a new uid), last for one never seen.
    #[test]
    fn numbers_objects_in_the_order_first_seen() {
        let mut writer = Writer::<TargetLease>::default();
        let index = TargetIndex::default();
        let (zz, aa) = (lease("a", "zz", "t"), lease("a", "aa", "t"));
        apply(&mut writer, &index, watcher::Event::Apply(zz.clone()));
        apply(&mut writer, &index, watcher::Event::Apply(aa.clone()));
        assert!(index.seen_order(&zz) < index.seen_order(&aa));
        // Updates and a relist (which lists by name) keep the first order.
        apply(&mut writer, &index, watcher::Event::Apply(zz.clone()));
        apply(&mut writer, &index, watcher::Event::Init);
        apply(&mut writer, &index, watcher::Event::InitApply(aa.clone()));
        apply(&mut writer, &index, watcher::Event::InitApply(zz.clone()));
        apply(&mut writer, &index, watcher::Event::InitDone);
        assert!(index.seen_order(&zz) < index.seen_order(&aa));
        // Recreated: a new uid, a new place at the end.
        apply(&mut writer, &index, watcher::Event::Delete(zz.clone()));
        let mut again = zz.clone();
        again.metadata.uid = Some("uid-a-zz-2".into());
        apply(&mut writer, &index, watcher::Event::Apply(again.clone()));
        assert!(index.seen_order(&again) > index.seen_order(&aa));
        assert_eq!(index.seen_order(&zz), u64::MAX);
    }
}
