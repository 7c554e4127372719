//! One node's bookkeeping: its GPUs, the pods booked on them and the totals derived from
//! those pods (GiB used per GPU, the twin rule's pending sizes, the free summary the
//! fragmentation measure reads). Pods are booked and unbooked through [`Node::book`] and
//! [`Node::unbook`] ([`Node::rebook`] replays them all after the GPU list changed), which
//! keep the derived totals equal to what rebuilding them from the pods would give; the
//! decisions that read them live in `decide`, the CPU and memory bookings in `host`.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::HashMap;
use crate::fragmentation::{FreeSummary, Host};
use crate::{Gpu, PodId, PodPlacement};

/// One GPU and the memory booked on it.
///
/// Why the private copies of index, size and health: the decision loop reads those three and
/// `used_gib` for every GPU of every candidate node (40,000 GPUs at 5,000 nodes). Kept together
/// in a 32-byte record, with the descriptive inventory (UUID, model) behind a pointer, a node's
/// eight GPUs fill four cache lines instead of ten; with a cold cache the 5,000-node filter
/// took twice as long the other way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUsage {
    /// The GPU as the inventory describes it.
    pub gpu: Arc<Gpu>,
    /// GiB booked by pods on it; may exceed the total when the watch reports a collision.
    pub used_gib: u64,
    /// Percent of its compute booked (of [`crate::COMPUTE_PER_GPU`]); may exceed it when the
    /// watch reports a collision.
    pub used_compute: u32,
    pub(super) total_gib: u64,
    pub(super) index: u32,
    pub(super) healthy: bool,
}

impl GpuUsage {
    pub(super) fn new(gpu: Gpu) -> Self {
        Self {
            used_gib: 0,
            used_compute: 0,
            total_gib: gpu.total_gib,
            index: gpu.index,
            healthy: gpu.healthy,
            gpu: Arc::new(gpu),
        }
    }

    /// GiB still free (zero when over-booked).
    pub fn free_gib(&self) -> u64 {
        self.total_gib.saturating_sub(self.used_gib)
    }

    /// Percent of compute still free (zero when over-booked).
    pub fn free_compute(&self) -> u32 {
        crate::COMPUTE_PER_GPU.saturating_sub(self.used_compute)
    }

    /// Whether `gib` and `compute` both fit in what is free.
    pub fn has_room(&self, gib: u64, compute: u32) -> bool {
        self.free_gib() >= gib && self.free_compute() >= compute
    }
}

/// A sorted set of GPU indices: which GPUs a pending container's devices come from. The twin
/// rule compares these, not single indices, since a multi-GPU pod's container spans several.
pub type GpuSet = Box<[u32]>;

/// One node: its GPUs and the pods placed on them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Node {
    /// Seen in the node watch (a node known only through its pods is not present).
    pub(super) present: bool,
    /// Carries the participation label.
    pub(super) eligible: bool,
    /// Sorted by index, unique indices.
    pub(super) gpus: Vec<GpuUsage>,
    pub(super) pods: HashMap<PodId, PodPlacement>,
    /// (container size, GPUs it spans) → number of pending containers of that size there.
    pub(super) pending: BTreeMap<(u64, GpuSet), u32>,
    /// Allocatable CPU and memory (`None`: unknown); see [`crate::fragmentation`].
    pub(super) host: Option<Host>,
    /// CPU and memory requested by the pods bound here, GPU pods or not.
    pub(super) host_used: Host,
    /// The same requests as kube-scheduler's LeastAllocated score counts them
    /// ([`crate::kube_scores::non_zero`], pod by pod); what the node holds besides GPU pods.
    pub(super) host_scored: Host,
    /// The healthy GPUs by free amount, as the fragmentation measure reads them: refreshed
    /// whenever `gpus` or their bookings change (see [`Node::refresh_free_summary`]).
    pub(super) free_summary: FreeSummary,
}

impl Node {
    /// Whether the node is in the node watch.
    pub fn is_present(&self) -> bool {
        self.present
    }

    /// Whether the node carries the participation label.
    pub fn is_eligible(&self) -> bool {
        self.eligible
    }

    /// The GPUs, sorted by index.
    pub fn gpus(&self) -> &[GpuUsage] {
        &self.gpus
    }

    /// The pods placed on this node.
    pub fn pods(&self) -> impl Iterator<Item = (&PodId, &PodPlacement)> {
        self.pods.iter()
    }

    /// Number of pending containers per (size, GPUs they span): what the twin rule reads.
    pub fn pending(&self) -> impl Iterator<Item = (u64, &[u32], u32)> + '_ {
        self.pending
            .iter()
            .map(|((size, gpus), &count)| (*size, &**gpus, count))
    }

    pub(super) fn position(&self, gpu: u32) -> Option<usize> {
        self.gpus.binary_search_by_key(&gpu, |g| g.index).ok()
    }

    /// Where memory recorded for GPU `(index, uuid)` sits now: the GPU the UUID names, or,
    /// when either side has no UUIDs, the GPU at the index. `None` when it is not on the node.
    fn slot_of(&self, index: u32, uuid: &str) -> Option<usize> {
        let by_uuid = !uuid.is_empty() && self.gpus.iter().any(|g| !g.gpu.uuid.is_empty());
        if by_uuid {
            self.gpus.iter().position(|g| *g.gpu.uuid == *uuid)
        } else {
            self.position(index)
        }
    }

    /// Where `placement`'s first GPU sits now (see [`Node::slot_of`]).
    fn slot(&self, placement: &PodPlacement) -> Option<usize> {
        self.slot_of(placement.gpu, &placement.uuid)
    }

    /// Where every GPU of `placement` sits now, each once; GPUs gone from the node are
    /// left out.
    pub(super) fn slots(&self, placement: &PodPlacement) -> Vec<usize> {
        let mut slots: Vec<usize> = std::iter::once((placement.gpu, &placement.uuid))
            .chain(
                placement
                    .more_gpus
                    .iter()
                    .map(|(index, uuid)| (*index, uuid)),
            )
            .filter_map(|(index, uuid)| self.slot_of(index, uuid))
            .collect();
        slots.sort_unstable();
        slots.dedup();
        slots
    }

    /// GiB `placement` holds on a GPU of `total_gib`: all of it when exclusive.
    pub(super) fn held(placement: &PodPlacement, total_gib: u64) -> u64 {
        if placement.exclusive {
            placement.pod_gib.max(total_gib)
        } else {
            placement.pod_gib
        }
    }

    /// Percent of compute `placement` holds on each of its GPUs: all of it when exclusive.
    pub(super) fn held_compute(placement: &PodPlacement) -> u32 {
        if placement.exclusive {
            crate::COMPUTE_PER_GPU
        } else {
            placement.compute
        }
    }

    /// The GPU set of `slots` (positions), as the twin rule keys it.
    fn set_of(&self, slots: &[usize]) -> GpuSet {
        let mut set: Vec<u32> = slots.iter().map(|&pos| self.gpus[pos].index).collect();
        set.sort_unstable();
        set.into_boxed_slice()
    }

    pub(super) fn book(&mut self, placement: &PodPlacement) {
        let slots = self.slots(placement);
        if slots.is_empty() {
            return;
        }
        for &pos in &slots {
            let usage = &mut self.gpus[pos];
            let held = Self::held(placement, usage.total_gib);
            usage.used_gib = usage.used_gib.saturating_add(held);
            usage.used_compute = usage
                .used_compute
                .saturating_add(Self::held_compute(placement));
        }
        self.refresh_free_summary();
        let set = self.set_of(&slots);
        for &size in placement.pending_sizes() {
            *self.pending.entry((size, set.clone())).or_default() += 1;
        }
    }

    pub(super) fn unbook(&mut self, placement: &PodPlacement) {
        let slots = self.slots(placement);
        if slots.is_empty() {
            return;
        }
        for &pos in &slots {
            let usage = &mut self.gpus[pos];
            let held = Self::held(placement, usage.total_gib);
            usage.used_gib = usage.used_gib.saturating_sub(held);
            usage.used_compute = usage
                .used_compute
                .saturating_sub(Self::held_compute(placement));
        }
        self.refresh_free_summary();
        let set = self.set_of(&slots);
        for &size in placement.pending_sizes() {
            let key = (size, set.clone());
            if let Some(count) = self.pending.get_mut(&key) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    self.pending.remove(&key);
                }
            }
        }
    }

    /// The GPU holding `placement`'s memory now (its first GPU, see `Node::slot_of`), if it
    /// is on the node.
    pub fn gpu_of(&self, placement: &PodPlacement) -> Option<&GpuUsage> {
        self.slot(placement).map(|pos| &self.gpus[pos])
    }

    /// Every GPU holding `placement`'s memory now, by index.
    pub fn gpus_of(&self, placement: &PodPlacement) -> Vec<&GpuUsage> {
        self.slots(placement)
            .into_iter()
            .map(|pos| &self.gpus[pos])
            .collect()
    }

    /// A copy of the node without its pod records, for trying bookings on (preemption):
    /// the decision reads the per-GPU totals and the pending sizes, never the records, and
    /// copying 80 pods' records per try was most of the cost.
    pub(super) fn scratch(&self) -> Node {
        Node {
            present: self.present,
            eligible: self.eligible,
            gpus: self.gpus.clone(),
            pods: HashMap::default(),
            pending: self.pending.clone(),
            host: self.host,
            host_used: self.host_used,
            host_scored: self.host_scored,
            free_summary: self.free_summary,
        }
    }

    /// Recomputes every derived total from the pods (after the GPU list changed).
    pub(super) fn rebook(&mut self) {
        for usage in &mut self.gpus {
            usage.used_gib = 0;
            usage.used_compute = 0;
        }
        self.pending.clear();
        let pods: Vec<PodPlacement> = self.pods.values().cloned().collect();
        for placement in &pods {
            self.book(placement);
        }
        self.refresh_free_summary();
    }

    /// Healthy GiB in all and booked on this node.
    pub(super) fn healthy_totals(&self) -> (u64, u64) {
        self.gpus
            .iter()
            .filter(|usage| usage.healthy)
            .fold((0, 0), |(total, used), usage| {
                (
                    total.saturating_add(usage.total_gib),
                    used.saturating_add(usage.used_gib.min(usage.total_gib)),
                )
            })
    }
}
