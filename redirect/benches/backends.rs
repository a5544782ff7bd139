//! Per-pod cost of programming the sidecar rules, on every backend, in the same run (benchmark issue, scenario
//! "pod rules"; nftables issue, last acceptance bullet: native nftables at least 5x cheaper than the
//! `iptables-nft-restore` exec Istio's plugin performs).
//!
//! Each iteration gives every contender a brand-new netns (created untimed by a thread that unshares and brings
//! `lo` up, as a pod's netns is before the plugin runs) and times only the programming step. Contenders are
//! interleaved round-robin, with a rotating start, so machine noise hits all of them alike. The table is printed
//! and written to `BENCHMARKS.md` (only this scenario's section is replaced).
//!
//! Run: `cargo bench -p redirect --bench backends`; `BENCH_ITERATIONS` (default 200) and `BENCH_WARMUP`
//! (default 20) set the counts. Without cargo's `--bench` flag (e.g. `cargo test --all-targets`) it does nothing.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use netns::Netns;
use redirect::apply::IptablesBackend;
use redirect::nft::layout::NftLayout;
use redirect::sidecar::{build, InterceptMode, Plan, SidecarConfig};

/// Section markers in BENCHMARKS.md; other scenarios add their own pairs.
const BEGIN: &str = "<!-- bench:pod-rules:begin -->";
const END: &str = "<!-- bench:pod-rules:end -->";
/// The command that produces this section.
const COMMAND: &str = "cargo bench -p redirect --bench backends";
/// The nftables issue's target: native nftables vs the `iptables-nft-restore` exec.
const TARGET_RATIO: f64 = 5.0;

/// One way of programming a plan into a pod netns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    /// Ours: netlink batch, no exec.
    NativeNftables,
    /// `iptables-nft-restore` exec per family (Istio's plugin; the baseline).
    IptablesNft,
    /// `iptables-legacy-restore` exec per family.
    IptablesLegacy,
    /// `nft -f -` exec fed the same layout's text (Istio's "native nftables").
    NftExec,
}

const CONTENDERS: [Contender; 4] =
    [Contender::NativeNftables, Contender::IptablesNft, Contender::IptablesLegacy, Contender::NftExec];

impl Contender {
    fn label(self) -> &'static str {
        match self {
            Contender::NativeNftables => "(a) native nftables (netlink)",
            Contender::IptablesNft => "(b) iptables-nft-restore exec",
            Contender::IptablesLegacy => "(c) iptables-legacy-restore exec",
            Contender::NftExec => "(d) nft -f - exec",
        }
    }
}

/// A plan to program, with the nft text (d) feeds to `nft -f -` (rendered once, outside the timing).
struct Case {
    name: &'static str,
    plan: Plan,
    nft_text: String,
}

impl Case {
    fn new(name: &'static str, cfg: SidecarConfig) -> Case {
        let plan = build(&cfg);
        let nft_text = NftLayout::sidecar(&plan).expect("nft layout of the plan").to_string();
        Case { name, plan, nft_text }
    }

    /// Programs the plan into `ns` with `who` and returns how long that took.
    fn program(&self, who: Contender, ns: &Netns) -> Duration {
        let start = Instant::now();
        match who {
            Contender::NativeNftables => redirect::nft::apply(ns, &self.plan).expect("native nftables apply"),
            Contender::IptablesNft => {
                redirect::apply::apply(ns, &self.plan, IptablesBackend::Nft).expect("iptables-nft apply")
            }
            Contender::IptablesLegacy => {
                redirect::apply::apply(ns, &self.plan, IptablesBackend::Legacy).expect("iptables-legacy apply")
            }
            Contender::NftExec => ns.run(|| nft_exec(&self.nft_text)).expect("enter netns for nft -f"),
        }
        start.elapsed()
    }
}

/// `nft -f -` with `text` on stdin, in the calling thread's netns; panics unless it succeeds.
fn nft_exec(text: &str) {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nft");
    child.stdin.take().expect("nft stdin").write_all(text.as_bytes()).expect("write nft stdin");
    let out = child.wait_with_output().expect("wait for nft");
    assert!(out.status.success(), "nft -f - failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// A brand-new pod-like netns with `lo` up, held only by the returned handle (it vanishes when dropped, so a
/// crashed run leaves nothing behind).
fn fresh_netns() -> Netns {
    std::thread::spawn(|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare netns");
        let up = Command::new("ip").args(["link", "set", "lo", "up"]).status().expect("run ip");
        assert!(up.success(), "ip link set lo up");
        Netns::current().expect("open own netns")
    })
    .join()
    .expect("netns thread")
}

/// Median, p90 and p99 (nearest rank) of one contender's samples, in µs.
struct Summary {
    median: f64,
    p90: f64,
    p99: f64,
}

impl Summary {
    fn of(samples: &mut [Duration]) -> Summary {
        samples.sort();
        let rank = |q: f64| {
            let i = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
            samples[i].as_secs_f64() * 1e6
        };
        Summary { median: rank(0.5), p90: rank(0.9), p99: rank(0.99) }
    }
}

fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v} is not a count")),
        Err(_) => default,
    }
}

/// Runs `case` for `warmup` + `iterations` rounds, each contender once per round on its own fresh netns, and
/// returns the timed samples per contender (in [`CONTENDERS`] order).
fn measure(case: &Case, warmup: usize, iterations: usize) -> Vec<Vec<Duration>> {
    let mut samples = vec![Vec::with_capacity(iterations); CONTENDERS.len()];
    for round in 0..warmup + iterations {
        for k in 0..CONTENDERS.len() {
            let i = (round + k) % CONTENDERS.len();
            let ns = fresh_netns();
            let took = case.program(CONTENDERS[i], &ns);
            if round >= warmup {
                samples[i].push(took);
            }
        }
    }
    samples
}

/// Output of `cmd args`, first line, or a note that it is unavailable.
fn first_line(cmd: &str, args: &[&str]) -> String {
    match Command::new(cmd).args(args).stdin(Stdio::null()).output() {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            text.lines().next().unwrap_or("").trim().to_string()
        }
        Err(e) => format!("unavailable ({e})"),
    }
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim()))
        .unwrap_or("unknown");
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut s = String::new();
    let _ = writeln!(s, "- CPU: {nproc} × {model}");
    let _ = writeln!(s, "- Kernel: {}", first_line("uname", &["-srvm"]));
    let nft = first_line("iptables-nft", &["--version"]);
    let legacy = first_line("iptables-legacy", &["--version"]);
    let _ = writeln!(s, "- iptables: {nft} / {legacy}");
    let _ = writeln!(s, "- nft: {}", first_line("nft", &["--version"]));
    let _ = writeln!(s, "- Commit: {}", first_line("git", &["rev-parse", "--short", "HEAD"]));
    s
}

fn table(results: &[(&Case, Vec<Summary>)], warmup: usize, iterations: usize) -> String {
    let mut s = String::new();
    let _ =
        writeln!(s, "Warm-up {warmup} rounds, then {iterations} timed rounds; each round programs every backend once,");
    let _ = writeln!(s, "round-robin with a rotating start, each into its own fresh netns (creation not timed).\n");
    let _ = writeln!(s, "| plan | backend | median µs | p90 µs | p99 µs | (b) median / median |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|");
    for (case, sums) in results {
        let base = sums[1].median;
        for (who, sum) in CONTENDERS.iter().zip(sums) {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.2}× |",
                case.name,
                who.label(),
                sum.median,
                sum.p90,
                sum.p99,
                base / sum.median
            );
        }
    }
    s.push('\n');
    for (case, sums) in results {
        let ratio = sums[1].median / sums[0].median;
        let verdict = if ratio >= TARGET_RATIO { "met" } else { "NOT met" };
        let _ = writeln!(
            s,
            "- {}: iptables-nft-restore exec median / native nftables median = {ratio:.1}× \
             (target ≥{TARGET_RATIO}×: {verdict}).",
            case.name
        );
    }
    s.push_str(COST_NOTE);
    s
}

/// Why the native backend is cheap, from profiling it (kept with the table so the figure can be explained).
const COST_NOTE: &str = "\nWhere the time goes (`strace -f -tt -T` of this bench): the native backend's batch `send` \
takes well under 1 ms. nf_tables frees the objects a transaction deletes only after an RCU grace period, and closing \
a netfilter socket waits for that pending work (NETLINK_URELEASE flushes it): a batch that deletes our old tables \
made every `close()` block for about 8.5 ms. A pod netns that holds none of our tables therefore gets a \
create-only batch (listed and committed over one socket); only re-programming a pod pays the wait.\n";

fn section(table: &str) -> String {
    format!(
        "{BEGIN}\n## Pod rules: per-pod cost of programming the sidecar rules\n\n\
         Command: `{COMMAND}` (release profile; `BENCH_ITERATIONS`, `BENCH_WARMUP` override the counts).\n\n\
         Timed: one programming call into a pod netns. (a) `redirect::nft::apply` (one netlink batch, no exec);\n\
         (b)/(c) `redirect::apply::apply` (one `iptables-{{nft,legacy}}-restore` exec per family, the step Istio's \
         plugin performs); (d) `nft -f -` exec of the same layout's text (what Istio's \"native nftables\" does; its \
         text is rendered outside the timing, and it does not add the IPv6 `::6` address or TPROXY routes that \
         (a)–(c) program over rtnetlink, so it is favoured in the TPROXY+IPv6 row). Each call includes entering \
         the netns on a fresh thread.\n\n\
         Machine:\n\n{}\n{table}{END}\n",
        machine()
    )
}

/// Replaces this scenario's section of BENCHMARKS.md (or appends it), keeping every other section.
fn write_benchmarks_md(section: &str) {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "BENCHMARKS.md"].iter().collect();
    let old = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        "# Benchmarks\n\nEach scenario of the benchmark issue owns one section between `<!-- bench:NAME:begin -->` \
         and `<!-- bench:NAME:end -->` markers; its bench rewrites only that section.\n"
            .to_string()
    });
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{section}{}", &old[..b], old[e + END.len()..].trim_start_matches('\n'))
        }
        _ => format!("{}\n\n{section}", old.trim_end_matches('\n')),
    };
    std::fs::write(&path, new).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    println!("wrote {}", path.display());
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("backends: not in bench mode (run `{COMMAND}`); skipping");
        return;
    }
    let warmup = env_count("BENCH_WARMUP", 20);
    let iterations = env_count("BENCH_ITERATIONS", 200);
    assert!(iterations > 0, "BENCH_ITERATIONS must be at least 1");
    let cases = [
        Case::new("sidecar default (IPv4, REDIRECT)", SidecarConfig::cni_pod_defaults()),
        Case::new(
            "TPROXY + IPv6 + DNS",
            SidecarConfig {
                mode: InterceptMode::Tproxy,
                enable_ipv6: true,
                redirect_dns: true,
                capture_all_dns: true,
                ..SidecarConfig::cni_pod_defaults()
            },
        ),
    ];
    println!("backends: warm-up {warmup}, iterations {iterations}, contenders round-robin");
    let results: Vec<(&Case, Vec<Summary>)> = cases
        .iter()
        .map(|case| {
            println!("measuring: {}", case.name);
            let sums = measure(case, warmup, iterations).iter_mut().map(|s| Summary::of(s)).collect();
            (case, sums)
        })
        .collect();
    let table = table(&results, warmup, iterations);
    println!("\n{table}");
    write_benchmarks_md(&section(&table));
}
