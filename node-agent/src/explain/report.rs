//! The explain report: what the agent knows about one pod, as JSON. The agent builds it
//! ([`super::build`]), serves it on its admin port ([`crate::admin`]), and `node-agent explain` reads it back
//! and prints it ([`super::render`]): one model, so the text and `-o json` say the same thing.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// Everything explain says about one pod.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// `namespace/name`.
    pub pod: String,
    /// The pod's UID.
    pub uid: String,
    /// One line: `in mesh (ambient)`, `in mesh (sidecar)`, `not in mesh: <reason>`, `enrollment failed: <error>`.
    pub verdict: String,
    /// Which data plane the pod belongs to.
    pub mode: Mode,
    /// What decided the mode: the enablement selector, annotation, label or exclusion.
    pub reason: String,
    /// The pod's network namespace, as the agent holds or found it.
    pub netns: Netns,
    /// The pod's IPs (the plugin's, for an enrolled pod; else its status').
    pub ips: Vec<IpAddr>,
    /// The in-pod rules expected and found (ambient pods).
    pub rules: Rules,
    /// What the node proxy was told about the pod over ZDS, or answered (ambient pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zds: Option<ProxyState>,
    /// The proxy's sockets inside the pod, on Istio's capture ports (ambient pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listeners: Option<Listeners>,
    /// Whether the pod's IPs are in the host probe set, so kubelet probes pass the proxy (ambient pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_probe: Option<HostProbe>,
    /// The last error of the pod's enrollment, and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<Timestamped>,
    /// The latest enrollment, step by step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// The plugin's sidecar decision (sidecar pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar: Option<Sidecar>,
    /// The agent's latest periodic drift check of the pod, and its repairs (`DRIFT_CHECK_INTERVAL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<DriftCheck>,
    /// The node's latest host probe self-test (`PROBE_SELFTEST_INTERVAL`; one enrolled pod stands for all): whether
    /// kubelet probes reach ambient pods from the probe SNAT address (ambient pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_selftest: Option<ProbeSelfTest>,
}

/// The node's latest host probe self-test (see `crate::probe_selftest`), as explain shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeSelfTest {
    /// `ok`, `fail` or `no_pod`, as the `result` label of `nodeagent_probe_selftest_runs_total`.
    pub verdict: String,
    /// The pod it tested (`namespace/name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// What the tested pod saw, or why the connection never arrived.
    pub detail: String,
    /// When it ran (RFC 3339).
    pub at: String,
}

/// The latest drift check of the pod (see `crate::drift`), as explain shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriftCheck {
    /// When it ran (RFC 3339).
    pub checked_at: String,
    /// Whether the rules (or the host probe entry) had drifted then.
    pub drifted: bool,
    /// Rule lines missing then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// Rule lines found then that were not expected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unexpected: Vec<String>,
    /// When the pod was last repaired (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_repair: Option<String>,
    /// Repairs of the pod since the agent started.
    pub repairs: u64,
    /// Why the check or its repair failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A pod's data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Enrolled (or to be enrolled) by this agent, traffic through the node proxy.
    Ambient,
    /// An injected sidecar captures its traffic.
    Sidecar,
    /// Not in the mesh.
    None,
}

impl Mode {
    /// The name explain prints.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ambient => "ambient",
            Mode::Sidecar => "sidecar",
            Mode::None => "none",
        }
    }
}

/// The pod's netns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Netns {
    /// Its inode (as `ls -l /proc/<pid>/ns/net` shows `net:[inode]`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inode: Option<u64>,
    /// Where it came from (`held since enrollment`, `found through /proc`), or why it is unknown.
    pub source: String,
}

/// The in-pod rules, by backend, with a diff. `error` alone when they were not inspected.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rules {
    /// `nftables`, `iptables-nft`, `iptables-legacy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// What the agent would program.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expected: Vec<String>,
    /// What the netns holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub found: Vec<String>,
    /// Expected but not found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// Found but not expected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unexpected: Vec<String>,
    /// Why they could not be inspected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Rules {
    /// Rules that were not inspected, and why.
    pub fn not_inspected(why: impl Into<String>) -> Self {
        Rules { error: Some(why.into()), ..Rules::default() }
    }
}

/// What the node proxy knows of the pod (ZDS).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ProxyState {
    /// Nothing sent yet.
    NotSent,
    /// `AddWorkload` sent, no answer yet.
    Sent,
    /// The proxy acked `AddWorkload`.
    Acked,
    /// In the cache since a restart of the agent: the proxy gets it in its next snapshot.
    Snapshot,
    /// The proxy answered with an error, or none was connected.
    Error {
        /// The ZDS error.
        message: String,
    },
}

impl ProxyState {
    /// One line.
    pub fn describe(&self) -> String {
        match self {
            ProxyState::NotSent => "not sent".into(),
            ProxyState::Sent => "sent, not acked yet".into(),
            ProxyState::Acked => "acked".into(),
            ProxyState::Snapshot => "in the cache since the agent's restart (sent in each proxy snapshot)".into(),
            ProxyState::Error { message } => format!("error: {message}"),
        }
    }
}

/// The proxy's sockets inside the pod on Istio's capture ports.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listeners {
    /// Each one found.
    #[serde(default)]
    pub found: Vec<Listener>,
    /// The capture ports with no socket.
    #[serde(default)]
    pub missing: Vec<u16>,
    /// Why they could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listener {
    /// `tcp`, `tcp6`, `udp`, `udp6`.
    pub protocol: String,
    /// The address it is bound to.
    pub address: String,
    /// Its port.
    pub port: u16,
    /// What Istio uses the port for.
    pub role: String,
}

/// The pod's entries in the host probe set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostProbe {
    /// Every IP of the pod the set takes has an entry naming its UID.
    pub in_set: bool,
    /// Why the set could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A message and its time (RFC 3339).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timestamped {
    /// What happened.
    pub message: String,
    /// When.
    pub at: String,
}

/// The pod's latest enrollment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// `plugin`, `watch` or `restore`.
    pub source: String,
    /// The IPs it enrolled the pod with.
    #[serde(default)]
    pub ips: Vec<IpAddr>,
    /// When it began (RFC 3339).
    pub started_at: String,
    /// The sum of its steps, once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_ms: Option<f64>,
    /// Its steps, in order.
    pub phases: Vec<Phase>,
    /// What the proxy was told or answered.
    pub proxy: ProxyState,
    /// `in progress`, `enrolled`, `failed: <error>`.
    pub outcome: String,
    /// Whether it failed.
    pub failed: bool,
    /// The last error of any enrollment of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<Timestamped>,
}

/// One step of an enrollment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    /// `netns`, `rules`, `proxy_ack`, `probe`, `annotate`.
    pub phase: String,
    /// When it began (RFC 3339).
    pub started_at: String,
    /// How long it took.
    pub duration_ms: f64,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The plugin's decision for a sidecar pod, and the rules in its netns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sidecar {
    /// Whether the plugin programs its redirect rules.
    pub redirected: bool,
    /// The decision in words.
    pub decision: String,
    /// How many rules of ours its netns holds, when it was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_count: Option<usize>,
    /// Why they could not be counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One line of `explain --all`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// `namespace/name`.
    pub pod: String,
    /// Which data plane.
    pub mode: Mode,
    /// The verdict.
    pub verdict: String,
}
