//! Scenario 1, sidecar pod setup: one full CNI ADD through the fake runtime (`bridge` + `host-local` +
//! `istio-cni`, the pod served by the fake API, the node agent beside it as the chart runs it) per backend,
//! against the same chain without our plugin, against our plugin with no agent (its API lookup), and against an
//! exec of `iptables-nft-restore` with the same rules in a fresh netns (the step Istio's plugin performs).
//! Contenders run round-robin with a rotating start so noise hits them alike. The pod GETs each fake API server
//! received are counted per ADD.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use redirect::iptables::IptablesBackend;
use redirect::sidecar::{build, SidecarConfig};
use testbed::mesh::{sidecar_pod, RuleBackend};
use testbed::node_agent::NodeAgent;
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
    /// The chain with our plugin on this backend, the node agent answering its pod lookup (cluster index).
    With(RuleBackend, usize, NetworkConfigList),
    /// The chain with our plugin (native nftables) and no node agent: the plugin GETs the pod (cluster index).
    NoAgent(usize, NetworkConfigList),
    /// `iptables-nft-restore` of the default sidecar rules in a fresh netns.
    Restore,
    /// The plugin exec'd for `VERSION`: the process's start and exit alone.
    Version,
    /// A static executable that only exits: what any exec'd plugin pays before its first instruction (the
    /// runtime's fork, the kernel's exec and exit), so the floor under the plugin's added cost on this machine.
    ExecFloor(std::path::PathBuf),
}

impl Contender {
    fn label(&self) -> String {
        match self {
            Contender::Without(_) => "bridge + host-local (no istio-cni)".into(),
            Contender::With(b, _, _) => format!("bridge + host-local + istio-cni, {}", backend_name(*b)),
            Contender::NoAgent(_, _) => {
                "bridge + host-local + istio-cni, native nftables, no node agent (API lookup)".into()
            }
            Contender::Restore => "iptables-nft-restore exec alone (Istio's step)".into(),
            Contender::Version => "istio-cni exec for VERSION alone (process start)".into(),
            Contender::ExecFloor(_) => "exec floor: a static executable that only exits".into(),
        }
    }

    /// The cluster whose API server this contender's plugin talks to.
    fn cluster(&self) -> Option<usize> {
        match self {
            Contender::With(_, i, _) | Contender::NoAgent(i, _) => Some(*i),
            _ => None,
        }
    }
}

/// Execs `path` as the runtime execs a plugin (`CNI_COMMAND=VERSION`, stdout and stderr read) and times it to
/// its exit.
fn timed_exec(path: &std::path::Path) -> Duration {
    let start = Instant::now();
    let out = std::process::Command::new(path)
        .env("CNI_COMMAND", "VERSION")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("exec {}: {e}", path.display()));
    assert!(out.status.success(), "{} VERSION: {out:?}", path.display());
    start.elapsed()
}

/// The smallest program an exec can start: a 129-byte static x86-64 ELF whose one instruction sequence is
/// `exit(0)` (no dynamic loader, no libc, one page mapped).
mod exec_floor {
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};

    /// Where the program is loaded; its code starts right after the two headers.
    const BASE: u64 = 0x40_0000;
    const HEADERS: u64 = 64 + 56;
    /// `mov eax, 60` (exit); `xor edi, edi`; `syscall`.
    const CODE: [u8; 9] = [0xb8, 60, 0, 0, 0, 0x31, 0xff, 0x0f, 0x05];

    fn image() -> Vec<u8> {
        let size = HEADERS + CODE.len() as u64;
        let mut elf = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        elf.extend(2u16.to_le_bytes()); // ET_EXEC
        elf.extend(0x3eu16.to_le_bytes()); // x86-64
        elf.extend(1u32.to_le_bytes());
        elf.extend((BASE + HEADERS).to_le_bytes()); // entry
        elf.extend(64u64.to_le_bytes()); // program headers' offset
        elf.extend(0u64.to_le_bytes()); // no section headers
        elf.extend(0u32.to_le_bytes());
        for half in [64u16, 56, 1, 0, 0, 0] {
            elf.extend(half.to_le_bytes()); // header size, phdr size and count, no sections
        }
        elf.extend(1u32.to_le_bytes()); // PT_LOAD
        elf.extend(5u32.to_le_bytes()); // R + X
        elf.extend(0u64.to_le_bytes());
        elf.extend(BASE.to_le_bytes());
        elf.extend(BASE.to_le_bytes());
        elf.extend(size.to_le_bytes());
        elf.extend(size.to_le_bytes());
        elf.extend(0x1000u64.to_le_bytes());
        elf.extend(CODE);
        elf
    }

    /// Writes the program into `dir`; `None` on another architecture than x86-64 (the row is left out).
    pub fn write(dir: &Path) -> Option<PathBuf> {
        if !cfg!(target_arch = "x86_64") {
            return None;
        }
        let path = dir.join("exit0");
        std::fs::write(&path, image()).expect("write the exec floor program");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("make it executable");
        Some(path)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_program_runs_and_exits_zero() {
            let dir = tempfile::tempdir().unwrap();
            let Some(path) = super::write(dir.path()) else { return };
            assert_eq!(std::fs::metadata(&path).unwrap().len(), 129);
            assert!(std::process::Command::new(&path).status().unwrap().success());
        }
    }
}

/// Pod GETs of [`POD`] that `cluster`'s API server answered.
fn pod_gets(cluster: &Cluster) -> usize {
    cluster.api.requests().iter().filter(|r| r.verb == "get" && r.path.ends_with(&format!("/pods/{POD}"))).count()
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
    // One cluster per backend with the node agent beside the plugin (as the chart runs it: sidecar-only, no
    // repair), and one native-nftables cluster without it.
    let mut clusters: Vec<Cluster> = RuleBackend::ALL.iter().map(|b| Cluster::with_backend(*b)).collect();
    clusters.push(Cluster::with_backend(RuleBackend::Nftables));
    for c in &clusters {
        install_kubeconfig(c);
        c.create(&sidecar_pod(NS, POD));
    }
    // After install-cni has written the kubeconfig and stopped: both listen on 8000 in the node netns.
    let agent_env = [("AMBIENT_ENABLED", "false"), ("REPAIR_ENABLED", "false"), ("LOG_LEVEL", "warn")];
    let _agents: Vec<NodeAgent> =
        clusters[..RuleBackend::ALL.len()].iter().map(|c| NodeAgent::start(c, &agent_env)).collect();
    let list = |v| NetworkConfigList::from_value(v).expect("valid conflist");
    let mut contenders = vec![Contender::Without(list(clusters[0].node.conflist(vec![])))];
    contenders
        .extend(RuleBackend::ALL.iter().enumerate().map(|(i, b)| Contender::With(*b, i, list(clusters[i].conflist()))));
    let no_agent = clusters.len() - 1;
    contenders.push(Contender::NoAgent(no_agent, list(clusters[no_agent].conflist())));
    contenders.push(Contender::Version);
    let floor_dir = tempfile::tempdir().expect("exec floor dir");
    if let Some(path) = exec_floor::write(floor_dir.path()) {
        contenders.push(Contender::ExecFloor(path));
    }
    contenders.push(Contender::Restore);
    let plan = build(&SidecarConfig::cni_pod_defaults());

    let mut samples = vec![Vec::with_capacity(counts.iterations); contenders.len()];
    let mut gets = vec![0; contenders.len()];
    for round in 0..counts.warmup + counts.iterations {
        for k in 0..contenders.len() {
            let i = (round + k) % contenders.len();
            let before = contenders[i].cluster().map(|c| pod_gets(&clusters[c]));
            let took = match &contenders[i] {
                Contender::Without(l) => timed_add(&clusters[0].node, l, NS, POD).took,
                Contender::With(_, c, l) | Contender::NoAgent(c, l) => timed_add(&clusters[*c].node, l, NS, POD).took,
                Contender::Version => timed_exec(&testbed::bins::path("istio-cni")),
                Contender::ExecFloor(path) => timed_exec(path),
                Contender::Restore => {
                    let ns = fresh_netns();
                    let start = Instant::now();
                    redirect::iptables::apply(&ns, &plan, IptablesBackend::Nft).expect("iptables-nft-restore");
                    start.elapsed()
                }
            };
            if round >= counts.warmup {
                samples[i].push(took);
                if let (Some(c), Some(before)) = (contenders[i].cluster(), before) {
                    gets[i] += pod_gets(&clusters[c]) - before;
                }
            }
        }
    }
    let sums: Vec<Summary> = samples.iter().map(|s| Summary::of(s)).collect();
    Section {
        name: "sidecar-setup",
        title: "Sidecar pod setup: one CNI ADD through the fake runtime".into(),
        body: table(&contenders, &sums, &gets, counts),
    }
}

fn table(contenders: &[Contender], sums: &[Summary], gets: &[usize], counts: Counts) -> String {
    let without = sums[0].median;
    let restore = sums[sums.len() - 1].median;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Timed: the runtime's whole ADD (every plugin exec'd with the pod's netns, as containerd does; netns \
         creation excluded). The pod is a sidecar pod stored in the fake API; our plugin asks the node agent for it \
         (one round trip on its socket; the agent answers from its watch of the node's pods), or, with no agent, \
         GETs it from the API; then it decides and programs the default sidecar rules. Warm-up {} rounds, then {} \
         timed rounds; each round runs every contender once, round-robin with a rotating start. \"pod GETs\" is \
         what the contender's fake API server answered per timed ADD.\n",
        counts.warmup, counts.iterations
    );
    let _ = writeln!(
        s,
        "| contender | median µs | p90 µs | p99 µs | added by istio-cni (median) µs | restore / added | pod GETs |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
    let mut verdicts = String::new();
    for ((c, sum), gets) in contenders.iter().zip(sums).zip(gets) {
        let (added, vs) = match c {
            Contender::With(..) | Contender::NoAgent(..) => {
                let added = sum.median.saturating_sub(without).max(Duration::from_micros(1));
                let r = ratio(restore, added);
                if matches!(c, Contender::With(RuleBackend::Nftables, ..)) {
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
        let gets = match c.cluster() {
            Some(_) => format!("{:.1}", *gets as f64 / counts.iterations.max(1) as f64),
            None => "–".into(),
        };
        let _ = writeln!(s, "| {} | {} | {added} | {vs} | {gets} |", c.label(), sum.us_cells());
    }
    if let Some((_, floor)) = contenders.iter().zip(sums).find(|(c, _)| matches!(c, Contender::ExecFloor(_))) {
        let budget = restore.div_f64(TARGET_RATIO);
        let _ = writeln!(
            verdicts,
            "- The target leaves the plugin {} µs (restore / {TARGET_RATIO}); exec'ing a program that does nothing \
             but exit takes {} µs here, {:.2}× that budget, before the plugin reads its netconf.",
            us(budget),
            us(floor.median),
            floor.median.as_secs_f64() / budget.as_secs_f64().max(1e-9)
        );
    }
    s.push('\n');
    s.push_str(&verdicts);
    s.push_str(
        "\nThe added cost is the whole plugin process: exec, reading the netconf, the pod lookup, the decision, and \
         the rules. With the node agent the lookup is one HTTP round trip on its unix socket, answered from its \
         watch; without it, a GET of the pod from the API server over https with the kubeconfig install-cni writes \
         (token and cluster CA, a TLS handshake per exec as on a real cluster), which is what Istio's plugin pays \
         before its `iptables-restore` exec.\n",
    );
    s
}
