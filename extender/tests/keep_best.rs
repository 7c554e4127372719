//! `--filter-keep-best` through the HTTP handlers: filter passes only the nodes kube-scheduler
//! would pick, ranked as kube-scheduler ranks them (our score with its CPU and memory scores),
//! and steps aside where kube-scheduler's own scoring must decide.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::http::StatusCode;
use common::{bound, bound_builder, call_raw, fixture_pod, harness_keeping_best, post};
use gpushare_contract::Keys;
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// `--filter-keep-best`: filter passes only the best-scored fitting nodes, in request order,
/// and reports no reason for the ones it leaves out (nor, since a node passes, for the unfit).
#[tokio::test]
async fn filter_keeps_only_the_best_nodes_when_asked() {
    // Binpack (the harness's policy) ranks the fuller nodes first: half-3 (12 of 16 GiB
    // taken), then half-2 (8), then empty; full cannot take the 4 GiB pod at all.
    let keeping = |n: usize| {
        harness_keeping_best(
            n,
            common::settings(),
            vec![
                node("empty").gpushare().gpus(&[16]).build(),
                node("half-2").gpushare().gpus(&[16]).build(),
                node("half-3").gpushare().gpus(&[16]).build(),
                node("full").gpushare().gpus(&[16]).build(),
            ],
            vec![
                fixture_pod(),
                bound("a", "half-2", 0, 8, true),
                bound("b", "half-3", 0, 12, true),
                bound("c", "full", 0, 16, true),
            ],
        )
    };
    let h = keeping(0);
    let args = json!({
        "Pod": fixture_pod(),
        "Nodes": null,
        "NodeNames": ["empty", "half-3", "full", "half-2"],
    })
    .to_string();
    let passed = |answer: &Value| answer["NodeNames"].clone();

    let (_, every) = post(&h, "filter", &args).await;
    assert_eq!(passed(&every), json!(["empty", "half-3", "half-2"]));

    let (status, best) = post(&keeping(1), "filter", &args).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(passed(&best), json!(["half-3"]));
    assert_eq!(best["FailedNodes"], json!({}), "{best}");

    let (_, two) = post(&keeping(2), "filter", &args).await;
    assert_eq!(passed(&two), json!(["half-3", "half-2"]));

    // More to keep than fit: every fitting node.
    let (_, all) = post(&keeping(5), "filter", &args).await;
    assert_eq!(passed(&all), passed(&every));
}

/// `--filter-keep-best`: the node kept is the one kube-scheduler would choose with scores,
/// its CPU and memory scores included: of two nodes our score ties, the one whose CPU a
/// CPU-only pod has mostly taken loses. A pod with soft preferences, or facing a
/// `PreferNoSchedule` taint it does not tolerate, gets every fitting node, and the metric
/// says why.
#[tokio::test]
async fn keep_best_ranks_as_kube_scheduler_would_and_steps_aside_for_soft_preferences() {
    let hog = pod("cpu-hog").cpu("6").on_node("busy").build();
    let gpu_pod = pod("trainer").gpu_mem(4).cpu("1").build();
    let h = harness_keeping_best(
        1,
        common::settings(),
        vec![roomy("busy"), roomy("idle")],
        vec![hog, gpu_pod.clone()],
    );
    let filter =
        |pod: &Pod| json!({"Pod": pod, "Nodes": null, "NodeNames": ["busy", "idle"]}).to_string();
    let (_, kept) = post(&h, "filter", &filter(&gpu_pod)).await;
    assert_eq!(kept["NodeNames"], json!(["idle"]), "{kept}");

    let mut prefers = gpu_pod.clone();
    prefers.metadata.name = Some("prefers".to_owned());
    prefers.metadata.uid = Some("uid-prefers".to_owned());
    prefers.spec.as_mut().unwrap().affinity = serde_json::from_value(json!({
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "preference": {"matchExpressions": [
                {"key": "rack", "operator": "In", "values": ["a"]}]}}]}
    }))
    .unwrap();
    let (_, every) = post(&h, "filter", &filter(&prefers)).await;
    assert_eq!(every["NodeNames"], json!(["busy", "idle"]), "{every}");

    let mut tainted = roomy("idle");
    tainted.spec.get_or_insert_default().taints = serde_json::from_value(json!([
        {"key": "maintenance", "value": "soon", "effect": "PreferNoSchedule"}
    ]))
    .unwrap();
    h.state.view_mut().apply_node(&tainted);
    let (_, every) = post(&h, "filter", &filter(&gpu_pod)).await;
    assert_eq!(every["NodeNames"], json!(["busy", "idle"]), "{every}");
    let mut tolerant = gpu_pod.clone();
    tolerant.spec.as_mut().unwrap().tolerations = serde_json::from_value(json!([
        {"key": "maintenance", "operator": "Exists"}
    ]))
    .unwrap();
    let (_, kept) = post(&h, "filter", &filter(&tolerant)).await;
    assert_eq!(kept["NodeNames"], json!(["idle"]), "{kept}");
    // The idle-GPU taint is met the same way: a routed pod carries the toleration the
    // webhook adds, and is narrowed as before.
    let mut idle_gpu = roomy("idle");
    idle_gpu.spec.get_or_insert_default().taints = serde_json::from_value(json!([
        {"key": "gpushare.example.com/idle-gpu", "effect": "PreferNoSchedule"}
    ]))
    .unwrap();
    h.state.view_mut().apply_node(&idle_gpu);
    let mut routed = gpu_pod.clone();
    routed.spec.as_mut().unwrap().tolerations = serde_json::from_value(json!([
        {"key": "gpushare.example.com/idle-gpu", "operator": "Exists", "effect": "PreferNoSchedule"}
    ]))
    .unwrap();
    let (_, kept) = post(&h, "filter", &filter(&routed)).await;
    assert_eq!(kept["NodeNames"], json!(["idle"]), "{kept}");

    let (_, _, metrics) = call_raw(&h.app, "GET", "/metrics", "").await;
    for reason in ["preferred_node_affinity", "prefer_no_schedule_taint"] {
        let line = format!(
            "gpushare_extender_filter_keep_best_stepped_aside_total{{reason=\"{reason}\"}} 1"
        );
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
}

/// A gpushare node with one 16 GiB GPU, 8 CPUs and 32 GiB.
fn roomy(name: &str) -> k8s_openapi::api::core::v1::Node {
    node(name)
        .gpushare()
        .gpus(&[16])
        .cpu("8")
        .memory("32Gi")
        .build()
}

/// Four pending jobs of 8 × 8 GiB: multi-GPU pods then bring most of the GPU demand.
fn eight_gpu_jobs() -> Vec<Pod> {
    (0..4)
        .map(|i| {
            pod(&format!("job-{i}"))
                .gpu_mem(64)
                .annotation(&Keys::default().request_gpus, "8")
                .build()
        })
        .collect()
}

/// The filter's answer, keeping the best node, for `small` on two [`roomy`] nodes "busy" (where
/// `resident` runs) and "idle", offered in `order`, with `jobs` pending besides.
async fn kept_of_two(
    resident: &Pod,
    small: &Pod,
    jobs: Vec<Pod>,
    order: [&str; 2],
) -> (common::Harness, Value) {
    let pods = [vec![resident.clone(), small.clone()], jobs].concat();
    let h = harness_keeping_best(
        1,
        common::settings(),
        vec![roomy("busy"), roomy("idle")],
        pods,
    );
    let body = json!({"Pod": small, "Nodes": null, "NodeNames": order}).to_string();
    let (_, answer) = post(&h, "filter", &body).await;
    (h, answer)
}

/// Where multi-GPU jobs bring much of the GPU demand arriving, the filter that keeps the best
/// ranks by our score alone, without kube-scheduler's CPU and memory scores (LeastAllocated
/// would spread small pods' CPU over every node and leave none with the CPU such a job
/// needs): the node our score prefers wins although its CPU is nearly gone and LeastAllocated
/// prefers the other by more than our score does, and the gauge says why. (That
/// BalancedAllocation is out too shows where our score ties, in the next test.)
#[tokio::test]
async fn keep_best_ranks_by_our_score_alone_while_multi_gpu_jobs_dominate_the_demand() {
    // busy holds a 4 GiB GPU pod asking 7.8 CPUs and 31 GiB. With the small pod: busy CPU
    // 7.9/8, memory 31.25/32 Gi; idle CPU 0.1/8, memory 0.25/32. LeastAllocated +
    // BalancedAllocation: busy 1 + 99, idle 98 + 99; our score × 10: busy 100 (its GPU is
    // the fuller), idle 10. With the resource scores idle wins, 207 to 200; by ours, busy.
    let resident = bound_builder("resident", "busy", 0, 4, true)
        .cpu("7800m")
        .memory("31Gi")
        .build();
    let small = pod("small").gpu_mem(4).cpu("100m").memory("256Mi").build();
    for (jobs, kept) in [(vec![], "idle"), (eight_gpu_jobs(), "busy")] {
        let (h, answer) = kept_of_two(&resident, &small, jobs, ["busy", "idle"]).await;
        assert_eq!(answer["NodeNames"], json!([kept]), "{answer}");
        let (_, _, metrics) = call_raw(&h.app, "GET", "/metrics", "").await;
        let share: f64 = metrics
            .lines()
            .find_map(|line| line.strip_prefix("gpushare_extender_multi_gpu_demand_share "))
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no demand share in {metrics}"));
        assert_eq!(share >= 0.25, kept == "busy", "{share}");
    }
}

/// The same switch where our score ties: two nodes with one empty 16 GiB GPU each, "busy"
/// holding a CPU-light, memory-heavy pod. With the small pod: busy CPU 5/8, memory 21/32 Gi,
/// which BalancedAllocation likes; idle CPU 4/8, memory 1/32. While the demand is one-GPU,
/// LeastAllocated + BalancedAllocation keep idle (73 + 76 against 35 + 98); while multi-GPU
/// jobs dominate, nothing but our tied score counts and the filter keeps the first
/// candidate, idle, where BalancedAllocation alone would keep busy.
#[tokio::test]
async fn keep_best_counts_no_resource_score_while_multi_gpu_jobs_dominate_the_demand() {
    let resident = pod("resident")
        .cpu("1")
        .memory("20Gi")
        .on_node("busy")
        .build();
    let small = pod("small").gpu_mem(4).cpu("4").memory("1Gi").build();
    for jobs in [vec![], eight_gpu_jobs()] {
        let (_, answer) = kept_of_two(&resident, &small, jobs, ["idle", "busy"]).await;
        assert_eq!(answer["NodeNames"], json!(["idle"]), "{answer}");
    }
}
