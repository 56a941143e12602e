//! What `run` hears about its TargetLease: the watch, the replies to its own heartbeats (the
//! only thing that extends its trust in the lease) and signals, one stream of [`Heard`].

use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use nix::sys::signal::Signal;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tracing::warn;

use crate::api::TargetLease;
use crate::api::heartbeat::HEARTBEAT_ANNOTATION;
use crate::api::heartbeat::{Beat as HeartbeatValue, Windows};
use crate::cli::client::refusal;
use crate::cli::watch::Sighting;

/// SIGTERM and SIGINT, whenever they come: one listener for the whole life of `run`.
pub(super) fn listen_for_signals() -> watch::Receiver<Option<Signal>> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            warn!("cannot listen for SIGTERM/SIGINT");
            return;
        };
        loop {
            let got = tokio::select! {
                _ = term.recv() => Signal::SIGTERM,
                _ = int.recv() => Signal::SIGINT,
            };
            // Only the first one counts; later ones change nothing.
            if tx.borrow().is_none() {
                let _ = tx.send(Some(got));
            }
        }
    });
    rx
}

/// A heartbeat the API server applied: when `run` sent it, the TTL it announced, and the
/// TargetLease the reply showed.
#[derive(Clone)]
pub(super) struct Beat {
    sent: Instant,
    ttl: Duration,
    lease: TargetLease,
}

/// What `run` hears about its TargetLease: the watch, its own heartbeat replies and signals.
pub(super) struct Monitor {
    pub(super) sightings: std::pin::Pin<Box<dyn Stream<Item = Sighting> + Send>>,
    /// The uid of the TargetLease this `run` made or adopted: another object of that name (one
    /// that replaced it) is not ours.
    pub(super) uid: String,
    pub(super) beats: watch::Receiver<Option<Beat>>,
    pub(super) signals: watch::Receiver<Option<Signal>>,
    /// Whether the signal was reported already: it is reported once.
    pub(super) signalled: bool,
}

/// One thing `run` heard.
pub(super) enum Heard {
    /// A version of the TargetLease from the watch.
    Lease(Box<TargetLease>),
    /// The reply to a heartbeat sent at `sent`, which announced `ttl`.
    Beat {
        sent: Instant,
        ttl: Duration,
        lease: Box<TargetLease>,
    },
    Gone,
    Signal(Signal),
}

impl Monitor {
    pub(super) async fn next(&mut self) -> Heard {
        loop {
            if !self.signalled
                && let Some(signal) = *self.signals.borrow_and_update()
            {
                self.signalled = true;
                return Heard::Signal(signal);
            }
            tokio::select! {
                seen = self.sightings.next() => match seen {
                    Some(Sighting::Present(lease)) if lease.uid().as_deref() == Some(&self.uid) => {
                        return Heard::Lease(lease);
                    }
                    Some(Sighting::Present(_) | Sighting::Gone) => return Heard::Gone,
                    // The watch never ends on its own; if it does, the heartbeat still confirms.
                    None => self.sightings = Box::pin(futures::stream::pending()),
                },
                changed = self.beats.changed() => match changed {
                    Ok(()) => if let Some(beat) = self.beats.borrow_and_update().clone() {
                        return Heard::Beat { sent: beat.sent, ttl: beat.ttl, lease: Box::new(beat.lease) };
                    },
                    // The heartbeat task ended: nothing confirms any more.
                    Err(_) => {
                        let (_, rx) = watch::channel(None);
                        self.beats = rx;
                    }
                },
                changed = self.signals.changed(), if !self.signalled => if changed.is_err() {
                    // The listener is gone: wait for the other sources only.
                    self.signalled = true;
                },
            }
        }
    }
}

/// Refreshes the heartbeat, announcing the TTL `ttl` holds, every sixth of it after the one
/// sent at `last` (counted from send to send, each request bounded by the interval; a create
/// that took long is followed by a beat at once, and so is a change of the TTL) and publishes
/// each reply with the instant it was sent: it is also `run`'s confirmation that it holds the
/// lease. It never waits for the reader, so heartbeats go on however busy `run` is. The patch
/// names the uid: it fails on an object that replaced ours.
pub(super) async fn heartbeat(
    api: Api<TargetLease>,
    name: String,
    uid: String,
    mut ttl: watch::Receiver<Duration>,
    last: Instant,
    replies: watch::Sender<Option<Beat>>,
) {
    let interval = |ttl: Duration| Windows::new(ttl, Duration::ZERO).beat;
    let mut next = last + interval(*ttl.borrow());
    loop {
        tokio::select! {
            _ = sleep_until(next) => {}
            changed = ttl.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
        let announced = *ttl.borrow_and_update();
        let sent = Instant::now();
        let every = interval(announced);
        next = sent + every;
        let value = HeartbeatValue {
            wall_ms: crate::time::wall_ms(),
            ttl_seconds: u32::try_from(announced.as_secs()).ok(),
        }
        .value();
        let beat = json!({"metadata": {
            "uid": uid,
            "annotations": {HEARTBEAT_ANNOTATION: value},
        }});
        let (params, beat) = (PatchParams::default(), Patch::Merge(&beat));
        match tokio::time::timeout(every, api.patch(&name, &params, &beat)).await {
            Ok(Ok(lease)) => {
                let reply = Beat {
                    sent,
                    ttl: announced,
                    lease,
                };
                if replies.send(Some(reply)).is_err() {
                    return;
                }
            }
            Ok(Err(e)) => warn!(%name, error = %refusal(&e), "heartbeat failed; retrying"),
            Err(_) => warn!(%name, "heartbeat not answered within its interval; retrying"),
        }
    }
}
