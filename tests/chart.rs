//! The Helm chart (`charts/targetlease`), the GitOps health checks and the examples.
//!
//! Static checks run helm (lint, template, the values schema) and Lua 5.1 (the Argo CD health
//! check). The rest runs on a real control plane (`e2e/cluster`): the chart installed into a
//! namespace enforcing the restricted Pod Security Standard, the controller binary run on the
//! host with the chart's ServiceAccount token (so the chart's RBAC is what it gets), `kubectl
//! auth can-i` as that ServiceAccount, kstatus on objects the controller wrote, upgrade and
//! uninstall. A missing tool or control plane fails the suite; it never skips.

use targetlease_test_support as support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};
use targetlease::api::{Phase, Reason, TargetLease, TargetLeaseStatus};
use targetlease::controller::status::Observed;
use targetlease::store::valkey::keys::TargetKeys;
use targetlease::store::{Grant, StoreError, TargetRef};

use support::kube::{
    Cluster, ControllerProcess, await_lease, condition, e2e_bin, lease_yaml, phase_of, repo,
    run_with_input, token_of,
};
use support::server::{Server, ServerKind};

/// The release every cluster test works with.
const RELEASE: &str = "targetlease";
/// Its namespace, labelled to enforce the restricted Pod Security Standard.
const RELEASE_NS: &str = "targetlease-system";
/// The chart's full name for RELEASE (the release name contains the chart name): the name of
/// its ServiceAccount, ClusterRole, Deployment, ...
const FULLNAME: &str = "targetlease";
/// The leader-election Lease the chart's Role allows.
const ELECTION_LEASE: &str = "targetlease-controller";
const CRD: &str = "targetleases.targetlease.dev";
const SEC: Duration = Duration::from_secs(1);

fn chart_dir() -> PathBuf {
    repo().join("charts/targetlease")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The YAML files of a folder, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// Every document of a multi-document YAML text, as JSON values (empty documents dropped).
fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let value: serde_yaml::Value = serde::Deserialize::deserialize(doc).expect("YAML");
            serde_json::to_value(value).expect("YAML as JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// The objects of `kind`.
fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The one object of `kind` named `name`.
fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
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

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The rules the controller needs, exactly (docs/install.md explains each).
fn controller_rules() -> Value {
    json!([
        {"apiGroups": ["targetlease.dev"], "resources": ["targetleases"], "verbs": ["list", "watch", "patch"]},
        {"apiGroups": ["targetlease.dev"], "resources": ["targetleases/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    ])
}

fn election_rules(lease: &str) -> Value {
    json!([
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [lease], "verbs": ["get", "update"]},
    ])
}

// ------------------------------------------------------------------------------------ tools --

/// helm, kubectl and kstatus from the e2e build, with helm's folders in a temporary directory.
struct Tools {
    bin: PathBuf,
    home: tempfile::TempDir,
}

impl Tools {
    fn new() -> Tools {
        Tools {
            bin: e2e_bin(),
            home: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn command(&self, tool: &str) -> Command {
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

    fn helm(&self, args: &[&str]) -> Output {
        let mut command = self.command("helm");
        command.args(args);
        run_with_input(command, None)
    }

    /// `helm template` of the chart as RELEASE in RELEASE_NS with `extra` arguments.
    fn render(&self, extra: &[&str]) -> Result<Vec<Value>, String> {
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

    fn render_ok(&self, extra: &[&str]) -> Vec<Value> {
        self.render(extra)
            .unwrap_or_else(|e| panic!("helm template {extra:?} failed: {e}"))
    }

    /// kstatus of one object: (status, message).
    fn kstatus(&self, object: &Value) -> (String, String) {
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
fn lua_literal(value: &Value) -> String {
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

fn lua_string(s: &str) -> String {
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
fn argocd_health(object: &Value) -> (String, String) {
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

// --------------------------------------------------------------------------- static tests --

fn lint_default_and_ci_values(tools: &Tools) {
    let chart = chart_dir().display().to_string();
    let out = tools.helm(&["lint", "--strict", &chart]);
    assert!(
        out.status.success(),
        "helm lint --strict (default values):\n{}{}",
        stdout(&out),
        stderr(&out)
    );
    tools.render_ok(&[]);
    let ci = yaml_files(&chart_dir().join("ci"));
    assert!(
        ci.len() >= 4,
        "charts/targetlease/ci has {} values files",
        ci.len()
    );
    for file in &ci {
        let file = file.display().to_string();
        let out = tools.helm(&["lint", "--strict", &chart, "-f", &file]);
        assert!(
            out.status.success(),
            "helm lint --strict -f {file}:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        let docs = tools.render_ok(&["-f", &file]);
        assert!(
            !of_kind(&docs, "Deployment").is_empty(),
            "{file}: no Deployment"
        );
    }
}

fn default_render_is_hardened_and_least_privilege(tools: &Tools) {
    let docs = tools.render_ok(&[]);
    let kinds: BTreeSet<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    let expected: BTreeSet<&str> = [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
    ]
    .into();
    assert_eq!(kinds, expected);

    let deploy = object(&docs, "Deployment", FULLNAME);
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], FULLNAME);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    let args = strings(&c["args"]);
    for arg in [
        "controller",
        "--leader-election",
        &format!("--leader-election-name={ELECTION_LEASE}"),
        "--http-addr=0.0.0.0:8080",
    ] {
        assert!(args.iter().any(|a| a == arg), "args lack {arg}: {args:?}");
    }
    assert!(
        !args.iter().any(|a| a.starts_with("--watch-namespace")),
        "{args:?}"
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    let env = c["env"].as_array().expect("env");
    let var = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no env {name}"))
    };
    assert_eq!(
        var("POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        var("POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    let url = &var("TARGETLEASE_VALKEY_URL")["valueFrom"]["secretKeyRef"];
    assert_eq!(url["name"], format!("{FULLNAME}-valkey"));
    assert_eq!(url["key"], "url");
    assert!(
        !env.iter().any(|e| e["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("TARGETLEASE_VALKEY_TLS"))),
        "TLS variables without valkey.tls"
    );
    assert_eq!(c["ports"][0]["containerPort"], 8080);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "http");
    assert!(c["resources"]["requests"]["memory"].is_string());

    // RBAC: exact rules; leader election in a Role in the release namespace.
    assert_eq!(
        object(&docs, "ClusterRole", FULLNAME)["rules"],
        controller_rules()
    );
    let binding = object(&docs, "ClusterRoleBinding", FULLNAME);
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NS}])
    );
    let election = object(&docs, "Role", &format!("{FULLNAME}-leader-election"));
    assert_eq!(election["metadata"]["namespace"], RELEASE_NS);
    assert_eq!(election["rules"], election_rules(ELECTION_LEASE));
    assert_eq!(
        of_kind(&docs, "ClusterRole").len(),
        1,
        "only one ClusterRole"
    );
    for doc in &docs {
        let rules = doc["rules"].as_array().cloned().unwrap_or_default();
        for rule in rules {
            let text = rule.to_string();
            assert!(!text.contains('*'), "wildcard in {}: {text}", doc["kind"]);
            assert!(
                !text.contains("secrets"),
                "secrets in {}: {text}",
                doc["kind"]
            );
        }
    }

    // The CRD is kept on uninstall; the PodDisruptionBudget keeps one replica.
    let crd = object(&docs, "CustomResourceDefinition", CRD);
    assert_eq!(
        crd["metadata"]["annotations"]["helm.sh/resource-policy"],
        "keep"
    );
    assert_eq!(
        object(&docs, "PodDisruptionBudget", FULLNAME)["spec"]["minAvailable"],
        1
    );

    // crds.keep=false drops the annotation; crds.enabled=false drops the CRD.
    let docs = tools.render_ok(&["--set", "crds.keep=false"]);
    let crd = object(&docs, "CustomResourceDefinition", CRD);
    assert!(crd["metadata"]["annotations"].is_null(), "{crd}");
    let docs = tools.render_ok(&["--set", "crds.enabled=false"]);
    assert!(of_kind(&docs, "CustomResourceDefinition").is_empty());
}

fn ci_values_render_what_they_ask_for(tools: &Tools) {
    let ci = chart_dir().join("ci");
    let file = |name: &str| ci.join(name).display().to_string();

    // One watched namespace: a Role there instead of the ClusterRole.
    let docs = tools.render_ok(&["-f", &file("namespaced-values.yaml")]);
    assert!(of_kind(&docs, "ClusterRole").is_empty());
    assert!(of_kind(&docs, "ClusterRoleBinding").is_empty());
    assert!(of_kind(&docs, "CustomResourceDefinition").is_empty());
    let role = object(&docs, "Role", FULLNAME);
    assert_eq!(role["metadata"]["namespace"], "team-a");
    assert_eq!(role["rules"], controller_rules());
    assert_eq!(
        object(&docs, "RoleBinding", FULLNAME)["metadata"]["namespace"],
        "team-a"
    );
    let deploy = object(&docs, "Deployment", FULLNAME);
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert!(strings(&c["args"]).contains(&"--watch-namespace=team-a".to_owned()));
    assert!(
        of_kind(&docs, "Secret").is_empty(),
        "existingSecret: no chart Secret"
    );

    // Every Valkey value: ACL user, password, cluster seeds, TLS mount, durability.
    let docs = tools.render_ok(&["-f", &file("hardened-valkey-values.yaml")]);
    let pod = &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let env: Vec<(String, Value)> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (e["name"].as_str().unwrap_or_default().to_owned(), e.clone()))
        .collect();
    let value = |name: &str| {
        env.iter()
            .find(|(n, _)| n == name)
            .map(|(_, e)| e["value"].clone())
            .unwrap_or_else(|| panic!("no env {name}"))
    };
    assert_eq!(value("TARGETLEASE_VALKEY_USERNAME"), "targetlease");
    assert_eq!(
        value("TARGETLEASE_VALKEY_CLUSTER_SEEDS"),
        "valkey-0.valkey-headless:6379,valkey-1.valkey-headless:6379,valkey-2.valkey-headless:6379"
    );
    assert_eq!(
        value("TARGETLEASE_VALKEY_TLS_CA_FILE"),
        "/etc/targetlease/valkey-tls/ca.crt"
    );
    assert_eq!(
        value("TARGETLEASE_VALKEY_TLS_KEY_FILE"),
        "/etc/targetlease/valkey-tls/tls.key"
    );
    assert_eq!(value("TARGETLEASE_VALKEY_DURABILITY"), "replicas=1");
    assert_eq!(value("TARGETLEASE_VALKEY_KEY_PREFIX"), "prod-tl");
    assert!(
        !env.iter().any(|(n, _)| n == "TARGETLEASE_VALKEY_URL"),
        "a URL and cluster seeds exclude each other"
    );
    let password = env
        .iter()
        .find(|(n, _)| n == "TARGETLEASE_VALKEY_PASSWORD")
        .map(|(_, e)| e["valueFrom"]["secretKeyRef"].clone())
        .expect("password from the Secret");
    assert_eq!(
        password,
        json!({"name": "valkey-credentials", "key": "password"})
    );
    assert_eq!(
        c["volumeMounts"][0]["mountPath"],
        "/etc/targetlease/valkey-tls"
    );
    assert_eq!(c["volumeMounts"][0]["readOnly"], true);
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"],
        "valkey-client-tls"
    );

    // One replica on the memory backend: no election, no PDB, no Valkey Secret.
    let docs = tools.render_ok(&["-f", &file("single-replica-memory-values.yaml")]);
    let deploy = object(&docs, "Deployment", FULLNAME);
    assert_eq!(deploy["spec"]["replicas"], 1);
    let args = strings(&deploy["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(args.contains(&"--backend=memory".to_owned()), "{args:?}");
    assert!(!args.contains(&"--leader-election".to_owned()), "{args:?}");
    assert!(of_kind(&docs, "PodDisruptionBudget").is_empty());
    assert!(of_kind(&docs, "Secret").is_empty());
    assert!(of_kind(&docs, "Role").is_empty(), "no leader-election Role");

    // Everything optional switched on.
    let docs = tools.render_ok(&["-f", &file("full-values.yaml")]);
    let monitor = object(&docs, "ServiceMonitor", FULLNAME);
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "http");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    let policy = object(&docs, "NetworkPolicy", FULLNAME);
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    assert_eq!(policy["spec"]["egress"].as_array().map(Vec::len), Some(3));
    let pod = &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"];
    assert!(
        pod["containers"][0]["image"]
            .as_str()
            .is_some_and(|i| i.contains("@sha256:")),
        "digest wins over the tag"
    );
    assert_eq!(pod["serviceAccountName"], "targetlease-controller");
    assert_eq!(pod["priorityClassName"], "system-cluster-critical");
    assert_eq!(pod["tolerations"][0]["key"], "dedicated");
    assert_eq!(pod["nodeSelector"]["kubernetes.io/os"], "linux");
    let spread = &pod["topologySpreadConstraints"][0];
    assert_eq!(spread["topologyKey"], "topology.kubernetes.io/zone");
    assert_eq!(
        spread["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"], RELEASE,
        "the chart fills in the spread's labelSelector"
    );
    assert_eq!(
        object(&docs, "PodDisruptionBudget", FULLNAME)["spec"]["minAvailable"],
        2
    );
    assert_eq!(
        object(&docs, "ClusterRoleBinding", FULLNAME)["subjects"][0]["name"],
        "targetlease-controller"
    );
}

fn schema_refuses_bad_values(tools: &Tools) {
    let files = yaml_files(&repo().join("tests/chart/bad-values"));
    assert!(files.len() >= 5, "only {} bad values files", files.len());
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read");
        let expect = text
            .lines()
            .find_map(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} has no `# expect:` line", file.display()));
        let path = file.display().to_string();
        match tools.render(&["-f", &path]) {
            Ok(_) => panic!("{path}: accepted"),
            Err(message) => assert!(
                message.contains(expect),
                "{path}: the message does not say {expect:?}:\n{message}"
            ),
        }
    }
}

fn chart_crd_matches_crds_dir(tools: &Tools) {
    let docs = tools.render_ok(&["--set", "crds.enabled=true"]);
    let mut rendered = object(&docs, "CustomResourceDefinition", CRD).clone();
    // The chart adds its labels and the keep annotation; everything else must be identical.
    let meta = rendered["metadata"].as_object_mut().expect("metadata");
    meta.remove("labels");
    meta.remove("annotations");
    let committed = documents(
        &std::fs::read_to_string(repo().join("crds/targetlease.dev_targetleases.yaml"))
            .expect("read crds/"),
    );
    assert_eq!(committed.len(), 1);
    assert!(
        rendered == committed[0],
        "charts/targetlease/templates/crd.yaml differs from crds/targetlease.dev_targetleases.yaml: \
         run `cargo run -- crd --chart > charts/targetlease/templates/crd.yaml`"
    );
}

fn chart_versions_match_the_crate() {
    let chart: Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart_dir().join("Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("parse Chart.yaml");
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    assert!(
        chart["kubeVersion"].is_string(),
        "Chart.yaml lacks kubeVersion"
    );
    let values = std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml");
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    let image = format!(
        "ghcr.io/targetlease/targetlease:{}",
        env!("CARGO_PKG_VERSION")
    );
    assert!(values.contains("repository: ghcr.io/targetlease/targetlease"));
    assert!(
        dockerfile.contains(&image),
        "Dockerfile does not name {image}"
    );
    assert!(
        dockerfile.contains("USER 65532:65532"),
        "the image runs as non-root"
    );
}

/// A TargetLease object as the API server returns it, with `status` (generation 1).
fn sample(status: Option<TargetLeaseStatus>) -> Value {
    let mut object = json!({
        "apiVersion": "targetlease.dev/v1alpha1",
        "kind": "TargetLease",
        "metadata": {"name": "sample", "namespace": "shop", "generation": 1, "uid": "u-1"},
        "spec": {"target": "orders-db/migration", "holder": "worker-7", "ttlSeconds": 30},
    });
    if let Some(status) = status {
        object["status"] = serde_json::to_value(status).expect("status");
    }
    object
}

/// One sample per row of docs/gitops.md's table: (what, object, Argo CD health, a word its
/// message must contain, kstatus).
fn gitops_samples() -> Vec<(
    &'static str,
    Value,
    &'static str,
    &'static str,
    &'static str,
)> {
    let now = Timestamp::now();
    let token = 1_764_423_912_004_117u64;
    let grant = Grant {
        token,
        acquired_at_ms: 1_764_423_912_004,
        server_time_ms: 1_764_423_912_004,
        expires_in_ms: 30_000,
    };
    // The statuses the controller writes, made by its own code.
    let held = Observed::held(&grant, "worker-7").into_status(Some(1), None, now);
    let waiting = Observed::waiting("worker-3", None).into_status(Some(1), None, now);
    let released = Observed::released(
        Reason::ReleaseRequested,
        "spec.release is true".into(),
        Some(token),
    )
    .into_status(Some(1), None, now);
    let lost = Observed::lost(Reason::Expired, "the lease expired".into(), Some(token))
        .into_status(Some(1), None, now);
    let corrupt = StoreError::Corrupt {
        detail: "lease key has the wrong type".into(),
    };
    let failed = Observed::store_failed(Some(&held), &corrupt, now).into_status(Some(1), None, now);
    let down = StoreError::Unavailable {
        endpoint: "valkey:6379".into(),
        cause: "connection refused".into(),
    };
    // The store down a second after the grant, and past the published expiry: Held still, then
    // Lost with the Held condition Unknown.
    let granted = Timestamp::from_millisecond(1_764_423_912_004).expect("time");
    let soon = granted + jiff::SignedDuration::from_secs(1);
    let retrying =
        Observed::store_failed(Some(&held), &down, soon).into_status(Some(1), None, soon);
    let later = granted + jiff::SignedDuration::from_secs(31);
    let unknown =
        Observed::store_failed(Some(&held), &down, later).into_status(Some(1), None, later);
    // Pending as the controller writes it: the store failed before the first acquire.
    let pending = Observed::store_failed(None, &down, now).into_status(Some(1), None, now);

    let mut stale = sample(Some(held.clone()));
    stale["metadata"]["generation"] = json!(2);
    let mut deleting = sample(Some(held.clone()));
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-29T20:25:12Z");

    vec![
        // kstatus reads an object without any status as Current (a known gap: docs/gitops.md).
        (
            "no status",
            sample(None),
            "Progressing",
            "reconcile",
            "Current",
        ),
        (
            "Pending",
            sample(Some(pending)),
            "Progressing",
            "Pending",
            "InProgress",
        ),
        (
            "Waiting",
            sample(Some(waiting)),
            "Progressing",
            "held by worker-3",
            "InProgress",
        ),
        // The full 16-digit token, not Lua's %.14g rounding.
        (
            "Held",
            sample(Some(held)),
            "Healthy",
            "1764423912004117",
            "Current",
        ),
        (
            "Held, new generation",
            stale,
            "Progressing",
            "generation 2",
            "InProgress",
        ),
        (
            "Released",
            sample(Some(released)),
            "Healthy",
            "spec.release is true",
            "Current",
        ),
        (
            "Lost",
            sample(Some(lost)),
            "Degraded",
            "expired",
            "InProgress",
        ),
        (
            "Failed",
            sample(Some(failed)),
            "Degraded",
            "wrong type",
            "Failed",
        ),
        (
            "store down",
            sample(Some(retrying)),
            "Progressing",
            // The status names the failure, never Valkey's own words or address.
            "cannot be reached",
            "InProgress",
        ),
        (
            "store down past the expiry",
            sample(Some(unknown)),
            "Degraded",
            "may have expired",
            "InProgress",
        ),
        ("deleted", deleting, "Progressing", "deleted", "Terminating"),
    ]
}

fn argocd_health_of_sample_statuses() {
    for (what, object, want, needle, _) in gitops_samples() {
        let (status, message) = argocd_health(&object);
        assert_eq!(status, want, "{what}: {message}");
        assert!(
            message.contains(needle),
            "{what}: message {message:?} lacks {needle:?}"
        );
    }
}

fn kstatus_of_sample_statuses(tools: &Tools) {
    for (what, object, _, _, want) in gitops_samples() {
        let (status, message) = tools.kstatus(&object);
        assert_eq!(status, want, "{what}: {message}");
    }
}

fn examples_are_well_formed(tools: &Tools) {
    let examples = repo().join("examples");
    let mut kinds = BTreeSet::new();
    for file in yaml_files(&examples)
        .into_iter()
        .chain(yaml_files(&examples.join("gitops")))
    {
        let docs = documents(&std::fs::read_to_string(&file).expect("read"));
        assert!(!docs.is_empty(), "{}: empty", file.display());
        for doc in docs {
            assert!(
                doc["apiVersion"].is_string(),
                "{}: no apiVersion",
                file.display()
            );
            kinds.insert(format!(
                "{}/{}",
                doc["apiVersion"].as_str().unwrap_or(""),
                doc["kind"].as_str().unwrap_or("")
            ));
        }
    }
    for kind in [
        "argoproj.io/v1alpha1/Application",
        "kustomize.toolkit.fluxcd.io/v1/Kustomization",
        "source.toolkit.fluxcd.io/v1/GitRepository",
        "batch/v1/Job",
        "apps/v1/Deployment",
        "rbac.authorization.k8s.io/v1/Role",
    ] {
        assert!(
            kinds.contains(kind),
            "no {kind} among the examples: {kinds:?}"
        );
    }
    // The folder the GitOps tools apply builds with kustomize and holds TargetLeases only.
    let leases = examples.join("gitops/leases").display().to_string();
    let mut command = tools.command("kubectl");
    command.args(["kustomize", &leases]);
    let out = run_with_input(command, None);
    assert!(out.status.success(), "kubectl kustomize: {}", stderr(&out));
    let docs = documents(&stdout(&out));
    assert!(docs.len() >= 2);
    for doc in &docs {
        assert_eq!(doc["kind"], "TargetLease");
        assert_eq!(doc["metadata"]["namespace"], "shop");
    }
    // Both GitOps tools point at that folder.
    let app = documents(
        &std::fs::read_to_string(examples.join("gitops/argocd-application.yaml")).expect("read"),
    );
    assert_eq!(app[0]["spec"]["source"]["path"], "examples/gitops/leases");
    let flux = documents(
        &std::fs::read_to_string(examples.join("gitops/flux-kustomization.yaml")).expect("read"),
    );
    let kustomization = flux
        .iter()
        .find(|d| d["kind"] == "Kustomization")
        .expect("Kustomization");
    assert_eq!(kustomization["spec"]["path"], "./examples/gitops/leases");
}

// --------------------------------------------------------------------------- cluster tests --

/// The control plane with the chart installed and the controller running on the host as the
/// chart's ServiceAccount. Fields drop in order: the controller and Valkey before the cluster.
struct World {
    controller: Mutex<Option<ControllerProcess>>,
    valkey: Server,
    sa_kubeconfig: PathBuf,
    install: Output,
    install_took: Duration,
    /// From the start of `helm install` until the ReplicaSet had created both pods (None: not
    /// within 60 s).
    pods_admitted: Option<Duration>,
    cluster: Cluster,
}

impl World {
    fn start() -> World {
        let cluster = Cluster::start();
        cluster.kubectl_ok(&["create", "namespace", RELEASE_NS]);
        restrict(&cluster, RELEASE_NS);
        let chart = chart_dir().display().to_string();
        let started = Instant::now();
        let install = cluster.helm(&["install", RELEASE, &chart, "-n", RELEASE_NS]);
        let install_took = started.elapsed();
        assert!(
            install.status.success(),
            "helm install failed:\n{}{}",
            stdout(&install),
            stderr(&install)
        );
        let deadline = started + 60 * SEC;
        let pods_admitted = loop {
            if release_pods(&cluster, RELEASE_NS, RELEASE).len() == 2 {
                break Some(started.elapsed());
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        cluster.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=30s",
            &format!("crd/{CRD}"),
        ]);
        let sa_kubeconfig = cluster.service_account_kubeconfig(RELEASE_NS, FULLNAME);
        let valkey = Server::start(ServerKind::Valkey91);
        let controller =
            host_controller(&cluster, &sa_kubeconfig, &valkey, RELEASE_NS, RELEASE, &[]);
        World {
            controller: Mutex::new(Some(controller)),
            valkey,
            sa_kubeconfig,
            install,
            install_took,
            pods_admitted,
            cluster,
        }
    }

    /// Stops the host controller until the guard drops (then it starts again).
    fn pause_controller(&self) -> PausedController<'_> {
        if let Some(mut controller) = self.take_controller() {
            let status = controller.terminate();
            assert!(status.success(), "controller exit: {status}");
        }
        PausedController(self)
    }

    fn take_controller(&self) -> Option<ControllerProcess> {
        self.controller
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn controller_log(&self) -> String {
        self.controller
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|c| c.logs())
            .unwrap_or_default()
    }

    /// kubectl as the chart's ServiceAccount.
    fn kubectl_as_controller(&self, args: &[&str]) -> Output {
        self.cluster.kubectl_as(&self.sa_kubeconfig, args)
    }

    fn json(&self, args: &[&str]) -> Value {
        kubectl_json(&self.cluster, args)
    }

    /// A fresh namespace for one test.
    fn namespace(&self, name: &str) -> String {
        self.cluster.kubectl_ok(&["create", "namespace", name]);
        name.to_owned()
    }
}

/// Restarts the host controller when dropped.
struct PausedController<'a>(&'a World);

impl Drop for PausedController<'_> {
    fn drop(&mut self) {
        let world = self.0;
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            host_controller(
                &world.cluster,
                &world.sa_kubeconfig,
                &world.valkey,
                RELEASE_NS,
                RELEASE,
                &[],
            )
        }));
        match started {
            Ok(controller) => {
                *world.controller.lock().unwrap_or_else(|e| e.into_inner()) = Some(controller);
            }
            Err(panic) => eprintln!(
                "could not restart the host controller: {}",
                panic_message(&*panic)
            ),
        }
    }
}

/// `targetlease controller` on the host with a release's ServiceAccount kubeconfig, electing a
/// leader the way the chart's pods do (its Lease in the release namespace); `extra` flags last.
fn host_controller(
    cluster: &Cluster,
    kubeconfig: &Path,
    valkey: &Server,
    release_ns: &str,
    release: &str,
    extra: &[&str],
) -> ControllerProcess {
    let lease = election_lease(release);
    let identity = format!("host-{release}");
    let mut args = vec![
        "--leader-election",
        "--leader-election-namespace",
        release_ns,
        "--leader-election-name",
        lease.as_str(),
        "--leader-election-seconds",
        "5",
        "--identity",
        identity.as_str(),
    ];
    args.extend_from_slice(extra);
    ControllerProcess::start_as(cluster, kubeconfig, &valkey.url(), &args)
}

/// The chart's full name for `release` (what _helpers.tpl computes).
fn fullname(release: &str) -> String {
    if release.contains("targetlease") {
        release.to_owned()
    } else {
        format!("{release}-targetlease")
    }
}

/// The leader-election Lease of `release`.
fn election_lease(release: &str) -> String {
    format!("{}-controller", fullname(release))
}

/// Labels a namespace to enforce (and warn about) the restricted Pod Security Standard.
fn restrict(cluster: &Cluster, ns: &str) {
    cluster.kubectl_ok(&[
        "label",
        "namespace",
        ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
        "pod-security.kubernetes.io/warn=restricted",
        "pod-security.kubernetes.io/warn-version=latest",
    ]);
}

/// Polls `check` every 200 ms until it returns `Some`, for at most `limit`.
fn poll<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The controller's pods of a release (the ReplicaSet controller made them; no kubelet runs
/// them, so they stay Pending).
fn release_pods(cluster: &Cluster, ns: &str, release: &str) -> Vec<Value> {
    let selector =
        format!("app.kubernetes.io/instance={release},app.kubernetes.io/component=controller");
    kubectl_json(cluster, &["get", "pods", "-n", ns, "-l", &selector])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// `kubectl get ... -o json`, parsed.
fn kubectl_json(cluster: &Cluster, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&cluster.kubectl_ok(&all)).expect("kubectl JSON")
}

/// The FailedCreate events in a namespace (both event APIs show them), as "reason: message".
fn failed_creates(world: &World, ns: &str) -> Vec<String> {
    world.json(&["get", "events", "-n", ns])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|e| e["reason"] == "FailedCreate")
        .map(|e| {
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            format!(
                "{} {}: {}",
                text(&e["involvedObject"]["kind"]),
                text(&e["involvedObject"]["name"]),
                text(&e["message"])
            )
        })
        .collect()
}

fn install_under_restricted_pod_security(world: &World) {
    eprintln!("measured: helm install {:?}", world.install_took);
    let warnings = stderr(&world.install);
    assert!(
        !warnings.contains("PodSecurity"),
        "helm install printed Pod Security warnings:\n{warnings}"
    );
    let status = world.cluster.helm(&["status", RELEASE, "-n", RELEASE_NS]);
    assert!(
        stdout(&status).contains("STATUS: deployed"),
        "{}",
        stdout(&status)
    );
    let admitted = world
        .pods_admitted
        .expect("the ReplicaSet did not create 2 pods within 60 s");
    eprintln!("measured: both controller pods admitted {admitted:?} after helm install began");
    let pods = release_pods(&world.cluster, RELEASE_NS, RELEASE);
    assert_eq!(pods.len(), 2);
    for pod in &pods {
        assert_eq!(pod["spec"]["serviceAccountName"], FULLNAME);
        assert_eq!(
            pod["status"]["phase"], "Pending",
            "no kubelet runs pods here"
        );
    }
    let refused = failed_creates(world, RELEASE_NS);
    assert!(refused.is_empty(), "pods refused: {refused:?}");
    let ns = world.json(&["get", "namespace", RELEASE_NS]);
    assert_eq!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "restricted"
    );

    // Control: the same chart with privilege escalation allowed is refused in the same kind of
    // namespace, and the refusal is visible where the check above looks for it.
    let ns = world.namespace("targetlease-insecure");
    restrict(&world.cluster, &ns);
    let chart = chart_dir().display().to_string();
    let out = world.cluster.helm(&[
        "install",
        "insecure",
        &chart,
        "-n",
        &ns,
        "--set",
        "crds.enabled=false",
        "--set",
        "securityContext.allowPrivilegeEscalation=true",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("would violate PodSecurity")
            && stderr(&out).contains("allowPrivilegeEscalation != false"),
        "no Pod Security warning for the insecure Deployment: {}",
        stderr(&out)
    );
    let refused = poll(
        60 * SEC,
        "a FailedCreate event for the insecure ReplicaSet",
        || {
            let refused = failed_creates(world, &ns);
            (!refused.is_empty()).then_some(refused)
        },
    );
    assert!(
        refused
            .iter()
            .any(|r| r.starts_with("ReplicaSet") && r.contains("violates PodSecurity")),
        "{refused:?}"
    );
    assert!(release_pods(&world.cluster, &ns, "insecure").is_empty());
    let out = world.cluster.helm(&["uninstall", "insecure", "-n", &ns]);
    assert!(out.status.success(), "{}", stderr(&out));
}

async fn chart_rbac_runs_the_controller(world: &World) {
    // The host controller (as the chart's ServiceAccount) leads through the chart's Role.
    let lease: Value = poll(30 * SEC, "the host controller leads", || {
        let out = world.cluster.kubectl(&[
            "get",
            "lease",
            ELECTION_LEASE,
            "-n",
            RELEASE_NS,
            "-o",
            "json",
        ]);
        let lease: Value = serde_json::from_slice(&out.stdout).ok()?;
        (lease["spec"]["holderIdentity"] == format!("host-{RELEASE}")).then_some(lease)
    });
    assert_eq!(lease["metadata"]["namespace"], RELEASE_NS);
    let ns = world.namespace("chart-rbac");
    lease_scenario(world, &ns, &|| world.controller_log()).await;
}

/// The controller's end-to-end scenario in `ns`, run by whichever controller watches it
/// (`log` shows its log): apply -> Held, a second claim Waiting, delete -> hand-over with a
/// larger token, events (created, and patched into a series), holderRef pods watched, and no
/// refused API call in the log.
async fn lease_scenario(world: &World, ns: &str, log: &(dyn Fn() -> String + Sync)) {
    let ns = ns.to_owned();
    let client: Client = world.cluster.client().await;
    let api: Api<TargetLease> = Api::namespaced(client.clone(), &ns);
    let wait = |name: &'static str, phase: Phase| {
        let api = api.clone();
        async move {
            await_lease(&api, name, &format!("{phase:?}"), 30 * SEC, move |l| {
                phase_of(l) == Some(phase)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\ncontroller log:\n{}", log()))
        }
    };
    // apply -> Held; a second claim -> Waiting; delete -> hand-over with a larger token.
    world
        .cluster
        .apply(&lease_yaml(&ns, "holder", "shared", "worker-a", ""));
    let held = wait("holder", Phase::Held).await;
    assert!(
        held.finalizers()
            .iter()
            .any(|f| f == "targetlease.dev/release")
    );
    world
        .cluster
        .apply(&lease_yaml(&ns, "waiter", "shared", "worker-b", ""));
    let waiting = wait("waiter", Phase::Waiting).await;
    assert_eq!(
        waiting.status.as_ref().and_then(|s| s.held_by.as_deref()),
        Some("worker-a")
    );
    let started = Instant::now();
    api.delete("holder", &DeleteParams::default())
        .await
        .expect("delete");
    let taken = wait("waiter", Phase::Held).await;
    eprintln!(
        "measured: hand-over as the chart's ServiceAccount {:?}",
        started.elapsed()
    );
    assert!(token_of(&taken) > token_of(&held));

    // Give the lease up and take it again: a repeated event is patched into a series.
    let patch = |release: bool| Patch::Merge(json!({"spec": {"release": release}}));
    api.patch("waiter", &PatchParams::default(), &patch(true))
        .await
        .expect("patch");
    wait("waiter", Phase::Released).await;
    api.patch("waiter", &PatchParams::default(), &patch(false))
        .await
        .expect("patch");
    let again = wait("waiter", Phase::Held).await;
    assert!(token_of(&again) > token_of(&taken));
    let events = poll(
        10 * SEC,
        "events, with the repeated Acquired as a series",
        || {
            let events = world.json(&["get", "events.events.k8s.io", "-n", &ns])["items"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let series = events.iter().any(|e| {
                e["regarding"]["name"] == "waiter"
                    && e["reason"] == "Acquired"
                    && e["series"]["count"].as_i64().unwrap_or(0) >= 2
            });
            series.then_some(events)
        },
    );
    let seen: BTreeSet<String> = events
        .iter()
        .map(|e| {
            format!(
                "{}/{}",
                e["regarding"]["name"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or("")
            )
        })
        .collect();
    for expected in [
        "holder/Acquired",
        "holder/Released",
        "waiter/Waiting",
        "waiter/Acquired",
        "waiter/Released",
    ] {
        assert!(seen.contains(expected), "no {expected} event in {seen:?}");
    }
    assert!(
        events
            .iter()
            .all(|e| e["reportingController"] == "targetlease-controller")
    );

    // holderRef: the pod watch (cluster-wide list/watch on pods) sees the holder go.
    world.cluster.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: worker-pod\n  namespace: {ns}\nspec:\n  containers:\n  - name: main\n    image: example.invalid/worker:1\n"
    ));
    world.cluster.apply(&lease_yaml(
        &ns,
        "by-pod",
        "pod-target",
        "worker-pod",
        "holderRef: {kind: Pod, name: worker-pod}",
    ));
    wait("by-pod", Phase::Held).await;
    let started = Instant::now();
    world.cluster.kubectl_ok(&[
        "delete",
        "pod",
        "worker-pod",
        "-n",
        &ns,
        "--grace-period=0",
        "--force",
    ]);
    let released = await_lease(&api, "by-pod", "Released", 5 * SEC, |l| {
        phase_of(l) == Some(Phase::Released)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\ncontroller log:\n{}", log()));
    eprintln!(
        "measured: holder pod deleted -> Released {:?}",
        started.elapsed()
    );
    assert_eq!(
        condition(&released, "Ready").map(|c| c.reason.as_str()),
        Some("HolderGone")
    );

    let text = log();
    // Any refused call would show here: a denied watch, patch or event.
    for needle in [
        "forbidden",
        "Forbidden",
        "could not publish event",
        "pod watch failed",
    ] {
        assert!(
            !text.contains(needle),
            "controller log contains {needle:?}:\n{text}"
        );
    }
}

/// controller.watchNamespace: the chart grants Roles only (no ClusterRole), and they are enough
/// for the controller watching that one namespace.
async fn watch_namespace_mode_needs_only_roles(world: &World) {
    let release = "team-a";
    let release_ns = "targetlease-team-a";
    let watched = world.namespace("team-a");
    world.namespace(release_ns);
    restrict(&world.cluster, release_ns);
    let chart = chart_dir().display().to_string();
    let out = world.cluster.helm(&[
        "install",
        release,
        &chart,
        "-n",
        release_ns,
        "--set",
        "crds.enabled=false",
        "--set",
        &format!("controller.watchNamespace={watched}"),
    ]);
    assert!(out.status.success(), "helm install: {}", stderr(&out));
    let name = fullname(release);
    let out = world.cluster.kubectl(&["get", "clusterrole", &name]);
    assert!(
        stderr(&out).contains("NotFound"),
        "a ClusterRole in namespaced mode"
    );
    let kubeconfig = world.cluster.service_account_kubeconfig(release_ns, &name);
    let can = |args: &[&str]| {
        let mut all = vec!["auth", "can-i"];
        all.extend_from_slice(args);
        let out = world.cluster.kubectl_as(&kubeconfig, &all);
        stdout(&out).trim() == "yes"
    };
    for (args, want) in [
        (
            &["watch", "targetleases.targetlease.dev", "-n", "team-a"][..],
            true,
        ),
        (
            &[
                "patch",
                "targetleases.targetlease.dev",
                "--subresource=status",
                "-n",
                "team-a",
            ],
            true,
        ),
        (&["watch", "pods", "-n", "team-a"], true),
        (&["create", "events.events.k8s.io", "-n", "team-a"], true),
        (
            &["watch", "targetleases.targetlease.dev", "--all-namespaces"],
            false,
        ),
        (&["watch", "pods", "--all-namespaces"], false),
        (&["get", "pods", "-n", "shop"], false),
        (&["create", "events.events.k8s.io", "-n", "shop"], false),
        (&["list", "secrets", "-n", "team-a"], false),
    ] {
        assert_eq!(can(args), want, "can-i {}", args.join(" "));
    }
    // Only this controller may act on team-a's leases while the scenario runs.
    let paused = world.pause_controller();
    let controller = host_controller(
        &world.cluster,
        &kubeconfig,
        &world.valkey,
        release_ns,
        release,
        &["--watch-namespace", &watched],
    );
    lease_scenario(world, &watched, &|| controller.logs()).await;
    drop(controller);
    drop(paused);
    let out = world
        .cluster
        .helm(&["uninstall", release, "-n", release_ns]);
    assert!(out.status.success(), "helm uninstall: {}", stderr(&out));
}

/// `kubectl auth can-i` as the chart's ServiceAccount: (arguments, allowed?).
fn can_i(world: &World, args: &[&str]) -> bool {
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    let out = world.kubectl_as_controller(&all);
    match (out.status.code(), stdout(&out).trim()) {
        (Some(0), "yes") => true,
        (Some(1), "no") => false,
        _ => panic!(
            "kubectl auth can-i {args:?}: {}{}",
            stdout(&out),
            stderr(&out)
        ),
    }
}

/// The can-i checks docs/install.md lists (its `can ...` / `cannot ...` lines): (allowed?,
/// arguments). The docs are the one list; this suite and the docs test both run it.
fn documented_can_i_checks() -> Vec<(bool, Vec<String>)> {
    let doc = std::fs::read_to_string(repo().join("docs/install.md")).expect("docs/install.md");
    let block = doc
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|block| block.contains("auth can-i"))
        .expect("docs/install.md has the can-i block");
    block
        .lines()
        .filter_map(|line| {
            let line = line.split('#').next().unwrap_or_default().trim();
            let (want, args) = match (line.strip_prefix("can "), line.strip_prefix("cannot ")) {
                (Some(args), _) => (true, args),
                (_, Some(args)) => (false, args),
                _ => return None,
            };
            Some((want, args.split_whitespace().map(str::to_owned).collect()))
        })
        .collect()
}

fn service_account_is_least_privilege(world: &World) {
    let checks = documented_can_i_checks();
    let allowed = checks.iter().filter(|(want, _)| *want).count();
    assert!(
        allowed >= 10 && checks.len() - allowed >= 30,
        "docs/install.md lists {allowed} allowed and {} refused checks",
        checks.len() - allowed
    );
    let mut wrong = Vec::new();
    for (want, args) in &checks {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        if can_i(world, &args) != *want {
            wrong.push(format!("can-i {} -> {}", args.join(" "), !want));
        }
    }
    assert!(
        wrong.is_empty(),
        "unexpected answers:\n{}",
        wrong.join("\n")
    );
    // A real request, not only the review: listing Secrets is Forbidden.
    let out = world.kubectl_as_controller(&["get", "secrets", "-n", RELEASE_NS]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("Forbidden"), "{}", stderr(&out));
    // Everything the ServiceAccount may do in a workload namespace, from the API server's view,
    // beyond what any ServiceAccount may do: exactly the chart's rules.
    let nobody = world
        .cluster
        .kubectl(&["create", "serviceaccount", "nobody", "-n", RELEASE_NS]);
    assert!(nobody.status.success(), "{}", stderr(&nobody));
    let baseline = world
        .cluster
        .service_account_kubeconfig(RELEASE_NS, "nobody");
    let list = |kubeconfig: &Path| -> BTreeSet<String> {
        let out = world
            .cluster
            .kubectl_as(kubeconfig, &["auth", "can-i", "--list", "-n", "shop"]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect()
    };
    let everyone = list(&baseline);
    assert!(
        everyone
            .iter()
            .any(|r| r.starts_with("selfsubjectaccessreviews")),
        "{everyone:?}"
    );
    let rows: BTreeSet<String> = list(&world.sa_kubeconfig)
        .difference(&everyone)
        .cloned()
        .collect();
    let expected: BTreeSet<String> = [
        "events.events.k8s.io [] [] [create patch]",
        "pods [] [] [get list watch]",
        "targetleases.targetlease.dev/status [] [] [patch]",
        "targetleases.targetlease.dev [] [] [list watch patch]",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(
        rows, expected,
        "can-i --list -n shop, beyond any ServiceAccount's"
    );
}

async fn gitops_status_of_real_objects(world: &World, tools: &Tools) {
    let ns = world.namespace("chart-gitops");
    let client = world.cluster.client().await;
    let api: Api<TargetLease> = Api::namespaced(client, &ns);
    let wait = |name: &'static str, phase: Phase| {
        let api = api.clone();
        async move {
            await_lease(&api, name, &format!("{phase:?}"), 30 * SEC, move |l| {
                phase_of(l) == Some(phase)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\ncontroller log:\n{}", world.controller_log()))
        }
    };
    world
        .cluster
        .apply(&lease_yaml(&ns, "held", "report", "worker-1", ""));
    wait("held", Phase::Held).await;
    world
        .cluster
        .apply(&lease_yaml(&ns, "waiting", "report", "worker-2", ""));
    wait("waiting", Phase::Waiting).await;
    world.cluster.apply(&lease_yaml(
        &ns,
        "released",
        "other",
        "worker-3",
        "release: true",
    ));
    wait("released", Phase::Released).await;
    // A lease record of the wrong type: the controller fails closed (Failed, Stalled=True).
    let keys = TargetKeys::new("tl", &TargetRef::new(&ns, "broken").expect("target"));
    world.valkey.raw(&["SET", &keys.lease(), "not-a-hash"]);
    world
        .cluster
        .apply(&lease_yaml(&ns, "failed", "broken", "worker-4", ""));
    wait("failed", Phase::Failed).await;

    for (name, kstatus_want, argocd_want) in [
        ("held", "Current", "Healthy"),
        ("waiting", "InProgress", "Progressing"),
        ("released", "Current", "Healthy"),
        ("failed", "Failed", "Degraded"),
    ] {
        // The object exactly as kubectl returns it.
        let object = world.json(&["get", "targetlease", name, "-n", &ns]);
        let (status, message) = tools.kstatus(&object);
        eprintln!("kstatus {name}: {status} ({message})");
        assert_eq!(
            status, kstatus_want,
            "kstatus of {name}: {message}\n{object:#}"
        );
        let (health, message) = argocd_health(&object);
        eprintln!("argocd health {name}: {health} ({message})");
        assert_eq!(health, argocd_want, "Argo CD health of {name}: {message}");
    }
}

async fn workload_rbac_example_runs_run_and_wait(world: &World) {
    let ns = world.namespace("shop");
    let examples = repo().join("examples");
    let apply = |file: &str| {
        let path = examples.join(file).display().to_string();
        world.cluster.kubectl_ok(&["apply", "-n", &ns, "-f", &path]);
    };
    apply("rbac.yaml");
    apply("gitops/leases/reports-writer.yaml");
    // The workload examples are valid for the API server (no kubelet runs them here).
    for file in [
        "job-run.yaml",
        "deployment-wait.yaml",
        "deployment-standby.yaml",
    ] {
        let path = examples.join(file).display().to_string();
        world
            .cluster
            .kubectl_ok(&["apply", "--dry-run=server", "-n", &ns, "-f", &path]);
    }
    let kubeconfig = world.cluster.service_account_kubeconfig(&ns, "lease-user");
    let targetlease = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_targetlease"));
        command
            .args(args)
            .envs(world.cluster.envs())
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE");
        run_with_input(command, None)
    };
    // wait: the declared lease is Held; its token comes back.
    let out = targetlease(&["wait", "reports-writer", "--timeout=30s"]);
    assert!(
        out.status.success(),
        "targetlease wait as lease-user: {}",
        stderr(&out)
    );
    let token: u64 = stdout(&out).trim().parse().expect("a token");
    let client = world.cluster.client().await;
    let declared = Api::<TargetLease>::namespaced(client, &ns)
        .get("reports-writer")
        .await
        .expect("get");
    assert_eq!(token, token_of(&declared));
    // run: creates its TargetLease, runs the command with the token, deletes it.
    let out = targetlease(&[
        "run",
        "--target=orders-db/migration",
        "--holder=orders-migration",
        "--",
        "sh",
        "-c",
        "test -n \"$TARGETLEASE_TOKEN\" && echo \"ran with $TARGETLEASE_TARGET\"",
    ]);
    assert!(
        out.status.success(),
        "targetlease run as lease-user: {}",
        stderr(&out)
    );
    assert!(
        stdout(&out).contains("ran with orders-db/migration"),
        "{}",
        stdout(&out)
    );
    // The workload cannot write a status (and so cannot forge a token).
    let out = world.cluster.kubectl_as(
        &kubeconfig,
        &[
            "patch",
            "targetlease",
            "reports-writer",
            "--subresource=status",
            "--type=merge",
            "-p",
            "{\"status\":{\"fencingToken\":1}}",
        ],
    );
    assert!(
        !out.status.success() && stderr(&out).contains("Forbidden"),
        "{}",
        stderr(&out)
    );
    let out = world.cluster.kubectl_as(&kubeconfig, &["get", "secrets"]);
    assert!(stderr(&out).contains("Forbidden"), "{}", stderr(&out));
}

/// The kubectl command docs/gitops.md gives for installing the Argo CD health check, run against
/// a stand-in argocd-cm: it adds exactly the Lua file under the documented key and keeps the rest.
fn argocd_cm_command_from_docs(world: &World) {
    let doc = std::fs::read_to_string(repo().join("docs/gitops.md")).expect("docs/gitops.md");
    let block = doc
        .split("```bash\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|block| block.contains("argocd-health.lua"))
        .expect("docs/gitops.md has the argocd-cm command block");
    world.namespace("argocd");
    world.cluster.kubectl_ok(&[
        "create",
        "configmap",
        "argocd-cm",
        "-n",
        "argocd",
        "--from-literal=url=https://argocd.example.com",
    ]);
    let mut command = Command::new("bash");
    command
        .args(["-euo", "pipefail", "-c", block])
        .current_dir(repo())
        .envs(world.cluster.envs());
    let out = run_with_input(command, None);
    assert!(
        out.status.success(),
        "{block}\n{}{}",
        stdout(&out),
        stderr(&out)
    );
    let cm = world.json(&["get", "configmap", "argocd-cm", "-n", "argocd"]);
    let lua = std::fs::read_to_string(repo().join("docs/gitops/argocd-health.lua")).expect("lua");
    assert_eq!(
        cm["data"]["resource.customizations.health.targetlease.dev_TargetLease"],
        lua.as_str()
    );
    assert_eq!(
        cm["data"]["url"], "https://argocd.example.com",
        "other keys kept"
    );
}

fn replica_sets(world: &World) -> Vec<(String, String, i64)> {
    let selector = format!("app.kubernetes.io/instance={RELEASE}");
    let mut sets: Vec<(String, String, i64)> =
        world.json(&["get", "replicasets", "-n", RELEASE_NS, "-l", &selector])["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|rs| {
                (
                    rs["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    rs["metadata"]["labels"]["pod-template-hash"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    rs["spec"]["replicas"].as_i64().unwrap_or(0),
                )
            })
            .collect();
    sets.sort();
    sets
}

fn upgrade_rolls_the_deployment(world: &World) {
    let before = replica_sets(world);
    assert_eq!(before.len(), 1, "{before:?}");
    let old_hash = before[0].1.clone();
    let chart = chart_dir().display().to_string();
    let upgrade = |sets: &[&str]| {
        let mut args = vec![
            "upgrade",
            RELEASE,
            chart.as_str(),
            "-n",
            RELEASE_NS,
            "--reuse-values",
        ];
        for set in sets {
            args.extend(["--set", set]);
        }
        let started = Instant::now();
        let out = world.cluster.helm(&args);
        assert!(out.status.success(), "helm upgrade: {}", stderr(&out));
        started.elapsed()
    };
    // Same values: the pod template (with the Valkey URL checksum) does not change.
    let took = upgrade(&[]);
    eprintln!("measured: helm upgrade without changes {took:?}");
    std::thread::sleep(2 * SEC);
    assert_eq!(
        replica_sets(world).len(),
        1,
        "an unchanged upgrade rolled the pods"
    );
    // A new Valkey URL: the Secret changes and the pods roll.
    let started = Instant::now();
    let took = upgrade(&["valkey.url=redis://valkey.other-namespace:6379"]);
    let new_hash = poll(60 * SEC, "a new ReplicaSet with pods", || {
        replica_sets(world)
            .into_iter()
            .find(|(_, hash, _)| *hash != old_hash)
            .map(|(_, hash, _)| hash)
            .filter(|hash| {
                let selector = format!("pod-template-hash={hash}");
                !world.json(&["get", "pods", "-n", RELEASE_NS, "-l", &selector])["items"]
                    .as_array()
                    .is_none_or(Vec::is_empty)
            })
    });
    eprintln!(
        "measured: helm upgrade {took:?}; first pod of the new ReplicaSet {:?} after the upgrade began",
        started.elapsed()
    );
    let secret = world.json(&[
        "get",
        "secret",
        &format!("{FULLNAME}-valkey"),
        "-n",
        RELEASE_NS,
    ]);
    assert!(secret["data"]["url"].is_string());
    let deploy = world.json(&["get", "deployment", FULLNAME, "-n", RELEASE_NS]);
    assert_eq!(
        deploy["metadata"]["generation"], 2,
        "{}",
        deploy["metadata"]
    );
    assert_ne!(new_hash, old_hash);
    let history = world.cluster.helm(&["history", RELEASE, "-n", RELEASE_NS]);
    assert!(
        stdout(&history).lines().count() >= 4,
        "{}",
        stdout(&history)
    );
    assert!(failed_creates(world, RELEASE_NS).is_empty());
}

async fn uninstall_keeps_crd_and_leases(world: &World) {
    let ns = world.namespace("chart-keep");
    let client = world.cluster.client().await;
    let api: Api<TargetLease> = Api::namespaced(client, &ns);
    world
        .cluster
        .apply(&lease_yaml(&ns, "kept", "kept-target", "worker-1", ""));
    await_lease(&api, "kept", "Held", 30 * SEC, |l| {
        phase_of(l) == Some(Phase::Held)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // The controller's ServiceAccount goes with the release: stop the controller first.
    if let Some(mut controller) = world.take_controller() {
        let status = controller.terminate();
        assert!(status.success(), "controller exit: {status}");
    }
    let started = Instant::now();
    let out = world
        .cluster
        .helm(&["uninstall", RELEASE, "-n", RELEASE_NS]);
    eprintln!("measured: helm uninstall {:?}", started.elapsed());
    assert!(out.status.success(), "helm uninstall: {}", stderr(&out));
    let said = format!("{}{}", stdout(&out), stderr(&out));
    assert!(said.contains("kept due to the resource policy"), "{said}");
    // The CRD and every TargetLease remain; the release's other objects are gone.
    world.cluster.kubectl_ok(&["get", "crd", CRD]);
    let kept = api
        .get("kept")
        .await
        .expect("the TargetLease survived the uninstall");
    assert_eq!(phase_of(&kept), Some(Phase::Held));
    for (kind, name, ns) in [
        ("clusterrole", FULLNAME, None),
        ("clusterrolebinding", FULLNAME, None),
        ("serviceaccount", FULLNAME, Some(RELEASE_NS)),
        ("deployment", FULLNAME, Some(RELEASE_NS)),
        ("role", "targetlease-leader-election", Some(RELEASE_NS)),
    ] {
        let mut args = vec!["get", kind, name];
        if let Some(ns) = ns {
            args.extend(["-n", ns]);
        }
        let out = world.cluster.kubectl(&args);
        assert!(
            stderr(&out).contains("NotFound"),
            "{kind}/{name} left behind: {}",
            stdout(&out)
        );
    }
    // The ServiceAccount's token died with it.
    let out = world.kubectl_as_controller(&["get", "targetleases", "-A"]);
    assert!(
        !out.status.success(),
        "the deleted ServiceAccount's token still works"
    );
}

// ---------------------------------------------------------------------------------- runner --

/// Shared by the trials: the tools, and the cluster world once a cluster test asks for it.
struct Suite {
    tools: Tools,
    world: Mutex<Option<Result<Arc<World>, String>>>,
}

impl Suite {
    /// The world, started on first use. If starting it failed, every cluster test fails with
    /// the same message.
    fn world(&self) -> Result<Arc<World>, Failed> {
        let mut slot = self.world.lock().unwrap_or_else(|e| e.into_inner());
        let result = slot.get_or_insert_with(|| {
            std::panic::catch_unwind(World::start)
                .map(Arc::new)
                .map_err(|panic| panic_message(&*panic))
        });
        result
            .clone()
            .map_err(|e| Failed::from(format!("the cluster could not be set up: {e}")))
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panicked".into())
}

/// Runs an async test body on its own runtime, with a time limit.
fn block_on(limit: Duration, body: impl Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        tokio::time::timeout(limit, body)
            .await
            .unwrap_or_else(|_| panic!("timed out after {limit:?}"))
    });
}

type Body = Box<dyn FnOnce(&Suite) -> Result<(), Failed> + Send>;

/// A test that needs the tools only.
fn tools_test(test: fn(&Tools)) -> Body {
    Box::new(move |suite| {
        test(&suite.tools);
        Ok(())
    })
}

/// A test on the cluster world; fails when the world could not be set up.
fn world_test(test: impl FnOnce(&World, &Tools) + Send + 'static) -> Body {
    Box::new(move |suite| {
        let world = suite.world()?;
        test(&world, &suite.tools);
        Ok(())
    })
}

fn main() {
    let mut args = Arguments::from_args();
    // One at a time: the cluster tests share one release, and the last one uninstalls it.
    args.test_threads = Some(1);
    const LIMIT: Duration = Duration::from_secs(180);
    let tests: Vec<(&str, Body)> = vec![
        (
            "lint_default_and_ci_values",
            tools_test(lint_default_and_ci_values),
        ),
        (
            "default_render_is_hardened_and_least_privilege",
            tools_test(default_render_is_hardened_and_least_privilege),
        ),
        (
            "ci_values_render_what_they_ask_for",
            tools_test(ci_values_render_what_they_ask_for),
        ),
        (
            "schema_refuses_bad_values",
            tools_test(schema_refuses_bad_values),
        ),
        (
            "chart_crd_matches_crds_dir",
            tools_test(chart_crd_matches_crds_dir),
        ),
        (
            "chart_versions_match_the_crate",
            tools_test(|_| chart_versions_match_the_crate()),
        ),
        (
            "argocd_health_of_sample_statuses",
            tools_test(|_| argocd_health_of_sample_statuses()),
        ),
        (
            "kstatus_of_sample_statuses",
            tools_test(kstatus_of_sample_statuses),
        ),
        (
            "examples_are_well_formed",
            tools_test(examples_are_well_formed),
        ),
        (
            "cluster_install_under_restricted_pod_security",
            world_test(|world, _| install_under_restricted_pod_security(world)),
        ),
        (
            "cluster_chart_rbac_runs_the_controller",
            world_test(|world, _| block_on(LIMIT, chart_rbac_runs_the_controller(world))),
        ),
        (
            "cluster_service_account_is_least_privilege",
            world_test(|world, _| service_account_is_least_privilege(world)),
        ),
        (
            "cluster_gitops_status_of_real_objects",
            world_test(|world, tools| block_on(LIMIT, gitops_status_of_real_objects(world, tools))),
        ),
        (
            "cluster_argocd_cm_command_from_docs",
            world_test(|world, _| argocd_cm_command_from_docs(world)),
        ),
        (
            "cluster_workload_rbac_example_runs_run_and_wait",
            world_test(|world, _| block_on(LIMIT, workload_rbac_example_runs_run_and_wait(world))),
        ),
        (
            "cluster_watch_namespace_mode_needs_only_roles",
            world_test(|world, _| block_on(LIMIT, watch_namespace_mode_needs_only_roles(world))),
        ),
        (
            "cluster_upgrade_rolls_the_deployment",
            world_test(|world, _| upgrade_rolls_the_deployment(world)),
        ),
        // Last: it uninstalls the release.
        (
            "cluster_uninstall_keeps_crd_and_leases",
            world_test(|world, _| block_on(LIMIT, uninstall_keeps_crd_and_leases(world))),
        ),
    ];
    let suite = Arc::new(Suite {
        tools: Tools::new(),
        world: Mutex::new(None),
    });
    let trials = tests
        .into_iter()
        .map(|(name, body)| {
            let suite = suite.clone();
            Trial::test(name, move || body(&suite))
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    // Stop the controller, Valkey and the cluster before reporting.
    let world = suite.world.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(world);
    println!(
        "chart: {} passed, {} failed",
        conclusion.num_passed, conclusion.num_failed
    );
    if conclusion.num_passed == 0 {
        eprintln!("chart: no test ran; refusing to pass vacuously");
        std::process::exit(1);
    }
    conclusion.exit();
}
