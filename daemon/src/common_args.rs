//! The settings every long-running binary takes the same way: where the probe and metrics servers listen, how to
//! log, and how long to drain on shutdown. Flattened into each binary's clap `Config`.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::{ArgAction, Args};
use istio_contract::ports;

use crate::drain::DrainWatcher;
use crate::listener;
use crate::probes::{self, Paths, ProbeState};
use crate::Error;

/// Shared flags (with env vars) of every agent binary.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Port of /healthz and /readyz.
    #[arg(long, env = "READINESS_PORT", default_value_t = ports::CNI_READINESS)]
    pub readiness_port: u16,
    /// Port of /metrics (the probe endpoints answer there too).
    #[arg(long, env = "MONITORING_PORT", default_value_t = ports::CNI_MONITORING)]
    pub monitoring_port: u16,
    /// Address the probe and metrics servers bind to.
    #[arg(long, env = "LISTEN_ADDRESS", default_value = "0.0.0.0")]
    pub listen_address: IpAddr,
    /// Log level or tracing filter; Istio's `--log_output_level` form (`default:info,cni:debug`) is accepted too.
    #[arg(long, alias = "log_output_level", env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// Emit JSON logs (`--log_as_json` alone, as Istio's chart passes it, means true).
    #[arg(
        long,
        alias = "log_as_json",
        env = "LOG_JSON",
        default_value_t = false,
        num_args = 0..=1,
        default_missing_value = "true",
        action = ArgAction::Set
    )]
    pub log_json: bool,
    /// On SIGTERM, how long open connections and in-flight work may take to finish before the process exits
    /// (a Go duration such as `5s` or `1m30s`; ztunnel's name for it).
    #[arg(long, env = "CONNECTION_TERMINATION_DEADLINE", default_value = "5s", value_parser = parse_duration)]
    pub termination_deadline: Duration,
}

impl CommonArgs {
    /// Installs the log subscriber.
    pub fn init_logging(&self) {
        crate::logging::init(&self.log_level, self.log_json);
    }

    /// Binds both ports and serves the probe endpoints (at `paths`) and metrics on them until the drain starts.
    pub async fn serve_probes(&self, state: &ProbeState, paths: Paths, drain: &DrainWatcher) -> Result<(), Error> {
        for port in [self.readiness_port, self.monitoring_port] {
            let listener = listener::bind_tcp(SocketAddr::new(self.listen_address, port)).await?;
            tokio::spawn(probes::serve(listener, state.clone(), paths, drain.clone()));
        }
        Ok(())
    }
}

/// Parses a Go duration (`5s`, `500ms`, `1m30s`, `1.5s`, `24h`), the form Istio's environment variables take.
/// jiff's "friendly" duration format is a superset of Go's; a negative duration is refused.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = |why: &dyn std::fmt::Display| format!("{text:?} is not a duration such as 5s, 500ms or 1m30s: {why}");
    let signed = jiff::fmt::friendly::SpanParser::new().parse_duration(text.trim()).map_err(|e| invalid(&e))?;
    Duration::try_from(signed).map_err(|_| invalid(&"negative"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn go_durations_parse_and_junk_is_refused() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(24 * 3600)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        for junk in ["", "5", "s", "5x", "-1s"] {
            assert!(parse_duration(junk).is_err(), "{junk:?} accepted");
        }
    }

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        common: CommonArgs,
    }

    #[test]
    fn defaults_are_istio_cni_ports_and_a_five_second_deadline() {
        let cli = Cli::try_parse_from(["cli"]).unwrap();
        assert_eq!(
            (cli.common.readiness_port, cli.common.monitoring_port),
            (ports::CNI_READINESS, ports::CNI_MONITORING)
        );
        assert_eq!(cli.common.termination_deadline, Duration::from_secs(5));
        let cli = Cli::try_parse_from(["cli", "--termination-deadline", "1m30s"]).unwrap();
        assert_eq!(cli.common.termination_deadline, Duration::from_secs(90));
        let error = Cli::try_parse_from(["cli", "--termination-deadline", "soon"]).unwrap_err().to_string();
        assert!(error.contains("termination-deadline"), "{error}");
    }

    #[test]
    fn istio_log_flags_are_accepted() {
        let cli = Cli::try_parse_from(["cli", "--log_output_level=default:debug", "--log_as_json"]).unwrap();
        assert_eq!((cli.common.log_level.as_str(), cli.common.log_json), ("default:debug", true));
        let cli = Cli::try_parse_from(["cli", "--log_as_json=false"]).unwrap();
        assert!(!cli.common.log_json);
        let cli = Cli::try_parse_from(["cli", "--log-json", "true", "--log-level", "warn"]).unwrap();
        assert_eq!((cli.common.log_level.as_str(), cli.common.log_json), ("warn", true));
    }
}
