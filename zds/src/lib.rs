//! The ZDS protocol ("ztunnel discovery service") between the node agent and the node proxy.
//!
//! The agent listens on an `AF_UNIX` `SOCK_SEQPACKET` socket; the proxy connects and says hello; the agent then
//! streams each enrolled pod's network namespace as a file descriptor (`SCM_RIGHTS`), one protobuf message per
//! datagram, in strict send → ack lockstep. This crate is the one home of that protocol and is wire-compatible
//! with Istio's ztunnel:
//!
//! * [`messages`]: the protobuf messages of package `istio.workload.zds`;
//! * [`transport`]: the seqpacket socket with fd passing, deadlines not included;
//! * [`server`]: the agent side ([`ZdsServer`], [`ZdsHandle`]);
//! * [`client`]: the proxy side ([`ZdsClient`]), also used by tests as a test peer.

#![warn(missing_docs)]

pub mod client;
mod error;
pub mod messages;
pub mod server;
pub mod transport;

pub use client::ZdsClient;
pub use error::ZdsError;
pub use server::{PodSnapshotEntry, ServerConfig, SnapshotSource, ZdsHandle, ZdsServer};
