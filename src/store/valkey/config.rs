//! Connection settings of the Valkey backend: where Valkey is, who we are, how we talk TLS, how
//! long we wait, how we reconnect and how durable an acquire must be before it returns.
//!
//! Secrets are read when a connection is made, not when the settings are built: a Kubernetes
//! Secret mounted as a file is updated in place, so a rotated password or client certificate is
//! picked up by the next reconnect without a restart.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::redact::{Secret, SecretUrl};
use crate::store::{DEFAULT_REPLY_TTL, StoreError};

use super::keys::check_prefix;

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "tl";

/// Connections in the pool unless configured otherwise (`--valkey-pool-size`).
pub const DEFAULT_POOL_SIZE: usize = 4;

/// Deadline for making one connection unless configured otherwise.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Deadline of one call unless configured otherwise (`--valkey-timeout`, the chart's
/// `valkey.timeout`).
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// First delay between reconnect attempts unless configured otherwise.
pub const DEFAULT_RECONNECT_MIN_DELAY: Duration = Duration::from_millis(50);

/// Longest delay between reconnect attempts unless configured otherwise.
pub const DEFAULT_RECONNECT_MAX_DELAY: Duration = Duration::from_secs(2);

/// Where Valkey is.
#[derive(Clone, Debug)]
pub enum Endpoints {
    /// One server (or a primary behind a stable name), by URL.
    Single(SecretUrl),
    /// A Valkey Cluster, by seed nodes; the topology is discovered from them.
    Cluster(Vec<SecretUrl>),
    /// A primary with replicas watched by Sentinel: the primary is asked of the sentinels at
    /// every connect.
    Sentinel(Sentinels),
}

/// A primary reached through Sentinel, and how to talk to the sentinels.
#[derive(Clone, Debug)]
pub struct Sentinels {
    /// The sentinels, asked in turn (the one that answered last is asked first).
    pub addrs: Vec<HostPort>,
    /// The name of the monitored primary (`sentinel monitor <name> ...`): `mymaster` in the
    /// valkey-io chart, `myprimary` in Bitnami's.
    pub master: String,
    /// ACL user on the sentinels, when they require one (the data user is
    /// [`ValkeyConfig::username`]).
    pub username: Option<String>,
    /// Password on the sentinels; read at every connect like the data password.
    pub password: Option<PasswordSource>,
    /// How often a store in use asks the sentinels whether the primary changed (a demoted
    /// primary keeps accepting writes on open connections until the sentinels reconfigure it).
    pub poll_interval: Duration,
}

/// How often the sentinels are asked for the primary unless configured otherwise.
pub const DEFAULT_SENTINEL_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// The longest master name accepted.
const MAX_MASTER_NAME: usize = 128;

/// The most sentinels one store asks.
const MAX_SENTINELS: usize = 16;

impl Sentinels {
    fn validate(&self) -> Result<(), StoreError> {
        let invalid = |m: String| Err(StoreError::InvalidConfig(m));
        if self.addrs.is_empty() {
            return invalid("no sentinel address configured (--valkey-sentinels)".into());
        }
        if self.addrs.len() > MAX_SENTINELS {
            return invalid(format!(
                "{} sentinels configured; at most {MAX_SENTINELS} are asked",
                self.addrs.len()
            ));
        }
        if let Some(twice) = self
            .addrs
            .iter()
            .enumerate()
            .find_map(|(i, a)| self.addrs[..i].contains(a).then_some(a))
        {
            return invalid(format!("the sentinel {twice} is configured twice"));
        }
        let name_ok = !self.master.is_empty()
            && self.master.len() <= MAX_MASTER_NAME
            && self.master.bytes().all(|b| b.is_ascii_graphic());
        if !name_ok {
            return invalid(format!(
                "the sentinel master name must be 1 to {MAX_MASTER_NAME} printable characters \
                 without spaces (the name of `sentinel monitor <name>`), not {:?}",
                self.master
            ));
        }
        if self.username.as_deref().is_some_and(str::is_empty) {
            return invalid("the sentinel ACL user name is empty".into());
        }
        let poll = Duration::from_millis(100)..=Duration::from_secs(60);
        if !poll.contains(&self.poll_interval) {
            return invalid(format!(
                "the sentinel poll interval must be between 100 ms and 60 s, not {} ms",
                self.poll_interval.as_millis()
            ));
        }
        Ok(())
    }
}

/// A `host:port` address (`[v6]:port` for an IPv6 address).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPort {
    /// Host name or IP address, without brackets.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl HostPort {
    /// The address as a `redis://` URL (no credentials).
    pub(super) fn url(&self) -> String {
        format!("redis://{self}")
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl FromStr for HostPort {
    type Err = String;

    /// `host:port` or `[v6]:port`.
    fn from_str(text: &str) -> Result<Self, String> {
        let usage = || format!("{text:?}: expected HOST:PORT (or [IPv6]:PORT)");
        let (host, port) = text.trim().rsplit_once(':').ok_or_else(usage)?;
        let host = match host.strip_prefix('[') {
            Some(v6) => v6.strip_suffix(']').ok_or_else(usage)?,
            None if host.contains(':') => return Err(usage()),
            None => host,
        };
        let port: u16 = port.parse().ok().filter(|p| *p > 0).ok_or_else(usage)?;
        let host_ok = !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(&b));
        if !host_ok {
            return Err(usage());
        }
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }
}

impl Endpoints {
    /// `host:port` of every configured node, without credentials, for error messages.
    pub fn describe(&self) -> String {
        match self {
            Endpoints::Single(url) => url.endpoint().to_owned(),
            Endpoints::Cluster(seeds) => {
                let nodes: Vec<&str> = seeds.iter().map(SecretUrl::endpoint).collect();
                format!("cluster {}", nodes.join(","))
            }
            Endpoints::Sentinel(sentinels) => {
                let nodes: Vec<String> = sentinels.addrs.iter().map(ToString::to_string).collect();
                format!(
                    "sentinel master {} via {}",
                    sentinels.master,
                    nodes.join(",")
                )
            }
        }
    }

    /// The configured URLs (none for Sentinel, whose addresses are not URLs).
    fn urls(&self) -> &[SecretUrl] {
        match self {
            Endpoints::Single(url) => std::slice::from_ref(url),
            Endpoints::Cluster(seeds) => seeds,
            Endpoints::Sentinel(_) => &[],
        }
    }
}

/// Where the password comes from. Read at every connect, so a rotated Secret is picked up.
#[derive(Clone)]
pub enum PasswordSource {
    /// A value given once (from the environment).
    Value(Secret),
    /// A file (a mounted Kubernetes Secret); one trailing newline is ignored.
    File(PathBuf),
}

impl fmt::Debug for PasswordSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PasswordSource::Value(_) => f.write_str("Value(***)"),
            PasswordSource::File(path) => write!(f, "File({})", path.display()),
        }
    }
}

impl PasswordSource {
    /// The password as of now.
    pub fn load(&self) -> Result<Secret, StoreError> {
        match self {
            PasswordSource::Value(secret) => Ok(secret.clone()),
            PasswordSource::File(path) => {
                let text = read_file(path, "password file")?;
                let text = String::from_utf8(text).map_err(|_| {
                    StoreError::InvalidConfig(format!(
                        "password file {} is not UTF-8",
                        path.display()
                    ))
                })?;
                let value = text
                    .strip_suffix('\n')
                    .map(|t| t.strip_suffix('\r').unwrap_or(t))
                    .unwrap_or(&text);
                if value.is_empty() {
                    return Err(StoreError::InvalidConfig(format!(
                        "password file {} is empty",
                        path.display()
                    )));
                }
                Ok(Secret::new(value))
            }
        }
    }
}

/// TLS settings. Certificates are always verified unless [`TlsConfig::insecure`] is set.
#[derive(Clone, Debug, Default)]
pub struct TlsConfig {
    /// PEM bundle of the CAs that may sign the server certificate; the system roots when unset.
    pub ca_file: Option<PathBuf>,
    /// The client certificate for mutual TLS: a certificate never comes without its key.
    pub client: Option<ClientCertificate>,
    /// The name the server certificate must carry, when it differs from the host connected to
    /// (connecting by IP or through a tunnel). Single servers and Sentinel (where every
    /// sentinel and every primary is checked against it); not a cluster.
    pub server_name: Option<String>,
    /// Accept any server certificate. Logged as a warning; for experiments only.
    pub insecure: bool,
}

/// A client certificate (chain) and its private key, as PEM files.
#[derive(Clone, Debug)]
pub struct ClientCertificate {
    /// PEM client certificate (chain).
    pub cert_file: PathBuf,
    /// PEM private key of the certificate.
    pub key_file: PathBuf,
}

/// The PEM material of a [`TlsConfig`], read from its files.
pub(super) struct TlsMaterial {
    pub ca: Option<Vec<u8>>,
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsConfig {
    /// Reads the certificate files (at every connect, so rotated files are picked up).
    pub(super) fn load(&self) -> Result<TlsMaterial, StoreError> {
        let ca = self
            .ca_file
            .as_deref()
            .map(|p| read_file(p, "TLS CA file"))
            .transpose()?;
        let client = match &self.client {
            Some(ClientCertificate {
                cert_file,
                key_file,
            }) => Some((
                read_file(cert_file, "TLS client certificate file")?,
                read_file(key_file, "TLS client key file")?,
            )),
            None => None,
        };
        Ok(TlsMaterial { ca, client })
    }
}

fn read_file(path: &Path, what: &str) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| {
        StoreError::InvalidConfig(format!("cannot read {what} {}: {e}", path.display()))
    })
}

/// How durable an acquire must be before it returns. Enforced with `WAITAOF` on the connection
/// that ran the acquire script, so it needs Valkey 8.0+ (or Redis 7.2+); checked at connect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Durability {
    /// Wait until the primary fsynced the acquire to its append-only file (`appendonly yes`).
    pub local: bool,
    /// Wait until this many replicas fsynced it to their append-only files.
    pub replicas: u32,
}

impl Durability {
    /// No waiting: the acquire returns when the primary ran it (the default).
    pub const NONE: Durability = Durability {
        local: false,
        replicas: 0,
    };

    /// Whether an acquire waits for anything.
    pub fn is_none(self) -> bool {
        self == Self::NONE
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.local, self.replicas) {
            (false, 0) => f.write_str("none"),
            (true, 0) => f.write_str("local"),
            (false, n) => write!(f, "replicas={n}"),
            (true, n) => write!(f, "local,replicas={n}"),
        }
    }
}

impl FromStr for Durability {
    type Err = String;

    /// `none`, `local`, `replicas=N` or `local,replicas=N`.
    fn from_str(text: &str) -> Result<Self, String> {
        let usage =
            || format!("durability {text:?}: expected none, local, replicas=N or local,replicas=N");
        if text == "none" {
            return Ok(Self::NONE);
        }
        let mut durability = Self::NONE;
        for part in text.split(',') {
            match part.split_once('=') {
                None if part == "local" && !durability.local => durability.local = true,
                Some(("replicas", n)) if durability.replicas == 0 => {
                    durability.replicas = n.parse().ok().filter(|n| *n > 0).ok_or_else(usage)?;
                }
                _ => return Err(usage()),
            }
        }
        Ok(durability)
    }
}

/// Everything the Valkey backend needs to know.
#[derive(Clone, Debug)]
pub struct ValkeyConfig {
    /// Where Valkey is. `rediss://` and `valkeys://` URLs turn TLS on.
    pub endpoints: Endpoints,
    /// ACL user; overrides a user in the URL.
    pub username: Option<String>,
    /// Password; overrides a password in the URL.
    pub password: Option<PasswordSource>,
    /// TLS settings; `Some` turns TLS on even for `redis://` URLs.
    pub tls: Option<TlsConfig>,
    /// Prefix of every key (default `tl`).
    pub key_prefix: String,
    /// Number of multiplexed connections (each to a single server, or each a cluster client).
    pub pool_size: usize,
    /// Deadline for establishing one connection (TCP, TLS and authentication).
    pub connect_timeout: Duration,
    /// Deadline for one call, including reconnects and retries within it.
    pub call_timeout: Duration,
    /// First delay between reconnect attempts; doubles per failure, with jitter.
    pub reconnect_min_delay: Duration,
    /// Longest delay between reconnect attempts.
    pub reconnect_max_delay: Duration,
    /// What an acquire waits for before it returns.
    pub durability: Durability,
    /// How long a reply stays cached for retries with the same request id. At least
    /// [`REPLY_TTL_PER_CALL_TIMEOUT`] call timeouts, so every retry a caller makes within its
    /// own deadlines finds the first reply.
    pub reply_ttl: Duration,
    /// Accept a server whose `maxmemory-policy` may evict keys (anything but `noeviction`),
    /// with a warning at every connect. Off by default: an evicted lease or fence is a lost
    /// lease or a token that can go back.
    pub allow_eviction: bool,
    /// This installation's identity. When set, every connection claims the key prefix for it
    /// (the `<prefix>:installation` marker) and is refused when another installation holds the
    /// prefix: two controllers without a shared leader never share leases by accident.
    pub installation: Option<String>,
}

/// The reply TTL must cover this many call timeouts: a caller's retries with one request id
/// (each bounded by the call timeout, with backoff between them) must all land while the first
/// reply is cached, or a late retry would act again.
pub const REPLY_TTL_PER_CALL_TIMEOUT: u32 = 4;

impl ValkeyConfig {
    /// Defaults for everything but the endpoint: prefix `tl`, 4 connections, 2 s to connect,
    /// 2 s per call, reconnect delays from 50 ms to 2 s, no durability wait, replies cached for
    /// 60 s.
    pub fn new(url: SecretUrl) -> Self {
        Self::with_endpoints(Endpoints::Single(url))
    }

    /// The same defaults for a Valkey Cluster reached through `seeds`.
    pub fn cluster(seeds: Vec<SecretUrl>) -> Self {
        Self::with_endpoints(Endpoints::Cluster(seeds))
    }

    /// The same defaults for the primary that `sentinels` name.
    pub fn sentinel(sentinels: Sentinels) -> Self {
        Self::with_endpoints(Endpoints::Sentinel(sentinels))
    }

    fn with_endpoints(endpoints: Endpoints) -> Self {
        Self {
            endpoints,
            username: None,
            password: None,
            tls: None,
            key_prefix: DEFAULT_PREFIX.to_owned(),
            pool_size: DEFAULT_POOL_SIZE,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            reconnect_min_delay: DEFAULT_RECONNECT_MIN_DELAY,
            reconnect_max_delay: DEFAULT_RECONNECT_MAX_DELAY,
            durability: Durability::NONE,
            reply_ttl: DEFAULT_REPLY_TTL,
            allow_eviction: false,
            installation: None,
        }
    }

    /// The TLS settings in force: the configured ones, or the defaults (system roots, full
    /// verification) when only the URL scheme asks for TLS.
    pub fn effective_tls(&self) -> Option<TlsConfig> {
        match &self.tls {
            Some(tls) => Some(tls.clone()),
            None if self.endpoints.urls().iter().any(SecretUrl::is_tls) => {
                Some(TlsConfig::default())
            }
            None => None,
        }
    }

    /// Checks the settings that can be checked without a server.
    pub fn validate(&self) -> Result<(), StoreError> {
        check_prefix(&self.key_prefix)?;
        let invalid = |m: &str| Err(StoreError::InvalidConfig(m.to_owned()));
        match &self.endpoints {
            Endpoints::Sentinel(sentinels) => sentinels.validate()?,
            _ if self.endpoints.urls().is_empty() => {
                return invalid("no Valkey endpoint configured");
            }
            _ => {}
        }
        if self.pool_size == 0 || self.pool_size > 64 {
            return invalid("the pool size must be between 1 and 64");
        }
        if self.connect_timeout.is_zero() || self.call_timeout.is_zero() {
            return invalid("timeouts must be positive");
        }
        if self.reconnect_min_delay.is_zero() || self.reconnect_min_delay > self.reconnect_max_delay
        {
            return invalid("reconnect delays must satisfy 0 < min <= max");
        }
        if self.reply_ttl < self.call_timeout * REPLY_TTL_PER_CALL_TIMEOUT {
            return Err(StoreError::InvalidConfig(format!(
                "the reply TTL ({} ms) must be at least {REPLY_TTL_PER_CALL_TIMEOUT} call \
                 timeouts ({} ms): a retry that lands after its cached reply expired acts again",
                self.reply_ttl.as_millis(),
                (self.call_timeout * REPLY_TTL_PER_CALL_TIMEOUT).as_millis()
            )));
        }
        if let Some(id) = &self.installation
            && !crate::store::names::is_name(id, 253, b"._:/-")
        {
            return invalid(
                "the installation id must be 1 to 253 characters of A-Z, a-z, 0-9 and . _ : / -",
            );
        }
        let tls = self.effective_tls();
        if let (
            Endpoints::Cluster(_),
            Some(TlsConfig {
                server_name: Some(_),
                ..
            }),
        ) = (&self.endpoints, &tls)
        {
            return invalid(
                "a TLS server name cannot be used with a cluster: every node is verified against \
                 the address it announces",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durability_round_trips() {
        for text in ["none", "local", "replicas=2", "local,replicas=1"] {
            let d: Durability = text.parse().unwrap();
            assert_eq!(d.to_string(), text);
        }
        for bad in [
            "",
            "replicas=0",
            "replicas=x",
            "local,local",
            "all",
            "replicas=1,replicas=2",
        ] {
            assert!(bad.parse::<Durability>().is_err(), "{bad}");
        }
    }

    #[test]
    fn password_file_drops_one_trailing_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, "s3cret\n").unwrap();
        let source = PasswordSource::File(path.clone());
        assert_eq!(source.load().unwrap().expose(), "s3cret");
        std::fs::write(&path, "\n").unwrap();
        assert_eq!(source.load().unwrap_err().kind().as_str(), "invalid_config");
        assert!(!format!("{:?}", PasswordSource::Value(Secret::new("x1"))).contains("x1"));
    }

    #[test]
    fn scheme_turns_tls_on_and_server_name_is_single_only() {
        let url = |u: &str| SecretUrl::parse(u).unwrap();
        assert!(
            ValkeyConfig::new(url("rediss://h:1"))
                .effective_tls()
                .is_some()
        );
        assert!(
            ValkeyConfig::new(url("redis://h:1"))
                .effective_tls()
                .is_none()
        );
        let mut cluster = ValkeyConfig::cluster(vec![url("redis://a:1"), url("redis://b:2")]);
        assert_eq!(cluster.endpoints.describe(), "cluster a:1,b:2");
        cluster.tls = Some(TlsConfig {
            server_name: Some("valkey.example".into()),
            ..TlsConfig::default()
        });
        assert!(cluster.validate().is_err());
    }
}
