use std::net::SocketAddr;

/// Everything that can fail while setting up the daemon plumbing, each naming what was being set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The probe server could not listen on its address (in use, not local, no permission).
    #[error("binding the probe server to {addr}")]
    Bind {
        /// The address that could not be bound.
        addr: SocketAddr,
        /// Why the kernel refused it.
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
