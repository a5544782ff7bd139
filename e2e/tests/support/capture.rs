//! Packet captures with the real `tcpdump` on an interface of a test netns, and a reader for the pcap files
//! it writes (Ethernet, IPv4 or IPv6, TCP), so tests can look at what actually crossed the wire.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use testbed::wait::eventually;
use testbed::NetnsGuard;

/// How long tcpdump may take to start listening, and to exit after SIGINT.
const DEADLINE: Duration = Duration::from_secs(10);

/// A running `tcpdump -i <iface> -w <file>`; killed on drop if it was not stopped.
pub struct Capture {
    child: Child,
    file: PathBuf,
    stderr: mpsc::Receiver<String>,
}

impl Capture {
    /// Starts tcpdump on `iface` inside `ns`, writing every full packet to `file`; returns once tcpdump
    /// says it is listening.
    pub fn start(ns: &NetnsGuard, iface: &str, file: &Path) -> Self {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns.name(),
                "tcpdump",
                "-Z",
                "root",
                "-i",
                iface,
                "-n",
                "-s",
                "0",
                "-B",
                "16384",
                "-U",
                "-w",
            ])
            .arg(file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tcpdump (scripts/install-deps.sh installs it)");
        let (tx, stderr) = mpsc::channel();
        let pipe = child.stderr.take().expect("tcpdump stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let capture = Capture { child, file: file.to_path_buf(), stderr };
        let deadline = std::time::Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match capture.stderr.recv_timeout(left) {
                Ok(line) if line.contains("listening on") => return capture,
                Ok(line) => seen.push(line),
                Err(_) => panic!("tcpdump on {iface} not listening within {DEADLINE:?}: {seen:?}"),
            }
        }
    }

    /// The packets written so far (tcpdump writes each one as it sees it).
    pub fn packets(&self) -> Vec<Packet> {
        read_pcap(&std::fs::read(&self.file).expect("read capture"))
    }

    /// Waits until the packets written so far satisfy `done` (tcpdump may lag behind the traffic a little), then
    /// stops it; panics naming `what` if that takes longer than the deadline.
    pub fn stop_when(self, what: &str, done: impl Fn(&[Packet]) -> bool) -> Vec<Packet> {
        eventually(&format!("the capture shows {what}"), || done(&self.packets()).then_some(()));
        self.stop()
    }

    /// Stops tcpdump with SIGINT (it flushes the file), waits for it and returns the packets it wrote, after
    /// checking that the kernel dropped none.
    pub fn stop(mut self) -> Vec<Packet> {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT).expect("SIGINT tcpdump");
        eventually("tcpdump exits after SIGINT", || self.child.try_wait().expect("poll tcpdump"));
        let summary: Vec<String> = self.stderr.try_iter().collect();
        let dropped = summary.iter().find(|l| l.contains("dropped by kernel")).cloned().unwrap_or_default();
        assert!(dropped.starts_with("0 "), "tcpdump lost packets, the capture is incomplete: {summary:?}");
        read_pcap(&std::fs::read(&self.file).expect("read capture"))
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One captured TCP segment.
#[derive(Debug, Clone)]
pub struct Packet {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// The TCP payload.
    pub payload: Vec<u8>,
}

/// Bytes of TCP payload in `packets` to or from `port`.
pub fn payload_bytes(packets: &[Packet], port: u16) -> u64 {
    packets.iter().filter(|p| p.sport == port || p.dport == port).map(|p| p.payload.len() as u64).sum()
}

/// The TCP segments (over IPv4 or IPv6) of a pcap file with Ethernet link type; anything else is skipped.
pub fn read_pcap(data: &[u8]) -> Vec<Packet> {
    assert!(data.len() >= 24, "pcap file shorter than its header");
    let magic = u32::from_le_bytes(data[0..4].try_into().unwrap());
    assert!(magic == 0xa1b2c3d4 || magic == 0xa1b23c4d, "little-endian pcap expected, magic {magic:#x}");
    let link_type = u32::from_le_bytes(data[20..24].try_into().unwrap());
    assert_eq!(link_type, 1, "Ethernet link type expected");
    let mut packets = Vec::new();
    let mut at = 24;
    while at + 16 <= data.len() {
        let caplen = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap()) as usize;
        let wirelen = u32::from_le_bytes(data[at + 12..at + 16].try_into().unwrap()) as usize;
        let Some(frame) = data.get(at + 16..at + 16 + caplen) else {
            break; // a record still being written
        };
        assert_eq!(caplen, wirelen, "the capture truncated a packet");
        at += 16 + caplen;
        if let Some(packet) = tcp_in_ethernet(frame) {
            packets.push(packet);
        }
    }
    packets
}

fn tcp_in_ethernet(frame: &[u8]) -> Option<Packet> {
    let ip = frame.get(14..)?;
    let (src, dst, tcp) = match frame.get(12..14)? {
        [0x08, 0x00] => tcp_in_ipv4(ip)?,
        [0x86, 0xdd] => tcp_in_ipv6(ip)?,
        _ => return None,
    };
    if tcp.len() < 20 {
        return None;
    }
    let offset = usize::from(tcp[12] >> 4) * 4;
    Some(Packet {
        src,
        dst,
        sport: u16::from_be_bytes([tcp[0], tcp[1]]),
        dport: u16::from_be_bytes([tcp[2], tcp[3]]),
        payload: tcp.get(offset..)?.to_vec(),
    })
}

/// (source, destination, TCP segment) of an IPv4 packet carrying TCP.
fn tcp_in_ipv4(ip: &[u8]) -> Option<(IpAddr, IpAddr, &[u8])> {
    if ip.len() < 20 || ip[0] >> 4 != 4 || ip[9] != 6 {
        return None;
    }
    let header = usize::from(ip[0] & 0x0f) * 4;
    // Segments the kernel aggregated beyond 64 KiB (BIG TCP) carry a total length of 0: the frame tells.
    let total = match usize::from(u16::from_be_bytes([ip[2], ip[3]])) {
        0 => ip.len(),
        total => total.min(ip.len()),
    };
    let addr = |at: usize| IpAddr::V4(Ipv4Addr::new(ip[at], ip[at + 1], ip[at + 2], ip[at + 3]));
    Some((addr(12), addr(16), ip.get(header..total)?))
}

/// (source, destination, TCP segment) of an IPv6 packet carrying TCP, directly or after a hop-by-hop header
/// (the jumbo payload option of IPv6 BIG TCP).
fn tcp_in_ipv6(ip: &[u8]) -> Option<(IpAddr, IpAddr, &[u8])> {
    if ip.len() < 40 || ip[0] >> 4 != 6 {
        return None;
    }
    let end = match usize::from(u16::from_be_bytes([ip[4], ip[5]])) {
        0 => ip.len(),
        len => (40 + len).min(ip.len()),
    };
    let (mut next, mut at) = (ip[6], 40);
    if next == 0 {
        next = *ip.get(at)?;
        at += (usize::from(*ip.get(at + 1)?) + 1) * 8;
    }
    if next != 6 {
        return None;
    }
    let addr = |from: usize| IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[from..from + 16]).expect("16 bytes")));
    Some((addr(8), addr(24), ip.get(at..end)?))
}

/// The host-side veth of a pod, as the bridge plugin reported it in the pod's CNI ADD result.
pub fn host_veth(result: &serde_json::Value) -> String {
    let interfaces = result["interfaces"].as_array().expect("ADD result interfaces");
    interfaces
        .iter()
        .find(|i| i.get("sandbox").is_none() && i["name"].as_str().is_some_and(|n| n.starts_with("veth")))
        .and_then(|i| i["name"].as_str())
        .unwrap_or_else(|| panic!("no host veth in {result}"))
        .to_owned()
}
