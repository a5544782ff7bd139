//! The proxy's sockets inside a pod: the agent enters the pod's netns and reads the kernel's socket tables
//! (`/proc/thread-self/net/{tcp,tcp6,udp,udp6}`, which show the calling thread's netns) for Istio's capture
//! ports. A pod whose rules redirect to a port nobody listens on drops its traffic: this is how explain shows it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use istio_contract::ports;
use netns::Netns;

use super::report::{Listener, Listeners};

/// The ports the in-pod rules send traffic to, and what for.
pub const CAPTURE_PORTS: [(u16, &str); 4] = [
    (ports::OUTBOUND, "outbound capture"),
    (ports::INBOUND_PLAINTEXT, "inbound plaintext capture"),
    (ports::HBONE, "HBONE inbound"),
    (ports::DNS, "DNS"),
];

/// `st` of a listening TCP socket in `/proc/net/tcp`.
const TCP_LISTEN: &str = "0A";
/// `st` of a bound, unconnected UDP socket.
const UDP_UNCONNECTED: &str = "07";

/// The capture-port sockets in `netns` (blocking: it enters the netns on a thread of its own).
pub fn read_in(netns: &Netns) -> Listeners {
    match netns.run(read_own) {
        Ok(Ok(found)) => listeners(found),
        Ok(Err(e)) => Listeners { error: Some(e.to_string()), ..Listeners::default() },
        Err(e) => Listeners { error: Some(e.to_string()), ..Listeners::default() },
    }
}

/// The capture-port sockets of the calling thread's netns.
fn read_own() -> std::io::Result<Vec<Listener>> {
    let mut found = Vec::new();
    for (protocol, state) in
        [("tcp", TCP_LISTEN), ("tcp6", TCP_LISTEN), ("udp", UDP_UNCONNECTED), ("udp6", UDP_UNCONNECTED)]
    {
        let text = match std::fs::read_to_string(format!("/proc/thread-self/net/{protocol}")) {
            Ok(text) => text,
            // No IPv6 in the kernel: no table.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && protocol.ends_with('6') => continue,
            Err(e) => return Err(e),
        };
        let udp = protocol.starts_with("udp");
        found.extend(parse(&text, state).into_iter().filter_map(|(address, port)| {
            let (_, role) = CAPTURE_PORTS.iter().find(|(p, _)| *p == port && (!udp || *p == ports::DNS))?;
            Some(Listener {
                protocol: protocol.to_string(),
                address: address.to_string(),
                port,
                role: role.to_string(),
            })
        }));
    }
    Ok(found)
}

/// What was found, and the TCP capture ports nothing listens on.
fn listeners(mut found: Vec<Listener>) -> Listeners {
    found.sort_by(|a, b| (a.port, &a.protocol).cmp(&(b.port, &b.protocol)));
    found.dedup();
    let missing = CAPTURE_PORTS
        .iter()
        .map(|(port, _)| *port)
        .filter(|port| !found.iter().any(|l| l.port == *port && l.protocol.starts_with("tcp")))
        .collect();
    Listeners { found, missing, error: None }
}

/// The local address and port of every socket in state `state` of a `/proc/net/{tcp,udp}[6]` table.
fn parse(table: &str, state: &str) -> Vec<(IpAddr, u16)> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) != Some(&state) {
                return None;
            }
            let (addr, port) = fields.get(1)?.split_once(':')?;
            Some((address(addr)?, u16::from_str_radix(port, 16).ok()?))
        })
        .collect()
}

/// The kernel prints an address as its 32-bit words in host byte order, each as 8 hex digits.
fn address(hex: &str) -> Option<IpAddr> {
    let words: Vec<[u8; 4]> = (0..hex.len() / 8)
        .map(|i| u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok().map(u32::to_ne_bytes))
        .collect::<Option<_>>()?;
    match words.as_slice() {
        [w] => Some(IpAddr::V4(Ipv4Addr::from(*w))),
        [a, b, c, d] => {
            let bytes: Vec<u8> = [a, b, c, d].iter().flat_map(|w| w.iter().copied()).collect();
            Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_sockets_on_the_capture_ports_are_read_from_the_kernels_tables() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                  0: 0100007F:3A99 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n\
                  1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2\n\
                  2: 0100007F:3A99 0100007F:8000 01 00000000:00000000 00:00000000 00000000     0        0 3\n";
        let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(parse(v4, TCP_LISTEN), [(local, 15001), (IpAddr::V4(Ipv4Addr::UNSPECIFIED), 8080)]);
        let v6 = "  sl local_address remote_address st\n\
                  0: 00000000000000000000000000000000:3A9E 00000000000000000000000000000000:0000 0A\n\
                  1: 00000000000000000000000001000000:3A98 00000000000000000000000000000000:0000 0A\n";
        assert_eq!(
            parse(v6, TCP_LISTEN),
            [(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 15006), (IpAddr::V6(Ipv6Addr::LOCALHOST), 15000)]
        );
    }

    #[test]
    fn the_capture_ports_nothing_listens_on_are_missing() {
        let l = |port, protocol: &str| Listener {
            protocol: protocol.into(),
            address: "0.0.0.0".into(),
            port,
            role: String::new(),
        };
        let got = listeners(vec![l(15006, "tcp6"), l(15001, "tcp"), l(15053, "udp")]);
        assert_eq!(got.missing, [ports::HBONE, ports::DNS]);
        assert_eq!(got.found.iter().map(|l| l.port).collect::<Vec<_>>(), [15001, 15006, 15053]);
    }
}
