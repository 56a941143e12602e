//! What the chart's suites share (`tests/packaging/chart.rs`, static; `tests/packaging/chart_cluster.rs`, on a
//! control plane): the release they work with, helm/kubectl/kstatus from the e2e build, YAML
//! helpers, the RBAC rules the chart must grant, and the Argo CD health check run with Lua 5.1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::{Value, json};

use crate::kube::{e2e_bin, repo, run_with_input};

/// The release every cluster test works with.
pub const RELEASE: &str = "targetlease";
/// Its namespace, labelled to enforce the restricted Pod Security Standard.
pub const RELEASE_NS: &str = "targetlease-system";
/// The chart's full name for RELEASE (the release name contains the chart name): the name of
/// its ServiceAccount, ClusterRole, Deployment, ...
pub const FULLNAME: &str = "targetlease";
/// The leader-election Lease the chart's Role allows.
pub const ELECTION_LEASE: &str = "targetlease-controller";
pub const CRD: &str = "targetleases.targetlease.dev";

/// The name of the release's ClusterRole and ClusterRoleBinding: the full name and the release
/// namespace, so two releases of one name in two namespaces never share them.
pub fn cluster_role() -> String {
    format!("{FULLNAME}-{RELEASE_NS}")
}
pub const SEC: Duration = Duration::from_secs(1);

pub fn chart_dir() -> PathBuf {
    repo().join("charts/targetlease")
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The YAML files of a folder, sorted.
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// Every document of a multi-document YAML text, as JSON values (empty documents dropped).
pub fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let value: serde_yaml::Value = serde::Deserialize::deserialize(doc).expect("YAML");
            serde_json::to_value(value).expect("YAML as JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// The versions a CustomResourceDefinition marks for storage (one, in a CRD the API server took).
pub fn storage_versions(crd: &Value) -> Vec<String> {
    crd["spec"]["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["storage"] == true)
        .filter_map(|v| v["name"].as_str().map(str::to_owned))
        .collect()
}

/// The storage versions of the TargetLease CRD in what `helm upgrade --dry-run=server
/// --output=json` printed: what an upgrade would apply.
pub fn dry_run_storage_versions(release_json: &str) -> Vec<String> {
    let release: Value = serde_json::from_str(release_json).expect("helm's release JSON");
    let rendered = documents(
        release["manifest"]
            .as_str()
            .expect("the release's manifest"),
    );
    storage_versions(object(&rendered, "CustomResourceDefinition", CRD))
}

/// How many TargetLeases `targetlease migrate-storage` says it re-encoded (`rewrote N
/// TargetLeases as ...`); panics, quoting it, when it says no rewrite ran.
pub fn migrate_rewrote(said: &str) -> usize {
    said.strip_prefix("rewrote ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("migrate-storage ran no rewrite: {said}"))
}

/// The objects of `kind`.
pub fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The one object of `kind` named `name`.
pub fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let have: Vec<String> = docs
                .iter()
                .map(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]))
                .collect();
            panic!("no {kind} {name} among {have:?}")
        })
}

pub fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The rules the controller needs, exactly (docs/reference/rbac.md explains each).
pub fn controller_rules() -> Value {
    json!([
        {"apiGroups": ["targetlease.dev"], "resources": ["targetleases"], "verbs": ["list", "watch", "patch"]},
        {"apiGroups": ["targetlease.dev"], "resources": ["targetleases/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["targetlease-installation"], "verbs": ["get"]},
    ])
}

/// The rules of the workload Role in `examples/rbac.yaml` (what `targetlease run` and `wait`
/// need), which the chart's `helm test` Role must equal.
pub fn workload_rules() -> Value {
    let text = std::fs::read_to_string(repo().join("examples/rbac.yaml")).expect("rbac.yaml");
    let docs = documents(&text);
    let roles = of_kind(&docs, "Role");
    assert_eq!(roles.len(), 1, "examples/rbac.yaml has one Role");
    roles[0]["rules"].clone()
}

pub fn election_rules(lease: &str) -> Value {
    json!([
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [lease], "verbs": ["get", "update"]},
    ])
}

/// promtool, unpacked from Debian's prometheus package by `scripts/install-test-deps.sh` into
/// `$TARGETLEASE_CACHE_DIR/promtool/bin` (default `~/.cache/targetlease`).
pub fn promtool() -> PathBuf {
    let cache = std::env::var_os("TARGETLEASE_CACHE_DIR").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/targetlease"),
        PathBuf::from,
    );
    let promtool = cache.join("promtool/bin/promtool");
    assert!(
        promtool.exists(),
        "{} is missing: run scripts/install-test-deps.sh",
        promtool.display()
    );
    promtool
}

// ------------------------------------------------------------------------------------ tools --

/// helm, kubectl and kstatus from the e2e build, with helm's folders in a temporary directory.
pub struct Tools {
    bin: PathBuf,
    home: tempfile::TempDir,
}

impl Tools {
    pub fn load() -> Tools {
        Tools {
            bin: e2e_bin(),
            home: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn command(&self, tool: &str) -> Command {
        let mut command = Command::new(self.bin.join(tool));
        let home = self.home.path();
        command
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            // Nothing here may talk to a cluster.
            .env("KUBECONFIG", home.join("no-kubeconfig"));
        command
    }

    pub fn helm(&self, args: &[&str]) -> Output {
        let mut command = self.command("helm");
        command.args(args);
        run_with_input(command, None)
    }

    /// `helm template` of the chart as RELEASE in RELEASE_NS with `extra` arguments.
    pub fn render(&self, extra: &[&str]) -> Result<Vec<Value>, String> {
        let chart = chart_dir().display().to_string();
        let mut args = vec!["template", RELEASE, chart.as_str(), "-n", RELEASE_NS];
        args.extend_from_slice(extra);
        let out = self.helm(&args);
        if out.status.success() {
            Ok(documents(&stdout(&out)))
        } else {
            Err(stderr(&out))
        }
    }

    pub fn render_ok(&self, extra: &[&str]) -> Vec<Value> {
        self.render(extra)
            .unwrap_or_else(|e| panic!("helm template {extra:?} failed: {e}"))
    }

    /// kstatus of one object: (status, message).
    pub fn kstatus(&self, object: &Value) -> (String, String) {
        let mut command = self.command("kstatus");
        command.args(["-o", "json", "-"]);
        let out = run_with_input(command, Some(&object.to_string()));
        assert!(out.status.success(), "kstatus failed: {}", stderr(&out));
        let result: Value = serde_json::from_str(&stdout(&out)).expect("kstatus JSON");
        (
            result["status"].as_str().unwrap_or_default().to_owned(),
            result["message"].as_str().unwrap_or_default().to_owned(),
        )
    }
}

// --------------------------------------------------------------------- Argo CD health (Lua) --

/// A JSON value as a Lua 5.1 table constructor (what Argo CD's gopher-lua hands the script).
pub fn lua_literal(value: &Value) -> String {
    match value {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => lua_string(s),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(lua_literal).collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("[{}] = {}", lua_string(k), lua_literal(v)))
                .collect();
            format!("{{{}}}", fields.join(", "))
        }
    }
}

pub fn lua_string(s: &str) -> String {
    let mut out = String::from("\"");
    for byte in s.bytes() {
        match byte {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b' '..=b'~' => out.push(byte as char),
            _ => out.push_str(&format!("\\{byte}")),
        }
    }
    out.push('"');
    out
}

/// Runs docs/gitops/argocd-health.lua on `object` with lua5.1: (status, message).
pub fn argocd_health(object: &Value) -> (String, String) {
    let script = repo().join("docs/gitops/argocd-health.lua");
    let dir = tempfile::tempdir().expect("temp dir");
    let driver = dir.path().join("driver.lua");
    std::fs::write(
        &driver,
        format!(
            "local check = assert(loadfile({}))\nobj = {}\nlocal hs = check()\nio.write(tostring(hs.status), \"\\t\", tostring(hs.message))\n",
            lua_string(&script.display().to_string()),
            lua_literal(object)
        ),
    )
    .expect("write the Lua driver");
    let out = Command::new("lua5.1")
        .arg(&driver)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run lua5.1 ({e}); scripts/install-test-deps.sh installs it")
        });
    assert!(out.status.success(), "lua5.1 failed: {}", stderr(&out));
    let text = stdout(&out);
    let (status, message) = text.split_once('\t').expect("status<TAB>message");
    (status.to_owned(), message.to_owned())
}
