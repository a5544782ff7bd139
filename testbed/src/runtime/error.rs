//! Errors of the fake CNI runtime, shaped so tests can assert on what a real runtime would report.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use netns::NetnsError;

/// A plugin exited non-zero; its stdout error JSON (`{cniVersion, code, msg, details}`) parsed when possible.
///
/// Tests assert on `code` and `msg` the way a kubelet user would see them in pod events.
#[derive(Debug, Clone)]
pub struct PluginError {
    /// Plugin `type` (binary name) that failed.
    pub plugin: String,
    /// The spec error code, if stdout held an error object.
    pub code: Option<u64>,
    /// The error message (`msg`), empty if absent.
    pub msg: String,
    /// The error details (`details`), empty if absent.
    pub details: String,
    /// Exit code, `None` if killed by a signal.
    pub exit: Option<i32>,
    /// Raw stdout.
    pub stdout: String,
    /// Raw stderr (plugin logs).
    pub stderr: String,
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "plugin {} failed (exit {:?}, code {:?}): {}", self.plugin, self.exit, self.code, self.msg)?;
        if !self.details.is_empty() {
            write!(f, "; details: {}", self.details)?;
        }
        if self.code.is_none() {
            write!(f, "; stdout: {}", self.stdout)?;
        }
        if !self.stderr.is_empty() {
            write!(f, "; stderr: {}", self.stderr)?;
        }
        Ok(())
    }
}

impl std::error::Error for PluginError {}

/// Everything that can go wrong while the fake runtime drives plugins.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The network configuration list could not be read or is malformed.
    #[error("network config {source_name}: {reason}")]
    Config {
        /// File path or description of where the config came from.
        source_name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No bin dir holds the plugin named by a config's `type`.
    #[error("plugin {plugin} not found in {dirs:?}")]
    PluginNotFound {
        /// Plugin `type`.
        plugin: String,
        /// Dirs searched.
        dirs: Vec<PathBuf>,
    },
    /// The plugin binary could not be started.
    #[error("spawn {}: {source}", bin.display())]
    Spawn {
        /// Binary path.
        bin: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The runtime's own netns could not be entered to spawn the plugin.
    #[error("enter runtime netns: {0}")]
    Netns(#[from] NetnsError),
    /// The plugin did not finish in time and was killed.
    #[error("plugin {} killed after {after:?}; stdout: {stdout}; stderr: {stderr}", bin.display())]
    Timeout {
        /// Binary path.
        bin: PathBuf,
        /// The deadline that passed.
        after: Duration,
        /// Stdout read before the kill.
        stdout: String,
        /// Stderr read before the kill.
        stderr: String,
    },
    /// The plugin failed (non-zero exit).
    #[error(transparent)]
    Plugin(#[from] Box<PluginError>),
    /// The plugin succeeded but its stdout is not a valid result.
    #[error("plugin {plugin} printed an invalid result ({reason}): {stdout}")]
    BadResult {
        /// Plugin `type`.
        plugin: String,
        /// Parse error.
        reason: String,
        /// Raw stdout.
        stdout: String,
    },
    /// The cached result could not be read back in the list's version (libcni's "failed to get network
    /// cached result"): CHECK fails with it; DEL drops the entry and runs without a prevResult.
    #[error("failed to get network {network:?} cached result: {reason}")]
    CachedResult {
        /// Network name.
        network: String,
        /// Why (unparsable entry, or no conversion to the list's version).
        reason: String,
    },
    /// GC ran every DEL and every plugin's GC it could and some failed; like libcni's joined errors, one
    /// line each.
    #[error("{}", .0.iter().map(|(what, e)| format!("{what}: {e}")).collect::<Vec<_>>().join("\n"))]
    Gc(Vec<(String, RuntimeError)>),
    /// Reading or writing the result cache failed.
    #[error("result cache {}: {reason}", path.display())]
    Cache {
        /// Cache file or dir.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
}
