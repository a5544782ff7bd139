#!/usr/bin/env bash
# The benchmarks (as root, on an otherwise idle machine): a release build of every binary, then the benchmark
# program with the given scenarios (all when none), which prints its tables and writes them into BENCHMARKS.md.
#   scripts/bench.sh                      # every scenario
#   scripts/bench.sh sidecar-setup --iterations 50
#   scripts/bench.sh --quick              # every scenario, a few rounds each, debug build, under 2 minutes;
#                                         # only checks that the benchmark runs (CI does this), writes nothing
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
profile=release
for arg in "$@"; do
  [ "$arg" = --quick ] && profile=debug
done
# The commit being built, recorded before the build so BENCHMARKS.md names what was measured even if HEAD moves
# while the benchmark runs; "-dirty" when tracked files differ from it.
BENCH_BUILT_COMMIT=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- || BENCH_BUILT_COMMIT="$BENCH_BUILT_COMMIT-dirty"
export BENCH_BUILT_COMMIT
if [ "$profile" = release ]; then
  cargo build --release --workspace --bins
else
  cargo build --workspace --bins
fi
exec "target/$profile/node-bench" "$@"
