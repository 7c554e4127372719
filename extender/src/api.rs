//! The HTTP surface: kube-scheduler's verbs, inspection, health and metrics.
//!
//! Every scheduling answer is HTTP 200 (kube-scheduler discards other bodies); problems with
//! a well-formed request go in the protocol's own fields. Only a body that is not the
//! protocol's JSON gets a 400, with a JSON body naming the problem.

use std::borrow::Cow;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpushare_allocator::{PodId, Policy, Refusal, Request, Unfit};
use gpushare_contract::{PodAllocation, pod_request};
use prometheus_client::registry::Registry;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::kube_io::{Binder, BindingTarget, EventSink, PodEvent};
use crate::metrics::Metrics;
use crate::view::{Reservation, ReservationState, Settings, View, to_request};
use crate::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
    RawNodeListOut, raw_node_name,
};

/// What `/filter` and `/bind` answer before the watches have listed everything.
pub const NOT_SYNCED: &str = "extender view not synced yet";

/// Largest request body accepted: a full `Nodes` list of a large cluster is tens of MiB.
const BODY_LIMIT: usize = 512 << 20;

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    view: RwLock<View>,
    policy: Policy,
    binder: Arc<dyn Binder>,
    events: EventSink,
    metrics: Metrics,
    registry: Arc<Registry>,
}

impl AppState {
    /// State over an empty, unsynced view; metrics are registered in `registry`.
    pub fn new(
        settings: Settings,
        policy: Policy,
        binder: Arc<dyn Binder>,
        events: EventSink,
        mut registry: Registry,
    ) -> Self {
        let metrics = Metrics::register(&mut registry);
        Self {
            inner: Arc::new(Inner {
                view: RwLock::new(View::new(settings)),
                policy,
                binder,
                events,
                metrics,
                registry: Arc::new(registry),
            }),
        }
    }

    /// Reads the view. A poisoned lock is recovered: the view holds no invariant a panic
    /// half-way through a handler could break worse than losing the process would.
    pub fn view(&self) -> RwLockReadGuard<'_, View> {
        self.inner.view.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the view (the watches, and tests building a state directly).
    pub fn view_mut(&self) -> RwLockWriteGuard<'_, View> {
        self.inner.view.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The event sink.
    pub fn events(&self) -> &EventSink {
        &self.inner.events
    }

    fn update_reservation_gauge(&self, view: &View) {
        let count = i64::try_from(view.reservation_count()).unwrap_or(i64::MAX);
        self.inner.metrics.reservations.set(count);
    }
}

/// The extender's routes: `{prefix}/filter|prioritize|bind|inspect[/{node}]`, `/healthz`,
/// `/readyz`, `/metrics`.
pub fn router(state: AppState, prefix: &str) -> Router {
    let verbs = Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/inspect", get(inspect_all))
        .route("/inspect/{node}", get(inspect_node));
    let prefix = prefix.trim_end_matches('/');
    let app = if prefix.is_empty() {
        verbs
    } else if prefix.starts_with('/') {
        Router::new().nest(prefix, verbs)
    } else {
        Router::new().nest(&format!("/{prefix}"), verbs)
    };
    app.route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

#[derive(Serialize)]
struct ErrorBody {
    error: String,
}

fn bad_request(what: &str, error: &serde_json::Error) -> Response {
    let body = ErrorBody {
        error: format!("malformed {what} request body: {error}"),
    };
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

fn json_response<T: Serialize>(value: &T) -> Response {
    json_response_sized(value, 256)
}

/// [`json_response`] into a buffer of `capacity` bytes to start with: filter and prioritize
/// answers at 5,000 names are 100 KB or more, and growing such a buffer by doubling copies it
/// over and over.
fn json_response_sized<T: Serialize>(value: &T, capacity: usize) -> Response {
    let mut body = Vec::with_capacity(capacity);
    match serde_json::to_writer(&mut body, value) {
        Ok(()) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(ErrorBody {
                error: format!("cannot encode the answer: {error}"),
            }),
        )
            .into_response(),
    }
}

/// The pod's request, or the reason every node fails.
fn read_request(args: &ExtenderArgs<'_>, resource: &str) -> Result<Option<Request>, String> {
    let Some(pod) = args.pod.as_ref() else {
        return Err("the request carries no Pod".to_owned());
    };
    pod_request(pod, resource)
        .map(|r| r.map(|r| to_request(&r)))
        .map_err(|e| e.to_string())
}

fn unfit_reason(settings: &Settings, node: &str, unfit: &Unfit) -> String {
    match unfit {
        Unfit::UnknownNode => format!("node {node} is unknown to the gpushare extender"),
        Unfit::NotEligible => format!(
            "node {node} does not take part in GPU sharing (label {}={} not set)",
            settings.label_key, settings.label_value
        ),
        other => other.to_string(),
    }
}

/// `POST {prefix}/filter`.
#[tracing::instrument(skip_all)]
async fn filter(State(state): State<AppState>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderArgs<'_>>(&body) {
        Ok(args) => json_response_sized(&filter_answer(&state, &args), body.len()),
        Err(error) => bad_request("filter", &error),
    };
    state.metrics().observe("filter", started);
    response
}

/// The candidate nodes of a request: names, each with its raw object when sent as objects.
fn candidates<'a>(args: &'a ExtenderArgs<'a>) -> Vec<(Cow<'a, str>, Option<&'a RawValue>)> {
    if let Some(names) = &args.node_names {
        names.iter().map(|n| (n.clone(), None)).collect()
    } else if let Some(nodes) = &args.nodes {
        nodes
            .items
            .iter()
            .map(|raw| (raw_node_name(raw).unwrap_or_default(), Some(*raw)))
            .collect()
    } else {
        Vec::new()
    }
}

fn filter_answer<'a>(state: &AppState, args: &'a ExtenderArgs<'a>) -> ExtenderFilterResult<'a> {
    let candidates = candidates(args);
    let mut result = ExtenderFilterResult::default();
    let mut passing: Vec<usize> = Vec::with_capacity(candidates.len());
    let view = state.view();
    let settings = view.settings();
    match read_request(args, &settings.resource) {
        // Not ours: every node passes untouched.
        Ok(None) => passing.extend(0..candidates.len()),
        Ok(Some(_)) | Err(_) if !view.is_synced() => {
            result.error = NOT_SYNCED.to_owned();
        }
        Err(reason) => {
            for (name, _) in &candidates {
                result
                    .failed_and_unresolvable_nodes
                    .insert(name.clone(), reason.clone());
            }
        }
        Ok(Some(request)) => {
            for (i, (name, _)) in candidates.iter().enumerate() {
                match view.cluster.fit(name, &request) {
                    Ok(()) => passing.push(i),
                    Err(unfit) => {
                        let reason = unfit_reason(settings, name, &unfit);
                        let map = if unfit.is_unresolvable() {
                            &mut result.failed_and_unresolvable_nodes
                        } else {
                            &mut result.failed_nodes
                        };
                        map.insert(name.clone(), reason);
                    }
                }
            }
        }
    }
    drop(view);
    if args.node_names.is_some() {
        result.node_names = Some(passing.iter().map(|&i| candidates[i].0.clone()).collect());
    } else if args.nodes.is_some() {
        result.nodes = Some(RawNodeListOut {
            metadata: Default::default(),
            items: passing.iter().filter_map(|&i| candidates[i].1).collect(),
        });
    }
    result
}

/// `POST {prefix}/prioritize`.
#[tracing::instrument(skip_all)]
async fn prioritize(State(state): State<AppState>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderArgs<'_>>(&body) {
        Ok(args) => {
            let candidates = candidates(&args);
            let view = state.view();
            let request = read_request(&args, &view.settings().resource)
                .ok()
                .flatten()
                .filter(|_| view.is_synced());
            let names: Vec<&str> = candidates.iter().map(|(name, _)| &**name).collect();
            let raw = match &request {
                Some(request) => view.cluster.scores(&names, request, state.inner.policy),
                None => vec![0; names.len()],
            };
            let scores: Vec<HostPriority> = names
                .iter()
                .zip(raw)
                .map(|(name, score)| HostPriority {
                    host: name,
                    score: i64::from(score),
                })
                .collect();
            drop(view);
            // `{"Host":"<name>","Score":10},` per node.
            let size = names.iter().map(|name| name.len() + 24).sum::<usize>() + 2;
            json_response_sized(&scores, size)
        }
        Err(error) => bad_request("prioritize", &error),
    };
    state.metrics().observe("prioritize", started);
    response
}

/// `POST {prefix}/bind`.
#[tracing::instrument(skip_all, fields(pod, node))]
async fn bind(State(state): State<AppState>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
        Ok(args) => {
            let span = tracing::Span::current();
            span.record(
                "pod",
                tracing::field::display(format_args!("{}/{}", args.pod_namespace, args.pod_name)),
            );
            span.record("node", tracing::field::display(&args.node));
            let error = match bind_pod(&state, &args).await {
                Ok(()) => String::new(),
                Err(reason) => reason,
            };
            json_response(&ExtenderBindingResult { error })
        }
        Err(error) => bad_request("bind", &error),
    };
    state.metrics().observe("bind", started);
    response
}

/// What bind decided under the lock.
enum Decision {
    /// Already bound there: answer success without writing.
    AlreadyBound,
    /// Write this Binding.
    Write(BindingTarget, u32, String, u64),
}

/// Binds a pod: decide and reserve under the view lock, write the Binding outside it.
async fn bind_pod(state: &AppState, args: &ExtenderBindingArgs) -> Result<(), String> {
    let metrics = state.metrics();
    let pod_key = format!("{}/{}", args.pod_namespace, args.pod_name);
    let refuse = |reason: &'static str, message: String| {
        metrics.bind(reason);
        tracing::info!(pod = %pod_key, node = %args.node, %message, "bind refused");
        state.events().send(PodEvent {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            uid: args.pod_uid.clone(),
            warning: true,
            reason: "GpuBindRefused",
            note: message.clone(),
        });
        Err(message)
    };

    let decision = {
        let mut view = state.view_mut();
        match decide(&mut view, state.inner.policy, args, &pod_key) {
            Ok(decision) => {
                state.update_reservation_gauge(&view);
                decision
            }
            Err((reason, message)) => {
                drop(view);
                return refuse(reason, message);
            }
        }
    };
    let (target, gpu, uuid, gib) = match decision {
        Decision::AlreadyBound => {
            metrics.bind("already_bound");
            return Ok(());
        }
        Decision::Write(target, gpu, uuid, gib) => (target, gpu, uuid, gib),
    };

    let uid = PodId::from(args.pod_uid.as_str());
    match state.inner.binder.bind(target).await {
        Ok(()) => {
            let mut view = state.view_mut();
            view.confirm_reservation(&uid);
            state.update_reservation_gauge(&view);
            drop(view);
            metrics.bind("bound");
            let uuid_text = if uuid.is_empty() {
                String::new()
            } else {
                format!(" ({uuid})")
            };
            let note = format!(
                "Assigned GPU {gpu}{uuid_text} {gib} GiB on node {}",
                args.node
            );
            tracing::info!(pod = %pod_key, node = %args.node, gpu, gib, "bound");
            state.events().send(PodEvent {
                namespace: args.pod_namespace.clone(),
                name: args.pod_name.clone(),
                uid: args.pod_uid.clone(),
                warning: false,
                reason: "GpuAssigned",
                note,
            });
            Ok(())
        }
        Err(error) => {
            let mut view = state.view_mut();
            view.release_reservation(&uid);
            state.update_reservation_gauge(&view);
            drop(view);
            refuse(
                "api_error",
                format!(
                    "binding pod {pod_key} to node {} failed, GPU {gpu} released: {error}",
                    args.node
                ),
            )
        }
    }
}

fn decide(
    view: &mut View,
    policy: Policy,
    args: &ExtenderBindingArgs,
    pod_key: &str,
) -> Result<Decision, (&'static str, String)> {
    if !view.is_synced() {
        return Err(("not_synced", NOT_SYNCED.to_owned()));
    }
    if let Some(wait) = view.bind_hold() {
        return Err((
            "starting",
            format!(
                "extender just started; binds resume in {} ms, once binds sent by a previous instance have landed",
                wait.as_millis()
            ),
        ));
    }
    let node = args.node.as_str();
    let uid = PodId::from(args.pod_uid.as_str());
    let Some(cached) = view.pod(&args.pod_namespace, &args.pod_name) else {
        return Err((
            "pod_not_found",
            format!("pod {pod_key} (uid {uid}) not found"),
        ));
    };
    if cached.uid != uid {
        return Err((
            "pod_recreated",
            format!(
                "pod {pod_key} (uid {uid}) was recreated (now uid {}); not binding the old one",
                cached.uid
            ),
        ));
    }
    let bound_to = cached.node_name.clone();
    let request = cached
        .pending_request()
        .map(|r| r.map(|(request, read)| (request, read.containers.clone())));
    // Retries: the same pod already placed.
    if let Some((placed_on, _)) = view.cluster.pod(&uid) {
        let placed_on = placed_on.to_owned();
        let state = view.reservation(&uid).map(|r| r.state);
        return match (placed_on == node, bound_to.as_deref(), state) {
            (true, Some(n), _) if n == node => Ok(Decision::AlreadyBound),
            (true, None, Some(ReservationState::Bound)) => Ok(Decision::AlreadyBound),
            (true, None, Some(ReservationState::InFlight)) => Err((
                "conflict",
                format!("a bind of pod {pod_key} to node {node} is already in progress"),
            )),
            _ => Err((
                "conflict",
                format!(
                    "pod {pod_key} already holds GPU memory on node {placed_on}; not binding it to {node}"
                ),
            )),
        };
    }
    if let Some(bound_to) = bound_to {
        return Err((
            "conflict",
            format!("pod {pod_key} is already bound to node {bound_to}"),
        ));
    }
    let (request, containers) = match request {
        Ok(Some(request)) => request,
        Ok(None) => {
            return Err((
                "no_request",
                format!(
                    "pod {pod_key} asks for no {}; the gpushare extender binds only pods that do",
                    view.settings().resource
                ),
            ));
        }
        Err(error) => return Err(("no_request", error.to_string())),
    };
    let placement = view
        .cluster
        .reserve(uid.clone(), node, &request, policy)
        .map_err(|refusal| match refusal {
            Refusal::Unfit { reason } => (
                "unfit",
                format!(
                    "cannot bind pod {pod_key} to node {node}: {}",
                    unfit_reason(view.settings(), node, &reason)
                ),
            ),
            other => ("conflict", format!("pod {pod_key}: {other}")),
        })?;
    let allocation = PodAllocation {
        gpu_index: placement.gpu,
        gpu_uuid: placement.uuid.clone(),
        pod_gib: placement.pod_gib,
        containers,
        bind_time: jiff::Timestamp::now().to_string(),
        assigned: false,
        allocated: Vec::new(),
    };
    let annotations = allocation.to_annotations(&view.settings().keys);
    view.add_reservation(
        uid.clone(),
        Reservation {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            node: node.to_owned(),
            placement: gpushare_allocator::PodPlacement {
                gpu: placement.gpu,
                pod_gib: placement.pod_gib,
                pending: request.containers.clone(),
                assigned: false,
            },
            state: ReservationState::InFlight,
        },
    );
    Ok(Decision::Write(
        BindingTarget {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            uid: uid.to_string(),
            node: node.to_owned(),
            annotations,
        },
        placement.gpu,
        placement.uuid,
        placement.pod_gib,
    ))
}

/// `GET {prefix}/inspect`.
async fn inspect_all(State(state): State<AppState>) -> Response {
    let started = Instant::now();
    let view = state.view();
    let mut nodes: Vec<InspectNode> = view
        .cluster
        .nodes()
        .filter(|(_, node)| node.is_present())
        .map(|(name, _)| inspect(&view, name))
        .collect();
    drop(view);
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let response = json_response(&InspectAll { nodes });
    state.metrics().observe("inspect", started);
    response
}

/// `GET {prefix}/inspect/{node}`.
async fn inspect_node(State(state): State<AppState>, Path(node): Path<String>) -> Response {
    let started = Instant::now();
    let view = state.view();
    let response = if view.cluster.node(&node).is_some_and(|n| n.is_present()) {
        json_response(&inspect(&view, &node))
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(ErrorBody {
                error: format!("node {node} is unknown to the gpushare extender"),
            }),
        )
            .into_response()
    };
    drop(view);
    state.metrics().observe("inspect", started);
    response
}

#[derive(Serialize)]
struct InspectAll {
    nodes: Vec<InspectNode>,
}

/// One node in `inspect` output.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectNode {
    name: String,
    eligible: bool,
    gpus: Vec<InspectGpu>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectGpu {
    index: u32,
    uuid: String,
    model: String,
    #[serde(rename = "totalGiB")]
    total_gib: u64,
    #[serde(rename = "usedGiB")]
    used_gib: u64,
    healthy: bool,
    pods: Vec<InspectPod>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectPod {
    namespace: String,
    name: String,
    uid: String,
    gib: u64,
    assigned: bool,
    /// True while only bind's reservation, not yet the watch, knows the pod is here.
    reserved: bool,
}

fn inspect(view: &View, name: &str) -> InspectNode {
    let Some(node) = view.cluster.node(name) else {
        return InspectNode {
            name: name.to_owned(),
            eligible: false,
            gpus: Vec::new(),
        };
    };
    let mut gpus: Vec<InspectGpu> = node
        .gpus()
        .iter()
        .map(|usage| InspectGpu {
            index: usage.gpu.index,
            uuid: usage.gpu.uuid.clone(),
            model: usage.gpu.model.clone(),
            total_gib: usage.gpu.total_gib,
            used_gib: usage.used_gib,
            healthy: usage.gpu.healthy,
            pods: Vec::new(),
        })
        .collect();
    for (uid, placement) in node.pods() {
        let Some(gpu) = gpus.iter_mut().find(|g| g.index == placement.gpu) else {
            continue;
        };
        let (namespace, pod_name) = view.pod_key(uid).unwrap_or(("", ""));
        gpu.pods.push(InspectPod {
            namespace: namespace.to_owned(),
            name: pod_name.to_owned(),
            uid: uid.to_string(),
            gib: placement.pod_gib,
            assigned: placement.assigned,
            reserved: view.reservation(uid).is_some(),
        });
    }
    for gpu in &mut gpus {
        gpu.pods
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    }
    InspectNode {
        name: name.to_owned(),
        eligible: node.is_eligible(),
        gpus,
    }
}

/// `GET /readyz`: 200 once both watches have listed and the view is built.
async fn readyz(State(state): State<AppState>) -> Response {
    if state.view().is_synced() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, NOT_SYNCED).into_response()
    }
}

/// `GET /metrics`, OpenMetrics text.
async fn metrics(State(state): State<AppState>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.inner.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {error}"),
        )
            .into_response(),
    }
}
