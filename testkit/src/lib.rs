//! gpushare's test kit: what a unit test needs to describe a cluster, and nothing that runs one.
//!
//! - [`fixtures`]: builders for nodes and pods, `node("n1").gpushare().gpus(&[16, 16])`,
//!   `pod("a").gpu_mem(4).on_node("n1")`, as gpushare's device plugin and users write them.
//! - [`json`]: editing JSON documents, for tests that feed decoders what they were not
//!   written for.
//! - [`workload`]: a cluster at scale, as the load harness and the memory instruments build it.
//!
//! The in-process control plane (API server, scheduler and kubelet drivers) lives in
//! `gpushare-e2e`, which depends on this crate and on the product crates; no product crate
//! depends on `gpushare-e2e`, so a unit test compiles only what it tests and this kit.

pub mod fixtures;
pub mod json;
pub mod workload;
