//! The workload as the per-node loops read it. Scoring 5,000 nodes reads the workload tens
//! of thousands of times per call, while the workload changes once per arriving pod: so
//! everything that depends only on it (normalized weights, each shape's weight × size, the
//! divisors of each shape's GPU size, CPU and memory, and a table of quotients) is derived
//! here when it changes, in fixed arrays the compiler unrolls, not per node.

use super::divisor::{Divisor, cap, cap_before_after};
use super::{Gang, Host, MAX_GANGS, MAX_SHAPES, Shape};

/// The GPU size of an unused shape entry: larger than any GPU, within [`Divisor`]'s fast
/// range.
const UNUSED_GIB: u64 = u32::MAX as u64;

/// Free amounts up to this many GiB (less one) find their quotients in [`Quotients`]: more
/// than any GPU sold today holds.
pub(super) const QUOTIENT_ROWS: usize = 512;

/// `⌊x / size⌋` for every shape's GPU size and every `x` below [`QUOTIENT_ROWS`]: the per-GPU
/// loops read a row instead of dividing (a scheduling call reads a few rows, thousands of
/// times). Built when the set of GPU sizes changes, shared by the workloads prepared since.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Quotients {
    /// The GPU size of each shape entry ([`UNUSED_GIB`] when unused).
    pub(super) sizes: [u64; MAX_SHAPES],
    /// Row `x`: `⌊x / size⌋` per shape entry.
    pub(super) rows: std::sync::Arc<[[u64; MAX_SHAPES]]>,
}

impl Quotients {
    pub(super) fn new(sizes: [u64; MAX_SHAPES], gib: &[Divisor; MAX_SHAPES]) -> Self {
        let rows = (0..QUOTIENT_ROWS as u64)
            .map(|x| std::array::from_fn(|m| gib[m].div(x)))
            .collect();
        Self { sizes, rows }
    }
}

/// A workload as the per-node loops read it, derived from its shapes whenever they change:
/// fixed arrays, weights normalized to sum to 1, divisors for each shape's GPU size, CPU and
/// memory.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Prepared {
    pub(super) weight: [f64; MAX_SHAPES],
    /// Σ weight: 1, or 0 for an empty workload (up to rounding).
    pub(super) weight_sum: f64,
    /// weight × GPU size: what one pod of the shape fewer costs, in expected GiB.
    pub(super) weighted_gib: [f64; MAX_SHAPES],
    pub(super) gib: [Divisor; MAX_SHAPES],
    /// Each shape's CPU (millicores) and memory (MiB), as divisors.
    pub(super) cpu: [Divisor; MAX_SHAPES],
    pub(super) memory: [Divisor; MAX_SHAPES],
    /// The smallest GPU size: a GPU with less free holds no pod of any shape.
    pub(super) min_gib: u64,
    /// `⌊x / size⌋` of every shape for small `x`: depends on the GPU sizes only.
    pub(super) quotients: Quotients,
    /// The multi-GPU shapes, normalized with the one-GPU ones.
    pub(super) gangs: [PreparedGang; MAX_GANGS],
}

/// A multi-GPU shape as the loops read it. An unused entry needs more GiB than any GPU has,
/// so no node takes one and it costs nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PreparedGang {
    /// GPUs per pod (1 for an unused entry, so that dividing by it is safe).
    pub(super) gpus: u64,
    /// GiB on each GPU.
    pub(super) gib: u64,
    /// Normalized weight.
    pub(super) weight: f64,
    /// weight × GiB in all: what one pod of it fewer costs, in expected GiB.
    pub(super) weighted_gib: f64,
    pub(super) cpu: Divisor,
    pub(super) memory: Divisor,
}

impl PreparedGang {
    const UNUSED: PreparedGang = PreparedGang {
        gpus: 1,
        gib: UNUSED_GIB,
        weight: 0.0,
        weighted_gib: 0.0,
        cpu: Divisor::ZERO,
        memory: Divisor::ZERO,
    };

    /// How many pods of it a node takes with `gpus_free` GPUs that have its GiB free and
    /// `free` CPU and memory.
    #[inline]
    pub(super) fn runs(&self, gpus_free: u64, free: Host) -> u64 {
        cap(
            cap(gpus_free / self.gpus, free.milli_cpu, self.cpu),
            free.memory_mib,
            self.memory,
        )
    }
}

impl Default for Prepared {
    fn default() -> Self {
        Self::new(&[], &[], None)
    }
}

impl Prepared {
    /// Prepares `shapes`; `previous`'s quotient table is reused when the GPU sizes are the
    /// same (weights and CPU means move with every pod, the sizes rarely).
    pub(super) fn new(
        shapes: &[(Shape, f64)],
        gangs: &[(Gang, f64)],
        previous: Option<&Prepared>,
    ) -> Self {
        let total: f64 =
            shapes.iter().map(|(_, w)| w).sum::<f64>() + gangs.iter().map(|(_, w)| w).sum::<f64>();
        let total = if total > 0.0 { total } else { 1.0 };
        let mut prepared = Prepared {
            weight: [0.0; MAX_SHAPES],
            weight_sum: 0.0,
            weighted_gib: [0.0; MAX_SHAPES],
            // Unused entries weigh nothing and hold no pod of any free amount we meet: the
            // loops run over all MAX_SHAPES entries, a fixed length the compiler unrolls.
            gib: [Divisor::new(UNUSED_GIB); MAX_SHAPES],
            cpu: [Divisor::new(0); MAX_SHAPES],
            memory: [Divisor::new(0); MAX_SHAPES],
            min_gib: u64::MAX,
            quotients: Quotients::default(),
            gangs: [PreparedGang::UNUSED; MAX_GANGS],
        };
        for (m, (gang, weight)) in gangs.iter().take(MAX_GANGS).enumerate() {
            prepared.weight_sum += weight / total;
            prepared.gangs[m] = PreparedGang {
                gpus: u64::from(gang.gpus.max(1)),
                gib: gang.shape.gpu_gib,
                weight: weight / total,
                weighted_gib: weight / total * gang.gib() as f64,
                cpu: Divisor::new(gang.shape.host.milli_cpu),
                memory: Divisor::new(gang.shape.host.memory_mib),
            };
        }
        let mut sizes = [UNUSED_GIB; MAX_SHAPES];
        for (m, (shape, weight)) in shapes.iter().take(MAX_SHAPES).enumerate() {
            prepared.weight[m] = weight / total;
            prepared.weight_sum += weight / total;
            prepared.weighted_gib[m] = weight / total * shape.gpu_gib as f64;
            prepared.gib[m] = Divisor::new(shape.gpu_gib);
            prepared.cpu[m] = Divisor::new(shape.host.milli_cpu);
            prepared.memory[m] = Divisor::new(shape.host.memory_mib);
            prepared.min_gib = prepared.min_gib.min(shape.gpu_gib);
            sizes[m] = shape.gpu_gib;
        }
        prepared.quotients = match previous {
            Some(previous) if previous.quotients.sizes == sizes => previous.quotients.clone(),
            _ => Quotients::new(sizes, &prepared.gib),
        };
        prepared
    }

    /// Per shape, `⌊x / size⌋`: a table row for the free amounts GPUs have, a division
    /// beyond.
    #[inline]
    pub(super) fn quotients(&self, x: u64) -> [u64; MAX_SHAPES] {
        match usize::try_from(x)
            .ok()
            .and_then(|x| self.quotients.rows.get(x))
        {
            Some(row) => *row,
            None => std::array::from_fn(|m| self.gib[m].div(x)),
        }
    }

    /// Per shape: how many pods of it a node takes whose GPUs have `slots` for it and
    /// whose host has `free` CPU and memory.
    #[inline]
    pub(super) fn runs(&self, slots: &[u64; MAX_SHAPES], free: Host) -> [u64; MAX_SHAPES] {
        let mut runs = [0; MAX_SHAPES];
        for m in 0..MAX_SHAPES {
            runs[m] = cap(
                cap(slots[m], free.milli_cpu, self.cpu[m]),
                free.memory_mib,
                self.memory[m],
            );
        }
        runs
    }

    /// [`Prepared::runs`] under `free` and under `free_after` at once. The nested caps of
    /// `runs` are `min(slots, cpu cap, memory cap)`, so each resource caps the slots on its
    /// own and the products are shared by the two hosts.
    #[inline]
    pub(super) fn runs_before_after(
        &self,
        slots: &[u64; MAX_SHAPES],
        free: Host,
        free_after: Host,
    ) -> ([u64; MAX_SHAPES], [u64; MAX_SHAPES]) {
        let mut runs = [0; MAX_SHAPES];
        let mut runs_after = [0; MAX_SHAPES];
        for m in 0..MAX_SHAPES {
            let cpu = cap_before_after(slots[m], free.milli_cpu, free_after.milli_cpu, self.cpu[m]);
            let memory = cap_before_after(
                slots[m],
                free.memory_mib,
                free_after.memory_mib,
                self.memory[m],
            );
            runs[m] = cpu.0.min(memory.0);
            runs_after[m] = cpu.1.min(memory.1);
        }
        (runs, runs_after)
    }
}
