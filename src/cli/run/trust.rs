//! How long `run` trusts its lease: its trust windows ([`Windows`]) counted from the send of the
//! last heartbeat whose reply showed the TargetLease Held with its token, for the TTL its
//! heartbeats announce (the controller judges silence with the longer of that and the spec's).
//!
//! A TTL edit is followed without ever trusting longer than the controller allows: a shorter TTL
//! counts from the moment `run` announces it (the controller may see the announcing heartbeat
//! applied before `run` sees its reply), a longer one only from a confirmed heartbeat that
//! announced it (the controller judges with it once it sees that heartbeat, or the spec).

use std::time::Duration;

use tokio::time::Instant;

use crate::api::heartbeat::Windows;

/// `run`'s trust in its lease.
#[derive(Clone, Copy, Debug)]
pub(super) struct Trust {
    grace: Duration,
    /// The TTL of the last confirmed heartbeat.
    ttl: Duration,
    /// When the last confirmed heartbeat was sent.
    confirmed: Instant,
    /// A shorter TTL announced at this instant and not confirmed yet.
    announced: Option<(Duration, Instant)>,
}

impl Trust {
    /// Trust from a heartbeat announcing `ttl`, sent at `sent` and applied (the create or the
    /// adoption of the TargetLease).
    pub(super) fn new(ttl: Duration, grace: Duration, sent: Instant) -> Self {
        Self {
            grace,
            ttl,
            confirmed: sent,
            announced: None,
        }
    }

    /// The windows of a TTL counted with.
    fn windows_of(&self, ttl: Duration) -> Windows {
        Windows::new(ttl, self.grace)
    }

    /// The spec asks `wanted`: the next heartbeats announce it, and a shorter one counts from
    /// `now` on.
    pub(super) fn follow(&mut self, wanted: Duration, now: Instant) {
        let current = self.announced.map_or(self.ttl, |(ttl, _)| ttl);
        if wanted < current {
            self.announced = Some((wanted, now));
        }
    }

    /// A heartbeat announcing `ttl`, sent at `sent`, was confirmed (its reply showed the lease
    /// Held with its token, or, while waiting, it was applied).
    pub(super) fn confirm(&mut self, sent: Instant, ttl: Duration) {
        if sent < self.confirmed {
            return;
        }
        self.confirmed = sent;
        self.ttl = ttl;
        self.announced = self.announced.filter(|(_, at)| *at > sent);
    }

    /// The earliest of `at(windows)` over the TTLs it counts with: the confirmed one from its
    /// heartbeat's send, an announced shorter one from its announcement (the controller counts
    /// its silence from when it sees the announcing heartbeat, which is later).
    fn earliest(&self, at: impl Fn(&Windows) -> Duration) -> Instant {
        let confirmed = self.confirmed + at(&self.windows_of(self.ttl));
        match self.announced {
            Some((ttl, since)) => confirmed.min(since + at(&self.windows_of(ttl))),
            None => confirmed,
        }
    }

    /// SIGTERM to the command from this instant on, unless a heartbeat is confirmed first.
    pub(super) fn term_at(&self) -> Instant {
        self.earliest(|w| w.term)
    }

    /// SIGKILL to the command and everything it started at this instant, whatever the grace.
    pub(super) fn kill_at(&self) -> Instant {
        self.earliest(|w| w.kill)
    }

    /// The grace a command gets when no heartbeat is confirmed: `--grace`, cut at the bound.
    pub(super) fn silent_grace(&self) -> Duration {
        self.windows_of(self.ttl).silent_grace()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    /// A shorter TTL counts from its announcement (not from its confirmation, which may never
    /// come while the controller already judges by it); a longer one only once confirmed.
    #[tokio::test(start_paused = true)]
    async fn a_ttl_edit_never_stretches_the_trust() {
        let t0 = Instant::now();
        let (thirty, six) = (30 * S, 6 * S);
        let mut trust = Trust::new(thirty, 10 * S, t0);
        let w30 = Windows::new(thirty, 10 * S);
        let w6 = Windows::new(six, 10 * S);
        assert_eq!(trust.kill_at(), t0 + w30.kill);
        // 30 s -> 6 s, announced 4 s after the last confirmed beat: the command must be dead by
        // the announcement plus the new bound, counted from no later than the announcement.
        let announced = t0 + 4 * S;
        trust.follow(six, announced);
        assert!(
            trust.kill_at() <= announced + w6.kill,
            "{:?}",
            trust.kill_at() - t0
        );
        assert!(trust.kill_at() <= t0 + w30.kill);
        // Its reply comes: from that send on, 6 s.
        trust.confirm(announced, six);
        assert_eq!(trust.kill_at(), announced + w6.kill);
        // 6 s -> 30 s: announced, not trusted until confirmed.
        let later = announced + S;
        trust.follow(thirty, later);
        assert_eq!(trust.kill_at(), announced + w6.kill);
        trust.confirm(later, thirty);
        assert_eq!(trust.kill_at(), later + w30.kill);
        // A late reply of an older beat changes nothing.
        trust.confirm(announced, six);
        assert_eq!(trust.kill_at(), later + w30.kill);
    }
}
