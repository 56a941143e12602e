//! The `TargetLease` custom resource and its CRD.
//!
//! The schema is the first line of defence: the API server itself refuses invalid resources with
//! a message naming the field (OpenAPI bounds and patterns, CEL rules for immutability and for
//! relations between fields), so the controller never sees them.
//!
//! The CRD serves two versions with one schema, `v1alpha1` and `v1beta1`; this code reads and
//! writes `v1beta1` ([`VERSION`]). With identical schemas the API server converts between them
//! by changing `apiVersion` alone (conversion strategy `None`), so an object written as either
//! is read as either, and clients of both versions work side by side. Which version the API
//! server stores is chosen at install time ([`StorageVersion`]); `targetlease migrate-storage`
//! rewrites stored objects after a change and records it in the CRD's `status.storedVersions`.
//! An incompatible schema change would need a new version with a conversion webhook (served by
//! the controller) and the same two stages; docs/install.md "Upgrading" says what each allows.

pub mod heartbeat;
pub mod reference;
mod status;
pub mod storage;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionVersion,
};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};

pub use status::{Condition, ConditionType, Phase, Reason, TargetLeaseStatus};

/// API group.
pub const GROUP: &str = "targetlease.dev";
/// The API version this code reads and writes (the derive below names it too; a unit test
/// keeps the two equal).
pub const VERSION: &str = "v1beta1";
/// The CRD's name.
pub const CRD_NAME: &str = "targetleases.targetlease.dev";
/// Every version the CRD serves, oldest first; all share one schema.
pub const SERVED_VERSIONS: [&str; 2] = ["v1alpha1", "v1beta1"];
/// The warning the API server returns to a client of `v1alpha1` once `v1beta1` is stored.
pub const V1ALPHA1_DEPRECATION: &str = "targetlease.dev/v1alpha1 TargetLease is deprecated: \
     use targetlease.dev/v1beta1, which has the same fields";

/// The version the API server stores TargetLeases in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum StorageVersion {
    /// Stored as `v1alpha1`: a rollback to a release that serves only `v1alpha1` stays possible.
    #[default]
    #[value(name = "v1alpha1")]
    V1alpha1,
    /// Stored as `v1beta1`; `v1alpha1` is still served, with a deprecation warning.
    #[value(name = "v1beta1")]
    V1beta1,
}

impl StorageVersion {
    /// The version's name.
    pub fn as_str(self) -> &'static str {
        match self {
            StorageVersion::V1alpha1 => "v1alpha1",
            StorageVersion::V1beta1 => "v1beta1",
        }
    }
}
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

/// A claim on a named target: at most `permits` TargetLeases per (namespace, target) hold it at a
/// time (one by default), each in its own slot, and each tenure gets a fencing token larger than
/// every earlier one.
// Several printer columns share a type; clippy reads the repeated `type_` as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "targetlease.dev",
    version = "v1beta1",
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
    ),
    selectable = ".spec.target",
    selectable = ".spec.holder"
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
    #[schemars(with = "i32", range(min = 1, max = MAX_TTL_SECONDS))]
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
    #[schemars(with = "Option<i32>", range(min = 1, max = MAX_HOLD_SECONDS))]
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
    #[schemars(extend("enum" = ["Pod"]))]
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

/// The CRD with every served version, storing `storage`.
pub fn crd(storage: StorageVersion) -> CustomResourceDefinition {
    let mut crd = TargetLease::crd();
    let body = shared_version_body(&crd);
    crd.spec.versions = SERVED_VERSIONS
        .iter()
        .map(|name| {
            let deprecated = *name == "v1alpha1" && storage != StorageVersion::V1alpha1;
            CustomResourceDefinitionVersion {
                name: (*name).to_string(),
                served: true,
                storage: *name == storage.as_str(),
                deprecated: deprecated.then_some(true),
                deprecation_warning: deprecated.then(|| V1ALPHA1_DEPRECATION.to_string()),
                ..body.clone()
            }
        })
        .collect();
    crd
}

/// What every served version shares: the derived version's schema, printer columns,
/// selectable fields and subresources.
fn shared_version_body(crd: &CustomResourceDefinition) -> CustomResourceDefinitionVersion {
    // The derive makes exactly one version: the one this code speaks.
    crd.spec
        .versions
        .first()
        .cloned()
        .unwrap_or_else(|| CustomResourceDefinitionVersion {
            name: VERSION.to_string(),
            ..Default::default()
        })
}

/// The CRD as YAML, as `targetlease crd` prints it and `crds/` holds it (with the default
/// storage version).
pub fn crd_yaml(storage: StorageVersion) -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&crd(storage))
}

/// The Helm chart's CRD template (`charts/targetlease/templates/crd.yaml`): the same spec as
/// [`crd_yaml`], inside `crds.enabled`, with the chart's labels, the storage version and the
/// deprecation from `crds.storageVersion`, and, with `crds.keep`, the annotation that makes
/// `helm uninstall` leave the CRD (and so every TargetLease) in place.
pub fn chart_crd_template() -> Result<String, serde_yaml::Error> {
    let crd = TargetLease::crd();
    let mut spec = serde_yaml::to_value(&crd.spec)?;
    if let Some(spec) = spec.as_mapping_mut() {
        spec.remove("versions");
    }
    let mut wrapped = serde_yaml::Mapping::new();
    wrapped.insert("spec".into(), spec);
    let spec = serde_yaml::to_string(&wrapped)?;
    let mut body = serde_yaml::to_value(shared_version_body(&crd))?;
    if let Some(body) = body.as_mapping_mut() {
        for key in [
            "name",
            "served",
            "storage",
            "deprecated",
            "deprecationWarning",
        ] {
            body.remove(key);
        }
    }
    let body = indent(&serde_yaml::to_string(&body)?, "    ");
    let versions = SERVED_VERSIONS
        .iter()
        .map(|v| format!("{v:?}"))
        .collect::<Vec<_>>()
        .join(" ");
    let name = crd.metadata.name.unwrap_or_default();
    Ok(format!(
        "{{{{- /* Generated by `targetlease crd --chart` from the code; do not edit. */ -}}}}
{{{{- if .Values.crds.enabled }}}}
{{{{- /*
Unset or empty: the version the installed CRD stores in, so that an upgrade whose values lack the
key (a values file without it, `--reuse-values` from an older release or after a refused
rollback) never moves the storage back; v1alpha1 on a new installation and wherever the chart is
rendered without a cluster (`helm template`, Argo CD), where the key must be set.
*/}}}}
{{{{- $storage := .Values.crds.storageVersion }}}}
{{{{- if not $storage }}}}
{{{{- $storage = \"v1alpha1\" }}}}
{{{{- $live := lookup \"apiextensions.k8s.io/v1\" \"CustomResourceDefinition\" \"\" {name:?} }}}}
{{{{- range (dig \"spec\" \"versions\" list $live) }}}}
{{{{- if .storage }}}}{{{{ $storage = .name }}}}{{{{ end }}}}
{{{{- end }}}}
{{{{- end }}}}
{{{{- if not (has $storage (list {versions})) }}}}
{{{{- fail (printf \"the installed CRD %s stores TargetLeases as %s, which this chart does not serve: set crds.storageVersion to one of {versions_text} (see docs/install.md, Upgrading)\" {name:?} $storage) }}}}
{{{{- end }}}}
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
{spec}  versions:
  {{{{- range $version := list {versions} }}}}
  - name: {{{{ $version }}}}
    served: true
    storage: {{{{ eq $version $storage }}}}
    {{{{- if and (eq $version \"v1alpha1\") (ne $storage \"v1alpha1\") }}}}
    deprecated: true
    deprecationWarning: {deprecation:?}
    {{{{- end }}}}
{body}  {{{{- end }}}}
{{{{- end }}}}
",
        deprecation = V1ALPHA1_DEPRECATION,
        versions_text = SERVED_VERSIONS.join(", "),
    ))
}

/// `text` with `prefix` before every non-empty line (YAML nested under a template line).
fn indent(text: &str, prefix: &str) -> String {
    text.lines()
        .map(|line| {
            if line.is_empty() {
                "\n".to_string()
            } else {
                format!("{prefix}{line}\n")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_crd_matches_the_code() {
        let committed = include_str!("../../crds/targetlease.dev_targetleases.yaml");
        let generated = crd_yaml(StorageVersion::default()).expect("CRD serializes");
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
    fn the_code_speaks_the_version_it_names() {
        assert_eq!(<TargetLease as kube::Resource>::version(&()), VERSION);
        assert_eq!(
            SERVED_VERSIONS.last(),
            Some(&VERSION),
            "the newest served version"
        );
    }

    #[test]
    fn every_version_shares_one_schema_and_one_is_stored() {
        for storage in [StorageVersion::V1alpha1, StorageVersion::V1beta1] {
            let crd = crd(storage);
            let names: Vec<_> = crd.spec.versions.iter().map(|v| v.name.as_str()).collect();
            assert_eq!(names, SERVED_VERSIONS);
            let stored: Vec<_> = crd.spec.versions.iter().filter(|v| v.storage).collect();
            assert_eq!(stored.len(), 1);
            assert_eq!(stored[0].name, storage.as_str());
            assert!(crd.spec.versions.iter().all(|v| v.served));
            let first = &crd.spec.versions[0];
            for other in &crd.spec.versions[1..] {
                assert_eq!(other.schema, first.schema);
                assert_eq!(
                    other.additional_printer_columns,
                    first.additional_printer_columns
                );
                assert_eq!(other.selectable_fields, first.selectable_fields);
                assert_eq!(other.subresources, first.subresources);
            }
            // v1alpha1 is deprecated exactly when it is no longer stored.
            let v1alpha1 = &crd.spec.versions[0];
            let deprecated = storage != StorageVersion::V1alpha1;
            assert_eq!(v1alpha1.deprecated, deprecated.then_some(true));
            assert_eq!(
                v1alpha1.deprecation_warning.as_deref(),
                deprecated.then_some(V1ALPHA1_DEPRECATION)
            );
            assert_eq!(crd.spec.versions[1].deprecated, None);
        }
    }

    #[test]
    fn the_chart_template_has_no_template_text_from_the_schema() {
        // Descriptions are copied into a Helm template: a `{{` in one would be read as Helm's.
        let crd = serde_yaml::to_string(&TargetLease::crd()).expect("yaml");
        assert!(!crd.contains("{{") && !crd.contains("}}"));
    }

    #[test]
    fn schema_carries_the_validation() {
        let crd = serde_json::to_string(&crd(StorageVersion::default())).expect("json");
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
