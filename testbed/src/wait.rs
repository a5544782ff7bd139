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

/// Polls `probe` every 10ms until it yields a value or `limit` has passed since `since`: for the tests whose
/// point is a bound (a listener gone within 1 s, an exit before the drain deadline), so running out is an answer
/// (`None`), not a panic.
pub fn within<T>(since: Instant, limit: Duration, probe: impl FnMut() -> Option<T>) -> Option<T> {
    within_every(since, limit, Duration::from_millis(10), probe)
}

/// [`within`], polling every `interval`: for probes that cost a process each (`kubectl`, `crictl` against the
/// real node), where polling every 10ms would load the machine the test is watching.
pub fn within_every<T>(
    since: Instant,
    limit: Duration,
    interval: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> Option<T> {
    loop {
        if let Some(v) = probe() {
            return Some(v);
        }
        if since.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(interval);
    }
}

/// The exit status of `child` once it has exited, or `None` if it is still running `limit` after `since`.
pub fn exit_within(
    child: &mut std::process::Child,
    since: Instant,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    within(since, limit, || child.try_wait().expect("poll a child process"))
}

/// [`eventually`] for async tests: polls `probe` every 10ms on the test's runtime, panicking with `what` after
/// [`DEADLINE`].
#[track_caller]
pub fn eventually_async<'a, T: 'a>(
    what: &'a str,
    mut probe: impl FnMut() -> Option<T> + 'a,
) -> impl std::future::Future<Output = T> + 'a {
    let caller = std::panic::Location::caller();
    async move {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            if let Some(v) = probe() {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{caller}: timed out after {DEADLINE:?} waiting until {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// [`eventually`] for a probe that is itself async (an API request, say): awaits `probe` every 10ms until it
/// returns `Some`, panicking with `what` after [`DEADLINE`].
pub async fn eventually_awaiting<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let poll = async {
        loop {
            if let Some(v) = probe().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    match tokio::time::timeout(DEADLINE, poll).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {DEADLINE:?} waiting until {what}"),
    }
}
