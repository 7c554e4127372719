//! A claim's devices on one node: each request read and checked (`Wanted`), then served
//! first fit (slices in name order, devices in slice order), and the allocation result
//! written as upstream writes it (a `shareID` and `consumedCapacity` per shared device, a
//! node selector naming the node). Pure: the pass in `driver.rs` calls it per node.
//!
//! Refused with a clear message, not half-done: `firstAvailable`, `allocationMode: All`,
//! `adminAccess`, claim `constraints`, and slices not bound to one node (`allNodes`,
//! `nodeSelector`, per-device node selection).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use gpushare_dra_plugin::quantity::{self, GIB};
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceClass, DeviceRequest,
    DeviceRequestAllocationResult, DeviceToleration, ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use super::AllocateError;
use super::device::{all_taints_tolerated, fit, selects};
use super::usage::{DeviceId, Hold, Usage};

/// Allocates `claim` from the slices of `node`, consuming from `usage` (updated on success).
pub fn allocate(
    claim: &ResourceClaim,
    node: &str,
    slices: &[Arc<ResourceSlice>],
    classes: &HashMap<String, Arc<DeviceClass>>,
    usage: &mut Usage,
) -> Result<AllocationResult, AllocateError> {
    let key = format!(
        "{}/{}",
        claim.namespace().unwrap_or_default(),
        claim.name_any()
    );
    let devices = &claim.spec.devices;
    if devices
        .as_ref()
        .and_then(|d| d.constraints.as_ref())
        .is_some_and(|c| !c.is_empty())
    {
        return Err(unsupported(&key, "constraints"));
    }
    let mut local: Vec<&Arc<ResourceSlice>> = slices
        .iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
        .collect();
    local.sort_by_key(|a| a.name_any());
    let mut trial = usage.clone();
    let mut results = Vec::new();
    for request in devices.iter().flat_map(|d| d.requests.iter().flatten()) {
        let wanted = Wanted::of(&key, request, classes)?;
        let mut taken: HashSet<DeviceId> = HashSet::new();
        for _ in 0..wanted.count.max(0) {
            let Some((id, hold)) = choose_device(&local, &wanted, &trial, &taken)? else {
                return Err(wanted.no_fit(&key));
            };
            taken.insert(id.clone());
            trial.hold(&id, &hold);
            results.push(request_result(&request.name, id, hold));
        }
    }
    *usage = trial;
    Ok(AllocationResult {
        devices: Some(DeviceAllocationResult {
            results: Some(results),
            config: None,
        }),
        node_selector: Some(node_selector(node)),
        allocation_timestamp: None,
    })
}

/// The error for a claim (`key`) asking for `what`, which this scheduler does not implement.
fn unsupported(key: &str, what: &str) -> AllocateError {
    AllocateError::Unsupported(format!(
        "claim {key}: {what} is not supported by this scheduler"
    ))
}

/// One `exactly` request of a claim, read and checked before any device is looked at.
struct Wanted<'a> {
    /// The device class every device must belong to.
    class: &'a str,
    /// How many devices (`ExactCount`).
    count: i64,
    /// The class's CEL selectors, then the request's.
    expressions: Vec<&'a str>,
    /// `capacity.requests`, in bytes (or units) per capacity name.
    requested: BTreeMap<&'a str, u128>,
    tolerations: Option<&'a [DeviceToleration]>,
}

impl<'a> Wanted<'a> {
    /// Reads `request` of claim `key`, refusing the shapes this scheduler does not implement.
    fn of(
        key: &str,
        request: &'a DeviceRequest,
        classes: &'a HashMap<String, Arc<DeviceClass>>,
    ) -> Result<Self, AllocateError> {
        let Some(exactly) = &request.exactly else {
            return Err(unsupported(key, "firstAvailable"));
        };
        if exactly.admin_access == Some(true) {
            return Err(unsupported(key, "adminAccess"));
        }
        let count = match exactly.allocation_mode.as_deref() {
            None | Some("ExactCount") => exactly.count.unwrap_or(1),
            Some(mode) => return Err(unsupported(key, &format!("allocationMode {mode}"))),
        };
        let class = classes.get(&exactly.device_class_name).ok_or_else(|| {
            AllocateError::NoFit(format!(
                "claim {key}: device class {} does not exist",
                exactly.device_class_name
            ))
        })?;
        let expressions: Vec<&str> = class
            .spec
            .selectors
            .iter()
            .flatten()
            .chain(exactly.selectors.iter().flatten())
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.as_str()))
            .collect();
        let mut requested: BTreeMap<&str, u128> = BTreeMap::new();
        for (name, value) in exactly
            .capacity
            .as_ref()
            .and_then(|c| c.requests.as_ref())
            .into_iter()
            .flatten()
        {
            let bytes = quantity::bytes(&value.0).map_err(|e| {
                AllocateError::Unsupported(format!("claim {key}: capacity {name}: {e}"))
            })?;
            requested.insert(name, bytes);
        }
        Ok(Wanted {
            class: &exactly.device_class_name,
            count,
            expressions,
            requested,
            tolerations: exactly.tolerations.as_deref(),
        })
    }

    /// Why no device of the node could serve one more device of this request of claim `key`.
    fn no_fit(&self, key: &str) -> AllocateError {
        let wanted = self
            .requested
            .iter()
            .map(|(name, bytes)| format!("{} of {name}", quantity_of(*bytes).0))
            .collect::<Vec<_>>()
            .join(", ");
        let wanted = if wanted.is_empty() {
            "a device".to_owned()
        } else {
            wanted
        };
        AllocateError::NoFit(format!(
            "cannot allocate all claims: no device of class {} has {wanted} free for claim {key}",
            self.class
        ))
    }
}

/// The first device of `local` (slices in name order, devices in slice order) that can serve
/// one device of `wanted` beside `trial`, skipping those this request has `taken` already.
fn choose_device(
    local: &[&Arc<ResourceSlice>],
    wanted: &Wanted<'_>,
    trial: &Usage,
    taken: &HashSet<DeviceId>,
) -> Result<Option<(DeviceId, Hold)>, AllocateError> {
    for slice in local {
        for device in slice.spec.devices.iter().flatten() {
            let id = DeviceId {
                driver: slice.spec.driver.clone(),
                pool: slice.spec.pool.name.clone(),
                device: device.name.clone(),
            };
            if taken.contains(&id)
                || !all_taints_tolerated(device, wanted.tolerations)
                || !selects(&wanted.expressions, &id.driver, device)?
            {
                continue;
            }
            if let Some(hold) = fit(device, &id, &wanted.requested, trial)? {
                return Ok(Some((id, hold)));
            }
        }
    }
    Ok(None)
}

/// The allocation result of `request` holding device `id` as `hold`: a share gets a fresh
/// `shareID` and records its `consumedCapacity`.
fn request_result(request: &str, id: DeviceId, hold: Hold) -> DeviceRequestAllocationResult {
    let consumed = match hold {
        Hold::Whole => None,
        Hold::Share(consumed) => Some(consumed),
    };
    DeviceRequestAllocationResult {
        request: request.to_owned(),
        driver: id.driver,
        pool: id.pool,
        device: id.device,
        share_id: consumed.as_ref().map(|_| random_uid()),
        consumed_capacity: consumed.map(|c| {
            c.into_iter()
                .map(|(name, amount)| (name, quantity_of(amount)))
                .collect()
        }),
        ..DeviceRequestAllocationResult::default()
    }
}

/// `bytes` as a quantity: whole GiB as `NGi`, else plain units.
pub fn quantity_of(bytes: u128) -> Quantity {
    if bytes > 0 && bytes.is_multiple_of(GIB) {
        Quantity(format!("{}Gi", bytes / GIB))
    } else {
        Quantity(bytes.to_string())
    }
}

fn random_uid() -> String {
    let bits: u128 = rand::random();
    let hex = format!("{bits:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

fn node_selector(node: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".to_owned(),
                operator: "In".to_owned(),
                values: Some(vec![node.to_owned()]),
            }]),
            match_expressions: None,
        }],
    }
}

/// The one node an allocation is available on, as [`allocate`] writes it.
pub fn allocated_node(claim: &ResourceClaim) -> Option<String> {
    let selector = claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .node_selector
        .as_ref()?;
    let term = selector.node_selector_terms.first()?;
    let field = term.match_fields.as_ref()?.first()?;
    (field.key == "metadata.name" && field.operator == "In")
        .then(|| field.values.as_ref()?.first().cloned())
        .flatten()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::ResourceClaimStatus;
    use serde_json::json;

    use super::*;
    use crate::scheduler::dra::device::tolerates;

    fn slice(node: &str, gpus: &[u64]) -> Arc<ResourceSlice> {
        let infos: Vec<_> = gpus
            .iter()
            .zip(0u32..)
            .map(|(&mem_gib, index)| gpushare_contract::GpuInfo {
                index,
                uuid: format!("GPU-{node}-{index}"),
                model: "T4".to_owned(),
                mem_gib,
                healthy: true,
                numa_node: None,
            })
            .collect();
        Arc::new(gpushare_dra_plugin::slice::build(
            node,
            "gpushare.example.com",
            &infos,
            1,
            gpushare_dra_plugin::slice::Unhealthy::Taint,
        ))
    }

    fn class() -> HashMap<String, Arc<DeviceClass>> {
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": "gpushare"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpushare.example.com\""}}]}
        }))
        .unwrap();
        HashMap::from([("gpushare".to_owned(), Arc::new(class))])
    }

    fn claim(name: &str, memory: Option<&str>) -> ResourceClaim {
        let mut exactly = json!({"deviceClassName": "gpushare"});
        if let Some(memory) = memory {
            exactly["capacity"] = json!({"requests": {"memory": memory}});
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
        }))
        .unwrap()
    }

    fn allocated(c: &ResourceClaim, allocation: AllocationResult) -> ResourceClaim {
        let mut c = c.clone();
        c.status = Some(ResourceClaimStatus {
            allocation: Some(allocation),
            ..ResourceClaimStatus::default()
        });
        c
    }

    #[test]
    fn shares_a_gpu_in_gib_steps_until_it_is_full() {
        let slices = vec![slice("n1", &[16])];
        let mut usage = Usage::default();
        let mut claims = Vec::new();
        for i in 0..4 {
            let c = claim(&format!("c{i}"), Some("3.5Gi"));
            let a = allocate(&c, "n1", &slices, &class(), &mut usage).unwrap();
            let result = &a.devices.as_ref().unwrap().results.as_ref().unwrap()[0];
            assert_eq!(result.device, "gpu-0");
            assert_eq!(
                result.consumed_capacity.as_ref().unwrap()["memory"].0,
                "4Gi"
            );
            assert!(result.share_id.is_some());
            claims.push(allocated(&c, a));
        }
        let err = allocate(
            &claim("c5", Some("1Gi")),
            "n1",
            &slices,
            &class(),
            &mut usage,
        )
        .unwrap_err();
        assert!(matches!(err, AllocateError::NoFit(_)), "{err}");
        // Rebuilding the usage from the stored claims agrees with the incremental one.
        let rebuilt = Usage::of(&claims);
        let id = DeviceId {
            driver: "gpushare.example.com".into(),
            pool: "n1".into(),
            device: "gpu-0".into(),
        };
        assert_eq!(rebuilt.consumed(&id, "memory"), 16 * GIB);
        assert_eq!(usage.consumed(&id, "memory"), 16 * GIB);
    }

    #[test]
    fn default_and_limits_of_the_policy() {
        let slices = vec![slice("n1", &[8, 16])];
        let mut usage = Usage::default();
        // No memory named: the policy's default, 1 GiB.
        let a = allocate(&claim("d", None), "n1", &slices, &class(), &mut usage).unwrap();
        let r = &a.devices.unwrap().results.unwrap()[0];
        assert_eq!(r.consumed_capacity.as_ref().unwrap()["memory"].0, "1Gi");
        // More than the first GPU's max: first fit moves on to the second.
        let a = allocate(
            &claim("big", Some("12Gi")),
            "n1",
            &slices,
            &class(),
            &mut usage,
        )
        .unwrap();
        assert_eq!(a.devices.unwrap().results.unwrap()[0].device, "gpu-1");
        // Other nodes' slices are not this node's.
        assert!(
            allocate(
                &claim("x", Some("1Gi")),
                "n2",
                &slices,
                &class(),
                &mut usage
            )
            .is_err()
        );
    }

    #[test]
    fn refuses_shapes_it_does_not_implement() {
        let slices = vec![slice("n1", &[16])];
        let mut c = claim("f", None);
        let devices = c.spec.devices.as_mut().unwrap();
        devices.requests.as_mut().unwrap()[0]
            .exactly
            .as_mut()
            .unwrap()
            .allocation_mode = Some("All".to_owned());
        let err = allocate(&c, "n1", &slices, &class(), &mut Usage::default()).unwrap_err();
        assert!(
            matches!(err, AllocateError::Unsupported(ref m) if m.contains("allocationMode All")),
            "{err}"
        );
        let mut missing = claim("m", None);
        missing
            .spec
            .devices
            .as_mut()
            .unwrap()
            .requests
            .as_mut()
            .unwrap()[0]
            .exactly
            .as_mut()
            .unwrap()
            .device_class_name = "nope".to_owned();
        let err = allocate(&missing, "n1", &slices, &class(), &mut Usage::default()).unwrap_err();
        assert!(
            err.to_string().contains("device class nope does not exist"),
            "{err}"
        );
    }

    #[test]
    fn a_tainted_gpu_goes_only_to_requests_that_tolerate_it() {
        let broken = gpushare_contract::GpuInfo {
            index: 0,
            uuid: "GPU-0".to_owned(),
            model: "T4".to_owned(),
            mem_gib: 16,
            healthy: false,
            numa_node: None,
        };
        let mut healthy = broken.clone();
        healthy.index = 1;
        healthy.healthy = true;
        let slices = vec![Arc::new(gpushare_dra_plugin::slice::build(
            "n1",
            "gpushare.example.com",
            &[broken, healthy],
            1,
            gpushare_dra_plugin::slice::Unhealthy::Taint,
        ))];
        let device = |a: AllocationResult| a.devices.unwrap().results.unwrap()[0].device.clone();
        let plain = claim("plain", Some("4Gi"));
        let a = allocate(&plain, "n1", &slices, &class(), &mut Usage::default()).unwrap();
        assert_eq!(device(a), "gpu-1", "the tainted gpu-0 is skipped");
        let mut tolerant = claim("tolerant", Some("4Gi"));
        tolerant
            .spec
            .devices
            .as_mut()
            .unwrap()
            .requests
            .as_mut()
            .unwrap()[0]
            .exactly
            .as_mut()
            .unwrap()
            .tolerations = Some(vec![DeviceToleration {
            key: Some("gpushare.example.com/unhealthy".to_owned()),
            operator: Some("Exists".to_owned()),
            ..DeviceToleration::default()
        }]);
        let a = allocate(&tolerant, "n1", &slices, &class(), &mut Usage::default()).unwrap();
        assert_eq!(device(a), "gpu-0");
        let taint = gpushare_dra_plugin::slice::unhealthy_taint("d");
        let equal = |value: Option<&str>| DeviceToleration {
            key: Some("d/unhealthy".to_owned()),
            value: value.map(str::to_owned),
            ..DeviceToleration::default()
        };
        assert!(tolerates(&equal(None), &taint));
        assert!(!tolerates(&equal(Some("x")), &taint));
        let other_effect = DeviceToleration {
            operator: Some("Exists".to_owned()),
            effect: Some("NoExecute".to_owned()),
            ..DeviceToleration::default()
        };
        assert!(!tolerates(&other_effect, &taint));
    }

    #[test]
    fn the_allocation_names_its_node() {
        let slices = vec![slice("n1", &[16])];
        let c = claim("c", Some("4Gi"));
        let a = allocate(&c, "n1", &slices, &class(), &mut Usage::default()).unwrap();
        assert_eq!(allocated_node(&allocated(&c, a)).as_deref(), Some("n1"));
    }
}
