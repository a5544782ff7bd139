//! The real node that `scripts/cluster.sh up` runs (etcd, kube-apiserver, controller-manager, scheduler,
//! kube-proxy, containerd and the kubelet, inside the network namespace `istio-real-node`), seen the way a user
//! sees a cluster: `kubectl`, `helm`, `crictl`, and the node's own files.
//!
//! [`RealNode::connect`] finds the running node from its state dir. When no node runs, a test skips (it prints
//! why and returns) unless `REAL_NODE_REQUIRED=1`, which `scripts/test.sh` sets after bringing the node up: there a
//! missing node fails the test.
//!
//! Every wait polls with a deadline ([`RealNode::eventually`]); the deadlines are long because a real kubelet
//! reconciles on its own schedule (pod sync, volume remounts, status updates), not because a test times anything.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The node's name (its `--hostname-override`), as `scripts/cluster.sh` names it.
pub const NODE_NAME: &str = "istio-real-node";
/// The node's IP (the API server listens there on 6443).
pub const NODE_IP: &str = "10.251.0.2";
/// The host's end of the link to the node (`scripts/cluster.sh`'s `HOST_IP`): what the node and its pods reach the
/// host at.
pub const HOST_IP: &str = "10.251.0.1";
/// The namespace our chart is installed into.
pub const RELEASE_NAMESPACE: &str = "istio-system";
/// The helm release name.
pub const RELEASE: &str = "istio-cni";
/// Our image, as `scripts/real-node/images.sh` tags it and the chart renders it with [`install_sets`].
pub const HUB: &str = "localhost";
/// The image tag the chart is given.
pub const TAG: &str = "dev";
/// The app image test pods run (Debian's static busybox: sh, nc, sleep, cat, …).
pub const APP_IMAGE: &str = "localhost/mesh-app:dev";
/// How long a real-node condition may take: pod starts, rollouts, a kubelet sync. `REAL_NODE_DEADLINE_SECS`
/// shortens it for runs that break the product on purpose (every scenario is then expected to fail, quickly).
pub fn deadline() -> Duration {
    let secs = std::env::var("REAL_NODE_DEADLINE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(180);
    Duration::from_secs(secs)
}

/// Where `scripts/cluster.sh` keeps the running node's files.
pub fn state_dir() -> PathBuf {
    std::env::var_os("REAL_NODE_STATE").map(PathBuf::from).unwrap_or_else(|| "/run/istio-cni-rs/real-node".into())
}

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `helm install` settings of the real-node suite: Istio's ambient profile, our image from the node's
/// containerd (never pulled), the bundled proxy with a trial CA. Everything else is Istio's default, including the
/// iptables backend. `REAL_NODE_EXTRA_SETS` (`;`-separated `key=value`) adds settings to every install: a way to
/// break the product on purpose and watch a scenario fail.
pub fn install_sets() -> Vec<String> {
    let mut sets: Vec<String> = [
        "profile=ambient",
        &format!("global.hub={HUB}"),
        &format!("global.tag={TAG}"),
        "global.imagePullPolicy=Never",
        "proxy.enabled=true",
        "proxy.selfSignedCA=true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Ok(extra) = std::env::var("REAL_NODE_EXTRA_SETS") {
        sets.extend(extra.split(';').filter(|s| !s.is_empty()).map(str::to_string));
    }
    sets
}

/// A handle on the running real node.
#[derive(Debug, Clone)]
pub struct RealNode {
    state: PathBuf,
}

impl RealNode {
    /// The running node, or `None` (after printing why) when none runs and `REAL_NODE_REQUIRED` is not `1`.
    pub fn connect() -> Option<Self> {
        let state = state_dir();
        if state.join("admin.kubeconfig").exists() && state.join("pids/kubelet").exists() {
            return Some(Self { state });
        }
        let why = format!("no real node runs (no {}); start one with scripts/cluster.sh up", state.display());
        if std::env::var("REAL_NODE_REQUIRED").as_deref() == Ok("1") {
            panic!("REAL_NODE_REQUIRED=1 but {why}");
        }
        eprintln!("SKIPPED: {why}");
        None
    }

    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> PathBuf {
        self.state.join("admin.kubeconfig")
    }

    /// A command with the node's tools on PATH and the admin kubeconfig: `kubectl`, `crictl`, `helm`.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let path = std::env::var("PATH").unwrap_or_default();
        cmd.env("PATH", format!("{}:{path}", self.state.join("bin").display()))
            .env("KUBECONFIG", self.kubeconfig())
            .env("CRI_CONFIG_FILE", self.state.join("crictl.yaml"))
            .stdin(Stdio::null());
        cmd
    }

    /// Runs `program args`; its output whatever the exit status.
    pub fn run(&self, program: &str, args: &[&str]) -> Output {
        self.command(program).args(args).output().unwrap_or_else(|e| panic!("run {program}: {e}"))
    }

    /// Runs `program args` and returns stdout; panics with stderr when it fails.
    #[track_caller]
    pub fn ok(&self, program: &str, args: &[&str]) -> String {
        let out = self.run(program, args);
        assert!(
            out.status.success(),
            "{program} {} failed ({}):\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl args`, which must succeed: its stdout.
    #[track_caller]
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.ok("kubectl", args)
    }

    /// `kubectl args -o json`, parsed; `None` when kubectl fails (e.g. not found).
    pub fn get_json(&self, args: &[&str]) -> Option<Value> {
        let mut all: Vec<&str> = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        let out = self.run("kubectl", &all);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).expect("kubectl prints JSON"))
    }

    /// `kubectl apply -f -` of `yaml`.
    #[track_caller]
    pub fn apply(&self, yaml: &str) {
        self.stdin_ok("kubectl", &["apply", "-f", "-"], yaml);
    }

    /// Runs `program args` with `input` on stdin; panics when it fails.
    #[track_caller]
    pub fn stdin_ok(&self, program: &str, args: &[&str], input: &str) -> String {
        use std::io::Write;
        let mut child = self
            .command(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run {program}: {e}"));
        child.stdin.take().unwrap().write_all(input.as_bytes()).expect("write stdin");
        let out = child.wait_with_output().expect("wait");
        assert!(
            out.status.success(),
            "{program} {} failed:\n{}\ninput:\n{input}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Polls `probe` every 250 ms until it yields a value; panics naming `what` (and `context()`) after
    /// [`deadline`].
    #[track_caller]
    pub fn eventually<T>(&self, what: &str, probe: impl FnMut() -> Option<T>) -> T {
        self.eventually_or(what, probe, String::new)
    }

    /// [`Self::eventually`] with context for the failure message.
    #[track_caller]
    pub fn eventually_or<T>(&self, what: &str, probe: impl FnMut() -> Option<T>, context: impl Fn() -> String) -> T {
        let limit = deadline();
        // A `match`, not a closure: the panic then names the test's line (`#[track_caller]`).
        match crate::wait::within_every(Instant::now(), limit, Duration::from_millis(250), probe) {
            Some(v) => v,
            None => panic!("timed out after {limit:?} waiting until {what}\n{}", context()),
        }
    }

    /// The release's user-supplied values, as `helm get values -o json` prints them (`None` when not installed).
    fn release_values(&self) -> Option<Value> {
        let out = self.run("helm", &["get", "values", RELEASE, "-n", RELEASE_NAMESPACE, "-o", "json"]);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).unwrap_or(Value::Null))
    }

    /// Our chart installed with exactly [`install_sets`] (a test that changed a setting and failed before putting
    /// it back leaves it changed: this puts it back), every DaemonSet rolled out. The values of the last install
    /// with exactly these settings are kept in the state dir, keyed by the settings, and compared with the release's.
    #[track_caller]
    pub fn ensure_installed(&self) {
        let record = self.state.join("default-values.json");
        let sets = install_sets();
        let want: Option<Value> = std::fs::read(&record)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
            .filter(|r| r["sets"] == serde_json::json!(sets))
            .map(|r| r["values"].clone());
        let have = self.release_values();
        if have.is_none() || have != want {
            self.helm_install(&[]);
            let values = self.release_values().expect("the release was just installed");
            let record_json = serde_json::json!({"sets": sets, "values": values});
            std::fs::write(&record, record_json.to_string()).expect("write the default values");
        }
        self.wait_rollout("istio-cni-node");
        self.wait_rollout("hbone-proxy");
    }

    /// `helm install` (or `upgrade --install`) of our chart with [`install_sets`] and `extra` settings, then waits
    /// until both DaemonSets are rolled out.
    #[track_caller]
    pub fn helm_install(&self, extra: &[&str]) {
        let chart = repo().join("charts/istio-cni");
        let mut args: Vec<String> = ["upgrade", "--install", RELEASE]
            .iter()
            .map(|s| s.to_string())
            .chain([chart.display().to_string()])
            .chain(["-n", RELEASE_NAMESPACE, "--create-namespace"].iter().map(|s| s.to_string()))
            .collect();
        for set in install_sets().iter().map(String::as_str).chain(extra.iter().copied()) {
            args.push("--set".into());
            args.push(set.into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.ok("helm", &args);
        self.wait_rollout("istio-cni-node");
        self.wait_rollout("hbone-proxy");
    }

    /// Waits until DaemonSet `name` in the release namespace has every pod updated and ready.
    #[track_caller]
    pub fn wait_rollout(&self, name: &str) {
        let ds = format!("daemonset/{name}");
        self.eventually_or(
            &format!("{ds} is rolled out"),
            || {
                let out = self.run("kubectl", &["rollout", "status", &ds, "-n", RELEASE_NAMESPACE, "--timeout=5s"]);
                out.status.success().then_some(())
            },
            || self.describe_namespace(RELEASE_NAMESPACE),
        );
    }

    /// `helm uninstall`, waiting until every pod of the release is gone.
    #[track_caller]
    pub fn helm_uninstall(&self) {
        self.ok("helm", &["uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait", "--timeout", "120s"]);
        self.eventually("the release's pods are gone", || {
            let pods = self.get_json(&["pods", "-n", RELEASE_NAMESPACE])?;
            pods["items"].as_array().is_some_and(|a| a.is_empty()).then_some(())
        });
    }

    /// The release namespace's pods and recent events, for failure messages.
    pub fn describe_namespace(&self, ns: &str) -> String {
        let pods = self.run("kubectl", &["get", "pods", "-n", ns, "-o", "wide"]);
        let events = self.run("kubectl", &["get", "events", "-n", ns, "--sort-by=.lastTimestamp"]);
        format!(
            "pods in {ns}:\n{}{}\nevents in {ns}:\n{}",
            String::from_utf8_lossy(&pods.stdout),
            String::from_utf8_lossy(&pods.stderr),
            String::from_utf8_lossy(&events.stdout)
        )
    }

    /// A namespace, created (or updated) with `labels`.
    #[track_caller]
    pub fn namespace(&self, name: &str, labels: &[(&str, &str)]) {
        let labels: serde_json::Map<String, Value> =
            labels.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect();
        let ns =
            serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}});
        self.apply(&ns.to_string());
    }

    /// Deletes namespace `name` and waits until it is gone.
    #[track_caller]
    pub fn delete_namespace(&self, name: &str) {
        let _ = self.run("kubectl", &["delete", "namespace", name, "--ignore-not-found", "--wait=false"]);
        self.eventually(&format!("namespace {name} is gone"), || {
            (!self.run("kubectl", &["get", "namespace", name]).status.success()).then_some(())
        });
    }

    /// Pod `ns/name` as JSON, if it exists.
    pub fn pod(&self, ns: &str, name: &str) -> Option<Value> {
        self.get_json(&["pod", name, "-n", ns])
    }

    /// Waits until pod `ns/name` is Ready; its JSON.
    #[track_caller]
    pub fn wait_ready(&self, ns: &str, name: &str) -> Value {
        self.eventually_or(
            &format!("pod {ns}/{name} is Ready"),
            || {
                let pod = self.pod(ns, name)?;
                let ready = pod["status"]["conditions"]
                    .as_array()?
                    .iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True");
                ready.then_some(pod)
            },
            || self.describe_namespace(ns),
        )
    }

    /// The running pods of `ns` matching `selector` (e.g. `app=web`).
    pub fn pods(&self, ns: &str, selector: &str) -> Vec<Value> {
        self.get_json(&["pods", "-n", ns, "-l", selector])
            .and_then(|v| v["items"].as_array().cloned())
            .unwrap_or_default()
    }

    /// The istio-cni-node pod (one node, one pod), once it exists.
    #[track_caller]
    pub fn agent_pod(&self) -> String {
        self.daemon_pod("k8s-app=istio-cni-node")
    }

    /// The hbone-proxy pod.
    #[track_caller]
    pub fn proxy_pod(&self) -> String {
        self.daemon_pod("k8s-app=hbone-proxy")
    }

    #[track_caller]
    fn daemon_pod(&self, selector: &str) -> String {
        self.eventually(&format!("a running {selector} pod"), || {
            self.pods(RELEASE_NAMESPACE, selector)
                .into_iter()
                .find(|p| p["status"]["phase"] == "Running" && p["metadata"]["deletionTimestamp"].is_null())
                .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
        })
    }

    /// `kubectl exec -n ns pod -c container -- cmd…`: whether it succeeded, and stdout + stderr.
    pub fn exec(&self, ns: &str, pod: &str, container: &str, cmd: &[&str]) -> (bool, String) {
        let mut args = vec!["exec", "-n", ns, pod, "-c", container, "--"];
        args.extend_from_slice(cmd);
        let out = self.run("kubectl", &args);
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    /// The first pid of pod `ns/name`'s sandbox (its pause process), from the runtime, as `crictl` tells it.
    pub fn sandbox_pid(&self, ns: &str, name: &str) -> Option<u32> {
        let id = self.sandbox_id(ns, name)?;
        let out = self.run("crictl", &["inspectp", &id]);
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        v["info"]["pid"].as_u64().map(|p| p as u32)
    }

    /// The network namespace file the runtime made for pod `ns/name`'s ready sandbox (under `/var/run/netns`,
    /// which the node shares with the host), from its runtime spec.
    pub fn sandbox_netns(&self, ns: &str, name: &str) -> Option<PathBuf> {
        let id = self.sandbox_id(ns, name)?;
        let out = self.run("crictl", &["inspectp", &id]);
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        let namespaces = v["info"]["runtimeSpec"]["linux"]["namespaces"].as_array()?;
        let net = namespaces.iter().find(|n| n["type"] == "network")?;
        net["path"].as_str().filter(|p| !p.is_empty()).map(PathBuf::from)
    }

    /// The id of pod `ns/name`'s ready sandbox in containerd.
    pub fn sandbox_id(&self, ns: &str, name: &str) -> Option<String> {
        let out =
            self.run("crictl", &["pods", "--namespace", ns, "--name", &format!("^{name}$"), "--state", "ready", "-q"]);
        String::from_utf8_lossy(&out.stdout).lines().next().map(str::to_string)
    }

    /// The node's init as the host sees it: PID 1 of the node's PID namespace, in the node's network namespace,
    /// with the node's /proc in its mount namespace.
    pub fn init_pid(&self) -> u32 {
        let text = std::fs::read_to_string(self.state.join("pids/init")).expect("the node's init pid file");
        text.trim().parse().expect("a pid")
    }

    /// `nsenter` into the node's network and mount namespaces (where /proc shows the node's pids).
    fn node_nsenter(&self) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.args(["--target", &self.init_pid().to_string(), "--net", "--mount", "--"]);
        cmd
    }

    /// Runs `program args` inside pod `ns/name`'s network namespace (entered through its sandbox's pid, which
    /// the runtime reports in the node's PID namespace): its stdout, or `None` when the pod has no running
    /// sandbox or the command fails.
    pub fn in_pod_netns(&self, ns: &str, name: &str, program: &str, args: &[&str]) -> Option<String> {
        let pid = self.sandbox_pid(ns, name)?;
        let out = self
            .node_nsenter()
            .arg("nsenter")
            .arg(format!("--net=/proc/{pid}/ns/net"))
            .arg("--")
            .arg(program)
            .args(args)
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs `program args` in the node's network namespace: its output.
    pub fn in_node(&self, program: &str, args: &[&str]) -> Output {
        self.node_nsenter().arg(program).args(args).output().unwrap_or_else(|e| panic!("nsenter {program}: {e}"))
    }

    /// `kubectl args` run on the node (its network namespace: Service IPs work there, through kube-proxy), as a
    /// process of the node would run it: whether it succeeded, and stdout + stderr.
    pub fn kubectl_on_node(&self, args: &[&str]) -> (bool, String) {
        let kubectl = self.state.join("bin/kubectl");
        let out = self.in_node(&kubectl.to_string_lossy(), args);
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    /// `scripts/cluster.sh restart COMPONENT` (kubelet or containerd).
    #[track_caller]
    pub fn restart(&self, component: &str) {
        let out = Command::new(repo().join("scripts/cluster.sh"))
            .args(["restart", component])
            .output()
            .expect("run scripts/cluster.sh");
        assert!(out.status.success(), "restart {component}: {}", String::from_utf8_lossy(&out.stderr));
    }
}
