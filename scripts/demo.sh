#!/usr/bin/env bash
# The main job on one machine: a local single-node demo of the plugin on its embedded defaults (as root).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cargo build --workspace --bins
exec target/debug/demo
