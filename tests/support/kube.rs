//! A real Kubernetes control plane for the tests (`e2e/cluster up`), and the controller binary
//! run against it as a child process.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A control plane started for this test process, stopped on drop (and by its watchdog if the
/// process dies first).
pub struct Cluster {
    base: tempfile::TempDir,
    env: HashMap<String, String>,
}

impl Cluster {
    /// Brings a cluster up; panics with `e2e/cluster`'s own message when it cannot.
    pub fn start() -> Cluster {
        let base = tempfile::tempdir().expect("temp dir");
        let started = Instant::now();
        let output = Command::new("bash")
            .arg(repo().join("e2e/cluster"))
            .args(["up", "--owner-pid", &std::process::id().to_string()])
            .arg("--dir")
            .arg(base.path().join("cluster"))
            .env("TARGETLEASE_E2E_STATE", base.path().join("state"))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .expect("run e2e/cluster up");
        assert!(
            output.status.success(),
            "e2e/cluster up failed ({}); see its messages above",
            output.status
        );
        let mut env = HashMap::new();
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if let Some((key, value)) = line.strip_prefix("export ").and_then(|l| l.split_once('='))
            {
                env.insert(key.to_owned(), value.trim_matches(['"', '\'']).to_owned());
            }
        }
        assert!(
            env.contains_key("KUBECONFIG"),
            "e2e/cluster up printed no KUBECONFIG"
        );
        eprintln!("cluster up in {:?}", started.elapsed());
        Cluster { base, env }
    }

    /// Path of the admin kubeconfig.
    pub fn kubeconfig(&self) -> &str {
        &self.env["KUBECONFIG"]
    }

    /// The folder holding kubectl and helm.
    pub fn bin(&self) -> PathBuf {
        PathBuf::from(&self.env["TARGETLEASE_E2E_BIN"])
    }

    /// Environment for processes that talk to the cluster.
    pub fn envs(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = self
            .env
            .iter()
            .filter(|(k, _)| k.as_str() != "PATH")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let path = format!(
            "{}:{}",
            self.bin().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        env.push(("PATH".into(), path));
        env
    }

    /// Runs kubectl with `args`.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_with_input(args, None)
    }

    /// Runs kubectl with `args` and `input` on stdin.
    pub fn kubectl_with_input(&self, args: &[&str], input: Option<&str>) -> Output {
        let mut child = Command::new(self.bin().join("kubectl"))
            .args(args)
            .envs(self.envs())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kubectl");
        if let Some(text) = input {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(text.as_bytes())
                .expect("write stdin");
        } else {
            drop(child.stdin.take());
        }
        child.wait_with_output().expect("kubectl output")
    }

    /// Runs kubectl and panics unless it succeeds; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Applies YAML and panics unless it succeeds.
    pub fn apply(&self, yaml: &str) {
        let out = self.kubectl_with_input(&["apply", "-f", "-"], Some(yaml));
        assert!(
            out.status.success(),
            "kubectl apply failed: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A client with the admin credentials.
    pub async fn client(&self) -> kube::Client {
        let kubeconfig = Kubeconfig::read_from(self.kubeconfig()).expect("read kubeconfig");
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .expect("kubeconfig");
        kube::Client::try_from(config).expect("client")
    }

    /// Installs the CRD from `crds/` and waits until it is established.
    pub fn install_crd(&self) {
        let path = repo().join("crds/targetlease.dev_targetleases.yaml");
        self.kubectl_ok(&["apply", "--server-side", "-f", &path.display().to_string()]);
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=30s",
            "crd/targetleases.targetlease.dev",
        ]);
    }

    /// Restarts one component of the control plane (`kube-apiserver`, `etcd`, ...); `crash`
    /// kills it with SIGKILL instead of stopping it.
    pub fn restart(&self, component: &str, crash: bool) {
        let mut command = Command::new("bash");
        command
            .arg(repo().join("e2e/cluster"))
            .args(["restart", component])
            .env("TARGETLEASE_E2E_STATE", self.base.path().join("state"))
            .env("TARGETLEASE_E2E_DIR", self.base.path().join("cluster"))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if crash {
            command.arg("--kill");
        }
        let status = command.status().expect("run e2e/cluster restart");
        assert!(status.success(), "e2e/cluster restart {component} failed");
    }

    /// A folder for files of this test run.
    pub fn scratch(&self) -> &Path {
        self.base.path()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo().join("e2e/cluster"))
            .arg("down")
            .env("TARGETLEASE_E2E_STATE", self.base.path().join("state"))
            .env("TARGETLEASE_E2E_DIR", self.base.path().join("cluster"))
            .stdout(Stdio::null())
            .status();
    }
}

/// The controller binary, running against a cluster; killed on drop.
pub struct ControllerProcess {
    child: Child,
    /// Address of its HTTP endpoints.
    pub http: String,
    /// Its log file.
    pub log: PathBuf,
}

impl ControllerProcess {
    /// Starts `targetlease controller` with `args` and waits until `/readyz` answers 200.
    pub fn start(cluster: &Cluster, valkey_url: &str, args: &[&str]) -> ControllerProcess {
        let port = super::server::free_port();
        let http = format!("127.0.0.1:{port}");
        let log = cluster.scratch().join(format!("controller-{port}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_targetlease"))
            .arg("controller")
            .args(["--http-addr", &http])
            .args(args)
            .envs(cluster.envs())
            .env("TARGETLEASE_VALKEY_URL", valkey_url)
            .env("TARGETLEASE_LOG", "info,targetlease=debug")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .expect("start the controller");
        let mut process = ControllerProcess { child, http, log };
        process.wait_ready(Duration::from_secs(30));
        process
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some((200, _)) = http_get(&self.http, "/readyz") {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("controller exited with {status}:\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "controller not ready:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The log so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait for the exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        self.child.wait().expect("wait for the controller")
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A plain HTTP/1.0 GET on loopback: (status, body).
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}
