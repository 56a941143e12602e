//! Values that must never reach a log line or `Debug` output whole.

use std::fmt;

/// A connection URL that may hold a password. `Display` and `Debug` print it with the password
/// replaced by `***`; [`SecretUrl::expose`] is the only way to the original.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl {
    raw: String,
    redacted: String,
    endpoint: String,
}

/// A URL that could not be parsed. Its message never repeats the URL.
#[derive(Debug, thiserror::Error)]
#[error("invalid URL: {0}")]
pub struct InvalidUrl(String);

impl SecretUrl {
    /// Parses a URL and prepares its redacted form.
    pub fn parse(raw: &str) -> Result<Self, InvalidUrl> {
        let parsed = url::Url::parse(raw).map_err(|e| InvalidUrl(e.to_string()))?;
        let host = parsed
            .host_str()
            .ok_or_else(|| InvalidUrl("the URL has no host".into()))?;
        let endpoint = match parsed.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        };
        let mut shown = parsed.clone();
        if shown.password().is_some() {
            // set_password only fails for URLs that cannot have credentials at all.
            let _ = shown.set_password(Some("***"));
        }
        Ok(Self {
            raw: raw.to_owned(),
            redacted: shown.to_string(),
            endpoint,
        })
    }

    /// The URL with its password, for the client library only.
    pub fn expose(&self) -> &str {
        &self.raw
    }

    /// `host:port`, for error messages.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether the URL carries a password.
    pub fn has_password(&self) -> bool {
        url::Url::parse(&self.raw).is_ok_and(|u| u.password().is_some())
    }

    /// Whether the scheme asks for TLS (`rediss://`, `valkeys://`).
    pub fn is_tls(&self) -> bool {
        self.raw.starts_with("rediss://") || self.raw.starts_with("valkeys://")
    }
}

/// A secret value (a password). `Debug` prints `Secret(***)`; it has no `Display`, so it cannot
/// end up in a formatted message by accident. [`Secret::expose`] is the only way to the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the client library only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted)
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({})", self.redacted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_is_masked_everywhere() {
        let url = SecretUrl::parse("redis://app:hunter2@127.0.0.1:6379/0").unwrap();
        for shown in [
            format!("{url}"),
            format!("{url:?}"),
            format!("{:?}", Some(&url)),
        ] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("***"), "{shown}");
        }
        assert_eq!(url.endpoint(), "127.0.0.1:6379");
        assert!(url.expose().contains("hunter2"));
        assert!(url.has_password());
    }

    #[test]
    fn secret_is_masked() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?}"), "Secret(***)");
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn invalid_url_error_does_not_echo_the_url() {
        let err = SecretUrl::parse("redis://app:hunter2@[bad").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
    }
}
