//! Requests and names the contract tests build their calls from.

use super::*;

/// A target in the contract's namespace.
pub fn target(name: &str) -> TargetRef {
    TargetRef::new("contract", name).expect("valid target")
}

/// An acquire request with a fresh request id and no token floor.
pub fn acquire_req(t: &TargetRef, lease: &str, owner: &str, ttl: Duration) -> AcquireRequest {
    AcquireRequest {
        target: t.clone(),
        lease_id: LeaseId::new(lease).expect("lease id"),
        owner: Owner::new(owner).expect("owner"),
        permits: Permits::ONE,
        ttl: Ttl::new(ttl).expect("ttl"),
        min_token: 0,
        request_id: RequestId::random(),
    }
}

/// A lease handle.
pub fn handle(t: &TargetRef, lease: &str, owner: &str, token: u64) -> LeaseHandle {
    LeaseHandle {
        target: t.clone(),
        permits: Permits::ONE,
        slot: Slot::ZERO,
        lease_id: LeaseId::new(lease).expect("lease id"),
        owner: Owner::new(owner).expect("owner"),
        token: token_of(token),
    }
}

/// A renew request with a fresh request id.
pub fn renew_req(h: LeaseHandle, ttl: Duration) -> RenewRequest {
    RenewRequest {
        lease: h,
        ttl: Ttl::new(ttl).expect("ttl"),
        request_id: RequestId::random(),
    }
}

/// A release request with a fresh request id.
pub fn release_req(h: LeaseHandle) -> ReleaseRequest {
    ReleaseRequest {
        lease: h,
        request_id: RequestId::random(),
    }
}

/// A commit to the guarded record `data` with a fresh request id and a sequence number larger
/// than every earlier one of this process (so each new call is a later write).
pub fn commit_req(t: &TargetRef, token: u64, value: &str) -> CommitRequest {
    static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    CommitRequest {
        target: t.clone(),
        slot: Slot::ZERO,
        token: token_of(token),
        key: data_key(),
        value: value.into(),
        sequence: SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
        request_id: RequestId::random(),
    }
}

/// A token the test knows to be valid (1 to 2^53-1).
pub fn token_of(n: u64) -> Token {
    Token::new(n).expect("a valid token")
}

/// The guarded record most tests write: `data`.
pub fn data_key() -> GuardedKey {
    guarded("data")
}

/// A guarded record's name the test knows to be valid.
pub fn guarded(name: &str) -> GuardedKey {
    GuardedKey::new(name).expect("guarded key")
}

/// Acquires and expects a grant.
pub async fn acquired(store: &dyn LeaseStore, req: &AcquireRequest) -> Grant {
    match store.acquire(req).await.expect("acquire call") {
        AcquireOutcome::Acquired(grant) => grant,
        other => panic!("expected acquired, got {other:?}"),
    }
}

/// The usual lease TTL of the contract.
pub const TTL: Duration = Duration::from_secs(30);
/// A TTL short enough to wait out in a test.
pub const SHORT_TTL: Duration = Duration::from_millis(300);
/// Long enough for [`SHORT_TTL`] to have passed.
pub const PAST_SHORT_TTL: Duration = Duration::from_millis(500);

/// An ACL rule documented in docs/operations.md between `<!-- MARKER:begin -->` and its end
/// marker, as command arguments, with `>CHANGE-ME` replaced by `password`: the tests set up
/// exactly what the documentation tells operators to run.
pub fn documented_acl_rule(marker: &str, password: &str) -> Vec<String> {
    let path = crate::kube::repo().join("docs/operations.md");
    let doc = std::fs::read_to_string(&path).expect("docs/operations.md");
    let line = doc
        .lines()
        .skip_while(|l| !l.contains(&format!("<!-- {marker}:begin -->")))
        .find(|l| l.starts_with("ACL SETUSER"))
        .unwrap_or_else(|| panic!("no ACL SETUSER line after the {marker} marker"));
    line.split_whitespace()
        .map(|w| match w {
            ">CHANGE-ME" => format!(">{password}"),
            other => other.to_owned(),
        })
        .collect()
}
