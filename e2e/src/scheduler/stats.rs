//! Counters and latencies the load harness reads; kept as plain vectors so the harness can compute
//! whatever percentiles it reports.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// A snapshot of what the driver has done since it started.
#[derive(Clone, Debug, Default)]
pub struct SchedulerStats {
    /// Scheduling cycles run (one per attempt to place a pod).
    pub cycles: u64,
    /// Cycles that chose a node (the pod was assumed there and handed to a bind task).
    pub assumed: u64,
    /// Cycles that ended with a FitError (no feasible node).
    pub unschedulable: u64,
    /// Cycles that ended with an error (an extender failed, no nodes at all).
    pub scheduling_errors: u64,
    /// Binds that succeeded (through an extender or the API's `pods/binding`).
    pub binds_ok: u64,
    /// Binds that failed; the pod was forgotten and requeued with backoff.
    pub bind_errors: u64,
    pub filter_calls: u64,
    pub prioritize_calls: u64,
    pub bind_calls: u64,
    /// Extender calls that failed (transport, status, decode or a reported `Error`).
    pub extender_errors: u64,
    /// Wall time of each extender call, by verb.
    pub filter_latencies: Vec<Duration>,
    pub prioritize_latencies: Vec<Duration>,
    pub bind_latencies: Vec<Duration>,
    /// Wall time of each scheduling cycle (filters, extenders, scoring, up to the assume).
    pub cycle_latencies: Vec<Duration>,
    /// Wall time of each binding cycle (extender bind or API binding), successful or not.
    pub binding_latencies: Vec<Duration>,
    /// Binds running right now, and the most that ever ran at once.
    pub binds_in_flight: usize,
    pub peak_binds_in_flight: usize,
    /// Extender answers by HTTP version (`HTTP/2.0`, `HTTP/1.1`): over HTTPS kube-scheduler's
    /// transport negotiates HTTP/2 with an extender that offers it.
    pub answers_by_version: std::collections::BTreeMap<String, u64>,
}

/// Which extender verb a call was.
#[derive(Clone, Copy, Debug)]
pub enum Call {
    Filter,
    Prioritize,
    Bind,
}

/// Shared handle the driver and its extenders record into.
#[derive(Clone, Debug, Default)]
pub struct StatsRecorder(Arc<Mutex<SchedulerStats>>);

impl StatsRecorder {
    /// Stats are plain counters: a panic elsewhere cannot leave them inconsistent, so a poisoned
    /// lock is simply taken over.
    pub fn lock(&self) -> MutexGuard<'_, SchedulerStats> {
        crate::locked(&self.0)
    }

    /// An extender answered over `version`.
    pub fn answer(&self, version: http::Version) {
        *self
            .lock()
            .answers_by_version
            .entry(format!("{version:?}"))
            .or_default() += 1;
    }

    pub fn snapshot(&self) -> SchedulerStats {
        self.lock().clone()
    }

    pub fn call(&self, call: Call, latency: Duration, ok: bool) {
        let mut guard = self.lock();
        let stats = &mut *guard;
        let (calls, latencies) = match call {
            Call::Filter => (&mut stats.filter_calls, &mut stats.filter_latencies),
            Call::Prioritize => (&mut stats.prioritize_calls, &mut stats.prioritize_latencies),
            Call::Bind => (&mut stats.bind_calls, &mut stats.bind_latencies),
        };
        *calls += 1;
        latencies.push(latency);
        if !ok {
            stats.extender_errors += 1;
        }
    }

    pub fn bind_started(&self) {
        let mut stats = self.lock();
        stats.binds_in_flight += 1;
        stats.peak_binds_in_flight = stats.peak_binds_in_flight.max(stats.binds_in_flight);
    }

    pub fn bind_finished(&self, latency: Duration, ok: bool) {
        let mut stats = self.lock();
        stats.binds_in_flight = stats.binds_in_flight.saturating_sub(1);
        stats.binding_latencies.push(latency);
        if ok {
            stats.binds_ok += 1;
        } else {
            stats.bind_errors += 1;
        }
    }
}
