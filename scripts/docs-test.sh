#!/usr/bin/env bash
# Runs every command block of the user docs (```sh fences in README.md, docs/*.md and
# docs/reference/*.md) as a user would type it, against a real local control plane, Valkey and
# the controller, with the chart installed as release `targetlease` in `targetlease-system` (its
# pods never run: the control plane has no node; the controller runs on this host). Pages in the
# other folders of docs/ are not run here: docs/quickstart/ and docs/upgrading/ need a cluster
# the reader owns and a release kit, docs/internals/ is for contributors.
# The blocks of one file run in order in one shell (later blocks may use what earlier ones set).
# First, every relative Markdown link and anchor of the repository must resolve
# (scripts/md_links.py); that check counts as one more result.
# Prints `docs: N passed, N failed`; exits non-zero on a failure or when no block ran.
#
# Blocks that are not run, and why (printed as SKIP):
#   - `bash scripts/test.sh`: it is this suite's own caller (CI runs it);
#   - `cargo install` / `cargo build --release`: the suite builds and tests the same binary
#     (the release build is exercised by the image and release suites);
#   - `TARGETLEASE_CASES=` / `TARGETLEASE_CHAOS_SECONDS=`: the long version of a suite that
#     scripts/test.sh runs at its default length;
#   - `cargo bench`: the benchmarks take minutes; scripts/test.sh runs their smoke mode.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
source scripts/env.sh

work="$(mktemp -d "${TMPDIR:-/tmp}/targetlease-docs.XXXXXX")"
controller_pid=""
cleanup() {
  [[ -n "$controller_pid" ]] && kill "$controller_pid" 2>/dev/null && wait "$controller_pid" 2>/dev/null
  TARGETLEASE_E2E_STATE="$work/state" bash e2e/cluster down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

if python3 scripts/md_links.py . >"$work/links.log" 2>&1; then
  echo pass >>"$work/results"; echo "PASS links: $(tail -n 1 "$work/links.log")"
else
  echo fail >>"$work/results"; echo "FAIL links"; sed 's/^/     /' "$work/links.log"
fi

cargo build --locked --quiet
mkdir -p "$work/bin"
ln -s "$CARGO_TARGET_DIR/debug/targetlease" "$work/bin/targetlease"
eval "$(TARGETLEASE_E2E_STATE="$work/state" bash e2e/cluster up --valkey --owner-pid $$ --dir "$work/cluster")"
export PATH="$work/bin:$PATH"
kubectl apply --server-side -f crds/targetlease.dev_targetleases.yaml >/dev/null
kubectl wait --for=condition=Established --timeout=30s crd/targetleases.targetlease.dev >/dev/null
targetlease controller --http-addr 127.0.0.1:0 >"$work/controller.log" 2>&1 &
controller_pid=$!
# The release the pages refer to (docs/reference/rbac.md checks its ServiceAccount's rights).
helm install targetlease charts/targetlease -n targetlease-system --create-namespace \
  --take-ownership --set valkey.url="$TARGETLEASE_VALKEY_URL" >/dev/null

# Extract the blocks: one file per block, named <doc>.<n>.sh, in document order.
mkdir -p "$work/blocks"
docs=(README.md docs/*.md docs/reference/*.md)
for doc in "${docs[@]}"; do
  awk -v out="$work/blocks/$(echo "$doc" | tr '/' '_')" '
    /^```sh[[:space:]]*$/ { n++; file = sprintf("%s.%02d.sh", out, n); inside = 1; next }
    /^```/ && inside { inside = 0; close(file); next }
    inside { print > file }
  ' "$doc"
done

passed=0 failed=0 skipped=0
for doc in "${docs[@]}"; do
  prefix="$work/blocks/$(echo "$doc" | tr '/' '_')"
  shopt -s nullglob
  blocks=("$prefix".*.sh)
  shopt -u nullglob
  ((${#blocks[@]})) || continue
  # One shell per document: blocks share variables, like a reader's terminal.
  runner="$work/run-$(basename "$prefix").sh"
  : >"$runner.state"
  {
    for block in "${blocks[@]}"; do
      name="$doc block $(basename "$block" .sh | sed 's/.*\.//')"
      if grep -Eq 'scripts/test\.sh|cargo install|cargo build --release|cargo bench|TARGETLEASE_CASES=|TARGETLEASE_CHAOS_SECONDS=' "$block"; then
        printf 'echo "SKIP %s (run elsewhere: see scripts/docs-test.sh)"\necho skip >>"%s"\n' "$name" "$work/results"
        continue
      fi
      printf 'echo "RUN  %s"\n' "$name"
      # A subshell per block (so `set -e` stops the block, not the run); variables the block sets
      # are exported (set -a) and handed to the next block through a state file.
      printf 'if ( set -euo pipefail -a; cd "%s"; source "%s.state"; source "%s"; export -p >"%s.state" ) >"%s.log" 2>&1; then echo pass >>"%s/results"; echo "PASS %s"; else echo fail >>"%s/results"; echo "FAIL %s"; sed "s/^/     /" "%s.log"; fi\n' \
        "$root" "$runner" "$block" "$runner" "$block" "$work" "$name" "$work" "$name" "$block"
    done
  } >"$runner"
  bash "$runner"
done
passed=$(grep -c '^pass$' "$work/results" 2>/dev/null || true)
failed=$(grep -c '^fail$' "$work/results" 2>/dev/null || true)
skipped=$(grep -c '^skip$' "$work/results" 2>/dev/null || true)
echo "docs: ${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
[[ "${failed:-0}" -eq 0 && "${passed:-0}" -gt 0 ]]
