//! The agent side of ZDS: accept node-proxy connections, send each a snapshot of enrolled pods, then stream
//! live Adds and Dels in send → ack lockstep.
//!
//! Each connection runs in its own task ([`conn`]). The node agent talks to those tasks through a
//! [`ZdsHandle`], which routes an Add to the newest connection and a Del to all of them, so a draining proxy
//! lets go of deleted pods too.

mod conn;
mod handle;
mod snapshot;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use crate::transport::SeqpacketListener;
use crate::ZdsError;

pub use handle::ZdsHandle;
pub use snapshot::{PodSnapshotEntry, SnapshotSource};

/// Tunables of the server; the defaults are Istio's.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Deadline of every single read and write on a connection (Istio: 5 s). Tests shorten it.
    pub io_timeout: Duration,
    /// File mode of the socket. It must not be world-writable: whoever connects receives pod netns handles.
    pub socket_mode: u32,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig { io_timeout: Duration::from_secs(5), socket_mode: 0o770 }
    }
}

/// The ZDS listener of the node agent. Bind it, take [`ZdsHandle`]s, then run [`ZdsServer::serve`].
pub struct ZdsServer {
    listener: SeqpacketListener,
    config: ServerConfig,
    handle: ZdsHandle,
}

impl ZdsServer {
    /// Binds the socket at `path` (removing a stale one, creating missing parent directories).
    pub async fn bind(path: &Path, config: ServerConfig) -> Result<ZdsServer, ZdsError> {
        let listener = SeqpacketListener::bind(path, config.socket_mode)?;
        Ok(ZdsServer { listener, config, handle: ZdsHandle::new() })
    }

    /// A handle for sending Adds and Dels; cheap to clone, valid before and while serving.
    pub fn handle(&self) -> ZdsHandle {
        self.handle.clone()
    }

    /// Accepts and serves proxy connections until `shutdown` completes, then closes them all.
    ///
    /// A connection that misbehaves (no hello, wrong message, truncated datagram, missed deadline) is logged
    /// and dropped; the others go on.
    pub async fn serve(self, snapshot: Arc<dyn SnapshotSource>, shutdown: impl Future<Output = ()>) {
        let mut tasks = JoinSet::new();
        let mut next_id: u64 = 0;
        tokio::pin!(shutdown);
        tracing::info!(path = %self.listener.path().display(), "serving ZDS");
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = self.listener.accept() => match accepted {
                    Ok(stream) => {
                        next_id += 1;
                        tasks.spawn(conn::run(
                            stream,
                            next_id,
                            self.handle.clone(),
                            snapshot.clone(),
                            self.config.io_timeout,
                        ));
                    }
                    Err(e) => {
                        // E.g. EMFILE: back off instead of spinning on a listener that stays readable.
                        tracing::error!(error = %e, "accepting a ZDS connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        tasks.shutdown().await;
        tracing::info!(path = %self.listener.path().display(), "ZDS server stopped");
    }
}
