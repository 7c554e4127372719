//! The `/mutate-pods` handler through the axum router, as the API server would call it.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::body::Body;
use base64::Engine as _;
use gpushare_admission::{AdmissionReview, AdmissionState, router};
use http_body_util::BodyExt as _;
use serde_json::{Value, json};
use tower::ServiceExt as _;

const RESOURCE: &str = "example.com/gpu-mem";

fn state() -> AdmissionState {
    AdmissionState::new(RESOURCE, "gpushare-scheduler")
}

fn pod(gpu_mem: Option<&str>, scheduler: Option<&str>) -> Value {
    let mut container = json!({"name": "main", "image": "cuda"});
    if let Some(q) = gpu_mem {
        container["resources"] = json!({"limits": {RESOURCE: q}});
    }
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "ml"},
        "spec": {"containers": [container]},
    });
    if let Some(s) = scheduler {
        pod["spec"]["schedulerName"] = json!(s);
    }
    pod
}

fn review(kind: &str, object: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": kind},
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "dryRun": false,
        }
    })
}

async fn post(body: Vec<u8>) -> (http::StatusCode, Vec<u8>) {
    post_to(state(), body).await
}

async fn post_to(state: AdmissionState, body: Vec<u8>) -> (http::StatusCode, Vec<u8>) {
    let request = http::Request::post("/mutate-pods")
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let response = router(state).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, bytes.to_vec())
}

async fn admit(review: Value) -> AdmissionReview {
    admit_by(state(), review).await
}

async fn admit_by(state: AdmissionState, review: Value) -> AdmissionReview {
    let (status, body) = post_to(state, serde_json::to_vec(&review).unwrap()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let out: AdmissionReview = serde_json::from_slice(&body).unwrap();
    assert_eq!(out.api_version, "admission.k8s.io/v1");
    assert_eq!(out.kind, "AdmissionReview");
    assert!(out.request.is_none());
    out
}

/// Decodes the response's base64 JSON Patch and applies it to `object`.
fn apply_patch(out: &AdmissionReview, mut object: Value) -> Value {
    let response = out.response.as_ref().unwrap();
    assert_eq!(response.patch_type.as_deref(), Some("JSONPatch"));
    let raw = base64::engine::general_purpose::STANDARD
        .decode(response.patch.as_ref().unwrap())
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&raw).unwrap();
    json_patch::patch(&mut object, &patch).unwrap();
    object
}

#[tokio::test]
async fn pod_asking_for_gpu_memory_is_routed_to_the_gpushare_scheduler() {
    for scheduler in [None, Some("default-scheduler")] {
        let object = pod(Some("4"), scheduler);
        let out = admit(review("Pod", object.clone())).await;
        let response = out.response.as_ref().unwrap();
        assert_eq!(response.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert!(response.allowed);
        let patched = apply_patch(&out, object.clone());
        assert_eq!(patched["spec"]["schedulerName"], "gpushare-scheduler");
        // Only the scheduler name changed.
        let mut expected = object;
        expected["spec"]["schedulerName"] = json!("gpushare-scheduler");
        assert_eq!(patched, expected);
    }
}

/// With the idle-GPU taint on, a routed pod also tolerates it (appended to its own
/// tolerations, or as the first), unless a toleration of its own already covers it.
#[tokio::test]
async fn routed_pods_tolerate_the_idle_gpu_taint_when_it_is_on() {
    let tolerating = state().with_idle_gpu_toleration(true);
    let ours = json!({"key": "gpushare.example.com/idle-gpu", "operator": "Exists", "effect": "PreferNoSchedule"});
    let theirs =
        json!({"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"});
    let routed = |tolerations: Option<Value>| {
        let mut object = pod(Some("4"), None);
        if let Some(tolerations) = tolerations {
            object["spec"]["tolerations"] = tolerations;
        }
        object
    };
    let cases = [
        (None, json!([ours])),
        (Some(json!([theirs])), json!([theirs, ours])),
        // Already covered: by the key with `Equal` and no value, by `Exists` on every key.
        (
            Some(json!([{"key": "gpushare.example.com/idle-gpu"}])),
            json!([{"key": "gpushare.example.com/idle-gpu"}]),
        ),
        (
            Some(json!([{"operator": "Exists"}])),
            json!([{"operator": "Exists"}]),
        ),
        // Another effect does not cover it.
        (
            Some(
                json!([{"key": "gpushare.example.com/idle-gpu", "operator": "Exists", "effect": "NoSchedule"}]),
            ),
            json!([{"key": "gpushare.example.com/idle-gpu", "operator": "Exists", "effect": "NoSchedule"}, ours]),
        ),
    ];
    for (tolerations, expected) in cases {
        let object = routed(tolerations);
        let out = admit_by(tolerating.clone(), review("Pod", object.clone())).await;
        let patched = apply_patch(&out, object);
        assert_eq!(patched["spec"]["schedulerName"], "gpushare-scheduler");
        assert_eq!(patched["spec"]["tolerations"], expected);
    }
    // Off (the default), and for a pod that is not routed: no toleration.
    let out = admit(review("Pod", routed(None))).await;
    assert!(
        apply_patch(&out, routed(None))["spec"]
            .get("tolerations")
            .is_none()
    );
    let chosen = pod(Some("4"), Some("my-scheduler"));
    let out = admit_by(tolerating, review("Pod", chosen)).await;
    assert!(out.response.unwrap().patch.is_none());
}

#[tokio::test]
async fn pod_without_the_resource_is_untouched() {
    let out = admit(review("Pod", pod(None, None))).await;
    let response = out.response.unwrap();
    assert!(response.allowed);
    assert_eq!(response.patch, None);
    assert_eq!(response.patch_type, None);
    assert!(response.warnings.is_empty());
}

#[tokio::test]
async fn pod_that_chose_another_scheduler_keeps_it() {
    let out = admit(review("Pod", pod(Some("4"), Some("volcano")))).await;
    let response = out.response.unwrap();
    assert!(response.allowed);
    assert_eq!(response.patch, None);
}

#[tokio::test]
async fn malformed_quantity_is_refused_naming_the_value() {
    let out = admit(review("Pod", pod(Some("4.5"), None))).await;
    let response = out.response.unwrap();
    assert!(!response.allowed);
    let status = response.status.unwrap();
    let message = status.message.unwrap();
    assert!(message.contains("\"4.5\""), "{message}");
    assert!(
        message.contains("ml/trainer") && message.contains("main"),
        "{message}"
    );
    assert_eq!(response.patch, None);
}

#[tokio::test]
async fn multi_gpu_layouts_are_checked_at_admission() {
    let with = |annotations: Value| {
        let mut object = pod(Some("9"), None);
        object["metadata"]["annotations"] = annotations;
        object
    };
    // 9 GiB cannot be split over 2 GPUs: refused, naming the container and the key.
    let out = admit(review(
        "Pod",
        with(json!({"gpushare.example.com/gpus": "2"})),
    ))
    .await;
    let response = out.response.unwrap();
    assert!(!response.allowed);
    let message = response.status.unwrap().message.unwrap();
    assert!(
        message.contains("multiple of 2") && message.contains("gpushare.example.com/gpus"),
        "{message}"
    );
    let out = admit(review(
        "Pod",
        with(json!({"gpushare.example.com/gpus": "many"})),
    ))
    .await;
    assert!(!out.response.unwrap().allowed);
    // 9 GiB over 3 GPUs, whole: routed like any GPU pod.
    let out = admit(review(
        "Pod",
        with(json!({"gpushare.example.com/gpus": "3", "gpushare.example.com/exclusive": "true"})),
    ))
    .await;
    let response = out.response.unwrap();
    assert!(response.allowed);
    assert!(response.patch.is_some());
}

#[tokio::test]
async fn non_pod_kind_is_allowed_with_a_warning() {
    let out = admit(review("Deployment", json!({"kind": "Deployment"}))).await;
    let response = out.response.unwrap();
    assert!(response.allowed);
    assert_eq!(response.patch, None);
    assert_eq!(response.warnings.len(), 1, "{:?}", response.warnings);
    assert!(response.warnings[0].contains("Deployment"));
}

#[tokio::test]
async fn bad_bodies_get_a_clear_400() {
    let (status, body) = post(b"{not json".to_vec()).await;
    assert_eq!(status, 400);
    let text = String::from_utf8(body).unwrap();
    assert!(
        text.contains("not an admission.k8s.io/v1 AdmissionReview"),
        "{text}"
    );

    let (status, body) =
        post(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec()).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8(body).unwrap().contains("no request"));
}

#[tokio::test]
async fn unparsable_pod_object_is_refused_with_400_status() {
    let out = admit(review("Pod", json!({"spec": {"containers": "nope"}}))).await;
    let response = out.response.unwrap();
    assert!(!response.allowed);
    let status = response.status.unwrap();
    assert_eq!(status.code, Some(400));
    assert!(status.message.unwrap().contains("not a valid Pod"));
}
