//! Scenario `istiod-scale` (issue #32): one node whose proxy runs with `CONTROL_PLANE=istiod` against the in-process
//! fake istiod (`testbed::fake_istiod`, served in the node's netns), which feeds it N workloads of other nodes
//! (10,000 by default, [`WORKLOADS_ENV`] to change; a few hundred under `--quick`). Reported: the proxy's resident
//! memory with no workload known and with the N (so the memory per known workload), the time from pushing the N to
//! the proxy ACKing them (applied), and the time from pushing a DENY policy over xDS to the first new connection it refuses
//! (a client pod probing a server pod of the same node over HBONE, the fast path off), median over the rounds.
//! Unlike `istiod-policy` (the real istiod, from `kubectl apply`), no istiod debounce is in the figure: it is the
//! proxy's own part of a policy change.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::json;
use testbed::fake_istiod::{exact, pod_workload, FakeControlPlane, TRUST_DOMAIN};
use testbed::hbone_proxy::Proxy;
use testbed::mesh::RuleBackend;
use testbed::node_agent::{ambient_conflist, ambient_pod, namespace, NodeAgent};
use testbed::{Cluster, Pod};
use xds::wire::security::{Action, Authorization, Group, Match, Rules, Scope};
use xds::wire::ResourceType;

use crate::apps::{Mode, Server, ECHO_PORT};
use crate::process_figures::rss_kib;
use crate::report::Section;
use crate::stats::{Counts, Summary};

const NAME: &str = "istiod-scale";
const TITLE: &str = "istiod mode: memory per known workload, and a pushed DENY to its first refusal";
/// Overrides the number of workloads fed to the proxy.
const WORKLOADS_ENV: &str = "ISTIOD_SCALE_WORKLOADS";
const WORKLOADS: usize = 10_000;
const QUICK_WORKLOADS: usize = 300;
/// The node's name for istiod, and the benchmark pods' namespace.
const NODE: &str = "bench-node";
const NS: &str = "bench";
/// How long the proxy is left to settle before a memory reading.
const SETTLE: Duration = Duration::from_secs(2);
const QUICK_SETTLE: Duration = Duration::from_millis(300);
/// How long one probe (connect, write, read) may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a change may take before the run is declared broken.
const LIMIT: Duration = Duration::from_secs(60);

/// Whether one new connection from `client` to the echo app at `server` gets its bytes back.
fn answered(client: &netns::Netns, server: SocketAddr) -> bool {
    let probe = || {
        let mut stream = TcpStream::connect_timeout(&server, PROBE_TIMEOUT).ok()?;
        stream.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
        stream.write_all(b"ping").ok()?;
        let mut buf = [0u8; 4];
        stream.read_exact(&mut buf).ok()?;
        (&buf == b"ping").then_some(())
    };
    client.run(probe).expect("enter the client pod").is_some()
}

/// Probes until a probe's outcome is `allowed`; when the client saw that outcome (the probe ended).
fn until_outcome(client: &netns::Netns, server: SocketAddr, allowed: bool) -> Instant {
    let start = Instant::now();
    loop {
        if answered(client, server) == allowed {
            return Instant::now();
        }
        assert!(start.elapsed() < LIMIT, "{NAME}: no {} within {LIMIT:?}", if allowed { "answer" } else { "refusal" });
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How many workloads the proxy's `/config_dump` says it knows (listed plus omitted).
fn known(proxy: &Proxy) -> Option<usize> {
    let dump = proxy.config_dump()?;
    let listed = dump["workloads"].as_array()?.len();
    Some(listed + usize::try_from(dump["workloads_omitted"].as_u64()?).ok()?)
}

/// Ambient pod `name` (service account `name`) on the node, placed there for the fake CA first.
fn pod(cluster: &Cluster, fake: &FakeControlPlane, name: &str) -> Pod {
    fake.place_pod(NS, name, name, NODE);
    let mut object = ambient_pod(NS, name);
    object["spec"]["serviceAccountName"] = json!(name);
    cluster.create(&object);
    cluster.add_with(ambient_conflist(cluster), name, NS).expect("CNI ADD")
}

/// The `i`th workload of another node, at 100.64.0.0 + i + 1.
fn other_workload(i: usize) -> xds::wire::workload::Workload {
    let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 0)) + 1 + i as u32);
    pod_workload(NS, &format!("w-{i}"), &format!("sa-{}", i % 50), IpAddr::V4(ip), &format!("node-{}", i % 100))
}

/// The scenario: `counts.iterations` DENY rounds after `counts.warmup` untimed ones.
pub fn run(counts: Counts, quick: bool) -> Section {
    let n = std::env::var(WORKLOADS_ENV).ok().and_then(|v| v.parse().ok()).unwrap_or(if quick {
        QUICK_WORKLOADS
    } else {
        WORKLOADS
    });
    let settle = if quick { QUICK_SETTLE } else { SETTLE };
    let cluster = Cluster::with_backend(RuleBackend::Nftables);
    cluster.api.upsert(namespace(NS, json!({}))).expect("store namespace");
    let agent = NodeAgent::start(&cluster, &[("LOG_LEVEL", "warn")]);
    let mut fake = FakeControlPlane::start_in(cluster.node.netns(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    let mut env = fake.add_node(NODE, "ztunnel-bench", IpAddr::V4(Ipv4Addr::LOCALHOST));
    env.push(("LOG_LEVEL".into(), "warn".into()));
    env.push(("SAME_NODE_FAST_PATH".into(), "false".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let dir = tempfile::Builder::new().prefix("bench-istiod-").tempdir().expect("proxy dir");
    let proxy = Proxy::start(&cluster, &agent, dir.path(), &dir.path().join("workloads.yaml"), &env);
    let (client, server) = (pod(&cluster, &fake, "client"), pod(&cluster, &fake, "server"));
    let app = Server::start(&server.netns, ECHO_PORT, Mode::Echo);

    std::thread::sleep(settle);
    let empty = rss_kib(proxy.pid());
    let mut workloads: Vec<_> = (0..n).map(other_workload).collect();
    for (name, p) in [("client", &client), ("server", &server)] {
        workloads.push(pod_workload(NS, name, name, IpAddr::V4(p.ip), NODE));
    }
    // The fake encodes the resources as they are set, before its streams push them: timed from the push.
    fake.set_workloads(workloads);
    let pushed = Instant::now();
    let version = fake.version();
    // Waiting on the proxy's ACK rather than its `/config_dump`, whose JSON would be in the memory reading.
    assert!(fake.wait_synced(version, 1, LIMIT), "{NAME}: the proxy did not apply the {n} workloads within {LIMIT:?}");
    let applied = pushed.elapsed();
    std::thread::sleep(settle);
    let full = rss_kib(proxy.pid());
    assert_eq!(known(&proxy), Some(n + 2), "{NAME}: the proxy lists every workload istiod sent");
    println!("{NAME}: {n} workloads applied in {applied:?}; RSS {empty} KiB with none, {full} KiB with them");

    let ns = client.netns.open().expect("open the client pod's netns");
    let target = SocketAddr::from((server.ip, ECHO_PORT));
    until_outcome(&ns, target, true);
    // What one answered probe takes: the resolution of the figures below.
    let probes: Vec<Duration> = (0..20)
        .map(|_| {
            let at = Instant::now();
            assert!(answered(&ns, target), "{NAME}: a probe went unanswered without a policy");
            at.elapsed()
        })
        .collect();
    let probe = Summary::of(&probes).median;
    let deny = Authorization {
        name: "deny-client".into(),
        namespace: NS.into(),
        scope: Scope::Namespace as i32,
        action: Action::Deny as i32,
        groups: vec![Group {
            rules: vec![Rules {
                matches: vec![Match {
                    principals: vec![exact(&format!("{TRUST_DOMAIN}/ns/{NS}/sa/client"))],
                    ..Default::default()
                }],
            }],
        }],
        ..Default::default()
    };
    let (mut denied, mut lifted) = (Vec::new(), Vec::new());
    let mut acked = Vec::new();
    for round in 0..counts.warmup + counts.iterations {
        let at = Instant::now();
        fake.set_policy(deny.clone());
        let version = fake.version();
        // The proxy's ACK of the push (it ACKs once applied), watched beside the probes.
        let (took, ack) = std::thread::scope(|scope| {
            let ack = scope.spawn(|| {
                assert!(fake.wait_synced(version, 1, LIMIT), "{NAME}: the proxy never ACKed the DENY");
                at.elapsed()
            });
            let took = until_outcome(&ns, target, false).saturating_duration_since(at);
            (took, ack.join().expect("ACK watcher"))
        });
        let at = Instant::now();
        fake.remove(ResourceType::Authorization, &format!("{NS}/deny-client"));
        let back = until_outcome(&ns, target, true).saturating_duration_since(at);
        if round >= counts.warmup {
            denied.push(took);
            acked.push(ack);
            lifted.push(back);
        }
    }
    drop(app);
    fake.stop();
    drop(proxy);

    let ms = |x: Duration| x.as_secs_f64() * 1000.0;
    let mib = |kib: u64| kib as f64 / 1024.0;
    let per = (full.saturating_sub(empty) * 1024) as f64 / n as f64;
    let body = format!(
        "One node; our proxy with `CONTROL_PLANE=istiod` against the in-process fake istiod \
         (`testbed::fake_istiod`: Delta xDS and the CA in the node's netns), which sends it {n} workloads of other \
         nodes (HBONE, 50 service accounts, 100 nodes; `{WORKLOADS_ENV}` changes the count) plus the two benchmark \
         pods, in responses of 1,000. Memory is the proxy's RSS {settle:?} after the change, with the two pods \
         enrolled.\n\n\
         | known workloads | proxy RSS |\n|---:|---:|\n\
         | 0 | {:.1} MiB |\n| {n} | {:.1} MiB |\n\n\
         Memory per known workload: {per:.0} bytes. From the push (the fake's diff, then {} response(s) of at \
         most 1,000) to the proxy's ACK of all {n} (applied): {:.0} ms.\n\n\
         A client pod probes a server pod of the same node over HBONE (`SAME_NODE_FAST_PATH=false`) with a new \
         connection every millisecond or so; each round pushes a DENY of the client's identity over xDS and times \
         to the end of the first refused probe (when the client sees the refusal), then removes it and times to \
         the end of the first answered one; an answered probe takes {:.1} ms (median), the figures' resolution. {} \
         rounds after {} untimed; no istiod debounce is included (the `istiod-policy` scenario has the real \
         istiod's).\n\n\
         | change | median | p90 | max |\n|---|---:|---:|---:|\n{}{}{}",
        mib(empty),
        mib(full),
        (n + 2).div_ceil(1000),
        ms(applied),
        ms(probe),
        counts.iterations,
        counts.warmup,
        Summary::ms_row("DENY pushed → the proxy's ACK (applied)", &acked, 1),
        Summary::ms_row("DENY pushed → first connection refused", &denied, 1),
        Summary::ms_row("DENY removed → first connection answered", &lifted, 1),
    );
    Section { name: NAME, title: TITLE.into(), body }
}
