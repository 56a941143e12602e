//! `--valkey-*` flags (and `TARGETLEASE_VALKEY_*` variables): how every subcommand that talks to
//! the lease store reaches Valkey. Flatten [`ValkeyArgs`] into a command and call
//! [`ValkeyArgs::open`].
//!
//! The password is never a flag: it comes from a file (`--valkey-password-file`, how a
//! Kubernetes Secret arrives) or from `TARGETLEASE_VALKEY_PASSWORD`, so it shows neither in
//! `--help` nor in the process list.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind as ClapErrorKind;
use clap::{Arg, Args, Command};

use super::flags::Span;
use crate::redact::{Secret, SecretUrl};
use crate::store::valkey::{
    ClientCertificate, DEFAULT_CALL_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE,
    DEFAULT_PREFIX, DEFAULT_RECONNECT_MAX_DELAY, DEFAULT_RECONNECT_MIN_DELAY,
    DEFAULT_SENTINEL_POLL_INTERVAL, Durability, HostPort, PasswordSource, Sentinels, TlsConfig,
    ValkeyConfig, ValkeyStore,
};
use crate::store::{DEFAULT_REPLY_TTL, LeaseStore, StoreError};

/// The variable that may hold the Valkey password.
pub const PASSWORD_ENV: &str = "TARGETLEASE_VALKEY_PASSWORD";

/// The variable that may hold the sentinels' password.
pub const SENTINEL_PASSWORD_ENV: &str = "TARGETLEASE_VALKEY_SENTINEL_PASSWORD";

/// How to reach the lease store (Valkey). One of `--valkey-url`, `--valkey-cluster-seeds` and
/// `--valkey-sentinels` is needed when the store is used; [`ValkeyArgs::config`] says so when
/// none is given (a command may not need Valkey at all, e.g. `controller --backend memory`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Valkey connection")]
pub struct ValkeyArgs {
    /// Valkey URL: redis://, rediss://, valkey:// or valkeys:// (the `s` schemes use TLS).
    /// Prefer --valkey-username and --valkey-password-file over credentials in the URL.
    #[arg(
        long,
        env = "TARGETLEASE_VALKEY_URL",
        hide_env_values = true,
        value_parser = VALKEY_URL,
        conflicts_with_all = ["valkey_cluster_seeds", "valkey_sentinels"]
    )]
    pub valkey_url: Option<SecretUrl>,

    /// Valkey Cluster seed nodes, comma-separated URLs or host:port pairs; the rest of the
    /// topology is discovered.
    #[arg(
        long,
        env = "TARGETLEASE_VALKEY_CLUSTER_SEEDS",
        hide_env_values = true,
        value_delimiter = ',',
        value_parser = VALKEY_URL,
        conflicts_with = "valkey_sentinels"
    )]
    pub valkey_cluster_seeds: Vec<SecretUrl>,

    /// Sentinels that watch the primary, comma-separated HOST:PORT pairs (Sentinel's port is
    /// usually 26379). Every connect asks them which server is the primary. Needs
    /// --valkey-sentinel-master.
    #[arg(
        long,
        env = "TARGETLEASE_VALKEY_SENTINELS",
        value_delimiter = ',',
        value_parser = parse_host_port
    )]
    pub valkey_sentinels: Vec<HostPort>,

    /// Name of the primary the sentinels monitor (`sentinel monitor <name> ...`; `mymaster` in
    /// the valkey-io chart, `myprimary` in Bitnami's).
    #[arg(long, env = "TARGETLEASE_VALKEY_SENTINEL_MASTER")]
    pub valkey_sentinel_master: Option<String>,

    /// ACL user on the sentinels, when they require one (the data user is --valkey-username).
    #[arg(long, env = "TARGETLEASE_VALKEY_SENTINEL_USERNAME")]
    pub valkey_sentinel_username: Option<String>,

    /// File holding the sentinels' password (re-read at every reconnect). Without it, the
    /// password is taken from TARGETLEASE_VALKEY_SENTINEL_PASSWORD when set.
    #[arg(long, env = "TARGETLEASE_VALKEY_SENTINEL_PASSWORD_FILE")]
    pub valkey_sentinel_password_file: Option<PathBuf>,

    /// How often the sentinels are asked whether the primary changed, while the store is in use
    /// (a demoted primary keeps taking writes on open connections until Sentinel reconfigures
    /// it).
    #[arg(long, env = "TARGETLEASE_VALKEY_SENTINEL_POLL_INTERVAL", default_value_t = Span(DEFAULT_SENTINEL_POLL_INTERVAL))]
    pub valkey_sentinel_poll_interval: Span,

    /// ACL user name.
    #[arg(long, env = "TARGETLEASE_VALKEY_USERNAME")]
    pub valkey_username: Option<String>,

    /// File holding the password (a mounted Secret; re-read at every reconnect). Without it,
    /// the password is taken from TARGETLEASE_VALKEY_PASSWORD when set.
    #[arg(long, env = "TARGETLEASE_VALKEY_PASSWORD_FILE")]
    pub valkey_password_file: Option<PathBuf>,

    /// Use TLS (also implied by rediss:// and valkeys:// URLs and by any --valkey-tls-* file).
    #[arg(long, env = "TARGETLEASE_VALKEY_TLS")]
    pub valkey_tls: bool,

    /// PEM bundle of the CAs that sign the server certificate (default: the system roots).
    #[arg(long, env = "TARGETLEASE_VALKEY_TLS_CA_FILE")]
    pub valkey_tls_ca_file: Option<PathBuf>,

    /// PEM client certificate for mutual TLS.
    #[arg(
        long,
        env = "TARGETLEASE_VALKEY_TLS_CERT_FILE",
        requires = "valkey_tls_key_file"
    )]
    pub valkey_tls_cert_file: Option<PathBuf>,

    /// PEM private key of the client certificate.
    #[arg(
        long,
        env = "TARGETLEASE_VALKEY_TLS_KEY_FILE",
        requires = "valkey_tls_cert_file"
    )]
    pub valkey_tls_key_file: Option<PathBuf>,

    /// Name the server certificate must carry when it differs from the URL's host.
    #[arg(long, env = "TARGETLEASE_VALKEY_TLS_SERVER_NAME")]
    pub valkey_tls_server_name: Option<String>,

    /// Accept any server certificate (logged as a warning). For experiments only.
    #[arg(long, env = "TARGETLEASE_VALKEY_TLS_INSECURE")]
    pub valkey_tls_insecure: bool,

    /// Prefix of every Valkey key (the ACL user's key pattern must cover `<prefix>:*`).
    #[arg(long, env = "TARGETLEASE_VALKEY_KEY_PREFIX", default_value = DEFAULT_PREFIX)]
    pub valkey_key_prefix: String,

    /// Number of multiplexed connections.
    #[arg(long, env = "TARGETLEASE_VALKEY_POOL_SIZE", default_value_t = DEFAULT_POOL_SIZE)]
    pub valkey_pool_size: usize,

    /// Deadline for making one connection (TCP, TLS, authentication).
    #[arg(long, env = "TARGETLEASE_VALKEY_CONNECT_TIMEOUT", default_value_t = Span(DEFAULT_CONNECT_TIMEOUT))]
    pub valkey_connect_timeout: Span,

    /// Deadline of one call, reconnects and retries included.
    #[arg(long, env = "TARGETLEASE_VALKEY_TIMEOUT", default_value_t = Span(DEFAULT_CALL_TIMEOUT))]
    pub valkey_timeout: Span,

    /// First delay between reconnect attempts (doubles per failure, with jitter).
    #[arg(long, env = "TARGETLEASE_VALKEY_RECONNECT_MIN_DELAY", default_value_t = Span(DEFAULT_RECONNECT_MIN_DELAY))]
    pub valkey_reconnect_min_delay: Span,

    /// Longest delay between reconnect attempts.
    #[arg(long, env = "TARGETLEASE_VALKEY_RECONNECT_MAX_DELAY", default_value_t = Span(DEFAULT_RECONNECT_MAX_DELAY))]
    pub valkey_reconnect_max_delay: Span,

    /// What an acquire waits for before it returns: none, local (AOF fsync on the primary),
    /// replicas=N (AOF fsync on N replicas) or local,replicas=N. Needs WAITAOF (Valkey 8+).
    #[arg(long, env = "TARGETLEASE_VALKEY_DURABILITY", default_value = "none")]
    pub valkey_durability: Durability,

    /// How long a call's reply stays cached for retries with the same request id: at least 4
    /// call timeouts (--valkey-timeout). A retry after it is refused or acts again, never
    /// answered from the cache.
    #[arg(long, env = "TARGETLEASE_VALKEY_REPLY_TTL", default_value_t = Span(DEFAULT_REPLY_TTL))]
    pub valkey_reply_ttl: Span,

    /// Accept a server whose maxmemory-policy may evict keys (anything but noeviction), with a
    /// warning at every connect. Evicted leases are lost leases and evicted fences let tokens
    /// go back: leave it off unless the server can never run out of memory.
    #[arg(long, env = "TARGETLEASE_VALKEY_ALLOW_EVICTION")]
    pub valkey_allow_eviction: bool,
}

impl ValkeyArgs {
    /// The backend settings these flags describe, with the passwords from [`PASSWORD_ENV`] and
    /// [`SENTINEL_PASSWORD_ENV`] when no password file is given.
    pub fn config(&self) -> Result<ValkeyConfig, StoreError> {
        self.config_with_env(|name| std::env::var(name).ok())
    }

    fn config_with_env(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<ValkeyConfig, StoreError> {
        // Every flag is named here: a flag added to the struct and not wired below does not
        // compile.
        let Self {
            valkey_url,
            valkey_cluster_seeds,
            valkey_sentinels,
            valkey_sentinel_master,
            valkey_sentinel_username,
            valkey_sentinel_password_file,
            valkey_sentinel_poll_interval,
            valkey_username,
            valkey_password_file,
            valkey_tls,
            valkey_tls_ca_file,
            valkey_tls_cert_file,
            valkey_tls_key_file,
            valkey_tls_server_name,
            valkey_tls_insecure,
            valkey_key_prefix,
            valkey_pool_size,
            valkey_connect_timeout,
            valkey_timeout,
            valkey_reconnect_min_delay,
            valkey_reconnect_max_delay,
            valkey_durability,
            valkey_reply_ttl,
            valkey_allow_eviction,
        } = self;
        // clap makes the certificate and its key require each other; the pair keeps it so.
        let client = match (valkey_tls_cert_file, valkey_tls_key_file) {
            (Some(cert_file), Some(key_file)) => Some(ClientCertificate {
                cert_file: cert_file.clone(),
                key_file: key_file.clone(),
            }),
            (None, None) => None,
            _ => {
                return Err(StoreError::InvalidConfig(
                    "a TLS client certificate needs both the certificate and the key file".into(),
                ));
            }
        };
        let tls_wanted = *valkey_tls
            || valkey_tls_ca_file.is_some()
            || client.is_some()
            || valkey_tls_server_name.is_some()
            || *valkey_tls_insecure;
        let sentinel_password =
            password_source(valkey_sentinel_password_file, env(SENTINEL_PASSWORD_ENV));
        let sentinel_settings = valkey_sentinel_master.is_some()
            || valkey_sentinel_username.is_some()
            || valkey_sentinel_password_file.is_some();
        let mut config = match (
            valkey_url,
            valkey_cluster_seeds.as_slice(),
            valkey_sentinels.as_slice(),
        ) {
            (Some(_), [], []) | (None, [_, ..], []) if sentinel_settings => {
                return Err(StoreError::InvalidConfig(
                    "--valkey-sentinel-master, --valkey-sentinel-username and \
                     --valkey-sentinel-password-file need --valkey-sentinels (and no \
                     --valkey-url or --valkey-cluster-seeds)"
                        .into(),
                ));
            }
            (Some(url), [], []) => ValkeyConfig::new(url.clone()),
            (None, seeds @ [_, ..], []) => ValkeyConfig::cluster(seeds.to_vec()),
            (None, [], addrs @ [_, ..]) => {
                let master = valkey_sentinel_master.clone().ok_or_else(|| {
                    StoreError::InvalidConfig(
                        "--valkey-sentinels needs --valkey-sentinel-master, the name of the \
                         primary the sentinels monitor"
                            .into(),
                    )
                })?;
                ValkeyConfig::sentinel(Sentinels {
                    addrs: addrs.to_vec(),
                    master,
                    username: valkey_sentinel_username.clone(),
                    password: sentinel_password,
                    poll_interval: valkey_sentinel_poll_interval.0,
                })
            }
            _ => {
                return Err(StoreError::InvalidConfig(
                    "give one of --valkey-url, --valkey-cluster-seeds and --valkey-sentinels"
                        .into(),
                ));
            }
        };
        config.username = valkey_username.clone();
        config.password = password_source(valkey_password_file, env(PASSWORD_ENV));
        config.tls = tls_wanted.then(|| TlsConfig {
            ca_file: valkey_tls_ca_file.clone(),
            client,
            server_name: valkey_tls_server_name.clone(),
            insecure: *valkey_tls_insecure,
        });
        config.key_prefix = valkey_key_prefix.clone();
        config.pool_size = *valkey_pool_size;
        config.connect_timeout = valkey_connect_timeout.0;
        config.call_timeout = valkey_timeout.0;
        config.reconnect_min_delay = valkey_reconnect_min_delay.0;
        config.reconnect_max_delay = valkey_reconnect_max_delay.0;
        config.durability = *valkey_durability;
        config.reply_ttl = valkey_reply_ttl.0;
        config.allow_eviction = *valkey_allow_eviction;
        config.validate()?;
        Ok(config)
    }

    /// Connects (checking health and durability support) and returns the store.
    pub async fn open(&self) -> Result<Arc<dyn LeaseStore>, StoreError> {
        Ok(Arc::new(ValkeyStore::connect(self.config()?).await?))
    }
}

/// A password from its file, else from the environment's value (an empty one is none).
pub(super) fn password_source(
    file: &Option<PathBuf>,
    env_value: Option<String>,
) -> Option<PasswordSource> {
    match (file, env_value) {
        (Some(path), _) => Some(PasswordSource::File(path.clone())),
        (None, Some(value)) if !value.is_empty() => Some(PasswordSource::Value(Secret::new(value))),
        (None, _) => None,
    }
}

fn parse_host_port(text: &str) -> Result<HostPort, String> {
    text.parse()
}

/// Parses a URL of one of `schemes` (or a bare `host:port`, taken as `default_scheme` +
/// `host:port`) without ever echoing it: clap's own error would print the value, password
/// included.
#[derive(Clone, Copy, Debug)]
pub(super) struct SecretUrlParser {
    default_scheme: &'static str,
    schemes: &'static [&'static str],
}

/// A Valkey URL.
const VALKEY_URL: SecretUrlParser = SecretUrlParser {
    default_scheme: "redis://",
    schemes: &["redis://", "rediss://", "valkey://", "valkeys://"],
};

/// An etcd member's client URL.
pub(super) const ETCD_URL: SecretUrlParser = SecretUrlParser {
    default_scheme: "http://",
    schemes: &["http://", "https://"],
};

impl TypedValueParser for SecretUrlParser {
    type Value = SecretUrl;

    fn parse_ref(
        &self,
        cmd: &Command,
        arg: Option<&Arg>,
        value: &OsStr,
    ) -> Result<SecretUrl, clap::Error> {
        let name = arg.map_or_else(|| "URL".to_owned(), |a| format!("--{}", a.get_id()));
        let fail = |why: String| {
            clap::Error::raw(ClapErrorKind::ValueValidation, format!("{name}: {why}\n"))
                .with_cmd(cmd)
        };
        let text = value
            .to_str()
            .ok_or_else(|| fail("not UTF-8".into()))?
            .trim();
        let text = if text.contains("://") {
            text.to_owned()
        } else {
            format!("{}{text}", self.default_scheme)
        };
        let url = SecretUrl::parse(&text).map_err(|e| fail(e.to_string()))?;
        if !self.schemes.iter().any(|s| text.starts_with(s)) {
            return Err(fail(format!(
                "the scheme must be {}",
                self.schemes.join(", ")
            )));
        }
        Ok(url)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        valkey: ValkeyArgs,
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
    }

    #[test]
    fn flags_become_one_config() {
        let cli = parse(&[
            "--valkey-url=redis://10.0.0.1:6379",
            "--valkey-username=targetlease",
            "--valkey-tls-ca-file=/ca.pem",
            "--valkey-durability=replicas=1",
            "--valkey-timeout=750ms",
        ])
        .unwrap();
        let config = cli
            .valkey
            .config_with_env(|n| (n == PASSWORD_ENV).then(|| "from-env".into()))
            .unwrap();
        assert!(config.tls.is_some(), "a CA file turns TLS on");
        assert_eq!(config.durability.replicas, 1);
        assert_eq!(config.call_timeout, Duration::from_millis(750));
        assert_eq!(config.reply_ttl, Duration::from_secs(60));
        assert!(!config.allow_eviction);
        let shown = format!("{config:?}");
        assert!(!shown.contains("from-env"), "{shown}");
    }

    #[test]
    fn cluster_seeds_and_url_exclude_each_other() {
        let cli = parse(&["--valkey-cluster-seeds=10.0.0.1:7000,10.0.0.2:7000"]).unwrap();
        let config = cli.valkey.config_with_env(|_| None).unwrap();
        assert_eq!(
            config.endpoints.describe(),
            "cluster 10.0.0.1:7000,10.0.0.2:7000"
        );
        assert!(parse(&["--valkey-url=redis://a:1", "--valkey-cluster-seeds=b:2"]).is_err());
    }

    #[test]
    fn sentinel_settings_are_complete_and_exclusive() {
        let cli = parse(&[
            "--valkey-sentinels=10.0.0.1:26379,[fd00::2]:26379,valkey-node-2.valkey:26379",
            "--valkey-sentinel-master=mymaster",
            "--valkey-sentinel-username=sentinel",
            "--valkey-username=targetlease",
        ])
        .unwrap();
        let config = cli
            .valkey
            .config_with_env(|n| (n == SENTINEL_PASSWORD_ENV).then(|| "s3nt1nel".into()))
            .unwrap();
        assert_eq!(
            config.endpoints.describe(),
            "sentinel master mymaster via 10.0.0.1:26379,[fd00::2]:26379,valkey-node-2.valkey:26379"
        );
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3nt1nel"), "{shown}");
        let refused = |args: &[&str]| match parse(args) {
            Err(e) => e.to_string(),
            Ok(cli) => cli
                .valkey
                .config_with_env(|_| None)
                .unwrap_err()
                .to_string(),
        };
        for (args, says) in [
            (
                &["--valkey-sentinels=a:26379"][..],
                "--valkey-sentinel-master",
            ),
            (
                &["--valkey-url=redis://a:1", "--valkey-sentinel-master=m"][..],
                "need --valkey-sentinels",
            ),
            (
                &["--valkey-sentinels=a:1", "--valkey-url=redis://b:2"][..],
                "cannot be used with",
            ),
            (
                &["--valkey-sentinels=a:1", "--valkey-cluster-seeds=b:2"][..],
                "cannot be used with",
            ),
            (&["--valkey-sentinels=a"][..], "HOST:PORT"),
            (&["--valkey-sentinels=a:0"][..], "HOST:PORT"),
            (
                &["--valkey-sentinels=a:1,a:1", "--valkey-sentinel-master=m"][..],
                "twice",
            ),
            (
                &[
                    "--valkey-sentinels=a:1",
                    "--valkey-sentinel-master=my master",
                ][..],
                "master name",
            ),
            (
                &["--valkey-sentinels=a:1", "--valkey-sentinel-master="][..],
                "master name",
            ),
            (
                &[
                    "--valkey-sentinels=a:1",
                    "--valkey-sentinel-master=m",
                    "--valkey-sentinel-poll-interval=10ms",
                ][..],
                "poll interval",
            ),
        ] {
            let message = refused(args);
            assert!(message.contains(says), "{args:?}: {message}");
        }
    }

    #[test]
    fn a_reply_ttl_shorter_than_four_call_timeouts_is_refused() {
        let cli = parse(&[
            "--valkey-url=redis://a:1",
            "--valkey-timeout=20s",
            "--valkey-reply-ttl=60s",
        ])
        .unwrap();
        let e = cli.valkey.config_with_env(|_| None).unwrap_err();
        assert!(e.to_string().contains("reply TTL"), "{e}");
        let cli = parse(&[
            "--valkey-url=redis://a:1",
            "--valkey-timeout=20s",
            "--valkey-reply-ttl=80s",
        ])
        .unwrap();
        assert!(cli.valkey.config_with_env(|_| None).is_ok());
    }

    #[test]
    fn a_bad_url_is_not_echoed() {
        let err = parse(&["--valkey-url=redis://u:hunter2@[bad"]).unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let err = parse(&["--valkey-url=http://u:hunter2@h:1"]).unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
}
