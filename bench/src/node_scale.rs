//! Scenario 5, node scale: enroll N pods (default 1,000) on one node, one after the other, and report the
//! enrollment throughput, the agent's and proxy's RSS at rest and per pod, the agent's startup reconcile time with
//! N running pods, and the proxy's re-adoption time after a restart.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use istio_contract::ports;
use testbed::mesh::RuleBackend;
use testbed::node_agent::uid;
use testbed::pod_process::PodProcess;

use crate::report::Section;
use crate::scene::{AmbientNode, NS};
use crate::stats::Counts;
use crate::stats::{us, Summary};

/// A pod range with room for thousands of pods (the test node's default is a /24).
const SUBNET: (&str, &str) = ("10.200.0.0/20", "10.200.0.1");
/// How long a whole-node convergence may take before the run is declared broken.
const LIMIT: Duration = Duration::from_secs(300);

/// Resident set size of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix(" kB")?.trim().parse().ok())
        .expect("VmRSS in status")
}

/// The value of gauge `name` in a Prometheus exposition.
fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn proxy_active(node: &AmbientNode) -> Option<f64> {
    let netns = node.cluster.node.netns().path();
    let (_, body) = testbed::http::get(&netns, ports::STATS, "/metrics").ok()?;
    gauge(&body, "workload_manager_active_proxy_count")
}

/// Polls `probe` every millisecond until it holds; returns when that was, measured from `since`.
fn until(since: Instant, what: &str, mut probe: impl FnMut() -> bool) -> Duration {
    while !probe() {
        assert!(since.elapsed() < LIMIT, "{what}: not within {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    since.elapsed()
}

/// Runs the scenario and returns its report section.
pub fn run(counts: Counts) -> Section {
    let n = counts.iterations;
    let mut node = AmbientNode::start(RuleBackend::Nftables, Some(SUBNET));
    let (agent0, proxy0) = (rss_kib(node.agent.pid()), rss_kib(node.proxy.pid()));

    println!("node-scale: enrolling {n} pods");
    let start = Instant::now();
    let mut pods = Vec::with_capacity(n);
    let mut latencies = Vec::with_capacity(n);
    for i in 0..n {
        let (pod, took) = node.add_pod(&format!("s{i}"));
        latencies.push(took);
        pods.push(pod);
    }
    let enrolled = until(start, "the proxy runs every pod", || proxy_active(&node) == Some(n as f64));
    let (agent1, proxy1) = (rss_kib(node.agent.pid()), rss_kib(node.proxy.pid()));

    println!("node-scale: starting a process in each pod (for the agent's /proc discovery after its restart)");
    let processes: Vec<PodProcess> = pods
        .iter()
        .enumerate()
        .map(|(i, p)| PodProcess::start(&p.netns, &uid(&node.cluster, NS, &format!("s{i}"))))
        .collect();

    println!("node-scale: restarting the node agent");
    let start = Instant::now();
    let agent_ready = node.restart_agent();
    let agent_restored = until(start, "the restarted agent holds every pod", || {
        gauge(&node.agent.metrics(), "nodeagent_enrolled_pods") == Some(n as f64)
    });

    println!("node-scale: restarting the proxy");
    let readopt_ready = node.restart_proxy();
    let start = Instant::now();
    let readopted =
        readopt_ready + until(start, "the new proxy runs every pod", || proxy_active(&node) == Some(n as f64));

    let lat = Summary::of(&latencies);
    let per_pod = |before: u64, after: u64| after.saturating_sub(before) as f64 / n as f64;
    let mut body = String::new();
    let _ = writeln!(
        body,
        "{n} ambient pods enrolled one after the other through the fake runtime (bridge + host-local + istio-cni, \
         native nftables rules), each until its annotation was visible and the real hbone-proxy ran its \
         listeners. RSS from `/proc/<pid>/status`. Restart figures: the agent is SIGKILLed and started again with \
         a process running in every pod (found through `/proc`); the proxy is killed and started again.\n"
    );
    let _ = writeln!(body, "| figure | value |\n|---|---:|");
    let rows = [
        ("pods", format!("{n}")),
        ("enrollment throughput (sequential)", format!("{:.1} pods/s", n as f64 / enrolled.as_secs_f64())),
        (
            "per-pod ADD → annotation, median / p90 / p99",
            format!("{} / {} / {} µs", us(lat.median), us(lat.p90), us(lat.p99)),
        ),
        ("node-agent RSS at rest, 0 pods", format!("{agent0} KiB")),
        ("node-agent RSS at rest, all pods", format!("{agent1} KiB ({:.1} KiB per pod)", per_pod(agent0, agent1))),
        ("hbone-proxy RSS at rest, 0 pods", format!("{proxy0} KiB")),
        ("hbone-proxy RSS at rest, all pods", format!("{proxy1} KiB ({:.1} KiB per pod)", per_pod(proxy0, proxy1))),
        ("agent restart: ready", format!("{} ms", agent_ready.as_millis())),
        ("agent restart: every pod restored", format!("{} ms", agent_restored.as_millis())),
        ("proxy restart: ready (first snapshot applied)", format!("{} ms", readopt_ready.as_millis())),
        ("proxy restart: every pod re-adopted", format!("{} ms", readopted.as_millis())),
    ];
    for (figure, value) in rows {
        let _ = writeln!(body, "| {figure} | {value} |");
    }
    println!("node-scale: tearing down {n} pods");
    drop(processes);
    drop(pods);
    Section { name: "node-scale", title: format!("Node scale: {n} pods on one node"), body }
}
