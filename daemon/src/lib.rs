//! The small shape every long-running binary of the node side shares (install-cni now, the node agent
//! and the HBONE proxy later): structured logging, a drain primitive for orderly shutdown, the
//! SIGTERM/SIGINT listener, and the health/readiness/metrics HTTP server the kubelet and Prometheus
//! scrape.

pub mod common_args;
pub mod drain;
mod error;
pub mod logging;
pub mod probes;
pub mod signals;

pub use error::Error;
