//! Watching one TargetLease for `run` and `wait`: every version of it, and its disappearance,
//! through watch errors and relists. kube-runtime's `await_condition` ends on the first watch
//! error and never reports a deletion; a lease client needs both.

use futures::{Stream, StreamExt};
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tracing::warn;

use crate::api::TargetLease;

/// What the watch saw of the TargetLease.
#[derive(Debug)]
pub enum Sighting {
    /// A version of it (deletion may have started: look at `deletionTimestamp`).
    Present(Box<TargetLease>),
    /// It is gone: a delete event, or a relist that did not list it.
    Gone,
}

/// Watches the TargetLease `name`. Watch errors are logged and retried with the watcher's
/// backoff, never returned: the stream ends only when the caller drops it.
pub fn watch_one(api: Api<TargetLease>, name: &str) -> impl Stream<Item = Sighting> + Send + use<> {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut listed = false;
    watcher(api, config)
        .default_backoff()
        .filter_map(move |event| {
            let seen = match event {
                Ok(watcher::Event::Apply(lease)) => Some(Sighting::Present(Box::new(lease))),
                Ok(watcher::Event::InitApply(lease)) => {
                    listed = true;
                    Some(Sighting::Present(Box::new(lease)))
                }
                Ok(watcher::Event::Delete(_)) => Some(Sighting::Gone),
                Ok(watcher::Event::Init) => {
                    listed = false;
                    None
                }
                Ok(watcher::Event::InitDone) => (!listed).then_some(Sighting::Gone),
                Err(e) => {
                    warn!(error = %e, "TargetLease watch failed; retrying with backoff");
                    None
                }
            };
            futures::future::ready(seen)
        })
}
