#!/usr/bin/env bash
# THE command that runs every Tessera test.
#
#   scripts/test.sh                # everything
#   scripts/test.sh nbd_           # extra args go to `cargo test` (here: a name filter)
#   scripts/test.sh -- --nocapture
#
# Steps: install external tools (fio, qemu-utils, libnbd-bin, nbdkit), build
# the binaries (the integration tests spawn target/ci/tessera), then run the
# workspace tests. Both use the `ci` profile (Cargo.toml): release optimisation
# without cross-crate LTO, which every test binary's link repeated and which took
# most of CI's time; `cargo test --release` runs the same tests against LTO builds.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"

section() {
  printf '\n==== %s ====\n' "$*"
}

START=$SECONDS
step_start=$SECONDS
step_done() {
  printf -- '---- %s: %ds\n' "$1" "$((SECONDS - step_start))"
  step_start=$SECONDS
}

section "install dependencies"
scripts/install-deps.sh </dev/null
step_done "install dependencies"

section "toolchain"
cargo --version
rustc --version
step_done "toolchain"

# Integration tests that live outside the tessera-cli crate cannot use
# CARGO_BIN_EXE_tessera; tell them where the built binary is.
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
export TESSERA="${TESSERA:-$TARGET_DIR/ci/tessera}"

section "format and lints (cargo fmt --check, cargo clippy -D warnings)"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# No import cycle between the files of a crate (beyond the two type-level ones the
# script allows, with reasons).
python3 scripts/import-cycles.py
# Every path and crate docs/architecture.md names exists, and its crate dependency
# list matches the Cargo.toml files.
python3 scripts/check-doc-paths.py
step_done "format and lints"

section "build (cargo build --profile ci --workspace --bins)"
cargo build --profile ci --workspace --bins
step_done "build"

section "test (cargo test --profile ci --workspace $*)"
cargo test --profile ci --workspace "$@"
step_done "test"

section "all tests passed in $((SECONDS - START))s"
