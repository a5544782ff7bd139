//! Scenario 1, sidecar pod setup: one full CNI ADD through the fake runtime (`bridge` + `host-local` +
//! `istio-cni`, the pod served by the fake API, the node agent beside it as the chart runs it) per backend,
//! against the same chain without our plugin, against our plugin with no agent (its API lookup), against Istio's
//! own `istio-cni` plugin in our plugin's place (#29: same node, same pod, same netconf but `type`; it GETs the pod
//! from the API with the same kubeconfig), and against the machine's floor: an exec of a program that only exits,
//! our native nftables netlink batch of the same rules alone, and an exec of `iptables-nft-restore` with the same
//! rules in a fresh netns (the step Istio's plugin performs). Contenders run round-robin with a rotating start so
//! noise hits them alike. The pod GETs each fake API server received are counted per ADD.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use redirect::iptables::IptablesBackend;
use redirect::sidecar::{build, SidecarConfig};
use serde_json::json;
use testbed::mesh::{sidecar_pod, RuleBackend};
use testbed::node_agent::NodeAgent;
use testbed::{Cluster, NetworkConfigList};

use crate::attach::timed_add;
use crate::istio_ref;
use crate::load::{self, Load};
use crate::pod_rules::fresh_netns;
use crate::report::Section;
use crate::scene::install_kubeconfig;
use crate::stats::Counts;
use crate::stats::{ratio, us, Summary};

/// The benchmark issue's target: our plugin's added cost with native nftables vs the restore exec.
const TARGET_RATIO: f64 = 5.0;
/// #29's targets: our added ADD cost at most this share of Istio's plugin's for the same pod...
const ISTIO_TARGET: f64 = 0.2;
/// ...and within this many times the floor (exec floor + the rules' netlink batch).
const FLOOR_TARGET: f64 = 2.0;
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
    /// The chain with Istio's plugin in our plugin's place, on the cluster of our `With` contender for this backend
    /// (cluster index): same netconf but `type` (and, for iptables, no flavour forced: it picks it itself).
    Istio(RuleBackend, usize, NetworkConfigList),
    /// `iptables-nft-restore` of the default sidecar rules in a fresh netns.
    Restore,
    /// Our native nftables netlink batch of the default sidecar rules in a fresh netns (no exec).
    Netlink,
    /// The plugin exec'd for `VERSION`: the process's start and exit alone.
    Version,
    /// Istio's plugin exec'd for `VERSION`: its (Go) process's start and exit alone.
    IstioVersion(PathBuf),
    /// A static executable that only exits: what any exec'd plugin pays before its first instruction (the
    /// runtime's fork, the kernel's exec and exit), so the floor under the plugin's added cost on this machine.
    ExecFloor(PathBuf),
}

impl Contender {
    fn label(&self) -> String {
        match self {
            Contender::Without(_) => "bridge + host-local (no istio-cni)".into(),
            Contender::With(b, _, _) => format!("bridge + host-local + istio-cni, {}", backend_name(*b)),
            Contender::NoAgent(_, _) => {
                "bridge + host-local + istio-cni, native nftables, no node agent (API lookup)".into()
            }
            Contender::Istio(b, _, _) => format!("bridge + host-local + **Istio's** istio-cni, {}", istio_backend(*b)),
            Contender::Restore => "iptables-nft-restore exec alone (Istio's step)".into(),
            Contender::Netlink => "native nftables netlink batch alone (our step, no exec)".into(),
            Contender::Version => "istio-cni exec for VERSION alone (process start)".into(),
            Contender::IstioVersion(_) => "Istio's istio-cni exec for VERSION alone (Go process start)".into(),
            Contender::ExecFloor(_) => "exec floor: a static executable that only exits".into(),
        }
    }

    /// The cluster whose API server this contender's plugin talks to.
    fn cluster(&self) -> Option<usize> {
        match self {
            Contender::With(_, i, _) | Contender::NoAgent(i, _) | Contender::Istio(_, i, _) => Some(*i),
            _ => None,
        }
    }

    /// Whether this contender is a whole ADD with a plugin after bridge (so it has an added cost).
    fn adds(&self) -> bool {
        matches!(self, Contender::With(..) | Contender::NoAgent(..) | Contender::Istio(..))
    }
}

/// How Istio's plugin picks its rules on `b`'s netconf.
fn istio_backend(b: RuleBackend) -> &'static str {
    match b {
        RuleBackend::Nftables => "`native_nftables: true` (execs `nft`)",
        _ => "iptables (its default; picks iptables-nft itself)",
    }
}

/// Execs `path` as the runtime execs a plugin (`CNI_COMMAND=VERSION`, stdout and stderr read) and times it to
/// its exit.
pub(crate) fn timed_exec(path: &std::path::Path) -> Duration {
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

/// Istio's plugin installed on `cluster`'s node under [`istio_ref::PLUGIN_TYPE`], and its conflist for `backend`:
/// `cluster`'s own (the same netconf as ours there) with only `type` changed and, for iptables, the flavour our
/// plugin is forced to dropped, so Istio's picks it itself as it does by default (iptables-nft in a fresh netns).
fn istio_conflist(cluster: &Cluster, backend: RuleBackend, plugin: &std::path::Path) -> NetworkConfigList {
    cluster.node.install_plugin(istio_ref::PLUGIN_TYPE, plugin);
    let mut list = cluster.conflist();
    list["plugins"][1]["type"] = json!(istio_ref::PLUGIN_TYPE);
    if backend != RuleBackend::Nftables {
        list["plugins"][1].as_object_mut().expect("plugin entry").remove("force_iptables_binary");
    }
    NetworkConfigList::from_value(list).expect("valid conflist")
}

/// Runs the scenario and returns its report section.
pub fn run(counts: Counts) -> Section {
    let load_start = Load::sample();
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
    // Istio's plugin on the clusters of our native nftables and iptables-nft contenders: the same node agent runs
    // beside it there (Istio's plugin sends it its log lines, as ours does; it asks the API for the pod).
    let istio = istio_ref::binary("istio-cni");
    match &istio {
        Ok(bin) => {
            for backend in [RuleBackend::Nftables, RuleBackend::IptablesNft] {
                let i = RuleBackend::ALL.iter().position(|b| *b == backend).expect("backend has a cluster");
                contenders.push(Contender::Istio(backend, i, istio_conflist(&clusters[i], backend, &bin.path)));
            }
            contenders.push(Contender::IstioVersion(bin.path.clone()));
        }
        Err(why) => println!("sidecar-setup: Istio's plugin rows skipped: {why}"),
    }
    contenders.push(Contender::Version);
    let floor_dir = tempfile::tempdir().expect("exec floor dir");
    if let Some(path) = exec_floor::write(floor_dir.path()) {
        contenders.push(Contender::ExecFloor(path));
    }
    contenders.push(Contender::Netlink);
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
                Contender::With(_, c, l) | Contender::NoAgent(c, l) | Contender::Istio(_, c, l) => {
                    timed_add(&clusters[*c].node, l, NS, POD).took
                }
                Contender::Version => timed_exec(&testbed::bins::path("istio-cni")),
                Contender::IstioVersion(path) | Contender::ExecFloor(path) => timed_exec(path),
                Contender::Netlink => {
                    let ns = fresh_netns();
                    let start = Instant::now();
                    redirect::nft::apply(&ns, &plan).expect("native nftables apply");
                    start.elapsed()
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
                if let (Some(c), Some(before)) = (contenders[i].cluster(), before) {
                    gets[i] += pod_gets(&clusters[c]) - before;
                }
            }
        }
    }
    let sums: Vec<Summary> = samples.iter().map(|s| Summary::of(s)).collect();
    let mut body = table(&contenders, &sums, &gets, counts);
    body.push('\n');
    body.push_str(&versus_istio(&contenders, &sums, &istio));
    body.push('\n');
    body.push_str(&load::note(&load_start, &Load::sample()));
    Section { name: "sidecar-setup", title: "Sidecar pod setup: one CNI ADD through the fake runtime".into(), body }
}

/// Selects a contender (a row).
type Pick<'a> = &'a dyn Fn(&Contender) -> bool;

/// The median of the first contender `pick` selects.
fn median(contenders: &[Contender], sums: &[Summary], pick: impl Fn(&Contender) -> bool) -> Option<Duration> {
    contenders.iter().zip(sums).find(|(c, _)| pick(c)).map(|(_, s)| s.median)
}

/// What a whole-ADD contender adds to the chain without a plugin (at least 1 µs, so ratios stay finite).
fn added(total: Duration, without: Duration) -> Duration {
    total.saturating_sub(without).max(Duration::from_micros(1))
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

fn table(contenders: &[Contender], sums: &[Summary], gets: &[usize], counts: Counts) -> String {
    let without = sums[0].median;
    let restore = median(contenders, sums, |c| matches!(c, Contender::Restore)).expect("restore row");
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Timed: the runtime's whole ADD (every plugin exec'd with the pod's netns, as containerd does; netns \
         creation excluded). The pod is a sidecar pod stored in the fake API; our plugin asks the node agent for it \
         (one round trip on its socket; the agent answers from its watch of the node's pods), or, with no agent, \
         GETs it from the API; then it decides and programs the default sidecar rules. **Istio's** rows run \
         Istio's own `istio-cni` plugin in our plugin's place, on the same node, for the same pod, with the same \
         netconf (only `type` differs, and on iptables no flavour is forced: it picks iptables-nft itself, its \
         default); it GETs the pod from the API with the same kubeconfig, as it always does. Warm-up {} rounds, \
         then {} timed rounds; each round runs every contender once, round-robin with a rotating start. \"pod \
         GETs\" is what the contender's fake API server answered per timed ADD.\n",
        counts.warmup, counts.iterations
    );
    let _ = writeln!(
        s,
        "| contender | median µs | p90 µs | p99 µs | added by the plugin (median) µs | restore / added | pod GETs |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
    let mut verdicts = String::new();
    for ((c, sum), gets) in contenders.iter().zip(sums).zip(gets) {
        let (added_cell, vs) = if c.adds() {
            let added = added(sum.median, without);
            let r = ratio(restore, added);
            if matches!(c, Contender::With(RuleBackend::Nftables, ..)) {
                let _ = writeln!(
                    verdicts,
                    "- istio-cni with native nftables adds {} µs to a pod's ADD; iptables-nft-restore alone \
                     takes {} µs: {r:.1}× (earlier target ≥{TARGET_RATIO}×: {}).",
                    us(added),
                    us(restore),
                    met(r >= TARGET_RATIO)
                );
            }
            (us(added), format!("{r:.2}×"))
        } else {
            ("–".into(), "–".into())
        };
        let gets = match c.cluster() {
            Some(_) => format!("{:.1}", *gets as f64 / counts.iterations.max(1) as f64),
            None => "–".into(),
        };
        let _ = writeln!(s, "| {} | {} | {added_cell} | {vs} | {gets} |", c.label(), sum.us_cells());
    }
    if let Some(floor) = median(contenders, sums, |c| matches!(c, Contender::ExecFloor(_))) {
        let budget = restore.div_f64(TARGET_RATIO);
        let _ = writeln!(
            verdicts,
            "- That target leaves the plugin {} µs (restore / {TARGET_RATIO}); exec'ing a program that does nothing \
             but exit takes {} µs here, {:.2}× that budget, before the plugin reads its netconf.",
            us(budget),
            us(floor),
            floor.as_secs_f64() / budget.as_secs_f64().max(1e-9)
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

/// #29's side-by-side table: our plugin's added ADD cost against Istio's for the same pod per backend (target ours
/// ≤ 0.2× Istio's), and against the floor, exec floor + the rules' netlink batch, both medians of this run (target
/// ≤ 2× the floor); then the reading.
fn versus_istio(contenders: &[Contender], sums: &[Summary], istio: &Result<istio_ref::IstioBinary, String>) -> String {
    let without = sums[0].median;
    let find = |pick: &dyn Fn(&Contender) -> bool| median(contenders, sums, pick);
    let exec_floor = find(&|c| matches!(c, Contender::ExecFloor(_)));
    let netlink = find(&|c| matches!(c, Contender::Netlink)).expect("netlink row");
    let restore = find(&|c| matches!(c, Contender::Restore)).expect("restore row");
    let floor = exec_floor.map(|e| e + netlink);
    let ours_version = find(&|c| matches!(c, Contender::Version)).expect("our VERSION row");
    let mut s = String::new();
    let _ = writeln!(s, "### Against Istio's plugin and the floor (#29)\n");
    match istio {
        Ok(bin) => {
            let _ = writeln!(
                s,
                "Istio's plugin: `istio-cni` of istio.io/istio `{}` (the version pinned in \
                 `scripts/istio-ref/build.sh`, built by it), installed in the node's bin dir as `{}`.",
                bin.version,
                istio_ref::PLUGIN_TYPE
            );
        }
        Err(why) => {
            let _ = writeln!(s, "Istio's plugin was not measured in this run: {why}.");
        }
    }
    let _ = match (exec_floor, floor) {
        (Some(e), Some(f)) => writeln!(
            s,
            "The floor is computed from two rows of this run: the exec floor ({} µs) plus our native nftables \
             netlink batch of the same rules alone ({} µs) = {} µs: what any exec'd plugin that programs these rules \
             must pay at least on this machine. Our plugin's own process start, exec'd for VERSION alone (it \
             reads no netconf and programs nothing), takes {} µs in this run: {:.1}× that floor before any work, \
             against the {FLOOR_TARGET}× the target allows for the whole ADD.\n",
            us(e),
            us(netlink),
            us(f),
            us(ours_version),
            ours_version.as_secs_f64() / f.as_secs_f64().max(1e-9)
        ),
        _ => writeln!(s, "No exec floor on this architecture: the floor is not computed.\n"),
    };
    let _ = writeln!(
        s,
        "| backend | ours added µs | Istio's added µs | ours / Istio's (target ≤{ISTIO_TARGET}×) | ours / floor \
         (target ≤{FLOOR_TARGET}×) |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|");
    let pairs: [(&str, Pick, RuleBackend); 3] = [
        (
            "native nftables (ours with the node agent)",
            &|c| matches!(c, Contender::With(RuleBackend::Nftables, ..)),
            RuleBackend::Nftables,
        ),
        (
            "iptables-nft (ours with the node agent)",
            &|c| matches!(c, Contender::With(RuleBackend::IptablesNft, ..)),
            RuleBackend::IptablesNft,
        ),
        (
            "native nftables, both GET the pod (ours without the node agent)",
            &|c| matches!(c, Contender::NoAgent(..)),
            RuleBackend::Nftables,
        ),
    ];
    let mut reading = String::new();
    for (name, ours_pick, backend) in pairs {
        let ours = added(find(ours_pick).expect("our row"), without);
        let theirs = find(&|c| matches!(c, Contender::Istio(b, ..) if *b == backend)).map(|m| added(m, without));
        let vs_istio = theirs.map(|t| ratio(ours, t));
        let vs_floor = floor.map(|f| ratio(ours, f));
        let cell = |r: Option<f64>, target: f64| match r {
            Some(r) => format!("{r:.2}× ({})", met(r <= target)),
            None => "–".into(),
        };
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} |",
            us(ours),
            theirs.map_or("–".into(), us),
            cell(vs_istio, ISTIO_TARGET),
            cell(vs_floor, FLOOR_TARGET)
        );
        let mut line = format!("- {name}: ours adds {} µs to the pod's ADD", us(ours));
        if let (Some(t), Some(r)) = (theirs, vs_istio) {
            let _ = write!(
                line,
                ", Istio's plugin {} µs: {r:.2}× (target ≤{ISTIO_TARGET}×, i.e. ≤{} µs: {})",
                us(t),
                us(t.mul_f64(ISTIO_TARGET)),
                met(r <= ISTIO_TARGET)
            );
        }
        if let (Some(f), Some(r)) = (floor, vs_floor) {
            let _ = write!(
                line,
                "; {r:.2}× the floor of {} µs (target ≤{FLOOR_TARGET}×, i.e. ≤{} µs: {})",
                us(f),
                us(f.mul_f64(FLOOR_TARGET)),
                met(r <= FLOOR_TARGET)
            );
        }
        if backend == RuleBackend::IptablesNft {
            if let Some(e) = exec_floor {
                let own = e + restore;
                let _ = write!(
                    line,
                    " (this backend cannot go below its own floor, exec floor + the iptables-nft-restore exec = {} \
                     µs: ours is {:.2}× that)",
                    us(own),
                    ratio(ours, own)
                );
            }
        }
        line.push_str(".\n");
        reading.push_str(&line);
    }
    s.push('\n');
    s.push_str(&reading);
    s.push_str(&reading_note(contenders, sums, floor));
    s
}

/// What the numbers mean, with the rows that explain them.
fn reading_note(contenders: &[Contender], sums: &[Summary], floor: Option<Duration>) -> String {
    let find = |pick: &dyn Fn(&Contender) -> bool| median(contenders, sums, pick);
    let without = sums[0].median;
    let ours_start = find(&|c| matches!(c, Contender::Version));
    let istio_start = find(&|c| matches!(c, Contender::IstioVersion(_)));
    let istio_nft = find(&|c| matches!(c, Contender::Istio(RuleBackend::Nftables, ..))).map(|m| added(m, without));
    let mut s = String::from(
        "\nReading: both plugins are exec'd once per ADD, so each pays a process start; ours is a small Rust \
         program, Istio's a Go binary with its runtime and client libraries",
    );
    if let (Some(o), Some(i)) = (ours_start, istio_start) {
        let _ = write!(s, " (VERSION alone: ours {} µs, Istio's {} µs)", us(o), us(i));
    }
    s.push_str(
        ". Istio's plugin then builds a Kubernetes client and GETs the pod over https (a TLS handshake per ADD), \
         and programs the rules by exec'ing tools (`iptables-nft-restore`, after probing which flavour to use; or \
         `nft`), each another process start. Ours asks the node agent over its unix socket, which answers from its \
         watch, and programs the rules in-process (one netlink batch on native nftables; on iptables-nft it execs \
         `iptables-nft-restore` too, which is why that backend stays far above the netlink floor)",
    );
    if let (Some(i), Some(f)) = (istio_nft, floor) {
        let _ = write!(s, ". Istio's native nftables ADD costs {:.1}× the floor", ratio(i, f));
    }
    s.push_str(
        ". The gap between ours and the floor is our plugin's own work: reading the netconf, the agent round trip, \
         the decision, entering the pod's netns and the log lines sent to the agent.\n",
    );
    s
}
