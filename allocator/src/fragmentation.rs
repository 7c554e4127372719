//! Fragmentation-aware placement: choose the node and GPU that leave the cluster's free GPU
//! memory most usable by the pods that typically arrive, CPU and memory included.
//!
//! The idea is FGD's (Weng et al., "Beware of Fragmentation", USENIX ATC'23): measure how much
//! of a node's free GPU memory the typical pods could not use, and place each pod where that
//! measure grows the least. Our measure counts, per typical shape, how many such pods the
//! node could still take, limited by its GPUs *and* by its free CPU and memory:
//!
//! ```text
//!   node: GPUs free 16 | 6 | 2 GiB (24 in all), host free 10 cores / 40 GiB
//!   shape 4 GiB + 2 cores:   GPUs take ⌊16/4⌋+⌊6/4⌋ = 5, host takes 5  → uses 20, lost  4
//!   shape 4 GiB + 8 cores:   GPUs take 5, host takes only 1            → uses  4, lost 20
//!   shape 20 GiB:            no GPU has 20 free                        → lost 24
//!   F(node) = Σ over shapes  weight × lost(shape)      (GiB, an expectation)
//! ```
//!
//! A pod goes where its placement raises `F` the least (or lowers it the most); within the
//! node, onto the GPU that does. GPUs stranded behind an exhausted host count as lost, so a
//! placement that would strand them is avoided, and so is one that splits a GPU a typical
//! large pod needs whole.
//!
//! Where we differ from FGD, each measured on the generated clusters of `perf/`
//! (`realistic-sim`):
//! - FGD counts a GPU as fragmented for a shape only when it is too small for one pod of it,
//!   and a node as usable when it fits one pod; we count the pods the node can really take
//!   (GPU slots, CPU and memory together), so a node with 4 free GPUs and CPU for one pod
//!   shows 3 GPUs lost.
//! - FGD is given the task distribution; we learn it online ([`Workload::observe`]): a
//!   decaying histogram of at most [`MAX_SHAPES`] GPU sizes, each with the mean CPU and
//!   memory of its pods, weighted by GPU memory (the measure is in GiB, so a size matters
//!   by the GiB it brings, not by its pod count).
//! - Multi-GPU jobs are shapes of their own ([`Gang`], at most [`MAX_GANGS`], learned by
//!   [`Workload::observe_gang`] on the same scale): a node takes `⌊GPUs with the job's GiB
//!   free / its GPUs⌋` of them, capped by its host, and loses every free GiB to the job
//!   when it takes none. So a small pod on an 8-GPU node that still holds an 8-GPU job whole
//!   costs that job, and goes where it costs nothing. On the trace's multigpu50 mix this
//!   lifted the chart's default from 94.2 to 95.6 % (on the generator as it drew multi-GPU
//!   jobs before 2026-11-29; docs/performance.md).
//! - Among placements that change `F` equally, the fuller node and then the fuller GPU win,
//!   so ties pack instead of scattering.
//!
//! **Cost.** Per node O(GPUs × shapes), no allocation, no division in the common case.
//! What depends only on the workload is prepared when it changes, not per node: normalized
//! weights, each shape's weight × size, reciprocals of each shape's CPU and memory (a
//! multiply and one correction instead of a division), and, only when the set of GPU sizes
//! changes, a table of `⌊x / size⌋` for every shape and every `x` below 512 GiB. Per node,
//! the allocator keeps a [`FreeSummary`] (its healthy GPUs grouped by free amount), updated
//! when the node's bookings change, so scoring reads one table row per distinct free amount
//! instead of walking the GPUs; the host caps the slots before and after the pod; each
//! distinct free amount that fits is then evaluated once, in O(shapes). When a call scores
//! many nodes, a [`Placing`] prepared once per call (a few µs) holds, per free amount, the
//! slots of each shape the pod's GiB take from a GPU, so an evaluation reads one row of it
//! instead of subtracting two quotient rows; what is the same for every GPU of a node (the
//! host's caps, the fullness tie-break) is computed once per node.
//! `perf/benches/extender_http.rs` times it through the extender at 5,000 nodes × 8 GPUs.
//!
//! The measure is built in layers, one module each, bottom up:
//!
//! ```text
//!   divisor    exact ⌊x / d⌋ by multiplication: the arithmetic every loop below runs on
//!   prepared   the workload as the loops read it: fixed arrays, divisors, quotient table
//!   workload   the shapes learned online from arriving pods (the only state that changes)
//!   free       a node as the measure reads it: GPU by GPU, or grouped by free amount
//!   measure    F(node) and how a placement changes it (Before, Placing)
//!   rank       the best GPU of a node, and relative scores across nodes
//! ```

mod divisor;
mod free;
mod measure;
mod prepared;
mod rank;
mod workload;

#[cfg(test)]
mod fixtures;

pub use free::{FreeSummary, NodeFree};
pub use measure::{Before, Placing};
pub use rank::{best_gpu, best_gpu_among, best_gpu_placing, best_gpu_summarized, relative_scores};
pub use workload::Workload;

/// CPU and memory: what a pod requests, a node has allocatable, or has free.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Host {
    /// CPU in millicores.
    pub milli_cpu: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
}

impl Host {
    /// A node whose CPU and memory are unknown: never the constraint.
    pub const UNLIMITED: Host = Host {
        milli_cpu: u64::MAX,
        memory_mib: u64::MAX,
    };

    /// CPU and memory.
    pub const fn new(milli_cpu: u64, memory_mib: u64) -> Self {
        Self {
            milli_cpu,
            memory_mib,
        }
    }

    /// Whether `need` fits in `self`.
    pub fn fits(self, need: Host) -> bool {
        self.milli_cpu >= need.milli_cpu && self.memory_mib >= need.memory_mib
    }

    /// `self − other`, each floored at zero.
    pub fn saturating_sub(self, other: Host) -> Host {
        Host {
            milli_cpu: self.milli_cpu.saturating_sub(other.milli_cpu),
            memory_mib: self.memory_mib.saturating_sub(other.memory_mib),
        }
    }

    /// `self + other`, each capped.
    pub fn saturating_add(self, other: Host) -> Host {
        Host {
            milli_cpu: self.milli_cpu.saturating_add(other.milli_cpu),
            memory_mib: self.memory_mib.saturating_add(other.memory_mib),
        }
    }
}

/// A pod shape: GPU memory on one GPU, and CPU and memory on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Shape {
    /// GiB on one GPU.
    pub gpu_gib: u64,
    /// CPU and memory.
    pub host: Host,
}

/// The most shapes a [`Workload`] keeps: the measure's cost per node grows with it.
pub const MAX_SHAPES: usize = 8;

/// A multi-GPU pod shape: `gpus` GPUs with `shape.gpu_gib` each, and the pod's CPU and
/// memory. Such a pod needs that many GPUs of one node with its GiB free at once, so a node
/// takes `⌊GPUs with the GiB free / gpus⌋` of them, capped by its host: a placement that
/// drops one of those GPUs below the GiB can cost a whole job, which no one-GPU shape sees.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Gang {
    /// GPUs it needs on one node (2 or more).
    pub gpus: u32,
    /// GiB on each, and the pod's CPU and memory.
    pub shape: Shape,
}

impl Gang {
    /// GiB it asks in all.
    pub fn gib(&self) -> u64 {
        self.shape.gpu_gib.saturating_mul(u64::from(self.gpus))
    }
}

/// The most multi-GPU shapes a [`Workload`] keeps.
pub const MAX_GANGS: usize = 4;
