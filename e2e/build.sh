#!/usr/bin/env bash
# Build the e2e control-plane and node binaries from pinned Go modules (see e2e/README.md).
#
#   e2e/build.sh                build what is missing for the current pins
#   e2e/build.sh --bin-dir      print the binary folder of the current pins (no build)
#   e2e/build.sh --check        exit 0 if every binary of the current pins is there
#   e2e/build.sh --force        rebuild every binary
#   e2e/build.sh --prune        remove binary folders of other (old) pins
#
# Binaries land in $TARGETLEASE_E2E_BIN_ROOT/<pin-hash>/ (default
# ~/.cache/targetlease/e2e-bin/<pin-hash>/, outside the work tree so a fresh clone reuses it). The hash covers e2e/versions.env, every
# file under e2e/tools/, the Go version and the build flags, so a pin change
# gives a new folder and a rebuild; otherwise nothing is rebuilt.
# The normal Go module and build caches are used too.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$E2E_DIR")"
TOOLS_DIR="$E2E_DIR/tools"
BIN_ROOT="${TARGETLEASE_E2E_BIN_ROOT:-${TARGETLEASE_CACHE_DIR:-$HOME/.cache/targetlease}/e2e-bin}"
JOBS="${TARGETLEASE_E2E_BUILD_JOBS:-2}"

die() { echo "e2e/build.sh: error: $*" >&2; exit 1; }
say() { echo "e2e/build.sh: $*" >&2; }

# shellcheck source=versions.env
source "$E2E_DIR/versions.env"

# --- Go toolchain ------------------------------------------------------------
if [[ -n "${GO_TOOLCHAIN:-}" ]]; then export GOTOOLCHAIN="$GO_TOOLCHAIN"; fi
GO="$(command -v go || true)"
if [[ -z "$GO" && -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go; fi
[[ -n "$GO" ]] || die "no 'go' on PATH (and no /usr/local/go/bin/go); Go >= $GO_MIN_VERSION is needed"
export CGO_ENABLED=0 # static binaries, as upstream builds them; also faster

go_version() { (cd "$TOOLS_DIR/kubernetes" && "$GO" env GOVERSION); }

# --- what is built -------------------------------------------------------------
# name|module dir|package|build tags|extra ldflags
kube_x="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=$KUBE_MAJOR -X k8s.io/component-base/version.gitMinor=$KUBE_MINOR -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.gitCommit="
kube_x+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBE_VERSION -X k8s.io/client-go/pkg/version.gitMajor=$KUBE_MAJOR -X k8s.io/client-go/pkg/version.gitMinor=$KUBE_MINOR -X k8s.io/client-go/pkg/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitCommit="
# containerd as its release binaries are built (static, no btrfs/devmapper/zfs snapshotters);
# the shim also without gRPC (ttrpc only), as upstream's Makefile builds it.
ctd_tags="urfave_cli_no_docs,osusergo,netgo,static_build,no_btrfs,no_devmapper,no_zfs"
ctd_x="-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION -X github.com/containerd/containerd/v2/version.Revision= -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2"
TARGETS=(
  "etcd|etcd|go.etcd.io/etcd/server/v3||"
  "kube-apiserver|kubernetes|k8s.io/kubernetes/cmd/kube-apiserver||$kube_x"
  "kube-controller-manager|kubernetes|k8s.io/kubernetes/cmd/kube-controller-manager||$kube_x"
  "kubectl|kubernetes|k8s.io/kubernetes/cmd/kubectl||$kube_x"
  "kstatus|kubernetes|./cmd/kstatus||"
  "helm|helm|helm.sh/helm/v4/cmd/helm||-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION -X helm.sh/helm/v4/internal/version.metadata= -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
  # the node (`e2e/cluster up --node`)
  "kube-scheduler|kubernetes|k8s.io/kubernetes/cmd/kube-scheduler||$kube_x"
  "kubelet|kubernetes|k8s.io/kubernetes/cmd/kubelet||$kube_x"
  "kube-proxy|kubernetes|k8s.io/kubernetes/cmd/kube-proxy||$kube_x"
  "pause|kubernetes|./cmd/pause||"
  "incluster|kubernetes|./cmd/incluster||"
  "containerd|containerd|github.com/containerd/containerd/v2/cmd/containerd|$ctd_tags|$ctd_x"
  "containerd-shim-runc-v2|containerd|github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2|$ctd_tags,no_grpc|$ctd_x"
  "ctr|containerd|github.com/containerd/containerd/v2/cmd/ctr|$ctd_tags|$ctd_x"
)
HASHED_FLAGS=(-trimpath -buildvcs=false)
BUILD_FLAGS=("${HASHED_FLAGS[@]}" -p "$JOBS")
BASE_LDFLAGS="-s -w"

pin_hash() {
  {
    echo "go=$(go_version) cgo=$CGO_ENABLED flags=${HASHED_FLAGS[*]} ld=$BASE_LDFLAGS"
    printf '%s\n' "${TARGETS[@]}"
    cat "$E2E_DIR/versions.env"
    (cd "$TOOLS_DIR" && find . -type f ! -name '*~' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

BIN_DIR="$BIN_ROOT/$(pin_hash)"

missing() {
  local t name
  for t in "${TARGETS[@]}"; do
    name="${t%%|*}"
    [[ -x "$BIN_DIR/$name" ]] || echo "$name"
  done
}

FORCE=0
case "${1:-}" in
  --bin-dir) echo "$BIN_DIR"; exit 0 ;;
  --check) if [[ -z "$(missing)" ]]; then exit 0; else exit 1; fi ;;
  --force) FORCE=1 ;;
  --prune)
    for d in "$BIN_ROOT"/*/; do
      d="${d%/}"
      [[ -d "$d" && "$d" != "$BIN_DIR" && -f "$d/build-stats.txt" ]] || continue
      say "removing $d"; rm -rf -- "$d"
    done
    exit 0 ;;
  "") ;;
  -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (use --bin-dir, --check, --force or nothing)" ;;
esac

mkdir -p "$BIN_DIR"
# One build at a time, even if two callers (e.g. two test runs) race.
exec 9>"$BIN_ROOT/.build.lock"
if ! flock -n 9; then
  say "another build holds $BIN_ROOT/.build.lock; waiting for it (up to 2 h)..."
  flock -w 7200 9 || die "timed out waiting for the build lock"
fi

if [[ $FORCE == 0 && -z "$(missing)" ]]; then
  say "all binaries present in $BIN_DIR"
  echo "$BIN_DIR"
  exit 0
fi

cat >&2 <<EOF
e2e/build.sh: building the e2e control plane from Go modules into
  $BIN_DIR
  pins: Kubernetes $KUBE_VERSION, etcd $ETCD_VERSION, helm $HELM_VERSION, cli-utils $CLI_UTILS_VERSION,
  containerd $CONTAINERD_VERSION, $(go_version)
Why this can take long: kube-apiserver, kube-controller-manager and kubectl
compile several thousand Go packages (all of Kubernetes); the node adds the
kubelet, kube-scheduler, kube-proxy and containerd. On a cold machine (empty Go
module and build caches) expect ~1.7 GB of module downloads and about 10
minutes of compiling on 2 cores (measured: 9.5 min, of which the node 1.5 min;
kube-apiserver alone 4 min, peak 2.6 GB RAM), more if the machine is busy;
binaries are built one at a time (go build -p $JOBS) to leave room for other
work. With a warm Go build cache a rebuild only links (~45 s); this folder is
reused, with no go command run, until a pin changes.
EOF

STATS="$BIN_DIR/build-stats.txt"
TIME_V=()
if [[ -x /usr/bin/time ]]; then TIME_V=(/usr/bin/time -v -o "$BIN_DIR/.time.tmp"); fi

total_start=$SECONDS
for t in "${TARGETS[@]}"; do
  IFS='|' read -r name mod pkg tags xflags <<<"$t"
  if [[ $FORCE == 0 && -x "$BIN_DIR/$name" ]]; then
    say "$name: present, skipped"
    continue
  fi
  say "$name: go build${tags:+ -tags $tags} $pkg (module e2e/tools/$mod) ..."
  start=$SECONDS
  tmp="$BIN_DIR/.$name.tmp"
  rm -f "$tmp"
  if ! (cd "$TOOLS_DIR/$mod" && "${TIME_V[@]}" "$GO" build "${BUILD_FLAGS[@]}" ${tags:+-tags "$tags"} \
        -ldflags "$BASE_LDFLAGS $xflags" -o "$tmp" "$pkg"); then
    rm -f "$tmp"
    die "building $name failed (see the go output above)"
  fi
  mv -f "$tmp" "$BIN_DIR/$name"
  secs=$((SECONDS - start))
  rss=""
  if [[ -f "$BIN_DIR/.time.tmp" ]]; then
    rss="$(awk -F': ' '/Maximum resident set size/{printf "%d MiB", $2/1024}' "$BIN_DIR/.time.tmp")"
    rm -f "$BIN_DIR/.time.tmp"
  fi
  size="$(du -m "$BIN_DIR/$name" | cut -f1) MiB"
  say "$name: built in ${secs}s${rss:+, peak RSS $rss}, size $size"
  echo "$(date -u +%FT%TZ) $name ${secs}s peak_rss=${rss:-?} size=$size" >>"$STATS"
done
say "done in $((SECONDS - total_start))s: $BIN_DIR"
echo "$BIN_DIR"
