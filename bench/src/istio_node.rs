//! Istio's own ambient path on a node of its own (#29), for the scenarios that compare it with ours: Istio's agent
//! (its `install-cni` with ambient on, run by testbed's [`IstioAgent`], with the plugin it installs) and our
//! hbone-proxy on its ZDS socket, acking its Adds as it acks our agent's. The pods go through the conflist Istio's
//! installer wrote, run as Istio's plugin.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use tempfile::TempDir;
use testbed::hbone_proxy::Proxy;
use testbed::istio_agent::IstioAgent;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_pod, namespace, redirection};
use testbed::wait::within_every;
use testbed::{Cluster, NetworkConfigList};

use crate::attach::{timed_add, Attached};
use crate::scene::NS;

/// The agent's settings beyond the runner's (Istio's defaults, DNS capture and IPv6 on, as ours runs here).
fn settings(backend: RuleBackend) -> [(&'static str, &'static str); 1] {
    [("NATIVE_NFTABLES", if backend == RuleBackend::Nftables { "true" } else { "false" })]
}

/// The node. Field order is drop order: the proxy, the agent, then the cluster.
pub struct IstioNode {
    _proxy: Proxy,
    /// Istio's agent.
    pub agent: IstioAgent,
    /// The conflist Istio's installer wrote, run as Istio's plugin (the pod range overridden when asked).
    list: NetworkConfigList,
    backend: RuleBackend,
    zds: TempDir,
    _proxy_dir: TempDir,
    /// Node netns, bridge, runtime and fake API.
    pub cluster: Cluster,
}

impl IstioNode {
    /// Istio's agent on native nftables or on iptables (the flavour it detects), and our proxy acking it.
    /// `subnet` overrides the pod range, as [`crate::scene::AmbientNode::start`]'s does.
    pub fn start(backend: RuleBackend, subnet: Option<(&str, &str)>) -> IstioNode {
        let mut cluster = Cluster::with_backend(backend);
        cluster.plugin_overrides = json!({});
        cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
        let zds = tempfile::Builder::new().prefix("bench-istio-zds-").tempdir().expect("ZDS dir");
        let agent = IstioAgent::start(&cluster, zds.path(), &settings(backend));
        let mut conflist = agent.conflist();
        if let Some((range, gateway)) = subnet {
            conflist["plugins"][0]["ipam"]["ranges"] = json!([[{ "subnet": range, "gateway": gateway }]]);
        }
        let list = NetworkConfigList::from_value(conflist).expect("Istio's conflist");
        let proxy_dir = tempfile::Builder::new().prefix("bench-istio-proxy-").tempdir().expect("proxy dir");
        let proxy = start_proxy(&cluster, &agent, proxy_dir.path());
        IstioNode { _proxy: proxy, agent, list, backend, zds, _proxy_dir: proxy_dir, cluster }
    }

    /// Kills Istio's agent (SIGKILL, as a crash) and starts a new one on the same ZDS socket dir, which our proxy
    /// reconnects to; returns how long it took from the kill until the new one answered `/readyz` (Istio's agent
    /// builds its snapshot of the enrolled pods, their netns found through `/proc`, and reconciles their rules
    /// before it reports ready), and whether the new agent logged that its snapshot was incomplete.
    pub fn restart_agent(&mut self) -> (Duration, bool) {
        let pid = self.agent.pid();
        let start = Instant::now();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)
            .expect("SIGKILL Istio's agent");
        // Dead once it is a zombie (its sockets closed); the old runner reaps it when dropped below.
        let dead = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
        };
        // Polled every millisecond: the wait is part of the restart time measured.
        within_every(Instant::now(), Duration::from_secs(20), Duration::from_millis(1), || dead().then_some(()))
            .expect("Istio's agent survived SIGKILL");
        let agent = IstioAgent::start(&self.cluster, self.zds.path(), &settings(self.backend));
        let ready = start.elapsed();
        drop(std::mem::replace(&mut self.agent, agent));
        (ready, self.agent.log().contains("failed to construct initial"))
    }

    /// As [`crate::scene::AmbientNode::add_pod`]: the attachment (its `took` is the ADD alone), and the time from
    /// the start of ADD until the annotation was visible in the API. The ADD starts once Istio's agent has
    /// handled the pod's add event (its informer holds the pod), as on a real node, where the kubelet creates the
    /// sandbox well after the pod was stored: Istio's agent looks the pod up in its informer's cache only, with
    /// ten 10 ms retries, and fails the ADD when the watch event comes later (seen here under load).
    pub fn add_pod(&self, name: &str) -> (Attached, Duration) {
        let mut pod = ambient_pod(NS, name);
        pod["spec"]["serviceAccountName"] = json!(name);
        let before = pod_adds(&self.agent.metrics());
        self.cluster.create(&pod);
        within_every(Instant::now(), Duration::from_secs(20), Duration::from_millis(1), || {
            (pod_adds(&self.agent.metrics()) > before).then_some(())
        })
        .unwrap_or_else(|| panic!("Istio's agent never saw pod {name}"));
        let attached = timed_add(&self.cluster.node, &self.list, NS, name);
        while redirection(&self.cluster, NS, name).as_deref() != Some("enabled") {
            assert!(
                attached.started.elapsed() < Duration::from_secs(20),
                "{name} was never annotated by Istio's agent; log:\n{}",
                self.agent.log()
            );
            std::thread::yield_now();
        }
        let enrolled = attached.started.elapsed();
        let mut object = self.cluster.api.get("Pod", Some(NS), name).expect("pod stored");
        let ip = attached.ip();
        object["status"] = json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
        self.cluster.api.upsert(object).expect("report the pod running");
        (attached, enrolled)
    }

    /// Removes pod `name`: CNI DEL (by dropping the attachment) and the Pod object.
    pub fn remove_pod(&self, name: &str, attached: Attached) {
        drop(attached);
        self.cluster.api.delete("Pod", Some(NS), name);
    }
}

/// The add events Istio's agent has handled (`nodeagent_reconcile_events_total{type="add"}`: pods' and
/// namespaces'; only pods are added while a scenario runs).
fn pod_adds(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.contains("nodeagent_reconcile_events_total{") && l.contains("type=\"add\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Our proxy on `agent`'s ZDS socket, quiet, with the node's kubeconfig for its chart service account.
fn start_proxy(cluster: &Cluster, agent: &IstioAgent, dir: &Path) -> Proxy {
    let kubeconfig = dir.join("kubeconfig");
    cluster.write_kubeconfig_for(&kubeconfig, testbed::chart::PROXY_SERVICE_ACCOUNT);
    let env = [("KUBECONFIG", kubeconfig.to_str().expect("utf-8 path")), ("LOG_LEVEL", "warn")];
    Proxy::start_on(cluster, agent.zds_socket(), dir, &dir.join("workloads.yaml"), &env, None)
}
