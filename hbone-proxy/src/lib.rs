//! The node proxy's workload directory, as a library: the binary (`src/main.rs`, behind the default `runtime`
//! feature) uses it as `crate::directory`, and the fuzz targets build its local workload file parser without the
//! runtime, as a dependency.

#![warn(missing_docs)]

pub mod directory;
