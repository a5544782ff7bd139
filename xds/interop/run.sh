#!/usr/bin/env bash
# The xds client against grpc-go (real HTTP/2, TLS and gRPC framing of the stack istiod runs on): builds the scripted
# server in grpc-go-istiod/ (offline, from the Go module cache holding istio's dependencies) and the xds_probe
# example, runs them, and passes if the server saw the whole script: node/headers, a 3,000-workload response
# (past HTTP/2's default windows) NACKed for its one bad resource only, an ACK, an `Unavailable: transport is
# closing` end, a reconnect echoing the 3,000 held versions and not the NACKed one, a removal ACKed.
#
#   xds/interop/run.sh        (needs go; not part of CI)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
export GOMODCACHE="${GOMODCACHE:-/var/cache/istio-cni-rs/istio-ref/go-mod}" GOPROXY=off GOSUMDB=off GOFLAGS=-mod=mod GOTOOLCHAIN=local
(cd "$here/grpc-go-istiod" && go build -o "$work/grpc-go-istiod" .)
(cd "$root" && cargo build -q -p xds --example xds_probe)
probe="${CARGO_TARGET_DIR:-$root/target}/debug/examples/xds_probe"
"$work/grpc-go-istiod" -ca "$work/ca.pem" -token interop-token >"$work/addr" 2>"$work/server.log" &
server=$!
for _ in $(seq 100); do [ -s "$work/addr" ] && break; sleep 0.1; done
XDS_ADDRESS="https://$(head -1 "$work/addr")" XDS_ROOT_CA="$work/ca.pem" ALT_XDS_HOSTNAME=istiod.istio-system.svc \
  AUTH_TOKEN=interop-token POD_NAME=ztunnel-interop POD_NAMESPACE=istio-system INSTANCE_IP=10.0.0.9 \
  XDS_PROBE_SECONDS=60 "$probe" >"$work/probe.log" 2>&1 &
status=0
wait "$server" || status=$?
cat "$work/server.log"
echo "--- probe"
cat "$work/probe.log"
exit "$status"
