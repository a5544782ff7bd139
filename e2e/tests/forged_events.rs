//! Forged plugin events, as an attacker on the node would post them to the agent's `pluginevent.sock` (mode 0666, so
//! the runtime's plugin can reach it): each is refused with a 4xx that names the reason, counted in
//! `istio_cni_plugin_requests_total`, logged (throttled per reason), and programs nothing anywhere: no rules or
//! policy routes in the host's, the node's or any pod's netns, no ZDS `AddWorkload`, no annotation. The real
//! plugin, which now sends the pod's UID from `CNI_ARGS`, still enrolls its pods, and when the runtime's UID is not
//! the pod's its CNI error carries the agent's reason.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use istio_contract::paths;
use netns::Netns;
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Gid, Uid};
use serde_json::{json, Value};
use testbed::mesh::RuleBackend;
use testbed::node::pod_attachment;
use testbed::node_agent::{
    ambient_conflist, ambient_node, ambient_pod, redirection, uid, NodeAgent, RequestKind, ZdsPeer,
};
use testbed::runtime::RuntimeError;
use testbed::{Cluster, NetnsGuard, NetworkConfigList};

const NS: &str = "shop";
/// The agent's node in testbed's scenes (its `NODE_NAME`, every test pod's `spec.nodeName`).
const THIS_NODE: &str = "node-1";
/// `nobody`: the non-root peer.
const NOBODY: u32 = 65534;
/// The log line of every refusal.
const REFUSED_LINE: &str = "plugin event refused";

/// What the agent could have programmed in the netns at `path`: every nftables table, set and chain (the in-pod
/// rules and the host probe set are native nftables here) and the policy routing rules (in-pod connmark routing).
fn programmed(path: &Path) -> String {
    let ns = Netns::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let out = ns
        .run(|| {
            std::process::Command::new("sh").args(["-c", "nft list ruleset; ip rule show; ip -6 rule show"]).output()
        })
        .expect("enter netns")
        .expect("run nft and ip");
    assert!(out.status.success(), "dumping {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// [`programmed`] of each of `paths`, to compare before and after.
fn snapshot(paths: &[PathBuf]) -> Vec<(PathBuf, String)> {
    paths.iter().map(|p| (p.clone(), programmed(p))).collect()
}

#[track_caller]
fn assert_unchanged(before: &[(PathBuf, String)]) {
    for (path, rules) in before {
        assert_eq!(&programmed(path), rules, "something was programmed in {}", path.display());
    }
}

/// The event the plugin sends for `name` in `netns`, with `uid` as `PodUID` when given.
fn event(name: &str, netns: &Path, uid: Option<&str>) -> Value {
    let mut event = json!({
        "Netns": netns, "PodName": name, "PodNamespace": NS,
        "IPs": [{ "address": "10.250.0.9/24", "gateway": "10.250.0.1" }],
    });
    if let Some(uid) = uid {
        event["PodUID"] = json!(uid);
    }
    event
}

fn request(event: &Value) -> Vec<u8> {
    let body = event.to_string();
    format!(
        "POST /cmdadd HTTP/1.1\r\nHost: cni\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The status code and body of a raw HTTP/1.1 answer.
fn parse(raw: &[u8]) -> (u16, String) {
    let raw = String::from_utf8_lossy(raw);
    let status = raw.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status in {raw:?}"));
    (status, raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
}

fn socket_of(c: &Cluster) -> PathBuf {
    c.run_dir().join(paths::PLUGIN_EVENT_SOCKET)
}

/// Posts `event` as root (this test process), as the runtime's plugin does.
fn post(c: &Cluster, event: &Value) -> (u16, String) {
    let mut stream = UnixStream::connect(socket_of(c)).expect("connect to the plugin event socket");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    stream.write_all(&request(event)).expect("send the event");
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse(&raw)
}

/// Posts `event` from a child process running as `uid`/`gid` (no supplementary groups): the kernel records those
/// ids as the connection's peer credentials.
fn post_as(c: &Cluster, uid: u32, gid: u32, event: &Value) -> (u16, String) {
    // Everything the child needs is made before the fork: between fork and exit it only makes system calls, so
    // no lock another thread of this test process held can stop it.
    let addr = UnixAddr::new(&socket_of(c)).expect("socket address");
    let request = request(event);
    let mut buf = vec![0u8; 16 * 1024];
    // Close-on-exec, or a process another test spawns meanwhile would hold the write end open.
    let (from_child, to_parent) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
    // SAFETY: the child runs only the system calls below and leaves with _exit.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            let mut talk = || -> nix::Result<()> {
                nix::unistd::setgroups(&[])?;
                nix::unistd::setgid(Gid::from_raw(gid))?;
                nix::unistd::setuid(Uid::from_raw(uid))?;
                let sock = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
                connect(sock.as_raw_fd(), &addr)?;
                let mut sent = 0;
                while sent < request.len() {
                    sent += nix::unistd::write(&sock, &request[sent..])?;
                }
                loop {
                    let n = nix::unistd::read(&sock, &mut buf)?;
                    if n == 0 {
                        return Ok(());
                    }
                    nix::unistd::write(&to_parent, &buf[..n])?;
                }
            };
            let code = match talk() {
                Ok(()) => 0,
                Err(errno) => errno as i32,
            };
            // SAFETY: leaves the child without running this process's exit handlers or destructors.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            drop(to_parent);
            let mut raw = Vec::new();
            std::fs::File::from(from_child).read_to_end(&mut raw).expect("read the child's answer");
            let status = waitpid(child, None).expect("reap the child");
            assert_eq!(status, WaitStatus::Exited(child, 0), "the child as uid {uid} failed (errno as exit code)");
            parse(&raw)
        }
    }
}

/// How many refusals of `kind` the agent logged.
fn logged(agent: &NodeAgent, kind: &str) -> usize {
    agent.log().lines().filter(|l| l.contains(REFUSED_LINE) && l.contains(kind)).count()
}

#[track_caller]
fn assert_nothing_enrolled(c: &Cluster, peer: &ZdsPeer, pods: &[&str]) {
    let adds: Vec<_> = peer.received().into_iter().filter(|r| r.kind == RequestKind::Add).collect();
    assert!(adds.is_empty(), "the proxy got an AddWorkload: {adds:?}");
    for pod in pods {
        assert_eq!(redirection(c, NS, pod), None, "pod {pod} got the redirection annotation");
    }
}

#[test]
fn events_naming_the_hosts_or_the_agents_own_netns_or_another_kind_of_namespace_are_refused_and_program_nothing() {
    // As the chart runs it: the agent in a netns of its own (the node's here), given the host's as HOST_NETNS (here a
    // netns standing for it, where the agent puts its host probe rules).
    let host = NetnsGuard::new("host");
    let host_netns = host.path().display().to_string();
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[("HOST_NETNS", &host_netns)]);
    let peer = ZdsPeer::connect(&agent);
    c.create(&ambient_pod(NS, "web"));
    let web = uid(&c, NS, "web");
    let before = snapshot(&[host.path(), c.node.netns().path()]);
    assert!(before[0].1.contains("istio"), "the agent put its host probe rules into HOST_NETNS: {}", before[0].1);

    let agents_own = PathBuf::from(format!("/proc/{}/ns/net", agent.pid()));
    let forged: [(PathBuf, &str); 9] = [
        (host.path(), "is the host's network namespace"),
        (c.node.netns().path(), "is the node agent's own network namespace"),
        (agents_own, "is the node agent's own network namespace"),
        // Resolved by the agent: its own namespaces.
        ("/proc/self/ns/net".into(), "is the node agent's own network namespace"),
        ("/proc/self/ns/mnt".into(), "is a mount namespace, not a network namespace"),
        (format!("/proc/{}/ns/mnt", std::process::id()).into(), "is a mount namespace, not a network namespace"),
        ("/proc/self/ns/user".into(), "is a user namespace, not a network namespace"),
        ("/proc/self/status".into(), "is not a network namespace"),
        ("/var/run/netns".into(), "is not a network namespace"),
    ];
    for (netns, why) in &forged {
        let (status, body) = post(&c, &event("web", netns, Some(&web)));
        assert_eq!(status, 403, "{}: {body}", netns.display());
        assert!(body.contains(why) && body.contains(&*netns.to_string_lossy()), "{}: {body}", netns.display());
    }

    assert_unchanged(&before);
    assert_nothing_enrolled(&c, &peer, &["web"]);
    assert_eq!(agent.metric("istio_cni_plugin_requests_total{response_code=\"403\"}"), Some(forged.len() as u64));
    assert_eq!(agent.probes(), (Some(200), Some(200)), "the agent stays healthy");
    // Four or five refusals of each kind within moments: one log line per kind (two, had an interval ended between).
    for kind in ["node_netns", "not_a_netns"] {
        let lines = logged(&agent, kind);
        assert!((1..=2).contains(&lines), "{kind}: {lines} log lines\n{}", agent.log());
    }

    // The real plugin's ADD of the pod still enrolls it.
    c.add_with(ambient_conflist(&c), "web", NS).expect("the plugin's ADD");
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
    assert_eq!(peer.received_for(RequestKind::Add, &web).len(), 1);
}

#[test]
fn events_for_a_pod_of_another_node_or_of_another_uid_are_refused_and_program_nothing() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let peer = ZdsPeer::connect(&agent);
    let mut far = ambient_pod(NS, "far");
    far["spec"]["nodeName"] = json!("node-2");
    c.create(&far);
    let mut unscheduled = ambient_pod(NS, "unscheduled");
    unscheduled["spec"].as_object_mut().unwrap().remove("nodeName");
    c.create(&unscheduled);
    // `web` was deleted and created again under the same name: an event for the old one names the old UID.
    c.create(&ambient_pod(NS, "web"));
    let old = uid(&c, NS, "web");
    c.delete_pod(NS, "web", None);
    c.create(&ambient_pod(NS, "web"));
    let web = uid(&c, NS, "web");
    assert_ne!(old, web);

    let sandboxes = [c.node.pod_netns(), c.node.pod_netns(), c.node.pod_netns()];
    let mut watched: Vec<PathBuf> = sandboxes.iter().map(NetnsGuard::path).collect();
    watched.push(c.node.netns().path());
    let before = snapshot(&watched);

    let other_node = format!("pod shop/far is scheduled on node Some(\"node-2\"), not on this node ({THIS_NODE})");
    let forged = [
        ("far", event("far", &sandboxes[0].path(), Some(&uid(&c, NS, "far"))), other_node),
        ("unscheduled", event("unscheduled", &sandboxes[1].path(), None), "is scheduled on node None".into()),
        (
            "web",
            event("web", &sandboxes[2].path(), Some(&old)),
            format!("has UID {web:?}, the event names UID {old:?}"),
        ),
        ("web", event("web", &sandboxes[2].path(), Some("")), "the event names UID \"\"".into()),
    ];
    for (pod, event, why) in &forged {
        let (status, body) = post(&c, event);
        assert_eq!(status, 403, "{pod}: {body}");
        assert!(body.contains(why.as_str()), "{pod}: {body}");
    }

    assert_unchanged(&before);
    assert_nothing_enrolled(&c, &peer, &["far", "unscheduled", "web"]);
    assert_eq!(agent.metric("istio_cni_plugin_requests_total{response_code=\"403\"}"), Some(forged.len() as u64));
    let lines = (logged(&agent, "other_node"), logged(&agent, "uid_mismatch"));
    assert!(lines.0 >= 1 && lines.1 >= 1 && lines.0 + lines.1 <= 3, "refusals are logged, throttled: {lines:?}");

    // The same event with the pod's UID is the plugin's, and enrolls it; so does Istio's event, without a UID.
    let (status, body) = post(&c, &event("web", &sandboxes[2].path(), Some(&web)));
    assert_eq!((status, body.as_str()), (200, ""));
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
    let adds = peer.received_for(RequestKind::Add, &web);
    assert_eq!(adds.iter().map(|a| a.fds.clone()).collect::<Vec<_>>(), vec![vec![sandboxes[2].open().unwrap().id()]]);
    c.create(&ambient_pod(NS, "legacy"));
    let legacy = c.node.pod_netns();
    assert_eq!(post(&c, &event("legacy", &legacy.path(), None)).0, 200, "an event without PodUID is Istio's");
    assert_eq!(redirection(&c, NS, "legacy").as_deref(), Some("enabled"));
}

#[test]
fn a_peer_that_is_not_root_is_refused_and_programs_nothing() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let peer = ZdsPeer::connect(&agent);
    c.create(&ambient_pod(NS, "web"));
    let web = uid(&c, NS, "web");
    let sandbox = c.node.pod_netns();
    // As on a real node, the path leads through world-searchable dirs (/var/run is 0755) to the 0750 run dir that
    // group root may enter: the peer is `nobody` in group root, as many containers run (OpenShift's default gid).
    std::fs::set_permissions(c.node.dir(), std::fs::Permissions::from_mode(0o755)).expect("chmod the node dir");
    let before = snapshot(&[sandbox.path(), c.node.netns().path()]);

    let forged = event("web", &sandbox.path(), Some(&web));
    const TRIES: usize = 20;
    for _ in 0..TRIES {
        let (status, body) = post_as(&c, NOBODY, 0, &forged);
        assert_eq!(status, 403, "{body}");
        assert!(body.contains(&format!("the peer runs as uid {NOBODY}")), "{body}");
    }

    assert_unchanged(&before);
    assert_nothing_enrolled(&c, &peer, &["web"]);
    assert_eq!(agent.metric("istio_cni_plugin_requests_total{response_code=\"403\"}"), Some(TRIES as u64));
    let lines = logged(&agent, "peer_not_root");
    assert!(
        (1..=2).contains(&lines),
        "{TRIES} refusals in a few seconds log one line (two across an interval): {lines}"
    );

    // The very same event from root is the plugin's.
    assert_eq!(post(&c, &forged), (200, String::new()));
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
}

#[test]
fn the_plugin_sends_the_pods_uid_and_its_cni_error_carries_the_agents_refusal() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let peer = ZdsPeer::connect(&agent);
    c.create(&ambient_pod(NS, "web"));
    let web = uid(&c, NS, "web");
    let list = NetworkConfigList::from_value(ambient_conflist(&c)).expect("conflist");

    // The runtime's sandbox is for another incarnation of the pod.
    let stale = c.node.pod_netns();
    let conf = pod_attachment(&stale, NS, "web", "9a1b-stale");
    let before = snapshot(&[stale.path(), c.node.netns().path()]);
    let error = match c.node.runtime().add(&list, &conf) {
        Err(RuntimeError::Plugin(e)) => e,
        other => panic!("expected the plugin to fail ADD, got {other:?}"),
    };
    c.node.runtime().del(&list, &conf).expect("DEL after the failed ADD");
    assert_eq!((error.plugin.as_str(), error.code), ("istio-cni", Some(11)), "{error}");
    for part in ["node agent refused pod shop/web (403)", "\"9a1b-stale\"", &web] {
        assert!(error.msg.contains(part), "the CNI error carries the agent's reason ({part}): {error}");
    }
    assert_unchanged(&before);
    assert_nothing_enrolled(&c, &peer, &["web"]);

    // With the pod's own UID in CNI_ARGS, as the kubelet's runtime passes it, ADD enrolls the pod.
    let sandbox = c.node.pod_netns();
    let conf = pod_attachment(&sandbox, NS, "web", &web);
    c.node.runtime().add(&list, &conf).unwrap_or_else(|e| panic!("ADD with the pod's UID: {e}\n{}", agent.log()));
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"));
    let adds = peer.received_for(RequestKind::Add, &web);
    assert_eq!(adds.iter().map(|a| a.fds.clone()).collect::<Vec<_>>(), vec![vec![sandbox.open().unwrap().id()]]);
    c.node.runtime().del(&list, &conf).expect("DEL");
}
