//! The settings every long-running binary takes the same way: where the probe and metrics servers listen, and
//! how to log. Flattened into each binary's clap `Config`.

use std::net::{IpAddr, SocketAddr};

use clap::{ArgAction, Args};

use crate::drain::DrainWatcher;
use crate::probes::{self, ProbeState};
use crate::Error;

/// Shared flags (with env vars) of every agent binary.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Port of /healthz and /readyz.
    #[arg(long, env = "READINESS_PORT", default_value_t = 8000)]
    pub readiness_port: u16,
    /// Port of /metrics (the probe endpoints answer there too).
    #[arg(long, env = "MONITORING_PORT", default_value_t = 15014)]
    pub monitoring_port: u16,
    /// Address the probe and metrics servers bind to.
    #[arg(long, env = "LISTEN_ADDRESS", default_value = "0.0.0.0")]
    pub listen_address: IpAddr,
    /// Log level or tracing filter.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// Emit JSON logs.
    #[arg(long, env = "LOG_JSON", default_value_t = false, action = ArgAction::Set)]
    pub log_json: bool,
}

impl CommonArgs {
    /// Installs the log subscriber.
    pub fn init_logging(&self) {
        crate::logging::init(&self.log_level, self.log_json);
    }

    /// Binds both ports and serves the probe endpoints and metrics on them until the drain starts.
    pub async fn serve_probes(&self, state: &ProbeState, drain: &DrainWatcher) -> Result<(), Error> {
        for port in [self.readiness_port, self.monitoring_port] {
            let listener = probes::bind(SocketAddr::new(self.listen_address, port)).await?;
            tokio::spawn(probes::serve(listener, state.clone(), drain.clone()));
        }
        Ok(())
    }
}
