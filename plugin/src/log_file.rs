//! Where the plugin's log file lives and how large it may grow. The run directory is RAM-backed and every pod
//! ADD and DEL appends to the file, so it is capped: once the next line would take `istio-cni.log` past
//! [`MAX_BYTES`], it is renamed to [`ROTATED_NAME`] (replacing the previous one) and a fresh file is started. The
//! plugin's logs therefore take at most `2 × MAX_BYTES` (plus one line) of the node's memory.

/// Name of the plugin's log file inside the run directory.
pub const NAME: &str = "istio-cni.log";
/// Name the full log file is renamed to when it is rotated; it holds the older lines.
pub const ROTATED_NAME: &str = "istio-cni.log.1";
/// Cap of each of the two files, in bytes (1 MiB): a line that would take the log file past it starts a new one.
pub const MAX_BYTES: u64 = 1 << 20;
