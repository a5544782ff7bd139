//! [`ZdsHandle`]: how the node agent reaches the live proxy connections.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot, watch};

use crate::messages::{WorkloadInfo, WorkloadRequest};
use crate::ZdsError;

/// Queue depth per connection; callers wait when a connection falls this far behind.
const COMMAND_QUEUE: usize = 128;

/// A request for one connection task, answered once the proxy acked it (or the exchange failed).
pub(super) struct Command {
    pub(super) request: WorkloadRequest,
    pub(super) fd: Option<OwnedFd>,
    pub(super) reply: oneshot::Sender<Result<(), ZdsError>>,
}

struct Entry {
    id: u64,
    commands: mpsc::Sender<Command>,
}

struct Registry {
    /// Connections that said hello, oldest first.
    entries: Mutex<Vec<Entry>>,
    count: watch::Sender<usize>,
}

/// Sends Adds and Dels to the connected proxies. Cheap to clone.
#[derive(Clone)]
pub struct ZdsHandle {
    registry: Arc<Registry>,
}

/// Keeps a connection listed while its task runs; dropping it (even by abort or panic) unlists it.
pub(super) struct Registration {
    handle: ZdsHandle,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.handle.update(|entries| entries.retain(|e| e.id != self.id));
    }
}

impl ZdsHandle {
    pub(super) fn new() -> Self {
        ZdsHandle { registry: Arc::new(Registry { entries: Mutex::new(Vec::new()), count: watch::Sender::new(0) }) }
    }

    fn update(&self, change: impl FnOnce(&mut Vec<Entry>)) {
        let mut entries = self.registry.entries.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut entries);
        self.registry.count.send_replace(entries.len());
    }

    /// Lists connection `id` as the newest; called once its hello was accepted.
    pub(super) fn register(&self, id: u64) -> (Registration, mpsc::Receiver<Command>) {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        self.update(|entries| entries.push(Entry { id, commands: tx }));
        (Registration { handle: self.clone(), id }, rx)
    }

    fn senders(&self) -> Vec<mpsc::Sender<Command>> {
        let entries = self.registry.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.iter().map(|e| e.commands.clone()).collect()
    }

    /// Enrolls a pod with the newest proxy connection and waits for its ack.
    ///
    /// The netns fd is duplicated, so the caller keeps its own. A connection still sending its snapshot takes
    /// the Add right after `SnapshotSent`. Errors: [`ZdsError::NoProxy`] when no proxy said hello,
    /// [`ZdsError::Nack`] when the proxy refused, and timeouts or a closed peer otherwise. Dropping the future
    /// while the Add still waits in the connection's queue withdraws it: it is never sent, and its fd is closed.
    pub async fn add(&self, uid: &str, info: WorkloadInfo, netns: impl AsFd) -> Result<(), ZdsError> {
        let fd =
            netns.as_fd().try_clone_to_owned().map_err(|source| ZdsError::Io { op: "duplicate netns fd", source })?;
        let newest = self.senders().pop().ok_or(ZdsError::NoProxy)?;
        send(&newest, WorkloadRequest::add(uid, info), Some(fd)).await
    }

    /// Unenrolls a pod from every proxy connection, so a draining proxy lets go too, and waits for all acks.
    ///
    /// With no connection there is nothing to undo and this succeeds. A connection that closes meanwhile
    /// counts as done (its proxy holds the pod no more); any other failure is returned (the first one).
    pub async fn del(&self, uid: &str) -> Result<(), ZdsError> {
        let mut pending = Vec::new();
        for sender in self.senders() {
            let (reply, answer) = oneshot::channel();
            let command = Command { request: WorkloadRequest::del(uid), fd: None, reply };
            if sender.send(command).await.is_ok() {
                pending.push(answer);
            }
        }
        let mut first_error = None;
        for answer in pending {
            match answer.await {
                Ok(Ok(())) | Ok(Err(ZdsError::PeerClosed)) | Err(_) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Number of proxy connections that said hello; exported as `ztunnel_connected`.
    pub fn connected(&self) -> usize {
        *self.registry.count.borrow()
    }

    /// Waits until exactly `count` proxies are connected (for readiness checks and tests).
    pub async fn wait_connected(&self, count: usize) {
        let mut rx = self.registry.count.subscribe();
        // The sender lives in self.registry, so the channel cannot close while we wait.
        let _ = rx.wait_for(|c| *c == count).await;
    }
}

async fn send(sender: &mpsc::Sender<Command>, request: WorkloadRequest, fd: Option<OwnedFd>) -> Result<(), ZdsError> {
    let (reply, answer) = oneshot::channel();
    let command = Command { request, fd, reply };
    sender.send(command).await.map_err(|_| ZdsError::PeerClosed)?;
    answer.await.map_err(|_| ZdsError::PeerClosed)?
}
