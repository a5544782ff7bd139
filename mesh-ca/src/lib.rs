//! Certificates for the node's workload identities from istiod's CA, as Istio's ztunnel obtains them (issue #32).
//!
//! * [`wire`]: `IstioCertificateRequest`/`IstioCertificateResponse` (prost, byte-pinned);
//! * [`csr`]: a fresh ECDSA P-256 key and PKCS#10 request per certificate;
//! * [`chain`]: the bounded decoding and verification of istiod's chain (leaf, intermediates, root bundle last);
//! * [`certificate`]: a verified certificate with its key, in the form rustls presents;
//! * [`clock`]: the wall clock validity is judged by (tokio's, in tests);
//! * [`client`]: `CreateCertificate` with `ImpersonatedIdentity` over the `xds` channel;
//! * [`manager`]: one certificate per identity, warm-up, on-demand fetches, half-life refresh, backoff, at most 8
//!   requests in flight, a config-dump snapshot;
//! * [`permits`]: the in-flight bound, serving waiters by priority (on demand, warm-up, refresh);
//! * `testing` (feature `testing`): a fake istiod CA applying istiod's checks, in process or over TLS.
//!
//! Every response is treated as hostile: sizes and counts are bounded before allocation and the chain is verified
//! before a certificate is handed out. Without the default `runtime` feature the crate is [`wire`], [`csr`],
//! [`chain`] and [`certificate`], for the fuzz targets.

#![warn(missing_docs)]

pub mod certificate;
pub mod chain;
#[cfg(feature = "runtime")]
pub mod client;
#[cfg(feature = "runtime")]
pub mod clock;
pub mod csr;
#[cfg(feature = "runtime")]
pub mod manager;
#[cfg(feature = "runtime")]
pub mod permits;
#[cfg(feature = "testing")]
pub mod testing;
pub mod wire;

pub use certificate::WorkloadCertificate;
#[cfg(feature = "runtime")]
pub use client::{CaClient, FetchError, RequestSettings, Signer};
#[cfg(feature = "runtime")]
pub use manager::{CertificateManager, CertificateSnapshot, ManagerConfig};
