//! Scenario 3, HBONE throughput: the same-node fast path, HBONE on one node, and HBONE across two nodes, each
//! against direct TCP between plain pods placed the same way; 1 and 4 streams; node-bench's sink apps and iperf3;
//! with the proxies' CPU seconds per GB moved. Every case's pods run for the whole scenario and the rounds are
//! interleaved (case by case, load by load, proxied then direct), so all rows see the same machine noise.

use std::fmt::Write as _;
use std::time::Duration;

use crate::apps::{self, SINK_PORT};
use crate::hbone::{Case, Pods};
use crate::iperf::{self, IperfServer};
use crate::report::Section;
use crate::stats::{gbps, Counts};

/// MiB per throughput run, split over the streams, unless `BENCH_TRANSFER_MIB` says otherwise.
const TRANSFER_MIB: u64 = 512;
/// The cases, in table order.
const CASES: [Case; 3] = [Case::SameNodeFastPath, Case::SameNodeHbone, Case::AcrossNodes];
/// Parallel connections per run.
const STREAMS: [usize; 2] = [1, 4];
/// The targets: a single stream through the proxy at least this share of direct TCP.
const TARGETS: [(Case, f64); 2] = [(Case::SameNodeFastPath, 0.5), (Case::AcrossNodes, 0.3)];

/// What profiling showed and what was tried to make HBONE faster (issue #19), kept with the table so its figures
/// can be explained and the tries are not repeated blindly.
const NOTES: &str = "\nWhere the time goes (`perf record -a` of the whole machine during an across-nodes transfer, one \
stream): the two proxies' threads took 67% of all samples, the apps 27%, idle 5%, so the path is CPU-bound on 2 \
cores. Of the proxies' samples about 70% are in the kernel (TCP send and receive on three TCP hops per byte, \
against one for direct TCP, with the bridge's netfilter hooks and conntrack on each), 20% in hbone-proxy's own \
code (mostly AES-GCM) and 8% in memmove (rustls's plaintext copies). Before the heap thresholds below, page \
faults and `madvise` took another 7% of the proxies' samples. The fast path pays two socket hops and `splice(2)` \
through a pipe, no TLS.

Profiled again with every kept change below in place (same method, 60,000 samples over 8 s, builds without LTO): \
the proxies' threads took 61% of all samples, the apps 32%, idle 6%. Of the proxies' share, 66% is the kernel \
(its socket copies alone 14%), 13% AES-GCM (ring's VAES code, both directions), 10% memmove (one plaintext copy \
on the sending proxy, two on the receiving one) and the remaining 11% everything else in user space: HTTP/2, \
tokio, rustls's bookkeeping, malloc. A system-wide syscall count showed, per 256 KiB DATA frame, one read and \
about one `writev` on the sending proxy, and about 11 TLS reads and one write on the receiving one.

Tried for HBONE across nodes (#19), each against the build before it, release builds alternated in one sitting \
(`node-bench hbone-throughput --no-write --warmup 1 --iterations 3`, twice each, A B C C B A) on a machine that \
other jobs kept at a load of about 5, so absolute rates are lower than in an idle run; figures are across nodes, \
one stream, node-bench sink / iperf3 Gb/s and proxy CPU s/GB (sink / iperf3), one pair per sitting:

- HTTP/2 windows and frames like ztunnel's (4 MiB stream window, 16 MiB connection window, 1 MiB max frame): \
already in place since #14 (`hbone::settings`); nothing to change. A 4 MiB h2 send buffer instead of h2's 400 KiB \
was tried before and made it slower (2.2 Gb/s against 2.5 Gb/s), so it stays at h2's default. Tried again at 1 MiB \
with the heap thresholds below in place (three runs each, alternated): 3.78 / 3.70, 3.52 / 3.37 and 3.89 / 4.07 \
Gb/s against 4.05 / 3.60, 3.75 / 3.50 and 4.24 / 4.08 with h2's default: no better.
- Large reads handed to h2 as `Bytes` without copying, and DATA payloads written to the app's socket as h2 hands \
them out (`hbone::copy`, replacing `copy_bidirectional` and its two 64 KiB buffers on both the client's and the \
server's proxy; reads of up to 256 KiB, so one DATA frame per read; a connection starts with 16 KiB reads and \
moves to 256 KiB once a read fills its buffer, so idle connections hold 16 KiB, not 2 × 64 KiB): before 1.42 / 1.46 and 1.53 / 1.59 Gb/s, \
5.45 / 5.64 and 5.00 / 4.90 CPU s/GB; after 1.78 / 1.53 and 1.75 / 1.64 Gb/s, 4.22 / 4.70 and 4.06 / 4.49 CPU \
s/GB. About 10% more throughput and 10-20% less CPU per GB: kept.
- TLS records filled to 16 KiB, and `writev`: already so. h2 writes each DATA frame's header and payload as one \
vectored write, rustls (0.23) cuts the joined bytes into full 16 KiB records (only a frame's last record is \
shorter, one in 16 with 256 KiB frames) and tokio-rustls sends the queued records with one `writev`; nothing to \
change.
- Buffered TLS reads: rustls reads its transport 4 KiB at a time, four or five `recvmsg` calls per 16 KiB \
record; a 256 KiB `BufReader` under TLS makes that one call per 256 KiB at the cost of one more memcpy of the \
ciphertext: 1.66 / 1.58 and 1.70 / 1.71 Gb/s, 4.50 / 4.36 and 4.40 / 4.26 CPU s/GB, no better than the build \
before it within the noise (sink slower, iperf3 faster): dropped.
- One tokio worker thread per proxy instead of one per core (two), so that the two proxies and two apps of the \
across-nodes case stop handing tasks between threads (three runs alternated, A B A, idle machine, `--iterations 3`, \
builds without LTO): across nodes, one stream, 2.95 / 2.61 Gb/s with one worker against 2.43 / 2.43 and 2.87 / \
2.55 with two, within the run-to-run spread of about 15%; but one proxy carrying both ends on one node fell from \
3.02 / 2.87 and 3.46 / 2.96 to 2.29 / 2.33 Gb/s: dropped.
- Heap thresholds (hbone-proxy `heap.rs`): glibc mapped every 256 KiB read buffer and large HTTP/2 read buffer \
afresh, or trimmed its arena after freeing one, so the proxies faulted their pages in and zeroed them again \
(`do_anonymous_page` 3.4% and `madvise` 1% of all samples). Fixed `mallopt` thresholds (in the try: heap blocks \
up to 4 MiB, trim above 32 MiB; kept: 2 MiB and 8 MiB), measured on the across-nodes case alone \
(`--warmup 1 --iterations 3`, builds without LTO, idle machine, ten runs alternated B M M B B M M B B M): medians \
3.09 / 3.24 Gb/s and 4.01 / 3.81 CPU s/GB before, 3.79 / 3.52 Gb/s and 3.19 / 3.29 CPU s/GB after. About 15% \
less CPU per GB: kept.
- A TLS send queue of 320 KiB instead of rustls's 64 KiB (`hbone::tls`), so that a 256 KiB DATA frame is one \
write and one `writev` instead of four (a system-wide count showed about 4.5 `writev` per 256 KiB read on the \
client's proxy). On top of the heap thresholds, same setup, six runs alternated A B B A A B: medians 4.11 / 4.18 \
Gb/s and 2.89 / 2.81 CPU s/GB before, 4.49 / 4.42 Gb/s and 2.65 / 2.56 CPU s/GB after. About 8% less CPU per \
GB: kept. (Direct TCP in these runs, 13 to 24 Gb/s, varies more than in the full scenario.)
- AES-128-GCM offered first instead of AES-256-GCM (AES-GCM is 14% of the proxies' samples; with ECDSA P-256 \
certificates and an X25519 key exchange the handshake is at the 128-bit level either way): same setup, on top of \
both changes above, six runs alternated A B B A A B: 3.84 / 3.55, 3.58 / 3.59 and 3.72 / 3.64 Gb/s before against \
3.93 / 3.51, 3.97 / 3.47 and 3.85 / 3.25 Gb/s after, 3.07 to 3.26 CPU s/GB before against 2.94 to 3.40 after: no \
difference outside the noise, so AES-256-GCM stays first.
- rustls's unbuffered API (not tried): the buffered API copies each received record's plaintext into a new \
`Vec` before tokio-rustls copies it into h2's buffer (2.2% of the proxies' samples), and the receiving proxy \
reads its TLS socket about 13 times per 256 KiB frame. A TLS stream of our own on the unbuffered API (handshake, \
key updates and alerts included, in place of tokio-rustls) would drop that copy and most of those reads: an \
estimated 3 to 4% of the proxies' CPU.
- Reads from the app's socket (so DATA frames) of 64, 128, 512 KiB and 1 MiB instead of 256 KiB, the TLS send \
queue following (same setup, alternated, two to four runs each): 3.17 / 3.03 Gb/s at 64 KiB, medians 3.85 / \
3.60 at 128 KiB, 4.17 / 3.79 at 256 KiB, 3.64 / 3.69 at 512 KiB and 3.98 / 3.72 at 1 MiB; proxy CPU 3.82, 3.2, \
2.9, 3.0 and 2.9 s/GB (sink). Smaller reads cost more per GB, larger ones gain nothing: 256 KiB stays.
- DATA frames capped at 16 or 64 KiB by the receiver's `SETTINGS_MAX_FRAME_SIZE` instead of 1 MiB (so that the \
receiving proxy hands the app each record's worth sooner): medians 2.20 / 2.16 Gb/s and 5.5 CPU s/GB at 16 KiB, \
3.08 / 2.97 and 3.85 at 64 KiB, 3.63 / 3.37 and 3.16 at 1 MiB. Every frame costs the receiving proxy a write to \
the app and the app a wake-up: 1 MiB stays.
- One tokio worker per proxy, tried again now that the heap no longer faults (eight runs alternated): medians \
3.65 / 3.67 Gb/s and 3.16 CPU s/GB with one worker against 3.72 / 3.36 and 3.14 with two: no difference, two \
stay.
- kTLS: cannot be tried on this machine. Its kernel is built without TLS support (`CONFIG_TLS` is not set in \
`/proc/config.gz`; `/proc/sys/net/ipv4/tcp_available_ulp` lists only `mptcp`, so `setsockopt(TCP_ULP, \"tls\")` \
fails), and there are no modules to load. kTLS would move AES-GCM into the kernel's socket copy and drop rustls's \
plaintext copy on both proxies, but the HTTP/2 framing keeps every byte passing through user space, so it cannot \
splice either. Whether it reaches 0.3× stays unmeasured.

Why across nodes stays near 0.3× here: the case is CPU-bound on 2 cores, and two thirds of the proxies' time is \
the kernel carrying each byte over three TCP hops where direct TCP has one. Of what is left in user space, \
AES-GCM cannot be cut without kTLS, and the one copy and the TLS reads the unbuffered API would save are about 3% \
of the machine. Five full runs of this scenario at commit 285e7a9 (release build, idle machine, `--iterations 9`, \
before the table above), across nodes, one stream: node-bench sink 0.306, 0.277, 0.304, 0.309 and 0.301× direct \
(median 0.304×), iperf3 0.334, 0.282, 0.290, 0.273 and 0.270× (median 0.282×); proxied rates 3.7 to 4.1 Gb/s, \
direct 11.3 to 14.4 Gb/s. ztunnel is about 0.23× on this machine type (#19).
";

/// Bytes per throughput run.
fn transfer_bytes() -> u64 {
    let mib = std::env::var("BENCH_TRANSFER_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(TRANSFER_MIB);
    mib.max(1) << 20
}

/// The load generator of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// node-bench's own client and sink app.
    Sink,
    /// iperf3.
    Iperf,
}

impl Load {
    const ALL: [Load; 2] = [Load::Sink, Load::Iperf];

    fn label(self) -> &'static str {
        match self {
            Load::Sink => "node-bench sink",
            Load::Iperf => "iperf3",
        }
    }
}

/// One table row's samples.
#[derive(Debug, Default)]
struct Row {
    /// Gb/s through the proxy, one per timed run.
    proxied: Vec<f64>,
    /// Gb/s direct, one per timed run.
    direct: Vec<f64>,
    /// The proxies' CPU time over the timed proxied runs.
    cpu: Duration,
    /// Bytes moved in the timed proxied runs.
    bytes: u64,
}

/// One run of `load` from `client` to `server`'s apps: Gb/s and bytes moved.
fn run(load: Load, client: &testbed::NetnsGuard, server: std::net::IpAddr, streams: usize) -> (f64, u64) {
    let total = transfer_bytes();
    match load {
        Load::Sink => {
            let per_stream = total / streams as u64;
            let took = apps::transfer(client, (server, SINK_PORT).into(), streams, per_stream);
            (gbps(per_stream * streams as u64, took), per_stream * streams as u64)
        }
        Load::Iperf => iperf::run(client, (server, iperf::PORT).into(), streams, total),
    }
}

/// Median and p10 (nearest rank) of rates.
fn median_p10(samples: &[f64]) -> (f64, f64) {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = |q: f64| sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
    (rank(0.5), rank(0.1))
}

/// Scenario 3: Gb/s per case, stream count and load, proxied vs direct, interleaved run by run.
pub fn throughput(counts: Counts) -> Section {
    // Servers before pods in each pair: they stop before their netns go.
    let sets: Vec<([IperfServer; 2], Pods)> = CASES
        .iter()
        .map(|&case| {
            println!("hbone-throughput: starting {}", case.label());
            let pods = Pods::start(case);
            let servers = [IperfServer::start(&pods.mesh_server.netns), IperfServer::start(&pods.plain_server.netns)];
            (servers, pods)
        })
        .collect();
    let mut rows: Vec<Row> = (0..CASES.len() * STREAMS.len() * Load::ALL.len()).map(|_| Row::default()).collect();
    for round in 0..counts.warmup + counts.iterations {
        println!("hbone-throughput: round {}/{}", round + 1, counts.warmup + counts.iterations);
        let mut row = rows.iter_mut();
        for (_, pods) in &sets {
            for streams in STREAMS {
                for load in Load::ALL {
                    let row = row.next().expect("a row per case, stream count and load");
                    let cpu = pods.proxy_cpu();
                    let (proxied, bytes) = run(load, &pods.mesh_client.netns, pods.mesh_server.ip().into(), streams);
                    let cpu = pods.proxy_cpu().saturating_sub(cpu);
                    let (direct, _) = run(load, &pods.plain_client.netns, pods.plain_server.ip().into(), streams);
                    if round >= counts.warmup {
                        row.proxied.push(proxied);
                        row.direct.push(direct);
                        row.cpu += cpu;
                        row.bytes += bytes;
                    }
                }
            }
        }
    }
    drop(sets);
    render(counts, &rows)
}

fn render(counts: Counts, rows: &[Row]) -> Section {
    let mut body = String::new();
    let _ = writeln!(
        body,
        "Timed: {} MiB per run, split over the streams. node-bench sink: from the first connect until every sink app \
         acknowledged the end of its stream; iperf3 (`-n`, `-P`): the rate its server received \
         (`end.sum_received`). Cases: the same-node fast path (the proxy's default), HBONE on one node (the proxy \
         with `SAME_NODE_FAST_PATH=false`), HBONE across two nodes (each with its own proxy, the node netns linked by \
         a veth); each against direct TCP between two plain pods placed the same way. Native nftables rules. \
         Warm-up {} rounds, then {} timed rounds; in each round every row runs once, proxied then direct. Proxy \
         CPU: user + system time of the proxy process(es) of the case (both nodes' across nodes) over the timed \
         proxied runs, per GB (10⁹ bytes) moved. Istio's ztunnel is not measured (it cannot be fetched or built \
         here).\n",
        transfer_bytes() >> 20,
        counts.warmup,
        counts.iterations
    );
    let _ = writeln!(
        body,
        "| case | streams | load | proxied Gb/s (median) | proxied p10 | direct Gb/s (median) | ÷ direct (medians) \
         | proxy CPU s/GB |\n|---|---:|---|---:|---:|---:|---:|---:|"
    );
    let mut verdict = String::new();
    let mut row = rows.iter();
    for case in CASES {
        for streams in STREAMS {
            for load in Load::ALL {
                let r = row.next().expect("a row per case, stream count and load");
                let ((pm, p10), (dm, _)) = (median_p10(&r.proxied), median_p10(&r.direct));
                let share = pm / dm.max(1e-9);
                let cpu = r.cpu.as_secs_f64() / (r.bytes as f64 / 1e9).max(1e-9);
                let _ = writeln!(
                    body,
                    "| {} | {streams} | {} | {pm:.2} | {p10:.2} | {dm:.2} | {share:.2} | {cpu:.2} |",
                    case.label(),
                    load.label()
                );
                if let Some((_, target)) = TARGETS.iter().find(|(c, _)| *c == case).filter(|_| streams == 1) {
                    let met = if share >= *target { "met" } else { "NOT met" };
                    let _ = writeln!(
                        verdict,
                        "- {}, single stream, {}: {share:.2}× direct (target ≥ {target}×: {met}).",
                        case.label(),
                        load.label()
                    );
                }
            }
        }
    }
    body.push('\n');
    body.push_str(&verdict);
    body.push_str(NOTES);
    Section { name: "hbone-throughput", title: "HBONE throughput".into(), body }
}
