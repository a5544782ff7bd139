//! Summaries of timed samples: every figure in the report is a median, p90 and p99 over a stated sample count.

use std::time::Duration;

/// Median, p90 and p99 (nearest rank) of a set of samples.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    /// 50th percentile.
    pub median: Duration,
    /// 90th percentile.
    pub p90: Duration,
    /// 99th percentile.
    pub p99: Duration,
}

impl Summary {
    /// Summarizes `samples` (panics on an empty set: a scenario that measured nothing is a bug).
    pub fn of(samples: &[Duration]) -> Summary {
        assert!(!samples.is_empty(), "no samples to summarize");
        let mut sorted = samples.to_vec();
        sorted.sort();
        let rank = |q: f64| sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        Summary { median: rank(0.5), p90: rank(0.9), p99: rank(0.99) }
    }

    /// A row `| label | median | p90 | max |` of `samples` in milliseconds with `decimals` places (the max, not the
    /// p99: these rows summarize a few dozen rounds). Panics on an empty set, as [`Summary::of`].
    pub fn ms_row(label: &str, samples: &[Duration], decimals: usize) -> String {
        let s = Summary::of(samples);
        let max = samples.iter().max().copied().unwrap_or_default();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "| {label} | {:.decimals$} ms | {:.decimals$} ms | {:.decimals$} ms |\n",
            ms(s.median),
            ms(s.p90),
            ms(max)
        )
    }

    /// `| median | p90 | p99 |` cells in microseconds.
    pub fn us_cells(&self) -> String {
        format!("{} | {} | {}", us(self.median), us(self.p90), us(self.p99))
    }
}

/// A duration in whole microseconds.
pub fn us(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e6)
}

/// `a / b` of two durations (how many times `b` fits in `a`).
pub fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-9)
}

/// Gigabits per second for `bytes` moved in `took`.
pub fn gbps(bytes: u64, took: Duration) -> f64 {
    bytes as f64 * 8.0 / took.as_secs_f64().max(1e-9) / 1e9
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let s = Summary::of(&samples);
        assert_eq!((s.median, s.p90, s.p99), (ms(50), ms(90), ms(99)));
        let one = Summary::of(&[ms(7)]);
        assert_eq!((one.median, one.p99), (ms(7), ms(7)));
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
}

/// Warm-up and timed iteration counts of a scenario.
#[derive(Debug, Clone, Copy)]
pub struct Counts {
    /// Untimed rounds first.
    pub warmup: usize,
    /// Timed rounds.
    pub iterations: usize,
}
