//! Shared helpers: a state built directly (no API server), a fake Binding writer, and a
//! one-shot HTTP caller.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures::future::BoxFuture;
use gpushare_allocator::Policy;
use gpushare_contract::{ContainerRequest, Keys, PodAllocation};
use gpushare_extender::scheduling::view::reservations::Phase;
use gpushare_extender::{
    BindError, BindTiming, Binder, BindingTarget, EventSink, PodOnServer, Ranking, Scheduling,
    Settings, router,
};
use gpushare_testkit::fixtures::{PodBuilder, node, pod};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use prometheus_client::registry::Registry;
use serde_json::Value;
use tower::ServiceExt;

pub const PREFIX: &str = "/gpushare-scheduler";

/// How the fake API server answers the next Bindings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BindMode {
    /// Applies the Binding and answers 201.
    #[default]
    Ok,
    /// Refuses it with this status, writing nothing.
    Refuse(u16),
    /// Applies it, then answers 504 (a write committed after the client's deadline).
    LandThenFail,
    /// Writes nothing and answers 503 (an unreachable or overloaded server).
    Unavailable,
}

/// A fake API server for the bind path: records Bindings, keeps which node each known pod
/// is bound to, and answers as [`BindMode`] says. A Binding of a pod already bound gets 409,
/// as from the real server.
#[derive(Default)]
pub struct FakeBinder {
    pub calls: Mutex<Vec<BindingTarget>>,
    pub mode: Mutex<BindMode>,
    /// Known pods by `namespace/name`: UID and node.
    pub pods: Mutex<HashMap<String, PodOnServer>>,
    /// How long each Binding takes before the server handles it.
    pub delay: Mutex<Duration>,
}

impl FakeBinder {
    pub fn calls(&self) -> Vec<BindingTarget> {
        self.calls.lock().unwrap().clone()
    }

    pub fn set_mode(&self, mode: BindMode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// The node the fake server has the pod bound to.
    pub fn bound_node(&self, namespace: &str, name: &str) -> Option<String> {
        let pods = self.pods.lock().unwrap();
        pods.get(&format!("{namespace}/{name}"))?.node.clone()
    }

    fn refused(code: u16) -> BindError {
        BindError::Refused {
            code,
            reason: "Injected".into(),
            message: "injected".into(),
        }
    }
}

impl Binder for FakeBinder {
    fn bind(&self, target: BindingTarget) -> BoxFuture<'_, Result<(), BindError>> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            let delay = *self.delay.lock().unwrap();
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            self.calls.lock().unwrap().push(target.clone());
            let mode = *self.mode.lock().unwrap();
            if let BindMode::Refuse(code) = mode {
                return Err(Self::refused(code));
            }
            if mode == BindMode::Unavailable {
                return Err(Self::refused(503));
            }
            {
                let mut pods = self.pods.lock().unwrap();
                let key = format!("{}/{}", target.namespace, target.name);
                let pod = pods.entry(key).or_insert_with(|| PodOnServer {
                    uid: target.uid.clone(),
                    node: None,
                });
                if pod.uid != target.uid || pod.node.is_some() {
                    return Err(Self::refused(409));
                }
                pod.node = Some(target.node.clone());
            }
            match mode {
                BindMode::LandThenFail => Err(Self::refused(504)),
                _ => Ok(()),
            }
        })
    }

    fn read_pod<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodOnServer>, BindError>> {
        Box::pin(async move {
            if *self.mode.lock().unwrap() == BindMode::Unavailable {
                return Err(Self::refused(503));
            }
            let pods = self.pods.lock().unwrap();
            Ok(pods.get(&format!("{namespace}/{name}")).cloned())
        })
    }
}

pub struct Harness {
    pub state: Scheduling,
    pub binder: Arc<FakeBinder>,
    pub app: Router,
}

/// The settings [`harness`] runs with: the default resource, domain and node label.
pub fn settings() -> Settings {
    Settings::new(
        gpushare_contract::DEFAULT_RESOURCE,
        gpushare_contract::DEFAULT_DOMAIN,
        "gpushare=true",
    )
}

/// The UID of the pod in the captured requests.
pub const FIXTURE_UID: &str = "647c79bc-629b-49c7-a3dd-034bd088a0ab";

/// The captured bind request (gpu-pod-3 to node-a), answered.
pub async fn captured_bind(h: &Harness) -> Value {
    post(h, "bind", &fixture("bind-request.json")).await.1
}

/// node-a: one empty 16 GiB GPU; node-b: one 8 GiB GPU with 6 GiB taken.
pub fn fixture_cluster() -> Harness {
    harness(
        vec![
            node("node-a").gpushare().gpus(&[16]).build(),
            node("node-b").gpushare().gpus(&[8]).build(),
        ],
        vec![fixture_pod(), bound("busy", "node-b", 0, 6, true)],
    )
}

/// GiB booked on node-a's GPU.
pub fn used_on_node_a(h: &Harness) -> u64 {
    h.state.view().cluster.node("node-a").unwrap().gpus()[0].used_gib
}

/// Where the captured pod's reservation is, if it has one.
pub fn phase_of_fixture_pod(h: &Harness) -> Option<Phase> {
    h.state
        .view()
        .reservation(&FIXTURE_UID.into())
        .map(|r| r.phase)
}

/// The pod inside the captured requests (gpu-pod-3, 4 GiB).
pub fn fixture_pod() -> Pod {
    let args: Value = serde_json::from_str(&fixture("filter-request-nodenames.json")).unwrap();
    serde_json::from_value(args["Pod"].clone()).unwrap()
}

/// A synced state over these nodes and pods (pods get a UID `uid-<name>` unless set).
pub fn harness(nodes: Vec<Node>, pods: Vec<Pod>) -> Harness {
    harness_with(settings(), nodes, pods)
}

/// [`harness`] with other settings (a keyring, another domain).
pub fn harness_with(settings: Settings, nodes: Vec<Node>, pods: Vec<Pod>) -> Harness {
    harness_timed(settings, fast_timing(), nodes, pods)
}

/// [`harness_with`] with other bind-path timing (limits on writes in flight).
pub fn harness_timed(
    settings: Settings,
    timing: BindTiming,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
) -> Harness {
    harness_ranked(settings, Ranking::by(Policy::Binpack), timing, nodes, pods)
}

/// [`harness_with`] whose filter passes only the `n` best fitting nodes
/// (`--filter-keep-best`).
pub fn harness_keeping_best(
    n: usize,
    settings: Settings,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
) -> Harness {
    let ranking = Ranking::by(Policy::Binpack).keeping_best(n);
    harness_ranked(settings, ranking, fast_timing(), nodes, pods)
}

/// The harness with every choice given.
pub fn harness_ranked(
    settings: Settings,
    ranking: Ranking,
    timing: BindTiming,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
) -> Harness {
    let binder = Arc::new(FakeBinder::default());
    let state = Scheduling::new(
        settings,
        ranking,
        binder.clone(),
        timing,
        EventSink::disabled(),
        Registry::default(),
    );
    let pods: Vec<Pod> = pods.into_iter().map(with_uid).collect();
    {
        let mut known = binder.pods.lock().unwrap();
        for pod in &pods {
            let meta = &pod.metadata;
            known.insert(
                format!(
                    "{}/{}",
                    meta.namespace.as_deref().unwrap_or("default"),
                    meta.name.as_deref().unwrap_or_default()
                ),
                PodOnServer {
                    uid: meta.uid.clone().unwrap_or_default(),
                    node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                },
            );
        }
    }
    {
        let mut view = state.view_mut();
        view.replace_nodes(&nodes);
        view.replace_pods(&pods);
    }
    let app = router(state.clone(), PREFIX, gpushare_extender::DEFAULT_BODY_LIMIT);
    Harness { state, binder, app }
}

/// Waits until `condition` holds, checking every 10 ms; fails a test hung for a minute (a
/// deadline only a hang reaches, on a paused clock or a slow machine alike).
pub async fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after 60 s waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Bind-path timing for tests: short timeouts and backoffs.
pub fn fast_timing() -> BindTiming {
    BindTiming {
        timeout: Duration::from_millis(500),
        backoff_initial: Duration::from_millis(5),
        backoff_max: Duration::from_millis(20),
        ..BindTiming::default()
    }
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

/// One request through the router with a body of any bytes; the answer's status and text.
pub async fn call_bytes(
    app: &Router,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> (StatusCode, String) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
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

/// A pod already bound to `node`, holding `gib` on GPU `gpu`, as the watch shows it.
pub fn bound(name: &str, node_name: &str, gpu: u32, gib: u64, assigned: bool) -> Pod {
    bound_builder(name, node_name, gpu, gib, assigned).build()
}

/// [`bound`], still to be built (to ask for CPU and memory too).
pub fn bound_builder(
    name: &str,
    node_name: &str,
    gpu: u32,
    gib: u64,
    assigned: bool,
) -> PodBuilder {
    let allocation = PodAllocation {
        more_gpus: Vec::new(),
        exclusive: false,
        gpu_index: gpu,
        gpu_uuid: format!("GPU-{node_name}-{gpu}"),
        pod_gib: gib,
        containers: vec![ContainerRequest {
            name: "main".into(),
            gib,
            init: false,
            compute: 0,
        }],
        bind_time: "2026-11-22T10:00:00Z".into(),
        assigned,
        allocated: if assigned {
            vec!["main".into()]
        } else {
            vec![]
        },
        signature: None,
        compute: 0,
    };
    let mut builder = pod(name).gpu_mem(gib).on_node(node_name);
    for (k, v) in allocation.to_annotations(&Keys::default()) {
        builder = builder.annotation(&k, &v);
    }
    builder
}

/// `POST {PREFIX}/{verb}` with `body`, as kube-scheduler calls the extender.
pub async fn post(h: &Harness, verb: &str, body: &str) -> (StatusCode, Value) {
    call(&h.app, "POST", &format!("{PREFIX}/{verb}"), body).await
}
