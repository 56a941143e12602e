//! Test support shared by the integration suites: real servers on loopback ports.
#![allow(dead_code)]

pub mod kube;
pub mod server;
