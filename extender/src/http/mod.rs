//! The HTTP surface: kube-scheduler's verbs, inspection, health and metrics.
//!
//! Every scheduling answer is HTTP 200 (kube-scheduler discards other bodies); problems with
//! a well-formed request go in the protocol's own fields. Only a body that is not the
//! protocol's JSON gets a 400, with a JSON body naming the problem.
//!
//! The handlers are adapters: each decodes the body, asks [`Scheduling`] (the domain, which
//! decides everything) and encodes its answer, timing the call. The one thing decided here is
//! what a follower does with a bind the domain says another replica must make: pass the body
//! on to the leader as received ([`forward`]), unless it came from another replica already.
//! This file holds the routes and those handlers; `inspect.rs` renders the view as JSON for
//! `kubectl gpushare`, and `callers.rs` says who may call the verbs at all (a client
//! certificate of `--client-ca`).

use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;

use self::callers::Callers;
use crate::leader::forward::{self, Forwarder};
use crate::scheduling::view::NOT_SYNCED;
use crate::scheduling::{BindRefusal, Scheduling};
use crate::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderPreemptionArgs,
};

pub mod callers;

mod inspect;

/// Default for the largest request body accepted (`--max-request-bytes`): a 5,000-node
/// `NodeNames` call is about 150 KB, a full `Nodes` list of the same cluster tens of MiB.
pub const DEFAULT_BODY_LIMIT: usize = 32 << 20;

/// The extender's routes: `{prefix}/filter|prioritize|bind|preempt|inspect[/{node}]`, `/healthz`,
/// `/readyz`, `/metrics`; bodies larger than `body_limit` bytes get a 413. Anyone may call the
/// verbs ([`scheduler_router`] sets who may).
pub fn router(state: Scheduling, prefix: &str, body_limit: usize) -> Router {
    let callers = Callers::anyone(state.metrics());
    scheduler_router(
        Adapter {
            domain: state,
            forwarder: None,
        },
        prefix,
        body_limit,
        callers,
    )
}

/// What the handlers work with: the domain, and how a follower reaches the leader.
#[derive(Clone)]
pub struct Adapter {
    /// The domain.
    pub domain: Scheduling,
    /// How binds are passed on to the leader (with leader election); `None`: a follower
    /// refuses them retryably.
    pub forwarder: Option<Forwarder>,
}

impl FromRef<Adapter> for Scheduling {
    fn from_ref(adapter: &Adapter) -> Self {
        adapter.domain.clone()
    }
}

/// As [`router`], with the verbs answering only `callers` ([`callers`]).
pub fn scheduler_router(
    state: Adapter,
    prefix: &str,
    body_limit: usize,
    callers: Callers,
) -> Router {
    let verbs = Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/preempt", post(preempt))
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
/// serves at the address it published (`crate::leader::forward::Forwarder::probe`); 404 without an
/// election.
async fn identity(State(state): State<Scheduling>) -> Response {
    match state.leadership().identity() {
        Some(identity) => identity.into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `/healthz`, `/readyz` and `/metrics` alone: what `--monitor-listen` serves, so probes and
/// Prometheus need neither the scheduler's TLS nor a way past its NetworkPolicy.
pub fn monitor_router(state: Scheduling) -> Router {
    monitor_routes()
        .layer(DefaultBodyLimit::max(0))
        .with_state(Adapter {
            domain: state,
            forwarder: None,
        })
}

fn monitor_routes() -> Router<Adapter> {
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

/// `POST {prefix}/filter`: paced while binds wait for a write slot ([`Scheduling::pace`]).
#[tracing::instrument(skip_all)]
async fn filter(State(state): State<Scheduling>, body: Bytes) -> Response {
    state.pace().await;
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderArgs<'_>>(&body) {
        Ok(args) => json_response_sized(&state.filter(&args), body.len()),
        Err(error) => bad_request("filter", &error),
    };
    state.metrics().observe("filter", started);
    response
}

/// `POST {prefix}/prioritize`.
#[tracing::instrument(skip_all)]
async fn prioritize(State(state): State<Scheduling>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderArgs<'_>>(&body) {
        Ok(args) => {
            let scores = state.prioritize(&args);
            let scores = scores.answer();
            // `{"Host":"<name>","Score":10},` per listed node.
            let size = scores.iter().map(|h| h.host.len() + 24).sum::<usize>() + 2;
            json_response_sized(&scores, size)
        }
        Err(error) => bad_request("prioritize", &error),
    };
    state.metrics().observe("prioritize", started);
    response
}

/// `POST {prefix}/preempt`.
#[tracing::instrument(skip_all, fields(pod))]
async fn preempt(State(state): State<Scheduling>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderPreemptionArgs>(&body) {
        Ok(args) => json_response(&state.preempt(&args)),
        Err(error) => bad_request("preempt", &error),
    };
    state.metrics().observe("preempt", started);
    response
}

/// `POST {prefix}/bind`.
#[tracing::instrument(skip_all, fields(pod, node))]
async fn bind(State(adapter): State<Adapter>, headers: HeaderMap, body: Bytes) -> Response {
    let state = &adapter.domain;
    let started = Instant::now();
    let response = match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
        Ok(args) => {
            let span = tracing::Span::current();
            span.record(
                "pod",
                tracing::field::display(format_args!("{}/{}", args.pod_namespace, args.pod_name)),
            );
            span.record("node", tracing::field::display(&args.node));
            let forwarded = headers.contains_key(forward::FORWARDED_HEADER);
            let error = match state.bind(&args).await {
                Ok(()) => String::new(),
                Err(BindRefusal::Follower { url, leader }) => {
                    let leader_said = pass_on(&adapter, (&url, &leader), &body, forwarded).await;
                    leader_said.err().unwrap_or_default()
                }
                Err(BindRefusal::Refused(reason)) => reason,
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

/// A bind that `leader` (at `url`) must make: `body` passed on to it as received, unless it
/// was `forwarded` here by another replica already (never passed on twice) or this replica
/// has no way to reach it; counted under `forwarded`, `forward_failed` or `not_leader`.
async fn pass_on(
    adapter: &Adapter,
    (url, leader): (&str, &str),
    body: &[u8],
    forwarded: bool,
) -> Result<(), String> {
    let state = &adapter.domain;
    let refuse = |reason: &'static str, message: String| {
        state.metrics().bind(reason);
        tracing::debug!(%message, "bind not taken");
        Err(message)
    };
    match (&adapter.forwarder, forwarded) {
        (Some(forwarder), false) => {
            match forwarder
                .forward(url, body, state.bind_timing().timeout)
                .await
            {
                Ok(answer) => {
                    state.metrics().bind("forwarded");
                    answer
                }
                Err(error) => refuse(
                    "forward_failed",
                    format!(
                        "the extender leader {leader} did not answer this bind ({error}); retry"
                    ),
                ),
            }
        }
        _ => refuse(
            "not_leader",
            format!("this extender replica does not lead ({leader} does); retry"),
        ),
    }
}

/// `GET /readyz`: 200 once both watches have listed and the view is built, and, with leader
/// election, while this replica reaches the API server (its last Lease round was answered
/// within a lease duration). Leader or follower does not matter: both answer filter and
/// prioritize, and a follower passes binds on to the leader.
async fn readyz(State(state): State<Scheduling>) -> Response {
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

/// `GET /metrics`, OpenMetrics text, sent a piece at a time (the per-GPU gauges of a large
/// cluster are megabytes: `scheduling::gauges`).
async fn metrics(State(state): State<Scheduling>) -> Response {
    match state.metrics_exposition() {
        Ok(pieces) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            Body::from_stream(futures::stream::iter(
                pieces.map(Ok::<_, std::convert::Infallible>),
            )),
        )
            .into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {error}"),
        )
            .into_response(),
    }
}
