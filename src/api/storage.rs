//! Moving the stored TargetLeases to the CRD's storage version (`targetlease migrate-storage`).
//!
//! The API server writes an object in the storage version only when the object is written, so
//! after the CRD's storage version changes, objects written before stay encoded in the old one,
//! and the CRD's `status.storedVersions` keeps naming it. A release that no longer serves that
//! version cannot be installed until every stored object is rewritten and the old version is
//! dropped from `storedVersions` (the API server refuses the CRD update otherwise). This module
//! does that, as `kube-storage-version-migrator` does: it waits until the API server stores in
//! the new version, rewrites every TargetLease unchanged (an update re-encodes it), and only then
//! records the single stored version. An object written meanwhile through an API server that
//! took the change is already encoded in the new version. One that has not taken it yet (with
//! several API servers, each reads the CRD change on its own) may still store a write in the old
//! version after the rewrite, which the recorded stored versions then no longer show: a second
//! run with `rewrite_all` once every API server has the change rewrites it too.

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};

use super::{CRD_NAME, GROUP, SERVED_VERSIONS, TargetLease};

/// How long to wait for the API server to report the new storage version.
pub const STORAGE_SWITCH_TIMEOUT: Duration = Duration::from_secs(60);
/// TargetLeases listed per page.
const PAGE: u32 = 500;
/// Attempts to rewrite one object that others keep changing (each conflict re-reads it).
const CONFLICT_ATTEMPTS: u32 = 10;

/// What a migration did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migration {
    /// The version every TargetLease is stored in now.
    pub storage: String,
    /// `status.storedVersions` before the migration.
    pub stored_before: Vec<String>,
    /// TargetLeases the rewrite re-encoded (those already stored in the storage version are
    /// left unchanged by the API server and not counted); None when no rewrite ran (one version
    /// was stored, and not every TargetLease was asked for).
    pub rewritten: Option<usize>,
    /// TargetLeases whose field-manager entries named a version the CRD no longer serves,
    /// moved to the storage version.
    pub repaired: usize,
}

/// Why a migration stopped. Nothing it did is undone by stopping: objects rewritten stay valid
/// in the storage version, and `storedVersions` is only changed at the end.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The CRD could not be read, or names no storage version.
    #[error("cannot read the CRD {CRD_NAME}: {0}")]
    Crd(String),
    /// The API server did not report the new storage version in time.
    #[error(
        "the API server still does not store TargetLeases as {storage} after {waited:?} \
         ({last}); try again later"
    )]
    StorageNotSwitched {
        /// The CRD's storage version.
        storage: String,
        /// How long the migration waited.
        waited: Duration,
        /// What discovery last answered: the storage version it reported, or why it failed.
        last: String,
    },
    /// Others changed one TargetLease every time it was about to be rewritten.
    #[error(
        "cannot rewrite TargetLease {namespace}/{name}: it changed {CONFLICT_ATTEMPTS} times \
         while being rewritten; run again"
    )]
    KeptChanging {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// A call to the API server failed.
    #[error("{action}: {source}")]
    Api {
        /// What was being done.
        action: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
}

impl MigrationError {
    fn api(action: impl Into<String>) -> impl FnOnce(kube::Error) -> MigrationError {
        let action = action.into();
        move |source| MigrationError::Api { action, source }
    }
}

/// The hash the API server's discovery reports for a resource stored as `group/version/kind`
/// (`storageVersionHash`): base64 of the first 8 bytes of the SHA-256 of that string.
pub fn storage_version_hash(group: &str, version: &str, kind: &str) -> String {
    use base64::Engine as _;
    let digest = ring::digest::digest(
        &ring::digest::SHA256,
        format!("{group}/{version}/{kind}").as_bytes(),
    );
    base64::engine::general_purpose::STANDARD.encode(&digest.as_ref()[..8])
}

/// Rewrites every TargetLease in the CRD's storage version and records it as the only stored
/// version; then moves field-manager entries of versions the CRD no longer serves to the storage
/// version. Safe to run again, and at any time: with one stored version and no such entry it
/// writes nothing, unless `rewrite_all` asks for every TargetLease to be rewritten anyway.
pub async fn migrate(client: &Client, rewrite_all: bool) -> Result<Migration, MigrationError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds
        .get(CRD_NAME)
        .await
        .map_err(|e| MigrationError::Crd(e.to_string()))?;
    let storage = crd
        .spec
        .versions
        .iter()
        .find(|v| v.storage)
        .map(|v| v.name.clone())
        .ok_or_else(|| MigrationError::Crd("no version is marked for storage".into()))?;
    let served: Vec<String> = crd
        .spec
        .versions
        .iter()
        .filter(|v| v.served)
        .map(|v| format!("{GROUP}/{}", v.name))
        .collect();
    let stored_before = crd
        .status
        .as_ref()
        .and_then(|s| s.stored_versions.clone())
        .unwrap_or_default();
    // Read and written in the storage version: always served, also after a rollback to a
    // release that does not serve the version this code speaks.
    let resource = ApiResource {
        api_version: format!("{GROUP}/{storage}"),
        version: storage.clone(),
        ..ApiResource::erase::<TargetLease>(&())
    };
    let narrow = stored_before != [storage.clone()];
    let rewritten = if narrow || rewrite_all {
        wait_for_storage_switch(client, &storage).await?;
        let mut count = 0;
        for object in list_all(client, &resource).await? {
            if rewrite(client, &resource, object).await? {
                count += 1;
            }
        }
        Some(count)
    } else {
        None
    };
    if narrow {
        let record = serde_json::json!({ "status": { "storedVersions": [storage] } });
        crds.patch_status(CRD_NAME, &PatchParams::default(), &Patch::Merge(&record))
            .await
            .map_err(MigrationError::api(format!(
                "cannot record {storage} as the only stored version in the CRD's status \
                 (every TargetLease was rewritten; run again)"
            )))?;
    }
    let mut repaired = 0;
    let to = format!("{GROUP}/{storage}");
    for object in list_all(client, &resource).await? {
        if repair_managers(client, &resource, object, &served, &to).await? {
            repaired += 1;
        }
    }
    Ok(Migration {
        storage,
        stored_before,
        rewritten,
        repaired,
    })
}

/// What a storageVersionHash from discovery says: the served version it names, if any.
fn describe_storage_hash(hash: Option<&str>, kind: &str) -> String {
    match hash {
        None => "discovery reports no storage version hash".to_string(),
        Some(hash) => SERVED_VERSIONS
            .iter()
            .find(|v| storage_version_hash(GROUP, v, kind) == hash)
            .map_or_else(
                || {
                    format!(
                        "discovery reports the storage version hash {hash}, of no served version"
                    )
                },
                |v| format!("discovery reports them stored as {v}"),
            ),
    }
}

/// Waits until the API server's discovery reports TargetLeases stored as `storage`: a CRD update
/// takes effect in each API server a moment after it is accepted, and an object rewritten
/// before that would be encoded in the old version again.
async fn wait_for_storage_switch(client: &Client, storage: &str) -> Result<(), MigrationError> {
    let kind = TargetLease::kind(&());
    let want = storage_version_hash(GROUP, storage, &kind);
    let plural = TargetLease::plural(&());
    let started = tokio::time::Instant::now();
    let mut last = "discovery was not asked".to_string();
    loop {
        // Any served version's resource list reports the same hash; ask each, as one may be
        // the version just added and not served yet.
        for version in SERVED_VERSIONS {
            let list = match client
                .list_api_group_resources(&format!("{GROUP}/{version}"))
                .await
            {
                Ok(list) => list,
                Err(e) => {
                    last = format!("discovery of {GROUP}/{version} failed: {e}");
                    continue;
                }
            };
            let hash = list
                .resources
                .iter()
                .find(|r| r.name == plural)
                .and_then(|r| r.storage_version_hash.as_deref());
            if hash == Some(want.as_str()) {
                return Ok(());
            }
            last = describe_storage_hash(hash, &kind);
        }
        if started.elapsed() >= STORAGE_SWITCH_TIMEOUT {
            return Err(MigrationError::StorageNotSwitched {
                storage: storage.to_string(),
                waited: started.elapsed(),
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Every TargetLease in every namespace. Read whole before anything is written, so that the
/// listing is short; one that outlives etcd's compaction anyway (410) is started again.
async fn list_all(
    client: &Client,
    resource: &ApiResource,
) -> Result<Vec<DynamicObject>, MigrationError> {
    // Dynamic objects, so that a field this release does not know is written back as it was.
    let all: Api<DynamicObject> = Api::all_with(client.clone(), resource);
    let mut objects = Vec::new();
    let mut params = ListParams::default().limit(PAGE);
    loop {
        let page = match all.list(&params).await {
            Ok(page) => page,
            Err(kube::Error::Api(status))
                if status.code == 410 && params.continue_token.is_some() =>
            {
                objects.clear();
                params = ListParams::default().limit(PAGE);
                continue;
            }
            Err(e) => return Err(MigrationError::api("cannot list TargetLeases")(e)),
        };
        objects.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(objects),
        }
    }
}

/// Moves `object`'s field-manager entries (`metadata.managedFields`) that name a version not in
/// `served` to version `to` (every version has the same schema, so their field sets stay
/// valid). The API server cannot convert such an entry, and refuses every server-side apply to
/// the object until it is gone: after a rollback to a release that does not serve a version,
/// every object written through it. False when nothing needed it.
async fn repair_managers(
    client: &Client,
    resource: &ApiResource,
    object: DynamicObject,
    served: &[String],
    to: &str,
) -> Result<bool, MigrationError> {
    let what = format!("move the field managers of TargetLease {{}} to {to}");
    write_back(client, resource, object, &what, |api, object| {
        let mut entries = object.metadata.managed_fields.clone().unwrap_or_default();
        let mut changed = false;
        for entry in &mut entries {
            if entry
                .api_version
                .as_ref()
                .is_some_and(|v| !served.contains(v))
            {
                entry.api_version = Some(to.to_string());
                changed = true;
            }
        }
        // The resourceVersion makes the patch conditional: an entry added meanwhile is kept.
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": object.metadata.resource_version,
                "managedFields": entries,
            }
        });
        let name = object.name_any();
        changed.then(|| {
            Box::pin(async move {
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| true)
            }) as Write
        })
    })
    .await
}

/// Writes `object` back unchanged: the API server re-encodes it in the storage version, and
/// leaves an object already stored so as it was (no new resourceVersion). True when it was
/// re-encoded; false when it was already stored so, or deleted meanwhile.
async fn rewrite(
    client: &Client,
    resource: &ApiResource,
    object: DynamicObject,
) -> Result<bool, MigrationError> {
    write_back(
        client,
        resource,
        object,
        "rewrite TargetLease {}",
        |api, object| {
            let (name, object) = (object.name_any(), object.clone());
            Some(Box::pin(async move {
                let before = object.metadata.resource_version.clone();
                let after = api.replace(&name, &PostParams::default(), &object).await?;
                Ok(after.metadata.resource_version != before)
            }) as Write)
        },
    )
    .await
}

/// One write of [`write_back`]: true when it changed the object.
type Write = std::pin::Pin<Box<dyn std::future::Future<Output = Result<bool, kube::Error>> + Send>>;

/// Makes the write `write` builds from `object` (None: nothing to write); on a conflict, reads
/// the object again and builds the write anew, up to [`CONFLICT_ATTEMPTS`] times. What the write
/// answered, or false when there was nothing to write or the object was deleted meanwhile.
/// `what` names the write in errors, `{}` standing for namespace/name.
async fn write_back(
    client: &Client,
    resource: &ApiResource,
    mut object: DynamicObject,
    what: &str,
    write: impl Fn(Api<DynamicObject>, &DynamicObject) -> Option<Write>,
) -> Result<bool, MigrationError> {
    let namespace = object.metadata.namespace.clone().unwrap_or_default();
    let name = object.name_any();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, resource);
    for _ in 0..CONFLICT_ATTEMPTS {
        let Some(attempt) = write(api.clone(), &object) else {
            return Ok(false);
        };
        match attempt.await {
            Ok(changed) => return Ok(changed),
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(false),
            Err(kube::Error::Api(status)) if status.code == 409 => {
                match api
                    .get_opt(&name)
                    .await
                    .map_err(MigrationError::api(format!(
                        "cannot read TargetLease {namespace}/{name} again"
                    )))? {
                    Some(fresh) => object = fresh,
                    None => return Ok(false),
                }
            }
            Err(source) => {
                return Err(MigrationError::Api {
                    action: format!(
                        "cannot {}",
                        what.replace("{}", &format!("{namespace}/{name}"))
                    ),
                    source,
                });
            }
        }
    }
    Err(MigrationError::KeptChanging { namespace, name })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storage_hash_names_its_version() {
        let kind = TargetLease::kind(&());
        let alpha = storage_version_hash(GROUP, "v1alpha1", &kind);
        assert_eq!(
            describe_storage_hash(Some(&alpha), &kind),
            "discovery reports them stored as v1alpha1"
        );
        assert!(describe_storage_hash(Some("xyz"), &kind).contains("of no served version"));
        assert!(describe_storage_hash(None, &kind).contains("no storage version hash"));
    }

    #[test]
    fn storage_version_hash_is_the_api_servers() {
        // As the API server reports them in discovery (k8s.io/apiserver's StorageVersionHash):
        // apps/v1 Deployment is "8aSe+NMegvE=" on every Kubernetes release.
        assert_eq!(
            storage_version_hash("apps", "v1", "Deployment"),
            "8aSe+NMegvE="
        );
    }
}
