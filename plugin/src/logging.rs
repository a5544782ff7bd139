//! Logs go to stderr, to `<run dir>/istio-cni.log` and, when the node agent listens there, to
//! `<run dir>/log.sock`, so they show up in `kubectl logs` of the agent. Never to stdout, which carries only the
//! result.
//!
//! The log file is capped and rotated ([`plugin::log_file`]). Many plugin processes append to it at once (one per
//! pod ADD or DEL), so every line is written under an exclusive `flock` of the file: the size is read from the
//! open descriptor, the file is renamed away when the line would take it past the cap, and a process whose
//! descriptor no longer names the current file reopens it. Logging is best effort: it never fails the plugin,
//! never waits long for the lock, and never writes to stdout.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use plugin::log_file;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// A stalled agent must not stall pod creation: log writes to it give up quickly.
const SOCKET_WRITE_TIMEOUT: Duration = Duration::from_millis(100);
/// How long a line waits for another plugin process to release the log file's lock (held only while it writes
/// or rotates). Past it this process stops writing the file: a stuck process must not stall pod creation.
const LOCK_WAIT: Duration = Duration::from_millis(500);
/// Longest pause between two attempts to take the lock.
const LOCK_POLL_MAX: Duration = Duration::from_millis(5);
/// Reopen-and-retry rounds per line (another process rotated the file under us); one or two are the rule.
const WRITE_ATTEMPTS: usize = 4;

#[derive(Clone)]
struct Tee {
    file: Option<Arc<Mutex<LogFile>>>,
    agent: Option<Arc<Mutex<UnixStream>>>,
}

impl Write for Tee {
    /// One call per event (the formatter writes each line whole), handed whole to every sink.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(file) = &self.file {
            if let Ok(mut file) = file.lock() {
                file.append(buf);
            }
        }
        if let Some(agent) = &self.agent {
            if let Ok(mut agent) = agent.lock() {
                let _ = agent.write_all(buf);
            }
        }
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
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

/// What one locked attempt at appending a line came to.
enum Attempt {
    /// The line is in the file.
    Written,
    /// The open descriptor is not (or no longer) the current log file: reopen and try again.
    Reopen,
}

/// The plugin's log file, shared with every other plugin process on the node: capped at `max` bytes and rotated
/// to `rotated`. `file` is `None` once this process gave up on it.
struct LogFile {
    path: PathBuf,
    rotated: PathBuf,
    max: u64,
    file: Option<File>,
}

impl LogFile {
    /// Opens (creating it and the run dir if needed) the log file in `run_dir`; `None` if that fails.
    fn open(run_dir: &Path, max: u64) -> Option<Self> {
        std::fs::create_dir_all(run_dir).ok()?;
        let path = run_dir.join(log_file::NAME);
        let file = open_append(&path).ok()?;
        Some(Self { rotated: run_dir.join(log_file::ROTATED_NAME), path, max, file: Some(file) })
    }

    /// Appends `line`, rotating first if it would take the file past the cap. Gives up on the file for the rest of
    /// this process when the lock stays taken or the file cannot be written.
    fn append(&mut self, line: &[u8]) {
        for _ in 0..WRITE_ATTEMPTS {
            let Some(file) = &self.file else { return };
            if !lock(file) {
                self.file = None;
                return;
            }
            let attempt = self.append_locked(file, line);
            let _ = file.unlock();
            match attempt {
                Ok(Attempt::Written) => return,
                Ok(Attempt::Reopen) => match open_append(&self.path) {
                    Ok(file) => self.file = Some(file),
                    Err(_) => break,
                },
                Err(_) => break,
            }
        }
        self.file = None;
    }

    /// One attempt, with `file`'s lock held: writes `line` if `file` is still the log file and has room for it,
    /// else renames a full file away and asks for a reopen.
    fn append_locked(&self, file: &File, line: &[u8]) -> std::io::Result<Attempt> {
        let open = file.metadata()?;
        let current = match std::fs::metadata(&self.path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Attempt::Reopen),
            Err(e) => return Err(e),
        };
        if (open.dev(), open.ino()) != (current.dev(), current.ino()) {
            return Ok(Attempt::Reopen);
        }
        // An empty file takes any line, so a line longer than the cap cannot loop; it is the one line over.
        if open.len() > 0 && open.len() + line.len() as u64 > self.max {
            std::fs::rename(&self.path, &self.rotated)?;
            return Ok(Attempt::Reopen);
        }
        (&*file).write_all(line)?;
        Ok(Attempt::Written)
    }
}

fn open_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// Takes `file`'s exclusive lock, waiting at most [`LOCK_WAIT`]; `false` if it could not.
fn lock(file: &File) -> bool {
    let deadline = Instant::now() + LOCK_WAIT;
    let mut pause = Duration::from_micros(50);
    loop {
        match file.try_lock() {
            Ok(()) => return true,
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(LOCK_POLL_MAX);
            }
            Err(_) => return false,
        }
    }
}

/// Installs the subscriber. The log file is best effort: a missing run dir must not fail DEL.
pub fn init(level: &str, run_dir: &Path) {
    let file = LogFile::open(run_dir, log_file::MAX_BYTES).map(|f| Arc::new(Mutex::new(f)));
    let level = if ["trace", "debug", "info", "warn", "error", "off"].contains(&level) { level } else { "info" };
    let filter = EnvFilter::new(format!("warn,istio_cni={level},redirect={level},netns={level}"));
    let agent = UnixStream::connect(run_dir.join(istio_contract::paths::LOG_SOCKET))
        .and_then(|s| s.set_write_timeout(Some(SOCKET_WRITE_TIMEOUT)).map(|()| s))
        .ok()
        .map(|s| Arc::new(Mutex::new(s)));
    let tee = Tee { file, agent };
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(tee).try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(n: usize) -> Vec<u8> {
        format!("{:0>9}\n", n).into_bytes()
    }

    #[test]
    fn the_file_is_rotated_before_a_line_would_pass_the_cap_and_the_newest_line_is_in_the_current_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogFile::open(dir.path(), 100).unwrap();
        for n in 0..95 {
            log.append(&line(n));
        }
        let current = std::fs::read_to_string(dir.path().join(log_file::NAME)).unwrap();
        let rotated = std::fs::read_to_string(dir.path().join(log_file::ROTATED_NAME)).unwrap();
        assert_eq!(current.len(), 50, "95 lines of 10 bytes, 10 per file: the last 5 are in the current file");
        assert_eq!(rotated.len(), 100, "a full file was rotated");
        assert!(current.ends_with(&String::from_utf8(line(94)).unwrap()), "{current}");
        assert!(rotated.ends_with(&String::from_utf8(line(89)).unwrap()), "{rotated}");
    }

    #[test]
    fn a_line_longer_than_the_cap_is_written_alone_and_does_not_loop() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogFile::open(dir.path(), 4).unwrap();
        log.append(b"0123456789\n");
        log.append(b"ab\n");
        let current = std::fs::read_to_string(dir.path().join(log_file::NAME)).unwrap();
        let rotated = std::fs::read_to_string(dir.path().join(log_file::ROTATED_NAME)).unwrap();
        assert_eq!((current.as_str(), rotated.as_str()), ("ab\n", "0123456789\n"));
    }

    #[test]
    fn a_writer_whose_file_was_rotated_by_another_process_reopens_the_current_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut stale = LogFile::open(dir.path(), 1000).unwrap();
        std::fs::rename(dir.path().join(log_file::NAME), dir.path().join(log_file::ROTATED_NAME)).unwrap();
        std::fs::write(dir.path().join(log_file::NAME), "other\n").unwrap();
        stale.append(b"mine\n");
        let current = std::fs::read_to_string(dir.path().join(log_file::NAME)).unwrap();
        assert_eq!(current, "other\nmine\n");
    }

    #[test]
    fn a_lock_held_elsewhere_makes_the_writer_give_up_instead_of_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogFile::open(dir.path(), 1000).unwrap();
        // flock locks belong to the open file description: a second open of the file is another holder.
        let holder = File::open(dir.path().join(log_file::NAME)).unwrap();
        holder.lock().unwrap();
        let started = Instant::now();
        log.append(b"dropped\n");
        assert!(started.elapsed() < LOCK_WAIT * 4, "waited {:?}", started.elapsed());
        assert!(log.file.is_none(), "gave up on the file");
        log.append(b"also dropped\n");
        assert_eq!(std::fs::read_to_string(dir.path().join(log_file::NAME)).unwrap(), "");
    }
}
