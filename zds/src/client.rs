//! The proxy side of ZDS: connect, say hello, then answer every request with exactly one ack.
//!
//! This is deliberately thin: it hands each request and its fds to the caller, who decides and acks. The node
//! proxy builds its snapshot/reconcile logic on top; tests use it as the "test ZDS peer".

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use crate::messages::{WorkloadRequest, WorkloadResponse, ZdsHello};
use crate::transport::SeqpacketConn;
use crate::ZdsError;

/// Deadline of the client's own writes (hello and acks), as on the agent's side.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to the agent's ZDS socket.
#[derive(Debug)]
pub struct ZdsClient {
    stream: SeqpacketConn,
}

impl ZdsClient {
    /// Connects to the agent at `path` and sends `ZdsHello{version: V1}`.
    pub async fn connect(path: &Path) -> Result<ZdsClient, ZdsError> {
        let stream = SeqpacketConn::connect(path).await?;
        write(&stream, &ZdsHello::v1()).await?;
        Ok(ZdsClient { stream })
    }

    /// Waits (without deadline: the agent may be idle for long) for the next request and its fds.
    ///
    /// An `AddWorkload` should carry exactly one fd, the pod netns; checking that is the caller's job, so it
    /// can answer with an error ack. [`ZdsError::PeerClosed`] means the agent went away.
    pub async fn recv(&self) -> Result<(WorkloadRequest, Vec<OwnedFd>), ZdsError> {
        self.stream.recv_msg::<WorkloadRequest>("WorkloadRequest").await
    }

    /// Acknowledges the last request: `None` for success, `Some(reason)` for failure.
    pub async fn ack(&self, error: Option<String>) -> Result<(), ZdsError> {
        write(&self.stream, &WorkloadResponse::ack(error)).await
    }

    /// The underlying connection, for peers that need to step outside the protocol (tests of bad peers).
    pub fn stream(&self) -> &SeqpacketConn {
        &self.stream
    }
}

async fn write(stream: &SeqpacketConn, msg: &impl prost::Message) -> Result<(), ZdsError> {
    tokio::time::timeout(WRITE_TIMEOUT, stream.send_msg(msg, None))
        .await
        .map_err(|_| ZdsError::Timeout { op: "write", after: WRITE_TIMEOUT })?
}
