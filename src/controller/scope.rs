//! What the controller watches: every namespace, one, or a list (`--watch-namespace a,b`).
//!
//! kube's reflector keeps one cache from one watch, and a relist (`Init` .. `InitDone`)
//! replaces the whole cache. With one watch per namespace of a list, one namespace's relist
//! would wipe the others'. [`Union`] turns the watches' events into one stream the reflector
//! can keep: a single `Init` .. `InitDone` once every namespace has listed (the cache is whole
//! only then, and reconciles wait for it), and afterwards each namespace's relist, once it is
//! complete, as the deletes of what it no longer lists (or lists under a new uid: deleted and
//! made again while the watch was down) followed by every object it listed.
//!
//! Each namespace's watch retries on its own, with its own backoff; its errors are logged with
//! the namespace and go no further, so one namespace's trouble (a missing RoleBinding, say)
//! never holds up the events of the others. The union keeps a copy of every object it has
//! seen, beside the reflector's: twice the cache's memory with a list of namespaces.

use std::collections::{BTreeMap, BTreeSet};

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher::watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tracing::warn;

use crate::api::TargetLease;

/// The events of every watched TargetLease, `modify` applied to each object as it arrives (the
/// controller drops what it never reads before anything is cached).
pub(crate) fn watch_targetleases(
    client: &Client,
    namespaces: &[String],
    modify: fn(&mut TargetLease),
) -> BoxStream<'static, Result<Event<TargetLease>, watcher::Error>> {
    let config = watcher::Config::default().any_semantic();
    match namespaces {
        [] => watcher(Api::all(client.clone()), config)
            .modify(modify)
            .boxed(),
        [one] => watcher(Api::namespaced(client.clone(), one), config)
            .modify(modify)
            .boxed(),
        several => {
            let watches = several.iter().map(|namespace| {
                let namespace = namespace.clone();
                watcher(Api::namespaced(client.clone(), &namespace), config.clone())
                    .default_backoff()
                    .modify(modify)
                    .filter_map(move |item| {
                        let kept = match item {
                            Ok(event) => Some((namespace.clone(), event)),
                            Err(error) => {
                                warn!(namespace = %namespace, error = %error, "cannot watch the TargetLeases of this namespace; retrying");
                                None
                            }
                        };
                        futures::future::ready(kept)
                    })
                    .boxed()
            });
            let mut union = Union::new(several.len());
            futures::stream::select_all(watches)
                .flat_map(move |(namespace, event)| {
                    futures::stream::iter(union.translate(&namespace, event).into_iter().map(Ok))
                })
                .boxed()
        }
    }
}

/// The state that turns several namespaces' watch events into one reflector's (see the
/// module's doc).
pub(crate) struct Union<K> {
    namespaces: usize,
    /// What each namespace holds, by name, as last seen.
    known: BTreeMap<String, BTreeMap<String, K>>,
    /// Each namespace's relist in progress: what it listed so far.
    relisting: BTreeMap<String, BTreeMap<String, K>>,
    /// Namespaces that finished a first list.
    listed: BTreeSet<String>,
    /// Whether every namespace has listed once: the reflector's cache is whole.
    whole: bool,
}

impl<K: Resource + Clone> Union<K> {
    /// A union of `namespaces` watches.
    pub(crate) fn new(namespaces: usize) -> Self {
        Self {
            namespaces,
            known: BTreeMap::new(),
            relisting: BTreeMap::new(),
            listed: BTreeSet::new(),
            whole: false,
        }
    }

    /// The events the reflector sees for `event` of `namespace`'s watch.
    pub(crate) fn translate(&mut self, namespace: &str, event: Event<K>) -> Vec<Event<K>> {
        match event {
            Event::Init => {
                self.relisting.insert(namespace.to_owned(), BTreeMap::new());
                Vec::new()
            }
            Event::InitApply(object) => {
                // Held back until the relist is complete: only then is it known what is gone.
                self.relisting
                    .entry(namespace.to_owned())
                    .or_default()
                    .insert(object.name_any(), object);
                Vec::new()
            }
            Event::InitDone => {
                let listed = self.relisting.remove(namespace).unwrap_or_default();
                let before =
                    std::mem::replace(self.known.entry(namespace.to_owned()).or_default(), listed);
                self.listed.insert(namespace.to_owned());
                let now = &self.known[namespace];
                if self.whole {
                    // Gone, or deleted and made again under the same name (another uid): the
                    // delete first, since the reflector deletes by name.
                    before
                        .into_iter()
                        .filter(|(name, old)| {
                            now.get(name).is_none_or(|new| new.uid() != old.uid())
                        })
                        .map(|(_, old)| Event::Delete(old))
                        .chain(now.values().cloned().map(Event::Apply))
                        .collect()
                } else if self.listed.len() == self.namespaces {
                    self.whole = true;
                    std::iter::once(Event::Init)
                        .chain(
                            self.known
                                .values()
                                .flat_map(|objects| objects.values().cloned())
                                .map(Event::InitApply),
                        )
                        .chain(std::iter::once(Event::InitDone))
                        .collect()
                } else {
                    Vec::new()
                }
            }
            Event::Apply(object) => {
                let replaced = self
                    .known
                    .entry(namespace.to_owned())
                    .or_default()
                    .insert(object.name_any(), object.clone());
                if !self.whole {
                    return Vec::new();
                }
                match replaced {
                    Some(old) if old.uid() != object.uid() => {
                        vec![Event::Delete(old), Event::Apply(object)]
                    }
                    _ => vec![Event::Apply(object)],
                }
            }
            Event::Delete(object) => {
                if let Some(objects) = self.known.get_mut(namespace) {
                    objects.remove(&object.name_any());
                }
                if self.whole {
                    vec![Event::Delete(object)]
                } else {
                    Vec::new()
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::reflector;

    use super::*;
    use crate::api::test_spec;

    fn lease(namespace: &str, name: &str) -> TargetLease {
        let mut lease = TargetLease::new(name, test_spec("t", name));
        lease.metadata.namespace = Some(namespace.into());
        lease.metadata.uid = Some(format!("uid-{namespace}-{name}"));
        lease
    }

    fn remade(mut lease: TargetLease) -> TargetLease {
        lease.metadata.uid = Some("a-new-uid".into());
        lease
    }

    /// Feeds `events` through a union of two namespaces into a real reflector store; returns
    /// the store's names after each step.
    fn cached(events: Vec<(&str, Event<TargetLease>)>) -> Vec<Vec<String>> {
        let (store, mut writer) = reflector::store::<TargetLease>();
        let mut union = Union::new(2);
        let mut seen = Vec::new();
        for (namespace, event) in events {
            for out in union.translate(namespace, event) {
                writer.apply_watcher_event(&out);
            }
            let mut names: Vec<String> = store
                .state()
                .iter()
                .map(|l| format!("{}/{}", l.namespace().unwrap_or_default(), l.name_any()))
                .collect();
            names.sort();
            seen.push(names);
        }
        seen
    }

    #[test]
    fn the_cache_fills_once_every_namespace_listed_and_a_relist_wipes_only_its_namespace() {
        let steps = cached(vec![
            ("a", Event::Init),
            ("a", Event::InitApply(lease("a", "one"))),
            ("a", Event::InitDone),
            // a's changes before b listed: kept, shown when the cache becomes whole.
            ("a", Event::Apply(lease("a", "two"))),
            ("b", Event::Init),
            ("b", Event::InitApply(lease("b", "three"))),
            ("b", Event::InitDone),
            // A relist of b that no longer lists three but lists four: a's stay.
            ("b", Event::Init),
            ("b", Event::InitApply(lease("b", "four"))),
            ("b", Event::InitDone),
            ("a", Event::Delete(lease("a", "one"))),
        ]);
        let names = |i: usize| steps[i].clone();
        assert!(
            names(3).is_empty(),
            "nothing cached before every namespace listed"
        );
        assert_eq!(names(6), ["a/one", "a/two", "b/three"]);
        assert_eq!(
            names(8),
            ["a/one", "a/two", "b/three"],
            "a relist shows once complete"
        );
        assert_eq!(names(9), ["a/one", "a/two", "b/four"]);
        assert_eq!(names(10), ["a/two", "b/four"]);
    }

    #[test]
    fn a_relist_under_way_when_the_cache_becomes_whole_still_arrives() {
        let steps = cached(vec![
            ("a", Event::Init),
            ("a", Event::InitApply(lease("a", "old"))),
            ("a", Event::InitDone),
            // a relists (a 410, say) while b has not listed yet.
            ("a", Event::Init),
            ("a", Event::InitApply(lease("a", "new"))),
            ("b", Event::Init),
            ("b", Event::InitDone),
            ("a", Event::InitDone),
        ]);
        assert_eq!(steps[6], ["a/old"]);
        assert_eq!(steps[7], ["a/new"]);
    }

    #[test]
    fn a_claim_made_again_under_its_name_replaces_the_old_one_by_uid() {
        let (store, mut writer) = reflector::store::<TargetLease>();
        let mut union = Union::new(2);
        let mut deleted = Vec::new();
        for (namespace, event) in [
            ("a", Event::Init),
            ("a", Event::InitApply(lease("a", "x"))),
            ("a", Event::InitDone),
            ("b", Event::Init),
            ("b", Event::InitDone),
            // Deleted and made again while a's watch was down: the relist shows another uid.
            ("a", Event::Init),
            ("a", Event::InitApply(remade(lease("a", "x")))),
            ("a", Event::InitDone),
        ] {
            for out in union.translate(namespace, event) {
                writer.apply_watcher_event(&out);
                if let Event::Delete(old) = &out {
                    deleted.push(old.uid());
                }
            }
        }
        assert_eq!(deleted, [Some("uid-a-x".to_owned())]);
        let cached: Vec<Option<String>> = store.state().iter().map(|l| l.uid()).collect();
        assert_eq!(cached, [Some("a-new-uid".to_owned())]);
        // A live watch's Apply under a new uid replaces the old one the same way.
        let outs = union.translate("a", Event::Apply(lease("a", "x")));
        assert!(
            matches!(&outs[..], [Event::Delete(_), Event::Apply(_)]),
            "{}",
            outs.len()
        );
    }

    #[test]
    fn the_reflector_is_told_its_cache_is_whole_exactly_once() {
        let mut union = Union::new(2);
        let mut inits = 0;
        let mut dones = 0;
        for (namespace, event) in [
            ("a", Event::Init),
            ("a", Event::InitDone),
            ("b", Event::Init),
            ("b", Event::InitDone),
            ("a", Event::Init),
            ("a", Event::InitApply(lease("a", "x"))),
            ("a", Event::InitDone),
        ] {
            for out in union.translate(namespace, event) {
                match out {
                    Event::Init => inits += 1,
                    Event::InitDone => dones += 1,
                    _ => {}
                }
            }
        }
        assert_eq!((inits, dones), (1, 1));
    }
}
