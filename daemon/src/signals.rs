//! Waiting for the signals the kubelet and a terminal send to stop a process.

use tokio::signal::unix::{signal, SignalKind};

use crate::Error;

/// Which signal asked the process to stop, so the binary can log why it is shutting down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownSignal {
    /// `SIGTERM`: the kubelet (or `kill`) asks the pod to terminate.
    Terminate,
    /// `SIGINT`: Ctrl-C when run by hand.
    Interrupt,
}

/// Resolves when the process receives SIGTERM or SIGINT, so `main` can start a drain instead of dying
/// mid-work. Both handlers are installed before the first `.await` point returns, and stay installed
/// for the life of the process (a later signal no longer kills it; call this again to observe it).
pub async fn shutdown_signal() -> Result<ShutdownSignal, Error> {
    let mut term = signal(SignalKind::terminate()).map_err(|source| Error::Signal { signal: "SIGTERM", source })?;
    let mut int = signal(SignalKind::interrupt()).map_err(|source| Error::Signal { signal: "SIGINT", source })?;
    tokio::select! {
        _ = term.recv() => Ok(ShutdownSignal::Terminate),
        _ = int.recv() => Ok(ShutdownSignal::Interrupt),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Sends `sig` to this test process with the system `kill`, as the kubelet would.
    fn kill_self(sig: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(std::process::id().to_string())
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -{sig} failed: {status}");
    }

    /// Polls `fut` once so its handlers are installed before a signal is sent.
    async fn install<F: std::future::Future + Unpin>(fut: &mut F) {
        tokio::select! {
            biased;
            _ = fut => panic!("shutdown_signal resolved before any signal was sent"),
            _ = std::future::ready(()) => {}
        }
    }

    // Both signals in one test: a signal reaches every listener in the process, so two tests in
    // parallel would see each other's signals.
    #[tokio::test]
    async fn resolves_on_sigterm_and_sigint() {
        for (sig, expected) in [("TERM", ShutdownSignal::Terminate), ("INT", ShutdownSignal::Interrupt)] {
            let mut fut = Box::pin(shutdown_signal());
            install(&mut fut).await;
            kill_self(sig);
            let got = tokio::time::timeout(Duration::from_secs(10), fut)
                .await
                .unwrap_or_else(|_| panic!("SIG{sig} not observed within 10s"))
                .expect("installing handlers");
            assert_eq!(got, expected);
        }
    }
}
