//! The preempt verb on a state built directly (no API server): kube-scheduler's proposal by
//! the node's total against the extender's per-GPU answer, nodes dropped, pods that are not
//! ours, and the memory held for a nominated preemptor.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::http::StatusCode;
use std::time::Instant;

use common::{PREFIX, bind_body, bound_builder, call, call_raw, harness, post};
use gpushare_allocator::{Policy, Request};
use gpushare_extender::scheduling::view::Hold;
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// The issue's node `node-k`: GPUs of 15 and 16 GiB holding three and four 4 GiB pods; the
/// first pod of each GPU (`low-0`, `low-1`) has priority 10, the others 100.
fn seven_pods() -> common::Harness {
    let mut pods = Vec::new();
    for (gpu, count) in [(0, 3), (1, 4)] {
        for i in 0..count {
            let (name, priority) = match i {
                0 => (format!("low-{gpu}"), 10),
                _ => (format!("mid-{gpu}-{i}"), 100),
            };
            pods.push(
                bound_builder(&name, "node-k", gpu, 4, true)
                    .priority(priority)
                    .build(),
            );
        }
    }
    pods.push(
        pod("cpu-only")
            .on_node("node-k")
            .cpu("1")
            .priority(0)
            .build(),
    );
    harness(
        vec![node("node-k").gpushare().gpus(&[15, 16]).build()],
        pods,
    )
}

/// A pending pod asking `gib` at `priority`, with UID `uid-<name>`.
fn preemptor(name: &str, gib: u64, priority: i32) -> Pod {
    let mut pod = pod(name).gpu_mem(gib).priority(priority).build();
    pod.metadata.uid = Some(format!("uid-{name}"));
    pod
}

/// The 8 GiB pod `name` (UID `uid-<name>`, priority 1000) that preemption nominated for
/// `node`, as the watch shows it.
fn nominated_for(name: &str, node: &str) -> Pod {
    let mut pod = pod(name).gpu_mem(8).priority(1000).nominated(node).build();
    pod.metadata.uid = Some(format!("uid-{name}"));
    pod
}

/// The preempt body kube-scheduler sends with `nodeCacheCapable: true`: `node` with `victims`.
fn meta_args(pod: &Pod, node: &str, victims: &[&str]) -> String {
    let pods: Vec<Value> = victims
        .iter()
        .map(|name| json!({"UID": format!("uid-{name}")}))
        .collect();
    json!({
        "Pod": pod,
        "NodeNameToVictims": null,
        "NodeNameToMetaVictims": {node: {"Pods": pods, "NumPDBViolations": 0}},
    })
    .to_string()
}

/// kube-scheduler's preempt call for `pod` with `victims` proposed on `node`, answered.
async fn preempt_on(
    h: &common::Harness,
    pod: &Pod,
    node: &str,
    victims: &[&str],
) -> (axum::http::StatusCode, Value) {
    post(h, "preempt", &meta_args(pod, node, victims)).await
}

/// The victims answered for `node`, by pod name (UIDs are `uid-<name>`).
fn victims(answer: &Value, node: &str) -> Vec<String> {
    answer["NodeNameToMetaVictims"][node]["Pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["UID"]
                .as_str()
                .unwrap()
                .trim_start_matches("uid-")
                .to_owned()
        })
        .collect()
}

async fn metrics(h: &common::Harness) -> String {
    call_raw(&h.app, "GET", "/metrics", "").await.2
}

#[tokio::test]
async fn an_8_gib_preemptor_evicts_two_pods_of_one_gpu_not_the_two_kube_scheduler_proposed() {
    let h = seven_pods();
    let pod = preemptor("important", 8, 100_000);
    // kube-scheduler proposes the two least important pods, one from each GPU.
    let (status, answer) = preempt_on(&h, &pod, "node-k", &["low-0", "low-1"]).await;
    assert_eq!(status, StatusCode::OK);
    let names = victims(&answer, "node-k");
    assert_eq!(names.len(), 2, "{answer}");
    let gpu = if names.contains(&"low-0".to_owned()) {
        0
    } else {
        1
    };
    // The least important pod of one GPU and one more of the same GPU, most important first.
    assert_eq!(names[1], format!("low-{gpu}"), "{names:?}");
    assert!(names[0].starts_with(&format!("mid-{gpu}-")), "{names:?}");
    assert_eq!(
        answer["NodeNameToMetaVictims"]["node-k"]["NumPDBViolations"],
        0
    );
    let text = metrics(&h).await;
    assert!(
        text.contains(r#"gpushare_extender_preempt_victims_total{by="proposed"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"gpushare_extender_preempt_victims_total{by="answered"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"gpushare_extender_preempt_answers_total{outcome="victims"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_preemptor_no_eviction_can_place_drops_the_node() {
    let h = seven_pods();
    // 20 GiB fits on no GPU of 15 or 16, whoever goes.
    let pod = preemptor("huge", 20, 100_000);
    let (_, answer) = preempt_on(&h, &pod, "node-k", &["low-0", "low-1", "mid-1-1"]).await;
    assert_eq!(answer, json!({"NodeNameToMetaVictims": {}}));
    // A preemptor above only the two least important pods: one from each GPU frees room on
    // neither, and pods of its own priority or above never go.
    let pod = preemptor("modest", 8, 100);
    let (_, answer) = preempt_on(&h, &pod, "node-k", &["low-0", "low-1"]).await;
    assert_eq!(answer, json!({"NodeNameToMetaVictims": {}}));
    // A 7 GiB one at that priority needs only the low pod of GPU 0 gone.
    let pod = preemptor("small", 7, 100);
    let (_, answer) = post(&h, "preempt", &meta_args(&pod, "node-k", &["low-0"])).await;
    assert_eq!(victims(&answer, "node-k"), ["low-0"]);
    let text = metrics(&h).await;
    assert!(
        text.contains(r#"gpushare_extender_preempt_answers_total{outcome="no_node"} 2"#),
        "{text}"
    );
    assert!(
        text.contains("gpushare_extender_preempt_nodes_dropped_total 2"),
        "{text}"
    );
}

#[tokio::test]
async fn victims_kube_scheduler_chose_for_other_resources_stay_and_unknown_nodes_go() {
    let h = seven_pods();
    let pod = preemptor("important", 8, 100_000);
    let body = json!({
        "Pod": pod,
        "NodeNameToMetaVictims": {
            "node-k": {"Pods": [{"UID": "uid-low-0"}, {"UID": "uid-cpu-only"}], "NumPDBViolations": 0},
            "node-gone": {"Pods": [{"UID": "uid-x"}], "NumPDBViolations": 0},
        },
    });
    let (_, answer) = post(&h, "preempt", &body.to_string()).await;
    let names = victims(&answer, "node-k");
    // Ours first, then the pod holding no GPU memory that kube-scheduler proposed.
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(names[2], "cpu-only");
    assert!(
        answer["NodeNameToMetaVictims"].get("node-gone").is_none(),
        "{answer}"
    );
}

#[tokio::test]
async fn the_whole_pod_form_is_read_and_pods_not_ours_pass_through() {
    let h = seven_pods();
    let important = preemptor("important", 8, 100_000);
    let low = h
        .state
        .view()
        .pod("default", "low-0")
        .unwrap()
        .uid
        .to_string();
    let whole = json!({
        "Pod": important,
        "NodeNameToVictims": {"node-k": {"Pods": [{"metadata": {"uid": low, "name": "low-0"}}], "NumPDBViolations": 0}},
        "NodeNameToMetaVictims": null,
    });
    let (_, answer) = post(&h, "preempt", &whole.to_string()).await;
    assert_eq!(victims(&answer, "node-k").len(), 2, "{answer}");
    // A pod asking for no GPU memory: kube-scheduler's proposal comes back as it was.
    let mut cpu_pod = pod("cpu-preemptor").priority(100_000).build();
    cpu_pod.metadata.uid = Some("uid-cpu-preemptor".into());
    let (_, answer) = post(&h, "preempt", &meta_args(&cpu_pod, "node-k", &["cpu-only"])).await;
    assert_eq!(victims(&answer, "node-k"), ["cpu-only"]);
    // Not the protocol's JSON: a 400 naming the problem.
    let (status, answer) = post(&h, "preempt", r#"{"NodeNameToMetaVictims": [1]}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("malformed preempt request body"),
        "{answer}"
    );
}

#[tokio::test]
async fn the_gpu_freed_for_a_nominated_preemptor_is_held_for_it() {
    // One 16 GiB GPU with four 4 GiB pods of priority 10.
    let pods: Vec<Pod> = (0..4)
        .map(|i| {
            bound_builder(&format!("p{i}"), "node-n", 0, 4, true)
                .priority(10)
                .build()
        })
        .collect();
    let h = harness(
        vec![node("node-n").gpushare().gpus(&[16]).build()],
        pods.clone(),
    );
    let important = preemptor("important", 8, 1000);
    let (_, answer) = preempt_on(&h, &important, "node-n", &["p0", "p1"]).await;
    let gone = victims(&answer, "node-n");
    assert_eq!(gone.len(), 2);
    // kube-scheduler nominates the preemptor, then the victims' deletions reach the watch.
    let nominated = nominated_for("important", "node-n");
    h.state.view_mut().apply_pod(&nominated);
    for pod in pods
        .iter()
        .filter(|p| gone.contains(p.metadata.name.as_ref().unwrap()))
    {
        let mut pod = pod.clone();
        pod.metadata.uid = Some(format!("uid-{}", pod.metadata.name.as_deref().unwrap()));
        h.state.view_mut().delete_pod(&pod);
    }
    assert_eq!(h.state.view().nominations(), (1, 1));
    // A smaller pod filtered now finds the freed memory held.
    let small = preemptor("small", 4, 0);
    let filter = |pod: &Pod| json!({"Pod": pod, "NodeNames": ["node-n"]}).to_string();
    let (_, answer) = post(&h, "filter", &filter(&small)).await;
    assert_eq!(answer["NodeNames"], json!([]), "{answer}");
    // The preemptor's own filter passes (its booking is its own), and its bind lands there.
    let (_, answer) = post(&h, "filter", &filter(&important)).await;
    assert_eq!(answer["NodeNames"], json!(["node-n"]), "{answer}");
    let (_, answer) = call(
        &h.app,
        "POST",
        &format!("{PREFIX}/bind"),
        &bind_body("important", "uid-important", "node-n"),
    )
    .await;
    assert_eq!(answer["Error"], "", "{answer}");
    // Once the watch shows it bound, the nomination is over.
    let bound = h.binder.bound_node("default", "important");
    assert_eq!(bound.as_deref(), Some("node-n"));
    let mut on_node = nominated.clone();
    on_node.spec.as_mut().unwrap().node_name = Some("node-n".into());
    h.state.view_mut().apply_pod(&on_node);
    assert_eq!(h.state.view().nominations(), (0, 0));
}

#[tokio::test]
async fn a_nomination_ends_when_kube_scheduler_clears_it() {
    let pods: Vec<Pod> = vec![
        bound_builder("p0", "node-n", 0, 8, true)
            .priority(10)
            .build(),
    ];
    let h = harness(vec![node("node-n").gpushare().gpus(&[16]).build()], pods);
    let mut nominated = nominated_for("important", "node-n");
    h.state.view_mut().apply_pod(&nominated);
    assert_eq!(h.state.view().nominations(), (1, 1));
    let small = preemptor("small", 4, 0);
    let filter = json!({"Pod": small, "NodeNames": ["node-n"]}).to_string();
    assert_eq!(post(&h, "filter", &filter).await.1["NodeNames"], json!([]));
    // kube-scheduler placed it elsewhere (or a more important preemptor took the node).
    nominated.status = None;
    h.state.view_mut().apply_pod(&nominated);
    assert_eq!(h.state.view().nominations(), (0, 0));
    assert_eq!(
        post(&h, "filter", &filter).await.1["NodeNames"],
        json!(["node-n"])
    );
}

/// GiB booked on each GPU of `node`, by index.
fn used(h: &common::Harness, node: &str) -> Vec<u64> {
    let view = h.state.view();
    let node = view.cluster.node(node).unwrap();
    node.gpus().iter().map(|usage| usage.used_gib).collect()
}

#[tokio::test]
async fn a_relist_books_a_nomination_only_once_every_pod_is_back() {
    // GPU 0 full of pods that sort after the nominated pod, GPU 1 with 8 GiB free.
    let mut pods: Vec<Pod> = (0..4)
        .map(|i| bound_builder(&format!("z-full-{i}"), "node-n", 0, 4, true).build())
        .collect();
    pods.push(bound_builder("z-half", "node-n", 1, 8, true).build());
    let nominated = nominated_for("a-important", "node-n");
    pods.insert(0, nominated);
    let h = harness(
        vec![node("node-n").gpushare().gpus(&[16, 16]).build()],
        pods.clone(),
    );
    // Booked on the GPU with room, not on the one whose pods were not replayed yet.
    assert_eq!(used(&h, "node-n"), [16, 16]);
    assert_eq!(h.state.view().nominations(), (1, 1));
    // The same on a relist.
    let listed: Vec<Pod> = pods.into_iter().map(common::with_uid).collect();
    h.state.view_mut().replace_pods(&listed);
    assert_eq!(used(&h, "node-n"), [16, 16]);
}

#[tokio::test]
async fn a_nominated_pods_bind_is_not_refused_when_another_hold_lapses() {
    let pods = vec![
        bound_builder("p0", "node-n", 0, 8, true)
            .priority(10)
            .build(),
    ];
    let h = harness(
        vec![node("node-n").gpushare().gpus(&[16, 16]).build()],
        pods,
    );
    let nominated = nominated_for("important", "node-n");
    h.state.view_mut().apply_pod(&nominated);
    assert_eq!(h.state.view().nominations(), (1, 1));
    // Another pod's hold, lapsed by the time the bind comes: giving it back books waiting
    // nominations, which must not book again the one the bind is deciding for.
    let request = Request {
        pod_gib: 4,
        containers: vec![4],
        ..Request::default()
    };
    let hold = Hold {
        uid: "uid-other".into(),
        namespace: "default",
        name: "other",
        node: "node-n",
        until: Instant::now(),
    };
    assert!(h.state.view_mut().hold(hold, &request, Policy::Binpack));
    let (_, answer) = call(
        &h.app,
        "POST",
        &format!("{PREFIX}/bind"),
        &bind_body("important", "uid-important", "node-n"),
    )
    .await;
    assert_eq!(answer["Error"], "", "{answer}");
}
