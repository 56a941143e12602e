//! Turning what a reconcile learned into a status, and deciding whether it is a transition worth
//! a write. Pure functions: no I/O, unit-tested below.

use jiff::Timestamp;

use super::budget::Priority;
use crate::api::{Condition, ConditionType, Phase, Reason, TargetLeaseStatus};
use crate::controller::error::{store_message, store_reason};
use crate::controller::tenure::{must_republish, promise};
use crate::store::{Grant, Permits, StoreError};
use crate::time::{millis, ms_of, timestamp};

/// What one reconcile learned about a TargetLease.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The new phase.
    pub phase: Phase,
    /// Whether the desired state is reached.
    pub ready: bool,
    /// Owner while held.
    pub owner: Option<String>,
    /// The token of the current or last tenure.
    pub token: Option<u64>,
    /// The slot held, while held.
    pub slot: Option<u32>,
    /// The permits the tenure was granted under, while held.
    pub permits: Option<u32>,
    /// Start of the tenure.
    pub acquired_at: Option<Timestamp>,
    /// Expiry as of this observation.
    pub expires_at: Option<Timestamp>,
    /// Who holds the target while Waiting.
    pub held_by: Option<String>,
    /// Condition reason.
    pub reason: Reason,
    /// Condition message.
    pub message: String,
    /// Whether the lease may still be held: the controller could not renew it before its last
    /// known expiry, so it cannot say (the `Held` condition is `Unknown`).
    pub held_unknown: bool,
    /// Whether the tenure ended and its holder has not been confirmed stopped yet: the `Held`
    /// condition's reason is `Stopping` and the target is not passed on.
    pub stopping: bool,
}

impl Observed {
    /// The lease is held with `grant`.
    pub fn held(grant: &Grant, permits: Permits, holder: &str) -> Self {
        Self {
            phase: Phase::Held,
            ready: true,
            owner: Some(holder.to_owned()),
            token: Some(grant.token),
            slot: Some(grant.slot.get()),
            permits: Some(permits.get()),
            acquired_at: Some(timestamp(grant.acquired_at_ms)),
            expires_at: Some(timestamp(promise(
                grant.server_time_ms,
                grant.expires_in_ms,
            ))),
            held_by: None,
            reason: Reason::Acquired,
            message: if permits.is_exclusive() {
                format!("held by {holder} with fencing token {}", grant.token)
            } else {
                format!(
                    "held by {holder} in slot {} of {permits} with fencing token {}",
                    grant.slot, grant.token
                )
            },
            held_unknown: false,
            stopping: false,
        }
    }

    /// Another TargetLease holds the target.
    pub fn waiting(owner: &str, last_token: Option<u64>) -> Self {
        Self {
            phase: Phase::Waiting,
            ready: false,
            owner: None,
            token: last_token,
            slot: None,
            permits: None,
            acquired_at: None,
            expires_at: None,
            held_by: Some(owner.to_owned()),
            reason: Reason::Waiting,
            message: format!("target is held by {owner}"),
            held_unknown: false,
            stopping: false,
        }
    }

    /// The lease was given up (or never needed) for `reason`.
    pub fn released(reason: Reason, message: String, last_token: Option<u64>) -> Self {
        Self::not_holding(Phase::Released, true, reason, message, last_token)
    }

    /// The claim cannot be served as it is written; a person must change its spec.
    pub(crate) fn refused(reason: Reason, message: String, last_token: Option<u64>) -> Self {
        Self::not_holding(Phase::Failed, false, reason, message, last_token)
    }

    /// The lease expired or was taken while this resource believed it held it.
    pub fn lost(reason: Reason, message: String, last_token: Option<u64>) -> Self {
        Self::not_holding(Phase::Lost, false, reason, message, last_token)
    }

    /// Waiting because the target's permits are held under `in_force` while the claim asks
    /// `asked` (phase Waiting, reason PermitsConflict): who holds the target is not known from
    /// the store's refusal, so `heldBy` is left out.
    pub fn permits_conflict(
        target: &str,
        in_force: u32,
        asked: Permits,
        last_token: Option<u64>,
    ) -> Self {
        let mut observed = Self::waiting("", last_token);
        observed.held_by = None;
        observed.reason = Reason::PermitsConflict;
        observed.message = format!(
            "{target} is held under permits {in_force} and this claim asks spec.permits {asked}: \
             every claim on a target must ask the same value; this one is admitted once it asks \
             {in_force} or no permit granted under {in_force} is held"
        );
        observed
    }

    /// A phase without a holder; the last token stays visible, it is the floor of the next one.
    fn not_holding(
        phase: Phase,
        ready: bool,
        reason: Reason,
        message: String,
        last_token: Option<u64>,
    ) -> Self {
        Self {
            phase,
            ready,
            owner: None,
            token: last_token,
            slot: None,
            permits: None,
            acquired_at: None,
            expires_at: None,
            held_by: None,
            reason,
            message,
            held_unknown: false,
            stopping: false,
        }
    }

    /// The store failed while the lease of a Held claim is still known to be valid for
    /// `valid_for` (see [`known_valid_for`](super::decide::known_valid_for): measured on the
    /// controller's monotonic clock, never by comparing its wall clock with the store's). What
    /// the status said stays true for as long as the controller knows it is: a claim that shows
    /// Held keeps Held (not ready, the failure as the reason) while `valid_for` is not zero,
    /// whatever the failure, so a one-second ACL or network blip changes no phase and kills no
    /// `targetlease run`. Past that it cannot tell whether the lease still exists: the phase
    /// becomes Lost and the `Held` condition `Unknown`. Other
    /// claims keep their phase through transient failures and move to Failed on failures that
    /// need a person (corrupt record, access denied, TLS, a configuration the server cannot
    /// serve, a refused request). A corrupt record or a refused request fails a Held claim at
    /// once: no blip explains those.
    pub fn store_failed(
        previous: Option<&TargetLeaseStatus>,
        error: &StoreError,
        valid_for: std::time::Duration,
    ) -> Self {
        use crate::store::ErrorKind;
        let kind = error.kind();
        let reason = store_reason(kind);
        let needs_a_person = matches!(
            kind,
            ErrorKind::Corrupt
                | ErrorKind::AccessDenied
                | ErrorKind::Tls
                | ErrorKind::InvalidConfig
                | ErrorKind::InvalidRequest
        );
        let about_the_data = matches!(kind, ErrorKind::Corrupt | ErrorKind::InvalidRequest);
        let previous = previous.cloned().unwrap_or_default();
        let mut message = store_message(error);
        let mut held_unknown = false;
        let phase = match previous.phase {
            Phase::Held if about_the_data => Phase::Failed,
            Phase::Held if !valid_for.is_zero() => Phase::Held,
            Phase::Held => {
                held_unknown = true;
                message = format!(
                    "the lease could not be renewed before its last known expiry and may have \
                     expired; a new attempt follows once the store answers: {message}"
                );
                Phase::Lost
            }
            _ if needs_a_person => Phase::Failed,
            phase => {
                // Still unknown while the store stays out of reach after such a loss.
                held_unknown = phase == Phase::Lost
                    && previous
                        .conditions
                        .iter()
                        .any(|c| c.type_ == ConditionType::Held.as_str() && c.status == "Unknown");
                phase
            }
        };
        Self {
            phase,
            ready: false,
            owner: previous.owner.filter(|_| phase == Phase::Held),
            token: previous.fencing_token,
            slot: previous.slot.filter(|_| phase == Phase::Held),
            permits: previous.permits.filter(|_| phase == Phase::Held),
            acquired_at: previous.acquired_at.filter(|_| phase == Phase::Held),
            expires_at: previous.expires_at.filter(|_| phase == Phase::Held),
            held_by: previous.held_by,
            reason,
            message,
            held_unknown,
            stopping: false,
        }
    }

    /// The tenure ended and its holder, which acts on the Held status, has not confirmed that its
    /// command stopped (`until` says until when the target waits for it at the most): the
    /// `Held` condition says `Stopping`, and the target is not passed on yet.
    pub(crate) fn stopping(mut self, until: &str) -> Self {
        if self.phase != Phase::Held {
            self.stopping = true;
            self.message = format!(
                "{}; the target passes on once the holder's targetlease run confirms that its \
                 command stopped, or {until}",
                self.message
            );
        }
        self
    }

    /// A Held claim whose holder pod could not be read (`why`): the lease is kept and renewed,
    /// since a failed read says nothing of the holder, but the status is not ready and says
    /// that the holder is not tracked until its pod can be read again. Other phases are kept.
    pub(crate) fn holder_unknown(mut self, why: Option<&str>) -> Self {
        if let (Phase::Held, Some(why)) = (self.phase, why) {
            self.ready = false;
            self.reason = Reason::HolderUnknown;
            self.message = why.to_owned();
        }
        self
    }

    /// Builds the status for generation `generation`, keeping each condition's transition time
    /// when its status did not change.
    pub fn into_status(
        self,
        generation: Option<i64>,
        old: Option<&TargetLeaseStatus>,
        now: Timestamp,
    ) -> TargetLeaseStatus {
        let flag = |b: bool| if b { "True" } else { "False" };
        let held = self.phase == Phase::Held;
        let held_flag = if self.held_unknown {
            "Unknown"
        } else {
            flag(held)
        };
        let mut wanted = vec![
            (ConditionType::Ready, flag(self.ready), self.reason),
            (
                ConditionType::Held,
                held_flag,
                if held {
                    Reason::Acquired
                } else if self.stopping {
                    Reason::Stopping
                } else {
                    self.reason
                },
            ),
        ];
        // kstatus conventions: Reconciling while progressing, Stalled when a person must act.
        if self.phase == Phase::Failed {
            wanted.push((ConditionType::Stalled, "True", self.reason));
        } else if !self.ready {
            wanted.push((ConditionType::Reconciling, "True", self.reason));
        }
        let conditions = wanted
            .into_iter()
            .map(|(type_, status, reason)| {
                let since = old
                    .and_then(|o| o.conditions.iter().find(|c| c.type_ == type_.as_str()))
                    .filter(|c| c.status == status)
                    .map_or(now, |c| c.last_transition_time);
                Condition {
                    type_: type_.as_str().to_owned(),
                    status: status.to_owned(),
                    reason: reason.as_str().to_owned(),
                    message: self.message.clone(),
                    observed_generation: generation,
                    last_transition_time: since,
                }
            })
            .collect();
        // Spent by this very release, or kept from before for as long as the spec is the same.
        let spent = if self.phase == Phase::Released && self.reason == Reason::MaxHoldReached {
            generation
        } else {
            old.and_then(|o| o.max_hold_spent_generation)
                .filter(|g| generation == Some(*g))
        };
        TargetLeaseStatus {
            phase: self.phase,
            owner: self.owner,
            fencing_token: self.token,
            slot: self.slot,
            permits: self.permits,
            acquired_at: self.acquired_at,
            expires_at: self.expires_at,
            held_by: self.held_by,
            observed_generation: generation,
            max_hold_spent_generation: spent,
            conditions,
        }
    }
}

/// The expiry to publish after a renewal answered at store time `now` for a lease of `ttl`: the
/// one already `published` while more than one TTL is left on it (most renewals cost no status
/// write), else a new [`promise`].
pub(crate) fn published_expiry(
    published: Option<Timestamp>,
    now: Timestamp,
    ttl: std::time::Duration,
) -> Option<Timestamp> {
    let ttl_ms = millis(ttl);
    let now_ms = ms_of(now);
    if must_republish(published.map(ms_of), now_ms, ttl_ms) {
        Some(timestamp(promise(now_ms, ttl_ms)))
    } else {
        published
    }
}

/// How much a write of `new` over `old` matters ([`Priority`]): a refresh when only `expiresAt`
/// moves (a renewal keeps the published one until it must move, see [`published_expiry`]), else
/// a transition; `None` when `new` says nothing `old` did not, and no write is worth it.
pub(crate) fn priority(
    old: Option<&TargetLeaseStatus>,
    new: &TargetLeaseStatus,
) -> Option<Priority> {
    let Some(old) = old else {
        return Some(Priority::Transition);
    };
    if says_the_same(old, new) {
        return (old.expires_at != new.expires_at).then_some(Priority::Refresh);
    }
    Some(Priority::Transition)
}

/// Whether two statuses say the same but perhaps for `expiresAt`.
fn says_the_same(old: &TargetLeaseStatus, new: &TargetLeaseStatus) -> bool {
    let key = |s: &TargetLeaseStatus| {
        (
            s.phase,
            s.owner.clone(),
            s.fencing_token,
            s.slot,
            s.permits,
            s.acquired_at,
            s.held_by.clone(),
            s.observed_generation,
            s.max_hold_spent_generation,
        )
    };
    // Only the conditions this installation writes: another's (InstallationConflict) is not
    // this status's to repeat or remove.
    let conditions = |s: &TargetLeaseStatus| {
        let mut c: Vec<_> = s
            .conditions
            .iter()
            .filter(|c| ConditionType::OWN.iter().any(|t| t.as_str() == c.type_))
            .map(|c| {
                (
                    c.type_.clone(),
                    c.status.clone(),
                    c.reason.clone(),
                    c.message.clone(),
                )
            })
            .collect();
        c.sort();
        c
    };
    key(old) == key(new) && conditions(old) == conditions(new)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn grant(token: u64) -> Grant {
        Grant {
            token,
            slot: crate::store::Slot::ZERO,
            acquired_at_ms: 1_000,
            server_time_ms: 2_000,
            expires_in_ms: 30_000,
        }
    }

    fn condition<'a>(s: &'a TargetLeaseStatus, t: &str) -> Option<&'a Condition> {
        s.conditions.iter().find(|c| c.type_ == t)
    }

    #[test]
    fn held_is_ready_and_not_reconciling() {
        let s = Observed::held(&grant(7), Permits::ONE, "w").into_status(
            Some(3),
            None,
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(s.phase, Phase::Held);
        assert_eq!(s.fencing_token, Some(7));
        assert_eq!(
            condition(&s, "Ready").map(|c| c.status.as_str()),
            Some("True")
        );
        assert_eq!(
            condition(&s, "Held").map(|c| c.status.as_str()),
            Some("True")
        );
        assert!(condition(&s, "Reconciling").is_none());
        // A promise of four TTLs from the store's time of the grant.
        assert_eq!(s.expires_at.map(|t| t.as_millisecond()), Some(122_000));
        assert_eq!(s.observed_generation, Some(3));
    }

    #[test]
    fn waiting_is_reconciling_with_held_by() {
        let s = Observed::waiting("other", None).into_status(Some(1), None, Timestamp::UNIX_EPOCH);
        assert_eq!(s.held_by.as_deref(), Some("other"));
        assert_eq!(
            condition(&s, "Ready").map(|c| c.reason.as_str()),
            Some("Waiting")
        );
        assert_eq!(
            condition(&s, "Reconciling").map(|c| c.status.as_str()),
            Some("True")
        );
    }

    #[test]
    fn renewal_is_not_a_transition_but_a_new_token_is() {
        let now = Timestamp::UNIX_EPOCH;
        let first = Observed::held(&grant(7), Permits::ONE, "w").into_status(Some(1), None, now);
        let mut later = grant(7);
        later.server_time_ms += 10_000;
        let mut observed = Observed::held(&later, Permits::ONE, "w");
        observed.expires_at = published_expiry(
            first.expires_at,
            at(12_000),
            std::time::Duration::from_secs(30),
        );
        let renewed = observed.into_status(Some(1), Some(&first), now);
        assert!(priority(Some(&first), &renewed).is_none());
        let moved =
            Observed::held(&later, Permits::ONE, "w").into_status(Some(1), Some(&first), now);
        assert!(
            priority(Some(&first), &moved).is_some(),
            "a new expiry is written"
        );
        let new_token =
            Observed::held(&grant(8), Permits::ONE, "w").into_status(Some(1), Some(&first), now);
        assert!(priority(Some(&first), &new_token).is_some());
        let new_generation =
            Observed::held(&grant(7), Permits::ONE, "w").into_status(Some(2), Some(&first), now);
        assert!(priority(Some(&first), &new_generation).is_some());
    }

    /// Another installation's condition on the status (InstallationConflict) is not this
    /// installation's to write again or remove: it never makes a status write due.
    #[test]
    fn another_installations_condition_is_no_change() {
        let now = Timestamp::UNIX_EPOCH;
        let mut old = Observed::held(&grant(7), Permits::ONE, "w").into_status(Some(1), None, now);
        old.conditions.push(Condition {
            type_: ConditionType::InstallationConflict.as_str().to_owned(),
            status: "True".to_owned(),
            reason: Reason::OtherInstallation.as_str().to_owned(),
            message: "another installation".to_owned(),
            observed_generation: Some(1),
            last_transition_time: now,
        });
        let again =
            Observed::held(&grant(7), Permits::ONE, "w").into_status(Some(1), Some(&old), now);
        assert!(priority(Some(&old), &again).is_none());
        assert!(condition(&again, "InstallationConflict").is_none());
    }

    #[test]
    fn transition_time_is_kept_while_the_status_holds() {
        let t0 = Timestamp::UNIX_EPOCH;
        let t1 = Timestamp::from_second(100).unwrap();
        let first = Observed::waiting("a", None).into_status(Some(1), None, t0);
        let second = Observed::waiting("b", None).into_status(Some(1), Some(&first), t1);
        assert_eq!(
            condition(&second, "Ready").map(|c| c.last_transition_time),
            Some(t0)
        );
        let held =
            Observed::held(&grant(1), Permits::ONE, "w").into_status(Some(1), Some(&second), t1);
        assert_eq!(
            condition(&held, "Ready").map(|c| c.last_transition_time),
            Some(t1)
        );
    }

    #[test]
    fn corrupt_record_fails_and_unavailable_keeps_the_phase() {
        let held = Observed::held(&grant(7), Permits::ONE, "w").into_status(
            Some(1),
            None,
            Timestamp::UNIX_EPOCH,
        );
        let down = StoreError::Unavailable {
            endpoint: "x:1".into(),
            cause: "refused".into(),
        };
        let s = Observed::store_failed(Some(&held), &down, VALID).into_status(
            Some(1),
            Some(&held),
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(s.phase, Phase::Held);
        assert_eq!(
            condition(&s, "Ready").map(|c| c.reason.as_str()),
            Some("BackendUnavailable")
        );
        let corrupt = StoreError::Corrupt { detail: "x".into() };
        let s = Observed::store_failed(Some(&held), &corrupt, VALID).into_status(
            Some(1),
            None,
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(s.phase, Phase::Failed);
        assert_eq!(
            condition(&s, "Stalled").map(|c| c.reason.as_str()),
            Some("CorruptRecord")
        );
    }

    #[test]
    fn store_failures_never_show_the_endpoint_or_the_user() {
        let failures = [
            StoreError::Unavailable {
                endpoint: "10.9.8.7:6380".into(),
                cause: "connection refused".into(),
            },
            StoreError::AccessDenied {
                endpoint: "10.9.8.7:6380".into(),
                cause: "WRONGPASS user ops-admin".into(),
            },
            StoreError::Tls {
                endpoint: "10.9.8.7:6380".into(),
                cause: "unknown CA for valkey.internal".into(),
            },
            StoreError::Timeout {
                endpoint: "10.9.8.7:6380".into(),
                after_ms: 2000,
            },
            StoreError::InvalidConfig("cannot read /etc/secret/10.9.8.7".into()),
        ];
        for error in failures {
            let s = Observed::store_failed(None, &error, VALID).into_status(
                Some(1),
                None,
                Timestamp::UNIX_EPOCH,
            );
            let shown = serde_json::to_string(&s).expect("json");
            for secret in ["10.9.8.7", "ops-admin", "valkey.internal", "/etc/secret"] {
                assert!(!shown.contains(secret), "{secret} in {shown}");
            }
            assert!(shown.contains("controller's log"), "{shown}");
        }
    }

    /// A lease still known to be valid for a millisecond.
    const VALID: Duration = Duration::from_millis(1);

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(ms).expect("timestamp")
    }

    fn held_until(ms_left: u64) -> TargetLeaseStatus {
        let mut g = grant(7);
        g.server_time_ms = 0;
        g.expires_in_ms = ms_left;
        Observed::held(&g, Permits::ONE, "w").into_status(Some(1), None, at(0))
    }

    /// A blip of any kind within the published expiry changes no phase: Held stays Held, with
    /// the failure as the Ready reason.
    #[test]
    fn brief_failures_keep_held_until_the_expiry() {
        let held = held_until(30_000);
        let denied = StoreError::AccessDenied {
            endpoint: "x:1".into(),
            cause: "NOPERM".into(),
        };
        let tls = StoreError::Tls {
            endpoint: "x:1".into(),
            cause: "handshake".into(),
        };
        for error in [denied, tls] {
            let s = Observed::store_failed(Some(&held), &error, VALID).into_status(
                Some(1),
                Some(&held),
                at(29_999),
            );
            assert_eq!(s.phase, Phase::Held, "{error}");
            assert_eq!(s.fencing_token, Some(7));
            assert_eq!(s.expires_at, held.expires_at);
            assert_eq!(
                condition(&s, "Held").map(|c| c.status.as_str()),
                Some("True")
            );
            assert_eq!(
                condition(&s, "Ready").map(|c| c.status.as_str()),
                Some("False")
            );
        }
    }

    /// Past the published expiry the controller cannot say the lease is held: Lost, with the
    /// Held condition Unknown, and it stays Unknown while the store stays out of reach.
    #[test]
    fn failures_past_the_expiry_make_held_unknown() {
        let held = held_until(30_000);
        let down = StoreError::Timeout {
            endpoint: "x:1".into(),
            after_ms: 2_000,
        };
        let s = Observed::store_failed(Some(&held), &down, Duration::ZERO).into_status(
            Some(1),
            Some(&held),
            at(30_000),
        );
        assert_eq!(s.phase, Phase::Lost);
        assert_eq!(s.owner, None);
        assert_eq!(s.expires_at, None, "an expiry that passed is not published");
        assert_eq!(
            s.fencing_token,
            Some(7),
            "the last token stays: it is the floor"
        );
        assert_eq!(
            condition(&s, "Held").map(|c| c.status.as_str()),
            Some("Unknown")
        );
        assert!(s.conditions.iter().all(|c| !c.message.contains("x:1")));
        let again = Observed::store_failed(Some(&s), &down, Duration::ZERO).into_status(
            Some(1),
            Some(&s),
            at(40_000),
        );
        assert_eq!(again.phase, Phase::Lost);
        assert_eq!(
            condition(&again, "Held").map(|c| c.status.as_str()),
            Some("Unknown")
        );
    }

    /// An unreadable holder pod makes a Held claim not ready, with the reason and the message,
    /// and keeps everything else; other phases are left alone.
    #[test]
    fn an_unknown_holder_keeps_held_but_not_ready() {
        let held = Observed::held(&grant(7), Permits::ONE, "w");
        let s = held
            .clone()
            .holder_unknown(Some("pod p could not be read"))
            .into_status(Some(1), None, at(0));
        assert_eq!((s.phase, s.fencing_token), (Phase::Held, Some(7)));
        assert_eq!(
            condition(&s, "Ready").map(|c| (c.status.as_str(), c.reason.as_str())),
            Some(("False", "HolderUnknown"))
        );
        assert_eq!(
            condition(&s, "Held").map(|c| c.status.as_str()),
            Some("True")
        );
        assert_eq!(held.clone().holder_unknown(None), held);
        let waiting = Observed::waiting("other", None);
        assert_eq!(waiting.clone().holder_unknown(Some("x")), waiting);
    }

    /// The published expiry is a promise of four TTLs, moved when one TTL is left: one write
    /// per three TTLs, never in the past while renewals succeed.
    #[test]
    fn published_expiry_moves_every_three_ttls() {
        let ttl = std::time::Duration::from_secs(30);
        let mut published = Some(at(4 * 30_000));
        let mut writes = 0;
        // A renewal every 10 s for 15 minutes.
        for renewal in 1..=90 {
            let now = renewal * 10_000;
            let next = published_expiry(published, at(now), ttl);
            assert!(next <= Some(at(now + 4 * 30_000)), "beyond the promise");
            // Still in the future at the next renewal, by more than two thirds of a TTL.
            assert!(next > Some(at(now + 20_000)), "renewal {renewal}: {next:?}");
            if next != published {
                writes += 1;
            }
            published = next;
        }
        assert_eq!(writes, 10, "one write per 90 s");
        // Late renewals (a budget that held refreshes back) move it at once.
        assert_eq!(
            published_expiry(Some(at(25_000)), at(20_000), ttl),
            Some(at(20_000 + 120_000))
        );
        assert!(must_republish(None, 0, 30_000));
        assert!(!must_republish(Some(100_000), 60_000, 30_000));
        assert!(must_republish(Some(100_000), 70_000, 30_000));
    }
}
