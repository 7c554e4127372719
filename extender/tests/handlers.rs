//! The extender's HTTP handlers on a state built directly (no API server): the captured
//! kube-scheduler requests, the design-doc example, refusals and their reasons.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::http::StatusCode;
use common::{
    BindMode, FIXTURE_UID, PREFIX, bind_body, bound, call, call_raw, captured_bind, fixture,
    fixture_cluster, fixture_pod, harness, phase_of_fixture_pod, post, used_on_node_a,
};
use gpushare_contract::{Keyring, Keys, PodAllocation, SharedKeyring};
use gpushare_extender::scheduling::view::reservations::Phase;
use gpushare_testkit::fixtures::{node, pod};
use serde_json::{Value, json};

#[tokio::test]
async fn captured_filter_by_names_is_answered_with_names() {
    let h = fixture_cluster();
    let (status, answer) = post(&h, "filter", &fixture("filter-request-nodenames.json")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["NodeNames"], json!(["node-a"]));
    assert_eq!(answer["Nodes"], Value::Null);
    // A node passes, so kube-scheduler would not read why node-b fails: no reason is sent.
    assert_eq!(answer["FailedNodes"], json!({}));
    assert_eq!(answer["FailedAndUnresolvableNodes"], json!({}));
    assert_eq!(answer["Error"], "");

    // When none passes, every node's reason is sent.
    let mut args: Value = serde_json::from_str(&fixture("filter-request-nodenames.json")).unwrap();
    args["NodeNames"] = json!(["node-b"]);
    let (_, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(answer["NodeNames"], json!([]));
    assert_eq!(
        answer["FailedNodes"]["node-b"],
        "needs 4 GiB on one GPU; largest free is 2 GiB (GPU 0)"
    );
}

#[tokio::test]
async fn captured_filter_by_objects_is_answered_with_the_full_objects() {
    let h = fixture_cluster();
    let request = fixture("filter-request-nodes.json");
    let (status, answer) = post(&h, "filter", &request).await;
    assert_eq!(status, StatusCode::OK);
    let sent: Value = serde_json::from_str(&request).unwrap();
    let items = answer["Nodes"]["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    // Passed back verbatim, every field kube-scheduler sent.
    assert_eq!(items[0], sent["Nodes"]["items"][0]);
    assert_eq!(answer["NodeNames"], Value::Null);
    assert_eq!(answer["FailedNodes"], json!({}));
}

#[tokio::test]
async fn captured_prioritize_lists_only_the_nodes_above_zero() {
    let h = fixture_cluster();
    let (status, answer) = post(&h, "prioritize", &fixture("prioritize-request.json")).await;
    assert_eq!(status, StatusCode::OK);
    // node-b cannot take the pod: it scores 0, which kube-scheduler reads from its absence.
    let list = answer.as_array().unwrap();
    assert_eq!(list.len(), 1, "{answer}");
    assert_eq!(list[0]["Host"], "node-a");
    assert!(list[0]["Score"].as_i64().unwrap() > 0);
}

#[tokio::test]
async fn prioritize_leaves_out_the_nodes_that_tie_at_the_bottom() {
    // Three empty nodes and one already half full: binpack prefers the fuller one, and the
    // three empty ones, all equal, would only add the same amount to each of their totals.
    let h = harness(
        vec![
            node("node-a").gpushare().gpus(&[16]).build(),
            node("node-b").gpushare().gpus(&[16]).build(),
            node("node-c").gpushare().gpus(&[16]).build(),
            node("fuller").gpushare().gpus(&[16]).build(),
        ],
        vec![fixture_pod(), bound("resident", "fuller", 0, 8, true)],
    );
    let args = json!({
        "Pod": fixture_pod(),
        "Nodes": null,
        "NodeNames": ["node-a", "node-b", "node-c", "fuller"],
    });
    let (status, answer) = post(&h, "prioritize", &args.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer, json!([{"Host": "fuller", "Score": 9}]));
    // All equal: nothing to tell kube-scheduler.
    let args = json!({"Pod": fixture_pod(), "Nodes": null, "NodeNames": ["node-a", "node-b"]});
    let (_, answer) = post(&h, "prioritize", &args.to_string()).await;
    assert_eq!(answer, json!([]));
}

#[tokio::test]
async fn captured_bind_writes_one_binding_with_the_decision() {
    let h = fixture_cluster();
    let (status, answer) = post(&h, "bind", &fixture("bind-request.json")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["Error"], "");
    let calls = h.binder.calls();
    assert_eq!(calls.len(), 1);
    let keys = Keys::default();
    let binding = &calls[0];
    assert_eq!(
        (
            binding.name.as_str(),
            binding.uid.as_str(),
            binding.node.as_str()
        ),
        ("gpu-pod-3", FIXTURE_UID, "node-a")
    );
    let allocation = PodAllocation::from_annotations(&keys, &binding.annotations)
        .unwrap()
        .unwrap();
    assert_eq!(allocation.gpu_index, 0);
    assert_eq!(allocation.gpu_uuid, "GPU-node-a-0");
    assert_eq!(allocation.pod_gib, 4);
    assert!(!allocation.assigned);
    assert_eq!(allocation.containers[0].name, "c");
    // Counted at once, before any watch.
    let view = h.state.view();
    assert_eq!(view.cluster.node("node-a").unwrap().gpus()[0].used_gib, 4);
    assert_eq!(view.reservation_count(), 1);
}

#[tokio::test]
async fn with_a_keyring_the_binding_carries_a_signature_that_verifies() {
    let keyring = SharedKeyring::new(
        Keyring::parse(
            "k2:AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=\nk1:AQEBAQEBAQEBAQEBAQEBAQ==",
        )
        .unwrap(),
    );
    let h = common::harness_with(
        common::settings().with_keyring(keyring.clone()),
        vec![node("node-a").gpushare().gpus(&[16]).build()],
        vec![fixture_pod()],
    );
    let answer = captured_bind(&h).await;
    assert_eq!(answer["Error"], "");
    let keys = Keys::default();
    let binding = h.binder.calls()[0].clone();
    let allocation = PodAllocation::from_annotations(&keys, &binding.annotations)
        .unwrap()
        .unwrap();
    let signature = binding.annotations[&keys.signature].clone();
    assert!(
        signature.starts_with("k2:"),
        "the first key signs: {signature}"
    );
    let keyring = keyring.current();
    assert_eq!(keyring.verify(FIXTURE_UID, "node-a", &allocation), Ok("k2"));
    // Bound to this pod and this node: copied elsewhere it does not verify.
    assert!(
        keyring
            .verify("another-uid", "node-a", &allocation)
            .is_err()
    );
    assert!(keyring.verify(FIXTURE_UID, "node-b", &allocation).is_err());
    // The watch shows the pod bound with the Binding's annotations: the extender's own
    // verification accepts them and books the pod once.
    let mut watched = fixture_pod();
    watched.metadata.annotations = Some(binding.annotations.clone());
    watched.spec.as_mut().unwrap().node_name = Some("node-a".into());
    assert!(h.state.view_mut().apply_pod(&watched).is_none());
    let view = h.state.view();
    assert!(!view.pod("default", "gpu-pod-3").unwrap().bad_annotations);
    assert_eq!(view.reservation_count(), 0);
    assert_eq!(view.cluster.node("node-a").unwrap().gpus()[0].used_gib, 4);
}

#[tokio::test]
async fn design_doc_example_binds_to_the_gpu_with_8_free() {
    // Four 16 GiB GPUs with 12, 8, 4 and 16 GiB free.
    let h = harness(
        vec![node("n1").gpushare().gpus(&[16, 16, 16, 16]).build()],
        vec![
            bound("a", "n1", 0, 4, true),
            bound("b", "n1", 1, 8, true),
            bound("c", "n1", 2, 12, true),
            pod("p").gpu_mem(8).build(),
        ],
    );
    let (_, answer) = post(&h, "bind", &bind_body("p", "uid-p", "n1")).await;
    assert_eq!(answer["Error"], "");
    let calls = h.binder.calls();
    assert_eq!(calls[0].annotations[&Keys::default().gpu_index], "1");
}

#[tokio::test]
async fn malformed_json_is_a_400_naming_the_problem() {
    let h = fixture_cluster();
    for verb in ["filter", "prioritize", "bind"] {
        let (status, answer) =
            call(&h.app, "POST", &format!("{PREFIX}/{verb}"), "{\"Pod\": ").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{verb}");
        let message = answer["error"].as_str().unwrap();
        assert!(
            message.contains(&format!("malformed {verb} request body")),
            "{message}"
        );
    }
    // Wrong types are refused too.
    let (status, _) = post(&h, "filter", r#"{"NodeNames": 5}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_body_over_the_limit_is_a_413_and_one_under_it_is_served() {
    let h = fixture_cluster();
    let body = fixture("filter-request-nodenames.json");
    let app = gpushare_extender::router(h.state.clone(), PREFIX, body.len());
    let (status, _) = call(&app, "POST", &format!("{PREFIX}/filter"), &body).await;
    assert_eq!(status, StatusCode::OK);
    let padded = format!("{body}{}", " ".repeat(16));
    let (status, _) = call(&app, "POST", &format!("{PREFIX}/filter"), &padded).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn each_rejected_node_gets_its_own_reason_even_when_they_repeat() {
    // Two equally busy nodes between two unknown ones: the busy reason is the same text on
    // both, and each unknown node is still named in its own.
    let h = harness(
        vec![
            node("busy-1").gpushare().gpus(&[8]).build(),
            node("busy-2").gpushare().gpus(&[8]).build(),
        ],
        vec![
            fixture_pod(),
            bound("a", "busy-1", 0, 6, true),
            bound("b", "busy-2", 0, 6, true),
        ],
    );
    let args = json!({
        "Pod": fixture_pod(),
        "Nodes": null,
        "NodeNames": ["ghost-1", "busy-1", "busy-2", "ghost-2"],
    });
    let (status, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["NodeNames"], json!([]));
    let busy = "needs 4 GiB on one GPU; largest free is 2 GiB (GPU 0)";
    assert_eq!(
        answer["FailedNodes"],
        json!({"busy-1": busy, "busy-2": busy})
    );
    assert_eq!(
        answer["FailedAndUnresolvableNodes"],
        json!({
            "ghost-1": "node ghost-1 is unknown to the gpushare extender",
            "ghost-2": "node ghost-2 is unknown to the gpushare extender",
        })
    );
}

#[tokio::test]
async fn a_node_waiting_for_kubelet_to_admit_a_twin_is_an_error_kube_scheduler_retries() {
    // "twin" (4 GiB, not admitted yet) fills GPU 0 with "filler"; GPU 1 is empty. The
    // fixture pod's 4 GiB must join its twin on GPU 0, which has no room: no node passes.
    let h = harness(
        vec![node("node-a").gpushare().gpus(&[16, 16]).build()],
        vec![
            fixture_pod(),
            bound("twin", "node-a", 0, 4, false),
            bound("filler", "node-a", 0, 12, true),
        ],
    );
    let args = json!({"Pod": fixture_pod(), "Nodes": null, "NodeNames": ["node-a"]});
    let (status, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    let error = answer["Error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with(
            "no node can take the pod until kubelet admits a pod bound before it; node node-a: \
             a 4 GiB container is still waiting for device allocation on GPU 0"
        ),
        "{answer}"
    );
    assert_eq!(answer["FailedNodes"], json!({}), "{answer}");
    let metrics = call(&h.app, "GET", "/metrics", "").await.1;
    assert!(
        metrics
            .as_str()
            .unwrap_or_default()
            .contains("gpushare_extender_filter_awaiting_admission_total 1"),
        "{metrics}"
    );
    // kubelet admits the twin: the next try passes node-a, for GPU 1.
    let mut admitted = bound("twin", "node-a", 0, 4, false);
    admitted.metadata.uid = Some("uid-twin".into());
    admitted.status.get_or_insert_default().start_time = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
    );
    h.state.view_mut().apply_pod(&admitted);
    let (_, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(answer["NodeNames"], json!(["node-a"]), "{answer}");
    assert_eq!(answer["Error"], json!(""), "{answer}");
}

#[tokio::test]
async fn unknown_and_unlabelled_nodes_fail_unresolvably_with_reasons() {
    let h = harness(
        vec![
            node("n1").gpushare().gpus(&[16]).build(),
            node("plain").gpus(&[16]).build(),
            node("small").gpushare().gpus(&[2]).build(),
        ],
        vec![pod("p").gpu_mem(4).build()],
    );
    let mut args =
        serde_json::from_str::<Value>(&fixture("filter-request-nodenames.json")).unwrap();
    args["NodeNames"] = json!(["n1", "ghost", "plain", "small"]);
    let (_, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(answer["NodeNames"], json!(["n1"]));
    assert_eq!(answer["FailedAndUnresolvableNodes"], json!({}));
    // Without n1 no node passes, and each failure carries its reason.
    args["NodeNames"] = json!(["ghost", "plain", "small"]);
    let (_, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(answer["NodeNames"], json!([]));
    let unresolvable = &answer["FailedAndUnresolvableNodes"];
    assert_eq!(
        unresolvable["ghost"],
        "node ghost is unknown to the gpushare extender"
    );
    assert!(
        unresolvable["plain"]
            .as_str()
            .unwrap()
            .contains("gpushare=true")
    );
    assert!(
        unresolvable["small"]
            .as_str()
            .unwrap()
            .contains("largest healthy GPU has 2 GiB")
    );
    assert_eq!(answer["FailedNodes"], json!({}));
}

#[tokio::test]
async fn pods_without_the_resource_pass_untouched_and_score_zero() {
    let h = fixture_cluster();
    let mut args = serde_json::from_str::<Value>(&fixture("filter-request-nodes.json")).unwrap();
    args["Pod"]["spec"]["containers"][0]["resources"] = json!({});
    // Another pod than the one the view holds waiting (whose reading filter would use).
    args["Pod"]["metadata"]["uid"] = json!("uid-not-watched-yet");
    let (_, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(answer["Nodes"]["items"], args["Nodes"]["items"]);
    let (status, scores) = post(&h, "prioritize", &args.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(scores, json!([]), "every node at 0: none listed");
}

#[tokio::test]
async fn a_malformed_quantity_fails_every_node_with_the_pods_name() {
    let h = fixture_cluster();
    let mut args =
        serde_json::from_str::<Value>(&fixture("filter-request-nodenames.json")).unwrap();
    args["Pod"]["spec"]["containers"][0]["resources"]["limits"]["example.com/gpu-mem"] =
        json!("4.5");
    // A pod the watch has not shown yet: filter reads the object sent.
    args["Pod"]["metadata"]["uid"] = json!("uid-not-watched-yet");
    let (status, answer) = post(&h, "filter", &args.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["NodeNames"], json!([]));
    for name in ["node-a", "node-b"] {
        let reason = answer["FailedAndUnresolvableNodes"][name].as_str().unwrap();
        assert!(
            reason.contains("default/gpu-pod-3") && reason.contains("4.5"),
            "{reason}"
        );
    }
    assert_eq!(answer["Error"], "");
}

#[tokio::test]
async fn unsynced_view_answers_error_and_readyz_is_503() {
    let h = fixture_cluster();
    let unsynced = common::harness(vec![], vec![]);
    // A fresh state that never listed: build one by hand.
    let state = gpushare_extender::Scheduling::new(
        gpushare_extender::Settings::new(
            "example.com/gpu-mem",
            "gpushare.example.com",
            "gpushare=true",
        ),
        gpushare_extender::Ranking::by(gpushare_allocator::Policy::Binpack),
        unsynced.binder.clone(),
        common::fast_timing(),
        gpushare_extender::EventSink::disabled(),
        prometheus_client::registry::Registry::default(),
    );
    let app = gpushare_extender::router(state, PREFIX, gpushare_extender::DEFAULT_BODY_LIMIT);
    let (status, _) = call(&app, "GET", "/readyz", "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (_, answer) = call(
        &app,
        "POST",
        &format!("{PREFIX}/filter"),
        &fixture("filter-request-nodenames.json"),
    )
    .await;
    assert_eq!(answer["Error"], gpushare_extender::NOT_SYNCED);
    let (_, answer) = call(
        &app,
        "POST",
        &format!("{PREFIX}/bind"),
        &fixture("bind-request.json"),
    )
    .await;
    assert_eq!(answer["Error"], gpushare_extender::NOT_SYNCED);
    let (status, _) = call(&h.app, "GET", "/readyz", "").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_refused_binding_is_an_error_and_releases_the_reservation() {
    let h = fixture_cluster();
    h.binder.set_mode(BindMode::Refuse(422));
    let (status, answer) = post(&h, "bind", &fixture("bind-request.json")).await;
    assert_eq!(status, StatusCode::OK);
    let error = answer["Error"].as_str().unwrap();
    assert!(
        error.contains("gpu-pod-3") && error.contains("422") && error.contains("released"),
        "{error}"
    );
    assert_eq!(used_on_node_a(&h), 0);
    assert_eq!(h.state.view().reservation_count(), 0);
    // A retry after the failure writes again, and succeeds.
    h.binder.set_mode(BindMode::Ok);
    let answer = captured_bind(&h).await;
    assert_eq!(answer["Error"], "");
    assert_eq!(h.binder.calls().len(), 2);
}

#[tokio::test]
async fn an_ambiguous_write_that_landed_keeps_its_memory_and_a_retry_there_succeeds() {
    let h = fixture_cluster();
    h.binder.set_mode(BindMode::LandThenFail);
    let answer = captured_bind(&h).await;
    let error = answer["Error"].as_str().unwrap();
    assert!(
        error.contains("no clear answer") && error.contains("504"),
        "{error}"
    );
    // Not released: the write did land. A read of the pod shows it, without a second write.
    assert_eq!(used_on_node_a(&h), 4);
    common::eventually("the resolution", || {
        phase_of_fixture_pod(&h) == Some(Phase::Written)
    })
    .await;
    assert_eq!(h.binder.calls().len(), 1);
    assert_eq!(
        h.binder.bound_node("default", "gpu-pod-3").as_deref(),
        Some("node-a")
    );
    // kube-scheduler retries the same node: success; another node: refused.
    h.binder.set_mode(BindMode::Ok);
    assert_eq!(captured_bind(&h).await["Error"], "");
    let (_, answer) = post(&h, "bind", &bind_body("gpu-pod-3", FIXTURE_UID, "node-b")).await;
    assert!(
        answer["Error"].as_str().unwrap().contains("node-a"),
        "{answer}"
    );
    assert_eq!(used_on_node_a(&h), 4);
}

#[tokio::test]
async fn an_unreachable_api_server_keeps_the_memory_until_the_binding_is_known() {
    let h = fixture_cluster();
    h.binder.set_mode(BindMode::Unavailable);
    let answer = captured_bind(&h).await;
    assert!(
        answer["Error"]
            .as_str()
            .unwrap()
            .contains("no clear answer"),
        "{answer}"
    );
    assert_eq!(used_on_node_a(&h), 4);
    assert_eq!(phase_of_fixture_pod(&h), Some(Phase::Resolving));
    // While unresolved, filter keeps only node-a, and a bind elsewhere is refused retryably.
    let (_, filtered) = post(&h, "filter", &fixture("filter-request-nodenames.json")).await;
    assert_eq!(filtered["NodeNames"], json!(["node-a"]));
    let (_, answer) = post(&h, "bind", &bind_body("gpu-pod-3", FIXTURE_UID, "node-b")).await;
    let error = answer["Error"].as_str().unwrap();
    assert!(
        error.contains("retry") && error.contains("node-a"),
        "{error}"
    );
    // The API server comes back: the Binding is re-posted and lands, by itself.
    h.binder.set_mode(BindMode::Ok);
    common::eventually("the resolution", || {
        phase_of_fixture_pod(&h) == Some(Phase::Written)
    })
    .await;
    assert_eq!(
        h.binder.bound_node("default", "gpu-pod-3").as_deref(),
        Some("node-a")
    );
    assert_eq!(captured_bind(&h).await["Error"], "");
    assert_eq!(used_on_node_a(&h), 4);
}

#[tokio::test]
async fn a_pod_deleted_while_its_binding_is_resolved_gives_its_memory_back() {
    let h = fixture_cluster();
    h.binder.set_mode(BindMode::Unavailable);
    captured_bind(&h).await;
    assert_eq!(used_on_node_a(&h), 4);
    h.binder.pods.lock().unwrap().clear();
    h.binder.set_mode(BindMode::Ok);
    common::eventually("the release", || phase_of_fixture_pod(&h).is_none()).await;
    assert_eq!(used_on_node_a(&h), 0);
}

/// Paused clock: the caller's 5 ms, the write's 200 ms and the bind path's 500 ms client
/// timeout elapse in that order whatever the machine's speed.
#[tokio::test(start_paused = true)]
async fn a_caller_that_goes_away_does_not_leak_the_reservation() {
    let h = fixture_cluster();
    // Well past the caller's 5 ms, well within the bind path's 500 ms client timeout.
    *h.binder.delay.lock().unwrap() = std::time::Duration::from_millis(200);
    // kube-scheduler's httpTimeout fires: the handler future is dropped mid-write.
    let cut = tokio::time::timeout(std::time::Duration::from_millis(5), captured_bind(&h)).await;
    assert!(
        cut.is_err(),
        "the bind answered before its caller went away"
    );
    assert_eq!(phase_of_fixture_pod(&h), Some(Phase::Writing));
    // The write goes on in its own task and the reservation ends written, not stranded.
    common::eventually("the write", || {
        phase_of_fixture_pod(&h) == Some(Phase::Written)
    })
    .await;
    assert_eq!(
        h.binder.bound_node("default", "gpu-pod-3").as_deref(),
        Some("node-a")
    );
    // The watch then shows the bound pod: the reservation ends.
    let mut watched = fixture_pod();
    let annotations = h.binder.calls()[0].annotations.clone();
    watched.metadata.annotations = Some(annotations);
    watched.spec.as_mut().unwrap().node_name = Some("node-a".into());
    h.state.view_mut().apply_pod(&watched);
    assert_eq!(h.state.view().reservation_count(), 0);
    assert_eq!(used_on_node_a(&h), 4);
}

#[tokio::test]
async fn retried_bind_after_success_writes_nothing_more() {
    let h = fixture_cluster();
    for _ in 0..2 {
        let answer = captured_bind(&h).await;
        assert_eq!(answer["Error"], "");
    }
    assert_eq!(h.binder.calls().len(), 1);
    // Elsewhere is refused: the pod holds memory on node-a.
    let (_, answer) = post(&h, "bind", &bind_body("gpu-pod-3", FIXTURE_UID, "node-b")).await;
    assert!(answer["Error"].as_str().unwrap().contains("node-a"));
}

#[tokio::test]
async fn unknown_or_recreated_pods_are_not_bound() {
    let h = fixture_cluster();
    let (_, answer) = post(&h, "bind", &bind_body("nobody", "uid-x", "node-a")).await;
    assert_eq!(answer["Error"], "pod default/nobody (uid uid-x) not found");
    let (_, answer) = post(&h, "bind", &bind_body("gpu-pod-3", "old-uid", "node-a")).await;
    assert!(
        answer["Error"].as_str().unwrap().contains("was recreated"),
        "{answer}"
    );
    assert!(h.binder.calls().is_empty());
    assert_eq!(h.state.view().reservation_count(), 0);
}

#[tokio::test]
async fn a_pod_bound_without_an_allocation_is_not_bound_again() {
    let h = fixture_cluster();
    // The watch shows the pod bound to node-b by someone else, with no gpushare decision.
    let mut bypassed = fixture_pod();
    bypassed.spec.as_mut().unwrap().node_name = Some("node-b".into());
    h.state.view_mut().apply_pod(&bypassed);
    let answer = captured_bind(&h).await;
    assert_eq!(
        answer["Error"],
        "pod default/gpu-pod-3 is already bound to node node-b"
    );
    assert!(h.binder.calls().is_empty());
    assert_eq!(h.state.view().reservation_count(), 0);
}

#[tokio::test]
async fn pod_deleted_before_bind_is_an_error() {
    let h = fixture_cluster();
    h.state.view_mut().delete_pod(&fixture_pod());
    let answer = captured_bind(&h).await;
    assert!(answer["Error"].as_str().unwrap().contains("not found"));
    assert_eq!(h.state.view().cluster.pod_count(), 1);
}

#[tokio::test]
async fn concurrent_binds_never_over_commit() {
    // 2×16 GiB: room for eight 4 GiB pods; 64 try. No device plugin runs here, so every
    // bound pod stays pending and the twin rule keeps all 4 GiB pods on one GPU: four fit.
    let pods = (0..64)
        .map(|i| pod(&format!("p{i}")).gpu_mem(4).build())
        .collect();
    let h = harness(vec![node("n1").gpushare().gpus(&[16, 16]).build()], pods);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let app = h.app.clone();
        tasks.push(tokio::spawn(async move {
            let body = bind_body(&format!("p{i}"), &format!("uid-p{i}"), "n1");
            call(&app, "POST", &format!("{PREFIX}/bind"), &body).await.1
        }));
    }
    let mut ok = 0;
    for task in tasks {
        let answer = task.await.unwrap();
        match answer["Error"].as_str().unwrap() {
            "" => ok += 1,
            reason => assert!(reason.contains("n1") && reason.contains("GiB"), "{reason}"),
        }
    }
    assert_eq!(ok, 4);
    assert_eq!(h.binder.calls().len(), 4);
    let view = h.state.view();
    for usage in view.cluster.node("n1").unwrap().gpus() {
        assert!(usage.used_gib <= usage.gpu.total_gib);
    }
}

#[tokio::test]
async fn inspect_metrics_and_health() {
    let h = fixture_cluster();
    post(&h, "bind", &fixture("bind-request.json")).await;
    let (status, all) = call(&h.app, "GET", &format!("{PREFIX}/inspect"), "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(all["nodes"].as_array().unwrap().len(), 2);
    let (_, node_a) = call(&h.app, "GET", &format!("{PREFIX}/inspect/node-a"), "").await;
    let gpu = &node_a["gpus"][0];
    assert_eq!(
        (gpu["totalGiB"].as_u64(), gpu["usedGiB"].as_u64()),
        (Some(16), Some(4))
    );
    assert_eq!(gpu["pods"][0]["name"], "gpu-pod-3");
    assert_eq!(gpu["pods"][0]["uid"], FIXTURE_UID);
    assert_eq!(gpu["pods"][0]["reserved"], true);
    let (status, _) = call(&h.app, "GET", &format!("{PREFIX}/inspect/ghost"), "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, content_type, body) = call_raw(&h.app, "GET", "/metrics", "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    assert!(
        body.contains("gpushare_extender_binds_total{reason=\"bound\"} 1"),
        "{body}"
    );
    assert!(body.contains("gpushare_extender_reservations 1"), "{body}");
    assert_eq!(call(&h.app, "GET", "/healthz", "").await.0, StatusCode::OK);
}

#[tokio::test]
async fn the_monitor_router_serves_health_and_metrics_and_nothing_else() {
    let h = fixture_cluster();
    let monitor = gpushare_extender::http::monitor_router(h.state.clone());
    for path in ["/healthz", "/readyz"] {
        let (status, _, body) = common::call_raw(&monitor, "GET", path, "").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"), "{path}");
    }
    let (status, _, body) = common::call_raw(&monitor, "GET", "/metrics", "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("gpushare_extender_"), "{body}");
    // The scheduler's verbs and the inspection endpoints are on --listen only.
    let bind = fixture("bind-request.json");
    for (method, path) in [
        ("POST", format!("{PREFIX}/filter")),
        ("POST", format!("{PREFIX}/bind")),
        ("GET", format!("{PREFIX}/inspect")),
    ] {
        let (status, _, _) = common::call_raw(&monitor, method, &path, &bind).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{method} {path}");
    }
    assert!(h.binder.calls().is_empty());
}

/// With a client CA, every verb answers only a caller whose TLS connection proved a
/// certificate of it: others get a 403 with a JSON error, counted; health stays open.
#[tokio::test]
async fn with_a_client_ca_the_verbs_answer_only_certified_callers() {
    use axum::body::Body;
    use gpushare_runtime::http::ClientCertificate;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    let h = fixture_cluster();
    let callers = gpushare_extender::Callers::certified(None, h.state.metrics());
    let app = gpushare_extender::scheduler_router(
        gpushare_extender::http::Adapter {
            domain: h.state.clone(),
            forwarder: None,
        },
        PREFIX,
        gpushare_extender::DEFAULT_BODY_LIMIT,
        callers,
    );
    let send = |method: &str, path: String, body: String, client: Option<ClientCertificate>| {
        let mut request = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        if let Some(client) = client {
            request.extensions_mut().insert(client);
        }
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await.unwrap();
            let status = response.status();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            (status, serde_json::from_slice::<Value>(&bytes).ok())
        }
    };
    let filter = fixture("filter-request-nodenames.json");
    let calls = [
        ("POST", "filter", filter.clone()),
        ("POST", "prioritize", filter.clone()),
        ("POST", "bind", fixture("bind-request.json")),
        ("POST", "preempt", "{}".to_owned()),
        ("GET", "inspect", String::new()),
        ("GET", "inspect/node-a", String::new()),
        ("GET", "identity", String::new()),
    ];
    for client in [None, Some(ClientCertificate::Absent)] {
        for (method, verb, body) in &calls {
            let (status, answer) =
                send(method, format!("{PREFIX}/{verb}"), body.clone(), client).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{verb} with {client:?}");
            let error = answer.and_then(|a| a["error"].as_str().map(str::to_owned));
            assert!(
                error.is_some_and(|e| e.contains("client certificate")),
                "{verb}: the refusal says what is missing"
            );
        }
    }
    assert_eq!(used_on_node_a(&h), 0, "a refused filter held nothing");
    let (status, _) = send("GET", "/healthz".to_owned(), String::new(), None).await;
    assert_eq!(status, StatusCode::OK, "health needs no certificate");
    let (status, answer) = send(
        "POST",
        format!("{PREFIX}/filter"),
        filter,
        Some(ClientCertificate::Verified),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer.unwrap()["NodeNames"], json!(["node-a"]));
    let (_, _, text) = call_raw(&h.app, "GET", "/metrics", "").await;
    assert!(
        text.contains(
            "gpushare_extender_caller_refusals_total{reason=\"no_client_certificate\"} 14"
        ),
        "{text}"
    );
}
