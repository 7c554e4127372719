//! Bad input at the webhook: whatever body reaches `/mutate-pods`, the answer is an
//! AdmissionReview for the request's uid (200) or a 400 naming the problem, never a panic.
//!
//! Property tests over arbitrary bytes and over an AdmissionReview of a GPU pod with one
//! subtree replaced by arbitrary JSON; a longer run:
//! `PROPTEST_CASES=20000 cargo test -p gpushare-admission --test bad_input`.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;

use axum::body::Body;
use gpushare_admission::{AdmissionState, router};
use gpushare_testkit::json::replace_at;
use http_body_util::BodyExt as _;
use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt as _;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    })
}

fn post(body: Vec<u8>) -> (http::StatusCode, Vec<u8>) {
    runtime().block_on(async {
        let request = http::Request::post("/mutate-pods")
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let state = AdmissionState::new("example.com/gpu-mem", "gpushare-scheduler");
        let response = router(state).oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, bytes.to_vec())
    })
}

/// An AdmissionReview of a pod asking 4 GiB, as the API server sends it.
fn gpu_pod_review() -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "trainer", "namespace": "ml"},
                "spec": {"containers": [{"name": "main", "image": "cuda",
                    "resources": {"limits": {"example.com/gpu-mem": "4"}}}]},
            },
        }
    })
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        prop_oneof![
            Just("4".to_owned()),
            Just("1e100".to_owned()),
            Just("-1".to_owned()),
            Just("gpushare-scheduler".to_owned()),
            ".{0,10}",
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z/.-]{0,10}", inner, 0..5)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// A 200 is an AdmissionReview answering the request's uid; anything else is a 400.
fn answer_is_clear(
    body: &[u8],
    status: http::StatusCode,
    answer: &[u8],
) -> Result<(), TestCaseError> {
    if status == http::StatusCode::OK {
        let review: Value = serde_json::from_slice(answer).unwrap();
        let sent: Value = serde_json::from_slice(body).unwrap();
        prop_assert_eq!(&review["kind"], "AdmissionReview");
        let uid = review["response"]["uid"].as_str().unwrap_or_default();
        prop_assert!(!uid.is_empty(), "{}", review);
        // (serde also reads a struct from an array of its fields, which no API server sends.)
        if sent["request"].is_object() {
            prop_assert_eq!(&review["response"]["uid"], &sent["request"]["uid"]);
        }
    } else {
        prop_assert_eq!(
            status,
            http::StatusCode::BAD_REQUEST,
            "{}",
            String::from_utf8_lossy(answer)
        );
    }
    Ok(())
}

proptest! {
    #[test]
    fn arbitrary_bytes_get_a_clear_answer(body in prop::collection::vec(any::<u8>(), 0..512)) {
        let (status, answer) = post(body.clone());
        answer_is_clear(&body, status, &answer)?;
    }

    #[test]
    fn a_review_with_a_subtree_replaced_gets_a_clear_answer(
        steps in prop::collection::vec(any::<usize>(), 0..7),
        replacement in any_json(),
    ) {
        let mut review = gpu_pod_review();
        replace_at(&mut review, &steps, replacement);
        let body = serde_json::to_vec(&review).unwrap();
        let (status, answer) = post(body.clone());
        answer_is_clear(&body, status, &answer)?;
    }
}
