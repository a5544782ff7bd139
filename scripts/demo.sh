#!/usr/bin/env bash
# The main job on one machine: a local simulation of a whole node (plugin, installer, node agent, HBONE proxy) on
# the embedded defaults, as root. Ctrl-C tears it down; the exit status says whether every step worked.
#
#   scripts/demo.sh --real-node    the same story on a real single-node Kubernetes cluster (scripts/cluster.sh):
#                                  kubectl, helm and our chart; see scripts/real-node/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "") ;;
  --real-node) exec scripts/real-node/demo.sh ;;
  *) echo "usage: $0 [--real-node]" >&2; exit 2 ;;
esac

scripts/install-deps.sh
cargo build --workspace --bins
exec target/debug/demo
