//! Log throttling for what a peer can repeat at will: a refused connection, a failed accept, a refused request.
//! [`Throttle`] lets the first event through, then at most one per [`LOG_INTERVAL`], and tells the logged line how
//! many events it stands for, so a flood costs a log line every few seconds instead of one per event.

use std::time::{Duration, Instant};

/// A warning that could repeat per connection or per request is logged at most this often.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Counts events and lets one through per [`LOG_INTERVAL`]. One throttle stands for one kind of event; a server
/// that logs several kinds (one per refusal reason, say) keeps one per kind.
#[derive(Debug, Default)]
pub struct Throttle {
    last: Option<Instant>,
    /// Events since the last one let through.
    held: u64,
}

impl Throttle {
    /// One that lets its first event through (a `const fn`, for statics).
    pub const fn new() -> Self {
        Throttle { last: None, held: 0 }
    }

    /// Counts one event; `Some(count of the events held back before it)` if this one should be logged.
    pub fn hit(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self.last.is_some_and(|last| now.duration_since(last) < LOG_INTERVAL) {
            self.held += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_lets_the_first_through_then_counts() {
        let mut throttle = Throttle::default();
        assert_eq!(throttle.hit(), Some(0));
        assert_eq!(throttle.hit(), None);
        assert_eq!(throttle.hit(), None);
        throttle.last = Some(Instant::now() - LOG_INTERVAL);
        assert_eq!(throttle.hit(), Some(2));
        assert_eq!(throttle.hit(), None);
    }
}
