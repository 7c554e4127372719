//! Dynamic Resource Allocation for the in-process cluster: what kube-scheduler's
//! DynamicResources plugin and kube-controller-manager's resourceclaim controller (its
//! reservation bookkeeping; claims from templates are [`crate::resourceclaim`]'s) do, for
//! the claim shapes gpushare's DRA mode uses. A pod's claims are found as upstream finds them
//! ([`crate::resourceclaim::claim_name`]): a template's claim once the controller recorded
//! it in the pod's status, and only if the pod controls it.
//!
//! ```text
//!  watch Pods, Nodes, ResourceClaims, ResourceSlices, DeviceClasses ──▶ stores ──▶ pass
//!  pass, per pending pod with claims (oldest first):
//!     claims allocated already ─▶ their node only
//!     nodes in name order: allocate every unallocated claim from the node's slices
//!        (first fit, devices in slice order, consumable capacity summed per device)
//!     fit  ─▶ PUT claim status {allocation, reservedFor += pod} ─▶ pods/binding
//!     none ─▶ PodScheduled=False, Unschedulable, with every node's reason
//!  then, as the resourceclaim controller: drop reservations of pods gone or finished;
//!     a claim reserved for no one is deallocated
//! ```
//!
//! Consumable capacity (KEP-5075) as upstream's allocator does it: a device with
//! `allowMultipleAllocations` may serve many requests; a request consumes, per capacity of
//! the device, what it asks for (`capacity.requests`) or else the policy's default (or the
//! whole capacity without a policy), rounded up to the policy (`validRange` min/step/max,
//! `validValues`); the sum over all allocations never exceeds the capacity's value. The
//! allocation records `consumedCapacity` and a `shareID` per result. A device without
//! `allowMultipleAllocations` is allocated at most once. A device with a `NoSchedule` or
//! `NoExecute` taint (KEP-5055) goes only to requests that tolerate it; allocations made
//! before the taint stay (this driver does not evict for `NoExecute`).
//!
//! Refused with a clear message, not half-done: `firstAvailable`, `allocationMode: All`,
//! `adminAccess`, claim `constraints`, slices not bound to one node (`allNodes`, `nodeSelector`, per-device node selection), and
//! CEL selectors that read `device.capacity` (the attributes and the driver are available).
//! Node choice is the first feasible node by name: kube-scheduler's DRA plugin does not score
//! and the default scores (least allocated CPU and memory) do not see devices.
//!
//! This module is the allocation, pure; the control loop that watches, writes the claims'
//! status and binds is `dra_scheduler.rs` ([`DraScheduler`], re-exported here).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use gpushare_dra_plugin::quantity::{self, GIB};
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, CapacityRequestPolicy, Device, DeviceAllocationResult, DeviceAttribute,
    DeviceClass, DeviceRequest, DeviceRequestAllocationResult, DeviceTaint, DeviceToleration,
    ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use serde_json::json;

pub(crate) use super::control_loop::{next_pass, stop_tasks, watch};
pub use super::dra_scheduler::DraScheduler;

/// A device, as allocations name it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    /// The driver.
    pub driver: String,
    /// The pool.
    pub pool: String,
    /// The device.
    pub device: String,
}

/// What the allocated claims hold: capacity consumed per shareable device, and the devices
/// held whole.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    consumed: HashMap<DeviceId, BTreeMap<String, u128>>,
    exclusive: HashSet<DeviceId>,
}

impl Usage {
    /// The usage of every allocated claim in `claims`.
    pub fn of<'a>(claims: impl IntoIterator<Item = &'a ResourceClaim>) -> Self {
        let mut usage = Self::default();
        for claim in claims {
            for result in allocation_results(claim) {
                let id = DeviceId {
                    driver: result.driver.clone(),
                    pool: result.pool.clone(),
                    device: result.device.clone(),
                };
                match &result.consumed_capacity {
                    Some(consumed) => {
                        let entry = usage.consumed.entry(id).or_default();
                        for (name, value) in consumed {
                            // A stored allocation with an unreadable quantity counts as the
                            // largest possible use: never over-commit on bad data.
                            let bytes = quantity::bytes(&value.0).unwrap_or(u128::MAX);
                            let slot = entry.entry(name.clone()).or_default();
                            *slot = slot.saturating_add(bytes);
                        }
                    }
                    None => {
                        usage.exclusive.insert(id);
                    }
                }
            }
        }
        usage
    }

    /// Bytes (or units) of `capacity` consumed on `device`.
    pub fn consumed(&self, device: &DeviceId, capacity: &str) -> u128 {
        self.consumed
            .get(device)
            .and_then(|c| c.get(capacity))
            .copied()
            .unwrap_or(0)
    }

    fn in_use(&self, device: &DeviceId) -> bool {
        self.exclusive.contains(device) || self.consumed.contains_key(device)
    }
}

fn allocation_results(claim: &ResourceClaim) -> &[DeviceRequestAllocationResult] {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or(&[])
}

/// Why a claim could not be allocated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// The claim asks for something this scheduler does not implement.
    #[error("{0}")]
    Unsupported(String),
    /// Not on this node.
    #[error("{0}")]
    NoFit(String),
}

/// The amount of a capacity a request consumes on a device, rounded to the device's
/// policy; `None` when the policy cannot be met.
fn consumption(
    requested: Option<u128>,
    value: u128,
    policy: Option<&CapacityRequestPolicy>,
) -> Result<Option<u128>, String> {
    let parse = |q: &Quantity| quantity::bytes(&q.0).map_err(|e| e.to_string());
    let Some(policy) = policy else {
        return Ok(Some(requested.unwrap_or(value)));
    };
    let default = policy.default.as_ref().map(parse).transpose()?;
    let mut amount = match (requested, default) {
        (Some(r), _) => r,
        (None, Some(d)) => d,
        (None, None) => value,
    };
    if let Some(values) = &policy.valid_values {
        let mut valid = values.iter().map(parse).collect::<Result<Vec<_>, _>>()?;
        valid.sort_unstable();
        return Ok(valid.into_iter().find(|v| *v >= amount));
    }
    if let Some(range) = &policy.valid_range {
        let min = parse(&range.min)?;
        amount = amount.max(min);
        if let Some(step) = range
            .step
            .as_ref()
            .map(parse)
            .transpose()?
            .filter(|s| *s > 0)
        {
            amount = min.saturating_add((amount - min).div_ceil(step).saturating_mul(step));
        }
        if let Some(max) = range.max.as_ref().map(parse).transpose()?
            && amount > max
        {
            return Ok(None);
        }
    }
    Ok(Some(amount))
}

/// `bytes` as a quantity: whole GiB as `NGi`, else plain units.
pub fn quantity_of(bytes: u128) -> Quantity {
    if bytes > 0 && bytes.is_multiple_of(GIB) {
        Quantity(format!("{}Gi", bytes / GIB))
    } else {
        Quantity(bytes.to_string())
    }
}

fn cel_attribute(value: &DeviceAttribute) -> serde_json::Value {
    if let Some(s) = &value.string {
        json!(s)
    } else if let Some(i) = value.int {
        json!(i)
    } else if let Some(b) = value.bool {
        json!(b)
    } else if let Some(v) = &value.version {
        json!(v)
    } else {
        serde_json::Value::Null
    }
}

/// The `device` variable CEL selectors see: driver and attributes by domain (an unqualified
/// attribute is in the driver's domain), as upstream.
fn cel_device(driver: &str, device: &Device) -> serde_json::Value {
    let mut domains: BTreeMap<String, serde_json::Map<String, serde_json::Value>> = BTreeMap::new();
    for (name, value) in device.attributes.iter().flatten() {
        let (domain, id) = name.split_once('/').unwrap_or((driver, name));
        domains
            .entry(domain.to_owned())
            .or_default()
            .insert(id.to_owned(), cel_attribute(value));
    }
    json!({"driver": driver, "attributes": domains})
}

fn selects(expressions: &[&str], driver: &str, device: &Device) -> Result<bool, AllocateError> {
    if expressions.is_empty() {
        return Ok(true);
    }
    let mut context = cel::Context::default();
    let value = cel::to_value(cel_device(driver, device))
        .map_err(|e| AllocateError::Unsupported(format!("device {}: {e}", device.name)))?;
    context.add_variable_from_value("device", value);
    for expression in expressions {
        if expression.contains("device.capacity") {
            return Err(AllocateError::Unsupported(format!(
                "CEL selector {expression:?} reads device.capacity, which this scheduler does not offer; request capacity with capacity.requests instead"
            )));
        }
        let program = cel::Program::compile(expression).map_err(|e| {
            AllocateError::Unsupported(format!("CEL selector {expression:?} does not compile: {e}"))
        })?;
        match program.execute(&context) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => return Ok(false),
            Ok(other) => {
                return Err(AllocateError::Unsupported(format!(
                    "CEL selector {expression:?} gave {other:?}, not a bool"
                )));
            }
            Err(e) => {
                return Err(AllocateError::Unsupported(format!(
                    "CEL selector {expression:?} failed on device {}: {e}",
                    device.name
                )));
            }
        }
    }
    Ok(true)
}

/// Upstream's `resourceclaim.ToleratesTaint`.
fn tolerates(toleration: &DeviceToleration, taint: &DeviceTaint) -> bool {
    if toleration
        .effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
        || toleration
            .key
            .as_deref()
            .is_some_and(|k| !k.is_empty() && k != taint.key)
    {
        return false;
    }
    match toleration.operator.as_deref() {
        None | Some("" | "Equal") => {
            toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        Some("Exists") => true,
        Some(_) => false,
    }
}

/// Whether a request with `tolerations` may get `device` (KEP-5055 device taints, beta in
/// 1.36): every `NoSchedule` or `NoExecute` taint must be tolerated. Other effects (`None`,
/// and unknown ones, which the API says to treat like `None`) keep no claim away.
fn all_taints_tolerated(device: &Device, tolerations: Option<&[DeviceToleration]>) -> bool {
    device
        .taints
        .iter()
        .flatten()
        .filter(|taint| matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute"))
        .all(|taint| {
            tolerations
                .unwrap_or_default()
                .iter()
                .any(|t| tolerates(t, taint))
        })
}

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

/// How an allocation holds a device: whole, or a share consuming some of its capacities.
enum Hold {
    Whole,
    Share(BTreeMap<String, u128>),
}

impl Usage {
    /// Counts `hold` of `id` as used.
    fn hold(&mut self, id: &DeviceId, hold: &Hold) {
        match hold {
            Hold::Share(consumed) => {
                let entry = self.consumed.entry(id.clone()).or_default();
                for (name, amount) in consumed {
                    let slot = entry.entry(name.clone()).or_default();
                    *slot = slot.saturating_add(*amount);
                }
            }
            Hold::Whole => {
                self.exclusive.insert(id.clone());
            }
        }
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

/// How `device` (`id`) can serve a request for `requested` beside `trial`: whole when it is
/// not shareable and unused (and nothing is requested of its capacity), else a share when
/// every capacity has room for the request rounded to its policy; `None` when it cannot.
fn fit(
    device: &Device,
    id: &DeviceId,
    requested: &BTreeMap<&str, u128>,
    trial: &Usage,
) -> Result<Option<Hold>, AllocateError> {
    let shared = device.allow_multiple_allocations == Some(true);
    if !shared {
        if trial.in_use(id) || !requested.is_empty() {
            return Ok(None);
        }
        return Ok(Some(Hold::Whole));
    }
    if trial.exclusive.contains(id) {
        return Ok(None);
    }
    let capacities = device.capacity.clone().unwrap_or_default();
    if requested.keys().any(|name| !capacities.contains_key(*name)) {
        return Ok(None);
    }
    let mut consumed = BTreeMap::new();
    for (name, capacity) in &capacities {
        let value = quantity::bytes(&capacity.value.0)
            .map_err(|e| AllocateError::Unsupported(format!("device {}: {e}", device.name)))?;
        let Some(amount) = consumption(
            requested.get(name.as_str()).copied(),
            value,
            capacity.request_policy.as_ref(),
        )
        .map_err(AllocateError::Unsupported)?
        else {
            return Ok(None);
        };
        if trial.consumed(id, name).saturating_add(amount) > value {
            return Ok(None);
        }
        consumed.insert(name.clone(), amount);
    }
    Ok(Some(Hold::Share(consumed)))
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

    use super::*;

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
