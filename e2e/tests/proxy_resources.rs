//! The real `hbone-proxy` and its own resources (issue #14; real node agent, pods through the fake CNI runtime): it
//! raises its open-files soft limit to the hard limit at start; its few socket threads serve every pod, so neither
//! pods nor connections create threads, and no thread stays inside a deleted pod's netns; out of file descriptors,
//! the pods'
//! accept loops back off and warn at most once per interval instead of spinning, and serve again once descriptors
//! free up; its HTTP endpoints (admin, stats, readiness) cap their connections and drop clients that never finish
//! their request headers.

use std::fs::File;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use daemon::listener::DEFAULT_MAX_CONNECTIONS;
use istio_contract::ports;
use testbed::wait::{eventually, within};
use testbed::{NetnsGuard, Pod};

mod support;
use support::traffic::echo_app;
use support::{listen_on, listening, open_fds, plain_member, Proxy, Scene, APP_PORT, NS};

const HELLO: &[u8] = b"hello through the node proxy";
/// The name of the proxy's socket threads (`sockets::SOCKET_THREAD`).
const SOCKET_THREAD: &str = "pod-sockets";
/// How many there are, whatever the pods (`sockets::SOCKET_THREADS`).
const SOCKET_THREADS: usize = 2;
/// Descriptors the proxy may open beyond what it holds once it runs pods A and B, in the test of running out.
const HEADROOM: usize = 48;
/// Connections beyond the headroom in that test: they wait in the accept queue while the proxy is out of fds.
const QUEUED: usize = 100;
/// How long the proxy is watched while it is out of descriptors: within one log interval (10 s), and shorter than
/// the TLS handshake timeout (10 s) that would free the descriptors the flood holds.
const SATURATED_FOR: Duration = Duration::from_secs(5);

fn scene() -> Scene {
    Scene::new(tempfile::tempdir().expect("scratch dir"), "b-sa", &[])
}

/// Replaces the scene's proxy with one whose open-files limit starts at `(soft, hard)`; returns once it is ready,
/// i.e. it has the pods back from the agent's snapshot.
fn restart_with_open_files(scene: &mut Scene, limit: (u64, u64)) {
    scene.proxy.stop();
    eventually("the old proxy's listeners are gone", || (!listening(&scene.b.netns, ports::HBONE)).then_some(()));
    let (dir, workloads) = (scene.dir.path(), scene.workloads());
    scene.proxy = Proxy::start_with_open_files(&scene.cluster, &scene.agent, dir, &workloads, &[], Some(limit));
}

/// The soft and hard "Max open files" of process `pid` (`/proc/<pid>/limits`).
fn open_files_limit(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read /proc/<pid>/limits");
    let line = limits.lines().find_map(|l| l.strip_prefix("Max open files")).expect("a Max open files line");
    let mut values = line.split_whitespace().map(|v| v.parse().unwrap_or_else(|_| panic!("a number in {line:?}")));
    (values.next().expect("soft"), values.next().expect("hard"))
}

/// How many threads of process `pid` are called `name`.
fn threads_named(pid: u32, name: &str) -> usize {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("list the proxy's threads");
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// The (dev, ino) of the netns each thread of process `pid` is in.
fn thread_netns(pid: u32) -> Vec<(u64, u64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("list the proxy's threads");
    tasks
        .filter_map(|task| std::fs::metadata(task.ok()?.path().join("ns/net")).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect()
}

/// The (dev, ino) of `pod`'s netns.
fn netns_id(pod: &Pod) -> (u64, u64) {
    let netns = std::fs::metadata(pod.netns.path()).expect("stat the pod's netns");
    (netns.dev(), netns.ino())
}

/// An app in `from` sends [`HELLO`] to `to` and reads the echo back (short timeouts, for polling).
fn hello(from: &Pod, to: SocketAddr) -> io::Result<Vec<u8>> {
    let ns = from.netns.open().expect("open pod netns");
    let mut stream = ns.run(|| TcpStream::connect_timeout(&to, Duration::from_secs(2))).expect("enter pod netns")?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(HELLO)?;
    stream.shutdown(Shutdown::Write)?;
    let mut back = Vec::new();
    stream.read_to_end(&mut back)?;
    Ok(back)
}

/// `strace` following every thread of process `pid`, recording the calls that create threads.
struct ThreadTrace {
    strace: Child,
    out: tempfile::TempDir,
}

impl ThreadTrace {
    /// Attaches to every thread of `pid`; returns once all of them are traced.
    fn attach(pid: u32) -> Self {
        let out = tempfile::tempdir().expect("scratch dir");
        let strace = Command::new("strace")
            .args(["-f", "-e", "trace=clone,clone3", "-o"])
            .arg(out.path().join("calls"))
            .args(["-p", &pid.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(out.path().join("stderr")).expect("strace stderr"))
            .spawn()
            .expect("spawn strace (the end-to-end tests need it)");
        let trace = ThreadTrace { strace, out };
        // `Process <pid> attached with <n> threads`, once all of them are.
        eventually("strace is attached to every thread of the proxy", || {
            let said = std::fs::read_to_string(trace.out.path().join("stderr")).unwrap_or_default();
            said.contains(" attached").then_some(())
        });
        trace
    }

    /// Detaches; how many threads the process created meanwhile.
    fn threads_created(mut self) -> usize {
        let pid = nix::unistd::Pid::from_raw(self.strace.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("stop strace");
        self.strace.wait().expect("reap strace");
        let calls = std::fs::read_to_string(self.out.path().join("calls")).expect("strace output");
        // An interrupted call shows again as `<... clone3 resumed>`: count the calls, not their resumptions.
        calls.matches("clone(").count() + calls.matches("clone3(").count()
    }
}

impl Drop for ThreadTrace {
    fn drop(&mut self) {
        let _ = self.strace.kill();
        let _ = self.strace.wait();
    }
}

#[test]
fn the_proxy_raises_its_open_files_soft_limit_to_the_hard_limit_at_start() {
    let mut scene = scene();
    restart_with_open_files(&mut scene, (1024, 4096));
    assert_eq!(open_files_limit(scene.proxy.pid()), (4096, 4096), "soft raised to hard");
    let log = scene.proxy.log();
    assert!(log.contains("soft_before=1024 soft=4096 hard=4096"), "the proxy logs both limits:\n{log}");
    let _accepted = echo_app(scene.b_listener());
    assert_eq!(hello(&scene.a, SocketAddr::from((scene.b.ip, APP_PORT))).expect("A to B"), HELLO);
}

#[test]
fn the_socket_threads_are_a_fixed_few_connections_create_no_threads_and_none_stays_in_a_pods_netns() {
    let mut scene = scene();
    let pid = scene.proxy.pid();
    assert_eq!(threads_named(pid, SOCKET_THREAD), SOCKET_THREADS, "a fixed few socket threads for A and B");
    let outsider = plain_member(&scene.cluster, "n");
    let _b_app = echo_app(scene.b_listener());
    let _outsider_app = echo_app(listen_on(&outsider, APP_PORT));
    let (to_b, to_outsider) = (SocketAddr::from((scene.b.ip, APP_PORT)), SocketAddr::from((outsider.ip, APP_PORT)));
    // The first connection opens A's pooled HBONE connection to B.
    assert_eq!(hello(&scene.a, to_b).expect("A to B over HBONE"), HELLO);

    // Every kind of upstream socket the proxy makes in a pod: B's app dialled for an HBONE stream and for
    // plaintext inbound, and a plain TCP destination dialled from A.
    let trace = ThreadTrace::attach(pid);
    for _ in 0..20 {
        assert_eq!(hello(&scene.a, to_b).expect("A to B over HBONE"), HELLO);
        assert_eq!(hello(&outsider, to_b).expect("plaintext into B"), HELLO);
        assert_eq!(hello(&scene.a, to_outsider).expect("A to a destination outside the mesh"), HELLO);
    }
    let created = trace.threads_created();
    assert_eq!(created, 0, "the proxy created {created} threads for 60 connections");
    assert_eq!(threads_named(pid, SOCKET_THREAD), SOCKET_THREADS);
    // Idle, the socket threads are back in the proxy's own netns: none holds a pod's netns alive.
    let b_netns = netns_id(&scene.b);
    eventually("no proxy thread idles in B's netns", || (!thread_netns(pid).contains(&b_netns)).then_some(()));

    scene.cluster.delete_pod(NS, "b", Some(&mut scene.b));
    assert_eq!(hello(&scene.a, to_outsider).expect("the socket threads still serve A"), HELLO);
    assert_eq!(threads_named(pid, SOCKET_THREAD), SOCKET_THREADS, "deleting a pod stops no socket thread");
    assert!(!thread_netns(pid).contains(&b_netns), "a proxy thread is inside B's deleted netns");
}

/// How many connections wait in the accept queue of the TCP listener on `port` in `ns` (`Recv-Q` of `ss -lnt`).
fn accept_queue(ns: &NetnsGuard, port: u16) -> usize {
    let out = ns.exec_ok(&["ss", "-Hltn", &format!("sport = :{port}")]);
    out.lines().filter_map(|line| line.split_whitespace().nth(1)?.parse::<usize>().ok()).sum()
}

/// The proxy's log lines that say accepting failed.
fn accept_failures(log: &str) -> Vec<&str> {
    log.lines().filter(|line| line.contains("accept failed")).collect()
}

#[test]
fn out_of_file_descriptors_the_accept_loops_back_off_warn_once_per_interval_and_serve_again_once_fds_free_up() {
    let mut scene = scene();
    let outsider = plain_member(&scene.cluster, "n");
    let _accepted = echo_app(scene.b_listener());
    let to_b = SocketAddr::from((scene.b.ip, APP_PORT));
    let limit = (open_fds(scene.proxy.pid()) + HEADROOM) as u64;
    restart_with_open_files(&mut scene, (limit, limit));
    assert_eq!(hello(&scene.a, to_b).expect("A to B before the flood"), HELLO);

    // Idle connections straight to B's HBONE port from a pod outside the mesh: each one the proxy accepts holds a
    // descriptor (until its TLS handshake times out), more than it has left; the rest wait in the accept queue.
    let hbone = SocketAddr::from((scene.b.ip, ports::HBONE));
    let ns = outsider.netns.open().expect("open the outsider's netns");
    let connect_all = || -> io::Result<Vec<TcpStream>> {
        (0..HEADROOM + QUEUED).map(|_| TcpStream::connect_timeout(&hbone, Duration::from_secs(5))).collect()
    };
    let flood = ns.run(connect_all).expect("enter the outsider's netns");
    let flood = flood.unwrap_or_else(|e| panic!("connect to {hbone}: {e}"));
    eventually("the proxy runs out of descriptors accepting", || {
        let log = scene.proxy.log();
        accept_failures(&log).iter().any(|line| line.contains("Too many open files")).then_some(())
    });

    // While it stays out of them (connections keep waiting in the queue), it neither spins nor floods its log.
    let drained =
        within(Instant::now(), SATURATED_FOR, || (accept_queue(&scene.b.netns, ports::HBONE) == 0).then_some(()));
    assert!(drained.is_none(), "the proxy accepted the whole queue: it was not out of descriptors");
    let log = scene.proxy.log();
    let failures = accept_failures(&log);
    assert_eq!(failures.len(), 1, "one warning per listener and interval, not one per failed accept:\n{failures:#?}");
    assert!(failures[0].contains("inbound HBONE") && failures[0].contains("uid="), "names the listener and the pod");

    // Once the flood goes, its descriptors are freed: the queue drains and A reaches B again.
    drop(flood);
    eventually("the queue on B's HBONE port drains", || {
        (accept_queue(&scene.b.netns, ports::HBONE) == 0).then_some(())
    });
    eventually("A reaches B again", || hello(&scene.a, to_b).ok().filter(|back| back == HELLO));
    let log = scene.proxy.log();
    assert!(accept_failures(&log).len() <= 2, "recovering logged no flood either:\n{:#?}", accept_failures(&log));
}

/// Connects to 127.0.0.1:`port` in `netns`.
fn connect_local(netns: &Path, port: u16) -> TcpStream {
    let ns = netns::Netns::open(netns).expect("open the node netns");
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = ns.run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(2))).expect("enter the node netns");
    let stream = stream.unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    stream.set_read_timeout(Some(testbed::wait::DEADLINE)).expect("read timeout");
    stream
}

/// Reads until `stream` ends: what came before the end (a reset counts as an end).
fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => return got,
            Err(e) => panic!("connection still open ({e}); read so far: {got:?}"),
        }
    }
}

#[test]
fn the_admin_stats_and_readiness_endpoints_cap_connections_and_drop_clients_that_never_send_their_headers() {
    let scene = scene();
    let netns = scene.cluster.node.netns().path();
    for port in [ports::ADMIN, ports::STATS, ports::READINESS] {
        // Idle connections hold every slot; one more is closed at once, unanswered.
        let held: Vec<TcpStream> = (0..DEFAULT_MAX_CONNECTIONS).map(|_| connect_local(&netns, port)).collect();
        let mut over = connect_local(&netns, port);
        let _ = over.write_all(b"GET / HTTP/1.1\r\nHost: proxy\r\n\r\n");
        let answer = String::from_utf8_lossy(&read_until_closed(&mut over)).into_owned();
        assert_eq!(answer, "", "port {port} answered a connection over its cap");
        drop(held);
    }

    // A client that starts a request and never finishes its headers is disconnected (header read timeout).
    let mut slow: Vec<(u16, TcpStream)> = [ports::ADMIN, ports::STATS, ports::READINESS]
        .into_iter()
        .map(|port| {
            let mut stream = connect_local(&netns, port);
            stream.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: pro").expect("half a request");
            (port, stream)
        })
        .collect();
    for (port, stream) in &mut slow {
        let answer = String::from_utf8_lossy(&read_until_closed(stream)).into_owned();
        assert_eq!(answer, "", "port {port} answered a request never finished");
    }
    let ready = support::http_get(&netns, ports::READINESS, "/healthz/ready").map(|(status, _)| status);
    assert_eq!(ready, Some(200), "the endpoints still serve");
}
