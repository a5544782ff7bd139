#!/usr/bin/env bash
# THE one command that runs the whole test suite: OS deps, workspace binaries (the end-to-end tests
# exec them from target/debug), then every crate's tests, closing with one total line.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cargo build --workspace --bins
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --all-targets --no-fail-fast 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed;?$/) p += $(i-1); if ($(i) ~ /^failed;?$/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
