//! The shape every long-running binary of the node side (install-cni, the node agent and the HBONE node proxy)
//! shares: one `main` skeleton ([`lifecycle`]: settings, logging, runtime, signals, probes, drain with a
//! deadline), structured logging, a drain primitive for orderly shutdown, the SIGTERM/SIGINT listener, one
//! drain-aware accept loop and HTTP/1 server that every endpoint runs on, and the health/readiness/metrics
//! endpoints the kubelet and Prometheus scrape, with readiness made of named blockers, and the log throttle for
//! whatever a peer can repeat.

pub mod common_args;
pub mod drain;
mod error;
pub mod http;
pub mod lifecycle;
pub mod listener;
pub mod logging;
pub mod probes;
pub mod signals;
pub mod throttle;

pub use error::Error;
