//! How the proxy's own traffic is told apart from the apps': a socket mark in ambient, a uid/gid in a sidecar.
//! Rules skip traffic that carries them, so a mismatch is a redirect loop.

/// Mark ztunnel (and our proxy) sets on its own sockets (1337); in-pod rules never redirect it.
pub const PROXY_MARK: u32 = 0x539;
/// Uid a sidecar's proxy runs as unless its container says otherwise.
pub const PROXY_UID: u32 = 1337;
/// Gid a sidecar's proxy runs as unless its container says otherwise.
pub const PROXY_GID: u32 = 1337;
/// Mark a sidecar's TPROXY rules set on inbound packets (Istio's `InboundTProxyMark`).
pub const TPROXY_MARK: u32 = 1337;
/// Mark a sidecar proxy's own loopback traffic gets in TPROXY mode (Istio's `OutboundMark`).
pub const TPROXY_OUTBOUND_MARK: u32 = 1338;
