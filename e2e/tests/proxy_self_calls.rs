//! Self-calls (issue #14) against the real `hbone-proxy` (real node agent, pods through the fake CNI runtime): an
//! app in an ambient pod that dials the proxy's own ports in its pod (`127.0.0.1:15001`, `127.0.0.1:15006`,
//! `podIP:15001`, `podIP:15006`, `podIP:15008`), and a peer outside the mesh that dials `podIP:15006` directly,
//! are each refused within 1 s. The proxy never connects to itself in a loop (its open fd count stays within 50
//! of its baseline), another pod pair keeps exchanging bytes meanwhile, every refusal is counted in
//! `istio_tcp_connections_refused_total`, and the log holds at most one line per pod and reason.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use istio_contract::ports;
use testbed::node_agent::uid;
use testbed::wait::{eventually, eventually_or};
use testbed::Pod;

mod support;
use support::traffic::{transfer, Payload};
use support::{ambient_member, metric, open_fds, plain_member, Scene, APP_PORT, NS};

/// The bound: each self-call is refused within this.
const REFUSED_WITHIN: Duration = Duration::from_secs(1);
/// The bound on how far the proxy's open fd count may rise above its baseline.
const FD_SLACK: usize = 50;
/// Rounds over every target.
const ROUNDS: usize = 25;
/// How often one pod's refusals of one kind are logged at most (the proxy's `REFUSAL_LOG_INTERVAL`).
const LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Bytes each way of every transfer between A and B.
const TRANSFER: u64 = 1024 * 1024;
/// The message of the proxy's (rate-limited) refusal log line.
const REFUSAL_LINE: &str = "captured connection refused";

/// An app in `from` dials `dst`, sends a line and reads until the connection ends: how long the proxy took to close
/// or reset it, or why it did not within [`REFUSED_WITHIN`].
fn refusal(from: &Pod, dst: SocketAddr) -> Result<Duration, String> {
    let started = Instant::now();
    let ns = from.netns.open().expect("open pod netns");
    let connected = ns.run(|| TcpStream::connect_timeout(&dst, REFUSED_WITHIN)).expect("enter pod netns");
    let mut stream = match connected {
        Ok(stream) => stream,
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset) => {
            return Ok(started.elapsed())
        }
        Err(e) => return Err(format!("connect: {e}")),
    };
    // The proxy may reset before or during the write; either way the read below tells.
    let _ = stream.write_all(b"hello, is this the mesh?\n");
    let mut buf = [0u8; 4096];
    loop {
        let left = REFUSED_WITHIN.checked_sub(started.elapsed()).filter(|left| !left.is_zero());
        let Some(left) = left else { return Err(format!("still open after {REFUSED_WITHIN:?}")) };
        stream.set_read_timeout(Some(left)).expect("read timeout");
        match stream.read(&mut buf) {
            Ok(0) => return Ok(started.elapsed()),
            // 15008 answers garbage with a TLS alert before it closes.
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(format!("still open after {REFUSED_WITHIN:?}"))
            }
            Err(_) => return Ok(started.elapsed()),
        }
    }
}

/// A and B exchanging [`TRANSFER`] bytes each way, one connection after another, on a thread of its own until
/// stopped (or dropped, say by a failing assertion); a transfer that does not arrive whole (length and SHA-256 on
/// both ends) ends the thread with a panic. Nothing here blocks the test: it only polls the thread.
struct Traffic {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

impl Traffic {
    fn start(scene: &Scene) -> Self {
        let listener = scene.b_listener();
        let a = scene.a.netns.open().expect("open A's netns");
        let b = SocketAddr::from((scene.b.ip, APP_PORT));
        let (stop, done) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let (stopped, count) = (stop.clone(), done.clone());
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                let connect = || {
                    let connected = a.run(|| TcpStream::connect_timeout(&b, Duration::from_secs(10)));
                    connected.expect("enter A's netns").expect("A's app connects to B")
                };
                let listener = listener.try_clone().expect("B's app socket");
                transfer(listener, connect, Payload::new(1, TRANSFER), Payload::new(2, TRANSFER));
                count.fetch_add(1, Ordering::SeqCst);
            }
        });
        Traffic { stop, done, thread: Some(thread) }
    }

    /// Transfers completed so far; panics if the thread ended (a transfer failed).
    fn completed(&self, during: &str) -> usize {
        let ended = self.thread.as_ref().is_none_or(JoinHandle::is_finished);
        assert!(!ended, "the transfers between A and B stopped ({during})");
        self.done.load(Ordering::SeqCst)
    }

    /// Stops after the current transfer and waits for it to end whole.
    fn finish(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let thread = self.thread.take().expect("running");
        eventually("the last transfer between A and B ended", || thread.is_finished().then_some(()));
        thread.join().expect("every transfer between A and B arrived whole (length and SHA-256 on both ends)");
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[test]
fn calls_to_the_proxys_own_ports_are_refused_at_once_without_a_loop_while_other_pods_keep_talking() {
    let scene = Scene::new(tempfile::tempdir().expect("scratch dir"), "b-sa", &[]);
    let victim = ambient_member(&scene.cluster, "v", "v-sa");
    let outsider = plain_member(&scene.cluster, "p");
    let pid = scene.proxy.pid();
    let node = scene.cluster.node.netns().path();
    let baseline = open_fds(pid);

    let pod_ip = |port| SocketAddr::from((victim.ip, port));
    let loopback = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    // Who dials, where, and the direction of the refusal counter it adds to (the HBONE port refuses in its TLS
    // handshake instead: a plaintext line is no ClientHello).
    let targets: [(&str, &Pod, SocketAddr, Option<&str>); 6] = [
        ("v's app", &victim, loopback(ports::OUTBOUND), Some("outbound")),
        ("v's app", &victim, pod_ip(ports::OUTBOUND), Some("outbound")),
        ("v's app", &victim, loopback(ports::INBOUND_PLAINTEXT), Some("inbound")),
        ("v's app", &victim, pod_ip(ports::INBOUND_PLAINTEXT), Some("inbound")),
        ("v's app", &victim, pod_ip(ports::HBONE), None),
        ("a peer outside the mesh", &outsider, pod_ip(ports::INBOUND_PLAINTEXT), Some("inbound")),
    ];

    // Another pod pair keeps exchanging bytes the whole time.
    let traffic = Traffic::start(&scene);
    eventually("A and B exchanged bytes", || (traffic.completed("before the self-calls") > 0).then_some(()));
    let before = traffic.completed("before the self-calls");
    let started = Instant::now();

    let mut peak = baseline;
    for round in 0..ROUNDS {
        for (who, from, dst, _) in &targets {
            let took = refusal(from, *dst).unwrap_or_else(|why| {
                panic!(
                    "round {round}: {who} -> {dst} was not refused: {why}; the proxy holds {} fds (baseline \
                     {baseline})",
                    open_fds(pid)
                )
            });
            assert!(took <= REFUSED_WITHIN, "round {round}: {who} -> {dst} refused only after {took:?}");
            peak = peak.max(open_fds(pid));
            assert!(
                peak <= baseline + FD_SLACK,
                "round {round}: after {who} -> {dst} the proxy holds {peak} fds (baseline {baseline})"
            );
        }
    }
    eventually("a transfer between A and B completed after the self-calls began", || {
        (traffic.completed("during the self-calls") >= before + 2).then_some(())
    });
    traffic.finish();
    let elapsed = started.elapsed();

    for direction in ["outbound", "inbound"] {
        let expected = (ROUNDS * targets.iter().filter(|t| t.3 == Some(direction)).count()) as f64;
        let line = format!("istio_tcp_connections_refused_total{{direction=\"{direction}\",reason=\"self_call\"}} ");
        eventually_or(
            &format!("{expected} {direction} self-calls are counted"),
            || (metric(&node, &line) == Some(expected)).then_some(()),
            || format!("{line}{:?}", metric(&node, &line)),
        );
    }

    // At most one line per pod, direction and reason and interval; never one per connection.
    let log = scene.proxy.log();
    let allowed = 1 + (elapsed.as_secs_f64() / LOG_INTERVAL.as_secs_f64()) as usize;
    let refusals: Vec<&str> = log.lines().filter(|l| l.contains(REFUSAL_LINE)).collect();
    let victim_uid = uid(&scene.cluster, NS, "v");
    for direction in ["outbound", "inbound"] {
        let fields = [format!("uid={victim_uid}"), format!("direction={direction}"), "reason=self_call".to_owned()];
        let lines = refusals.iter().filter(|l| fields.iter().all(|f| l.contains(f.as_str()))).count();
        assert!(
            (1..=allowed).contains(&lines),
            "{lines} log lines for v's {direction} self-calls in {elapsed:?} (1 to {allowed} expected):\n{}",
            refusals.join("\n")
        );
    }
    assert!(refusals.len() <= 2 * allowed, "refusal log lines beyond v's self-calls:\n{}", refusals.join("\n"));
    assert!(!log.contains("accept failed"), "the proxy ran out of something while refusing:\n{log}");
}
