//! The GPUs a container gets: every GPU its pod's allocation names, checked against this
//! node's (present, the same UUID, healthy) before any is handed out, and the same GPUs named
//! as CDI devices for runtimes that resolve devices through CDI (`--cdi-devices`).

use gpushare_contract::GpuInfo;
use gpushare_proto::v1beta1::CdiDevice;

use super::AllocateError;
use crate::view::PodView;

/// The GPUs a pod's allocation names (the first one first), if every one of them is usable:
/// this node has it, its UUID is the one the extender recorded, and it is healthy. A
/// multi-GPU pod gets none of its GPUs when any one of them fails.
pub fn check_gpus(
    gpus: &[GpuInfo],
    node: &str,
    view: &PodView,
) -> Result<Vec<GpuInfo>, AllocateError> {
    let alloc = &view.allocation;
    let set: Vec<u32> = alloc.gpus().map(|(index, _)| index).collect();
    let mut checked = Vec::with_capacity(alloc.gpu_count());
    for (index, uuid) in alloc.gpus() {
        let gpu = gpus.iter().find(|gpu| gpu.index == index).ok_or_else(|| {
            AllocateError::UnknownGpu {
                pod: view.key.clone(),
                index,
                node: node.to_owned(),
                set: set.clone(),
            }
        })?;
        if !uuid.is_empty() && uuid != gpu.uuid {
            return Err(AllocateError::UuidMismatch {
                pod: view.key.clone(),
                index,
                annotated: uuid.to_owned(),
                ours: gpu.uuid.clone(),
                set,
            });
        }
        if !gpu.healthy {
            return Err(AllocateError::UnhealthyGpu {
                pod: view.key.clone(),
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                set,
            });
        }
        checked.push(gpu.clone());
    }
    Ok(checked)
}

/// The CDI kind the NVIDIA container toolkit gives GPUs in the spec it generates.
pub const NVIDIA_CDI_KIND: &str = "nvidia.com/gpu";

/// The CDI devices that give a container `gpus`: `nvidia.com/gpu=<uuid>` each.
///
/// The NVIDIA container toolkit's generated CDI spec (`nvidia-ctk cdi generate`, kind
/// `nvidia.com/gpu`) names every GPU both by index and by UUID, `nvidia.com/gpu=0` and
/// `nvidia.com/gpu=GPU-…`, beside `nvidia.com/gpu=all`; `nvidia-ctk cdi list` prints them
/// (<https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/cdi-support.html>).
/// The UUID is used because it names the same GPU whatever the enumeration order, as the
/// allocation does. A GPU without a UUID (no inventory) gets no CDI device.
pub fn cdi_devices(gpus: &[GpuInfo]) -> Vec<CdiDevice> {
    gpus.iter()
        .filter(|gpu| !gpu.uuid.is_empty())
        .map(|gpu| CdiDevice {
            name: format!("{NVIDIA_CDI_KIND}={}", gpu.uuid),
        })
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    use gpushare_contract::{ContainerRequest, GpuRef, PodAllocation};
    use tonic::Status;

    use super::*;
    use crate::view::Trust;

    /// A GPU of `mem_gib` GiB with index `index` (UUID `GPU-<index>`); the enforcement
    /// tests build theirs with it too.
    pub(in crate::service) fn gpu(index: u32, mem_gib: u64, healthy: bool) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: String::new(),
            mem_gib,
            healthy,
            numa_node: None,
        }
    }

    /// A pod placed on `gpus` (index, uuid) with `pod_gib` on each.
    fn placed(gpus: &[(u32, &str)], pod_gib: u64, exclusive: bool) -> PodView {
        let (first, more) = gpus.split_first().expect("at least one GPU");
        PodView {
            key: "default/p".into(),
            uid: "uid-p".into(),
            node: Some("n1".into()),
            phase: Some("Pending".into()),
            deleting: false,
            admitted: false,
            allocation: PodAllocation {
                gpu_index: first.0,
                gpu_uuid: first.1.into(),
                more_gpus: more
                    .iter()
                    .map(|&(index, uuid)| GpuRef {
                        index,
                        uuid: uuid.into(),
                    })
                    .collect(),
                pod_gib,
                exclusive,
                containers: vec![ContainerRequest {
                    name: "main".into(),
                    gib: pod_gib * u64::try_from(gpus.len()).unwrap(),
                    init: false,
                    compute: 0,
                }],
                bind_time: "2026-11-22T10:00:00Z".into(),
                assigned: false,
                allocated: vec![],
                signature: None,
                compute: 0,
            },
            trust: Trust::Verified,
        }
    }

    #[test]
    fn cdi_devices_name_every_gpu_by_uuid() {
        let names: Vec<String> = cdi_devices(&[gpu(3, 24, true), gpu(1, 16, true)])
            .into_iter()
            .map(|device| device.name)
            .collect();
        assert_eq!(names, ["nvidia.com/gpu=GPU-3", "nvidia.com/gpu=GPU-1"]);
        let mut bare = gpu(0, 16, true);
        bare.uuid.clear();
        assert!(cdi_devices(&[bare]).is_empty());
    }

    #[test]
    fn every_gpu_of_the_allocation_is_checked() {
        let node = [gpu(0, 16, true), gpu(1, 16, true), gpu(3, 24, true)];
        let view = placed(&[(3, "GPU-3"), (1, "GPU-1")], 8, false);
        let checked = check_gpus(&node, "n1", &view).unwrap();
        assert_eq!(
            checked.iter().map(|g| g.index).collect::<Vec<_>>(),
            [3, 1],
            "the allocation's order, the first GPU first"
        );
        // Recorded without UUIDs (no inventory when scheduled): indices alone.
        let view = placed(&[(0, ""), (1, "")], 8, false);
        assert_eq!(check_gpus(&node, "n1", &view).unwrap().len(), 2);
    }

    #[test]
    fn an_unhealthy_second_gpu_refuses_the_whole_allocation() {
        let node = [gpu(1, 16, true), gpu(3, 24, false)];
        let view = placed(&[(1, "GPU-1"), (3, "GPU-3")], 8, false);
        let err = check_gpus(&node, "n1", &view).unwrap_err();
        assert_eq!(err.reason(), "gpu_unhealthy");
        assert_eq!(
            err.to_string(),
            "pod default/p was placed on GPU 3 (GPU-3) (one of its GPUs 1,3), which is unhealthy; delete the pod so it is scheduled elsewhere"
        );
        assert_eq!(Status::from(err).code(), tonic::Code::Unavailable);
        // The one-GPU message is unchanged.
        let view = placed(&[(3, "GPU-3")], 8, false);
        assert_eq!(
            check_gpus(&node, "n1", &view).unwrap_err().to_string(),
            "pod default/p was placed on GPU 3 (GPU-3), which is unhealthy; delete the pod so it is scheduled elsewhere"
        );
    }

    #[test]
    fn a_second_gpu_that_is_missing_or_changed_is_refused() {
        let node = [gpu(0, 16, true), gpu(1, 16, true)];
        let err = check_gpus(
            &node,
            "n1",
            &placed(&[(0, "GPU-0"), (5, "GPU-5")], 8, false),
        )
        .unwrap_err();
        assert_eq!(err.reason(), "unknown_gpu");
        assert!(
            err.to_string()
                .contains("was placed on GPU 5 (one of its GPUs 0,5), but node n1 has no GPU"),
            "{err}"
        );
        let err = check_gpus(
            &node,
            "n1",
            &placed(&[(0, "GPU-0"), (1, "GPU-x")], 8, false),
        )
        .unwrap_err();
        assert_eq!(err.reason(), "gpu_uuid_mismatch");
        assert!(
            err.to_string().contains(
                "GPU 1 (one of its GPUs 0,1) with UUID GPU-x, but GPU 1 on this node is GPU-1"
            ),
            "{err}"
        );
    }
}
