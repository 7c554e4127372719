//! GPUs as kubelet sees them: one device per whole GiB.
//!
//! GPU `GPU-abc` with 16 GiB becomes devices `GPU-abc-0` … `GPU-abc-15`. The IDs are only
//! tokens for kubelet's accounting (a container asking for 4 GiB gets 4 of them); which GPU
//! the container really uses is decided by the extender's annotation, not by which tokens
//! kubelet happened to pick.

use gpushare_contract::GpuInfo;
use gpushare_proto::v1beta1::{Device, NumaNode, TopologyInfo};
use gpushare_proto::{HEALTHY, UNHEALTHY};

/// The ID of slot `slot` of the GPU `uuid`.
pub fn device_id(uuid: &str, slot: u64) -> String {
    format!("{uuid}-{slot}")
}

/// Every device of every GPU, health and NUMA node taken from the GPU.
pub fn device_list(gpus: &[GpuInfo]) -> Vec<Device> {
    gpus.iter()
        .flat_map(|gpu| {
            (0..gpu.mem_gib).map(move |slot| device_of(gpu, device_id(&gpu.uuid, slot)))
        })
        .collect()
}

/// Device `id` of `gpu`, as kubelet lists it: the GPU's health and NUMA node (the memory
/// resource's GiB and the compute resource's units alike).
pub fn device_of(gpu: &GpuInfo, id: String) -> Device {
    Device {
        id,
        health: if gpu.healthy { HEALTHY } else { UNHEALTHY }.to_owned(),
        topology: gpu.numa_node.map(|id| TopologyInfo {
            nodes: vec![NumaNode { id }],
        }),
    }
}

/// The index of the GPU a device ID belongs to, read from the ID itself (`<uuid>-<slot>`,
/// slot within the GPU's GiB); `None` for an ID we never advertised. Parsing instead of a map
/// of every device keeps `Allocate` free of work proportional to the node's memory.
pub fn gpu_of(gpus: &[GpuInfo], id: &str) -> Option<u32> {
    let (uuid, slot) = id.rsplit_once('-')?;
    let slot: u64 = slot.parse().ok()?;
    gpus.iter()
        .find(|gpu| gpu.uuid == uuid && slot < gpu.mem_gib)
        .map(|gpu| gpu.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, mem_gib: u64, healthy: bool) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: String::new(),
            mem_gib,
            healthy,
            numa_node: (index == 1).then_some(1),
        }
    }

    #[test]
    fn one_device_per_gib_with_gpu_health_and_numa() {
        let gpus = [gpu(0, 2, true), gpu(1, 3, false)];
        let devices = device_list(&gpus);
        let ids: Vec<_> = devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["GPU-0-0", "GPU-0-1", "GPU-1-0", "GPU-1-1", "GPU-1-2"]);
        assert_eq!(devices[0].health, HEALTHY);
        assert!(devices[0].topology.is_none());
        assert_eq!(devices[4].health, UNHEALTHY);
        assert_eq!(devices[4].topology.as_ref().unwrap().nodes[0].id, 1);
        assert_eq!(gpu_of(&gpus, "GPU-1-2"), Some(1));
        assert_eq!(gpu_of(&gpus, "GPU-0-1"), Some(0));
        for unknown in ["GPU-0-2", "GPU-7-0", "GPU-0", "GPU-0-x", "", "GPU-0--1"] {
            assert_eq!(gpu_of(&gpus, unknown), None, "{unknown}");
        }
    }
}
