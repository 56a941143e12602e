#!/usr/bin/env bash
# The whole test suite: what README.md tells you to run and what CI (.ci/run) runs.
# Installs what it needs, then: format and lint checks, unit tests, the lease-store layer on real
# Valkey/Redis servers (contract, attacks, Cluster, Sentinel, faults, property tests, fuzzing),
# the controller layer and the packaging layer (chart, image, node, upgrades, release kit) end to
# end on local Kubernetes control planes, the benchmarks' smoke runs, the control plane's
# self-test, the docs' command blocks, and last the chaos runs, alone on the machine.
# Ends with one line `N passed, N failed`; exits non-zero on any failure or when nothing ran.
#
# Where the time goes (docs/internals/testing.md has the figures): most suites wait (for a TTL,
# a pod, a failover) rather than compute, so after one build the three layers run side by side
# in lanes, each with its own log, and the builds that only some suites need (the control
# plane's Go binaries, the release binary of the image) run in the background at a lower
# priority. The chaos runs, whose checker reads timing, run after the lanes, alone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
source scripts/env.sh

log_dir="$(mktemp -d "${TMPDIR:-/tmp}/targetlease-test.XXXXXX")"
# Each step names when it began (seconds since the start): the budget is read from these.
step() { printf '\n=== %s (at %d s)\n' "$*" "$SECONDS"; }

# Background jobs die with this script, however it ends.
background=()
stop_background() {
  local pid
  for pid in "${background[@]}"; do
    kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  done
}
trap stop_background EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# in_background NAME COMMAND...: runs COMMAND in a process group of its own, its output into
# $log_dir/NAME.out and its exit status into $log_dir/NAME.rc when it ends.
in_background() {
  local name="$1"
  shift
  setsid bash -c '"${@:3}" >"$1" 2>&1; echo $? >"$2"' _ \
    "$log_dir/$name.out" "$log_dir/$name.rc" "$@" &
  background+=("$!")
}

# finished NAME: waits for the background job NAME and returns its exit status.
finished() {
  while [[ ! -s "$log_dir/$1.rc" ]]; do sleep 1; done
  return "$(cat "$log_dir/$1.rc")"
}

step "dependencies"
bash scripts/install-test-deps.sh

step "the control plane's binaries (e2e/build.sh), in the background at a lower priority"
# About 10 minutes on 2 cores when nothing is cached, seconds otherwise. The Rust build below
# takes the cores first; e2e/build.sh holds a lock, so a suite that needs the binaries before
# they are ready waits for them.
in_background e2e-build nice -n 10 bash e2e/build.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --locked --workspace --all-targets -- -D warnings

step "no import cycle among the files of src/ (scripts/import_cycles.py)"
python3 scripts/import_cycles.py

step "build every test and benchmark (test profile)"
# The executables are then run directly: `cargo test` holds the build folder's lock while its
# tests run, which would put the lanes below one after the other.
cargo test --locked --all-targets --no-run --message-format=json-render-diagnostics \
  >"$log_dir/build.json"
executable() { # KIND NAME: the test executable of that target
  python3 - "$log_dir/build.json" "$1" "$2" <<'PY'
import json, sys
found = ""
for line in open(sys.argv[1]):
    m = json.loads(line)
    t = m.get("target", {})
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m.get("profile", {}).get("test") and t.get("name") == sys.argv[3]
            and sys.argv[2] in t.get("kind", [])):
        found = m["executable"]
print(found)
PY
}
unit="$(executable lib targetlease)"
store="$(executable test store)"
controller="$(executable test controller)"
packaging="$(executable test packaging)"
store_bench="$(executable bench store)"
controller_bench="$(executable bench controller)"
etcd_bench="$(executable bench etcd)"
for exe in "$unit" "$store" "$controller" "$packaging" "$store_bench" "$controller_bench" "$etcd_bench"; do
  [[ -x "$exe" ]] || { echo "a test executable is missing from the build's output" >&2; exit 1; }
done
# What `cargo test` gives the tests it runs: the package's folder, here and in the environment.
export CARGO_MANIFEST_DIR="$root"

step "the release binary and the controller image (scripts/image.sh), in the background at a lower priority"
# The image and node suites need them; they wait for this build rather than start one of their own.
in_background image nice -n 10 bash scripts/image.sh

step "unit tests"
"$unit" >"$log_dir/cargo-unit.log" 2>&1 || echo cargo-unit >>"$log_dir/failed"
cat "$log_dir/cargo-unit.log"

# lane NAME STEP...: runs the steps one after the other in the background, each `LOG COMMAND...`
# (space separated in one word: the log's name, then the command), every step's output into its
# log. A step that fails does not stop the lane: every suite runs, and the end counts failures.
lane_names=()
lane() {
  local name="$1"
  shift
  (
    for spec in "$@"; do
      local log="${spec%% *}" cmd="${spec#* }"
      printf '=== lane %s: %s (at %d s)\n' "$name" "$cmd" "$SECONDS" >>"$log_dir/lanes.log"
      bash -c "$cmd" >"$log_dir/$log.log" 2>&1 || echo "$log" >>"$log_dir/failed"
      printf '=== lane %s: %s done (at %d s)\n' "$name" "$log" "$SECONDS" >>"$log_dir/lanes.log"
    done
  ) &
  lane_names+=("$name")
  lane_pids+=("$!")
}
lane_pids=()

step "three lanes side by side: the store layer, the controller layer, the packaging layer"
export store controller packaging store_bench controller_bench etcd_bench log_dir
export -f finished
lane store \
  'cargo-doc cargo test --locked --doc' \
  'cargo-store "$store"' \
  'suite-bench-store "$store_bench" --smoke' \
  'suite-bench-controller "$controller_bench" --smoke' \
  'suite-bench-etcd "$etcd_bench" --smoke'
lane controller \
  'cargo-controller "$controller" --skip chaos::' \
  'suite-docs bash scripts/docs-test.sh'
# What needs no image first (the chart's suites, the control plane's self-test, which must not
# run beside the node suites: both use the node's bridge), while the image builds.
lane packaging \
  'cargo-charts "$packaging" --skip image:: --skip release:: --skip node::' \
  'suite-e2e bash e2e/selftest.sh' \
  'suite-image-build finished image || { cat "$log_dir/image.out"; exit 1; }' \
  'cargo-packaging "$packaging" --skip chart:: --skip chart-cluster::'
for pid in "${lane_pids[@]}"; do wait "$pid" || true; done
cat "$log_dir/lanes.log"

step "chaos, alone on the machine"
"$controller" chaos:: >"$log_dir/cargo-chaos.log" 2>&1 || echo cargo-chaos >>"$log_dir/failed"

step "the logs, lane by lane"
for log in cargo-doc cargo-store suite-bench-store suite-bench-controller suite-bench-etcd cargo-controller \
  suite-docs cargo-charts suite-e2e cargo-packaging cargo-chaos; do
  printf '\n=== %s\n' "$log"
  cat "$log_dir/$log.log"
done
printf '\n=== e2e/build.sh (background)\n'
tail -n 5 "$log_dir/e2e-build.out"

step "the slowest tests (where the suite's time goes)"
grep -ho 'took: [^ ]*: [0-9.]* s' "$log_dir"/cargo-*.log | awk '{print $(NF-1), $0}' |
  sort -g -r | head -15 | cut -d' ' -f2- || true

if [[ -s "$log_dir/failed" ]]; then
  echo "failed: $(tr '\n' ' ' <"$log_dir/failed")" >&2
fi
# One closing line over every suite: the `test result:` lines of the test executables, and the
# closing `[name: ]N passed, N failed` line of each script suite.
awk '
  FILENAME ~ /\/cargo-[a-z]+\.log$/ && /^test result: / { gsub(/;/, ""); p += $4; f += $6; next }
  FILENAME ~ /\/suite-[a-z-]+\.log$/ && /^([a-z0-9-]+: )?[0-9]+ passed, [0-9]+ failed/ {
    sub(/^[a-z0-9-]+: /, ""); p += $1; f += $3
  }
  END {
    printf "\n%d passed, %d failed\n", p, f
    if (f > 0 || p == 0) exit 1
  }
' "$log_dir"/cargo-*.log "$log_dir"/suite-*.log
[[ ! -s "$log_dir/failed" ]]
