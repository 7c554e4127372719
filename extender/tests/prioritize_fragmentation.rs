//! Prioritize under the `fragmentation` policy, through the real router: the workload is
//! learned from the waiting pods the watch shows, the nodes' CPU from their allocatable, the
//! pods' CPU from their requests; the answer prefers the node the placement fragments less,
//! where `binpack` prefers the fuller one.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{FakeBinder, PREFIX, bound_builder, call, fast_timing, settings, with_uid};
use gpushare_allocator::Policy;
use gpushare_extender::{EventSink, Scheduling, router};
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::{Node, Pod};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

/// A synced state under `policy` over these nodes and pods, and its router.
fn app(policy: Policy, nodes: &[Node], pods: Vec<Pod>) -> axum::Router {
    let state = Scheduling::new(
        settings(),
        gpushare_extender::Ranking::by(policy),
        Arc::new(FakeBinder::default()),
        fast_timing(),
        EventSink::disabled(),
        Registry::default(),
    );
    let pods: Vec<Pod> = pods.into_iter().map(with_uid).collect();
    {
        let mut view = state.view_mut();
        view.replace_nodes(nodes);
        view.replace_pods(&pods);
    }
    router(state, PREFIX, gpushare_extender::DEFAULT_BODY_LIMIT)
}

/// A pod bound to `node_name` holding `gib` on GPU `gpu`, as the watch shows it.
fn bound(name: &str, node_name: &str, gpu: u32, gib: u64) -> Pod {
    bound_with_cpu(name, node_name, gpu, gib, None)
}

/// [`bound`], requesting `cpu` when given.
fn bound_with_cpu(name: &str, node_name: &str, gpu: u32, gib: u64, cpu: Option<&str>) -> Pod {
    let builder = bound_builder(name, node_name, gpu, gib, true);
    match cpu {
        Some(cpu) => builder.cpu(cpu).build(),
        None => builder.build(),
    }
}

/// kube-scheduler's prioritize call for `pod` over these node names.
fn prioritize_body(pod: &Pod, names: &[&str]) -> String {
    json!({"Pod": pod, "Nodes": null, "NodeNames": names}).to_string()
}

/// Scores of `names` from a prioritize answer, read as kube-scheduler reads them: a node the
/// answer leaves out scores 0 (the extender lists only the nodes above the lowest).
fn scores(answer: &Value, names: &[&str]) -> Vec<(String, i64)> {
    let listed = answer.as_array().unwrap();
    names
        .iter()
        .map(|name| {
            let score = listed
                .iter()
                .filter(|entry| entry["Host"] == *name)
                .map(|entry| entry["Score"].as_i64().unwrap())
                .sum();
            ((*name).to_owned(), score)
        })
        .collect()
}

/// Two nodes of 2 × 16 GiB GPUs. `tight` has 12 cores and already runs a 1 GiB pod, so
/// binpack finds it fuller; `roomy` has 64 cores and is empty. The pods that arrive ask for
/// 8 GiB and 4 cores (three wait in the queue). The pod to place asks for 8 GiB and 8 cores.
///
/// On `tight`, the pod leaves 4 cores: one more typical pod fits, and of the 23 GiB still
/// free only 8 can ever be used; 15 GiB are stranded behind the CPU (before, with 12 cores
/// for three typical pods, 7 GiB were: the 15 GiB GPU takes one 8 GiB pod, not two).
/// On `roomy`, 56 cores remain and the 24 free GiB still take three typical pods: nothing
/// is stranded. So the pod belongs on `roomy`, which binpack gets wrong.
fn stranding_cluster() -> (Vec<Node>, Vec<Pod>, Pod) {
    let nodes = vec![
        node("tight").gpushare().gpus(&[16, 16]).cpu("12").build(),
        node("roomy").gpushare().gpus(&[16, 16]).cpu("64").build(),
    ];
    let mut pods = vec![bound("small", "tight", 0, 1)];
    for i in 0..3 {
        pods.push(pod(&format!("typical-{i}")).gpu_mem(8).cpu("4").build());
    }
    let incoming = with_uid(pod("incoming").gpu_mem(8).cpu("8").build());
    (nodes, pods, incoming)
}

#[tokio::test]
async fn the_node_the_pod_would_strand_scores_below_the_one_it_would_not() {
    let (nodes, pods, incoming) = stranding_cluster();
    let app = app(Policy::Fragmentation, &nodes, pods);
    let body = prioritize_body(&incoming, &["tight", "roomy"]);
    let (status, answer) = call(&app, "POST", &format!("{PREFIX}/prioritize"), &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        scores(&answer, &["tight", "roomy"]),
        vec![("tight".to_owned(), 0), ("roomy".to_owned(), 9)]
    );
}

#[tokio::test]
async fn binpack_prefers_the_fuller_node_in_the_same_cluster() {
    // The same request under binpack: what the fragmentation policy changes.
    let (nodes, pods, incoming) = stranding_cluster();
    let app = app(Policy::Binpack, &nodes, pods);
    let body = prioritize_body(&incoming, &["tight", "roomy"]);
    let (_, answer) = call(&app, "POST", &format!("{PREFIX}/prioritize"), &body).await;
    assert_eq!(
        scores(&answer, &["tight", "roomy"]),
        vec![("tight".to_owned(), 9), ("roomy".to_owned(), 0)]
    );
}

#[tokio::test]
async fn without_cpu_pressure_the_fuller_node_wins_and_misfits_score_zero() {
    // Both nodes roomy: nothing is stranded either way, so the fuller node wins (ties
    // pack); a node whose GPUs cannot hold the pod scores 0.
    let nodes = vec![
        node("fuller").gpushare().gpus(&[16, 16]).cpu("64").build(),
        node("empty").gpushare().gpus(&[16, 16]).cpu("64").build(),
        node("small").gpushare().gpus(&[4]).cpu("64").build(),
    ];
    let mut pods = vec![bound("resident", "fuller", 0, 8)];
    for i in 0..3 {
        pods.push(pod(&format!("typical-{i}")).gpu_mem(8).cpu("4").build());
    }
    let app = app(Policy::Fragmentation, &nodes, pods);
    let incoming = with_uid(pod("incoming").gpu_mem(8).cpu("4").build());
    let body = prioritize_body(&incoming, &["fuller", "empty", "small"]);
    let (_, answer) = call(&app, "POST", &format!("{PREFIX}/prioritize"), &body).await;
    let scores = scores(&answer, &["fuller", "empty", "small"]);
    assert_eq!(scores[0], ("fuller".to_owned(), 10));
    assert!((1..10).contains(&scores[1].1), "{scores:?}");
    assert_eq!(scores[2], ("small".to_owned(), 0));
}

#[tokio::test]
async fn a_started_extender_learns_the_shapes_from_the_pods_already_bound() {
    // No pod waits: the typical 8 GiB / 4-core pods are all bound (on `busy`), as when the
    // extender restarts. Learned from them, the scores are those of the stranding scenario;
    // with nothing learned they would be binpack's (tight 10, roomy 1).
    let (mut nodes, _, incoming) = stranding_cluster();
    nodes.push(node("busy").gpushare().gpus(&[16, 16]).cpu("64").build());
    let pods = vec![
        bound("small", "tight", 0, 1),
        bound_with_cpu("typical-0", "busy", 0, 8, Some("4")),
        bound_with_cpu("typical-1", "busy", 0, 8, Some("4")),
        bound_with_cpu("typical-2", "busy", 1, 8, Some("4")),
    ];
    let app = app(Policy::Fragmentation, &nodes, pods);
    let body = prioritize_body(&incoming, &["tight", "roomy"]);
    let (_, answer) = call(&app, "POST", &format!("{PREFIX}/prioritize"), &body).await;
    assert_eq!(
        scores(&answer, &["tight", "roomy"]),
        vec![("tight".to_owned(), 0), ("roomy".to_owned(), 9)]
    );
}
