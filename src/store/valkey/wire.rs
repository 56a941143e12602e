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
    GuardedValue, Inspection, LeaseId, LeaseView, LossReason, MAX_PERMITS, MAX_TOKEN, Permits,
    ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, RepairOutcome, Slot, StoreError,
    Token,
};

/// An operation's KEYS and ARGV by name, as its script's header lists them.
pub struct Contract {
    /// The script.
    pub script: fn() -> &'static LuaScript,
    /// KEYS, in order.
    pub keys: &'static [&'static str],
    /// KEYS repeated after those, once per further slot (slots 1 and up), in order.
    pub per_slot: &'static [&'static str],
    /// ARGV, in order.
    pub argv: &'static [&'static str],
}

impl Contract {
    /// The call of this contract's script; the names and the values must pair up.
    fn call(&self, keys: &[&str], argv: &[&str]) -> ScriptCall<'static> {
        debug_assert!(
            keys.len() >= self.keys.len()
                && (self.per_slot.is_empty() && keys.len() == self.keys.len()
                    || !self.per_slot.is_empty()
                        && (keys.len() - self.keys.len()).is_multiple_of(self.per_slot.len())),
            "KEYS of {:?} then {:?} per further slot",
            self.keys,
            self.per_slot
        );
        debug_assert_eq!(argv.len(), self.argv.len(), "ARGV of {:?}", self.argv);
        ScriptCall::new((self.script)(), keys, argv)
    }
}

/// The slots of `permits` from 1: the further slots whose keys follow a call's own.
fn further_slots(permits: Permits) -> impl Iterator<Item = Slot> {
    permits.slots().skip(1)
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
    keys: &["lease", "fence", "reply", "grant", "permits"],
    per_slot: &["slot_lease", "slot_fence", "slot_grant"],
    argv: &[
        "lease_id",
        "owner",
        "ttl_ms",
        "min_token",
        "reply_ttl_ms",
        "request_id",
        "permits",
    ],
};

/// The acquire call for `req`.
pub fn acquire_call(
    k: &TargetKeys,
    req: &AcquireRequest,
    ttl_ms: &str,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    let mut keys = vec![
        k.lease(),
        k.fence(),
        k.reply(&req.request_id),
        k.grant(),
        k.permits(),
    ];
    for slot in further_slots(req.permits) {
        keys.extend([k.lease_of(slot), k.fence_of(slot), k.grant_of(slot)]);
    }
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    ACQUIRE.call(
        &keys,
        &[
            req.lease_id.expose(),
            req.owner.as_str(),
            ttl_ms,
            &req.min_token.to_string(),
            reply_ttl_ms,
            req.request_id.as_str(),
            &req.permits.to_string(),
        ],
    )
}

/// A slot in a reply: one the permits asked for have (a reply naming another is not what this
/// version's scripts send).
fn slot_field(s: &str, permits: Permits) -> Result<Slot, StoreError> {
    let slot = u32::try_from(number("slot", s)?)
        .map_err(|_| StoreError::UnexpectedReply("slot is out of range".into()))
        .and_then(|n| {
            Slot::new(n).map_err(|_| StoreError::UnexpectedReply("slot is out of range".into()))
        })?;
    permits
        .check_slot(slot)
        .map_err(|_| StoreError::UnexpectedReply("slot is beyond the permits asked for".into()))?;
    Ok(slot)
}

/// Decodes the reply of `acquire.lua` to a call with `permits`: a grant names its slot, one
/// that `permits` has.
pub fn acquire(reply: &str, permits: Permits) -> Result<AcquireOutcome, StoreError> {
    match outcome(reply) {
        ("acquired", rest) => {
            let [granted, pttl, now, acquired, slot] =
                fields(rest).ok_or_else(|| bad("acquire reply", reply))?;
            Ok(AcquireOutcome::Acquired(Grant {
                token: token("token", granted)?,
                slot: slot_field(slot, permits)?,
                expires_in_ms: number("pttl", pttl)?,
                server_time_ms: number("server time", now)?,
                acquired_at_ms: number("acquired_ms", acquired)?,
            }))
        }
        ("conflict", Some(in_force)) => {
            let in_force = u32::try_from(number("permits in force", in_force)?)
                .ok()
                .filter(|n| (1..=MAX_PERMITS).contains(n) && *n != permits.get())
                .ok_or_else(|| bad("acquire reply", reply))?;
            Ok(AcquireOutcome::PermitsConflict { in_force })
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
    keys: &["lease", "fence", "reply", "permits", "slot_zero_fence"],
    per_slot: &[],
    argv: &[
        "lease_id",
        "owner",
        "token",
        "ttl_ms",
        "reply_ttl_ms",
        "permits",
    ],
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
        &[
            &k.lease_of(lease.slot),
            &k.fence_of(lease.slot),
            &k.reply(&req.request_id),
            &k.permits(),
            &k.fence(),
        ],
        &[
            lease.lease_id.expose(),
            lease.owner.as_str(),
            &lease.token.to_string(),
            ttl_ms,
            reply_ttl_ms,
            &lease.permits.to_string(),
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
    keys: &["lease", "reply", "permits"],
    per_slot: &["other_lease"],
    argv: &["lease_id", "owner", "token", "reply_ttl_ms"],
};

/// The release call for `req`.
pub fn release_call(
    k: &TargetKeys,
    req: &ReleaseRequest,
    reply_ttl_ms: &str,
) -> ScriptCall<'static> {
    let lease = &req.lease;
    let mut keys = vec![
        k.lease_of(lease.slot),
        k.reply(&req.request_id),
        k.permits(),
    ];
    let others = lease.permits.slots().filter(|s| *s != lease.slot);
    keys.extend(others.map(|s| k.lease_of(s)));
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    RELEASE.call(
        &keys,
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
    per_slot: &[],
    argv: &["token", "value", "reply_ttl_ms", "sequence", "key"],
};

/// The commit call for `req`; the guarded record's name goes into the binding with its slot
/// ([`CommitRequest::bound_key`]).
pub fn commit_call(k: &TargetKeys, req: &CommitRequest, reply_ttl_ms: &str) -> ScriptCall<'static> {
    let bound_key = req.bound_key();
    COMMIT.call(
        &[
            &k.fence_of(req.slot),
            &k.guarded_of(req.slot, req.key.as_str()),
            &k.commit_reply(&req.request_id),
        ],
        &[
            &req.token.to_string(),
            &req.value,
            reply_ttl_ms,
            &req.sequence.to_string(),
            &bound_key,
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
    per_slot: &[],
    argv: &[],
};

/// The read call of the guarded record `key` of `slot`.
pub fn read_call(k: &TargetKeys, slot: Slot, key: &GuardedKey) -> ScriptCall<'static> {
    READ.call(&[&k.guarded_of(slot, key.as_str())], &[])
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
    per_slot: &[],
    argv: &["token"],
};

/// The check call of `token` against `slot`'s fence.
pub fn check_call(k: &TargetKeys, slot: Slot, token: Token) -> ScriptCall<'static> {
    CHECK.call(&[&k.fence_of(slot)], &[&token.to_string()])
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
    per_slot: &["slot_lease"],
    argv: &[],
};

/// The inspect call: slot 0's keys alone (an exclusive lease's, so that a view of one never
/// names a key that does not exist, which a cluster slot being migrated refuses), or with
/// `every_slot` the lease of every slot a target can have, so no holder is missed.
pub fn inspect_call(k: &TargetKeys, every_slot: bool) -> ScriptCall<'static> {
    let mut keys = vec![k.lease(), k.fence()];
    if every_slot {
        keys.extend(further_slots(Permits::MAX).map(|s| k.lease_of(s)));
    }
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    INSPECT.call(&keys, &[])
}

/// Decodes the reply of `inspect.lua`; `None` for `more` (ask again with every slot).
pub fn inspect(reply: &str) -> Result<Option<Inspection>, StoreError> {
    if reply == "more" {
        return Ok(None);
    }
    inspect_view(reply).map(Some)
}

fn inspect_view(reply: &str) -> Result<Inspection, StoreError> {
    let err = || bad("inspect reply", reply);
    let ("view", rest) = outcome(reply) else {
        return Err(err());
    };
    let mut rest = rest.ok_or_else(err)?;
    let fence = token("fence", next_field(&mut rest))?;
    let server_time_ms = number("server time", next_field(&mut rest))?;
    let permits = u32::try_from(number("permits", next_field(&mut rest))?)
        .ok()
        .filter(|n| (1..=MAX_PERMITS).contains(n))
        .ok_or_else(err)?;
    let count = number("holders", next_field(&mut rest))?;
    let mut inspection = Inspection {
        fence,
        server_time_ms,
        permits,
        lease: None,
        slots: Vec::new(),
    };
    for _ in 0..count {
        let slot = slot_field(next_field(&mut rest), Permits::new(MAX_PERMITS)?)?;
        let permits = u32::try_from(number("permits", next_field(&mut rest))?)
            .ok()
            .and_then(|n| Permits::new(n).ok())
            .ok_or_else(err)?;
        permits.check_slot(slot).map_err(|_| err())?;
        let held = token("token", next_field(&mut rest))?;
        let acquired_at_ms = number("acquired_ms", next_field(&mut rest))?;
        let expires_in_ms = remaining("pttl", next_field(&mut rest))?;
        let owner = sized(&mut rest, reply)?;
        let lease_id = sized(&mut rest, reply)?;
        let view = LeaseView {
            slot,
            permits,
            owner: owner.to_owned(),
            token: held,
            acquired_at_ms,
            expires_in_ms,
            lease_id: LeaseId::new(lease_id)?,
        };
        if slot == Slot::ZERO && inspection.lease.is_none() {
            inspection.lease = Some(view);
        } else if slot != Slot::ZERO && inspection.slots.last().is_none_or(|l| l.slot < slot) {
            inspection.slots.push(view);
        } else {
            return Err(err());
        }
    }
    if !rest.is_empty() {
        return Err(err());
    }
    Ok(inspection)
}

/// The next space-separated field of `rest`, taken from its front.
fn next_field<'a>(rest: &mut &'a str) -> &'a str {
    let (head, tail) = rest.split_once(' ').unwrap_or((rest, ""));
    *rest = tail;
    head
}

/// A free-text field preceded by its length in bytes (`<bytes> <text>`), taken from the front of
/// `rest` with the space after it.
fn sized<'a>(rest: &mut &'a str, reply: &str) -> Result<&'a str, StoreError> {
    let err = || bad("inspect reply", reply);
    let (bytes, tail) = rest.split_once(' ').ok_or_else(err)?;
    let at = usize::try_from(number("field length", bytes)?).map_err(|_| err())?;
    let text = tail.get(..at).ok_or_else(err)?;
    let after = tail.get(at..).ok_or_else(err)?;
    *rest = match after.strip_prefix(' ') {
        Some(next) => next,
        None if after.is_empty() => "",
        None => return Err(err()),
    };
    Ok(text)
}

/// `lua/repair.lua`.
pub const REPAIR: Contract = Contract {
    script: || &SCRIPTS.repair,
    keys: &["lease", "fence", "grant", "permits"],
    per_slot: &["slot_lease", "slot_fence", "slot_grant"],
    argv: &["floor"],
};

/// The repair call with `floor`: every slot a target can have.
pub fn repair_call(k: &TargetKeys, floor: u64) -> ScriptCall<'static> {
    let mut keys = vec![k.lease(), k.fence(), k.grant(), k.permits()];
    for slot in further_slots(Permits::MAX) {
        keys.extend([k.lease_of(slot), k.fence_of(slot), k.grant_of(slot)]);
    }
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    REPAIR.call(&keys, &[&floor.to_string()])
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
            acquire("acquired 17 30000 5 4 0", Permits::ONE),
            Ok(AcquireOutcome::Acquired(Grant { token: 17, .. }))
        ));
        // One form for every permits value: the slot is always named.
        assert!(acquire("acquired 17 30000 5 4", Permits::ONE).is_err());
        assert!(acquire("acquired 17 30000 5 4 1", Permits::ONE).is_err());
        assert!(matches!(
            acquire("held -1 w", Permits::ONE),
            Ok(AcquireOutcome::Held {
                expires_in_ms: 0,
                ..
            })
        ));
        assert_eq!(
            acquire("expired 17", Permits::ONE).unwrap(),
            AcquireOutcome::Expired { token: 17 }
        );
        assert!(acquire("expired 17 3", Permits::ONE).is_err());
        assert!(acquire("expired", Permits::ONE).is_err());
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
            acquire("held 250 team a / job 7", Permits::ONE).unwrap(),
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
        let seen = inspect_view("view 9 100 1 1 0 1 9 90 10 5 a b c 14 id with spaces").unwrap();
        let held = seen.lease.expect("held");
        assert_eq!(held.owner, "a b c");
        assert_eq!(held.lease_id.expose(), "id with spaces");
        // Several slots, each with its own free text, in slot order.
        let seen =
            inspect_view("view 12 100 3 2 0 3 9 90 10 1 a 2 i0 2 3 12 95 20 3 b c 2 i2").unwrap();
        assert_eq!(seen.permits, 3);
        assert_eq!(seen.lease.as_ref().map(|l| l.token), Some(9));
        assert_eq!(seen.slots.len(), 1);
        assert_eq!(seen.slots[0].slot.get(), 2);
        assert_eq!(seen.slots[0].owner, "b c");
        assert_eq!(seen.holders().count(), 2);
        assert_eq!(inspect_view("view 0 100 1 0").unwrap().lease, None);
        assert_eq!(inspect("more").unwrap(), None);
        for garbage in [
            "view 9 100 1 1 0 1 9 90 10 6 a b c 2 id",
            "view 9 100 1 1 0 1 9 90 10 99 a b c 2 id",
            "view 9 100 1 1 0 1 9 90 10 5 a b cX2 id",
            "view 9 100 1 1 0 1 9 90 10 -1 a b c 2 id",
            "view 9 100 1 1 0 1 9 90 10 2 a\u{e9} 2 id",
            "view 9 100 1 2 0 1 9 90 10 1 a 2 id",
            "view 9 100 1 1 0 1 9 90 10 1 a 2 id trailing",
            // Slot 3 of a lease granted under permits 3, slot 0 twice, slots out of order.
            "view 9 100 3 1 3 3 9 90 10 1 a 2 id",
            "view 9 100 1 2 0 1 9 90 10 1 a 2 id 0 1 9 90 10 1 b 2 id",
            "view 9 100 3 2 2 3 9 90 10 1 a 2 id 1 3 9 90 10 1 b 2 id",
            "held 9 100 9 90 10 1 a id",
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
            let per_slot = if contract.per_slot.is_empty() {
                assert!(!source.contains("-- KEYS per further slot: "));
                Vec::new()
            } else {
                listed("-- KEYS per further slot: ")
            };
            assert_eq!(per_slot, contract.per_slot, "{:?}", contract.per_slot);
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
            permits: Permits::ONE,
            slot: Slot::ZERO,
            lease_id: lease_id.clone(),
            owner: Owner::new("o").expect("owner"),
            token: Token::new(1).expect("token"),
        };
        let acquire = AcquireRequest {
            target: target.clone(),
            lease_id,
            owner: Owner::new("o").expect("owner"),
            permits: Permits::ONE,
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
            slot: Slot::ZERO,
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
            (
                &READ,
                read_call(&k, Slot::ZERO, &GuardedKey::new("k").expect("key")),
            ),
            (
                &CHECK,
                check_call(&k, Slot::ZERO, Token::new(1).expect("token")),
            ),
            (&INSPECT, inspect_call(&k, true)),
            (&REPAIR, repair_call(&k, 0)),
        ];
        for (contract, call) in calls {
            let (keys, args) = call.keys_and_args();
            // Inspect and repair name every slot a target can have; the others the permits'.
            let all_slots = std::ptr::eq(contract, &INSPECT) || std::ptr::eq(contract, &REPAIR);
            let further = if all_slots {
                MAX_PERMITS as usize - 1
            } else {
                0
            };
            let expected = contract.keys.len() + contract.per_slot.len() * further;
            assert_eq!(keys.len(), expected, "{:?}", contract.keys);
            assert_eq!(args.len(), contract.argv.len(), "{:?}", contract.argv);
            assert!(std::ptr::eq(call.script, (contract.script)()));
        }
        // Permits 3: acquire names every slot's three keys, release every other slot's lease.
        let three = Permits::new(3).expect("permits");
        let acquire = AcquireRequest {
            permits: three,
            ..acquire
        };
        let (keys, _) = acquire_call(&k, &acquire, "1000", "60000").keys_and_args();
        assert_eq!(keys.len(), ACQUIRE.keys.len() + 2 * ACQUIRE.per_slot.len());
        assert!(keys.contains(&k.lease_of(Slot::new(2).expect("slot"))));
        let release = ReleaseRequest {
            lease: LeaseHandle {
                permits: three,
                slot: Slot::new(1).expect("slot"),
                ..release.lease
            },
            request_id: release.request_id,
        };
        let (keys, _) = release_call(&k, &release, "60000").keys_and_args();
        assert_eq!(keys[0], k.lease_of(Slot::new(1).expect("slot")));
        assert_eq!(
            keys[3..],
            [
                k.lease_of(Slot::ZERO),
                k.lease_of(Slot::new(2).expect("slot"))
            ]
        );
    }

    #[test]
    fn refuses_garbage() {
        assert!(acquire("acquired x 1 1 1 0", Permits::ONE).is_err());
        assert!(acquire("", Permits::ONE).is_err());
        assert!(renew("lost why").is_err());
        assert!(release("released extra").is_err());
        assert!(check("current -3").is_err());
        assert!(check("current 9007199254740992").is_err());
        assert!(check("current 9007199254740991").is_ok());
        assert!(inspect("held 1 2").is_err());
    }
}
