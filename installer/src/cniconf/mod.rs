//! The CNI config side of install-cni: building our `istio-cni` plugin entry, finding the primary
//! config the kubelet uses, merging our entry into it (or writing an owned/standalone file), the
//! validity check behind readiness, finishing a conversion a crash interrupted, and cleanup. Output
//! matches Istio's byte for byte.

mod check;
mod complete;
mod discover;
mod entry;
mod error;
mod json;
mod plan;

pub use check::{check, Invalid};
pub use complete::complete_conversions;
pub use discover::find_primary;
pub use entry::{PluginEntry, PLUGIN_TYPE};
pub use error::{ConfError, Malformed};
pub use json::{insert, remove_entry, standalone, ConfForm};
pub use plan::{
    apply, cleanup, desired, strip_file, Change, ConfSettings, Desired, DEFAULT_OWNED_FILENAME,
    DEFAULT_STANDALONE_FILENAME, NEW_FILE_MODE,
};
