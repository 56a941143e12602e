//! A real Kubernetes control plane for the tests (`e2e/cluster up`), the controller binary run
//! against it as a child process, and helpers to read TargetLeases.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kube::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::await_condition;
use targetlease::api::{Condition, Phase, TargetLease};

/// The repository root. Cargo names it at run time (`CARGO_MANIFEST_DIR` of the package whose
/// tests or benchmarks run): this crate's compile-time path can name another clone that shared
/// the build cache, since Cargo does not rebuild a path dependency that merely moved.
pub fn repo() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .filter(|dir| dir.join("Cargo.lock").is_file())
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")))
}

/// Builds the Go program in the repository folder `package` into `out` with the Go that
/// `e2e/build.sh` uses (on PATH, else where the Go tarball installs itself); panics naming
/// `what` when Go is missing or the build fails.
pub fn go_build(package: &str, out: &Path, what: &str) {
    go_build_in(package, ".", out, what);
}

/// [`go_build`] of the package `target` as the Go module in the repository folder `module`
/// pins it (a `tool` of its go.mod: a program of another module, at the version written there).
pub fn go_build_in(module: &str, target: &str, out: &Path, what: &str) {
    let go = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("go"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("/usr/local/go/bin/go"));
    let status = Command::new(go)
        .args(["build", "-o"])
        .arg(out)
        .arg(target)
        .current_dir(repo().join(module))
        .status()
        .unwrap_or_else(|e| panic!("go is not installed ({what} is a Go program): {e}"));
    assert!(status.success(), "building {target} in {module} failed");
}

/// The `targetlease` binary of the build that runs the current test or benchmark: Cargo puts a
/// package's binaries next to the `deps/` folder that holds its test executables (debug for
/// tests, release for benchmarks). `TARGETLEASE_BIN` overrides it.
pub fn targetlease_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("TARGETLEASE_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable lives in <target>/<profile>/deps");
    let bin = profile_dir.join("targetlease");
    assert!(
        bin.exists(),
        "{} is missing: run the suite through cargo, which builds it",
        bin.display()
    );
    bin
}

/// The folder of the e2e binaries (kubectl, helm, kstatus, ...): `e2e/build.sh` builds them when
/// they are missing (a no-op when they are there) and prints the folder. Panics when it fails.
pub fn e2e_bin() -> PathBuf {
    let output = Command::new("bash")
        .arg(repo().join("e2e/build.sh"))
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("run e2e/build.sh");
    assert!(
        output.status.success(),
        "e2e/build.sh failed ({}); see its messages above",
        output.status
    );
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    for tool in ["kubectl", "helm", "kstatus"] {
        assert!(
            dir.join(tool).is_file(),
            "e2e/build.sh printed {} but it has no {tool}",
            dir.display()
        );
    }
    dir
}

/// Runs `command` with `input` on stdin (or a closed stdin) and returns its output.
pub fn run_with_input(mut command: Command, input: Option<&str>) -> Output {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", command.get_program()));
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
    child.wait_with_output().expect("command output")
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
        Self::start_with(&[])
    }

    /// Brings a cluster up with a node (`e2e/cluster up --node`: scheduler, containerd,
    /// kubelet, kube-proxy): pods really run. One node per machine at a time.
    pub fn start_with_node() -> Cluster {
        Self::start_with(&["--node"])
    }

    fn start_with(options: &[&str]) -> Cluster {
        let base = tempfile::tempdir().expect("temp dir");
        let started = Instant::now();
        let output = Command::new("bash")
            .arg(repo().join("e2e/cluster"))
            .args(["up", "--owner-pid", &std::process::id().to_string()])
            .args(options)
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

    /// The API server's port on loopback, from the admin kubeconfig.
    pub fn apiserver_port(&self) -> u16 {
        let config = std::fs::read_to_string(self.kubeconfig()).expect("read the kubeconfig");
        config
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: https://127.0.0.1:"))
            .and_then(|p| p.trim().parse().ok())
            .expect("the kubeconfig names https://127.0.0.1:PORT")
    }

    /// A copy of the admin kubeconfig that reaches the API server through loopback `port` (a
    /// proxy; the server's certificate names 127.0.0.1, so TLS still verifies).
    pub fn kubeconfig_via(&self, port: u16) -> PathBuf {
        let config = std::fs::read_to_string(self.kubeconfig()).expect("read the kubeconfig");
        let direct = format!("server: https://127.0.0.1:{}", self.apiserver_port());
        let path = self.scratch().join(format!("kubeconfig-via-{port}"));
        std::fs::write(
            &path,
            config.replace(&direct, &format!("server: https://127.0.0.1:{port}")),
        )
        .expect("write the kubeconfig");
        path
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
        self.tool(self.kubeconfig(), "kubectl", args, input)
    }

    /// Runs a tool of the e2e build (kubectl, helm, kstatus) with `args`, `input` on stdin and
    /// the credentials of `kubeconfig`.
    pub fn tool(&self, kubeconfig: &str, tool: &str, args: &[&str], input: Option<&str>) -> Output {
        let mut command = Command::new(self.bin().join(tool));
        command
            .args(args)
            .envs(self.envs())
            .env("KUBECONFIG", kubeconfig);
        run_with_input(command, input)
    }

    /// Runs kubectl with the credentials of `kubeconfig` (e.g. a ServiceAccount's).
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str]) -> Output {
        self.tool(&kubeconfig.display().to_string(), "kubectl", args, None)
    }

    /// Runs helm with `args` as the admin.
    pub fn helm(&self, args: &[&str]) -> Output {
        self.tool(self.kubeconfig(), "helm", args, None)
    }

    /// Writes a kubeconfig that authenticates as ServiceAccount `namespace/name` with a fresh
    /// token (`kubectl create token`), the admin kubeconfig's server and CA, and `namespace` as
    /// its default namespace. The token is never printed.
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> PathBuf {
        let token = self.kubectl_ok(&["create", "token", name, "-n", namespace, "--duration=2h"]);
        let admin: serde_yaml::Value = serde_yaml::from_str(
            &std::fs::read_to_string(self.kubeconfig()).expect("read the admin kubeconfig"),
        )
        .expect("parse the admin kubeconfig");
        let cluster = &admin["clusters"][0]["cluster"];
        let server = cluster["server"]
            .as_str()
            .expect("server in the kubeconfig");
        let ca = cluster["certificate-authority-data"]
            .as_str()
            .expect("certificate-authority-data in the kubeconfig");
        let config = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority-data": ca}}],
            "users": [{"name": name, "user": {"token": token.trim()}}],
            "contexts": [{"name": name, "context": {"cluster": "e2e", "user": name, "namespace": namespace}}],
            "current-context": name,
        });
        let path = self
            .scratch()
            .join(format!("{namespace}.{name}.kubeconfig"));
        std::fs::write(&path, serde_json::to_string(&config).expect("json")).expect("write");
        path
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

    /// `kubectl <args> -o json`, parsed; panics unless kubectl succeeds.
    pub fn kubectl_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl_ok(&all)).expect("kubectl printed JSON")
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

    /// Imports an OCI image tarball into the node's container runtime (`e2e/cluster
    /// import-image`): pods then run it without pulling.
    pub fn import_image(&self, tarball: &Path) {
        let output = Command::new("bash")
            .arg(repo().join("e2e/cluster"))
            .arg("import-image")
            .arg(tarball)
            .env("TARGETLEASE_E2E_STATE", self.base.path().join("state"))
            .env("TARGETLEASE_E2E_DIR", self.base.path().join("cluster"))
            .stdin(Stdio::null())
            .output()
            .expect("run e2e/cluster import-image");
        assert!(
            output.status.success(),
            "e2e/cluster import-image {} failed: {}",
            tarball.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// The node's InternalIP: where pods reach services of the host (Valkey in the tests).
    pub fn node_ip(&self) -> String {
        let ip = self.kubectl_ok(&[
            "get",
            "nodes",
            "-o",
            "jsonpath={.items[0].status.addresses[?(@.type==\"InternalIP\")].address}",
        ]);
        assert!(!ip.trim().is_empty(), "the node has no InternalIP");
        ip.trim().to_owned()
    }

    /// The chart settings of the node suites: images imported into the node (never pulled),
    /// Valkey's URL and password from the Secret `valkey` that [`Cluster::valkey_secret`] made.
    pub const NODE_CHART_SETTINGS: [&'static str; 6] = [
        "--set",
        "image.pullPolicy=Never",
        "--set",
        "valkey.existingSecret.name=valkey",
        "--set",
        "valkey.existingSecret.passwordKey=password",
    ];

    /// Creates the Secret `name` in `namespace` with the keys `url` and `password`, as the
    /// chart's `valkey.existingSecret` reads them. The password goes through a file, not the
    /// command line (argv is readable by every process, and kubectl_ok would print it in a
    /// failure).
    pub fn valkey_secret(&self, namespace: &str, name: &str, url: &str, password: &str) {
        let password_file = self.scratch().join(format!("{namespace}-{name}-password"));
        std::fs::write(&password_file, password).expect("password file");
        self.kubectl_ok(&[
            "create",
            "secret",
            "generic",
            name,
            "-n",
            namespace,
            &format!("--from-literal=url={url}"),
            &format!("--from-file=password={}", password_file.display()),
        ]);
    }

    /// A folder for files of this test run.
    pub fn scratch(&self) -> &Path {
        self.base.path()
    }

    /// The `apiVersion` etcd holds a TargetLease in: what the API server stored, whatever
    /// version a client reads it with. Asked from etcd's own HTTP gateway on loopback.
    pub fn stored_api_version(&self, namespace: &str, name: &str) -> String {
        let stored = self.etcd("range", &Self::etcd_key(namespace, name), None);
        stored["apiVersion"]
            .as_str()
            .expect("apiVersion")
            .to_owned()
    }

    /// Writes a TargetLease into etcd encoded as `api_version`, past the API server, as an API
    /// server that has not taken up a CRD's new storage version yet stores a write.
    pub fn store_as_api_version(&self, namespace: &str, name: &str, api_version: &str) {
        let key = Self::etcd_key(namespace, name);
        let mut stored = self.etcd("range", &key, None);
        stored["apiVersion"] = api_version.into();
        self.etcd("put", &key, Some(&stored));
    }

    fn etcd_key(namespace: &str, name: &str) -> String {
        format!("/registry/targetlease.dev/targetleases/{namespace}/{name}")
    }

    /// One call of etcd's HTTP gateway on loopback: `range` (the JSON object at `key`) or
    /// `put` (`value` at `key`; answers Null).
    fn etcd(&self, call: &str, key: &str, value: Option<&serde_json::Value>) -> serde_json::Value {
        let ports = std::fs::read_to_string(self.base.path().join("cluster/ports"))
            .expect("read the cluster's ports file");
        let port = ports
            .lines()
            .find_map(|l| l.strip_prefix("etcd="))
            .expect("the ports file names etcd");
        let mut body = serde_json::json!({ "key": BASE64.encode(key.as_bytes()) });
        if let Some(value) = value {
            body["value"] = BASE64.encode(value.to_string().as_bytes()).into();
        }
        let out = Command::new("curl")
            .args([
                "-sf",
                "--max-time",
                "5",
                "-X",
                "POST",
                "-d",
                &body.to_string(),
            ])
            .arg(format!("http://127.0.0.1:{port}/v3/kv/{call}"))
            .output()
            .expect("run curl");
        assert!(out.status.success(), "etcd {call} of {key} failed");
        if value.is_some() {
            return serde_json::Value::Null;
        }
        let reply: serde_json::Value = serde_json::from_slice(&out.stdout).expect("etcd json");
        let value = reply["kvs"][0]["value"]
            .as_str()
            .unwrap_or_else(|| panic!("etcd holds no {key}: {reply}"));
        serde_json::from_slice(&BASE64.decode(value).expect("etcd base64"))
            .expect("a JSON-encoded object in etcd")
    }

    /// The process id of a control-plane component (`kube-apiserver`, `etcd`, ...) from the
    /// pid file `e2e/cluster` keeps (`PID STARTTIME NAME`); `None` when it is not running.
    /// Read it again after [`Cluster::restart`]: the component then has a new pid.
    pub fn pid(&self, component: &str) -> Option<u32> {
        let path = self
            .base
            .path()
            .join("cluster/pids")
            .join(format!("{component}.pid"));
        let text = std::fs::read_to_string(path).ok()?;
        text.split_whitespace().next()?.parse().ok()
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
        Self::start_as(cluster, Path::new(cluster.kubeconfig()), valkey_url, args)
    }

    /// Like [`ControllerProcess::start`], with the credentials of `kubeconfig`.
    pub fn start_as(
        cluster: &Cluster,
        kubeconfig: &Path,
        valkey_url: &str,
        args: &[&str],
    ) -> ControllerProcess {
        Self::start_with(cluster, kubeconfig, valkey_url, args, &[])
    }

    /// Like [`ControllerProcess::start`], with extra environment variables (applied last, so
    /// they can replace the debug log filter the tests use; a filter must keep
    /// `targetlease::cli::controller` at info, whose start-up line says the controller serves).
    pub fn start_with_env(
        cluster: &Cluster,
        valkey_url: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> ControllerProcess {
        Self::start_with(
            cluster,
            Path::new(cluster.kubeconfig()),
            valkey_url,
            args,
            env,
        )
    }

    /// Like [`ControllerProcess::start`], with the credentials of `kubeconfig` (a proxy's, see
    /// [`Cluster::kubeconfig_via`]) and extra environment variables (applied last).
    pub fn start_with(
        cluster: &Cluster,
        kubeconfig: &Path,
        valkey_url: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> ControllerProcess {
        let mut all = vec![("TARGETLEASE_VALKEY_URL", valkey_url)];
        all.extend_from_slice(env);
        Self::start_reaching(cluster, kubeconfig, args, &all)
    }

    /// A controller that reaches the lease store as `args` and `env` say (no Valkey URL is
    /// set: `--valkey-sentinels`, `--valkey-cluster-seeds` or `TARGETLEASE_VALKEY_URL` in
    /// them), the API server as `kubeconfig` says.
    pub fn start_reaching(
        cluster: &Cluster,
        kubeconfig: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> ControllerProcess {
        // Another process may take the port `free_port` handed out before the controller
        // binds it: the controller then exits saying it cannot listen, and another is tried.
        super::server::on_other_ports("controller", 3, || {
            let port = super::server::free_port();
            let http = format!("127.0.0.1:{port}");
            let log = cluster.scratch().join(format!("controller-{port}.log"));
            let file = std::fs::File::create(&log).expect("log file");
            let child = Command::new(targetlease_bin())
                .arg("controller")
                .args(["--http-addr", &http])
                .args(args)
                .envs(cluster.envs())
                .env("KUBECONFIG", kubeconfig)
                .env("TARGETLEASE_LOG", "info,targetlease=debug")
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(file.try_clone().expect("log file"))
                .stderr(file)
                .spawn()
                .expect("start the controller");
            let mut process = ControllerProcess { child, http, log };
            let Err(status) = process.until_ready(Duration::from_secs(30)) else {
                return Ok(process);
            };
            let logs = process.logs();
            let why: Vec<&str> = logs
                .lines()
                .filter(|l| l.contains("cannot listen on"))
                .collect();
            if why.is_empty() {
                panic!("controller exited with {status}:\n{logs}");
            }
            Err(format!("it exited ({status}): {}", why.join("\n")))
        })
    }

    /// Waits until `/readyz` answers 200; panics when the controller exits or after `limit`.
    pub fn wait_ready(&mut self, limit: Duration) {
        if let Err(status) = self.until_ready(limit) {
            panic!("controller exited with {status}:\n{}", self.logs());
        }
    }

    /// Waits until `/readyz` answers 200 from this controller (its log says it serves on that
    /// address: another process's server on a port both drew is not taken for it): `Err` when
    /// it exits first; panics after `limit`.
    fn until_ready(&mut self, limit: Duration) -> Result<(), std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        let serving = format!("serving probes and metrics on {}", self.http);
        loop {
            if let Some((200, _)) = http_get(&self.http, "/readyz")
                && self.logs().contains(&serving)
            {
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(status);
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

/// The sum of the samples of `series` in a Prometheus text page: a metric name (every label set
/// counts) or a name with its full label set (one sample). 0 when there is none.
pub fn metric(page: &str, series: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(series)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        // Not `sum()`: an empty f64 sum is -0.0, which prints as "-0".
        .fold(0.0, |total, sample| total + sample)
}

/// A TargetLease manifest; `extra` lines go under `spec`.
pub fn lease_yaml(ns: &str, name: &str, target: &str, holder: &str, extra: &str) -> String {
    let mut yaml = format!(
        "apiVersion: {}/{}\nkind: TargetLease\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  target: {target}\n  holder: {holder}\n",
        targetlease::api::GROUP,
        targetlease::api::VERSION
    );
    for line in extra.lines().filter(|l| !l.trim().is_empty()) {
        yaml.push_str("  ");
        yaml.push_str(line.trim_start());
        yaml.push('\n');
    }
    yaml
}

/// The phase in a TargetLease's status.
pub fn phase_of(lease: &TargetLease) -> Option<Phase> {
    lease.status.as_ref().map(|s| s.phase)
}

/// The fencing token in a TargetLease's status; panics when there is none.
pub fn token_of(lease: &TargetLease) -> u64 {
    lease
        .status
        .as_ref()
        .and_then(|s| s.fencing_token)
        .expect("a fencing token")
}

/// A condition of a TargetLease's status.
pub fn condition<'a>(lease: &'a TargetLease, type_: &str) -> Option<&'a Condition> {
    lease
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
}

/// Waits (by watch) up to `limit` until TargetLease `name` satisfies `pred`. `Err` tells why
/// not, with the last status seen.
pub async fn await_lease(
    api: &Api<TargetLease>,
    name: &str,
    what: &str,
    limit: Duration,
    pred: impl Fn(&TargetLease) -> bool + Send + 'static,
) -> Result<TargetLease, String> {
    let cond = move |obj: Option<&TargetLease>| obj.is_some_and(&pred);
    match tokio::time::timeout(limit, await_condition(api.clone(), name, cond)).await {
        Ok(Ok(Some(lease))) => Ok(lease),
        Ok(other) => Err(format!(
            "{name}: watch ended while waiting for {what}: {other:?}"
        )),
        Err(_) => {
            let now = api.get_opt(name).await.ok().flatten();
            Err(format!(
                "{name}: not {what} within {limit:?}; status: {:?}",
                now.and_then(|l| l.status)
            ))
        }
    }
}
