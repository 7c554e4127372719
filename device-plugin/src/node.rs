//! The node's GPU inventory: kept current from the backend's health reports and published
//! on the Node for the extender (annotation `<domain>/v1.gpus`, label `<domain>/gpu-count`)
//! and for people's node affinity (labels `<domain>/gpu-model.<model>` and
//! `<domain>/gpu-mem-gib.<GiB>`, one per model and size present).
//!
//! The inventory lives in a `watch` channel: ListAndWatch streams, Allocate and the
//! publisher all read the same value, so kubelet and the extender never see two different
//! healths for one GPU for longer than a write takes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpushare_contract::{GpuInfo, Keys, inventory};
use gpushare_runtime::gpu::{BackendError, GpuBackend};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// The current GPUs; every reader subscribes.
pub type Inventory = watch::Sender<Arc<Vec<GpuInfo>>>;

/// How long to wait before retrying a failed Node patch.
const RETRY: Duration = Duration::from_secs(1);

/// Records `healthy` for GPU `index`; returns whether anything changed.
pub fn set_health(inventory: &Inventory, index: u32, healthy: bool) -> bool {
    inventory.send_if_modified(
        |gpus| match gpus.iter().position(|gpu| gpu.index == index) {
            Some(pos) if gpus[pos].healthy != healthy => {
                Arc::make_mut(gpus)[pos].healthy = healthy;
                true
            }
            _ => false,
        },
    )
}

/// Runs the backend's blocking health watch on a blocking thread until `shutdown`, applying
/// its reports to `inventory` and to the GPU metrics ([`Metrics::record_gpus`]).
pub async fn watch_health(
    backend: Arc<dyn GpuBackend>,
    inventory: Inventory,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<(), BackendError> {
    /// Stops the blocking loop however this future ends, even when it is dropped.
    struct StopOnDrop(Arc<AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let _guard = StopOnDrop(stop.clone());
    metrics.record_gpus(&inventory.borrow());
    let blocking_stop = stop.clone();
    let mut task = tokio::task::spawn_blocking(move || {
        backend.watch_health(&blocking_stop, &mut |index, healthy| {
            if set_health(&inventory, index, healthy) {
                if healthy {
                    tracing::info!(gpu = index, "GPU is healthy again");
                } else {
                    tracing::warn!(gpu = index, "GPU is unhealthy; its devices are withdrawn");
                }
                metrics.record_gpus(&inventory.borrow());
            }
        })
    });
    tokio::select! {
        () = shutdown.cancelled() => {
            stop.store(true, Ordering::Relaxed);
            Ok(())
        }
        result = &mut task => match result {
            Ok(result) => result,
            // The health loop never panics on its own; if it did, the plugin must not go
            // on reporting stale health.
            Err(join) => {
                tracing::error!(error = %join, "GPU health watch crashed");
                Ok(())
            }
        },
    }
}

/// The labels the plugin keeps on its Node for `gpus`, as a merge patch over a node now
/// labelled `current`: the GPU count, one `gpu-model.<model>` and one `gpu-mem-gib.<GiB>`
/// label per model and size present (for node affinity), and `null` for such labels of GPUs
/// that are gone.
pub fn node_labels<'a>(
    keys: &Keys,
    gpus: &[GpuInfo],
    current: impl IntoIterator<Item = &'a String>,
) -> serde_json::Map<String, serde_json::Value> {
    use serde_json::Value;
    let mut labels = serde_json::Map::new();
    for key in current {
        if key.starts_with(&keys.node_gpu_model_prefix)
            || key.starts_with(&keys.node_gpu_mem_prefix)
        {
            labels.insert(key.clone(), Value::Null);
        }
    }
    for gpu in gpus {
        labels.insert(keys.gpu_model_label(&gpu.model), Value::from("true"));
        labels.insert(keys.gpu_mem_label(gpu.mem_gib), Value::from("true"));
    }
    labels.insert(
        keys.node_gpu_count.clone(),
        Value::from(gpus.len().to_string()),
    );
    labels
}

/// How often the publisher looks whether the plugin serves kubelet (see [`publish`]).
const SERVING_POLL: Duration = Duration::from_millis(200);
/// Longest the last write, at shutdown, may take.
const LAST_WRITE: Duration = Duration::from_secs(2);

/// The inventory as published: every GPU unhealthy while no plugin serves kubelet.
pub fn as_published(gpus: &[GpuInfo], serving: bool) -> Vec<GpuInfo> {
    gpus.iter()
        .map(|gpu| GpuInfo {
            healthy: gpu.healthy && serving,
            ..gpu.clone()
        })
        .collect()
}

/// Writes the inventory onto the Node now and after every change, until `shutdown`; then
/// once more with every GPU unhealthy.
///
/// Why a GPU reads unhealthy while the plugin does not serve: kubelet refuses a GPU pod it
/// admits while no plugin of the resource is registered, or before the plugin's device list
/// arrived ("no healthy devices present"), and the pod fails. On the real cluster a pod the
/// extender bound right after `helm install` hit the old inventory, left healthy by the
/// uninstalled plugin, before the new plugin had registered. So the inventory shows its GPUs
/// healthy only while `serving` (registered, and kubelet has the device list), and the
/// plugin marks them unhealthy as it stops: the extender places nothing on the node in
/// between. Pods already running are not touched (their memory stays booked).
pub async fn publish(
    client: Client,
    node: String,
    keys: Keys,
    mut inventory: watch::Receiver<Arc<Vec<GpuInfo>>>,
    serving: Arc<AtomicBool>,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let api: Api<Node> = Api::all(client);
    let mut last: Option<(Arc<Vec<GpuInfo>>, bool)> = None;
    loop {
        let gpus = inventory.borrow_and_update().clone();
        let now_serving = serving.load(Ordering::Relaxed);
        let state = (gpus.clone(), now_serving);
        let written = if last.as_ref() == Some(&state) {
            true
        } else {
            let written = write(&api, &node, &keys, &gpus, now_serving, &metrics).await;
            if written {
                last = Some(state);
            }
            written
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            changed = inventory.changed() => if changed.is_err() { break },
            () = tokio::time::sleep(if written { SERVING_POLL } else { RETRY }) => {}
        }
    }
    let gpus = inventory.borrow().clone();
    let stopped = write(&api, &node, &keys, &gpus, false, &metrics);
    if tokio::time::timeout(LAST_WRITE, stopped).await.is_err() {
        tracing::warn!(%node, "could not mark the GPUs unavailable on the node before stopping");
    }
}

/// One write of the inventory (as [`as_published`] shows it) and the node's GPU labels.
async fn write(
    api: &Api<Node>,
    node: &str,
    keys: &Keys,
    gpus: &[GpuInfo],
    serving: bool,
    metrics: &Metrics,
) -> bool {
    // Model and size labels of GPUs no longer here (replaced while the plugin was down, or
    // since) are removed: read what the node carries now.
    let current = match api.get(node).await {
        Ok(found) => found.metadata.labels.unwrap_or_default(),
        Err(err) => {
            tracing::debug!(%node, error = %err, "cannot read the node's labels; stale GPU model labels stay");
            Default::default()
        }
    };
    let shown = as_published(gpus, serving);
    let patch = serde_json::json!({
        "metadata": {
            "annotations": { keys.node_gpus.as_str(): inventory::encode(&shown) },
            "labels": node_labels(keys, gpus, current.keys()),
        }
    });
    let written = match api
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            tracing::info!(%node, gpus = gpus.len(), healthy = shown.iter().filter(|gpu| gpu.healthy).count(), serving, "published GPU inventory");
            true
        }
        Err(err) => {
            tracing::warn!(%node, error = %err, "cannot publish GPU inventory on the node; retrying");
            false
        }
    };
    Metrics::patch(&metrics.node_patches, written);
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, model: &str, mem_gib: u64) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: model.to_owned(),
            mem_gib,
            healthy: true,
            numa_node: None,
        }
    }

    /// A backend whose health watch reports GPU 1 unhealthy, then ends.
    struct OneFailure;

    impl GpuBackend for OneFailure {
        fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
            Ok(vec![gpu(0, "Tesla T4", 15), gpu(1, "Tesla T4", 15)])
        }

        fn watch_health(
            &self,
            _stop: &AtomicBool,
            report: &mut dyn FnMut(u32, bool),
        ) -> Result<(), BackendError> {
            report(1, false);
            Ok(())
        }
    }

    /// The served text of `registry`'s samples.
    fn samples(registry: &prometheus_client::registry::Registry) -> Vec<String> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }

    #[tokio::test]
    async fn the_health_watch_exports_each_gpu_its_health_and_the_count() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Metrics::new(&mut registry);
        let backend = Arc::new(OneFailure);
        let inventory = Inventory::new(Arc::new(backend.gpus().unwrap()));
        let token = CancellationToken::new();
        watch_health(backend, inventory.clone(), metrics, token)
            .await
            .unwrap();

        assert!(!inventory.borrow()[1].healthy);
        let samples = samples(&registry);
        for line in [
            "gpushare_device_plugin_gpus 2",
            "gpushare_device_plugin_gpus_healthy 1",
            "gpushare_device_plugin_gpu_healthy{gpu=\"0\",uuid=\"GPU-0\"} 1",
            "gpushare_device_plugin_gpu_healthy{gpu=\"1\",uuid=\"GPU-1\"} 0",
            "gpushare_device_plugin_gpu_capacity_bytes{gpu=\"1\",uuid=\"GPU-1\",model=\"Tesla T4\"} 16106127360",
        ] {
            assert!(
                samples.iter().any(|l| l == line),
                "{line} missing from {samples:#?}"
            );
        }
    }

    #[test]
    fn no_gpu_is_published_healthy_while_the_plugin_does_not_serve() {
        let mut broken = gpu(1, "Tesla T4", 15);
        broken.healthy = false;
        let gpus = [gpu(0, "Tesla T4", 15), broken];
        let healthy = |shown: Vec<GpuInfo>| shown.iter().map(|g| g.healthy).collect::<Vec<_>>();
        assert_eq!(healthy(as_published(&gpus, true)), [true, false]);
        assert_eq!(healthy(as_published(&gpus, false)), [false, false]);
        assert_eq!(as_published(&gpus, false)[0].uuid, "GPU-0");
    }

    #[test]
    fn labels_name_each_model_and_size_and_drop_those_gone() {
        let keys = Keys::new("gpushare.example.com");
        let gpus = [
            gpu(0, "Tesla T4", 15),
            gpu(1, "NVIDIA A10", 24),
            gpu(2, "Tesla T4", 15),
        ];
        let current = [
            "gpushare.example.com/gpu-model.Tesla-V100".to_owned(),
            "gpushare.example.com/gpu-model.Tesla-T4".to_owned(),
            "gpushare.example.com/gpu-mem-gib.16".to_owned(),
            "kubernetes.io/hostname".to_owned(),
        ];
        let labels = node_labels(&keys, &gpus, current.iter());
        let want = serde_json::json!({
            "gpushare.example.com/gpu-model.Tesla-T4": "true",
            "gpushare.example.com/gpu-model.NVIDIA-A10": "true",
            "gpushare.example.com/gpu-mem-gib.15": "true",
            "gpushare.example.com/gpu-mem-gib.24": "true",
            "gpushare.example.com/gpu-model.Tesla-V100": null,
            "gpushare.example.com/gpu-mem-gib.16": null,
            "gpushare.example.com/gpu-count": "3",
        });
        assert_eq!(serde_json::Value::Object(labels), want);
    }
}
