//! How the load harness records and prints what it measured.
//!
//! Latencies are kept whole (one `Duration` per call) and percentiles are read from the sorted
//! list by nearest rank, so p99 of 2,000 binds is the 1,980th slowest call and not a bucket
//! boundary. The report is plain aligned lines on stdout, one figure per line with its unit,
//! so a run can be pasted into an issue or grepped by the smoke test.

use std::fmt::Display;
use std::time::Duration;

const LABEL_WIDTH: usize = 44;

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

/// A process's memory figure from `/proc/<pid>/status` (`VmHWM` = peak RSS, `VmRSS` = now),
/// as `123.4 MiB`; `unavailable` where `/proc` is not readable (not Linux, process gone).
pub fn proc_memory(pid: Option<u32>, field: &str) -> String {
    let kib = pid.and_then(|pid| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|value| value.split_whitespace().next())
            .and_then(|kib| kib.parse::<u64>().ok())
    });
    match kib {
        Some(kib) => format!("{:.1} MiB", kib as f64 / 1024.0),
        None => "unavailable".to_owned(),
    }
}

/// CPU time (user + system, seconds) process `pid` has used so far, from `/proc/PID/stat`.
pub fn proc_cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid?)).ok()?;
    // Fields after the command name (which may hold spaces, so split after its ')'):
    // state is field 3, utime 14 and stime 15, in clock ticks.
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    let (utime, stime) = (ticks(11)?, ticks(12)?);
    Some((utime + stime) as f64 / clock_ticks_per_second())
}

/// `getconf CLK_TCK`: the unit of `/proc` CPU times (100 on every common Linux).
fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|hz| *hz > 0.0)
        .unwrap_or(100.0)
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
