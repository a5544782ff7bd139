//! HBONE transport for the node proxy: SPIFFE identities, the mesh CA, mutual TLS 1.3 configs and
//! HTTP/2 CONNECT tunnels (a pooled client and a server), wire-compatible with Istio's ztunnel.

//!
//! Everything but [`identity`] and [`connect`] needs the default `runtime` feature (tokio, rustls, h2); without it
//! the crate is those two pure modules alone, which is what the fuzz targets build.

#![warn(missing_docs)]

#[cfg(feature = "runtime")]
pub mod budget;
#[cfg(feature = "runtime")]
pub mod ca;
pub mod connect;
#[cfg(feature = "runtime")]
pub mod copy;
#[cfg(feature = "runtime")]
pub mod headers;
pub mod identity;
#[cfg(feature = "runtime")]
pub mod keepalive;
#[cfg(feature = "runtime")]
pub mod limits;
#[cfg(feature = "runtime")]
pub mod pool;
#[cfg(feature = "runtime")]
pub mod server;
#[cfg(feature = "runtime")]
pub mod settings;
#[cfg(feature = "runtime")]
pub mod stream;
#[cfg(feature = "runtime")]
pub mod tls;

#[cfg(feature = "runtime")]
pub use budget::{Account, MemoryBudget};
#[cfg(feature = "runtime")]
pub use ca::{CaError, MeshCa, WorkloadCert};
#[cfg(feature = "runtime")]
pub use headers::Baggage;
pub use identity::{Identity, IdentityError};
#[cfg(feature = "runtime")]
pub use keepalive::Keepalive;
#[cfg(feature = "runtime")]
pub use limits::{ConnectionCaps, ConnectionLimiter, ConnectionPermit, OverCap};
#[cfg(feature = "runtime")]
pub use pool::{ConnectError, ConnectObserver, ConnectRequest, Dialer, Pool, PoolConfig};
#[cfg(feature = "runtime")]
pub use server::{
    refuse, serve, serve_budgeted, ConnectHandler, Ended, InboundRequest, ServeError, ServeOptions, Transfer,
};
#[cfg(feature = "runtime")]
pub use stream::H2Stream;
#[cfg(feature = "runtime")]
pub use tls::{Accepted, InboundTls, MeshTls, ServerCerts, TlsError};
