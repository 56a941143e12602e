//! Decoding of script replies. Every script answers a flat array of strings whose first element
//! names the outcome; anything else is an error, never a guess.

use crate::store::{
    AcquireOutcome, CheckOutcome, CommitOutcome, Grant, GuardedValue, Inspection, LeaseId,
    LeaseView, LossReason, ReleaseOutcome, RenewOutcome, StoreError,
};

fn bad(what: &str, reply: &[String]) -> StoreError {
    StoreError::UnexpectedReply(format!("{what}: {} element(s)", reply.len()))
}

fn number(field: &str, s: &str) -> Result<u64, StoreError> {
    s.parse::<u64>()
        .map_err(|_| StoreError::UnexpectedReply(format!("{field} is not a number")))
}

/// Decodes the reply of `acquire.lua`.
pub fn acquire(reply: &[String]) -> Result<AcquireOutcome, StoreError> {
    match reply {
        [kind, token, pttl, now, acquired] if kind == "acquired" => {
            Ok(AcquireOutcome::Acquired(Grant {
                token: number("token", token)?,
                expires_in_ms: number("pttl", pttl)?,
                server_time_ms: number("server time", now)?,
                acquired_at_ms: number("acquired_ms", acquired)?,
            }))
        }
        [kind, owner, pttl] if kind == "held" => Ok(AcquireOutcome::Held {
            owner: owner.clone(),
            // PTTL answers -1 for a key without expiry: report it as 0 rather than wrap around.
            expires_in_ms: pttl.parse::<i64>().map_or(0, |v| v.max(0) as u64),
        }),
        _ => Err(bad("acquire reply", reply)),
    }
}

/// Decodes the reply of `renew.lua`.
pub fn renew(reply: &[String]) -> Result<RenewOutcome, StoreError> {
    match reply {
        [kind, pttl, now] if kind == "renewed" => Ok(RenewOutcome::Renewed {
            expires_in_ms: number("pttl", pttl)?,
            server_time_ms: number("server time", now)?,
        }),
        [kind, reason] if kind == "lost" => Ok(RenewOutcome::Lost {
            reason: match reason.as_str() {
                "expired" => LossReason::Expired,
                "not_holder" => LossReason::NotHolder,
                _ => return Err(bad("renew loss reason", reply)),
            },
        }),
        _ => Err(bad("renew reply", reply)),
    }
}

/// Decodes the reply of `release.lua`.
pub fn release(reply: &[String]) -> Result<ReleaseOutcome, StoreError> {
    match reply {
        [kind] if kind == "released" => Ok(ReleaseOutcome::Released),
        [kind] if kind == "not_holder" => Ok(ReleaseOutcome::NotHolder),
        _ => Err(bad("release reply", reply)),
    }
}

/// Decodes the reply of `commit.lua`.
pub fn commit(reply: &[String]) -> Result<CommitOutcome, StoreError> {
    match reply {
        [kind, token] if kind == "committed" => Ok(CommitOutcome::Committed {
            token: number("token", token)?,
        }),
        [kind, newest] if kind == "stale" => Ok(CommitOutcome::Stale {
            newest: number("newest token", newest)?,
        }),
        _ => Err(bad("commit reply", reply)),
    }
}

/// Decodes the reply of `read.lua`.
pub fn read(reply: &[String]) -> Result<Option<GuardedValue>, StoreError> {
    match reply {
        [kind] if kind == "absent" => Ok(None),
        [kind, token, value] if kind == "present" => Ok(Some(GuardedValue {
            token: number("token", token)?,
            value: value.clone(),
        })),
        _ => Err(bad("read reply", reply)),
    }
}

/// Decodes the reply of `check.lua`.
pub fn check(reply: &[String]) -> Result<CheckOutcome, StoreError> {
    match reply {
        [kind, newest] if kind == "current" => Ok(CheckOutcome::Current {
            newest: number("newest token", newest)?,
        }),
        [kind, newest] if kind == "stale" => Ok(CheckOutcome::Stale {
            newest: number("newest token", newest)?,
        }),
        _ => Err(bad("check reply", reply)),
    }
}

/// Decodes the reply of `inspect.lua`.
pub fn inspect(reply: &[String]) -> Result<Inspection, StoreError> {
    match reply {
        [kind, fence, now] if kind == "free" => Ok(Inspection {
            fence: number("fence", fence)?,
            server_time_ms: number("server time", now)?,
            lease: None,
        }),
        [kind, fence, now, owner, token, acquired, pttl, lease_id] if kind == "held" => {
            Ok(Inspection {
                fence: number("fence", fence)?,
                server_time_ms: number("server time", now)?,
                lease: Some(LeaseView {
                    owner: owner.clone(),
                    token: number("token", token)?,
                    acquired_at_ms: number("acquired_ms", acquired)?,
                    expires_in_ms: pttl.parse::<i64>().map_or(0, |v| v.max(0) as u64),
                    lease_id: LeaseId::new(lease_id.clone())?,
                }),
            })
        }
        _ => Err(bad("inspect reply", reply)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(parts: &[&str]) -> Vec<String> {
        parts.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn decodes_each_outcome() {
        assert!(matches!(
            acquire(&s(&["acquired", "17", "30000", "5", "4"])),
            Ok(AcquireOutcome::Acquired(Grant { token: 17, .. }))
        ));
        assert!(matches!(
            acquire(&s(&["held", "w", "-1"])),
            Ok(AcquireOutcome::Held {
                expires_in_ms: 0,
                ..
            })
        ));
        assert_eq!(
            renew(&s(&["lost", "expired"])).unwrap(),
            RenewOutcome::Lost {
                reason: LossReason::Expired
            }
        );
        assert_eq!(
            release(&s(&["released"])).unwrap(),
            ReleaseOutcome::Released
        );
        assert_eq!(
            commit(&s(&["stale", "9"])).unwrap(),
            CommitOutcome::Stale { newest: 9 }
        );
    }

    #[test]
    fn refuses_garbage() {
        assert!(acquire(&s(&["acquired", "x", "1", "1", "1"])).is_err());
        assert!(acquire(&s(&[])).is_err());
        assert!(renew(&s(&["lost", "why"])).is_err());
        assert!(release(&s(&["released", "extra"])).is_err());
        assert!(check(&s(&["current", "-3"])).is_err());
        assert!(inspect(&s(&["held", "1", "2"])).is_err());
    }
}
