//! HBONE transport for the node proxy: SPIFFE identities, the mesh CA, mutual TLS 1.3 configs and
//! HTTP/2 CONNECT tunnels (a pooled client and a server), wire-compatible with Istio's ztunnel.

pub mod ca;
pub mod identity;

pub use ca::{CaError, MeshCa, WorkloadCert};
pub use identity::{Identity, IdentityError};
