//! Leader election on a coordination.k8s.io Lease, so several replicas can run and exactly one
//! reconciles. The new leader's first reconciles renew every held lease with the token recorded
//! in its status, so a rolling restart or a crash loses no lease as long as the new leader starts
//! within the leases' TTL.

use std::future::Future;
use std::pin::Pin;

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::{oneshot, watch};
use tracing::info;

/// Which Lease to compete for, and as whom.
#[derive(Clone, Debug)]
pub struct Election {
    /// Namespace of the coordination Lease (the controller's own namespace).
    pub namespace: String,
    /// Name of the coordination Lease.
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a leader's claim lasts without renewal, in seconds.
    pub duration_seconds: u64,
}

/// A future that completes when the work must stop.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send + Sync>>;

/// Resolves once `stop` turns true (or its sender is gone).
pub async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Runs `work` whenever this replica leads, until `stop` turns true. `work` gets a signal that
/// fires when leadership is lost or the process stops; it must wind down when it fires.
pub async fn lead<F, Fut>(
    client: Client,
    election: Election,
    stop: watch::Receiver<bool>,
    mut work: F,
) -> Result<(), LeaseManagerError>
where
    F: FnMut(StopSignal) -> Fut,
    Fut: Future<Output = ()>,
{
    let manager = LeaseManagerBuilder::new(client, &election.name)
        .with_namespace(&election.namespace)
        .with_identity(&election.identity)
        .with_duration(election.duration_seconds)
        .with_grace(2)
        .build()
        .await?;
    let (mut leading, task) = manager.watch().await;
    let mut stop_requested = stop.clone();
    loop {
        tokio::select! {
            _ = leading.wait_for(|l| *l) => {}
            _ = stop_requested.wait_for(|s| *s) => break,
        }
        info!(identity = %election.identity, lease = %election.name, "became leader");
        let (lost_tx, lost_rx) = oneshot::channel::<()>();
        let signal: StopSignal = {
            let stop = stop.clone();
            Box::pin(async move {
                tokio::select! {
                    _ = stopped(stop) => {}
                    _ = lost_rx => {}
                }
            })
        };
        let running = work(signal);
        tokio::pin!(running);
        let mut lost_tx = Some(lost_tx);
        loop {
            tokio::select! {
                _ = &mut running => break,
                changed = leading.changed() => {
                    let lost = changed.is_err() || !*leading.borrow();
                    if lost && let Some(tx) = lost_tx.take() {
                        info!(identity = %election.identity, "lost leadership; stopping");
                        let _ = tx.send(());
                    }
                }
            }
        }
        if *stop.borrow() {
            break;
        }
    }
    // Dropping the receiver makes the manager release the Lease: a successor takes over at once
    // instead of waiting for the claim to expire.
    drop(leading);
    let _ = task.await;
    Ok(())
}
