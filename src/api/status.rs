//! The status the controller writes: phase, owner, token, times and conditions.

use jiff::Timestamp;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Where a TargetLease stands.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum Phase {
    /// Not reconciled yet, or between attempts.
    #[default]
    Pending,
    /// Another TargetLease holds the target; this one gets it when that one is done.
    Waiting,
    /// This TargetLease holds the target: use `status.fencingToken`.
    Held,
    /// The lease was given up (`spec.release`, holder gone, `maxHoldSeconds` reached).
    Released,
    /// The lease expired or was taken while this TargetLease believed it held it, or could not be
    /// renewed before its `expiresAt` (the `Held` condition is then `Unknown`). A new attempt
    /// follows; it can only get a larger token.
    Lost,
    /// The lease store refused or failed; see the conditions.
    Failed,
}

impl Phase {
    /// Every phase, in the order a TargetLease usually passes through them.
    pub const ALL: [Phase; 6] = [
        Phase::Pending,
        Phase::Waiting,
        Phase::Held,
        Phase::Released,
        Phase::Lost,
        Phase::Failed,
    ];
}

/// Declares an enum of words the controller writes in status, each with its meaning taken from
/// its doc comment, so that the generated reference (`targetlease reference conditions`) says
/// what the code says: `ALL` lists the values, `as_str` is the word written, `meaning` the doc.
macro_rules! status_words {
    ($(#[$meta:meta])* pub enum $name:ident {
        $($(#[doc = $doc:literal])+ $variant:ident => $word:literal,)+
    }) => {
        $(#[$meta])*
        pub enum $name {
            $($(#[doc = $doc])+ $variant,)+
        }

        impl $name {
            /// Every value, in the order declared.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The word written in status (and in Events).
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $word,)+
                }
            }

            /// What it means, for the reference: its doc comment.
            pub fn meaning(self) -> &'static str {
                match self {
                    $($name::$variant => concat!($($doc, "\n"),+),)+
                }
            }
        }
    };
}

status_words! {
    /// Why a condition is what it is: the `reason` of every condition and Event the controller
    /// writes, one CamelCase word a program can match on (docs/reference/conditions.md lists them
    /// all).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Reason {
        /// The target is held.
        Acquired => "Acquired",

        /// Another TargetLease holds the target.
        Waiting => "Waiting",

        /// `spec.release` is true.
        ReleaseRequested => "ReleaseRequested",

        /// The holder pod is gone, finished or another pod of that name, or `run`'s heartbeat
        /// stopped.
        HolderGone => "HolderGone",

        /// The tenure reached `maxHoldSeconds`.
        MaxHoldReached => "MaxHoldReached",

        /// The lease was released (an Event).
        Released => "Released",

        /// Another claim or token holds the target.
        Lost => "Lost",

        /// The lease expired before it was renewed.
        Expired => "Expired",

        /// The lease store could not be reached.
        BackendUnavailable => "BackendUnavailable",

        /// A lease store call timed out.
        BackendTimeout => "BackendTimeout",

        /// The TLS handshake with the lease store failed.
        BackendTlsFailed => "BackendTLSFailed",

        /// The lease store refused the credentials or rights.
        BackendAuthFailed => "BackendAuthFailed",

        /// An acquire was not confirmed durable in time.
        BackendNotDurable => "BackendNotDurable",

        /// The lease store settings are unusable.
        BackendMisconfigured => "BackendMisconfigured",

        /// A record in the lease store is unreadable.
        CorruptRecord => "CorruptRecord",

        /// The lease store refused the request as invalid.
        InvalidRequest => "InvalidRequest",

        /// The lease store answered something this version does not understand.
        BackendUnexpectedReply => "BackendUnexpectedReply",

        /// `spec.ttlSeconds` is shorter than this controller can keep a lease for.
        TtlTooShort => "TTLTooShort",

        /// The holder pod could not be read: the lease is renewed, its holder is not tracked.
        HolderUnknown => "HolderUnknown",

        /// The target's permits are held under another `spec.permits` value than this claim's.
        PermitsConflict => "PermitsConflict",

        /// The tenure ended (the Ready condition says why) and its holder, which acts on the Held
        /// status (`targetlease run`), has not confirmed yet that its command stopped: the target
        /// is passed on once it does, or at the bound by which it must have (the message names it).
        Stopping => "Stopping",

        /// Another installation of targetlease acts in this namespace (`InstallationConflict`,
        /// written by the installation that leaves the TargetLease alone).
        OtherInstallation => "OtherInstallation",
    }
}

impl Reason {
    /// The reason a condition names, if it is one of these.
    pub fn parse(word: &str) -> Option<Reason> {
        Reason::ALL.iter().copied().find(|r| r.as_str() == word)
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

status_words! {
    /// The condition types the controller writes.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum ConditionType {
        /// The resource is where it should be (Held, or Released as asked).
        Ready => "Ready",

        /// The lease is held.
        Held => "Held",

        /// The controller is still working towards Ready (kstatus).
        Reconciling => "Reconciling",

        /// A person must act (kstatus).
        Stalled => "Stalled",

        /// Another installation of targetlease, whose scope overlaps this one's, leaves this
        /// TargetLease to the installation that acts in its namespace (written by the former).
        InstallationConflict => "InstallationConflict",
    }
}

impl ConditionType {
    /// The types the installation that acts on a TargetLease writes (the rest are another's).
    pub const OWN: [ConditionType; 4] = [
        ConditionType::Ready,
        ConditionType::Held,
        ConditionType::Reconciling,
        ConditionType::Stalled,
    ];
}

/// Observed state of a TargetLease.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TargetLeaseStatus {
    /// Where the lease stands.
    pub phase: Phase,
    /// Who holds the lease through this resource (the spec's holder) while Held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The fencing token of the current (or last) tenure: larger than every token issued for the
    /// target before it. Pass it with every write to the protected store.
    // int64 in the schema: the API server does not know the uint64 format. Tokens are at most
    // 2^53-1 (the store's bound), so a status patch cannot publish one no store issues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i64>", range(min = 1, max = 9007199254740991_i64))]
    pub fencing_token: Option<u64>,
    /// While Held: the slot of the target this claim holds, 0 to permits-1 (0 for an exclusive
    /// lease). Its fencing token is current for this slot while it is the slot's newest grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 0, max = 99))]
    pub slot: Option<u32>,
    /// While Held: the permits value the tenure was granted under (a later edit of
    /// spec.permits applies to the next tenure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 100))]
    pub permits: Option<u32>,
    /// When this tenure began (Valkey server time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquired_at: Option<Timestamp>,
    /// While Held: until when the controller keeps the lease, as a promise it keeps while it runs
    /// and reaches the store (Valkey server time): four TTLs after a renewal, moved forward when
    /// one TTL is left, never past the maxHoldSeconds bound. The phase changes first whenever
    /// the lease ends earlier (a release, a loss, a store failure that outlasts the expiry the
    /// store granted). In the past while Held only when no controller is running or the
    /// controller holds refreshes back for a slow API server (the lease is still renewed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Timestamp>,
    /// While Waiting: who holds the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The generation whose tenure reached `maxHoldSeconds`: this TargetLease does not take the
    /// target again until its spec changes. A field of its own, so store failures, wake-ups and
    /// controller restarts cannot wash it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hold_spent_generation: Option<i64>,
    /// `Ready`, `Held`, `Reconciling` and `Stalled`, in the metav1.Condition shape.
    #[serde(default)]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// A condition in the metav1.Condition shape.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    // The field checks are metav1.Condition's, so tools that read conditions can rely on them.
    /// `Ready`, `Held`, `Reconciling`, `Stalled`, or `InstallationConflict` (written by another
    /// installation of targetlease that leaves this TargetLease alone).
    #[serde(rename = "type")]
    #[schemars(
        length(min = 1, max = 316),
        regex(
            pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
        )
    )]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    #[schemars(extend("enum" = ["True", "False", "Unknown"]))]
    pub status: String,
    /// One CamelCase word a program can match on.
    #[schemars(
        length(min = 1, max = 1024),
        regex(pattern = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    )]
    pub reason: String,
    /// What a person should know.
    #[schemars(length(max = 32768))]
    pub message: String,
    /// The generation the condition was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,
    /// When the status last changed.
    pub last_transition_time: Timestamp,
}
