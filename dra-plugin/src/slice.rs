//! The node's ResourceSlice: what the scheduler allocates from.
//!
//! One pool per node (named after the node), one slice in it, one device per GPU:
//!
//! ```text
//!   device gpu-<index>
//!     attributes  index, uuid, model, memoryGiB (, numaNode)
//!     capacity    memory  = <GiB>Gi, requestPolicy: default 1Gi, validRange 1Gi..<GiB>Gi step 1Gi
//!                 compute = 100,     requestPolicy: default 0,   validRange 0..100 step 1
//!     allowMultipleAllocations: true   (KEP-5075 consumable capacity)
//! ```
//!
//! With `allowMultipleAllocations` the scheduler may hand one GPU to many claims, each
//! consuming part of `memory`, and never more in total than its value. The request policy
//! makes every share a whole number of GiB (a request of 3.5Gi consumes 4Gi), matching the
//! extender mode's unit, and a claim that names no memory consumes 1 GiB, not the whole GPU.
//! `compute` is the GPU's SM time in percent, consumed the same way: claims asking for it
//! never take more than 100 of a GPU together, and a claim that names none consumes none
//! (without a request policy it would take the whole capacity, and a memory-only claim would
//! shut every other claim out).
//! [`build`] is pure; [`publish`] writes it.
//!
//! An unhealthy GPU stops being offered ([`Unhealthy`]). By default its device stays in the
//! slice with a `NoSchedule` device taint `<driver>/unhealthy` (KEP-5055, `DRADeviceTaints`:
//! beta and on by default since Kubernetes 1.36): the scheduler allocates it to no new
//! claim that does not tolerate the taint, the claims already on it keep their allocation
//! (as the device plugin leaves running pods alone), and `kubectl get resourceslices -o
//! yaml` shows why the GPU is not used. `NoSchedule`, not `NoExecute`: evicting the pods of
//! a GPU that flaps would restart them over and over. Where the API server drops the field
//! (the feature gate off, as before 1.36), [`publish`] says so and the plugin withdraws
//! unhealthy devices from the slice instead, which every DRA version honours.

use std::collections::BTreeMap;

use gpushare_contract::GpuInfo;
use gpushare_contract::quantity::gib;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

pub use gpushare_contract::dra::{COMPUTE, MEMORY, device_index, device_name};
use gpushare_contract::request::COMPUTE_PER_GPU;

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

/// How an unhealthy GPU is kept from new claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unhealthy {
    /// Its device carries a `NoSchedule` taint [`taint_key`] (the default).
    Taint,
    /// Its device is left out of the slice (where the API server drops device taints).
    Withdraw,
}

/// The key of the taint an unhealthy GPU's device carries: `<driver>/unhealthy`.
pub fn taint_key(driver: &str) -> String {
    format!("{driver}/unhealthy")
}

/// The taint of an unhealthy GPU's device.
pub fn unhealthy_taint(driver: &str) -> DeviceTaint {
    DeviceTaint {
        key: taint_key(driver),
        value: None,
        effect: "NoSchedule".to_owned(),
        time_added: None,
    }
}

/// The device for one GPU (healthy or not; see [`build`] for what health changes).
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
    let compute = DeviceCapacity {
        value: Quantity(COMPUTE_PER_GPU.to_string()),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(Quantity("0".to_owned())),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity("0".to_owned()),
                step: Some(Quantity("1".to_owned())),
                max: Some(Quantity(COMPUTE_PER_GPU.to_string())),
            }),
            valid_values: None,
        }),
    };
    Device {
        name: device_name(gpu.index),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([
            (MEMORY.to_owned(), memory),
            (COMPUTE.to_owned(), compute),
        ])),
        allow_multiple_allocations: Some(true),
        ..Device::default()
    }
}

/// The slice for `gpus` on `node`, at pool `generation`. GPUs with no memory are left out
/// (a capacity policy needs at least one step); unhealthy ones are tainted or left out, as
/// `unhealthy` says.
pub fn build(
    node: &str,
    driver: &str,
    gpus: &[GpuInfo],
    generation: i64,
    unhealthy: Unhealthy,
) -> ResourceSlice {
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
                    .filter(|gpu| gpu.healthy || unhealthy == Unhealthy::Taint)
                    .map(|gpu| {
                        let mut device = device(gpu);
                        if !gpu.healthy {
                            device.taints = Some(vec![unhealthy_taint(driver)]);
                        }
                        device
                    })
                    .collect(),
            ),
            ..ResourceSliceSpec::default()
        },
    }
}

/// What [`publish`] found the API server kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    /// The slice is as built.
    AsBuilt,
    /// The API server dropped the devices' taints (`DRADeviceTaints` off): unhealthy GPUs
    /// would still be offered, so publish again with [`Unhealthy::Withdraw`].
    TaintsDropped,
}

/// The taints of each device of `slice`, by device name.
fn taints(slice: &ResourceSlice) -> BTreeMap<String, Vec<DeviceTaint>> {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| (d.name.clone(), d.taints.clone().unwrap_or_default()))
        .collect()
}

/// Keeps the `timeAdded` the API server stamped on taints that are still wanted, so an
/// unchanged slice compares equal and a taint keeps the time it was first set.
fn keep_taint_times(wanted: &mut ResourceSlice, current: &ResourceSlice) {
    let current = taints(current);
    for device in wanted.spec.devices.iter_mut().flatten() {
        for taint in device.taints.iter_mut().flatten() {
            if let Some(stored) =
                current.get(&device.name).into_iter().flatten().find(|t| {
                    t.key == taint.key && t.value == taint.value && t.effect == taint.effect
                })
            {
                taint.time_added.clone_from(&stored.time_added);
            }
        }
    }
}

/// Whether the API server kept every taint of `wanted` in `stored`.
fn kept_taints(wanted: &ResourceSlice, stored: &ResourceSlice) -> bool {
    let stored = taints(stored);
    taints(wanted).iter().all(|(name, wanted)| {
        wanted.iter().all(|taint| {
            stored.get(name).is_some_and(|s| {
                s.iter()
                    .any(|t| t.key == taint.key && t.effect == taint.effect)
            })
        })
    })
}

/// Creates the node's slice, or brings the existing one up to date (bumping the pool
/// generation when the devices changed, as consumers expect).
pub async fn publish(
    api: &Api<ResourceSlice>,
    node: &str,
    driver: &str,
    gpus: &[GpuInfo],
    unhealthy: Unhealthy,
) -> Result<Published, kube::Error> {
    let name = slice_name(node, driver);
    let (wanted, stored) = match api.get_opt(&name).await? {
        None => {
            let wanted = build(node, driver, gpus, 1, unhealthy);
            let stored = api.create(&PostParams::default(), &wanted).await?;
            tracing::info!(slice = %name, gpus = gpus.len(), "published the ResourceSlice");
            (wanted, stored)
        }
        Some(current) => {
            let mut wanted = build(node, driver, gpus, current.spec.pool.generation, unhealthy);
            keep_taint_times(&mut wanted, &current);
            if wanted.spec == current.spec {
                tracing::info!(slice = %name, "the ResourceSlice is up to date");
                return Ok(Published::AsBuilt);
            }
            wanted.spec.pool.generation = current.spec.pool.generation.saturating_add(1);
            wanted.metadata.resource_version = current.metadata.resource_version;
            let stored = api.replace(&name, &PostParams::default(), &wanted).await?;
            tracing::info!(slice = %name, generation = wanted.spec.pool.generation, "updated the ResourceSlice");
            (wanted, stored)
        }
    };
    if kept_taints(&wanted, &stored) {
        Ok(Published::AsBuilt)
    } else {
        tracing::warn!(slice = %name, "the API server dropped the device taints of unhealthy GPUs (feature gate DRADeviceTaints off, as before Kubernetes 1.36); withdrawing those devices from the slice instead");
        Ok(Published::TaintsDropped)
    }
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
        let slice = build(
            "n1",
            "gpushare.example.com",
            &[gpu(0, 16), gpu(1, 24)],
            1,
            Unhealthy::Taint,
        );
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
        // Compute: 100 percent, and a claim naming none consumes none.
        let compute = &device["capacity"]["compute"];
        assert_eq!(compute["value"], "100");
        assert_eq!(compute["requestPolicy"]["default"], "0");
        assert_eq!(compute["requestPolicy"]["validRange"]["min"], "0");
        assert_eq!(compute["requestPolicy"]["validRange"]["step"], "1");
        assert_eq!(compute["requestPolicy"]["validRange"]["max"], "100");
    }

    #[test]
    fn an_unhealthy_gpu_is_tainted_or_withdrawn() {
        let mut broken = gpu(1, 24);
        broken.healthy = false;
        let gpus = [gpu(0, 16), broken];
        let tainted = build("n1", "gpushare.example.com", &gpus, 1, Unhealthy::Taint);
        let json = serde_json::to_value(&tainted).unwrap();
        assert!(json["spec"]["devices"][0].get("taints").is_none());
        assert_eq!(
            json["spec"]["devices"][1]["taints"],
            serde_json::json!([{"key": "gpushare.example.com/unhealthy", "effect": "NoSchedule"}])
        );
        let withdrawn = build("n1", "gpushare.example.com", &gpus, 1, Unhealthy::Withdraw);
        let names: Vec<_> = withdrawn
            .spec
            .devices
            .unwrap()
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["gpu-0"]);
    }

    #[test]
    fn dropped_taints_are_noticed_and_stamped_times_kept() {
        let mut broken = gpu(0, 16);
        broken.healthy = false;
        let wanted = build("n1", "d", &[broken.clone()], 1, Unhealthy::Taint);
        let dropped = build("n1", "d", &[gpu(0, 16)], 1, Unhealthy::Taint);
        assert!(!kept_taints(&wanted, &dropped));
        assert!(kept_taints(&wanted, &wanted));
        let mut stamped = wanted.clone();
        let time = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-01-01T00:00:00Z".parse().unwrap(),
        );
        stamped.spec.devices.as_mut().unwrap()[0]
            .taints
            .as_mut()
            .unwrap()[0]
            .time_added = Some(time);
        let mut again = build("n1", "d", &[broken], 1, Unhealthy::Taint);
        assert_ne!(again.spec, stamped.spec);
        keep_taint_times(&mut again, &stamped);
        assert_eq!(
            again.spec, stamped.spec,
            "an unchanged slice is not written again"
        );
    }
}
