#!/usr/bin/env bash
# Regenerates xds/tests/fixtures/*.bin with Istio's generated Go types (istio-fixtures/), offline from the Go module
# cache holding istio (GOMODCACHE, default the istio reference cache). Needs go; not part of CI.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export GOMODCACHE="${GOMODCACHE:-/var/cache/istio-cni-rs/istio-ref/go-mod}" GOPROXY=off GOSUMDB=off GOFLAGS=-mod=mod GOTOOLCHAIN=local
cd "$here/istio-fixtures"
go run . "$here/../tests/fixtures"
