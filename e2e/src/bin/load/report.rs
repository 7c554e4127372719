//! How the load harness records and prints what it measured.
//!
//! Latencies are kept whole (one `Duration` per call) and percentiles are read from the sorted
//! list by nearest rank, so p99 of 2,000 binds is the 1,980th slowest call and not a bucket
//! boundary. The report is plain aligned lines on stdout, one figure per line with its unit,
//! so a run can be pasted into an issue or grepped by the smoke test.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use gpushare_e2e::realk8s::load::rss_mib;

const LABEL_WIDTH: usize = 44;
/// How many refusal or error messages the report quotes.
pub const QUOTED: usize = 3;

/// Every latency of one kind of call.
#[derive(Debug, Default, Clone)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    pub fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Sorted, for reading percentiles.
    pub fn summary(mut self) -> Summary {
        self.0.sort_unstable();
        Summary(self.0)
    }
}

/// Sorted latencies.
#[derive(Debug)]
pub struct Summary(Vec<Duration>);

impl Summary {
    /// The nearest-rank percentile `p` (0..=100); `None` when nothing was recorded.
    pub fn percentile(&self, p: f64) -> Option<Duration> {
        if self.0.is_empty() {
            return None;
        }
        let rank = (p / 100.0 * self.0.len() as f64).ceil() as usize;
        let index = rank.clamp(1, self.0.len()) - 1;
        self.0.get(index).copied()
    }

    pub fn max(&self) -> Option<Duration> {
        self.0.last().copied()
    }

    /// Prints `<what> p50`, `<what> p99` and `<what> max` lines.
    pub fn print(&self, what: &str) {
        figure(&format!("{what} p50"), ms(self.percentile(50.0)));
        figure(&format!("{what} p99"), ms(self.percentile(99.0)));
        figure(&format!("{what} max"), ms(self.max()));
    }
}

/// A section heading.
pub fn section(title: &str) {
    println!();
    println!("{title}");
}

/// One figure: an aligned label and its value (with unit).
pub fn figure(label: &str, value: impl Display) {
    println!("  {label:<LABEL_WIDTH$} {value}");
}

/// The time since `started`, as a figure.
pub fn took(label: &str, started: Instant) {
    figure(label, secs(started.elapsed()));
}

/// `label`: how many `messages`, then the first few quoted as `  <quote>`.
pub fn quoted(label: &str, quote: &str, messages: &[String]) {
    figure(label, messages.len());
    for message in messages.iter().take(QUOTED) {
        figure(&format!("  {quote}"), message);
    }
}

/// Runs `calls`, `concurrency` at a time; the first error ends it.
pub async fn in_flight<T, E>(
    concurrency: usize,
    calls: impl Iterator<Item = impl Future<Output = Result<T, E>>>,
) -> Result<(), E> {
    futures::stream::iter(calls)
        .buffer_unordered(concurrency)
        .try_for_each(|_| async { Ok(()) })
        .await
}

/// `12.345 ms`, or `n/a` when nothing was measured.
pub fn ms(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.3} ms", d.as_secs_f64() * 1e3),
        None => "n/a (no calls)".to_owned(),
    }
}

/// `1.23 s`.
pub fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// `a ÷ b` with two decimals, or `n/a` when `b` is zero.
pub fn ratio(a: u64, b: u64) -> String {
    if b == 0 {
        "n/a (nothing to divide by)".to_owned()
    } else {
        format!("{:.2}", a as f64 / b as f64)
    }
}

/// A process's memory figure (`VmHWM` = peak RSS, `VmRSS` = now) as `123.4 MiB`;
/// `unavailable` where `/proc` is not readable (not Linux, process gone).
pub fn proc_memory(pid: Option<u32>, field: &str) -> String {
    match pid.and_then(rss_mib) {
        Some((peak, now)) => format!("{:.1} MiB", if field == "VmHWM" { peak } else { now }),
        None => "unavailable".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut l = Latencies::default();
        for ms in (1..=100).rev() {
            l.push(Duration::from_millis(ms));
        }
        let s = l.summary();
        assert_eq!(s.percentile(50.0), Some(Duration::from_millis(50)));
        assert_eq!(s.percentile(99.0), Some(Duration::from_millis(99)));
        assert_eq!(s.percentile(100.0), Some(Duration::from_millis(100)));
        assert_eq!(s.percentile(0.0), Some(Duration::from_millis(1)));
        assert_eq!(s.max(), Some(Duration::from_millis(100)));
        assert_eq!(Latencies::default().summary().percentile(50.0), None);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn reads_own_memory() {
        assert!(proc_memory(Some(std::process::id()), "VmHWM").ends_with("MiB"));
        assert_eq!(proc_memory(None, "VmRSS"), "unavailable");
    }
}
