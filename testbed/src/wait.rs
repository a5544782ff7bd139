//! Waiting for a condition with a deadline, the one way every test here waits (never a fixed sleep).

use std::time::{Duration, Instant};

/// How long any awaited condition (readiness, a repair, an exit) may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Polls `probe` every 10ms until it yields a value, panicking with `what` after [`DEADLINE`].
#[track_caller]
pub fn eventually<T>(what: &str, probe: impl FnMut() -> Option<T>) -> T {
    eventually_or(what, probe, String::new)
}

/// Like [`eventually`], adding `context()` (e.g. a process's log) to the panic message.
#[track_caller]
pub fn eventually_or<T>(what: &str, mut probe: impl FnMut() -> Option<T>, context: impl Fn() -> String) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {DEADLINE:?} waiting until {what}\n{}", context());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
