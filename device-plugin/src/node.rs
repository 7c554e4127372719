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
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::backend::{BackendError, GpuBackend};
use crate::metrics::Metrics;

/// The current GPUs; every reader subscribes.
pub type Inventory = watch::Sender<Arc<Vec<GpuInfo>>>;

/// How long to wait before retrying a failed Node patch.
const RETRY: Duration = Duration::from_secs(1);

fn count_healthy(gpus: &[GpuInfo]) -> i64 {
    i64::try_from(gpus.iter().filter(|gpu| gpu.healthy).count()).unwrap_or(i64::MAX)
}

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
/// its reports to `inventory`.
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
    metrics.gpus_healthy.set(count_healthy(&inventory.borrow()));
    let blocking_stop = stop.clone();
    let mut task = tokio::task::spawn_blocking(move || {
        backend.watch_health(&blocking_stop, &mut |index, healthy| {
            if set_health(&inventory, index, healthy) {
                if healthy {
                    tracing::info!(gpu = index, "GPU is healthy again");
                } else {
                    tracing::warn!(gpu = index, "GPU is unhealthy; its devices are withdrawn");
                }
                metrics.gpus_healthy.set(count_healthy(&inventory.borrow()));
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

/// Writes the inventory onto the Node now and after every change, until `shutdown`.
pub async fn publish(
    client: Client,
    node: String,
    keys: Keys,
    mut inventory: watch::Receiver<Arc<Vec<GpuInfo>>>,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let api: Api<Node> = Api::all(client);
    loop {
        let gpus = inventory.borrow_and_update().clone();
        // Model and size labels of GPUs no longer here (replaced while the plugin was down,
        // or since) are removed: read what the node carries now.
        let current = match api.get(&node).await {
            Ok(found) => found.metadata.labels.unwrap_or_default(),
            Err(err) => {
                tracing::debug!(%node, error = %err, "cannot read the node's labels; stale GPU model labels stay");
                Default::default()
            }
        };
        let patch = serde_json::json!({
            "metadata": {
                "annotations": { keys.node_gpus.as_str(): inventory::encode(&gpus) },
                "labels": node_labels(&keys, &gpus, current.keys()),
            }
        });
        let written = match api
            .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::info!(%node, gpus = gpus.len(), healthy = count_healthy(&gpus), "published GPU inventory");
                true
            }
            Err(err) => {
                tracing::warn!(%node, error = %err, "cannot publish GPU inventory on the node; retrying");
                false
            }
        };
        Metrics::patch(&metrics.node_patches, written);
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = inventory.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(RETRY), if !written => {}
        }
    }
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
