//! HBONE transport for the node proxy: SPIFFE identities, the mesh CA, mutual TLS 1.3 configs and
//! HTTP/2 CONNECT tunnels (a pooled client and a server), wire-compatible with Istio's ztunnel.

#![warn(missing_docs)]

pub mod ca;
mod connect;
mod counting;
pub mod headers;
pub mod identity;
pub mod keepalive;
pub mod pool;
pub mod server;
pub mod settings;
pub mod stream;
pub mod tls;

pub use ca::{CaError, MeshCa, WorkloadCert};
pub use headers::Baggage;
pub use identity::{Identity, IdentityError};
pub use keepalive::Keepalive;
pub use pool::{ConnectError, ConnectObserver, ConnectRequest, Dialer, Pool, PoolConfig};
pub use server::{serve, ConnectHandler, InboundRequest, ServeError, ServeOptions, Transfer};
pub use stream::H2Stream;
pub use tls::{Accepted, InboundTls, MeshTls, ServerCerts, TlsError};
