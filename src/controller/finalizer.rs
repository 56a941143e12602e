//! The controller's finalizer: kube-runtime's `finalizer()` with the object's uid as a
//! precondition of both of its patches, and a removal that finds its object gone counted as done.
//!
//! Why not kube-runtime's own: its patches name the object and nothing else. The status write of
//! a cleanup queues another reconcile of the same object, which can run on the cached, deleting
//! copy after the finalizer went and the object with it. Its removal patch then meets either
//! nothing (404: the cleanup was a failure that is retried, though nothing is left to do) or a
//! new object that took the name meanwhile (a `run` command creates its claim's name again right
//! after deleting it), whose finalizer it stripped: a deletion of that object in the moment
//! before the finalizer came back would have skipped its cleanup, its lease left in the store
//! until its TTL ran out.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, RemoveOperation, TestOperation};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Error, Event};
use kube::{Api, Resource, ResourceExt};
use serde_json::Value;

use crate::api::TargetLease;

/// The objects whose finalizer this process removed, by uid, until a while after the watch
/// said they are gone. A cleanup's own status write queues one more reconcile of its object,
/// and the next claim's grant wakes it too; such a reconcile runs on the cached, deleting copy
/// after the finalizer went. With nothing left to do, it would still ask the store what the
/// lease id holds and patch a finalizer that is no longer there (a request refused with 404, at
/// the moment the next claim's grant is being written).
///
/// A uid is kept [`KEPT_AFTER_GONE`] after the watch said its object is gone, not forgotten at
/// once: a reconcile can take its copy of the object from the cache just before the watch says
/// it is gone, and must still find the uid here. The watch can also say so before the removal
/// is recorded (its Delete event handled before the patch's answer): the time it went is kept
/// for a uid not yet marked, so every entry is forgotten a while after its object went.
#[derive(Default)]
pub struct Removed(Mutex<HashMap<String, Entry>>);

/// What [`Removed`] knows of one uid.
#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    /// This process removed the object's finalizer.
    removed: bool,
    /// When the watch said the object is gone.
    gone: Option<Instant>,
}

/// How long a uid stays in [`Removed`] after the watch said its object is gone: longer than any
/// reconcile that started before may run (the reconciler asserts it against its limit).
pub(crate) const KEPT_AFTER_GONE: Duration = Duration::from_secs(60);

impl Removed {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this process removed the finalizer of the object with `uid`.
    pub(crate) fn contains(&self, uid: &str) -> bool {
        self.lock().get(uid).is_some_and(|entry| entry.removed)
    }

    /// The finalizer of the object with `uid` was removed.
    pub(crate) fn mark(&self, uid: &str) {
        let now = Instant::now();
        let mut entries = self.lock();
        entries.entry(uid.to_owned()).or_default().removed = true;
        Self::purge(&mut entries, now);
    }

    /// The watch says the object with `uid` is gone: kept a while longer, and the uids gone
    /// longer than that are forgotten.
    pub(crate) fn forget(&self, uid: &str) {
        let now = Instant::now();
        let mut entries = self.lock();
        entries
            .entry(uid.to_owned())
            .or_default()
            .gone
            .get_or_insert(now);
        Self::purge(&mut entries, now);
    }

    /// A relist: the objects it no longer lists are gone (kept a while longer, as in
    /// [`Removed::forget`]).
    pub(crate) fn retain(&self, listed: &HashSet<String>) {
        let now = Instant::now();
        let mut entries = self.lock();
        for (uid, entry) in entries.iter_mut() {
            if !listed.contains(uid) {
                entry.gone.get_or_insert(now);
            }
        }
        Self::purge(&mut entries, now);
    }

    fn purge(entries: &mut HashMap<String, Entry>, now: Instant) {
        entries.retain(|_, entry| {
            entry
                .gone
                .is_none_or(|at| now.duration_since(at) < KEPT_AFTER_GONE)
        });
    }

    /// How many uids are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Runs `reconcile` as [`kube::runtime::finalizer::finalizer`] does: `Apply` once the object
/// carries `finalizer_name`, which is first added; `Cleanup` once it is being deleted, after which
/// the finalizer is removed. Both patches hold only while the object under the name is the one
/// `lease` is a copy of; a removal is recorded in `removed`.
pub async fn finalizer<Fut, E>(
    api: &Api<TargetLease>,
    finalizer_name: &str,
    removed: &Removed,
    lease: Arc<TargetLease>,
    reconcile: impl FnOnce(Event<TargetLease>) -> Fut,
) -> Result<Action, Error<E>>
where
    Fut: Future<Output = Result<Action, E>>,
    E: std::error::Error + 'static,
{
    let name = lease.meta().name.clone().ok_or(Error::UnnamedObject)?;
    let uid = lease.meta().uid.clone().ok_or(Error::UnnamedObject)?;
    let index = lease.finalizers().iter().position(|f| f == finalizer_name);
    let deleting = lease.meta().deletion_timestamp.is_some();
    match (index, deleting) {
        (Some(_), false) => reconcile(Event::Apply(lease))
            .await
            .map_err(Error::ApplyFailed),
        (Some(index), true) => {
            // The finalizer stays if the cleanup fails.
            let action = reconcile(Event::Cleanup(lease))
                .await
                .map_err(Error::CleanupFailed)?;
            let at = pointer(&format!("/metadata/finalizers/{index}"))?;
            let patch = vec![
                test("/metadata/uid", uid.as_str().into())?,
                // Another controller's finalizer may have moved ours: the test fails, and the
                // change brings a new reconcile.
                PatchOperation::Test(TestOperation {
                    path: at.clone(),
                    value: finalizer_name.into(),
                }),
                PatchOperation::Remove(RemoveOperation { path: at }),
            ];
            match json_patch(api, &name, patch).await {
                Ok(()) => {}
                Err(e) if is_gone(api, &name, &uid, &e).await => {}
                Err(e) => return Err(Error::RemoveFinalizer(e)),
            }
            removed.mark(&uid);
            Ok(action)
        }
        (None, false) => {
            let mut patch = vec![test("/metadata/uid", uid.as_str().into())?];
            // Kubernetes does not deduplicate finalizers: the list is tested as read, so that
            // a finalizer added meanwhile fails the patch (and the change brings a new reconcile).
            if lease.finalizers().is_empty() {
                patch.push(test("/metadata/finalizers", Value::Null)?);
                patch.push(PatchOperation::Add(AddOperation {
                    path: pointer("/metadata/finalizers")?,
                    value: vec![finalizer_name].into(),
                }));
            } else {
                patch.push(test("/metadata/finalizers", lease.finalizers().into())?);
                patch.push(PatchOperation::Add(AddOperation {
                    path: pointer("/metadata/finalizers/-")?,
                    value: finalizer_name.into(),
                }));
            }
            json_patch(api, &name, patch)
                .await
                .map_err(Error::AddFinalizer)?;
            // The patch brings a new reconcile, which applies.
            Ok(Action::await_change())
        }
        (None, true) => Ok(Action::await_change()),
    }
}

/// Whether a refused finalizer removal means the object that was cleaned up is gone: a 404 that
/// names it (a 404 of the route, a version the API server no longer serves, does not), or a
/// failed test after which the name holds no object or one with another uid.
async fn is_gone(api: &Api<TargetLease>, name: &str, uid: &str, error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) if status.code == 404 => names_object(status, name),
        kube::Error::Api(status) if matches!(status.code, 409 | 422) => match api.get(name).await {
            Ok(now) => now.uid().as_deref() != Some(uid),
            Err(kube::Error::Api(status)) if status.code == 404 => names_object(&status, name),
            Err(_) => false,
        },
        _ => false,
    }
}

/// Whether a 404 is about the object `name` (its details name it), not about the route.
fn names_object(status: &kube::core::Status, name: &str) -> bool {
    status.details.as_ref().is_some_and(|d| d.name == name)
}

async fn json_patch(
    api: &Api<TargetLease>,
    name: &str,
    operations: Vec<PatchOperation>,
) -> Result<(), kube::Error> {
    api.patch::<TargetLease>(
        name,
        &PatchParams::default(),
        &Patch::Json(json_patch::Patch(operations)),
    )
    .await
    .map(|_| ())
}

fn pointer<E>(path: &str) -> Result<PointerBuf, Error<E>>
where
    E: std::error::Error + 'static,
{
    PointerBuf::parse(path).map_err(|_| Error::InvalidFinalizer)
}

fn test<E>(path: &str, value: Value) -> Result<PatchOperation, Error<E>>
where
    E: std::error::Error + 'static,
{
    Ok(PatchOperation::Test(TestOperation {
        path: pointer(path)?,
        value,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::{Status, response::StatusDetails};

    fn not_found(details_name: Option<&str>) -> Status {
        let mut status = Status::failure("not found", "NotFound").with_code(404);
        status.details = details_name.map(|name| StatusDetails {
            name: name.to_owned(),
            group: "targetlease.dev".to_owned(),
            kind: "targetleases".to_owned(),
            uid: String::new(),
            causes: Vec::new(),
            retry_after_seconds: 0,
        });
        status
    }

    /// A reconcile can take its copy of a deleted object just before the watch says the object
    /// is gone: it must still find the uid, or it patches the gone object's finalizer again (a
    /// 404, measured in up to one hand-over in three when the object goes early). Forgotten only
    /// once no reconcile that started before can still run.
    #[tokio::test(start_paused = true)]
    async fn a_removal_outlives_the_watch_saying_the_object_is_gone() {
        let removed = Removed::default();
        removed.mark("a");
        removed.mark("b");
        removed.forget("a");
        assert!(
            removed.contains("a"),
            "forgotten while its cleanup may still run"
        );
        removed.retain(&HashSet::from(["a".to_owned()]));
        assert!(removed.contains("b"), "a relist forgot it at once");
        tokio::time::advance(KEPT_AFTER_GONE).await;
        removed.mark("c");
        removed.forget("c");
        assert!(
            !removed.contains("a") && !removed.contains("b"),
            "kept forever"
        );
        assert!(removed.contains("c"));
    }

    /// The watch can say an object is gone before its removal is recorded (the Delete event
    /// handled before the patch's answer, or a removal that found the object gone): the uid
    /// still counts as removed, and is forgotten in time like any other, not kept forever. An
    /// object the watch saw go without this process removing anything does not count as
    /// removed.
    #[tokio::test(start_paused = true)]
    async fn a_removal_recorded_after_the_object_went_is_forgotten_too() {
        let removed = Removed::default();
        removed.forget("late");
        removed.forget("never-ours");
        assert!(!removed.contains("late") && !removed.contains("never-ours"));
        removed.mark("late");
        assert!(removed.contains("late"));
        tokio::time::advance(KEPT_AFTER_GONE).await;
        removed.forget("other");
        assert_eq!(removed.len(), 1, "only the last deletion is still kept");
        assert!(!removed.contains("late"), "kept forever");
    }

    #[test]
    fn only_a_404_naming_the_object_says_it_is_gone() {
        assert!(names_object(&not_found(Some("claim")), "claim"));
        assert!(!names_object(&not_found(Some("other")), "claim"));
        // The API server's answer for a route it does not serve (a version removed by a
        // rollback): the object may well be there.
        assert!(!names_object(&not_found(Some("")), "claim"));
        assert!(!names_object(&not_found(None), "claim"));
    }
}
