//! The in-pod DNS forwarder on [`ports::DNS`](istio_contract::ports::DNS). The in-pod rules redirect the pod's DNS
//! (UDP and TCP port 53) here by default, so without it an enrolled pod cannot resolve names. Each query is
//! relayed to the upstream resolvers from inside the pod netns (source: the pod IP; the proxy mark, so the rules
//! do not capture it again), and the answer goes back. A query no upstream answers in time gets SERVFAIL instead
//! of silence, so clients fail fast rather than retrying into their own timeouts.
//!
//! Everything a pod can make the forwarder hold is bounded per pod, so one pod flooding it cannot starve others:
//! - At most [`MAX_IN_FLIGHT`] queries of a pod are in flight (UDP and TCP together, from admission until the
//!   answer is handed back); more are dropped and counted. A slot comes back when its query is answered, or after
//!   [`QUERY_TIMEOUT`] at the latest.
//! - Upstream sockets are reused. Each pod has one connected UDP socket per upstream, made in the pod's netns
//!   on a socket thread ([`PodNetns`](crate::sockets::PodNetns)); every UDP query of the pod goes through it with its
//!   id remapped to a random free one, and an answer is taken only from that upstream, with that id and echoing
//!   the question. Over TCP, each client connection gets one upstream connection per upstream, carrying all of its
//!   queries the same way.
//! - Buffers are sized to messages: a query is at most [`MAX_UDP_PAYLOAD`] bytes, and a UDP answer is relayed up
//!   to the size its query allows (the EDNS0 UDP payload size, at most [`MAX_UDP_PAYLOAD`]; 512 without EDNS). A
//!   longer one is cut to its question with TC set, so the client retries over TCP.
//! - At most [`MAX_TCP_CONNECTIONS`] client TCP connections per pod (more are reset at once), each with at most
//!   [`MAX_TCP_PIPELINE`] queries in flight: the connection is not read further until one of them is answered.
//!
//! Messages are opaque bytes except for the header (id, QR, TC, RCODE, counts), the question section (compared
//! and echoed) and the OPT record's UDP payload size (read, and lowered to [`MAX_UDP_PAYLOAD`] when larger).
//!
//! [`MAX_IN_FLIGHT`]: forwarder::MAX_IN_FLIGHT
//! [`QUERY_TIMEOUT`]: forwarder::QUERY_TIMEOUT
//! [`MAX_TCP_CONNECTIONS`]: forwarder::MAX_TCP_CONNECTIONS
//! [`MAX_TCP_PIPELINE`]: forwarder::MAX_TCP_PIPELINE
//! [`MAX_UDP_PAYLOAD`]: wire::MAX_UDP_PAYLOAD
//!
//! One job per module, each stating what it guarantees:
//! - [`forwarder`]: one pod's forwarder, its bounds, and serving its UDP socket and TCP connections;
//! - [`wire`]: the wire parser (in the library, `hbone_proxy::dns::wire`, so the fuzz targets build it);
//! - [`upstreams`]: which resolvers, from `DNS_UPSTREAMS` or the host's resolv.conf;
//! - [`ids`]: id remapping, and which upstream answer belongs to which query;
//! - [`transport`]: exchanging a query with one upstream over UDP or TCP, and TCP's framing.
//!
//! The forwarder's marked UDP sockets are made with the proxy's other marked sockets, in [`crate::sockets`].

mod forwarder;
mod ids;
mod transport;
// Named by its path (`dns::upstreams::Upstreams`), not re-exported: the flags and the mesh need only the upstreams,
// and through this module they would depend on the forwarder and all it uses.
pub mod upstreams;

pub use forwarder::{listen_addrs, serve_tcp, serve_udp, Forwarder};
pub use hbone_proxy::dns::wire;
