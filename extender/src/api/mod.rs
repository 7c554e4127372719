//! The HTTP surface: kube-scheduler's verbs, inspection, health and metrics.
//!
//! Every scheduling answer is HTTP 200 (kube-scheduler discards other bodies); problems with
//! a well-formed request go in the protocol's own fields. Only a body that is not the
//! protocol's JSON gets a 400, with a JSON body naming the problem.
//!
//! This file holds the shared state, the routes and the thin handlers; each verb with
//! decisions of its own has a file: `filter.rs` (which nodes pass, and the hold for a single
//! one), `prioritize.rs` (scores, and the hold for a sole best), `inspect.rs` (the view as
//! JSON), `preempt.rs` (which pods to evict so a preemptor gets room on one GPU), with
//! `args.rs` reading what filter and prioritize are sent, and `callers.rs` (who may call the
//! verbs at all: a client certificate of `--client-ca`). Binding is in [`crate::bind`].

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpushare_allocator::Policy;
use prometheus_client::registry::Registry;
use serde::Serialize;

use self::callers::Callers;
use crate::bind::BindTiming;
use crate::bind::slots::{Pacing, WriteSlots};
use crate::kube_io::{Binder, EventSink};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::reservation::Phase;
use crate::view::{Settings, View};
use crate::wire::{ExtenderBindingArgs, ExtenderBindingResult};

mod args;
pub mod callers;
mod filter;
mod inspect;
mod preempt;
mod prioritize;

pub use crate::view::NOT_SYNCED;

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
        metrics.set_nominations(view.nominations());
    }
}

/// The extender's routes: `{prefix}/filter|prioritize|bind|preempt|inspect[/{node}]`, `/healthz`,
/// `/readyz`, `/metrics`; bodies larger than `body_limit` bytes get a 413. Anyone may call the
/// verbs ([`scheduler_router`] sets who may).
pub fn router(state: AppState, prefix: &str, body_limit: usize) -> Router {
    let callers = Callers::anyone(state.metrics());
    scheduler_router(state, prefix, body_limit, callers)
}

/// As [`router`], with the verbs answering only `callers` ([`callers`]).
pub fn scheduler_router(
    state: AppState,
    prefix: &str,
    body_limit: usize,
    callers: Callers,
) -> Router {
    let verbs = Router::new()
        .route("/filter", post(filter::filter))
        .route("/prioritize", post(prioritize::prioritize))
        .route("/bind", post(bind))
        .route("/preempt", post(preempt::preempt))
        .route("/inspect", get(inspect::inspect_all))
        .route("/inspect/{node}", get(inspect::inspect_node))
        .route("/identity", get(identity))
        .route_layer(axum::middleware::from_fn_with_state(
            callers,
            callers::admit,
        ));
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
