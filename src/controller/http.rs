//! `/healthz`, `/readyz` and `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use kube::Client;

use super::metrics::Metrics;
use crate::store::LeaseStore;

/// What the endpoints look at.
pub struct Probe {
    /// Kubernetes client, for the API server check.
    pub client: Client,
    /// The lease store, for its health check.
    pub store: Arc<dyn LeaseStore>,
    /// Metrics to render.
    pub metrics: Arc<Metrics>,
}

/// Serves the endpoints on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    probe: Arc<Probe>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(probe);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Ready when both the API server and the lease store answer within 2 s.
async fn readyz(State(probe): State<Arc<Probe>>) -> (StatusCode, String) {
    let limit = Duration::from_secs(2);
    let api = tokio::time::timeout(limit, probe.client.apiserver_version()).await;
    let api = match api {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("API server: {e}")),
        Err(_) => Err("API server: no answer within 2 s".to_owned()),
    };
    let store = probe.store.health().await.map_err(|e| e.to_string());
    match (api, store) {
        (Ok(()), Ok(())) => (StatusCode::OK, "ok".into()),
        (a, s) => {
            let problems: Vec<String> = [a.err(), s.err()].into_iter().flatten().collect();
            (StatusCode::SERVICE_UNAVAILABLE, problems.join("\n"))
        }
    }
}

async fn metrics(State(probe): State<Arc<Probe>>) -> String {
    probe.metrics.render()
}
