//! One `run`'s hold on its TargetLease: what it hears ([`Monitor`]), how far it trusts the lease
//! ([`Trust`]), the TTL its heartbeats announce, and what a TargetLease says of a tenure.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::info;

use super::monitor::Monitor;
use super::trust::Trust;
use crate::api::{MAX_TTL_SECONDS, Phase, TargetLease};

/// The tenure the command runs under, as its status showed it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holding {
    /// Its fencing token.
    pub(super) token: u64,
    /// Its slot (0 for an exclusive lease).
    pub(super) slot: u32,
}

/// What a TargetLease says about the tenure with `token`: `None` while it holds it, else why not.
pub(super) fn lost_because(lease: &TargetLease, token: u64) -> Option<String> {
    if lease.metadata.deletion_timestamp.is_some() {
        return Some("the TargetLease is being deleted".into());
    }
    let status = lease.status.as_ref();
    let phase = status.map(|s| s.phase);
    let current = status.and_then(|s| s.fencing_token);
    (phase != Some(Phase::Held) || current != Some(token)).then(|| {
        format!(
            "phase {:?} with token {current:?}, not Held with token {token}",
            phase.unwrap_or_default()
        )
    })
}

/// The token and slot of a Held TargetLease that is not being deleted.
pub(super) fn held_token(lease: &TargetLease) -> Option<(u64, u32)> {
    let status = lease.status.as_ref()?;
    let token = status.fencing_token?;
    let slot = status.slot.unwrap_or(0);
    lost_because(lease, token)
        .is_none()
        .then_some((token, slot))
}

/// One `run`'s hold on its TargetLease: what it hears, how far it trusts the lease, and the TTL
/// its heartbeats announce.
pub(super) struct Session {
    pub(super) monitor: Monitor,
    pub(super) name: String,
    pub(super) uid: String,
    pub(super) trust: Trust,
    pub(super) ttl: watch::Sender<Duration>,
    /// The token of the last Held status seen while no command ran.
    pub(super) seen_token: Option<u64>,
}

impl Session {
    /// Follows the TTL the TargetLease's spec asks (see [`Trust::follow`]).
    pub(super) fn follow(&mut self, lease: &TargetLease) {
        let seconds = lease.spec.ttl_seconds.clamp(1, MAX_TTL_SECONDS);
        let wanted = Duration::from_secs(u64::from(seconds));
        if *self.ttl.borrow() != wanted {
            info!(name = %self.name, ttl = ?wanted, "ttlSeconds changed: following it");
            self.trust.follow(wanted, Instant::now());
            let _ = self.ttl.send(wanted);
        }
    }

    /// Remembers the token of a Held status seen while waiting.
    pub(super) fn saw(&mut self, lease: &TargetLease) {
        if let Some(status) = lease.status.as_ref().filter(|s| s.phase == Phase::Held) {
            self.seen_token = status.fencing_token.or(self.seen_token);
        }
    }
}
