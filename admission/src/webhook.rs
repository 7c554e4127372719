//! The `/mutate-pods` handler: route pods that ask for GPU memory to the gpushare scheduler.
//!
//! Users should not have to remember `schedulerName: gpushare-scheduler`. A pod that asks for
//! the resource but is scheduled by the default scheduler would be placed without the
//! extender, so no GPU would be chosen for it and the device plugin could not pin it. The
//! webhook closes that gap at CREATE: such a pod gets a JSON Patch setting
//! `/spec/schedulerName` (and, with the idle-GPU taint on, a toleration of it: that taint is
//! meant for pods that ask for no GPU). Everything else is admitted untouched, and a pod whose request is
//! malformed is refused with a message naming the value, which is friendlier than a pod that
//! stays Pending forever.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use gpushare_contract::taints::{idle_gpu_taint, tolerates};
use gpushare_contract::{DEFAULT_RESOURCE, Keys, pod_request_with};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use crate::review::{AdmissionRequest, AdmissionResponse, AdmissionReview, PATCH_TYPE_JSON_PATCH};

/// The path the chart's MutatingWebhookConfiguration points at.
pub const MUTATE_PODS_PATH: &str = "/mutate-pods";
/// The scheduler name the chart configures by default.
pub const DEFAULT_SCHEDULER_NAME: &str = "gpushare-scheduler";
/// The scheduler name Kubernetes fills in when a pod names none.
const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// What the webhook needs to decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionState {
    /// The extended resource pods ask for, e.g. `example.com/gpu-mem`.
    pub resource: String,
    /// The scheduler profile that runs the gpushare extender, e.g. `gpushare-scheduler`.
    pub scheduler_name: String,
    /// Annotation keys, for the multi-GPU layout annotations (`<domain>/gpus`,
    /// `<domain>/exclusive`) checked with the request.
    pub keys: Keys,
    /// Whether a routed pod also gets a toleration of the extender's idle-GPU taint
    /// (`<domain>/idle-gpu`, `PreferNoSchedule`): the taint steers pods that ask for no GPU
    /// away from idle GPUs, and must not outweigh a GPU pod's own soft preferences when
    /// kube-scheduler scores it.
    pub tolerate_idle_gpu_taint: bool,
}

impl AdmissionState {
    /// A webhook routing pods asking for `resource` to `scheduler_name`.
    pub fn new(resource: impl Into<String>, scheduler_name: impl Into<String>) -> Self {
        Self {
            resource: resource.into(),
            scheduler_name: scheduler_name.into(),
            keys: Keys::default(),
            tolerate_idle_gpu_taint: false,
        }
    }

    /// The same, giving routed pods a toleration of the idle-GPU taint.
    pub fn with_idle_gpu_toleration(mut self, tolerate: bool) -> Self {
        self.tolerate_idle_gpu_taint = tolerate;
        self
    }

    /// The same, with annotation keys under `domain`.
    pub fn with_domain(mut self, domain: &str) -> Self {
        self.keys = Keys::new(domain);
        self
    }
}

impl Default for AdmissionState {
    fn default() -> Self {
        Self::new(DEFAULT_RESOURCE, DEFAULT_SCHEDULER_NAME)
    }
}

/// The webhook's routes: `POST /mutate-pods`. Mount it on an HTTPS server ([`crate::serve_tls`]).
pub fn router(state: AdmissionState) -> Router {
    Router::new()
        .route(MUTATE_PODS_PATH, post(mutate_pods))
        .with_state(state)
}

/// The JSON Patch operation giving `pod` a toleration of the `PreferNoSchedule` taint `key`,
/// unless one of its tolerations already covers it.
fn idle_gpu_toleration(pod: &Pod, key: &str) -> Option<serde_json::Value> {
    let toleration = json!({"key": key, "operator": "Exists", "effect": "PreferNoSchedule"});
    let tolerations = pod.spec.as_ref().and_then(|spec| spec.tolerations.as_ref());
    let taint = idle_gpu_taint(key);
    let covered = tolerations
        .into_iter()
        .flatten()
        .any(|t| tolerates(t, &taint));
    match (covered, tolerations) {
        (true, _) => None,
        (false, Some(_)) => {
            Some(json!({"op": "add", "path": "/spec/tolerations/-", "value": toleration}))
        }
        (false, None) => {
            Some(json!({"op": "add", "path": "/spec/tolerations", "value": [toleration]}))
        }
    }
}

/// A body that is not an AdmissionReview: the API server never sends one, so whoever did
/// gets a plain 400 saying what was wrong.
fn bad_request(message: String) -> Response {
    tracing::warn!(%message, "rejected malformed admission request");
    (StatusCode::BAD_REQUEST, message).into_response()
}

async fn mutate_pods(State(state): State<AdmissionState>, body: Bytes) -> Response {
    let review: AdmissionReview = match serde_json::from_slice(&body) {
        Ok(review) => review,
        Err(err) => {
            return bad_request(format!(
                "request body is not an admission.k8s.io/v1 AdmissionReview: {err}"
            ));
        }
    };
    let Some(request) = review.request else {
        return bad_request("AdmissionReview has no request".to_owned());
    };
    if request.uid.is_empty() {
        return bad_request("AdmissionReview request has no uid".to_owned());
    }
    let response = review_pod(&state, &request);
    axum::Json(response.into_review()).into_response()
}

/// Decides on one admission request. Pure: the HTTP layer only parses and wraps.
pub fn review_pod(state: &AdmissionState, request: &AdmissionRequest) -> AdmissionResponse {
    let uid = request.uid.as_str();
    if request.kind.kind != "Pod" || !request.kind.group.is_empty() {
        let mut response = AdmissionResponse::allow(uid);
        response.warnings.push(format!(
            "the gpushare webhook only handles Pods, but was sent a {}/{}; check the rules of its MutatingWebhookConfiguration",
            request.kind.group, request.kind.kind
        ));
        return response;
    }
    // schedulerName is immutable after creation: only CREATE can be routed.
    if request.operation != "CREATE" || request.sub_resource.is_some() {
        return AdmissionResponse::allow(uid);
    }
    let Some(object) = request.object.clone() else {
        return AdmissionResponse::deny(
            uid,
            400,
            "BadRequest",
            "admission request for a Pod CREATE carries no object",
        );
    };
    let mut pod: Pod = match serde_json::from_value(object) {
        Ok(pod) => pod,
        Err(err) => {
            return AdmissionResponse::deny(
                uid,
                400,
                "BadRequest",
                format!("the object under admission is not a valid Pod: {err}"),
            );
        }
    };
    // On CREATE the name may still be empty (generateName) and the namespace implied: fill
    // them in so error messages name the pod the user wrote.
    if pod.metadata.namespace.is_none() {
        pod.metadata.namespace = request.namespace.clone();
    }
    if pod.metadata.name.is_none() {
        pod.metadata.name = request
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .or_else(|| pod.metadata.generate_name.as_ref().map(|g| format!("{g}*")));
    }
    let pod_name = gpushare_contract::request::pod_key(&pod);
    match pod_request_with(&pod, &state.resource, &state.keys) {
        Err(err) => {
            tracing::info!(pod = %pod_name, error = %err, "refused pod with malformed GPU memory request");
            AdmissionResponse::deny(uid, 422, "Invalid", err.to_string())
        }
        Ok(None) => AdmissionResponse::allow(uid),
        Ok(Some(req)) => {
            let current = pod
                .spec
                .as_ref()
                .and_then(|spec| spec.scheduler_name.as_deref())
                .unwrap_or("");
            if !current.is_empty() && current != DEFAULT_SCHEDULER {
                // The user picked a scheduler on purpose (maybe ours already): respect it.
                return AdmissionResponse::allow(uid);
            }
            tracing::info!(
                pod = %pod_name,
                gib = req.pod_gib,
                scheduler = %state.scheduler_name,
                "routing pod to the gpushare scheduler"
            );
            let mut patch = vec![json!({
                "op": "add",
                "path": "/spec/schedulerName",
                "value": state.scheduler_name,
            })];
            if state.tolerate_idle_gpu_taint {
                patch.extend(idle_gpu_toleration(&pod, &state.keys.node_idle_gpu_taint));
            }
            let patch = serde_json::Value::Array(patch);
            let mut response = AdmissionResponse::allow(uid);
            response.patch = Some(BASE64.encode(patch.to_string()));
            response.patch_type = Some(PATCH_TYPE_JSON_PATCH.to_owned());
            response
        }
    }
}
