//! Claiming the TargetLease: create it, or adopt the one an incarnation of this `run` left when
//! that incarnation is provably dead, or wait for one whose `run` cannot be judged until it is
//! gone or released for a stopped heartbeat, and replace it.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, ResourceExt};
use nix::sys::signal::Signal;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::{Instant, sleep};
use tracing::{info, warn};

use super::args::RunArgs;
use super::identity::{
    COMMAND_ANNOTATION, PROCESS_ANNOTATION, Predecessor, describe, kill_leftovers, predecessor,
};
use crate::api::heartbeat::Beat as HeartbeatValue;
use crate::api::heartbeat::HEARTBEAT_ANNOTATION;
use crate::api::heartbeat::released_for_gone_holder;
use crate::api::{HolderRef, MAX_TTL_SECONDS, TargetLease, TargetLeaseSpec};
use crate::cli::client::api_code;

/// How claiming the TargetLease ended.
pub(super) enum Claimed {
    /// It is ours: its uid, when the heartbeat the create or the adoption wrote was sent, and
    /// the TTL its spec gives the controller.
    Ours {
        uid: String,
        sent: Instant,
        ttl_seconds: u32,
    },
    TimedOut,
    Interrupted(Signal),
}

/// A TargetLease the API server answered as ours, its heartbeat sent at `sent`.
/// A heartbeat's value announcing `ttl_seconds` (see [`HeartbeatValue`]).
fn beat_value(ttl_seconds: u32) -> String {
    HeartbeatValue {
        wall_ms: crate::time::wall_ms(),
        ttl_seconds: Some(ttl_seconds.clamp(1, MAX_TTL_SECONDS)),
    }
    .value()
}

fn ours(lease: &TargetLease, sent: Instant) -> Result<Claimed, String> {
    let uid = lease
        .uid()
        .ok_or("the API server answered a TargetLease without a uid")?;
    Ok(Claimed::Ours {
        uid,
        sent,
        ttl_seconds: lease.spec.ttl_seconds.clamp(1, MAX_TTL_SECONDS),
    })
}

/// Deletes `existing` (only that object: its uid and resourceVersion as preconditions), for a
/// new TargetLease to take its name once it is gone.
async fn replace(api: &Api<TargetLease>, name: &str, existing: &TargetLease) -> Result<(), String> {
    let that = DeleteParams {
        preconditions: Some(Preconditions {
            uid: existing.uid(),
            resource_version: existing.resource_version(),
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &that).await {
        Ok(_) => Ok(()),
        // Changed or gone in between: the next look decides.
        Err(e) if matches!(api_code(&e), Some(404 | 409)) => Ok(()),
        Err(e) => Err(format!("cannot replace TargetLease {name}: {e}")),
    }
}

impl RunArgs {
    pub(super) fn new_lease(&self, name: &str, holder: &str) -> TargetLease {
        let pod = self.pod_name.as_ref();
        let owner_references = pod.zip(self.pod_uid.as_ref()).map(|(name, uid)| {
            vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: name.clone(),
                uid: uid.clone(),
                ..Default::default()
            }]
        });
        TargetLease {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                owner_references,
                annotations: Some(
                    [
                        (
                            HEARTBEAT_ANNOTATION.to_owned(),
                            beat_value(self.ttl_seconds()),
                        ),
                        (
                            PROCESS_ANNOTATION.to_owned(),
                            describe(std::process::id().cast_signed()),
                        ),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec: TargetLeaseSpec {
                target: self.target.clone(),
                holder: holder.to_owned(),
                holder_ref: pod.map(|name| HolderRef {
                    kind: "Pod".into(),
                    name: name.clone(),
                    uid: self.pod_uid.clone(),
                }),
                ttl_seconds: self.ttl_seconds(),
                permits: self.permits,
                max_hold_seconds: None,
                release: false,
                priority: None,
            },
            status: None,
        }
    }

    /// Creates the TargetLease, or adopts the one an incarnation of this `run` left when it can
    /// prove that incarnation dead; refuses when a live one in its own PID namespace holds it.
    /// One whose `run` cannot be judged (another PID namespace or boot: another container or
    /// machine under the same name) is waited for: until it is deleted, or the controller
    /// released it because its heartbeat stopped, and then replaced.
    pub(super) async fn claim(
        &self,
        api: &Api<TargetLease>,
        name: &str,
        holder: &str,
        signals: &watch::Receiver<Option<Signal>>,
    ) -> Result<Claimed, String> {
        let deadline = Instant::now() + self.wait_timeout;
        let mut told = false;
        loop {
            if let Some(signal) = *signals.borrow() {
                return Ok(Claimed::Interrupted(signal));
            }
            let existing = api
                .get_opt(name)
                .await
                .map_err(|e| format!("cannot read TargetLease {name}: {e}"))?;
            let Some(existing) = existing else {
                let sent = Instant::now();
                match api
                    .create(&PostParams::default(), &self.new_lease(name, holder))
                    .await
                {
                    Ok(made) => return ours(&made, sent),
                    // Created by someone else in between: look again.
                    Err(e) if api_code(&e) == Some(409) => continue,
                    Err(e) => return Err(format!("cannot create TargetLease {name}: {e}")),
                }
            };
            if existing.spec.target != self.target {
                return Err(format!(
                    "TargetLease {name} exists for target {}, not {}",
                    existing.spec.target, self.target
                ));
            }
            let annotations = existing.metadata.annotations.clone().unwrap_or_default();
            let process = annotations.get(PROCESS_ANNOTATION).map(String::as_str);
            let judged = predecessor(process);
            if existing.metadata.deletion_timestamp.is_some() {
                // Being released: wait for it to go.
            } else if judged == Predecessor::Alive {
                return Err(format!(
                    "another targetlease run ({}) holds TargetLease {name} for target {}",
                    process.unwrap_or_default(),
                    self.target
                ));
            } else if let Predecessor::Unknown(why) = judged {
                if released_for_gone_holder(&existing) {
                    // No heartbeat for the controller's whole silence bound: that `run` stopped
                    // its command long ago. Replace the object (a new uid), so that even if it
                    // comes back it cannot take this one for its own.
                    info!(%name, "replacing the TargetLease an earlier run left, released since");
                    replace(api, name, &existing).await?;
                } else if !told {
                    warn!(%name, "waiting: another targetlease run may hold this TargetLease and cannot be proven dead ({why}); it is taken over once it is deleted or the controller releases it for a stopped heartbeat");
                    told = true;
                }
            } else {
                info!(%name, "adopting the TargetLease left by an earlier run");
                if let Some(command) = annotations.get(COMMAND_ANNOTATION) {
                    kill_leftovers(command, name);
                }
                let adopt = json!({
                    "metadata": {
                        "resourceVersion": existing.resource_version(),
                        "annotations": {
                            HEARTBEAT_ANNOTATION: beat_value(existing.spec.ttl_seconds),
                            PROCESS_ANNOTATION: describe(std::process::id().cast_signed()),
                            COMMAND_ANNOTATION: null,
                        }
                    }
                });
                let sent = Instant::now();
                match api
                    .patch(name, &PatchParams::default(), &Patch::Merge(&adopt))
                    .await
                {
                    Ok(adopted) => return ours(&adopted, sent),
                    // Changed in between (the resourceVersion precondition): look again.
                    Err(e) if api_code(&e) == Some(409) => continue,
                    Err(e) => return Err(format!("cannot adopt TargetLease {name}: {e}")),
                }
            }
            if Instant::now() >= deadline {
                return Ok(Claimed::TimedOut);
            }
            sleep(Duration::from_millis(200)).await;
        }
    }
}
