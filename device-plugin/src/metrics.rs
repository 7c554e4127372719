//! Prometheus metrics and the health endpoints (`/healthz`, `/readyz`, `/metrics`).
//!
//! The registry is created in `run` and passed down; nothing is global, so two plugins in
//! one test process do not share counters.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// A label naming why something failed, or `ok`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// short, fixed vocabulary: `no_devices`, `unknown_device`, `no_pending_pod`, …
    pub reason: String,
}

/// A label naming the outcome of an API write.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or `error`
    pub result: String,
}

/// Every metric the plugin exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Containers allocated.
    pub allocations: Counter,
    /// Allocate calls refused, by reason.
    pub allocate_errors: Family<ReasonLabels, Counter>,
    /// Allocate calls refused because the pod's allocation is not signed by the extender.
    pub forged_allocations: Counter,
    /// Time to answer an Allocate call.
    pub allocate_duration: Histogram,
    /// Healthy GPUs on the node.
    pub gpus_healthy: Gauge<i64, AtomicI64>,
    /// GPUs on the node.
    pub gpus: Gauge<i64, AtomicI64>,
    /// Successful registrations with kubelet.
    pub registrations: Counter,
    /// Pod annotation patches (allocated/assigned marks), by result.
    pub pod_patches: Family<ResultLabels, Counter>,
    /// Node inventory patches, by result.
    pub node_patches: Family<ResultLabels, Counter>,
    /// Disagreements between what kubelet reports containers hold and the allocations, by
    /// kind (`wrong_gpu`, `no_allocation`); each counted once per container.
    pub kubelet_mismatches: Family<KindLabels, Counter>,
    /// Allocation marks corrected from what kubelet reports containers hold.
    pub marks_from_kubelet: Counter,
    /// 1 while kubelet's PodResources API answers, else 0.
    pub pod_resources_up: Gauge<i64, AtomicI64>,
    /// Running pods whose GPU turned unhealthy (each counted once per health change).
    pub pods_on_unhealthy_gpu: Counter,
    /// Pods evicted because their GPU turned unhealthy (`--evict-on-unhealthy`).
    pub evictions: Counter,
}

/// A label naming the kind of a finding.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `wrong_gpu` or `no_allocation`
    pub kind: String,
}

impl Metrics {
    /// Creates the metrics and registers them under `gpushare_device_plugin` in `registry`.
    pub fn new(registry: &mut Registry) -> Self {
        let metrics = Self {
            allocations: Counter::default(),
            allocate_errors: Family::default(),
            forged_allocations: Counter::default(),
            allocate_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            gpus_healthy: Gauge::default(),
            gpus: Gauge::default(),
            registrations: Counter::default(),
            pod_patches: Family::default(),
            node_patches: Family::default(),
            kubelet_mismatches: Family::default(),
            marks_from_kubelet: Counter::default(),
            pod_resources_up: Gauge::default(),
            pods_on_unhealthy_gpu: Counter::default(),
            evictions: Counter::default(),
        };
        let sub = registry.sub_registry_with_prefix("gpushare_device_plugin");
        sub.register(
            "allocations",
            "Containers allocated",
            metrics.allocations.clone(),
        );
        sub.register(
            "allocate_errors",
            "Allocate calls refused, by reason",
            metrics.allocate_errors.clone(),
        );
        sub.register(
            "forged_allocations",
            "Allocate calls refused because the pod's allocation is not signed by the gpushare extender",
            metrics.forged_allocations.clone(),
        );
        sub.register(
            "allocate_duration_seconds",
            "Time to answer an Allocate call",
            metrics.allocate_duration.clone(),
        );
        sub.register("gpus_healthy", "Healthy GPUs", metrics.gpus_healthy.clone());
        sub.register("gpus", "GPUs on the node", metrics.gpus.clone());
        sub.register(
            "registrations",
            "Successful registrations with kubelet",
            metrics.registrations.clone(),
        );
        sub.register(
            "pod_patches",
            "Pod allocation-mark patches, by result",
            metrics.pod_patches.clone(),
        );
        sub.register(
            "node_patches",
            "Node inventory patches, by result",
            metrics.node_patches.clone(),
        );
        sub.register(
            "kubelet_mismatches",
            "Containers kubelet reports holding GPU memory devices their pod was not given, by kind (wrong_gpu: devices of another GPU than the pod's; no_allocation: a pod without its own gpushare allocation)",
            metrics.kubelet_mismatches.clone(),
        );
        sub.register(
            "marks_from_kubelet",
            "Pod allocation marks corrected from what kubelet's PodResources API reports containers hold",
            metrics.marks_from_kubelet.clone(),
        );
        sub.register(
            "pod_resources_up",
            "1 while kubelet's PodResources API answers, else 0 (marks are then reconciled from pod phases)",
            metrics.pod_resources_up.clone(),
        );
        sub.register(
            "pods_on_unhealthy_gpu",
            "Running pods whose GPU turned unhealthy (an Event and a pod condition each)",
            metrics.pods_on_unhealthy_gpu.clone(),
        );
        sub.register(
            "unhealthy_gpu_evictions",
            "Pods evicted because their GPU turned unhealthy (--evict-on-unhealthy)",
            metrics.evictions.clone(),
        );
        metrics
    }

    /// Counts a finding about what kubelet reports containers hold.
    pub fn kubelet_mismatch(&self, kind: &str) {
        self.kubelet_mismatches
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Counts a refused Allocate.
    pub fn allocate_error(&self, reason: &str) {
        self.allocate_errors
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts an API write by outcome.
    pub fn patch(family: &Family<ResultLabels, Counter>, ok: bool) {
        let result = if ok { "ok" } else { "error" }.to_owned();
        family.get_or_create(&ResultLabels { result }).inc();
    }
}

#[derive(Clone)]
struct HttpState {
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
}

/// Serves `/healthz`, `/readyz` (ready once registered with kubelet) and `/metrics` on
/// `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(registry, ready))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// The routes of the metrics server.
pub fn router(registry: Arc<Registry>, ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(HttpState { registry, ready })
}

/// Binds the metrics address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

async fn readyz(State(state): State<HttpState>) -> impl IntoResponse {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not registered with kubelet",
        )
    }
}

async fn metrics(State(state): State<HttpState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(err) => (StatusCode::INTERNAL_SERVER_ERROR, err.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(app: Router, path: &str) -> (StatusCode, String) {
        let response = app
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn serves_openmetrics_and_readiness() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        metrics.allocations.inc();
        metrics.allocate_error("no_pending_pod");
        metrics.allocate_duration.observe(0.0002);
        metrics.gpus_healthy.set(3);
        let ready = Arc::new(AtomicBool::new(false));
        let app = router(Arc::new(registry), ready.clone());

        let (status, body) = get(app.clone(), "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        for line in [
            "gpushare_device_plugin_allocations_total 1",
            "gpushare_device_plugin_allocate_errors_total{reason=\"no_pending_pod\"} 1",
            "gpushare_device_plugin_allocate_duration_seconds_count 1",
            "gpushare_device_plugin_gpus_healthy 3",
            "# EOF",
        ] {
            assert!(body.contains(line), "{line} missing from\n{body}");
        }
        assert_eq!(get(app.clone(), "/healthz").await.0, StatusCode::OK);
        assert_eq!(
            get(app.clone(), "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        ready.store(true, Ordering::Relaxed);
        assert_eq!(get(app, "/readyz").await.0, StatusCode::OK);
    }
}
