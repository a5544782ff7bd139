//! How the proxy's own traffic is told apart from the apps': a socket mark in ambient, a uid/gid in a sidecar;
//! and the source address the node's own probes arrive from. Rules skip traffic that carries them, so a mismatch
//! is a redirect loop or a failing probe.

use std::net::{Ipv4Addr, Ipv6Addr};

/// Mark ztunnel (and our proxy) sets on its own sockets (1337); in-pod rules never redirect it.
pub const PROXY_MARK: u32 = 0x539;
/// Uid a sidecar's proxy runs as unless its container says otherwise.
pub const PROXY_UID: u32 = 1337;
/// Gid a sidecar's proxy runs as unless its container says otherwise.
pub const PROXY_GID: u32 = 1337;
/// Mark a sidecar's TPROXY rules set on inbound packets (Istio's `InboundTProxyMark`).
pub const TPROXY_MARK: u32 = 1337;
/// Source address the node rewrites kubelet probes to (host probe SNAT); ambient pods accept it unredirected.
pub const PROBE_SNAT_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);
/// The IPv6 host probe SNAT address.
pub const PROBE_SNAT_V6: Ipv6Addr = Ipv6Addr::new(0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff);
/// Mark a sidecar proxy's own loopback traffic gets in TPROXY mode (Istio's `OutboundMark`).
pub const TPROXY_OUTBOUND_MARK: u32 = 1338;
