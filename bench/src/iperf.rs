//! iperf3 (the Debian package) as a second load generator beside node-bench's own sink apps: a server in the server
//! pod's netns for the whole scenario, and one client run per measurement in the client pod's netns, whose JSON
//! report gives the rate the server received.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testbed::NetnsGuard;

/// The port iperf3 listens on in the server pods.
pub const PORT: u16 = 5201;
/// How long the server may take to listen.
const START_LIMIT: Duration = Duration::from_secs(20);

/// `iperf3 -s` in a pod's netns; killed on drop.
pub struct IperfServer {
    child: Child,
}

impl IperfServer {
    /// Starts the server in `pod` and waits until it listens.
    pub fn start(pod: &NetnsGuard) -> IperfServer {
        let child = Command::new("ip")
            .args(["netns", "exec", pod.name(), "iperf3", "-s", "-p", &PORT.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn iperf3 -s (scripts/install-deps.sh installs iperf3)");
        let server = IperfServer { child };
        let filter = format!("sport = :{PORT}");
        let listening = testbed::wait::within(Instant::now(), START_LIMIT, || {
            (!pod.exec_ok(&["ss", "-Hltn", &filter]).trim().is_empty()).then_some(())
        });
        assert!(listening.is_some(), "iperf3 -s never listened in {}", pod.name());
        server
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        // `ip netns exec` execs iperf3, so this is iperf3's own process.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One iperf3 client run from `pod` to the server at `addr`: `bytes` in all over `streams` parallel connections.
/// Returns the rate the server received in Gb/s and the bytes it received.
pub fn run(pod: &NetnsGuard, addr: SocketAddr, streams: usize, bytes: u64) -> (f64, u64) {
    let out = Command::new("ip")
        .args(["netns", "exec", pod.name(), "iperf3", "-J", "--connect-timeout", "10000", "-c"])
        .args([addr.ip().to_string(), "-p".into(), addr.port().to_string()])
        .args(["-n".to_string(), bytes.to_string(), "-P".into(), streams.to_string()])
        .output()
        .expect("run iperf3 -c");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 -c {addr}: no JSON ({e}): {}", String::from_utf8_lossy(&out.stderr)));
    if let Some(error) = report.get("error") {
        panic!("iperf3 -c {addr}: {error}");
    }
    let received = &report["end"]["sum_received"];
    let bits = received["bits_per_second"].as_f64().expect("iperf3 end.sum_received.bits_per_second");
    (bits / 1e9, received["bytes"].as_u64().unwrap_or(bytes))
}
