//! `node-bench`: the benchmark program of the benchmark issue. Each scenario sets up real namespaces, runs a
//! fixed number of iterations after a warm-up, measures against its baseline in the same run, prints a markdown
//! table and writes it into BENCHMARKS.md. Run it with `scripts/bench.sh [SCENARIO...]` (release build, as root,
//! with nothing else loaded); timings never appear in the test suite.

mod ambient_enroll;
mod apps;
mod attach;
mod fleet;
mod hbone;
mod hostile_buffers;
mod installer_repair;
mod iperf;
mod istio_node;
mod istio_ref;
mod istiod_policy;
mod istiod_scale;
mod load;
mod node_scale;
mod pod_rules;
mod process_figures;
mod report;
mod scene;
mod sidecar_setup;
mod stats;
mod throughput;

use clap::{Parser, ValueEnum};

use crate::stats::Counts;

/// The scenarios, named as in BENCHMARKS.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// Per-pod cost of the rule programming step alone, per backend.
    PodRules,
    /// A sidecar pod's whole CNI ADD with and without our plugin, per backend.
    SidecarSetup,
    /// An ambient pod's whole enrollment path, and the agent's per-phase histogram.
    AmbientEnroll,
    /// HBONE and same-node fast path throughput, 1 and 4 streams, node-bench's apps and iperf3, against direct TCP.
    HboneThroughput,
    /// HBONE request/response latency and connection setup, against direct TCP.
    HboneLatency,
    /// 1,000 pods on one node: enrollment rate, memory, restart times.
    NodeScale,
    /// Time from a rival's conflist rewrite until install-cni has re-inserted our plugin.
    InstallerRepair,
    /// Several nodes on one API server: each component's requests, watch events, bytes and memory, and the
    /// model for 5,000 nodes × 100 pods (iterations: enrolled pods per node).
    Fleet,
    /// One pod pushing into 500, 1,500 and 3,000 non-reading connections across nodes: each proxy's memory before,
    /// at the peak and after the burst, with the buffer budget on and off (iterations unused).
    HostileBuffers,
    /// On the real node (`scripts/cluster.sh up`), with Istio's istiod and our proxy in istiod mode: the time from an
    /// AuthorizationPolicy change stored in the API server to its enforcement (skipped without a real node).
    IstiodPolicy,
    /// One proxy in istiod mode fed N workloads (10,000; a few hundred with `--quick`) by the fake istiod: its
    /// memory with none and with N known, and the time from a DENY pushed over xDS to the first refusal.
    IstiodScale,
}

impl Scenario {
    /// Default counts: cheap scenarios run many rounds, heavy ones fewer.
    fn default_counts(self) -> Counts {
        match self {
            Scenario::PodRules => Counts { warmup: 20, iterations: 200 },
            Scenario::SidecarSetup => Counts { warmup: 10, iterations: 100 },
            Scenario::InstallerRepair => Counts { warmup: 5, iterations: 100 },
            Scenario::AmbientEnroll => Counts { warmup: 5, iterations: 50 },
            Scenario::HboneThroughput => Counts { warmup: 1, iterations: 5 },
            Scenario::HboneLatency => Counts { warmup: 200, iterations: 2000 },
            Scenario::NodeScale => Counts { warmup: 10, iterations: 1000 },
            Scenario::Fleet => Counts { warmup: 0, iterations: 25 },
            Scenario::HostileBuffers => Counts { warmup: 0, iterations: 1 },
            Scenario::IstiodPolicy => Counts { warmup: 2, iterations: 20 },
            Scenario::IstiodScale => Counts { warmup: 2, iterations: 20 },
        }
    }

    /// `--quick` counts: enough rounds to run every code path of the scenario, few enough that the whole set
    /// takes under two minutes, so CI can keep the benchmark from rotting.
    fn quick_counts(self) -> Counts {
        match self {
            Scenario::PodRules => Counts { warmup: 1, iterations: 5 },
            Scenario::SidecarSetup => Counts { warmup: 1, iterations: 3 },
            Scenario::InstallerRepair => Counts { warmup: 1, iterations: 5 },
            Scenario::AmbientEnroll => Counts { warmup: 1, iterations: 3 },
            Scenario::HboneThroughput => Counts { warmup: 0, iterations: 1 },
            Scenario::HboneLatency => Counts { warmup: 10, iterations: 100 },
            Scenario::NodeScale => Counts { warmup: 1, iterations: 20 },
            Scenario::Fleet => Counts { warmup: 0, iterations: 2 },
            Scenario::HostileBuffers => Counts { warmup: 0, iterations: 1 },
            Scenario::IstiodPolicy => Counts { warmup: 0, iterations: 1 },
            Scenario::IstiodScale => Counts { warmup: 0, iterations: 3 },
        }
    }
}

/// MiB per HBONE throughput run under `--quick` (unless `BENCH_TRANSFER_MIB` is set).
const QUICK_TRANSFER_MIB: &str = "8";

#[derive(Debug, Parser)]
#[command(about = "Benchmarks pod setup, HBONE and node scale against baselines in the same run")]
struct Args {
    /// Scenarios to run (all when none is given).
    #[arg(value_enum)]
    scenarios: Vec<Scenario>,
    /// Timed iterations per scenario (overrides each scenario's default).
    #[arg(long, env = "BENCH_ITERATIONS")]
    iterations: Option<usize>,
    /// Warm-up iterations per scenario (overrides each scenario's default).
    #[arg(long, env = "BENCH_WARMUP")]
    warmup: Option<usize>,
    /// Print the tables without touching BENCHMARKS.md.
    #[arg(long)]
    no_write: bool,
    /// Every scenario (or the named ones) with a few iterations and small transfers: checks that the benchmark
    /// still runs, in under two minutes. Implies `--no-write`; its figures are not the published ones.
    #[arg(long)]
    quick: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(nix::unistd::geteuid().is_root(), "node-bench needs root (network namespaces, netfilter)");
    let scenarios = if args.scenarios.is_empty() { Scenario::value_variants().to_vec() } else { args.scenarios };
    if args.quick && std::env::var_os("BENCH_TRANSFER_MIB").is_none() {
        // Set before any thread starts; the HBONE scenarios read it.
        std::env::set_var("BENCH_TRANSFER_MIB", QUICK_TRANSFER_MIB);
    }
    let started = std::time::Instant::now();
    for scenario in scenarios {
        let defaults = if args.quick { scenario.quick_counts() } else { scenario.default_counts() };
        let counts = Counts {
            warmup: args.warmup.unwrap_or(defaults.warmup),
            iterations: args.iterations.unwrap_or(defaults.iterations).max(1),
        };
        println!("== {scenario:?}: warm-up {}, iterations {}", counts.warmup, counts.iterations);
        let section = match scenario {
            Scenario::PodRules => pod_rules::run(counts),
            Scenario::SidecarSetup => sidecar_setup::run(counts),
            Scenario::InstallerRepair => installer_repair::run(counts),
            Scenario::AmbientEnroll => ambient_enroll::run(counts),
            Scenario::HboneThroughput => throughput::throughput(counts),
            Scenario::HboneLatency => hbone::latency(counts),
            Scenario::NodeScale => node_scale::run(counts),
            Scenario::Fleet => fleet::run(counts, args.quick),
            Scenario::HostileBuffers => hostile_buffers::run(args.quick),
            Scenario::IstiodPolicy => istiod_policy::run(counts),
            Scenario::IstiodScale => istiod_scale::run(counts, args.quick),
        };
        if args.quick {
            println!("\n{}", section.render_as("`scripts/bench.sh --quick` (debug build, few rounds: not comparable)"));
        } else {
            println!("\n{}", section.render());
        }
        if !args.no_write && !args.quick {
            let path = report::write(&section)?;
            println!("wrote {}", path.display());
        }
    }
    if args.quick {
        println!("node-bench --quick: every scenario ran, in {:.0?} (figures not published)", started.elapsed());
    }
    Ok(())
}
