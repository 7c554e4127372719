//! What bind and filter book before the watch shows a pod bound, through the HTTP handlers:
//! the holds filter and prioritize take for the bind to come, and the write slots that bound
//! the Bindings in flight (a bind waits for one or is refused; filter paces on the queue).

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::http::StatusCode;
use common::{
    FIXTURE_UID, bind_body, bound, call_raw, captured_bind, fixture, fixture_cluster, fixture_pod,
    harness, phase_of_fixture_pod, post, used_on_node_a,
};
use gpushare_extender::scheduling::view::reservations::Phase;
use gpushare_testkit::fixtures::node;
use serde_json::{Value, json};

/// When filter passes one node, kube-scheduler binds the pod there next, while its next cycles
/// already run: filter holds the pod's memory from then on, so the next pods' filters see it
/// taken. A second filter of the same pod (its attempt failed) replaces the hold instead of
/// adding one, and the bind takes the hold over as its reservation. With two nodes passing,
/// nothing is decided and nothing held.
#[tokio::test]
async fn a_filter_that_passes_one_node_holds_the_memory_until_the_bind() {
    let h = fixture_cluster();
    let args = fixture("filter-request-nodenames.json");
    let (_, answer) = post(&h, "filter", &args).await;
    // node-b has 2 GiB free: node-a alone takes the 4 GiB pod.
    assert_eq!(answer["NodeNames"], json!(["node-a"]));
    assert_eq!(phase_of_fixture_pod(&h), Some(Phase::Held));
    assert_eq!(used_on_node_a(&h), 4);

    let (_, again) = post(&h, "filter", &args).await;
    assert_eq!(again["NodeNames"], json!(["node-a"]));
    assert_eq!(used_on_node_a(&h), 4, "a retried filter held twice");

    let (status, bound) = post(&h, "bind", &fixture("bind-request.json")).await;
    assert_eq!(
        (status, bound["Error"].as_str()),
        (StatusCode::OK, Some(""))
    );
    assert_eq!(phase_of_fixture_pod(&h), Some(Phase::Written));
    assert_eq!(used_on_node_a(&h), 4);

    // Two nodes that fit: no decision, no hold.
    let h = harness(
        vec![
            node("node-a").gpushare().gpus(&[16]).build(),
            node("node-b").gpushare().gpus(&[16]).build(),
        ],
        vec![fixture_pod()],
    );
    let (_, both) = post(&h, "filter", &args).await;
    assert_eq!(both["NodeNames"], json!(["node-a", "node-b"]));
    assert_eq!(phase_of_fixture_pod(&h), None);
}

/// Prioritize scoring one node above all others is kube-scheduler's choice in all but name: it
/// holds the pod's memory there, so the filters before the bind see it taken. When the bind
/// names another node after all (kube-scheduler's own scores tipped it), the hold is given
/// back and the bind books there. A tie holds nothing: kube-scheduler draws among the tied.
#[tokio::test]
async fn prioritize_holds_the_node_it_scores_best_alone_until_the_bind() {
    let h = harness(
        vec![
            node("node-a").gpushare().gpus(&[16]).build(),
            node("node-b").gpushare().gpus(&[16]).build(),
        ],
        vec![fixture_pod(), bound("resident", "node-a", 0, 4, true)],
    );
    let args = fixture("prioritize-request.json");
    let (_, answer) = post(&h, "prioritize", &args).await;
    assert_eq!(answer[0]["Host"], "node-a", "{answer}");
    assert_eq!(phase_of_fixture_pod(&h), Some(Phase::Held));
    assert_eq!(used_on_node_a(&h), 8);
    let (_, _, metrics) = call_raw(&h.app, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("gpushare_extender_reservations_held 1"),
        "{metrics}"
    );

    let mut to_b: Value = serde_json::from_str(&fixture("bind-request.json")).unwrap();
    to_b["Node"] = json!("node-b");
    let (_, bound_b) = post(&h, "bind", &to_b.to_string()).await;
    assert_eq!(bound_b["Error"], "", "{bound_b}");
    assert_eq!(
        used_on_node_a(&h),
        4,
        "the hold on node-a outlived the bind"
    );
    let booked_on_b = {
        let view = h.state.view();
        let used = view.cluster.node("node-b").unwrap().gpus()[0].used_gib;
        let node = view
            .reservation(&FIXTURE_UID.into())
            .map(|r| r.node.clone());
        (used, node)
    };
    assert_eq!(booked_on_b, (4, Some("node-b".to_owned())));

    let tied = harness(
        vec![
            node("node-a").gpushare().gpus(&[16]).build(),
            node("node-b").gpushare().gpus(&[16]).build(),
        ],
        vec![fixture_pod()],
    );
    let (_, answer) = post(&tied, "prioritize", &args).await;
    assert_eq!(answer, json!([]));
    assert_eq!(phase_of_fixture_pod(&tied), None);
}

/// Binds the pod `name` (UID `uid-<name>`) to node-a.
async fn bind_to_node_a(h: &common::Harness, name: &str) -> (StatusCode, Value) {
    post(
        h,
        "bind",
        &bind_body(name, &format!("uid-{name}"), "node-a"),
    )
    .await
}

/// node-a with one 16 GiB GPU, and a copy of the captured pod (4 GiB) under each of `names`
/// (UID `uid-<name>`), waiting; the bind path timed by `timing`.
fn one_gpu_with_pods(timing: gpushare_extender::BindTiming, names: &[&str]) -> common::Harness {
    let pods = names
        .iter()
        .map(|name| {
            let mut pod = fixture_pod();
            pod.metadata.name = Some((*name).to_owned());
            pod.metadata.uid = Some(format!("uid-{name}"));
            pod
        })
        .collect();
    common::harness_timed(
        common::settings(),
        timing,
        vec![node("node-a").gpushare().gpus(&[16]).build()],
        pods,
    )
}

/// With one write slot, a second bind waits for the first write to end, and then writes; a
/// bind that waits longer than its slot wait is refused with its memory released and nothing
/// written, so kube-scheduler retries it against a less busy API server. Paused clock: the
/// writes' delays and the slot wait elapse in the order their durations say.
#[tokio::test(start_paused = true)]
async fn binds_beyond_the_writes_in_flight_wait_for_a_slot_or_are_refused() {
    let timing = gpushare_extender::BindTiming {
        writes_in_flight: 1,
        slot_wait: std::time::Duration::from_millis(400),
        ..common::fast_timing()
    };
    let h = one_gpu_with_pods(timing, &["first", "second", "third"]);
    *h.binder.delay.lock().unwrap() = std::time::Duration::from_millis(200);
    let bind = |name: &'static str| bind_to_node_a(&h, name);
    // The second waits about 200 ms for the first's slot: within its slot wait.
    let ((_, first), (_, second)) = tokio::join!(bind("first"), bind("second"));
    assert_eq!(
        (first["Error"].as_str(), second["Error"].as_str()),
        (Some(""), Some(""))
    );
    assert_eq!(h.binder.calls().len(), 2);

    // A write that outlasts the slot wait: the bind behind it is refused, nothing written.
    *h.binder.delay.lock().unwrap() = std::time::Duration::from_millis(480);
    let (_, third) = tokio::join!(
        async {
            let mut stuck = fixture_pod();
            stuck.metadata.name = Some("stuck".to_owned());
            stuck.metadata.uid = Some("uid-stuck".to_owned());
            h.binder.pods.lock().unwrap().insert(
                "default/stuck".to_owned(),
                gpushare_extender::PodOnServer {
                    uid: "uid-stuck".to_owned(),
                    node: None,
                },
            );
            h.state.view_mut().apply_pod(&stuck);
            post(&h, "bind", &bind_body("stuck", "uid-stuck", "node-a")).await
        },
        async {
            // third comes once stuck's write holds the only slot.
            let slots = h.state.bind_slots().unwrap();
            common::eventually("stuck's write to take the only slot", || {
                slots.try_take().is_none()
            })
            .await;
            bind("third").await
        }
    );
    let error = third.1["Error"].as_str().unwrap_or_default().to_owned();
    assert!(error.contains("API server is slow"), "{error}");
    assert!(h.state.view().reservation(&"uid-third".into()).is_none());
    assert!(
        h.binder.calls().iter().all(|call| call.name != "third"),
        "the refused bind was written"
    );
    // first, second and stuck hold 4 GiB each; third's was given back.
    assert_eq!(used_on_node_a(&h), 12);
}

/// While as many binds wait for a write slot as there are slots, filter waits for the queue
/// to shorten before it answers: kube-scheduler's cycle, where filter runs, then goes at the
/// pace Bindings commit instead of piling binds up until they are refused. With no queue,
/// filter does not wait. Paused clock: the first write's 300 ms elapse only once every task
/// waits.
#[tokio::test(start_paused = true)]
async fn filter_waits_while_the_bind_queue_is_as_long_as_the_write_slots() {
    let timing = gpushare_extender::BindTiming {
        writes_in_flight: 1,
        slot_wait: std::time::Duration::from_secs(5),
        pace_max: std::time::Duration::from_secs(5),
        ..common::fast_timing()
    };
    let h = one_gpu_with_pods(timing, &["first", "second"]);
    let paced = |h: &common::Harness| h.state.metrics().paced.get();
    // No queue: filter answers at once.
    post(&h, "filter", &fixture("filter-request-nodenames.json")).await;
    assert_eq!(paced(&h), 0);

    *h.binder.delay.lock().unwrap() = std::time::Duration::from_millis(300);
    let bind = |name: &'static str| {
        let h = &h;
        async move { bind_to_node_a(h, name).await.1 }
    };
    let filter_after_the_queue_forms = async {
        // first writes, second waits for its slot: the queue is as long as the slots.
        let slots = h.state.bind_slots().unwrap();
        common::eventually("second to wait for the slot first writes in", || {
            slots.waiting() == 1
        })
        .await;
        let (_, answer) = post(&h, "filter", &fixture("filter-request-nodenames.json")).await;
        (answer, h.binder.calls().len())
    };
    let (first, second, (answer, writes_when_filter_answered)) =
        tokio::join!(bind("first"), bind("second"), filter_after_the_queue_forms);
    assert_eq!(
        (first["Error"].as_str(), second["Error"].as_str()),
        (Some(""), Some(""))
    );
    assert!(
        answer["Error"].as_str().unwrap_or_default().is_empty(),
        "{answer}"
    );
    assert_eq!(paced(&h), 1, "filter did not wait for the queue");
    // The binder records a write as it ends: the first had ended, freeing the slot the
    // second took, before filter answered.
    assert!(
        writes_when_filter_answered >= 1,
        "filter answered before the queued bind got its slot"
    );
}

/// A hold whose bind never came stops counting once it lapsed, even for a bind with no filter
/// before it on this replica (a follower passed it on): here a lapsed 12 GiB hold would leave
/// the 4 GiB pod no room on node-a's 16 GiB GPU.
#[tokio::test]
async fn a_bind_gives_back_holds_that_lapsed() {
    let h = harness(
        vec![node("node-a").gpushare().gpus(&[16]).build()],
        vec![fixture_pod()],
    );
    let gone = gpushare_allocator::Request {
        pod_gib: 16,
        containers: vec![16],
        ..Default::default()
    };
    let held = h.state.view_mut().hold(
        gpushare_extender::scheduling::view::Hold {
            uid: "uid-gone".into(),
            namespace: "default",
            name: "gone",
            node: "node-a",
            until: std::time::Instant::now(),
        },
        &gone,
        gpushare_allocator::Policy::Binpack,
    );
    assert!(held);
    assert_eq!(used_on_node_a(&h), 16);
    let answer = captured_bind(&h).await;
    assert_eq!(answer["Error"], "", "{answer}");
    assert_eq!(used_on_node_a(&h), 4);
    assert!(h.state.view().reservation(&"uid-gone".into()).is_none());
}
