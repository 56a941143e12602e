#!/usr/bin/env bash
# The whole test suite: what README.md tells you to run and what CI (.ci/run) runs.
# Installs what it needs, then: format and lint checks, unit tests, the lease-store contract
# suite on real Valkey/Redis servers, property tests and fuzzing, the controller and the Helm
# chart end to end on a local Kubernetes control plane, the benchmarks' smoke runs, the control
# plane's self-test, and the docs' command blocks.
# Ends with one line `N passed, N failed`; exits non-zero on any failure or when nothing ran.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
source scripts/env.sh

log_dir="$(mktemp -d "${TMPDIR:-/tmp}/targetlease-test.XXXXXX")"
# Each step names when it began (seconds since the start): the budget is read from these.
step() { printf '\n=== %s (at %d s)\n' "$*" "$SECONDS"; }

step "dependencies"
bash scripts/install-test-deps.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --locked --workspace --all-targets -- -D warnings

step "cargo test (unit, lease-store contract, model and fuzz tests on real servers, controller and chart end to end)"
# Into a file, not a pipe: a process a test leaves behind with the test's output inherited
# would hold a pipe open, and `tee` would wait for it past every time limit.
cargo_status=0
cargo test --locked >"$log_dir/cargo.log" 2>&1 || cargo_status=$?
cat "$log_dir/cargo.log"
if ((cargo_status != 0)); then
  echo "cargo test failed (exit $cargo_status)" >&2
  exit "$cargo_status"
fi

step "benchmark smoke runs (test profile; tiny sizes; checks that numbers come out, never speed)"
# The test profile the step above built: a release build of the crate and the test support for
# benchmarks whose speed nobody reads here would cost two minutes of every run (the image and
# release suites build and check the release binary).
{
  cargo test --locked --bench store -- --smoke
  cargo test --locked --bench controller -- --smoke
} 2>&1 | tee "$log_dir/suite-bench.log"

step "local Kubernetes control plane self-test"
bash e2e/selftest.sh 2>&1 | tee "$log_dir/suite-e2e.log"

step "docs: every command block of README.md and docs/ run as a user would"
bash scripts/docs-test.sh 2>&1 | tee "$log_dir/suite-docs.log"

step "the slowest tests (where the suite's time goes)"
grep -ho 'took: [^ ]*: [0-9.]* s' "$log_dir/cargo.log" | sort -t: -k3 -g -r | head -15 || true

# One closing line over every suite: cargo's `test result:` lines, and the closing
# `[name: ]N passed, N failed` line of each script suite.
awk '
  FILENAME ~ /cargo\.log$/ && /^test result: / { gsub(/;/, ""); p += $4; f += $6; next }
  FILENAME ~ /suite-/ && /^([a-z0-9-]+: )?[0-9]+ passed, [0-9]+ failed/ {
    sub(/^[a-z0-9-]+: /, ""); p += $1; f += $3
  }
  END {
    printf "\n%d passed, %d failed\n", p, f
    if (f > 0 || p == 0) exit 1
  }
' "$log_dir/cargo.log" "$log_dir"/suite-*.log
