//! Each operation's wire contract, in one place: the script it runs, its KEYS and ARGV by name
//! (the script's header lists the same names, which a test checks), how the call is built from a
//! request, and how the reply decodes. Every script answers one string: the outcome, then its
//! fields separated by single spaces, the last of which may be free text (see `lua/lib.lua`);
//! anything else is an error, never a guess.

pub use super::ScriptCall;
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
    fn call(&self, keys: &[&str], argv: &[&str]) -> ScriptCall<'static> {
        debug_assert_eq!(keys.len(), self.keys.len(), "KEYS of {:?}", self.keys);
        debug_assert_eq!(argv.len(), self.argv.len(), "ARGV of {:?}", self.argv);
        ScriptCall::new((self.script)(), keys, argv)
    }
}

/// A reply this version's scripts do not send. Only its length is named: free-text fields may
/// hold a lease id.
fn bad(what: &str, reply: &str) -> StoreError {
    StoreError::UnexpectedReply(format!("{what}: {} byte(s)", reply.len()))
}

/// The outcome of a reply and the rest after it (None when the reply is the outcome alone).
fn outcome(reply: &str) -> (&str, Option<&str>) {
    match reply.split_once(' ') {
        Some((kind, rest)) => (kind, Some(rest)),
        None => (reply, None),
    }
}

/// The `N` fields after an outcome, the last taking the rest of the reply (it may be free text
/// with spaces); None when there are fewer.
fn fields<const N: usize>(rest: Option<&str>) -> Option<[&str; N]> {
    let mut parts = rest?.splitn(N, ' ');
    let mut out = [""; N];
    for slot in &mut out {
        *slot = parts.next()?;
    }
    Some(out)
}

/// A remaining-time field. The scripts only answer it for a lease that is held (so it is
/// positive); a value below zero is reported as 0 rather than wrapping.
fn remaining(field: &str, s: &str) -> Result<u64, StoreError> {
    s.parse::<i64>()
        .map(|v| v.max(0).unsigned_abs())
        .map_err(|_| StoreError::UnexpectedReply(format!("{field} is not a number")))
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
pub fn acquire_call(
    k: &TargetKeys,
    req: &AcquireRequest,
    ttl_ms: &str,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    ACQUIRE.call(
        &[
            &k.lease(),
            &k.fence(),
            &k.reply(&req.request_id),
            &k.grant(),
        ],
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
pub fn acquire(reply: &str) -> Result<AcquireOutcome, StoreError> {
    match outcome(reply) {
        ("acquired", rest) => {
            let [granted, pttl, now, acquired] =
                fields(rest).ok_or_else(|| bad("acquire reply", reply))?;
            Ok(AcquireOutcome::Acquired(Grant {
                token: token("token", granted)?,
                expires_in_ms: number("pttl", pttl)?,
                server_time_ms: number("server time", now)?,
                acquired_at_ms: number("acquired_ms", acquired)?,
            }))
        }
        ("held", rest) => {
            let [pttl, owner] = fields(rest).ok_or_else(|| bad("acquire reply", reply))?;
            Ok(AcquireOutcome::Held {
                owner: owner.to_owned(),
                expires_in_ms: remaining("pttl", pttl)?,
            })
        }
        ("expired", rest) => {
            let [granted] = fields(rest).ok_or_else(|| bad("acquire reply", reply))?;
            Ok(AcquireOutcome::Expired {
                token: token("token", granted)?,
            })
        }
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
pub fn renew_call(
    k: &TargetKeys,
    req: &RenewRequest,
    ttl_ms: &str,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    let lease = &req.lease;
    RENEW.call(
        &[&k.lease(), &k.fence(), &k.reply(&req.request_id)],
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
pub fn renew(reply: &str) -> Result<RenewOutcome, StoreError> {
    match outcome(reply) {
        ("renewed", rest) => {
            let [pttl, now] = fields(rest).ok_or_else(|| bad("renew reply", reply))?;
            Ok(RenewOutcome::Renewed {
                expires_in_ms: number("pttl", pttl)?,
                server_time_ms: number("server time", now)?,
            })
        }
        ("lost", Some("expired")) => Ok(RenewOutcome::Lost {
            reason: LossReason::Expired,
        }),
        ("lost", Some("not_holder")) => Ok(RenewOutcome::Lost {
            reason: LossReason::NotHolder,
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
pub fn release_call(
    k: &TargetKeys,
    req: &ReleaseRequest,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    let lease = &req.lease;
    RELEASE.call(
        &[&k.lease(), &k.reply(&req.request_id)],
        &[
            lease.lease_id.expose(),
            lease.owner.as_str(),
            &lease.token.to_string(),
            reply_ttl_ms,
        ],
    )
}

/// Decodes the reply of `release.lua`.
pub fn release(reply: &str) -> Result<ReleaseOutcome, StoreError> {
    match reply {
        "released" => Ok(ReleaseOutcome::Released),
        "not_holder" => Ok(ReleaseOutcome::NotHolder),
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
pub fn commit_call(k: &TargetKeys, req: &CommitRequest, reply_ttl_ms: &str) -> ScriptCall<'static> {
    COMMIT.call(
        &[
            &k.fence(),
            &k.guarded(req.key.as_str()),
            &k.commit_reply(&req.request_id),
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
pub fn commit(reply: &str) -> Result<CommitOutcome, StoreError> {
    match outcome(reply) {
        ("committed", Some(committed)) => Ok(CommitOutcome::Committed {
            token: token("token", committed)?,
        }),
        ("stale", Some(newest)) => Ok(CommitOutcome::Stale {
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
pub fn read_call(k: &TargetKeys, key: &GuardedKey) -> ScriptCall<'static> {
    READ.call(&[&k.guarded(key.as_str())], &[])
}

/// Decodes the reply of `read.lua`.
pub fn read(reply: &str) -> Result<Option<GuardedValue>, StoreError> {
    match outcome(reply) {
        ("absent", None) => Ok(None),
        ("present", rest) => {
            let [written, value] = fields(rest).ok_or_else(|| bad("read reply", reply))?;
            Ok(Some(GuardedValue {
                token: token("token", written)?,
                value: value.to_owned(),
            }))
        }
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
pub fn check_call(k: &TargetKeys, token: Token) -> ScriptCall<'static> {
    CHECK.call(&[&k.fence()], &[&token.to_string()])
}

/// Decodes the reply of `check.lua`.
pub fn check(reply: &str) -> Result<CheckOutcome, StoreError> {
    match outcome(reply) {
        ("current", Some(newest)) => Ok(CheckOutcome::Current {
            newest: token("newest token", newest)?,
        }),
        ("stale", Some(newest)) => Ok(CheckOutcome::Stale {
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
pub fn inspect_call(k: &TargetKeys) -> ScriptCall<'static> {
    INSPECT.call(&[&k.lease(), &k.fence()], &[])
}

/// Decodes the reply of `inspect.lua`.
pub fn inspect(reply: &str) -> Result<Inspection, StoreError> {
    match outcome(reply) {
        ("free", rest) => {
            let [fence, now] = fields(rest).ok_or_else(|| bad("inspect reply", reply))?;
            Ok(Inspection {
                fence: token("fence", fence)?,
                server_time_ms: number("server time", now)?,
                lease: None,
            })
        }
        ("held", rest) => {
            let [fence, now, held, acquired, pttl, owner_bytes, both] =
                fields(rest).ok_or_else(|| bad("inspect reply", reply))?;
            // `<owner> <lease_id>`: the owner is `owner_bytes` long and may hold spaces.
            let at = usize::try_from(number("owner length", owner_bytes)?)
                .map_err(|_| bad("inspect reply", reply))?;
            let (owner, lease_id) = both
                .get(..at)
                .zip(both.get(at..).and_then(|r| r.strip_prefix(' ')))
                .ok_or_else(|| bad("inspect reply", reply))?;
            Ok(Inspection {
                fence: token("fence", fence)?,
                server_time_ms: number("server time", now)?,
                lease: Some(LeaseView {
                    owner: owner.to_owned(),
                    token: token("token", held)?,
                    acquired_at_ms: number("acquired_ms", acquired)?,
                    expires_in_ms: remaining("pttl", pttl)?,
                    lease_id: LeaseId::new(lease_id)?,
                }),
            })
        }
        _ => Err(bad("inspect reply", reply)),
    }
}

/// `lua/repair.lua`.
pub const REPAIR: Contract = Contract {
    script: || &SCRIPTS.repair,
    keys: &["lease", "fence", "grant"],
    argv: &["floor"],
};

/// The repair call with `floor`.
pub fn repair_call(k: &TargetKeys, floor: u64) -> ScriptCall<'static> {
    REPAIR.call(&[&k.lease(), &k.fence(), &k.grant()], &[&floor.to_string()])
}

/// Decodes the reply of `repair.lua`.
pub fn repair(reply: &str) -> Result<RepairOutcome, StoreError> {
    match outcome(reply) {
        ("intact", Some(fence)) => Ok(RepairOutcome::Intact {
            fence: token("fence", fence)?,
        }),
        ("repaired", rest) => {
            let [fence, what] = fields(rest).ok_or_else(|| bad("repair reply", reply))?;
            Ok(RepairOutcome::Repaired {
                fence: token("fence", fence)?,
                what: what.to_owned(),
            })
        }
        _ => Err(bad("repair reply", reply)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_each_outcome() {
        assert!(matches!(
            acquire("acquired 17 30000 5 4"),
            Ok(AcquireOutcome::Acquired(Grant { token: 17, .. }))
        ));
        assert!(matches!(
            acquire("held -1 w"),
            Ok(AcquireOutcome::Held {
                expires_in_ms: 0,
                ..
            })
        ));
        assert_eq!(
            acquire("expired 17").unwrap(),
            AcquireOutcome::Expired { token: 17 }
        );
        assert!(acquire("expired 17 3").is_err());
        assert!(acquire("expired").is_err());
        assert_eq!(
            renew("lost expired").unwrap(),
            RenewOutcome::Lost {
                reason: LossReason::Expired
            }
        );
        assert_eq!(release("released").unwrap(), ReleaseOutcome::Released);
        assert_eq!(
            commit("stale 9").unwrap(),
            CommitOutcome::Stale { newest: 9 }
        );
    }

    /// Free text comes last and keeps its spaces; inspect's two free-text fields are split at
    /// the owner's length, whatever either holds.
    #[test]
    fn free_text_fields_keep_their_spaces() {
        assert_eq!(
            acquire("held 250 team a / job 7").unwrap(),
            AcquireOutcome::Held {
                owner: "team a / job 7".into(),
                expires_in_ms: 250,
            }
        );
        assert_eq!(
            read("present 5 a b  c").unwrap(),
            Some(GuardedValue {
                token: 5,
                value: "a b  c".into()
            })
        );
        assert_eq!(
            read("present 5 ").unwrap().map(|v| v.value),
            Some(String::new())
        );
        let held = inspect("held 9 100 9 90 10 5 a b c id with spaces")
            .unwrap()
            .lease
            .expect("held");
        assert_eq!(held.owner, "a b c");
        assert_eq!(held.lease_id.expose(), "id with spaces");
        for garbage in [
            "held 9 100 9 90 10 6 a b c",
            "held 9 100 9 90 10 99 a b c id",
            "held 9 100 9 90 10 5 a b cXid",
            "held 9 100 9 90 10 -1 a b c id",
            "held 9 100 9 90 10 2 a\u{e9} id",
        ] {
            assert!(inspect(garbage).is_err(), "{garbage}");
        }
        assert_eq!(
            repair("repaired 7 deleted x; reset the fence").unwrap(),
            RepairOutcome::Repaired {
                fence: 7,
                what: "deleted x; reset the fence".into()
            }
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
            let (keys, args) = call.keys_and_args();
            assert_eq!(keys.len(), contract.keys.len(), "{:?}", contract.keys);
            assert_eq!(args.len(), contract.argv.len(), "{:?}", contract.argv);
            assert!(std::ptr::eq(call.script, (contract.script)()));
        }
    }

    #[test]
    fn refuses_garbage() {
        assert!(acquire("acquired x 1 1 1").is_err());
        assert!(acquire("").is_err());
        assert!(renew("lost why").is_err());
        assert!(release("released extra").is_err());
        assert!(check("current -3").is_err());
        assert!(check("current 9007199254740992").is_err());
        assert!(check("current 9007199254740991").is_ok());
        assert!(inspect("held 1 2").is_err());
    }
}
