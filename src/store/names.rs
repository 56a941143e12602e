//! The lease-store protocol's validated names and bounds, shared by every backend and every
//! caller: targets, lease ids, request ids, owners, tokens, slots and permits, each checked once
//! at the edge (a flag, a status, a reply), so that no backend checks it again; and the bounds
//! (token, target length, reply TTL) that the Lua scripts and the memory backend enforce alike.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::StoreError;

/// Longest accepted target name; the CRD enforces the same bound.
pub const MAX_TARGET_LEN: usize = 200;

/// How long a reply stays cached for retries with the same request id, unless configured
/// otherwise (every backend).
pub const DEFAULT_REPLY_TTL: Duration = Duration::from_secs(60);

/// The largest fencing token, 2^53-1: the largest integer that every link of the chain holds
/// exactly (a Lua number in the scripts, a JSON number in a TargetLease status and in most
/// clients that read it). Tokens, floors and stored fences above it are refused.
pub const MAX_TOKEN: u64 = (1 << 53) - 1;

/// How far ahead of the store's clock every token is issued, in microseconds (one hour): every
/// token is at least (the clock when it was issued + this lead), on every grant, and at most
/// that unless a floor pushed it higher, so a server that lost the newest grants (a promoted
/// replica, an older snapshot, no data) still issues above every token they carried.
pub const MAX_TOKEN_LEAD_MICROS: u64 = 3_600_000_000;

/// How far ahead of the store's clock a floor may be, in microseconds (two hours): the lead plus
/// one hour for a server whose clock is behind the one that issued the floor's token. A floor
/// further ahead did not come from a store and is refused.
pub const MAX_FLOOR_LEAD_MICROS: u64 = 2 * MAX_TOKEN_LEAD_MICROS;

/// The most permits a target may have. An acquire with permits N reads each of the N slots in
/// one atomic step on the server, so the bound keeps the longest call short (docs/internals/store.md,
/// "Permits").
pub const MAX_PERMITS: u32 = 100;

/// How many holders a target admits at once, each in its own slot with its own fencing token:
/// 1 (an exclusive lease, the default) to [`MAX_PERMITS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Permits(u32);

impl Permits {
    /// One permit: the exclusive lease.
    pub const ONE: Permits = Permits(1);

    /// The most permits a target may have.
    pub const MAX: Permits = Permits(MAX_PERMITS);

    /// The slots of these permits, 0 to permits-1.
    pub fn slots(self) -> impl Iterator<Item = Slot> {
        (0..self.0).map(Slot)
    }

    /// Refuses 0 and anything above [`MAX_PERMITS`].
    pub fn new(permits: u32) -> Result<Self, StoreError> {
        if permits == 0 || permits > MAX_PERMITS {
            return Err(StoreError::InvalidRequest(format!(
                "permits {permits} is out of range: a target admits 1 to {MAX_PERMITS} holders"
            )));
        }
        Ok(Self(permits))
    }

    /// The number.
    pub fn get(self) -> u32 {
        self.0
    }

    /// Whether this is the exclusive lease (one permit).
    pub fn is_exclusive(self) -> bool {
        self.0 == 1
    }

    /// Refuses a slot that is not one of these permits' (0 to permits-1).
    pub fn check_slot(self, slot: Slot) -> Result<(), StoreError> {
        if slot.0 >= self.0 {
            return Err(StoreError::InvalidRequest(format!(
                "slot {slot} is out of range: with {} permit(s) the slots are 0 to {}",
                self.0,
                self.0 - 1
            )));
        }
        Ok(())
    }
}

impl fmt::Display for Permits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One permit's place on a target: 0 to permits-1. Slot 0 is the exclusive lease's place too,
/// so a token is fenced per slot the same way whatever the permits: it is current for its slot
/// while it is the newest grant of that slot.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Slot(#[serde(deserialize_with = "slot_in_range")] u32);

/// A slot read back from a store's records is checked like one from a caller.
fn slot_in_range<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let slot = <u32 as serde::Deserialize>::deserialize(d)?;
    Slot::new(slot)
        .map(Slot::get)
        .map_err(serde::de::Error::custom)
}

impl Slot {
    /// Slot 0: the exclusive lease's.
    pub const ZERO: Slot = Slot(0);

    /// Refuses a slot no target can have (at or above [`MAX_PERMITS`]).
    pub fn new(slot: u32) -> Result<Self, StoreError> {
        if slot >= MAX_PERMITS {
            return Err(StoreError::InvalidRequest(format!(
                "slot {slot} is out of range: slots are 0 to {}",
                MAX_PERMITS - 1
            )));
        }
        Ok(Self(slot))
    }

    /// The number.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Checks a token (or a floor) given by a caller: at most [`MAX_TOKEN`], and non-zero where
/// `positive` is set.
pub fn check_token(what: &str, value: u64, positive: bool) -> Result<(), StoreError> {
    if value > MAX_TOKEN || (positive && value == 0) {
        let low = if positive { 1 } else { 0 };
        return Err(StoreError::InvalidRequest(format!(
            "{what} {value} is out of range: tokens are integers from {low} to 2^53-1 ({MAX_TOKEN})"
        )));
    }
    Ok(())
}

/// Whether `name` is 1 to `max_len` bytes of ASCII letters, digits and the bytes of
/// `punctuation`: the one shape check every name the store puts in a key or a record goes
/// through (targets, request ids, guarded keys, the installation id).
pub(crate) fn is_name(name: &str, max_len: usize, punctuation: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= max_len
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || punctuation.contains(&b))
}

/// A fencing token given by a caller: an integer from 1 to [`MAX_TOKEN`]. Built once at the edge
/// (a flag, a status, a reply), so no backend checks it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Token(u64);

impl Token {
    /// Refuses 0 and anything above 2^53-1.
    pub fn new(value: u64) -> Result<Self, StoreError> {
        check_token("token", value, true)?;
        Ok(Self(value))
    }

    /// The number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Who a lease is claimed for: 1 to 253 bytes (a Kubernetes object name's bound).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner(String);

impl Owner {
    /// Refuses an empty name and one longer than 253 bytes.
    pub fn new(owner: impl Into<String>) -> Result<Self, StoreError> {
        let owner = owner.into();
        if owner.is_empty() || owner.len() > 253 {
            return Err(StoreError::InvalidRequest(
                "owner must be 1 to 253 bytes".into(),
            ));
        }
        Ok(Self(owner))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A lease's time-to-live: whole milliseconds from 1 ms to 24 h.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ttl(u64);

impl Ttl {
    /// Refuses zero (after rounding down to milliseconds) and more than 24 h.
    pub fn new(ttl: Duration) -> Result<Self, StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if ms == 0 || ms > 24 * 3600 * 1000 {
            return Err(StoreError::InvalidRequest(
                "ttl must be between 1 ms and 24 h".into(),
            ));
        }
        Ok(Self(ms))
    }

    /// The TTL in milliseconds, as the wire carries it.
    pub fn millis(self) -> u64 {
        self.0
    }

    /// The TTL as a duration.
    pub fn duration(self) -> Duration {
        Duration::from_millis(self.0)
    }
}

/// The name of a guarded record of a target: 1 to 128 characters of `[A-Za-z0-9._:/-]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GuardedKey(String);

impl GuardedKey {
    /// Refuses anything but 1 to 128 characters of `[A-Za-z0-9._:/-]`.
    pub fn new(key: impl Into<String>) -> Result<Self, StoreError> {
        let key = key.into();
        if !is_name(&key, 128, b"._:/-") {
            return Err(StoreError::InvalidRequest(format!(
                "guarded key {key:?} must be 1 to 128 characters of A-Z, a-z, 0-9 and . _ : / -"
            )));
        }
        Ok(Self(key))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What is leased: leases on the same (namespace, target) exclude each other.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TargetRef {
    namespace: String,
    target: String,
}

impl TargetRef {
    /// Validates and builds a target reference. The target may hold `[A-Za-z0-9._:/-]` only, so
    /// it can never break a key's hash tag; the namespace is a Kubernetes namespace name.
    pub fn new(namespace: &str, target: &str) -> Result<Self, StoreError> {
        let namespace_ok = !namespace.is_empty()
            && namespace.len() <= 63
            && namespace
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !namespace_ok {
            return Err(StoreError::InvalidRequest(format!(
                "namespace {namespace:?} must be 1 to 63 characters of a-z, 0-9 and '-'"
            )));
        }
        if !is_name(target, MAX_TARGET_LEN, b"._:/-") {
            return Err(StoreError::InvalidRequest(format!(
                "target {target:?} must be 1 to {MAX_TARGET_LEN} characters of A-Z, a-z, 0-9 and . _ : / -"
            )));
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            target: target.to_owned(),
        })
    }

    /// The namespace the target belongs to.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The target's name within its namespace.
    pub fn target(&self) -> &str {
        &self.target
    }
}

impl fmt::Display for TargetRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.target)
    }
}

/// The identity of one claim (the TargetLease's `metadata.uid`). Whoever knows it, the owner and
/// the token can renew or release the lease, so it is never printed whole: `Debug` and `Display`
/// show a short hash.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LeaseId(String);

impl LeaseId {
    /// Wraps a lease id; it must not be empty.
    pub fn new(id: impl Into<String>) -> Result<Self, StoreError> {
        let id = id.into();
        if id.is_empty() || id.len() > 256 {
            return Err(StoreError::InvalidRequest(
                "lease id must be 1 to 256 bytes".into(),
            ));
        }
        Ok(Self(id))
    }

    /// The full id, for the wire only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digest = sha1_smol::Sha1::from(self.0.as_bytes())
            .digest()
            .to_string();
        write!(f, "lease#{}", &digest[..10])
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Names one logical call so that retries of it act once. Use a fresh one per call and the same
/// one for every retry of that call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RequestId(String);

impl RequestId {
    /// A new random request id: 128 bits from the thread's CSPRNG (seeded by the OS), as 32 hex
    /// digits. No system call per id, unlike a v4 UUID from the OS generator: one is made for
    /// every call.
    pub fn random() -> Self {
        Self(format!("{:032x}", rand::random::<u128>()))
    }

    /// A caller-chosen request id: 1 to 128 characters of `[A-Za-z0-9._:-]`.
    pub fn new(id: &str) -> Result<Self, StoreError> {
        let ok = is_name(id, 128, b"._:-");
        if !ok {
            return Err(StoreError::InvalidRequest(format!(
                "request id {id:?} must be 1 to 128 characters of A-Z, a-z, 0-9 and . _ : -"
            )));
        }
        Ok(Self(id.to_owned()))
    }

    /// The id as sent on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_refuses_braces_and_empty() {
        assert!(TargetRef::new("shop", "orders-db/migration").is_ok());
        assert!(TargetRef::new("shop", "a{b}").is_err());
        assert!(TargetRef::new("shop", "").is_err());
        assert!(TargetRef::new("Shop", "x").is_err());
        assert!(TargetRef::new("shop", &"x".repeat(MAX_TARGET_LEN + 1)).is_err());
    }

    #[test]
    fn lease_id_is_never_printed_whole() {
        let id = LeaseId::new("6f1c2b9e-0d7a-4c55-9a38-2c1d9e5b7a10").unwrap();
        let shown = format!("{id} {id:?}");
        assert!(!shown.contains("6f1c2b9e"), "{shown}");
        assert!(shown.starts_with("lease#"));
        assert_eq!(format!("{id}"), format!("{id:?}"));
    }

    #[test]
    fn request_id_refuses_spaces() {
        assert!(RequestId::new("abc-1").is_ok());
        assert!(RequestId::new("a b").is_err());
        assert_eq!(RequestId::random().as_str().len(), 32);
    }
}
