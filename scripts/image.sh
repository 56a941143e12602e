#!/usr/bin/env bash
# Builds the controller image without a container daemon: the static release binary with its
# dependency list embedded (the Dockerfile's build command), a root file system like distroless "static" (CA certificates, /etc/passwd with
# the non-root user, /tmp), and an OCI image-layout tarball written by scripts/oci_image.py with
# the Dockerfile's user, entrypoint, command, port and labels.
#
#   bash scripts/image.sh            build; prints the tarball's path on stdout
#   bash scripts/image.sh --name     print the image reference only
#
# The tarball lands in $CARGO_TARGET_DIR/image/ (outside the work tree, next to the cargo cache)
# with a file naming its reference and digest beside it. Same sources, toolchain and paths: same
# binary; same binary: same image digest (entries sorted, owned by 0:0, dated SOURCE_DATE_EPOCH).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
source scripts/env.sh

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
name="ghcr.io/targetlease/targetlease:$version"
if [[ "${1:-}" == --name ]]; then echo "$name"; exit 0; fi

triple="$TARGETLEASE_TARGET"
out_dir="$CARGO_TARGET_DIR/image"
mkdir -p "$out_dir"

say() { echo "scripts/image.sh: $*" >&2; }
say "building the static binary (cargo auditable build --release --target $triple, glibc linked statically)"
# cargo-auditable embeds the crates built into the binary (its .dep-v0 section, which
# `cargo audit bin` reads): the image carries the release binary itself.
# The pinned one, run by its path (static_cargo auditable): it shapes the binary, and so the
# image digest.
if [[ ! -x "$TARGETLEASE_CARGO_AUDITABLE_ROOT/bin/cargo-auditable" ]]; then
  say "error: cargo-auditable $TARGETLEASE_PIN_CARGO_AUDITABLE is missing: run bash scripts/install-test-deps.sh"
  exit 1
fi
# scripts/env.sh has the flags (the upgrade suite builds the previous release with them too).
static_cargo auditable build --locked --release --bin targetlease >&2
binary="$CARGO_TARGET_DIR/$triple/release/targetlease"
if ! ldd "$binary" 2>&1 | grep -Eq 'statically linked|not a dynamic executable'; then
  say "error: $binary is dynamically linked"
  exit 1
fi

rootfs="$(mktemp -d "${TMPDIR:-/tmp}/targetlease-rootfs.XXXXXX")"
trap 'rm -rf "$rootfs"' EXIT
install -D -m 0555 "$binary" "$rootfs/targetlease"
install -d -m 0755 "$rootfs/etc/ssl/certs"
# The Mozilla set of Debian's ca-certificates package, in a fixed order: never this machine's
# own additions (/usr/local/share/ca-certificates, a corporate root), so every build of the
# image trusts the same roots.
shopt -s nullglob
cas=(/usr/share/ca-certificates/mozilla/*.crt)
shopt -u nullglob
((${#cas[@]} > 100)) || { say "error: Debian's ca-certificates (Mozilla set) is not installed"; exit 1; }
printf '%s\0' "${cas[@]}" | LC_ALL=C sort -z | xargs -0 awk 1 >"$rootfs/etc/ssl/certs/ca-certificates.crt"
chmod 0444 "$rootfs/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
# glibc, even linked statically, reads this to resolve host names (the Valkey URL's host).
printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
chmod 0444 "$rootfs/etc/passwd" "$rootfs/etc/group" "$rootfs/etc/nsswitch.conf"
install -d -m 1777 "$rootfs/tmp"
chmod 0755 "$rootfs" "$rootfs/etc" "$rootfs/etc/ssl"

tarball="$out_dir/targetlease-$version.oci.tar"
digest="$(python3 scripts/oci_image.py --rootfs "$rootfs" --name "$name" --out "$tarball" --dockerfile Dockerfile)"
printf '%s@%s\n' "$name" "$digest" >"$tarball.ref"
say "$name@$digest ($(du -h "$tarball" | cut -f1))"
echo "$tarball"
