#!/usr/bin/env bash
# The main job on one machine: a local simulation of a whole node (plugin, installer, node agent, HBONE proxy) on
# the embedded defaults, as root. Ctrl-C tears it down; the exit status says whether every step worked.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cargo build --workspace --bins
exec target/debug/demo
