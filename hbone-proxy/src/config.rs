//! The proxy's settings, from flags or Istio's environment variable names.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, ValueEnum};
use daemon::common_args::CommonArgs;

/// Readiness port of Istio's proxies (`/healthz/ready`).
pub const READINESS_PORT: &str = "15021";
/// Metrics port of Istio's proxies (`/metrics`).
pub const METRICS_PORT: &str = "15020";

/// Port of Istio's proxy admin endpoint (`/config_dump`), served on 127.0.0.1 only.
pub const ADMIN_PORT: &str = "15000";

/// Whether pods accept plaintext inbound traffic, as the `mtls.mode` of a mesh-wide Istio PeerAuthentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "UPPERCASE")]
pub enum MtlsMode {
    /// Plaintext captured on 15006 is forwarded to the app (Istio's default).
    Permissive,
    /// Plaintext captured on 15006 is refused: only HBONE reaches the apps.
    Strict,
}

/// Everything the proxy is told at startup.
#[derive(Debug, Clone, Parser)]
#[command(name = "hbone-proxy", about = "HBONE node proxy for ambient pods")]
pub struct Config {
    /// The node agent's ZDS socket.
    #[arg(long, env = "INPOD_UDS", default_value = istio_contract::paths::ZDS_SOCKET)]
    pub inpod_uds: PathBuf,
    /// The mesh trust domain: local identities are minted in it and peers must belong to it.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
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
    /// On SIGTERM, how long open connections may take to finish (a Go duration such as `5s` or `1m30s`).
    #[arg(long, env = "CONNECTION_TERMINATION_DEADLINE", default_value = "5s", value_parser = parse_duration)]
    pub termination_deadline: Duration,
    /// Upstream resolvers of the in-pod DNS forwarder (comma-separated `ip[:port]`); by default the
    /// nameservers of the host's /etc/resolv.conf, read at startup.
    #[arg(long, env = "DNS_UPSTREAMS", value_delimiter = ',', value_parser = crate::dns::parse_upstream)]
    pub dns_upstreams: Vec<SocketAddr>,
    /// Lifetime of the workload certificates the proxy mints (a Go duration); each is replaced at half life.
    #[arg(long, env = "SECRET_TTL", default_value = "24h", value_parser = parse_duration)]
    pub secret_ttl: Duration,
    /// `PERMISSIVE` forwards plaintext inbound connections (captured on 15006) to the apps; `STRICT` refuses them.
    #[arg(long, env = "MTLS_MODE", value_enum, default_value = "PERMISSIVE", ignore_case = true)]
    pub mtls_mode: MtlsMode,
    /// Port of the admin endpoint (`/config_dump`) on 127.0.0.1.
    #[arg(long, env = "ADMIN_PORT", default_value = ADMIN_PORT)]
    pub admin_port: u16,
    /// Probe ports and logging, with Istio's proxy ports as defaults.
    #[command(flatten)]
    pub common: CommonArgs,
}

impl Config {
    /// Parses flags and env, defaulting the shared probe ports to Istio's proxy ports (15021, 15020).
    pub fn from_env_and_args() -> Self {
        let command = Self::command()
            .mut_arg("readiness_port", |arg| arg.default_value(READINESS_PORT))
            .mut_arg("monitoring_port", |arg| arg.default_value(METRICS_PORT));
        Self::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit())
    }
}

/// Parses a Go-style duration (`5s`, `500ms`, `1m30s`), the form Istio's environment variables take.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("{text:?} is not a duration such as 5s, 500ms or 1m30s");
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(invalid());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        let number: f64 = rest[..digits].parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(invalid()),
        };
        rest = &rest[unit_len..];
        total += Duration::from_secs_f64(number * scale);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse_and_junk_is_refused() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        for junk in ["", "5", "s", "5x", "-1s"] {
            assert!(parse_duration(junk).is_err(), "{junk:?} accepted");
        }
    }
}
