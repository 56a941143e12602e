//! Each operation's wire contract, in one place: the script it runs, its KEYS and ARGV by name
//! (the script's header lists the same names, which a test checks), how the call is built from a
//! request, and how the reply decodes. Every script answers a flat array of strings whose first
//! element names the outcome; anything else is an error, never a guess.

use super::ScriptCall;
use super::keys::TargetKeys;
use super::scripts::{LuaScript, SCRIPTS};
use crate::store::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, Grant, GuardedKey,
    GuardedValue, Inspection, LeaseId, LeaseView, LossReason, MAX_TOKEN, ReleaseOutcome,
    ReleaseRequest, RenewOutcome, RenewRequest, RepairOutcome, StoreError, Token,
};

/// An operation's KEYS and ARGV by name, as its script's header lists them.
pub struct Contract {
    /// The script.
    pub script: fn() -> &'static LuaScript,
    /// KEYS, in order.
    pub keys: &'static [&'static str],
    /// ARGV, in order.
    pub argv: &'static [&'static str],
}

impl Contract {
    /// The call of this contract's script; the names and the values must pair up.
    fn call(&self, keys: Vec<String>, argv: &[&str]) -> ScriptCall<'static> {
        debug_assert_eq!(keys.len(), self.keys.len(), "KEYS of {:?}", self.keys);
        debug_assert_eq!(argv.len(), self.argv.len(), "ARGV of {:?}", self.argv);
        ScriptCall::new((self.script)(), keys, argv)
    }
}

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

/// `lua/acquire.lua`.
pub const ACQUIRE: Contract = Contract {
    script: || &SCRIPTS.acquire,
    keys: &["lease", "fence", "reply", "grant"],
    argv: &[
        "lease_id",
        "owner",
        "ttl_ms",
        "min_token",
        "reply_ttl_ms",
        "request_id",
    ],
};

/// The acquire call for `req`.
pub(super) fn acquire_call(
    k: &TargetKeys,
    req: &AcquireRequest,
    ttl_ms: &str,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    ACQUIRE.call(
        vec![k.lease(), k.fence(), k.reply(&req.request_id), k.grant()],
        &[
            req.lease_id.expose(),
            req.owner.as_str(),
            ttl_ms,
            &req.min_token.to_string(),
            reply_ttl_ms,
            req.request_id.as_str(),
        ],
    )
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

/// `lua/renew.lua`.
pub const RENEW: Contract = Contract {
    script: || &SCRIPTS.renew,
    keys: &["lease", "fence", "reply"],
    argv: &["lease_id", "owner", "token", "ttl_ms", "reply_ttl_ms"],
};

/// The renew call for `req`.
pub(super) fn renew_call(
    k: &TargetKeys,
    req: &RenewRequest,
    ttl_ms: &str,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    let lease = &req.lease;
    RENEW.call(
        vec![k.lease(), k.fence(), k.reply(&req.request_id)],
        &[
            lease.lease_id.expose(),
            lease.owner.as_str(),
            &lease.token.to_string(),
            ttl_ms,
            reply_ttl_ms,
        ],
    )
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

/// `lua/release.lua`.
pub const RELEASE: Contract = Contract {
    script: || &SCRIPTS.release,
    keys: &["lease", "reply"],
    argv: &["lease_id", "owner", "token", "reply_ttl_ms"],
};

/// The release call for `req`.
pub(super) fn release_call(
    k: &TargetKeys,
    req: &ReleaseRequest,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    let lease = &req.lease;
    RELEASE.call(
        vec![k.lease(), k.reply(&req.request_id)],
        &[
            lease.lease_id.expose(),
            lease.owner.as_str(),
            &lease.token.to_string(),
            reply_ttl_ms,
        ],
    )
}

/// Decodes the reply of `release.lua`.
pub fn release(reply: &[String]) -> Result<ReleaseOutcome, StoreError> {
    match reply {
        [kind] if kind == "released" => Ok(ReleaseOutcome::Released),
        [kind] if kind == "not_holder" => Ok(ReleaseOutcome::NotHolder),
        _ => Err(bad("release reply", reply)),
    }
}

/// `lua/commit.lua`.
pub const COMMIT: Contract = Contract {
    script: || &SCRIPTS.commit,
    keys: &["fence", "guarded", "commit_reply"],
    argv: &["token", "value", "reply_ttl_ms", "sequence", "key"],
};

/// The commit call for `req`.
pub(super) fn commit_call(
    k: &TargetKeys,
    req: &CommitRequest,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    COMMIT.call(
        vec![
            k.fence(),
            k.guarded(req.key.as_str()),
            k.commit_reply(&req.request_id),
        ],
        &[
            &req.token.to_string(),
            &req.value,
            reply_ttl_ms,
            &req.sequence.to_string(),
            req.key.as_str(),
        ],
    )
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

/// `lua/read.lua`.
pub const READ: Contract = Contract {
    script: || &SCRIPTS.read,
    keys: &["guarded"],
    argv: &[],
};

/// The read call of the guarded record `key`.
pub(super) fn read_call(k: &TargetKeys, key: &GuardedKey) -> ScriptCall<'static> {
    READ.call(vec![k.guarded(key.as_str())], &[])
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

/// `lua/check.lua`.
pub const CHECK: Contract = Contract {
    script: || &SCRIPTS.check,
    keys: &["fence"],
    argv: &["token"],
};

/// The check call of `token`.
pub(super) fn check_call(k: &TargetKeys, token: Token) -> ScriptCall<'static> {
    CHECK.call(vec![k.fence()], &[&token.to_string()])
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

/// `lua/inspect.lua`.
pub const INSPECT: Contract = Contract {
    script: || &SCRIPTS.inspect,
    keys: &["lease", "fence"],
    argv: &[],
};

/// The inspect call.
pub(super) fn inspect_call(k: &TargetKeys) -> ScriptCall<'static> {
    INSPECT.call(vec![k.lease(), k.fence()], &[])
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

/// `lua/repair.lua`.
pub const REPAIR: Contract = Contract {
    script: || &SCRIPTS.repair,
    keys: &["lease", "fence"],
    argv: &["floor"],
};

/// The repair call with `floor`.
pub(super) fn repair_call(k: &TargetKeys, floor: u64) -> ScriptCall<'static> {
    REPAIR.call(vec![k.lease(), k.fence()], &[&floor.to_string()])
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

    /// The names each contract gives its KEYS and ARGV are the ones its script's header lists,
    /// in the same order (`-- KEYS: a, b` and `-- ARGV: x, y` lines).
    #[test]
    fn contracts_match_the_script_headers() {
        for contract in [
            &ACQUIRE, &RENEW, &RELEASE, &COMMIT, &READ, &CHECK, &INSPECT, &REPAIR,
        ] {
            let source = (contract.script)().source;
            let listed = |prefix: &str| -> Vec<String> {
                let line = source
                    .lines()
                    .find_map(|l| l.strip_prefix(prefix))
                    .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{source}"));
                if line.trim() == "(none)" {
                    return Vec::new();
                }
                line.split(',').map(|n| n.trim().to_owned()).collect()
            };
            assert_eq!(listed("-- KEYS: "), contract.keys, "{:?}", contract.keys);
            assert_eq!(listed("-- ARGV: "), contract.argv, "{:?}", contract.argv);
            // The script reads no ARGV or KEYS past what its header lists.
            for (table, names) in [("ARGV", contract.argv), ("KEYS", contract.keys)] {
                let past = format!("{table}[{}]", names.len() + 1);
                assert!(!source.contains(&past), "the script reads {past}");
            }
        }
    }

    /// The calls carry as many KEYS and ARGV as their contracts name (debug builds assert it).
    #[test]
    fn calls_fill_their_contracts() {
        use crate::store::{LeaseHandle, Owner, RequestId, TargetRef, Ttl};
        let target = TargetRef::new("ns", "t").expect("target");
        let k = TargetKeys::new("tl", &target);
        let lease_id = LeaseId::new("id").expect("lease id");
        let request_id = RequestId::random();
        let handle = LeaseHandle {
            target: target.clone(),
            lease_id: lease_id.clone(),
            owner: Owner::new("o").expect("owner"),
            token: Token::new(1).expect("token"),
        };
        let acquire = AcquireRequest {
            target: target.clone(),
            lease_id,
            owner: Owner::new("o").expect("owner"),
            ttl: Ttl::new(std::time::Duration::from_secs(1)).expect("ttl"),
            min_token: 0,
            request_id: request_id.clone(),
        };
        let renew = RenewRequest {
            lease: handle.clone(),
            ttl: Ttl::new(std::time::Duration::from_secs(1)).expect("ttl"),
            request_id: request_id.clone(),
        };
        let release = ReleaseRequest {
            lease: handle,
            request_id: request_id.clone(),
        };
        let commit = CommitRequest {
            target,
            token: Token::new(1).expect("token"),
            key: GuardedKey::new("k").expect("key"),
            value: "v".into(),
            sequence: 0,
            request_id,
        };
        let calls = [
            (&ACQUIRE, acquire_call(&k, &acquire, "1000", "60000")),
            (&RENEW, renew_call(&k, &renew, "1000", "60000")),
            (&RELEASE, release_call(&k, &release, "60000")),
            (&COMMIT, commit_call(&k, &commit, "60000")),
            (&READ, read_call(&k, &GuardedKey::new("k").expect("key"))),
            (&CHECK, check_call(&k, Token::new(1).expect("token"))),
            (&INSPECT, inspect_call(&k)),
            (&REPAIR, repair_call(&k, 0)),
        ];
        for (contract, call) in calls {
            assert_eq!(call.keys.len(), contract.keys.len(), "{:?}", contract.keys);
            assert_eq!(call.args.len(), contract.argv.len(), "{:?}", contract.argv);
            assert!(std::ptr::eq(call.script, (contract.script)()));
        }
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
