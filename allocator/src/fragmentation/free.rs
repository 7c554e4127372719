//! A node as the measure reads it. The allocator hands the measure a node two ways: GPU by
//! GPU through a closure ([`NodeFree`], for any node), or as the healthy GPUs grouped by free
//! amount ([`FreeSummary`], kept per node and updated when its bookings change), because a
//! node's GPUs rarely differ in more than a few ways and scoring thousands of nodes should
//! read a few amounts per node, not walk every GPU.

use super::Host;

/// A node as the measure reads it: each GPU's free and total GiB (`None`: unhealthy, neither
/// usable nor a fragment) and the host's free CPU and memory.
#[derive(Debug, Clone, Copy)]
pub struct NodeFree<F> {
    /// Number of GPUs.
    pub gpus: usize,
    /// Free and total GiB of GPU `i`, `None` when it takes no pods.
    pub free: F,
    /// Free CPU and memory of the host.
    pub host: Host,
}

/// The most distinct free amounts a [`FreeSummary`] keeps: every node of eight GPUs or fewer
/// fits, and larger ones do unless their GPUs differ in more than eight ways.
pub(super) const DISTINCT: usize = 8;

/// A node's healthy GPUs grouped by free amount: all the measure reads of them. The
/// allocator keeps one per node, updated when the node's bookings or GPUs change, so that
/// scoring thousands of nodes reads a few amounts per node instead of walking every GPU.
///
/// ```text
///   GPUs free 12 | 12 | 4 | 12 (of 16 each)  →  12 × 3 (first GPU 0), 4 × 1 (first GPU 2)
/// ```
///
/// Exact: the slots of a shape are `Σ ⌊free / size⌋` over GPUs, which is `Σ count × ⌊amount
/// / size⌋` over amounts; a GPU's goodness depends only on its free amount, and the first GPU
/// of an amount is the one the per-GPU choice would keep on a tie.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FreeSummary {
    /// Free GiB over healthy GPUs.
    pub(super) total_free: u64,
    /// GiB of all healthy GPUs, for the fullness tie-break.
    pub(super) total_gib: u64,
    /// The largest free GiB of a healthy GPU, `None` when the node has none.
    pub(super) max_free: Option<u64>,
    /// Distinct amounts kept, in the order of their first GPU.
    len: u8,
    /// A ninth distinct amount was seen: the amounts are incomplete.
    overflow: bool,
    free: [u64; DISTINCT],
    count: [u32; DISTINCT],
    first: [u32; DISTINCT],
}

impl FreeSummary {
    /// Reads `gpus` GPUs through `free` (free and total GiB, `None` when unhealthy).
    pub fn new<F: Fn(usize) -> Option<(u64, u64)>>(gpus: usize, free: F) -> Self {
        let mut summary = Self::default();
        for i in 0..gpus {
            if let Some((free, total)) = free(i) {
                summary.add(i, free, total);
            }
        }
        summary
    }

    #[inline]
    fn add(&mut self, gpu: usize, free: u64, total: u64) {
        self.total_gib = self.total_gib.saturating_add(total);
        self.total_free = self.total_free.saturating_add(free);
        self.max_free = Some(self.max_free.map_or(free, |max| max.max(free)));
        let len = usize::from(self.len);
        if let Some(k) = self.free[..len].iter().position(|&f| f == free) {
            self.count[k] = self.count[k].saturating_add(1);
            return;
        }
        match u32::try_from(gpu) {
            Ok(gpu) if len < DISTINCT => {
                self.free[len] = free;
                self.count[len] = 1;
                self.first[len] = gpu;
                self.len += 1;
            }
            _ => self.overflow = true,
        }
    }

    /// Whether every free amount is kept: false for a node whose GPUs differ in more than
    /// eight ways, which the measure then reads GPU by GPU ([`best_gpu`](super::best_gpu)).
    pub fn is_complete(&self) -> bool {
        !self.overflow
    }

    /// Each distinct free amount with its first GPU and how many GPUs have it.
    pub(super) fn amounts(&self) -> impl Iterator<Item = (usize, u64, u32)> + Clone + '_ {
        let len = usize::from(self.len);
        self.first[..len]
            .iter()
            .zip(&self.free[..len])
            .zip(&self.count[..len])
            .map(|((&gpu, &free), &count)| (gpu as usize, free, count))
    }
}
