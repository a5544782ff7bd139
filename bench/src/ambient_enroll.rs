//! Scenario 2, ambient pod enrollment: the whole path ADD → agent → netns → rules → ZDS Add and ack (the real
//! proxy) → annotation, against the same chain without our plugin; plus the agent's own per-phase histogram.
//! With Istio's binaries built (`scripts/istio-ref/build.sh`), the same path through Istio's own plugin and agent
//! (its `install-cni` as the ambient agent, testbed's `IstioAgent`) on a node of its own, with our hbone-proxy acking its
//! ZDS Adds as it acks ours (#29): the same pods, one of each per round, so noise hits both alike.

use std::fmt::Write as _;
use std::time::Duration;

use testbed::mesh::RuleBackend;
use testbed::{Cluster, NetworkConfigList};

use crate::attach::timed_add;
use crate::istio_node::IstioNode;
use crate::istio_ref;
use crate::load::{self, Load};
use crate::report::Section;
use crate::scene::{AmbientNode, NS};
use crate::stats::Counts;
use crate::stats::{us, Summary};

/// What the side-by-side figures mean (#29).
const ISTIO_READING: &str =
    "\nReading, against Istio's: both paths run the same steps in the same order (the plugin hands \
the pod to the agent, the agent programs the pod's rules, sends the pod to the proxy, waits for its ack, adds the \
host probe entry, annotates). Istio's costs more at each: its plugin is a Go process that builds a Kubernetes client \
and GETs the pod and its namespace over https before it calls its agent; its agent programs the rules by exec'ing \
`nft` or `iptables-restore` after exec'ing the save tools and probing the flavour. Ours asks the agent, which \
answers from its watch; the agent programs native nftables in one netlink batch (no exec), and on iptables-nft \
one `iptables-nft-restore` per family into a new pod's netns (whether the netns holds a table is asked of the \
kernel, so nothing is saved first). On iptables-nft those two execs are most of what ours adds; on native \
nftables the plugin's own process start is.\n";

/// What the `netns` phase times.
const NETNS_NOTE: &str = "\nThe `netns` phase is opening the pod's netns: from the path CNI ADD brings (microseconds) \
or, for pods enrolled by a label change or after a restart, found through /proc.\n";

/// The target for (b) − (c) at the median: what istio-cni adds from ADD to annotation.
const TARGET_ADDED: Duration = Duration::from_millis(5);

/// #29's target: what our plugin and agent add from ADD to annotation, at most this share of what Istio's add.
const ISTIO_TARGET: f64 = 0.3;

/// Phases of `nodeagent_enrollment_duration_seconds`, in path order.
const PHASES: [&str; 5] = ["netns", "rules", "proxy_ack", "probe", "annotate"];

/// Runs the scenario and returns its report section.
pub fn run(counts: Counts) -> Section {
    let load_start = Load::sample();
    let istio = istio_ref::binary("install-cni").and_then(|b| istio_ref::binary("istio-cni").map(|_| b));
    if let Err(why) = &istio {
        println!("ambient-enroll: Istio's plugin and agent rows skipped: {why}");
    }
    let mut body = String::new();
    let _ = writeln!(
        body,
        "Timed per pod: (a) the runtime's ADD with our plugin, which returns once the agent has enrolled the pod \
         (netns found, rules programmed, ZDS Add acked by the real hbone-proxy); (b) from the start of ADD until \
         the `ambient.istio.io/redirection: enabled` annotation is visible in the API; (c) the same chain without \
         our plugin. Warm-up {} pods, then {} timed pods, one after the other; each is deleted (CNI DEL and API \
         delete) before the next. \"Pod and namespace GETs\" counts what the fake API server answered (to the \
         plugin and the agent) per timed ADD: the plugin asks the agent, which answers from its watch.\n",
        counts.warmup, counts.iterations
    );
    match &istio {
        Ok(bin) => {
            let _ = writeln!(
                body,
                "**Istio's** rows (d) and (e) are (a) and (b) through Istio's own plugin and agent (istio.io/istio \
                 `{}`, pinned in `scripts/istio-ref/build.sh`): its `install-cni` as the ambient agent on a node of \
                 its own (testbed's `IstioAgent`: Istio's defaults, DNS capture and IPv6 on as ours; the conflist its \
                 installer wrote, run as its plugin; on iptables the flavour it detects), with our hbone-proxy \
                 acking its ZDS Adds as it acks ours. Each round adds one pod through ours, one through Istio's and \
                 one plain, in that order. Istio's agent logs at debug level (as the runner starts it), ours at \
                 warn. Istio's ADD starts once its agent has handled the pod's add event (its informer holds the \
                 pod, as on a real node: it fails an ADD whose pod its cache lacks after ten 10 ms retries), which \
                 favours it: ours gets its ADD right after the pod is stored.\n",
                bin.version
            );
        }
        Err(why) => {
            let _ = writeln!(body, "Istio's plugin and agent were not measured in this run: {why}.\n");
        }
    }
    let _ = writeln!(body, "| backend | figure | median µs | p90 µs | p99 µs |\n|---|---|---:|---:|---:|");
    let mut phases = String::new();
    let mut verdicts = String::new();
    for backend in [RuleBackend::Nftables, RuleBackend::IptablesNft] {
        let name = match backend {
            RuleBackend::Nftables => "native nftables",
            _ => "iptables-nft",
        };
        println!("ambient-enroll: {name}");
        let node = AmbientNode::start(backend, None);
        let istio_node = istio.is_ok().then(|| IstioNode::start(backend, None));
        let without = NetworkConfigList::from_value(node.cluster.node.conflist(vec![])).expect("plain conflist");
        let (mut add, mut enrolled, mut plain) = (Vec::new(), Vec::new(), Vec::new());
        let (mut istio_add, mut istio_enrolled) = (Vec::new(), Vec::new());
        let (mut gets, mut istio_gets) = (0, 0);
        for round in 0..counts.warmup + counts.iterations {
            let timed = round >= counts.warmup;
            let pod = format!("p{round}");
            let before = lookups(&node.cluster);
            let (attached, through_annotation) = node.add_pod(&pod);
            if timed {
                gets += lookups(&node.cluster) - before;
            }
            let add_took = attached.took;
            node.remove_pod(&pod, attached);
            if let Some(theirs) = &istio_node {
                let before = lookups(&theirs.cluster);
                let (attached, through_annotation) = theirs.add_pod(&pod);
                if timed {
                    istio_gets += lookups(&theirs.cluster) - before;
                    istio_add.push(attached.took);
                    istio_enrolled.push(through_annotation);
                }
                theirs.remove_pod(&pod, attached);
            }
            let plain_took = timed_add(&node.cluster.node, &without, NS, &format!("plain{round}")).took;
            if timed {
                add.push(add_took);
                enrolled.push(through_annotation);
                plain.push(plain_took);
            }
        }
        let mut figures = vec![
            ("(a) ADD with istio-cni (returns after the proxy's ack)", &add),
            ("(b) ADD start → annotation visible", &enrolled),
            ("(c) ADD without istio-cni", &plain),
        ];
        if istio_node.is_some() {
            figures.push(("(d) ADD with **Istio's** istio-cni and agent (returns after the proxy's ack)", &istio_add));
            figures.push(("(e) ADD start → annotation visible, **Istio's** plugin and agent", &istio_enrolled));
        }
        for (figure, samples) in figures {
            let _ = writeln!(body, "| {name} | {figure} | {} |", Summary::of(samples).us_cells());
        }
        let plain_median = Summary::of(&plain).median;
        let added = Summary::of(&enrolled).median.saturating_sub(plain_median);
        let verdict = if added <= TARGET_ADDED { "met" } else { "NOT met" };
        let (table, steps) = phase_table(&node.agent.metrics());
        let _ = writeln!(
            verdicts,
            "- {name}: istio-cni adds {} µs from ADD to annotation at the median ((b) − (c); target ≤ {} µs: \
             {verdict}); pod and namespace GETs per ADD: {:.1}. The agent's rules, proxy_ack, probe and annotate \
             phases, which run one after another (Istio's order: the proxy gets the pod once its rules are in, the \
             annotation says it is enrolled), take {} µs of it (sum of their means).",
            us(added),
            TARGET_ADDED.as_micros(),
            gets as f64 / counts.iterations.max(1) as f64,
            us(steps)
        );
        if istio_node.is_some() {
            let theirs = Summary::of(&istio_enrolled).median.saturating_sub(plain_median).max(Duration::from_micros(1));
            let r = added.as_secs_f64() / theirs.as_secs_f64();
            let _ = writeln!(
                verdicts,
                "- {name}, against Istio's: Istio's plugin and agent add {} µs from ADD to annotation ((e) − (c)); \
                 ours / Istio's = {r:.2}× (target ≤{ISTIO_TARGET}×, i.e. ≤{} µs: {}); Istio's pod and namespace \
                 GETs per ADD: {:.1}.",
                us(theirs),
                us(theirs.mul_f64(ISTIO_TARGET)),
                if r <= ISTIO_TARGET { "met" } else { "NOT met" },
                istio_gets as f64 / counts.iterations.max(1) as f64
            );
        }
        let _ = writeln!(phases, "\nAgent histogram `nodeagent_enrollment_duration_seconds` ({name}, all pods):\n");
        phases.push_str(&table);
    }
    body.push('\n');
    body.push_str(&verdicts);
    if istio.is_ok() {
        body.push_str(ISTIO_READING);
    }
    body.push_str(&phases);
    body.push_str(NETNS_NOTE);
    body.push('\n');
    body.push_str(&load::note(&load_start, &Load::sample()));
    Section { name: "ambient-enroll", title: "Ambient pod enrollment".into(), body }
}

/// Pod and namespace GETs the node's API server has answered so far.
fn lookups(cluster: &Cluster) -> usize {
    let requests = cluster.api.requests();
    let namespace = |p: &str| p.strip_prefix("/api/v1/namespaces/").is_some_and(|rest| !rest.contains('/'));
    requests.iter().filter(|r| r.verb == "get" && (r.path.contains("/pods/") || namespace(&r.path))).count()
}

/// One phase's histogram, read from the agent's `/metrics`.
#[derive(Default)]
struct Phase {
    count: f64,
    sum: f64,
    /// (upper bound, cumulative count), in exposition order (ascending).
    buckets: Vec<(f64, f64)>,
}

impl Phase {
    /// The upper bound of the bucket holding quantile `q` (what a Prometheus histogram can tell).
    fn quantile_bound(&self, q: f64) -> Option<f64> {
        self.buckets.iter().find(|(_, c)| *c >= q * self.count).map(|(le, _)| *le)
    }
}

fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let start = line.find(&format!("{name}=\""))? + name.len() + 2;
    Some(&line[start..start + line[start..].find('"')?])
}

/// The per-phase table, and the sum of the means of the phases an ADD always runs (all but `netns`).
fn phase_table(metrics: &str) -> (String, Duration) {
    const NAME: &str = "nodeagent_enrollment_duration_seconds";
    let mut out = String::from("| phase | count | mean µs | p50 ≤ µs | p90 ≤ µs |\n|---|---:|---:|---:|---:|\n");
    let mut steps = Duration::ZERO;
    for phase in PHASES {
        let mut p = Phase::default();
        for line in metrics.lines().filter(|l| l.starts_with(NAME) && label(l, "phase") == Some(phase)) {
            let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
            if line.starts_with(&format!("{NAME}_sum")) {
                p.sum = value;
            } else if line.starts_with(&format!("{NAME}_count")) {
                p.count = value;
            } else if let Some(le) = label(line, "le") {
                p.buckets.push((le.parse().unwrap_or(f64::INFINITY), value));
            }
        }
        let bound = |q| match p.quantile_bound(q) {
            Some(s) if s.is_finite() => us(Duration::from_secs_f64(s)),
            Some(_) => "+Inf".to_owned(),
            None => "–".to_owned(),
        };
        let mean = (p.count > 0.0).then(|| Duration::from_secs_f64(p.sum / p.count));
        if phase != "netns" {
            steps += mean.unwrap_or_default();
        }
        let mean = mean.map_or_else(|| "–".into(), us);
        let _ = writeln!(out, "| {phase} | {} | {mean} | {} | {} |", p.count, bound(0.5), bound(0.9));
    }
    (out, steps)
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn reads_phase_histograms_from_the_exposition() {
        let text = "\
nodeagent_enrollment_duration_seconds_sum{phase=\"rules\"} 0.004
nodeagent_enrollment_duration_seconds_count{phase=\"rules\"} 4
nodeagent_enrollment_duration_seconds_bucket{le=\"0.0005\",phase=\"rules\"} 1
nodeagent_enrollment_duration_seconds_bucket{le=\"0.001\",phase=\"rules\"} 3
nodeagent_enrollment_duration_seconds_bucket{le=\"+Inf\",phase=\"rules\"} 4
";
        let (table, steps) = phase_table(text);
        assert!(table.contains("| rules | 4 | 1000 | 1000 | +Inf |"), "{table}");
        assert_eq!(steps, Duration::from_millis(1));
    }
}
