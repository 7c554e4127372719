//! The node's ResourceSlice: what the scheduler allocates from.
//!
//! One pool per node (named after the node), one slice in it, one device per GPU:
//!
//! ```text
//!   device gpu-<index>
//!     attributes  index, uuid, model, memoryGiB (, numaNode)
//!     capacity    memory = <GiB>Gi, requestPolicy: default 1Gi, validRange 1Gi..<GiB>Gi step 1Gi
//!     allowMultipleAllocations: true   (KEP-5075 consumable capacity)
//! ```
//!
//! With `allowMultipleAllocations` the scheduler may hand one GPU to many claims, each
//! consuming part of `memory`, and never more in total than its value. The request policy
//! makes every share a whole number of GiB (a request of 3.5Gi consumes 4Gi), matching the
//! extender mode's unit, and a claim that names no memory consumes 1 GiB, not the whole GPU.
//! [`build`] is pure; [`publish`] writes it.

use std::collections::BTreeMap;

use gpushare_contract::GpuInfo;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use crate::quantity::gib;

/// The capacity every device offers, in whole GiB.
pub const MEMORY: &str = "memory";

/// The device name of GPU `index`: a DNS label, stable across restarts.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The GPU index a device name stands for, if it is one of ours.
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("gpu-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The name of `node`'s slice for `driver`.
pub fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_owned()),
        ..DeviceAttribute::default()
    }
}

fn int(value: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(value),
        ..DeviceAttribute::default()
    }
}

/// The device for one GPU.
pub fn device(gpu: &GpuInfo) -> Device {
    let mut attributes = BTreeMap::from([
        ("index".to_owned(), int(i64::from(gpu.index))),
        ("uuid".to_owned(), string(&gpu.uuid)),
        ("model".to_owned(), string(&gpu.model)),
        (
            "memoryGiB".to_owned(),
            int(i64::try_from(gpu.mem_gib).unwrap_or(i64::MAX)),
        ),
    ]);
    if let Some(numa) = gpu.numa_node {
        attributes.insert("numaNode".to_owned(), int(numa));
    }
    let memory = DeviceCapacity {
        value: Quantity(gib(gpu.mem_gib)),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(Quantity(gib(1))),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity(gib(1)),
                step: Some(Quantity(gib(1))),
                max: Some(Quantity(gib(gpu.mem_gib))),
            }),
            valid_values: None,
        }),
    };
    Device {
        name: device_name(gpu.index),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([(MEMORY.to_owned(), memory)])),
        allow_multiple_allocations: Some(true),
        ..Device::default()
    }
}

/// The slice for `gpus` on `node`, at pool `generation`. GPUs with no memory are left out
/// (a capacity policy needs at least one step).
pub fn build(node: &str, driver: &str, gpus: &[GpuInfo], generation: i64) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node, driver)),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool {
                name: node.to_owned(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(
                gpus.iter()
                    .filter(|gpu| gpu.mem_gib > 0)
                    .map(device)
                    .collect(),
            ),
            ..ResourceSliceSpec::default()
        },
    }
}

/// Creates the node's slice, or brings the existing one up to date (bumping the pool
/// generation when the devices changed, as consumers expect).
pub async fn publish(
    api: &Api<ResourceSlice>,
    node: &str,
    driver: &str,
    gpus: &[GpuInfo],
) -> Result<(), kube::Error> {
    let name = slice_name(node, driver);
    match api.get_opt(&name).await? {
        None => {
            api.create(&PostParams::default(), &build(node, driver, gpus, 1))
                .await?;
            tracing::info!(slice = %name, gpus = gpus.len(), "published the ResourceSlice");
        }
        Some(current) => {
            let mut wanted = build(node, driver, gpus, current.spec.pool.generation);
            if wanted.spec == current.spec {
                tracing::info!(slice = %name, "the ResourceSlice is up to date");
                return Ok(());
            }
            wanted.spec.pool.generation = current.spec.pool.generation.saturating_add(1);
            wanted.metadata.resource_version = current.metadata.resource_version;
            api.replace(&name, &PostParams::default(), &wanted).await?;
            tracing::info!(slice = %name, generation = wanted.spec.pool.generation, "updated the ResourceSlice");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, mem_gib: u64) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "T4".to_owned(),
            mem_gib,
            healthy: true,
            numa_node: Some(0),
        }
    }

    #[test]
    fn one_shareable_device_per_gpu_with_memory_in_gib_steps() {
        let slice = build("n1", "gpushare.example.com", &[gpu(0, 16), gpu(1, 24)], 1);
        let json = serde_json::to_value(&slice).unwrap();
        assert_eq!(json["spec"]["nodeName"], "n1");
        assert_eq!(json["spec"]["pool"]["name"], "n1");
        let device = &json["spec"]["devices"][1];
        assert_eq!(device["name"], "gpu-1");
        assert_eq!(device["allowMultipleAllocations"], true);
        assert_eq!(device["attributes"]["uuid"]["string"], "GPU-1");
        assert_eq!(device["attributes"]["memoryGiB"]["int"], 24);
        let memory = &device["capacity"]["memory"];
        assert_eq!(memory["value"], "24Gi");
        assert_eq!(memory["requestPolicy"]["default"], "1Gi");
        assert_eq!(memory["requestPolicy"]["validRange"]["step"], "1Gi");
        assert_eq!(memory["requestPolicy"]["validRange"]["max"], "24Gi");
    }

    #[test]
    fn device_names_round_trip() {
        assert_eq!(device_index(&device_name(7)), Some(7));
        for other in ["gpu-", "gpu-x", "cpu-1", "gpu--1", "gpu-+1"] {
            assert_eq!(device_index(other), None, "{other}");
        }
    }
}
