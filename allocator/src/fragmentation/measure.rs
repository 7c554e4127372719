//! The measure itself: a node's expected fragmentation `F` against the workload, and how a
//! pod's placement on one of its GPUs changes it. [`Before`] is what is read of the node once
//! (its slots and runs per shape), [`Placing`] what is prepared of the pod once (per call,
//! or per node), so that each GPU, or each distinct free amount, costs O(shapes) and no
//! division.

use super::divisor::to_f64;
use super::{FreeSummary, Host, MAX_GANGS, MAX_SHAPES, NodeFree, Workload};

/// What the measure precomputes of a node before trying its GPUs: O(shapes) from its
/// [`FreeSummary`] (O(GPUs × shapes) read GPU by GPU), no heap.
///
/// Per shape, the GiB the node's free GPU memory loses to it is `free − runs × size`, where
/// `runs` is the pods of it the node can still take: its GPUs' slots (`Σ ⌊free / size⌋`,
/// zero exactly when no GPU has `size` free), capped by the pods of it the host's free CPU
/// and memory take (zero exactly when the host cannot take one).
#[derive(Debug, Clone, Copy)]
pub struct Before {
    /// Free GiB over healthy GPUs.
    total_free: u64,
    /// The largest free GiB of a healthy GPU, `None` when the node has none.
    pub(super) max_free: Option<u64>,
    /// Per shape: how many of it the GPUs could take (Σ ⌊free / size⌋).
    slots: [u64; MAX_SHAPES],
    /// Per shape: how many of it the node can take now (slots capped by the host).
    runs: [u64; MAX_SHAPES],
    host: Host,
    /// GiB of all healthy GPUs, for the fullness tie-break.
    total_gib: u64,
    /// Per multi-GPU shape: healthy GPUs with its GiB free.
    gang_free: [u64; MAX_GANGS],
    /// Per multi-GPU shape: how many of it the node can take now.
    gang_runs: [u64; MAX_GANGS],
}

/// What a pod's placement on a node costs each shape, whichever GPU it takes, from
/// [`Before::after_host`]. With `limit` the runs of a shape once the pod's CPU and memory are
/// gone, placing it on a GPU that loses `d` slots of the shape leaves
/// `min(slots − d, limit)` runs: `runs − limit` are lost to the host in any case, and
/// `d − (slots − limit)` more when that is positive.
#[derive(Debug, Clone, Copy)]
pub(super) struct HostCost {
    /// Per shape, `runs − limit`: pods of it lost to the host's CPU and memory.
    lost: [u64; MAX_SHAPES],
    /// Per shape, `slots − limit`: slots the GPU may lose before they cost a pod.
    spare: [u64; MAX_SHAPES],
    /// The host's free CPU and memory once the pod's are gone: what caps the multi-GPU
    /// shapes afterwards.
    host_after: Host,
}

impl Before {
    /// Reads `node` against `workload`, GPU by GPU.
    pub fn new<F: Fn(usize) -> Option<(u64, u64)>>(
        workload: &Workload,
        node: &NodeFree<F>,
    ) -> Self {
        let w = &workload.prepared;
        let mut before = Self::empty(node.host);
        for i in 0..node.gpus {
            let Some((free, total)) = (node.free)(i) else {
                continue;
            };
            before.total_gib = before.total_gib.saturating_add(total);
            before.total_free = before.total_free.saturating_add(free);
            before.max_free = Some(before.max_free.map_or(free, |max| max.max(free)));
            for (count, gang) in before.gang_free.iter_mut().zip(&w.gangs) {
                *count += u64::from(free >= gang.gib);
            }
            if free < w.min_gib {
                continue;
            }
            for (slots, quotient) in before.slots.iter_mut().zip(w.quotients(free)) {
                *slots += quotient;
            }
        }
        before.runs = w.runs(&before.slots, before.host);
        before.gang_runs = before.gang_runs_under(workload, before.host);
        before
    }

    /// Per multi-GPU shape, the pods of it the node takes with `free` CPU and memory.
    fn gang_runs_under(&self, workload: &Workload, free: Host) -> [u64; MAX_GANGS] {
        let gangs = &workload.prepared.gangs;
        std::array::from_fn(|k| gangs[k].runs(self.gang_free[k], free))
    }

    /// Reads a node from its complete `summary` and its host's `free` CPU and memory: one
    /// table row per distinct free amount. With what a pod of `pod` CPU and memory costs it
    /// ([`Before::after_host`]), the host's caps before and after computed together.
    pub(super) fn of_summary(
        workload: &Workload,
        summary: &FreeSummary,
        free: Host,
        pod: Host,
    ) -> (Self, HostCost) {
        let w = &workload.prepared;
        let mut before = Self::empty(free);
        before.total_gib = summary.total_gib;
        before.total_free = summary.total_free;
        before.max_free = summary.max_free;
        for (_, amount, count) in summary.amounts() {
            let count = u64::from(count);
            for (free, gang) in before.gang_free.iter_mut().zip(&w.gangs) {
                *free += if amount >= gang.gib { count } else { 0 };
            }
            if amount < w.min_gib {
                continue;
            }
            for (slots, quotient) in before.slots.iter_mut().zip(w.quotients(amount)) {
                *slots += count * quotient;
            }
        }
        let after = free.saturating_sub(pod);
        let (runs, limits) = w.runs_before_after(&before.slots, free, after);
        before.runs = runs;
        before.gang_runs = before.gang_runs_under(workload, free);
        let cost = before.cost_given(&limits, after);
        (before, cost)
    }

    /// A node with no GPUs and `host` free.
    fn empty(host: Host) -> Self {
        Before {
            total_free: 0,
            max_free: None,
            slots: [0; MAX_SHAPES],
            runs: [0; MAX_SHAPES],
            host,
            total_gib: 0,
            gang_free: [0; MAX_GANGS],
            gang_runs: [0; MAX_GANGS],
        }
    }

    /// The node's expected fragmentation now, in GiB.
    pub fn fragmentation(&self, workload: &Workload) -> f64 {
        let w = &workload.prepared;
        let singles: f64 = (0..MAX_SHAPES)
            .map(|m| {
                let lost = self
                    .total_free
                    .saturating_sub(self.runs[m].saturating_mul(w.gib[m].d));
                w.weight[m] * lost as f64
            })
            .sum();
        let gangs: f64 = (0..MAX_GANGS)
            .map(|k| {
                let gang = &w.gangs[k];
                let used = self.gang_runs[k]
                    .saturating_mul(gang.gpus)
                    .saturating_mul(gang.gib);
                gang.weight * self.total_free.saturating_sub(used) as f64
            })
            .sum();
        singles + gangs
    }

    /// What placing a pod of `host` costs each shape whichever GPU it goes on (see
    /// [`HostCost`]): the same for every GPU of the node, so [`best_gpu`](super::best_gpu)
    /// computes it once.
    pub(super) fn after_host(&self, workload: &Workload, host: Host) -> HostCost {
        // Per shape, an upper bound on the pods of it the node takes afterwards: today's
        // slots, capped by what the host has left; ≤ runs and ≤ slots.
        let after = self.host.saturating_sub(host);
        let limits = workload.prepared.runs(&self.slots, after);
        self.cost_given(&limits, after)
    }

    /// The [`HostCost`] given each shape's runs once the pod's CPU and memory are gone.
    #[inline]
    fn cost_given(&self, limits: &[u64; MAX_SHAPES], host_after: Host) -> HostCost {
        HostCost {
            lost: std::array::from_fn(|m| self.runs[m].saturating_sub(limits[m])),
            spare: std::array::from_fn(|m| self.slots[m].saturating_sub(limits[m])),
            host_after,
        }
    }

    /// Change in expected fragmentation (GiB) if a pod of `need` GiB and `host` goes on a GPU
    /// with `free` GiB free. The caller has checked that it fits.
    pub fn delta(&self, workload: &Workload, free: u64, need: u64, host: Host) -> f64 {
        let cost = self.after_host(workload, host);
        let taken = Placing::new(workload, need, host).taken(free);
        self.delta_with(workload, (free, need), &taken, &cost)
    }

    /// [`Before::delta`] given [`Before::after_host`] and, per shape, the slots the GPU
    /// loses (`taken`, from [`Placing::taken`]). With `lost = free − runs × size` per shape,
    /// the change is `−need` (the pod's GiB leave the free memory) plus `size` per pod of
    /// the shape the node can no longer take: O(shapes). A multi-GPU shape loses a pod when
    /// the GPU (with `free` GiB) drops below its GiB per GPU and the node's GPUs that still
    /// have it no longer make up as many pods, or when the host no longer holds as many.
    #[inline]
    fn delta_with(
        &self,
        workload: &Workload,
        (free, need): (u64, u64),
        taken: &[u64; MAX_SHAPES],
        cost: &HostCost,
    ) -> f64 {
        let w = &workload.prepared;
        let mut delta = -(need as f64) * w.weight_sum;
        for (m, taken) in taken.iter().enumerate() {
            let pods_lost = cost.lost[m] + taken.saturating_sub(cost.spare[m]);
            delta += w.weighted_gib[m] * to_f64(pods_lost);
        }
        for (k, gang) in w.gangs.iter().enumerate() {
            if self.gang_runs[k] == 0 {
                continue;
            }
            let drops = free >= gang.gib && free.saturating_sub(need) < gang.gib;
            let left = self.gang_free[k].saturating_sub(u64::from(drops));
            let pods_lost = self.gang_runs[k].saturating_sub(gang.runs(left, cost.host_after));
            delta += gang.weighted_gib * to_f64(pods_lost);
        }
        delta
    }

    /// How good placing the pod on a GPU with `free` GiB free is: higher is better. The
    /// fragmentation it adds, negated, in GiB; then, worth less than 1/64 GiB of
    /// fragmentation, how full the node's GPUs are afterwards, so that equal changes pack.
    pub fn goodness(&self, workload: &Workload, free: u64, need: u64, host: Host) -> f64 {
        let placing = Placing::new(workload, need, host);
        let cost = self.after_host(workload, host);
        self.goodness_with(&placing, free, &cost, self.fullness_after(need))
    }

    /// How full the node's GPUs are once `need` GiB more are used, from 0 to 1: the same for
    /// every GPU of the node, so computed once per node.
    pub(crate) fn fullness_after(&self, need: u64) -> f64 {
        let used_after = self
            .total_gib
            .saturating_sub(self.total_free.saturating_sub(need));
        if self.total_gib == 0 {
            1.0
        } else {
            used_after as f64 / self.total_gib as f64
        }
    }

    /// [`Before::goodness`] given [`Before::after_host`] and [`Before::fullness_after`].
    #[inline(always)]
    pub(super) fn goodness_with(
        &self,
        placing: &Placing,
        free: u64,
        cost: &HostCost,
        fullness: f64,
    ) -> f64 {
        let workload = placing.workload;
        let fragmentation = if workload.is_empty() {
            0.0
        } else {
            self.delta_with(workload, (free, placing.need), &placing.taken(free), cost)
        };
        -fragmentation + fullness / 64.0
    }
}

/// A pod being scored, as the per-node loops read it: its GPU memory and host needs with
/// its workload, and, when many nodes are scored at once, a table of the slots a GPU loses
/// to it per shape and free amount, built once per scheduling call (a few µs) instead of
/// two quotient rows read and subtracted per evaluation.
#[derive(Debug, Clone)]
pub struct Placing<'w> {
    pub(super) workload: &'w Workload,
    /// GiB on one GPU.
    pub(super) need: u64,
    /// CPU and memory.
    pub(super) host: Host,
    /// Row `free − need`, for `need ≤ free <`
    /// [`QUOTIENT_ROWS`](super::prepared::QUOTIENT_ROWS): per shape,
    /// `⌊free / size⌋ − ⌊(free − need) / size⌋`. Empty when scoring a single node.
    taken: Vec<[u64; MAX_SHAPES]>,
}

impl<'w> Placing<'w> {
    /// A pod of `need` GiB and `host` scored against `workload` on one node: no table.
    pub fn new(workload: &'w Workload, need: u64, host: Host) -> Self {
        Self {
            workload,
            need,
            host,
            taken: Vec::new(),
        }
    }

    /// [`Placing::new`] for scoring many nodes: with the table of slots taken.
    pub fn for_many_nodes(workload: &'w Workload, need: u64, host: Host) -> Self {
        let rows = &workload.prepared.quotients.rows;
        let taken = usize::try_from(need)
            .ok()
            .filter(|&need| need < rows.len())
            .map_or(Vec::new(), |need| {
                rows[need..]
                    .iter()
                    .zip(rows.iter())
                    .map(|(on_gpu, after)| std::array::from_fn(|m| on_gpu[m] - after[m]))
                    .collect()
            });
        Self {
            taken,
            ..Self::new(workload, need, host)
        }
    }

    /// Per shape, the slots a GPU with `free` GiB free loses to the pod: ⌊x / size⌋ grows
    /// with x, so this is ≥ 0. A table row where there is one, two quotient rows beyond.
    /// Inlined into the per-node loop so that the row is read in place, not copied out.
    #[inline(always)]
    fn taken(&self, free: u64) -> [u64; MAX_SHAPES] {
        let row = free
            .checked_sub(self.need)
            .and_then(|after_free| usize::try_from(after_free).ok())
            .and_then(|after_free| self.taken.get(after_free));
        if let Some(row) = row {
            return *row;
        }
        let w = &self.workload.prepared;
        let (on_gpu, after) = (
            w.quotients(free),
            w.quotients(free.saturating_sub(self.need)),
        );
        std::array::from_fn(|m| on_gpu[m].saturating_sub(after[m]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fragmentation::fixtures::{node, shape};

    #[test]
    fn fragments_are_the_memory_a_shape_cannot_use() {
        let workload = Workload::from_shapes([(shape(8, 4), 1.0)]);
        let roomy = Host::new(64_000, 1 << 20);
        // Two 8 GiB pods fit the 16 GiB GPU; the 6 and 2 GiB are lost.
        let before = Before::new(&workload, &node(&[16, 6, 2], roomy));
        assert_eq!(before.fragmentation(&workload), 8.0);
        // CPU for one pod only: 16 of the 24 GiB are lost.
        let one = Before::new(&workload, &node(&[16, 6, 2], Host::new(6_000, 1 << 20)));
        assert_eq!(one.fragmentation(&workload), 16.0);
        // No CPU left for the shape: every free GiB is lost.
        let starved = Before::new(&workload, &node(&[16, 6, 2], Host::new(2_000, 1 << 20)));
        assert_eq!(starved.fragmentation(&workload), 24.0);
    }

    #[test]
    fn a_multi_gpu_shape_counts_the_jobs_a_node_can_still_take_whole() {
        use crate::fragmentation::Gang;
        let gang = Gang {
            gpus: 4,
            shape: shape(16, 8),
        };
        let workload = Workload::from_shapes([(shape(4, 1), 1.0)]).with_gangs([(gang, 1.0)]);
        let roomy = Host::new(64_000, 1 << 20);
        // Four empty GPUs hold one job: nothing is lost to it; with one GPU partly used,
        // the job no longer fits and every free GiB is lost to it (weight one half).
        let whole = Before::new(&workload, &node(&[16, 16, 16, 16], roomy));
        assert_eq!(whole.fragmentation(&workload), 0.0);
        let split = Before::new(&workload, &node(&[16, 16, 16, 12], roomy));
        assert_eq!(split.fragmentation(&workload), 60.0 / 2.0);
        // So a 4 GiB pod keeps the whole node whole: placing it there costs the job's 64 GiB
        // (× its weight), on the split node nothing more than its own GiB.
        let pod = Host::new(1_000, 4_096);
        let on_whole = whole.delta(&workload, 16, 4, pod);
        let on_split = split.delta(&workload, 12, 4, pod);
        assert_eq!(on_whole - on_split, 64.0 / 2.0);
        assert!(whole.goodness(&workload, 16, 4, pod) < split.goodness(&workload, 12, 4, pod));
        // A host too small for the job's CPU loses it as surely as a split GPU.
        let starved = Before::new(
            &workload,
            &node(&[16, 16, 16, 16], Host::new(6_000, 1 << 20)),
        );
        // (The 4 GiB shape: 6 cores take 6 pods, 40 GiB lost, × one half; the job: all 64.)
        assert_eq!(starved.fragmentation(&workload), 40.0 / 2.0 + 64.0 / 2.0);
    }
}
