//! The two unix sockets the plugin talks to (events and logs) are created the same way, as Istio does, and share
//! one connection cap; both are served by the daemon's accept loop.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use tokio::net::UnixListener;

/// Plugin connections served at once per socket: each is one CNI ADD (or one plugin run's log lines), so this is
/// well above the pods a node runs (110 by default) starting together.
pub const MAX_CONNECTIONS: usize = 256;

/// Creates `<run_dir>/<name>` as Istio does: the dir at mode 0750, a stale socket removed, the socket at mode 0666
/// (the plugin runs as the container runtime's user).
pub fn bind(run_dir: &Path, name: &str) -> anyhow::Result<(UnixListener, PathBuf)> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o750))
        .with_context(|| format!("setting the mode of {}", run_dir.display()))?;
    let path = run_dir.join(name);
    let listener = daemon::listener::bind_unix(&path, 0o666)?;
    Ok((listener, path))
}
