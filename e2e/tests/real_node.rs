//! Our chart on a real node (issue #28): a real kube-apiserver (Node and RBAC authorization, NodeRestriction,
//! service-account token signing), a real kubelet and containerd 1.6 with its CRI calling the CNI reference plugins
//! and then our plugin, as `scripts/cluster.sh up` runs them. Everything is done as a user does it: `helm install`
//! of the chart with Istio's ambient profile, `kubectl` for pods and namespaces, the node's own files for what
//! install-cni wrote, `crictl` for the runtime's view, and the pods' network namespaces for their rules.
//!
//! Each test skips when no real node runs (see [`testbed::real_node`]); `scripts/test.sh` brings one up and sets
//! `REAL_NODE_REQUIRED=1`, so there a missing node fails. The tests share one node, so they take turns
//! ([`LOCK`]); each starts from "our chart installed" and puts it back when it changed it.

use std::collections::BTreeSet;
use std::sync::Mutex;

use istio_contract::{names, ports};
use serde_json::Value;
use testbed::real_node::{RealNode, APP_IMAGE, NODE_NAME, RELEASE_NAMESPACE};

/// One test at a time on the one node.
static LOCK: Mutex<()> = Mutex::new(());

/// The host's primary conflist, as `scripts/cluster.sh` writes it (bridge + host-local, then portmap).
const PRIMARY_CONFLIST: &str = "/etc/cni/net.d/10-bridge.conflist";
/// Where install-cni puts the plugin.
const PLUGIN_BINARY: &str = "/opt/cni/bin/istio-cni";
/// The plugin's kubeconfig, written by install-cni into its run dir.
const PLUGIN_KUBECONFIG: &str = "/var/run/istio-cni/istio-cni-kubeconfig";

/// The node with our chart installed, or `None` when no real node runs.
fn node() -> Option<(std::sync::MutexGuard<'static, ()>, RealNode)> {
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let node = RealNode::connect()?;
    node.ensure_installed();
    Some((guard, node))
}

/// A Deployment of `replicas` app pods labelled `app=NAME` in `ns`, each an echo server on 8080 that answers
/// one line with `pong from <pod>` and logs what it read.
fn echo_deployment(node: &RealNode, ns: &str, name: &str, replicas: u32) {
    node.apply(&format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: {ns}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: app
        image: {APP_IMAGE}
        imagePullPolicy: Never
        env: [{{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}]
        command: ["nc", "-ll", "-p", "8080", "-e", "sh", "-c", "read l; echo \"got $l\" >&2; echo pong from $POD_NAME"]
        readinessProbe: {{exec: {{command: ["sh", "-c", "netstat -ltn | grep -q ':8080 '"]}}, periodSeconds: 1}}
"#
    ));
}

/// Waits for `count` Ready pods labelled `app=NAME` in `ns`: their names and IPs.
#[track_caller]
fn ready_pods(node: &RealNode, ns: &str, app: &str, count: usize) -> Vec<(String, String)> {
    node.eventually_or(
        &format!("{count} ready pods app={app} in {ns}"),
        || {
            let pods: Vec<(String, String)> = node
                .pods(ns, &format!("app={app}"))
                .into_iter()
                .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
                .filter(|p| {
                    p["status"]["conditions"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
                })
                .filter_map(|p| {
                    Some((p["metadata"]["name"].as_str()?.to_string(), p["status"]["podIP"].as_str()?.to_string()))
                })
                .collect();
            (pods.len() == count).then_some(pods)
        },
        || node.describe_namespace(ns),
    )
}

/// The in-pod rules of pod `ns/name`, as the iptables tools and nft see them (whichever backend wrote them).
fn pod_rules(node: &RealNode, ns: &str, name: &str) -> String {
    let mut all = String::new();
    for (program, args) in
        [("iptables-nft-save", &[][..]), ("iptables-legacy-save", &[][..]), ("nft", &["list", "ruleset"][..])]
    {
        if let Some(out) = node.in_pod_netns(ns, name, program, args) {
            all.push_str(&out);
        }
    }
    all
}

/// Whether `rules` hold Istio's in-pod redirection (the iptables chain names or the nftables tables).
fn has_istio_rules(rules: &str) -> bool {
    rules.contains("ISTIO_OUTPUT")
        || rules.contains("ISTIO_PRERT")
        || rules.contains("istio-proxy-nat")
        || rules.contains("istio-ambient-nat")
}

/// `echo ping | nc IP 8080` from pod `ns/from`: the answer line.
fn ask(node: &RealNode, ns: &str, from: &str, ip: &str) -> (bool, String) {
    node.exec(ns, from, "app", &["sh", "-c", &format!("echo ping | timeout 10 nc {ip} 8080")])
}

/// A metric's value summed over its series in a Prometheus text page, for series whose labels hold every
/// `labels` pair.
fn metric_sum(page: &str, name: &str, labels: &[&str]) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| {
            let rest = &l[name.len()..];
            (rest.starts_with('{') || rest.starts_with(' ')) && labels.iter().all(|p| l.contains(p))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `GET http://POD_IP:PORT/metrics` of a pod of the release, fetched from the node's netns as Prometheus would
/// scrape it.
fn scrape(node: &RealNode, pod: &str, port: u16) -> String {
    let pod = node.pod(RELEASE_NAMESPACE, pod).expect("the pod exists");
    let ip = pod["status"]["podIP"].as_str().expect("the pod has an IP").to_string();
    let out = node.in_node("curl", &["-sf", "--max-time", "5", &format!("http://{ip}:{port}/metrics")]);
    assert!(out.status.success(), "scrape {ip}:{port}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn install_chains_into_the_real_conflist_and_its_kubeconfig_authenticates() {
    let Some((_guard, node)) = node() else { return };
    for ds in ["istio-cni-node", "hbone-proxy"] {
        let d = node.get_json(&["daemonset", ds, "-n", RELEASE_NAMESPACE]).expect("the DaemonSet exists");
        assert_eq!(d["status"]["numberReady"], 1, "{ds}: {}", d["status"]);
    }
    // install-cni chained the plugin into the primary's conflist, last, keeping the primary's plugins.
    let conflist: Value = serde_json::from_str(&std::fs::read_to_string(PRIMARY_CONFLIST).unwrap()).unwrap();
    let types: Vec<&str> = conflist["plugins"].as_array().unwrap().iter().filter_map(|p| p["type"].as_str()).collect();
    assert_eq!(types, ["bridge", "portmap", "istio-cni"], "{conflist}");
    assert!(std::path::Path::new(PLUGIN_BINARY).exists());
    // The kubeconfig it wrote carries the pod's projected token: the real API server authenticates it as the
    // chart's service account, and the real RBAC lets it read pods.
    // The plugin runs on the node, where the kubeconfig's server (the kubernetes Service's IP) is reachable.
    let (ok, whoami) = node.kubectl_on_node(&["--kubeconfig", PLUGIN_KUBECONFIG, "auth", "whoami", "-o", "json"]);
    assert!(ok && whoami.contains("system:serviceaccount:istio-system:istio-cni"), "{whoami}");
    let (_, can) =
        node.kubectl_on_node(&["--kubeconfig", PLUGIN_KUBECONFIG, "auth", "can-i", "get", "pods", "-n", "default"]);
    assert_eq!(can.trim(), "yes");
}

/// The token in the plugin's kubeconfig.
fn kubeconfig_token() -> Option<String> {
    let text = std::fs::read_to_string(PLUGIN_KUBECONFIG).ok()?;
    text.lines().find_map(|l| l.trim().strip_prefix("token:").map(|t| t.trim().trim_matches('"').to_string()))
}

/// The projected token the kubelet wrote for the istio-cni-node pod, read from the kubelet's volume dir.
fn projected_token(node: &RealNode) -> Option<String> {
    let pod = node.pod(RELEASE_NAMESPACE, &node.agent_pod())?;
    let uid = pod["metadata"]["uid"].as_str()?;
    let dir = std::path::Path::new("/var/lib/istio-cni-rs/real-node/kubelet/pods")
        .join(uid)
        .join("volumes/kubernetes.io~projected");
    let vol = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(Result::ok)
        .find(|e| e.file_name().to_string_lossy().starts_with("kube-api-access-"))?;
    std::fs::read_to_string(vol.path().join("token")).ok()
}

#[test]
fn the_plugin_kubeconfig_follows_the_projected_token_when_the_kubelet_rotates_it() {
    let Some((_guard, node)) = node() else { return };
    let before = node.eventually("the kubelet has written the pod's token", || projected_token(&node));
    node.eventually("the kubeconfig holds the pod's token", || (kubeconfig_token()? == before).then_some(()));
    // A restarted kubelet has no cached tokens: it asks TokenRequest for new ones and rewrites every projected
    // volume, as it does when a token nears its expiry.
    node.restart("kubelet");
    let after =
        node.eventually("the kubelet rotated the pod's token", || projected_token(&node).filter(|t| *t != before));
    node.eventually("install-cni rewrote the kubeconfig with the new token", || {
        (kubeconfig_token()? == after).then_some(())
    });
    let (ok, whoami) = node.kubectl_on_node(&["--kubeconfig", PLUGIN_KUBECONFIG, "auth", "whoami", "-o", "json"]);
    assert!(ok && whoami.contains("system:serviceaccount:istio-system:istio-cni"), "{whoami}");
    node.eventually(&format!("node {NODE_NAME} is Ready again"), || {
        node.run("kubectl", &["wait", "--for=condition=Ready", &format!("node/{NODE_NAME}"), "--timeout=2s"])
            .status
            .success()
            .then_some(())
    });
}

/// A pod as Istio's injector writes it with istio-cni: the `sidecar.istio.io/status` annotation and `istio-proxy`
/// as a native sidecar (uid 1337), here a stand-in listening on 15001 and 15006 that logs what reaches it. Its
/// startup probe holds the app until the proxy listens, as `holdApplicationUntilProxyStarts` does. The app's
/// first action is one connection to an address no pod has: only the redirect can answer it.
fn sidecar_pod_yaml(ns: &str) -> String {
    let listener = |port: u16| {
        format!("nc -ll -p {port} -e sh -c 'read l; echo \"{port} got: $l\" >&2; echo answered-by-{port}' & ")
    };
    let status = r#"{"initContainers":["istio-proxy"],"containers":null,"volumes":["istio-envoy","istio-data"],"imagePullSecrets":null,"revision":"default"}"#;
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "web",
            "namespace": ns,
            "labels": {"app": "web", "security.istio.io/tlsMode": "istio", "service.istio.io/canonical-name": "web"},
            "annotations": {
                names::SIDECAR_STATUS_ANNOTATION: status,
                "kubectl.kubernetes.io/default-container": "app",
                "prometheus.io/port": ports::STATS.to_string(),
            },
        },
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "initContainers": [{
                "name": names::PROXY_CONTAINER,
                "image": APP_IMAGE,
                "imagePullPolicy": "Never",
                "restartPolicy": "Always",
                "args": ["proxy", "sidecar"],
                "command": ["sh", "-c", format!("{}{}wait", listener(ports::OUTBOUND), listener(ports::INBOUND_PLAINTEXT))],
                "securityContext": {"runAsUser": 1337, "runAsGroup": 1337, "runAsNonRoot": true, "allowPrivilegeEscalation": false},
                "startupProbe": {
                    "exec": {"command": ["sh", "-c", format!("netstat -ltn | grep -q ':{} ' && netstat -ltn | grep -q ':{} '", ports::OUTBOUND, ports::INBOUND_PLAINTEXT)]},
                    "periodSeconds": 1,
                    "failureThreshold": 60,
                },
            }],
            "containers": [{
                "name": "app",
                "image": APP_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", "echo first-byte-from-app | timeout 10 nc 10.252.0.254 80 >&2; exec nc -ll -p 8080 -e echo app"],
            }],
        },
    })
    .to_string()
}

#[test]
fn a_sidecar_pod_is_redirected_before_its_app_sends_a_byte() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-sidecar";
    node.delete_namespace(ns);
    node.namespace(ns, &[]);
    node.apply(&sidecar_pod_yaml(ns));
    let pod = node.wait_ready(ns, "web");
    let ip = pod["status"]["podIP"].as_str().unwrap().to_string();
    // The app's very first connection, to an address nobody has, was answered by the proxy's outbound port.
    let app_log = node.kubectl(&["logs", "-n", ns, "web", "-c", "app"]);
    let outbound = ports::OUTBOUND;
    assert!(
        app_log.contains(&format!("answered-by-{outbound}")),
        "the app's first connection was not redirected: {app_log:?}"
    );
    let proxy_log = node.kubectl(&["logs", "-n", ns, "web", "-c", "istio-proxy"]);
    assert!(proxy_log.contains(&format!("{outbound} got: first-byte-from-app")), "{proxy_log:?}");
    // Inbound: a connection to the app's port from outside the pod lands on 15006.
    let out = node.in_node("sh", &["-c", &format!("echo inbound-hello | busybox timeout 10 busybox nc {ip} 8080")]);
    let inbound = ports::INBOUND_PLAINTEXT;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("answered-by-{inbound}"));
    node.eventually("the proxy logged the inbound bytes", || {
        node.kubectl(&["logs", "-n", ns, "web", "-c", "istio-proxy"])
            .contains(&format!("{inbound} got: inbound-hello"))
            .then_some(())
    });
    let rules = pod_rules(&node, ns, "web");
    assert!(rules.contains("ISTIO_INBOUND") || rules.contains("istio-proxy-nat"), "{rules}");
    node.delete_namespace(ns);
}

/// Waits until every pod of `pods` carries the ambient annotation and in-pod rules.
#[track_caller]
fn assert_enrolled(node: &RealNode, ns: &str, pods: &[(String, String)]) {
    for (name, _) in pods {
        node.eventually_or(
            &format!("{ns}/{name} is annotated {}: {}", names::AMBIENT_REDIRECTION, names::AMBIENT_REDIRECTION_ENABLED),
            || {
                let pod = node.pod(ns, name)?;
                (pod["metadata"]["annotations"][names::AMBIENT_REDIRECTION] == names::AMBIENT_REDIRECTION_ENABLED)
                    .then_some(())
            },
            || format!("{:?}", node.pod(ns, name)),
        );
        let rules = pod_rules(node, ns, name);
        assert!(has_istio_rules(&rules), "{ns}/{name} has no in-pod rules:\n{rules}");
    }
}

/// Waits until no pod of `pods` carries the annotation or in-pod rules.
#[track_caller]
fn assert_not_enrolled(node: &RealNode, ns: &str, pods: &[(String, String)]) {
    for (name, _) in pods {
        node.eventually_or(
            &format!("{ns}/{name} has neither the ambient annotation nor in-pod rules"),
            || {
                let pod = node.pod(ns, name)?;
                let annotated = !pod["metadata"]["annotations"][names::AMBIENT_REDIRECTION].is_null();
                (!annotated && !has_istio_rules(&pod_rules(node, ns, name))).then_some(())
            },
            || pod_rules(node, ns, name),
        );
    }
}

/// A fresh ambient namespace `ns` (labelled `istio.io/dataplane-mode=ambient`) with an echo Deployment `app` of
/// `replicas` pods, once every pod is Ready and enrolled: their names and IPs.
#[track_caller]
fn enrolled_app(node: &RealNode, ns: &str, app: &str, replicas: u32) -> Vec<(String, String)> {
    node.delete_namespace(ns);
    node.namespace(ns, &[(names::DATAPLANE_MODE_LABEL, "ambient")]);
    echo_deployment(node, ns, app, replicas);
    let pods = ready_pods(node, ns, app, replicas as usize);
    assert_enrolled(node, ns, &pods);
    pods
}

/// The hbone-proxy's count of HBONE connections it accepted with mTLS (the inbound side of pod-to-pod traffic).
fn hbone_connections(node: &RealNode) -> f64 {
    let page = scrape(node, &node.proxy_pod(), ports::STATS);
    metric_sum(&page, "istio_tcp_connections_opened_total", &["connection_security_policy=\"mutual_tls\""])
}

/// Two app pods of an ambient namespace exchange a line both ways and back.
#[track_caller]
fn assert_talk(node: &RealNode, ns: &str, pods: &[(String, String)]) {
    let (a, b) = (&pods[0], &pods[1]);
    for (from, to) in [(a, b), (b, a)] {
        let (ok, answer) = ask(node, ns, &from.0, &to.1);
        assert!(ok && answer.contains(&format!("pong from {}", to.0)), "{} -> {}: {answer}", from.0, to.0);
    }
}

#[test]
fn ambient_pods_are_enrolled_by_the_real_cni_call_and_talk_over_hbone() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-ambient";
    let pods = enrolled_app(&node, ns, "echo", 2);
    // Istio's default backend: iptables (the image carries Debian's iptables-nft).
    let rules = node.in_pod_netns(ns, &pods[0].0, "iptables-nft-save", &[]).unwrap_or_default();
    assert!(rules.contains("ISTIO_OUTPUT"), "not iptables rules:\n{rules}");
    // The annotation was written by the node agent with the chart's service account, through the real RBAC.
    let pod: Value = serde_json::from_str(&node.kubectl(&[
        "get",
        "pod",
        &pods[0].0,
        "-n",
        ns,
        "-o",
        "json",
        "--show-managed-fields",
    ]))
    .unwrap();
    let managers: BTreeSet<String> = pod["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["manager"].as_str().map(str::to_string))
        .collect();
    assert!(managers.iter().any(|m| m.contains("node-agent")), "managers: {managers:?}");

    // Same node, fast path on (the chart's default): the pods talk; the proxy carried them.
    assert_talk(&node, ns, &pods);

    // Fast path off: the same pods, now over HBONE with mTLS through the proxy's 15008.
    node.helm_install(&["proxy.sameNodeFastPath=false"]);
    let before = hbone_connections(&node);
    node.eventually("the pods talk again after the proxy restarted", || {
        let (ok, answer) = ask(&node, ns, &pods[0].0, &pods[1].1);
        (ok && answer.contains("pong from")).then_some(())
    });
    assert_talk(&node, ns, &pods);
    let after = hbone_connections(&node);
    assert!(after >= before + 2.0, "HBONE mTLS connections {before} -> {after}");
    node.helm_install(&[]);
    node.delete_namespace(ns);
}

#[test]
fn native_nftables_mode_enrolls_and_redirects_ambient_pods_too() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-nft";
    node.helm_install(&["global.nativeNftables=true"]);
    let pods = enrolled_app(&node, ns, "nft", 2);
    for (name, _) in &pods {
        let nft = node.in_pod_netns(ns, name, "nft", &["list", "ruleset"]).unwrap_or_default();
        assert!(nft.contains("table inet istio-ambient-nat"), "{name}: not Istio's nftables layout:\n{nft}");
        let ipt = node.in_pod_netns(ns, name, "iptables-nft-save", &[]).unwrap_or_default();
        assert!(!ipt.contains("ISTIO_"), "{name}: iptables rules in nftables mode:\n{ipt}");
    }
    assert_talk(&node, ns, &pods);
    node.delete_namespace(ns);
    node.helm_install(&[]);
}

/// Open file descriptors of processes named `comm` whose target starts with `kind` (`net:` for network namespace
/// handles, `socket:` for sockets: the proxy's listeners inside each pod's netns are sockets, and a socket keeps its
/// netns alive).
fn descriptors_of(comm: &str, kind: &str) -> usize {
    let mut n = 0;
    for proc in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(name) = std::fs::read_to_string(proc.path().join("comm")) else { continue };
        if name.trim() != comm {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(proc.path().join("fd")) else { continue };
        n += fds
            .filter_map(Result::ok)
            .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy().starts_with(kind)))
            .count();
    }
    n
}

/// Network namespace handles held by processes named `comm`.
fn netns_handles(comm: &str) -> usize {
    descriptors_of(comm, "net:")
}

/// Sockets held by processes named `comm`.
fn sockets_of(comm: &str) -> usize {
    descriptors_of(comm, "socket:")
}

/// A gauge or counter of a release pod's metrics page (its annotated port), summed over series.
fn release_metric(node: &RealNode, pod: &str, port: u16, name: &str) -> f64 {
    metric_sum(&scrape(node, pod, port), name, &[])
}

#[test]
fn a_pod_deleted_by_the_kubelet_leaves_nothing_behind() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-delete";
    node.delete_namespace(ns);
    node.namespace(ns, &[(names::DATAPLANE_MODE_LABEL, "ambient")]);
    let (agent, proxy) = (node.agent_pod(), node.proxy_pod());
    let state = |node: &RealNode| {
        (
            release_metric(node, &agent, ports::CNI_MONITORING, "nodeagent_enrolled_pods"),
            release_metric(node, &proxy, ports::STATS, "workload_manager_active_proxy_count"),
            sockets_of("hbone-proxy"),
            netns_handles("node-agent") + netns_handles("hbone-proxy"),
        )
    };
    let before = state(&node);
    echo_deployment(&node, ns, "gone", 1);
    let pods = ready_pods(&node, ns, "gone", 1);
    assert_enrolled(&node, ns, &pods);
    let (name, ip) = pods[0].clone();
    let probes =
        || String::from_utf8_lossy(&node.in_node("ipset", &["list", "istio-inpod-probes-v4"]).stdout).into_owned();
    let ipam = testbed::real_node::state_dir().join("cni-ipam/podnet").join(&ip);
    let sandbox = node.sandbox_id(ns, &name).expect("the pod's sandbox");
    let inspect: Value = serde_json::from_str(&node.ok("crictl", &["inspectp", &sandbox])).unwrap();
    let netns_path = inspect["info"]["runtimeSpec"]["linux"]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["type"] == "network")
        .and_then(|n| n["path"].as_str())
        .expect("the sandbox's netns path")
        .to_string();
    let during = state(&node);
    assert!(during.0 == before.0 + 1.0 && during.1 == before.1 + 1.0, "enrolled: {before:?} -> {during:?}");
    assert!(during.2 > before.2, "the proxy listens in the pod: {before:?} -> {during:?}");
    assert!(probes().contains(&ip) && ipam.exists() && std::path::Path::new(&netns_path).exists());

    node.kubectl(&["scale", "deployment/gone", "-n", ns, "--replicas=0"]);
    node.eventually("the pod is gone from the API", || node.pod(ns, &name).is_none().then_some(()));
    node.eventually_or(
        "nothing of the pod is left: CNI DEL ran through the chain (IPAM released), ZDS Del reached the proxy, no \
         listener, netns handle or probe-set entry is left",
        || {
            let now = state(&node);
            (now == before
                && !ipam.exists()
                && !probes().contains(&ip)
                && !std::path::Path::new(&netns_path).exists()
                && node.sandbox_id(ns, &name).is_none())
            .then_some(())
        },
        || format!("before {before:?}, now {:?}, ipam {}, probes {}", state(&node), ipam.exists(), probes()),
    );
    let (_, explain) = node.exec(RELEASE_NAMESPACE, &agent, "node-agent", &["node-agent", "explain", "--all"]);
    assert!(!explain.contains(&name), "explain still lists {name}: {explain}");
    node.delete_namespace(ns);
}

#[test]
fn labelling_a_running_namespace_enrolls_its_pods_without_a_restart_and_unlabelling_removes_them() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-label";
    node.delete_namespace(ns);
    node.namespace(ns, &[]);
    echo_deployment(&node, ns, "late", 2);
    let pods = ready_pods(&node, ns, "late", 2);
    assert_not_enrolled(&node, ns, &pods);
    let sandboxes: Vec<Option<String>> = pods.iter().map(|(n, _)| node.sandbox_id(ns, n)).collect();
    node.kubectl(&["label", "namespace", ns, &format!("{}=ambient", names::DATAPLANE_MODE_LABEL)]);
    assert_enrolled(&node, ns, &pods);
    assert_talk(&node, ns, &pods);
    node.kubectl(&["label", "namespace", ns, &format!("{}-", names::DATAPLANE_MODE_LABEL)]);
    assert_not_enrolled(&node, ns, &pods);
    assert_talk(&node, ns, &pods);
    // Same sandboxes all along: nothing restarted.
    let after: Vec<Option<String>> = pods.iter().map(|(n, _)| node.sandbox_id(ns, n)).collect();
    assert_eq!(sandboxes, after);
    node.delete_namespace(ns);
}

#[test]
fn after_the_agent_kubelet_and_containerd_restart_every_pod_is_reconciled() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-faults";
    enrolled_app(&node, ns, "steady", 2);
    // Kill the node agent's container: the kubelet restarts it, and it restores its pods from the node.
    let agent = node.agent_pod();
    let restarts = |node: &RealNode| -> u64 {
        node.pod(RELEASE_NAMESPACE, &agent)
            .and_then(|p| {
                p["status"]["containerStatuses"]
                    .as_array()?
                    .iter()
                    .find(|c| c["name"] == "node-agent")
                    .and_then(|c| c["restartCount"].as_u64())
            })
            .unwrap_or(0)
    };
    let before = restarts(&node);
    let id = node.ok("crictl", &["ps", "--name", "^node-agent$", "-q"]);
    node.ok("crictl", &["stop", "--timeout", "0", id.trim()]);
    node.eventually("the node agent's container was restarted", || (restarts(&node) > before).then_some(()));
    node.wait_rollout("istio-cni-node");
    node.restart("kubelet");
    node.restart("containerd");
    node.wait_rollout("istio-cni-node");
    node.wait_rollout("hbone-proxy");
    let pods = ready_pods(&node, ns, "steady", 2);
    assert_enrolled(&node, ns, &pods);
    // The API still shows the pods Ready from before the restarts; a restarted kubelet serves `exec` for a pod only
    // once it has synced it again (until then: "unable to upgrade connection: pod does not exist").
    for (name, _) in &pods {
        node.eventually(&format!("the restarted kubelet serves exec for {name}"), || {
            node.exec(ns, name, "app", &["true"]).0.then_some(())
        });
    }
    assert_talk(&node, ns, &pods);
    // A pod created after the faults is enrolled too.
    node.kubectl(&["scale", "deployment/steady", "-n", ns, "--replicas=3"]);
    let pods = ready_pods(&node, ns, "steady", 3);
    assert_enrolled(&node, ns, &pods);
    assert_talk(&node, ns, &pods[1..]);
    // Nothing leaked: the agent and the proxy each hold exactly the node's three ambient pods.
    let (agent, proxy) = (node.agent_pod(), node.proxy_pod());
    node.eventually_or(
        "the agent and the proxy each hold exactly the three pods",
        || {
            let enrolled = release_metric(&node, &agent, ports::CNI_MONITORING, "nodeagent_enrolled_pods");
            let proxied = release_metric(&node, &proxy, ports::STATS, "workload_manager_active_proxy_count");
            (enrolled == 3.0 && proxied == 3.0).then_some(())
        },
        || {
            format!(
                "enrolled {}, proxied {}",
                release_metric(&node, &agent, ports::CNI_MONITORING, "nodeagent_enrolled_pods"),
                release_metric(&node, &proxy, ports::STATS, "workload_manager_active_proxy_count")
            )
        },
    );
    node.delete_namespace(ns);
}

#[test]
fn a_pod_created_during_a_rollout_is_redirected_or_fails_closed() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-rollout";
    node.delete_namespace(ns);
    node.namespace(ns, &[(names::DATAPLANE_MODE_LABEL, "ambient")]);
    echo_deployment(&node, ns, "churn", 1);
    ready_pods(&node, ns, "churn", 1);
    node.kubectl(&["rollout", "restart", "daemonset/istio-cni-node", "daemonset/hbone-proxy", "-n", RELEASE_NAMESPACE]);
    // Pods created while the agent and the proxy are replaced: each ends up Running with its rules, or never starts
    // unredirected.
    node.kubectl(&["scale", "deployment/churn", "-n", ns, "--replicas=3"]);
    node.wait_rollout("istio-cni-node");
    node.wait_rollout("hbone-proxy");
    let pods = ready_pods(&node, ns, "churn", 3);
    assert_enrolled(&node, ns, &pods);
    // Every container that ever ran in the namespace ran in a redirected pod: a pod whose ADD failed closed never
    // ran its app (its sandbox was torn down and retried), so any Running pod must hold rules.
    for p in node.pods(ns, "app=churn") {
        let name = p["metadata"]["name"].as_str().unwrap();
        if p["status"]["phase"] == "Running" {
            assert!(has_istio_rules(&pod_rules(&node, ns, name)), "{name} runs without rules");
        }
    }
    node.delete_namespace(ns);
}

#[test]
fn explain_events_and_every_annotated_metrics_port_are_seen_from_outside() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-explain";
    let pods = enrolled_app(&node, ns, "seen", 1);
    // A pod that opts out with its own label, beside the enrolled one.
    node.apply(
        &serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "out", "namespace": ns, "labels": {names::DATAPLANE_MODE_LABEL: "none"}},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{"name": "app", "image": APP_IMAGE,
                     "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]},
        })
        .to_string(),
    );
    node.wait_ready(ns, "out");
    let agent = node.agent_pod();
    let explain = |pod: &str| {
        node.exec(
            RELEASE_NAMESPACE,
            &agent,
            "node-agent",
            &["node-agent", "explain", &format!("{ns}/{pod}"), "-o", "json"],
        )
    };
    // `kubectl exec … node-agent explain` tells the truth about each: the enrolled pod is in the mesh with its rules
    // in sync and acked by the proxy, the opted-out pod is not and says why, a pod that is not there is an error.
    let (ok, text) = explain(&pods[0].0);
    assert!(ok, "{text}");
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(report["verdict"], "in mesh (ambient)", "{report}");
    assert_eq!(report["mode"], "ambient", "{report}");
    assert_eq!(report["ips"][0], pods[0].1.as_str(), "{report}");
    assert_eq!(report["zds"]["state"], "acked", "{report}");
    assert_eq!(report["rules"]["backend"], "iptables-nft", "{report}");
    let (expected, found) = (&report["rules"]["expected"], &report["rules"]["found"]);
    assert!(expected.as_array().is_some_and(|e| !e.is_empty()) && expected == found, "rules not in sync: {report}");
    let (ok, text) = explain("out");
    assert!(ok, "{text}");
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(report["mode"], "none", "{report}");
    assert!(report["verdict"].as_str().is_some_and(|v| v.starts_with("not in mesh") && v.contains("none")), "{report}");
    let (ok, text) = explain("no-such-pod");
    assert!(!ok && text.contains("not on this node"), "{text}");
    // Our Events, through the API: the repair controller in label mode (Istio's `repair.labelPods`) writes one on
    // a broken sidecar pod, whose `istio-validation` init container exited with Istio's code 126.
    node.helm_install(&["repair.repairPods=false", "repair.labelPods=true"]);
    let broken = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "broken",
            "namespace": ns,
            "labels": {"app": "broken", names::DATAPLANE_MODE_LABEL: "none"},
            "annotations": {names::SIDECAR_STATUS_ANNOTATION: r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#},
        },
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "initContainers": [{
                "name": names::VALIDATION_CONTAINER,
                "image": APP_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", format!("exit {}", names::VALIDATION_EXIT_CODE)],
            }],
            "containers": [
                {"name": names::PROXY_CONTAINER, "image": APP_IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                 "securityContext": {"runAsUser": 1337, "runAsGroup": 1337}},
                {"name": "app", "image": APP_IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "3600"]},
            ],
        },
    });
    node.apply(&broken.to_string());
    let event = node.eventually_or(
        "the repair controller's LabelBrokenPod Event on the broken pod",
        || {
            let events = node.get_json(&["events", "-n", ns, "--field-selector", "involvedObject.name=broken"])?;
            events["items"].as_array()?.iter().find(|e| e["reason"] == "LabelBrokenPod").cloned()
        },
        || node.describe_namespace(ns),
    );
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["source"]["component"], "cni-repair", "{event}");
    let pod = node.pod(ns, "broken").unwrap();
    assert_eq!(pod["metadata"]["labels"][names::BROKEN_POD_LABEL], "true", "{pod}");
    node.helm_install(&[]);
    // Every metrics port the chart annotates answers a scrape.
    for pod in node.pods(RELEASE_NAMESPACE, "app.kubernetes.io/instance=istio-cni") {
        let name = pod["metadata"]["name"].as_str().unwrap();
        let Some(port) = pod["metadata"]["annotations"]["prometheus.io/port"].as_str() else { continue };
        let page = scrape(&node, name, port.parse().unwrap());
        assert!(page.contains("# TYPE"), "{name}:{port}: {page}");
    }
    node.delete_namespace(ns);
}

#[test]
fn uninstall_leaves_the_hosts_bin_dir_and_conflist_as_before() {
    let Some((_guard, node)) = node() else { return };
    node.helm_uninstall();
    // The conflist holds what scripts/cluster.sh wrote before the install (as JSON: key order may differ).
    let read = |p: &std::path::Path| -> Value { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    let pristine = testbed::real_node::state_dir().join("pristine").join("10-bridge.conflist");
    assert_eq!(read(PRIMARY_CONFLIST.as_ref()), read(&pristine));
    assert!(!std::path::Path::new(PLUGIN_BINARY).exists());
    let bins: BTreeSet<String> = std::fs::read_dir("/opt/cni/bin")
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    assert_eq!(bins, ["bridge", "host-local", "loopback", "portmap"].iter().map(|s| s.to_string()).collect());
    node.helm_install(&[]);
}

/// One request in the API server's audit log (`scripts/cluster.sh` logs every request of istio-system's service
/// accounts at the Metadata level).
#[derive(Debug)]
struct Audited {
    user_agent: String,
    verb: String,
    resource: String,
    namespace: String,
    uri: String,
}

/// Every request in the audit log from byte `from` on, once each (a watch is logged when its response starts and
/// again when it ends).
fn audited(from: u64) -> Vec<Audited> {
    let path = testbed::real_node::state_dir().join("audit.log");
    let text = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (a node started before the audit log was added: restart it with scripts/cluster.sh)",
            path.display()
        )
    });
    let text = String::from_utf8_lossy(text.get(from as usize..).unwrap_or_default());
    let mut seen = BTreeSet::new();
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|event| seen.insert(event["auditID"].as_str().unwrap_or_default().to_string()))
        .map(|event| {
            let field = |v: &Value| v.as_str().unwrap_or_default().to_string();
            Audited {
                user_agent: field(&event["userAgent"]),
                verb: field(&event["verb"]),
                resource: field(&event["objectRef"]["resource"]),
                namespace: field(&event["objectRef"]["namespace"]),
                uri: field(&event["requestURI"]),
            }
        })
        .collect()
}

/// The size of the audit log now: where the requests of what follows begin.
fn audit_log_end() -> u64 {
    let path = testbed::real_node::state_dir().join("audit.log");
    std::fs::metadata(&path).map(|m| m.len()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// #31's API load on the real API server: while pods are created and enrolled, the node agent GETs no pod (its
/// watch already holds them), writes each pod at most once (the annotation), and every pod list and watch it has
/// made since it started asks for its own node's pods only. The plugin, which asks the agent, sends nothing either.
/// What each of our components sent in that time is printed, by verb and resource.
#[test]
fn on_a_real_api_server_the_agent_gets_no_pod_writes_once_per_pod_and_watches_only_its_node() {
    let Some((_guard, node)) = node() else { return };
    let ns = "real-api-load";
    let replicas = 4;
    node.delete_namespace(ns);
    let from = audit_log_end();
    let pods = enrolled_app(&node, ns, "load", replicas);
    // Every pod is annotated, so every request of its enrollment has been answered, and so logged.
    let requests = audited(from);
    let agent = |r: &&Audited| r.user_agent.starts_with("node-agent/");
    let mut by_component: std::collections::BTreeMap<(String, String, String), usize> = Default::default();
    for r in &requests {
        let component = r.user_agent.split('/').next().unwrap_or_default().to_string();
        *by_component.entry((component, r.verb.clone(), r.resource.clone())).or_default() += 1;
    }
    println!("requests while {replicas} pods were created and enrolled (component, verb, resource: count):");
    for ((component, verb, resource), count) in &by_component {
        println!("  {component:<14} {verb:<8} {resource:<24} {count}");
    }
    assert!(requests.iter().any(|r| agent(&r)), "no request of the node agent was logged at all: {requests:#?}");
    let pod_gets: Vec<&Audited> = requests
        .iter()
        .filter(|r| r.resource == "pods" && r.verb == "get" && r.namespace == ns)
        .filter(|r| agent(r) || r.user_agent.starts_with("istio-cni/"))
        .collect();
    assert!(pod_gets.is_empty(), "pod GETs by the agent or the plugin: {pod_gets:#?}");
    let writes: Vec<&Audited> = requests
        .iter()
        .filter(agent)
        .filter(|r| r.resource == "pods" && r.namespace == ns && matches!(r.verb.as_str(), "patch" | "update"))
        .collect();
    assert!(!writes.is_empty() && writes.len() <= pods.len(), "{} pods, the agent's writes: {writes:#?}", pods.len());
    // Since the node started: each pod list and watch of the agent carries its node's field selector.
    let node_scoped = format!("fieldSelector=spec.nodeName%3D{}", testbed::real_node::NODE_NAME);
    let reads: Vec<Audited> = audited(0)
        .into_iter()
        .filter(|r| r.user_agent.starts_with("node-agent/") && r.resource == "pods")
        .filter(|r| matches!(r.verb.as_str(), "list" | "watch"))
        .collect();
    assert!(!reads.is_empty(), "no pod list or watch of the agent in the audit log");
    let unscoped: Vec<&Audited> = reads.iter().filter(|r| !r.uri.contains(&node_scoped)).collect();
    assert!(unscoped.is_empty(), "pod reads of the agent not scoped to {node_scoped}: {unscoped:#?}");
    node.delete_namespace(ns);
}

/// What istiod has sent our xDS client so far: workloads (uid → tunnel protocol, node, addresses) and policies
/// (`ns/name` → action).
#[derive(Debug, Default)]
struct Received {
    workloads: std::collections::BTreeMap<String, (i32, String, Vec<Vec<u8>>)>,
    policies: std::collections::BTreeMap<String, i32>,
}

/// The xDS client's consumer in the test: it keeps what it is given.
struct Keep(std::sync::Arc<std::sync::Mutex<Received>>);

impl xds::ads::Handler for Keep {
    fn apply(
        &mut self,
        _ty: xds::wire::ResourceType,
        upserts: Vec<xds::ads::Upsert>,
        removals: Vec<String>,
    ) -> Vec<(String, String)> {
        use xds::wire::resource::DecodedResource;
        use xds::wire::workload::address::Type;
        let mut got = self.0.lock().unwrap();
        for name in removals {
            got.workloads.remove(&name);
            got.policies.remove(&name);
        }
        for upsert in upserts {
            match upsert.resource {
                DecodedResource::Address(address) => {
                    if let Some(Type::Workload(w)) = address.r#type {
                        got.workloads.insert(upsert.name, (w.tunnel_protocol, w.node, w.addresses));
                    }
                }
                DecodedResource::Authorization(policy) => {
                    got.policies.insert(upsert.name, policy.action);
                }
            }
        }
        Vec::new()
    }
}

/// Issue #32 against a real istiod: Istio's own `pilot-discovery`, built from the pinned module, on the real node's
/// API server. Our xDS client connects over TLS to 15012 as ztunnel does (a `istio-system/ztunnel` token with audience
/// `istio-ca`, the mesh root from `istio-ca-root-cert`), receives the workloads of the pods our agent enrolled
/// (HBONE, on this node, with their IPs), and an `AuthorizationPolicy` written with kubectl reaches it within seconds
/// as it goes from ALLOW to DENY, back to ALLOW, and away.
#[test]
fn a_real_istiod_gives_our_clients_the_enrolled_workloads_each_policy_change_and_their_certificates() {
    let Some((_guard, node)) = node() else { return };
    let Some(istiod) = testbed::real_istiod::RealIstiod::start(&node) else { return };
    let ns = "real-istiod";
    let pods = enrolled_app(&node, ns, "xds", 2);

    let received = std::sync::Arc::new(std::sync::Mutex::new(Received::default()));
    let vars: std::collections::BTreeMap<String, String> = [
        ("XDS_ADDRESS", istiod.address()),
        ("ALT_XDS_HOSTNAME", testbed::real_istiod::SERVER_NAME.to_string()),
        ("XDS_ROOT_CA", istiod.root_cert().display().to_string()),
        ("AUTH_TOKEN", istiod.token().display().to_string()),
        ("POD_NAME", "ztunnel-test".to_string()),
        ("POD_NAMESPACE", RELEASE_NAMESPACE.to_string()),
        ("NODE_NAME", NODE_NAME.to_string()),
        ("INSTANCE_IP", testbed::real_node::NODE_IP.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let config = xds::settings::channel_config(xds::settings::Endpoint::Xds, &vars, std::path::Path::exists)
        .expect("xDS settings")
        .expect("an xDS address");
    let channel = xds::channel::Channel::new(config).expect("channel");
    let identity = xds::settings::node_identity(&vars).expect("node identity");
    let (client, readiness) =
        xds::ads::AdsClient::new(channel, xds::ads::AdsConfig::new(identity.node()), Keep(received.clone()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let task = runtime.spawn(client.run(async move {
        let _ = stopped.await;
    }));
    let context = || format!("received: {:?}\nistiod:\n{}", received.lock().unwrap(), istiod.log());
    node.eventually_or("the xDS client is ready (both types applied)", || readiness.is_ready().then_some(()), context);

    // The enrolled pods, as istiod's ambient controller describes them to a node proxy.
    for (name, ip) in &pods {
        let uid = format!("Kubernetes//Pod/{ns}/{name}");
        let octets: Vec<u8> = ip.parse::<std::net::Ipv4Addr>().unwrap().octets().to_vec();
        node.eventually_or(
            &format!("istiod sends {uid} as an HBONE workload on {NODE_NAME} at {ip}"),
            || {
                let got = received.lock().unwrap();
                let (tunnel, on, addresses) = got.workloads.get(&uid)?;
                let hbone = *tunnel == xds::wire::workload::TunnelProtocol::Hbone as i32;
                (hbone && on == NODE_NAME && addresses.contains(&octets)).then_some(())
            },
            context,
        );
    }

    // A policy, changed from ALLOW to DENY and back, then deleted: each change reaches the client.
    let policy = |action: &str| {
        format!(
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: gate, namespace: {ns}}}\n\
             spec:\n  action: {action}\n  rules:\n  - from: [{{source: {{namespaces: [\"other\"]}}}}]\n"
        )
    };
    let key = format!("{ns}/gate");
    let (allow, deny) = (xds::wire::security::Action::Allow as i32, xds::wire::security::Action::Deny as i32);
    for (action, want) in [("ALLOW", allow), ("DENY", deny), ("ALLOW", allow)] {
        node.apply(&policy(action));
        node.eventually_or(
            &format!("istiod sends {key} as {action}"),
            || (received.lock().unwrap().policies.get(&key) == Some(&want)).then_some(()),
            context,
        );
    }
    node.kubectl(&["delete", "authorizationpolicy", "gate", "-n", ns]);
    node.eventually_or(
        &format!("istiod removes {key}"),
        || (!received.lock().unwrap().policies.contains_key(&key)).then_some(()),
        context,
    );
    let _ = stop.send(());
    let _ = runtime.block_on(task);

    // istiod's CA, as our proxy will use it: the proxy's pod asks for its pods' identity (impersonation), and for
    // an identity with no pod on this node it is refused with istiod's own message.
    let proxy_pod = node.proxy_pod();
    let token = istiod.pod_token(&node, testbed::chart::PROXY_SERVICE_ACCOUNT, &proxy_pod);
    let ca_vars: std::collections::BTreeMap<String, String> = [
        ("CA_ADDRESS", istiod.address()),
        ("ALT_CA_HOSTNAME", testbed::real_istiod::SERVER_NAME.to_string()),
        ("CA_ROOT_CA", istiod.root_cert().display().to_string()),
        ("AUTH_TOKEN", token.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let ca =
        mesh_ca::client::CaClient::from_env(&ca_vars, std::path::Path::exists).expect("CA settings").expect("a CA");
    let local: hbone::identity::Identity = format!("spiffe://cluster.local/ns/{ns}/sa/default").parse().unwrap();
    let cert = runtime
        .block_on(ca.fetch(&local))
        .unwrap_or_else(|e| panic!("istiod refused {local} for {proxy_pod}: {e}\n{}", istiod.log()));
    assert_eq!(cert.identity(), &local);
    assert!(!cert.roots().is_empty(), "no trust roots in istiod's chain");
    let elsewhere: hbone::identity::Identity = "spiffe://cluster.local/ns/nowhere/sa/nobody".parse().unwrap();
    let refused = runtime.block_on(ca.fetch(&elsewhere)).map(|c| c.identity().to_string()).unwrap_err().to_string();
    assert!(refused.contains("request impersonation authentication failure"), "{refused}");
    node.delete_namespace(ns);
}

/// The proxy's `/config_dump`, read from inside its pod (the admin port listens on the pod's loopback).
fn proxy_config_dump(node: &RealNode) -> Option<Value> {
    let pod = node.proxy_pod();
    let url = format!("http://127.0.0.1:{}/config_dump", ports::ADMIN);
    let text = node.in_pod_netns(RELEASE_NAMESPACE, &pod, "curl", &["-sf", "--max-time", "5", &url])?;
    serde_json::from_str(&text).ok()
}

/// Issue #32 end to end: our proxy, installed by our chart with `proxy.controlPlane=istiod`, joins Istio's real
/// istiod as ztunnel would (the projected `istio-ca` token, the root from `istio-ca-root-cert`, istiod's Service
/// name resolved through the pod's resolv.conf by the image's resolver).
/// It takes the enrolled pods' workloads from istiod's xDS and their certificates from istiod's CA (impersonation,
/// for pods on its node), carries HBONE between two pods with those certificates (the same-node fast path off, so
/// the bytes cross mTLS on 15008), and enforces an `AuthorizationPolicy` written with kubectl as it goes from
/// ALLOW to DENY and back to ALLOW, within seconds of each change.
#[test]
fn our_proxy_joins_a_real_istiod_carries_hbone_with_its_certificates_and_enforces_its_policies() {
    let Some((_guard, node)) = node() else { return };
    let Some(istiod) = testbed::real_istiod::RealIstiod::start(&node) else { return };
    let ns = "real-istiod-proxy";
    // ztunnel's defaults: istiod by its Service name (`istiod.istio-system.svc:15012`), resolved in the proxy's
    // pod as its resolv.conf says (the cluster DNS, the search domains), by the static image's own resolver.
    node.helm_install(&["proxy.controlPlane=istiod", "proxy.sameNodeFastPath=false"]);
    let context = || format!("proxy dump: {:#?}\nistiod:\n{}", proxy_config_dump(&node), istiod.log());

    let pods = enrolled_app(&node, ns, "echo", 2);
    // What istiod sent and issued, as the proxy shows it: both pods as HBONE workloads from istiod, and a
    // certificate for their identity from istiod's CA.
    let identity = format!("spiffe://cluster.local/ns/{ns}/sa/default");
    let dump = node.eventually_or(
        "the proxy's config dump lists the pods from istiod and their identity's certificate as Available",
        || {
            let dump = proxy_config_dump(&node)?;
            let listed = pods.iter().all(|(name, _)| {
                dump["workloads"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|w| w["name"] == name.as_str() && w["source"] == "istiod" && w["protocol"] == "HBONE")
            });
            let certified = dump["certificates"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["identity"] == identity.as_str() && c["state"] == "Available");
            (listed && certified).then_some(dump)
        },
        context,
    );
    assert_eq!(dump["control_plane"], "istiod", "{dump:#}");
    let cert = dump["certificates"].as_array().unwrap().iter().find(|c| c["identity"] == identity.as_str()).unwrap();
    assert!(cert["issuer"].as_str().is_some_and(|i| !i.is_empty()), "istiod's CA issued it: {cert:#}");

    // The pods talk over HBONE with istiod's certificates.
    let before = hbone_connections(&node);
    assert_talk(&node, ns, &pods);
    let after = hbone_connections(&node);
    assert!(after >= before + 2.0, "HBONE mTLS connections {before} -> {after}");

    // A policy on the pods' namespace, from ALLOW to DENY and back: each change takes effect within seconds.
    let policy = |action: &str| {
        format!(
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: gate, namespace: {ns}}}\n\
             spec:\n  action: {action}\n  rules:\n  - from: [{{source: {{namespaces: [\"{ns}\"]}}}}]\n"
        )
    };
    let talks = |node: &RealNode| {
        let (ok, answer) = ask(node, ns, &pods[0].0, &pods[1].1);
        ok && answer.contains("pong from")
    };
    let denied = || {
        let page = scrape(&node, &node.proxy_pod(), ports::STATS);
        metric_sum(&page, "istio_tcp_connections_refused_total", &["reason=\"authorization_policy\""])
    };
    node.apply(&policy("ALLOW"));
    node.eventually_or("the pods talk under an ALLOW of their namespace", || talks(&node).then_some(()), context);
    let refused_before = denied();
    node.apply(&policy("DENY"));
    node.eventually_or("a DENY of their namespace stops the pods' traffic", || (!talks(&node)).then_some(()), context);
    assert!(denied() > refused_before, "the proxy counted the denial");
    let dump = proxy_config_dump(&node).expect("config dump");
    let held = dump["policies"].as_array().cloned().unwrap_or_default();
    assert!(held.iter().any(|p| p["name"] == format!("{ns}/gate") && p["action"] == "DENY"), "{dump:#}");
    node.apply(&policy("ALLOW"));
    node.eventually_or("the pods talk again under ALLOW", || talks(&node).then_some(()), context);
    node.kubectl(&["delete", "authorizationpolicy", "gate", "-n", ns]);
    assert_talk(&node, ns, &pods);

    node.helm_install(&[]);
    node.delete_namespace(ns);
}
