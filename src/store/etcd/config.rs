//! Connection settings of the etcd backend, in the same shape as Valkey's: endpoints, a key
//! prefix, credentials from a file, TLS and mTLS, deadlines.

use std::path::PathBuf;
use std::time::Duration;

use crate::redact::SecretUrl;
use crate::store::valkey::PasswordSource;
use crate::store::valkey::config::REPLY_TTL_PER_CALL_TIMEOUT;
use crate::store::{DEFAULT_REPLY_TTL, StoreError};

/// The key prefix when none is given: every key of an installation starts with it.
pub const DEFAULT_ETCD_PREFIX: &str = "targetlease";
/// Deadline of one store call when none is given (every retry and endpoint within it).
pub const DEFAULT_ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline of one connection (TCP and TLS) when none is given.
pub const DEFAULT_ETCD_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// TLS towards the etcd members.
#[derive(Clone, Debug, Default)]
pub struct EtcdTls {
    /// The CA that signed the members' certificates (PEM).
    pub ca_file: Option<PathBuf>,
    /// A client certificate (PEM) for mTLS, with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's key (PEM).
    pub key_file: Option<PathBuf>,
}

/// How to reach etcd.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Client URLs of the members (`http://` or `https://`); calls go to the first that answers.
    pub endpoints: Vec<SecretUrl>,
    /// Every key starts with `<prefix>/`.
    pub key_prefix: String,
    /// An etcd user (with `password`), when etcd has authentication on.
    pub username: Option<String>,
    /// The user's password.
    pub password: Option<PasswordSource>,
    /// TLS settings (required for `https://` endpoints when the CA is not in the system's).
    pub tls: EtcdTls,
    /// Deadline for opening one connection.
    pub connect_timeout: Duration,
    /// Deadline for one call, including its retries on other members.
    pub call_timeout: Duration,
    /// How long a reply stays cached for retries with the same request id.
    pub reply_ttl: Duration,
    /// This installation's identity. When set, the store claims the key prefix for it (the
    /// `<prefix>/installation` key) before its first call and at every health check, and is
    /// refused when another installation holds the prefix: two controllers without a shared
    /// leader never share leases by accident.
    pub installation: Option<String>,
}

impl EtcdConfig {
    /// Defaults for everything but the endpoints: prefix `targetlease`, 2 s to connect, 2 s per
    /// call, replies cached for 60 s.
    pub fn new(endpoints: Vec<SecretUrl>) -> Self {
        Self {
            endpoints,
            key_prefix: DEFAULT_ETCD_PREFIX.into(),
            username: None,
            password: None,
            tls: EtcdTls::default(),
            connect_timeout: DEFAULT_ETCD_CONNECT_TIMEOUT,
            call_timeout: DEFAULT_ETCD_CALL_TIMEOUT,
            reply_ttl: DEFAULT_REPLY_TTL,
            installation: None,
        }
    }

    /// Refuses settings that cannot work, with the rule broken.
    pub fn validate(&self) -> Result<(), StoreError> {
        let invalid = |m: String| Err(StoreError::InvalidConfig(m));
        if self.endpoints.is_empty() {
            return invalid("no etcd endpoint: give --etcd-endpoints URL[,URL...]".into());
        }
        for url in &self.endpoints {
            let raw = url.expose();
            if !(raw.starts_with("http://") || raw.starts_with("https://")) {
                return invalid(format!(
                    "etcd endpoint {url} must start with http:// or https://"
                ));
            }
            if raw.starts_with("https://") && self.tls.ca_file.is_none() {
                return invalid(format!(
                    "etcd endpoint {url} is https://: give the CA of the members with \
                     --etcd-tls-ca-file (the system's CAs are not trusted for etcd)"
                ));
            }
            if url.has_password() {
                return invalid(format!(
                    "etcd endpoint {url} carries a password: give the user with --etcd-username \
                     and the password in a file (--etcd-password-file)"
                ));
            }
        }
        let prefix_ok = !self.key_prefix.is_empty()
            && self.key_prefix.len() <= 128
            && self
                .key_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b))
            && !self.key_prefix.ends_with('/');
        if !prefix_ok {
            return invalid(format!(
                "etcd key prefix {:?} must be 1 to 128 characters of A-Z, a-z, 0-9 and . _ - /, \
                 not ending in /",
                self.key_prefix
            ));
        }
        if self.username.is_some() != self.password.is_some() {
            return invalid("an etcd user needs a password, and a password a user".into());
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            return invalid("a client certificate needs its key, and a key its certificate".into());
        }
        if self.call_timeout.is_zero() || self.connect_timeout.is_zero() {
            return invalid("etcd deadlines must be above zero".into());
        }
        if let Some(id) = &self.installation
            && !crate::store::names::is_name(id, 253, b"._:/-")
        {
            return invalid(
                "the installation id must be 1 to 253 characters of A-Z, a-z, 0-9 and . _ : / -"
                    .into(),
            );
        }
        if self.reply_ttl < self.call_timeout * REPLY_TTL_PER_CALL_TIMEOUT {
            return invalid(format!(
                "the reply TTL ({:?}) must cover {REPLY_TTL_PER_CALL_TIMEOUT} call timeouts ({:?}): \
                 a retry after it would act again",
                self.reply_ttl, self.call_timeout
            ));
        }
        Ok(())
    }
}
