//! Which installation acts in a namespace.
//!
//! Two installations of targetlease (two Helm releases, each with its own Valkey or key prefix)
//! whose scopes overlap would each grant the claims of a shared namespace from their own store:
//! two holders of one target, and a token that moves with every grant of either. Marking each
//! TargetLease would not be enough: two claims on one target, marked by two installations at the
//! same moment, would still be granted by both. So the unit is the namespace, and the API server
//! is the arbiter: before it acts on any TargetLease of a namespace, a controller claims the
//! namespace for its installation with a `coordination.k8s.io` Lease named [`MARKER`], whose
//! `holderIdentity` is the installation's id. The first installation to create it acts there
//! (the API server lets exactly one create succeed); an installation that finds another's
//! marker leaves every TargetLease of the namespace alone: no store call, no finalizer, no
//! status but one condition of its own, `InstallationConflict`, and a warning in its log.
//!
//! The marker is never renewed and never expires: a namespace moves to another installation
//! only when a person deletes the marker (docs/operations.md, "Installations").

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tracing::{info, warn};

use super::error::Error;

/// The name of the Lease that says which installation acts in its namespace.
pub const MARKER: &str = "targetlease-installation";

/// Whether this installation acts in a namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Standing {
    /// It does: the marker names it (or it just created the marker).
    Ours,
    /// Another installation does: the id the marker names.
    Theirs(String),
}

/// The namespaces this installation acts in, as far as it has asked.
pub(crate) struct Installations {
    client: Client,
    /// This installation's id.
    id: String,
    /// What each namespace's marker said (a marker is never renewed or moved by a controller,
    /// so an answer holds for the life of this process).
    known: Mutex<HashMap<String, Standing>>,
    /// The namespaces whose conflict this process has logged.
    warned: Mutex<HashSet<String>>,
}

impl Installations {
    /// The installation `id`, asking through `client`.
    pub(crate) fn new(client: Client, id: String) -> Self {
        Self {
            client,
            id,
            known: Mutex::default(),
            warned: Mutex::default(),
        }
    }

    /// An installation that acts in `namespaces` without asking (the reconcile tests' mocked
    /// API server serves no Leases).
    #[cfg(test)]
    pub(crate) fn acting_in(client: Client, id: &str, namespaces: &[&str]) -> Self {
        let this = Self::new(client, id.to_owned());
        this.lock_known().extend(
            namespaces
                .iter()
                .map(|ns| ((*ns).to_owned(), Standing::Ours)),
        );
        this
    }

    /// This installation's id.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// Whether this installation acts in `namespace`: reads the namespace's marker, creating it
    /// when there is none. Fails (and so acts nowhere) when the marker can be neither read nor
    /// created: acting without it could put two installations on one target.
    pub(crate) async fn standing(&self, namespace: &str) -> Result<Standing, Error> {
        if let Some(known) = self.lock_known().get(namespace) {
            return Ok(known.clone());
        }
        let api: Api<Lease> = Api::namespaced(self.client.clone(), namespace);
        let named = match api.get_opt(MARKER).await? {
            Some(marker) => holder_of(&marker),
            None => match api.create(&PostParams::default(), &self.marker()).await {
                Ok(_) => {
                    info!(%namespace, installation = %self.id, "this installation acts on the TargetLeases of this namespace from now on (Lease {MARKER})");
                    self.id.clone()
                }
                // Another installation created it in between: read whose it is.
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    holder_of(&api.get(MARKER).await?)
                }
                Err(e) => return Err(e.into()),
            },
        };
        let standing = if named == self.id {
            Standing::Ours
        } else {
            Standing::Theirs(named)
        };
        self.lock_known()
            .insert(namespace.to_owned(), standing.clone());
        Ok(standing)
    }

    /// Logs, once per namespace, that another installation acts in `namespace`.
    pub(crate) fn warn_once(&self, namespace: &str, owner: &str) {
        let first = self
            .warned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(namespace.to_owned());
        if first {
            warn!(%namespace, installation = %self.id, other = %owner, "another installation acts on the TargetLeases of this namespace: this one leaves them alone; give the two installations scopes that do not overlap (--watch-namespace)");
        }
    }

    fn lock_known(&self) -> std::sync::MutexGuard<'_, HashMap<String, Standing>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn marker(&self) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(MARKER.to_owned()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_owned(),
                        "targetlease".to_owned(),
                    )]
                    .into(),
                ),
                annotations: Some(
                    [(
                        "targetlease.dev/description".to_owned(),
                        "The targetlease installation named in holderIdentity acts on the \
                         TargetLeases of this namespace; any other leaves them alone. Delete \
                         this Lease only to hand the namespace to another installation, with \
                         this one's controller stopped."
                            .to_owned(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.id.clone()),
                ..LeaseSpec::default()
            }),
        }
    }
}

/// The installation a marker names; a marker without one names nobody, which is not this
/// installation either (it fails closed).
fn holder_of(marker: &Lease) -> String {
    marker
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default()
}

/// The installation id of a controller started without `--installation-id`: its store, as far
/// as the command line names it. The chart always sets one (`<namespace>/<release>`).
pub(crate) fn default_id(store: &str) -> String {
    format!("unnamed ({store})")
}
