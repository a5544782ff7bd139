//! Receives the plugin's log lines on `<run dir>/log.sock` and logs them again, so a pod's CNI story shows up in
//! `kubectl logs` of the agent (the plugin itself runs outside any pod, where nobody reads its stderr).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use daemon::drain::DrainWatcher;
use tokio::io::AsyncBufReadExt;

/// File name of the socket, Istio's.
pub const LOG_SOCKET: &str = "log.sock";
/// A line longer than this is cut: a misbehaving writer must not grow the agent's memory.
const MAX_LINE: usize = 16 * 1024;

/// Binds the socket (a stale one is replaced; mode 0666 like the event socket, since the plugin runs as the
/// container runtime's user).
pub fn bind(run_dir: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let path = run_dir.join(LOG_SOCKET);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// Relays every line of every connection as an `info` event with target `istio_cni_plugin`.
pub async fn serve(listener: tokio::net::UnixListener, drain: DrainWatcher) {
    loop {
        let stream = tokio::select! {
            _ = drain.signaled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "plugin log socket accept");
                    continue;
                }
            },
        };
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stream).lines();
            while let Ok(Some(mut line)) = lines.next_line().await {
                line.truncate(MAX_LINE);
                tracing::info!(target: "istio_cni_plugin", "{line}");
            }
        });
    }
}
