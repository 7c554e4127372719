//! The node's GPU inventory, published by the device plugin in the node annotation
//! `<domain>/v1.gpus` and read by the extender.
//!
//! ```json
//! [{"index":0,"uuid":"GPU-8f0c…","model":"Tesla T4","memGiB":15,"healthy":true,"numaNode":0}]
//! ```
//!
//! Each GPU carries its own size: nodes with mixed GPUs are normal. `healthy: false` means
//! the device plugin saw a critical XID on it; the extender places nothing new there.

use serde::{Deserialize, Serialize};

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

    #[test]
    fn gib_rounds_down() {
        assert_eq!(gib_from_bytes(16 << 30), 16);
        assert_eq!(gib_from_bytes((16 << 30) - 1), 15);
        // A "16 GB" T4 reports 15360 MiB.
        assert_eq!(gib_from_bytes(15360 << 20), 15);
    }
}
