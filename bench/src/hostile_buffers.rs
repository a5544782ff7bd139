//! Scenario `hostile-buffers` (#33): one client pod on node 1 opens 500, 1,500 and 3,000 connections through the
//! mesh to an app on node 2 that accepts them and never reads, and pushes up to 8 MiB into each. Reported per
//! count, with the proxies' buffer budget on (the default) and off (`BUFFER_BUDGET_MIB=0`) in the same run: each
//! proxy's resident memory before the burst, at its peak, and 10 s after the last connection closed.

use std::fmt::Write as _;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::apps;
use crate::hbone::{Case, Pods};
use crate::process_figures::rss_kib;
use crate::report::Section;

/// The non-reading app's port on the server pod.
const HOLD_PORT: u16 = 9003;
/// Connection counts of the published run.
const COUNTS: [usize; 3] = [500, 1_500, 3_000];
/// Connection counts under `--quick`.
const QUICK_COUNTS: [usize; 2] = [20, 60];
/// Bytes the client tries to push into each connection.
const PUSH: usize = 8 << 20;
/// The burst lasts until the client could push nothing more for this long (everything is held somewhere).
const STALLED: Duration = Duration::from_secs(2);
/// [`STALLED`] and [`AFTER`] under `--quick`.
const QUICK_STALLED: Duration = Duration::from_millis(500);
const QUICK_AFTER: Duration = Duration::from_secs(1);
/// At most this long, whatever.
const BURST_LIMIT: Duration = Duration::from_secs(120);
/// The after-burst reading is taken this long after the last connection closed.
const AFTER: Duration = Duration::from_secs(10);
/// The targets (#33).
const PEAK_TARGET_MIB: f64 = 160.0;
const RECOVERY_TARGET: f64 = 1.5;

/// What the figures say, kept with the table.
const NOTES: &str =
    "\nWith the budget off the proxies hold what the HTTP/2 windows and the copy buffers let them (the figures of \
#33's report: 529 and 348 MiB at 1,500 connections, ztunnel 487 and 356 MiB), and at 3,000 connections the client's \
proxy still held 949 MiB 10 s after the last close in the run at cfd1a30 (841 MiB at 11f5247): its tunnels still \
held 69 MiB of tunnel bytes then (a debug run of this scenario, which prints the count), so some were still ending, and the heap is given back only once \
they hold under 1 MiB. Why they take that long with the budget off is not explained yet. With the budget on, the \
count was back at 0 on both nodes after every burst. With it on, each node holds at most one pod's share (16 MiB) of tunnel \
bytes; the rest of the peak is what each connection costs besides buffered bytes (sockets, tasks, HTTP/2 and TLS \
state, heap slack): about 26 to 38 KiB a connection on the client's node and 4 to 7 KiB on the server's. After \
the burst `malloc_trim` gives the heap back once the tunnels hold under 1 MiB (`hbone-proxy/src/heap.rs`); what \
stays are the idle HBONE connections the burst opened (pooled for 5 min on the client, served for 10 min on the \
server) and tokio's registrations. The first burst starts from proxies that have carried nothing yet, so its \
after ÷ before is the highest of a run (up to 1.9× at 500 connections, from 13 MiB to 24).\n";

/// One budget setting.
#[derive(Clone, Copy)]
struct Budget {
    label: &'static str,
    env: &'static [(&'static str, &'static str)],
}

const BUDGETS: [Budget; 2] = [
    Budget { label: "on (default: 64 MiB, 16 MiB a pod)", env: &[] },
    Budget { label: "off (`BUFFER_BUDGET_MIB=0`)", env: &[("BUFFER_BUDGET_MIB", "0")] },
];

/// One burst's figures, per node (client's, server's), in KiB.
struct Burst {
    conns: usize,
    before: [u64; 2],
    peak: [u64; 2],
    after: [u64; 2],
    pushed: u64,
}

fn burst(pods: &Pods, conns: usize, quick: bool) -> Burst {
    let (stalled, after_wait) = if quick { (QUICK_STALLED, QUICK_AFTER) } else { (STALLED, AFTER) };
    let pids = [pods.nodes[0].proxy.pid(), pods.nodes[1].proxy.pid()];
    let before = pids.map(rss_kib);
    let listener = pods.mesh_server.netns.open().expect("server pod").run(|| TcpListener::bind(("0.0.0.0", HOLD_PORT)));
    let listener = listener.expect("enter server pod").expect("bind the hold port");
    let accepted = Arc::new(AtomicU64::new(0));
    let app = testbed::hostile_load::hold(listener, conns, accepted.clone());
    let dst = SocketAddr::from((pods.mesh_server.ip(), HOLD_PORT));
    let clients: Vec<TcpStream> = (0..conns).map(|_| apps::connect(&pods.mesh_client.netns, dst)).collect();
    let (stop, pushed) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let pusher = testbed::hostile_load::push(clients, PUSH, stop.clone(), pushed.clone());
    let mut peak = before;
    let started = Instant::now();
    let (mut last, mut since) = (0, Instant::now());
    while started.elapsed() < BURST_LIMIT {
        for (p, pid) in peak.iter_mut().zip(pids) {
            *p = (*p).max(rss_kib(pid));
        }
        let now = pushed.load(Ordering::Relaxed);
        if now != last || accepted.load(Ordering::Relaxed) < conns as u64 {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= stalled {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    for conn in pusher.join().expect("pusher") {
        // A reset, as a client giving up.
        let _ = nix::sys::socket::setsockopt(
            &conn,
            nix::sys::socket::sockopt::Linger,
            &nix::libc::linger { l_onoff: 1, l_linger: 0 },
        );
    }
    for held in app.join().expect("hold app") {
        let _ = held.shutdown(Shutdown::Both);
    }
    let closed = Instant::now();
    while closed.elapsed() < after_wait {
        for (p, pid) in peak.iter_mut().zip(pids) {
            *p = (*p).max(rss_kib(pid));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let after = pids.map(rss_kib);
    let pushed = pushed.load(Ordering::Relaxed);
    let held = [0, 1].map(|i| held_bytes(pods, i) >> 10);
    println!(
        "hostile-buffers: {conns} connections: before {before:?} peak {peak:?} after {after:?} KiB (tunnel bytes held \
         after: {held:?} KiB)"
    );
    Burst { conns, before, peak, after, pushed }
}

/// The tunnel bytes node `i`'s proxy holds now (`hbone_buffer_held_bytes`).
fn held_bytes(pods: &Pods, i: usize) -> u64 {
    let netns = pods.nodes[i].cluster.node.netns().path();
    let Ok((_, body)) = testbed::http::get(&netns, istio_contract::ports::STATS, "/metrics") else { return 0 };
    body.lines().find_map(|l| l.strip_prefix("hbone_buffer_held_bytes ")?.trim().parse().ok()).unwrap_or(0)
}

/// The scenario; `quick` runs small counts.
pub fn run(quick: bool) -> Section {
    let counts: &[usize] = if quick { &QUICK_COUNTS } else { &COUNTS };
    let mut results = Vec::new();
    for budget in BUDGETS {
        println!("hostile-buffers: budget {}", budget.label);
        let pods = Pods::start_with_env(Case::AcrossNodes, budget.env);
        let bursts: Vec<Burst> = counts.iter().map(|&n| burst(&pods, n, quick)).collect();
        results.push((budget, bursts));
    }
    render(&results)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn render(results: &[(Budget, Vec<Burst>)]) -> Section {
    let mut body = String::new();
    let _ = writeln!(
        body,
        "One client pod on node 1 opens N connections through the mesh to an app on node 2 that accepts them and \
         never reads, and pushes up to {} MiB into each (poll(2) for writability) until nothing more goes in for {} s. \
         Resident memory (VmRSS) of each node's proxy: before the burst, at its peak (sampled every 50 ms), and {} s \
         after the last connection closed (the client resets its connections, the app closes what it held). The \
         bursts run one after the other on the same two nodes, so \"before\" is the memory after the previous \
         burst. Budget on and off are two pairs of nodes in the same run. Targets (#33): peak ≤ {PEAK_TARGET_MIB} \
         MiB on each node at 1,500 connections; after ≤ {RECOVERY_TARGET}× before.\n",
        PUSH >> 20,
        STALLED.as_secs(),
        AFTER.as_secs()
    );
    let _ = writeln!(
        body,
        "| budget | connections | pushed MiB | node 1 before / peak / after MiB | node 2 before / peak / after MiB \
         | after ÷ before (node 1, node 2) |\n|---|---:|---:|---|---|---|"
    );
    let mut verdict = String::new();
    for (budget, bursts) in results {
        for b in bursts {
            let cell = |i: usize| format!("{:.0} / {:.0} / {:.0}", mib(b.before[i]), mib(b.peak[i]), mib(b.after[i]));
            let ratio = |i: usize| b.after[i] as f64 / b.before[i].max(1) as f64;
            let _ = writeln!(
                body,
                "| {} | {} | {} | {} | {} | {:.2}, {:.2} |",
                budget.label,
                b.conns,
                b.pushed >> 20,
                cell(0),
                cell(1),
                ratio(0),
                ratio(1)
            );
            if b.conns == 1_500 && budget.env.is_empty() {
                let peak = mib(b.peak[0].max(b.peak[1]));
                let met = |ok: bool| if ok { "met" } else { "NOT met" };
                let _ = writeln!(
                    verdict,
                    "- 1,500 connections, budget on: peak {peak:.0} MiB (target ≤ {PEAK_TARGET_MIB}: {}); after \
                     {:.2}× and {:.2}× before (target ≤ {RECOVERY_TARGET}×: {}).",
                    met(peak <= PEAK_TARGET_MIB),
                    ratio(0),
                    ratio(1),
                    met(ratio(0) <= RECOVERY_TARGET && ratio(1) <= RECOVERY_TARGET)
                );
            }
        }
    }
    body.push('\n');
    body.push_str(&verdict);
    body.push_str(NOTES);
    Section { name: "hostile-buffers", title: "Hostile buffers: one pod, many non-reading connections".into(), body }
}
