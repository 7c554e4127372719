//! Prometheus metrics and the health endpoints (`/healthz`, `/readyz`, `/metrics`).
//!
//! The registry is created in `run` and passed down; nothing is global, so two plugins in
//! one test process do not share counters.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use gpushare_contract::GpuInfo;
use gpushare_runtime::metrics::label_value;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::attribution::Report;

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
    /// Healthy GPUs on the node ([`Metrics::record_gpus`]).
    pub gpus_healthy: Gauge<i64, AtomicI64>,
    /// GPUs on the node ([`Metrics::record_gpus`]).
    pub gpus: Gauge<i64, AtomicI64>,
    /// 1 while each GPU is healthy, else 0 ([`Metrics::record_gpus`]).
    pub gpu_healthy: Family<GpuLabels, Gauge<i64, AtomicI64>>,
    /// The memory of each GPU the plugin offers, in bytes ([`Metrics::record_gpus`]).
    pub gpu_capacity_bytes: Family<GpuModelLabels, Gauge<i64, AtomicI64>>,
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
    /// Bytes kubelet gave pods on each GPU ([`crate::usage`]).
    pub gpu_allocated_bytes: Family<GpuLabels, Gauge<i64, AtomicI64>>,
    /// Bytes every process on each GPU uses.
    pub gpu_used_bytes: Family<GpuLabels, Gauge<i64, AtomicI64>>,
    /// Of those, bytes no gpushare pod could be named for.
    pub gpu_unattributed_bytes: Family<GpuLabels, Gauge<i64, AtomicI64>>,
    /// Bytes kubelet gave each pod on each GPU.
    pub pod_allocated_bytes: Family<PodGpuLabels, Gauge<i64, AtomicI64>>,
    /// Bytes each pod's processes use on each GPU.
    pub pod_used_bytes: Family<PodGpuLabels, Gauge<i64, AtomicI64>>,
    /// Pods using more than they hold on some GPU.
    pub pods_over_share: Gauge<i64, AtomicI64>,
    /// Node usage annotation patches, by result.
    pub usage_patches: Family<ResultLabels, Counter>,
    /// Each container's share of each GPU, as its interposer holds it
    /// ([`crate::isolation_usage`]).
    pub isolated_share_bytes: Family<ContainerGpuLabels, Gauge<i64, AtomicI64>>,
    /// Bytes each container holds on each GPU, as its interposer counted them.
    pub isolated_used_bytes: Family<ContainerGpuLabels, Gauge<i64, AtomicI64>>,
    /// Allocations the interposer refused each container so far (past its share).
    pub isolated_refused_allocations: Family<ContainerGpuLabels, Gauge<i64, AtomicI64>>,
    /// Bytes each pod's containers use on each GPU by the driver's count
    /// (`gpushare_container_gpu_memory_used_bytes`, [`crate::over_share`]).
    pub container_used_bytes: Family<ContainerUseLabels, Gauge<i64, AtomicI64>>,
    /// Of those, bytes past what kubelet gave the pod there
    /// (`gpushare_container_over_share_bytes`).
    pub container_over_share_bytes: Family<ContainerUseLabels, Gauge<i64, AtomicI64>>,
    /// Episodes of a pod over its share of a GPU (each told once by an Event).
    pub over_share_episodes: Counter,
    /// Pods evicted for staying over their share (`--over-share evict`).
    pub over_share_evictions: Counter,
}

/// Labels of a per-container, per-GPU metric of the driver's figures.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ContainerUseLabels {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The containers given the GPU (kubelet's listing), joined with `+`; empty if unknown.
    pub container: String,
    /// The GPU's index on the node.
    pub gpu: String,
}

/// Labels of a per-container, per-GPU metric of the interposer.
#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ContainerGpuLabels {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container.
    pub container: String,
    /// The GPU, as the container numbers it.
    pub gpu: u32,
}

/// Labels of a per-GPU metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    /// The GPU's index on the node.
    pub gpu: String,
    /// Its UUID.
    pub uuid: String,
}

/// Labels of a per-GPU metric that names the model.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuModelLabels {
    /// The GPU's index on the node.
    pub gpu: String,
    /// Its UUID.
    pub uuid: String,
    /// Its product name (escaped for the text format).
    pub model: String,
}

/// Labels of a per-pod, per-GPU metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodGpuLabels {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The GPU's index on the node.
    pub gpu: String,
}

/// The label sets [`Metrics::record_usage`] exported, so that those of pods gone are removed
/// at the next measurement rather than left at their last value.
#[derive(Debug, Default)]
pub struct ExportedUsage {
    gpus: HashSet<GpuLabels>,
    pods: HashSet<PodGpuLabels>,
    containers: HashSet<ContainerUseLabels>,
}

fn bytes_gauge(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
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
            gpu_healthy: Family::default(),
            gpu_capacity_bytes: Family::default(),
            registrations: Counter::default(),
            pod_patches: Family::default(),
            node_patches: Family::default(),
            kubelet_mismatches: Family::default(),
            marks_from_kubelet: Counter::default(),
            pod_resources_up: Gauge::default(),
            pods_on_unhealthy_gpu: Counter::default(),
            evictions: Counter::default(),
            gpu_allocated_bytes: Family::default(),
            gpu_used_bytes: Family::default(),
            gpu_unattributed_bytes: Family::default(),
            pod_allocated_bytes: Family::default(),
            pod_used_bytes: Family::default(),
            pods_over_share: Gauge::default(),
            usage_patches: Family::default(),
            isolated_share_bytes: Family::default(),
            isolated_used_bytes: Family::default(),
            isolated_refused_allocations: Family::default(),
            container_used_bytes: Family::default(),
            container_over_share_bytes: Family::default(),
            over_share_episodes: Counter::default(),
            over_share_evictions: Counter::default(),
        };
        let sub = registry.sub_registry_with_prefix("gpushare_device_plugin");
        // In this order: it is the order of `/metrics`.
        metrics.register_allocate(sub);
        metrics.register_node(sub);
        metrics.register_kubelet(sub);
        metrics.register_usage(sub);
        metrics.register_over_share(registry);
        metrics
    }

    /// Registers the Allocate path's metrics.
    fn register_allocate(&self, sub: &mut Registry) {
        sub.register(
            "allocations",
            "Containers allocated",
            self.allocations.clone(),
        );
        sub.register(
            "allocate_errors",
            "Allocate calls refused, by reason",
            self.allocate_errors.clone(),
        );
        sub.register(
            "forged_allocations",
            "Allocate calls refused because the pod's allocation is not signed by the gpushare extender",
            self.forged_allocations.clone(),
        );
        sub.register(
            "allocate_duration_seconds",
            "Time to answer an Allocate call",
            self.allocate_duration.clone(),
        );
    }

    /// Registers the metrics of the node's GPUs, of the registration and of the plugin's API writes.
    fn register_node(&self, sub: &mut Registry) {
        sub.register("gpus_healthy", "Healthy GPUs", self.gpus_healthy.clone());
        sub.register("gpus", "GPUs on the node", self.gpus.clone());
        sub.register(
            "gpu_healthy",
            "1 while the GPU is healthy, 0 while it is withdrawn from kubelet (a critical XID, or the simulated health file)",
            self.gpu_healthy.clone(),
        );
        sub.register(
            "gpu_capacity_bytes",
            "Memory of each GPU the plugin offers kubelet (whole GiB, one device each), in bytes",
            self.gpu_capacity_bytes.clone(),
        );
        sub.register(
            "registrations",
            "Successful registrations with kubelet",
            self.registrations.clone(),
        );
        sub.register(
            "pod_patches",
            "Pod allocation-mark patches, by result",
            self.pod_patches.clone(),
        );
        sub.register(
            "node_patches",
            "Node inventory patches, by result",
            self.node_patches.clone(),
        );
    }

    /// Registers what kubelet's PodResources API and GPU health changes showed.
    fn register_kubelet(&self, sub: &mut Registry) {
        sub.register(
            "kubelet_mismatches",
            "Containers kubelet reports holding GPU memory devices their pod was not given, by kind (wrong_gpu: devices of another GPU than the pod's; no_allocation: a pod without its own gpushare allocation)",
            self.kubelet_mismatches.clone(),
        );
        sub.register(
            "marks_from_kubelet",
            "Pod allocation marks corrected from what kubelet's PodResources API reports containers hold",
            self.marks_from_kubelet.clone(),
        );
        sub.register(
            "pod_resources_up",
            "1 while kubelet's PodResources API answers, else 0 (marks are then reconciled from pod phases)",
            self.pod_resources_up.clone(),
        );
        sub.register(
            "pods_on_unhealthy_gpu",
            "Running pods whose GPU turned unhealthy (an Event and a pod condition each)",
            self.pods_on_unhealthy_gpu.clone(),
        );
        sub.register(
            "unhealthy_gpu_evictions",
            "Pods evicted because their GPU turned unhealthy (--evict-on-unhealthy)",
            self.evictions.clone(),
        );
    }

    /// Registers the GPU memory use metrics ([`crate::usage`]).
    fn register_usage(&self, sub: &mut Registry) {
        sub.register(
            "gpu_allocated_bytes",
            "GPU memory kubelet gave pods on each GPU (its PodResources API: one device per GiB)",
            self.gpu_allocated_bytes.clone(),
        );
        sub.register(
            "gpu_used_bytes",
            "GPU memory every process on each GPU uses (NVML process lists, or the simulated usage file)",
            self.gpu_used_bytes.clone(),
        );
        sub.register(
            "gpu_unattributed_bytes",
            "GPU memory used on each GPU by processes not traced to a gpushare pod (host processes, other pods, or all of them when the plugin cannot see the host's /proc)",
            self.gpu_unattributed_bytes.clone(),
        );
        sub.register(
            "pod_allocated_bytes",
            "GPU memory kubelet gave each pod on each GPU",
            self.pod_allocated_bytes.clone(),
        );
        sub.register(
            "pod_used_bytes",
            "GPU memory each pod's processes use on each GPU",
            self.pod_used_bytes.clone(),
        );
        sub.register(
            "isolated_share_bytes",
            "Each container's share of each GPU, as the isolation interposer holds it (isolation.mode preload)",
            self.isolated_share_bytes.clone(),
        );
        sub.register(
            "isolated_used_bytes",
            "GPU memory each container holds on each GPU, as the isolation interposer counted it",
            self.isolated_used_bytes.clone(),
        );
        sub.register(
            "isolated_refused_allocations",
            "Allocations the isolation interposer refused each container so far, because they would pass its share",
            self.isolated_refused_allocations.clone(),
        );
        sub.register(
            "pods_over_share",
            "Pods whose processes use more GPU memory than they were given on some GPU",
            self.pods_over_share.clone(),
        );
        sub.register(
            "usage_patches",
            "Node GPU usage annotation patches, by result",
            self.usage_patches.clone(),
        );
    }

    /// Registers the per-container figures of the over-share watch ([`crate::over_share`]):
    /// under `gpushare_container_*`, the names dashboards and alerts use whichever plugin
    /// exports them.
    fn register_over_share(&self, registry: &mut Registry) {
        let container = registry.sub_registry_with_prefix("gpushare_container");
        container.register(
            "gpu_memory_used_bytes",
            "GPU memory each pod's containers use on each GPU, by the driver's count (NVML process lists, or the simulated usage file); with the interposer alone, what it counted",
            self.container_used_bytes.clone(),
        );
        container.register(
            "over_share_bytes",
            "GPU memory each pod's containers use on each GPU past what kubelet gave the pod there (0 within the share)",
            self.container_over_share_bytes.clone(),
        );
        let plugin = registry.sub_registry_with_prefix("gpushare_device_plugin");
        plugin.register(
            "over_share_episodes",
            "Times a pod went over its share of a GPU (each told by a GpuMemoryOverShare Event)",
            self.over_share_episodes.clone(),
        );
        plugin.register(
            "over_share_evictions",
            "Pods evicted for staying over their share of a GPU past the grace period (--over-share evict)",
            self.over_share_evictions.clone(),
        );
    }

    /// Exports the node's GPUs as the inventory has them now: how many, how many healthy,
    /// each one's health and size. Called at start and on every health change; the set of
    /// GPUs is read once at start and never changes, so no series is ever left behind.
    pub fn record_gpus(&self, gpus: &[GpuInfo]) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.gpus.set(count(gpus.len()));
        self.gpus_healthy
            .set(count(gpus.iter().filter(|gpu| gpu.healthy).count()));
        for gpu in gpus {
            let labels = GpuLabels {
                gpu: gpu.index.to_string(),
                uuid: gpu.uuid.clone(),
            };
            self.gpu_healthy
                .get_or_create(&labels)
                .set(i64::from(gpu.healthy));
            let labels = GpuModelLabels {
                gpu: labels.gpu,
                uuid: labels.uuid,
                model: label_value(&gpu.model).into_owned(),
            };
            self.gpu_capacity_bytes
                .get_or_create(&labels)
                .set(bytes_gauge(gpu.mem_gib.saturating_mul(1 << 30)));
        }
    }

    /// Exports a usage measurement, removing the label sets of `previous` that are gone;
    /// returns what is exported now.
    pub fn record_usage(&self, report: &Report, previous: ExportedUsage) -> ExportedUsage {
        let mut now = ExportedUsage::default();
        for gpu in &report.gpus {
            let labels = GpuLabels {
                gpu: gpu.index.to_string(),
                uuid: gpu.uuid.clone(),
            };
            self.gpu_allocated_bytes
                .get_or_create(&labels)
                .set(bytes_gauge(gpu.allocated));
            self.gpu_used_bytes
                .get_or_create(&labels)
                .set(bytes_gauge(gpu.used));
            self.gpu_unattributed_bytes
                .get_or_create(&labels)
                .set(bytes_gauge(gpu.unattributed));
            now.gpus.insert(labels);
        }
        for (key, gpus) in &report.pods {
            let (namespace, pod) = key.split_once('/').unwrap_or(("", key));
            for (index, held) in gpus {
                let labels = PodGpuLabels {
                    namespace: namespace.to_owned(),
                    pod: pod.to_owned(),
                    gpu: index.to_string(),
                };
                self.pod_allocated_bytes
                    .get_or_create(&labels)
                    .set(bytes_gauge(held.allocated));
                self.pod_used_bytes
                    .get_or_create(&labels)
                    .set(bytes_gauge(held.used));
                now.pods.insert(labels);
                let labels = ContainerUseLabels {
                    namespace: namespace.to_owned(),
                    pod: pod.to_owned(),
                    container: report.containers_of(key, *index).to_owned(),
                    gpu: index.to_string(),
                };
                self.container_used_bytes
                    .get_or_create(&labels)
                    .set(bytes_gauge(held.used));
                self.container_over_share_bytes
                    .get_or_create(&labels)
                    .set(bytes_gauge(held.over_share()));
                now.containers.insert(labels);
            }
        }
        self.pods_over_share
            .set(i64::try_from(report.over_share().len()).unwrap_or(i64::MAX));
        for gone in previous.gpus.difference(&now.gpus) {
            self.gpu_allocated_bytes.remove(gone);
            self.gpu_used_bytes.remove(gone);
            self.gpu_unattributed_bytes.remove(gone);
        }
        for gone in previous.pods.difference(&now.pods) {
            self.pod_allocated_bytes.remove(gone);
            self.pod_used_bytes.remove(gone);
        }
        for gone in previous.containers.difference(&now.containers) {
            self.container_used_bytes.remove(gone);
            self.container_over_share_bytes.remove(gone);
        }
        now
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
/// `listener` until `shutdown`, on the accept loop every gpushare server runs
/// (`gpushare_runtime::http`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    gpushare_runtime::http::Server::new(listener, router(registry, ready))
        .serve(shutdown.cancelled_owned())
        .await;
    Ok(())
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

    #[tokio::test]
    async fn usage_is_exported_and_pods_gone_disappear() {
        use crate::attribution::{GpuMemory, Held};
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let app = router(Arc::new(registry), Arc::new(AtomicBool::new(true)));
        let gib = 1u64 << 30;
        let report = |pods: &[(&str, u64, u64)]| Report {
            gpus: vec![GpuMemory {
                index: 0,
                uuid: "GPU-0".into(),
                allocated: pods.iter().map(|p| p.1).sum(),
                used: pods.iter().map(|p| p.2).sum(),
                unattributed: 0,
            }],
            pods: pods
                .iter()
                .map(|&(key, allocated, used)| {
                    (
                        key.to_owned(),
                        [(
                            0,
                            Held {
                                allocated,
                                used,
                                counted: None,
                            },
                        )]
                        .into(),
                    )
                })
                .collect(),
            unknown_pids: 0,
            containers: [(("default/a".to_owned(), 0), "main".to_owned())].into(),
        };
        let exported = metrics.record_usage(
            &report(&[("default/a", 2 * gib, 5 * gib), ("ml/b", 4 * gib, gib)]),
            ExportedUsage::default(),
        );
        let (_, body) = get(app.clone(), "/metrics").await;
        for line in [
            "gpushare_device_plugin_gpu_allocated_bytes{gpu=\"0\",uuid=\"GPU-0\"} 6442450944",
            "gpushare_device_plugin_gpu_used_bytes{gpu=\"0\",uuid=\"GPU-0\"} 6442450944",
            "gpushare_device_plugin_pod_allocated_bytes{namespace=\"default\",pod=\"a\",gpu=\"0\"} 2147483648",
            "gpushare_device_plugin_pod_used_bytes{namespace=\"default\",pod=\"a\",gpu=\"0\"} 5368709120",
            "gpushare_device_plugin_pod_used_bytes{namespace=\"ml\",pod=\"b\",gpu=\"0\"} 1073741824",
            "gpushare_device_plugin_pods_over_share 1",
            "gpushare_container_gpu_memory_used_bytes{namespace=\"default\",pod=\"a\",container=\"main\",gpu=\"0\"} 5368709120",
            "gpushare_container_over_share_bytes{namespace=\"default\",pod=\"a\",container=\"main\",gpu=\"0\"} 3221225472",
            "gpushare_container_over_share_bytes{namespace=\"ml\",pod=\"b\",container=\"\",gpu=\"0\"} 0",
        ] {
            assert!(
                body.lines().any(|l| l == line),
                "{line} missing from\n{body}"
            );
        }
        metrics.record_usage(&report(&[("ml/b", 4 * gib, gib)]), exported);
        let (_, body) = get(app, "/metrics").await;
        assert!(!body.contains("pod=\"a\""), "{body}");
        assert!(body.contains("pod=\"b\""), "{body}");
        assert!(
            body.lines()
                .any(|l| l == "gpushare_device_plugin_pods_over_share 0"),
            "{body}"
        );
    }
}
