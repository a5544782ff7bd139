//! Logs go to stderr and to `<run dir>/istio-cni.log`, never to stdout, which carries only the result.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// Name of the plugin's log file inside the run directory.
pub const LOG_FILE: &str = "istio-cni.log";

#[derive(Clone)]
struct Tee(Option<Arc<Mutex<File>>>);

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(f) = &self.0 {
            if let Ok(mut f) = f.lock() {
                let _ = f.write_all(buf);
            }
        }
        std::io::stderr().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
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
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(Tee(file)).try_init();
}
