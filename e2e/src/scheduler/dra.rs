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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpushare_dra_plugin::quantity::{self, GIB};
use k8s_openapi::api::core::v1::{
    Binding, Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference, Pod,
};
use k8s_openapi::api::resource::v1::{
    AllocationResult, CapacityRequestPolicy, Device, DeviceAllocationResult, DeviceAttribute,
    DeviceClass, DeviceRequestAllocationResult, DeviceTaint, DeviceToleration, ResourceClaim,
    ResourceClaimConsumerReference, ResourceClaimStatus, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::resourceclaim;

/// How often a pass runs without any watch event (the backoff of unschedulable pods).
const RETRY: Duration = Duration::from_millis(500);

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
    let unsupported = |what: &str| {
        AllocateError::Unsupported(format!(
            "claim {key}: {what} is not supported by this scheduler"
        ))
    };
    let devices = &claim.spec.devices;
    if devices
        .as_ref()
        .and_then(|d| d.constraints.as_ref())
        .is_some_and(|c| !c.is_empty())
    {
        return Err(unsupported("constraints"));
    }
    let mut local: Vec<&Arc<ResourceSlice>> = slices
        .iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
        .collect();
    local.sort_by_key(|a| a.name_any());
    let mut trial = usage.clone();
    let mut results = Vec::new();
    for request in devices.iter().flat_map(|d| d.requests.iter().flatten()) {
        let Some(exactly) = &request.exactly else {
            return Err(unsupported("firstAvailable"));
        };
        if exactly.admin_access == Some(true) {
            return Err(unsupported("adminAccess"));
        }
        let count = match exactly.allocation_mode.as_deref() {
            None | Some("ExactCount") => exactly.count.unwrap_or(1),
            Some(mode) => return Err(unsupported(&format!("allocationMode {mode}"))),
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
        let mut taken: HashSet<DeviceId> = HashSet::new();
        for _ in 0..count.max(0) {
            let mut chosen = None;
            'devices: for slice in &local {
                'devices_inner: for device in slice.spec.devices.iter().flatten() {
                    let id = DeviceId {
                        driver: slice.spec.driver.clone(),
                        pool: slice.spec.pool.name.clone(),
                        device: device.name.clone(),
                    };
                    if taken.contains(&id)
                        || !all_taints_tolerated(device, exactly.tolerations.as_deref())
                        || !selects(&expressions, &id.driver, device)?
                    {
                        continue;
                    }
                    let shared = device.allow_multiple_allocations == Some(true);
                    if !shared {
                        if trial.in_use(&id) || !requested.is_empty() {
                            continue;
                        }
                        chosen = Some((id, None));
                        break 'devices;
                    }
                    if trial.exclusive.contains(&id) {
                        continue;
                    }
                    let capacities = device.capacity.clone().unwrap_or_default();
                    if requested.keys().any(|name| !capacities.contains_key(*name)) {
                        continue;
                    }
                    let mut consumed = BTreeMap::new();
                    for (name, capacity) in &capacities {
                        let value = quantity::bytes(&capacity.value.0).map_err(|e| {
                            AllocateError::Unsupported(format!("device {}: {e}", device.name))
                        })?;
                        let Some(amount) = consumption(
                            requested.get(name.as_str()).copied(),
                            value,
                            capacity.request_policy.as_ref(),
                        )
                        .map_err(AllocateError::Unsupported)?
                        else {
                            continue 'devices_inner;
                        };
                        if trial.consumed(&id, name).saturating_add(amount) > value {
                            continue 'devices_inner;
                        }
                        consumed.insert(name.clone(), amount);
                    }
                    chosen = Some((id, Some(consumed)));
                    break 'devices;
                }
            }
            let Some((id, consumed)) = chosen else {
                let wanted = requested
                    .iter()
                    .map(|(name, bytes)| format!("{} of {name}", quantity_of(*bytes).0))
                    .collect::<Vec<_>>()
                    .join(", ");
                let wanted = if wanted.is_empty() {
                    "a device".to_owned()
                } else {
                    wanted
                };
                return Err(AllocateError::NoFit(format!(
                    "cannot allocate all claims: no device of class {} has {wanted} free for claim {key}",
                    exactly.device_class_name
                )));
            };
            taken.insert(id.clone());
            match &consumed {
                Some(consumed) => {
                    let entry = trial.consumed.entry(id.clone()).or_default();
                    for (name, amount) in consumed {
                        let slot = entry.entry(name.clone()).or_default();
                        *slot = slot.saturating_add(*amount);
                    }
                }
                None => {
                    trial.exclusive.insert(id.clone());
                }
            }
            results.push(DeviceRequestAllocationResult {
                request: request.name.clone(),
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
            });
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

// ---- The driver: watches, passes, writes ----

/// The stores a pass reads.
#[derive(Clone)]
struct Stores {
    pods: Store<Pod>,
    nodes: Store<Node>,
    claims: Store<ResourceClaim>,
    slices: Store<ResourceSlice>,
    classes: Store<DeviceClass>,
}

/// Schedules pods that use ResourceClaims, and releases claims their pods no longer need.
pub struct DraScheduler {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// A reflector store of every `K`, kept by a task pushed on `tasks` that wakes `notify` on
/// each event and ends with `stop`; `who` names the watcher in warnings. Shared by the
/// in-process control loops (this scheduler, the resourceclaim controller).
pub(crate) fn watch<K>(
    who: &'static str,
    client: &Client,
    notify: &Arc<Notify>,
    stop: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let api: Api<K> = Api::all(client.clone());
    let notify = notify.clone();
    let stop = stop.clone();
    tasks.push(tokio::spawn(async move {
        let stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .reflect(writer);
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                event = stream.next() => match event {
                    Some(Ok(_)) => notify.notify_one(),
                    Some(Err(err)) => tracing::warn!(error = %err, "{who} watch failed"),
                    None => return,
                },
            }
        }
    }));
    store
}

/// Waits for the next pass of a control loop: a watch event, or [`RETRY`] at the latest.
/// `false` once `stop` is cancelled.
pub(crate) async fn next_pass(stop: &CancellationToken, notify: &Notify) -> bool {
    tokio::select! {
        () = stop.cancelled() => false,
        () = notify.notified() => true,
        () = tokio::time::sleep(RETRY) => true,
    }
}

/// Cancels `stop` and waits for every task of a control loop.
pub(crate) async fn stop_tasks(stop: CancellationToken, tasks: Vec<JoinHandle<()>>) {
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
}

impl DraScheduler {
    /// Starts watching and scheduling through `client`.
    pub fn start(client: Client) -> Self {
        let stop = CancellationToken::new();
        let notify = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        let stores = Stores {
            pods: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            nodes: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            claims: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            slices: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            classes: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
        };
        let loop_stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut scheduler = Passes {
                client,
                stores,
                written: HashMap::new(),
            };
            for store in [
                scheduler.stores.pods.wait_until_ready().await.is_ok(),
                scheduler.stores.nodes.wait_until_ready().await.is_ok(),
                scheduler.stores.claims.wait_until_ready().await.is_ok(),
                scheduler.stores.slices.wait_until_ready().await.is_ok(),
                scheduler.stores.classes.wait_until_ready().await.is_ok(),
            ] {
                if !store {
                    return;
                }
            }
            loop {
                scheduler.pass().await;
                if !next_pass(&loop_stop, &notify).await {
                    return;
                }
            }
        }));
        Self { stop, tasks }
    }

    /// Stops every task.
    pub async fn shutdown(self) {
        stop_tasks(self.stop, self.tasks).await;
    }
}

struct Passes {
    client: Client,
    stores: Stores,
    /// Claims as this scheduler last wrote them, until the watch shows that version (the
    /// assume cache: the next pass must not allocate what was just allocated).
    written: HashMap<(String, String), ResourceClaim>,
}

fn rv(claim: &ResourceClaim) -> u64 {
    claim
        .metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn claim_key(claim: &ResourceClaim) -> (String, String) {
    (claim.namespace().unwrap_or_default(), claim.name_any())
}

impl Passes {
    /// The claims as they are now: the store, or what this scheduler wrote if newer.
    fn claims(&mut self) -> HashMap<(String, String), ResourceClaim> {
        let mut claims: HashMap<_, _> = self
            .stores
            .claims
            .state()
            .into_iter()
            .map(|c| (claim_key(&c), (*c).clone()))
            .collect();
        self.written.retain(|key, written| match claims.get(key) {
            Some(stored) if rv(stored) >= rv(written) => false,
            // Deleted since: forget it.
            None => false,
            Some(_) => true,
        });
        for (key, written) in &self.written {
            claims.insert(key.clone(), written.clone());
        }
        claims
    }

    async fn pass(&mut self) {
        self.release().await;
        let mut pods: Vec<Arc<Pod>> = self
            .stores
            .pods
            .state()
            .into_iter()
            .filter(|pod| {
                pod.spec.as_ref().is_some_and(|s| {
                    s.node_name.is_none()
                        && s.resource_claims.as_ref().is_some_and(|c| !c.is_empty())
                }) && pod.metadata.deletion_timestamp.is_none()
            })
            .collect();
        pods.sort_by(|a, b| {
            (
                a.metadata.creation_timestamp.as_ref().map(|t| t.0),
                a.name_any(),
            )
                .cmp(&(
                    b.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    b.name_any(),
                ))
        });
        for pod in pods {
            self.schedule(&pod).await;
        }
    }

    /// As the resourceclaim controller: reservations of pods that are gone or finished are
    /// removed, and a claim reserved for no one is deallocated.
    async fn release(&mut self) {
        let live: HashSet<String> = self
            .stores
            .pods
            .state()
            .iter()
            .filter(|pod| !gpushare_contract::request::pod_is_finished(pod))
            .filter_map(|pod| pod.metadata.uid.clone())
            .collect();
        for (_, claim) in self.claims() {
            let Some(status) = &claim.status else {
                continue;
            };
            let reserved = status.reserved_for.clone().unwrap_or_default();
            let kept: Vec<_> = reserved
                .iter()
                .filter(|r| r.resource != "pods" || live.contains(&r.uid))
                .cloned()
                .collect();
            if kept.len() == reserved.len() && !(kept.is_empty() && status.allocation.is_some()) {
                continue;
            }
            let mut updated = claim.clone();
            updated.status = Some(ResourceClaimStatus {
                allocation: if kept.is_empty() {
                    None
                } else {
                    status.allocation.clone()
                },
                reserved_for: (!kept.is_empty()).then_some(kept),
                devices: status.devices.clone(),
            });
            if let Err(error) = self.write_status(&updated).await {
                tracing::debug!(claim = ?claim_key(&claim), %error, "releasing the claim failed; retrying");
            }
        }
    }

    async fn write_status(&mut self, claim: &ResourceClaim) -> Result<(), String> {
        let (namespace, name) = claim_key(claim);
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let stored = api
            .replace_status(&name, &PostParams::default(), claim)
            .await
            .map_err(kube_message)?;
        self.written.insert(claim_key(&stored), stored);
        Ok(())
    }

    async fn schedule(&mut self, pod: &Pod) {
        let namespace = pod.namespace().unwrap_or_default();
        let pod_key = format!("{namespace}/{}", pod.name_any());
        let claims = self.claims();
        let mut mine = Vec::new();
        for entry in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
        {
            let (name, check_owner) = match resourceclaim::claim_name(pod, entry) {
                Ok(Some(found)) => found,
                // The controller recorded that no claim is needed.
                Ok(None) => continue,
                // As upstream's PreEnqueue: the pod waits, without a condition, until the
                // resourceclaim controller created its claim.
                Err(error @ resourceclaim::ClaimNameError::NotCreatedYet { .. }) => {
                    tracing::debug!(pod = %pod_key, %error, "waiting for the claim");
                    return;
                }
                Err(error) => {
                    self.unschedulable(pod, &error.to_string()).await;
                    return;
                }
            };
            match claims.get(&(namespace.clone(), name.clone())) {
                Some(claim) => {
                    if check_owner && let Err(message) = resourceclaim::is_for_pod(pod, claim) {
                        self.unschedulable(pod, &message).await;
                        return;
                    }
                    mine.push(claim.clone());
                }
                None => {
                    self.unschedulable(pod, &format!("resourceclaim \"{name}\" not found"))
                        .await;
                    return;
                }
            }
        }
        let mut nodes: Vec<Arc<Node>> = self
            .stores
            .nodes
            .state()
            .into_iter()
            .filter(|n| {
                !n.spec
                    .as_ref()
                    .and_then(|s| s.unschedulable)
                    .unwrap_or(false)
            })
            .collect();
        nodes.sort_by_key(|n| n.name_any());
        if let Some(node) = mine.iter().find_map(allocated_node) {
            nodes.retain(|n| n.name_any() == node);
        }
        let slices = self.stores.slices.state();
        let classes: HashMap<String, Arc<DeviceClass>> = self
            .stores
            .classes
            .state()
            .into_iter()
            .map(|c| (c.name_any(), c))
            .collect();
        let base = Usage::of(claims.values());
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        let mut placed = None;
        for node in &nodes {
            let name = node.name_any();
            let mut usage = base.clone();
            let mut allocations = Vec::new();
            let mut failed = None;
            for claim in &mine {
                if claim
                    .status
                    .as_ref()
                    .is_some_and(|s| s.allocation.is_some())
                {
                    allocations.push(None);
                    continue;
                }
                match allocate(claim, &name, &slices, &classes, &mut usage) {
                    Ok(allocation) => allocations.push(Some(allocation)),
                    Err(AllocateError::Unsupported(message)) => {
                        self.unschedulable(pod, &message).await;
                        return;
                    }
                    Err(AllocateError::NoFit(message)) => {
                        failed = Some(message);
                        break;
                    }
                }
            }
            match failed {
                Some(reason) => *reasons.entry(reason).or_default() += 1,
                None => {
                    placed = Some((name, allocations));
                    break;
                }
            }
        }
        let Some((node, allocations)) = placed else {
            let detail = reasons
                .iter()
                .map(|(reason, count)| format!("{count} {reason}"))
                .collect::<Vec<_>>()
                .join(", ");
            self.unschedulable(
                pod,
                &format!("0/{} nodes are available: {detail}.", nodes.len()),
            )
            .await;
            return;
        };
        // PreBind: each claim gets its allocation (if new) and the pod in reservedFor.
        let reference = ResourceClaimConsumerReference {
            api_group: Some(String::new()),
            resource: "pods".to_owned(),
            name: pod.name_any(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
        };
        for (claim, allocation) in mine.iter().zip(allocations) {
            let mut updated = claim.clone();
            let status = updated
                .status
                .get_or_insert_with(ResourceClaimStatus::default);
            if let Some(allocation) = allocation {
                status.allocation = Some(allocation);
            }
            let reserved = status.reserved_for.get_or_insert_with(Vec::new);
            if !reserved.iter().any(|r| r.uid == reference.uid) {
                reserved.push(reference.clone());
            }
            if let Err(error) = self.write_status(&updated).await {
                tracing::info!(pod = %pod_key, claim = ?claim_key(claim), %error, "reserving the claim failed; the pod is retried");
                return;
            }
        }
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(pod.name_any()),
                namespace: Some(namespace.clone()),
                uid: pod.metadata.uid.clone(),
                ..ObjectMeta::default()
            },
            target: ObjectReference {
                kind: Some("Node".to_owned()),
                name: Some(node.clone()),
                ..ObjectReference::default()
            },
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        match api
            .create_subresource::<_, serde_json::Value>(
                "binding",
                &pod.name_any(),
                &PostParams::default(),
                &binding,
            )
            .await
        {
            Ok(_) => tracing::info!(pod = %pod_key, %node, "bound with its claims allocated"),
            Err(error) => {
                tracing::info!(pod = %pod_key, error = %kube_message(error), "binding failed; the claims are released when the pod goes")
            }
        }
    }

    /// Sets `PodScheduled=False`, reason `Unschedulable`, unless already so with `message`.
    async fn unschedulable(&self, pod: &Pod, message: &str) {
        let already = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "PodScheduled" && c.message.as_deref() == Some(message));
        if already {
            return;
        }
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let patch = json!({"status": {"conditions": [{
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": jiff::Timestamp::now().to_string(),
        }]}});
        if let Err(error) = api
            .patch_status(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Strategic(patch),
            )
            .await
        {
            tracing::debug!(pod = %pod.name_any(), error = %kube_message(error), "cannot report why the pod waits");
        }
    }
}

fn kube_message(error: kube::Error) -> String {
    match error {
        kube::Error::Api(status) => status.message,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
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
