//! Operating the real `hbone-proxy` (real node agent, pods through the fake CNI runtime): a pod whose proxy
//! cannot start is retried every 5 s and keeps the proxy unready (pending gauge on 15020), `/config_dump` on
//! 127.0.0.1:15000 shows the pods, identities and certificate expiry and the workload directory, the HBONE connect-latency histogram counts
//! new connections, leaf certificates rotate at half life without dropping connections, and a new proxy takes over
//! the pods' ports (SO_REUSEPORT) while the old one drains.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use istio_contract::ports;
use testbed::hbone_proxy::{KUBERNETES_SOURCE, LOCAL_FILE_SOURCE};
use testbed::node_agent::{netns_id, uid};
use testbed::wait::eventually;
use testbed::Pod;

mod support;
use support::traffic::Payload;
use support::{
    ambient_member, await_kubernetes_listing, config_dump, connect_from, dumped_pod, http_get, listen_on, listening,
    metric, pod_ips, unready, Proxy, Scene, APP_PORT, HBONE_ON_ONE_NODE, NS,
};

/// How often the proxy retries a pod that failed to start.
const RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// A scene with the proxy's `env`, and its same-node fast path off: these tests count HBONE connections and hand
/// HBONE streams over between proxies.
fn scene(env: &[(&str, &str)]) -> Scene {
    let env: Vec<(&str, &str)> = [HBONE_ON_ONE_NODE].into_iter().chain(env.iter().copied()).collect();
    Scene::new(tempfile::tempdir().expect("scratch dir"), "b-sa", &env)
}

fn expiry(scene: &Scene, name: &str) -> u64 {
    dumped_pod(&config_dump(scene), name)["certificate"]["expires_at_unix"].as_u64().expect("expiry")
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs()
}

/// Seconds of the day from a log line's leading RFC 3339 timestamp (`2026-11-30T10:56:29.056138Z ...`).
fn log_seconds(line: &str) -> f64 {
    let time = line.split_whitespace().next().and_then(|t| t.split('T').nth(1)).expect("a timestamped line");
    let mut parts = time.trim_end_matches('Z').split(':').map(|p| p.parse::<f64>().expect("a time field"));
    let (h, m, s) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
    h * 3600.0 + m * 60.0 + s
}

fn readiness(scene: &Scene) -> Option<(u16, String)> {
    http_get(&scene.cluster.node.netns().path(), ports::READINESS, "/healthz/ready")
}

/// A 1 MiB exchange each way between an app in `client` and a fresh listener of `server` on 8080.
fn exchange(client: &Pod, server: &Pod) -> SocketAddr {
    let dst = SocketAddr::from((server.ip, APP_PORT));
    let data = (Payload::new(1, 1 << 20), Payload::new(2, 1 << 20));
    support::traffic::transfer(listen_on(server, APP_PORT), || connect_from(client, dst), data.0, data.1)
}

/// Echoes `msg` over `stream` and checks it comes back.
fn echo(stream: &mut TcpStream, msg: &[u8]) {
    stream.write_all(msg).expect("write to the tunnel");
    let mut back = vec![0; msg.len()];
    stream.read_exact(&mut back).expect("read the echo");
    assert_eq!(back, msg);
}

/// An echo server for one connection on `listener`.
fn echo_one(listener: TcpListener) {
    std::thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else { return };
        let mut reader = stream.try_clone().expect("clone socket");
        let _ = std::io::copy(&mut reader, &mut stream);
        let _ = stream.shutdown(Shutdown::Write);
    });
}

#[test]
fn a_pod_whose_proxy_cannot_start_is_retried_every_5s_and_keeps_the_proxy_unready() {
    let mut scene = scene(&[]);
    let netns = scene.cluster.node.netns().path();
    scene.proxy.stop();
    eventually("the old proxy's listeners are gone", || (!listening(&scene.b.netns, ports::HBONE)).then_some(()));
    // Another process holds B's 15006 without SO_REUSEPORT: B's proxy cannot bind its listeners.
    let blocker = listen_on(&scene.b, ports::INBOUND_PLAINTEXT);
    scene.proxy = Proxy::spawn(&scene.cluster, &scene.agent, scene.dir.path(), &scene.workloads(), &[]);
    let pending = "workload_manager_pending_proxy_count";
    eventually("B counted as pending", || (metric(&netns, pending)? == 1.0).then_some(()));
    // Once the snapshot is applied, B being pending is what keeps the proxy unready.
    eventually("/healthz/ready answers 503 because B failed to start", || {
        let (status, reason) = readiness(&scene)?;
        (status == 503 && reason.contains("failed to start")).then_some(())
    });
    assert!(listening(&scene.a.netns, ports::HBONE), "A's proxy started regardless");
    let b_uid = uid(&scene.cluster, NS, "b");
    let dump = config_dump(&scene);
    assert!(dump["pending"][0]["uid"] == b_uid.as_str(), "/config_dump lists B as pending: {dump}");

    // Retried, and still failing while the port is held.
    let failed = format!("pod proxy failed to start uid=\"{b_uid}\"");
    eventually("a retry that failed again", || (scene.proxy.log().matches(&failed).count() >= 2).then_some(()));
    assert_eq!(readiness(&scene).map(|(s, _)| s), Some(503), "still not ready");
    let log = scene.proxy.log();
    let attempts: Vec<f64> = log.lines().filter(|l| l.contains(&failed)).map(log_seconds).collect();
    let gap = attempts[1] - attempts[0];
    assert!((4.5..6.5).contains(&gap), "the retry came {gap:.2} s after the failed start, not about 5 s");

    drop(blocker);
    let freed = Instant::now();
    eventually("B's proxy started on a retry and the proxy is ready", || {
        let ready = readiness(&scene)?.0 == 200 && metric(&netns, pending)? == 0.0;
        (ready && listening(&scene.b.netns, ports::HBONE)).then_some(())
    });
    let took = freed.elapsed();
    assert!(took < RETRY_INTERVAL + Duration::from_millis(1500), "the retry came {took:?} after the port was freed");
    assert!(scene.proxy.log().contains("pod proxy started on retry"), "the log tells");
    let peer = exchange(&scene.a, &scene.b);
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip), "A reaches B through B's restarted proxy");
}

#[test]
fn config_dump_shows_pods_identities_certificate_expiry_and_the_directory_and_the_connect_histogram_counts_connections()
{
    let scene = scene(&[]);
    let netns = scene.cluster.node.netns().path();
    let dump = config_dump(&scene);
    assert_eq!(dump["pending"], serde_json::json!([]), "nothing pending: {dump}");
    for (pod, name, sa) in [(&scene.a, "a", "a-sa"), (&scene.b, "b", "b-sa")] {
        let entry = dumped_pod(&dump, name);
        assert_eq!(entry["uid"], uid(&scene.cluster, NS, name).as_str());
        assert_eq!(entry["namespace"], NS);
        let (dev, ino) = netns_id(&pod.netns);
        assert_eq!((entry["netns"]["dev"].as_u64(), entry["netns"]["ino"].as_u64()), (Some(dev), Some(ino)));
        assert_eq!(entry["identity"], format!("spiffe://cluster.local/ns/{NS}/sa/{sa}").as_str());
        assert_eq!(entry["ips"][0], pod.ip.to_string().as_str());
        let expires = entry["certificate"]["expires_at_unix"].as_u64().expect("expiry");
        let day = 24 * 3600;
        assert!(expires.abs_diff(unix_now() + day) < 120, "a 24 h leaf by default: {entry}");
        assert!(entry["certificate"]["expires_at"].as_str().is_some_and(|t| t.ends_with('Z')), "RFC 3339: {entry}");
    }
    // The workload directory, in ztunnel's field names: A and B as their Pod objects list them (the Kubernetes
    // source), nothing from the (absent) local workloads file.
    let listed = dump["workloads"].as_array().unwrap_or_else(|| panic!("a workloads list: {dump}"));
    assert_eq!(listed.len(), 2, "A and B, each once: {dump}");
    for (pod, name, sa) in [(&scene.a, "a", "a-sa"), (&scene.b, "b", "b-sa")] {
        let entry = listed.iter().find(|w| w["name"] == name).unwrap_or_else(|| panic!("workload {name} in {dump}"));
        let object = scene.cluster.api.get("Pod", Some(NS), name).expect("pod object");
        assert_eq!(entry["source"], KUBERNETES_SOURCE, "{entry}");
        assert_eq!(entry["uid"], uid(&scene.cluster, NS, name).as_str());
        assert_eq!(entry["namespace"], NS);
        assert_eq!(entry["serviceAccount"], sa);
        assert_eq!(entry["trustDomain"], "cluster.local");
        assert_eq!(entry["workloadIps"], serde_json::json!([pod.ip.to_string()]));
        assert_eq!(entry["protocol"], "HBONE");
        assert_eq!(entry["node"], object["spec"]["nodeName"]);
        assert_eq!(
            (&entry["workloadName"], &entry["canonicalName"]),
            (&serde_json::json!(name), &serde_json::json!(name))
        );
        assert_eq!(
            entry["clusterId"],
            istio_contract::telemetry::DEFAULT_CLUSTER_ID,
            "the proxy's own cluster (CLUSTER_ID's default)"
        );
    }
    let counts = &dump["workload_sources"];
    assert_eq!(counts[KUBERNETES_SOURCE], serde_json::json!({ "workloads": 2, "addresses": 2 }), "{dump}");
    assert_eq!(counts[LOCAL_FILE_SOURCE], serde_json::json!({ "workloads": 0, "addresses": 0 }), "{dump}");
    assert_eq!(dump["workloads_omitted"], 0);
    // Bound to the node's loopback only: the node's own bridge address does not serve it.
    let gateway = SocketAddr::from((scene.cluster.node.gateway(), ports::ADMIN));
    let node = scene.cluster.node.netns().open().expect("open node netns");
    let refused = node.run(|| TcpStream::connect_timeout(&gateway, Duration::from_secs(2))).expect("enter node netns");
    assert!(refused.is_err(), "the admin port answers on {gateway}");

    let count = "hbone_connect_duration_seconds_count";
    assert_eq!(metric(&netns, count), Some(0.0), "no HBONE connection yet");
    exchange(&scene.a, &scene.b);
    assert_eq!(metric(&netns, count), Some(1.0), "the first exchange dialled one HBONE connection");
    assert!(metric(&netns, "hbone_connect_duration_seconds_sum").is_some_and(|s| s > 0.0), "its latency was observed");
    exchange(&scene.a, &scene.b);
    assert_eq!(metric(&netns, count), Some(1.0), "the second exchange reused the pooled connection");
}

#[test]
fn leaf_certificates_rotate_at_half_life_without_dropping_open_connections() {
    let scene = scene(&[("SECRET_TTL", "4s")]);
    let c = ambient_member(&scene.cluster, "c", "c-sa");
    await_kubernetes_listing(&scene.proxy, [&scene.a, &scene.b, &c].into_iter().map(|p| pod_ips(p).len()).sum());
    echo_one(scene.b_listener());
    let mut open = scene.a_connects_to_b();
    echo(&mut open, b"before any rotation");
    let first: Vec<u64> = ["a", "b", "c"].iter().map(|name| expiry(&scene, name)).collect();
    assert!(first.iter().all(|e| e.abs_diff(unix_now() + 4) <= 5), "SECRET_TTL sets the lifetime: {first:?}");

    eventually("every pod's certificate was replaced by a later one", || {
        let now: Vec<u64> = ["a", "b", "c"].iter().map(|name| expiry(&scene, name)).collect();
        now.iter().zip(&first).all(|(now, first)| now > first).then_some(())
    });
    let all_expired = first.iter().max().copied().unwrap_or_default() + 1;
    eventually("the first certificates have expired", || (unix_now() > all_expired).then_some(()));

    echo(&mut open, b"after the certificate it began with expired");
    // A fresh HBONE connection (A to C was never dialled) needs both current certificates to be valid: A's as a
    // client and C's as a server.
    let peer = exchange(&scene.a, &c);
    assert_eq!(peer.ip(), IpAddr::from(scene.a.ip), "a new connection after the old leaves expired works");
    assert!(scene.proxy.log().contains("workload certificate rotated"), "the log tells");
}

#[test]
fn a_new_proxy_takes_over_the_pods_ports_while_the_old_one_drains() {
    let mut scene = scene(&[("CONNECTION_TERMINATION_DEADLINE", "8s")]);
    // Connections still queued on the old listeners when they close move to the new ones instead of being reset.
    for pod in [&scene.a, &scene.b] {
        assert_eq!(pod.netns.exec_ok(&["sysctl", "-n", "net.ipv4.tcp_migrate_req"]).trim(), "1");
    }
    let accepted = support::traffic::echo_app(scene.b_listener());
    let mut open = scene.a_connects_to_b();
    echo(&mut open, b"through the old proxy");

    // The new proxy shares the state dir (so the mesh CA) and, as a new pod would, binds the pods' ports next to
    // the old listeners (SO_REUSEPORT); its own probe and admin ports differ only because both run in one netns.
    let env = [("READINESS_PORT", "15121"), ("MONITORING_PORT", "15120"), ("ADMIN_PORT", "15100"), HBONE_ON_ONE_NODE];
    let new = Proxy::spawn(&scene.cluster, &scene.agent, scene.dir.path(), &scene.workloads(), &env);
    let netns = scene.cluster.node.netns().path();
    eventually("the new proxy is ready: it runs both pods next to the old one", || {
        (http_get(&netns, 15121, "/healthz/ready")?.0 == 200).then_some(())
    });
    let mut old = std::mem::replace(&mut scene.proxy, new);
    assert!(!unready(&netns, ports::READINESS), "the old proxy is ready before SIGTERM");
    let sent = old.terminate();
    eventually("the old proxy drains: no longer ready", || unready(&netns, ports::READINESS).then_some(()));

    let mut fresh = scene.a_connects_to_b();
    echo(&mut fresh, b"through the new proxy");
    drop(fresh);
    echo(&mut open, b"still through the old proxy while it drains");
    open.shutdown(Shutdown::Write).expect("A's app is done");
    assert_eq!(open.read(&mut [0; 8]).expect("EOF"), 0, "B's echo finished");
    let status = old.exit_within(sent, Duration::from_secs(8)).expect("the old proxy exits once drained");
    assert!(status.success(), "{status}");
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "B's app saw both connections");
    // The new proxy dialled the one HBONE connection it has seen: it carried the new connection.
    let dialled = || {
        let (_, body) = http_get(&netns, 15120, "/metrics")?;
        body.lines().find_map(|l| l.strip_prefix("hbone_connect_duration_seconds_count ")?.trim().parse::<f64>().ok())
    };
    assert_eq!(dialled(), Some(1.0), "the new proxy's HBONE dials");
}
