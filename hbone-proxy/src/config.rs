//! The proxy's settings, from flags or Istio's environment variable names.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, ValueEnum};
use daemon::common_args::{parse_duration, CommonArgs};
use daemon::lifecycle::Daemon;
use daemon::probes::Paths;
use istio_contract::ports;

use crate::memory;

/// Istio's proxy probe paths: the kubelet probes `/healthz/ready` (on 15021), Prometheus scrapes `/metrics` (on
/// 15020); no liveness path.
const PROBE_PATHS: Paths = Paths { live: None, ready: "/healthz/ready", metrics: "/metrics" };

/// Whether pods accept plaintext inbound traffic, as the `mtls.mode` of a mesh-wide Istio PeerAuthentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "UPPERCASE")]
pub enum MtlsMode {
    /// Plaintext captured on 15006 is forwarded to the app (Istio's default).
    Permissive,
    /// Plaintext captured on 15006 is refused: only HBONE reaches the apps.
    Strict,
}

/// Where the proxy takes its workloads, authorization policies and certificates from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "lowercase")]
pub enum ControlPlane {
    /// Certificates minted by the proxy's own mesh CA (`CA_DIR`, or self-signed in `STATE_DIR`); workloads from
    /// the Kubernetes API (`KUBE_WORKLOADS`) and `LOCAL_WORKLOADS`; no authorization policies.
    Local,
    /// As ztunnel in an Istio ambient mesh: workloads and authorization policies from istiod over Delta xDS
    /// (`XDS_ADDRESS`), certificates from istiod's CA (`CA_ADDRESS`), authenticated with the projected token
    /// (`AUTH_TOKEN`, default `/var/run/secrets/tokens/istio-token`) against the mesh root (`XDS_ROOT_CA`,
    /// `CA_ROOT_CA`, default `/var/run/secrets/istio/root-cert.pem`); ztunnel's variable names throughout.
    /// `KUBE_WORKLOADS`, `CA_DIR` and `STATE_DIR` are not used.
    Istiod,
}

/// Everything the proxy is told at startup.
#[derive(Debug, Clone, Parser)]
#[command(name = "hbone-proxy", about = "HBONE node proxy for ambient pods")]
pub struct Config {
    /// The node agent's ZDS socket.
    #[arg(long, env = "INPOD_UDS", default_value = istio_contract::paths::ZDS_SOCKET)]
    pub inpod_uds: PathBuf,
    /// Where workloads, policies and certificates come from: `local` (the proxy's own CA and the Kubernetes API) or
    /// `istiod` (xDS and istiod's CA, as ztunnel).
    #[arg(long, env = "CONTROL_PLANE", value_enum, default_value = "local", ignore_case = true)]
    pub control_plane: ControlPlane,
    /// The mesh trust domain: local identities are minted in it and peers must belong to it.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// The cluster this node belongs to, as ztunnel's `CLUSTER_ID`: the `source_cluster` and `destination_cluster` of
    /// the traffic metrics for workloads listed without a cluster of their own.
    #[arg(long, env = "CLUSTER_ID", default_value = istio_contract::telemetry::DEFAULT_CLUSTER_ID)]
    pub cluster_id: String,
    /// A mesh CA in Istio's `cacerts` layout; without it a self-signed CA is kept in `STATE_DIR`.
    #[arg(long, env = "CA_DIR")]
    pub ca_dir: Option<PathBuf>,
    /// Where the self-signed CA lives when no `CA_DIR` is given.
    #[arg(long, env = "STATE_DIR", default_value = "/var/lib/hbone-proxy")]
    pub state_dir: PathBuf,
    /// A YAML file in ztunnel's local-config shape (`workloads:`) describing mesh destinations; watched.
    #[arg(long, env = "LOCAL_WORKLOADS")]
    pub local_workloads: Option<PathBuf>,
    /// Whether enrolled pods found through the Kubernetes API (kubeconfig or in-cluster) are mesh destinations.
    #[arg(long, env = "KUBE_WORKLOADS", default_value_t = true, action = ArgAction::Set)]
    pub kube_workloads: bool,
    /// Upstream resolvers of the in-pod DNS forwarder (comma-separated `ip[:port]`); by default the
    /// nameservers of the host's /etc/resolv.conf, read at startup.
    #[arg(long, env = "DNS_UPSTREAMS", value_delimiter = ',', value_parser = crate::dns::upstreams::parse_upstream)]
    pub dns_upstreams: Vec<SocketAddr>,
    /// Lifetime of the workload certificates the proxy mints (a Go duration); each is replaced at half life.
    #[arg(long, env = "SECRET_TTL", default_value = "24h", value_parser = parse_duration)]
    pub secret_ttl: Duration,
    /// `PERMISSIVE` forwards plaintext inbound connections (captured on 15006) to the apps; `STRICT` refuses them.
    #[arg(long, env = "MTLS_MODE", value_enum, default_value = "PERMISSIVE", ignore_case = true)]
    pub mtls_mode: MtlsMode,
    /// Inbound HBONE connections (15008) with no open stream for this long are closed with GOAWAY (a Go duration).
    /// Twice ztunnel's client-side `POOL_UNUSED_RELEASE_TIMEOUT` by default, so well-behaved clients close first.
    #[arg(long, env = "HBONE_SERVER_IDLE_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub hbone_server_idle_timeout: Duration,
    /// Inbound HBONE connections open at once on the node, all pods and clients together; more are refused (GOAWAY
    /// REFUSED_STREAM) and counted in `hbone_connections_refused_total{reason="max_connections"}`.
    #[arg(long, env = "HBONE_MAX_CONNECTIONS", default_value_t = hbone::ConnectionCaps::default().total,
          value_parser = positive)]
    pub hbone_max_connections: usize,
    /// Inbound HBONE connections open at once on the node from one client identity (the SPIFFE id of its
    /// certificate); more are refused and counted in `hbone_connections_refused_total{reason=
    /// "max_connections_per_identity"}`.
    #[arg(long, env = "HBONE_MAX_CONNECTIONS_PER_IDENTITY",
          default_value_t = hbone::ConnectionCaps::default().per_identity, value_parser = positive)]
    pub hbone_max_connections_per_identity: usize,
    /// The node-wide budget, in MiB, for tunnel bytes the proxy holds in user space (read from an app and not yet
    /// sent, received over HBONE and not yet written to an app), all pods together. Once it is reached, tunnels stop
    /// reading from the sockets that would add to it: HTTP/2 flow control and TCP backpressure hold the senders
    /// back, nothing is dropped. `0` turns the budget off (the bytes are still counted, for the metrics).
    #[arg(long, env = "BUFFER_BUDGET_MIB", default_value_t = memory::DEFAULT_BUDGET_MIB)]
    pub buffer_budget_mib: usize,
    /// What one pod may hold of the buffer budget, in MiB (its tunnels in both directions, as client and as
    /// server), so one pod's connections cannot take the whole budget from the others.
    #[arg(long, env = "BUFFER_BUDGET_PER_POD_MIB", default_value_t = memory::DEFAULT_PER_POD_MIB,
          value_parser = positive)]
    pub buffer_budget_per_pod_mib: usize,
    /// Whether a connection between two pods this proxy enrolled takes the same-node fast path: connected inside the
    /// destination pod's netns directly, with the same identity and policy checks as HBONE but no TLS, since the
    /// bytes never leave the node's kernel. `false` sends it over HBONE to the peer's 15008, as between nodes.
    #[arg(long, env = "SAME_NODE_FAST_PATH", default_value_t = true, action = ArgAction::Set)]
    pub same_node_fast_path: bool,
    /// With `CONTROL_PLANE=istiod`: where istiod is and who the proxy is, in ztunnel's variables.
    #[command(flatten)]
    pub istiod: IstiodArgs,
    /// Port of the admin endpoint (`/config_dump`) on 127.0.0.1.
    #[arg(long, env = "ADMIN_PORT", default_value_t = ports::ADMIN)]
    pub admin_port: u16,
    /// Probe ports, logging and the termination deadline (`CONNECTION_TERMINATION_DEADLINE`), with Istio's proxy
    /// ports as defaults.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// istiod's endpoints and the proxy's own identity for them, in ztunnel's variables (`CONTROL_PLANE=istiod`). Read
/// by the `xds` and `mesh-ca` settings, which also take `XDS_HEADER_*`, `CA_HEADER_*` and `ISTIO_META_*`; a flag
/// given here wins over its variable.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "istiod (CONTROL_PLANE=istiod)")]
pub struct IstiodArgs {
    /// istiod's xDS address (`host:port`, https); default `istiod.istio-system.svc:15012` in a pod.
    #[arg(long, env = "XDS_ADDRESS")]
    pub xds_address: Option<String>,
    /// istiod's CA address; default as `XDS_ADDRESS`.
    #[arg(long, env = "CA_ADDRESS")]
    pub ca_address: Option<String>,
    /// The root certificate istiod's xDS serving certificate chains to: a PEM file, inline PEM, or `SYSTEM`;
    /// default `/var/run/secrets/istio/root-cert.pem`.
    #[arg(long, env = "XDS_ROOT_CA")]
    pub xds_root_ca: Option<String>,
    /// The same for the CA; its roots are also the mesh roots peers must chain to.
    #[arg(long, env = "CA_ROOT_CA")]
    pub ca_root_ca: Option<String>,
    /// The name istiod's serving certificate is checked against, when it is not the address's host.
    #[arg(long, env = "ALT_XDS_HOSTNAME")]
    pub alt_xds_hostname: Option<String>,
    /// The same for the CA.
    #[arg(long, env = "ALT_CA_HOSTNAME")]
    pub alt_ca_hostname: Option<String>,
    /// The bearer token for istiod (a file, re-read per call, or the token); default
    /// `/var/run/secrets/tokens/istio-token`.
    #[arg(long, env = "AUTH_TOKEN")]
    pub auth_token: Option<String>,
    /// The proxy's pod name (its node id).
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// The proxy's pod namespace (its node id).
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
    /// The node the proxy serves: istiod sends the workloads of the whole mesh, and certificates only for pods on it.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// The proxy's pod IP (its node id).
    #[arg(long, env = "INSTANCE_IP")]
    pub instance_ip: Option<String>,
}

impl IstiodArgs {
    /// The variables the `xds` and `mesh-ca` settings read: the process environment, with each setting given here
    /// (flag or variable) in place of its variable.
    pub fn environment(&self) -> std::collections::BTreeMap<String, String> {
        let mut env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
        let given = [
            ("XDS_ADDRESS", &self.xds_address),
            ("CA_ADDRESS", &self.ca_address),
            ("XDS_ROOT_CA", &self.xds_root_ca),
            ("CA_ROOT_CA", &self.ca_root_ca),
            ("ALT_XDS_HOSTNAME", &self.alt_xds_hostname),
            ("ALT_CA_HOSTNAME", &self.alt_ca_hostname),
            ("AUTH_TOKEN", &self.auth_token),
            ("POD_NAME", &self.pod_name),
            ("POD_NAMESPACE", &self.pod_namespace),
            ("NODE_NAME", &self.node_name),
            ("INSTANCE_IP", &self.instance_ip),
        ];
        for (name, value) in given {
            if let Some(value) = value {
                env.insert(name.to_owned(), value.clone());
            }
        }
        env
    }
}

impl Config {
    /// Parses flags and env, defaulting the shared probe ports to Istio's proxy ports (15021, 15020).
    pub fn from_env_and_args() -> Self {
        Self::from_arg_matches(&Self::command_with_proxy_ports().get_matches()).unwrap_or_else(|e| e.exit())
    }

    fn command_with_proxy_ports() -> clap::Command {
        Self::command()
            .mut_arg("readiness_port", |arg| arg.default_value(ports::READINESS.to_string()))
            .mut_arg("monitoring_port", |arg| arg.default_value(ports::STATS.to_string()))
    }
}

/// A count of at least 1 (a cap of 0 would refuse every connection).
fn positive(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// What the shared main needs to run the proxy: its settings and Istio's probe paths.
impl Daemon for Config {
    const NAME: &'static str = "hbone-proxy";
    const PROBE_PATHS: Paths = PROBE_PATHS;

    fn parse() -> Self {
        Config::from_env_and_args()
    }

    fn common(&self) -> &CommonArgs {
        &self.common
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        let matches = Config::command_with_proxy_ports()
            .try_get_matches_from(std::iter::once("hbone-proxy").chain(args.iter().copied()))?;
        Config::from_arg_matches(&matches)
    }

    #[test]
    fn defaults_are_istios_proxy_ports_and_durations() {
        let config = parse(&[]).unwrap();
        assert_eq!((config.common.readiness_port, config.common.monitoring_port), (ports::READINESS, ports::STATS));
        assert_eq!(config.admin_port, ports::ADMIN);
        assert_eq!(config.cluster_id, "Kubernetes", "ztunnel's default cluster id");
        assert_eq!(config.common.termination_deadline, Duration::from_secs(5));
        assert_eq!(config.secret_ttl, Duration::from_secs(24 * 3600));
        assert_eq!(config.hbone_server_idle_timeout, hbone::server::DEFAULT_IDLE_TIMEOUT);
        assert!(config.same_node_fast_path, "the same-node fast path is on by default");
        assert_eq!(config.control_plane, ControlPlane::Local, "istiod is chosen, not assumed");
        assert_eq!(parse(&["--control-plane", "ISTIOD"]).unwrap().control_plane, ControlPlane::Istiod);
        assert!(parse(&["--control-plane", "pilot"]).is_err());
        let budget = memory::budget(config.buffer_budget_mib, config.buffer_budget_per_pod_mib);
        assert_eq!((budget.limit(), budget.share()), (64 << 20, 16 << 20));
        assert_eq!(parse(&["--buffer-budget-mib", "0"]).unwrap().buffer_budget_mib, 0, "0 turns the budget off");
        assert!(parse(&["--buffer-budget-per-pod-mib", "0"]).is_err());
        assert!(!parse(&["--same-node-fast-path", "false"]).unwrap().same_node_fast_path);
        let caps = hbone::ConnectionCaps::default();
        assert_eq!(
            (config.hbone_max_connections, config.hbone_max_connections_per_identity),
            (caps.total, caps.per_identity)
        );
    }

    #[test]
    fn go_durations_parse_and_junk_is_refused() {
        let config = parse(&["--termination-deadline", "1m30s", "--secret-ttl", "1.5s"]).unwrap();
        assert_eq!(config.common.termination_deadline, Duration::from_secs(90));
        assert_eq!(config.secret_ttl, Duration::from_millis(1500));
        for junk in ["", "5", "s", "5x", "-1s"] {
            assert!(parse(&["--secret-ttl", junk]).is_err(), "{junk:?} accepted");
        }
        let config = parse(&["--hbone-server-idle-timeout", "2s", "--hbone-max-connections", "7"]).unwrap();
        assert_eq!((config.hbone_server_idle_timeout, config.hbone_max_connections), (Duration::from_secs(2), 7));
        for junk in ["0", "-1", "x"] {
            assert!(parse(&["--hbone-max-connections-per-identity", junk]).is_err(), "{junk:?} accepted");
        }
    }
}
