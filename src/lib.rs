//! targetlease: exclusive, fenced leases on named targets, kept in Valkey and driven through
//! the Kubernetes API.

pub mod cli;
pub mod redact;
pub mod store;
pub mod telemetry;
