//! A stand-in for the node proxy on the agent's ZDS socket: it records every request with its fds (kept open, as
//! a proxy keeps them) and answers each as told, so tests see exactly what a proxy would be sent.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use netns::Netns;
use zds::messages::{workload_request::Payload, WorkloadInfo};

use super::NodeAgent;
use crate::wait::eventually;

/// What kind of request the agent sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// `AddWorkload`.
    Add,
    /// `KeepWorkload`.
    Keep,
    /// `DelWorkload`.
    Del,
    /// `SnapshotSent`.
    SnapshotSent,
    /// A request without payload (a protocol error on the agent's side).
    Empty,
}

/// One request the peer received, as the node proxy would see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// Which request.
    pub kind: RequestKind,
    /// The pod UID (empty for `SnapshotSent`).
    pub uid: String,
    /// `(dev, ino)` of every fd that came with it, to compare with `Netns::id()`.
    pub fds: Vec<(u64, u64)>,
    /// The `AddWorkload`'s workload info.
    pub info: Option<WorkloadInfo>,
}

/// How the peer answers every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// An empty ack (success).
    Ack,
    /// An ack carrying this error.
    Nack(String),
}

#[derive(Default)]
struct PeerState {
    received: Vec<Received>,
    /// The fds of every Add, by pod UID, kept open as the node proxy keeps them.
    netns: Vec<(String, OwnedFd)>,
}

/// A test node proxy on its own thread: connected to the agent's ZDS socket, it records every request (and
/// keeps the netns fds), and answers each with [`Reply`]. Disconnects on drop.
pub struct ZdsPeer {
    state: Arc<Mutex<PeerState>>,
    reply: Arc<Mutex<Reply>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ZdsPeer {
    /// Connects to `agent`'s ZDS socket and returns after the (empty or not) snapshot ended with `SnapshotSent`,
    /// so the agent routes new pods to this connection.
    #[track_caller]
    pub fn connect(agent: &NodeAgent) -> Self {
        let peer = Self::connect_to(&agent.zds_socket());
        eventually("the peer received SnapshotSent", || {
            peer.received().iter().any(|r| r.kind == RequestKind::SnapshotSent).then_some(())
        });
        peer
    }

    /// Like [`ZdsPeer::connect`] for any agent's ZDS socket at `path` (e.g. Istio's agent,
    /// [`crate::istio_agent::IstioAgent::zds_socket`]).
    #[track_caller]
    pub fn connect_at(path: &Path) -> Self {
        let peer = Self::connect_to(path);
        eventually("the peer received SnapshotSent", || {
            peer.received().iter().any(|r| r.kind == RequestKind::SnapshotSent).then_some(())
        });
        peer
    }

    fn connect_to(path: &Path) -> Self {
        let state = Arc::new(Mutex::new(PeerState::default()));
        let reply = Arc::new(Mutex::new(Reply::Ack));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let (connected_tx, connected_rx) = mpsc::channel();
        let (path, st, rp) = (path.to_path_buf(), state.clone(), reply.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("peer runtime");
            rt.block_on(serve(path, st, rp, stop_rx, connected_tx));
        });
        match connected_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("ZDS peer could not connect: {e}"),
            Err(_) => panic!("ZDS peer thread ended before connecting"),
        }
        Self { state, reply, stop: Some(stop_tx), thread: Some(thread) }
    }

    /// Changes how the following requests are answered.
    pub fn set_reply(&self, reply: Reply) {
        *self.reply.lock().unwrap() = reply;
    }

    /// Every request received so far, in order.
    pub fn received(&self) -> Vec<Received> {
        self.state.lock().unwrap().received.clone()
    }

    /// The requests of kind `kind` for pod `uid`.
    pub fn received_for(&self, kind: RequestKind, uid: &str) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.kind == kind && r.uid == uid).collect()
    }

    /// The netns of pod `uid` from the fd of its latest `AddWorkload`, as the node proxy enters it.
    pub fn netns(&self, uid: &str) -> Netns {
        let state = self.state.lock().unwrap();
        let (_, fd) = state
            .netns
            .iter()
            .rev()
            .find(|(u, _)| u == uid)
            .unwrap_or_else(|| panic!("the peer received no netns fd for pod {uid}"));
        let fd = fd.try_clone().expect("dup netns fd");
        Netns::from_fd(fd, format!("netns of {uid} received over ZDS")).expect("received fd is a netns")
    }
}

impl Drop for ZdsPeer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    path: PathBuf,
    state: Arc<Mutex<PeerState>>,
    reply: Arc<Mutex<Reply>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    connected: mpsc::Sender<Result<(), String>>,
) {
    let client = match zds::ZdsClient::connect(&path).await {
        Ok(c) => {
            let _ = connected.send(Ok(()));
            c
        }
        Err(e) => {
            let _ = connected.send(Err(e.to_string()));
            return;
        }
    };
    loop {
        let (request, fds) = tokio::select! {
            _ = &mut stop => return,
            received = client.recv() => match received {
                Ok(r) => r,
                Err(e) => return eprintln!("ZDS peer: connection ended: {e}"),
            },
        };
        let (kind, uid, info) = match request.payload {
            Some(Payload::Add(add)) => (RequestKind::Add, add.uid, add.workload_info),
            Some(Payload::Keep(keep)) => (RequestKind::Keep, keep.uid, None),
            Some(Payload::Del(del)) => (RequestKind::Del, del.uid, None),
            Some(Payload::SnapshotSent(_)) => (RequestKind::SnapshotSent, String::new(), None),
            None => (RequestKind::Empty, String::new(), None),
        };
        let ids = fds.iter().map(fd_id).collect();
        {
            let mut state = state.lock().unwrap();
            state.received.push(Received { kind, uid: uid.clone(), fds: ids, info });
            state.netns.extend(fds.into_iter().map(|fd| (uid.clone(), fd)));
        }
        let answer = match reply.lock().unwrap().clone() {
            Reply::Ack => None,
            Reply::Nack(reason) => Some(reason),
        };
        if let Err(e) = client.ack(answer).await {
            return eprintln!("ZDS peer: ack failed: {e}");
        }
    }
}

fn fd_id(fd: &OwnedFd) -> (u64, u64) {
    let st = nix::sys::stat::fstat(fd.as_fd()).expect("fstat received fd");
    (st.st_dev as u64, st.st_ino as u64)
}
