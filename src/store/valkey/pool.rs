//! A small pool of multiplexed connections with bounded reconnects.
//!
//! Connections are made lazily, one per slot, and handed out round-robin. A connection that
//! broke, stalled past a deadline or reached a read-only node is dropped from its slot; the next
//! call on that slot reconnects. Reconnect attempts of the whole pool share one backoff:
//! exponential from the minimum delay, capped at the maximum, with jitter so that many
//! controllers do not reconnect in lockstep. While the next attempt is further away than a
//! call's deadline, the call fails at once with the last cause instead of waiting in vain.
//!
//! Through Sentinel every connect asks which server is the primary. When a connect finds
//! another primary than the one the pooled connections reach, those connections are dropped
//! before any of them carries another call: each connection belongs to a primary generation,
//! and a connection of an older generation is never handed out; a connection made to the old
//! primary while the store moved is refused. A store in use also asks the sentinels every poll
//! interval ([`Pool::follow_primary`]): a demoted primary keeps accepting writes on its open
//! connections until the sentinels reconfigure it, seconds after the failover. The generation
//! is shared by a store's pools ([`PrimaryState`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;
use tracing::{info, warn};

use super::config::HostPort;
use super::connect::Conn;
use super::open::Opener;
use crate::store::StoreError;
use crate::time::millis;

/// Exponential backoff with jitter, bounded by `max`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Backoff {
    /// The first delay.
    pub min: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Backoff {
    /// The delay before attempt `failures + 1`: `min * 2^(failures-1)` capped at `max`, then
    /// drawn uniformly from its upper half ("equal jitter": never zero, never above `max`).
    pub(super) fn delay(self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(20);
        let ceiling = self.min.saturating_mul(1 << exp).min(self.max);
        let half = ceiling / 2;
        let jitter = rand::rng().random_range(0..=millis(half));
        half + Duration::from_millis(jitter)
    }
}

/// A connection handed out for one attempt of one call.
pub(super) struct Checkout {
    /// The connection (a cheap clone of the pooled one).
    pub conn: Conn,
    slot: usize,
    id: u64,
}

struct Live {
    conn: Conn,
    id: u64,
    /// The primary generation the connection was made in.
    generation: u64,
}

/// One slot of the pool.
#[derive(Default)]
struct Slot {
    /// The live connection. A plain mutex held only to clone or replace it: the common path
    /// (a live connection) neither waits on an async lock nor arms a timer.
    live: Mutex<Option<Live>>,
    /// Held while connecting, so concurrent calls on an empty slot wait for one attempt.
    connecting: tokio::sync::Mutex<()>,
}

impl Slot {
    fn live(&self) -> std::sync::MutexGuard<'_, Option<Live>> {
        // Every write is one assignment, so a panic elsewhere cannot leave it half-written.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Shared reconnect state of the pool.
#[derive(Default)]
struct Reconnect {
    failures: u32,
    retry_at: Option<Instant>,
    last_error: Option<StoreError>,
    down_since: Option<Instant>,
}

/// The pool.
pub(super) struct Pool {
    opener: Opener,
    slots: Box<[Slot]>,
    next_slot: AtomicUsize,
    next_id: AtomicU64,
    backoff: Backoff,
    connect_timeout: Duration,
    reconnect: Mutex<Reconnect>,
    /// Which primary the store's connections reach, shared by its pools.
    primary: Arc<PrimaryState>,
}

/// Which primary a store's connections reach (Sentinel only), shared by its pools: a switch
/// seen by one retires the connections of every pool.
#[derive(Debug, Default)]
pub(super) struct PrimaryState {
    /// Bumped whenever the store moves to another primary.
    generation: AtomicU64,
    /// The primary of the current generation.
    known: Mutex<Option<HostPort>>,
    /// Whether the last poll of the sentinels failed (to log a change, not every poll).
    poll_failing: AtomicBool,
}

impl PrimaryState {
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Option<HostPort>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Pool {
    /// A pool of `size` lazily made connections.
    pub(super) fn new(
        opener: Opener,
        size: usize,
        connect_timeout: Duration,
        backoff: Backoff,
        primary: Arc<PrimaryState>,
    ) -> Self {
        Self {
            opener,
            slots: (0..size.max(1)).map(|_| Slot::default()).collect(),
            next_slot: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            backoff,
            connect_timeout,
            reconnect: Mutex::new(Reconnect::default()),
            primary,
        }
    }

    /// The configured endpoint(s), for messages.
    pub(super) fn endpoint(&self) -> &str {
        self.opener.endpoint()
    }

    /// A connection for one attempt, connecting if its slot is empty. Gives up at `deadline`.
    pub(super) async fn checkout(&self, deadline: Instant) -> Result<Checkout, StoreError> {
        let slot = self.next_slot.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        if let Some(checkout) = self.live(slot) {
            return Ok(checkout);
        }
        let waited = tokio::time::timeout_at(deadline, self.connect_slot(slot, deadline)).await;
        waited.unwrap_or_else(|_| {
            Err(self
                .last_error()
                .unwrap_or_else(|| StoreError::Unavailable {
                    endpoint: self.endpoint().to_owned(),
                    cause: "no connection became available before the call deadline".into(),
                }))
        })
    }

    /// The live connection of `slot`, if it has one of the current primary generation (an
    /// older one is dropped).
    fn live(&self, slot: usize) -> Option<Checkout> {
        let mut guard = self.slots[slot].live();
        // Read under the slot's lock: a switch bumps the generation before it empties the
        // slots, so a connection of the old generation is never handed out after the bump.
        let generation = self.primary.generation();
        if guard
            .as_ref()
            .is_some_and(|live| live.generation < generation)
        {
            *guard = None;
        }
        guard.as_ref().map(|live| Checkout {
            conn: live.conn.clone(),
            slot,
            id: live.id,
        })
    }

    /// Asks the sentinels which server is the primary and, when a majority name another one
    /// than the store's connections reach, moves the store to it: every pooled connection is
    /// retired, and the next call connects to the new primary (and checks its role). Nothing
    /// changes when no majority answers or no connection was made yet; a failing poll is
    /// logged when it starts failing and when it recovers.
    pub(super) async fn follow_primary(&self) {
        let asked_in = self.primary.generation();
        let named = self.opener.named_primary(self.connect_timeout).await;
        let failing = named.is_err();
        if self.primary.poll_failing.swap(failing, Ordering::Relaxed) != failing {
            match &named {
                Err(e) => warn!(
                    endpoint = %self.endpoint(),
                    kind = e.kind().as_str(),
                    error = %e,
                    "the sentinels do not name a primary by a majority; the pooled connections carry on, and a failover is seen only when they break"
                ),
                Ok(_) => info!(endpoint = %self.endpoint(), "the sentinels answer again"),
            }
        }
        let Ok(Some(named)) = named else {
            return;
        };
        let mut known = self.primary.known();
        // A connect that moved the store while the sentinels were asked has the newer answer.
        if self.primary.generation() != asked_in {
            return;
        }
        if known.as_ref().is_some_and(|known| *known != named) {
            self.switch(&mut known, named);
        }
    }

    /// Moves the store to `primary`: a new generation, this pool's connections dropped at once
    /// (the other pool's at their next checkout).
    fn switch(&self, known: &mut Option<HostPort>, primary: HostPort) -> u64 {
        let generation = self.primary.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let mut dropped = 0;
        for slot in &self.slots {
            if slot.live().take().is_some() {
                dropped += 1;
            }
        }
        if let Some(old) = known.as_ref() {
            warn!(
                endpoint = %self.endpoint(),
                old_primary = %old,
                new_primary = %primary,
                dropped_connections = dropped,
                "the primary changed: every pooled connection to the old one is dropped"
            );
        } else {
            info!(endpoint = %self.endpoint(), primary = %primary, "connected to the primary");
        }
        *known = Some(primary);
        generation
    }

    /// The generation a new connection to `primary` belongs to, when it was made in generation
    /// `started_in`. A first primary, or another one found while nothing moved, starts a new
    /// generation; a connection to another primary than the store moved to while it was being
    /// made is refused (it reached the old one): the call tries again.
    fn adopt(&self, primary: Option<&HostPort>, started_in: u64) -> Result<u64, StoreError> {
        let Some(primary) = primary else {
            return Ok(self.primary.generation());
        };
        let mut known = self.primary.known();
        let current = self.primary.generation();
        if known.as_ref() == Some(primary) {
            return Ok(current);
        }
        if current != started_in {
            return Err(StoreError::Unavailable {
                endpoint: self.endpoint().to_owned(),
                cause: format!(
                    "the store moved to the primary {} while this connection was made to {primary}",
                    known
                        .as_ref()
                        .map_or_else(|| "?".to_owned(), ToString::to_string)
                ),
            });
        }
        Ok(self.switch(&mut known, primary.clone()))
    }

    async fn connect_slot(&self, slot: usize, deadline: Instant) -> Result<Checkout, StoreError> {
        let _connecting = self.slots[slot].connecting.lock().await;
        // Another call may have connected while this one waited.
        if let Some(checkout) = self.live(slot) {
            return Ok(checkout);
        }
        if let Some((retry_at, last)) = self.backing_off() {
            if retry_at >= deadline {
                return Err(last);
            }
            tokio::time::sleep_until(retry_at).await;
        }
        let limit = self
            .connect_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let started_in = self.primary.generation();
        let connected = self.opener.connect(limit).await.and_then(|c| {
            let generation = self.adopt(c.primary.as_ref(), started_in)?;
            Ok((c.conn, generation))
        });
        match connected {
            Ok((conn, generation)) => {
                self.connected();
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                *self.slots[slot].live() = Some(Live {
                    conn,
                    id,
                    generation,
                });
                // Through `live`: a switch since `adopt` retires it before any call.
                self.live(slot).ok_or_else(|| StoreError::Unavailable {
                    endpoint: self.endpoint().to_owned(),
                    cause: "the primary changed while connecting".into(),
                })
            }
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        }
    }

    /// Drops the connection of `checkout` from its slot (if it is still there): it broke,
    /// stalled or reached a node that cannot take writes. In-flight calls on it finish or fail
    /// on their own clones.
    pub(super) fn discard(&self, checkout: &Checkout) {
        let mut guard = self.slots[checkout.slot].live();
        if guard.as_ref().is_some_and(|live| live.id == checkout.id) {
            *guard = None;
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Reconnect> {
        self.reconnect.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn last_error(&self) -> Option<StoreError> {
        self.state().last_error.clone()
    }

    /// When the next attempt may start and the error of the last one, while backing off.
    fn backing_off(&self) -> Option<(Instant, StoreError)> {
        let state = self.state();
        match (state.retry_at, &state.last_error) {
            (Some(at), Some(e)) if at > Instant::now() => Some((at, e.clone())),
            _ => None,
        }
    }

    fn connected(&self) {
        let mut state = self.state();
        if let Some(since) = state.down_since.take() {
            info!(
                endpoint = %self.endpoint(),
                failed_attempts = state.failures,
                down_ms = millis(since.elapsed()),
                "reconnected to the lease store"
            );
        }
        *state = Reconnect::default();
    }

    fn failed(&self, error: &StoreError) {
        let mut state = self.state();
        state.failures = state.failures.saturating_add(1);
        let delay = self.backoff.delay(state.failures);
        state.retry_at = Some(Instant::now() + delay);
        state.down_since.get_or_insert_with(Instant::now);
        state.last_error = Some(error.clone());
        warn!(
            endpoint = %self.endpoint(),
            kind = error.kind().as_str(),
            error = %error,
            attempt = state.failures,
            next_attempt_in_ms = millis(delay),
            "cannot connect to the lease store"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_stays_bounded() {
        let b = Backoff {
            min: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        for _ in 0..200 {
            let first = b.delay(1);
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            let fourth = b.delay(4);
            assert!(fourth >= Duration::from_millis(400) && fourth <= Duration::from_millis(800));
            let late = b.delay(60);
            assert!(late >= Duration::from_secs(1) && late <= Duration::from_secs(2));
        }
    }
}
