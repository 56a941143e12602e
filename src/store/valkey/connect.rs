//! Making one connection from a [`ValkeyConfig`]: URL, credentials, TLS (rustls), server name,
//! single server, cluster, or the primary that Sentinel names (see [`super::sentinel`]). Nothing of redis-rs leaves the backend: callers see
//! [`crate::store::LeaseStore`] and [`StoreError`].

use std::net::SocketAddr;
use std::sync::Once;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::io::AsyncDNSResolver;
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, Cmd, ConnectionInfo, IntoConnectionInfo,
    Pipeline, RedisFuture, RedisResult, TlsCertificates, TlsMode, Value,
};
use tracing::warn;

use super::classify::classify;
use super::config::{Durability, Endpoints, TlsConfig, TlsMaterial, ValkeyConfig};
use super::info;
use crate::redact::{Secret, SecretUrl};
use crate::store::StoreError;
use crate::time::millis;

/// One multiplexed connection: to a single server, or a cluster client that routes by key
/// (following MOVED/ASK and refreshing its slot map itself).
#[derive(Clone)]
pub(super) enum Conn {
    /// A single server.
    Single(MultiplexedConnection),
    /// A Valkey Cluster.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Makes connections. Secrets and certificates are read at every connect.
pub(super) struct Connector {
    config: ValkeyConfig,
    tls: Option<TlsConfig>,
    endpoint: String,
    /// Replicas in sync a Sentinel-named primary must have: the durability's on the connections
    /// of durable acquires, none on the others (a renewal needs no replica).
    replicas_needed: u32,
}

impl Connector {
    /// Prepares a connector; warns once when certificate checks are off.
    pub(super) fn new(config: ValkeyConfig, durable_acquires: bool) -> Self {
        let tls = config.effective_tls();
        let endpoint = config.endpoints.describe();
        // The warnings once per store, not once per pool.
        if let Endpoints::Sentinel(sentinels) = &config.endpoints
            && !durable_acquires
            && sentinels.addrs.len() < 3
        {
            warn!(
                endpoint = %endpoint,
                sentinels = sentinels.addrs.len(),
                "fewer than three sentinel addresses: a majority of them cannot outvote a \
                 sentinel that has not heard of a failover (one address follows whatever it \
                 says; two need both); list every sentinel's own address, not a Service in \
                 front of them"
            );
        }
        if !durable_acquires && tls.as_ref().is_some_and(|t| t.insecure) {
            warn!(
                endpoint = %endpoint,
                "TLS certificate verification is DISABLED (insecure): anyone on the network path \
                 can impersonate the server and read the lease traffic; use a CA bundle instead"
            );
        }
        Self {
            replicas_needed: if durable_acquires {
                config.durability.replicas
            } else {
                0
            },
            config,
            tls,
            endpoint,
        }
    }

    /// The data ACL user.
    pub(super) fn username(&self) -> Option<&str> {
        self.config.username.as_deref()
    }

    /// The configured endpoint(s), for messages.
    pub(super) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The TLS material and the data password, read now (secrets and certificates are read at
    /// every connect, so a rotated one is used from the next connection on).
    pub(super) fn credentials(&self) -> Result<(Option<TlsMaterial>, Option<Secret>), StoreError> {
        install_crypto_provider();
        let material = self.tls.as_ref().map(TlsConfig::load).transpose()?;
        let password = self
            .config
            .password
            .as_ref()
            .map(|p| p.load())
            .transpose()?;
        Ok((material, password))
    }

    /// A connection to the one server of a URL.
    pub(super) async fn open_url(
        &self,
        url: &SecretUrl,
        password: Option<&Secret>,
        material: Option<&TlsMaterial>,
        limit: Duration,
    ) -> Result<Conn, StoreError> {
        let info = self.connection_info(
            url.expose(),
            url.endpoint(),
            self.config.username.as_deref(),
            password,
        )?;
        let conn = self
            .open_single(info, &url_host(url), material)
            .await
            .map_err(|e| classify(&self.endpoint, &e, limit, true))?;
        Ok(Conn::Single(conn))
    }

    /// A connection to a cluster, from its seeds.
    pub(super) async fn open_cluster(
        &self,
        seeds: &[SecretUrl],
        password: Option<&Secret>,
        material: Option<&TlsMaterial>,
        limit: Duration,
    ) -> Result<Conn, StoreError> {
        let fail = |e: redis::RedisError| classify(&self.endpoint, &e, limit, true);
        let infos = seeds
            .iter()
            .map(|seed| {
                self.connection_info(
                    seed.expose(),
                    seed.endpoint(),
                    self.config.username.as_deref(),
                    password,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut builder = ClusterClientBuilder::new(infos)
            .connection_timeout(limit)
            .response_timeout(self.config.call_timeout)
            .retries(3)
            .min_retry_wait(millis(self.config.reconnect_min_delay))
            .max_retry_wait(millis(self.config.reconnect_max_delay));
        if let Some(user) = &self.config.username {
            builder = builder.username(user);
        }
        if let Some(password) = password {
            builder = builder.password(password.expose());
        }
        if let Some(tls) = &self.tls {
            builder = builder.tls(if tls.insecure {
                TlsMode::Insecure
            } else {
                TlsMode::Secure
            });
            if let Some(certs) = material.and_then(certificates) {
                builder = builder.certs(certs);
            }
        }
        let client = builder.build().map_err(fail)?;
        let conn = client.get_async_connection().await.map_err(fail)?;
        Ok(Conn::Cluster(conn))
    }

    /// The checks every new connection passes before it carries a call: the durability the
    /// server can give, no eviction, and the installation's claim on its key prefix.
    pub(super) async fn check(&self, conn: &mut Conn, limit: Duration) -> Result<(), StoreError> {
        self.check_durability(conn, limit).await?;
        self.check_eviction(conn, limit).await?;
        if let Some(id) = &self.config.installation {
            self.claim_installation(conn, id, limit).await?;
        }
        Ok(())
    }

    /// The configured endpoints.
    pub(super) fn endpoints(&self) -> &Endpoints {
        &self.config.endpoints
    }

    /// A connect through Sentinel that took too long, said with what it waited for.
    pub(super) fn timed_out(&self, limit: Duration) -> StoreError {
        StoreError::Unavailable {
            endpoint: self.endpoint.clone(),
            cause: self.connect_timed_out(limit),
        }
    }

    /// One multiplexed connection to one server, TLS as configured; the certificate is checked
    /// against the TLS server name when one is set (the connection still goes to `host`).
    pub(super) async fn open_single(
        &self,
        info: ConnectionInfo,
        host: &str,
        material: Option<&TlsMaterial>,
    ) -> redis::RedisResult<MultiplexedConnection> {
        let client = match material.and_then(certificates) {
            Some(certs) => Client::build_with_tls(info, certs),
            None => Client::open(info),
        }?;
        // Deadlines are the store's: connecting and every call are wrapped in their own, which
        // name what ran out.
        let mut options = AsyncConnectionConfig::new()
            .set_connection_timeout(None)
            .set_response_timeout(None);
        if let Some(name) = self.tls.as_ref().and_then(|t| t.server_name.clone()) {
            options = options.set_dns_resolver(ServerNameResolver {
                name,
                host: host.to_owned(),
            });
        }
        client
            .get_multiplexed_async_connection_with_config(&options)
            .await
    }

    /// The configured durability, for messages.
    pub(super) fn durability(&self) -> Durability {
        self.config.durability
    }

    /// Replicas in sync a Sentinel-named primary must have for this connector's connections.
    pub(super) fn replicas_needed(&self) -> u32 {
        self.replicas_needed
    }

    /// Refuses a connection to a server that cannot provide the configured durability: WAITAOF
    /// missing (Redis before 7.2, Valkey before 8.0) or `local` without `appendonly yes`.
    /// Checked on every new connection, so a store notices at start-up (or at its first
    /// connection, for a lazy one) and again after a failover to a differently configured
    /// server, never by running an acquire it cannot make durable.
    async fn check_durability(&self, conn: &mut Conn, limit: Duration) -> Result<(), StoreError> {
        let durability = self.config.durability;
        if durability.is_none() {
            return Ok(());
        }
        // Nothing written on this connection yet: the probe returns at once when it can.
        let mut probe = redis::cmd("WAITAOF");
        probe.arg(i64::from(durability.local)).arg(0).arg(1);
        let Err(e) = probe.query_async::<Value>(conn).await else {
            return Ok(());
        };
        let text = e.to_string();
        if text.to_ascii_lowercase().contains("unknown command") {
            Err(StoreError::InvalidConfig(format!(
                "durability {durability} needs WAITAOF (Valkey 8.0+ or Redis 7.2+), which the \
                 server at {} does not have ({text})",
                self.endpoint
            )))
        } else if text.contains("appendonly") {
            Err(StoreError::InvalidConfig(format!(
                "durability {durability} needs `appendonly yes` on the server at {} ({text})",
                self.endpoint
            )))
        } else {
            Err(classify(&self.endpoint, &e, limit, true))
        }
    }

    /// Refuses a server that may evict keys: under any `maxmemory-policy` but `noeviction`
    /// (`volatile-lru` and `allkeys-lru` are the defaults of several hosted offerings) Valkey
    /// silently drops live leases and fences when memory runs short. With
    /// [`ValkeyConfig::allow_eviction`] the connection is accepted with a warning. Read from
    /// `INFO memory` (on a cluster: every node that answers), which an ACL user may run where
    /// `CONFIG GET` is often withheld.
    async fn check_eviction(&self, conn: &mut Conn, limit: Duration) -> Result<(), StoreError> {
        let info = redis::cmd("INFO")
            .arg("memory")
            .query_async::<Value>(conn)
            .await
            .map_err(|e| classify(&self.endpoint, &e, limit, true))?;
        let texts = info::texts(&info);
        let policies = info::fields(&texts, "maxmemory_policy");
        if policies.is_empty() {
            return Err(StoreError::InvalidConfig(format!(
                "the server at {} did not report its maxmemory-policy in INFO memory; \
                 targetlease needs to know that leases are never evicted",
                self.endpoint
            )));
        }
        let Some(policy) = policies.into_iter().find(|p| *p != "noeviction") else {
            return Ok(());
        };
        if self.config.allow_eviction {
            warn!(
                endpoint = %self.endpoint,
                policy,
                "the server may EVICT keys (maxmemory-policy is not noeviction): a lease or a \
                 fence dropped under memory pressure is a lost lease or a token that goes back; \
                 accepted because eviction is explicitly allowed"
            );
            return Ok(());
        }
        Err(StoreError::InvalidConfig(format!(
            "the server at {} runs with maxmemory-policy {policy}, which may evict live leases \
             and fences under memory pressure (a lost lease, a token that goes back); set \
             maxmemory-policy noeviction, or accept the risk with --valkey-allow-eviction",
            self.endpoint
        )))
    }

    /// Claims the key prefix for this installation (`SET <prefix>:installation <id> NX GET`,
    /// one atomic command) and refuses a prefix that another installation holds.
    async fn claim_installation(
        &self,
        conn: &mut Conn,
        id: &str,
        limit: Duration,
    ) -> Result<(), StoreError> {
        let key = format!("{}:installation", self.config.key_prefix);
        let previous: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(id)
            .arg("NX")
            .arg("GET")
            .query_async(conn)
            .await
            .map_err(|e| classify(&self.endpoint, &e, limit, true))?;
        match previous {
            Some(other) if other != id => Err(StoreError::InvalidConfig(format!(
                "the key prefix {:?} on {} belongs to another installation ({other}); two \
                 installations on one prefix would share leases without a shared leader: give \
                 this one its own --valkey-key-prefix (or delete {key} if that installation is \
                 gone)",
                self.config.key_prefix, self.endpoint
            ))),
            _ => Ok(()),
        }
    }

    /// Why a connect attempt that ran out of time failed.
    fn connect_timed_out(&self, limit: Duration) -> String {
        let configured = self.config.connect_timeout;
        // The pool shortens the last attempt of a call to what is left of the call deadline;
        // a few ms less is still the connect timeout at work.
        let what = if limit + Duration::from_millis(20) < configured {
            format!(
                "the call deadline ({} ms) ran out while connecting",
                millis(self.config.call_timeout)
            )
        } else {
            format!("connect timed out after {} ms", millis(configured))
        };
        // A plaintext server never answers a TLS handshake: it waits for the end of a command
        // line that does not come.
        if self.tls.is_some() {
            format!(
                "{what} (if the TCP connection opened, the TLS handshake got no answer: does the \
                 server speak TLS on this port?)"
            )
        } else {
            what
        }
    }

    /// The client library's view of one URL (`endpoint` is its `host:port`, for messages), with
    /// TLS and the given credentials applied.
    pub(super) fn connection_info(
        &self,
        url: &str,
        endpoint: &str,
        username: Option<&str>,
        password: Option<&crate::redact::Secret>,
    ) -> Result<ConnectionInfo, StoreError> {
        let invalid =
            |what: &str| StoreError::InvalidConfig(format!("Valkey URL for {endpoint}: {what}"));
        let mut parsed = url::Url::parse(url).map_err(|_| invalid("not a URL"))?;
        if let Some(tls) = &self.tls {
            let scheme = match parsed.scheme() {
                "redis" | "rediss" => "rediss",
                "valkey" | "valkeys" => "valkeys",
                _ => return Err(invalid("scheme must be redis, rediss, valkey or valkeys")),
            };
            parsed
                .set_scheme(scheme)
                .map_err(|()| invalid("cannot switch the URL to TLS"))?;
            if let Some(name) = &tls.server_name {
                // redis-rs verifies the certificate against the URL's host; the resolver below
                // still connects to the configured address.
                parsed
                    .set_host(Some(name))
                    .map_err(|_| invalid("the TLS server name is not a valid host name"))?;
            }
            parsed.set_fragment(tls.insecure.then_some("insecure"));
        }
        let info = parsed
            .as_str()
            .into_connection_info()
            .map_err(|e| invalid(&e.to_string()))?;
        let mut redis = info
            .redis_settings()
            .clone()
            .set_lib_name("targetlease", env!("CARGO_PKG_VERSION"));
        if let Some(user) = username {
            redis = redis.set_username(user);
        }
        if let Some(password) = password {
            redis = redis.set_password(password.expose());
        }
        Ok(info.set_redis_settings(redis))
    }
}

fn url_host(url: &SecretUrl) -> String {
    url::Url::parse(url.expose())
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_default()
}

/// redis-rs' form of the PEM material; `None` when only the system roots are needed.
fn certificates(material: &TlsMaterial) -> Option<TlsCertificates> {
    if material.ca.is_none() && material.client.is_none() {
        return None;
    }
    Some(TlsCertificates {
        client_tls: material.client.as_ref().map(|(cert, key)| ClientTlsConfig {
            client_cert: cert.clone(),
            client_key: key.clone(),
        }),
        root_cert: material.ca.clone(),
    })
}

/// Resolves the TLS server name to the configured host, so the certificate is checked against
/// the server name while the connection goes to the configured address.
struct ServerNameResolver {
    name: String,
    host: String,
}

impl AsyncDNSResolver for ServerNameResolver {
    fn resolve<'a, 'b: 'a>(
        &'a self,
        host: &'b str,
        port: u16,
    ) -> RedisFuture<'a, Box<dyn Iterator<Item = SocketAddr> + Send + 'a>> {
        let target = if host == self.name {
            self.host.clone()
        } else {
            host.to_owned()
        };
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((target.as_str(), port)).await?;
            let addrs: Box<dyn Iterator<Item = SocketAddr> + Send + 'a> =
                Box::new(addrs.collect::<Vec<_>>().into_iter());
            RedisResult::Ok(addrs)
        })
    }
}

/// redis-rs uses rustls without choosing a crypto provider; choose ring once per process. If
/// another part of the process installed one first, that one is used.
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
