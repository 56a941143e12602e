//! Decoding of script replies. Every script answers a flat array of strings whose first element
//! names the outcome; anything else is an error, never a guess.

use crate::store::{
    AcquireOutcome, CheckOutcome, CommitOutcome, Grant, GuardedValue, Inspection, LeaseId,
    LeaseView, LossReason, MAX_TOKEN, ReleaseOutcome, RenewOutcome, RepairOutcome, StoreError,
};

fn bad(what: &str, reply: &[String]) -> StoreError {
    StoreError::UnexpectedReply(format!("{what}: {} element(s)", reply.len()))
}

fn number(field: &str, s: &str) -> Result<u64, StoreError> {
    s.parse::<u64>()
        .map_err(|_| StoreError::UnexpectedReply(format!("{field} is not a number")))
}

/// A token in a reply: a number no larger than [`MAX_TOKEN`]. The scripts never answer more, so
/// a larger one means the reply is not what this version's scripts send.
fn token(field: &str, s: &str) -> Result<u64, StoreError> {
    let n = number(field, s)?;
    if n > MAX_TOKEN {
        return Err(StoreError::UnexpectedReply(format!(
            "{field} is above the largest token 2^53-1"
        )));
    }
    Ok(n)
}

/// Decodes the reply of `acquire.lua`.
pub fn acquire(reply: &[String]) -> Result<AcquireOutcome, StoreError> {
    match reply {
        [kind, granted, pttl, now, acquired] if kind == "acquired" => {
            Ok(AcquireOutcome::Acquired(Grant {
                token: token("token", granted)?,
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
        [kind, committed] if kind == "committed" => Ok(CommitOutcome::Committed {
            token: token("token", committed)?,
        }),
        [kind, newest] if kind == "stale" => Ok(CommitOutcome::Stale {
            newest: token("newest token", newest)?,
        }),
        _ => Err(bad("commit reply", reply)),
    }
}

/// Decodes the reply of `read.lua`.
pub fn read(reply: &[String]) -> Result<Option<GuardedValue>, StoreError> {
    match reply {
        [kind] if kind == "absent" => Ok(None),
        [kind, written, value] if kind == "present" => Ok(Some(GuardedValue {
            token: token("token", written)?,
            value: value.clone(),
        })),
        _ => Err(bad("read reply", reply)),
    }
}

/// Decodes the reply of `check.lua`.
pub fn check(reply: &[String]) -> Result<CheckOutcome, StoreError> {
    match reply {
        [kind, newest] if kind == "current" => Ok(CheckOutcome::Current {
            newest: token("newest token", newest)?,
        }),
        [kind, newest] if kind == "stale" => Ok(CheckOutcome::Stale {
            newest: token("newest token", newest)?,
        }),
        _ => Err(bad("check reply", reply)),
    }
}

/// Decodes the reply of `inspect.lua`.
pub fn inspect(reply: &[String]) -> Result<Inspection, StoreError> {
    match reply {
        [kind, fence, now] if kind == "free" => Ok(Inspection {
            fence: token("fence", fence)?,
            server_time_ms: number("server time", now)?,
            lease: None,
        }),
        [kind, fence, now, owner, held, acquired, pttl, lease_id] if kind == "held" => {
            Ok(Inspection {
                fence: token("fence", fence)?,
                server_time_ms: number("server time", now)?,
                lease: Some(LeaseView {
                    owner: owner.clone(),
                    token: token("token", held)?,
                    acquired_at_ms: number("acquired_ms", acquired)?,
                    expires_in_ms: pttl.parse::<i64>().map_or(0, |v| v.max(0) as u64),
                    lease_id: LeaseId::new(lease_id.clone())?,
                }),
            })
        }
        _ => Err(bad("inspect reply", reply)),
    }
}

/// Decodes the reply of `repair.lua`.
pub fn repair(reply: &[String]) -> Result<RepairOutcome, StoreError> {
    match reply {
        [kind, fence] if kind == "intact" => Ok(RepairOutcome::Intact {
            fence: token("fence", fence)?,
        }),
        [kind, fence, what] if kind == "repaired" => Ok(RepairOutcome::Repaired {
            fence: token("fence", fence)?,
            what: what.clone(),
        }),
        _ => Err(bad("repair reply", reply)),
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
        assert!(check(&s(&["current", "9007199254740992"])).is_err());
        assert!(check(&s(&["current", "9007199254740991"])).is_ok());
        assert!(inspect(&s(&["held", "1", "2"])).is_err());
    }
}
