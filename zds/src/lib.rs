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
//!
//! Everything but [`messages`] needs the default `runtime` feature (tokio and the socket); without it the crate is
//! the messages alone, which is what the fuzz targets build.

#![warn(missing_docs)]

#[cfg(feature = "runtime")]
pub mod client;
#[cfg(feature = "runtime")]
mod error;
pub mod messages;
#[cfg(feature = "runtime")]
pub mod server;
#[cfg(feature = "runtime")]
pub mod transport;

#[cfg(feature = "runtime")]
pub use client::ZdsClient;
#[cfg(feature = "runtime")]
pub use error::ZdsError;
#[cfg(feature = "runtime")]
pub use server::{PodSnapshotEntry, ServerConfig, SnapshotSource, ZdsHandle, ZdsServer};
