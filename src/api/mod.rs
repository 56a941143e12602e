//! The `TargetLease` custom resource (`targetlease.dev/v1alpha1`).
//!
//! The schema is the first line of defence: the API server itself refuses invalid resources with
//! a message naming the field (OpenAPI bounds and patterns, CEL rules for immutability and for
//! relations between fields), so the controller never sees them.

pub mod reference;
mod status;

use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};

pub use status::{Condition, ConditionType, Phase, Reason, TargetLeaseStatus};

/// API group.
pub const GROUP: &str = "targetlease.dev";
/// Finalizer that keeps a resource until its lease is released in the store.
pub const FINALIZER: &str = "targetlease.dev/release";
/// Field manager of every write the controller makes.
pub const FIELD_MANAGER: &str = "targetlease-controller";
/// Default lease time-to-live.
pub const DEFAULT_TTL_SECONDS: u32 = 30;

/// [`DEFAULT_TTL_SECONDS`] as a duration: the default `--ttl` of `targetlease run` and `lease`.
pub const DEFAULT_TTL: std::time::Duration =
    std::time::Duration::from_secs(DEFAULT_TTL_SECONDS as u64);
/// Longest accepted lease time-to-live.
pub const MAX_TTL_SECONDS: u32 = 3600;
/// Longest accepted `maxHoldSeconds` (7 days).
pub const MAX_HOLD_SECONDS: u32 = 7 * 24 * 3600;
/// Annotation that `targetlease run` refreshes every quarter of the TTL: a TargetLease carrying
/// it whose value has not changed for half the TTL has lost its holder and is released.
pub const HEARTBEAT_ANNOTATION: &str = "targetlease.dev/heartbeat";

/// A claim on a named target: at most `permits` TargetLeases per (namespace, target) hold it at a
/// time (one by default), each in its own slot, and each tenure gets a fencing token larger than
/// every earlier one.
// Several printer columns share a type; clippy reads the repeated `type_` as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "targetlease.dev",
    version = "v1alpha1",
    kind = "TargetLease",
    plural = "targetleases",
    shortname = "tl",
    category = "all",
    namespaced,
    status = "TargetLeaseStatus",
    doc = "A claim on a named target, with a fencing token in its status",
    printcolumn(name = "Target", type_ = "string", json_path = ".spec.target"),
    printcolumn(name = "Holder", type_ = "string", json_path = ".spec.holder"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Token", type_ = "integer", json_path = ".status.fencingToken"),
    printcolumn(name = "Slot", type_ = "integer", json_path = ".status.slot"),
    printcolumn(name = "Expires", type_ = "string", json_path = ".status.expiresAt"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new(
    "!has(self.maxHoldSeconds) || self.maxHoldSeconds >= self.ttlSeconds"
).message("maxHoldSeconds must be at least ttlSeconds").field_path(".maxHoldSeconds"))]
#[serde(rename_all = "camelCase")]
pub struct TargetLeaseSpec {
    /// What is leased. Leases on the same target in the same namespace exclude each other.
    /// 1 to 200 characters of A-Z, a-z, 0-9 and . _ : / - ; immutable.
    #[schemars(length(min = 1, max = 200), regex(pattern = r"^[A-Za-z0-9._:/-]+$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("target is immutable"))]
    pub target: String,

    /// Who the lease is claimed for, usually the pod name. 1 to 253 characters of A-Z, a-z, 0-9
    /// and . _ : - ; immutable.
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[A-Za-z0-9._:-]+$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("holder is immutable"))]
    pub holder: String,

    /// Release the lease as soon as this object is gone or has finished (when the controller
    /// tracks holder pods in this namespace: see the chart value controller.holderPods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_ref: Option<HolderRef>,

    /// Lease time-to-live in Valkey, in seconds (1 to 3600); renewed every ttlSeconds/3.
    #[serde(default = "default_ttl")]
    #[schemars(with = "i32", range(min = 1, max = 3600))]
    pub ttl_seconds: u32,

    /// How many TargetLeases may hold the target at once (1 to 100; default 1, an exclusive
    /// lease). Each holder gets its own slot (status.slot, 0 to permits-1) and a fencing token
    /// larger than every token issued on the target; a token is current for its slot while it
    /// is the newest grant of that slot. Every claim on a target must ask the same value: a
    /// claim asking another while permits granted under a different value are held waits with
    /// reason PermitsConflict until they are all gone.
    #[serde(default = "default_permits")]
    #[schemars(with = "i32", range(min = 1, max = 100))]
    pub permits: u32,

    /// Hard bound on one tenure, in seconds; the lease is released when it is reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 604800))]
    pub max_hold_seconds: Option<u32>,

    /// Give the lease up but keep the resource (GitOps-friendly release).
    #[serde(default)]
    pub release: bool,

    /// Order among the claims waiting for the target: a higher priority gets it first; equal
    /// priorities go in the order the claims were created, so a new claim never jumps an older
    /// one (within the one second of creationTimestamp, in the order the controller saw them
    /// created; by name for claims it found already there when it started). Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: Option<i32>,
}

fn default_ttl() -> u32 {
    DEFAULT_TTL_SECONDS
}

fn default_permits() -> u32 {
    1
}

/// The object whose life bounds the lease.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HolderRef {
    /// Kind of the holder; only `Pod` is supported.
    #[schemars(regex(pattern = r"^Pod$"))]
    pub kind: String,
    /// Name of the holder, in the TargetLease's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// UID of the holder pod (`metadata.uid`, from the downward API): a pod of the same name
    /// with another UID (recreated, as a StatefulSet does) is not the holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub uid: Option<String>,
}

/// A spec with the defaults, for unit tests of code that reads TargetLeases.
#[cfg(test)]
pub(crate) fn test_spec(target: &str, holder: &str) -> TargetLeaseSpec {
    TargetLeaseSpec {
        target: target.into(),
        holder: holder.into(),
        holder_ref: None,
        ttl_seconds: DEFAULT_TTL_SECONDS,
        permits: 1,
        max_hold_seconds: None,
        release: false,
        priority: None,
    }
}

/// The CRD as YAML, as `targetlease crd` prints it and `crds/` holds it.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&TargetLease::crd())
}

/// The Helm chart's CRD template (`charts/targetlease/templates/crd.yaml`): the same spec as
/// [`crd_yaml`], inside `crds.enabled`, with the chart's labels and, with `crds.keep`, the
/// annotation that makes `helm uninstall` leave the CRD (and so every TargetLease) in place.
pub fn chart_crd_template() -> Result<String, serde_yaml::Error> {
    let crd = TargetLease::crd();
    let spec = serde_yaml::to_string(&serde_json::json!({ "spec": crd.spec }))?;
    let name = crd.metadata.name.unwrap_or_default();
    Ok(format!(
        "{{{{- /* Generated by `targetlease crd --chart` from the code; do not edit. */ -}}}}
{{{{- if .Values.crds.enabled }}}}
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {name}
  labels:
    {{{{- include \"targetlease.labels\" . | nindent 4 }}}}
  {{{{- if .Values.crds.keep }}}}
  annotations:
    # Uninstalling the release leaves the CRD, and so every TargetLease, in place.
    helm.sh/resource-policy: keep
  {{{{- end }}}}
{spec}{{{{- end }}}}
"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_crd_matches_the_code() {
        let committed = include_str!("../../crds/targetlease.dev_targetleases.yaml");
        let generated = crd_yaml().expect("CRD serializes");
        assert!(
            committed == generated,
            "crds/targetlease.dev_targetleases.yaml is stale: run `cargo run -- crd > crds/targetlease.dev_targetleases.yaml`"
        );
    }

    #[test]
    fn committed_chart_crd_matches_the_code() {
        let committed = include_str!("../../charts/targetlease/templates/crd.yaml");
        let generated = chart_crd_template().expect("CRD serializes");
        assert!(
            committed == generated,
            "charts/targetlease/templates/crd.yaml is stale: run `cargo run -- crd --chart > \
             charts/targetlease/templates/crd.yaml`"
        );
    }

    #[test]
    fn schema_carries_the_validation() {
        let crd = serde_json::to_string(&TargetLease::crd()).expect("json");
        for needle in [
            "self == oldSelf",
            "target is immutable",
            "holder is immutable",
            "maxHoldSeconds must be at least ttlSeconds",
            r#""x-kubernetes-list-type":"map""#,
            r#""maximum":3600"#,
        ] {
            assert!(crd.contains(needle), "CRD lacks {needle}");
        }
    }
}
