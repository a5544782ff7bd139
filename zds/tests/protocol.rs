//! The ZDS protocol over real seqpacket sockets: the agent's server against test peers (the crate's client,
//! or raw sockets for peers that break the rules).

use std::fs::File;
use std::future::Future;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{sendmsg, MsgFlags};
use nix::sys::stat::fstat;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use zds::messages::workload_request::Payload;
use zds::messages::{WorkloadInfo, WorkloadResponse, ZdsHello};
use zds::transport::{SeqpacketConn, MAX_MESSAGE_LEN};
use zds::{PodSnapshotEntry, ServerConfig, ZdsClient, ZdsError, ZdsHandle, ZdsServer};

/// Upper bound for any single wait in these tests; a hang fails the test instead of blocking it.
const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, fut).await.unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// An agent-side server on a socket in its own temp dir, serving a fixed snapshot.
struct Agent {
    _dir: tempfile::TempDir,
    path: PathBuf,
    handle: ZdsHandle,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Agent {
    async fn start(config: ServerConfig, pods: Vec<PodSnapshotEntry>) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/ztunnel.sock");
        let server = ZdsServer::bind(&path, config).await.unwrap();
        let handle = server.handle();
        let (stop, stopped) = oneshot::channel::<()>();
        let source = Arc::new(move || pods.clone());
        let task = tokio::spawn(server.serve(source, async move {
            let _ = stopped.await;
        }));
        Agent { _dir: dir, path, handle, stop: Some(stop), task }
    }

    async fn peer(&self) -> ZdsClient {
        within("connect", ZdsClient::connect(&self.path)).await.unwrap()
    }

    async fn raw_peer(&self) -> SeqpacketConn {
        within("connect", SeqpacketConn::connect(&self.path)).await.unwrap()
    }
}

fn fast() -> ServerConfig {
    ServerConfig { io_timeout: Duration::from_secs(1), ..ServerConfig::default() }
}

fn info(uid: &str) -> WorkloadInfo {
    WorkloadInfo { name: format!("{uid}-name"), namespace: "ns1".into(), service_account: format!("{uid}-sa") }
}

/// (st_dev, st_ino): what identifies a netns (or the temp file standing in for one).
fn file_id(fd: impl AsFd) -> (u64, u64) {
    let st = fstat(fd).unwrap();
    (st.st_dev as u64, st.st_ino as u64)
}

/// A pod whose "netns" is a fresh temp file with its own inode; returns the entry and that identity.
fn pod_with_netns(uid: &str) -> (PodSnapshotEntry, (u64, u64)) {
    let fd = OwnedFd::from(tempfile::tempfile().unwrap());
    let id = file_id(&fd);
    let entry = PodSnapshotEntry { uid: uid.into(), info: info(uid), netns: Some(Arc::new(fd)) };
    (entry, id)
}

fn pod_without_netns(uid: &str) -> PodSnapshotEntry {
    PodSnapshotEntry { uid: uid.into(), info: info(uid), netns: None }
}

async fn next(peer: &ZdsClient) -> (Payload, Vec<OwnedFd>) {
    let (req, fds) = within("a request", peer.recv()).await.unwrap();
    (req.payload.expect("request without payload"), fds)
}

/// Receives an Add for `uid` with the full identity and exactly one fd that is `netns`; does not ack.
async fn expect_add(peer: &ZdsClient, uid: &str, netns: (u64, u64)) {
    match next(peer).await {
        (Payload::Add(add), fds) => {
            assert_eq!(add.uid, uid);
            assert_eq!(add.workload_info, Some(info(uid)));
            assert_eq!(fds.len(), 1, "an Add carries exactly one fd");
            assert_eq!(file_id(&fds[0]), netns, "the fd of {uid} is its netns");
        }
        (other, _) => panic!("expected Add {uid}, got {other:?}"),
    }
}

async fn expect_no_fd(peer: &ZdsClient) -> Payload {
    let (payload, fds) = next(peer).await;
    assert!(fds.is_empty(), "{payload:?} carried fds");
    payload
}

async fn ack(peer: &ZdsClient) {
    within("ack", peer.ack(None)).await.unwrap();
}

async fn expect_snapshot_sent(peer: &ZdsClient) {
    assert!(matches!(expect_no_fd(peer).await, Payload::SnapshotSent(_)));
    ack(peer).await;
}

async fn expect_del(peer: &ZdsClient, uid: &str) {
    match expect_no_fd(peer).await {
        Payload::Del(del) => assert_eq!(del.uid, uid),
        other => panic!("expected Del {uid}, got {other:?}"),
    }
}

/// The server dropped this connection: the very next read is end of stream (no further message).
async fn expect_dropped(stream: &SeqpacketConn) {
    match within("the server to drop the connection", stream.recv()).await {
        Err(ZdsError::PeerClosed) => {}
        other => panic!("expected the connection to be dropped, got {other:?}"),
    }
}

/// A well-behaved peer connects and takes the whole snapshot of `pods`, acking each message.
async fn good_peer(agent: &Agent, pods: &[(&str, (u64, u64))]) -> ZdsClient {
    let peer = agent.peer().await;
    for (uid, id) in pods {
        expect_add(&peer, uid, *id).await;
        ack(&peer).await;
    }
    expect_snapshot_sent(&peer).await;
    peer
}

#[tokio::test]
async fn snapshot_sends_one_netns_fd_per_pod_then_snapshot_sent() {
    let mut pods = Vec::new();
    let mut ids = Vec::new();
    // 50 pods, as many as the agent-restart acceptance test enrolls. One stands for a real netns: our own.
    let own = OwnedFd::from(File::open("/proc/self/ns/net").unwrap());
    ids.push(("pod-0".to_string(), file_id(&own)));
    pods.push(PodSnapshotEntry { uid: "pod-0".into(), info: info("pod-0"), netns: Some(Arc::new(own)) });
    for i in 1..50 {
        let uid = format!("pod-{i}");
        let (entry, id) = pod_with_netns(&uid);
        pods.push(entry);
        ids.push((uid, id));
    }
    let agent = Agent::start(ServerConfig::default(), pods).await;
    assert_eq!(agent.handle.connected(), 0);

    let peer = agent.peer().await;
    for (uid, id) in &ids {
        expect_add(&peer, uid, *id).await;
        ack(&peer).await;
    }
    expect_snapshot_sent(&peer).await;
    within("connected", agent.handle.wait_connected(1)).await;
    assert_eq!(agent.handle.connected(), 1);
}

#[tokio::test]
async fn a_pod_with_unknown_netns_is_sent_as_keep() {
    let (known, known_id) = pod_with_netns("known");
    let agent = Agent::start(ServerConfig::default(), vec![pod_without_netns("lost"), known]).await;
    let peer = agent.peer().await;
    match expect_no_fd(&peer).await {
        Payload::Keep(keep) => assert_eq!(keep.uid, "lost"),
        other => panic!("expected Keep, got {other:?}"),
    }
    ack(&peer).await;
    expect_add(&peer, "known", known_id).await;
    ack(&peer).await;
    expect_snapshot_sent(&peer).await;
}

#[tokio::test]
async fn live_add_waits_for_the_ack_and_a_nack_is_an_error() {
    let agent = Agent::start(ServerConfig::default(), Vec::new()).await;
    let peer = good_peer(&agent, &[]).await;
    within("connected", agent.handle.wait_connected(1)).await;

    let (netns, id) = pod_with_netns("live");
    let handle = agent.handle.clone();
    let fd = netns.netns.clone().unwrap();
    let add = tokio::spawn(async move { handle.add("live", info("live"), fd).await });
    expect_add(&peer, "live", id).await;
    assert!(!add.is_finished(), "add returned before the proxy acked");
    ack(&peer).await;
    within("add", add).await.unwrap().unwrap();

    let handle = agent.handle.clone();
    let add =
        tokio::spawn(
            async move { handle.add("refused", info("refused"), File::open("/proc/self/ns/net").unwrap()).await },
        );
    let (payload, fds) = next(&peer).await;
    assert!(matches!(payload, Payload::Add(ref a) if a.uid == "refused"));
    assert_eq!(fds.len(), 1);
    within("nack", peer.ack(Some("cannot enter netns".into()))).await.unwrap();
    match within("add", add).await.unwrap() {
        Err(ZdsError::Nack(reason)) => assert_eq!(reason, "cannot enter netns"),
        other => panic!("expected a nack, got {other:?}"),
    }

    // A nack does not end the connection: Del goes through and is acked.
    let handle = agent.handle.clone();
    let del = tokio::spawn(async move { handle.del("live").await });
    expect_del(&peer, "live").await;
    assert!(!del.is_finished(), "del returned before the proxy acked");
    ack(&peer).await;
    within("del", del).await.unwrap().unwrap();
    assert_eq!(agent.handle.connected(), 1);
}

#[tokio::test]
async fn an_add_abandoned_while_queued_is_never_sent() {
    let agent = Agent::start(ServerConfig::default(), Vec::new()).await;
    let peer = good_peer(&agent, &[]).await;
    within("connected", agent.handle.wait_connected(1)).await;

    // The proxy is busy with a first Add (not acked yet), so a second one waits in the queue...
    let (first, first_id) = pod_with_netns("first");
    let handle = agent.handle.clone();
    let fd = first.netns.clone().unwrap();
    let busy = tokio::spawn(async move { handle.add("first", info("first"), fd).await });
    expect_add(&peer, "first", first_id).await;
    // ...and its caller gives up on it there (as an enrollment past the plugin's deadline does).
    let (abandoned, _) = pod_with_netns("abandoned");
    let queued = agent.handle.add("abandoned", info("abandoned"), abandoned.netns.clone().unwrap());
    let gave_up = tokio::time::timeout(Duration::from_millis(200), queued).await;
    assert!(gave_up.is_err(), "the queued Add cannot have been answered: the proxy is still busy");

    ack(&peer).await;
    within("first add", busy).await.unwrap().unwrap();
    // The next request the proxy sees is the next live one: the abandoned Add was dropped, never sent.
    let (next_pod, next_id) = pod_with_netns("next");
    let handle = agent.handle.clone();
    let fd = next_pod.netns.clone().unwrap();
    let add = tokio::spawn(async move { handle.add("next", info("next"), fd).await });
    expect_add(&peer, "next", next_id).await;
    ack(&peer).await;
    within("next add", add).await.unwrap().unwrap();
}

#[tokio::test]
async fn add_without_a_proxy_fails_with_no_proxy() {
    let agent = Agent::start(ServerConfig::default(), Vec::new()).await;
    let netns = File::open("/proc/self/ns/net").unwrap();
    match agent.handle.add("p", info("p"), &netns).await {
        Err(ZdsError::NoProxy) => {}
        other => panic!("expected NoProxy, got {other:?}"),
    }
    // Nothing to undo without a proxy.
    agent.handle.del("p").await.unwrap();
}

#[tokio::test]
async fn add_goes_to_the_newest_connection_and_del_to_all() {
    let agent = Agent::start(ServerConfig::default(), Vec::new()).await;
    let old = good_peer(&agent, &[]).await;
    within("first connection", agent.handle.wait_connected(1)).await;
    let new = good_peer(&agent, &[]).await;
    within("second connection", agent.handle.wait_connected(2)).await;

    let (pod, id) = pod_with_netns("p1");
    let handle = agent.handle.clone();
    let add = tokio::spawn(async move { handle.add("p1", info("p1"), pod.netns.unwrap()).await });
    expect_add(&new, "p1", id).await;
    ack(&new).await;
    within("add", add).await.unwrap().unwrap();

    let handle = agent.handle.clone();
    let del = tokio::spawn(async move { handle.del("p1").await });
    // The old connection's next message is the Del: it never saw the Add.
    expect_del(&old, "p1").await;
    expect_del(&new, "p1").await;
    ack(&new).await;
    assert!(!del.is_finished(), "del returned before every connection acked");
    ack(&old).await;
    within("del", del).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_gone_peer_is_noticed_and_a_reconnect_gets_the_snapshot_again() {
    let (a, a_id) = pod_with_netns("a");
    let (b, b_id) = pod_with_netns("b");
    let agent = Agent::start(ServerConfig::default(), vec![a, b]).await;
    let pods = [("a", a_id), ("b", b_id)];

    let peer = good_peer(&agent, &pods).await;
    within("connected", agent.handle.wait_connected(1)).await;
    drop(peer);
    within("the server to notice the closed peer", agent.handle.wait_connected(0)).await;
    let netns = File::open("/proc/self/ns/net").unwrap();
    assert!(matches!(agent.handle.add("x", info("x"), &netns).await, Err(ZdsError::NoProxy)));

    let _again = good_peer(&agent, &pods).await;
    within("reconnected", agent.handle.wait_connected(1)).await;
}

#[tokio::test]
async fn shutdown_closes_every_connection() {
    let mut agent = Agent::start(ServerConfig::default(), Vec::new()).await;
    let peer = good_peer(&agent, &[]).await;
    within("connected", agent.handle.wait_connected(1)).await;
    agent.stop.take().unwrap().send(()).unwrap();
    within("serve to return", &mut agent.task).await.unwrap();
    expect_dropped(peer.stream()).await;
    assert_eq!(agent.handle.connected(), 0);
}

#[tokio::test]
async fn a_wrong_first_message_drops_the_connection() {
    let (pod, id) = pod_with_netns("p");
    let agent = Agent::start(fast(), vec![pod]).await;

    // An ack where the hello belongs.
    let raw = agent.raw_peer().await;
    raw.send_msg(&WorkloadResponse::ack(None), None).await.unwrap();
    expect_dropped(&raw).await;
    // A hello of an unknown version.
    let raw = agent.raw_peer().await;
    raw.send(&[0x08, 0x02], None).await.unwrap();
    expect_dropped(&raw).await;
    // No hello at all: dropped at the read deadline.
    let raw = agent.raw_peer().await;
    expect_dropped(&raw).await;
    assert_eq!(agent.handle.connected(), 0);

    // The server keeps serving.
    let _good = good_peer(&agent, &[("p", id)]).await;
    within("connected", agent.handle.wait_connected(1)).await;
}

#[tokio::test]
async fn a_truncated_or_garbage_ack_drops_the_connection() {
    let (pod, id) = pod_with_netns("p");
    let agent = Agent::start(fast(), vec![pod]).await;

    let peer = agent.peer().await;
    expect_add(&peer, "p", id).await;
    // A datagram over the limit: the server reads it truncated.
    let big = [0x0au8; MAX_MESSAGE_LEN + 100];
    let raw = peer.stream().as_fd().as_raw_fd();
    sendmsg::<()>(raw, &[std::io::IoSlice::new(&big)], &[], MsgFlags::empty(), None).unwrap();
    expect_dropped(peer.stream()).await;

    let peer = agent.peer().await;
    expect_add(&peer, "p", id).await;
    // Bytes that are no WorkloadResponse (a field header with no value).
    peer.stream().send(&[0x0a, 0x05, 0x01], None).await.unwrap();
    expect_dropped(peer.stream()).await;

    let peer = agent.peer().await;
    expect_add(&peer, "p", id).await;
    // The proxy's own hello again instead of an ack.
    peer.stream().send_msg(&ZdsHello::v1(), None).await.unwrap();
    expect_dropped(peer.stream()).await;

    let _good = good_peer(&agent, &[("p", id)]).await;
    within("connected", agent.handle.wait_connected(1)).await;
}

#[tokio::test]
async fn a_peer_that_never_acks_is_dropped_while_others_are_served() {
    let (p1, id1) = pod_with_netns("p1");
    let (p2, id2) = pod_with_netns("p2");
    let agent =
        Agent::start(ServerConfig { io_timeout: Duration::from_secs(2), ..ServerConfig::default() }, vec![p1, p2])
            .await;

    let stuck = agent.peer().await;
    expect_add(&stuck, "p1", id1).await;
    // While the stuck peer holds its first Add unacked, another peer gets the whole snapshot.
    let _good = good_peer(&agent, &[("p1", id1), ("p2", id2)]).await;
    // Lockstep: the stuck peer never receives p2 or SnapshotSent; its connection ends at the deadline.
    expect_dropped(stuck.stream()).await;
    within("one connection left", agent.handle.wait_connected(1)).await;
}

#[tokio::test]
async fn an_unacked_live_add_times_out_and_drops_the_connection() {
    let agent = Agent::start(fast(), Vec::new()).await;
    let peer = good_peer(&agent, &[]).await;
    within("connected", agent.handle.wait_connected(1)).await;

    let (pod, id) = pod_with_netns("p");
    let handle = agent.handle.clone();
    let add = tokio::spawn(async move { handle.add("p", info("p"), pod.netns.unwrap()).await });
    expect_add(&peer, "p", id).await;
    match within("add", add).await.unwrap() {
        Err(ZdsError::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    expect_dropped(peer.stream()).await;
    within("disconnected", agent.handle.wait_connected(0)).await;
}

#[tokio::test]
async fn the_socket_is_not_world_writable_and_a_stale_one_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing-dir/ztunnel.sock");
    // A stale socket file, as a crashed agent leaves it.
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());

    let server = ZdsServer::bind(&path, ServerConfig::default()).await.unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o770);

    // A configured mode is applied exactly, whatever the umask.
    drop(server);
    let server = ZdsServer::bind(&path, ServerConfig { socket_mode: 0o700, ..ServerConfig::default() }).await.unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o700);

    // The replaced socket is live: a proxy connects and gets its (empty) snapshot.
    let handle = server.handle();
    tokio::spawn(server.serve(Arc::new(Vec::<PodSnapshotEntry>::new), std::future::pending()));
    let peer = within("connect", ZdsClient::connect(&path)).await.unwrap();
    expect_snapshot_sent(&peer).await;
    within("connected", handle.wait_connected(1)).await;
}

#[tokio::test]
async fn a_path_that_is_not_a_socket_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path: &Path = &dir.path().join("ztunnel.sock");
    std::fs::write(path, b"keep me").unwrap();
    match ZdsServer::bind(path, ServerConfig::default()).await {
        Err(ZdsError::Socket { .. }) => {}
        Err(other) => panic!("expected a socket error, got {other:?}"),
        Ok(_) => panic!("bind replaced a regular file"),
    }
    assert_eq!(std::fs::read(path).unwrap(), b"keep me");
}
