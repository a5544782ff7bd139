#!/usr/bin/env bash
# The README's demo on the real node (`scripts/demo.sh --real-node`): the same story as target/debug/demo, told with
# kubectl, helm and crictl against the single-node Kubernetes cluster of scripts/cluster.sh.
#
#   1. the node: brought up with `scripts/cluster.sh up` when it does not run (and taken down at the end, only then)
#   2. our chart: `helm upgrade --install` with the real-node settings when no release istio-cni exists in
#      istio-system (uninstalled at the end, only then); an existing release is used as it is. The same-node fast
#      path is turned off for the demo (proxy.sameNodeFastPath=false), so two pods of the one node talk over HBONE
#      with mTLS; on a release the demo did not install, the release's own values are put back at the end
#   3. install-cni's chaining of our plugin into /etc/cni/net.d/10-bridge.conflist
#   4. a sidecar pod as Istio's injector writes it (namespace demo-shop): its rules, its app's first connection
#   5. two ambient pods (namespace demo-mesh, labelled istio.io/dataplane-mode=ambient): annotation, rules, the
#      proxy's enrollment log lines with their SPIFFE identities
#   6. frontend echoes 1 MiB through backend, over HBONE; 7. the proxy's istio_tcp_* metrics for it; 8. node-agent
#      explain for one pod
#
# Exit status: 0 and `demo OK` when every step worked, 1 naming the failed step, 130 on Ctrl-C. Everything it
# created is removed on every exit. Every wait polls with a deadline. Namespaces `real-*` belong to the real-node
# test suite and are never touched.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD

NODE=istio-real-node
NETNS=istio-real-node
STATE="${REAL_NODE_STATE:-/run/istio-cni-rs/real-node}"
RELEASE=istio-cni
RELEASE_NS=istio-system
SIDECAR_NS=demo-shop
AMBIENT_NS=demo-mesh
APP_IMAGE=localhost/mesh-app:dev
CONFLIST=/etc/cni/net.d/10-bridge.conflist
PAYLOAD=1048576
STEPS=8
INSTALL_SETS=(--set profile=ambient --set global.hub=localhost --set global.tag=dev --set global.imagePullPolicy=Never
  --set proxy.enabled=true --set proxy.selfSignedCA=true)

brought_up=0        # this run started the node
installed=0         # this run installed the release
release_ns_created=0  # and created its namespace
values_saved=""     # the existing release's values, to put back (file), when this run changed the fast path
created_ns=()
interrupted=0
step_no=0
step_name="start"
t_start=$SECONDS
work=$(mktemp -d /tmp/real-node-demo.XXXXXX)

say() { printf '%s\n' "$*"; }
detail() { printf '      %s\n' "$*"; }
begin() { step_no=$1; step_name=$2; }
fail() { echo "demo: step [$step_no/$STEPS] $step_name: $*" >&2; exit 1; }
strip_ansi() { sed 's/\x1b\[[0-9;]*m//g'; }

# poll SECS CMD...: runs CMD every half second until it succeeds (0), or 1 after SECS seconds; the last error of CMD
# in $work/last.err.
poll() {
  local end=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>"$work/last.err"; do
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.5
  done
}
# until_ok SECS WHAT CMD...: poll, failing the step after SECS seconds.
until_ok() {
  local secs=$1 what=$2; shift 2
  if ! poll "$secs" "$@"; then
    local err; err=$(tail -c 300 "$work/last.err" | tr '\n' ' ')
    fail "timed out after ${secs}s waiting until $what${err:+ (last error: $err)}"
  fi
}

# ---------------------------------------------------------------------------------------------------------------
# Teardown, on every exit.

cleanup() {
  local status=$?
  trap '' INT TERM
  set +e
  [ "$interrupted" = 1 ] && status=130
  local what=()
  # What the demo made in the cluster (also before taking down a node it brought up: helm uninstall has
  # install-cni remove our plugin from the host's bin dir).
  if [ -n "${KUBECONFIG:-}" ] && [ -e "/run/netns/$NETNS" ]; then
    local ns
    for ns in "${created_ns[@]}"; do
      kubectl delete namespace "$ns" --ignore-not-found --wait=false >/dev/null 2>&1
    done
    for ns in "${created_ns[@]}"; do
      local end=$((SECONDS + 120))
      while kubectl get namespace "$ns" >/dev/null 2>&1 && [ "$SECONDS" -lt "$end" ]; do sleep 0.5; done
      if kubectl get namespace "$ns" >/dev/null 2>&1; then
        echo "teardown: namespace $ns still terminating after 120s" >&2; [ "$status" = 0 ] && status=1
      else
        what+=("namespace $ns deleted")
      fi
    done
    if [ "$installed" = 1 ]; then
      if helm uninstall "$RELEASE" -n "$RELEASE_NS" --wait --timeout 120s >/dev/null 2>&1; then
        what+=("release $RELEASE uninstalled")
      else
        echo "teardown: helm uninstall $RELEASE failed" >&2; [ "$status" = 0 ] && status=1
      fi
      if [ "$release_ns_created" = 1 ]; then
        kubectl delete namespace "$RELEASE_NS" --ignore-not-found --wait=false >/dev/null 2>&1
      fi
    elif [ -n "$values_saved" ]; then
      # The release's own values again (not --reuse-values: a value the release never set must go back to unset).
      if helm upgrade "$RELEASE" charts/istio-cni -n "$RELEASE_NS" -f "$values_saved" >/dev/null 2>"$work/restore.err" &&
        kubectl rollout status daemonset/hbone-proxy -n "$RELEASE_NS" --timeout=120s >/dev/null 2>&1; then
        what+=("release $RELEASE's own values put back")
      else
        echo "teardown: could not put back the release's values: $(cat "$work/restore.err")" >&2
        [ "$status" = 0 ] && status=1
      fi
    fi
  fi
  if [ "$brought_up" = 1 ]; then
    if scripts/cluster.sh down >>"$work/cluster.log" 2>&1; then what+=("node taken down (scripts/cluster.sh down)"); else
      echo "teardown: scripts/cluster.sh down failed; log: $work/cluster.log" >&2; [ "$status" = 0 ] && status=1
      work_keep=1
    fi
  fi
  local list="" w
  for w in "${what[@]}"; do list="${list:+$list, }$w"; done
  say "teardown: ${list:-nothing to remove}"
  [ "${work_keep:-0}" = 1 ] || rm -rf "$work"
  case "$status" in
    0) say "demo OK ($((SECONDS - t_start))s)" ;;
    130) say "demo interrupted" ;;
    *) echo "demo FAILED at step [$step_no/$STEPS] $step_name" >&2; status=1 ;;
  esac
  exit "$status"
}
trap cleanup EXIT
trap 'interrupted=1; exit 130' INT TERM

# ---------------------------------------------------------------------------------------------------------------
# Helpers over the node.

init_pid() { cat "$STATE/pids/init"; }
sandbox_pid() { # NS POD
  local id
  id=$(crictl pods --namespace "$1" --name "^$2\$" --state ready -q 2>/dev/null | head -n1)
  [ -n "$id" ] && crictl inspectp "$id" | jq -r '.info.pid'
}
# pod_rules NS POD: the pod netns's rules as iptables-save prints them (nft backend first, then legacy), or nft's.
pod_rules() {
  local pid tool out
  pid=$(sandbox_pid "$1" "$2") || return 1
  for tool in iptables-nft-save iptables-legacy-save; do
    out=$(nsenter --target "$(init_pid)" --net --mount -- nsenter --net="/proc/$pid/ns/net" -- "$tool" 2>/dev/null) || continue
    if grep -q "^-A ISTIO" <<<"$out"; then echo "# tool: ${tool%-save}"; echo "$out"; return 0; fi
  done
  out=$(nsenter --target "$(init_pid)" --net --mount -- nsenter --net="/proc/$pid/ns/net" -- nft list ruleset 2>/dev/null)
  if grep -q istio <<<"$out"; then echo "# tool: nft"; echo "$out"; return 0; fi
  return 1
}
has_rules() { pod_rules "$1" "$2" >/dev/null; }
# rules_summary: "N rules (TOOL) in CHAIN n, ...; redirect to :P ..." from pod_rules' output on stdin (iptables-save's
# `-A CHAIN` lines, or the rules of each chain of nft's ruleset; a chain's hook line is not a rule).
rules_summary() {
  awk '
    function add(ch) { n++; if (!(ch in c)) order[++k] = ch; c[ch]++ }
    /^# tool:/ { tool = $3; next }
    /^-A / { add($2) }
    /^table / { tbl = $3 }
    /^\tchain / { ch = tbl "/" $2; next }
    /^\t\t/ && ch != "" && !/^\t\t(type|policy) / { add(ch) }
    /^\t}/ { ch = "" }
    { for (i = 1; i < NF; i++) if ($i == "--to-ports" || $i == "--on-port") p[$(i + 1)] = 1 }
    { for (i = 1; i <= NF; i++) if ($i ~ /^:[0-9]+;?$/) { x = substr($i, 2); sub(/;$/, "", x); p[x] = 1 } }
    END {
      s = ""; for (i = 1; i <= k; i++) s = s (i > 1 ? ", " : "") order[i] " " c[order[i]]
      m = 0; for (x in p) q[++m] = x + 0
      for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (q[j] < q[i]) { t = q[i]; q[i] = q[j]; q[j] = t }
      r = ""; for (i = 1; i <= m; i++) r = r " :" q[i]
      printf "%d rules (%s) in %s; redirect to%s\n", n, tool, s, r
    }'
}
pod_ready() { kubectl get pod "$2" -n "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True; }
annotated() { [ "$(kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.annotations.ambient\.istio\.io/redirection}')" = enabled ]; }
release_pod() { # SELECTOR: the running, not terminating, pod of the release
  kubectl get pods -n "$RELEASE_NS" -l "$1" -o json |
    jq -re '[.items[] | select(.status.phase == "Running" and .metadata.deletionTimestamp == null)] | .[0].metadata.name'
}
proxy_started() { # UID: the proxy's log says it started a pod proxy for the pod; sets $proxy to the proxy's pod
  proxy=$(release_pod k8s-app=hbone-proxy) && kubectl logs -n "$RELEASE_NS" "$proxy" | grep 'pod proxy started' | grep -q "$1"
}
rolled_out() { kubectl rollout status "daemonset/$1" -n "$RELEASE_NS" --timeout=5s; }

# ---------------------------------------------------------------------------------------------------------------
begin 1 "the node"
[ "$(id -u)" -eq 0 ] || fail "run as root"
if [ -e "/run/netns/$NETNS" ] && [ -f "$STATE/pids/kubelet" ]; then
  how="already running"
else
  [ -e "/run/netns/$NETNS" ] && fail "a half-up node is there (scripts/cluster.sh down, then again)"
  say "      bringing the node up: scripts/cluster.sh up (first run builds Kubernetes, ~10 min; log $work/cluster.log)"
  brought_up=1
  t0=$SECONDS
  scripts/cluster.sh up >"$work/cluster.log" 2>&1 || { tail -n 20 "$work/cluster.log" >&2; work_keep=1; fail "scripts/cluster.sh up failed"; }
  how="brought up by the demo in $((SECONDS - t0))s"
fi
eval "$(scripts/cluster.sh env)"
command -v helm >/dev/null || scripts/install-helm.sh >"$work/helm.log" 2>&1 || fail "no helm (scripts/install-helm.sh failed)"
until_ok 120 "node $NODE is Ready" kubectl wait --for=condition=Ready "node/$NODE" --timeout=2s
node_json=$(kubectl get node "$NODE" -o json)
say "[1/$STEPS] node $NODE ($how): Ready, $(jq -r '.status.nodeInfo | "kubelet \(.kubeletVersion), \(.containerRuntimeVersion), \(.osImage), kernel \(.kernelVersion)"' <<<"$node_json")"
kubectl get node -o wide | while IFS= read -r l; do detail "$l"; done
detail "pod CIDR 10.252.0.0/24 on bridge cni0; API server https://10.251.0.2:6443 ($(kubectl version -o json | jq -r .serverVersion.gitVersion))"

# ---------------------------------------------------------------------------------------------------------------
begin 2 "our chart"
if helm status "$RELEASE" -n "$RELEASE_NS" >/dev/null 2>&1; then
  helm get values "$RELEASE" -n "$RELEASE_NS" -o yaml >"$work/values.yaml"
  rev=$(helm status "$RELEASE" -n "$RELEASE_NS" -o json | jq -r .version)
  how="existing (revision $rev), used as it is"
  fast=$(helm get values "$RELEASE" -n "$RELEASE_NS" -a -o json | jq -r '.proxy.sameNodeFastPath')
  if [ "$fast" != false ]; then
    values_saved="$work/values.yaml"
    helm upgrade "$RELEASE" charts/istio-cni -n "$RELEASE_NS" --reuse-values --set proxy.sameNodeFastPath=false \
      >"$work/helm.log" 2>&1 || fail "helm upgrade --set proxy.sameNodeFastPath=false: $(cat "$work/helm.log")"
    how="$how but for proxy.sameNodeFastPath=false (revision $((rev + 1)); its own values go back at the end)"
  fi
else
  kubectl get namespace "$RELEASE_NS" >/dev/null 2>&1 || release_ns_created=1
  installed=1
  helm upgrade --install "$RELEASE" charts/istio-cni -n "$RELEASE_NS" --create-namespace "${INSTALL_SETS[@]}" \
    --set proxy.sameNodeFastPath=false >"$work/helm.log" 2>&1 || fail "helm upgrade --install: $(cat "$work/helm.log")"
  how="installed by the demo with proxy.sameNodeFastPath=false (uninstalled at the end)"
fi
until_ok 180 "daemonset/istio-cni-node is rolled out" rolled_out istio-cni-node
until_ok 180 "daemonset/hbone-proxy is rolled out" rolled_out hbone-proxy
agent=$(release_pod k8s-app=istio-cni-node) || fail "no running istio-cni-node pod"
proxy=$(release_pod k8s-app=hbone-proxy) || fail "no running hbone-proxy pod"
until_ok 60 "the proxy runs with the fast path off" \
  sh -c "kubectl logs -n $RELEASE_NS $proxy | grep -q 'same_node_fast_path.*false'"
say "[2/$STEPS] helm release $RELEASE in $RELEASE_NS: $how"
detail "$(helm list -n "$RELEASE_NS" -f "^$RELEASE\$" -o json | jq -r '.[0] | "chart \(.chart), revision \(.revision), \(.status)"'); image $(kubectl get ds istio-cni-node -n "$RELEASE_NS" -o jsonpath='{.spec.template.spec.containers[0].image}')"
detail "DaemonSet istio-cni-node: pod $agent ready (install-cni + node-agent); DaemonSet hbone-proxy: pod $proxy ready"

# ---------------------------------------------------------------------------------------------------------------
begin 3 "install-cni chained our plugin"
until_ok 60 "istio-cni is chained in $CONFLIST" sh -c "jq -e '.plugins[] | select(.type == \"istio-cni\")' $CONFLIST"
types=$(jq -r '[.plugins[].type] | join(" -> ")' "$CONFLIST")
ours=$(jq -c '.plugins[] | select(.type == "istio-cni") | {ambient_enabled, cni_agent_run_dir, exclude_namespaces}' "$CONFLIST")
say "[3/$STEPS] install-cni ($agent): chained our plugin into $CONFLIST: $types"
detail "istio-cni entry: $ours"
detail "binary /opt/cni/bin/istio-cni ($(stat -c %s /opt/cni/bin/istio-cni) bytes); install-cni: $(kubectl logs -n "$RELEASE_NS" "$agent" -c install-cni | strip_ansi | grep -m1 -o 'CNI config installed.*' || echo '(no log line)')"

# ---------------------------------------------------------------------------------------------------------------
begin 4 "a sidecar pod"
kubectl delete namespace "$SIDECAR_NS" --ignore-not-found --wait=false >/dev/null
until_ok 120 "an old namespace $SIDECAR_NS is gone" sh -c "! kubectl get namespace $SIDECAR_NS"
created_ns+=("$SIDECAR_NS")
kubectl create namespace "$SIDECAR_NS" >/dev/null
# As Istio's injector writes a pod with istio-cni: the sidecar.istio.io/status annotation, istio-proxy as a native
# sidecar (uid 1337), here a stand-in answering on 15001 and 15006; its startup probe holds the app until it
# listens (holdApplicationUntilProxyStarts). The app's first action: one connection to an address no pod has.
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: $SIDECAR_NS
  labels: {app: web, security.istio.io/tlsMode: istio, service.istio.io/canonical-name: web}
  annotations:
    sidecar.istio.io/status: '{"initContainers":["istio-proxy"],"containers":null,"volumes":["istio-envoy","istio-data"],"imagePullSecrets":null,"revision":"default"}'
    kubectl.kubernetes.io/default-container: app
spec:
  terminationGracePeriodSeconds: 1
  initContainers:
  - name: istio-proxy
    image: $APP_IMAGE
    imagePullPolicy: Never
    restartPolicy: Always
    args: [proxy, sidecar]
    command: [sh, -c, "nc -ll -p 15001 -e sh -c 'read l; echo \"15001 got: \$l\" >&2; echo answered-by-15001' & nc -ll -p 15006 -e sh -c 'read l; echo \"15006 got: \$l\" >&2; echo answered-by-15006' & wait"]
    securityContext: {runAsUser: 1337, runAsGroup: 1337, runAsNonRoot: true, allowPrivilegeEscalation: false}
    startupProbe:
      exec: {command: [sh, -c, "netstat -ltn | grep -q ':15001 ' && netstat -ltn | grep -q ':15006 '"]}
      periodSeconds: 1
      failureThreshold: 60
  containers:
  - name: app
    image: $APP_IMAGE
    imagePullPolicy: Never
    command: [sh, -c, "echo first-byte-from-app | timeout 10 nc 10.252.0.254 80 >&2; exec nc -ll -p 8080 -e echo app"]
EOF
until_ok 180 "pod $SIDECAR_NS/web is Ready" pod_ready "$SIDECAR_NS" web
web_ip=$(kubectl get pod web -n "$SIDECAR_NS" -o jsonpath='{.status.podIP}')
until_ok 30 "the sidecar pod's rules are readable" has_rules "$SIDECAR_NS" web
say "[4/$STEPS] pod $SIDECAR_NS/web (sidecar, as Istio's injector writes it) $web_ip"
detail "rules: $(pod_rules "$SIDECAR_NS" web | rules_summary)"
until_ok 30 "the app logged its first connection's answer" \
  sh -c "kubectl logs -n $SIDECAR_NS web -c app | grep -q answered-by-"
app_said=$(kubectl logs -n "$SIDECAR_NS" web -c app | grep -m1 answered-by-)
[ "$app_said" = answered-by-15001 ] || fail "the app's first connection was not redirected to 15001: $app_said"
proxy_said=$(kubectl logs -n "$SIDECAR_NS" web -c istio-proxy | grep -m1 '15001 got:' || true)
detail "the app's first connection (to 10.252.0.254:80, which no pod has) landed on 15001: the app read \"$app_said\", istio-proxy logged \"$proxy_said\""

# ---------------------------------------------------------------------------------------------------------------
begin 5 "two ambient pods"
kubectl delete namespace "$AMBIENT_NS" --ignore-not-found --wait=false >/dev/null
until_ok 120 "an old namespace $AMBIENT_NS is gone" sh -c "! kubectl get namespace $AMBIENT_NS"
created_ns+=("$AMBIENT_NS")
kubectl create namespace "$AMBIENT_NS" >/dev/null
kubectl label namespace "$AMBIENT_NS" istio.io/dataplane-mode=ambient >/dev/null
pod_yaml() { # NAME COMMAND(json list) [readiness]
  cat <<EOF
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: $1, namespace: $AMBIENT_NS}
---
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $AMBIENT_NS, labels: {app: $1}}
spec:
  serviceAccountName: $1
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: $APP_IMAGE
    imagePullPolicy: Never
    command: $2
    volumeMounts: [{name: tmp, mountPath: /tmp}]
${3:-}
  volumes: [{name: tmp, emptyDir: {}}]
EOF
}
{
  pod_yaml backend '[nc, -ll, -p, "8080", -e, cat]' \
    "    readinessProbe: {exec: {command: [sh, -c, \"netstat -ltn | grep -q ':8080 '\"]}, periodSeconds: 1}"
  pod_yaml frontend '[sleep, infinity]'
} | kubectl apply -f - >/dev/null
say "[5/$STEPS] namespace $AMBIENT_NS labelled istio.io/dataplane-mode=ambient: pods frontend and backend"
for p in frontend backend; do
  until_ok 180 "pod $AMBIENT_NS/$p is Ready" pod_ready "$AMBIENT_NS" "$p"
  until_ok 60 "pod $AMBIENT_NS/$p is annotated ambient.istio.io/redirection: enabled" annotated "$AMBIENT_NS" "$p"
  until_ok 30 "pod $AMBIENT_NS/$p has its in-pod rules" has_rules "$AMBIENT_NS" "$p"
  ip=$(kubectl get pod "$p" -n "$AMBIENT_NS" -o jsonpath='{.status.podIP}')
  uid=$(kubectl get pod "$p" -n "$AMBIENT_NS" -o jsonpath='{.metadata.uid}')
  eval "${p}_ip=$ip"
  # The proxy pod of now (a helm upgrade by someone else replaces it; the new one starts every pod proxy again).
  until_ok 60 "the proxy started a pod proxy for $AMBIENT_NS/$p" proxy_started "$uid"
  line=$(kubectl logs -n "$RELEASE_NS" "$proxy" | strip_ansi | grep 'pod proxy started' | grep "$uid" | tail -n1 |
    sed -E 's/^[^ ]+ +INFO +//')
  say "      pod $AMBIENT_NS/$p (ambient) $ip: ambient.istio.io/redirection=$(kubectl get pod "$p" -n "$AMBIENT_NS" -o jsonpath='{.metadata.annotations.ambient\.istio\.io/redirection}')"
  detail "  rules: $(pod_rules "$AMBIENT_NS" "$p" | rules_summary)"
  detail "  proxy: $line"
done

# ---------------------------------------------------------------------------------------------------------------
begin 6 "traffic over HBONE"
metrics() { nsenter --target "$(init_pid)" --net -- curl -sf --max-time 5 "http://$(kubectl get pod "$proxy" -n "$RELEASE_NS" -o jsonpath='{.status.podIP}'):15020/metrics"; }
front_id="spiffe://cluster.local/ns/$AMBIENT_NS/sa/frontend"
back_id="spiffe://cluster.local/ns/$AMBIENT_NS/sa/backend"
# The sum of METRIC's series from frontend to backend over mTLS, reported by REPORTER.
tcp_metric() { # PAGE-FILE METRIC REPORTER
  grep "^$2{" "$1" | grep "reporter=\"$3\"" | grep 'connection_security_policy="mutual_tls"' |
    grep "source_principal=\"$front_id\"" | grep "destination_principal=\"$back_id\"" |
    awk '{ s += $NF } END { printf "%d\n", s }'
}
# A first line through, to know the path works (the proxy may have just restarted with the fast path off).
# Both ends of the connection are the one proxy: the client side (reporter=source) and the server side of HBONE
# (reporter=destination). Its counters live as long as its pod: when someone's helm upgrade replaces the pod during
# the transfer, the transfer is done again with the new one (twice at most).
got_metrics() {
  metrics >"$work/after.prom" || return 1
  local r m
  for r in source destination; do
    for m in istio_tcp_received_bytes_total istio_tcp_sent_bytes_total; do
      [ $(($(tcp_metric "$work/after.prom" $m $r) - $(tcp_metric "$work/before.prom" $m $r))) -ge "$PAYLOAD" ] || return 1
    done
  done
}
for attempt in 1 2 3; do
  until_ok 60 "frontend reaches backend:8080" sh -c \
    "kubectl exec -n $AMBIENT_NS frontend -- sh -c 'echo hello | timeout 5 nc -w 1 $backend_ip 8080' | grep -qx hello"
  proxy=$(release_pod k8s-app=hbone-proxy) || fail "no running hbone-proxy pod"
  metrics >"$work/before.prom" || fail "cannot scrape the proxy's metrics"
  t0=$(date +%s%N)
  out=$(kubectl exec -n "$AMBIENT_NS" frontend -- sh -c "
    head -c $PAYLOAD /dev/urandom >/tmp/sent
    timeout 30 nc -w 2 $backend_ip 8080 </tmp/sent >/tmp/echoed
    echo \$(wc -c </tmp/sent) \$(wc -c </tmp/echoed) \$(md5sum </tmp/sent | cut -c1-12) \$(md5sum </tmp/echoed | cut -c1-12)
  ") || fail "the app's transfer failed: $out"
  ms=$((($(date +%s%N) - t0) / 1000000))
  read -r sent echoed sum_sent sum_echoed <<<"$out"
  [ "$sent" = "$PAYLOAD" ] && [ "$echoed" = "$PAYLOAD" ] && [ "$sum_sent" = "$sum_echoed" ] ||
    fail "sent $sent bytes (md5 $sum_sent), got $echoed back (md5 $sum_echoed)"
  poll 30 got_metrics && break
  now=$(release_pod k8s-app=hbone-proxy || true)
  [ "$now" != "$proxy" ] && [ "$attempt" -lt 3 ] || {
    begin 7 "the proxy's metrics"
    fail "the proxy did not count $PAYLOAD bytes each way over mTLS from frontend to backend within 30s (proxy pod $proxy, now ${now:-none}; last error: $(tail -c 300 "$work/last.err"))"
  }
  say "      (the proxy pod $proxy was replaced during the transfer, by $now: once more)"
done
say "[6/$STEPS] traffic: $AMBIENT_NS/frontend app -> $backend_ip:8080 (backend's echo server), $((PAYLOAD / 1024)) KiB each way"
detail "bytes: $sent sent, $echoed echoed back, md5 $sum_sent both ways (as the app counted them), in ${ms} ms (kubectl exec included)"

# ---------------------------------------------------------------------------------------------------------------
begin 7 "the proxy's metrics"
say "[7/$STEPS] proxy $proxy metrics (:15020/metrics), HBONE with mTLS: $front_id -> $back_id"
for r in source destination; do
  d() { echo $(($(tcp_metric "$work/after.prom" "$1" $r) - $(tcp_metric "$work/before.prom" "$1" $r))); }
  detail "reporter=$r: istio_tcp_connections_opened_total +$(d istio_tcp_connections_opened_total), istio_tcp_received_bytes_total +$(d istio_tcp_received_bytes_total), istio_tcp_sent_bytes_total +$(d istio_tcp_sent_bytes_total)"
done
series=$(grep '^istio_tcp_sent_bytes_total{' "$work/after.prom" | grep 'reporter="destination"' |
  grep "source_principal=\"$front_id\"" | grep 'connection_security_policy="mutual_tls"' | tail -n1)
detail "series: $(grep -o 'connection_security_policy="[^"]*"' <<<"$series"), $(grep -o 'source_principal="[^"]*"' <<<"$series"), $(grep -o 'destination_principal="[^"]*"' <<<"$series")"

# ---------------------------------------------------------------------------------------------------------------
begin 8 "node-agent explain"
explain=$(kubectl exec -n "$RELEASE_NS" "$agent" -c node-agent -- node-agent explain "$AMBIENT_NS/backend" 2>&1) ||
  fail "node-agent explain $AMBIENT_NS/backend: $explain"
say "[8/$STEPS] kubectl exec -n $RELEASE_NS $agent -c node-agent -- node-agent explain $AMBIENT_NS/backend"
while IFS= read -r l; do detail "$l"; done <<<"$explain"
