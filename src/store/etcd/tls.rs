//! TLS towards the members: the client settings (the CA file as the only roots, a client
//! certificate for mTLS), and the probe that names why a member refuses this client.

use std::sync::Arc;
use std::time::Duration;

use super::config::EtcdConfig;
use crate::redact::SecretUrl;
use crate::store::StoreError;

/// The TLS settings: the CA file's certificates as the only roots, and the client certificate
/// for mTLS.
pub(super) fn client_config(config: &EtcdConfig) -> Result<rustls::ClientConfig, StoreError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let invalid = |what: &str, path: &std::path::Path, e: &dyn std::fmt::Display| {
        StoreError::InvalidConfig(format!("cannot read {what} {}: {e}", path.display()))
    };
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = &config.tls.ca_file {
        let certs =
            CertificateDer::pem_file_iter(path).map_err(|e| invalid("CA file", path, &e))?;
        for cert in certs {
            let cert = cert.map_err(|e| invalid("CA file", path, &e))?;
            roots.add(cert).map_err(|e| invalid("CA file", path, &e))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::InvalidConfig(format!("TLS: {e}")))?
        .with_root_certificates(roots);
    match (&config.tls.cert_file, &config.tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .map_err(|e| invalid("client certificate", cert, &e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid("client certificate", cert, &e))?;
            let key_der =
                PrivateKeyDer::from_pem_file(key).map_err(|e| invalid("client key", key, &e))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| StoreError::InvalidConfig(format!("client certificate: {e}")))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// Why a TLS member refuses this client, when it does: the rustls error that a fresh
/// handshake and a first read get. HTTP/2 hides it: the connection's own task reads the
/// member's alert (TLS 1.3 refuses a missing or unknown client certificate after the
/// handshake) and the call is told only that the connection closed. `None` for a plain
/// endpoint, or when the probe connects and reads without a TLS error.
pub(super) async fn refusal(
    tls: &Arc<rustls::ClientConfig>,
    url: &SecretUrl,
) -> Option<rustls::Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let uri: hyper::Uri = url.expose().parse().ok()?;
    if uri.scheme_str() != Some("https") {
        return None;
    }
    let host = uri
        .host()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(443);
    let of = |e: &std::io::Error| {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .cloned()
    };
    let probe = async {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .ok()?;
        let name = rustls::pki_types::ServerName::try_from(host.clone()).ok()?;
        let connector = tokio_rustls::TlsConnector::from(tls.clone());
        let mut tls = match connector.connect(name, tcp).await {
            Ok(tls) => tls,
            Err(e) => return of(&e),
        };
        if let Err(e) = tls.write_all(HTTP2_PREFACE).await {
            return of(&e);
        }
        let mut first = [0u8; 1];
        tls.read(&mut first).await.err().and_then(|e| of(&e))
    };
    tokio::time::timeout(TLS_PROBE, probe).await.ok().flatten()
}

/// What an HTTP/2 client sends first.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How long [`refusal`] waits: a member that refuses answers at once.
const TLS_PROBE: Duration = Duration::from_millis(500);
