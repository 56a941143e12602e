//! Opening a connection, the one way every pool does it: to the URL's server, to a cluster from
//! its seeds, or through Sentinel to the primary a majority of the sentinels name; then the
//! checks every new connection passes ([`Connector::check`]). The sentinels are asked in the
//! order the store's pools share ([`sentinel::Order`]).

use std::sync::Arc;
use std::time::Duration;

use super::config::{Endpoints, HostPort};
use super::connect::{Conn, Connector};
use super::sentinel;
use crate::store::StoreError;

/// A new connection and, through Sentinel, the primary it reaches.
pub(super) struct Connected {
    /// The connection.
    pub(super) conn: Conn,
    /// The primary as the sentinels named it (and its role confirmed on `conn`); `None` for a
    /// URL or a cluster.
    pub(super) primary: Option<HostPort>,
}

/// Opens connections for one pool.
pub(super) struct Opener {
    connector: Connector,
    /// Which sentinel to ask first, shared by the store's pools.
    order: Arc<sentinel::Order>,
}

impl Opener {
    /// An opener of `connector`'s connections, asking sentinels in `order`.
    pub(super) fn new(connector: Connector, order: Arc<sentinel::Order>) -> Self {
        Self { connector, order }
    }

    /// The configured endpoint(s), for messages.
    pub(super) fn endpoint(&self) -> &str {
        self.connector.endpoint()
    }

    /// Opens one connection, bounded by the connect timeout (through Sentinel: finding and
    /// reaching the primary by it, the checks on the new connection by it again, and the whole
    /// by the caller's deadline).
    pub(super) async fn connect(&self, limit: Duration) -> Result<Connected, StoreError> {
        let connector = &self.connector;
        let (material, password) = connector.credentials()?;
        let (material, password) = (material.as_ref(), password.as_ref());
        let opened = async {
            let mut connected = match connector.endpoints() {
                Endpoints::Single(url) => Connected {
                    conn: connector.open_url(url, password, material, limit).await?,
                    primary: None,
                },
                Endpoints::Cluster(seeds) => Connected {
                    conn: connector
                        .open_cluster(seeds, password, material, limit)
                        .await?,
                    primary: None,
                },
                Endpoints::Sentinel(sentinels) => {
                    let (conn, primary) = sentinel::connect(
                        connector,
                        &self.order,
                        sentinels,
                        limit,
                        password,
                        material,
                    )
                    .await?;
                    Connected {
                        conn: Conn::Single(conn),
                        primary: Some(primary),
                    }
                }
            };
            connector.check(&mut connected.conn, limit).await?;
            Ok(connected)
        };
        let overall = match connector.endpoints() {
            // Finding the primary has the connect timeout; the checks on its connection the same
            // again.
            Endpoints::Sentinel(_) => limit.saturating_mul(2),
            _ => limit,
        };
        match tokio::time::timeout(overall, opened).await {
            Ok(result) => result,
            Err(_) => Err(connector.timed_out(limit)),
        }
    }

    /// Through Sentinel: the primary a majority of the sentinels name now (see
    /// [`sentinel::named_primary`]); `Ok(None)` for a URL or a cluster.
    pub(super) async fn named_primary(
        &self,
        limit: Duration,
    ) -> Result<Option<HostPort>, StoreError> {
        let Endpoints::Sentinel(sentinels) = self.connector.endpoints() else {
            return Ok(None);
        };
        let (material, _) = self.connector.credentials()?;
        sentinel::named_primary(
            &self.connector,
            &self.order,
            sentinels,
            limit,
            material.as_ref(),
        )
        .await
    }
}
