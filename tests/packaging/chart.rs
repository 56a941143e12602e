//! The Helm chart (`charts/targetlease`), the GitOps health checks and the examples, checked
//! without a cluster: helm (lint, template, the values schema), Lua 5.1 (the Argo CD health
//! check) and kstatus on sample statuses the controller's own code makes. The chart on a real
//! control plane is `tests/packaging/chart_cluster.rs`. A missing tool fails the suite; it never skips.

use targetlease_test_support as support;

use libtest_mimic::{Arguments, Conclusion};

use std::collections::BTreeSet;
use std::sync::Arc;

use jiff::Timestamp;
use serde_json::{Value, json};
use targetlease::api::{Reason, TargetLeaseStatus};
use targetlease::controller::status::Observed;
use targetlease::store::{Grant, Permits, Slot, StoreError};

use support::chart::*;
use support::kube::{repo, run_with_input};
use support::suite;

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
        // The `helm test` pod (a hook: `helm install` does not create it).
        "Pod",
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
        object(&docs, "ClusterRole", &cluster_role())["rules"],
        controller_rules()
    );
    let binding = object(&docs, "ClusterRoleBinding", &cluster_role());
    assert_eq!(binding["roleRef"]["name"], cluster_role());
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NS}])
    );
    let election = object(&docs, "Role", &format!("{FULLNAME}-leader-election"));
    assert_eq!(election["metadata"]["namespace"], RELEASE_NS);
    assert_eq!(election["rules"], election_rules(ELECTION_LEASE));
    // Beside the controller's: the rights aggregated into the built-in view, edit and admin
    // roles (never the status), and the workload ClusterRole, whose rules are examples/rbac.yaml's.
    let prefix = format!("{FULLNAME}-{RELEASE_NS}");
    let names: BTreeSet<String> = of_kind(&docs, "ClusterRole")
        .iter()
        .filter_map(|r| r["metadata"]["name"].as_str().map(str::to_owned))
        .collect();
    let expected: BTreeSet<String> = [
        cluster_role(),
        format!("{prefix}-view"),
        format!("{prefix}-edit"),
        format!("{prefix}-workload"),
    ]
    .into();
    assert_eq!(names, expected);
    let view = object(&docs, "ClusterRole", &format!("{prefix}-view"));
    for role in ["view", "edit", "admin"] {
        assert_eq!(
            view["metadata"]["labels"][format!("rbac.authorization.k8s.io/aggregate-to-{role}")],
            "true"
        );
    }
    assert_eq!(
        view["rules"],
        json!([{"apiGroups": ["targetlease.dev"], "resources": ["targetleases", "targetleases/status"], "verbs": ["get", "list", "watch"]}])
    );
    let edit = object(&docs, "ClusterRole", &format!("{prefix}-edit"));
    assert!(edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"].is_null());
    assert!(
        !edit["rules"].to_string().contains("status"),
        "edit may write the status: {}",
        edit["rules"]
    );
    assert_eq!(
        object(&docs, "ClusterRole", &format!("{prefix}-workload"))["rules"],
        workload_rules()
    );
    let off = tools.render_ok(&[
        "--set",
        "rbac.aggregateToDefaultRoles=false",
        "--set",
        "rbac.workloadClusterRole=false",
    ]);
    assert_eq!(
        of_kind(&off, "ClusterRole").len(),
        1,
        "only the controller's ClusterRole"
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
    let budget = &object(&docs, "PodDisruptionBudget", FULLNAME)["spec"];
    assert_eq!(budget["minAvailable"], 1);
    // /readyz follows Valkey: with Valkey down every replica is unready, and a drain must not
    // hang on the budget.
    assert_eq!(budget["unhealthyPodEvictionPolicy"], "AlwaysAllow");

    // Any change of the URL the pods read restarts them, a new password alone included; the
    // same URL renders the same pod template (an unchanged upgrade rolls nothing).
    let pod_annotations = |url: &str| {
        let docs = tools.render_ok(&["--set", &format!("valkey.url={url}")]);
        object(&docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["annotations"].clone()
    };
    let url = "redis://user:s3cret@valkey:6379";
    let first = pod_annotations(url);
    assert_ne!(
        pod_annotations("redis://user:other@valkey:6379"),
        first,
        "a new password in valkey.url leaves the pod template as it was: the pods keep the old one"
    );
    assert_eq!(pod_annotations(url), first);
    for other in [
        "redis://other:s3cret@valkey:6379",
        "redis://user:s3cret@valkey-2:6379",
        "redis://user:s3cret@valkey:6380",
        "redis://user:s3cret@valkey:6379/1",
        "rediss://user:s3cret@valkey:6379",
        "redis://valkey:6379",
    ] {
        assert_ne!(pod_annotations(other), first, "{other}");
    }
    // Not a fast digest that would let pod readers test guesses of the password: no hex digest,
    // nothing of the URL.
    let checksum = first["checksum/valkey-url"]
        .as_str()
        .expect("checksum/valkey-url");
    assert!(
        !(checksum.len() >= 32 && checksum.bytes().all(|b| b.is_ascii_hexdigit())),
        "a plain digest: {checksum}"
    );
    assert!(
        !checksum.contains("s3cret") && !checksum.contains("valkey"),
        "{checksum}"
    );
    assert!(first.get("checksum/valkey-endpoint").is_none(), "{first}");

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

    // Holder pods narrowed to two namespaces: the ClusterRole reads no pod, a Role in each of
    // them does, and the controller is told where to look.
    let without_pods: Vec<Value> = controller_rules()
        .as_array()
        .expect("rules")
        .iter()
        .filter(|rule| rule["resources"][0] != "pods")
        .cloned()
        .collect();
    let docs = tools.render_ok(&["-f", &file("holder-pods-values.yaml")]);
    let narrowed = object(&docs, "ClusterRole", &cluster_role());
    assert_eq!(narrowed["rules"], json!(without_pods));
    let holder_roles: Vec<&Value> = of_kind(&docs, "Role")
        .into_iter()
        .filter(|r| r["metadata"]["name"] == format!("{FULLNAME}-holder-pods"))
        .collect();
    let namespaces: Vec<&str> = holder_roles
        .iter()
        .filter_map(|r| r["metadata"]["namespace"].as_str())
        .collect();
    assert_eq!(namespaces, ["batch", "shop"]);
    for role in &holder_roles {
        assert_eq!(
            role["rules"],
            json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}])
        );
    }
    let bindings = of_kind(&docs, "RoleBinding")
        .into_iter()
        .filter(|b| b["metadata"]["name"] == format!("{FULLNAME}-holder-pods"))
        .count();
    assert_eq!(bindings, 2);
    let c = &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0];
    assert!(strings(&c["args"]).contains(&"--holder-pod-namespaces=batch,shop".to_owned()));

    // Holder pods off: no pod rule anywhere.
    let docs = tools.render_ok(&["--set", "controller.holderPods.enabled=false"]);
    for kind in ["ClusterRole", "Role"] {
        for role in of_kind(&docs, kind) {
            assert!(
                !role["rules"].to_string().contains("\"pods\""),
                "{kind} {} still reads pods",
                role["metadata"]["name"]
            );
        }
    }
    let c = &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0];
    assert!(strings(&c["args"]).contains(&"--no-holder-pods".to_owned()));

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
    // The password is a mounted file (the kubelet updates it when the Secret rotates, and the
    // controller reads it at every reconnect), never an env var.
    assert_eq!(
        value("TARGETLEASE_VALKEY_PASSWORD_FILE"),
        "/etc/targetlease/valkey-password/password"
    );
    assert!(
        !env.iter().any(|(n, _)| n == "TARGETLEASE_VALKEY_PASSWORD"),
        "the password must not be an env var"
    );
    assert_eq!(
        c["volumeMounts"],
        json!([
            {"name": "valkey-tls", "mountPath": "/etc/targetlease/valkey-tls", "readOnly": true},
            {"name": "valkey-password", "mountPath": "/etc/targetlease/valkey-password", "readOnly": true},
        ])
    );
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"],
        "valkey-client-tls"
    );
    let password = &pod["volumes"][1]["secret"];
    assert_eq!(password["secretName"], "valkey-credentials");
    assert_eq!(
        password["items"],
        json!([{"key": "password", "path": "password"}])
    );
    // Read-only for the pod's user and group, like the TLS files.
    assert_eq!(
        password["defaultMode"],
        pod["volumes"][0]["secret"]["defaultMode"]
    );
    // Cluster mode passes the seeds, not a URL: no URL Secret is made for it.
    let docs = tools.render_ok(&["--set", "valkey.clusterSeeds={valkey-0:6379}"]);
    assert!(of_kind(&docs, "Secret").is_empty(), "an unused URL Secret");

    // One replica on the memory backend: no election, no PDB, no Valkey Secret.
    let docs = tools.render_ok(&["-f", &file("single-replica-memory-values.yaml")]);
    let deploy = object(&docs, "Deployment", FULLNAME);
    assert_eq!(deploy["spec"]["replicas"], 1);
    let args = strings(&deploy["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(args.contains(&"--backend=memory".to_owned()), "{args:?}");
    assert!(!args.contains(&"--leader-election".to_owned()), "{args:?}");
    // The release is named whatever the backend: the namespaces it claimed on the memory store
    // stay its own when it moves to Valkey (the quick start's path).
    assert_eq!(
        env_value(&controller_env(&docs), "TARGETLEASE_INSTALLATION_ID"),
        Some(json!(format!("{RELEASE_NS}/{RELEASE}")))
    );
    assert!(of_kind(&docs, "PodDisruptionBudget").is_empty());
    assert!(of_kind(&docs, "Secret").is_empty());
    assert!(
        of_kind(&docs, "Role")
            .iter()
            .all(|role| role["metadata"]["name"] == format!("{FULLNAME}-helm-test")),
        "no leader-election Role"
    );

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
        object(&docs, "ClusterRoleBinding", &cluster_role())["subjects"][0]["name"],
        "targetlease-controller"
    );
}

/// The controller container's env of a rendering, by name.
fn controller_env(docs: &[Value]) -> Vec<(String, Value)> {
    object(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (e["name"].as_str().unwrap_or_default().to_owned(), e.clone()))
        .collect()
}

/// The `value` of one env var, None when the var is absent.
fn env_value(env: &[(String, Value)], name: &str) -> Option<Value> {
    env.iter()
        .find(|(n, _)| n == name)
        .map(|(_, e)| e["value"].clone())
}

fn sentinel_values_pass_the_sentinels_not_the_url(tools: &Tools) {
    let file = chart_dir()
        .join("ci/sentinel-values.yaml")
        .display()
        .to_string();
    let docs = tools.render_ok(&["-f", &file]);
    let env = controller_env(&docs);
    let value = |name: &str| env_value(&env, name).unwrap_or_else(|| panic!("no env {name}"));
    assert_eq!(
        value("TARGETLEASE_VALKEY_SENTINELS"),
        "store-valkey-node-0.store-valkey-headless.valkey.svc:26379,\
         store-valkey-node-1.store-valkey-headless.valkey.svc:26379,\
         store-valkey-node-2.store-valkey-headless.valkey.svc:26379"
    );
    assert_eq!(value("TARGETLEASE_VALKEY_SENTINEL_MASTER"), "myprimary");
    assert_eq!(
        value("TARGETLEASE_VALKEY_SENTINEL_PASSWORD_FILE"),
        "/etc/targetlease/valkey-sentinel-password/password"
    );
    // The data password stays the data password, from its own mount.
    assert_eq!(
        value("TARGETLEASE_VALKEY_PASSWORD_FILE"),
        "/etc/targetlease/valkey-password/password"
    );
    assert_eq!(
        value("TARGETLEASE_VALKEY_TLS_SERVER_NAME"),
        "store-valkey.valkey.svc"
    );
    // The controller refuses a URL or seeds beside the sentinels, and a password in the env
    // would show in the pod spec.
    for absent in [
        "TARGETLEASE_VALKEY_URL",
        "TARGETLEASE_VALKEY_CLUSTER_SEEDS",
        "TARGETLEASE_VALKEY_SENTINEL_PASSWORD",
        "TARGETLEASE_VALKEY_SENTINEL_USERNAME",
    ] {
        assert!(
            !env.iter().any(|(n, _)| n == absent),
            "{absent} in a Sentinel rendering"
        );
    }
    let pod = &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"];
    let mounts = &pod["containers"][0]["volumeMounts"];
    assert_eq!(
        mounts[2],
        json!({"name": "valkey-sentinel-password", "mountPath": "/etc/targetlease/valkey-sentinel-password", "readOnly": true}),
        "{mounts}"
    );
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "valkey-sentinel-password")
        .expect("the sentinel password volume");
    assert_eq!(volume["secret"]["secretName"], "store-valkey");
    assert_eq!(
        volume["secret"]["items"],
        json!([{"key": "valkey-password", "path": "password"}])
    );
    // Read-only for the pod's user and group, like the data password.
    let data = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "valkey-password")
        .expect("the data password volume");
    assert_eq!(
        volume["secret"]["defaultMode"],
        data["secret"]["defaultMode"]
    );
    // No URL is passed, so no URL Secret and no checksum of one.
    assert!(of_kind(&docs, "Secret").is_empty(), "an unused URL Secret");
    let annotations =
        &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["annotations"];
    assert!(
        annotations.get("checksum/valkey-url").is_none(),
        "{annotations}"
    );
    // The NetworkPolicy of the example lets the controller reach the sentinels and the data
    // port they announce.
    let egress = object(&docs, "NetworkPolicy", FULLNAME)["spec"]["egress"].to_string();
    for port in ["26379", "6379"] {
        assert!(egress.contains(&format!("\"port\":{port}")), "{egress}");
    }

    // The default valkey.url left in place: still no URL, no Secret. A user on the sentinels,
    // an IPv6 sentinel, no sentinel password: no mount.
    let docs = tools.render_ok(&[
        "--set",
        "valkey.sentinel.addresses={[fd00::7]:26379,valkey-sentinel:26379}",
        "--set",
        "valkey.sentinel.masterName=mymaster",
        "--set",
        "valkey.sentinel.username=sentinel",
    ]);
    let env = controller_env(&docs);
    assert_eq!(
        env_value(&env, "TARGETLEASE_VALKEY_SENTINELS"),
        Some(json!("[fd00::7]:26379,valkey-sentinel:26379"))
    );
    assert_eq!(
        env_value(&env, "TARGETLEASE_VALKEY_SENTINEL_USERNAME"),
        Some(json!("sentinel"))
    );
    for absent in [
        "TARGETLEASE_VALKEY_URL",
        "TARGETLEASE_VALKEY_SENTINEL_PASSWORD_FILE",
        "TARGETLEASE_VALKEY_TLS_SERVER_NAME",
    ] {
        assert!(!env.iter().any(|(n, _)| n == absent), "{absent}");
    }
    assert!(of_kind(&docs, "Secret").is_empty(), "an unused URL Secret");
    let pod = &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"];
    assert!(pod["volumes"].is_null(), "{}", pod["volumes"]);

    // Without sentinels nothing of Sentinel is passed (the default rendering).
    let env = controller_env(&tools.render_ok(&[]));
    assert!(
        !env.iter()
            .any(|(n, _)| n.starts_with("TARGETLEASE_VALKEY_SENTINEL")),
        "{env:?}"
    );
}

fn etcd_values_pass_the_members_not_valkey(tools: &Tools) {
    let file = chart_dir()
        .join("ci/etcd-values.yaml")
        .display()
        .to_string();
    let docs = tools.render_ok(&["-f", &file]);
    let deploy = object(&docs, "Deployment", FULLNAME);
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert!(strings(&c["args"]).contains(&"--backend=etcd".to_owned()));
    let env = controller_env(&docs);
    let value = |name: &str| env_value(&env, name).unwrap_or_else(|| panic!("no env {name}"));
    assert_eq!(
        value("TARGETLEASE_ETCD_ENDPOINTS"),
        "https://etcd-0.etcd.etcd.svc:2379,https://etcd-1.etcd.etcd.svc:2379,\
         https://etcd-2.etcd.etcd.svc:2379"
    );
    assert_eq!(value("TARGETLEASE_ETCD_KEY_PREFIX"), "targetlease-prod");
    assert_eq!(value("TARGETLEASE_ETCD_TIMEOUT"), "2s");
    assert_eq!(value("TARGETLEASE_ETCD_USERNAME"), "targetlease");
    assert_eq!(
        value("TARGETLEASE_ETCD_PASSWORD_FILE"),
        "/etc/targetlease/etcd-password/password"
    );
    assert_eq!(
        value("TARGETLEASE_ETCD_TLS_CA_FILE"),
        "/etc/targetlease/etcd-tls/ca.crt"
    );
    assert_eq!(
        value("TARGETLEASE_ETCD_TLS_CERT_FILE"),
        "/etc/targetlease/etcd-tls/tls.crt"
    );
    assert_eq!(
        value("TARGETLEASE_ETCD_TLS_KEY_FILE"),
        "/etc/targetlease/etcd-tls/tls.key"
    );
    // Nothing of Valkey: no URL, no Secret of the chart, no checksum of one; no password in
    // the environment.
    assert!(
        !env.iter()
            .any(|(n, _)| n.starts_with("TARGETLEASE_VALKEY_") || n == "TARGETLEASE_ETCD_PASSWORD"),
        "{env:?}"
    );
    assert!(of_kind(&docs, "Secret").is_empty(), "an unused URL Secret");
    let pod = &deploy["spec"]["template"]["spec"];
    let volumes = pod["volumes"].as_array().expect("volumes");
    let volume = |name: &str| {
        volumes
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    };
    assert_eq!(
        volume("etcd-tls")["secret"]["secretName"],
        "targetlease-etcd-tls"
    );
    assert_eq!(
        volume("etcd-password")["secret"]["secretName"],
        "targetlease-etcd"
    );
    assert_eq!(
        volume("etcd-password")["secret"]["items"],
        json!([{"key": "password", "path": "password"}])
    );
    // Read-only for the pod's user and group, like Valkey's (0440, octal in Kubernetes' YAML).
    for v in volumes {
        assert_eq!(v["secret"]["defaultMode"], "0440", "{v}");
    }
    let egress = object(&docs, "NetworkPolicy", FULLNAME)["spec"]["egress"].to_string();
    assert!(egress.contains("\"port\":2379"), "{egress}");

    // Endpoints alone: the defaults, no mount.
    let docs = tools.render_ok(&[
        "--set",
        "controller.backend=etcd",
        "--set",
        "etcd.endpoints={http://etcd:2379}",
    ]);
    let env = controller_env(&docs);
    assert_eq!(
        env_value(&env, "TARGETLEASE_ETCD_KEY_PREFIX"),
        Some(json!("targetlease"))
    );
    for absent in [
        "TARGETLEASE_ETCD_USERNAME",
        "TARGETLEASE_ETCD_PASSWORD_FILE",
        "TARGETLEASE_ETCD_TLS_CA_FILE",
    ] {
        assert!(!env.iter().any(|(n, _)| n == absent), "{absent}");
    }
    let pod = &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"];
    assert!(pod["volumes"].is_null(), "{}", pod["volumes"]);

    // No etcd block at all, as `helm upgrade --reuse-values` from a release before it leaves
    // the values: Valkey renders as before, and etcd is refused with the value to set, not a
    // template error.
    let env = controller_env(&tools.render_ok(&["--set", "etcd=null"]));
    assert!(
        !env.iter().any(|(n, _)| n.starts_with("TARGETLEASE_ETCD_")),
        "{env:?}"
    );
    let refused = tools
        .render(&["--set", "etcd=null", "--set", "controller.backend=etcd"])
        .expect_err("etcd without endpoints");
    assert!(
        refused.contains("controller.backend=etcd needs etcd.endpoints"),
        "{refused}"
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
        "apiVersion": "targetlease.dev/v1beta1",
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
        slot: Slot::ZERO,
        acquired_at_ms: 1_764_423_912_004,
        server_time_ms: 1_764_423_912_004,
        expires_in_ms: 30_000,
    };
    // The statuses the controller writes, made by its own code.
    let held = Observed::held(&grant, Permits::ONE, "worker-7").into_status(Some(1), None, now);
    let waiting = Observed::waiting("worker-3", None).into_status(Some(1), None, now);
    let permit = Grant {
        slot: Slot::new(1).expect("slot"),
        ..grant.clone()
    };
    let three = Permits::new(3).expect("permits");
    let held_permit = Observed::held(&permit, three, "worker-8").into_status(Some(1), None, now);
    let conflict = Observed::permits_conflict(
        "shop/reports-db",
        3,
        Permits::new(2).expect("permits"),
        None,
    )
    .into_status(Some(1), None, now);
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
    let valid = std::time::Duration::from_secs(29);
    let failed =
        Observed::store_failed(Some(&held), &corrupt, valid).into_status(Some(1), None, now);
    let down = StoreError::Unavailable {
        endpoint: "valkey:6379".into(),
        cause: "connection refused".into(),
    };
    // The store down a second after the grant (the lease known valid for 29 s more), and past
    // the expiry: Held still, then Lost with the Held condition Unknown.
    let granted = Timestamp::from_millisecond(1_764_423_912_004).expect("time");
    let soon = granted + jiff::SignedDuration::from_secs(1);
    let retrying =
        Observed::store_failed(Some(&held), &down, valid).into_status(Some(1), None, soon);
    let later = granted + jiff::SignedDuration::from_secs(31);
    let unknown = Observed::store_failed(Some(&held), &down, std::time::Duration::ZERO)
        .into_status(Some(1), None, later);
    // Pending as the controller writes it: the store failed before the first acquire.
    let pending = Observed::store_failed(None, &down, std::time::Duration::ZERO).into_status(
        Some(1),
        None,
        now,
    );

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
        (
            "Waiting, another permits value in force",
            sample(Some(conflict)),
            "Progressing",
            "held under permits 3",
            "InProgress",
        ),
        (
            "Held, a permit",
            sample(Some(held_permit)),
            "Healthy",
            "in slot 1 of 3",
            "Current",
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

/// The `helm test` hook: its own ServiceAccount, a Role with exactly the workload rules of
/// `examples/rbac.yaml` and a binding of the one to the other, created before the pod (hook
/// weights), all deleted once the test passes; a restricted pod running `targetlease run` in the
/// controller image, where the controller watches; none of it with `helmTest.enabled=false`.
fn helm_test_hook_is_least_privilege_and_restricted(tools: &Tools) {
    let name = format!("{FULLNAME}-helm-test");
    let docs = tools.render_ok(&[]);
    let hooks: Vec<&Value> = docs
        .iter()
        .filter(|d| d["metadata"]["annotations"]["helm.sh/hook"].is_string())
        .collect();
    let kinds: Vec<&str> = hooks.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(kinds, ["ServiceAccount", "Role", "RoleBinding", "Pod"]);
    let weight = |d: &Value| {
        d["metadata"]["annotations"]["helm.sh/hook-weight"]
            .as_str()
            .unwrap_or("0")
            .parse::<i32>()
            .expect("a weight")
    };
    for hook in &hooks {
        let annotations = &hook["metadata"]["annotations"];
        assert_eq!(annotations["helm.sh/hook"], "test", "{hook}");
        assert_eq!(
            annotations["helm.sh/hook-delete-policy"], "before-hook-creation,hook-succeeded",
            "{hook}"
        );
        assert_eq!(hook["metadata"]["name"], name.as_str(), "{hook}");
        assert_eq!(hook["metadata"]["namespace"], RELEASE_NS, "{hook}");
        // The controller's selectors (Service, PodDisruptionBudget) must not pick the pod up.
        assert_eq!(
            hook["metadata"]["labels"]["app.kubernetes.io/component"], "helm-test",
            "{hook}"
        );
    }
    let pod = object(&docs, "Pod", &name);
    assert!(
        hooks
            .iter()
            .filter(|h| h["kind"] != "Pod")
            .all(|h| weight(h) < weight(pod)),
        "the ServiceAccount and RBAC must exist before the pod"
    );
    assert_eq!(object(&docs, "Role", &name)["rules"], workload_rules());
    let binding = object(&docs, "RoleBinding", &name);
    assert_eq!(
        binding["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name})
    );
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": name, "namespace": RELEASE_NS}])
    );
    let spec = &pod["spec"];
    assert_eq!(spec["serviceAccountName"], name.as_str());
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(spec["securityContext"]["runAsUser"], 65532);
    assert_eq!(
        spec["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let c = &spec["containers"][0];
    assert_eq!(
        c["image"],
        format!(
            "ghcr.io/targetlease/targetlease:{}",
            env!("CARGO_PKG_VERSION")
        )
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(
        strings(&c["args"]),
        [
            "run",
            &format!("--target=helm-test-{RELEASE}"),
            "--ttl=30s",
            "--wait-timeout=60s",
            "--",
            "/targetlease",
            "wait",
            "--timeout=10s"
        ]
    );
    assert_eq!(spec["activeDeadlineSeconds"], 120);
    let env: Vec<String> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| {
            e["valueFrom"]["fieldRef"]["fieldPath"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(env, ["metadata.name", "metadata.uid", "metadata.namespace"]);

    // Where the controller watches: a TargetLease elsewhere would never be reconciled.
    let docs = tools.render_ok(&[
        "--set",
        "controller.watchNamespace=shop",
        "--set",
        "helmTest.ttlSeconds=40",
        "--set",
        "helmTest.timeoutSeconds=20",
    ]);
    for kind in ["ServiceAccount", "Role", "RoleBinding", "Pod"] {
        assert_eq!(object(&docs, kind, &name)["metadata"]["namespace"], "shop");
    }
    let pod = object(&docs, "Pod", &name);
    let args = strings(&pod["spec"]["containers"][0]["args"]);
    assert!(args.contains(&"--ttl=40s".to_owned()), "{args:?}");
    assert!(args.contains(&"--wait-timeout=20s".to_owned()), "{args:?}");
    assert_eq!(pod["spec"]["activeDeadlineSeconds"], 90);

    // A list of namespaces: the controller's Role and RoleBinding in each, the list passed on,
    // the test in the first; an empty entry is refused by the schema.
    let docs = tools.render_ok(&["--set", "controller.watchNamespace=shop\\,batch"]);
    let controller_roles: Vec<&str> = docs
        .iter()
        .filter(|d| d["kind"] == "Role" && d["metadata"]["name"] == FULLNAME)
        .filter_map(|d| d["metadata"]["namespace"].as_str())
        .collect();
    assert_eq!(controller_roles, ["shop", "batch"]);
    let bindings = docs
        .iter()
        .filter(|d| d["kind"] == "RoleBinding" && d["metadata"]["name"] == FULLNAME)
        .count();
    assert_eq!(bindings, 2);
    let args = strings(
        &object(&docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0]["args"],
    );
    assert!(
        args.contains(&"--watch-namespace=shop,batch".to_owned()),
        "{args:?}"
    );
    assert_eq!(object(&docs, "Pod", &name)["metadata"]["namespace"], "shop");
    let refused = tools.render(&["--set", "controller.watchNamespace=shop\\,\\,batch"]);
    assert!(refused.is_err_and(|e| e.contains("watchNamespace")));

    let docs = tools.render_ok(&["--set", "helmTest.enabled=false"]);
    assert!(
        docs.iter()
            .all(|d| d["metadata"]["annotations"]["helm.sh/hook"].is_null()),
        "a hook with helmTest.enabled=false"
    );
}

/// GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The PrometheusRule and the dashboard ConfigMap: off by default; on, every alert has a
/// severity, a summary, a description and a runbook_url whose anchor is a heading of
/// docs/operations.md; the rule's labels and selector follow the values; the dashboard is
/// files/dashboard.json unchanged, with the sidecar's label. (Their metric names are checked
/// against a running controller in tests/controller/lifecycle.rs.)
fn alerts_and_dashboard_render_when_asked(tools: &Tools) {
    let docs = tools.render_ok(&[]);
    assert!(of_kind(&docs, "PrometheusRule").is_empty());
    assert!(of_kind(&docs, "ConfigMap").is_empty());
    let docs = tools.render_ok(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "prometheusRule.labels.release=kube-prometheus-stack",
        "--set",
        "prometheusRule.alertLabels.team=platform",
        "--set",
        "grafanaDashboard.enabled=true",
        "--set",
        "grafanaDashboard.namespace=monitoring",
    ]);
    let rule = object(&docs, "PrometheusRule", FULLNAME);
    assert_eq!(
        rule["metadata"]["labels"]["release"],
        "kube-prometheus-stack"
    );
    let operations =
        std::fs::read_to_string(repo().join("docs/operations.md")).expect("operations.md");
    let anchors: BTreeSet<String> = operations
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect();
    let rules = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules");
    let names: Vec<&str> = rules.iter().filter_map(|r| r["alert"].as_str()).collect();
    assert_eq!(
        names,
        [
            "TargetLeaseNoLeader",
            "TargetLeaseTwoLeaders",
            "TargetLeaseStoreErrors",
            "TargetLeaseLost",
            "TargetLeaseStoreSlow"
        ]
    );
    for r in rules {
        let expr = r["expr"].as_str().expect("expr");
        assert!(
            expr.contains(&format!(
                "namespace=\"{RELEASE_NS}\",job=\"{FULLNAME}-metrics\""
            )),
            "{expr}"
        );
        assert!(
            ["critical", "warning"].contains(&r["labels"]["severity"].as_str().unwrap_or("")),
            "{r}"
        );
        assert_eq!(r["labels"]["team"], "platform", "{r}");
        for key in ["summary", "description"] {
            assert!(
                r["annotations"][key]
                    .as_str()
                    .is_some_and(|t| !t.is_empty()),
                "{r}"
            );
        }
        let url = r["annotations"]["runbook_url"]
            .as_str()
            .expect("runbook_url");
        let (base, fragment) = url.split_once('#').expect("an anchor");
        assert_eq!(
            base,
            "https://github.com/targetlease/targetlease/blob/main/docs/operations.md"
        );
        assert!(
            anchors.contains(fragment),
            "{url}: docs/operations.md has no heading #{fragment}"
        );
    }
    let dashboard = object(&docs, "ConfigMap", &format!("{FULLNAME}-dashboard"));
    assert_eq!(dashboard["metadata"]["namespace"], "monitoring");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let file = std::fs::read_to_string(chart_dir().join("files/dashboard.json")).expect("file");
    assert_eq!(dashboard["data"]["targetlease.json"], file.trim_end());
    let json: Value = serde_json::from_str(&file).expect("dashboard JSON");
    assert!(json["panels"].as_array().is_some_and(|p| p.len() >= 8));

    // Without the chart's ServiceMonitor and without a selector of another scrape job, no
    // series would ever match and TargetLeaseNoLeader would page for good: refused, saying so.
    let refused = tools
        .render(&["--set", "prometheusRule.enabled=true"])
        .expect_err("alerts rendered with nothing scraping the metrics");
    assert!(
        refused.contains("metrics.serviceMonitor.enabled=true")
            && refused.contains("prometheusRule.selector")
            && refused.contains("TargetLeaseNoLeader"),
        "{refused}"
    );
    // Another scrape job, named by the selector, without the chart's ServiceMonitor.
    let docs = tools.render_ok(&[
        "--set",
        "prometheusRule.enabled=true",
        "--set-string",
        "prometheusRule.selector=job=\"tl\"",
    ]);
    let rule = object(&docs, "PrometheusRule", FULLNAME);
    for r in rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules")
    {
        let expr = r["expr"].as_str().expect("expr");
        assert!(
            expr.contains("{job=\"tl\"}") || expr.contains("{job=\"tl\","),
            "{expr}"
        );
        assert!(!expr.contains("namespace="), "{expr}");
    }
}

/// The alerts through Prometheus's own tools: `promtool check rules` parses every expression and
/// annotation template, and `promtool test rules` runs tests/chart/alerts-test.yaml (series
/// that must fire each alert, with its labels, and series that must not) against the rendered
/// rules (without their annotations, whose texts the checks above cover).
/// `helm upgrade --reuse-values` from a release without the optional blocks (the test, the
/// alerts, the dashboard) gives only what the command line sets, e.g. `helmTest.enabled=true`:
/// every other key of the block is unset (`--set KEY=null` removes a key the same way). A key the
/// output cannot do without is refused, naming it and the flag to use, rather than rendering a
/// test with no TTL or an alert with an empty `for`; every other key renders absent (one listed
/// as needed when it is not would break a plain `--reuse-values` upgrade, and one a user nulls
/// on purpose). Every key values.yaml gives each block is tried, and all of them at once.
fn optional_blocks_without_their_defaults(tools: &Tools) {
    let values: Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml"),
    )
    .expect("parse values.yaml");
    let needed: [(&str, &[&str]); 3] = [
        ("helmTest", &["ttlSeconds", "timeoutSeconds"]),
        (
            "prometheusRule",
            &["noLeaderFor", "storeLatencyRatio", "runbookBaseUrl"],
        ),
        ("grafanaDashboard", &[]),
    ];
    for (block, needed) in needed {
        let keys: Vec<&String> = values[block]
            .as_object()
            .unwrap_or_else(|| panic!("values.yaml has no {block} block"))
            .keys()
            .filter(|k| k.as_str() != "enabled")
            .collect();
        assert!(!keys.is_empty(), "{block} has no keys besides enabled");
        for key in needed {
            assert!(
                keys.iter().any(|k| k == key),
                "values.yaml lacks {block}.{key}"
            );
        }
        let enable = format!("{block}.enabled=true");
        // The alerts also need the metrics scraped (refused otherwise: see
        // alerts_and_dashboard_render_when_asked).
        let scraped = "metrics.serviceMonitor.enabled=true";
        for key in &keys {
            let unset = format!("{block}.{key}=null");
            let rendered = tools.render(&["--set", scraped, "--set", &enable, "--set", &unset]);
            match (needed.contains(&key.as_str()), rendered) {
                (true, Ok(_)) => panic!("rendered with {block}.{key} unset"),
                (true, Err(message)) => assert!(
                    message.contains(&format!("{block}.{key} unset"))
                        && message.contains("--reset-then-reuse-values"),
                    "{block}.{key} unset: {message}"
                ),
                (false, Err(message)) => {
                    panic!("{block}.{key} unset, which the output can do without: {message}")
                }
                (false, Ok(_)) => {}
            }
        }
        // A block left with `enabled` alone, as `--reuse-values --set BLOCK.enabled=true` from
        // a release without it leaves it: one message names every key it needs.
        let mut args = vec![
            "--set".to_string(),
            scraped.to_string(),
            "--set".to_string(),
            enable.clone(),
        ];
        for key in &keys {
            args.extend(["--set".to_string(), format!("{block}.{key}=null")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match tools.render(&args) {
            Ok(_) => assert!(needed.is_empty(), "{block} rendered with only enabled set"),
            Err(message) => assert!(
                !needed.is_empty()
                    && message.contains(
                        &needed
                            .iter()
                            .map(|k| format!("{block}.{k}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                "{block} with only enabled set: {message}"
            ),
        }
    }
}

fn alerts_pass_promtool(tools: &Tools) {
    let docs = tools.render_ok(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
    ]);
    let spec = object(&docs, "PrometheusRule", FULLNAME)["spec"].clone();
    let dir = tempfile::tempdir().expect("temp dir");
    let promtool = |args: &[&str]| {
        let out = std::process::Command::new(promtool())
            .args(args)
            .current_dir(dir.path())
            .output()
            .expect("run promtool");
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        stdout(&out)
    };
    std::fs::write(dir.path().join("rules.json"), spec.to_string()).expect("write");
    let checked = promtool(&["check", "rules", "rules.json"]);
    assert!(checked.contains("SUCCESS: 5 rules found"), "{checked}");
    let mut bare = spec;
    for rule in bare["groups"][0]["rules"].as_array_mut().expect("rules") {
        rule.as_object_mut().expect("rule").remove("annotations");
    }
    std::fs::write(dir.path().join("alerts.rules.json"), bare.to_string()).expect("write");
    std::fs::copy(
        repo().join("tests/chart/alerts-test.yaml"),
        dir.path().join("alerts-test.yaml"),
    )
    .expect("copy the alert tests");
    let tested = promtool(&["test", "rules", "alerts-test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Every panel query of the dashboard parses as PromQL (`promtool check rules` on each as a
/// recording rule, Grafana's `$__rate_interval` given as 5m; `$job` is inside a regex string).
fn dashboard_queries_parse() {
    let file = std::fs::read_to_string(chart_dir().join("files/dashboard.json")).expect("file");
    let dashboard: Value = serde_json::from_str(&file).expect("dashboard JSON");
    // Every panel reads only the chosen controllers: one release name in two namespaces gives
    // two installations one `job`.
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(
        variables.contains(&"job") && variables.contains(&"namespace"),
        "{variables:?}"
    );
    // "All" as `.*`, which also matches a series without the label (a scrape that adds no
    // `namespace`); Grafana's default, the listed values joined, would drop those as soon as
    // another series has one.
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if matches!(variable["name"].as_str(), Some("job" | "namespace")) {
            assert_eq!(variable["allValue"], ".*", "{variable}");
        }
    }
    let chosen = r#"{job=~"$job",namespace=~"$namespace""#;
    let mut rules = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            for (at, _) in expr.match_indices("targetlease_") {
                let selector =
                    expr[at..].trim_start_matches(|c: char| c.is_ascii_lowercase() || c == '_');
                assert!(
                    selector.starts_with(chosen),
                    "a series of {expr:?} is not selected by {chosen}"
                );
            }
            let record = format!("dashboard:query_{}", rules.len());
            rules.push(json!({"record": record, "expr": expr.replace("$__rate_interval", "5m")}));
        }
    }
    assert!(rules.len() >= 10, "{} queries", rules.len());
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("dashboard.rules.json");
    let groups = json!({"groups": [{"name": "dashboard", "rules": rules}]});
    std::fs::write(&path, groups.to_string()).expect("write");
    let out = std::process::Command::new(promtool())
        .args(["check", "rules", &path.display().to_string()])
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool check rules (dashboard queries):\n{}{}",
        stdout(&out),
        stderr(&out)
    );
}

/// A test that needs the tools only.
type StaticTest = (&'static str, fn(&Tools));

/// Artifact Hub's annotations: the license is the crate's, the image is the controller's at
/// appVersion, the CRD and its example are the committed CRD's kind at a version it serves (the
/// example deserializes as a TargetLease), and the changes are CHANGELOG.md's section of this
/// version.
fn artifact_hub_annotations() {
    let chart: Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart_dir().join("Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("parse Chart.yaml");
    let annotations = &chart["annotations"];
    let listed = |key: &str| -> Vec<Value> {
        let text = annotations[key]
            .as_str()
            .unwrap_or_else(|| panic!("Chart.yaml lacks the annotation {key}"));
        serde_yaml::from_str(text).unwrap_or_else(|e| panic!("{key} is no YAML list: {e}"))
    };
    assert_eq!(
        annotations["artifacthub.io/license"],
        env!("CARGO_PKG_LICENSE")
    );
    let app_version = chart["appVersion"].as_str().expect("appVersion");
    let images = listed("artifacthub.io/images");
    assert_eq!(images.len(), 1, "{images:?}");
    assert_eq!(
        images[0]["image"],
        format!("ghcr.io/targetlease/targetlease:{app_version}")
    );

    let crd: Value = serde_yaml::from_str(
        &std::fs::read_to_string(repo().join("crds/targetlease.dev_targetleases.yaml"))
            .expect("the CRD"),
    )
    .expect("parse the CRD");
    let kind = crd["spec"]["names"]["kind"].as_str().expect("kind");
    let group = crd["spec"]["group"].as_str().expect("group");
    let served: Vec<&str> = crd["spec"]["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .filter(|v| v["served"] == json!(true))
        .filter_map(|v| v["name"].as_str())
        .collect();
    let crds = listed("artifacthub.io/crds");
    assert_eq!(crds.len(), 1, "{crds:?}");
    assert_eq!(crds[0]["kind"], kind);
    assert_eq!(crds[0]["name"], crd["metadata"]["name"]);
    let version = crds[0]["version"].as_str().expect("version");
    assert!(
        served.contains(&version),
        "{version} is not served: {served:?}"
    );
    for key in ["displayName", "description"] {
        assert!(crds[0][key].is_string(), "artifacthub.io/crds lacks {key}");
    }
    let examples = listed("artifacthub.io/crdsExamples");
    assert!(!examples.is_empty());
    for example in examples {
        assert_eq!(example["kind"], kind);
        let api_version = example["apiVersion"].as_str().expect("apiVersion");
        assert_eq!(api_version, format!("{group}/{version}"));
        serde_json::from_value::<targetlease::api::TargetLease>(example.clone())
            .unwrap_or_else(|e| panic!("the example is no TargetLease: {e}\n{example}"));
    }

    let section = support::release::changelog_section(env!("CARGO_PKG_VERSION"));
    let expected: Vec<Value> = support::release::changelog_changes(&section)
        .into_iter()
        .map(|(kind, description)| json!({"kind": kind, "description": description}))
        .collect();
    assert!(!expected.is_empty(), "the CHANGELOG section lists nothing");
    assert_eq!(
        listed("artifacthub.io/changes"),
        expected,
        "artifacthub.io/changes is not CHANGELOG.md's section of this version"
    );
    let links = listed("artifacthub.io/links");
    assert!(
        links.iter().all(|l| l["name"].is_string()
            && l["url"].as_str().is_some_and(|u| u.starts_with("https://"))),
        "{links:?}"
    );
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let tools = Arc::new(Tools::load());
    let tests: Vec<StaticTest> = vec![
        ("lint_default_and_ci_values", lint_default_and_ci_values),
        (
            "default_render_is_hardened_and_least_privilege",
            default_render_is_hardened_and_least_privilege,
        ),
        (
            "ci_values_render_what_they_ask_for",
            ci_values_render_what_they_ask_for,
        ),
        (
            "sentinel_values_pass_the_sentinels_not_the_url",
            sentinel_values_pass_the_sentinels_not_the_url,
        ),
        (
            "etcd_values_pass_the_members_not_valkey",
            etcd_values_pass_the_members_not_valkey,
        ),
        ("schema_refuses_bad_values", schema_refuses_bad_values),
        (
            "helm_test_hook_is_least_privilege_and_restricted",
            helm_test_hook_is_least_privilege_and_restricted,
        ),
        (
            "alerts_and_dashboard_render_when_asked",
            alerts_and_dashboard_render_when_asked,
        ),
        ("alerts_pass_promtool", alerts_pass_promtool),
        (
            "optional_blocks_without_their_defaults",
            optional_blocks_without_their_defaults,
        ),
        ("dashboard_queries_parse", |_| dashboard_queries_parse()),
        ("chart_crd_matches_crds_dir", chart_crd_matches_crds_dir),
        ("chart_versions_match_the_crate", |_| {
            chart_versions_match_the_crate()
        }),
        ("artifact_hub_annotations", |_| artifact_hub_annotations()),
        ("argocd_health_of_sample_statuses", |_| {
            argocd_health_of_sample_statuses()
        }),
        ("kstatus_of_sample_statuses", kstatus_of_sample_statuses),
        ("examples_are_well_formed", examples_are_well_formed),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            let tools = tools.clone();
            suite::trial(name, move || async move { test(&tools) })
        })
        .collect();
    suite::run(args, trials)
}
