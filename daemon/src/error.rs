use std::net::SocketAddr;
use std::path::PathBuf;

/// Everything that can fail while setting up the daemon plumbing, each naming what was being set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A server could not listen on its address (in use, not local, no permission).
    #[error("binding {addr}")]
    Bind {
        /// The address that could not be bound.
        addr: SocketAddr,
        /// Why the kernel refused it.
        #[source]
        source: std::io::Error,
    },
    /// A server could not listen on its unix socket (no such directory, no permission, stale file in the way).
    #[error("binding the unix socket {}", path.display())]
    BindUnix {
        /// The socket path.
        path: PathBuf,
        /// Why it could not be created.
        #[source]
        source: std::io::Error,
    },
    /// A shutdown signal handler could not be installed, so the process could not be stopped cleanly.
    #[error("listening for {signal}")]
    Signal {
        /// The signal whose handler failed (`SIGTERM` or `SIGINT`).
        signal: &'static str,
        /// Why tokio could not register it.
        #[source]
        source: std::io::Error,
    },
}
