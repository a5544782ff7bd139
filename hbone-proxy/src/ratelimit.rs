//! Rate-limited logging. Whatever a pod or a peer can repeat at will (a refused connection, say) must not cost
//! one log line per repetition: [`RateLimitedLog`] lets the first event of each key through, then at most one per
//! interval, and tells the logged line how many events of that key it stands for.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often the same kind of refusal of one pod is logged at most.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Decides which events get a log line: per key, the first one and then at most one per interval. Keys are meant
/// to come from a small closed set (a direction and a reason, say), which bounds the map; the owner (one pod)
/// drops it with everything else it holds.
#[derive(Debug)]
pub struct RateLimitedLog<K> {
    interval: Duration,
    max_keys: usize,
    windows: Mutex<HashMap<K, Window>>,
}

/// The state of one key: when its last line was logged and how many events were left out since.
#[derive(Debug, Clone, Copy)]
struct Window {
    logged_at: Instant,
    suppressed: u64,
}

impl<K: Eq + Hash> RateLimitedLog<K> {
    /// A limiter logging each key at most once per `interval`.
    pub fn new(interval: Duration) -> Self {
        RateLimitedLog { interval, max_keys: usize::MAX, windows: Mutex::new(HashMap::new()) }
    }

    /// A limiter for keys a peer can vary (an error's text, say): it tracks at most `max_keys` of them; a new key
    /// beyond that, while none of the tracked ones has expired, is only counted, never logged.
    pub fn bounded(interval: Duration, max_keys: usize) -> Self {
        RateLimitedLog { interval, max_keys, windows: Mutex::new(HashMap::new()) }
    }

    /// Records one event of `key` now; see [`RateLimitedLog::admit_at`].
    pub fn admit(&self, key: K) -> Option<u64> {
        self.admit_at(key, Instant::now())
    }

    /// Records one event of `key` at `now`. `Some(suppressed)` means: log it, saying that `suppressed` events of
    /// this key were left out since the previous line; `None` means the previous line of this key was less than
    /// the interval ago, so this event is only counted.
    pub fn admit_at(&self, key: K, now: Instant) -> Option<u64> {
        let mut windows = self.windows.lock().unwrap_or_else(PoisonError::into_inner);
        match windows.get_mut(&key) {
            Some(window) if now.saturating_duration_since(window.logged_at) < self.interval => {
                window.suppressed += 1;
                None
            }
            Some(window) => {
                let suppressed = std::mem::take(&mut window.suppressed);
                window.logged_at = now;
                Some(suppressed)
            }
            None => {
                if windows.len() >= self.max_keys {
                    let interval = self.interval;
                    windows.retain(|_, w| now.saturating_duration_since(w.logged_at) < interval);
                    if windows.len() >= self.max_keys {
                        return None;
                    }
                }
                windows.insert(key, Window { logged_at: now, suppressed: 0 });
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounded_log_tracks_at_most_its_keys_and_frees_expired_ones() {
        let log = RateLimitedLog::bounded(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        assert_eq!(log.admit_at("a".to_owned(), t0), Some(0));
        assert_eq!(log.admit_at("b".to_owned(), t0), Some(0));
        for i in 0..1_000 {
            assert_eq!(log.admit_at(format!("peer-chosen {i}"), t0), None, "no third key while two are live");
        }
        assert_eq!(log.windows.lock().unwrap().len(), 2);
        let later = t0 + Duration::from_secs(10);
        assert_eq!(log.admit_at("c".to_owned(), later), Some(0), "expired keys make room");
    }

    #[test]
    fn logs_each_key_once_per_interval_and_counts_what_it_left_out() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);

        assert_eq!(log.admit_at("self_call", at(0)), Some(0), "the first event is logged");
        for _ in 0..10_000 {
            assert_eq!(log.admit_at("self_call", at(1)), None, "repeats within the interval are not");
        }
        assert_eq!(log.admit_at("not_pod_ip", at(1)), Some(0), "another key has its own interval");
        assert_eq!(log.admit_at("self_call", at(9)), None);
        assert_eq!(log.admit_at("self_call", at(10)), Some(10_001), "one line per interval, with the count left out");
        assert_eq!(log.admit_at("self_call", at(19)), None);
        assert_eq!(log.admit_at("self_call", at(40)), Some(1), "the count starts over after each line");
        assert_eq!(log.admit_at("not_pod_ip", at(40)), Some(0));
    }

    #[test]
    fn a_clock_that_goes_backwards_suppresses_instead_of_panicking() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now() + Duration::from_secs(60);
        assert_eq!(log.admit_at(1u8, t0), Some(0));
        assert_eq!(log.admit_at(1u8, t0 - Duration::from_secs(30)), None);
    }
}
