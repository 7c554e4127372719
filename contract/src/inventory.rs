//! The node's GPU inventory, published by the device plugin in the node annotation
//! `<domain>/v1.gpus` and read by the extender.
//!
//! ```json
//! [{"index":0,"uuid":"GPU-8f0c…","model":"Tesla T4","memGiB":15,"healthy":true,"numaNode":0}]
//! ```
//!
//! Each GPU carries its own size: nodes with mixed GPUs are normal. `healthy: false` means
//! the device plugin saw a critical XID on it; the extender places nothing new there.

use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use crate::Keys;

/// One GPU as the device plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    /// The GPU's index on the node (NVML index), the number users see in `nvidia-smi`.
    pub index: u32,
    /// The GPU's UUID (`GPU-…`), the value of `NVIDIA_VISIBLE_DEVICES`.
    pub uuid: String,
    /// Product name, for people reading `inspect` output.
    #[serde(default)]
    pub model: String,
    /// Whole GiB of memory: `floor(bytes / 2^30)`.
    #[serde(rename = "memGiB")]
    pub mem_gib: u64,
    /// False while the GPU is unusable (critical XID seen).
    pub healthy: bool,
    /// NUMA node, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i64>,
}

/// Why an inventory annotation could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// The annotation is not the JSON list described in this module.
    #[error("GPU inventory annotation is not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    /// Two entries claim the same GPU index.
    #[error("GPU inventory lists GPU index {0} twice")]
    DuplicateIndex(u32),
}

/// Whole GiB in `bytes` of GPU memory, as advertised: `floor(bytes / 2^30)`.
pub fn gib_from_bytes(bytes: u64) -> u64 {
    bytes >> 30
}

/// Renders an inventory for the node annotation.
pub fn encode(gpus: &[GpuInfo]) -> String {
    // A Vec of plain structs always serializes.
    serde_json::to_string(gpus).unwrap_or_else(|_| "[]".to_owned())
}

/// Reads the node annotation back, sorted by index.
pub fn decode(text: &str) -> Result<Vec<GpuInfo>, InventoryError> {
    let mut gpus: Vec<GpuInfo> = serde_json::from_str(text).map_err(InventoryError::Json)?;
    gpus.sort_by_key(|gpu| gpu.index);
    if let Some(pair) = gpus.windows(2).find(|pair| pair[0].index == pair[1].index) {
        return Err(InventoryError::DuplicateIndex(pair[0].index));
    }
    Ok(gpus)
}

/// The node's inventory annotation, if it has one: `None` without, `Some(Err)` when unreadable.
pub fn from_node(node: &Node, keys: &Keys) -> Option<Result<Vec<GpuInfo>, InventoryError>> {
    let text = node.metadata.annotations.as_ref()?.get(&keys.node_gpus)?;
    Some(decode(text))
}

/// Where a node's GPU list came from ([`read`]).
#[derive(Debug)]
pub enum Source {
    /// The device plugin's inventory annotation.
    Inventory,
    /// Capacity split over the GPU-count label: no inventory yet.
    Capacity,
    /// The inventory annotation is present but unreadable; the GPUs are the capacity's.
    Unreadable(InventoryError),
    /// Neither inventory nor capacity: no GPUs.
    None,
}

/// A node's GPUs as gpushare schedules on them: the inventory annotation, or else (absent or
/// unreadable) its capacity of `resource` ([`from_capacity`]). The one reading shared by the
/// extender, which places pods on it, and `kubectl gpushare`, which shows it: the two cannot
/// disagree about a node with a malformed annotation.
pub fn read(node: &Node, keys: &Keys, resource: &str) -> (Vec<GpuInfo>, Source) {
    let unreadable = match from_node(node, keys) {
        Some(Ok(gpus)) => return (gpus, Source::Inventory),
        Some(Err(error)) => Some(error),
        None => None,
    };
    let gpus = from_capacity(node, keys, resource);
    let source = match unreadable {
        Some(error) => Source::Unreadable(error),
        None if gpus.is_empty() => Source::None,
        None => Source::Capacity,
    };
    (gpus, source)
}

/// A node's GPUs from its capacity of `resource` alone, for a node whose device plugin has
/// not published an inventory: capacity split evenly over the `gpu-count` label (one GPU when
/// the label is absent), healthy, with no UUID. Empty when the node advertises none.
pub fn from_capacity(node: &Node, keys: &Keys, resource: &str) -> Vec<GpuInfo> {
    let capacity = node
        .status
        .as_ref()
        .and_then(|status| status.capacity.as_ref())
        .and_then(|capacity| capacity.get(resource))
        .and_then(|quantity| quantity.0.trim().parse::<u64>().ok())
        .unwrap_or(0);
    if capacity == 0 {
        return Vec::new();
    }
    let count = node
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(&keys.node_gpu_count))
        .and_then(|value| value.trim().parse::<u32>().ok())
        .filter(|&count| count > 0)
        .unwrap_or(1);
    (0..count)
        .map(|index| GpuInfo {
            index,
            uuid: String::new(),
            model: String::new(),
            mem_gib: capacity / u64::from(count),
            healthy: true,
            numa_node: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, mem_gib: u64) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "Tesla T4".into(),
            mem_gib,
            healthy: true,
            numa_node: None,
        }
    }

    #[test]
    fn round_trips_and_sorts_by_index() {
        let text = encode(&[gpu(1, 24), gpu(0, 16)]);
        assert!(text.contains("\"memGiB\":24"), "{text}");
        let back = decode(&text).unwrap();
        assert_eq!(back, vec![gpu(0, 16), gpu(1, 24)]);
    }

    #[test]
    fn rejects_garbage_and_duplicates() {
        assert!(matches!(decode("{nope"), Err(InventoryError::Json(_))));
        let dup = encode(&[gpu(0, 16), gpu(0, 16)]);
        assert!(matches!(
            decode(&dup),
            Err(InventoryError::DuplicateIndex(0))
        ));
    }

    /// The extender and kubectl read a node alike: the inventory when readable, else the
    /// capacity, saying why.
    #[test]
    fn read_falls_back_to_capacity_and_says_when_the_inventory_is_unreadable() {
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let keys = Keys::default();
        let resource = "example.com/gpu-mem";
        let mut node = Node::default();
        assert!(matches!(read(&node, &keys, resource), (gpus, Source::None) if gpus.is_empty()));
        node.status = Some(k8s_openapi::api::core::v1::NodeStatus {
            capacity: Some([(resource.to_owned(), Quantity("16".into()))].into()),
            ..Default::default()
        });
        assert!(
            matches!(read(&node, &keys, resource), (gpus, Source::Capacity) if gpus.len() == 1)
        );
        node.metadata.annotations = Some([(keys.node_gpus.clone(), "{nope".to_owned())].into());
        let (gpus, source) = read(&node, &keys, resource);
        assert_eq!(gpus.len(), 1);
        assert!(
            matches!(source, Source::Unreadable(InventoryError::Json(_))),
            "{source:?}"
        );
        node.metadata.annotations =
            Some([(keys.node_gpus.clone(), encode(&[gpu(0, 15), gpu(1, 15)]))].into());
        let (gpus, source) = read(&node, &keys, resource);
        assert!(matches!(source, Source::Inventory));
        assert_eq!(gpus, vec![gpu(0, 15), gpu(1, 15)]);
    }

    #[test]
    fn gib_rounds_down() {
        assert_eq!(gib_from_bytes(16 << 30), 16);
        assert_eq!(gib_from_bytes((16 << 30) - 1), 15);
        // A "16 GB" T4 reports 15360 MiB.
        assert_eq!(gib_from_bytes(15360 << 20), 15);
    }

    #[test]
    fn capacity_fallback_splits_evenly_over_the_gpu_count_label() {
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let keys = Keys::default();
        let mut node = Node::default();
        assert!(from_node(&node, &keys).is_none());
        assert!(from_capacity(&node, &keys, "example.com/gpu-mem").is_empty());
        node.status = Some(k8s_openapi::api::core::v1::NodeStatus {
            capacity: Some([("example.com/gpu-mem".to_owned(), Quantity("32".into()))].into()),
            ..Default::default()
        });
        assert_eq!(from_capacity(&node, &keys, "example.com/gpu-mem").len(), 1);
        node.metadata.labels = Some([(keys.node_gpu_count.clone(), "2".to_owned())].into());
        let gpus = from_capacity(&node, &keys, "example.com/gpu-mem");
        assert_eq!(
            gpus.iter()
                .map(|g| (g.index, g.mem_gib))
                .collect::<Vec<_>>(),
            vec![(0, 16), (1, 16)]
        );
        node.metadata.annotations = Some([(keys.node_gpus.clone(), encode(&[gpu(0, 24)]))].into());
        assert_eq!(from_node(&node, &keys).unwrap().unwrap(), vec![gpu(0, 24)]);
    }
}
