//! The Kubernetes client of the subcommands, the check that the API server serves the
//! TargetLease version this binary speaks, and how its refusals are logged.

use std::time::Duration;

/// A Kubernetes client and the namespace to use: `namespace`, else the kubeconfig's (or the
/// pod's) default.
pub(crate) async fn kube_client(
    namespace: Option<String>,
) -> Result<(kube::Client, String), String> {
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("cannot configure the Kubernetes client: {e}"))?;
    let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_owned());
    Ok((client, namespace))
}

/// [`kube_client`] for `run` and `wait`, after [`ensure_served`]: without it every call would
/// fail with a bare 404, and a workload image newer than the installed chart is the likely
/// cause.
pub(crate) async fn lease_client(
    namespace: Option<String>,
) -> Result<(kube::Client, String), String> {
    let (client, namespace) = kube_client(namespace).await?;
    ensure_served(&client).await?;
    Ok((client, namespace))
}

/// Checks that the API server serves the TargetLease version this binary speaks; the error says
/// to upgrade the chart (or the CRD) first.
pub(crate) async fn ensure_served(client: &kube::Client) -> Result<(), String> {
    use kube::Resource as _;
    let group_version = format!("{}/{}", crate::api::GROUP, crate::api::VERSION);
    let plural = crate::api::TargetLease::plural(&());
    // A CRD that was just updated is served a moment later: asked again for a few seconds.
    let deadline = tokio::time::Instant::now() + ENSURE_SERVED_PATIENCE;
    loop {
        let served = match client.list_api_group_resources(&group_version).await {
            Ok(list) => list.resources.iter().any(|r| r.name == plural),
            Err(kube::Error::Api(status)) if status.code == 404 => false,
            // Anything else (unreachable, forbidden) surfaces at the first real call.
            Err(_) => true,
        };
        if served {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!(
        "the API server does not serve {group_version} TargetLeases: install or upgrade the \
             targetlease chart (it serves {group_version} from 0.2.0 on; with crds.enabled=false, \
             apply this release's crds/ file) before this targetlease runs; see \
             docs/install.md, \"Upgrading\""
    ))
}

/// How long [`ensure_served`] waits for the API version to be served.
const ENSURE_SERVED_PATIENCE: Duration = Duration::from_secs(5);

/// An error of a request that names the TargetLease's uid, for the log: the API server's own
/// message may quote the uid (the lease id), so a refusal is given by its code and reason only.
pub(crate) fn refusal(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => format!("{} {}", status.code, status.reason),
        other => other.to_string(),
    }
}

/// The HTTP status of an API server refusal.
pub(crate) fn api_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}
