//! gpushare's test ground: an in-process Kubernetes control plane and the scenarios run on it.
//!
//! - [`apiserver`]: a real HTTP server speaking the Kubernetes REST + watch protocol for the
//!   objects gpushare uses (nodes, pods, bindings, events, leases), strict where the real one
//!   is strict, with fault injection.
//! - [`scheduler`]: drives pending pods through an HTTP extender exactly as kube-scheduler does.
//! - [`kubelet`]: registers device plugins over a real unix socket and admits pods as kubelet
//!   does.
//! - [`fixtures`]: builders for nodes and pods shared by every test.
//! - [`cluster`]: the whole system — our real binaries as child processes on simulated GPUs —
//!   started, faulted and stopped in one place, for the scenarios, the demo and the load harness.
//! - [`scenarios`]: the user stories, written once, run here and on a real cluster.
//! - [`tools`]: installs kubectl and helm from the project's own script, for tests that need them.

pub mod apiserver;
pub mod cluster;
pub mod fixtures;
pub mod kubelet;
pub mod scenarios;
pub mod scheduler;
pub mod tools;
