#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, for the real-node test suite and demo:
#
#   scripts/cluster.sh up        build (or take from the cache) and start everything; prints the kubeconfig path
#   scripts/cluster.sh down      stop everything and remove every trace (processes, mounts, netns, rules, files)
#   scripts/cluster.sh status    what runs
#   scripts/cluster.sh env       shell exports for using the cluster (KUBECONFIG, PATH with kubectl and crictl)
#   scripts/cluster.sh restart kubelet|containerd     stop one component and start it again (fault tests)
#   scripts/cluster.sh images    rebuild the images (after a code change) and import them into the node
#
# What runs, all as plain root processes (PID 1 is not systemd), every one inside the node's own namespaces: the
# network namespace `istio-real-node` (so the node's bridge, routes, iptables and nftables rules live and die with
# it), and a PID namespace whose PID 1 is the node's init (our pause program), with /proc mounted for it. A real
# node's PID 1 sits in the node's network namespace, and Istio's node agent finds the host's network namespace as
# /proc/1/ns/net (ours too, HOST_NETNS); this machine's own PID 1 holds capabilities root lacks, so even root gets
# EACCES opening its /proc/1/ns/net. Killing the node's init ends every process of the node at once. Mounts are
# shared with the host (`/` is made rshared), so the runtime's netns handles and volumes are visible from the host.
#   etcd 3.6 · kube-apiserver (Node,RBAC authorization, NodeRestriction and the default admission, service-account
#   token signing with TokenRequest and projected tokens) · kube-controller-manager · kube-scheduler ·
#   kube-proxy (iptables) · containerd 1.6 from Debian with its CRI plugin and runc · kubelet.
# The primary CNI is Debian's reference plugins (bridge + host-local) in /etc/cni/net.d, binaries in /opt/cni/bin:
# Istio's default paths, so our chart installs exactly as on a real node.
# The Go programs are built from the Go module proxy by scripts/real-node/build.sh (cached by version outside the
# clone); the images (ours, a pause image, an app image) by scripts/real-node/images.sh and imported into containerd.
#
# The node is reached from the host through a veth: the node's IP is 10.251.0.2 (the API server at
# https://10.251.0.2:6443); the host side is 10.251.0.1. Pods get 10.252.0.0/24 on bridge cni0.
#
# Settings: REAL_NODE_CACHE (binaries and images; default /var/cache/istio-cni-rs/real-node),
# REAL_NODE_STATE (this run's files; default /run/istio-cni-rs/real-node).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

CACHE="${REAL_NODE_CACHE:-/var/cache/istio-cni-rs/real-node}"
STATE="${REAL_NODE_STATE:-/run/istio-cni-rs/real-node}"
DATA=/var/lib/istio-cni-rs/real-node
NETNS=istio-real-node
NODE=istio-real-node
HOST_IP=10.251.0.1
NODE_IP=10.251.0.2
POD_CIDR=10.252.0.0/24
SERVICE_CIDR=10.96.0.0/16
API_SERVICE_IP=10.96.0.1
CNI_BIN=/opt/cni/bin
CNI_CONF=/etc/cni/net.d
PRIMARY_CONF=10-bridge.conflist
CONTAINERD_SOCK="$STATE/containerd/containerd.sock"

log() { echo "cluster: $*" >&2; }
die() { echo "cluster: $*" >&2; exit 1; }

bin_path() {
  local d
  for d in $(scripts/real-node/build.sh bin-dirs); do PATH="$d:$PATH"; done
  export PATH
}

init_pid() { cat "$STATE/pids/init"; }

in_netns() { nsenter --net="/run/netns/$NETNS" -- "$@"; }

# Runs a command in the node's network and mount namespaces (its /proc shows the node's processes).
in_node() { nsenter --target "$(init_pid)" --net --mount -- "$@"; }

# The node's init: PID 1 of the node's PID namespace, in its network namespace, with a /proc of its own.
init_up() {
  mkdir -p "$STATE/logs" "$STATE/pids"
  gcc -static -O2 -o "$STATE/bin/node-init" scripts/real-node/pause.c
  setsid nsenter --net="/run/netns/$NETNS" -- unshare --pid --fork --mount --propagation unchanged -- \
    sh -c 'mount --make-private /proc && mount -t proc proc /proc && exec "$0"' "$STATE/bin/node-init" \
    >>"$STATE/logs/init.log" 2>&1 </dev/null &
  local unshare=$! i pid=
  for i in $(seq 1 100); do
    pid=$(pgrep -P "$unshare" 2>/dev/null | head -n1) && [ -n "$pid" ] &&
      [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$STATE/bin/node-init" ] && break
    pid=; sleep 0.05
  done
  [ -n "$pid" ] || die "the node's init did not start (log: $STATE/logs/init.log)"
  echo "$pid" >"$STATE/pids/init"
}

# Starts NAME in the node's namespaces in its own session, output to $STATE/logs/NAME.log; its pid (as the host
# sees it) in $STATE/pids/NAME.
start() {
  local name=$1; shift
  setsid nsenter --target "$(init_pid)" --net --mount --pid -- "$@" >>"$STATE/logs/$name.log" 2>&1 </dev/null &
  local nsenter=$! i pid=
  for i in $(seq 1 100); do
    pid=$(pgrep -P "$nsenter" 2>/dev/null | head -n1) && [ -n "$pid" ] && break
    pid=; sleep 0.02
  done
  [ -n "$pid" ] || die "$name did not start (log: $STATE/logs/$name.log)"
  echo "$pid" >"$STATE/pids/$name"
}

running() { local p; p=$(cat "$STATE/pids/$1" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }

# Stops NAME: SIGTERM, then SIGKILL after a deadline; waits until it is gone.
stop() {
  local name=$1 pid i
  pid=$(cat "$STATE/pids/$name" 2>/dev/null) || return 0
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$STATE/pids/$name"
}

# Waits up to $1 seconds for the command after it to succeed.
wait_for() {
  local secs=$1 what=$2 i; shift 2
  for i in $(seq 1 $((secs * 5))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  die "$what not ready after ${secs}s (logs: $STATE/logs)"
}

pki() {
  local p="$STATE/pki"
  mkdir -p "$p"; cd "$p"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 -subj /CN=istio-real-node-ca 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  # name CN O SANs: a certificate signed by the cluster CA.
  cert() {
    local name=$1 cn=$2 o=$3 san=${4:-}
    local subj="/CN=$cn"; [ -n "$o" ] && subj="/O=$o/CN=$cn"
    openssl req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subj" 2>/dev/null
    if [ -n "$san" ]; then
      openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 -out "$name.crt" \
        -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth' "$san") 2>/dev/null
    else
      openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 -out "$name.crt" \
        -extfile <(printf 'extendedKeyUsage=clientAuth') 2>/dev/null
    fi
    rm -f "$name.csr"
  }
  cert apiserver kube-apiserver "" "IP:127.0.0.1,IP:$NODE_IP,IP:$API_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  cert admin admin system:masters
  cert controller-manager system:kube-controller-manager ""
  cert scheduler system:kube-scheduler ""
  cert kube-proxy system:kube-proxy ""
  cert kubelet-client "system:node:$NODE" system:nodes
  cert kubelet "$NODE" "" "IP:$NODE_IP,DNS:$NODE"
  chmod 600 ./*.key
  cd "$repo"
  local who
  for who in admin controller-manager scheduler kube-proxy kubelet-client; do
    kubeconfig "$who" "https://$NODE_IP:6443" >"$STATE/$who.kubeconfig"
  done
}

kubeconfig() {
  local who=$1 server=$2 p="$STATE/pki"
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: real-node
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$p/ca.crt")
users:
- name: $who
  user:
    client-certificate-data: $(base64 -w0 <"$p/$who.crt")
    client-key-data: $(base64 -w0 <"$p/$who.key")
contexts:
- name: real-node
  context: {cluster: real-node, user: $who}
current-context: real-node
EOF
}

network_up() {
  ip netns add "$NETNS"
  ip link add rn-host type veth peer name rn-node
  ip link set rn-node netns "$NETNS"
  ip addr add "$HOST_IP/24" dev rn-host
  ip link set rn-host up
  in_netns ip link set lo up
  in_netns ip addr add "$NODE_IP/24" dev rn-node
  in_netns ip link set rn-node up
  in_netns ip route add default via "$HOST_IP"
  in_netns sysctl -qw net.ipv4.ip_forward=1
  # Pods on the node reach each other and Services through the node's netns; the host reaches the pod network.
  ip route add "$POD_CIDR" via "$NODE_IP"
  # Service IPs too, so that nothing meant for the cluster ever leaves through the host's default route.
  ip route add "$SERVICE_CIDR" via "$NODE_IP"
}

cni_up() {
  mkdir -p "$STATE/restore"
  [ -d "$CNI_BIN" ] || { touch "$STATE/restore/created-cni-bin"; mkdir -p "$CNI_BIN"; }
  [ -d "$CNI_CONF" ] || { touch "$STATE/restore/created-cni-conf"; mkdir -p "$CNI_CONF"; }
  local d
  for d in /var/run/istio-cni /var/run/ztunnel; do [ -e "$d" ] || touch "$STATE/restore/created-$(basename "$d")"; done
  local p
  for p in bridge host-local loopback portmap; do
    if [ ! -e "$CNI_BIN/$p" ]; then
      cp "/usr/lib/cni/$p" "$CNI_BIN/$p"
      echo "$p" >>"$STATE/restore/cni-bins"
    fi
  done
  [ -e "$CNI_CONF/$PRIMARY_CONF" ] && die "$CNI_CONF/$PRIMARY_CONF exists already: is another cluster running?"
  cat >"$CNI_CONF/$PRIMARY_CONF.tmp" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "podnet",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": { "type": "host-local", "ranges": [[{ "subnet": "$POD_CIDR" }]], "routes": [{ "dst": "0.0.0.0/0" }], "dataDir": "$STATE/cni-ipam" }
    },
    { "type": "portmap", "capabilities": { "portMappings": true } }
  ]
}
EOF
  mkdir -p "$STATE/pristine"; cp "$CNI_CONF/$PRIMARY_CONF.tmp" "$STATE/pristine/$PRIMARY_CONF"
  mv "$CNI_CONF/$PRIMARY_CONF.tmp" "$CNI_CONF/$PRIMARY_CONF"
}

containerd_config() {
  cat >"$STATE/containerd.toml" <<EOF
version = 2
root = "$DATA/containerd"
state = "$STATE/containerd"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:3.10"
  # No CAP_SYS_RESOURCE on this machine: runc cannot lower the OOM score of a container below ours.
  restrict_oom_score_adj = true
  tolerate_missing_hugepages_controller = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$CNI_CONF"
    max_conf_num = 1
EOF
}

kubelet_config() {
  cat >"$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $STATE/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $STATE/pki/kubelet.crt
tlsPrivateKeyFile: $STATE/pki/kubelet.key
clusterDomain: cluster.local
# The cluster DNS is on the host's end of the node link, as CoreDNS's Service would be: pods get it in their
# resolv.conf (with the cluster search domains). Only the real-istiod tests answer there
# (testbed/src/real_istiod.rs: istiod's Service name); other names get no answer.
clusterDNS: [$HOST_IP]
# Imported images cannot be pulled back: never collect them, and never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {nodefs.available: "0%", nodefs.inodesFree: "0%", imagefs.available: "0%", memory.available: "0%"}
# The default (-999) needs CAP_SYS_RESOURCE, which this machine does not give root.
oomScoreAdj: 0
registerNode: true
serializeImagePulls: false
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusUpdateFrequency: 5s
rotateCertificates: false
EOF
}

images_import() {
  local dir="$CACHE/images" tar
  bash scripts/real-node/images.sh "$dir" >&2
  for tar in "$dir"/*.tar; do
    ctr --address "$CONTAINERD_SOCK" -n k8s.io images import --all-platforms "$tar" >/dev/null
  done
}

up() {
  [ "$(id -u)" -eq 0 ] || die "run as root"
  if [ -e "/run/netns/$NETNS" ]; then
    running kubelet && die "already up (scripts/cluster.sh down first)"
    log "a node that is no longer running left its namespace behind: taking it down first"
    down || true
  fi
  local t0=$SECONDS
  scripts/install-deps.sh >&2
  command -v containerd >/dev/null || die "containerd missing (scripts/install-deps.sh installs it)"
  scripts/real-node/build.sh all >&2
  bin_path
  rm -rf "$STATE" "$DATA"; mkdir -p "$STATE/bin" "$DATA"
  # The node's tools in one place for tests and users (scripts/cluster.sh env puts it on PATH).
  local tool
  for tool in kubectl crictl kube-apiserver etcd; do ln -s "$(command -v "$tool")" "$STATE/bin/$tool"; done
  printf 'runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 20\n' "$CONTAINERD_SOCK" "$CONTAINERD_SOCK" \
    >"$STATE/crictl.yaml"
  # Mount propagation: the chart mounts the runtime's netns dir with HostToContainer, which needs a shared (or
  # slave) mount at /. Remember the old propagation to put it back on `down`.
  findmnt -no PROPAGATION / >"$STATE/root-propagation"
  mount --make-rshared /
  log "pki and kubeconfigs"; pki
  log "network namespace $NETNS ($NODE_IP)"; network_up
  log "the node's init (PID 1 of the node)"; init_up
  log "CNI: $CNI_CONF/$PRIMARY_CONF (bridge cni0 + host-local $POD_CIDR)"; cni_up

  log "etcd"
  start etcd etcd --name n1 --data-dir "$DATA/etcd" --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster n1=http://127.0.0.1:2380 \
    --initial-cluster-state new --log-level warn
  wait_for 30 etcd in_node curl -sf http://127.0.0.1:2379/health

  log "kube-apiserver"
  local p="$STATE/pki"
  # The audit log records every request our components make (the service accounts of istio-system), with the
  # user agent that tells the node agent from the plugin: the real-node test of the agent's API load reads it.
  cat >"$STATE/audit-policy.yaml" <<EOF
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts:istio-system"]
- level: None
EOF
  start kube-apiserver kube-apiserver --etcd-servers=http://127.0.0.1:2379 --advertise-address="$NODE_IP" \
    --bind-address=0.0.0.0 --secure-port=6443 --tls-cert-file="$p/apiserver.crt" --tls-private-key-file="$p/apiserver.key" \
    --client-ca-file="$p/ca.crt" --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --allow-privileged=true --service-cluster-ip-range="$SERVICE_CIDR" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local --service-account-key-file="$p/sa.pub" \
    --service-account-signing-key-file="$p/sa.key" \
    --kubelet-client-certificate="$p/apiserver-kubelet-client.crt" --kubelet-client-key="$p/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$p/ca.crt" --kubelet-preferred-address-types=InternalIP \
    --service-node-port-range=30000-32767 --profiling=false --v=1 \
    --audit-policy-file="$STATE/audit-policy.yaml" --audit-log-path="$STATE/audit.log" --audit-log-format=json \
    --audit-log-maxsize=200 --audit-log-maxbackup=1
  wait_for 90 kube-apiserver kubectl --kubeconfig "$STATE/admin.kubeconfig" get --raw /readyz

  log "containerd $(containerd --version | awk '{print $3}')"
  containerd_config
  start containerd containerd --config "$STATE/containerd.toml"
  wait_for 30 containerd ctr --address "$CONTAINERD_SOCK" version
  log "images"; images_import

  log "kube-controller-manager, kube-scheduler, kube-proxy"
  start kube-controller-manager kube-controller-manager --kubeconfig="$STATE/controller-manager.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --service-account-private-key-file="$p/sa.key" \
    --root-ca-file="$p/ca.crt" --service-cluster-ip-range="$SERVICE_CIDR" --use-service-account-credentials=true \
    --cluster-signing-cert-file="$p/ca.crt" --cluster-signing-key-file="$p/ca.key" --v=1
  start kube-scheduler kube-scheduler --kubeconfig="$STATE/scheduler.kubeconfig" --leader-elect=false \
    --bind-address=127.0.0.1 --v=1
  cat >"$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $STATE/kube-proxy.kubeconfig}
mode: iptables
clusterCIDR: $POD_CIDR
conntrack: {maxPerCore: 0}
hostnameOverride: $NODE
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
EOF
  start kube-proxy kube-proxy --config="$STATE/kube-proxy.yaml" --v=1

  log "kubelet"
  kubelet_config
  start kubelet kubelet --config="$STATE/kubelet.yaml" --kubeconfig="$STATE/kubelet-client.kubeconfig" \
    --node-ip="$NODE_IP" --hostname-override="$NODE" --root-dir="$DATA/kubelet" --v=1
  export KUBECONFIG="$STATE/admin.kubeconfig"
  wait_for 60 kubelet in_node curl -sf http://127.0.0.1:10248/healthz
  wait_for 120 "node $NODE" kubectl get node "$NODE"
  wait_for 120 "node $NODE Ready" kubectl wait --for=condition=Ready "node/$NODE" --timeout=1s
  wait_for 60 "default ServiceAccount" kubectl get serviceaccount default -n default
  log "up in $((SECONDS - t0))s: export KUBECONFIG=$STATE/admin.kubeconfig (or: eval \$(scripts/cluster.sh env))"
  echo "$STATE/admin.kubeconfig"
}

# Everything the node made, in reverse: pods and their sandboxes (so CNI DEL runs), the processes, mounts under
# our data dirs, the netns (with its bridge, routes and rules), the CNI files we added, the propagation of /.
down() {
  [ "$(id -u)" -eq 0 ] || die "run as root"
  bin_path
  local stale=1
  running kubelet && stale=0
  # Uninstall what was installed with helm while the node still runs, so each release cleans up after itself.
  if running kube-apiserver && running kubelet; then
    local release
    for release in $(KUBECONFIG="$STATE/admin.kubeconfig" helm list -A -q 2>/dev/null); do
      local rns; rns=$(KUBECONFIG="$STATE/admin.kubeconfig" helm list -A -f "^$release\$" -o json | jq -r '.[0].namespace')
      log "helm uninstall $release -n $rns"
      KUBECONFIG="$STATE/admin.kubeconfig" helm uninstall "$release" -n "$rns" --wait --timeout 90s >/dev/null || true
      # `--wait` returns once the objects are deleted; their pods are still terminating (install-cni cleans the
      # host up on SIGTERM): wait until they are gone, or the node's end would cut that cleanup short.
      local i
      for i in $(seq 1 450); do
        [ -z "$(KUBECONFIG="$STATE/admin.kubeconfig" kubectl get pods -n "$rns" -l "app.kubernetes.io/instance=$release" -o name 2>/dev/null)" ] && break
        sleep 0.2
      done
    done
  fi
  if running kubelet; then stop kubelet; fi
  if running containerd && command -v crictl >/dev/null; then
    local cri=(crictl --config "$STATE/crictl.yaml")
    "${cri[@]}" stop --timeout 10 $("${cri[@]}" ps -q 2>/dev/null) >/dev/null 2>&1 || true
    local sb
    for sb in $("${cri[@]}" pods -q 2>/dev/null); do "${cri[@]}" stopp "$sb" >/dev/null 2>&1 || true; "${cri[@]}" rmp -f "$sb" >/dev/null 2>&1 || true; done
  fi
  local c
  for c in kube-proxy kube-scheduler kube-controller-manager containerd kube-apiserver etcd; do stop "$c"; done
  # containerd's shims (one per pod) outlive containerd by design: the end of the node's init ends them, and
  # every other process left in the node's PID namespace.
  if [ -f "$STATE/pids/init" ]; then
    local init; init=$(init_pid)
    kill -TERM "$init" 2>/dev/null || true
    for c in $(seq 1 100); do kill -0 "$init" 2>/dev/null || break; sleep 0.1; done
    rm -f "$STATE/pids/init"
  fi
  local m
  for m in $(awk -v d="$DATA" -v s="$STATE" '$5 ~ "^"d || $5 ~ "^"s {print $5}' /proc/self/mountinfo | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  # Pod netns handles the runtime left (a pod killed with its shim gets no CNI DEL).
  for m in /run/netns/cni-*; do
    [ -e "$m" ] || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    rm -f "$m"
  done
  ip route del "$POD_CIDR" 2>/dev/null || true
  ip route del "$SERVICE_CIDR" 2>/dev/null || true
  ip link del rn-host 2>/dev/null || true
  [ -e "/run/netns/$NETNS" ] && ip netns del "$NETNS"
  rm -f "$CNI_CONF/$PRIMARY_CONF"
  # A node that died without its releases' uninstall (its session ended) leaves install-cni's plugin binary.
  if [ "$stale" = 1 ] && [ -e "$CNI_BIN/istio-cni" ]; then
    log "the node was not running: removing the plugin binary its install-cni left ($CNI_BIN/istio-cni)"
    rm -f "$CNI_BIN/istio-cni"
  fi
  if [ -f "$STATE/restore/cni-bins" ]; then
    while read -r p; do rm -f "$CNI_BIN/$p"; done <"$STATE/restore/cni-bins"
  fi
  # Host paths the chart's pods mount with DirectoryOrCreate: the kubelet made them for the node.
  for p in /var/run/istio-cni /var/run/ztunnel; do
    [ -f "$STATE/restore/created-$(basename "$p")" ] && rm -rf "$p"
  done
  [ -f "$STATE/restore/created-cni-bin" ] && rmdir "$CNI_BIN" 2>/dev/null || true
  [ -f "$STATE/restore/created-cni-conf" ] && rmdir "$CNI_CONF" 2>/dev/null || true
  if [ -f "$STATE/root-propagation" ] && [ "$(cat "$STATE/root-propagation")" = private ]; then
    mount --make-rprivate /
  fi
  rm -rf "$DATA" "$STATE"
  verify_clean
  log "down"
}

# What `down` promises: no process, mount, netns, route, rule or file of the node is left on the host.
verify_clean() {
  local left=() p
  p=$(pgrep -f "$STATE|$DATA|istio-real-node" | grep -vx "$$" || true)
  [ -z "$p" ] || left+=("processes: $(echo $p)")
  grep -qE " ($STATE|$DATA)[/ ]| /run/netns/cni-" /proc/self/mountinfo && left+=("mounts: $(grep -E " ($STATE|$DATA)[/ ]| /run/netns/cni-" /proc/self/mountinfo | awk '{print $5}' | tr '\n' ' ')")
  [ -e "/run/netns/$NETNS" ] && left+=("netns $NETNS")
  ls /run/netns/cni-* >/dev/null 2>&1 && left+=("pod netns handles: $(ls /run/netns/ | grep '^cni-' | tr '\n' ' ')")
  ip link show rn-host >/dev/null 2>&1 && left+=("link rn-host")
  ip route | grep -qE "^($POD_CIDR|$SERVICE_CIDR) " && left+=("routes to the node")
  iptables-save 2>/dev/null | grep -qE "KUBE-|ISTIO" && left+=("iptables rules in the host's netns")
  nft list ruleset 2>/dev/null | grep -qiE "istio|kube" && left+=("nftables rules in the host's netns")
  [ -e "$CNI_CONF/$PRIMARY_CONF" ] && left+=("$CNI_CONF/$PRIMARY_CONF")
  [ -e "$CNI_BIN/istio-cni" ] && left+=("$CNI_BIN/istio-cni")
  if [ "${#left[@]}" -gt 0 ]; then
    printf 'cluster: left behind: %s\n' "${left[@]}" >&2
    return 1
  fi
}

status() {
  local c
  for c in etcd kube-apiserver containerd kube-controller-manager kube-scheduler kube-proxy kubelet; do
    if running "$c"; then echo "$c: running (pid $(cat "$STATE/pids/$c"))"; else echo "$c: stopped"; fi
  done
}

restart() {
  local c=${1:?restart what}
  bin_path
  case "$c" in
    kubelet)
      stop kubelet
      start kubelet kubelet --config="$STATE/kubelet.yaml" --kubeconfig="$STATE/kubelet-client.kubeconfig" \
        --node-ip="$NODE_IP" --hostname-override="$NODE" --root-dir="$DATA/kubelet" --v=1
      wait_for 60 kubelet in_node curl -sf http://127.0.0.1:10248/healthz ;;
    containerd)
      stop containerd
      start containerd containerd --config "$STATE/containerd.toml"
      wait_for 30 containerd ctr --address "$CONTAINERD_SOCK" version
      # The kubelet reconnects on its own; the node is back once the kubelet says it is healthy.
      wait_for 60 kubelet in_node curl -sf http://127.0.0.1:10248/healthz ;;
    *) die "restart: kubelet or containerd" ;;
  esac
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  check-clean) verify_clean ;;
  restart) shift; restart "$@" ;;
  images) bin_path; images_import ;;
  env)
    bin_path
    echo "export KUBECONFIG=$STATE/admin.kubeconfig"
    echo "export CRI_CONFIG_FILE=$STATE/crictl.yaml"
    echo "export PATH=$STATE/bin:\$PATH" ;;
  *) echo "usage: $0 up|down|status|env|restart kubelet|containerd" >&2; exit 2 ;;
esac
