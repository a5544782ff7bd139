//! The `istio-cni` plugin's netconf parser, as a library: the binary (`src/main.rs`, behind the default `runtime`
//! feature) uses it as `crate::config`, and the fuzz targets build it without the runtime, as a dependency. It
//! also names the plugin's log file and its cap ([`log_file`]), which the binary and its tests share.

#![warn(missing_docs)]

pub mod config;
pub mod log_file;
