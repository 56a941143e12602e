//! `--etcd-*` flags (and `TARGETLEASE_ETCD_*` variables): how a subcommand reaches etcd when
//! `--backend etcd` selects it. The same shape as the Valkey flags: endpoints, a key prefix, a
//! user with a password from a file (or `TARGETLEASE_ETCD_PASSWORD`, never a flag), TLS and
//! mTLS from PEM files, deadlines.

use std::path::PathBuf;

use clap::Args;

use super::flags::Span;
use super::valkey_args::{ETCD_URL, password_source};
use crate::redact::SecretUrl;
use crate::store::etcd::{
    DEFAULT_ETCD_CALL_TIMEOUT, DEFAULT_ETCD_CONNECT_TIMEOUT, DEFAULT_ETCD_PREFIX, EtcdConfig,
    EtcdTls,
};
use crate::store::{DEFAULT_REPLY_TTL, StoreError};

/// The variable that may hold the etcd user's password.
pub const ETCD_PASSWORD_ENV: &str = "TARGETLEASE_ETCD_PASSWORD";

/// How to reach etcd.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "etcd connection (--backend etcd)")]
pub struct EtcdArgs {
    /// Client URLs of the etcd members, comma-separated (http:// or https://; a bare
    /// host:port is http://). Calls go to the member that answered last, and to the next one
    /// when it is unreachable or has no leader.
    #[arg(
        long,
        env = "TARGETLEASE_ETCD_ENDPOINTS",
        hide_env_values = true,
        value_delimiter = ',',
        value_parser = ETCD_URL
    )]
    pub etcd_endpoints: Vec<SecretUrl>,
    /// The etcd user (etcd with authentication on); its password comes from
    /// --etcd-password-file or TARGETLEASE_ETCD_PASSWORD.
    #[arg(long, env = "TARGETLEASE_ETCD_USERNAME")]
    pub etcd_username: Option<String>,
    /// A file holding the etcd user's password (a mounted Secret).
    #[arg(long, env = "TARGETLEASE_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// The CA that signed the members' certificates (PEM); needed for https:// endpoints.
    #[arg(long, env = "TARGETLEASE_ETCD_TLS_CA_FILE")]
    pub etcd_tls_ca_file: Option<PathBuf>,
    /// A client certificate for mTLS (PEM), with --etcd-tls-key-file.
    #[arg(
        long,
        env = "TARGETLEASE_ETCD_TLS_CERT_FILE",
        requires = "etcd_tls_key_file"
    )]
    pub etcd_tls_cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        env = "TARGETLEASE_ETCD_TLS_KEY_FILE",
        requires = "etcd_tls_cert_file"
    )]
    pub etcd_tls_key_file: Option<PathBuf>,
    /// Every key starts with this prefix and a slash: one prefix per installation.
    #[arg(long, env = "TARGETLEASE_ETCD_KEY_PREFIX", default_value = DEFAULT_ETCD_PREFIX)]
    pub etcd_key_prefix: String,
    /// Deadline for opening one connection to a member.
    #[arg(long, env = "TARGETLEASE_ETCD_CONNECT_TIMEOUT", default_value_t = Span(DEFAULT_ETCD_CONNECT_TIMEOUT))]
    pub etcd_connect_timeout: Span,
    /// Deadline for one call, including its retries on other members.
    #[arg(long, env = "TARGETLEASE_ETCD_TIMEOUT", default_value_t = Span(DEFAULT_ETCD_CALL_TIMEOUT))]
    pub etcd_timeout: Span,
    /// How long a reply stays cached for retries with the same request id (at least four
    /// call timeouts).
    #[arg(long, env = "TARGETLEASE_ETCD_REPLY_TTL", default_value_t = Span(DEFAULT_REPLY_TTL))]
    pub etcd_reply_ttl: Span,
}

impl EtcdArgs {
    /// The settings these flags describe, with the password from [`ETCD_PASSWORD_ENV`] when no
    /// password file is given.
    pub fn config(&self) -> Result<EtcdConfig, StoreError> {
        self.config_with_env(|name| std::env::var(name).ok())
    }

    fn config_with_env(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<EtcdConfig, StoreError> {
        // Every flag is named here: a flag added to the struct and not wired below does not
        // compile.
        let Self {
            etcd_endpoints,
            etcd_username,
            etcd_password_file,
            etcd_tls_ca_file,
            etcd_tls_cert_file,
            etcd_tls_key_file,
            etcd_key_prefix,
            etcd_connect_timeout,
            etcd_timeout,
            etcd_reply_ttl,
        } = self;
        let mut config = EtcdConfig::new(etcd_endpoints.clone());
        config.username = etcd_username.clone();
        config.password = password_source(etcd_password_file, env(ETCD_PASSWORD_ENV));
        config.tls = EtcdTls {
            ca_file: etcd_tls_ca_file.clone(),
            cert_file: etcd_tls_cert_file.clone(),
            key_file: etcd_tls_key_file.clone(),
        };
        config.key_prefix = etcd_key_prefix.clone();
        config.connect_timeout = etcd_connect_timeout.0;
        config.call_timeout = etcd_timeout.0;
        config.reply_ttl = etcd_reply_ttl.0;
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        etcd: EtcdArgs,
    }

    fn config(args: &[&str], password: Option<&str>) -> Result<EtcdConfig, StoreError> {
        let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .map_err(|e| StoreError::InvalidConfig(e.to_string()))?;
        cli.etcd.config_with_env(|name| {
            password
                .filter(|_| name == ETCD_PASSWORD_ENV)
                .map(String::from)
        })
    }

    #[test]
    fn endpoints_and_defaults() {
        let c = config(
            &[
                "--etcd-endpoints",
                "127.0.0.1:2379,https://e2:2379",
                "--etcd-tls-ca-file",
                "/ca.pem",
            ],
            None,
        )
        .unwrap();
        let urls: Vec<&str> = c.endpoints.iter().map(|u| u.expose()).collect();
        assert_eq!(urls, ["http://127.0.0.1:2379", "https://e2:2379"]);
        assert_eq!(c.key_prefix, DEFAULT_ETCD_PREFIX);
        assert_eq!(c.call_timeout, DEFAULT_ETCD_CALL_TIMEOUT);
        assert!(c.username.is_none() && c.password.is_none());
    }

    #[test]
    fn contradictions_are_refused_with_the_rule() {
        let refused = |args: &[&str], password: Option<&str>, rule: &str| {
            let e = config(args, password).expect_err("refused");
            assert!(e.to_string().contains(rule), "{args:?}: {e}");
        };
        refused(&[], None, "no etcd endpoint");
        refused(
            &["--etcd-endpoints", "redis://e:1"],
            None,
            "the scheme must be",
        );
        refused(
            &["--etcd-endpoints", "https://e:2379"],
            None,
            "--etcd-tls-ca-file",
        );
        refused(
            &["--etcd-endpoints", "http://u:secret@e:2379"],
            None,
            "--etcd-password-file",
        );
        refused(
            &["--etcd-endpoints", "e:2379", "--etcd-username", "u"],
            None,
            "needs a password",
        );
        refused(
            &["--etcd-endpoints", "e:2379", "--etcd-key-prefix", "a b"],
            None,
            "key prefix",
        );
        refused(
            &["--etcd-endpoints", "e:2379", "--etcd-reply-ttl", "1s"],
            None,
            "reply TTL",
        );
        // A password in the environment with a user works.
        let c = config(
            &["--etcd-endpoints", "e:2379", "--etcd-username", "u"],
            Some("pw"),
        )
        .unwrap();
        assert_eq!(c.username.as_deref(), Some("u"));
    }

    #[test]
    fn a_password_in_a_url_is_never_echoed() {
        let e = config(&["--etcd-endpoints", "http://u:hunter2@e:2379"], None).expect_err("x");
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let cli =
            Cli::try_parse_from(["t", "--etcd-endpoints", "http://u:hunter2@e:2379"]).unwrap();
        assert!(!format!("{cli:?}").contains("hunter2"));
    }
}
