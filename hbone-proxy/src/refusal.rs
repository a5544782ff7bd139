//! Captured connections the proxy must not serve, refused before anything is connected for them. Serving a
//! connection to one of the proxy's own ports would make the proxy connect to itself, and that connection would be
//! captured and served again, without end (issue #14: 20,000 file descriptors in 2 s). So the outbound
//! ([`ports::OUTBOUND`]) and plaintext inbound ([`ports::INBOUND_PLAINTEXT`]) handlers screen each connection:
//!
//! - its destination is one of the proxy's ports ([`ports::PROXY_OWN`]) on an address of the pod (its IPs,
//!   loopback, unspecified): refused as a self-call, as ztunnel does;
//! - its original destination is the listener itself (the accepted socket's local address, on the listener's
//!   port): nothing redirected it, someone dialled the proxy directly;
//! - plaintext inbound headed anywhere but one of the pod's own IPs.
//!
//! A refusal resets the connection at once, is counted in `istio_tcp_connections_refused_total` (labels
//! `direction`, `reason`) and is logged at most once per pod, direction, reason and [`REFUSAL_LOG_INTERVAL`].
//!
//! [`REFUSAL_LOG_INTERVAL`]: crate::ratelimit::REFUSAL_LOG_INTERVAL

use std::net::{IpAddr, SocketAddr};

use istio_contract::ports;
use tokio::net::TcpStream;

use crate::mesh::PodContext;
use crate::metrics::{Direction, RefusalReason};
use crate::sockets;

/// Whether `dst` is one of the proxy's own ports on an address of the pod (`pod_ips`, loopback or unspecified).
pub fn is_self_call(pod_ips: &[IpAddr], dst: SocketAddr) -> bool {
    let ip = dst.ip().to_canonical();
    ports::PROXY_OWN.contains(&dst.port()) && (ip.is_loopback() || ip.is_unspecified() || pod_ips.contains(&ip))
}

/// Why a connection accepted on `listener_port` (its local address `local`, its original destination `dst`) in
/// the direction `direction` must be refused, if it must.
pub fn check(
    direction: Direction,
    listener_port: u16,
    pod_ips: &[IpAddr],
    local: SocketAddr,
    dst: SocketAddr,
) -> Result<(), RefusalReason> {
    if is_self_call(pod_ips, dst) {
        return Err(RefusalReason::SelfCall);
    }
    // REDIRECT rewrites the destination to the listener, so an unchanged one means nothing redirected the
    // connection. (With TPROXY the local address is always the original destination; it is on the listener's
    // port only when the proxy itself was dialled.)
    let local = SocketAddr::new(local.ip().to_canonical(), local.port());
    if dst == local && local.port() == listener_port {
        return Err(RefusalReason::NotRedirected);
    }
    if direction == Direction::Inbound && !pod_ips.contains(&dst.ip().to_canonical()) {
        return Err(RefusalReason::NotPodIp);
    }
    Ok(())
}

/// Screens a connection accepted on `listener_port`: its original destination when it may be served; otherwise
/// the connection is reset, counted and (rate-limited) logged, and `None` is returned.
pub fn screen(
    pod: &PodContext,
    direction: Direction,
    listener_port: u16,
    stream: TcpStream,
    peer: SocketAddr,
) -> Option<(TcpStream, SocketAddr)> {
    let addrs = sockets::original_dst(&stream).and_then(|dst| Ok((stream.local_addr()?, dst)));
    let (reason, dst) = match addrs {
        Ok((local, dst)) => match check(direction, listener_port, &pod.ips, local, dst) {
            Ok(()) => return Some((stream, dst)),
            Err(reason) => (reason, dst.to_string()),
        },
        Err(error) => (RefusalReason::NoOriginalDst, format!("unknown ({error})")),
    };
    sockets::reset(stream);
    pod.mesh.metrics.refused(direction, reason);
    if let Some(suppressed) = pod.refusal_log.admit((direction, reason)) {
        tracing::warn!(
            uid = %pod.uid,
            direction = %direction.as_str(),
            reason = %reason.as_str(),
            %peer,
            %dst,
            suppressed,
            "captured connection refused"
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::net::{Ipv4Addr, Ipv6Addr};

    const POD: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 7);
    const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 7);
    const OTHER: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 8);
    const APP_PORT: u16 = 8080;

    fn ips() -> Vec<IpAddr> {
        vec![POD.into(), POD6.into()]
    }

    fn at(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
        SocketAddr::new(ip.into(), port)
    }

    #[test]
    fn every_proxy_port_on_every_address_of_the_pod_is_a_self_call() {
        let mapped = Ipv4Addr::LOCALHOST.to_ipv6_mapped();
        let addresses: [IpAddr; 7] = [
            POD.into(),
            POD6.into(),
            Ipv4Addr::LOCALHOST.into(),
            Ipv4Addr::new(127, 0, 0, 2).into(),
            Ipv6Addr::LOCALHOST.into(),
            Ipv4Addr::UNSPECIFIED.into(),
            mapped.into(),
        ];
        for ip in addresses {
            for port in ports::PROXY_OWN {
                assert!(is_self_call(&ips(), at(ip, port)), "{ip}:{port}");
                for (direction, listener) in
                    [(Direction::Outbound, ports::OUTBOUND), (Direction::Inbound, ports::INBOUND_PLAINTEXT)]
                {
                    let local = at(POD, listener);
                    assert_eq!(check(direction, listener, &ips(), local, at(ip, port)), Err(RefusalReason::SelfCall));
                }
            }
            assert!(!is_self_call(&ips(), at(ip, APP_PORT)), "{ip}:{APP_PORT} is the app, not the proxy");
        }
        assert!(!is_self_call(&ips(), at(OTHER, ports::INBOUND_PLAINTEXT)), "another pod's ports are not ours");
    }

    #[test]
    fn a_connection_nothing_redirected_is_refused() {
        // An address the pod list does not hold (added later, say), dialled on the listener's port directly.
        let unlisted = at(Ipv4Addr::new(192, 0, 2, 1), ports::OUTBOUND);
        assert_eq!(
            check(Direction::Outbound, ports::OUTBOUND, &ips(), unlisted, unlisted),
            Err(RefusalReason::NotRedirected)
        );
        // Redirected: the local address is the listener's, the original destination is elsewhere.
        let local = at(Ipv4Addr::LOCALHOST, ports::OUTBOUND);
        assert_eq!(check(Direction::Outbound, ports::OUTBOUND, &ips(), local, at(OTHER, APP_PORT)), Ok(()));
        // TPROXY-style: the local address is the original destination, on the app's port.
        let app = at(POD, APP_PORT);
        assert_eq!(check(Direction::Inbound, ports::INBOUND_PLAINTEXT, &ips(), app, app), Ok(()));
    }

    #[test]
    fn plaintext_inbound_reaches_only_the_pods_own_ips() {
        let local = at(POD, ports::INBOUND_PLAINTEXT);
        let inbound = |dst| check(Direction::Inbound, ports::INBOUND_PLAINTEXT, &ips(), local, dst);
        assert_eq!(inbound(at(POD, APP_PORT)), Ok(()));
        assert_eq!(inbound(at(POD6, APP_PORT)), Ok(()));
        assert_eq!(inbound(at(OTHER, APP_PORT)), Err(RefusalReason::NotPodIp));
        assert_eq!(inbound(at(Ipv4Addr::LOCALHOST, APP_PORT)), Err(RefusalReason::NotPodIp));
        // Outbound goes anywhere but to the proxy itself.
        let local = at(Ipv4Addr::LOCALHOST, ports::OUTBOUND);
        assert_eq!(check(Direction::Outbound, ports::OUTBOUND, &ips(), local, at(OTHER, APP_PORT)), Ok(()));
    }
}
