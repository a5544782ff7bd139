#!/usr/bin/env bash
# THE one command that runs the whole test suite: OS deps, workspace binaries (the end-to-end tests
# exec them from target/debug), then every crate's tests, closing with one total line.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cargo build --workspace --bins
# The container image's static binaries (target/static): built here, on their own, so that a failure shows its own
# error, and e2e/tests/image.rs (and the real node's image) only stage them and run podman.
scripts/build-image.sh --binaries-only
# The real node (docs/real-node.md): Kubernetes and etcd built from the Go module proxy (cached by version outside
# the clone; about 10 minutes cold on 2 cores, seconds warm). The fake-vs-real API server checks in the suite below
# need them; the real-node scenarios run after it. REAL_NODE=0 skips both for a quick local run.
real_node=${REAL_NODE:-1}
if [ "$real_node" != 0 ]; then
  scripts/real-node/build.sh all
  export REAL_NODE_REQUIRED=1
fi
# Istio's own istio-cni and install-cni (scripts/istio-ref/build.sh: the pinned istio.io/istio module, cached; about
# 4 minutes cold): e2e/tests/istio_differential.rs runs generated pods through Istio's plugin and ours and compares
# the rules; e2e/tests/istio_installer_differential.rs runs Istio's installer fixtures through both install-cnis and
# compares what each writes and leaves; e2e/tests/istio_ambient_differential.rs has Istio's ambient node agent and
# ours enroll the same pods and compares rules, probe SNAT, ZDS and annotations; with the real node, Istio's istiod
# is built too (a few minutes cold) for e2e/tests/real_node.rs's xDS test. ISTIO_REF=0 skips them.
if [ "${ISTIO_REF:-1}" != 0 ]; then
  scripts/istio-ref/build.sh
  # Istio's istiod (pilot-discovery): the real-node test of our xDS client runs against it (issue #32).
  [ "$real_node" != 0 ] && scripts/istio-ref/build.sh pilot-discovery
  export ISTIO_REF_REQUIRED=1
fi
log=$(mktemp)
soak_log=$(mktemp)
soak_pid=
# A suite stopped early (an error, Ctrl-C: background jobs of a script ignore SIGINT) takes the soak test with it.
cluster_up=
trap '[ -n "$soak_pid" ] && kill "$soak_pid" 2>/dev/null; [ -n "$cluster_up" ] && scripts/cluster.sh down; rm -f "$log" "$soak_log"' EXIT
status=0
# Every test binary is built first (diagnostics on stderr). The soak test (e2e/tests/soak.rs, SOAK_SECS,
# default 300) spends minutes mostly waiting: it then runs in the background beside the rest of the suite rather
# than after it, as cargo would run it (from its package's directory), and the rest skips it. Its output follows
# the suite's.
soak_test=the_node_agrees_with_the_api_server_after_minutes_of_chaos_and_churn
soak_bin=$(cargo test --workspace --all-targets --no-run --message-format=json-render-diagnostics |
  sed -n 's/.*"executable":"\([^"]*\/soak-[^"]*\)".*/\1/p' | tail -n 1)
[ -x "$soak_bin" ] || { echo "test.sh: the soak test's binary was not built" >&2; exit 1; }
(trap - EXIT; cd e2e && exec "$soak_bin" --exact "$soak_test" >"$soak_log" 2>&1) &
soak_pid=$!
cargo test --workspace --all-targets --no-fail-fast -- --skip "$soak_test" 2>&1 | tee "$log" || status=$?
echo "test.sh: waiting for the soak test, running in the background since the suite started"
wait "$soak_pid" || status=$?
soak_pid=
echo "     Running tests/soak.rs (in the background)" | tee -a "$log"
tee -a "$log" <"$soak_log"
# The real-node scenarios (e2e/tests/real_node.rs): a real node comes up (reused if one already runs), our chart is
# installed on it with helm, and it is taken down again, leaving nothing behind (`down` checks).
if [ "$real_node" != 0 ]; then
  if [ -e /run/netns/istio-real-node ] && scripts/cluster.sh status | grep -q "^kubelet: running"; then
    echo "test.sh: reusing the real node that already runs (scripts/cluster.sh down to stop it)"
  else
    # What a node that died with its session left (netns, mounts, files) goes first.
    [ -e /run/netns/istio-real-node ] && { scripts/cluster.sh down || true; }
    cluster_up=1
    scripts/cluster.sh up >/dev/null
  fi
  # --workspace, not -p e2e: the features are unified as in the suite's build, so nothing is compiled again.
  cargo test --workspace --test real_node --no-fail-fast -- --test-threads=1 2>&1 | tee -a "$log" || status=$?
  if [ -n "$cluster_up" ]; then
    scripts/cluster.sh down || status=$?
    cluster_up=
  fi
fi
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed;?$/) p += $(i-1); if ($(i) ~ /^failed;?$/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
