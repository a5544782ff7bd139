use std::io;
use std::path::PathBuf;

/// Why a CNI config's content cannot be used, independent of where it came from.
#[derive(Debug, thiserror::Error)]
pub enum Malformed {
    /// The bytes are not JSON.
    #[error("not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    /// The top-level value is not an object.
    #[error("not a JSON object")]
    NotObject,
    /// A single-plugin config without a non-empty string `type`.
    #[error("no plugin \"type\"")]
    NoType,
    /// A config list without a string `name`.
    #[error("config list has no \"name\"")]
    NoName,
    /// A config list without a `plugins` array.
    #[error("no \"plugins\" array")]
    NoPluginList,
    /// A config list whose `plugins` array is empty.
    #[error("\"plugins\" is empty")]
    EmptyPluginList,
    /// An element of `plugins` is not an object.
    #[error("plugin {0} is not an object")]
    PluginNotObject(usize),
    /// An element of `plugins` has no non-empty string `type`.
    #[error("plugin {0} has no \"type\"")]
    PluginNoType(usize),
    /// A field the CNI spec types as a string holds something else.
    #[error("\"{0}\" is not a string")]
    NotString(&'static str),
}

/// Failure to plan, write or clean up a CNI config, naming the file and the reason.
#[derive(Debug, thiserror::Error)]
pub enum ConfError {
    /// The CNI config directory could not be listed.
    #[error("listing CNI config dir {path}: {source}")]
    ListDir {
        /// The file concerned.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// A config file could not be read (or its mode not read).
    #[error("reading CNI config {path}: {source}")]
    Read {
        /// The file concerned.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// A config file could not be written or renamed into place.
    #[error("writing CNI config {path}: {source}")]
    Write {
        /// The file concerned.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// A config file could not be deleted.
    #[error("removing CNI config {path}: {source}")]
    Remove {
        /// The file concerned.
        path: PathBuf,
        /// The underlying I/O error.
        source: io::Error,
    },
    /// A config file's content is unusable.
    #[error("CNI config {path}: {reason}")]
    Malformed {
        /// The file concerned.
        path: PathBuf,
        /// What is wrong with its content.
        reason: Malformed,
    },
}
