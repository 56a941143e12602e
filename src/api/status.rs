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
    /// The lease expired or was taken while this TargetLease believed it held it. A new attempt
    /// follows; it can only get a larger token.
    Lost,
    /// The lease store refused or failed; see the conditions.
    Failed,
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
    /// When this tenure began (Valkey server time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquired_at: Option<Timestamp>,
    /// When the lease expires unless renewed, as of the last status write (Valkey server time).
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
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// A condition in the metav1.Condition shape.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready`, `Held`, `Reconciling` or `Stalled`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// One CamelCase word a program can match on.
    pub reason: String,
    /// What a person should know.
    pub message: String,
    /// The generation the condition was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When the status last changed.
    pub last_transition_time: Timestamp,
}
