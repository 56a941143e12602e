//! `targetlease lease ...`: one store call per invocation, one JSON object on stdout.
//!
//! Exit status: 0 when the call did what was asked, 3 when it was refused (held by someone
//! else, a permits conflict, lost, not the holder, stale token) or `read` found no record
//! (`absent`), 4 when an
//! acquire retried with its request id finds its grant ended (`expired`), 1 on a failure (see
//! [`super::exit`]; 2 is clap's usage error).

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};
use serde::Serialize;
use serde_json::{Value, json};

use super::exit;
use super::flags::Span;
use super::store_args::StoreArgs;
use crate::store::{
    AcquireOutcome, AcquireRequest, CheckOutcome, CommitOutcome, CommitRequest, GuardedKey,
    LeaseHandle, LeaseId, LeaseStore, Owner, Permits, ReleaseOutcome, ReleaseRequest, RenewOutcome,
    RenewRequest, RequestId, Slot, StoreError, TargetRef, Token, Ttl,
};

#[derive(Debug, Subcommand)]
pub enum LeaseCommand {
    /// Claim a target.
    Acquire {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        claim: ClaimArgs,
        /// How many holders the target admits, each in its own slot (1 to 100). Every claim
        /// on a target must ask the same value while any permit is held.
        #[arg(long, default_value_t = 1)]
        permits: u32,
        /// Lease time-to-live (30, 30s, 500ms, 2m).
        #[arg(long, default_value_t = Span(crate::api::DEFAULT_TTL))]
        ttl: Span,
        /// The new token will be larger than this. Refused when more than two hours ahead of
        /// the server clock (no store issues a token that far ahead).
        #[arg(long, default_value_t = 0)]
        min_token: u64,
        #[command(flatten)]
        request: RequestArgs,
    },
    /// Extend a lease you hold.
    Renew {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        claim: ClaimArgs,
        #[command(flatten)]
        permit: PermitArgs,
        /// The fencing token the lease was granted with.
        #[arg(long)]
        token: u64,
        /// New time-to-live from now.
        #[arg(long, default_value_t = Span(crate::api::DEFAULT_TTL))]
        ttl: Span,
        #[command(flatten)]
        request: RequestArgs,
    },
    /// Give up a lease you hold.
    Release {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        claim: ClaimArgs,
        #[command(flatten)]
        permit: PermitArgs,
        /// The fencing token the lease was granted with.
        #[arg(long)]
        token: u64,
        #[command(flatten)]
        request: RequestArgs,
    },
    /// Fencing check: is this token still the newest grant of its slot?
    Check {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        slot: SlotArgs,
        /// The token to check.
        #[arg(long)]
        token: u64,
    },
    /// Fenced write of a value to a guarded record of the target's slot.
    Commit {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        slot: SlotArgs,
        /// The writer's fencing token.
        #[arg(long)]
        token: u64,
        /// Name of the guarded record.
        #[arg(long)]
        key: String,
        /// Value to write.
        #[arg(long)]
        value: String,
        /// This write's number within the tenure: (token, sequence) must grow from write to
        /// write, so a late replay of an earlier write is refused as stale. Default: the time
        /// of the call in microseconds, which grows from one call to the next.
        #[arg(long)]
        sequence: Option<u64>,
        #[command(flatten)]
        request: RequestArgs,
    },
    /// Read a guarded record written by `commit`.
    Read {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        slot: SlotArgs,
        /// Name of the guarded record.
        #[arg(long)]
        key: String,
    },
    /// Show the target's leases (every held slot, with the permits each was granted under) and
    /// the fence.
    Inspect {
        #[command(flatten)]
        target: TargetArgs,
    },
    /// Replace the target's records that fail closed, in every slot: an unreadable lease or
    /// grant record is deleted, an unreadable fence (not a number, above 2^53-1) is set to the
    /// largest of --floor, the leases' tokens and the server clock in microseconds plus one
    /// hour, an unreadable permits record is rewritten from the held permits (deleted when
    /// none is held). Readable records are left alone.
    Repair {
        #[command(flatten)]
        target: TargetArgs,
        /// The highest token you know was issued for the target (from your own records).
        #[arg(long, default_value_t = 0)]
        floor: u64,
    },
}

/// Where the store is and which target to talk about.
#[derive(Debug, Args)]
pub struct TargetArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Namespace of the target.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// The target.
    #[arg(long)]
    target: String,
}

/// Who claims.
#[derive(Debug, Args)]
pub struct ClaimArgs {
    /// The claim's identity (a TargetLease's metadata.uid).
    #[arg(long)]
    lease_id: String,
    /// Who the lease is for.
    #[arg(long)]
    owner: String,
}

/// Which permit a lease is.
#[derive(Debug, Args)]
pub struct PermitArgs {
    /// The permits value the lease was granted under (1: the exclusive lease).
    #[arg(long, default_value_t = 1)]
    permits: u32,
    /// The slot the lease was granted (0 for the exclusive lease).
    #[arg(long, default_value_t = 0)]
    slot: u32,
}

/// Which slot's fence a token is checked against.
#[derive(Debug, Args)]
pub struct SlotArgs {
    /// The slot the token was granted (0 for the exclusive lease): each slot has its own
    /// fence and guarded records.
    #[arg(long, default_value_t = 0)]
    slot: u32,
}

/// Idempotency.
#[derive(Debug, Args)]
pub struct RequestArgs {
    /// Request id; reuse it to retry a call without acting twice (default: a new random one).
    #[arg(long)]
    request_id: Option<String>,
}

impl RequestArgs {
    fn resolve(&self) -> Result<RequestId, StoreError> {
        match &self.request_id {
            Some(id) => RequestId::new(id),
            None => Ok(RequestId::random()),
        }
    }
}

impl TargetArgs {
    async fn open(&self) -> Result<(Arc<dyn LeaseStore>, TargetRef), StoreError> {
        let target = TargetRef::new(&self.namespace, &self.target)?;
        Ok((self.store.open().await?, target))
    }
}

impl ClaimArgs {
    fn handle(
        &self,
        target: TargetRef,
        permit: &PermitArgs,
        token: u64,
    ) -> Result<LeaseHandle, StoreError> {
        let permits = Permits::new(permit.permits)?;
        let slot = Slot::new(permit.slot)?;
        permits.check_slot(slot)?;
        Ok(LeaseHandle {
            target,
            permits,
            slot,
            lease_id: LeaseId::new(self.lease_id.clone())?,
            owner: Owner::new(self.owner.clone())?,
            token: Token::new(token)?,
        })
    }
}

/// A printed result: the JSON object and whether the call did what was asked.
struct Printed {
    body: Value,
    /// The exit status: [`exit::OK`], [`exit::REFUSED`] or [`exit::GRANT_ENDED`].
    code: u8,
}

/// OK when the call did what was asked, REFUSED otherwise.
fn done_or_refused(done: bool) -> u8 {
    if done { exit::OK } else { exit::REFUSED }
}

fn printed(outcome: &impl Serialize, code: u8, request_id: Option<&RequestId>) -> Printed {
    let mut body = serde_json::to_value(outcome)
        .unwrap_or_else(|e| json!({"outcome": "error", "message": e.to_string()}));
    if let (Some(id), Value::Object(map)) = (request_id, &mut body) {
        map.insert("requestId".into(), Value::String(id.as_str().to_owned()));
    }
    Printed { body, code }
}

impl LeaseCommand {
    /// Runs the call and prints its outcome.
    pub async fn run(self) -> ExitCode {
        let result = self.call().await;
        let (body, code) = match result {
            Ok(Printed { body, code }) => (body, code),
            Err(e) => (
                json!({"outcome": "error", "kind": e.kind().as_str(), "message": e.to_string()}),
                exit::FAILURE,
            ),
        };
        println!("{body}");
        ExitCode::from(code)
    }

    async fn call(&self) -> Result<Printed, StoreError> {
        match self {
            LeaseCommand::Acquire {
                target,
                claim,
                permits,
                ttl,
                min_token,
                request,
            } => {
                let (store, target) = target.open().await?;
                let request_id = request.resolve()?;
                let outcome = store
                    .acquire(&AcquireRequest {
                        target,
                        lease_id: LeaseId::new(claim.lease_id.clone())?,
                        owner: Owner::new(claim.owner.clone())?,
                        permits: Permits::new(*permits)?,
                        ttl: Ttl::new(ttl.0)?,
                        min_token: *min_token,
                        request_id: request_id.clone(),
                    })
                    .await?;
                let code = match outcome {
                    AcquireOutcome::Acquired(_) => exit::OK,
                    AcquireOutcome::Held { .. } | AcquireOutcome::PermitsConflict { .. } => {
                        exit::REFUSED
                    }
                    AcquireOutcome::Expired { .. } => exit::GRANT_ENDED,
                };
                Ok(printed(&outcome, code, Some(&request_id)))
            }
            LeaseCommand::Renew {
                target,
                claim,
                permit,
                token,
                ttl,
                request,
            } => {
                let (store, target) = target.open().await?;
                let request_id = request.resolve()?;
                let outcome = store
                    .renew(&RenewRequest {
                        lease: claim.handle(target, permit, *token)?,
                        ttl: Ttl::new(ttl.0)?,
                        request_id: request_id.clone(),
                    })
                    .await?;
                let done = matches!(outcome, RenewOutcome::Renewed { .. });
                Ok(printed(&outcome, done_or_refused(done), Some(&request_id)))
            }
            LeaseCommand::Release {
                target,
                claim,
                permit,
                token,
                request,
            } => {
                let (store, target) = target.open().await?;
                let request_id = request.resolve()?;
                let outcome = store
                    .release(&ReleaseRequest {
                        lease: claim.handle(target, permit, *token)?,
                        request_id: request_id.clone(),
                    })
                    .await?;
                let done = outcome == ReleaseOutcome::Released;
                Ok(printed(&outcome, done_or_refused(done), Some(&request_id)))
            }
            LeaseCommand::Check {
                target,
                slot,
                token,
            } => {
                let (store, target) = target.open().await?;
                let outcome = store
                    .check(&target, Slot::new(slot.slot)?, Token::new(*token)?)
                    .await?;
                let done = matches!(outcome, CheckOutcome::Current { .. });
                Ok(printed(&outcome, done_or_refused(done), None))
            }
            LeaseCommand::Commit {
                target,
                slot,
                token,
                key,
                value,
                sequence,
                request,
            } => {
                let (store, target) = target.open().await?;
                let request_id = request.resolve()?;
                let outcome = store
                    .commit(&CommitRequest {
                        target,
                        slot: Slot::new(slot.slot)?,
                        token: Token::new(*token)?,
                        key: GuardedKey::new(key.clone())?,
                        value: value.clone(),
                        sequence: sequence.unwrap_or_else(now_micros),
                        request_id: request_id.clone(),
                    })
                    .await?;
                let done = matches!(outcome, CommitOutcome::Committed { .. });
                Ok(printed(&outcome, done_or_refused(done), Some(&request_id)))
            }
            LeaseCommand::Read { target, slot, key } => {
                let (store, target) = target.open().await?;
                let found = store
                    .read_guarded(
                        &target,
                        Slot::new(slot.slot)?,
                        &GuardedKey::new(key.clone())?,
                    )
                    .await?;
                let body = match &found {
                    Some(v) => json!({"outcome": "present", "token": v.token, "value": v.value}),
                    None => json!({"outcome": "absent"}),
                };
                Ok(Printed {
                    body,
                    code: done_or_refused(found.is_some()),
                })
            }
            LeaseCommand::Inspect { target } => {
                let (store, target) = target.open().await?;
                let inspection = store.inspect(&target).await?;
                Ok(printed(&inspection, exit::OK, None))
            }
            LeaseCommand::Repair { target, floor } => {
                let (store, target) = target.open().await?;
                let outcome = store.repair(&target, *floor).await?;
                Ok(printed(&outcome, exit::OK, None))
            }
        }
    }
}

/// The client's clock in microseconds since the Unix epoch: the default commit sequence.
fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
