//! Logs go to stderr, to `<run dir>/istio-cni.log` and, when the node agent listens there, to
//! `<run dir>/log.sock`, so they show up in `kubectl logs` of the agent. Never to stdout, which carries only the
//! result.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// Name of the plugin's log file inside the run directory.
pub const LOG_FILE: &str = "istio-cni.log";

/// A stalled agent must not stall pod creation: log writes to it give up quickly.
const SOCKET_WRITE_TIMEOUT: Duration = Duration::from_millis(100);

#[derive(Clone)]
struct Tee {
    file: Option<Arc<Mutex<File>>>,
    agent: Option<Arc<Mutex<UnixStream>>>,
}

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let sinks = [self.file.as_ref().map(|f| f as &dyn Sink), self.agent.as_ref().map(|s| s as &dyn Sink)];
        for sink in sinks.into_iter().flatten() {
            sink.put(buf);
        }
        std::io::stderr().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// A best-effort log destination: a failure to log never fails the plugin.
trait Sink {
    fn put(&self, buf: &[u8]);
}

impl<W: Write> Sink for Arc<Mutex<W>> {
    fn put(&self, buf: &[u8]) {
        if let Ok(mut w) = self.lock() {
            let _ = w.write_all(buf);
        }
    }
}

impl<'a> MakeWriter<'a> for Tee {
    type Writer = Tee;
    fn make_writer(&'a self) -> Tee {
        self.clone()
    }
}

/// Installs the subscriber. The log file is best effort: a missing run dir must not fail DEL.
pub fn init(level: &str, run_dir: &Path) {
    let file = std::fs::create_dir_all(run_dir)
        .and_then(|_| OpenOptions::new().create(true).append(true).open(run_dir.join(LOG_FILE)))
        .ok()
        .map(|f| Arc::new(Mutex::new(f)));
    let level = if ["trace", "debug", "info", "warn", "error", "off"].contains(&level) { level } else { "info" };
    let filter = EnvFilter::new(format!("warn,istio_cni={level},redirect={level},netns={level}"));
    let agent = UnixStream::connect(run_dir.join(istio_contract::paths::LOG_SOCKET))
        .and_then(|s| s.set_write_timeout(Some(SOCKET_WRITE_TIMEOUT)).map(|()| s))
        .ok()
        .map(|s| Arc::new(Mutex::new(s)));
    let tee = Tee { file, agent };
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(tee).try_init();
}
