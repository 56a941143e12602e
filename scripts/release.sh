#!/usr/bin/env bash
# Builds the release kit of the checked-out commit: what a platform team takes.
#
#   bash scripts/release.sh [--out DIR] [--allow-dirty]
#
# DIR (default target/release-kit/<version>) receives:
#   targetlease-<version>-<triple>       the static binary, its dependency list embedded
#                                        (cargo-auditable's .dep-v0 section)
#   targetlease-<version>.oci.tar        the controller image (scripts/image.sh), whose binary
#                                        is the one above
#   targetlease-<version>.cdx.json       CycloneDX 1.5 SBOM of the crates built in (scripts/sbom.py)
#   targetlease-<version>.tgz            the Helm chart (helm package)
#   RELEASE_NOTES.md                     the version's section of CHANGELOG.md
#   LICENSE
#   SHA256SUMS                           `sha256sum -c SHA256SUMS` checks every file above
#
# It refuses, before building anything, a tree with uncommitted changes or untracked files
# (unless --allow-dirty: the kit then names a commit it was not built from), a chart whose
# version or appVersion is not Cargo.toml's version, and a version without a CHANGELOG.md
# section. Only the package registries are reached (cargo, and e2e/build.sh for helm).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
source scripts/env.sh

say() { echo "scripts/release.sh: $*" >&2; }
fail() { say "error: $*"; exit 1; }

out="" allow_dirty=false
while (($#)); do
  case "$1" in
    --out) [[ $# -ge 2 ]] || fail "--out needs a folder"; out="$2"; shift 2 ;;
    --allow-dirty) allow_dirty=true; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) fail "unknown argument $1 (see --help)" ;;
  esac
done

git rev-parse --verify -q HEAD >/dev/null 2>&1 || fail "$root is not a git checkout: a release names its commit"
commit="$(git rev-parse HEAD)"
dirty="$(git status --porcelain --untracked-files=normal)"
if [[ -n "$dirty" ]]; then
  if ! $allow_dirty; then
    say "error: the work tree has changes that commit $commit does not (commit or stash them, or pass --allow-dirty):"
    printf '%s\n' "$dirty" | head -20 >&2
    exit 1
  fi
  say "warning: building from a dirty tree (--allow-dirty): the kit names commit $commit but holds uncommitted changes"
fi

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
[[ -n "$version" ]] || fail "no version in Cargo.toml"
chart_field() { sed -n "s/^$1: *\"\{0,1\}\([^\"]*\)\"\{0,1\} *$/\1/p" charts/targetlease/Chart.yaml | head -1; }
chart_version="$(chart_field version)" app_version="$(chart_field appVersion)"
[[ "$chart_version" == "$version" && "$app_version" == "$version" ]] ||
  fail "charts/targetlease/Chart.yaml has version '$chart_version' and appVersion '$app_version'; Cargo.toml has $version: set both to $version"

# The section `## [<version>] ...` up to the next `## [` (the blank lines before it dropped).
notes="$(awk -v v="$version" '
  index($0, "## [" v "]") == 1 { on = 1; print; next }
  on && /^## \[/ { exit }
  on { print }
' CHANGELOG.md 2>/dev/null)"
[[ "$(printf '%s\n' "$notes" | sed 1d | tr -d '[:space:]')" != "" ]] ||
  fail "CHANGELOG.md has no section '## [$version]' with content: write the release notes first"

out="${out:-target/release-kit/$version}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# A folder that holds something other than an earlier kit is not overwritten.
if [[ -n "$(ls -A "$out")" && ! -f "$out/SHA256SUMS" ]]; then
  fail "$out is not empty and holds no earlier kit (no SHA256SUMS): choose another --out"
fi
find "$out" -mindepth 1 -delete

triple="$TARGETLEASE_TARGET"
epoch="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct HEAD)}"
say "release $version of commit $commit into $out"

# The image's build is the release build: one static binary, with its dependency list, serves
# both the image and the kit.
tarball="$(bash scripts/image.sh)"
binary="$CARGO_TARGET_DIR/$triple/release/targetlease"
want="targetlease $version (commit ${commit:0:12},"
got="$("$binary" --version)"
[[ "$got" == "$want"* ]] || fail "$binary says '$got', not '$want ...': a stale build"
install -m 0755 "$binary" "$out/targetlease-$version-$triple"
install -m 0644 "$tarball" "$out/targetlease-$version.oci.tar"

say "SBOM of the crates built into the binary"
python3 scripts/sbom.py --target "$triple" --out "$out/targetlease-$version.cdx.json" \
  --commit "$commit" --epoch "$epoch"

say "packaging the chart"
helm="$(bash e2e/build.sh)/helm"
"$helm" package charts/targetlease --version "$version" --app-version "$version" \
  --destination "$out" >&2
[[ -f "$out/targetlease-$version.tgz" ]] || fail "helm package wrote no targetlease-$version.tgz"

printf '%s\n' "$notes" >"$out/RELEASE_NOTES.md"
install -m 0644 LICENSE "$out/LICENSE"

(cd "$out" && find . -maxdepth 1 -type f ! -name SHA256SUMS -printf '%f\n' | LC_ALL=C sort |
  xargs sha256sum >SHA256SUMS)
say "done: $(wc -l <"$out/SHA256SUMS") artifacts; check them with (cd $out && sha256sum -c SHA256SUMS)"
echo "$out"
