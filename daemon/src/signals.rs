//! Waiting for the signals the kubelet and a terminal send to stop a process.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

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

/// Resolves on the first SIGTERM or SIGINT after [`shutdown_signal`] installed the handlers; a named type so the
/// shared main can hand it to the binary.
pub struct Shutdown(Pin<Box<dyn Future<Output = ShutdownSignal> + Send>>);

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shutdown")
    }
}

impl Future for Shutdown {
    type Output = ShutdownSignal;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ShutdownSignal> {
        self.0.as_mut().poll(cx)
    }
}

/// Installs SIGTERM and SIGINT handlers right away and returns a future that resolves on the first of them, so
/// `main` can start a drain instead of dying mid-work. A signal that arrives before the future is polled (say,
/// during a long startup step) is not lost. The handlers stay installed for the life of the process.
pub fn shutdown_signal() -> Result<Shutdown, Error> {
    let mut term = signal(SignalKind::terminate()).map_err(|source| Error::Signal { signal: "SIGTERM", source })?;
    let mut int = signal(SignalKind::interrupt()).map_err(|source| Error::Signal { signal: "SIGINT", source })?;
    Ok(Shutdown(Box::pin(async move {
        tokio::select! {
            _ = term.recv() => ShutdownSignal::Terminate,
            _ = int.recv() => ShutdownSignal::Interrupt,
        }
    })))
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

    // Both signals in one test: a signal reaches every listener in the process, so two tests in
    // parallel would see each other's signals.
    #[tokio::test]
    async fn resolves_on_sigterm_and_sigint() {
        for (sig, expected) in [("TERM", ShutdownSignal::Terminate), ("INT", ShutdownSignal::Interrupt)] {
            // Handlers are live as soon as shutdown_signal returns, before the future is first polled.
            let fut = shutdown_signal().expect("installing handlers");
            kill_self(sig);
            let got = tokio::time::timeout(Duration::from_secs(10), fut)
                .await
                .unwrap_or_else(|_| panic!("SIG{sig} not observed within 10s"));
            assert_eq!(got, expected);
        }
    }
}
