//! CNI protocol types shared by the plugin and the test runtime: commands and their environment,
//! `CNI_ARGS`, spec versions, result conversion between versions, and errors with the spec's codes.

pub mod args;
pub mod command;
pub mod error;
pub mod plugin_event;
pub mod result;
pub mod version;

pub use args::CniArgs;
pub use command::{Command, Invocation};
pub use error::{CniError, ErrorCode};
pub use version::{Version, SUPPORTED_VERSIONS};
