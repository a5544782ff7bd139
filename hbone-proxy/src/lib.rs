//! The parts of the node proxy that build without its runtime, as a library: the binary (`src/main.rs`, behind
//! the default `runtime` feature) uses them as `crate::directory` and `crate::dns::wire`, and the fuzz targets
//! build their parsers (the local workload file's, the DNS forwarder's wire parser) without the runtime, as a
//! dependency.

#![warn(missing_docs)]

#[cfg(feature = "runtime")]
pub mod authorization;
pub mod directory;

/// The DNS forwarder's parts that need no runtime; the forwarder itself is the binary's `dns` module.
pub mod dns {
    pub mod wire;
}
