//! Stopping the demo cleanly: Ctrl-C (SIGINT) or SIGTERM sets a flag every step checks, so the demo returns
//! through the guards that own what it created; and the record of those things, checked once they are dropped.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static PROCESSES: Mutex<Vec<(&'static str, u32)>> = Mutex::new(Vec::new());
static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Why the demo stopped before the end.
#[derive(Debug)]
pub enum Stop {
    /// Ctrl-C or SIGTERM.
    Interrupted,
    /// A step failed; the text says which and why.
    Failed(String),
}

/// Blocks SIGINT and SIGTERM in this thread and every thread it starts later (spawned processes get a clean mask
/// from std), then waits for them on a thread of their own: the first asks the demo to stop, a second one exits
/// at once. Call before starting any thread.
pub fn handle_signals() {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().expect("block SIGINT and SIGTERM");
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let signal = set.wait().expect("wait for SIGINT or SIGTERM");
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                eprintln!("demo: {signal} again: exiting without finishing the cleanup");
                std::process::exit(130);
            }
            eprintln!("demo: {signal}: stopping and cleaning up (send it again to exit at once)");
        })
        .expect("start the signal thread");
}

/// Whether Ctrl-C or SIGTERM arrived.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// `Err(Stop::Interrupted)` once the demo was asked to stop: called between and within steps.
pub fn checkpoint() -> Result<(), Stop> {
    if interrupted() {
        Err(Stop::Interrupted)
    } else {
        Ok(())
    }
}

/// Polls `probe` every 10 ms until it yields a value; fails naming `what` after `limit`, stops on Ctrl-C.
pub fn wait_for<T>(what: &str, limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Result<T, Stop> {
    let deadline = Instant::now() + limit;
    loop {
        checkpoint()?;
        if let Some(value) = probe() {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            return Err(Stop::Failed(format!("timed out after {limit:?} waiting until {what}")));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Remembers a process the demo started, to check it is gone after the teardown.
pub fn track_process(name: &'static str, pid: u32) {
    PROCESSES.lock().unwrap_or_else(|p| p.into_inner()).push((name, pid));
}

/// Remembers a temp dir the demo created, to check it is gone after the teardown.
pub fn track_dir(dir: PathBuf) {
    DIRS.lock().unwrap_or_else(|p| p.into_inner()).push(dir);
}

/// What the teardown left behind: this process's netns (named `<prefix>-<pid>-<n>`), tracked processes that
/// still run and tracked dirs that still exist. Empty when everything was removed.
pub fn leftovers() -> Vec<String> {
    let mut left = Vec::new();
    let tag = format!("-{}-", std::process::id());
    match std::process::Command::new("ip").args(["netns", "list"]).output() {
        Ok(out) => left.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| l.split_whitespace().next())
                .filter(|name| name.contains(&tag))
                .map(|name| format!("netns {name}")),
        ),
        Err(e) => left.push(format!("could not list namespaces: {e}")),
    }
    for (name, pid) in PROCESSES.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        if PathBuf::from(format!("/proc/{pid}")).exists() {
            left.push(format!("process {name} (pid {pid})"));
        }
    }
    for dir in DIRS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        if dir.exists() {
            left.push(format!("dir {}", dir.display()));
        }
    }
    left
}

/// Counts of what was tracked: (processes, dirs).
pub fn tracked() -> (usize, usize) {
    let processes = PROCESSES.lock().unwrap_or_else(|p| p.into_inner()).len();
    (processes, DIRS.lock().unwrap_or_else(|p| p.into_inner()).len())
}
