//! One drain primitive for orderly shutdown: a trigger says "stop taking new work", watchers see it,
//! and the trigger can wait until every watcher (and every guard held by in-flight work) is gone.
//!
//! Built on [`tokio::sync::watch`]: the trigger owns the sender, each watcher or guard owns a
//! receiver, and "drained" is "no receivers left".

use tokio::sync::watch;

/// How the process wants its work to stop, so each component can choose between finishing what it
/// is doing and dropping it on the floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainMode {
    /// Stop accepting new work; let in-flight work finish.
    Graceful,
    /// Stop now; abandon in-flight work.
    Immediate,
}

/// Namespace for [`Drain::new`]; it has no values.
#[derive(Debug)]
pub enum Drain {}

impl Drain {
    /// Creates a connected trigger/watcher pair: hand clones of the watcher to every long-running
    /// task, keep the trigger in `main`.
    #[allow(clippy::new_ret_no_self)] // a constructor of a pair, named as the house API asks
    pub fn new() -> (DrainTrigger, DrainWatcher) {
        let (tx, rx) = watch::channel(None);
        (DrainTrigger { tx }, DrainWatcher { rx })
    }
}

/// The owner's side of a drain: starts it and waits for it to complete.
///
/// Dropping the trigger without calling [`start`](Self::start) starts an
/// [`Immediate`](DrainMode::Immediate) drain, so watchers never wait for a signal that cannot come.
#[derive(Debug)]
pub struct DrainTrigger {
    tx: watch::Sender<Option<DrainMode>>,
}

impl DrainTrigger {
    /// Tells every watcher to stop in `mode`. The first call decides the mode; later calls are
    /// ignored (to cut a graceful drain short, stop waiting on [`drained`](Self::drained)).
    pub fn start(&self, mode: DrainMode) {
        self.tx.send_if_modified(|current| {
            if current.is_some() {
                return false;
            }
            *current = Some(mode);
            true
        });
    }

    /// Resolves once every [`DrainWatcher`] clone and every [`DrainGuard`] has been dropped, i.e. all
    /// work that registered with this drain is finished. Wrap it in a timeout to bound shutdown.
    pub async fn drained(&self) {
        self.tx.closed().await;
    }
}

impl Drop for DrainTrigger {
    fn drop(&mut self) {
        self.start(DrainMode::Immediate);
    }
}

/// A task's view of the drain: lets it notice that shutdown began and in which mode. Each clone keeps
/// the drain from completing until it is dropped.
#[derive(Debug, Clone)]
pub struct DrainWatcher {
    rx: watch::Receiver<Option<DrainMode>>,
}

impl DrainWatcher {
    /// Resolves with the mode once the drain has started (immediately if it already has). Safe to use
    /// repeatedly in `select!` loops.
    pub async fn signaled(&self) -> DrainMode {
        let mut rx = self.rx.clone();
        // The trigger sets a mode before it can go away, so a closed channel still holds one.
        let waited = rx.wait_for(Option::is_some).await.map(|mode| *mode);
        let mode = waited.unwrap_or_else(|_| *rx.borrow());
        mode.unwrap_or(DrainMode::Immediate)
    }

    /// The drain mode if the drain has started, so work that is already running can check whether to
    /// cut corners without awaiting.
    pub fn mode(&self) -> Option<DrainMode> {
        *self.rx.borrow()
    }

    /// A handle for one piece of in-flight work (a connection, a request) that holds the drain open
    /// until dropped, without needing to observe the signal itself.
    pub fn guard(&self) -> DrainGuard {
        DrainGuard { _rx: self.rx.clone() }
    }
}

/// Keeps a drain from completing while it is alive; drop it when the work it stands for is done.
#[derive(Debug)]
#[must_use = "the guard holds the drain open only while it is alive"]
pub struct DrainGuard {
    _rx: watch::Receiver<Option<DrainMode>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::time::Duration;

    const DEADLINE: Duration = Duration::from_secs(10);

    /// True if `fut` completes on its first poll.
    async fn ready_now<F: Future + Unpin>(fut: &mut F) -> bool {
        tokio::select! {
            biased;
            _ = fut => true,
            _ = std::future::ready(()) => false,
        }
    }

    async fn within<F: Future>(what: &str, fut: F) -> F::Output {
        tokio::time::timeout(DEADLINE, fut)
            .await
            .unwrap_or_else(|_| panic!("{what} did not happen within {DEADLINE:?}"))
    }

    #[tokio::test]
    async fn watchers_see_the_start_and_its_mode() {
        let (trigger, watcher) = Drain::new();
        let other = watcher.clone();
        assert_eq!(watcher.mode(), None);
        let waiting = tokio::spawn(async move { other.signaled().await });

        let mut pending = Box::pin(watcher.signaled());
        assert!(!ready_now(&mut pending).await, "signaled before start");
        drop(pending);

        trigger.start(DrainMode::Graceful);
        let seen = within("spawned watcher signaled", waiting).await.unwrap();
        assert_eq!(seen, DrainMode::Graceful);
        assert_eq!(watcher.mode(), Some(DrainMode::Graceful));
        // Already started: resolves at once, and again.
        assert_eq!(watcher.signaled().await, DrainMode::Graceful);
        assert_eq!(watcher.signaled().await, DrainMode::Graceful);
    }

    #[tokio::test]
    async fn first_mode_wins() {
        let (trigger, watcher) = Drain::new();
        trigger.start(DrainMode::Immediate);
        trigger.start(DrainMode::Graceful);
        assert_eq!(watcher.mode(), Some(DrainMode::Immediate));
        assert_eq!(watcher.signaled().await, DrainMode::Immediate);
    }

    #[tokio::test]
    async fn drained_waits_for_every_watcher_and_guard() {
        let (trigger, watcher) = Drain::new();
        let clone = watcher.clone();
        let guard = watcher.guard();
        trigger.start(DrainMode::Graceful);

        let mut drained = Box::pin(trigger.drained());
        drop(watcher);
        assert!(!ready_now(&mut drained).await, "drained with a clone and a guard alive");
        drop(clone);
        assert!(!ready_now(&mut drained).await, "drained with a guard alive");

        // In-flight work finishing on another task completes the drain.
        tokio::spawn(async move { drop(guard) });
        within("drained after the last guard", drained).await;
    }

    #[tokio::test]
    async fn dropping_the_trigger_signals_immediate() {
        let (trigger, watcher) = Drain::new();
        let waiting = tokio::spawn({
            let watcher = watcher.clone();
            async move { watcher.signaled().await }
        });
        drop(trigger);
        assert_eq!(within("signal on drop", waiting).await.unwrap(), DrainMode::Immediate);
        assert_eq!(watcher.mode(), Some(DrainMode::Immediate));
    }
}
