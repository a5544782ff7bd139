//! The wall clock the certificate manager and the CA client judge validity by.
//!
//! Guarantees: [`Clock::System`] is the system's wall clock. [`Clock::tokio`] is anchored on the wall clock once
//! and then advances with tokio's clock, so tests that pause tokio time see certificates age, refresh and expire
//! without real sleeps; the manager schedules on tokio's timers either way.

use std::time::{Duration, SystemTime};

/// Where "now" comes from.
#[derive(Clone, Copy, Debug, Default)]
pub enum Clock {
    /// The system's wall clock.
    #[default]
    System,
    /// The wall clock at `start`, then tokio's elapsed time.
    Tokio {
        /// The wall time at the anchor.
        wall: SystemTime,
        /// Tokio's time at the anchor.
        start: tokio::time::Instant,
    },
}

impl Clock {
    /// A clock that follows tokio's (possibly paused) time from now on.
    pub fn tokio() -> Self {
        Clock::Tokio { wall: SystemTime::now(), start: tokio::time::Instant::now() }
    }

    /// The current wall time.
    pub fn now(&self) -> SystemTime {
        match self {
            Clock::System => SystemTime::now(),
            Clock::Tokio { wall, start } => *wall + start.elapsed(),
        }
    }

    /// How long until `at` (zero if it has passed).
    pub fn until(&self, at: SystemTime) -> Duration {
        at.duration_since(self.now()).unwrap_or_default()
    }
}
