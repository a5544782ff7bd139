//! Scenario `istiod-policy` (issue #32): on the real node (`scripts/cluster.sh up`), with Istio's own istiod and our
//! proxy installed by our chart with `proxy.controlPlane=istiod`, the time from an `AuthorizationPolicy` change
//! stored in the API server until our proxy enforces it: the path a user's `kubectl apply` takes (API server →
//! istiod's informer and debounce → Delta xDS push → the proxy's policies).
//!
//! How it is measured: an app pod in an ambient namespace, and a client pod in a namespace outside the mesh. A
//! prober thread in the client pod's network namespace (the runtime's netns file, entered with setns) connects to the
//! app every [`PROBE_EVERY`], sends a line and reads the answer: an answer means allowed, a reset or an empty read
//! means refused (the proxy resets plaintext it denies). Each round applies a DENY-everything policy in the app's
//! namespace, taking the time when `kubectl apply` returned (the object is stored), and waits for the first refused
//! probe; then deletes it and waits for the first answered probe. Without a real node, or without Istio's
//! `pilot-discovery` built, the scenario says so and reports nothing.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use testbed::real_istiod::RealIstiod;
use testbed::real_node::{RealNode, APP_IMAGE};

use crate::report::Section;
use crate::stats::{Counts, Summary};

/// The app's namespace (ambient) and the client's (not in the mesh).
const APP_NS: &str = "bench-policy";
const CLIENT_NS: &str = "bench-policy-client";
/// Port the app answers on.
const APP_PORT: u16 = 8080;
/// How often the prober connects.
const PROBE_EVERY: Duration = Duration::from_millis(10);
/// How long one connection attempt (connect, write, read) may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a change may take before the round is declared broken.
const LIMIT: Duration = Duration::from_secs(60);

const NAME: &str = "istiod-policy";
const TITLE: &str = "istiod mode: from an AuthorizationPolicy change in the API to enforcement";

/// Whether one connection to `app` from the current netns got the app's answer.
fn answered(app: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&app, PROBE_TIMEOUT) else { return false };
    let _ = stream.set_read_timeout(Some(PROBE_TIMEOUT));
    if stream.write_all(b"ping\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(stream.read(&mut buf), Ok(n) if n > 0 && buf[..n].starts_with(b"pong"))
}

/// Probes `app` from inside `netns` every [`PROBE_EVERY`] until a probe's outcome is `allowed`; when that was.
fn until_outcome(netns: &netns::Netns, app: SocketAddr, allowed: bool) -> Instant {
    let start = Instant::now();
    netns
        .run(|| loop {
            let at = Instant::now();
            if answered(app) == allowed {
                return at;
            }
            assert!(
                start.elapsed() < LIMIT,
                "{NAME}: no {} within {LIMIT:?}",
                if allowed { "answer" } else { "refusal" }
            );
            std::thread::sleep(PROBE_EVERY);
        })
        .expect("enter the client pod's netns")
}

fn skipped(why: &str) -> Section {
    println!("{NAME}: skipped: {why}");
    Section { name: NAME, title: TITLE.into(), body: format!("Not measured in this run: {why}.\n") }
}

/// The pods of the scenario: an app in an ambient namespace, a client outside the mesh.
fn pods(node: &RealNode) {
    for ns in [APP_NS, CLIENT_NS] {
        node.delete_namespace(ns);
    }
    node.namespace(APP_NS, &[(istio_contract::names::DATAPLANE_MODE_LABEL, "ambient")]);
    node.namespace(CLIENT_NS, &[]);
    node.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: app, namespace: {APP_NS}}}\nspec:\n  \
         terminationGracePeriodSeconds: 1\n  containers:\n  - name: app\n    image: {APP_IMAGE}\n    \
         imagePullPolicy: Never\n    command: [\"nc\", \"-ll\", \"-p\", \"{APP_PORT}\", \"-e\", \"sh\", \"-c\", \
         \"read l; echo pong\"]\n"
    ));
    node.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: client, namespace: {CLIENT_NS}}}\nspec:\n  \
         terminationGracePeriodSeconds: 1\n  containers:\n  - name: client\n    image: {APP_IMAGE}\n    \
         imagePullPolicy: Never\n    command: [\"sleep\", \"100000\"]\n"
    ));
}

/// The scenario: `counts.iterations` rounds of DENY then delete, after `counts.warmup` untimed rounds.
pub fn run(counts: Counts) -> Section {
    let Some(node) = RealNode::connect() else { return skipped("no real node runs (scripts/cluster.sh up)") };
    let Some(istiod) = RealIstiod::start(&node) else {
        return skipped("Istio's pilot-discovery is not built (scripts/istio-ref/build.sh pilot-discovery)");
    };
    println!("{NAME}: installing our chart with proxy.controlPlane=istiod");
    node.helm_install(&["proxy.controlPlane=istiod"]);
    pods(&node);
    let app = node.wait_ready(APP_NS, "app");
    node.wait_ready(CLIENT_NS, "client");
    let ip = app["status"]["podIP"].as_str().expect("the app pod's IP").to_owned();
    let app = SocketAddr::new(ip.parse().expect("an IP"), APP_PORT);
    let client = node.sandbox_netns(CLIENT_NS, "client").expect("the client pod's netns file");
    let netns = netns::Netns::open(Path::new(&client)).expect("open the client pod's netns");
    until_outcome(&netns, app, true);

    let deny = format!(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: deny-all, namespace: {APP_NS}}}\n\
         spec:\n  action: DENY\n  rules:\n  - {{}}\n"
    );
    let (mut denied, mut lifted) = (Vec::new(), Vec::new());
    for round in 0..counts.warmup + counts.iterations {
        node.apply(&deny);
        let stored = Instant::now();
        let took = until_outcome(&netns, app, false).saturating_duration_since(stored);
        node.kubectl(&["delete", "authorizationpolicy", "deny-all", "-n", APP_NS]);
        let deleted = Instant::now();
        let back = until_outcome(&netns, app, true).saturating_duration_since(deleted);
        if round >= counts.warmup {
            denied.push(took);
            lifted.push(back);
        }
    }
    drop(istiod);
    for ns in [APP_NS, CLIENT_NS] {
        node.delete_namespace(ns);
    }
    node.helm_install(&[]);

    let body = format!(
        "On the real node (kube-apiserver, kubelet, containerd), Istio's own istiod (`pilot-discovery` from the pinned \
         module, its default debounce) and our proxy installed by our chart with `proxy.controlPlane=istiod`. A client \
         pod outside the mesh connects to an app pod of an ambient namespace every {} ms (a line, then the answer); \
         each round applies an `AuthorizationPolicy` that denies everything in the app's namespace and times from \
         `kubectl apply` returning (the object stored) to the first refused connection, then deletes it and times to \
         the first answered one. {} rounds after {} untimed.\n\n\
         | change | median | p90 | max |\n|---|---:|---:|---:|\n{}{}\n\
         The figures include istiod's debounce (`PILOT_DEBOUNCE_AFTER`, 100 ms by default) and the prober's \
         {} ms period.\n",
        PROBE_EVERY.as_millis(),
        counts.iterations,
        counts.warmup,
        Summary::ms_row("DENY applied → first connection refused", &denied, 0),
        Summary::ms_row("DENY deleted → first connection answered", &lifted, 0),
        PROBE_EVERY.as_millis(),
    );
    Section { name: NAME, title: TITLE.into(), body }
}
