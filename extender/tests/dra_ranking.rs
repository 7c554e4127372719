//! DRA mode (`--dra-driver`, `--dra-device-class`): the extender ranks nodes for
//! kube-scheduler's DRA allocation over a view built from ResourceSlices and ResourceClaims.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{PREFIX, call, harness_keeping_best, settings};
use gpushare_extender::scheduling::view::DraNames;
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use serde_json::{Value, json};

const DRIVER: &str = "gpu-mem.example.com";
const CLASS: &str = "gpu-mem.example.com";

fn dra_settings() -> gpushare_extender::Settings {
    settings().with_dra(DraNames {
        driver: DRIVER.to_owned(),
        device_class: CLASS.to_owned(),
    })
}

/// Our driver's slice for `node`, one device per entry of `gpus` (GiB).
fn slice(node: &str, gpus: &[u64]) -> ResourceSlice {
    let devices: Vec<Value> = gpus
        .iter()
        .enumerate()
        .map(|(index, gib)| {
            json!({
                "name": format!("gpu-{index}"),
                "attributes": {"index": {"int": index}, "uuid": {"string": format!("GPU-{node}-{index}")}},
                "capacity": {"memory": {"value": format!("{gib}Gi")}},
                "allowMultipleAllocations": true,
            })
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{DRIVER}")},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices},
    }))
    .unwrap()
}

/// A claim `name` asking `gib` of one device of our class; allocated on `on` (node, GPU
/// index) and reserved for `pod_uid` when given.
fn claim(name: &str, gib: u64, on: Option<(&str, u32)>, pod_uid: Option<&str>) -> ResourceClaim {
    let mut claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": format!("claim-uid-{name}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": CLASS,
            "capacity": {"requests": {"memory": format!("{gib}Gi")}},
        }}]}},
    });
    if let Some((node, gpu)) = on {
        claim["status"] = json!({
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": node, "device": format!("gpu-{gpu}"),
                "consumedCapacity": {"memory": format!("{gib}Gi")}, "shareID": "s1",
            }]}},
            "reservedFor": pod_uid.map(|uid| vec![json!({"resource": "pods", "name": "p", "uid": uid})]),
        });
    }
    serde_json::from_value(claim).unwrap()
}

/// A pending pod whose claim entry `gpu` was generated as the claim `claim`.
fn claiming_pod(name: &str, claim: &str) -> Pod {
    let mut pod = pod(name).build();
    pod.metadata.uid = Some(format!("uid-{name}"));
    pod.spec.as_mut().unwrap().resource_claims = Some(vec![
        serde_json::from_value(
            json!({"name": "gpu", "resourceClaimTemplateName": "gpushare-gpu-mem-4"}),
        )
        .unwrap(),
    ]);
    pod.status = Some(
        serde_json::from_value(
            json!({"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim}]}),
        )
        .unwrap(),
    );
    pod
}

fn filter_args(pod: &Pod, nodes: &[&str]) -> String {
    json!({"Pod": pod, "Nodes": null, "NodeNames": nodes}).to_string()
}

/// The extender's filter answer for `pod` over `nodes`.
async fn filter(app: &axum::Router, pod: &Pod, nodes: &[&str]) -> Value {
    let (_, answer) = call(
        app,
        "POST",
        &format!("{PREFIX}/filter"),
        &filter_args(pod, nodes),
    )
    .await;
    answer
}

/// GiB used on each GPU of `node`, as `/inspect` shows them.
async fn used(app: &axum::Router, node: &str) -> Vec<u64> {
    let (_, answer) = call(app, "GET", &format!("{PREFIX}/inspect/{node}"), "").await;
    answer["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|gpu| gpu["usedGiB"].as_u64().unwrap())
        .collect()
}

/// Filter keeps the node whose GPU allocated claims filled most, holds the pod's share there
/// until kube-scheduler's allocation of its claim shows up, then counts the allocation in
/// its place (not both).
#[tokio::test]
async fn filter_keeps_the_node_claims_filled_most_and_holds_until_the_claim_is_allocated() {
    let nodes = ["empty", "fuller", "half"]
        .map(|name| node(name).gpushare().build())
        .to_vec();
    let h = harness_keeping_best(1, dra_settings(), nodes, vec![]);
    {
        let mut view = h.state.view_mut();
        view.replace_slices(&[
            slice("empty", &[16, 16]),
            slice("fuller", &[16, 16]),
            slice("half", &[16, 16]),
        ]);
        view.replace_claims(&[
            claim("a", 12, Some(("fuller", 0)), None),
            claim("b", 8, Some(("half", 0)), None),
            claim("pending", 4, None, None),
        ]);
        assert!(view.is_synced());
    }
    assert_eq!(used(&h.app, "fuller").await, [12, 0]);

    let pod = claiming_pod("trainer", "pending");
    let (_, answer) = call(
        &h.app,
        "POST",
        &format!("{PREFIX}/filter"),
        &filter_args(&pod, &["empty", "half", "fuller"]),
    )
    .await;
    assert_eq!(answer["NodeNames"], json!(["fuller"]), "{answer}");
    assert_eq!(used(&h.app, "fuller").await, [16, 0], "the share is held");

    // kube-scheduler allocates the claim (first fit: the first device with room).
    h.state.view_mut().apply_claim(&claim(
        "pending",
        4,
        Some(("fuller", 0)),
        Some("uid-trainer"),
    ));
    assert_eq!(used(&h.app, "fuller").await, [16, 0], "counted once");
    h.state.view_mut().delete_claim(&claim("a", 12, None, None));
    assert_eq!(
        used(&h.app, "fuller").await,
        [4, 0],
        "a deleted claim frees its share"
    );

    // A relist without a node's slice takes its GPUs away; a deleted slice too.
    h.state
        .view_mut()
        .replace_slices(&[slice("empty", &[16, 16]), slice("fuller", &[16, 16])]);
    assert!(used(&h.app, "half").await.is_empty());
    assert_eq!(used(&h.app, "fuller").await, [4, 0]);
    h.state.view_mut().delete_slice(&slice("empty", &[]));
    assert!(used(&h.app, "empty").await.is_empty());
}

/// The hold books the GPU kube-scheduler's allocator will take (the first device with room),
/// not the one the extender's policy prefers, so the pods filtered before the allocation is
/// watched see each GPU as it will be.
#[tokio::test]
async fn the_hold_books_the_gpu_first_fit_takes() {
    let nodes = vec![node("n").gpushare().build()];
    let h = harness_keeping_best(1, dra_settings(), nodes, vec![]);
    {
        let mut view = h.state.view_mut();
        view.replace_slices(&[slice("n", &[16, 16])]);
        view.replace_claims(&[
            claim("a", 4, Some(("n", 1)), None),
            claim("pending", 4, None, None),
        ]);
    }
    let pod = claiming_pod("trainer", "pending");
    let answer = filter(&h.app, &pod, &["n"]).await;
    assert_eq!(answer["NodeNames"], json!(["n"]), "{answer}");
    // The policy would fill gpu-1 (the fuller); first fit takes gpu-0.
    assert_eq!(used(&h.app, "n").await, [4, 4], "held where first fit goes");
    // kube-scheduler writes the allocation in its binding cycle, which a loaded API server
    // can hold for many seconds: the hold outlasts extender mode's 5 s.
    let later = std::time::Instant::now() + std::time::Duration::from_secs(20);
    assert_eq!(h.state.view_mut().release_lapsed_holds(later), 0);
    assert_eq!(used(&h.app, "n").await, [4, 4], "still held 20 s on");
    h.state
        .view_mut()
        .apply_claim(&claim("pending", 4, Some(("n", 0)), Some("uid-trainer")));
    assert_eq!(used(&h.app, "n").await, [4, 4], "counted once");
}

/// A claim asking for compute (`capacity.requests.compute`, percent of a GPU) is held and
/// booked with it: the hold goes where first fit finds both its memory and its compute, and
/// the allocation's `consumedCapacity.compute` counts as kube-scheduler counts it.
#[tokio::test]
async fn compute_is_held_and_booked_beside_the_memory() {
    let with_compute = |mut claim: ResourceClaim, percent: u32| {
        let mut value = serde_json::to_value(&claim).unwrap();
        value["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["compute"] =
            json!(percent.to_string());
        if let Some(result) = value.pointer_mut("/status/allocation/devices/results/0") {
            result["consumedCapacity"]["compute"] = json!(percent.to_string());
        }
        claim = serde_json::from_value(value).unwrap();
        claim
    };
    let nodes = vec![node("n").gpushare().build()];
    let h = harness_keeping_best(1, dra_settings(), nodes, vec![]);
    {
        let mut view = h.state.view_mut();
        view.replace_slices(&[slice("n", &[16, 16])]);
        view.replace_claims(&[
            with_compute(claim("a", 2, Some(("n", 0)), None), 60),
            with_compute(claim("pending", 2, None, None), 60),
        ]);
    }
    let (_, inspect) = call(&h.app, "GET", &format!("{PREFIX}/inspect/n"), "").await;
    assert_eq!(inspect["gpus"][0]["usedCompute"], 60, "{inspect}");
    assert_eq!(inspect["gpus"][0]["pods"][0]["compute"], 60, "{inspect}");

    let pod = claiming_pod("trainer", "pending");
    let answer = filter(&h.app, &pod, &["n"]).await;
    assert_eq!(answer["NodeNames"], json!(["n"]), "{answer}");
    // gpu-0 has the memory but only 40 % compute free: first fit takes gpu-1.
    assert_eq!(used(&h.app, "n").await, [2, 2], "held where both fit");
    let (_, inspect) = call(&h.app, "GET", &format!("{PREFIX}/inspect/n"), "").await;
    assert_eq!(inspect["gpus"][1]["usedCompute"], 60, "{inspect}");
    h.state.view_mut().apply_claim(&with_compute(
        claim("pending", 2, Some(("n", 1)), Some("uid-trainer")),
        60,
    ));
    let (_, inspect) = call(&h.app, "GET", &format!("{PREFIX}/inspect/n"), "").await;
    assert_eq!(
        (
            &inspect["gpus"][0]["usedCompute"],
            &inspect["gpus"][1]["usedCompute"]
        ),
        (&json!(60), &json!(60)),
        "counted once: {inspect}"
    );
}

/// A pod the extender cannot rank (no claim of our class, or one not seen yet) passes every
/// node kube-scheduler found fit, and so does one the view finds no room for: in DRA mode
/// kube-scheduler's allocator decides what fits, the extender only ranks.
#[tokio::test]
async fn pods_it_cannot_rank_pass_every_candidate() {
    let nodes = ["one", "two"]
        .map(|name| node(name).gpushare().build())
        .to_vec();
    let h = harness_keeping_best(1, dra_settings(), nodes, vec![]);
    {
        let mut view = h.state.view_mut();
        view.replace_slices(&[slice("one", &[8]), slice("two", &[8])]);
        view.replace_claims(&[
            claim("full-1", 8, Some(("one", 0)), None),
            claim("full-2", 8, Some(("two", 0)), None),
            claim("big", 4, None, None),
        ]);
    }
    let filter = async |pod: &Pod| filter(&h.app, pod, &["one", "two"]).await["NodeNames"].clone();
    assert_eq!(
        filter(&claiming_pod("unseen", "not-yet")).await,
        json!(["one", "two"])
    );
    assert_eq!(filter(&pod("plain").build()).await, json!(["one", "two"]));
    assert_eq!(
        filter(&claiming_pod("no-room", "big")).await,
        json!(["one", "two"])
    );
}
