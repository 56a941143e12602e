//! `--backend` and the flags of each backend: how a subcommand opens the lease store. Flatten
//! [`StoreArgs`] into a command; the controller opens it lazily (it starts, not ready, while the
//! store is down), a one-shot command connects and checks first.

use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::etcd_args::EtcdArgs;
use super::valkey_args::ValkeyArgs;
use crate::store::etcd::EtcdStore;
use crate::store::memory::MemoryStore;
use crate::store::valkey::ValkeyStore;
use crate::store::{LeaseStore, StoreError};

/// Which lease store to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Valkey (or Redis), shared by every replica.
    Valkey,
    /// etcd 3.5 or later (its gRPC API): exclusion that survives the loss of a member, at the
    /// cost of a consensus round per call.
    Etcd,
    /// In this process only: for a single replica without Valkey (leases do not survive a
    /// restart of the controller).
    Memory,
}

/// The backend and how to reach it.
#[derive(Debug, Args)]
pub struct StoreArgs {
    /// Lease store backend.
    #[arg(
        long,
        value_enum,
        default_value = "valkey",
        env = "TARGETLEASE_BACKEND"
    )]
    pub backend: Backend,
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

impl StoreArgs {
    /// The store, without a call to it yet. `installation` claims the key prefix (Valkey's or
    /// etcd's) for this installation.
    pub fn open_lazy(
        &self,
        installation: Option<String>,
    ) -> Result<Arc<dyn LeaseStore>, StoreError> {
        match self.backend {
            Backend::Memory => Ok(Arc::new(MemoryStore::new())),
            Backend::Valkey => {
                let mut config = self.valkey.config()?;
                config.installation = installation;
                config.validate()?;
                Ok(Arc::new(ValkeyStore::new_lazy(config)?))
            }
            Backend::Etcd => {
                let mut config = self.etcd.config()?;
                config.installation = installation;
                Ok(Arc::new(EtcdStore::new(config)?))
            }
        }
    }

    /// The store, connected and checked: for a command that makes one call and exits. The
    /// in-memory store is refused: it would forget the call when the command exits.
    pub async fn open(&self) -> Result<Arc<dyn LeaseStore>, StoreError> {
        match self.backend {
            Backend::Memory => Err(StoreError::InvalidConfig(
                "--backend memory keeps leases inside one controller process: a command \
                 cannot reach them; use --backend valkey or etcd"
                    .into(),
            )),
            Backend::Valkey => self.valkey.open().await,
            Backend::Etcd => {
                let store = EtcdStore::new(self.etcd.config()?)?;
                store.health().await?;
                Ok(Arc::new(store))
            }
        }
    }

    /// A name for the store an installation uses when it has no id of its own.
    pub fn describe(&self) -> String {
        match self.backend {
            Backend::Memory => "memory".into(),
            Backend::Valkey => format!("Valkey key prefix {}", self.valkey.valkey_key_prefix),
            Backend::Etcd => format!("etcd key prefix {}", self.etcd.etcd_key_prefix),
        }
    }

    /// The deadline of one store call, where there is one.
    pub fn call_timeout(&self) -> Option<Duration> {
        match self.backend {
            Backend::Memory => None,
            Backend::Valkey => Some(self.valkey.valkey_timeout.0),
            Backend::Etcd => Some(self.etcd.etcd_timeout.0),
        }
    }
}
