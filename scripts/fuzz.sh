#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ (or only the TARGETs named) for SECONDS each (default 60), starting from
# the committed seeds in fuzz/corpus/<target>/; stops at the first crash, whose input libFuzzer saves under
# fuzz/artifacts/<target>/. A target is registered by its [[bin]] in fuzz/Cargo.toml: `cargo fuzz list` names it.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Works on the stable toolchain: the targets build without a sanitizer (`-s none`; the code under fuzz is safe
# Rust, so ASan would only slow it down) and RUSTC_BOOTSTRAP=1 lets stable rustc take cargo-fuzz's flags.
# Installs cargo-fuzz from crates.io, and a C++ compiler for libFuzzer, when missing.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-60}"
shift $(($# > 0 ? 1 : 0))

if ! command -v c++ >/dev/null; then
  echo "fuzz: installing g++ (libFuzzer is C++)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends g++
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
cargo fuzz build -s none
log=$(mktemp)
trap 'rm -f "$log"' EXIT
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)
for target in "${targets[@]}"; do
  echo "fuzz: $target for ${seconds}s"
  status=0
  # -timeout: one input running over 10 s is reported as a hang, like a crash.
  cargo fuzz run -s none "$target" -- -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 >"$log" 2>&1 ||
    status=$?
  # The last stats line (runs, coverage, corpus) and the verdict.
  grep -E "^#[0-9]+[[:space:]]+DONE|^Done|panicked|ERROR|SUMMARY|Test unit" "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log" >&2
    echo "fuzz: $target failed; reproduce: cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none $target artifacts/$target/<file>" >&2
    exit "$status"
  fi
done
echo "fuzz: ${targets[*]} ran ${seconds}s each, clean"
