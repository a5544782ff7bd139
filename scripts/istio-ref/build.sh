#!/usr/bin/env bash
# Builds Istio's own Go programs from the Go module proxy, in a wrapper module of our own (separate from the
# Kubernetes one in scripts/real-node/build.sh), and caches the binaries by version outside the clone (ISTIO_REF_CACHE,
# default /var/cache/istio-cni-rs/istio-ref). A second run finds every binary cached and returns at once.
# Test references only (issue #29): nothing built here goes into our images or our code.
#
#   scripts/istio-ref/build.sh [cni|pilot-discovery|crd-file|bin-dir|version]     (default cni: istio-cni and install-cni)
#   (bin-dir and version print where the binaries are and the pinned istio.io/istio version, touching nothing;
#   crd-file prints the path of Istio's CustomResourceDefinitions in the pinned module, downloading it if needed)
#
# The version is pinned here, in one place: istio.io/istio is served only as a pseudo-version.
set -euo pipefail

ISTIO_VERSION="${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}"
# What the binaries report as their version (Istio's Makefile sets it the same way).
ISTIO_BUILD_VERSION="${ISTIO_BUILD_VERSION:-1.31-dev}"
CACHE="${ISTIO_REF_CACHE:-/var/cache/istio-cni-rs/istio-ref}"
ROOT="$CACHE/istio-$ISTIO_VERSION"
OUT="$ROOT/bin"
# Where the binaries are (or will be), for the tests: answered without touching anything.
if [ "${1:-}" = bin-dir ]; then echo "$OUT"; exit 0; fi
# The pinned version, for what reports it (the benchmark's section).
if [ "${1:-}" = version ]; then echo "$ISTIO_VERSION"; exit 0; fi

# shellcheck source=../lib/go-reference-build.sh
. "$(dirname "$0")/../lib/go-reference-build.sh"
go_reference_env "$CACHE" "${GOCACHE_ISTIO_REF:-}" "${GOMODCACHE_ISTIO_REF:-}" "istio-ref build"

# One wrapper module for every Istio target: istio.io/istio's go.mod has no replace directives, so requiring the
# pinned pseudo-version is enough. Written once; later targets add their tools to it.
wrapper() {
  local src="$ROOT/wrapper"
  if [ ! -f "$src/go.mod" ]; then
    rm -rf "$src"; mkdir -p "$src"
    (cd "$src" && go mod init example.invalid/istio-ref >/dev/null 2>&1)
    # Only the main module's godebug applies: take Istio's (if any) so the binaries behave as upstream's.
    local gm; gm=$(cd "$src" && go mod download -json "istio.io/istio@$ISTIO_VERSION" | jq -r .GoMod)
    grep -E '^godebug ' "$gm" >> "$src/go.mod" || true
  fi
  echo "$src"
}

ldflags() {
  local p=istio.io/istio/pkg/version
  echo "-s -w -X $p.buildVersion=$ISTIO_BUILD_VERSION -X $p.buildGitRevision=${ISTIO_VERSION##*-}" \
    "-X $p.buildStatus=Clean -X $p.buildTag=$ISTIO_VERSION -X $p.buildHub=localhost"
}

# build TAGS BINARY... : go build the named cmd packages into $OUT (each binary moved in only once built).
build() {
  local tags=$1; shift
  local pkgs=() b
  for b in "$@"; do
    case "$b" in
      istio-cni|install-cni) pkgs+=("istio.io/istio/cni/cmd/$b") ;;
      pilot-discovery) pkgs+=("istio.io/istio/pilot/cmd/$b") ;;
    esac
  done
  local src; src=$(wrapper)
  cd "$src"
  local tools=() p
  for p in "${pkgs[@]}"; do tools+=("$p@$ISTIO_VERSION"); done
  log "istio $ISTIO_VERSION: go get -tool ${tools[*]}"
  go get -tool "${tools[@]}"
  mkdir -p "$OUT" "$ROOT/tmp"
  log "istio $ISTIO_VERSION: go build -tags $tags $*"
  local t0=$SECONDS
  CGO_ENABLED=0 go build -trimpath -tags "$tags" -ldflags "$(ldflags)" -o "$ROOT/tmp/" "${pkgs[@]}"
  for b in "$@"; do mv "$ROOT/tmp/$b" "$OUT/$b"; done
  log "istio $ISTIO_VERSION: $* built into $OUT in $((SECONDS - t0)) s"
}

build_cni() {
  if have_all "$OUT" istio-cni install-cni; then log "istio-cni, install-cni $ISTIO_VERSION cached in $OUT"; return; fi
  build agent,disable_pgv,grpcnotrace,retrynotrace istio-cni install-cni
}

build_pilot() {
  if have_all "$OUT" pilot-discovery; then log "pilot-discovery $ISTIO_VERSION cached in $OUT"; return; fi
  build vtprotobuf,disable_pgv pilot-discovery
}

# Istio's CRDs (AuthorizationPolicy and the rest), as its base chart installs them, from the pinned module.
crd_file() {
  local dir; dir=$(go mod download -json "istio.io/istio@$ISTIO_VERSION" | jq -r .Dir)
  echo "$dir/manifests/charts/base/files/crd-all.gen.yaml"
}

case "${1:-cni}" in
  cni) build_cni ;;
  pilot-discovery) build_pilot ;;
  crd-file) crd_file ;;
  *) echo "usage: $0 [cni|pilot-discovery|crd-file|bin-dir|version]" >&2; exit 2 ;;
esac
