//! targetlease: exclusive, fenced leases on named targets, kept in Valkey and driven through
//! the Kubernetes API.

pub mod api;
pub mod build_info;
pub mod cli;
pub mod controller;
pub(crate) mod election;
pub mod redact;
pub mod store;
pub mod telemetry;
pub(crate) mod time;
