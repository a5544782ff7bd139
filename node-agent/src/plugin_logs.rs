//! Receives the plugin's log lines on `<run dir>/log.sock` and logs them again, so a pod's CNI story shows up in
//! `kubectl logs` of the agent (the plugin itself runs outside any pod, where nobody reads its stderr).

use std::path::Path;

use daemon::drain::DrainWatcher;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

use crate::plugin_socket;

/// Longest piece of a line relayed at once, so a misbehaving writer cannot grow the agent's memory.
const MAX_LINE: usize = 16 * 1024;

/// Binds `<run dir>/log.sock`.
pub fn bind(run_dir: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    plugin_socket::bind(run_dir, istio_contract::paths::LOG_SOCKET).map(|(listener, _)| listener)
}

/// Relays every line of every connection as an `info` event with target `istio_cni_plugin`.
pub async fn serve(listener: tokio::net::UnixListener, drain: DrainWatcher) {
    let max = plugin_socket::MAX_CONNECTIONS;
    daemon::listener::serve(listener, "plugin logs", max, drain, |stream, _drain| async move {
        let mut reader = tokio::io::BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            // Reading at most MAX_LINE bytes at a time: a longer line arrives in pieces.
            match (&mut reader).take(MAX_LINE as u64).read_until(b'\n', &mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => tracing::info!(target: "istio_cni_plugin", "{}", String::from_utf8_lossy(&buf).trim_end()),
            }
        }
    })
    .await;
}
