//! One proxy connection: hello, snapshot, then live requests, every exchange in send → ack lockstep.

use std::future::Future;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use crate::messages::{workload_request, workload_response, Version, WorkloadRequest, WorkloadResponse, ZdsHello};
use crate::transport::SeqpacketConn;
use crate::ZdsError;

use super::handle::ZdsHandle;
use super::snapshot::SnapshotSource;

/// Serves connection `id` until it closes or misbehaves; logs why it ended.
pub(super) async fn run(
    stream: SeqpacketConn,
    id: u64,
    handle: ZdsHandle,
    source: Arc<dyn SnapshotSource>,
    io_timeout: Duration,
) {
    match serve(&stream, id, &handle, source.as_ref(), io_timeout).await {
        Ok(()) => tracing::info!(conn = id, "node proxy disconnected from ZDS"),
        Err(e) => tracing::error!(conn = id, error = %e, "dropping ZDS connection"),
    }
}

async fn serve(
    stream: &SeqpacketConn,
    id: u64,
    handle: &ZdsHandle,
    source: &dyn SnapshotSource,
    io_timeout: Duration,
) -> Result<(), ZdsError> {
    let (hello, fds) = deadline(io_timeout, "read of the hello", stream.recv_msg::<ZdsHello>("ZdsHello")).await?;
    if !fds.is_empty() {
        return Err(ZdsError::Protocol(format!("hello carried {} fds", fds.len())));
    }
    if hello.version != Version::V1 as i32 {
        return Err(ZdsError::Protocol(format!("hello with unsupported version {}", hello.version)));
    }
    // Listed before the snapshot is taken, so a pod enrolled meanwhile is either in the snapshot or queued.
    let (_registration, mut commands) = handle.register(id);
    tracing::info!(conn = id, "node proxy connected to ZDS; sending snapshot");

    let snapshot = source.snapshot();
    let pods = snapshot.len();
    for pod in snapshot {
        let request = match &pod.netns {
            Some(_) => WorkloadRequest::add(&pod.uid, pod.info),
            None => WorkloadRequest::keep(&pod.uid),
        };
        let fd = pod.netns.as_deref().map(AsFd::as_fd);
        tolerate_nack(id, &pod.uid, exchange(stream, &request, fd, io_timeout).await)?;
    }
    let sent = exchange(stream, &WorkloadRequest::snapshot_sent(), None, io_timeout).await;
    tolerate_nack(id, "SnapshotSent", sent)?;
    tracing::info!(conn = id, pods, "ZDS snapshot sent");

    loop {
        tokio::select! {
            command = commands.recv() => {
                // The registry keeps a sender for as long as `_registration` lives.
                let Some(command) = command else { return Ok(()) };
                // An Add whose caller stopped waiting (its enrollment ran past the plugin's deadline and is being
                // rolled back) is not sent: the pod's netns handle goes now, not after the queue ahead of it.
                if command.reply.is_closed() && matches!(command.request.payload, Some(workload_request::Payload::Add(_))) {
                    tracing::debug!(conn = id, "AddWorkload abandoned by its caller before it was sent: dropped");
                    continue;
                }
                let result = exchange(stream, &command.request, command.fd.as_ref().map(AsFd::as_fd), io_timeout).await;
                let fatal = match &result {
                    Ok(()) => None,
                    Err(ZdsError::Nack(reason)) => {
                        tracing::warn!(conn = id, request = describe(&command.request), reason, "node proxy refused");
                        None
                    }
                    Err(e) => Some(e.duplicate()),
                };
                let _ = command.reply.send(result);
                if let Some(error) = fatal {
                    return Err(error);
                }
            }
            // Idle: readability is the keepalive. A hang-up shows at once as end of stream; anything the
            // proxy says unasked breaks the lockstep.
            received = stream.recv() => {
                return match received {
                    Err(ZdsError::PeerClosed) => Ok(()),
                    Err(e) => Err(e),
                    Ok((bytes, _fds)) => Err(ZdsError::Protocol(format!(
                        "unsolicited {}-byte message while idle", bytes.len()
                    ))),
                };
            }
        }
    }
}

/// A refused snapshot entry is the proxy's to retry; only transport and protocol failures end the connection.
fn tolerate_nack(id: u64, what: &str, result: Result<(), ZdsError>) -> Result<(), ZdsError> {
    match result {
        Err(ZdsError::Nack(reason)) => {
            tracing::warn!(conn = id, what, reason, "node proxy refused a snapshot entry");
            Ok(())
        }
        other => other,
    }
}

/// Sends one request (with its fd) and waits for its ack, each step under the deadline.
async fn exchange(
    stream: &SeqpacketConn,
    request: &WorkloadRequest,
    fd: Option<BorrowedFd<'_>>,
    io_timeout: Duration,
) -> Result<(), ZdsError> {
    deadline(io_timeout, "write", stream.send_msg(request, fd)).await?;
    let (response, fds) =
        deadline(io_timeout, "wait for the ack", stream.recv_msg::<WorkloadResponse>("WorkloadResponse")).await?;
    if !fds.is_empty() {
        return Err(ZdsError::Protocol(format!("ack carried {} fds", fds.len())));
    }
    match response.payload {
        Some(workload_response::Payload::Ack(ack)) if ack.error.is_empty() => Ok(()),
        Some(workload_response::Payload::Ack(ack)) => Err(ZdsError::Nack(ack.error)),
        None => Err(ZdsError::Protocol("response without an ack".into())),
    }
}

async fn deadline<T>(
    after: Duration,
    op: &'static str,
    fut: impl Future<Output = Result<T, ZdsError>>,
) -> Result<T, ZdsError> {
    tokio::time::timeout(after, fut).await.map_err(|_| ZdsError::Timeout { op, after })?
}

fn describe(request: &WorkloadRequest) -> &'static str {
    match request.payload {
        Some(workload_request::Payload::Add(_)) => "AddWorkload",
        Some(workload_request::Payload::Del(_)) => "DelWorkload",
        Some(workload_request::Payload::Keep(_)) => "KeepWorkload",
        Some(workload_request::Payload::SnapshotSent(_)) => "SnapshotSent",
        None => "empty request",
    }
}
