//! Faults around the real `hbone-proxy`: killed under load (pods fail closed while it is down, never plaintext
//! around it), and a node agent that sends garbage over ZDS (the proxy logs, reconnects and keeps its pods).

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use istio_contract::ports;
use testbed::hbone_proxy::Proxy;
use testbed::mesh::plain_pod;
use testbed::node_agent::ambient_conflist;
use testbed::wait::{eventually, eventually_or};
use testbed::{NetnsGuard, Pod};
use zds::messages::{workload_response, Ack, WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello};
use zds::transport::{SeqpacketConn, SeqpacketListener};
use zds::ZdsError;

mod support;
use support::traffic::echo_app;
use support::{listening, APP_PORT, NS};

/// One echo exchange from `pod` to `dst`: Ok when the echo came back, else why not.
fn exchange(pod: &Pod, dst: SocketAddr) -> Result<(), std::io::Error> {
    let ns = pod.netns.open().expect("open pod netns");
    let mut stream = ns.run(|| TcpStream::connect_timeout(&dst, Duration::from_secs(2))).expect("enter pod netns")?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"ping")?;
    let mut got = [0; 4];
    stream.read_exact(&mut got)?;
    if &got != b"ping" {
        return Err(std::io::Error::other(format!("echo was {got:?}")));
    }
    Ok(())
}

/// Outcomes of a client loop: successes, and the error kinds of failures.
#[derive(Default)]
struct Tally {
    ok: usize,
    failed: Vec<ErrorKind>,
}

#[test]
fn killing_the_proxy_under_load_makes_pod_traffic_fail_closed_never_plaintext_and_a_restart_heals_it() {
    let dir = tempfile::tempdir().expect("scratch dir");
    let mut scene = support::Scene::new(dir, "b-sa", &[]);
    let accepted = echo_app(scene.b_listener());
    let b_app = SocketAddr::from((scene.b.ip, APP_PORT));
    // A pod outside the mesh on the same node, for the inbound direction.
    scene.cluster.create(&plain_pod(NS, "c"));
    let c = scene.cluster.add_with(ambient_conflist(&scene.cluster), "c", NS).expect("ADD of c");

    // Four clients in A hammer B's app through the proxies, each keeping its own tally.
    let stop = AtomicBool::new(false);
    let tallies: Vec<Mutex<Tally>> = (0..4).map(|_| Mutex::default()).collect();
    let total = |f: fn(&Tally) -> usize| tallies.iter().map(|t| f(&t.lock().unwrap())).sum::<usize>();
    let reset = || tallies.iter().for_each(|t| *t.lock().unwrap() = Tally::default());
    std::thread::scope(|s| {
        for tally in &tallies {
            let (stop, a) = (&stop, &scene.a);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let result = exchange(a, b_app);
                    let mut t = tally.lock().unwrap();
                    match result {
                        Ok(()) => t.ok += 1,
                        Err(e) => t.failed.push(e.kind()),
                    }
                }
            });
        }
        let stopper = StopOnDrop(&stop);
        eventually("A's clients reach B through the proxies", || (total(|t| t.ok) >= 20).then_some(()));
        assert_eq!(total(|t| t.failed.len()), 0, "failures before the kill");

        scene.proxy.stop();
        reset();
        // Exchanges in flight at the kill are settled once every client has failed twice since.
        eventually("every client fails after the kill", || {
            tallies.iter().all(|t| t.lock().unwrap().failed.len() >= 2).then_some(())
        });
        let accepted_down = accepted.load(Ordering::SeqCst);
        reset();
        eventually("A's clients keep trying while the proxy is down", || {
            (total(|t| t.failed.len()) >= 100).then_some(())
        });
        let inbound = exchange(&c, b_app);
        drop(stopper);
        let ok = total(|t| t.ok);
        let failed: Vec<ErrorKind> = tallies.iter().flat_map(|t| t.lock().unwrap().failed.clone()).collect();
        assert_eq!(ok, 0, "A reached B with the proxy down: its traffic went around the mesh");
        assert!(
            failed.iter().all(|k| matches!(k, ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset)),
            "A's connections fail at once (refused by the capture with nothing listening): {failed:?}"
        );
        assert!(inbound.is_err(), "a non-mesh pod reached B's app with the proxy down");
        assert_eq!(accepted.load(Ordering::SeqCst), accepted_down, "B's app got connections while the proxy was down");
    });

    // The restarted proxy gets both pods back from the agent's snapshot; traffic flows again.
    let _restarted = Proxy::start(&scene.cluster, &scene.agent, scene.dir.path(), &scene.workloads(), &[]);
    eventually_or("A reaches B through the restarted proxy", || exchange(&scene.a, b_app).ok(), || scene.proxy.log());
}

/// Sets the flag when dropped, so the client threads stop even when the test panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// An `hbone-proxy` in its own node netns, connected to a ZDS socket the test serves; killed on drop.
struct LoneProxy {
    child: Child,
    log: std::path::PathBuf,
}

impl LoneProxy {
    fn start(node: &NetnsGuard, dir: &Path, uds: &Path) -> Self {
        let log = dir.join("hbone-proxy.log");
        let mut cmd = Command::new(testbed::bins::path("hbone-proxy"));
        cmd.env_clear()
            .env("INPOD_UDS", uds)
            .env("STATE_DIR", dir.join("state"))
            .env("KUBE_WORKLOADS", "false")
            .env("LOG_LEVEL", "debug,h2=info,rustls=info,hyper=info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("proxy log file"));
        let ns = node.open().expect("open node netns");
        let child = ns.run(|| cmd.spawn()).expect("enter node netns").expect("spawn hbone-proxy");
        LoneProxy { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LoneProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("hbone-proxy log:\n{}", self.log());
        }
    }
}

/// Accepts the proxy's next connection and reads its hello, within 10 s.
async fn accept_hello(listener: &SeqpacketListener) -> SeqpacketConn {
    let conn = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("the proxy (re)connects within 10 s")
        .expect("accept");
    let (hello, _) = conn.recv_msg::<ZdsHello>("ZdsHello").await.expect("the proxy says hello");
    assert_eq!(hello, ZdsHello::v1());
    conn
}

/// Waits until the proxy closes `conn` (after `what` from the agent's side), within 10 s.
async fn hung_up(conn: &SeqpacketConn, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, conn.recv()).await {
            Err(_) => panic!("after {what} the proxy kept its ZDS connection open"),
            Ok(Err(ZdsError::PeerClosed)) => return,
            Ok(Err(e)) => panic!("after {what}: expected the proxy to close the connection, got {e}"),
            Ok(Ok(_)) => {}
        }
    }
}

/// Sends `request` (with `fd`) and returns the proxy's ack: `Ok` or the error it carried.
async fn request(conn: &SeqpacketConn, request: &WorkloadRequest, fd: Option<BorrowedFd<'_>>) -> Result<(), String> {
    conn.send_msg(request, fd).await.expect("send request");
    let (ack, _) = tokio::time::timeout(Duration::from_secs(10), conn.recv_msg::<WorkloadResponse>("ack"))
        .await
        .expect("the proxy acks within 10 s")
        .expect("an ack");
    match ack.payload {
        Some(workload_response::Payload::Ack(Ack { error })) if error.is_empty() => Ok(()),
        Some(workload_response::Payload::Ack(Ack { error })) => Err(error),
        None => Err("an ack without payload".to_owned()),
    }
}

#[test]
fn garbage_from_the_agent_side_makes_the_proxy_reconnect_and_keep_its_pods_listening() {
    let dir = tempfile::tempdir().expect("scratch dir");
    let node = NetnsGuard::new("znode");
    let pod = NetnsGuard::new("zpod");
    pod.exec_ok(&["ip", "link", "set", "lo", "up"]);
    pod.exec_ok(&["ip", "addr", "add", &format!("{}/32", Ipv4Addr::new(192, 0, 2, 10)), "dev", "lo"]);
    let uds = dir.path().join("ztunnel.sock");
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let listener = rt.block_on(async { SeqpacketListener::bind(&uds, 0o700) }).expect("bind the test's ZDS socket");
    let _proxy = LoneProxy::start(&node, dir.path(), &uds);
    let info = WorkloadInfo { name: "web".into(), namespace: NS.into(), service_account: "web-sa".into() };
    let pod_ports = [ports::OUTBOUND, ports::INBOUND_PLAINTEXT, ports::HBONE];

    rt.block_on(async {
        let conn = accept_hello(&listener).await;
        let netns = pod.open().expect("open pod netns").try_clone_fd().expect("pod netns fd");
        let ack = request(&conn, &WorkloadRequest::add("web-uid", info.clone()), Some(netns.as_fd())).await;
        assert_eq!(ack, Ok(()), "the proxy took the pod");
        assert_eq!(request(&conn, &WorkloadRequest::snapshot_sent(), None).await, Ok(()));
        for port in pod_ports {
            assert!(listening(&pod, port), "the pod's proxy listens on {port}");
        }

        let garbage: [(&str, &[u8]); 3] = [
            ("random bytes", &[0xff; 8]),
            ("a truncated AddWorkload", &[0x0a, 0x10, 0x0a, 0x07]),
            ("a hello where a request belongs", &[0x08, 0x01, 0x12, 0x7f]),
        ];
        let mut conn = conn;
        for (what, bytes) in garbage {
            conn.send(bytes, None).await.expect("send garbage");
            hung_up(&conn, what).await;
            conn = accept_hello(&listener).await;
            for port in pod_ports {
                assert!(listening(&pod, port), "after {what} the pod's proxy still listens on {port}");
            }
            // The reconnected session's snapshot keeps the pod.
            assert_eq!(request(&conn, &WorkloadRequest::keep("web-uid"), None).await, Ok(()), "after {what}");
            assert_eq!(request(&conn, &WorkloadRequest::snapshot_sent(), None).await, Ok(()), "after {what}");
            for port in pod_ports {
                assert!(listening(&pod, port), "after {what} and a new snapshot the pod still listens on {port}");
            }
        }
        // The connection still works for real requests: a Del stops the pod's listeners.
        assert_eq!(request(&conn, &WorkloadRequest::del("web-uid"), None).await, Ok(()));
    });
    eventually("the Del closed the pod's listeners", || {
        pod_ports.iter().all(|port| !listening(&pod, *port)).then_some(())
    });
}

/// Before its Kubernetes source has listed the pods, every mesh destination would look like one outside the
/// mesh, and pod traffic would leave in plaintext. So the proxy takes no pod from the agent until then: it is
/// not ready (blocker `kubernetes`), it is not connected to the agent's ZDS socket, and an ambient pod's ADD
/// fails closed. Once the API server lets it list pods, it connects and pods enroll.
#[test]
fn the_proxy_takes_no_pod_before_its_kubernetes_source_has_listed_the_pods() {
    use testbed::chart::PROXY_SERVICE_ACCOUNT;
    use testbed::mesh::{chart_rbac, RuleBackend};
    use testbed::node_agent::{ambient_pod, namespace, NodeAgent};

    let c = testbed::Cluster::with_backend(RuleBackend::Nftables);
    c.api.upsert(namespace(NS, serde_json::json!({}))).expect("store namespace");
    let agent = NodeAgent::start(&c, &[]);
    // The API server refuses the proxy's list (its role binding is gone), and only the proxy's.
    let binding = chart_rbac(&[])
        .into_iter()
        .find(|o| {
            o["kind"] == "ClusterRoleBinding"
                && o["subjects"].as_array().is_some_and(|s| s.iter().any(|s| s["name"] == PROXY_SERVICE_ACCOUNT))
        })
        .expect("the chart binds a role to the proxy's service account");
    let name = binding["metadata"]["name"].as_str().expect("binding name").to_owned();
    c.api.delete("ClusterRoleBinding", None, &name).expect("binding stored");

    let dir = tempfile::tempdir().expect("proxy dir");
    let proxy = Proxy::spawn_unlisted(&c, &agent, dir.path(), &dir.path().join("workloads.yaml"), &[]);
    let netns = c.node.netns().path();
    let body = eventually("the proxy says it waits for the pods to be listed", || {
        let (status, body) = testbed::http::get(&netns, ports::READINESS, "/healthz/ready").ok()?;
        (status == 503 && body.contains("kubernetes")).then_some(body)
    });
    assert_eq!(agent.metric("ztunnel_connected"), Some(0), "the proxy connected to ZDS unlisted; readiness: {body}");
    c.api.upsert(ambient_pod(NS, "early")).expect("store pod");
    let early = c.add_with(ambient_conflist(&c), "early", NS);
    assert!(early.is_err(), "an ambient pod started while the proxy could not know the mesh: {early:?}");

    c.api.upsert(binding).expect("restore the binding");
    eventually("the proxy connects to the agent once the pods are listed", || {
        (agent.metric("ztunnel_connected") == Some(1)).then_some(())
    });
    c.api.upsert(ambient_pod(NS, "late")).expect("store pod");
    c.add_with(ambient_conflist(&c), "late", NS).expect("an ambient pod enrolls once the proxy has the pods");
    drop(proxy);
    // The proxy's refused requests were this test's doing.
    c.api.clear_requests();
}
