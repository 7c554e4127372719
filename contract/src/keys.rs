//! Annotation and label keys, built once from a configurable domain.
//!
//! All keys carry the contract version (`<domain>/v1.<name>`), so a future incompatible
//! format can live beside this one during an upgrade.

use crate::{CONTRACT_VERSION, DEFAULT_DOMAIN};

/// Every key gpushare reads or writes, for one domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    /// Pod: index of the GPU the extender chose (decimal).
    pub gpu_index: String,
    /// Pod: UUID of that GPU, from the node's inventory (empty when the node published none).
    pub gpu_uuid: String,
    /// Pod: GiB the whole pod holds on its GPU (decimal).
    pub pod_gib: String,
    /// Pod: JSON list of the containers that asked for GPU memory, in kubelet's admission order.
    pub containers: String,
    /// Pod: RFC 3339 time of the bind decision.
    pub bind_time: String,
    /// Pod: `"true"` once the device plugin has allocated every container, else `"false"`.
    pub assigned: String,
    /// Pod: comma-separated names of the containers the device plugin has allocated so far.
    pub allocated: String,
    /// Pod: the extender's signature of its decision, `<key-id>:<base64>`
    /// (see [`crate::signature`]).
    pub signature: String,
    /// Pod: `"true"` when the pod holds its GPUs whole, alone (written by the extender only
    /// then; see [`crate::PodAllocation::exclusive`]).
    pub exclusive: String,
    /// Pod: percent of each of its GPUs' compute the pod holds (decimal; written only when
    /// the pod asked for compute, see [`crate::request`]).
    pub compute: String,
    /// Pod, set by the user: over how many GPUs of one node the pod's GPU memory is spread,
    /// evenly (`<domain>/gpus: "2"`; absent means one). See [`crate::request`].
    pub request_gpus: String,
    /// Pod, set by the user: `"true"` to take whole GPUs, never shared
    /// (`<domain>/exclusive`). See [`crate::request`].
    pub request_exclusive: String,
    /// Pod, set by the user: GPU models the pod may get, comma-separated, `!` refusing one
    /// (`<domain>/gpu-model: "NVIDIA-A100-SXM4-80GB,!Tesla-T4"`). See [`crate::request`].
    pub request_models: String,
    /// Node: JSON list of [`crate::GpuInfo`], published by the device plugin.
    pub node_gpus: String,
    /// Node: GPU memory measured in use per GPU and per pod ([`crate::usage`]), published
    /// by the device plugin when it changed noticeably.
    pub node_usage: String,
    /// Node label: number of GPUs the device plugin found.
    pub node_gpu_count: String,
    /// Node labels `<prefix><model>: "true"`, one per GPU model on the node (see
    /// [`Keys::gpu_model_label`]), for node affinity on models.
    pub node_gpu_model_prefix: String,
    /// Node labels `<prefix><GiB>: "true"`, one per GPU memory size on the node.
    pub node_gpu_mem_prefix: String,
    /// Node taint (`PreferNoSchedule`, no value) the extender keeps on nodes with an idle
    /// GPU, so that pods asking for no GPU prefer the other nodes.
    pub node_idle_gpu_taint: String,
}

impl Keys {
    /// Keys under `domain` (for example `gpushare.example.com`).
    pub fn new(domain: &str) -> Self {
        let key = |name: &str| format!("{domain}/{CONTRACT_VERSION}.{name}");
        Self {
            gpu_index: key("gpu-index"),
            gpu_uuid: key("gpu-uuid"),
            pod_gib: key("pod-gib"),
            containers: key("containers"),
            bind_time: key("bind-time"),
            assigned: key("assigned"),
            allocated: key("allocated"),
            signature: key("signature"),
            exclusive: key("exclusive"),
            compute: key("compute"),
            request_gpus: format!("{domain}/gpus"),
            request_exclusive: format!("{domain}/exclusive"),
            request_models: format!("{domain}/gpu-model"),
            node_gpus: key("gpus"),
            node_usage: key("usage"),
            node_gpu_count: format!("{domain}/gpu-count"),
            node_gpu_model_prefix: format!("{domain}/gpu-model."),
            node_gpu_mem_prefix: format!("{domain}/gpu-mem-gib."),
            node_idle_gpu_taint: format!("{domain}/idle-gpu"),
        }
    }

    /// The node label naming GPU `model`: `<domain>/gpu-model.<model>`, the model's name with
    /// every character a label name cannot hold turned into `-` (`NVIDIA A10G` →
    /// `gpu-model.NVIDIA-A10G`), trimmed to a valid label name.
    pub fn gpu_model_label(&self, model: &str) -> String {
        let room = 63 - "gpu-model.".len();
        let cleaned: String = model
            .trim()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '-'
                }
            })
            .take(room)
            .collect();
        let cleaned = cleaned.trim_matches(|c: char| !c.is_ascii_alphanumeric());
        let cleaned = if cleaned.is_empty() {
            "unknown"
        } else {
            cleaned
        };
        format!("{}{cleaned}", self.node_gpu_model_prefix)
    }

    /// The node label of a GPU memory size: `<domain>/gpu-mem-gib.<GiB>`.
    pub fn gpu_mem_label(&self, gib: u64) -> String {
        format!("{}{gib}", self.node_gpu_mem_prefix)
    }

    /// The keys of the allocation decision itself, which only the extender may write.
    /// Values a user set on these before bind are ignored and overwritten.
    pub fn allocation_keys(&self) -> [&str; 10] {
        [
            &self.gpu_index,
            &self.gpu_uuid,
            &self.pod_gib,
            &self.containers,
            &self.bind_time,
            &self.assigned,
            &self.allocated,
            &self.signature,
            &self.exclusive,
            &self.compute,
        ]
    }
}

impl Default for Keys {
    fn default() -> Self {
        Self::new(DEFAULT_DOMAIN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_versioned_under_the_domain() {
        let keys = Keys::new("gpu.acme.io");
        assert_eq!(keys.gpu_index, "gpu.acme.io/v1.gpu-index");
        assert_eq!(keys.node_gpus, "gpu.acme.io/v1.gpus");
        assert_eq!(keys.signature, "gpu.acme.io/v1.signature");
        assert_eq!(keys.node_gpu_count, "gpu.acme.io/gpu-count");
        assert_eq!(keys.exclusive, "gpu.acme.io/v1.exclusive");
        assert_eq!(keys.compute, "gpu.acme.io/v1.compute");
        assert_eq!(keys.request_gpus, "gpu.acme.io/gpus");
        assert_eq!(keys.request_exclusive, "gpu.acme.io/exclusive");
        assert_eq!(
            keys.gpu_model_label("NVIDIA A10G"),
            "gpu.acme.io/gpu-model.NVIDIA-A10G"
        );
        assert_eq!(
            keys.gpu_model_label(" Tesla V100-SXM2-16GB (rev. a) "),
            "gpu.acme.io/gpu-model.Tesla-V100-SXM2-16GB--rev.-a"
        );
        assert_eq!(keys.gpu_model_label("***"), "gpu.acme.io/gpu-model.unknown");
        let long = keys.gpu_model_label(&"x".repeat(100));
        assert_eq!(long.split_once('/').map(|(_, name)| name.len()), Some(63));
        assert_eq!(keys.gpu_mem_label(24), "gpu.acme.io/gpu-mem-gib.24");
        assert!(
            keys.allocation_keys()
                .iter()
                .all(|k| k.starts_with("gpu.acme.io/v1."))
        );
    }
}
