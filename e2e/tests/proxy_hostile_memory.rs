//! Memory under hostile load (#33), across two nodes with the real `hbone-proxy` on each: ambient pod A on node 1
//! opens [`HOSTILE`] connections to an app in pod B on node 2 that accepts them and never reads, and pushes up to
//! [`PUSH`] bytes into each. Meanwhile pod C on node 1 exchanges data with pod D on node 2.
//!
//! What a user observes:
//! - C's exchanges complete, byte for byte, while A's load is on (A's share of the buffer budget is full, not
//!   the node's);
//! - neither proxy's resident memory goes over its resident memory before the load plus the buffer budget plus a
//!   fixed allowance for what each connection costs besides buffers ([`PER_CONNECTION_KIB`]);
//! - once every connection closed, each proxy's resident memory comes back to at most [`RECOVERY`] times what it
//!   was before the load (plus [`RECOVERY_SLACK_MIB`] of noise).

use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use testbed::wait::{eventually, within};
use testbed::Pod;

mod support;
use support::traffic::{echo_app, exchange, Payload};
use support::two_nodes::{NodeSide, TwoNodes};
use support::{ambient_member, connect_from, listen_on, workload, write_workloads, APP_PORT};

/// Connections pod A opens to B's non-reading app.
const HOSTILE: usize = 1_500;
/// Bytes A tries to push into each of them.
const PUSH: usize = 8 << 20;
/// B's non-reading app's port.
const HOLD_PORT: u16 = 8081;
/// Bytes each way of each of C's exchanges with D.
const GOOD: u64 = 4 << 20;
/// C's exchanges while A's load is on.
const GOOD_EXCHANGES: usize = 3;
/// What each connection may cost a proxy besides buffered bytes (its sockets, task, HTTP/2 stream, TLS and copy
/// state, heap slack): measured at up to 38 KiB on the sending node in release builds (BENCHMARKS.md,
/// `hostile-buffers`) and about 37 KiB in this test's debug build, given room for noise.
const PER_CONNECTION_KIB: u64 = 48;
/// Resident memory after the load, at most, as a multiple of before it.
const RECOVERY: f64 = 1.5;
/// Noise allowed on top of [`RECOVERY`].
const RECOVERY_SLACK_MIB: u64 = 4;
/// How long the proxies may take to give memory back after the last connection closed.
const RECOVERY_LIMIT: Duration = Duration::from_secs(30);
/// How long opening every hostile connection and filling the buffers may take (debug builds, a loaded machine).
const LOAD_LIMIT: Duration = Duration::from_secs(180);

/// Resident set size of `pid` in KiB (`VmRSS`).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the proxy's /proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix(" kB")?.trim().parse().ok())
        .expect("VmRSS")
}

/// A gauge of the proxy on `side` (0 when absent).
fn gauge(side: &NodeSide, name: &str) -> u64 {
    support::metric(&side.cluster.node.netns().path(), &format!("{name} ")).unwrap_or(0.0) as u64
}

/// The connection and tunnel-buffer lines of the proxy's metrics on `side`.
fn connection_metrics(side: &NodeSide, pod: &Pod) -> String {
    let body = support::http_get(&side.cluster.node.netns().path(), istio_contract::ports::STATS, "/metrics")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let hbone = pod.netns.exec_ok(&["ss", "-Htn", "state", "established", "( sport = :15008 or dport = :15008 )"]);
    let mut lines: Vec<String> = body
        .lines()
        .filter(|l| !l.starts_with('#') && (l.contains("connections") || l.contains("hbone_")))
        .map(str::to_owned)
        .collect();
    lines.push(format!("HBONE TCP connections established: {}", hbone.lines().count()));
    lines.join("\n")
}

/// One of C's exchanges with D's echo app: everything sent comes back.
fn good_exchange(c: &Pod, d_app: SocketAddr, seed: u8) {
    let payload = Payload::new(seed, GOOD);
    let done = exchange(connect_from(c, d_app), payload);
    assert_eq!(done.received, GOOD, "C got all of its echo back while A's load was on");
    assert_eq!(done.received_sha256, done.sent_sha256, "C got exactly what it sent back");
}

#[test]
fn one_pod_pushing_into_many_non_reading_connections_is_held_to_its_share_and_memory_comes_back() {
    let nodes = TwoNodes::start(&[]);
    let (one, two) = (&nodes.one, &nodes.two);
    let a = ambient_member(&one.cluster, "a", "a-sa");
    let c = ambient_member(&one.cluster, "c", "c-sa");
    let b = ambient_member(&two.cluster, "b", "b-sa");
    let d = ambient_member(&two.cluster, "d", "d-sa");
    let listing = || {
        vec![
            workload(&one.cluster, "a", "a-sa", a.ip.into(), "node-1"),
            workload(&one.cluster, "c", "c-sa", c.ip.into(), "node-1"),
            workload(&two.cluster, "b", "b-sa", b.ip.into(), "node-2"),
            workload(&two.cluster, "d", "d-sa", d.ip.into(), "node-2"),
        ]
    };
    for side in [one, two] {
        write_workloads(&side.proxy, &side.dir.path().join("workloads.yaml"), listing());
    }
    let budget = gauge(one, "hbone_buffer_budget_bytes");
    assert!(budget > 0, "the buffer budget is on by default");
    let d_app = SocketAddr::from((d.ip, APP_PORT));
    let _echo = echo_app(listen_on(&d, APP_PORT));
    // Before the load: the proxies have carried traffic (pools, TLS, first buffers), as in a working node.
    good_exchange(&c, d_app, 1);
    let pids = [one.proxy.pid(), two.proxy.pid()];
    let before = pids.map(rss_kib);

    // A's load.
    let accepted = Arc::new(AtomicU64::new(0));
    let app = testbed::hostile_load::hold(listen_on(&b, HOLD_PORT), HOSTILE, accepted.clone());
    let b_hold = SocketAddr::from((b.ip, HOLD_PORT));
    let conns: Vec<TcpStream> = (0..HOSTILE).map(|_| connect_from(&a, b_hold)).collect();
    let (stop, pushed) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let pusher = testbed::hostile_load::push(conns, PUSH, stop.clone(), pushed.clone());
    let start = Instant::now();
    let all_accepted = within(start, LOAD_LIMIT, || (accepted.load(Ordering::Relaxed) == HOSTILE as u64).then_some(()));
    assert!(all_accepted.is_some(), "B's app accepted {} of {HOSTILE} connections", accepted.load(Ordering::Relaxed));
    // A fills its share on both nodes: on node 1 with what it sends, on node 2 with what B never reads.
    let share = gauge(one, "hbone_buffer_budget_per_pod_bytes");
    let filled = within(start, LOAD_LIMIT, || {
        [one, two].iter().all(|side| gauge(side, "hbone_buffer_held_bytes") >= share / 2).then_some(())
    });
    assert!(
        filled.is_some(),
        "A's share never filled: held {} and {} bytes, {} pushed",
        gauge(one, "hbone_buffer_held_bytes"),
        gauge(two, "hbone_buffer_held_bytes"),
        pushed.load(Ordering::Relaxed)
    );
    let mut peak = pids.map(rss_kib);
    let mut held_peak = 0;
    for seed in 0..GOOD_EXCHANGES as u8 {
        good_exchange(&c, d_app, 10 + seed);
        for (i, pid) in pids.iter().enumerate() {
            peak[i] = peak[i].max(rss_kib(*pid));
        }
        held_peak = held_peak.max(gauge(one, "hbone_buffer_held_bytes").max(gauge(two, "hbone_buffer_held_bytes")));
    }
    let allowance = (budget >> 10) + HOSTILE as u64 * PER_CONNECTION_KIB;
    println!(
        "before {before:?} KiB, peak {peak:?} KiB, budget {} MiB, share {} MiB, held at most {} KiB, pushed {} MiB",
        budget >> 20,
        share >> 20,
        held_peak >> 10,
        pushed.load(Ordering::Relaxed) >> 20
    );
    assert!(held_peak <= budget, "the proxies held {held_peak} bytes, over the {budget} byte budget");
    for (i, node) in ["node 1 (A's)", "node 2 (B's)"].iter().enumerate() {
        assert!(
            peak[i] <= before[i] + allowance,
            "{node} proxy: {} KiB under the load, over {} KiB before plus the budget and {PER_CONNECTION_KIB} KiB a \
             connection",
            peak[i],
            before[i]
        );
    }

    // Every connection closes: A gives up (resets), B's app closes what it held.
    stop.store(true, Ordering::Relaxed);
    for conn in pusher.join().expect("pusher") {
        let _ = nix::sys::socket::setsockopt(
            &conn,
            nix::sys::socket::sockopt::Linger,
            &libc::linger { l_onoff: 1, l_linger: 0 },
        );
        drop(conn);
    }
    for held in app.join().expect("B's app") {
        let _ = held.shutdown(Shutdown::Both);
    }
    let closed = Instant::now();
    let bound = before.map(|kib| (kib as f64 * RECOVERY) as u64 + (RECOVERY_SLACK_MIB << 10));
    let recovered = within(closed, RECOVERY_LIMIT, || {
        let now = pids.map(rss_kib);
        (now[0] <= bound[0] && now[1] <= bound[1]).then_some(now)
    });
    let now = pids.map(rss_kib);
    println!("after the load: {now:?} KiB ({:?} after the last close)", closed.elapsed());
    assert!(
        recovered.is_some(),
        "resident memory {now:?} KiB {RECOVERY_LIMIT:?} after the load, over {bound:?} ({RECOVERY}× {before:?} + \
         {RECOVERY_SLACK_MIB} MiB); the proxies' connection and buffer metrics:\n{}",
        [connection_metrics(one, &a), connection_metrics(two, &b)].join("\n---\n")
    );
    // And the node still carries traffic.
    good_exchange(&c, d_app, 99);
    eventually("the proxies hold no tunnel bytes", || {
        [one, two].iter().all(|side| gauge(side, "hbone_buffer_held_bytes") < share / 4).then_some(())
    });
}
