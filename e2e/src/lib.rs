//! gpushare's test ground: an in-process Kubernetes control plane and the scenarios run on it.
//!
//! - [`apiserver`]: a real HTTP server speaking the Kubernetes REST + watch protocol for the
//!   objects gpushare uses (nodes, pods, bindings, events, leases), strict where the real one
//!   is strict, with fault injection.
//! - [`scheduler`]: drives pending pods through an HTTP extender exactly as kube-scheduler does.
//! - [`kubelet`]: registers device plugins over a real unix socket and admits pods as kubelet
//!   does.
//! - [`fixtures`]: builders for nodes and pods shared by every test (`gpushare-testkit`'s,
//!   re-exported).
//! - [`cluster`]: the whole system — our real binaries as child processes on simulated GPUs —
//!   started, faulted and stopped in one place, for the scenarios, the demo and the load harness.
//!   DRA mode runs only on the real-Kubernetes tier ([`realk8s`]), apart from the DRA
//!   plugin's RBAC check (`tests/chart.rs`), which runs the plugin alone on the API server.
//! - [`front`]: a round-robin TCP front over several extender replicas, as a Service is.
//! - [`realk8s`]: the real-Kubernetes tier: the kit of `../shared/realk8s` set up, the chart
//!   installed by helm, container environments read from the real runtime's record.
//! - [`scenarios`]: the user stories, written once, run here and on a real cluster;
//!   [`preemption`]: the preemption stories, run on the real cluster only.
//! - [`tools`]: installs kubectl and helm from the project's own script, for tests that need them.
//!
//! Binaries: `demo` (the local demo cluster), `load` (the load harness: the real extender and
//! device plugin driven at scale on this control plane) and `realload` (drains on the real
//! cluster).

pub mod apiserver;
mod chunked;
pub mod cluster;
pub use gpushare_testkit::fixtures;
pub mod front;
pub mod kubelet;
pub mod preemption;
pub mod realk8s;
pub mod scenarios;
pub mod scheduler;
pub mod tools;

use std::sync::{Mutex, MutexGuard};

/// The guard of `mutex`, poisoned or not: every lock in the harness guards plain maps, counters
/// and state changed synchronously, which a panic elsewhere (already reported by the panicking
/// task) cannot leave half-written in a way that matters to a test.
pub(crate) fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}
