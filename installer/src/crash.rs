//! A test hook that simulates install-cni crashing between two steps of converting a single-plugin `X.conf`
//! into `X.conflist`, so tests can prove a crash at any step leaves a node config that a runtime loads and that
//! a restarted install-cni completes.
//!
//! The conversion runs these steps, in order; a crash after any of them leaves:
//!
//! | step ([`Step::name`]) | done | on disk after a crash there |
//! |---|---|---|
//! | `conf-recorded` | the original `X.conf` (bytes, mode) saved in the install journal | `X.conf` unchanged |
//! | `conflist-staged` | the list written and fsynced to a temp file in the conf dir | `X.conf` unchanged, plus a `.istio-cni-tmp-*` file no runtime loads (removed at the next start) |
//! | `conflist-written` | the temp file renamed to `X.conflist`, the dir fsynced | `X.conf` unchanged (it sorts first, so runtimes still load it, without our plugin) and `X.conflist` with our plugin |
//! | `conf-removed` | `X.conf` deleted, the dir fsynced | `X.conflist` alone: the conversion is complete |
//!
//! At the next start install-cni finishes an interrupted conversion before anything else
//! ([`crate::cniconf::complete_conversions`]): a leftover `X.conf` whose `X.conflist` already holds it plus
//! our entry is removed, and a list-shaped `X.conf` holding our entry (the old write-in-place-then-rename order,
//! as Istio's own install-cni does, crashed before its rename) becomes `X.conflist`.
//!
//! The hook: in debug builds only, `INSTALL_CNI_CRASH_AFTER=<step name>` makes install-cni abort
//! (`std::process::abort`: SIGABRT, no destructors, no cleanup, temp files left as they are) right after that
//! step, after printing `crash hook: aborting after <step>` to stderr. Release builds compile [`after`] to
//! nothing and never read the variable.

/// The env var naming the step after which a debug build aborts (see the module doc).
pub const CRASH_AFTER_ENV: &str = "INSTALL_CNI_CRASH_AFTER";

/// One step of converting `X.conf` into `X.conflist`, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The original `X.conf` is saved in the journal; nothing in the conf dir changed yet.
    ConfRecorded,
    /// The list is in a synced temp file in the conf dir, not yet renamed to `X.conflist`.
    ConflistStaged,
    /// `X.conflist` is in place; `X.conf` still exists.
    ConflistWritten,
    /// `X.conf` is removed.
    ConfRemoved,
}

impl Step {
    /// Every step, in the order a conversion runs them, so a test can crash at each.
    pub const ALL: [Step; 4] = [Step::ConfRecorded, Step::ConflistStaged, Step::ConflistWritten, Step::ConfRemoved];

    /// The step's name, the value [`CRASH_AFTER_ENV`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Step::ConfRecorded => "conf-recorded",
            Step::ConflistStaged => "conflist-staged",
            Step::ConflistWritten => "conflist-written",
            Step::ConfRemoved => "conf-removed",
        }
    }
}

/// Marks `step` as done; in a debug build whose [`CRASH_AFTER_ENV`] names it, aborts the process right here.
pub fn after(step: Step) {
    #[cfg(debug_assertions)]
    if std::env::var_os(CRASH_AFTER_ENV).is_some_and(|v| v == step.name()) {
        eprintln!("crash hook: aborting after {}", step.name());
        std::process::abort();
    }
    #[cfg(not(debug_assertions))]
    let _ = step;
}
