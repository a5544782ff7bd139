# Sourced by the scripts that build test-reference programs from the Go module proxy (scripts/real-node/build.sh,
# scripts/istio-ref/build.sh). It guarantees the same build environment for each: the machine's Go toolchain only
# (GOTOOLCHAIN=local, never a download), no VCS stamping, and Go build and module caches of the caller's own under
# its cache dir, apart from any other Go work on the machine.
#
#   go_reference_env CACHE_DIR GOCACHE_OVERRIDE GOMODCACHE_OVERRIDE LOG_PREFIX
#   have_all DIR BINARY...      true when every BINARY is an executable in DIR
#   log MESSAGE...              to stderr, with LOG_PREFIX

go_reference_env() {
  local cache=$1
  export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
  export GOCACHE="${2:-$cache/go-build}" GOMODCACHE="${3:-$cache/go-mod}"
  mkdir -p "$cache" "$GOCACHE" "$GOMODCACHE"
  GO_REFERENCE_LOG_PREFIX=$4
}

log() { echo "$GO_REFERENCE_LOG_PREFIX: $*" >&2; }
have_all() { local d=$1; shift; for b in "$@"; do [ -x "$d/$b" ] || return 1; done; }
