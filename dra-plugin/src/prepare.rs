//! What preparing a claim means for gpushare: from the scheduler's allocation to the GPU,
//! the GiB and the CDI device a container gets. Pure; the service does the I/O.
//!
//! The allocation (`status.allocation.devices.results`) names, per request, a device of a
//! pool of a driver, and for a shareable device the capacity consumed. A result of another
//! driver is someone else's business and is skipped. Ours must be in this node's pool and
//! name one of this node's GPUs; `consumedCapacity.memory` is the share, in whole GiB (the
//! request policy in the slice makes it so), and `consumedCapacity.compute` the percent of the
//! GPU's SM time the claim was given (none named: no compute share). A claim may hold several gpushare devices (a
//! request with `count: N`): each on its own GPU and each with the same share, so the
//! container sees them all as extender mode's multi-GPU pods do (`cdi::claim_env`).

use gpushare_contract::GpuInfo;
use gpushare_contract::quantity::{self, GIB};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::{Deserialize, Serialize};

use crate::slice::{COMPUTE, MEMORY, device_index};
use gpushare_contract::request::COMPUTE_PER_GPU;

/// One allocated device, ready for a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The claim's request the device was allocated for.
    pub request: String,
    /// The pool (this node's name).
    pub pool: String,
    /// The device (`gpu-<index>`).
    pub device: String,
    /// The GPU's index on the node.
    pub gpu_index: u32,
    /// The GPU's UUID.
    pub gpu_uuid: String,
    /// The GPU's total memory in GiB.
    pub gpu_mem_gib: u64,
    /// The GiB this claim holds on the GPU.
    pub gib: u64,
    /// The percent of the GPU's compute this claim holds (0: no compute share). Absent from
    /// checkpoints written before compute was shared.
    #[serde(default)]
    pub compute: u32,
    /// The fully qualified CDI device name (`<kind>=<name>`).
    pub cdi_device_id: String,
}

/// Why a claim cannot be prepared. The message goes back to kubelet, which shows it on the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrepareError {
    /// The claim read from the API server is another incarnation than kubelet asked for.
    #[error(
        "claim {namespace}/{name} has UID {found}, kubelet asked for {wanted}: it was deleted and recreated; kubelet will retry with the new one"
    )]
    Replaced {
        /// the claim's namespace
        namespace: String,
        /// the claim's name
        name: String,
        /// the UID kubelet sent
        wanted: String,
        /// the UID found
        found: String,
    },
    /// The claim has no allocation.
    #[error(
        "claim {namespace}/{name} is not allocated; the scheduler allocates it before the pod is bound"
    )]
    NotAllocated {
        /// the claim's namespace
        namespace: String,
        /// the claim's name
        name: String,
    },
    /// The allocation names a device of another node's pool.
    #[error(
        "claim {claim} was allocated device {device} of pool {pool}, but this is node {node}: the claim belongs to a pod on another node"
    )]
    OtherPool {
        /// namespace/name
        claim: String,
        /// the pool named
        pool: String,
        /// the device named
        device: String,
        /// this node
        node: String,
    },
    /// The allocation names a device this node does not have.
    #[error(
        "claim {claim} was allocated device {device}, which is not a GPU on node {node}; was the slice changed under the scheduler?"
    )]
    UnknownDevice {
        /// namespace/name
        claim: String,
        /// the device named
        device: String,
        /// this node
        node: String,
    },
    /// The consumed memory is not a whole number of GiB, or not a quantity.
    #[error(
        "claim {claim} consumes {value:?} of memory on {device}; gpushare shares GPUs in whole GiB (the slice's request policy rounds requests up to 1Gi steps)"
    )]
    BadShare {
        /// namespace/name
        claim: String,
        /// the device
        device: String,
        /// the quantity found
        value: String,
    },
    /// The consumed compute is not a whole percent from 0 to 100.
    #[error(
        "claim {claim} consumes {value:?} of compute on {device}; compute is a whole percent of a GPU, 0 to {COMPUTE_PER_GPU}"
    )]
    BadCompute {
        /// namespace/name
        claim: String,
        /// the device
        device: String,
        /// the quantity found
        value: String,
    },
    /// Two of the claim's devices are the same GPU.
    #[error(
        "claim {claim} holds {device} twice; a claim's GPUs must be distinct (ask for one request with count: N)"
    )]
    SameGpuTwice {
        /// namespace/name
        claim: String,
        /// the device named twice
        device: String,
    },
    /// The claim's GPUs hold different shares.
    #[error(
        "claim {claim} holds different shares of its GPUs ({shares}); a container gets the same share of each of its GPUs, so ask for one request with count: N and one capacity"
    )]
    UnevenShares {
        /// namespace/name
        claim: String,
        /// the shares, e.g. `gpu-0: 4 GiB, gpu-1: 8 GiB` (and the compute, where one is given)
        shares: String,
    },
}

/// The CDI device name for `device` of claim `uid`, without the kind.
pub fn cdi_name(uid: &str, device: &str) -> String {
    format!("claim-{uid}-{device}")
}

/// The devices of `claim` (UID `uid`, as kubelet sent it) that `driver` must prepare on
/// `node`, whose GPUs are `gpus`. `cdi_kind` is the CDI kind (`vendor/class`) of the spec.
pub fn plan(
    claim: &ResourceClaim,
    uid: &str,
    driver: &str,
    node: &str,
    gpus: &[GpuInfo],
    cdi_kind: &str,
) -> Result<Vec<PreparedDevice>, PrepareError> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let key = format!("{namespace}/{name}");
    let found = claim.metadata.uid.as_deref().unwrap_or("");
    if found != uid {
        return Err(PrepareError::Replaced {
            namespace,
            name,
            wanted: uid.to_owned(),
            found: found.to_owned(),
        });
    }
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Err(PrepareError::NotAllocated { namespace, name });
    };
    let ours: Vec<_> = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .filter(|result| result.driver == driver)
        .collect();
    let mut devices = Vec::with_capacity(ours.len());
    for result in ours {
        if result.pool != node {
            return Err(PrepareError::OtherPool {
                claim: key,
                pool: result.pool.clone(),
                device: result.device.clone(),
                node: node.to_owned(),
            });
        }
        let gpu = device_index(&result.device)
            .and_then(|index| gpus.iter().find(|gpu| gpu.index == index))
            .ok_or_else(|| PrepareError::UnknownDevice {
                claim: key.clone(),
                device: result.device.clone(),
                node: node.to_owned(),
            })?;
        let gib = match result
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get(MEMORY))
        {
            // Not shared: the whole GPU.
            None => gpu.mem_gib,
            Some(value) => {
                let bad = || PrepareError::BadShare {
                    claim: key.clone(),
                    device: result.device.clone(),
                    value: value.0.clone(),
                };
                let bytes = quantity::bytes(&value.0).map_err(|_| bad())?;
                if bytes == 0 || bytes % GIB != 0 {
                    return Err(bad());
                }
                u64::try_from(bytes / GIB).map_err(|_| bad())?
            }
        };
        let compute = match result
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get(COMPUTE))
        {
            None => 0,
            Some(value) => quantity::milli(&value.0)
                .ok()
                .filter(|milli| milli % 1000 == 0)
                .and_then(|milli| u32::try_from(milli / 1000).ok())
                .filter(|&percent| percent <= COMPUTE_PER_GPU)
                .ok_or_else(|| PrepareError::BadCompute {
                    claim: key.clone(),
                    device: result.device.clone(),
                    value: value.0.clone(),
                })?,
        };
        devices.push(PreparedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
            gpu_index: gpu.index,
            gpu_uuid: gpu.uuid.clone(),
            gpu_mem_gib: gpu.mem_gib,
            gib,
            compute,
            cdi_device_id: format!("{cdi_kind}={}", cdi_name(uid, &result.device)),
        });
    }
    if let Some(twice) = devices.iter().enumerate().find_map(|(i, d)| {
        devices[..i]
            .iter()
            .any(|earlier| earlier.gpu_index == d.gpu_index)
            .then_some(d)
    }) {
        return Err(PrepareError::SameGpuTwice {
            claim: key,
            device: twice.device.clone(),
        });
    }
    if devices
        .windows(2)
        .any(|pair| (pair[0].gib, pair[0].compute) != (pair[1].gib, pair[1].compute))
    {
        let shares = devices
            .iter()
            .map(|d| match d.compute {
                0 => format!("{}: {} GiB", d.device, d.gib),
                percent => format!("{}: {} GiB and {percent} % compute", d.device, d.gib),
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Err(PrepareError::UnevenShares { claim: key, shares });
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gpus() -> Vec<GpuInfo> {
        (0..2)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-{index}"),
                model: "T4".to_owned(),
                mem_gib: 16,
                healthy: true,
                numa_node: None,
            })
            .collect()
    }

    fn claim(results: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results}}}
        }))
        .unwrap()
    }

    fn result(driver: &str, pool: &str, device: &str, memory: Option<&str>) -> serde_json::Value {
        let mut r = json!({"request": "gpu", "driver": driver, "pool": pool, "device": device});
        if let Some(memory) = memory {
            r["consumedCapacity"] = json!({"memory": memory});
        }
        r
    }

    fn with_compute(mut result: serde_json::Value, compute: &str) -> serde_json::Value {
        result["consumedCapacity"]["compute"] = json!(compute);
        result
    }

    const D: &str = "gpushare.example.com";

    #[test]
    fn a_share_becomes_one_cdi_device_on_its_gpu() {
        let c = claim(json!([
            result("other.example.com", "x", "y", None),
            result(D, "n1", "gpu-1", Some("4Gi"))
        ]));
        let devices = plan(&c, "u1", D, "n1", &gpus(), "gpushare.example.com/gpu").unwrap();
        assert_eq!(devices.len(), 1);
        let d = &devices[0];
        assert_eq!((d.gpu_index, d.gib, d.gpu_mem_gib), (1, 4, 16));
        assert_eq!(d.gpu_uuid, "GPU-1");
        assert_eq!(d.cdi_device_id, "gpushare.example.com/gpu=claim-u1-gpu-1");
    }

    #[test]
    fn a_claim_of_two_gpus_holds_the_same_share_of_each() {
        let c = claim(json!([
            result(D, "n1", "gpu-1", Some("4Gi")),
            result(D, "n1", "gpu-0", Some("4Gi"))
        ]));
        let devices = plan(&c, "u1", D, "n1", &gpus(), "k/c").unwrap();
        let placed: Vec<(u32, u64)> = devices.iter().map(|d| (d.gpu_index, d.gib)).collect();
        assert_eq!(placed, [(1, 4), (0, 4)]);
    }

    #[test]
    fn the_consumed_compute_is_the_claims_percent_of_each_gpu() {
        let c = claim(json!([
            with_compute(result(D, "n1", "gpu-0", Some("4Gi")), "30"),
            with_compute(result(D, "n1", "gpu-1", Some("4Gi")), "30")
        ]));
        let devices = plan(&c, "u1", D, "n1", &gpus(), "k/c").unwrap();
        assert_eq!(
            devices.iter().map(|d| d.compute).collect::<Vec<_>>(),
            [30, 30]
        );
        // None consumed (a memory-only claim, or "0"): no compute share.
        for c in [
            claim(json!([result(D, "n1", "gpu-0", Some("4Gi"))])),
            claim(json!([with_compute(
                result(D, "n1", "gpu-0", Some("4Gi")),
                "0"
            )])),
        ] {
            assert_eq!(
                plan(&c, "u1", D, "n1", &gpus(), "k/c").unwrap()[0].compute,
                0
            );
        }
        for bad in ["101", "1500m", "x"] {
            let c = claim(json!([with_compute(
                result(D, "n1", "gpu-0", Some("4Gi")),
                bad
            )]));
            let err = plan(&c, "u1", D, "n1", &gpus(), "k/c").unwrap_err();
            assert!(
                matches!(err, PrepareError::BadCompute { .. }),
                "{bad}: {err}"
            );
        }
        let c = claim(json!([
            with_compute(result(D, "n1", "gpu-0", Some("4Gi")), "30"),
            result(D, "n1", "gpu-1", Some("4Gi"))
        ]));
        let uneven = plan(&c, "u1", D, "n1", &gpus(), "k/c").unwrap_err();
        assert!(
            uneven
                .to_string()
                .contains("gpu-0: 4 GiB and 30 % compute, gpu-1: 4 GiB"),
            "{uneven}"
        );
    }

    #[test]
    fn a_device_checkpointed_before_compute_reads_back_without_a_share() {
        let device: PreparedDevice = serde_json::from_value(json!({
            "request": "gpu", "pool": "n1", "device": "gpu-0", "gpuIndex": 0,
            "gpuUuid": "GPU-0", "gpuMemGib": 16, "gib": 4, "cdiDeviceId": "k/c=claim-u1-gpu-0"
        }))
        .unwrap();
        assert_eq!((device.gib, device.compute), (4, 0));
    }

    #[test]
    fn an_unshared_device_is_the_whole_gpu() {
        let c = claim(json!([result(D, "n1", "gpu-0", None)]));
        let devices = plan(&c, "u1", D, "n1", &gpus(), "k/c").unwrap();
        assert_eq!(devices[0].gib, 16);
    }

    #[test]
    fn refuses_what_it_cannot_honour() {
        let g = gpus();
        let run = |c: &ResourceClaim, uid: &str| plan(c, uid, D, "n1", &g, "k/c");
        let c = claim(json!([result(D, "n1", "gpu-0", Some("4Gi"))]));
        assert!(matches!(run(&c, "u2"), Err(PrepareError::Replaced { .. })));
        let c = claim(json!([result(D, "n2", "gpu-0", Some("4Gi"))]));
        assert!(matches!(run(&c, "u1"), Err(PrepareError::OtherPool { .. })));
        let c = claim(json!([result(D, "n1", "gpu-9", Some("4Gi"))]));
        assert!(matches!(
            run(&c, "u1"),
            Err(PrepareError::UnknownDevice { .. })
        ));
        let c = claim(json!([result(D, "n1", "gpu-0", Some("1536Mi"))]));
        assert!(matches!(run(&c, "u1"), Err(PrepareError::BadShare { .. })));
        let c = claim(json!([
            result(D, "n1", "gpu-0", Some("4Gi")),
            result(D, "n1", "gpu-0", Some("4Gi"))
        ]));
        assert!(matches!(
            run(&c, "u1"),
            Err(PrepareError::SameGpuTwice { .. })
        ));
        let c = claim(json!([
            result(D, "n1", "gpu-0", Some("4Gi")),
            result(D, "n1", "gpu-1", Some("8Gi"))
        ]));
        let uneven = run(&c, "u1").unwrap_err();
        assert!(
            uneven.to_string().contains("gpu-0: 4 GiB, gpu-1: 8 GiB"),
            "{uneven}"
        );
        let mut c = claim(json!([]));
        c.status = None;
        assert!(matches!(
            run(&c, "u1"),
            Err(PrepareError::NotAllocated { .. })
        ));
    }
}
