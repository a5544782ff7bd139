//! Executing one plugin process with a deadline, optionally spawned from inside a netns.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use netns::Netns;

use super::error::RuntimeError;

/// What a plugin process did: exit status and everything it printed.
#[derive(Debug, Clone)]
pub struct RawOutput {
    /// Exit status.
    pub status: ExitStatus,
    /// Bytes written to stdout.
    pub stdout: Vec<u8>,
    /// Bytes written to stderr.
    pub stderr: Vec<u8>,
}

impl RawOutput {
    /// Stdout as (lossy) UTF-8.
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Stderr as (lossy) UTF-8.
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// Spawns `cmd` (from inside `netns` when given), feeds it `stdin`, collects its output, and kills its
/// whole process group if it has not finished within `timeout`.
pub(crate) fn run(
    mut cmd: Command,
    bin: &Path,
    netns: Option<&Path>,
    stdin: Vec<u8>,
    timeout: Duration,
) -> Result<RawOutput, RuntimeError> {
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let deadline = Instant::now() + timeout;
    let ns = netns.map(Netns::open).transpose()?;
    let mut child = loop {
        let spawned = match &ns {
            Some(ns) => ns.run(|| cmd.spawn())?,
            None => cmd.spawn(),
        };
        match spawned {
            // A freshly written plugin can be briefly "busy" while another thread's fork still holds its
            // write fd; libcni retries the same way.
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            other => break other.map_err(|source| RuntimeError::Spawn { bin: bin.to_path_buf(), source })?,
        }
    };

    let mut pipe_in = child.stdin.take().expect("stdin piped");
    // A plugin may exit without reading stdin; the resulting EPIPE is not an error of the runtime.
    std::thread::spawn(move || {
        let _ = pipe_in.write_all(&stdin);
    });
    let stdout = drain(child.stdout.take().expect("stdout piped"));
    let stderr = drain(child.stderr.take().expect("stderr piped"));

    let status = wait_until(child, deadline);
    let collect = |rx: &mpsc::Receiver<Vec<u8>>| {
        // Output of a killed (or daemonizing) plugin may never reach EOF; give the readers a short grace.
        let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(200));
        rx.recv_timeout(wait).unwrap_or_default()
    };
    match status {
        Some(status) => Ok(RawOutput { status, stdout: collect(&stdout), stderr: collect(&stderr) }),
        None => Err(RuntimeError::Timeout {
            bin: bin.to_path_buf(),
            after: timeout,
            stdout: String::from_utf8_lossy(&collect(&stdout)).into_owned(),
            stderr: String::from_utf8_lossy(&collect(&stderr)).into_owned(),
        }),
    }
}

/// Waits for the child to exit, until the deadline; on timeout kills its process group and reaps it. The wait
/// blocks in `waitpid` on a thread of its own and is woken by the exit itself, as a real runtime's is (Go's
/// `exec.Cmd.Wait`): polling would round every plugin's measured time up to the poll interval.
fn wait_until(mut child: Child, deadline: Instant) -> Option<ExitStatus> {
    let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(status) => status.ok(),
        Err(_) => {
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
            // The kill ends the wait; the child is reaped before the runtime reports the timeout.
            let _ = rx.recv();
            None
        }
    }
}

fn drain(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        let _ = tx.send(buf);
    });
    rx
}

/// Finds plugin `name` in the first bin dir that holds it, like libcni's `FindInPath`.
pub(super) fn find_plugin(name: &str, dirs: &[PathBuf]) -> Result<PathBuf, RuntimeError> {
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| RuntimeError::PluginNotFound { plugin: name.to_owned(), dirs: dirs.to_vec() })
}
