//! The names of the agent's admin API, shared by the server ([`crate::admin`]), the agent's flags
//! ([`crate::config`]) and the `explain` client: its env var, default port and paths. A leaf: it imports nothing of
//! the crate, so the flags can name the port without depending on the server (and, through it, on explain).

use istio_contract::ports;

/// The flag's env var, which the `explain` subcommand reads too.
pub const PORT_ENV: &str = "ADMIN_PORT";
/// The default port, for the flag.
pub const DEFAULT_PORT: u16 = ports::CNI_ADMIN;
/// The pods' reports live under this path.
pub const PODS_PATH: &str = "/debug/pods";
/// Asks for a drift check now.
pub const DRIFT_CHECK_PATH: &str = "/debug/drift-check";
