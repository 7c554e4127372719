//! The HTTP surface: kube-scheduler's verbs, inspection, health and metrics.
//!
//! Every scheduling answer is HTTP 200 (kube-scheduler discards other bodies); problems with
//! a well-formed request go in the protocol's own fields. Only a body that is not the
//! protocol's JSON gets a 400, with a JSON body naming the problem.

use std::borrow::Cow;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpushare_allocator::{PodId, Policy, Request, Unfit};
use gpushare_contract::pod_request_with;
use prometheus_client::registry::Registry;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::bind::BindTiming;
use crate::bind::slots::{Pacing, WriteSlots};
use crate::keep_best::KeepBest;
use crate::kube_io::{Binder, EventSink};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::reservation::Phase;
use crate::view::{Hold, Settings, View, pod_host, to_request};
use crate::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
    RawNodeListOut, raw_node_name,
};

/// What `/filter` and `/bind` answer before the watches have listed everything.
pub const NOT_SYNCED: &str = "extender view not synced yet";

/// Default for the largest request body accepted (`--max-request-bytes`): a 5,000-node
/// `NodeNames` call is about 150 KB, a full `Nodes` list of the same cluster tens of MiB.
pub const DEFAULT_BODY_LIMIT: usize = 32 << 20;

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    view: RwLock<View>,
    policy: Policy,
    /// `--filter-keep-best`: 0 passes every fitting node.
    filter_keep_best: AtomicUsize,
    /// `--prioritize-weight`: what kube-scheduler multiplies our scores by.
    prioritize_weight: AtomicI64,
    binder: Arc<dyn Binder>,
    bind_timing: BindTiming,
    /// Slots for Binding writes in flight (`None`: no limit); see [`crate::bind`].
    bind_slots: Option<Arc<WriteSlots>>,
    /// How filter paces kube-scheduler's cycle on the binds waiting for a slot.
    pacing: Pacing,
    events: EventSink,
    metrics: Metrics,
    registry: Arc<Registry>,
    leadership: Leadership,
    forwarder: RwLock<Option<crate::forward::Forwarder>>,
}

impl AppState {
    /// State over an empty, unsynced view; metrics are registered in `registry`.
    pub fn new(
        settings: Settings,
        policy: Policy,
        binder: Arc<dyn Binder>,
        bind_timing: BindTiming,
        events: EventSink,
        mut registry: Registry,
    ) -> Self {
        let metrics = Metrics::register(&mut registry);
        // Without an election this instance always binds; `serve` switches it to elected.
        metrics.leader.set(1);
        Self {
            inner: Arc::new(Inner {
                view: RwLock::new(View::new(settings)),
                policy,
                filter_keep_best: AtomicUsize::new(0),
                prioritize_weight: AtomicI64::new(1),
                binder,
                bind_timing,
                bind_slots: (bind_timing.writes_in_flight > 0)
                    .then(|| Arc::new(WriteSlots::new(bind_timing.writes_in_flight))),
                pacing: Pacing {
                    max_wait: bind_timing.pace_max,
                },
                events,
                metrics,
                registry: Arc::new(registry),
                leadership: Leadership::default(),
                forwarder: RwLock::new(None),
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

    /// The GPU choice policy.
    pub fn policy(&self) -> Policy {
        self.inner.policy
    }

    /// Makes filter pass only the `n` fitting nodes the policy scores best (0: all of them;
    /// see `--filter-keep-best`).
    pub fn set_filter_keep_best(&self, n: usize) {
        self.inner.filter_keep_best.store(n, Ordering::Relaxed);
    }

    /// The weight kube-scheduler's extender stanza gives our prioritize scores: the filter
    /// that keeps the best nodes ranks with it as kube-scheduler would (see
    /// `--prioritize-weight`).
    pub fn set_prioritize_weight(&self, weight: i64) {
        self.inner
            .prioritize_weight
            .store(weight, Ordering::Relaxed);
    }

    /// What writes Bindings and reads pods.
    pub fn binder(&self) -> &dyn Binder {
        &*self.inner.binder
    }

    /// The bind path's timeouts.
    pub fn bind_timing(&self) -> BindTiming {
        self.inner.bind_timing
    }

    /// The slots Binding writes take, when their number is limited.
    pub fn bind_slots(&self) -> Option<&Arc<WriteSlots>> {
        self.inner.bind_slots.as_ref()
    }

    /// Waits while the binds queued for a write slot are as many as the slots (see
    /// [`crate::bind::slots`]); counts the wait.
    async fn pace(&self) {
        let Some(slots) = self.bind_slots() else {
            return;
        };
        let waited = slots.pace(self.inner.pacing).await;
        if !waited.is_zero() {
            self.metrics().paced(waited);
        }
    }

    /// Whether this replica may bind now (see [`crate::leader`]).
    pub fn leadership(&self) -> &Leadership {
        &self.inner.leadership
    }

    /// How a follower passes binds on to the leader, if it does.
    pub fn forwarder(&self) -> Option<crate::forward::Forwarder> {
        self.inner
            .forwarder
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Sets [`AppState::forwarder`].
    pub fn set_forwarder(&self, forwarder: crate::forward::Forwarder) {
        *self
            .inner
            .forwarder
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(forwarder);
    }

    /// Sets the reservation gauges from `view`.
    pub fn update_reservation_gauges(&self, view: &View) {
        let gauge = |count: usize| i64::try_from(count).unwrap_or(i64::MAX);
        let metrics = &self.inner.metrics;
        metrics.reservations.set(gauge(view.reservation_count()));
        metrics
            .reservations_resolving
            .set(gauge(view.reservations_in(Phase::Resolving)));
        metrics
            .reservations_held
            .set(gauge(view.reservations_in(Phase::Held)));
    }
}

/// The extender's routes: `{prefix}/filter|prioritize|bind|inspect[/{node}]`, `/healthz`,
/// `/readyz`, `/metrics`; bodies larger than `body_limit` bytes get a 413.
pub fn router(state: AppState, prefix: &str, body_limit: usize) -> Router {
    let verbs = Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/inspect", get(inspect_all))
        .route("/inspect/{node}", get(inspect_node))
        .route("/identity", get(identity));
    let prefix = prefix.trim_end_matches('/');
    let app = if prefix.is_empty() {
        verbs
    } else if prefix.starts_with('/') {
        Router::new().nest(prefix, verbs)
    } else {
        Router::new().nest(&format!("/{prefix}"), verbs)
    };
    app.merge(monitor_routes())
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// This process's election identity, for a follower asking whether the Lease's holder still
/// serves at the address it published (`crate::forward::Forwarder::probe`); 404 without an
/// election.
async fn identity(State(state): State<AppState>) -> Response {
    match state.leadership().identity() {
        Some(identity) => identity.into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `/healthz`, `/readyz` and `/metrics` alone: what `--monitor-listen` serves, so probes and
/// Prometheus need neither the scheduler's TLS nor a way past its NetworkPolicy.
pub fn monitor_router(state: AppState) -> Router {
    monitor_routes()
        .layer(DefaultBodyLimit::max(0))
        .with_state(state)
}

fn monitor_routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
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
fn read_request(args: &ExtenderArgs<'_>, settings: &Settings) -> Result<Option<Request>, String> {
    let Some(pod) = args.pod.as_ref() else {
        return Err("the request carries no Pod".to_owned());
    };
    pod_request_with(pod, &settings.resource, &settings.keys)
        .map(|r| {
            r.map(|r| Request {
                host: pod_host(pod),
                ..to_request(&r)
            })
        })
        .map_err(|e| e.to_string())
}

pub(crate) fn unfit_reason(settings: &Settings, node: &str, unfit: &Unfit) -> String {
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
    state.pace().await;
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
    let pod_uid = pod_uid(args);
    release_holds(state, pod_uid.as_ref());
    // The request to hold memory for, when exactly one node passes.
    let mut to_hold: Option<Request> = None;
    let view = state.view();
    let settings = view.settings();
    match read_request(args, settings) {
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
            let reserved_on = reserved_node(&view, args);
            // Why each other node fails, kept as the allocator's reason and written out only
            // when no node passes: kube-scheduler reads extender failure reasons only then
            // (for its FitError and preemption); once a node passes it drops them unread, and
            // at hundreds of nodes a call they were most of the answer it decodes.
            let mut rejected: Vec<(usize, Unfit)> = Vec::new();
            for (i, (name, _)) in candidates.iter().enumerate() {
                match reserved_on {
                    Some(reserved_on) if name == reserved_on => passing.push(i),
                    Some(reserved_on) => {
                        result.failed_nodes.insert(
                            name.clone(),
                            format!("the pod's GPU memory is booked on node {reserved_on} while its earlier bind there is settled"),
                        );
                    }
                    None => match view.cluster.fit(name, &request) {
                        Ok(()) => passing.push(i),
                        Err(unfit) => rejected.push((i, unfit)),
                    },
                }
            }
            if reserved_on.is_none() {
                let keep_best = KeepBest {
                    keep: state.inner.filter_keep_best.load(Ordering::Relaxed),
                    policy: state.inner.policy,
                    prioritize_weight: state.inner.prioritize_weight.load(Ordering::Relaxed),
                };
                let stepped_aside = keep_best.narrow(
                    &view,
                    args.pod.as_ref(),
                    &request,
                    &candidates,
                    &mut passing,
                );
                if let Some(why) = stepped_aside {
                    state.metrics().keep_best_stepped_aside(why);
                }
            }
            if passing.is_empty() {
                write_reasons(settings, &candidates, rejected, &mut result);
            } else {
                result.failed_nodes = Default::default();
            }
            if reserved_on.is_none() && passing.len() == 1 {
                to_hold = Some(request);
            }
        }
    }
    drop(view);
    if let (Some(request), Some(uid), [only]) = (to_hold, pod_uid, passing.as_slice()) {
        hold_for_bind(state, args, uid, &candidates[*only].0, &request);
    }
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

/// The UID of the pod a filter or prioritize call is about, when kube-scheduler sent one.
fn pod_uid(args: &ExtenderArgs<'_>) -> Option<PodId> {
    args.pod
        .as_ref()
        .and_then(|pod| pod.metadata.uid.as_deref())
        .map(PodId::from)
}

/// Gives back, before a filter, the holds whose bind did not come in time, and the hold of the
/// pod being filtered (its earlier attempt ended without a bind). The write lock is taken only
/// when there are reservations at all.
fn release_holds(state: &AppState, pod_uid: Option<&PodId>) {
    if state.view().reservation_count() == 0 {
        return;
    }
    let mut view = state.view_mut();
    if let Some(uid) = pod_uid {
        view.release_hold(uid);
    }
    view.release_lapsed_holds(Instant::now());
    state.update_reservation_gauges(&view);
}

/// Holds `request`'s memory on `node` for the pod kube-scheduler is about to bind there:
/// exactly one node passed filter (kube-scheduler does not score a single node), or
/// prioritize scored one node above all others ([`sole_best`]). The hold lasts until the
/// pod's bind comes, so the filters of the pods scheduled meanwhile see the memory taken
/// ([`crate::reservation`], "Why holds").
fn hold_for_bind(
    state: &AppState,
    args: &ExtenderArgs<'_>,
    uid: PodId,
    node: &str,
    request: &Request,
) {
    let Some(pod) = args.pod.as_ref() else {
        return;
    };
    let (Some(namespace), Some(name)) = (
        pod.metadata.namespace.as_deref(),
        pod.metadata.name.as_deref(),
    ) else {
        return;
    };
    let hold = Hold {
        uid,
        namespace,
        name,
        node,
        until: Instant::now() + HOLD_FOR,
    };
    let mut view = state.view_mut();
    view.hold(hold, request, state.inner.policy);
    state.update_reservation_gauges(&view);
}

/// How long filter holds memory for a pod whose bind has not come: kube-scheduler calls bind
/// milliseconds after filter unless its binding cycle is stuck or gone.
const HOLD_FOR: Duration = Duration::from_secs(5);

/// Writes why each `rejected` candidate fails into `result`'s failed or unresolvable nodes.
///
/// Formatting a reason per rejected node was the handler's largest cost of its own in the
/// load harness profile (busy clusters reject hundreds of nodes a call, most for the same
/// shortfall): the text of the last one is reused while it repeats.
fn write_reasons<'a>(
    settings: &Settings,
    candidates: &[(Cow<'a, str>, Option<&RawValue>)],
    rejected: Vec<(usize, Unfit)>,
    result: &mut ExtenderFilterResult<'a>,
) {
    let mut last_reason: Option<(Unfit, String)> = None;
    for (i, unfit) in rejected {
        let name = &candidates[i].0;
        let reason = match &last_reason {
            // These two name the node; every other reason reads the same on each node with
            // the same shortfall.
            _ if matches!(unfit, Unfit::UnknownNode | Unfit::NotEligible) => {
                unfit_reason(settings, name, &unfit)
            }
            Some((seen, text)) if *seen == unfit => text.clone(),
            _ => {
                let text = unfit_reason(settings, name, &unfit);
                last_reason = Some((unfit.clone(), text.clone()));
                text
            }
        };
        let map = if unfit.is_unresolvable() {
            &mut result.failed_and_unresolvable_nodes
        } else {
            &mut result.failed_nodes
        };
        map.insert(name.clone(), reason);
    }
}

/// The node where the pod's memory is already booked by an earlier bind whose Binding is not
/// settled yet: a retry can only succeed there (and will, once it landed).
fn reserved_node<'v>(view: &'v View, args: &ExtenderArgs<'_>) -> Option<&'v str> {
    if view.reservation_count() == 0 {
        return None;
    }
    let uid = args.pod.as_ref()?.metadata.uid.as_deref()?;
    view.reservation(&PodId::from(uid))
        .map(|reservation| reservation.node.as_str())
}

/// `POST {prefix}/prioritize`.
#[tracing::instrument(skip_all)]
async fn prioritize(State(state): State<AppState>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderArgs<'_>>(&body) {
        Ok(args) => {
            let candidates = candidates(&args);
            let view = state.view();
            let request = read_request(&args, view.settings())
                .ok()
                .flatten()
                .filter(|_| view.is_synced());
            let names: Vec<&str> = candidates.iter().map(|(name, _)| &**name).collect();
            let raw = match &request {
                Some(request) => view.cluster.scores(&names, request, state.inner.policy),
                None => vec![0; names.len()],
            };
            drop(view);
            if let (Some(request), Some(best), Some(uid)) =
                (&request, sole_best(&raw), pod_uid(&args))
            {
                hold_for_bind(&state, &args, uid, names[best], request);
            }
            let scores = compact_priorities(&names, &raw);
            // `{"Host":"<name>","Score":10},` per listed node.
            let size = scores.iter().map(|h| h.host.len() + 24).sum::<usize>() + 2;
            json_response_sized(&scores, size)
        }
        Err(error) => bad_request("prioritize", &error),
    };
    state.metrics().observe("prioritize", started);
    response
}

/// The position of the one candidate scored above all others, if one is (a tie has none).
///
/// Why prioritize holds it: our score is what sets GPU pods apart (kube-scheduler's own scores
/// barely move for a pod's small CPU and memory request), so the node scored best alone is
/// where the pod is bound next, and the filters of the pods scheduled before that bind must
/// see its memory taken, as with filter's hold ([`crate::reservation`], "Why holds"). If
/// kube-scheduler chooses another node, the bind gives the hold back and books there; until
/// then the held node merely looked a little fuller. On a tie kube-scheduler draws the node,
/// so nothing is held.
fn sole_best(raw: &[u8]) -> Option<usize> {
    let best = raw.iter().copied().max().filter(|&best| best > 0)?;
    let mut at_best = raw.iter().enumerate().filter(|(_, score)| **score == best);
    let (position, _) = at_best.next()?;
    at_best.next().is_none().then_some(position)
}

/// The prioritize answer for `names` scored `raw`: every score lowered by the lowest one, and
/// only the hosts left above 0.
///
/// Why this is the same answer: kube-scheduler adds `score × weight × 10` to each candidate's
/// total and adds nothing for a host the list leaves out (`prioritizeNodes` in upstream's
/// `pkg/scheduler/schedule_one.go` walks the list, not the candidates), so a host left out
/// counts as 0; lowering every candidate by the same amount moves no total past another.
/// What it saves: after filter every candidate fits, and on a cluster with room most of them
/// tie at the bottom (all of them when none is better than another), so the list kube-scheduler
/// decodes in its scheduling cycle holds only the hosts we prefer.
///
/// One thing does change: upstream draws a random tie-breaker only for hosts a list names, so a
/// host left out loses a tie of totals to one that is listed, and ties among hosts left out go
/// by the order of its score heap rather than by chance.
fn compact_priorities<'a>(names: &[&'a str], raw: &[u8]) -> Vec<HostPriority<'a>> {
    let lowest = raw.iter().copied().min().unwrap_or(0);
    names
        .iter()
        .zip(raw)
        .filter(|(_, score)| **score > lowest)
        .map(|(name, score)| HostPriority {
            host: name,
            score: i64::from(score - lowest),
        })
        .collect()
}

/// `POST {prefix}/bind`.
#[tracing::instrument(skip_all, fields(pod, node))]
async fn bind(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
        Ok(args) => {
            let span = tracing::Span::current();
            span.record(
                "pod",
                tracing::field::display(format_args!("{}/{}", args.pod_namespace, args.pod_name)),
            );
            span.record("node", tracing::field::display(&args.node));
            let forwarded = headers.contains_key(crate::forward::FORWARDED_HEADER);
            let error = match crate::bind::bind_or_forward(&state, &args, &body, forwarded).await {
                Ok(()) => String::new(),
                Err(reason) => reason,
            };
            let failed = !error.is_empty();
            let mut response = json_response(&ExtenderBindingResult { error });
            // A replica that does not lead and got no bind done closes the connection: kube-scheduler keeps its connections alive, and its retry on a new
            // one may reach the replica that can bind.
            if failed && !state.leadership().is_leader() {
                response.headers_mut().insert(
                    header::CONNECTION,
                    axum::http::HeaderValue::from_static("close"),
                );
            }
            response
        }
        Err(error) => bad_request("bind", &error),
    };
    state.metrics().observe("bind", started);
    response
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
    // A multi-GPU pod is listed on each of its GPUs, with what it holds there.
    for (uid, placement) in node.pods() {
        let (namespace, pod_name) = view.pod_key(uid).unwrap_or(("", ""));
        for holder in node.gpus_of(placement) {
            let Some(gpu) = gpus.iter_mut().find(|g| g.index == holder.gpu.index) else {
                continue;
            };
            let gib = if placement.exclusive {
                placement.pod_gib.max(holder.gpu.total_gib)
            } else {
                placement.pod_gib
            };
            gpu.pods.push(InspectPod {
                namespace: namespace.to_owned(),
                name: pod_name.to_owned(),
                uid: uid.to_string(),
                gib,
                assigned: placement.assigned,
                reserved: view.reservation(uid).is_some(),
            });
        }
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

/// `GET /readyz`: 200 once both watches have listed and the view is built, and, with leader
/// election, while this replica reaches the API server (its last Lease round was answered
/// within a lease duration). Leader or follower does not matter: both answer filter and
/// prioritize, and a follower passes binds on to the leader.
async fn readyz(State(state): State<AppState>) -> Response {
    if !state.view().is_synced() {
        (StatusCode::SERVICE_UNAVAILABLE, NOT_SYNCED).into_response()
    } else if !state.leadership().reaches_api() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "this replica has not reached the API server for a lease duration",
        )
            .into_response()
    } else {
        (StatusCode::OK, "ok").into_response()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each host's score with a host left out counting as 0, as kube-scheduler counts it.
    fn as_upstream_reads(names: &[&str], answer: &[HostPriority<'_>]) -> Vec<i64> {
        names
            .iter()
            .map(|name| {
                answer
                    .iter()
                    .filter(|h| h.host == *name)
                    .map(|h| h.score)
                    .sum()
            })
            .collect()
    }

    #[test]
    fn sole_best_is_the_one_top_score_and_never_a_tie_or_a_zero() {
        assert_eq!(sole_best(&[3, 10, 7]), Some(1));
        assert_eq!(sole_best(&[0, 0, 1]), Some(2));
        assert_eq!(sole_best(&[10, 3, 10]), None);
        assert_eq!(sole_best(&[0, 0]), None);
        assert_eq!(sole_best(&[]), None);
    }

    #[test]
    fn compact_priorities_keep_every_difference_and_leave_out_the_bottom() {
        let names = ["a", "b", "c", "d"];
        let cases: [&[u8]; 5] = [
            &[3, 1, 10, 1],
            &[0, 4, 10, 0],
            &[10, 10, 10, 10],
            &[1, 2, 3, 4],
            &[0; 4],
        ];
        for raw in cases {
            let answer = compact_priorities(&names, raw);
            let read = as_upstream_reads(&names, &answer);
            for i in 0..names.len() {
                for j in 0..names.len() {
                    assert_eq!(
                        read[i] - read[j],
                        i64::from(raw[i]) - i64::from(raw[j]),
                        "{raw:?} → {answer:?}"
                    );
                }
            }
            assert!(answer.iter().all(|h| h.score > 0), "{answer:?}");
        }
        assert_eq!(
            compact_priorities(&names, &[3, 1, 10, 1]),
            [
                HostPriority {
                    host: "a",
                    score: 2
                },
                HostPriority {
                    host: "c",
                    score: 9
                }
            ]
        );
        // A host that does not fit scores 0: the others keep their scores.
        assert_eq!(
            compact_priorities(&names, &[0, 4, 10, 0]),
            [
                HostPriority {
                    host: "b",
                    score: 4
                },
                HostPriority {
                    host: "c",
                    score: 10
                }
            ]
        );
        assert!(compact_priorities(&names, &[10; 4]).is_empty());
        assert!(compact_priorities(&[], &[]).is_empty());
    }
}
