//! Certificates made at test time with the `openssl` command (installed by
//! `scripts/install-test-deps.sh`): a CA, a server certificate for `127.0.0.1`, `localhost` and
//! `valkey.test`, a client certificate, and a second, unrelated CA with its own client
//! certificate for the failure cases.

use std::path::{Path, PathBuf};
use std::process::Command;

use redis::{ClientTlsConfig, TlsCertificates};

/// Test certificates in a temporary folder.
pub struct Certs {
    dir: tempfile::TempDir,
}

const CA_CONFIG: &str = "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = unused\n\
[v3_ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n\
subjectKeyIdentifier = hash\n";

const SERVER_EXT: &str = "basicConstraints = CA:FALSE\nkeyUsage = digitalSignature\n\
extendedKeyUsage = serverAuth\nsubjectAltName = IP:127.0.0.1,DNS:localhost,DNS:valkey.test\n";

/// A server certificate that is also a client's: an etcd member's, whose JSON gateway connects
/// to the member's own gRPC port with it when clients must show a certificate.
const SERVER_AND_CLIENT_EXT: &str = "basicConstraints = CA:FALSE\nkeyUsage = digitalSignature\n\
extendedKeyUsage = serverAuth,clientAuth\nsubjectAltName = IP:127.0.0.1,DNS:localhost\n";

const CLIENT_EXT: &str =
    "basicConstraints = CA:FALSE\nkeyUsage = digitalSignature\nextendedKeyUsage = clientAuth\n";

impl Certs {
    /// Makes a fresh set; panics with openssl's output when a step fails.
    pub fn generate() -> Certs {
        let dir = tempfile::tempdir().expect("temp dir for certificates");
        let certs = Certs { dir };
        std::fs::write(certs.path("ca.cnf"), CA_CONFIG).expect("write ca.cnf");
        std::fs::write(certs.path("server.ext"), SERVER_EXT).expect("write server.ext");
        std::fs::write(certs.path("client.ext"), CLIENT_EXT).expect("write client.ext");
        std::fs::write(certs.path("server-and-client.ext"), SERVER_AND_CLIENT_EXT)
            .expect("write server-and-client.ext");
        for ca in ["ca", "other-ca"] {
            certs.openssl(&[
                "req",
                "-x509",
                "-config",
                "ca.cnf",
                "-extensions",
                "v3_ca",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.crt"),
                "-subj",
                &format!("/CN=targetlease test {ca}"),
            ]);
        }
        certs.leaf("server", "ca", "valkey.test", "server.ext");
        certs.leaf("member", "ca", "etcd.test", "server-and-client.ext");
        certs.leaf("client", "ca", "targetlease", "client.ext");
        certs.leaf("other-client", "other-ca", "intruder", "client.ext");
        certs
    }

    fn leaf(&self, name: &str, ca: &str, cn: &str, ext: &str) {
        self.openssl(&[
            "req",
            "-new",
            "-config",
            "ca.cnf",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            ext,
            "-out",
            &format!("{name}.crt"),
        ]);
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect("openssl must be installed (scripts/install-test-deps.sh)");
        assert!(
            out.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A file of the set: `ca.crt`, `server.crt`, `server.key`, `client.crt`, `client.key`,
    /// `other-ca.crt`, `other-client.crt`, `other-client.key`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The server arguments for a TLS-only server; `mtls` requires client certificates.
    pub fn server_args(&self, mtls: bool) -> Vec<String> {
        let p = |n: &str| self.path(n).display().to_string();
        vec![
            "--tls-cert-file".into(),
            p("server.crt"),
            "--tls-key-file".into(),
            p("server.key"),
            "--tls-ca-cert-file".into(),
            p("ca.crt"),
            "--tls-auth-clients".into(),
            if mtls { "yes" } else { "no" }.into(),
        ]
    }

    /// redis-rs certificates for an administrator connection (trusting the CA, presenting the
    /// client certificate).
    pub fn admin_certs(&self) -> TlsCertificates {
        TlsCertificates {
            client_tls: Some(ClientTlsConfig {
                client_cert: read(&self.path("client.crt")),
                client_key: read(&self.path("client.key")),
            }),
            root_cert: Some(read(&self.path("ca.crt"))),
        }
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}
