//! Scenario 1, sidecar pod setup: one full CNI ADD through the fake runtime (`bridge` + `host-local` +
//! `istio-cni`, the pod served by the fake API) per backend, against the same chain without our plugin and
//! against an exec of `iptables-nft-restore` with the same rules in a fresh netns (the step Istio's plugin
//! performs). Contenders run round-robin with a rotating start so noise hits them alike.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use redirect::iptables::IptablesBackend;
use redirect::sidecar::{build, SidecarConfig};
use testbed::mesh::{sidecar_pod, RuleBackend};
use testbed::{Cluster, NetworkConfigList};

use crate::attach::timed_add;
use crate::pod_rules::fresh_netns;
use crate::report::Section;
use crate::scene::install_kubeconfig;
use crate::stats::Counts;
use crate::stats::{ratio, us, Summary};

/// The benchmark issue's target: our plugin's added cost with native nftables vs the restore exec.
const TARGET_RATIO: f64 = 5.0;
const NS: &str = "bench";
const POD: &str = "web";

/// One timed thing per round.
enum Contender {
    /// The chain without our plugin.
    Without(NetworkConfigList),
    /// The chain with our plugin on this backend.
    With(RuleBackend, NetworkConfigList),
    /// `iptables-nft-restore` of the default sidecar rules in a fresh netns.
    Restore,
}

impl Contender {
    fn label(&self) -> String {
        match self {
            Contender::Without(_) => "bridge + host-local (no istio-cni)".into(),
            Contender::With(b, _) => format!("bridge + host-local + istio-cni, {}", backend_name(*b)),
            Contender::Restore => "iptables-nft-restore exec alone (Istio's step)".into(),
        }
    }
}

fn backend_name(b: RuleBackend) -> &'static str {
    match b {
        RuleBackend::Nftables => "native nftables",
        RuleBackend::IptablesNft => "iptables-nft",
        RuleBackend::IptablesLegacy => "iptables-legacy",
    }
}

/// Runs the scenario and returns its report section.
pub fn run(counts: Counts) -> Section {
    let clusters: Vec<(RuleBackend, Cluster)> =
        RuleBackend::ALL.iter().map(|b| (*b, Cluster::with_backend(*b))).collect();
    for (_, c) in &clusters {
        install_kubeconfig(c);
        c.create(&sidecar_pod(NS, POD));
    }
    let list = |v| NetworkConfigList::from_value(v).expect("valid conflist");
    let mut contenders = vec![Contender::Without(list(clusters[0].1.node.conflist(vec![])))];
    contenders.extend(clusters.iter().map(|(b, c)| Contender::With(*b, list(c.conflist()))));
    contenders.push(Contender::Restore);
    let plan = build(&SidecarConfig::cni_pod_defaults());

    let mut samples = vec![Vec::with_capacity(counts.iterations); contenders.len()];
    for round in 0..counts.warmup + counts.iterations {
        for k in 0..contenders.len() {
            let i = (round + k) % contenders.len();
            let took = match &contenders[i] {
                Contender::Without(l) => timed_add(&clusters[0].1.node, l, NS, POD).took,
                Contender::With(b, l) => {
                    let node = &clusters.iter().find(|(cb, _)| cb == b).expect("cluster of backend").1.node;
                    timed_add(node, l, NS, POD).took
                }
                Contender::Restore => {
                    let ns = fresh_netns();
                    let start = Instant::now();
                    redirect::iptables::apply(&ns, &plan, IptablesBackend::Nft).expect("iptables-nft-restore");
                    start.elapsed()
                }
            };
            if round >= counts.warmup {
                samples[i].push(took);
            }
        }
    }
    let sums: Vec<Summary> = samples.iter().map(|s| Summary::of(s)).collect();
    Section {
        name: "sidecar-setup",
        title: "Sidecar pod setup: one CNI ADD through the fake runtime".into(),
        body: table(&contenders, &sums, counts),
    }
}

fn table(contenders: &[Contender], sums: &[Summary], counts: Counts) -> String {
    let without = sums[0].median;
    let restore = sums[sums.len() - 1].median;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Timed: the runtime's whole ADD (every plugin exec'd with the pod's netns, as containerd does; netns \
         creation excluded). The pod is a sidecar pod stored in the fake API; our plugin looks it up, decides, and \
         programs the default sidecar rules. Warm-up {} rounds, then {} timed rounds; each round runs every \
         contender once, round-robin with a rotating start.\n",
        counts.warmup, counts.iterations
    );
    let _ =
        writeln!(s, "| contender | median µs | p90 µs | p99 µs | added by istio-cni (median) µs | restore / added |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|");
    let mut verdicts = String::new();
    for (c, sum) in contenders.iter().zip(sums) {
        let (added, vs) = match c {
            Contender::With(b, _) => {
                let added = sum.median.saturating_sub(without).max(Duration::from_micros(1));
                let r = ratio(restore, added);
                if *b == RuleBackend::Nftables {
                    let verdict = if r >= TARGET_RATIO { "met" } else { "NOT met" };
                    let _ = writeln!(
                        verdicts,
                        "- istio-cni with native nftables adds {} µs to a pod's ADD; iptables-nft-restore alone \
                         takes {} µs: {r:.1}× (target ≥{TARGET_RATIO}×: {verdict}).",
                        us(added),
                        us(restore)
                    );
                }
                (us(added), format!("{r:.2}×"))
            }
            _ => ("–".into(), "–".into()),
        };
        let _ = writeln!(s, "| {} | {} | {added} | {vs} |", c.label(), sum.us_cells());
    }
    s.push('\n');
    s.push_str(&verdicts);
    s.push_str(
        "\nThe added cost is the whole plugin process: exec, reading the netconf, one GET of the pod from the API \
         server (over https with the kubeconfig install-cni writes: token and cluster CA, a TLS handshake per \
         exec as on a real cluster), the decision, and the rules. Istio's \
         plugin pays the same exec and API call before its `iptables-restore` exec.\n",
    );
    s
}
