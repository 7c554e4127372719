//! The in-process tier: every test against gpushare-e2e's in-process cluster (API server,
//! scheduler driver, kubelet driver; the real binaries run against it), in one test binary.
//!
//! One binary rather than one per file: each binary links all of kube, tonic, axum and the
//! product crates. As twenty-one binaries they were 62-111 MB apiece, 1.8 GB of a cold
//! build's 6.2 GB target directory (a CI machine ran out of disk while the real tier unpacked
//! its kit after them), and twenty-one links on two cores; as one, 152 MB and one link. The
//! tests share nothing but the binaries they build once (`gpushare_e2e::cluster::cargo_build`):
//! each starts its own API server on 127.0.0.1:0 and its own temp dirs. A file's tests run
//! with its module name as the filter: `cargo test -p gpushare-e2e --test in_process --
//! scenarios::`.
//!
//! The real cluster's tier is `real.rs`, a binary of its own: its scenarios run one at a
//! time (fixed ports, /var/lib/kubelet).

#[path = "device_plugin/common.rs"]
mod device_plugin_common;
#[path = "../../../kubectl-gpushare/tests/common/mod.rs"]
mod kubectl_common;

mod apiserver;
mod bursts;
mod chart;
mod device_plugin_kubelet_plugin;
mod device_plugin_multi_gpu;
mod device_plugin_plugin_grpc;
mod device_plugin_pod_resources;
mod device_plugin_signed_allocations;
mod enforcement;
mod extender_leader;
mod extender_live;
mod gpu_models;
mod ha;
mod kubectl_cli;
mod load_smoke;
mod multi_gpu;
mod pod_resources;
mod scenarios;
mod scheduler_driver;
mod served;
mod unhealthy_gpu;
mod usage;
mod webhook;
