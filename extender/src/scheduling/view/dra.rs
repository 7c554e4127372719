//! DRA mode: each node's GPUs from our driver's ResourceSlices, what is booked on them from
//! the allocated ResourceClaims (the capacity each consumed), and a pending pod's request
//! from its claims.
//!
//! Why: in DRA mode kube-scheduler allocates the claims and binds the pod; its allocator is
//! the authority and takes the first device with room on the node it is given. What it does
//! not do is choose the node by what claims leave free on each GPU. The extender does that
//! (filter keeps the best node, prioritize scores), so its view must count what the
//! allocator counts: the devices of the slices, less the `consumedCapacity` of every
//! allocated claim, plus the holds filter makes for the pods whose claims are not allocated
//! yet. A claim is booked in the allocation core as a pod would be, under its own UID
//! (claims and pods never share one), so the fragmentation measure, keep-best and the holds
//! work unchanged.
//!
//! What is not read: claims of other device classes, and requests the extender cannot size
//! (`firstAvailable`, `allocationMode: All`): such a pod is passed on unranked, and
//! kube-scheduler's first fit decides. Nothing here can over-commit a GPU: the extender only
//! narrows the nodes kube-scheduler already found fit.

use std::collections::HashMap;
use std::sync::Arc;

use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::{Gpu, ModelFilter, PodId, PodPlacement, Request};
use gpushare_contract::dra::{COMPUTE, MEMORY, device_index};
use gpushare_contract::quantity::{self, GIB};
use gpushare_contract::request::COMPUTE_PER_GPU;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::View;
use super::facts::pod_host;

/// The names DRA mode reads: our driver's slices and claims of our device class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraNames {
    /// The driver whose ResourceSlices describe the GPUs (`--dra-driver`).
    pub driver: String,
    /// The DeviceClass whose claims are GPU shares (`--dra-device-class`).
    pub device_class: String,
}

/// What a claim asks of our device class: `count` devices of `gib` (and `compute`) each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimAsk {
    /// GiB on each device.
    pub gib: u64,
    /// Percent of each device's compute (0: none asked, none consumed).
    pub compute: u32,
    /// How many devices.
    pub count: u32,
}

/// What the view keeps of a claim.
#[derive(Debug, Clone)]
struct ClaimRecord {
    uid: PodId,
    /// `None`: asks nothing of our class, or nothing the extender can size.
    ask: Option<ClaimAsk>,
}

/// DRA mode's part of the view.
#[derive(Debug, Default)]
pub(super) struct DraState {
    /// Our slices' GPUs, by node then slice name (a node has one slice of ours; the map
    /// keeps any other a driver might publish), so a node's GPUs are read without a scan.
    node_slices: HashMap<Arc<str>, HashMap<String, Vec<Gpu>>>,
    /// The node of each slice, by slice name.
    slice_nodes: HashMap<String, Arc<str>>,
    /// Claims by `namespace/name`.
    claims: HashMap<String, ClaimRecord>,
    /// What each allocated claim books (node, placement), by claim UID: booked again after
    /// a relist of pods rebuilds the allocation core.
    bookings: HashMap<PodId, (Arc<str>, PodPlacement)>,
    slices_synced: bool,
    claims_synced: bool,
}

impl DraState {
    /// Both DRA watches have listed everything.
    pub(super) fn is_synced(&self) -> bool {
        self.slices_synced && self.claims_synced
    }
}

/// GiB of a quantity, rounded up (a claim of 3.5Gi consumes 4 GiB under our request policy).
fn gib_up(quantity: &Quantity) -> Option<u64> {
    let bytes = quantity::bytes(&quantity.0).ok()?;
    u64::try_from(bytes.div_ceil(GIB)).ok()
}

/// A compute capacity in percent of a GPU, rounded up to a whole one as our devices' request
/// policy (step 1) makes kube-scheduler consume it; `None` past [`COMPUTE_PER_GPU`] (a
/// claim no device can take, which the extender does not size).
fn compute_percent(quantity: &Quantity) -> Option<u32> {
    let milli = quantity::milli(&quantity.0).ok()?;
    let percent = u32::try_from(milli.div_ceil(1000)).ok()?;
    (percent <= COMPUTE_PER_GPU).then_some(percent)
}

/// The GPU a device of our slice stands for; `None` for a device without memory capacity.
fn device_gpu(device: &Device) -> Option<Gpu> {
    let attributes = device.attributes.as_ref();
    let attribute = |name: &str| attributes.and_then(|a| a.get(name));
    let index = attribute("index")
        .and_then(|a| a.int)
        .and_then(|i| u32::try_from(i).ok())
        .or_else(|| device_index(&device.name))?;
    let memory = device.capacity.as_ref()?.get(MEMORY)?;
    let total_gib = u64::try_from(quantity::bytes(&memory.value.0).ok()? / GIB).ok()?;
    let healthy = !device
        .taints
        .iter()
        .flatten()
        .any(|taint| matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute"));
    Some(Gpu {
        index,
        uuid: attribute("uuid")
            .and_then(|a| a.string.clone())
            .unwrap_or_default(),
        model: attribute("model")
            .and_then(|a| a.string.clone())
            .unwrap_or_default(),
        total_gib,
        healthy,
        numa: attribute("numaNode").and_then(|a| a.int),
    })
}

/// The `namespace/name` key of an object.
fn object_key(namespace: Option<&str>, name: Option<&str>) -> Option<String> {
    Some(format!("{}/{}", namespace.unwrap_or_default(), name?))
}

impl View {
    /// The DRA names, in DRA mode.
    fn dra_names(&self) -> Option<&DraNames> {
        self.settings.dra.as_ref()
    }

    /// The GPUs our slices give `node` (empty without a slice).
    pub(super) fn dra_gpus(&self, node: &str) -> Vec<Gpu> {
        let mut gpus: Vec<Gpu> = self
            .dra
            .node_slices
            .get(node)
            .into_iter()
            .flat_map(|slices| slices.values().flatten().cloned())
            .collect();
        gpus.sort_by_key(|gpu| gpu.index);
        gpus
    }

    /// Sets `node`'s GPUs from its slices; a node with a slice of ours takes part.
    fn refresh_dra_node(&mut self, node: &str) {
        let gpus = self.dra_gpus(node);
        let eligible = !gpus.is_empty();
        self.cluster.set_node(node, gpus, eligible);
    }

    /// Forgets slice `name`; returns the node it was on.
    fn forget_slice(&mut self, name: &str) -> Option<Arc<str>> {
        let node = self.dra.slice_nodes.remove(name)?;
        if let Some(slices) = self.dra.node_slices.get_mut(&node) {
            slices.remove(name);
            if slices.is_empty() {
                self.dra.node_slices.remove(&node);
            }
        }
        Some(node)
    }

    /// Applies a ResourceSlice from the slice watch (other drivers' are ignored).
    pub fn apply_slice(&mut self, slice: &ResourceSlice) {
        let Some(names) = self.dra_names() else {
            return;
        };
        if slice.spec.driver != names.driver {
            return;
        }
        let (Some(name), Some(node)) = (
            slice.metadata.name.as_deref(),
            slice.spec.node_name.as_deref(),
        ) else {
            return;
        };
        let gpus = slice
            .spec
            .devices
            .iter()
            .flatten()
            .filter_map(device_gpu)
            .collect();
        let node = self.cluster.node_name(node);
        if let Some(old) = self.forget_slice(name)
            && old != node
        {
            self.refresh_dra_node(&old);
        }
        self.dra.slice_nodes.insert(name.to_owned(), node.clone());
        self.dra
            .node_slices
            .entry(node.clone())
            .or_default()
            .insert(name.to_owned(), gpus);
        self.refresh_dra_node(&node);
    }

    /// Applies a slice deletion.
    pub fn delete_slice(&mut self, slice: &ResourceSlice) {
        let Some(name) = slice.metadata.name.as_deref() else {
            return;
        };
        if let Some(node) = self.forget_slice(name) {
            self.refresh_dra_node(&node);
        }
    }

    /// Replaces every slice with a fresh list (after the watch relisted): the listed ones
    /// are applied, and the nodes whose slices all went are set without GPUs.
    pub fn replace_slices(&mut self, slices: &[ResourceSlice]) {
        let before: Vec<Arc<str>> = self.dra.node_slices.keys().cloned().collect();
        self.dra.node_slices.clear();
        self.dra.slice_nodes.clear();
        for slice in slices {
            self.apply_slice(slice);
        }
        for node in before {
            if !self.dra.node_slices.contains_key(&node) {
                self.refresh_dra_node(&node);
            }
        }
        self.dra.slices_synced = true;
        self.mark_synced_at();
    }

    /// What `claim` asks of our device class, when the extender can size it: one request
    /// of our class naming an exact count (1 by default), a memory capacity (1 GiB by
    /// default, as our devices' request policy says) and a compute capacity (none by
    /// default).
    fn claim_ask(&self, claim: &ResourceClaim) -> Option<ClaimAsk> {
        let class = &self.dra_names()?.device_class;
        let requests = claim.spec.devices.as_ref()?.requests.as_ref()?;
        let mut ours = requests.iter().filter_map(|request| {
            let exact = request.exactly.as_ref()?;
            (exact.device_class_name == *class).then_some(exact)
        });
        let exact = ours.next()?;
        if ours.next().is_some()
            || exact
                .allocation_mode
                .as_deref()
                .is_some_and(|m| m != "ExactCount")
        {
            return None;
        }
        let capacity = exact.capacity.as_ref().and_then(|c| c.requests.as_ref());
        let gib = match capacity.and_then(|r| r.get(MEMORY)) {
            Some(quantity) => gib_up(quantity)?,
            None => 1,
        };
        let compute = match capacity.and_then(|r| r.get(COMPUTE)) {
            Some(quantity) => compute_percent(quantity)?,
            None => 0,
        };
        let count = u32::try_from(exact.count.unwrap_or(1)).ok()?;
        (gib > 0 && count > 0).then_some(ClaimAsk {
            gib,
            compute,
            count,
        })
    }

    /// What an allocated claim books on our devices: its node and placement (the capacity it
    /// consumed on each device; a device allocated without a consumed capacity is taken
    /// whole). `None` while it is not allocated on our devices.
    fn claim_booking(&self, claim: &ResourceClaim) -> Option<(Arc<str>, PodPlacement)> {
        let driver = &self.dra_names()?.driver;
        let results = claim
            .status
            .as_ref()?
            .allocation
            .as_ref()?
            .devices
            .as_ref()?
            .results
            .as_ref()?;
        let ours: Vec<_> = results.iter().filter(|r| r.driver == *driver).collect();
        let first = ours.first()?;
        let mut gpus = Vec::with_capacity(ours.len());
        let mut per_gpu = 0;
        let mut compute = 0;
        let mut whole = false;
        for result in ours.iter().filter(|r| r.pool == first.pool) {
            gpus.push(device_index(&result.device)?);
            let consumed = result.consumed_capacity.as_ref();
            match consumed.and_then(|c| c.get(MEMORY)) {
                Some(quantity) => per_gpu = per_gpu.max(gib_up(quantity)?),
                None => whole = true,
            }
            if let Some(quantity) = consumed.and_then(|c| c.get(COMPUTE)) {
                // What the API server accepted is what kube-scheduler counts: a value past
                // the device's capacity is booked as the whole GPU's compute.
                let percent = compute_percent(quantity).unwrap_or(COMPUTE_PER_GPU);
                compute = compute.max(percent);
            }
        }
        let (&gpu, more) = gpus.split_first()?;
        let placement = PodPlacement {
            gpu,
            uuid: Arc::from(""),
            more_gpus: more.iter().map(|&index| (index, Arc::from(""))).collect(),
            pod_gib: per_gpu,
            exclusive: whole,
            pending: Vec::new(),
            assigned: true,
            compute,
        };
        Some((self.cluster.node_name(&first.pool), placement))
    }

    /// Applies a ResourceClaim from the claim watch: what it asks, and what it books once
    /// allocated. The holds of the pods it is reserved for end: the allocation counts now.
    pub fn apply_claim(&mut self, claim: &ResourceClaim) {
        let (Some(key), Some(uid)) = (
            object_key(
                claim.metadata.namespace.as_deref(),
                claim.metadata.name.as_deref(),
            ),
            claim.metadata.uid.as_deref(),
        ) else {
            return;
        };
        let uid = PodId::from(uid);
        let record = ClaimRecord {
            uid: uid.clone(),
            ask: self.claim_ask(claim),
        };
        let booking = self.claim_booking(claim);
        let ask = record.ask;
        match self.dra.claims.insert(key, record) {
            Some(old) if old.uid != uid => self.unbook_claim(&old.uid),
            Some(_) => {}
            // A new claim waiting for its allocation: the demand the fragmentation measure
            // learns from (as a new pending pod in extender mode; the pod's CPU and memory
            // are not on the claim).
            None => {
                if let (Some(ask), None) = (ask, &booking) {
                    self.observe_claim(ask);
                }
            }
        }
        match booking {
            Some((node, placement)) => {
                self.cluster
                    .upsert_pod(uid.clone(), &node, placement.clone());
                self.dra.bookings.insert(uid, (node, placement));
                let consumers = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
                for consumer in consumers.into_iter().flatten() {
                    if consumer.resource == "pods" {
                        self.release_hold(&PodId::from(consumer.uid.as_str()));
                    }
                }
            }
            None => self.unbook_claim(&uid),
        }
    }

    fn observe_claim(&mut self, ask: ClaimAsk) {
        self.cluster
            .observe_arrival((ask.count, ask.gib), false, Host::default(), false);
    }

    fn unbook_claim(&mut self, uid: &PodId) {
        if self.dra.bookings.remove(uid).is_some() {
            self.cluster.remove_pod(uid);
        }
    }

    /// Applies a claim deletion: what it booked is free.
    pub fn delete_claim(&mut self, claim: &ResourceClaim) {
        let Some(key) = object_key(
            claim.metadata.namespace.as_deref(),
            claim.metadata.name.as_deref(),
        ) else {
            return;
        };
        if let Some(record) = self.dra.claims.remove(&key) {
            self.unbook_claim(&record.uid);
        }
    }

    /// Replaces every claim with a fresh list (after the watch relisted).
    pub fn replace_claims(&mut self, claims: &[ResourceClaim]) {
        for uid in std::mem::take(&mut self.dra.bookings).into_keys() {
            self.cluster.remove_pod(&uid);
        }
        self.dra.claims.clear();
        for claim in claims {
            self.apply_claim(claim);
        }
        self.dra.claims_synced = true;
        self.mark_synced_at();
    }

    /// Books the allocated claims again after a relist of pods rebuilt the allocation core.
    pub(super) fn rebook_claims(&mut self) {
        for (uid, (node, placement)) in &self.dra.bookings {
            self.cluster
                .upsert_pod(uid.clone(), node, placement.clone());
        }
    }

    /// The request of a pod in DRA mode, read from its claims; `None` (the pod is passed on
    /// unranked) when it has no claim of our class the extender can size, one the claim
    /// watch has not shown yet, or several (kube-scheduler allocates them all; the extender
    /// ranks one share per pod).
    pub fn dra_request(&self, pod: &Pod) -> Option<Request> {
        let namespace = pod.metadata.namespace.as_deref();
        let generated = pod
            .status
            .as_ref()
            .and_then(|status| status.resource_claim_statuses.as_ref());
        let claim_name = |entry: &k8s_openapi::api::core::v1::PodResourceClaim| {
            entry.resource_claim_name.clone().or_else(|| {
                generated?
                    .iter()
                    .find(|status| status.name == entry.name)?
                    .resource_claim_name
                    .clone()
            })
        };
        let entries = pod
            .spec
            .as_ref()
            .and_then(|spec| spec.resource_claims.as_ref());
        let mut asks = entries
            .into_iter()
            .flatten()
            .filter_map(|entry| object_key(namespace, claim_name(entry).as_deref()))
            .filter_map(|key| self.dra.claims.get(&key)?.ask);
        let ask = asks.next()?;
        if asks.next().is_some() {
            return None;
        }
        let pod_gib = ask.gib * u64::from(ask.count);
        Some(Request {
            pod_gib,
            containers: vec![pod_gib],
            host: pod_host(pod),
            gpus: ask.count,
            exclusive: false,
            models: ModelFilter::default(),
            compute: ask.compute,
        })
    }
}
