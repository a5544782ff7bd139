#!/usr/bin/env bash
# Builds the real node's Go programs from the Go module proxy, each in a wrapper module of our own, and caches the
# binaries by version outside the clone (REAL_NODE_CACHE, default /var/cache/istio-cni-rs/real-node). A second run
# finds every binary cached and returns at once. Test references only: nothing built here is shipped.
#
#   scripts/real-node/build.sh [k8s|etcd|crictl|all|bin-dirs]     (default all)
#
# Versions are pinned here, in one place:
#   Kubernetes  K8S_VERSION    (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy,
#                               kubectl)
#   etcd        ETCD_VERSION   (go.etcd.io/etcd/server/v3)
#   crictl      CRICTL_VERSION (sigs.k8s.io/cri-tools)
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-3.6.16}"
CRICTL_VERSION="${CRICTL_VERSION:-1.34.0}"
CACHE="${REAL_NODE_CACHE:-/var/cache/istio-cni-rs/real-node}"

# shellcheck source=../lib/go-reference-build.sh
. "$(dirname "$0")/../lib/go-reference-build.sh"
go_reference_env "$CACHE" "${GOCACHE_REAL_NODE:-}" "${GOMODCACHE_REAL_NODE:-}" "real-node build"

# The wrapper module for k8s.io/kubernetes: k/k requires every staging module at v0.0.0 and replaces it with a
# directory of its own tree; Go ignores a dependency's replaces, so our wrapper's replaces pin each one to its
# published v0.MINOR.PATCH. The list is read from the release's own go.mod, never copied by hand.
build_k8s() {
  local out="$CACHE/kubernetes-v$K8S_VERSION/bin"
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
  if have_all "$out" "${bins[@]}"; then log "kubernetes v$K8S_VERSION cached in $out"; return; fi
  local minor patch staging src
  minor=$(cut -d. -f2 <<<"$K8S_VERSION"); patch=$(cut -d. -f3 <<<"$K8S_VERSION"); staging="v0.$minor.$patch"
  src="$CACHE/kubernetes-v$K8S_VERSION/wrapper"
  rm -rf "$src"; mkdir -p "$src"; cd "$src"
  log "kubernetes v$K8S_VERSION: wrapper module in $src (staging modules at $staging)"
  go mod init example.invalid/real-node/kubernetes >/dev/null 2>&1
  local gm; gm=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | jq -r .GoMod)
  # Only the main module's godebug applies: take k/k's so the binaries behave as upstream's.
  grep -E '^godebug ' "$gm" >> go.mod || true
  local staged=0
  for m in $(awk '$2=="v0.0.0"{print $1}' "$gm"); do go mod edit "-replace=$m=$m@$staging"; staged=$((staged+1)); done
  log "kubernetes v$K8S_VERSION: $staged staging modules pinned to $staging"
  local c=k8s.io/kubernetes/cmd
  go get -tool "$c/kube-apiserver@v$K8S_VERSION" "$c/kube-controller-manager@v$K8S_VERSION" \
    "$c/kube-scheduler@v$K8S_VERSION" "$c/kubelet@v$K8S_VERSION" "$c/kube-proxy@v$K8S_VERSION" "$c/kubectl@v$K8S_VERSION"
  local ldf="-s -w" p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
    ldf="$ldf -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  mkdir -p "$out.tmp"
  log "kubernetes v$K8S_VERSION: go build (cold: tens of minutes on 2 cores)"
  CGO_ENABLED=0 go build -trimpath -tags selinux,notest -ldflags "$ldf" -o "$out.tmp/" \
    "$c/kube-apiserver" "$c/kube-controller-manager" "$c/kube-scheduler" "$c/kubectl" "$c/kubelet" "$c/kube-proxy"
  rm -rf "$out"; mv "$out.tmp" "$out"
  log "kubernetes v$K8S_VERSION built into $out"
}

# build_single NAME VERSION PACKAGE: one static program whose main package is PACKAGE (at vVERSION), built in a
# wrapper module of its own (a module with replace directives cannot be built with `go install pkg@version`).
build_single() {
  local name=$1 version=$2 pkg=$3
  local out="$CACHE/$name-v$version/bin" src="$CACHE/$name-v$version/wrapper"
  if have_all "$out" "$name"; then log "$name v$version cached in $out"; return; fi
  rm -rf "$src"; mkdir -p "$src"; cd "$src"
  go mod init "example.invalid/real-node/$name" >/dev/null 2>&1
  go get -tool "$pkg@v$version"
  mkdir -p "$out.tmp"
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/$name" "$pkg"
  rm -rf "$out"; mv "$out.tmp" "$out"
  log "$name v$version built into $out"
}

build_etcd() { build_single etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3; }
build_crictl() { build_single crictl "$CRICTL_VERSION" sigs.k8s.io/cri-tools/cmd/crictl; }

# Prints the directories holding the built binaries (for PATH), one per line.
bin_dirs() {
  echo "$CACHE/kubernetes-v$K8S_VERSION/bin"
  echo "$CACHE/etcd-v$ETCD_VERSION/bin"
  echo "$CACHE/crictl-v$CRICTL_VERSION/bin"
}

case "${1:-all}" in
  k8s) build_k8s ;;
  etcd) build_etcd ;;
  crictl) build_crictl ;;
  all) build_etcd; build_crictl; build_k8s ;;
  bin-dirs) bin_dirs ;;
  *) echo "usage: $0 [k8s|etcd|crictl|all|bin-dirs]" >&2; exit 2 ;;
esac
