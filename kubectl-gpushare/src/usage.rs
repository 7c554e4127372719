//! Who holds how much GPU memory where, computed from nodes and pods alone.
//!
//! Both `top` and `doctor` read the cluster the way the extender does: a node's GPUs come
//! from the device plugin's inventory annotation (or, before it is published, capacity split
//! evenly over the GPU-count label), and a pod's place from the allocation annotations the
//! extender wrote when it bound the pod. A pod that asks for the resource and is bound but
//! carries no allocation was placed without the extender: it is counted as *pending*,
//! because no GPU was chosen for it.
//!
//! What pods really use comes from the device plugin's usage annotation on the node
//! (`<domain>/v1.usage`, see [`gpushare_contract::usage`]); a node without it (usage not
//! measured there, or not yet) and a pod missing from it have no figure (`None`), not 0.

use std::collections::BTreeMap;

use gpushare_contract::allocation::classic;
use gpushare_contract::usage::{MIB_PER_GIB, NodeMemoryUse};
use gpushare_contract::{GpuInfo, PodAllocation, inventory, pod_request_with};
use k8s_openapi::api::core::v1::{Node, Pod};

/// What to read: the resource name, the annotation domain and the participation label, as
/// the extender reads them.
pub use gpushare_contract::Scope as Settings;

/// One GPU and what is placed on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUsage {
    /// Index on the node.
    pub index: u32,
    /// Product name, empty when unknown.
    pub model: String,
    /// UUID, empty when unknown.
    pub uuid: String,
    /// GiB of memory.
    pub total_gib: u64,
    /// GiB held by pods the extender placed here.
    pub allocated_gib: u64,
    /// Percent of its compute held by pods that asked for compute (`gpu-compute`).
    pub allocated_compute: u32,
    /// False when the device plugin reported the GPU unusable.
    pub healthy: bool,
    /// MiB in use on it, as the device plugin last published; `None`: not measured.
    pub used_mib: Option<u64>,
}

/// Where one pod's GPU memory is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUsage {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// GPU index, or `None` when bound without an allocation (pending).
    pub gpu: Option<u32>,
    /// GiB it holds (or asks for, when pending).
    pub gib: u64,
    /// The scheduler that bound it.
    pub scheduler: String,
    /// MiB its processes use, as the device plugin last published; `None`: not measured.
    pub used_mib: Option<u64>,
    /// MiB the isolation interposer counted for it, where the plugin publishes that beside
    /// the driver's figure; `None`: not published.
    pub counted_mib: Option<u64>,
    /// Percent of the GPU's compute it holds (`gpu-compute`; 0: none asked).
    pub compute: u32,
    /// Percent of its GPUs' time its kernels ran lately, as the interposer measured and the
    /// device plugin published it; `None`: not published.
    pub compute_used: Option<u32>,
}

impl PodUsage {
    /// Whether its processes use more than the GiB it holds.
    pub fn over_share(&self) -> bool {
        self.used_mib
            .is_some_and(|used| used > self.gib.saturating_mul(MIB_PER_GIB))
    }
}

/// One node's GPUs and pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeUsage {
    /// Node name.
    pub name: String,
    /// Internal IP, empty when the node reports none.
    pub ip: String,
    /// Its GPUs, by index.
    pub gpus: Vec<GpuUsage>,
    /// Its GPU pods, by namespace and name.
    pub pods: Vec<PodUsage>,
    /// How the GPU list was obtained.
    pub source: GpuSource,
    /// Whether the device plugin publishes measured GPU memory use on this node.
    pub measured: bool,
    /// Whether it publishes what the interposer counted beside the driver's figures.
    pub counted: bool,
}

/// Where a node's GPU list came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSource {
    /// The device plugin's inventory annotation.
    Inventory,
    /// Capacity split over the GPU-count label (no inventory yet).
    Capacity,
    /// The inventory annotation is present but unreadable (the message says why); the GPUs
    /// shown are the capacity's, which the extender schedules on meanwhile.
    BadInventory(String),
    /// Neither inventory nor capacity.
    None,
    /// DRA mode: the DRA plugin's ResourceSlice (see [`crate::dra`]).
    ResourceSlice,
}

impl NodeUsage {
    /// GiB of pods bound here without an allocation.
    pub fn pending_gib(&self) -> u64 {
        self.pods
            .iter()
            .filter(|p| p.gpu.is_none())
            .map(|p| p.gib)
            .sum()
    }

    /// Total GiB of all GPUs.
    pub fn total_gib(&self) -> u64 {
        self.gpus.iter().map(|g| g.total_gib).sum()
    }

    /// GiB allocated on GPUs plus pending.
    pub fn allocated_gib(&self) -> u64 {
        self.gpus.iter().map(|g| g.allocated_gib).sum::<u64>() + self.pending_gib()
    }
}

/// True when the node takes part or looks like it should: labelled, or advertising the
/// resource, or carrying an inventory.
pub fn is_gpu_node(node: &Node, settings: &Settings) -> bool {
    is_labelled(node, settings)
        || capacity_gib(node, &settings.resource).is_some_and(|gib| gib > 0)
        || node_annotation(node, &settings.keys.node_gpus).is_some()
}

/// True when the node carries the participation label.
pub fn is_labelled(node: &Node, settings: &Settings) -> bool {
    node.metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(&settings.label_key))
        .is_some_and(|v| v == &settings.label_value)
}

/// The node's capacity of `resource` in whole GiB, if it advertises any.
pub fn capacity_gib(node: &Node, resource: &str) -> Option<u64> {
    let quantity = node.status.as_ref()?.capacity.as_ref()?.get(resource)?;
    quantity.0.trim().parse().ok()
}

fn node_annotation<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// True unless the pod has finished (its GPU memory is free again).
pub fn is_active(pod: &Pod) -> bool {
    !gpushare_contract::request::pod_is_finished(pod)
}

/// The node's GPUs as the extender schedules on them ([`inventory::read`]).
fn node_gpus(node: &Node, settings: &Settings) -> (Vec<GpuInfo>, GpuSource) {
    let (gpus, source) = inventory::read(node, &settings.keys, &settings.resource);
    let source = match source {
        inventory::Source::Inventory => GpuSource::Inventory,
        inventory::Source::Capacity => GpuSource::Capacity,
        inventory::Source::Unreadable(error) => GpuSource::BadInventory(error.to_string()),
        inventory::Source::None => GpuSource::None,
    };
    (gpus, source)
}

fn internal_ip(node: &Node) -> String {
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_deref());
    let addresses = addresses.unwrap_or_default();
    addresses
        .iter()
        .find(|a| a.type_ == "InternalIP")
        .or_else(|| addresses.first())
        .map(|a| a.address.clone())
        .unwrap_or_default()
}

/// The device plugin's measured use on `node`, if it publishes a readable one.
fn measured_use(node: &Node, settings: &Settings) -> Option<NodeMemoryUse> {
    NodeMemoryUse::decode(node_annotation(node, &settings.keys.node_usage)?).ok()
}

/// The usage of every GPU node, sorted by name. Pods not asking for the resource, not
/// bound, or finished are ignored.
pub fn cluster_usage(nodes: &[Node], pods: &[Pod], settings: &Settings) -> Vec<NodeUsage> {
    let mut by_node: BTreeMap<String, NodeUsage> = BTreeMap::new();
    // Node → (namespace/name → MiB), from each node's usage annotation: the driver's figures
    // (or the interposer's alone), and the interposer's beside them.
    let mut used_by_pod: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut counted_by_pod: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut compute_by_pod: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
    for node in nodes.iter().filter(|n| is_gpu_node(n, settings)) {
        let Some(name) = node.metadata.name.clone() else {
            continue;
        };
        let measured = measured_use(node, settings);
        if let Some(measured) = &measured {
            used_by_pod.insert(name.clone(), measured.pods.clone());
            counted_by_pod.insert(name.clone(), measured.counted.clone());
            compute_by_pod.insert(name.clone(), measured.compute.clone());
        }
        let row = node_row(node, name.clone(), measured.as_ref(), settings);
        by_node.insert(name, row);
    }
    for pod in pods.iter().filter(|p| is_active(p)) {
        let Some(spec) = pod.spec.as_ref() else {
            continue;
        };
        let Some(usage) = spec.node_name.as_ref().and_then(|n| by_node.get_mut(n)) else {
            continue;
        };
        let Ok(Some(request)) = pod_request_with(pod, &settings.resource, &settings.keys) else {
            continue;
        };
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        // gpushare's allocation, else one Alibaba's classic gpushare placed before the switch
        // (docs/migrating.md): the extender books both.
        let allocation = PodAllocation::from_annotations(&settings.keys, &annotations)
            .ok()
            .flatten()
            .or_else(|| classic::placement(&annotations).map(|c| c.as_allocation()));
        let rows = hold_gpus(&mut usage.gpus, allocation.as_ref(), request.pod_gib);
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let key = format!("{namespace}/{name}");
        let used_mib = used_by_pod
            .get(&usage.name)
            .and_then(|pods| pods.get(&key).copied());
        let counted_mib = counted_by_pod
            .get(&usage.name)
            .and_then(|pods| pods.get(&key).copied());
        let compute_used = compute_by_pod
            .get(&usage.name)
            .and_then(|pods| pods.get(&key).copied());
        let scheduler = spec
            .scheduler_name
            .clone()
            .unwrap_or_else(|| "default-scheduler".to_owned());
        push_pod_rows(
            &mut usage.pods,
            (namespace, name),
            scheduler,
            rows,
            (used_mib, counted_mib),
            (allocation.as_ref().map_or(0, |a| a.compute), compute_used),
        );
    }
    let mut nodes: Vec<NodeUsage> = by_node.into_values().collect();
    for node in &mut nodes {
        node.pods
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    }
    nodes
}

/// The row of GPU node `name`, its GPUs with nothing placed on them yet and their measured
/// use, if the device plugin publishes it (`measured`).
fn node_row(
    node: &Node,
    name: String,
    measured: Option<&NodeMemoryUse>,
    settings: &Settings,
) -> NodeUsage {
    let (gpus, source) = node_gpus(node, settings);
    let gpus = gpus
        .into_iter()
        .map(|gpu| GpuUsage {
            used_mib: measured.and_then(|m| m.gpus.get(&gpu.index).copied()),
            index: gpu.index,
            model: gpu.model,
            uuid: gpu.uuid,
            total_gib: gpu.mem_gib,
            allocated_gib: 0,
            allocated_compute: 0,
            healthy: gpu.healthy,
        })
        .collect();
    NodeUsage {
        name,
        ip: internal_ip(node),
        gpus,
        pods: Vec::new(),
        source,
        measured: measured.is_some(),
        counted: measured.is_some_and(|m| !m.counted.is_empty()),
    }
}

/// Books a pod's `allocation` on the node's `gpus` and returns its rows: one per GPU the pod
/// holds (a multi-GPU pod shows on each of its GPUs), with what it holds there (the whole
/// GPU when exclusive); a GPU missing from the list, or no allocation at all (`requested_gib`
/// pending), gives a row without a GPU. Never empty.
fn hold_gpus(
    gpus: &mut [GpuUsage],
    allocation: Option<&PodAllocation>,
    requested_gib: u64,
) -> Vec<(Option<u32>, u64)> {
    let mut rows: Vec<(Option<u32>, u64)> = Vec::new();
    match allocation {
        Some(a) => {
            for (index, _) in a.gpus() {
                match gpus.iter_mut().find(|g| g.index == index) {
                    Some(gpu) => {
                        let held = if a.exclusive {
                            a.pod_gib.max(gpu.total_gib)
                        } else {
                            a.pod_gib
                        };
                        gpu.allocated_gib += held;
                        gpu.allocated_compute = gpu.allocated_compute.saturating_add(a.compute);
                        rows.push((Some(index), held));
                    }
                    None => rows.push((None, a.pod_gib)),
                }
            }
        }
        None => rows.push((None, requested_gib)),
    }
    rows
}

/// Adds the pod `(namespace, name)`'s `rows` (from [`hold_gpus`]) to `pods`. Its measured
/// use (memory and compute) shows once, on its first GPU's row; its compute share on each.
fn push_pod_rows(
    pods: &mut Vec<PodUsage>,
    (namespace, name): (String, String),
    scheduler: String,
    mut rows: Vec<(Option<u32>, u64)>,
    (used_mib, counted_mib): (Option<u64>, Option<u64>),
    (compute, compute_used): (u32, Option<u32>),
) {
    let (gpu, gib) = rows.remove(0);
    pods.push(PodUsage {
        namespace: namespace.clone(),
        name: name.clone(),
        used_mib,
        counted_mib,
        gpu,
        gib,
        scheduler: scheduler.clone(),
        compute,
        compute_used,
    });
    for (gpu, gib) in rows {
        pods.push(PodUsage {
            namespace: namespace.clone(),
            name: name.clone(),
            used_mib: None,
            counted_mib: None,
            gpu,
            gib,
            scheduler: scheduler.clone(),
            compute,
            compute_used: None,
        });
    }
}
