//! The two unix sockets the plugin talks to (events and logs) share their setup and accept loop.

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use daemon::drain::DrainWatcher;
use tokio::net::{UnixListener, UnixStream};

/// Creates `<run_dir>/<name>` as Istio does: the dir at mode 0750, a stale socket removed, the socket at mode 0666
/// (the plugin runs as the container runtime's user).
pub fn bind(run_dir: &Path, name: &str) -> std::io::Result<(UnixListener, PathBuf)> {
    std::fs::create_dir_all(run_dir)?;
    std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o750))?;
    let path = run_dir.join(name);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    Ok((listener, path))
}

/// Accepts until the drain starts; each connection runs `handle` on its own task, holding the drain open.
pub async fn accept_until_drained<F, Fut>(listener: UnixListener, drain: DrainWatcher, what: &'static str, handle: F)
where
    F: Fn(UnixStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        let stream = tokio::select! {
            _ = drain.signaled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, socket = what, "accept");
                    continue;
                }
            },
        };
        let guard = drain.guard();
        let work = handle(stream);
        tokio::spawn(async move {
            work.await;
            drop(guard);
        });
    }
}
