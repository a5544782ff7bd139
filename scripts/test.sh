#!/usr/bin/env bash
# THE one command that runs the whole test suite: OS deps, workspace binaries (the end-to-end tests
# exec them from target/debug), then every crate's tests.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cargo build --workspace --bins
cargo test --workspace
