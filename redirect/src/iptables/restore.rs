//! Runs the iptables binaries (`*-restore`, `*-save`) in the calling thread's netns with a private xtables lock,
//! for both the sidecar apply step (whole tables) and the ambient / host-probe steps (only our chains).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use super::error::IptablesError;
use super::flavour::IptablesBackend;
use crate::model::{Family, Table};

/// A lock file in a directory of our own (removed on drop), so iptables-legacy never waits on the host's
/// /run/xtables.lock (kube-proxy).
pub(crate) struct XtablesLock {
    dir: tempfile::TempDir,
}

impl XtablesLock {
    /// Creates the lock directory in the first writable one of /run, /tmp, /dev/shm and the temp dir. A container
    /// with a read-only root file system and a FROM scratch image (the chart's node agent) has neither /run nor
    /// /tmp, but the runtime always gives it a writable /dev/shm.
    pub(crate) fn new() -> Result<Self, IptablesError> {
        let mut bases: Vec<PathBuf> = ["/run", "/tmp", "/dev/shm"].iter().map(PathBuf::from).collect();
        bases.push(std::env::temp_dir());
        let mut tried = Vec::new();
        for base in bases.iter().filter(|p| p.is_dir()) {
            match tempfile::Builder::new().prefix("istio-cni-xtables-").tempdir_in(base) {
                Ok(dir) => return Ok(Self { dir }),
                Err(e) => tried.push(format!("{}: {e}", base.display())),
            }
        }
        let what = format!(
            "create lock dir (tried {})",
            if tried.is_empty() { "no existing dir".into() } else { tried.join("; ") }
        );
        Err(IptablesError::Setup { what, source: std::io::Error::from(std::io::ErrorKind::NotFound) })
    }

    /// The lock file to hand to the binaries as `XTABLES_LOCKFILE`.
    pub(crate) fn file(&self) -> PathBuf {
        self.dir.path().join("xtables.lock")
    }
}

/// How `iptables-restore` treats the tables a payload names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RestoreMode {
    /// Replace them wholesale (the sidecar tables are all ours).
    Replace,
    /// `--noflush`: keep what is not in the payload (tables shared with kube-proxy and others).
    NoFlush,
}

/// Feeds `payload` to `<family>-<backend>-restore --wait` on stdin.
pub(crate) fn restore(
    backend: IptablesBackend,
    family: Family,
    payload: &str,
    mode: RestoreMode,
    lockfile: &Path,
) -> Result<(), IptablesError> {
    let binary = backend.binary(family, "restore");
    let args: &[&str] = match mode {
        RestoreMode::Replace => &["--wait"],
        RestoreMode::NoFlush => &["--noflush", "--wait"],
    };
    tracing::debug!(%binary, %family, ?args, payload, "running iptables-restore");
    let spawn_err = |source| IptablesError::Spawn { binary: binary.clone(), source };
    let mut child = Command::new(&binary)
        .args(args)
        .env("XTABLES_LOCKFILE", lockfile)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    let written = child.stdin.take().map(|mut stdin| stdin.write_all(payload.as_bytes()));
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        return Err(command_error(&binary, family, out.status, &out.stderr));
    }
    if let Some(Err(source)) = written {
        return Err(spawn_err(source));
    }
    Ok(())
}

/// `<family>-<backend>-save [-t <table>]`: the table (or all tables) as it is now. With `lockfile`, the binary
/// uses that lock instead of the host's.
pub(crate) fn save(
    backend: IptablesBackend,
    family: Family,
    table: Option<Table>,
    lockfile: Option<&Path>,
) -> Result<String, IptablesError> {
    let binary = backend.binary(family, "save");
    let mut cmd = Command::new(&binary);
    if let Some(table) = table {
        cmd.args(["-t", table.name()]);
    }
    if let Some(lockfile) = lockfile {
        cmd.env("XTABLES_LOCKFILE", lockfile);
    }
    let out =
        cmd.stdin(Stdio::null()).output().map_err(|source| IptablesError::Spawn { binary: binary.clone(), source })?;
    if !out.status.success() {
        return Err(command_error(&binary, family, out.status, &out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The error for a binary that ran and failed, with its trimmed standard error.
fn command_error(binary: &str, family: Family, status: ExitStatus, stderr: &[u8]) -> IptablesError {
    IptablesError::Command {
        binary: binary.to_string(),
        family,
        status,
        stderr: String::from_utf8_lossy(stderr).trim().to_string(),
    }
}
