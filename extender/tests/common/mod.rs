//! Shared helpers: a state built directly (no API server), a fake Binding writer, and a
//! one-shot HTTP caller.

#![allow(dead_code, clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures::future::BoxFuture;
use gpushare_allocator::Policy;
use gpushare_extender::{AppState, BindError, Binder, BindingTarget, EventSink, Settings, router};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use prometheus_client::registry::Registry;
use serde_json::Value;
use tower::ServiceExt;

pub const PREFIX: &str = "/gpushare-scheduler";

/// Records Bindings; fails them on demand.
#[derive(Default)]
pub struct FakeBinder {
    pub calls: Mutex<Vec<BindingTarget>>,
    pub fail: AtomicBool,
}

impl FakeBinder {
    pub fn calls(&self) -> Vec<BindingTarget> {
        self.calls.lock().unwrap().clone()
    }
}

impl Binder for FakeBinder {
    fn bind(&self, target: BindingTarget) -> BoxFuture<'_, Result<(), BindError>> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.calls.lock().unwrap().push(target);
            if self.fail.load(Ordering::SeqCst) {
                Err(BindError::Refused {
                    code: 500,
                    reason: "InternalError".into(),
                    message: "injected".into(),
                })
            } else {
                Ok(())
            }
        })
    }
}

pub struct Harness {
    pub state: AppState,
    pub binder: Arc<FakeBinder>,
    pub app: Router,
}

/// A synced state over these nodes and pods (pods get a UID `uid-<name>` unless set).
pub fn harness(nodes: Vec<Node>, pods: Vec<Pod>) -> Harness {
    let binder = Arc::new(FakeBinder::default());
    let state = AppState::new(
        Settings::new(
            gpushare_contract::DEFAULT_RESOURCE,
            gpushare_contract::DEFAULT_DOMAIN,
            "gpushare=true",
        ),
        Policy::Binpack,
        binder.clone(),
        EventSink::disabled(),
        Registry::default(),
    );
    {
        let mut view = state.view_mut();
        view.replace_nodes(&nodes);
        let pods: Vec<Pod> = pods.into_iter().map(with_uid).collect();
        view.replace_pods(&pods);
    }
    let app = router(state.clone(), PREFIX);
    Harness { state, binder, app }
}

pub fn with_uid(mut pod: Pod) -> Pod {
    if pod.metadata.uid.is_none() {
        pod.metadata.uid = Some(format!(
            "uid-{}",
            pod.metadata.name.clone().unwrap_or_default()
        ));
    }
    pod
}

/// One request through the router; the body parsed as JSON when it is JSON.
pub async fn call(app: &Router, method: &str, path: &str, body: &str) -> (StatusCode, Value) {
    let (status, _, text) = call_raw(app, method, path, body).await;
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

pub async fn call_raw(
    app: &Router,
    method: &str,
    path: &str,
    body: &str,
) -> (StatusCode, String, String) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        content_type,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

pub fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap()
}

pub fn bind_body(pod: &str, uid: &str, node: &str) -> String {
    serde_json::json!({"PodName": pod, "PodNamespace": "default", "PodUID": uid, "Node": node})
        .to_string()
}
