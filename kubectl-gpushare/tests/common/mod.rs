//! One small cluster shared by the golden tests here and the end-to-end ones
//! (`e2e/tests/in_process/kubectl_cli.rs`, which compiles this file by path), so both must print the
//! same thing for the same objects.

// Each test binary uses part of it; a failed unwrap in a helper is a failed test.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use gpushare_contract::{ContainerRequest, Keys, PodAllocation};
use gpushare_testkit::fixtures::{PodBuilder, node, pod};
use k8s_openapi::api::core::v1::{Node, Pod};

/// A pod placed by the extender on GPU `gpu` of its node.
pub fn placed(builder: PodBuilder, gpu: u32, gib: u64) -> PodBuilder {
    let allocation = PodAllocation {
        more_gpus: Vec::new(),
        exclusive: false,
        gpu_index: gpu,
        gpu_uuid: String::new(),
        pod_gib: gib,
        containers: vec![ContainerRequest {
            name: "main".into(),
            gib,
            init: false,
            compute: 0,
        }],
        bind_time: "2026-01-01T00:00:00Z".into(),
        assigned: true,
        allocated: vec!["main".into()],
        signature: None,
        compute: 0,
    };
    allocation
        .to_annotations(&Keys::default())
        .iter()
        .fold(builder, |b, (k, v)| b.annotation(k, v))
}

/// - n1: labelled, two 16 GiB GPUs; a (4 GiB, GPU0), b (8 GiB, GPU1), c (2 GiB, bound by
///   the default scheduler without the extender: pending).
/// - n2: labelled, 32 GiB over 2 GPUs by capacity only (no inventory); d (6 GiB, GPU1).
/// - n3: one 24 GiB GPU but no label (the extender ignores it).
/// - n4: labelled, no capacity (device plugin not registered).
/// - cpu1: an ordinary node, not shown.
/// - e: pending, unbound (not counted); f: on n1 asking for nothing (not counted).
pub fn cluster() -> (Vec<Node>, Vec<Pod>) {
    let nodes = vec![
        node("n1").gpushare().gpus(&[16, 16]).build(),
        node("n2").gpushare().capacity_only(32, 2).build(),
        node("n3").gpus(&[24]).build(),
        node("n4").gpushare().build(),
        node("cpu1").build(),
    ];
    let pods = vec![
        placed(pod("a").gpu_mem(4).on_node("n1"), 0, 4).build(),
        placed(pod("b").gpu_mem(8).on_node("n1"), 1, 8).build(),
        pod("c").gpu_mem(2).on_node("n1").build(),
        placed(pod("d").namespace("ml").gpu_mem(6).on_node("n2"), 1, 6).build(),
        pod("e").gpu_mem(3).build(),
        pod("f").on_node("n1").build(),
    ];
    (nodes, pods)
}

/// `tests/golden/<name>`; with `UPDATE_GOLDEN=1` the file is rewritten from `actual`.
pub fn assert_golden(name: &str, actual: &str) {
    // From the workspace root: `e2e/tests/in_process/kubectl_cli.rs` compiles this module too.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kubectl-gpushare/tests/golden")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run with UPDATE_GOLDEN=1 to create it)",
            path.display()
        )
    });
    assert_eq!(
        actual,
        expected,
        "output differs from {} (UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
}
