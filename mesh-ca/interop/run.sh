#!/usr/bin/env bash
# The CA client against grpc-go and Istio's own generated IstioCertificateService types (the stack and decoder
# istiod runs on): builds the server in grpc-go-ca/ (offline, from the Go module cache holding istio's
# dependencies) and the ca_probe example, runs them, and passes if the server decoded the request as istiod does
# (bearer token, clusterid, ImpersonatedIdentity read with GetStringValue, validity_duration, a P-256 ECDSA-SHA256
# CSR whose only name is the identity's URI SAN) and the probe verified the chain it answered.
#
#   mesh-ca/interop/run.sh        (needs go; not part of CI)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
export GOMODCACHE="${GOMODCACHE:-/var/cache/istio-cni-rs/istio-ref/go-mod}" GOPROXY=off GOSUMDB=off GOFLAGS=-mod=mod GOTOOLCHAIN=local
(cd "$here/grpc-go-ca" && go build -o "$work/grpc-go-ca" .)
(cd "$root" && cargo build -q -p mesh-ca --example ca_probe)
probe="${CARGO_TARGET_DIR:-$root/target}/debug/examples/ca_probe"
identity=spiffe://cluster.local/ns/default/sa/bookinfo
"$work/grpc-go-ca" -ca "$work/ca.pem" -token interop-token -identity "$identity" -ttl 43200 >"$work/addr" 2>"$work/server.log" &
server=$!
for _ in $(seq 100); do [ -s "$work/addr" ] && break; sleep 0.1; done
probe_status=0
CA_ADDRESS="https://$(head -1 "$work/addr")" CA_ROOT_CA="$work/ca.pem" ALT_CA_HOSTNAME=istiod.istio-system.svc \
  AUTH_TOKEN=interop-token SECRET_TTL=12h CA_PROBE_IDENTITY="$identity" "$probe" || probe_status=$?
status=0
wait "$server" || status=$?
cat "$work/server.log"
[ "$status" -eq 0 ] && [ "$probe_status" -eq 0 ]
