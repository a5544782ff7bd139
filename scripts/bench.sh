#!/usr/bin/env bash
# The benchmarks (as root, on an otherwise idle machine): a release build of every binary, then the benchmark
# program with the given scenarios (all when none), which prints its tables and writes them into BENCHMARKS.md.
#   scripts/bench.sh                      # every scenario
#   scripts/bench.sh sidecar-setup --iterations 50
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cargo build --release --workspace --bins
exec target/release/node-bench "$@"
