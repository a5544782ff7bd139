//! The one `main` every long-running binary shares (install-cni, the node agent, the node proxy), so they start,
//! report and stop the same way: parse the settings, validate them (exit 2 with a message naming the setting),
//! start logging, build the runtime, raise the open-files limit, install the SIGTERM/SIGINT handlers, serve the
//! probes, run the binary, then drain, waiting for in-flight work at most the configured deadline
//! (`CONNECTION_TERMINATION_DEADLINE`).
//!
//! ```ignore
//! fn main() -> std::process::ExitCode {
//!     daemon::lifecycle::main(run)
//! }
//!
//! async fn run(config: Config, ctx: daemon::lifecycle::Context) -> anyhow::Result<()> {
//!     // register metrics and blockers, start work, clear ctx.startup, then wait for ctx.shutdown
//! }
//! ```

use std::fmt::{Debug, Display};
use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;

use crate::common_args::CommonArgs;
use crate::drain::{Drain, DrainMode, DrainWatcher};
use crate::probes::{Blocker, Paths, ProbeState};
use crate::signals::{self, Shutdown};

/// The exit status of a process whose settings are invalid.
const INVALID_CONFIG: u8 = 2;

/// What a binary tells the shared main about itself: how to read its settings and what its runtime and probes
/// look like.
pub trait Daemon: Debug + Sized {
    /// The binary's name, in the messages of the shared main.
    const NAME: &'static str;
    /// The runtime it runs on.
    const RUNTIME: Runtime = Runtime::MultiThread { workers: None };
    /// Where its probes answer.
    const PROBE_PATHS: Paths = Paths::DAEMON;

    /// Reads flags and env; on a parse error prints clap's message and exits (status 2).
    fn parse() -> Self;

    /// Checks what the parser cannot; the message names the setting.
    fn validate(&self) -> Result<(), String> {
        Ok(())
    }

    /// The settings every binary shares.
    fn common(&self) -> &CommonArgs;
}

/// The tokio runtime a binary needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// One thread: the binary's work is sequential.
    CurrentThread,
    /// A worker pool of `workers` threads (one per core when `None`).
    MultiThread {
        /// How many worker threads.
        workers: Option<usize>,
    },
}

impl Runtime {
    fn build(self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = match self {
            Runtime::CurrentThread => tokio::runtime::Builder::new_current_thread(),
            Runtime::MultiThread { workers } => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                if let Some(workers) = workers {
                    builder.worker_threads(workers);
                }
                builder
            }
        };
        builder.enable_all().build()
    }
}

/// What the shared main hands the binary's `run`.
#[derive(Debug)]
pub struct Context {
    /// The probe state the probe servers already answer from; register metrics and blockers here.
    pub probes: ProbeState,
    /// Blocks readiness (`startup: starting`) until the binary clears it, once it has registered its own
    /// blockers and started serving.
    pub startup: Blocker,
    /// Hand clones to long-running tasks: they see the drain start and hold it open until they finish.
    pub drain: DrainWatcher,
    /// Resolves on SIGTERM or SIGINT; `run` returns after it (or earlier, if its work ends), and the drain starts.
    pub shutdown: Shutdown,
}

/// Runs a binary: parses and validates `C`, starts logging and the runtime, serves the probes, and runs
/// `run(config, context)`. When it returns, the process turns unready (`shutdown: shutting down`), starts a
/// graceful drain and waits for it at most the termination deadline. Returns the process's exit status: 0, 2 for
/// invalid settings, 1 when `run` or the setup failed (logged).
pub fn main<C, F, Fut, E>(run: F) -> ExitCode
where
    C: Daemon,
    F: FnOnce(C, Context) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    let config = C::parse();
    if let Err(message) = config.validate() {
        eprintln!("{}: invalid configuration: {message}", C::NAME);
        return ExitCode::from(INVALID_CONFIG);
    }
    config.common().init_logging();
    let runtime = match C::RUNTIME.build() {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "{}: cannot start the tokio runtime", C::NAME);
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(lifecycle(config, run)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // `#` shows an error's whole chain of causes (anyhow's alternate form).
            tracing::error!("{} failed: {error:#}", C::NAME);
            ExitCode::FAILURE
        }
    }
}

/// Everything after the runtime is up; errors come back formatted, with their chain of causes.
async fn lifecycle<C, F, Fut, E>(config: C, run: F) -> Result<(), String>
where
    C: Daemon,
    F: FnOnce(C, Context) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    tracing::info!(config = ?config, "starting");
    // Every binary holds descriptors other parties make it open (pod connections, netns handles, plugin
    // sockets): start with all the node allows, not the container runtime's default soft limit, as Go does.
    crate::listener::raise_open_files_limit().map_err(|e| format!("raising RLIMIT_NOFILE to its hard limit: {e}"))?;
    let shutdown = signals::shutdown_signal().map_err(|e| display_chain(&e))?;
    let probes = ProbeState::new(Arc::default());
    let startup = probes.blocker("startup", "starting");
    let (trigger, drain) = Drain::new();
    let deadline = config.common().termination_deadline;
    config.common().serve_probes(&probes, C::PROBE_PATHS, &drain).await.map_err(|e| display_chain(&e))?;

    let context = Context { probes: probes.clone(), startup, drain, shutdown };
    let result = run(config, context).await.map_err(|e| format!("{e:#}"));

    probes.blocker("shutdown", "shutting down");
    trigger.start(DrainMode::Graceful);
    match tokio::time::timeout(deadline, trigger.drained()).await {
        Ok(()) => tracing::info!("drained: all connections finished"),
        Err(_) => tracing::warn!(?deadline, "connections still open at the termination deadline: exiting"),
    }
    result
}

/// `error` and its sources, `: `-separated, as anyhow's alternate form shows them.
fn display_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
